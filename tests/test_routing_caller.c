/* The call engine (routing/caller.h) over a fake transport: holders that
 * exist only in this file, whose lookups, connections and replies arrive
 * on the loop through timers. Each test describes calls as a client does,
 * sends them from its pump, reaps the outcomes and checks what the engine
 * chose, sent and reported: replica choice with pins and avoid lists, the
 * request's bytes and meta, the reply's rows and versions, spans, error
 * replies and refusals, replies of the wrong shape, connections that come
 * up late or never, stages without holders, and that the pump is never
 * re-entered. Every run is bounded by a watchdog timer. */
#include <errno.h>
#include <string.h>

#include <uv.h>

#include "expert/block.h"
#include "expert/model.h"
#include "net/stagecall.h"
#include "routing/caller.h"
#include "swarm/announce.h"
#include "test_util.h"

#define MAX_H 4
#define ROWS 3
#define RUN_LIMIT_MS 10000

enum { ANSWER, ERR_RANGE, ERR_IO, BAD_SHAPE, SILENT };
enum { UP, SLOW, REFUSE };

typedef struct fake_holder {
    uint8_t id[DHT_ID_LEN];
    char addr[32];
    unsigned stages;            /* bit s: announces stage s online */
    int conn;                   /* UP, SLOW (comes up after 30 ms), REFUSE */
    int connecting;             /* a connection is being set up */
    int connected;
    int mode;                   /* how it answers */
    uint64_t version;           /* the weight version it names per stage */
    int calls;                  /* requests it received */
    int at_version_known;       /* the last request's pinned version */
    uint64_t at_version;
    int span;                   /* the last request's span */
    int x_ok;                   /* the last request carried the call's inputs */
    int banned;                 /* backed off at the run's end (at any stage it serves) */
} fake_holder;

typedef struct fake {
    uv_loop_t loop;
    uv_timer_t watchdog;
    route_caller *r;
    const struct expert_model_spec *m;
    fake_holder h[MAX_H];
    int n;
    int drops;
    const float *expect_x;      /* the inputs the requests must carry */
    /* the client */
    route_caller_call calls[4];
    int n_calls;
    int reaped;                 /* outcomes taken */
    int depth, max_depth;       /* pump nesting */
    int pumps;
    int attempts;               /* retry_step's */
    void (*step)(struct fake *f);
} fake;

typedef struct event {
    uv_timer_t t;
    fake *f;
    int kind;                   /* 0 lookup, 1 reply, 2 connection */
    dht_get_cb cb;
    void *ud;
    uint8_t key[DHT_ID_LEN];
    peer_rpc_reply_cb rcb;
    void *rarg;
    int status;
    int holder;
    peer_msg reply;
    float rows[ROWS * 784];
    uint8_t meta[8 * ROUTE_PIPELINE_MAX_STAGES];
} event;

static void event_closed(uv_handle_t *h)
{
    free(h->data);
}

static void stage_name(const fake *f, int s, char *buf, size_t len)
{
    expert_stage_name(buf, len, f->m, s);
}

/* A lookup's entries: the fake holders announcing that stage. */
static void deliver_lookup(event *e)
{
    fake *f = e->f;
    dht_entry ent[MAX_H];
    uint8_t val[MAX_H][PEER_ANNOUNCE_MAX_BYTES];
    size_t n = 0;
    for (int s = 0; s < f->m->n_stages; s++) {
        char name[65];
        uint8_t key[DHT_ID_LEN];
        stage_name(f, s, name, sizeof name);
        dht_id_of_bytes(key, name, strlen(name));
        if (memcmp(key, e->key, DHT_ID_LEN))
            continue;
        for (int i = 0; i < f->n; i++) {
            if (!(f->h[i].stages & (1u << s)))
                continue;
            peer_announce a = {0};
            snprintf(a.block, sizeof a.block, "%s", name);
            snprintf(a.addr, sizeof a.addr, "%s", f->h[i].addr);
            a.state = PEER_STATE_ONLINE;
            a.stage_hash = expert_stage_hash(f->m, s);
            a.weight_version = f->h[i].version;
            a.throughput = 100;
            a.time_ms = 1000;
            long len = peer_announce_encode(&a, val[n], sizeof val[n]);
            assert_true(len > 0);
            memset(&ent[n], 0, sizeof ent[n]);
            ent[n].subkey = f->h[i].id;
            ent[n].subkey_len = DHT_ID_LEN;
            ent[n].value = val[n];
            ent[n].value_len = (size_t)len;
            ent[n].expires = 60000;
            ent[n].is_signed = 1;
            n++;
        }
    }
    e->cb(NULL, 0, ent, n, e->ud);
}

