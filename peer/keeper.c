#include "peer/keeper.h"

#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include <sodium.h>

#include "expert/block.h"
#include "expert/model.h"
#include "swarm/announce.h"
#include "peer/log.h"
#include "peer/statesync.h"
#include "swarm/holders.h"

#define MAX_PEERS 1024           /* distinct peers of the model considered */
#define MAX_HOLDERS 64           /* per stage */
#define FIRST_LOOK_MS 5000       /* first look, and again while a copy is missing */

typedef struct holder {
    uint8_t id[DHT_ID_LEN];
    char addr[65];
    uint64_t version;
} holder;

typedef struct stage {
    struct peer_keeper *k;
    char name[65];
    uint64_t hash;
    int hosted;                  /* served by this peer: never kept */
    holder h[MAX_HOLDERS];       /* online holders seen this tick */
    int nh;
    uint8_t *copy;               /* the cold copy, or NULL */
    size_t len;
    uint64_t copy_id, version;
    int want;                    /* chosen as a keeper this tick */
    int unwanted;                /* periods in a row not chosen while holding a copy */
    int too_big;                 /* past --keep-mb: not fetched again */
    uint64_t accept_max;         /* a download newer than this is refused (peer_statesync_choose) */
} stage;

struct peer_keeper {
    peer_keeper_config cfg;
    char model[64];
    char addr[65];
    int n_stages;
    stage *st;
    uv_timer_t timer;
    int timer_open;
    int lookups;                 /* holder lookups of this tick in flight */
    int downloading;             /* the stage being fetched, or -1 */
    uint64_t next_copy_id;
    int full_said;
    int stopping, stopped;
    void (*stop_cb)(void *);
    void *stop_arg;
};

#define say(o, ...) peer_log((o)->cfg.log, __VA_ARGS__)

/* ---- the choice (pure) ---- */

static void score(uint8_t out[8], const uint8_t id[DHT_ID_LEN], const char *name)
{
    crypto_generichash_state s;
    crypto_generichash_init(&s, NULL, 0, 8);
    crypto_generichash_update(&s, (const uint8_t *)"starling.keep.v1", 16);
    crypto_generichash_update(&s, id, DHT_ID_LEN);
    crypto_generichash_update(&s, (const uint8_t *)name, strlen(name));
    crypto_generichash_final(&s, out, 8);
}

int peer_keeper_choose(const uint8_t (*ids)[DHT_ID_LEN], int n, const uint8_t self[DHT_ID_LEN],
                       const char *const *names, int n_stages, const uint8_t *holds, int replicas,
                       uint8_t *keep)
{
    if (!ids || !self || !names || !holds || !keep || n < 1 || n_stages < 1 || replicas < 1)
        return -EINVAL;
    int me = -1;
    for (int j = 0; j < n; j++)
        if (!memcmp(ids[j], self, DHT_ID_LEN))
            me = j;
    if (me < 0)
        return -EINVAL;
    for (int s = 0; s < n_stages; s++) {
        keep[s] = 0;
        if (holds[(size_t)s * (size_t)n + (size_t)me])
            continue;
        uint8_t mine[8];
        score(mine, self, names[s]);
        /* Our rank among the peers that do not hold s (ties by ID). */
        int above = 0;
        for (int j = 0; j < n && above < replicas; j++) {
            if (j == me || holds[(size_t)s * (size_t)n + (size_t)j])
                continue;
            uint8_t theirs[8];
            score(theirs, ids[j], names[s]);
            int c = memcmp(theirs, mine, 8);
            if (c > 0 || (c == 0 && memcmp(ids[j], self, DHT_ID_LEN) < 0))
                above++;
        }
        keep[s] = above < replicas;
    }
    return 0;
}

/* ---- the period ---- */

static void maybe_stopped(peer_keeper *k)
{
    if (!k->stopping || k->timer_open || k->downloading >= 0 || k->stopped)
        return;
    k->stopped = 1;
    if (k->stop_cb)
        k->stop_cb(k->stop_arg);
}

static size_t bytes_held(const peer_keeper *k)
{
    size_t b = 0;
    for (int s = 0; s < k->n_stages; s++)
        b += k->st[s].len;
    return b;
}

