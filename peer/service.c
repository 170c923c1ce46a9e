#include "peer/service.h"
#include "peer/device.h"

#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include <sodium.h>

#include "expert/block.h"
#include "expert/guard.h"
#include "expert/hfweights.h"
#include "expert/model.h"
#include "peer/log.h"
#include "net/stagecall.h"
#include "net/rpc_server.h"
#include "net/tensorfmt.h"
#include "net/wire.h"

typedef struct svc_block svc_block;

/* One request in flight: the batcher task plus what the reply needs. */
typedef struct svc_task {
    peer_task t;               /* first: the done callback casts back */
    svc_block *blk;
    peer_rpc_request *req;
    int method;
    int span, pos;             /* infer: consecutive stages in the request, this task's place */
    struct svc_task *prev;     /* infer span: the task of the stage before (its out is our input) */
    struct svc_task *next_free;
    float *out;                /* (max_batch, max(in, out)) */
    float *in, *gout;          /* compressed requests: inputs and grad_outputs decoded
                                  (grown to the largest request seen) */
    size_t in_cap, gout_cap;   /* their floats */
    void *enc;                 /* a compressed reply's bytes (made on first use) */
    size_t enc_cap;
    peer_dtype rdtype;         /* the reply's format, as the request asked */
    int rblock;
} svc_task;

struct svc_block {
    peer_service *svc;
    int index;
    char name[65];
    char ckpt_path[PATH_MAX];
    int restored;
    int has_state;             /* restored, downloaded, averaged or trained: not initial weights */
    uint64_t stage_hash;
    struct expert_block_config cfg;
    expert_block *block;
    peer_batcher *batcher;
    pthread_mutex_t pool_mu;
    svc_task *free_list;
    int pool_size, pool_cap;
    expert_workspace *inline_ws; /* loop thread: small inference requests, made on first use */
    /* Training integrity (loop thread only): the history of backward
     * requests' per-sample norms, what was refused, what was logged. */
    struct expert_guard in_guard, go_guard;
    uint64_t refused_requests;
    uint64_t refused_logged;   /* refusals (requests + steps) already in the log */
    double refused_log_t;      /* when the last refusal line was written */
    uint64_t steps_logged;     /* refused steps already in the log */
    int frozen_logged;         /* "weights have not moved" written, not yet taken back */
    /* Device failures (any compute thread): how many, and when the last
     * log line about them was written (monotonic ms, 0: never). */
    _Atomic uint64_t device_failures;
    _Atomic uint64_t device_logged_ms;
};

/* A method's registered handler (peer_service_set_handler). */
struct svc_handler {
    peer_service_handler fn;
    void *ctx;
    void (*release)(void *ctx);
};

struct peer_service {
    uv_loop_t *loop;
    peer_service_config cfg;
    char model[64];
    const struct expert_model_spec *spec;
    int n_blocks;
    svc_block blocks[PEER_SERVICE_MAX_BLOCKS];
    peer_rpc_server *rpc;
    peer_fmt_mask formats;     /* tensor formats accepted */
    /* Tensor bytes of the compute methods by method (forward, backward,
     * infer), format and direction (0 received, 1 sent); any thread. */
    _Atomic uint64_t tensor_bytes[PEER_SERVICE_TRAFFIC_METHODS][PEER_FMT_COUNT][2];
    _Atomic uint64_t sr_count;  /* stochastic rounding: one seed per gradient reply */
    uint64_t sr_base;           /* ... from this random base */
    struct svc_handler handlers[PEER_SERVICE_MAX_METHODS];
    const expert_backend *be;   /* cfg.backend, or the CPU */
    size_t reserved;            /* device bytes earlier blocks will still allocate (kept
                                   activations, allocated on first use) */
    int closing;
    void (*close_cb)(peer_service *, int, void *);
    void *close_arg;
    char info_json[4096];
};

static svc_task *pool_get(svc_block *b)
{
    svc_task *t = NULL;
    pthread_mutex_lock(&b->pool_mu);
    if (b->free_list) {
        t = b->free_list;
        b->free_list = t->next_free;
    } else if (b->pool_size < b->pool_cap) {
        size_t wide = (size_t)(b->cfg.in > b->cfg.out ? b->cfg.in : b->cfg.out);
        t = calloc(1, sizeof *t);
        if (t)
            t->out = malloc((size_t)b->svc->cfg.max_batch * wide * sizeof(float));
        if (t && !t->out) {
            free(t);
            t = NULL;
        }
        if (t)
            b->pool_size++;
    }
    pthread_mutex_unlock(&b->pool_mu);
    if (t)
        t->blk = b;
    return t;
}

static void pool_put(svc_block *b, svc_task *t)
{
    pthread_mutex_lock(&b->pool_mu);
    t->next_free = b->free_list;
    b->free_list = t;
    pthread_mutex_unlock(&b->pool_mu);
}

static void pool_free(svc_block *b)
{
    svc_task *t = b->free_list;
    while (t) {
        svc_task *n = t->next_free;
        free(t->out);
        free(t->in);
        free(t->gout);
        free(t->enc);
        free(t);
        t = n;
    }
    b->free_list = NULL;
}

/* Recycles t and the tasks of the stages before it in an infer span. */
static void chain_put(svc_task *t)
{
    while (t) {
        svc_task *p = t->prev;
        pool_put(t->blk, t);
        t = p;
    }
}

/* Answers t's request with an error and recycles its chain. */
static void task_fail(svc_task *t, int code, const char *why)
{
    peer_rpc_respond_error(t->req, code, why);
    chain_put(t);
}

/* Counts n tensor bytes of a compute method in format dtype, received
 * (dir 0) or sent (1). */
static void traffic(peer_service *s, int method, peer_dtype dtype, int dir, size_t n)
{
    int m = method == PEER_METHOD_FORWARD ? 0 : method == PEER_METHOD_BACKWARD ? 1 : 2;
    if ((unsigned)dtype < PEER_FMT_COUNT)
        atomic_fetch_add_explicit(&s->tensor_bytes[m][dtype][dir], (uint64_t)n, memory_order_relaxed);
}

/* Answers t's request with its result (t is the request's last stage) or
 * an error, and recycles the chain. Any thread: the RPC server hands the
 * encoded reply to the loop. */
