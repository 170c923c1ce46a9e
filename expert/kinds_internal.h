/* expert/kinds_internal.h: what the block kinds' files share with
 * expert/block.c, which dispatches to them (internal; only expert/ includes
 * it). One file per kind, each with its _forward/_backward pair:
 * expert/dense.c (LINEAR), resffn.c (RESFFN), head.c (HEAD), embed.c
 * (EMBED), decoder.c (DECODER, and the decoder layer the transformer kinds
 * share), lmhead.c (LMHEAD). Parameters and gradients come as flat arrays
 * with the block's tensor list t (expert_block_config_tensors); gradients
 * accumulate (+=), the input's gradient is written (=).
 *
 * ---- LINEAR, RESFFN, HEAD ----
 *
 * A row is one sample of width in; their workspace views, (B, width) each,
 * are laid out by expert/ffnws.c (the transformer kinds': expert/seqws.c).
 */
#ifndef EXPERT_KINDS_INTERNAL_H
#define EXPERT_KINDS_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "expert/block.h"

struct expert__ffn_ws {
    float *ln;           /* (B,in)     LN(x) (RESFFN, HEAD; kept) */
    float *mean, *rstd;  /* (B)        its statistics (kept) */
    float *act;          /* (B,hidden) gelu(ln·W1ᵀ + b1) (RESFFN; kept) */
    float *dgelu;        /* (B,hidden) gelu'(pre) (RESFFN; kept) */
    float *dln;          /* (B,in)     backward scratch */
};
#define EXPERT__FFN_MAX_VIEWS 5

/* The kept views of ws in packing order (ln, mean, rstd, then RESFFN's act,
 * dgelu), their floats per row. Returns the count (LINEAR: 0, it keeps
 * nothing; HEAD: 3; RESFFN: 5). */
int expert__ffn_kept_views(const struct expert_block_config *c, const struct expert__ffn_ws *ws,
                           float **v, size_t *w);

/* Allocates the views of a block of config c for max_batch rows out of one
 * buffer (*buf_out, the caller frees it; never NULL, even for LINEAR, which
 * has no view). Returns 0 or -ENOMEM. */
int expert__ffn_ws_init(struct expert__ffn_ws *ws, const struct expert_block_config *c,
                        int max_batch, float **buf_out);

/* want_dgelu: keep gelu' for a backward. out may be NULL (a backward's
 * recompute that only needs the kept views). */
void expert__dense_forward(const struct expert_block_config *c, const struct expert_tensor_info *t,
                           const float *params, float *out, const float *inp, int B);
void expert__dense_backward(const struct expert_block_config *c, const struct expert_tensor_info *t,
                            const float *params, float *grads, float *dinp, const float *dout,
                            const float *inp, int B);
void expert__resffn_forward(const struct expert_block_config *c, const struct expert_tensor_info *t,
                            const float *params, struct expert__ffn_ws *ws, float *out,
                            const float *inp, int B, int want_dgelu);
void expert__resffn_backward(const struct expert_block_config *c, const struct expert_tensor_info *t,
                             const float *params, float *grads, struct expert__ffn_ws *ws,
                             float *dinp, const float *dout, const float *inp, int B);
void expert__head_forward(const struct expert_block_config *c, const struct expert_tensor_info *t,
                          const float *params, struct expert__ffn_ws *ws, float *out,
                          const float *inp, int B);
void expert__head_backward(const struct expert_block_config *c, const struct expert_tensor_info *t,
                           const float *params, float *grads, struct expert__ffn_ws *ws,
                           float *dinp, const float *dout, const float *inp, int B);

/* ---- EMBED, DECODER, LMHEAD ----
 *
 * A transformer stage's row is one sequence: T = cfg->seq positions of
 * width d = cfg->dim, so B rows are N = B·T positions, and every view below
 * is (B, per-row floats) with the positions of a row consecutive. The
 * workspace holds, per decoder layer, what its backward reads (the "kept"
 * views, saved and loaded by expert_workspace_save_rows/load_rows) and,
 * shared by the layers, the backward's scratch.
 */

/* One decoder layer's kept activations (shapes per row, H = hidden,
 * NH = heads). */
struct expert__seq_layer {
    float *x;            /* (T,d)     the layer's input (the residual stream) */
    float *ln1;          /* (T,d)     LN1(x) */
    float *m1, *r1;      /* (T)       its mean and 1/std */
    float *qkv;          /* (T,3d)    ln1·Wqkvᵀ + b */
    float *att;          /* (NH,T,T)  attention probabilities */
    float *atty;         /* (T,d)     attention output, heads concatenated */
    float *x1;           /* (T,d)     x + proj(atty) */
    float *ln2;          /* (T,d)     LN2(x1) */
    float *m2, *r2;      /* (T) */
    float *act;          /* (T,H)     gelu(ln2·W1ᵀ + b1) */
    float *dgelu;        /* (T,H)     gelu'(pre) */
};
#define EXPERT__SEQ_LAYER_VIEWS 13

