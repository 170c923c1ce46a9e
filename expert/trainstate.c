/* expert/trainstate.c: a block's training state on its backend: the
 * accumulated gradients, the optimizer state (AdamW's moments or SGD's
 * momentum, the step count), the guard on every step's gradient and the
 * health of the steps; the optimizer step itself, flat export and apply
 * (replica averaging), parameter replacement, and the host view of the
 * state that checkpoints and state downloads serialise. The math of an
 * update is the backend's (sqnorm, adamw_update, sgd_update); the guard's
 * decisions are made on the host from the norms the backend returns. */
#include "expert/block.h"
#include "expert/block_internal.h"
#include "expert/guard.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int expert_block_accumulated(expert_block *b)
{
    pthread_mutex_lock(&b->grad_mu);
    int n = b->accum;
    pthread_mutex_unlock(&b->grad_mu);
    return n;
}

uint64_t expert_block_dropped_steps(expert_block *b)
{
    pthread_mutex_lock(&b->grad_mu);
    uint64_t n = b->dropped_steps;
    pthread_mutex_unlock(&b->grad_mu);
    return n;
}

uint64_t expert_block_steps(expert_block *b)
{
    pthread_mutex_lock(&b->grad_mu);
    uint64_t n = b->steps;
    pthread_mutex_unlock(&b->grad_mu);
    return n;
}

/* Zeroes the gradients and the sample count (grad_mu held); waits for the
 * zeroing, so the next backward may run on any thread. */
static int clear_grads(expert_block *b)
{
    b->accum = 0;
    int rc = b->be->zero(b->be, b->grads, b->n * sizeof(float));
    return rc == 0 ? b->be->sync(b->be) : rc;
}

void expert_block_zero_grad(expert_block *b)
{
    pthread_mutex_lock(&b->grad_mu);
    (void)clear_grads(b);
    pthread_mutex_unlock(&b->grad_mu);
}

/* A refused step: drops the accumulation, counts it, keeps the sentence. */
static int step_refused(expert_block *b, const char *why)
{
    (void)clear_grads(b);
    b->dropped_steps++;
    pthread_mutex_lock(&b->health_mu);
    b->health.refused_steps = b->dropped_steps;
    snprintf(b->health.last_refusal, sizeof b->health.last_refusal, "%s", why);
    pthread_mutex_unlock(&b->health_mu);
    return -ERANGE;
}

/* The backend failed in the middle of a step: the spare slot and the
 * moments may be half written. The spare slot is forgotten, the moments
 * start again from zero, the accumulation is dropped; the caller gets the
 * backend's error. */
static int step_failed(expert_block *b, int rc)
{
    pthread_mutex_lock(&b->mu);
    b->slot_valid[1 - b->cur] = 0;
    pthread_mutex_unlock(&b->mu);
    (void)b->be->zero(b->be, b->m, b->n * sizeof(float));
    (void)b->be->zero(b->be, b->v, b->n * sizeof(float));
    (void)clear_grads(b);
    return rc;
}

