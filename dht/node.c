/* The Kademlia core: requests, replies, lookups, maintenance.
 *
 * Identity proofs: a request may carry a random 16-byte nonce; the reply then
 * carries the responder's ed25519 public key and its signature over
 * "starling-dht-id-v1" || nonce. We ask for a proof whenever the answer could
 * put the node into our table (an unknown ID, or a known ID at a new
 * address), so an ID cannot be claimed without its secret key and a table
 * entry always names a node that answered from that address. Known nodes are
 * then trusted by (ID, address, transaction ID), which spares a signature per
 * message.
 *
 * Write tokens (as in BitTorrent's DHT): every reply carries
 * BLAKE2b-64(secret, requester address); a store must present it, so a
 * sender must be able to receive at the address it stores from. The secret
 * rotates every token_ms and the previous one is still accepted.
 */
#include "dht/node.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include <sodium.h>
#include <uthash.h>

#include "dht/store.h"
#include "dht/table.h"

#define LOOKUP_MAX 64        /* candidates remembered per lookup */
#define MAX_RPCS 2048        /* outstanding requests per node */
#define MAX_LOOKUPS 256      /* concurrent operations per node */
#define MAX_OUT 4096         /* queued datagrams */
#define MAX_PAGES 16         /* get pages followed per node */
#define MAX_RESULTS 1024     /* entries one get collects */
#define HANDOVER_BUDGET 32   /* stores sent to one newcomer */
#define JOIN_ROUNDS 3        /* a join asks silent initial peers this many times */
#define REPUBLISH_BATCH 16   /* keys republished per housekeeping tick */
#define RL_SETS 64  /* rate-limit buckets: sets of RL_WAYS sources */
#define RL_WAYS 4
#define VERIFY_SLOTS 256 /* verify-ping throttle, by hashed claimed ID */
#define VCACHE_SETS 256      /* (ID, address) pairs proven recently, beyond the table: */
#define VCACHE_WAYS 4        /* 1,024 keyed 64-bit fingerprints, 8 KiB */
#define PROOF_CTX "starling-dht-id-v1"

enum rpc_kind { RPC_LOOKUP, RPC_PAGE, RPC_STORE, RPC_VERIFY, RPC_EVICT, RPC_HANDOVER, RPC_SELF };
enum cand_state { C_NEW, C_INFLIGHT, C_DONE, C_FAILED };
enum store_state { S_NONE, S_SENT, S_OK, S_FAILED };
enum op { OP_JOIN, OP_FIND, OP_GET, OP_PUT, OP_REFRESH, OP_REPUBLISH };

typedef struct rpc {
    uint32_t tid;
    uint8_t kind, req_type, has_id, has_nonce;
    uint8_t id[DHT_ID_LEN];
    uint8_t nonce[DHT_NONCE_LEN];
    dht_addr addr;
    uint32_t lookup_id;
    uint64_t deadline;
    UT_hash_handle hh;
} rpc;

typedef struct cand {
    uint8_t id[DHT_ID_LEN];
    dht_addr addr;
    uint8_t state, anon, has_token, pages, tries;
    uint8_t lost;           /* failed by timeout (not by a wrong answer) */
    uint8_t st;             /* put: store not sent, sent, stored, refused/lost */
    uint8_t token[DHT_TOKEN_LEN];
    uint16_t depth;
    uint64_t sent_at;       /* when the request in flight went out */
} cand;

/* An entry owned by a lookup (dht_entry borrows; this copies). */
typedef struct own_entry {
    uint8_t sub[DHT_MAX_SUBKEY];
    size_t sub_len;
    uint8_t *val;
    size_t val_len;
    uint64_t expires;
    int is_signed;
    uint8_t pk[32], sig[64];
} own_entry;

typedef struct lookup {
    struct lookup *next;
    uint32_t id;
    uint8_t op, phase, deferred;
    uint8_t rounds;         /* join: rounds of retries of silent peers so far */
    uint8_t target[DHT_ID_LEN];
    cand c[LOOKUP_MAX];
    size_t n;
    size_t q_inflight;      /* lookup requests in flight */
    uint64_t wake_at;       /* next time an in-flight request turns stale */
    size_t other_inflight;  /* page and store requests in flight */
    dht_node_cb cb;
    void *ud;
    own_entry *res;         /* get results, or the entries a put stores */
    size_t n_res, cap_res;
    unsigned msgs;
    int stored;
    uint64_t started;
    dht_join_diag why;      /* the first wrong-ID or foreign-swarm answer */
    uint8_t collision;      /* join: a node proved our ID from collision_addr */
    dht_addr collision_addr;
} lookup;

typedef struct outpkt {
    struct outpkt *next;
    dht_addr to;
    size_t len;
    uint8_t data[];
} outpkt;

struct dht_node {
    dht_identity ident;
    dht_config cfg;
    dht_table *table;
    dht_store *store;
    rpc *rpcs;
    size_t n_rpcs;
    lookup *lookups;
    size_t n_lookups;
    uint32_t next_lookup_id;
    int deferred;           /* some lookup must finish at the next tick */
    outpkt *out_head, *out_tail;
    size_t n_out;
    uint8_t rng_key[32];
    uint64_t rng_ctr;
    uint8_t pool[64];
    size_t pool_pos;
    uint8_t tok_cur[32], tok_prev[32];
    uint64_t tok_rotated;
    uint8_t rl_key[crypto_shorthash_KEYBYTES];
    struct { uint8_t ip[16]; uint64_t last, milli; } rl[RL_SETS][RL_WAYS];
    uint64_t verify_at[VERIFY_SLOTS]; /* last verify ping per hashed address */
    uint64_t vcache[VCACHE_SETS][VCACHE_WAYS]; /* most recent first, 0 = empty */
    uint64_t next_maint, next_republish;
    uint64_t next_selfcheck;  /* next lookup of our own ID (0: not joined) */
    size_t republish_cursor;
    int joined;
    int closing;            /* destroy is cancelling: no new operations */
    int families;           /* bit 0: can send to IPv4, bit 1: to IPv6 */
    dht_join_diag diag;     /* the latest join that failed for a known reason */
    dht_addr collision;     /* the latest node that proved our ID (family 0: none) */
    uint64_t collision_at;
    dht_node_stats st;
};

/* ---- small helpers ---- */

static void rng(dht_node *n, void *out, size_t len)
{
    uint8_t *o = out;
    while (len) {
        if (n->pool_pos == sizeof n->pool) {
            uint8_t nonce[crypto_stream_chacha20_NONCEBYTES] = {0};
            memcpy(nonce, &n->rng_ctr, sizeof n->rng_ctr < sizeof nonce ? sizeof n->rng_ctr : sizeof nonce);
            n->rng_ctr++;
            crypto_stream_chacha20(n->pool, sizeof n->pool, nonce, n->rng_key);
            n->pool_pos = 0;
        }
        size_t take = sizeof n->pool - n->pool_pos;
        if (take > len)
            take = len;
        memcpy(o, n->pool + n->pool_pos, take);
        n->pool_pos += take;
        o += take;
        len -= take;
    }
}

static void make_token(const dht_node *n, const uint8_t secret[32], const dht_addr *a,
                       uint8_t out[DHT_TOKEN_LEN])
{
    uint8_t packed[18];
    int len = dht_wire_addr_pack(packed, a);
    crypto_generichash(out, DHT_TOKEN_LEN, packed, len > 0 ? (size_t)len : 0, secret, 32);
    (void)n;
}

static int token_ok(const dht_node *n, const dht_addr *a, const uint8_t tok[DHT_TOKEN_LEN])
{
    uint8_t t1[DHT_TOKEN_LEN], t2[DHT_TOKEN_LEN];
    make_token(n, n->tok_cur, a, t1);
    make_token(n, n->tok_prev, a, t2);
    return sodium_memcmp(t1, tok, DHT_TOKEN_LEN) == 0 || sodium_memcmp(t2, tok, DHT_TOKEN_LEN) == 0;
}

/* Token bucket per source IP, in a set-associative table: the IP picks a
 * set by a keyed hash (a sender cannot aim at another's set) and keeps its
 * own bucket there, so two sources never share one; a new source takes the
 * set's least recently seen entry (starting with a full bucket). */
static int rate_ok(dht_node *n, const dht_addr *a, uint64_t now)
{
    static const uint8_t v6_loopback[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1};
    uint8_t h[crypto_shorthash_BYTES];
    /* Loopback senders share one address (a whole swarm in tests and
     * benchmarks) and are on this host anyway: limiting them protects
     * nothing and would throttle local swarms. */
    if ((a->family == 4 && a->ip[0] == 127) || (a->family == 6 && !memcmp(a->ip, v6_loopback, 16)))
        return 1;
    crypto_shorthash(h, a->ip, 16, n->rl_key);
    size_t set = (size_t)(h[0] | h[1] << 8) % RL_SETS, way = RL_WAYS;
    for (size_t w = 0; w < RL_WAYS && way == RL_WAYS; w++)
        if (n->rl[set][w].last != 0 && !memcmp(n->rl[set][w].ip, a->ip, 16))
            way = w;
    uint64_t cap = (uint64_t)n->cfg.rate_burst * 1000;
    if (way == RL_WAYS) {
        way = 0;
        for (size_t w = 1; w < RL_WAYS; w++)
            if (n->rl[set][w].last < n->rl[set][way].last)
                way = w;
        memcpy(n->rl[set][way].ip, a->ip, 16);
        n->rl[set][way].milli = cap;
    } else if (now > n->rl[set][way].last) {
        uint64_t add = (now - n->rl[set][way].last) * n->cfg.rate_per_s;
        n->rl[set][way].milli = n->rl[set][way].milli + add > cap ? cap : n->rl[set][way].milli + add;
    }
    n->rl[set][way].last = now ? now : 1;
    if (n->rl[set][way].milli < 1000)
        return 0;
    n->rl[set][way].milli -= 1000;
    return 1;
}

