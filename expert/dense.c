/* expert/dense.c: the LINEAR kind, one fully connected layer (torch's
 * nn.Linear(in, out)); named so as not to clash with the op in
 * expert/linear.c, which it calls.
 *   inp  (B, in)
 *   out  (B, out)  = inp·Wᵀ + b
 * Tensors: w (out,in), b (out). It keeps nothing: its backward reads only
 * the input. */
#include "expert/kinds_internal.h"
#include "expert/ops.h"

enum { W, BIAS };

void expert__dense_forward(const struct expert_block_config *c, const struct expert_tensor_info *t,
                           const float *params, float *out, const float *inp, int B)
{
    if (out)
        expert_linear_forward(out, inp, params + t[W].offset, params + t[BIAS].offset, B, c->in,
                              c->out);
}

/* dW += doutᵀ·inp, db += Σ dout, dinp = dout·W. */
void expert__dense_backward(const struct expert_block_config *c, const struct expert_tensor_info *t,
                            const float *params, float *grads, float *dinp, const float *dout,
                            const float *inp, int B)
{
    expert_linear_backward(dinp, grads + t[W].offset, grads + t[BIAS].offset, dout, inp,
                           params + t[W].offset, B, c->in, c->out);
}
