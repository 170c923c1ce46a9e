/* routing/infer.c: inference's own part: batches and their K paths,
 * spans of stages per request, path diversity and the majority vote.
 * Sending the calls, retries, connections, waits and the log are
 * routing/caller.c's. */
#include "routing/infer.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "net/wire.h"
#include "routing/caller.h"
#include "routing/pipeline.h"
#include "routing/swarm.h"

/* One (batch, path): goes forward through every stage. */
typedef struct unit {
    route_caller_call rpc;      /* the call of its current stage (rpc.stage, rpc.span) */
    int used;
    int batch, path, rows;
    float *buf[2];              /* ping-pong (batch, max width) */
    int cur;                    /* the buffer holding the current stage's inputs (-1: the batch's) */
    uint8_t prev[DHT_ID_LEN];   /* holder that served the previous stage */
    uint8_t avoid[ROUTE_INFER_MAX_REPLICAS][DHT_ID_LEN]; /* the sibling paths' holders of this stage */
    double t_start;
} unit;

typedef struct infer {
    route_infer_config cfg;
    route_infer_result *res;
    route_caller *caller;
    int S, C, max_w;
    unit *units;
    int n_batches, next_batch, next_path;
    int *paths_done;            /* per batch */
    float *probs;               /* (n, replicas, C) softmax of each path */
    /* holders used by each batch's paths at each stage, for diversity */
    uint8_t (*used)[ROUTE_INFER_MAX_REPLICAS][DHT_ID_LEN];
    uint8_t *used_set;          /* (n_batches * S * replicas) flags */
    double *lat;                /* per unit */
    long n_lat, units_done;
    double t0;
} infer;

static uint8_t *used_id(infer *in, int b, int s, int path)
{
    return in->used[(size_t)b * (size_t)in->S + (size_t)s][path];
}

static uint8_t *used_flag(infer *in, int b, int s, int path)
{
    return &in->used_set[((size_t)b * (size_t)in->S + (size_t)s) * (size_t)in->cfg.replicas + (size_t)path];
}

static void softmax_row(const float *z, float *p, int C)
{
    float mx = z[0];
    for (int c = 1; c < C; c++)
        mx = z[c] > mx ? z[c] : mx;
    double sum = 0;
    for (int c = 0; c < C; c++)
        sum += exp((double)(z[c] - mx));
    for (int c = 0; c < C; c++)
        p[c] = (float)(exp((double)(z[c] - mx)) / sum);
}

/* All paths of batch b are in: vote per sample. */
static void decide(infer *in, int b)
{
    const int K = in->cfg.replicas, C = in->C;
    int first = b * in->cfg.batch;
    int rows = in->cfg.n - first < in->cfg.batch ? in->cfg.n - first : in->cfg.batch;
    for (int r = 0; r < rows; r++) {
        int i = first + r;
        int votes[256] = {0};
        double mean[256] = {0};
        for (int k = 0; k < K; k++) {
            const float *p = in->probs + ((size_t)i * (size_t)K + (size_t)k) * (size_t)C;
            int arg = 0;
            for (int c = 1; c < C; c++)
                if (p[c] > p[arg])
                    arg = c;
            votes[arg]++;
            for (int c = 0; c < C; c++)
                mean[c] += p[c] / K;
        }
        int best = 0;
        for (int c = 1; c < C; c++)
            if (votes[c] > votes[best] || (votes[c] == votes[best] && mean[c] > mean[best]))
                best = c;
        in->res->pred[i] = best;
        if (in->res->probs)
            for (int c = 0; c < C; c++)
                in->res->probs[(size_t)i * (size_t)C + (size_t)c] = (float)mean[c];
        if (in->res->prob)
            in->res->prob[i] = (float)mean[best];
        if (in->res->agree)
            in->res->agree[i] = (uint8_t)votes[best];
    }
}


