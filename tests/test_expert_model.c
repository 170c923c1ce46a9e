/* tests/test_expert_model.c: the whole fmnist-mlp as the swarm runs it, six
 * stage blocks chained by their API plus the trainer's cross-entropy, learns
 * a synthetic 10-class problem: the loss must fall well below chance level.
 * This is the end-to-end check that stages chain (widths, grads flowing from
 * stage to stage through dinp), that micro-batches accumulate to the target
 * batch, and that the optimizer moves every stage the right way. */
#include "test_expert_util.h"

#include <errno.h>

#include "expert/expert.h"

#define SEED 2024u
#define MB 16          /* micro-batch */
#define TARGET 32      /* samples per optimizer step */
#define STEPS 25

static void make_batch(uint64_t *s, const float *protos, float *x, int32_t *y, int n)
{
    for (int i = 0; i < n; i++) {
        int c = (int)(tx_rng_next(s) % 10);
        y[i] = c;
        for (int j = 0; j < 784; j++)
            x[(size_t)i * 784 + j] = protos[(size_t)c * 784 + j] + 0.8f * tx_uniform(s);
    }
}

static void test_fmnist_mlp_learns(void **state)
{
    (void)state;
    const struct expert_model_spec *m = expert_model_find("fmnist-mlp");
    assert_non_null(m);
    int ns = m->n_stages;
    expert_block *blk[8];
    expert_workspace *ws[8];
    float *act[9], *grad[9];
    act[0] = tx_alloc((size_t)MB * m->n_in);
    grad[0] = NULL;
    for (int i = 0; i < ns; i++) {
        struct expert_block_config c;
        assert_int_equal(expert_model_stage(m, i, &c), 0);
        blk[i] = expert_block_create(&c, expert_stage_seed(SEED, i));
        ws[i] = expert_workspace_create(&c, MB);
        assert_non_null(blk[i]);
        assert_non_null(ws[i]);
        act[i + 1] = tx_alloc((size_t)MB * c.out);
        grad[i + 1] = tx_alloc((size_t)MB * c.out);
    }
    uint64_t s = SEED;
    float *protos = tx_alloc(10 * 784);
    tx_fill(protos, 10 * 784, &s, 1.0f);
    int32_t y[MB];
    float losses[MB], *probs = tx_alloc((size_t)MB * 10);
    struct expert_optim o;
    expert_optim_default_adamw(&o);
    o.target_batch = TARGET;
    double first = 0.0, last = 0.0;
    int stepped = 0;
    for (int it = 0; it < STEPS * (TARGET / MB); it++) {
        make_batch(&s, protos, act[0], y, MB);
        for (int i = 0; i < ns; i++)
            assert_int_equal(expert_block_forward(blk[i], ws[i], act[i + 1], act[i], MB, NULL), 0);
        assert_int_equal(expert_crossentropy_forward(losses, probs, act[ns], y, MB, 10), 0);
        double l = 0;
        for (int i = 0; i < MB; i++)
            l += losses[i];
        l /= MB;
        if (it < 2)
            first += l / 2;
        if (it >= STEPS * (TARGET / MB) - 2)
            last += l / 2;
        /* Summed-loss gradient; the blocks average over TARGET at the step. */
        assert_int_equal(expert_crossentropy_backward(grad[ns], probs, y, 1.0f, MB, 10), 0);
        for (int i = ns - 1; i >= 0; i--)
            assert_int_equal(expert_block_backward(blk[i], ws[i], i ? grad[i] : NULL, grad[i + 1],
                                                   act[i], MB, NULL), 0);
        for (int i = 0; i < ns; i++) {
            int rc = expert_block_maybe_step(blk[i], &o, NULL);
            assert_true(rc == 0 || rc == 1);
            if (i == 0)
                stepped += rc;
        }
    }
    fprintf(stderr, "fmnist-mlp synthetic: loss %.4f -> %.4f over %d steps\n", first, last, stepped);
    assert_int_equal(stepped, STEPS);
    for (int i = 0; i < ns; i++)
        assert_int_equal(expert_block_version(blk[i]), STEPS);
    assert_true(first > 1.5);           /* about ln 10 at init */
    assert_true(last < 0.25 * first);   /* it learned */
    for (int i = 0; i < ns; i++) {
        expert_block_destroy(&blk[i]);
        expert_workspace_destroy(&ws[i]);
        free(act[i + 1]);
        free(grad[i + 1]);
    }
    free(act[0]);
    free(protos);
    free(probs);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fmnist_mlp_learns),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
