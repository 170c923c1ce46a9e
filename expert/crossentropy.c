/* expert/crossentropy.c: fused softmax + cross-entropy (the trainer's loss). */
#include "expert/ops.h"

#include <errno.h>
#include <math.h>

int expert_crossentropy_forward(float *losses, float *probs, const float *logits,
                                const int32_t *targets, int B, int V)
{
    if (!losses || !probs || !logits || !targets || B < 0 || V <= 0)
        return -EINVAL;
    for (int b = 0; b < B; b++) {
        const float *z = logits + (size_t)b * V;
        float *p = probs + (size_t)b * V;
        int32_t t = targets[b];
        if (t < 0 || t >= V)
            return -EINVAL;
        /* Subtract the max so exp never overflows; sum in double so wide
         * vocabularies keep their digits. */
        float mx = z[0];
        for (int v = 1; v < V; v++)
            mx = z[v] > mx ? z[v] : mx;
        double sum = 0.0;
        for (int v = 0; v < V; v++) {
            p[v] = expf(z[v] - mx);
            sum += p[v];
        }
        float inv = (float)(1.0 / sum);
        for (int v = 0; v < V; v++)
            p[v] *= inv;
        losses[b] = (float)(log(sum) - (double)(z[t] - mx));
    }
    return 0;
}

int expert_crossentropy_backward(float *dlogits, const float *probs,
                                 const int32_t *targets, float dloss, int B, int V)
{
    if (!dlogits || !probs || !targets || B < 0 || V <= 0)
        return -EINVAL;
    for (int b = 0; b < B; b++) {
        int32_t t = targets[b];
        if (t < 0 || t >= V)
            return -EINVAL;
        const float *p = probs + (size_t)b * V;
        float *d = dlogits + (size_t)b * V;
        for (int v = 0; v < V; v++)
            d[v] = (p[v] - (v == t ? 1.0f : 0.0f)) * dloss;
    }
    return 0;
}