static void task_reply(svc_task *t, int status)
{
    peer_task *pt = &t->t;
    svc_block *b = t->blk;
    if (status == -ERANGE) {
        /* The optimizer step this backward completed was refused
         * (expert_block_step): say why, so the trainer's log shows it. */
        struct expert_block_health h;
        char why[sizeof b->name + 64 + sizeof h.last_refusal];
        expert_block_health(b->block, &h);
        snprintf(why, sizeof why, "%s: the optimizer step this backward completed was dropped: %s", b->name,
                 h.last_refusal);
        task_fail(t, ERANGE, why);
        return;
    }
    if (status != 0) {
        task_fail(t, EIO, "compute failed");
        return;
    }
    peer_msg reply;
    uint8_t meta[PEER_META_U64_LEN * PEER_SERVICE_MAX_BLOCKS];
    uint64_t versions[PEER_SERVICE_MAX_BLOCKS];
    int n = t->pos + 1; /* one weight version per stage, in order */
    for (svc_task *x = t; x; x = x->prev)
        versions[x->pos] = x->t.version;
    peer_msg_init(&reply, PEER_KIND_REPLY, (peer_method)t->method, 0);
    reply.meta = meta;
    reply.meta_len = peer_meta_versions_encode(meta, sizeof meta, versions, n);
    uint64_t row[2];
    int nrow = expert_block_row_shape(&b->cfg, t->method != PEER_METHOD_BACKWARD, row);
    reply.n_tensors = 1;
    if (peer_tensor_rows(&reply.t[0], t->out, (uint64_t)pt->rows, nrow, row) != 0) {
        task_fail(t, EIO, "compute failed");
        return;
    }
    if (t->rdtype != PEER_DTYPE_F32) {
        /* The reply in the format the client asked for. */
        size_t nv = (size_t)peer_tensor_count(&reply.t[0]);
        size_t need = peer_tensorfmt_size((peer_fmt)t->rdtype, t->rblock, nv);
        if (need > t->enc_cap) {
            /* As large as this reply needs: a pooled task keeps it, so a
             * stream of small requests must not hold full-size buffers. */
            free(t->enc);
            t->enc_cap = need;
            if (!(t->enc = malloc(t->enc_cap)))
                t->enc_cap = 0;
        }
        /* Gradients (a backward's grad_inputs) with stochastic rounding:
         * unbiased, like the trainer's grad_outputs; activations to nearest. */
        long k;
        if (!t->enc) {
            k = -ENOMEM;
        } else if (t->method == PEER_METHOD_BACKWARD) {
            /* Each reply's draws from its own seed: this process's random
             * base (so peers and restarts differ) and a counter, mixed so
             * that no two replies' draws line up. */
            uint64_t seed = atomic_fetch_add_explicit(&b->svc->sr_count, 1, memory_order_relaxed);
            seed = (seed ^ b->svc->sr_base) * 0xD6E8FEB86659FD93ull;
            seed ^= seed >> 32;
            k = peer_tensorfmt_encode_sr((peer_fmt)t->rdtype, t->rblock, t->out, nv, seed, t->enc, t->enc_cap);
        } else {
            k = peer_tensorfmt_encode((peer_fmt)t->rdtype, t->rblock, t->out, nv, t->enc, t->enc_cap);
        }
        uint64_t shape[PEER_WIRE_MAX_DIMS];
        memcpy(shape, reply.t[0].shape, sizeof shape);
        if (k < 0 || peer_tensor_encoded(&reply.t[0], t->rdtype, t->rblock, t->enc, reply.t[0].ndim, shape) != 0) {
            task_fail(t, k == -ENOMEM ? ENOMEM : EIO, k == -ENOMEM ? "out of memory" : "compute failed");
            return;
        }
    }
    traffic(b->svc, t->method, reply.t[0].dtype, 1, reply.t[0].nbytes);
    if (peer_rpc_respond(t->req, &reply) != 0) {
        /* respond already answered the client (EIO) or dropped the
         * request; either way the request is gone. */
    }
    chain_put(t);
}

uint64_t peer_service_tensor_bytes(const peer_service *s, int method, int fmt, int dir)
{
    if (!s || method < 0 || method >= PEER_SERVICE_TRAFFIC_METHODS || fmt < 0 || fmt >= PEER_FMT_COUNT ||
        dir < 0 || dir > 1)
        return 0;
    return atomic_load_explicit(&s->tensor_bytes[method][fmt][dir], memory_order_relaxed);
}

double peer_service_bytes_per_sample(peer_service *s)
{
    uint64_t bytes = 0, rows = 0;
    for (int m = 0; s && m < PEER_SERVICE_TRAFFIC_METHODS; m++)
        for (int f = 0; f < PEER_FMT_COUNT; f++)
            bytes += peer_service_tensor_bytes(s, m, f, 0) + peer_service_tensor_bytes(s, m, f, 1);
    peer_block_info info;
    for (int i = 0; s && i < s->n_blocks; i++)
        if (peer_service_block_info(s, i, &info) == 0)
            rows += info.stats.rows[1] + info.stats.rows[2] + info.stats.rows[3];
    return rows ? (double)bytes / (double)rows : 0.0;
}

uint32_t peer_service_formats(const peer_service *s)
{
    return s ? s->formats : 0;
}

static svc_block *block_of_stage(peer_service *s, int index)
{
    for (int i = 0; i < s->n_blocks; i++)
        if (s->blocks[i].index == index)
            return &s->blocks[i];
    return NULL;
}

/* The task for the stage after t in an infer span: its input is t's output.
 * NULL when that block's pool is exhausted. */
static svc_task *span_next(svc_task *t)
{
    svc_block *nb = block_of_stage(t->blk->svc, t->blk->index + 1);
    svc_task *nt = nb ? pool_get(nb) : NULL;
    if (!nt)
        return NULL;
    nt->req = t->req;
    nt->rdtype = t->rdtype;
    nt->rblock = t->rblock;
    nt->method = t->method;
    nt->span = t->span;
    nt->pos = t->pos + 1;
    nt->prev = t;
    memset(&nt->t, 0, sizeof nt->t);
    nt->t.kind = PEER_TASK_INFER;
    nt->t.rows = t->t.rows;
    nt->t.inputs = t->out;
    nt->t.outputs = nt->out;
    nt->t.done = t->t.done;
    return nt;
}

static double mono_s(void);

/* A call on block b failed in its device (-EIO, -ENOMEM: a kernel fault,
 * device memory exhausted): the log says so with the backend's sentence
 * (the calling thread's), at most one line per PEER_DEVICE_LOG_S per
 * block with the count since. A faulted CUDA context stays faulted: every
 * later call fails the same way, and trainers take other replicas. */
