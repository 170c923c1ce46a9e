/* The sans-I/O node (dht/node.h): tokens, identity proofs, swarm key, hostile
 * datagrams, rate limits, paging, hand-over, expiry, callback rules. */
#include <errno.h>

#include "dht/store.h"
#include "dht/table.h"
#include "test_dht_simnet.h"
#include "test_util.h"

#define T0 SIM_EPOCH

static dht_node *make_node(uint8_t seed, const dht_config *cfg)
{
    dht_identity id;
    uint8_t s[32] = {seed};
    assert_int_equal(dht_identity_from_seed(&id, s), 0);
    dht_node *n = dht_node_create(&id, cfg, T0);
    assert_non_null(n);
    return n;
}

static void peer_addr(dht_addr *a, uint8_t last, uint16_t port)
{
    uint8_t ip[4] = {192, 168, 0, last};
    dht_addr_v4(a, ip, port);
}

/* Encodes m from a fake sender and feeds it to n; returns the decoded reply
 * (if any) in reply. */
static int exchange(dht_node *n, dht_msg *m, const dht_addr *from, uint64_t now, dht_msg *reply,
                    uint8_t *rbuf)
{
    uint8_t buf[DHT_MAX_DATAGRAM];
    dht_addr to;
    int len = dht_wire_encode(m, buf, sizeof buf);
    assert_true(len > 0);
    dht_node_input(n, buf, (size_t)len, from, now);
    int got = 0, rl;
    while ((rl = dht_node_pop_output(n, rbuf, DHT_MAX_DATAGRAM, &to)) > 0) {
        dht_msg r;
        if (dht_wire_decode(&r, rbuf, (size_t)rl) == 0 && (r.type & DHT_MSG_REPLY) &&
            dht_addr_equal(&to, from) && r.tid == m->tid) {
            *reply = r;
            got = 1;
            break; /* entries point into rbuf: stop here */
        }
    }
    while (dht_node_pop_output(n, buf, sizeof buf, &to) > 0)
        ;
    return got;
}

static void test_write_token_binds_address(void **state)
{
    (void)state;
    dht_node *n = make_node(1, NULL);
    dht_addr alice, eve;
    dht_msg m, r;
    uint8_t rbuf[DHT_MAX_DATAGRAM], tok[DHT_TOKEN_LEN];
    peer_addr(&alice, 1, 5000);
    peer_addr(&eve, 2, 5000);
    memset(&m, 0, sizeof m);
    m.type = DHT_MSG_PING;
    m.tid = 1;
    m.id[0] = 0xaa;
    assert_true(exchange(n, &m, &alice, T0, &r, rbuf));
    assert_true(r.has_token);
    memcpy(tok, r.token, sizeof tok);

    memset(&m, 0, sizeof m);
    m.type = DHT_MSG_STORE;
    m.tid = 2;
    m.id[0] = 0xaa;
    m.target[0] = 0x42;
    m.has_token = 1;
    memcpy(m.token, tok, sizeof tok);
    m.n_entries = 1;
    m.entries[0].value = (const uint8_t *)"hi";
    m.entries[0].value_len = 2;
    m.entries[0].expires = T0 + 60000;
    /* Eve replays Alice's token from her own address: refused. */
    assert_true(exchange(n, &m, &eve, T0, &r, rbuf));
    assert_int_equal(r.status, DHT_ST_BAD_TOKEN);
    /* Alice stores. */
    m.tid = 3;
    assert_true(exchange(n, &m, &alice, T0, &r, rbuf));
    assert_int_equal(r.status, DHT_ST_OK);
    /* An expired entry is refused even with a good token. */
    m.tid = 4;
    m.entries[0].expires = T0 - 1;
    assert_true(exchange(n, &m, &alice, T0, &r, rbuf));
    assert_int_equal(r.status, DHT_ST_INVALID);
    /* After two secret rotations the token is dead. */
    uint64_t t = T0;
    for (int i = 0; i < 11 * 60; i++) {
        t += 1000;
        dht_node_tick(n, t);
    }
    m.tid = 5;
    m.entries[0].expires = t + 60000;
    assert_true(exchange(n, &m, &alice, t, &r, rbuf));
    assert_int_equal(r.status, DHT_ST_BAD_TOKEN);
    dht_node_stats st;
    dht_node_get_stats(n, &st);
    assert_int_equal(st.store_rejected, 3);
    dht_node_destroy(&n);
}

static void test_proof_of_id_in_replies(void **state)
{
    (void)state;
    dht_node *n = make_node(3, NULL);
    dht_addr a;
    dht_msg m, r;
    uint8_t rbuf[DHT_MAX_DATAGRAM];
    peer_addr(&a, 3, 6000);
    memset(&m, 0, sizeof m);
    m.type = DHT_MSG_FIND_NODE;
    m.tid = 9;
    m.id[0] = 1;
    m.has_nonce = 1;
    memset(m.nonce, 0x77, sizeof m.nonce);
    assert_true(exchange(n, &m, &a, T0, &r, rbuf));
    assert_true(r.has_proof);
    uint8_t id[20];
    dht_id_of_pubkey(id, r.pk);
    assert_memory_equal(id, r.id, 20);
    assert_memory_equal(id, dht_node_id(n), 20);
    dht_node_destroy(&n);
}

static int join_status;
static int join_called;
static void on_join(void *ud, const dht_result *r)
{
    (void)ud;
    join_called++;
    join_status = r->status;
}