static void on_event(uv_timer_t *t)
{
    event *e = t->data;
    fake *f = e->f;
    if (e->kind == 0) {
        deliver_lookup(e);
    } else if (e->kind == 1) {
        e->reply.meta = e->reply.meta_len ? e->meta : NULL;
        e->rcb(e->rarg, e->status, e->status == 0 ? &e->reply : NULL);
    } else if (f->r) {
        fake_holder *h = &f->h[e->holder];
        h->connecting = 0;
        h->connected = e->status == 0;
        if (e->status == 0)
            route_caller_conn_ready(f->r, h->id, h->addr);
        else
            route_caller_conn_failed(f->r, h->id, h->addr, e->status);
    }
    uv_close((uv_handle_t *)t, event_closed);
}

static event *event_new(fake *f, int kind, uint64_t after_ms)
{
    event *e = calloc(1, sizeof *e);
    assert_non_null(e);
    e->f = f;
    e->kind = kind;
    uv_timer_init(&f->loop, &e->t);
    e->t.data = e;
    uv_timer_start(&e->t, on_event, after_ms, 0);
    return e;
}

/* ---- the transport ---- */

static int fk_lookup(void *ctx, const uint8_t key[DHT_ID_LEN], dht_get_cb cb, void *ud)
{
    event *e = event_new(ctx, 0, 1);
    memcpy(e->key, key, DHT_ID_LEN);
    e->cb = cb;
    e->ud = ud;
    return 0;
}

static int find(fake *f, const uint8_t id[DHT_ID_LEN])
{
    for (int i = 0; i < f->n; i++)
        if (!memcmp(f->h[i].id, id, DHT_ID_LEN))
            return i;
    return -1;
}

static int fk_ready(void *ctx, const uint8_t id[DHT_ID_LEN], const char *addr, uint64_t *serial)
{
    fake *f = ctx;
    int i = find(f, id);
    assert_true(i >= 0);
    assert_string_equal(addr, f->h[i].addr);
    fake_holder *h = &f->h[i];
    if (h->conn == UP)
        h->connected = 1;
    if (h->connected) {
        *serial = (uint64_t)i + 1;
        return 1;
    }
    if (!h->connecting) {
        h->connecting = 1;
        event *e = event_new(f, 2, 30);
        e->holder = i;
        e->status = h->conn == SLOW ? 0 : -ECONNREFUSED;
    }
    return 0;
}

