#include "peer/daemon.h"

#include <errno.h>
#include <inttypes.h>
#include <stddef.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "expert/block.h"
#include "expert/model.h"
#include <sodium.h>

#include "peer/announce.h"
#include "peer/averaging.h"
#include "peer/keeper.h"
#include "peer/log.h"
#include "peer/metrics.h"
#include "peer/statesync.h"
#include "peer/timeslice.h"
#include "peer/wire.h"

#define JOIN_RETRY_MS 5000
#define MAX_INITIAL 64
#define STOP_ANNOUNCE_WAIT_MS 3000

/* The block being joined: where its newest state is. The online holders
 * first (on_holders), then the keepers of cold copies (on_keepers). */
typedef struct sync_view {
    peer_announce cand[16];
    uint8_t ids[16][DHT_ID_LEN];
    int nc, found;
    uint64_t best;               /* newest online version */
    uint64_t prev;               /* what this node ID announced before it restarted (0: nothing) */
    uint8_t suspect[16];         /* holders whose claimed version is far above the others' */
    peer_keep_record keep[16];   /* cold copies, newest first */
    uint8_t kid[16][DHT_ID_LEN];
    int nk, next_keep;           /* copies found, the next one to try */
    uint8_t keep_suspect[16];    /* copies whose claimed version is far above the others' */
    uint64_t known;              /* the newest version known to have existed */
    uint64_t accept_max;         /* a downloaded state newer than this is refused: */
    uint64_t hold_max, keep_max; /*   from a holder, from a cold copy */
} sync_view;

struct peer_daemon {
    uv_loop_t *loop;
    dht_identity ident;
    uint8_t swarm_key[32];
    int has_swarm_key;
    char model[49];
    int n_stages;
    char device[33];
    char announce_addr[65];
    double announce_every_s, ttl_s, checkpoint_every_s;
    int max_queue_rows;
    FILE *log;
    dht_peer_addr initial[MAX_INITIAL];
    size_t n_initial;

    dht *dht;
    peer_service *svc;
    peer_allreduce_server *rounds; /* svc's averaging rounds (the service frees it) */
    peer_statesync_server *states; /* svc's state serving (likewise) */
    peer_metrics *metrics;
    uv_timer_t announce_timer, join_timer, ckpt_timer, stop_timer;
    double average_every_s;
    int optim_kind;
    peer_averaging *avg;         /* NULL: no averaging */
    int avg_running;             /* its stop callback is still to come */
    peer_keeper *keeper;         /* NULL: no cold copies */
    int keeper_running;
    int timers_open;

    int joined;
    int syncing;                 /* index of the block whose state is being fetched, or -1 */
    int sync_inflight;           /* a download's callback is still to come */
    sync_view view;
    uint64_t sync_expect;        /* the version a lost download would have kept (0: nothing at stake) */
    char sync_from[96];
    uint64_t lost_from[PEER_SERVICE_MAX_BLOCKS], lost_to[PEER_SERVICE_MAX_BLOCKS];
    int no_state_download;
    uint64_t sync_rng;
    double sync_t0;
    int put_failures_logged;
    uint64_t last_expiry;        /* announcements expire strictly later each time */
    int stopping;
    int offline_puts;            /* offline announcements still in flight */
    int stop_phase;              /* 1 announcing offline, 2 closing service, 3 closing the rest, 4 done */
    int ckpt_busy;
    uv_work_t ckpt_work;
    int ckpt_status;
    void (*stop_cb)(int, void *);
    void *stop_arg;
    void (*on_refused)(void *);
    void *refused_arg;
    int final_status;
};

#define say(d, ...) peer_log((d)->log, __VA_ARGS__)
static void maybe_free(peer_daemon *d);

/* ---- announcements ---- */

static void on_announce_timer(uv_timer_t *t);

static void on_put(dht *dh, int status, void *ud)
{
    (void)dh;
    peer_daemon *d = ud;
    if (status < 0 && !d->stopping) {
        if (!d->put_failures_logged)
            say(d, "announcement not stored (%s); retrying in 2 s", strerror(-status));
        d->put_failures_logged = 1;
        /* Retry soon rather than at the next period: until it is stored,
         * clients see an old state (or nothing). */
        uint64_t every = (uint64_t)(d->announce_every_s * 1000);
        if (d->joined && d->syncing < 0 && uv_timer_get_due_in(&d->announce_timer) > 2000)
            uv_timer_start(&d->announce_timer, on_announce_timer, 2000, every);
    } else if (status >= 0) {
        d->put_failures_logged = 0;
    }
}

static void continue_stop(peer_daemon *d);

static void on_offline_put(dht *dh, int status, void *ud)
{
    (void)dh;
    (void)status;
    peer_daemon *d = ud;
    if (--d->offline_puts == 0 && d->stop_phase == 1)
        continue_stop(d);
}

/* Announcements expire strictly later each time: a new state (joining ->
 * online -> offline) must never tie with or lose to the previous one, even
 * within a millisecond or with a shorter TTL. */
static uint64_t next_expiry(peer_daemon *d, peer_state state)
{
    double ttl = state == PEER_STATE_OFFLINE ? 15.0 : d->ttl_s;
    uint64_t expiry = dht_now_ms() + (uint64_t)(ttl * 1000);
    if (expiry <= d->last_expiry)
        expiry = d->last_expiry + 1;
    d->last_expiry = expiry;
    return expiry;
}

/* Puts block i's announcement with the given state. Returns 1 when the put
 * started, else 0. */
static int announce_block(peer_daemon *d, int i, peer_state state, uint64_t expiry, dht_done_cb cb)
{
    uint8_t val[PEER_ANNOUNCE_MAX_BYTES], key[DHT_ID_LEN];
    peer_block_info info;
    if (peer_service_block_info(d->svc, i, &info) != 0)
        return 0;
    peer_announce a;
    memset(&a, 0, sizeof a);
    snprintf(a.block, sizeof a.block, "%s", info.name);
    snprintf(a.addr, sizeof a.addr, "%s", d->announce_addr);
    a.state = state;
    a.stage_hash = info.stage_hash;
    a.weight_version = info.version;
    a.throughput = peer_batcher_train_throughput(&info.stats);
    a.load = (double)info.stats.queued_rows / (double)d->max_queue_rows;
    if (a.load > 1)
        a.load = 1;
    snprintf(a.device, sizeof a.device, "%s", d->device);
    a.time_ms = dht_now_ms();
    peer_averaging_stats as;
    peer_averaging_get_stats(d->avg, i, &as);
    a.avg_rounds = as.rounds;
    a.avg_group = as.group;
    a.avg_abandoned = as.abandoned;
    a.lost_from = d->lost_from[i];
    a.lost_to = d->lost_to[i];
    a.grads_refused = info.refused_requests + info.refused_steps;
    a.frozen_steps = info.frozen ? info.still_steps : 0;
    long n = peer_announce_encode(&a, val, sizeof val);
    if (n < 0)
        return 0;
    dht_id_of_bytes(key, info.name, strlen(info.name));
    return dht_put(d->dht, key, NULL, 0, val, (size_t)n, expiry, 1, cb, d) == 0;
}

