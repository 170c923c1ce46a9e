/* peer/joiner.h: joins the swarm through the initial peers, and keeps
 * trying while nobody answers.
 *
 * A join that fails is tried again every PEER_JOINER_RETRY_MS, with a
 * sentence that says what to check: the node ID in --initial-peers when
 * the peer answered under another ID, --swarm-key when it answered under
 * another key, otherwise that no initial peer could be reached. One case
 * is never retried: another process is online with our identity (it
 * proved our node ID from another address); two peers with one ID would
 * displace each other in routing tables and announcements, so the joiner
 * says so and calls `refused`.
 *
 * Loop thread only.
 */
#ifndef PEER_JOINER_H
#define PEER_JOINER_H

#include <stddef.h>
#include <stdio.h>

#include <uv.h>

#include "dht/dht.h"

#define PEER_JOINER_RETRY_MS 5000
#define PEER_JOINER_MAX_INITIAL 64

typedef struct peer_joiner_config {
    uv_loop_t *loop;
    dht *dht;                      /* started; borrowed: outlives the joiner */
    const dht_peer_addr *initial;  /* copied; 1..PEER_JOINER_MAX_INITIAL */
    size_t n_initial;
    FILE *log;
    void (*joined)(void *arg);     /* once, when a join succeeded */
    void (*refused)(void *arg);    /* once, when another peer has our identity (said) */
    void *arg;
} peer_joiner_config;

typedef struct peer_joiner peer_joiner;

/* NULL on bad arguments or no memory. Joins nothing yet. */
peer_joiner *peer_joiner_create(const peer_joiner_config *cfg);

/* Starts the first join. NULL-safe. */
void peer_joiner_start(peer_joiner *j);

/* No more joins and no more callbacks; closes the retry timer, then calls
 * cb (may be NULL) on the loop. Idempotent; NULL-safe (cb does not run
 * then). */
void peer_joiner_stop(peer_joiner *j, void (*cb)(void *arg), void *arg);

/* Frees a stopped joiner (one whose stop is still closing is freed once it
 * has closed). Only once the DHT is closed, so that no join can call back.
 * NULL-safe; sets *p = NULL. */
void peer_joiner_destroy(peer_joiner **p);

#endif
