/* expert/dense.c: the LINEAR kind, a fully connected layer (nn.Linear).
 *   inp (B, in)  ->  out (B, out) = inp·Wᵀ + b
 * Tensors: w (out, in), b (out). It keeps nothing for its backward, which
 * reads only the input. */
#include "expert/kinds_internal.h"

#define P(i) EXPERT__P(x, i)
#define P16(i) EXPERT__P16(x, i)
#define G(i) EXPERT__G(x, i)

int expert__dense_forward(const struct expert__exec *x, float *out, const float *inp, int B)
{
    if (!out)
        return 0;
    return x->o->matmul_forward(out, NULL, inp, P(0), P16(0), P(1), B, x->c->in, x->c->out);
}

int expert__dense_backward(const struct expert__exec *x, float *dinp, const float *dout,
                           const float *inp, int B)
{
    return x->o->matmul_backward(dinp, G(0), G(1), dout, inp, P(0), P16(0), B, x->c->in, x->c->out);
}