/* At most one verify ping per claimed ID (hashed) per timeout period, so a
 * burst of requests from an unknown node is not answered by a burst of pings
 * (fresh IDs from one address are bounded by that address's rate limit). */
static int verify_due_key(dht_node *n, const uint8_t *key, size_t len, uint64_t now)
{
    uint8_t h[crypto_shorthash_BYTES];
    crypto_shorthash(h, key, len, n->rl_key);
    size_t slot = (size_t)(h[2] | h[3] << 8) % VERIFY_SLOTS;
    if (n->verify_at[slot] && now < n->verify_at[slot] + n->cfg.rpc_timeout_ms)
        return 0;
    n->verify_at[slot] = now ? now : 1;
    return 1;
}

static int verify_due(dht_node *n, const uint8_t id[DHT_ID_LEN], uint64_t now)
{
    return verify_due_key(n, id, DHT_ID_LEN, now);
}

/* Queues body for to, followed by our swarm tag when tagged (and we have a
 * key). */
static void emit_as(dht_node *n, const dht_addr *to, const uint8_t *body, size_t len, int tagged)
{
    tagged = tagged && n->cfg.has_swarm_key;
    size_t total = len + (tagged ? DHT_TAG_LEN : 0);
    outpkt *p;
    if (n->n_out >= MAX_OUT || total > DHT_MAX_DATAGRAM || !(p = malloc(sizeof *p + total))) {
        n->st.drop_queue++;
        return;
    }
    p->next = NULL;
    p->to = *to;
    p->len = total;
    memcpy(p->data, body, len);
    if (tagged)
        dht_wire_tag(p->data + len, n->cfg.swarm_key, body, len);
    if (n->out_tail)
        n->out_tail->next = p;
    else
        n->out_head = p;
    n->out_tail = p;
    n->n_out++;
    n->st.tx++;
    n->st.tx_bytes += total;
}

static void emit(dht_node *n, const dht_addr *to, const uint8_t *body, size_t len)
{
    emit_as(n, to, body, len, 1);
}

static int send_msg(dht_node *n, const dht_msg *m, const dht_addr *to)
{
    uint8_t buf[DHT_MAX_DATAGRAM];
    int len = dht_wire_encode(m, buf, sizeof buf);
    if (len < 0)
        return len;
    emit(n, to, buf, (size_t)len);
    return 0;
}

/* Fingerprint of (id, addr): SipHash keyed with a secret, so nobody can
 * aim a pair at another's entry; never 0. */
static uint64_t vprint(const dht_node *n, const uint8_t id[DHT_ID_LEN], const dht_addr *addr)
{
    uint8_t buf[DHT_ID_LEN + 18], h[crypto_shorthash_BYTES];
    uint64_t v;
    int len = dht_wire_addr_pack(buf + DHT_ID_LEN, addr);
    memcpy(buf, id, DHT_ID_LEN);
    crypto_shorthash(h, buf, DHT_ID_LEN + (len > 0 ? (size_t)len : 0), n->rl_key);
    memcpy(&v, h, sizeof v);
    return v | 1;
}

/* 1 if id proved itself at addr: it is in the table there, or it answered
 * a challenge recently (a small set-associative cache, so that lookups do
 * not ask the same non-table nodes for a signature again and again). */
static int known_at(dht_node *n, const uint8_t id[DHT_ID_LEN], const dht_addr *addr)
{
    dht_table_entry *e = dht_table_find(n->table, id);
    if (e)
        return dht_addr_equal(&e->addr, addr);
    uint64_t v = vprint(n, id, addr);
    const uint64_t *set = n->vcache[(v >> 32) % VCACHE_SETS];
    for (size_t w = 0; w < VCACHE_WAYS; w++)
        if (set[w] == v)
            return 1;
    return 0;
}

static void proven(dht_node *n, const uint8_t id[DHT_ID_LEN], const dht_addr *addr)
{
    uint64_t v = vprint(n, id, addr);
    uint64_t *set = n->vcache[(v >> 32) % VCACHE_SETS];
    size_t w = 0;
    while (w < VCACHE_WAYS - 1 && set[w] != v)
        w++;
    memmove(&set[1], &set[0], w * sizeof *set); /* to the front; the oldest goes */
    set[0] = v;
}

/* Proof is needed unless id is known to be at addr. A node answering with
 * our own ID always proves it: that answer is what tells another process
 * running with our identity from a stale or false contact (and our own
 * request looped back to us is recognised by its nonce). */
static int need_proof(dht_node *n, const uint8_t *id, const dht_addr *addr)
{
    if (id && memcmp(id, n->ident.id, DHT_ID_LEN) == 0)
        return 1;
    if (!n->cfg.verify_ids)
        return 0;
    return !id || !known_at(n, id, addr);
}

/* Sends request m (type, target, ... filled by the caller) and records it.
 * Returns 0 or -EAGAIN when too many requests are outstanding. */
static int send_request(dht_node *n, dht_msg *m, const dht_addr *to, const uint8_t *expect_id,
                        int kind, uint32_t lookup_id, uint64_t now)
{
    rpc *r, *dup;
    if (n->n_rpcs >= MAX_RPCS)
        return -EAGAIN;
    r = calloc(1, sizeof *r);
    if (!r)
        return -ENOMEM;
    for (;;) {
        rng(n, &r->tid, sizeof r->tid);
        HASH_FIND_INT(n->rpcs, &r->tid, dup);
        if (!dup)
            break;
    }
    r->kind = (uint8_t)kind;
    r->req_type = m->type;
    r->addr = *to;
    r->lookup_id = lookup_id;
    r->deadline = now + n->cfg.rpc_timeout_ms;
    if (expect_id) {
        r->has_id = 1;
        memcpy(r->id, expect_id, DHT_ID_LEN);
    }
    m->tid = r->tid;
    m->read_only = n->cfg.client_only;
    memcpy(m->id, n->ident.id, DHT_ID_LEN);
    m->has_nonce = 0;
    if (need_proof(n, expect_id, to)) {
        r->has_nonce = 1;
        rng(n, r->nonce, sizeof r->nonce);
        m->has_nonce = 1;
        memcpy(m->nonce, r->nonce, sizeof r->nonce);
    }
    int rc = send_msg(n, m, to);
    if (rc < 0) {
        free(r);
        return rc;
    }
    HASH_ADD_INT(n->rpcs, tid, r);
    n->n_rpcs++;
    if (m->type < 5)
        n->st.req_sent[m->type]++;
    return 0;
}

static void send_ping(dht_node *n, const dht_addr *to, const uint8_t *id, int kind, uint64_t now)
{
    dht_msg m;
    memset(&m, 0, sizeof m);
    m.type = DHT_MSG_PING;
    (void)send_request(n, &m, to, id, kind, 0, now);
}

/* A request to id at addr failed. Only a failure at the address the table
 * holds counts against the entry: a node list naming the ID at another
 * (dead, or someone else's) address must not wear down a live entry, or a
 * second address could take the ID over once it is dropped. */
static void table_failed_at(dht_node *n, const uint8_t id[DHT_ID_LEN], const dht_addr *addr, int force)
{
    dht_table_entry *e = dht_table_find(n->table, id);
    if (e && dht_addr_equal(&e->addr, addr))
        dht_table_failed(n->table, id, force);
}

static lookup *lookup_by_id(dht_node *n, uint32_t id);

/* Remembers in r's join why it may fail: r's node answered with another ID
 * (got) or is under another swarm key. The first such answer is kept. */
static void note_problem(dht_node *n, const rpc *r, int status, const uint8_t *got)
{
    lookup *l = r->kind == RPC_LOOKUP && r->lookup_id ? lookup_by_id(n, r->lookup_id) : NULL;
    if (!l || l->op != OP_JOIN || l->why.status)
        return;
    l->why.status = status;
    l->why.addr = r->addr;
    l->why.have_swarm_key = n->cfg.has_swarm_key;
    if (r->has_id)
        memcpy(l->why.expected, r->id, DHT_ID_LEN);
    if (got)
        memcpy(l->why.got, got, DHT_ID_LEN);
}

/* Someone's node list (or the command line) names our own ID at addr. If
 * the node there proves the ID, it holds our secret key: another process
 * runs with our identity. Asked at most once per address per timeout
 * period; a join waits for the answer (rpc_done, RPC_SELF). Our own
 * address listed by a node that sees us there is harmless: we drop our
 * own ping (recognised by its nonce) and it times out. */
static void self_check(dht_node *n, lookup *l, const dht_addr *addr, uint64_t now)
{
    uint8_t key[1 + 18];
    dht_msg m;
    int len = dht_wire_addr_pack(key + 1, addr);
    if (len < 0 || !addr->port || !(n->families & (addr->family == 6 ? 2 : 1)))
        return;
    key[0] = 0xa5; /* not an ID: its own throttle slot */
    if (!verify_due_key(n, key, 1 + (size_t)len, now))
        return;
    int join = l && l->op == OP_JOIN;
    memset(&m, 0, sizeof m);
    m.type = DHT_MSG_PING;
    if (send_request(n, &m, addr, n->ident.id, RPC_SELF, join ? l->id : 0, now) == 0 && join) {
        l->other_inflight++;
        l->msgs++;
    }
}

