#include "routing/data.h"

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <zlib.h>

#define IDX_MAGIC_U8_1D 0x00000801u
#define IDX_MAGIC_U8_3D 0x00000803u

static int is_dir(const char *p)
{
    struct stat st;
    return p && stat(p, &st) == 0 && S_ISDIR(st.st_mode);
}

int route_data_find_dir(const char *dir, char *out, size_t outlen, char *err, size_t errlen)
{
    const char *env = getenv("FASHION_MNIST_DIR");
    const char *pick = NULL;
    const char *why = NULL;

    if (dir && *dir) {
        pick = dir;
        why = "--data";
    } else if (env && *env) {
        pick = env;
        why = "$FASHION_MNIST_DIR";
    } else {
        pick = ROUTE_FMNIST_DEFAULT_DIR;
    }
    if (!is_dir(pick)) {
        if (why)
            snprintf(err, errlen, "data directory '%s' (from %s) does not exist", pick, why);
        else
            snprintf(err, errlen,
                     "Fashion-MNIST not found in %s: install it with "
                     "'apt-get install dataset-fashion-mnist' or pass --data DIR",
                     ROUTE_FMNIST_DEFAULT_DIR);
        return -ENOENT;
    }
    if (snprintf(out, outlen, "%s", pick) >= (int)outlen) {
        snprintf(err, errlen, "data directory path too long");
        return -EINVAL;
    }
    return 0;
}

/* Opens dir/name(.gz). gzopen reads plain files transparently. */
static gzFile open_idx(const char *dir, const char *name, char *path, size_t pathlen)
{
    snprintf(path, pathlen, "%s/%s.gz", dir, name);
    gzFile f = gzopen(path, "rb");
    if (f)
        return f;
    snprintf(path, pathlen, "%s/%s", dir, name);
    return gzopen(path, "rb");
}

static int read_exact(gzFile f, void *buf, size_t len)
{
    unsigned char *p = buf;
    while (len > 0) {
        unsigned chunk = len > (1u << 30) ? (1u << 30) : (unsigned)len;
        int got = gzread(f, p, chunk);
        if (got <= 0)
            return -1;
        p += got;
        len -= (size_t)got;
    }
    return 0;
}

static uint32_t be32(const unsigned char *b)
{
    return (uint32_t)b[0] << 24 | (uint32_t)b[1] << 16 | (uint32_t)b[2] << 8 | b[3];
}

/* Reads one IDX file of unsigned bytes with `ndims` dimensions from f
 * (named path in messages) into a fresh buffer; dims_out receives the
 * dimensions. Closes f. */
static int read_idx(gzFile f, const char *path, int ndims, uint32_t dims_out[3],
                    uint8_t **data_out, char *err, size_t errlen)
{
    unsigned char hdr[16];
    uint8_t *data = NULL;
    int rc = 0;
    const uint32_t want_magic = ndims == 3 ? IDX_MAGIC_U8_3D : IDX_MAGIC_U8_1D;

    *data_out = NULL;
    size_t hlen = 4 + 4 * (size_t)ndims;
    if (read_exact(f, hdr, hlen) != 0) {
        snprintf(err, errlen, "%s: truncated or unreadable IDX header", path);
        rc = -EBADMSG;
        goto out;
    }
    uint32_t magic = be32(hdr);
    if (magic != want_magic) {
        snprintf(err, errlen, "%s: not an IDX file of %d-D unsigned bytes (magic 0x%08x, want 0x%08x)",
                 path, ndims, magic, want_magic);
        rc = -EBADMSG;
        goto out;
    }
    size_t total = 1;
    for (int i = 0; i < ndims; i++) {
        dims_out[i] = be32(hdr + 4 + 4 * i);
        uint32_t lim = i == 0 ? ROUTE_DATA_MAX_ITEMS : ROUTE_DATA_MAX_SIDE;
        if (dims_out[i] == 0 || dims_out[i] > lim) {
            snprintf(err, errlen, "%s: dimension %d is %u (allowed 1..%u)", path, i, dims_out[i], lim);
            rc = -EBADMSG;
            goto out;
        }
        total *= dims_out[i];
    }
    data = malloc(total);
    if (!data) {
        snprintf(err, errlen, "%s: out of memory for %zu bytes", path, total);
        rc = -ENOMEM;
        goto out;
    }
    if (read_exact(f, data, total) != 0) {
        int zerr = 0;
        const char *zmsg = gzerror(f, &zerr);
        snprintf(err, errlen, "%s: truncated: expected %zu bytes of data (%s)", path, total,
                 zerr ? zmsg : "end of file");
        rc = -EBADMSG;
        goto out;
    }
    unsigned char extra;
    if (gzread(f, &extra, 1) != 0) {
        snprintf(err, errlen, "%s: unexpected bytes after the data", path);
        rc = -EBADMSG;
        goto out;
    }
out:
    gzclose(f);
    if (rc != 0)
        free(data);
    else
        *data_out = data;
    return rc;
}