/* Puts every block's announcement (and the model record) with the given
 * state. Returns the number of puts started. */
static int announce(peer_daemon *d, peer_state state, dht_done_cb cb)
{
    uint8_t val[PEER_ANNOUNCE_MAX_BYTES], key[DHT_ID_LEN];
    uint64_t now = dht_now_ms(), expiry = next_expiry(d, state);
    int started = 0;
    for (int i = 0; i < peer_service_n_blocks(d->svc); i++)
        started += announce_block(d, i, state, expiry, cb);
    if (state != PEER_STATE_OFFLINE) {
        peer_model_record m;
        memset(&m, 0, sizeof m);
        snprintf(m.model, sizeof m.model, "%s", d->model);
        m.n_stages = d->n_stages;
        long n = peer_model_record_encode(&m, val, sizeof val);
        dht_id_of_bytes(key, PEER_MODELS_KEY, strlen(PEER_MODELS_KEY));
        if (n > 0 && dht_put(d->dht, key, NULL, 0, val, (size_t)n, now + (uint64_t)(d->ttl_s * 1000), 1,
                             cb, d) == 0)
            started++;
    }
    return started;
}

/* Announces online; when the DHT refuses to start some puts (too busy),
 * tries again in 2 s instead of a whole period later. */
static void announce_online(peer_daemon *d)
{
    int want = peer_service_n_blocks(d->svc) + 1;
    if (announce(d, PEER_STATE_ONLINE, on_put) < want) {
        uint64_t every = (uint64_t)(d->announce_every_s * 1000);
        uv_timer_start(&d->announce_timer, on_announce_timer, 2000, every);
    }
}

static void on_announce_timer(uv_timer_t *t)
{
    peer_daemon *d = t->data;
    if (d->joined && !d->stopping)
        announce_online(d);
}

/* ---- newcomer state ---- */

static void go_online(peer_daemon *d)
{
    d->syncing = -1;
    say(d, "online: announcing %d block%s", peer_service_n_blocks(d->svc),
        peer_service_n_blocks(d->svc) == 1 ? "" : "s");
    uint64_t every = (uint64_t)(d->announce_every_s * 1000);
    uv_timer_start(&d->announce_timer, on_announce_timer, every, every);
    announce_online(d);
}

static void sync_next(peer_daemon *d);
static void note_lost(peer_daemon *d, int i, uint64_t from, uint64_t to, const char *why);
static int try_cold_copy(peer_daemon *d);
static void sync_settle(peer_daemon *d, const char *failed, int downloaded);

static void maybe_free(peer_daemon *d);

static void on_state(void *arg, int status, const uint8_t *buf, size_t len, uint64_t version)
{
    peer_daemon *d = arg;
    d->sync_inflight = 0;
    if (d->stopping) {
        maybe_free(d);
        return;
    }
    peer_block_info info;
    peer_service_block_info(d->svc, d->syncing, &info);
    const char *failed = NULL;
    int again = status != 0; /* another copy may still be had */
    struct expert_ckpt_info ci;
    if (status == 0 && expert_ckpt_peek(buf, len, &ci) == 0 && ci.version > version)
        version = ci.version; /* what would be installed */
    if (status == 0 && version > d->view.accept_max) {
        /* The donor announced a plausible version and served a far newer
         * one (or the holders' claims bound it): not a state to spread. */
        say(d, "%s: the state downloaded from %s has weight version %" PRIu64 ", far above what the holders "
            "claim (at most %" PRIu64 "); refused, keeping ours", info.name, d->sync_from, version,
            d->view.accept_max);
        failed = "the downloaded state was refused";
        again = 1;
    } else if (status == 0) {
        int rc = peer_service_install_state(d->svc, d->syncing, buf, len);
        if (rc == 0) {
            say(d, "%s: downloaded the current state (weight version %llu, %.1f MB in %.2f s) from %s", info.name,
                (unsigned long long)version, (double)len / 1e6, (double)uv_now(d->loop) / 1000.0 - d->sync_t0,
                d->sync_from);
            if (d->sync_expect > version)
                failed = "the newest copy in the swarm was older";
        } else {
            say(d, "%s: the state downloaded from %s was refused (%s); keeping ours", info.name, d->sync_from,
                rc == -ESTALE ? "it is the state of another stage or configuration" : strerror(-rc));
            failed = "the downloaded state was refused";
            again = 1;
        }
    } else {
        say(d, "%s: state download from %s failed (%s); keeping ours", info.name, d->sync_from,
            strerror(-status));
        failed = "the download failed";
    }
    /* A copy that could not be had: the next newest one. */
    if (again && try_cold_copy(d))
        return;
    sync_settle(d, failed, status == 0 && !again);
}

/* Says (and announces) that block i went back: this peer, or a keeper,
 * had a newer version than the one it serves from now on. */
static void note_lost(peer_daemon *d, int i, uint64_t from, uint64_t to, const char *why)
{
    peer_block_info info;
    peer_service_block_info(d->svc, i, &info);
    d->lost_from[i] = from;
    d->lost_to[i] = to;
    say(d, "%s: STATE LOST: weight version %" PRIu64 " existed, this peer serves version %" PRIu64 " (%s)",
        info.name, from, to, why);
}

/* Starts downloading block d->syncing (d->sync_from says from whom).
 * Returns 0, or a negative errno (said). */
static int start_download(peer_daemon *d, const uint8_t *id, const char *addr)
{
    peer_block_info info;
    peer_service_block_info(d->svc, d->syncing, &info);
    d->sync_t0 = (double)uv_now(d->loop) / 1000.0;
    int rc = peer_statesync_start(d->loop, &d->ident, d->has_swarm_key ? d->swarm_key : NULL, id, addr,
                                  info.name, 30.0, on_state, d);
    if (rc == 0)
        d->sync_inflight = 1;
    else
        say(d, "%s: cannot start the state download from %s (%s)", info.name, d->sync_from, strerror(-rc));
    return rc;
}

/* Downloads block d->syncing from the next cold copy newer than ours.
 * Returns 1 when a download started. */
static int try_cold_copy(peer_daemon *d)
{
    sync_view *v = &d->view;
    peer_block_info info;
    peer_service_block_info(d->svc, d->syncing, &info);
    while (v->next_keep < v->nk && v->keep[v->next_keep].weight_version > info.version) {
        int k = v->next_keep++;
        if (v->keep_suspect[k])
            continue;
        char hex[DHT_ID_HEX_LEN + 1];
        dht_id_to_hex(hex, v->kid[k]);
        snprintf(d->sync_from, sizeof d->sync_from, "a cold copy kept by %.8s", hex);
        v->accept_max = v->keep_max;
        d->sync_expect = v->known;
        if (start_download(d, v->kid[k], v->keep[k].addr) == 0)
            return 1;
    }
    return 0;
}

/* Nothing (more) to download for block d->syncing: say where it starts
 * from, and whether that loses a newer version. */
