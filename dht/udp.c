/* The libuv binding: one uv_udp_t and one uv_timer_t around a dht_node. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <sodium.h>

#include "dht/dht.h"

struct dht {
    uv_loop_t *loop;
    uv_udp_t udp;
    uv_timer_t timer;
    dht_node *node;
    int started, closing, open_handles;
    int in_node;            /* inside a call into the node (callbacks may close) */
    int handles_closed;
    int v6_socket;
    dht_addr local;
    dht_close_cb close_cb;
    void *close_ud;
    uint8_t rbuf[2048];
    int rbuf_busy;
};

typedef struct opctx {
    dht *d;
    dht_done_cb done;
    dht_get_cb get;
    void *ud;
} opctx;

typedef struct sendreq {
    uv_udp_send_t req;
    size_t len;
    uint8_t data[];
} sendreq;

uint64_t dht_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

const char *dht_swarm_key_strerror(int status)
{
    return status == -EPERM     ? "readable by group or others; chmod 600 it"
           : status == -EBADMSG ? "expected 64 hex digits"
                                : strerror(-status);
}

int dht_swarm_key_load(uint8_t key[32], const char *path)
{
    char buf[130];
    struct stat st;
    ssize_t n;
    size_t bin_len = 0;
    const char *end = NULL;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -errno;
    if (fstat(fd, &st) != 0) {
        int e = -errno;
        close(fd);
        return e;
    }
    if (st.st_mode & 077) {
        close(fd);
        return -EPERM;
    }
    n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n < 0)
        return -EIO;
    buf[n] = '\0';
    while (n > 0 && (buf[n - 1] == '\n' || buf[n - 1] == '\r' || buf[n - 1] == ' '))
        buf[--n] = '\0';
    if (n != 64 || sodium_hex2bin(key, 32, buf, (size_t)n, NULL, &bin_len, &end) != 0 ||
        bin_len != 32 || *end)
        return -EBADMSG;
    return 0;
}

static void flush(dht *d);

static void on_send(uv_udp_send_t *req, int status)
{
    (void)status; /* UDP is lossy anyway: the core retries through timeouts */
    free(req->data);
}

static void on_timer(uv_timer_t *t);

static void rearm(dht *d)
{
    if (d->closing || !d->started)
        return;
    uint64_t dl = dht_node_next_deadline(d->node), now = dht_now_ms();
    if (dl == UINT64_MAX)
        uv_timer_stop(&d->timer);
    else
        uv_timer_start(&d->timer, on_timer, dl > now ? dl - now : 0, 0);
}

static void flush(dht *d)
{
    uint8_t buf[DHT_MAX_DATAGRAM];
    dht_addr to;
    int len;
    uv_os_fd_t fd = -1;
    if (d->started && uv_fileno((const uv_handle_t *)&d->udp, &fd) != 0)
        fd = -1;
    while ((len = dht_node_pop_output(d->node, buf, sizeof buf, &to)) != 0) {
        struct sockaddr_storage ss;
        if (len < 0 || !d->started)
            continue;
        if (to.family == 4 && d->v6_socket) {
            /* A dual-stack socket reaches IPv4 through mapped addresses. */
            dht_addr m = to;
            memset(m.ip, 0, 16);
            m.ip[10] = m.ip[11] = 0xff;
            memcpy(m.ip + 12, to.ip, 4);
            m.family = 6;
            to = m;
        } else if (to.family == 6 && !d->v6_socket) {
            continue;
        }
        int sl = dht_addr_to_sockaddr(&to, &ss);
        if (sl < 0)
            continue;
        /* Straight to the socket when nothing is queued: uv_udp_send sends
         * at once only the first datagram of a loop iteration and queues
         * the others for the next one (a lookup sends several at once). */
        if (fd >= 0 && uv_udp_get_send_queue_count(&d->udp) == 0) {
            ssize_t w;
            do
                w = sendto(fd, buf, (size_t)len, 0, (const struct sockaddr *)&ss, (socklen_t)sl);
            while (w < 0 && errno == EINTR);
            if (w >= 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != ENOBUFS))
                continue; /* sent, or dropped as UDP may drop anything */
        }
        sendreq *s = malloc(sizeof *s + (size_t)len);
        if (!s)
            continue;
        memcpy(s->data, buf, (size_t)len);
        s->len = (size_t)len;
        s->req.data = s;
        uv_buf_t b = uv_buf_init((char *)s->data, (unsigned)len);
        if (uv_udp_send(&s->req, &d->udp, &b, 1, (const struct sockaddr *)&ss, on_send) != 0)
            free(s);
    }
    rearm(d);
}

