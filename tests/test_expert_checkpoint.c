/* tests/test_expert_checkpoint.c: checkpoint round trips (weights and
 * optimizer state), every byte flip, header fields with a valid checksum,
 * every truncation, garbage, mismatched configs, atomic replacement. */
#include "test_expert_util.h"

#include <dirent.h>
#include <errno.h>
#include <zlib.h>

#include "expert/block.h"

#define SEED 4242u

static void fix_crc(unsigned char *buf, size_t len)
{
    uint32_t c = (uint32_t)crc32_z(0L, buf, len - 4);
    for (int i = 0; i < 4; i++)
        buf[len - 4 + i] = (unsigned char)(c >> (8 * i));
}

/* A block that has taken 2 AdamW steps, so m, v and steps are non-trivial. */
static expert_block *trained_block(const struct expert_block_config *cfg, uint64_t seed)
{
    expert_block *b = expert_block_create(cfg, seed);
    assert_non_null(b);
    expert_workspace *ws = expert_workspace_create(cfg, 4);
    assert_non_null(ws);
    uint64_t s = seed;
    float *x = tx_alloc((size_t)4 * cfg->in), *dy = tx_alloc((size_t)4 * cfg->out);
    struct expert_optim o;
    expert_optim_default_adamw(&o);
    for (int i = 0; i < 2; i++) {
        tx_fill(x, (size_t)4 * cfg->in, &s, 1.0f);
        tx_fill(dy, (size_t)4 * cfg->out, &s, 1.0f);
        assert_int_equal(expert_block_backward(b, ws, NULL, dy, x, 4, NULL), 0);
        assert_int_equal(expert_block_step(b, &o, NULL), 0);
    }
    free(x);
    free(dy);
    expert_workspace_destroy(&ws);
    return b;
}

static uint32_t params_crc(expert_block *b, uint64_t *version)
{
    struct expert_snapshot s;
    expert_block_snapshot_acquire(b, &s);
    uint32_t c = (uint32_t)crc32_z(0L, (const void *)s.params, expert_block_nparams(b) * 4);
    *version = s.version;
    expert_block_snapshot_release(b, &s);
    return c;
}

static unsigned char *serialize(expert_block *b, int with_optim, size_t *len)
{
    *len = expert_block_serialized_size(b, with_optim);
    unsigned char *buf = malloc(*len);
    assert_non_null(buf);
    assert_int_equal(expert_block_serialize(b, with_optim, buf, *len), (long)*len);
    return buf;
}

static void test_round_trip(void **state)
{
    (void)state;
    struct expert_block_config cfg = { EXPERT_BLOCK_RESFFN, 8, 8, 24 };
    expert_block *a = trained_block(&cfg, SEED);
    expert_block *b = expert_block_create(&cfg, SEED + 1);
    char dir[512], path[600];
    test_tmpdir(dir, sizeof dir, "ckpt");
    snprintf(path, sizeof path, "%s/stage.ckpt", dir);
    assert_int_equal(expert_block_save(a, path, 1), 0);
    assert_int_equal(expert_block_load(b, path), 0);
    uint64_t va, vb;
    assert_int_equal(params_crc(a, &va), params_crc(b, &vb));
    assert_int_equal(va, 2);
    assert_int_equal(vb, 2);
    assert_int_equal(expert_block_steps(b), 2);
    /* Same optimizer state: one more identical step keeps them identical. */
    expert_workspace *ws = expert_workspace_create(&cfg, 2);
    float x[16], dy[16];
    uint64_t s = 3;
    tx_fill(x, 16, &s, 1.0f);
    tx_fill(dy, 16, &s, 1.0f);
    struct expert_optim o;
    expert_optim_default_adamw(&o);
    assert_int_equal(expert_block_backward(a, ws, NULL, dy, x, 2, NULL), 0);
    assert_int_equal(expert_block_backward(b, ws, NULL, dy, x, 2, NULL), 0);
    assert_int_equal(expert_block_step(a, &o, NULL), 0);
    assert_int_equal(expert_block_step(b, &o, NULL), 0);
    assert_int_equal(params_crc(a, &va), params_crc(b, &vb));
    /* Weights only: m/v/steps start afresh on the loading side. */
    assert_int_equal(expert_block_save(a, path, 0), 0);
    assert_int_equal(expert_block_load(b, path), 0);
    assert_int_equal(params_crc(a, &va), params_crc(b, &vb));
    assert_int_equal(expert_block_steps(b), 0);
    /* Replacing leaves no temporary files behind. */
    DIR *d = opendir(dir);
    assert_non_null(d);
    int files = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL)
        if (e->d_name[0] != '.') {
            files++;
            assert_string_equal(e->d_name, "stage.ckpt");
        }
    closedir(d);
    assert_int_equal(files, 1);
    /* I/O errors. */
    char missing[700];
    snprintf(missing, sizeof missing, "%s/nodir/x.ckpt", dir);
    assert_int_equal(expert_block_save(a, missing, 1), -ENOENT);
    assert_int_equal(expert_block_load(a, missing), -ENOENT);
    assert_int_equal(expert_block_load(a, dir), -EBADMSG); /* a directory */
    unsigned char small[16];
    assert_int_equal(expert_block_serialize(a, 1, small, sizeof small), -ENOSPC);
    expert_workspace_destroy(&ws);
    expert_block_destroy(&a);
    expert_block_destroy(&b);
    test_rmtree(dir);
}

