/* The iterative lookup engine: every operation of the node (join, find,
 * get, put, bucket refresh, republish) is a lookup of a target ID.
 *
 * A lookup keeps up to LOOKUP_MAX candidates sorted by distance to the
 * target (at most DHT_LOOKUP_PER_NET of one network), seeded from the
 * routing table or the join's initial peers. Its converge step
 * (lookup_converge) asks the nearest not-yet-asked candidates, alpha at a
 * time until the alpha nearest have answered, then the rest of the k
 * nearest at once; a request unanswered for rpc_timeout/4 is stale, asked
 * once more and then no longer waited for. Each answer adds the nodes it
 * lists. Once the k nearest (a get: the quorum nearest) have answered or
 * are presumed dead, the operation's own rules take over
 * (lookup_settled, lookup_status): a put and a republish store on the k
 * nearest that gave us a write token (a put as soon as every nearer
 * candidate has settled, reporting once the quorum nearest have stored),
 * a get merges the entries it collected (following paged replies) with our
 * own store, and a join retries silent initial peers and records why it
 * failed. The node (node.c) sends the requests and hands each reply here
 * (dht__lookup_reply); the two share dht/node_internal.h.
 */
#include "dht/node_internal.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#define LOOKUP_MAX 64        /* candidates remembered per lookup */
#define MAX_LOOKUPS 256      /* concurrent operations per node */
#define MAX_PAGES 16         /* get pages followed per node */
#define MAX_RESULTS 1024     /* entries one get collects */
#define JOIN_ROUNDS 3        /* a join asks silent initial peers this many times */

enum cand_state { C_NEW, C_INFLIGHT, C_DONE, C_FAILED };
enum store_state { S_NONE, S_SENT, S_OK, S_FAILED };
enum op { OP_JOIN, OP_FIND, OP_GET, OP_PUT, OP_REFRESH, OP_REPUBLISH };

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

