/* tests/test_backend_kinds.c: every block kind on a backend other than the
 * CPU, against the same block on the CPU: forward, backward (recomputing
 * and from kept rows), one AdamW step, snapshots of the state moved
 * between the two (checkpoint bytes, flat export and apply), ten training
 * steps of tiny-lm end to end, and a budget a block does not fit.
 *
 * Backends: the simulated device always (the CPU's math behind memory the
 * host cannot touch: results must be bit for bit the CPU's, and any place
 * the block runtime reads device memory directly crashes), and CUDA in
 * fp32 and bf16 when this build has CUDA and the machine a GPU.
 *
 * Tolerances, per tensor: exact on the simulated device; CUDA fp32 within
 * 1e-4 of the tensor's largest magnitude (other kernels, other summation
 * orders); CUDA bf16 llm.c's test_gpt2.cu rule, |got - want| <= 0.079·|want|
 * plus a floor of 5 % of the tensor's largest magnitude (bf16 keeps 8
 * significant bits; products of K terms lose about sqrt(K) ulps). The
 * ten-step losses: 1e-4 (fp32) and 2e-2 (bf16) relative. */
#include <errno.h>
#include <math.h>
#include <string.h>

#include "config.h"
#include "cuda/cuda.h"
#include "expert/backend.h"
#include "expert/block.h"
#include "expert/model.h"
#include "expert/ops.h"
#include "test_expert_util.h"

enum { TOL_EXACT, TOL_FP32, TOL_BF16 };

struct target {
    const char *name;
    const expert_backend *be;
    int tol;
};

/* Compares a tensor; returns the misses (printed). */
static int cmp(const struct target *tg, const char *what, const float *got, const float *want, size_t n)
{
    if (tg->tol == TOL_EXACT) {
        int miss = 0;
        for (size_t i = 0; i < n; i++)
            if (memcmp(&got[i], &want[i], sizeof(float)) != 0) {
                if (miss < 5)
                    fprintf(stderr, "  %s %s[%zu]: got %.9g want %.9g (not bit-identical)\n", tg->name,
                            what, i, (double)got[i], (double)want[i]);
                miss++;
            }
        if (miss)
            fprintf(stderr, "%s %s: %d/%zu elements differ\n", tg->name, what, miss, n);
        return miss;
    }
    double scale = 0.0;
    for (size_t i = 0; i < n; i++)
        if (fabs((double)want[i]) > scale)
            scale = fabs((double)want[i]);
    char label[96];
    snprintf(label, sizeof label, "%s %s", tg->name, what);
    if (tg->tol == TOL_FP32)
        return tx_check(got, want, n, 1e-4 * scale + 1e-30, 0.0, label);
    return tx_check(got, want, n, 0.05 * scale + 1e-30, 0.079, label);
}

/* The configs, small but with every path: odd widths, several heads, a
 * context that is no multiple of a tile. */
static const struct expert_block_config cfgs[] = {
    { .kind = EXPERT_BLOCK_LINEAR, .in = 37, .out = 23 },
    { .kind = EXPERT_BLOCK_RESFFN, .in = 48, .out = 48, .hidden = 80 },
    { .kind = EXPERT_BLOCK_HEAD, .in = 48, .out = 10 },
    { .kind = EXPERT_BLOCK_EMBED, .in = 19, .out = 19 * 32, .hidden = 64, .dim = 32, .heads = 4,
      .seq = 19, .layers = 1, .vocab = 50 },
    { .kind = EXPERT_BLOCK_EMBED, .in = 19, .out = 19 * 32, .hidden = 64, .dim = 32, .heads = 4,
      .seq = 19, .layers = 0, .vocab = 50 },
    { .kind = EXPERT_BLOCK_DECODER, .in = 19 * 32, .out = 19 * 32, .hidden = 64, .dim = 32, .heads = 4,
      .seq = 19, .layers = 2 },
    { .kind = EXPERT_BLOCK_LMHEAD, .in = 19 * 32, .out = 19 * 50, .hidden = 64, .dim = 32, .heads = 2,
      .seq = 19, .layers = 1, .vocab = 50 },
    { .kind = EXPERT_BLOCK_LMHEAD, .in = 19 * 32, .out = 19 * 50, .hidden = 64, .dim = 32, .heads = 2,
      .seq = 19, .layers = 0, .vocab = 50 },
};
#define NCFG (sizeof cfgs / sizeof cfgs[0])
#define B 3

