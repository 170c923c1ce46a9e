/* peer/keeper.h: cold copies of other stages' state, so that a stage whose
 * only holder dies keeps its training state.
 *
 * Every period (and every 5 s while a copy it should keep is still
 * missing) a peer reads the holders of every stage of its model from the
 * DHT. For each stage it does not serve, the `replicas` peers of the
 * model that do not serve it and score highest under BLAKE2b(node ID,
 * stage name) (rendezvous hashing: every peer computes the same choice
 * from the same view, and a peer joining or leaving moves few copies) are
 * its keepers. A keeper downloads the stage's newest state from a holder
 * (peer/statesync.h, the newcomers' download) whenever the holders have a
 * newer weight version than its copy, keeps it in memory, serves it to
 * state downloads like a holder would (peer_statesync_server_set_cold_source), and
 * stores a signed record of it in the DHT (swarm/announce.h, the keep key).
 *
 * A stage with no online holder keeps its copies whatever the view says
 * (that is when they matter); a copy whose keeper is no longer chosen is
 * kept one more period (so the new keeper's copy exists) and then
 * withdrawn: its record is replaced by one of version 0, which readers
 * skip. A joining block tries the copies newest first, so a keeper that
 * vanished costs one failed download, not the state. A peer that takes the stage next (the
 * restarted holder, or a newcomer) compares its own checkpoint, the online
 * holders and the keepers' records, and takes the newest (peer/daemon.c).
 *
 * Memory: at most max_bytes of copies; a stage that would pass it is not
 * kept (nor fetched again), and the peer says so once.
 *
 * Loop thread only.
 */
#ifndef PEER_KEEPER_H
#define PEER_KEEPER_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include <uv.h>

#include "dht/dht.h"
#include "peer/service.h"
#include "peer/statesync.h"

#define PEER_KEEPER_MAX_STAGES 256

/* Keeper choice (pure): writes to keep[s] (s < n_stages) whether self is
 * among the `replicas` highest-scoring peers of ids[0..n) that do not hold
 * stage s; holds[s * n + j] says whether ids[j] holds stage s, names[s] is
 * the stage's name. self must be among ids. Returns 0 or -EINVAL. */
int peer_keeper_choose(const uint8_t (*ids)[DHT_ID_LEN], int n, const uint8_t self[DHT_ID_LEN],
                       const char *const *names, int n_stages, const uint8_t *holds, int replicas,
                       uint8_t *keep);

typedef struct peer_keeper_config {
    uv_loop_t *loop;
    dht *dht;
    const dht_identity *self;      /* borrowed: outlives the keeper */
    const uint8_t *swarm_key;      /* 32 bytes or NULL; borrowed likewise */
    peer_service *svc;             /* borrowed likewise */
    peer_statesync_server *states; /* svc's state serving (peer_statesync_server_create), where
                                      the copies are served from; borrowed likewise */
    const char *model;             /* copied */
    const char *addr;              /* our tensor RPC "HOST:PORT" (copied) */
    double every_s;                /* > 0 */
    int replicas;                  /* keepers per stage, >= 1 */
    size_t max_bytes;              /* memory for copies */
    int (*ready)(void *arg);       /* nonzero once online */
    void *ready_arg;
    FILE *log;
} peer_keeper_config;

typedef struct peer_keeper peer_keeper;

/* Starts the period timer and serves copies through the service. Returns
 * NULL with a sentence in err (unknown model, bad arguments, no memory). */
peer_keeper *peer_keeper_start(const peer_keeper_config *cfg, char *err, size_t errlen);

/* Stops the timer and any download; cb runs on the loop once nothing of it
 * is running. DHT lookups may still call back until the DHT is closed:
 * free with peer_keeper_destroy only after that. NULL-safe. */
void peer_keeper_stop(peer_keeper *k, void (*cb)(void *arg), void *arg);
void peer_keeper_destroy(peer_keeper **p);

#endif