/* Stores (or renews) our record of stage s's copy; withdraw: a record of
 * version 0, which replaces ours and which readers skip. */
static void publish(peer_keeper *k, int s, int withdraw)
{
    stage *t = &k->st[s];
    peer_keep_record r = {0};
    snprintf(r.addr, sizeof r.addr, "%s", k->addr);
    r.weight_version = withdraw ? 0 : t->version;
    r.time_ms = dht_now_ms();
    uint8_t val[PEER_ANNOUNCE_MAX_BYTES], key[DHT_ID_LEN];
    long n = peer_keep_record_encode(&r, val, sizeof val);
    if (n < 0)
        return;
    peer_keep_key(key, t->name, t->hash);
    /* Outlives a few missed periods: a holder restarting after a crash
     * must still find it. */
    double ttl = 3 * k->cfg.every_s < 120 ? 120 : 3 * k->cfg.every_s;
    if (ttl > 23 * 3600)
        ttl = 23 * 3600; /* the DHT keeps nothing longer than a day */
    dht_put(k->cfg.dht, key, NULL, 0, val, (size_t)n, r.time_ms + (uint64_t)(ttl * 1000), 1, NULL, NULL);
}

static void fetch_next(peer_keeper *k);
static void on_tick(uv_timer_t *tm);

static void on_copy(void *arg, int status, const uint8_t *buf, size_t len, uint64_t version)
{
    peer_keeper *k = arg;
    int s = k->downloading;
    k->downloading = -1;
    if (k->stopping) {
        maybe_stopped(k);
        return;
    }
    stage *t = &k->st[s];
    struct expert_ckpt_info ci;
    if (status == 0 && expert_ckpt_peek(buf, len, &ci) == 0 && ci.version > version)
        version = ci.version; /* what the state says it is */
    if (status != 0) {
        say(k, "%s: cannot take a cold copy (%s); trying again next period", t->name, strerror(-status));
    } else if (version > t->accept_max) {
        say(k, "%s: not kept: the copy has weight version %" PRIu64 ", far above what the holders claim "
            "(at most %" PRIu64 ")", t->name, version, t->accept_max);
    } else if (bytes_held(k) - t->len + len > k->cfg.max_bytes) {
        if (!k->full_said)
            say(k, "%s: not kept: cold copies would exceed %.0f MB (--keep-mb)", t->name,
                (double)k->cfg.max_bytes / 1e6);
        k->full_said = 1;
        t->too_big = 1;
    } else {
        uint8_t *c = malloc(len ? len : 1);
        if (!c) {
            say(k, "%s: out of memory for a cold copy", t->name);
        } else {
            memcpy(c, buf, len);
            int first = t->copy == NULL;
            free(t->copy);
            t->copy = c;
            t->len = len;
            t->version = version;
            t->copy_id = ++k->next_copy_id;
            if (first)
                say(k, "%s: keeping a cold copy (weight version %" PRIu64 ", %.1f MB)", t->name, version,
                    (double)len / 1e6);
            publish(k, s, 0);
        }
    }
    fetch_next(k);
}

/* Downloads the next stage whose holders are ahead of our copy. */
static void fetch_next(peer_keeper *k)
{
    if (k->stopping || k->lookups > 0 || k->downloading >= 0)
        return;
    for (int s = 0; s < k->n_stages; s++) {
        stage *t = &k->st[s];
        if (!t->want || t->nh == 0 || t->too_big)
            continue;
        /* The newest claim that is not far above the other holders'
         * (peer_statesync_choose): a holder announcing version 10^9 is
         * not copied, and a copy far newer than the claims is refused. */
        uint64_t hv[MAX_HOLDERS];
        uint8_t sus[MAX_HOLDERS];
        for (int i = 0; i < t->nh; i++)
            hv[i] = t->h[i].version;
        t->accept_max = peer_statesync_choose(hv, t->nh, sus);
        int best = -1;
        for (int i = 0; i < t->nh; i++)
            if (!sus[i] && (best < 0 || t->h[i].version > t->h[best].version))
                best = i;
        if (best < 0)
            continue;
        if (t->copy && t->h[best].version <= t->version)
            continue;
        if (t->h[best].version == 0)
            continue; /* initial weights: nothing worth keeping */
        t->want = 0; /* one try per period */
        int rc = peer_statesync_start(k->cfg.loop, k->cfg.self, k->cfg.swarm_key, t->h[best].id,
                                      t->h[best].addr, t->name, 30.0, on_copy, k);
        if (rc == 0) {
            k->downloading = s;
            return;
        }
        say(k, "%s: cannot start a cold copy download (%s)", t->name, strerror(-rc));
    }
}

