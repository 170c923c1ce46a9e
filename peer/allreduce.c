#include "peer/allreduce.h"

#include <errno.h>
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include <sodium.h>

#include "dht/addr.h"
#include "expert/block.h"
#include "net/rpc_client.h"
#include "net/tensorfmt.h"
#include "net/wire.h"

#define RETRY_MS 10

/* ---- the meta of PEER_METHOD_AVG (both sides) ---- */

#define AVG_REQUEST_META 48
#define AVG_REPLY_META 24

typedef struct avg_request {
    uint64_t round;
    uint8_t digest[PEER_AVG_DIGEST_LEN];
    uint64_t kind;                 /* 0 base, 1 reduced */
    uint64_t off, count;
} avg_request;

typedef struct avg_reply {
    uint64_t round;
    double weight;
    uint64_t nflat;
} avg_reply;

static void avg_request_encode(uint8_t meta[AVG_REQUEST_META], const avg_request *r)
{
    peer_put_le64(meta, r->round);
    memcpy(meta + 8, r->digest, PEER_AVG_DIGEST_LEN);
    peer_put_le64(meta + 24, r->kind);
    peer_put_le64(meta + 32, r->off);
    peer_put_le64(meta + 40, r->count);
}

/* Returns 0, or -EBADMSG when meta is not a request's. */
static int avg_request_decode(avg_request *r, const void *meta, size_t len)
{
    const uint8_t *m = meta;
    if (!m || len != AVG_REQUEST_META)
        return -EBADMSG;
    r->round = peer_get_le64(m);
    memcpy(r->digest, m + 8, PEER_AVG_DIGEST_LEN);
    r->kind = peer_get_le64(m + 24);
    r->off = peer_get_le64(m + 32);
    r->count = peer_get_le64(m + 40);
    return 0;
}

static void avg_reply_encode(uint8_t meta[AVG_REPLY_META], const avg_reply *r)
{
    uint64_t wbits;
    memcpy(&wbits, &r->weight, sizeof wbits);
    peer_put_le64(meta, r->round);
    peer_put_le64(meta + 8, wbits);
    peer_put_le64(meta + 16, r->nflat);
}

/* Returns 0, or -EBADMSG when meta is not a reply's. */
static int avg_reply_decode(avg_reply *r, const void *meta, size_t len)
{
    const uint8_t *m = meta;
    if (!m || len != AVG_REPLY_META)
        return -EBADMSG;
    uint64_t wbits = peer_get_le64(m + 8);
    r->round = peer_get_le64(m);
    memcpy(&r->weight, &wbits, sizeof r->weight);
    r->nflat = peer_get_le64(m + 16);
    return 0;
}

/* ---- the slices on the wire (both sides) ----
 *
 * The one place that chooses how a slice of a round's vector travels in
 * the avg reply: one (1, count) tensor in the round's format (allreduce.h,
 * "How slices travel"). f32 slices are the floats themselves; any other
 * format is encoded once per part (part_encode) and served as byte ranges
 * of that encoding (slice_encode), which is what encoding the slice alone
 * would give as long as a q8 slice starts at a multiple of the block from
 * its part's start (the askers' chunks do: PEER_AVG_MAX_COUNT is a
 * multiple of every block). */

/* q8's block for h (the default for 0), 0 for the other formats. */
static int fmt_block_of(const peer_avg_method *h)
{
    return h->fmt == PEER_FMT_Q8 ? (h->fmt_block ? h->fmt_block : PEER_FMT_Q8_BLOCK) : 0;
}

/* Bytes of n values in (fmt, block); 0 for n = 0. */
static size_t part_bytes(int fmt, int block, size_t n)
{
    return peer_tensorfmt_size((peer_fmt)fmt, block, n);
}

/* Encodes src[0..n) into dst (part_bytes(fmt, block, n) bytes): rounding
 * to nearest, or, with residual (n floats), with error feedback
 * (peer_tensorfmt_encode_ef: sends src + residual, leaves what it lost in
 * residual). Returns 0 or -EINVAL. */
static int part_encode(int fmt, int block, const float *src, size_t n, float *residual, uint8_t *dst)
{
    if (n == 0)
        return 0;
    size_t cap = part_bytes(fmt, block, n);
    long k = residual ? peer_tensorfmt_encode_ef((peer_fmt)fmt, block, src, n, residual, dst, cap)
                      : peer_tensorfmt_encode((peer_fmt)fmt, block, src, n, dst, cap);
    return k >= 0 && (size_t)k == cap ? 0 : -EINVAL;
}

/* Fills t with the slice [rel, rel + count) of a part: its floats (f32)
 * or its encoding enc (borrowed until the reply is sent). Returns 0, or
 * -EINVAL when a q8 slice does not start on a block. */
static int slice_encode(peer_tensor *t, int fmt, int block, const float *vals, const uint8_t *enc, size_t rel,
                        uint64_t count)
{
    uint64_t shape[2] = {1, count};
    if (fmt == PEER_FMT_F32)
        return peer_tensor_f32(t, (float *)(uintptr_t)(vals + rel), 2, shape);
    if (fmt == PEER_FMT_Q8 && rel % (size_t)block != 0)
        return -EINVAL;
    return peer_tensor_encoded(t, (peer_dtype)fmt, block, enc + part_bytes(fmt, block, rel), 2, shape);
}

/* Decodes a received slice of count values, which must be a (1, count)
 * tensor in the format asked, into dst. Returns 0, or -EBADMSG when t is
 * not such a slice or does not decode (a negative q8 scale). */
static int slice_decode(const peer_tensor *t, int fmt, int block, size_t count, float *dst)
{
    if ((int)t->dtype != fmt || t->block != (fmt == PEER_FMT_Q8 ? block : 0) || t->ndim != 2 || t->shape[0] != 1 ||
        t->shape[1] != count)
        return -EBADMSG;
    return peer_tensor_to_f32(t, dst, count) == 0 ? 0 : -EBADMSG;
}

/* ---- the serving side ---- */

/* One hosted block's rounds (loop thread only). */
typedef struct srv_block {
    uint64_t mark;             /* backward rows at the last applied round */
    /* Diloco mode's anchor (the parameters after the last applied round),
     * outer momentum and error-feedback residual of lossy slices are the
     * block's (expert_block_outer_lock): checkpoints and state downloads
     * carry them. */
    struct {
        int active;            /* base frozen */
        uint64_t round;
        uint8_t digest[PEER_AVG_DIGEST_LEN];
        peer_avg_method how;   /* fmt_block normalized (fmt_block_of) */
        double weight;
        uint64_t mark;         /* backward rows when the base was frozen */
        float *base;           /* the round's vector at its start (nflat floats); in diloco
                                  mode followed by the parameters it came from (nflat more)
                                  and the residual the round leaves once applied (nflat more) */
        size_t cap;            /* floats allocated at base */
        size_t nflat;
        int n, me;             /* members, and our index */
        size_t part_off, part_len;
        uint8_t *enc;          /* a lossy format: the base encoded part by part, or NULL */
        size_t enc_cap;
        size_t enc_off[PEER_ALLREDUCE_MAX_MEMBERS + 1]; /* part j's bytes at enc + enc_off[j] */
        float *reduced;        /* our part, averaged (as every member decodes it) */
        uint8_t *reduced_enc;  /* a lossy format: its encoding, served */
        int reduced_state;     /* 0 pending, 1 ready, < 0 failed (negative errno) */
    } cur;
    /* The previous round's reduced part, still served to members that
     * finish later than we do (we may begin the next round meanwhile). */
    struct {
        uint64_t round;
        uint8_t digest[PEER_AVG_DIGEST_LEN];
        double weight;
        int fmt, fmt_block;
        size_t nflat, part_off, part_len;
        float *reduced;        /* NULL: none */
        uint8_t *reduced_enc;  /* its encoding (a lossy format) */
    } prev;
    /* Averaging tensor bytes (peer_allreduce_server_bytes), and those sent
     * for each of the last two rounds served. */
    uint64_t bytes_received, bytes_sent;
    struct {
        uint64_t round, bytes;
    } sent_round[2];
} srv_block;

