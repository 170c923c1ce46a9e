/* Tensor RPC over loopback (net/rpc_server.h, net/rpc_client.h). */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdatomic.h>
#include <sys/socket.h>

#include <uv.h>

#include "peer/peer.h"
#include "test_util.h"

#define SEED 777u

static dht_identity id_s, id_c, id_x;
static uv_loop_t loop;

/* ---- the test handler: an affine "block" ---- */

/* forward: y = 2x + 1 per input tensor; backward (inputs, grad_out): grad_in
 * = 2 * grad_out; info: meta "affine". Block "async" computes on a worker
 * thread; block "slow" is parked until the test answers it. */
typedef struct worker {
    pthread_t th;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    peer_rpc_request *q[1024];
    const peer_msg *qm[1024];
    int head, tail, stop;
} worker;

static worker W;
static peer_rpc_request *parked[64];
static int n_parked, n_handled;

static void compute(peer_rpc_request *req, const peer_msg *m)
{
    peer_msg r;
    peer_msg_init(&r, PEER_KIND_REPLY, m->method, 0);
    static _Thread_local float out[PEER_WIRE_MAX_TENSORS][4096];
    if (m->method == PEER_METHOD_INFO) {
        r.meta = "affine";
        r.meta_len = 6;
        peer_rpc_respond(req, &r);
        return;
    }
    if (m->method != PEER_METHOD_FORWARD && m->method != PEER_METHOD_BACKWARD) {
        peer_rpc_respond_error(req, ENOSYS, "unknown method");
        return;
    }
    int first = 0, n = m->n_tensors;
    if (m->method == PEER_METHOD_BACKWARD) {
        if (n % 2) {
            peer_rpc_respond_error(req, EINVAL, "backward wants inputs and grad_outputs");
            return;
        }
        first = n / 2;
    }
    for (int i = first; i < n; i++) {
        const peer_tensor *t = &m->t[i];
        size_t cnt = t->nbytes / 4;
        if (cnt > 4096) {
            peer_rpc_respond_error(req, EINVAL, "tensor too large for the test block");
            return;
        }
        const float *x = t->data;
        for (size_t k = 0; k < cnt; k++)
            out[i - first][k] = m->method == PEER_METHOD_FORWARD ? 2.0f * x[k] + 1.0f : 2.0f * x[k];
        peer_tensor_f32(&r.t[i - first], out[i - first], t->ndim, t->shape);
    }
    r.n_tensors = n - first;
    peer_rpc_respond(req, &r);
}

static void *worker_main(void *arg)
{
    (void)arg;
    pthread_mutex_lock(&W.mu);
    for (;;) {
        while (W.head == W.tail && !W.stop)
            pthread_cond_wait(&W.cv, &W.mu);
        if (W.head == W.tail && W.stop)
            break;
        peer_rpc_request *req = W.q[W.head % 1024];
        const peer_msg *m = W.qm[W.head % 1024];
        W.head++;
        pthread_mutex_unlock(&W.mu);
        compute(req, m); /* answered from this thread: the eventfd wake-up path */
        pthread_mutex_lock(&W.mu);
    }
    pthread_mutex_unlock(&W.mu);
    return NULL;
}

static void handler(peer_rpc_request *req, const peer_msg *m, void *arg)
{
    (void)arg;
    n_handled++;
    assert_memory_equal(peer_rpc_request_peer_id(req), id_c.id, DHT_ID_LEN);
    if (strcmp(m->block, "slow") == 0) {
        assert_true(n_parked < 64);
        parked[n_parked++] = req;
    } else if (strcmp(m->block, "async") == 0) {
        pthread_mutex_lock(&W.mu);
        W.q[W.tail % 1024] = req;
        W.qm[W.tail % 1024] = m; /* valid until answered */
        W.tail++;
        pthread_cond_signal(&W.cv);
        pthread_mutex_unlock(&W.mu);
    } else if (strcmp(m->block, "affine") == 0) {
        compute(req, m);
    } else if (strcmp(m->block, "echo") == 0) {
        /* Reply tensors point into the request's own buffer. */
        peer_msg r;
        peer_msg_init(&r, PEER_KIND_REPLY, m->method, 0);
        r.n_tensors = m->n_tensors;
        memcpy(r.t, m->t, sizeof(peer_tensor) * (size_t)m->n_tensors);
        peer_rpc_respond(req, &r);
    } else {
        peer_rpc_respond_error(req, ENOENT, "block not hosted");
    }
}

static void release_parked(void)
{
    for (int i = 0; i < n_parked; i++)
        peer_rpc_respond_error(parked[i], EIO, "released");
    n_parked = 0;
}

/* ---- fixtures ---- */

static uv_timer_t tick;
static void tick_cb(uv_timer_t *t) { (void)t; }

