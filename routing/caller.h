/* routing/caller.h: sending stage calls to the swarm's holders, for any
 * client (the trainer, inference, a language binding).
 *
 * A client asks for "this call, to some holder of stage s"; the caller
 * finds the stage's holders through the DHT (routing/swarm.h), picks a
 * replica at random in proportion to its expected service rate
 * (routing/swarm.h), keeps one encrypted connection per holder
 * (routing/conns.h), sends the request and reports the outcome. It owns
 * everything that is the same for every client:
 *
 * - connections: opened on first use; a holder whose connection comes up
 *   is unbanned, one that cannot be reached is banned in every stage it
 *   serves at that address (logged: "cannot connect to holder ..."), and the
 *   calls that waited for that connection are reported failed; connections
 *   to addresses nobody announces any more are closed after each lookup.
 * - failures: a timeout, a broken connection, an error reply or a reply
 *   of the wrong shape bans the replica for a while (doubling back-off)
 *   and is reported to the client, which sends the call again: the next
 *   route_caller_send picks another replica where there is one. A backward
 *   refused with ERANGE (the holder's gradient checks failed) is a refusal:
 *   the refuser is not banned. An ENOENT reply (the holder no longer serves
 *   the stage) forces a fresh lookup.
 * - probing: when every replica of a stage is banned, the one whose ban
 *   ends first is tried, at most every ROUTE_PROBE_S.
 * - waits: a stage without an online holder is waited for (a line every 5 s)
 *   up to max_wait_s; then the run ends with -ETIMEDOUT and a sentence
 *   naming the stage.
 * - the log: every failure's sentence reaches on_message, the first of each
 *   (stage, error) at once, the rest in one summary line at most every
 *   ROUTE_ERRLOG_PERIOD_S (routing/pipeline.h's route_errlog).
 * - the clock: route_caller_now, from uv_hrtime. uv_now has millisecond
 *   resolution, too coarse for the latencies measured here (a call to a
 *   local holder takes well under a millisecond), so every time the caller
 *   and its clients keep is on this one clock.
 * - the loop: a pump every ROUTE_CALLER_PUMP_MS and after every event,
 *   which calls the client's pump; route_caller_run runs the loop until
 *   route_caller_finish and every handle closed.
 * - the request: the wire format (cfg.wire_format) where the holder
 *   announces it, else f32; token inputs (an embed stage's) always f32;
 *   one stochastic-rounding seed per gradient sent, from cfg.sr_base.
 *
 * A call, from the client's side, is data: it describes what to send (the
 * stage, method, rows, input and gradient tensors, a holder to try first
 * and holders to avoid, where the reply's rows go) and the engine does the
 * rest: it picks the replica, encodes the request (net/stagecall.h: the
 * format the holder accepts, the pinned weight version, an infer's span),
 * sends it, checks the reply's shape and decodes its rows into the call's
 * out buffer, and records the outcome in the call (status, stages served,
 * weight versions, bytes). A finished call, replied or failed, waits in the
 * engine's completion queue until the client takes it with
 * route_caller_reap, from its pump. So one call goes one way: the client
 * describes it and sends it, the engine drives it and hands it back; the
 * client's only hook is its pump.
 *
 * Threads: everything runs on the thread that calls route_caller_run, the
 * libuv loop thread; the pump is called there, from inside
 * route_caller_run, and route_caller_* functions are loop-thread only. The
 * pump is never re-entered: events during it (a dropped connection failing
 * other calls) pump again once it returns.
 *
 * Transport: the engine reaches the swarm through a route_transport: holder
 * lookups (the DHT's dht_get) and calls over connections to holders
 * (routing/conns.h over net/rpc_client.h). route_caller_create opens the
 * real one; a test passes its own (cfg.transport) to drive the engine
 * without sockets.
 *
 * Ownership: the caller borrows the DHT, the identity and the model spec
 * (they must outlive it) and owns its swarm view and connections. Calls
 * (route_caller_call) are the client's memory, usually embedded in its own
 * per-call records: a call, and the tensors it names, must neither move nor
 * be freed from route_caller_send's 1 until route_caller_reap returns it
 * (or route_caller_run has returned).
 */
