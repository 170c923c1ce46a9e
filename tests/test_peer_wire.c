/* Tensor RPC message codec (net/wire.h): round trips and hostile input. */
#include <errno.h>
#include <math.h>

#include "net/tensorfmt.h"
#include "net/wire.h"
#include "test_util.h"

#define SEED 12345u

static uint32_t rng = SEED;
static uint32_t next_rand(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 17;
    rng ^= rng << 5;
    return rng;
}

static float xs[6 * 7], ys[5];

/* A forward request with two tensors, a block name and meta. */
static void sample(peer_msg *m)
{
    for (int i = 0; i < 42; i++)
        xs[i] = (float)i * 0.5f - 3.0f;
    for (int i = 0; i < 5; i++)
        ys[i] = (float)-i;
    peer_msg_init(m, PEER_KIND_REQUEST, PEER_METHOD_FORWARD, 0x1122334455667788ull);
    snprintf(m->block, sizeof m->block, "fmnist-mlp.2");
    uint64_t s0[2] = {6, 7}, s1[1] = {5};
    assert_int_equal(peer_tensor_f32(&m->t[0], xs, 2, s0), 0);
    assert_int_equal(peer_tensor_f32(&m->t[1], ys, 1, s1), 0);
    m->n_tensors = 2;
    static const char meta[] = "hello";
    m->meta = meta;
    m->meta_len = 5;
}

/* Encodes into a fresh 16-byte aligned buffer; returns it and its length. */
static uint8_t *enc(const peer_msg *m, long *len)
{
    long n = peer_wire_size(m);
    assert_true(n > 0);
    uint8_t *buf = aligned_alloc(16, ((size_t)n + 15) & ~(size_t)15);
    assert_non_null(buf);
    assert_int_equal(peer_wire_encode(m, buf, (size_t)n - 1), -ENOBUFS);
    assert_int_equal(peer_wire_encode(m, buf, (size_t)n), n);
    *len = n;
    return buf;
}

static void test_roundtrip(void **state)
{
    (void)state;
    peer_msg m, d;
    sample(&m);
    long n;
    uint8_t *buf = enc(&m, &n);
    assert_int_equal(n % 4, 0);
    assert_int_equal(peer_wire_decode(buf, (size_t)n, NULL, &d), 0);
    assert_int_equal(d.kind, PEER_KIND_REQUEST);
    assert_int_equal(d.method, PEER_METHOD_FORWARD);
    assert_true(d.id == 0x1122334455667788ull);
    assert_string_equal(d.block, "fmnist-mlp.2");
    assert_int_equal(d.n_tensors, 2);
    assert_int_equal(d.t[0].ndim, 2);
    assert_true(d.t[0].shape[0] == 6 && d.t[0].shape[1] == 7);
    assert_int_equal(d.t[0].nbytes, sizeof xs);
    assert_memory_equal(d.t[0].data, xs, sizeof xs);
    assert_memory_equal(d.t[1].data, ys, sizeof ys);
    /* Tensor bytes are raw, in place, at the end of the frame. */
    assert_ptr_equal((const uint8_t *)d.t[1].data + sizeof ys, buf + n);
    assert_int_equal(d.meta_len, 5);
    assert_memory_equal(d.meta, "hello", 5);
    free(buf);

    /* Error reply, no tensors; a zero-size tensor; a scalar (0 dims). */
    peer_msg e;
    peer_msg_init(&e, PEER_KIND_ERROR, PEER_METHOD_BACKWARD, 7);
    e.err_code = 22;
    snprintf(e.err_msg, sizeof e.err_msg, "wrong shape: want (B,512)");
    buf = enc(&e, &n);
    assert_int_equal(peer_wire_decode(buf, (size_t)n, NULL, &d), 0);
    assert_int_equal(d.kind, PEER_KIND_ERROR);
    assert_int_equal(d.err_code, 22);
    assert_string_equal(d.err_msg, "wrong shape: want (B,512)");
    assert_int_equal(d.n_tensors, 0);
    free(buf);

    peer_msg z;
    peer_msg_init(&z, PEER_KIND_REPLY, PEER_METHOD_FORWARD, 0);
    uint64_t s0[3] = {4, 0, 9};
    float one = 1.5f;
    assert_int_equal(peer_tensor_f32(&z.t[0], NULL, 3, s0), 0);
    assert_int_equal(peer_tensor_f32(&z.t[1], &one, 0, NULL), 0);
    z.n_tensors = 2;
    buf = enc(&z, &n);
    assert_int_equal(peer_wire_decode(buf, (size_t)n, NULL, &d), 0);
    assert_int_equal(d.t[0].nbytes, 0);
    assert_int_equal(d.t[1].nbytes, 4);
    assert_true(*(const float *)d.t[1].data == 1.5f);
    free(buf);
}

static void test_encoder_refuses(void **state)
{
    (void)state;
    peer_msg m;
    sample(&m);
    m.t[0].nbytes = 4; /* does not match the shape */
    assert_int_equal(peer_wire_size(&m), -EINVAL);
    sample(&m);
    m.n_tensors = PEER_WIRE_MAX_TENSORS + 1;
    assert_int_equal(peer_wire_size(&m), -EINVAL);
    sample(&m);
    m.t[0].data = NULL;
    assert_int_equal(peer_wire_size(&m), -EINVAL);
    uint64_t big[2] = {UINT64_MAX / 2, 3};
    peer_tensor t;
    assert_int_equal(peer_tensor_f32(&t, xs, 2, big), -EOVERFLOW);
    assert_int_equal(peer_tensor_f32(&t, xs, PEER_WIRE_MAX_DIMS + 1, big), -EINVAL);
    assert_int_equal(peer_wire_size(NULL), -EINVAL);
}

/* Every proper prefix of a valid frame is refused without crashing. */
static void test_truncations(void **state)
{
    (void)state;
    peer_msg m, d;
    sample(&m);
    long n;
    uint8_t *buf = enc(&m, &n);
    for (long i = 0; i < n; i++) {
        uint8_t *cut = aligned_alloc(16, ((size_t)i + 31) & ~(size_t)15);
        memcpy(cut, buf, (size_t)i);
        int rc = peer_wire_decode(cut, (size_t)i, NULL, &d);
        if (rc != -EBADMSG)
            fail_msg("prefix of %ld bytes gave %d", i, rc);
        free(cut);
    }
    /* A trailing byte is refused too. */
    uint8_t *longer = aligned_alloc(16, ((size_t)n + 31) & ~(size_t)15);
    memcpy(longer, buf, (size_t)n);
    longer[n] = 0;
    assert_int_equal(peer_wire_decode(longer, (size_t)n + 1, NULL, &d), -EBADMSG);
    free(longer);
    free(buf);
}

static void test_garbage_and_mutation(void **state)
{
    (void)state;
    peer_msg m, d;
    uint8_t *g = aligned_alloc(16, 4096);
    rng = SEED;
    /* Pure garbage of every length up to 300, many times. */
    for (int iter = 0; iter < 20000; iter++) {
        size_t len = next_rand() % 300;
        for (size_t i = 0; i < len; i++)
            g[i] = (uint8_t)next_rand();
        /* Make the header length plausible half of the time. */
        if (len >= 4 && (iter & 1)) {
            uint32_t h = next_rand() % (uint32_t)(len - 3);
            g[0] = (uint8_t)h; g[1] = (uint8_t)(h >> 8); g[2] = 0; g[3] = 0;
        }
        int rc = peer_wire_decode(g, len, NULL, &d);
        if (rc != 0 && rc != -EBADMSG && rc != -EMSGSIZE)
            fail_msg("seed %u iter %d: garbage gave %d", SEED, iter, rc);
    }
    /* Random 1..4-byte mutations of a valid frame: decode or refuse, and when
     * it decodes, every tensor lies inside the buffer. */
    sample(&m);
    long n;
    uint8_t *buf = enc(&m, &n);
    int ok = 0, bad = 0;
    for (int iter = 0; iter < 50000; iter++) {
        memcpy(g, buf, (size_t)n);
        int k = 1 + (int)(next_rand() % 4);
        for (int j = 0; j < k; j++)
            g[next_rand() % (uint32_t)n] = (uint8_t)next_rand();
        int rc = peer_wire_decode(g, (size_t)n, NULL, &d);
        if (rc == 0) {
            ok++;
            for (int t = 0; t < d.n_tensors; t++)
                if (d.t[t].nbytes && ((const uint8_t *)d.t[t].data < g ||
                                      (const uint8_t *)d.t[t].data + d.t[t].nbytes > g + n))
                    fail_msg("seed %u iter %d: tensor %d outside the frame", SEED, iter, t);
        } else if (rc == -EBADMSG || rc == -EMSGSIZE) {
            bad++;
        } else {
            fail_msg("seed %u iter %d: mutation gave %d", SEED, iter, rc);
        }
    }
    /* Mutations of tensor bytes decode; header mutations mostly do not. */
    assert_true(ok > 0 && bad > 0);
    free(buf);
    free(g);
}

