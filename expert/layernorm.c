/* expert/layernorm.c: LayerNorm over the last dimension (biased variance,
 * eps = EXPERT_LN_EPS, as torch.nn.LayerNorm). */
#include "expert/ops.h"
#include "expert/pool.h"
#include "expert/simd.h"

#include <errno.h>
#include <math.h>

EXPERT__CLONES
static void ln_fwd(float *out, float *mean, float *rstd, const float *inp,
                   const float *w, const float *b, int N0, int N1, int C)
{
    for (int n = N0; n < N1; n++) {
        const float *x = inp + (size_t)n * C;
        float *o = out + (size_t)n * C;
        /* Two passes (mean, then centred squares): the one-pass E[x²]-E[x]²
         * loses digits when |mean| >> std, as residual streams often are. */
        float s = 0.0f;
        for (int c = 0; c < C; c++)
            s += x[c];
        float m = s / (float)C;
        float v = 0.0f;
        for (int c = 0; c < C; c++) {
            float d = x[c] - m;
            v += d * d;
        }
        float r = 1.0f / sqrtf(v / (float)C + EXPERT_LN_EPS);
        for (int c = 0; c < C; c++)
            o[c] = (x[c] - m) * r * w[c] + b[c];
        if (mean)
            mean[n] = m;
        if (rstd)
            rstd[n] = r;
    }
}

EXPERT__CLONES
static void ln_bwd(float *dinp, float *dw, float *db, const float *dout,
                   const float *inp, const float *w, const float *mean,
                   const float *rstd, int N, int C)
{
    for (int n = 0; n < N; n++) {
        const float *x = inp + (size_t)n * C;
        const float *dy = dout + (size_t)n * C;
        float *dx = dinp + (size_t)n * C;
        float m = mean[n], r = rstd[n];
        float sum_dn = 0.0f, sum_dn_xh = 0.0f;
        for (int c = 0; c < C; c++) {
            float xh = (x[c] - m) * r;
            float dn = dy[c] * w[c];
            sum_dn += dn;
            sum_dn_xh += dn * xh;
            dw[c] += dy[c] * xh;
            db[c] += dy[c];
        }
        sum_dn /= (float)C;
        sum_dn_xh /= (float)C;
        for (int c = 0; c < C; c++) {
            float xh = (x[c] - m) * r;
            dx[c] = (dy[c] * w[c] - sum_dn - xh * sum_dn_xh) * r;
        }
    }
}

struct ln_job {
    float *out, *mean, *rstd;
    const float *inp, *w, *b;
    int N, C;
};

/* Rows are independent in the forward, so parts split by row. (The
 * backward's dw/db sums over rows; it stays on one thread.) */
static void ln_fwd_task(void *p, int i, int n)
{
    struct ln_job *j = p;
    size_t lo, hi;
    expert__split((size_t)j->N, i, n, 1, &lo, &hi);
    ln_fwd(j->out, j->mean, j->rstd, j->inp, j->w, j->b, (int)lo, (int)hi, j->C);
}

int expert_layernorm_forward(float *out, float *mean, float *rstd, const float *inp,
                             const float *w, const float *b, int N, int C)
{
    if (!out || !inp || !w || !b || N < 0 || C <= 0)
        return -EINVAL;
    struct ln_job j = { out, mean, rstd, inp, w, b, N, C };
    expert__parallel(ln_fwd_task, &j, (size_t)N * C);
    return 0;
}

int expert_layernorm_backward(float *dinp, float *dw, float *db, const float *dout,
                              const float *inp, const float *w, const float *mean,
                              const float *rstd, int N, int C)
{
    if (!dinp || !dw || !db || !dout || !inp || !w || !mean || !rstd || N < 0 || C <= 0)
        return -EINVAL;
    ln_bwd(dinp, dw, db, dout, inp, w, mean, rstd, N, C);
    return 0;
}