struct peer_allreduce_server {
    peer_service *svc;
    peer_allreduce_hint_fn hint;
    void *hint_arg;
    srv_block b[PEER_SERVICE_MAX_BLOCKS];
};

static void count_sent(srv_block *b, uint64_t round, size_t nbytes)
{
    b->bytes_sent += nbytes;
    int s = b->sent_round[0].round == round   ? 0
            : b->sent_round[1].round == round ? 1
            : b->sent_round[0].round < b->sent_round[1].round ? 0 : 1;
    if (b->sent_round[s].round != round) {
        b->sent_round[s].round = round;
        b->sent_round[s].bytes = 0;
    }
    b->sent_round[s].bytes += nbytes;
}

/* Answers with the slice [rel, rel + count) of a part (slice_encode), or
 * EINVAL when it cannot be served in the round's format. */
static void avg_respond(srv_block *b, peer_rpc_request *req, uint64_t round, double weight, size_t nflat, int fmt,
                        int block, const float *vals, const uint8_t *enc, size_t rel, uint64_t count)
{
    uint8_t meta[AVG_REPLY_META];
    avg_reply_encode(meta, &(avg_reply){round, weight, nflat});
    peer_msg reply;
    peer_msg_init(&reply, PEER_KIND_REPLY, PEER_METHOD_AVG, 0);
    reply.meta = meta;
    reply.meta_len = sizeof meta;
    reply.n_tensors = 1;
    if (slice_encode(&reply.t[0], fmt, block, vals, enc, rel, count) != 0) {
        peer_rpc_respond_error(req, EINVAL, "avg slice does not start on a q8 block of its part");
        return;
    }
    count_sent(b, round, reply.t[0].nbytes);
    peer_rpc_respond(req, &reply);
}

/* Whether msg asks for the slices in (fmt, block); else answers EINVAL. */
static int format_ok(peer_rpc_request *req, const peer_msg *msg, int fmt, int block)
{
    if ((int)msg->reply_dtype == fmt && msg->reply_block == (fmt == PEER_FMT_Q8 ? block : 0))
        return 1;
    char why[128], spec[16] = "";
    if (fmt == PEER_FMT_Q8)
        snprintf(spec, sizeof spec, ":%d", block);
    const char *asked = peer_tensorfmt_name((peer_fmt)msg->reply_dtype);
    snprintf(why, sizeof why, "this averaging round's slices travel as %s%s, not %s",
             peer_tensorfmt_name((peer_fmt)fmt), spec, asked ? asked : "?");
    peer_rpc_respond_error(req, EINVAL, why);
    return 0;
}

/* A slower member of our last round fetching our reduced part (whether or
 * not we have begun another round since). Returns 0 when it answered. */
static int serve_prev(srv_block *b, peer_rpc_request *req, const peer_msg *msg, const avg_request *q)
{
    if (q->kind != 1 || !b->prev.reduced || b->prev.round != q->round ||
        memcmp(b->prev.digest, q->digest, PEER_AVG_DIGEST_LEN))
        return -ENOENT;
    if (!format_ok(req, msg, b->prev.fmt, b->prev.fmt_block))
        return 0;
    if (q->off < b->prev.part_off || q->count < 1 || q->count > PEER_AVG_MAX_COUNT ||
        q->off > b->prev.part_off + b->prev.part_len || q->count > b->prev.part_off + b->prev.part_len - q->off) {
        peer_rpc_respond_error(req, EINVAL, "avg range outside this member's part");
        return 0;
    }
    avg_respond(b, req, q->round, b->prev.weight, b->prev.nflat, b->prev.fmt, b->prev.fmt_block, b->prev.reduced,
                b->prev.reduced_enc, q->off - b->prev.part_off, q->count);
    return 0;
}

/* The avg method's handler (peer_service_set_handler): slices of block
 * i's current round, or of its previous round's reduced part. */
static int serve_avg(void *ctx, peer_rpc_request *req, const peer_msg *msg, int i)
{
    peer_allreduce_server *srv = ctx;
    if (i < 0)
        return -ENOENT;
    srv_block *b = &srv->b[i];
    avg_request q;
    if (avg_request_decode(&q, msg->meta, msg->meta_len) != 0) {
        peer_rpc_respond_error(req, EINVAL, "avg takes meta = round, digest, kind, offset, count (48 bytes)");
        return 0;
    }
    if (serve_prev(b, req, msg, &q) == 0)
        return 0;
    if (!b->cur.active && b->prev.reduced && q.round <= b->prev.round) {
        peer_rpc_respond_error(req, ESTALE, "another averaging round");
        return 0;
    }
    if (!b->cur.active || b->cur.round < q.round) {
        /* A member counts us in a round we have not begun: our view of the
         * group may lack it. */
        if (srv->hint)
            srv->hint(srv->hint_arg, i, q.round);
        peer_rpc_respond_error(req, EAGAIN, "that averaging round has not begun here yet");
        return 0;
    }
    if (b->cur.round != q.round) {
        peer_rpc_respond_error(req, ESTALE, "another averaging round");
        return 0;
    }
    if (memcmp(b->cur.digest, q.digest, PEER_AVG_DIGEST_LEN) != 0) {
        /* The same round, another group: the members' views of who is in
         * it differ. Both sides look again; the asker waits meanwhile. */
        if (srv->hint)
            srv->hint(srv->hint_arg, i, q.round);
        peer_rpc_respond_error(req, EAGAIN, "another group for this averaging round; looking again");
        return 0;
    }
    const int fmt = b->cur.how.fmt, fb = b->cur.how.fmt_block;
    if (!format_ok(req, msg, fmt, fb))
        return 0;
    if (q.kind > 1 || q.count < 1 || q.count > PEER_AVG_MAX_COUNT || q.off > b->cur.nflat ||
        q.count > b->cur.nflat - q.off) {
        peer_rpc_respond_error(req, EINVAL, "avg range outside the state");
        return 0;
    }
    if (q.kind == 0) {
        /* A slice of our base: within one part when it is encoded. */
        if (fmt == PEER_FMT_F32) {
            avg_respond(b, req, q.round, b->cur.weight, b->cur.nflat, fmt, fb, b->cur.base, NULL, q.off, q.count);
            return 0;
        }
        for (int j = 0; j < b->cur.n; j++) {
            size_t off, len;
            peer_avg_part(b->cur.nflat, b->cur.n, j, &off, &len);
            if (q.off >= off && q.off + q.count <= off + len) {
                avg_respond(b, req, q.round, b->cur.weight, b->cur.nflat, fmt, fb, NULL,
                            b->cur.enc + b->cur.enc_off[j], q.off - off, q.count);
                return 0;
            }
        }
        peer_rpc_respond_error(req, EINVAL, "avg range across two members' parts");
        return 0;
    }
    /* A slice of our reduced part. */
    if (b->cur.reduced_state < 0) {
        peer_rpc_respond_error(req, ECANCELED, "the averaging round failed here");
        return 0;
    }
    if (q.off < b->cur.part_off || q.off + q.count > b->cur.part_off + b->cur.part_len) {
        peer_rpc_respond_error(req, EINVAL, "avg range outside this member's part");
        return 0;
    }
    if (b->cur.reduced_state == 0) {
        peer_rpc_respond_error(req, EAGAIN, "this member's part is not reduced yet");
        return 0;
    }
    avg_respond(b, req, q.round, b->cur.weight, b->cur.nflat, fmt, fb, b->cur.reduced, b->cur.reduced_enc,
                q.off - b->cur.part_off, q.count);
    return 0;
}

static void server_free(void *ctx)
{
    peer_allreduce_server *srv = ctx;
    for (int i = 0; i < PEER_SERVICE_MAX_BLOCKS; i++) {
        free(srv->b[i].cur.base);
        free(srv->b[i].cur.enc);
        free(srv->b[i].cur.reduced);
        free(srv->b[i].cur.reduced_enc);
        free(srv->b[i].prev.reduced);
        free(srv->b[i].prev.reduced_enc);
    }
    free(srv);
}

