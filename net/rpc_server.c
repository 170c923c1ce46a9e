/* net/rpc_server.c: tensor RPC server (see rpc_server.h). */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>

#include <sodium.h>

#include "net/rpc_conn.h"
#include "net/rpc_server.h"
#include "net/wake.h"

typedef struct sconn sconn;

/* Connections per remote address (IPv4 address, IPv6 /64), counted from
 * accept until close. Keyed with a random SipHash key, so an attacker who
 * picks addresses cannot aim at one bucket. */
#define IP_BUCKETS 1024

typedef struct ipent {
    uint8_t key[16];
    int conns, hs;         /* open connections, of them still in the handshake */
    size_t queued;         /* reply bytes not yet written, its connections together */
    size_t charged;        /* record bytes charged to max_incomplete_bytes */
    struct ipent *next;
} ipent;

struct peer_rpc_request {
    sconn *conn;
    peer__buf in;          /* the request's record: msg borrows it */
    peer__buf out;         /* the reply record, sealed in place */
    size_t plain_len;
    int ok;                /* reply encoded */
    uint64_t id;
    peer_method method;
    size_t held;           /* bytes of in counted in srv->held */
    size_t queued;         /* bytes of out handed to the socket, not yet written */
    size_t retained;       /* bytes counted in srv->retained while on the free list */
    peer_msg msg;
    uv_write_t wr;
    peer_rpc_request *next; /* free list or completion queue */
};

struct sconn {
    peer__conn c;          /* first: c.tcp.data == this */
    peer_rpc_server *srv;
    sconn *prev, *next;
    peer_rpc_request *free_reqs;
    int inflight;          /* requests taken and not yet released */
    int handle_closed;
    int close_after_write;
    uint64_t hs_deadline;
    ipent *ip;             /* NULL once closing */
    int in_hs;             /* counted in ip->hs and srv->st.handshaking */
    uint64_t last_active;  /* handshake done, request taken or reply written */
    size_t queued;         /* reply bytes not yet written */
    uint64_t drain_since;  /* queued > 0: when its replies last made write progress */
    size_t wq_seen;        /* libuv's write queue size at the last sweep */
    int pin;               /* being walked by resume_waiters: not freed */
};

struct peer_rpc_server {
    uv_loop_t *loop;
    pthread_t loop_thread;
    peer_rpc_server_config cfg;
    dht_identity self;
    uint8_t swarm[32];
    int have_swarm;
    uv_tcp_t listener;
    uv_timer_t sweep;
    peer__wake wake;             /* workers' answers wake the loop */
    int wake_ok;
    int listening, closing, handles_open;
    int port;
    sconn *conns;
    pthread_mutex_t mu;
    peer_rpc_request *done_head, *done_tail; /* answered off the loop thread */
    peer_rpc_server_stats st;
    size_t held;                 /* request bytes held by unanswered requests */
    size_t retained, retain_cap; /* buffers kept on free lists */
    size_t queued;               /* reply bytes not yet written, all connections */
    int live;                    /* connections not closing */
    int resuming;                /* in resume_waiters */
    int freed;                   /* a connection was freed during resume_waiters */
    int paused_hint;             /* some connection may be paused by can_read */
    int queued_addrs;            /* addresses with reply bytes not yet written */
    peer__budget budget;         /* records being received */
    ipent *ip_tab[IP_BUCKETS];
    uint8_t ip_salt[crypto_shorthash_KEYBYTES];
    void (*close_cb)(peer_rpc_server *, void *);
    void *close_arg;
};

static void maybe_finish_close(peer_rpc_server *srv);

/* ---- requests ---- */

static peer_rpc_request *take_req(sconn *sc)
{
    peer_rpc_request *r = sc->free_reqs;
    if (r) {
        sc->free_reqs = r->next;
        sc->srv->retained -= r->retained;
        r->retained = 0;
    } else {
        r = calloc(1, sizeof *r);
        if (!r)
            return NULL;
    }
    r->next = NULL;
    r->conn = sc;
    r->wr.data = r;
    r->ok = 0;
    sc->inflight++;
    return r;
}

static void conn_maybe_free(sconn *sc);

