/* peer/announcer.h: keeps this peer's announcements in the DHT.
 *
 * Each hosted block's announcement (swarm/announce.h) is stored under the
 * block's key, signed, and the model's record under the models index, with
 * the model's description (swarm/modeldesc.h) in chunks of its own, renewed
 * with the record, so that it lives as long as some peer serves it. A
 * joining block is announced once (peer_announcer_joining); once online
 * every block is announced online, expiring ttl_s ahead and renewed every
 * every_s, and a put the DHT refuses or does not store is tried again in
 * 2 s (until it is stored, clients see an old state or nothing), said once
 * until one is stored again. At stop the blocks are announced offline
 * (expiring 15 s ahead), so that clients drop this peer at once. Each
 * announcement expires strictly later than the one before, so a new state
 * (joining -> online -> offline) never ties with or loses to an old one.
 *
 * Loop thread only.
 */
#ifndef PEER_ANNOUNCER_H
#define PEER_ANNOUNCER_H

#include <stdio.h>

#include <uv.h>

#include "dht/dht.h"
#include "swarm/announce.h"
#include "peer/service.h"

typedef struct peer_announcer_config {
    uv_loop_t *loop;
    dht *dht;
    peer_service *svc;             /* borrowed: outlives the announcer */
    const char *model;             /* copied */
    int n_stages;                  /* of the model */
    const char *addr;              /* our tensor RPC "HOST:PORT" (copied) */
    const char *device;            /* announced device name (copied) */
    const char *precision;         /* announced precision, "fp32" or "bf16" (static) */
    int max_queue_rows;            /* >= 1: load = queued rows / this */
    double every_s, ttl_s;         /* > 0 */
    FILE *log;
    /* Fills the parts of block i's announcement that the owner knows
     * (averaging counters, state loss), just before it is encoded. May be
     * NULL. */
    void (*fill)(void *arg, int block, peer_announce *a);
    void *arg;
} peer_announcer_config;

typedef struct peer_announcer peer_announcer;

/* NULL on bad arguments or no memory. Announces nothing yet. */
peer_announcer *peer_announcer_create(const peer_announcer_config *cfg);

/* Announces block i joining, once (not renewed). Returns 1 when the put
 * started, else 0. */
int peer_announcer_joining(peer_announcer *an, int block);

/* Says "online: announcing N blocks", announces every block online and
 * renews them every every_s from now on. */
void peer_announcer_go_online(peer_announcer *an);

/* Stops renewing. With offline set, announces every block offline and
 * calls done on the loop once each of those puts has answered. Returns the
 * number of offline puts started (0: done never runs). */
int peer_announcer_leave(peer_announcer *an, int offline, void (*done)(void *arg), void *arg);

/* Stops renewing and closes the renewal timer, then calls cb (may be NULL)
 * on the loop. Idempotent; NULL-safe (cb does not run then). */
void peer_announcer_stop(peer_announcer *an, void (*cb)(void *arg), void *arg);

/* Frees a stopped announcer (one whose stop is still closing is freed once
 * it has closed). Only once the DHT is closed, so that no put can call
 * back. NULL-safe; sets *p = NULL. */
void peer_announcer_destroy(peer_announcer **p);

#endif
