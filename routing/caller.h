/* routing/caller.h: sending stage calls to the swarm's holders, for any
 * client (the trainer, inference, a language binding).
 *
 * A client asks for "this call, to some holder of stage s"; the caller
 * finds the stage's holders through the DHT (routing/swarm.h), picks a
 * replica at random in proportion to its expected service rate
 * (routing/replica.h), keeps one encrypted connection per holder
 * (routing/conns.h), sends the request and reports the outcome. It owns
 * everything that is the same for every client:
 *
 * - connections: opened on first use; a holder whose connection comes up
 *   is unbanned, one that cannot be reached is banned in every stage it
 *   serves at that address (logged: "cannot connect to holder ..."), and the
 *   calls that waited for that connection are reported failed; connections
 *   to addresses nobody announces any more are closed after each lookup.
 * - failures: a timeout, a broken connection, an error reply or a reply
 *   the client rejects bans the replica for a while (doubling back-off)
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
 *
 * Threads: everything runs on the thread that calls route_caller_run, the
 * libuv loop thread; every hook is called there, from inside
 * route_caller_run, and route_caller_* functions are loop-thread only.
 *
 * Ownership: the caller borrows the DHT, the identity and the model spec
 * (they must outlive it) and owns its swarm view and connections. Calls
 * (route_caller_call) are the client's memory, usually embedded in its own
 * per-call records: a call must neither move nor be freed while it is sent
 * or parked (c->sent or c->parked), i.e. until the caller reports it through
 * on_reply or on_failed, or route_caller_run has returned.
 */
#ifndef ROUTE_CALLER_H
#define ROUTE_CALLER_H

#include <stddef.h>
#include <stdint.h>

#include <uv.h>

#include "dht/dht.h"
#include "expert/model.h"
#include "net/wire.h"
#include "routing/conns.h"
#include "routing/pipeline.h"
#include "routing/replica.h"
#include "routing/swarm.h"

#define ROUTE_CALLER_PUMP_MS 20
#define ROUTE_CALLER_META_MAX 64            /* bytes of request meta build may write */

typedef struct route_caller route_caller;

/* One call. The client sets the first block of fields before
 * route_caller_send; the caller keeps the rest (read-only to the client). */
typedef struct route_caller_call {
    int stage;                  /* the (first) stage called */
    peer_method method;         /* PEER_METHOD_FORWARD, _BACKWARD or _INFER */
    int rows;                   /* rows of its input: for the measured rate */
    int span;                   /* stages asked of the holder (>= 1): set by build */
    void *user;                 /* the client's, e.g. its record holding this call */

    int sent;                   /* a request is out: on_reply or on_failed will follow */
    int parked;                 /* waits for the connection to holder/addr being set up */
    uint8_t holder[DHT_ID_LEN]; /* the holder it went to (or waits for) */
    char addr[ROUTE_CONNS_ADDR_MAX + 1];
    uint64_t conn;              /* serial of the connection it went over (routing/conns.h) */
    double t_sent;              /* route_caller_now when it went out */
    struct route_caller *caller;
    struct route_caller_call *park_prev, *park_next;
} route_caller_call;

/* The client's hooks. Each gets the config's arg and runs on the loop
 * thread. Only pump may call route_caller_send; none may call
 * route_caller_run or route_caller_destroy. The caller pumps after every
 * reply and failure, so on_reply and on_failed need not. */
