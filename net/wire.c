/* net/wire.c: tensor RPC message codec (see wire.h, docs/rpc.md).
 *
 * Encoding uses msgpack-c's packer writing into the caller's buffer. Decoding
 * is a small hand-written msgpack reader for the subset the header uses: it
 * allocates nothing (msgpack-c's unpacker allocates a zone per message) and
 * bounds every length before it looks at the bytes. */
#include <errno.h>
#include <limits.h>
#include <string.h>

#include <msgpack.h>

#include "net/tensorfmt.h"
#include "net/wire.h"

#define DEFAULT_MAX_FRAME (256u << 20)
#define MAX_SKIP_DEPTH 8

enum { K_KIND = 0, K_METHOD = 1, K_ID = 2, K_BLOCK = 3, K_TENSORS = 4, K_CODE = 5, K_MSG = 6,
       K_META = 7, K_RFMT = 8 };

_Static_assert((int)PEER_DTYPE_F16 == (int)PEER_FMT_F16 && (int)PEER_DTYPE_BF16 == (int)PEER_FMT_BF16 &&
                   (int)PEER_DTYPE_Q8 == (int)PEER_FMT_Q8 && PEER_FMT_COUNT == 4,
               "wire dtypes are the tensor formats");

/* 0 if (dtype, block) names a format with a valid block (0 unless q8). */
static int check_fmt(uint64_t dtype, int64_t block)
{
    if (dtype >= PEER_FMT_COUNT)
        return -EINVAL;
    if (dtype != PEER_DTYPE_Q8)
        return block == 0 ? 0 : -EINVAL;
    return block > 0 && block <= PEER_FMT_Q8_BLOCK_MAX && peer_tensorfmt_check(PEER_FMT_Q8, (int)block) == 0
               ? 0
               : -EINVAL;
}

/* Encoded bytes of n values (n already bounded so 4n fits a size_t; 0
 * values take 0 bytes). */
static size_t fmt_bytes(peer_dtype dtype, int block, uint64_t n)
{
    return peer_tensorfmt_size((peer_fmt)dtype, block, (size_t)n);
}

int peer_tensor_rows(peer_tensor *t, const float *data, uint64_t rows, int nrow, const uint64_t *row)
{
    if (nrow < 1 || nrow >= PEER_WIRE_MAX_DIMS || !row)
        return -EINVAL;
    uint64_t shape[PEER_WIRE_MAX_DIMS];
    shape[0] = rows;
    memcpy(shape + 1, row, (size_t)nrow * sizeof *row);
    return peer_tensor_f32(t, data, nrow + 1, shape);
}

int peer_tensor_rows_as(peer_tensor *t, const float *data, uint64_t rows, int nrow, const uint64_t *row,
                        peer_dtype dtype, int block, int sr, uint64_t sr_seed, void *scratch, size_t cap)
{
    int rc = peer_tensor_rows(t, data, rows, nrow, row);
    if (rc || dtype == PEER_DTYPE_F32)
        return rc;
    if (check_fmt(dtype, block))
        return -EINVAL;
    size_t n = (size_t)peer_tensor_count(t);
    long k = sr ? peer_tensorfmt_encode_sr((peer_fmt)dtype, block, data, n, sr_seed, scratch, cap)
                : peer_tensorfmt_encode((peer_fmt)dtype, block, data, n, scratch, cap);
    if (k < 0)
        return (int)k;
    uint64_t shape[PEER_WIRE_MAX_DIMS];
    memcpy(shape, t->shape, sizeof shape);
    return peer_tensor_encoded(t, dtype, block, scratch, t->ndim, shape);
}

int peer_tensor_is_rows(const peer_tensor *t, int nrow, const uint64_t *row, uint64_t max_rows,
                        uint64_t *rows_out)
{
    if (!t || !row || t->ndim != nrow + 1 || t->shape[0] < 1 ||
        t->shape[0] > max_rows)
        return 0;
    for (int i = 0; i < nrow; i++)
        if (t->shape[i + 1] != row[i])
            return 0;
    if (rows_out)
        *rows_out = t->shape[0];
    return 1;
}

