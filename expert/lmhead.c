/* expert/lmhead.c: the LMHEAD kind, a GPT's last stage: its decoder layers
 * (expert/decoder.c), then the final LayerNorm and the language-model head
 * (train_lm.py's ln_f and head: Linear(d, vocab) with bias, not tied).
 *   inp    (B, T, d)
 *   xf     (B, T, d)   = layers(inp)   (inp when the stage has none)
 *   lnf    (B, T, d)   = LN_f(xf)
 *   out    (B, T, V)   = lnf·Wᵀ + b, the logits of the next token at every
 *                        position; the loss is the trainer's
 * Tensors: 12 per layer, then lnf_w, lnf_b (d), head_w (V,d), head_b (V). */
#include "expert/ops.h"
#include "expert/kinds_internal.h"

#include <string.h>

void expert__lmhead_forward(const struct expert_block_config *c, const struct expert_tensor_info *t,
                            const float *params, struct expert__seq_ws *ws, float *out,
                            const float *inp, int B)
{
    int N = B * c->seq, d = c->dim, f = 12 * c->layers;
    if (c->layers)
        expert__layers_forward(c, t, 0, params, ws, inp, ws->xf, B);
    else
        memcpy(ws->xf, inp, (size_t)N * (size_t)d * sizeof(float));
    expert_layernorm_forward(ws->lnf, ws->mf, ws->rf, ws->xf, params + t[f].offset,
                             params + t[f + 1].offset, N, d);
    if (out)
        expert_linear_forward(out, ws->lnf, params + t[f + 2].offset, params + t[f + 3].offset, N,
                              d, c->vocab);
}

void expert__lmhead_backward(const struct expert_block_config *c, const struct expert_tensor_info *t,
                             const float *params, float *grads, struct expert__seq_ws *ws,
                             float *dinp, const float *dout, int B)
{
    int N = B * c->seq, d = c->dim, f = 12 * c->layers;
    expert_linear_backward(ws->dln, grads + t[f + 2].offset, grads + t[f + 3].offset, dout, ws->lnf,
                           params + t[f + 2].offset, N, d, c->vocab);
    float *dxf = c->layers || !dinp ? ws->gf : dinp;
    expert_layernorm_backward(dxf, grads + t[f].offset, grads + t[f + 1].offset, ws->dln, ws->xf,
                              params + t[f].offset, ws->mf, ws->rf, N, d);
    if (c->layers)
        expert__layers_backward(c, t, 0, params, grads, ws, ws->gf, dinp, B);
}
