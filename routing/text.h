/* routing/text.h: a byte-level language model's data, exactly as
 * ../shared/bench/torch/train_lm.py draws it.
 *
 * The corpus is any file's raw bytes, or by default the plain-text files
 * of the Debian packages fortunes and fortunes-min: those `dpkg -L` lists
 * directly in /usr/share/games/fortunes/ that are regular files (not
 * symlinks) and do not end in ".dat", sorted by name bytewise and
 * concatenated (Debian 12: 43 files, 2,576,674 bytes, SHA-256 starting
 * fbc2d796dde8ea64). The last N/10 bytes are the validation split, the
 * rest the training split.
 *
 * A window of context T is T+1 consecutive bytes at offset o of a split:
 * x = b[o .. o+T), y = b[o+1 .. o+T+1). Offsets come from SplitMix64,
 * o = next() % (len(split) - T). The training stream starts from the
 * run's seed, and step s takes draws s·B .. s·B+B-1 as its rows; the
 * validation stream starts from ROUTE_TEXT_VAL_SEED, whatever the seed.
 * The state after k draws is seed + k·0x9E3779B97F4A7C15, so any draw is
 * computed directly.
 *
 * Threads: a loaded route_text is read-only; every function but load and
 * free may be called from any thread.
 */
#ifndef ROUTE_TEXT_H
#define ROUTE_TEXT_H

#include <stddef.h>
#include <stdint.h>

#define ROUTE_TEXT_VAL_SEED 12345
#define ROUTE_TEXT_EVAL_ROWS 32     /* validation windows per evaluation batch */
#define ROUTE_TEXT_FORTUNE_DIR "/usr/share/games/fortunes"
#define ROUTE_TEXT_MAX_BYTES ((size_t)1 << 34)

enum route_text_split { ROUTE_TEXT_TRAIN = 0, ROUTE_TEXT_VAL = 1 };

typedef struct route_text {
    unsigned char *bytes;      /* the whole corpus; owned */
    size_t n;                  /* its length */
    size_t n_train, n_val;     /* the splits: [0, n_train) and [n_train, n) */
    int n_files;
    char source[512];          /* the file's path, or "fortunes + fortunes-min (43 files)" */
    char sha256_16[17];        /* the first 16 hex digits of its SHA-256 */
} route_text;

/* Loads path's bytes (path NULL: the default corpus) into *out. On failure
 * *out is zeroed, nothing is leaked, and err receives a sentence naming the
 * file, or the packages to install. Returns 0, -ENOENT (no such file, or
 * the packages are missing), -EISDIR, -EFBIG (over ROUTE_TEXT_MAX_BYTES),
 * -ENOMEM, or another -errno from reading. */
int route_text_load(route_text *out, const char *path, char *err, size_t errlen);

/* Frees what route_text_load allocated and zeroes t. NULL-safe. */
void route_text_free(route_text *t);

/* 0 when both splits hold at least one window of context T, else -EINVAL
 * with a sentence in err saying which split is too short. */
int route_text_check(const route_text *t, int T, char *err, size_t errlen);

/* The SplitMix64 output number k (0-based) of the stream that starts from
 * seed. */
uint64_t route_text_draw(uint64_t seed, uint64_t k);

/* The offset of window k of split's stream from seed, within the split. */
uint64_t route_text_offset(const route_text *t, int split, uint64_t seed, uint64_t k, int T);

/* Fills rows windows at offsets (within split) into x (rows, T) as token
 * values 0..255 in floats, and y (rows, T) with the next bytes. Returns 0,
 * or -EINVAL (an offset past the split's last window). */
int route_text_fill(const route_text *t, int split, const uint64_t *offsets, int rows, int T, float *x,
                    int32_t *y);

#endif