#define PEER_DEVICE_LOG_S 30
static void device_failed(svc_block *b, int status)
{
    uint64_t n = atomic_fetch_add(&b->device_failures, 1) + 1;
    uint64_t now = (uint64_t)(mono_s() * 1000), last = atomic_load(&b->device_logged_ms);
    if (last && now - last < PEER_DEVICE_LOG_S * 1000)
        return;
    if (!atomic_compare_exchange_strong(&b->device_logged_ms, &last, now ? now : 1))
        return;
    const char *why = expert_backend_last_error();
    peer_log(b->svc->cfg.log, "block %s: the device failed (%s; %" PRIu64 " failed call%s so far)%s%s", b->name,
             strerror(-status), n, n == 1 ? "" : "s", why[0] ? ": " : "", why);
}

/* Runs on a compute thread; a span's next stage goes to its block's lane. */
static void task_done(peer_task *pt, int status)
{
    svc_task *t = (svc_task *)pt;
    if (status == -EIO || status == -ENOMEM)
        device_failed(t->blk, status);
    if (status != 0 || t->pos + 1 >= t->span) {
        task_reply(t, status);
        return;
    }
    svc_task *nt = span_next(t);
    if (!nt) {
        task_fail(t, EBUSY, "peer overloaded; try another replica");
        return;
    }
    int rc = peer_batcher_submit(nt->blk->batcher, &nt->t);
    if (rc != 0)
        task_fail(nt, rc == -EAGAIN ? EBUSY : rc == -ESHUTDOWN ? ESHUTDOWN : EIO,
                  rc == -EAGAIN ? "queue full; try another replica" : "cannot queue request");
}

/* Refusals and frozen weights go to the peer's log; refusals at most one
 * line per PEER_GUARD_LOG_S per block (an attacker could send thousands),
 * with the count since the last line. */
#define PEER_GUARD_LOG_S 10.0

/* Logs what block b's checks saw since the last call. Loop thread. */
static void guard_log(peer_service *s, svc_block *b, const char *request_why)
{
    struct expert_block_health h;
    expert_block_health(b->block, &h);
    uint64_t total = b->refused_requests + h.refused_steps;
    double now = mono_s();
    if (total > b->refused_logged && (b->refused_logged == 0 || now - b->refused_log_t >= PEER_GUARD_LOG_S)) {
        const char *why = h.refused_steps > b->steps_logged ? h.last_refusal : request_why;
        peer_log(s->cfg.log, "block %s: %" PRIu64 " gradient%s refused (%" PRIu64 " requests, %" PRIu64
                 " steps in all); latest: %s",
                 b->name, total - b->refused_logged, total - b->refused_logged == 1 ? "" : "s",
                 b->refused_requests, h.refused_steps, why && why[0] ? why : h.last_refusal);
        b->refused_logged = total;
        b->steps_logged = h.refused_steps;
        b->refused_log_t = now;
    }
    if (h.frozen && !b->frozen_logged) {
        peer_log(s->cfg.log,
                 "block %s: weights have not moved in %" PRIu64 " steps (version %" PRIu64
                 "): its gradients are applied but change nothing; it needs fresh state (averaging, "
                 "a download or a restart from a checkpoint)",
                 b->name, h.still_steps, expert_block_version(b->block));
        b->frozen_logged = 1;
    } else if (!h.frozen && b->frozen_logged && h.still_steps == 0) {
        peer_log(s->cfg.log, "block %s: weights move again", b->name);
        b->frozen_logged = 0;
    }
}

/* The per-request half of the training-integrity checks (expert/guard.h):
 * a backward's inputs and grad_outputs must be finite, and their
 * per-sample norms within the bounds of this block's recent requests.
 * Refused before the request is queued, so nothing of it reaches the
 * gradients. Returns 0 or -ERANGE with a sentence in why. */
static int check_backward(peer_service *s, svc_block *b, const float *in, const float *gout, int rows,
                          char *why, size_t len)
{
    double sqi, sqg;
    char what[160];
    /* Non-finite sums (an element NaN or Inf) fail the checks below. */
    (void)expert_guard_sqnorm(in, (size_t)rows * (size_t)b->cfg.in, &sqi);
    (void)expert_guard_sqnorm(gout, (size_t)rows * (size_t)b->cfg.out, &sqg);
    double ni = sqrt(sqi / rows), ng = sqrt(sqg / rows);
    int rc;
    if ((rc = expert_guard_check(&b->go_guard, &s->cfg.guard, ng, "per-sample grad_output", what,
                                 sizeof what)) != 0 ||
        (rc = expert_guard_check(&b->in_guard, &s->cfg.guard, ni, "per-sample input", what, sizeof what)) != 0) {
        snprintf(why, len, "%s: backward %s", b->name, what);
        b->refused_requests++;
    }
    /* Refused or not (expert_guard_observe): a reference talked down by a
     * stream of tiny requests is lifted back by the honest ones it
     * refuses. */
    expert_guard_observe(&b->go_guard, &s->cfg.guard, ng);
    expert_guard_observe(&b->in_guard, &s->cfg.guard, ni);
    guard_log(s, b, rc != 0 ? what : NULL);
    return rc;
}

/* Whether t is a batch of rows of block config c's input (out == 0) or
 * output: f32 (B, row shape...) with 1 <= B <= max_rows. */
static int is_rows_of(const peer_tensor *t, const struct expert_block_config *c, int out, int max_rows,
                      uint64_t *rows_out)
{
    uint64_t row[2];
    int n = expert_block_row_shape(c, out, row);
    return n > 0 && peer_tensor_is_rows(t, n, row, (uint64_t)max_rows, rows_out);
}

/* "(B, 128, 256)": the shape a batch of c's input (out == 0) or output has. */
static void shape_text(char *buf, size_t len, const struct expert_block_config *c, int out)
{
    uint64_t row[2];
    int n = expert_block_row_shape(c, out, row);
    if (n == 2)
        snprintf(buf, len, "(B, %llu, %llu)", (unsigned long long)row[0], (unsigned long long)row[1]);
    else
        snprintf(buf, len, "(B, %llu)", (unsigned long long)row[0]);
}

/* The span an infer request names in its meta: this stage and the ones
 * after it, all hosted here, computed one after the other without a round
 * trip each. Returns the span (1 without meta), or 0 when it answered req
 * with an error. */
