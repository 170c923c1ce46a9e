/* net/rpc_client.c: tensor RPC client (see rpc_client.h). */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include <uthash.h>

#include "net/rpc_client.h"
#include "net/rpc_conn.h"

typedef struct call call;
struct call {
    uint64_t id;
    peer_rpc_client *cl;
    peer_rpc_reply_cb cb;
    void *arg;
    uint64_t deadline;         /* uv_now ms; UINT64_MAX for none */
    peer__buf out;             /* the request record, reused */
    uv_write_t wr;
    int writing, pending;
    call *next;                /* free list */
    UT_hash_handle hh;
};

enum { ST_INIT, ST_CONNECTING, ST_READY, ST_FAILED, ST_CLOSING };

struct peer_rpc_client {
    peer__conn c;              /* first: c.tcp.data == this */
    uv_loop_t *loop;
    peer_rpc_client_config cfg;
    dht_identity self;
    uint8_t expect[DHT_ID_LEN], swarm[32];
    int have_expect, have_swarm, have_local;
    struct sockaddr_storage local; /* cfg.local_addr, copied */
    int state;
    int conn_inited, handles_open;
    uv_connect_t creq;
    uv_timer_t timer;
    uint64_t timer_due;        /* 0: not armed */
    uint64_t connect_deadline;
    call *pending;             /* uthash by id */
    int npending;
    call *free_calls;
    uint64_t next_id;
    peer_rpc_connect_cb ccb;
    void *carg;
    void (*close_cb)(peer_rpc_client *, void *);
    void *close_arg;
};

static void put_call(call *k)
{
    peer_rpc_client *cl = k->cl;
    k->next = cl->free_calls;
    cl->free_calls = k;
}

/* Completes k with status (and reply when status is 0). */
static void complete(call *k, int status, const peer_msg *reply)
{
    peer_rpc_client *cl = k->cl;
    HASH_DEL(cl->pending, k);
    cl->npending--;
    k->pending = 0;
    peer_rpc_reply_cb cb = k->cb;
    void *arg = k->arg;
    if (!k->writing)
        put_call(k);
    cb(arg, status, reply);
}

static void fail_all(peer_rpc_client *cl, int status)
{
    /* Take the head each time: callbacks may re-enter and fail others. */
    while (cl->pending)
        complete(cl->pending, status, NULL);
}

static void timer_cb(uv_timer_t *t);

static void rearm(peer_rpc_client *cl, uint64_t due)
{
    if (cl->state == ST_CLOSING || cl->handles_open == 0)
        return;
    if (cl->timer_due && cl->timer_due <= due)
        return;
    uint64_t now = uv_now(cl->loop);
    cl->timer_due = due;
    uv_timer_start(&cl->timer, timer_cb, due > now ? due - now : 0, 0);
}

peer_cipher peer_rpc_client_cipher(const peer_rpc_client *cl)
{
    return cl && cl->state == ST_READY ? peer_channel_cipher(cl->c.ch) : PEER_CIPHER_NONE;
}

static void handle_closed(uv_handle_t *h)
{
    peer_rpc_client *cl = h->data;
    if (--cl->handles_open == 0 && cl->state == ST_CLOSING && cl->close_cb)
        cl->close_cb(cl, cl->close_arg);
}

static void conn_fail(peer_rpc_client *cl, int err)
{
    if (cl->state == ST_CLOSING || cl->state == ST_FAILED)
        return;
    int was_connecting = cl->state == ST_CONNECTING;
    cl->state = ST_FAILED;
    peer__conn_close(&cl->c, handle_closed);
    if (was_connecting && cl->ccb)
        cl->ccb(cl, err, cl->carg);
    fail_all(cl, err);
}

static void timer_cb(uv_timer_t *t)
{
    peer_rpc_client *cl = t->data;
    uint64_t now = uv_now(cl->loop), next = UINT64_MAX;
    cl->timer_due = 0;
    if (cl->state == ST_CONNECTING) {
        if (now >= cl->connect_deadline) {
            conn_fail(cl, -ETIMEDOUT);
            return;
        }
        next = cl->connect_deadline;
    }
    call *k, *tmp;
    /* A callback may close the client; stop then. */
    HASH_ITER(hh, cl->pending, k, tmp) {
        if (k->deadline <= now) {
            complete(k, -ETIMEDOUT, NULL);
            if (cl->state == ST_CLOSING)
                return;
            /* complete() may have removed tmp through a re-entrant call:
             * restart the scan on the next tick instead of trusting it. */
            next = now;
            break;
        }
        if (k->deadline < next)
            next = k->deadline;
    }
    if (next != UINT64_MAX)
        rearm(cl, next);
}

