/* dht/mp.h: msgpack helpers for every layer that speaks it on the wire.
 *
 * Writing goes through msgpack-c's packer (msgpack_pack_*) into a fixed,
 * caller-owned buffer: no allocation, and an overflow is reported instead of
 * growing. Reading is a bounded pull parser over untrusted bytes. msgpack-c's
 * own unpacker is not used for untrusted input because it allocates storage
 * for a container's DECLARED element count before reading the elements, so a
 * 5-byte header can demand gigabytes; here a container is walked element by
 * element, so a huge declared count simply runs out of bytes, and nesting is
 * bounded. Readers return 0 or -1 (malformed); callers map -1 to -EBADMSG.
 * Decoded pointers borrow the input buffer. Thread-safe (no shared state).
 */
#ifndef DHT_MP_H
#define DHT_MP_H

#include <stddef.h>
#include <stdint.h>

#include <msgpack.h>

#define DHT_MP_MAX_DEPTH 8

/* ---- writing ---- */

typedef struct dht_mp_writer {
    uint8_t *buf;
    size_t cap, len;
    int overflow;
    msgpack_packer pk;     /* pass &w->pk to msgpack_pack_* */
} dht_mp_writer;

/* Starts writing into buf[0..cap). */
void dht_mp_writer_init(dht_mp_writer *w, void *buf, size_t cap);
/* The encoded length, or -EMSGSIZE if anything did not fit. */
long dht_mp_writer_finish(const dht_mp_writer *w);
/* Packs a str from a NUL-terminated C string. */
int dht_mp_pack_cstr(msgpack_packer *pk, const char *s);

/* ---- reading ---- */

typedef struct dht_mp_reader {
    const uint8_t *p, *end;
} dht_mp_reader;

/* Starts a reader on len bytes at buf (borrowed while it reads). */
void dht_mp_reader_init(dht_mp_reader *r, const void *buf, size_t len);

/* Reads any value's header. kind: 'u' uint, 'i' negative int, 's' str,
 * 'b' bin, 'm' map, 'a' array, 'n' nil, 't' bool, 'f' float, 'e' ext. For
 * s/b/e, *val is the payload length (not consumed yet: take or skip it); for
 * m/a, the element count; for u/i/t the value (i: raw bits); for f nothing. */
int dht_mp_head(dht_mp_reader *r, char *kind, uint64_t *val);
/* Skips one whole value found at nesting depth `depth` (the caller's);
 * values nested deeper than DHT_MP_MAX_DEPTH are malformed. */
int dht_mp_skip(dht_mp_reader *r, int depth);
/* Takes n raw bytes. */
int dht_mp_take(dht_mp_reader *r, uint64_t n, const uint8_t **out);
/* A non-negative integer. */
int dht_mp_uint(dht_mp_reader *r, uint64_t *out);
/* A float32/float64 (or an integer), as a finite double. */
int dht_mp_double(dht_mp_reader *r, double *out);
/* A bin of at most max bytes. */
int dht_mp_bin(dht_mp_reader *r, const uint8_t **d, size_t *len, size_t max);
/* A str of at most max bytes, copied NUL-terminated into out (cap > max);
 * rejects embedded NULs and control characters. */
int dht_mp_cstr(dht_mp_reader *r, char *out, size_t cap, size_t max);
/* A map key (str). A key too long for cap becomes "" (unknown, skippable). */
int dht_mp_key(dht_mp_reader *r, char *key, size_t cap);
/* A map ('m') or array ('a') header with its count. */
int dht_mp_container(dht_mp_reader *r, char want, uint64_t *n);
/* 1 when every byte has been read. */
int dht_mp_at_end(const dht_mp_reader *r);

#endif