static int infer_span(peer_service *s, svc_block *b, peer_rpc_request *req, const peer_msg *msg)
{
    char why[256];
    if (msg->method != PEER_METHOD_INFER)
        return 1;
    int span;
    if (peer_meta_span_decode(msg->meta, msg->meta_len, s->n_blocks, &span) != 0) {
        snprintf(why, sizeof why, "infer meta is the number of consecutive stages to run (u64le, 1..%d)",
                 s->n_blocks);
        peer_rpc_respond_error(req, EINVAL, why);
        return 0;
    }
    for (int i = 1; i < span; i++)
        if (!block_of_stage(s, b->index + i)) {
            snprintf(why, sizeof why, "stage %d (in a span of %d from %s) is not hosted by this peer",
                     b->index + i, span, b->name);
            peer_rpc_respond_error(req, ENOENT, why);
            return 0;
        }
    return span;
}

/* Computes the small inference request t (and the rest of its span) here
 * on the loop thread and answers it. A small inference request costs less
 * to compute here (under a millisecond per stage) than to hand to the lane
 * and back: two thread wake-ups per stage, each of which waits for a time
 * slice when training keeps the cores busy. */
static void infer_inline(peer_service *s, svc_task *t)
{
    for (;;) {
        svc_block *tb = t->blk;
        if (!tb->inline_ws)
            tb->inline_ws = expert_workspace_create_on(&tb->cfg, s->cfg.infer_inline_rows, s->be);
        int rc = tb->inline_ws ? peer_batcher_infer_now(tb->batcher, tb->inline_ws, &t->t) : -ENOMEM;
        if (rc != 0) {
            task_fail(t, rc == -ESHUTDOWN ? ESHUTDOWN : rc == -ENOMEM ? ENOMEM : EIO,
                      rc == -ESHUTDOWN ? "peer is shutting down" : "compute failed");
            return;
        }
        if (t->pos + 1 >= t->span) {
            task_reply(t, 0);
            return;
        }
        svc_task *nt = span_next(t);
        if (!nt) {
            task_fail(t, EBUSY, "peer overloaded; try another replica");
            return;
        }
        t = nt;
    }
}

/* Whether this peer accepts the formats of msg's tensors and of the reply
 * it asks for; else answers EINVAL naming the ones it does. */
static int formats_ok(peer_service *s, svc_block *b, peer_rpc_request *req, const peer_msg *msg)
{
    peer_dtype bad = msg->reply_dtype;
    int ok = peer_fmt_mask_has(s->formats, (peer_fmt)bad);
    for (int i = 0; ok && i < msg->n_tensors; i++)
        if (!peer_fmt_mask_has(s->formats, (peer_fmt)msg->t[i].dtype))
            ok = 0, bad = msg->t[i].dtype;
    if (ok)
        return 1;
    char list[64], why[256];
    if (peer_tensorfmt_mask_format(s->formats, list, sizeof list) < 0)
        snprintf(list, sizeof list, "?");
    snprintf(why, sizeof why, "%s: tensor format %s is not accepted by this peer (it accepts %s: starling peer "
             "--wire-formats)", b->name, peer_tensorfmt_name((peer_fmt)bad), list);
    peer_rpc_respond_error(req, EINVAL, why);
    return 0;
}

/* Decodes the compressed tensor t into *buf (cap floats, allocated on first
 * use) and points *out at it. Returns 0, -ENOMEM or -EBADMSG. */
static int decoded(const peer_tensor *t, float **buf, size_t *cap, const float **out)
{
    size_t n = (size_t)peer_tensor_count(t); /* rows checked against max_batch already */
    if (n > *cap) {
        /* As large as this request needs (see task_reply). */
        free(*buf);
        *cap = 0;
        if (!(*buf = malloc(n * sizeof(float))))
            return -ENOMEM;
        *cap = n;
    }
    int rc = peer_tensor_to_f32(t, *buf, *cap);
    if (rc == 0)
        *out = *buf;
    return rc == -ENOBUFS ? -EBADMSG : rc;
}

/* forward, backward and infer of hosted block b: checks the request, then
 * computes it inline or queues it on the block's batcher, whose worker
 * answers it. */