peer_allreduce_server *peer_allreduce_server_create(peer_service *svc)
{
    peer_allreduce_server *srv = svc ? calloc(1, sizeof *srv) : NULL;
    if (!srv)
        return NULL;
    srv->svc = svc;
    if (peer_service_set_handler(svc, PEER_METHOD_AVG, serve_avg, srv, server_free) != 0) {
        free(srv);
        return NULL;
    }
    return srv;
}

void peer_allreduce_server_set_hint(peer_allreduce_server *srv, peer_allreduce_hint_fn fn, void *arg)
{
    if (!srv)
        return;
    srv->hint = fn;
    srv->hint_arg = arg;
}

static srv_block *srv_block_of(peer_allreduce_server *srv, int i)
{
    return srv && i >= 0 && i < peer_service_n_blocks(srv->svc) ? &srv->b[i] : NULL;
}

void peer_allreduce_server_bytes(const peer_allreduce_server *srv, int i, uint64_t *received, uint64_t *sent)
{
    const srv_block *b = srv_block_of((peer_allreduce_server *)(uintptr_t)srv, i);
    if (received)
        *received = b ? b->bytes_received : 0;
    if (sent)
        *sent = b ? b->bytes_sent : 0;
}

uint64_t peer_allreduce_server_round_sent(const peer_allreduce_server *srv, int i, uint64_t round)
{
    const srv_block *b = srv_block_of((peer_allreduce_server *)(uintptr_t)srv, i);
    for (int s = 0; b && s < 2; s++)
        if (b->sent_round[s].round == round)
            return b->sent_round[s].bytes;
    return 0;
}

/* Moves a finished round's reduced part to prev (slower members may still
 * fetch it) and frees the rest. */
static void retire(srv_block *b)
{
    if (b->cur.active && b->cur.reduced_state == 1 && b->cur.reduced) {
        free(b->prev.reduced);
        free(b->prev.reduced_enc);
        b->prev.round = b->cur.round;
        memcpy(b->prev.digest, b->cur.digest, PEER_AVG_DIGEST_LEN);
        b->prev.weight = b->cur.weight;
        b->prev.fmt = b->cur.how.fmt;
        b->prev.fmt_block = b->cur.how.fmt_block;
        b->prev.nflat = b->cur.nflat;
        b->prev.part_off = b->cur.part_off;
        b->prev.part_len = b->cur.part_len;
        b->prev.reduced = b->cur.reduced;
        b->prev.reduced_enc = b->cur.reduced_enc;
        b->cur.reduced = NULL;
        b->cur.reduced_enc = NULL;
    }
    free(b->cur.base);
    free(b->cur.enc);
    free(b->cur.reduced);
    free(b->cur.reduced_enc);
    memset(&b->cur, 0, sizeof b->cur);
}

/* Diloco: block blk's anchor := params (np floats), momentum and residual
 * := 0, and the next round's samples count from `rows`. */
static int set_anchor(srv_block *b, expert_block *blk, const float *params, size_t np, uint64_t rows)
{
    struct expert_outer o;
    int rc = expert_block_outer_lock(blk, 1, &o);
    if (rc != 0)
        return rc;
    if (o.n != np) {
        expert_block_outer_unlock(blk);
        return -EINVAL;
    }
    memcpy(o.anchor, params, np * sizeof(float));
    memset(o.momentum, 0, np * sizeof(float));
    memset(o.residual, 0, np * sizeof(float));
    expert_block_outer_unlock(blk);
    b->mark = rows;
    return 0;
}

/* Copies block i's current parameters (np floats) into out (host memory,
 * from whichever device the block is on). Returns 0 or the backend's error. */
static int copy_params(peer_allreduce_server *srv, int i, float *out, size_t np)
{
    expert_block *blk = peer_service_block(srv->svc, i);
    if (expert_block_nparams(blk) != np)
        return -EINVAL;
    return expert_block_read_params(blk, out, NULL);
}

static uint64_t backward_rows(peer_allreduce_server *srv, int i, peer_block_info *info)
{
    peer_service_block_info(srv->svc, i, info);
    return info->stats.rows[PEER_TASK_BACKWARD];
}

int peer_allreduce_server_anchor(peer_allreduce_server *srv, int i)
{
    srv_block *b = srv_block_of(srv, i);
    if (!b)
        return -EINVAL;
    expert_block *blk = peer_service_block(srv->svc, i);
    peer_block_info info;
    uint64_t rows = backward_rows(srv, i, &info);
    /* An outer state the block restored or downloaded with its weights
     * is the one its replicas share: it stays. */
    struct expert_outer o;
    if (expert_block_outer_lock(blk, 0, &o) == 0) {
        expert_block_outer_unlock(blk);
        b->mark = rows;
        return 0;
    }
    size_t np = expert_block_nparams(blk);
    float *tmp = malloc((np ? np : 1) * sizeof(float));
    if (!tmp)
        return -ENOMEM;
    int rc = copy_params(srv, i, tmp, np);
    if (rc == 0)
        rc = set_anchor(b, blk, tmp, np, rows);
    free(tmp);
    return rc;
}

static int method_ok(const peer_avg_method *h)
{
    if (peer_tensorfmt_check((peer_fmt)h->fmt, fmt_block_of(h)) != 0 ||
        (h->fmt != PEER_FMT_Q8 && h->fmt_block != 0))
        return 0;
    if (h->mode == PEER_AVG_MEAN)
        return 1;
    return h->mode == PEER_AVG_DILOCO && h->outer_lr > 0 && isfinite(h->outer_lr) && h->outer_momentum >= 0 &&
           h->outer_momentum < 1;
}

/* A lossy format: encodes the frozen base part by part into b->cur.enc
 * (allreduce.h, "How slices travel"). In diloco mode first makes the base
 * v = delta + residual, encoding the others' parts with error feedback
 * into the residual the round leaves (base + 2 nflat; 0 over our part, which
 * never travels). Returns 0, -ENOMEM or -EINVAL. */
static int encode_base(srv_block *b, expert_block *blk, int diloco)
{
    const int fmt = b->cur.how.fmt, fb = b->cur.how.fmt_block, n = b->cur.n;
    const size_t nflat = b->cur.nflat;
    size_t total = 0;
    for (int j = 0; j < n; j++) {
        size_t off, len;
        peer_avg_part(nflat, n, j, &off, &len);
        b->cur.enc_off[j] = total;
        total += part_bytes(fmt, fb, len);
    }
    b->cur.enc_off[n] = total;
    if (!b->cur.enc || b->cur.enc_cap < total) {
        free(b->cur.enc);
        b->cur.enc_cap = 0;
        if (!(b->cur.enc = malloc(total ? total : 1)))
            return -ENOMEM;
        b->cur.enc_cap = total;
    }
    float *base = b->cur.base, *rnext = diloco ? b->cur.base + 2 * nflat : NULL;
    struct expert_outer o;
    if (diloco) {
        int rc = expert_block_outer_lock(blk, 0, &o);
        if (rc != 0)
            return rc == -ENOENT ? -EINVAL : rc;
        if (o.n != nflat) {
            expert_block_outer_unlock(blk);
            return -EINVAL;
        }
        memcpy(rnext, o.residual, nflat * sizeof(float));
    }
    for (int j = 0; j < n; j++) {
        size_t off, len;
        peer_avg_part(nflat, n, j, &off, &len);
        if (j == b->cur.me)
            continue;
        if (part_encode(fmt, fb, base + off, len, rnext ? rnext + off : NULL, b->cur.enc + b->cur.enc_off[j]) != 0) {
            if (diloco)
                expert_block_outer_unlock(blk);
            return -EINVAL;
        }
    }
    if (diloco) {
        /* What encode_ef sent is decode(v) with v = delta + residual: make
         * that our base too (our own part enters our reduce exact, so its
         * residual is spent). */
        for (size_t k = 0; k < nflat; k++)
            base[k] += o.residual[k];
        expert_block_outer_unlock(blk);
        memset(rnext + b->cur.part_off, 0, b->cur.part_len * sizeof(float));
    }
    return part_encode(fmt, fb, base + b->cur.part_off, b->cur.part_len, NULL, b->cur.enc + b->cur.enc_off[b->cur.me]);
}

