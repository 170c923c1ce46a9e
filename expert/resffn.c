/* expert/resffn.c: the RESFFN kind, a pre-LN residual feed-forward block
 * (../shared/bench/torch/common.py's ResFFN), d = in = out, H = hidden:
 *   ln  (B, d) = LN(x)
 *   act (B, H) = gelu(ln·W1ᵀ + b1)        (gelu' kept for the backward)
 *   out (B, d) = x + act·W2ᵀ + b2
 * Tensors: ln_w, ln_b (d), fc1_w (H, d), fc1_b (H), fc2_w (d, H), fc2_b (d).
 * Kept: ln, mean, rstd, act, dgelu. */
#include "expert/kinds_internal.h"

#define P(i) EXPERT__P(x, i)
#define P16(i) EXPERT__P16(x, i)
#define G(i) EXPERT__G(x, i)

int expert__resffn_forward(const struct expert__exec *x, struct expert__ffn_ws *ws, float *out,
                           const float *inp, int B, int want_dgelu)
{
    const struct expert_ops *o = x->o;
    int d = x->c->in, h = x->c->hidden;
    EXPERT__TRY(o->layernorm_forward(ws->ln, ws->mean, ws->rstd, inp, P(0), P(1), B, d));
    EXPERT__TRY(o->matmul_forward(ws->act, NULL, ws->ln, P(2), P16(2), NULL, B, d, h));
    EXPERT__TRY(o->bias_gelu_forward(ws->act, want_dgelu ? ws->dgelu : NULL, ws->act, P(3), B, h));
    if (!out)
        return 0;
    return o->matmul_forward(out, inp, ws->act, P(4), P16(4), P(5), B, h, d); /* x + act·W2ᵀ + b2 */
}

int expert__resffn_backward(const struct expert__exec *x, struct expert__ffn_ws *ws, float *dinp,
                            const float *dout, const float *inp, int B)
{
    const struct expert_ops *o = x->o;
    int in = x->c->in, h = x->c->hidden;
    /* fc2: db2 += Σ dout; dW2 += doutᵀ·act; then dact = dout·W2
     * overwrites act, which nothing reads any more. */
    EXPERT__TRY(o->matmul_backward(ws->act, G(4), G(5), dout, ws->act, P(4), P16(4), B, h, in));
    /* GELU and b1 in one pass: dpre = dact·gelu'(pre), db1 += Σ dpre. */
    EXPERT__TRY(o->bias_gelu_backward(ws->act, G(3), ws->act, ws->dgelu, B, h));
    EXPERT__TRY(o->matmul_backward(ws->dln, G(2), NULL, ws->act, ws->ln, P(2), P16(2), B, in, h));
    /* LN's grads are needed even when dinp is not; ln is free now. */
    float *dx = dinp ? dinp : ws->ln;
    EXPERT__TRY(o->layernorm_backward(dx, G(0), G(1), ws->dln, inp, P(0), ws->mean, ws->rstd, B, in));
    return dinp ? o->residual_forward(dinp, dinp, dout, (long)B * in) : 0;
}