static int can_read(const sconn *sc)
{
    const peer_rpc_server *srv = sc->srv;
    if (sc->inflight >= srv->cfg.max_inflight || srv->held >= srv->cfg.max_held_bytes ||
        sc->queued >= srv->cfg.max_queued_bytes)
        return 0;
    if (srv->queued < srv->cfg.max_queued_total)
        return 1;
    /* The total is reached: only addresses holding at least an equal share
     * of it (among the addresses with replies queued) stop being read, so
     * one address's unread replies cannot stall everyone else. */
    size_t mine = sc->ip ? sc->ip->queued : sc->queued;
    int n = srv->queued_addrs > 0 ? srv->queued_addrs : 1;
    return mine < srv->cfg.max_queued_total / (size_t)n;
}

static void queue_add(sconn *sc, size_t n)
{
    peer_rpc_server *srv = sc->srv;
    if (!sc->queued) {
        sc->drain_since = uv_now(srv->loop);
        sc->wq_seen = 0;
    }
    sc->queued += n;
    srv->queued += n;
    if (sc->ip && n) {
        if (!sc->ip->queued)
            srv->queued_addrs++;
        sc->ip->queued += n;
    }
}

static void queue_sub(sconn *sc, size_t n)
{
    peer_rpc_server *srv = sc->srv;
    sc->queued -= n;
    srv->queued -= n;
    if (sc->ip && n) {
        sc->ip->queued -= n;
        if (!sc->ip->queued)
            srv->queued_addrs--;
    }
}

static void resume_waiters(peer_rpc_server *srv);

static void free_req_bufs(peer_rpc_request *r)
{
    peer__buf_free(&r->in);
    peer__buf_free(&r->out);
}

/* Frees the answered requests sc keeps for reuse, and their buffers. */
static void free_spare_reqs(sconn *sc)
{
    while (sc->free_reqs) {
        peer_rpc_request *r = sc->free_reqs;
        sc->free_reqs = r->next;
        sc->srv->retained -= r->retained;
        free_req_bufs(r);
        free(r);
    }
}

static void release_req(peer_rpc_request *r)
{
    sconn *sc = r->conn;
    peer_rpc_server *srv = sc->srv;
    /* Keep the buffers for the next request while the kept ones are few: a
     * burst of huge frames must not stay allocated for good. */
    size_t keep = r->in.cap + r->out.cap;
    if (srv->retained + keep > srv->retain_cap) {
        free_req_bufs(r);
        keep = 0;
    }
    r->retained = keep;
    srv->retained += keep;
    r->next = sc->free_reqs;
    sc->free_reqs = r;
    sc->inflight--;
    srv->held -= r->held;
    r->held = 0;
    if (sc->c.closing)
        conn_maybe_free(sc); /* may free sc */
    /* Held and queued bytes dropped: this connection and any other held
     * back by the server-wide bounds or the record budget may go on. */
    resume_waiters(srv);
}

static void close_conn(sconn *sc);

static void reply_written(uv_write_t *wr, int status)
{
    (void)status;
    peer_rpc_request *r = wr->data;
    sconn *sc = r->conn;
    peer_rpc_server *srv = sc->srv;
    queue_sub(sc, r->queued);
    r->queued = 0;
    if (status == 0)
        sc->last_active = sc->drain_since = uv_now(srv->loop);
    /* Close before releasing: releasing the last request of a closed
     * connection frees it. */
    if (sc->close_after_write && !sc->c.closing)
        close_conn(sc);
    release_req(r);
}

/* Loop thread: seal and write a reply, or drop it. m is NULL when the
 * whole reply is already encoded in r->out (answered off the loop). */
static void send_reply(peer_rpc_request *r, size_t head_len, const peer_msg *m)
{
    sconn *sc = r->conn;
    if (!r->ok || sc->c.closing ||
        peer__conn_send(&sc->c, r->out.p, head_len, m, r->plain_len, &r->wr, reply_written) != 0) {
        release_req(r);
        return;
    }
    peer_rpc_server *srv = sc->srv;
    srv->st.replies++;
    r->queued = PEER_CHANNEL_HDR_LEN + r->plain_len + peer_channel_tag_len(sc->c.ch);
    queue_add(sc, r->queued);
    if (srv->queued > srv->st.queued_bytes_max)
        srv->st.queued_bytes_max = srv->queued;
}

