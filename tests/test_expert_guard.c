/* tests/test_expert_guard.c: gradients and updates are checked against the
 * block's own history (expert/guard.h, expert_block_step).
 *
 * The attack this guards against: one backward whose grad_output is finite
 * but huge (1e30). Without the checks its square overflows AdamW's second
 * moment to +Inf, every later update of the block is m / Inf = 0, and the
 * block is frozen for good while its weight version keeps rising
 * (test_huge_gradient_refused fails that way on a build without them). */
#include "test_expert_util.h"

#include <errno.h>

#include "expert/expert.h"
#include "expert/pool.h"

/* The statistic: warm-up, relative bound, absolute cap, non-finite, and a
 * reference that cannot be talked up fast. */
static void test_guard_statistic(void **state)
{
    (void)state;
    struct expert_guard g = {0};
    struct expert_guard_config c = {0};
    char msg[256];
    /* Warm-up: only the absolute cap applies. */
    for (int i = 0; i < EXPERT_GUARD_WARMUP; i++) {
        double x = i == 0 ? 500.0 : 1.0;
        assert_int_equal(expert_guard_check(&g, &c, x, "gradient", msg, sizeof msg), 0);
        expert_guard_accept(&g, &c, x);
    }
    assert_true(g.ref > 1.0 && g.ref < 30.0); /* the warm-up's mean */
    assert_int_equal(expert_guard_check(&g, &c, 1e30, "gradient", msg, sizeof msg), -ERANGE);
    fprintf(stderr, "  %s\n", msg);
    assert_non_null(strstr(msg, "limit"));
    assert_int_equal(expert_guard_check(&g, &c, NAN, "gradient", msg, sizeof msg), -ERANGE);
    assert_non_null(strstr(msg, "not finite"));
    assert_int_equal(expert_guard_check(&g, &c, INFINITY, "gradient", NULL, 0), -ERANGE);
    /* Relative: settle the reference near 1, then 100x refuses. */
    for (int i = 0; i < 2000; i++)
        expert_guard_accept(&g, &c, 1.0);
    assert_true(fabs(g.ref - 1.0) < 0.01);
    assert_int_equal(expert_guard_check(&g, &c, 99.0, "gradient", msg, sizeof msg), 0);
    assert_int_equal(expert_guard_check(&g, &c, 101.0, "gradient", msg, sizeof msg), -ERANGE);
    fprintf(stderr, "  %s\n", msg);
    assert_non_null(strstr(msg, "recent norm"));
    /* An attacker sending norms just under the bound raises it slowly. */
    struct expert_guard a = g;
    int n = 0;
    while (a.ref < 100.0 && n < 10000) {
        expert_guard_accept(&a, &c, 99.0 * a.ref);
        n++;
    }
    fprintf(stderr, "  raising the reference 100-fold took %d accepted requests\n", n);
    assert_true(n >= 200);
    /* Zeros are accepted but carry no scale. */
    struct expert_guard z = {0};
    for (int i = 0; i < 100; i++)
        expert_guard_accept(&z, &c, 0.0);
    assert_int_equal(z.seen, 0);
    assert_int_equal(expert_guard_check(&z, &c, 3.0, "gradient", msg, sizeof msg), 0);
    /* Bounds off: only non-finite is refused. */
    struct expert_guard_config off = { .factor = -1, .max_norm = -1 };
    assert_int_equal(expert_guard_check(&g, &off, 1e30, "gradient", msg, sizeof msg), 0);
    assert_int_equal(expert_guard_check(&g, &off, NAN, "gradient", msg, sizeof msg), -ERANGE);
    /* Request rows: Σ x², non-finite elements refused. */
    float x[37];
    for (int i = 0; i < 37; i++)
        x[i] = 2.0f;
    double sq;
    assert_int_equal(expert_guard_sqnorm(x, 37, &sq), 0);
    assert_true(fabs(sq - 148.0) < 1e-9);
    x[36] = 3e38f;
    assert_int_equal(expert_guard_sqnorm(x, 37, &sq), 0); /* finite, only huge */
    x[20] = NAN;
    assert_int_equal(expert_guard_sqnorm(x, 37, &sq), -ERANGE);
    x[20] = -INFINITY;
    assert_int_equal(expert_guard_sqnorm(x, 37, &sq), -ERANGE);
}

