/* expert/gelu.c: GELU (exact erf form, as torch.nn.GELU()) and the fused
 * bias+GELU pass the feed-forward block uses on its hidden activations. */
#include "expert/ops.h"
#include "expert/pool.h"
#include "expert/simd.h"

#include <errno.h>

/* mode 0: out = gelu(x); 1: out = gelu(x), d = gelu'(x); 2: out = dy·gelu'(x).
 * x = inp (+ bias, broadcast over rows of C when bias != NULL; then the
 * biased value is written back to pre when pre != NULL). One row at a time,
 * vectors of EXPERT__VW with a padded tail. */
EXPERT__INLINE void gelu_row(float *out, float *d, float *pre, const float *inp,
                             const float *bias, const float *dy, long n, int mode)
{
    long i = 0;
    for (; i + EXPERT__VW <= n; i += EXPERT__VW) {
        expert__vf x, g, dg;
        memcpy(&x, inp + i, sizeof x);
        if (bias) {
            expert__vf bv;
            memcpy(&bv, bias + i, sizeof bv);
            x += bv;
            if (pre)
                memcpy(pre + i, &x, sizeof x);
        }
        expert__vgelu(x, &g, &dg);
        if (mode == 2) {
            expert__vf yv;
            memcpy(&yv, dy + i, sizeof yv);
            g = yv * dg;
        }
        memcpy(out + i, &g, sizeof g);
        if (mode == 1)
            memcpy(d + i, &dg, sizeof dg);
    }
    if (i < n) {
        long r = n - i;
        float xs[EXPERT__VW] = { 0 }, bs[EXPERT__VW] = { 0 }, ys[EXPERT__VW] = { 0 };
        memcpy(xs, inp + i, (size_t)r * sizeof(float));
        if (bias)
            memcpy(bs, bias + i, (size_t)r * sizeof(float));
        if (mode == 2)
            memcpy(ys, dy + i, (size_t)r * sizeof(float));
        expert__vf x, bv, yv, g, dg;
        memcpy(&x, xs, sizeof x);
        memcpy(&bv, bs, sizeof bv);
        memcpy(&yv, ys, sizeof yv);
        x += bv;
        expert__vgelu(x, &g, &dg);
        if (mode == 2)
            g = yv * dg;
        float gs[EXPERT__VW], ds[EXPERT__VW];
        memcpy(xs, &x, sizeof x);
        memcpy(gs, &g, sizeof g);
        memcpy(ds, &dg, sizeof dg);
        if (bias && pre)
            memcpy(pre + i, xs, (size_t)r * sizeof(float));
        memcpy(out + i, gs, (size_t)r * sizeof(float));
        if (mode == 1)
            memcpy(d + i, ds, (size_t)r * sizeof(float));
    }
}

EXPERT__CLONES
static void gelu_fwd(float *out, const float *inp, long N)
{
    gelu_row(out, NULL, NULL, inp, NULL, NULL, N, 0);
}

EXPERT__CLONES
static void gelu_bwd(float *dinp, const float *dout, const float *inp, long N)
{
    gelu_row(dinp, NULL, NULL, inp, NULL, dout, N, 2);
}

EXPERT__CLONES
static void bias_gelu_fwd(float *out, float *dgelu, float *pre, const float *bias,
                          int B0, int B1, int C)
{
    for (int b = B0; b < B1; b++) {
        size_t o = (size_t)b * C;
        /* pre is read, biased, written back, then out (may alias pre) written. */
        gelu_row(out + o, dgelu ? dgelu + o : NULL, pre + o, pre + o, bias, NULL, C,
                 dgelu ? 1 : 0);
    }
}

/* Columns [C0, C1) of every row: splitting by column keeps each dbias
 * element in one task, so the parts need no reduction. */
EXPERT__CLONES
static void bias_gelu_bwd(float *dpre, float *dbias, const float *dout,
                          const float *dgelu, int B, int C, int C0, int C1)
{
    for (int b = 0; b < B; b++) {
        float *dp = dpre + (size_t)b * C;
        const float *dy = dout + (size_t)b * C;
        const float *d = dgelu + (size_t)b * C;
        for (int c = C0; c < C1; c++) {
            float v = dy[c] * d[c];
            dp[c] = v;
            dbias[c] += v;
        }
    }
}

int expert_gelu_forward(float *out, const float *inp, long N)
{
    if (!out || !inp || N < 0)
        return -EINVAL;
    gelu_fwd(out, inp, N);
    return 0;
}

int expert_gelu_backward(float *dinp, const float *dout, const float *inp, long N)
{
    if (!dinp || !dout || !inp || N < 0)
        return -EINVAL;
    gelu_bwd(dinp, dout, inp, N);
    return 0;
}

struct bg_job {
    float *out, *dgelu, *pre, *dpre, *dbias;
    const float *bias, *dout, *dg;
    int B, C;
};

static void bg_fwd_task(void *p, int i, int n)
{
    struct bg_job *j = p;
    size_t lo, hi;
    expert__split((size_t)j->B, i, n, 1, &lo, &hi);
    bias_gelu_fwd(j->out, j->dgelu, j->pre, j->bias, (int)lo, (int)hi, j->C);
}

static void bg_bwd_task(void *p, int i, int n)
{
    struct bg_job *j = p;
    size_t lo, hi;
    expert__split((size_t)j->C, i, n, 16, &lo, &hi); /* whole cache lines */
    bias_gelu_bwd(j->dpre, j->dbias, j->dout, j->dg, j->B, j->C, (int)lo, (int)hi);
}

int expert_bias_gelu_forward(float *out, float *dgelu, float *pre, const float *bias,
                             int B, int C)
{
    if (!out || !pre || !bias || B < 0 || C <= 0)
        return -EINVAL;
    struct bg_job j = { .out = out, .dgelu = dgelu, .pre = pre, .bias = bias, .B = B, .C = C };
    expert__parallel(bg_fwd_task, &j, (size_t)B * C);
    return 0;
}

int expert_bias_gelu_backward(float *dpre, float *dbias, const float *dout,
                              const float *dgelu, int B, int C)
{
    if (!dpre || !dbias || !dout || !dgelu || B < 0 || C <= 0)
        return -EINVAL;
    struct bg_job j = { .dpre = dpre, .dbias = dbias, .dout = dout, .dg = dgelu, .B = B, .C = C };
    expert__parallel(bg_bwd_task, &j, (size_t)B * C);
    return 0;
}