static void finish(peer_rpc_request *r)
{
    send_reply(r, r->plain_len, NULL);
}

static void error_msg(peer_msg *m, const peer_rpc_request *r, int code, const char *text)
{
    peer_msg_init(m, PEER_KIND_ERROR, r->method, r->id);
    m->err_code = code;
    snprintf(m->err_msg, sizeof m->err_msg, "%s", text ? text : "");
}

static int on_loop(const peer_rpc_server *srv)
{
    return pthread_equal(pthread_self(), srv->loop_thread);
}

/* Another thread answered: queue r for the loop. */
static void dispatch(peer_rpc_request *r)
{
    peer_rpc_server *srv = r->conn->srv;
    pthread_mutex_lock(&srv->mu);
    /* Only the answer that makes the queue non-empty wakes the loop: until
     * the loop takes the queue, that wake-up is still due. */
    int first = srv->done_head == NULL;
    if (srv->done_tail)
        srv->done_tail->next = r;
    else
        srv->done_head = r;
    srv->done_tail = r;
    pthread_mutex_unlock(&srv->mu);
    if (first)
        peer__wake_send(&srv->wake);
}

int peer_rpc_respond(peer_rpc_request *r, const peer_msg *reply)
{
    if (!r)
        return -EINVAL;
    peer_msg m;
    if (reply)
        m = *reply;
    else
        peer_msg_init(&m, PEER_KIND_REPLY, r->method, r->id);
    if (m.kind != PEER_KIND_ERROR)
        m.kind = PEER_KIND_REPLY;
    m.id = r->id;
    m.method = r->method;
    int rc = 0;
    long n = peer_wire_size(&m);
    if (n == -EINVAL) {
        /* The handler built a bad reply: tell the client rather than hang it. */
        rc = -EINVAL;
        error_msg(&m, r, EIO, "server produced a malformed reply");
        n = peer_wire_size(&m);
    }
    r->ok = 0;
    if (n >= 0 && peer__buf_reserve(&r->out, PEER_CHANNEL_HDR_LEN + (size_t)n +
                                                 PEER_CHANNEL_TAG_LEN) == 0) {
        r->plain_len = (size_t)n;
        r->ok = 1;
    } else if (!rc) {
        rc = -ENOMEM;
    }
    uint8_t *p = r->ok ? r->out.p + PEER_CHANNEL_HDR_LEN : NULL;
    size_t cap = r->ok ? r->out.cap - PEER_CHANNEL_HDR_LEN : 0;
    if (on_loop(r->conn->srv)) {
        /* Encode the header only; the tensors are sealed straight from the
         * handler's memory. */
        long head = r->ok ? peer_wire_encode_head(&m, p, cap, NULL) : -ENOBUFS;
        r->ok = head >= 0;
        send_reply(r, r->ok ? (size_t)head : 0, &m);
        return rc;
    }
    /* Off the loop the channel may not be touched: copy everything now (on
     * this thread), the loop seals it in place. */
    if (r->ok)
        r->ok = peer_wire_encode(&m, p, cap) == n;
    dispatch(r);
    return rc;
}

int peer_rpc_respond_error(peer_rpc_request *r, int code, const char *message)
{
    if (!r)
        return -EINVAL;
    peer_msg m;
    error_msg(&m, r, code, message);
    return peer_rpc_respond(r, &m);
}

const uint8_t *peer_rpc_request_peer_id(const peer_rpc_request *r)
{
    return peer_channel_peer_id(r->conn->c.ch);
}

static void wake_cb(peer__wake *w)
{
    peer_rpc_server *srv = w->data;
    pthread_mutex_lock(&srv->mu);
    peer_rpc_request *r = srv->done_head;
    srv->done_head = srv->done_tail = NULL;
    pthread_mutex_unlock(&srv->mu);
    while (r) {
        peer_rpc_request *next = r->next;
        r->next = NULL;
        finish(r);
        r = next;
    }
}

/* ---- connections ---- */

/* Connections paused by can_read or waiting for the record budget get
 * another try, in list order. A resume may deliver records and run
 * handlers, which may answer (and so release) requests synchronously, even
 * another connection's: the connection being resumed is pinned, and one
 * freed meanwhile makes the walk run again (at most three passes; a
 * connection that pauses again at once is not retried in the same pass).
 * Not reentrant: a call from inside a resume returns at once, the outer
 * walk covers it. */