static void test_join_refuses_wrong_id_and_foreign_swarm(void **state)
{
    (void)state;
    dht_config cfg;
    dht_config_default(&cfg);
    cfg.rpc_timeout_ms = 300;
    simnet *s = sim_create(4, 5, 0.0, &cfg);
    dht_peer_addr pa;
    memset(&pa, 0, sizeof pa);
    sim_addr(&pa.addr, 0);
    pa.has_id = 1;
    memcpy(pa.id, s->n[1].id, 20); /* node 0's address, node 1's ID */
    join_called = 0;
    assert_int_equal(dht_node_join(s->n[2].node, &pa, 1, on_join, NULL, s->now), 0);
    sim_after(s, 2);
    assert_int_equal(join_called, 0); /* never from the starting call */
    sim_run(s, s->now + 5000, NULL);
    assert_int_equal(join_called, 1);
    /* Node 0 answered, as node 0: the join says so (not "unreachable"). */
    assert_int_equal(join_status, -EADDRNOTAVAIL);
    dht_join_diag why;
    assert_int_equal(dht_node_join_diag(s->n[2].node, &why), -EADDRNOTAVAIL);
    assert_true(dht_addr_equal(&why.addr, &pa.addr));
    assert_memory_equal(why.expected, s->n[1].id, 20);
    assert_memory_equal(why.got, s->n[0].id, 20);
    dht_node_stats st;
    dht_node_get_stats(s->n[2].node, &st);
    assert_true(st.drop_bad_proof >= 1);
    assert_true(st.wrong_id >= 1);
    /* Node 1's ID was never accepted at node 0's address (node 0 may be in
     * the table under its own, proven, ID). */
    dht_wire_node near[1];
    if (dht_node_closest(s->n[2].node, s->n[1].id, near, 1) == 1)
        assert_memory_not_equal(near[0].id, s->n[1].id, 20);
    /* The right ID joins. */
    memcpy(pa.id, s->n[0].id, 20);
    assert_int_equal(dht_node_join(s->n[2].node, &pa, 1, on_join, NULL, s->now), 0);
    sim_after(s, 2);
    sim_run(s, s->now + 5000, NULL);
    assert_int_equal(join_status, 0);
    sim_destroy(&s);

    /* A private swarm: nodes 0 and 1 share a key, node 2 has none, node 3
     * another key. */
    dht_config priv = cfg;
    priv.has_swarm_key = 1;
    memset(priv.swarm_key, 0x5c, 32);
    s = sim_create(4, 6, 0.0, &cfg);
    for (int i = 0; i < 4; i++) {
        dht_identity id;
        uint8_t seed[32] = {(uint8_t)(40 + i)};
        dht_identity_from_seed(&id, seed);
        dht_node_destroy(&s->n[i].node);
        dht_config c = i < 2 ? priv : cfg;
        if (i == 3) {
            c = priv;
            c.swarm_key[0] ^= 1;
        }
        s->n[i].node = dht_node_create(&id, &c, s->now);
        memcpy(s->n[i].id, id.id, 20);
    }
    memcpy(pa.id, s->n[0].id, 20);
    for (uint32_t i = 1; i < 4; i++) {
        uint64_t t0 = s->now;
        join_called = 0;
        assert_int_equal(dht_node_join(s->n[i].node, &pa, 1, on_join, NULL, s->now), 0);
        sim_after(s, i);
        while (!join_called && s->now < t0 + 5000)
            sim_run(s, s->now + 10, NULL);
        assert_int_equal(join_called, 1);
        /* Node 0 tells foreign nodes it is under another key: the join
         * says so at once (no retry rounds, no timeouts). */
        assert_int_equal(join_status, i == 1 ? 0 : -EKEYREJECTED);
        if (i > 1) {
            assert_true(s->now - t0 < 200);
            assert_int_equal(dht_node_join_diag(s->n[i].node, &why), -EKEYREJECTED);
            assert_true(dht_addr_equal(&why.addr, &pa.addr));
            assert_int_equal(why.have_swarm_key, i == 3);
            dht_node_get_stats(s->n[i].node, &st);
            assert_int_equal(st.swarm_rejects, 1);
            assert_int_equal(st.table_size, 0);
        }
    }
    dht_node_get_stats(s->n[0].node, &st);
    assert_true(st.drop_tag >= 2); /* node 2's and node 3's requests */
    assert_int_equal(st.rejects_sent, 2);
    assert_int_equal(st.table_size, 1);

    /* The other way round: a node without a key answers a keyed one. */
    sim_run(s, s->now + 2000, NULL);
    dht_peer_addr p2;
    memset(&p2, 0, sizeof p2);
    sim_addr(&p2.addr, 2);
    p2.has_id = 1;
    memcpy(p2.id, s->n[2].id, 20);
    join_called = 0;
    assert_int_equal(dht_node_join(s->n[3].node, &p2, 1, on_join, NULL, s->now), 0);
    sim_after(s, 3);
    sim_run(s, s->now + 3000, NULL);
    assert_int_equal(join_called, 1);
    assert_int_equal(join_status, -EKEYREJECTED);
    assert_int_equal(dht_node_join_diag(s->n[3].node, &why), -EKEYREJECTED);
    assert_true(dht_addr_equal(&why.addr, &p2.addr));
    sim_destroy(&s);
}