/* Crafted hostile headers: each must give the stated error. */
static void test_crafted(void **state)
{
    (void)state;
    peer_msg d;
    uint8_t *b = aligned_alloc(16, 256);
    struct { const char *what; uint8_t hdr[40]; size_t hlen; size_t tail; int want; } cases[] = {
        /* {0:0, 1:2, 2:1} and nothing else: valid, no tensors */
        {"minimal", {0x83, 0, 0, 1, 2, 2, 1}, 7, 1, 0},
        {"missing id", {0x82, 0, 0, 1, 2}, 5, 3, -EBADMSG},
        {"repeated key", {0x84, 0, 0, 1, 2, 2, 1, 2, 1}, 9, 3, -EBADMSG},
        {"kind out of range", {0x83, 0, 3, 1, 2, 2, 1}, 7, 1, -EBADMSG},
        {"map count huge", {0xdf, 0xff, 0xff, 0xff, 0xff}, 5, 3, -EBADMSG},
        {"unknown key skipped", {0x84, 0, 0, 1, 2, 2, 1, 9, 0x92, 1, 2}, 11, 1, 0},
        {"deep nesting", {0x84, 0, 0, 1, 2, 2, 1, 9, 0x91, 0x91, 0x91, 0x91, 0x91, 0x91, 0x91,
                          0x91, 0x91, 0x91, 0x91, 1}, 20, 0, -EBADMSG},
        /* tensors: [[0, [1000000000, 1000000000]]]: over the frame limit */
        {"huge shape", {0x84, 0, 0, 1, 2, 2, 1, 4, 0x91, 0x92, 0, 0x92, 0xce, 0x3b, 0x9a, 0xca,
                        0x00, 0xce, 0x3b, 0x9a, 0xca, 0x00}, 22, 2, -EMSGSIZE},
        /* tensors: [[4, [2]]]: dtype 4 unknown (1..3 are the compressed
         * formats, test_lying_headers) */
        {"bad dtype", {0x84, 0, 0, 1, 2, 2, 1, 4, 0x91, 0x92, 4, 0x91, 2}, 13, 3, -EBADMSG},
        /* tensors: [[0, [2]]] but no data follows */
        {"missing data", {0x84, 0, 0, 1, 2, 2, 1, 4, 0x91, 0x92, 0, 0x91, 2}, 13, 3, -EBADMSG},
        /* 9 dims */
        {"too many dims", {0x84, 0, 0, 1, 2, 2, 1, 4, 0x91, 0x92, 0, 0x99, 1, 1, 1, 1, 1, 1, 1, 1,
                           1}, 21, 3, -EMSGSIZE},
        /* 17 tensors (array16 of 17) */
        {"too many tensors", {0x84, 0, 0, 1, 2, 2, 1, 4, 0xdc, 0, 17}, 11, 1, -EMSGSIZE},
        /* block name with a NUL */
        {"NUL in block", {0x84, 0, 0, 1, 2, 2, 1, 3, 0xa2, 'a', 0}, 11, 1, -EBADMSG},
        /* str8 claiming 200 bytes */
        {"string overrun", {0x84, 0, 0, 1, 2, 2, 1, 3, 0xd9, 200, 'a'}, 11, 1, -EBADMSG},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        size_t h = cases[i].hlen;
        b[0] = (uint8_t)h; b[1] = b[2] = b[3] = 0;
        memcpy(b + 4, cases[i].hdr, h);
        size_t len = 4 + h;
        size_t pad = (4 - (len & 3)) & 3;
        memset(b + len, 0, pad + 8);
        len += pad;
        (void)cases[i].tail;
        int rc = peer_wire_decode(b, len, NULL, &d);
        if (rc != cases[i].want)
            fail_msg("%s: got %d, want %d", cases[i].what, rc, cases[i].want);
    }
    /* Non-zero padding is refused. */
    b[0] = 7; b[1] = b[2] = b[3] = 0;
    memcpy(b + 4, (uint8_t[]){0x83, 0, 0, 1, 2, 2, 1}, 7);
    b[11] = 1;
    assert_int_equal(peer_wire_decode(b, 12, NULL, &d), -EBADMSG);
    /* A frame over the configured limit is refused by size. */
    peer_wire_limits lim = {.max_frame = 8};
    b[11] = 0;
    assert_int_equal(peer_wire_decode(b, 12, &lim, &d), -EMSGSIZE);
    assert_int_equal(peer_wire_decode(NULL, 12, NULL, &d), -EBADMSG);
    free(b);
}

/* The worked example of docs/rpc.md section 5, byte for byte. */
static void test_doc_example(void **state)
{
    (void)state;
    float x[6] = {1, 2, 3, 4, 5, 6};
    uint64_t shape[2] = {2, 3};
    peer_msg m;
    peer_msg_init(&m, PEER_KIND_REQUEST, PEER_METHOD_FORWARD, 1);
    snprintf(m.block, sizeof m.block, "b");
    peer_tensor_f32(&m.t[0], x, 2, shape);
    m.n_tensors = 1;
    static const uint8_t want[] = {
        0x11, 0, 0, 0,                                     /* hlen = 17 */
        0x85, 0x00, 0x00, 0x01, 0x02, 0x02, 0x01, 0x03, 0xa1, 'b',
        0x04, 0x91, 0x92, 0x00, 0x92, 0x02, 0x03,
        0, 0, 0,                                           /* pad to 24 */
        0x00, 0x00, 0x80, 0x3f, 0x00, 0x00, 0x00, 0x40, 0x00, 0x00, 0x40, 0x40,
        0x00, 0x00, 0x80, 0x40, 0x00, 0x00, 0xa0, 0x40, 0x00, 0x00, 0xc0, 0x40,
    };
    uint8_t out[64];
    assert_int_equal(peer_wire_encode(&m, out, sizeof out), (long)sizeof want);
    assert_memory_equal(out, want, sizeof want);
}

/* ---- compressed tensor formats (dtype 1 f16, 2 bf16, 3 q8 with a block) ---- */

/* A format of the round trips below: dtype and q8 block. */
typedef struct wfmt {
    peer_dtype dtype;
    int block;
} wfmt;

static const wfmt wire_fmts[] = {
    {PEER_DTYPE_F16, 0}, {PEER_DTYPE_BF16, 0}, {PEER_DTYPE_Q8, 16}, {PEER_DTYPE_Q8, 64}, {PEER_DTYPE_Q8, 4096},
};

/* n values of mixed sign and magnitude. */
static void fill_vals(float *x, size_t n, uint32_t seed)
{
    rng = seed;
    for (size_t i = 0; i < n; i++)
        x[i] = ((float)(next_rand() % 20001) - 10000.0f) * 1e-3f * (float)(1 + (next_rand() % 4));
}

/* Encodes x (n values) in f into a malloc'ed buffer of exactly the encoded
 * size; *len gets it. */
static uint8_t *fmt_encode(wfmt f, const float *x, size_t n, size_t *len)
{
    *len = peer_tensorfmt_size((peer_fmt)f.dtype, f.block, n);
    assert_true(*len > 0);
    uint8_t *b = malloc(*len);
    assert_non_null(b);
    assert_int_equal(peer_tensorfmt_encode((peer_fmt)f.dtype, f.block, x, n, b, *len), (long)*len);
    return b;
}

static size_t pad_of(size_t n)
{
    return (4 - (n & 3)) & 3;
}

