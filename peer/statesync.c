#include "peer/statesync.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "dht/addr.h"
#include "expert/block.h"
#include "net/rpc_client.h"
#include "peer/service.h"
#include "net/wire.h"

#define MAX_STATE_BYTES ((size_t)4 << 30) /* refuse absurd totals from a donor */

/* ---- the meta of PEER_METHOD_STATE (both sides) ---- */

#define STATE_REQUEST_META 16
#define STATE_REPLY_META 24

typedef struct state_request {
    uint64_t id;                   /* snapshot id; 0: take a new snapshot */
    uint64_t off;                  /* byte offset */
} state_request;

typedef struct state_reply {
    uint64_t id, total, version;
} state_reply;

static void state_request_encode(uint8_t meta[STATE_REQUEST_META], const state_request *r)
{
    peer_put_le64(meta, r->id);
    peer_put_le64(meta + 8, r->off);
}

/* Returns 0, or -EBADMSG when meta is not a request's. */
static int state_request_decode(state_request *r, const void *meta, size_t len)
{
    if (!meta || len != STATE_REQUEST_META)
        return -EBADMSG;
    r->id = peer_get_le64(meta);
    r->off = peer_get_le64((const uint8_t *)meta + 8);
    return 0;
}

static void state_reply_encode(uint8_t meta[STATE_REPLY_META], const state_reply *r)
{
    peer_put_le64(meta, r->id);
    peer_put_le64(meta + 8, r->total);
    peer_put_le64(meta + 16, r->version);
}

/* Returns 0, or -EBADMSG when meta is not a reply's. 24 bytes; 32 are
 * accepted too (an early version of the reply had a 4th, unused field). */
static int state_reply_decode(state_reply *r, const void *meta, size_t len)
{
    if (!meta || (len != STATE_REPLY_META && len != STATE_REPLY_META + 8))
        return -EBADMSG;
    r->id = peer_get_le64(meta);
    r->total = peer_get_le64((const uint8_t *)meta + 8);
    r->version = peer_get_le64((const uint8_t *)meta + 16);
    return 0;
}

/* ---- the serving side ---- */

/* The latest serialized snapshot of one hosted block (loop thread). */
typedef struct snapshot {
    uint8_t *buf;
    size_t len;
    uint64_t id, version;
} snapshot;

struct peer_statesync_server {
    peer_service *svc;
    uint64_t next_id;
    float *chunk;                  /* one reply's tensor, (PEER_STATE_CHUNK + 4) bytes */
    peer_statesync_cold_fn cold_fn;
    void *cold_arg;
    snapshot snap[PEER_SERVICE_MAX_BLOCKS];
};

/* Answers one chunk of a serialized state (state, state_len) at off. */
static void serve_chunk(peer_statesync_server *srv, peer_rpc_request *req, const uint8_t *state, size_t state_len,
                        uint64_t state_id, uint64_t version, uint64_t off)
{
    if (off > state_len) {
        peer_rpc_respond_error(req, EINVAL, "offset past the end of the state");
        return;
    }
    size_t len = state_len - off < PEER_STATE_CHUNK ? state_len - (size_t)off : PEER_STATE_CHUNK;
    if (!srv->chunk && !(srv->chunk = malloc(PEER_STATE_CHUNK + 4))) {
        peer_rpc_respond_error(req, ENOMEM, "out of memory");
        return;
    }
    float *chunk = srv->chunk;
    size_t nf = (len + 3) / 4;
    chunk[nf ? nf - 1 : 0] = 0.0f; /* zero the padding */
    memcpy(chunk, state + off, len);
    uint8_t meta[STATE_REPLY_META];
    state_reply_encode(meta, &(state_reply){state_id, state_len, version});
    peer_msg reply;
    peer_msg_init(&reply, PEER_KIND_REPLY, PEER_METHOD_STATE, 0);
    reply.meta = meta;
    reply.meta_len = sizeof meta;
    uint64_t shape[2] = {1, nf};
    reply.n_tensors = nf ? 1 : 0;
    if (nf)
        peer_tensor_f32(&reply.t[0], chunk, 2, shape);
    peer_rpc_respond(req, &reply);
}

