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

/* The checked kernels: the same formulas in the same order per element,
 * plus two sums kept in 16 float lanes (lane l takes elements l mod 16),
 * so GCC vectorises the loop without reassociating anything. The arrays
 * must not overlap (restrict), which lets the lanes' loads and stores be
 * reordered. Float lanes are enough: the sums only feed a relative
 * change and a finiteness test. */
#define CK_LANES 16

static void lanes_out(const float dd[CK_LANES], const float pp[CK_LANES], double sums[2])
{
    double a = 0, b = 0;
    for (int l = 0; l < CK_LANES; l++) {
        a += dd[l];
        b += pp[l];
    }
    sums[0] += a;
    sums[1] += b;
}

EXPERT__CLONES
static void adamw_ck(float *restrict p_out, const float *restrict p_in, const float *restrict g,
                     float *restrict m, float *restrict v, size_t n, float gscale, float b1, float b2,
                     float eps, float decay, float step_size, float bc2_sqrt, double sums[2])
{
    float dd[CK_LANES] = {0}, pp[CK_LANES] = {0};
    size_t i = 0;
    for (; i + CK_LANES <= n; i += CK_LANES)
        for (int l = 0; l < CK_LANES; l++) {
            size_t k = i + (size_t)l;
            float gi = g[k] * gscale;
            float p = p_in[k] * decay;
            float mi = m[k] * b1 + (1.0f - b1) * gi;
            float vi = v[k] * b2 + (1.0f - b2) * gi * gi;
            m[k] = mi;
            v[k] = vi;
            float po = p - step_size * (mi / (sqrtf(vi) / bc2_sqrt + eps));
            p_out[k] = po;
            float d = po - p_in[k];
            dd[l] += d * d;
            pp[l] += po * po + (mi + vi) * 0.0f;
        }
    for (int l = 0; i < n; i++, l++) {
        float gi = g[i] * gscale;
        float p = p_in[i] * decay;
        float mi = m[i] * b1 + (1.0f - b1) * gi;
        float vi = v[i] * b2 + (1.0f - b2) * gi * gi;
        m[i] = mi;
        v[i] = vi;
        float po = p - step_size * (mi / (sqrtf(vi) / bc2_sqrt + eps));
        p_out[i] = po;
        float d = po - p_in[i];
        dd[l] += d * d;
        pp[l] += po * po + (mi + vi) * 0.0f;
    }
    lanes_out(dd, pp, sums);
}

void expert_adamw_update_checked(float *restrict p_out, const float *restrict p_in, const float *restrict g,
                                 float *restrict m, float *restrict v, size_t n, float gscale,
                                 const struct expert_optim *o, uint64_t t, double sums[2])
{
    double bc1 = 1.0 - pow((double)o->beta1, (double)t);
    double bc2 = 1.0 - pow((double)o->beta2, (double)t);
    adamw_ck(p_out, p_in, g, m, v, n, gscale, o->beta1, o->beta2, o->eps, 1.0f - o->lr * o->weight_decay,
             (float)(o->lr / bc1), (float)sqrt(bc2), sums);
}

EXPERT__CLONES
static void sgd_ck(float *restrict p_out, const float *restrict p_in, const float *restrict g,
                   float *restrict buf, size_t n, float gscale, float lr, float wd, float mom, double sums[2])
{
    float dd[CK_LANES] = {0}, pp[CK_LANES] = {0};
    size_t i = 0;
    for (; i + CK_LANES <= n; i += CK_LANES)
        for (int l = 0; l < CK_LANES; l++) {
            size_t k = i + (size_t)l;
            float gi = g[k] * gscale + wd * p_in[k];
            float b = mom * buf[k] + gi;
            buf[k] = b;
            float po = p_in[k] - lr * b;
            p_out[k] = po;
            float d = po - p_in[k];
            dd[l] += d * d;
            pp[l] += po * po + b * 0.0f;
        }
    for (int l = 0; i < n; i++, l++) {
        float gi = g[i] * gscale + wd * p_in[i];
        float b = mom * buf[i] + gi;
        buf[i] = b;
        float po = p_in[i] - lr * b;
        p_out[i] = po;
        float d = po - p_in[i];
        dd[l] += d * d;
        pp[l] += po * po + b * 0.0f;
    }
    lanes_out(dd, pp, sums);
}

void expert_sgd_update_checked(float *restrict p_out, const float *restrict p_in, const float *restrict g,
                               float *restrict buf, size_t n, float gscale, const struct expert_optim *o,
                               double sums[2])
{
    sgd_ck(p_out, p_in, g, buf, n, gscale, o->lr, o->weight_decay, o->momentum, sums);
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
