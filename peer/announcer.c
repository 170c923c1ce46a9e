/* peer/announcer.c: keeps this peer's announcements in the DHT: joining,
 * online and renewed, offline at stop, and the model's description
 * (peer/announcer.h). */
#include "peer/announcer.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "expert/model.h"
#include "peer/log.h"
#include "swarm/modeldesc.h"
#include "net/tensorfmt.h"

#define RETRY_MS 2000
#define OFFLINE_TTL_S 15.0

struct peer_announcer {
    peer_announcer_config cfg;
    char model[49];
    char addr[65];
    char device[33];
    peer_modeldesc desc;         /* the served model's description (json NULL: none) */
    uv_timer_t timer;            /* renewal */
    int online;                  /* renewing */
    int stopping;
    int put_failures_logged;
    uint64_t last_expiry;        /* announcements expire strictly later each time */
    int offline_puts;            /* offline announcements still in flight */
    void (*offline_done)(void *);
    void *offline_arg;
    int closing, closed, destroy_pending; /* stop called, timer closed, destroy called */
    void (*close_cb)(void *);
    void *close_arg;
};

#define say(an, ...) peer_log((an)->cfg.log, __VA_ARGS__)

static void on_timer(uv_timer_t *t);

static void on_put(dht *dh, int status, void *ud)
{
    (void)dh;
    peer_announcer *an = ud;
    if (status < 0 && !an->stopping) {
        if (!an->put_failures_logged)
            say(an, "announcement not stored (%s); retrying in 2 s", strerror(-status));
        an->put_failures_logged = 1;
        /* Retry soon rather than at the next period: until it is stored,
         * clients see an old state (or nothing). */
        uint64_t every = (uint64_t)(an->cfg.every_s * 1000);
        if (an->online && uv_timer_get_due_in(&an->timer) > RETRY_MS)
            uv_timer_start(&an->timer, on_timer, RETRY_MS, every);
    } else if (status >= 0) {
        an->put_failures_logged = 0;
    }
}

static void on_offline_put(dht *dh, int status, void *ud)
{
    (void)dh;
    (void)status;
    peer_announcer *an = ud;
    if (--an->offline_puts == 0 && an->offline_done)
        an->offline_done(an->offline_arg);
}

/* Announcements expire strictly later each time: a new state (joining ->
 * online -> offline) must never tie with or lose to the previous one, even
 * within a millisecond or with a shorter TTL. */
static uint64_t next_expiry(peer_announcer *an, peer_state state)
{
    double ttl = state == PEER_STATE_OFFLINE ? OFFLINE_TTL_S : an->cfg.ttl_s;
    uint64_t expiry = dht_now_ms() + (uint64_t)(ttl * 1000);
    if (expiry <= an->last_expiry)
        expiry = an->last_expiry + 1;
    an->last_expiry = expiry;
    return expiry;
}

/* Puts block i's announcement with the given state. Returns 1 when the put
 * started, else 0. */
static int announce_block(peer_announcer *an, int i, peer_state state, uint64_t expiry, dht_done_cb cb)
{
    uint8_t val[PEER_ANNOUNCE_MAX_BYTES], key[DHT_ID_LEN];
    peer_block_info info;
    if (peer_service_block_info(an->cfg.svc, i, &info) != 0)
        return 0;
    peer_announce a;
    memset(&a, 0, sizeof a);
    snprintf(a.block, sizeof a.block, "%s", info.name);
    snprintf(a.addr, sizeof a.addr, "%s", an->addr);
    a.state = state;
    a.stage_hash = info.stage_hash;
    a.weight_version = info.version;
    a.throughput = peer_batcher_train_throughput(&info.stats);
    a.load = (double)info.stats.queued_rows / (double)an->cfg.max_queue_rows;
    if (a.load > 1)
        a.load = 1;
    snprintf(a.device, sizeof a.device, "%s", an->device);
    snprintf(a.precision, sizeof a.precision, "%s", an->cfg.precision ? an->cfg.precision : "");
    a.time_ms = dht_now_ms();
    a.grads_refused = info.refused_requests + info.refused_steps;
    a.frozen_steps = info.frozen ? info.still_steps : 0;
    a.formats = peer_service_formats(an->cfg.svc);
    a.bytes_per_sample = peer_service_bytes_per_sample(an->cfg.svc);
    if (an->cfg.fill)
        an->cfg.fill(an->cfg.arg, i, &a);
    long n = peer_announce_encode(&a, val, sizeof val);
    if (n < 0)
        return 0;
    dht_id_of_bytes(key, info.name, strlen(info.name));
    return dht_put(an->cfg.dht, key, NULL, 0, val, (size_t)n, expiry, 1, cb, an) == 0;
}

/* Puts every block's announcement (and the model record) with the given
 * state. Returns the number of puts started. */