static int setup(void **state)
{
    (void)state;
    uint8_t seed[32];
    memset(seed, 0x51, 32);
    dht_identity_from_seed(&id_s, seed);
    memset(seed, 0xc1, 32);
    dht_identity_from_seed(&id_c, seed);
    memset(seed, 0x99, 32);
    dht_identity_from_seed(&id_x, seed);
    assert_int_equal(uv_loop_init(&loop), 0);
    /* A 5 ms tick bounds every wait below (uv_run ONCE always returns). */
    uv_timer_init(&loop, &tick);
    uv_timer_start(&tick, tick_cb, 5, 5);
    memset(&W, 0, sizeof W);
    pthread_mutex_init(&W.mu, NULL);
    pthread_cond_init(&W.cv, NULL);
    assert_int_equal(pthread_create(&W.th, NULL, worker_main, NULL), 0);
    return 0;
}

static void close_leftover(uv_handle_t *h, void *arg)
{
    if (!uv_is_closing(h)) {
        (*(int *)arg)++;
        uv_close(h, NULL);
    }
}

static int teardown(void **state)
{
    (void)state;
    pthread_mutex_lock(&W.mu);
    W.stop = 1;
    pthread_cond_signal(&W.cv);
    pthread_mutex_unlock(&W.mu);
    pthread_join(W.th, NULL);
    uv_close((uv_handle_t *)&tick, NULL);
    /* Bounded: a failed test may have left a server or client open, and
     * that must fail here rather than hang the run. */
    for (int i = 0; i < 200 && uv_loop_alive(&loop); i++)
        uv_run(&loop, UV_RUN_NOWAIT);
    int left = 0;
    uv_walk(&loop, close_leftover, &left);
    for (int i = 0; i < 200 && uv_loop_alive(&loop); i++)
        uv_run(&loop, UV_RUN_NOWAIT);
    int rc = uv_loop_close(&loop);
    if (left)
        fail_msg("%d libuv handles were left open", left);
    if (rc != 0)
        fail_msg("uv_loop_close: %s", uv_strerror(rc));
    return 0;
}

static uint64_t now_ms(void)
{
    return uv_hrtime() / 1000000u;
}

/* Runs the loop until *flag becomes true or ms pass; returns *flag. */
static int run_until(volatile int *flag, int ms)
{
    uint64_t end = now_ms() + (uint64_t)ms;
    while (!*flag && now_ms() < end)
        uv_run(&loop, UV_RUN_ONCE);
    return *flag;
}

static size_t server_max_held;
static uint64_t server_hs_timeout;

static peer_rpc_server *start_server(const uint8_t *swarm, size_t max_frame, int max_inflight,
                                     struct sockaddr_in *addr)
{
    peer_rpc_server_config cfg = {.self = &id_s, .swarm_key = swarm, .max_frame = max_frame,
                                  .max_inflight = max_inflight, .handler = handler,
                                  .max_held_bytes = server_max_held,
                                  .handshake_timeout_ms = server_hs_timeout};
    peer_rpc_server *srv = peer_rpc_server_create(&loop, &cfg);
    assert_non_null(srv);
    uv_ip4_addr("127.0.0.1", 0, addr);
    assert_int_equal(peer_rpc_server_listen(srv, (struct sockaddr *)addr), 0);
    int port = peer_rpc_server_port(srv);
    assert_true(port > 0);
    addr->sin_port = htons((uint16_t)port);
    return srv;
}

static int srv_closed;
static void srv_close_cb(peer_rpc_server *s, void *a) { (void)s; (void)a; srv_closed = 1; }

static void stop_server(peer_rpc_server **srv)
{
    srv_closed = 0;
    peer_rpc_server_stop(*srv, srv_close_cb, NULL);
    release_parked();
    assert_true(run_until(&srv_closed, 5000));
    peer_rpc_server_destroy(srv);
    assert_null(*srv);
}

typedef struct conn_state {
    int done, status;
} conn_state;

static void on_connect(peer_rpc_client *cl, int status, void *arg)
{
    (void)cl;
    conn_state *cs = arg;
    cs->done = 1;
    cs->status = status;
}

static int client_no_aes;

static peer_rpc_client *connect_client(const struct sockaddr_in *addr, const uint8_t *expect,
                                       const uint8_t *swarm, size_t max_frame, int *status)
{
    peer_rpc_client_config cfg = {.self = &id_c, .expect_id = expect, .swarm_key = swarm,
                                  .max_frame = max_frame, .no_aes = client_no_aes};
    peer_rpc_client *cl = peer_rpc_client_create(&loop, &cfg);
    assert_non_null(cl);
    static conn_state cs;
    cs.done = 0;
    assert_int_equal(peer_rpc_client_connect(cl, (const struct sockaddr *)addr, on_connect, &cs), 0);
    assert_true(run_until(&cs.done, 5000));
    *status = cs.status;
    return cl;
}

static int cl_closed;
static void cl_close_cb(peer_rpc_client *c, void *a) { (void)c; (void)a; cl_closed = 1; }

static void close_client(peer_rpc_client **cl)
{
    cl_closed = 0;
    peer_rpc_client_stop(*cl, cl_close_cb, NULL);
    assert_true(run_until(&cl_closed, 5000));
    peer_rpc_client_destroy(cl);
}

/* ---- one call, checked ---- */

