/* expert/bias.c: broadcast bias add and its row-sum backward. */
#include "expert/ops.h"
#include "expert/simd.h"

#include <errno.h>

EXPERT__CLONES
static void bias_fwd(float *out, const float *inp, const float *bias, int B, int C)
{
    for (int b = 0; b < B; b++) {
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

int expert_bias_forward(float *out, const float *inp, const float *bias, int B, int C)
{
    if (!out || !inp || !bias || B < 0 || C <= 0)
        return -EINVAL;
    bias_fwd(out, inp, bias, B, C);
    return 0;
}

int expert_bias_backward(float *dbias, const float *dout, int B, int C)
{
    if (!dbias || !dout || B < 0 || C <= 0)
        return -EINVAL;
    bias_bwd(dbias, dout, B, C);
    return 0;
}
