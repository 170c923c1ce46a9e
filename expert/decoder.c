/* expert/decoder.c: the pre-LayerNorm decoder layer of a GPT (train_lm.py's
 * Block) and the DECODER kind, a stage of such layers.
 *
 * One layer on N = B·T positions of width d (H = hidden, NH = heads):
 *   ln1  = LN1(x)                          (N,d)
 *   qkv  = ln1·Wqkvᵀ + bqkv                (N,3d)
 *   atty = attention(qkv), att saved       (N,d), (B,NH,T,T)
 *   x1   = x + atty·Wprojᵀ + bproj         (N,d)
 *   ln2  = LN2(x1)                         (N,d)
 *   act  = gelu(ln2·W1ᵀ + b1)              (N,H), gelu' saved
 *   y    = x1 + act·W2ᵀ + b2               (N,d)
 * Tensors of a layer, in order: ln1_w, ln1_b, qkv_w, qkv_b, proj_w, proj_b,
 * ln2_w, ln2_b, fc1_w, fc1_b, fc2_w, fc2_b. Parameter grads +=, the input's
 * gradient =, as every op (expert/ops.h). */
#include "expert/kinds_internal.h"

enum { LN1_W, LN1_B, QKV_W, QKV_B, PROJ_W, PROJ_B, LN2_W, LN2_B, FC1_W, FC1_B, FC2_W, FC2_B };

/* Tensor i of the layer whose first tensor is t[k]. */
#define P(i) EXPERT__P(x, k + (i))
#define P16(i) EXPERT__P16(x, k + (i))
#define G(i) EXPERT__G(x, k + (i))

/* y (N,d) = layer(L->x) with the activations kept in L; the layer's
 * tensors start at t[k]. */
static int layer_forward(const struct expert__exec *x, int k, struct expert__seq_layer *L, float *y,
                         int B)
{
    const struct expert_ops *o = x->o;
    int T = x->c->seq, d = x->c->dim, H = x->c->hidden, N = B * T;
    EXPERT__TRY(o->layernorm_forward(L->ln1, L->m1, L->r1, L->x, P(LN1_W), P(LN1_B), N, d));
    EXPERT__TRY(o->matmul_forward(L->qkv, NULL, L->ln1, P(QKV_W), P16(QKV_W), P(QKV_B), N, d, 3 * d));
    EXPERT__TRY(o->attention_forward(L->atty, L->att, L->qkv, B, T, d, x->c->heads));
    EXPERT__TRY(o->matmul_forward(L->x1, L->x, L->atty, P(PROJ_W), P16(PROJ_W), P(PROJ_B), N, d,
                                  d));
    EXPERT__TRY(o->layernorm_forward(L->ln2, L->m2, L->r2, L->x1, P(LN2_W), P(LN2_B), N, d));
    EXPERT__TRY(o->matmul_forward(L->act, NULL, L->ln2, P(FC1_W), P16(FC1_W), NULL, N, d, H));
    EXPERT__TRY(o->bias_gelu_forward(L->act, L->dgelu, L->act, P(FC1_B), N, H));
    EXPERT__TRY(o->matmul_forward(y, L->x1, L->act, P(FC2_W), P16(FC2_W), P(FC2_B), N, H, d));
    return 0;
}

/* dx (N,d) = ∂/∂x (=) from dy (N,d) = ∂/∂y; parameter grads +=. Uses
 * ws->dres, dln, dqkv, datt; overwrites L->act (it holds gelu's gradient
 * afterwards). dx must not alias dy. */
