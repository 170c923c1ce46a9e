/* routing/trainer.c: the trainer's own part: data order, the micro-batch
 * pipeline's calls, backward affinity and refusals, the loss, epochs and
 * evaluation. Sending the calls, retries, connections, waits and the log
 * are routing/caller.c's. */
#include "routing/trainer.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <sodium.h>

#include "expert/ops.h"
#include "net/tensorfmt.h"
#include "net/wire.h"
#include "routing/caller.h"
#include "routing/pipeline.h"
#include "routing/swarm.h"
#include "routing/versions.h"

#define MAX_REFUSERS 8   /* replicas that refused one batch's backward at one stage, remembered */

/* The errlog codes the trainer adds to the caller's (route_caller_log_once)
 * besides errno values. */
#define LOG_BACKED_OFF 0           /* a refuser backed off: a replica accepted what it refused */
#define LOG_DROPPED 100000         /* a batch's update dropped after too many refusals */

/* A call taken from the pipeline: used until the pipeline hears of it. */
typedef struct pend {
    route_call call;
    route_caller_call rpc;         /* its RPC: rpc.sent while one is out */
    int used;
} pend;

typedef enum phase { PH_TRAIN, PH_EVAL, PH_DONE } phase;

typedef struct trainer {
    route_train_config cfg;
    route_train_result *res;
    route_caller *caller;
    route_pipeline *pipe;
    route_versions *versions;
    pend *pends;                   /* cfg.inflight entries */
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
    double recent_loss;
    long eval_correct;
    double eval_loss;
    long eval_done;
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
    /* loss scratch */
    float *probs, *losses;
    int32_t *targets;
    /* batch staging */
    float *xbuf;
    uint8_t *ybuf;
    /* text (a language model): labels per row (its context; 1 for images),
     * the first training draw of the current epoch, and the steps' end */
    int lpr;
    long draw_base;
    int stopping;                  /* max_seconds reached: evaluate, then finish */
    double t_limit0;               /* when training started (after a language model's first
                                      evaluation): the clock max_seconds counts on */
    uint64_t *offs;                /* (batch) window offsets */
    int32_t *tbuf;                 /* (batch, lpr) targets of a text batch */
} trainer;

static double now_s(const trainer *t)
{
    return route_caller_now(t->caller);
}

static const char *stage_name(trainer *t, int stage)
{
    return route_caller_stage_name(t->caller, stage);
}

static void finish(trainer *t, int rc)
{
    route_caller_finish(t->caller, rc);
}

/* ---- the loss, computed here: the trainer holds only data and the loss ---- */

/* A row's loss is the mean cross-entropy over its lpr positions (one for
 * a class; every next byte of a window for a language model, whose logits
 * row is (lpr, V)), so *loss_sum sums the rows' means and *correct counts
 * positions. */
static int loss_fn(void *ctx, const float *logits, const uint8_t *labels, int B, int C, float *dl,
                   double *loss_sum, int *correct)
{
    trainer *t = ctx;
    int n = B * t->lpr, V = C / t->lpr;
    for (int i = 0; i < n; i++)
        t->targets[i] = labels[i];
    int rc = expert_crossentropy_forward(t->losses, t->probs, logits, t->targets, n, V);
    if (rc != 0)
        return rc;
    /* The blocks expect the gradient of the loss SUMMED over rows (each
     * row's loss the mean over its positions). */
    rc = expert_crossentropy_backward(dl, t->probs, t->targets, 1.0f / (float)t->lpr, n, V);
    if (rc != 0)
        return rc;
    double s = 0;
    int ok = 0;
    for (int i = 0; i < n; i++) {
        s += t->losses[i];
        const float *z = logits + (size_t)i * V;
        int arg = 0;
        for (int c = 1; c < V; c++)
            if (z[c] > z[arg])
                arg = c;
        ok += arg == labels[i];
    }
    *loss_sum = s / t->lpr;
    *correct = ok;
    return 0;
}

/* ---- connections ---- */

/* ---- refusals ---- */

