/* expert/guard.c: gradient norm bounds from a block's own history. */
#include "expert/guard.h"
#include "expert/optim.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>

struct expert_guard_config expert_guard_resolve(const struct expert_guard_config *c)
{
    struct expert_guard_config r = {0};
    if (c)
        r = *c;
    if (r.factor == 0 || !(r.factor == r.factor))
        r.factor = EXPERT_GUARD_FACTOR;
    if (r.max_norm == 0 || !(r.max_norm == r.max_norm))
        r.max_norm = EXPERT_GUARD_MAX_NORM;
    if (r.warmup <= 0)
        r.warmup = EXPERT_GUARD_WARMUP;
    if (r.frozen_steps <= 0)
        r.frozen_steps = EXPERT_GUARD_FROZEN_STEPS;
    return r;
}

int expert_guard_check(const struct expert_guard *g, const struct expert_guard_config *cfg,
                       double norm, const char *what, char *msg, size_t msglen)
{
    struct expert_guard_config c = expert_guard_resolve(cfg);
    char dummy[1];
    if (!msg || !msglen) {
        msg = dummy;
        msglen = sizeof dummy;
    }
    msg[0] = '\0';
    if (!isfinite(norm)) {
        snprintf(msg, msglen, "%s is not finite (NaN or Inf); refused", what);
        return -ERANGE;
    }
    if (c.max_norm > 0 && norm > c.max_norm) {
        snprintf(msg, msglen, "%s norm %.3g is above the limit %.3g; refused", what, norm, c.max_norm);
        return -ERANGE;
    }
    if (c.factor > 0 && g && g->seen >= (uint64_t)c.warmup && g->ref > 0 && norm > c.factor * g->ref) {
        snprintf(msg, msglen, "%s norm %.3g is %.3gx this block's recent norm %.3g (limit %gx); refused",
                 what, norm, norm / g->ref, g->ref, c.factor);
        return -ERANGE;
    }
    return 0;
}

void expert_guard_accept(struct expert_guard *g, const struct expert_guard_config *cfg, double norm)
{
    if (!g || !(norm > 0) || !isfinite(norm))
        return;
    struct expert_guard_config c = expert_guard_resolve(cfg);
    g->seen++;
    if (g->seen <= (uint64_t)c.warmup) {
        g->ref += (norm - g->ref) / (double)g->seen; /* the mean of the warm-up */
        g->warm = g->ref;
        return;
    }
    /* Clamped both ways: a stream of tiny norms must not talk the
     * reference down (and the bound with it) as fast as big ones can talk
     * it up, nor below a floor. */
    double x = norm < EXPERT_GUARD_RISE * g->ref ? norm : EXPERT_GUARD_RISE * g->ref;
    if (x < g->ref / EXPERT_GUARD_FALL)
        x = g->ref / EXPERT_GUARD_FALL;
    g->ref += EXPERT_GUARD_ALPHA * (x - g->ref);
    if (g->ref < EXPERT_GUARD_FLOOR * g->warm)
        g->ref = EXPERT_GUARD_FLOOR * g->warm;
}

void expert_guard_observe(struct expert_guard *g, const struct expert_guard_config *cfg, double norm)
{
    struct expert_guard_config c = expert_guard_resolve(cfg);
    if (!isfinite(norm) || (c.max_norm > 0 && norm > c.max_norm))
        return;
    expert_guard_accept(g, cfg, norm);
}

int expert_guard_sqnorm(const float *x, size_t n, double *sq_out)
{
    double s = x && n ? expert_sqnorm(x, n) : 0.0;
    if (sq_out)
        *sq_out = s;
    return isfinite(s) ? 0 : -ERANGE;
}
