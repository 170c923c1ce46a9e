/* expert/optim.h: optimizers as flat-array kernels, plus their config.
 *
 * Blocks call these on their single parameter/gradient/state allocations, so
 * one call updates every tensor of a block. The kernels follow PyTorch's
 * torch.optim.AdamW and torch.optim.SGD(momentum, dampening=0, nesterov=False)
 * formulas exactly (fp32, same operation order where it matters), so the tests
 * compare against torch to a few ulps. Kernels are pure: thread-safe on
 * disjoint arrays, allocate nothing.
 */
#ifndef EXPERT_OPTIM_H
#define EXPERT_OPTIM_H

#include <stddef.h>
#include <stdint.h>

/* The kernels' restrict, also in the C++ of cuda/ (which includes this
 * header for struct expert_optim). */
#ifdef __cplusplus
#define EXPERT__RESTRICT __restrict__
extern "C" {
#else
#define EXPERT__RESTRICT restrict
#endif

enum expert_optim_kind {
    EXPERT_OPTIM_ADAMW = 1,
    EXPERT_OPTIM_SGD = 2,
};

struct expert_optim {
    int kind;            /* enum expert_optim_kind */
    float lr;
    float beta1, beta2;  /* AdamW (torch defaults 0.9, 0.999) */
    float eps;           /* AdamW (1e-8) */
    float weight_decay;  /* AdamW: decoupled; SGD: L2 added to the gradient */
    float momentum;      /* SGD (0 = plain SGD) */
    float clip_norm;     /* > 0: clip the gradient's L2 norm to this first */
    int target_batch;    /* samples to accumulate before a step (>= 1) */
};

/* torch.optim.AdamW defaults with lr = 1e-3 and no weight decay (= Adam, the
 * baseline's optimizer); clip off; target_batch 128. */
void expert_optim_default_adamw(struct expert_optim *o);
/* SGD lr 0.01, momentum 0.9; clip off; target_batch 128. */
void expert_optim_default_sgd(struct expert_optim *o);

/* Checks ranges: -EINVAL when kind is unknown, lr/eps/betas/momentum out of
 * range or not finite, target_batch < 1. */
int expert_optim_check(const struct expert_optim *o);

/* One AdamW step, t = step number starting at 1. p_out may alias p_in.
 * g is scaled by gscale first (averaging and clipping fold into it).
 * p_out, p_in, g, m, v: (n) each; m and v are updated in place. */
void expert_adamw_update(float *p_out, const float *p_in, const float *g,
                         float *m, float *v, size_t n, float gscale,
                         const struct expert_optim *o, uint64_t t);

/* One SGD-with-momentum step; buf is the momentum buffer (zeros before the
 * first step, which then equals torch's clone-on-first-step). */
void expert_sgd_update(float *p_out, const float *p_in, const float *g,
                       float *buf, size_t n, float gscale,
                       const struct expert_optim *o);

/* The two updates above with the step's checks folded in (the same
 * results, element for element), for arrays that do not overlap: adds to
 * sums[0] Σ (p_out − p_in)² and to sums[1] Σ p_out² + 0·(m + v) (AdamW) or
 * + 0·buf (SGD), which is NaN or Inf when any new weight or moment is. The
 * block's step uses them to refuse a non-finite update and to see a step
 * that changed nothing, without a second pass over memory. */
void expert_adamw_update_checked(float *EXPERT__RESTRICT p_out, const float *EXPERT__RESTRICT p_in,
                                 const float *EXPERT__RESTRICT g, float *EXPERT__RESTRICT m,
                                 float *EXPERT__RESTRICT v, size_t n, float gscale,
                                 const struct expert_optim *o, uint64_t t, double sums[2]);
void expert_sgd_update_checked(float *EXPERT__RESTRICT p_out, const float *EXPERT__RESTRICT p_in,
                               const float *EXPERT__RESTRICT g, float *EXPERT__RESTRICT buf, size_t n,
                               float gscale, const struct expert_optim *o,
                               double sums[2]);

/* Σ g² in double (for global-norm clipping across several blocks). */
double expert_sqnorm(const float *g, size_t n);

#ifdef __cplusplus
}
#endif

#endif