/* Every byte, three flip patterns: the checksum (or, for the version field,
 * the version check) must catch each, and the target block must not change. */
static void test_every_byte_flip(void **state)
{
    (void)state;
    struct expert_block_config cfg = { EXPERT_BLOCK_LINEAR, 3, 2, 0 };
    expert_block *a = trained_block(&cfg, SEED);
    expert_block *b = expert_block_create(&cfg, SEED + 7);
    uint64_t v0;
    uint32_t c0 = params_crc(b, &v0);
    for (int with_optim = 0; with_optim < 2; with_optim++) {
        size_t len;
        unsigned char *buf = serialize(a, with_optim, &len);
        const unsigned char pats[3] = { 0x01, 0x80, 0xff };
        for (size_t i = 0; i < len; i++)
            for (int k = 0; k < 3; k++) {
                buf[i] ^= pats[k];
                int rc = expert_block_deserialize(b, buf, len);
                buf[i] ^= pats[k];
                if (rc != -EBADMSG && rc != -EPROTONOSUPPORT)
                    fprintf(stderr, "flip %#x at %zu (optim %d): rc %d\n", pats[k], i, with_optim, rc);
                assert_true(rc == -EBADMSG || rc == -EPROTONOSUPPORT);
            }
        uint64_t v;
        assert_int_equal(params_crc(b, &v), c0);
        assert_int_equal(v, v0);
        assert_int_equal(expert_block_deserialize(b, buf, len), 0); /* intact: loads */
        free(buf);
        expert_block_destroy(&b);
        b = expert_block_create(&cfg, SEED + 7);
    }
    expert_block_destroy(&a);
    expert_block_destroy(&b);
}

/* Header and table bytes changed WITH a valid checksum: the structural checks
 * alone must refuse every one, except the free-valued weight version and
 * step count (bytes 24..39). Data bytes turned into NaN are refused too. */
static void test_header_fields_validated(void **state)
{
    (void)state;
    struct expert_block_config cfg = { EXPERT_BLOCK_HEAD, 4, 3, 0 };
    expert_block *a = trained_block(&cfg, SEED);
    expert_block *b = expert_block_create(&cfg, 1);
    size_t len;
    unsigned char *buf = serialize(a, 1, &len);
    int nt;
    expert_block_tensors(a, &nt, NULL);
    size_t data_off = 64 + 48 * (size_t)nt * 3;
    unsigned char *mod = malloc(len);
    for (size_t i = 0; i < data_off; i++) {
        if (i >= 24 && i < 40)
            continue;
        for (int k = 0; k < 2; k++) {
            memcpy(mod, buf, len);
            mod[i] ^= k ? 0x80 : 0x01;
            fix_crc(mod, len);
            int rc = expert_block_deserialize(b, mod, len);
            if (rc == 0)
                fprintf(stderr, "header byte %zu flip accepted\n", i);
            assert_true(rc == -EBADMSG || rc == -EPROTONOSUPPORT || rc == -ESTALE);
        }
    }
    /* Specific fields give specific errors. */
    memcpy(mod, buf, len);
    mod[8] = 2;                        /* format version */
    assert_int_equal(expert_block_deserialize(b, mod, len), -EPROTONOSUPPORT);
    memcpy(mod, buf, len);
    mod[16] ^= 1;                      /* config hash */
    fix_crc(mod, len);
    assert_int_equal(expert_block_deserialize(b, mod, len), -ESTALE);
    memcpy(mod, buf, len);
    mod[44] ^= 1;                      /* in */
    fix_crc(mod, len);
    assert_int_equal(expert_block_deserialize(b, mod, len), -ESTALE);
    /* A NaN weight with a valid checksum. */
    memcpy(mod, buf, len);
    const float qnan = NAN;
    memcpy(mod + data_off + 8, &qnan, 4);
    fix_crc(mod, len);
    assert_int_equal(expert_block_deserialize(b, mod, len), -EBADMSG);
    /* The free fields do load, and the version is taken from the file. */
    memcpy(mod, buf, len);
    mod[24] = 77;
    mod[25] = 0;
    fix_crc(mod, len);
    assert_int_equal(expert_block_deserialize(b, mod, len), 0);
    assert_int_equal(expert_block_version(b), 77);
    free(mod);
    free(buf);
    expert_block_destroy(&a);
    expert_block_destroy(&b);
}

