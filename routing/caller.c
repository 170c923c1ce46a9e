/* routing/caller.c: stage calls to the swarm's holders: connections,
 * replica choice, failures, waits, the log and the loop (see caller.h). */
#include "routing/caller.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "net/rpc_client.h"
#include "net/stagecall.h"
#include "net/tensorfmt.h"

/* A stage's row shapes: what its requests carry and its replies hold. */
typedef struct stage_shape {
    int nin, nout;
    uint64_t rin[2], rout[2];
    size_t in_w, out_w;       /* floats per row */
    int exact_inputs;         /* token inputs (an embed stage): always f32 */
} stage_shape;

struct route_caller {
    uv_loop_t *loop;
    route_caller_config cfg;
    route_transport tr;
    route_swarm *swarm;
    route_conns *conns;            /* the real transport's (NULL with a fake) */
    stage_shape shapes[ROUTE_PIPELINE_MAX_STAGES];
    uint8_t *scratch;              /* encoded tensors of the request being built */
    size_t scratch_cap;
    uint64_t sr_count;             /* gradients encoded so far */
    route_caller_call *done_head, *done_tail; /* completed calls, oldest first */
    int pumping, pump_again;
    uv_timer_t timer;
    int timer_started, timer_closed;
    int finishing, rc;
    uint64_t rng;
    long errors;
    long lookups_seen;             /* swarm lookups when connections were last pruned */
    route_waits waits;
    route_errlog errs;             /* which failures to log, and the counts for summaries */
    double probe_at[ROUTE_PIPELINE_MAX_STAGES]; /* last probe of a stage whose replicas were all banned */
    route_caller_call *parked;     /* calls waiting for a connection being set up */
};

double route_caller_now(const route_caller *r)
{
    (void)r;
    return (double)uv_hrtime() * 1e-9;
}

route_swarm *route_caller_swarm(route_caller *r)
{
    return r->swarm;
}

uint64_t *route_caller_rng(route_caller *r)
{
    return &r->rng;
}

long route_caller_errors(const route_caller *r)
{
    return r ? r->errors : 0;
}

int route_caller_finishing(const route_caller *r)
{
    return r->finishing;
}

void route_caller_note(route_caller *r, const char *fmt, ...)
{
    char msg[640];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (r->cfg.on_message)
        r->cfg.on_message(r->cfg.message_arg, msg);
}

const char *route_caller_stage_name(route_caller *r, int stage)
{
    route_stage *st = stage >= 0 && stage < route_swarm_n_stages(r->swarm) ? route_swarm_stage(r->swarm, stage) : NULL;
    return st ? st->name : "?";
}

int route_caller_log_once(route_caller *r, int stage, int code, const char *sentence)
{
    return route_errlog_add(&r->errs, stage, code, sentence);
}

static void pump(route_caller *r);

/* ---- completions ---- */

/* c is done (replied: status 0, or failed): queued for route_caller_reap. */
static void complete(route_caller *r, route_caller_call *c, int status)
{
    c->status = status;
    c->sent = 0;
    c->queued = 1;
    c->done_next = NULL;
    if (r->done_tail)
        r->done_tail->done_next = c;
    else
        r->done_head = c;
    r->done_tail = c;
}

route_caller_call *route_caller_reap(route_caller *r)
{
    route_caller_call *c = r ? r->done_head : NULL;
    if (!c)
        return NULL;
    r->done_head = c->done_next;
    if (!r->done_head)
        r->done_tail = NULL;
    c->done_next = NULL;
    c->queued = 0;
    return c;
}

/* ---- parked calls ---- */

static void park(route_caller *r, route_caller_call *c, const route_holder *h)
{
    memcpy(c->holder, h->rep.id, DHT_ID_LEN);
    snprintf(c->addr, sizeof c->addr, "%s", h->ann.addr);
    if (c->parked)
        return;
    c->parked = 1;
    c->park_prev = NULL;
    c->park_next = r->parked;
    if (r->parked)
        r->parked->park_prev = c;
    r->parked = c;
}

static void unpark(route_caller *r, route_caller_call *c)
{
    if (!c->parked)
        return;
    if (c->park_prev)
        c->park_prev->park_next = c->park_next;
    else
        r->parked = c->park_next;
    if (c->park_next)
        c->park_next->park_prev = c->park_prev;
    c->parked = 0;
    c->park_prev = c->park_next = NULL;
}

