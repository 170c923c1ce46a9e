/* routing/swarm.h: what the DHT says about a model's stages, and the
 * choice among the replicas of one stage.
 *
 * For every stage "<model>.<i>" a route_swarm looks up the holders' signed
 * announcements (swarm/announce.h) through the DHT, at most every refresh_s
 * seconds per stage (sooner while a stage has no usable holder), and keeps
 * one route_holder per holder. What the trainer learns about a holder
 * (latency, failures, bans) lives in its route_replica and survives
 * refreshes, because holders are matched by node ID; a newer announcement
 * (later "t") from a banned holder lifts its ban, since it shows the holder
 * is alive (e.g. back after a restart). A holder whose
 * announcement names another stage hash (another model version) is counted
 * in wrong_hash and never used.
 *
 * Loop thread only. The DHT must stay open until route_swarm_destroy; a
 * lookup still in flight at destroy finishes harmlessly (the swarm object
 * lives until its last callback).
 *
 * Replicas. For every holder the view keeps a route_replica: what the
 * client has observed of it. Choice is randomised in proportion to each
 * replica's expected service rate (as in SWARM parallelism's stochastic
 * wiring), so load spreads over replicas instead of piling onto the single
 * fastest one, and a faster replica still gets more work. A replica that
 * fails is banned for a time that doubles with each consecutive failure (with
 * jitter, so trainers do not retry in lock-step), and a success clears it.
 * The ban is capped low (ROUTE_BAN_MAX_S): a holder that died and comes back
 * must not stay unused for long after its return. When every replica of a
 * stage is banned there is nothing to spread load to, so the caller probes
 * the one whose ban ends first (route_pick_probe) at most every
 * ROUTE_PROBE_S instead of waiting the ban out.
 *
 * Announced throughput is the holder's own word, so it is capped
 * (route_replica_tput): once we have measured a replica, by
 * ROUTE_TPUT_MEASURED_FACTOR times the rate we measured (rows per second
 * of round trip, an EWMA); before that, by the median of the other
 * replicas' announcements. A holder that announces 10^9 samples/s thus
 * gets about the share of a typical replica until it has served us, and
 * then what it serves.
 *
 * The route_replica_* and route_pick_* functions are plain data and pure
 * functions of their arguments (time is passed in), so they are
 * deterministic under a seeded RNG and testable without a network.
 */
#ifndef ROUTE_SWARM_H
#define ROUTE_SWARM_H

#include <stdint.h>

#include "dht/dht.h"
#include "expert/model.h"
#include "swarm/announce.h"
#include "swarm/rng.h"

/* ---- replicas ---- */

#define ROUTE_ID_LEN 20

#ifndef ROUTE_BAN_BASE_S
#define ROUTE_BAN_BASE_S 1.0    /* first ban after a failure */
#endif
#ifndef ROUTE_BAN_MAX_S
#define ROUTE_BAN_MAX_S 10.0    /* longest ban */
#endif
#ifndef ROUTE_PROBE_S
#define ROUTE_PROBE_S 1.0       /* between probes of a stage whose replicas are all banned */
#endif
#ifndef ROUTE_TPUT_MEASURED_FACTOR
#define ROUTE_TPUT_MEASURED_FACTOR 4.0 /* a claim may exceed our measured rate this much */
#endif
#ifndef ROUTE_LATENCY_ALPHA
#define ROUTE_LATENCY_ALPHA 0.2 /* EWMA weight of a new latency sample */
#endif

typedef struct route_replica {
    uint8_t id[ROUTE_ID_LEN];  /* holder's node ID */
    double tput;               /* announced samples/s; <= 0 when unknown */
    double load;               /* announced queue fullness in [0, 1] */
    double latency_s;          /* EWMA of observed round trips; < 0 when none yet */
    double meas_tput;          /* EWMA of rows/s we observed (rows / round trip); <= 0 when none yet */
    int inflight;              /* our requests now in flight to it */
    int failures;              /* consecutive failures */
    double banned_until;       /* no requests before this time (seconds) */
} route_replica;

/* Sets r to a fresh replica with the given ID and announcement. */
void route_replica_init(route_replica *r, const uint8_t id[ROUTE_ID_LEN], double tput, double load);

/* The weight used for random choice: an estimate of requests/s this replica
 * would serve for us, lower when it is loaded, slow or busy with our own
 * requests. Always > 0 and finite for a replica that is not banned; 0 for a
 * banned one at time now. */
double route_replica_weight(const route_replica *r, double now);

/* The throughput to believe of r[i] among the replicas r[0..n) of one
 * stage: its announcement, at most ROUTE_TPUT_MEASURED_FACTOR times our
 * measured rate once there is one, else at most the (upper) median of the
 * other replicas' positive announcements (no cap when there is none).
 * <= 0 when it announced nothing usable. */
double route_replica_tput(const route_replica *r, int n, int i);

/* Picks a replica index among r[0..n), skipping banned ones and any whose
 * index has skip[i] != 0 (skip may be NULL), at random in proportion to
 * route_replica_weight, with each throughput capped by route_replica_tput. *rng is a xorshift64* state (never 0) and is advanced.
 * Returns the index, or -EAGAIN when every candidate is banned or skipped
 * (then *retry_at, if not NULL, receives the earliest time a banned one is
 * free, or 0 when all were skipped), or -EINVAL for bad arguments. */
int route_pick_replica(const route_replica *r, int n, const uint8_t *skip, double now,
                       uint64_t *rng, double *retry_at);