int peer_tensor_f32(peer_tensor *t, const float *data, int ndim, const uint64_t *shape)
{
    return peer_tensor_encoded(t, PEER_DTYPE_F32, 0, data, ndim, shape);
}

uint64_t peer_tensor_count(const peer_tensor *t)
{
    uint64_t n = 1;
    for (int i = 0; t && i < t->ndim; i++)
        n *= t->shape[i];
    return t ? n : 0;
}

int peer_tensor_to_f32(const peer_tensor *t, float *dst, size_t cap)
{
    uint64_t n = peer_tensor_count(t);
    if (!t || n > cap)
        return -ENOBUFS;
    if (t->dtype == PEER_DTYPE_F32) {
        if (t->nbytes != n * 4)
            return -EBADMSG;
        if (n)
            memcpy(dst, t->data, t->nbytes);
        return 0;
    }
    if (n == 0)
        return t->nbytes == 0 ? 0 : -EBADMSG;
    int rc = peer_tensorfmt_decode((peer_fmt)t->dtype, t->block, t->data, t->nbytes, (size_t)n, dst);
    return rc == -EINVAL ? -EBADMSG : rc;
}

int peer_tensor_encoded(peer_tensor *t, peer_dtype dtype, int block, const void *data, int ndim,
                        const uint64_t *shape)
{
    if (!t || ndim < 0 || ndim > PEER_WIRE_MAX_DIMS || (ndim && !shape) || check_fmt(dtype, block))
        return -EINVAL;
    uint64_t n = 1;
    for (int i = 0; i < ndim; i++) {
        if (shape[i] && n > (UINT64_MAX / 4) / shape[i])
            return -EOVERFLOW;
        n *= shape[i];
    }
    if (n > SIZE_MAX / 4)
        return -EOVERFLOW;
    memset(t, 0, sizeof *t);
    t->dtype = dtype;
    t->block = block;
    t->ndim = ndim;
    for (int i = 0; i < ndim; i++)
        t->shape[i] = shape[i];
    t->data = data;
    t->nbytes = fmt_bytes(dtype, block, n);
    return 0;
}

void peer_msg_init(peer_msg *m, peer_kind kind, peer_method method, uint64_t id)
{
    memset(m, 0, sizeof *m);
    m->kind = kind;
    m->method = method;
    m->id = id;
}

/* ---- encoder ---- */

typedef struct wbuf {
    uint8_t *p;      /* NULL: only count */
    size_t cap, len;
    int overflow;
} wbuf;

static int wbuf_write(void *data, const char *buf, size_t len)
{
    wbuf *w = data;
    if (w->p) {
        if (len > w->cap - w->len) {
            w->overflow = 1;
            return -1;
        }
        memcpy(w->p + w->len, buf, len);
    }
    w->len += len;
    return 0;
}

/* Checks m and returns the byte count of its tensor data, or -EINVAL. */
static long check_msg(const peer_msg *m, size_t *data_len)
{
    if (!m || m->n_tensors < 0 || m->n_tensors > PEER_WIRE_MAX_TENSORS ||
        strnlen(m->block, sizeof m->block) > PEER_WIRE_MAX_BLOCK ||
        strnlen(m->err_msg, sizeof m->err_msg) > PEER_WIRE_MAX_ERRMSG ||
        m->meta_len > PEER_WIRE_MAX_META || (m->meta_len && !m->meta) ||
        check_fmt(m->reply_dtype, m->reply_block))
        return -EINVAL;
    size_t total = 0;
    for (int i = 0; i < m->n_tensors; i++) {
        const peer_tensor *t = &m->t[i];
        if (check_fmt(t->dtype, t->block) || t->ndim < 0 || t->ndim > PEER_WIRE_MAX_DIMS)
            return -EINVAL;
        uint64_t n = 1;
        for (int d = 0; d < t->ndim; d++) {
            if (t->shape[d] && n > (UINT64_MAX / 4) / t->shape[d])
                return -EINVAL;
            n *= t->shape[d];
        }
        if (n > SIZE_MAX / 4 || fmt_bytes(t->dtype, t->block, n) != t->nbytes || (t->nbytes && !t->data) ||
            t->nbytes + 3 > SIZE_MAX - total)
            return -EINVAL;
        total += t->nbytes + peer_wire_pad4(t->nbytes);
    }
    *data_len = total;
    return 0;
}

