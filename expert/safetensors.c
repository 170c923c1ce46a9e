/* expert/safetensors.c: safetensors weight files, read and written (see
 * safetensors.h). */
#include "expert/safetensors.h"
#include "expert/atomicfile.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <jansson.h>

struct expert_st_file {
    int fd;
    char *path;
    uint64_t data_at;              /* file offset of the data: 8 + N */
    int n;
    expert_st_tensor *t;           /* sorted by begin */
    json_t *meta;                  /* the "__metadata__" object, or NULL */
};

static int fail(char *err, size_t errlen, int rc, const char *fmt, ...) __attribute__((format(printf, 4, 5)));

static int fail(char *err, size_t errlen, int rc, const char *fmt, ...)
{
    if (err && errlen) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, errlen, fmt, ap);
        va_end(ap);
    }
    return rc;
}

static uint64_t get_le64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = v << 8 | p[i];
    return v;
}

static void put_le64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

float expert_st_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13); /* inf, NaN (payload kept) */
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign; /* ±0 */
    } else {
        /* a subnormal: normalise it */
        int e = -1;
        do {
            e++;
            man <<= 1;
        } while (!(man & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

float expert_st_bf16_to_f32(uint16_t h)
{
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static const char *dtype_name(expert_st_dtype d)
{
    static const char *names[] = {"F32", "F16", "BF16", "F64"};
    return names[d];
}

static size_t dtype_size(expert_st_dtype d)
{
    return d == EXPERT_ST_F32 ? 4 : d == EXPERT_ST_F64 ? 8 : 2;
}

/* The dtype named s: 0 and *out, or -1 for a dtype safetensors has that is
 * not a float format read here, -2 for one it does not have. */
static int parse_dtype(const char *s, expert_st_dtype *out)
{
    static const char *known_other[] = {"BOOL", "U8", "I8", "I16", "U16", "I32", "U32", "I64", "U64",
                                        "F8_E5M2", "F8_E4M3", "F8_E8M0", "F4", "F6_E2M3", "F6_E3M2",
                                        "C64"};
    for (int d = EXPERT_ST_F32; d <= EXPERT_ST_F64; d++)
        if (!strcmp(s, dtype_name((expert_st_dtype)d))) {
            *out = (expert_st_dtype)d;
            return 0;
        }
    for (size_t i = 0; i < sizeof known_other / sizeof *known_other; i++)
        if (!strcmp(s, known_other[i]))
            return -1;
    return -2;
}

/* A non-negative JSON integer into *v. */
static int get_u64(const json_t *j, uint64_t *v)
{
    if (!json_is_integer(j) || json_integer_value(j) < 0)
        return -1;
    *v = (uint64_t)json_integer_value(j);
    return 0;
}

/* Reads entry `name` = e into t (data bytes: size). Returns 0 or -EINVAL
 * with err. */
static int parse_entry(const char *path, const char *name, const json_t *e, uint64_t size, expert_st_tensor *t,
                       char *err, size_t errlen)
{
    if (!*name || strlen(name) > EXPERT_ST_NAME_MAX)
        return fail(err, errlen, -EINVAL, "%s: a tensor name is empty or longer than %d bytes", path,
                    EXPERT_ST_NAME_MAX);
    if (!json_is_object(e))
        return fail(err, errlen, -EINVAL, "%s: tensor %s: its entry is not a JSON object", path, name);
    const json_t *dt = json_object_get(e, "dtype"), *sh = json_object_get(e, "shape"),
                 *off = json_object_get(e, "data_offsets");
    if (!json_is_string(dt) || !json_is_array(sh) || !json_is_array(off) || json_object_size(e) != 3)
        return fail(err, errlen, -EINVAL,
                    "%s: tensor %s: its entry must have exactly dtype (a string), shape and data_offsets "
                    "(arrays)", path, name);
    int k = parse_dtype(json_string_value(dt), &t->dtype);
    if (k != 0)
        return fail(err, errlen, -EINVAL, "%s: tensor %s: dtype %s %s", path, name, json_string_value(dt),
                    k == -1 ? "is not a float format (F32, F16, BF16 and F64 are read)" : "is not a safetensors dtype");
    size_t nd = json_array_size(sh);
    if (nd > EXPERT_ST_MAX_DIMS)
        return fail(err, errlen, -EINVAL, "%s: tensor %s: %zu dimensions (at most %d)", path, name, nd,
                    EXPERT_ST_MAX_DIMS);
    t->ndim = (int)nd;
    t->count = 1;
    for (size_t i = 0; i < nd; i++) {
        if (get_u64(json_array_get(sh, i), &t->shape[i]) != 0)
            return fail(err, errlen, -EINVAL, "%s: tensor %s: shape[%zu] is not a non-negative integer", path,
                        name, i);
        if (t->shape[i] != 0 && t->count > UINT64_MAX / 8 / t->shape[i])
            return fail(err, errlen, -EINVAL, "%s: tensor %s: its shape is too large", path, name);
        t->count *= t->shape[i];
    }
    if (json_array_size(off) != 2 || get_u64(json_array_get(off, 0), &t->begin) != 0 ||
        get_u64(json_array_get(off, 1), &t->end) != 0)
        return fail(err, errlen, -EINVAL, "%s: tensor %s: data_offsets must be two non-negative integers", path,
                    name);
    if (t->begin > t->end || t->end > size)
        return fail(err, errlen, -EINVAL, "%s: tensor %s: data_offsets [%llu, %llu] are outside the %llu bytes of "
                                          "data", path, name, (unsigned long long)t->begin,
                    (unsigned long long)t->end, (unsigned long long)size);
    if (t->end - t->begin != t->count * dtype_size(t->dtype))
        return fail(err, errlen, -EINVAL, "%s: tensor %s: data_offsets hold %llu bytes, its shape and dtype %s "
                                          "%llu", path, name, (unsigned long long)(t->end - t->begin),
                    dtype_name(t->dtype), (unsigned long long)(t->count * dtype_size(t->dtype)));
    return 0;
}

static int by_begin(const void *a, const void *b)
{
    const expert_st_tensor *x = a, *y = b;
    if (x->begin != y->begin)
        return x->begin < y->begin ? -1 : 1;
    return (x->end > y->end) - (x->end < y->end);
}

/* The entries of header h into f (data bytes: size); offsets must tile
 * the data. */
static int parse_header(expert_st_file *f, json_t *h, uint64_t size, char *err, size_t errlen)
{
    size_t n = json_object_size(h);
    json_t *meta = json_object_get(h, "__metadata__");
    if (meta) {
        n--;
        const char *k;
        json_t *v;
        if (!json_is_object(meta))
            return fail(err, errlen, -EINVAL, "%s: __metadata__ is not a JSON object", f->path);
        json_object_foreach(meta, k, v)
        {
            if (!json_is_string(v))
                return fail(err, errlen, -EINVAL, "%s: __metadata__.%s is not a string", f->path, k);
        }
        f->meta = json_incref(meta);
    }
    if (n > EXPERT_ST_MAX_TENSORS)
        return fail(err, errlen, -EINVAL, "%s: %zu tensors (at most %d)", f->path, n, EXPERT_ST_MAX_TENSORS);
    f->t = calloc(n ? n : 1, sizeof *f->t);
    if (!f->t)
        return fail(err, errlen, -ENOMEM, "%s: out of memory", f->path);
    const char *name;
    json_t *e;
    json_object_foreach(h, name, e)
    {
        if (e == meta)
            continue;
        expert_st_tensor *t = &f->t[f->n];
        int rc = parse_entry(f->path, name, e, size, t, err, errlen);
        if (rc != 0)
            return rc;
        if (!(t->name = strdup(name)))
            return fail(err, errlen, -ENOMEM, "%s: out of memory", f->path);
        f->n++;
    }
    qsort(f->t, (size_t)f->n, sizeof *f->t, by_begin);
    uint64_t at = 0;
    for (int i = 0; i < f->n; i++) {
        if (f->t[i].begin != at)
            return fail(err, errlen, -EINVAL, "%s: tensor %s starts at byte %llu of the data where %llu was "
                                              "expected (the tensors' bytes %s)", f->path, f->t[i].name,
                        (unsigned long long)f->t[i].begin, (unsigned long long)at,
                        f->t[i].begin < at ? "overlap" : "leave a hole");
        at = f->t[i].end;
    }
    if (at != size)
        return fail(err, errlen, -EINVAL, "%s: the tensors cover %llu bytes of data, the file holds %llu", f->path,
                    (unsigned long long)at, (unsigned long long)size);
    return 0;
}

/* Reads the header of f (file size fsize) and parses it. */
static int read_header(expert_st_file *f, uint64_t fsize, char *err, size_t errlen)
{
    uint8_t len8[8];
    if (fsize < 8 || pread(f->fd, len8, 8, 0) != 8)
        return fail(err, errlen, -EINVAL, "%s: not a safetensors file (shorter than its 8-byte header length)",
                    f->path);
    uint64_t hn = get_le64(len8);
    if (hn > EXPERT_ST_MAX_HEADER || hn > fsize - 8 || hn < 2)
        return fail(err, errlen, -EINVAL, "%s: not a safetensors file (a header of %llu bytes in a file of %llu)",
                    f->path, (unsigned long long)hn, (unsigned long long)fsize);
    char *buf = malloc(hn);
    if (!buf)
        return fail(err, errlen, -ENOMEM, "%s: out of memory for its %llu-byte header", f->path,
                    (unsigned long long)hn);
    if (pread(f->fd, buf, hn, 8) != (ssize_t)hn) {
        free(buf);
        return fail(err, errlen, -EIO, "%s: cannot read its header", f->path);
    }
    json_error_t je;
    json_t *h = json_loadb(buf, hn, JSON_REJECT_DUPLICATES, &je);
    free(buf);
    if (!h)
        return fail(err, errlen, -EINVAL, "%s: the header is not JSON: %s (byte %d)", f->path, je.text,
                    je.position);
    int rc = json_is_object(h) ? 0 : fail(err, errlen, -EINVAL, "%s: the header is not a JSON object", f->path);
    f->data_at = 8 + hn;
    if (rc == 0)
        rc = parse_header(f, h, fsize - f->data_at, err, errlen);
    json_decref(h);
    return rc;
}

int expert_st_open(expert_st_file **out, const char *path, char *err, size_t errlen)
{
    if (err && errlen)
        err[0] = '\0';
    if (!out || !path)
        return fail(err, errlen, -EINVAL, "no file");
    *out = NULL;
    expert_st_file *f = calloc(1, sizeof *f);
    if (!f || !(f->path = strdup(path))) {
        free(f);
        return fail(err, errlen, -ENOMEM, "%s: out of memory", path);
    }
    f->fd = open(path, O_RDONLY | O_CLOEXEC);
    struct stat st;
    if (f->fd < 0 || fstat(f->fd, &st) != 0) {
        int e = errno;
        expert_st_close(&f);
        return fail(err, errlen, -e, "%s: %s", path, strerror(e));
    }
    if (!S_ISREG(st.st_mode)) {
        expert_st_close(&f);
        return fail(err, errlen, -EINVAL, "%s: not a regular file", path);
    }
    int rc = read_header(f, (uint64_t)st.st_size, err, errlen);
    if (rc != 0) {
        expert_st_close(&f);
        return rc;
    }
    *out = f;
    return 0;
}

int expert_st_count(const expert_st_file *f)
{
    return f ? f->n : 0;
}

const expert_st_tensor *expert_st_at(const expert_st_file *f, int i)
{
    return f && i >= 0 && i < f->n ? &f->t[i] : NULL;
}

const expert_st_tensor *expert_st_find(const expert_st_file *f, const char *name)
{
    for (int i = 0; f && name && i < f->n; i++)
        if (!strcmp(f->t[i].name, name))
            return &f->t[i];
    return NULL;
}

const char *expert_st_metadata(const expert_st_file *f, const char *key)
{
    return f && f->meta && key ? json_string_value(json_object_get(f->meta, key)) : NULL;
}

int expert_st_read(expert_st_file *f, const expert_st_tensor *t, float *out, size_t cap, char *err, size_t errlen)
{
    if (!f || !t || (!out && t->count) || cap < t->count)
        return fail(err, errlen, -EINVAL, "%s: tensor %s: no room for its %llu values", f ? f->path : "?",
                    t ? t->name : "?", t ? (unsigned long long)t->count : 0ULL);
    size_t es = dtype_size(t->dtype);
    /* In chunks through a small buffer: the conversion needs no copy of
     * the whole tensor in its file format. */
    uint8_t buf[1 << 16];
    uint64_t done = 0, per = sizeof buf / es;
    while (done < t->count) {
        uint64_t k = t->count - done < per ? t->count - done : per;
        off_t at = (off_t)(f->data_at + t->begin + done * es);
        if (pread(f->fd, buf, (size_t)(k * es), at) != (ssize_t)(k * es))
            return fail(err, errlen, -EIO, "%s: tensor %s: a short read (the file changed?)", f->path, t->name);
        for (uint64_t i = 0; i < k; i++) {
            const uint8_t *p = buf + i * es;
            float v;
            if (t->dtype == EXPERT_ST_F32) {
                uint32_t b = (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
                memcpy(&v, &b, sizeof v);
            } else if (t->dtype == EXPERT_ST_F64) {
                uint64_t b = get_le64(p);
                double d;
                memcpy(&d, &b, sizeof d);
                v = (float)d;
            } else {
                uint16_t b = (uint16_t)(p[0] | p[1] << 8);
                v = t->dtype == EXPERT_ST_F16 ? expert_st_f16_to_f32(b) : expert_st_bf16_to_f32(b);
            }
            out[done + i] = v;
        }
        done += k;
    }
    return 0;
}

void expert_st_close(expert_st_file **pf)
{
    if (!pf || !*pf)
        return;
    expert_st_file *f = *pf;
    if (f->fd >= 0)
        close(f->fd);
    for (int i = 0; f->t && i < f->n; i++)
        free((char *)f->t[i].name);
    free(f->t);
    json_decref(f->meta);
    free(f->path);
    free(f);
    *pf = NULL;
}

/* ---- writing ---- */

/* A JSON entry for tensor t whose data starts at *off (moved past it). */
static json_t *out_entry(const expert_st_out *t, uint64_t *off)
{
    json_t *e = json_object(), *shape = json_array(), *offs = json_array();
    uint64_t count = 1;
    int ok = e && shape && offs;
    for (int d = 0; ok && d < t->ndim; d++) {
        count *= t->shape[d];
        ok = json_array_append_new(shape, json_integer((json_int_t)t->shape[d])) == 0;
    }
    ok = ok && json_array_append_new(offs, json_integer((json_int_t)*off)) == 0 &&
         json_array_append_new(offs, json_integer((json_int_t)(*off + 4 * count))) == 0 &&
         json_object_set_new(e, "dtype", json_string("F32")) == 0 && json_object_set(e, "shape", shape) == 0 &&
         json_object_set(e, "data_offsets", offs) == 0;
    json_decref(shape);
    json_decref(offs);
    *off += 4 * count;
    if (!ok) {
        json_decref(e);
        return NULL;
    }
    return e;
}

/* The header of t[0..n) and meta as compact JSON, padded with spaces to a
 * multiple of 8; NULL with err on bad input or no memory. */
static char *build_header(const char *path, const expert_st_out *t, int n, const char *const *meta, int n_meta,
                          size_t *len, char *err, size_t errlen)
{
    json_t *h = json_object(), *m = n_meta > 0 ? json_object() : NULL;
    int nomem = !h || (n_meta > 0 && !m), bad = 0;
    for (int i = 0; !nomem && !bad && i < n_meta; i++) {
        if (!meta[2 * i] || !meta[2 * i + 1])
            bad = fail(err, errlen, -EINVAL, "%s: metadata pair %d lacks its key or value", path, i);
        else if (json_object_set_new(m, meta[2 * i], json_string(meta[2 * i + 1])) != 0)
            nomem = 1;
    }
    if (!nomem && !bad && m && json_object_set(h, "__metadata__", m) != 0)
        nomem = 1;
    uint64_t off = 0;
    for (int i = 0; !nomem && !bad && i < n; i++) {
        const char *name = t[i].name;
        if (!name || !*name || strlen(name) > EXPERT_ST_NAME_MAX || !strcmp(name, "__metadata__") ||
            json_object_get(h, name) || t[i].ndim < 0 || t[i].ndim > EXPERT_ST_MAX_DIMS) {
            bad = fail(err, errlen, -EINVAL, "%s: tensor %d (%s): a bad or repeated name, or a bad shape", path, i,
                       name ? name : "no name");
            break;
        }
        json_t *e = out_entry(&t[i], &off);
        if (!e || json_object_set_new(h, name, e) != 0)
            nomem = 1;
    }
    char *s = !nomem && !bad ? json_dumps(h, JSON_COMPACT | JSON_PRESERVE_ORDER) : NULL;
    json_decref(m);
    json_decref(h);
    size_t sl = s ? strlen(s) : 0, padded = (sl + 7) / 8 * 8;
    char *p = s ? realloc(s, padded + 1) : NULL;
    if (!p) {
        free(s);
        if (!bad)
            fail(err, errlen, -ENOMEM, "%s: out of memory for the header", path);
        return NULL;
    }
    memset(p + sl, ' ', padded - sl);
    p[padded] = '\0';
    *len = padded;
    return p;
}

/* The data of t[0..n), little-endian f32, to f. */
static int write_data(expert_atomic_file *f, const expert_st_out *t, int n)
{
    uint8_t buf[1 << 16];
    for (int i = 0; i < n; i++) {
        uint64_t count = 1;
        for (int d = 0; d < t[i].ndim; d++)
            count *= t[i].shape[d];
        for (uint64_t done = 0; done < count;) {
            uint64_t k = count - done < sizeof buf / 4 ? count - done : sizeof buf / 4;
            for (uint64_t j = 0; j < k; j++) {
                uint32_t b;
                memcpy(&b, &t[i].data[done + j], 4);
                for (int q = 0; q < 4; q++)
                    buf[4 * j + (uint64_t)q] = (uint8_t)(b >> (8 * q));
            }
            int rc = expert_atomic_write(f, buf, (size_t)(4 * k));
            if (rc != 0)
                return rc;
            done += k;
        }
    }
    return 0;
}

int expert_st_write(const char *path, const expert_st_out *t, int n, const char *const *meta, int n_meta,
                    char *err, size_t errlen)
{
    if (err && errlen)
        err[0] = '\0';
    if (!path || n < 0 || (n > 0 && !t) || (n_meta > 0 && !meta))
        return fail(err, errlen, -EINVAL, "nothing to write");
    for (int i = 0; i < n; i++)
        if (!t[i].data && t[i].ndim > 0)
            return fail(err, errlen, -EINVAL, "%s: tensor %s has no data", path, t[i].name ? t[i].name : "?");
    size_t hl = 0;
    char *h = build_header(path, t, n, meta, n_meta, &hl, err, errlen);
    if (!h)
        return -EINVAL;
    expert_atomic_file f;
    int rc = expert_atomic_open(&f, path);
    uint8_t len8[8];
    put_le64(len8, hl);
    if (rc == 0) {
        expert_atomic_write(&f, len8, 8);
        expert_atomic_write(&f, h, hl);
        write_data(&f, t, n);
        rc = expert_atomic_commit(&f);
    }
    if (rc != 0)
        fail(err, errlen, rc, "%s: cannot write: %s", path, strerror(-rc));
    free(h);
    return rc;
}