static void test_truncation_and_garbage(void **state)
{
    (void)state;
    struct expert_block_config cfg = { EXPERT_BLOCK_LINEAR, 5, 3, 0 };
    expert_block *a = trained_block(&cfg, SEED);
    expert_block *b = expert_block_create(&cfg, 2);
    size_t len;
    unsigned char *buf = serialize(a, 1, &len);
    for (size_t n = 0; n < len; n++)
        assert_int_equal(expert_block_deserialize(b, buf, n), -EBADMSG);
    unsigned char *big = calloc(1, len + 1);
    memcpy(big, buf, len);
    assert_int_equal(expert_block_deserialize(b, big, len + 1), -EBADMSG);
    assert_int_equal(expert_block_deserialize(b, NULL, 0), -EBADMSG);
    /* Files: truncated at a few points, and padded. */
    char dir[512], path[600];
    test_tmpdir(dir, sizeof dir, "ckpt-trunc");
    snprintf(path, sizeof path, "%s/t.ckpt", dir);
    const size_t cuts[] = { 0, 1, 8, 63, 64, len / 2, len - 4, len - 1 };
    for (size_t i = 0; i < sizeof cuts / sizeof cuts[0]; i++) {
        test_write_file(path, buf, cuts[i], 0644);
        assert_int_equal(expert_block_load(b, path), -EBADMSG);
    }
    test_write_file(path, big, len + 1, 0644);
    assert_int_equal(expert_block_load(b, path), -EBADMSG);
    /* Garbage with our magic, version and a valid checksum, at random sizes:
     * never a crash, never accepted. */
    uint64_t s = SEED;
    for (int it = 0; it < 2000; it++) {
        size_t n = 68 + (size_t)(tx_rng_next(&s) % (2 * len));
        unsigned char *g = malloc(n);
        for (size_t i = 0; i < n; i++)
            g[i] = (unsigned char)tx_rng_next(&s);
        memcpy(g, "STRLCKPT\x01\0\0\0", 12);
        if (it & 1)
            memcpy(g + 12, buf + 12, 52); /* a valid header on top of garbage */
        fix_crc(g, n);
        int rc = expert_block_deserialize(b, g, n);
        if (rc == 0)
            fprintf(stderr, "garbage accepted, seed %u it %d\n", SEED, it);
        assert_true(rc < 0);
        free(g);
    }
    free(big);
    free(buf);
    expert_block_destroy(&a);
    expert_block_destroy(&b);
    test_rmtree(dir);
}

static void test_mismatched_config(void **state)
{
    (void)state;
    struct expert_block_config c1 = { EXPERT_BLOCK_RESFFN, 8, 8, 16 };
    struct expert_block_config c2 = { EXPERT_BLOCK_RESFFN, 8, 8, 32 };
    expert_block *a = trained_block(&c1, SEED), *b = expert_block_create(&c2, 1);
    size_t len;
    unsigned char *buf = serialize(a, 1, &len);
    assert_int_equal(expert_block_deserialize(b, buf, len), -ESTALE);
    char dir[512], path[600];
    test_tmpdir(dir, sizeof dir, "ckpt-mismatch");
    snprintf(path, sizeof path, "%s/a.ckpt", dir);
    assert_int_equal(expert_block_save(a, path, 1), 0);
    assert_int_equal(expert_block_load(b, path), -ESTALE);
    free(buf);
    expert_block_destroy(&a);
    expert_block_destroy(&b);
    test_rmtree(dir);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_round_trip),
        cmocka_unit_test(test_every_byte_flip),
        cmocka_unit_test(test_header_fields_validated),
        cmocka_unit_test(test_truncation_and_garbage),
        cmocka_unit_test(test_mismatched_config),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