static int layer_backward(const struct expert__exec *x, int k, struct expert__seq_layer *L,
                          struct expert__seq_ws *ws, float *dx, const float *dy, int B)
{
    const struct expert_ops *o = x->o;
    int T = x->c->seq, d = x->c->dim, H = x->c->hidden, N = B * T;
    /* MLP: db2 += Σ dy; dW2 += dyᵀ·act; dact = dy·W2 (into act). */
    EXPERT__TRY(o->matmul_backward(L->act, G(FC2_W), G(FC2_B), dy, L->act, P(FC2_W), P16(FC2_W),
                                   N, H, d));
    EXPERT__TRY(o->bias_gelu_backward(L->act, G(FC1_B), L->act, L->dgelu, N, H));
    EXPERT__TRY(o->matmul_backward(ws->dln, G(FC1_W), NULL, L->act, L->ln2, P(FC1_W), P16(FC1_W),
                                   N, d, H));
    /* dx1 = LN2'(dln) + dy (the residual). */
    EXPERT__TRY(o->layernorm_backward(ws->dres, G(LN2_W), G(LN2_B), ws->dln, L->x1, P(LN2_W), L->m2,
                                      L->r2, N, d));
    EXPERT__TRY(o->residual_forward(ws->dres, ws->dres, dy, (long)N * d));
    /* Attention: dbproj += Σ dx1; dWproj += dx1ᵀ·atty; datty = dx1·Wproj. */
    EXPERT__TRY(o->matmul_backward(ws->dln, G(PROJ_W), G(PROJ_B), ws->dres, L->atty, P(PROJ_W),
                                   P16(PROJ_W), N, d, d));
    EXPERT__TRY(o->attention_backward(ws->dqkv, ws->datt, ws->dln, L->atty, L->qkv, L->att, B, T, d,
                                      x->c->heads));
    EXPERT__TRY(o->matmul_backward(ws->dln, G(QKV_W), G(QKV_B), ws->dqkv, L->ln1, P(QKV_W),
                                   P16(QKV_W), N, d, 3 * d));
    /* dx = LN1'(dln) + dx1. */
    EXPERT__TRY(o->layernorm_backward(dx, G(LN1_W), G(LN1_B), ws->dln, L->x, P(LN1_W), L->m1, L->r1,
                                      N, d));
    EXPERT__TRY(o->residual_forward(dx, dx, ws->dres, (long)N * d));
    return 0;
}

int expert__layers_forward(const struct expert__exec *x, int first, struct expert__seq_ws *ws,
                           const float *in, float *out, int B)
{
    const struct expert_block_config *c = x->c;
    size_t n = (size_t)B * (size_t)c->seq * (size_t)c->dim;
    if (ws->l[0].x != in)
        EXPERT__TRY(x->be->copy(x->be, ws->l[0].x, in, n * sizeof(float)));
    for (int l = 0; l < c->layers; l++) {
        float *y = l + 1 < c->layers ? ws->l[l + 1].x : out ? out : ws->g0;
        EXPERT__TRY(layer_forward(x, first + 12 * l, &ws->l[l], y, B));
    }
    return 0;
}

int expert__layers_backward(const struct expert__exec *x, int first, struct expert__seq_ws *ws,
                            const float *dout, float *dx, int B)
{
    /* Layer l writes its input's gradient into buf(l) (layer 0: dx), which
     * layer l-1 reads; neighbours never share a buffer. */
    const float *dy = dout;
    for (int l = x->c->layers - 1; l >= 0; l--) {
        float *buf = (l % 2) ? ws->g1 : ws->g0;
        float *dst = l == 0 && dx ? dx : buf;
        EXPERT__TRY(layer_backward(x, first + 12 * l, &ws->l[l], ws, dst, dy, B));
        dy = dst;
    }
    return 0;
}

/* ---- the DECODER kind: in = out = (B, T·d) ---- */

int expert__decoder_forward(const struct expert__exec *x, struct expert__seq_ws *ws, float *out,
                            const float *inp, int B)
{
    return expert__layers_forward(x, 0, ws, inp, out, B);
}

int expert__decoder_backward(const struct expert__exec *x, struct expert__seq_ws *ws, float *dinp,
                             const float *dout, int B)
{
    return expert__layers_backward(x, 0, ws, dout, dinp, B);
}