/* DiLoCo's base for block i: anchor - params, then the params themselves
 * (for the apply). A block without an anchor takes one now (at `rows`
 * samples): its delta is 0, so it gives nothing this round. Returns 0 or
 * -errno. */
static int diloco_base(peer_allreduce_server *srv, srv_block *b, int i, expert_block *blk, size_t np,
                       uint64_t rows)
{
    float *delta = b->cur.base, *theta = b->cur.base + np;
    int rc = copy_params(srv, i, theta, np);
    if (rc != 0)
        return rc;
    struct expert_outer o;
    rc = expert_block_outer_lock(blk, 0, &o);
    if (rc == -ENOENT) {
        rc = set_anchor(b, blk, theta, np, rows);
        if (rc == 0)
            rc = expert_block_outer_lock(blk, 0, &o);
        b->cur.weight = 0;
    }
    if (rc == 0 && o.n != np) {
        expert_block_outer_unlock(blk);
        rc = -EINVAL;
    }
    if (rc != 0)
        return rc;
    for (size_t k = 0; k < np; k++)
        delta[k] = o.anchor[k] - theta[k];
    expert_block_outer_unlock(blk);
    return 0;
}

int peer_allreduce_server_begin(peer_allreduce_server *srv, int i, uint64_t round,
                                const uint8_t digest[PEER_AVG_DIGEST_LEN], int n, int me,
                                const peer_avg_method *how, double *weight_out, size_t *nflat_out)
{
    srv_block *b = srv_block_of(srv, i);
    peer_avg_method h = how ? *how : (peer_avg_method){.mode = PEER_AVG_MEAN};
    if (!b || !digest || n < 1 || n > PEER_ALLREDUCE_MAX_MEMBERS || me < 0 || me >= n || !method_ok(&h))
        return -EINVAL;
    h.fmt_block = fmt_block_of(&h);
    const int lossy = h.fmt != PEER_FMT_F32;
    expert_block *blk = peer_service_block(srv->svc, i);
    int diloco = h.mode == PEER_AVG_DILOCO;
    size_t np = expert_block_nparams(blk);
    size_t nflat = diloco ? np : expert_block_flat_len(blk), cap = diloco ? 3 * np : nflat;
    if (b->cur.active && b->cur.reduced_state == 1)
        retire(b); /* a finished round: keep its part for slower members */
    if (!b->cur.base || b->cur.cap != cap) {
        free(b->cur.base);
        b->cur.cap = 0;
        b->cur.nflat = 0;
        b->cur.active = 0;
        if (!(b->cur.base = malloc((cap ? cap : 1) * sizeof(float))))
            return -ENOMEM;
        b->cur.cap = cap;
    }
    size_t off, len;
    peer_avg_part(nflat, n, me, &off, &len);
    free(b->cur.reduced);
    free(b->cur.reduced_enc);
    b->cur.reduced_enc = NULL;
    size_t rbytes = lossy ? part_bytes(h.fmt, h.fmt_block, len) : 0;
    if (!(b->cur.reduced = malloc((len ? len : 1) * sizeof(float))) ||
        (lossy && !(b->cur.reduced_enc = malloc(rbytes ? rbytes : 1)))) {
        b->cur.active = 0;
        return -ENOMEM;
    }
    /* The row count first: samples trained after it count for the next
     * round, and their updates survive this one (flat_apply). */
    peer_block_info info;
    uint64_t rows = backward_rows(srv, i, &info);
    b->cur.mark = rows;
    /* Initial weights carry no information: such a member takes the
     * group's average and gives nothing to it. */
    b->cur.weight = info.has_state ? (double)(rows >= b->mark ? rows - b->mark : 0) + 1.0 : 0.0;
    int rc = diloco ? diloco_base(srv, b, i, blk, np, rows) : expert_block_flat_export(blk, b->cur.base);
    if (rc != 0) {
        b->cur.active = 0;
        return rc;
    }
    b->cur.how = h;
    b->cur.nflat = nflat;
    b->cur.n = n;
    b->cur.me = me;
    b->cur.round = round;
    memcpy(b->cur.digest, digest, PEER_AVG_DIGEST_LEN);
    b->cur.part_off = off;
    b->cur.part_len = len;
    if (lossy) {
        rc = encode_base(b, blk, diloco);
        if (rc != 0) {
            b->cur.active = 0;
            return rc;
        }
    }
    b->cur.reduced_state = 0;
    b->cur.active = 1;
    if (weight_out)
        *weight_out = b->cur.weight;
    if (nflat_out)
        *nflat_out = nflat;
    return 0;
}

const float *peer_allreduce_server_base(peer_allreduce_server *srv, int i)
{
    srv_block *b = srv_block_of(srv, i);
    return b && b->cur.active ? b->cur.base : NULL;
}

int peer_allreduce_server_reduced(peer_allreduce_server *srv, int i, const float *part)
{
    srv_block *b = srv_block_of(srv, i);
    if (!b || !part || !b->cur.active)
        return -EINVAL;
    const int fmt = b->cur.how.fmt, fb = b->cur.how.fmt_block;
    size_t len = b->cur.part_len;
    if (fmt == PEER_FMT_F32) {
        memcpy(b->cur.reduced, part, len * sizeof(float));
    } else if (len > 0) {
        /* Encoded once, rounding to nearest; what we apply ourselves is
         * what the others decode. */
        if (part_encode(fmt, fb, part, len, NULL, b->cur.reduced_enc) != 0 ||
            peer_tensorfmt_decode((peer_fmt)fmt, fb, b->cur.reduced_enc, part_bytes(fmt, fb, len), len,
                                  b->cur.reduced) != 0)
            return -EINVAL;
        for (size_t k = 0; k < len; k++)
            if (!isfinite(b->cur.reduced[k]))
                return -ERANGE;
    }
    b->cur.reduced_state = 1;
    return 0;
}

const float *peer_allreduce_server_reduced_part(peer_allreduce_server *srv, int i)
{
    srv_block *b = srv_block_of(srv, i);
    return b && b->cur.active && b->cur.reduced_state == 1 ? b->cur.reduced : NULL;
}

void peer_allreduce_server_fail(peer_allreduce_server *srv, int i, int err)
{
    srv_block *b = srv_block_of(srv, i);
    if (b && b->cur.active)
        b->cur.reduced_state = err < 0 ? err : -ECANCELED;
}

/* Diloco: the outer Nesterov step from the mean pseudo-gradient dbar
 * (allreduce.h), applied on top of the updates made during the round;
 * anchor and momentum advance only when it is applied. */
static int apply_outer(srv_block *b, expert_block *blk, const float *dbar, double *dist_before,
                       double *dist_after)
{
    size_t np = b->cur.nflat;
    const double mu = b->cur.how.outer_momentum, lr = b->cur.how.outer_lr;
    float *buf = malloc((np ? 2 * np : 1) * sizeof(float));
    if (!buf)
        return -ENOMEM;
    /* The outer state is held through the apply, so a checkpoint sees the
     * weights and the anchor of the same round (the lock comes before the
     * block's gradient lock, which the apply takes). */
    struct expert_outer o;
    int rc = expert_block_outer_lock(blk, 0, &o);
    if (rc != 0 || o.n != np) {
        if (rc == 0)
            expert_block_outer_unlock(blk);
        free(buf);
        return -EINVAL;
    }
    float *theta_new = buf + np;
    for (size_t k = 0; k < np; k++) {
        double m = mu * o.momentum[k] + dbar[k];
        buf[k] = (float)m;
        theta_new[k] = (float)(o.anchor[k] - lr * (dbar[k] + mu * m));
    }
    /* Parameters only: params += theta_new - (params at the round's start). */
    rc = expert_block_flat_apply(blk, theta_new, b->cur.base + np, 0, dist_before, dist_after);
    if (rc == 0) {
        memcpy(o.momentum, buf, np * sizeof(float));
        memcpy(o.anchor, theta_new, np * sizeof(float));
        /* Error feedback: what this round's slices lost goes out next. */
        if (b->cur.how.fmt != PEER_FMT_F32)
            memcpy(o.residual, b->cur.base + 2 * np, np * sizeof(float));
    }
    expert_block_outer_unlock(blk);
    free(buf);
    return rc;
}

