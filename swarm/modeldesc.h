/* swarm/modeldesc.h: a model's description travels with the swarm.
 *
 * Whoever serves a model publishes its description (the canonical JSON of
 * its spec, expert_model_to_json) in the DHT, so that a peer or client can
 * join with --model NAME alone and take the architecture from the swarm.
 * Both sides are here: publishing (peer/announcer.c calls it on the
 * announcements' cadence) and fetching (tools/client.c).
 *
 * The description hash is the first 20 bytes of SHA-256 of the canonical
 * JSON. The JSON is cut into chunks of PEER_MODELDESC_CHUNK bytes (at most
 * PEER_MODELDESC_MAX_CHUNKS); chunk i is stored under the key
 *     BLAKE2b-160("starling.model:<40 hex digits of the hash>:<i>")
 * (i decimal), as a signed entry (subkey = the publisher's node ID) whose
 * value is a msgpack map:
 *     "v" u   1
 *     "n" u   number of chunks, 1..PEER_MODELDESC_MAX_CHUNKS
 *     "i" u   this chunk's index, < n (and the index of the key it is under)
 *     "c" bin the chunk's bytes, 1..PEER_MODELDESC_CHUNK (every chunk but
 *             the last is full)
 * Unknown keys are skipped. The models index entry (swarm/announce.h) names
 * the hash in its optional field "d".
 *
 * A fetch reads the models index, takes the distinct hashes of the entries
 * naming the model (the PEER_MODELDESC_MAX_CANDIDATES most listed), and
 * for each reads its chunks: anyone's chunks will do,
 * since the content is checked, not the signer. The chunks are put together
 * per publisher (and, failing that, by majority per index) and accepted only
 * when the whole hashes to the advertised hash, parses strictly
 * (expert_model_parse), names the model asked for and is canonical
 * (expert_model_to_json of the parsed spec gives the same bytes). The index
 * entries' stage counts are not compared: anyone who lists a hash sets its
 * "n", and the hash already pins the description. Descriptions that fail are refused with a
 * sentence naming the publisher; two different descriptions that pass for
 * one name are a conflict (the user must pass --model-file).
 *
 * Loop thread only for the DHT functions; the rest is pure.
 */
#ifndef SWARM_MODELDESC_H
#define SWARM_MODELDESC_H

#include <stddef.h>
#include <stdint.h>

#include "dht/dht.h"

struct expert_model_spec;

#define PEER_MODELDESC_HASH_LEN 20
#define PEER_MODELDESC_CHUNK 700       /* content bytes per chunk: a value is <= 716 bytes */
#define PEER_MODELDESC_MAX_CHUNKS 64   /* so a description is at most 44 800 bytes */
#define PEER_MODELDESC_MAX_BYTES (PEER_MODELDESC_CHUNK * PEER_MODELDESC_MAX_CHUNKS)
#define PEER_MODELDESC_VALUE_MAX (PEER_MODELDESC_CHUNK + 32) /* an encoded chunk fits */
/* Fetching: distinct descriptions considered per name, publishers kept per
 * description, distinct contents kept per chunk index. */
#define PEER_MODELDESC_MAX_CANDIDATES 8
#define PEER_MODELDESC_MAX_SIGNERS 16
#define PEER_MODELDESC_MAX_VARIANTS 4

/* ---- the format (pure) ---- */

/* The description hash of len bytes of JSON. */
void peer_modeldesc_hash(uint8_t hash[PEER_MODELDESC_HASH_LEN], const void *json, size_t len);

/* The key of chunk i of the description with this hash. */
void peer_modeldesc_key(uint8_t key[DHT_ID_LEN], const uint8_t hash[PEER_MODELDESC_HASH_LEN], int i);

/* The number of chunks of a description of len bytes, or -EFBIG (more than
 * PEER_MODELDESC_MAX_CHUNKS) / -EINVAL (len 0). */
int peer_modeldesc_chunks(size_t len);

/* Encodes chunk i of the description json[0..len) into buf. Returns the
 * value's length, -EINVAL (i out of range, len 0 or too big) or -EMSGSIZE. */
long peer_modeldesc_chunk_encode(const void *json, size_t len, int i, uint8_t *buf, size_t cap);

