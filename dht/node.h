/* dht/node.h: the sans-I/O Kademlia node.
 *
 * The node never reads a clock or a socket. The caller feeds it datagrams
 * (dht_node_input), calls dht_node_tick when dht_node_next_deadline comes,
 * and sends what dht_node_pop_output hands back. All times are milliseconds
 * on one clock that must be (close to) unix time, because record expirations
 * travel between nodes: the UDP binding uses the wall clock, the simulation
 * a simulated one. The same code therefore runs one real node or thousands
 * of simulated ones in one process.
 *
 * Operations (join, find, get, put) are iterative lookups (alpha parallel
 * requests toward the k closest). Their callback runs exactly once, from
 * inside dht_node_input, dht_node_tick or dht_node_destroy (status
 * -ECANCELED), never from the call that started them; a call that fails
 * returns -errno and never calls the callback. Callbacks may start new
 * operations but must not destroy the node.
 *
 * Not thread-safe: one thread owns a node.
 */
#ifndef DHT_NODE_H
#define DHT_NODE_H

#include <stddef.h>
#include <stdint.h>

#include "dht/addr.h"
#include "dht/identity.h"
#include "dht/wire.h"

#ifndef DHT_ALPHA
#define DHT_ALPHA 3
#endif

#ifndef DHT_QUORUM
#define DHT_QUORUM 8
#endif

/* A lookup keeps at most this many candidates of one /24 (IPv4) or /48
 * (IPv6) network, the nearest it heard of (a node whose ID is the target
 * itself is always kept). Nodes with IDs ground near a key from one network
 * then hold at most 2 of the quorum a get asks and 2 of the k a put stores
 * on: see docs/protocol.md, "Security properties". */
#ifndef DHT_LOOKUP_PER_NET
#define DHT_LOOKUP_PER_NET 2
#endif

typedef struct dht_node dht_node;

typedef struct dht_config {
    size_t k;                   /* bucket size and replication (DHT_K) */
    size_t alpha;               /* parallel requests per lookup (DHT_ALPHA) */
    size_t quorum;              /* a get is over once this many of the nearest
                                   nodes have answered; a put reports once
                                   this many of the nearest have stored (the
                                   stores to the rest of the k go on)
                                   (DHT_QUORUM, <= k) */
    uint32_t rpc_timeout_ms;    /* a request unanswered this long failed (1000) */
    uint32_t maint_ms;          /* housekeeping period (1000) */
    uint32_t refresh_ms;        /* refresh a bucket idle this long (15 min) */
    uint32_t republish_ms;      /* re-store held records this often (10 min) */
    uint32_t token_ms;          /* write-token secret rotation (5 min) */
    uint32_t rate_per_s;        /* requests per second per source IP (200) */
    uint32_t rate_burst;        /* burst per source IP (400) */
    int verify_ids;             /* 1: a node enters the table only after signing
                                   our nonce; 0 (simulations only): trust IDs */
    int client_only;            /* a short-lived client (tools): asks others not
                                   to add it to their tables */
    int has_swarm_key;
    uint8_t swarm_key[32];      /* datagrams carry a keyed BLAKE2b tag */
    uint8_t seed[32];           /* all-zero: random; else deterministic
                                   transaction IDs, nonces and secrets (tests) */
    size_t store_max_keys, store_max_subkeys, store_max_bytes; /* 0 = defaults */
    int diversity;              /* which addresses the per-network limits of the
                                   routing table (dht/table.h) and of lookups
                                   (DHT_LOOKUP_PER_NET) apply to: enum
                                   dht_diversity, default DHT_DIVERSITY_PUBLIC
                                   (loopback and private addresses exempt) */
} dht_config;

