/* peer/daemon.h: a whole peer: DHT node, block service, announcements,
 * periodic checkpoints and the metrics endpoint, on one libuv loop.
 *
 * The DHT (UDP) and the tensor RPC (TCP) listen on the same HOST:PORT. The
 * daemon joins the swarm through the initial peers (retrying every few
 * seconds while nobody answers, with a message), announces its blocks as
 * joining, downloads each block's newest state from an online holder
 * (peer/statesync.h; a random one of the most up to date, so newcomers
 * spread over donors) unless its own is as new, then announces each hosted
 * block online under its key (swarm/announce.h) and the model under the
 * models index, signed, expiring ttl_s ahead and renewed every
 * announce_every_s. Every average_every_s seconds it averages each block
 * with its other replicas (peer/averaging.h), and every keep_every_s it
 * refreshes the cold copies it keeps of other stages (peer/keeper.h). A
 * joining block takes the newest of its checkpoint, the online holders'
 * state and the cold copies; when a newer version existed (this node's own
 * announcement from before a crash, or a copy it could not fetch) it says
 * STATE LOST and announces from which version to which it went back.
 * A stop announces the blocks offline, closes the service (which writes
 * checkpoints), and closes the DHT.
 *
 * Each of these is a part of its own, which the daemon wires together,
 * starts and stops: peer/joiner.h (joining), peer/catchup.h (where a
 * joining block's state comes from), peer/announcer.h (announcements),
 * peer/metrics_text.h (the metrics text), averaging and keeper.
 *
 * Loop thread only.
 */
#ifndef PEER_DAEMON_H
#define PEER_DAEMON_H

#include <stdio.h>

#include <uv.h>

#include "dht/dht.h"
#include "peer/service.h"

typedef struct peer_daemon_config {
    const dht_identity *ident;         /* required; copied */
    const uint8_t *swarm_key;          /* 32 bytes or NULL */
    const char *listen;                /* "HOST:PORT" for UDP and TCP; port 0 = any */
    const char *announce_host;         /* host others reach us at; NULL = listen host */
    const dht_peer_addr *initial;      /* peers to join through (may be 0 for the first) */
    size_t n_initial;
    peer_service_config svc;           /* model, blocks, threads, optimizer, checkpoints */
    const char *device;                /* announced device name, e.g. "cpu" */
    int precision;                     /* announced precision (enum expert_precision) */
    double announce_every_s;           /* 0 = 20 */
    double ttl_s;                      /* 0 = 60 */
    double checkpoint_every_s;         /* 0 = never (checkpoints still written at stop) */
    const char *metrics_listen;        /* "HOST:PORT" or NULL */
    int no_state_download;             /* keep our own state even if holders have newer */
    double average_every_s;            /* replica averaging period; 0 = off */
    int average_mode;                  /* enum peer_avg_mode (peer/allreduce.h); 0 = mean */
    int average_format;                /* the rounds' slices: peer_fmt (net/tensorfmt.h); 0 = f32 */
    int average_format_block;          /* q8's block; 0 = PEER_FMT_Q8_BLOCK (0 for the others) */
    double outer_lr, outer_momentum;   /* diloco's outer step: lr (0 = 0.7) and Nesterov
                                          momentum (as given, 0..<1) */
    double keep_every_s;               /* cold copies of other stages (peer/keeper.h); 0 = off */
    int keep_copies;                   /* keepers per stage; 0 = 2 */
    size_t keep_max_bytes;             /* memory for cold copies; 0 = 2 GiB */
    int dht_diversity_given;           /* 1: use dht_diversity; 0: dht_config_default's
                                          (STARLING_DHT_LIMITS, else public addresses) */
    int dht_diversity;                 /* which addresses the DHT's per-network limits
                                          apply to (enum dht_diversity) */
    FILE *log;                         /* status lines; NULL = stderr */
    /* Called on the loop when the daemon refuses to go on (another peer is
     * online with our identity; it has said why): the owner should stop it
     * (peer_daemon_stop) and report failure. NULL: the daemon stops itself. */
    void (*on_refused)(void *arg);
    void *refused_arg;
} peer_daemon_config;

typedef struct peer_daemon peer_daemon;

/* Starts everything. Returns NULL with a sentence in err on failure. */
peer_daemon *peer_daemon_start(uv_loop_t *loop, const peer_daemon_config *cfg, char *err,
                               size_t errlen);

/* The address string of this node for --initial-peers ("HOST:PORT/ID"). */
int peer_daemon_peer_string(const peer_daemon *d, char *buf, size_t cap);

/* The daemon's DHT node (for views of the swarm built on top, e.g. block
 * rebalancing); valid until the stop callback runs. */
dht *peer_daemon_dht(peer_daemon *d);

/* Graceful stop; cb runs on the loop when done, with the checkpoint status
 * (0 or -errno). Calls after the first do nothing. */
void peer_daemon_stop(peer_daemon *d, void (*cb)(int status, void *arg), void *arg);

/* Frees a daemon whose stop callback has run. Called earlier, it stops the
 * daemon (when not yet stopping) and frees it once stopped, before the
 * stop callback runs. NULL-safe; sets *p = NULL. */
void peer_daemon_destroy(peer_daemon **p);

#endif
