/* tests/test_expert_optim.c: AdamW and SGD against torch.optim trajectories
 * (tests/ref/gen_optim.py), gradient averaging over accumulated micro-batches,
 * clipping by norm, target-batch stepping, bad configs. */
#include "test_expert_util.h"

#include <errno.h>

#include "expert/blas.h"
#include "expert/block.h"
#include "expert/optim.h"

static void test_torch_trajectories(void **state)
{
    (void)state;
    struct tx_file f;
    tx_file_open(&f, "optim.bin");
    assert_int_equal(tx_file_u32(&f), 1);
    assert_int_equal(tx_file_u32(&f), 200);
    size_t n = tx_file_u32(&f), steps = tx_file_u32(&f);
    float *hp = tx_file_f32(&f, 8);
    float *p0 = tx_file_f32(&f, n), *g = tx_file_f32(&f, steps * n);
    float *want_adamw = tx_file_f32(&f, steps * n), *want_sgd = tx_file_f32(&f, steps * n);
    tx_file_close(&f);

    struct expert_optim a, s;
    expert_optim_default_adamw(&a);
    a.lr = hp[0]; a.beta1 = hp[1]; a.beta2 = hp[2]; a.eps = hp[3]; a.weight_decay = hp[4];
    expert_optim_default_sgd(&s);
    s.lr = hp[5]; s.momentum = hp[6]; s.weight_decay = hp[7];
    assert_int_equal(expert_optim_check(&a), 0);
    assert_int_equal(expert_optim_check(&s), 0);

    float *p = tx_alloc(n), *q = tx_alloc(n), *m = tx_alloc(n), *v = tx_alloc(n), *buf = tx_alloc(n);
    memcpy(p, p0, n * sizeof(float));
    memcpy(q, p0, n * sizeof(float));
    int miss = 0;
    for (size_t t = 0; t < steps; t++) {
        expert_adamw_update(p, p, g + t * n, m, v, n, 1.0f, &a, t + 1);
        expert_sgd_update(q, q, g + t * n, buf, n, 1.0f, &s);
        char what[64];
        snprintf(what, sizeof what, "adamw step %zu", t + 1);
        miss += tx_check(p, want_adamw + t * n, n, 1e-6, 1e-5, what);
        snprintf(what, sizeof what, "sgd step %zu", t + 1);
        miss += tx_check(q, want_sgd + t * n, n, 1e-6, 1e-5, what);
    }
    assert_int_equal(miss, 0);
    free(hp); free(p0); free(g); free(want_adamw); free(want_sgd);
    free(p); free(q); free(m); free(v); free(buf);
}

static void test_check_rejects(void **state)
{
    (void)state;
    struct expert_optim o;
    expert_optim_default_adamw(&o);
    assert_int_equal(expert_optim_check(&o), 0);
    struct expert_optim bad = o;
    bad.kind = 3;
    assert_int_equal(expert_optim_check(&bad), -EINVAL);
    bad = o; bad.lr = NAN;
    assert_int_equal(expert_optim_check(&bad), -EINVAL);
    bad = o; bad.beta1 = 1.0f;
    assert_int_equal(expert_optim_check(&bad), -EINVAL);
    bad = o; bad.eps = 0.0f;
    assert_int_equal(expert_optim_check(&bad), -EINVAL);
    bad = o; bad.target_batch = 0;
    assert_int_equal(expert_optim_check(&bad), -EINVAL);
    bad = o; bad.clip_norm = -1.0f;
    assert_int_equal(expert_optim_check(&bad), -EINVAL);
    expert_optim_default_sgd(&bad);
    bad.momentum = 1.5f;
    assert_int_equal(expert_optim_check(&bad), -EINVAL);
    assert_int_equal(expert_optim_check(NULL), -EINVAL);
}

/* Two blocks from one seed; one sees a batch of 8 in one backward, the other
 * in micro-batches of 3+5. After a step on each, the weights agree: the step
 * averages over accumulated samples. */
