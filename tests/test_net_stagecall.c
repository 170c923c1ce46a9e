/* The stage-call codec (net/stagecall.h): requests for each method and
 * format, replies of the right and the wrong shape, and hostile replies
 * off the wire. */
#include <errno.h>
#include <string.h>

#include "net/stagecall.h"
#include "net/tensorfmt.h"
#include "swarm/rng.h"
#include "test_util.h"

#define ROWS 3
#define W 8

static float x[ROWS * W], dy[ROWS * W];
static const uint64_t rw[1] = {W};

static void fill(void)
{
    for (int i = 0; i < ROWS * W; i++) {
        x[i] = (float)i * 0.25f - 2.0f;
        dy[i] = (float)(i % 5) * 0.125f - 0.3f;
    }
}

static void test_forward_and_infer(void **state)
{
    (void)state;
    fill();
    peer_msg m;
    uint8_t meta[PEER_META_U64_LEN];
    peer_msg_init(&m, PEER_KIND_REQUEST, PEER_METHOD_FORWARD, 1);
    peer_stagecall c = {.rows = ROWS, .x = x, .nin = 1, .rin = rw};
    assert_int_equal(peer_stagecall_encode(&m, meta, &c), 0);
    assert_int_equal(m.n_tensors, 1);
    assert_int_equal(m.t[0].dtype, PEER_DTYPE_F32);
    assert_int_equal(m.t[0].ndim, 2);
    assert_int_equal(m.t[0].shape[0], ROWS);
    assert_ptr_equal(m.t[0].data, x); /* f32 is borrowed, not copied */
    assert_null(m.meta);
    assert_int_equal(m.meta_len, 0);
    /* An infer over a span of 3 stages names it; a span of 1 sends none. */
    peer_msg_init(&m, PEER_KIND_REQUEST, PEER_METHOD_INFER, 2);
    c.span = 3;
    assert_int_equal(peer_stagecall_encode(&m, meta, &c), 0);
    int span = 0;
    assert_int_equal(peer_meta_span_decode(m.meta, m.meta_len, 8, &span), 0);
    assert_int_equal(span, 3);
    c.span = 1;
    assert_int_equal(peer_stagecall_encode(&m, meta, &c), 0);
    assert_int_equal(m.meta_len, 0);
    /* A bad shape is an error, not a message. */
    c.nin = 0;
    assert_int_equal(peer_stagecall_encode(&m, meta, &c), -EINVAL);
}

static void test_backward_formats(void **state)
{
    (void)state;
    fill();
    peer_msg m;
    uint8_t meta[PEER_META_U64_LEN];
    uint8_t scratch[2 * 1024];
    peer_msg_init(&m, PEER_KIND_REQUEST, PEER_METHOD_BACKWARD, 3);
    peer_stagecall c = {
        .rows = ROWS, .x = x, .nin = 1, .rin = rw, .dy = dy, .nout = 1, .rout = rw,
        .fmt = PEER_DTYPE_Q8, .block = PEER_FMT_Q8_BLOCK_MIN, .exact_inputs = 1, .sr_seed = 99,
        .at_version_known = 1, .at_version = 41, .scratch = scratch, .scratch_cap = sizeof scratch,
    };
    assert_int_equal(peer_stagecall_encode(&m, meta, &c), 0);
    assert_int_equal(m.n_tensors, 2);
    assert_int_equal(m.t[0].dtype, PEER_DTYPE_F32); /* tokens stay exact */
    assert_int_equal(m.t[1].dtype, PEER_DTYPE_Q8);
    assert_int_equal(m.reply_dtype, PEER_DTYPE_Q8);
    assert_int_equal(m.reply_block, PEER_FMT_Q8_BLOCK_MIN);
    uint64_t v = 0;
    assert_int_equal(peer_meta_at_version_decode(m.meta, m.meta_len, &v), 1);
    assert_int_equal(v, 41);
    /* Inputs in the format too when they are not tokens; the gradient is
     * unbiased-rounded, so it decodes close to dy. */
    c.exact_inputs = 0;
    c.at_version_known = 0;
    assert_int_equal(peer_stagecall_encode(&m, meta, &c), 0);
    assert_int_equal(m.t[0].dtype, PEER_DTYPE_Q8);
    assert_int_equal(m.meta_len, 0);
    float back[ROWS * W];
    assert_int_equal(peer_tensor_to_f32(&m.t[1], back, ROWS * W), 0);
    for (int i = 0; i < ROWS * W; i++)
        assert_float_equal(back[i], dy[i], 0.01);
    /* No room for the encoded tensors: said. */
    c.scratch_cap = 16;
    assert_int_equal(peer_stagecall_encode(&m, meta, &c), -ENOBUFS);
}

