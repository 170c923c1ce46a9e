/* expert/resffn.c: the RESFFN kind, a pre-LN residual feed-forward block
 * (common.py's ResFFN(d, hidden); in = out = d, H = hidden).
 *   inp    (B, d)
 *   ln     (B, d)   = LN(inp), mean and rstd (B) saved
 *   act    (B, H)   = gelu(ln·W1ᵀ + b1), gelu' saved as dgelu
 *   out    (B, d)   = inp + act·W2ᵀ + b2
 * Tensors: ln_w (d), ln_b (d), fc1_w (H,d), fc1_b (H), fc2_w (d,H),
 * fc2_b (d). */
#include "expert/kinds_internal.h"
#include "expert/ops.h"

#include <cblas.h>

enum { LN_W, LN_B, FC1_W, FC1_B, FC2_W, FC2_B };

void expert__resffn_forward(const struct expert_block_config *c, const struct expert_tensor_info *t,
                            const float *params, struct expert__vec_ws *ws, float *out,
                            const float *inp, int B, int want_dgelu)
{
    int d = c->in, h = c->hidden;
    const float *p[6];
    for (int i = 0; i < 6; i++)
        p[i] = params + t[i].offset;
    expert_layernorm_forward(ws->ln, ws->mean, ws->rstd, inp, p[LN_W], p[LN_B], B, d);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, B, h, d,
                1.0f, ws->ln, d, p[FC1_W], d, 0.0f, ws->act, h);
    expert_bias_gelu_forward(ws->act, want_dgelu ? ws->dgelu : NULL, ws->act, p[FC1_B], B, h);
    if (out) {
        /* out = x + b2 first, then sgemm accumulates W2·act onto it (beta=1):
         * bias and residual cost one pass, fused with the GEMM's C read. */
        expert_bias_forward(out, inp, p[FC2_B], B, d);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, B, d, h,
                    1.0f, ws->act, h, p[FC2_W], h, 1.0f, out, d);
    }
}

void expert__resffn_backward(const struct expert_block_config *c, const struct expert_tensor_info *t,
                             const float *params, float *grads, struct expert__vec_ws *ws,
                             float *dinp, const float *dout, const float *inp, int B)
{
    int in = c->in, h = c->hidden;
    const float *p[6];
    float *g[6];
    for (int i = 0; i < 6; i++) {
        p[i] = params + t[i].offset;
        g[i] = grads + t[i].offset;
    }
    /* fc2: db2 += Σ dout; dW2 += doutᵀ·act; then dact = dout·W2 may
     * overwrite act, which nothing reads any more. */
    expert_bias_backward(g[FC2_B], dout, B, in);
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, in, h, B,
                1.0f, dout, in, ws->act, h, 1.0f, g[FC2_W], h);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, B, h, in,
                1.0f, dout, in, p[FC2_W], h, 0.0f, ws->act, h);
    /* GELU and b1 in one pass: dpre = dact·gelu'(pre), db1 += Σ dpre. */
    expert_bias_gelu_backward(ws->act, g[FC1_B], ws->act, ws->dgelu, B, h);
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, h, in, B,
                1.0f, ws->act, h, ws->ln, in, 1.0f, g[FC1_W], in);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, B, in, h,
                1.0f, ws->act, h, p[FC1_W], in, 0.0f, ws->dln, in);
    /* LN's grads are needed even when dinp is not; ln is free now. */
    float *dx = dinp ? dinp : ws->ln;
    expert_layernorm_backward(dx, g[LN_W], g[LN_B], ws->dln, inp, p[LN_W], ws->mean, ws->rstd, B,
                              in);
    /* The residual: dinp += dout. */
    if (dinp)
        expert_residual_forward(dinp, dinp, dout, (long)B * in);
}