static int step_locked(expert_block *b, const struct expert_optim *o,
                       struct expert_step_info *info)
{
    const struct expert_ops *ops = &b->be->ops;
    if (expert_optim_check(o) < 0)
        return -EINVAL;
    if (b->optim_kind && b->optim_kind != o->kind)
        return -EINVAL; /* m/v hold the other optimizer's state */
    if (b->accum <= 0)
        return -EAGAIN;
    float gscale = 1.0f / (float)b->accum;
    double sq = 0;
    int rc = ops->sqnorm(&sq, b->grads, b->n);
    if (rc != 0)
        return step_failed(b, rc);
    double norm = sqrt(sq) * gscale;
    char why[sizeof b->health.last_refusal];
    /* A NaN/Inf gradient would poison every weight for good; a finite but
     * huge one (a grad_output of 1e30) overflows AdamW's v, after which
     * the weights never move again. Either is refused before it touches
     * the moments, and the whole accumulation is dropped (guard.h). */
    if (expert_guard_check(&b->guard, &b->guard_cfg, norm, "averaged gradient", why, sizeof why) < 0) {
        expert_guard_observe(&b->guard, &b->guard_cfg, norm); /* guard.h: refused norms lift it too */
        return step_refused(b, why);
    }
    if (o->clip_norm > 0.0f && norm > o->clip_norm)
        gscale *= (float)(o->clip_norm / (norm + 1e-6)); /* torch clip_grad_norm_ */
    const float *src = expert__current_params(b);
    float *dst = expert__spare_begin(b);
    uint64_t t = b->steps + 1;
    /* The update streams parameters, gradients and moments once and sums
     * what it did on the way (the checks below cost no extra pass). */
    double sums[2] = { 0, 0 };
    rc = o->kind == EXPERT_OPTIM_ADAMW
             ? ops->adamw_update(dst, src, b->grads, b->m, b->v, b->n, gscale, o, t, sums)
             : ops->sgd_update(dst, src, b->grads, b->m, b->n, gscale, o, sums);
    if (rc != 0)
        return step_failed(b, rc);
    double dd = sums[0], pp = sums[1];
    if (!isfinite(dd) || !isfinite(pp)) {
        /* The new weights or moments are not finite although the gradient
         * passed (the bounds were turned off, or SGD's momentum grew
         * without bound). The new weights are in the spare slot, which
         * is not published: forget that it held the version before last.
         * The moments were updated in place and cannot be recovered, so
         * they start again from zero. */
        pthread_mutex_lock(&b->mu);
        b->slot_valid[1 - b->cur] = 0;
        pthread_mutex_unlock(&b->mu);
        (void)b->be->zero(b->be, b->m, b->n * sizeof(float));
        (void)b->be->zero(b->be, b->v, b->n * sizeof(float));
        snprintf(why, sizeof why,
                 "the step from an averaged gradient of norm %.3g would have made weights or optimizer "
                 "state non-finite; rolled back (optimizer moments reset)", norm);
        return step_refused(b, why);
    }
    uint64_t version = b->version + 1; /* only writers change it; we are one */
    if ((rc = expert__spare_publish(b, version)) != 0)
        return step_failed(b, rc);
    expert_guard_accept(&b->guard, &b->guard_cfg, norm);
    b->steps = t;
    b->optim_kind = o->kind;
    /* A step that applied a non-zero gradient at lr > 0 but changed no
     * weight: the block is frozen (e.g. a second moment that a huge
     * gradient made enormous). Counted while it lasts. */
    double rel = pp > 0 ? sqrt(dd / pp) : dd > 0 ? 1.0 : 0.0;
    int still = o->lr > 0 && norm > 0 && rel <= EXPERT_GUARD_STILL_REL;
    pthread_mutex_lock(&b->health_mu);
    b->health.last_change = rel;
    b->health.grad_ref = b->guard.ref;
    b->health.still_steps = still ? b->health.still_steps + 1 : 0;
    b->health.frozen = b->health.still_steps >= (uint64_t)b->guard_cfg.frozen_steps;
    pthread_mutex_unlock(&b->health_mu);
    if (info) {
        info->grad_norm = norm;
        info->version = version;
        info->samples = b->accum;
    }
    return clear_grads(b);
}

int expert_block_set_guard(expert_block *b, const struct expert_guard_config *c)
{
    if (!b)
        return -EINVAL;
    pthread_mutex_lock(&b->grad_mu);
    b->guard_cfg = expert_guard_resolve(c);
    pthread_mutex_unlock(&b->grad_mu);
    return 0;
}

void expert_block_health(expert_block *b, struct expert_block_health *out)
{
    pthread_mutex_lock(&b->health_mu);
    *out = b->health;
    pthread_mutex_unlock(&b->health_mu);
}

int expert_block_step(expert_block *b, const struct expert_optim *o,
                      struct expert_step_info *info)
{
    if (!b)
        return -EINVAL;
    pthread_mutex_lock(&b->grad_mu);
    int rc = step_locked(b, o, info);
    pthread_mutex_unlock(&b->grad_mu);
    return rc;
}

int expert_block_maybe_step(expert_block *b, const struct expert_optim *o,
                            struct expert_step_info *info)
{
    if (!b || expert_optim_check(o) < 0)
        return -EINVAL;
    pthread_mutex_lock(&b->grad_mu);
    int rc = 0;
    if (b->accum >= o->target_batch) {
        rc = step_locked(b, o, info);
        if (rc == 0)
            rc = 1;
    }
    pthread_mutex_unlock(&b->grad_mu);
    return rc;
}

int expert_block_copy_grads(expert_block *b, float *out)
{
    if (!b || !out)
        return -EINVAL;
    pthread_mutex_lock(&b->grad_mu);
    int rc = b->be->download(b->be, out, b->grads, b->n * sizeof(float));
    pthread_mutex_unlock(&b->grad_mu);
    return rc;
}

int expert_block_set_params(expert_block *b, const float *params)
{
    if (!b || !params)
        return -EINVAL;
    pthread_mutex_lock(&b->grad_mu);
    float *dst = expert__spare_begin(b);
    int rc = b->be->upload(b->be, dst, params, b->n * sizeof(float));
    if (rc == 0)
        rc = expert__spare_publish(b, b->version + 1);
    else
        (void)b->be->sync(b->be);
    pthread_mutex_unlock(&b->grad_mu);
    return rc;
}

