/* Hostile clients against the tensor RPC server and the metrics endpoint
 * (net/rpc_server.h "Hostile clients", peer/metrics.h, docs/rpc.md
 * "Limits"). One test per attack; each passes only if the server bounds
 * what the attacker holds and still serves a legitimate client.
 *
 * The server runs on this thread's loop; attackers are plain blocking
 * sockets on a second thread (written against docs/rpc.md with the channel
 * code for the crypto), so the loop keeps turning while they work. The
 * legitimate clients connect from 127.0.0.2, the attackers from 127.0.0.1:
 * the limits count per address. Every wait is for an event, bounded.
 *
 * usage: test_peer_rpc_limits [test name]   (no name: all)
 */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <sys/resource.h>
#include <sys/socket.h>

#include <uv.h>

#include "peer/metrics.h"
#include "peer/peer.h"
#include "test_util.h"

static dht_identity id_s, id_c;
static uv_loop_t loop;
static uv_timer_t tick;

#define BIG_FLOATS (128 * 1024) /* "big" replies: 512 KiB, still being written when reset */
static float big_out[BIG_FLOATS];

/* "info": empty reply; "big": a 512 KiB tensor; anything else: ENOENT. */
static void handler(peer_rpc_request *req, const peer_msg *m, void *arg)
{
    (void)arg;
    peer_msg r;
    peer_msg_init(&r, PEER_KIND_REPLY, m->method, 0);
    if (strcmp(m->block, "big") == 0) {
        uint64_t shape[2] = {1, BIG_FLOATS};
        peer_tensor_f32(&r.t[0], big_out, 2, shape);
        r.n_tensors = 1;
        peer_rpc_respond(req, &r);
    } else if (strcmp(m->block, "info") == 0) {
        r.meta = "ok";
        r.meta_len = 2;
        peer_rpc_respond(req, &r);
    } else {
        peer_rpc_respond_error(req, ENOENT, "block not hosted");
    }
}

static void tick_cb(uv_timer_t *t) { (void)t; }

static int setup(void **state)
{
    (void)state;
    uint8_t seed[32];
    memset(seed, 0x52, 32);
    dht_identity_from_seed(&id_s, seed);
    memset(seed, 0xc2, 32);
    dht_identity_from_seed(&id_c, seed);
    assert_int_equal(uv_loop_init(&loop), 0);
    /* A 5 ms tick bounds every wait below (uv_run ONCE always returns). */
    uv_timer_init(&loop, &tick);
    uv_timer_start(&tick, tick_cb, 5, 5);
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
    uv_close((uv_handle_t *)&tick, NULL);
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

/* Runs the loop until *flag is non-zero or ms pass; returns *flag. */
static int run_until(atomic_int *flag, int ms)
{
    uint64_t end = now_ms() + (uint64_t)ms;
    while (!atomic_load(flag) && now_ms() < end)
        uv_run(&loop, UV_RUN_ONCE);
    return atomic_load(flag);
}

static void run_for(int ms)
{
    uint64_t end = now_ms() + (uint64_t)ms;
    while (now_ms() < end)
        uv_run(&loop, UV_RUN_ONCE);
}

/* ---- server and legitimate client ---- */

static peer_rpc_server *start_server(peer_rpc_server_config *cfg, int *port)
{
    cfg->self = &id_s;
    cfg->handler = handler;
    peer_rpc_server *srv = peer_rpc_server_create(&loop, cfg);
    assert_non_null(srv);
    struct sockaddr_in a;
    uv_ip4_addr("127.0.0.1", 0, &a);
    assert_int_equal(peer_rpc_server_listen(srv, (struct sockaddr *)&a), 0);
    *port = peer_rpc_server_port(srv);
    assert_true(*port > 0);
    return srv;
}

static atomic_int srv_closed;
static void srv_close_cb(peer_rpc_server *s, void *a) { (void)s; (void)a; atomic_store(&srv_closed, 1); }

static void stop_server(peer_rpc_server **srv)
{
    atomic_store(&srv_closed, 0);
    peer_rpc_server_stop(*srv, srv_close_cb, NULL);
    assert_true(run_until(&srv_closed, 5000));
    peer_rpc_server_destroy(srv);
}

typedef struct outcome {
    atomic_int done;
    int status, kind;
    size_t meta_len;
} outcome;

static void on_connect(peer_rpc_client *cl, int status, void *arg)
{
    (void)cl;
    outcome *o = arg;
    o->status = status;
    atomic_store(&o->done, 1);
}

static void on_reply(void *arg, int status, const peer_msg *m)
{
    outcome *o = arg;
    o->status = status;
    if (status == 0) {
        o->kind = m->kind;
        o->meta_len = m->meta_len;
    }
    atomic_store(&o->done, 1);
}

static atomic_int cl_closed;
static void cl_close_cb(peer_rpc_client *c, void *a) { (void)c; (void)a; atomic_store(&cl_closed, 1); }

/* Request payload for legit_calls (a large request, up to ~1 MiB). */
#define LEGIT_MAX_FLOATS (256 * 1024)
static float legit_in[LEGIT_MAX_FLOATS];

/* A legitimate client from src: handshake, then n info calls on that one
 * connection, each carrying floats floats (0: none) and allowed call_ms.
 * Returns 0 when all succeed, else the first failure (and says which). */
static int legit_calls(int port, const char *src, int n, int floats, int call_ms)
{
    struct sockaddr_in local, to;
    uv_ip4_addr(src, 0, &local);
    uv_ip4_addr("127.0.0.1", port, &to);
    peer_rpc_client_config cc = {.self = &id_c, .expect_id = id_s.id,
                                 .local_addr = (const struct sockaddr *)&local};
    peer_rpc_client *cl = peer_rpc_client_create(&loop, &cc);
    assert_non_null(cl);
    outcome o = {0};
    int rc = peer_rpc_client_connect(cl, (const struct sockaddr *)&to, on_connect, &o);
    if (rc == 0) {
        assert_true(run_until(&o.done, 10000));
        rc = o.status;
        if (rc)
            fprintf(stderr, "legitimate handshake failed: %s\n", strerror(-rc));
    }
    for (int i = 0; rc == 0 && i < n; i++) {
        peer_msg req;
        peer_msg_init(&req, PEER_KIND_REQUEST, PEER_METHOD_INFO, 0);
        snprintf(req.block, sizeof req.block, "info");
        if (floats) {
            uint64_t shape[2] = {1, (uint64_t)floats};
            peer_tensor_f32(&req.t[0], legit_in, 2, shape);
            req.n_tensors = 1;
        }
        atomic_store(&o.done, 0);
        rc = peer_rpc_call(cl, &req, (uint64_t)call_ms, on_reply, &o, NULL);
        if (rc == 0) {
            assert_true(run_until(&o.done, call_ms + 5000));
            rc = o.status ? o.status : o.kind == PEER_KIND_REPLY && o.meta_len == 2 ? 0 : -EPROTO;
        }
        if (rc)
            fprintf(stderr, "legitimate call %d failed: %s\n", i, strerror(-rc));
    }
    atomic_store(&cl_closed, 0);
    peer_rpc_client_stop(cl, cl_close_cb, NULL);
    assert_true(run_until(&cl_closed, 5000));
    peer_rpc_client_destroy(&cl);
    return rc;
}

/* A legitimate client from 127.0.0.2: handshake, one info call. */
static int legit_call(int port)
{
    return legit_calls(port, "127.0.0.2", 1, 0, 5000);
}

/* ---- raw attacker sockets (blocking, on the attacker thread) ---- */

static int dial_from(const char *src, int port, int rcvbuf)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0)
        return -1;
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    inet_pton(AF_INET, src, &a.sin_addr);
    struct timeval tv = {5, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    if (rcvbuf)
        setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &rcvbuf, sizeof rcvbuf);
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    if (bind(fd, (struct sockaddr *)&a, sizeof a) != 0) {
        close(fd);
        return -1;
    }
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons((uint16_t)port);
    if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
        close(fd);
        return -1;
    }
    return fd;
}

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