static void pack_header(msgpack_packer *pk, const peer_msg *m)
{
    size_t blen = strlen(m->block), elen = strlen(m->err_msg);
    int rfmt = m->kind == PEER_KIND_REQUEST && m->reply_dtype != PEER_DTYPE_F32;
    int n = 3 + (blen > 0) + (m->n_tensors > 0) + (m->kind == PEER_KIND_ERROR) * 2 +
            (m->meta_len > 0) + rfmt;
    msgpack_pack_map(pk, (size_t)n);
    msgpack_pack_uint8(pk, K_KIND);
    msgpack_pack_uint8(pk, (uint8_t)m->kind);
    msgpack_pack_uint8(pk, K_METHOD);
    msgpack_pack_uint8(pk, (uint8_t)m->method);
    msgpack_pack_uint8(pk, K_ID);
    msgpack_pack_uint64(pk, m->id);
    if (blen) {
        msgpack_pack_uint8(pk, K_BLOCK);
        msgpack_pack_str(pk, blen);
        msgpack_pack_str_body(pk, m->block, blen);
    }
    if (m->n_tensors > 0) {
        msgpack_pack_uint8(pk, K_TENSORS);
        msgpack_pack_array(pk, (size_t)m->n_tensors);
        for (int i = 0; i < m->n_tensors; i++) {
            const peer_tensor *t = &m->t[i];
            msgpack_pack_array(pk, t->dtype == PEER_DTYPE_Q8 ? 3 : 2);
            msgpack_pack_uint8(pk, (uint8_t)t->dtype);
            msgpack_pack_array(pk, (size_t)t->ndim);
            for (int d = 0; d < t->ndim; d++)
                msgpack_pack_uint64(pk, t->shape[d]);
            if (t->dtype == PEER_DTYPE_Q8)
                msgpack_pack_uint32(pk, (uint32_t)t->block);
        }
    }
    if (m->kind == PEER_KIND_ERROR) {
        msgpack_pack_uint8(pk, K_CODE);
        msgpack_pack_int32(pk, m->err_code);
        msgpack_pack_uint8(pk, K_MSG);
        msgpack_pack_str(pk, elen);
        msgpack_pack_str_body(pk, m->err_msg, elen);
    }
    if (m->meta_len) {
        msgpack_pack_uint8(pk, K_META);
        msgpack_pack_bin(pk, m->meta_len);
        msgpack_pack_bin_body(pk, m->meta, m->meta_len);
    }
    if (rfmt) {
        msgpack_pack_uint8(pk, K_RFMT);
        msgpack_pack_array(pk, m->reply_dtype == PEER_DTYPE_Q8 ? 2 : 1);
        msgpack_pack_uint8(pk, (uint8_t)m->reply_dtype);
        if (m->reply_dtype == PEER_DTYPE_Q8)
            msgpack_pack_uint32(pk, (uint32_t)m->reply_block);
    }
}

long peer_wire_size(const peer_msg *m)
{
    size_t data_len;
    long rc = check_msg(m, &data_len);
    if (rc)
        return rc;
    wbuf w = {0};
    msgpack_packer pk;
    msgpack_packer_init(&pk, &w, wbuf_write);
    pack_header(&pk, m);
    size_t n = 4 + w.len;
    n += peer_wire_pad4(n);
    if (data_len > (size_t)LONG_MAX - n)
        return -EINVAL;
    return (long)(n + data_len);
}