/* Marks stages [stage, stage + n) of u's path as served by holder id (or
 * frees them, id NULL), so sibling paths pick other holders. */
static void claim(infer *in, const unit *u, int stage, int n, const uint8_t *id)
{
    for (int i = 0; i < n && stage + i < in->S; i++) {
        if (id)
            memcpy(used_id(in, u->batch, stage + i, u->path), id, DHT_ID_LEN);
        *used_flag(in, u->batch, stage + i, u->path) = id != NULL;
    }
}

/* u went through every stage: keep this path's probabilities; vote when
 * the batch's last path is in. */
static void path_done(infer *in, unit *u)
{
    const float *z = u->buf[u->cur];
    int first = u->batch * in->cfg.batch;
    size_t row = (size_t)in->cfg.model->n_out;
    for (int r = 0; r < u->rows; r++) {
        /* A language model's row is (seq, vocab): the position's logits. */
        size_t at = in->cfg.positions ? (size_t)in->cfg.positions[first + r] * (size_t)in->C : 0;
        softmax_row(z + (size_t)r * row + at,
                    in->probs + ((size_t)(first + r) * (size_t)in->cfg.replicas + (size_t)u->path) * (size_t)in->C,
                    in->C);
    }
    in->lat[in->n_lat++] = (route_caller_now(in->caller) - u->t_start) * 1000.0;
    in->units_done++;
    if (++in->paths_done[u->batch] == in->cfg.replicas)
        decide(in, u->batch);
    u->used = 0;
}

/* A reply: one weight version per stage served (a peer may serve fewer
 * stages of the span than asked: one, if it predates spans); the outputs,
 * in the other buffer, are the next stage's inputs. */
static void unit_replied(infer *in, unit *u)
{
    route_caller_call *c = &u->rpc;
    for (int i = 0; i < c->n_versions; i++) {
        uint64_t v = c->versions[i];
        if (v < in->res->ver_min[c->stage + i])
            in->res->ver_min[c->stage + i] = v;
        if (v > in->res->ver_max[c->stage + i])
            in->res->ver_max[c->stage + i] = v;
    }
    memcpy(u->prev, c->holder, DHT_ID_LEN);
    claim(in, u, c->stage, c->served, c->holder);
    u->cur = u->cur < 0 ? 0 : u->cur ^ 1;
    c->stage += c->served;
    if (c->stage == in->S)
        path_done(in, u);
}

/* A failure: the stages it claimed are free again; the next pump sends it
 * to another replica. */
static void unit_failed(infer *in, unit *u)
{
    claim(in, u, u->rpc.stage, u->rpc.span, NULL);
    in->res->retries++;
}

/* What u's call sends: its inputs, as many stages as one holder serves (a
 * span: one round trip instead of one per stage), and the holders to
 * prefer: none that another path of this batch used at this stage, and
 * first the one that served this path's previous stage when it holds this
 * one too (when every replica is a sibling's, the path stays where it
 * was). K paths then mean K different peers, so one bad replica spoils one
 * path, not all of them. */
static void describe(infer *in, unit *u)
{
    route_caller_call *c = &u->rpc;
    const route_stage *st0 = route_swarm_stage(route_caller_swarm(in->caller), 0);
    c->x = u->cur < 0 ? in->cfg.inputs + (size_t)u->batch * (size_t)in->cfg.batch * (size_t)st0->in : u->buf[u->cur];
    c->out = u->buf[u->cur < 0 ? 0 : u->cur ^ 1];
    c->out_cap = (size_t)u->rows * (size_t)in->max_w;
    c->max_span = in->S;
    c->pin = c->stage > 0 ? u->prev : NULL;
    c->n_avoid = 0;
    for (int k = 0; k < in->cfg.replicas; k++)
        if (k != u->path && *used_flag(in, u->batch, c->stage, k))
            memcpy(u->avoid[c->n_avoid++], used_id(in, u->batch, c->stage, k), DHT_ID_LEN);
    c->avoid = (const uint8_t(*)[DHT_ID_LEN])u->avoid;
}