typedef struct dht__lookup {
    struct dht__lookup *next;
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

static void lookup_step(dht_node *n, lookup *l, uint64_t now, int may_finish);

/* ---- the entries a get collects or a put stores ---- */

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

/* ---- candidates ---- */

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

/* Adds the node id at addr (heard of at referral depth depth) to l's
 * candidates in distance order, unless it is us, unreachable, already
 * there, farther than the LOOKUP_MAX nearest or over its network's share. */
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

/* The candidate with id (an anonymous initial peer: at addr), or NULL. */
static cand *cand_find(lookup *l, const uint8_t id[DHT_ID_LEN], const dht_addr *addr)
{
    for (size_t i = 0; i < l->n; i++) {
        if (l->c[i].anon ? dht_addr_equal(&l->c[i].addr, addr)
                         : memcmp(l->c[i].id, id, DHT_ID_LEN) == 0)
            return &l->c[i];
    }
    return NULL;
}

/* ---- a lookup's life ---- */

static lookup *lookup_by_id(dht_node *n, uint32_t id)
{
    for (lookup *l = n->lookups; l; l = l->next)
        if (l->id == id)
            return l;
    return NULL;
}

/* A new lookup of target for op, seeded with the k nearest table
 * entries and linked into n; NULL when MAX_LOOKUPS run or on no memory. */
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

/* Unlinks l, runs its callback (if it has not run) and frees it. */
static void lookup_finish(dht_node *n, lookup *l, int status)
{
    lookup_unlink(n, l);
    lookup_report(n, l, status);
    lookup_free(l);
}

/* Asks c for l's target (find_node, or get for a get); c fails at once
 * when the request cannot go out. */
static void lookup_send(dht_node *n, lookup *l, cand *c, uint64_t now)
{
    dht_msg m;
    memset(&m, 0, sizeof m);
    m.type = l->op == OP_GET ? DHT_MSG_GET : DHT_MSG_FIND_NODE;
    memcpy(m.target, l->target, DHT_ID_LEN);
    const uint8_t *expect = c->anon ? NULL : c->id;
    if (dht__node_send_request(n, &m, &c->addr, expect, RPC_LOOKUP, l->id, now) == 0) {
        c->state = C_INFLIGHT;
        c->sent_at = now;
        l->q_inflight++;
        l->msgs++;
    } else {
        c->state = C_FAILED;
    }
}

/* Our own ID is listed at addr (by an answer to l, or among a join's
 * initial peers): the node there may run with our identity. A join waits
 * for its answer (dht__lookup_reply, RPC_SELF); other lookups do not. */
static void self_check(dht_node *n, lookup *l, const dht_addr *addr, uint64_t now)
{
    int join = l && l->op == OP_JOIN;
    if (dht__node_self_ping(n, addr, join ? l->id : 0, now) == 0 && join) {
        l->other_inflight++;
        l->msgs++;
    }
}

/* ---- the converge step ---- */

/* How many of the nearest candidates must answer before the lookup is
 * over: k (they are the nodes to store on, or the answer to find_node),
 * but only the read quorum for a get. */
static size_t lookup_want(const dht_node *n, const lookup *l)
{
    if (l->op == OP_GET && n->cfg.quorum < n->cfg.k)
        return n->cfg.quorum;
    return n->cfg.k;
}

/* How many requests l may have in flight now: alpha, or the rest of the
 * want nearest at once when the alpha nearest have answered. *active_out:
 * the requests in flight that hold a slot (neither stale nor resent). */
static size_t lookup_budget(const dht_node *n, const lookup *l, uint64_t now, size_t want,
                            size_t *active_out)
{
    uint64_t soft = n->cfg.rpc_timeout_ms / 4;
    size_t active = 0, limit = n->cfg.alpha, seen = 0;
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
    *active_out = active;
    return limit;
}

/* Sends requests toward the nearest candidates not yet asked (within the
 * budget), asks a stale one once more, and sets l->wake_at to when the next
 * request in flight turns stale. A request unanswered for a quarter of the
 * timeout is "stale": it no longer holds one of the alpha slots, and the
 * lookup may finish without it once k closer-or-equal nodes have answered.
 * Dead nodes then cost a lookup rpc_timeout/4, not the full timeout (the
 * full timeout still decides whether the table drops them). Returns 1
 * while one of the want nearest live candidates has not answered. */
static int lookup_converge(dht_node *n, lookup *l, uint64_t now)
{
    uint64_t soft = n->cfg.rpc_timeout_ms / 4;
    size_t counted = 0, active, want = lookup_want(n, l);
    size_t limit = lookup_budget(n, l, now, want, &active);
    int busy = 0;
    l->wake_at = UINT64_MAX;
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
    return busy;
}

/* ---- put and republish: the stores ---- */

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
        if (dht__node_send_request(n, &m, &c->addr, c->id, RPC_STORE, l->id, now) == 0) {
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

/* ---- when an operation is over, and its status ---- */

/* Moves l through its phases: converging on the nearest nodes, then (put,
 * republish) storing on the k nearest. Returns 1 once nothing is left that
 * the operation waits for. A put's early stores need not be acknowledged
 * for its lookup to go on. */
static int lookup_settled(dht_node *n, lookup *l, uint64_t now, int may_finish)
{
    if (l->phase == 0) {
        int busy = lookup_converge(n, l, now);
        if (l->op == OP_PUT)
            put_progress(n, l, now, may_finish);
        if (busy || (l->other_inflight && l->op != OP_PUT))
            return 0;
        dht_table_bucket_touch(n->table, dht_id_common_prefix(n->ident.id, l->target), now);
        if (l->op == OP_PUT || l->op == OP_REPUBLISH) {
            l->phase = 1;
            store_phase(n, l, now);
            return !l->other_inflight;
        }
        return 1;
    }
    if (l->op == OP_PUT)
        put_progress(n, l, now, may_finish);
    return !l->other_inflight;
}

/* A join that nobody answered, with rounds left: with datagram loss a
 * single silent initial peer is not yet a dead one, and a node whose join
 * fails stays alone (and whoever joins through it forms an island). Makes
 * the silent candidates new again (not those that answered wrongly) and
 * returns 1 if there were any, so that the lookup asks them again. */
static int join_retry(lookup *l, int any_done)
{
    int retry = 0;
    if (l->op != OP_JOIN || any_done || l->rounds + 1 >= JOIN_ROUNDS)
        return 0;
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
    return retry;
}

/* A join's status (dht_node_join): records why it failed, or a collision
 * with our ID, in n->diag; the first join that works starts the refresh
 * of every farther bucket. */
static int join_status(dht_node *n, lookup *l, int any_done, uint64_t now)
{
    int coll = l->collision || (n->collision_at && n->collision_at >= l->started);
    int status = any_done && dht_table_size(n->table) ? 0 : -EHOSTUNREACH;
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
                dht__lookup_refresh(n, b, now);
        }
        n->joined = 1;
    }
    /* Reported even when the join worked: the caller must not go on as
     * a second copy of another node. */
    if (coll)
        status = -EADDRINUSE;
    return status;
}

/* The status l's operation reports now that it is over (any_done: some
 * candidate answered): a join's (join_status); a get's, once our own
 * store's entries are merged in; a put's or republish's count of stores
 * acknowledged; -EHOSTUNREACH when nothing came of it. */
static int lookup_status(dht_node *n, lookup *l, int any_done, uint64_t now)
{
    switch (l->op) {
    case OP_JOIN:
        return join_status(n, l, any_done, now);
    case OP_GET: {
        dht_entry local[32];
        size_t off = 0, total = 0, got;
        do {
            got = dht_store_get(n->store, l->target, now, off, local, 32, &total);
            for (size_t i = 0; i < got; i++)
                merge_entry(l, &local[i]);
            off += got;
        } while (got && off < total);
        return any_done || l->n_res ? 0 : -EHOSTUNREACH;
    }
    case OP_PUT:
    case OP_REPUBLISH:
        return l->stored > 0 ? l->stored : -EHOSTUNREACH;
    default:
        return any_done ? 0 : -EHOSTUNREACH;
    }
}

/* Advances l: sends up to alpha requests toward the k closest candidates and
 * notices when the lookup (and its pages and stores) are over. With
 * may_finish == 0 (inside the call that started it) completion is deferred
 * to the next tick, so the callback never runs inside the starting call. */