static int announce_all(peer_announcer *an, peer_state state, dht_done_cb cb)
{
    uint8_t val[PEER_ANNOUNCE_MAX_BYTES], key[DHT_ID_LEN];
    uint64_t now = dht_now_ms(), expiry = next_expiry(an, state);
    int started = 0;
    for (int i = 0; i < peer_service_n_blocks(an->cfg.svc); i++)
        started += announce_block(an, i, state, expiry, cb);
    if (state != PEER_STATE_OFFLINE) {
        peer_model_record m;
        memset(&m, 0, sizeof m);
        snprintf(m.model, sizeof m.model, "%s", an->model);
        m.n_stages = an->cfg.n_stages;
        m.has_desc = an->desc.json != NULL;
        memcpy(m.desc_hash, an->desc.hash, sizeof m.desc_hash);
        long n = peer_model_record_encode(&m, val, sizeof val);
        uint64_t expires = now + (uint64_t)(an->cfg.ttl_s * 1000);
        dht_id_of_bytes(key, PEER_MODELS_KEY, strlen(PEER_MODELS_KEY));
        if (n > 0 && dht_put(an->cfg.dht, key, NULL, 0, val, (size_t)n, expires, 1, cb, an) == 0)
            started++;
        /* The description lives as long as some peer serves the model. */
        started += peer_modeldesc_publish(an->cfg.dht, &an->desc, expires, cb, an);
    }
    return started;
}

/* Announces online; when the DHT refuses to start some puts (too busy),
 * tries again in 2 s instead of a whole period later. */
static void announce_online(peer_announcer *an)
{
    int want = peer_service_n_blocks(an->cfg.svc) + 1 + an->desc.n_chunks;
    if (announce_all(an, PEER_STATE_ONLINE, on_put) < want) {
        uint64_t every = (uint64_t)(an->cfg.every_s * 1000);
        uv_timer_start(&an->timer, on_timer, RETRY_MS, every);
    }
}

static void on_timer(uv_timer_t *t)
{
    peer_announcer *an = t->data;
    if (an->online && !an->stopping)
        announce_online(an);
}

peer_announcer *peer_announcer_create(const peer_announcer_config *cfg)
{
    if (!cfg || !cfg->loop || !cfg->dht || !cfg->svc || !cfg->model || !cfg->addr || !cfg->device ||
        cfg->max_queue_rows < 1 || !(cfg->every_s > 0) || !(cfg->ttl_s > 0))
        return NULL;
    peer_announcer *an = calloc(1, sizeof *an);
    if (!an)
        return NULL;
    an->cfg = *cfg;
    snprintf(an->model, sizeof an->model, "%s", cfg->model);
    snprintf(an->addr, sizeof an->addr, "%s", cfg->addr);
    snprintf(an->device, sizeof an->device, "%s", cfg->device);
    an->cfg.model = an->model;
    an->cfg.addr = an->addr;
    an->cfg.device = an->device;
    const struct expert_model_spec *spec = expert_model_find(cfg->model);
    int rc = spec ? peer_modeldesc_make(&an->desc, spec) : -ENOENT;
    if (rc != 0)
        say(an, "warning: model %s's description is not published (%s): peers and clients need its file",
            an->model, rc == -EFBIG ? "more than 64 chunks" : strerror(-rc));
    uv_timer_init(cfg->loop, &an->timer);
    an->timer.data = an;
    return an;
}

int peer_announcer_joining(peer_announcer *an, int block)
{
    if (!an || an->stopping)
        return 0;
    return announce_block(an, block, PEER_STATE_JOINING, next_expiry(an, PEER_STATE_JOINING), on_put);
}

void peer_announcer_go_online(peer_announcer *an)
{
    int n = peer_service_n_blocks(an->cfg.svc);
    char wf[64];
    if (peer_tensorfmt_mask_format(peer_service_formats(an->cfg.svc), wf, sizeof wf) < 0)
        wf[0] = '\0';
    say(an, "online: announcing %d block%s (tensor formats accepted: %s)", n, n == 1 ? "" : "s", wf);
    an->online = 1;
    uint64_t every = (uint64_t)(an->cfg.every_s * 1000);
    uv_timer_start(&an->timer, on_timer, every, every);
    announce_online(an);
}

int peer_announcer_leave(peer_announcer *an, int offline, void (*done)(void *arg), void *arg)
{
    if (!an || an->stopping)
        return 0;
    an->stopping = 1;
    uv_timer_stop(&an->timer);
    an->offline_done = done;
    an->offline_arg = arg;
    an->offline_puts = offline ? announce_all(an, PEER_STATE_OFFLINE, on_offline_put) : 0;
    return an->offline_puts;
}

static void release(peer_announcer *an)
{
    peer_modeldesc_clear(&an->desc);
    free(an);
}

static void on_closed(uv_handle_t *h)
{
    peer_announcer *an = h->data;
    void (*cb)(void *) = an->close_cb;
    void *arg = an->close_arg;
    an->closed = 1;
    if (an->destroy_pending)
        release(an);
    if (cb)
        cb(arg);
}

void peer_announcer_stop(peer_announcer *an, void (*cb)(void *arg), void *arg)
{
    if (!an || an->closing)
        return;
    an->stopping = 1;
    an->closing = 1;
    an->close_cb = cb;
    an->close_arg = arg;
    uv_close((uv_handle_t *)&an->timer, on_closed);
}

void peer_announcer_destroy(peer_announcer **p)
{
    peer_announcer *an = p ? *p : NULL;
    if (!an)
        return;
    *p = NULL;
    peer_announcer_stop(an, NULL, NULL);
    if (an->closed)
        release(an);
    else
        an->destroy_pending = 1;
}