#ifndef ROUTE_CALLER_H
#define ROUTE_CALLER_H

#include <stddef.h>
#include <stdint.h>

#include <uv.h>

#include "dht/dht.h"
#include "expert/model.h"
#include "net/rpc_client.h"
#include "net/wire.h"
#include "routing/conns.h"
#include "routing/pipeline.h"
#include "routing/swarm.h"

#define ROUTE_CALLER_PUMP_MS 20

typedef struct route_caller route_caller;

/* One call. The client sets the first block of fields before each
 * route_caller_send; the engine fills the outcome when the call completes
 * and keeps the rest (read-only to the client). */
typedef struct route_caller_call {
    int stage;                  /* the (first) stage called */
    peer_method method;         /* PEER_METHOD_FORWARD, _BACKWARD or _INFER */
    int rows;                   /* rows of x, dy and out */
    const float *x;             /* inputs: rows x the stage's input row */
    const float *dy;            /* a backward's gradient of the outputs: rows x its output row */
    float *out;                 /* the reply's rows: a forward's or infer's outputs (of the last */
    size_t out_cap;             /* stage served), a backward's input gradient; out_cap floats */
    int max_span;               /* infer: at most this many consecutive stages in one request, */
                                /* as many as the holder serves online (<= 1: one) */
    const uint8_t *pin;         /* NULL, or the node ID of a holder to try first: used when it is */
                                /* not banned and not avoided (or every replica is avoided) */
    int pin_version_known;      /* a backward sent to the pinned holder names this weight */
    uint64_t pin_version;       /* version (its forward's), so the holder recomputes on it */
    const uint8_t (*avoid)[DHT_ID_LEN]; /* n_avoid holders to pass over while another */
    int n_avoid;                /* replica is available (not banned) */
    void *user;                 /* the client's, e.g. its record holding this call */

    /* The outcome, once route_caller_reap returned the call. */
    int status;                 /* 0: replied; else -errno: the transport's (-ETIMEDOUT, */
                                /* -ECONNRESET, -ECANCELED: we closed the connection), an error */
                                /* reply's code negated, -EBADMSG for a reply of the wrong shape */
    int refused;                /* an ERANGE reply to a backward: not banned (see above) */
    int served;                 /* stages the reply covers (1..span) */
    int n_versions;             /* weight versions the reply named, one per stage served (0: none) */
    uint64_t versions[ROUTE_PIPELINE_MAX_STAGES];
    int compressed;             /* the request's tensors went in cfg.wire_format, not f32 */
    uint64_t bytes_sent;        /* tensor bytes of the request (0 when it was never sent) */
    uint64_t bytes_received;    /* tensor bytes of the reply */

    /* The engine's. */
    int span;                   /* stages asked of the holder */
    int sent;                   /* a request is out: it completes later */
    int parked;                 /* waits for the connection to holder/addr being set up */
    int queued;                 /* completed, waiting for route_caller_reap */
    uint8_t holder[DHT_ID_LEN]; /* the holder it went to (or waits for) */
    char addr[ROUTE_CONNS_ADDR_MAX + 1];
    uint64_t conn;              /* serial of the connection it went over (routing/conns.h) */
    double t_sent;              /* route_caller_now when it went out */
    struct route_caller *caller;
    struct route_caller_call *park_prev, *park_next, *done_next;
} route_caller_call;