/* Holder i's answer to m. */
static int fk_call(void *ctx, const uint8_t id[DHT_ID_LEN], const char *addr, const peer_msg *m,
                   uint64_t timeout_ms, peer_rpc_reply_cb cb, void *cb_arg, uint64_t *serial)
{
    fake *f = ctx;
    int i = find(f, id);
    assert_true(i >= 0 && f->h[i].connected);
    fake_holder *h = &f->h[i];
    h->calls++;
    *serial = (uint64_t)i + 1;
    /* The request: the inputs as the client gave them, and the meta. */
    assert_true(m->n_tensors >= 1);
    h->x_ok = f->expect_x && m->t[0].dtype == PEER_DTYPE_F32 && m->t[0].shape[0] == ROWS &&
              !memcmp(m->t[0].data, f->expect_x, m->t[0].nbytes);
    h->at_version_known = 0;
    h->span = 1;
    if (m->method == PEER_METHOD_BACKWARD)
        h->at_version_known = peer_meta_at_version_decode(m->meta, m->meta_len, &h->at_version) == 1;
    if (m->method == PEER_METHOD_INFER)
        assert_true(peer_meta_span_decode(m->meta, m->meta_len, ROUTE_PIPELINE_MAX_STAGES, &h->span) >= 0);
    if (h->span < 1)
        h->span = 1;
    event *e = event_new(f, 1, h->mode == SILENT ? timeout_ms : 1);
    e->rcb = cb;
    e->rarg = cb_arg;
    if (h->mode == SILENT) {
        e->status = -ETIMEDOUT;
        return 0;
    }
    if (h->mode == ERR_RANGE || h->mode == ERR_IO) {
        peer_msg_init(&e->reply, PEER_KIND_ERROR, m->method, m->id);
        e->reply.err_code = h->mode == ERR_RANGE ? ERANGE : EIO;
        snprintf(e->reply.err_msg, sizeof e->reply.err_msg, "fake %d says no", i);
        return 0;
    }
    /* The outputs of the last stage served (a backward's: the stage's
     * input shape), each value naming the holder. */
    int stage = 0;
    for (int s = 0; s < f->m->n_stages; s++) {
        char name[65];
        stage_name(f, s, name, sizeof name);
        if (!strcmp(name, m->block))
            stage = s;
    }
    int last = stage + h->span - 1;
    struct expert_block_config bc;
    expert_model_stage(f->m, m->method == PEER_METHOD_BACKWARD ? stage : last, &bc);
    uint64_t row[2];
    int nrow = expert_block_row_shape(&bc, m->method != PEER_METHOD_BACKWARD, row);
    uint64_t w = row[0] * (nrow > 1 ? row[1] : 1);
    for (uint64_t k = 0; k < ROWS * w; k++)
        e->rows[k] = (float)(i + 1) * 1000.0f + (float)k;
    peer_msg_init(&e->reply, PEER_KIND_REPLY, m->method, m->id);
    uint64_t rows = h->mode == BAD_SHAPE ? ROWS - 1 : ROWS;
    assert_int_equal(peer_tensor_rows(&e->reply.t[0], e->rows, rows, nrow, row), 0);
    e->reply.n_tensors = 1;
    uint64_t v[ROUTE_PIPELINE_MAX_STAGES];
    for (int s = 0; s < h->span; s++)
        v[s] = h->version + (uint64_t)s;
    e->reply.meta_len = peer_meta_versions_encode(e->meta, sizeof e->meta, v, h->span);
    (void)addr;
    return 0;
}

static void fk_drop(void *ctx, const uint8_t id[DHT_ID_LEN], const char *addr)
{
    fake *f = ctx;
    int i = find(f, id);
    (void)addr;
    f->drops++;
    if (i >= 0)
        f->h[i].connected = 0;
}

static void fk_retain(void *ctx, int (*keep)(void *arg, const uint8_t id[DHT_ID_LEN], const char *addr), void *arg)
{
    fake *f = ctx;
    for (int i = 0; i < f->n; i++)
        if (f->h[i].connected && !keep(arg, f->h[i].id, f->h[i].addr))
            f->h[i].connected = 0;
}

static void fk_close_all(void *ctx)
{
    fake *f = ctx;
    for (int i = 0; i < f->n; i++)
        f->h[i].connected = 0;
}

static int fk_open(void *ctx)
{
    (void)ctx;
    return 0;
}

/* ---- the client ---- */