static void own_from(own_entry *o, const dht_entry *e)
{
    memset(o, 0, sizeof *o);
    if (e->subkey_len)
        memcpy(o->sub, e->subkey, e->subkey_len);
    o->sub_len = e->subkey_len;
    o->val_len = e->value_len;
    o->expires = e->expires;
    o->is_signed = e->is_signed;
    memcpy(o->pk, e->pk, 32);
    memcpy(o->sig, e->sig, 64);
}

static void own_view(dht_entry *e, const own_entry *o)
{
    memset(e, 0, sizeof *e);
    e->subkey = o->sub;
    e->subkey_len = o->sub_len;
    e->value = o->val;
    e->value_len = o->val_len;
    e->expires = o->expires;
    e->is_signed = o->is_signed;
    memcpy(e->pk, o->pk, 32);
    memcpy(e->sig, o->sig, 64);
}

/* 1 if l->res holds e's (signed, subkey) with the same or a later
 * expiration: merging e would change nothing. */
static int have_entry(const lookup *l, const dht_entry *e)
{
    for (size_t i = 0; i < l->n_res; i++) {
        const own_entry *o = &l->res[i];
        if (o->is_signed == e->is_signed && o->sub_len == e->subkey_len &&
            (!e->subkey_len || memcmp(o->sub, e->subkey, e->subkey_len) == 0))
            return o->expires >= e->expires;
    }
    return 0;
}

/* Replaces o's copy with e's (value copied); on no memory o stays as it was. */
static void own_replace(own_entry *o, const dht_entry *e)
{
    uint8_t *v = malloc(e->value_len ? e->value_len : 1);
    if (!v)
        return;
    free(o->val);
    own_from(o, e);
    o->val = v;
    if (e->value_len)
        memcpy(v, e->value, e->value_len);
}

/* Adds e to l->res, one per (signed, subkey), newest expiration winning. */
static void merge_entry(lookup *l, const dht_entry *e)
{
    for (size_t i = 0; i < l->n_res; i++) {
        own_entry *o = &l->res[i];
        if (o->is_signed == e->is_signed && o->sub_len == e->subkey_len &&
            (!e->subkey_len || memcmp(o->sub, e->subkey, e->subkey_len) == 0)) {
            if (e->expires > o->expires)
                own_replace(o, e);
            return;
        }
    }
    if (l->n_res >= MAX_RESULTS) {
        /* Full: a signed entry takes the place of an unsigned one, so that
         * holders answering with unsigned junk cannot crowd out the owners'
         * entries that other holders return. */
        size_t u = l->n_res;
        while (u > 0 && l->res[u - 1].is_signed)
            u--;
        if (!e->is_signed || u == 0)
            return;
        own_replace(&l->res[u - 1], e);
        return;
    }
    if (l->n_res == l->cap_res) {
        size_t nc = l->cap_res ? l->cap_res * 2 : 4;
        own_entry *nr = realloc(l->res, nc * sizeof *nr);
        if (!nr)
            return;
        l->res = nr;
        l->cap_res = nc;
    }
    own_entry *o = &l->res[l->n_res];
    own_from(o, e);
    o->val = malloc(e->value_len ? e->value_len : 1);
    if (!o->val)
        return;
    if (e->value_len)
        memcpy(o->val, e->value, e->value_len);
    l->n_res++;
}

/* ---- table maintenance ---- */

static void handover(dht_node *n, const dht_table_entry *newcomer, uint64_t now);

/* A node proved (or is trusted to have) id at addr. */
static void node_seen(dht_node *n, const uint8_t id[DHT_ID_LEN], const dht_addr *addr,
                      const uint8_t *token, uint64_t now)
{
    dht_table_entry *ping = NULL;
    int rc = dht_table_insert(n->table, id, addr, token, now, &ping);
    if (rc == DHT_TABLE_ADDED) {
        dht_table_entry *e = dht_table_find(n->table, id);
        if (e) {
            dht_table_entry copy = *e;
            handover(n, &copy, now);
        }
    } else if (rc == DHT_TABLE_CACHED && ping) {
        dht_table_entry copy = *ping;
        send_ping(n, &copy.addr, copy.id, RPC_EVICT, now);
    } else if (rc == -EDQUOT) {
        n->st.table_refused++;
    }
}

/* Stores our signed records on a newcomer that is closer to their keys than
 * we are: it will be asked for them from now on. */
static void handover(dht_node *n, const dht_table_entry *nc, uint64_t now)
{
    uint8_t keys[64][DHT_ID_LEN];
    dht_entry ents[8];
    size_t cursor = 0, budget = HANDOVER_BUDGET;
    if (!nc->has_token || !dht_store_count_keys(n->store))
        return;
    do {
        size_t nk = dht_store_keys(n->store, &cursor, keys, 64);
        for (size_t i = 0; i < nk && budget; i++) {
            if (dht_id_distance_cmp(keys[i], nc->id, n->ident.id) >= 0)
                continue;
            size_t ne = dht_store_get(n->store, keys[i], now, 0, ents, 8, NULL);
            /* Signed entries only (they come first): an unsigned entry has
             * no owner to vouch for it, and relaying it would spread
             * whatever anyone wrote here to every newcomer. Its writer
             * stores it where it should be. */
            for (size_t j = 0; j < ne && budget && ents[j].is_signed; j++, budget--) {
                dht_msg m;
                memset(&m, 0, sizeof m);
                m.type = DHT_MSG_STORE;
                memcpy(m.target, keys[i], DHT_ID_LEN);
                m.has_token = 1;
                memcpy(m.token, nc->token, DHT_TOKEN_LEN);
                m.n_entries = 1;
                m.entries[0] = ents[j];
                (void)send_request(n, &m, &nc->addr, nc->id, RPC_HANDOVER, 0, now);
            }
        }
    } while (cursor && budget);
}

/* ---- lookups ---- */

static int cand_cmp(const cand *a, const cand *b, const uint8_t target[DHT_ID_LEN])
{
    if (a->anon != b->anon)
        return a->anon ? -1 : 1;
    if (a->anon)
        return 0;
    return dht_id_distance_cmp(target, a->id, b->id);
}

static void cand_sort(lookup *l)
{
    for (size_t i = 1; i < l->n; i++) {
        cand x = l->c[i];
        size_t j = i;
        while (j > 0 && cand_cmp(&x, &l->c[j - 1], l->target) < 0) {
            l->c[j] = l->c[j - 1];
            j--;
        }
        l->c[j] = x;
    }
}

static void cand_add(dht_node *n, lookup *l, const uint8_t id[DHT_ID_LEN], const dht_addr *addr,
                     unsigned depth)
{
    if (memcmp(id, n->ident.id, DHT_ID_LEN) == 0 || !(n->families & (addr->family == 6 ? 2 : 1)))
        return;
    for (size_t i = 0; i < l->n; i++)
        if (!l->c[i].anon && memcmp(l->c[i].id, id, DHT_ID_LEN) == 0)
            return;
    cand x;
    memset(&x, 0, sizeof x);
    memcpy(x.id, id, DHT_ID_LEN);
    x.addr = *addr;
    x.depth = (uint16_t)(depth > 0xffff ? 0xffff : depth);
    size_t pos = l->n;
    while (pos > 0 && cand_cmp(&x, &l->c[pos - 1], l->target) < 0)
        pos--;
    if (pos >= LOOKUP_MAX)
        return;
    /* At most DHT_LOOKUP_PER_NET candidates per network: the nearest. IDs
     * cost nothing to grind near a key, networks do, so this bounds how
     * much of the k nearest (and of a get's quorum) one network can hold.
     * The target's own ID is exempt: a find for a node must find it. */
    int limited = dht_addr_limited(addr, n->cfg.diversity) &&
                  memcmp(id, l->target, DHT_ID_LEN) != 0;
    dht_addr net, y;
    if (limited) {
        size_t closer = 0;
        dht_addr_prefix(&net, addr, dht_addr_net_bits(addr));
        for (size_t i = 0; i < pos; i++) {
            dht_addr_prefix(&y, &l->c[i].addr, dht_addr_net_bits(addr));
            closer += !l->c[i].anon && dht_addr_equal(&y, &net);
        }
        if (closer >= DHT_LOOKUP_PER_NET) {
            n->st.lookup_refused++;
            return;
        }
    }
    size_t keep = l->n < LOOKUP_MAX ? l->n : LOOKUP_MAX - 1;
    memmove(&l->c[pos + 1], &l->c[pos], (keep - pos) * sizeof x);
    l->c[pos] = x;
    if (l->n < LOOKUP_MAX)
        l->n++;
    if (limited) {
        /* The network may now have one too many: its farthest goes. */
        size_t seen = 0;
        for (size_t i = 0; i < l->n; i++) {
            if (l->c[i].anon || memcmp(l->c[i].id, l->target, DHT_ID_LEN) == 0)
                continue;
            dht_addr_prefix(&y, &l->c[i].addr, dht_addr_net_bits(addr));
            if (dht_addr_equal(&y, &net) && ++seen > DHT_LOOKUP_PER_NET) {
                memmove(&l->c[i], &l->c[i + 1], (l->n - i - 1) * sizeof x);
                l->n--;
                n->st.lookup_refused++;
                break;
            }
        }
    }
}

static lookup *lookup_by_id(dht_node *n, uint32_t id)
{
    for (lookup *l = n->lookups; l; l = l->next)
        if (l->id == id)
            return l;
    return NULL;
}

