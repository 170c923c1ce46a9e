#include "routing/trainer.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "expert/ops.h"
#include "peer/meta.h"
#include "peer/rpc_client.h"
#include "routing/conns.h"
#include "peer/wire.h"
#include "routing/pipeline.h"
#include "routing/replica.h"
#include "routing/swarm.h"
#include "routing/versions.h"

#define PUMP_MS 20
#define MAX_REFUSERS 8   /* replicas that refused one batch's backward at one stage, remembered */

/* A call taken from the pipeline: parked until sent, then outstanding. */
typedef struct pend {
    route_call call;
    int used;
    int sent;
    int waiting;                   /* parked on the connection to holder/addr being set up */
    uint8_t holder[DHT_ID_LEN];
    char addr[ROUTE_CONNS_ADDR_MAX + 1];
    uint64_t conn;                 /* serial of the connection it went over */
    double t0;
    struct trainer *t;
} pend;

typedef enum phase { PH_TRAIN, PH_EVAL, PH_DONE } phase;

typedef struct trainer {
    uv_loop_t *loop;
    route_train_config cfg;
    route_train_result *res;
    route_swarm *swarm;
    route_pipeline *pipe;
    route_conns *conns;
    route_versions *versions;
    pend *pends;                   /* cfg.inflight entries */
    uv_timer_t pump_timer;
    int timer_closed;
    uint64_t rng;
    phase ph;
    int epoch;                     /* 1-based */
    int *order;                    /* training sample order */
    long cursor;                   /* next sample of the current pass */
    long n_train, n_test;
    long done_total, total;
    double t_start, t_epoch, train_time, ep_time;
    double ep_loss;
    long ep_samples;
    uint64_t ep_retries_base;      /* route_pipeline_retries at the epoch's start */
    uint64_t ep_refused_base;      /* route_pipeline_refusals at the epoch's start */
    long ep_refused_samples;
    route_errlog errs;             /* which failures to log, and the counts for summaries */
    double probe_at[ROUTE_PIPELINE_MAX_STAGES]; /* last probe of a stage whose replicas were all banned */
    long lookups_seen;             /* swarm lookups when connections were last pruned */
    double recent_loss;
    long eval_correct;
    double eval_loss;
    long eval_done;
    route_waits waits;
    /* The holder that served each in-flight batch's forward at each stage:
     * its backward goes there too when it can, because replicas step on
     * their own and a backward recomputed on another replica's weights
     * would mismatch the activations the forward produced. */
    uint8_t fwd_holder[ROUTE_PIPELINE_MAX_INFLIGHT][ROUTE_PIPELINE_MAX_STAGES][DHT_ID_LEN];
    /* ... and the weight version it used: the backward asks the holder to
     * recompute on the same version (weight stashing) when it still has it. */
    uint64_t fwd_version[ROUTE_PIPELINE_MAX_INFLIGHT][ROUTE_PIPELINE_MAX_STAGES];
    int fwd_version_known[ROUTE_PIPELINE_MAX_INFLIGHT][ROUTE_PIPELINE_MAX_STAGES];
    /* The holders that refused (ERANGE) the current backward of each
     * in-flight batch, at stage refusers_stage: its retries avoid them
     * while another replica is available, and when another replica accepts
     * it they are backed off (they refused what their replicas accept). */
    uint8_t refusers[ROUTE_PIPELINE_MAX_INFLIGHT][MAX_REFUSERS][DHT_ID_LEN];
    int n_refusers[ROUTE_PIPELINE_MAX_INFLIGHT];
    int refusers_stage[ROUTE_PIPELINE_MAX_INFLIGHT];
    int finishing;
    int rc;
    /* loss scratch */
    float *probs, *losses;
    int32_t *targets;
    /* batch staging */
    float *xbuf;
    uint8_t *ybuf;
} trainer;

static double now_s(const trainer *t)
{
    return (double)uv_now(t->loop) / 1000.0;
}

