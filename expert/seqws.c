/* expert/seqws.c: the workspace layout of the transformer kinds (the
 * views of expert/kinds_internal.h), one allocation of backend memory per
 * workspace. Attention's saved state and scratch are as large as the
 * backend says (attention_sizes). */
#include "expert/kinds_internal.h"

/* Each view rounded up to 64 floats (256 bytes), so every one starts on a
 * cache line and on the alignment the GPU's vector loads want. */
#define R64(x) (((x) + 63) & ~(size_t)63)

/* Floats per row of each kept view of a layer, in packing order. */
static void layer_widths(const struct expert_block_config *c, const struct expert_ops *ops,
                         size_t w[EXPERT__SEQ_LAYER_VIEWS])
{
    size_t T = (size_t)c->seq, d = (size_t)c->dim, H = (size_t)c->hidden, att = 0;
    ops->attention_sizes(c->seq, c->heads, &att, NULL);
    size_t v[EXPERT__SEQ_LAYER_VIEWS] = { T * d, T * d, T, T, 3 * T * d, att, T * d,
                                          T * d, T * d, T, T, T * H, T * H };
    for (int i = 0; i < EXPERT__SEQ_LAYER_VIEWS; i++)
        w[i] = v[i];
}

int expert__seq_kept_views(const struct expert_block_config *c, const struct expert_ops *ops,
                           const struct expert__seq_ws *ws, float **v, size_t *w)
{
    int n = 0;
    size_t lw[EXPERT__SEQ_LAYER_VIEWS];
    layer_widths(c, ops, lw);
    for (int l = 0; l < c->layers; l++) {
        const struct expert__seq_layer *L = &ws->l[l];
        float *lv[EXPERT__SEQ_LAYER_VIEWS] = { L->x,  L->ln1, L->m1, L->r1,  L->qkv,
                                               L->att, L->atty, L->x1, L->ln2, L->m2,
                                               L->r2, L->act,  L->dgelu };
        for (int i = 0; i < EXPERT__SEQ_LAYER_VIEWS; i++, n++) {
            v[n] = lv[i];
            w[n] = lw[i];
        }
    }
    if (c->kind == EXPERT_BLOCK_LMHEAD) {
        size_t T = (size_t)c->seq, d = (size_t)c->dim;
        float *fv[4] = { ws->xf, ws->lnf, ws->mf, ws->rf };
        size_t fw[4] = { T * d, T * d, T, T };
        for (int i = 0; i < 4; i++, n++) {
            v[n] = fv[i];
            w[n] = fw[i];
        }
    }
    return n;
}

size_t expert__seq_ws_layout(struct expert__seq_ws *ws, const struct expert_block_config *c,
                             const struct expert_ops *ops, int max_batch, float *buf)
{
    size_t B = (size_t)max_batch, T = (size_t)c->seq, d = (size_t)c->dim, scratch = 0;
    size_t lw[EXPERT__SEQ_LAYER_VIEWS];
    layer_widths(c, ops, lw);
    ops->attention_sizes(c->seq, c->heads, NULL, &scratch);
    size_t per_layer = 0;
    for (int i = 0; i < EXPERT__SEQ_LAYER_VIEWS; i++)
        per_layer += R64(B * lw[i]);
    int head = c->kind == EXPERT_BLOCK_LMHEAD;
    size_t n_final = head ? 2 * R64(B * T * d) + 2 * R64(B * T) : 0;
    /* scratch: g0, g1, gf, dres, dln, dqkv, datt */
    size_t n_scratch = 5 * R64(B * T * d) + R64(3 * B * T * d) + R64(B * scratch);
    size_t total = per_layer * (size_t)c->layers + n_final + n_scratch;
    if (!buf)
        return total;
    float *p = buf;
    ws->layers = c->layers;
    for (int l = 0; l < c->layers; l++) {
        struct expert__seq_layer *L = &ws->l[l];
        float **slot[EXPERT__SEQ_LAYER_VIEWS] = { &L->x,   &L->ln1,  &L->m1, &L->r1,  &L->qkv,
                                                  &L->att, &L->atty, &L->x1, &L->ln2, &L->m2,
                                                  &L->r2,  &L->act,  &L->dgelu };
        for (int i = 0; i < EXPERT__SEQ_LAYER_VIEWS; i++) {
            *slot[i] = p;
            p += R64(B * lw[i]);
        }
    }
    if (head) {
        ws->xf = p;  p += R64(B * T * d);
        ws->lnf = p; p += R64(B * T * d);
        ws->mf = p;  p += R64(B * T);
        ws->rf = p;  p += R64(B * T);
    }
    ws->g0 = p;   p += R64(B * T * d);
    ws->g1 = p;   p += R64(B * T * d);
    ws->gf = p;   p += R64(B * T * d);
    ws->dres = p; p += R64(B * T * d);
    ws->dln = p;  p += R64(B * T * d);
    ws->dqkv = p; p += R64(3 * B * T * d);
    ws->datt = p;
    return total;
}