typedef struct route_caller_hooks {
    /* The client's part of a pump: collect results, start work, and call
     * route_caller_send for each call not yet sent. Required. */
    void (*pump)(void *arg);
    /* Optional: preferences among the stage's online replicas reps[0..n)
     * (copies, in the order build's holders follow). May set avoid[i] = 1
     * for replicas to avoid while one not avoided is available (not
     * banned); returns the index of a replica to try first when it is not
     * banned, or -1. */
    int (*prefer)(void *arg, const route_caller_call *c, const route_replica *reps, int n, double now,
                  uint8_t *avoid);
    /* Fills request m for holder h: m's kind, method and block are set;
     * build adds the tensors (borrowed: they must stay valid until
     * route_caller_send returns) and may write up to ROUTE_CALLER_META_MAX
     * bytes of meta into meta_buf (then m->meta = meta_buf). preferred: h
     * is the replica prefer returned. Sets c->span when it asks for more
     * than one stage. Returns 0, or -errno to skip h. Required. */
    int (*build)(void *arg, route_caller_call *c, const route_holder *h, int preferred, peer_msg *m,
                 uint8_t *meta_buf);
    /* A reply arrived for sent call c (c->sent still 1). m and its
     * tensors are valid for the duration of the hook only. Returns the
     * number of stages it served (>= 1: accepted; the round trip divided
     * by it is the replica's latency sample), or a negative errno to reject
     * it as malformed (logged as "a reply of the wrong shape", the replica
     * is banned, its connection closed, and on_failed follows with that
     * errno). Required. */
    int (*on_reply)(void *arg, route_caller_call *c, const peer_msg *m);
    /* Call c failed (c->sent and c->parked are 0): status is a negative
     * errno: the transport's (-ETIMEDOUT, -ECONNRESET, -ECANCELED: we closed
     * the connection), an error reply's code negated, the connection's
     * failure for a parked call, or on_reply's rejection. refused: an
     * ERANGE error reply to a backward (see above). The failure is already
     * logged and the replica backed off; the client sends the call again
     * (or gives up on it). Required. */
    void (*on_failed)(void *arg, route_caller_call *c, int status, int refused);
    /* Optional: formats a summary line's part for an errlog kind the
     * client added itself (route_caller_log_once); returns 1 when it
     * wrote buf, 0 to use the generic wording. */
    int (*summary_part)(void *arg, const route_errlog_kind *k, char *buf, size_t len);
} route_caller_hooks;

typedef struct route_caller_config {
    dht *dht;                               /* started and joined; borrowed */
    const dht_identity *ident;              /* for the RPC handshakes; borrowed */
    const uint8_t *swarm_key;               /* 32 bytes or NULL; copied */
    const struct expert_model_spec *model;  /* borrowed; at most ROUTE_PIPELINE_MAX_STAGES stages */
    double call_timeout_s;                  /* one RPC, and a connection's set-up (0: 30) */
    double max_wait_s;                      /* a stage without holders (0: 120) */
    double refresh_s;                       /* holder lookups (0: 10) */
    int max_pending;                        /* requests outstanding per connection */
    int max_refusals;                       /* named in the refusal line (0: ROUTE_PIPELINE_MAX_REFUSALS) */
    uint64_t rng_seed;                      /* replica choice and bans (route_caller_rng) */
    char *error;                            /* why the run stopped early goes here: the */
    size_t error_len;                       /* client's result buffer, or NULL */
    route_caller_hooks hooks;
    void *arg;                              /* the hooks' */
    void (*on_message)(void *arg, const char *msg);  /* log lines, or NULL */
    void *message_arg;
} route_caller_config;

/* Returns a caller, or NULL on a bad config (a required hook missing, no
 * DHT, identity or model, too many stages) or no memory. Nothing happens
 * on the loop before route_caller_run. */
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
int route_caller_closed(const route_caller *r);
int route_caller_rc(const route_caller *r);

/* Pumps now (the client queued work and wants it sent without waiting for
 * the next ROUTE_CALLER_PUMP_MS tick). Loop thread, outside the hooks. */
void route_caller_pump(route_caller *r);

/* Ends the run with rc: the last summary line, then every connection is
 * closed; the calls still out fail with -ECANCELED (on_failed, while
 * route_caller_finishing is 1). Later calls do nothing. */
void route_caller_finish(route_caller *r, int rc);
int route_caller_finishing(const route_caller *r);

/* Frees r, once route_caller_run has returned or if it never ran.
 * NULL-safe; sets *r to NULL. */
void route_caller_destroy(route_caller **r);

/* Tries to send c (its stage, method, rows and user set; not sent). Returns
 * 1 when it went out (on_reply or on_failed follows), 0 when not now: no
 * online holder (the wait starts), every replica banned, or the chosen
 * holder's connection is being set up (c is then parked on it: when it
 * cannot be made, on_failed reports c). */
int route_caller_send(route_caller *r, route_caller_call *c);

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
 * hooks.summary_part). Codes the caller itself uses: errno values (> 0)
 * and negated ones. */
int route_caller_log_once(route_caller *r, int stage, int code, const char *sentence);

#endif
