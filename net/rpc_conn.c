/* net/rpc_conn.c: handshake, record reassembly and sends on one TCP
 * connection (see rpc_conn.h). */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>

#include "net/rpc_conn.h"

/* A record tail this large is read straight into c->rec instead of being
 * copied out of the staging buffer. */
#define DIRECT_MIN 16384

int peer__buf_reserve(peer__buf *b, size_t n)
{
    if (b->cap >= n)
        return 0;
    /* Round up so repeated, slightly varying shapes settle on one size. */
    size_t cap = n < 4096 ? 4096 : n + n / 8;
    void *p = malloc(cap);
    if (!p)
        return -ENOMEM;
    free(b->p);
    b->p = p;
    b->cap = cap;
    return 0;
}

void peer__buf_free(peer__buf *b)
{
    free(b->p);
    b->p = NULL;
    b->cap = 0;
}

/* Gives back this connection's share of the record budget (its record is
 * complete or will never be). */
static void budget_leave(peer__conn *c)
{
    peer__budget *b = c->budget;
    if (!b)
        return;
    b->used -= c->charged;
    if (c->group)
        *c->group -= c->charged;
    c->charged = 0;
    if (c->budget_wait) {
        c->budget_wait = 0;
        b->waiters--;
    }
}

static void fail(peer__conn *c, int err)
{
    if (c->failed)
        return;
    c->failed = 1;
    budget_leave(c);
    if (c->reading) {
        uv_read_stop((uv_stream_t *)&c->tcp);
        c->reading = 0;
    }
    if (!c->closing)
        c->ops->on_error(c, err);
}

static void hs_write_cb(uv_write_t *wr, int status)
{
    (void)wr;
    (void)status; /* a failed write shows up as a read error or EOF */
}

static int hs_send(peer__conn *c, int slot, size_t len)
{
    uv_buf_t b = uv_buf_init((char *)c->hs_out[slot], (unsigned)len);
    return uv_write(&c->hs_wr[slot], (uv_stream_t *)&c->tcp, &b, 1, hs_write_cb);
}

/* Decrypt a large record in place while the rest of it arrives. */
#define OPEN_PIECE (256u << 10)

static void open_some(peer__conn *c)
{
    if (!peer_channel_streams(c->ch))
        return;
    size_t tag = peer_channel_tag_len(c->ch);
    size_t have = c->rec_have < c->rec_len - tag ? c->rec_have : c->rec_len - tag;
    size_t avail = have - PEER_CHANNEL_HDR_LEN;
    if (!c->opening) {
        if (avail < OPEN_PIECE)
            return;
        if (peer_channel_open_begin(c->ch, c->rec.p, c->rec_len) != 0) {
            fail(c, -EBADMSG);
            return;
        }
        c->opening = 1;
    }
    size_t done = peer_channel_open_done(c->ch);
    if (avail - done >= OPEN_PIECE && peer_channel_open_update(c->ch, avail - done) != 0)
        fail(c, -EBADMSG);
}

static void deliver(peer__conn *c)
{
    uint8_t *plain;
    size_t plain_len;
    c->in_rec = 0;
    c->hdr_have = 0;
    budget_leave(c);
    int rc;
    if (c->opening) {
        c->opening = 0;
        rc = peer_channel_open_final(c->ch, &plain, &plain_len);
    } else {
        rc = peer_channel_open(c->ch, c->rec.p, c->rec_len, &plain, &plain_len);
    }
    if (rc) {
        fail(c, rc);
        return;
    }
    peer_msg m;
    rc = peer_wire_decode(plain, plain_len, &c->lim, &m);
    c->ops->on_message(c, rc ? NULL : &m, rc);
}

/* The length prefix is in c->hdr: charge the record to the budget and
 * make room for it. Returns 0 (receiving it, or already delivered when
 * empty), 1 (no room in the budget: paused until resumed) or -1 (failed). */
