/* peer/catchup.c: where a joining block's state comes from: the online
 * holders first, then the cold copies newest first, then our checkpoint
 * (peer/catchup.h). */
#include "peer/catchup.h"

#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "expert/block.h"
#include "peer/log.h"
#include "peer/statesync.h"
#include "swarm/holders.h"

struct peer_catchup {
    peer_catchup_config cfg;
    int block;                   /* the block being caught up, or -1 */
    int inflight;                /* a download's callback is still to come */
    peer_catchup_view view;
    uint64_t accept_max;         /* the download in flight is refused above this */
    uint64_t expect;             /* the version a lost download would have kept (0: nothing at stake) */
    char from[96];               /* whom the download in flight is from, for the log */
    double t0;                   /* when it started, s */
    uint64_t rng;
    uint64_t lost_from[PEER_SERVICE_MAX_BLOCKS], lost_to[PEER_SERVICE_MAX_BLOCKS];
    int stopping;
    void (*stop_cb)(void *);
    void *stop_arg;
};

#define say(c, ...) peer_log((c)->cfg.log, __VA_ARGS__)

/* ---- the choice (pure) ---- */

void peer_catchup_read_holders(peer_catchup_view *v, const dht_entry *e, size_t n,
                               const uint8_t self[DHT_ID_LEN], const char *block, uint64_t stage_hash)
{
    memset(v, 0, sizeof *v);
    for (size_t i = 0; i < n; i++) {
        swarm_holder h;
        if (!swarm_holder_read(&h, &e[i], block, stage_hash) || !h.same_hash)
            continue;
        if (!memcmp(h.id, self, DHT_ID_LEN)) {
            /* Our own entry from before a restart (it outlives a crash by
             * up to a TTL): the version we had. */
            if (h.ann.state != PEER_STATE_JOINING)
                v->prev = h.ann.weight_version;
            continue;
        }
        if (!h.usable)
            continue;
        v->found = 1;
        if (v->nc < PEER_CATCHUP_MAX) {
            v->cand[v->nc] = h.ann;
            memcpy(v->ids[v->nc], h.id, DHT_ID_LEN);
            v->nc++;
        }
    }
    /* One holder's version claim is not trusted on its own word: a claim
     * far above the other holders' is ignored (peer_statesync_choose), so
     * a holder announcing version 10^9 does not become every newcomer's
     * donor. The newest trusted claim is the one to download. */
    uint64_t hv[PEER_CATCHUP_MAX];
    for (int i = 0; i < v->nc; i++)
        hv[i] = v->cand[i].weight_version;
    v->hold_max = peer_statesync_choose(hv, v->nc, v->suspect);
    for (int i = 0; i < v->nc; i++)
        if (!v->suspect[i] && hv[i] > v->best)
            v->best = hv[i];
}

static int cmp_keep(const void *a, const void *b)
{
    uint64_t x = ((const peer_keep_record *)a)->weight_version, y = ((const peer_keep_record *)b)->weight_version;
    return x < y ? 1 : x > y ? -1 : 0;
}

void peer_catchup_read_keepers(peer_catchup_view *v, const dht_entry *e, size_t n,
                               const uint8_t self[DHT_ID_LEN])
{
    /* The copies, newest first (IDs sorted along through an index). */
    struct {
        peer_keep_record r;
        uint8_t id[DHT_ID_LEN];
    } kk[PEER_CATCHUP_MAX];
    int nk = 0;
    for (size_t i = 0; i < n && nk < PEER_CATCHUP_MAX; i++) {
        if (!e[i].is_signed || e[i].subkey_len != DHT_ID_LEN || !memcmp(e[i].subkey, self, DHT_ID_LEN) ||
            peer_keep_record_decode(&kk[nk].r, e[i].value, e[i].value_len) != 0 || kk[nk].r.weight_version == 0)
            continue;
        memcpy(kk[nk].id, e[i].subkey, DHT_ID_LEN);
        nk++;
    }
    qsort(kk, (size_t)nk, sizeof kk[0], cmp_keep); /* the record is the first field */
    v->nk = nk;
    v->next_keep = 0;
    uint64_t kv[PEER_CATCHUP_MAX];
    for (int i = 0; i < nk; i++) {
        v->keep[i] = kk[i].r;
        memcpy(v->kid[i], kk[i].id, DHT_ID_LEN);
        kv[i] = kk[i].r.weight_version;
    }
    /* A copy's version is its keeper's word: checked against the other
     * copies like the holders' (peer_statesync_choose). */
    v->keep_max = peer_statesync_choose(kv, nk, v->keep_suspect);
    uint64_t cold = 0;
    for (int i = 0; i < nk; i++)
        if (!v->keep_suspect[i] && kv[i] > cold)
            cold = kv[i];
    /* The newest state known to have existed: our own before a restart,
     * and the copies when no holder is online (a holder supersedes them). */
    v->known = v->prev;
    if (!v->found && cold > v->known)
        v->known = cold;
}

