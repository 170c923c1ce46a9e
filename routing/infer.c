#include "routing/infer.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "peer/meta.h"
#include "peer/rpc_client.h"
#include "peer/wire.h"
#include "routing/conns.h"
#include "routing/pipeline.h"
#include "routing/replica.h"
#include "routing/swarm.h"

#define PUMP_MS 20

/* One (batch, path): goes forward through every stage. */
typedef struct unit {
    int used, sent;
    int batch, path, rows;
    int stage;
    int span;                   /* stages asked of the holder in flight (from stage on) */
    float *buf[2];              /* ping-pong (batch, max width) */
    uint8_t holder[DHT_ID_LEN]; /* holder of the call in flight */
    uint8_t prev[DHT_ID_LEN];   /* holder that served the previous stage */
    double t_start, t_call;
    int attempt;
    struct infer *in;
} unit;

typedef struct infer {
    uv_loop_t *loop;
    route_infer_config cfg;
    route_infer_result *res;
    route_swarm *swarm;
    route_conns *conns;
    uv_timer_t timer;
    int timer_closed, finishing, rc;
    uint64_t rng;
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
    route_waits waits;
    route_errlog errs;          /* failures logged: the first of each kind, then summaries */
} infer;

static double now_s(const infer *in)
{
    /* uv_now has millisecond resolution: too coarse for latencies. */
    (void)in;
    return (double)uv_hrtime() * 1e-9;
}

static void note(infer *in, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void note(infer *in, const char *fmt, ...)
{
    char msg[640];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (in->cfg.on_message)
        in->cfg.on_message(in->cfg.arg, msg);
}

static void pump(infer *in);
static void finish(infer *in, int rc);

static void on_conn_ready(void *arg, const uint8_t id[DHT_ID_LEN], const char *addr)
{
    (void)id;
    (void)addr;
    pump(arg);
}

#define ERRLOG_PERIOD_S 10.0

static const char *stage_name(infer *in, int stage)
{
    route_stage *st = stage >= 0 && stage < in->S ? route_swarm_stage(in->swarm, stage) : NULL;
    return st ? st->name : "?";
}

/* A failed call or connection: the first of each (stage, code) is logged
 * at once, later ones in a summary line at most every ERRLOG_PERIOD_S.
 * code: an error reply's errno (> 0) or a transport failure's -errno. */
static void log_failure(infer *in, int stage, const uint8_t id[DHT_ID_LEN], const char *addr, int code,
                        const char *why)
{
    if (in->finishing || code == -ECANCELED)
        return; /* we cancelled it (closing, or dropping a connection) */
    char sentence[160], hex[DHT_ID_HEX_LEN + 1];
    snprintf(sentence, sizeof sentence, "%s", code < 0 ? strerror(-code) : why && *why ? why : "(no reason given)");
    if (!route_errlog_add(&in->errs, stage, code, sentence))
        return;
    dht_id_to_hex(hex, id);
    if (stage < 0)
        note(in, "cannot connect to holder %.12s at %s: %s; trying other replicas", hex, addr, sentence);
    else if (code > 0)
        note(in, "stage %s (holder %.8s) answered with error %d: %s; trying other replicas", stage_name(in, stage),
             hex, code, sentence);
    else
        note(in, "a call to stage %s (holder %.8s) failed: %s; trying other replicas", stage_name(in, stage), hex,
             sentence);
}

typedef struct summary {
    infer *in;
    char buf[600];
    size_t len;
} summary;

static void summary_line(void *arg, const route_errlog_kind *k)
{
    summary *sm = arg;
    if (sm->len >= sizeof sm->buf - 1)
        return;
    char where[80];
    if (k->stage < 0)
        snprintf(where, sizeof where, "connections");
    else
        snprintf(where, sizeof where, "stage %s", stage_name(sm->in, k->stage));
    int n = snprintf(sm->buf + sm->len, sizeof sm->buf - sm->len, "%s%s: %ld more (latest: %.100s)",
                     sm->len ? "; " : "", where, k->pending, k->last);
    if (n > 0)
        sm->len += (size_t)n < sizeof sm->buf - sm->len ? (size_t)n : sizeof sm->buf - sm->len - 1;
}

/* At most one line every ERRLOG_PERIOD_S, and with last one at the end. */
static void summarize(infer *in, int last)
{
    summary sm = {.in = in};
    if (route_errlog_flush(&in->errs, last ? HUGE_VAL : now_s(in), summary_line, &sm) > 0)
        note(in, "more failures since the last report: %s", sm.buf);
}

static void on_conn_failed(void *arg, const uint8_t id[DHT_ID_LEN], const char *addr, int status)
{
    infer *in = arg;
    route_swarm_ban(in->swarm, id, addr, now_s(in), &in->rng);
    log_failure(in, -1, id, addr, status < 0 ? status : -EIO, NULL);
    pump(in);
}

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
        if (in->res->prob)
            in->res->prob[i] = (float)mean[best];
        if (in->res->agree)
            in->res->agree[i] = (uint8_t)votes[best];
    }
}