static void handle_compute(peer_service *s, svc_block *b, peer_rpc_request *req, const peer_msg *msg)
{
    char why[256];
    const int fwd = msg->method != PEER_METHOD_BACKWARD;
    uint64_t rows = 0, rows2 = 0;
    if (msg->n_tensors != (fwd ? 1 : 2) || !is_rows_of(&msg->t[0], &b->cfg, 0, s->cfg.max_batch, &rows) ||
        (!fwd && (!is_rows_of(&msg->t[1], &b->cfg, 1, s->cfg.max_batch, &rows2) || rows2 != rows))) {
        char in_s[64], out_s[64];
        shape_text(in_s, sizeof in_s, &b->cfg, 0);
        shape_text(out_s, sizeof out_s, &b->cfg, 1);
        snprintf(why, sizeof why, "%s of %s takes %s tensor%s of shape %s%s%s with 1 <= B <= %d",
                 fwd ? "forward" : "backward", b->name, fwd ? "one" : "two", fwd ? "" : "s", in_s,
                 fwd ? "" : " and ", fwd ? "" : out_s, s->cfg.max_batch);
        peer_rpc_respond_error(req, EINVAL, why);
        return;
    }
    if (!formats_ok(s, b, req, msg))
        return;
    if (b->cfg.kind == EXPERT_BLOCK_EMBED && msg->t[0].dtype != PEER_DTYPE_F32) {
        /* f16 and bf16 would turn large token values into their
         * neighbours without a trace: tokens come exact or not at all. */
        snprintf(why, sizeof why, "%s takes token values as f32 tensors, not %s", b->name,
                 peer_tensorfmt_name((peer_fmt)msg->t[0].dtype));
        peer_rpc_respond_error(req, EINVAL, why);
        return;
    }
    svc_task *t = pool_get(b);
    if (!t) {
        peer_rpc_respond_error(req, EBUSY, "peer overloaded; try another replica");
        return;
    }
    const float *in = msg->t[0].data, *gout = fwd ? NULL : msg->t[1].data;
    int rc = 0;
    if (msg->t[0].dtype != PEER_DTYPE_F32)
        rc = decoded(&msg->t[0], &t->in, &t->in_cap, &in);
    if (rc == 0 && !fwd && msg->t[1].dtype != PEER_DTYPE_F32)
        rc = decoded(&msg->t[1], &t->gout, &t->gout_cap, &gout);
    for (int i = 0; i < msg->n_tensors; i++)
        traffic(s, msg->method, msg->t[i].dtype, 0, msg->t[i].nbytes);
    if (rc != 0) {
        pool_put(b, t);
        snprintf(why, sizeof why, "%s of %s: a %s tensor does not decode", fwd ? "forward" : "backward",
                 b->name, rc == -ENOMEM ? "(out of memory)" : "compressed");
        peer_rpc_respond_error(req, rc == -ENOMEM ? ENOMEM : EBADMSG, why);
        return;
    }
    /* Token values too, per client, before requests are joined: one bad
     * request must not fail the others in its batch. */
    if (expert_block_input_check(&b->cfg, in, (int)rows, why, sizeof why) != 0) {
        pool_put(b, t);
        peer_rpc_respond_error(req, EINVAL, why);
        return;
    }
    if (!fwd && check_backward(s, b, in, gout, (int)rows, why, sizeof why) != 0) {
        pool_put(b, t);
        peer_rpc_respond_error(req, ERANGE, why);
        return;
    }
    int span = infer_span(s, b, req, msg);
    if (span == 0) {
        pool_put(b, t);
        return;
    }
    t->req = req;
    t->rdtype = msg->reply_dtype;
    t->rblock = msg->reply_block;
    t->method = msg->method;
    t->span = span;
    t->pos = 0;
    t->prev = NULL;
    memset(&t->t, 0, sizeof t->t);
    t->t.kind = msg->method == PEER_METHOD_INFER ? PEER_TASK_INFER
                : fwd                           ? PEER_TASK_FORWARD
                                                : PEER_TASK_BACKWARD;
    t->t.rows = (int)rows;
    t->t.inputs = in;
    t->t.grad_outputs = gout;
    t->t.outputs = t->out;
    t->t.done = task_done;
    /* A backward may name the weight version its forward used, so the
     * recompute uses the same weights when still held; meta of another
     * length is ignored, as it always was. */
    if (!fwd && peer_meta_at_version_decode(msg->meta, msg->meta_len, &t->t.at_version) == 1)
        t->t.has_at_version = 1;
    if (t->t.kind == PEER_TASK_INFER && t->t.rows <= s->cfg.infer_inline_rows) {
        infer_inline(s, t);
        return;
    }
    rc = peer_batcher_submit(b->batcher, &t->t);
    if (rc != 0) {
        pool_put(b, t);
        if (rc == -EAGAIN)
            peer_rpc_respond_error(req, EBUSY, "queue full; try another replica");
        else
            peer_rpc_respond_error(req, rc == -ESHUTDOWN ? ESHUTDOWN : EIO, "cannot queue request");
    }
}

static int find_block(const peer_service *s, const char *name)
{
    for (int i = 0; i < s->n_blocks; i++)
        if (strcmp(s->blocks[i].name, name) == 0)
            return i;
    return -1;
}

static void respond_not_hosted(peer_rpc_request *req, const peer_msg *msg)
{
    char why[256];
    snprintf(why, sizeof why, "block '%.80s' is not hosted by this peer", msg->block);
    peer_rpc_respond_error(req, ENOENT, why);
}

/* The RPC server's handler (loop thread): info and the compute methods
 * here, every other method to the handler registered for it. */
static void handle(peer_rpc_request *req, const peer_msg *msg, void *arg)
{
    peer_service *s = arg;
    if (s->closing) {
        peer_rpc_respond_error(req, ESHUTDOWN, "peer is shutting down");
        return;
    }
    if (msg->method == PEER_METHOD_INFO) {
        peer_msg reply;
        peer_msg_init(&reply, PEER_KIND_REPLY, PEER_METHOD_INFO, 0);
        reply.meta = s->info_json;
        reply.meta_len = strlen(s->info_json);
        peer_rpc_respond(req, &reply);
        return;
    }
    int compute = msg->method == PEER_METHOD_FORWARD || msg->method == PEER_METHOD_BACKWARD ||
                  msg->method == PEER_METHOD_INFER;
    const struct svc_handler *h =
        (unsigned)msg->method < PEER_SERVICE_MAX_METHODS ? &s->handlers[msg->method] : NULL;
    if (!compute && (!h || !h->fn)) {
        peer_rpc_respond_error(req, ENOSYS, "unknown method");
        return;
    }
    int i = find_block(s, msg->block);
    if (!compute) {
        int rc = h->fn(h->ctx, req, msg, i);
        if (rc == -ENOENT)
            respond_not_hosted(req, msg);
        else if (rc != 0) /* a handler that failed without answering */
            peer_rpc_respond_error(req, rc < 0 ? -rc : EIO, "the request could not be handled");
    } else if (i < 0) {
        respond_not_hosted(req, msg);
    } else {
        handle_compute(s, &s->blocks[i], req, msg);
    }
}

static void build_info(peer_service *s)
{
    size_t off = 0, cap = sizeof s->info_json;
    off += (size_t)snprintf(s->info_json + off, cap - off,
                            "{\"model\":\"%s\",\"max_batch\":%d,\"blocks\":[", s->model, s->cfg.max_batch);
    for (int i = 0; i < s->n_blocks && off < cap; i++) {
        const svc_block *b = &s->blocks[i];
        off += (size_t)snprintf(s->info_json + off, cap - off,
                                "%s{\"name\":\"%s\",\"in\":%d,\"out\":%d,\"hash\":\"%016" PRIx64 "\"}",
                                i ? "," : "", b->name, b->cfg.in, b->cfg.out, b->stage_hash);
    }
    if (off < cap)
        snprintf(s->info_json + off, cap - off, "]}");
}

static double mono_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Measures forward and backward seconds per row on the block itself,
 * before it serves (the gradients it accumulates are dropped after), so the
 * first announcement already carries a measured throughput. A first
 * forward and backward warm the device up (contexts, matmul plans). Best
 * effort: leaves the batcher's estimate unset when memory is short. */