size_t expert_block_flat_len(const expert_block *b)
{
    return b ? 3 * b->n : 0;
}

int expert_block_flat_export(expert_block *b, float *out)
{
    if (!b || !out)
        return -EINVAL;
    const expert_backend *be = b->be;
    pthread_mutex_lock(&b->grad_mu);
    int rc = be->download(be, out, expert__current_params(b), b->n * sizeof(float));
    if (rc == 0)
        rc = be->download(be, out + b->n, b->m, b->n * sizeof(float));
    if (rc == 0)
        rc = be->download(be, out + 2 * b->n, b->v, b->n * sizeof(float));
    pthread_mutex_unlock(&b->grad_mu);
    return rc;
}

int expert_block_flat_apply(expert_block *b, const float *avg, const float *base, int with_optim,
                            double *dist_before, double *dist_after)
{
    if (!b || !avg || !base)
        return -EINVAL;
    const expert_backend *be = b->be;
    const size_t n = b->n;
    double d0 = 0, d1 = 0;
    int rc = 0;
    pthread_mutex_lock(&b->grad_mu);
    /* The arithmetic runs on the host: on the CPU in the block's own
     * memory, elsewhere on a host copy of the weights and moments that is
     * uploaded back once everything checked out (a round every few tens
     * of seconds: the copies cost nothing that matters). */
    float *copy = NULL;
    const float *ps;
    float *m, *v;
    if (be->host_memory) {
        ps = expert__current_params(b);
        m = b->m;
        v = b->v;
    } else {
        copy = malloc((n ? 3 * n : 1) * sizeof(float));
        if (!copy) {
            pthread_mutex_unlock(&b->grad_mu);
            return -ENOMEM;
        }
        rc = be->download(be, copy, expert__current_params(b), n * sizeof(float));
        if (rc == 0 && with_optim)
            rc = be->download(be, copy + n, b->m, n * sizeof(float));
        if (rc == 0 && with_optim)
            rc = be->download(be, copy + 2 * n, b->v, n * sizeof(float));
        ps = copy;
        m = copy + n;
        v = copy + 2 * n;
    }
    /* Check everything first: nothing changes unless all of it is finite. */
    for (size_t i = 0; i < (with_optim ? 3 : 1) * n && rc == 0; i++) {
        float cur = i < n ? ps[i] : i < 2 * n ? m[i - n] : v[i - 2 * n];
        if (!isfinite(cur + (avg[i] - base[i])))
            rc = -ERANGE;
    }
    if (rc == 0) {
        float *dst = expert__spare_begin(b);
        /* On the CPU the new weights go straight into the spare slot;
         * elsewhere into the copy's weights, which are then uploaded. */
        float *out = be->host_memory ? dst : copy;
        for (size_t i = 0; i < n; i++) {
            float nv = ps[i] + (avg[i] - base[i]);
            double e0 = (double)base[i] - avg[i], e1 = (double)nv - avg[i];
            d0 += e0 * e0;
            d1 += e1 * e1;
            out[i] = nv;
        }
        if (with_optim) {
            for (size_t i = 0; i < n; i++) {
                m[i] += avg[n + i] - base[n + i];
                float nv = v[i] + (avg[2 * n + i] - base[2 * n + i]);
                v[i] = nv > 0.0f ? nv : 0.0f;
            }
        }
        if (!be->host_memory) {
            rc = be->upload(be, dst, copy, n * sizeof(float));
            if (rc == 0 && with_optim)
                rc = be->upload(be, b->m, m, n * sizeof(float));
            if (rc == 0 && with_optim)
                rc = be->upload(be, b->v, v, n * sizeof(float));
        }
        if (rc == 0)
            rc = expert__spare_publish(b, b->version + 1);
        else
            (void)be->sync(be);
    }
    pthread_mutex_unlock(&b->grad_mu);
    free(copy);
    if (rc == 0) {
        if (dist_before)
            *dist_before = sqrt(d0);
        if (dist_after)
            *dist_after = sqrt(d1);
    }
    return rc;
}

/* ------------------------------------- for the checkpoint format -- */

