#include "peer/daemon.h"

#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "expert/model.h"
#include <sodium.h>

#include "peer/allreduce.h"
#include "peer/announce.h"
#include "peer/metrics.h"
#include "peer/statesync.h"
#include "peer/timeslice.h"
#include "peer/wire.h"

#define JOIN_RETRY_MS 5000
#define MAX_INITIAL 64
#define STOP_ANNOUNCE_WAIT_MS 3000

typedef struct avg_ctx {
    struct peer_daemon *d;
    int block;
    uint64_t round;
    int putting, getting;        /* matchmaking entry stored / group lookup in flight */
    int regets;                  /* group lookups repeated this round while alone */
    peer_allreduce *ar;          /* the round running, or NULL */
} avg_ctx;

/* A replica that finds no other entry looks again this many times while the
 * round lasts: the others' entries can be late (a put that meets dead
 * contacts waits a stale period per hop, more on a loaded machine). */
#define AVG_REGETS 3

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
    peer_metrics *metrics;
    uv_timer_t announce_timer, join_timer, ckpt_timer, stop_timer, avg_timer, avg_gather_timer;
    double average_every_s;
    int optim_kind;
    avg_ctx avg[PEER_SERVICE_MAX_BLOCKS];
    int avg_inflight;            /* all-reduce rounds whose callback is still to come */
    uint64_t avg_rounds[PEER_SERVICE_MAX_BLOCKS]; /* averaging rounds completed per block (announced) */
    int avg_group[PEER_SERVICE_MAX_BLOCKS];       /* size of the last completed round's group */
    int avg_alone[PEER_SERVICE_MAX_BLOCKS];       /* "alone" said since the last completed round */
    int timers_open;

    int joined;
    int syncing;                 /* index of the block whose state is being fetched, or -1 */
    int sync_inflight;           /* a download's callback is still to come */
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
    int final_status;
};