/* The workspace of a transformer stage. */
struct expert__seq_ws {
    int layers;
    struct expert__seq_layer l[EXPERT_BLOCK_MAX_LAYERS];
    /* LMHEAD's final part (kept): */
    float *xf;           /* (T,d)     the last layer's output (or the input) */
    float *lnf;          /* (T,d)     LN_f(xf) */
    float *mf, *rf;      /* (T) */
    /* Not kept: */
    int32_t *tok;        /* (T)       EMBED: the tokens of each row */
    float *g0, *g1;      /* (T,d)     residual-stream gradients between layers */
    float *gf;           /* (T,d)     LMHEAD: the gradient of xf */
    float *dres;         /* (T,d)     a layer's gradient of x1 */
    float *dqkv;         /* (T,3d) */
    float *datt;         /* (NH,T,T)  attention backward scratch */
    float *dln;          /* (T,d) */
};

/* Kept views per layer, LMHEAD's final ones. */
#define EXPERT__SEQ_MAX_VIEWS (EXPERT__SEQ_LAYER_VIEWS * EXPERT_BLOCK_MAX_LAYERS + 4)

/* The kept views of ws in packing order, their floats per row. Returns
 * the count (at most EXPERT__SEQ_MAX_VIEWS). */
int expert__seq_kept_views(const struct expert_block_config *c, const struct expert__seq_ws *ws,
                           float **v, size_t *w);

/* Allocates the views of a stage of config c for max_batch rows out of one
 * buffer (*buf_out, the caller frees it). Returns 0 or -ENOMEM. */
int expert__seq_ws_init(struct expert__seq_ws *ws, const struct expert_block_config *c,
                        int max_batch, float **buf_out);

/* The 12 parameter (or gradient) tensors of decoder layer l, from the flat
 * array base (offsets from the block's tensor list t). */
void expert__seq_layer_tensors(const struct expert_tensor_info *t, int first, const float *base,
                               const float *p[12]);

/* Tokens of B rows (T floats each) into tok: -EINVAL unless every value is
 * an integer in [0, V). */
int expert__seq_tokens(int32_t *tok, const float *inp, long n, int V);

/* ---- decoder layers (expert/decoder.c) ---- */

/* Runs layers [0, c->layers) of a stage whose first tensor of layer 0 is
 * t[first], on x (B rows; copied into layer 0's view), leaving the result in
 * out (B, T·d). */
void expert__layers_forward(const struct expert_block_config *c, const struct expert_tensor_info *t,
                            int first, const float *params, struct expert__seq_ws *ws,
                            const float *x, float *out, int B);
/* Back-propagates dout (B, T·d), the gradient of the last layer's output
 * (not ws->g0, g1, dres or dln), through the layers: parameter gradients
 * += (grads, same offsets as params), dx (B, T·d) = the gradient of layer
 * 0's input (=); dx NULL: not wanted (it lands in ws->g0). c->layers >= 1. */
void expert__layers_backward(const struct expert_block_config *c, const struct expert_tensor_info *t,
                             int first, const float *params, float *grads,
                             struct expert__seq_ws *ws, const float *dout, float *dx, int B);

/* ---- the kinds (forward: returns 0 or -EINVAL for bad tokens) ---- */

int expert__embed_forward(const struct expert_block_config *c, const struct expert_tensor_info *t,
                          const float *params, struct expert__seq_ws *ws, float *out,
                          const float *inp, int B);
int expert__embed_backward(const struct expert_block_config *c, const struct expert_tensor_info *t,
                           const float *params, float *grads, struct expert__seq_ws *ws,
                           float *dinp, const float *dout, const float *inp, int B);
void expert__decoder_forward(const struct expert_block_config *c, const struct expert_tensor_info *t,
                             const float *params, struct expert__seq_ws *ws, float *out,
                             const float *inp, int B);
void expert__decoder_backward(const struct expert_block_config *c, const struct expert_tensor_info *t,
                              const float *params, float *grads, struct expert__seq_ws *ws,
                              float *dinp, const float *dout, int B);
void expert__lmhead_forward(const struct expert_block_config *c, const struct expert_tensor_info *t,
                            const float *params, struct expert__seq_ws *ws, float *out,
                            const float *inp, int B);
void expert__lmhead_backward(const struct expert_block_config *c, const struct expert_tensor_info *t,
                             const float *params, float *grads, struct expert__seq_ws *ws,
                             float *dinp, const float *dout, int B);

#endif
