/* expert/block.c: the block runtime on any backend: creation, the
 * double-buffered weights with pinned snapshots, the generic forward and
 * backward drivers (recomputing or from kept rows) and the stage identity.
 * Each kind's own forward and backward is its own file (dense, resffn,
 * head, embed, decoder, lmhead) behind expert/kinds_internal.h, computing
 * through the block's backend; block.c dispatches to them and moves the
 * caller's host tensors to and from the backend. Workspaces are
 * expert/workspace.c's; gradients, optimizer state and steps are
 * expert/trainstate.c's; configs are expert/blockcfg.c's; a block's bytes
 * (the checkpoint format) are expert/serialize.c's. */
#include "expert/block.h"
#include "expert/block_internal.h"
#include "expert/guard.h"
#include "expert/model.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ----------------------------------------------------------- create -- */

static void free_memory(expert_block *b)
{
    const expert_backend *be = b->be;
    expert_backend_free(be, b->params);
    expert_backend_free(be, b->params16);
    expert_backend_free(be, b->grads);
    expert_backend_free(be, b->m);
    expert_backend_free(be, b->v);
}

size_t expert_block_bytes(const struct expert_block_config *cfg, const expert_backend *be)
{
    struct expert_tensor_info t[EXPERT_BLOCK_MAX_TENSORS];
    size_t n = 0;
    if (expert_block_config_tensors(cfg, t, &n) < 0)
        return 0;
    size_t bytes = 5 * n * sizeof(float); /* two slots, gradients, two moments */
    if (be && be->precision == EXPERT_PRECISION_BF16)
        bytes += 2 * n * sizeof(uint16_t);
    return bytes;
}

expert_block *expert_block_create_on(const struct expert_block_config *cfg, uint64_t seed,
                                     const expert_backend *be)
{
    if (expert_block_config_check(cfg) < 0 || !be)
        return NULL;
    expert_block *b = calloc(1, sizeof *b);
    if (!b)
        return NULL;
    b->cfg = *cfg;
    b->be = be;
    b->slot_valid[0] = 1; /* slot 0 holds version 0 */
    b->nt = expert_block_config_tensors(cfg, b->t, &b->n);
    size_t bytes = (b->n ? b->n : 1) * sizeof(float);
    float *init = be->host_memory ? NULL : malloc(bytes);
    b->params = be->alloc(be, 2 * bytes);
    b->grads = be->alloc(be, bytes);
    b->m = be->alloc(be, bytes);
    b->v = be->alloc(be, bytes);
    if (be->precision == EXPERT_PRECISION_BF16)
        b->params16 = be->alloc(be, 2 * (b->n ? b->n : 1) * sizeof(uint16_t));
    if (!b->params || !b->grads || !b->m || !b->v ||
        (be->precision == EXPERT_PRECISION_BF16 && !b->params16) || (!be->host_memory && !init))
        goto fail;
    /* The first weights are drawn on the host, into the block's memory
     * directly when it is host memory. */
    expert_block_init_params(cfg, seed, init ? init : b->params);
    int rc = init ? be->upload(be, b->params, init, b->n * sizeof(float)) : 0;
    if (rc == 0)
        rc = be->copy(be, b->params + b->n, b->params, b->n * sizeof(float));
    if (rc == 0 && b->params16)
        rc = be->ops.cast_bf16(b->params16, b->params, 2 * b->n);
    if (rc == 0)
        rc = be->zero(be, b->grads, b->n * sizeof(float));
    if (rc == 0)
        rc = be->zero(be, b->m, b->n * sizeof(float));
    if (rc == 0)
        rc = be->zero(be, b->v, b->n * sizeof(float));
    if (rc == 0)
        rc = be->sync(be);
    free(init);
    init = NULL;
    if (rc != 0)
        goto fail;
    if (pthread_mutex_init(&b->mu, NULL) != 0)
        goto fail;
    if (pthread_cond_init(&b->cv, NULL) != 0) {
        pthread_mutex_destroy(&b->mu);
        goto fail;
    }
    if (pthread_mutex_init(&b->grad_mu, NULL) != 0) {
        pthread_cond_destroy(&b->cv);
        pthread_mutex_destroy(&b->mu);
        goto fail;
    }
    if (pthread_mutex_init(&b->health_mu, NULL) != 0) {
        pthread_mutex_destroy(&b->grad_mu);
        pthread_cond_destroy(&b->cv);
        pthread_mutex_destroy(&b->mu);
        goto fail;
    }
    if (pthread_mutex_init(&b->outer_mu, NULL) != 0) {
        pthread_mutex_destroy(&b->health_mu);
        pthread_mutex_destroy(&b->grad_mu);
        pthread_cond_destroy(&b->cv);
        pthread_mutex_destroy(&b->mu);
        goto fail;
    }
    b->guard_cfg = expert_guard_resolve(NULL);
    return b;
fail:
    free(init);
    free_memory(b);
    free(b);
    return NULL;
}