static void sync_settle(peer_daemon *d, const char *failed, int downloaded)
{
    sync_view *v = &d->view;
    peer_block_info info;
    peer_service_block_info(d->svc, d->syncing, &info);
    if (!v->found && !failed && !downloaded)
        say(d, "%s: no other holder; starting from our %s (weight version %" PRIu64 ")", info.name,
            info.restored ? "checkpoint" : "initial weights", info.version);
    if (d->sync_expect > info.version)
        note_lost(d, d->syncing, d->sync_expect, info.version, failed ? failed
                  : info.restored ? "the checkpoint is older and no newer copy is in the swarm"
                                  : "no checkpoint and no copy in the swarm");
    sync_next(d);
}

static int cmp_keep(const void *a, const void *b)
{
    uint64_t x = ((const peer_keep_record *)a)->weight_version, y = ((const peer_keep_record *)b)->weight_version;
    return x < y ? 1 : x > y ? -1 : 0;
}

/* Logs that a holder's (or keeper's) claim i of v[0..n) was ignored. */
static void say_ignored(peer_daemon *d, const char *block, const char *what, const uint8_t *id,
                        const uint64_t *v, int n, int i)
{
    char hex[DHT_ID_HEX_LEN + 1];
    dht_id_to_hex(hex, id);
    int others = 0;
    for (int j = 0; j < n; j++)
        others += j != i && v[j] > 0;
    say(d, "%s: ignored %s %.8s: it claims weight version %" PRIu64 ", far above the %d other%s (median %" PRIu64
        ")", block, what, hex, v[i], others, others == 1 ? "" : "s", peer_trust_median_u64(v, n, i));
}

static void on_keepers(dht *dh, int status, const dht_entry *e, size_t n, void *ud)
{
    (void)dh;
    peer_daemon *d = ud;
    if (d->stopping)
        return;
    sync_view *v = &d->view;
    peer_block_info info;
    peer_service_block_info(d->svc, d->syncing, &info);
    /* The copies, newest first (IDs sorted along through an index). */
    struct {
        peer_keep_record r;
        uint8_t id[DHT_ID_LEN];
    } kk[16];
    int nk = 0;
    for (size_t i = 0; status == 0 && i < n && nk < 16; i++) {
        if (!e[i].is_signed || e[i].subkey_len != DHT_ID_LEN || !memcmp(e[i].subkey, d->ident.id, DHT_ID_LEN) ||
            peer_keep_record_decode(&kk[nk].r, e[i].value, e[i].value_len) != 0 || kk[nk].r.weight_version == 0)
            continue;
        memcpy(kk[nk].id, e[i].subkey, DHT_ID_LEN);
        nk++;
    }
    qsort(kk, (size_t)nk, sizeof kk[0], cmp_keep); /* the record is the first field */
    v->nk = nk;
    v->next_keep = 0;
    uint64_t kv[16];
    for (int i = 0; i < nk; i++) {
        v->keep[i] = kk[i].r;
        memcpy(v->kid[i], kk[i].id, DHT_ID_LEN);
        kv[i] = kk[i].r.weight_version;
    }
    /* A copy's version is its keeper's word: checked against the other
     * copies like the holders' (peer_statesync_choose). */
    v->keep_max = peer_statesync_choose(kv, nk, v->keep_suspect);
    uint64_t cold = 0;
    for (int i = 0; i < nk; i++) {
        if (v->keep_suspect[i])
            say_ignored(d, info.name, "cold copy kept by", v->kid[i], kv, nk, i);
        else if (kv[i] > cold)
            cold = kv[i];
    }
    /* The newest state known to have existed: our own before a restart,
     * and the copies when no holder is online (a holder supersedes them). */
    v->known = v->prev;
    if (!v->found && cold > v->known)
        v->known = cold;
    d->sync_expect = 0;
    int fresh = !info.restored && info.version == 0;
    int pick = -1, seen = 0;
    for (int i = 0; i < v->nc; i++) {
        if (v->suspect[i] || v->cand[i].weight_version + 1 < v->best)
            continue;
        d->sync_rng = d->sync_rng * 6364136223846793005ULL + 1442695040888963407ULL;
        if ((int)((d->sync_rng >> 33) % (uint64_t)(++seen)) == 0)
            pick = i;
    }
    if (d->no_state_download) {
        if (!v->found)
            d->sync_expect = v->known;
        sync_settle(d, d->sync_expect > info.version ? "--no-state-download" : NULL, 0);
        return;
    }
    /* Online holders first: they are at least as new as any copy of them,
     * and a copy's claimed version is only its keeper's word. */
    if (pick >= 0 && (v->best > info.version || fresh)) {
        snprintf(d->sync_from, sizeof d->sync_from, "an online holder");
        v->accept_max = v->hold_max;
        if (start_download(d, v->ids[pick], v->cand[pick].addr) == 0)
            return;
    }
    if (!v->found && try_cold_copy(d))
        return;
    if (!v->found)
        d->sync_expect = v->known;
    sync_settle(d, NULL, 0);
}

static void on_holders(dht *dh, int status, const dht_entry *e, size_t n, void *ud)
{
    (void)dh;
    peer_daemon *d = ud;
    if (d->stopping)
        return;
    peer_block_info info;
    peer_service_block_info(d->svc, d->syncing, &info);
    sync_view *v = &d->view;
    memset(v, 0, sizeof *v);
    for (size_t i = 0; status == 0 && i < n; i++) {
        peer_announce a;
        if (!e[i].is_signed || e[i].subkey_len != DHT_ID_LEN ||
            peer_announce_decode(&a, e[i].value, e[i].value_len) != 0 || a.stage_hash != info.stage_hash ||
            strcmp(a.block, info.name) != 0)
            continue;
        if (!memcmp(e[i].subkey, d->ident.id, DHT_ID_LEN)) {
            /* Our own entry from before a restart (it outlives a crash by
             * up to a TTL): the version we had. */
            if (a.state != PEER_STATE_JOINING)
                v->prev = a.weight_version;
            continue;
        }
        if (a.state != PEER_STATE_ONLINE)
            continue;
        v->found = 1;
        if (v->nc < 16) {
            v->cand[v->nc] = a;
            memcpy(v->ids[v->nc], e[i].subkey, DHT_ID_LEN);
            v->nc++;
        }
    }
    /* One holder's version claim is not trusted on its own word: a claim
     * far above the other holders' is ignored (peer_statesync_choose), so
     * a holder announcing version 10^9 does not become every newcomer's
     * donor. The newest trusted claim is the one to download. */
    uint64_t hv[16];
    for (int i = 0; i < v->nc; i++)
        hv[i] = v->cand[i].weight_version;
    v->hold_max = peer_statesync_choose(hv, v->nc, v->suspect);
    for (int i = 0; i < v->nc; i++) {
        if (v->suspect[i])
            say_ignored(d, info.name, "holder", v->ids[i], hv, v->nc, i);
        else if (hv[i] > v->best)
            v->best = hv[i];
    }
    /* Only now, with our previous entry read, does the joining one replace
     * it. */
    announce_block(d, d->syncing, PEER_STATE_JOINING, next_expiry(d, PEER_STATE_JOINING), on_put);
    uint8_t key[DHT_ID_LEN];
    peer_keep_key(key, info.name, info.stage_hash);
    if (dht_get(d->dht, key, on_keepers, d) != 0)
        on_keepers(d->dht, -EAGAIN, NULL, 0, d);
}