static void test_garbage_then_still_answers(void **state)
{
    (void)state;
    dht_node *n = make_node(7, NULL);
    dht_addr a;
    uint8_t g[1500], rbuf[DHT_MAX_DATAGRAM];
    uint64_t x = 2024;
    size_t sent = 0;
    for (uint32_t i = 0; i < 3000; i++) {
        size_t len = 1 + (size_t)(i * 7919u % 1400u);
        for (size_t j = 0; j < len; j++) {
            x = x * 6364136223846793005ull + 1442695040888963407ull;
            g[j] = (uint8_t)(x >> 35);
        }
        if (i % 3 == 0)
            g[0] = 0x85; /* looks like a map */
        peer_addr(&a, (uint8_t)(i % 250), (uint16_t)(1000 + i));
        dht_node_input(n, g, len, &a, T0 + i);
        sent++;
    }
    dht_node_stats st;
    dht_node_get_stats(n, &st);
    assert_int_equal(st.drop_malformed, sent);
    assert_int_equal(st.tx, 0);
    dht_msg m, r;
    memset(&m, 0, sizeof m);
    m.type = DHT_MSG_PING;
    m.tid = 5;
    m.id[0] = 3;
    peer_addr(&a, 251, 7000);
    assert_true(exchange(n, &m, &a, T0 + 5000, &r, rbuf));
    dht_node_destroy(&n);
}

static void test_rate_limit_per_source(void **state)
{
    (void)state;
    dht_node *n = make_node(8, NULL);
    dht_addr a, to;
    dht_msg m;
    uint8_t buf[DHT_MAX_DATAGRAM];
    memset(&m, 0, sizeof m);
    m.type = DHT_MSG_PING;
    m.id[0] = 9;
    for (int i = 0; i < 1000; i++) {
        m.tid = (uint32_t)i;
        int len = dht_wire_encode(&m, buf, sizeof buf);
        peer_addr(&a, 9, (uint16_t)(2000 + i)); /* one IP, many ports */
        dht_node_input(n, buf, (size_t)len, &a, T0);
    }
    int replies = 0;
    while (dht_node_pop_output(n, buf, sizeof buf, &to) > 0)
        replies += to.ip[3] == 9;
    dht_node_stats st;
    dht_node_get_stats(n, &st);
    assert_int_equal(st.drop_rate, 600);
    assert_true(replies >= 400 && replies <= 401); /* + at most one verify ping */
    /* Another source is unaffected; the first recovers with time. */
    peer_addr(&a, 10, 2000);
    int len = dht_wire_encode(&m, buf, sizeof buf);
    assert_int_equal(dht_node_input(n, buf, (size_t)len, &a, T0), 0);
    peer_addr(&a, 9, 2000);
    assert_int_equal(dht_node_input(n, buf, (size_t)len, &a, T0), -EAGAIN);
    assert_int_equal(dht_node_input(n, buf, (size_t)len, &a, T0 + 100), 0);
    /* Loopback is exempt (a local swarm shares 127.0.0.1). */
    const uint8_t lo[4] = {127, 0, 0, 1};
    dht_addr_v4(&a, lo, 3000);
    for (int i = 0; i < 1000; i++)
        assert_int_equal(dht_node_input(n, buf, (size_t)len, &a, T0 + 100), 0);
    dht_node_destroy(&n);
}

typedef struct got_t {
    int called, status;
    size_t n;
    int bad;
} got_t;

static void on_get(void *ud, const dht_result *r)
{
    got_t *g = ud;
    g->called++;
    g->status = r->status;
    g->n = r->n_entries;
    for (size_t i = 0; i < r->n_entries; i++)
        if (r->entries[i].value_len != 300 || r->entries[i].value[0] != r->entries[i].subkey[0])
            g->bad++;
}

static void on_put(void *ud, const dht_result *r)
{
    got_t *g = ud;
    g->called++;
    g->status = r->status;
}

static void join_all(simnet *s)
{
    for (uint32_t i = 1; i < s->count; i++) {
        dht_peer_addr pa;
        memset(&pa, 0, sizeof pa);
        sim_addr(&pa.addr, 0);
        pa.has_id = 1;
        memcpy(pa.id, s->n[0].id, 20);
        dht_node_join(s->n[i].node, &pa, 1, NULL, NULL, s->now);
        sim_after(s, i);
        sim_run(s, s->now + 50, NULL);
    }
    sim_run(s, s->now + 10000, NULL);
}

/* Joins nodes 1..count-1 through node 0; the others stay out (not started)
 * until the test joins them. */
static void join_first(simnet *s, uint32_t count)
{
    simnet tmp = *s;
    tmp.count = count;
    join_all(&tmp);
    s->now = tmp.now;
    s->heap = tmp.heap;
    s->hn = tmp.hn;
    s->hcap = tmp.hcap;
    s->seq = tmp.seq;
    s->rng = tmp.rng;
}