static void on_established(peer__conn *c)
{
    peer_rpc_client *cl = (peer_rpc_client *)c;
    cl->state = ST_READY;
    if (cl->ccb)
        cl->ccb(cl, 0, cl->carg);
}

static void on_message(peer__conn *c, const peer_msg *m, int rc)
{
    peer_rpc_client *cl = (peer_rpc_client *)c;
    if (rc || m->kind == PEER_KIND_REQUEST) {
        conn_fail(cl, -EBADMSG); /* a server that sends garbage is not trusted further */
        return;
    }
    if (m->id == 0 && m->kind == PEER_KIND_ERROR) {
        /* A connection-level complaint (our frame was refused). */
        conn_fail(cl, m->err_code > 0 ? -m->err_code : -EPROTO);
        return;
    }
    call *k;
    uint64_t id = m->id;
    HASH_FIND(hh, cl->pending, &id, sizeof id, k);
    if (!k)
        return; /* late answer to a request that already timed out */
    complete(k, 0, m);
}

static void on_error(peer__conn *c, int err)
{
    conn_fail((peer_rpc_client *)c, err);
}

static const peer__conn_ops client_ops = {on_established, on_message, on_error};

peer_rpc_client *peer_rpc_client_create(uv_loop_t *loop, const peer_rpc_client_config *cfg)
{
    if (!loop || !cfg || !cfg->self)
        return NULL;
    peer_rpc_client *cl = calloc(1, sizeof *cl);
    if (!cl)
        return NULL;
    cl->loop = loop;
    cl->cfg = *cfg;
    cl->self = *cfg->self;
    cl->cfg.self = &cl->self;
    if (cfg->expect_id) {
        memcpy(cl->expect, cfg->expect_id, DHT_ID_LEN);
        cl->have_expect = 1;
    }
    if (cfg->swarm_key) {
        memcpy(cl->swarm, cfg->swarm_key, 32);
        cl->have_swarm = 1;
    }
    cl->cfg.expect_id = cl->cfg.swarm_key = NULL;
    if (cfg->local_addr) {
        size_t len = cfg->local_addr->sa_family == AF_INET6 ? sizeof(struct sockaddr_in6)
                                                            : sizeof(struct sockaddr_in);
        memcpy(&cl->local, cfg->local_addr, len);
        cl->have_local = 1;
    }
    cl->cfg.local_addr = NULL;
    /* A server that resets the connection must not kill the process. */
    peer__ignore_sigpipe();
    if (!cl->cfg.max_frame)
        cl->cfg.max_frame = PEER_CHANNEL_MAX_RECORD;
    if (cl->cfg.max_pending <= 0)
        cl->cfg.max_pending = 256;
    if (!cl->cfg.connect_timeout_ms)
        cl->cfg.connect_timeout_ms = 5000;
    return cl;
}

static void connect_cb(uv_connect_t *req, int status)
{
    peer_rpc_client *cl = req->data;
    if (cl->state != ST_CONNECTING)
        return;
    if (status < 0) {
        conn_fail(cl, status);
        return;
    }
    if (peer__conn_start(&cl->c) != 0)
        conn_fail(cl, -EPIPE);
}

int peer_rpc_client_connect(peer_rpc_client *cl, const struct sockaddr *addr,
                            peer_rpc_connect_cb cb, void *arg)
{
    if (!cl || !addr || cl->state != ST_INIT)
        return -EINVAL;
    peer_channel_config cc = {.self = &cl->self, .expect_id = cl->have_expect ? cl->expect : NULL,
                              .swarm_key = cl->have_swarm ? cl->swarm : NULL,
                              .max_record = cl->cfg.max_frame, .plaintext = cl->cfg.plaintext,
                              .no_aes = cl->cfg.no_aes};
    int rc = peer__conn_init(&cl->c, cl->loop, &cc, 1, &client_ops, cl, cl->cfg.max_frame);
    if (rc)
        return rc;
    cl->conn_inited = 1;
    uv_timer_init(cl->loop, &cl->timer);
    cl->timer.data = cl;
    cl->handles_open = 2;
    cl->creq.data = cl;
    rc = cl->have_local ? uv_tcp_bind(&cl->c.tcp, (const struct sockaddr *)&cl->local, 0) : 0;
    if (rc == 0)
        rc = uv_tcp_connect(&cl->creq, &cl->c.tcp, addr, connect_cb);
    if (rc) {
        cl->state = ST_FAILED; /* the caller closes */
        return rc;
    }
    cl->ccb = cb;
    cl->carg = arg;
    cl->state = ST_CONNECTING;
    cl->connect_deadline = uv_now(cl->loop) + cl->cfg.connect_timeout_ms;
    rearm(cl, cl->connect_deadline);
    return 0;
}

