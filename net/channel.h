/* net/channel.h: the authenticated, encrypted byte channel under the tensor RPC.
 *
 * Sans-I/O: the channel never touches a socket. The caller moves bytes; the
 * channel turns handshake messages into replies and frames into records, so
 * the whole thing is testable with two channels and a memcpy. docs/rpc.md has
 * the byte layout.
 *
 * Handshake (three fixed-size messages, initiator = the side that connected):
 *   msg1 I->R  flags, ephemeral X25519 key e_i, swarm tag over msg1
 *   msg2 R->I  flags, e_r, responder ed25519 key, signature over the
 *              transcript, swarm tag over msg1||msg2
 *   msg3 I->R  flags, initiator ed25519 key, signature over the transcript
 * Session keys are BLAKE2b-512, keyed with the swarm key, of the transcript
 * hash and three X25519 products (ee, e_i*s_r, s_i*e_r; the static keys are
 * the ed25519 identities converted to X25519), so a peer that holds neither
 * the identity secret key nor the swarm key cannot derive them. The swarm
 * tag on msg1 lets a responder refuse a stranger before it has spent a
 * signature or served anything.
 *
 * Records after the handshake: u32 little-endian length L, then L bytes =
 * AEAD(plaintext) || 16-byte tag, nonce = per-direction 64-bit counter, the
 * 4 length bytes as associated data. AES-256-GCM when both sides have it in
 * hardware, else ChaCha20-Poly1305 (IETF). Plaintext mode (both sides must
 * ask for it; benchmarks only) keeps the authenticated handshake but sends
 * records without encryption or tag.
 *
 * Thread-safety: a channel is used by one thread at a time. It holds secret
 * material and wipes it on destroy.
 */
#ifndef NET_CHANNEL_H
#define NET_CHANNEL_H

#include <stddef.h>
#include <stdint.h>

#include "dht/identity.h"

#define PEER_CHANNEL_HS1_LEN 72    /* bytes in msg1 */
#define PEER_CHANNEL_HS2_LEN 168   /* bytes in msg2 */
#define PEER_CHANNEL_HS3_LEN 104   /* bytes in msg3 */
#define PEER_CHANNEL_HS_MAX 168    /* the largest handshake message */
#define PEER_CHANNEL_HDR_LEN 4     /* record length prefix */
#define PEER_CHANNEL_TAG_LEN 16    /* AEAD tag at the end of an encrypted record */
#define PEER_CHANNEL_SWARM_KEY_LEN 32

#ifndef PEER_CHANNEL_MAX_RECORD
#define PEER_CHANNEL_MAX_RECORD (256u << 20) /* default largest plaintext per record */
#endif

typedef struct peer_channel peer_channel;

typedef enum peer_cipher {
    PEER_CIPHER_NONE = 0,          /* plaintext mode (benchmarks) */
    PEER_CIPHER_AES256GCM = 1,
    PEER_CIPHER_CHACHA20POLY1305 = 2,
} peer_cipher;

typedef struct peer_channel_config {
    const dht_identity *self;       /* required; copied */
    const uint8_t *expect_id;       /* DHT_ID_LEN bytes, or NULL to accept any peer; copied */
    const uint8_t *swarm_key;       /* PEER_CHANNEL_SWARM_KEY_LEN bytes or NULL; copied */
    size_t max_record;              /* largest plaintext per record; 0 = PEER_CHANNEL_MAX_RECORD */
    int plaintext;                  /* non-zero: no frame encryption (benchmarks only) */
    int no_aes;                     /* non-zero: do not offer AES-256-GCM (tests) */
    int sodium_only;                /* non-zero: libsodium AEAD even if built with OpenSSL
                                       (tests: both backends must agree on the wire) */
} peer_channel_config;

/* Creates a channel for one connection. initiator is non-zero on the side
 * that connected. Returns NULL on bad arguments, no memory or a libsodium
 * failure. */
peer_channel *peer_channel_create(const peer_channel_config *cfg, int initiator);

/* Wipes the keys, frees, sets *p = NULL. Accepts NULL and *p == NULL. */
void peer_channel_destroy(peer_channel **p);

/* Initiator only, once, first: writes msg1 (PEER_CHANNEL_HS1_LEN bytes) into
 * out. Returns the length written, or -EINVAL (responder, or called twice). */
int peer_channel_hello(peer_channel *ch, uint8_t out[PEER_CHANNEL_HS_MAX]);

/* How many bytes the next incoming handshake message has; 0 once the
 * handshake is done or failed. The caller gathers exactly this many bytes and
 * passes them to peer_channel_hs_input. */
size_t peer_channel_hs_expect(const peer_channel *ch);