/* A chunk of hosted block i's state. Serialising a snapshot copies the
 * parameters and optimizer state once per download, not per chunk. */
static void serve_hosted(peer_statesync_server *srv, int i, peer_rpc_request *req, const state_request *q)
{
    snapshot *sn = &srv->snap[i];
    uint64_t off = q->off;
    if (q->id == 0) {
        expert_block *blk = peer_service_block(srv->svc, i);
        size_t need = expert_block_serialized_size(blk, 1);
        uint8_t *buf = realloc(sn->buf, need ? need : 1);
        if (!buf) {
            peer_rpc_respond_error(req, ENOMEM, "out of memory for the state snapshot");
            return;
        }
        sn->buf = buf;
        long n = expert_block_serialize(blk, 1, buf, need);
        if (n < 0) {
            sn->len = 0;
            peer_rpc_respond_error(req, EIO, "cannot serialize the block");
            return;
        }
        sn->len = (size_t)n;
        sn->id = ++srv->next_id;
        sn->version = expert_block_version(blk);
        off = 0;
    } else if (q->id != sn->id || !sn->len) {
        peer_rpc_respond_error(req, ESTALE, "the state snapshot was replaced; start again");
        return;
    }
    serve_chunk(srv, req, sn->buf, sn->len, sn->id, sn->version, off);
}

/* The state method's handler (peer_service_set_handler): hosted blocks
 * from their snapshots, others from a cold copy when there is one. */
static int serve_state(void *ctx, peer_rpc_request *req, const peer_msg *msg, int i)
{
    peer_statesync_server *srv = ctx;
    const uint8_t *buf = NULL;
    size_t len = 0;
    uint64_t cid = 0, version = 0;
    if (i < 0 && (!srv->cold_fn || srv->cold_fn(srv->cold_arg, msg->block, &buf, &len, &cid, &version) != 0))
        return -ENOENT;
    state_request q;
    if (state_request_decode(&q, msg->meta, msg->meta_len) != 0) {
        peer_rpc_respond_error(req, EINVAL, "state takes meta = snapshot id and offset (16 bytes)");
        return 0;
    }
    if (i >= 0) {
        serve_hosted(srv, i, req, &q);
        return 0;
    }
    if (q.id != 0 && q.id != cid) {
        peer_rpc_respond_error(req, ESTALE, "the state snapshot was replaced; start again");
        return 0;
    }
    serve_chunk(srv, req, buf, len, cid, version, q.id == 0 ? 0 : q.off);
    return 0;
}

static void server_free(void *ctx)
{
    peer_statesync_server *srv = ctx;
    for (int i = 0; i < PEER_SERVICE_MAX_BLOCKS; i++)
        free(srv->snap[i].buf);
    free(srv->chunk);
    free(srv);
}

peer_statesync_server *peer_statesync_server_create(peer_service *svc)
{
    peer_statesync_server *srv = svc ? calloc(1, sizeof *srv) : NULL;
    if (!srv)
        return NULL;
    srv->svc = svc;
    if (peer_service_set_handler(svc, PEER_METHOD_STATE, serve_state, srv, server_free) != 0) {
        free(srv);
        return NULL;
    }
    return srv;
}

void peer_statesync_server_set_cold_source(peer_statesync_server *srv, peer_statesync_cold_fn fn, void *arg)
{
    if (!srv)
        return;
    srv->cold_fn = fn;
    srv->cold_arg = arg;
}

/* ---- the download (client) ---- */