/* ---- the log ---- */

static const char *err_name(int code)
{
    switch (code) {
    case ERANGE: return "ERANGE";
    case EBUSY: return "EBUSY";
    case ENOENT: return "ENOENT";
    case EINVAL: return "EINVAL";
    case EIO: return "EIO";
    case ENOSYS: return "ENOSYS";
    case ESHUTDOWN: return "ESHUTDOWN";
    case ENOMEM: return "ENOMEM";
    case ETIMEDOUT: return "ETIMEDOUT";
    case ECONNRESET: return "ECONNRESET";
    case ECANCELED: return "ECANCELED";
    case ENOTCONN: return "ENOTCONN";
    case EPIPE: return "EPIPE";
    default: return "error";
    }
}

static const char *method_name(peer_method m)
{
    return m == PEER_METHOD_FORWARD ? "forward" : m == PEER_METHOD_BACKWARD ? "backward" : "infer";
}

/* A failed call: counted, and logged when it is the first of its (stage,
 * code); later ones go into the summary lines (summarize). code: an error
 * reply's errno (> 0) or the transport's -errno. */
static void log_failure(route_caller *r, const route_caller_call *c, int code, const char *why)
{
    if (r->finishing || code == -ECANCELED)
        return; /* we cancelled it: closing, or dropping a connection after another call failed on it */
    r->errors++;
    char hex[DHT_ID_HEX_LEN + 1];
    dht_id_to_hex(hex, c->holder);
    const char *kind = method_name(c->method);
    const char *name = route_caller_stage_name(r, c->stage);
    char sentence[160];
    if (code < 0)
        snprintf(sentence, sizeof sentence, "%s", strerror(-code));
    else
        snprintf(sentence, sizeof sentence, "%s", why && *why ? why : "(no reason given)");
    if (!route_errlog_add(&r->errs, c->stage, code, sentence))
        return;
    if (code == ERANGE && c->method == PEER_METHOD_BACKWARD)
        route_caller_note(r, "stage %s refused a backward: %s (holder %.8s; sent to another replica, at most %d "
                             "refusals per micro-batch; further refusals are summarised every %.0f s)",
                          name, sentence, hex, r->cfg.max_refusals, ROUTE_ERRLOG_PERIOD_S);
    else if (code > 0)
        route_caller_note(r, "stage %s (holder %.8s) answered a%s %s with %s: %s; trying other replicas", name, hex,
                          c->method == PEER_METHOD_INFER ? "n" : "", kind, err_name(code), sentence);
    else
        route_caller_note(r, "a%s %s call to stage %s (holder %.8s at %s) failed: %s; trying other replicas",
                          c->method == PEER_METHOD_INFER ? "n" : "", kind, name, hex, c->addr, sentence);
}

typedef struct summary {
    route_caller *r;
    char buf[600];
    size_t len;
} summary;

static void summary_line(void *arg, const route_errlog_kind *k)
{
    summary *sm = arg;
    route_caller *r = sm->r;
    if (sm->len >= sizeof sm->buf - 1)
        return;
    const char *name = route_caller_stage_name(r, k->stage);
    char part[300];
    if (r->cfg.summary_part && r->cfg.summary_part(r->cfg.arg, k, part, sizeof part))
        ;
    else if (k->code == ERANGE)
        snprintf(part, sizeof part, "stage %s refused %ld backward%s (latest: %.100s)", name, k->pending,
                 k->pending == 1 ? "" : "s", k->last);
    else if (k->code > 0)
        snprintf(part, sizeof part, "stage %s: %ld %s error%s (latest: %.80s)", name, k->pending,
                 err_name(k->code), k->pending == 1 ? "" : "s", k->last);
    else
        snprintf(part, sizeof part, "stage %s: %ld failed call%s (%s)", name, k->pending,
                 k->pending == 1 ? "" : "s", k->last);
    int n = snprintf(sm->buf + sm->len, sizeof sm->buf - sm->len, "%s%s", sm->len ? "; " : "", part);
    if (n > 0)
        sm->len += (size_t)n < sizeof sm->buf - sm->len ? (size_t)n : sizeof sm->buf - sm->len - 1;
}

/* At most one line every ROUTE_ERRLOG_PERIOD_S (and, with last,
 * one at the end): the failures not logged one by one since the last. */