static void resume_waiters(peer_rpc_server *srv)
{
    if (srv->resuming || srv->closing || (!srv->budget.waiters && !srv->paused_hint))
        return;
    srv->resuming = 1;
    for (int pass = 0; pass < 3; pass++) {
        srv->freed = 0;
        int still = 0;
        for (sconn *o = srv->conns, *next; o; o = next) {
            o->pin++;
            if (o->c.paused && !o->c.closing && !o->c.failed && can_read(o))
                peer__conn_resume(&o->c);
            still |= o->c.paused && !o->c.budget_wait && !o->c.closing;
            next = o->next;
            if (--o->pin == 0)
                conn_maybe_free(o); /* only if it closed meanwhile */
        }
        srv->paused_hint = still;
        if (!srv->freed)
            break;
    }
    srv->resuming = 0;
}

/* ---- addresses ---- */

static ipent **ip_slot(peer_rpc_server *srv, const uint8_t key[16])
{
    uint8_t h[crypto_shorthash_BYTES];
    crypto_shorthash(h, key, 16, srv->ip_salt);
    uint32_t b = ((uint32_t)h[0] | (uint32_t)h[1] << 8) % IP_BUCKETS;
    ipent **pp = &srv->ip_tab[b];
    while (*pp && memcmp((*pp)->key, key, 16) != 0)
        pp = &(*pp)->next;
    return pp;
}

/* Stops counting sc against its address and the server's totals (at
 * close: a closing connection no longer holds a place). */
static void detach(sconn *sc)
{
    peer_rpc_server *srv = sc->srv;
    ipent *e = sc->ip;
    if (!e)
        return;
    sc->ip = NULL;
    srv->live--;
    e->conns--;
    if (sc->queued) {
        e->queued -= sc->queued;
        if (!e->queued)
            srv->queued_addrs--;
    }
    peer__conn_set_group(&sc->c, NULL); /* e may be freed below */
    if (sc->in_hs) {
        sc->in_hs = 0;
        e->hs--;
        srv->st.handshaking--;
    }
    if (e->conns == 0) {
        ipent **pp = ip_slot(srv, e->key);
        *pp = e->next;
        free(e);
    }
}

static void conn_maybe_free(sconn *sc)
{
    if (!sc->handle_closed || sc->inflight > 0 || sc->pin)
        return;
    peer_rpc_server *srv = sc->srv;
    srv->freed = 1;
    if (sc->prev)
        sc->prev->next = sc->next;
    else
        srv->conns = sc->next;
    if (sc->next)
        sc->next->prev = sc->prev;
    free_spare_reqs(sc);
    peer__conn_free(&sc->c);
    free(sc);
    srv->st.conns_open--;
    resume_waiters(srv);
    maybe_finish_close(srv);
}

static void conn_closed(uv_handle_t *h)
{
    sconn *sc = h->data;
    sc->handle_closed = 1;
    conn_maybe_free(sc);
}

static void close_conn(sconn *sc)
{
    detach(sc);
    peer__conn_close(&sc->c, conn_closed);
}

/* Which of a and b to close first: handshaking, then idle, then the one
 * quiet longest. */
static int evict_before(const sconn *a, const sconn *b)
{
    if (a->in_hs != b->in_hs)
        return a->in_hs;
    if ((a->inflight == 0) != (b->inflight == 0))
        return a->inflight == 0;
    return a->last_active < b->last_active;
}

/* Makes room for newcomer nc (already counted) by closing a connection of
 * the address holding the most (connections, or handshakes when hs), if it
 * holds more than nc's address. Returns 1 if one was closed. */
static int evict_for(peer_rpc_server *srv, sconn *nc, int hs)
{
    int mine = hs ? nc->ip->hs : nc->ip->conns;
    sconn *best = NULL;
    int most = 0;
    for (sconn *o = srv->conns; o; o = o->next) {
        if (o == nc || !o->ip || (hs && !o->in_hs))
            continue;
        int n = hs ? o->ip->hs : o->ip->conns;
        if (n > most || (n == most && evict_before(o, best))) {
            best = o;
            most = n;
        }
    }
    if (!best || most <= mine)
        return 0;
    srv->st.evicted++;
    close_conn(best);
    return 1;
}