/* Checks a decoded message against the one encoded (m) and the frame
 * (buf, n): tensors in order, 4-aligned, in place, their padding zero,
 * the last one ending at the frame's end. */
static void check_tensors(const peer_msg *m, const peer_msg *d, const uint8_t *buf, long n)
{
    assert_int_equal(d->n_tensors, m->n_tensors);
    const uint8_t *end = NULL;
    for (int i = 0; i < m->n_tensors; i++) {
        const peer_tensor *a = &m->t[i], *b = &d->t[i];
        assert_int_equal(b->dtype, a->dtype);
        assert_int_equal(b->block, a->block);
        assert_int_equal(b->ndim, a->ndim);
        for (int k = 0; k < a->ndim; k++)
            assert_true(b->shape[k] == a->shape[k]);
        assert_int_equal(b->nbytes, a->nbytes);
        if (!a->nbytes)
            continue;
        const uint8_t *p = b->data;
        assert_true(p > buf && p + b->nbytes <= buf + n);
        assert_int_equal((uintptr_t)p & 3u, 0);
        if (end)
            assert_ptr_equal(p, end); /* nothing between tensors but their padding */
        assert_memory_equal(p, a->data, a->nbytes);
        for (size_t k = 0; k < pad_of(b->nbytes); k++)
            assert_int_equal(p[b->nbytes + k], 0);
        end = p + b->nbytes + pad_of(b->nbytes);
    }
    if (end)
        assert_ptr_equal(end, buf + n);
}

/* f16, bf16 and q8 (blocks 16, 64, 4096) tensors of odd lengths round trip,
 * alone and followed by an f32 tensor whose data stays 4-aligned; sizes,
 * the head/data split and peer_tensor_to_f32 agree with the codec. */
static void test_formats_roundtrip(void **state)
{
    (void)state;
    static const size_t ns[] = {1, 2, 3, 5, 65, 1001};
    static float x[1001], tail[7], y[1002], want[1001];
    for (int i = 0; i < 7; i++)
        tail[i] = (float)i - 2.5f;
    for (size_t fi = 0; fi < sizeof wire_fmts / sizeof wire_fmts[0]; fi++) {
        wfmt f = wire_fmts[fi];
        for (size_t k = 0; k < sizeof ns / sizeof ns[0]; k++) {
            size_t nv = ns[k];
            fill_vals(x, nv, SEED + (uint32_t)(fi * 16 + k));
            size_t elen;
            uint8_t *e = fmt_encode(f, x, nv, &elen);
            for (int mixed = 0; mixed < 3; mixed++) {
                peer_msg m, d;
                peer_msg_init(&m, PEER_KIND_REQUEST, PEER_METHOD_BACKWARD, 77 + (uint64_t)k);
                snprintf(m.block, sizeof m.block, "m.%zu", fi);
                uint64_t s1[1] = {nv}, s2[2] = {1, nv}, st[2] = {7, 1};
                /* mixed 0: the tensor alone (1-dim); 1: then an f32 (7, 1);
                 * 2: an f32 first, then the tensor (2-dim), then the same
                 * tensor again. */
                if (mixed == 2)
                    assert_int_equal(peer_tensor_f32(&m.t[m.n_tensors++], tail, 2, st), 0);
                assert_int_equal(peer_tensor_encoded(&m.t[m.n_tensors++], f.dtype, f.block, e, mixed == 2 ? 2 : 1,
                                                     mixed == 2 ? s2 : s1),
                                 0);
                assert_int_equal(m.t[m.n_tensors - 1].nbytes, elen);
                if (mixed == 1)
                    assert_int_equal(peer_tensor_f32(&m.t[m.n_tensors++], tail, 2, st), 0);
                if (mixed == 2)
                    assert_int_equal(peer_tensor_encoded(&m.t[m.n_tensors++], f.dtype, f.block, e, 1, s1), 0);
                long n;
                uint8_t *buf = enc(&m, &n);
                assert_int_equal(n % 4, 0);
                /* the head, then data_len bytes: the same frame */
                size_t dl = 0, want_dl = 0;
                for (int i = 0; i < m.n_tensors; i++)
                    want_dl += m.t[i].nbytes + pad_of(m.t[i].nbytes);
                uint8_t head[256];
                long h = peer_wire_encode_head(&m, head, sizeof head, &dl);
                assert_true(h > 0 && h % 4 == 0);
                assert_int_equal(dl, want_dl);
                assert_int_equal((size_t)h + dl, (size_t)n);
                assert_memory_equal(head, buf, (size_t)h);
                assert_int_equal(peer_wire_encode_head(&m, head, (size_t)h - 1, &dl), -ENOBUFS);

                assert_int_equal(peer_wire_decode(buf, (size_t)n, NULL, &d), 0);
                assert_true(d.id == 77 + (uint64_t)k);
                assert_int_equal(d.reply_dtype, PEER_DTYPE_F32);
                check_tensors(&m, &d, buf, n);
                /* every tensor reads back as the codec decodes it */
                int ti = mixed == 2 ? 1 : 0;
                assert_true(peer_tensor_count(&d.t[ti]) == nv);
                assert_int_equal(peer_tensorfmt_decode((peer_fmt)f.dtype, f.block, e, elen, nv, want), 0);
                memset(y, 0xA5, sizeof y);
                assert_int_equal(peer_tensor_to_f32(&d.t[ti], y, nv), 0);
                assert_memory_equal(y, want, nv * sizeof *y);
                static const uint8_t a5[4] = {0xA5, 0xA5, 0xA5, 0xA5};
                assert_memory_equal(&y[nv], a5, 4); /* nothing written past n */
                assert_int_equal(peer_tensor_to_f32(&d.t[ti], y, nv - 1), -ENOBUFS);
                if (mixed) {
                    int fi32 = mixed == 1 ? 1 : 0;
                    assert_int_equal(peer_tensor_to_f32(&d.t[fi32], y, 7), 0);
                    assert_memory_equal(y, tail, sizeof tail);
                    assert_memory_equal(d.t[fi32].data, tail, sizeof tail);
                }
                if (mixed == 2) {
                    assert_int_equal(peer_tensor_to_f32(&d.t[2], y, nv), 0);
                    assert_memory_equal(y, want, nv * sizeof *y);
                }
                free(buf);
            }
            free(e);
        }
    }
}

/* peer_tensor_rows_as encodes as the codec does: to nearest, or
 * stochastically with the seed given (gradients). */
static void test_rows_as(void **state)
{
    (void)state;
    static float x[3 * 65];
    static uint8_t scratch[4096], ref[4096];
    fill_vals(x, 3 * 65, 99);
    uint64_t row[1] = {65};
    for (size_t fi = 0; fi < sizeof wire_fmts / sizeof wire_fmts[0]; fi++) {
        wfmt f = wire_fmts[fi];
        size_t sz = peer_tensorfmt_size((peer_fmt)f.dtype, f.block, 3 * 65);
        for (int sr = 0; sr < 2; sr++) {
            peer_tensor t;
            assert_int_equal(peer_tensor_rows_as(&t, x, 3, 1, row, f.dtype, f.block, sr, 1234, scratch, sizeof scratch),
                             0);
            assert_int_equal(t.dtype, f.dtype);
            assert_int_equal(t.block, f.block);
            assert_int_equal(t.ndim, 2);
            assert_true(t.shape[0] == 3 && t.shape[1] == 65);
            assert_int_equal(t.nbytes, sz);
            assert_ptr_equal(t.data, scratch);
            long k = sr ? peer_tensorfmt_encode_sr((peer_fmt)f.dtype, f.block, x, 3 * 65, 1234, ref, sizeof ref)
                        : peer_tensorfmt_encode((peer_fmt)f.dtype, f.block, x, 3 * 65, ref, sizeof ref);
            assert_int_equal(k, (long)sz);
            assert_memory_equal(scratch, ref, sz);
            assert_int_equal(peer_tensor_rows_as(&t, x, 3, 1, row, f.dtype, f.block, sr, 1234, scratch, sz - 1),
                             -ENOBUFS);
        }
    }
    /* f32 borrows the data; bad formats are refused */
    peer_tensor t;
    assert_int_equal(peer_tensor_rows_as(&t, x, 3, 1, row, PEER_DTYPE_F32, 0, 0, 0, NULL, 0), 0);
    assert_ptr_equal(t.data, x);
    assert_int_equal(t.nbytes, 3 * 65 * 4);
    assert_int_equal(peer_tensor_rows_as(&t, x, 3, 1, row, PEER_DTYPE_Q8, 100, 0, 0, scratch, sizeof scratch),
                     -EINVAL);
    assert_int_equal(peer_tensor_rows_as(&t, x, 3, 1, row, PEER_DTYPE_Q8, 0, 0, 0, scratch, sizeof scratch),
                     -EINVAL);
    assert_int_equal(peer_tensor_rows_as(&t, x, 3, 1, row, (peer_dtype)4, 0, 0, 0, scratch, sizeof scratch),
                     -EINVAL);
}

