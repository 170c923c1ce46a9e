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
#include "expert/ops.h"
#include "expert/kinds_internal.h"

#include <string.h>

#include <cblas.h>

enum { LN1_W, LN1_B, QKV_W, QKV_B, PROJ_W, PROJ_B, LN2_W, LN2_B, FC1_W, FC1_B, FC2_W, FC2_B };

void expert__seq_layer_tensors(const struct expert_tensor_info *t, int first, const float *base,
                               const float *p[12])
{
    for (int i = 0; i < 12; i++)
        p[i] = base + t[first + i].offset;
}

/* y (N,d) = layer(L->x) with the activations kept in L. */
static void layer_forward(const struct expert_block_config *c, const float *const p[12],
                          struct expert__seq_layer *L, float *y, int B)
{
    int T = c->seq, d = c->dim, H = c->hidden, N = B * T;
    expert_layernorm_forward(L->ln1, L->m1, L->r1, L->x, p[LN1_W], p[LN1_B], N, d);
    expert_linear_forward(L->qkv, L->ln1, p[QKV_W], p[QKV_B], N, d, 3 * d);
    expert_attention_forward(L->atty, L->att, L->qkv, B, T, d, c->heads);
    /* x1 = x + bproj, then sgemm accumulates atty·Wprojᵀ onto it (beta 1). */
    expert_bias_forward(L->x1, L->x, p[PROJ_B], N, d);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, d, d, 1.0f, L->atty, d, p[PROJ_W], d,
                1.0f, L->x1, d);
    expert_layernorm_forward(L->ln2, L->m2, L->r2, L->x1, p[LN2_W], p[LN2_B], N, d);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, H, d, 1.0f, L->ln2, d, p[FC1_W], d,
                0.0f, L->act, H);
    expert_bias_gelu_forward(L->act, L->dgelu, L->act, p[FC1_B], N, H);
    expert_bias_forward(y, L->x1, p[FC2_B], N, d);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, d, H, 1.0f, L->act, H, p[FC2_W], H,
                1.0f, y, d);
}

/* dx (N,d) = ∂/∂x (=) from dy (N,d) = ∂/∂y; parameter grads g +=. Uses
 * ws->dres, dln, dqkv, datt; overwrites L->act (it holds gelu's gradient
 * afterwards). dx must not alias dy. */
static void layer_backward(const struct expert_block_config *c, const float *const p[12],
                           float *const g[12], struct expert__seq_layer *L,
                           struct expert__seq_ws *ws, float *dx, const float *dy, int B)
{
    int T = c->seq, d = c->dim, H = c->hidden, N = B * T;
    /* MLP: db2 += Σ dy; dW2 += dyᵀ·act; dact = dy·W2 (into act). */
    expert_bias_backward(g[FC2_B], dy, N, d);
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, d, H, N, 1.0f, dy, d, L->act, H, 1.0f,
                g[FC2_W], H);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, N, H, d, 1.0f, dy, d, p[FC2_W], H, 0.0f,
                L->act, H);
    expert_bias_gelu_backward(L->act, g[FC1_B], L->act, L->dgelu, N, H);
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, H, d, N, 1.0f, L->act, H, L->ln2, d, 1.0f,
                g[FC1_W], d);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, N, d, H, 1.0f, L->act, H, p[FC1_W], d,
                0.0f, ws->dln, d);
    /* dx1 = LN2'(dln) + dy (the residual). */
    expert_layernorm_backward(ws->dres, g[LN2_W], g[LN2_B], ws->dln, L->x1, p[LN2_W], L->m2, L->r2,
                              N, d);
    expert_residual_forward(ws->dres, ws->dres, dy, (long)N * d);
    /* Attention: dbproj += Σ dx1; dWproj += dx1ᵀ·atty; datty = dx1·Wproj. */
    expert_bias_backward(g[PROJ_B], ws->dres, N, d);
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, d, d, N, 1.0f, ws->dres, d, L->atty, d,
                1.0f, g[PROJ_W], d);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, N, d, d, 1.0f, ws->dres, d, p[PROJ_W], d,
                0.0f, ws->dln, d);
    expert_attention_backward(ws->dqkv, ws->datt, ws->dln, L->qkv, L->att, B, T, d, c->heads);
    expert_linear_backward(ws->dln, g[QKV_W], g[QKV_B], ws->dqkv, L->ln1, p[QKV_W], N, d, 3 * d);
    /* dx = LN1'(dln) + dx1. */
    expert_layernorm_backward(dx, g[LN1_W], g[LN1_B], ws->dln, L->x, p[LN1_W], L->m1, L->r1, N, d);
    expert_residual_forward(dx, dx, ws->dres, (long)N * d);
}

void expert__layers_forward(const struct expert_block_config *c, const struct expert_tensor_info *t,
                            int first, const float *params, struct expert__seq_ws *ws,
                            const float *x, float *out, int B)
{
    size_t n = (size_t)B * (size_t)c->seq * (size_t)c->dim;
    if (ws->l[0].x != x)
        memcpy(ws->l[0].x, x, n * sizeof(float));
    for (int l = 0; l < c->layers; l++) {
        const float *p[12];
        expert__seq_layer_tensors(t, first + 12 * l, params, p);
        float *y = l + 1 < c->layers ? ws->l[l + 1].x : out ? out : ws->g0;
        layer_forward(c, p, &ws->l[l], y, B);
    }
}

void expert__layers_backward(const struct expert_block_config *c, const struct expert_tensor_info *t,
                             int first, const float *params, float *grads,
                             struct expert__seq_ws *ws, const float *dout, float *dx, int B)
{
    /* Layer l writes its input's gradient into buf(l) (layer 0: dx), which
     * layer l-1 reads; neighbours never share a buffer. */
    const float *dy = dout;
    for (int l = c->layers - 1; l >= 0; l--) {
        const float *p[12];
        float *g[12];
        expert__seq_layer_tensors(t, first + 12 * l, params, p);
        for (int i = 0; i < 12; i++)
            g[i] = grads + t[first + 12 * l + i].offset;
        float *buf = (l % 2) ? ws->g1 : ws->g0;
        float *dst = l == 0 && dx ? dx : buf;
        layer_backward(c, p, g, &ws->l[l], ws, dst, dy, B);
        dy = dst;
    }
}

/* ---- the DECODER kind: in = out = (B, T·d) ---- */

void expert__decoder_forward(const struct expert_block_config *c, const struct expert_tensor_info *t,
                             const float *params, struct expert__seq_ws *ws, float *out,
                             const float *inp, int B)
{
    expert__layers_forward(c, t, 0, params, ws, inp, out, B);
}

void expert__decoder_backward(const struct expert_block_config *c, const struct expert_tensor_info *t,
                              const float *params, float *grads, struct expert__seq_ws *ws,
                              float *dinp, const float *dout, int B)
{
    expert__layers_backward(c, t, 0, params, grads, ws, dout, dinp, B);
}
