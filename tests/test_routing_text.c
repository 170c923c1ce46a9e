/* A language model's corpus and windows (routing/text.h) against
 * ../shared/bench/torch/train_lm.py's own generator, and hostile files. */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "routing/text.h"
#include "test_util.h"

static char dir[256];

static int setup(void **state)
{
    (void)state;
    test_tmpdir(dir, sizeof dir, "text");
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    test_rmtree(dir);
    return 0;
}

/* Writes n bytes of pattern (i * 7 + 3) mod 256 to dir/name; its path into path. */
static void write_file(const char *name, size_t n, char *path, size_t len)
{
    snprintf(path, len, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    for (size_t i = 0; i < n; i++)
        fputc((int)((i * 7 + 3) & 255), f);
    fclose(f);
}

/* The values were computed with train_lm.py's SplitMix64 class (copied
 * into /usr/bin/python3): SplitMix64(seed).next() in a loop, then
 * % (len(split) - T) for the offsets. */
static void test_draws_match_train_lm(void **state)
{
    (void)state;
    assert_true(route_text_draw(0, 0) == 16294208416658607535ULL);
    assert_true(route_text_draw(0, 1) == 7960286522194355700ULL);
    assert_true(route_text_draw(0, 2) == 487617019471545679ULL);
    assert_true(route_text_draw(7, 69) == 17599774830844088246ULL);
    /* A 1,000-byte training split (the split lengths set directly), T 16. */
    route_text t = { 0 };
    unsigned char bytes[1200] = { 0 };
    t.bytes = bytes;
    t.n = 1000 + 200;
    t.n_train = 1000;
    t.n_val = 200;
    uint64_t want[6] = { 679, 972, 247, 244, 787, 306 };
    for (int k = 0; k < 6; k++)
        assert_int_equal(route_text_offset(&t, ROUTE_TEXT_TRAIN, 0, (uint64_t)k, 16), want[k]);
    /* Debian 12's corpus: validation 257,667 bytes, T 128, VAL_SEED. */
    t.n_train = 2319007;
    t.n_val = 257667;
    uint64_t val[4] = { 13959, 6783, 134163, 206013 };
    for (int k = 0; k < 4; k++)
        assert_int_equal(route_text_offset(&t, ROUTE_TEXT_VAL, ROUTE_TEXT_VAL_SEED, (uint64_t)k, 128),
                         val[k]);
    assert_int_equal(route_text_offset(&t, ROUTE_TEXT_TRAIN, 7, 69, 128), 1113647);
}

static void test_split_and_fill(void **state)
{
    (void)state;
    char path[512], err[512];
    write_file("c.txt", 1005, path, sizeof path);
    route_text t;
    assert_int_equal(route_text_load(&t, path, err, sizeof err), 0);
    assert_int_equal(t.n, 1005);
    assert_int_equal(t.n_val, 100);   /* N // 10 */
    assert_int_equal(t.n_train, 905);
    assert_int_equal(t.n_files, 1);
    assert_string_equal(t.source, path);
    assert_int_equal(strlen(t.sha256_16), 16);
    assert_int_equal(route_text_check(&t, 16, err, sizeof err), 0);
    /* x is the window, y the same shifted by one byte; validation windows
     * start at the split's start. */
    uint64_t offs[2] = { 0, 905 - 16 - 1 };
    float x[2 * 16];
    int32_t y[2 * 16];
    assert_int_equal(route_text_fill(&t, ROUTE_TEXT_TRAIN, offs, 2, 16, x, y), 0);
    for (int r = 0; r < 2; r++)
        for (int i = 0; i < 16; i++) {
            size_t at = offs[r] + (size_t)i;
            assert_true(x[r * 16 + i] == (float)((at * 7 + 3) & 255));
            assert_int_equal(y[r * 16 + i], (int)(((at + 1) * 7 + 3) & 255));
        }
    uint64_t v[1] = { 5 };
    assert_int_equal(route_text_fill(&t, ROUTE_TEXT_VAL, v, 1, 16, x, y), 0);
    assert_true(x[0] == (float)(((905 + 5) * 7 + 3) & 255));
    /* An offset past the split's last window is refused. */
    uint64_t bad[1] = { 905 - 16 };
    assert_int_equal(route_text_fill(&t, ROUTE_TEXT_TRAIN, bad, 1, 16, x, y), -EINVAL);
    v[0] = 100 - 16;
    assert_int_equal(route_text_fill(&t, ROUTE_TEXT_VAL, v, 1, 16, x, y), -EINVAL);
    /* Every drawn offset is a valid window. */
    for (uint64_t k = 0; k < 1000; k++) {
        uint64_t o = route_text_offset(&t, ROUTE_TEXT_VAL, 3, k, 16);
        assert_true(o < 100 - 16);
    }
    /* Context 100: the validation part (100 bytes) is too short. */
    assert_int_equal(route_text_check(&t, 100, err, sizeof err), -EINVAL);
    assert_non_null(strstr(err, "validation part"));
    assert_non_null(strstr(err, path));
    route_text_free(&t);
    assert_null(t.bytes);
}

static void test_bad_files(void **state)
{
    (void)state;
    char path[512], err[512];
    route_text t;
    snprintf(path, sizeof path, "%s/none.txt", dir);
    assert_int_equal(route_text_load(&t, path, err, sizeof err), -ENOENT);
    assert_non_null(strstr(err, path));
    assert_null(t.bytes);
    assert_int_equal(route_text_load(&t, dir, err, sizeof err), -EISDIR);
    assert_non_null(strstr(err, "directory"));
    write_file("empty.txt", 0, path, sizeof path);
    assert_int_equal(route_text_load(&t, path, err, sizeof err), -EINVAL);
    assert_non_null(strstr(err, "empty"));
    write_file("short.txt", 50, path, sizeof path);
    assert_int_equal(route_text_load(&t, path, err, sizeof err), 0);
    assert_int_equal(route_text_check(&t, 128, err, sizeof err), -EINVAL);
    assert_non_null(strstr(err, "training part"));
    assert_non_null(strstr(err, "context 128"));
    route_text_free(&t);
    route_text_free(NULL);
    /* An unreadable file (not as root: root reads anything). */
    if (geteuid() != 0) {
        write_file("locked.txt", 10, path, sizeof path);
        chmod(path, 0);
        assert_int_equal(route_text_load(&t, path, err, sizeof err), -EACCES);
        assert_non_null(strstr(err, path));
    }
}

/* The default corpus: Debian 12's fortunes + fortunes-min, as train_lm.py
 * reads it (tools/deps.sh installs the packages). */
static void test_default_corpus(void **state)
{
    (void)state;
    if (access(ROUTE_TEXT_FORTUNE_DIR, F_OK) != 0) {
        fprintf(stderr, "skipping the default corpus: %s is missing (apt-get install fortunes)\n",
                ROUTE_TEXT_FORTUNE_DIR);
        skip();
    }
    char err[512];
    route_text t;
    assert_int_equal(route_text_load(&t, NULL, err, sizeof err), 0);
    fprintf(stderr, "default corpus: %s, %zu bytes, sha256 %s\n", t.source, t.n, t.sha256_16);
    assert_int_equal(t.n_files, 43);
    assert_int_equal(t.n, 2576674);
    assert_string_equal(t.sha256_16, "fbc2d796dde8ea64");
    assert_int_equal(t.n_train, 2319007);
    assert_int_equal(t.n_val, 257667);
    route_text_free(&t);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_draws_match_train_lm),
        cmocka_unit_test_setup_teardown(test_split_and_fill, setup, teardown),
        cmocka_unit_test_setup_teardown(test_bad_files, setup, teardown),
        cmocka_unit_test(test_default_corpus),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
