/* dht/identity.h: a node's long-lived ed25519 identity.
 *
 * The identity file is one line of text:
 *
 *     starling-ed25519-v1 <seed: 64 hex digits> <public key: 64 hex digits>\n
 *
 * The secret key is re-derived from the seed on load and the derived public
 * key must equal the stored one, so a flipped bit anywhere is detected. The
 * file must be private to its owner (no group/other permission bits), as with
 * ssh keys; a world- or group-readable file is refused.
 *
 * The struct is plain data: it may be copied and embedded. It holds secret
 * material, so callers should sodium_memzero() it when done.
 */
#ifndef DHT_IDENTITY_H
#define DHT_IDENTITY_H

#include <stdint.h>

#include "dht/id.h"

#define DHT_PUBKEY_LEN 32
#define DHT_SECKEY_LEN 64
#define DHT_SIG_LEN 64
#define DHT_IDENTITY_MAGIC "starling-ed25519-v1"

typedef struct dht_identity {
    uint8_t pk[DHT_PUBKEY_LEN];   /* ed25519 public key */
    uint8_t sk[DHT_SECKEY_LEN];   /* ed25519 secret key (seed || pk, libsodium layout) */
    uint8_t id[DHT_ID_LEN];       /* BLAKE2b-160(pk) */
} dht_identity;

/* Initialises libsodium (idempotent, thread-safe). Returns 0 or -EIO. Every
 * other function here calls it, so callers rarely need to. */
int dht_crypto_init(void);

/* Fills out with a fresh random key pair. Returns 0 or -EIO (libsodium
 * failed to initialise). */
int dht_identity_generate(dht_identity *out);

/* Fills out deterministically from a 32-byte seed (tests, simulations).
 * Returns 0 or -EIO. */
int dht_identity_from_seed(dht_identity *out, const uint8_t seed[32]);

/* Writes the identity to path with mode 0600: a temporary file in the same
 * directory, fsync, then link into place, so a crash never leaves a torn
 * file. Refuses to replace an existing file unless overwrite is non-zero.
 * Returns 0, -EEXIST, or another -errno from the file system. */
int dht_identity_save(const dht_identity *ident, const char *path, int overwrite);

/* Loads an identity written by dht_identity_save. Returns 0 on success and
 * fills out; on failure out is zeroed and the result is
 *   -ENOENT   no such file,
 *   -EPERM    the file is readable or writable by group or others,
 *   -EBADMSG  the contents are not a valid identity (corrupt, truncated,
 *             wrong magic, key mismatch),
 *   or another -errno from the file system. */
int dht_identity_load(dht_identity *out, const char *path);

/* A sentence describing an error returned by dht_identity_load/save, for
 * messages to users. Never NULL; the string is static. */
const char *dht_identity_strerror(int err);

#endif