static void summarize(route_caller *r, int last)
{
    summary sm = {.r = r};
    long dropped = r->errs.dropped;
    if (route_errlog_flush(&r->errs, last ? HUGE_VAL : route_caller_now(r), summary_line, &sm) > 0)
        route_caller_note(r, "more failures since the last report: %s", sm.buf);
    /* Kinds beyond the errlog's table have no line of their own: say how
     * many there were, so no failure goes unmentioned. */
    if (dropped > 0 && (last || sm.len > 0)) {
        route_caller_note(r, "%ld more failures of other kinds (not itemised)", dropped);
        r->errs.dropped = 0;
    }
}

/* ---- connections ---- */

/* A connection came up: the holder is alive, so a ban from earlier failures
 * ends (this is how a probe of a banned holder brings it back). */
void route_caller_conn_ready(route_caller *r, const uint8_t id[DHT_ID_LEN], const char *addr)
{
    route_swarm_unban(r->swarm, id, addr);
    pump(r);
}

/* A holder we could not connect to is banned in every stage it serves at
 * that address, and the calls parked on the connection complete with the
 * failure: the client sends each again (to another replica when there is
 * one). Every such failure is logged (the tests count them). */
void route_caller_conn_failed(route_caller *r, const uint8_t id[DHT_ID_LEN], const char *addr, int status)
{
    if (status >= 0)
        status = -EIO;
    route_swarm_ban(r->swarm, id, addr, route_caller_now(r), &r->rng);
    for (route_caller_call *c = r->parked, *nx; c; c = nx) {
        nx = c->park_next;
        if (memcmp(c->holder, id, DHT_ID_LEN) || strcmp(c->addr, addr))
            continue;
        unpark(r, c);
        c->refused = 0;
        complete(r, c, status);
    }
    char hex[DHT_ID_HEX_LEN + 1];
    dht_id_to_hex(hex, id);
    route_caller_note(r, "cannot connect to holder %.12s at %s: %s; trying other replicas", hex, addr,
                      strerror(-status));
    pump(r);
}

/* route_conns_retain: a connection stays while some stage announces its
 * holder at its address. */
static int conn_announced(void *arg, const uint8_t id[DHT_ID_LEN], const char *addr)
{
    route_caller *r = arg;
    for (int s = 0; s < route_swarm_n_stages(r->swarm); s++) {
        route_holder *h = route_swarm_find_holder(r->swarm, s, id);
        if (h && !strcmp(h->ann.addr, addr))
            return 1;
    }
    return 0;
}

/* After new lookups: close connections to addresses no longer announced
 * (a holder that moved gets a new connection; the old one goes). */
static void prune_conns(route_caller *r)
{
    long lookups = 0;
    for (int s = 0; s < route_swarm_n_stages(r->swarm); s++)
        lookups += route_swarm_stage(r->swarm, s)->lookups;
    if (lookups == r->lookups_seen)
        return;
    r->lookups_seen = lookups;
    r->tr.retain(r->tr.ctx, conn_announced, r);
}

/* ---- the real transport: the DHT and routing/conns.c ---- */

static int real_lookup(void *ctx, const uint8_t key[DHT_ID_LEN], dht_get_cb cb, void *ud)
{
    route_caller *r = ctx;
    return dht_get(r->cfg.dht, key, cb, ud);
}

static int real_ready(void *ctx, const uint8_t id[DHT_ID_LEN], const char *addr, uint64_t *serial)
{
    route_caller *r = ctx;
    return route_conns_get(r->conns, id, addr, serial) != NULL;
}

static int real_call(void *ctx, const uint8_t id[DHT_ID_LEN], const char *addr, const peer_msg *m,
                     uint64_t timeout_ms, peer_rpc_reply_cb cb, void *cb_arg, uint64_t *serial)
{
    route_caller *r = ctx;
    peer_rpc_client *cl = route_conns_get(r->conns, id, addr, serial);
    if (!cl)
        return -EINPROGRESS;
    return peer_rpc_call(cl, m, timeout_ms, cb, cb_arg, NULL);
}

static void real_drop(void *ctx, const uint8_t id[DHT_ID_LEN], const char *addr)
{
    route_caller *r = ctx;
    route_conns_drop(r->conns, id, addr);
}

static void real_retain(void *ctx, int (*keep)(void *arg, const uint8_t id[DHT_ID_LEN], const char *addr),
                        void *arg)
{
    route_caller *r = ctx;
    route_conns_retain(r->conns, keep, arg);
}

