/* tests/test_dht_simnet.h: many sans-I/O DHT nodes in one process.
 *
 * A discrete-event network: every datagram a node emits is delivered to its
 * destination after a random latency (or lost), node timers fire at the
 * node's next deadline, and time only moves from event to event, so a run is
 * a pure function of the seed. Node i lives at 10.i>>16.i>>8.i:4000 unless
 * a test moves it (sim_set_addr: attacks from one network, public
 * addresses). A test may also watch and rewrite every datagram (hook): how
 * misbehaving nodes are made, and how an outsider gets its replies.
 * Used by tests/test_dht_sim.c and tests/bench/dht_sim.c (header-only so
 * that neither the library nor the test harness grows a test-only module).
 */
#ifndef TESTS_TEST_DHT_SIMNET_H
#define TESTS_TEST_DHT_SIMNET_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dht/dht.h"

#define SIM_EPOCH 1700000000000ull /* simulated wall clock starts here (ms) */

typedef struct sim_ev {
    uint64_t t;
    uint64_t seq;      /* FIFO among equal times, for determinism */
    uint32_t node;
    uint32_t kind;     /* 0 timer, 1 delivery */
    struct sim_pkt *pkt;
} sim_ev;

typedef struct sim_pkt {
    dht_addr from;
    size_t len;
    uint8_t data[];
} sim_pkt;

typedef struct sim_node {
    dht_node *node;
    uint64_t sched;    /* time of the pending timer event, UINT64_MAX none */
    int alive;
    uint8_t id[DHT_ID_LEN];
    dht_addr addr;
} sim_node;

struct simnet;

/* Sees every datagram node `from` sends to `to` (to_idx: the node there, or
 * UINT32_MAX for an address outside the simnet, which only the hook sees).
 * May rewrite buf (up to DHT_MAX_DATAGRAM bytes) and *len. Returns 1 to
 * deliver, 0 to drop. */
typedef int (*sim_hook_fn)(struct simnet *s, uint32_t from, uint32_t to_idx, const dht_addr *to,
                           uint8_t *buf, size_t *len, void *ud);

typedef struct simnet {
    sim_node *n;
    size_t count;
    uint64_t now;
    uint64_t rng;
    double loss;
    uint32_t lat_min, lat_max;
    sim_ev *heap;
    size_t hn, hcap;
    uint64_t seq;
    uint64_t delivered, lost;
    int custom_addrs;  /* some node was moved: find destinations by search */
    sim_hook_fn hook;
    void *hook_ud;
} simnet;

static inline uint64_t sim_rand(simnet *s)
{
    /* splitmix64 */
    uint64_t z = (s->rng += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static inline double sim_uniform(simnet *s)
{
    return (double)(sim_rand(s) >> 11) / 9007199254740992.0;
}

static inline void sim_addr(dht_addr *a, uint32_t i)
{
    uint8_t ip[4] = {10, (uint8_t)(i >> 16), (uint8_t)(i >> 8), (uint8_t)i};
    dht_addr_v4(a, ip, 4000);
}

static inline int sim_ev_less(const sim_ev *a, const sim_ev *b)
{
    return a->t < b->t || (a->t == b->t && a->seq < b->seq);
}

static inline void sim_push(simnet *s, sim_ev ev)
{
    if (s->hn == s->hcap) {
        s->hcap = s->hcap ? s->hcap * 2 : 1024;
        s->heap = realloc(s->heap, s->hcap * sizeof *s->heap);
        if (!s->heap) {
            fprintf(stderr, "simnet: out of memory\n");
            exit(1);
        }
    }
    ev.seq = s->seq++;
    size_t i = s->hn++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!sim_ev_less(&ev, &s->heap[p]))
            break;
        s->heap[i] = s->heap[p];
        i = p;
    }
    s->heap[i] = ev;
}

static inline sim_ev sim_pop(simnet *s)
{
    sim_ev top = s->heap[0], last = s->heap[--s->hn];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= s->hn)
            break;
        if (c + 1 < s->hn && sim_ev_less(&s->heap[c + 1], &s->heap[c]))
            c++;
        if (!sim_ev_less(&s->heap[c], &last))
            break;
        s->heap[i] = s->heap[c];
        i = c;
    }
    if (s->hn)
        s->heap[i] = last;
    return top;
}

