/* routing/conns.h: tensor RPC connections from a client to stage holders.
 *
 * One encrypted connection per holder, keyed by its node ID AND its
 * announced address, and opened on first use with that ID as the expected
 * identity (a holder whose key does not hash to the announced ID is refused
 * by the handshake). The address is part of the key because two processes
 * may run under one identity at different addresses (serving different
 * stages), and a holder may come back at a new address: a connection to one
 * address is never used for another. route_conns_retain closes the
 * connections whose (ID, address) nobody announces any more.
 *
 * While a connection is being set up route_conns_get returns NULL and the
 * caller tries another replica or later; on_ready runs when it is usable,
 * on_failed when it could not be set up within connect_timeout_ms (the
 * entry is then gone, so a later get retries). Loop thread only.
 */
#ifndef ROUTE_CONNS_H
#define ROUTE_CONNS_H

#include <stdint.h>

#include <uv.h>

#include "dht/identity.h"
#include "net/rpc_client.h"

#define ROUTE_CONNS_ADDR_MAX 64              /* longest "HOST:PORT" (as announced) */

typedef struct route_conns route_conns;

/* The callbacks' id and addr are valid for the duration of the callback
 * only; they may call any route_conns function. */
typedef struct route_conns_config {
    const dht_identity *ident;           /* copied by the RPC clients */
    const uint8_t *swarm_key;            /* 32 bytes or NULL */
    int max_pending;                     /* per connection */
    void (*on_ready)(void *arg, const uint8_t id[DHT_ID_LEN], const char *addr);
    void (*on_failed)(void *arg, const uint8_t id[DHT_ID_LEN], const char *addr, int status);
    void *arg;
    uint64_t connect_timeout_ms;         /* TCP connect + handshake; 0: the RPC client's default (5 s) */
} route_conns_config;

/* NULL on bad arguments (no loop, config or identity) or no memory. */
route_conns *route_conns_create(uv_loop_t *loop, const route_conns_config *cfg);

/* The connected client for holder id at addr ("HOST:PORT"), or NULL while
 * connecting, when addr is malformed, or out of memory. *serial_out (if not
 * NULL) receives the connection's serial number when one is returned: it
 * differs for every connection this pool ever opened, so a caller can tell
 * whether two replies came over the same connection (the same process). */
peer_rpc_client *route_conns_get(route_conns *c, const uint8_t id[DHT_ID_LEN], const char *addr,
                                 uint64_t *serial_out);

/* Closes the connection to id at addr, or every connection to id when addr
 * is NULL (their pending calls fail with -ECANCELED). */
void route_conns_drop(route_conns *c, const uint8_t id[DHT_ID_LEN], const char *addr);

/* Closes every connection for which keep(arg, id, addr) returns 0 (e.g. a
 * holder that moved to another address, or is no longer announced).
 * Returns the number closed. */
int route_conns_retain(route_conns *c, int (*keep)(void *arg, const uint8_t id[DHT_ID_LEN], const char *addr),
                       void *arg);

/* Closes every connection; route_conns_open() reaches 0 once all are freed. */
void route_conns_close_all(route_conns *c);
int route_conns_open(const route_conns *c);

/* Frees c; only once route_conns_open(c) == 0. NULL-safe. */
void route_conns_destroy(route_conns **c);

#endif