static int send_all(int fd, const void *p, size_t n)
{
    return send(fd, p, n, MSG_NOSIGNAL) == (ssize_t)n ? 0 : -1;
}

/* Closes fd with a reset (SO_LINGER 0) instead of a FIN. */
static void reset_close(int fd)
{
    struct linger l = {1, 0};
    setsockopt(fd, SOL_SOCKET, SO_LINGER, &l, sizeof l);
    close(fd);
}

/* Waits until the server closes fd (EOF or reset); 1 if it did within the
 * socket's receive timeout. */
static int closed_by_server(int fd)
{
    uint8_t b[4096];
    for (;;) {
        ssize_t k = recv(fd, b, sizeof b, 0);
        if (k == 0 || (k < 0 && errno == ECONNRESET))
            return 1;
        if (k < 0)
            return 0;
    }
}

/* Runs the handshake on fd as initiator. Returns 0, or -1 when the server
 * refused (closed) or anything failed. */
static int raw_handshake(int fd, peer_channel *ch)
{
    uint8_t m[PEER_CHANNEL_HS_MAX], r[PEER_CHANNEL_HS_MAX];
    size_t n;
    int len = peer_channel_hello(ch, m);
    if (len <= 0 || send_all(fd, m, (size_t)len) || read_full(fd, r, PEER_CHANNEL_HS2_LEN) ||
        peer_channel_hs_input(ch, r, m, &n) != 1 || send_all(fd, m, n))
        return -1;
    return 0;
}

static peer_channel *new_channel(void)
{
    peer_channel_config cc = {.self = &id_c, .expect_id = id_s.id};
    peer_channel *ch = peer_channel_create(&cc, 1);
    assert_non_null(ch);
    return ch;
}

/* Seals a request for block into rec (cap bytes); returns its length. */
static long seal_request(peer_channel *ch, const char *block, uint64_t id, uint8_t *rec, size_t cap)
{
    peer_msg req;
    peer_msg_init(&req, PEER_KIND_REQUEST, PEER_METHOD_INFO, id);
    snprintf(req.block, sizeof req.block, "%s", block);
    long pl = peer_wire_encode(&req, rec + 4, cap - 4 - PEER_CHANNEL_TAG_LEN);
    return pl < 0 ? pl : peer_channel_seal(ch, rec, (size_t)pl);
}

typedef struct attack {
    int port;
    int n;                 /* connections to try */
    int *fds;
    atomic_int ready;      /* the attack is in place */
    atomic_int release;    /* the main thread is done: close everything */
    atomic_int done;
    int established, refused;
    const char **srcs;     /* addresses to dial from, round robin (NULL: 127.0.0.1) */
    int n_srcs;
    char err[160];
} attack;

static void attack_close_all(attack *a)
{
    for (int i = 0; i < a->n; i++)
        if (a->fds[i] >= 0)
            close(a->fds[i]);
}

static void wait_release(attack *a)
{
    /* Bounded: the main thread releases within its own bounded waits. */
    for (int i = 0; i < 60000 && !atomic_load(&a->release); i++)
        usleep(1000);
}

/* Raises the soft limit on open files as far as the hard limit allows and
 * returns how many connections a test may open (need, or fewer). */
static int fd_budget(int need)
{
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0)
        return need;
    if (rl.rlim_cur < rl.rlim_max) {
        rl.rlim_cur = rl.rlim_max;
        setrlimit(RLIMIT_NOFILE, &rl);
        getrlimit(RLIMIT_NOFILE, &rl);
    }
    /* The server's side of each kept connection and the loop's own fds. */
    long room = rl.rlim_cur == RLIM_INFINITY ? need + 400 : (long)rl.rlim_cur - 300;
    return room < need ? (int)room : need;
}

