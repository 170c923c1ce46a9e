/* expert/head.c: the HEAD kind, a classifier's last stage: LayerNorm, then
 * a fully connected layer (../shared/bench/torch/common.py's Head).
 *   inp (B, in)  ->  ln (B, in) = LN(inp)  ->  out (B, out) = ln·Wᵀ + b
 * Tensors: ln_w, ln_b (in), fc_w (out, in), fc_b (out). Kept: ln, mean,
 * rstd. */
#include "expert/kinds_internal.h"

#define P(i) EXPERT__P(x, i)
#define P16(i) EXPERT__P16(x, i)
#define G(i) EXPERT__G(x, i)

int expert__head_forward(const struct expert__exec *x, struct expert__ffn_ws *ws, float *out,
                         const float *inp, int B)
{
    const struct expert_ops *o = x->o;
    int in = x->c->in;
    EXPERT__TRY(o->layernorm_forward(ws->ln, ws->mean, ws->rstd, inp, P(0), P(1), B, in));
    if (!out)
        return 0;
    return o->matmul_forward(out, NULL, ws->ln, P(2), P16(2), P(3), B, in, x->c->out);
}

int expert__head_backward(const struct expert__exec *x, struct expert__ffn_ws *ws, float *dinp,
                          const float *dout, const float *inp, int B)
{
    const struct expert_ops *o = x->o;
    int in = x->c->in;
    EXPERT__TRY(o->matmul_backward(ws->dln, G(2), G(3), dout, ws->ln, P(2), P16(2), B, in, x->c->out));
    /* LN's grads are needed even when dinp is not; ln is free now. */
    float *dx = dinp ? dinp : ws->ln;
    return o->layernorm_backward(dx, G(0), G(1), ws->dln, inp, P(0), ws->mean, ws->rstd, B, in);
}
