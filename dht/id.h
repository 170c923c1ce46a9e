/* dht/id.h: 160-bit identifiers.
 *
 * A node ID is the BLAKE2b-160 hash of the node's ed25519 public key; the DHT key
 * of a string (a block name such as "fmnist-mlp.2") is the BLAKE2b-160 hash of
 * its bytes. Both live in the same 160-bit space, so the XOR metric applies to
 * both. All functions are pure and thread-safe.
 */
#ifndef DHT_ID_H
#define DHT_ID_H

#include <stddef.h>
#include <stdint.h>

#define DHT_ID_LEN 20      /* bytes in an ID: 160 bits */
#define DHT_ID_HEX_LEN 40  /* hex digits in an ID, without the NUL */

/* out = BLAKE2b-160(pk). pk is a 32-byte ed25519 public key. */
void dht_id_of_pubkey(uint8_t out[DHT_ID_LEN], const uint8_t pk[32]);

/* out = BLAKE2b-160(data[0..len)). */
void dht_id_of_bytes(uint8_t out[DHT_ID_LEN], const void *data, size_t len);

/* Writes 40 lower-case hex digits and a NUL into out. */
void dht_id_to_hex(char out[DHT_ID_HEX_LEN + 1], const uint8_t id[DHT_ID_LEN]);

/* Parses exactly 40 hex digits (either case) from a NUL-terminated string.
 * Returns 0, or -EINVAL for a wrong length or a non-hex character; out is
 * untouched on failure. */
int dht_id_from_hex(uint8_t out[DHT_ID_LEN], const char *hex);

#endif