/* What the engine sends through (see above). Every function gets ctx. */
typedef struct route_transport {
    void *ctx;
    /* Looks up key (a stage's DHT key: dht_id_of_bytes of its name); cb
     * follows on the loop (d may be NULL). Returns 0 or -errno. */
    int (*lookup)(void *ctx, const uint8_t key[DHT_ID_LEN], dht_get_cb cb, void *ud);
    /* 1 when the connection to holder id at addr is up (*serial: its
     * serial, different for every connection), 0 while it is being set
     * up: opened on first ask; route_caller_conn_ready or
     * route_caller_conn_failed follows. */
    int (*ready)(void *ctx, const uint8_t id[DHT_ID_LEN], const char *addr, uint64_t *serial);
    /* Sends m to holder id at addr over its connection (ready said 1).
     * Returns 0 when it went out (cb follows on the loop, never from
     * inside call), -EAGAIN for backpressure, -ENOTCONN for a broken
     * connection (the engine drops it), or another -errno. m and its
     * tensors are borrowed until it returns. */
    int (*call)(void *ctx, const uint8_t id[DHT_ID_LEN], const char *addr, const peer_msg *m,
                uint64_t timeout_ms, peer_rpc_reply_cb cb, void *cb_arg, uint64_t *serial);
    /* Closes the connection to id at addr (its calls fail, -ECANCELED). */
    void (*drop)(void *ctx, const uint8_t id[DHT_ID_LEN], const char *addr);
    /* Closes every connection for which keep(arg, id, addr) returns 0. */
    void (*retain)(void *ctx, int (*keep)(void *arg, const uint8_t id[DHT_ID_LEN], const char *addr),
                   void *arg);
    /* Closes every connection; open then reaches 0. */
    void (*close_all)(void *ctx);
    /* Connections not yet freed. */
    int (*open)(void *ctx);
    /* Frees ctx once open is 0 (or never started); NULL: nothing to free. */
    void (*destroy)(void *ctx);
} route_transport;

typedef struct route_caller_config {
    dht *dht;                               /* started and joined; borrowed (not needed with transport) */
    const dht_identity *ident;              /* for the RPC handshakes; borrowed (likewise) */
    const uint8_t *swarm_key;               /* 32 bytes or NULL; copied */
    const struct expert_model_spec *model;  /* borrowed; at most ROUTE_PIPELINE_MAX_STAGES stages */
    const route_transport *transport;       /* NULL: the DHT and real connections; else copied, */
                                            /* its ctx borrowed (a test's fake) */
    double call_timeout_s;                  /* one RPC, and a connection's set-up (0: 30) */
    double max_wait_s;                      /* a stage without holders (0: 120) */
    double refresh_s;                       /* holder lookups (0: 10) */
    int max_pending;                        /* requests outstanding per connection */
    int max_refusals;                       /* named in the refusal line (0: ROUTE_PIPELINE_MAX_REFUSALS) */
    int wire_format;                        /* peer_fmt for the tensors where the holder takes it (0: f32) */
    int wire_block;                         /* q8's block (0: PEER_FMT_Q8_BLOCK) */
    uint64_t sr_base;                       /* stochastic rounding: gradient n's seed derives from it */
    uint64_t rng_seed;                      /* replica choice and bans (route_caller_rng) */
    char *error;                            /* why the run stopped early goes here: the */
    size_t error_len;                       /* client's result buffer, or NULL */
    /* The client's part of a pump: take the completed calls
     * (route_caller_reap), start work, and call route_caller_send for each
     * call not yet sent. Required. May call any route_caller_* function
     * but route_caller_run and route_caller_destroy. */
    void (*pump)(void *arg);
    /* Optional: words for a summary line's part about an errlog kind the
     * client added itself (route_caller_log_once); returns 1 when it wrote
     * buf, 0 for the generic wording. */
    int (*summary_part)(void *arg, const route_errlog_kind *k, char *buf, size_t len);
    void *arg;                              /* pump's and summary_part's */
    void (*on_message)(void *arg, const char *msg);  /* log lines, or NULL */
    void *message_arg;
} route_caller_config;

/* Returns a caller, or NULL on a bad config (no pump, no DHT or identity
 * without a transport, no model, too many stages) or no memory. Nothing
 * happens on the loop before route_caller_run. */
