/* routing/conns.h: tensor RPC connections from a client to stage holders.
 *
 * One encrypted connection per holder, keyed by its node ID and opened on
 * first use with that ID as the expected identity (a holder whose key does
 * not hash to the announced ID is refused by the handshake). While a
 * connection is being set up route_conns_get returns NULL and the caller
 * tries another replica or later; on_ready runs when it is usable, on_failed
 * when it could not be set up (the entry is then gone, so a later get
 * retries). Loop thread only.
 */
#ifndef ROUTE_CONNS_H
#define ROUTE_CONNS_H

#include <stdint.h>

#include <uv.h>

#include "dht/identity.h"
#include "peer/rpc_client.h"

typedef struct route_conns route_conns;

typedef struct route_conns_config {
    const dht_identity *ident;           /* copied by the RPC clients */
    const uint8_t *swarm_key;            /* 32 bytes or NULL */
    int max_pending;                     /* per connection */
    void (*on_ready)(void *arg);
    void (*on_failed)(void *arg, const uint8_t id[DHT_ID_LEN], int status);
    void *arg;
} route_conns_config;

route_conns *route_conns_create(uv_loop_t *loop, const route_conns_config *cfg);

/* The connected client for holder id at addr ("HOST:PORT"), or NULL while
 * connecting, when addr is malformed, or out of memory. */
peer_rpc_client *route_conns_get(route_conns *c, const uint8_t id[DHT_ID_LEN], const char *addr);

/* Closes the connection to id (its pending calls fail with -ECANCELED). */
void route_conns_drop(route_conns *c, const uint8_t id[DHT_ID_LEN]);

/* Closes every connection; route_conns_open() reaches 0 once all are freed. */
void route_conns_close_all(route_conns *c);
int route_conns_open(const route_conns *c);

/* Frees c; only once route_conns_open(c) == 0. NULL-safe. */
void route_conns_destroy(route_conns **c);

#endif