/* The checked update kernels give the unchecked ones' results bit for bit,
 * and sums that match a double-precision reference; a non-finite moment or
 * weight makes the second sum non-finite. */
static void test_checked_kernels(void **state)
{
    (void)state;
    static const size_t lens[] = {1, 15, 16, 17, 1003};
    uint64_t s = 5;
    for (int kind = 0; kind < 2; kind++)
        for (size_t li = 0; li < sizeof lens / sizeof lens[0]; li++) {
            size_t n = lens[li];
            float *p = tx_alloc(n), *g = tx_alloc(n), *m1 = tx_alloc(n), *v1 = tx_alloc(n), *m2 = tx_alloc(n),
                  *v2 = tx_alloc(n), *o1 = tx_alloc(n), *o2 = tx_alloc(n);
            tx_fill(p, n, &s, 1.0f);
            tx_fill(g, n, &s, 1.0f);
            tx_fill(m1, n, &s, 0.1f);
            for (size_t i = 0; i < n; i++)
                v1[i] = fabsf(tx_uniform(&s)) * 0.01f;
            memcpy(m2, m1, n * sizeof(float));
            memcpy(v2, v1, n * sizeof(float));
            struct expert_optim o;
            if (kind == 0)
                expert_optim_default_adamw(&o);
            else
                expert_optim_default_sgd(&o);
            o.weight_decay = 0.01f;
            double sums[2] = {0, 0};
            if (kind == 0) {
                expert_adamw_update(o1, p, g, m1, v1, n, 0.5f, &o, 3);
                expert_adamw_update_checked(o2, p, g, m2, v2, n, 0.5f, &o, 3, sums);
            } else {
                expert_sgd_update(o1, p, g, m1, n, 0.5f, &o);
                expert_sgd_update_checked(o2, p, g, m2, n, 0.5f, &o, sums);
            }
            assert_memory_equal(o1, o2, n * sizeof(float));
            assert_memory_equal(m1, m2, n * sizeof(float));
            assert_memory_equal(v1, v2, n * sizeof(float));
            double dd = 0, pp = 0;
            for (size_t i = 0; i < n; i++) {
                double d = (double)o1[i] - (double)p[i];
                dd += d * d;
                pp += (double)o1[i] * (double)o1[i];
            }
            assert_true(fabs(sums[0] - dd) <= 1e-5 * dd + 1e-30);
            assert_true(fabs(sums[1] - pp) <= 1e-5 * pp);
            /* An overflowing moment shows. */
            g[n / 2] = 3e38f;
            sums[0] = sums[1] = 0;
            if (kind == 0)
                expert_adamw_update_checked(o2, p, g, m2, v2, n, 1.0f, &o, 4, sums);
            else
                expert_sgd_update_checked(o2, p, g, m2, n, 1e30f, &o, sums);
            assert_false(isfinite(sums[0]) && isfinite(sums[1]));
            free(p), free(g), free(m1), free(v1), free(m2), free(v2), free(o1), free(o2);
        }
}

/* A small ResFFN, its inputs, a probe batch and the optimizer. */
typedef struct rig {
    struct expert_block_config cfg;
    expert_block *b;
    expert_workspace *ws;
    float x[8 * 16], dy[8 * 16], probe[8 * 16], out[8 * 16], prev[8 * 16];
    struct expert_optim o;
    uint64_t s;
} rig;

static void rig_init(rig *r, uint64_t seed)
{
    memset(r, 0, sizeof *r);
    r->cfg = (struct expert_block_config){ EXPERT_BLOCK_RESFFN, 16, 16, 32 };
    r->b = expert_block_create(&r->cfg, seed);
    r->ws = expert_workspace_create(&r->cfg, 8);
    assert_non_null(r->b);
    assert_non_null(r->ws);
    r->s = seed;
    tx_fill(r->probe, 8 * 16, &r->s, 1.0f);
    expert_optim_default_adamw(&r->o);
    r->o.target_batch = 8;
}

