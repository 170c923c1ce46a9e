/* tools/client.h: joining a swarm as a light client (train, monitor, infer),
 * and taking a model's description from the swarm.
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

struct expert_model_spec;

/* Fetches the description of the model called name from the swarm
 * (swarm/modeldesc.h) through an open client, running its loop until the
 * fetch ends or timeout_s passes; registers the model
 * (expert_model_register) and sets *out to it. Says where it came from on
 * stderr ("starling CMD: model NAME: description HASH8 fetched from the
 * swarm (N bytes, M stages)"). Returns CLI_EXIT_OK, or CLI_EXIT_FAIL with
 * the reason said (nobody publishes it: "unknown model ..."; every
 * description refused, naming the publisher; different models under one
 * name; timeout). */
int tools_client_fetch_model(tools_client *c, const char *cmd, const char *name, double timeout_s,
                             const struct expert_model_spec **out);

/* cli_model_select (tools/cli.h), and when NAME is neither built in nor
 * registered, no FILE is given and initial (--initial-peers) is: joins as a
 * short-lived light client (fresh identity, swarm_key_file) and fetches the
 * model from the swarm (tools_client_fetch_model). Returns 0 with *out set,
 * CLI_EXIT_USAGE (bad flags, said) or CLI_EXIT_FAIL (cannot join, or the
 * model cannot be had from the swarm: said why). */
int tools_model_select(const char *cmd, const char *name, const char *file, const char *dflt, const char *initial,
                       const char *swarm_key_file, const struct expert_model_spec **out);

#endif
