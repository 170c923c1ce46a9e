/* expert/ops.c: the CPU backend's function table. */
#include "expert/ops.h"

#include <string.h>

void expert_ops_init_cpu(struct expert_ops *ops)
{
    memset(ops, 0, sizeof *ops);
    ops->name = "cpu";
    ops->linear_forward = expert_linear_forward;
    ops->linear_backward = expert_linear_backward;
    ops->bias_forward = expert_bias_forward;
    ops->bias_backward = expert_bias_backward;
    ops->layernorm_forward = expert_layernorm_forward;
    ops->layernorm_backward = expert_layernorm_backward;
    ops->gelu_forward = expert_gelu_forward;
    ops->gelu_backward = expert_gelu_backward;
    ops->bias_gelu_forward = expert_bias_gelu_forward;
    ops->bias_gelu_backward = expert_bias_gelu_backward;
    ops->residual_forward = expert_residual_forward;
    ops->residual_backward = expert_residual_backward;
    ops->crossentropy_forward = expert_crossentropy_forward;
    ops->crossentropy_backward = expert_crossentropy_backward;
    ops->softmax_forward = expert_softmax_forward;
    ops->softmax_backward = expert_softmax_backward;
    ops->attention_forward = expert_attention_forward;
    ops->attention_backward = expert_attention_backward2;
    ops->embedding_forward = expert_embedding_forward;
    ops->embedding_backward = expert_embedding_backward;
    ops->matmul_forward = expert_matmul_forward;
    ops->matmul_backward = expert_matmul_backward;
    ops->attention_sizes = expert_attention_sizes;
    ops->sqnorm = expert_sqnorm_op;
    ops->adamw_update = expert_adamw_op;
    ops->sgd_update = expert_sgd_op;
    ops->cast_bf16 = expert_cast_bf16;
}
