/* expert/head.c: the HEAD kind, a classifier's last stage: LayerNorm, then
 * a fully connected layer (../shared/bench/torch/common.py's Head).
 *   inp (B, in)  ->  ln (B, in) = LN(inp)  ->  out (B, out) = ln·Wᵀ + b
 * Tensors: ln_w, ln_b (in), fc_w (out, in), fc_b (out). Kept: ln, mean,
 * rstd. */
#include "expert/kinds_internal.h"
#include "expert/ops.h"

#define P(i) (params + t[i].offset)
#define G(i) (grads + t[i].offset)

void expert__head_forward(const struct expert_block_config *c, const struct expert_tensor_info *t,
                          const float *params, struct expert__ffn_ws *ws, float *out,
                          const float *inp, int B)
{
    expert_layernorm_forward(ws->ln, ws->mean, ws->rstd, inp, P(0), P(1), B, c->in);
    if (out)
        expert_linear_forward(out, ws->ln, P(2), P(3), B, c->in, c->out);
}

void expert__head_backward(const struct expert_block_config *c, const struct expert_tensor_info *t,
                           const float *params, float *grads, struct expert__ffn_ws *ws,
                           float *dinp, const float *dout, const float *inp, int B)
{
    expert_linear_backward(ws->dln, G(2), G(3), dout, ws->ln, P(2), B, c->in, c->out);
    /* LN's grads are needed even when dinp is not; ln is free now. */
    float *dx = dinp ? dinp : ws->ln;
    expert_layernorm_backward(dx, G(0), G(1), ws->dln, inp, P(0), ws->mean, ws->rstd, B, c->in);
}