typedef struct result {
    int done, status, kind, err_code, n_tensors;
    int ok;          /* outputs equal the expected bytes exactly */
    char msg[PEER_WIRE_MAX_ERRMSG + 1];
    size_t meta_len;
    const float *want[4];
    size_t want_n[4];
    uint64_t want_shape0;
} result;

static void on_reply(void *arg, int status, const peer_msg *m)
{
    result *r = arg;
    r->done = 1;
    r->status = status;
    if (status)
        return;
    r->kind = m->kind;
    r->err_code = m->err_code;
    r->n_tensors = m->n_tensors;
    r->meta_len = m->meta_len;
    snprintf(r->msg, sizeof r->msg, "%s", m->err_msg);
    r->ok = 1;
    for (int i = 0; i < m->n_tensors && i < 4; i++) {
        if (!r->want[i] || m->t[i].nbytes != r->want_n[i] * 4 ||
            memcmp(m->t[i].data, r->want[i], m->t[i].nbytes) != 0 ||
            (r->want_shape0 && m->t[i].shape[0] != r->want_shape0))
            r->ok = 0;
    }
}

static int call_sync(peer_rpc_client *cl, const peer_msg *req, uint64_t timeout, result *r)
{
    r->done = 0;
    int rc = peer_rpc_call(cl, req, timeout, on_reply, r, NULL);
    if (rc)
        return rc;
    assert_true(run_until(&r->done, 5000));
    return 0;
}

static void fill(float *x, size_t n, uint32_t seed)
{
    for (size_t i = 0; i < n; i++) {
        seed = seed * 1664525u + 1013904223u;
        x[i] = (float)(seed >> 8) / (float)(1u << 24) - 0.5f;
    }
}

static void test_roundtrip(void **state)
{
    (void)state;
    struct sockaddr_in addr;
    peer_rpc_server *srv = start_server(NULL, 0, 0, &addr);
    int st;
    peer_rpc_client *cl = connect_client(&addr, id_s.id, NULL, 0, &st);
    assert_int_equal(st, 0);
    assert_memory_equal(peer_rpc_client_peer_id(cl), id_s.id, DHT_ID_LEN);

    float x[32 * 8], g[32 * 8], y[32 * 8], gi[32 * 8];
    fill(x, 256, SEED);
    fill(g, 256, SEED + 1);
    for (int i = 0; i < 256; i++) {
        y[i] = 2.0f * x[i] + 1.0f;
        gi[i] = 2.0f * g[i];
    }
    uint64_t shape[2] = {32, 8};
    const char *blocks[2] = {"affine", "async"};
    for (int b = 0; b < 2; b++) {
        peer_msg req;
        result r = {0};
        peer_msg_init(&req, PEER_KIND_REQUEST, PEER_METHOD_FORWARD, 0);
        snprintf(req.block, sizeof req.block, "%s", blocks[b]);
        peer_tensor_f32(&req.t[0], x, 2, shape);
        req.n_tensors = 1;
        r.want[0] = y;
        r.want_n[0] = 256;
        r.want_shape0 = 32;
        assert_int_equal(call_sync(cl, &req, 2000, &r), 0);
        assert_int_equal(r.status, 0);
        assert_int_equal(r.kind, PEER_KIND_REPLY);
        assert_int_equal(r.n_tensors, 1);
        assert_true(r.ok);

        req.method = PEER_METHOD_BACKWARD;
        peer_tensor_f32(&req.t[1], g, 2, shape);
        req.n_tensors = 2;
        r.want[0] = gi;
        assert_int_equal(call_sync(cl, &req, 2000, &r), 0);
        assert_int_equal(r.kind, PEER_KIND_REPLY);
        assert_int_equal(r.n_tensors, 1);
        assert_true(r.ok);
    }
    peer_msg req;
    result r = {0};
    peer_msg_init(&req, PEER_KIND_REQUEST, PEER_METHOD_INFO, 0);
    snprintf(req.block, sizeof req.block, "affine");
    assert_int_equal(call_sync(cl, &req, 2000, &r), 0);
    assert_int_equal(r.kind, PEER_KIND_REPLY);
    assert_int_equal(r.meta_len, 6);
    snprintf(req.block, sizeof req.block, "nope");
    assert_int_equal(call_sync(cl, &req, 2000, &r), 0);
    assert_int_equal(r.kind, PEER_KIND_ERROR);
    assert_int_equal(r.err_code, ENOENT);
    assert_string_equal(r.msg, "block not hosted");
    req.method = (peer_method)42;
    snprintf(req.block, sizeof req.block, "affine");
    assert_int_equal(call_sync(cl, &req, 2000, &r), 0);
    assert_int_equal(r.err_code, ENOSYS);

    peer_rpc_server_stats s;
    peer_rpc_server_get_stats(srv, &s);
    assert_int_equal(s.requests, 7);
    assert_int_equal(s.bad_frames, 0);
    close_client(&cl);
    stop_server(&srv);
}

