/* routing/data.h: the trainer's data: Fashion-MNIST in IDX format.
 *
 * Debian's dataset-fashion-mnist package installs the four gzip-compressed
 * IDX files under /usr/share/datasets/fashion-mnist. Plain (uncompressed)
 * files with the same names minus ".gz" are accepted too. Images are
 * normalised as the PyTorch baselines do: x/255, then (x - 0.286041)/0.353024.
 */
#ifndef ROUTE_DATA_H
#define ROUTE_DATA_H

#include <stddef.h>
#include <stdint.h>

#define ROUTE_FMNIST_DEFAULT_DIR "/usr/share/datasets/fashion-mnist"
#define ROUTE_FMNIST_MEAN 0.286041f
#define ROUTE_FMNIST_STD 0.353024f
#define ROUTE_DATA_MAX_ITEMS 10000000
#define ROUTE_DATA_MAX_SIDE 1024

typedef struct route_dataset {
    int n;            /* number of examples */
    int rows, cols;   /* image shape */
    int classes;      /* 1 + the largest label (0 without labels) */
    float *images;    /* (n, rows*cols), normalised; owned */
    uint8_t *labels;  /* (n); owned; NULL when loaded without labels */
} route_dataset;

/* Finds the data directory: `dir` when not NULL, else $FASHION_MNIST_DIR,
 * else the Debian package's directory. Writes it into out. Returns 0, or
 * -ENOENT with a sentence in err telling the user what to install or pass. */
int route_data_find_dir(const char *dir, char *out, size_t outlen, char *err, size_t errlen);

/* Loads split "train" or "t10k" from dir into out. On success the caller owns
 * out's arrays (free with route_data_free). On failure out is zeroed, nothing
 * is leaked, and err receives a sentence naming the file and the problem.
 * Returns 0, -ENOENT (missing file), -EBADMSG (not IDX, wrong magic, bad
 * dimensions, truncated, trailing bytes, labels/images mismatch), -ENOMEM or
 * -EINVAL. */
int route_data_load(route_dataset *out, const char *dir, const char *split,
                    char *err, size_t errlen);

/* Loads an IDX images file (3-D unsigned bytes, gzip or plain) and,
 * when labels is not NULL, its IDX labels file. Without labels, out->labels
 * is NULL and out->classes 0. Errors as route_data_load. */
int route_data_load_files(route_dataset *out, const char *images, const char *labels, char *err,
                          size_t errlen);

/* Frees what route_data_load allocated and zeroes d. Accepts NULL. */
void route_data_free(route_dataset *d);

#endif