static void lookup_step(dht_node *n, lookup *l, uint64_t now, int may_finish)
{
    int any_done;
    do {
        if (!lookup_settled(n, l, now, may_finish))
            return;
        if (!may_finish) {
            l->deferred = 1;
            n->deferred = 1;
            return;
        }
        any_done = 0;
        for (size_t i = 0; i < l->n; i++)
            any_done |= l->c[i].state == C_DONE;
    } while (join_retry(l, any_done));
    lookup_finish(n, l, lookup_status(n, l, any_done, now));
}

/* ---- replies ---- */

/* c (a candidate of l) answered l's request r with m, or failed (m NULL;
 * by timeout when timeout != 0). An answer adds the nodes it lists. Returns
 * c's place after the candidates are re-sorted (NULL: dropped). */
static cand *cand_answered(dht_node *n, lookup *l, cand *c, const dht__rpc *r, const dht_msg *m,
                           int timeout, uint64_t now)
{
    if (!m) {
        /* A timeout of the first attempt while the retry is still
         * out changes nothing; a wrong answer fails at once. */
        if (!timeout || now >= c->sent_at + n->cfg.rpc_timeout_ms) {
            c->state = C_FAILED;
            c->lost = timeout != 0;
        }
        return c;
    }
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
    return cand_find(l, m->id, &r->addr);
}

/* A get's answer m (to r, from c, NULL if c is gone): merges its entries
 * whose signatures check and asks for the next page, if any. */
static void get_answered(dht_node *n, lookup *l, cand *c, const dht__rpc *r, const dht_msg *m,
                         uint64_t now)
{
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
    if (m->has_next && c && c->pages < MAX_PAGES && m->next_offset > 0 && m->n_entries) {
        dht_msg q;
        memset(&q, 0, sizeof q);
        q.type = DHT_MSG_GET;
        memcpy(q.target, l->target, DHT_ID_LEN);
        q.offset = m->next_offset;
        if (dht__node_send_request(n, &q, &r->addr, m->id, RPC_PAGE, l->id, now) == 0) {
            c->pages++;
            l->other_inflight++;
            l->msgs++;
        }
    }
}

void dht__lookup_reply(dht_node *n, const dht__rpc *r, const dht_msg *m, int timeout, uint64_t now)
{
    lookup *l = r->lookup_id ? lookup_by_id(n, r->lookup_id) : NULL;
    if (!l)
        return;
    switch (r->kind) {
    case RPC_SELF:
        if (m) {
            /* It signed our nonce with our key, from another address. */
            l->collision = 1;
            l->collision_addr = r->addr;
        }
        l->other_inflight--;
        break;
    case RPC_STORE: {
        int ok = m && (m->status == DHT_ST_OK || m->status == DHT_ST_OLDER);
        cand *c = cand_find(l, r->id, &r->addr);
        l->other_inflight--;
        l->stored += ok;
        if (c && c->st != S_OK)
            c->st = ok ? S_OK : S_FAILED;
        break;
    }
    case RPC_PAGE:
    case RPC_LOOKUP: {
        cand *c = cand_find(l, m ? m->id : r->id, &r->addr);
        if (r->kind == RPC_LOOKUP)
            l->q_inflight--;
        else
            l->other_inflight--;
        if (c && r->kind == RPC_LOOKUP)
            c = cand_answered(n, l, c, r, m, timeout, now);
        if (m && l->op == OP_GET)
            get_answered(n, l, c, r, m, now);
        break;
    }
    default:
        return;
    }
    lookup_step(n, l, now, 1);
}

void dht__lookup_note_problem(dht_node *n, const dht__rpc *r, int status, const uint8_t *got)
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

/* ---- for the node: background lookups, time, shutdown ---- */

void dht__lookup_self(dht_node *n, uint64_t now)
{
    lookup *l = lookup_new(n, OP_JOIN, n->ident.id, NULL, NULL);
    if (l) {
        l->started = now;
        lookup_step(n, l, now, 0);
    }
}

void dht__lookup_refresh(dht_node *n, int b, uint64_t now)
{
    uint8_t target[DHT_ID_LEN];
    if (b < 0 || b >= DHT_BUCKETS)
        return;
    dht__node_rng(n, target, sizeof target);
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

void dht__lookup_republish(dht_node *n, const uint8_t key[DHT_ID_LEN], uint64_t now)
{
    lookup *l = lookup_new(n, OP_REPUBLISH, key, NULL, NULL);
    if (l)
        lookup_step(n, l, now, 0);
}

void dht__lookup_wake(dht_node *n, uint64_t now)
{
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
}

uint64_t dht__lookup_deadline(const dht_node *n, uint64_t d)
{
    for (const lookup *l = n->lookups; l; l = l->next)
        if (l->phase == 0 && l->wake_at && l->wake_at < d)
            d = l->wake_at;
    return d;
}

void dht__lookup_cancel_all(dht_node *n)
{
    while (n->lookups) {
        lookup *l = n->lookups;
        lookup_finish(n, l, -ECANCELED); /* unlinks l */
    }
}

/* ---- operations (dht/node.h) ---- */

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