static void sync_next(peer_daemon *d)
{
    if (d->stopping)
        return;
    for (;;) {
        if (++d->syncing >= peer_service_n_blocks(d->svc)) {
            go_online(d);
            return;
        }
        peer_block_info info;
        uint8_t key[DHT_ID_LEN];
        peer_service_block_info(d->svc, d->syncing, &info);
        dht_id_of_bytes(key, info.name, strlen(info.name));
        if (dht_get(d->dht, key, on_holders, d) == 0)
            return;
        say(d, "%s: cannot look up holders; keeping ours", info.name);
    }
}

/* ---- replica averaging (peer/averaging.h) ---- */

static int avg_ready(void *arg)
{
    peer_daemon *d = arg;
    /* Only once online (not while fetching state). */
    return d->joined && d->syncing < 0 && !d->sync_inflight;
}

static void on_avg_stopped(void *arg)
{
    peer_daemon *d = arg;
    d->avg_running = 0;
    if (d->stop_phase == 2)
        continue_stop(d);
}

/* The keeper may still be finishing a copy's download (statesync cannot
 * be cancelled) while the rest stops: only the daemon's memory waits for
 * it, not the final checkpoints. */
static void on_keeper_stopped(void *arg)
{
    peer_daemon *d = arg;
    d->keeper_running = 0;
    maybe_free(d);
}

/* ---- joining ---- */

static void start_join(peer_daemon *d);

static void on_join_timer(uv_timer_t *t)
{
    peer_daemon *d = t->data;
    if (!d->stopping)
        start_join(d);
}

static void on_join(dht *dh, int status, void *ud)
{
    peer_daemon *d = ud;
    if (d->stopping)
        return;
    if (status == -EADDRINUSE) {
        /* Another process runs with our identity file (it proved our node
         * ID from another address): two peers with one ID would displace
         * each other in routing tables and announcements. Refuse: no
         * retry; the owner stops us (peer_daemon_config.on_refused). */
        char hex[DHT_ID_HEX_LEN + 1], at[DHT_ADDR_STRLEN];
        dht_id_to_hex(hex, dht_self_id(dh));
        if (dht_collision_addr(dh, at, sizeof at) < 0)
            snprintf(at, sizeof at, "another address");
        say(d, "another peer is online with this identity (node ID %s) at %s; refusing to start: "
               "use another --identity", hex, at);
        if (d->on_refused)
            d->on_refused(d->refused_arg);
        else
            peer_daemon_stop(d, NULL, NULL);
        return;
    }
    if (status == -EADDRNOTAVAIL || status == -EKEYREJECTED) {
        /* The initial peer answered: say what is wrong, not "unreachable". */
        char why[256];
        dht_join_strerror(dh, status, why, sizeof why);
        say(d, "%s: check %s; retrying in %d s", why,
            status == -EADDRNOTAVAIL ? "the node ID in --initial-peers" : "--swarm-key", JOIN_RETRY_MS / 1000);
        uv_timer_start(&d->join_timer, on_join_timer, JOIN_RETRY_MS, 0);
        return;
    }
    if (status < 0) {
        say(d, "cannot reach any initial peer (%s); retrying in %d s", strerror(-status),
            JOIN_RETRY_MS / 1000);
        uv_timer_start(&d->join_timer, on_join_timer, JOIN_RETRY_MS, 0);
        return;
    }
    d->joined = 1;
    say(d, "joined the swarm; fetching the current state of %d block%s from holders",
        peer_service_n_blocks(d->svc), peer_service_n_blocks(d->svc) == 1 ? "" : "s");
    /* Each block is announced joining once its holders are read
     * (on_holders), so that a restarted peer still finds its own entry
     * from before, with the version it had. */
    d->syncing = -1;
    sync_next(d);
}

static void start_join(peer_daemon *d)
{
    int rc = dht_join(d->dht, d->initial, d->n_initial, on_join, d);
    if (rc != 0) {
        say(d, "join failed to start (%s); retrying", strerror(-rc));
        uv_timer_start(&d->join_timer, on_join_timer, JOIN_RETRY_MS, 0);
    }
}

/* ---- checkpoints ---- */

static void ckpt_work_cb(uv_work_t *w)
{
    peer_daemon *d = w->data;
    /* libuv's pool threads start at the first queued work and inherit the
     * loop thread's time slice (10 ms under --training-priority idle): give
     * this one the kernel's default, as the compute threads have. */
    (void)peer_sched_set_slice(0);
    d->ckpt_status = peer_service_checkpoint(d->svc);
}

static void ckpt_after_cb(uv_work_t *w, int status)
{
    peer_daemon *d = w->data;
    (void)status;
    d->ckpt_busy = 0;
    if (d->ckpt_status != 0)
        say(d, "checkpoint failed: %s", strerror(-d->ckpt_status));
    if (d->stopping && d->stop_phase == 2)
        continue_stop(d);
}

static void on_ckpt_timer(uv_timer_t *t)
{
    peer_daemon *d = t->data;
    if (d->ckpt_busy || d->stopping)
        return;
    d->ckpt_busy = 1;
    d->ckpt_work.data = d;
    if (uv_queue_work(d->loop, &d->ckpt_work, ckpt_work_cb, ckpt_after_cb) != 0)
        d->ckpt_busy = 0;
}

/* ---- metrics ---- */

/* Appends to buf[off..cap) (the render callbacks' buf, cap, off). */
#define EMIT(...)                                                                       \
    do {                                                                                \
        int n_ = snprintf(buf + off, cap > off ? cap - off : 0, __VA_ARGS__);           \
        if (n_ > 0)                                                                     \
            off = off + (size_t)n_ < cap ? off + (size_t)n_ : cap;                      \
    } while (0)

/* One per-block averaging counter family with two results, each a
 * uint64_t field of peer_averaging_stats (by offset), appended at off.
 * Returns the new offset (at most cap). */
static size_t emit_avg_family(peer_daemon *d, char *buf, size_t cap, size_t off, const char *name,
                              const char *help, const char *res_a, size_t field_a, const char *res_b,
                              size_t field_b)
{
    EMIT("# HELP %s %s\n# TYPE %s counter\n", name, help, name);
    int nb = peer_service_n_blocks(d->svc);
    for (int i = 0; i < nb; i++) {
        peer_block_info info;
        if (peer_service_block_info(d->svc, i, &info) != 0)
            continue;
        peer_averaging_stats as;
        peer_averaging_get_stats(d->avg, i, &as);
        uint64_t a, b;
        memcpy(&a, (const char *)&as + field_a, sizeof a);
        memcpy(&b, (const char *)&as + field_b, sizeof b);
        EMIT("%s{block=\"%s\",result=\"%s\"} %" PRIu64 "\n%s{block=\"%s\",result=\"%s\"} %" PRIu64 "\n", name,
             info.name, res_a, a, name, info.name, res_b, b);
    }
    return off;
}