static void unit_failed(infer *in, unit *u, int drop)
{
    route_holder *h = route_swarm_find_holder(in->swarm, u->stage, u->holder);
    if (h) {
        if (h->rep.inflight > 0)
            h->rep.inflight--;
        route_replica_failure(&h->rep, now_s(in), &in->rng);
    }
    if (drop)
        route_conns_drop(in->conns, u->holder, NULL);
    for (int i = 0; i < u->span; i++)
        *used_flag(in, u->batch, u->stage + i, u->path) = 0;
    u->sent = 0;
    u->attempt++;
    in->res->retries++;
}

static void on_reply(void *arg, int status, const peer_msg *m)
{
    unit *u = arg;
    infer *in = u->in;
    if (status != 0 || m->kind != PEER_KIND_REPLY) {
        if (status != 0)
            log_failure(in, u->stage, u->holder, NULL, status < 0 ? status : -EIO, NULL);
        else
            log_failure(in, u->stage, u->holder, NULL,
                        m->kind == PEER_KIND_ERROR && m->err_code > 0 ? m->err_code : EIO,
                        m->kind == PEER_KIND_ERROR ? m->err_msg : "an unexpected message");
        if (status == 0 && m->err_code == ENOENT)
            for (int s = u->stage; s < u->stage + u->span; s++)
                route_swarm_invalidate(in->swarm, s);
        unit_failed(in, u, status != 0 && status != -ETIMEDOUT);
        pump(in);
        return;
    }
    /* One weight version per stage served: a peer may serve fewer stages
     * of the span than asked (one, if it predates spans). */
    uint64_t vers[ROUTE_PIPELINE_MAX_STAGES];
    int served = peer_meta_versions_decode(m->meta, m->meta_len, vers, u->span);
    int last = u->stage + served - 1;
    route_stage *st = served >= 1 && served <= u->span ? route_swarm_stage(in->swarm, last) : NULL;
    if (!st || m->n_tensors != 1 || m->t[0].dtype != PEER_DTYPE_F32 || m->t[0].ndim != 2 ||
        m->t[0].shape[0] != (uint64_t)u->rows || m->t[0].shape[1] != (uint64_t)st->out) {
        log_failure(in, u->stage, u->holder, NULL, EBADMSG, "a reply of the wrong shape");
        unit_failed(in, u, 1);
        pump(in);
        return;
    }
    memcpy(u->buf[(last + 1) & 1], m->t[0].data, (size_t)u->rows * (size_t)st->out * sizeof(float));
    for (int i = 0; i < served; i++) {
        uint64_t v = vers[i];
        if (v < in->res->ver_min[u->stage + i])
            in->res->ver_min[u->stage + i] = v;
        if (v > in->res->ver_max[u->stage + i])
            in->res->ver_max[u->stage + i] = v;
    }
    route_holder *h = route_swarm_find_holder(in->swarm, u->stage, u->holder);
    if (h) {
        if (h->rep.inflight > 0)
            h->rep.inflight--;
        route_replica_success(&h->rep, (now_s(in) - u->t_call) / served);
        route_replica_measured(&h->rep, u->rows, (now_s(in) - u->t_call) / served);
    }
    memcpy(u->prev, u->holder, DHT_ID_LEN);
    for (int i = 0; i < served; i++) {
        memcpy(used_id(in, u->batch, u->stage + i, u->path), u->holder, DHT_ID_LEN);
        *used_flag(in, u->batch, u->stage + i, u->path) = 1;
    }
    u->sent = 0;
    u->attempt = 0;
    u->stage = last + 1;
    if (u->stage < in->S) {
        pump(in);
        return;
    }
    /* Through every stage: keep this path's probabilities. */
    const float *z = u->buf[in->S & 1];
    int first = u->batch * in->cfg.batch;
    for (int r = 0; r < u->rows; r++)
        softmax_row(z + (size_t)r * (size_t)in->C,
                    in->probs + ((size_t)(first + r) * (size_t)in->cfg.replicas + (size_t)u->path) * (size_t)in->C,
                    in->C);
    in->lat[in->n_lat++] = (now_s(in) - u->t_start) * 1000.0;
    in->units_done++;
    if (++in->paths_done[u->batch] == in->cfg.replicas)
        decide(in, u->batch);
    u->used = 0;
    pump(in);
}