static void test_accumulation_matches_full_batch(void **state)
{
    (void)state;
    struct expert_block_config cfg = { EXPERT_BLOCK_RESFFN, 16, 16, 48 };
    expert_block *a = expert_block_create(&cfg, 3), *b = expert_block_create(&cfg, 3);
    expert_workspace *ws = expert_workspace_create(&cfg, 8);
    assert_non_null(a);
    assert_non_null(b);
    assert_non_null(ws);
    uint64_t s = 11;
    float *x = tx_alloc(8 * 16), *dy = tx_alloc(8 * 16), *dx = tx_alloc(8 * 16);
    tx_fill(x, 8 * 16, &s, 1.0f);
    tx_fill(dy, 8 * 16, &s, 1.0f);
    struct expert_optim o;
    expert_optim_default_adamw(&o);
    o.target_batch = 8;
    o.weight_decay = 0.01f;
    for (int round = 0; round < 3; round++) {
        assert_int_equal(expert_block_backward(a, ws, dx, dy, x, 8, NULL), 0);
        assert_int_equal(expert_block_maybe_step(a, &o, NULL), 1);
        assert_int_equal(expert_block_backward(b, ws, dx, dy, x, 3, NULL), 0);
        assert_int_equal(expert_block_maybe_step(b, &o, NULL), 0); /* 3 < 8 */
        assert_int_equal(expert_block_accumulated(b), 3);
        assert_int_equal(expert_block_backward(b, ws, dx, dy + 3 * 16, x + 3 * 16, 5, NULL), 0);
        struct expert_step_info info;
        assert_int_equal(expert_block_maybe_step(b, &o, &info), 1);
        assert_int_equal(info.samples, 8);
        assert_int_equal(info.version, (uint64_t)round + 1);
        assert_true(info.grad_norm > 0.0);
        assert_int_equal(expert_block_accumulated(b), 0);
    }
    assert_int_equal(expert_block_version(a), 3);
    assert_int_equal(expert_block_steps(b), 3);
    struct expert_snapshot sa, sb;
    expert_block_snapshot_acquire(a, &sa);
    expert_block_snapshot_acquire(b, &sb);
    assert_int_equal(sa.version, 3);
    int miss = tx_check(sb.params, sa.params, expert_block_nparams(a), 1e-6, 1e-5, "accumulated");
    expert_block_snapshot_release(a, &sa);
    expert_block_snapshot_release(b, &sb);
    assert_int_equal(miss, 0);
    /* No samples: -EAGAIN, and no version change. Switching optimizer kind
     * after AdamW state exists is refused. */
    assert_int_equal(expert_block_step(a, &o, NULL), -EAGAIN);
    struct expert_optim sgd;
    expert_optim_default_sgd(&sgd);
    assert_int_equal(expert_block_backward(a, ws, dx, dy, x, 2, NULL), 0);
    assert_int_equal(expert_block_step(a, &sgd, NULL), -EINVAL);
    assert_int_equal(expert_block_version(a), 3);
    free(x); free(dy); free(dx);
    expert_workspace_destroy(&ws);
    expert_block_destroy(&a);
    expert_block_destroy(&b);
}

/* SGD with lr 1 and no momentum moves the weights by exactly the (averaged,
 * clipped) gradient, which shows the clipping factor directly. */