/* ---- (a) close or reset at every point ---- */

typedef struct reset_run {
    int port, metrics_port;
    atomic_int done;
    int rounds;
    char err[160];
} reset_run;

/* The places a client can give up. */
enum {
    AT_CONNECT, AT_HALF_MSG1, AT_MSG1, AT_MSG2, AT_HALF_MSG3, AT_MSG3, AT_HEADER,
    AT_HALF_RECORD, AT_REQUEST, AT_PIPELINED, AT_HALF_REPLY, AT_COUNT
};

static void *reset_main(void *arg)
{
    reset_run *rr = arg;
    uint8_t rec[512];
    for (int at = 0; at < AT_COUNT; at++) {
        for (int mode = 0; mode < 2; mode++) { /* 0: close (FIN), 1: reset */
            /* A small receive buffer, so big replies are still being
             * written when the connection goes away. */
            int fd = dial_from("127.0.0.1", rr->port, 4096);
            if (fd < 0) {
                snprintf(rr->err, sizeof rr->err, "dial failed at point %d", at);
                goto out;
            }
            peer_channel *ch = new_channel();
            uint8_t m[PEER_CHANNEL_HS_MAX], r[PEER_CHANNEL_HS_MAX];
            size_t n;
            int len = peer_channel_hello(ch, m);
            if (at == AT_HALF_MSG1) {
                send_all(fd, m, (size_t)len / 2);
            } else if (at > AT_HALF_MSG1) {
                send_all(fd, m, (size_t)len);
                if (at >= AT_MSG2) {
                    if (read_full(fd, r, PEER_CHANNEL_HS2_LEN) || peer_channel_hs_input(ch, r, m, &n) != 1) {
                        snprintf(rr->err, sizeof rr->err, "handshake failed at point %d", at);
                        peer_channel_destroy(&ch);
                        close(fd);
                        goto out;
                    }
                    if (at == AT_HALF_MSG3)
                        send_all(fd, m, n / 2);
                    else if (at > AT_HALF_MSG3)
                        send_all(fd, m, n);
                }
            }
            if (at >= AT_HEADER) {
                long rl = seal_request(ch, at >= AT_REQUEST ? "big" : "info", 1, rec, sizeof rec);
                size_t part = at == AT_HEADER ? 4 : at == AT_HALF_RECORD ? (size_t)rl / 2 : (size_t)rl;
                send_all(fd, rec, part);
                for (int k = 2; at >= AT_PIPELINED && k <= 20; k++) {
                    rl = seal_request(ch, "big", (uint64_t)k, rec, sizeof rec);
                    send_all(fd, rec, (size_t)rl);
                }
                if (at == AT_HALF_REPLY) {
                    uint8_t some[1000];
                    read_full(fd, some, sizeof some);
                }
            }
            if (mode)
                reset_close(fd);
            else
                close(fd);
            peer_channel_destroy(&ch);
            rr->rounds++;
        }
    }
    /* The metrics endpoint: a scrape abandoned before, during and after
     * the request. */
    for (int at = 0; at < 3; at++) {
        int fd = dial_from("127.0.0.1", rr->metrics_port, 4096);
        if (fd < 0) {
            snprintf(rr->err, sizeof rr->err, "metrics dial failed");
            goto out;
        }
        const char *get = "GET /metrics HTTP/1.0\r\n\r\n";
        if (at)
            send_all(fd, get, at == 1 ? 6 : strlen(get));
        if (at == 2) {
            uint8_t some[100];
            read_full(fd, some, sizeof some);
        }
        reset_close(fd);
        rr->rounds++;
    }
out:
    atomic_store(&rr->done, 1);
    return NULL;
}

static size_t render_big(char *buf, size_t cap, void *arg)
{
    (void)arg;
    memset(buf, '#', cap);
    return cap;
}

static void test_reset_anywhere(void **state)
{
    (void)state;
    /* SIGPIPE at its default kills: the server and the endpoint must not
     * depend on the process having ignored it. */
    signal(SIGPIPE, SIG_DFL);
    peer_rpc_server_config cfg = {0};
    int port;
    peer_rpc_server *srv = start_server(&cfg, &port);
    struct sigaction sa;
    assert_int_equal(sigaction(SIGPIPE, NULL, &sa), 0);
    assert_true(sa.sa_handler == SIG_IGN); /* the server set it, before any connection */
    struct sockaddr_in ma;
    uv_ip4_addr("127.0.0.1", 0, &ma);
    int err;
    peer_metrics *met = peer_metrics_start(&loop, (struct sockaddr *)&ma, render_big, NULL, &err);
    assert_non_null(met);
    reset_run rr = {.port = port, .metrics_port = peer_metrics_port(met)};
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, reset_main, &rr), 0);
    assert_true(run_until(&rr.done, 20000));
    pthread_join(th, NULL);
    assert_string_equal(rr.err, "");
    assert_int_equal(rr.rounds, 2 * AT_COUNT + 3);
    /* Let the server see every close and write into every reset socket. */
    run_for(200);
    assert_int_equal(legit_call(port), 0);
    peer_metrics_destroy(&met);
    stop_server(&srv);
}

/* ---- (b) 1,024 idle connections from one address ---- */

static void *flood_main(void *arg)
{
    attack *a = arg;
    for (int i = 0; i < a->n; i++) {
        a->fds[i] = dial_from("127.0.0.1", a->port, 0);
        if (a->fds[i] < 0) {
            snprintf(a->err, sizeof a->err, "dial %d failed: %s", i, strerror(errno));
            break;
        }
        peer_channel *ch = new_channel();
        if (raw_handshake(a->fds[i], ch) == 0) {
            a->established++;
        } else {
            a->refused++;
            close(a->fds[i]);
            a->fds[i] = -1;
        }
        peer_channel_destroy(&ch);
    }
    atomic_store(&a->ready, 1);
    wait_release(a);
    attack_close_all(a);
    atomic_store(&a->done, 1);
    return NULL;
}

