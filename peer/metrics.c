/* peer/metrics.c: the Prometheus endpoint (see metrics.h). */
#include "peer/metrics.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "net/rpc_conn.h"

#define REQ_MAX 8192
#define BODY_MAX (256 * 1024)

typedef struct mconn {
    uv_tcp_t tcp;            /* first: handle -> conn */
    struct peer_metrics *m;
    char req[REQ_MAX];
    size_t len;
    int answered;
    uv_write_t wr;
    char *out;               /* response bytes while writing */
    uint8_t key[16];         /* peer__addr_key of the client */
    uint64_t deadline;       /* closed at this uv_now */
    int closing;
    struct mconn *prev, *next;
} mconn;

struct peer_metrics {
    uv_tcp_t listener;
    uv_loop_t *loop;
    peer_metrics_render_fn render;
    void *arg;
    peer_metrics_limits lim;
    peer_metrics_stats st;
    uv_timer_t sweep;
    int live;                /* connections not closing */
    int stopping;
    int stopped, destroy_pending; /* every handle closed; destroy was called */
    void (*stop_cb)(void *);
    void *stop_arg;
    int handles;             /* open handles (listener, timer, conns) */
    mconn *conns;
};

static void maybe_free(peer_metrics *m)
{
    if (!m->stopping || m->handles > 0 || m->stopped)
        return;
    void (*cb)(void *) = m->stop_cb;
    void *arg = m->stop_arg;
    m->stopped = 1;
    if (m->destroy_pending)
        free(m);
    if (cb)
        cb(arg);
}

static void on_conn_closed(uv_handle_t *h)
{
    mconn *c = (mconn *)h;
    peer_metrics *m = c->m;
    if (c->prev)
        c->prev->next = c->next;
    else
        m->conns = c->next;
    if (c->next)
        c->next->prev = c->prev;
    m->handles--;
    free(c->out);
    free(c);
    maybe_free(m);
}

static void conn_close(mconn *c)
{
    if (c->closing)
        return;
    c->closing = 1;
    c->m->live--;
    uv_close((uv_handle_t *)&c->tcp, on_conn_closed);
}

static void on_written(uv_write_t *wr, int status)
{
    (void)status;
    conn_close((mconn *)wr->data);
}

static void respond(mconn *c, int code, const char *reason, const char *body, size_t blen)
{
    char head[256];
    int hl = snprintf(head, sizeof head,
                      "HTTP/1.0 %d %s\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
                      "Content-Length: %zu\r\nConnection: close\r\n\r\n",
                      code, reason, blen);
    c->out = malloc((size_t)hl + blen);
    if (!c->out) {
        conn_close(c);
        return;
    }
    memcpy(c->out, head, (size_t)hl);
    memcpy(c->out + hl, body, blen);
    uv_buf_t b = uv_buf_init(c->out, (unsigned)((size_t)hl + blen));
    c->wr.data = c;
    c->answered = 1;
    if (uv_write(&c->wr, (uv_stream_t *)&c->tcp, &b, 1, on_written) != 0)
        conn_close(c);
}

static void handle_request(mconn *c)
{
    c->req[c->len] = '\0';
    if (strncmp(c->req, "GET ", 4) != 0) {
        respond(c, 400, "Bad Request", "bad request\n", 12);
        return;
    }
    const char *path = c->req + 4;
    size_t plen = strcspn(path, " \r\n");
    if (!((plen == 8 && !strncmp(path, "/metrics", 8)) ||
          (plen == 9 && !strncmp(path, "/metrics/", 9)))) {
        respond(c, 404, "Not Found", "try /metrics\n", 13);
        return;
    }
    char *body = malloc(BODY_MAX);
    if (!body) {
        conn_close(c);
        return;
    }
    size_t n = c->m->render(body, BODY_MAX, c->m->arg);
    if (n > BODY_MAX)
        n = BODY_MAX;
    c->m->st.served++;
    respond(c, 200, "OK", body, n);
    free(body);
}

static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf)
{
    (void)suggested;
    mconn *c = (mconn *)h;
    size_t room = REQ_MAX - 1 - c->len;
    *buf = uv_buf_init(c->req + c->len, (unsigned)room);
}

static void on_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf)
{
    (void)buf;
    mconn *c = (mconn *)s;
    if (c->answered)
        return;
    if (nread < 0) {
        conn_close(c);
        return;
    }
    c->len += (size_t)nread;
    c->req[c->len] = '\0';
    if (strstr(c->req, "\r\n\r\n") || strstr(c->req, "\n\n")) {
        uv_read_stop(s);
        handle_request(c);
    } else if (c->len >= REQ_MAX - 1) {
        uv_read_stop(s);
        respond(c, 400, "Bad Request", "request too large\n", 18);
    }
}

static int same_addr(const mconn *a, const mconn *b)
{
    return memcmp(a->key, b->key, 16) == 0;
}

/* Live connections from c's address (c included when live). */
static int addr_count(const peer_metrics *m, const mconn *c)
{
    int n = 0;
    for (const mconn *o = m->conns; o; o = o->next)
        n += !o->closing && same_addr(o, c);
    return n;
}

/* Full: close the oldest connection (still reading first) of the address
 * that holds the most, if it holds more than newcomer nc's. At most
 * max_conns + 1 connections, so the quadratic scan stays small. */
static int evict_for(peer_metrics *m, mconn *nc)
{
    int mine = addr_count(m, nc), most = 0;
    mconn *best = NULL;
    for (mconn *o = m->conns; o; o = o->next) {
        if (o == nc || o->closing)
            continue;
        int n = addr_count(m, o);
        /* The list is newest first: a later match of the same count is older. */
        if (n > most || (n == most && (!o->answered || best->answered))) {
            best = o;
            most = n;
        }
    }
    if (!best || most <= mine)
        return 0;
    m->st.evicted++;
    conn_close(best);
    return 1;
}