/* The node at a, or UINT32_MAX. */
static inline uint32_t sim_index_of(const simnet *s, const dht_addr *a)
{
    if (s->custom_addrs) {
        for (uint32_t i = 0; i < s->count; i++)
            if (dht_addr_equal(&s->n[i].addr, a))
                return i;
        return UINT32_MAX;
    }
    uint32_t dst = (uint32_t)a->ip[1] << 16 | (uint32_t)a->ip[2] << 8 | a->ip[3];
    if (a->family != 4 || a->ip[0] != 10 || dst >= s->count)
        return UINT32_MAX;
    return dst;
}

/* Moves node i to a (before it joins or is named to anyone). */
static inline void sim_set_addr(simnet *s, uint32_t i, const dht_addr *a)
{
    s->n[i].addr = *a;
    s->custom_addrs = 1;
}

/* Sends what node i queued and re-arms its timer. Call after every call
 * into node i. */
static inline void sim_after(simnet *s, uint32_t i)
{
    uint8_t buf[DHT_MAX_DATAGRAM];
    dht_addr to, from;
    int len;
    sim_node *sn = &s->n[i];
    from = sn->addr;
    while ((len = dht_node_pop_output(sn->node, buf, sizeof buf, &to)) > 0) {
        uint32_t dst = sim_index_of(s, &to);
        size_t plen = (size_t)len;
        if (s->hook && !s->hook(s, i, dst, &to, buf, &plen, s->hook_ud))
            continue;
        len = (int)plen;
        if (dst == UINT32_MAX)
            continue;
        if (sim_uniform(s) < s->loss) {
            s->lost++;
            continue;
        }
        sim_pkt *p = malloc(sizeof *p + (size_t)len);
        if (!p)
            exit(1);
        p->from = from;
        p->len = (size_t)len;
        memcpy(p->data, buf, (size_t)len);
        uint32_t lat = s->lat_min + (uint32_t)(sim_rand(s) % (s->lat_max - s->lat_min + 1));
        sim_ev ev = {s->now + lat, 0, dst, 1, p};
        sim_push(s, ev);
    }
    uint64_t d = dht_node_next_deadline(sn->node);
    if (d < s->now)
        d = s->now;
    if (d < sn->sched) {
        sn->sched = d;
        sim_ev ev = {d, 0, i, 0, NULL};
        sim_push(s, ev);
    }
}

/* cfg may be NULL (defaults with deterministic per-node seeds). */
static inline simnet *sim_create(size_t count, uint64_t seed, double loss, const dht_config *cfg)
{
    simnet *s = calloc(1, sizeof *s);
    if (!s)
        return NULL;
    s->n = calloc(count, sizeof *s->n);
    s->count = count;
    s->now = SIM_EPOCH;
    s->rng = seed;
    s->loss = loss;
    s->lat_min = 10;
    s->lat_max = 80;
    for (size_t i = 0; i < count; i++) {
        dht_identity ident;
        dht_config c;
        uint8_t idseed[32];
        if (cfg)
            c = *cfg;
        else
            dht_config_default(&c);
        for (int j = 0; j < 4; j++) {
            uint64_t r = sim_rand(s);
            memcpy(idseed + 8 * j, &r, 8);
        }
        dht_identity_from_seed(&ident, idseed);
        for (int j = 0; j < 4; j++) {
            uint64_t r = sim_rand(s) | 1;
            memcpy(c.seed + 8 * j, &r, 8);
        }
        s->n[i].node = dht_node_create(&ident, &c, s->now);
        if (!s->n[i].node) {
            fprintf(stderr, "simnet: node %zu create failed\n", i);
            exit(1);
        }
        memcpy(s->n[i].id, ident.id, DHT_ID_LEN);
        sim_addr(&s->n[i].addr, (uint32_t)i);
        s->n[i].alive = 1;
        s->n[i].sched = UINT64_MAX;
        sim_after(s, (uint32_t)i);
    }
    return s;
}

static inline void sim_destroy(simnet **p)
{
    simnet *s = *p;
    if (!s)
        return;
    for (size_t i = 0; i < s->hn; i++)
        free(s->heap[i].pkt);
    for (size_t i = 0; i < s->count; i++)
        dht_node_destroy(&s->n[i].node);
    free(s->heap);
    free(s->n);
    free(s);
    *p = NULL;
}

/* Runs events until time t (inclusive) or until *stop becomes non-zero. */
static inline void sim_run(simnet *s, uint64_t t, const int *stop)
{
    while (s->hn && s->heap[0].t <= t && !(stop && *stop)) {
        sim_ev ev = sim_pop(s);
        sim_node *sn = &s->n[ev.node];
        s->now = ev.t;
        if (ev.kind == 1) {
            if (sn->alive) {
                s->delivered++;
                dht_node_input(sn->node, ev.pkt->data, ev.pkt->len, &ev.pkt->from, s->now);
                sim_after(s, ev.node);
            }
            free(ev.pkt);
        } else if (sn->alive && ev.t == sn->sched) {
            sn->sched = UINT64_MAX;
            dht_node_tick(sn->node, s->now);
            sim_after(s, ev.node);
        }
    }
    if (!(stop && *stop) && s->now < t)
        s->now = t;
}

