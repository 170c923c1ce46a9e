/* Weight stashing: a backward recomputed on the version its forward used
 * (expert_block_backward_at), while the block still holds it; and kept
 * activations: a backward that takes its forward from saved workspace rows
 * (expert_block_backward_kept) equals the recomputing one. */
#include <errno.h>
#include <math.h>

#include "expert/block.h"
#include "expert/optim.h"
#include "test_util.h"

static const struct expert_block_config cfg = {EXPERT_BLOCK_RESFFN, 8, 8, 16};

static void fill(float *x, size_t n, unsigned seed)
{
    for (size_t i = 0; i < n; i++)
        x[i] = (float)rand_r(&seed) / (float)RAND_MAX - 0.5f;
}

static void test_backward_on_previous_version(void **state)
{
    (void)state;
    expert_block *b = expert_block_create(&cfg, 3), *ref = expert_block_create(&cfg, 3);
    expert_workspace *ws = expert_workspace_create(&cfg, 4);
    struct expert_optim o;
    expert_optim_default_adamw(&o);
    o.target_batch = 1;
    float x[32], dy[32], dx[32], dx_ref[32], g[1024], g_ref[1024];
    fill(x, 32, 1);
    fill(dy, 32, 2);
    size_t n = expert_block_nparams(b);
    assert_true(n <= 1024);

    /* Step b once: version 1; slot "previous" still holds version 0. */
    uint64_t v = 99;
    assert_int_equal(expert_block_backward(b, ws, NULL, dy, x, 4, NULL), 0);
    assert_int_equal(expert_block_step(b, &o, NULL), 0);
    assert_true(expert_block_version(b) == 1);

    /* backward_at(0) equals a backward on the untouched reference (version 0). */
    assert_int_equal(expert_block_backward_at(b, ws, NULL, dx, dy, x, 4, 0, &v), 0);
    assert_true(v == 0);
    assert_int_equal(expert_block_backward(ref, ws, dx_ref, dy, x, 4, NULL), 0);
    assert_memory_equal(dx, dx_ref, sizeof dx);
    expert_block_copy_grads(b, g);
    expert_block_copy_grads(ref, g_ref);
    assert_memory_equal(g, g_ref, n * sizeof(float));

    /* The current version is used when asked, or when the old one is gone. */
    assert_int_equal(expert_block_backward_at(b, ws, NULL, dx, dy, x, 4, EXPERT_VERSION_CURRENT, &v), 0);
    assert_true(v == 1);
    assert_int_equal(expert_block_step(b, &o, NULL), 0); /* version 2: 0 is gone */
    assert_int_equal(expert_block_backward_at(b, ws, NULL, dx, dy, x, 4, 0, &v), 0);
    assert_true(v == 2);
    assert_int_equal(expert_block_backward_at(b, ws, NULL, dx, dy, x, 4, 1, &v), 0);
    assert_true(v == 1);
    expert_workspace_destroy(&ws);
    expert_block_destroy(&b);
    expert_block_destroy(&ref);
}

/* Kept activations, for every kind: a joined forward of two requests
 * (rows 0-2 and 3-6), each request's rows saved, then each backward run
 * from its rows loaded into another workspace, gives the same input
 * gradient and parameter gradients as the recomputing backward, on the
 * version the forward used even after a step; a version the block no
 * longer holds is refused with -ESTALE and changes nothing. */
