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

#include "expert/backend.h"
#include "expert/block.h"

/* What a kind's forward or backward runs with: the block's backend, config
 * and tensor list, the weights of one slot and the gradients (all backend
 * memory). */
struct expert__exec {
    const expert_backend *be;
    const struct expert_ops *o;           /* &be->ops */
    const struct expert_block_config *c;
    const struct expert_tensor_info *t;   /* expert_block_config_tensors */
    const float *params;                  /* the slot's weights */
    const uint16_t *params16;             /* their bf16 copy (bf16 precision), else NULL */
    float *grads;                         /* NULL in a forward */
};

/* Runs a backend call and returns its error, if any, from the function
 * (kinds return 0 or the first op's error: -EINVAL for refused input,
 * -EIO and the like from a device). */
#define EXPERT__TRY(call) do { int rc_ = (call); if (rc_ != 0) return rc_; } while (0)

/* Tensor i's weights, their bf16 copy (or NULL), its gradient. */
#define EXPERT__P(x, i) ((x)->params + (x)->t[i].offset)
#define EXPERT__P16(x, i) ((x)->params16 ? (x)->params16 + (x)->t[i].offset : NULL)
#define EXPERT__G(x, i) ((x)->grads + (x)->t[i].offset)

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

/* The floats a workspace of config c for max_batch rows needs for its
 * views (0 for LINEAR), and lays them out from buf (backend memory of that
 * many floats; NULL: only count). */
size_t expert__ffn_ws_layout(struct expert__ffn_ws *ws, const struct expert_block_config *c,
                             int max_batch, float *buf);

/* Each returns 0 or the first backend call's error.
 * want_dgelu: keep gelu' for a backward. out may be NULL (a backward's
 * recompute that only needs the kept views). Backward: x->grads +=, dinp
 * = (may be NULL: not wanted). */
int expert__dense_forward(const struct expert__exec *x, float *out, const float *inp, int B);
int expert__dense_backward(const struct expert__exec *x, float *dinp, const float *dout,
                           const float *inp, int B);
int expert__resffn_forward(const struct expert__exec *x, struct expert__ffn_ws *ws, float *out,
                           const float *inp, int B, int want_dgelu);
int expert__resffn_backward(const struct expert__exec *x, struct expert__ffn_ws *ws, float *dinp,
                            const float *dout, const float *inp, int B);
int expert__head_forward(const struct expert__exec *x, struct expert__ffn_ws *ws, float *out,
                         const float *inp, int B);
int expert__head_backward(const struct expert__exec *x, struct expert__ffn_ws *ws, float *dinp,
                          const float *dout, const float *inp, int B);

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
    float *att;          /* attention's saved state: (NH,T,T) probabilities on
                            the CPU, (NH,T) log-sum-exps on CUDA (attention_sizes) */
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
    int32_t *tok;        /* (T)       EMBED: the tokens of each row (host memory) */
    float *g0, *g1;      /* (T,d)     residual-stream gradients between layers */
    float *gf;           /* (T,d)     LMHEAD: the gradient of xf */
    float *dres;         /* (T,d)     a layer's gradient of x1 */
    float *dqkv;         /* (T,3d) */
    float *datt;         /* attention backward scratch (attention_sizes) */
    float *dln;          /* (T,d) */
};

/* Kept views per layer, LMHEAD's final ones. */
#define EXPERT__SEQ_MAX_VIEWS (EXPERT__SEQ_LAYER_VIEWS * EXPERT_BLOCK_MAX_LAYERS + 4)

/* The kept views of ws in packing order, their floats per row. Returns
 * the count (at most EXPERT__SEQ_MAX_VIEWS). */
int expert__seq_kept_views(const struct expert_block_config *c, const struct expert_ops *ops,
                           const struct expert__seq_ws *ws, float **v, size_t *w);

/* The floats a workspace of config c for max_batch rows needs on backend
 * ops (its attention sizes), and lays the views out from buf (backend
 * memory of that many floats; NULL: only count). ws->tok is not among
 * them: it is host memory (expert/block.c allocates it). */
size_t expert__seq_ws_layout(struct expert__seq_ws *ws, const struct expert_block_config *c,
                             const struct expert_ops *ops, int max_batch, float *buf);

/* Tokens of B rows (T floats each, host memory) into tok (host memory):
 * -EINVAL unless every value is an integer in [0, V). */
int expert__seq_tokens(int32_t *tok, const float *inp, long n, int V);

/* ---- decoder layers (expert/decoder.c) ---- */

/* Runs layers [0, c->layers) of a stage whose first tensor of layer 0 is
 * x->t[first], on in (B rows; copied into layer 0's view), leaving the
 * result in out (B, T·d). */
int expert__layers_forward(const struct expert__exec *x, int first, struct expert__seq_ws *ws,
                           const float *in, float *out, int B);
/* Back-propagates dout (B, T·d), the gradient of the last layer's output
 * (not ws->g0, g1, dres or dln), through the layers: parameter gradients
 * += (x->grads), dx (B, T·d) = the gradient of layer 0's input (=); dx
 * NULL: not wanted (it lands in ws->g0). c->layers >= 1. */
int expert__layers_backward(const struct expert__exec *x, int first, struct expert__seq_ws *ws,
                            const float *dout, float *dx, int B);

/* ---- the kinds ----
 * EMBED's inp is host memory (tokens as floats: checked and converted on
 * the host, never uploaded); its forward returns 0 or -EINVAL for a value
 * that is not a token. EMBED writes no input gradient (tokens have none:
 * expert/block.c zeroes the caller's dinp).
 * Each forward writes out (B rows of the kind's output); each backward
 * adds the parameter gradients (x->grads) and writes dinp, the gradient of
 * its input. Return 0 or a negative errno. */
int expert__embed_forward(const struct expert__exec *x, struct expert__seq_ws *ws, float *out,
                          const float *inp_host, int B);
int expert__embed_backward(const struct expert__exec *x, struct expert__seq_ws *ws,
                           const float *dout, const float *inp_host, int B);
int expert__decoder_forward(const struct expert__exec *x, struct expert__seq_ws *ws, float *out,
                            const float *inp, int B);
int expert__decoder_backward(const struct expert__exec *x, struct expert__seq_ws *ws, float *dinp,
                             const float *dout, int B);
int expert__lmhead_forward(const struct expert__exec *x, struct expert__seq_ws *ws, float *out,
                           const float *inp, int B);
int expert__lmhead_backward(const struct expert__exec *x, struct expert__seq_ws *ws, float *dinp,
                            const float *dout, int B);

#endif