/* Kills node i: it stops receiving and ticking (its state is kept, unused). */
static inline void sim_kill(simnet *s, uint32_t i)
{
    s->n[i].alive = 0;
}

#endif

/* ---- the standard scenario (test and benchmark) ---- */

typedef struct sim_report {
    size_t nodes, lookups, found;
    double success_rate;
    unsigned median_hops, p99_hops;
    double msgs_per_lookup;
    double bytes_per_node;
    size_t records, stored, found_before, found_after, alive_after;
    double churn;
} sim_report;

typedef struct sim_probe {
    int done, ok;
    uint8_t want[DHT_ID_LEN];   /* find: the target; get: unused */
    char value[32];             /* get: the value we expect */
    unsigned hops, msgs;
    int status;
} sim_probe;

static void sim_find_cb(void *ud, const dht_result *r)
{
    sim_probe *p = ud;
    p->done = 1;
    p->status = r->status;
    p->hops = r->hops;
    p->msgs = r->msgs;
    p->ok = r->status == 0 && r->n_nodes && memcmp(r->nodes[0].id, p->want, DHT_ID_LEN) == 0;
}

static void sim_put_cb(void *ud, const dht_result *r)
{
    sim_probe *p = ud;
    p->done = 1;
    p->status = r->status;
    p->ok = r->status > 0;
}

static void sim_get_cb(void *ud, const dht_result *r)
{
    sim_probe *p = ud;
    p->done = 1;
    p->status = r->status;
    p->msgs = r->msgs;
    for (size_t i = 0; i < r->n_entries; i++)
        if (r->entries[i].value_len == strlen(p->value) &&
            memcmp(r->entries[i].value, p->value, r->entries[i].value_len) == 0 &&
            r->entries[i].is_signed)
            p->ok = 1;
}

static inline uint32_t sim_pick_alive(simnet *s)
{
    for (;;) {
        uint32_t i = (uint32_t)(sim_rand(s) % s->count);
        if (s->n[i].alive)
            return i;
    }
}

static int sim_cmp_u(const void *a, const void *b)
{
    unsigned x = *(const unsigned *)a, y = *(const unsigned *)b;
    return x < y ? -1 : x > y;
}

/* Issues ops one every gap ms, then runs until all are done (bounded). */
static inline void sim_wait(simnet *s, sim_probe *p, size_t n, uint64_t limit_ms)
{
    uint64_t end = s->now + limit_ms;
    for (;;) {
        size_t done = 0;
        for (size_t i = 0; i < n; i++)
            done += p[i].done != 0;
        if (done == n || s->now >= end)
            return;
        sim_run(s, s->now + 100 < end ? s->now + 100 : end, NULL);
    }
}

static inline void sim_gets(simnet *s, sim_probe *p, size_t n_records)
{
    for (size_t i = 0; i < n_records; i++) {
        uint8_t key[DHT_ID_LEN];
        char name[32];
        snprintf(name, sizeof name, "rec-%zu", i);
        dht_id_of_bytes(key, name, strlen(name));
        memset(&p[i], 0, sizeof p[i]);
        snprintf(p[i].value, sizeof p[i].value, "value-%zu", i);
        uint32_t src = sim_pick_alive(s);
        if (dht_node_get(s->n[src].node, key, sim_get_cb, &p[i], s->now) != 0)
            p[i].done = 1;
        sim_after(s, src);
        sim_run(s, s->now + 5, NULL);
    }
    sim_wait(s, p, n_records, 120000);
}

/* Joins `nodes` nodes, runs n_lookups find_node lookups of existing IDs,
 * stores n_records signed records, reads them back, kills a `churn`
 * fraction of the nodes, waits 2.5 republish periods and reads them again. */
