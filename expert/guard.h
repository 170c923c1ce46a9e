/* expert/guard.h: sanity bounds on gradients, from a block's own history.
 *
 * A gradient arrives from whoever sends a backward. One that is finite but
 * absurd (a grad_output of 1e30) does not make the weights non-finite: with
 * AdamW its square overflows the second moment v to +Inf, every later
 * update of those weights becomes m / Inf = 0, and the block stops learning
 * for good while its weight version keeps rising. So gradients are checked
 * before they touch any optimizer state, against
 *   - finiteness;
 *   - an absolute cap (max_norm), which also keeps g² finite in fp32;
 *   - the block's own recent history: after `warmup` accepted observations,
 *     a norm above `factor` times the reference (a running average of the
 *     norms accepted before) is refused.
 * The same statistic serves two places: the peer checks each backward
 * request's grad_outputs and inputs (per-sample norms) before queueing it,
 * and the block checks the averaged gradient of every optimizer step
 * (expert_block_step; block.h).
 *
 * The reference cannot be talked up quickly: an accepted norm moves it by
 * EXPERT_GUARD_ALPHA of the difference, and counts for at most
 * EXPERT_GUARD_RISE times the reference, so it rises by at most 2 % per
 * accepted norm: raising the bound 100-fold takes over 200 accepted
 * requests that each sit just below it. Falling is slower still (a norm
 * counts for at least the reference / EXPERT_GUARD_FALL: at most 0.4 % per
 * observation, so talking the bound down 100-fold takes over 1,100
 * requests) and stops at EXPERT_GUARD_FLOOR x the warm-up mean; refused
 * norms under the absolute cap are observed too (expert_guard_observe), so
 * honest traffic that the bound has fallen below lifts it back at 2 % per
 * request (from the floor: about 120 requests to reach 1/100 of the
 * warm-up scale) instead of being locked out.
 *
 * Pure functions on caller-owned state: not thread-safe on one state.
 */
#ifndef EXPERT_GUARD_H
#define EXPERT_GUARD_H

#include <stddef.h>
#include <stdint.h>

#ifndef EXPERT_GUARD_FACTOR
#define EXPERT_GUARD_FACTOR 100.0   /* refuse above this many times the reference */
#endif
#ifndef EXPERT_GUARD_MAX_NORM
#define EXPERT_GUARD_MAX_NORM 1e5   /* absolute cap on a norm */
#endif
#ifndef EXPERT_GUARD_WARMUP
#define EXPERT_GUARD_WARMUP 20      /* accepted observations before the relative bound */
#endif
#ifndef EXPERT_GUARD_FROZEN_STEPS
#define EXPERT_GUARD_FROZEN_STEPS 8 /* consecutive steps that moved nothing = frozen */
#endif
#define EXPERT_GUARD_ALPHA 0.02     /* weight of a new norm in the reference */
#define EXPERT_GUARD_RISE 2.0       /* a new norm counts for at most RISE x the reference */
#endif
#ifndef EXPERT_GUARD_FALL
#define EXPERT_GUARD_FALL 1.25      /* ... and for at least the reference / FALL */
#endif
#ifndef EXPERT_GUARD_FLOOR
#define EXPERT_GUARD_FLOOR 1e-3     /* the reference stays above this x the warm-up mean */
/* A step whose relative weight change ‖Δp‖/‖p‖ is at most this moved
 * nothing. Honest AdamW steps at lr 1e-3 changed fmnist-mlp's stages by
 * 1e-5 to 2e-5 even once its loss was near 0 (test_expert_guard), so
 * learning rates down to about 1e-7 stay clear of it; a block whose second
 * moment overflowed changes exactly 0, one whose v holds 1e27 about 5e-10. */
#define EXPERT_GUARD_STILL_REL 1e-9

/* Zero fields take the defaults above; a negative factor or max_norm turns
 * that bound off (non-finite norms are refused regardless). */
struct expert_guard_config {
    double factor;
    double max_norm;
    int warmup;
    int frozen_steps;   /* steps that change no weight before the block counts as frozen */
};

/* The history of one stream of norms (zero-initialise). */
struct expert_guard {
    double ref;         /* reference norm: mean over the warm-up, then a damped average */
    uint64_t seen;      /* accepted non-zero norms */
    double warm;        /* the warm-up mean (the reference's floor is FLOOR x this) */
};

/* The config with zeros replaced by the defaults. */
struct expert_guard_config expert_guard_resolve(const struct expert_guard_config *c);

/* Checks norm (of `what`, e.g. "gradient", for the message) against g.
 * Returns 0, or -ERANGE with a sentence in msg (may be NULL) naming the
 * norm, the bound and why: "gradient norm 1e+30 is 3.1e+29x this block's
 * recent norm 3.2 (limit 100x); refused". Does not change g. */
int expert_guard_check(const struct expert_guard *g, const struct expert_guard_config *c,
                       double norm, const char *what, char *msg, size_t msglen);

/* Records an accepted norm (norms of 0 are not recorded: a block that got
 * only zero gradients has no scale yet). After the warm-up it counts for
 * at most RISE x the reference and at least the reference / FALL. */
void expert_guard_accept(struct expert_guard *g, const struct expert_guard_config *c, double norm);

/* Records a checked norm whether or not expert_guard_check refused it, as
 * long as it is finite and within the absolute cap (those are refused for
 * good). So honest traffic above a reference that was talked down (or that
 * fell while the block converged) lifts it back, at the same bounded rate
 * at which accepted norms could: no sender raises the bound faster by
 * being refused. */
void expert_guard_observe(struct expert_guard *g, const struct expert_guard_config *c, double norm);

/* *sq_out = Σ x² over x (n floats) in double (expert_sqnorm). Returns 0,
 * or -ERANGE when an element is NaN or Inf. For request checks. */
int expert_guard_sqnorm(const float *x, size_t n, double *sq_out);

#endif