long peer_wire_encode_head(const peer_msg *m, uint8_t *out, size_t cap, size_t *data_len)
{
    size_t dl;
    long rc = check_msg(m, &dl);
    if (rc)
        return rc;
    if (!out || cap < 4)
        return -ENOBUFS;
    wbuf w = {.p = out + 4, .cap = cap - 4};
    msgpack_packer pk;
    msgpack_packer_init(&pk, &w, wbuf_write);
    pack_header(&pk, m);
    size_t off = 4 + w.len, pad = peer_wire_pad4(off);
    if (w.overflow || pad > cap - off)
        return -ENOBUFS;
    uint32_t hlen = (uint32_t)w.len;
    out[0] = (uint8_t)hlen; out[1] = (uint8_t)(hlen >> 8);
    out[2] = (uint8_t)(hlen >> 16); out[3] = (uint8_t)(hlen >> 24);
    memset(out + off, 0, pad);
    if (data_len)
        *data_len = dl;
    return (long)(off + pad);
}

long peer_wire_encode(const peer_msg *m, uint8_t *out, size_t cap)
{
    long total = peer_wire_size(m);
    if (total < 0)
        return total;
    if (!out || (size_t)total > cap)
        return -ENOBUFS;
    long head = peer_wire_encode_head(m, out, cap, NULL);
    if (head < 0)
        return head;
    size_t off = (size_t)head;
    for (int i = 0; i < m->n_tensors; i++) {
        size_t nb = m->t[i].nbytes, pad = peer_wire_pad4(nb);
        if (nb)
            memcpy(out + off, m->t[i].data, nb);
        memset(out + off + nb, 0, pad);
        off += nb + pad;
    }
    return (long)off;
}

/* ---- decoder: a bounded msgpack reader ---- */

typedef struct rd {
    const uint8_t *p, *end;
} rd;

static int need(rd *r, size_t n)
{
    return (size_t)(r->end - r->p) >= n ? 0 : -EBADMSG;
}

static uint64_t be(const uint8_t *p, int n)
{
    uint64_t v = 0;
    for (int i = 0; i < n; i++)
        v = v << 8 | p[i];
    return v;
}

static int rd_uint(rd *r, uint64_t *v)
{
    if (need(r, 1))
        return -EBADMSG;
    uint8_t c = *r->p++;
    int n;
    if (c <= 0x7f) { *v = c; return 0; }
    switch (c) {
    case 0xcc: n = 1; break;
    case 0xcd: n = 2; break;
    case 0xce: n = 4; break;
    case 0xcf: n = 8; break;
    default: return -EBADMSG;
    }
    if (need(r, (size_t)n))
        return -EBADMSG;
    *v = be(r->p, n);
    r->p += n;
    return 0;
}

static int rd_int(rd *r, int64_t *v)
{
    if (need(r, 1))
        return -EBADMSG;
    uint8_t c = *r->p;
    if (c >= 0xe0) { r->p++; *v = (int8_t)c; return 0; }
    int n;
    switch (c) {
    case 0xd0: n = 1; break;
    case 0xd1: n = 2; break;
    case 0xd2: n = 4; break;
    case 0xd3: n = 8; break;
    default: {
        uint64_t u;
        if (rd_uint(r, &u) || u > INT64_MAX)
            return -EBADMSG;
        *v = (int64_t)u;
        return 0;
    }
    }
    r->p++;
    if (need(r, (size_t)n))
        return -EBADMSG;
    uint64_t u = be(r->p, n);
    r->p += n;
    if (n == 1) *v = (int8_t)u;
    else if (n == 2) *v = (int16_t)u;
    else if (n == 4) *v = (int32_t)u;
    else *v = (int64_t)u;
    return 0;
}

/* Reads a container or string/bin header of the family given by the fix
 * range (fixlo, fixmask) and the three sized codes c8/c16/c32 (0 = none). */