static void call_written(uv_write_t *wr, int status)
{
    call *k = wr->data;
    peer_rpc_client *cl = k->cl;
    k->writing = 0;
    if (!k->pending)
        put_call(k);
    if (status < 0 && status != UV_ECANCELED)
        conn_fail(cl, status);
}

int peer_rpc_call(peer_rpc_client *cl, const peer_msg *req, uint64_t timeout_ms,
                  peer_rpc_reply_cb cb, void *arg, uint64_t *id_out)
{
    if (!cl || !req || !cb)
        return -EINVAL;
    if (cl->state != ST_READY)
        return -ENOTCONN;
    if (cl->npending >= cl->cfg.max_pending)
        return -EAGAIN;
    peer_msg m = *req;
    m.kind = PEER_KIND_REQUEST;
    m.id = ++cl->next_id;
    long n = peer_wire_size(&m);
    if (n < 0)
        return (int)n;
    if ((size_t)n > cl->cfg.max_frame)
        return -EMSGSIZE;
    call *k = cl->free_calls;
    if (k) {
        cl->free_calls = k->next;
    } else if (!(k = calloc(1, sizeof *k))) {
        return -ENOMEM;
    }
    k->cl = cl;
    k->wr.data = k;
    if (peer__buf_reserve(&k->out, PEER_CHANNEL_HDR_LEN + (size_t)n + PEER_CHANNEL_TAG_LEN)) {
        put_call(k);
        return -ENOMEM;
    }
    /* Only the header is encoded here; the tensors are sealed straight from
     * the caller's memory into the record. */
    long head = peer_wire_encode_head(&m, k->out.p + PEER_CHANNEL_HDR_LEN,
                                      k->out.cap - PEER_CHANNEL_HDR_LEN, NULL);
    int rc = head < 0 ? (int)head
                      : peer__conn_send(&cl->c, k->out.p, (size_t)head, &m, (size_t)n, &k->wr,
                                        call_written);
    if (rc) {
        put_call(k);
        return rc;
    }
    k->id = m.id;
    k->cb = cb;
    k->arg = arg;
    k->writing = 1;
    k->pending = 1;
    k->deadline = timeout_ms ? uv_now(cl->loop) + timeout_ms : UINT64_MAX;
    HASH_ADD(hh, cl->pending, id, sizeof k->id, k);
    cl->npending++;
    if (timeout_ms)
        rearm(cl, k->deadline);
    if (id_out)
        *id_out = m.id;
    return 0;
}

int peer_rpc_client_pending(const peer_rpc_client *cl)
{
    return cl ? cl->npending : 0;
}

const uint8_t *peer_rpc_client_peer_id(const peer_rpc_client *cl)
{
    return cl && cl->state == ST_READY ? peer_channel_peer_id(cl->c.ch) : NULL;
}

void peer_rpc_client_stop(peer_rpc_client *cl, void (*close_cb)(peer_rpc_client *, void *),
                           void *arg)
{
    if (!cl || cl->state == ST_CLOSING)
        return;
    int was_connecting = cl->state == ST_CONNECTING;
    cl->state = ST_CLOSING;
    cl->close_cb = close_cb;
    cl->close_arg = arg;
    if (was_connecting && cl->ccb)
        cl->ccb(cl, -ECANCELED, cl->carg);
    fail_all(cl, -ECANCELED);
    if (!cl->conn_inited) {
        if (close_cb)
            close_cb(cl, arg);
        return;
    }
    uv_timer_stop(&cl->timer);
    uv_close((uv_handle_t *)&cl->timer, handle_closed);
    /* After a failure the tcp handle is already closing; its callback
     * counts down handles_open like the timer's. */
    peer__conn_close(&cl->c, handle_closed);
}

void peer_rpc_client_destroy(peer_rpc_client **p)
{
    if (!p || !*p)
        return;
    peer_rpc_client *cl = *p;
    while (cl->free_calls) {
        call *k = cl->free_calls;
        cl->free_calls = k->next;
        peer__buf_free(&k->out);
        free(k);
    }
    if (cl->conn_inited)
        peer__conn_free(&cl->c);
    free(cl);
    *p = NULL;
}