static void pump(void *arg)
{
    fake *f = arg;
    f->depth++;
    f->max_depth = f->depth > f->max_depth ? f->depth : f->max_depth;
    f->pumps++;
    while (route_caller_reap(f->r))
        f->reaped++;
    f->step(f);
    f->depth--;
}

static void on_watchdog(uv_timer_t *t)
{
    fake *f = t->data;
    fail_msg("the engine did not finish within %d ms (%d of %d calls reaped)", RUN_LIMIT_MS, f->reaped, f->n_calls);
}

static void add_holder(fake *f, unsigned stages, int conn, int mode, uint64_t version)
{
    fake_holder *h = &f->h[f->n];
    memset(h, 0, sizeof *h);
    memset(h->id, 0x10 * (f->n + 1), DHT_ID_LEN);
    snprintf(h->addr, sizeof h->addr, "127.0.0.1:%d", 4100 + f->n);
    h->stages = stages;
    h->conn = conn;
    h->mode = mode;
    h->version = version;
    f->n++;
}

static fake *fake_new(void (*step)(fake *f))
{
    fake *f = calloc(1, sizeof *f);
    assert_non_null(f);
    assert_int_equal(uv_loop_init(&f->loop), 0);
    f->m = expert_model_find("fmnist-mlp");
    assert_non_null(f->m);
    f->step = step;
    return f;
}

/* Runs the engine until the client finishes it; returns its rc. */
static int fake_run(fake *f, double max_wait_s, double call_timeout_s)
{
    route_transport tr = {.ctx = f,
                          .lookup = fk_lookup,
                          .ready = fk_ready,
                          .call = fk_call,
                          .drop = fk_drop,
                          .retain = fk_retain,
                          .close_all = fk_close_all,
                          .open = fk_open};
    route_caller_config cc = {.model = f->m,
                              .transport = &tr,
                              .call_timeout_s = call_timeout_s,
                              .max_wait_s = max_wait_s,
                              .rng_seed = 7,
                              .pump = pump,
                              .arg = f};
    f->r = route_caller_create(&f->loop, &cc);
    assert_non_null(f->r);
    uv_timer_init(&f->loop, &f->watchdog);
    f->watchdog.data = f;
    uv_timer_start(&f->watchdog, on_watchdog, RUN_LIMIT_MS, 0);
    int rc = route_caller_run(f->r);
    uv_close((uv_handle_t *)&f->watchdog, NULL);
    /* Events still scheduled (replies to calls nobody waits for) close. */
    uv_run(&f->loop, UV_RUN_NOWAIT);
    route_caller_destroy(&f->r);
    return rc;
}

static void fake_free(fake *f)
{
    uv_run(&f->loop, UV_RUN_DEFAULT); /* lookups still scheduled end */
    assert_int_equal(uv_loop_close(&f->loop), 0);
    free(f);
}

static float X[ROWS * 784], DY[ROWS * 512], OUT[4][ROWS * 512];

static void describe(fake *f, int k, int stage, peer_method method)
{
    route_caller_call *c = &f->calls[k];
    memset(c, 0, sizeof *c);
    c->stage = stage;
    c->method = method;
    c->rows = ROWS;
    c->x = X;
    c->dy = method == PEER_METHOD_BACKWARD ? DY : NULL;
    c->out = OUT[k];
    c->out_cap = sizeof OUT[k] / sizeof(float);
    if (k >= f->n_calls)
        f->n_calls = k + 1;
}

/* Notes which holders the engine backed off, then ends the run. */
static void finish(fake *f)
{
    route_swarm *sw = route_caller_swarm(f->r);
    double now = route_caller_now(f->r);
    for (int i = 0; i < f->n; i++)
        for (int s = 0; s < f->m->n_stages; s++) {
            route_holder *h = route_swarm_find_holder(sw, s, f->h[i].id);
            if (h && route_replica_weight(&h->rep, now) <= 0)
                f->h[i].banned = 1;
        }
    route_caller_finish(f->r, 0);
}