static void on_connection(uv_stream_t *server, int status)
{
    peer_metrics *m = server->data;
    if (status < 0 || m->stopping)
        return;
    mconn *c = calloc(1, sizeof *c);
    if (!c)
        return;
    c->m = m;
    if (uv_tcp_init(m->loop, &c->tcp) != 0) {
        free(c);
        return;
    }
    m->handles++;
    m->live++;
    c->next = m->conns;
    if (m->conns)
        m->conns->prev = c;
    m->conns = c;
    c->deadline = uv_now(m->loop) + m->lim.timeout_ms;
    if (uv_accept(server, (uv_stream_t *)&c->tcp) != 0) {
        conn_close(c);
        return;
    }
    m->st.accepted++;
    struct sockaddr_storage ss;
    int len = sizeof ss;
    memset(&ss, 0, sizeof ss);
    uv_tcp_getpeername(&c->tcp, (struct sockaddr *)&ss, &len);
    peer__addr_key((const struct sockaddr *)&ss, c->key);
    if (addr_count(m, c) > m->lim.max_conns_per_ip) {
        m->st.refused_per_ip++;
        conn_close(c);
        return;
    }
    if (m->live > m->lim.max_conns && !evict_for(m, c)) {
        m->st.refused_full++;
        conn_close(c);
        return;
    }
    if (uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read) != 0)
        conn_close(c);
}

static void sweep_cb(uv_timer_t *t)
{
    peer_metrics *m = t->data;
    uint64_t now = uv_now(m->loop);
    for (mconn *c = m->conns; c; c = c->next)
        if (!c->closing && now >= c->deadline) {
            m->st.timed_out++;
            conn_close(c);
        }
}

peer_metrics *peer_metrics_start(uv_loop_t *loop, const struct sockaddr *addr,
                                 peer_metrics_render_fn render, void *arg, int *err)
{
    return peer_metrics_start_ex(loop, addr, render, arg, NULL, err);
}

peer_metrics *peer_metrics_start_ex(uv_loop_t *loop, const struct sockaddr *addr,
                                    peer_metrics_render_fn render, void *arg,
                                    const peer_metrics_limits *lim, int *err)
{
    int dummy, rc;
    if (!err)
        err = &dummy;
    if (!loop || !addr || !render) {
        *err = -EINVAL;
        return NULL;
    }
    peer_metrics *m = calloc(1, sizeof *m);
    if (!m) {
        *err = -ENOMEM;
        return NULL;
    }
    m->loop = loop;
    m->render = render;
    m->arg = arg;
    if (lim)
        m->lim = *lim;
    if (m->lim.max_conns <= 0)
        m->lim.max_conns = 64;
    if (m->lim.max_conns_per_ip <= 0)
        m->lim.max_conns_per_ip = 8;
    if (!m->lim.timeout_ms)
        m->lim.timeout_ms = 5000;
    peer__ignore_sigpipe();
    if ((rc = uv_tcp_init(loop, &m->listener)) != 0) {
        free(m);
        *err = rc;
        return NULL;
    }
    m->handles = 1;
    m->listener.data = m;
    uv_timer_init(loop, &m->sweep);
    m->sweep.data = m;
    m->handles++;
    uint64_t tick = m->lim.timeout_ms / 4;
    tick = tick < 10 ? 10 : tick > 250 ? 250 : tick;
    uv_timer_start(&m->sweep, sweep_cb, tick, tick);
    if ((rc = uv_tcp_bind(&m->listener, addr, 0)) != 0 ||
        (rc = uv_listen((uv_stream_t *)&m->listener, 128, on_connection)) != 0) {
        *err = rc;
        peer_metrics_destroy(&m);
        return NULL;
    }
    *err = 0;
    return m;
}

void peer_metrics_get_stats(const peer_metrics *m, peer_metrics_stats *out)
{
    *out = m->st;
}

int peer_metrics_port(const peer_metrics *m)
{
    struct sockaddr_storage ss;
    int len = sizeof ss;
    if (!m || uv_tcp_getsockname(&m->listener, (struct sockaddr *)&ss, &len) != 0)
        return -1;
    if (ss.ss_family == AF_INET)
        return ntohs(((struct sockaddr_in *)&ss)->sin_port);
    if (ss.ss_family == AF_INET6)
        return ntohs(((struct sockaddr_in6 *)&ss)->sin6_port);
    return -1;
}

static void on_handle_closed(uv_handle_t *h)
{
    peer_metrics *m = h->data;
    m->handles--;
    maybe_free(m);
}

void peer_metrics_stop(peer_metrics *m, void (*cb)(void *arg), void *arg)
{
    if (!m || m->stopping)
        return;
    m->stopping = 1;
    m->stop_cb = cb;
    m->stop_arg = arg;
    for (mconn *c = m->conns; c; c = c->next)
        conn_close(c);
    uv_timer_stop(&m->sweep);
    uv_close((uv_handle_t *)&m->sweep, on_handle_closed);
    uv_close((uv_handle_t *)&m->listener, on_handle_closed);
}

void peer_metrics_destroy(peer_metrics **p)
{
    peer_metrics *m = p ? *p : NULL;
    if (!m)
        return;
    *p = NULL;
    if (m->stopped) {
        free(m);
        return;
    }
    m->destroy_pending = 1;
    peer_metrics_stop(m, NULL, NULL); /* nothing when already stopping */
}