/* How many stages from `stage` on the holder id can serve in one request:
 * it announces each of them online and is not backed off at any. */
static int span_of(infer *in, int stage, const uint8_t id[DHT_ID_LEN], double now)
{
    int n = 1;
    while (stage + n < in->S) {
        route_holder *h = route_swarm_find_holder(in->swarm, stage + n, id);
        if (!h || h->ann.state != PEER_STATE_ONLINE || route_replica_weight(&h->rep, now) <= 0)
            break;
        n++;
    }
    return n;
}

static int dispatch(infer *in, unit *u)
{
    route_stage *st = route_swarm_stage(in->swarm, u->stage);
    double now = now_s(in);
    route_replica reps[ROUTE_MAX_HOLDERS];
    int map[ROUTE_MAX_HOLDERS], n = 0;
    for (int i = 0; i < st->n_holders; i++)
        if (st->holders[i].ann.state == PEER_STATE_ONLINE) {
            reps[n] = st->holders[i].rep;
            map[n++] = i;
        }
    route_waits_mark(&in->waits, u->stage, n > 0, now);
    if (n == 0)
        return 0;
    /* Prefer holders no other path of this batch used at this stage. */
    uint8_t skip[ROUTE_MAX_HOLDERS] = {0};
    int avoided = 0;
    for (int i = 0; i < n; i++)
        for (int k = 0; k < in->cfg.replicas; k++)
            if (k != u->path && *used_flag(in, u->batch, u->stage, k) &&
                !memcmp(used_id(in, u->batch, u->stage, k), reps[i].id, DHT_ID_LEN)) {
                skip[i] = 1;
                avoided++;
            }
    if (avoided >= n)
        memset(skip, 0, sizeof skip);
    /* A path stays on the peer that served its previous stage when that
     * peer holds this one too: K paths then mean K different peers, so one
     * bad replica spoils one path, not all of them. */
    int stay = -1;
    if (u->stage > 0)
        for (int i = 0; i < n; i++)
            if (!skip[i] && !memcmp(reps[i].id, u->prev, DHT_ID_LEN) && route_replica_weight(&reps[i], now) > 0)
                stay = i;
    int fresh_busy = 0; /* a holder no sibling uses is still connecting */
    for (int tries = 0; tries < n; tries++) {
        int k = stay >= 0 && tries == 0 ? stay : route_pick_replica(reps, n, skip, now, &in->rng, NULL);
        if (k < 0) {
            if (avoided == 0 || fresh_busy)
                return 0; /* wait for it rather than doubling up on a sibling's holder */
            memset(skip, 0, sizeof skip); /* every fresh holder is banned: reuse one */
            avoided = 0;
            k = route_pick_replica(reps, n, skip, now, &in->rng, NULL);
            if (k < 0)
                return 0;
        }
        skip[k] = 1;
        route_holder *h = &st->holders[map[k]];
        peer_rpc_client *cl = route_conns_get(in->conns, h->rep.id, h->ann.addr, NULL);
        if (!cl) {
            fresh_busy |= avoided > 0;
            continue;
        }
        /* The stages after this one that the same peer holds go in the
         * same request (a span): one round trip instead of one per stage. */
        int span = span_of(in, u->stage, h->rep.id, now);
        uint8_t meta[PEER_META_U64_LEN];
        peer_msg m;
        peer_msg_init(&m, PEER_KIND_REQUEST, PEER_METHOD_INFER, 0);
        snprintf(m.block, sizeof m.block, "%s", st->name);
        m.meta_len = peer_meta_span_encode(meta, span);
        m.meta = m.meta_len ? meta : NULL;
        uint64_t shape[2] = {(uint64_t)u->rows, (uint64_t)st->in};
        const float *x = u->stage == 0 ? in->cfg.inputs + (size_t)u->batch * (size_t)in->cfg.batch * (size_t)st->in
                                       : u->buf[u->stage & 1];
        peer_tensor_f32(&m.t[0], x, 2, shape);
        m.n_tensors = 1;
        memcpy(u->holder, h->rep.id, DHT_ID_LEN);
        u->t_call = now;
        u->span = span;
        int rc = peer_rpc_call(cl, &m, (uint64_t)(in->cfg.call_timeout_s * 1000), on_reply, u, NULL);
        if (rc == 0) {
            u->sent = 1;
            h->rep.inflight++;
            /* Claimed now, not on the reply: sibling paths dispatched in
             * the meantime must see it. */
            for (int i = 0; i < span; i++) {
                memcpy(used_id(in, u->batch, u->stage + i, u->path), h->rep.id, DHT_ID_LEN);
                *used_flag(in, u->batch, u->stage + i, u->path) = 1;
            }
            return 1;
        }
        if (rc == -ENOTCONN)
            route_conns_drop(in->conns, h->rep.id, h->ann.addr);
    }
    return 0;
}

