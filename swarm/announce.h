/* swarm/announce.h: what a peer stores in the DHT about the blocks it serves.
 *
 * Under the key BLAKE2b-160("<model>.<index>") each holder stores one entry,
 * signed with its identity (so subkey = its node ID), whose value is a
 * msgpack map:
 *     "v"  u   format version (1)
 *     "b"  str block name, "<model>.<index>" (<= 64 bytes)
 *     "a"  str tensor RPC address "HOST:PORT" or "[V6]:PORT" (<= 64 bytes)
 *     "st" u   state: 0 joining, 1 online, 2 offline
 *     "h"  u   stage hash (expert_stage_hash): holders and clients must agree
 *     "wv" u   weight version (optimizer steps applied)
 *     "tp" f64 measured training throughput, samples/s (forward + backward)
 *     "ld" f64 load: queued rows / queue bound, in [0, 1]
 *     "dv" str device, e.g. "cpu" or "cuda:0" (<= 32 bytes)
 *     "pr" str precision of the device's math, "fp32" or "bf16" (<= 8 bytes;
 *              optional: absent means fp32, as older peers)
 *     "t"  u   when this value was made, ms since the epoch
 *     "ar" u   group averaging rounds completed (optional)
 *     "ag" u   size of the group of the last completed round (optional)
 *     "af" u   group averaging rounds abandoned (optional)
 *     "lf" u   state lost: the weight version this holder had before it
 *              restarted with older weights (optional; with "lt")
 *     "lt" u   the weight version it restarted from (optional)
 *     "gr" u   gradients refused: backward requests and optimizer steps that
 *              failed the training-integrity checks since the peer started
 *              (optional; absent when 0)
 *     "fz" u   frozen: the holder's latest N optimizer steps applied
 *              gradients but changed no weight (optional; present only
 *              once N reaches the peer's threshold, 8 by default, so a
 *              reader flags the holder when "fz" is present)
 *     "wf" u   tensor formats the holder accepts on the wire, bit f for
 *              peer_fmt f (net/tensorfmt.h: 1 f32, 2 f16, 4 bf16, 8 q8;
 *              optional: absent means float32 only, as older peers)
 *     "bs" f64 tensor bytes received and sent per sample served (forward,
 *              backward and infer rows of all its blocks) since it started
 *              (optional; absent before the first request)
 * It expires about a minute after it is written and is renewed every ~20 s,
 * so a peer that dies disappears within a minute. Unknown keys are skipped
 * (newer peers may add fields); missing required keys ("v", "b", "a", "st",
 * "h") make the value invalid.
 *
 * Under the key BLAKE2b-160(PEER_MODELS_KEY) each peer also stores a signed
 * entry naming the model it serves, so a monitor can list the models of a
 * swarm without knowing their names:
 *     "v" u 1, "m" str model name (<= 48 bytes), "n" u number of stages,
 *     "d" bin 20: the hash of the model's description, published in chunks
 *         under keys of its own (swarm/modeldesc.h; optional: older peers
 *         leave it out, older readers skip it).
 *
 * Group averaging stores its matchmaking entries in the same frame
 * (peer/averaging.h).
 *
 * Cold copies (peer/keeper.h): a peer that keeps a copy of a stage it does
 * not serve stores, under BLAKE2b-160("starling.keep:<block>:<stage hash,
 * 16 hex digits>"), a signed entry (subkey = its node ID):
 *     "v" u 1, "a" str tensor RPC address it serves the copy from,
 *     "wv" u weight version of the copy (0: withdrawn, skip it),
 *     "t" u when it was taken (ms).
 */
#ifndef SWARM_ANNOUNCE_H
#define SWARM_ANNOUNCE_H

#include <stddef.h>
#include <stdint.h>

#define PEER_ANNOUNCE_VERSION 1
#define PEER_MODELS_KEY "starling/models"
#define PEER_ANNOUNCE_MAX_BYTES 400   /* an encoded value is at most this */

typedef enum peer_state {
    PEER_STATE_JOINING = 0,
    PEER_STATE_ONLINE = 1,
    PEER_STATE_OFFLINE = 2,
} peer_state;

typedef struct peer_announce {
    char block[65];
    char addr[65];
    peer_state state;
    uint64_t stage_hash;
    uint64_t weight_version;
    double throughput;
    double load;
    char device[33];
    char precision[9];            /* "pr": "" = not sent (fp32) */
    uint64_t time_ms;
    uint64_t avg_rounds;
    int avg_group;
    uint64_t avg_abandoned;
    uint64_t lost_from, lost_to;  /* lost_from > lost_to: state went back */
    uint64_t grads_refused;       /* "gr": 0 = not sent */
    uint64_t frozen_steps;        /* "fz": 0 = not frozen (not sent) */
    uint32_t formats;             /* "wf": tensor formats accepted (peer_fmt_mask); 0 =
                                     not sent: float32 only */
    double bytes_per_sample;      /* "bs": 0 = not sent */
} peer_announce;

typedef struct peer_model_record {
    char model[49];
    int n_stages;
    int has_desc;              /* "d" present */
    uint8_t desc_hash[20];     /* "d": the description hash (swarm/modeldesc.h) */
} peer_model_record;

/* Encodes a into buf. Returns the length, -EINVAL (a string too long or
 * with control characters, a state out of range, non-finite numbers) or
 * -EMSGSIZE (cap too small). */
long peer_announce_encode(const peer_announce *a, uint8_t *buf, size_t cap);

/* Decodes an untrusted value. Returns 0, or -EBADMSG for anything malformed
 * (out is then zeroed). Throughput and load are clamped to sane ranges. */
int peer_announce_decode(peer_announce *out, const uint8_t *buf, size_t len);

/* The models index's record (PEER_MODELS_KEY): encoded and decoded like
 * an announcement, with the same results and checks. */
long peer_model_record_encode(const peer_model_record *m, uint8_t *buf, size_t cap);
int peer_model_record_decode(peer_model_record *out, const uint8_t *buf, size_t len);

typedef struct peer_keep_record {
    char addr[65];
    uint64_t weight_version;
    uint64_t time_ms;
} peer_keep_record;

/* The cold-copy key of a block (see above). */
void peer_keep_key(uint8_t key[20], const char *block, uint64_t stage_hash);
long peer_keep_record_encode(const peer_keep_record *m, uint8_t *buf, size_t cap);
/* Decodes an untrusted value: 0 or -EBADMSG (out zeroed). */
int peer_keep_record_decode(peer_keep_record *out, const uint8_t *buf, size_t len);

/* "joining" / "online" / "offline" / "unknown". */
const char *peer_state_name(int state);

/* ---- The records' frame, shared inside peer/ (peer/averaging.c) ---- */

struct dht_mp_reader;

/* 1 when s is at most max bytes and holds no control character. */
int peer__printable(const char *s, size_t max);

/* One field of a record: reads the value of `key` into out and sets its
 * bit in *have when the field is required. Returns 0, 1 for a key it does
 * not know (the caller skips its value), or -1 for a bad value. */
typedef int (*peer__record_field_fn)(struct dht_mp_reader *r, const char *key, void *out, int *have);

/* Decodes an untrusted record value into out (size bytes, cleared first
 * and again on failure): a msgpack map within PEER_ANNOUNCE_MAX_BYTES whose
 * "v" is PEER_ANNOUNCE_VERSION (bit 1 of have) and whose other keys go to
 * field; good when the bits set equal want. Returns 0, -EBADMSG or
 * -EINVAL (out NULL). */
int peer__record_decode_into(void *out, size_t size, const uint8_t *buf, size_t len, peer__record_field_fn field,
                             int want);

#endif
