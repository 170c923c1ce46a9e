/* capi/stages.c: remote stages: one forward or backward call at a time per
 * API call, through routing/caller.h (replica choice, connections, bans,
 * waits), sent again to another replica when one fails, as the trainer
 * does. Each handle keeps its caller on the swarm's loop; a caller that
 * ended (no holder of a stage for max_wait_s) fails the calls it had and
 * is replaced on the next call. */
#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "capi/capi_internal.h"
#include "expert/block.h"
#include "expert/model.h"
#include "net/wire.h"
#include "routing/caller.h"

#define MAX_ATTEMPTS 16      /* calls of one API call before it fails */
#define MAX_REJECTS 3        /* error replies saying the request is wrong (EINVAL) */
#define MAX_REFUSALS 3       /* ERANGE answers to one backward */
#define MAX_ROWS 4096

typedef struct call_job {
    capi_job job;
    starling_stages *st;
    route_caller_call rpc;
    int backward;
    const float *x, *dy;
    float *out;                      /* y, or dx (NULL: not wanted) */
    int64_t rows;
    const starling_served *served_in;
    starling_served *served_out;
    int attempts, rejects, refusals, last_status;
    int listed;                      /* on st->calls: capi_done not called yet */
    double t0;
    struct call_job *prev, *next;    /* st->calls */
} call_job;

typedef struct stage_shape {
    int nin, nout;
    uint64_t rin[2], rout[2];
    int64_t in_w, out_w;
} stage_shape;

struct starling_stages {
    starling_stages *next;           /* the swarm's list (loop thread) */
    starling_swarm *s;
    const struct expert_model_spec *model;
    int first, last;
    int max_rows;
    stage_shape *shapes;             /* [last - first + 1], computed at open */
    route_caller *caller;            /* loop thread: NULL until a call, or after it ended */
    route_caller *old;               /* an ended caller whose handles are still closing */
    char caller_err[320];
    char last_note[320];             /* the caller's latest log line */
    call_job *calls;                 /* loop thread: calls not yet finished */
    capi_job *close_job;             /* loop thread: a close waiting for the caller */
    atomic_uint_least64_t n_calls, n_retries;
};

/* ---- the swarm's list and shutdown (loop thread) ---- */

starling_stages *capi_stages_next(starling_stages *st)
{
    return st->next;
}

static void unlink_stages(starling_stages *st)
{
    starling_stages **pp = &st->s->stages;
    while (*pp && *pp != st)
        pp = &(*pp)->next;
    if (*pp)
        *pp = st->next;
    st->next = NULL;
}

void capi_stages_free(starling_stages *st)
{
    if (!st)
        return;
    route_caller_destroy(&st->caller);
    route_caller_destroy(&st->old);
    free(st->shapes);
    free(st);
}

static void list_remove(starling_stages *st, call_job *c)
{
    if (!c->listed)
        return;
    c->listed = 0;
    if (c->prev)
        c->prev->next = c->next;
    else
        st->calls = c->next;
    if (c->next)
        c->next->prev = c->prev;
    c->prev = c->next = NULL;
}

/* Ends c (once: after capi_done its memory is its thread's again). */
static void fail_call(starling_stages *st, call_job *c, int rc)
{
    if (!c->listed)
        return;
    list_remove(st, c);
    capi_done(&c->job, rc);
}

static const char *stage_label(starling_stages *st, int stage, char *buf, size_t len)
{
    snprintf(buf, len, "stage %d (%s.%d)", stage, st->model->name, stage);
    return buf;
}

/* A caller that ended: the calls it was not sending fail with its reason;
 * once its handles are closed it is freed. A close waiting for it ends. */
static void reap_calls(starling_stages *st, route_caller *r);

