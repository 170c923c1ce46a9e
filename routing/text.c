/* routing/text.c: a language model's corpus (a file, or the fortunes
 * packages' files) and its windows, drawn as train_lm.py draws them. */
#include "routing/text.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <sodium.h>

static const char *const fortune_pkgs[] = { "fortunes", "fortunes-min" };
#define MAX_FILES 512

static void say(char *err, size_t errlen, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void say(char *err, size_t errlen, const char *fmt, ...)
{
    if (!err || !errlen)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}

/* Appends path's bytes to *buf (*len used, *cap allocated). */
static int append_file(const char *path, unsigned char **buf, size_t *len, size_t *cap, char *err,
                       size_t errlen)
{
    struct stat st;
    if (stat(path, &st) != 0) {
        int e = errno;
        say(err, errlen, "%s: %s", path, strerror(e));
        return -e;
    }
    if (S_ISDIR(st.st_mode)) {
        say(err, errlen, "%s: %s: pass a file, not a directory", path, "is a directory");
        return -EISDIR;
    }
    FILE *f = fopen(path, "rb");
    if (!f) {
        int e = errno;
        say(err, errlen, "%s: %s", path, strerror(e));
        return -e;
    }
    int rc = 0;
    for (;;) {
        if (*cap - *len < 65536) {
            size_t nc = *cap ? *cap * 2 : 1 << 20;
            if (nc > ROUTE_TEXT_MAX_BYTES + 65536) {
                say(err, errlen, "%s: %s", path, "larger than the 16 GiB a corpus may have");
                rc = -EFBIG;
                break;
            }
            unsigned char *nb = realloc(*buf, nc);
            if (!nb) {
                say(err, errlen, "%s: %s", path, "out of memory");
                rc = -ENOMEM;
                break;
            }
            *buf = nb;
            *cap = nc;
        }
        size_t got = fread(*buf + *len, 1, *cap - *len, f);
        *len += got;
        if (got == 0) {
            if (ferror(f)) {
                say(err, errlen, "%s: %s", path, "read error");
                rc = -EIO;
            }
            break;
        }
    }
    fclose(f);
    return rc;
}

static int cmp_base(const void *a, const void *b)
{
    const char *x = strrchr(*(char *const *)a, '/'), *y = strrchr(*(char *const *)b, '/');
    return strcmp(x + 1, y + 1); /* bytewise: strcmp compares unsigned chars */
}

/* The fortune files `dpkg -L` lists for pkg, added to files (deduplicated). */
static void list_package(const char *pkg, char **files, int *n)
{
    char cmd[128];
    snprintf(cmd, sizeof cmd, "dpkg -L %s 2>/dev/null", pkg);
    FILE *p = popen(cmd, "r");
    if (!p)
        return;
    char line[4096];
    size_t dl = strlen(ROUTE_TEXT_FORTUNE_DIR);
    while (fgets(line, sizeof line, p)) {
        line[strcspn(line, "\r\n")] = '\0';
        const char *base = line + dl + 1;
        size_t bl = strlen(line) > dl ? strlen(base) : 0;
        if (strncmp(line, ROUTE_TEXT_FORTUNE_DIR "/", dl + 1) != 0 || !bl || strchr(base, '/') ||
            (bl >= 4 && strcmp(base + bl - 4, ".dat") == 0))
            continue;
        struct stat st;
        if (lstat(line, &st) != 0 || !S_ISREG(st.st_mode))
            continue;
        int dup = 0;
        for (int i = 0; i < *n && !dup; i++)
            dup = strcmp(files[i], line) == 0;
        if (!dup && *n < MAX_FILES && (files[*n] = strdup(line)))
            (*n)++;
    }
    pclose(p);
}

static int load_fortunes(route_text *out, size_t *cap, char *err, size_t errlen)
{
    char *files[MAX_FILES];
    int n = 0, rc = 0;
    for (size_t k = 0; k < sizeof fortune_pkgs / sizeof fortune_pkgs[0]; k++)
        list_package(fortune_pkgs[k], files, &n);
    if (n == 0) {
        say(err, errlen,
            "the default corpus is the Debian packages %s and %s (train_lm.py's): apt-get install "
            "fortunes, or pass --data FILE",
            fortune_pkgs[0], fortune_pkgs[1]);
        return -ENOENT;
    }
    qsort(files, (size_t)n, sizeof files[0], cmp_base);
    for (int i = 0; i < n && rc == 0; i++)
        rc = append_file(files[i], &out->bytes, &out->n, cap, err, errlen);
    for (int i = 0; i < n; i++)
        free(files[i]);
    out->n_files = n;
    snprintf(out->source, sizeof out->source, "%s + %s (%d files)", fortune_pkgs[0], fortune_pkgs[1], n);
    return rc;
}

int route_text_load(route_text *out, const char *path, char *err, size_t errlen)
{
    if (!out)
        return -EINVAL;
    memset(out, 0, sizeof *out);
    size_t cap = 0;
    int rc;
    if (path) {
        rc = append_file(path, &out->bytes, &out->n, &cap, err, errlen);
        out->n_files = 1;
        snprintf(out->source, sizeof out->source, "%s", path);
    } else {
        rc = load_fortunes(out, &cap, err, errlen);
    }
    if (rc == 0 && out->n == 0) {
        say(err, errlen, "%s: %s", path ? path : out->source, "empty: a corpus needs bytes to train on");
        rc = -EINVAL;
    }
    if (rc != 0) {
        route_text_free(out);
        return rc;
    }
    out->n_val = out->n / 10;
    out->n_train = out->n - out->n_val;
    unsigned char h[crypto_hash_sha256_BYTES];
    crypto_hash_sha256(h, out->bytes, out->n);
    for (int i = 0; i < 8; i++)
        snprintf(out->sha256_16 + 2 * i, 3, "%02x", h[i]);
    return 0;
}

void route_text_free(route_text *t)
{
    if (!t)
        return;
    free(t->bytes);
    memset(t, 0, sizeof *t);
}

int route_text_check(const route_text *t, int T, char *err, size_t errlen)
{
    if (!t || !t->bytes || T < 1)
        return -EINVAL;
    const char *which = t->n_train <= (size_t)T ? "training part (the first 90%)"
                        : t->n_val <= (size_t)T ? "validation part (the last 10%)"
                                                : NULL;
    if (!which)
        return 0;
    if (err && errlen)
        snprintf(err, errlen,
                 "%s: its %s holds %zu bytes, too few for context %d: each split needs at least %d "
                 "bytes (the corpus at least %zu)",
                 t->source, which, t->n_train <= (size_t)T ? t->n_train : t->n_val, T, T + 1,
                 (size_t)(T + 1) * 10);
    return -EINVAL;
}

uint64_t route_text_draw(uint64_t seed, uint64_t k)
{
    uint64_t z = seed + (k + 1) * 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

static size_t split_len(const route_text *t, int split)
{
    return split == ROUTE_TEXT_TRAIN ? t->n_train : t->n_val;
}

uint64_t route_text_offset(const route_text *t, int split, uint64_t seed, uint64_t k, int T)
{
    size_t len = split_len(t, split);
    if (len <= (size_t)T)
        return 0;
    return route_text_draw(seed, k) % (uint64_t)(len - (size_t)T);
}

int route_text_fill(const route_text *t, int split, const uint64_t *offsets, int rows, int T, float *x,
                    int32_t *y)
{
    if (!t || !offsets || !x || !y || rows < 0 || T < 1)
        return -EINVAL;
    size_t len = split_len(t, split);
    const unsigned char *b = t->bytes + (split == ROUTE_TEXT_TRAIN ? 0 : t->n_train);
    for (int r = 0; r < rows; r++)
        if (len <= (size_t)T || offsets[r] > len - (size_t)T - 1)
            return -EINVAL;
    for (int r = 0; r < rows; r++) {
        const unsigned char *w = b + offsets[r];
        for (int i = 0; i < T; i++) {
            x[(size_t)r * (size_t)T + (size_t)i] = (float)w[i];
            y[(size_t)r * (size_t)T + (size_t)i] = w[i + 1];
        }
    }
    return 0;
}
