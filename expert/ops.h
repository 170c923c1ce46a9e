/* expert/ops.h: the backend interface of the math layer.
 *
 * Every op is a _forward/_backward pair with one argument order, shared by the
 * CPU reference (expert/<op>.c) and the CUDA twin (cuda/<op>.cu):
 *     outputs, saved-for-backward, inputs, weights, dims.
 * All tensors are fp32, row-major, contiguous; shapes are given per argument.
 * Linear weights use PyTorch's layout, w is (OC, C), so checkpoints and
 * reference fixtures compare one to one with nn.Linear.
 *
 * Backward contract (llm.c): parameter grads are ACCUMULATED (+=), activation
 * grads are WRITTEN (=). Running a backward twice therefore doubles the
 * parameter grads and leaves the activation grads unchanged. A NULL
 * activation-grad pointer means "not wanted" where the op says so.
 *
 * All ops return 0 or -EINVAL (bad dims / NULL). They allocate nothing and keep
 * no state, so any number of threads may call them on disjoint outputs.
 * BLAS-backed ops use OpenBLAS's thread pool (expert_blas_set_threads).
 */
#ifndef EXPERT_OPS_H
#define EXPERT_OPS_H

#include <stddef.h>
#include <stdint.h>

/* out = inp · wᵀ + bias.  out (B,OC), inp (B,C), w (OC,C), bias (OC) or NULL. */
#define decl_linear_fwd_fn(name) \
int (name)(float *out, const float *inp, const float *w, const float *bias, \
           int B, int C, int OC)
/* dinp = dout · w (= ; skipped when dinp is NULL); dw += doutᵀ · inp;
 * dbias += Σ_b dout (skipped when dbias is NULL).
 * dinp (B,C), dw (OC,C), dbias (OC), dout (B,OC), inp (B,C), w (OC,C). */
#define decl_linear_bwd_fn(name) \
int (name)(float *dinp, float *dw, float *dbias, const float *dout, \
           const float *inp, const float *w, int B, int C, int OC)

/* out = inp + bias (broadcast over rows); out may alias inp.
 * out (B,C), inp (B,C), bias (C). */
#define decl_bias_fwd_fn(name) \
int (name)(float *out, const float *inp, const float *bias, int B, int C)
/* dbias += Σ_b dout. (dinp = dout is the identity and is left to the caller.)
 * dbias (C), dout (B,C). */
#define decl_bias_bwd_fn(name) \
int (name)(float *dbias, const float *dout, int B, int C)

/* out = (inp - mean) * rstd * w + b per row; mean, rstd (N) are saved for
 * backward (may be NULL). eps is fixed at EXPERT_LN_EPS (PyTorch's 1e-5).
 * out (N,C), inp (N,C), w (C), b (C). */
#define decl_layernorm_fwd_fn(name) \
int (name)(float *out, float *mean, float *rstd, const float *inp, \
           const float *w, const float *b, int N, int C)
/* dinp = ∂L/∂inp (=), dw += , db += .  mean/rstd from the forward.
 * dinp (N,C), dw (C), db (C), dout (N,C), inp (N,C), w (C), mean/rstd (N). */
#define decl_layernorm_bwd_fn(name) \
int (name)(float *dinp, float *dw, float *db, const float *dout, \
           const float *inp, const float *w, const float *mean, \
           const float *rstd, int N, int C)

/* ---- Llama-family ops (train_llama.py's docstring is the specification) ---- */

/* RMSNorm (Hugging Face LlamaRMSNorm) per row: out = w · x · rstd, rstd =
 * 1/sqrt(mean(x²) + eps) in fp32, saved for backward (may be NULL).
 * out (N,C), inp (N,C), w (C), rstd (N); out may not alias inp. */