static void test_paged_get_collects_every_subkey(void **state)
{
    (void)state;
    simnet *s = sim_create(30, 11, 0.0, NULL);
    join_all(s);
    uint8_t key[20];
    dht_id_of_bytes(key, "many", 4);
    got_t puts[60];
    memset(puts, 0, sizeof puts);
    for (int i = 0; i < 60; i++) {
        uint8_t sub[2] = {(uint8_t)i, 0x33}, val[300];
        memset(val, i, sizeof val);
        uint32_t src = (uint32_t)(i % 30);
        assert_int_equal(dht_node_put(s->n[src].node, key, sub, 2, val, sizeof val, s->now + 600000,
                                      0, on_put, &puts[i], s->now), 0);
        sim_after(s, src);
        sim_run(s, s->now + 20, NULL);
    }
    sim_run(s, s->now + 10000, NULL);
    for (int i = 0; i < 60; i++) {
        assert_int_equal(puts[i].called, 1);
        assert_true(puts[i].status >= 1);
    }
    got_t g = {0};
    assert_int_equal(dht_node_get(s->n[17].node, key, on_get, &g, s->now), 0);
    sim_after(s, 17);
    sim_run(s, s->now + 20000, NULL);
    assert_int_equal(g.called, 1);
    assert_int_equal(g.status, 0);
    assert_int_equal(g.n, 60);
    assert_int_equal(g.bad, 0);

    /* Expired entries vanish from gets. */
    uint8_t k2[20];
    dht_id_of_bytes(k2, "short", 5);
    got_t p = {0};
    uint8_t v[300] = {0};
    uint8_t sub0[1] = {0};
    uint64_t expires = s->now + 5000;
    assert_int_equal(dht_node_put(s->n[3].node, k2, sub0, 1, v, sizeof v, expires, 0, on_put,
                                  &p, s->now), 0);
    sim_after(s, 3);
    sim_run(s, s->now + 2000, NULL);
    assert_true(p.status >= 1);
    memset(&g, 0, sizeof g);
    dht_node_get(s->n[9].node, k2, on_get, &g, s->now);
    sim_after(s, 9);
    sim_run(s, s->now + 2000, NULL);
    assert_int_equal(g.called, 1);
    assert_int_equal(g.n, 1);
    sim_run(s, expires + 1, NULL);
    memset(&g, 0, sizeof g);
    dht_node_get(s->n[9].node, k2, on_get, &g, s->now);
    sim_after(s, 9);
    sim_run(s, s->now + 2000, NULL);
    assert_int_equal(g.called, 1);
    assert_int_equal(g.n, 0);
    sim_destroy(&s);
}

static void test_handover_to_closer_newcomer(void **state)
{
    (void)state;
    simnet *s = sim_create(25, 12, 0.0, NULL);
    /* Nodes 0..23 form the swarm; 24 joins later. Its own ID as the key
     * makes it the closest node to the key. */
    join_first(s, 24);
    got_t p = {0};
    uint8_t v[300];
    memset(v, 0, sizeof v);
    /* Signed: unsigned entries are never handed over (their writer stores
     * them where they belong; test_dht_spam.c). */
    assert_int_equal(dht_node_put(s->n[5].node, s->n[24].id, NULL, 0, v, sizeof v, s->now + 600000,
                                  1, on_put, &p, s->now), 0);
    sim_after(s, 5);
    sim_run(s, s->now + 3000, NULL);
    assert_true(p.status >= 1);
    dht_node_stats st;
    dht_node_get_stats(s->n[24].node, &st);
    assert_int_equal(st.store_keys, 0);
    dht_peer_addr pa;
    memset(&pa, 0, sizeof pa);
    sim_addr(&pa.addr, 0);
    pa.has_id = 1;
    memcpy(pa.id, s->n[0].id, 20);
    dht_node_join(s->n[24].node, &pa, 1, NULL, NULL, s->now);
    sim_after(s, 24);
    sim_run(s, s->now + 5000, NULL);
    dht_node_get_stats(s->n[24].node, &st);
    assert_int_equal(st.store_keys, 1); /* handed over by a holder */
    sim_destroy(&s);
}

static void test_isolated_put_defers_callback(void **state)
{
    (void)state;
    dht_node *n = make_node(20, NULL);
    got_t p = {0};
    uint8_t key[20] = {1};
    assert_int_equal(dht_node_put(n, key, NULL, 0, (const uint8_t *)"v", 1, T0 + 1000, 1, on_put,
                                  &p, T0), 0);
    assert_int_equal(p.called, 0);
    assert_int_equal(dht_node_next_deadline(n), 0); /* due now */
    dht_node_tick(n, T0);
    assert_int_equal(p.called, 1);
    assert_int_equal(p.status, 1); /* stored here only */
    /* Argument checks fail without calling back. */
    assert_int_equal(dht_node_put(n, key, NULL, 0, (const uint8_t *)"v", 1, T0, 1, on_put, &p, T0),
                     -EINVAL);
    assert_int_equal(dht_node_put(n, key, NULL, 0, (const uint8_t *)"v", DHT_MAX_VALUE + 1,
                                  T0 + 5, 1, on_put, &p, T0), -EINVAL);
    /* Pending operations are cancelled by destroy. */
    got_t g = {0};
    assert_int_equal(dht_node_get(n, key, on_get, &g, T0), 0);
    dht_node_destroy(&n);
    assert_int_equal(g.called, 1);
    assert_int_equal(g.status, -ECANCELED);
    assert_int_equal(p.called, 1);
}


/* ---- quorum gets and puts ---- */

typedef struct quorum_got {
    int called, status;
    size_t n, n_nodes;
    unsigned msgs;
    uint8_t subs[32][DHT_MAX_SUBKEY];
    size_t sub_len[32];
    int all_signed;
} quorum_got;

