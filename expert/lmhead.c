/* expert/lmhead.c: the LMHEAD kind, a GPT's last stage: its decoder layers
 * (expert/decoder.c), then the final LayerNorm and the language-model head
 * (train_lm.py's ln_f and head: Linear(d, vocab) with bias, not tied).
 *   inp    (B, T, d)
 *   xf     (B, T, d)   = layers(inp)   (inp when the stage has none)
 *   lnf    (B, T, d)   = LN_f(xf)
 *   out    (B, T, V)   = lnf·Wᵀ + b, the logits of the next token at every
 *                        position; the loss is the trainer's
 * Tensors: 12 per layer, then lnf_w, lnf_b (d), head_w (V,d), head_b (V). */
#include "expert/kinds_internal.h"

#define P(i) EXPERT__P(x, i)
#define P16(i) EXPERT__P16(x, i)
#define G(i) EXPERT__G(x, i)

int expert__lmhead_forward(const struct expert__exec *x, struct expert__seq_ws *ws, float *out,
                           const float *inp, int B)
{
    const struct expert_block_config *c = x->c;
    const struct expert_ops *o = x->o;
    int N = B * c->seq, d = c->dim, f = 12 * c->layers;
    if (c->layers)
        EXPERT__TRY(expert__layers_forward(x, 0, ws, inp, ws->xf, B));
    else
        EXPERT__TRY(x->be->copy(x->be, ws->xf, inp, (size_t)N * (size_t)d * sizeof(float)));
    EXPERT__TRY(o->layernorm_forward(ws->lnf, ws->mf, ws->rf, ws->xf, P(f), P(f + 1), N, d));
    if (!out)
        return 0;
    return o->matmul_forward(out, NULL, ws->lnf, P(f + 2), P16(f + 2), P(f + 3), N, d, c->vocab);
}

int expert__lmhead_backward(const struct expert__exec *x, struct expert__seq_ws *ws, float *dinp,
                            const float *dout, int B)
{
    const struct expert_block_config *c = x->c;
    const struct expert_ops *o = x->o;
    int N = B * c->seq, d = c->dim, f = 12 * c->layers;
    EXPERT__TRY(o->matmul_backward(ws->dln, G(f + 2), G(f + 3), dout, ws->lnf, P(f + 2), P16(f + 2),
                                   N, d, c->vocab));
    float *dxf = c->layers || !dinp ? ws->gf : dinp;
    EXPERT__TRY(o->layernorm_backward(dxf, G(f), G(f + 1), ws->dln, ws->xf, P(f), ws->mf, ws->rf, N, d));
    return c->layers ? expert__layers_backward(x, 0, ws, ws->gf, dinp, B) : 0;
}