static void rig_free(rig *r)
{
    expert_workspace_destroy(&r->ws);
    expert_block_destroy(&r->b);
}

/* One honest backward of 8 rows (gradients of the scale a summed
 * cross-entropy gives) and a step. */
static int honest_step(rig *r, float dscale)
{
    tx_fill(r->x, 8 * 16, &r->s, 1.0f);
    tx_fill(r->dy, 8 * 16, &r->s, 0.3f * dscale);
    assert_int_equal(expert_block_backward(r->b, r->ws, NULL, r->dy, r->x, 8, NULL), 0);
    return expert_block_step(r->b, &r->o, NULL);
}

/* max |block(probe) now - before|, and remembers now. */
static double probe_moved(rig *r)
{
    assert_int_equal(expert_block_forward(r->b, r->ws, r->out, r->probe, 8, NULL), 0);
    double d = 0;
    for (int i = 0; i < 8 * 16; i++)
        d = fmax(d, fabs((double)r->out[i] - (double)r->prev[i]));
    memcpy(r->prev, r->out, sizeof r->prev);
    return d;
}

/* The finding of issue 18: after one 1e30 backward, later honest steps
 * must still change the block's outputs. With the checks, that step is
 * refused (weights, version unchanged, a sentence saying why) and
 * training goes on; without them the block froze. */
static void test_huge_gradient_refused(void **state)
{
    (void)state;
    rig r;
    rig_init(&r, 11);
    for (int i = 0; i < 30; i++)
        assert_int_equal(honest_step(&r, 1.0f), 0);
    probe_moved(&r);
    uint64_t v0 = expert_block_version(r.b);

    tx_fill(r.x, 8 * 16, &r.s, 1.0f);
    for (int i = 0; i < 8 * 16; i++)
        r.dy[i] = 1e30f;
    assert_int_equal(expert_block_backward(r.b, r.ws, NULL, r.dy, r.x, 8, NULL), 0);
    int rc = expert_block_step(r.b, &r.o, NULL);
    struct expert_block_health h;
    expert_block_health(r.b, &h);
    fprintf(stderr, "  1e30 step: %d (%s)\n", rc, h.last_refusal);
    assert_int_equal(rc, -ERANGE);
    assert_int_equal(expert_block_version(r.b), v0);
    assert_true(probe_moved(&r) == 0.0);
    assert_int_equal(h.refused_steps, 1);
    assert_non_null(strstr(h.last_refusal, "refused"));

    for (int i = 0; i < 10; i++) {
        assert_int_equal(honest_step(&r, 1.0f), 0);
        double d = probe_moved(&r);
        if (!(d > 1e-6))
            fprintf(stderr, "  honest step %d after the 1e30 backward moved the outputs by %g\n", i, d);
        assert_true(d > 1e-6);
    }
    expert_block_health(r.b, &h);
    assert_int_equal(h.still_steps, 0);
    assert_int_equal(h.frozen, 0);
    assert_true(h.last_change > 1e-6);
    rig_free(&r);
}

/* NaN and Inf gradients are refused; so is an averaged gradient 100x the
 * block's recent norm once it has a history. */
static void test_bad_gradients_refused(void **state)
{
    (void)state;
    rig r;
    rig_init(&r, 12);
    for (int i = 0; i < EXPERT_GUARD_WARMUP + 5; i++)
        assert_int_equal(honest_step(&r, 1.0f), 0);
    const float bad[2] = { NAN, INFINITY };
    for (int k = 0; k < 2; k++) {
        tx_fill(r.x, 8 * 16, &r.s, 1.0f);
        tx_fill(r.dy, 8 * 16, &r.s, 0.3f);
        r.dy[7] = bad[k];
        assert_int_equal(expert_block_backward(r.b, r.ws, NULL, r.dy, r.x, 8, NULL), 0);
        assert_int_equal(expert_block_step(r.b, &r.o, NULL), -ERANGE);
    }
    uint64_t v0 = expert_block_version(r.b);
    assert_int_equal(honest_step(&r, 1000.0f), -ERANGE); /* 1000x the usual */
    struct expert_block_health h;
    expert_block_health(r.b, &h);
    fprintf(stderr, "  %s\n", h.last_refusal);
    assert_non_null(strstr(h.last_refusal, "recent norm"));
    assert_int_equal(h.refused_steps, 3);
    assert_int_equal(expert_block_version(r.b), v0);
    assert_int_equal(honest_step(&r, 3.0f), 0);            /* a few times the usual is fine */
    assert_int_equal(expert_block_version(r.b), v0 + 1);
    rig_free(&r);
}