static void fill_input(const struct expert_block_config *c, float *x, size_t n, uint64_t *s)
{
    if (c->kind == EXPERT_BLOCK_EMBED)
        for (size_t i = 0; i < n; i++)
            x[i] = (float)(tx_rng_next(s) % (uint64_t)c->vocab);
    else
        tx_fill(x, n, s, 1.0f);
}

/* One config on one target: returns the misses. */
static int check_kind(const struct target *tg, const struct expert_block_config *c)
{
    const expert_backend *be = tg->be;
    const char *kind = expert_block_kind_name(c->kind);
    int miss = 0;
    expert_block *ref = expert_block_create(c, 77), *dut = expert_block_create_on(c, 77, be);
    expert_workspace *wr = expert_workspace_create(c, B), *wd = expert_workspace_create_on(c, B, be);
    assert_non_null(ref);
    assert_non_null(dut);
    assert_non_null(wr);
    assert_non_null(wd);
    assert_ptr_equal(expert_block_backend(dut), be);
    /* A workspace of another backend is refused. */
    float dummy[1];
    assert_int_equal(expert_block_forward(dut, wr, dummy, dummy, 1, NULL), -EINVAL);

    size_t np = expert_block_nparams(ref), nin = (size_t)B * c->in, nout = (size_t)B * c->out;
    float *x = tx_alloc(nin), *dy = tx_alloc(nout);
    float *y0 = tx_alloc(nout), *y1 = tx_alloc(nout), *g0 = tx_alloc(nin), *g1 = tx_alloc(nin);
    float *p0 = tx_alloc(np), *p1 = tx_alloc(np);
    float *f0 = tx_alloc(3 * np), *f1 = tx_alloc(3 * np);
    uint64_t s = 1000 + (uint64_t)c->kind;
    fill_input(c, x, nin, &s);
    tx_fill(dy, nout, &s, 1.0f);
    char what[64];

    /* The same first weights. */
    assert_int_equal(expert_block_read_params(ref, p0, NULL), 0);
    assert_int_equal(expert_block_read_params(dut, p1, NULL), 0);
    snprintf(what, sizeof what, "%s initial weights", kind);
    miss += cmp(&(struct target){ tg->name, be, TOL_EXACT }, what, p1, p0, np);

    /* Forward. */
    memset(y1, 0xff, nout * sizeof *y1);
    assert_int_equal(expert_block_forward(ref, wr, y0, x, B, NULL), 0);
    assert_int_equal(expert_block_forward(dut, wd, y1, x, B, NULL), 0);
    snprintf(what, sizeof what, "%s forward", kind);
    miss += cmp(tg, what, y1, y0, nout);

    /* Forward and backward (recomputing). */
    memset(y1, 0xff, nout * sizeof *y1);
    memset(g1, 0xff, nin * sizeof *g1);
    assert_int_equal(expert_block_forward_backward(ref, wr, y0, g0, dy, x, B, NULL), 0);
    assert_int_equal(expert_block_forward_backward(dut, wd, y1, g1, dy, x, B, NULL), 0);
    snprintf(what, sizeof what, "%s forward of backward", kind);
    miss += cmp(tg, what, y1, y0, nout);
    snprintf(what, sizeof what, "%s input gradient", kind);
    miss += cmp(tg, what, g1, g0, nin);
    assert_int_equal(expert_block_copy_grads(ref, p0), 0);
    assert_int_equal(expert_block_copy_grads(dut, p1), 0);
    snprintf(what, sizeof what, "%s parameter gradients", kind);
    miss += cmp(tg, what, p1, p0, np);

    /* From kept rows: a forward that keeps, its rows saved into device
     * memory, the workspace scribbled over by another forward, the rows
     * loaded back, the backward from them. */
    size_t kf = expert_workspace_kept_floats(wd);
    assert_int_equal(kf, expert_kept_floats(c, be));
    if (kf > 0) {
        uint64_t v0 = 0, v1 = 0;
        float *kept_h = tx_alloc(kf * B);
        float *kept_d = expert_backend_alloc(be, kf * B * sizeof(float));
        assert_non_null(kept_d);
        assert_int_equal(expert_block_forward_train(ref, wr, y0, x, B, &v0), 0);
        assert_int_equal(expert_workspace_save_rows(wr, 0, B, kept_h), 0);
        assert_int_equal(expert_block_forward_train(dut, wd, y1, x, B, &v1), 0);
        assert_int_equal(expert_workspace_save_rows(wd, 0, B, kept_d), 0);
        float *x2 = tx_alloc(nin);
        fill_input(c, x2, nin, &s);
        assert_int_equal(expert_block_forward(dut, wd, y1, x2, B, NULL), 0);
        assert_int_equal(expert_block_forward(ref, wr, y0, x2, B, NULL), 0);
        assert_int_equal(expert_workspace_load_rows(wr, 0, B, kept_h), 0);
        assert_int_equal(expert_workspace_load_rows(wd, 0, B, kept_d), 0);
        memset(g1, 0xff, nin * sizeof *g1);
        assert_int_equal(expert_block_backward_kept(ref, wr, g0, dy, x, B, v0, NULL), 0);
        assert_int_equal(expert_block_backward_kept(dut, wd, g1, dy, x, B, v1, NULL), 0);
        snprintf(what, sizeof what, "%s input gradient from kept rows", kind);
        miss += cmp(tg, what, g1, g0, nin);
        expert_backend_free(be, kept_d);
        free(kept_h);
        free(x2);
    } else {
        /* Nothing to keep: the backward recomputes. */
        assert_int_equal(expert_block_backward(ref, wr, g0, dy, x, B, NULL), 0);
        assert_int_equal(expert_block_backward(dut, wd, g1, dy, x, B, NULL), 0);
    }
    assert_int_equal(expert_block_copy_grads(ref, p0), 0);
    assert_int_equal(expert_block_copy_grads(dut, p1), 0);
    snprintf(what, sizeof what, "%s accumulated gradients", kind);
    miss += cmp(tg, what, p1, p0, np);

    /* One AdamW step on the accumulated gradients, then the weights and
     * both moments. */
    struct expert_optim o;
    expert_optim_default_adamw(&o);
    o.weight_decay = 0.01f;
    struct expert_step_info i0, i1;
    assert_int_equal(expert_block_step(ref, &o, &i0), 0);
    assert_int_equal(expert_block_step(dut, &o, &i1), 0);
    assert_int_equal(i0.samples, i1.samples);
    assert_true(fabs(i0.grad_norm - i1.grad_norm) <= 1e-3 * i0.grad_norm + 1e-12 ||
                tg->tol == TOL_BF16);
    assert_int_equal(expert_block_flat_export(ref, f0), 0);
    assert_int_equal(expert_block_flat_export(dut, f1), 0);
    snprintf(what, sizeof what, "%s weights after a step", kind);
    miss += cmp(tg, what, f1, f0, np);
    snprintf(what, sizeof what, "%s AdamW m", kind);
    miss += cmp(tg, what, f1 + np, f0 + np, np);
    snprintf(what, sizeof what, "%s AdamW v", kind);
    miss += cmp(tg, what, f1 + 2 * np, f0 + 2 * np, np);
    assert_int_equal(expert_block_accumulated(dut), 0);

    /* The device's state through checkpoint bytes into a CPU block, which
     * must hold it exactly, and back onto the device. */
    size_t len = expert_block_serialized_size(dut, 1);
    void *buf = malloc(len);
    assert_non_null(buf);
    assert_int_equal(expert_block_serialize(dut, 1, buf, len), (long)len);
    expert_block *cpu = expert_block_create(c, 1);
    assert_int_equal(expert_block_deserialize(cpu, buf, len), 0);
    assert_int_equal(expert_block_flat_export(cpu, f0), 0);
    snprintf(what, sizeof what, "%s state device -> cpu", kind);
    miss += cmp(&(struct target){ tg->name, be, TOL_EXACT }, what, f0, f1, 3 * np);
    expert_block *dev2 = expert_block_create_on(c, 2, be);
    assert_non_null(dev2);
    assert_int_equal(expert_block_serialize(cpu, 1, buf, len), (long)len);
    assert_int_equal(expert_block_deserialize(dev2, buf, len), 0);
    assert_int_equal(expert_block_flat_export(dev2, f0), 0);
    snprintf(what, sizeof what, "%s state cpu -> device", kind);
    miss += cmp(&(struct target){ tg->name, be, TOL_EXACT }, what, f0, f1, 3 * np);
    assert_int_equal(expert_block_version(dev2), expert_block_version(dut));
    assert_int_equal(expert_block_steps(dev2), 1);
    expert_block_destroy(&dev2);
    expert_block_destroy(&cpu);
    free(buf);

    /* Averaging's apply on the device's state: every element moves by
     * avg - base (here base is the state itself), v stays >= 0;
     * set_params installs a new version. */
    float *avg = tx_alloc(3 * np), *want = tx_alloc(3 * np);
    for (size_t k = 0; k < 3 * np; k++) {
        avg[k] = f1[k] + (k < 2 * np ? 0.01f : -1e-7f);
        float nv = f1[k] + (avg[k] - f1[k]);
        want[k] = k >= 2 * np && !(nv > 0.0f) ? 0.0f : nv;
    }
    double d0, d1;
    assert_int_equal(expert_block_flat_apply(dut, avg, f1, 1, &d0, &d1), 0);
    assert_int_equal(expert_block_flat_export(dut, f0), 0);
    snprintf(what, sizeof what, "%s state after flat_apply", kind);
    miss += cmp(&(struct target){ tg->name, be, TOL_EXACT }, what, f0, want, 3 * np);
    free(want);
    assert_true(d1 < 1e-6 * (d0 + 1));
    assert_int_equal(expert_block_set_params(dut, avg), 0);
    assert_int_equal(expert_block_read_params(dut, p1, NULL), 0);
    snprintf(what, sizeof what, "%s set_params", kind);
    miss += cmp(&(struct target){ tg->name, be, TOL_EXACT }, what, p1, avg, np);
    /* A non-finite average changes nothing. */
    avg[0] = INFINITY;
    uint64_t ver = expert_block_version(dut);
    assert_int_equal(expert_block_flat_apply(dut, avg, f1, 1, NULL, NULL), -ERANGE);
    assert_int_equal(expert_block_version(dut), ver);
    free(avg);

    free(x);
    free(dy);
    free(y0);
    free(y1);
    free(g0);
    free(g1);
    free(p0);
    free(p1);
    free(f0);
    free(f1);
    expert_workspace_destroy(&wr);
    expert_workspace_destroy(&wd);
    expert_block_destroy(&ref);
    expert_block_destroy(&dut);
    return miss;
}