#define decl_rmsnorm_fwd_fn(name) \
int (name)(float *out, float *rstd, const float *inp, const float *w, float eps, int N, int C)
/* dinp = ∂L/∂inp (=), dw += .  rstd from the forward.
 * dinp (N,C), dw (C), dout (N,C), inp (N,C), w (C), rstd (N). */
#define decl_rmsnorm_bwd_fn(name) \
int (name)(float *dinp, float *dw, const float *dout, const float *inp, const float *w, \
           const float *rstd, int N, int C)

/* Rotary embedding in Hugging Face's rotate-half layout, in place: x holds
 * N rows of `heads` heads of hd (even) values; row n is at position
 * n % T, whose cos/sin rows (T, hd/2) come from expert_rope_tables. For
 * i < hd/2 and a = the angle: x[i] <- x[i] cos a - x[i+hd/2] sin a,
 * x[i+hd/2] <- x[i+hd/2] cos a + x[i] sin a. The backward (inverse = 1)
 * rotates by -a: applied to ∂L/∂out in place it gives ∂L/∂inp. */
#define decl_rope_fn(name) \
int (name)(float *x, const float *cos_t, const float *sin_t, int N, int T, int heads, int hd, int inverse)

/* Causal grouped-query attention (Llama's; RoPE already applied to q and k):
 * query head h reads kv head h / (H/KV); per head S = q·kᵀ · fp32(1/√hd),
 * S[i][j] = -inf for j > i, P = softmax over j (fp32), o = P·v.
 * out (B,T,H,hd), att (B,H,T,T) = P saved for backward, q (B,T,H,hd),
 * k and v (B,T,KV,hd); KV divides H. */
#define decl_gqa_fwd_fn(name) \
int (name)(float *out, float *att, const float *q, const float *k, const float *v, int B, int T, int H, \
           int KV, int hd)
/* dq, dk, dv = ∂L/∂q, ∂L/∂k, ∂L/∂v (=; dk and dv sum over each group's
 * query heads). Shapes as the forward's; dout (B,T,H,hd). */
#define decl_gqa_bwd_fn(name) \
int (name)(float *dq, float *dk, float *dv, const float *dout, const float *att, const float *q, \
           const float *k, const float *v, int B, int T, int H, int KV, int hd)

/* SwiGLU's gate: out = silu(gate) · up, silu(z) = z / (1 + exp(-z)).
 * out, gate, up (N); out may alias neither. */
#define decl_swiglu_fwd_fn(name) \
int (name)(float *out, const float *gate, const float *up, size_t N)
/* dgate = dout · up · silu'(gate), dup = dout · silu(gate) (both =).
 * dgate, dup, dout, gate, up (N). */
#define decl_swiglu_bwd_fn(name) \
int (name)(float *dgate, float *dup, const float *dout, const float *gate, const float *up, size_t N)

/* GELU, exact erf form (PyTorch nn.GELU() default): out = x·Φ(x).
 * out (N), inp (N); out may alias inp. */
#define decl_gelu_fwd_fn(name) \
int (name)(float *out, const float *inp, long N)
/* dinp = dout · GELU'(inp) (=). dinp may alias dout. */
#define decl_gelu_bwd_fn(name) \
int (name)(float *dinp, const float *dout, const float *inp, long N)

/* Fused bias + GELU over a hidden activation, one pass over memory:
 * pre = pre + bias (in place, saved for backward), out = GELU(pre) and
 * dgelu = GELU'(pre) (saved for backward; may be NULL).
 * out, pre, dgelu (B,C); bias (C). */
#define decl_bias_gelu_fwd_fn(name) \
int (name)(float *out, float *dgelu, float *pre, const float *bias, int B, int C)
/* Fused backward: dpre = dout · dgelu (=, may alias dout), dbias += Σ_b dpre.
 * dpre (B,C), dbias (C), dout (B,C), dgelu (B,C) from the forward. */
#define decl_bias_gelu_bwd_fn(name) \
int (name)(float *dpre, float *dbias, const float *dout, const float *dgelu, \
           int B, int C)