static void on_quorum_get(void *ud, const dht_result *r)
{
    quorum_got *g = ud;
    g->called++;
    g->status = r->status;
    g->n = r->n_entries;
    g->n_nodes = r->n_nodes;
    g->msgs = r->msgs;
    g->all_signed = 1;
    for (size_t i = 0; i < r->n_entries && i < 32; i++) {
        memcpy(g->subs[i], r->entries[i].subkey, r->entries[i].subkey_len);
        g->sub_len[i] = r->entries[i].subkey_len;
        g->all_signed &= r->entries[i].is_signed;
    }
}

static int got_sub(const quorum_got *g, const uint8_t *sub, size_t len)
{
    for (size_t i = 0; i < g->n && i < 32; i++)
        if (g->sub_len[i] == len && memcmp(g->subs[i], sub, len) == 0)
            return 1;
    return 0;
}

static const uint8_t *rank_key;
static const simnet *rank_net;
static int by_distance(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return dht_id_distance_cmp(rank_key, rank_net->n[x].id, rank_net->n[y].id);
}

/* order[0..count): the simnet's nodes, nearest to key first. */
static void rank_nodes(const simnet *s, const uint8_t key[20], uint32_t *order)
{
    for (uint32_t i = 0; i < s->count; i++)
        order[i] = i;
    rank_key = key;
    rank_net = s;
    qsort(order, s->count, sizeof *order, by_distance);
}

/* Stores e under key on node i only, as a client at an address outside the
 * simnet would (ping for a token, then store). */
static void store_on_one(simnet *s, uint32_t i, const uint8_t key[20], const dht_entry *e)
{
    dht_addr from;
    dht_msg m, r;
    uint8_t rbuf[DHT_MAX_DATAGRAM], tok[DHT_TOKEN_LEN];
    peer_addr(&from, 200, 9000);
    memset(&m, 0, sizeof m);
    m.type = DHT_MSG_PING;
    m.tid = 700 + i;
    m.id[0] = 0xee;
    m.read_only = 1;
    assert_true(exchange(s->n[i].node, &m, &from, s->now, &r, rbuf));
    assert_true(r.has_token);
    memcpy(tok, r.token, sizeof tok);
    memset(&m, 0, sizeof m);
    m.type = DHT_MSG_STORE;
    m.tid = 800 + i;
    m.id[0] = 0xee;
    m.read_only = 1;
    memcpy(m.target, key, 20);
    m.has_token = 1;
    memcpy(m.token, tok, sizeof tok);
    m.n_entries = 1;
    m.entries[0] = *e;
    assert_true(exchange(s->n[i].node, &m, &from, s->now, &r, rbuf));
    assert_int_equal(r.status, DHT_ST_OK);
}

static void run_get(simnet *s, uint32_t from, const uint8_t key[20], quorum_got *g)
{
    memset(g, 0, sizeof *g);
    assert_int_equal(dht_node_get(s->n[from].node, key, on_quorum_get, g, s->now), 0);
    sim_after(s, from);
    sim_run(s, s->now + 5000, NULL);
    assert_int_equal(g->called, 1);
    assert_int_equal(g->status, 0);
}

/* A get is over once the quorum (8) nearest nodes have answered, but it
 * still returns every live subkey: entries signed by different owners, and
 * entries that only some of the nearest holders have (each merged in). */
static void test_quorum_get_merges_holders(void **state)
{
    (void)state;
    simnet *s = sim_create(120, 21, 0.0, NULL);
    join_all(s);
    uint8_t key[20];
    dht_id_of_bytes(key, "fmnist-mlp.1", 12);

    /* Ten peers announce under one key (subkey = their node ID, signed). */
    got_t puts[10];
    memset(puts, 0, sizeof puts);
    for (uint32_t i = 0; i < 10; i++) {
        uint32_t src = 11 * i + 3;
        char val[300];
        memset(val, 0, sizeof val);
        snprintf(val, sizeof val, "peer %u", src);
        assert_int_equal(dht_node_put(s->n[src].node, key, NULL, 0, (const uint8_t *)val,
                                      sizeof val, s->now + 600000, 1, on_put, &puts[i], s->now), 0);
        sim_after(s, src);
        sim_run(s, s->now + 30, NULL);
    }
    sim_run(s, s->now + 5000, NULL);
    for (int i = 0; i < 10; i++) {
        assert_int_equal(puts[i].called, 1);
        /* Reported once the quorum nearest stored it (or later). */
        assert_true(puts[i].status >= DHT_QUORUM && puts[i].status <= DHT_K + 1);
    }
    quorum_got g;
    run_get(s, 100, key, &g);
    assert_int_equal(g.n, 10);
    assert_true(g.all_signed);
    for (uint32_t i = 0; i < 10; i++)
        assert_true(got_sub(&g, s->n[11 * i + 3].id, 20));
    assert_true(g.n_nodes >= DHT_QUORUM);

    /* The stores to the rest of the k nearest went on after the report:
     * each of the k nearest holds all ten entries. */
    uint32_t order[120];
    rank_nodes(s, key, order);
    for (int r = 0; r < DHT_K; r++) {
        dht_node_stats st;
        dht_node_get_stats(s->n[order[r]].node, &st);
        assert_int_equal(st.store_entries, 10);
    }

    /* Three owners whose entries reached only one of the nearest nodes each
     * (the nearest, the fourth and the eighth): one get returns all three. */
    uint8_t k2[20];
    dht_id_of_bytes(k2, "partial", 7);
    rank_nodes(s, k2, order);
    const int ranks[3] = {0, 3, DHT_QUORUM - 1};
    dht_identity owners[3];
    for (int j = 0; j < 3; j++) {
        uint8_t seed[32] = {0x51, (uint8_t)j};
        dht_entry e;
        uint8_t val[40];
        assert_int_equal(dht_identity_from_seed(&owners[j], seed), 0);
        memset(val, 'a' + j, sizeof val);
        memset(&e, 0, sizeof e);
        e.subkey = owners[j].id;
        e.subkey_len = 20;
        e.value = val;
        e.value_len = sizeof val;
        e.expires = s->now + 600000;
        assert_int_equal(dht_entry_sign(&e, k2, &owners[j]), 0);
        store_on_one(s, order[ranks[j]], k2, &e);
    }
    uint32_t getter = order[60];
    run_get(s, getter, k2, &g);
    assert_int_equal(g.n, 3);
    for (int j = 0; j < 3; j++)
        assert_true(got_sub(&g, owners[j].id, 20));
    unsigned quorum_msgs = g.msgs;

    /* A node configured with quorum = k waits for all k nearest: it asks
     * more nodes for the same answer. */
    dht_config full;
    dht_config_default(&full);
    full.quorum = DHT_K;
    dht_identity gid;
    uint8_t gseed[32] = {0x77};
    dht_identity_from_seed(&gid, gseed);
    dht_node *old = s->n[getter].node;
    s->n[getter].node = dht_node_create(&gid, &full, s->now);
    assert_non_null(s->n[getter].node);
    memcpy(s->n[getter].id, gid.id, 20);
    dht_node_destroy(&old);
    dht_peer_addr pa;
    memset(&pa, 0, sizeof pa);
    sim_addr(&pa.addr, 0);
    pa.has_id = 1;
    memcpy(pa.id, s->n[0].id, 20);
    dht_node_join(s->n[getter].node, &pa, 1, NULL, NULL, s->now);
    sim_after(s, getter);
    sim_run(s, s->now + 10000, NULL);
    run_get(s, getter, k2, &g);
    assert_int_equal(g.n, 3);
    assert_true(g.n_nodes >= DHT_K);
    assert_true(g.msgs > quorum_msgs);
    sim_destroy(&s);
}