static void test_idle_flood(void **state)
{
    (void)state;
    peer_rpc_server_config cfg = {0}; /* defaults: 64 per address, 1,024 in all */
    int port;
    peer_rpc_server *srv = start_server(&cfg, &port);
    attack a = {.port = port, .n = fd_budget(1024)};
    assert_true(a.n > 64);
    a.fds = malloc(sizeof(int) * (size_t)a.n);
    for (int i = 0; i < a.n; i++)
        a.fds[i] = -1;
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, flood_main, &a), 0);
    assert_true(run_until(&a.ready, 25000));
    assert_string_equal(a.err, "");
    /* The address got its 64 and no more; a newcomer still gets in. */
    assert_int_equal(a.established, 64);
    assert_int_equal(legit_call(port), 0);
    peer_rpc_server_stats s;
    peer_rpc_server_get_stats(srv, &s);
    assert_int_equal(s.refused_per_ip, (uint64_t)a.n - 64);
    atomic_store(&a.release, 1);
    assert_true(run_until(&a.done, 10000));
    pthread_join(th, NULL);
    free(a.fds);
    stop_server(&srv);
}

/* Silent connections (no handshake) fill the handshake slots of one
 * address; a newcomer from another takes one of them. */
static void *silent_main(void *arg)
{
    attack *a = arg;
    for (int i = 0; i < a->n; i++)
        a->fds[i] = dial_from("127.0.0.1", a->port, 0);
    atomic_store(&a->ready, 1);
    wait_release(a);
    attack_close_all(a);
    atomic_store(&a->done, 1);
    return NULL;
}

static void test_handshake_slots(void **state)
{
    (void)state;
    peer_rpc_server_config cfg = {.max_handshakes = 16, .max_conns_per_ip = 16};
    int port;
    peer_rpc_server *srv = start_server(&cfg, &port);
    attack a = {.port = port, .n = 16};
    int fds[16];
    a.fds = fds;
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, silent_main, &a), 0);
    assert_true(run_until(&a.ready, 10000));
    peer_rpc_server_stats s;
    for (int i = 0; i < 2000; i++) { /* until the server accepted all 16 */
        peer_rpc_server_get_stats(srv, &s);
        if (s.handshaking == 16)
            break;
        uv_run(&loop, UV_RUN_ONCE);
    }
    assert_int_equal(s.handshaking, 16);
    assert_int_equal(legit_call(port), 0);
    peer_rpc_server_get_stats(srv, &s);
    assert_int_equal(s.evicted, 1);
    assert_int_equal(s.refused_handshakes, 0);
    atomic_store(&a.release, 1);
    assert_true(run_until(&a.done, 10000));
    pthread_join(th, NULL);
    stop_server(&srv);
}

/* ---- idle and handshake timeouts ---- */

typedef struct idle_run {
    int port;
    atomic_int done;
    int idle_closed, hs_closed;
    char err[160];
} idle_run;

static void *idle_main(void *arg)
{
    idle_run *ir = arg;
    int fds[12];
    peer_channel *chs[12] = {0};
    for (int i = 0; i < 12; i++)
        fds[i] = -1;
    /* 0..5: established, then silent; 6..7: silent from the start; 8..9:
     * half a msg1; 10..11: msg1 but never msg3. */
    for (int i = 0; i < 12; i++) {
        fds[i] = dial_from("127.0.0.1", ir->port, 0);
        if (fds[i] < 0) {
            snprintf(ir->err, sizeof ir->err, "dial failed");
            goto out;
        }
        chs[i] = new_channel();
        uint8_t m[PEER_CHANNEL_HS_MAX], r[PEER_CHANNEL_HS_MAX];
        if (i < 6) {
            if (raw_handshake(fds[i], chs[i]) != 0)
                snprintf(ir->err, sizeof ir->err, "handshake %d failed", i);
            continue;
        }
        int len = peer_channel_hello(chs[i], m);
        if (i >= 8 && i < 10) {
            send_all(fds[i], m, (size_t)len / 2);
        } else if (i >= 10) {
            send_all(fds[i], m, (size_t)len);
            read_full(fds[i], r, PEER_CHANNEL_HS2_LEN);
        }
    }
    for (int i = 0; i < 12; i++) {
        int c = closed_by_server(fds[i]);
        if (i < 6)
            ir->idle_closed += c;
        else
            ir->hs_closed += c;
    }
out:
    for (int i = 0; i < 12; i++) {
        peer_channel_destroy(&chs[i]);
        if (fds[i] >= 0)
            close(fds[i]);
    }
    atomic_store(&ir->done, 1);
    return NULL;
}

static void test_timeouts(void **state)
{
    (void)state;
    /* Long enough that a loaded machine still finishes the good handshakes. */
    peer_rpc_server_config cfg = {.idle_timeout_ms = 500, .handshake_timeout_ms = 1000};
    int port;
    peer_rpc_server *srv = start_server(&cfg, &port);
    idle_run ir = {.port = port};
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, idle_main, &ir), 0);
    assert_true(run_until(&ir.done, 15000));
    pthread_join(th, NULL);
    assert_string_equal(ir.err, "");
    assert_int_equal(ir.idle_closed, 6);
    assert_int_equal(ir.hs_closed, 6);
    peer_rpc_server_stats s;
    peer_rpc_server_get_stats(srv, &s);
    assert_int_equal(s.closed_idle, 6);
    assert_int_equal(s.closed_hs_timeout, 6);
    /* A client that keeps asking is not idle. */
    assert_int_equal(legit_call(port), 0);
    stop_server(&srv);
}