static cand *cand_find(lookup *l, const uint8_t id[DHT_ID_LEN], const dht_addr *addr)
{
    for (size_t i = 0; i < l->n; i++) {
        if (l->c[i].anon ? dht_addr_equal(&l->c[i].addr, addr)
                         : memcmp(l->c[i].id, id, DHT_ID_LEN) == 0)
            return &l->c[i];
    }
    return NULL;
}

static lookup *lookup_new(dht_node *n, int op, const uint8_t target[DHT_ID_LEN], dht_node_cb cb,
                          void *ud)
{
    dht_table_entry seeds[LOOKUP_MAX];
    if (n->n_lookups >= MAX_LOOKUPS)
        return NULL;
    lookup *l = calloc(1, sizeof *l);
    if (!l)
        return NULL;
    l->id = ++n->next_lookup_id;
    l->op = (uint8_t)op;
    memcpy(l->target, target, DHT_ID_LEN);
    l->cb = cb;
    l->ud = ud;
    size_t ns = dht_table_closest(n->table, target, n->cfg.k, seeds);
    for (size_t i = 0; i < ns; i++)
        cand_add(n, l, seeds[i].id, &seeds[i].addr, 1);
    l->next = n->lookups;
    n->lookups = l;
    n->n_lookups++;
    return l;
}

static void lookup_free(lookup *l)
{
    for (size_t i = 0; i < l->n_res; i++)
        free(l->res[i].val);
    free(l->res);
    free(l);
}

static void lookup_unlink(dht_node *n, lookup *l)
{
    for (lookup **pp = &n->lookups; *pp; pp = &(*pp)->next) {
        if (*pp == l) {
            *pp = l->next;
            n->n_lookups--;
            return;
        }
    }
}

static void start_refresh(dht_node *n, int bucket, uint64_t now);

/* Runs l's callback (once: a put reports before its last stores are
 * acknowledged, and l lives on without a callback). */
static void lookup_report(dht_node *n, lookup *l, int status)
{
    dht_wire_node nodes[DHT_WIRE_MAX_NODES];
    dht_entry *ents = NULL;
    dht_result r;
    size_t nn = 0;
    dht_node_cb cb = l->cb;
    if (!cb)
        return;
    l->cb = NULL;
    memset(&r, 0, sizeof r);
    for (size_t i = 0; i < l->n && nn < n->cfg.k && nn < DHT_WIRE_MAX_NODES; i++) {
        if (l->c[i].state != C_DONE)
            continue;
        if (nn == 0)
            r.hops = l->c[i].depth;
        memcpy(nodes[nn].id, l->c[i].id, DHT_ID_LEN);
        nodes[nn].addr = l->c[i].addr;
        nn++;
    }
    if (l->op == OP_GET && l->n_res) {
        ents = calloc(l->n_res, sizeof *ents);
        if (ents)
            for (size_t i = 0; i < l->n_res; i++)
                own_view(&ents[i], &l->res[i]);
        else
            status = -ENOMEM;
        r.n_entries = ents ? l->n_res : 0;
    }
    r.status = status;
    r.entries = ents;
    r.nodes = nodes;
    r.n_nodes = nn;
    r.msgs = l->msgs;
    cb(l->ud, &r);
    free(ents);
}

static void lookup_finish(dht_node *n, lookup *l, int status)
{
    lookup_unlink(n, l);
    lookup_report(n, l, status);
    lookup_free(l);
}

static void lookup_send(dht_node *n, lookup *l, cand *c, uint64_t now)
{
    dht_msg m;
    memset(&m, 0, sizeof m);
    m.type = l->op == OP_GET ? DHT_MSG_GET : DHT_MSG_FIND_NODE;
    memcpy(m.target, l->target, DHT_ID_LEN);
    if (send_request(n, &m, &c->addr, c->anon ? NULL : c->id, RPC_LOOKUP, l->id, now) == 0) {
        c->state = C_INFLIGHT;
        c->sent_at = now;
        l->q_inflight++;
        l->msgs++;
    } else {
        c->state = C_FAILED;
    }
}

static void store_phase(dht_node *n, lookup *l, uint64_t now);
static void put_progress(dht_node *n, lookup *l, uint64_t now, int may_finish);

/* How many of the nearest candidates must answer before the lookup is
 * over: k (they are the nodes to store on, or the answer to find_node),
 * but only the read quorum for a get. */
static size_t lookup_want(const dht_node *n, const lookup *l)
{
    if (l->op == OP_GET && n->cfg.quorum < n->cfg.k)
        return n->cfg.quorum;
    return n->cfg.k;
}

/* Advances l: sends up to alpha requests toward the k closest candidates and
 * notices when the lookup (and its pages and stores) are over. With
 * may_finish == 0 (inside the call that started it) completion is deferred
 * to the next tick, so the callback never runs inside the starting call. */
static void lookup_step(dht_node *n, lookup *l, uint64_t now, int may_finish)
{
again:
    if (l->phase == 0) {
        /* A request unanswered for a quarter of the timeout is "stale": it
         * no longer holds one of the alpha slots, and the lookup may finish
         * without it once k closer-or-equal nodes have answered. Dead nodes
         * then cost a lookup rpc_timeout/4, not the full timeout (the full
         * timeout still decides whether the table drops them). */
        uint64_t soft = n->cfg.rpc_timeout_ms / 4;
        size_t counted = 0, active = 0, want = lookup_want(n, l);
        int busy = 0;
        l->wake_at = UINT64_MAX;
        size_t limit = n->cfg.alpha, seen = 0;
        int near_done = 1;
        for (size_t i = 0; i < l->n; i++) {
            const cand *c = &l->c[i];
            int stale = c->state == C_INFLIGHT && now >= c->sent_at + soft;
            int resent = c->state == C_INFLIGHT && c->tries && l->op == OP_GET;
            if (c->state == C_INFLIGHT && !stale && !resent)
                active++;
            if (c->state == C_FAILED || (stale && c->tries) || resent)
                continue; /* presumed dead: does not hold the lookup back */
            if (seen++ < n->cfg.alpha && c->state != C_DONE)
                near_done = 0;
        }
        /* Once the alpha nearest candidates have answered, the lookup has
         * converged: ask the rest of the k nearest all at once instead of
         * alpha per round trip (the final step of Kademlia's lookup). */
        if (near_done && seen >= n->cfg.alpha)
            limit = want;
        /* A get asks all of its (few) nearest candidates at once from the
         * start: it needs the quorum's answers anyway, and a round trip
         * costs more than the few requests to nodes that turn out not to
         * be among the nearest. */
        if (l->op == OP_GET)
            limit = want;
        else if (l->op == OP_PUT && limit < n->cfg.quorum)
            limit = n->cfg.quorum; /* its quorum first, as a get does */
        for (size_t i = 0; i < l->n && counted < want; i++) {
            cand *c = &l->c[i];
            if (c->state == C_FAILED)
                continue;
            if (c->state == C_NEW && active < limit) {
                lookup_send(n, l, c, now);
                if (c->state == C_INFLIGHT)
                    active++;
            }
            if (c->state == C_FAILED)
                continue;
            if (c->state == C_INFLIGHT && now >= c->sent_at + soft) {
                /* First time stale: ask again at once (a lost datagram
                 * should not cost a lookup its best candidate). A find
                 * asks its alpha nearest a third time: they are the
                 * answer itself (the node looked for, usually), and two
                 * lost exchanges in a row are not that rare at scale. */
                if (c->tries == 0 ||
                    (c->tries == 1 && l->op == OP_FIND && counted < n->cfg.alpha)) {
                    c->tries++;
                    lookup_send(n, l, c, now);
                    if (c->state == C_FAILED)
                        continue;
                } else {
                    continue; /* stale twice: neither counted nor waited for */
                }
            }
            /* A get does not wait for a node that was silent once: its
             * request went out again, but the next candidate takes its place
             * in the quorum now (an answer that still comes is merged). A
             * dead node among the nearest then costs a get rpc_timeout/4,
             * not twice that. */
            if (l->op == OP_GET && c->state == C_INFLIGHT && c->tries)
                continue;
            counted++;
            if (c->state == C_INFLIGHT && c->sent_at + soft < l->wake_at)
                l->wake_at = c->sent_at + soft;
            if (c->state != C_DONE)
                busy = 1;
        }
        if (l->op == OP_PUT)
            put_progress(n, l, now, may_finish);
        /* (A put's early stores need not be acknowledged to go on.) */
        if (busy || (l->other_inflight && l->op != OP_PUT))
            return;
        dht_table_bucket_touch(n->table, dht_id_common_prefix(n->ident.id, l->target), now);
        if (l->op == OP_PUT || l->op == OP_REPUBLISH) {
            l->phase = 1;
            store_phase(n, l, now);
            if (l->other_inflight)
                return;
        }
    } else {
        if (l->op == OP_PUT)
            put_progress(n, l, now, may_finish);
        if (l->other_inflight)
            return;
    }
    if (!may_finish) {
        l->deferred = 1;
        n->deferred = 1;
        return;
    }
    int any_done = 0;
    for (size_t i = 0; i < l->n; i++)
        any_done |= l->c[i].state == C_DONE;
    if (l->op == OP_JOIN && !any_done && l->rounds + 1 < JOIN_ROUNDS) {
        /* Nobody answered: with datagram loss a single silent initial peer
         * is not yet a dead one, and a node whose join fails stays alone
         * (and whoever joins through it forms an island). Ask the silent
         * ones again (not those that answered wrongly). */
        int retry = 0;
        for (size_t i = 0; i < l->n; i++) {
            cand *c = &l->c[i];
            if (c->state == C_INFLIGHT || (c->state == C_FAILED && c->lost)) {
                c->state = C_NEW;
                c->tries = 0;
                c->lost = 0;
                retry = 1;
            }
        }
        l->rounds++;
        if (retry)
            goto again;
    }
    int status = 0;
    switch (l->op) {
    case OP_JOIN: {
        int coll = l->collision || (n->collision_at && n->collision_at >= l->started);
        status = any_done && dht_table_size(n->table) ? 0 : -EHOSTUNREACH;
        if (status < 0 && l->why.status) {
            status = l->why.status; /* the nodes that answered told us why */
            n->diag = l->why;
        }
        if (coll) {
            memset(&n->diag, 0, sizeof n->diag);
            n->diag.status = -EADDRINUSE;
            n->diag.addr = l->collision ? l->collision_addr : n->collision;
            memcpy(n->diag.expected, n->ident.id, DHT_ID_LEN);
        }
        if (status == 0) {
            /* A join through a node that was itself still joining sees
             * few nodes: look ourselves up again soon, when the swarm has
             * learned more (and then every refresh period). */
            if (!n->joined) {
                /* Look ourselves up once more shortly: nodes that joined
                 * meanwhile (or a seed that was itself still joining) make
                 * the first answer incomplete. */
                n->next_selfcheck = now + 5ull * n->cfg.maint_ms;
                /* Refresh every bucket farther than our neighbourhood, so
                 * the table learns nodes at every distance now, not in 15
                 * minutes. (Later self-lookups only renew the neighbourhood:
                 * the periodic bucket refresh covers the rest.) */
                int depth = dht_table_depth(n->table);
                for (int b = 0; b < DHT_BUCKETS; b++)
                    dht_table_bucket_touch(n->table, b, now); /* the self-lookup covered the rest */
                for (int b = 0; b < depth; b++)
                    start_refresh(n, b, now);
            }
            n->joined = 1;
        }
        /* Reported even when the join worked: the caller must not go on as
         * a second copy of another node. */
        if (coll)
            status = -EADDRINUSE;
        break;
    }
    case OP_GET: {
        dht_entry local[32];
        size_t off = 0, total = 0, got;
        do {
            got = dht_store_get(n->store, l->target, now, off, local, 32, &total);
            for (size_t i = 0; i < got; i++)
                merge_entry(l, &local[i]);
            off += got;
        } while (got && off < total);
        status = any_done || l->n_res ? 0 : -EHOSTUNREACH;
        break;
    }
    case OP_PUT:
    case OP_REPUBLISH:
        status = l->stored > 0 ? l->stored : -EHOSTUNREACH;
        break;
    default:
        status = any_done ? 0 : -EHOSTUNREACH;
    }
    lookup_finish(n, l, status);
}

