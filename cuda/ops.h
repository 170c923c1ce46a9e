/* cuda/ops.h: the CUDA twins of the CPU ops in expert/ops.h.
 *
 * Same names (cuda_ instead of expert_), same argument order, same
 * accumulation contract (+= into parameter grads, = into activation grads).
 * Every pointer is device memory. Work is queued on the backend's stream.
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

#ifdef __cplusplus
}
#endif

#endif