static void test_refusals(void **state)
{
    (void)state;
    uint8_t key[32], other[32];
    memset(key, 7, 32);
    memset(other, 8, 32);
    struct sockaddr_in addr;
    peer_rpc_server *srv = start_server(key, 0, 0, &addr);
    int st;
    /* Wrong expected node ID: the client refuses the server. */
    peer_rpc_client *cl = connect_client(&addr, id_x.id, key, 0, &st);
    assert_int_equal(st, -EPERM);
    peer_msg req;
    peer_msg_init(&req, PEER_KIND_REQUEST, PEER_METHOD_INFO, 0);
    result r = {0};
    assert_int_equal(peer_rpc_call(cl, &req, 100, on_reply, &r, NULL), -ENOTCONN);
    close_client(&cl);
    /* No swarm key, or another one: the server hangs up before serving. */
    cl = connect_client(&addr, id_s.id, NULL, 0, &st);
    assert_true(st < 0);
    close_client(&cl);
    cl = connect_client(&addr, id_s.id, other, 0, &st);
    assert_true(st < 0);
    close_client(&cl);
    peer_rpc_server_stats s;
    peer_rpc_server_get_stats(srv, &s);
    assert_int_equal(s.requests, 0);
    assert_true(s.handshakes_failed >= 2);
    /* The right key works. */
    cl = connect_client(&addr, id_s.id, key, 0, &st);
    assert_int_equal(st, 0);
    snprintf(req.block, sizeof req.block, "affine");
    assert_int_equal(call_sync(cl, &req, 2000, &r), 0);
    assert_int_equal(r.kind, PEER_KIND_REPLY);
    close_client(&cl);
    stop_server(&srv);
}

/* ---- many concurrent requests from several clients ---- */

#define NCLI 4
#define PER_CLI 300

typedef struct flow {
    peer_rpc_client *cl;
    int sent, done, bad;
    uint32_t seed;
    float x[64][96];     /* inputs by slot */
    int slot_used[64];
} flow;

static flow flows[NCLI];
static int flows_done;

static void flow_send(flow *f);

typedef struct slotarg {
    flow *f;
    int slot;
    size_t n;
} slotarg;
static slotarg slotargs[NCLI][64];

static void flow_reply(void *arg, int status, const peer_msg *m)
{
    slotarg *sa = arg;
    flow *f = sa->f;
    f->done++;
    if (status || m->kind != PEER_KIND_REPLY || m->n_tensors != 1 || m->t[0].nbytes != sa->n * 4) {
        f->bad++;
    } else {
        const float *y = m->t[0].data;
        for (size_t i = 0; i < sa->n; i++)
            if (y[i] != 2.0f * f->x[sa->slot][i] + 1.0f) {
                f->bad++;
                break;
            }
    }
    f->slot_used[sa->slot] = 0;
    if (f->done == PER_CLI)
        flows_done++;
    flow_send(f);
}

static void flow_send(flow *f)
{
    while (f->sent < PER_CLI) {
        int slot = -1;
        for (int s = 0; s < 64; s++)
            if (!f->slot_used[s]) {
                slot = s;
                break;
            }
        if (slot < 0)
            return;
        f->seed = f->seed * 1103515245u + 12345u;
        size_t rows = 1 + (f->seed >> 16) % 12, n = rows * 8;
        fill(f->x[slot], n, f->seed);
        peer_msg req;
        peer_msg_init(&req, PEER_KIND_REQUEST, PEER_METHOD_FORWARD, 0);
        snprintf(req.block, sizeof req.block, "%s", (f->sent & 1) ? "async" : "affine");
        uint64_t shape[2] = {rows, 8};
        peer_tensor_f32(&req.t[0], f->x[slot], 2, shape);
        req.n_tensors = 1;
        slotarg *sa = &slotargs[f - flows][slot];
        sa->f = f;
        sa->slot = slot;
        sa->n = n;
        int rc = peer_rpc_call(f->cl, &req, 5000, flow_reply, sa, NULL);
        if (rc == -EAGAIN)
            return;
        assert_int_equal(rc, 0);
        f->slot_used[slot] = 1;
        f->sent++;
    }
}

static void test_concurrent(void **state)
{
    (void)state;
    struct sockaddr_in addr;
    peer_rpc_server *srv = start_server(NULL, 0, 8, &addr); /* small bound: exercises pausing */
    int st;
    memset(flows, 0, sizeof flows);
    flows_done = 0;
    for (int i = 0; i < NCLI; i++) {
        flows[i].cl = connect_client(&addr, id_s.id, NULL, 0, &st);
        assert_int_equal(st, 0);
        flows[i].seed = SEED + (uint32_t)i;
    }
    for (int i = 0; i < NCLI; i++)
        flow_send(&flows[i]);
    volatile int all = 0;
    uint64_t end = now_ms() + 20000;
    while (flows_done < NCLI && now_ms() < end)
        uv_run(&loop, UV_RUN_ONCE);
    all = flows_done == NCLI;
    if (!all)
        fail_msg("seed %u: only %d of %d flows finished", SEED, flows_done, NCLI);
    for (int i = 0; i < NCLI; i++) {
        if (flows[i].bad)
            fail_msg("seed %u: client %d had %d bad replies", SEED, i, flows[i].bad);
        close_client(&flows[i].cl);
    }
    peer_rpc_server_stats s;
    peer_rpc_server_get_stats(srv, &s);
    assert_int_equal(s.requests, NCLI * PER_CLI);
    stop_server(&srv);
}