static void say(peer_daemon *d, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void maybe_free(peer_daemon *d);
static void on_avg_timer(uv_timer_t *t);
static void say(peer_daemon *d, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(d->log, "starling peer: ");
    vfprintf(d->log, fmt, ap);
    fputc('\n', d->log);
    fflush(d->log);
    va_end(ap);
}

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

/* Puts every block's announcement (and the model record) with the given
 * state. Returns the number of puts started. */
static int announce(peer_daemon *d, peer_state state, dht_done_cb cb)
{
    uint8_t val[PEER_ANNOUNCE_MAX_BYTES], key[DHT_ID_LEN];
    uint64_t now = dht_now_ms();
    double ttl = state == PEER_STATE_OFFLINE ? 15.0 : d->ttl_s;
    /* The DHT keeps the entry with the latest expiration: a new state
     * (joining -> online -> offline) must never tie with or lose to the
     * previous one, even within a millisecond or with a shorter TTL. */
    uint64_t expiry = now + (uint64_t)(ttl * 1000);
    if (expiry <= d->last_expiry)
        expiry = d->last_expiry + 1;
    d->last_expiry = expiry;
    int started = 0;
    for (int i = 0; i < peer_service_n_blocks(d->svc); i++) {
        peer_block_info info;
        if (peer_service_block_info(d->svc, i, &info) != 0)
            continue;
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
        a.time_ms = now;
        a.avg_rounds = d->avg_rounds[i];
        a.avg_group = d->avg_group[i];
        long n = peer_announce_encode(&a, val, sizeof val);
        if (n < 0)
            continue;
        dht_id_of_bytes(key, info.name, strlen(info.name));
        if (dht_put(d->dht, key, NULL, 0, val, (size_t)n, expiry, 1, cb, d) == 0)
            started++;
    }
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
    if (status == 0) {
        int rc = peer_service_install_state(d->svc, d->syncing, buf, len);
        if (rc == 0)
            say(d, "%s: downloaded the current state (weight version %llu, %.1f MB in %.2f s)", info.name,
                (unsigned long long)version, (double)len / 1e6, (double)uv_now(d->loop) / 1000.0 - d->sync_t0);
        else
            say(d, "%s: the downloaded state was refused (%s); keeping ours", info.name, strerror(-rc));
    } else {
        say(d, "%s: state download failed (%s); keeping ours", info.name, strerror(-status));
    }
    sync_next(d);
}

/* Picks a donor among the online holders with the newest weights; a random
 * one of the near-newest, so newcomers spread over donors. */
static void on_holders(dht *dh, int status, const dht_entry *e, size_t n, void *ud)
{
    (void)dh;
    peer_daemon *d = ud;
    if (d->stopping)
        return;
    peer_block_info info;
    peer_service_block_info(d->svc, d->syncing, &info);
    uint64_t best = 0;
    int found = 0;
    peer_announce cand[16];
    uint8_t ids[16][DHT_ID_LEN];
    int nc = 0;
    for (size_t i = 0; status == 0 && i < n; i++) {
        peer_announce a;
        if (!e[i].is_signed || e[i].subkey_len != DHT_ID_LEN || !memcmp(e[i].subkey, d->ident.id, DHT_ID_LEN) ||
            peer_announce_decode(&a, e[i].value, e[i].value_len) != 0 || a.state != PEER_STATE_ONLINE ||
            a.stage_hash != info.stage_hash || strcmp(a.block, info.name) != 0)
            continue;
        if (!found || a.weight_version > best)
            best = a.weight_version;
        found = 1;
        if (nc < 16) {
            cand[nc] = a;
            memcpy(ids[nc], e[i].subkey, DHT_ID_LEN);
            nc++;
        }
    }
    int pick = -1, seen = 0;
    for (int i = 0; i < nc; i++) {
        if (cand[i].weight_version + 1 < best)
            continue;
        d->sync_rng = d->sync_rng * 6364136223846793005ULL + 1442695040888963407ULL;
        if ((int)((d->sync_rng >> 33) % (uint64_t)(++seen)) == 0)
            pick = i;
    }
    int want = pick >= 0 && !d->no_state_download &&
               (best > info.version || (!info.restored && info.version == 0));
    if (!want) {
        if (!found)
            say(d, "%s: no other holder; starting from our %s", info.name,
                info.restored ? "checkpoint" : "initial weights");
        sync_next(d);
        return;
    }
    d->sync_t0 = (double)uv_now(d->loop) / 1000.0;
    int rc = peer_statesync_start(d->loop, &d->ident, d->has_swarm_key ? d->swarm_key : NULL, ids[pick],
                                  cand[pick].addr, info.name, 30.0, on_state, d);
    if (rc == 0)
        d->sync_inflight = 1;
    else {
        say(d, "%s: cannot start the state download (%s); keeping ours", info.name, strerror(-rc));
        sync_next(d);
    }
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

/* ---- replica averaging (group rounds; peer/allreduce.h) ---- */

/* Rounds start on wall-clock multiples of the period, so replicas agree on
 * the round number without talking; each holder then stores a matchmaking
 * entry for each of its blocks, waits a gathering window, reads who else
 * did, and runs the all-reduce with that group. */
static uint64_t avg_period_ms(const peer_daemon *d)
{
    uint64_t ms = (uint64_t)(d->average_every_s * 1000);
    return ms ? ms : 1;
}

static uint64_t avg_gather_ms(const peer_daemon *d)
{
    uint64_t g = avg_period_ms(d) / 4;
    return g < 300 ? 300 : g > 2000 ? 2000 : g;
}

static void avg_schedule(peer_daemon *d)
{
    uint64_t p = avg_period_ms(d), now = dht_now_ms();
    uv_timer_start(&d->avg_timer, on_avg_timer, p - now % p, 0);
}

static void on_avg_done(void *arg, int status, const peer_allreduce_result *res)
{
    avg_ctx *c = arg;
    peer_daemon *d = c->d;
    c->ar = NULL;
    d->avg_inflight--;
    if (d->stopping) {
        maybe_free(d);
        return;
    }
    peer_block_info info;
    peer_service_block_info(d->svc, c->block, &info);
    if (status == 0) {
        d->avg_rounds[c->block]++;
        d->avg_group[c->block] = res->n;
        d->avg_alone[c->block] = 0;
        say(d,
            "%s: averaged in a group of %d (round %llu, our weight %.3f, %.1f MB in %.2f s; distance to the "
            "group average %.6g -> %.6g)",
            info.name, res->n, (unsigned long long)c->round, res->weight_self, (double)res->bytes_in / 1e6,
            res->seconds, res->dist_before, res->dist_after);
    } else {
        say(d, "%s: averaging round %llu in a group of %d abandoned (%s); weights unchanged", info.name,
            (unsigned long long)c->round, res->n, strerror(-status));
    }
}

static void on_avg_gather(uv_timer_t *t);

static int cmp_member(const void *a, const void *b)
{
    return memcmp(((const peer_allreduce_member *)a)->id, ((const peer_allreduce_member *)b)->id, DHT_ID_LEN);
}

typedef struct avg_cand {
    peer_allreduce_member m;
    uint8_t optim;
    uint8_t order[8];    /* BLAKE2b(id, round): splits large groups the same way everywhere */
} avg_cand;

static int cmp_order(const void *a, const void *b)
{
    return memcmp(((const avg_cand *)a)->order, ((const avg_cand *)b)->order, 8);
}

static void on_avg_group(dht *dh, int status, const dht_entry *e, size_t n, void *ud)
{
    (void)dh;
    avg_ctx *c = ud;
    peer_daemon *d = c->d;
    c->getting = 0;
    if (d->stopping) {
        maybe_free(d);
        return;
    }
    peer_block_info info;
    peer_service_block_info(d->svc, c->block, &info);
    avg_cand cand[256];
    int nc = 0;
    for (size_t i = 0; status == 0 && i < n && nc < 255; i++) {
        peer_avg_record r;
        if (!e[i].is_signed || e[i].subkey_len != DHT_ID_LEN ||
            peer_avg_record_decode(&r, e[i].value, e[i].value_len) != 0 || r.round != c->round)
            continue;
        if (!memcmp(e[i].subkey, d->ident.id, DHT_ID_LEN))
            continue; /* we are a member whether or not our own entry came back */
        memcpy(cand[nc].m.id, e[i].subkey, DHT_ID_LEN);
        snprintf(cand[nc].m.addr, sizeof cand[nc].m.addr, "%s", r.addr);
        cand[nc].optim = (uint8_t)r.optim;
        nc++;
    }
    memcpy(cand[nc].m.id, d->ident.id, DHT_ID_LEN);
    snprintf(cand[nc].m.addr, sizeof cand[nc].m.addr, "%s", d->announce_addr);
    cand[nc].optim = (uint8_t)d->optim_kind;
    nc++;
    if (nc < 2) {
        /* No other replica's entry (yet). */
        uint64_t gather = avg_gather_ms(d), end = (c->round + 1) * avg_period_ms(d);
        if (c->regets < AVG_REGETS && dht_now_ms() + gather / 2 + gather < end) {
            c->regets++;
            c->putting = 1;
            uv_timer_start(&d->avg_gather_timer, on_avg_gather, gather / 2, 0);
        } else if (d->avg_group[c->block] >= 2 && !d->avg_alone[c->block]) {
            /* Said once when a block that had a group finds itself alone. */
            say(d, "%s: no other replica joined averaging round %llu", info.name, (unsigned long long)c->round);
            d->avg_alone[c->block] = 1;
        }
        return;
    }
    /* More than PEER_ALLREDUCE_MAX_MEMBERS: split into near-equal groups by
     * a per-round hash of the IDs, which every member computes alike. */
    int lo = 0, hi = nc;
    if (nc > PEER_ALLREDUCE_MAX_MEMBERS) {
        uint8_t rb[8];
        peer_put_le64(rb, c->round);
        for (int i = 0; i < nc; i++) {
            crypto_generichash_state st;
            crypto_generichash_init(&st, NULL, 0, 8);
            crypto_generichash_update(&st, cand[i].m.id, DHT_ID_LEN);
            crypto_generichash_update(&st, rb, sizeof rb);
            crypto_generichash_final(&st, cand[i].order, 8);
        }
        qsort(cand, (size_t)nc, sizeof cand[0], cmp_order);
        int groups = (nc + PEER_ALLREDUCE_MAX_MEMBERS - 1) / PEER_ALLREDUCE_MAX_MEMBERS;
        for (int g = 0; g < groups; g++) {
            int a = nc * g / groups, b = nc * (g + 1) / groups;
            for (int i = a; i < b; i++)
                if (!memcmp(cand[i].m.id, d->ident.id, DHT_ID_LEN)) {
                    lo = a;
                    hi = b;
                }
        }
    }
    int gn = hi - lo;
    if (gn < 2)
        return;
    peer_allreduce_member mem[PEER_ALLREDUCE_MAX_MEMBERS];
    avg_cand grp[PEER_ALLREDUCE_MAX_MEMBERS];
    memcpy(grp, cand + lo, (size_t)gn * sizeof grp[0]);
    qsort(grp, (size_t)gn, sizeof grp[0], cmp_member); /* the member is the first field */
    uint8_t ids[PEER_ALLREDUCE_MAX_MEMBERS][DHT_ID_LEN], tags[PEER_ALLREDUCE_MAX_MEMBERS];
    int me = 0, same_optim = 1;
    for (int i = 0; i < gn; i++) {
        mem[i] = grp[i].m;
        memcpy(ids[i], grp[i].m.id, DHT_ID_LEN);
        tags[i] = grp[i].optim;
        same_optim &= grp[i].optim == grp[0].optim;
        if (!memcmp(grp[i].m.id, d->ident.id, DHT_ID_LEN))
            me = i;
    }
    uint8_t digest[PEER_AVG_DIGEST_LEN];
    peer_allreduce_digest(digest, c->round, (const uint8_t(*)[DHT_ID_LEN])ids, tags, gn);
    peer_allreduce_config ac = {0};
    ac.loop = d->loop;
    ac.self = &d->ident;
    ac.swarm_key = d->has_swarm_key ? d->swarm_key : NULL;
    ac.svc = d->svc;
    ac.block = c->block;
    ac.block_name = info.name;
    ac.round = c->round;
    ac.digest = digest;
    ac.members = mem;
    ac.n = gn;
    ac.me = me;
    ac.with_optim = same_optim;
    ac.timeout_s = 30.0;
    ac.cb = on_avg_done;
    ac.arg = c;
    int rc = peer_allreduce_start(&ac, &c->ar);
    if (rc == 0)
        d->avg_inflight++;
    else
        say(d, "%s: cannot begin averaging round %llu: %s", info.name, (unsigned long long)c->round,
            strerror(-rc));
}

static void on_avg_gather(uv_timer_t *t)
{
    peer_daemon *d = t->data;
    if (d->stopping)
        return;
    for (int i = 0; i < peer_service_n_blocks(d->svc); i++) {
        avg_ctx *c = &d->avg[i];
        if (!c->putting || c->ar || c->getting)
            continue;
        c->putting = 0;
        peer_block_info info;
        uint8_t key[DHT_ID_LEN];
        peer_service_block_info(d->svc, i, &info);
        peer_avg_key(key, info.name, info.stage_hash);
        if (dht_get(d->dht, key, on_avg_group, c) == 0)
            c->getting = 1;
    }
}

static void on_avg_timer(uv_timer_t *t)
{
    peer_daemon *d = t->data;
    if (d->stopping)
        return;
    avg_schedule(d);
    /* Only once online (not while fetching state). */
    if (!d->joined || d->syncing >= 0 || d->sync_inflight)
        return;
    uint64_t now = dht_now_ms(), round = now / avg_period_ms(d);
    uint8_t val[PEER_ANNOUNCE_MAX_BYTES], key[DHT_ID_LEN];
    int started = 0;
    for (int i = 0; i < peer_service_n_blocks(d->svc); i++) {
        avg_ctx *c = &d->avg[i];
        c->d = d;
        c->block = i;
        if (c->ar || c->getting)
            continue; /* the last round of this block is still running */
        /* The last round's buffers were kept a period for slower members. */
        peer_service_avg_release(d->svc, i);
        peer_block_info info;
        peer_service_block_info(d->svc, i, &info);
        peer_avg_record r = {0};
        r.round = round;
        snprintf(r.addr, sizeof r.addr, "%s", d->announce_addr);
        r.optim = d->optim_kind;
        long n = peer_avg_record_encode(&r, val, sizeof val);
        if (n < 0)
            continue;
        peer_avg_key(key, info.name, info.stage_hash);
        /* Expires strictly later each round (a constant TTL after now). */
        if (dht_put(d->dht, key, NULL, 0, val, (size_t)n, now + 2 * avg_gather_ms(d) + 5000, 1, NULL, NULL) ==
            0) {
            c->round = round;
            c->regets = 0;
            c->putting = 1;
            started++;
        }
    }
    if (started)
        uv_timer_start(&d->avg_gather_timer, on_avg_gather, avg_gather_ms(d), 0);
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
    (void)dh;
    peer_daemon *d = ud;
    if (d->stopping)
        return;
    if (status < 0) {
        say(d, "cannot reach any initial peer (%s); retrying in %d s", strerror(-status),
            JOIN_RETRY_MS / 1000);
        uv_timer_start(&d->join_timer, on_join_timer, JOIN_RETRY_MS, 0);
        return;
    }
    d->joined = 1;
    say(d, "joined the swarm; fetching the current state of %d block%s from holders",
        peer_service_n_blocks(d->svc), peer_service_n_blocks(d->svc) == 1 ? "" : "s");
    announce(d, PEER_STATE_JOINING, on_put);
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

static size_t render_metrics(char *buf, size_t cap, void *arg)
{
    peer_daemon *d = arg;
    size_t off = 0;
#define EMIT(...)                                                                       \
    do {                                                                                \
        int n_ = snprintf(buf + off, cap > off ? cap - off : 0, __VA_ARGS__);           \
        if (n_ > 0)                                                                     \
            off = off + (size_t)n_ < cap ? off + (size_t)n_ : cap;                      \
    } while (0)
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
    memcpy(d->initial, cfg->initial, cfg->n_initial * sizeof *cfg->initial);
    d->n_initial = cfg->n_initial;

    dht_config dc;
    dht_config_default(&dc);
    if (d->has_swarm_key) {
        dc.has_swarm_key = 1;
        memcpy(dc.swarm_key, d->swarm_key, 32);
    }
    int rc;
    peer_service_config sc = cfg->svc;
    sc.self = &d->ident;
    sc.swarm_key = cfg->swarm_key;
    d->svc = peer_service_create(loop, &sc, err, errlen);
    if (!d->svc)
        goto fail_dht;
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
    uv_timer_t *timers[] = {&d->announce_timer, &d->join_timer, &d->ckpt_timer, &d->stop_timer,
                            &d->avg_timer, &d->avg_gather_timer};
    for (size_t i = 0; i < 6; i++) {
        uv_timer_init(loop, timers[i]);
        timers[i]->data = d;
        d->timers_open++;
    }
    if (d->checkpoint_every_s > 0) {
        uint64_t ms = (uint64_t)(d->checkpoint_every_s * 1000);
        uv_timer_start(&d->ckpt_timer, on_ckpt_timer, ms, ms);
    }
    if (d->average_every_s > 0)
        avg_schedule(d);
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
    if (d->timers_open > 0 || d->sync_inflight || d->avg_inflight > 0 || d->stop_phase < 4)
        return;
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
    uv_close((uv_handle_t *)&d->avg_timer, on_timer_closed);
    uv_close((uv_handle_t *)&d->avg_gather_timer, on_timer_closed);
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
        if (d->ckpt_busy)
            return; /* ckpt_after_cb calls us again */
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
    uv_timer_stop(&d->avg_timer);
    uv_timer_stop(&d->avg_gather_timer);
    /* Rounds in flight are abandoned while the service still stands. */
    for (int i = 0; i < PEER_SERVICE_MAX_BLOCKS; i++)
        if (d->avg[i].ar)
            peer_allreduce_cancel(d->avg[i].ar);
    d->stop_phase = 1;
    d->offline_puts = d->joined ? announce(d, PEER_STATE_OFFLINE, on_offline_put) : 0;
    if (d->offline_puts == 0) {
        continue_stop(d);
        return;
    }
    uv_timer_start(&d->stop_timer, on_stop_timer, STOP_ANNOUNCE_WAIT_MS, 0);
}