/* A reply with one tensor of `rows` rows of width w. */
static void reply(peer_msg *m, const float *data, uint64_t rows, uint64_t w)
{
    peer_msg_init(m, PEER_KIND_REPLY, PEER_METHOD_FORWARD, 1);
    uint64_t row[1] = {w};
    assert_int_equal(peer_tensor_rows(&m->t[0], data, rows, 1, row), 0);
    m->n_tensors = 1;
}

static void test_reply_rows(void **state)
{
    (void)state;
    fill();
    peer_msg m;
    float out[ROWS * W];
    reply(&m, x, ROWS, W);
    assert_int_equal(peer_stagecall_reply_rows(&m, 1, rw, ROWS, out, ROWS * W), 0);
    assert_memory_equal(out, x, sizeof out);
    assert_int_equal(peer_stagecall_reply_rows(&m, 1, rw, ROWS, NULL, 0), 0);
    /* Fewer or more rows than asked, another row width, two tensors: refused. */
    reply(&m, x, ROWS - 1, W);
    assert_int_equal(peer_stagecall_reply_rows(&m, 1, rw, ROWS, out, ROWS * W), -EBADMSG);
    reply(&m, x, ROWS, W);
    assert_int_equal(peer_stagecall_reply_rows(&m, 1, rw, ROWS - 1, out, ROWS * W), -EBADMSG);
    reply(&m, x, ROWS * 2, W / 2);
    assert_int_equal(peer_stagecall_reply_rows(&m, 1, rw, ROWS * 2, out, ROWS * W), -EBADMSG);
    reply(&m, x, ROWS, W);
    m.t[1] = m.t[0];
    m.n_tensors = 2;
    assert_int_equal(peer_stagecall_reply_rows(&m, 1, rw, ROWS, out, ROWS * W), -EBADMSG);
    m.n_tensors = 0;
    assert_int_equal(peer_stagecall_reply_rows(&m, 1, rw, ROWS, out, ROWS * W), -EBADMSG);
}

/* Replies off the wire with flipped bytes: every one either decodes to the
 * asked rows or is refused; none is read past its end (ASan). */
static void test_garbage_replies(void **state)
{
    (void)state;
    fill();
    peer_msg m;
    reply(&m, x, ROWS, W);
    uint8_t wire[4096];
    long len = peer_wire_encode(&m, wire, sizeof wire);
    assert_true(len > 0);
    uint64_t rng = 12345;
    int ok = 0, refused = 0;
    for (int round = 0; round < 5000; round++) {
        uint8_t buf[4096];
        memcpy(buf, wire, (size_t)len);
        size_t n = (size_t)len;
        int flips = 1 + (int)(route_rand01(&rng) * 4);
        for (int f = 0; f < flips; f++)
            buf[(size_t)(route_rand01(&rng) * (double)n)] = (uint8_t)(route_rand01(&rng) * 256);
        if (route_rand01(&rng) < 0.2)
            n = (size_t)(route_rand01(&rng) * (double)n);
        peer_msg d;
        if (peer_wire_decode(buf, n, NULL, &d) != 0) {
            refused++;
            continue;
        }
        float out[ROWS * W];
        int rc = peer_stagecall_reply_rows(&d, 1, rw, ROWS, out, ROWS * W);
        assert_true(rc == 0 || rc == -EBADMSG);
        if (rc == 0)
            ok++;
        else
            refused++;
    }
    assert_int_equal(ok + refused, 5000);
    assert_true(refused > 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_forward_and_infer),
        cmocka_unit_test(test_backward_formats),
        cmocka_unit_test(test_reply_rows),
        cmocka_unit_test(test_garbage_replies),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
