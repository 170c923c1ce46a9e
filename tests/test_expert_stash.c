/* Weight stashing: a backward recomputed on the version its forward used
 * (expert_block_backward_at), while the block still holds it. */
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

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_backward_on_previous_version),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
