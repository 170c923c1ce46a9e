/* peer/rebalance.h: a peer started without --blocks: which span of
 * stages it starts on, and moving it when the swarm's balance changes.
 *
 * It lives in routing/ because it needs the swarm view (routing/swarm.h),
 * which sits above peer/; peer/ stays a daemon that serves a fixed set of
 * stages. A move is the daemon's graceful stop (offline announcement,
 * checkpoints) and a start on the new span, on the same port.
 *
 * Two parts:
 * - Decisions, pure: they read a view of the swarm, one route_stage per
 *   stage as route_swarm_stage returns it (a NULL view or NULL stage: no
 *   holders seen), and score each stage in holder-equivalents: the stage's
 *   total announced throughput divided by its fastest holder's. Throughput
 *   alone would make intrinsically cheap stages (a small input projection)
 *   look well served and expensive ones starved however many holders they
 *   have. The span arithmetic is swarm/balance.h's.
 * - The rebalancer: owns a running daemon and a timer; every every_s
 *   seconds (+-50% jitter, so peers that started together do not re-check
 *   together) it looks up every stage again, decides, and moves.
 *
 * Loop thread only.
 */
#ifndef PEER_REBALANCE_H
#define PEER_REBALANCE_H

#include <stdint.h>
#include <stdio.h>

#include <uv.h>

#include "dht/dht.h"
#include "expert/model.h"
#include "peer/daemon.h"
#include "routing/swarm.h"

/* Move only to a span served less than this fraction of ours. */
#define ROUTE_REBALANCE_RATIO 0.5
/* A warranted move is left to the highest node ID among the peers sharing
 * our span; a peer with --blocks never moves, so after yielding on this
 * many checks in a row we go anyway. */
#define ROUTE_REBALANCE_MAX_YIELDS 3

/* --- Decisions ---------------------------------------------------------- */

/* How well each of the n stages is served by the online holders other than
 * self_id (NULL: every holder): score[i] in holder-equivalents (the holder
 * count when no holder announces a throughput), holders[i] the count.
 * n <= ROUTE_SWARM_MAX_STAGES. */
void route_rebalance_scores(const route_stage *const *view, int n, const uint8_t *self_id, double *score,
                            int *holders);

/* Other online peers that serve all of [cur, cur+k) and have a higher node
 * ID than self_id: among the peers sharing a span, the highest ID moves.
 * Returns the count or -EINVAL. */
int route_rebalance_outranking(const route_stage *const *view, int n, const uint8_t self_id[DHT_ID_LEN],
                               int cur, int k);

/* The starting span of k stages for a newcomer: the least served one, from
 * a view of every holder (view NULL: nothing seen; the aligned spans, one at
 * random). Returns the start, or -EINVAL; *served (may be NULL) gets the
 * span's holder-equivalents. *rng (not 0) breaks ties. */
int route_rebalance_choose_start(const route_stage *const *view, int n, int k, uint64_t *rng, double *served);

/* A re-check by the peer self_id serving [cur, cur+k): returns 1 and the
 * new start in *to when it should move now, 0 when it stays, -EINVAL.
 * *yielded counts the checks in a row on which a warranted move was left to
 * a peer that outranks us (route_rebalance_outranking); at
 * ROUTE_REBALANCE_MAX_YIELDS we move anyway. Start it at 0. */
int route_rebalance_decide(const route_stage *const *view, int n, const uint8_t self_id[DHT_ID_LEN], int cur,
                           int k, int *yielded, uint64_t *rng, int *to);

/* The first choice of a peer without --blocks, given a DHT node that has
 * joined the swarm (e.g. a light client's): looks up every stage of spec,
 * running loop (d's) until the lookups end, chooses the span and logs
 * "chose stages A-B, the least served span (...)" to log (NULL: stderr).
 * Returns the start or -EINVAL. */
int route_rebalance_first_span(dht *d, uv_loop_t *loop, const struct expert_model_spec *spec, int k,
                               uint64_t *rng, FILE *log);

/* The span [start, start+k) as people read it: "A" or "A-B". */
void route_rebalance_span_name(char *buf, size_t len, int start, int k);

/* --- The rebalancer ----------------------------------------------------- */

/* Passed to on_stopped when a move could not restart the daemon (the
 * rebalancer has logged why). */
#define ROUTE_REBALANCE_RESTART_FAILED 1

typedef struct route_rebalance_config {
    /* Copied; what it points to (identity, keys, initial peers, strings)
     * is borrowed until on_stopped. svc.blocks, svc.n_blocks and listen
     * are the rebalancer's: it sets them for every start. */
    const peer_daemon_config *dc;
    const struct expert_model_spec *spec;
    int k;                        /* span length, 1..PEER_SERVICE_MAX_BLOCKS */
    int start;                    /* first span (route_rebalance_first_span) */
    double every_s;               /* seconds between re-checks; 0: never move */
    uint64_t rng;                 /* tie-break and jitter state, not 0 */
    /* After every start of the daemon, the first included, with the span it
     * serves (valid for the call only): e.g. print where it serves. */
    void (*on_started)(void *arg, peer_daemon *d, const int *blocks, int n_blocks);
    /* Once, when the rebalancer is done (after route_rebalance_stop, or
     * when a move could not restart), after which the owner destroys it
     * (route_rebalance_destroy): status
     * is the daemon's stop status (0 or -errno; 0 for a stop during a
     * move, whose checkpoint failure was logged) or
     * ROUTE_REBALANCE_RESTART_FAILED. */
    void (*on_stopped)(void *arg, int status);
    void *arg;
} route_rebalance_config;

typedef struct route_rebalance route_rebalance;

/* Starts the daemon on [start, start+k) and the re-check timer. Returns
 * NULL with a sentence in err when the daemon does not start (on_stopped is
 * never called then). */
route_rebalance *route_rebalance_start(uv_loop_t *loop, const route_rebalance_config *cfg, char *err,
                                       size_t errlen);

/* Graceful stop: stops re-checking and the daemon (or lets a move in
 * progress end without restarting); on_stopped follows. Calls after the
 * first do nothing. */
void route_rebalance_stop(route_rebalance *rb);

/* Frees a rebalancer whose on_stopped has run. Called earlier, it stops
 * it (when not yet stopping) and frees it once stopped, before on_stopped
 * runs. NULL-safe; sets *p = NULL. */
void route_rebalance_destroy(route_rebalance **p);

#endif