static void calibrate(peer_service *s, svc_block *b, int max_batch)
{
    int rows = max_batch < 64 ? max_batch : 64;
    expert_workspace *ws = expert_workspace_create_on(&b->cfg, rows, s->be);
    float *x = malloc((size_t)rows * (size_t)b->cfg.in * sizeof(float));
    float *y = malloc((size_t)rows * (size_t)b->cfg.out * sizeof(float));
    float *gx = malloc((size_t)rows * (size_t)b->cfg.in * sizeof(float));
    if (ws && x && y && gx) {
        /* Inputs the block accepts: tokens for an embed stage. */
        int tokens = b->cfg.kind == EXPERT_BLOCK_EMBED;
        for (size_t i = 0; i < (size_t)rows * (size_t)b->cfg.in; i++)
            x[i] = tokens ? (float)(i % (size_t)b->cfg.vocab)
                          : (float)((i * 2654435761u) % 1000) / 1000.0f - 0.5f;
        int rc = expert_block_forward(b->block, ws, y, x, rows, NULL); /* warm-up */
        rc |= expert_block_backward(b->block, ws, gx, y, x, rows, NULL);
        double t0 = mono_s();
        rc |= expert_block_forward(b->block, ws, y, x, rows, NULL);
        double t1 = mono_s();
        rc |= expert_block_backward(b->block, ws, gx, y, x, rows, NULL);
        double t2 = mono_s();
        if (rc == 0)
            peer_batcher_set_speed(b->batcher, (t1 - t0) / rows, (t2 - t1) / rows);
    }
    expert_block_zero_grad(b->block);
    free(x);
    free(y);
    free(gx);
    expert_workspace_destroy(&ws);
}

static void free_blocks(peer_service *s)
{
    for (int i = 0; i < s->n_blocks; i++) {
        svc_block *b = &s->blocks[i];
        peer_batcher_destroy(&b->batcher);
        expert_workspace_destroy(&b->inline_ws);
        pool_free(b);
        pthread_mutex_destroy(&b->pool_mu);
        expert_block_destroy(&b->block);
    }
    s->n_blocks = 0;
}

/* A line in the service's log (config log, else stderr); any thread. */
#define svc_log(s, ...) peer_log((s)->cfg.log, __VA_ARGS__)

/* Removes the temporary files that killed checkpoint writes of block b left
 * (expert_ckpt_clean_tmp: only a writer that is gone, never a write in
 * flight) and says how much they held. */
static void clean_stale_tmp(peer_service *s, svc_block *b)
{
    uint64_t bytes = 0;
    int n = expert_ckpt_clean_tmp(b->ckpt_path, &bytes);
    if (n > 0)
        svc_log(s, "%s: removed %d stale temporary checkpoint file%s (%" PRIu64 " bytes)", b->name, n,
                n == 1 ? "" : "s", bytes);
    else if (n < 0)
        svc_log(s, "%s: cannot look for stale temporary checkpoint files: %s", b->name, strerror(-n));
}

/* Checks cfg, finds its model and makes the checkpoint directory. Returns
 * the model, or NULL with a sentence in err. */
static const struct expert_model_spec *check_config(const peer_service_config *cfg, char *err, size_t errlen)
{
    if (!cfg->self || !cfg->model || !cfg->blocks || cfg->n_blocks < 1 ||
        cfg->n_blocks > PEER_SERVICE_MAX_BLOCKS || cfg->threads < 1 || cfg->max_batch < 1 ||
        cfg->infer_inline_rows < 0 || cfg->infer_inline_rows > cfg->max_batch ||
        cfg->keep_activations < 0 || cfg->keep_activations > PEER_BATCHER_MAX_KEEP ||
        cfg->max_queue_rows < cfg->max_batch) {
        snprintf(err, errlen, "invalid service configuration");
        return NULL;
    }
    if (expert_optim_check(&cfg->optim) != 0) {
        snprintf(err, errlen, "invalid optimizer settings");
        return NULL;
    }
    const struct expert_model_spec *spec = expert_model_find(cfg->model);
    if (!spec) {
        snprintf(err, errlen, "unknown model '%s'", cfg->model);
        return NULL;
    }
    if (cfg->checkpoint_dir) {
        struct stat st;
        if (stat(cfg->checkpoint_dir, &st) != 0 && mkdir(cfg->checkpoint_dir, 0700) != 0) {
            snprintf(err, errlen, "cannot create checkpoint directory '%s': %s", cfg->checkpoint_dir,
                     strerror(errno));
            return NULL;
        }
    }
    return spec;
}

/* Restores block b from its checkpoint in dir when there is one (after
 * removing stale temporary files). Returns 0, or -1 with a sentence in err. */
static int restore_block(peer_service *s, svc_block *b, const char *dir, char *err, size_t errlen)
{
    char name[sizeof b->name];
    memcpy(name, b->name, sizeof name); /* a copy: gcc's -Wrestrict sees b->name in *b */
    snprintf(b->ckpt_path, sizeof b->ckpt_path, "%s/%s.ckpt", dir, name);
    clean_stale_tmp(s, b);
    struct stat st;
    if (stat(b->ckpt_path, &st) != 0)
        return 0;
    char why[PATH_MAX + 512];
    int rc = expert_block_load(b->block, b->ckpt_path, why, sizeof why);
    if (rc != 0) {
        /* Not started, so the file is not overwritten by our next
         * checkpoint: it may be the only copy of a stage. */
        snprintf(err, errlen,
                 "cannot restore %s: %s. The file is left as it is: give it the name of the "
                 "stage it holds, or move it away to start %s fresh",
                 b->name, why, b->name);
        return -1;
    }
    if (why[0])
        svc_log(s, "warning: %s", why);
    b->restored = 1;
    b->has_state = 1;
    return 0;
}

/* Checks that block b (its config set) fits in the device's free memory:
 * its state, one workspace per compute thread and the inference thread,
 * the calibration's workspace, and its kept forwards (allocated on first
 * use, so reserved). On the CPU nothing is checked (the kernel's
 * overcommit decides). Returns 0, or -1 with a sentence in err. */