/* With the bounds off, a 1e30 gradient passes the gradient check, but the
 * update check still catches the overflowed moments: the step is rolled
 * back (weights and version unchanged), the moments restart from zero, and
 * the next honest steps move the weights. */
static void test_nonfinite_update_rolled_back(void **state)
{
    (void)state;
    rig r;
    rig_init(&r, 13);
    struct expert_guard_config off = { .factor = -1, .max_norm = -1 };
    assert_int_equal(expert_block_set_guard(r.b, &off), 0);
    for (int i = 0; i < 5; i++)
        assert_int_equal(honest_step(&r, 1.0f), 0);
    probe_moved(&r);
    uint64_t v0 = expert_block_version(r.b);
    /* The spare slot holds the version before; a backward naming it must
     * not see the discarded update after the rollback. */
    tx_fill(r.x, 8 * 16, &r.s, 1.0f);
    for (int i = 0; i < 8 * 16; i++)
        r.dy[i] = 1e30f;
    assert_int_equal(expert_block_backward(r.b, r.ws, NULL, r.dy, r.x, 8, NULL), 0);
    assert_int_equal(expert_block_step(r.b, &r.o, NULL), -ERANGE);
    struct expert_block_health h;
    expert_block_health(r.b, &h);
    fprintf(stderr, "  %s\n", h.last_refusal);
    assert_non_null(strstr(h.last_refusal, "rolled back"));
    assert_int_equal(expert_block_version(r.b), v0);
    assert_true(probe_moved(&r) == 0.0);
    uint64_t used = 0;
    float gx[8 * 16];
    assert_int_equal(expert_block_backward_at(r.b, r.ws, NULL, gx, r.dy, r.x, 8, v0 - 1, &used), 0);
    assert_int_equal(used, v0); /* not the discarded slot */
    expert_block_zero_grad(r.b);
    /* Every weight and moment is finite. */
    size_t nf = expert_block_flat_len(r.b);
    float *flat = tx_alloc(nf);
    assert_int_equal(expert_block_flat_export(r.b, flat), 0);
    for (size_t i = 0; i < nf; i++)
        assert_true(isfinite(flat[i]));
    free(flat);
    for (int i = 0; i < 5; i++) {
        assert_int_equal(honest_step(&r, 1.0f), 0);
        assert_true(probe_moved(&r) > 1e-6);
    }
    rig_free(&r);
}

/* A block whose steps apply gradients but change no weight is reported
 * frozen after frozen_steps steps. With the bounds off, a finite gradient
 * of 1e15 leaves AdamW's v at ~1e27: once the huge first moment has
 * decayed (about a hundred steps), every later update is far below a
 * weight's last bit. */