expert_block *expert_block_create(const struct expert_block_config *cfg, uint64_t seed)
{
    return expert_block_create_on(cfg, seed, expert_backend_cpu());
}

void expert_block_destroy(expert_block **p)
{
    if (!p || !*p)
        return;
    expert_block *b = *p;
    pthread_mutex_destroy(&b->outer_mu);
    free(b->outer);
    pthread_mutex_destroy(&b->health_mu);
    pthread_mutex_destroy(&b->grad_mu);
    pthread_cond_destroy(&b->cv);
    pthread_mutex_destroy(&b->mu);
    free_memory(b);
    free(b);
    *p = NULL;
}

const struct expert_block_config *expert_block_config(const expert_block *b)
{
    return &b->cfg;
}

const expert_backend *expert_block_backend(const expert_block *b)
{
    return b ? b->be : NULL;
}

const struct expert_tensor_info *expert_block_tensors(const expert_block *b, int *n_out,
                                                      size_t *total_out)
{
    if (n_out)
        *n_out = b->nt;
    if (total_out)
        *total_out = b->n;
    return b->t;
}

size_t expert_block_nparams(const expert_block *b)
{
    return b->n;
}

/* -------------------------------------------------------- snapshots -- */

void expert_block_snapshot_acquire(expert_block *b, struct expert_snapshot *s)
{
    pthread_mutex_lock(&b->mu);
    s->slot = b->cur;
    b->refs[s->slot]++;
    s->version = b->version;
    s->params = b->params + (size_t)s->slot * b->n;
    pthread_mutex_unlock(&b->mu);
}

void expert_block_snapshot_release(expert_block *b, struct expert_snapshot *s)
{
    pthread_mutex_lock(&b->mu);
    if (--b->refs[s->slot] == 0)
        pthread_cond_broadcast(&b->cv);
    pthread_mutex_unlock(&b->mu);
    s->params = NULL;
}

int expert_block_read_params(expert_block *b, float *out, uint64_t *version_out)
{
    if (!b || !out)
        return -EINVAL;
    struct expert_snapshot s;
    expert_block_snapshot_acquire(b, &s);
    int rc = b->be->download(b->be, out, s.params, b->n * sizeof(float));
    if (version_out)
        *version_out = s.version;
    expert_block_snapshot_release(b, &s);
    return rc;
}

uint64_t expert_block_version(expert_block *b)
{
    pthread_mutex_lock(&b->mu);
    uint64_t v = b->version;
    pthread_mutex_unlock(&b->mu);
    return v;
}

/* Writers hold grad_mu, so there is one at a time and cur only changes under
 * them. Returns the spare slot once no reader pins it; new readers pin cur,
 * so it stays unpinned until publish(). */
float *expert__spare_begin(expert_block *b)
{
    pthread_mutex_lock(&b->mu);
    int back = 1 - b->cur;
    while (b->refs[back] > 0)
        pthread_cond_wait(&b->cv, &b->mu);
    pthread_mutex_unlock(&b->mu);
    return b->params + (size_t)back * b->n;
}

int expert__spare_publish(expert_block *b, uint64_t version)
{
    int back = 1 - b->cur; /* only writers change cur; we are one */
    int rc = 0;
    if (b->params16)
        rc = b->be->ops.cast_bf16(b->params16 + (size_t)back * b->n, b->params + (size_t)back * b->n,
                                  b->n);
    if (rc == 0)
        rc = b->be->sync(b->be);
    if (rc != 0) {
        /* The spare slot may be half written: it no longer holds what it did. */
        pthread_mutex_lock(&b->mu);
        b->slot_valid[back] = 0;
        pthread_mutex_unlock(&b->mu);
        return rc;
    }
    pthread_mutex_lock(&b->mu);
    b->cur = back;
    b->version = version;
    b->slot_version[b->cur] = version;
    b->slot_valid[b->cur] = 1;
    pthread_mutex_unlock(&b->mu);
    return 0;
}