static void test_clip_by_norm(void **state)
{
    (void)state;
    struct expert_block_config cfg = { EXPERT_BLOCK_LINEAR, 6, 4, 0 };
    expert_block *b = expert_block_create(&cfg, 9);
    expert_workspace *ws = expert_workspace_create(&cfg, 4);
    size_t np = expert_block_nparams(b);
    uint64_t s = 5;
    float *x = tx_alloc(4 * 6), *dy = tx_alloc(4 * 4), *g = tx_alloc(np);
    float *before = tx_alloc(np);
    tx_fill(x, 24, &s, 3.0f);
    tx_fill(dy, 16, &s, 3.0f);
    struct expert_optim o;
    expert_optim_default_sgd(&o);
    o.lr = 1.0f;
    o.momentum = 0.0f;
    o.target_batch = 1;
    for (int clip = 0; clip < 2; clip++) {
        struct expert_snapshot sn;
        expert_block_snapshot_acquire(b, &sn);
        memcpy(before, sn.params, np * sizeof(float));
        expert_block_snapshot_release(b, &sn);
        assert_int_equal(expert_block_backward(b, ws, NULL, dy, x, 4, NULL), 0);
        expert_block_copy_grads(b, g);
        double norm = sqrt(expert_sqnorm(g, np)) / 4.0;
        o.clip_norm = clip ? (float)(norm * 0.25) : 0.0f;
        struct expert_step_info info;
        assert_int_equal(expert_block_step(b, &o, &info), 0);
        assert_true(fabs(info.grad_norm - norm) <= 1e-5 * norm);
        double want_scale = clip ? 0.25 * norm / (norm + 1e-6) : 1.0;
        expert_block_snapshot_acquire(b, &sn);
        double moved = 0.0;
        for (size_t i = 0; i < np; i++)
            moved += ((double)before[i] - sn.params[i]) * ((double)before[i] - sn.params[i]);
        expert_block_snapshot_release(b, &sn);
        moved = sqrt(moved);
        if (!(fabs(moved - want_scale * norm) <= 1e-4 * norm))
            fprintf(stderr, "clip %d: moved %g want %g\n", clip, moved, want_scale * norm);
        assert_true(fabs(moved - want_scale * norm) <= 1e-4 * norm);
    }
    free(x); free(dy); free(g); free(before);
    expert_workspace_destroy(&ws);
    expert_block_destroy(&b);
}

/* A NaN in a grad_output must not reach the weights: the step refuses,
 * drops the accumulation, and the next clean step works. */
static void test_nonfinite_gradient_refused(void **state)
{
    (void)state;
    struct expert_block_config cfg = { EXPERT_BLOCK_RESFFN, 8, 8, 16 };
    expert_block *b = expert_block_create(&cfg, 4);
    expert_workspace *ws = expert_workspace_create(&cfg, 2);
    size_t np = expert_block_nparams(b);
    float x[16], dy[16], *before = tx_alloc(np);
    uint64_t s = 8;
    tx_fill(x, 16, &s, 1.0f);
    tx_fill(dy, 16, &s, 1.0f);
    struct expert_snapshot sn;
    expert_block_snapshot_acquire(b, &sn);
    memcpy(before, sn.params, np * sizeof(float));
    expert_block_snapshot_release(b, &sn);
    struct expert_optim o;
    expert_optim_default_adamw(&o);
    const float bad[2] = { NAN, INFINITY };
    for (int k = 0; k < 2; k++) {
        float d2[16];
        memcpy(d2, dy, sizeof d2);
        d2[5] = bad[k];
        assert_int_equal(expert_block_backward(b, ws, NULL, dy, x, 2, NULL), 0);
        assert_int_equal(expert_block_backward(b, ws, NULL, d2, x, 2, NULL), 0);
        assert_int_equal(expert_block_step(b, &o, NULL), -ERANGE);
        assert_int_equal(expert_block_accumulated(b), 0);
        assert_int_equal(expert_block_version(b), 0);
        assert_int_equal(expert_block_dropped_steps(b), (uint64_t)k + 1);
    }
    expert_block_snapshot_acquire(b, &sn);
    assert_memory_equal(sn.params, before, np * sizeof(float));
    expert_block_snapshot_release(b, &sn);
    assert_int_equal(expert_block_backward(b, ws, NULL, dy, x, 2, NULL), 0);
    assert_int_equal(expert_block_step(b, &o, NULL), 0);
    assert_int_equal(expert_block_version(b), 1);
    assert_int_equal(expert_block_steps(b), 1);
    free(before);
    expert_workspace_destroy(&ws);
    expert_block_destroy(&b);
}