static uint64_t get_done_at;
static simnet *get_net;
static void on_timed_get(void *ud, const dht_result *r)
{
    on_quorum_get(ud, r);
    get_done_at = get_net->now;
}

/* A dead node among the nearest costs a get one stale period (250 ms): the
 * next candidate takes its place in the quorum once it was silent once. */
static void test_get_replaces_silent_holder(void **state)
{
    (void)state;
    simnet *s = sim_create(60, 25, 0.0, NULL);
    join_all(s);
    uint8_t key[20];
    dht_id_of_bytes(key, "churned", 7);
    got_t p = {0};
    assert_int_equal(dht_node_put(s->n[7].node, key, NULL, 0, (const uint8_t *)"v", 1,
                                  s->now + 600000, 1, on_put, &p, s->now), 0);
    sim_after(s, 7);
    sim_run(s, s->now + 3000, NULL);
    assert_true(p.status >= 1);
    uint32_t order[60];
    rank_nodes(s, key, order);
    sim_kill(s, order[0]);
    sim_kill(s, order[2]);
    uint32_t getter = order[40] == 7 ? order[41] : order[40];
    quorum_got g;
    memset(&g, 0, sizeof g);
    get_net = s;
    uint64_t t0 = s->now;
    assert_int_equal(dht_node_get(s->n[getter].node, key, on_timed_get, &g, s->now), 0);
    sim_after(s, getter);
    sim_run(s, s->now + 5000, NULL);
    assert_int_equal(g.called, 1);
    assert_int_equal(g.status, 0);
    assert_int_equal(g.n, 1);
    assert_true(got_sub(&g, s->n[7].id, 20));
    /* 250 ms stale period + at most a few 10-80 ms exchanges. */
    assert_true(get_done_at - t0 >= 250);
    assert_true(get_done_at - t0 < 500);
    sim_destroy(&s);
}

/* A join whose only initial peer is silent for a while (lost datagrams, a
 * peer still starting) asks it again instead of giving up alone. */
static void test_join_retries_silent_peer(void **state)
{
    (void)state;
    simnet *s = sim_create(6, 23, 0.0, NULL);
    join_first(s, 5);
    dht_peer_addr pa;
    memset(&pa, 0, sizeof pa);
    sim_addr(&pa.addr, 1);
    pa.has_id = 1;
    memcpy(pa.id, s->n[1].id, 20);
    sim_kill(s, 1); /* silent: both tries of the first round are lost */
    join_called = 0;
    assert_int_equal(dht_node_join(s->n[5].node, &pa, 1, on_join, NULL, s->now), 0);
    sim_after(s, 5);
    sim_run(s, s->now + 700, NULL);
    assert_int_equal(join_called, 0);
    s->n[1].alive = 1;
    s->n[1].sched = UINT64_MAX;
    sim_after(s, 1);
    sim_run(s, s->now + 5000, NULL);
    assert_int_equal(join_called, 1);
    assert_int_equal(join_status, 0);
    dht_node_stats st;
    dht_node_get_stats(s->n[5].node, &st);
    assert_true(st.table_size >= 4);

    /* A peer that stays silent still fails the join, in bounded time. */
    uint8_t seed[32] = {0x42};
    dht_identity id;
    dht_identity_from_seed(&id, seed);
    dht_node *lone = dht_node_create(&id, NULL, s->now);
    const uint8_t ip[4] = {10, 9, 9, 9}; /* nobody there */
    memset(&pa, 0, sizeof pa);
    dht_addr_v4(&pa.addr, ip, 4000);
    join_called = 0;
    assert_int_equal(dht_node_join(lone, &pa, 1, on_join, NULL, s->now), 0);
    uint8_t buf[DHT_MAX_DATAGRAM];
    dht_addr to;
    uint64_t t = s->now;
    while (!join_called && t < s->now + 10000) {
        while (dht_node_pop_output(lone, buf, sizeof buf, &to) > 0)
            ;
        t += 50;
        dht_node_tick(lone, t);
    }
    assert_int_equal(join_called, 1);
    assert_int_equal(join_status, -EHOSTUNREACH);
    assert_true(t - s->now <= 3000);
    dht_node_get_stats(lone, &st);
    assert_true(st.req_sent[DHT_MSG_FIND_NODE] >= 5); /* 3 rounds of 2 tries */
    dht_node_destroy(&lone);
    sim_destroy(&s);
}