/* out = a + b (elementwise); out may alias a or b. (N) each. */
#define decl_residual_fwd_fn(name) \
int (name)(float *out, const float *a, const float *b, long N)
/* da = dout, db = dout (=); either may be NULL; either may alias dout. */
#define decl_residual_bwd_fn(name) \
int (name)(float *da, float *db, const float *dout, long N)

/* Softmax cross-entropy. losses (B) = -log softmax(logits)[target];
 * probs (B,V) saved for backward; logits (B,V); targets (B) in [0,V).
 * Returns -EINVAL for an out-of-range target (nothing written past it). */
#define decl_crossentropy_fwd_fn(name) \
int (name)(float *losses, float *probs, const float *logits, \
           const int32_t *targets, int B, int V)
/* dlogits = (probs - onehot(target)) · dloss (=), where dloss is the gradient
 * of the loss with respect to each sample's loss (1 for a summed loss,
 * 1/B for a mean). dlogits (B,V), probs (B,V), targets (B). */
#define decl_crossentropy_bwd_fn(name) \
int (name)(float *dlogits, const float *probs, const int32_t *targets, \
           float dloss, int B, int V)

/* Row softmax. out (N,V) = softmax(inp) per row (max-subtracted); out may
 * alias inp. */
#define decl_softmax_fwd_fn(name) \
int (name)(float *out, const float *inp, int N, int V)
/* dinp = out ⊙ (dout − Σ_j dout_j·out_j) per row (=); dinp may alias dout.
 * dinp, dout, out (N,V). */
#define decl_softmax_bwd_fn(name) \
int (name)(float *dinp, const float *dout, const float *out, int N, int V)

/* Causal multi-head self-attention over a fused qkv (train_lm.py's layout).
 * qkv (B,T,3C): columns [0,C) are q, [C,2C) k, [2C,2C+C) v; head h uses
 * columns h·hd .. h·hd+hd-1 of each, hd = C/NH (C % NH == 0).
 * att (B,NH,T,T) = softmax(q·kᵀ/√hd + M) per head, M[i][j] = -inf for j > i
 * (the scale is applied before the mask); entries j > i are written 0.
 * Saved for backward. out (B,T,C) = att·v, heads concatenated in order. */
#define decl_attention_fwd_fn(name) \
int (name)(float *out, float *att, const float *qkv, int B, int T, int C, int NH)
/* dqkv (B,T,3C) = ∂/∂qkv (=). scratch (B,NH,T,T) is overwritten.
 * dout (B,T,C), qkv and att from the forward. */
#define decl_attention_bwd_fn(name) \
int (name)(float *dqkv, float *scratch, const float *dout, const float *qkv, \
           const float *att, int B, int T, int C, int NH)

/* Token + learned position embedding.
 * out (B,T,C) = wte[tok[b][t]] + wpe[t]; tok (B,T) in [0,V); wte (V,C);
 * wpe (T,C) (the first T rows of a longer table work too).
 * -EINVAL for a token out of range (nothing written past it). */
#define decl_embedding_fwd_fn(name) \
int (name)(float *out, const int32_t *tok, const float *wte, const float *wpe, \
           int B, int T, int C, int V)
/* dwte[tok[b][t]] += dout[b][t]; dwpe[t] += Σ_b dout[b][t] (both +=).
 * -EINVAL for a token out of range (no gradient changed). */
#define decl_embedding_bwd_fn(name) \
int (name)(float *dwte, float *dwpe, const float *dout, const int32_t *tok, \
           int B, int T, int C, int V)

/* ---- The ops the block kinds run (the backend table's own forms) ---- */

/* The linear layer as the kinds use it, with its epilogues:
 *   out = [res +] inp · wᵀ [+ bias]
 * res (B,OC) may be NULL (nothing added) and may alias out; bias (OC) may
 * be NULL. w16 (OC,C) is w as bf16 (the block keeps it when the backend's
 * precision is bf16; a backend in fp32 ignores it, one in bf16 converts w
 * itself when it is NULL). out (B,OC), inp (B,C), w (OC,C). */