static void check_waits(infer *in)
{
    char msg[320];
    int rc = route_waits_check(&in->waits, in->swarm, now_s(in), in->cfg.max_wait_s, in->res->error,
                               sizeof in->res->error, msg, sizeof msg);
    if (rc < 0)
        finish(in, rc);
    else if (rc > 0)
        note(in, "%s", msg);
}

static void pump(infer *in)
{
    if (in->finishing)
        return;
    route_swarm_refresh(in->swarm, now_s(in));
    summarize(in, 0);
    if (in->units_done == (long)in->n_batches * in->cfg.replicas) {
        finish(in, 0);
        return;
    }
    for (int i = 0; i < in->cfg.inflight; i++) {
        unit *u = &in->units[i];
        if (!u->used && in->next_batch < in->n_batches) {
            u->used = 1;
            u->batch = in->next_batch;
            u->path = in->next_path;
            int first = u->batch * in->cfg.batch;
            u->rows = in->cfg.n - first < in->cfg.batch ? in->cfg.n - first : in->cfg.batch;
            u->stage = 0;
            u->span = 1;
            u->sent = 0;
            u->attempt = 0;
            u->t_start = now_s(in);
            u->in = in;
            if (++in->next_path == in->cfg.replicas) {
                in->next_path = 0;
                in->next_batch++;
            }
        }
        if (u->used && !u->sent)
            dispatch(in, u);
    }
    check_waits(in);
}

static void on_timer(uv_timer_t *t)
{
    pump(t->data);
}

static void on_timer_closed(uv_handle_t *h)
{
    ((infer *)h->data)->timer_closed = 1;
}

