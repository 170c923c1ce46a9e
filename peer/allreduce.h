/* peer/allreduce.h: one group-averaging round of one block among its
 * replicas, as a butterfly all-reduce over the tensor RPC.
 *
 * The members (found through the DHT by the daemon, sorted by node ID, the
 * same list on every member) each freeze their block's flat state (params,
 * m, v; peer_service_avg_begin) and split it into n parts. Member j pulls
 * part j of every other member's base (PEER_METHOD_AVG kind 0), forms the
 * average weighted by each member's weight (training samples since its last
 * round, plus one; 0 for initial weights), publishes it, then pulls every other member's reduced
 * part (kind 1). Each member receives and sends 2 (n-1)/n of the state.
 * With the whole average in hand it applies it as one new weight version,
 * keeping the updates made during the round (expert_block_flat_apply).
 *
 * A member in another group for the same round answers EAGAIN and is asked
 * again until the deadline (the daemon regroups meanwhile). A group whose
 * weights are all 0 fails with -ENODATA.
 *
 * Failure: any other error (a member gone, a timeout) abandons the
 * round here and leaves the block unchanged; a member that fails before its
 * part is reduced answers ECANCELED, so the others abandon too. So every
 * member ends with its own weights either unchanged or replaced by the
 * group's average, never a mix.
 *
 * Loop thread only.
 */
#ifndef PEER_ALLREDUCE_H
#define PEER_ALLREDUCE_H

#include <stddef.h>
#include <stdint.h>

#include <uv.h>

#include "dht/identity.h"
#include "peer/service.h"

#define PEER_ALLREDUCE_MAX_MEMBERS 16

typedef struct peer_allreduce_member {
    uint8_t id[DHT_ID_LEN];
    char addr[66];                 /* "HOST:PORT" of its tensor RPC */
} peer_allreduce_member;

typedef struct peer_allreduce_result {
    int n;                         /* group size */
    double weight_self;            /* our weight / the group's total */
    double dist_before, dist_after; /* our parameters' L2 distance to the group average */
    double seconds;                /* begin to apply */
    uint64_t bytes_in;             /* tensor bytes received */
} peer_allreduce_result;

/* status 0: the average was applied; otherwise a negative errno and the
 * block is unchanged. res is valid during the callback only. */
typedef void (*peer_allreduce_cb)(void *arg, int status, const peer_allreduce_result *res);

typedef struct peer_allreduce peer_allreduce;

typedef struct peer_allreduce_config {
    uv_loop_t *loop;
    const dht_identity *self;
    const uint8_t *swarm_key;      /* 32 bytes or NULL */
    peer_service *svc;
    int block;                     /* the service's block index */
    const char *block_name;
    uint64_t round;
    const uint8_t *digest;         /* PEER_AVG_DIGEST_LEN bytes naming the group */
    const peer_allreduce_member *members; /* sorted; includes us */
    int n;                         /* 2..PEER_ALLREDUCE_MAX_MEMBERS */
    int me;                        /* our index in members */
    int with_optim;                /* average m and v too */
    double timeout_s;              /* the whole round */
    peer_allreduce_cb cb;
    void *arg;
} peer_allreduce_config;

/* Begins the round (freezing our base). Returns 0 and *out (cb runs exactly
 * once later), or a negative errno (cb never runs, nothing changed). */
int peer_allreduce_start(const peer_allreduce_config *cfg, peer_allreduce **out);

/* Abandons the round now (cb runs later with -ECANCELED, unless the
 * round already succeeded). */
void peer_allreduce_cancel(peer_allreduce *ar);

/* The group digest: BLAKE2b-128 over the round and the sorted member IDs,
 * each followed by a byte the caller chooses (the optimizer kind). */
void peer_allreduce_digest(uint8_t out[PEER_AVG_DIGEST_LEN], uint64_t round,
                           const uint8_t (*ids)[DHT_ID_LEN], const uint8_t *tags, int n);

#endif