#define decl_matmul_fwd_fn(name) \
int (name)(float *out, const float *res, const float *inp, const float *w, \
           const uint16_t *w16, const float *bias, int B, int C, int OC)
/* dw += doutᵀ·inp and dbias += Σ_b dout (when dbias is not NULL) first,
 * then dinp = dout·w (=; skipped when dinp is NULL), so dinp may alias inp.
 * dinp (B,C), dw (OC,C), dbias (OC), dout (B,OC), inp (B,C), w and w16
 * (OC,C) as for the forward. */
#define decl_matmul_bwd_fn(name) \
int (name)(float *dinp, float *dw, float *dbias, const float *dout, const float *inp, \
           const float *w, const uint16_t *w16, int B, int C, int OC)

/* Attention as the kinds use it: the forward as attention_forward, where
 * saved holds what this backend's backward needs (per sequence:
 * attention_sizes' saved floats); the backward also takes the forward's
 * output `out` (B,T,C) and a scratch of attention_sizes' scratch floats per
 * sequence. */
#define decl_attention_bwd2_fn(name) \
int (name)(float *dqkv, float *scratch, const float *dout, const float *out, \
           const float *qkv, const float *saved, int B, int T, int C, int NH)
/* Floats per sequence of attention's saved state and backward scratch:
 * the CPU keeps the probabilities (NH·T·T each); a flash-style backend
 * keeps one log-sum-exp per row and head (NH·T). */
#define decl_attention_sizes_fn(name) \
void (name)(int T, int NH, size_t *saved_out, size_t *scratch_out)

/* *out = Σ x² in double, summed in an order that depends on n alone (the
 * same result for any number of threads). Waits for the result. */
#define decl_sqnorm_fn(name) \
int (name)(double *out, const float *x, size_t n)
/* expert_adamw_update_checked and expert_sgd_update_checked (expert/optim.h)
 * over the backend's memory: the same formulas element for element, and
 * sums[0] += Σ (p_out − p_in)², sums[1] += Σ p_out² + 0·(moments) in host
 * memory (waits for them). The arrays must not overlap. */
#define decl_adamw_fn(name) \
int (name)(float *p_out, const float *p_in, const float *g, float *m, float *v, size_t n, \
           float gscale, const struct expert_optim *o, uint64_t t, double sums[2])
#define decl_sgd_fn(name) \
int (name)(float *p_out, const float *p_in, const float *g, float *buf, size_t n, \
           float gscale, const struct expert_optim *o, double sums[2])
/* dst (n) = src rounded to bfloat16 (round to nearest even; NaN stays NaN). */
#define decl_cast_bf16_fn(name) \
int (name)(uint16_t *dst, const float *src, size_t n)

#define EXPERT_LN_EPS 1e-5f

struct expert_optim;

/* The function table a backend fills in. Every entry is set by every
 * backend; pointers are the backend's memory, except the embedding ops'
 * tokens (host memory: they were checked on the host). */