/* Consumes one whole handshake message (peer_channel_hs_expect bytes) and
 * writes the reply, if any, into out with its length in *out_len (0 if none).
 * Returns 1 when the channel is now established, 0 when more handshake is
 * expected, or an error after which the channel is dead and the connection
 * must be closed:
 *   -EACCES   swarm key mismatch (the peer does not hold our swarm key),
 *   -EPERM    the peer's key hashes to another node ID than expected,
 *   -EPROTO   wrong magic or version, or plaintext mode on one side only,
 *   -EBADMSG  bad signature or unusable key (tampered handshake). */
int peer_channel_hs_input(peer_channel *ch, const uint8_t *msg,
                          uint8_t out[PEER_CHANNEL_HS_MAX], size_t *out_len);

/* Non-zero once the handshake succeeded (and no record failed since). */
int peer_channel_established(const peer_channel *ch);

/* The peer's identity, valid once established: its ed25519 key and node ID. */
const uint8_t *peer_channel_peer_pk(const peer_channel *ch);
const uint8_t *peer_channel_peer_id(const peer_channel *ch);
peer_cipher peer_channel_cipher(const peer_channel *ch);

/* Bytes a record adds after the plaintext: PEER_CHANNEL_TAG_LEN, or 0 in
 * plaintext mode. A record is PEER_CHANNEL_HDR_LEN + plain_len + this. */
size_t peer_channel_tag_len(const peer_channel *ch);

/* Seals a record in place. rec has room for PEER_CHANNEL_HDR_LEN +
 * plain_len + tag_len bytes; the plaintext is at rec + PEER_CHANNEL_HDR_LEN
 * and becomes ciphertext; the length prefix and tag are written. Returns the
 * record length, -EMSGSIZE (plain_len over max_record) or -EINVAL (not
 * established). */
long peer_channel_seal(peer_channel *ch, uint8_t *rec, size_t plain_len);

/* Streaming form of peer_channel_seal, one record at a time: begin writes
 * the length prefix; updates encrypt consecutive plaintext pieces from src
 * into dst, where dst must be exactly where the previous piece ended
 * (rec + PEER_CHANNEL_HDR_LEN first) and src may equal dst or be anywhere
 * else (the caller's tensors, so nothing is copied first); final writes
 * the tag and returns the record length. Bytes before dst + n are final
 * ciphertext once an update returns (with OpenSSL; with libsodium only
 * after final), so they may be written to the socket early only when
 * peer_channel_streams() says so. Errors as peer_channel_seal, and -EINVAL
 * for out-of-order use. */
int peer_channel_seal_begin(peer_channel *ch, uint8_t *rec, size_t plain_len);
int peer_channel_seal_update(peer_channel *ch, uint8_t *dst, const uint8_t *src, size_t n);
long peer_channel_seal_final(peer_channel *ch);

/* Non-zero when seal/open updates do the cipher work incrementally
 * (OpenSSL backend or plaintext mode). */
int peer_channel_streams(const peer_channel *ch);

/* Streaming form of peer_channel_open: begin checks the length prefix of
 * the whole record (rec_len bytes; only the first PEER_CHANNEL_HDR_LEN need
 * be present yet); each update decrypts the next n ciphertext bytes in
 * place, which must have arrived; final decrypts what is left, checks the
 * tag and returns the plaintext as peer_channel_open. Plaintext is not to be
 * used before final succeeds. open_done is how many bytes updates covered. */
int peer_channel_open_begin(peer_channel *ch, uint8_t *rec, size_t rec_len);
int peer_channel_open_update(peer_channel *ch, size_t n);
size_t peer_channel_open_done(const peer_channel *ch);
int peer_channel_open_final(peer_channel *ch, uint8_t **plain, size_t *plain_len);

/* Reads a record's length prefix: *rec_len = the whole record's length
 * (prefix included). Returns 0, -EMSGSIZE (over max_record) or -EBADMSG
 * (too short to hold a tag). The bytes are hostile. */
int peer_channel_record_len(const peer_channel *ch, const uint8_t hdr[PEER_CHANNEL_HDR_LEN],
                            size_t *rec_len);

/* Opens a whole record in place; *plain points into rec, *plain_len bytes.
 * Returns 0, or -EBADMSG (forged, replayed, reordered or corrupt; the
 * channel is then dead) or -EINVAL (not established). */
int peer_channel_open(peer_channel *ch, uint8_t *rec, size_t rec_len,
                      uint8_t **plain, size_t *plain_len);

/* For tests: when built with OpenSSL (which then does the record AEAD),
 * checks that OpenSSL and libsodium produce and accept the same records in
 * both directions for both ciphers. Returns 0, -EIO on a mismatch, or
 * -ENOSYS in a build without OpenSSL (libsodium does everything). */
int peer__channel_selftest(void);

#endif
