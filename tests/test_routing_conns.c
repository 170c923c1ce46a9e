/* tests/test_routing_conns.c: the client's connection pool (routing/conns.h)
 * closing connections that are still being set up, and reporting the ones
 * that cannot be.
 *
 * The "holder" here is a TCP listener that accepts and then says nothing,
 * so every client stays in its handshake (connecting) until closed. Closing
 * such a connection cancels its setup; that is our own doing, not a failed
 * holder: on_failed must not run, and the pool must stay consistent when
 * several are closed at once (the cancel re-enters the pool's connect
 * callback, which must not remove the entry a second time: that corrupted
 * the table and crashed a trainer or `starling infer` finishing while a
 * connection was still being set up).
 *
 * Connections are keyed by node ID and address: two servers sharing one
 * identity at two addresses get a connection each, and a call goes to the
 * address asked for (issue 17: a trainer sent stage 3's calls to the process
 * serving stages 0-2 under the same identity, and hung). Setting up a
 * connection is bounded by connect_timeout_ms. */
#include <errno.h>
#include <string.h>

#include <uv.h>

#include "net/rpc_server.h"
#include "routing/conns.h"
#include "test_util.h"

typedef struct silent {
    uv_tcp_t srv;
    uv_tcp_t peers[8];
    int n;
} silent;

static void on_peer_closed(uv_handle_t *h)
{
    (void)h;
}

static void on_silent_conn(uv_stream_t *s, int status)
{
    silent *sv = s->data;
    if (status != 0 || sv->n >= 8)
        return;
    uv_tcp_t *p = &sv->peers[sv->n];
    uv_tcp_init(s->loop, p);
    if (uv_accept(s, (uv_stream_t *)p) == 0)
        sv->n++;
    else
        uv_close((uv_handle_t *)p, on_peer_closed);
}

typedef struct counts {
    int ready, failed, last_status;
    char last_addr[80];
} counts;

static void on_ready(void *arg, const uint8_t id[DHT_ID_LEN], const char *addr)
{
    (void)id;
    counts *k = arg;
    k->ready++;
    snprintf(k->last_addr, sizeof k->last_addr, "%s", addr);
}

static void on_failed(void *arg, const uint8_t id[DHT_ID_LEN], const char *addr, int status)
{
    (void)id;
    counts *k = arg;
    k->failed++;
    k->last_status = status;
    snprintf(k->last_addr, sizeof k->last_addr, "%s", addr);
}

static void run_for(uv_loop_t *loop, uint64_t ms)
{
    uv_update_time(loop);
    uint64_t end = uv_now(loop) + ms;
    for (int i = 0; i < 100000 && uv_now(loop) < end; i++) {
        uv_run(loop, UV_RUN_NOWAIT);
        uv_sleep(1);
        uv_update_time(loop);
    }
}

/* Runs the loop until the pool has nothing open (bounded). */
static int drain(uv_loop_t *loop, route_conns *c)
{
    for (int i = 0; i < 2000 && route_conns_open(c) > 0; i++) {
        uv_run(loop, UV_RUN_NOWAIT);
        uv_sleep(1);
    }
    return route_conns_open(c);
}

