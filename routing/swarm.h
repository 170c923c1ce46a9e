/* routing/swarm.h: what the DHT says about a model's stages.
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
 */
#ifndef ROUTE_SWARM_H
#define ROUTE_SWARM_H

#include <stdint.h>

#include "dht/dht.h"
#include "expert/model.h"
#include "swarm/announce.h"
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