static int poll_stages(starling_stages *st)
{
    if (st->caller)
        reap_calls(st, st->caller);
    if (st->old)
        reap_calls(st, st->old);
    if (st->caller && route_caller_finishing(st->caller)) {
        int rc = route_caller_rc(st->caller);
        if (rc >= 0)
            rc = -ECANCELED;
        for (call_job *c = st->calls, *nx; c; c = nx) {
            nx = c->next;
            if (c->rpc.sent || c->rpc.parked)
                continue;
            if (rc == -ECANCELED)
                capi_err(c->job.err, c->job.err_len, rc, "the stages handle was closed");
            else
                capi_err(c->job.err, c->job.err_len, rc, "%s", st->caller_err[0] ? st->caller_err : strerror(-rc));
            fail_call(st, c, rc);
        }
        if (route_caller_closed(st->caller))
            route_caller_destroy(&st->caller);
    }
    if (st->old && route_caller_closed(st->old))
        route_caller_destroy(&st->old);
    if (st->close_job && !st->caller && !st->old && !st->calls) {
        capi_job *j = st->close_job;
        st->close_job = NULL;
        unlink_stages(st);
        capi_done(j, 0);
        return 0;
    }
    return st->caller || st->old;
}

int capi_stages_shutdown(starling_stages *st)
{
    if (st->caller)
        route_caller_finish(st->caller, -ECANCELED);
    if (st->old)
        route_caller_finish(st->old, -ECANCELED);
    return poll_stages(st);
}

void capi_stages_poll(starling_swarm *s)
{
    for (starling_stages *st = s->stages, *nx; st; st = nx) {
        nx = st->next;
        poll_stages(st);
    }
}

/* ---- the calls' part of the engine's pump ---- */

/* A call answered: its rows are in c->out; what served it goes to
 * served_out; the API call returns 0. */
static void call_replied(starling_stages *st, call_job *c)
{
    const route_caller_call *rc = &c->rpc;
    c->attempts++;
    if (c->served_out) {
        starling_served *sv = c->served_out;
        memset(sv, 0, sizeof *sv);
        memcpy(sv->holder, rc->holder, DHT_ID_LEN);
        sv->version_known = rc->n_versions == 1;
        sv->weight_version = sv->version_known ? rc->versions[0] : 0;
        sv->attempts = c->attempts;
    }
    fail_call(st, c, 0);
}

/* A call failed: sent again at the next pass (to another replica when one
 * is available: this one is backed off), or the API call fails once the
 * bounds are reached or the engine r ended. */
static void call_failed(starling_stages *st, call_job *c, route_caller *r)
{
    int status = c->rpc.status;
    char l[96];
    stage_label(st, c->rpc.stage, l, sizeof l);
    c->attempts++;
    c->last_status = status;
    if (route_caller_finishing(r)) {
        int why = route_caller_rc(r);
        if (why >= 0)
            why = -ECANCELED;
        capi_err(c->job.err, c->job.err_len, why, "%s: %s", l,
                 st->caller_err[0] ? st->caller_err : "the stages handle was closed while the call was out");
        fail_call(st, c, why);
        return;
    }
    atomic_fetch_add(&st->n_retries, 1);
    if (c->rpc.refused && ++c->refusals >= MAX_REFUSALS) {
        capi_err(c->job.err, c->job.err_len, -ERANGE,
                 "%s refused the gradient %d times (its gradient checks failed): the gradient is out of bounds", l,
                 c->refusals);
        fail_call(st, c, -ERANGE);
        return;
    }
    if ((status == -EINVAL || status == -EMSGSIZE) && ++c->rejects >= MAX_REJECTS) {
        capi_err(c->job.err, c->job.err_len, status, "%s rejected the request %d times: %s", l, c->rejects,
                 st->last_note[0] ? st->last_note : strerror(-status));
        fail_call(st, c, status);
        return;
    }
    if (c->attempts >= MAX_ATTEMPTS) {
        capi_err(c->job.err, c->job.err_len, status, "%s: gave up after %d attempts: %s", l, c->attempts,
                 st->last_note[0] ? st->last_note : strerror(-status));
        fail_call(st, c, status);
    }
}

