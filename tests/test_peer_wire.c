/* Tensor RPC message codec (peer/wire.h): round trips and hostile input. */
#include <errno.h>

#include "peer/wire.h"
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
        /* tensors: [[1, [2]]]: dtype 1 unknown */
        {"bad dtype", {0x84, 0, 0, 1, 2, 2, 1, 4, 0x91, 0x92, 1, 0x91, 2}, 13, 3, -EBADMSG},
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

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_roundtrip),
        cmocka_unit_test(test_encoder_refuses),
        cmocka_unit_test(test_truncations),
        cmocka_unit_test(test_garbage_and_mutation),
        cmocka_unit_test(test_crafted),
        cmocka_unit_test(test_doc_example),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
