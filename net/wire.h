/* net/wire.h: tensor RPC messages (the plaintext inside one channel record).
 *
 * A message is
 *     u32 LE  hlen            length of the msgpack header
 *     hlen    header          msgpack map with small integer keys (below)
 *     pad     0..3 zero bytes so the tensor bytes start at a multiple of 4
 *     data    tensor after tensor, each in its format (net/tensorfmt.h: f32,
 *             f16, bf16 or blockwise q8, C order) and followed by 0..3 zero
 *             bytes so the next starts at a multiple of 4 (f32 needs none)
 * Tensor bytes never pass through msgpack. Header keys (unknown keys are
 * skipped, so later versions can add fields):
 *     0 kind (uint: 0 request, 1 reply, 2 error)   1 method (uint)
 *     2 id (uint64)   3 block (str)
 *     4 tensors: array of [dtype, [dims...]], or [3, [dims...], block] for q8
 *     5 error code (int)   6 error message (str)   7 meta (bin, opaque)
 *     8 reply format (requests): [dtype] or [3, block]: the format the
 *       client wants the reply's tensors in (absent: f32)
 * docs/rpc.md is the byte-level reference.
 *
 * The decoder treats its input as hostile: every length is bounded, every
 * type checked, and it returns -EBADMSG or -EMSGSIZE, never asserts. It does
 * not allocate: a decoded message borrows the input bytes.
 * All functions are thread-safe (no shared state).
 */
#ifndef NET_WIRE_H
#define NET_WIRE_H

#include <stddef.h>
#include <stdint.h>

#define PEER_WIRE_MAX_DIMS 8        /* compile-time caps; runtime limits may be lower */
#define PEER_WIRE_MAX_TENSORS 16
#define PEER_WIRE_MAX_BLOCK 128     /* bytes in a block name, without the NUL */
#define PEER_WIRE_MAX_ERRMSG 256    /* bytes in an error message, without the NUL */
#define PEER_WIRE_MAX_META 65536    /* bytes of opaque meta (e.g. an info reply) */

typedef enum peer_kind { PEER_KIND_REQUEST = 0, PEER_KIND_REPLY = 1, PEER_KIND_ERROR = 2 } peer_kind;
typedef enum peer_method {
    PEER_METHOD_INFO = 1,       /* no tensors; the reply carries meta */
    PEER_METHOD_FORWARD = 2,    /* inputs -> outputs */
    PEER_METHOD_BACKWARD = 3,   /* inputs, grad_outputs -> grad_inputs */
    PEER_METHOD_INFER = 4,      /* inputs -> outputs, like forward, served ahead of training */
    PEER_METHOD_STATE = 5,      /* a chunk of a block's serialized state (newcomer download) */
    PEER_METHOD_AVG = 6,        /* a slice of a group-averaging round (peer/allreduce.h) */
} peer_method;
/* A tensor's format on the wire: the values of peer_fmt (net/tensorfmt.h). */
typedef enum peer_dtype {
    PEER_DTYPE_F32 = 0,
    PEER_DTYPE_F16 = 1,
    PEER_DTYPE_BF16 = 2,
    PEER_DTYPE_Q8 = 3,
} peer_dtype;

/* Error codes carried by PEER_KIND_ERROR replies: positive errno values, so
 * both ends can strerror() them (EINVAL wrong shape or arguments, ENOENT
 * block not hosted, ENOSYS unknown method, EMSGSIZE too large, EBADMSG
 * malformed, EBUSY overloaded, EIO compute failed). */

typedef struct peer_tensor {
    peer_dtype dtype;
    int block;                         /* q8's block length; 0 for the other formats */
    int ndim;                          /* 0..PEER_WIRE_MAX_DIMS */
    uint64_t shape[PEER_WIRE_MAX_DIMS];
    const void *data;                  /* borrowed; nbytes bytes, 4-byte aligned when decoded */
    size_t nbytes;                     /* = peer_tensorfmt_size(dtype, block, prod(shape))
                                          (4 * prod(shape) for f32); set by the decoder,
                                          and by peer_tensor_f32/_encoded for the encoder */
} peer_tensor;

typedef struct peer_msg {
    peer_kind kind;
    peer_method method;
    uint64_t id;                       /* request id, echoed in the reply */
    char block[PEER_WIRE_MAX_BLOCK + 1];
    int32_t err_code;                  /* PEER_KIND_ERROR: positive errno */
    char err_msg[PEER_WIRE_MAX_ERRMSG + 1];
    const void *meta;                  /* borrowed opaque bytes, or NULL */
    size_t meta_len;
    int n_tensors;
    peer_tensor t[PEER_WIRE_MAX_TENSORS];
    peer_dtype reply_dtype;            /* requests: the reply's tensor format (key 8) */
    int reply_block;                   /* its q8 block; 0 otherwise */
} peer_msg;