/* Answers a frame the handler never sees. */
static void server_error(sconn *sc, uint64_t id, peer_method method, int code, const char *text)
{
    peer_rpc_request *r = take_req(sc);
    if (!r) {
        close_conn(sc);
        return;
    }
    r->id = id;
    r->method = method;
    peer_rpc_respond_error(r, code, text);
}

static void on_established(peer__conn *c)
{
    sconn *sc = (sconn *)c;
    sc->last_active = uv_now(sc->srv->loop);
    if (sc->in_hs) {
        sc->in_hs = 0;
        sc->ip->hs--;
        sc->srv->st.handshaking--;
    }
}

static void on_message(peer__conn *c, const peer_msg *m, int rc)
{
    sconn *sc = (sconn *)c;
    peer_rpc_server *srv = sc->srv;
    sc->last_active = uv_now(srv->loop);
    if (rc || m->kind != PEER_KIND_REQUEST) {
        srv->st.bad_frames++;
        /* Decoded past a limit (too many tensors or dimensions, a shape
         * larger than the frame limit, meta over 64 KiB): EMSGSIZE; any
         * other garbage: EBADMSG. The id is unknown when decoding failed. */
        server_error(sc, rc ? 0 : m->id, rc ? 0 : m->method, rc == -EMSGSIZE ? EMSGSIZE : EBADMSG,
                     rc == -EMSGSIZE ? "frame exceeds a limit" : rc ? "malformed frame" : "expected a request");
        /* A junk record must not pin a frame-sized buffer on an idle
         * connection. */
        if (c->rec.cap > PEER__STAGE_LEN)
            peer__buf_free(&c->rec);
    } else {
        peer_rpc_request *r = take_req(sc);
        if (!r) {
            close_conn(sc);
            return;
        }
        /* The request keeps the record; the connection gets the request's
         * old buffer, so steady traffic allocates nothing. */
        peer__buf t = r->in;
        r->in = c->rec;
        c->rec = t;
        r->id = m->id;
        r->method = m->method;
        r->msg = *m;
        r->held = c->rec_len;
        srv->held += r->held;
        srv->st.requests++;
        srv->cfg.handler(r, &r->msg, srv->cfg.arg);
    }
    if (!c->closing && !can_read(sc)) {
        peer__conn_pause(c);
        srv->paused_hint = 1;
    }
    resume_waiters(srv);
}

static void on_error(peer__conn *c, int err)
{
    sconn *sc = (sconn *)c;
    if (!peer_channel_established(c->ch) && err != -ECONNRESET)
        sc->srv->st.handshakes_failed++;
    if (err == -EMSGSIZE && peer_channel_established(c->ch)) {
        /* Say why before hanging up; the unread record makes the stream
         * unusable, so the connection closes once this is written. */
        sc->srv->st.oversize_frames++;
        sc->close_after_write = 1;
        server_error(sc, 0, 0, EMSGSIZE, "frame exceeds the server's limit");
        resume_waiters(sc->srv);
        return;
    }
    close_conn(sc);
    resume_waiters(sc->srv);
}

static const peer__conn_ops server_ops = {on_established, on_message, on_error};

