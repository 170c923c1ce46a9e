/* expert/ffnws.c: the workspace layout of the LINEAR, RESFFN and HEAD
 * kinds (the views of struct expert__ffn_ws in expert/kinds_internal.h),
 * in one allocation of backend memory per workspace. */
#include "expert/kinds_internal.h"

/* Each view rounded up to 64 floats (256 bytes), so every one starts on a
 * cache line and on the alignment the GPU's vector loads want. */
#define R64(x) (((x) + 63) & ~(size_t)63)

int expert__ffn_kept_views(const struct expert_block_config *c, const struct expert__ffn_ws *ws,
                           float **v, size_t *w)
{
    int n = 0;
    if (c->kind == EXPERT_BLOCK_LINEAR)
        return 0;
    v[n] = ws->ln, w[n++] = (size_t)c->in;
    v[n] = ws->mean, w[n++] = 1;
    v[n] = ws->rstd, w[n++] = 1;
    if (c->kind == EXPERT_BLOCK_RESFFN) {
        v[n] = ws->act, w[n++] = (size_t)c->hidden;
        v[n] = ws->dgelu, w[n++] = (size_t)c->hidden;
    }
    return n;
}

size_t expert__ffn_ws_layout(struct expert__ffn_ws *ws, const struct expert_block_config *c,
                             int max_batch, float *buf)
{
    size_t B = (size_t)max_batch, in = (size_t)c->in, h = (size_t)c->hidden;
    size_t n_ln = 0, n_stat = 0, n_h = 0;
    if (c->kind != EXPERT_BLOCK_LINEAR) {
        n_ln = R64(B * in);
        n_stat = R64(B);
    }
    if (c->kind == EXPERT_BLOCK_RESFFN)
        n_h = R64(B * h);
    size_t total = 2 * n_ln + 2 * n_stat + 2 * n_h;
    if (!buf)
        return total;
    float *p = buf;
    ws->ln = p;    p += n_ln;
    ws->dln = p;   p += n_ln;
    ws->mean = p;  p += n_stat;
    ws->rstd = p;  p += n_stat;
    ws->act = p;   p += n_h;
    ws->dgelu = p;
    return total;
}