typedef struct sync {
    peer_rpc_client *cl;
    char block[PEER_WIRE_MAX_BLOCK + 1];
    uint64_t timeout_ms;
    peer_statesync_cb cb;
    void *arg;
    uint8_t *buf;
    size_t total, got;
    uint64_t id, version;
    int restarts;
    int status;
    int done;
} sync_t;

static void on_closed(peer_rpc_client *cl, void *arg)
{
    sync_t *s = arg;
    peer_rpc_client_destroy(&cl);
    if (s->status == 0)
        s->cb(s->arg, 0, s->buf, s->total, s->version);
    else
        s->cb(s->arg, s->status, NULL, 0, 0);
    free(s->buf);
    free(s);
}

static void finish(sync_t *s, int status)
{
    if (s->done)
        return;
    s->done = 1;
    s->status = status;
    peer_rpc_client_stop(s->cl, on_closed, s);
}

static void on_reply(void *arg, int status, const peer_msg *m);

static void request(sync_t *s)
{
    uint8_t meta[STATE_REQUEST_META];
    state_request_encode(meta, &(state_request){s->id, s->got});
    peer_msg m;
    peer_msg_init(&m, PEER_KIND_REQUEST, PEER_METHOD_STATE, 0);
    snprintf(m.block, sizeof m.block, "%s", s->block);
    m.meta = meta;
    m.meta_len = sizeof meta;
    int rc = peer_rpc_call(s->cl, &m, s->timeout_ms, on_reply, s, NULL);
    if (rc != 0)
        finish(s, rc);
}

static void on_reply(void *arg, int status, const peer_msg *m)
{
    sync_t *s = arg;
    if (s->done)
        return;
    if (status != 0) {
        finish(s, status);
        return;
    }
    if (m->kind == PEER_KIND_ERROR) {
        if (m->err_code == ESTALE && s->restarts++ < 3) {
            s->id = 0;
            s->got = 0;
            request(s);
            return;
        }
        finish(s, m->err_code > 0 ? -m->err_code : -EIO);
        return;
    }
    state_reply r;
    if (state_reply_decode(&r, m->meta, m->meta_len) != 0) {
        finish(s, -EBADMSG);
        return;
    }
    uint64_t id = r.id, total = r.total, version = r.version;
    if (s->id == 0) {
        /* The first chunk fixes the snapshot and its size. */
        if (total == 0 || total > MAX_STATE_BYTES) {
            finish(s, -EBADMSG);
            return;
        }
        uint8_t *buf = realloc(s->buf, total);
        if (!buf) {
            finish(s, -ENOMEM);
            return;
        }
        s->buf = buf;
        s->id = id;
        s->total = total;
        s->version = version;
    } else if (id != s->id || total != s->total) {
        finish(s, -EBADMSG);
        return;
    }
    size_t want = s->total - s->got < PEER_STATE_CHUNK ? s->total - s->got : PEER_STATE_CHUNK;
    if (m->n_tensors != 1 || m->t[0].dtype != PEER_DTYPE_F32 || m->t[0].nbytes < want ||
        m->t[0].nbytes > want + 3) {
        finish(s, -EBADMSG);
        return;
    }
    memcpy(s->buf + s->got, m->t[0].data, want);
    s->got += want;
    if (s->got == s->total)
        finish(s, 0);
    else
        request(s);
}

static void on_connect(peer_rpc_client *cl, int status, void *arg)
{
    (void)cl;
    sync_t *s = arg;
    if (status != 0)
        finish(s, status);
    else
        request(s);
}