/* Counters, for tests, benchmarks and monitoring. */
typedef struct dht_node_stats {
    uint64_t rx, tx, rx_bytes, tx_bytes;
    uint64_t drop_malformed;    /* not a valid message */
    uint64_t drop_tag;          /* missing or wrong swarm tag */
    uint64_t drop_rate;         /* rate-limited requests */
    uint64_t drop_unexpected;   /* reply without a matching request */
    uint64_t drop_bad_proof;    /* reply with a missing, wrong or foreign-ID proof */
    uint64_t drop_queue;        /* output queue full */
    uint64_t store_rejected;    /* store requests refused (token, signature, ...) */
    uint64_t timeouts;
    uint64_t req_sent[5];       /* requests sent by type (index = enum dht_msg_type) */
    uint64_t wrong_id;          /* replies from the address asked with another node's ID
                                   (also counted in drop_bad_proof) */
    uint64_t swarm_rejects;     /* "not in this swarm" notices received: a node
                                   answered a request of ours but is under another
                                   swarm key (or none) */
    uint64_t rejects_sent;      /* notices we sent to requests under another key */
    uint64_t id_collisions;     /* another node proved our own ID from another address */
    uint64_t table_refused;     /* proven nodes kept out of the table by the
                                   per-network limits */
    uint64_t lookup_refused;    /* lookup candidates dropped by DHT_LOOKUP_PER_NET */
    int table_depth;            /* deepest non-empty bucket, -1 if empty */
    size_t table_size, store_keys, store_entries, store_bytes;
    size_t pending_rpcs, lookups;
} dht_node_stats;

/* What an operation's callback receives. Everything is borrowed for the
 * duration of the callback only. */
typedef struct dht_result {
    int status;                 /* 0 ok (put: number of nodes that stored it),
                                   or -EHOSTUNREACH, -ECANCELED, ... */
    const dht_entry *entries;   /* get: every live entry found, one per
                                   (subkey, signed), newest expiration */
    size_t n_entries;
    const dht_wire_node *nodes; /* the closest nodes that answered, nearest first */
    size_t n_nodes;
    unsigned hops;              /* referral depth of the nearest answer */
    unsigned msgs;              /* requests sent by this operation */
} dht_result;

typedef void (*dht_node_cb)(void *ud, const dht_result *r);

/* Why a join failed, beyond "nobody answered" (dht_node_join_diag). */
typedef struct dht_join_diag {
    int status;                    /* -EADDRNOTAVAIL, -EKEYREJECTED, -EADDRINUSE, or
                                      0 when no join has ended with one of them */
    dht_addr addr;                 /* the node concerned */
    uint8_t expected[DHT_ID_LEN];  /* -EADDRNOTAVAIL: the ID we were given for addr;
                                      -EADDRINUSE: our own ID */
    uint8_t got[DHT_ID_LEN];       /* -EADDRNOTAVAIL: the ID addr answered with */
    int have_swarm_key;            /* -EKEYREJECTED: whether we have a key */
} dht_join_diag;

/* Fills cfg with the defaults above. diversity comes from the environment
 * variable STARLING_DHT_LIMITS: "all" (DHT_DIVERSITY_ALL), "off"
 * (DHT_DIVERSITY_OFF), anything else or unset DHT_DIVERSITY_PUBLIC. */
void dht_config_default(dht_config *cfg);

/* ident is copied (and wiped on destroy). cfg NULL = defaults. Returns NULL
 * on allocation failure or if libsodium cannot start. */
dht_node *dht_node_create(const dht_identity *ident, const dht_config *cfg, uint64_t now);

/* Cancels pending operations (callbacks get -ECANCELED) and frees. */
void dht_node_destroy(dht_node **n);

/* Our node ID: DHT_ID_LEN bytes owned by n, never changed, valid until
 * dht_node_destroy. */
const uint8_t *dht_node_id(const dht_node *n);

/* Which address families the transport can send to (both by default).
 * Lookups skip candidates the node could not reach. */
void dht_node_set_families(dht_node *n, int v4, int v6);

/* Feeds one datagram received from `from` (buf is read during the call
 * only). Bad datagrams are counted and dropped. Callbacks of operations
 * may run inside. Returns 0, or -EBADMSG/-EPERM/-EAGAIN when it was
 * dropped, -EINVAL when n, buf or from is NULL. */
int dht_node_input(dht_node *n, const uint8_t *buf, size_t len, const dht_addr *from,
                   uint64_t now);

/* Moves the oldest queued datagram into buf (cap >= DHT_MAX_DATAGRAM) and
 * its destination into to. Returns its length, 0 when the queue is empty,
 * or -EMSGSIZE when it was longer than cap (it is dropped; to is not set). */
int dht_node_pop_output(dht_node *n, uint8_t *buf, size_t cap, dht_addr *to);

/* Next time dht_node_tick has work (UINT64_MAX: none). */
uint64_t dht_node_next_deadline(const dht_node *n);

/* Handles timeouts and housekeeping (expiry, token rotation, bucket refresh,
 * republish) due at now. Callbacks of operations may run inside. */
void dht_node_tick(dht_node *n, uint64_t now);