static void on_connection(uv_stream_t *l, int status)
{
    peer_rpc_server *srv = l->data;
    if (status < 0 || srv->closing)
        return;
    sconn *sc = calloc(1, sizeof *sc);
    if (!sc)
        return;
    peer_channel_config cc = {.self = &srv->self, .swarm_key = srv->have_swarm ? srv->swarm : NULL,
                              .max_record = srv->cfg.max_frame, .plaintext = srv->cfg.plaintext,
                              .no_aes = srv->cfg.no_aes};
    if (peer__conn_init(&sc->c, srv->loop, &cc, 0, &server_ops, srv, srv->cfg.max_frame) != 0) {
        free(sc);
        return;
    }
    peer__conn_set_budget(&sc->c, &srv->budget);
    sc->srv = srv;
    sc->next = srv->conns;
    if (srv->conns)
        srv->conns->prev = sc;
    srv->conns = sc;
    srv->st.conns_accepted++;
    srv->st.conns_open++;
    uint64_t now = uv_now(srv->loop);
    sc->hs_deadline = now + srv->cfg.handshake_timeout_ms;
    sc->last_active = now;
    if (uv_accept(l, (uv_stream_t *)&sc->c.tcp) != 0) {
        close_conn(sc);
        return;
    }
    /* Count the newcomer against its address before deciding, so that the
     * comparisons below see what each address would hold. */
    struct sockaddr_storage ss;
    int len = sizeof ss;
    memset(&ss, 0, sizeof ss);
    uv_tcp_getpeername(&sc->c.tcp, (struct sockaddr *)&ss, &len);
    uint8_t key[16];
    peer__addr_key((const struct sockaddr *)&ss, key);
    ipent **pp = ip_slot(srv, key);
    if (!*pp) {
        if (!(*pp = calloc(1, sizeof **pp))) {
            close_conn(sc);
            return;
        }
        memcpy((*pp)->key, key, 16);
    }
    sc->ip = *pp;
    peer__conn_set_group(&sc->c, &sc->ip->charged);
    sc->ip->conns++;
    sc->ip->hs++;
    sc->in_hs = 1;
    srv->live++;
    srv->st.handshaking++;
    if (sc->ip->conns > srv->cfg.max_conns_per_ip) {
        srv->st.refused_per_ip++;
        close_conn(sc);
        return;
    }
    if (srv->live > srv->cfg.max_conns && !evict_for(srv, sc, 0)) {
        srv->st.refused_full++;
        close_conn(sc);
        return;
    }
    if (srv->st.handshaking > (uint64_t)srv->cfg.max_handshakes && !evict_for(srv, sc, 1)) {
        srv->st.refused_handshakes++;
        close_conn(sc);
        return;
    }
    if (peer__conn_start(&sc->c) != 0)
        close_conn(sc);
}

/* Bytes the kernel holds for sc that libuv has not read yet (0 when
 * unknown). */
static int bytes_pending(sconn *sc)
{
    uv_os_fd_t fd;
    int n = 0;
    if (uv_fileno((uv_handle_t *)&sc->c.tcp, &fd) != 0 || ioctl(fd, FIONREAD, &n) != 0)
        return 0;
    return n;
}

/* How long the record being received may take since its length prefix:
 * record_timeout_ms, plus a quarter second per MiB (slow links). */
static uint64_t record_deadline(const peer_rpc_server *srv, const sconn *sc)
{
    return sc->c.rec_start + srv->cfg.record_timeout_ms + ((uint64_t)(sc->c.rec_len >> 20) * 250);
}

static void sweep_cb(uv_timer_t *t)
{
    peer_rpc_server *srv = t->data;
    uint64_t now = uv_now(srv->loop);
    sconn *top = NULL; /* the connection holding the most unwritten reply bytes */
    for (sconn *sc = srv->conns; sc; sc = sc->next) {
        if (sc->c.closing)
            continue;
        if (!peer_channel_established(sc->c.ch)) {
            if (now >= sc->hs_deadline) {
                srv->st.handshakes_failed++;
                srv->st.closed_hs_timeout++;
                close_conn(sc);
            }
            continue;
        }
        /* Replies that make no write progress (the client stopped
         * reading) for drain_timeout_ms close the connection, however often
         * it finishes one: progress is the write queue shrinking. */
        if (sc->queued > 0) {
            size_t wq = uv_stream_get_write_queue_size((uv_stream_t *)&sc->c.tcp);
            if (wq < sc->wq_seen)
                sc->drain_since = now;
            sc->wq_seen = wq;
            if (now - sc->drain_since >= srv->cfg.drain_timeout_ms) {
                srv->st.closed_drain++;
                close_conn(sc);
                continue;
            }
            if (!top || sc->queued > top->queued)
                top = sc;
        }
        /* A record must arrive whole soon after its length prefix: a
         * half-sent record holds its charge in max_incomplete_bytes. */
        if (sc->c.in_rec && now >= record_deadline(srv, sc)) {
            srv->st.closed_record_timeout++;
            close_conn(sc);
            continue;
        }
        uint64_t quiet = now - sc->last_active;
        /* Idle: nothing asked (a record begun long ago included), or
         * replies that stopped draining because the client stopped reading.
         * A request the handler is still working on keeps it open. A
         * request already in the socket buffer (timers run before the poll
         * for I/O) keeps it open until it is read. */
        if ((sc->inflight == 0 || sc->queued > 0) && quiet >= srv->cfg.idle_timeout_ms &&
            !(sc->c.reading && bytes_pending(sc) > 0)) {
            srv->st.closed_idle++;
            close_conn(sc);
            continue;
        }
        /* An idle connection gives back its buffers; traffic reallocates
         * them once. */
        if (sc->inflight == 0 && !sc->c.in_rec && quiet >= 1000) {
            peer__buf_free(&sc->c.rec);
            free_spare_reqs(sc);
        }
    }
    /* At the total bound, the largest holder that has not drained for a
     * quarter of drain_timeout_ms goes first. */
    if (top && !top->c.closing && srv->queued >= srv->cfg.max_queued_total &&
        now - top->drain_since >= srv->cfg.drain_timeout_ms / 4) {
        srv->st.closed_drain++;
        close_conn(top);
    }
    resume_waiters(srv);
}

