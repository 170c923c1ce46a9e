/* dht/node_internal.h: what dht/node.c and dht/lookup.c share.
 *
 * Not public API: only files in dht/ include it (layers above use
 * dht/dht.h, tests of the core dht/node.h). node.c is the node: datagrams
 * in and out, requests and their replies, the routing table, the store and
 * housekeeping. lookup.c is the iterative lookup engine that runs the
 * node's operations (join, find, get, put, bucket refresh, republish). They
 * meet here: the node's state, its outstanding requests, the few node
 * functions a lookup calls and the lookup entry points the node calls.
 * Everything here runs on the one thread that owns the node (dht/node.h).
 */
#ifndef DHT_NODE_INTERNAL_H
#define DHT_NODE_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include <sodium.h>
#include <uthash.h>

#include "dht/node.h"
#include "dht/store.h"
#include "dht/table.h"

#define RL_SETS 64  /* rate-limit buckets: sets of RL_WAYS sources */
#define RL_WAYS 4
#define VERIFY_SLOTS 256 /* verify-ping throttle, by hashed claimed ID */
#define VCACHE_SETS 256      /* (ID, address) pairs proven recently, beyond the table: */
#define VCACHE_WAYS 4        /* 1,024 keyed 64-bit fingerprints, 8 KiB */

/* Why a request went out, which decides what its reply (or its failure)
 * does: RPC_LOOKUP, RPC_PAGE, RPC_STORE and RPC_SELF sent by a lookup go to
 * dht__lookup_reply; the rest are the node's own. */
enum dht__rpc_kind {
    RPC_LOOKUP,   /* a lookup's find_node or get */
    RPC_PAGE,     /* a get's next page from a holder */
    RPC_STORE,    /* a put's or republish's store */
    RPC_VERIFY,   /* a ping asking an unknown sender to prove its ID */
    RPC_EVICT,    /* a ping to a table entry that a newcomer may replace */
    RPC_HANDOVER, /* a store of our signed records on a nearer newcomer */
    RPC_SELF      /* a ping to a node listed with our own ID */
};

/* One outstanding request, keyed by transaction ID. */
typedef struct dht__rpc {
    uint32_t tid;
    uint8_t kind, req_type, has_id, has_nonce;
    uint8_t id[DHT_ID_LEN];
    uint8_t nonce[DHT_NONCE_LEN];
    dht_addr addr;
    uint32_t lookup_id;     /* the lookup it serves, 0: none */
    uint64_t deadline;
    UT_hash_handle hh;
} dht__rpc;

struct dht__lookup;  /* lookup.c */
struct dht__outpkt;  /* node.c */

struct dht_node {
    dht_identity ident;
    dht_config cfg;
    dht_table *table;
    dht_store *store;
    dht__rpc *rpcs;
    size_t n_rpcs;
    struct dht__lookup *lookups;
    size_t n_lookups;
    uint32_t next_lookup_id;
    int deferred;           /* some lookup must finish at the next tick */
    struct dht__outpkt *out_head, *out_tail;
    size_t n_out;
    uint8_t rng_key[32];
    uint64_t rng_ctr;
    uint8_t pool[64];
    size_t pool_pos;
    uint8_t tok_cur[32], tok_prev[32];
    uint64_t tok_rotated;
    uint8_t rl_key[crypto_shorthash_KEYBYTES];
    struct { uint8_t ip[16]; uint64_t last, milli; } rl[RL_SETS][RL_WAYS];
    uint64_t verify_at[VERIFY_SLOTS]; /* last verify ping per hashed address */
    uint64_t vcache[VCACHE_SETS][VCACHE_WAYS]; /* most recent first, 0 = empty */
    uint64_t next_maint, next_republish;
    uint64_t next_selfcheck;  /* next lookup of our own ID (0: not joined) */
    size_t republish_cursor;
    int joined;
    int closing;            /* destroy is cancelling: no new operations */
    int families;           /* bit 0: can send to IPv4, bit 1: to IPv6 */
    dht_join_diag diag;     /* the latest join that failed for a known reason */
    dht_addr collision;     /* the latest node that proved our ID (family 0: none) */
    uint64_t collision_at;
    dht_node_stats st;
};

/* ---- node.c, for lookups ---- */

/* Fills out with len bytes of the node's random stream (deterministic
 * under cfg.seed). */
void dht__node_rng(dht_node *n, void *out, size_t len);

/* Sends request m (type, target, ... filled by the caller; tid, our ID and
 * the proof nonce are filled here) to `to` and records it as an rpc of
 * kind for lookup lookup_id (0: none). expect_id: the ID that must answer
 * (NULL: any, which then must prove it). Returns 0 when the request is
 * recorded (a full output queue may still drop the datagram: the request
 * then times out), or -EAGAIN (too many requests outstanding), -ENOMEM or
 * an encoding error, and then nothing was recorded. */
int dht__node_send_request(dht_node *n, dht_msg *m, const dht_addr *to, const uint8_t *expect_id,
                           int kind, uint32_t lookup_id, uint64_t now);

/* Someone's node list (or the command line) names our own ID at addr:
 * pings addr asking for a proof of our ID (an RPC_SELF request for lookup
 * lookup_id, 0: none), at most once per address per timeout period.
 * Returns 0 when the ping went out, -EAGAIN when it did not (throttled, an
 * address family we cannot reach, no room). */
int dht__node_self_ping(dht_node *n, const dht_addr *addr, uint32_t lookup_id, uint64_t now);

/* ---- lookup.c, for the node ---- */

/* The reply m (NULL: the request failed, by timeout when timeout != 0 or
 * by a wrong answer) to r, a request of kind RPC_LOOKUP, RPC_PAGE,
 * RPC_STORE or RPC_SELF: advances its lookup, which may run the
 * operation's callback and free the lookup. r and m stay the caller's.
 * Does nothing when r's lookup is gone. */
void dht__lookup_reply(dht_node *n, const dht__rpc *r, const dht_msg *m, int timeout, uint64_t now);

/* Remembers in r's join why it may fail: r's node answered with another ID
 * (got) or is under another swarm key (status -EADDRNOTAVAIL or
 * -EKEYREJECTED). The first such answer of a join is kept. */
void dht__lookup_note_problem(dht_node *n, const dht__rpc *r, int status, const uint8_t *got);

/* Background lookups, started without a callback: a lookup of our own ID,
 * a refresh of bucket b (a lookup of a random ID in it; none while
 * closing), a republish of the signed entries we hold under key. Each does
 * nothing when no lookup can be started (too many, no memory). */
void dht__lookup_self(dht_node *n, uint64_t now);
void dht__lookup_refresh(dht_node *n, int b, uint64_t now);
void dht__lookup_republish(dht_node *n, const uint8_t key[DHT_ID_LEN], uint64_t now);

/* Moves on the lookups due at now (a request turned stale, a completion
 * deferred out of the call that started it). Callbacks may run. */
void dht__lookup_wake(dht_node *n, uint64_t now);

/* The earliest time before d at which a lookup needs dht__lookup_wake, or
 * d. */
uint64_t dht__lookup_deadline(const dht_node *n, uint64_t d);

/* Ends every lookup: callbacks get -ECANCELED. n->closing must be set, so
 * that callbacks cannot start new ones. */
void dht__lookup_cancel_all(dht_node *n);

#endif
