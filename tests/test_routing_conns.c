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
 * connection was still being set up). */
#include <errno.h>
#include <string.h>

#include <uv.h>

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
} counts;

static void on_ready(void *arg)
{
    ((counts *)arg)->ready++;
}

static void on_failed(void *arg, const uint8_t id[DHT_ID_LEN], int status)
{
    (void)id;
    counts *k = arg;
    k->failed++;
    k->last_status = status;
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
    counts k = {0, 0, 0};
    route_conns_config cc = {&me, NULL, 4, on_ready, on_failed, &k};
    route_conns *c = route_conns_create(&loop, &cc);
    assert_non_null(c);
    uint8_t ids[4][DHT_ID_LEN];
    for (int i = 0; i < 4; i++) {
        memset(ids[i], 0x11 * (i + 1), DHT_ID_LEN);
        assert_null(route_conns_get(c, ids[i], addr)); /* connecting */
    }
    assert_int_equal(route_conns_open(c), 4);
    assert_null(route_conns_get(c, ids[0], addr)); /* still the same one */
    assert_int_equal(route_conns_open(c), 4);
    run_for(&loop, 100); /* TCP connects; the handshake gets no answer */
    assert_int_equal(sv.n, 4);
    assert_int_equal(k.ready, 0);

    /* One dropped, then all the others at once. */
    route_conns_drop(c, ids[1]);
    route_conns_close_all(c);
    assert_int_equal(drain(&loop, c), 0);
    assert_int_equal(k.failed, 0); /* we cancelled them; no holder failed */
    assert_int_equal(k.ready, 0);

    /* The pool is usable again: a new connection to the same holder. */
    assert_null(route_conns_get(c, ids[1], addr));
    assert_int_equal(route_conns_open(c), 1);
    route_conns_close_all(c);
    assert_int_equal(drain(&loop, c), 0);
    assert_int_equal(k.failed, 0);

    /* A holder that refuses: on_failed once, with an error, entry gone. */
    uv_close((uv_handle_t *)&sv.srv, on_peer_closed);
    for (int i = 0; i < sv.n; i++)
        uv_close((uv_handle_t *)&sv.peers[i], on_peer_closed);
    run_for(&loop, 20);
    assert_null(route_conns_get(c, ids[2], addr));
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

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_close_while_connecting),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