/* ---- (c) almost-complete huge records ---- */

#define FRAME (1u << 20)
#define INCOMPLETE_CAP (4u << 20)

static void *records_main(void *arg)
{
    attack *a = arg;
    uint8_t *junk = calloc(1, FRAME + 64);
    for (int i = 0; i < a->n && junk; i++) {
        a->fds[i] = dial_from(a->srcs ? a->srcs[i % a->n_srcs] : "127.0.0.1", a->port, 0);
        peer_channel *ch = new_channel();
        if (a->fds[i] < 0 || raw_handshake(a->fds[i], ch) != 0) {
            snprintf(a->err, sizeof a->err, "handshake %d failed", i);
            peer_channel_destroy(&ch);
            break;
        }
        peer_channel_destroy(&ch);
        a->established++;
        /* A record of the largest size the server takes, all but its last
         * 100 bytes. The server stops reading connections that wait for
         * the budget, so send what the socket takes without blocking. */
        uint32_t L = FRAME + PEER_CHANNEL_TAG_LEN;
        uint8_t *p = junk;
        p[0] = (uint8_t)L;
        p[1] = (uint8_t)(L >> 8);
        p[2] = (uint8_t)(L >> 16);
        p[3] = (uint8_t)(L >> 24);
        size_t want = 4 + L - 100, off = 0;
        while (off < want) {
            ssize_t k = send(a->fds[i], p + off, want - off, MSG_NOSIGNAL | MSG_DONTWAIT);
            if (k <= 0)
                break;
            off += (size_t)k;
        }
    }
    free(junk);
    atomic_store(&a->ready, 1);
    wait_release(a);
    attack_close_all(a);
    atomic_store(&a->done, 1);
    return NULL;
}

static void test_incomplete_records(void **state)
{
    (void)state;
    /* All from one address: lift the per-address share to the total. */
    peer_rpc_server_config cfg = {.max_frame = FRAME, .max_incomplete_bytes = INCOMPLETE_CAP,
                                  .max_incomplete_per_ip = INCOMPLETE_CAP};
    int port;
    peer_rpc_server *srv = start_server(&cfg, &port);
    int fds[40];
    attack a = {.port = port, .n = 40, .fds = fds};
    for (int i = 0; i < 40; i++)
        fds[i] = -1;
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, records_main, &a), 0);
    assert_true(run_until(&a.ready, 20000));
    assert_string_equal(a.err, "");
    assert_int_equal(a.established, 40);
    /* Until every record began or waits: (charged records) * FRAME + (waits). */
    peer_rpc_server_stats s;
    for (int i = 0; i < 4000; i++) {
        peer_rpc_server_get_stats(srv, &s);
        if (s.record_waits >= 37 && s.incomplete_bytes >= 3 * (uint64_t)FRAME)
            break;
        uv_run(&loop, UV_RUN_ONCE);
    }
    print_message("incomplete: now %llu max %llu cap %u, waits %llu\n",
                  (unsigned long long)s.incomplete_bytes, (unsigned long long)s.incomplete_bytes_max,
                  INCOMPLETE_CAP, (unsigned long long)s.record_waits);
    assert_true(s.incomplete_bytes_max <= INCOMPLETE_CAP);
    assert_true(s.record_waits >= 37);
    /* Small requests still fit beside them. */
    assert_int_equal(legit_call(port), 0);
    atomic_store(&a.release, 1);
    assert_true(run_until(&a.done, 10000));
    pthread_join(th, NULL);
    /* Once the attackers are gone, nothing stays charged. */
    for (int i = 0; i < 2000; i++) {
        peer_rpc_server_get_stats(srv, &s);
        if (s.conns_open == 0)
            break;
        uv_run(&loop, UV_RUN_ONCE);
    }
    assert_int_equal(s.conns_open, 0);
    assert_int_equal(s.incomplete_bytes, 0);
    stop_server(&srv);
}


/* Several addresses hold half-sent records; an honest client from another
 * address sends a large request. With per_ip_share, three addresses hold
 * at most 3/4 of the budget and the request fits at once; with
 * deadline (four addresses, a budget that three records fill), it waits
 * until the record deadline closes the stalled records. */