static void rolled_back(trainer *t, int stage, const uint8_t id[DHT_ID_LEN], uint64_t from, uint64_t to);

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
        if (!memcmp(t->refusers[slot][i], p->rpc.holder, DHT_ID_LEN))
            return;
    if (t->n_refusers[slot] < MAX_REFUSERS)
        memcpy(t->refusers[slot][t->n_refusers[slot]++], p->rpc.holder, DHT_ID_LEN);
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
        route_holder *h = route_swarm_find_holder(route_caller_swarm(t->caller), stage, t->refusers[slot][i]);
        if (!h)
            continue;
        route_replica_failure(&h->rep, now_s(t), route_caller_rng(t->caller));
        if (route_caller_log_once(t->caller, stage, LOG_BACKED_OFF, "")) {
            char a[DHT_ID_HEX_LEN + 1], b[DHT_ID_HEX_LEN + 1];
            dht_id_to_hex(a, t->refusers[slot][i]);
            dht_id_to_hex(b, by);
            route_caller_note(t->caller,
                              "stage %s: holder %.8s accepted a backward that holder %.8s refused; backing off "
                              "from %.8s",
                              stage_name(t, stage), b, a, a);
        }
    }
    t->n_refusers[slot] = 0;
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
    route_caller_note(t->caller, "stage %d (holder %.8s) went back from weight version %llu to %llu", stage, hex,
                      (unsigned long long)from, (unsigned long long)to);
}

/* ---- calls: what each sends, and what its outcome does ---- */

/* A refused backward's pend: remembered (refused()), so its retry goes to
 * another replica while one is available. */
static void refused_by(trainer *t, pend *p)
{
    t->res->refused++;
    refused(t, p);
}

/* What p's call sends: its inputs (and for a backward, the output
 * gradient), its reply into the pipeline's buffer; a backward goes first
 * to the replica that served its forward, at the forward's weight version
 * (weight stashing), and a refused backward's retry avoids the replicas
 * that refused it. */
static void describe(trainer *t, pend *p)
{
    const route_call *call = &p->call;
    route_caller_call *c = &p->rpc;
    int slot = call->slot, backward = call->kind == ROUTE_CALL_BACKWARD;
    c->stage = call->stage;
    c->method = backward ? PEER_METHOD_BACKWARD : PEER_METHOD_FORWARD;
    c->rows = call->rows;
    c->x = call->inputs;
    c->dy = backward ? call->grad_outputs : NULL;
    c->out = call->outputs;
    c->out_cap = (size_t)call->rows * (size_t)(backward ? call->width_in : call->width_out);
    c->user = p;
    c->pin = backward && call->attempt == 0 ? t->fwd_holder[slot][call->stage] : NULL;
    c->pin_version_known = t->fwd_version_known[slot][call->stage];
    c->pin_version = t->fwd_version[slot][call->stage];
    int avoid = backward && call->attempt > 0 && t->refusers_stage[slot] == call->stage;
    c->avoid = avoid ? (const uint8_t(*)[DHT_ID_LEN])t->refusers[slot] : NULL;
    c->n_avoid = avoid ? t->n_refusers[slot] : 0;
}

/* A forward's reply: who served it, on which weight version. */
static void forward_served(trainer *t, const pend *p)
{
    const route_call *c = &p->call;
    int slot = c->slot;
    memcpy(t->fwd_holder[slot][c->stage], p->rpc.holder, DHT_ID_LEN);
    uint64_t v = p->rpc.versions[0], from = 0;
    t->fwd_version_known[slot][c->stage] = p->rpc.n_versions == 1;
    if (t->fwd_version_known[slot][c->stage]) {
        t->fwd_version[slot][c->stage] = v;
        /* Forwards only: a backward may name an older, stashed version. */
        if (route_versions_observe(t->versions, c->stage, p->rpc.holder, p->rpc.conn, v, &from) == 1)
            rolled_back(t, c->stage, p->rpc.holder, from, v);
    }
}

/* A reply (its rows already in the pipeline's buffer): the pipeline
 * moves on. */
static void call_replied(trainer *t, pend *p)
{
    const route_call *c = &p->call;
    if (c->kind == ROUTE_CALL_BACKWARD)
        accepted(t, c->slot, c->stage, p->rpc.holder);
    else if (c->stage == 0)
        t->n_refusers[c->slot] = 0; /* a new batch in this slot */
    if (c->kind == ROUTE_CALL_FORWARD)
        forward_served(t, p);
    p->used = 0;
    int err = route_pipeline_call_done(t->pipe, c->token, 0);
    if (err != 0 && err != -ENOENT)
        route_caller_note(t->caller, "a batch was dropped: its labels are out of range (%s)", strerror(-err));
}