/* Takes the next (batch, path) into free unit u. */
static void start_unit(infer *in, unit *u)
{
    u->used = 1;
    u->batch = in->next_batch;
    u->path = in->next_path;
    int first = u->batch * in->cfg.batch;
    u->rows = in->cfg.n - first < in->cfg.batch ? in->cfg.n - first : in->cfg.batch;
    u->cur = -1;
    u->rpc.stage = 0;
    u->rpc.method = PEER_METHOD_INFER;
    u->rpc.rows = u->rows;
    u->rpc.user = u;
    u->t_start = route_caller_now(in->caller);
    if (++in->next_path == in->cfg.replicas) {
        in->next_path = 0;
        in->next_batch++;
    }
}

/* The caller's pump: completed calls in, then the end, or new units and
 * every unsent call out. */
static void pump(void *arg)
{
    infer *in = arg;
    route_caller_call *c;
    while ((c = route_caller_reap(in->caller)) != NULL) {
        if (c->status == 0)
            unit_replied(in, c->user);
        else
            unit_failed(in, c->user);
    }
    if (in->units_done == (long)in->n_batches * in->cfg.replicas) {
        route_caller_finish(in->caller, 0);
        return;
    }
    for (int i = 0; i < in->cfg.inflight; i++) {
        unit *u = &in->units[i];
        if (!u->used && in->next_batch < in->n_batches)
            start_unit(in, u);
        /* Claimed when sent, not on the reply: sibling paths dispatched
         * in the meantime must see it. */
        if (!u->used || u->rpc.sent || u->rpc.queued)
            continue;
        describe(in, u);
        if (route_caller_send(in->caller, &u->rpc) == 1)
            claim(in, u, u->rpc.stage, u->rpc.span, u->rpc.holder);
    }
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}


/* Allocates in's parts for in->cfg (already checked). Returns 0 or -ENOMEM. */
static int infer_init(infer *in, uv_loop_t *loop)
{
    const route_infer_config *cfg = &in->cfg;
    in->n_batches = (cfg->n + cfg->batch - 1) / cfg->batch;
    long units = (long)in->n_batches * cfg->replicas;
    in->units = calloc((size_t)cfg->inflight, sizeof *in->units);
    in->paths_done = calloc((size_t)in->n_batches, sizeof *in->paths_done);
    in->probs = malloc((size_t)cfg->n * (size_t)cfg->replicas * (size_t)in->C * sizeof(float));
    in->used = calloc((size_t)in->n_batches * (size_t)in->S, sizeof *in->used);
    in->used_set = calloc((size_t)in->n_batches * (size_t)in->S * (size_t)cfg->replicas, 1);
    in->lat = malloc((size_t)units * sizeof(double));
    route_caller_config cc = {.dht = cfg->dht,
                              .ident = cfg->ident,
                              .swarm_key = cfg->swarm_key,
                              .model = cfg->model,
                              .call_timeout_s = cfg->call_timeout_s,
                              .max_wait_s = cfg->max_wait_s,
                              .refresh_s = cfg->refresh_s,
                              .max_pending = 2 * cfg->inflight + 8,
                              .rng_seed = 0x853c49e6748fea9bULL,
                              .error = in->res->error,
                              .error_len = sizeof in->res->error,
                              .pump = pump,
                              .arg = in,
                              .on_message = cfg->on_message,
                              .message_arg = cfg->arg};
    in->caller = route_caller_create(loop, &cc);
    int ok = in->units && in->paths_done && in->probs && in->used && in->used_set && in->lat && in->caller;
    for (int i = 0; ok && i < cfg->inflight; i++) {
        in->units[i].buf[0] = malloc((size_t)cfg->batch * (size_t)in->max_w * sizeof(float));
        in->units[i].buf[1] = malloc((size_t)cfg->batch * (size_t)in->max_w * sizeof(float));
        ok = in->units[i].buf[0] && in->units[i].buf[1];
    }
    return ok ? 0 : -ENOMEM;
}

