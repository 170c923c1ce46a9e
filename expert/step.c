/* expert/step.c: the CPU backend's optimizer-step ops: the gradient's
 * squared norm and the checked AdamW and SGD updates (expert/optim.c's
 * kernels), split over the BLAS thread budget (expert/pool.h). Both are
 * memory bound: they stream parameters, gradients and moments once. */
#include "expert/ops.h"
#include "expert/optim.h"
#include "expert/pool.h"

#include <errno.h>

/* Σ x² over the thread budget. x is cut into at most SQ_CHUNKS chunks
 * whose size depends on n alone; each chunk's sum is computed whole by one
 * thread and the sums are added in chunk order, so the result is the same
 * for any number of threads. */
#define SQ_CHUNKS 256
struct sq_ctx {
    const float *g;
    size_t n, chunk, chunks;
    double part[SQ_CHUNKS];
};

static void sq_part(void *ctx, int i, int n)
{
    struct sq_ctx *c = ctx;
    size_t lo, hi;
    expert__split(c->chunks, i, n, 1, &lo, &hi);
    for (size_t k = lo; k < hi; k++) {
        size_t a = k * c->chunk, e = a + c->chunk < c->n ? a + c->chunk : c->n;
        c->part[k] = expert_sqnorm(c->g + a, e - a);
    }
}

int expert_sqnorm_op(double *out, const float *x, size_t n)
{
    if (!out || (!x && n))
        return -EINVAL;
    struct sq_ctx c;
    c.g = x;
    c.n = n;
    c.chunk = (n + SQ_CHUNKS - 1) / SQ_CHUNKS;
    if (c.chunk < 4096)
        c.chunk = 4096;
    c.chunks = (n + c.chunk - 1) / c.chunk;
    expert__parallel(sq_part, &c, n);
    double s = 0.0;
    for (size_t k = 0; k < c.chunks; k++)
        s += c.part[k];
    *out = s;
    return 0;
}

struct upd_ctx {
    const struct expert_optim *o;
    float *dst, *m, *v;
    const float *src, *g;
    size_t n;
    float gscale;
    uint64_t t;
    double sums[EXPERT__POOL_MAX_PARTS][2]; /* per part: Σ Δp², Σ p'² (+ 0·moments) */
};

/* Each part also sums what its update did (expert_adamw_update_checked):
 * the checks of the step cost no extra pass over memory. */
static void upd_part(void *ctx, int i, int n)
{
    struct upd_ctx *c = ctx;
    size_t lo, hi;
    expert__split(c->n, i, n, 16, &lo, &hi);
    c->sums[i][0] = c->sums[i][1] = 0;
    if (hi <= lo)
        return;
    if (c->o->kind == EXPERT_OPTIM_ADAMW)
        expert_adamw_update_checked(c->dst + lo, c->src + lo, c->g + lo, c->m + lo, c->v + lo, hi - lo,
                                    c->gscale, c->o, c->t, c->sums[i]);
    else
        expert_sgd_update_checked(c->dst + lo, c->src + lo, c->g + lo, c->m + lo, hi - lo, c->gscale,
                                  c->o, c->sums[i]);
}

static int update(struct upd_ctx *c, double sums[2])
{
    /* Unused parts leave their sums at 0, so every part's are added. */
    for (int i = 0; i < EXPERT__POOL_MAX_PARTS; i++)
        c->sums[i][0] = c->sums[i][1] = 0;
    expert__parallel(upd_part, c, c->n * 7);
    double dd = 0, pp = 0;
    for (int i = 0; i < EXPERT__POOL_MAX_PARTS; i++) {
        dd += c->sums[i][0];
        pp += c->sums[i][1];
    }
    sums[0] += dd;
    sums[1] += pp;
    return 0;
}

int expert_adamw_op(float *p_out, const float *p_in, const float *g, float *m, float *v, size_t n,
                    float gscale, const struct expert_optim *o, uint64_t t, double sums[2])
{
    if (!p_out || !p_in || !g || !m || !v || !o || !sums || o->kind != EXPERT_OPTIM_ADAMW)
        return -EINVAL;
    struct upd_ctx c = { .o = o, .dst = p_out, .m = m, .v = v, .src = p_in, .g = g, .n = n,
                         .gscale = gscale, .t = t };
    return update(&c, sums);
}

int expert_sgd_op(float *p_out, const float *p_in, const float *g, float *buf, size_t n, float gscale,
                  const struct expert_optim *o, double sums[2])
{
    if (!p_out || !p_in || !g || !buf || !o || !sums || o->kind != EXPERT_OPTIM_SGD)
        return -EINVAL;
    struct upd_ctx c = { .o = o, .dst = p_out, .m = buf, .src = p_in, .g = g, .n = n, .gscale = gscale };
    return update(&c, sums);
}