/* Ten training steps of tiny-lm's three stages, chained on one side on the
 * CPU and on the other on the target, from the same initial weights and
 * batches: the next-byte loss (mean over positions, summed over rows) of
 * every step must agree. */
static int check_tiny_lm(const struct target *tg)
{
    const struct expert_model_spec *m = expert_model_find("tiny-lm");
    assert_non_null(m);
    int ns = m->n_stages, rows = 2;
    expert_block *rb[8], *db[8];
    expert_workspace *rw[8], *dw[8];
    struct expert_block_config c[8];
    for (int i = 0; i < ns; i++) {
        assert_int_equal(expert_model_stage(m, i, &c[i]), 0);
        rb[i] = expert_block_create(&c[i], expert_stage_seed(0, i));
        db[i] = expert_block_create_on(&c[i], expert_stage_seed(0, i), tg->be);
        rw[i] = expert_workspace_create(&c[i], rows);
        dw[i] = expert_workspace_create_on(&c[i], rows, tg->be);
        assert_true(rb[i] && db[i] && rw[i] && dw[i]);
    }
    int T = c[0].seq, V = c[ns - 1].vocab;
    size_t wmax = 0;
    for (int i = 0; i < ns; i++)
        wmax = (size_t)c[i].out > wmax ? (size_t)c[i].out : wmax;
    float *act[2][9], *grad[2][9];
    for (int side = 0; side < 2; side++)
        for (int i = 0; i <= ns; i++) {
            act[side][i] = tx_alloc(rows * wmax);
            grad[side][i] = tx_alloc(rows * wmax);
        }
    float *probs = tx_alloc((size_t)rows * T * V), *losses = tx_alloc((size_t)rows * T);
    int32_t *tgt = malloc((size_t)rows * T * sizeof *tgt);
    assert_non_null(tgt);
    struct expert_optim o;
    expert_optim_default_adamw(&o);
    uint64_t s = 99;
    int bad = 0;
    double tol = tg->tol == TOL_EXACT ? 0 : tg->tol == TOL_FP32 ? 1e-4 : 2e-2;
    for (int step = 0; step < 10; step++) {
        for (int k = 0; k < rows * T; k++) {
            act[0][0][k] = act[1][0][k] = (float)(tx_rng_next(&s) % 256);
            tgt[k] = (int32_t)(tx_rng_next(&s) % 256);
        }
        double loss[2];
        for (int side = 0; side < 2; side++) {
            expert_block **bl = side ? db : rb;
            expert_workspace **ws = side ? dw : rw;
            for (int i = 0; i < ns; i++)
                assert_int_equal(expert_block_forward(bl[i], ws[i], act[side][i + 1], act[side][i], rows, NULL), 0);
            assert_int_equal(expert_crossentropy_forward(losses, probs, act[side][ns], tgt, rows * T, V), 0);
            double l = 0;
            for (int k = 0; k < rows * T; k++)
                l += losses[k];
            loss[side] = l / (rows * T);
            assert_int_equal(expert_crossentropy_backward(grad[side][ns], probs, tgt, 1.0f / T, rows * T, V), 0);
            for (int i = ns - 1; i >= 0; i--)
                assert_int_equal(expert_block_backward(bl[i], ws[i], i ? grad[side][i] : NULL, grad[side][i + 1],
                                                       act[side][i], rows, NULL), 0);
            for (int i = 0; i < ns; i++)
                assert_int_equal(expert_block_step(bl[i], &o, NULL), 0);
        }
        double rel = fabs(loss[1] - loss[0]) / fabs(loss[0]);
        if (!(rel <= tol)) {
            fprintf(stderr, "%s tiny-lm step %d: loss %.9g, cpu %.9g (rel %.3g > %.3g)\n", tg->name, step, loss[1],
                    loss[0], rel, tol);
            bad++;
        } else if (step == 9) {
            fprintf(stderr, "%s tiny-lm: 10 steps, last loss %.6f (cpu %.6f)\n", tg->name, loss[1], loss[0]);
        }
    }
    for (int side = 0; side < 2; side++)
        for (int i = 0; i <= ns; i++) {
            free(act[side][i]);
            free(grad[side][i]);
        }
    for (int i = 0; i < ns; i++) {
        expert_block_destroy(&rb[i]);
        expert_block_destroy(&db[i]);
        expert_workspace_destroy(&rw[i]);
        expert_workspace_destroy(&dw[i]);
    }
    free(probs);
    free(losses);
    free(tgt);
    return bad;
}