static void close_now(dht *d);

/* Every call into the node is bracketed so that a callback that closes the
 * dht (the usual end of a command-line tool) only marks it: the node is
 * freed once the call has returned. */
static void leave(dht *d)
{
    if (--d->in_node > 0)
        return;
    if (d->closing)
        close_now(d);
    else
        flush(d);
}

static void on_timer(uv_timer_t *t)
{
    dht *d = t->data;
    if (d->closing)
        return;
    d->in_node++;
    dht_node_tick(d->node, dht_now_ms());
    leave(d);
}

static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf)
{
    dht *d = h->data;
    (void)suggested;
    if (d->rbuf_busy) {
        *buf = uv_buf_init(NULL, 0);
        return;
    }
    d->rbuf_busy = 1;
    *buf = uv_buf_init((char *)d->rbuf, sizeof d->rbuf);
}

static void on_recv(uv_udp_t *u, ssize_t nread, const uv_buf_t *buf, const struct sockaddr *sa,
                    unsigned flags)
{
    dht *d = u->data;
    dht_addr from;
    if (buf->base == (char *)d->rbuf)
        d->rbuf_busy = 0;
    if (nread <= 0 || !sa || (flags & UV_UDP_PARTIAL) || d->closing)
        return;
    if (dht_addr_from_sockaddr(&from, sa) != 0)
        return;
    d->in_node++;
    dht_node_input(d->node, (const uint8_t *)buf->base, (size_t)nread, &from, dht_now_ms());
    leave(d);
}

dht *dht_create(uv_loop_t *loop, const dht_identity *ident, const dht_config *cfg)
{
    if (!loop || !ident)
        return NULL;
    dht *d = calloc(1, sizeof *d);
    if (!d)
        return NULL;
    d->loop = loop;
    d->node = dht_node_create(ident, cfg, dht_now_ms());
    if (!d->node) {
        free(d);
        return NULL;
    }
    return d;
}

int dht_start(dht *d, const char *listen)
{
    dht_addr a;
    struct sockaddr_storage ss;
    int rc, len;
    if (!d || !listen || d->started || d->closing)
        return -EINVAL;
    if (dht_addr_parse_listen(&a, listen) != 0)
        return -EINVAL;
    len = dht_addr_to_sockaddr(&a, &ss);
    if (len < 0)
        return -EINVAL;
    if ((rc = uv_udp_init(d->loop, &d->udp)) != 0)
        return rc;
    d->udp.data = d;
    d->open_handles++;
    if ((rc = uv_timer_init(d->loop, &d->timer)) != 0)
        return rc; /* the udp handle is closed by dht_close */
    d->timer.data = d;
    d->open_handles++;
    d->v6_socket = a.family == 6;
    /* A socket bound to a specific IPv6 address cannot reach IPv4; one bound
     * to :: is dual-stack (v4-mapped), one bound to IPv4 reaches IPv4 only. */
    {
        static const uint8_t any6[16];
        int wildcard6 = a.family == 6 && memcmp(a.ip, any6, 16) == 0;
        dht_node_set_families(d->node, a.family == 4 || wildcard6, a.family == 6);
    }
    if ((rc = uv_udp_bind(&d->udp, (const struct sockaddr *)&ss, 0)) != 0)
        return rc;
    int sl = (int)sizeof ss;
    if ((rc = uv_udp_getsockname(&d->udp, (struct sockaddr *)&ss, &sl)) != 0)
        return rc;
    dht_addr_from_sockaddr(&d->local, (const struct sockaddr *)&ss);
    if ((rc = uv_udp_recv_start(&d->udp, on_alloc, on_recv)) != 0)
        return rc;
    d->started = 1;
    rearm(d);
    return 0;
}