static void test_close_while_connecting(void **state)
{
    (void)state;
    uv_loop_t loop;
    uv_loop_init(&loop);
    silent sv;
    memset(&sv, 0, sizeof sv);
    uv_tcp_init(&loop, &sv.srv);
    sv.srv.data = &sv;
    struct sockaddr_in a;
    uv_ip4_addr("127.0.0.1", 0, &a);
    assert_int_equal(uv_tcp_bind(&sv.srv, (const struct sockaddr *)&a, 0), 0);
    assert_int_equal(uv_listen((uv_stream_t *)&sv.srv, 16, on_silent_conn), 0);
    struct sockaddr_storage ss;
    int len = sizeof ss;
    uv_tcp_getsockname(&sv.srv, (struct sockaddr *)&ss, &len);
    char addr[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", ntohs(((struct sockaddr_in *)&ss)->sin_port));

    dht_identity me;
    uint8_t seed[32] = {7};
    dht_identity_from_seed(&me, seed);
    counts k;
    memset(&k, 0, sizeof k);
    route_conns_config cc = {.ident = &me, .max_pending = 4, .on_ready = on_ready, .on_failed = on_failed, .arg = &k};
    route_conns *c = route_conns_create(&loop, &cc);
    assert_non_null(c);
    uint8_t ids[4][DHT_ID_LEN];
    for (int i = 0; i < 4; i++) {
        memset(ids[i], 0x11 * (i + 1), DHT_ID_LEN);
        assert_null(route_conns_get(c, ids[i], addr, NULL)); /* connecting */
    }
    assert_int_equal(route_conns_open(c), 4);
    assert_null(route_conns_get(c, ids[0], addr, NULL)); /* still the same one */
    assert_int_equal(route_conns_open(c), 4);
    run_for(&loop, 100); /* TCP connects; the handshake gets no answer */
    assert_int_equal(sv.n, 4);
    assert_int_equal(k.ready, 0);

    /* One dropped, then all the others at once. */
    route_conns_drop(c, ids[1], addr);
    route_conns_close_all(c);
    assert_int_equal(drain(&loop, c), 0);
    assert_int_equal(k.failed, 0); /* we cancelled them; no holder failed */
    assert_int_equal(k.ready, 0);

    /* The pool is usable again: a new connection to the same holder. */
    assert_null(route_conns_get(c, ids[1], addr, NULL));
    assert_int_equal(route_conns_open(c), 1);
    route_conns_close_all(c);
    assert_int_equal(drain(&loop, c), 0);
    assert_int_equal(k.failed, 0);

    /* A holder that refuses: on_failed once, with an error, entry gone. */
    uv_close((uv_handle_t *)&sv.srv, on_peer_closed);
    for (int i = 0; i < sv.n; i++)
        uv_close((uv_handle_t *)&sv.peers[i], on_peer_closed);
    run_for(&loop, 20);
    assert_null(route_conns_get(c, ids[2], addr, NULL));
    for (int i = 0; i < 2000 && k.failed == 0; i++) {
        uv_run(&loop, UV_RUN_NOWAIT);
        uv_sleep(1);
    }
    assert_int_equal(k.failed, 1);
    assert_true(k.last_status < 0);
    assert_int_equal(drain(&loop, c), 0);

    route_conns_destroy(&c);
    assert_null(c);
    uv_run(&loop, UV_RUN_DEFAULT);
    assert_int_equal(uv_loop_close(&loop), 0);
}

/* ---- one identity at two addresses ---- */

typedef struct server {
    peer_rpc_server *srv;
    int which;          /* answered in the reply's meta */
    int closed;
} server;

static void answer_which(peer_rpc_request *req, const peer_msg *msg, void *arg)
{
    (void)msg;
    server *sv = arg;
    uint8_t meta[1] = {(uint8_t)sv->which};
    peer_msg reply;
    peer_msg_init(&reply, PEER_KIND_REPLY, PEER_METHOD_INFO, 0);
    reply.meta = meta;
    reply.meta_len = 1;
    peer_rpc_respond(req, &reply);
}

static void on_server_closed(peer_rpc_server *srv, void *arg)
{
    (void)srv;
    ((server *)arg)->closed = 1;
}

static void start_server(uv_loop_t *loop, server *sv, const dht_identity *ident, int which, char *addr, size_t len)
{
    memset(sv, 0, sizeof *sv);
    sv->which = which;
    peer_rpc_server_config sc;
    memset(&sc, 0, sizeof sc);
    sc.self = ident;
    sc.handler = answer_which;
    sc.arg = sv;
    sv->srv = peer_rpc_server_create(loop, &sc);
    assert_non_null(sv->srv);
    struct sockaddr_in a;
    uv_ip4_addr("127.0.0.1", 0, &a);
    assert_int_equal(peer_rpc_server_listen(sv->srv, (const struct sockaddr *)&a), 0);
    snprintf(addr, len, "127.0.0.1:%d", peer_rpc_server_port(sv->srv));
}

static void stop_server(uv_loop_t *loop, server *sv)
{
    peer_rpc_server_stop(sv->srv, on_server_closed, sv);
    for (int i = 0; i < 5000 && !sv->closed; i++) {
        uv_run(loop, UV_RUN_NOWAIT);
        uv_sleep(1);
    }
    assert_true(sv->closed);
    peer_rpc_server_destroy(&sv->srv);
}

typedef struct answer {
    int done, status, which;
} answer;

static void on_answer(void *arg, int status, const peer_msg *reply)
{
    answer *a = arg;
    a->done = 1;
    a->status = status;
    a->which = status == 0 && reply->meta_len == 1 ? ((const uint8_t *)reply->meta)[0] : -1;
}

/* Which server answers a call on cl. */
static int ask(uv_loop_t *loop, peer_rpc_client *cl)
{
    peer_msg m;
    peer_msg_init(&m, PEER_KIND_REQUEST, PEER_METHOD_INFO, 0);
    answer a = {0, 0, -1};
    assert_int_equal(peer_rpc_call(cl, &m, 5000, on_answer, &a, NULL), 0);
    for (int i = 0; i < 5000 && !a.done; i++) {
        uv_run(loop, UV_RUN_NOWAIT);
        uv_sleep(1);
    }
    assert_true(a.done);
    assert_int_equal(a.status, 0);
    return a.which;
}

/* Gets the connected client for id at addr, running the loop meanwhile. */
static peer_rpc_client *get_ready(uv_loop_t *loop, route_conns *c, const uint8_t *id, const char *addr,
                                  uint64_t *serial)
{
    peer_rpc_client *cl = NULL;
    for (int i = 0; i < 5000 && !(cl = route_conns_get(c, id, addr, serial)); i++) {
        uv_run(loop, UV_RUN_NOWAIT);
        uv_sleep(1);
    }
    assert_non_null(cl);
    return cl;
}

static int keep_addr(void *arg, const uint8_t id[DHT_ID_LEN], const char *addr)
{
    (void)id;
    return !strcmp(addr, arg);
}

static void test_one_identity_two_addresses(void **state)
{
    (void)state;
    uv_loop_t loop;
    uv_loop_init(&loop);
    dht_identity shared, me;
    uint8_t seed[32] = {42}, seed2[32] = {9};
    dht_identity_from_seed(&shared, seed);
    dht_identity_from_seed(&me, seed2);
    server s0, s1;
    char a0[64], a1[64];
    start_server(&loop, &s0, &shared, 0, a0, sizeof a0);
    start_server(&loop, &s1, &shared, 1, a1, sizeof a1);

    counts k;
    memset(&k, 0, sizeof k);
    route_conns_config cc = {.ident = &me, .max_pending = 4, .on_ready = on_ready, .on_failed = on_failed, .arg = &k};
    route_conns *c = route_conns_create(&loop, &cc);
    assert_non_null(c);
    assert_null(route_conns_get(c, shared.id, a0, NULL));
    assert_null(route_conns_get(c, shared.id, a1, NULL));
    assert_int_equal(route_conns_open(c), 2); /* one per address, not one per ID */

    uint64_t ser0 = 0, ser1 = 0;
    peer_rpc_client *c0 = get_ready(&loop, c, shared.id, a0, &ser0);
    peer_rpc_client *c1 = get_ready(&loop, c, shared.id, a1, &ser1);
    assert_true(c0 != c1);
    assert_true(ser0 != 0 && ser1 != 0 && ser0 != ser1);
    assert_int_equal(k.ready, 2);
    assert_int_equal(ask(&loop, c0), 0);
    assert_int_equal(ask(&loop, c1), 1);
    assert_int_equal(ask(&loop, route_conns_get(c, shared.id, a0, NULL)), 0);

    /* The holder is now announced at a1 only: the connection to a0 goes,
     * the one to a1 stays, and nobody failed. */
    assert_int_equal(route_conns_retain(c, keep_addr, a1), 1);
    assert_int_equal(route_conns_open(c), 2); /* a0 is still closing */
    for (int i = 0; i < 2000 && route_conns_open(c) > 1; i++) {
        uv_run(&loop, UV_RUN_NOWAIT);
        uv_sleep(1);
    }
    assert_int_equal(route_conns_open(c), 1);
    assert_int_equal(k.failed, 0);
    assert_true(route_conns_get(c, shared.id, a1, NULL) == c1);
    assert_int_equal(route_conns_retain(c, keep_addr, a1), 0);
    /* Asked again, a0 is a new connection with a new serial. */
    uint64_t ser0b = 0;
    peer_rpc_client *c0b = get_ready(&loop, c, shared.id, a0, &ser0b);
    assert_true(ser0b != ser0 && ser0b != ser1);
    assert_int_equal(ask(&loop, c0b), 0);

    /* Dropping by ID alone closes both. */
    route_conns_drop(c, shared.id, NULL);
    assert_int_equal(drain(&loop, c), 0);
    assert_int_equal(k.failed, 0);

    route_conns_destroy(&c);
    stop_server(&loop, &s0);
    stop_server(&loop, &s1);
    uv_run(&loop, UV_RUN_DEFAULT);
    assert_int_equal(uv_loop_close(&loop), 0);
}

/* A holder that accepts TCP but never finishes the handshake: on_failed
 * with -ETIMEDOUT after connect_timeout_ms, not the RPC client's 5 s. */
static void test_connect_timeout(void **state)
{
    (void)state;
    uv_loop_t loop;
    uv_loop_init(&loop);
    silent sv;
    memset(&sv, 0, sizeof sv);
    uv_tcp_init(&loop, &sv.srv);
    sv.srv.data = &sv;
    struct sockaddr_in a;
    uv_ip4_addr("127.0.0.1", 0, &a);
    assert_int_equal(uv_tcp_bind(&sv.srv, (const struct sockaddr *)&a, 0), 0);
    assert_int_equal(uv_listen((uv_stream_t *)&sv.srv, 16, on_silent_conn), 0);
    struct sockaddr_storage ss;
    int len = sizeof ss;
    uv_tcp_getsockname(&sv.srv, (struct sockaddr *)&ss, &len);
    char addr[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", ntohs(((struct sockaddr_in *)&ss)->sin_port));

    dht_identity me;
    uint8_t seed[32] = {3};
    dht_identity_from_seed(&me, seed);
    counts k;
    memset(&k, 0, sizeof k);
    route_conns_config cc = {.ident = &me,
                             .max_pending = 4,
                             .on_ready = on_ready,
                             .on_failed = on_failed,
                             .arg = &k,
                             .connect_timeout_ms = 300};
    route_conns *c = route_conns_create(&loop, &cc);
    uint8_t id[DHT_ID_LEN];
    memset(id, 0x5a, sizeof id);
    uv_update_time(&loop);
    uint64_t t0 = uv_now(&loop);
    assert_null(route_conns_get(c, id, addr, NULL));
    for (int i = 0; i < 4000 && k.failed == 0; i++) {
        uv_run(&loop, UV_RUN_NOWAIT);
        uv_sleep(1);
        uv_update_time(&loop);
    }
    uint64_t took = uv_now(&loop) - t0;
    assert_int_equal(k.failed, 1);
    assert_int_equal(k.last_status, -ETIMEDOUT);
    assert_string_equal(k.last_addr, addr);
    if (took < 250 || took > 2500)
        fail_msg("the handshake timed out after %llu ms, want about 300", (unsigned long long)took);
    assert_int_equal(drain(&loop, c), 0);
    route_conns_destroy(&c);

    uv_close((uv_handle_t *)&sv.srv, on_peer_closed);
    for (int i = 0; i < sv.n; i++)
        uv_close((uv_handle_t *)&sv.peers[i], on_peer_closed);
    uv_run(&loop, UV_RUN_DEFAULT);
    assert_int_equal(uv_loop_close(&loop), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_close_while_connecting),
        cmocka_unit_test(test_one_identity_two_addresses),
        cmocka_unit_test(test_connect_timeout),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