/* A failure: the pipeline re-issues the call (to another replica, through
 * the caller's choice), or drops the batch's update after too many
 * refusals. The pipeline needs only "refused or not": the reason is in
 * the log already. */
static void call_failed(trainer *t, pend *p)
{
    int refusal = p->rpc.refused;
    p->used = 0;
    if (refusal)
        refused_by(t, p);
    uint64_t dropped = route_pipeline_refused_batches(t->pipe);
    route_pipeline_call_done(t->pipe, p->call.token, refusal ? -ERANGE : -EIO);
    if (route_pipeline_refused_batches(t->pipe) != dropped &&
        route_caller_log_once(t->caller, p->call.stage, LOG_DROPPED, ""))
        route_caller_note(t->caller,
                          "stage %s refused the backward of a micro-batch (%d samples) %d times: its update is "
                          "dropped (the samples count as processed; \"refused_samples\" in the summary); when "
                          "every replica refuses, the trainer's own gradients are out of bounds",
                          stage_name(t, p->call.stage), p->call.rows, ROUTE_PIPELINE_MAX_REFUSALS);
}

/* Every call the caller completed: its traffic counted (training only),
 * then its reply or failure handled. */
static void reap(trainer *t)
{
    route_caller_call *c;
    while ((c = route_caller_reap(t->caller)) != NULL) {
        pend *p = c->user;
        if (t->ph == PH_TRAIN && c->bytes_sent > 0) {
            t->res->bytes_sent += c->bytes_sent;
            t->res->bytes_received += c->bytes_received;
            if (c->compressed)
                t->res->compressed_calls++;
            else
                t->res->f32_calls++;
        }
        if (c->status == 0)
            call_replied(t, p);
        else
            call_failed(t, p);
    }
}

/* cfg.summary_part: the trainer's own errlog codes. */
static int summary_part(void *arg, const route_errlog_kind *k, char *buf, size_t len)
{
    trainer *t = arg;
    const char *name = stage_name(t, k->stage);
    if (k->code == LOG_BACKED_OFF)
        snprintf(buf, len, "stage %s: %ld refuser%s backed off", name, k->pending, k->pending == 1 ? "" : "s");
    else if (k->code == LOG_DROPPED)
        snprintf(buf, len, "stage %s: %ld micro-batch update%s dropped after repeated refusals", name,
                 k->pending, k->pending == 1 ? "" : "s");
    else
        return 0;
    return 1;
}

/* ---- the schedule ---- */

static void shuffle(trainer *t)
{
    if (t->cfg.text)
        return; /* windows come in the order of their draws */
    for (long i = 0; i < t->n_train; i++)
        t->order[i] = (int)i;
    for (long i = t->n_train - 1; i > 0; i--) {
        long j = (long)(route_rand01(route_caller_rng(t->caller)) * (double)(i + 1));
        int tmp = t->order[i];
        t->order[i] = t->order[j];
        t->order[j] = tmp;
    }
}

/* Rows [cursor, cursor + rows) of the current phase into xbuf/ybuf. */
static void stage_rows(trainer *t, int rows)
{
    if (t->cfg.text) {
        int T = t->lpr, split = t->ph == PH_TRAIN ? ROUTE_TEXT_TRAIN : ROUTE_TEXT_VAL;
        uint64_t seed = t->ph == PH_TRAIN ? t->cfg.seed : ROUTE_TEXT_VAL_SEED;
        long first = t->ph == PH_TRAIN ? t->draw_base + t->cursor : t->cursor;
        for (int r = 0; r < rows; r++)
            t->offs[r] = route_text_offset(t->cfg.text, split, seed, (uint64_t)(first + r), T);
        route_text_fill(t->cfg.text, split, t->offs, rows, T, t->xbuf, t->tbuf);
        for (long i = 0; i < (long)rows * T; i++)
            t->ybuf[i] = (uint8_t)t->tbuf[i];
        return;
    }
    const route_dataset *d = t->ph == PH_TRAIN ? t->cfg.train : t->cfg.test;
    int w = d->rows * d->cols;
    for (int r = 0; r < rows; r++) {
        long idx = t->ph == PH_TRAIN ? t->order[t->cursor + r] : t->cursor + r;
        memcpy(t->xbuf + (size_t)r * (size_t)w, d->images + (size_t)idx * (size_t)w,
               (size_t)w * sizeof(float));
        t->ybuf[r] = d->labels[idx];
    }
}