/* Sends every described call not out; finishes once all are reaped. */
static void send_all(fake *f)
{
    if (f->reaped == f->n_calls) {
        finish(f);
        return;
    }
    for (int k = 0; k < f->n_calls; k++)
        if (!f->calls[k].sent && !f->calls[k].queued && f->calls[k].status == 0 && !f->calls[k].served)
            route_caller_send(f->r, &f->calls[k]);
}

/* ---- tests ---- */

/* A forward reaches a holder of its stage with the client's inputs; the
 * reply's rows land in out, with the holder's version; the pump never
 * nests. */
static void test_forward(void **state)
{
    (void)state;
    for (int i = 0; i < ROWS * 784; i++)
        X[i] = (float)i * 0.5f;
    fake *f = fake_new(send_all);
    add_holder(f, 1u << 0, UP, ANSWER, 41);
    f->expect_x = X;
    describe(f, 0, 0, PEER_METHOD_FORWARD);
    assert_int_equal(fake_run(f, 5, 2), 0);
    route_caller_call *c = &f->calls[0];
    assert_int_equal(f->reaped, 1);
    assert_int_equal(c->status, 0);
    assert_int_equal(c->served, 1);
    assert_int_equal(c->n_versions, 1);
    assert_int_equal(c->versions[0], 41);
    assert_memory_equal(c->holder, f->h[0].id, DHT_ID_LEN);
    assert_true(f->h[0].x_ok);
    assert_int_equal(c->bytes_sent, (uint64_t)ROWS * 784 * 4);
    assert_int_equal(c->bytes_received, (uint64_t)ROWS * 512 * 4);
    assert_true(OUT[0][0] == 1000.0f && OUT[0][ROWS * 512 - 1] == 1000.0f + ROWS * 512 - 1);
    assert_int_equal(f->max_depth, 1);
    fake_free(f);
}

/* A backward pinned to the holder that served its forward goes there and
 * names the forward's version; one that avoids a holder goes to the
 * other; a pin that is avoided while another replica is free is not
 * used. */
static void test_pin_and_avoid(void **state)
{
    (void)state;
    for (int round = 0; round < 8; round++) {
        fake *f = fake_new(send_all);
        add_holder(f, 1u << 2, UP, ANSWER, 5);
        add_holder(f, 1u << 2, UP, ANSWER, 6);
        describe(f, 0, 2, PEER_METHOD_BACKWARD);
        f->calls[0].pin = f->h[1].id;
        f->calls[0].pin_version_known = 1;
        f->calls[0].pin_version = 77;
        describe(f, 1, 2, PEER_METHOD_FORWARD);
        static uint8_t avoid[1][DHT_ID_LEN];
        memcpy(avoid[0], f->h[1].id, DHT_ID_LEN);
        f->calls[1].avoid = (const uint8_t(*)[DHT_ID_LEN])avoid;
        f->calls[1].n_avoid = 1;
        describe(f, 2, 2, PEER_METHOD_FORWARD);
        f->calls[2].pin = f->h[1].id;
        f->calls[2].avoid = (const uint8_t(*)[DHT_ID_LEN])avoid;
        f->calls[2].n_avoid = 1;
        assert_int_equal(fake_run(f, 5, 2), 0);
        assert_int_equal(f->reaped, 3);
        assert_memory_equal(f->calls[0].holder, f->h[1].id, DHT_ID_LEN);
        assert_memory_equal(f->calls[1].holder, f->h[0].id, DHT_ID_LEN);
        assert_memory_equal(f->calls[2].holder, f->h[0].id, DHT_ID_LEN);
        /* holder 1 got only the pinned backward, with its version */
        assert_int_equal(f->h[1].calls, 1);
        assert_true(f->h[1].at_version_known);
        assert_int_equal(f->h[1].at_version, 77);
        assert_int_equal(f->calls[0].versions[0], 6);
        fake_free(f);
    }
}

