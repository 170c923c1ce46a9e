/* The Kademlia node: datagrams in and out, requests and replies, the
 * routing table and the store, maintenance (token rotation, bucket
 * refresh, republish, handover to newcomers). The lookups that run the
 * operations are in dht/lookup.c; a lookup's requests go out through
 * dht__node_send_request and their replies come back to it through
 * rpc_done (dht/node_internal.h).
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
#include "dht/node_internal.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#define MAX_RPCS 2048        /* outstanding requests per node */
#define MAX_OUT 4096         /* queued datagrams */
#define HANDOVER_BUDGET 32   /* stores sent to one newcomer */
#define REPUBLISH_BATCH 16   /* keys republished per housekeeping tick */
#define PROOF_CTX "starling-dht-id-v1"

typedef struct dht__outpkt {
    struct dht__outpkt *next;
    dht_addr to;
    size_t len;
    uint8_t data[];
} outpkt;

/* ---- small helpers ---- */

void dht__node_rng(dht_node *n, void *out, size_t len)
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

/* Sends and records a request: see dht/node_internal.h. */
int dht__node_send_request(dht_node *n, dht_msg *m, const dht_addr *to, const uint8_t *expect_id,
                           int kind, uint32_t lookup_id, uint64_t now)
{
    dht__rpc *r, *dup;
    if (n->n_rpcs >= MAX_RPCS)
        return -EAGAIN;
    r = calloc(1, sizeof *r);
    if (!r)
        return -ENOMEM;
    for (;;) {
        dht__node_rng(n, &r->tid, sizeof r->tid);
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
        dht__node_rng(n, r->nonce, sizeof r->nonce);
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
    (void)dht__node_send_request(n, &m, to, id, kind, 0, now);
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

/* Someone's node list (or the command line) names our own ID at addr. If
 * the node there proves the ID, it holds our secret key: another process
 * runs with our identity (rpc_done, RPC_SELF). Our own address listed by a
 * node that sees us there is harmless: we drop our own ping (recognised by
 * its nonce) and it times out. */
int dht__node_self_ping(dht_node *n, const dht_addr *addr, uint32_t lookup_id, uint64_t now)
{
    uint8_t key[1 + 18];
    dht_msg m;
    int len = dht_wire_addr_pack(key + 1, addr);
    if (len < 0 || !addr->port || !(n->families & (addr->family == 6 ? 2 : 1)))
        return -EAGAIN;
    key[0] = 0xa5; /* not an ID: its own throttle slot */
    if (!verify_due_key(n, key, 1 + (size_t)len, now))
        return -EAGAIN;
    memset(&m, 0, sizeof m);
    m.type = DHT_MSG_PING;
    if (dht__node_send_request(n, &m, addr, n->ident.id, RPC_SELF, lookup_id, now) != 0)
        return -EAGAIN;
    return 0;
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
                (void)dht__node_send_request(n, &m, &nc->addr, nc->id, RPC_HANDOVER, 0, now);
            }
        }
    } while (cursor && budget);
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
 * or answered wrongly. A lookup's requests go on to its lookup. */
static void rpc_done(dht_node *n, dht__rpc *r, const dht_msg *m, int timeout, uint64_t now)
{
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
        }
        dht__lookup_reply(n, r, m, timeout, now);
        return;
    default:
        dht__lookup_reply(n, r, m, timeout, now);
        return;
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
    dht__rpc *r;
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
        dht__lookup_note_problem(n, r, -EADDRNOTAVAIL, m->id);
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
    dht__node_rng(n, n->tok_cur, 32);
    dht__node_rng(n, n->tok_prev, 32);
    dht__node_rng(n, n->rl_key, sizeof n->rl_key);
    n->tok_rotated = now;
    n->next_maint = now + n->cfg.maint_ms;
    /* Spread republishing so that holders of a key do not all fire at once. */
    uint32_t jitter;
    dht__node_rng(n, &jitter, sizeof jitter);
    n->next_republish = now + n->cfg.republish_ms + jitter % (n->cfg.republish_ms / 4 + 1);
    return n;
}

void dht_node_destroy(dht_node **p)
{
    if (!p || !*p)
        return;
    dht_node *n = *p;
    n->closing = 1;
    dht__lookup_cancel_all(n);
    dht__rpc *r, *tmp;
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
    dht__rpc *r;
    if (from->family == 0 || from->port == 0 || len > DHT_MAX_DATAGRAM)
        return;
    if (dht_wire_decode_reject(buf, len, &tid) == 0) {
        HASH_FIND_INT(n->rpcs, &tid, r);
        if (!r || !dht_addr_equal(&r->addr, from))
            return;
        HASH_DEL(n->rpcs, r);
        n->n_rpcs--;
        n->st.swarm_rejects++;
        dht__lookup_note_problem(n, r, -EKEYREJECTED, NULL);
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
    dht__rpc *r;
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
    for (const dht__rpc *r = n->rpcs; r; r = r->hh.next)
        if (r->deadline < d)
            d = r->deadline;
    return dht__lookup_deadline(n, d);
}

static void maintain(dht_node *n, uint64_t now)
{
    n->next_maint = now + n->cfg.maint_ms;
    dht_store_expire(n->store, now);
    if (now - n->tok_rotated >= n->cfg.token_ms) {
        memcpy(n->tok_prev, n->tok_cur, 32);
        dht__node_rng(n, n->tok_cur, 32);
        n->tok_rotated = now;
    }
    if (n->joined && n->next_selfcheck && now >= n->next_selfcheck) {
        dht__lookup_self(n, now);
        n->next_selfcheck = now + (dht_table_size(n->table) < n->cfg.k ? 10ull * n->cfg.maint_ms
                                                                        : n->cfg.refresh_ms);
    }
    if (n->joined) {
        int depth = dht_table_depth(n->table), started = 0;
        for (int b = 0; b <= depth && started < 2; b++) {
            if (now - dht_table_bucket_refreshed(n->table, b) >= n->cfg.refresh_ms) {
                dht__lookup_refresh(n, b, now);
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
            dht__lookup_republish(n, keys[i], now);
        }
        n->next_republish = n->republish_cursor ? now + n->cfg.maint_ms : now + n->cfg.republish_ms;
    }
}

void dht_node_tick(dht_node *n, uint64_t now)
{
    dht__rpc *r, *tmp, *expired = NULL;
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
    dht__lookup_wake(n, now);
    if (now >= n->next_maint)
        maintain(n, now);
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
