/* expert/resffn.c: the RESFFN kind, a pre-LN residual feed-forward block
 * (../shared/bench/torch/common.py's ResFFN), d = in = out, H = hidden:
 *   ln  (B, d) = LN(x)
 *   act (B, H) = gelu(ln·W1ᵀ + b1)        (gelu' kept for the backward)
 *   out (B, d) = x + act·W2ᵀ + b2
 * Tensors: ln_w, ln_b (d), fc1_w (H, d), fc1_b (H), fc2_w (d, H), fc2_b (d).
 * Kept: ln, mean, rstd, act, dgelu. */
#include "expert/kinds_internal.h"
#include "expert/ops.h"

#include <cblas.h>

#define P(i) (params + t[i].offset)
#define G(i) (grads + t[i].offset)

void expert__resffn_forward(const struct expert_block_config *c, const struct expert_tensor_info *t,
                            const float *params, struct expert__ffn_ws *ws, float *out,
                            const float *inp, int B, int want_dgelu)
{
    int d = c->in, h = c->hidden;
    expert_layernorm_forward(ws->ln, ws->mean, ws->rstd, inp, P(0), P(1), B, d);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, B, h, d,
                1.0f, ws->ln, d, P(2), d, 0.0f, ws->act, h);
    expert_bias_gelu_forward(ws->act, want_dgelu ? ws->dgelu : NULL, ws->act, P(3), B, h);
    if (out) {
        /* out = x + b2 first, then sgemm accumulates W2·act onto it (beta=1):
         * bias and residual cost one pass, fused with the GEMM's C read. */
        expert_bias_forward(out, inp, P(5), B, d);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, B, d, h,
                    1.0f, ws->act, h, P(4), h, 1.0f, out, d);
    }
}

void expert__resffn_backward(const struct expert_block_config *c, const struct expert_tensor_info *t,
                             const float *params, float *grads, struct expert__ffn_ws *ws,
                             float *dinp, const float *dout, const float *inp, int B)
{
    int in = c->in, h = c->hidden;
    /* fc2: db2 += Σ dout; dW2 += doutᵀ·act; then dact = dout·W2 may
     * overwrite act, which nothing reads any more. */
    expert_bias_backward(G(5), dout, B, in);
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, in, h, B,
                1.0f, dout, in, ws->act, h, 1.0f, G(4), h);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, B, h, in,
                1.0f, dout, in, P(4), h, 0.0f, ws->act, h);
    /* GELU and b1 in one pass: dpre = dact·gelu'(pre), db1 += Σ dpre. */
    expert_bias_gelu_backward(ws->act, G(3), ws->act, ws->dgelu, B, h);
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, h, in, B,
                1.0f, ws->act, h, ws->ln, in, 1.0f, G(2), in);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, B, in, h,
                1.0f, ws->act, h, P(2), in, 0.0f, ws->dln, in);
    /* LN's grads are needed even when dinp is not; ln is free now. */
    float *dx = dinp ? dinp : ws->ln;
    expert_layernorm_backward(dx, G(0), G(1), ws->dln, inp, P(0), ws->mean, ws->rstd, B, in);
    if (dinp)
        expert_residual_forward(dinp, dinp, dout, (long)B * in);
}