/* ---- timeouts, backpressure, connection errors ---- */

static void test_timeout_backpressure(void **state)
{
    (void)state;
    struct sockaddr_in addr;
    peer_rpc_server *srv = start_server(NULL, 0, 4, &addr);
    int st;
    peer_rpc_client *cl = connect_client(&addr, id_s.id, NULL, 0, &st);
    assert_int_equal(st, 0);
    peer_msg req;
    peer_msg_init(&req, PEER_KIND_REQUEST, PEER_METHOD_INFO, 0);
    snprintf(req.block, sizeof req.block, "slow");
    result r[10];
    memset(r, 0, sizeof r);
    n_handled = 0;
    for (int i = 0; i < 10; i++)
        assert_int_equal(peer_rpc_call(cl, &req, i < 2 ? 60 : 0, on_reply, &r[i], NULL), 0);
    assert_int_equal(peer_rpc_client_pending(cl), 10);
    /* The two with a 60 ms timeout fail with -ETIMEDOUT. */
    assert_true(run_until(&r[1].done, 3000));
    assert_int_equal(r[0].status, -ETIMEDOUT);
    assert_int_equal(r[1].status, -ETIMEDOUT);
    /* The server took only max_inflight = 4 requests off the socket. */
    volatile int never = 0;
    run_until(&never, 100);
    assert_int_equal(n_handled, 4);
    assert_int_equal(n_parked, 4);
    /* Answering them lets the next ones in (late answers to timed-out
     * requests are dropped by the client). */
    release_parked();
    volatile int enough = 0;
    uint64_t end = now_ms() + 3000;
    while (n_handled < 8 && now_ms() < end)
        uv_run(&loop, UV_RUN_ONCE);
    (void)enough;
    assert_int_equal(n_handled, 8);
    assert_int_equal(r[2].status, 0);
    assert_int_equal(r[2].kind, PEER_KIND_ERROR);
    assert_int_equal(r[2].err_code, EIO);
    /* Closing the server fails the client's pending requests. */
    srv_closed = 0;
    peer_rpc_server_stop(srv, srv_close_cb, NULL);
    assert_true(run_until(&r[9].done, 3000));
    assert_true(r[9].status < 0);
    assert_int_equal(peer_rpc_client_pending(cl), 0);
    release_parked();
    assert_true(run_until(&srv_closed, 3000));
    peer_rpc_server_destroy(&srv);
    close_client(&cl);
}

/* The server-wide byte budget holds back a client whose unanswered
 * requests hold too many bytes, though max_inflight would allow more. */
static void test_byte_budget(void **state)
{
    (void)state;
    struct sockaddr_in addr;
    server_max_held = 100000; /* two 40 KB requests fit, the third tips it */
    peer_rpc_server *srv = start_server(NULL, 0, 64, &addr);
    server_max_held = 0;
    int st;
    peer_rpc_client *cl = connect_client(&addr, id_s.id, NULL, 0, &st);
    assert_int_equal(st, 0);
    static float x[10000];
    uint64_t shape[1] = {10000};
    peer_msg req;
    peer_msg_init(&req, PEER_KIND_REQUEST, PEER_METHOD_FORWARD, 0);
    snprintf(req.block, sizeof req.block, "slow");
    peer_tensor_f32(&req.t[0], x, 1, shape);
    req.n_tensors = 1;
    result r[8];
    memset(r, 0, sizeof r);
    n_handled = 0;
    for (int i = 0; i < 8; i++)
        assert_int_equal(peer_rpc_call(cl, &req, 0, on_reply, &r[i], NULL), 0);
    volatile int never = 0;
    run_until(&never, 150);
    assert_int_equal(n_handled, 3);
    release_parked();
    uint64_t end = now_ms() + 3000;
    while (n_handled < 6 && now_ms() < end)
        uv_run(&loop, UV_RUN_ONCE);
    run_until(&never, 50);
    assert_int_equal(n_handled, 6);
    release_parked();
    end = now_ms() + 3000;
    while (!r[7].done && now_ms() < end) {
        uv_run(&loop, UV_RUN_ONCE);
        release_parked();
    }
    for (int i = 0; i < 8; i++)
        assert_int_equal(r[i].status, 0);
    close_client(&cl);
    stop_server(&srv);
}

