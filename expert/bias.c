/* expert/bias.c: broadcast bias add and its row-sum backward. */
#include "expert/ops.h"
#include "expert/pool.h"
#include "expert/simd.h"

#include <errno.h>

EXPERT__CLONES
static void bias_fwd(float *out, const float *inp, const float *bias, int B0, int B1, int C)
{
    for (int b = B0; b < B1; b++) {
        float *o = out + (size_t)b * C;
        const float *x = inp + (size_t)b * C;
        for (int c = 0; c < C; c++)
            o[c] = x[c] + bias[c];
    }
}

EXPERT__CLONES
static void bias_bwd(float *dbias, const float *dout, int B, int C)
{
    /* Row by row, so the inner loop is a vectorisable elementwise add. */
    for (int b = 0; b < B; b++) {
        const float *d = dout + (size_t)b * C;
        for (int c = 0; c < C; c++)
            dbias[c] += d[c];
    }
}

struct bias_job {
    float *out;
    const float *inp, *bias;
    int B, C;
};

static void bias_fwd_task(void *p, int i, int n)
{
    struct bias_job *j = p;
    size_t lo, hi;
    expert__split((size_t)j->B, i, n, 1, &lo, &hi);
    bias_fwd(j->out, j->inp, j->bias, (int)lo, (int)hi, j->C);
}

int expert_bias_forward(float *out, const float *inp, const float *bias, int B, int C)
{
    if (!out || !inp || !bias || B < 0 || C <= 0)
        return -EINVAL;
    struct bias_job j = { out, inp, bias, B, C };
    expert__parallel(bias_fwd_task, &j, (size_t)B * C);
    return 0;
}

int expert_bias_backward(float *dbias, const float *dout, int B, int C)
{
    if (!dbias || !dout || B < 0 || C <= 0)
        return -EINVAL;
    bias_bwd(dbias, dout, B, C);
    return 0;
}