static void test_frozen_detected(void **state)
{
    (void)state;
    rig r;
    rig_init(&r, 14);
    struct expert_guard_config off = { .factor = -1, .max_norm = -1, .frozen_steps = 5 };
    assert_int_equal(expert_block_set_guard(r.b, &off), 0);
    for (int i = 0; i < 3; i++)
        assert_int_equal(honest_step(&r, 1.0f), 0);
    probe_moved(&r);
    assert_int_equal(honest_step(&r, 1.0f), 0);
    double normal = probe_moved(&r); /* what an honest step changes */
    assert_int_equal(honest_step(&r, 1e15f), 0);
    struct expert_block_health h;
    int at = -1;
    for (int i = 0; i < 400 && at < 0; i++) {
        assert_int_equal(honest_step(&r, 1.0f), 0);
        expert_block_health(r.b, &h);
        if (h.frozen)
            at = i;
        if (h.still_steps == 1)
            probe_moved(&r);
    }
    fprintf(stderr, "  frozen after %d honest steps: still %llu steps, last change %g\n", at + 1,
            (unsigned long long)h.still_steps, h.last_change);
    assert_true(at >= 0);
    assert_int_equal(h.still_steps, 5);
    /* The outputs indeed stopped changing (only weights near 0, whose
     * last bit is tiny, still move). */
    double d = probe_moved(&r);
    fprintf(stderr, "  outputs moved %g over the frozen steps; an honest step moves them %g\n", d, normal);
    assert_true(d < 1e-4 * normal);
    uint64_t v = expert_block_version(r.b);
    assert_int_equal(honest_step(&r, 1.0f), 0);
    assert_int_equal(expert_block_version(r.b), v + 1); /* the version still rises */
    expert_block_health(r.b, &h);
    assert_int_equal(h.still_steps, 6);
    rig_free(&r);

    /* With the default bounds the same gradient is refused outright. */
    rig_init(&r, 14);
    for (int i = 0; i < 3; i++)
        assert_int_equal(honest_step(&r, 1.0f), 0);
    assert_int_equal(honest_step(&r, 1e15f), -ERANGE);
    for (int i = 0; i < 6; i++)
        assert_int_equal(honest_step(&r, 1.0f), 0);
    expert_block_health(r.b, &h);
    assert_int_equal(h.still_steps, 0);
    assert_int_equal(h.frozen, 0);
    /* lr 0 moves nothing, and is not "frozen": nothing was asked to move. */
    r.o.lr = 0.0f;
    for (int i = 0; i < 10; i++)
        assert_int_equal(honest_step(&r, 1.0f), 0);
    expert_block_health(r.b, &h);
    assert_int_equal(h.still_steps, 0);
    rig_free(&r);
}

/* No false positives: the six fmnist-mlp stages, chained as the swarm
 * chains them, train a synthetic 10-class task with inputs at the scale of
 * normalised Fashion-MNIST, from the first steps (where norms are largest)
 * for 300 steps. Every request passes the per-request checks the peer
 * makes (service.c: per-sample norms of inputs and grad_outputs), and no
 * step is refused or frozen. The largest ratio to the reference seen is
 * printed, to show the margin. */
#define FM_MB 16
#define FM_STEPS 300

static void make_batch(uint64_t *s, const float *protos, float *x, int32_t *y, int n)
{
    for (int i = 0; i < n; i++) {
        int c = (int)(tx_rng_next(s) % 10);
        y[i] = c;
        for (int j = 0; j < 784; j++)
            x[(size_t)i * 784 + j] = protos[(size_t)c * 784 + j] + 0.8f * tx_uniform(s);
    }
}