struct expert_ops {
    const char *name;                          /* "cpu", "cuda", "sim" */
    decl_linear_fwd_fn(*linear_forward);
    decl_linear_bwd_fn(*linear_backward);
    decl_bias_fwd_fn(*bias_forward);
    decl_bias_bwd_fn(*bias_backward);
    decl_layernorm_fwd_fn(*layernorm_forward);
    decl_layernorm_bwd_fn(*layernorm_backward);
    decl_gelu_fwd_fn(*gelu_forward);
    decl_gelu_bwd_fn(*gelu_backward);
    decl_bias_gelu_fwd_fn(*bias_gelu_forward);
    decl_bias_gelu_bwd_fn(*bias_gelu_backward);
    decl_residual_fwd_fn(*residual_forward);
    decl_residual_bwd_fn(*residual_backward);
    decl_crossentropy_fwd_fn(*crossentropy_forward);
    decl_crossentropy_bwd_fn(*crossentropy_backward);
    decl_softmax_fwd_fn(*softmax_forward);
    decl_softmax_bwd_fn(*softmax_backward);
    decl_attention_fwd_fn(*attention_forward);
    decl_attention_bwd2_fn(*attention_backward); /* the kinds' form (expert_attention_backward2) */
    decl_embedding_fwd_fn(*embedding_forward);
    decl_embedding_bwd_fn(*embedding_backward);
    decl_matmul_fwd_fn(*matmul_forward);
    decl_matmul_bwd_fn(*matmul_backward);
    decl_attention_sizes_fn(*attention_sizes);
    decl_sqnorm_fn(*sqnorm);
    decl_adamw_fn(*adamw_update);
    decl_sgd_fn(*sgd_update);
    decl_cast_bf16_fn(*cast_bf16);
};

/* Fills ops with the CPU reference backend. Always available. */
void expert_ops_init_cpu(struct expert_ops *ops);

/* The CPU implementations, callable directly. */
decl_linear_fwd_fn(expert_linear_forward);
decl_linear_bwd_fn(expert_linear_backward);
decl_bias_fwd_fn(expert_bias_forward);
decl_bias_bwd_fn(expert_bias_backward);
decl_layernorm_fwd_fn(expert_layernorm_forward);
decl_layernorm_bwd_fn(expert_layernorm_backward);
decl_gelu_fwd_fn(expert_gelu_forward);
decl_gelu_bwd_fn(expert_gelu_backward);
decl_bias_gelu_fwd_fn(expert_bias_gelu_forward);
decl_bias_gelu_bwd_fn(expert_bias_gelu_backward);
decl_residual_fwd_fn(expert_residual_forward);
decl_residual_bwd_fn(expert_residual_backward);
decl_crossentropy_fwd_fn(expert_crossentropy_forward);
decl_crossentropy_bwd_fn(expert_crossentropy_backward);
decl_softmax_fwd_fn(expert_softmax_forward);
decl_softmax_bwd_fn(expert_softmax_backward);
decl_attention_fwd_fn(expert_attention_forward);
decl_attention_bwd_fn(expert_attention_backward);
decl_embedding_fwd_fn(expert_embedding_forward);
decl_embedding_bwd_fn(expert_embedding_backward);
decl_matmul_fwd_fn(expert_matmul_forward);
decl_matmul_bwd_fn(expert_matmul_backward);
decl_attention_bwd2_fn(expert_attention_backward2);
decl_attention_sizes_fn(expert_attention_sizes);
decl_sqnorm_fn(expert_sqnorm_op);
decl_adamw_fn(expert_adamw_op);
decl_sgd_fn(expert_sgd_op);
decl_cast_bf16_fn(expert_cast_bf16);
decl_rmsnorm_fwd_fn(expert_rmsnorm_forward);
decl_rmsnorm_bwd_fn(expert_rmsnorm_backward);
decl_rope_fn(expert_rope);
decl_swiglu_fwd_fn(expert_swiglu_forward);
decl_swiglu_bwd_fn(expert_swiglu_backward);
decl_gqa_fwd_fn(expert_gqa_forward);
decl_gqa_bwd_fn(expert_gqa_backward);

/* RoPE's tables for positions 0..T-1 and a head of hd (even) values:
 * cos_t[p][i] = cos(p · theta^(-2i/hd)) and sin_t likewise, i < hd/2,
 * computed in double and rounded to float (train_llama.py's rope_tables).
 * cos_t, sin_t (T, hd/2). Returns 0 or -EINVAL. */
int expert_rope_tables(float *cos_t, float *sin_t, int T, int hd, double theta);

#endif