/* Oversize frame: the server says EMSGSIZE and hangs up on that client only. */
static void test_oversize(void **state)
{
    (void)state;
    struct sockaddr_in addr;
    peer_rpc_server *srv = start_server(NULL, 1 << 20, 0, &addr);
    int st;
    peer_rpc_client *big = connect_client(&addr, id_s.id, NULL, 8 << 20, &st);
    assert_int_equal(st, 0);
    peer_rpc_client *good = connect_client(&addr, id_s.id, NULL, 0, &st);
    assert_int_equal(st, 0);
    size_t n = 512 * 1024; /* 2 MiB of floats */
    float *x = calloc(n, sizeof *x);
    peer_msg req;
    peer_msg_init(&req, PEER_KIND_REQUEST, PEER_METHOD_FORWARD, 0);
    snprintf(req.block, sizeof req.block, "affine");
    uint64_t shape[1] = {n};
    peer_tensor_f32(&req.t[0], x, 1, shape);
    req.n_tensors = 1;
    result r = {0};
    assert_int_equal(call_sync(big, &req, 3000, &r), 0);
    assert_int_equal(r.status, -EMSGSIZE);
    free(x);
    peer_rpc_server_stats s;
    peer_rpc_server_get_stats(srv, &s);
    assert_int_equal(s.oversize_frames, 1);
    /* The other client is unaffected. */
    float y[8] = {1, 2, 3, 4, 5, 6, 7, 8}, w[8];
    for (int i = 0; i < 8; i++)
        w[i] = 2.0f * y[i] + 1.0f;
    shape[0] = 8;
    peer_tensor_f32(&req.t[0], y, 1, shape);
    result r2 = {.want = {w}, .want_n = {8}};
    assert_int_equal(call_sync(good, &req, 3000, &r2), 0);
    assert_int_equal(r2.status, 0);
    assert_true(r2.ok);
    close_client(&big);
    close_client(&good);
    stop_server(&srv);
}

/* Large tensors take the streaming paths (sealing in pieces written while
 * the rest is encrypted, decrypting while the record arrives): several
 * multi-MiB echoes in flight at once must come back byte for byte, with
 * AES-GCM (if the CPU has it) and with ChaCha20-Poly1305. */
static void test_large_echo(void **state)
{
    (void)state;
    struct sockaddr_in addr;
    peer_rpc_server *srv = start_server(NULL, 0, 0, &addr);
    size_t n0 = 786433, n1 = 300001; /* 3 MiB + 4 bytes, and an odd size */
    float *a = malloc(n0 * 4), *b = malloc(n1 * 4);
    assert_non_null(a);
    assert_non_null(b);
    fill(a, n0, SEED + 5);
    fill(b, n1, SEED + 6);
    for (int mode = 0; mode < 2; mode++) {
        client_no_aes = mode;
        int st;
        peer_rpc_client *cl = connect_client(&addr, id_s.id, NULL, 0, &st);
        assert_int_equal(st, 0);
        assert_int_equal(peer_rpc_client_cipher(cl),
                         mode ? PEER_CIPHER_CHACHA20POLY1305 : peer_rpc_client_cipher(cl));
        peer_msg req;
        peer_msg_init(&req, PEER_KIND_REQUEST, PEER_METHOD_FORWARD, 0);
        snprintf(req.block, sizeof req.block, "echo");
        uint64_t s0[2] = {1, n0}, s1[1] = {n1};
        peer_tensor_f32(&req.t[0], a, 2, s0);
        peer_tensor_f32(&req.t[1], b, 1, s1);
        req.n_tensors = 2;
        result r[4];
        memset(r, 0, sizeof r);
        for (int i = 0; i < 4; i++) {
            r[i].want[0] = a;
            r[i].want_n[0] = n0;
            r[i].want[1] = b;
            r[i].want_n[1] = n1;
            assert_int_equal(peer_rpc_call(cl, &req, 10000, on_reply, &r[i], NULL), 0);
        }
        for (int i = 0; i < 4; i++) {
            assert_true(run_until(&r[i].done, 10000));
            if (r[i].status != 0 || !r[i].ok || r[i].n_tensors != 2)
                fail_msg("mode %d call %d: status %d ok %d n %d", mode, i, r[i].status, r[i].ok,
                         r[i].n_tensors);
        }
        close_client(&cl);
    }
    client_no_aes = 0;
    free(a);
    free(b);
    stop_server(&srv);
}

/* A connection that never completes the handshake is closed after the
 * handshake timeout; connecting where nobody listens fails cleanly. */
static void test_silent_and_refused(void **state)
{
    (void)state;
    struct sockaddr_in addr;
    server_hs_timeout = 100;
    peer_rpc_server *srv = start_server(NULL, 0, 0, &addr);
    server_hs_timeout = 0;
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(fd >= 0);
    assert_int_equal(connect(fd, (struct sockaddr *)&addr, sizeof addr), 0);
    volatile int never = 0;
    run_until(&never, 600); /* timeout 100 ms, swept every 250 ms */
    uint8_t b;
    ssize_t n = recv(fd, &b, 1, MSG_DONTWAIT);
    if (n != 0)
        fail_msg("silent connection still open after 600 ms (recv %zd, errno %d)", n, errno);
    close(fd);
    peer_rpc_server_stats s;
    peer_rpc_server_get_stats(srv, &s);
    assert_int_equal(s.handshakes_failed, 1);
    assert_int_equal(s.conns_open, 0);
    stop_server(&srv);

    /* Nobody listens on the port the server just released. */
    int st;
    peer_rpc_client *cl = connect_client(&addr, id_s.id, NULL, 0, &st);
    assert_int_equal(st, -ECONNREFUSED);
    close_client(&cl);
}