static int check_memory(peer_service *s, const peer_service_config *cfg, svc_block *b, char *err,
                        size_t errlen)
{
    const expert_backend *be = s->be;
    if (be->host_memory)
        return 0;
    size_t state = expert_block_bytes(&b->cfg, be);
    size_t ws = expert_workspace_bytes(&b->cfg, be, cfg->max_batch);
    int calib_rows = cfg->max_batch < 64 ? cfg->max_batch : 64;
    size_t acts = (size_t)(cfg->threads + 1) * ws + expert_workspace_bytes(&b->cfg, be, calib_rows);
    size_t kept = (size_t)cfg->keep_activations * (size_t)cfg->max_batch *
                  expert_kept_floats(&b->cfg, be) * sizeof(float);
    /* Headroom for the device's own needs (matmul workspace, scratch). */
    size_t need = state + acts + kept + ((size_t)64 << 20);
    size_t avail = 0, total = 0;
    if (be->mem_info(be, &avail, &total) != 0) {
        snprintf(err, errlen, "cannot read the free memory of %s: %s", be->name,
                 expert_backend_last_error());
        return -1;
    }
    avail = avail > s->reserved ? avail - s->reserved : 0;
    if (need > avail) {
        char n[32], f[32], st[32], ac[32], kp[32];
        snprintf(err, errlen,
                 "stage %s needs %s on %s (weights, gradients and optimizer state %s; activations "
                 "of %d compute thread%s at --max-batch %d %s; %d kept forward%s %s) but %s is free; "
                 "lower --max-batch or --keep-activations, host fewer stages, or use a larger device",
                 b->name, peer_device_bytes(n, sizeof n, need), be->name,
                 peer_device_bytes(st, sizeof st, state), cfg->threads + 1, cfg->threads ? "s" : "",
                 cfg->max_batch, peer_device_bytes(ac, sizeof ac, acts), cfg->keep_activations,
                 cfg->keep_activations == 1 ? "" : "s", peer_device_bytes(kp, sizeof kp, kept),
                 peer_device_bytes(f, sizeof f, avail));
        return -1;
    }
    s->reserved += kept;
    return 0;
}

/* Hosts stage idx of cfg's model as the next block: its block (restored
 * from its checkpoint when present), its batcher, its speed. Returns 0, or
 * -1 with a sentence in err (the block, if counted, is freed with the
 * others). */
/* The --init-weights file's slice for block b (stage idx): a safetensors
 * file under Hugging Face's names (by its ".safetensors" suffix), else a
 * flat weight file of the whole model. A fallback the safetensors loader
 * took (a tied head, no head bias) is logged. */
static int load_init_weights(peer_service *s, svc_block *b, int idx, char *err, size_t errlen)
{
    const char *path = s->cfg.init_weights;
    size_t n = strlen(path);
    if (n < 12 || strcmp(path + n - 12, ".safetensors") != 0)
        return expert_block_load_flat(b->block, s->spec, idx, path, err, errlen);
    char note[600];
    int rc = expert_block_load_safetensors(b->block, s->spec, idx, path, err, errlen, note, sizeof note);
    if (rc == 0 && note[0])
        peer_log(s->cfg.log, "block %s: %s", b->name, note);
    return rc;
}

static int open_block(peer_service *s, const peer_service_config *cfg, int idx, char *err, size_t errlen)
{
    svc_block *b = &s->blocks[s->n_blocks];
    if (block_of_stage(s, idx)) {
        snprintf(err, errlen, "stage %d listed twice", idx);
        return -1;
    }
    if (expert_model_stage(s->spec, idx, &b->cfg) != 0) {
        snprintf(err, errlen, "model %s has no stage %d (stages 0..%d)", s->spec->name, idx,
                 s->spec->n_stages - 1);
        return -1;
    }
    b->svc = s;
    b->index = idx;
    expert_stage_name(b->name, sizeof b->name, s->spec, idx);
    b->stage_hash = expert_stage_hash(s->spec, idx);
    pthread_mutex_init(&b->pool_mu, NULL);
    b->pool_cap = cfg->max_queue_rows + (cfg->threads + 2) * cfg->max_batch + 16;
    s->n_blocks++;
    if (check_memory(s, cfg, b, err, errlen) != 0)
        return -1;
    b->block = expert_block_create_on(&b->cfg, expert_stage_seed(cfg->seed, idx), s->be);
    if (!b->block) {
        snprintf(err, errlen, "out of memory for block %s on %s%s%s", b->name, s->be->name,
                 expert_backend_last_error()[0] ? ": " : "", expert_backend_last_error());
        return -1;
    }
    /* Checkpoints and downloaded state then record and check the stage. */
    if (expert_block_set_stage(b->block, s->spec, idx) != 0) {
        snprintf(err, errlen, "cannot name block %s", b->name);
        return -1;
    }
    expert_block_set_guard(b->block, &cfg->guard);
    if (cfg->init_weights && load_init_weights(s, b, idx, err, errlen) != 0)
        return -1;
    if (cfg->checkpoint_dir && restore_block(s, b, cfg->checkpoint_dir, err, errlen) != 0)
        return -1;
    peer_batcher_config bc = {cfg->threads, cfg->max_batch, cfg->max_queue_rows, cfg->optim, 1,
                              cfg->train_idle, b->index, cfg->keep_activations};
    b->batcher = peer_batcher_create(b->block, &bc);
    if (!b->batcher) {
        snprintf(err, errlen, "cannot start compute threads for %s", b->name);
        return -1;
    }
    calibrate(s, b, cfg->max_batch);
    return 0;
}

/* The RPC server, its frames sized for the widest block's requests (at
 * most two (max_batch, width) tensors) and for state chunks. */
static peer_rpc_server *create_rpc(peer_service *s, const peer_service_config *cfg)
{
    peer_rpc_server_config rc = {0};
    rc.self = cfg->self;
    rc.swarm_key = cfg->swarm_key;
    size_t widest = 0;
    for (int i = 0; i < s->n_blocks; i++) {
        size_t w = (size_t)(s->blocks[i].cfg.in + s->blocks[i].cfg.out);
        if (w > widest)
            widest = w;
    }
    rc.max_frame = (size_t)cfg->max_batch * widest * sizeof(float) + 65536;
    if (rc.max_frame < PEER_STATE_CHUNK + 65536)
        rc.max_frame = PEER_STATE_CHUNK + 65536; /* state downloads */
    rc.max_conns = cfg->rpc_max_conns;
    rc.max_conns_per_ip = cfg->rpc_max_conns_per_ip;
    rc.max_handshakes = cfg->rpc_max_handshakes;
    rc.idle_timeout_ms = cfg->rpc_idle_timeout_ms;
    rc.handler = handle;
    rc.arg = s;
    return peer_rpc_server_create(s->loop, &rc);
}