/* When route_pick_replica finds nothing because every candidate (not
 * skipped) is banned at now: the index of the banned candidate whose ban
 * ends first, to probe. Returns -EAGAIN when some candidate is not banned
 * (pick that instead) or there is none, -EINVAL for bad arguments. */
int route_pick_probe(const route_replica *r, int n, const uint8_t *skip, double now);

/* Lifts r's ban (keeping its failure count, so a further failure bans it
 * for longer): the holder showed it is alive again (a newer announcement, a
 * connection that came up). */
void route_replica_unban(route_replica *r);

/* Records a success with its round-trip time: clears the failure count and
 * ban, updates the latency EWMA. */
void route_replica_success(route_replica *r, double rtt_s);

/* Records what one successful call measured: `rows` rows served in
 * rtt_s seconds of round trip (an EWMA of rows / rtt_s, for the cap in
 * route_replica_tput). Ignores non-positive or non-finite input. */
void route_replica_measured(route_replica *r, int rows, double rtt_s);

/* Records a failure at time now: bans for ROUTE_BAN_BASE_S * 2^(failures-1)
 * seconds, capped at ROUTE_BAN_MAX_S, times a jitter factor in [1, 1.25)
 * drawn from *rng. */
void route_replica_failure(route_replica *r, double now, uint64_t *rng);

/* ---- the view ---- */

#define ROUTE_MAX_HOLDERS 64

typedef struct route_holder {
    route_replica rep;        /* id = holder's node ID; routing state */
    peer_announce ann;        /* its latest announcement */
    uint64_t expires_ms;      /* when the DHT entry expires */
} route_holder;

typedef struct route_stage {
    char name[65];            /* "<model>.<i>" */
    int index;
    uint64_t hash;            /* expert_stage_hash: what holders must announce */
    int in, out;              /* widths */
    route_holder holders[ROUTE_MAX_HOLDERS];
    int n_holders;            /* every holder of the latest lookup, any state */
    int wrong_hash;           /* holders seen announcing another hash */
    int lookups;              /* lookups completed */
    int pending;              /* a lookup is in flight */
    int last_status;          /* 0 or the last lookup's -errno */
    double refreshed_at;      /* when the latest lookup completed (seconds) */
} route_stage;

typedef struct route_swarm route_swarm;

/* Returns NULL on bad arguments or no memory. d is borrowed. */
route_swarm *route_swarm_create(dht *d, const struct expert_model_spec *m, double refresh_s);

/* A lookup of key: 0 with cb to follow on the loop (its dht may be NULL),
 * or -errno. dht_get is one (through route_swarm_create). */
typedef int (*route_lookup_fn)(void *ctx, const uint8_t key[DHT_ID_LEN], dht_get_cb cb, void *ud);

/* The same with lookups through fn (ctx borrowed): a test's fake swarm. */
route_swarm *route_swarm_create_with(route_lookup_fn fn, void *ctx, const struct expert_model_spec *m,
                                     double refresh_s);

/* Starts lookups for the stages that are due at time now (seconds, any
 * monotonic clock): never looked up, older than refresh_s, or older than
 * 1 s while the stage has no online holder that is not banned (to see a
 * holder come back, or a new one, soon). Returns the number started. */
int route_swarm_refresh(route_swarm *s, double now);

/* Forces a lookup of stage i at the next refresh (e.g. after every replica
 * failed). */
void route_swarm_invalidate(route_swarm *s, int i);

/* The model's number of stages (0 for NULL), and stage i's view
 * (borrowed; NULL when i is out of range). */
int route_swarm_n_stages(const route_swarm *s);
route_stage *route_swarm_stage(route_swarm *s, int i);

/* Online holders of stage i with the right hash. */
int route_stage_usable(const route_stage *st);

/* Of those, the ones not banned at time now. */
int route_stage_available(const route_stage *st, double now);

/* The holder of stage `stage` with node ID id, or NULL. */
route_holder *route_swarm_find_holder(route_swarm *s, int stage, const uint8_t id[DHT_ID_LEN]);

/* Records a failure of holder id at address addr (at time now) in every
 * stage it announces at that address: for a connection that could not be
 * made, not one call that failed. Two processes may share one identity at
 * different addresses, so the address must match too (addr NULL: any). */
void route_swarm_ban(route_swarm *s, const uint8_t id[DHT_ID_LEN], const char *addr, double now,
                     uint64_t *rng);

/* Lifts the ban of holder id at addr (NULL: any) in every stage: a
 * connection to it came up. */
void route_swarm_unban(route_swarm *s, const uint8_t id[DHT_ID_LEN], const char *addr);

/* Waiting for holders: a client notes, per stage, since when a call has had
 * no online holder to go to, and gives up after max_wait seconds. */
#define ROUTE_SWARM_MAX_STAGES 64
typedef struct route_waits {
    double since[ROUTE_SWARM_MAX_STAGES];     /* 0: not waiting */
    double last_note[ROUTE_SWARM_MAX_STAGES];
} route_waits;

/* A call for `stage` found (has_holder) or did not find a holder at now. */
void route_waits_mark(route_waits *w, int stage, int has_holder, double now);

/* Returns -ETIMEDOUT with a sentence in err (naming the stage and the fix)
 * when some stage has waited longer than max_wait; 1 with a progress
 * sentence in note every 5 s of waiting; else 0. */
int route_waits_check(route_waits *w, route_swarm *s, double now, double max_wait, char *err,
                      size_t errlen, char *note, size_t notelen);

/* Frees s (pending lookups complete into nothing). NULL-safe. */
void route_swarm_destroy(route_swarm **s);

#endif