static void run_target(const struct target *tg)
{
    int miss = 0;
    for (size_t i = 0; i < NCFG; i++)
        miss += check_kind(tg, &cfgs[i]);
    miss += check_tiny_lm(tg);
    assert_int_equal(miss, 0);
}

static void test_sim(void **state)
{
    (void)state;
    expert_backend *be = expert_backend_sim_create(0);
    assert_non_null(be);
    struct target tg = { "sim", be, TOL_EXACT };
    run_target(&tg);
    /* Everything the blocks and workspaces took was given back. */
    assert_int_equal(expert_backend_sim_used(be), 0);
    expert_backend_sim_destroy(&be);
}

/* A budget: a block that does not fit is not created, and the sizes the
 * peer checks before creating one are what creation takes. */
static void test_sim_budget(void **state)
{
    (void)state;
    const struct expert_block_config *c = &cfgs[5];
    size_t need = expert_block_bytes(c, expert_backend_cpu());
    size_t wsb = expert_workspace_bytes(c, expert_backend_cpu(), 4);
    assert_true(need > 0 && wsb > 0);
    expert_backend *be = expert_backend_sim_create(need - 1);
    assert_non_null(be);
    assert_null(expert_block_create_on(c, 1, be));
    assert_int_equal(expert_backend_sim_used(be), 0);
    size_t avail = 0, total = 0;
    assert_int_equal(be->mem_info(be, &avail, &total), 0);
    assert_int_equal(total, need - 1);
    assert_int_equal(avail, need - 1);
    expert_backend_sim_destroy(&be);

    /* Exactly enough for the block and one workspace (the sizes include
     * the staging a device workspace keeps). */
    size_t wsd = expert_workspace_bytes(c, NULL, 4);
    assert_int_equal(wsd, 0); /* no backend: no size */
    be = expert_backend_sim_create(0);
    wsd = expert_workspace_bytes(c, be, 4);
    assert_true(wsd > wsb);
    expert_backend_sim_destroy(&be);
    be = expert_backend_sim_create(need + wsd);
    expert_block *b = expert_block_create_on(c, 1, be);
    assert_non_null(b);
    expert_workspace *ws = expert_workspace_create_on(c, 4, be);
    assert_non_null(ws);
    assert_int_equal(expert_backend_sim_used(be), need + wsd);
    assert_null(expert_workspace_create_on(c, 1, be));
    expert_workspace_destroy(&ws);
    expert_block_destroy(&b);
    assert_int_equal(expert_backend_sim_used(be), 0);
    expert_backend_sim_destroy(&be);
}

static void test_cuda(void **state)
{
    (void)state;
    int n = cuda_device_count();
    if (n <= 0) {
        fprintf(stderr, "no CUDA device (%s): the CUDA targets are skipped\n", cuda_strerror(n ? n : -ENODEV));
        skip();
    }
    char err[256];
    const expert_backend *fp32 = NULL, *bf16 = NULL;
    assert_int_equal(cuda_backend_get(0, EXPERT_PRECISION_FP32, &fp32, err, sizeof err), 0);
    assert_int_equal(cuda_backend_get(0, EXPERT_PRECISION_BF16, &bf16, err, sizeof err), 0);
    struct target t32 = { "cuda fp32", fp32, TOL_FP32 }, t16 = { "cuda bf16", bf16, TOL_BF16 };
    run_target(&t32);
    run_target(&t16);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_sim),
        cmocka_unit_test(test_sim_budget),
        cmocka_unit_test(test_cuda),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
