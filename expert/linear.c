/* expert/linear.c: fully connected layer on OpenBLAS sgemm (PyTorch layout,
 * w is (OC, C)). The transposes are sgemm flags, never copies. */
#include "expert/ops.h"

#include <errno.h>
#include <string.h>

#include <cblas.h>

int expert_linear_forward(float *out, const float *inp, const float *w,
                          const float *bias, int B, int C, int OC)
{
    if (!out || !inp || !w || B < 0 || C <= 0 || OC <= 0)
        return -EINVAL;
    if (B == 0)
        return 0;
    float beta = 0.0f;
    if (bias) {
        /* Seed out with the bias and let sgemm accumulate onto it (beta=1):
         * one write pass instead of a GEMM plus a second read-modify pass. */
        for (int b = 0; b < B; b++)
            memcpy(out + (size_t)b * OC, bias, (size_t)OC * sizeof *out);
        beta = 1.0f;
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, B, OC, C,
                1.0f, inp, C, w, C, beta, out, OC);
    return 0;
}

int expert_linear_backward(float *dinp, float *dw, float *dbias, const float *dout,
                           const float *inp, const float *w, int B, int C, int OC)
{
    if (!dw || !dout || !inp || !w || B < 0 || C <= 0 || OC <= 0)
        return -EINVAL;
    if (B == 0) {
        return 0;
    }
    if (dinp) /* dinp (B,C) = dout (B,OC) · w (OC,C) */
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, B, C, OC,
                    1.0f, dout, OC, w, C, 0.0f, dinp, C);
    /* dw (OC,C) += doutᵀ (OC,B) · inp (B,C); beta=1 accumulates in place. */
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, OC, C, B,
                1.0f, dout, OC, inp, C, 1.0f, dw, C);
    if (dbias)
        return expert_bias_backward(dbias, dout, B, OC);
    return 0;
}

int expert_matmul_forward(float *out, const float *res, const float *inp, const float *w,
                          const uint16_t *w16, const float *bias, int B, int C, int OC)
{
    (void)w16; /* the CPU computes in fp32 */
    if (!res)
        return expert_linear_forward(out, inp, w, bias, B, C, OC);
    if (!out || !inp || !w || B < 0 || C <= 0 || OC <= 0)
        return -EINVAL;
    if (B == 0)
        return 0;
    /* out = res + bias first, then sgemm accumulates inp·wᵀ onto it (beta
     * 1): bias and residual cost one pass, fused with the GEMM's C read. */
    if (bias)
        expert_bias_forward(out, res, bias, B, OC);
    else if (out != res)
        memcpy(out, res, (size_t)B * (size_t)OC * sizeof *out);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, B, OC, C,
                1.0f, inp, C, w, C, 1.0f, out, OC);
    return 0;
}

int expert_matmul_backward(float *dinp, float *dw, float *dbias, const float *dout,
                           const float *inp, const float *w, const uint16_t *w16, int B, int C,
                           int OC)
{
    (void)w16;
    if (!dw || !dout || !inp || !w || B < 0 || C <= 0 || OC <= 0)
        return -EINVAL;
    if (B == 0)
        return 0;
    if (dbias)
        expert_bias_backward(dbias, dout, B, OC);
    /* dw first: dinp may alias inp. */
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, OC, C, B,
                1.0f, dout, OC, inp, C, 1.0f, dw, C);
    if (dinp)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, B, C, OC,
                    1.0f, dout, OC, w, C, 0.0f, dinp, C);
    return 0;
}