const float *expert__current_params(expert_block *b)
{
    pthread_mutex_lock(&b->mu);
    const float *p = b->params + (size_t)b->cur * b->n;
    pthread_mutex_unlock(&b->mu);
    return p;
}

/* ---------------------------------------------------- forward/backward -- */

static int check_call(const expert_block *b, const expert_workspace *ws, int B)
{
    if (!ws || B < 1 || B > ws->max_batch || ws->be != b->be)
        return -EINVAL;
    if (memcmp(&ws->cfg, &b->cfg, sizeof b->cfg) != 0)
        return -EINVAL;
    return 0;
}

enum {
    RUN_FORWARD = 1,   /* run the forward (a backward's recompute too) */
    RUN_KEEP = 2,      /* keep what a backward reads (RESFFN: gelu') */
    RUN_BACKWARD = 4,  /* then back-propagate dout */
    RUN_DEVICE = 8,    /* the tensors are backend memory already (EMBED's input aside) */
};

/* One call of the block's kind on slot `slot`'s weights. The tensors are
 * the caller's host memory: on a backend without host memory the inputs
 * are uploaded into the workspace's staging views and the outputs
 * downloaded at the end (EMBED's tokens stay on the host: the kind reads
 * them there). Every call ends with the thread's queued work done, so its
 * writes are visible to the next caller on any thread. Returns 0, -EINVAL
 * for input a kind refuses (EMBED: a token that is not an integer in [0,
 * vocab)), or the backend's error. */
static int run_kind(expert_block *b, int slot, expert_workspace *ws, float *out, float *dinp,
                    const float *dout, const float *inp, int B, int flags)
{
    const expert_backend *be = b->be;
    const struct expert_block_config *c = &b->cfg;
    const int embed = c->kind == EXPERT_BLOCK_EMBED;
    const int host = be->host_memory || (flags & RUN_DEVICE);
    const size_t nin = (size_t)B * (size_t)c->in, nout = (size_t)B * (size_t)c->out;
    struct expert__exec x = {
        .be = be, .o = &be->ops, .c = c, .t = b->t,
        .params = b->params + (size_t)slot * b->n,
        .params16 = b->params16 ? b->params16 + (size_t)slot * b->n : NULL,
        .grads = (flags & RUN_BACKWARD) ? b->grads : NULL,
    };
    const float *xi = inp, *gy = dout;
    float *y = out, *gx = embed ? NULL : dinp;
    int rc = 0;
    if (!host) {
        if (!embed)
            rc = be->upload(be, ws->d_in, inp, nin * sizeof(float));
        if (!embed)
            xi = ws->d_in;
        y = out ? ws->d_out : NULL;
        if (flags & RUN_BACKWARD) {
            if (rc == 0)
                rc = be->upload(be, ws->d_dout, dout, nout * sizeof(float));
            gy = ws->d_dout;
            gx = gx ? ws->d_dinp : NULL;
        }
    }
    if (rc == 0 && (flags & RUN_FORWARD)) {
        switch (c->kind) {
        case EXPERT_BLOCK_EMBED: rc = expert__embed_forward(&x, ws->seq, y, inp, B); break;
        case EXPERT_BLOCK_DECODER: rc = expert__decoder_forward(&x, ws->seq, y, xi, B); break;
        case EXPERT_BLOCK_LMHEAD: rc = expert__lmhead_forward(&x, ws->seq, y, xi, B); break;
        case EXPERT_BLOCK_LINEAR: rc = expert__dense_forward(&x, y, xi, B); break;
        case EXPERT_BLOCK_RESFFN:
            rc = expert__resffn_forward(&x, &ws->ffn, y, xi, B, (flags & RUN_KEEP) != 0);
            break;
        case EXPERT_BLOCK_HEAD: rc = expert__head_forward(&x, &ws->ffn, y, xi, B); break;
        }
    }
    if (rc == 0 && (flags & RUN_BACKWARD)) {
        switch (c->kind) {
        case EXPERT_BLOCK_EMBED: rc = expert__embed_backward(&x, ws->seq, gy, inp, B); break;
        case EXPERT_BLOCK_DECODER: rc = expert__decoder_backward(&x, ws->seq, gx, gy, B); break;
        case EXPERT_BLOCK_LMHEAD: rc = expert__lmhead_backward(&x, ws->seq, gx, gy, B); break;
        case EXPERT_BLOCK_LINEAR: rc = expert__dense_backward(&x, gx, gy, xi, B); break;
        case EXPERT_BLOCK_RESFFN: rc = expert__resffn_backward(&x, &ws->ffn, gx, gy, xi, B); break;
        case EXPERT_BLOCK_HEAD: rc = expert__head_backward(&x, &ws->ffn, gx, gy, xi, B); break;
        }
    }
    if (!host) {
        /* A download waits for everything queued before it; with nothing
         * to download, a sync does. Either reports a failure in the queued
         * work. */
        int done = 0, rc2 = 0;
        if (rc != 0) {
            (void)be->sync(be);
            done = 1;
        }
        if (rc == 0 && out) {
            rc2 = be->download(be, out, ws->d_out, nout * sizeof(float));
            done = 1;
        }
        if (rc == 0 && rc2 == 0 && gx) {
            rc2 = be->download(be, dinp, ws->d_dinp, nin * sizeof(float));
            done = 1;
        }
        if (!done)
            rc2 = be->sync(be);
        if (rc == 0)
            rc = rc2;
    } else if (flags & RUN_DEVICE) {
        int rc2 = be->sync(be);
        if (rc == 0)
            rc = rc2;
    }
    if (rc == 0 && embed && dinp && (flags & RUN_BACKWARD)) { /* tokens have no gradient */
        if (flags & RUN_DEVICE)
            rc = be->zero(be, dinp, nin * sizeof *dinp);
        else
            memset(dinp, 0, nin * sizeof *dinp);
    }
    return rc;
}

