/* expert/swiglu.c: the SwiGLU gate of a Llama MLP, silu(gate) · up. */
#include "expert/ops.h"

#include <errno.h>
#include <math.h>

int expert_swiglu_forward(float *out, const float *gate, const float *up, size_t N)
{
    if ((!out || !gate || !up) && N)
        return -EINVAL;
    for (size_t i = 0; i < N; i++) {
        float g = gate[i], s = g / (1.0f + expf(-g));
        out[i] = s * up[i];
    }
    return 0;
}

/* silu'(z) = σ(z) (1 + z (1 - σ(z))). */
int expert_swiglu_backward(float *dgate, float *dup, const float *dout, const float *gate, const float *up, size_t N)
{
    if ((!dgate || !dup || !dout || !gate || !up) && N)
        return -EINVAL;
    for (size_t i = 0; i < N; i++) {
        float g = gate[i], sg = 1.0f / (1.0f + expf(-g)), s = g * sg;
        float d = dout[i];
        dup[i] = d * s;
        dgate[i] = d * up[i] * sg * (1.0f + g * (1.0f - sg));
    }
    return 0;
}