static void infer_free(infer *in)
{
    for (int i = 0; in->units && i < in->cfg.inflight; i++) {
        free(in->units[i].buf[0]);
        free(in->units[i].buf[1]);
    }
    route_caller_destroy(&in->caller);
    free(in->units);
    free(in->paths_done);
    free(in->probs);
    free(in->used);
    free(in->used_set);
    free(in->lat);
    free(in);
}

/* The run's figures, once it has ended with rc. */
static void report(infer *in, int rc)
{
    route_infer_result *out = in->res;
    out->elapsed_s = route_caller_now(in->caller) - in->t0;
    if (in->n_lat > 0) {
        qsort(in->lat, (size_t)in->n_lat, sizeof *in->lat, cmp_double);
        out->p50_ms = in->lat[(in->n_lat - 1) / 2];
        out->p99_ms = in->lat[(long)ceil(0.99 * (double)in->n_lat) - 1];
    }
    if (out->elapsed_s > 0) {
        out->requests_per_s = (double)in->units_done / out->elapsed_s;
        out->samples_per_s = rc == 0 ? (double)in->cfg.n / out->elapsed_s : 0;
    }
    for (int s = 0; s < in->S; s++)
        if (out->ver_min[s] == UINT64_MAX)
            out->ver_min[s] = 0;
}

int route_infer_run(uv_loop_t *loop, const route_infer_config *cfg, route_infer_result *out)
{
    if (!out)
        return -EINVAL;
    int *pred = out->pred;
    float *prob = out->prob, *probs = out->probs;
    uint8_t *agree = out->agree;
    memset(out, 0, sizeof *out);
    out->pred = pred;
    out->prob = prob;
    out->probs = probs;
    out->agree = agree;
    int lm = cfg && cfg->model && cfg->model->task == EXPERT_TASK_BYTES;
    if (!loop || !cfg || !cfg->dht || !cfg->ident || !cfg->model || !cfg->inputs || cfg->n < 1 ||
        cfg->batch < 1 || cfg->replicas < 1 || cfg->replicas > ROUTE_INFER_MAX_REPLICAS ||
        cfg->inflight < 1 || !pred || cfg->model->n_stages > 64 ||
        (lm ? !cfg->positions || cfg->model->vocab > 256 : cfg->positions || cfg->model->n_out > 256)) {
        snprintf(out->error, sizeof out->error, "invalid inference configuration");
        return -EINVAL;
    }
    for (int i = 0; lm && i < cfg->n; i++)
        if (cfg->positions[i] < 0 || cfg->positions[i] >= cfg->model->seq) {
            snprintf(out->error, sizeof out->error, "position %d of row %d is outside the context (%d)",
                     cfg->positions[i], i, cfg->model->seq);
            return -EINVAL;
        }
    infer *in = calloc(1, sizeof *in);
    if (!in)
        return -ENOMEM;
    in->cfg = *cfg;
    in->res = out;
    in->S = cfg->model->n_stages;
    in->C = lm ? cfg->model->vocab : cfg->model->n_out;
    for (int s = 0; s < in->S; s++) {
        struct expert_block_config c;
        expert_model_stage(cfg->model, s, &c);
        in->max_w = c.in > in->max_w ? c.in : in->max_w;
        in->max_w = c.out > in->max_w ? c.out : in->max_w;
        out->ver_min[s] = UINT64_MAX;
    }
    int rc = infer_init(in, loop);
    if (rc != 0) {
        snprintf(out->error, sizeof out->error, "out of memory");
        infer_free(in);
        return rc;
    }
    in->t0 = route_caller_now(in->caller);
    rc = route_caller_run(in->caller);
    report(in, rc);
    infer_free(in);
    return rc;
}