int expert_block_forward_snapshot(expert_block *b, const struct expert_snapshot *s,
                                  expert_workspace *ws, float *out,
                                  const float *inp, int B)
{
    if (!b || !s || !s->params || !out || !inp)
        return -EINVAL;
    int rc = check_call(b, ws, B);
    if (rc < 0)
        return rc;
    return run_kind(b, s->slot, ws, out, NULL, NULL, inp, B, RUN_FORWARD);
}

/* A forward on the current weights; keep: keep gelu' for a backward. */
static int forward_current(expert_block *b, expert_workspace *ws, float *out, const float *inp,
                           int B, int flags, uint64_t *version_out)
{
    if (!b || !out || !inp)
        return -EINVAL;
    int rc = check_call(b, ws, B);
    if (rc < 0)
        return rc;
    struct expert_snapshot s;
    expert_block_snapshot_acquire(b, &s);
    rc = run_kind(b, s.slot, ws, out, NULL, NULL, inp, B, RUN_FORWARD | flags);
    if (version_out)
        *version_out = s.version;
    expert_block_snapshot_release(b, &s);
    return rc;
}

int expert_block_forward(expert_block *b, expert_workspace *ws, float *out,
                         const float *inp, int B, uint64_t *version_out)
{
    return forward_current(b, ws, out, inp, B, 0, version_out);
}

int expert_block_forward_train(expert_block *b, expert_workspace *ws, float *out,
                               const float *inp, int B, uint64_t *version_out)
{
    return forward_current(b, ws, out, inp, B, RUN_KEEP, version_out);
}

int expert_block_forward_dev(expert_block *b, expert_workspace *ws, float *out, const float *inp,
                             int B, int keep, uint64_t *version_out)
{
    return forward_current(b, ws, out, inp, B, RUN_DEVICE | (keep ? RUN_KEEP : 0), version_out);
}

int expert_block_backward(expert_block *b, expert_workspace *ws, float *dinp,
                          const float *dout, const float *inp, int B,
                          uint64_t *version_out)
{
    return expert_block_forward_backward(b, ws, NULL, dinp, dout, inp, B, version_out);
}

int expert_block_forward_backward(expert_block *b, expert_workspace *ws, float *out,
                                  float *dinp, const float *dout, const float *inp,
                                  int B, uint64_t *version_out)
{
    return expert_block_backward_at(b, ws, out, dinp, dout, inp, B, EXPERT_VERSION_CURRENT,
                                    version_out);
}