static void real_close_all(void *ctx)
{
    route_caller *r = ctx;
    route_conns_close_all(r->conns);
}

static int real_open(void *ctx)
{
    route_caller *r = ctx;
    return route_conns_open(r->conns);
}

static void on_conn_ready(void *arg, const uint8_t id[DHT_ID_LEN], const char *addr)
{
    route_caller_conn_ready(arg, id, addr);
}

static void on_conn_failed(void *arg, const uint8_t id[DHT_ID_LEN], const char *addr, int status)
{
    route_caller_conn_failed(arg, id, addr, status);
}

/* r->tr for the DHT and real connections. Returns 0 or -ENOMEM. */
static int open_real_transport(route_caller *r)
{
    /* The handshake is bounded by the call timeout too. */
    route_conns_config cc = {.ident = r->cfg.ident,
                             .swarm_key = r->cfg.swarm_key,
                             .max_pending = r->cfg.max_pending,
                             .on_ready = on_conn_ready,
                             .on_failed = on_conn_failed,
                             .arg = r,
                             .connect_timeout_ms = (uint64_t)(r->cfg.call_timeout_s * 1000)};
    r->conns = route_conns_create(r->loop, &cc);
    r->tr = (route_transport){.ctx = r,
                              .lookup = real_lookup,
                              .ready = real_ready,
                              .call = real_call,
                              .drop = real_drop,
                              .retain = real_retain,
                              .close_all = real_close_all,
                              .open = real_open};
    return r->conns ? 0 : -ENOMEM;
}

/* ---- outcomes ---- */

/* Sent call c failed: logged (code and why as in log_failure), the
 * replica's in-flight count and (unless it refused) its ban updated, the
 * connection closed when drop is set, then c completes with status. */
static void call_failed(route_caller *r, route_caller_call *c, int status, int code, const char *why, int drop,
                        int refused)
{
    log_failure(r, c, code, why);
    route_holder *h = route_swarm_find_holder(r->swarm, c->stage, c->holder);
    if (h) {
        if (h->rep.inflight > 0)
            h->rep.inflight--;
        /* Not when the holder has since moved: the new address did not fail. */
        if (!refused && !strcmp(h->ann.addr, c->addr))
            route_replica_failure(&h->rep, route_caller_now(r), &r->rng);
    }
    /* Still marked sent while the drop fails the connection's other calls. */
    if (drop)
        r->tr.drop(r->tr.ctx, c->holder, c->addr);
    c->refused = refused;
    complete(r, c, status);
}

static void on_error_reply(route_caller *r, route_caller_call *c, const peer_msg *m)
{
    int code = m->err_code > 0 ? m->err_code : EIO;
    if (code == ENOENT)
        for (int s = c->stage; s < c->stage + (c->span > 0 ? c->span : 1); s++)
            route_swarm_invalidate(r->swarm, s);
    int refused = code == ERANGE && c->method == PEER_METHOD_BACKWARD;
    call_failed(r, c, -code, code, m->err_msg, 0, refused);
}

/* Reads reply m of call c: its weight versions (one per stage served; a
 * span of more than one stage must name them) and its rows, of the last
 * stage served's output shape (a backward's: the stage's input shape),
 * into c->out. Returns the stages served, or -EBADMSG. */
static int read_reply(route_caller *r, route_caller_call *c, const peer_msg *m)
{
    int n = peer_meta_versions_decode(m->meta, m->meta_len, c->versions, c->span);
    if (c->span > 1 && n < 1)
        return -EBADMSG;
    int served = n >= 1 ? n : 1;
    const stage_shape *sh = &r->shapes[c->stage + served - 1];
    int backward = c->method == PEER_METHOD_BACKWARD;
    if (peer_stagecall_reply_rows(m, backward ? sh->nin : sh->nout, backward ? sh->rin : sh->rout,
                                  (uint64_t)c->rows, c->out, c->out_cap) != 0)
        return -EBADMSG;
    c->n_versions = n > 0 ? n : 0;
    c->served = served;
    c->bytes_received = m->t[0].nbytes;
    return served;
}

/* A reply read: the replica's latency and rate, per stage served. */
static void call_done(route_caller *r, const route_caller_call *c, double rtt)
{
    route_holder *h = route_swarm_find_holder(r->swarm, c->stage, c->holder);
    if (!h)
        return;
    if (h->rep.inflight > 0)
        h->rep.inflight--;
    route_replica_success(&h->rep, rtt / c->served);
    route_replica_measured(&h->rep, c->rows, rtt / c->served);
}