int peer_allreduce_server_apply(peer_allreduce_server *srv, int i, const float *avg, int with_optim,
                                double *dist_before, double *dist_after)
{
    srv_block *b = srv_block_of(srv, i);
    if (!b || !avg || !b->cur.active)
        return -EINVAL;
    expert_block *blk = peer_service_block(srv->svc, i);
    int rc;
    if (b->cur.how.mode == PEER_AVG_DILOCO)
        rc = apply_outer(b, blk, avg, dist_before, dist_after);
    else
        rc = expert_block_flat_apply(blk, avg, b->cur.base, with_optim, dist_before, dist_after);
    if (rc == 0) {
        b->mark = b->cur.mark;
        peer_service_note_state(srv->svc, i);
    }
    return rc;
}

void peer_allreduce_server_release(peer_allreduce_server *srv, int i)
{
    srv_block *b = srv_block_of(srv, i);
    if (b)
        retire(b);
}

/* ---- the round as a client ---- */

typedef struct ar_link {
    struct peer_allreduce *ar;
    int j;
    peer_rpc_client *cl;
    uv_timer_t retry;
    int timer_open;
    size_t off, len, pos;          /* the slice this phase pulls from member j */
    double weight;                 /* member j's weight (phase 1) */
    float *part;                   /* member j's values of our part (phase 1) */
    int done;
} ar_link;

struct peer_allreduce {
    uv_loop_t *loop;
    peer_allreduce_server *srv;
    int bi;
    char block[PEER_WIRE_MAX_BLOCK + 1];
    uint64_t round;
    uint8_t digest[PEER_AVG_DIGEST_LEN];
    int n, me, with_optim;
    int fmt, fmt_block;            /* the slices' format (fmt_block normalized) */
    size_t nflat, part_off, part_len;
    int nseg;                      /* segments of the vector: 3 (params, m, v) or 1 */
    float *acc;                    /* our part's (robust) average */
    double wself;
    float *avg;                    /* the whole result (phase 2) */
    ar_link links[PEER_ALLREDUCE_MAX_MEMBERS];
    int phase, remaining;
    uv_timer_t deadline;
    int handles;                   /* open clients and timers */
    int finished, status;
    peer_allreduce_result res;
    uint64_t t0;
    peer_allreduce_cb cb;
    void *arg;
};

void peer_allreduce_digest(uint8_t out[PEER_AVG_DIGEST_LEN], uint64_t round,
                           const uint8_t (*ids)[DHT_ID_LEN], const uint8_t *tags, int n, int mode)
{
    peer_allreduce_digest_fmt(out, round, ids, tags, n, mode, PEER_FMT_F32, 0);
}

void peer_allreduce_digest_fmt(uint8_t out[PEER_AVG_DIGEST_LEN], uint64_t round,
                               const uint8_t (*ids)[DHT_ID_LEN], const uint8_t *tags, int n, int mode, int fmt,
                               int block)
{
    crypto_generichash_state st;
    uint8_t r[8];
    peer_put_le64(r, round);
    crypto_generichash_init(&st, NULL, 0, PEER_AVG_DIGEST_LEN);
    crypto_generichash_update(&st, (const uint8_t *)"starling.avg.v1", 15);
    crypto_generichash_update(&st, r, sizeof r);
    for (int i = 0; i < n; i++) {
        crypto_generichash_update(&st, ids[i], DHT_ID_LEN);
        crypto_generichash_update(&st, tags ? &tags[i] : (const uint8_t *)"", 1);
    }
    if (fmt != PEER_FMT_F32) {
        /* The mode byte always, then the format (and q8's block). */
        if (fmt == PEER_FMT_Q8 && !block)
            block = PEER_FMT_Q8_BLOCK;
        uint8_t t[4] = {(uint8_t)mode, (uint8_t)fmt, (uint8_t)(block & 0xff), (uint8_t)((unsigned)block >> 8)};
        crypto_generichash_update(&st, t, fmt == PEER_FMT_Q8 ? 4 : 2);
    } else if (mode != PEER_AVG_MEAN) {
        uint8_t m = (uint8_t)mode;
        crypto_generichash_update(&st, &m, 1);
    }
    crypto_generichash_final(&st, out, PEER_AVG_DIGEST_LEN);
}

/* ---- the robust reduce (see allreduce.h for the rule and its guarantee) ---- */

/* The median of v[0..m), m >= 1 (v is reordered). */
static double median_of(double *v, int m)
{
    for (int i = 1; i < m; i++) {
        double t = v[i];
        int k = i;
        for (; k > 0 && v[k - 1] > t; k--)
            v[k] = v[k - 1];
        v[k] = t;
    }
    return m % 2 ? v[m / 2] : 0.5 * (v[m / 2 - 1] + v[m / 2]);
}

/* The passes below are plain loops over a part (millions of floats); peer/
 * builds at -O2, where GCC vectorises only the simplest loops, so they ask
 * for -O3 -fno-trapping-math, as expert/ is built (without them the
 * compare-exchanges below stay branches: 6-8x slower for groups of 5-8;
 * tests/test_peer_robust.c --bench). */
#if defined(__GNUC__) && !defined(__clang__)
#define VECTORISE __attribute__((optimize("O3", "no-trapping-math")))
#else
#define VECTORISE
#endif

/* Plain comparisons (the values are finite): they vectorise, fminf need not. */
#define MINF(a, b) ((a) < (b) ? (a) : (b))
#define MAXF(a, b) ((a) < (b) ? (b) : (a))

/* lo[u], hi[u] = the smaller, the larger of the two (64 lanes). */
VECTORISE static inline void compare_exchange(float *restrict lo, float *restrict hi)
{
    float t[64];
    for (int u = 0; u < 64; u++)
        t[u] = MINF(lo[u], hi[u]);
    for (int u = 0; u < 64; u++)
        hi[u] = MAXF(lo[u], hi[u]);
    memcpy(lo, t, sizeof t);
}

/* c[k] = the coordinate-wise median of the m rows xs over [0, len). */
VECTORISE static void median_rows(const float *const *xs, int m, size_t len, float *c)
{
    if (m == 3) {
        const float *a = xs[0], *b = xs[1], *d = xs[2];
        for (size_t k = 0; k < len; k++) {
            float lo = MINF(a[k], b[k]), hi = MAXF(a[k], b[k]);
            c[k] = MINF(MAXF(d[k], lo), hi);
        }
        return;
    }
    if (m == 4) {
        /* The two middle values are the larger of the pairs' minima and
         * the smaller of their maxima. */
        const float *a = xs[0], *b = xs[1], *d = xs[2], *e = xs[3];
        for (size_t k = 0; k < len; k++) {
            float lo = MAXF(MINF(a[k], b[k]), MINF(d[k], e[k]));
            float hi = MINF(MAXF(a[k], b[k]), MAXF(d[k], e[k]));
            c[k] = 0.5f * lo + 0.5f * hi;
        }
        return;
    }
    /* More members: an odd-even transposition sort of each coordinate's
     * values, 64 coordinates at a time so that every compare-exchange is
     * one branch-free pass over a row (it vectorises; a sort per
     * coordinate does not). */
    enum { B = 64 };
    float v[PEER_ALLREDUCE_MAX_MEMBERS][B];
    for (size_t k0 = 0; k0 < len; k0 += B) {
        size_t nb = len - k0 < B ? len - k0 : B;
        for (int i = 0; i < m; i++) {
            memcpy(v[i], xs[i] + k0, nb * sizeof(float));
            for (size_t u = nb; u < B; u++)
                v[i][u] = 0;
        }
        for (int r = 0; r < m; r++)
            for (int i = r & 1; i + 1 < m; i += 2)
                compare_exchange(v[i], v[i + 1]);
        for (size_t u = 0; u < nb; u++)
            c[k0 + u] = m % 2 ? v[m / 2][u] : 0.5f * v[m / 2 - 1][u] + 0.5f * v[m / 2][u];
    }
}

