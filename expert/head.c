/* expert/head.c: the HEAD kind, LayerNorm then a linear layer (common.py's
 * Head(in, out)).
 *   inp  (B, in)
 *   ln   (B, in)   = LN(inp), mean and rstd (B) saved
 *   out  (B, out)  = ln·Wᵀ + b
 * Tensors: ln_w (in), ln_b (in), fc_w (out,in), fc_b (out). */
#include "expert/kinds_internal.h"
#include "expert/ops.h"

enum { LN_W, LN_B, FC_W, FC_B };

void expert__head_forward(const struct expert_block_config *c, const struct expert_tensor_info *t,
                          const float *params, struct expert__vec_ws *ws, float *out,
                          const float *inp, int B)
{
    expert_layernorm_forward(ws->ln, ws->mean, ws->rstd, inp, params + t[LN_W].offset,
                             params + t[LN_B].offset, B, c->in);
    if (out)
        expert_linear_forward(out, ws->ln, params + t[FC_W].offset, params + t[FC_B].offset, B,
                              c->in, c->out);
}

void expert__head_backward(const struct expert_block_config *c, const struct expert_tensor_info *t,
                           const float *params, float *grads, struct expert__vec_ws *ws,
                           float *dinp, const float *dout, const float *inp, int B)
{
    expert_linear_backward(ws->dln, grads + t[FC_W].offset, grads + t[FC_B].offset, dout, ws->ln,
                           params + t[FC_W].offset, B, c->in, c->out);
    /* LN's grads are needed even when dinp is not; ln is free now. */
    float *dx = dinp ? dinp : ws->ln;
    expert_layernorm_backward(dx, grads + t[LN_W].offset, grads + t[LN_B].offset, ws->dln, inp,
                              params + t[LN_W].offset, ws->mean, ws->rstd, B, c->in);
}
