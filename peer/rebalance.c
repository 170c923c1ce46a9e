/* peer/rebalance.c: the span a peer without --blocks starts on, and its
 * moves (peer/rebalance.h). */
#include "peer/rebalance.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "peer/log.h"
#include "swarm/balance.h"
#include "routing/swarm.h"

void route_rebalance_scores(const route_stage *const *view, int n, const uint8_t *self_id, double *score,
                            int *holders)
{
    for (int i = 0; i < n; i++) {
        const route_stage *st = view ? view[i] : NULL;
        double total = 0, best = 0;
        holders[i] = 0;
        for (int h = 0; st && h < st->n_holders; h++) {
            const route_holder *ho = &st->holders[h];
            if (ho->ann.state != PEER_STATE_ONLINE || (self_id && !memcmp(ho->rep.id, self_id, DHT_ID_LEN)))
                continue;
            holders[i]++;
            total += ho->ann.throughput;
            if (ho->ann.throughput > best)
                best = ho->ann.throughput;
        }
        score[i] = best > 0 ? total / best : holders[i];
    }
}

/* The holder of st with node ID id (any state), or NULL. */
static const route_holder *find_holder(const route_stage *st, const uint8_t *id)
{
    for (int h = 0; st && h < st->n_holders; h++)
        if (!memcmp(st->holders[h].rep.id, id, DHT_ID_LEN))
            return &st->holders[h];
    return NULL;
}

int route_rebalance_outranking(const route_stage *const *view, int n, const uint8_t self_id[DHT_ID_LEN],
                               int cur, int k)
{
    if (!self_id || k < 1 || cur < 0 || cur + k > n)
        return -EINVAL;
    const route_stage *st = view ? view[cur] : NULL;
    int count = 0;
    for (int h = 0; st && h < st->n_holders; h++) {
        const route_holder *ho = &st->holders[h];
        if (ho->ann.state != PEER_STATE_ONLINE || memcmp(ho->rep.id, self_id, DHT_ID_LEN) <= 0)
            continue;
        int all = 1;
        for (int i = cur + 1; i < cur + k && all; i++) {
            const route_holder *o = find_holder(view[i], ho->rep.id);
            all = o && o->ann.state == PEER_STATE_ONLINE;
        }
        count += all;
    }
    return count;
}

int route_rebalance_choose_start(const route_stage *const *view, int n, int k, uint64_t *rng, double *served)
{
    if (n < 1 || n > ROUTE_SWARM_MAX_STAGES)
        return -EINVAL;
    double score[ROUTE_SWARM_MAX_STAGES] = {0};
    int holders[ROUTE_SWARM_MAX_STAGES] = {0};
    route_rebalance_scores(view, n, NULL, score, holders);
    int start = route_balance_choose(score, n, k, rng);
    double sum = 0;
    for (int i = start; start >= 0 && i < start + k; i++)
        sum += score[i];
    if (served)
        *served = sum;
    return start;
}

int route_rebalance_decide(const route_stage *const *view, int n, const uint8_t self_id[DHT_ID_LEN], int cur,
                           int k, int *yielded, uint64_t *rng, int *to)
{
    if (n < 1 || n > ROUTE_SWARM_MAX_STAGES || !self_id || !yielded)
        return -EINVAL;
    double score[ROUTE_SWARM_MAX_STAGES] = {0};
    int holders[ROUTE_SWARM_MAX_STAGES] = {0};
    route_rebalance_scores(view, n, self_id, score, holders);
    int outranked = route_rebalance_outranking(view, n, self_id, cur, k);
    if (outranked < 0)
        return outranked;
    int go = route_balance_should_move(score, holders, n, k, cur, ROUTE_REBALANCE_RATIO, outranked, rng, to);
    if (go < 0)
        return go;
    /* Left to a peer that outranks us: count the checks it has not gone. */
    if (go != 1 && outranked > 0 &&
        route_balance_should_move(score, holders, n, k, cur, ROUTE_REBALANCE_RATIO, 0, rng, to) == 1)
        go = ++*yielded >= ROUTE_REBALANCE_MAX_YIELDS;
    else
        *yielded = 0;
    if (go == 1)
        *yielded = 0;
    return go == 1;
}

/* The stages of sw as a view (sw NULL: NULL). */
static const route_stage *const *swarm_view(route_swarm *sw, const route_stage **view, int n)
{
    if (!sw)
        return NULL;
    for (int i = 0; i < n; i++)
        view[i] = route_swarm_stage(sw, i);
    return view;
}

static int any_pending(route_swarm *sw, int n)
{
    for (int i = 0; i < n; i++)
        if (route_swarm_stage(sw, i)->pending)
            return 1;
    return 0;
}

