/* dht/table.h: the Kademlia routing table.
 *
 * 160 buckets indexed by the length of the common prefix with our own ID
 * (bucket i holds IDs that agree with ours on exactly i leading bits), which
 * is the same as the split-bucket tree restricted to the branches Kademlia
 * ever splits. Each bucket holds up to k entries plus a small replacement
 * cache. A full bucket never drops a live entry: a newcomer goes to the
 * replacement cache and the caller is asked to ping the least-recently-seen
 * entry; only when that ping (or DHT_TABLE_MAX_FAILS requests) fails is the
 * entry removed and the newest replacement promoted.
 *
 * Only the node core inserts, and only nodes that proved their ID (see
 * docs/protocol.md).
 *
 * Proving an ID costs one key pair, so an attacker can bring thousands.
 * What it cannot bring cheaply is networks: as go-libp2p-kad-dht's
 * diversity filter and S/Kademlia propose, entries (and replacements) are
 * limited per network, a /24 for IPv4 and a /48 for IPv6: at most
 * DHT_TABLE_PER_BUCKET_NET in one bucket, DHT_TABLE_PER_NET in the table,
 * and DHT_TABLE_PER_IP from one exact IP. A node over a limit is refused
 * (-EDQUOT), as when its bucket is full of live nodes. By default loopback
 * and private addresses are exempt (enum dht_diversity): a local swarm runs
 * every process on one address, and a LAN is one operator's.
 *
 * Memory per bucket grows on demand, so a table of a few hundred nodes
 * costs a few tens of kilobytes. Not thread-safe.
 */
#ifndef DHT_TABLE_H
#define DHT_TABLE_H

#include <stddef.h>
#include <stdint.h>

#include "dht/addr.h"
#include "dht/id.h"
#include "dht/wire.h"

#ifndef DHT_K
#define DHT_K 20
#endif
#ifndef DHT_TABLE_REPLACEMENTS
#define DHT_TABLE_REPLACEMENTS 8
#endif
#ifndef DHT_TABLE_MAX_FAILS
#define DHT_TABLE_MAX_FAILS 2
#endif
#ifndef DHT_TABLE_PER_BUCKET_NET
#define DHT_TABLE_PER_BUCKET_NET 2 /* entries per /24 (/48) in one bucket */
#endif
#ifndef DHT_TABLE_PER_NET
#define DHT_TABLE_PER_NET 8        /* entries per /24 (/48) in the table */
#endif
#ifndef DHT_TABLE_PER_IP
#define DHT_TABLE_PER_IP 4         /* entries per exact IP in the table */
#endif
#define DHT_BUCKETS (DHT_ID_LEN * 8)

typedef struct dht_table dht_table;

typedef struct dht_table_entry {
    uint8_t id[DHT_ID_LEN];
    dht_addr addr;
    uint64_t last_seen;     /* ms of the last good reply (or keep-alive) */
    uint8_t fails;          /* consecutive failed requests */
    uint8_t pinging;        /* an eviction check ping is outstanding */
    uint8_t has_token;
    uint8_t token[DHT_TOKEN_LEN]; /* its write token for our address */
} dht_table_entry;

enum dht_table_insert_result {
    DHT_TABLE_UPDATED = 0,   /* known: last_seen (and token) refreshed */
    DHT_TABLE_ADDED = 1,     /* new entry in its bucket */
    DHT_TABLE_CACHED = 2,    /* bucket full: kept as a replacement */
};

/* Bucket index of id relative to self: the number of leading bits they share
 * (0..159), or -1 when id == self. */
int dht_id_common_prefix(const uint8_t self[DHT_ID_LEN], const uint8_t id[DHT_ID_LEN]);

/* -1, 0, 1 as a is closer to, as close as, or farther from target than b. */
int dht_id_distance_cmp(const uint8_t target[DHT_ID_LEN], const uint8_t a[DHT_ID_LEN],
                        const uint8_t b[DHT_ID_LEN]);

/* k entries per bucket (0 = DHT_K). Returns NULL on allocation failure. */
dht_table *dht_table_create(const uint8_t self[DHT_ID_LEN], size_t k);
void dht_table_destroy(dht_table **t);

/* Which addresses the per-network limits apply to (enum dht_diversity;
 * DHT_DIVERSITY_PUBLIC after create). Entries already held are kept. */
void dht_table_set_diversity(dht_table *t, int mode);

/* Records a node that proved its ID at addr. token may be NULL. Returns an
 * enum dht_table_insert_result, -EINVAL for our own ID, -EEXIST when the ID
 * is known at another address (the entry is kept: moving a known ID needs
 * the old address to fail first), -EDQUOT when addr's network (or IP) has
 * its share of the bucket or table already (neither entry nor replacement),
 * or -ENOMEM. On DHT_TABLE_CACHED,
 * *ping_out (if not NULL) is set to the least-recently-seen entry when the
 * caller should ping it (not already being pinged), else NULL. */
int dht_table_insert(dht_table *t, const uint8_t id[DHT_ID_LEN], const dht_addr *addr,
                     const uint8_t *token, uint64_t now, dht_table_entry **ping_out);

/* The entry for id, or NULL. The pointer is valid until the next insert,
 * failed or remove. */
dht_table_entry *dht_table_find(dht_table *t, const uint8_t id[DHT_ID_LEN]);

/* A request to id failed. After DHT_TABLE_MAX_FAILS consecutive failures (or
 * a failed eviction ping, force != 0) the entry is removed and the newest
 * replacement that is within the per-network limits takes its place.
 * Returns 1 if removed, 0 otherwise. */
int dht_table_failed(dht_table *t, const uint8_t id[DHT_ID_LEN], int force);

/* Writes the (up to) n entries closest to target, nearest first, into out
 * (copies). Returns the count. */
size_t dht_table_closest(const dht_table *t, const uint8_t target[DHT_ID_LEN], size_t n,
                         dht_table_entry *out);

/* The number of nodes in the table. */
size_t dht_table_size(const dht_table *t);

/* 1 if a node with this ID at addr would go straight into its bucket (not
 * known, bucket not full, within the per-network limits; addr NULL: no
 * address check), else 0. */
int dht_table_has_room(const dht_table *t, const uint8_t id[DHT_ID_LEN], const dht_addr *addr);

/* Deepest non-empty bucket index, or -1 for an empty table. */
int dht_table_depth(const dht_table *t);

/* Bucket refresh bookkeeping: last time bucket i saw a lookup through it. */
uint64_t dht_table_bucket_refreshed(const dht_table *t, int i);
void dht_table_bucket_touch(dht_table *t, int i, uint64_t now);

#endif
