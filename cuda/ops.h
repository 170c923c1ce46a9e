/* cuda/ops.h: the CUDA twins of the CPU ops in expert/ops.h.
 *
 * Same names (cuda_ instead of expert_), same argument order, same
 * accumulation contract (+= into parameter grads, = into activation grads).
 * Every pointer is device memory, except the embedding ops' tokens (host
 * memory, as expert/ops.h says). Work is queued on the calling thread's
 * stream (cuda/common.cuh); ops return 0, -EINVAL (bad arguments), -ENODEV
 * (no device), -ENOMEM (scratch) or -EIO (a launch failed). Results are
 * deterministic for a fixed configuration: no op sums with atomics.
 * Plain C: no CUDA header is needed to call these.
 */
#ifndef CUDA_OPS_H
#define CUDA_OPS_H

#ifdef __cplusplus
extern "C" {
#endif

#include "expert/ops.h"

decl_linear_fwd_fn(cuda_linear_forward);
decl_linear_bwd_fn(cuda_linear_backward);
decl_bias_fwd_fn(cuda_bias_forward);
decl_bias_bwd_fn(cuda_bias_backward);
decl_layernorm_fwd_fn(cuda_layernorm_forward);
decl_layernorm_bwd_fn(cuda_layernorm_backward);
decl_gelu_fwd_fn(cuda_gelu_forward);
decl_gelu_bwd_fn(cuda_gelu_backward);
decl_bias_gelu_fwd_fn(cuda_bias_gelu_forward);
decl_bias_gelu_bwd_fn(cuda_bias_gelu_backward);
decl_residual_fwd_fn(cuda_residual_forward);
decl_residual_bwd_fn(cuda_residual_backward);
decl_crossentropy_fwd_fn(cuda_crossentropy_forward);
decl_crossentropy_bwd_fn(cuda_crossentropy_backward);
decl_softmax_fwd_fn(cuda_softmax_forward);
decl_softmax_bwd_fn(cuda_softmax_backward);

/* Flash-style causal attention (cuda/attention.cu): the forward saves one
 * log-sum-exp per (sequence, head, row), never the T×T probabilities; the
 * backward recomputes them tile by tile. saved and scratch are
 * cuda_attention_sizes' NH·T floats per sequence. */
decl_attention_fwd_fn(cuda_attention_forward);
decl_attention_bwd2_fn(cuda_attention_backward);
decl_attention_sizes_fn(cuda_attention_sizes);
/* The same contract for the bf16 backend (cuda/attention_bf16.cu): the
 * products on the tensor cores (q, k, v, dout, P and dS rounded to bf16,
 * fp32 accumulation; softmax, lse and dS in fp32), deterministic. Head sizes
 * that are not a multiple of 16 up to 128 (or a device without the shared
 * memory) run the fp32 functions above, for forward and backward alike;
 * saved holds the same lse either way (cuda_attention_sizes). */
decl_attention_fwd_fn(cuda_attention_forward_bf16);
decl_attention_bwd2_fn(cuda_attention_backward_bf16);

/* Token + position embedding (cuda/embedding.cu); tok is host memory. The
 * backward adds each token's rows in a fixed order (positions sorted by
 * token on the host), without atomics. */
decl_embedding_fwd_fn(cuda_embedding_forward);
decl_embedding_bwd_fn(cuda_embedding_backward);

/* The linear layer through cuBLASLt (cuda/matmul.cu): fp32 (full fp32
 * products, or TF32 after cuda_set_tf32(1)), and bf16 (bf16 inputs from
 * w16 or converted on the fly, fp32 accumulation and outputs). */
decl_matmul_fwd_fn(cuda_matmul_forward);
decl_matmul_bwd_fn(cuda_matmul_backward);
decl_matmul_fwd_fn(cuda_matmul_forward_bf16);
decl_matmul_bwd_fn(cuda_matmul_backward_bf16);

/* The step (cuda/step.cu): deterministic sums (fixed blocks, then the
 * blocks' sums in order, in double), the checked updates, the bf16 cast. */
decl_sqnorm_fn(cuda_sqnorm);
decl_adamw_fn(cuda_adamw_update);
decl_sgd_fn(cuda_sgd_update);
decl_cast_bf16_fn(cuda_cast_bf16);

#ifdef __cplusplus
}
#endif

#endif