static inline int sim_scenario(size_t nodes, double churn, uint64_t seed, size_t n_lookups,
                               size_t n_records, const dht_config *cfg_in, sim_report *rep)
{
    dht_config cfg;
    if (cfg_in)
        cfg = *cfg_in;
    else {
        dht_config_default(&cfg);
        cfg.republish_ms = 60000;
        cfg.refresh_ms = 30 * 60000;
        cfg.rpc_timeout_ms = 1000;
    }
    memset(rep, 0, sizeof *rep);
    simnet *s = sim_create(nodes, seed, 0.01, &cfg);
    if (!s)
        return -1;
    rep->nodes = nodes;
    rep->churn = churn;

    /* Join: node i enters through a random earlier node, one every gap ms. */
    uint64_t gap = nodes <= 1000 ? 20 : 2;
    for (uint32_t i = 1; i < nodes; i++) {
        dht_peer_addr pa;
        uint32_t via = (uint32_t)(sim_rand(s) % i);
        memset(&pa, 0, sizeof pa);
        sim_addr(&pa.addr, via);
        pa.has_id = 1;
        memcpy(pa.id, s->n[via].id, DHT_ID_LEN);
        sim_run(s, s->now + gap, NULL);
        dht_node_join(s->n[i].node, &pa, 1, NULL, NULL, s->now);
        sim_after(s, i);
    }
    sim_run(s, s->now + 20000, NULL);

    /* Lookups of existing node IDs. */
    sim_probe *p = calloc(n_lookups > n_records ? n_lookups : n_records, sizeof *p);
    unsigned *hops = calloc(n_lookups + 1, sizeof *hops);
    uint64_t msgs = 0;
    for (size_t i = 0; i < n_lookups; i++) {
        uint32_t src = sim_pick_alive(s), dst = sim_pick_alive(s);
        while (dst == src)
            dst = sim_pick_alive(s);
        memcpy(p[i].want, s->n[dst].id, DHT_ID_LEN);
        if (dht_node_find(s->n[src].node, p[i].want, sim_find_cb, &p[i], s->now) != 0)
            p[i].done = 1;
        sim_after(s, src);
        sim_run(s, s->now + 5, NULL);
    }
    sim_wait(s, p, n_lookups, 120000);
    for (size_t i = 0; i < n_lookups; i++) {
        rep->found += p[i].ok != 0;
        hops[i] = p[i].hops;
        msgs += p[i].msgs;
    }
    rep->lookups = n_lookups;
    rep->success_rate = n_lookups ? (double)rep->found / (double)n_lookups : 0;
    qsort(hops, n_lookups, sizeof *hops, sim_cmp_u);
    if (n_lookups) {
        rep->median_hops = hops[n_lookups / 2];
        rep->p99_hops = hops[(n_lookups * 99) / 100 < n_lookups ? (n_lookups * 99) / 100 : n_lookups - 1];
    }
    rep->msgs_per_lookup = n_lookups ? (double)msgs / (double)n_lookups : 0;

    /* Records: signed puts from random nodes, then gets from others. */
    rep->records = n_records;
    for (size_t i = 0; i < n_records; i++) {
        uint8_t key[DHT_ID_LEN];
        char name[32], val[32];
        snprintf(name, sizeof name, "rec-%zu", i);
        snprintf(val, sizeof val, "value-%zu", i);
        dht_id_of_bytes(key, name, strlen(name));
        memset(&p[i], 0, sizeof p[i]);
        uint32_t src = sim_pick_alive(s);
        if (dht_node_put(s->n[src].node, key, NULL, 0, (const uint8_t *)val, strlen(val),
                         s->now + 3600 * 1000, 1, sim_put_cb, &p[i], s->now) != 0)
            p[i].done = 1;
        sim_after(s, src);
        sim_run(s, s->now + 5, NULL);
    }
    sim_wait(s, p, n_records, 120000);
    for (size_t i = 0; i < n_records; i++)
        rep->stored += p[i].ok != 0;
    sim_gets(s, p, n_records);
    for (size_t i = 0; i < n_records; i++)
        rep->found_before += p[i].ok != 0;

    /* Churn, republish, read again. */
    size_t kill = (size_t)(churn * (double)nodes);
    for (size_t k = 0; k < kill; k++)
        sim_kill(s, sim_pick_alive(s));
    rep->alive_after = nodes - kill;
    sim_run(s, s->now + (cfg.republish_ms * 5) / 2, NULL);
    sim_gets(s, p, n_records);
    for (size_t i = 0; i < n_records; i++)
        rep->found_after += p[i].ok != 0;

    uint64_t tx = 0;
    for (size_t i = 0; i < nodes; i++) {
        dht_node_stats st;
        dht_node_get_stats(s->n[i].node, &st);
        tx += st.tx_bytes;
    }
    rep->bytes_per_node = (double)tx / (double)nodes;
    free(p);
    free(hops);
    sim_destroy(&s);
    return 0;
}