/* ---- server ---- */

peer_rpc_server *peer_rpc_server_create(uv_loop_t *loop, const peer_rpc_server_config *cfg)
{
    if (!loop || !cfg || !cfg->self || !cfg->handler)
        return NULL;
    peer_rpc_server *srv = calloc(1, sizeof *srv);
    if (!srv)
        return NULL;
    srv->loop = loop;
    srv->loop_thread = pthread_self();
    srv->cfg = *cfg;
    srv->self = *cfg->self;
    srv->cfg.self = &srv->self;
    if (cfg->swarm_key) {
        memcpy(srv->swarm, cfg->swarm_key, 32);
        srv->have_swarm = 1;
    }
    srv->cfg.swarm_key = NULL;
    if (!srv->cfg.max_frame)
        srv->cfg.max_frame = PEER_CHANNEL_MAX_RECORD;
    if (srv->cfg.max_inflight <= 0)
        srv->cfg.max_inflight = 64;
    if (!srv->cfg.max_held_bytes)
        srv->cfg.max_held_bytes = (size_t)1 << 30;
    if (srv->cfg.max_conns <= 0)
        srv->cfg.max_conns = 1024;
    if (!srv->cfg.handshake_timeout_ms)
        srv->cfg.handshake_timeout_ms = 5000;
    if (srv->cfg.max_conns_per_ip <= 0)
        srv->cfg.max_conns_per_ip = 64;
    if (srv->cfg.max_handshakes <= 0)
        srv->cfg.max_handshakes = 64;
    if (!srv->cfg.idle_timeout_ms)
        srv->cfg.idle_timeout_ms = 120000;
    if (!srv->cfg.max_incomplete_bytes)
        srv->cfg.max_incomplete_bytes = (size_t)256 << 20;
    if (!srv->cfg.max_queued_bytes)
        srv->cfg.max_queued_bytes = (size_t)16 << 20;
    if (!srv->cfg.max_queued_total)
        srv->cfg.max_queued_total = (size_t)256 << 20;
    if (!srv->cfg.max_incomplete_per_ip)
        srv->cfg.max_incomplete_per_ip = srv->cfg.max_incomplete_bytes / 4;
    if (!srv->cfg.record_timeout_ms)
        srv->cfg.record_timeout_ms = 30000;
    if (!srv->cfg.drain_timeout_ms)
        srv->cfg.drain_timeout_ms = 30000;
    srv->budget.cap = srv->cfg.max_incomplete_bytes;
    srv->budget.group_cap = srv->cfg.max_incomplete_per_ip;
    srv->retain_cap = srv->cfg.max_held_bytes / 4;
    randombytes_buf(srv->ip_salt, sizeof srv->ip_salt);
    /* Replies to a client that reset the connection must not kill us, even
     * before the first connection sets up the channel code. */
    peer__ignore_sigpipe();
    srv->port = -1;
    if (pthread_mutex_init(&srv->mu, NULL) != 0) {
        free(srv);
        return NULL;
    }
    return srv;
}