/* Sends the entries of l to c (which answered and gave us its token). */
static void store_send(dht_node *n, lookup *l, cand *c, uint64_t now)
{
    c->st = S_FAILED;
    for (size_t j = 0; j < l->n_res; j++) {
        dht_msg m;
        memset(&m, 0, sizeof m);
        m.type = DHT_MSG_STORE;
        memcpy(m.target, l->target, DHT_ID_LEN);
        m.has_token = 1;
        memcpy(m.token, c->token, DHT_TOKEN_LEN);
        m.n_entries = 1;
        own_view(&m.entries[0], &l->res[j]);
        if (send_request(n, &m, &c->addr, c->id, RPC_STORE, l->id, now) == 0) {
            l->other_inflight++;
            l->msgs++;
            c->st = S_SENT;
        }
    }
}

/* A put does not wait for its whole lookup before storing: each of the k
 * nearest candidates gets the entry as soon as every candidate nearer than
 * it has answered (or is presumed dead), so the nearest, which settle
 * first, store while the lookup still completes the farther ones. The put
 * reports (status: stores acknowledged so far) once the quorum nearest have
 * stored it, which is when a get (asking the quorum nearest) finds it; the
 * lookup and the stores to the rest of the k go on without a callback. */
static void put_progress(dht_node *n, lookup *l, uint64_t now, int may_finish)
{
    uint64_t soft = n->cfg.rpc_timeout_ms / 4;
    size_t pos = 0, ok = 0, quorum = n->cfg.quorum < n->cfg.k ? n->cfg.quorum : n->cfg.k;
    int ready = 1;
    for (size_t i = 0; i < l->n && pos < n->cfg.k; i++) {
        cand *c = &l->c[i];
        if (c->state == C_FAILED ||
            (c->state == C_INFLIGHT && c->tries && now >= c->sent_at + soft))
            continue; /* presumed dead, as the lookup presumes */
        if (c->state != C_DONE) {
            if (ok < quorum)
                ready = 0; /* a nearer node may still answer */
            break;
        }
        if (!c->has_token)
            continue;
        pos++;
        if (c->st == S_NONE)
            store_send(n, l, c, now);
        if (ok < quorum) {
            if (c->st == S_OK)
                ok++;
            else if (c->st != S_FAILED)
                ready = 0;
        }
    }
    if (ready && ok >= quorum && may_finish)
        lookup_report(n, l, l->stored);
}

/* Sends the entries of a put (or republish) to the k closest nodes that
 * answered and gave us a write token; stores here too when we are one of
 * them (a put's originator is a holder when it is among the k closest). */
static void store_phase(dht_node *n, lookup *l, uint64_t now)
{
    size_t done = 0;
    const uint8_t *kth = NULL;
    if (l->op == OP_REPUBLISH) {
        /* Republish the signed entries we hold now (fresh copies: some may
         * have expired). Unsigned ones are not relayed: a node that stored
         * junk on us must not have every honest holder spread it to the k
         * nearest every republish period (its writer re-stores it, if it
         * wants it kept). Signed entries sort first. */
        dht_entry local[32];
        size_t off = 0, total = 0, got;
        int more = 1;
        do {
            got = dht_store_get(n->store, l->target, now, off, local, 32, &total);
            for (size_t i = 0; i < got && more; i++) {
                if (!local[i].is_signed)
                    more = 0;
                else
                    merge_entry(l, &local[i]);
            }
            off += got;
        } while (more && got && off < total);
    }
    for (size_t i = 0; i < l->n && done < n->cfg.k; i++) {
        cand *c = &l->c[i];
        if (c->state != C_DONE || !c->has_token)
            continue;
        done++;
        kth = c->id;
        if (c->st == S_NONE)
            store_send(n, l, c, now);
    }
    if (l->op == OP_PUT && (done < n->cfg.k || !kth ||
                            dht_id_distance_cmp(l->target, n->ident.id, kth) < 0)) {
        int any = 0;
        for (size_t j = 0; j < l->n_res; j++) {
            dht_entry e;
            own_view(&e, &l->res[j]);
            any |= dht_store_put(n->store, l->target, &e, now) >= 0;
        }
        l->stored += any;
    }
}

static void start_refresh(dht_node *n, int b, uint64_t now)
{
    uint8_t target[DHT_ID_LEN];
    if (b < 0 || b >= DHT_BUCKETS)
        return;
    rng(n, target, sizeof target);
    /* Keep our first b bits, flip bit b: an ID that falls in bucket b. */
    for (int i = 0; i <= b; i++) {
        uint8_t mask = (uint8_t)(0x80 >> (i % 8));
        uint8_t want = (uint8_t)(n->ident.id[i / 8] & mask) ^ (i == b ? mask : 0);
        target[i / 8] = (uint8_t)((target[i / 8] & ~mask) | want);
    }
    dht_table_bucket_touch(n->table, b, now);
    lookup *l = n->closing ? NULL : lookup_new(n, OP_REFRESH, target, NULL, NULL);
    if (l)
        lookup_step(n, l, now, 0);
}

/* ---- requests ---- */

/* Fills r's node list. The requester (exclude at from) is left out; an
 * entry with the requester's ID at ANOTHER address is not the requester but
 * a second node with its identity, and is listed so that it can tell. */
static void reply_nodes(dht_node *n, dht_msg *r, const uint8_t target[DHT_ID_LEN],
                        const uint8_t *exclude, const dht_addr *from, size_t max, uint8_t family)
{
    dht_table_entry e[DHT_WIRE_MAX_NODES + 1];
    size_t ne = dht_table_closest(n->table, target, max + 1, e);
    r->n_nodes = 0;
    for (size_t i = 0; i < ne && r->n_nodes < max; i++) {
        if (exclude && memcmp(e[i].id, exclude, DHT_ID_LEN) == 0 && dht_addr_equal(&e[i].addr, from))
            continue;
        /* Only nodes the requester can reach: it asked over this family.
         * (Entries whose last request failed are still handed out: with
         * datagram loss, hiding them hides live nodes; lookups stop waiting
         * for silent ones after rpc_timeout/4 anyway.) */
        if (family && e[i].addr.family != family)
            continue;
        memcpy(r->nodes[r->n_nodes].id, e[i].id, DHT_ID_LEN);
        r->nodes[r->n_nodes].addr = e[i].addr;
        r->n_nodes++;
    }
}

