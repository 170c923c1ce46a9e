/* expert/rmsnorm.c: RMSNorm over the last dimension (Hugging Face
 * LlamaRMSNorm: no mean subtracted, no bias; eps from the model). */
#include "expert/ops.h"
#include "expert/pool.h"
#include "expert/simd.h"

#include <errno.h>
#include <math.h>

EXPERT__CLONES
static void rms_fwd(float *out, float *rstd, const float *inp, const float *w, float eps, int N0, int N1, int C)
{
    for (int n = N0; n < N1; n++) {
        const float *x = inp + (size_t)n * C;
        float *o = out + (size_t)n * C;
        float ss = 0.0f;
        for (int c = 0; c < C; c++)
            ss += x[c] * x[c];
        float r = 1.0f / sqrtf(ss / (float)C + eps);
        /* torch: weight * (x * rsqrt(var + eps)): x·r rounded first. */
        for (int c = 0; c < C; c++) {
            float xn = x[c] * r;
            o[c] = w[c] * xn;
        }
        if (rstd)
            rstd[n] = r;
    }
}

struct rms_job {
    float *out, *rstd;
    const float *inp, *w;
    float eps;
    int N, C;
};

static void rms_fwd_task(void *p, int i, int n)
{
    struct rms_job *j = p;
    size_t lo, hi;
    expert__split((size_t)j->N, i, n, 1, &lo, &hi);
    rms_fwd(j->out, j->rstd, j->inp, j->w, j->eps, (int)lo, (int)hi, j->C);
}

int expert_rmsnorm_forward(float *out, float *rstd, const float *inp, const float *w, float eps, int N, int C)
{
    if (!out || !inp || !w || N < 0 || C <= 0 || !(eps > 0) || out == inp)
        return -EINVAL;
    struct rms_job j = {out, rstd, inp, w, eps, N, C};
    expert__parallel(rms_fwd_task, &j, (size_t)N * (size_t)C);
    return 0;
}

/* With x̂ = x·r and g = dout·w: dx = r · (g - x̂ · mean(g·x̂)), dw += dout·x̂. */
int expert_rmsnorm_backward(float *dinp, float *dw, const float *dout, const float *inp, const float *w,
                            const float *rstd, int N, int C)
{
    if (!dinp || !dw || !dout || !inp || !w || !rstd || N < 0 || C <= 0)
        return -EINVAL;
    for (int n = 0; n < N; n++) {
        const float *x = inp + (size_t)n * C, *dy = dout + (size_t)n * C;
        float *dx = dinp + (size_t)n * C;
        float r = rstd[n], dot = 0.0f;
        for (int c = 0; c < C; c++) {
            float xh = x[c] * r;
            dot += dy[c] * w[c] * xh;
            dw[c] += dy[c] * xh;
        }
        dot /= (float)C;
        for (int c = 0; c < C; c++)
            dx[c] = r * (dy[c] * w[c] - x[c] * r * dot);
    }
    return 0;
}
