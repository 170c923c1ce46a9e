/* net/meta.h: the meta bytes of the compute methods (forward, backward,
 * infer), encoded and decoded in one place.
 *
 * A tensor RPC message carries an opaque meta blob (net/wire.h). For the
 * compute methods it holds little-endian u64 values (docs/protocol.md):
 *
 *   request                          reply
 *   forward   none                   one weight version per stage served
 *   backward  none, or the weight    one weight version per stage served
 *             version its forward
 *             ran at (8 bytes)
 *   infer     none (span 1), or the  one weight version per stage served
 *             span: consecutive        (1..span, in stage order)
 *             stages to run (8 bytes)
 *
 * The encoders write into a caller-owned buffer and return the bytes
 * written (the message's meta_len); 0 means "send no meta". The decoders
 * treat the bytes as hostile: they check the length and range and return
 * -EINVAL for malformed meta, never reading past len. Pure functions, any
 * thread.
 */
#ifndef NET_META_H
#define NET_META_H

#include <stddef.h>
#include <stdint.h>

#define PEER_META_U64_LEN 8   /* bytes of one u64le field */

/* ---- replies: weight versions, one per stage served ---- */

/* Writes n versions v[0..n) as u64le into buf (cap bytes). Returns 8*n, or
 * 0 when n < 0 or buf is too small (nothing written then). */
size_t peer_meta_versions_encode(uint8_t *buf, size_t cap, const uint64_t *v, int n);

/* Reads the versions of a reply's meta (len bytes) into v[0..max). Returns
 * their count (0 for no meta), or -EINVAL when len is not a multiple of 8 or
 * holds more than max versions (v is then untouched). meta may be NULL when
 * len is 0. */
int peer_meta_versions_decode(const void *meta, size_t len, uint64_t *v, int max);

/* ---- backward request: the weight version its forward ran at ---- */

/* Writes version into buf (8 bytes). Returns PEER_META_U64_LEN. */
size_t peer_meta_at_version_encode(uint8_t buf[PEER_META_U64_LEN], uint64_t version);

/* Returns 1 and sets *version_out when meta names a version, 0 when there
 * is no meta (the holder uses its current weights), -EINVAL when len is
 * neither 0 nor 8. */
int peer_meta_at_version_decode(const void *meta, size_t len, uint64_t *version_out);

/* ---- infer request: the span ---- */

/* Writes span into buf (8 bytes) and returns PEER_META_U64_LEN; returns 0
 * (send no meta) for a span of 1 or less, which every peer, including those
 * that predate spans, reads as one stage. */
size_t peer_meta_span_encode(uint8_t buf[PEER_META_U64_LEN], int span);

/* Sets *span_out to the span an infer request asks for: 1 when there is no
 * meta, else its u64le value. Returns 0, or -EINVAL when len is neither 0
 * nor 8 or the value is outside 1..max (*span_out untouched then). */
int peer_meta_span_decode(const void *meta, size_t len, int max, int *span_out);

#endif
