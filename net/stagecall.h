/* net/stagecall.h: the stage-call protocol, both sides: a forward, backward
 * or infer request to a stage holder, the rows of its reply, and the meta
 * bytes of both.
 *
 * The call engine (routing/caller.c) builds and reads every client's
 * messages here (the trainer's, `starling infer`'s and `starling
 * generate`'s, libstarling's); the holder (peer/service.c) reads requests'
 * meta and writes replies' with the peer_meta_* functions. A request carries the
 * inputs (rows x the stage's input row shape), for a backward also the
 * gradient of the outputs, and its meta (below): the weight version a
 * backward's forward ran at, or an infer's span. A reply carries one tensor,
 * the outputs (forward, infer) or the gradient of the inputs (backward), in
 * any tensor format, and one weight version per stage served.
 *
 * Formats (net/tensorfmt.h): the request names one for its tensors and the
 * reply. Inputs are rounded to nearest (a backward's inputs then equal its
 * forward's, byte for byte), gradients stochastically (unbiased); token
 * inputs can be kept f32, since f16 or q8 would turn large token values into
 * their neighbours. Pure: no I/O; encoded tensors live in the caller's
 * scratch, the message borrows the caller's floats and buffers.
 *
 * The meta bytes. A tensor RPC message carries an opaque meta blob (net/wire.h). For the
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
#ifndef NET_STAGECALL_H
#define NET_STAGECALL_H

#include <stddef.h>
#include <stdint.h>

#include "net/wire.h"

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

/* ---- the stage call ---- */

/* One stage call to encode. Fields not named for a method are ignored. */
typedef struct peer_stagecall {
    uint64_t rows;               /* rows in the batch, >= 1 */
    const float *x;              /* inputs: rows x rin[0..nin) */
    int nin;
    const uint64_t *rin;
    const float *dy;             /* backward (NULL: a forward or infer): the */
    int nout;                    /* gradient of the outputs, rows x rout[0..nout) */
    const uint64_t *rout;
    peer_dtype fmt;              /* the tensors' and the reply's format */
    int block;                   /* q8's block, else 0 */
    int exact_inputs;            /* inputs stay f32 whatever fmt is (tokens) */
    uint64_t sr_seed;            /* the gradient's stochastic-rounding seed */
    int at_version_known;        /* backward: name the forward's version */
    uint64_t at_version;
    int span;                    /* infer: consecutive stages to run (<= 1: one) */
    uint8_t *scratch;            /* room for the tensors when fmt is not f32: */
    size_t scratch_cap;          /* half for the inputs, half for the gradient */
} peer_stagecall;

/* Fills request m (initialised by peer_msg_init with its method) from c:
 * its tensors, its reply format and its meta, written into meta_buf.
 * Returns 0, or -EINVAL, -EOVERFLOW or -ENOBUFS from encoding the tensors
 * (peer_tensor_rows_as). */
int peer_stagecall_encode(peer_msg *m, uint8_t meta_buf[PEER_META_U64_LEN], const peer_stagecall *c);

/* Reads a reply's rows: it must hold exactly one tensor of shape
 * (rows, row[0], .., row[nrow-1]) in any format, decoded into out (cap
 * floats; NULL: only checked). Returns 0 or -EBADMSG. The reply's weight
 * versions are read with peer_meta_versions_decode. */
int peer_stagecall_reply_rows(const peer_msg *m, int nrow, const uint64_t *row, uint64_t rows, float *out,
                              size_t cap);

#endif