/* Key 8, the reply format: round trips on requests; absent means f32;
 * replies and errors do not carry it; the encoder refuses bad ones. */
static void test_reply_format(void **state)
{
    (void)state;
    static const wfmt rf[] = {{PEER_DTYPE_F32, 0}, {PEER_DTYPE_F16, 0}, {PEER_DTYPE_BF16, 0}, {PEER_DTYPE_Q8, 16},
                              {PEER_DTYPE_Q8, 64}, {PEER_DTYPE_Q8, 256}, {PEER_DTYPE_Q8, 4096}};
    peer_msg m, d;
    long n0;
    sample(&m);
    uint8_t *plain = enc(&m, &n0);
    for (size_t i = 0; i < sizeof rf / sizeof rf[0]; i++) {
        sample(&m);
        m.reply_dtype = rf[i].dtype;
        m.reply_block = rf[i].block;
        long n;
        uint8_t *buf = enc(&m, &n);
        memset(&d, 0x5A, sizeof d);
        assert_int_equal(peer_wire_decode(buf, (size_t)n, NULL, &d), 0);
        assert_int_equal(d.reply_dtype, rf[i].dtype);
        assert_int_equal(d.reply_block, rf[i].block);
        assert_int_equal(d.n_tensors, 2);
        assert_memory_equal(d.t[0].data, xs, sizeof xs);
        if (rf[i].dtype == PEER_DTYPE_F32) {
            /* f32 is the default: not written at all */
            assert_int_equal(n, n0);
            assert_memory_equal(buf, plain, (size_t)n);
        } else {
            assert_true(buf[0] > plain[0]); /* the header grew by key 8 */
        }
        free(buf);
        /* replies and errors: never carried */
        for (int kind = PEER_KIND_REPLY; kind <= PEER_KIND_ERROR; kind++) {
            peer_msg r, r0;
            peer_msg_init(&r, (peer_kind)kind, PEER_METHOD_FORWARD, 9);
            if (kind == PEER_KIND_ERROR)
                snprintf(r.err_msg, sizeof r.err_msg, "no");
            r0 = r;
            r.reply_dtype = rf[i].dtype;
            r.reply_block = rf[i].block;
            long a, b;
            uint8_t *ba = enc(&r, &a), *bb = enc(&r0, &b);
            assert_int_equal(a, b);
            assert_memory_equal(ba, bb, (size_t)a);
            assert_int_equal(peer_wire_decode(ba, (size_t)a, NULL, &d), 0);
            assert_int_equal(d.reply_dtype, PEER_DTYPE_F32);
            assert_int_equal(d.reply_block, 0);
            free(ba);
            free(bb);
        }
    }
    free(plain);
    /* a request without key 8 decodes as f32, block 0 */
    sample(&m);
    long n;
    uint8_t *buf = enc(&m, &n);
    memset(&d, 0x5A, sizeof d);
    assert_int_equal(peer_wire_decode(buf, (size_t)n, NULL, &d), 0);
    assert_int_equal(d.reply_dtype, PEER_DTYPE_F32);
    assert_int_equal(d.reply_block, 0);
    free(buf);
    /* invalid reply formats are refused by every encoder entry */
    static const wfmt bad[] = {{PEER_DTYPE_Q8, 0}, {PEER_DTYPE_Q8, 8}, {PEER_DTYPE_Q8, 100}, {PEER_DTYPE_Q8, 8192},
                               {PEER_DTYPE_Q8, -64}, {PEER_DTYPE_F16, 64}, {PEER_DTYPE_F32, 16},
                               {(peer_dtype)4, 0}, {(peer_dtype)255, 0}};
    uint8_t out[512];
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        sample(&m);
        m.reply_dtype = bad[i].dtype;
        m.reply_block = bad[i].block;
        size_t dl;
        if (peer_wire_size(&m) != -EINVAL || peer_wire_encode(&m, out, sizeof out) != -EINVAL ||
            peer_wire_encode_head(&m, out, sizeof out, &dl) != -EINVAL)
            fail_msg("reply format (%d, %d) was not refused", (int)bad[i].dtype, bad[i].block);
    }
}

/* peer_tensor_to_f32 on hostile payloads: a negative or infinite q8 scale
 * is -EBADMSG with dst untouched; a small dst is -ENOBUFS. */
static void test_tensor_to_f32(void **state)
{
    (void)state;
    float x[40], y[41];
    fill_vals(x, 40, 5);
    size_t elen;
    wfmt f = {PEER_DTYPE_Q8, 16};
    uint8_t *e = fmt_encode(f, x, 40, &elen); /* blocks of 16, 16, 8 */
    assert_int_equal(elen, 40 + 3 * 4);
    peer_msg m, d;
    peer_msg_init(&m, PEER_KIND_REPLY, PEER_METHOD_FORWARD, 3);
    uint64_t shape[2] = {5, 8};
    assert_int_equal(peer_tensor_encoded(&m.t[0], f.dtype, f.block, e, 2, shape), 0);
    m.n_tensors = 1;
    long n;
    uint8_t *buf = enc(&m, &n);
    assert_int_equal(peer_wire_decode(buf, (size_t)n, NULL, &d), 0);
    uint8_t *scales = (uint8_t *)d.t[0].data;
    static const uint32_t refused[] = {0xBF800000u, 0x80000001u, 0x7F800000u, 0xFF800000u};
    for (int blk = 0; blk < 3; blk++)
        for (size_t i = 0; i < sizeof refused / sizeof refused[0]; i++) {
            uint8_t save[4];
            uint8_t *s = scales + 20 * blk;
            memcpy(save, s, 4);
            memcpy(s, &refused[i], 4);
            /* the frame still decodes: the wire does not read payloads */
            assert_int_equal(peer_wire_decode(buf, (size_t)n, NULL, &d), 0);
            for (int k = 0; k < 41; k++)
                y[k] = 777.0f;
            assert_int_equal(peer_tensor_to_f32(&d.t[0], y, 41), -EBADMSG);
            for (int k = 0; k < 41; k++)
                assert_true(y[k] == 777.0f);
            memcpy(s, save, 4);
        }
    assert_int_equal(peer_tensor_to_f32(&d.t[0], y, 39), -ENOBUFS);
    assert_int_equal(peer_tensor_to_f32(&d.t[0], y, 0), -ENOBUFS);
    assert_int_equal(peer_tensor_to_f32(&d.t[0], y, 40), 0);
    /* a zero-size compressed tensor reads as nothing */
    uint64_t z[2] = {0, 8};
    peer_tensor t0;
    assert_int_equal(peer_tensor_encoded(&t0, PEER_DTYPE_Q8, 64, NULL, 2, z), 0);
    assert_int_equal(t0.nbytes, 0);
    assert_int_equal(peer_tensor_to_f32(&t0, y, 0), 0);
    assert_true(peer_tensor_count(NULL) == 0);
    free(buf);
    free(e);
}

/* The encoder refuses tensors whose format, block or byte count do not
 * agree. */