static void incomplete_from_many(size_t cap, size_t per_ip, uint64_t record_ms, int n_srcs,
                                 int max_ms, uint64_t want_timeouts, uint64_t *timeouts)
{
    peer_rpc_server_config cfg = {.max_frame = FRAME, .max_incomplete_bytes = cap,
                                  .max_incomplete_per_ip = per_ip, .record_timeout_ms = record_ms,
                                  .idle_timeout_ms = 20000};
    int port;
    peer_rpc_server *srv = start_server(&cfg, &port);
    static const char *srcs[] = {"127.0.0.1", "127.0.0.4", "127.0.0.5", "127.0.0.6"};
    int fds[16];
    attack a = {.port = port, .n = 16, .fds = fds, .srcs = srcs, .n_srcs = n_srcs};
    for (int i = 0; i < 16; i++)
        fds[i] = -1;
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, records_main, &a), 0);
    assert_true(run_until(&a.ready, 20000));
    assert_string_equal(a.err, "");
    assert_int_equal(a.established, 16);
    /* Until three records are charged and the rest wait. */
    peer_rpc_server_stats s;
    for (int i = 0; i < 4000; i++) {
        peer_rpc_server_get_stats(srv, &s);
        if (s.record_waits >= 13 && s.incomplete_bytes >= 3 * (uint64_t)FRAME)
            break;
        uv_run(&loop, UV_RUN_ONCE);
    }
    assert_true(s.incomplete_bytes >= 3 * (uint64_t)FRAME);
    assert_true(s.record_waits >= 13);
    assert_int_equal(s.closed_record_timeout, 0);
    /* A request of ~800 KiB from an address of its own. */
    uint64_t t0 = now_ms();
    assert_int_equal(legit_calls(port, "127.0.0.2", 1, 200 * 1024, 10000), 0);
    uint64_t took = now_ms() - t0;
    peer_rpc_server_get_stats(srv, &s);
    print_message("large request took %llu ms; record timeouts %llu, waits %llu, max %llu\n",
                  (unsigned long long)took, (unsigned long long)s.closed_record_timeout,
                  (unsigned long long)s.record_waits, (unsigned long long)s.incomplete_bytes_max);
    assert_true(took < (uint64_t)max_ms);
    assert_true(s.incomplete_bytes_max <= cap);
    /* The honest record may get in after the first stalled one is closed
     * (their deadlines drift apart on a loaded machine); the others are
     * closed at their own deadlines: wait for that (bounded). */
    for (uint64_t end = now_ms() + 15000; s.closed_record_timeout < want_timeouts && now_ms() < end;) {
        uv_run(&loop, UV_RUN_ONCE);
        peer_rpc_server_get_stats(srv, &s);
    }
    *timeouts = s.closed_record_timeout;
    atomic_store(&a.release, 1);
    assert_true(run_until(&a.done, 10000));
    pthread_join(th, NULL);
    for (int i = 0; i < 2000; i++) {
        peer_rpc_server_get_stats(srv, &s);
        if (s.conns_open == 0)
            break;
        uv_run(&loop, UV_RUN_ONCE);
    }
    assert_int_equal(s.conns_open, 0);
    assert_int_equal(s.incomplete_bytes, 0);
    stop_server(&srv);
}

static void test_incomplete_per_ip(void **state)
{
    (void)state;
    uint64_t timeouts;
    /* The default share, a quarter: three addresses leave a quarter free. */
    incomplete_from_many(INCOMPLETE_CAP, 0, 20000, 3, 5000, 0, &timeouts);
    assert_int_equal(timeouts, 0);
}

static void test_record_deadline(void **state)
{
    (void)state;
    uint64_t timeouts;
    /* Three records fill the budget; the rest (a fourth address included)
     * wait. The stalled records are closed after 1 s (+250 ms for their
     * MiB), and the honest record goes as soon as one is. */
    incomplete_from_many(3 * (FRAME + PEER_CHANNEL_TAG_LEN) + 1024, FRAME, 1000, 4, 8000, 3, &timeouts);
    assert_true(timeouts >= 3);
}

/* ---- (d) a client that pipelines and never reads ---- */

#define QUEUE_CAP (1u << 20)

typedef struct noread_run {
    int port;
    atomic_int sent, release, done;
    int n_sent;
    int read_every_ms;     /* > 0: read 64 KiB this often (a trickle) */
    char err[160];
} noread_run;

static void *noread_main(void *arg)
{
    noread_run *nr = arg;
    int fd = dial_from("127.0.0.1", nr->port, 4096);
    peer_channel *ch = new_channel();
    if (fd < 0 || raw_handshake(fd, ch) != 0) {
        snprintf(nr->err, sizeof nr->err, "handshake failed");
        goto out;
    }
    /* 400 requests for 512 KiB each (200 MiB of answers), as many as the
     * socket takes. */
    uint8_t rec[512];
    for (int i = 0; i < 400; i++) {
        long rl = seal_request(ch, "big", (uint64_t)i + 1, rec, sizeof rec);
        if (send(fd, rec, (size_t)rl, MSG_NOSIGNAL | MSG_DONTWAIT) != rl)
            break;
        nr->n_sent++;
    }
    atomic_store(&nr->sent, 1);
    static uint8_t sink[65536];
    for (int i = 0; i < 60000 && !atomic_load(&nr->release); i++) {
        usleep(1000);
        if (nr->read_every_ms > 0 && i % nr->read_every_ms == nr->read_every_ms - 1)
            (void)recv(fd, sink, sizeof sink, MSG_DONTWAIT);
    }
out:
    peer_channel_destroy(&ch);
    if (fd >= 0)
        close(fd);
    atomic_store(&nr->done, 1);
    return NULL;
}

static void test_never_reads(void **state)
{
    (void)state;
    peer_rpc_server_config cfg = {.max_queued_bytes = QUEUE_CAP, .idle_timeout_ms = 1500};
    int port;
    peer_rpc_server *srv = start_server(&cfg, &port);
    noread_run nr = {.port = port};
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, noread_main, &nr), 0);
    assert_true(run_until(&nr.sent, 10000));
    assert_string_equal(nr.err, "");
    /* The replies stop draining: the server stops reading, and after the
     * idle timeout closes the connection. */
    peer_rpc_server_stats s;
    for (int i = 0; i < 20000; i++) {
        peer_rpc_server_get_stats(srv, &s);
        if (s.closed_idle)
            break;
        uv_run(&loop, UV_RUN_ONCE);
    }
    size_t reply = 4 + 16 + BIG_FLOATS * 4 + 64;
    print_message("sent %d, served %llu, queued max %llu (cap %u + one reply %zu)\n", nr.n_sent,
                  (unsigned long long)s.replies, (unsigned long long)s.queued_bytes_max, QUEUE_CAP,
                  reply);
    assert_int_equal(s.closed_idle, 1);
    assert_true(s.queued_bytes_max <= QUEUE_CAP + reply);
    assert_true(s.requests < (uint64_t)nr.n_sent);
    assert_int_equal(legit_call(port), 0);
    atomic_store(&nr.release, 1);
    assert_true(run_until(&nr.done, 10000));
    pthread_join(th, NULL);
    for (int i = 0; i < 2000; i++) {
        peer_rpc_server_get_stats(srv, &s);
        if (s.conns_open == 0)
            break;
        uv_run(&loop, UV_RUN_ONCE);
    }
    assert_int_equal(s.queued_bytes, 0);
    stop_server(&srv);
}