/* recompute == 0: the workspace already holds the forward of inp on the
 * version's weights (expert_block_forward_train, or rows loaded back). */
static int backward_common(expert_block *b, expert_workspace *ws, float *out, float *dinp,
                           const float *dout, const float *inp, int B, uint64_t at_version,
                           int recompute, int dev, uint64_t *version_out)
{
    if (!b || !dout || !inp)
        return -EINVAL;
    int rc = check_call(b, ws, B);
    if (rc < 0)
        return rc;
    pthread_mutex_lock(&b->grad_mu);
    if (b->accum > (1 << 30) - B) {
        pthread_mutex_unlock(&b->grad_mu);
        return -EOVERFLOW;
    }
    struct expert_snapshot s;
    expert_block_snapshot_acquire(b, &s);
    if (at_version != EXPERT_VERSION_CURRENT && at_version != s.version) {
        /* The forward ran on the previous version: when the other slot still
         * holds it, recompute on exactly those weights (no step can replace
         * that slot while we hold grad_mu). */
        pthread_mutex_lock(&b->mu);
        int other = 1 - s.slot;
        if (b->slot_valid[other] && b->slot_version[other] == at_version) {
            if (--b->refs[s.slot] == 0)
                pthread_cond_broadcast(&b->cv);
            b->refs[other]++;
            s.slot = other;
            s.version = at_version;
            s.params = b->params + (size_t)other * b->n;
        }
        pthread_mutex_unlock(&b->mu);
    }
    if (!recompute && s.version != at_version) {
        /* The kept activations are of a version the block no longer holds. */
        expert_block_snapshot_release(b, &s);
        pthread_mutex_unlock(&b->grad_mu);
        return -ESTALE;
    }
    rc = run_kind(b, s.slot, ws, recompute ? out : NULL, dinp, dout, inp, B,
                  RUN_BACKWARD | (recompute ? RUN_FORWARD | RUN_KEEP : 0) | (dev ? RUN_DEVICE : 0));
    if (version_out)
        *version_out = s.version;
    expert_block_snapshot_release(b, &s);
    if (rc == 0)
        b->accum += B;
    pthread_mutex_unlock(&b->grad_mu);
    return rc;
}

int expert_block_backward_at(expert_block *b, expert_workspace *ws, float *out, float *dinp,
                             const float *dout, const float *inp, int B, uint64_t at_version,
                             uint64_t *version_out)
{
    return backward_common(b, ws, out, dinp, dout, inp, B, at_version, 1, 0, version_out);
}

int expert_block_backward_kept(expert_block *b, expert_workspace *ws, float *dinp,
                               const float *dout, const float *inp, int B, uint64_t version,
                               uint64_t *version_out)
{
    if (version == EXPERT_VERSION_CURRENT)
        return -EINVAL;
    return backward_common(b, ws, NULL, dinp, dout, inp, B, version, 0, 0, version_out);
}

int expert_block_backward_dev(expert_block *b, expert_workspace *ws, float *dinp, const float *dout,
                              const float *inp, int B, uint64_t version, uint64_t *version_out)
{
    int kept = version != EXPERT_VERSION_CURRENT;
    return backward_common(b, ws, NULL, dinp, dout, inp, B, version, !kept, 1, version_out);
}

/* ---------------------------------------------------- stage identity -- */

int expert_block_set_stage(expert_block *b, const struct expert_model_spec *m, int index)
{
    struct expert_block_config cfg;
    char stage[EXPERT_CKPT_NAME_LEN];
    if (!b || !m || expert_model_stage(m, index, &cfg) != 0 || cfg.kind != b->cfg.kind ||
        cfg.in != b->cfg.in || cfg.out != b->cfg.out || cfg.hidden != b->cfg.hidden ||
        strlen(m->name) >= sizeof b->model || expert_stage_name(stage, sizeof stage, m, index) < 0)
        return -EINVAL;
    memcpy(b->stage, stage, sizeof stage);
    snprintf(b->model, sizeof b->model, "%s", m->name);
    b->stage_hash = expert_stage_hash(m, index);
    return 0;
}

const char *expert_block_stage(const expert_block *b, uint64_t *stage_hash_out)
{
    if (stage_hash_out)
        *stage_hash_out = b ? b->stage_hash : 0;
    return b ? b->stage : "";
}

const char *expert__block_model(const expert_block *b)
{
    return b->model;
}