int route_rebalance_first_span(dht *d, uv_loop_t *loop, const struct expert_model_spec *spec, int k,
                               uint64_t *rng, FILE *log)
{
    if (!loop || !spec || spec->n_stages > ROUTE_SWARM_MAX_STAGES)
        return -EINVAL;
    int n = spec->n_stages;
    route_swarm *sw = route_swarm_create(d, spec, 1e9);
    if (sw) {
        route_swarm_refresh(sw, 0);
        for (int waited = 0; waited < 1000 && any_pending(sw, n); waited++)
            uv_run(loop, UV_RUN_ONCE);
    }
    const route_stage *stages[ROUTE_SWARM_MAX_STAGES];
    double served = 0;
    int start = route_rebalance_choose_start(swarm_view(sw, stages, n), n, k, rng, &served);
    route_swarm_destroy(&sw);
    peer_log(log, "chose stages %d-%d, the least served span (%.1f holder-equivalents)", start, start + k - 1,
             served);
    return start;
}

/* --- The rebalancer ----------------------------------------------------- */

struct route_rebalance {
    uv_loop_t *loop;
    uv_timer_t timer;
    route_rebalance_config cfg;
    peer_daemon_config dc;        /* cfg.dc's copy, with our span and listen */
    int blocks[PEER_SERVICE_MAX_BLOCKS];
    char listen[96];              /* listen address, with the bound port after the first start */
    peer_daemon *daemon;          /* NULL while a move or the stop is under way */
    route_swarm *sw;              /* view for the re-checks, on the daemon's DHT */
    int cur;                      /* start of the current span */
    int next;                     /* start to move to */
    int yielded;                  /* see route_rebalance_decide */
    int eval_pending;             /* lookups started; decide when they end */
    int moving, stopping;
    int status;                   /* for on_stopped */
    int stopped, destroy_pending; /* on_stopped has run; destroy was called */
};

void route_rebalance_span_name(char *buf, size_t len, int start, int k)
{
    if (k == 1)
        snprintf(buf, len, "%d", start);
    else
        snprintf(buf, len, "%d-%d", start, start + k - 1);
}

/* Starts the daemon on [start, start+k); keeps its port for the next start. */
static int start_span(route_rebalance *rb, int start, char *err, size_t errlen)
{
    for (int i = 0; i < rb->cfg.k; i++)
        rb->blocks[i] = start + i;
    rb->dc.svc.blocks = rb->blocks;
    rb->dc.svc.n_blocks = rb->cfg.k;
    rb->dc.listen = rb->listen;
    rb->cur = start;
    rb->daemon = peer_daemon_start(rb->loop, &rb->dc, err, errlen);
    if (!rb->daemon)
        return -1;
    /* Keep the port: a move restarts on the same one. */
    dht_addr bound;
    if (dht_local_addr(peer_daemon_dht(rb->daemon), &bound) == 0) {
        char *colon = strrchr(rb->listen, ':');
        if (colon)
            snprintf(colon, sizeof rb->listen - (size_t)(colon - rb->listen), ":%u", (unsigned)bound.port);
    }
    if (rb->cfg.on_started)
        rb->cfg.on_started(rb->cfg.arg, rb->daemon, rb->blocks, rb->cfg.k);
    return 0;
}

static void on_timer_closed(uv_handle_t *h)
{
    route_rebalance *rb = h->data;
    void (*cb)(void *, int) = rb->cfg.on_stopped;
    void *arg = rb->cfg.arg;
    int status = rb->status;
    rb->stopped = 1;
    if (rb->destroy_pending)
        free(rb);
    if (cb)
        cb(arg, status);
}

static void finish(route_rebalance *rb, int status)
{
    rb->status = status;
    uv_close((uv_handle_t *)&rb->timer, on_timer_closed);
}

static void on_daemon_stopped(int status, void *arg)
{
    finish(arg, status);
}

static void on_tick(uv_timer_t *t);

static void schedule(route_rebalance *rb, double seconds)
{
    double s = seconds * (0.5 + route_rand01(&rb->cfg.rng));
    uv_timer_start(&rb->timer, on_tick, (uint64_t)(s * 1000), 0);
}

static void on_moved(int status, void *arg)
{
    route_rebalance *rb = arg;
    char err[512];
    rb->moving = 0;
    if (status != 0)
        peer_log(rb->dc.log, "warning: checkpoints before the move failed");
    if (rb->stopping) {
        finish(rb, 0);
        return;
    }
    if (start_span(rb, rb->next, err, sizeof err) != 0) {
        peer_log(rb->dc.log, "cannot restart after the move: %s", err);
        rb->stopping = 1;
        finish(rb, ROUTE_REBALANCE_RESTART_FAILED);
        return;
    }
    schedule(rb, rb->cfg.every_s);
}