static void on_rpc_reply(void *arg, int status, const peer_msg *m)
{
    route_caller_call *c = arg;
    route_caller *r = c->caller;
    if (status != 0) {
        int st = status < 0 ? status : -EIO;
        call_failed(r, c, st, st, NULL, st != -ETIMEDOUT, 0);
    } else if (m->kind == PEER_KIND_ERROR) {
        on_error_reply(r, c, m);
    } else if (m->kind != PEER_KIND_REPLY) {
        call_failed(r, c, -EBADMSG, EBADMSG, "an unexpected message", 1, 0);
    } else if (read_reply(r, c, m) < 0) {
        call_failed(r, c, -EBADMSG, EBADMSG, "a reply of the wrong shape", 1, 0);
    } else {
        call_done(r, c, route_caller_now(r) - c->t_sent);
        complete(r, c, 0);
    }
    pump(r);
}

/* ---- sending ---- */

/* The stage's online holders as replicas (copies) in reps[0..n), with
 * their indices in st->holders in map. */
static int online_replicas(const route_stage *st, route_replica *reps, int *map)
{
    int n = 0;
    for (int i = 0; i < st->n_holders; i++)
        if (st->holders[i].ann.state == PEER_STATE_ONLINE) {
            reps[n] = st->holders[i].rep;
            map[n++] = i;
        }
    return n;
}

/* The call's preferences: fills skip with the replicas it avoids while one
 * not avoided is available (not banned), and returns its pin's index when
 * the pin is not banned and not avoided (or every replica is), else -1. */
static int preferences(const route_caller_call *c, const route_replica *reps, int n, double now, uint8_t *skip)
{
    uint8_t avoid[ROUTE_MAX_HOLDERS] = {0};
    int all_avoided = n > 0, other = 0, first = -1;
    for (int i = 0; i < n; i++) {
        for (int k = 0; k < c->n_avoid && c->avoid; k++)
            if (!memcmp(reps[i].id, c->avoid[k], DHT_ID_LEN))
                avoid[i] = 1;
        all_avoided &= avoid[i];
        if (!avoid[i] && route_replica_weight(&reps[i], now) > 0)
            other = 1;
        if (c->pin && !memcmp(reps[i].id, c->pin, DHT_ID_LEN))
            first = i;
    }
    for (int i = 0; other && i < n; i++)
        skip[i] = avoid[i];
    if (first >= 0 && ((avoid[first] && !all_avoided) || route_replica_weight(&reps[first], now) <= 0))
        first = -1;
    return first;
}

/* How many stages from c's on holder id serves in one request: each
 * announced online by it and not backed off there, at most c->max_span. */
static int span_of(route_caller *r, const route_caller_call *c, const uint8_t id[DHT_ID_LEN], double now)
{
    int n = 1, S = route_swarm_n_stages(r->swarm);
    if (c->method != PEER_METHOD_INFER)
        return 1;
    while (n < c->max_span && c->stage + n < S) {
        route_holder *h = route_swarm_find_holder(r->swarm, c->stage + n, id);
        if (!h || h->ann.state != PEER_STATE_ONLINE || route_replica_weight(&h->rep, now) <= 0)
            break;
        n++;
    }
    return n;
}

/* Room for c's tensors encoded (half for the inputs, half for the
 * gradient). Returns 0 or -ENOMEM. */
static int ensure_scratch(route_caller *r, const route_caller_call *c)
{
    const stage_shape *sh = &r->shapes[c->stage];
    size_t w = sh->in_w > sh->out_w ? sh->in_w : sh->out_w;
    size_t need = 2 * ((size_t)c->rows * w * sizeof(float) + 64);
    if (need <= r->scratch_cap)
        return 0;
    uint8_t *p = realloc(r->scratch, need);
    if (!p)
        return -ENOMEM;
    r->scratch = p;
    r->scratch_cap = need;
    return 0;
}

/* Encodes c for holder h into m (meta into meta): the wire format when h
 * takes it, a backward's pinned version when h is the pin, an infer's
 * span. Returns 0 or -errno. */