static int rd_len(rd *r, uint8_t fixlo, uint8_t fixmask, uint8_t c8, uint8_t c16, uint8_t c32,
                  size_t *len)
{
    if (need(r, 1))
        return -EBADMSG;
    uint8_t c = *r->p++;
    int n;
    if ((c & (uint8_t)~fixmask) == fixlo) { *len = c & fixmask; return 0; }
    if (c8 && c == c8) n = 1;
    else if (c == c16) n = 2;
    else if (c == c32) n = 4;
    else return -EBADMSG;
    if (need(r, (size_t)n))
        return -EBADMSG;
    *len = (size_t)be(r->p, n);
    r->p += n;
    return 0;
}

static int rd_map(rd *r, size_t *n) { return rd_len(r, 0x80, 0x0f, 0, 0xde, 0xdf, n); }
static int rd_array(rd *r, size_t *n) { return rd_len(r, 0x90, 0x0f, 0, 0xdc, 0xdd, n); }

static int rd_str(rd *r, const uint8_t **s, size_t *n)
{
    if (rd_len(r, 0xa0, 0x1f, 0xd9, 0xda, 0xdb, n) || need(r, *n))
        return -EBADMSG;
    *s = r->p;
    r->p += *n;
    return 0;
}

static int rd_bin(rd *r, const uint8_t **s, size_t *n)
{
    if (need(r, 1))
        return -EBADMSG;
    uint8_t c = *r->p;
    if (c != 0xc4 && c != 0xc5 && c != 0xc6)
        return -EBADMSG;
    /* 0xc4/0xc5/0xc6 carry 1/2/4 length bytes. */
    r->p++;
    int nb = c == 0xc4 ? 1 : c == 0xc5 ? 2 : 4;
    if (need(r, (size_t)nb))
        return -EBADMSG;
    *n = (size_t)be(r->p, nb);
    r->p += nb;
    if (need(r, *n))
        return -EBADMSG;
    *s = r->p;
    r->p += *n;
    return 0;
}

/* Skips one value of any type (unknown keys), depth-bounded. */
static int rd_skip(rd *r, int depth)
{
    if (depth > MAX_SKIP_DEPTH || need(r, 1))
        return -EBADMSG;
    uint8_t c = *r->p;
    size_t n;
    const uint8_t *s;
    if (c <= 0x7f || c >= 0xe0 || c == 0xc0 || c == 0xc2 || c == 0xc3) { r->p++; return 0; }
    if ((c & 0xe0) == 0xa0 || c == 0xd9 || c == 0xda || c == 0xdb)
        return rd_str(r, &s, &n);
    if (c == 0xc4 || c == 0xc5 || c == 0xc6)
        return rd_bin(r, &s, &n);
    if ((c & 0xf0) == 0x90 || c == 0xdc || c == 0xdd) {
        if (rd_array(r, &n))
            return -EBADMSG;
        /* Each element takes at least a byte, so n is bounded by the input. */
        if (n > (size_t)(r->end - r->p))
            return -EBADMSG;
        for (size_t i = 0; i < n; i++)
            if (rd_skip(r, depth + 1))
                return -EBADMSG;
        return 0;
    }
    if ((c & 0xf0) == 0x80 || c == 0xde || c == 0xdf) {
        if (rd_map(r, &n) || n > (size_t)(r->end - r->p))
            return -EBADMSG;
        for (size_t i = 0; i < 2 * n; i++)
            if (rd_skip(r, depth + 1))
                return -EBADMSG;
        return 0;
    }
    int k;
    switch (c) {
    case 0xcc: case 0xd0: k = 1; break;
    case 0xcd: case 0xd1: k = 2; break;
    case 0xce: case 0xd2: case 0xca: k = 4; break;
    case 0xcf: case 0xd3: case 0xcb: k = 8; break;
    default: return -EBADMSG; /* ext types and reserved codes are not used */
    }
    if (need(r, 1 + (size_t)k))
        return -EBADMSG;
    r->p += 1 + k;
    return 0;
}