int dht_local_addr(const dht *d, dht_addr *out)
{
    if (!d || !d->started)
        return -ENOTCONN;
    *out = d->local;
    return 0;
}

int dht_peer_string(const dht *d, char *buf, size_t cap)
{
    dht_peer_addr p;
    if (!d || !d->started)
        return -ENOTCONN;
    memset(&p, 0, sizeof p);
    p.addr = d->local;
    p.has_id = 1;
    memcpy(p.id, dht_node_id(d->node), DHT_ID_LEN);
    return dht_peer_addr_format(buf, cap, &p);
}

const uint8_t *dht_self_id(const dht *d)
{
    return dht_node_id(d->node);
}

static void op_done(void *ud, const dht_result *r)
{
    opctx *o = ud;
    if (o->done)
        o->done(o->d, r->status, o->ud);
    else if (o->get)
        o->get(o->d, r->status, r->entries, r->n_entries, o->ud);
    free(o);
}

static opctx *op_new(dht *d, dht_done_cb done, dht_get_cb get, void *ud)
{
    opctx *o = calloc(1, sizeof *o);
    if (o) {
        o->d = d;
        o->done = done;
        o->get = get;
        o->ud = ud;
    }
    return o;
}

int dht_join(dht *d, const dht_peer_addr *peers, size_t n_peers, dht_done_cb cb, void *ud)
{
    if (!d || !peers || !n_peers)
        return -EINVAL;
    if (d->closing || !d->started)
        return d->closing ? -ECANCELED : -ENOTCONN;
    opctx *o = op_new(d, cb, NULL, ud);
    if (!o)
        return -ENOMEM;
    d->in_node++;
    int rc = dht_node_join(d->node, peers, n_peers, op_done, o, dht_now_ms());
    if (rc)
        free(o);
    leave(d);
    return rc;
}

/* Heap memory: a join that outlives the wait (timeout) reports into it
 * later, when it ends or the dht closes, and the callback frees it. */
typedef struct join_wait {
    int done, status, abandoned;
} join_wait;

static void on_join_done(dht *d, int status, void *ud)
{
    (void)d;
    join_wait *w = ud;
    if (w->abandoned) {
        free(w);
        return;
    }
    w->done = 1;
    w->status = status;
}

typedef struct join_timer {
    uv_timer_t t;
    int fired, closed;
} join_timer;

static void on_join_timeout(uv_timer_t *t)
{
    ((join_timer *)t)->fired = 1;
}

static void on_join_timer_closed(uv_handle_t *h)
{
    ((join_timer *)h)->closed = 1;
}

int dht_join_wait(dht *d, const dht_peer_addr *peers, size_t n_peers, double timeout_s)
{
    join_wait *w = calloc(1, sizeof *w);
    if (!w)
        return -ENOMEM;
    int rc = dht_join(d, peers, n_peers, on_join_done, w);
    if (rc != 0) {
        free(w);
        return rc;
    }
    join_timer timer = {.fired = 0, .closed = 0};
    uv_timer_init(d->loop, &timer.t);
    uv_timer_start(&timer.t, on_join_timeout, (uint64_t)(timeout_s * 1000), 0);
    while (!w->done && !timer.fired)
        uv_run(d->loop, UV_RUN_ONCE);
    uv_close((uv_handle_t *)&timer.t, on_join_timer_closed);
    while (!timer.closed) /* the timer lives on this stack frame */
        uv_run(d->loop, UV_RUN_ONCE);
    if (!w->done) {
        w->abandoned = 1; /* the join's callback frees it */
        return -ETIMEDOUT;
    }
    rc = w->status;
    free(w);
    return rc;
}

const char *dht_client_listen(const dht_peer_addr *first)
{
    static const uint8_t lo6[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1};
    if (first->addr.family == 6)
        return memcmp(first->addr.ip, lo6, 16) ? "[::]:0" : "[::1]:0";
    return first->addr.ip[0] == 127 ? "127.0.0.1:0" : "0.0.0.0:0";
}

int dht_collision_addr(const dht *d, char *buf, size_t cap)
{
    dht_addr a;
    if (dht_node_collision(d->node, &a) != 0)
        return -ENOENT;
    return dht_addr_format(buf, cap, &a);
}

