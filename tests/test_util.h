/* tests/test_util.h: small helpers shared by the C tests (cmocka based). */
#ifndef TESTS_TEST_UTIL_H
#define TESTS_TEST_UTIL_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

/* Exit status meson reads as "skipped". */
#define TEST_SKIP 77

/* Makes a fresh private directory under $TMPDIR (or /tmp) for one test and
 * writes its path into dir. Fails the test if it cannot. */
static inline void test_tmpdir(char *dir, size_t len, const char *tag)
{
    const char *base = getenv("TMPDIR");
    snprintf(dir, len, "%s/starling-%s-XXXXXX", base && *base ? base : "/tmp", tag);
    assert_non_null(mkdtemp(dir));
}

/* Removes a directory tree made by test_tmpdir (best effort). */
static inline void test_rmtree(const char *dir)
{
    char cmd[4200];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0)
        fprintf(stderr, "warning: could not remove %s\n", dir);
}

/* Writes len bytes to path with the given mode; fails the test on error. */
static inline void test_write_file(const char *path, const void *data, size_t len, int mode)
{
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    if (len)
        assert_int_equal(fwrite(data, 1, len, f), len);
    assert_int_equal(fclose(f), 0);
    assert_int_equal(chmod(path, (mode_t)mode), 0);
}

/* Reads up to cap-1 bytes of path into buf, NUL-terminates, returns length. */
static inline size_t test_read_file(const char *path, char *buf, size_t cap)
{
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    size_t n = fread(buf, 1, cap - 1, f);
    buf[n] = '\0';
    fclose(f);
    return n;
}

#endif
