/* dht/wire.h: the DHT's msgpack messages (see docs/protocol.md).
 *
 * Every datagram is one msgpack map, optionally followed by a 16-byte swarm
 * tag (keyed BLAKE2b-128 of the map under the swarm's pre-shared key). The
 * encoder writes into a caller buffer and never allocates; the decoder reads
 * bytes as hostile: it never allocates, bounds every length and count, checks
 * every type, ignores unknown keys (after skipping them with a depth limit),
 * and rejects trailing bytes. Decoded pointers (entry subkeys and values)
 * borrow from the input buffer and are valid while it is.
 * All functions are pure and thread-safe.
 */
#ifndef DHT_WIRE_H
#define DHT_WIRE_H

#include <stddef.h>
#include <stdint.h>

#include "dht/addr.h"
#include "dht/id.h"

#define DHT_WIRE_VERSION 1
#define DHT_MAX_DATAGRAM 1199   /* every datagram is < 1200 bytes, tag included */
#define DHT_TAG_LEN 16          /* swarm tag */
#define DHT_NONCE_LEN 16        /* identity-proof nonce in requests */
#define DHT_TOKEN_LEN 8         /* write token */
#define DHT_MAX_SUBKEY 32       /* bytes */
#define DHT_MAX_VALUE 768       /* bytes: a store with pk, sig and tag still fits */
#define DHT_WIRE_MAX_NODES 20   /* nodes in one reply (k) */
#define DHT_WIRE_MAX_ENTRIES 32 /* record entries in one reply */

enum dht_msg_type {
    DHT_MSG_PING = 1,
    DHT_MSG_FIND_NODE = 2,
    DHT_MSG_GET = 3,
    DHT_MSG_STORE = 4,
    DHT_MSG_REPLY = 0x80, /* a reply's type is the request's type | DHT_MSG_REPLY */
};

/* "Not in this swarm": the untagged notice a node sends back to a request
 * it cannot authenticate under its swarm key (docs/protocol.md). */
#define DHT_MSG_SWARM_REJECT 0xff

/* Store statuses carried in a store reply ("st"). */
enum dht_store_status {
    DHT_ST_OK = 0,        /* stored or refreshed */
    DHT_ST_OLDER = 1,     /* a copy with a later expiration is already held */
    DHT_ST_BAD_TOKEN = 2,
    DHT_ST_INVALID = 3,   /* bad signature, expired, too large, ... */
    DHT_ST_FULL = 4,
};

/* One (subkey -> value, expiration) entry of a record. A signed entry's
 * subkey is the BLAKE2b-160 ID of pk and sig signs it (dht/store.h). */
typedef struct dht_entry {
    const uint8_t *subkey;
    size_t subkey_len;      /* 0..DHT_MAX_SUBKEY */
    const uint8_t *value;
    size_t value_len;       /* 0..DHT_MAX_VALUE */
    uint64_t expires;       /* unix time in milliseconds */
    int is_signed;
    uint8_t pk[32];
    uint8_t sig[64];
} dht_entry;

typedef struct dht_wire_node {
    uint8_t id[DHT_ID_LEN];
    dht_addr addr;
} dht_wire_node;

/* A decoded (or to-be-encoded) message. Fields not used by a type are
 * ignored by the encoder and zero after decoding. */
typedef struct dht_msg {
    uint8_t type;                 /* enum dht_msg_type, | DHT_MSG_REPLY for replies */
    uint32_t tid;                 /* transaction id, echoed by the reply */
    uint8_t id[DHT_ID_LEN];       /* sender's node ID */
    int read_only;                /* request: the sender is a short-lived client;
                                     do not put it in routing tables (BEP 43) */
    int has_nonce;                /* request: please prove your ID by signing this */
    uint8_t nonce[DHT_NONCE_LEN];
    int has_proof;                /* reply: pk and sig over the request's nonce */
    uint8_t pk[32];
    uint8_t sig[64];
    int has_token;                /* reply: write token for the requester's address;
                                     store request: that token */
    uint8_t token[DHT_TOKEN_LEN];
    uint8_t target[DHT_ID_LEN];   /* find_node target, get/store key */
    uint32_t offset;              /* get: first entry wanted (paging) */
    int has_next;                 /* get reply: more entries from next_offset */
    uint32_t next_offset;
    int status;                   /* store reply: enum dht_store_status */
    size_t n_nodes;               /* find_node / get reply */
    dht_wire_node nodes[DHT_WIRE_MAX_NODES];
    size_t n_entries;             /* get reply (0..32), store request (exactly 1) */
    dht_entry entries[DHT_WIRE_MAX_ENTRIES];
} dht_msg;

/* Encodes m into buf[0..cap). Returns the length, -EMSGSIZE if it does not
 * fit in min(cap, DHT_MAX_DATAGRAM - DHT_TAG_LEN), or -EINVAL for a message
 * that breaks the limits above. */
int dht_wire_encode(const dht_msg *m, uint8_t *buf, size_t cap);

/* Decodes a datagram body (without tag). Returns 0, or -EBADMSG for anything
 * malformed (m is then unspecified). Never reads outside buf[0..len). */
int dht_wire_decode(dht_msg *m, const uint8_t *buf, size_t len);

/* The "not in this swarm" notice {v: 1, t: 0xff, x: tid}: encode returns
 * its length or -EMSGSIZE; decode returns 0 with the request's transaction
 * ID in *tid_out, or -EBADMSG for anything else (unknown keys are skipped,
 * trailing bytes are not). Never reads outside buf[0..len). */
int dht_wire_encode_reject(uint32_t tid, uint8_t *buf, size_t cap);
int dht_wire_decode_reject(const uint8_t *buf, size_t len, uint32_t *tid_out);

/* tag = BLAKE2b-128 keyed by swarm_key over body[0..len). */
void dht_wire_tag(uint8_t tag[DHT_TAG_LEN], const uint8_t swarm_key[32], const uint8_t *body,
                  size_t len);

/* Compact address encoding used in node lists: 4+2 or 16+2 bytes, port
 * big-endian. Returns bytes written (6 or 18) or -EINVAL; parse returns 0 or
 * -EBADMSG (wrong length, port 0). */
int dht_wire_addr_pack(uint8_t out[18], const dht_addr *a);
int dht_wire_addr_unpack(dht_addr *out, const uint8_t *b, size_t len);

#endif