static void test_encoder_refuses_formats(void **state)
{
    (void)state;
    static uint8_t bytes[4096];
    uint64_t shape[1] = {100};
    peer_tensor t;
    /* bad formats and blocks, at construction */
    static const wfmt bad[] = {{PEER_DTYPE_Q8, 0}, {PEER_DTYPE_Q8, 8}, {PEER_DTYPE_Q8, 17}, {PEER_DTYPE_Q8, 100},
                               {PEER_DTYPE_Q8, 8192}, {PEER_DTYPE_Q8, -16}, {PEER_DTYPE_F16, 16},
                               {PEER_DTYPE_BF16, 64}, {PEER_DTYPE_F32, 64}, {(peer_dtype)4, 0},
                               {(peer_dtype)255, 0}, {(peer_dtype)-1, 0}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        if (peer_tensor_encoded(&t, bad[i].dtype, bad[i].block, bytes, 1, shape) != -EINVAL)
            fail_msg("peer_tensor_encoded took (%d, %d)", (int)bad[i].dtype, bad[i].block);
    /* ... and in a message, when the fields are set by hand */
    peer_msg m;
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        peer_msg_init(&m, PEER_KIND_REQUEST, PEER_METHOD_FORWARD, 1);
        assert_int_equal(peer_tensor_encoded(&m.t[0], PEER_DTYPE_Q8, 64, bytes, 1, shape), 0);
        m.n_tensors = 1;
        m.t[0].dtype = bad[i].dtype;
        m.t[0].block = bad[i].block;
        if (peer_wire_size(&m) != -EINVAL)
            fail_msg("peer_wire_size took a tensor (%d, %d)", (int)bad[i].dtype, bad[i].block);
    }
    /* byte counts that do not match the format: one short, one long, the
     * padded size, another format's or block's size */
    struct { wfmt f; size_t nbytes; } lies[] = {
        {{PEER_DTYPE_F16, 0}, 199}, {{PEER_DTYPE_F16, 0}, 201}, {{PEER_DTYPE_F16, 0}, 400},
        {{PEER_DTYPE_BF16, 0}, 0}, {{PEER_DTYPE_Q8, 64}, 107}, {{PEER_DTYPE_Q8, 64}, 109},
        {{PEER_DTYPE_Q8, 64}, 112}, {{PEER_DTYPE_Q8, 16}, 108}, {{PEER_DTYPE_Q8, 4096}, 108},
        {{PEER_DTYPE_F32, 0}, 200},
    };
    for (size_t i = 0; i < sizeof lies / sizeof lies[0]; i++) {
        peer_msg_init(&m, PEER_KIND_REQUEST, PEER_METHOD_FORWARD, 1);
        assert_int_equal(peer_tensor_encoded(&m.t[0], lies[i].f.dtype, lies[i].f.block, bytes, 1, shape), 0);
        assert_true(m.t[0].nbytes != lies[i].nbytes);
        m.t[0].nbytes = lies[i].nbytes;
        m.n_tensors = 1;
        size_t dl;
        uint8_t out[512];
        if (peer_wire_size(&m) != -EINVAL || peer_wire_encode(&m, out, sizeof out) != -EINVAL ||
            peer_wire_encode_head(&m, out, sizeof out, &dl) != -EINVAL)
            fail_msg("case %zu: a %s tensor of 100 values with %zu bytes was encoded", i,
                     peer_tensorfmt_name((peer_fmt)lies[i].f.dtype), lies[i].nbytes);
    }
    /* the sizes peer_tensor_encoded sets */
    assert_int_equal(peer_tensor_encoded(&t, PEER_DTYPE_F16, 0, bytes, 1, shape), 0);
    assert_int_equal(t.nbytes, 200);
    assert_int_equal(peer_tensor_encoded(&t, PEER_DTYPE_Q8, 64, bytes, 1, shape), 0);
    assert_int_equal(t.nbytes, 108);
    assert_int_equal(peer_tensor_encoded(&t, PEER_DTYPE_Q8, 16, bytes, 1, shape), 0);
    assert_int_equal(t.nbytes, 100 + 7 * 4);
}

/* ---- lying headers ---- */

/* Writes a frame into b (aligned, >= 4 + hlen + 3 + dlen bytes): hlen,
 * the header, zero padding, then dlen data bytes. Returns its length. */
static size_t frame(uint8_t *b, const uint8_t *hdr, size_t hlen, const uint8_t *data, size_t dlen)
{
    b[0] = (uint8_t)hlen;
    b[1] = (uint8_t)(hlen >> 8);
    b[2] = b[3] = 0;
    memcpy(b + 4, hdr, hlen);
    size_t off = 4 + hlen, pad = pad_of(off);
    memset(b + off, 0, pad);
    off += pad;
    if (dlen)
        memcpy(b + off, data, dlen);
    return off + dlen;
}

/* A request header {0: 0, 1: 2, 2: 1, 4: tensors, 8: rfmt} with the
 * msgpack bytes given for key 4's value (none: no key 4) and key 8's. */
static size_t hdr_with(uint8_t *h, const uint8_t *tens, size_t tn, const uint8_t *rfmt, size_t rn)
{
    size_t k = 0;
    h[k++] = (uint8_t)(0x83 + (tn > 0) + (rn > 0));
    h[k++] = 0; h[k++] = 0;
    h[k++] = 1; h[k++] = 2;
    h[k++] = 2; h[k++] = 1;
    if (tn) {
        h[k++] = 4;
        memcpy(h + k, tens, tn);
        k += tn;
    }
    if (rn) {
        h[k++] = 8;
        memcpy(h + k, rfmt, rn);
        k += rn;
    }
    return k;
}

#define BYTES(...) ((const uint8_t[]){__VA_ARGS__}), sizeof((const uint8_t[]){__VA_ARGS__})

typedef struct lie {
    const char *what;
    uint8_t tens[40];
    size_t tn;
    size_t dlen;   /* zero data bytes that follow */
    int want;
} lie;