static size_t render_metrics(char *buf, size_t cap, void *arg)
{
    peer_daemon *d = arg;
    size_t off = 0;
    EMIT("# HELP starling_up 1 while the peer serves.\n# TYPE starling_up gauge\nstarling_up 1\n");
    static const char *kinds[4] = {"", "inference", "forward", "backward"};
    EMIT("# HELP starling_requests_total Requests served, by block and kind.\n"
         "# TYPE starling_requests_total counter\n");
    int nb = peer_service_n_blocks(d->svc);
    peer_block_info info;
    for (int i = 0; i < nb; i++) {
        if (peer_service_block_info(d->svc, i, &info) != 0)
            continue;
        for (int k = 1; k <= 3; k++)
            EMIT("starling_requests_total{block=\"%s\",kind=\"%s\"} %" PRIu64 "\n", info.name, kinds[k],
                 info.stats.tasks[k]);
    }
    EMIT("# HELP starling_samples_total Rows (samples) computed, by block and kind.\n"
         "# TYPE starling_samples_total counter\n");
    for (int i = 0; i < nb; i++) {
        if (peer_service_block_info(d->svc, i, &info) != 0)
            continue;
        for (int k = 1; k <= 3; k++)
            EMIT("starling_samples_total{block=\"%s\",kind=\"%s\"} %" PRIu64 "\n", info.name, kinds[k],
                 info.stats.rows[k]);
    }
    struct {
        const char *name, *type, *help;
    } per_block[] = {
        {"starling_batches_total", "counter", "Joined batches computed."},
        {"starling_batch_rows_avg", "gauge", "Average rows per joined batch."},
        {"starling_queue_rows", "gauge", "Rows waiting in the queue."},
        {"starling_rejected_total", "counter", "Requests refused because the queue was full."},
        {"starling_errors_total", "counter", "Requests that failed in compute."},
        {"starling_steps_total", "counter", "Optimizer steps applied."},
        {"starling_weight_version", "gauge", "Current weight version."},
        {"starling_throughput_samples_per_second", "gauge", "Measured training throughput."},
        {"starling_backward_kept_samples_total", "counter",
         "Backward rows computed from kept forward activations (no recompute)."},
        {"starling_backward_recomputed_samples_total", "counter",
         "Backward rows that recomputed their forward (with --keep-activations > 0)."},
    };
    for (size_t m = 0; m < sizeof per_block / sizeof per_block[0]; m++) {
        EMIT("# HELP %s %s\n# TYPE %s %s\n", per_block[m].name, per_block[m].help, per_block[m].name,
             per_block[m].type);
        for (int i = 0; i < nb; i++) {
            if (peer_service_block_info(d->svc, i, &info) != 0)
                continue;
            const peer_batcher_stats *s = &info.stats;
            uint64_t rows = s->rows[1] + s->rows[2] + s->rows[3];
            double v = 0;
            switch (m) {
            case 0: v = (double)s->batches; break;
            case 1: v = s->batches ? (double)rows / (double)s->batches : 0; break;
            case 2: v = s->queued_rows; break;
            case 3: v = (double)s->rejected; break;
            case 4: v = (double)s->errors; break;
            case 5: v = (double)s->steps; break;
            case 6: v = (double)info.version; break;
            case 7: v = peer_batcher_train_throughput(s); break;
            case 8: v = (double)s->kept_hits; break;
            default: v = (double)s->kept_misses; break;
            }
            EMIT("%s{block=\"%s\"} %.6g\n", per_block[m].name, info.name, v);
        }
    }
    /* Training integrity (peer/service.h, "Gradient checks"). */
    EMIT("# HELP starling_gradients_refused_total Gradients refused by the training-integrity checks, by "
         "block and kind (request: a backward answered ERANGE before it was queued; step: an optimizer "
         "step dropped).\n# TYPE starling_gradients_refused_total counter\n");
    for (int i = 0; i < nb; i++) {
        if (peer_service_block_info(d->svc, i, &info) != 0)
            continue;
        EMIT("starling_gradients_refused_total{block=\"%s\",kind=\"request\"} %" PRIu64 "\n"
             "starling_gradients_refused_total{block=\"%s\",kind=\"step\"} %" PRIu64 "\n",
             info.name, info.refused_requests, info.name, info.refused_steps);
    }
    EMIT("# HELP starling_weights_frozen 1 while the block's latest --frozen-steps optimizer steps applied "
         "gradients but changed no weight.\n# TYPE starling_weights_frozen gauge\n");
    for (int i = 0; i < nb; i++)
        if (peer_service_block_info(d->svc, i, &info) == 0)
            EMIT("starling_weights_frozen{block=\"%s\"} %d\n", info.name, info.frozen ? 1 : 0);
    EMIT("# HELP starling_weights_still_steps Consecutive latest optimizer steps that changed no weight.\n"
         "# TYPE starling_weights_still_steps gauge\n");
    for (int i = 0; i < nb; i++)
        if (peer_service_block_info(d->svc, i, &info) == 0)
            EMIT("starling_weights_still_steps{block=\"%s\"} %" PRIu64 "\n", info.name, info.still_steps);
    if (d->avg) {
        off = emit_avg_family(d, buf, cap, off, "starling_avg_rounds_total",
                              "Replica averaging rounds, by block and result (abandoned: weights unchanged).",
                              "completed", offsetof(peer_averaging_stats, rounds), "abandoned",
                              offsetof(peer_averaging_stats, abandoned));
        off = emit_avg_family(d, buf, cap, off, "starling_avg_contributions_total",
                              "Other members' contributions to averaging rounds the robust reduce did not take "
                              "as sent (dropped: non-finite, or a reduced part far from the others'; clipped: "
                              "pulled in toward the group's median).",
                              "dropped", offsetof(peer_averaging_stats, dropped), "clipped",
                              offsetof(peer_averaging_stats, clipped));
    }
    /* The tensor RPC server and its limits (docs/rpc.md, "Limits"). */
    peer_rpc_server_stats rs;
    peer_service_rpc_stats(d->svc, &rs);
    EMIT("# HELP starling_rpc_connections Tensor RPC connections open.\n"
         "# TYPE starling_rpc_connections gauge\nstarling_rpc_connections %" PRIu64 "\n"
         "# HELP starling_rpc_connections_total Tensor RPC connections accepted.\n"
         "# TYPE starling_rpc_connections_total counter\nstarling_rpc_connections_total %" PRIu64 "\n"
         "# HELP starling_rpc_handshakes_failed_total Handshakes refused, failed or timed out.\n"
         "# TYPE starling_rpc_handshakes_failed_total counter\n"
         "starling_rpc_handshakes_failed_total %" PRIu64 "\n",
         rs.conns_open, rs.conns_accepted, rs.handshakes_failed);
    EMIT("# HELP starling_rpc_refused_total Connections closed at accept by the limits, by reason "
         "(per_ip: --max-conns-per-ip; full: --max-conns; handshakes: too many unfinished handshakes).\n"
         "# TYPE starling_rpc_refused_total counter\n"
         "starling_rpc_refused_total{reason=\"per_ip\"} %" PRIu64 "\n"
         "starling_rpc_refused_total{reason=\"full\"} %" PRIu64 "\n"
         "starling_rpc_refused_total{reason=\"handshakes\"} %" PRIu64 "\n",
         rs.refused_per_ip, rs.refused_full, rs.refused_handshakes);
    EMIT("# HELP starling_rpc_closed_total Connections closed by the limits, by reason "
         "(handshake_timeout; idle: --idle-timeout; evicted: to make room for another address; drain: "
         "replies not read; record_timeout: a record not sent whole in time).\n"
         "# TYPE starling_rpc_closed_total counter\n"
         "starling_rpc_closed_total{reason=\"handshake_timeout\"} %" PRIu64 "\n"
         "starling_rpc_closed_total{reason=\"idle\"} %" PRIu64 "\n"
         "starling_rpc_closed_total{reason=\"evicted\"} %" PRIu64 "\n"
         "starling_rpc_closed_total{reason=\"drain\"} %" PRIu64 "\n"
         "starling_rpc_closed_total{reason=\"record_timeout\"} %" PRIu64 "\n",
         rs.closed_hs_timeout, rs.closed_idle, rs.evicted, rs.closed_drain, rs.closed_record_timeout);
    EMIT("# HELP starling_rpc_bad_frames_total Frames answered with an error, by reason (malformed: not a "
         "usable request, connection kept; oversize: over the frame limit, connection closed).\n"
         "# TYPE starling_rpc_bad_frames_total counter\n"
         "starling_rpc_bad_frames_total{reason=\"malformed\"} %" PRIu64 "\n"
         "starling_rpc_bad_frames_total{reason=\"oversize\"} %" PRIu64 "\n"
         "# HELP starling_rpc_record_waits_total Records that waited for the budget of records being "
         "received.\n# TYPE starling_rpc_record_waits_total counter\n"
         "starling_rpc_record_waits_total %" PRIu64 "\n",
         rs.bad_frames, rs.oversize_frames, rs.record_waits);
    EMIT("# HELP starling_rpc_handshaking Connections in the handshake.\n"
         "# TYPE starling_rpc_handshaking gauge\nstarling_rpc_handshaking %" PRIu64 "\n"
         "# HELP starling_rpc_incomplete_bytes Bytes charged to records being received.\n"
         "# TYPE starling_rpc_incomplete_bytes gauge\nstarling_rpc_incomplete_bytes %" PRIu64 "\n"
         "# HELP starling_rpc_incomplete_bytes_max High-water mark of starling_rpc_incomplete_bytes.\n"
         "# TYPE starling_rpc_incomplete_bytes_max gauge\nstarling_rpc_incomplete_bytes_max %" PRIu64 "\n"
         "# HELP starling_rpc_queued_bytes Reply bytes handed to the sockets and not yet written.\n"
         "# TYPE starling_rpc_queued_bytes gauge\nstarling_rpc_queued_bytes %" PRIu64 "\n"
         "# HELP starling_rpc_queued_bytes_max High-water mark of starling_rpc_queued_bytes.\n"
         "# TYPE starling_rpc_queued_bytes_max gauge\nstarling_rpc_queued_bytes_max %" PRIu64 "\n",
         rs.handshaking, rs.incomplete_bytes, rs.incomplete_bytes_max, rs.queued_bytes, rs.queued_bytes_max);
    /* This endpoint's own limits (peer/metrics.h). */
    peer_metrics_stats ms = {0};
    if (d->metrics)
        peer_metrics_stats_get(d->metrics, &ms);
    EMIT("# HELP starling_metrics_endpoint_refused_total Metrics connections closed at accept, by reason "
         "(per_ip: 8 per address; full: 64 in all, no address to take one from).\n"
         "# TYPE starling_metrics_endpoint_refused_total counter\n"
         "starling_metrics_endpoint_refused_total{reason=\"per_ip\"} %" PRIu64 "\n"
         "starling_metrics_endpoint_refused_total{reason=\"full\"} %" PRIu64 "\n"
         "# HELP starling_metrics_endpoint_closed_total Metrics connections closed early, by reason "
         "(evicted: to make room for another address; timeout: the exchange took over 5 s).\n"
         "# TYPE starling_metrics_endpoint_closed_total counter\n"
         "starling_metrics_endpoint_closed_total{reason=\"evicted\"} %" PRIu64 "\n"
         "starling_metrics_endpoint_closed_total{reason=\"timeout\"} %" PRIu64 "\n",
         ms.refused_per_ip, ms.refused_full, ms.evicted, ms.timed_out);
    dht_node_stats ds;
    dht_get_stats(d->dht, &ds);
    EMIT("# HELP starling_dht_datagrams_total DHT datagrams, by direction.\n"
         "# TYPE starling_dht_datagrams_total counter\n"
         "starling_dht_datagrams_total{dir=\"rx\"} %" PRIu64 "\n"
         "starling_dht_datagrams_total{dir=\"tx\"} %" PRIu64 "\n",
         ds.rx, ds.tx);
    EMIT("# HELP starling_dht_bytes_total DHT bytes, by direction.\n"
         "# TYPE starling_dht_bytes_total counter\n"
         "starling_dht_bytes_total{dir=\"rx\"} %" PRIu64 "\n"
         "starling_dht_bytes_total{dir=\"tx\"} %" PRIu64 "\n",
         ds.rx_bytes, ds.tx_bytes);
    EMIT("# HELP starling_dht_dropped_total DHT datagrams dropped, by reason.\n"
         "# TYPE starling_dht_dropped_total counter\n"
         "starling_dht_dropped_total{reason=\"malformed\"} %" PRIu64 "\n"
         "starling_dht_dropped_total{reason=\"swarm_tag\"} %" PRIu64 "\n"
         "starling_dht_dropped_total{reason=\"rate\"} %" PRIu64 "\n",
         ds.drop_malformed, ds.drop_tag, ds.drop_rate);
    EMIT("# HELP starling_dht_refused_total Nodes kept out by the DHT's per-network limits (--dht-limits), "
         "by where (table: proven nodes not added to the routing table; lookup: lookup candidates "
         "dropped).\n# TYPE starling_dht_refused_total counter\n"
         "starling_dht_refused_total{where=\"table\"} %" PRIu64 "\n"
         "starling_dht_refused_total{where=\"lookup\"} %" PRIu64 "\n",
         ds.table_refused, ds.lookup_refused);
#undef EMIT
    return off;
}

