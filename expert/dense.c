/* expert/dense.c: the LINEAR kind, a fully connected layer (nn.Linear).
 *   inp (B, in)  ->  out (B, out) = inp·Wᵀ + b
 * Tensors: w (out, in), b (out). It keeps nothing for its backward, which
 * reads only the input. */
#include "expert/kinds_internal.h"
#include "expert/ops.h"

void expert__dense_forward(const struct expert_block_config *c, const struct expert_tensor_info *t,
                           const float *params, float *out, const float *inp, int B)
{
    if (out)
        expert_linear_forward(out, inp, params + t[0].offset, params + t[1].offset, B, c->in, c->out);
}

void expert__dense_backward(const struct expert_block_config *c, const struct expert_tensor_info *t,
                            const float *params, float *grads, float *dinp, const float *dout,
                            const float *inp, int B)
{
    expert_linear_backward(dinp, grads + t[0].offset, grads + t[1].offset, dout, inp,
                           params + t[0].offset, B, c->in, c->out);
}
