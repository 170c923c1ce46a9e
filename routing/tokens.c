/* routing/tokens.c: llm.c .bin token files, read and written (see tokens.h). */
#include "routing/tokens.h"

#include "expert/atomicfile.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static int say(char *err, size_t errlen, int rc, const char *fmt, ...) __attribute__((format(printf, 4, 5)));

static int say(char *err, size_t errlen, int rc, const char *fmt, ...)
{
    if (err && errlen) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, errlen, fmt, ap);
        va_end(ap);
    }
    return rc;
}

static uint32_t le32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* Reads len bytes at offset off of fd into buf. */
static int read_at(int fd, void *buf, size_t len, off_t off)
{
    uint8_t *p = buf;
    while (len > 0) {
        ssize_t r = pread(fd, p, len, off);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return r < 0 ? -errno : -EIO;
        p += r;
        len -= (size_t)r;
        off += r;
    }
    return 0;
}

/* The header's token width (2 or 4) and count, checked against the size. */
static int read_header(int fd, const char *path, uint64_t size, int *width, size_t *n, char *err, size_t errlen)
{
    uint8_t h[ROUTE_TOKENS_HEADER];
    if (size < ROUTE_TOKENS_HEADER)
        return say(err, errlen, -EINVAL, "%s: not a token file (shorter than the %d-byte header)", path,
                   ROUTE_TOKENS_HEADER);
    int rc = read_at(fd, h, sizeof h, 0);
    if (rc != 0)
        return say(err, errlen, rc, "%s: cannot read: %s", path, strerror(-rc));
    int32_t magic = (int32_t)le32(h), version = (int32_t)le32(h + 4), count = (int32_t)le32(h + 8);
    if (magic == ROUTE_TOKENS_MAGIC && version == 1)
        *width = 2;
    else if ((magic == ROUTE_TOKENS_MAGIC && version == 2) || (magic == ROUTE_TOKENS_MAGIC_LLAMA3 && version == 7))
        *width = 4;
    else
        return say(err, errlen, -EINVAL, "%s: not a token file this reads (magic %d, version %d; llm.c's "
                                         "20240520/1, 20240520/2 and 20240801/7 are)", path, magic, version);
    if (count < 0 || size != ROUTE_TOKENS_HEADER + (uint64_t)count * (uint64_t)*width)
        return say(err, errlen, -EINVAL, "%s: %llu bytes, but the header says %d tokens of %d bytes after %d",
                   path, (unsigned long long)size, count, *width, ROUTE_TOKENS_HEADER);
    *n = (size_t)count;
    return 0;
}

int route_tokens_load(const char *path, uint32_t vocab, uint32_t **out, size_t *n, char *err, size_t errlen)
{
    if (err && errlen)
        err[0] = '\0';
    if (!path || !out || !n)
        return say(err, errlen, -EINVAL, "no token file");
    *out = NULL;
    *n = 0;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0) {
        int e = errno;
        if (fd >= 0)
            close(fd);
        return say(err, errlen, -e, "%s: %s", path, strerror(e));
    }
    int width = 0;
    size_t count = 0;
    int rc = S_ISREG(st.st_mode) ? read_header(fd, path, (uint64_t)st.st_size, &width, &count, err, errlen)
                                 : say(err, errlen, -EINVAL, "%s: not a regular file", path);
    uint8_t *raw = rc == 0 ? malloc(count * (size_t)width + 1) : NULL;
    uint32_t *t = rc == 0 ? malloc((count ? count : 1) * sizeof *t) : NULL;
    if (rc == 0 && (!raw || !t))
        rc = say(err, errlen, -ENOMEM, "%s: out of memory for %zu tokens", path, count);
    if (rc == 0 && (rc = read_at(fd, raw, count * (size_t)width, ROUTE_TOKENS_HEADER)) != 0)
        say(err, errlen, rc, "%s: cannot read: %s", path, strerror(-rc));
    close(fd);
    for (size_t i = 0; rc == 0 && i < count; i++) {
        const uint8_t *p = raw + i * (size_t)width;
        t[i] = width == 2 ? (uint32_t)(p[0] | p[1] << 8) : le32(p);
        if (vocab > 0 && t[i] >= vocab)
            rc = say(err, errlen, -ERANGE, "%s: token %zu is %u, outside the vocabulary of %u", path, i, t[i], vocab);
    }
    free(raw);
    if (rc != 0) {
        free(t);
        return rc;
    }
    *out = t;
    *n = count;
    return 0;
}

int route_tokens_write(const char *path, const uint32_t *t, size_t n, char *err, size_t errlen)
{
    if (!path || (!t && n) || n > INT32_MAX)
        return say(err, errlen, -EINVAL, "%s: nothing to write, or more than 2^31-1 tokens", path ? path : "?");
    int width = 2;
    for (size_t i = 0; i < n; i++)
        if (t[i] > 65535)
            width = 4;
    size_t len = ROUTE_TOKENS_HEADER + n * (size_t)width;
    uint8_t *buf = calloc(1, len);
    if (!buf)
        return say(err, errlen, -ENOMEM, "%s: out of memory", path);
    uint32_t hdr[3] = {ROUTE_TOKENS_MAGIC, width == 2 ? 1u : 2u, (uint32_t)n};
    for (int k = 0; k < 3; k++)
        for (int b = 0; b < 4; b++)
            buf[4 * k + b] = (uint8_t)(hdr[k] >> (8 * b));
    for (size_t i = 0; i < n; i++)
        for (int b = 0; b < width; b++)
            buf[ROUTE_TOKENS_HEADER + i * (size_t)width + (size_t)b] = (uint8_t)(t[i] >> (8 * b));
    expert_atomic_file f;
    int rc = expert_atomic_open(&f, path);
    if (rc == 0) {
        expert_atomic_write(&f, buf, len);
        rc = expert_atomic_commit(&f);
    }
    if (rc != 0)
        say(err, errlen, rc, "%s: cannot write: %s", path, strerror(-rc));
    free(buf);
    return rc;
}