/* The calls engine r completed. */
static void reap_calls(starling_stages *st, route_caller *r)
{
    route_caller_call *rc;
    while ((rc = route_caller_reap(r)) != NULL) {
        call_job *c = rc->user;
        if (rc->status == 0)
            call_replied(st, c);
        else
            call_failed(st, c, r);
    }
}

/* What c sends: its tensors, where the reply goes, and for a backward the
 * forward's holder first, at the forward's weight version. */
static void describe(starling_stages *st, call_job *c)
{
    route_caller_call *rc = &c->rpc;
    const stage_shape *sh = &st->shapes[rc->stage - st->first];
    rc->x = c->x;
    rc->dy = c->backward ? c->dy : NULL;
    rc->out = c->out;
    rc->out_cap = c->out ? (size_t)c->rows * (size_t)(c->backward ? sh->in_w : sh->out_w) : 0;
    int pin = c->backward && c->served_in && c->attempts == 0;
    rc->pin = pin ? c->served_in->holder : NULL;
    rc->pin_version_known = pin && c->served_in->version_known;
    rc->pin_version = pin ? c->served_in->weight_version : 0;
}

/* The engine's pump: completed calls end or wait to be sent again, and
 * every call not out goes out. A call that waited longer than max_wait_s
 * fails. */
static void hook_pump(void *arg)
{
    starling_stages *st = arg;
    route_caller *r = st->caller;
    double now = route_caller_now(r);
    reap_calls(st, r);
    for (call_job *c = st->calls, *nx; c; c = nx) {
        nx = c->next;
        if (c->rpc.sent || c->rpc.queued)
            continue;
        /* a parked call waits for its connection (bounded by the call
         * timeout); it is sent again from here when that comes up */
        if (!c->rpc.parked && now - c->t0 > st->s->opt.max_wait_s) {
            char l[96];
            capi_err(c->job.err, c->job.err_len, -ETIMEDOUT,
                     "%s: no holder answered within %g s (%d attempt%s)%s%s", stage_label(st, c->rpc.stage, l, sizeof l),
                     st->s->opt.max_wait_s, c->attempts, c->attempts == 1 ? "" : "s", st->last_note[0] ? "; last: " : "",
                     st->last_note);
            fail_call(st, c, -ETIMEDOUT);
            continue;
        }
        describe(st, c);
        route_caller_send(r, &c->rpc);
        if (route_caller_finishing(r))
            break;
    }
}

static void on_message(void *arg, const char *msg)
{
    starling_stages *st = arg;
    snprintf(st->last_note, sizeof st->last_note, "%s", msg);
    if (getenv("STARLING_VERBOSE"))
        fprintf(stderr, "starling: %s\n", msg);
}

static int ensure_caller(starling_stages *st, char *err, size_t err_len)
{
    if (st->caller)
        return 0;
    starling_swarm *s = st->s;
    s->rng = s->rng * 6364136223846793005ULL + 1442695040888963407ULL;
    st->caller_err[0] = '\0';
    route_caller_config cfg = {
        .dht = s->d,
        .ident = &s->ident,
        .swarm_key = s->has_swarm_key ? s->swarm_key : NULL,
        .model = st->model,
        .call_timeout_s = s->opt.call_timeout_s,
        /* Each call keeps its own wait (hook_pump); the caller's would end
         * every call when one stage has had no holder for that long. */
        .max_wait_s = 1e9,
        .refresh_s = 10,
        .max_pending = 64,
        .rng_seed = s->rng | 1,
        .error = st->caller_err,
        .error_len = sizeof st->caller_err,
        .pump = hook_pump,
        .arg = st,
        .on_message = on_message,
        .message_arg = st,
    };
    st->caller = route_caller_create(&s->loop, &cfg);
    if (!st->caller || route_caller_start(st->caller) != 0) {
        route_caller_destroy(&st->caller);
        return capi_err(err, err_len, -ENOMEM, "cannot create the call engine");
    }
    return 0;
}

/* ---- calls ---- */