/* The never-reading client of test_never_reads, with the total queue bound
 * equal to the per-connection one: its replies fill the total, yet an
 * honest client from another address keeps being served on one connection
 * while the attacker holds its queue. */
static void test_never_reads_fair(void **state)
{
    (void)state;
    peer_rpc_server_config cfg = {.max_queued_bytes = QUEUE_CAP, .max_queued_total = QUEUE_CAP,
                                  .idle_timeout_ms = 20000, .drain_timeout_ms = 20000};
    int port;
    peer_rpc_server *srv = start_server(&cfg, &port);
    noread_run nr = {.port = port};
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, noread_main, &nr), 0);
    assert_true(run_until(&nr.sent, 10000));
    assert_string_equal(nr.err, "");
    peer_rpc_server_stats s;
    for (int i = 0; i < 4000; i++) {
        peer_rpc_server_get_stats(srv, &s);
        if (s.queued_bytes >= QUEUE_CAP)
            break;
        uv_run(&loop, UV_RUN_ONCE);
    }
    assert_true(s.queued_bytes >= QUEUE_CAP);
    assert_int_equal(legit_calls(port, "127.0.0.3", 8, 0, 3000), 0);
    peer_rpc_server_get_stats(srv, &s);
    assert_int_equal(s.closed_drain + s.closed_idle, 0); /* the attacker still holds its queue */
    assert_true(s.queued_bytes >= QUEUE_CAP);
    atomic_store(&nr.release, 1);
    assert_true(run_until(&nr.done, 10000));
    pthread_join(th, NULL);
    for (int i = 0; i < 2000; i++) {
        peer_rpc_server_get_stats(srv, &s);
        if (s.conns_open == 0)
            break;
        uv_run(&loop, UV_RUN_ONCE);
    }
    assert_int_equal(s.queued_bytes, 0);
    stop_server(&srv);
}

/* A client that reads a little now and then (so a reply finishes now and
 * then) but makes no write progress for drain_timeout_ms is closed, even
 * though it is never idle_timeout_ms quiet. */
static void test_slow_drain(void **state)
{
    (void)state;
    peer_rpc_server_config cfg = {.max_queued_bytes = QUEUE_CAP, .idle_timeout_ms = 20000,
                                  .drain_timeout_ms = 1000};
    int port;
    peer_rpc_server *srv = start_server(&cfg, &port);
    noread_run nr = {.port = port, .read_every_ms = 1500};
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, noread_main, &nr), 0);
    assert_true(run_until(&nr.sent, 10000));
    assert_string_equal(nr.err, "");
    peer_rpc_server_stats s;
    uint64_t t0 = now_ms();
    for (int i = 0; i < 2000; i++) {
        peer_rpc_server_get_stats(srv, &s);
        if (s.closed_drain)
            break;
        uv_run(&loop, UV_RUN_ONCE);
    }
    print_message("closed for not draining after %llu ms\n", (unsigned long long)(now_ms() - t0));
    assert_int_equal(s.closed_drain, 1);
    assert_int_equal(s.closed_idle, 0);
    assert_int_equal(legit_call(port), 0);
    atomic_store(&nr.release, 1);
    assert_true(run_until(&nr.done, 10000));
    pthread_join(th, NULL);
    for (int i = 0; i < 2000; i++) {
        peer_rpc_server_get_stats(srv, &s);
        if (s.conns_open == 0)
            break;
        uv_run(&loop, UV_RUN_ONCE);
    }
    assert_int_equal(s.queued_bytes, 0);
    stop_server(&srv);
}

/* At max_queued_total, the connection holding the most is closed once it
 * has made no write progress for a quarter of drain_timeout_ms (not the
 * whole of it). */
static void test_queue_total_evicts(void **state)
{
    (void)state;
    peer_rpc_server_config cfg = {.max_queued_bytes = QUEUE_CAP, .max_queued_total = QUEUE_CAP,
                                  .idle_timeout_ms = 20000, .drain_timeout_ms = 8000};
    int port;
    peer_rpc_server *srv = start_server(&cfg, &port);
    noread_run nr = {.port = port};
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, noread_main, &nr), 0);
    assert_true(run_until(&nr.sent, 10000));
    assert_string_equal(nr.err, "");
    peer_rpc_server_stats s;
    uint64_t t0 = now_ms();
    for (int i = 0; i < 2000; i++) {
        peer_rpc_server_get_stats(srv, &s);
        if (s.closed_drain)
            break;
        uv_run(&loop, UV_RUN_ONCE);
    }
    uint64_t took = now_ms() - t0;
    print_message("largest holder closed after %llu ms\n", (unsigned long long)took);
    assert_int_equal(s.closed_drain, 1);
    assert_true(took < 7000); /* before the whole drain_timeout_ms */
    atomic_store(&nr.release, 1);
    assert_true(run_until(&nr.done, 10000));
    pthread_join(th, NULL);
    stop_server(&srv);
}

/* ---- (e) the metrics endpoint under 1,100 idle connections ---- */

static size_t render_small(char *buf, size_t cap, void *arg)
{
    (void)arg;
    return (size_t)snprintf(buf, cap, "starling_up 1\n");
}

/* A non-blocking connect from src; the caller turns the loop so the
 * server accepts (one thread: the accept queue never overflows, which a
 * dialing thread racing a descheduled loop made it do, costing a SYN
 * retransmission of a second). */
static int dial_nb(const char *src, int port)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    if (fd < 0)
        return -1;
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    inet_pton(AF_INET, src, &a.sin_addr);
    if (bind(fd, (struct sockaddr *)&a, sizeof a) != 0) {
        close(fd);
        return -1;
    }
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons((uint16_t)port);
    if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0 && errno != EINPROGRESS) {
        close(fd);
        return -1;
    }
    return fd;
}

