/* tests/test_expert_checkpoint.c: checkpoint round trips (weights and
 * optimizer state), every byte flip, header fields with a valid checksum,
 * every truncation, garbage, mismatched configs, atomic replacement; the
 * recorded stage (another stage's file is refused, a format-1 file loads
 * with a warning), and removing the temp files of killed writers. */
#include "test_expert_util.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/wait.h>
#include <time.h>
#include <zlib.h>

#include "expert/block.h"
#include "expert/model.h"

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
    assert_int_equal(expert_block_load(b, path, NULL, 0), 0);
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
    assert_int_equal(expert_block_load(b, path, NULL, 0), 0);
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
    assert_int_equal(expert_block_load(a, missing, NULL, 0), -ENOENT);
    assert_int_equal(expert_block_load(a, dir, NULL, 0), -EBADMSG); /* a directory */
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

/* A small model of our own for the stage tests: stages 1 and 2 have the same
 * block config, as fmnist-mlp's ResFFN stages do. */
static const struct expert_block_config tiny_stages[4] = {
    { EXPERT_BLOCK_LINEAR, 4, 8, 0 },
    { EXPERT_BLOCK_RESFFN, 8, 8, 16 },
    { EXPERT_BLOCK_RESFFN, 8, 8, 16 },
    { EXPERT_BLOCK_HEAD, 8, 3, 0 },
};
static const struct expert_model_spec tiny = { "tiny", "test model", 4, tiny_stages, 4, 3 };

static expert_block *tiny_block(int stage, int trained)
{
    expert_block *b = trained ? trained_block(&tiny_stages[stage], SEED + (uint64_t)stage)
                              : expert_block_create(&tiny_stages[stage], 99);
    assert_non_null(b);
    assert_int_equal(expert_block_set_stage(b, &tiny, stage), 0);
    return b;
}

/* Header and table bytes changed WITH a valid checksum: the structural checks
 * alone must refuse every one, except the free-valued weight version and
 * step count (bytes 24..39) and the guard's history (format 4, bytes
 * 220..243: its own test checks what is refused there). Data bytes turned
 * into NaN are refused too.
 * Both for a block that records no stage and one that does (the stage hash
 * and both names are then all checked against each other). */
