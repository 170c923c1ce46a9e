#include "peer/metrics.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_CONNS 32
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
    struct mconn *prev, *next;
} mconn;

struct peer_metrics {
    uv_tcp_t listener;
    uv_loop_t *loop;
    peer_metrics_render_fn render;
    void *arg;
    int nconns;
    int stopping;
    int handles;             /* open handles (listener + conns) */
    mconn *conns;
};

static void maybe_free(peer_metrics *m)
{
    if (m->stopping && m->handles == 0)
        free(m);
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
    m->nconns--;
    m->handles--;
    free(c->out);
    free(c);
    maybe_free(m);
}

static void conn_close(mconn *c)
{
    if (!uv_is_closing((uv_handle_t *)&c->tcp))
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
    m->nconns++;
    c->next = m->conns;
    if (m->conns)
        m->conns->prev = c;
    m->conns = c;
    if (uv_accept(server, (uv_stream_t *)&c->tcp) != 0 || m->nconns > MAX_CONNS ||
        uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read) != 0)
        conn_close(c);
}

peer_metrics *peer_metrics_start(uv_loop_t *loop, const struct sockaddr *addr,
                                 peer_metrics_render_fn render, void *arg, int *err)
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
    if ((rc = uv_tcp_init(loop, &m->listener)) != 0) {
        free(m);
        *err = rc;
        return NULL;
    }
    m->handles = 1;
    m->listener.data = m;
    if ((rc = uv_tcp_bind(&m->listener, addr, 0)) != 0 ||
        (rc = uv_listen((uv_stream_t *)&m->listener, 16, on_connection)) != 0) {
        *err = rc;
        peer_metrics_stop(m);
        return NULL;
    }
    *err = 0;
    return m;
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

static void on_listener_closed(uv_handle_t *h)
{
    peer_metrics *m = h->data;
    m->handles--;
    maybe_free(m);
}

void peer_metrics_stop(peer_metrics *m)
{
    if (!m || m->stopping)
        return;
    m->stopping = 1;
    for (mconn *c = m->conns; c; c = c->next)
        conn_close(c);
    uv_close((uv_handle_t *)&m->listener, on_listener_closed);
}