static void test_no_false_positives(void **state)
{
    (void)state;
    const struct expert_model_spec *m = expert_model_find("fmnist-mlp");
    assert_non_null(m);
    int ns = m->n_stages;
    expert_block *blk[8];
    expert_workspace *ws[8];
    float *act[9], *grad[9];
    struct expert_guard rin[8] = {{0}}, rgo[8] = {{0}};
    struct expert_guard_config gc = {0};
    double worst_in = 0, worst_go = 0, max_in = 0, max_go = 0, worst_step = 0, max_step = 0;
    act[0] = tx_alloc((size_t)FM_MB * m->n_in);
    grad[0] = NULL;
    for (int i = 0; i < ns; i++) {
        struct expert_block_config c;
        assert_int_equal(expert_model_stage(m, i, &c), 0);
        blk[i] = expert_block_create(&c, expert_stage_seed(7, i));
        ws[i] = expert_workspace_create(&c, FM_MB);
        act[i + 1] = tx_alloc((size_t)FM_MB * c.out);
        grad[i + 1] = tx_alloc((size_t)FM_MB * c.out);
    }
    uint64_t s = 7;
    float *protos = tx_alloc(10 * 784);
    tx_fill(protos, 10 * 784, &s, 1.0f);
    int32_t y[FM_MB];
    float losses[FM_MB], *probs = tx_alloc((size_t)FM_MB * 10);
    struct expert_optim o;
    expert_optim_default_adamw(&o);
    o.target_batch = FM_MB;
    char msg[256];
    double first = 0, last = 0;
    for (int it = 0; it < FM_STEPS; it++) {
        make_batch(&s, protos, act[0], y, FM_MB);
        for (int i = 0; i < ns; i++)
            assert_int_equal(expert_block_forward(blk[i], ws[i], act[i + 1], act[i], FM_MB, NULL), 0);
        assert_int_equal(expert_crossentropy_forward(losses, probs, act[ns], y, FM_MB, 10), 0);
        double l = 0;
        for (int i = 0; i < FM_MB; i++)
            l += losses[i] / FM_MB;
        if (it == 0)
            first = l;
        last = l;
        assert_int_equal(expert_crossentropy_backward(grad[ns], probs, y, 1.0f, FM_MB, 10), 0);
        for (int i = ns - 1; i >= 0; i--) {
            const struct expert_block_config *c = expert_block_config(blk[i]);
            double sqi, sqg;
            assert_int_equal(expert_guard_sqnorm(act[i], (size_t)FM_MB * c->in, &sqi), 0);
            assert_int_equal(expert_guard_sqnorm(grad[i + 1], (size_t)FM_MB * c->out, &sqg), 0);
            double ni = sqrt(sqi / FM_MB), ng = sqrt(sqg / FM_MB);
            if (rin[i].seen >= EXPERT_GUARD_WARMUP)
                worst_in = fmax(worst_in, ni / rin[i].ref);
            if (rgo[i].seen >= EXPERT_GUARD_WARMUP)
                worst_go = fmax(worst_go, ng / rgo[i].ref);
            max_in = fmax(max_in, ni);
            max_go = fmax(max_go, ng);
            if (expert_guard_check(&rin[i], &gc, ni, "input", msg, sizeof msg) != 0 ||
                expert_guard_check(&rgo[i], &gc, ng, "grad_output", msg, sizeof msg) != 0)
                fail_msg("stage %d step %d: %s", i, it, msg);
            expert_guard_accept(&rin[i], &gc, ni);
            expert_guard_accept(&rgo[i], &gc, ng);
            assert_int_equal(expert_block_backward(blk[i], ws[i], i ? grad[i] : NULL, grad[i + 1], act[i],
                                                   FM_MB, NULL), 0);
        }
        for (int i = 0; i < ns; i++) {
            struct expert_step_info info;
            struct expert_block_health h;
            expert_block_health(blk[i], &h);
            double ref = h.grad_ref;
            int rc = expert_block_maybe_step(blk[i], &o, &info);
            if (rc != 1) {
                expert_block_health(blk[i], &h);
                fail_msg("stage %d step %d: %d (%s)", i, it, rc, h.last_refusal);
            }
            if (it >= EXPERT_GUARD_WARMUP)
                worst_step = fmax(worst_step, info.grad_norm / ref);
            max_step = fmax(max_step, info.grad_norm);
        }
    }
    double max_change = 0, min_change = 1;
    for (int i = 0; i < ns; i++) {
        struct expert_block_health h;
        expert_block_health(blk[i], &h);
        assert_int_equal(h.refused_steps, 0);
        assert_int_equal(h.still_steps, 0);
        assert_int_equal(h.frozen, 0);
        max_change = fmax(max_change, h.last_change);
        min_change = fmin(min_change, h.last_change);
        assert_int_equal(expert_block_version(blk[i]), FM_STEPS);
    }
    fprintf(stderr,
            "  fmnist-mlp, %d steps of %d: loss %.3f -> %.3f; largest per-sample norm input %.3g, "
            "grad_output %.3g; worst ratio to the reference after warm-up: input %.2fx, grad_output "
            "%.2fx, step gradient %.2fx (limit %gx); largest step gradient norm %.3g (cap %g); last "
            "relative change %.2g..%.2g\n",
            FM_STEPS, FM_MB, first, last, max_in, max_go, worst_in, worst_go, worst_step, EXPERT_GUARD_FACTOR,
            max_step, EXPERT_GUARD_MAX_NORM, min_change, max_change);
    assert_true(last < first);
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

/* The step's checks sum what each part of the update did; with the most
 * threads the pool allows, expert__parallel splits the step into
 * EXPERT__POOL_MAX_PARTS parts (two per thread) and every one must be
 * counted (a per-thread array overflowed here with 9 or more threads:
 * ASan's stack-buffer-overflow; the sanitizer build runs this). Honest
 * steps pass and move the weights; a 1e30 gradient is still rolled back. */
static void test_many_threads(void **state)
{
    (void)state;
    int before = expert_blas_threads();
    assert_int_equal(expert_blas_set_threads(EXPERT__POOL_MAX), EXPERT__POOL_MAX);
    struct expert_block_config cfg = { EXPERT_BLOCK_RESFFN, 128, 128, 512 };
    expert_block *b = expert_block_create(&cfg, 5);
    expert_workspace *ws = expert_workspace_create(&cfg, 8);
    assert_non_null(b);
    assert_non_null(ws);
    struct expert_guard_config off = { .factor = -1, .max_norm = -1 };
    assert_int_equal(expert_block_set_guard(b, &off), 0);
    struct expert_optim o;
    expert_optim_default_adamw(&o);
    o.target_batch = 8;
    float x[8 * 128], dy[8 * 128];
    uint64_t s = 3;
    for (int i = 0; i < 3; i++) {
        tx_fill(x, 8 * 128, &s, 1.0f);
        tx_fill(dy, 8 * 128, &s, 0.3f);
        assert_int_equal(expert_block_backward(b, ws, NULL, dy, x, 8, NULL), 0);
        assert_int_equal(expert_block_step(b, &o, NULL), 0);
    }
    uint64_t v0 = expert_block_version(b);
    for (int i = 0; i < 8 * 128; i++)
        dy[i] = 1e30f;
    assert_int_equal(expert_block_backward(b, ws, NULL, dy, x, 8, NULL), 0);
    assert_int_equal(expert_block_step(b, &o, NULL), -ERANGE);
    assert_int_equal(expert_block_version(b), v0);
    expert_workspace_destroy(&ws);
    expert_block_destroy(&b);
    expert_blas_set_threads(before);
}

/* A sender cannot talk the reference down quickly (each tiny norm counts
 * for at least ref / FALL) nor below the floor: 228 tiny requests, which locked honest ones
 * out before, leave an honest norm accepted; and after a long stream of
 * them, the honest norms the bound refuses lift it back (observe) within a
 * bounded number of requests instead of being locked out for good. */
static void test_reference_talked_down(void **state)
{
    (void)state;
    struct expert_guard g = {0};
    struct expert_guard_config c = {0};
    char why[160];
    for (int i = 0; i < 20; i++)
        expert_guard_observe(&g, &c, 1.0);
    for (int i = 0; i < 228; i++) {
        assert_int_equal(expert_guard_check(&g, &c, 1e-30, "tiny", why, sizeof why), 0);
        expert_guard_observe(&g, &c, 1e-30);
    }
    assert_int_equal(expert_guard_check(&g, &c, 1.0, "honest", why, sizeof why), 0);
    for (int i = 0; i < 2000; i++)
        expert_guard_observe(&g, &c, 1e-30);
    assert_int_equal(expert_guard_check(&g, &c, 1.0, "honest", why, sizeof why), -ERANGE);
    int refused = 0;
    for (int i = 0; i < 1000 && expert_guard_check(&g, &c, 1.0, "honest", why, sizeof why) != 0; i++) {
        refused++;
        expert_guard_observe(&g, &c, 1.0);
    }
    fprintf(stderr, "  after 2228 tiny norms, %d honest requests were refused before one passed\n", refused);
    assert_true(refused >= 1 && refused <= 150);
    /* Non-finite and over-the-cap norms are never observed. */
    double ref = g.ref;
    expert_guard_observe(&g, &c, NAN);
    expert_guard_observe(&g, &c, 1e30);
    assert_true(g.ref == ref);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_guard_statistic),
        cmocka_unit_test(test_checked_kernels),
        cmocka_unit_test(test_huge_gradient_refused),
        cmocka_unit_test(test_bad_gradients_refused),
        cmocka_unit_test(test_nonfinite_update_rolled_back),
        cmocka_unit_test(test_many_threads),
        cmocka_unit_test(test_reference_talked_down),
        cmocka_unit_test(test_frozen_detected),
        cmocka_unit_test(test_no_false_positives),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