static int encode(route_caller *r, route_caller_call *c, const route_holder *h, int pinned, peer_msg *m,
                  uint8_t *meta, double now)
{
    const stage_shape *sh = &r->shapes[c->stage];
    int backward = c->method == PEER_METHOD_BACKWARD;
    peer_dtype fmt = PEER_DTYPE_F32;
    int block = 0;
    if (r->cfg.wire_format != PEER_FMT_F32 && peer_fmt_mask_has(h->ann.formats, (peer_fmt)r->cfg.wire_format)) {
        fmt = (peer_dtype)r->cfg.wire_format;
        block = fmt != PEER_DTYPE_Q8 ? 0 : r->cfg.wire_block ? r->cfg.wire_block : PEER_FMT_Q8_BLOCK;
        if (ensure_scratch(r, c) != 0)
            return -ENOMEM;
    }
    c->span = span_of(r, c, h->rep.id, now);
    peer_stagecall sc = {
        .rows = (uint64_t)c->rows,
        .x = c->x,
        .nin = sh->nin,
        .rin = sh->rin,
        .dy = backward ? c->dy : NULL,
        .nout = sh->nout,
        .rout = sh->rout,
        .fmt = fmt,
        .block = block,
        .exact_inputs = sh->exact_inputs,
        .sr_seed = backward ? (r->cfg.sr_base ^ ++r->sr_count) * 0xD1B54A32D192ED03ull : 0,
        .at_version_known = backward && pinned && c->pin_version_known,
        .at_version = c->pin_version,
        .span = c->span,
        .scratch = r->scratch,
        .scratch_cap = r->scratch_cap,
    };
    c->compressed = fmt != PEER_DTYPE_F32;
    return peer_stagecall_encode(m, meta, &sc);
}

/* Sends c to holder h of stage st (its connection is up). Returns the
 * transport's result. */
static int send_to(route_caller *r, route_caller_call *c, route_stage *st, route_holder *h, int pinned,
                   double now, uint64_t *serial)
{
    peer_msg m;
    uint8_t meta[PEER_META_U64_LEN];
    peer_msg_init(&m, PEER_KIND_REQUEST, c->method, 0);
    snprintf(m.block, sizeof m.block, "%s", st->name);
    int rc = encode(r, c, h, pinned, &m, meta, now);
    if (rc != 0)
        return rc;
    rc = r->tr.call(r->tr.ctx, h->rep.id, h->ann.addr, &m, (uint64_t)(r->cfg.call_timeout_s * 1000), on_rpc_reply,
                    c, serial);
    if (rc == 0) {
        c->bytes_sent = 0;
        for (int i = 0; i < m.n_tensors; i++)
            c->bytes_sent += m.t[i].nbytes;
    }
    return rc;
}

/* A request that holder h's connection would not take, for a reason
 * other than backpressure (-EMSGSIZE, -EINVAL, -ENOMEM): said, not
 * swallowed, though the call is not counted as failed (it was not sent). */
static void log_unsent(route_caller *r, const route_caller_call *c, const route_holder *h, int rc)
{
    char sentence[160], hex[DHT_ID_HEX_LEN + 1];
    snprintf(sentence, sizeof sentence, "cannot be sent: %s", strerror(-rc));
    if (r->finishing || !route_errlog_add(&r->errs, c->stage, rc, sentence))
        return;
    dht_id_to_hex(hex, h->rep.id);
    route_caller_note(r, "a%s %s call to stage %s (holder %.8s at %s) %s; trying other replicas",
                      c->method == PEER_METHOD_INFER ? "n" : "", method_name(c->method),
                      route_caller_stage_name(r, c->stage), hex, h->ann.addr, sentence);
}

/* The replica to try: the pinned one first, else a random pick; when
 * every candidate is banned, the one whose ban ends first, at most every
 * ROUTE_PROBE_S per stage (a dead holder costs a refused connection; one
 * that came back is used at once, rather than after its ban). */
static int choose(route_caller *r, int stage, const route_replica *reps, int n, const uint8_t *skip, int first,
                  int tries, double now)
{
    int k = first >= 0 && tries == 0 ? first : route_pick_replica(reps, n, skip, now, &r->rng, NULL);
    if (k < 0 && tries == 0) {
        if (now - r->probe_at[stage] < ROUTE_PROBE_S)
            return -1;
        k = route_pick_probe(reps, n, skip, now);
        if (k >= 0)
            r->probe_at[stage] = now;
    }
    return k < 0 ? -1 : k;
}