static void handle_request(dht_node *n, const dht_msg *m, const dht_addr *from, uint64_t now)
{
    dht_msg r;
    uint8_t buf[DHT_MAX_DATAGRAM];
    int len;

    /* Learn about the sender: a known node at its known address is alive;
     * an unknown one is pinged (with a proof request) before it may enter. */
    dht_table_entry *e = dht_table_find(n->table, m->id);
    if (e && dht_addr_equal(&e->addr, from)) {
        e->last_seen = now;
        e->fails = 0;
    } else if (!e && !m->read_only && dht_table_has_room(n->table, m->id, from)) {
        if (!n->cfg.verify_ids)
            node_seen(n, m->id, from, NULL, now);
        else if (verify_due(n, m->id, now))
            send_ping(n, from, m->id, RPC_VERIFY, now);
    }

    memset(&r, 0, sizeof r);
    r.type = (uint8_t)(m->type | DHT_MSG_REPLY);
    r.tid = m->tid;
    memcpy(r.id, n->ident.id, DHT_ID_LEN);
    r.has_token = 1;
    make_token(n, n->tok_cur, from, r.token);
    if (m->has_nonce) {
        uint8_t msg[sizeof PROOF_CTX - 1 + DHT_NONCE_LEN];
        memcpy(msg, PROOF_CTX, sizeof PROOF_CTX - 1);
        memcpy(msg + sizeof PROOF_CTX - 1, m->nonce, DHT_NONCE_LEN);
        crypto_sign_detached(r.sig, NULL, msg, sizeof msg, n->ident.sk);
        memcpy(r.pk, n->ident.pk, 32);
        r.has_proof = 1;
    }
    switch (m->type) {
    case DHT_MSG_PING:
        break;
    case DHT_MSG_FIND_NODE:
        reply_nodes(n, &r, m->target, m->id, from,
                    n->cfg.k < DHT_WIRE_MAX_NODES ? n->cfg.k : DHT_WIRE_MAX_NODES, from->family);
        break;
    case DHT_MSG_STORE: {
        int rc;
        if (!token_ok(n, from, m->token)) {
            r.status = DHT_ST_BAD_TOKEN;
            n->st.store_rejected++;
            break;
        }
        rc = dht_store_put_from(n->store, m->target, &m->entries[0], now, from);
        r.status = rc == 1 ? DHT_ST_OK : rc == 0 ? DHT_ST_OLDER
                 : (rc == -ENOSPC || rc == -ENOMEM) ? DHT_ST_FULL : DHT_ST_INVALID;
        if (rc < 0)
            n->st.store_rejected++;
        break;
    }
    case DHT_MSG_GET: {
        dht_entry ents[DHT_WIRE_MAX_ENTRIES];
        size_t total = 0, avail;
        avail = dht_store_get(n->store, m->target, now, m->offset, ents, DHT_WIRE_MAX_ENTRIES, &total);
        if (m->offset == 0)
            reply_nodes(n, &r, m->target, m->id, from,
                        n->cfg.k < DHT_WIRE_MAX_NODES ? n->cfg.k : DHT_WIRE_MAX_NODES, from->family);
        /* As many entries as fit; the first page gives up nodes, farthest
         * first, rather than carry no entry at all. */
        size_t fit = 0;
        for (size_t want = 1; want <= avail; want++) {
            memcpy(r.entries, ents, want * sizeof *ents);
            r.n_entries = want;
            r.has_next = 1;
            r.next_offset = m->offset + (uint32_t)want;
            while ((len = dht_wire_encode(&r, buf, sizeof buf)) < 0 && want == 1 && r.n_nodes)
                r.n_nodes--;
            if (len < 0)
                break;
            fit = want;
        }
        r.n_entries = fit;
        r.has_next = m->offset + fit < total;
        r.next_offset = m->offset + (uint32_t)fit;
        break;
    }
    default:
        return;
    }
    len = dht_wire_encode(&r, buf, sizeof buf);
    if (len > 0)
        emit(n, from, buf, (size_t)len);
}

/* ---- replies ---- */

/* m is the reply, or NULL when the request failed: timed out (timeout != 0)
 * or answered wrongly. */
static void rpc_done(dht_node *n, rpc *r, const dht_msg *m, int timeout, uint64_t now)
{
    lookup *l = r->lookup_id ? lookup_by_id(n, r->lookup_id) : NULL;
    switch (r->kind) {
    case RPC_VERIFY:
    case RPC_HANDOVER:
        return;
    case RPC_EVICT:
        if (!m)
            table_failed_at(n, r->id, &r->addr, 1);
        return;
    case RPC_SELF:
        if (m) {
            /* It signed our nonce with our key, from another address. */
            n->st.id_collisions++;
            n->collision = r->addr;
            n->collision_at = now ? now : 1;
            if (l) {
                l->collision = 1;
                l->collision_addr = r->addr;
            }
        }
        if (l) {
            l->other_inflight--;
            lookup_step(n, l, now, 1);
        }
        return;
    case RPC_STORE: {
        if (!l)
            return;
        int ok = m && (m->status == DHT_ST_OK || m->status == DHT_ST_OLDER);
        cand *c = cand_find(l, r->id, &r->addr);
        l->other_inflight--;
        l->stored += ok;
        if (c && c->st != S_OK)
            c->st = ok ? S_OK : S_FAILED;
        lookup_step(n, l, now, 1);
        return;
    }
    case RPC_PAGE:
    case RPC_LOOKUP: {
        if (!l)
            return;
        cand *c = cand_find(l, m ? m->id : r->id, &r->addr);
        if (r->kind == RPC_LOOKUP)
            l->q_inflight--;
        else
            l->other_inflight--;
        if (c && r->kind == RPC_LOOKUP) {
            if (!m) {
                /* A timeout of the first attempt while the retry is still
                 * out changes nothing; a wrong answer fails at once. */
                if (!timeout || now >= c->sent_at + n->cfg.rpc_timeout_ms) {
                    c->state = C_FAILED;
                    c->lost = timeout != 0;
                }
            } else {
                c->state = C_DONE;
                if (c->anon) {
                    memcpy(c->id, m->id, DHT_ID_LEN);
                    c->anon = 0;
                }
                if (m->has_token) {
                    c->has_token = 1;
                    memcpy(c->token, m->token, DHT_TOKEN_LEN);
                }
                unsigned depth = c->depth + 1u;
                for (size_t i = 0; i < m->n_nodes; i++) {
                    if (memcmp(m->nodes[i].id, n->ident.id, DHT_ID_LEN) == 0)
                        self_check(n, l, &m->nodes[i].addr, now);
                    else
                        cand_add(n, l, m->nodes[i].id, &m->nodes[i].addr, depth);
                }
                cand_sort(l);
                c = cand_find(l, m->id, &r->addr);
            }
        }
        if (m && l->op == OP_GET) {
            for (size_t i = 0; i < m->n_entries; i++) {
                /* Holders mostly send the same copy: one we already have
                 * (or a newer one) would change nothing, so its signature
                 * is not checked again. */
                if (have_entry(l, &m->entries[i]))
                    continue;
                if (dht_entry_check(&m->entries[i], l->target, now) == 0)
                    merge_entry(l, &m->entries[i]);
                else
                    n->st.drop_bad_proof++;
            }
            if (m->has_next && c && c->pages < MAX_PAGES && m->next_offset > 0 &&
                m->n_entries) {
                dht_msg q;
                memset(&q, 0, sizeof q);
                q.type = DHT_MSG_GET;
                memcpy(q.target, l->target, DHT_ID_LEN);
                q.offset = m->next_offset;
                if (send_request(n, &q, &r->addr, m->id, RPC_PAGE, l->id, now) == 0) {
                    c->pages++;
                    l->other_inflight++;
                    l->msgs++;
                }
            }
        }
        lookup_step(n, l, now, 1);
        return;
    }
    }
}

static int check_proof(const dht_msg *m, const uint8_t nonce[DHT_NONCE_LEN])
{
    uint8_t id[DHT_ID_LEN];
    uint8_t msg[sizeof PROOF_CTX - 1 + DHT_NONCE_LEN];
    if (!m->has_proof)
        return 0;
    dht_id_of_pubkey(id, m->pk);
    if (memcmp(id, m->id, DHT_ID_LEN) != 0)
        return 0;
    memcpy(msg, PROOF_CTX, sizeof PROOF_CTX - 1);
    memcpy(msg + sizeof PROOF_CTX - 1, nonce, DHT_NONCE_LEN);
    return crypto_sign_verify_detached(m->sig, msg, sizeof msg, m->pk) == 0;
}

static void handle_reply(dht_node *n, const dht_msg *m, const dht_addr *from, uint64_t now)
{
    rpc *r;
    uint32_t tid = m->tid;
    HASH_FIND_INT(n->rpcs, &tid, r);
    if (!r || !dht_addr_equal(&r->addr, from) || m->type != (r->req_type | DHT_MSG_REPLY)) {
        n->st.drop_unexpected++;
        return;
    }
    HASH_DEL(n->rpcs, r);
    n->n_rpcs--;
    int ok = 1;
    if (r->has_id && memcmp(r->id, m->id, DHT_ID_LEN) != 0) {
        ok = 0; /* someone else answers at that address */
        n->st.wrong_id++;
        note_problem(n, r, -EADDRNOTAVAIL, m->id);
    } else if (r->has_nonce && !check_proof(m, r->nonce)) {
        ok = 0;
    }
    if (!ok) {
        n->st.drop_bad_proof++;
        if (r->has_id)
            table_failed_at(n, r->id, &r->addr, r->kind == RPC_EVICT);
        rpc_done(n, r, NULL, 0, now);
        free(r);
        return;
    }
    if (memcmp(m->id, n->ident.id, DHT_ID_LEN) != 0) { /* (our ID: RPC_SELF) */
        if (r->has_nonce)
            proven(n, m->id, from);
        if (r->has_nonce || !n->cfg.verify_ids || known_at(n, m->id, from))
            node_seen(n, m->id, from, m->has_token ? m->token : NULL, now);
    }
    rpc_done(n, r, m, 0, now);
    free(r);
}

/* ---- public ---- */