/* The L2 distance between x and c (len floats): float partial sums over
 * short runs (vectorised), added up in double. */
VECTORISE static double dist_to(const float *x, const float *c, size_t len)
{
    double s = 0;
    for (size_t k0 = 0; k0 < len; k0 += 1024) {
        size_t k1 = k0 + 1024 < len ? k0 + 1024 : len;
        float acc[8] = {0};
        size_t k = k0;
        for (; k + 8 <= k1; k += 8)
            for (int u = 0; u < 8; u++) {
                float e = x[k + u] - c[k + u];
                acc[u] += e * e;
            }
        for (; k < k1; k++) {
            float e = x[k] - c[k];
            acc[0] += e * e;
        }
        for (int u = 0; u < 8; u++)
            s += acc[u];
    }
    return sqrt(s);
}

/* One segment slice: out[0..len) from the m rows xs with weights ws. */
VECTORISE static void robust_slice(const float *const *xs, const double *ws, const int *idx, int m, size_t len,
                                   float *out, peer_robust_stats *st)
{
    double wsum = 0, scale[PEER_ALLREDUCE_MAX_MEMBERS], d[PEER_ALLREDUCE_MAX_MEMBERS],
           ds[PEER_ALLREDUCE_MAX_MEMBERS];
    for (int i = 0; i < m; i++) {
        wsum += ws[i];
        scale[i] = 1.0;
    }
    /* out = (1 - A) c + sum a_i x_i, a_i = w_i s_i / W, A = sum a_i: that
     * is c + sum a_i (x_i - c) computed in place, one pass per member. */
    double amass = 1.0;
    if (m >= 3) {
        /* Two members cannot outvote each other: the mean is all we can do. */
        median_rows(xs, m, len, out);
        for (int i = 0; i < m; i++)
            d[i] = ds[i] = dist_to(xs[i], out, len);
        double med = median_of(ds, m), tau = PEER_ALLREDUCE_CLIP_FACTOR * med;
        amass = 0;
        for (int i = 0; i < m; i++) {
            double r = med > 0 ? d[i] / med : d[i] > 0 ? INFINITY : 0;
            if (r > st->max_ratio)
                st->max_ratio = r;
            if (d[i] > tau) {
                scale[i] = tau / d[i];
                st->clipped |= 1u << idx[i];
            }
            amass += ws[i] * scale[i] / wsum;
        }
    }
    if (amass < 1.0 - 1e-12) {
        float keep = (float)(1.0 - amass);
        for (size_t k = 0; k < len; k++)
            out[k] *= keep;
    } else {
        /* Nobody clipped: exactly the weighted mean, c drops out. */
        memset(out, 0, len * sizeof(float));
    }
    for (int i = 0; i < m; i++) {
        float a = (float)(ws[i] * scale[i] / wsum);
        const float *x = xs[i];
        for (size_t k = 0; k < len; k++)
            out[k] += a * x[k];
    }
}

VECTORISE static int all_finite(const float *x, size_t len)
{
    int bad = 0;
    for (size_t k = 0; k < len; k++)
        bad |= !(fabsf(x[k]) <= FLT_MAX);
    return !bad;
}

int peer_allreduce_robust_mean(const float *const *x, const double *w, int n, size_t len, size_t off,
                               size_t seg, float *out, peer_robust_stats *st)
{
    peer_robust_stats dummy;
    if (!st)
        st = &dummy;
    memset(st, 0, sizeof *st);
    if (!x || !w || !out || n < 1 || n > PEER_ALLREDUCE_MAX_MEMBERS)
        return -EINVAL;
    const float *xs[PEER_ALLREDUCE_MAX_MEMBERS];
    double ws[PEER_ALLREDUCE_MAX_MEMBERS];
    int idx[PEER_ALLREDUCE_MAX_MEMBERS], m = 0, positive = 0;
    for (int j = 0; j < n; j++) {
        if (!(w[j] >= 0) || !isfinite(w[j]))
            return -EINVAL;
        if (!x[j])
            continue;
        /* Checked whatever the weight: a weight-0 member's NaN times 0 is
         * NaN too, and the log should name it either way. */
        if (!all_finite(x[j], len)) {
            st->dropped |= 1u << j;
            positive += w[j] > 0;
            continue;
        }
        if (!(w[j] > 0))
            continue; /* initial weights: neither counted nor voting */
        positive++;
        xs[m] = x[j];
        ws[m] = w[j];
        idx[m] = j;
        m++;
    }
    if (m == 0)
        return positive ? -ERANGE : -ENODATA;
    size_t k = 0;
    while (k < len) {
        size_t end = len;
        if (seg > 0) {
            size_t next = ((off + k) / seg + 1) * seg; /* the next segment boundary */
            if (next - off < end)
                end = next - off;
        }
        const float *ys[PEER_ALLREDUCE_MAX_MEMBERS];
        for (int i = 0; i < m; i++)
            ys[i] = xs[i] + k;
        robust_slice(ys, ws, idx, m, end - k, out + k, st);
        k = end;
    }
    return 0;
}

static void on_handle_closed(uv_handle_t *h);

static void release(peer_allreduce *ar)
{
    if (--ar->handles > 0)
        return;
    ar->res.seconds = (double)(uv_now(ar->loop) - ar->t0) / 1000.0;
    ar->cb(ar->arg, ar->status, &ar->res);
    for (int j = 0; j < ar->n; j++)
        free(ar->links[j].part);
    free(ar->acc);
    free(ar->avg);
    free(ar);
}

static void on_client_closed(peer_rpc_client *cl, void *arg)
{
    peer_rpc_client_destroy(&cl);
    release(arg);
}

static void on_handle_closed(uv_handle_t *h)
{
    release(h->data);
}

static void finish(peer_allreduce *ar, int status)
{
    if (ar->finished)
        return;
    ar->finished = 1;
    ar->status = status;
    if (status == 0) {
        ar->status = peer_allreduce_server_apply(ar->srv, ar->bi, ar->avg, ar->with_optim, &ar->res.dist_before,
                                            &ar->res.dist_after);
    } else if (ar->phase == 1) {
        /* Our part will never be reduced: the others must not wait for it. */
        peer_allreduce_server_fail(ar->srv, ar->bi, status);
    }
    /* A failure after our part was published leaves it served, so members
     * still pulling can finish; the daemon releases it later. */
    uv_timer_stop(&ar->deadline);
    uv_close((uv_handle_t *)&ar->deadline, on_handle_closed);
    for (int j = 0; j < ar->n; j++) {
        ar_link *l = &ar->links[j];
        if (j == ar->me)
            continue;
        if (l->timer_open) {
            uv_timer_stop(&l->retry);
            uv_close((uv_handle_t *)&l->retry, on_handle_closed);
        }
        if (l->cl)
            peer_rpc_client_stop(l->cl, on_client_closed, ar);
    }
}

static void pull(ar_link *l);