/* Joins through the given peers (n_peers >= 1): a lookup of our own ID
 * seeded with them, then a refresh of the farther buckets. A peer with an ID
 * that answers with another ID is ignored. status:
 *   0              some node is in the table;
 *   -EADDRINUSE    another node proved OUR ID from another address during
 *                  the join (it runs with our identity file): someone's node
 *                  list named our ID at an address, and the node there
 *                  signed our challenge with our key. The join is otherwise
 *                  complete (the node works) but the caller should not go on;
 *   -EADDRNOTAVAIL nobody answered usefully, and an initial peer given as
 *                  HOST:PORT/ID answered from HOST:PORT with another ID;
 *   -EKEYREJECTED  nobody answered usefully, and a node told us it is under
 *                  another swarm key (or none, or we have none): see
 *                  docs/protocol.md, "Private swarms";
 *   -EHOSTUNREACH  nobody answered.
 * dht_node_join_diag then tells which address (and IDs). A join that meets
 * our ID in a node list waits for that node's answer (at most
 * rpc_timeout_ms). peers are read during the call only. Returns 0 or
 * -EINVAL/-ENOMEM/-EAGAIN, or -ECANCELED (destroying). */
int dht_node_join(dht_node *n, const dht_peer_addr *peers, size_t n_peers, dht_node_cb cb,
                  void *ud, uint64_t now);

/* The detail of the latest join that ended with -EADDRNOTAVAIL,
 * -EKEYREJECTED or -EADDRINUSE (out->status 0: none yet). Returns
 * out->status. */
int dht_node_join_diag(const dht_node *n, dht_join_diag *out);

/* The address of the latest node that proved our own ID from elsewhere (in
 * a join or in any later lookup). Returns 0, or -ENOENT if none has. */
int dht_node_collision(const dht_node *n, dht_addr *out);

/* Iterative find_node for target (result nodes, nearest first). status 0
 * when some node answered, else -EHOSTUNREACH (or -ECANCELED). Returns 0 or
 * -EINVAL (n or target NULL), -ECANCELED (destroying), -EAGAIN (too many
 * operations), -ENOMEM. */
int dht_node_find(dht_node *n, const uint8_t target[DHT_ID_LEN], dht_node_cb cb, void *ud,
                  uint64_t now);

/* Collects every live entry of key from the quorum nearest nodes (and our
 * own store), following paged replies: the lookup asks the quorum nearest
 * candidates at once and is over when the quorum nearest have answered.
 * status 0 (with the entries, ours merged in), -EHOSTUNREACH (no node
 * answered, no entry found), -ENOMEM (the entries could not be handed
 * over) or -ECANCELED (with the entries other nodes sent so far). Signed
 * entries' signatures are checked. Returns 0 or -EINVAL (n or key NULL),
 * -ECANCELED (destroying), -EAGAIN (too many operations), -ENOMEM. */
int dht_node_get(dht_node *n, const uint8_t key[DHT_ID_LEN], dht_node_cb cb, void *ud,
                 uint64_t now);

/* Stores one entry under key on the k closest nodes (and here, if we are
 * among them). The callback runs once the quorum nearest have acknowledged
 * (status: acknowledgements so far); the stores to the rest go on. With
 * sign != 0 the subkey is ignored and replaced by our node ID, and the
 * entry is signed with our identity. expires is absolute
 * (ms, same clock as now). An unsigned entry (sign == 0) gets only the small
 * share of each node that unsigned entries have (dht/store.h) and is never
 * republished or handed over by the nodes that hold it: it stays on the
 * nodes it was stored on until it expires (put it again to follow churn).
 * value and subkey are copied. Returns 0, or -EINVAL (sizes, expiration not
 * in (now, now + DHT_MAX_TTL_MS]), -ENOMEM, -EAGAIN (too many operations),
 * -ECANCELED (destroying). */
int dht_node_put(dht_node *n, const uint8_t key[DHT_ID_LEN], const uint8_t *subkey,
                 size_t subkey_len, const uint8_t *value, size_t value_len, uint64_t expires,
                 int sign, dht_node_cb cb, void *ud, uint64_t now);

/* Fills *out with a snapshot of n's counters and sizes. Cannot fail. */
void dht_node_get_stats(const dht_node *n, dht_node_stats *out);

/* Closest table entries to target as wire nodes (for tools and tests). */
size_t dht_node_closest(const dht_node *n, const uint8_t target[DHT_ID_LEN], dht_wire_node *out,
                        size_t max);

#endif