static void test_backward_from_kept_rows(void **state)
{
    (void)state;
    const struct expert_block_config cfgs[3] = {
        {EXPERT_BLOCK_RESFFN, 8, 8, 16}, {EXPERT_BLOCK_HEAD, 8, 5, 0}, {EXPERT_BLOCK_LINEAR, 6, 8, 0}};
    const size_t want_kept[3] = {8 + 2 + 32, 8 + 2, 0};
    for (int k = 0; k < 3; k++) {
        const struct expert_block_config *c = &cfgs[k];
        expert_block *b = expert_block_create(c, 11), *ref = expert_block_create(c, 11);
        expert_workspace *ws = expert_workspace_create(c, 8), *ws2 = expert_workspace_create(c, 8);
        assert_int_equal(expert_workspace_kept_floats(ws), want_kept[k]);
        size_t kf = expert_workspace_kept_floats(ws), n = expert_block_nparams(b);
        float x[7 * 8], y[7 * 8], y_ref[7 * 8], dy[7 * 8], dx[7 * 8], dx_ref[7 * 8];
        float saved_a[3 * 42 + 1], saved_b[4 * 42 + 1], g[2048], g_ref[2048];
        assert_true(n <= 2048 && kf <= 42);
        fill(x, sizeof x / sizeof x[0], 20 + (unsigned)k);
        fill(dy, sizeof dy / sizeof dy[0], 30 + (unsigned)k);
        uint64_t v = 99, vr = 99;
        assert_int_equal(expert_block_forward_train(b, ws, y, x, 7, &v), 0);
        assert_true(v == 0);
        assert_int_equal(expert_block_forward(ref, ws2, y_ref, x, 7, NULL), 0);
        assert_memory_equal(y, y_ref, (size_t)7 * (size_t)c->out * sizeof(float));
        /* (LINEAR keeps nothing: the calls still check their ranges.) */
        assert_int_equal(expert_workspace_save_rows(ws, 0, 3, saved_a), 0);
        assert_int_equal(expert_workspace_save_rows(ws, 3, 4, saved_b), 0);
        assert_int_equal(expert_workspace_save_rows(ws, 6, 3, saved_a), -EINVAL);
        assert_int_equal(expert_workspace_load_rows(ws2, -1, 3, saved_a), -EINVAL);
        assert_int_equal(expert_workspace_save_rows(NULL, 0, 1, saved_a), -EINVAL);
        assert_int_equal(expert_workspace_save_rows(ws, 0, 1, NULL), -EINVAL);
        assert_int_equal(expert_workspace_load_rows(ws2, 0, 1, NULL), -EINVAL);

        /* A step in between: version 1 is current, 0 still held. */
        struct expert_optim o;
        expert_optim_default_adamw(&o);
        assert_int_equal(expert_block_backward(b, ws, NULL, dy, x, 7, NULL), 0);
        assert_int_equal(expert_block_step(b, &o, NULL), 0);

        /* The second request's backward from its kept rows (at offset 0 of
         * another workspace) vs the reference's recomputing backward on
         * version 0. */
        size_t in = (size_t)c->in, out = (size_t)c->out;
        assert_int_equal(expert_workspace_load_rows(ws2, 0, 4, saved_b), 0);
        assert_int_equal(expert_block_backward_kept(b, ws2, dx, dy + 3 * out, x + 3 * in, 4, 0, &v), 0);
        assert_true(v == 0);
        assert_int_equal(expert_block_backward_at(ref, ws, NULL, dx_ref, dy + 3 * out, x + 3 * in, 4, 0, &vr), 0);
        expert_block_copy_grads(b, g);
        expert_block_copy_grads(ref, g_ref);
        for (size_t i = 0; i < 4 * in; i++)
            assert_true(fabsf(dx[i] - dx_ref[i]) <= 1e-6f + 1e-5f * fabsf(dx_ref[i]));
        for (size_t i = 0; i < n; i++)
            assert_true(fabsf(g[i] - g_ref[i]) <= 1e-6f + 1e-5f * fabsf(g_ref[i]));
        assert_int_equal(expert_block_accumulated(b), 4);

        /* The kept rows are what it reads: request a's rows under request
         * b's inputs give another input gradient (kinds that keep any). */
        if (kf) {
            assert_int_equal(expert_workspace_load_rows(ws2, 0, 3, saved_a), 0);
            assert_int_equal(expert_block_backward_kept(b, ws2, dx, dy + 3 * out, x + 3 * in, 3, 0, NULL), 0);
            size_t differ = 0;
            for (size_t i = 0; i < 3 * in; i++)
                differ += fabsf(dx[i] - dx_ref[i]) > 1e-4f;
            assert_true(differ > 0);
        }

        /* Two more steps: version 0 is gone; the kept rows are refused. */
        assert_int_equal(expert_block_step(b, &o, NULL), 0);
        assert_int_equal(expert_block_backward(b, ws, NULL, dy, x, 7, NULL), 0);
        assert_int_equal(expert_block_step(b, &o, NULL), 0);
        assert_int_equal(expert_workspace_load_rows(ws2, 0, 3, saved_a), 0);
        assert_int_equal(expert_block_backward_kept(b, ws2, dx, dy, x, 3, 0, NULL), -ESTALE);
        assert_int_equal(expert_block_accumulated(b), 0);
        assert_int_equal(expert_block_backward_kept(b, ws2, dx, dy, x, 3, EXPERT_VERSION_CURRENT, NULL),
                         -EINVAL);
        expert_workspace_destroy(&ws);
        expert_workspace_destroy(&ws2);
        expert_block_destroy(&b);
        expert_block_destroy(&ref);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_backward_on_previous_version),
        cmocka_unit_test(test_backward_from_kept_rows),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