static void start_phase2(peer_allreduce *ar)
{
    const float *x[PEER_ALLREDUCE_MAX_MEMBERS];
    double w[PEER_ALLREDUCE_MAX_MEMBERS];
    const float *base = peer_allreduce_server_base(ar->srv, ar->bi);
    for (int j = 0; j < ar->n; j++) {
        x[j] = j == ar->me ? (base ? base + ar->part_off : NULL) : ar->links[j].part;
        w[j] = j == ar->me ? ar->wself : ar->links[j].weight;
    }
    /* Segments: parameters, m, v (expert_block_flat_len: 3 * nparams), or
     * one (a diloco round's pseudo-gradient). */
    size_t seg = ar->nseg == 3 ? ar->nflat / 3 : 0;
    peer_robust_stats st;
    int rc = peer_allreduce_robust_mean(x, w, ar->n, ar->part_len, ar->part_off, seg, ar->acc, &st);
    ar->res.dropped = st.dropped;
    ar->res.clipped = st.clipped;
    if (rc != 0) {
        /* -ENODATA: every member still has its initial weights, nothing to
         * average; -ERANGE: every member with something to give sent
         * non-finite values. */
        finish(ar, rc);
        return;
    }
    for (size_t k = 0; k < ar->part_len; k++)
        if (!isfinite(ar->acc[k])) {
            finish(ar, -ERANGE);
            return;
        }
    /* Published in the round's format; we apply what the others decode. */
    rc = peer_allreduce_server_reduced(ar->srv, ar->bi, ar->acc);
    const float *mine = rc == 0 ? peer_allreduce_server_reduced_part(ar->srv, ar->bi) : NULL;
    if (!mine) {
        finish(ar, rc ? rc : -EINVAL);
        return;
    }
    memcpy(ar->avg + ar->part_off, mine, ar->part_len * sizeof(float));
    double wsum = 0;
    for (int j = 0; j < ar->n; j++)
        if (!(st.dropped >> j & 1))
            wsum += w[j];
    ar->res.weight_self = wsum > 0 && !(st.dropped >> ar->me & 1) ? ar->wself / wsum : 0.0;
    ar->phase = 2;
    ar->remaining = 0;
    for (int j = 0; j < ar->n; j++) {
        ar_link *l = &ar->links[j];
        if (j == ar->me)
            continue;
        peer_avg_part(ar->nflat, ar->n, j, &l->off, &l->len);
        l->pos = 0;
        l->done = l->len == 0;
        if (!l->done)
            ar->remaining++;
    }
    if (ar->remaining == 0) {
        finish(ar, 0);
        return;
    }
    for (int j = 0; j < ar->n && !ar->finished; j++)
        if (j != ar->me && !ar->links[j].done)
            pull(&ar->links[j]);
}

/* How far the average moves our own values over [off, off + len): *r =
 * the L2 distance between avg and base over base's L2 norm (with a zero
 * base, the distance itself), *cos = the cosine between that change and
 * base (0 when either is zero). */
static void piece_change(const float *avg, const float *base, size_t off, size_t len, double *r, double *cos)
{
    double d = 0, b = 0, db = 0;
    for (size_t k = off; k < off + len; k++) {
        double e = (double)avg[k] - base[k];
        d += e * e;
        b += (double)base[k] * base[k];
        db += e * base[k];
    }
    *r = b > 0 ? sqrt(d / b) : sqrt(d);
    *cos = d > 0 && b > 0 ? db / sqrt(d * b) : 0.0;
}

int peer_allreduce_check_parts(const float *avg, const float *base, size_t nflat, int n, int me, uint32_t *rejected)
{
    /* Segments: parameters, m, v (as in the reduce); one segment, treated
     * as parameters, when the state is not three equal thirds. */
    return peer_allreduce_check_parts_seg(avg, base, nflat, nflat % 3 == 0 && nflat > 0 ? 3 : 1, n, me, rejected);
}

int peer_allreduce_check_parts_seg(const float *avg, const float *base, size_t nflat, int nseg, int n, int me,
                                   uint32_t *rejected)
{
    if (rejected)
        *rejected = 0;
    if (!avg || !base || !rejected || n < 2 || n > PEER_ALLREDUCE_MAX_MEMBERS || me < 0 || me >= n ||
        (nseg != 1 && nseg != 3) || (nseg == 3 && nflat % 3 != 0))
        return -EINVAL;
    int three = nseg == 3;
    size_t seg = three ? nflat / 3 : nflat;
    /* How far our own part (reduced by us, robustly) moves us, in its most
     * moved piece: when that is large, we are the one far from the group,
     * and the other parts may move us as far. */
    double own = 0;
    {
        size_t off, len;
        peer_avg_part(nflat, n, me, &off, &len);
        for (int t = 0; t < (three ? 3 : 1); t++) {
            size_t s0 = (size_t)t * seg, s1 = s0 + seg;
            size_t a = off > s0 ? off : s0, b = off + len < s1 ? off + len : s1;
            double r, c;
            if (b > a) {
                piece_change(avg, base, a, b - a, &r, &c);
                own = r > own ? r : own;
            }
        }
    }
    for (int t = 0; t < (three ? 3 : 1); t++) {
        size_t s0 = (size_t)t * seg, s1 = s0 + seg;
        double r[PEER_ALLREDUCE_MAX_MEMBERS], c[PEER_ALLREDUCE_MAX_MEMBERS], sorted[PEER_ALLREDUCE_MAX_MEMBERS];
        int has[PEER_ALLREDUCE_MAX_MEMBERS], m = 0;
        for (int j = 0; j < n; j++) {
            size_t off, len;
            peer_avg_part(nflat, n, j, &off, &len);
            size_t a = off > s0 ? off : s0, b = off + len < s1 ? off + len : s1;
            has[j] = b > a;
            r[j] = c[j] = 0;
            if (has[j]) {
                piece_change(avg, base, a, b - a, &r[j], &c[j]);
                sorted[m++] = r[j];
            }
        }
        /* The reference: the median change over the pieces of this
         * segment when there are three or more (an honest majority of
         * reducers makes it an honest change), at least our own piece's,
         * which we reduced ourselves; with fewer, our own piece's alone;
         * without one, none. */
        double ref = m >= 3 ? median_of(sorted, m) : -1;
        if (has[me] && r[me] > ref)
            ref = r[me];
        double rmax = t == 0 ? PEER_ALLREDUCE_PART_MAX_PARAMS : PEER_ALLREDUCE_PART_MAX_MOMENTS;
        for (int j = 0; j < n; j++) {
            if (j == me || !has[j])
                continue;
            int bad = 0;
            if (ref >= 0 && r[j] > PEER_ALLREDUCE_PART_FACTOR * ref + PEER_ALLREDUCE_PART_FLOOR)
                bad = 1;
            /* The absolute rules hold where the part moves us much more
             * than our own part does: parameters and second moments
             * pulled toward zero or blown up along themselves (m, a noisy
             * average of gradients, can honestly change that way, and
             * zeroed it only resets momentum), or moved beyond rmax. */
            if (r[j] > 2 * own && (r[j] > rmax || (t != 1 && r[j] >= 0.5 && fabs(c[j]) >= 0.9)))
                bad = 1;
            if (bad)
                *rejected |= 1u << j;
        }
    }
    return 0;
}

/* Phase 2 is complete: before applying, check every other reducer's part
 * against ours (peer_allreduce_check_parts); a rejected part keeps our own
 * values (the round's base) for its coordinates, as if that slice were not
 * averaged, so a hostile reducer moves nothing it publishes far off. */
static void finish_phase2(peer_allreduce *ar)
{
    const float *base = peer_allreduce_server_base(ar->srv, ar->bi);
    uint32_t rejected = 0;
    /* A member with weight 0 (initial weights) has nothing to defend and
     * nothing to compare with: it takes the group's average. */
    if (base && ar->wself > 0 &&
        peer_allreduce_check_parts_seg(ar->avg, base, ar->nflat, ar->nseg, ar->n, ar->me, &rejected) == 0 &&
        rejected) {
        for (int j = 0; j < ar->n; j++)
            if (rejected >> j & 1) {
                size_t off, len;
                peer_avg_part(ar->nflat, ar->n, j, &off, &len);
                memcpy(ar->avg + off, base + off, len * sizeof(float));
            }
        ar->res.rejected = rejected;
    }
    finish(ar, 0);
}

static void link_done(ar_link *l)
{
    peer_allreduce *ar = l->ar;
    l->done = 1;
    if (--ar->remaining > 0)
        return;
    if (ar->phase == 1)
        start_phase2(ar);
    else
        finish_phase2(ar);
}

static void on_retry(uv_timer_t *t)
{
    ar_link *l = t->data == NULL ? NULL : (ar_link *)((char *)t - offsetof(ar_link, retry));
    if (l && !l->ar->finished)
        pull(l);
}