/* Two nodes with one identity (two processes started with the same
 * identity file): the second one's join meets our ID at the first one's
 * address in node 0's answer, asks it, gets a valid proof, and reports
 * -EADDRINUSE with that address. Node 0 keeps the ID at the first address.
 * A restart at the same address, or at a new one while the old process is
 * gone, is no collision. */
static void test_identity_collision(void **state)
{
    (void)state;
    simnet *s = sim_create(6, 31, 0.0, NULL);
    join_first(s, 3); /* nodes 1 and 2 join through node 0 */
    dht_identity twin;
    uint8_t seed[32] = {0x77};
    assert_int_equal(dht_identity_from_seed(&twin, seed), 0);
    /* Node 3 runs with identity "twin" and joins; then node 4 with the same. */
    for (uint32_t i = 3; i <= 4; i++) {
        dht_node_destroy(&s->n[i].node);
        s->n[i].node = dht_node_create(&twin, NULL, s->now);
        assert_non_null(s->n[i].node);
        memcpy(s->n[i].id, twin.id, 20);
    }
    dht_peer_addr pa;
    memset(&pa, 0, sizeof pa);
    sim_addr(&pa.addr, 0);
    pa.has_id = 1;
    memcpy(pa.id, s->n[0].id, 20);
    join_called = 0;
    assert_int_equal(dht_node_join(s->n[3].node, &pa, 1, on_join, NULL, s->now), 0);
    sim_after(s, 3);
    sim_run(s, s->now + 5000, &join_called);
    assert_int_equal(join_called, 1);
    assert_int_equal(join_status, 0);
    sim_run(s, s->now + 3000, NULL);

    uint64_t t0 = s->now;
    join_called = 0;
    assert_int_equal(dht_node_join(s->n[4].node, &pa, 1, on_join, NULL, s->now), 0);
    sim_after(s, 4);
    sim_run(s, s->now + 5000, &join_called);
    assert_int_equal(join_called, 1);
    assert_int_equal(join_status, -EADDRINUSE);
    assert_true(s->now - t0 < 1500);
    dht_join_diag why;
    dht_addr a3, got;
    sim_addr(&a3, 3);
    assert_int_equal(dht_node_join_diag(s->n[4].node, &why), -EADDRINUSE);
    assert_true(dht_addr_equal(&why.addr, &a3));
    assert_memory_equal(why.expected, twin.id, 20);
    assert_int_equal(dht_node_collision(s->n[4].node, &got), 0);
    assert_true(dht_addr_equal(&got, &a3));
    dht_node_stats st;
    dht_node_get_stats(s->n[4].node, &st);
    assert_int_equal(st.id_collisions, 1);
    /* The first one saw nothing of its own and is still known at its
     * address. */
    assert_int_equal(dht_node_collision(s->n[3].node, &got), -ENOENT);
    dht_wire_node near[1];
    assert_int_equal(dht_node_closest(s->n[0].node, twin.id, near, 1), 1);
    assert_memory_equal(near[0].id, twin.id, 20);
    assert_true(dht_addr_equal(&near[0].addr, &a3));

    /* The first one restarts at its own address: no collision. */
    sim_run(s, s->now + 2000, NULL);
    dht_node_destroy(&s->n[3].node);
    s->n[3].node = dht_node_create(&twin, NULL, s->now);
    join_called = 0;
    assert_int_equal(dht_node_join(s->n[3].node, &pa, 1, on_join, NULL, s->now), 0);
    sim_after(s, 3);
    sim_run(s, s->now + 5000, &join_called);
    assert_int_equal(join_called, 1);
    assert_int_equal(join_status, 0);
    assert_int_equal(dht_node_collision(s->n[3].node, &got), -ENOENT);

    /* ... or at another address once the old process is gone (node 5
     * takes the identity; node 3 is dead): no collision either. */
    sim_kill(s, 3);
    sim_run(s, s->now + 2000, NULL);
    dht_node_destroy(&s->n[5].node);
    s->n[5].node = dht_node_create(&twin, NULL, s->now);
    join_called = 0;
    assert_int_equal(dht_node_join(s->n[5].node, &pa, 1, on_join, NULL, s->now), 0);
    sim_after(s, 5);
    sim_run(s, s->now + 5000, &join_called);
    assert_int_equal(join_called, 1);
    assert_int_equal(join_status, 0);
    assert_int_equal(dht_node_collision(s->n[5].node, &got), -ENOENT);
    sim_destroy(&s);
}