static int load_idx(const char *dir, const char *name, int ndims, uint32_t dims_out[3],
                    uint8_t **data_out, char *err, size_t errlen)
{
    char path[PATH_MAX];
    gzFile f = open_idx(dir, name, path, sizeof path);
    if (!f) {
        *data_out = NULL;
        snprintf(err, errlen, "cannot open %s/%s(.gz): %s", dir, name, strerror(errno ? errno : ENOENT));
        return -ENOENT;
    }
    return read_idx(f, path, ndims, dims_out, data_out, err, errlen);
}

static int load_idx_path(const char *path, int ndims, uint32_t dims_out[3], uint8_t **data_out,
                         char *err, size_t errlen)
{
    gzFile f = gzopen(path, "rb");
    if (!f) {
        *data_out = NULL;
        snprintf(err, errlen, "cannot open %s: %s", path, strerror(errno ? errno : ENOENT));
        return -ENOENT;
    }
    return read_idx(f, path, ndims, dims_out, data_out, err, errlen);
}

/* Builds the dataset from loaded pixels and (optional) labels; takes
 * ownership of both. */
static int assemble(route_dataset *out, uint8_t *pix, const uint32_t idims[3], uint8_t *lab,
                    const uint32_t ldims[3], const char *what, char *err, size_t errlen)
{
    int rc = 0;
    if (lab && ldims[0] != idims[0]) {
        snprintf(err, errlen, "%s: %u images but %u labels", what, idims[0], ldims[0]);
        rc = -EBADMSG;
        goto fail;
    }
    int maxlab = -1;
    for (uint32_t i = 0; lab && i < ldims[0]; i++)
        if (lab[i] > maxlab)
            maxlab = lab[i];
    if (maxlab > 99) {
        snprintf(err, errlen, "%s: label %d out of range", what, maxlab);
        rc = -EBADMSG;
        goto fail;
    }
    size_t npix = (size_t)idims[0] * idims[1] * idims[2];
    float *img = malloc(npix * sizeof *img);
    if (!img) {
        snprintf(err, errlen, "out of memory for %zu pixels", npix);
        rc = -ENOMEM;
        goto fail;
    }
    const float scale = 1.0f / (255.0f * ROUTE_FMNIST_STD);
    const float shift = ROUTE_FMNIST_MEAN / ROUTE_FMNIST_STD;
    for (size_t i = 0; i < npix; i++)
        img[i] = (float)pix[i] * scale - shift;
    free(pix);
    out->n = (int)idims[0];
    out->rows = (int)idims[1];
    out->cols = (int)idims[2];
    out->classes = maxlab + 1;
    out->images = img;
    out->labels = lab;
    return 0;
fail:
    free(pix);
    free(lab);
    return rc;
}

int route_data_load(route_dataset *out, const char *dir, const char *split,
                    char *err, size_t errlen)
{
    char name[64];
    uint32_t idims[3] = {0}, ldims[3] = {0};
    uint8_t *pix = NULL, *lab = NULL;
    char dummy[1];
    int rc;

    if (!err) {
        err = dummy;
        errlen = sizeof dummy;
    }
    if (!out) {
        snprintf(err, errlen, "no output dataset");
        return -EINVAL;
    }
    memset(out, 0, sizeof *out);
    if (!dir || !split || (strcmp(split, "train") != 0 && strcmp(split, "t10k") != 0)) {
        snprintf(err, errlen, "split must be 'train' or 't10k'");
        return -EINVAL;
    }
    snprintf(name, sizeof name, "%s-images-idx3-ubyte", split);
    rc = load_idx(dir, name, 3, idims, &pix, err, errlen);
    if (rc != 0)
        return rc;
    snprintf(name, sizeof name, "%s-labels-idx1-ubyte", split);
    rc = load_idx(dir, name, 1, ldims, &lab, err, errlen);
    if (rc != 0) {
        free(pix);
        return rc;
    }
    return assemble(out, pix, idims, lab, ldims, dir, err, errlen);
}

int route_data_load_files(route_dataset *out, const char *images, const char *labels, char *err,
                          size_t errlen)
{
    uint32_t idims[3] = {0}, ldims[3] = {0};
    uint8_t *pix = NULL, *lab = NULL;
    char dummy[1];
    if (!err) {
        err = dummy;
        errlen = sizeof dummy;
    }
    if (!out || !images) {
        snprintf(err, errlen, "no images file");
        return -EINVAL;
    }
    memset(out, 0, sizeof *out);
    int rc = load_idx_path(images, 3, idims, &pix, err, errlen);
    if (rc != 0)
        return rc;
    if (labels) {
        rc = load_idx_path(labels, 1, ldims, &lab, err, errlen);
        if (rc != 0) {
            free(pix);
            return rc;
        }
    }
    return assemble(out, pix, idims, lab, ldims, images, err, errlen);
}

void route_data_free(route_dataset *d)
{
    if (!d)
        return;
    free(d->images);
    free(d->labels);
    memset(d, 0, sizeof *d);
}