/* Every lookup is back: who keeps what. */
static void decide(peer_keeper *k)
{
    static uint8_t ids[MAX_PEERS][DHT_ID_LEN]; /* loop thread only */
    int n = 0;
    memcpy(ids[n++], k->cfg.self->id, DHT_ID_LEN);
    for (int s = 0; s < k->n_stages; s++)
        for (int i = 0; i < k->st[s].nh; i++) {
            int j = 0;
            while (j < n && memcmp(ids[j], k->st[s].h[i].id, DHT_ID_LEN))
                j++;
            if (j == n && n < MAX_PEERS)
                memcpy(ids[n++], k->st[s].h[i].id, DHT_ID_LEN);
        }
    size_t cells = (size_t)(unsigned)k->n_stages * (size_t)(unsigned)n;
    uint8_t *holds = calloc(cells ? cells : 1, 1);
    uint8_t keep[PEER_KEEPER_MAX_STAGES];
    const char *names[PEER_KEEPER_MAX_STAGES];
    if (!holds)
        return;
    for (int s = 0; s < k->n_stages; s++) {
        names[s] = k->st[s].name;
        for (int j = 0; j < n; j++) {
            int h = j == 0 && k->st[s].hosted;
            for (int i = 0; i < k->st[s].nh && !h; i++)
                h = !memcmp(ids[j], k->st[s].h[i].id, DHT_ID_LEN);
            holds[(size_t)s * (size_t)n + (size_t)j] = (uint8_t)h;
        }
    }
    peer_keeper_choose((const uint8_t(*)[DHT_ID_LEN])ids, n, k->cfg.self->id, names, k->n_stages, holds,
                       k->cfg.replicas, keep);
    free(holds);
    for (int s = 0; s < k->n_stages; s++) {
        stage *t = &k->st[s];
        t->want = keep[s] && !t->hosted;
        t->unwanted = t->copy && !t->want ? t->unwanted + 1 : 0;
        if (t->copy && (t->hosted || (t->unwanted >= 2 && t->nh > 0))) {
            /* Another peer keeps it now (for a period already, so its copy
             * exists), or we serve the stage: let ours go. */
            publish(k, s, 1);
            free(t->copy);
            t->copy = NULL;
            t->len = 0;
            t->unwanted = 0;
        } else if (t->copy) {
            publish(k, s, 0); /* still ours: renew the record */
        }
    }
    /* A stage we should keep but have no copy of yet (its holders had
     * nothing trained, or a download failed): look again in 5 s rather than
     * a whole period later, so that a young swarm is covered early. */
    int pending = 0;
    for (int s = 0; s < k->n_stages; s++)
        pending |= k->st[s].want && !k->st[s].copy && !k->st[s].too_big;
    uint64_t every = (uint64_t)(k->cfg.every_s * 1000);
    if (pending && every > FIRST_LOOK_MS)
        uv_timer_start(&k->timer, on_tick, FIRST_LOOK_MS, every);
    fetch_next(k);
}

static void on_holders(dht *dh, int status, const dht_entry *e, size_t n, void *ud)
{
    (void)dh;
    stage *t = ud;
    peer_keeper *k = t->k;
    k->lookups--;
    if (k->stopping)
        return;
    swarm_holder sh[MAX_HOLDERS];
    t->nh = status == 0 ? swarm_holders_usable(sh, MAX_HOLDERS, e, n, t->name, t->hash, k->cfg.self->id) : 0;
    for (int i = 0; i < t->nh; i++) {
        holder *h = &t->h[i];
        memcpy(h->id, sh[i].id, DHT_ID_LEN);
        snprintf(h->addr, sizeof h->addr, "%s", sh[i].ann.addr);
        h->version = sh[i].ann.weight_version;
    }
    if (k->lookups == 0)
        decide(k);
}