static void finish(infer *in, int rc)
{
    if (in->finishing)
        return;
    summarize(in, 1);
    in->finishing = 1;
    in->rc = rc;
    uv_timer_stop(&in->timer);
    uv_close((uv_handle_t *)&in->timer, on_timer_closed);
    route_conns_close_all(in->conns);
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int route_infer_run(uv_loop_t *loop, const route_infer_config *cfg, route_infer_result *out)
{
    if (!out)
        return -EINVAL;
    int *pred = out->pred;
    float *prob = out->prob;
    uint8_t *agree = out->agree;
    memset(out, 0, sizeof *out);
    out->pred = pred;
    out->prob = prob;
    out->agree = agree;
    if (!loop || !cfg || !cfg->dht || !cfg->ident || !cfg->model || !cfg->inputs || cfg->n < 1 ||
        cfg->batch < 1 || cfg->replicas < 1 || cfg->replicas > ROUTE_INFER_MAX_REPLICAS ||
        cfg->inflight < 1 || !pred || cfg->model->n_stages > 64 || cfg->model->n_out > 256) {
        snprintf(out->error, sizeof out->error, "invalid inference configuration");
        return -EINVAL;
    }
    infer *in = calloc(1, sizeof *in);
    if (!in)
        return -ENOMEM;
    in->loop = loop;
    in->cfg = *cfg;
    if (!(in->cfg.call_timeout_s > 0))
        in->cfg.call_timeout_s = 30;
    if (!(in->cfg.max_wait_s > 0))
        in->cfg.max_wait_s = 120;
    if (!(in->cfg.refresh_s > 0))
        in->cfg.refresh_s = 10;
    in->res = out;
    in->rng = 0x853c49e6748fea9bULL;
    in->S = cfg->model->n_stages;
    in->C = cfg->model->n_out;
    for (int s = 0; s < in->S; s++) {
        struct expert_block_config c;
        expert_model_stage(cfg->model, s, &c);
        in->max_w = c.in > in->max_w ? c.in : in->max_w;
        in->max_w = c.out > in->max_w ? c.out : in->max_w;
        out->ver_min[s] = UINT64_MAX;
    }
    in->n_batches = (cfg->n + cfg->batch - 1) / cfg->batch;
    long units = (long)in->n_batches * cfg->replicas;
    in->units = calloc((size_t)cfg->inflight, sizeof *in->units);
    in->paths_done = calloc((size_t)in->n_batches, sizeof *in->paths_done);
    in->probs = malloc((size_t)cfg->n * (size_t)cfg->replicas * (size_t)in->C * sizeof(float));
    in->used = calloc((size_t)in->n_batches * (size_t)in->S, sizeof *in->used);
    in->used_set = calloc((size_t)in->n_batches * (size_t)in->S * (size_t)cfg->replicas, 1);
    in->lat = malloc((size_t)units * sizeof(double));
    in->swarm = route_swarm_create(cfg->dht, cfg->model, in->cfg.refresh_s);
    route_conns_config cc = {.ident = cfg->ident,
                             .swarm_key = cfg->swarm_key,
                             .max_pending = 2 * cfg->inflight + 8,
                             .on_ready = on_conn_ready,
                             .on_failed = on_conn_failed,
                             .arg = in,
                             .connect_timeout_ms = (uint64_t)(in->cfg.call_timeout_s * 1000)};
    in->conns = route_conns_create(loop, &cc);
    int rc = 0;
    int ok = in->units && in->paths_done && in->probs && in->used && in->used_set && in->lat && in->swarm &&
             in->conns;
    for (int i = 0; ok && i < cfg->inflight; i++) {
        in->units[i].buf[0] = malloc((size_t)cfg->batch * (size_t)in->max_w * sizeof(float));
        in->units[i].buf[1] = malloc((size_t)cfg->batch * (size_t)in->max_w * sizeof(float));
        ok = in->units[i].buf[0] && in->units[i].buf[1];
    }
    if (!ok) {
        snprintf(out->error, sizeof out->error, "out of memory");
        rc = -ENOMEM;
        goto out;
    }
    uv_update_time(loop);
    in->t0 = now_s(in);
    route_errlog_init(&in->errs, ERRLOG_PERIOD_S, in->t0);
    uv_timer_init(loop, &in->timer);
    in->timer.data = in;
    uv_timer_start(&in->timer, on_timer, 0, PUMP_MS);
    while (!(in->finishing && in->timer_closed && route_conns_open(in->conns) == 0))
        uv_run(loop, UV_RUN_ONCE);
    rc = in->rc;
    uv_update_time(loop);
    out->elapsed_s = now_s(in) - in->t0;
    if (in->n_lat > 0) {
        qsort(in->lat, (size_t)in->n_lat, sizeof *in->lat, cmp_double);
        out->p50_ms = in->lat[(in->n_lat - 1) / 2];
        out->p99_ms = in->lat[(long)ceil(0.99 * (double)in->n_lat) - 1];
    }
    if (out->elapsed_s > 0) {
        out->requests_per_s = (double)in->units_done / out->elapsed_s;
        out->samples_per_s = rc == 0 ? (double)cfg->n / out->elapsed_s : 0;
    }
    for (int s = 0; s < in->S; s++)
        if (out->ver_min[s] == UINT64_MAX)
            out->ver_min[s] = 0;
out:
    for (int i = 0; in->units && i < cfg->inflight; i++) {
        free(in->units[i].buf[0]);
        free(in->units[i].buf[1]);
    }
    route_conns_destroy(&in->conns);
    route_swarm_destroy(&in->swarm);
    free(in->units);
    free(in->paths_done);
    free(in->probs);
    free(in->used);
    free(in->used_set);
    free(in->lat);
    free(in);
    return rc;
}
