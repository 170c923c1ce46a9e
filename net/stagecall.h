/* net/stagecall.h: the stage-call codec: a forward, backward or infer
 * request to a stage holder, and the rows of its reply.
 *
 * Every client of the compute methods builds and reads its messages here:
 * the trainer (routing/trainer.c), `starling infer` and `starling generate`
 * (routing/infer.c) and libstarling (capi/stages.c). A request carries the
 * inputs (rows x the stage's input row shape), for a backward also the
 * gradient of the outputs, and its meta (net/meta.h): the weight version a
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
 */
#ifndef NET_STAGECALL_H
#define NET_STAGECALL_H

#include <stddef.h>
#include <stdint.h>

#include "net/meta.h"
#include "net/wire.h"

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