static int rd_tensors(rd *r, const peer_wire_limits *lim, peer_msg *out)
{
    size_t n;
    if (rd_array(r, &n))
        return -EBADMSG;
    if (n > (size_t)lim->max_tensors)
        return -EMSGSIZE;
    out->n_tensors = (int)n;
    for (size_t i = 0; i < n; i++) {
        peer_tensor *t = &out->t[i];
        size_t two, nd;
        uint64_t dt;
        if (rd_array(r, &two) || two < 2 || two > 3 || rd_uint(r, &dt) || dt >= PEER_FMT_COUNT ||
            (two == 3) != (dt == PEER_DTYPE_Q8) || rd_array(r, &nd))
            return -EBADMSG;
        if (nd > (size_t)lim->max_dims)
            return -EMSGSIZE;
        t->dtype = (peer_dtype)dt;
        t->ndim = (int)nd;
        uint64_t elems = 1;
        for (size_t d = 0; d < nd; d++) {
            if (rd_uint(r, &t->shape[d]))
                return -EBADMSG;
            /* Bound the product by the frame limit as we go, so it cannot wrap. */
            if (t->shape[d] && elems > (lim->max_frame / 4) / t->shape[d])
                return -EMSGSIZE;
            elems *= t->shape[d];
        }
        if (two == 3) {
            uint64_t blk;
            if (rd_uint(r, &blk) || blk > PEER_FMT_Q8_BLOCK_MAX || check_fmt(dt, (int64_t)blk))
                return -EBADMSG;
            t->block = (int)blk;
        }
        t->nbytes = fmt_bytes(t->dtype, t->block, elems);
    }
    return 0;
}

/* Key 8: [dtype] or [3, block]. */
static int rd_rfmt(rd *r, peer_msg *out)
{
    size_t n;
    uint64_t dt, blk = 0;
    if (rd_array(r, &n) || n < 1 || n > 2 || rd_uint(r, &dt) || dt >= PEER_FMT_COUNT ||
        (n == 2) != (dt == PEER_DTYPE_Q8) || (n == 2 && rd_uint(r, &blk)) || blk > PEER_FMT_Q8_BLOCK_MAX ||
        check_fmt(dt, (int64_t)blk))
        return -EBADMSG;
    out->reply_dtype = (peer_dtype)dt;
    out->reply_block = (int)blk;
    return 0;
}

/* One header field: key's value, read into out. Returns 0, -EBADMSG or
 * -EMSGSIZE. */
static int rd_field(rd *r, uint64_t key, const peer_wire_limits *lim, peer_msg *out)
{
    uint64_t v;
    int64_t sv;
    const uint8_t *s;
    size_t sn;
    switch (key) {
    case K_KIND:
        if (rd_uint(r, &v) || v > PEER_KIND_ERROR)
            return -EBADMSG;
        out->kind = (peer_kind)v;
        return 0;
    case K_METHOD:
        /* Unknown methods decode, so a server can answer ENOSYS. */
        if (rd_uint(r, &v) || v > 255)
            return -EBADMSG;
        out->method = (peer_method)v;
        return 0;
    case K_ID:
        if (rd_uint(r, &out->id))
            return -EBADMSG;
        return 0;
    case K_BLOCK:
        if (rd_str(r, &s, &sn) || sn > PEER_WIRE_MAX_BLOCK || memchr(s, 0, sn))
            return -EBADMSG;
        memcpy(out->block, s, sn);
        out->block[sn] = '\0';
        return 0;
    case K_TENSORS:
        return rd_tensors(r, lim, out);
    case K_CODE:
        if (rd_int(r, &sv) || sv < INT32_MIN || sv > INT32_MAX)
            return -EBADMSG;
        out->err_code = (int32_t)sv;
        return 0;
    case K_MSG:
        if (rd_str(r, &s, &sn) || memchr(s, 0, sn))
            return -EBADMSG;
        /* A long message is cut, not refused: it is for humans. */
        if (sn > PEER_WIRE_MAX_ERRMSG)
            sn = PEER_WIRE_MAX_ERRMSG;
        memcpy(out->err_msg, s, sn);
        out->err_msg[sn] = '\0';
        return 0;
    case K_RFMT:
        if (rd_rfmt(r, out))
            return -EBADMSG;
        return 0;
    case K_META:
        if (rd_bin(r, &s, &sn))
            return -EBADMSG;
        if (sn > PEER_WIRE_MAX_META)
            return -EMSGSIZE;
        out->meta = sn ? s : NULL;
        out->meta_len = sn;
        return 0;
    default:
        return rd_skip(r, 0) ? -EBADMSG : 0;
    }
}