static void call_start(capi_job *j)
{
    call_job *c = (call_job *)j;
    starling_stages *st = c->st;
    if (st->close_job) {
        capi_done(j, capi_err(j->err, j->err_len, -ECANCELED, "the stages handle is closing"));
        return;
    }
    if (st->caller && route_caller_finishing(st->caller))
        poll_stages(st); /* an ended caller is replaced */
    if (st->caller && route_caller_finishing(st->caller)) {
        if (st->old) {
            capi_done(j, capi_err(j->err, j->err_len, -EAGAIN, "the call engine is still being replaced after "
                                                                "a failure; try again"));
            return;
        }
        st->old = st->caller; /* its calls are still reaped (poll_stages) */
        st->caller = NULL;
    }
    int rc = ensure_caller(st, j->err, j->err_len);
    if (rc != 0) {
        capi_done(j, rc);
        return;
    }
    c->t0 = route_caller_now(st->caller);
    c->listed = 1;
    c->next = st->calls;
    if (st->calls)
        st->calls->prev = c;
    st->calls = c;
    atomic_fetch_add(&st->n_calls, 1);
    route_caller_pump(st->caller);
}

static int check_call(starling_stages *st, int stage, const void *x, const void *out, int64_t rows, int out_needed,
                      char *err, size_t err_len)
{
    if (err && err_len)
        err[0] = '\0';
    if (!st)
        return capi_err(err, err_len, -EINVAL, "no stages handle");
    if (stage < st->first || stage > st->last)
        return capi_err(err, err_len, -EINVAL, "stage %d is not among the handle's stages %d..%d of '%s'", stage,
                        st->first, st->last, st->model->name);
    if (!x || (out_needed && !out))
        return capi_err(err, err_len, -EINVAL, "a tensor pointer is NULL");
    if (rows < 1 || rows > st->max_rows)
        return capi_err(err, err_len, -EINVAL, "%lld rows: a call takes 1..%d rows (the peers' largest request for "
                                               "'%s'); split the batch",
                        (long long)rows, st->max_rows, st->model->name);
    return 0;
}

static int run_call(starling_stages *st, call_job *c)
{
    c->st = st;
    c->job.start = call_start;
    c->rpc.user = c;
    c->rpc.rows = (int)c->rows;
    return capi_run(st->s, &c->job);
}

int starling_stage_forward(starling_stages *st, int stage, const float *x, int64_t rows, float *y, int training,
                           starling_served *served, char *err, size_t err_len)
{
    int rc = check_call(st, stage, x, y, rows, 1, err, err_len);
    if (rc != 0)
        return rc;
    if (st->model->task == EXPERT_TASK_BYTES && stage == 0) {
        struct expert_block_config cfg;
        char why[200];
        expert_model_stage(st->model, 0, &cfg);
        if (expert_block_input_check(&cfg, x, (int)rows, why, sizeof why) != 0)
            return capi_err(err, err_len, -EINVAL, "%s", why);
    }
    call_job c = {.job = {.err = err, .err_len = err_len}, .x = x, .out = y, .rows = rows, .served_out = served};
    c.rpc.stage = stage;
    c.rpc.method = training ? PEER_METHOD_FORWARD : PEER_METHOD_INFER;
    return run_call(st, &c);
}

int starling_stage_backward(starling_stages *st, int stage, const float *x, const float *dy, int64_t rows, float *dx,
                            const starling_served *served, char *err, size_t err_len)
{
    int rc = check_call(st, stage, x, dx, rows, 0, err, err_len);
    if (rc != 0)
        return rc;
    if (!dy)
        return capi_err(err, err_len, -EINVAL, "a tensor pointer is NULL");
    call_job c = {.job = {.err = err, .err_len = err_len}, .backward = 1, .x = x, .dy = dy, .out = dx, .rows = rows,
                  .served_in = served};
    c.rpc.stage = stage;
    c.rpc.method = PEER_METHOD_BACKWARD;
    return run_call(st, &c);
}

