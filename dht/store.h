/* dht/store.h: the records a node holds for others.
 *
 * A record maps a 160-bit key to entries identified by (subkey, signed):
 *
 *   - unsigned entries: anyone with a write token may store them;
 *   - signed entries: the subkey must be BLAKE2b-160 of the entry's ed25519
 *     public key, and the signature (dht_entry_sign) must verify. Signed and
 *     unsigned entries live in separate namespaces, so nobody can shadow an
 *     owner's signed entry with an unsigned one that has the same subkey.
 *
 * Per entry the newest expiration wins; an entry whose expiration has passed
 * is never returned and is freed by dht_store_expire. Everything is bounded
 * (keys, entries per key, value size, total bytes).
 *
 * Unsigned entries cost their writer nothing but a write token, so they get
 * a small, separate share that can never crowd out signed ones:
 *
 *   - signed entries come first in every key (dht_store_get's order), so a
 *     reader that follows a bounded number of pages sees every signed entry
 *     before any unsigned one;
 *   - per key at most max_unsigned unsigned entries, max_unsigned_key_bytes
 *     bytes of them, and max_unsigned_per_source from one source network
 *     (the /24 or /48 of the address that stored it; the exact IP for
 *     loopback and private addresses); in the whole store at most
 *     max_unsigned_bytes of them;
 *   - a signed entry that finds its key, the key table or the byte budget
 *     full first evicts unsigned entries (of its own key first, soonest
 *     expiring first) and only then is refused.
 *
 * When full otherwise, a put that would need more room is refused with
 * -ENOSPC rather than evicting a signed entry.
 *
 * Not thread-safe: one owner (a dht_node) uses it.
 */
#ifndef DHT_STORE_H
#define DHT_STORE_H

#include <stddef.h>
#include <stdint.h>

#include "dht/addr.h"
#include "dht/identity.h"
#include "dht/wire.h"

#ifndef DHT_STORE_MAX_KEYS
#define DHT_STORE_MAX_KEYS 4096
#endif
#ifndef DHT_STORE_MAX_SUBKEYS
#define DHT_STORE_MAX_SUBKEYS 256
#endif
#ifndef DHT_STORE_MAX_BYTES
#define DHT_STORE_MAX_BYTES (16u << 20)
#endif
#ifndef DHT_STORE_MAX_UNSIGNED
#define DHT_STORE_MAX_UNSIGNED 64 /* unsigned entries per key */
#endif
#ifndef DHT_STORE_MAX_UNSIGNED_KEY_BYTES
#define DHT_STORE_MAX_UNSIGNED_KEY_BYTES (32u << 10) /* per key, 160 per entry included */
#endif
#ifndef DHT_STORE_MAX_UNSIGNED_PER_SOURCE
#define DHT_STORE_MAX_UNSIGNED_PER_SOURCE 8 /* per key and source network */
#endif
#ifndef DHT_MAX_TTL_MS
#define DHT_MAX_TTL_MS (24ull * 3600 * 1000) /* farther expirations are refused */
#endif

typedef struct dht_store dht_store;

/* Zero fields take the defaults above; max_unsigned_bytes defaults to a
 * quarter of max_bytes. */
typedef struct dht_store_limits {
    size_t max_keys, max_subkeys, max_bytes;
    size_t max_unsigned, max_unsigned_key_bytes, max_unsigned_per_source, max_unsigned_bytes;
} dht_store_limits;

/* Signs e in place for key with ident: sets is_signed, pk and sig. The
 * subkey must already be ident's node ID (20 bytes); returns 0 or -EINVAL.
 * The signed message is "starling-dht-entry-v1" || key || u8 subkey_len ||
 * subkey || u64be expires || value. */
int dht_entry_sign(dht_entry *e, const uint8_t key[DHT_ID_LEN], const dht_identity *ident);

/* Checks an entry on its own: sizes, subkey == ID(pk) and the signature for
 * signed entries, now < expires <= now + DHT_MAX_TTL_MS. Returns 0, -EINVAL
 * (sizes, bad owner), -EPERM (bad signature) or -ESTALE (expired/too far). */
int dht_entry_check(const dht_entry *e, const uint8_t key[DHT_ID_LEN], uint64_t now);

/* NULL limits means the defaults above. Returns NULL on allocation failure. */
dht_store *dht_store_create(const dht_store_limits *limits);
void dht_store_destroy(dht_store **s);

/* Checks e (dht_entry_check) and stores a copy, as written by this node
 * itself (no per-source limit). Returns 1 if stored or replaced, 0 if an
 * entry with the same or a later expiration is held (it is kept), or
 * -EINVAL/-EPERM/-ESTALE/-ENOSPC/-ENOMEM. e is borrowed. The checks, in
 * order: sizes (-EINVAL); a copy with the same or a later expiration held
 * (0, no signature check); expiration range (-ESTALE) and owner/signature
 * (-EINVAL/-EPERM); then room (-ENOSPC): unsigned quotas, entries per key,
 * keys, bytes, where a signed entry first evicts unsigned ones. */
int dht_store_put(dht_store *s, const uint8_t key[DHT_ID_LEN], const dht_entry *e, uint64_t now);

/* As dht_store_put for an entry that src stored (a store request from that
 * address): unsigned entries count against src's network's share of the key.
 * src NULL = our own entry. */
int dht_store_put_from(dht_store *s, const uint8_t key[DHT_ID_LEN], const dht_entry *e,
                       uint64_t now, const dht_addr *src);

/* Copies up to max live entries of key, starting at index offset in a stable
 * order (signed entries first, then by subkey length and subkey), into
 * out. Pointers in out borrow from the store and stay valid until the next
 * put/expire. *total_out (if not NULL)
 * receives the number of live entries. Returns the count written. */
size_t dht_store_get(dht_store *s, const uint8_t key[DHT_ID_LEN], uint64_t now, size_t offset,
                     dht_entry *out, size_t max, size_t *total_out);

/* Frees every expired entry and empty key. Returns the number freed. */
size_t dht_store_expire(dht_store *s, uint64_t now);

/* Key iteration for republish and hand-over: writes up to max keys, starting
 * after the cursor-th key in an unspecified but stable order while nothing is
 * added or removed. Returns the count; *cursor advances (0 restarts). */
size_t dht_store_keys(dht_store *s, size_t *cursor, uint8_t (*keys)[DHT_ID_LEN], size_t max);

/* Gauges: keys held, entries, bytes held (values and per-entry overhead)
 * and the part of those bytes in unsigned entries. */
size_t dht_store_count_keys(const dht_store *s);
size_t dht_store_count_entries(const dht_store *s);
size_t dht_store_bytes(const dht_store *s);
size_t dht_store_unsigned_bytes(const dht_store *s);

#endif