/* An infer call spans the stages one holder serves: one request, one
 * version per stage, the last stage's outputs. */
static void test_span(void **state)
{
    (void)state;
    fake *f = fake_new(send_all);
    add_holder(f, 0x3fu, UP, ANSWER, 100); /* all six stages */
    describe(f, 0, 1, PEER_METHOD_INFER);
    f->calls[0].max_span = 3;
    assert_int_equal(fake_run(f, 5, 2), 0);
    route_caller_call *c = &f->calls[0];
    assert_int_equal(c->status, 0);
    assert_int_equal(f->h[0].calls, 1);
    assert_int_equal(f->h[0].span, 3);
    assert_int_equal(c->served, 3);
    assert_int_equal(c->n_versions, 3);
    assert_int_equal(c->versions[2], 102);
    fake_free(f);

    /* To the last stage: the span stops at the model's end, and the rows
     * are the last stage's (10 wide). */
    f = fake_new(send_all);
    add_holder(f, 0x3fu, UP, ANSWER, 1);
    describe(f, 0, 4, PEER_METHOD_INFER);
    f->calls[0].max_span = 6;
    assert_int_equal(fake_run(f, 5, 2), 0);
    assert_int_equal(f->calls[0].served, 2);
    assert_int_equal(f->calls[0].bytes_received, (uint64_t)ROWS * 10 * 4);
    fake_free(f);
}

/* Failures come back as outcomes: a refusal (ERANGE to a backward) is not
 * a ban, an EIO reply is; a reply of the wrong shape is -EBADMSG and its
 * connection is dropped; a silent holder times out. */
static int outcome_of(int mode, peer_method method, int *drops, int *banned)
{
    fake *f = fake_new(send_all);
    add_holder(f, 1u << 3, UP, mode, 9);
    describe(f, 0, 3, method);
    assert_int_equal(fake_run(f, 5, 0.2), 0);
    assert_int_equal(f->reaped, 1);
    int status = f->calls[0].status;
    *drops = f->drops;
    *banned = f->h[0].banned;
    if (status == -ERANGE)
        assert_int_equal(f->calls[0].refused, method == PEER_METHOD_BACKWARD);
    fake_free(f);
    return status;
}

static void test_failures(void **state)
{
    (void)state;
    int drops, banned;
    assert_int_equal(outcome_of(ANSWER, PEER_METHOD_BACKWARD, &drops, &banned), 0);
    assert_int_equal(drops + banned, 0);
    assert_int_equal(outcome_of(ERR_RANGE, PEER_METHOD_BACKWARD, &drops, &banned), -ERANGE);
    assert_int_equal(drops + banned, 0);
    assert_int_equal(outcome_of(ERR_RANGE, PEER_METHOD_FORWARD, &drops, &banned), -ERANGE);
    assert_int_equal(banned, 1);
    assert_int_equal(outcome_of(ERR_IO, PEER_METHOD_FORWARD, &drops, &banned), -EIO);
    assert_int_equal(drops, 0);
    assert_int_equal(banned, 1);
    assert_int_equal(outcome_of(BAD_SHAPE, PEER_METHOD_FORWARD, &drops, &banned), -EBADMSG);
    assert_int_equal(drops, 1);
    assert_int_equal(banned, 1);
    assert_int_equal(outcome_of(SILENT, PEER_METHOD_FORWARD, &drops, &banned), -ETIMEDOUT);
    assert_int_equal(banned, 1);
}

/* After a failure, the client's retry goes to the other replica: the one
 * that failed is banned; one that refused is not. At most two attempts. */
static void retry_step(fake *f)
{
    route_caller_call *c = &f->calls[0];
    if (f->reaped > 0) {
        f->reaped = 0;
        if (c->status == 0 || ++f->attempts == 2) {
            finish(f);
            return;
        }
    }
    if (!c->sent && !c->queued && (f->attempts == 0 || c->status != 0))
        route_caller_send(f->r, c);
}