/* The tensor bytes after a header that ends at off: each tensor's data,
 * zero-padded to 4 bytes, and nothing after the last. Returns 0 or
 * -EBADMSG. */
static int rd_data(const uint8_t *p, size_t len, size_t off, peer_msg *out)
{
    size_t pad = peer_wire_pad4(off);
    if (pad > len - off)
        return -EBADMSG;
    for (size_t i = 0; i < pad; i++)
        if (p[off + i])
            return -EBADMSG;
    off += pad;
    /* Tensors are read as float: the caller's buffer start must keep the
     * data 4-byte aligned, which it does when the record starts aligned. */
    if (((uintptr_t)(p + off) & 3u) != 0)
        return -EBADMSG;
    size_t left = len - off;
    for (int i = 0; i < out->n_tensors; i++) {
        size_t nb = out->t[i].nbytes, tpad = peer_wire_pad4(nb);
        if (nb > left || tpad > left - nb)
            return -EBADMSG;
        out->t[i].data = nb ? p + off : NULL;
        for (size_t k = 0; k < tpad; k++)
            if (p[off + nb + k])
                return -EBADMSG;
        off += nb + tpad;
        left -= nb + tpad;
    }
    return left ? -EBADMSG : 0;
}

int peer_wire_decode(const uint8_t *p, size_t len, const peer_wire_limits *lim_in, peer_msg *out)
{
    if (!p || !out)
        return -EBADMSG;
    peer_wire_limits lim = {DEFAULT_MAX_FRAME, PEER_WIRE_MAX_DIMS, PEER_WIRE_MAX_TENSORS};
    if (lim_in) {
        if (lim_in->max_frame) lim.max_frame = lim_in->max_frame;
        if (lim_in->max_dims > 0 && lim_in->max_dims < PEER_WIRE_MAX_DIMS)
            lim.max_dims = lim_in->max_dims;
        if (lim_in->max_tensors > 0 && lim_in->max_tensors < PEER_WIRE_MAX_TENSORS)
            lim.max_tensors = lim_in->max_tensors;
    }
    if (len > lim.max_frame)
        return -EMSGSIZE;
    if (len < 4)
        return -EBADMSG;
    size_t hlen = (size_t)p[0] | (size_t)p[1] << 8 | (size_t)p[2] << 16 | (size_t)p[3] << 24;
    if (hlen > len - 4)
        return -EBADMSG;
    memset(out, 0, sizeof *out);
    rd r = {p + 4, p + 4 + hlen};
    size_t nkeys;
    if (rd_map(&r, &nkeys) || nkeys > hlen)
        return -EBADMSG;
    unsigned seen = 0;
    for (size_t i = 0; i < nkeys; i++) {
        uint64_t key;
        if (rd_uint(&r, &key))
            return -EBADMSG;
        if (key < 32) {
            if (seen & (1u << key))
                return -EBADMSG; /* a repeated key is malformed, not "last wins" */
            seen |= 1u << key;
        }
        int rc = rd_field(&r, key, &lim, out);
        if (rc != 0)
            return rc;
    }
    if (r.p != r.end)
        return -EBADMSG; /* trailing bytes inside the header */
    if ((seen & 7u) != 7u)
        return -EBADMSG; /* kind, method and id are required */
    return rd_data(p, len, 4 + hlen, out);
}