/* At a boundary between groups with nothing in flight: has max_seconds
 * passed? Then this epoch's training ends here. */
static int out_of_time(trainer *t)
{
    if (t->cfg.max_seconds <= 0 || now_s(t) - t->t_limit0 < t->cfg.max_seconds)
        return 0;
    t->n_train = t->cursor;
    t->stopping = 1;
    return 1;
}

static void push_batches(trainer *t)
{
    long n = t->ph == PH_TRAIN ? t->n_train : t->n_test;
    while (t->cursor < n) {
        int rows = (int)(n - t->cursor < t->cfg.batch ? n - t->cursor : t->cfg.batch);
        if (t->ph == PH_TRAIN && t->cfg.sync_samples > 0) {
            /* A group never mixes with the next: the next group's forwards
             * see the weights after every stage stepped on this one. */
            long in_group = t->cursor % t->cfg.sync_samples;
            if (in_group == 0 && t->cursor > 0 && route_pipeline_inflight(t->pipe) > 0)
                break;
            if (in_group == 0 && t->cursor > 0 && out_of_time(t))
                break;
            if (rows > t->cfg.sync_samples - in_group)
                rows = (int)(t->cfg.sync_samples - in_group);
        } else if (t->ph == PH_TRAIN && t->cursor > 0 && out_of_time(t)) {
            break;
        }
        stage_rows(t, rows);
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
        if (t->epoch < t->cfg.epochs)
            out_of_time(t); /* time ran out in this stretch's last step: evaluate, then stop */
        if (t->cfg.text && t->cfg.sync_samples > 0)
            t->res->steps += t->n_train / t->cfg.sync_samples;
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
    e.test_acc = t->eval_done ? (double)t->eval_correct / ((double)t->eval_done * t->lpr) : 0;
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
    if (t->epoch >= t->cfg.epochs || t->stopping) {
        t->res->stopped_early = t->stopping;
        finish(t, 0);
        return;
    }
    t->epoch++;
    t->ph = PH_TRAIN;
    if (t->epoch == 1)
        t->t_limit0 = now_s(t); /* after a language model's first evaluation */
    if (t->cfg.text && t->epoch > 1) {
        /* The next stretch of steps, up to the next evaluation. */
        t->draw_base += t->n_train;
        long left = t->cfg.steps * t->cfg.sync_samples - t->draw_base;
        long per = (long)t->cfg.eval_every * t->cfg.sync_samples;
        t->n_train = left < per ? left : per;
    }
    t->cursor = 0;
    t->ep_loss = 0;
    t->ep_samples = 0;
    t->ep_refused_samples = 0;
    shuffle(t);
    t->t_epoch = now_s(t);
}

/* The caller's pump: completed calls in, results in, the schedule on,
 * every ready call out. */
static void pump(void *arg)
{
    trainer *t = arg;
    reap(t);
    collect(t);
    advance_phase(t);
    if (route_caller_finishing(t->caller))
        return;
    push_batches(t);
    /* Take every ready call, then send what can be sent. */
    for (int i = 0; i < t->cfg.inflight; i++) {
        pend *p = &t->pends[i];
        if (p->used)
            continue;
        if (!route_pipeline_next_call(t->pipe, &p->call))
            break;
        p->used = 1;
    }
    for (int i = 0; i < t->cfg.inflight; i++) {
        pend *p = &t->pends[i];
        if (p->used && !p->rpc.sent && !p->rpc.queued) {
            describe(t, p);
            route_caller_send(t->caller, &p->rpc);
        }
    }
}

/* A language model's configuration. */
static int check_text_config(const uv_loop_t *loop, const route_train_config *c, route_train_result *out)
{
    const struct expert_model_spec *m = c->model;
    if (!loop || !c->dht || !c->ident || !m || c->batch < 1 || c->inflight < 1 ||
        c->inflight > ROUTE_PIPELINE_MAX_INFLIGHT || c->sync_samples < 1 || c->steps < 1 ||
        c->eval_every < 1 || c->eval_rows < 1 || m->n_stages > ROUTE_PIPELINE_MAX_STAGES ||
        c->steps > (1L << 40) / c->sync_samples) {
        snprintf(out->error, sizeof out->error, "invalid training configuration");
        return -EINVAL;
    }
    if (m->task != EXPERT_TASK_BYTES || m->vocab != 256 || m->n_in != m->seq ||
        (long)m->n_out != (long)m->seq * m->vocab) {
        snprintf(out->error, sizeof out->error,
                 "model %s is not a byte-level language model: it cannot train on text", m->name);
        return -EINVAL;
    }
    return route_text_check(c->text, m->seq, out->error, sizeof out->error);
}

/* Checks the configuration; writes the reason into out->error. */
static int check_config(const uv_loop_t *loop, const route_train_config *c, route_train_result *out)
{
    if (c && (peer_tensorfmt_check((peer_fmt)c->wire_format, c->wire_block ? c->wire_block : PEER_FMT_Q8_BLOCK) ||
              (c->wire_block && c->wire_format != PEER_FMT_Q8))) {
        snprintf(out->error, sizeof out->error, "invalid wire format");
        return -EINVAL;
    }
    if (c && c->text)
        return check_text_config(loop, c, out);
    if (!loop || !c || !c->dht || !c->ident || !c->model || !c->train || !c->test || c->epochs < 1 || c->batch < 1 ||
        c->inflight < 1 || c->inflight > ROUTE_PIPELINE_MAX_INFLIGHT || c->sync_samples < 0 ||
        c->model->n_stages > ROUTE_PIPELINE_MAX_STAGES) {
        snprintf(out->error, sizeof out->error, "invalid training configuration");
        return -EINVAL;
    }
    const struct expert_model_spec *m = c->model;
    if (m->task != EXPERT_TASK_CLASSES) {
        snprintf(out->error, sizeof out->error, "model %s is a language model: it trains on text, not images",
                 m->name);
        return -EINVAL;
    }
    int in_w = c->train->rows * c->train->cols;
    if (in_w != m->n_in || c->test->rows * c->test->cols != m->n_in || c->train->classes > m->n_out ||
        c->test->classes > m->n_out) {
        snprintf(out->error, sizeof out->error,
                 "the data (%d inputs, %d classes) does not fit model %s (%d inputs, %d outputs)", in_w,
                 c->train->classes, m->name, m->n_in, m->n_out);
        return -EINVAL;
    }
    return 0;
}

/* Allocates t's parts for t->cfg (already checked). Returns 0 or -ENOMEM. */
static int trainer_init(trainer *t, uv_loop_t *loop)
{
    const struct expert_model_spec *m = t->cfg.model;
    int in_w = m->n_in;
    int widths[ROUTE_PIPELINE_MAX_STAGES + 1];
    for (int s = 0; s < m->n_stages; s++) {
        struct expert_block_config c;
        expert_model_stage(m, s, &c);
        widths[s] = c.in;
        widths[s + 1] = c.out;
    }
    route_pipeline_config pc = {m->n_stages, widths, t->cfg.batch, t->cfg.inflight, loss_fn, t,
                                ROUTE_PIPELINE_MAX_REFUSALS, t->lpr};
    t->pipe = route_pipeline_create(&pc);
    uint64_t seed = t->cfg.seed * 0x9E3779B97F4A7C15ULL + 0x1234567ULL, sr_base;
    randombytes_buf(&sr_base, sizeof sr_base); /* trainers' rounding draws differ */
    route_caller_config cc = {.dht = t->cfg.dht,
                              .ident = t->cfg.ident,
                              .swarm_key = t->cfg.swarm_key,
                              .model = m,
                              .call_timeout_s = t->cfg.call_timeout_s,
                              .max_wait_s = t->cfg.max_wait_s,
                              .refresh_s = t->cfg.refresh_s,
                              .max_pending = 4 * t->cfg.inflight + 8,
                              .max_refusals = ROUTE_PIPELINE_MAX_REFUSALS,
                              .wire_format = t->cfg.wire_format,
                              .wire_block = t->cfg.wire_block,
                              .sr_base = sr_base,
                              .rng_seed = seed ? seed : 1,
                              .error = t->res->error,
                              .error_len = sizeof t->res->error,
                              .pump = pump,
                              .summary_part = summary_part,
                              .arg = t,
                              .on_message = t->cfg.on_message,
                              .message_arg = t->cfg.arg};
    t->caller = route_caller_create(loop, &cc);
    t->versions = route_versions_create();
    t->pends = calloc((size_t)t->cfg.inflight, sizeof *t->pends);
    size_t B = (size_t)t->cfg.batch, rows = B * (size_t)t->lpr;
    t->order = malloc((t->cfg.text ? 1 : (size_t)t->n_train) * sizeof *t->order);
    t->probs = malloc(B * (size_t)m->n_out * sizeof(float));
    t->losses = malloc(rows * sizeof(float));
    t->targets = malloc(rows * sizeof(int32_t));
    t->xbuf = malloc(B * (size_t)in_w * sizeof(float));
    t->ybuf = malloc(rows);
    t->offs = malloc(B * sizeof *t->offs);
    t->tbuf = malloc(rows * sizeof *t->tbuf);
    if (!t->pipe || !t->caller || !t->versions || !t->pends || !t->order || !t->probs || !t->losses ||
        !t->targets || !t->xbuf || !t->ybuf || !t->offs || !t->tbuf)
        return -ENOMEM;
    return 0;
}

static void trainer_free(trainer *t)
{
    route_caller_destroy(&t->caller);
    route_versions_destroy(&t->versions);
    route_pipeline_destroy(&t->pipe);
    free(t->pends);
    free(t->order);
    free(t->probs);
    free(t->losses);
    free(t->targets);
    free(t->xbuf);
    free(t->ybuf);
    free(t->offs);
    free(t->tbuf);
    free(t);
}

int route_train_run(uv_loop_t *loop, const route_train_config *cfg_in, route_train_result *out)
{
    if (!out)
        return -EINVAL;
    memset(out, 0, sizeof *out);
    int rc = check_config(loop, cfg_in, out);
    if (rc != 0)
        return rc;
    trainer *t = calloc(1, sizeof *t);
    if (!t)
        return -ENOMEM;
    t->cfg = *cfg_in;
    t->res = out;
    t->lpr = 1;
    if (t->cfg.text) {
        /* Epoch 0 is the evaluation before the first step; epoch e >= 1
         * trains up to eval_every steps, then evaluates. */
        t->lpr = t->cfg.model->seq;
        t->cfg.epochs = (int)((t->cfg.steps + t->cfg.eval_every - 1) / t->cfg.eval_every);
        long per = (long)t->cfg.eval_every * t->cfg.sync_samples;
        t->total = t->cfg.steps * t->cfg.sync_samples;
        t->n_train = t->total < per ? t->total : per;
        t->n_test = t->cfg.eval_rows;
    } else {
        t->n_train = t->cfg.n_train > 0 && t->cfg.n_train < t->cfg.train->n ? t->cfg.n_train
                                                                             : t->cfg.train->n;
        t->n_test = t->cfg.n_test > 0 && t->cfg.n_test < t->cfg.test->n ? t->cfg.n_test : t->cfg.test->n;
        t->total = t->n_train * t->cfg.epochs;
    }
    rc = trainer_init(t, loop);
    if (rc != 0) {
        snprintf(out->error, sizeof out->error, "out of memory");
        trainer_free(t);
        return rc;
    }
    t->epoch = 1;
    t->ph = PH_TRAIN;
    if (t->cfg.text) {
        t->epoch = 0;
        t->ph = PH_EVAL;
    }
    shuffle(t);
    t->t_start = t->t_epoch = t->t_limit0 = now_s(t);
    rc = route_caller_run(t->caller);
    /* Not after the end's cancellations: those calls are not re-sent. */
    out->retries = (long)route_pipeline_retries(t->pipe);
    out->errors = route_caller_errors(t->caller);
    out->train_time_s = t->train_time;
    out->samples = t->done_total;
    out->samples_per_s = t->train_time > 0 ? (double)t->done_total / t->train_time : 0;
    trainer_free(t);
    return rc;
}