static int begin_record(peer__conn *c)
{
    int rc = peer_channel_record_len(c->ch, c->hdr, &c->rec_len);
    if (rc) {
        fail(c, rc);
        return -1;
    }
    peer__budget *b = c->budget;
    if (b) {
        /* Always admit a record when nothing is charged: one frame larger
         * than the cap must not wedge the server. */
        int full = b->used && (b->used >= b->cap || c->rec_len > b->cap - b->used);
        /* A group holding nothing may begin one record; beyond that it
         * holds at most group_cap. */
        if (!full && c->group && b->group_cap && *c->group &&
            (*c->group >= b->group_cap || c->rec_len > b->group_cap - *c->group))
            full = 1;
        if (full) {
            if (!c->budget_wait) {
                c->budget_wait = 1;
                b->waiters++;
                b->waits++;
            }
            c->paused = 1;
            return 1;
        }
        if (c->budget_wait) {
            c->budget_wait = 0;
            b->waiters--;
        }
        b->used += c->rec_len;
        c->charged = c->rec_len;
        if (c->group)
            *c->group += c->rec_len;
        if (b->used > b->high)
            b->high = b->used;
    }
    if (peer__buf_reserve(&c->rec, c->rec_len) != 0) {
        fail(c, -ENOMEM);
        return -1;
    }
    memcpy(c->rec.p, c->hdr, PEER_CHANNEL_HDR_LEN);
    c->rec_have = PEER_CHANNEL_HDR_LEN;
    c->in_rec = 1;
    c->rec_start = uv_now(c->tcp.loop);
    if (c->rec_have == c->rec_len) /* plaintext mode, empty record */
        deliver(c);
    return 0;
}

/* Consumes staged bytes until they run out, the owner pauses, or we fail. */
static void process(peer__conn *c)
{
    while (!c->paused && !c->failed && !c->closing && c->stage_off < c->stage_len) {
        const uint8_t *p = c->stage + c->stage_off;
        size_t n = c->stage_len - c->stage_off, take;
        size_t want = peer_channel_hs_expect(c->ch);
        if (want) {
            take = want - c->hs_have < n ? want - c->hs_have : n;
            memcpy(c->hs_in + c->hs_have, p, take);
            c->hs_have += take;
            c->stage_off += take;
            if (c->hs_have < want)
                continue;
            c->hs_have = 0;
            size_t out_len;
            /* msg2 goes in slot 0 (responder), msg3 in slot 1 (initiator). */
            int slot = want == PEER_CHANNEL_HS2_LEN ? 1 : 0;
            int rc = peer_channel_hs_input(c->ch, c->hs_in, c->hs_out[slot], &out_len);
            if (rc < 0) {
                fail(c, rc);
                return;
            }
            if (out_len && hs_send(c, slot, out_len) != 0) {
                fail(c, -EPIPE);
                return;
            }
            if (rc == 1)
                c->ops->on_established(c);
            continue;
        }
        if (!peer_channel_established(c->ch)) {
            fail(c, -EPROTO); /* bytes before we sent msg1: not our protocol */
            return;
        }
        if (!c->in_rec) {
            take = PEER_CHANNEL_HDR_LEN - c->hdr_have < n ? PEER_CHANNEL_HDR_LEN - c->hdr_have : n;
            memcpy(c->hdr + c->hdr_have, p, take);
            c->hdr_have += take;
            c->stage_off += take;
            if (c->hdr_have < PEER_CHANNEL_HDR_LEN)
                continue;
            if (begin_record(c) != 0)
                return;
            continue;
        }
        take = c->rec_len - c->rec_have < n ? c->rec_len - c->rec_have : n;
        memcpy(c->rec.p + c->rec_have, p, take);
        c->rec_have += take;
        c->stage_off += take;
        if (c->rec_have == c->rec_len)
            deliver(c);
    }
}

static void alloc_cb(uv_handle_t *h, size_t suggested, uv_buf_t *buf)
{
    (void)suggested;
    peer__conn *c = h->data;
    if (c->in_rec && c->rec_len - c->rec_have >= DIRECT_MIN) {
        c->alloc_direct = 1;
        *buf = uv_buf_init((char *)c->rec.p + c->rec_have, (unsigned)(c->rec_len - c->rec_have));
        return;
    }
    c->alloc_direct = 0;
    /* We only read when the stage is fully consumed (see resume). */
    c->stage_off = c->stage_len = 0;
    *buf = uv_buf_init((char *)c->stage, PEER__STAGE_LEN);
}