/* Σ g² against a long-double reference over lengths around the 8-lane
 * split; non-finite values stay non-finite (the step's NaN check). */
static void test_sqnorm(void **state)
{
    (void)state;
    static const size_t lens[] = {0, 1, 7, 8, 9, 15, 17, 1000, 100003};
    float *g = tx_alloc(100003);
    uint64_t s = 99;
    tx_fill(g, 100003, &s, 5.0f);
    for (size_t k = 0; k < sizeof lens / sizeof lens[0]; k++) {
        long double ref = 0.0L;
        for (size_t i = 0; i < lens[k]; i++)
            ref += (long double)g[i] * g[i];
        double got = expert_sqnorm(g, lens[k]);
        if (!(fabsl((long double)got - ref) <= 1e-13L * ref))
            fail_msg("n %zu: %.17g want %.17Lg", lens[k], got, ref);
    }
    g[12345] = NAN;
    assert_true(isnan(expert_sqnorm(g, 100003)));
    g[12345] = INFINITY;
    assert_true(isinf(expert_sqnorm(g, 100003)));
    g[100002] = -INFINITY; /* in the tail after the last full group of 8 */
    g[12345] = 0.0f;
    assert_true(isinf(expert_sqnorm(g, 100003)));
    free(g);
}

/* A step's gradient norm (summed in chunks over the BLAS thread budget) is
 * the same bits for 1 and 2 threads, and matches a plain sum. */
static void test_step_norm_thread_independent(void **state)
{
    (void)state;
    /* 526k parameters: enough work for the pool to split it (2 threads). */
    struct expert_block_config cfg = { EXPERT_BLOCK_RESFFN, 256, 256, 1024 };
    double norms[2];
    for (int t = 0; t < 2; t++) {
        /* The gradients themselves on one thread (BLAS results may differ
         * in the last bits between thread counts); the step on t + 1. */
        expert_blas_set_threads(1);
        expert_block *b = expert_block_create(&cfg, 3);
        expert_workspace *ws = expert_workspace_create(&cfg, 8);
        size_t np = expert_block_nparams(b);
        uint64_t s = 17;
        float *x = tx_alloc(8 * 256), *dy = tx_alloc(8 * 256), *g = tx_alloc(np);
        tx_fill(x, 8 * 256, &s, 1.0f);
        tx_fill(dy, 8 * 256, &s, 1.0f);
        assert_int_equal(expert_block_backward(b, ws, NULL, dy, x, 8, NULL), 0);
        expert_block_copy_grads(b, g);
        long double ref = 0.0L;
        for (size_t i = 0; i < np; i++)
            ref += (long double)g[i] * g[i];
        struct expert_optim o;
        expert_optim_default_adamw(&o);
        struct expert_step_info info;
        expert_blas_set_threads(t + 1);
        assert_int_equal(expert_block_step(b, &o, &info), 0);
        norms[t] = info.grad_norm;
        long double want = sqrtl(ref) / 8.0L;
        if (!(fabsl((long double)info.grad_norm - want) <= 1e-12L * want))
            fail_msg("threads %d: norm %.17g want %.17Lg", t + 1, info.grad_norm, want);
        free(x); free(dy); free(g);
        expert_workspace_destroy(&ws);
        expert_block_destroy(&b);
    }
    expert_blas_set_threads(0);
    assert_memory_equal(&norms[0], &norms[1], sizeof(double));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_torch_trajectories),
        cmocka_unit_test(test_check_rejects),
        cmocka_unit_test(test_accumulation_matches_full_batch),
        cmocka_unit_test(test_clip_by_norm),
        cmocka_unit_test(test_nonfinite_gradient_refused),
        cmocka_unit_test(test_sqnorm),
        cmocka_unit_test(test_step_norm_thread_independent),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