/* One scrape from src with the loop turning; returns the HTTP status (0:
 * none) and whether the body came. */
static int scrape(const char *src, int port, int *body_ok)
{
    int fd = dial_nb(src, port);
    assert_true(fd >= 0);
    const char *get = "GET /metrics HTTP/1.0\r\n\r\n";
    size_t sent = 0, have = 0;
    char resp[1024];
    uint64_t end = now_ms() + 10000;
    while (now_ms() < end) {
        uv_run(&loop, UV_RUN_ONCE);
        if (sent < strlen(get)) {
            ssize_t k = send(fd, get + sent, strlen(get) - sent, MSG_NOSIGNAL);
            if (k > 0)
                sent += (size_t)k;
            else if (errno != EAGAIN && errno != ENOTCONN)
                break;
            continue;
        }
        ssize_t k = recv(fd, resp + have, sizeof resp - 1 - have, 0);
        if (k == 0 || (k < 0 && errno != EAGAIN) || have + (size_t)(k > 0 ? k : 0) >= sizeof resp - 1)
            break;
        if (k > 0)
            have += (size_t)k;
    }
    close(fd);
    resp[have] = '\0';
    int status = 0;
    sscanf(resp, "HTTP/1.0 %d", &status);
    *body_ok = strstr(resp, "starling_up 1\n") != NULL;
    return status;
}

static void test_metrics_flood(void **state)
{
    (void)state;
    struct sockaddr_in ma;
    uv_ip4_addr("127.0.0.1", 0, &ma);
    int err;
    peer_metrics *met = peer_metrics_start(&loop, (struct sockaddr *)&ma, render_small, NULL, &err);
    assert_non_null(met);
    int port = peer_metrics_port(met);
    int n = fd_budget(1100);
    assert_true(n > 64);
    int *fds = malloc(sizeof(int) * (size_t)n);
    for (int i = 0; i < n; i++) {
        fds[i] = dial_nb("127.0.0.1", port);
        assert_true(fds[i] >= 0);
        if (i % 16 == 15)
            uv_run(&loop, UV_RUN_NOWAIT);
    }
    peer_metrics_stats s;
    for (int i = 0; i < 2000; i++) { /* until every one was accepted */
        peer_metrics_get_stats(met, &s);
        if (s.accepted == (uint64_t)n)
            break;
        uv_run(&loop, UV_RUN_ONCE);
    }
    assert_int_equal(s.accepted, n);
    /* A real scrape from another address while they hang on. */
    int body_ok;
    assert_int_equal(scrape("127.0.0.2", port, &body_ok), 200);
    assert_true(body_ok);
    peer_metrics_get_stats(met, &s);
    assert_int_equal(s.served, 1);
    assert_int_equal(s.refused_per_ip, (uint64_t)n - 8);
    for (int i = 0; i < n; i++)
        close(fds[i]);
    free(fds);
    peer_metrics_destroy(&met);
    run_for(50);
}

/* The endpoint closes a client that sends nothing or half a request. */
typedef struct mslow_run {
    int port;
    atomic_int done;
    int closed;
} mslow_run;

static void *metrics_slow_main(void *arg)
{
    mslow_run *ms = arg;
    int fd1 = dial_from("127.0.0.1", ms->port, 0);
    int fd2 = dial_from("127.0.0.1", ms->port, 0);
    if (fd2 >= 0)
        send_all(fd2, "GET /met", 8);
    ms->closed = (fd1 >= 0 && closed_by_server(fd1)) + (fd2 >= 0 && closed_by_server(fd2));
    if (fd1 >= 0)
        close(fd1);
    if (fd2 >= 0)
        close(fd2);
    atomic_store(&ms->done, 1);
    return NULL;
}

static void test_metrics_timeout(void **state)
{
    (void)state;
    struct sockaddr_in ma;
    uv_ip4_addr("127.0.0.1", 0, &ma);
    int err;
    peer_metrics_limits lim = {.timeout_ms = 300};
    peer_metrics *met = peer_metrics_start_ex(&loop, (struct sockaddr *)&ma, render_small, NULL, &lim, &err);
    assert_non_null(met);
    mslow_run ms = {.port = peer_metrics_port(met)};
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, metrics_slow_main, &ms), 0);
    assert_true(run_until(&ms.done, 10000));
    pthread_join(th, NULL);
    assert_int_equal(ms.closed, 2);
    peer_metrics_stats s;
    peer_metrics_get_stats(met, &s);
    assert_int_equal(s.timed_out, 2);
    peer_metrics_destroy(&met);
    run_for(50);
}

int main(int argc, char **argv)
{
    const struct CMUnitTest all[] = {
        cmocka_unit_test(test_reset_anywhere),
        cmocka_unit_test(test_idle_flood),
        cmocka_unit_test(test_handshake_slots),
        cmocka_unit_test(test_timeouts),
        cmocka_unit_test(test_incomplete_records),
        cmocka_unit_test(test_incomplete_per_ip),
        cmocka_unit_test(test_record_deadline),
        cmocka_unit_test(test_never_reads),
        cmocka_unit_test(test_never_reads_fair),
        cmocka_unit_test(test_slow_drain),
        cmocka_unit_test(test_queue_total_evicts),
        cmocka_unit_test(test_metrics_flood),
        cmocka_unit_test(test_metrics_timeout),
    };
    struct CMUnitTest pick[sizeof all / sizeof all[0]];
    size_t n = 0;
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        if (argc < 2 || strcmp(argv[1], all[i].name + 5) == 0) /* name without "test_" */
            pick[n++] = all[i];
    if (!n) {
        fprintf(stderr, "no test named %s\n", argv[1]);
        return 2;
    }
    return _cmocka_run_group_tests("peer_rpc_limits", pick, n, setup, teardown);
}
