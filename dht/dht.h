/* dht/dht.h: the public face of the membership layer.
 *
 * dht/ knows nothing of expert/: it provides identities, 160-bit IDs, the
 * sans-I/O Kademlia core (dht/node.h) and this libuv UDP binding. Layers
 * above include this header only.
 *
 * A dht runs one node on one UDP socket (IPv4 or IPv6) on a libuv loop. All
 * functions but dht_now_ms and dht_swarm_key_load must be called on the
 * loop's thread, and every callback runs on it. A function that takes a
 * callback and fails (returns -errno) never calls it; one that succeeds
 * calls it exactly once, later (never from inside the call), with
 * -ECANCELED if the dht is closed first. Functions that take a dht need a
 * live one (not NULL unless said otherwise, not after dht_close).
 *
 * Callbacks may call any function here, dht_close included: a dht closed
 * from inside one of its callbacks is closed once that callback has
 * returned, and meanwhile new operations fail with -ECANCELED.
 *
 * Typical use by the peer layer (announce a block every ~20 s):
 *
 *     uint8_t key[DHT_ID_LEN];
 *     dht_id_of_bytes(key, "fmnist-mlp.2", 12);
 *     dht_put(d, key, NULL, 0, info, info_len, dht_now_ms() + 60000, 1, on_put, ctx);
 *     dht_get(d, key, on_holders, ctx);  // entries: one per holder, signed
 *
 * Signed entries have subkey = the signer's node ID and carry its public key;
 * the DHT has verified the signature before a callback sees them.
 */
#ifndef DHT_DHT_H
#define DHT_DHT_H

#include <stddef.h>
#include <stdint.h>

#include <uv.h>

#include "dht/addr.h"
#include "dht/id.h"
#include "dht/identity.h"
#include "dht/node.h"
#include "dht/wire.h"

typedef struct dht dht;

/* status: 0 (join), a count of nodes that stored the entry (put, >= 1: the
 * acknowledgements when the put reports, once the quorum nearest nodes have
 * stored it; the stores to the rest of the k nearest go on), or -errno:
 * -EHOSTUNREACH (nobody answered), -ECANCELED (closed), and for a join also
 * -EADDRNOTAVAIL (an initial peer answered with another node ID than the
 * one given), -EKEYREJECTED (a node answered that it is under another swarm
 * key, or none), -EADDRINUSE (another node proved our own node ID from
 * another address: it runs with our identity file; the join itself may have
 * worked). dht_join_strerror gives the details. */
typedef void (*dht_done_cb)(dht *d, int status, void *ud);

/* status 0 or -errno (dht_get); entries[0..n) are every live entry of the
 * key found on the quorum (DHT_QUORUM, 8) nearest nodes, merged, one per
 * (subkey, signed) with the latest expiration (entries may be NULL when n is
 * 0). The array and the bytes its entries point to are borrowed for the
 * duration of the callback only: copy what you keep. */
typedef void (*dht_get_cb)(dht *d, int status, const dht_entry *entries, size_t n, void *ud);

/* dht_close's: d is only an identity here, freed when this returns. */
typedef void (*dht_close_cb)(dht *d, void *ud);

/* Wall-clock milliseconds since the epoch: the clock expirations use. */
uint64_t dht_now_ms(void);

/* Reads a swarm key file: 64 hex digits (32 bytes), optional trailing
 * newline. Returns 0, -EBADMSG (malformed), -EPERM (readable by group or
 * others) or another -errno. */
int dht_swarm_key_load(uint8_t key[32], const char *path);

/* What dht_swarm_key_load's status means, as the end of a sentence
 * ("cannot load swarm key 'F': ..."). Static string. */
const char *dht_swarm_key_strerror(int status);

/* Creates a node with identity ident (copied) and configuration cfg (copied;
 * NULL: defaults; set cfg->has_swarm_key/swarm_key for a private swarm) on
 * loop, which must outlive d (until dht_close's callback). Returns NULL on
 * failure (loop or ident NULL, no memory, libsodium cannot start). Nothing
 * happens on the network until dht_start. */
dht *dht_create(uv_loop_t *loop, const dht_identity *ident, const dht_config *cfg);

/* Binds the UDP socket to listen ("HOST:PORT", "[V6]:PORT"; port 0 picks a
 * free one) and starts receiving. Returns 0, -EINVAL, or a libuv -errno; on
 * failure d stays valid and must still be released with dht_close. A socket
 * bound to a specific IPv6 address reaches IPv6 peers only; one bound to
 * [::] reaches both (IPv4 through mapped addresses). */
int dht_start(dht *d, const char *listen);

/* The address actually bound (after dht_start). Returns 0 or -ENOTCONN. */
int dht_local_addr(const dht *d, dht_addr *out);

/* The peer address string others pass to --initial-peers ("HOST:PORT/ID").
 * A wildcard host (0.0.0.0, ::) is printed as given; replace it by a
 * reachable address. Returns the length written (without NUL), or
 * -ENOTCONN (not started), -ENOSPC (cap too small) or -EINVAL. */
int dht_peer_string(const dht *d, char *buf, size_t cap);

/* Our node ID: DHT_ID_LEN bytes owned by d, set by dht_create (from the
 * identity) and never changed, valid until dht_close frees d (copy it to
 * keep it longer). Usable before dht_start. */
