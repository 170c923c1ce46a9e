/* llm.c .bin token files (routing/tokens.h): round trips in both widths,
 * the Llama-3 variant read, tokens checked against the vocabulary, and
 * every malformed file refused with a sentence naming it (short, unknown
 * magic or version, a count that does not match the size, a negative
 * count, a directory, no file), then mutated headers read or refused. */
#include <errno.h>
#include <string.h>

#include "routing/tokens.h"
#include "test_util.h"

static char dir[256];

static void path_of(char *buf, size_t len, const char *name)
{
    snprintf(buf, len, "%s/%s", dir, name);
}

/* A file of header words h[0..2] and nbytes of 0x01 after the header. */
static void raw(const char *path, int32_t magic, int32_t version, int32_t n, size_t nbytes)
{
    uint8_t buf[ROUTE_TOKENS_HEADER + 64] = {0};
    int32_t h[3] = {magic, version, n};
    for (int k = 0; k < 3; k++)
        for (int b = 0; b < 4; b++)
            buf[4 * k + b] = (uint8_t)((uint32_t)h[k] >> (8 * b));
    memset(buf + ROUTE_TOKENS_HEADER, 1, nbytes);
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(buf, 1, ROUTE_TOKENS_HEADER + nbytes, f), ROUTE_TOKENS_HEADER + nbytes);
    fclose(f);
}

static void refused(const char *path, int want, const char *says)
{
    uint32_t *t = NULL;
    size_t n = 7;
    char err[300] = "";
    int rc = route_tokens_load(path, 0, &t, &n, err, sizeof err);
    if (rc != want || !strstr(err, path) || !strstr(err, says))
        fail_msg("%s: rc %d \"%s\" (wanted %d and \"%s\")", path, rc, err, want, says);
    assert_null(t);
    assert_int_equal(n, 0);
}

static void test_round_trip(void **state)
{
    (void)state;
    char p[300], err[300];
    uint32_t small[5] = {0, 1, 65535, 300, 7}, big[3] = {65536, 0, 128255};
    uint32_t *t = NULL;
    size_t n = 0;
    path_of(p, sizeof p, "small.bin");
    assert_int_equal(route_tokens_write(p, small, 5, err, sizeof err), 0);
    struct stat st;
    assert_int_equal(stat(p, &st), 0);
    assert_int_equal(st.st_size, ROUTE_TOKENS_HEADER + 5 * 2); /* uint16 */
    assert_int_equal(route_tokens_load(p, 65536, &t, &n, err, sizeof err), 0);
    assert_int_equal(n, 5);
    assert_memory_equal(t, small, sizeof small);
    free(t);
    /* A token outside the vocabulary: named. */
    assert_int_equal(route_tokens_load(p, 1000, &t, &n, err, sizeof err), -ERANGE);
    assert_non_null(strstr(err, "token 2 is 65535"));
    path_of(p, sizeof p, "big.bin");
    assert_int_equal(route_tokens_write(p, big, 3, err, sizeof err), 0);
    assert_int_equal(stat(p, &st), 0);
    assert_int_equal(st.st_size, ROUTE_TOKENS_HEADER + 3 * 4); /* uint32 */
    assert_int_equal(route_tokens_load(p, 0, &t, &n, err, sizeof err), 0);
    assert_memory_equal(t, big, sizeof big);
    free(t);
    /* Empty, and llm.c's Llama-3 files. */
    path_of(p, sizeof p, "empty.bin");
    assert_int_equal(route_tokens_write(p, NULL, 0, err, sizeof err), 0);
    assert_int_equal(route_tokens_load(p, 10, &t, &n, err, sizeof err), 0);
    assert_int_equal(n, 0);
    free(t);
    path_of(p, sizeof p, "llama3.bin");
    raw(p, ROUTE_TOKENS_MAGIC_LLAMA3, 7, 2, 8);
    assert_int_equal(route_tokens_load(p, 0, &t, &n, err, sizeof err), 0);
    assert_int_equal(n, 2);
    assert_int_equal(t[1], 0x01010101u);
    free(t);
}

static void test_malformed(void **state)
{
    (void)state;
    char p[300];
    path_of(p, sizeof p, "short.bin");
    FILE *f = fopen(p, "wb");
    fputs("tokens?", f);
    fclose(f);
    refused(p, -EINVAL, "shorter than");
    path_of(p, sizeof p, "magic.bin");
    raw(p, 12345, 1, 0, 0);
    refused(p, -EINVAL, "magic 12345");
    path_of(p, sizeof p, "version.bin");
    raw(p, ROUTE_TOKENS_MAGIC, 7, 0, 0);
    refused(p, -EINVAL, "version 7");
    path_of(p, sizeof p, "count.bin");
    raw(p, ROUTE_TOKENS_MAGIC, 1, 5, 8);
    refused(p, -EINVAL, "says 5 tokens of 2 bytes");
    path_of(p, sizeof p, "negative.bin");
    raw(p, ROUTE_TOKENS_MAGIC, 2, -1, 0);
    refused(p, -EINVAL, "says -1 tokens");
    refused(dir, -EINVAL, "not a regular file");
    path_of(p, sizeof p, "absent.bin");
    refused(p, -ENOENT, "No such file");
    /* Flipped header bytes: read or refused, never more tokens than bytes. */
    path_of(p, sizeof p, "mutant.bin");
    uint64_t r = 99;
    for (int k = 0; k < 500; k++) {
        r = r * 6364136223846793005ULL + 1442695040888963407ULL;
        raw(p, ROUTE_TOKENS_MAGIC, 1 + (int)((r >> 60) & 1), 4, 8);
        f = fopen(p, "r+b");
        fseek(f, (long)((r >> 33) % 12), SEEK_SET);
        fputc((int)(r >> 20) & 0xff, f);
        fclose(f);
        uint32_t *t = NULL;
        size_t n = 0;
        char err[300];
        int rc = route_tokens_load(p, 0, &t, &n, err, sizeof err);
        assert_true(rc == 0 || rc == -EINVAL);
        assert_true(rc != 0 || n * 2 <= 8);
        free(t);
    }
}

static int setup(void **state)
{
    (void)state;
    test_tmpdir(dir, sizeof dir, "tokens");
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    test_rmtree(dir);
    return 0;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_round_trip),
        cmocka_unit_test(test_malformed),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