/* ---- start and stop ---- */

static void destroy_after_close(peer_service *s, int ckpt_status, void *arg)
{
    (void)ckpt_status;
    (void)arg;
    peer_service_destroy(&s);
}

static int split_host(const char *hostport, char *host, size_t cap)
{
    /* "[v6]:port" -> "v6" in brackets kept; "a.b.c.d:port" -> "a.b.c.d" */
    const char *colon = strrchr(hostport, ':');
    if (!colon || (size_t)(colon - hostport) >= cap)
        return -EINVAL;
    memcpy(host, hostport, (size_t)(colon - hostport));
    host[colon - hostport] = '\0';
    return 0;
}

static int is_wildcard(const char *host)
{
    return !strcmp(host, "0.0.0.0") || !strcmp(host, "[::]") || !strcmp(host, "::");
}

peer_daemon *peer_daemon_start(uv_loop_t *loop, const peer_daemon_config *cfg, char *err,
                               size_t errlen)
{
    char host[64];
    dht_addr bound;
    struct sockaddr_storage ss;
    if (!loop || !cfg || !cfg->ident || !cfg->listen || cfg->n_initial > MAX_INITIAL) {
        snprintf(err, errlen, "invalid daemon configuration");
        return NULL;
    }
    const struct expert_model_spec *spec = expert_model_find(cfg->svc.model);
    if (!spec) {
        snprintf(err, errlen, "unknown model '%s'", cfg->svc.model ? cfg->svc.model : "");
        return NULL;
    }
    if (split_host(cfg->listen, host, sizeof host) != 0) {
        snprintf(err, errlen, "--listen '%s' is not HOST:PORT", cfg->listen);
        return NULL;
    }
    if (!cfg->announce_host && is_wildcard(host)) {
        snprintf(err, errlen,
                 "--listen %s binds every interface: give --announce HOST with the address other "
                 "machines reach this one at", cfg->listen);
        return NULL;
    }
    peer_daemon *d = calloc(1, sizeof *d);
    if (!d) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    d->loop = loop;
    d->ident = *cfg->ident;
    if (cfg->swarm_key) {
        memcpy(d->swarm_key, cfg->swarm_key, 32);
        d->has_swarm_key = 1;
    }
    snprintf(d->model, sizeof d->model, "%s", spec->name);
    d->n_stages = spec->n_stages;
    snprintf(d->device, sizeof d->device, "%s", cfg->device ? cfg->device : "cpu");
    d->announce_every_s = cfg->announce_every_s > 0 ? cfg->announce_every_s : 20.0;
    d->ttl_s = cfg->ttl_s > 0 ? cfg->ttl_s : 60.0;
    d->checkpoint_every_s = cfg->checkpoint_every_s;
    d->max_queue_rows = cfg->svc.max_queue_rows > 0 ? cfg->svc.max_queue_rows : 1;
    d->syncing = -1;
    d->optim_kind = cfg->svc.optim.kind;
    d->average_every_s = cfg->average_every_s;
    d->no_state_download = cfg->no_state_download;
    d->sync_rng = (uint64_t)d->ident.id[0] << 8 | d->ident.id[1];
    d->log = cfg->log ? cfg->log : stderr;
    d->on_refused = cfg->on_refused;
    d->refused_arg = cfg->refused_arg;
    memcpy(d->initial, cfg->initial, cfg->n_initial * sizeof *cfg->initial);
    d->n_initial = cfg->n_initial;

    dht_config dc;
    dht_config_default(&dc);
    if (cfg->dht_diversity_given)
        dc.diversity = cfg->dht_diversity;
    if (d->has_swarm_key) {
        dc.has_swarm_key = 1;
        memcpy(dc.swarm_key, d->swarm_key, 32);
    }
    int rc;
    peer_service_config sc = cfg->svc;
    sc.log = d->log;
    sc.self = &d->ident;
    sc.swarm_key = cfg->swarm_key;
    d->svc = peer_service_create(loop, &sc, err, errlen);
    if (!d->svc)
        goto fail_dht;
    d->rounds = peer_allreduce_server_create(d->svc);
    d->states = peer_statesync_server_create(d->svc);
    if (!d->rounds || !d->states) {
        snprintf(err, errlen, "out of memory");
        goto fail_svc;
    }
    for (int i = 0; i < peer_service_n_blocks(d->svc); i++) {
        peer_block_info bi;
        if (peer_service_block_info(d->svc, i, &bi) == 0 && bi.restored)
            say(d, "restored %s from its checkpoint (weight version %llu)", bi.name,
                (unsigned long long)bi.version);
    }
    if (cfg->metrics_listen) {
        dht_addr ma;
        if (dht_addr_parse_listen(&ma, cfg->metrics_listen) != 0 ||
            dht_addr_to_sockaddr(&ma, &ss) < 0) {
            snprintf(err, errlen, "--metrics '%s' is not HOST:PORT", cfg->metrics_listen);
            goto fail_svc;
        }
        d->metrics = peer_metrics_start(loop, (const struct sockaddr *)&ss, render_metrics, d, &rc);
        if (!d->metrics) {
            snprintf(err, errlen, "cannot serve metrics on %s: %s", cfg->metrics_listen, strerror(-rc));
            goto fail_svc;
        }
        char mh[64];
        dht_addr_format(mh, sizeof mh, &ma);
        *strrchr(mh, ':') = '\0';
        say(d, "metrics on http://%s:%d/metrics", mh, peer_metrics_port(d->metrics));
    }
    /* The DHT (UDP) and the RPC (TCP) share one port. With port 0 the
     * kernel picks the UDP port, which TCP may already use for an outgoing
     * connection; so pick a port free for TCP first (a probe socket held
     * until the UDP bind succeeded), and try again if UDP has it taken. */
    dht_addr req;
    if (dht_addr_parse_listen(&req, cfg->listen) != 0) {
        snprintf(err, errlen, "--listen '%s' is not a numeric HOST:PORT", cfg->listen);
        goto fail_metrics_only;
    }
    for (int attempt = 0;; attempt++) {
        char lst[96];
        int probe = -1;
        if (req.port == 0) {
            struct sockaddr_storage ps;
            socklen_t plen = sizeof ps;
            int sl = dht_addr_to_sockaddr(&req, &ps);
            probe = sl > 0 ? socket(ps.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0) : -1;
            if (probe < 0 || bind(probe, (struct sockaddr *)&ps, (socklen_t)sl) != 0 ||
                getsockname(probe, (struct sockaddr *)&ps, &plen) != 0) {
                snprintf(err, errlen, "cannot listen on %s: %s", cfg->listen, strerror(errno));
                if (probe >= 0)
                    close(probe);
                goto fail_metrics_only;
            }
            dht_addr pa;
            dht_addr_from_sockaddr(&pa, (struct sockaddr *)&ps);
            dht_addr_format(lst, sizeof lst, &pa);
        } else {
            snprintf(lst, sizeof lst, "%s", cfg->listen);
        }
        d->dht = dht_create(loop, &d->ident, &dc);
        if (!d->dht) {
            snprintf(err, errlen, "cannot create the DHT node");
            if (probe >= 0)
                close(probe);
            goto fail_metrics_only;
        }
        rc = dht_start(d->dht, lst);
        if (rc == 0 && dht_local_addr(d->dht, &bound) == 0) {
            if (probe >= 0)
                close(probe);
            break;
        }
        dht_close(d->dht, NULL, NULL);
        d->dht = NULL;
        if (probe >= 0)
            close(probe);
        if (req.port != 0 || attempt >= 15) {
            snprintf(err, errlen, "cannot listen on %s (UDP): %s", lst, strerror(rc < 0 ? -rc : EINVAL));
            goto fail_metrics_only;
        }
    }
    const char *ahost = cfg->announce_host ? cfg->announce_host : host;
    if (strlen(ahost) > 48) {
        snprintf(err, errlen, "announce host '%.60s' is too long", ahost);
        goto fail_metrics;
    }
    snprintf(d->announce_addr, sizeof d->announce_addr, "%.48s:%u", ahost, (unsigned)bound.port);
    if (dht_addr_to_sockaddr(&bound, &ss) < 0 ||
        (rc = peer_service_listen(d->svc, (const struct sockaddr *)&ss)) != 0) {
        snprintf(err, errlen, "cannot listen on %s (TCP port %u): %s", cfg->listen, bound.port,
                 strerror(-rc));
        goto fail_metrics;
    }
    uv_timer_t *timers[] = {&d->announce_timer, &d->join_timer, &d->ckpt_timer, &d->stop_timer};
    for (size_t i = 0; i < 4; i++) {
        uv_timer_init(loop, timers[i]);
        timers[i]->data = d;
        d->timers_open++;
    }
    if (d->checkpoint_every_s > 0) {
        uint64_t ms = (uint64_t)(d->checkpoint_every_s * 1000);
        uv_timer_start(&d->ckpt_timer, on_ckpt_timer, ms, ms);
    }
    if (d->average_every_s > 0) {
        peer_averaging_config ac = {0};
        ac.loop = loop;
        ac.dht = d->dht;
        ac.self = &d->ident;
        ac.swarm_key = d->has_swarm_key ? d->swarm_key : NULL;
        ac.svc = d->svc;
        ac.rounds = d->rounds;
        ac.addr = d->announce_addr;
        ac.optim_kind = d->optim_kind;
        ac.every_s = d->average_every_s;
        ac.ready = avg_ready;
        ac.ready_arg = d;
        ac.log = d->log;
        if (!(d->avg = peer_averaging_start(&ac)))
            say(d, "cannot start replica averaging (out of memory); serving without it");
        d->avg_running = d->avg != NULL;
    }
    if (cfg->keep_every_s > 0) {
        peer_keeper_config kc = {0};
        kc.loop = loop;
        kc.dht = d->dht;
        kc.self = &d->ident;
        kc.swarm_key = d->has_swarm_key ? d->swarm_key : NULL;
        kc.svc = d->svc;
        kc.states = d->states;
        kc.model = d->model;
        kc.addr = d->announce_addr;
        kc.every_s = cfg->keep_every_s;
        kc.replicas = cfg->keep_copies > 0 ? cfg->keep_copies : 2;
        kc.max_bytes = cfg->keep_max_bytes ? cfg->keep_max_bytes : (size_t)2 << 30;
        kc.ready = avg_ready;
        kc.ready_arg = d;
        kc.log = d->log;
        char kerr[160];
        if (!(d->keeper = peer_keeper_start(&kc, kerr, sizeof kerr)))
            say(d, "%s; serving without cold copies", kerr);
        d->keeper_running = d->keeper != NULL;
    }
    if (d->n_initial > 0) {
        start_join(d);
    } else {
        /* The first node of a swarm: nothing to join or fetch. */
        d->joined = 1;
        go_online(d);
    }
    return d;

fail_metrics:
    /* A failed listen leaves handles open: close the service asynchronously
     * (it frees itself in the callback). */
    peer_metrics_stop(d->metrics); /* frees itself once its handles close */
    peer_service_close(d->svc, destroy_after_close, NULL);
    d->svc = NULL;
    goto fail_dht;
fail_metrics_only:
    peer_metrics_stop(d->metrics);
fail_svc:
    /* The service never listened, so it can be destroyed at once. */
    peer_service_destroy(&d->svc);
fail_dht:
    if (d->dht)
        dht_close(d->dht, NULL, NULL);
    free(d);
    return NULL;
}