typedef struct peer_wire_limits {
    size_t max_frame;                  /* largest message; 0 = 256 MiB */
    int max_dims;                      /* 0 = PEER_WIRE_MAX_DIMS */
    int max_tensors;                   /* 0 = PEER_WIRE_MAX_TENSORS */
} peer_wire_limits;

/* Zero bytes that follow n bytes so the next part starts at a multiple of
 * 4 (after the header, and after each tensor's bytes). */
static inline size_t peer_wire_pad4(size_t n)
{
    return (4 - (n & 3)) & 3;
}

/* Little-endian u64 fields of meta blobs (weight versions, offsets). */
static inline uint64_t peer_get_le64(const void *p)
{
    const uint8_t *b = p;
    uint64_t v = 0;
    for (int i = 0; i < 8; i++)
        v |= (uint64_t)b[i] << (8 * i);
    return v;
}

static inline void peer_put_le64(void *p, uint64_t v)
{
    uint8_t *b = p;
    for (int i = 0; i < 8; i++)
        b[i] = (uint8_t)(v >> (8 * i));
}

/* Fills t as an f32 tensor of the given shape over data (borrowed).
 * Returns 0, or -EINVAL (too many dims) or -EOVERFLOW (size overflows). */
int peer_tensor_f32(peer_tensor *t, const float *data, int ndim, const uint64_t *shape);

/* Fills t as a tensor of the given shape whose data (borrowed) is already
 * encoded in format dtype (block: q8's block length, else 0). Returns 0,
 * -EINVAL (bad format, block or dims) or -EOVERFLOW. */
int peer_tensor_encoded(peer_tensor *t, peer_dtype dtype, int block, const void *data, int ndim,
                        const uint64_t *shape);

/* The number of values in t (the product of its shape). */
uint64_t peer_tensor_count(const peer_tensor *t);

/* Decodes t's data, in whatever format it came, into dst (cap floats, at
 * least peer_tensor_count(t)). Returns 0, -ENOBUFS (cap too small) or
 * -EBADMSG (a payload its format refuses, e.g. a negative q8 scale; dst is
 * then unchanged). The decoder has checked the byte count already. */
int peer_tensor_to_f32(const peer_tensor *t, float *dst, size_t cap);

/* A batch of rows: t = f32 data of shape (rows, row[0], .., row[nrow-1]),
 * 1 <= nrow < PEER_WIRE_MAX_DIMS. Returns peer_tensor_f32's result. */
int peer_tensor_rows(peer_tensor *t, const float *data, uint64_t rows, int nrow, const uint64_t *row);
/* peer_tensor_rows in format dtype (block: q8's, else 0): data is encoded
 * into scratch (cap bytes), rounded to nearest, or stochastically with
 * sr_seed when sr is set (gradients: peer_tensorfmt_encode_sr). For f32,
 * t borrows data and scratch is unused. Returns 0, -EINVAL, -EOVERFLOW or
 * -ENOBUFS (scratch too small). */
int peer_tensor_rows_as(peer_tensor *t, const float *data, uint64_t rows, int nrow, const uint64_t *row,
                        peer_dtype dtype, int block, int sr, uint64_t sr_seed, void *scratch, size_t cap);

/* Whether t has shape (B, row[0], .., row[nrow-1]) with 1 <= B <=
 * max_rows, in any format (read it with peer_tensor_to_f32 unless its dtype
 * is f32); then *rows_out = B. Returns 1 or 0. */
int peer_tensor_is_rows(const peer_tensor *t, int nrow, const uint64_t *row, uint64_t max_rows,
                        uint64_t *rows_out);

/* Clears m and sets kind, method and id (block empty, no tensors). */
void peer_msg_init(peer_msg *m, peer_kind kind, peer_method method, uint64_t id);

/* Exact encoded length of m in bytes, or a negative errno (-EINVAL for a
 * malformed message: bad counts, a tensor whose nbytes does not match its
 * shape, names too long). */
long peer_wire_size(const peer_msg *m);

/* Encodes m into out (cap bytes). Returns the length, -ENOBUFS if cap is
 * too small, or -EINVAL as peer_wire_size. */
long peer_wire_encode(const peer_msg *m, uint8_t *out, size_t cap);

/* Writes only the part before the tensor bytes (hlen, header, padding) and
 * returns its length; *data_len (if not NULL) receives the byte count of
 * the tensor data that must follow (tensor after tensor). For senders that
 * move the tensor bytes themselves (encrypting them straight from the
 * caller's memory). Errors as peer_wire_encode. */
long peer_wire_encode_head(const peer_msg *m, uint8_t *out, size_t cap, size_t *data_len);

/* Decodes len bytes at p into out; out's tensors and meta point into p
 * (p must stay alive and unchanged while out is used). lim may be NULL
 * for the defaults. Returns 0, -EMSGSIZE (over a limit) or -EBADMSG
 * (anything malformed). On failure out is unspecified. */
int peer_wire_decode(const uint8_t *p, size_t len, const peer_wire_limits *lim, peer_msg *out);

#endif