/* ---- opening and closing ---- */

typedef struct open_job {
    capi_job job;
    const char *name;
    int first, last;
    starling_stages *st;
} open_job;

static void open_found(void *arg, int rc, const struct expert_model_spec *m)
{
    open_job *o = arg;
    capi_job *j = &o->job;
    if (rc != 0) {
        capi_done(j, rc);
        return;
    }
    if (o->first < 0 || o->last < o->first || o->last >= m->n_stages) {
        capi_done(j, capi_err(j->err, j->err_len, -EINVAL,
                                     "stages %d..%d are out of range: model '%s' has stages 0..%d", o->first, o->last,
                                     m->name, m->n_stages - 1));
        return;
    }
    starling_stages *st = calloc(1, sizeof *st);
    int n = o->last - o->first + 1;
    if (st)
        st->shapes = calloc((size_t)n, sizeof *st->shapes);
    if (!st || !st->shapes) {
        free(st);
        capi_done(j, capi_err(j->err, j->err_len, -ENOMEM, "out of memory"));
        return;
    }
    st->s = j->s;
    st->model = m;
    st->first = o->first;
    st->last = o->last;
    st->max_rows = m->max_batch > 0 ? m->max_batch : 256; /* a peer's default --max-batch */
    if (st->max_rows > MAX_ROWS)
        st->max_rows = MAX_ROWS;
    for (int i = 0; i < n; i++) {
        struct expert_block_config cfg;
        stage_shape *sh = &st->shapes[i];
        expert_model_stage(m, o->first + i, &cfg);
        sh->nin = expert_block_row_shape(&cfg, 0, sh->rin);
        sh->nout = expert_block_row_shape(&cfg, 1, sh->rout);
        sh->in_w = cfg.in;
        sh->out_w = cfg.out;
    }
    st->next = j->s->stages;
    j->s->stages = st;
    o->st = st;
    capi_done(j, 0);
}

static void open_start(capi_job *j)
{
    open_job *o = (open_job *)j;
    capi_model_find(j->s, o->name, j->err, j->err_len, open_found, o);
}

int starling_stages_open(starling_stages **out, starling_swarm *s, const char *model, int first, int last, char *err,
                         size_t err_len)
{
    if (err && err_len)
        err[0] = '\0';
    if (!out)
        return capi_err(err, err_len, -EINVAL, "no place for the handle (out is NULL)");
    *out = NULL;
    if (!s)
        return capi_err(err, err_len, -EINVAL, "no swarm handle");
    open_job o = {.job = {.start = open_start, .err = err, .err_len = err_len}, .name = model, .first = first,
                  .last = last};
    int rc = capi_run(s, &o.job);
    if (rc == 0)
        *out = o.st;
    return rc;
}

static void close_start(capi_job *j)
{
    starling_stages *st = ((call_job *)j)->st;
    st->close_job = j;
    capi_stages_shutdown(st);
}

void starling_stages_close(starling_stages *st)
{
    if (!st)
        return;
    call_job c = {.job = {.start = close_start}, .st = st};
    if (capi_run(st->s, &c.job) == 0)
        capi_stages_free(st);
    /* else the swarm is closing: it frees st */
}

int starling_stages_widths(const starling_stages *st, int stage, int64_t *in_width, int64_t *out_width)
{
    if (!st || stage < st->first || stage > st->last)
        return -EINVAL;
    if (in_width)
        *in_width = st->shapes[stage - st->first].in_w;
    if (out_width)
        *out_width = st->shapes[stage - st->first].out_w;
    return 0;
}

int starling_stages_max_rows(const starling_stages *st)
{
    return st ? st->max_rows : -EINVAL;
}

void starling_stages_counters(const starling_stages *st, uint64_t *calls, uint64_t *retries)
{
    if (calls)
        *calls = st ? atomic_load(&st->n_calls) : 0;
    if (retries)
        *retries = st ? atomic_load(&st->n_retries) : 0;
}
