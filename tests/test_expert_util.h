/* tests/test_expert_util.h: helpers for the expert/ tests: seeded random
 * tensors, tolerance checks that print what missed, central-difference
 * gradient checks, and the reference fixture reader (tests/ref/). */
#ifndef TESTS_TEST_EXPERT_UTIL_H
#define TESTS_TEST_EXPERT_UTIL_H

#include "test_util.h"

#include <math.h>

static inline uint64_t tx_rng_next(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

/* Uniform in [-1, 1). */
static inline float tx_uniform(uint64_t *s)
{
    return (float)((double)(tx_rng_next(s) >> 11) * (2.0 / 9007199254740992.0) - 1.0);
}

static inline void tx_fill(float *x, size_t n, uint64_t *s, float scale)
{
    for (size_t i = 0; i < n; i++)
        x[i] = tx_uniform(s) * scale;
}

static inline float *tx_alloc(size_t n)
{
    float *p = calloc(n ? n : 1, sizeof(float));
    assert_non_null(p);
    return p;
}

/* Compares got with want elementwise: miss when !(|got-want| <= atol +
 * rtol·|want|) (NaN-safe). Prints the first 5 misses and the max abs/rel
 * difference; returns the number of misses. */
static inline int tx_check(const float *got, const float *want, size_t n, double atol,
                           double rtol, const char *what)
{
    int miss = 0;
    double maxabs = 0.0, maxrel = 0.0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)got[i] - (double)want[i]);
        double tol = atol + rtol * fabs((double)want[i]);
        if (!(d <= tol)) {
            if (miss < 5)
                fprintf(stderr, "  %s[%zu]: got %.8g want %.8g (diff %.3g)\n", what, i,
                        (double)got[i], (double)want[i], d);
            miss++;
        }
        if (d > maxabs)
            maxabs = d;
        if (fabs((double)want[i]) > 1e-6 && d / fabs((double)want[i]) > maxrel)
            maxrel = d / fabs((double)want[i]);
    }
    if (miss)
        fprintf(stderr, "%s: %d/%zu miss (max abs %.3g, max rel %.3g)\n", what, miss, n,
                maxabs, maxrel);
    return miss;
}

/* Central-difference gradient check. f(ctx, out) computes the forward from
 * the current contents of x (and whatever else ctx holds); the loss is
 * L = Σ out·r in double. Perturbs every x[i] by ±eps and compares
 * (L+ - L-)/2eps with analytic[i]. Returns misses (printed). */
typedef void (*tx_fwd_fn)(void *ctx, float *out);

static inline double tx_loss(tx_fwd_fn f, void *ctx, float *out, const float *r, size_t nout)
{
    f(ctx, out);
    double l = 0.0;
    for (size_t i = 0; i < nout; i++)
        l += (double)out[i] * (double)r[i];
    return l;
}

static inline int tx_gradcheck(const char *what, tx_fwd_fn f, void *ctx, float *x, size_t nx,
                               const float *analytic, float *out, const float *r,
                               size_t nout, float eps, double atol, double rtol)
{
    float *num = tx_alloc(nx);
    for (size_t i = 0; i < nx; i++) {
        float keep = x[i];
        x[i] = keep + eps;
        double lp = tx_loss(f, ctx, out, r, nout);
        x[i] = keep - eps;
        double lm = tx_loss(f, ctx, out, r, nout);
        x[i] = keep;
        num[i] = (float)((lp - lm) / (2.0 * (double)eps));
    }
    int miss = tx_check(analytic, num, nx, atol, rtol, what);
    free(num);
    return miss;
}

/* ---- reference fixtures (format: tests/ref/gen_blocks.py) ---- */

struct tx_file {
    unsigned char *data;
    size_t len, pos;
};

static inline void tx_file_open(struct tx_file *f, const char *name)
{
    const char *root = getenv("STARLING_SOURCE_ROOT");
    char path[4096];
    snprintf(path, sizeof path, "%s/tests/ref/%s", root && *root ? root : ".", name);
    FILE *fp = fopen(path, "rb");
    if (!fp)
        fprintf(stderr, "cannot open fixture %s\n", path);
    assert_non_null(fp);
    assert_int_equal(fseek(fp, 0, SEEK_END), 0);
    long len = ftell(fp);
    assert_true(len > 12);
    rewind(fp);
    f->data = malloc((size_t)len);
    assert_non_null(f->data);
    assert_int_equal(fread(f->data, 1, (size_t)len, fp), (size_t)len);
    fclose(fp);
    f->len = (size_t)len;
    f->pos = 0;
    assert_memory_equal(f->data, "STRLREF1", 8);
    f->pos = 8;
}

static inline uint32_t tx_file_u32(struct tx_file *f)
{
    assert_true(f->pos + 4 <= f->len);
    uint32_t v;
    memcpy(&v, f->data + f->pos, 4);
    f->pos += 4;
    return v;
}

static inline float *tx_file_f32(struct tx_file *f, size_t n)
{
    assert_true(f->pos + 4 * n <= f->len);
    float *p = tx_alloc(n);
    memcpy(p, f->data + f->pos, 4 * n);
    f->pos += 4 * n;
    return p;
}

static inline void tx_file_close(struct tx_file *f)
{
    assert_int_equal(f->pos, f->len); /* read exactly the whole fixture */
    free(f->data);
    f->data = NULL;
}

#endif
