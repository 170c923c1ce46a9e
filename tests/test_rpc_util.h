/* tests/test_rpc_util.h: loopback RPC helpers shared by the peer tests that
 * drive a peer_service from a test's own libuv loop. Include after cmocka. */
#ifndef TESTS_TEST_RPC_UTIL_H
#define TESTS_TEST_RPC_UTIL_H

#include <string.h>
#include <unistd.h>

#include <uv.h>

#include "peer/peer.h"

/* Runs loop until *flag is non-zero, for at most max_ms (then fails). */
static inline void test_run_until(uv_loop_t *loop, volatile int *flag, int max_ms)
{
    for (int i = 0; i < max_ms && !*flag; i++) {
        uv_run(loop, UV_RUN_NOWAIT);
        if (!*flag)
            usleep(1000);
    }
    assert_true(*flag);
}

static inline void test_rpc_on_connect(peer_rpc_client *cl, int status, void *arg)
{
    (void)cl;
    *(int *)arg = status == 0 ? 1 : status;
}

static inline void test_rpc_on_flag(peer_rpc_client *cl, void *arg)
{
    (void)cl;
    *(int *)arg = 1;
}

/* A client of identity self, connected to 127.0.0.1:port, which must
 * prove identity expect_id. */
static inline peer_rpc_client *test_rpc_connect(uv_loop_t *loop, const dht_identity *self,
                                                const uint8_t *expect_id, int port)
{
    peer_rpc_client_config cc;
    memset(&cc, 0, sizeof cc);
    cc.self = self;
    cc.expect_id = expect_id;
    /* The wait below is the bound, not the client's 5 s default: a
     * sanitizer build beside other work once needed longer. */
    cc.connect_timeout_ms = 20000;
    peer_rpc_client *cl = peer_rpc_client_create(loop, &cc);
    assert_non_null(cl);
    struct sockaddr_in sa;
    uv_ip4_addr("127.0.0.1", port, &sa);
    int ok = 0;
    assert_int_equal(peer_rpc_client_connect(cl, (const struct sockaddr *)&sa, test_rpc_on_connect, &ok), 0);
    test_run_until(loop, &ok, 20000);
    assert_int_equal(ok, 1);
    return cl;
}

/* Closes and frees *cl; sets it to NULL. */
static inline void test_rpc_close(uv_loop_t *loop, peer_rpc_client **cl)
{
    int done = 0;
    peer_rpc_client_stop(*cl, test_rpc_on_flag, &done);
    test_run_until(loop, &done, 20000);
    peer_rpc_client_destroy(cl);
}

#endif