/* ---- a hostile client on a raw socket, in a thread ---- */

typedef struct hostile {
    int port;
    atomic_int done;
    int garbage_reply_code, oversize_reply_code, eof_after_oversize, prehs_closed;
    int dribble_ok;
    char err[128];
} hostile;

static int read_full(int fd, uint8_t *p, size_t n)
{
    while (n) {
        ssize_t k = recv(fd, p, n, 0);
        if (k <= 0)
            return -1;
        p += k;
        n -= (size_t)k;
    }
    return 0;
}

static int dial(int port)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_port = htons((uint16_t)port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    struct timeval tv = {5, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
        close(fd);
        return -1;
    }
    return fd;
}

/* Reads one record, opens it and returns the error code it carries (or -1). */
static int read_error_reply(int fd, peer_channel *ch)
{
    uint8_t hdr[4];
    size_t rl;
    if (read_full(fd, hdr, 4) || peer_channel_record_len(ch, hdr, &rl))
        return -1;
    uint8_t *rec = aligned_alloc(16, (rl + 15) & ~(size_t)15);
    memcpy(rec, hdr, 4);
    int code = -1;
    uint8_t *plain;
    size_t pl;
    peer_msg m;
    if (read_full(fd, rec + 4, rl - 4) == 0 && peer_channel_open(ch, rec, rl, &plain, &pl) == 0 &&
        peer_wire_decode(plain, pl, NULL, &m) == 0 && m.kind == PEER_KIND_ERROR)
        code = m.err_code;
    free(rec);
    return code;
}

/* Sends n bytes in pieces of 1..7 bytes with TCP_NODELAY, so the server's
 * reassembly sees every possible split of headers and records. */
static int send_dribble(int fd, const uint8_t *p, size_t n, uint32_t *seed)
{
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    while (n) {
        *seed = *seed * 1664525u + 1013904223u;
        size_t k = 1 + (*seed >> 24) % 7;
        if (k > n)
            k = n;
        if (send(fd, p, k, MSG_NOSIGNAL) != (ssize_t)k)
            return -1;
        p += k;
        n -= k;
        if ((*seed & 0x300) == 0)
            usleep(200); /* let some pieces arrive in separate reads */
    }
    return 0;
}

/* A whole conversation dribbled a few bytes at a time: handshake, then two
 * forward requests; the replies must be exact. */
static int dribble_client(int port, uint32_t seed)
{
    int fd = dial(port);
    if (fd < 0)
        return -1;
    peer_channel_config cc = {.self = &id_c, .expect_id = id_s.id};
    peer_channel *ch = peer_channel_create(&cc, 1);
    uint8_t m[PEER_CHANNEL_HS_MAX], r[PEER_CHANNEL_HS_MAX];
    size_t n;
    int ok = 0;
    int len = peer_channel_hello(ch, m);
    if (send_dribble(fd, m, (size_t)len, &seed) || read_full(fd, r, PEER_CHANNEL_HS2_LEN) ||
        peer_channel_hs_input(ch, r, m, &n) != 1 || send_dribble(fd, m, n, &seed))
        goto out;
    float x[5] = {0.5f, -1, 2, 1e3f, -7};
    uint64_t shape[1] = {5};
    peer_msg req;
    peer_msg_init(&req, PEER_KIND_REQUEST, PEER_METHOD_FORWARD, 0);
    snprintf(req.block, sizeof req.block, "affine");
    peer_tensor_f32(&req.t[0], x, 1, shape);
    req.n_tensors = 1;
    /* Two records back to back in one dribbled stream. */
    uint8_t out[2][256];
    size_t total = 0;
    uint8_t both[512];
    for (int i = 0; i < 2; i++) {
        req.id = 10 + (uint64_t)i;
        long pl = peer_wire_encode(&req, out[i] + 4, sizeof out[i] - 4 - 16);
        long rl = pl < 0 ? pl : peer_channel_seal(ch, out[i], (size_t)pl);
        if (rl < 0)
            goto out;
        memcpy(both + total, out[i], (size_t)rl);
        total += (size_t)rl;
    }
    if (send_dribble(fd, both, total, &seed))
        goto out;
    for (int i = 0; i < 2; i++) {
        uint8_t hdr[4], rec[512], *plain;
        size_t rl, pl;
        peer_msg rep;
        if (read_full(fd, hdr, 4) || peer_channel_record_len(ch, hdr, &rl) || rl > sizeof rec)
            goto out;
        memcpy(rec, hdr, 4);
        if (read_full(fd, rec + 4, rl - 4) || peer_channel_open(ch, rec, rl, &plain, &pl) ||
            peer_wire_decode(plain, pl, NULL, &rep) || rep.kind != PEER_KIND_REPLY ||
            rep.id != 10 + (uint64_t)i || rep.n_tensors != 1 || rep.t[0].nbytes != sizeof x)
            goto out;
        const float *y = rep.t[0].data;
        for (int k = 0; k < 5; k++)
            if (y[k] != 2.0f * x[k] + 1.0f)
                goto out;
    }
    ok = 1;
out:
    peer_channel_destroy(&ch);
    close(fd);
    return ok;
}

