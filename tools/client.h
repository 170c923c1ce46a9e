/* tools/client.h: joining a swarm as a light client (train, monitor, infer).
 *
 * A client runs its own DHT node on its own loop, marked client_only so
 * other nodes keep it out of their routing tables, and joins through the
 * initial peers before the command does its work.
 */
#ifndef TOOLS_CLIENT_H
#define TOOLS_CLIENT_H

#include <stdint.h>

#include <uv.h>

#include "dht/dht.h"

typedef struct tools_client {
    uv_loop_t loop;
    dht *d;
    dht_identity ident;
    int has_swarm_key;
    uint8_t swarm_key[32];
    int loop_ready;
    uv_timer_t join_timer;      /* bounds the join */
} tools_client;

/* Loads the identity (or makes a fresh one) and the swarm key, starts the
 * DHT node (listen NULL: any port on the initial peers' address family) and
 * joins through `initial` (a comma-separated peer address list), waiting at
 * most timeout_s. Messages go to stderr as "starling CMD: ...". Returns
 * CLI_EXIT_OK, CLI_EXIT_USAGE (bad flags) or CLI_EXIT_FAIL (cannot load a
 * file; no initial peer answered: "cannot reach ..."; an initial peer
 * answered with another node ID, or under another swarm key: the message
 * says which, tools_join_error). Another node online with our identity is
 * a warning only (a client stays out of routing tables). On failure
 * everything is already closed. */
int tools_client_open(tools_client *c, const char *cmd, const char *initial, const char *listen,
                      const char *identity, const char *swarm_key_file, double timeout_s);

/* A join's failure for people: dht_join_strerror's sentence followed by
 * what to check (": check the node ID in --initial-peers", ": check
 * --swarm-key", ": use another --identity"); for other statuses just the
 * sentence. Returns the length written. */
int tools_join_error(const dht *d, int status, char *buf, size_t cap);

/* Closes the DHT and the loop, wiping the keys. */
void tools_client_close(tools_client *c);

#endif