int dht_join_strerror(const dht *d, int status, char *buf, size_t cap)
{
    dht_join_diag g;
    char addr[DHT_ADDR_STRLEN] = "?", got[DHT_ID_HEX_LEN + 1], want[DHT_ID_HEX_LEN + 1];
    int n;
    if (!buf || !cap)
        return 0;
    dht_node_join_diag(d->node, &g);
    if (g.status == status && status < 0) {
        if (dht_addr_format(addr, sizeof addr, &g.addr) < 0)
            snprintf(addr, sizeof addr, "?");
        dht_id_to_hex(got, g.got);
        dht_id_to_hex(want, g.expected);
    }
    if (g.status != status || status >= 0)
        n = snprintf(buf, cap, "%s", status == -EHOSTUNREACH ? "no initial peer answered" : strerror(-status));
    else if (status == -EADDRNOTAVAIL)
        n = snprintf(buf, cap, "%s answered as node %s, not %s", addr, got, want);
    else if (status == -EKEYREJECTED)
        n = snprintf(buf, cap, "%s answers, but not under our swarm key%s", addr,
                     g.have_swarm_key ? "" : " (we have none)");
    else
        n = snprintf(buf, cap, "another node is online with our node ID %s at %s", want, addr);
    return n < 0 ? 0 : (size_t)n >= cap ? (int)cap - 1 : n;
}

int dht_put(dht *d, const uint8_t key[DHT_ID_LEN], const uint8_t *subkey, size_t subkey_len,
            const void *value, size_t value_len, uint64_t expires_ms, int sign, dht_done_cb cb,
            void *ud)
{
    if (!d || !key)
        return -EINVAL;
    if (d->closing || !d->started)
        return d->closing ? -ECANCELED : -ENOTCONN;
    opctx *o = op_new(d, cb, NULL, ud);
    if (!o)
        return -ENOMEM;
    d->in_node++;
    int rc = dht_node_put(d->node, key, subkey, subkey_len, value, value_len, expires_ms, sign,
                          op_done, o, dht_now_ms());
    if (rc)
        free(o);
    leave(d);
    return rc;
}

int dht_get(dht *d, const uint8_t key[DHT_ID_LEN], dht_get_cb cb, void *ud)
{
    if (!d || !key || !cb)
        return -EINVAL;
    if (d->closing || !d->started)
        return d->closing ? -ECANCELED : -ENOTCONN;
    opctx *o = op_new(d, NULL, cb, ud);
    if (!o)
        return -ENOMEM;
    d->in_node++;
    int rc = dht_node_get(d->node, key, op_done, o, dht_now_ms());
    if (rc)
        free(o);
    leave(d);
    return rc;
}

void dht_get_stats(const dht *d, dht_node_stats *out)
{
    dht_node_get_stats(d->node, out);
}

static void finish_close(dht *d)
{
    dht_close_cb cb = d->close_cb;
    void *ud = d->close_ud;
    if (cb)
        cb(d, ud); /* d must not be used by cb: it is freed right after */
    free(d);
}

static void on_closed(uv_handle_t *h)
{
    dht *d = h->data;
    if (--d->open_handles == 0)
        finish_close(d);
}

static void close_now(dht *d)
{
    if (d->handles_closed)
        return;
    d->handles_closed = 1;
    /* Callbacks of pending operations run now, with -ECANCELED; calls they
     * make fail with -ECANCELED because closing is set. */
    d->in_node++;
    dht_node_destroy(&d->node);
    d->in_node--;
    if (d->open_handles == 0) {
        finish_close(d);
        return;
    }
    if (d->open_handles >= 1)
        uv_close((uv_handle_t *)&d->udp, on_closed);
    if (d->open_handles >= 2)
        uv_close((uv_handle_t *)&d->timer, on_closed);
}

void dht_close(dht *d, dht_close_cb cb, void *ud)
{
    if (!d || d->closing)
        return;
    d->closing = 1;
    d->close_cb = cb;
    d->close_ud = ud;
    if (!d->in_node)
        close_now(d);
}