/* A routing-table entry that is alive at its address is not worn down by
 * requests to the same ID at another address (a node list naming it there:
 * stale, false, or a second process with that identity): a silent or
 * wrong-ID answer there counts against nobody, so the other address can
 * never take the ID over. */
static void test_table_keeps_live_id_at_its_address(void **state)
{
    (void)state;
    dht_config cfg;
    dht_config_default(&cfg);
    cfg.verify_ids = 0; /* trust IDs: the table fills from requests */
    cfg.k = 2;
    dht_node *n = make_node(9, &cfg);
    const uint8_t *self = dht_node_id(n);
    uint8_t x[20], y1[20], y2[20], z[20];
    /* x in bucket 0, y1 in bucket 1, y2 in bucket 2: a lookup for y1 with
     * k = 2 starts from y1 and y2, not x. */
    memcpy(x, self, 20);
    x[0] ^= 0x80;
    memcpy(y1, self, 20);
    y1[0] ^= 0x40;
    memcpy(y2, self, 20);
    y2[0] ^= 0x20;
    memset(z, 0x5a, 20);
    dht_addr ax, ay1, ay2, elsewhere;
    peer_addr(&ax, 1, 5000);
    peer_addr(&ay1, 2, 5000);
    peer_addr(&ay2, 3, 5000);
    peer_addr(&elsewhere, 4, 5000);
    uint64_t now = T0;
    const uint8_t *ids[3] = {x, y1, y2};
    const dht_addr *addrs[3] = {&ax, &ay1, &ay2};
    for (int i = 0; i < 3; i++) {
        dht_msg m, r;
        uint8_t rbuf[DHT_MAX_DATAGRAM];
        memset(&m, 0, sizeof m);
        m.type = DHT_MSG_PING;
        m.tid = (uint32_t)(100 + i);
        memcpy(m.id, ids[i], 20);
        assert_true(exchange(n, &m, addrs[i], now, &r, rbuf));
    }
    dht_node_stats st;
    dht_node_get_stats(n, &st);
    assert_int_equal(st.table_size, 3);
    /* Two lookups; in each, y1 names x at another address, and y2 answers
     * with a wrong ID (so x is among the k nearest left and is asked there).
     * x's other address answers with another ID (first) or not at all
     * (second). */
    for (int round = 0; round < 2; round++) {
        assert_int_equal(dht_node_find(n, y1, NULL, NULL, now), 0);
        uint8_t buf[DHT_MAX_DATAGRAM];
        dht_addr dst;
        int len, asked = 0;
        dht_msg q, r;
        while ((len = dht_node_pop_output(n, buf, sizeof buf, &dst)) > 0) {
            assert_int_equal(dht_wire_decode(&q, buf, (size_t)len), 0);
            if (q.type & DHT_MSG_REPLY)
                continue;
            memset(&r, 0, sizeof r);
            r.type = (uint8_t)(q.type | DHT_MSG_REPLY);
            r.tid = q.tid;
            if (dht_addr_equal(&dst, &ay1)) {
                memcpy(r.id, y1, 20);
                r.n_nodes = 1;
                memcpy(r.nodes[0].id, x, 20);
                r.nodes[0].addr = elsewhere;
            } else if (dht_addr_equal(&dst, &ay2)) {
                memcpy(r.id, z, 20);
            } else if (dht_addr_equal(&dst, &elsewhere)) {
                asked++;
                if (round == 1)
                    continue; /* silent */
                memcpy(r.id, z, 20);
            } else {
                fail_msg("round %d: unexpected request", round);
            }
            uint8_t out[DHT_MAX_DATAGRAM];
            int ol = dht_wire_encode(&r, out, sizeof out);
            assert_true(ol > 0);
            dht_node_input(n, out, (size_t)ol, &dst, now + 20);
        }
        assert_true(asked >= 1);
        for (int i = 0; i < 40; i++) {
            now += 100;
            dht_node_tick(n, now);
            while (dht_node_pop_output(n, buf, sizeof buf, &dst) > 0)
                ; /* retries to the silent address, lost */
        }
        dht_node_get_stats(n, &st);
        assert_int_equal(st.lookups, 0);
    }
    /* x is still in the table, at its own address. */
    dht_wire_node near[1];
    assert_int_equal(dht_node_closest(n, x, near, 1), 1);
    assert_memory_equal(near[0].id, x, 20);
    assert_true(dht_addr_equal(&near[0].addr, &ax));
    dht_node_destroy(&n);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_write_token_binds_address),
        cmocka_unit_test(test_proof_of_id_in_replies),
        cmocka_unit_test(test_join_refuses_wrong_id_and_foreign_swarm),
        cmocka_unit_test(test_garbage_then_still_answers),
        cmocka_unit_test(test_rate_limit_per_source),
        cmocka_unit_test(test_paged_get_collects_every_subkey),
        cmocka_unit_test(test_handover_to_closer_newcomer),
        cmocka_unit_test(test_isolated_put_defers_callback),
        cmocka_unit_test(test_quorum_get_merges_holders),
        cmocka_unit_test(test_join_retries_silent_peer),
        cmocka_unit_test(test_get_replaces_silent_holder),
        cmocka_unit_test(test_identity_collision),
        cmocka_unit_test(test_table_keeps_live_id_at_its_address),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