static void header_fields_case(int staged)
{
    struct expert_block_config cfg = staged ? tiny_stages[3] : (struct expert_block_config){ EXPERT_BLOCK_HEAD, 4, 3, 0 };
    expert_block *a = staged ? tiny_block(3, 1) : trained_block(&cfg, SEED);
    expert_block *b = staged ? tiny_block(3, 0) : expert_block_create(&cfg, 1);
    size_t len;
    unsigned char *buf = serialize(a, 1, &len);
    int nt;
    expert_block_tensors(a, &nt, NULL);
    size_t data_off = 260 + 48 * (size_t)nt * 3;
    unsigned char *mod = malloc(len);
    for (size_t i = 0; i < data_off; i++) {
        if ((i >= 24 && i < 40) || (i >= 220 && i < 244))
            continue;
        for (int k = 0; k < 2; k++) {
            memcpy(mod, buf, len);
            mod[i] ^= k ? 0x80 : 0x01;
            fix_crc(mod, len);
            int rc = expert_block_deserialize(b, mod, len);
            if (rc == 0)
                fprintf(stderr, "header byte %zu flip accepted (staged %d)\n", i, staged);
            assert_true(rc == -EBADMSG || rc == -EPROTONOSUPPORT || rc == -ESTALE);
        }
    }
    /* Specific fields give specific errors. */
    memcpy(mod, buf, len);
    mod[8] = 9;                        /* format version */
    assert_int_equal(expert_block_deserialize(b, mod, len), -EPROTONOSUPPORT);
    memcpy(mod, buf, len);
    mod[16] ^= 1;                      /* config hash: for a stage, no longer its stage hash's */
    fix_crc(mod, len);
    assert_int_equal(expert_block_deserialize(b, mod, len), staged ? -EBADMSG : -ESTALE);
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

static void test_header_fields_validated(void **state)
{
    (void)state;
    header_fields_case(0);
    header_fields_case(1);
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
    const size_t cuts[] = { 0, 1, 8, 63, 64, 199, 259, 260, len / 2, len - 4, len - 1 };
    char msg[512];
    for (size_t i = 0; i < sizeof cuts / sizeof cuts[0]; i++) {
        test_write_file(path, buf, cuts[i], 0644);
        assert_int_equal(expert_block_load(b, path, msg, sizeof msg), -EBADMSG);
        /* The sentence names the file and says which: no header, or a
         * header whose length the file does not have. */
        assert_non_null(strstr(msg, path));
        assert_non_null(strstr(msg, cuts[i] < 260 ? "corrupt: not a checkpoint header" : "truncated or padded"));
    }
    test_write_file(path, big, len + 1, 0644);
    assert_int_equal(expert_block_load(b, path, msg, sizeof msg), -EBADMSG);
    assert_non_null(strstr(msg, "truncated or padded"));
    test_write_file(path, "garbage", 7, 0644);
    assert_int_equal(expert_block_load(b, path, msg, sizeof msg), -EBADMSG);
    assert_non_null(strstr(msg, "not a checkpoint header"));
    /* Whole, but a data byte changed: the checksum says so. */
    buf[len / 2] ^= 4;
    test_write_file(path, buf, len, 0644);
    buf[len / 2] ^= 4;
    assert_int_equal(expert_block_load(b, path, msg, sizeof msg), -EBADMSG);
    assert_non_null(strstr(msg, "checksum or contents do not verify"));
    /* A future format. */
    buf[8] = 9;
    test_write_file(path, buf, len, 0644);
    buf[8] = 2;
    assert_int_equal(expert_block_load(b, path, msg, sizeof msg), -EPROTONOSUPPORT);
    assert_non_null(strstr(msg, "format 9"));
    assert_int_equal(expert_block_load(b, dir, msg, sizeof msg), -EBADMSG);
    assert_non_null(strstr(msg, "not a regular file"));
    /* Garbage with our magic, version and a valid checksum, at random sizes:
     * never a crash, never accepted. */
    uint64_t s = SEED;
    for (int it = 0; it < 2000; it++) {
        size_t n = 68 + (size_t)(tx_rng_next(&s) % (2 * len));
        unsigned char *g = malloc(n);
        for (size_t i = 0; i < n; i++)
            g[i] = (unsigned char)tx_rng_next(&s);
        /* Formats 1 and 2, and a valid header on top of garbage. */
        memcpy(g, (it & 2) ? "STRLCKPT\x02\0\0\0" : "STRLCKPT\x01\0\0\0", 12);
        if (it & 1)
            memcpy(g + 12, buf + 12, (it & 2) && n > 204 ? 188 : 52);
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
    assert_int_equal(expert_block_load(b, path, NULL, 0), -ESTALE);
    free(buf);
    expert_block_destroy(&a);
    expert_block_destroy(&b);
    test_rmtree(dir);
}

static uint32_t le32(const unsigned char *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static void put_le32(unsigned char *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (unsigned char)(v >> (8 * i));
}

/* The same state in format 1 (as the previous build wrote it): the first 64
 * header bytes with version 1, the table with offsets 136 bytes lower (no
 * stage fields), the data, a new CRC. */
/* Format 2 (from a format 2 buffer, or a format 4 one of a block without
 * DiLoCo's outer state: its header's last 60 bytes dropped) or format 1
 * (the stage dropped too), as older builds wrote them. */
static unsigned char *to_format(const unsigned char *src, size_t len, uint32_t want, size_t *len_out)
{
    size_t hl = le32(src + 8) == 4 ? 260 : 200, wl = want == 1 ? 64 : 200, cut = hl - wl;
    *len_out = len - cut;
    unsigned char *o = malloc(*len_out);
    assert_non_null(o);
    memcpy(o, src, wl);
    put_le32(o + 8, want);
    uint32_t ne = le32(src + 60);
    for (uint32_t e = 0; e < ne; e++) {
        unsigned char *q = o + wl + 48 * (size_t)e;
        memcpy(q, src + hl + 48 * (size_t)e, 48);
        uint64_t off = 0;
        for (int i = 0; i < 8; i++)
            off |= (uint64_t)q[32 + i] << (8 * i);
        off -= cut;
        for (int i = 0; i < 8; i++)
            q[32 + i] = (unsigned char)(off >> (8 * i));
    }
    size_t data = hl + 48 * (size_t)ne;
    memcpy(o + wl + 48 * (size_t)ne, src + data, len - 4 - data);
    fix_crc(o, *len_out);
    return o;
}

static unsigned char *to_format1(const unsigned char *v2, size_t len, size_t *len1)
{
    return to_format(v2, len, 1, len1);
}

/* Checkpoints record the model, the stage and its hash; a file of another
 * stage (of the same shape, or not) is refused naming both, and the block
 * is unchanged; the same stage and a block that was never told its stage
 * load it. The same holds for state in memory (a download). */
static void test_stage_recorded(void **state)
{
    (void)state;
    char dir[512], p2[600], p0[600], msg[512];
    test_tmpdir(dir, sizeof dir, "ckpt-stage");
    snprintf(p2, sizeof p2, "%s/tiny.2.ckpt", dir);
    snprintf(p0, sizeof p0, "%s/tiny.0.ckpt", dir);
    expert_block *a = tiny_block(2, 1);
    uint64_t sh;
    assert_string_equal(expert_block_stage(a, &sh), "tiny.2");
    assert_true(sh == expert_stage_hash(&tiny, 2) && sh != 0);
    assert_int_equal(expert_block_save(a, p2, 1), 0);

    /* The header says what the file holds. */
    size_t len;
    unsigned char *buf = serialize(a, 1, &len);
    struct expert_ckpt_info h;
    assert_int_equal(expert_ckpt_peek(buf, len, &h), 0);
    assert_int_equal(h.format, 4);
    assert_string_equal(h.model, "tiny");
    assert_string_equal(h.stage, "tiny.2");
    assert_true(h.stage_hash == expert_stage_hash(&tiny, 2));
    assert_true(h.config_hash == expert_block_config_hash(&tiny_stages[2]));
    assert_true(h.total_len == len && h.with_optim == 1 && h.version == 2 && h.steps == 2);
    assert_int_equal(expert_ckpt_peek(buf, 199, &h), -EBADMSG); /* short of the header */

    /* Stage 1 has the same block config: refused all the same. */
    expert_block *b = tiny_block(1, 0);
    uint64_t v0, v;
    uint32_t c0 = params_crc(b, &v0);
    assert_int_equal(expert_block_load(b, p2, msg, sizeof msg), -ESTALE);
    fprintf(stderr, "refusal: %s\n", msg);
    assert_non_null(strstr(msg, p2));
    assert_non_null(strstr(msg, "holds tiny.2 (stage hash"));
    assert_non_null(strstr(msg, "not tiny.1 (stage hash"));
    assert_int_equal(expert_block_deserialize(b, buf, len), -ESTALE);
    assert_int_equal(params_crc(b, &v), c0);
    assert_true(v == v0);
    /* A file of another shape (stage 0) under stage 2's name: named too. */
    expert_block *z = tiny_block(0, 1);
    assert_int_equal(expert_block_save(z, p0, 0), 0);
    expert_block *b2 = tiny_block(2, 0);
    assert_int_equal(expert_block_load(b2, p0, msg, sizeof msg), -ESTALE);
    assert_non_null(strstr(msg, "holds tiny.0 (stage hash"));
    assert_non_null(strstr(msg, "not tiny.2 (stage hash"));
    /* The right stage loads, with no warning; so does an unnamed block. */
    assert_int_equal(expert_block_load(b2, p2, msg, sizeof msg), 0);
    assert_string_equal(msg, "");
    assert_int_equal(params_crc(b2, &v), params_crc(a, &v0));
    expert_block *anon = expert_block_create(&tiny_stages[2], 5);
    assert_string_equal(expert_block_stage(anon, NULL), "");
    assert_int_equal(expert_block_load(anon, p2, msg, sizeof msg), 0);
    assert_string_equal(msg, "");

    /* An unnamed block's state names no stage: it loads anywhere its config
     * fits, with a warning. */
    assert_int_equal(expert_block_save(anon, p2, 1), 0);
    assert_int_equal(expert_block_load(b, p2, msg, sizeof msg), 0);
    assert_non_null(strstr(msg, "records no stage"));

    /* A stage name changed in the header with a valid checksum no longer
     * matches its stage hash: corrupt, not silently another stage. */
    unsigned char *mod = malloc(len);
    memcpy(mod, buf, len);
    assert_int_equal(memcmp(mod + 136, "tiny.2", 7), 0);
    mod[136 + 5] = '1';
    fix_crc(mod, len);
    assert_int_equal(expert_block_deserialize(b, mod, len), -EBADMSG);
    assert_int_equal(expert_block_deserialize(b2, mod, len), -EBADMSG);

    /* Bad stages. */
    assert_int_equal(expert_block_set_stage(anon, &tiny, 0), -EINVAL); /* another config */
    assert_int_equal(expert_block_set_stage(anon, &tiny, 4), -EINVAL);
    assert_int_equal(expert_block_set_stage(anon, NULL, 2), -EINVAL);
    assert_int_equal(expert_block_set_stage(anon, &tiny, 1), 0);
    assert_string_equal(expert_block_stage(anon, NULL), "tiny.1");

    free(mod);
    free(buf);
    expert_block_destroy(&a);
    expert_block_destroy(&b);
    expert_block_destroy(&b2);
    expert_block_destroy(&z);
    expert_block_destroy(&anon);
    test_rmtree(dir);
}

/* The previous format (1, no stage) is still read: into a block of its
 * config with a warning that names the risk, refused for another config. */
static void test_format1_read(void **state)
{
    (void)state;
    char dir[512], path[600], msg[512];
    test_tmpdir(dir, sizeof dir, "ckpt-v1");
    snprintf(path, sizeof path, "%s/tiny.2.ckpt", dir);
    expert_block *a = tiny_block(2, 1);
    for (int with_optim = 0; with_optim < 2; with_optim++) {
        size_t len, len1;
        unsigned char *buf = serialize(a, with_optim, &len);
        unsigned char *v1 = to_format1(buf, len, &len1);
        struct expert_ckpt_info h;
        assert_int_equal(expert_ckpt_peek(v1, len1, &h), 0);
        assert_int_equal(h.format, 1);
        assert_string_equal(h.stage, "");
        assert_true(h.total_len == len1);
        expert_block *b = tiny_block(2, 0);
        assert_int_equal(expert_block_deserialize(b, v1, len1), 0);
        uint64_t va, vb;
        assert_int_equal(params_crc(b, &vb), params_crc(a, &va));
        assert_true(va == vb);
        assert_int_equal(expert_block_steps(b), with_optim ? 2 : 0);
        expert_block_destroy(&b);
        /* From a file: loads with a warning. */
        test_write_file(path, v1, len1, 0644);
        b = tiny_block(1, 0);
        assert_int_equal(expert_block_load(b, path, msg, sizeof msg), 0);
        fprintf(stderr, "warning: %s\n", msg);
        assert_non_null(strstr(msg, "records no stage (checkpoint format 1)"));
        assert_non_null(strstr(msg, "tiny.1"));
        assert_int_equal(params_crc(b, &vb), params_crc(a, &va));
        expert_block_destroy(&b);
        /* Another config: refused, and said so. */
        b = tiny_block(3, 0);
        assert_int_equal(expert_block_load(b, path, msg, sizeof msg), -ESTALE);
        assert_non_null(strstr(msg, "names no stage"));
        assert_non_null(strstr(msg, "not tiny.3"));
        assert_int_equal(expert_block_deserialize(b, v1, len1), -ESTALE);
        expert_block_destroy(&b);
        /* Every truncation and a flipped byte are still caught. */
        b = tiny_block(2, 0);
        for (size_t n = 0; n < len1; n += 7)
            assert_int_equal(expert_block_deserialize(b, v1, n), -EBADMSG);
        v1[len1 / 2] ^= 0x10;
        assert_int_equal(expert_block_deserialize(b, v1, len1), -EBADMSG);
        expert_block_destroy(&b);
        free(v1);
        free(buf);
    }
    expert_block_destroy(&a);
    test_rmtree(dir);
}

static int exists_in(const char *dir, const char *name)
{
    char p[800];
    struct stat st;
    snprintf(p, sizeof p, "%s/%s", dir, name);
    return stat(p, &st) == 0;
}

static void make_in(const char *dir, const char *name, size_t len, time_t age_s)
{
    char p[800];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    char *junk = calloc(1, len + 1);
    test_write_file(p, junk, len, 0644);
    free(junk);
    if (age_s) {
        struct timespec ts[2];
        clock_gettime(CLOCK_REALTIME, &ts[0]);
        ts[0].tv_sec -= age_s;
        ts[1] = ts[0];
        assert_int_equal(utimensat(AT_FDCWD, p, ts, 0), 0);
    }
}

/* Temp files of killed writers are removed: our pattern, our checkpoint,
 * a writer that is gone; a live writer's (pid alive, or lock held), another
 * checkpoint's and other names are kept. */
static void test_clean_tmp(void **state)
{
    (void)state;
    char dir[512], path[600];
    test_tmpdir(dir, sizeof dir, "ckpt-tmp");
    snprintf(path, sizeof path, "%s/s.ckpt", dir);
    pid_t dead = fork();
    assert_true(dead >= 0);
    if (dead == 0)
        _exit(0);
    assert_int_equal(waitpid(dead, NULL, 0), dead);
    char n_dead[64], n_self[64], n_live[64], n_live_old[64], n_locked[64], n_other[64];
    snprintf(n_dead, sizeof n_dead, "s.ckpt.tmp.%d.aB3xYz", (int)dead);
    snprintf(n_self, sizeof n_self, "s.ckpt.tmp.%d.Qq0000", (int)getpid());
    snprintf(n_live, sizeof n_live, "s.ckpt.tmp.%d.Zz9999", (int)getppid());
    snprintf(n_live_old, sizeof n_live_old, "s.ckpt.tmp.%d.Zz8888", (int)getppid());
    snprintf(n_locked, sizeof n_locked, "s.ckpt.tmp.%d.Lk1234", (int)dead);
    snprintf(n_other, sizeof n_other, "t.ckpt.tmp.%d.aB3xYz", (int)dead);
    make_in(dir, n_dead, 1000, 0);
    make_in(dir, n_self, 300, 0);
    make_in(dir, n_live, 7, 0);
    make_in(dir, n_live_old, 20, EXPERT_CKPT_TMP_STALE_S + 5); /* pid reused, lock free */
    make_in(dir, n_locked, 7, EXPERT_CKPT_TMP_STALE_S + 5);
    make_in(dir, n_other, 7, 0);
    make_in(dir, "s.ckpt.tmp.OLDone", 4, EXPERT_CKPT_TMP_STALE_S + 5); /* an older build's */
    make_in(dir, "s.ckpt.tmp.NEWone", 7, 0);
    make_in(dir, "s.ckpt.tmp.12.toolong", 7, EXPERT_CKPT_TMP_STALE_S + 5);
    make_in(dir, "s.ckpt.tmp.012.abcdef", 7, EXPERT_CKPT_TMP_STALE_S + 5);
    make_in(dir, "s.ckpt.tmpx", 7, EXPERT_CKPT_TMP_STALE_S + 5);
    make_in(dir, "s.ckpt", 7, EXPERT_CKPT_TMP_STALE_S + 5);
    /* A write in flight holds its lock, whatever its pid looks like. */
    char pl[800];
    snprintf(pl, sizeof pl, "%s/%s", dir, n_locked);
    int lfd = open(pl, O_RDWR | O_CLOEXEC);
    assert_true(lfd >= 0);
    assert_int_equal(flock(lfd, LOCK_EX), 0);

    uint64_t bytes = 0;
    assert_int_equal(expert_ckpt_clean_tmp(path, &bytes), 4);
    assert_true(bytes == 1000 + 300 + 20 + 4);
    assert_false(exists_in(dir, n_dead));
    assert_false(exists_in(dir, n_self));
    assert_false(exists_in(dir, n_live_old));
    assert_false(exists_in(dir, "s.ckpt.tmp.OLDone"));
    const char *kept[] = { n_live, n_locked, n_other, "s.ckpt.tmp.NEWone", "s.ckpt.tmp.12.toolong",
                           "s.ckpt.tmp.012.abcdef", "s.ckpt.tmpx", "s.ckpt" };
    for (size_t i = 0; i < sizeof kept / sizeof kept[0]; i++) {
        if (!exists_in(dir, kept[i]))
            fail_msg("%s was removed", kept[i]);
    }
    assert_int_equal(expert_ckpt_clean_tmp(path, &bytes), 0);
    assert_true(bytes == 0);
    close(lfd);
    assert_int_equal(expert_ckpt_clean_tmp(path, NULL), 1); /* its writer is gone now */
    snprintf(pl, sizeof pl, "%s/nodir/s.ckpt", dir);
    assert_int_equal(expert_ckpt_clean_tmp(pl, NULL), -ENOENT);
    test_rmtree(dir);
}

/* Format 4 carries the whole training state: the guard's history of step
 * gradient norms and DiLoCo's outer state, which a peer that restarts
 * resumes from; format 2 (an older build's) is still read, with a guard
 * that starts afresh and no outer state. Its new fields refuse garbage. */
static void test_format4_training_state(void **state)
{
    (void)state;
    struct expert_block_config cfg = { EXPERT_BLOCK_RESFFN, 8, 8, 24 };
    expert_block *a = trained_block(&cfg, SEED);
    size_t n = expert_block_nparams(a);
    struct expert_outer o;
    assert_int_equal(expert_block_outer_lock(a, 0, &o), -ENOENT);
    assert_int_equal(expert_block_outer_lock(a, 1, &o), 0);
    assert_int_equal(o.n, n);
    for (size_t i = 0; i < n; i++) {
        o.anchor[i] = 0.5f + (float)i;
        o.momentum[i] = -0.25f * (float)i;
        o.residual[i] = 1e-3f * (float)(i % 7);
    }
    expert_block_outer_unlock(a);
    struct expert_block_health ha, hb;
    expert_block_health(a, &ha);
    assert_true(ha.grad_ref > 0);

    char dir[512], path[600];
    test_tmpdir(dir, sizeof dir, "ckpt-v4");
    snprintf(path, sizeof path, "%s/s.ckpt", dir);
    assert_int_equal(expert_block_save(a, path, 1), 0);
    expert_block *b = expert_block_create(&cfg, 5);
    assert_int_equal(expert_block_load(b, path, NULL, 0), 0);
    expert_block_health(b, &hb);
    assert_true(hb.grad_ref == ha.grad_ref);
    struct expert_outer ob;
    assert_int_equal(expert_block_outer_lock(b, 0, &ob), 0);
    for (size_t i = 0; i < n; i++)
        assert_true(ob.anchor[i] == 0.5f + (float)i && ob.momentum[i] == -0.25f * (float)i &&
                    ob.residual[i] == 1e-3f * (float)(i % 7));
    expert_block_outer_unlock(b);

    /* The header says so; weights alone carry neither (format 2). */
    size_t len;
    unsigned char *buf = serialize(a, 1, &len);
    struct expert_ckpt_info h;
    assert_int_equal(expert_ckpt_peek(buf, len, &h), 0);
    assert_true(h.format == 4 && h.with_optim == 1 && h.with_outer == 1 && h.total_len == len);
    size_t lw;
    unsigned char *w = serialize(a, 0, &lw);
    assert_int_equal(expert_ckpt_peek(w, lw, &h), 0);
    assert_true(h.format == 2 && h.with_outer == 0);
    free(w);

    /* Garbage in the new fields, with a valid checksum. */
    unsigned char *mod = malloc(len);
    assert_non_null(mod);
    struct { size_t off; double v; } bad_f64[] = { { 220, NAN }, { 220, -1.0 }, { 236, INFINITY }, { 236, -2.0 } };
    for (size_t i = 0; i < sizeof bad_f64 / sizeof bad_f64[0]; i++) {
        memcpy(mod, buf, len);
        memcpy(mod + bad_f64[i].off, &bad_f64[i].v, 8);
        fix_crc(mod, len);
        assert_int_equal(expert_block_deserialize(b, mod, len), -EBADMSG);
    }
    uint32_t bad_u32[][2] = { { 244, 2 }, { 248, 1 }, { 252, 1 }, { 256, 7 }, { 12, 0 } };
    for (size_t i = 0; i < sizeof bad_u32 / sizeof bad_u32[0]; i++) {
        memcpy(mod, buf, len);
        put_le32(mod + bad_u32[i][0], bad_u32[i][1]);
        fix_crc(mod, len);
        assert_int_equal(expert_block_deserialize(b, mod, len), -EBADMSG);
    }
    /* The outer flag cleared: the table and length no longer agree. */
    memcpy(mod, buf, len);
    put_le32(mod + 244, 0);
    fix_crc(mod, len);
    assert_int_equal(expert_block_deserialize(b, mod, len), -EBADMSG);
    free(mod);

    /* A format-2 file of an older build: the moments load, the guard
     * starts afresh, the outer state is gone. */
    expert_block_outer_drop(a);
    unsigned char *v4 = serialize(a, 1, &len);
    size_t len2;
    unsigned char *v2 = to_format(v4, len, 2, &len2);
    assert_int_equal(expert_ckpt_peek(v2, len2, &h), 0);
    assert_int_equal(h.format, 2);
    assert_int_equal(expert_block_deserialize(b, v2, len2), 0);
    assert_int_equal(expert_block_outer_lock(b, 0, &ob), -ENOENT);
    expert_block_health(b, &hb);
    assert_true(hb.grad_ref == 0);
    assert_int_equal(expert_block_steps(b), expert_block_steps(a));
    free(v2);
    free(v4);
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
        cmocka_unit_test(test_stage_recorded),
        cmocka_unit_test(test_format1_read),
        cmocka_unit_test(test_format4_training_state),
        cmocka_unit_test(test_clean_tmp),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