static void on_reply(void *arg, int status, const peer_msg *m)
{
    ar_link *l = arg;
    peer_allreduce *ar = l->ar;
    if (ar->finished)
        return;
    if (status != 0) {
        finish(ar, status);
        return;
    }
    if (m->kind == PEER_KIND_ERROR) {
        if (m->err_code == EAGAIN) {
            uv_timer_start(&l->retry, on_retry, RETRY_MS, 0);
            return;
        }
        finish(ar, m->err_code > 0 ? -m->err_code : -EIO);
        return;
    }
    size_t count = l->len - l->pos < PEER_AVG_MAX_COUNT ? l->len - l->pos : PEER_AVG_MAX_COUNT;
    avg_reply rm;
    /* Phase 1 keeps member j's values whole (the robust reduce needs every
     * member's); phase 2 fills in the average. */
    float *dst = ar->phase == 1 ? l->part + l->pos : ar->avg + l->off + l->pos;
    if (m->n_tensors == 1) {
        /* Counted whether or not the slice is any good: it came in. */
        srv_block *sb = srv_block_of(ar->srv, ar->bi);
        if (sb)
            sb->bytes_received += m->t[0].nbytes;
    }
    if (avg_reply_decode(&rm, m->meta, m->meta_len) != 0 || rm.round != ar->round || rm.nflat != ar->nflat ||
        m->n_tensors != 1 || slice_decode(&m->t[0], ar->fmt, ar->fmt_block, count, dst) != 0) {
        finish(ar, -EBADMSG);
        return;
    }
    ar->res.bytes_in += m->t[0].nbytes;
    if (ar->phase == 1) {
        double w = rm.weight;
        if (!(w >= 0.0) || !isfinite(w) || (l->pos > 0 && w != l->weight)) {
            finish(ar, -EBADMSG);
            return;
        }
        if (l->pos == 0)
            l->weight = w;
    } else {
        for (size_t k = 0; k < count; k++)
            if (!isfinite(dst[k])) {
                /* Its reducer published garbage: applying any of it would
                 * poison us, and dropping it would leave a torn state. */
                ar->res.bad_reducer = l->j;
                finish(ar, -ERANGE);
                return;
            }
    }
    l->pos += count;
    if (l->pos == l->len)
        link_done(l);
    else
        pull(l);
}

static void pull(ar_link *l)
{
    peer_allreduce *ar = l->ar;
    size_t count = l->len - l->pos < PEER_AVG_MAX_COUNT ? l->len - l->pos : PEER_AVG_MAX_COUNT;
    avg_request q = {.round = ar->round, .kind = ar->phase == 1 ? 0 : 1, .off = l->off + l->pos, .count = count};
    memcpy(q.digest, ar->digest, PEER_AVG_DIGEST_LEN);
    uint8_t meta[AVG_REQUEST_META];
    avg_request_encode(meta, &q);
    peer_msg req;
    peer_msg_init(&req, PEER_KIND_REQUEST, PEER_METHOD_AVG, 0);
    snprintf(req.block, sizeof req.block, "%s", ar->block);
    req.meta = meta;
    req.meta_len = sizeof meta;
    req.reply_dtype = (peer_dtype)ar->fmt;
    req.reply_block = ar->fmt_block;
    int rc = peer_rpc_call(l->cl, &req, 0, on_reply, l, NULL);
    if (rc != 0)
        finish(ar, rc);
}

static void on_connect(peer_rpc_client *cl, int status, void *arg)
{
    (void)cl;
    ar_link *l = arg;
    if (l->ar->finished)
        return;
    if (status != 0)
        finish(l->ar, status);
    else if (l->done)
        link_done(l); /* an empty slice: nothing to pull */
    else
        pull(l);
}

static void on_deadline(uv_timer_t *t)
{
    finish(t->data, -ETIMEDOUT);
}

/* ar's buffers: its part's accumulator, the whole average, and each other
 * member's copy of our part. Returns 0, or -ENOMEM with none left. */
static int alloc_parts(peer_allreduce *ar)
{
    ar->acc = malloc((ar->part_len ? ar->part_len : 1) * sizeof(float));
    ar->avg = malloc(ar->nflat * sizeof(float));
    int ok = ar->acc && ar->avg;
    for (int j = 0; ok && j < ar->n; j++)
        if (j != ar->me && ar->part_len > 0 && !(ar->links[j].part = malloc(ar->part_len * sizeof(float))))
            ok = 0;
    if (ok)
        return 0;
    for (int j = 0; j < ar->n; j++) {
        free(ar->links[j].part);
        ar->links[j].part = NULL;
    }
    free(ar->acc);
    free(ar->avg);
    ar->acc = ar->avg = NULL;
    return -ENOMEM;
}

int peer_allreduce_start(const peer_allreduce_config *c, peer_allreduce **out)
{
    if (!c || !out || !c->loop || !c->self || !c->srv || !c->block_name || !c->digest || !c->members ||
        !c->cb || c->n < 2 || c->n > PEER_ALLREDUCE_MAX_MEMBERS || c->me < 0 || c->me >= c->n ||
        strlen(c->block_name) > PEER_WIRE_MAX_BLOCK || !(c->timeout_s > 0))
        return -EINVAL;
    struct sockaddr_storage ss[PEER_ALLREDUCE_MAX_MEMBERS];
    for (int j = 0; j < c->n; j++) {
        dht_addr a;
        if (j != c->me && (dht_addr_parse(&a, c->members[j].addr) != 0 || dht_addr_to_sockaddr(&a, &ss[j]) < 0))
            return -EINVAL;
    }
    peer_allreduce *ar = calloc(1, sizeof *ar);
    if (!ar)
        return -ENOMEM;
    ar->loop = c->loop;
    ar->srv = c->srv;
    ar->bi = c->block;
    snprintf(ar->block, sizeof ar->block, "%s", c->block_name);
    ar->round = c->round;
    memcpy(ar->digest, c->digest, PEER_AVG_DIGEST_LEN);
    ar->n = c->n;
    ar->me = c->me;
    ar->with_optim = c->with_optim;
    ar->fmt = c->method.fmt;
    ar->fmt_block = fmt_block_of(&c->method);
    ar->cb = c->cb;
    ar->arg = c->arg;
    ar->res.n = c->n;
    ar->t0 = uv_now(c->loop);
    int rc = peer_allreduce_server_begin(c->srv, c->block, c->round, c->digest, c->n, c->me, &c->method,
                                         &ar->wself, &ar->nflat);
    if (rc != 0) {
        free(ar);
        return rc;
    }
    ar->nseg = c->method.mode == PEER_AVG_MEAN && ar->nflat % 3 == 0 ? 3 : 1;
    peer_avg_part(ar->nflat, ar->n, ar->me, &ar->part_off, &ar->part_len);
    if (alloc_parts(ar) != 0) {
        peer_allreduce_server_release(c->srv, c->block);
        free(ar);
        return -ENOMEM;
    }
    ar->res.bad_reducer = -1;
    ar->phase = 1;

    uv_timer_init(c->loop, &ar->deadline);
    ar->deadline.data = ar;
    ar->handles = 1;
    uv_timer_start(&ar->deadline, on_deadline, (uint64_t)(c->timeout_s * 1000), 0);
    peer_rpc_client_config cc;
    memset(&cc, 0, sizeof cc);
    cc.self = c->self;
    cc.swarm_key = c->swarm_key;
    cc.max_pending = 4;
    for (int j = 0; j < c->n; j++) {
        ar_link *l = &ar->links[j];
        l->ar = ar;
        l->j = j;
        if (j == c->me)
            continue;
        l->off = ar->part_off;
        l->len = ar->part_len;
        l->done = ar->part_len == 0;
        ar->remaining++;
        uv_timer_init(c->loop, &l->retry);
        l->retry.data = ar; /* non-NULL: on_retry finds the link by offset */
        l->timer_open = 1;
        ar->handles++;
        cc.expect_id = c->members[j].id;
        l->cl = peer_rpc_client_create(c->loop, &cc);
        if (l->cl) {
            ar->handles++;
            if (peer_rpc_client_connect(l->cl, (const struct sockaddr *)&ss[j], on_connect, l) != 0) {
                finish(ar, -ECONNREFUSED);
                break;
            }
        } else {
            finish(ar, -ENOMEM);
            break;
        }
    }
    *out = ar;
    return 0;
}

void peer_allreduce_cancel(peer_allreduce *ar)
{
    if (ar)
        finish(ar, -ECANCELED);
}