typedef struct peer_modeldesc_chunk {
    int n, i;
    const uint8_t *data;   /* borrows the decoded buffer */
    size_t len;
} peer_modeldesc_chunk;

/* Decodes an untrusted chunk value: 0, or -EBADMSG (malformed, wrong types,
 * n out of 1..MAX_CHUNKS, i >= n, empty or oversized content, a chunk other
 * than the last that is not full); out is zeroed on failure. */
int peer_modeldesc_chunk_decode(peer_modeldesc_chunk *out, const uint8_t *buf, size_t len);

/* ---- putting one description's chunks together (pure) ---- */

typedef struct peer_modeldesc_asm peer_modeldesc_asm;

/* An assembler of the chunks of the description with this hash. NULL on no
 * memory. */
peer_modeldesc_asm *peer_modeldesc_asm_create(const uint8_t hash[PEER_MODELDESC_HASH_LEN]);
void peer_modeldesc_asm_free(peer_modeldesc_asm *a);

/* Adds the value found under chunk `key_index`'s key, signed by signer (20
 * bytes). Returns 0 (kept, or the same content seen before), -EBADMSG
 * (malformed value, or its "i" is not key_index), -EEXIST (this signer sent
 * another content for the same chunk: its chunks are all dropped),
 * -ENOSPC (too many publishers or contents for this chunk: ignored). The
 * reason goes to err (may be NULL) when not 0. */
int peer_modeldesc_asm_add(peer_modeldesc_asm *a, const uint8_t signer[DHT_ID_LEN], int key_index,
                           const uint8_t *value, size_t len, char *err, size_t errlen);

/* The number of chunks to read: the largest "n" any kept chunk claims (0:
 * none kept yet). */
int peer_modeldesc_asm_want(const peer_modeldesc_asm *a);

/* Puts the chunks together and checks the result (see above): the hash,
 * the strict parse, the model's name (unless name is NULL), its number of
 * stages (when n_stages > 0) and the canonical form. Returns the
 * parsed spec (owned: expert_model_free or expert_model_register it), with
 * the JSON's length in *json_len when not NULL; or NULL with one sentence in
 * err saying what was refused and from whom. */
struct expert_model_spec *peer_modeldesc_asm_finish(peer_modeldesc_asm *a, const char *name, int n_stages,
                                                    size_t *json_len, char *err, size_t errlen);

/* ---- publishing ---- */

typedef struct peer_modeldesc {
    char *json;            /* canonical JSON (owned) */
    size_t len;
    uint8_t hash[PEER_MODELDESC_HASH_LEN];
    int n_chunks;
} peer_modeldesc;

/* The description of spec: 0, -EINVAL (no canonical JSON), -EFBIG (more
 * than PEER_MODELDESC_MAX_CHUNKS chunks) or -ENOMEM. */
int peer_modeldesc_make(peer_modeldesc *out, const struct expert_model_spec *spec);
void peer_modeldesc_clear(peer_modeldesc *m);

/* Puts every chunk of desc, signed, expiring at expires_ms; cb (may be
 * NULL) runs once per put started. Returns the number of puts started. */
int peer_modeldesc_publish(dht *d, const peer_modeldesc *desc, uint64_t expires_ms, dht_done_cb cb, void *ud);

/* ---- fetching ---- */

/* A fetch's outcome. status 0: spec is the description's model (owned by
 * the callee now), hash and json_len say which. Otherwise spec is NULL and
 * err holds one sentence: -ENOENT (no models index entry names the model
 * with a description), -EBADMSG (every description was refused),
 * -ENOTUNIQ (several different valid descriptions), -EHOSTUNREACH (the
 * models index could not be read), -ECANCELED (the DHT closed). */
typedef void (*peer_modeldesc_fetch_cb)(int status, struct expert_model_spec *spec,
                                        const uint8_t hash[PEER_MODELDESC_HASH_LEN], size_t json_len,
                                        const char *err, void *arg);

/* Fetches the description of the model called name (see above); cb runs
 * once, later, on the loop. Every read is a dht_get, bounded by the DHT's
 * own timeouts; at most 8 run at once. Returns 0, or -EINVAL (bad name),
 * -ENOMEM, or dht_get's error; then cb never runs. */
int peer_modeldesc_fetch(dht *d, const char *name, peer_modeldesc_fetch_cb cb, void *arg);

#endif