void dht_config_default(dht_config *c)
{
    memset(c, 0, sizeof *c);
    c->k = DHT_K;
    c->alpha = DHT_ALPHA;
    c->rpc_timeout_ms = 1000;
    c->maint_ms = 1000;
    c->refresh_ms = 15 * 60 * 1000;
    c->republish_ms = 10 * 60 * 1000;
    c->token_ms = 5 * 60 * 1000;
    c->rate_per_s = 200;
    c->rate_burst = 400;
    c->verify_ids = 1;
    c->quorum = DHT_QUORUM;
    /* Operators of an open swarm on a shared private network (or tests
     * with many addresses on one host) turn the per-network limits on for
     * every address; "off" is for measurements. */
    const char *lim = getenv("STARLING_DHT_LIMITS");
    c->diversity = lim && !strcmp(lim, "all") ? DHT_DIVERSITY_ALL
                 : lim && !strcmp(lim, "off") ? DHT_DIVERSITY_OFF : DHT_DIVERSITY_PUBLIC;
}

dht_node *dht_node_create(const dht_identity *ident, const dht_config *cfg, uint64_t now)
{
    static const uint8_t zero[32];
    dht_node *n;
    dht_store_limits lim;
    if (!ident || dht_crypto_init() != 0)
        return NULL;
    n = calloc(1, sizeof *n);
    if (!n)
        return NULL;
    n->ident = *ident;
    if (cfg)
        n->cfg = *cfg;
    else
        dht_config_default(&n->cfg);
    if (!n->cfg.k || n->cfg.k > DHT_WIRE_MAX_NODES)
        n->cfg.k = DHT_K;
    if (!n->cfg.alpha)
        n->cfg.alpha = DHT_ALPHA;
    if (!n->cfg.quorum)
        n->cfg.quorum = DHT_QUORUM;
    if (!n->cfg.rpc_timeout_ms)
        n->cfg.rpc_timeout_ms = 1000;
    if (!n->cfg.maint_ms)
        n->cfg.maint_ms = 1000;
    if (!n->cfg.token_ms)
        n->cfg.token_ms = 5 * 60 * 1000;
    if (!n->cfg.refresh_ms)
        n->cfg.refresh_ms = 15 * 60 * 1000;
    if (!n->cfg.republish_ms)
        n->cfg.republish_ms = 10 * 60 * 1000;
    if (!n->cfg.rate_burst)
        n->cfg.rate_burst = 1;
    memset(&lim, 0, sizeof lim); /* zero fields: the store's defaults */
    lim.max_keys = n->cfg.store_max_keys ? n->cfg.store_max_keys : DHT_STORE_MAX_KEYS;
    lim.max_subkeys = n->cfg.store_max_subkeys ? n->cfg.store_max_subkeys : DHT_STORE_MAX_SUBKEYS;
    lim.max_bytes = n->cfg.store_max_bytes ? n->cfg.store_max_bytes : DHT_STORE_MAX_BYTES;
    if (memcmp(n->cfg.seed, zero, 32) == 0)
        randombytes_buf(n->rng_key, sizeof n->rng_key);
    else
        memcpy(n->rng_key, n->cfg.seed, 32);
    n->pool_pos = sizeof n->pool;
    n->families = 3;
    n->table = dht_table_create(ident->id, n->cfg.k);
    n->store = dht_store_create(&lim);
    if (!n->table || !n->store) {
        dht_node_destroy(&n);
        return NULL;
    }
    dht_table_set_diversity(n->table, n->cfg.diversity);
    rng(n, n->tok_cur, 32);
    rng(n, n->tok_prev, 32);
    rng(n, n->rl_key, sizeof n->rl_key);
    n->tok_rotated = now;
    n->next_maint = now + n->cfg.maint_ms;
    /* Spread republishing so that holders of a key do not all fire at once. */
    uint32_t jitter;
    rng(n, &jitter, sizeof jitter);
    n->next_republish = now + n->cfg.republish_ms + jitter % (n->cfg.republish_ms / 4 + 1);
    return n;
}

void dht_node_destroy(dht_node **p)
{
    if (!p || !*p)
        return;
    dht_node *n = *p;
    n->closing = 1;
    while (n->lookups) {
        lookup *l = n->lookups;
        lookup_finish(n, l, -ECANCELED); /* unlinks l */
    }
    rpc *r, *tmp;
    HASH_ITER(hh, n->rpcs, r, tmp) {
        HASH_DEL(n->rpcs, r);
        free(r);
    }
    while (n->out_head) {
        outpkt *o = n->out_head;
        n->out_head = o->next;
        free(o);
    }
    dht_table_destroy(&n->table);
    dht_store_destroy(&n->store);
    sodium_memzero(&n->ident, sizeof n->ident);
    free(n);
    *p = NULL;
}

void dht_node_set_families(dht_node *n, int v4, int v6)
{
    n->families = (v4 ? 1 : 0) | (v6 ? 2 : 0);
}

const uint8_t *dht_node_id(const dht_node *n)
{
    return n->ident.id;
}

/* A datagram that does not authenticate under our swarm key (or, without
 * a key, has 16 bytes after its map): a node under another key, or none.
 * If it is a "not in this swarm" notice answering a request of ours, that
 * request failed for that reason; if it is a request, we send the notice
 * back (untagged, rate-limited like requests, never in answer to a
 * notice), so that its sender can tell a wrong swarm key from a dead
 * address. Nothing else is revealed: no ID, no nodes. */
static void foreign_datagram(dht_node *n, const uint8_t *buf, size_t len, const dht_addr *from,
                             uint64_t now)
{
    uint32_t tid;
    dht_msg m;
    rpc *r;
    if (from->family == 0 || from->port == 0 || len > DHT_MAX_DATAGRAM)
        return;
    if (dht_wire_decode_reject(buf, len, &tid) == 0) {
        HASH_FIND_INT(n->rpcs, &tid, r);
        if (!r || !dht_addr_equal(&r->addr, from))
            return;
        HASH_DEL(n->rpcs, r);
        n->n_rpcs--;
        n->st.swarm_rejects++;
        note_problem(n, r, -EKEYREJECTED, NULL);
        if (r->has_id)
            table_failed_at(n, r->id, &r->addr, r->kind == RPC_EVICT);
        rpc_done(n, r, NULL, 0, now);
        free(r);
        return;
    }
    /* Sent without a tag (when we have a key), or with one under a key that
     * is not ours. */
    int req = (n->cfg.has_swarm_key && dht_wire_decode(&m, buf, len) == 0) ||
              (len > DHT_TAG_LEN && dht_wire_decode(&m, buf, len - DHT_TAG_LEN) == 0);
    if (!req || (m.type & DHT_MSG_REPLY) || !rate_ok(n, from, now))
        return;
    uint8_t out[32];
    int ol = dht_wire_encode_reject(m.tid, out, sizeof out);
    if (ol > 0) {
        emit_as(n, from, out, (size_t)ol, 0);
        n->st.rejects_sent++;
    }
}

/* 1 if m, carrying our own ID, may go on: a ping from another node with
 * our identity (answered, so that it can find out: self_check), or the
 * answer to such a ping of ours. Our own ping looped back to us (we were
 * listed at our own address) has the nonce of one of our requests. */
static int own_id_ok(dht_node *n, const dht_msg *m)
{
    rpc *r;
    uint32_t tid = m->tid;
    HASH_FIND_INT(n->rpcs, &tid, r);
    if (m->type & DHT_MSG_REPLY)
        return r && r->kind == RPC_SELF;
    if (m->type != DHT_MSG_PING)
        return 0;
    return !(r && r->has_nonce && m->has_nonce && memcmp(r->nonce, m->nonce, DHT_NONCE_LEN) == 0);
}

int dht_node_input(dht_node *n, const uint8_t *buf, size_t len, const dht_addr *from,
                   uint64_t now)
{
    dht_msg m;
    if (!n || !buf || !from)
        return -EINVAL;
    n->st.rx++;
    n->st.rx_bytes += len;
    if (n->cfg.has_swarm_key) {
        uint8_t tag[DHT_TAG_LEN];
        if (len < DHT_TAG_LEN + 1 || len > DHT_MAX_DATAGRAM) {
            n->st.drop_tag++;
            foreign_datagram(n, buf, len, from, now);
            return -EPERM;
        }
        dht_wire_tag(tag, n->cfg.swarm_key, buf, len - DHT_TAG_LEN);
        if (crypto_verify_16(tag, buf + len - DHT_TAG_LEN) != 0) {
            n->st.drop_tag++;
            foreign_datagram(n, buf, len, from, now);
            return -EPERM;
        }
        len -= DHT_TAG_LEN;
    }
    int undecodable = dht_wire_decode(&m, buf, len) != 0;
    if (undecodable || from->family == 0 || from->port == 0 ||
        (memcmp(m.id, n->ident.id, DHT_ID_LEN) == 0 && !own_id_ok(n, &m))) {
        n->st.drop_malformed++;
        if (undecodable && !n->cfg.has_swarm_key)
            foreign_datagram(n, buf, len, from, now);
        return -EBADMSG;
    }
    if (!(m.type & DHT_MSG_REPLY)) {
        if (!rate_ok(n, from, now)) {
            n->st.drop_rate++;
            return -EAGAIN;
        }
        handle_request(n, &m, from, now);
    } else {
        handle_reply(n, &m, from, now);
    }
    return 0;
}

int dht_node_pop_output(dht_node *n, uint8_t *buf, size_t cap, dht_addr *to)
{
    outpkt *p = n->out_head;
    if (!p)
        return 0;
    n->out_head = p->next;
    if (!n->out_head)
        n->out_tail = NULL;
    n->n_out--;
    int len = (int)p->len;
    if (p->len > cap) {
        len = -EMSGSIZE;
    } else {
        memcpy(buf, p->data, p->len);
        *to = p->to;
    }
    free(p);
    return len;
}