route_caller *route_caller_create(uv_loop_t *loop, const route_caller_config *cfg);

/* Runs the loop, pumping, until route_caller_finish and until every handle
 * of the caller has closed (the DHT's stay open). Returns the rc given to
 * route_caller_finish: 0, the client's, or -ETIMEDOUT (a stage had no
 * holder for max_wait_s; cfg.error says which). Call it once. */
int route_caller_run(route_caller *r);

/* For a client whose own thread runs the loop (a language binding with
 * several callers on one loop): starts the pump timer and returns at once
 * (0, or -EINVAL when already started). route_caller_closed is 1 once
 * route_caller_finish was called and every handle of the caller has
 * closed; route_caller_rc is the rc given to route_caller_finish. */
int route_caller_start(route_caller *r);

/* 1 once finished and every handle of r has closed (see route_caller_start). */
int route_caller_closed(const route_caller *r);

/* The rc given to route_caller_finish (0 before). */
int route_caller_rc(const route_caller *r);

/* Pumps now (the client queued work and wants it sent without waiting for
 * the next ROUTE_CALLER_PUMP_MS tick). Loop thread; inside the pump it
 * only asks for another pass. */
void route_caller_pump(route_caller *r);

/* Ends the run with rc: the last summary line, then every connection is
 * closed; the calls still out complete with -ECANCELED (still reaped with
 * route_caller_reap, though the pump no longer runs); parked calls are
 * let go without completing. Later calls do nothing. */
void route_caller_finish(route_caller *r, int rc);

/* 1 once route_caller_finish was called. */
int route_caller_finishing(const route_caller *r);

/* Frees r, once route_caller_run has returned or if it never ran.
 * NULL-safe; sets *r to NULL. Calls still queued are let go. */
void route_caller_destroy(route_caller **r);

/* Tries to send c (described as above; not sent, not queued). Returns 1
 * when it went out (it completes later), 0 when not now: no online holder
 * (the wait starts), every replica banned, or the chosen holder's
 * connection is being set up (c is then parked on it: when it cannot be
 * made, c completes with that failure). */
int route_caller_send(route_caller *r, route_caller_call *c);

/* The oldest completed call, taken off the queue (c->queued is 0 again),
 * or NULL. Its outcome fields are set; the engine no longer touches it. */
route_caller_call *route_caller_reap(route_caller *r);

/* For a route_transport: the connection to holder id at addr came up, or
 * could not be made (status -errno); loop thread, outside the pump too. */
void route_caller_conn_ready(route_caller *r, const uint8_t id[DHT_ID_LEN], const char *addr);
void route_caller_conn_failed(route_caller *r, const uint8_t id[DHT_ID_LEN], const char *addr, int status);

/* The caller's clock, in seconds (uv_hrtime: see above). */
double route_caller_now(const route_caller *r);

/* The caller's swarm view (its stages and holders), owned by r. */
route_swarm *route_caller_swarm(route_caller *r);

/* The xorshift64* state for the client's own draws (shared with the
 * replica choice, so one seed fixes the run). */
uint64_t *route_caller_rng(route_caller *r);

/* A stage's name ("?" for an unknown stage); owned by r. */
const char *route_caller_stage_name(route_caller *r, int stage);

/* Calls that failed after they were sent: error replies (refusals
 * included), timeouts, broken connections, rejected replies; not those
 * we cancelled ourselves (-ECANCELED) nor those that waited for a
 * connection that could not be made. */
long route_caller_errors(const route_caller *r);

/* A log line through cfg.on_message. */
void route_caller_note(route_caller *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* For the client's own rate-limited lines: records one (stage, code)
 * occurrence with its sentence and returns 1 when it is the first of its
 * kind (print it now) or 0 (it goes into the summary lines, worded by
 * cfg.summary_part). Codes the caller itself uses: errno values (> 0)
 * and negated ones. */
int route_caller_log_once(route_caller *r, int stage, int code, const char *sentence);

#endif