/* c went out to holder h over connection serial. */
static void mark_sent(route_caller_call *c, route_holder *h, uint64_t serial, double now)
{
    memcpy(c->holder, h->rep.id, DHT_ID_LEN);
    snprintf(c->addr, sizeof c->addr, "%s", h->ann.addr);
    c->conn = serial;
    c->t_sent = now;
    c->sent = 1;
    h->rep.inflight++;
}

int route_caller_send(route_caller *r, route_caller_call *c)
{
    if (!r || !c || c->sent || c->queued || r->finishing || c->stage < 0 ||
        c->stage >= route_swarm_n_stages(r->swarm))
        return 0;
    c->caller = r;
    c->status = c->refused = c->served = c->n_versions = c->compressed = 0;
    c->span = 1;
    c->bytes_sent = c->bytes_received = 0;
    route_stage *st = route_swarm_stage(r->swarm, c->stage);
    double now = route_caller_now(r);
    route_replica reps[ROUTE_MAX_HOLDERS];
    int map[ROUTE_MAX_HOLDERS];
    int n = online_replicas(st, reps, map);
    route_waits_mark(&r->waits, c->stage, n > 0, now);
    if (n == 0)
        return 0;
    uint8_t skip[ROUTE_MAX_HOLDERS] = {0};
    int first = preferences(c, reps, n, now, skip);
    int waiting = 0;
    for (int tries = 0; tries < n; tries++) {
        int k = choose(r, c->stage, reps, n, skip, first, tries, now);
        if (k < 0)
            return 0;
        skip[k] = 1;
        route_holder *h = &st->holders[map[k]];
        uint64_t serial = 0;
        if (!r->tr.ready(r->tr.ctx, h->rep.id, h->ann.addr, &serial)) {
            /* Connecting (or failed to start): the call waits for the
             * first such holder unless another replica takes it. */
            if (!waiting) {
                waiting = 1;
                park(r, c, h);
            }
            continue;
        }
        int rc = send_to(r, c, st, h, k == first, now, &serial);
        if (rc == 0) {
            unpark(r, c);
            mark_sent(c, h, serial, now);
            return 1;
        }
        if (rc == -ENOTCONN) {
            /* Dropping fails that connection's other calls (they complete;
             * the pump that follows may send c), and the stage's holders
             * may change. */
            r->tr.drop(r->tr.ctx, h->rep.id, h->ann.addr);
            return 0;
        }
        if (rc != -EAGAIN && rc != -EINPROGRESS)
            log_unsent(r, c, h, rc);
    }
    return 0;
}

/* ---- the loop ---- */

static void check_waits(route_caller *r)
{
    char msg[320], err[320];
    int rc = route_waits_check(&r->waits, r->swarm, route_caller_now(r), r->cfg.max_wait_s, err, sizeof err, msg,
                               sizeof msg);
    if (rc < 0) {
        if (r->cfg.error && r->cfg.error_len > 0)
            snprintf(r->cfg.error, r->cfg.error_len, "%s", err);
        route_caller_finish(r, rc);
    } else if (rc > 0) {
        route_caller_note(r, "%s", msg);
    }
}

/* One pass: the swarm view, the log, the client, the waits. Never nested:
 * an event inside a pass (a send that dropped a connection, a pump asked
 * for) runs another pass after it, at most ROUTE_CALLER_PASSES in a row;
 * the timer brings the next. */
#define ROUTE_CALLER_PASSES 16
static void pump(route_caller *r)
{
    if (r->finishing)
        return;
    if (r->pumping) {
        r->pump_again = 1;
        return;
    }
    r->pumping = 1;
    for (int pass = 0; pass < ROUTE_CALLER_PASSES && !r->finishing; pass++) {
        r->pump_again = 0;
        route_swarm_refresh(r->swarm, route_caller_now(r));
        prune_conns(r);
        summarize(r, 0);
        r->cfg.pump(r->cfg.arg);
        if (r->finishing)
            break;
        check_waits(r);
        if (!r->pump_again)
            break;
    }
    r->pumping = 0;
}

static void on_timer(uv_timer_t *t)
{
    pump(t->data);
}

void route_caller_pump(route_caller *r)
{
    if (r && r->timer_started)
        pump(r);
}

static void on_timer_closed(uv_handle_t *h)
{
    route_caller *r = h->data;
    r->timer_closed = 1;
}