int expert__block_state_lock(expert_block *b, struct expert__block_state *out)
{
    const expert_backend *be = b->be;
    memset(out, 0, sizeof *out);
    pthread_mutex_lock(&b->outer_mu);
    pthread_mutex_lock(&b->grad_mu);
    if (be->host_memory) {
        out->params = expert__current_params(b);
        out->m = b->m;
        out->v = b->v;
    } else {
        size_t n = b->n;
        float *copy = malloc((n ? 3 * n : 1) * sizeof(float));
        int rc = copy ? 0 : -ENOMEM;
        if (rc == 0)
            rc = be->download(be, copy, expert__current_params(b), n * sizeof(float));
        if (rc == 0)
            rc = be->download(be, copy + n, b->m, n * sizeof(float));
        if (rc == 0)
            rc = be->download(be, copy + 2 * n, b->v, n * sizeof(float));
        if (rc != 0) {
            free(copy);
            pthread_mutex_unlock(&b->grad_mu);
            pthread_mutex_unlock(&b->outer_mu);
            return rc;
        }
        out->copy_ = copy;
        out->params = copy;
        out->m = copy + n;
        out->v = copy + 2 * n;
    }
    out->version = b->version;
    out->steps = b->steps;
    out->optim_kind = b->optim_kind;
    out->model = b->model;
    out->stage = b->stage;
    out->stage_hash = b->stage_hash;
    out->guard = b->guard;
    out->outer = b->outer;
    return 0;
}

void expert__block_state_unlock(expert_block *b, struct expert__block_state *st)
{
    pthread_mutex_unlock(&b->grad_mu);
    pthread_mutex_unlock(&b->outer_mu);
    free(st->copy_);
    st->copy_ = NULL;
}

int expert__block_restore(expert_block *b, const void *params, const void *m, const void *v,
                          uint64_t version, uint64_t steps, int optim_kind,
                          const struct expert__train_extra *extra)
{
    const expert_backend *be = b->be;
    const size_t bytes = b->n * sizeof(float);
    /* The outer state's copy first: nothing below fails for want of it. */
    float *outer = NULL;
    if (extra && extra->outer) {
        if (!(outer = malloc(3 * (b->n ? b->n : 1) * sizeof(float))))
            return -ENOMEM;
        memcpy(outer, extra->outer, 3 * bytes);
    }
    pthread_mutex_lock(&b->outer_mu);
    pthread_mutex_lock(&b->grad_mu);
    float *dst = expert__spare_begin(b);
    int rc = be->upload(be, dst, params, bytes);
    if (rc == 0)
        rc = m && v ? be->upload(be, b->m, m, bytes) : be->zero(be, b->m, bytes);
    if (rc == 0)
        rc = m && v ? be->upload(be, b->v, v, bytes) : be->zero(be, b->v, bytes);
    if (rc == 0)
        rc = expert__spare_publish(b, version);
    if (rc != 0) {
        (void)step_failed(b, rc);
        pthread_mutex_unlock(&b->grad_mu);
        pthread_mutex_unlock(&b->outer_mu);
        free(outer);
        return rc;
    }
    b->steps = m && v ? steps : 0;
    b->optim_kind = m && v ? optim_kind : 0;
    b->guard = extra ? extra->guard : (struct expert_guard){ 0 };
    pthread_mutex_lock(&b->health_mu);
    b->health.grad_ref = b->guard.ref;
    pthread_mutex_unlock(&b->health_mu);
    free(b->outer);
    b->outer = outer;
    rc = clear_grads(b);
    pthread_mutex_unlock(&b->grad_mu);
    pthread_mutex_unlock(&b->outer_mu);
    return rc;
}

/* ---------------------------------------------- DiLoCo's outer state -- */

int expert_block_outer_lock(expert_block *b, int create, struct expert_outer *out)
{
    if (!b || !out)
        return -EINVAL;
    pthread_mutex_lock(&b->outer_mu);
    if (!b->outer && create) {
        b->outer = calloc(3 * (b->n ? b->n : 1), sizeof(float));
        if (!b->outer) {
            pthread_mutex_unlock(&b->outer_mu);
            return -ENOMEM;
        }
    }
    if (!b->outer) {
        pthread_mutex_unlock(&b->outer_mu);
        return -ENOENT;
    }
    out->anchor = b->outer;
    out->momentum = b->outer + b->n;
    out->residual = b->outer + 2 * b->n;
    out->n = b->n;
    return 0;
}

int expert__block_has_outer(const expert_block *b)
{
    /* The lock is the block's state, not its identity: taking it through
     * a const pointer changes nothing a caller can see. */
    pthread_mutex_t *mu = (pthread_mutex_t *)&b->outer_mu;
    pthread_mutex_lock(mu);
    int has = b->outer != NULL;
    pthread_mutex_unlock(mu);
    return has;
}

void expert_block_outer_unlock(expert_block *b)
{
    pthread_mutex_unlock(&b->outer_mu);
}

void expert_block_outer_drop(expert_block *b)
{
    pthread_mutex_lock(&b->outer_mu);
    free(b->outer);
    b->outer = NULL;
    pthread_mutex_unlock(&b->outer_mu);
}