dht *peer_daemon_dht(peer_daemon *d)
{
    return d ? d->dht : NULL;
}

int peer_daemon_peer_string(const peer_daemon *d, char *buf, size_t cap)
{
    dht_addr bound;
    char id[DHT_ID_HEX_LEN + 1];
    if (!d || dht_local_addr(d->dht, &bound) != 0)
        return -EINVAL;
    dht_id_to_hex(id, d->ident.id);
    int n = snprintf(buf, cap, "%s/%s", d->announce_addr, id);
    return n < 0 || (size_t)n >= cap ? -ENOSPC : n;
}

/* The daemon goes away once its timers are closed and no state download
 * can still call back into it. */
static void maybe_free(peer_daemon *d)
{
    if (d->timers_open > 0 || d->sync_inflight || d->avg_running || d->keeper_running || d->stop_phase < 4)
        return;
    peer_averaging_destroy(&d->avg);
    peer_keeper_destroy(&d->keeper);
    void (*cb)(int, void *) = d->stop_cb;
    void *arg = d->stop_arg;
    int status = d->final_status;
    free(d);
    if (cb)
        cb(status, arg);
}

static void on_timer_closed(uv_handle_t *h)
{
    peer_daemon *d = h->data;
    d->timers_open--;
    maybe_free(d);
}