void route_caller_finish(route_caller *r, int rc)
{
    if (!r || r->finishing)
        return;
    summarize(r, 1);
    r->finishing = 1;
    r->rc = rc;
    if (r->timer_started) {
        uv_timer_stop(&r->timer);
        uv_close((uv_handle_t *)&r->timer, on_timer_closed);
    }
    /* Parked calls were never sent: nothing follows for them. */
    while (r->parked)
        unpark(r, r->parked);
    r->tr.close_all(r->tr.ctx);
}

/* Each stage's row shapes, from the model. */
static void read_shapes(route_caller *r)
{
    for (int s = 0; s < r->cfg.model->n_stages; s++) {
        struct expert_block_config bc;
        stage_shape *sh = &r->shapes[s];
        expert_model_stage(r->cfg.model, s, &bc);
        sh->nin = expert_block_row_shape(&bc, 0, sh->rin);
        sh->nout = expert_block_row_shape(&bc, 1, sh->rout);
        sh->in_w = sh->out_w = 1;
        for (int i = 0; i < sh->nin; i++)
            sh->in_w *= (size_t)sh->rin[i];
        for (int i = 0; i < sh->nout; i++)
            sh->out_w *= (size_t)sh->rout[i];
        /* Token values must arrive exact. */
        sh->exact_inputs = bc.kind == EXPERT_BLOCK_EMBED;
    }
}

route_caller *route_caller_create(uv_loop_t *loop, const route_caller_config *cfg)
{
    if (!loop || !cfg || !cfg->pump || !cfg->model || (!cfg->transport && (!cfg->dht || !cfg->ident)) ||
        cfg->model->n_stages < 1 || cfg->model->n_stages > ROUTE_PIPELINE_MAX_STAGES)
        return NULL;
    route_caller *r = calloc(1, sizeof *r);
    if (!r)
        return NULL;
    r->loop = loop;
    r->cfg = *cfg;
    if (!(r->cfg.call_timeout_s > 0))
        r->cfg.call_timeout_s = 30;
    if (!(r->cfg.max_wait_s > 0))
        r->cfg.max_wait_s = 120;
    if (!(r->cfg.refresh_s > 0))
        r->cfg.refresh_s = 10;
    if (r->cfg.max_refusals <= 0)
        r->cfg.max_refusals = ROUTE_PIPELINE_MAX_REFUSALS;
    r->rng = cfg->rng_seed ? cfg->rng_seed : 1;
    for (int s = 0; s < ROUTE_PIPELINE_MAX_STAGES; s++)
        r->probe_at[s] = -1e30;
    read_shapes(r);
    int rc = 0;
    if (cfg->transport)
        r->tr = *cfg->transport;
    else
        rc = open_real_transport(r);
    if (rc == 0)
        r->swarm = route_swarm_create_with(r->tr.lookup, r->tr.ctx, cfg->model, r->cfg.refresh_s);
    if (rc != 0 || !r->swarm) {
        route_caller_destroy(&r);
        return NULL;
    }
    return r;
}

int route_caller_start(route_caller *r)
{
    if (!r || r->timer_started)
        return -EINVAL;
    if (r->finishing) /* finished before it ran: nothing to start */
        return 0;
    uv_update_time(r->loop);
    route_errlog_init(&r->errs, ROUTE_ERRLOG_PERIOD_S, route_caller_now(r));
    uv_timer_init(r->loop, &r->timer);
    r->timer.data = r;
    r->timer_started = 1;
    uv_timer_start(&r->timer, on_timer, 0, ROUTE_CALLER_PUMP_MS);
    return 0;
}

int route_caller_closed(const route_caller *r)
{
    return r->finishing && (!r->timer_started || r->timer_closed) && r->tr.open(r->tr.ctx) == 0;
}

int route_caller_rc(const route_caller *r)
{
    return r->rc;
}

int route_caller_run(route_caller *r)
{
    int rc = route_caller_start(r);
    if (rc != 0)
        return rc;
    /* The DHT keeps the loop alive, so run until our own handles are closed. */
    while (!route_caller_closed(r))
        uv_run(r->loop, UV_RUN_ONCE);
    return r->rc;
}

void route_caller_destroy(route_caller **pr)
{
    if (!pr || !*pr)
        return;
    route_caller *r = *pr;
    if (r->conns)
        route_conns_destroy(&r->conns);
    else if (r->tr.destroy)
        r->tr.destroy(r->tr.ctx);
    route_swarm_destroy(&r->swarm);
    free(r->scratch);
    free(r);
    *pr = NULL;
}