static void test_lying_headers(void **state)
{
    (void)state;
    uint8_t *b = aligned_alloc(16, 8192), hdr[128];
    uint8_t *data = calloc(1, 4096);
    assert_true(b && data);
    peer_msg d;
    /* q8 block 16 of 3 values: 4 + 3 = 7 bytes, padded to 8; f16 of 3: 6,
     * padded to 8; q8 block 64 of 65 values: 65 + 8 = 73, padded to 76 */
    static const lie cases[] = {
        {"q8 [3] block 16", {0x91, 0x93, 3, 0x91, 3, 16}, 6, 8, 0},
        {"q8 [3] block 16, uint16 block", {0x91, 0x93, 3, 0x91, 3, 0xcd, 0, 16}, 8, 8, 0},
        {"f16 [3]", {0x91, 0x92, 1, 0x91, 3}, 5, 8, 0},
        {"bf16 [3]", {0x91, 0x92, 2, 0x91, 3}, 5, 8, 0},
        {"bf16 [2]: no padding needed", {0x91, 0x92, 2, 0x91, 2}, 5, 4, 0},
        {"q8 [65] block 64", {0x91, 0x93, 3, 0x91, 65, 64}, 6, 76, 0},
        {"q8 [65] block 4096", {0x91, 0x93, 3, 0x91, 65, 0xcd, 0x10, 0x00}, 8, 72, 0},
        {"dtype 4", {0x91, 0x92, 4, 0x91, 3}, 5, 12, -EBADMSG},
        {"dtype 4 with a block", {0x91, 0x93, 4, 0x91, 3, 16}, 6, 8, -EBADMSG},
        {"dtype 255", {0x91, 0x92, 0xcc, 0xff, 0x91, 3}, 6, 12, -EBADMSG},
        {"dtype -1", {0x91, 0x92, 0xff, 0x91, 3}, 5, 12, -EBADMSG},
        {"dtype a string", {0x91, 0x92, 0xa1, '3', 0x91, 3}, 6, 12, -EBADMSG},
        {"q8 without a block", {0x91, 0x92, 3, 0x91, 3}, 5, 8, -EBADMSG},
        {"q8 without a block, f32 size", {0x91, 0x92, 3, 0x91, 3}, 5, 12, -EBADMSG},
        {"f16 with a third element", {0x91, 0x93, 1, 0x91, 3, 16}, 6, 8, -EBADMSG},
        {"f16 with a third element 0", {0x91, 0x93, 1, 0x91, 3, 0}, 6, 8, -EBADMSG},
        {"f32 with a third element", {0x91, 0x93, 0, 0x91, 3, 16}, 6, 12, -EBADMSG},
        {"q8 with a fourth element", {0x91, 0x94, 3, 0x91, 3, 16, 16}, 7, 8, -EBADMSG},
        {"tensor of one element", {0x91, 0x91, 3}, 3, 8, -EBADMSG},
        {"q8 block 0", {0x91, 0x93, 3, 0x91, 3, 0}, 6, 8, -EBADMSG},
        {"q8 block 8", {0x91, 0x93, 3, 0x91, 3, 8}, 6, 8, -EBADMSG},
        {"q8 block 17", {0x91, 0x93, 3, 0x91, 3, 17}, 6, 8, -EBADMSG},
        {"q8 block 100", {0x91, 0x93, 3, 0x91, 3, 100}, 6, 8, -EBADMSG},
        {"q8 block 4097", {0x91, 0x93, 3, 0x91, 3, 0xcd, 0x10, 0x01}, 8, 8, -EBADMSG},
        {"q8 block 8192", {0x91, 0x93, 3, 0x91, 3, 0xcd, 0x20, 0x00}, 8, 8, -EBADMSG},
        {"q8 block 2^32 + 16", {0x91, 0x93, 3, 0x91, 3, 0xcf, 0, 0, 0, 1, 0, 0, 0, 16}, 14, 8, -EBADMSG},
        {"q8 block 2^40", {0x91, 0x93, 3, 0x91, 3, 0xcf, 0, 0, 1, 0, 0, 0, 0, 0}, 14, 8, -EBADMSG},
        {"q8 block 2^64-1", {0x91, 0x93, 3, 0x91, 3, 0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}, 14, 8,
         -EBADMSG},
        {"q8 block -16", {0x91, 0x93, 3, 0x91, 3, 0xf0}, 6, 8, -EBADMSG},
        {"q8 block nil", {0x91, 0x93, 3, 0x91, 3, 0xc0}, 6, 8, -EBADMSG},
        {"q8 block 16.0", {0x91, 0x93, 3, 0x91, 3, 0xca, 0x41, 0x80, 0, 0}, 10, 8, -EBADMSG},
        /* the same lies with no data at all: a format that cannot be sized
         * must not pass as an empty tensor */
        {"q8 without a block, no data", {0x91, 0x92, 3, 0x91, 3}, 5, 0, -EBADMSG},
        {"q8 block 0, no data", {0x91, 0x93, 3, 0x91, 3, 0}, 6, 0, -EBADMSG},
        {"q8 block 17, no data", {0x91, 0x93, 3, 0x91, 3, 17}, 6, 0, -EBADMSG},
        {"q8 block 8192, no data", {0x91, 0x93, 3, 0x91, 3, 0xcd, 0x20, 0x00}, 8, 0, -EBADMSG},
        {"q8 block 2^40, no data", {0x91, 0x93, 3, 0x91, 3, 0xcf, 0, 0, 1, 0, 0, 0, 0, 0}, 14, 0, -EBADMSG},
        {"dtype 4, no data", {0x91, 0x92, 4, 0x91, 3}, 5, 0, -EBADMSG},
        {"f32 with a third element 0, its data", {0x91, 0x93, 0, 0x91, 3, 0}, 6, 12, -EBADMSG},
        {"f16 with a third element 0, no data", {0x91, 0x93, 1, 0x91, 3, 0}, 6, 0, -EBADMSG},
        {"q8 [0] block 16, no data", {0x91, 0x93, 3, 0x91, 0, 16}, 6, 0, 0},
        {"q8 [0] without a block", {0x91, 0x92, 3, 0x91, 0}, 5, 0, -EBADMSG},
        /* byte counts: q8 [3] block 16 is 7 (+1 pad) */
        {"q8: missing padding", {0x91, 0x93, 3, 0x91, 3, 16}, 6, 7, -EBADMSG},
        {"q8: one byte short", {0x91, 0x93, 3, 0x91, 3, 16}, 6, 6, -EBADMSG},
        {"q8: one byte long", {0x91, 0x93, 3, 0x91, 3, 16}, 6, 9, -EBADMSG},
        {"q8: f32's size", {0x91, 0x93, 3, 0x91, 3, 16}, 6, 12, -EBADMSG},
        {"q8: four bytes long", {0x91, 0x93, 3, 0x91, 3, 16}, 6, 12, -EBADMSG},
        {"q8 [65]: 72", {0x91, 0x93, 3, 0x91, 65, 64}, 6, 72, -EBADMSG},
        {"q8 [65]: 73 (no padding)", {0x91, 0x93, 3, 0x91, 65, 64}, 6, 73, -EBADMSG},
        {"q8 [65]: 75", {0x91, 0x93, 3, 0x91, 65, 64}, 6, 75, -EBADMSG},
        {"q8 [65]: 77", {0x91, 0x93, 3, 0x91, 65, 64}, 6, 77, -EBADMSG},
        {"q8 [65]: 80", {0x91, 0x93, 3, 0x91, 65, 64}, 6, 80, -EBADMSG},
        {"q8 [65] block 16: block 64's size", {0x91, 0x93, 3, 0x91, 65, 16}, 6, 76, -EBADMSG},
        {"f16 [3]: missing padding", {0x91, 0x92, 1, 0x91, 3}, 5, 6, -EBADMSG},
        {"f16 [3]: one byte short", {0x91, 0x92, 1, 0x91, 3}, 5, 7, -EBADMSG},
        {"f16 [3]: f32's size", {0x91, 0x92, 1, 0x91, 3}, 5, 12, -EBADMSG},
        {"f16 [3]: no data", {0x91, 0x92, 1, 0x91, 3}, 5, 0, -EBADMSG},
        {"bf16 [2]: two bytes", {0x91, 0x92, 2, 0x91, 2}, 5, 2, -EBADMSG},
        {"bf16 [2]: eight bytes", {0x91, 0x92, 2, 0x91, 2}, 5, 8, -EBADMSG},
        /* q8 [3] then f32 [1]: 7 + 1 pad + 4 */
        {"q8 then f32", {0x92, 0x93, 3, 0x91, 3, 16, 0x92, 0, 0x91, 1}, 10, 12, 0},
        {"q8 then f32, packed", {0x92, 0x93, 3, 0x91, 3, 16, 0x92, 0, 0x91, 1}, 10, 11, -EBADMSG},
        {"q8 then f32, one long", {0x92, 0x93, 3, 0x91, 3, 16, 0x92, 0, 0x91, 1}, 10, 13, -EBADMSG},
        {"f16 [1] then bf16 [1]", {0x92, 0x92, 1, 0x91, 1, 0x92, 2, 0x91, 1}, 9, 8, 0},
        {"f16 [1] then bf16 [1], packed", {0x92, 0x92, 1, 0x91, 1, 0x92, 2, 0x91, 1}, 9, 4, -EBADMSG},
        {"f16 [1] then bf16 [1], short", {0x92, 0x92, 1, 0x91, 1, 0x92, 2, 0x91, 1}, 9, 6, -EBADMSG},
        /* limits: the tensor's value count is bounded by the frame */
        {"q8 huge shape", {0x91, 0x93, 3, 0x92, 0xce, 0x3b, 0x9a, 0xca, 0x00, 0xce, 0x3b, 0x9a, 0xca, 0x00, 64}, 15,
         8, -EMSGSIZE},
        {"f16 huge shape", {0x91, 0x92, 1, 0x92, 0xce, 0x3b, 0x9a, 0xca, 0x00, 0xce, 0x3b, 0x9a, 0xca, 0x00}, 14, 8,
         -EMSGSIZE},
        {"q8 shape 2^63", {0x91, 0x93, 3, 0x91, 0xcf, 0x80, 0, 0, 0, 0, 0, 0, 0, 16}, 14, 8, -EMSGSIZE},
        {"q8 nine dims", {0x91, 0x93, 3, 0x99, 1, 1, 1, 1, 1, 1, 1, 1, 3, 16}, 14, 8, -EMSGSIZE},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        size_t hl = hdr_with(hdr, cases[i].tens, cases[i].tn, NULL, 0);
        /* zero data: q8 scales of 0, so what decodes reads back */
        memset(data, 0, 4096);
        size_t len = frame(b, hdr, hl, data, cases[i].dlen);
        memset(&d, 0x5A, sizeof d);
        int rc = peer_wire_decode(b, len, NULL, &d);
        if (rc != cases[i].want)
            fail_msg("%s: got %d, want %d", cases[i].what, rc, cases[i].want);
        if (rc == 0)
            for (int t = 0; t < d.n_tensors; t++) {
                /* what decoded is consistent: its size is its format's */
                uint64_t cnt = peer_tensor_count(&d.t[t]);
                size_t want = d.t[t].dtype == PEER_DTYPE_F32 ? 4 * cnt
                              : peer_tensorfmt_size((peer_fmt)d.t[t].dtype, d.t[t].block, cnt);
                assert_int_equal(d.t[t].nbytes, want);
                assert_int_equal((uintptr_t)d.t[t].data & 3u, 0);
                float *y = malloc(cnt * sizeof *y);
                assert_int_equal(peer_tensor_to_f32(&d.t[t], y, cnt), 0);
                free(y);
            }
    }

    /* Nonzero padding after a compressed tensor: every pad byte, alone or
     * after a tensor that another follows. */
    struct { const char *what; uint8_t tens[16]; size_t tn; size_t dlen; size_t pad_at[3]; int npad; } pads[] = {
        {"q8 [3]", {0x91, 0x93, 3, 0x91, 3, 16}, 6, 8, {7}, 1},
        {"f16 [3]", {0x91, 0x92, 1, 0x91, 3}, 5, 8, {6, 7}, 2},
        {"bf16 [1]", {0x91, 0x92, 2, 0x91, 1}, 5, 4, {2, 3}, 2},
        {"q8 [65]", {0x91, 0x93, 3, 0x91, 65, 64}, 6, 76, {73, 74, 75}, 3},
        {"q8 then f32", {0x92, 0x93, 3, 0x91, 3, 16, 0x92, 0, 0x91, 1}, 10, 12, {7}, 1},
        {"f16 then bf16", {0x92, 0x92, 1, 0x91, 1, 0x92, 2, 0x91, 1}, 9, 8, {2, 3, 6}, 3},
    };
    for (size_t i = 0; i < sizeof pads / sizeof pads[0]; i++) {
        size_t hl = hdr_with(hdr, pads[i].tens, pads[i].tn, NULL, 0);
        memset(data, 0, 4096);
        size_t len = frame(b, hdr, hl, data, pads[i].dlen);
        assert_int_equal(peer_wire_decode(b, len, NULL, &d), 0);
        for (int k = 0; k < pads[i].npad; k++)
            for (int v = 0; v < 2; v++) {
                data[pads[i].pad_at[k]] = v ? 0x80 : 0x01;
                len = frame(b, hdr, hl, data, pads[i].dlen);
                int rc = peer_wire_decode(b, len, NULL, &d);
                if (rc != -EBADMSG)
                    fail_msg("%s: pad byte %zu = %#x: got %d", pads[i].what, pads[i].pad_at[k], data[pads[i].pad_at[k]],
                             rc);
                data[pads[i].pad_at[k]] = 0;
            }
    }

    /* Key 8, the reply format. */
    static const struct { const char *what; uint8_t v[16]; size_t n; int want; peer_dtype dt; int blk; } rf[] = {
        {"[0]", {0x91, 0}, 2, 0, PEER_DTYPE_F32, 0},
        {"[1]", {0x91, 1}, 2, 0, PEER_DTYPE_F16, 0},
        {"[2]", {0x91, 2}, 2, 0, PEER_DTYPE_BF16, 0},
        {"[3, 16]", {0x92, 3, 16}, 3, 0, PEER_DTYPE_Q8, 16},
        {"[3, 4096] (uint64)", {0x92, 3, 0xcf, 0, 0, 0, 0, 0, 0, 0x10, 0}, 11, 0, PEER_DTYPE_Q8, 4096},
        {"[uint8 3, 64]", {0x92, 0xcc, 3, 64}, 4, 0, PEER_DTYPE_Q8, 64},
        {"[]", {0x90}, 1, -EBADMSG, 0, 0},
        {"[9]", {0x91, 9}, 2, -EBADMSG, 0, 0},
        {"[4]", {0x91, 4}, 2, -EBADMSG, 0, 0},
        {"[255]", {0x91, 0xcc, 0xff}, 3, -EBADMSG, 0, 0},
        {"[3]", {0x91, 3}, 2, -EBADMSG, 0, 0},
        {"[1, 64]", {0x92, 1, 64}, 3, -EBADMSG, 0, 0},
        {"[0, 0]", {0x92, 0, 0}, 3, -EBADMSG, 0, 0},
        {"[3, 100]", {0x92, 3, 100}, 3, -EBADMSG, 0, 0},
        {"[3, 0]", {0x92, 3, 0}, 3, -EBADMSG, 0, 0},
        {"[3, 8]", {0x92, 3, 8}, 3, -EBADMSG, 0, 0},
        {"[3, 8192]", {0x92, 3, 0xcd, 0x20, 0}, 5, -EBADMSG, 0, 0},
        {"[3, 2^40]", {0x92, 3, 0xcf, 0, 0, 1, 0, 0, 0, 0, 0}, 11, -EBADMSG, 0, 0},
        {"[3, -64]", {0x92, 3, 0xd0, 0xc0}, 4, -EBADMSG, 0, 0},
        {"[3, 64, 1]", {0x93, 3, 64, 1}, 4, -EBADMSG, 0, 0},
        {"[-1]", {0x91, 0xff}, 2, -EBADMSG, 0, 0},
        {"3 (not an array)", {3}, 1, -EBADMSG, 0, 0},
        {"\"q8\"", {0xa2, 'q', '8'}, 3, -EBADMSG, 0, 0},
        {"{3: 64}", {0x81, 3, 64}, 3, -EBADMSG, 0, 0},
        {"nil", {0xc0}, 1, -EBADMSG, 0, 0},
        {"array16 [3, 64]", {0xdc, 0, 2, 3, 64}, 5, 0, PEER_DTYPE_Q8, 64},
        {"array32 claiming 2^32-1", {0xdd, 0xff, 0xff, 0xff, 0xff, 3}, 6, -EBADMSG, 0, 0},
    };
    for (size_t i = 0; i < sizeof rf / sizeof rf[0]; i++) {
        size_t hl = hdr_with(hdr, NULL, 0, rf[i].v, rf[i].n);
        size_t len = frame(b, hdr, hl, NULL, 0);
        memset(&d, 0x5A, sizeof d);
        int rc = peer_wire_decode(b, len, NULL, &d);
        if (rc != rf[i].want)
            fail_msg("key 8 = %s: got %d, want %d", rf[i].what, rc, rf[i].want);
        if (rc == 0 && (d.reply_dtype != rf[i].dt || d.reply_block != rf[i].blk))
            fail_msg("key 8 = %s: decoded (%d, %d)", rf[i].what, (int)d.reply_dtype, d.reply_block);
    }
    /* key 8 twice */
    {
        uint8_t h[32] = {0x85, 0, 0, 1, 2, 2, 1, 8, 0x91, 1, 8, 0x91, 1};
        size_t len = frame(b, h, 13, NULL, 0);
        assert_int_equal(peer_wire_decode(b, len, NULL, &d), -EBADMSG);
        h[0] = 0x84;
        len = frame(b, h, 10, NULL, 0);
        assert_int_equal(peer_wire_decode(b, len, NULL, &d), 0);
        assert_int_equal(d.reply_dtype, PEER_DTYPE_F16);
    }
    /* A small frame limit. The value count is bounded as for f32 (docs/rpc.md,
     * "Limits": 4 x product(shape) over the frame limit is EMSGSIZE), so a
     * q8 tensor of 65 values (a 96-byte frame) needs max_frame >= 260. */
    {
        size_t hl = hdr_with(hdr, BYTES(0x91, 0x93, 3, 0x91, 65, 64), NULL, 0);
        size_t len = frame(b, hdr, hl, data, 76);
        assert_int_equal(len, 96);
        peer_wire_limits lim = {.max_frame = 4 * 65};
        assert_int_equal(peer_wire_decode(b, len, &lim, &d), 0);
        lim.max_frame = 4 * 65 - 1;
        assert_int_equal(peer_wire_decode(b, len, &lim, &d), -EMSGSIZE);
        lim.max_frame = len - 1;
        assert_int_equal(peer_wire_decode(b, len, &lim, &d), -EMSGSIZE);
    }
    free(data);
    free(b);
}

