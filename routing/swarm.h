/* routing/swarm.h: what the DHT says about a model's stages.
 *
 * For every stage "<model>.<i>" a route_swarm looks up the holders' signed
 * announcements (peer/announce.h) through the DHT, at most every refresh_s
 * seconds per stage (sooner while a stage has no usable holder), and keeps
 * one route_holder per holder. What the trainer learns about a holder
 * (latency, failures, bans) lives in its route_replica and survives
 * refreshes, because holders are matched by node ID. A holder whose
 * announcement names another stage hash (another model version) is counted
 * in wrong_hash and never used.
 *
 * Loop thread only. The DHT must stay open until route_swarm_destroy; a
 * lookup still in flight at destroy finishes harmlessly (the swarm object
 * lives until its last callback).
 */
#ifndef ROUTE_SWARM_H
#define ROUTE_SWARM_H

#include <stdint.h>

#include "dht/dht.h"
#include "expert/model.h"
#include "peer/announce.h"
#include "routing/replica.h"

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

/* Starts lookups for the stages that are due at time now (seconds, any
 * monotonic clock): never looked up, older than refresh_s, or older than
 * 1 s while the stage has no online holder. Returns the number started. */
int route_swarm_refresh(route_swarm *s, double now);

/* Forces a lookup of stage i at the next refresh (e.g. after every replica
 * failed). */
void route_swarm_invalidate(route_swarm *s, int i);

int route_swarm_n_stages(const route_swarm *s);
route_stage *route_swarm_stage(route_swarm *s, int i);

/* Online holders of stage i with the right hash. */
int route_stage_usable(const route_stage *st);

/* Frees s (pending lookups complete into nothing). NULL-safe. */
void route_swarm_destroy(route_swarm **s);

#endif