static void on_tick(uv_timer_t *tm)
{
    peer_keeper *k = tm->data;
    if (k->stopping || k->lookups > 0 || k->downloading >= 0)
        return;
    if (k->cfg.ready && !k->cfg.ready(k->cfg.ready_arg))
        return;
    for (int s = 0; s < k->n_stages; s++) {
        uint8_t key[DHT_ID_LEN];
        dht_id_of_bytes(key, k->st[s].name, strlen(k->st[s].name));
        if (dht_get(k->cfg.dht, key, on_holders, &k->st[s]) == 0)
            k->lookups++;
    }
}

static int cold_source(void *arg, const char *block, const uint8_t **buf, size_t *len, uint64_t *id,
                       uint64_t *version)
{
    peer_keeper *k = arg;
    for (int s = 0; s < k->n_stages; s++) {
        stage *t = &k->st[s];
        if (t->copy && !strcmp(t->name, block)) {
            *buf = t->copy;
            *len = t->len;
            *id = t->copy_id;
            *version = t->version;
            return 0;
        }
    }
    return -ENOENT;
}

peer_keeper *peer_keeper_start(const peer_keeper_config *cfg, char *err, size_t errlen)
{
    if (!cfg || !cfg->loop || !cfg->dht || !cfg->self || !cfg->svc || !cfg->states || !cfg->model ||
        !cfg->addr || !(cfg->every_s > 0) || cfg->replicas < 1) {
        snprintf(err, errlen, "cold copies: bad arguments");
        return NULL;
    }
    const struct expert_model_spec *m = expert_model_find(cfg->model);
    if (!m || m->n_stages > PEER_KEEPER_MAX_STAGES) {
        snprintf(err, errlen, "cold copies: unknown model '%.60s'", cfg->model);
        return NULL;
    }
    peer_keeper *k = calloc(1, sizeof *k);
    if (k)
        k->st = calloc((size_t)m->n_stages, sizeof *k->st);
    if (!k || !k->st) {
        free(k);
        snprintf(err, errlen, "cold copies: out of memory");
        return NULL;
    }
    k->cfg = *cfg;
    snprintf(k->model, sizeof k->model, "%s", cfg->model);
    snprintf(k->addr, sizeof k->addr, "%s", cfg->addr);
    k->cfg.model = k->model;
    k->cfg.addr = k->addr;
    k->n_stages = m->n_stages;
    k->downloading = -1;
    for (int s = 0; s < k->n_stages; s++) {
        k->st[s].k = k;
        expert_stage_name(k->st[s].name, sizeof k->st[s].name, m, s);
        k->st[s].hash = expert_stage_hash(m, s);
    }
    for (int i = 0; i < peer_service_n_blocks(cfg->svc); i++) {
        peer_block_info info;
        if (peer_service_block_info(cfg->svc, i, &info) == 0 && info.index >= 0 && info.index < k->n_stages)
            k->st[info.index].hosted = 1;
    }
    uv_timer_init(cfg->loop, &k->timer);
    k->timer.data = k;
    k->timer_open = 1;
    uint64_t ms = (uint64_t)(cfg->every_s * 1000);
    /* The first look soon after joining: a holder that crashes early must
     * already have a keeper. */
    uv_timer_start(&k->timer, on_tick, ms < FIRST_LOOK_MS ? ms : FIRST_LOOK_MS, ms);
    peer_statesync_server_set_cold_source(cfg->states, cold_source, k);
    return k;
}

static void on_timer_closed(uv_handle_t *h)
{
    peer_keeper *k = h->data;
    k->timer_open = 0;
    maybe_stopped(k);
}

void peer_keeper_stop(peer_keeper *k, void (*cb)(void *arg), void *arg)
{
    if (!k || k->stopping)
        return;
    k->stopping = 1;
    k->stop_cb = cb;
    k->stop_arg = arg;
    peer_statesync_server_set_cold_source(k->cfg.states, NULL, NULL);
    uv_timer_stop(&k->timer);
    uv_close((uv_handle_t *)&k->timer, on_timer_closed);
}

void peer_keeper_destroy(peer_keeper **p)
{
    if (!p || !*p)
        return;
    peer_keeper *k = *p;
    for (int s = 0; s < k->n_stages; s++)
        free(k->st[s].copy);
    free(k->st);
    free(k);
    *p = NULL;
}