static void move_to(route_rebalance *rb, int to)
{
    char from_s[32], to_s[32];
    route_rebalance_span_name(from_s, sizeof from_s, rb->cur, rb->cfg.k);
    route_rebalance_span_name(to_s, sizeof to_s, to, rb->cfg.k);
    peer_log(rb->dc.log, "moving from stages %s to %s, which the swarm serves much less", from_s, to_s);
    rb->next = to;
    rb->moving = 1;
    route_swarm_destroy(&rb->sw);
    peer_daemon_stop(rb->daemon, on_moved, rb);
    peer_daemon_destroy(&rb->daemon); /* freed once stopped */
}

/* Every every_s seconds: look up every stage again (polling each second
 * until the lookups end), then decide whether our span should move. */
static void on_tick(uv_timer_t *t)
{
    route_rebalance *rb = t->data;
    int n = rb->cfg.spec->n_stages;
    if (rb->stopping || rb->moving || !rb->daemon)
        return;
    if (!rb->eval_pending) {
        if (!rb->sw)
            rb->sw = route_swarm_create(peer_daemon_dht(rb->daemon), rb->cfg.spec, 1e9);
        if (!rb->sw) {
            schedule(rb, rb->cfg.every_s);
            return;
        }
        for (int i = 0; i < n; i++)
            route_swarm_invalidate(rb->sw, i);
        route_swarm_refresh(rb->sw, (double)uv_now(rb->loop) / 1000.0);
        rb->eval_pending = 1;
        uv_timer_start(&rb->timer, on_tick, 1000, 0);
        return;
    }
    if (any_pending(rb->sw, n)) {
        uv_timer_start(&rb->timer, on_tick, 1000, 0);
        return;
    }
    rb->eval_pending = 0;
    const route_stage *stages[ROUTE_SWARM_MAX_STAGES];
    int to = -1;
    if (route_rebalance_decide(swarm_view(rb->sw, stages, n), n, rb->dc.ident->id, rb->cur, rb->cfg.k,
                               &rb->yielded, &rb->cfg.rng, &to) == 1) {
        move_to(rb, to);
        return;
    }
    schedule(rb, rb->cfg.every_s);
}

route_rebalance *route_rebalance_start(uv_loop_t *loop, const route_rebalance_config *cfg, char *err,
                                       size_t errlen)
{
    if (!loop || !cfg || !cfg->dc || !cfg->dc->ident || !cfg->spec ||
        cfg->spec->n_stages > ROUTE_SWARM_MAX_STAGES || cfg->k < 1 || cfg->k > PEER_SERVICE_MAX_BLOCKS ||
        cfg->start < 0 || cfg->start + cfg->k > cfg->spec->n_stages || cfg->rng == 0) {
        snprintf(err, errlen, "invalid rebalancing configuration");
        return NULL;
    }
    route_rebalance *rb = calloc(1, sizeof *rb);
    if (!rb) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    rb->loop = loop;
    rb->cfg = *cfg;
    rb->dc = *cfg->dc;
    rb->cfg.dc = &rb->dc;
    snprintf(rb->listen, sizeof rb->listen, "%s", cfg->dc->listen ? cfg->dc->listen : "127.0.0.1:0");
    if (start_span(rb, cfg->start, err, errlen) != 0) {
        free(rb);
        return NULL;
    }
    uv_timer_init(loop, &rb->timer);
    rb->timer.data = rb;
    if (rb->cfg.every_s > 0)
        schedule(rb, rb->cfg.every_s);
    return rb;
}

void route_rebalance_stop(route_rebalance *rb)
{
    if (!rb || rb->stopping)
        return;
    rb->stopping = 1;
    uv_timer_stop(&rb->timer);
    route_swarm_destroy(&rb->sw);
    if (rb->daemon) {
        peer_daemon_stop(rb->daemon, on_daemon_stopped, rb);
        peer_daemon_destroy(&rb->daemon); /* freed once stopped */
    }
    /* else: a move is under way; on_moved sees `stopping` */
}

void route_rebalance_destroy(route_rebalance **p)
{
    route_rebalance *rb = p ? *p : NULL;
    if (!rb)
        return;
    *p = NULL;
    if (rb->stopped) {
        free(rb);
        return;
    }
    rb->destroy_pending = 1;
    route_rebalance_stop(rb); /* nothing when already stopping */
}