int peer_catchup_pick_holder(const peer_catchup_view *v, uint64_t *rng)
{
    int pick = -1, seen = 0;
    for (int i = 0; i < v->nc; i++) {
        if (v->suspect[i] || v->cand[i].weight_version + 1 < v->best)
            continue;
        *rng = *rng * 6364136223846793005ULL + 1442695040888963407ULL;
        if ((int)((*rng >> 33) % (uint64_t)(++seen)) == 0)
            pick = i;
    }
    return pick;
}

int peer_catchup_next_copy(peer_catchup_view *v, uint64_t ours)
{
    while (v->next_keep < v->nk && v->keep[v->next_keep].weight_version > ours) {
        int k = v->next_keep++;
        if (!v->keep_suspect[k])
            return k;
    }
    return -1;
}

/* ---- the catch-up ---- */

static void settle(peer_catchup *c, const char *failed, int downloaded);
static int try_cold_copy(peer_catchup *c);

/* Says (and keeps for the announcements) that the block went back: this
 * peer, or a keeper, had a newer version than the one it serves from now
 * on. */
static void note_lost(peer_catchup *c, const char *name, uint64_t from, uint64_t to, const char *why)
{
    c->lost_from[c->block] = from;
    c->lost_to[c->block] = to;
    say(c, "%s: STATE LOST: weight version %" PRIu64 " existed, this peer serves version %" PRIu64 " (%s)",
        name, from, to, why);
}

static void on_state(void *arg, int status, const uint8_t *buf, size_t len, uint64_t version)
{
    peer_catchup *c = arg;
    c->inflight = 0;
    if (c->stopping) {
        if (c->stop_cb)
            c->stop_cb(c->stop_arg);
        return;
    }
    peer_block_info info;
    peer_service_block_info(c->cfg.svc, c->block, &info);
    const char *failed = NULL;
    int again = status != 0; /* another copy may still be had */
    struct expert_ckpt_info ci;
    if (status == 0 && expert_ckpt_peek(buf, len, &ci) == 0 && ci.version > version)
        version = ci.version; /* what would be installed */
    if (status == 0 && version > c->accept_max) {
        /* The donor announced a plausible version and served a far newer
         * one (or the holders' claims bound it): not a state to spread. */
        say(c, "%s: the state downloaded from %s has weight version %" PRIu64 ", far above what the holders "
            "claim (at most %" PRIu64 "); refused, keeping ours", info.name, c->from, version, c->accept_max);
        failed = "the downloaded state was refused";
        again = 1;
    } else if (status == 0) {
        int rc = peer_service_install_state(c->cfg.svc, c->block, buf, len);
        if (rc == 0) {
            say(c, "%s: downloaded the current state (weight version %llu, %.1f MB in %.2f s) from %s", info.name,
                (unsigned long long)version, (double)len / 1e6,
                (double)uv_now(c->cfg.loop) / 1000.0 - c->t0, c->from);
            if (c->expect > version)
                failed = "the newest copy in the swarm was older";
        } else {
            say(c, "%s: the state downloaded from %s was refused (%s); keeping ours", info.name, c->from,
                rc == -ESTALE ? "it is the state of another stage or configuration" : strerror(-rc));
            failed = "the downloaded state was refused";
            again = 1;
        }
    } else {
        say(c, "%s: state download from %s failed (%s); keeping ours", info.name, c->from, strerror(-status));
        failed = "the download failed";
    }
    /* A copy that could not be had: the next newest one. */
    if (again && try_cold_copy(c))
        return;
    settle(c, failed, status == 0 && !again);
}