static void read_cb(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf)
{
    (void)buf;
    peer__conn *c = s->data;
    if (nread == 0)
        return;
    if (nread < 0) {
        fail(c, nread == UV_EOF ? -ECONNRESET : (int)nread);
        return;
    }
    if (c->alloc_direct) {
        c->rec_have += (size_t)nread;
        if (c->rec_have == c->rec_len)
            deliver(c);
        else
            open_some(c);
        return;
    }
    c->stage_len = (size_t)nread;
    c->stage_off = 0;
    process(c);
    if (c->paused && c->reading) {
        uv_read_stop(s);
        c->reading = 0;
    }
}

/* A peer that resets the connection must cost an error on that connection,
 * not the process: libuv writes with write(2), which raises SIGPIPE on a
 * reset socket, and its default action kills. Ignore it (once, and only if
 * nobody installed a handler). */
static void ignore_sigpipe_once(void)
{
    struct sigaction sa;
    if (sigaction(SIGPIPE, NULL, &sa) == 0 && sa.sa_handler == SIG_DFL && !(sa.sa_flags & SA_SIGINFO)) {
        sa.sa_handler = SIG_IGN;
        sigemptyset(&sa.sa_mask);
        sa.sa_flags = 0;
        sigaction(SIGPIPE, &sa, NULL);
    }
}

void peer__ignore_sigpipe(void)
{
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, ignore_sigpipe_once);
}