static void note(trainer *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void note(trainer *t, const char *fmt, ...)
{
    char msg[640];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (t->cfg.on_message)
        t->cfg.on_message(t->cfg.arg, msg);
}

/* ---- the loss, computed here: the trainer holds only data and the loss ---- */

static int loss_fn(void *ctx, const float *logits, const uint8_t *labels, int B, int C, float *dl,
                   double *loss_sum, int *correct)
{
    trainer *t = ctx;
    for (int i = 0; i < B; i++)
        t->targets[i] = labels[i];
    int rc = expert_crossentropy_forward(t->losses, t->probs, logits, t->targets, B, C);
    if (rc != 0)
        return rc;
    /* The blocks expect the gradient of the loss SUMMED over samples. */
    rc = expert_crossentropy_backward(dl, t->probs, t->targets, 1.0f, B, C);
    if (rc != 0)
        return rc;
    double s = 0;
    int ok = 0;
    for (int i = 0; i < B; i++) {
        s += t->losses[i];
        const float *z = logits + (size_t)i * C;
        int arg = 0;
        for (int c = 1; c < C; c++)
            if (z[c] > z[arg])
                arg = c;
        ok += arg == labels[i];
    }
    *loss_sum = s;
    *correct = ok;
    return 0;
}

/* ---- connections ---- */

static void pump(trainer *t);

/* A connection came up: the holder is alive, so a ban from earlier failures
 * ends (this is how a probe of a banned holder brings it back). */
static void on_conn_ready(void *arg, const uint8_t id[DHT_ID_LEN], const char *addr)
{
    trainer *t = arg;
    route_swarm_unban(t->swarm, id, addr);
    pump(t);
}

/* A holder we could not connect to is banned in every stage it serves at
 * that address, and the calls that waited for the connection go back to the
 * pipeline as failed: each is re-issued (to another replica when there is
 * one) and counted as a retry. */
static void on_conn_failed(void *arg, const uint8_t id[DHT_ID_LEN], const char *addr, int status)
{
    trainer *t = arg;
    route_swarm_ban(t->swarm, id, addr, now_s(t), &t->rng);
    for (int i = 0; i < t->cfg.inflight; i++) {
        pend *p = &t->pends[i];
        if (p->used && !p->sent && p->waiting && !memcmp(p->holder, id, DHT_ID_LEN) && !strcmp(p->addr, addr)) {
            p->waiting = 0;
            p->used = 0;
            route_pipeline_call_done(t->pipe, p->call.token, status < 0 ? status : -EIO);
        }
    }
    char hex[DHT_ID_HEX_LEN + 1];
    dht_id_to_hex(hex, id);
    note(t, "cannot connect to holder %.12s at %s: %s; trying other replicas", hex, addr, strerror(-status));
    pump(t);
}

/* route_conns_retain: a connection stays while some stage announces its
 * holder at its address. */
static int conn_announced(void *arg, const uint8_t id[DHT_ID_LEN], const char *addr)
{
    trainer *t = arg;
    for (int s = 0; s < route_swarm_n_stages(t->swarm); s++) {
        route_holder *h = route_swarm_find_holder(t->swarm, s, id);
        if (h && !strcmp(h->ann.addr, addr))
            return 1;
    }
    return 0;
}

/* After new lookups: close connections to addresses no longer announced
 * (a holder that moved gets a new connection; the old one goes). */
static void prune_conns(trainer *t)
{
    long lookups = 0;
    for (int s = 0; s < route_swarm_n_stages(t->swarm); s++)
        lookups += route_swarm_stage(t->swarm, s)->lookups;
    if (lookups == t->lookups_seen)
        return;
    t->lookups_seen = lookups;
    route_conns_retain(t->conns, conn_announced, t);
}

/* ---- failures: what the log shows ---- */

/* The errlog's codes: a remote error reply's errno (> 0), a transport
 * failure's -errno (< 0), and these. */
#define LOG_BACKED_OFF 0           /* a refuser backed off: a replica accepted what it refused */
#define LOG_DROPPED 100000         /* a batch's update dropped after too many refusals */

static const char *err_name(int code)
{
    switch (code) {
    case ERANGE: return "ERANGE";
    case EBUSY: return "EBUSY";
    case ENOENT: return "ENOENT";
    case EINVAL: return "EINVAL";
    case EIO: return "EIO";
    case ENOSYS: return "ENOSYS";
    case ESHUTDOWN: return "ESHUTDOWN";
    case ENOMEM: return "ENOMEM";
    case ETIMEDOUT: return "ETIMEDOUT";
    case ECONNRESET: return "ECONNRESET";
    case ECANCELED: return "ECANCELED";
    case ENOTCONN: return "ENOTCONN";
    case EPIPE: return "EPIPE";
    default: return "error";
    }
}

static const char *stage_name(trainer *t, int stage)
{
    route_stage *st = stage >= 0 && stage < route_swarm_n_stages(t->swarm) ? route_swarm_stage(t->swarm, stage) : NULL;
    return st ? st->name : "?";
}

/* A failed call: counted, and logged when it is the first of its (stage,
 * code); later ones go into the summary lines (summarize). */
static void log_failure(trainer *t, const pend *p, int code, const char *why)
{
    if (t->finishing || code == -ECANCELED)
        return; /* we cancelled it: closing, or dropping a connection after another call failed on it */
    t->res->errors++;
    char hex[DHT_ID_HEX_LEN + 1];
    dht_id_to_hex(hex, p->holder);
    const char *kind = p->call.kind == ROUTE_CALL_FORWARD ? "forward" : "backward";
    const char *name = stage_name(t, p->call.stage);
    char sentence[160];
    if (code < 0)
        snprintf(sentence, sizeof sentence, "%s", strerror(-code));
    else
        snprintf(sentence, sizeof sentence, "%s", why && *why ? why : "(no reason given)");
    if (!route_errlog_add(&t->errs, p->call.stage, code, sentence))
        return;
    if (code == ERANGE && p->call.kind == ROUTE_CALL_BACKWARD)
        note(t, "stage %s refused a backward: %s (holder %.8s; sent to another replica, at most %d refusals "
                "per micro-batch; further refusals are summarised every %.0f s)",
             name, sentence, hex, ROUTE_PIPELINE_MAX_REFUSALS, ROUTE_ERRLOG_PERIOD_S);
    else if (code > 0)
        note(t, "stage %s (holder %.8s) answered a %s with %s: %s; trying other replicas", name, hex, kind,
             err_name(code), sentence);
    else
        note(t, "a %s call to stage %s (holder %.8s at %s) failed: %s; trying other replicas", kind, name, hex,
             p->addr, sentence);
}

typedef struct summary {
    trainer *t;
    char buf[600];
    size_t len;
} summary;

static void summary_line(void *arg, const route_errlog_kind *k)
{
    summary *sm = arg;
    if (sm->len >= sizeof sm->buf - 1)
        return;
    const char *name = k->stage >= 0 ? stage_name(sm->t, k->stage) : "?";
    char part[300];
    if (k->code == ERANGE)
        snprintf(part, sizeof part, "stage %s refused %ld backward%s (latest: %.100s)", name, k->pending,
                 k->pending == 1 ? "" : "s", k->last);
    else if (k->code == LOG_BACKED_OFF)
        snprintf(part, sizeof part, "stage %s: %ld refuser%s backed off", name, k->pending,
                 k->pending == 1 ? "" : "s");
    else if (k->code == LOG_DROPPED)
        snprintf(part, sizeof part, "stage %s: %ld micro-batch update%s dropped after repeated refusals", name,
                 k->pending, k->pending == 1 ? "" : "s");
    else if (k->code > 0)
        snprintf(part, sizeof part, "stage %s: %ld %s error%s (latest: %.80s)", name, k->pending,
                 err_name(k->code), k->pending == 1 ? "" : "s", k->last);
    else
        snprintf(part, sizeof part, "stage %s: %ld failed call%s (%s)", name, k->pending,
                 k->pending == 1 ? "" : "s", k->last);
    int n = snprintf(sm->buf + sm->len, sizeof sm->buf - sm->len, "%s%s", sm->len ? "; " : "", part);
    if (n > 0)
        sm->len += (size_t)n < sizeof sm->buf - sm->len ? (size_t)n : sizeof sm->buf - sm->len - 1;
}

/* At most one line every ROUTE_ERRLOG_PERIOD_S (and, with last, one at
 * the end): the failures not logged one by one since the last such line. */
static void summarize(trainer *t, int last)
{
    summary sm = {.t = t};
    if (route_errlog_flush(&t->errs, last ? HUGE_VAL : now_s(t), summary_line, &sm) > 0)
        note(t, "more failures since the last report: %s", sm.buf);
}

/* ---- calls ---- */

static void rolled_back(trainer *t, int stage, const uint8_t id[DHT_ID_LEN], uint64_t from, uint64_t to);

/* Call p failed. status: -ERANGE for a refused backward (the refuser is
 * not banned: see refused()), else any negative errno (the replica is
 * banned for a while). */
static void call_failed(trainer *t, pend *p, int status, int drop_conn)
{
    route_holder *h = route_swarm_find_holder(t->swarm, p->call.stage, p->holder);
    int refusal = status == -ERANGE && p->call.kind == ROUTE_CALL_BACKWARD;
    if (h) {
        if (h->rep.inflight > 0)
            h->rep.inflight--;
        /* Not when the holder has since moved: the new address did not fail. */
        if (!refusal && !strcmp(h->ann.addr, p->addr))
            route_replica_failure(&h->rep, now_s(t), &t->rng);
    }
    if (drop_conn)
        route_conns_drop(t->conns, p->holder, p->addr);
    p->sent = 0;
    p->used = 0;
    uint64_t dropped = route_pipeline_refused_batches(t->pipe);
    route_pipeline_call_done(t->pipe, p->call.token, refusal ? -ERANGE : -EIO);
    if (route_pipeline_refused_batches(t->pipe) != dropped && !t->finishing &&
        route_errlog_add(&t->errs, p->call.stage, LOG_DROPPED, ""))
        note(t, "stage %s refused the backward of a micro-batch (%d samples) %d times: its update is dropped "
                "(the samples count as processed; \"refused_samples\" in the summary); when every replica "
                "refuses, the trainer's own gradients are out of bounds",
             stage_name(t, p->call.stage), p->call.rows, ROUTE_PIPELINE_MAX_REFUSALS);
}

/* Holder p->holder refused p's backward (ERANGE): remembered, so that the
 * retry goes to another replica while one is available. */
static void refused(trainer *t, pend *p)
{
    int slot = p->call.slot;
    if (t->refusers_stage[slot] != p->call.stage) {
        t->refusers_stage[slot] = p->call.stage;
        t->n_refusers[slot] = 0;
    }
    for (int i = 0; i < t->n_refusers[slot]; i++)
        if (!memcmp(t->refusers[slot][i], p->holder, DHT_ID_LEN))
            return;
    if (t->n_refusers[slot] < MAX_REFUSERS)
        memcpy(t->refusers[slot][t->n_refusers[slot]++], p->holder, DHT_ID_LEN);
}

static int is_refuser(const trainer *t, int slot, int stage, const uint8_t id[DHT_ID_LEN])
{
    if (t->refusers_stage[slot] != stage)
        return 0;
    for (int i = 0; i < t->n_refusers[slot]; i++)
        if (!memcmp(t->refusers[slot][i], id, DHT_ID_LEN))
            return 1;
    return 0;
}

/* Holder `by` accepted the backward of `slot` at `stage`: the replicas
 * that refused it refused what a replica accepts, so they are backed off
 * as if they had failed (a replica that refuses every gradient is thus
 * banned like a dead one; an honest one that refused a borderline
 * gradient loses a second or so). */
static void accepted(trainer *t, int slot, int stage, const uint8_t by[DHT_ID_LEN])
{
    if (t->refusers_stage[slot] != stage || t->n_refusers[slot] == 0)
        return;
    for (int i = 0; i < t->n_refusers[slot]; i++) {
        if (!memcmp(t->refusers[slot][i], by, DHT_ID_LEN))
            continue;
        route_holder *h = route_swarm_find_holder(t->swarm, stage, t->refusers[slot][i]);
        if (!h)
            continue;
        route_replica_failure(&h->rep, now_s(t), &t->rng);
        if (route_errlog_add(&t->errs, stage, LOG_BACKED_OFF, "")) {
            char a[DHT_ID_HEX_LEN + 1], b[DHT_ID_HEX_LEN + 1];
            dht_id_to_hex(a, t->refusers[slot][i]);
            dht_id_to_hex(b, by);
            note(t, "stage %s: holder %.8s accepted a backward that holder %.8s refused; backing off from %.8s",
                 stage_name(t, stage), b, a, a);
        }
    }
    t->n_refusers[slot] = 0;
}

static void on_reply(void *arg, int status, const peer_msg *m)
{
    pend *p = arg;
    trainer *t = p->t;
    if (status != 0) {
        log_failure(t, p, status < 0 ? status : -EIO, NULL);
        call_failed(t, p, -EIO, status != -ETIMEDOUT);
        pump(t);
        return;
    }
    if (m->kind == PEER_KIND_ERROR) {
        if (m->err_code == ENOENT)
            route_swarm_invalidate(t->swarm, p->call.stage);
        int code = m->err_code > 0 ? m->err_code : EIO;
        if (code == ERANGE && p->call.kind == ROUTE_CALL_BACKWARD) {
            t->res->refused++;
            refused(t, p);
        }
        log_failure(t, p, code, m->err_msg);
        call_failed(t, p, -code, 0);
        pump(t);
        return;
    }
    const route_call *c = &p->call;
    int width = c->kind == ROUTE_CALL_FORWARD ? c->width_out : c->width_in;
    if (m->n_tensors != 1 || m->t[0].dtype != PEER_DTYPE_F32 || m->t[0].ndim != 2 ||
        m->t[0].shape[0] != (uint64_t)c->rows || m->t[0].shape[1] != (uint64_t)width) {
        log_failure(t, p, EBADMSG, "a reply of the wrong shape");
        call_failed(t, p, -EBADMSG, 1);
        pump(t);
        return;
    }
    memcpy(c->outputs, m->t[0].data, (size_t)c->rows * (size_t)width * sizeof(float));
    if (c->kind == ROUTE_CALL_BACKWARD)
        accepted(t, c->slot, c->stage, p->holder);
    else if (c->stage == 0)
        t->n_refusers[c->slot] = 0; /* a new batch in this slot */
    if (c->kind == ROUTE_CALL_FORWARD) {
        int slot = c->slot;
        memcpy(t->fwd_holder[slot][c->stage], p->holder, DHT_ID_LEN);
        uint64_t v = 0, from = 0;
        t->fwd_version_known[slot][c->stage] = peer_meta_versions_decode(m->meta, m->meta_len, &v, 1) == 1;
        if (t->fwd_version_known[slot][c->stage]) {
            t->fwd_version[slot][c->stage] = v;
            /* Forwards only: a backward may name an older, stashed version. */
            if (route_versions_observe(t->versions, c->stage, p->holder, p->conn, v, &from) == 1)
                rolled_back(t, c->stage, p->holder, from, v);
        }
    }
    route_holder *h = route_swarm_find_holder(t->swarm, c->stage, p->holder);
    if (h) {
        if (h->rep.inflight > 0)
            h->rep.inflight--;
        route_replica_success(&h->rep, now_s(t) - p->t0);
        route_replica_measured(&h->rep, c->rows, now_s(t) - p->t0);
    }
    p->sent = 0;
    p->used = 0;
    int rc = route_pipeline_call_done(t->pipe, c->token, 0);
    if (rc != 0 && rc != -ENOENT)
        note(t, "a batch was dropped: its labels are out of range (%s)", strerror(-rc));
    pump(t);
}

/* Holder `id` of `stage` answered on weight version `to` after `from`. */
static void rolled_back(trainer *t, int stage, const uint8_t id[DHT_ID_LEN], uint64_t from, uint64_t to)
{
    route_train_result *r = t->res;
    if (r->n_rollbacks < ROUTE_MAX_ROLLBACKS) {
        route_rollback *b = &r->rollbacks[r->n_rollbacks];
        b->stage = stage;
        memcpy(b->holder, id, DHT_ID_LEN);
        b->from = from;
        b->to = to;
    }
    r->n_rollbacks++;
    char hex[DHT_ID_HEX_LEN + 1];
    dht_id_to_hex(hex, id);
    note(t, "stage %d (holder %.8s) went back from weight version %llu to %llu", stage, hex,
         (unsigned long long)from, (unsigned long long)to);
}

/* Tries to send parked call p. Returns 1 if sent. */
static int dispatch(trainer *t, pend *p)
{
    route_stage *st = route_swarm_stage(t->swarm, p->call.stage);
    double now = now_s(t);
    route_replica reps[ROUTE_MAX_HOLDERS];
    int map[ROUTE_MAX_HOLDERS], n = 0;
    for (int i = 0; i < st->n_holders; i++)
        if (st->holders[i].ann.state == PEER_STATE_ONLINE) {
            reps[n] = st->holders[i].rep;
            map[n++] = i;
        }
    route_waits_mark(&t->waits, p->call.stage, n > 0, now);
    if (n == 0)
        return 0;
    uint8_t skip[ROUTE_MAX_HOLDERS] = {0};
    int affine = -1;
    if (p->call.kind == ROUTE_CALL_BACKWARD && p->call.attempt == 0) {
        const uint8_t *want = t->fwd_holder[p->call.slot][p->call.stage];
        for (int i = 0; i < n; i++)
            if (!memcmp(reps[i].id, want, DHT_ID_LEN) && route_replica_weight(&reps[i], now) > 0)
                affine = i;
    }
    /* A refused backward goes to a replica that has not refused it, while
     * one is available (not banned); else to any. */
    if (p->call.kind == ROUTE_CALL_BACKWARD && p->call.attempt > 0) {
        int slot = p->call.slot, other = 0;
        for (int i = 0; i < n; i++)
            if (!is_refuser(t, slot, p->call.stage, reps[i].id) && route_replica_weight(&reps[i], now) > 0)
                other = 1;
        for (int i = 0; other && i < n; i++)
            skip[i] = (uint8_t)is_refuser(t, slot, p->call.stage, reps[i].id);
    }
    int waiting = 0;
    for (int tries = 0; tries < n; tries++) {
        int k = affine >= 0 && tries == 0 ? affine : route_pick_replica(reps, n, skip, now, &t->rng, NULL);
        if (k < 0 && tries == 0) {
            /* Every replica is banned: nothing to spread the load to, so
             * rather than wait the bans out, probe the one whose ban ends
             * first, at most every ROUTE_PROBE_S (a dead holder costs a
             * refused connection; one that came back is used at once). */
            int stage = p->call.stage;
            if (now - t->probe_at[stage] < ROUTE_PROBE_S)
                return 0;
            k = route_pick_probe(reps, n, skip, now);
            if (k >= 0)
                t->probe_at[stage] = now;
        }
        if (k < 0)
            return 0;
        skip[k] = 1;
        route_holder *h = &st->holders[map[k]];
        uint64_t serial = 0;
        peer_rpc_client *cl = route_conns_get(t->conns, h->rep.id, h->ann.addr, &serial);
        if (!cl) {
            /* Connecting (or failed to start): the call waits for the
             * first such holder unless another replica takes it. */
            if (!waiting) {
                waiting = 1;
                p->waiting = 1;
                memcpy(p->holder, h->rep.id, DHT_ID_LEN);
                snprintf(p->addr, sizeof p->addr, "%s", h->ann.addr);
            }
            continue;
        }
        peer_msg m;
        peer_msg_init(&m, PEER_KIND_REQUEST,
                      p->call.kind == ROUTE_CALL_FORWARD ? PEER_METHOD_FORWARD : PEER_METHOD_BACKWARD, 0);
        snprintf(m.block, sizeof m.block, "%s", st->name);
        uint64_t sin[2] = {(uint64_t)p->call.rows, (uint64_t)p->call.width_in};
        uint64_t sout[2] = {(uint64_t)p->call.rows, (uint64_t)p->call.width_out};
        peer_tensor_f32(&m.t[0], p->call.inputs, 2, sin);
        m.n_tensors = 1;
        uint8_t meta[PEER_META_U64_LEN];
        if (p->call.kind == ROUTE_CALL_BACKWARD) {
            peer_tensor_f32(&m.t[1], p->call.grad_outputs, 2, sout);
            m.n_tensors = 2;
            int slot = p->call.slot;
            if (k == affine && t->fwd_version_known[slot][p->call.stage]) {
                m.meta = meta;
                m.meta_len = peer_meta_at_version_encode(meta, t->fwd_version[slot][p->call.stage]);
            }
        }
        uint64_t timeout = (uint64_t)(t->cfg.call_timeout_s * 1000);
        int rc = peer_rpc_call(cl, &m, timeout, on_reply, p, NULL);
        if (rc == 0) {
            memcpy(p->holder, h->rep.id, DHT_ID_LEN);
            snprintf(p->addr, sizeof p->addr, "%s", h->ann.addr);
            p->conn = serial;
            p->t0 = now;
            p->sent = 1;
            p->waiting = 0;
            h->rep.inflight++;
            return 1;
        }
        if (rc == -ENOTCONN) {
            route_conns_drop(t->conns, h->rep.id, h->ann.addr);
            /* Dropping failed that connection's other calls, whose
             * callbacks pump: they may have sent p already. */
            if (!p->used || p->sent)
                return p->sent;
        }
    }
    return 0;
}

/* ---- the schedule ---- */

static void shuffle(trainer *t)
{
    for (long i = 0; i < t->n_train; i++)
        t->order[i] = (int)i;
    for (long i = t->n_train - 1; i > 0; i--) {
        long j = (long)(route_rand01(&t->rng) * (double)(i + 1));
        int tmp = t->order[i];
        t->order[i] = t->order[j];
        t->order[j] = tmp;
    }
}

static void finish(trainer *t, int rc);

static void push_batches(trainer *t)
{
    const route_dataset *d = t->ph == PH_TRAIN ? t->cfg.train : t->cfg.test;
    long n = t->ph == PH_TRAIN ? t->n_train : t->n_test;
    int w = d->rows * d->cols;
    while (t->cursor < n) {
        int rows = (int)(n - t->cursor < t->cfg.batch ? n - t->cursor : t->cfg.batch);
        if (t->ph == PH_TRAIN && t->cfg.sync_samples > 0) {
            /* A group never mixes with the next: the next group's forwards
             * see the weights after every stage stepped on this one. */
            long in_group = t->cursor % t->cfg.sync_samples;
            if (in_group == 0 && t->cursor > 0 && route_pipeline_inflight(t->pipe) > 0)
                break;
            if (rows > t->cfg.sync_samples - in_group)
                rows = (int)(t->cfg.sync_samples - in_group);
        }
        for (int r = 0; r < rows; r++) {
            long idx = t->ph == PH_TRAIN ? t->order[t->cursor + r] : t->cursor + r;
            memcpy(t->xbuf + (size_t)r * (size_t)w, d->images + (size_t)idx * (size_t)w,
                   (size_t)w * sizeof(float));
            t->ybuf[r] = d->labels[idx];
        }
        int64_t seq = t->ph == PH_TRAIN ? route_pipeline_push(t->pipe, t->xbuf, t->ybuf, rows)
                                        : route_pipeline_push_eval(t->pipe, t->xbuf, t->ybuf, rows);
        if (seq < 0)
            break;
        t->cursor += rows;
    }
}

static void collect(trainer *t)
{
    route_batch_result r;
    /* Retries are counted when a call is re-issued, not when its batch
     * finishes, so the progress lines are current. */
    t->res->retries = (long)route_pipeline_retries(t->pipe);
    t->res->refused_batches = (long)route_pipeline_refused_batches(t->pipe);
    t->res->refused_samples = (long)route_pipeline_refused_rows(t->pipe);
    while (route_pipeline_pop_result(t->pipe, &r)) {
        if (r.forward_only) {
            t->eval_correct += r.correct;
            t->eval_loss += r.loss_sum;
            t->eval_done += r.rows;
            continue;
        }
        t->ep_loss += r.loss_sum;
        t->ep_samples += r.rows;
        if (r.refused)
            t->ep_refused_samples += r.rows;
        t->done_total += r.rows;
        double bl = r.loss_sum / r.rows;
        t->recent_loss = t->recent_loss == 0 ? bl : 0.9 * t->recent_loss + 0.1 * bl;
        if (t->cfg.on_progress) {
            route_train_progress pr = {t->epoch, t->done_total, t->total, t->recent_loss,
                                       t->train_time + (now_s(t) - t->t_epoch), t->res->retries,
                                       t->res->refused};
            t->cfg.on_progress(t->cfg.arg, &pr);
        }
    }
}

static void advance_phase(trainer *t)
{
    long n = t->ph == PH_TRAIN ? t->n_train : t->n_test;
    if (t->cursor < n || route_pipeline_inflight(t->pipe) > 0)
        return;
    if (t->ph == PH_TRAIN) {
        double ep_time = now_s(t) - t->t_epoch;
        t->train_time += ep_time;
        t->ph = PH_EVAL;
        t->cursor = 0;
        t->eval_correct = 0;
        t->eval_loss = 0;
        t->eval_done = 0;
        t->res->samples = t->done_total;
        /* remember the epoch's figures for on_epoch */
        t->res->train_time_s = t->train_time;
        t->ep_loss = t->ep_samples ? t->ep_loss / (double)t->ep_samples : 0;
        t->ep_time = ep_time;
        return;
    }
    /* evaluation finished */
    route_epoch_result e;
    e.epoch = t->epoch;
    e.train_loss = t->ep_loss;
    e.test_loss = t->eval_done ? t->eval_loss / (double)t->eval_done : 0;
    e.test_acc = t->eval_done ? (double)t->eval_correct / (double)t->eval_done : 0;
    e.samples = t->ep_samples;
    e.train_time_s = t->ep_time;
    e.retries = (long)(route_pipeline_retries(t->pipe) - t->ep_retries_base);
    t->ep_retries_base = route_pipeline_retries(t->pipe);
    e.refused = (long)(route_pipeline_refusals(t->pipe) - t->ep_refused_base);
    e.refused_samples = t->ep_refused_samples;
    t->ep_refused_base = route_pipeline_refusals(t->pipe);
    t->res->retries = (long)route_pipeline_retries(t->pipe);
    t->res->epochs = t->epoch;
    t->res->test_acc = e.test_acc;
    t->res->test_loss = e.test_loss;
    if (t->cfg.on_epoch)
        t->cfg.on_epoch(t->cfg.arg, &e);
    if (t->epoch >= t->cfg.epochs) {
        finish(t, 0);
        return;
    }
    t->epoch++;
    t->ph = PH_TRAIN;
    t->cursor = 0;
    t->ep_loss = 0;
    t->ep_samples = 0;
    t->ep_refused_samples = 0;
    shuffle(t);
    t->t_epoch = now_s(t);
}

static void check_waits(trainer *t)
{
    char msg[320];
    int rc = route_waits_check(&t->waits, t->swarm, now_s(t), t->cfg.max_wait_s, t->res->error,
                               sizeof t->res->error, msg, sizeof msg);
    if (rc < 0)
        finish(t, rc);
    else if (rc > 0)
        note(t, "%s", msg);
}

static void pump(trainer *t)
{
    if (t->finishing)
        return;
    route_swarm_refresh(t->swarm, now_s(t));
    prune_conns(t);
    collect(t);
    summarize(t, 0);
    advance_phase(t);
    if (t->finishing)
        return;
    push_batches(t);
    /* Park every ready call, then send what can be sent. */
    for (int i = 0; i < t->cfg.inflight; i++) {
        pend *p = &t->pends[i];
        if (p->used)
            continue;
        if (!route_pipeline_next_call(t->pipe, &p->call))
            break;
        p->used = 1;
        p->sent = 0;
        p->t = t;
    }
    for (int i = 0; i < t->cfg.inflight; i++) {
        pend *p = &t->pends[i];
        if (p->used && !p->sent)
            dispatch(t, p);
    }
    check_waits(t);
}

static void on_pump_timer(uv_timer_t *h)
{
    pump(h->data);
}

static void on_timer_closed(uv_handle_t *h)
{
    trainer *t = h->data;
    t->timer_closed = 1;
}

static void finish(trainer *t, int rc)
{
    if (t->finishing)
        return;
    summarize(t, 1);
    t->finishing = 1;
    t->rc = rc;
    /* Before closing: the calls that closing cancels are not re-sent. */
    t->res->retries = (long)route_pipeline_retries(t->pipe);
    uv_timer_stop(&t->pump_timer);
    uv_close((uv_handle_t *)&t->pump_timer, on_timer_closed);
    route_conns_close_all(t->conns);
}

int route_train_run(uv_loop_t *loop, const route_train_config *cfg_in, route_train_result *out)
{
    if (!out)
        return -EINVAL;
    memset(out, 0, sizeof *out);
    if (!loop || !cfg_in || !cfg_in->dht || !cfg_in->ident || !cfg_in->model || !cfg_in->train ||
        !cfg_in->test || cfg_in->epochs < 1 || cfg_in->batch < 1 || cfg_in->inflight < 1 ||
        cfg_in->inflight > ROUTE_PIPELINE_MAX_INFLIGHT || cfg_in->sync_samples < 0 ||
        cfg_in->model->n_stages > ROUTE_PIPELINE_MAX_STAGES) {
        snprintf(out->error, sizeof out->error, "invalid training configuration");
        return -EINVAL;
    }
    const struct expert_model_spec *m = cfg_in->model;
    int in_w = cfg_in->train->rows * cfg_in->train->cols;
    if (in_w != m->n_in || cfg_in->test->rows * cfg_in->test->cols != m->n_in ||
        cfg_in->train->classes > m->n_out || cfg_in->test->classes > m->n_out) {
        snprintf(out->error, sizeof out->error,
                 "the data (%d inputs, %d classes) does not fit model %s (%d inputs, %d outputs)", in_w,
                 cfg_in->train->classes, m->name, m->n_in, m->n_out);
        return -EINVAL;
    }
    trainer *t = calloc(1, sizeof *t);
    if (!t)
        return -ENOMEM;
    t->loop = loop;
    t->cfg = *cfg_in;
    if (!(t->cfg.call_timeout_s > 0))
        t->cfg.call_timeout_s = 30;
    if (!(t->cfg.max_wait_s > 0))
        t->cfg.max_wait_s = 120;
    if (!(t->cfg.refresh_s > 0))
        t->cfg.refresh_s = 10;
    t->res = out;
    t->rng = t->cfg.seed * 0x9E3779B97F4A7C15ULL + 0x1234567ULL;
    if (t->rng == 0)
        t->rng = 1;
    t->n_train = t->cfg.n_train > 0 && t->cfg.n_train < t->cfg.train->n ? t->cfg.n_train : t->cfg.train->n;
    t->n_test = t->cfg.n_test > 0 && t->cfg.n_test < t->cfg.test->n ? t->cfg.n_test : t->cfg.test->n;
    t->total = t->n_train * t->cfg.epochs;

    int widths[ROUTE_PIPELINE_MAX_STAGES + 1];
    for (int s = 0; s < m->n_stages; s++) {
        struct expert_block_config c;
        expert_model_stage(m, s, &c);
        widths[s] = c.in;
        widths[s + 1] = c.out;
    }
    route_pipeline_config pc = {m->n_stages, widths, t->cfg.batch, t->cfg.inflight, loss_fn, t,
                                ROUTE_PIPELINE_MAX_REFUSALS};
    t->pipe = route_pipeline_create(&pc);
    t->swarm = route_swarm_create(t->cfg.dht, m, t->cfg.refresh_s);
    /* The handshake is bounded by the call timeout too. */
    route_conns_config cc = {.ident = t->cfg.ident,
                             .swarm_key = t->cfg.swarm_key,
                             .max_pending = 4 * t->cfg.inflight + 8,
                             .on_ready = on_conn_ready,
                             .on_failed = on_conn_failed,
                             .arg = t,
                             .connect_timeout_ms = (uint64_t)(t->cfg.call_timeout_s * 1000)};
    t->conns = route_conns_create(loop, &cc);
    t->versions = route_versions_create();
    for (int s = 0; s < ROUTE_PIPELINE_MAX_STAGES; s++)
        t->probe_at[s] = -1e30;
    t->pends = calloc((size_t)t->cfg.inflight, sizeof *t->pends);
    t->order = malloc((size_t)t->n_train * sizeof *t->order);
    t->probs = malloc((size_t)t->cfg.batch * (size_t)m->n_out * sizeof(float));
    t->losses = malloc((size_t)t->cfg.batch * sizeof(float));
    t->targets = malloc((size_t)t->cfg.batch * sizeof(int32_t));
    t->xbuf = malloc((size_t)t->cfg.batch * (size_t)in_w * sizeof(float));
    t->ybuf = malloc((size_t)t->cfg.batch);
    int rc = 0;
    if (!t->pipe || !t->swarm || !t->conns || !t->versions || !t->pends || !t->order || !t->probs ||
        !t->losses || !t->targets || !t->xbuf || !t->ybuf) {
        snprintf(out->error, sizeof out->error, "out of memory");
        rc = -ENOMEM;
        goto out;
    }
    t->epoch = 1;
    t->ph = PH_TRAIN;
    shuffle(t);
    uv_update_time(loop);
    t->t_start = t->t_epoch = now_s(t);
    route_errlog_init(&t->errs, ROUTE_ERRLOG_PERIOD_S, now_s(t));
    uv_timer_init(loop, &t->pump_timer);
    t->pump_timer.data = t;
    uv_timer_start(&t->pump_timer, on_pump_timer, 0, PUMP_MS);

    /* The DHT keeps the loop alive, so run until our own handles are closed. */
    while (!(t->finishing && t->timer_closed && route_conns_open(t->conns) == 0))
        uv_run(loop, UV_RUN_ONCE);
    rc = t->rc;
    out->train_time_s = t->train_time;
    out->samples = t->done_total;
    out->samples_per_s = t->train_time > 0 ? (double)t->done_total / t->train_time : 0;
out:
    route_conns_destroy(&t->conns);
    route_versions_destroy(&t->versions);
    route_swarm_destroy(&t->swarm);
    route_pipeline_destroy(&t->pipe);
    free(t->pends);
    free(t->order);
    free(t->probs);
    free(t->losses);
    free(t->targets);
    free(t->xbuf);
    free(t->ybuf);
    free(t);
    return rc;
}
