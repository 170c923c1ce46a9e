/* routing/replica.h: choosing among the replicas of one stage.
 *
 * The trainer keeps, for every stage, the holders it learned from the DHT and
 * what it has observed of them. Choice is randomised in proportion to each
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
 * Everything here is plain data and pure functions of their arguments (time
 * is passed in), so it is deterministic under a seeded RNG and testable
 * without a network. Not thread-safe: one owner per route_replica_set.
 */
#ifndef ROUTE_REPLICA_H
#define ROUTE_REPLICA_H

#include <stdint.h>

#include "swarm/rng.h"

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

#endif