void peer__addr_key(const struct sockaddr *sa, uint8_t key[16])
{
    memset(key, 0, 16);
    if (sa->sa_family == AF_INET) {
        key[10] = key[11] = 0xff;
        memcpy(key + 12, &((const struct sockaddr_in *)sa)->sin_addr, 4);
    } else if (sa->sa_family == AF_INET6) {
        const uint8_t *a = ((const struct sockaddr_in6 *)sa)->sin6_addr.s6_addr;
        static const uint8_t mapped[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
        memcpy(key, a, memcmp(a, mapped, 12) == 0 ? 16 : 8);
    }
}

int peer__conn_init(peer__conn *c, uv_loop_t *loop, const peer_channel_config *cc, int initiator,
                    const peer__conn_ops *ops, void *owner, size_t max_frame)
{
    peer__ignore_sigpipe();
    memset(c, 0, sizeof *c);
    c->ops = ops;
    c->owner = owner;
    c->lim.max_frame = max_frame;
    c->stage = malloc(PEER__STAGE_LEN);
    c->ch = peer_channel_create(cc, initiator);
    if (!c->stage || !c->ch) {
        free(c->stage);
        peer_channel_destroy(&c->ch);
        return -ENOMEM;
    }
    int rc = uv_tcp_init(loop, &c->tcp);
    if (rc) {
        free(c->stage);
        peer_channel_destroy(&c->ch);
        return rc;
    }
    c->tcp.data = c;
    return 0;
}

void peer__conn_set_budget(peer__conn *c, peer__budget *b)
{
    c->budget = b;
}

void peer__conn_set_group(peer__conn *c, size_t *group)
{
    if (c->group)
        *c->group -= c->charged;
    c->group = group;
    if (group)
        *group += c->charged;
}

int peer__conn_start(peer__conn *c)
{
    uv_tcp_nodelay(&c->tcp, 1);
    int rc = uv_read_start((uv_stream_t *)&c->tcp, alloc_cb, read_cb);
    if (rc)
        return rc;
    c->reading = 1;
    int n = peer_channel_hello(c->ch, c->hs_out[0]);
    if (n > 0)
        return hs_send(c, 0, (size_t)n);
    return 0;
}

void peer__conn_pause(peer__conn *c)
{
    c->paused = 1;
    /* read_cb stops the handle after process() returns; outside a read
     * callback we stop it here. */
    if (c->reading) {
        uv_read_stop((uv_stream_t *)&c->tcp);
        c->reading = 0;
    }
}

void peer__conn_resume(peer__conn *c)
{
    if (!c->paused || c->failed || c->closing)
        return;
    c->paused = 0;
    /* A record that waited for the budget: its prefix is already read. */
    if (c->budget_wait && begin_record(c) != 0)
        return;
    process(c);
    if (!c->paused && !c->failed && !c->closing && !c->reading) {
        if (uv_read_start((uv_stream_t *)&c->tcp, alloc_cb, read_cb) == 0)
            c->reading = 1;
        else
            fail(c, -EPIPE);
    }
}

/* Sealing works in pieces of this size; after each, the piece goes to the
 * socket at once (when the cipher streams), so the peer reads and decrypts
 * while we encrypt the rest, and the kernel copies the piece while it is
 * still in this core's L2 (1 MiB here). 256 KiB pieces, written one by one,
 * streamed 16 MiB records about 10 % faster than 1 MiB pieces written in
 * quarters (docs/benchmarks.md, "Tensor RPC, against PyTorch RPC"). */
#define SEND_PIECE (256u << 10)

typedef struct sender {
    peer__conn *c;
    uint8_t *rec;
    size_t ready, sent, total;
    int stream;
} sender;

static void flush(sender *s)
{
    /* Keep the last byte back: the final uv_write is never empty, and it
     * is the one that reports errors and completion. */
    size_t upto = s->ready < s->total - 1 ? s->ready : s->total - 1;
    if (!s->stream || upto <= s->sent)
        return;
    uv_buf_t b = uv_buf_init((char *)s->rec + s->sent, (unsigned)(upto - s->sent));
    int n = uv_try_write((uv_stream_t *)&s->c->tcp, &b, 1);
    if (n > 0)
        s->sent += (size_t)n;
    else if (n != UV_EAGAIN)
        s->stream = 0; /* leave it to uv_write to report */
}

static int seal_piece(sender *s, uint8_t *dst, const uint8_t *src, size_t n)
{
    while (n) {
        size_t k = n < SEND_PIECE ? n : SEND_PIECE;
        int rc = peer_channel_seal_update(s->c->ch, dst, src, k);
        if (rc)
            return rc;
        dst += k;
        src += k;
        n -= k;
        s->ready += k;
        if (s->ready - s->sent >= SEND_PIECE)
            flush(s);
    }
    return 0;
}

int peer__conn_send(peer__conn *c, uint8_t *rec, size_t head_len, const peer_msg *m,
                    size_t plain_len, uv_write_t *wr, uv_write_cb cb)
{
    /* A connection whose reading failed may still send (the server explains
     * an oversize frame before it hangs up); a dead channel refuses to seal. */
    if (c->closing)
        return -ENOTCONN;
    int rc = peer_channel_seal_begin(c->ch, rec, plain_len);
    if (rc)
        return rc;
    sender s = {c, rec, PEER_CHANNEL_HDR_LEN, 0,
                PEER_CHANNEL_HDR_LEN + plain_len + peer_channel_tag_len(c->ch),
                peer_channel_streams(c->ch)};
    uint8_t *p = rec + PEER_CHANNEL_HDR_LEN;
    rc = seal_piece(&s, p, p, head_len);
    size_t off = head_len;
    static const uint8_t zeros[4];
    for (int i = 0; m && rc == 0 && i < m->n_tensors; i++) {
        size_t nb = m->t[i].nbytes, pad = peer_wire_pad4(nb); /* each tensor ends 4-aligned */
        rc = seal_piece(&s, p + off, m->t[i].data, nb);
        off += nb;
        if (rc == 0 && pad) {
            rc = seal_piece(&s, p + off, zeros, pad);
            off += pad;
        }
    }
    if (rc == 0 && off != plain_len)
        rc = -EINVAL;
    long n = rc ? rc : peer_channel_seal_final(c->ch);
    if (n < 0) {
        /* Part of the record may be on the wire: the stream is unusable. */
        fail(c, -EIO);
        return (int)n;
    }
    uv_buf_t b = uv_buf_init((char *)rec + s.sent, (unsigned)((size_t)n - s.sent));
    if (uv_write(wr, (uv_stream_t *)&c->tcp, &b, 1, cb) != 0) {
        fail(c, -EPIPE);
        return -EPIPE;
    }
    return 0;
}

void peer__conn_close(peer__conn *c, uv_close_cb close_cb)
{
    if (c->closing)
        return;
    c->closing = 1;
    if (c->reading) {
        uv_read_stop((uv_stream_t *)&c->tcp);
        c->reading = 0;
    }
    uv_close((uv_handle_t *)&c->tcp, close_cb);
}

void peer__conn_free(peer__conn *c)
{
    budget_leave(c);
    peer_channel_destroy(&c->ch);
    peer__buf_free(&c->rec);
    free(c->stage);
    c->stage = NULL;
}
