/* expert/optim.c: AdamW and SGD kernels (PyTorch formulas). */
#include "expert/optim.h"
#include "expert/simd.h"

#include <errno.h>
#include <math.h>

void expert_optim_default_adamw(struct expert_optim *o)
{
    *o = (struct expert_optim){ .kind = EXPERT_OPTIM_ADAMW, .lr = 1e-3f,
        .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f, .weight_decay = 0.0f,
        .momentum = 0.0f, .clip_norm = 0.0f, .target_batch = 128 };
}

void expert_optim_default_sgd(struct expert_optim *o)
{
    *o = (struct expert_optim){ .kind = EXPERT_OPTIM_SGD, .lr = 1e-2f,
        .momentum = 0.9f, .target_batch = 128 };
}

int expert_optim_check(const struct expert_optim *o)
{
    if (!o || (o->kind != EXPERT_OPTIM_ADAMW && o->kind != EXPERT_OPTIM_SGD))
        return -EINVAL;
    if (!isfinite(o->lr) || o->lr < 0.0f || !isfinite(o->weight_decay) ||
        o->weight_decay < 0.0f || !isfinite(o->clip_norm) || o->clip_norm < 0.0f ||
        o->target_batch < 1)
        return -EINVAL;
    if (o->kind == EXPERT_OPTIM_ADAMW &&
        (!(o->beta1 >= 0.0f && o->beta1 < 1.0f) || !(o->beta2 >= 0.0f && o->beta2 < 1.0f) ||
         !(o->eps > 0.0f) || !isfinite(o->eps)))
        return -EINVAL;
    if (o->kind == EXPERT_OPTIM_SGD && !(o->momentum >= 0.0f && o->momentum < 1.0f))
        return -EINVAL;
    return 0;
}

EXPERT__CLONES
static void adamw(float *p_out, const float *p_in, const float *g, float *m, float *v,
                  size_t n, float gscale, float lr, float b1, float b2, float eps,
                  float decay, float step_size, float bc2_sqrt)
{
    for (size_t i = 0; i < n; i++) {
        float gi = g[i] * gscale;
        float p = p_in[i] * decay;           /* torch: p.mul_(1 - lr*wd) first */
        float mi = m[i] * b1 + (1.0f - b1) * gi;       /* torch 1.13 order */
        float vi = v[i] * b2 + (1.0f - b2) * gi * gi;
        m[i] = mi;
        v[i] = vi;
        float denom = sqrtf(vi) / bc2_sqrt + eps;
        p_out[i] = p - step_size * (mi / denom);
    }
}

void expert_adamw_update(float *p_out, const float *p_in, const float *g,
                         float *m, float *v, size_t n, float gscale,
                         const struct expert_optim *o, uint64_t t)
{
    double bc1 = 1.0 - pow((double)o->beta1, (double)t);
    double bc2 = 1.0 - pow((double)o->beta2, (double)t);
    float step_size = (float)(o->lr / bc1);
    float bc2_sqrt = (float)sqrt(bc2);
    adamw(p_out, p_in, g, m, v, n, gscale, o->lr, o->beta1, o->beta2, o->eps,
          1.0f - o->lr * o->weight_decay, step_size, bc2_sqrt);
}

EXPERT__CLONES
static void sgd(float *p_out, const float *p_in, const float *g, float *buf, size_t n,
                float gscale, float lr, float wd, float mom)
{
    for (size_t i = 0; i < n; i++) {
        float gi = g[i] * gscale + wd * p_in[i];
        float b = mom * buf[i] + gi;
        buf[i] = b;
        p_out[i] = p_in[i] - lr * b;
    }
}

void expert_sgd_update(float *p_out, const float *p_in, const float *g,
                       float *buf, size_t n, float gscale,
                       const struct expert_optim *o)
{
    sgd(p_out, p_in, g, buf, n, gscale, o->lr, o->weight_decay, o->momentum);
}

/* Eight independent double accumulators (lane i % 8), combined in a fixed
 * order: the compiler can keep them in one vector register without
 * reassociating anything, and the result does not depend on the ISA the
 * clone runs. A single accumulator made this a chain of dependent adds,
 * one per 4 cycles: about as long as the whole AdamW pass. */
EXPERT__CLONES
static double sqnorm8(const float *g, size_t n)
{
    double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int l = 0; l < 8; l++)
            acc[l] += (double)g[i + l] * (double)g[i + l];
    for (int l = 0; i < n; i++, l++)
        acc[l] += (double)g[i] * (double)g[i];
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

double expert_sqnorm(const float *g, size_t n)
{
    return sqnorm8(g, n);
}