int peer_rpc_server_listen(peer_rpc_server *srv, const struct sockaddr *addr)
{
    if (!srv || !addr || srv->listening || srv->closing)
        return -EINVAL;
    int rc = uv_tcp_init(srv->loop, &srv->listener);
    if (rc)
        return rc;
    srv->listener.data = srv;
    srv->listening = 1;
    srv->handles_open = 2;
    uv_timer_init(srv->loop, &srv->sweep);
    srv->sweep.data = srv;
    rc = peer__wake_init(&srv->wake, srv->loop, wake_cb, srv);
    if (srv->wake.fd >= 0) { /* the handle exists, even if it failed to start */
        srv->wake_ok = 1;
        srv->handles_open = 3;
    }
    if (rc)
        return rc; /* the caller closes the server */
    if ((rc = uv_tcp_bind(&srv->listener, addr, 0)) != 0 ||
        (rc = uv_listen((uv_stream_t *)&srv->listener, 128, on_connection)) != 0)
        return rc; /* the caller closes the server */
    struct sockaddr_storage ss;
    int len = sizeof ss;
    if (uv_tcp_getsockname(&srv->listener, (struct sockaddr *)&ss, &len) == 0) {
        if (ss.ss_family == AF_INET)
            srv->port = ntohs(((struct sockaddr_in *)&ss)->sin_port);
        else if (ss.ss_family == AF_INET6)
            srv->port = ntohs(((struct sockaddr_in6 *)&ss)->sin6_port);
    }
    /* Timeouts fire within a quarter of the shortest one (at most 250 ms). */
    uint64_t tick = srv->cfg.handshake_timeout_ms;
    uint64_t others[3] = {srv->cfg.idle_timeout_ms, srv->cfg.record_timeout_ms,
                          srv->cfg.drain_timeout_ms};
    for (int i = 0; i < 3; i++)
        tick = others[i] < tick ? others[i] : tick;
    tick = tick / 4 < 10 ? 10 : tick / 4 > 250 ? 250 : tick / 4;
    uv_timer_start(&srv->sweep, sweep_cb, tick, tick);
    return 0;
}

int peer_rpc_server_port(const peer_rpc_server *srv)
{
    return srv ? srv->port : -1;
}

void peer_rpc_server_get_stats(const peer_rpc_server *srv, peer_rpc_server_stats *out)
{
    *out = srv->st;
    out->record_waits = srv->budget.waits;
    out->incomplete_bytes = srv->budget.used;
    out->incomplete_bytes_max = srv->budget.high;
    out->queued_bytes = srv->queued;
}

static void handle_closed(uv_handle_t *h)
{
    peer_rpc_server *srv = h->data;
    srv->handles_open--;
    maybe_finish_close(srv);
}

static void wake_closed(peer__wake *w)
{
    peer_rpc_server *srv = w->data;
    srv->handles_open--;
    maybe_finish_close(srv);
}

static void maybe_finish_close(peer_rpc_server *srv)
{
    if (!srv->closing)
        return;
    /* The wake-up closes last: workers may still answer until every
     * connection (and so every request) is gone. */
    if (srv->wake_ok && srv->handles_open == 1 && !srv->conns &&
        !peer__wake_is_closing(&srv->wake)) {
        peer__wake_close(&srv->wake, wake_closed);
        return;
    }
    if (srv->handles_open == 0 && srv->close_cb) {
        void (*cb)(peer_rpc_server *, void *) = srv->close_cb;
        srv->close_cb = NULL;
        cb(srv, srv->close_arg);
    }
}

void peer_rpc_server_stop(peer_rpc_server *srv, void (*close_cb)(peer_rpc_server *, void *),
                           void *arg)
{
    if (!srv || srv->closing)
        return;
    srv->closing = 1;
    srv->close_cb = close_cb;
    srv->close_arg = arg;
    if (!srv->listening) {
        if (close_cb)
            close_cb(srv, arg);
        srv->close_cb = NULL;
        return;
    }
    uv_close((uv_handle_t *)&srv->listener, handle_closed);
    uv_timer_stop(&srv->sweep);
    uv_close((uv_handle_t *)&srv->sweep, handle_closed);
    for (sconn *sc = srv->conns, *next; sc; sc = next) {
        next = sc->next; /* close_conn never frees synchronously */
        close_conn(sc);
    }
}

void peer_rpc_server_destroy(peer_rpc_server **p)
{
    if (!p || !*p)
        return;
    pthread_mutex_destroy(&(*p)->mu);
    free(*p);
    *p = NULL;
}