/* Starts downloading the block (c->from says from whom). Returns 0, or a
 * negative errno (said). */
static int start_download(peer_catchup *c, const uint8_t *id, const char *addr)
{
    peer_block_info info;
    peer_service_block_info(c->cfg.svc, c->block, &info);
    c->t0 = (double)uv_now(c->cfg.loop) / 1000.0;
    int rc = peer_statesync_start(c->cfg.loop, c->cfg.self, c->cfg.swarm_key, id, addr, info.name, 30.0,
                                  on_state, c);
    if (rc == 0)
        c->inflight = 1;
    else
        say(c, "%s: cannot start the state download from %s (%s)", info.name, c->from, strerror(-rc));
    return rc;
}

/* Downloads the block from the next cold copy newer than ours. Returns 1
 * when a download started. */
static int try_cold_copy(peer_catchup *c)
{
    peer_catchup_view *v = &c->view;
    peer_block_info info;
    peer_service_block_info(c->cfg.svc, c->block, &info);
    int k;
    while ((k = peer_catchup_next_copy(v, info.version)) >= 0) {
        char hex[DHT_ID_HEX_LEN + 1];
        dht_id_to_hex(hex, v->kid[k]);
        snprintf(c->from, sizeof c->from, "a cold copy kept by %.8s", hex);
        c->accept_max = v->keep_max;
        c->expect = v->known;
        if (start_download(c, v->kid[k], v->keep[k].addr) == 0)
            return 1;
    }
    return 0;
}

/* Nothing (more) to download for the block: say where it starts from,
 * and whether that loses a newer version. */
static void settle(peer_catchup *c, const char *failed, int downloaded)
{
    peer_catchup_view *v = &c->view;
    peer_block_info info;
    peer_service_block_info(c->cfg.svc, c->block, &info);
    if (!v->found && !failed && !downloaded)
        say(c, "%s: no other holder; starting from our %s (weight version %" PRIu64 ")", info.name,
            info.restored ? "checkpoint" : "initial weights", info.version);
    if (c->expect > info.version)
        note_lost(c, info.name, c->expect, info.version, failed ? failed
                  : info.restored ? "the checkpoint is older and no newer copy is in the swarm"
                                  : "no checkpoint and no copy in the swarm");
    c->cfg.done(c->cfg.arg, c->block);
}

/* Logs that a holder's (or keeper's) claim i of v[0..n) was ignored. */
static void say_ignored(peer_catchup *c, const char *block, const char *what, const uint8_t *id,
                        const uint64_t *v, int n, int i)
{
    char hex[DHT_ID_HEX_LEN + 1];
    dht_id_to_hex(hex, id);
    int others = 0;
    for (int j = 0; j < n; j++)
        others += j != i && v[j] > 0;
    say(c, "%s: ignored %s %.8s: it claims weight version %" PRIu64 ", far above the %d other%s (median %" PRIu64
        ")", block, what, hex, v[i], others, others == 1 ? "" : "s", peer_trust_median_u64(v, n, i));
}