static void *hostile_main(void *arg)
{
    hostile *h = arg;
    uint8_t junk[4096];
    uint32_t s = SEED;
    for (size_t i = 0; i < sizeof junk; i++) {
        s = s * 1664525u + 1013904223u;
        junk[i] = (uint8_t)(s >> 24);
    }
    /* 1. Garbage instead of a handshake: the server closes on us. */
    int fd = dial(h->port);
    if (fd >= 0) {
        if (send(fd, junk, sizeof junk, MSG_NOSIGNAL) < 0) { /* may fail if already closed */ }
        uint8_t b;
        h->prehs_closed = recv(fd, &b, 1, 0) <= 0;
        close(fd);
    }
    /* 2. A valid conversation, a few bytes per send. */
    h->dribble_ok = dribble_client(h->port, SEED + 9) && dribble_client(h->port, SEED + 10);
    /* 3. A proper handshake, then a sealed record of garbage, then an
     * oversize record header. */
    fd = dial(h->port);
    if (fd < 0)
        goto out;
    peer_channel_config cc = {.self = &id_c, .expect_id = id_s.id};
    peer_channel *ch = peer_channel_create(&cc, 1);
    uint8_t m[PEER_CHANNEL_HS_MAX], r[PEER_CHANNEL_HS_MAX];
    size_t n;
    int len = peer_channel_hello(ch, m);
    if (send(fd, m, (size_t)len, MSG_NOSIGNAL) != len ||
        read_full(fd, r, PEER_CHANNEL_HS2_LEN) || peer_channel_hs_input(ch, r, m, &n) != 1 ||
        send(fd, m, n, MSG_NOSIGNAL) != (ssize_t)n) {
        snprintf(h->err, sizeof h->err, "raw handshake failed");
        goto out2;
    }
    uint8_t rec[4 + 300 + 16];
    memcpy(rec + 4, junk, 300);
    long rl = peer_channel_seal(ch, rec, 300);
    if (send(fd, rec, (size_t)rl, MSG_NOSIGNAL) != rl)
        goto out2;
    h->garbage_reply_code = read_error_reply(fd, ch);
    uint8_t big[4] = {0xff, 0xff, 0xff, 0x7f};
    if (send(fd, big, 4, MSG_NOSIGNAL) != 4)
        goto out2;
    h->oversize_reply_code = read_error_reply(fd, ch);
    uint8_t b;
    h->eof_after_oversize = recv(fd, &b, 1, 0) == 0;
out2:
    peer_channel_destroy(&ch);
    close(fd);
out:
    atomic_store(&h->done, 1);
    return NULL;
}

static void test_hostile_client(void **state)
{
    (void)state;
    struct sockaddr_in addr;
    peer_rpc_server *srv = start_server(NULL, 0, 0, &addr);
    int st;
    peer_rpc_client *good = connect_client(&addr, id_s.id, NULL, 0, &st);
    assert_int_equal(st, 0);
    hostile h = {.port = ntohs(addr.sin_port)};
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, hostile_main, &h), 0);
    /* Serve the hostile thread and the good client together. */
    float y[4] = {1, -2, 3, -4}, w[4] = {3, -3, 7, -7};
    uint64_t shape[1] = {4};
    peer_msg req;
    peer_msg_init(&req, PEER_KIND_REQUEST, PEER_METHOD_FORWARD, 0);
    snprintf(req.block, sizeof req.block, "affine");
    peer_tensor_f32(&req.t[0], y, 1, shape);
    req.n_tensors = 1;
    int good_ok = 0, rounds = 0;
    uint64_t end = now_ms() + 10000;
    while ((!atomic_load(&h.done) || rounds < 20) && now_ms() < end) {
        result r = {.want = {w}, .want_n = {4}};
        assert_int_equal(call_sync(good, &req, 3000, &r), 0);
        good_ok += r.status == 0 && r.ok;
        rounds++;
    }
    pthread_join(th, NULL);
    assert_string_equal(h.err, "");
    assert_int_equal(good_ok, rounds);
    assert_true(h.prehs_closed);
    if (!h.dribble_ok)
        fail_msg("seed %u: a conversation sent a few bytes at a time failed", SEED);
    assert_int_equal(h.garbage_reply_code, EBADMSG);
    assert_int_equal(h.oversize_reply_code, EMSGSIZE);
    assert_true(h.eof_after_oversize);
    peer_rpc_server_stats s;
    peer_rpc_server_get_stats(srv, &s);
    assert_true(s.handshakes_failed >= 1);
    assert_int_equal(s.bad_frames, 1);
    assert_int_equal(s.oversize_frames, 1);
    close_client(&good);
    stop_server(&srv);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_roundtrip),
        cmocka_unit_test(test_refusals),
        cmocka_unit_test(test_concurrent),
        cmocka_unit_test(test_timeout_backpressure),
        cmocka_unit_test(test_byte_budget),
        cmocka_unit_test(test_oversize),
        cmocka_unit_test(test_large_echo),
        cmocka_unit_test(test_hostile_client),
        cmocka_unit_test(test_silent_and_refused),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