int peer_statesync_start(uv_loop_t *loop, const dht_identity *self, const uint8_t *swarm_key,
                         const uint8_t donor_id[DHT_ID_LEN], const char *donor_addr, const char *block,
                         double timeout_s, peer_statesync_cb cb, void *arg)
{
    dht_addr a;
    struct sockaddr_storage ss;
    if (!loop || !self || !donor_id || !donor_addr || !block || !cb ||
        strlen(block) > PEER_WIRE_MAX_BLOCK || dht_addr_parse(&a, donor_addr) != 0 ||
        dht_addr_to_sockaddr(&a, &ss) < 0)
        return -EINVAL;
    sync_t *s = calloc(1, sizeof *s);
    if (!s)
        return -ENOMEM;
    snprintf(s->block, sizeof s->block, "%s", block);
    s->timeout_ms = (uint64_t)(timeout_s * 1000);
    s->cb = cb;
    s->arg = arg;
    peer_rpc_client_config cc;
    memset(&cc, 0, sizeof cc);
    cc.self = self;
    cc.expect_id = donor_id;
    cc.swarm_key = swarm_key;
    cc.max_pending = 4;
    s->cl = peer_rpc_client_create(loop, &cc);
    if (!s->cl) {
        free(s);
        return -ENOMEM;
    }
    int rc = peer_rpc_client_connect(s->cl, (const struct sockaddr *)&ss, on_connect, s);
    if (rc != 0) {
        peer_rpc_client_destroy(&s->cl);
        free(s);
        return rc;
    }
    return 0;
}

/* ---- Trust ---- */

#define TRUST_MAX_CLAIMS 256

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

uint64_t peer_trust_median_u64(const uint64_t *v, int n, int skip)
{
    uint64_t s[TRUST_MAX_CLAIMS];
    int m = 0;
    for (int i = 0; v && i < n && i < TRUST_MAX_CLAIMS; i++)
        if (i != skip && v[i] > 0)
            s[m++] = v[i];
    if (m == 0)
        return 0;
    qsort(s, (size_t)m, sizeof s[0], cmp_u64);
    return s[m / 2];
}

double peer_trust_median(const double *v, int n, int skip)
{
    double s[TRUST_MAX_CLAIMS];
    int m = 0;
    for (int i = 0; v && i < n && i < TRUST_MAX_CLAIMS; i++)
        if (i != skip && v[i] > 0 && isfinite(v[i]))
            s[m++] = v[i];
    if (m == 0)
        return 0;
    qsort(s, (size_t)m, sizeof s[0], cmp_double);
    return s[m / 2];
}

/* a * f + b without wrapping around. */
static uint64_t sat_mul_add(uint64_t a, uint64_t f, uint64_t b)
{
    if (f && a > (UINT64_MAX - b) / f)
        return UINT64_MAX;
    return a * f + b;
}

int peer_trust_version_suspect(const uint64_t *version, int n, int i)
{
    if (!version || i < 0 || i >= n)
        return 0;
    uint64_t med = peer_trust_median_u64(version, n, i);
    if (med == 0)
        return 0; /* nothing to compare with */
    return version[i] > sat_mul_add(med, PEER_TRUST_VERSION_FACTOR, PEER_TRUST_VERSION_SLACK);
}

int peer_trust_tput_suspect(const double *tput, int n, int i)
{
    if (!tput || i < 0 || i >= n || !(tput[i] > 0))
        return 0;
    double med = peer_trust_median(tput, n, i);
    if (med <= 0)
        return 0;
    return !isfinite(tput[i]) || tput[i] > PEER_TRUST_TPUT_FACTOR * med;
}

uint64_t peer_statesync_choose(const uint64_t *version, int n, uint8_t *suspect)
{
    uint64_t top = 0;
    for (int i = 0; version && i < n; i++) {
        int bad = peer_trust_version_suspect(version, n, i);
        if (suspect)
            suspect[i] = (uint8_t)bad;
        if (!bad && version[i] > top)
            top = version[i];
    }
    /* Every trusted claim is 0 (a young swarm: announcements lag the
     * holders' first steps by up to the announcement period): no claim to
     * bound the download by. */
    if (top == 0)
        return UINT64_MAX;
    return sat_mul_add(top, PEER_TRUST_VERSION_FACTOR, PEER_TRUST_VERSION_SLACK);
}