/* Random mutations of valid frames with compressed tensors and a reply
 * format: each decodes or is refused; what decodes lies inside the frame
 * (ASan: every frame is a buffer of exactly its length), is 4-aligned,
 * has its format's size, and reads back with peer_tensor_to_f32 or a
 * clean -EBADMSG. */
static void test_formats_fuzz(void **state)
{
    (void)state;
    static float x[300];
    fill_vals(x, 300, 4242);
    size_t l1, l2, l3, l4;
    uint8_t *e1 = fmt_encode((wfmt){PEER_DTYPE_Q8, 16}, x, 65, &l1);
    uint8_t *e2 = fmt_encode((wfmt){PEER_DTYPE_F16, 0}, x, 3, &l2);
    uint8_t *e3 = fmt_encode((wfmt){PEER_DTYPE_BF16, 0}, x, 5, &l3);
    uint8_t *e4 = fmt_encode((wfmt){PEER_DTYPE_Q8, 4096}, x, 300, &l4);
    peer_msg ms[3];
    peer_msg_init(&ms[0], PEER_KIND_REQUEST, PEER_METHOD_FORWARD, 5);
    snprintf(ms[0].block, sizeof ms[0].block, "lm.1");
    uint64_t s65[2] = {5, 13}, s3[1] = {3}, s5[2] = {5, 1}, s300[2] = {3, 100}, s1[1] = {1};
    assert_int_equal(peer_tensor_encoded(&ms[0].t[0], PEER_DTYPE_Q8, 16, e1, 2, s65), 0);
    assert_int_equal(peer_tensor_f32(&ms[0].t[1], x, 1, s1), 0);
    ms[0].n_tensors = 2;
    ms[0].reply_dtype = PEER_DTYPE_Q8;
    ms[0].reply_block = 64;
    peer_msg_init(&ms[1], PEER_KIND_REQUEST, PEER_METHOD_BACKWARD, 6);
    assert_int_equal(peer_tensor_encoded(&ms[1].t[0], PEER_DTYPE_F16, 0, e2, 1, s3), 0);
    assert_int_equal(peer_tensor_encoded(&ms[1].t[1], PEER_DTYPE_BF16, 0, e3, 2, s5), 0);
    assert_int_equal(peer_tensor_encoded(&ms[1].t[2], PEER_DTYPE_Q8, 4096, e4, 2, s300), 0);
    ms[1].n_tensors = 3;
    ms[1].reply_dtype = PEER_DTYPE_BF16;
    peer_msg_init(&ms[2], PEER_KIND_REPLY, PEER_METHOD_FORWARD, 7);
    assert_int_equal(peer_tensor_encoded(&ms[2].t[0], PEER_DTYPE_Q8, 16, e1, 2, s65), 0);
    ms[2].n_tensors = 1;
    static float y[4096];
    int ok = 0, bad = 0;
    rng = SEED ^ 0x5eed;
    for (int which = 0; which < 3; which++) {
        long n;
        uint8_t *good = enc(&ms[which], &n);
        for (int iter = 0; iter < 20000; iter++) {
            /* the length: as is most of the time, else a few bytes off */
            size_t len = (size_t)n;
            uint32_t r = next_rand();
            if (r % 8 == 0)
                len = (size_t)n - 1 - (next_rand() % 8);
            else if (r % 8 == 1)
                len = (size_t)n + 1 + (next_rand() % 8);
            uint8_t *g = aligned_alloc(16, (len + 15) & ~(size_t)15);
            assert_non_null(g);
            memcpy(g, good, len < (size_t)n ? len : (size_t)n);
            for (size_t k = (size_t)n; k < len; k++)
                g[k] = (next_rand() & 1) ? 0 : (uint8_t)next_rand();
            int nm = 1 + (int)(next_rand() % 4);
            for (int j = 0; j < nm; j++) {
                /* mostly the header, where the formats are */
                uint32_t at = (next_rand() & 1) ? next_rand() % (uint32_t)(4 + good[0] + 3)
                                                : next_rand() % (uint32_t)len;
                if (at >= len)
                    at = (uint32_t)(len - 1);
                switch (next_rand() % 4) {
                case 0: g[at] = (uint8_t)next_rand(); break;
                case 1: g[at] ^= (uint8_t)(1u << (next_rand() % 8)); break;
                case 2: g[at] = (uint8_t)(g[at] + 1); break;
                default: g[at] = (uint8_t)(g[at] - 1); break;
                }
            }
            peer_msg d;
            int rc = peer_wire_decode(g, len, NULL, &d);
            if (rc == 0) {
                ok++;
                for (int t = 0; t < d.n_tensors; t++) {
                    const peer_tensor *tt = &d.t[t];
                    uint64_t cnt = peer_tensor_count(tt);
                    if ((unsigned)tt->dtype >= PEER_FMT_COUNT ||
                        peer_tensorfmt_check((peer_fmt)tt->dtype, tt->block) != 0 ||
                        (tt->dtype == PEER_DTYPE_Q8) != (tt->block != 0))
                        fail_msg("frame %d iter %d: tensor %d has format (%d, %d)", which, iter, t,
                                 (int)tt->dtype, tt->block);
                    size_t want = tt->dtype == PEER_DTYPE_F32 ? 4 * cnt
                                  : cnt ? peer_tensorfmt_size((peer_fmt)tt->dtype, tt->block, cnt) : 0;
                    if (tt->nbytes != want)
                        fail_msg("frame %d iter %d: tensor %d has %zu bytes, its format %zu", which, iter, t,
                                 tt->nbytes, want);
                    if (tt->nbytes && ((const uint8_t *)tt->data < g ||
                                       (const uint8_t *)tt->data + tt->nbytes > g + len ||
                                       ((uintptr_t)tt->data & 3u)))
                        fail_msg("frame %d iter %d: tensor %d outside the frame or unaligned", which, iter, t);
                    assert_true(cnt <= sizeof y / sizeof y[0]);
                    float *out = malloc((cnt ? cnt : 1) * sizeof *out); /* exact, for ASan */
                    assert_non_null(out);
                    int r2 = peer_tensor_to_f32(tt, out, cnt);
                    if (r2 != 0 && r2 != -EBADMSG)
                        fail_msg("frame %d iter %d: tensor %d read gave %d", which, iter, t, r2);
                    free(out);
                }
                if ((unsigned)d.reply_dtype >= PEER_FMT_COUNT ||
                    (d.reply_dtype == PEER_DTYPE_Q8
                         ? peer_tensorfmt_check(PEER_FMT_Q8, d.reply_block) != 0
                         : d.reply_block != 0))
                    fail_msg("frame %d iter %d: reply format (%d, %d)", which, iter, (int)d.reply_dtype,
                             d.reply_block);
            } else if (rc == -EBADMSG || rc == -EMSGSIZE) {
                bad++;
            } else {
                fail_msg("frame %d iter %d: mutation gave %d", which, iter, rc);
            }
            free(g);
        }
        free(good);
    }
    fprintf(stderr, "  fuzz: %d decoded, %d refused\n", ok, bad);
    assert_true(ok > 100 && bad > 100);
    free(e1);
    free(e2);
    free(e3);
    free(e4);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_roundtrip),
        cmocka_unit_test(test_encoder_refuses),
        cmocka_unit_test(test_truncations),
        cmocka_unit_test(test_garbage_and_mutation),
        cmocka_unit_test(test_crafted),
        cmocka_unit_test(test_doc_example),
        cmocka_unit_test(test_formats_roundtrip),
        cmocka_unit_test(test_rows_as),
        cmocka_unit_test(test_reply_format),
        cmocka_unit_test(test_tensor_to_f32),
        cmocka_unit_test(test_encoder_refuses_formats),
        cmocka_unit_test(test_lying_headers),
        cmocka_unit_test(test_formats_fuzz),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