peer_service *peer_service_create(uv_loop_t *loop, const peer_service_config *cfg, char *err,
                                  size_t errlen)
{
    char dummy[1];
    if (!err) {
        err = dummy;
        errlen = sizeof dummy;
    }
    const struct expert_model_spec *spec = loop && cfg ? check_config(cfg, err, errlen) : NULL;
    if (!spec) {
        if (!loop || !cfg)
            snprintf(err, errlen, "invalid service configuration");
        return NULL;
    }
    peer_service *s = calloc(1, sizeof *s);
    if (!s) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    s->loop = loop;
    s->cfg = *cfg;
    s->be = cfg->backend ? cfg->backend : expert_backend_cpu();
    s->formats = cfg->formats ? cfg->formats & PEER_FMT_MASK_ALL : PEER_FMT_MASK_ALL;
    s->formats |= PEER_FMT_BIT(PEER_FMT_F32); /* every peer takes float32 */
    randombytes_buf(&s->sr_base, sizeof s->sr_base);
    s->cfg.blocks = NULL; /* borrowed pointers are not kept */
    s->cfg.self = NULL;
    s->cfg.model = NULL;
    s->cfg.checkpoint_dir = NULL;
    s->cfg.swarm_key = NULL;
    s->spec = spec;
    snprintf(s->model, sizeof s->model, "%s", spec->name);
    for (int i = 0; i < cfg->n_blocks; i++)
        if (open_block(s, cfg, cfg->blocks[i], err, errlen) != 0)
            goto fail;
    build_info(s);
    s->rpc = create_rpc(s, cfg);
    if (!s->rpc) {
        snprintf(err, errlen, "cannot create the RPC server");
        goto fail;
    }
    return s;
fail:
    free_blocks(s);
    free(s);
    return NULL;
}

int peer_service_set_handler(peer_service *s, peer_method method, peer_service_handler fn, void *ctx,
                             void (*release)(void *ctx))
{
    if (!s || (unsigned)method >= PEER_SERVICE_MAX_METHODS || method == PEER_METHOD_INFO ||
        method == PEER_METHOD_FORWARD || method == PEER_METHOD_BACKWARD || method == PEER_METHOD_INFER)
        return -EINVAL;
    struct svc_handler *h = &s->handlers[method], old = *h;
    h->fn = fn;
    h->ctx = fn ? ctx : NULL;
    h->release = fn ? release : NULL;
    if (old.release)
        old.release(old.ctx);
    return 0;
}

/* Releases every handler's context: no request reaches them any more. */
static void release_handlers(peer_service *s)
{
    for (int m = 0; m < PEER_SERVICE_MAX_METHODS; m++)
        if (s->handlers[m].fn)
            peer_service_set_handler(s, (peer_method)m, NULL, NULL, NULL);
}

int peer_service_listen(peer_service *s, const struct sockaddr *addr)
{
    if (!s || !addr || s->closing)
        return -EINVAL;
    return peer_rpc_server_listen(s->rpc, addr);
}

int peer_service_port(const peer_service *s)
{
    return s && s->rpc ? peer_rpc_server_port(s->rpc) : -1;
}

void peer_service_get_rpc_stats(const peer_service *s, peer_rpc_server_stats *out)
{
    memset(out, 0, sizeof *out);
    if (s && s->rpc)
        peer_rpc_server_get_stats(s->rpc, out);
}

int peer_service_n_blocks(const peer_service *s)
{
    return s ? s->n_blocks : 0;
}

int peer_service_block_info(peer_service *s, int i, peer_block_info *info)
{
    if (!s || !info || i < 0 || i >= s->n_blocks)
        return -EINVAL;
    svc_block *b = &s->blocks[i];
    memset(info, 0, sizeof *info);
    snprintf(info->name, sizeof info->name, "%s", b->name);
    info->index = b->index;
    info->stage_hash = b->stage_hash;
    info->in = b->cfg.in;
    info->out = b->cfg.out;
    info->restored = b->restored;
    info->version = expert_block_version(b->block);
    info->has_state = b->has_state || info->version > 0;
    if (b->batcher)
        peer_batcher_get_stats(b->batcher, &info->stats);
    struct expert_block_health h;
    expert_block_health(b->block, &h);
    info->refused_requests = b->refused_requests;
    info->refused_steps = h.refused_steps;
    info->still_steps = h.still_steps;
    info->frozen = h.frozen;
    return 0;
}

int peer_service_install_state(peer_service *s, int i, const void *buf, size_t len)
{
    if (!s || i < 0 || i >= s->n_blocks || !buf)
        return -EINVAL;
    int rc = expert_block_deserialize(s->blocks[i].block, buf, len);
    if (rc == 0)
        s->blocks[i].has_state = 1;
    return rc;
}

struct expert_block *peer_service_block(peer_service *s, int i)
{
    return s && i >= 0 && i < s->n_blocks ? s->blocks[i].block : NULL;
}

void peer_service_note_state(peer_service *s, int i)
{
    if (s && i >= 0 && i < s->n_blocks)
        s->blocks[i].has_state = 1;
}

int peer_service_checkpoint(peer_service *s)
{
    int first = 0;
    if (!s)
        return -EINVAL;
    for (int i = 0; i < s->n_blocks; i++) {
        svc_block *b = &s->blocks[i];
        if (!b->ckpt_path[0])
            continue;
        int rc = expert_block_save(b->block, b->ckpt_path, 1);
        if (rc != 0 && first == 0)
            first = rc;
        clean_stale_tmp(s, b);
    }
    return first;
}

static void on_rpc_closed(peer_rpc_server *srv, void *arg)
{
    (void)srv;
    peer_service *s = arg;
    /* Every request handed to us has been answered: the queues are empty,
     * so stopping the workers finishes at once. */
    for (int i = 0; i < s->n_blocks; i++)
        peer_batcher_destroy(&s->blocks[i].batcher);
    int ck = peer_service_checkpoint(s);
    if (s->close_cb)
        s->close_cb(s, ck, s->close_arg);
}

void peer_service_stop(peer_service *s, void (*cb)(peer_service *, int, void *), void *arg)
{
    if (!s || s->closing)
        return;
    s->closing = 1;
    s->close_cb = cb;
    s->close_arg = arg;
    peer_rpc_server_stop(s->rpc, on_rpc_closed, s);
}

void peer_service_destroy(peer_service **pp)
{
    if (!pp || !*pp)
        return;
    peer_service *s = *pp;
    peer_rpc_server_destroy(&s->rpc);
    release_handlers(s);
    free_blocks(s);
    free(s);
    *pp = NULL;
}