static void on_dht_closed(dht *dh, void *ud)
{
    (void)dh;
    peer_daemon *d = ud;
    d->stop_phase = 4;
    uv_close((uv_handle_t *)&d->announce_timer, on_timer_closed);
    uv_close((uv_handle_t *)&d->join_timer, on_timer_closed);
    uv_close((uv_handle_t *)&d->ckpt_timer, on_timer_closed);
    uv_close((uv_handle_t *)&d->stop_timer, on_timer_closed);
}

static void on_svc_closed(peer_service *s, int ckpt_status, void *arg)
{
    (void)s;
    peer_daemon *d = arg;
    d->final_status = ckpt_status;
    if (ckpt_status != 0)
        say(d, "final checkpoint failed: %s", strerror(-ckpt_status));
    peer_service_destroy(&d->svc);
    peer_metrics_stop(d->metrics);
    d->metrics = NULL;
    d->stop_phase = 3;
    dht_close(d->dht, on_dht_closed, d);
    d->dht = NULL;
}

static void on_stop_timer(uv_timer_t *t)
{
    peer_daemon *d = t->data;
    if (d->stop_phase == 1)
        continue_stop(d); /* offline announcements took too long: go on */
}

static void continue_stop(peer_daemon *d)
{
    if (d->stop_phase == 1) {
        uv_timer_stop(&d->stop_timer);
        d->stop_phase = 2;
    }
    if (d->stop_phase == 2) {
        if (d->ckpt_busy || d->avg_running)
            return; /* ckpt_after_cb / on_avg_stopped call us again */
        d->stop_phase = 3;
        peer_service_close(d->svc, on_svc_closed, d);
    }
}

void peer_daemon_stop(peer_daemon *d, void (*cb)(int status, void *arg), void *arg)
{
    if (!d || d->stopping)
        return;
    d->stopping = 1;
    d->stop_cb = cb;
    d->stop_arg = arg;
    uv_timer_stop(&d->announce_timer);
    uv_timer_stop(&d->join_timer);
    uv_timer_stop(&d->ckpt_timer);
    /* Rounds in flight are abandoned while the service still stands. */
    if (d->avg_running)
        peer_averaging_stop(d->avg, on_avg_stopped, d);
    if (d->keeper_running)
        peer_keeper_stop(d->keeper, on_keeper_stopped, d);
    d->stop_phase = 1;
    d->offline_puts = d->joined ? announce(d, PEER_STATE_OFFLINE, on_offline_put) : 0;
    if (d->offline_puts == 0) {
        continue_stop(d);
        return;
    }
    uv_timer_start(&d->stop_timer, on_stop_timer, STOP_ANNOUNCE_WAIT_MS, 0);
}