const uint8_t *dht_self_id(const dht *d);

/* Joins the swarm through peers (see dht_node_join for what is done and
 * for every status). peers[0..n_peers) are read during the call only. cb
 * (may be NULL) runs once, later, on the loop thread, with the join's
 * status (dht_done_cb). Returns 0 or -EINVAL (d or peers NULL, n_peers 0),
 * -ENOTCONN (not started), -ECANCELED (closing), -ENOMEM, -EAGAIN (too
 * many operations under way); then cb never runs. */
int dht_join(dht *d, const dht_peer_addr *peers, size_t n_peers, dht_done_cb cb, void *ud);

/* For a process that runs the loop itself before it hands it over (the
 * light clients: tools/client.c, capi/): dht_join, then runs d's loop on
 * the calling thread until the join ends or timeout_s passes. Returns the
 * join's status (0 or -errno as dht_done_cb's, -EADDRINUSE included) or
 * -ETIMEDOUT; a failure to start the join is returned as is. Loop thread
 * only; nothing else may run the loop meanwhile. */
int dht_join_wait(dht *d, const dht_peer_addr *peers, size_t n_peers, double timeout_s);

/* The local address a client should listen on to reach `first` (the first
 * initial peer): "127.0.0.1:0" / "[::1]:0" for loopback, else "0.0.0.0:0"
 * / "[::]:0" (any port, same address family). Static string. */
const char *dht_client_listen(const dht_peer_addr *first);

/* "HOST:PORT" of the latest node that proved our own node ID from another
 * address (during a join or any later lookup). Returns the length, or
 * -ENOENT (none seen), -ENOSPC. */
int dht_collision_addr(const dht *d, char *buf, size_t cap);

/* A sentence (no trailing period) on a join's status for people, using the
 * join's detail: "127.0.0.1:4000 answered as node <hex>, not <hex>",
 * "127.0.0.1:4000 answers, but not under our swarm key", "another node is
 * online with our node ID <hex> at 127.0.0.1:4000", "no initial peer
 * answered", or strerror. Callers add the advice (which flag to check).
 * Returns the length written (truncated to cap). */
int dht_join_strerror(const dht *d, int status, char *buf, size_t cap);

/* Stores (key, subkey) -> value until expires_ms (absolute, dht_now_ms clock,
 * at most 24 h ahead). With sign != 0 the subkey argument is ignored: the
 * entry's subkey is our node ID and it is signed with our identity, so
 * nobody else can overwrite it; unsigned entries get a small share of
 * each node and are not republished by others (dht_node_put). value and
 * subkey are copied. cb (may be NULL) runs once, later, on the loop thread,
 * with the count of nodes that stored it or -errno (dht_done_cb). Returns
 * 0 or -EINVAL (d or key NULL, value NULL with value_len > 0; sizes: value
 * <= DHT_MAX_VALUE, subkey <= DHT_MAX_SUBKEY; expires_ms not in (now, now +
 * DHT_MAX_TTL_MS]),
 * -ENOTCONN (not started), -ECANCELED (closing), -ENOMEM, -EAGAIN (too
 * many operations under way); then cb never runs. */
int dht_put(dht *d, const uint8_t key[DHT_ID_LEN], const uint8_t *subkey, size_t subkey_len,
            const void *value, size_t value_len, uint64_t expires_ms, int sign, dht_done_cb cb,
            void *ud);

/* Collects every live entry of key from the quorum nearest nodes and our
 * own store (dht_node_get). cb (required) runs once, later, on the loop
 * thread (dht_get_cb): status 0 with the entries (none if nobody holds
 * the key), -EHOSTUNREACH when no node answered and no entry was found,
 * -ENOMEM when the entries could not be handed over, or -ECANCELED (the
 * dht closed first; the entries collected from other nodes so far, if
 * any, still come with it). Signed entries' signatures are checked;
 * unsigned entries are whatever anyone stored, to be checked by the
 * caller. Returns 0 or -EINVAL (d, key or cb NULL), -ENOTCONN (not
 * started), -ECANCELED (closing), -ENOMEM, -EAGAIN (too many operations
 * under way); then cb never runs. */
int dht_get(dht *d, const uint8_t key[DHT_ID_LEN], dht_get_cb cb, void *ud);

/* Fills *out (the caller's) with a snapshot of the node's counters, table
 * and store sizes, requests and operations under way (dht/node.h). Cannot
 * fail; usable before dht_start. */
void dht_get_stats(const dht *d, dht_node_stats *out);

/* Cancels pending operations (their callbacks get -ECANCELED), closes the
 * handles and frees d; cb (may be NULL) runs once everything is closed.
 * Called from one of d's callbacks, all of this happens when that callback
 * returns; otherwise the cancelled callbacks run inside this call, and so
 * does cb when d holds no libuv handle (dht_start not called, or failed
 * before opening one); else cb runs in a later loop iteration, once libuv
 * has closed the handles. Meanwhile a second dht_close does nothing and
 * new operations fail with -ECANCELED. dht_close(NULL) does nothing. d
 * must not be used after this call. */
void dht_close(dht *d, dht_close_cb cb, void *ud);

#endif