uint64_t dht_node_next_deadline(const dht_node *n)
{
    uint64_t d = n->deferred ? 0 : n->next_maint;
    for (const rpc *r = n->rpcs; r; r = r->hh.next)
        if (r->deadline < d)
            d = r->deadline;
    for (const lookup *l = n->lookups; l; l = l->next)
        if (l->phase == 0 && l->wake_at && l->wake_at < d)
            d = l->wake_at;
    return d;
}

static void maintain(dht_node *n, uint64_t now)
{
    n->next_maint = now + n->cfg.maint_ms;
    dht_store_expire(n->store, now);
    if (now - n->tok_rotated >= n->cfg.token_ms) {
        memcpy(n->tok_prev, n->tok_cur, 32);
        rng(n, n->tok_cur, 32);
        n->tok_rotated = now;
    }
    if (n->joined && n->next_selfcheck && now >= n->next_selfcheck) {
        lookup *l = lookup_new(n, OP_JOIN, n->ident.id, NULL, NULL);
        if (l) {
            l->started = now;
            lookup_step(n, l, now, 0);
        }
        n->next_selfcheck = now + (dht_table_size(n->table) < n->cfg.k ? 10ull * n->cfg.maint_ms
                                                                        : n->cfg.refresh_ms);
    }
    if (n->joined) {
        int depth = dht_table_depth(n->table), started = 0;
        for (int b = 0; b <= depth && started < 2; b++) {
            if (now - dht_table_bucket_refreshed(n->table, b) >= n->cfg.refresh_ms) {
                start_refresh(n, b, now);
                started++;
            }
        }
    }
    if (now >= n->next_republish) {
        uint8_t keys[REPUBLISH_BATCH][DHT_ID_LEN];
        size_t nk = dht_store_keys(n->store, &n->republish_cursor, keys, REPUBLISH_BATCH);
        for (size_t i = 0; i < nk; i++) {
            dht_entry first;
            if (dht_store_get(n->store, keys[i], now, 0, &first, 1, NULL) == 0 || !first.is_signed)
                continue; /* nothing we relay (unsigned only) */
            lookup *l = lookup_new(n, OP_REPUBLISH, keys[i], NULL, NULL);
            if (l)
                lookup_step(n, l, now, 0);
        }
        n->next_republish = n->republish_cursor ? now + n->cfg.maint_ms : now + n->cfg.republish_ms;
    }
}

void dht_node_tick(dht_node *n, uint64_t now)
{
    rpc *r, *tmp, *expired = NULL;
    /* Collect first: failing a request may send new ones. */
    HASH_ITER(hh, n->rpcs, r, tmp) {
        if (r->deadline <= now) {
            HASH_DEL(n->rpcs, r);
            n->n_rpcs--;
            r->hh.next = expired;
            expired = r;
        }
    }
    while (expired) {
        r = expired;
        expired = r->hh.next;
        n->st.timeouts++;
        if (r->has_id && r->kind != RPC_EVICT) {
            /* Only a node silent since the request went out has failed: a
             * lookup's retry may have been answered meanwhile. */
            dht_table_entry *e = dht_table_find(n->table, r->id);
            if (e && e->last_seen < r->deadline - n->cfg.rpc_timeout_ms)
                table_failed_at(n, r->id, &r->addr, 0);
        }
        rpc_done(n, r, NULL, 1, now);
        free(r);
    }
    /* Lookups with a request turning stale move on now. */
    for (int again = 1; again;) {
        again = 0;
        for (lookup *l = n->lookups; l; l = l->next) {
            if (l->phase == 0 && l->wake_at && l->wake_at <= now) {
                l->wake_at = 0;
                lookup_step(n, l, now, 1);
                again = 1; /* the list may have changed */
                break;
            }
        }
    }
    if (n->deferred) {
        n->deferred = 0;
        int again;
        do {
            again = 0;
            for (lookup *l = n->lookups; l; l = l->next) {
                if (l->deferred) {
                    l->deferred = 0;
                    lookup_step(n, l, now, 1);
                    again = 1; /* the list may have changed */
                    break;
                }
            }
        } while (again);
    }
    if (now >= n->next_maint)
        maintain(n, now);
}

static int start_op(dht_node *n, int op, const uint8_t target[DHT_ID_LEN], dht_node_cb cb,
                    void *ud, uint64_t now, lookup **out)
{
    if (n->closing)
        return -ECANCELED;
    lookup *l = lookup_new(n, op, target, cb, ud);
    if (!l)
        return n->n_lookups >= MAX_LOOKUPS ? -EAGAIN : -ENOMEM;
    if (out)
        *out = l;
    (void)now;
    return 0;
}

int dht_node_join(dht_node *n, const dht_peer_addr *peers, size_t n_peers, dht_node_cb cb,
                  void *ud, uint64_t now)
{
    lookup *l;
    if (!n || !peers || !n_peers)
        return -EINVAL;
    int rc = start_op(n, OP_JOIN, n->ident.id, cb, ud, now, &l);
    if (rc)
        return rc;
    l->started = now;
    for (size_t i = 0; i < n_peers && l->n < LOOKUP_MAX; i++) {
        if (peers[i].has_id && memcmp(peers[i].id, n->ident.id, DHT_ID_LEN) == 0) {
            self_check(n, l, &peers[i].addr, now); /* our ID: a second copy of us? */
        } else if (peers[i].has_id) {
            cand_add(n, l, peers[i].id, &peers[i].addr, 1);
        } else {
            cand x;
            memset(&x, 0, sizeof x);
            x.anon = 1;
            x.addr = peers[i].addr;
            x.depth = 1;
            memmove(&l->c[1], &l->c[0], (l->n < LOOKUP_MAX ? l->n : LOOKUP_MAX - 1) * sizeof x);
            l->c[0] = x;
            if (l->n < LOOKUP_MAX)
                l->n++;
        }
    }
    lookup_step(n, l, now, 0);
    return 0;
}

int dht_node_find(dht_node *n, const uint8_t target[DHT_ID_LEN], dht_node_cb cb, void *ud,
                  uint64_t now)
{
    lookup *l;
    if (!n || !target)
        return -EINVAL;
    int rc = start_op(n, OP_FIND, target, cb, ud, now, &l);
    if (rc)
        return rc;
    lookup_step(n, l, now, 0);
    return 0;
}

int dht_node_get(dht_node *n, const uint8_t key[DHT_ID_LEN], dht_node_cb cb, void *ud,
                 uint64_t now)
{
    lookup *l;
    if (!n || !key)
        return -EINVAL;
    int rc = start_op(n, OP_GET, key, cb, ud, now, &l);
    if (rc)
        return rc;
    lookup_step(n, l, now, 0);
    return 0;
}

int dht_node_put(dht_node *n, const uint8_t key[DHT_ID_LEN], const uint8_t *subkey,
                 size_t subkey_len, const uint8_t *value, size_t value_len, uint64_t expires,
                 int sign, dht_node_cb cb, void *ud, uint64_t now)
{
    dht_entry e;
    lookup *l;
    if (!n || !key || (value_len && !value) || value_len > DHT_MAX_VALUE ||
        (!sign && (subkey_len > DHT_MAX_SUBKEY || (subkey_len && !subkey))) ||
        expires <= now || expires > now + DHT_MAX_TTL_MS)
        return -EINVAL;
    memset(&e, 0, sizeof e);
    e.value = value;
    e.value_len = value_len;
    e.expires = expires;
    if (sign) {
        e.subkey = n->ident.id;
        e.subkey_len = DHT_ID_LEN;
        if (dht_entry_sign(&e, key, &n->ident) != 0)
            return -EINVAL;
    } else {
        e.subkey = subkey;
        e.subkey_len = subkey_len;
    }
    int rc = start_op(n, OP_PUT, key, cb, ud, now, &l);
    if (rc)
        return rc;
    merge_entry(l, &e);
    if (l->n_res != 1) {
        lookup_unlink(n, l);
        lookup_free(l);
        return -ENOMEM;
    }
    lookup_step(n, l, now, 0);
    return 0;
}

int dht_node_join_diag(const dht_node *n, dht_join_diag *out)
{
    *out = n->diag;
    return out->status;
}

int dht_node_collision(const dht_node *n, dht_addr *out)
{
    if (!n->collision_at)
        return -ENOENT;
    *out = n->collision;
    return 0;
}

void dht_node_get_stats(const dht_node *n, dht_node_stats *out)
{
    *out = n->st;
    out->table_size = dht_table_size(n->table);
    out->table_depth = dht_table_depth(n->table);
    out->store_keys = dht_store_count_keys(n->store);
    out->store_entries = dht_store_count_entries(n->store);
    out->store_bytes = dht_store_bytes(n->store);
    out->pending_rpcs = n->n_rpcs;
    out->lookups = n->n_lookups;
}

size_t dht_node_closest(const dht_node *n, const uint8_t target[DHT_ID_LEN], dht_wire_node *out,
                        size_t max)
{
    dht_table_entry e[DHT_WIRE_MAX_NODES];
    if (max > DHT_WIRE_MAX_NODES)
        max = DHT_WIRE_MAX_NODES;
    size_t ne = dht_table_closest(n->table, target, max, e);
    for (size_t i = 0; i < ne; i++) {
        memcpy(out[i].id, e[i].id, DHT_ID_LEN);
        out[i].addr = e[i].addr;
    }
    return ne;
}