static void on_keepers(dht *dh, int status, const dht_entry *e, size_t n, void *ud)
{
    (void)dh;
    peer_catchup *c = ud;
    if (c->stopping)
        return;
    peer_catchup_view *v = &c->view;
    peer_block_info info;
    peer_service_block_info(c->cfg.svc, c->block, &info);
    peer_catchup_read_keepers(v, e, status == 0 ? n : 0, c->cfg.self->id);
    uint64_t kv[PEER_CATCHUP_MAX];
    for (int i = 0; i < v->nk; i++)
        kv[i] = v->keep[i].weight_version;
    for (int i = 0; i < v->nk; i++)
        if (v->keep_suspect[i])
            say_ignored(c, info.name, "cold copy kept by", v->kid[i], kv, v->nk, i);
    c->expect = 0;
    int fresh = !info.restored && info.version == 0;
    int pick = peer_catchup_pick_holder(v, &c->rng);
    if (c->cfg.no_state_download) {
        if (!v->found)
            c->expect = v->known;
        settle(c, c->expect > info.version ? "--no-state-download" : NULL, 0);
        return;
    }
    /* Online holders first: they are at least as new as any copy of them,
     * and a copy's claimed version is only its keeper's word. */
    if (pick >= 0 && (v->best > info.version || fresh)) {
        snprintf(c->from, sizeof c->from, "an online holder");
        c->accept_max = v->hold_max;
        if (start_download(c, v->ids[pick], v->cand[pick].addr) == 0)
            return;
    }
    if (!v->found && try_cold_copy(c))
        return;
    if (!v->found)
        c->expect = v->known;
    settle(c, NULL, 0);
}

static void on_holders(dht *dh, int status, const dht_entry *e, size_t n, void *ud)
{
    (void)dh;
    peer_catchup *c = ud;
    if (c->stopping)
        return;
    peer_block_info info;
    peer_service_block_info(c->cfg.svc, c->block, &info);
    peer_catchup_view *v = &c->view;
    peer_catchup_read_holders(v, e, status == 0 ? n : 0, c->cfg.self->id, info.name, info.stage_hash);
    uint64_t hv[PEER_CATCHUP_MAX];
    for (int i = 0; i < v->nc; i++)
        hv[i] = v->cand[i].weight_version;
    for (int i = 0; i < v->nc; i++)
        if (v->suspect[i])
            say_ignored(c, info.name, "holder", v->ids[i], hv, v->nc, i);
    /* Only now, with our previous entry read, does the joining one replace
     * it. */
    c->cfg.joining(c->cfg.arg, c->block);
    uint8_t key[DHT_ID_LEN];
    peer_keep_key(key, info.name, info.stage_hash);
    if (dht_get(c->cfg.dht, key, on_keepers, c) != 0)
        on_keepers(c->cfg.dht, -EAGAIN, NULL, 0, c);
}

peer_catchup *peer_catchup_create(const peer_catchup_config *cfg)
{
    if (!cfg || !cfg->loop || !cfg->dht || !cfg->self || !cfg->svc || !cfg->joining || !cfg->done)
        return NULL;
    peer_catchup *c = calloc(1, sizeof *c);
    if (!c)
        return NULL;
    c->cfg = *cfg;
    c->block = -1;
    c->rng = (uint64_t)cfg->self->id[0] << 8 | cfg->self->id[1];
    return c;
}

int peer_catchup_start(peer_catchup *c, int block)
{
    peer_block_info info;
    if (!c || c->stopping || peer_service_block_info(c->cfg.svc, block, &info) != 0)
        return -EINVAL;
    c->block = block;
    uint8_t key[DHT_ID_LEN];
    dht_id_of_bytes(key, info.name, strlen(info.name));
    int rc = dht_get(c->cfg.dht, key, on_holders, c);
    if (rc == 0)
        return 0;
    say(c, "%s: cannot look up holders; keeping ours", info.name);
    return rc < 0 ? rc : -EIO;
}

void peer_catchup_lost(const peer_catchup *c, int block, uint64_t *from, uint64_t *to)
{
    *from = *to = 0;
    if (!c || block < 0 || block >= PEER_SERVICE_MAX_BLOCKS)
        return;
    *from = c->lost_from[block];
    *to = c->lost_to[block];
}

void peer_catchup_stop(peer_catchup *c, void (*cb)(void *arg), void *arg)
{
    if (!c || c->stopping)
        return;
    c->stopping = 1;
    c->stop_cb = cb;
    c->stop_arg = arg;
    if (!c->inflight && cb)
        cb(arg);
}

void peer_catchup_destroy(peer_catchup **p)
{
    if (!p || !*p)
        return;
    free(*p);
    *p = NULL;
}