static void test_retry_elsewhere(void **state)
{
    (void)state;
    for (int round = 0; round < 6; round++) {
        fake *f = fake_new(retry_step);
        add_holder(f, 1u << 1, UP, ERR_IO, 1);
        add_holder(f, 1u << 1, UP, ANSWER, 2);
        describe(f, 0, 1, PEER_METHOD_FORWARD);
        f->calls[0].pin = f->h[0].id; /* the failing one first */
        assert_int_equal(fake_run(f, 5, 2), 0);
        assert_int_equal(f->calls[0].status, 0);
        assert_memory_equal(f->calls[0].holder, f->h[1].id, DHT_ID_LEN);
        assert_int_equal(f->h[0].calls, 1);
        fake_free(f);
    }
    /* A refusal does not ban: the pinned refuser is asked again. */
    fake *f = fake_new(retry_step);
    add_holder(f, 1u << 1, UP, ERR_RANGE, 1);
    add_holder(f, 1u << 1, UP, ANSWER, 2);
    describe(f, 0, 1, PEER_METHOD_BACKWARD);
    f->calls[0].pin = f->h[0].id;
    assert_int_equal(fake_run(f, 5, 2), 0);
    assert_int_equal(f->calls[0].status, -ERANGE);
    assert_int_equal(f->h[0].calls, 2);
    fake_free(f);
}

/* A connection that comes up late: the call waits for it (parked), then
 * goes out. One that cannot be made: the parked call completes with the
 * failure. */
static void test_connections(void **state)
{
    (void)state;
    fake *f = fake_new(send_all);
    add_holder(f, 1u << 0, SLOW, ANSWER, 3);
    describe(f, 0, 0, PEER_METHOD_FORWARD);
    assert_int_equal(fake_run(f, 5, 2), 0);
    assert_int_equal(f->calls[0].status, 0);
    assert_int_equal(f->h[0].calls, 1);
    fake_free(f);

    f = fake_new(send_all);
    add_holder(f, 1u << 0, REFUSE, ANSWER, 3);
    describe(f, 0, 0, PEER_METHOD_FORWARD);
    assert_int_equal(fake_run(f, 5, 2), 0);
    assert_int_equal(f->calls[0].status, -ECONNREFUSED);
    assert_int_equal(f->calls[0].bytes_sent, 0);
    assert_int_equal(f->h[0].calls, 0);
    fake_free(f);
}

/* A stage nobody holds: the run ends after max_wait_s with -ETIMEDOUT and
 * the call never completes. */
static void test_no_holder(void **state)
{
    (void)state;
    fake *f = fake_new(send_all);
    add_holder(f, 1u << 0, UP, ANSWER, 3);
    describe(f, 0, 5, PEER_METHOD_FORWARD);
    assert_int_equal(fake_run(f, 0.3, 2), -ETIMEDOUT);
    assert_int_equal(f->reaped, 0);
    assert_int_equal(f->h[0].calls, 0);
    fake_free(f);
}

/* A config without a pump, or without a transport and a DHT, is refused. */
static void test_bad_config(void **state)
{
    (void)state;
    uv_loop_t loop;
    uv_loop_init(&loop);
    route_caller_config cc = {.model = expert_model_find("fmnist-mlp")};
    assert_null(route_caller_create(&loop, &cc));
    cc.pump = pump;
    assert_null(route_caller_create(&loop, &cc)); /* no DHT, no transport */
    assert_null(route_caller_reap(NULL));
    uv_loop_close(&loop);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_forward),       cmocka_unit_test(test_pin_and_avoid),
        cmocka_unit_test(test_span),          cmocka_unit_test(test_failures),
        cmocka_unit_test(test_retry_elsewhere), cmocka_unit_test(test_connections),
        cmocka_unit_test(test_no_holder),     cmocka_unit_test(test_bad_config),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
