/* tests/test_expert_block.c: blocks against PyTorch fixtures and central
 * differences, the accumulation contract, the model spec and its hashes. */
#include "test_expert_util.h"

#include <errno.h>

#include "expert/block.h"
#include "expert/model.h"
#include "expert/ops.h"

#define SEED 777u

/* ---- PyTorch fixtures (tests/ref/gen_blocks.py) ---- */

static void check_fixture(const char *file)
{
    struct tx_file f;
    tx_file_open(&f, file);
    assert_int_equal(tx_file_u32(&f), 1);
    struct expert_block_config cfg = { 0 };
    cfg.kind = (int)tx_file_u32(&f);
    cfg.in = (int)tx_file_u32(&f);
    cfg.out = (int)tx_file_u32(&f);
    cfg.hidden = (int)tx_file_u32(&f);
    int B = (int)tx_file_u32(&f);
    size_t np = tx_file_u32(&f);
    expert_block *b = expert_block_create(&cfg, 1);
    assert_non_null(b);
    assert_int_equal(expert_block_nparams(b), np);
    float *params = tx_file_f32(&f, np);
    float *inp = tx_file_f32(&f, (size_t)B * cfg.in);
    float *dout = tx_file_f32(&f, (size_t)B * cfg.out);
    float *want_out = tx_file_f32(&f, (size_t)B * cfg.out);
    float *want_dinp = tx_file_f32(&f, (size_t)B * cfg.in);
    float *want_dp = tx_file_f32(&f, np);
    tx_file_close(&f);

    expert_workspace *ws = expert_workspace_create(&cfg, B + 3);
    assert_non_null(ws);
    assert_int_equal(expert_block_set_params(b, params), 0);
    float *out = tx_alloc((size_t)B * cfg.out), *out2 = tx_alloc((size_t)B * cfg.out);
    float *dinp = tx_alloc((size_t)B * cfg.in), *dp = tx_alloc(np);
    assert_int_equal(expert_block_forward(b, ws, out, inp, B, NULL), 0);
    assert_int_equal(expert_block_forward_backward(b, ws, out2, dinp, dout, inp, B, NULL), 0);
    expert_block_copy_grads(b, dp);
    int miss = 0;
    miss += tx_check(out, want_out, (size_t)B * cfg.out, 1e-5, 1e-4, "torch out");
    miss += tx_check(out2, out, (size_t)B * cfg.out, 0, 0, "fwd_bwd out vs fwd");
    miss += tx_check(dinp, want_dinp, (size_t)B * cfg.in, 1e-5, 1e-4, "torch dinp");
    miss += tx_check(dp, want_dp, np, 1e-5, 1e-4, "torch dparams");
    /* Backward again: param grads double, dinp unchanged, count adds up. */
    float *dinp2 = tx_alloc((size_t)B * cfg.in), *dp2 = tx_alloc(np);
    assert_int_equal(expert_block_backward(b, ws, dinp2, dout, inp, B, NULL), 0);
    expert_block_copy_grads(b, dp2);
    for (size_t i = 0; i < np; i++)
        dp[i] *= 2.0f;
    miss += tx_check(dinp2, dinp, (size_t)B * cfg.in, 0, 0, "dinp twice");
    miss += tx_check(dp2, dp, np, 1e-6, 1e-6, "dparams twice");
    assert_int_equal(expert_block_accumulated(b), 2 * B);
    /* dinp = NULL still accumulates the same parameter grads. */
    expert_block_zero_grad(b);
    assert_int_equal(expert_block_backward(b, ws, NULL, dout, inp, B, NULL), 0);
    expert_block_copy_grads(b, dp2);
    miss += tx_check(dp2, want_dp, np, 1e-5, 1e-4, "dparams without dinp");
    if (miss)
        fprintf(stderr, "fixture %s\n", file);
    assert_int_equal(miss, 0);
    free(params); free(inp); free(dout); free(want_out); free(want_dinp); free(want_dp);
    free(out); free(out2); free(dinp); free(dp); free(dinp2); free(dp2);
    expert_workspace_destroy(&ws);
    assert_null(ws);
    expert_block_destroy(&b);
    assert_null(b);
}

static void test_torch_linear(void **state) { (void)state; check_fixture("linear.bin"); }
static void test_torch_resffn(void **state) { (void)state; check_fixture("resffn.bin"); }
static void test_torch_head(void **state) { (void)state; check_fixture("head.bin"); }

static void test_torch_crossentropy(void **state)
{
    (void)state;
    struct tx_file f;
    tx_file_open(&f, "crossentropy.bin");
    assert_int_equal(tx_file_u32(&f), 1);
    assert_int_equal(tx_file_u32(&f), 100);
    int B = (int)tx_file_u32(&f), V = (int)tx_file_u32(&f);
    float *logits = tx_file_f32(&f, (size_t)B * V);
    float *traw = tx_file_f32(&f, (size_t)B);
    float *want_l = tx_file_f32(&f, (size_t)B), *want_d = tx_file_f32(&f, (size_t)B * V);
    tx_file_close(&f);
    int32_t *t = calloc((size_t)B, sizeof *t);
    memcpy(t, traw, sizeof(int32_t) * B);
    float *l = tx_alloc(B), *p = tx_alloc((size_t)B * V), *d = tx_alloc((size_t)B * V);
    assert_int_equal(expert_crossentropy_forward(l, p, logits, t, B, V), 0);
    assert_int_equal(expert_crossentropy_backward(d, p, t, 1.0f, B, V), 0);
    int miss = tx_check(l, want_l, B, 1e-5, 1e-5, "ce loss");
    miss += tx_check(d, want_d, (size_t)B * V, 1e-6, 1e-5, "ce dlogits");
    assert_int_equal(miss, 0);
    free(logits); free(traw); free(want_l); free(want_d); free(t); free(l); free(p); free(d);
}

/* ---- central differences through a whole block ---- */

struct blk_ctx {
    expert_block *b;
    expert_workspace *ws;
    float *params, *inp;
    int B;
};

static void blk_fwd(void *c, float *out)
{
    struct blk_ctx *x = c;
    assert_int_equal(expert_block_set_params(x->b, x->params), 0);
    assert_int_equal(expert_block_forward(x->b, x->ws, out, x->inp, x->B, NULL), 0);
}

static void gradcheck_block(const struct expert_block_config *cfg, int B, uint64_t seed)
{
    uint64_t s = seed;
    expert_block *b = expert_block_create(cfg, seed);
    assert_non_null(b);
    size_t np = expert_block_nparams(b);
    struct blk_ctx c = { b, expert_workspace_create(cfg, B), tx_alloc(np),
                         tx_alloc((size_t)B * cfg->in), B };
    assert_non_null(c.ws);
    struct expert_snapshot snap;
    expert_block_snapshot_acquire(b, &snap);
    memcpy(c.params, snap.params, np * sizeof(float));
    expert_block_snapshot_release(b, &snap);
    /* Perturb LN params away from 1/0 so their gradients are general. */
    for (size_t i = 0; i < np; i++)
        c.params[i] += 0.2f * tx_uniform(&s);
    tx_fill(c.inp, (size_t)B * cfg->in, &s, 1.5f);
    assert_int_equal(expert_block_set_params(b, c.params), 0);
    size_t no = (size_t)B * cfg->out;
    float *r = tx_alloc(no), *out = tx_alloc(no), *dinp = tx_alloc((size_t)B * cfg->in);
    float *dp = tx_alloc(np);
    tx_fill(r, no, &s, 1.0f);
    assert_int_equal(expert_block_backward(b, c.ws, dinp, r, c.inp, B, NULL), 0);
    expert_block_copy_grads(b, dp);
    int miss = 0;
    miss += tx_gradcheck("block dinp", blk_fwd, &c, c.inp, (size_t)B * cfg->in, dinp, out, r,
                         no, 1e-2f, 2e-3, 2e-2);
    miss += tx_gradcheck("block dparams", blk_fwd, &c, c.params, np, dp, out, r, no, 1e-2f,
                         2e-3, 2e-2);
    if (miss)
        fprintf(stderr, "kind %d seed %llu\n", cfg->kind, (unsigned long long)seed);
    assert_int_equal(miss, 0);
    free(c.params); free(c.inp); free(r); free(out); free(dinp); free(dp);
    expert_workspace_destroy(&c.ws);
    expert_block_destroy(&b);
}

static void test_gradcheck_blocks(void **state)
{
    (void)state;
    struct expert_block_config lin = { EXPERT_BLOCK_LINEAR, 5, 3, 0 };
    struct expert_block_config ffn = { EXPERT_BLOCK_RESFFN, 6, 6, 20 };
    struct expert_block_config head = { EXPERT_BLOCK_HEAD, 7, 4, 0 };
    gradcheck_block(&lin, 3, SEED);
    gradcheck_block(&ffn, 3, SEED + 1);
    gradcheck_block(&head, 2, SEED + 2);
}

/* ---- init, config, workspace ---- */

static void test_init_and_config(void **state)
{
    (void)state;
    struct expert_block_config cfg = { EXPERT_BLOCK_RESFFN, 64, 64, 256 };
    expert_block *a = expert_block_create(&cfg, 5), *b = expert_block_create(&cfg, 5);
    expert_block *c = expert_block_create(&cfg, 6);
    assert_non_null(a);
    assert_non_null(b);
    assert_non_null(c);
    int nt;
    size_t n;
    const struct expert_tensor_info *t = expert_block_tensors(a, &nt, &n);
    assert_int_equal(nt, 6);
    assert_int_equal(n, 64 + 64 + 256 * 64 + 256 + 64 * 256 + 64);
    assert_string_equal(t[2].name, "fc1_w");
    assert_int_equal(t[2].rows, 256);
    assert_int_equal(t[2].cols, 64);
    struct expert_snapshot sa, sb, sc;
    expert_block_snapshot_acquire(a, &sa);
    expert_block_snapshot_acquire(b, &sb);
    expert_block_snapshot_acquire(c, &sc);
    assert_memory_equal(sa.params, sb.params, n * sizeof(float)); /* same seed */
    assert_memory_not_equal(sa.params, sc.params, n * sizeof(float));
    /* torch defaults: LN w=1 b=0; fc1 ~ U(±1/√64), fc2 ~ U(±1/√256), and the
     * draws actually fill the range (mean ~0, max near the bound). */
    for (int i = 0; i < 64; i++) {
        assert_true(sa.params[t[0].offset + i] == 1.0f);
        assert_true(sa.params[t[1].offset + i] == 0.0f);
    }
    const int lin_idx[4] = { 2, 3, 4, 5 };
    const float bound[4] = { 0.125f, 0.125f, 0.0625f, 0.0625f };
    for (int k = 0; k < 4; k++) {
        const struct expert_tensor_info *ti = &t[lin_idx[k]];
        double sum = 0, mx = 0;
        for (size_t i = 0; i < ti->count; i++) {
            float v = sa.params[ti->offset + i];
            assert_true(fabsf(v) <= bound[k]);
            sum += v;
            mx = fabs(v) > mx ? fabs(v) : mx;
        }
        assert_true(fabs(sum / (double)ti->count) < 0.05 * bound[k] + bound[k] / sqrt((double)ti->count) * 3);
        assert_true(mx > 0.8 * bound[k]);
    }
    expert_block_snapshot_release(a, &sa);
    expert_block_snapshot_release(b, &sb);
    expert_block_snapshot_release(c, &sc);
    assert_int_equal(expert_block_version(a), 0);

    /* Bad configs and calls. */
    struct expert_block_config bad[] = {
        { 0, 4, 4, 0 }, { EXPERT_BLOCK_RESFFN, 4, 5, 8 }, { EXPERT_BLOCK_RESFFN, 4, 4, 0 },
        { EXPERT_BLOCK_LINEAR, 4, 4, 3 }, { EXPERT_BLOCK_HEAD, 0, 4, 0 },
        { EXPERT_BLOCK_LINEAR, EXPERT_BLOCK_MAX_DIM + 1, 4, 0 },
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        assert_int_equal(expert_block_config_check(&bad[i]), -EINVAL);
        assert_null(expert_block_create(&bad[i], 1));
        assert_null(expert_workspace_create(&bad[i], 4));
        assert_int_equal(expert_block_config_hash(&bad[i]), 0);
    }
    assert_null(expert_workspace_create(&cfg, 0));
    expert_workspace *ws = expert_workspace_create(&cfg, 4);
    struct expert_block_config other = { EXPERT_BLOCK_RESFFN, 64, 64, 128 };
    expert_workspace *ws_other = expert_workspace_create(&other, 4);
    float *x = tx_alloc(64 * 8), *y = tx_alloc(64 * 8);
    assert_int_equal(expert_block_forward(a, ws, y, x, 5, NULL), -EINVAL);  /* > max batch */
    assert_int_equal(expert_block_forward(a, ws, y, x, 0, NULL), -EINVAL);
    assert_int_equal(expert_block_forward(a, ws_other, y, x, 2, NULL), -EINVAL); /* wrong ws */
    assert_int_equal(expert_block_backward(a, ws, y, NULL, x, 2, NULL), -EINVAL);
    uint64_t ver = 99;
    assert_int_equal(expert_block_forward(a, ws, y, x, 4, &ver), 0);
    assert_int_equal(ver, 0);
    free(x); free(y);
    expert_workspace_destroy(&ws);
    expert_workspace_destroy(&ws_other);
    expert_workspace_destroy(&ws); /* NULL-safe */
    expert_block_destroy(&a);
    expert_block_destroy(&b);
    expert_block_destroy(&c);
    expert_block_destroy(&c);
}

/* ---- model spec ---- */

static void test_model_spec(void **state)
{
    (void)state;
    const struct expert_model_spec *m = expert_model_find("fmnist-mlp");
    assert_non_null(m);
    assert_ptr_equal(expert_model_at(0), m);
    assert_null(expert_model_at(-1));
    assert_null(expert_model_find("nope"));
    assert_int_equal(m->n_stages, 6);
    assert_int_equal(m->n_in, 784);
    assert_int_equal(m->n_out, 10);
    /* 8 811 018 parameters and 17.59 MFLOP/sample, as the torch baseline. */
    size_t total = 0;
    for (int i = 0; i < m->n_stages; i++) {
        struct expert_block_config c;
        assert_int_equal(expert_model_stage(m, i, &c), 0);
        struct expert_tensor_info t[EXPERT_BLOCK_MAX_TENSORS];
        size_t n;
        assert_true(expert_block_config_tensors(&c, t, &n) > 0);
        total += n;
        if (i > 0) {
            struct expert_block_config prev;
            expert_model_stage(m, i - 1, &prev);
            assert_int_equal(prev.out, c.in); /* stages chain */
        }
    }
    assert_int_equal(total, 8811018);
    assert_true(fabs(expert_model_flops_per_sample(m) - 17.59e6) < 0.01e6);
    struct expert_block_config c;
    assert_int_equal(expert_model_stage(m, 6, &c), -ENOENT);

    const struct expert_model_spec *pm;
    int idx;
    assert_int_equal(expert_stage_parse("fmnist-mlp.3", &pm, &idx), 0);
    assert_ptr_equal(pm, m);
    assert_int_equal(idx, 3);
    assert_int_equal(expert_stage_parse("fmnist-mlp.0", &pm, &idx), 0);
    assert_int_equal(idx, 0);
    const char *bad[] = { "", ".", "fmnist-mlp", "fmnist-mlp.", ".3", "fmnist-mlp.03",
                          "fmnist-mlp.-1", "fmnist-mlp.3x", "fmnist-mlp. 3" };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        assert_int_equal(expert_stage_parse(bad[i], &pm, &idx), -EINVAL);
    assert_int_equal(expert_stage_parse("fmnist-mlp.6", &pm, &idx), -ENOENT);
    assert_int_equal(expert_stage_parse("fmnist-mlp.99999999999", &pm, &idx), -ENOENT);
    assert_int_equal(expert_stage_parse("other.1", &pm, &idx), -ENOENT);
    char name[EXPERT_STAGE_NAME_MAX];
    assert_int_equal(expert_stage_name(name, sizeof name, m, 5), 12);
    assert_string_equal(name, "fmnist-mlp.5");
    assert_int_equal(expert_stage_name(name, 5, m, 5), -ENOSPC);

    /* Hashes are pinned: a change here breaks agreement with deployed
     * peers and checkpoints, so it must be deliberate (bump the tag). */
    uint64_t h[6];
    for (int i = 0; i < 6; i++) {
        h[i] = expert_stage_hash(m, i);
        assert_true(h[i] != 0);
        for (int j = 0; j < i; j++)
            assert_true(h[i] != h[j]);
    }
    struct expert_block_config s1, s2;
    expert_model_stage(m, 1, &s1);
    expert_model_stage(m, 2, &s2);
    assert_true(expert_block_config_hash(&s1) == expert_block_config_hash(&s2));
    fprintf(stderr, "block hash resffn(512,2048) = %016llx, stage .0 = %016llx\n",
            (unsigned long long)expert_block_config_hash(&s1), (unsigned long long)h[0]);
    assert_true(expert_block_config_hash(&s1) == 0xf9f434a0908d2aa3ULL);
    assert_true(h[0] == 0xdf12b5aae585ce84ULL);
    assert_true(expert_stage_seed(0, 1) != expert_stage_seed(0, 2));
    assert_true(expert_stage_seed(7, 1) == expert_stage_seed(7, 1));

    /* tiny-lm: train_lm.py's default GPT, 4 903 168 parameters in three
     * stages that chain from context token ids to context*vocab logits. */
    const struct expert_model_spec *lm = expert_model_find("tiny-lm");
    assert_non_null(lm);
    assert_ptr_equal(expert_model_at(1), lm);
    assert_int_equal(lm->task, EXPERT_TASK_BYTES);
    assert_int_equal(m->task, EXPERT_TASK_CLASSES);
    assert_int_equal(lm->n_stages, 3);
    assert_int_equal(lm->n_in, 128);
    assert_int_equal(lm->n_out, 128 * 256);
    total = 0;
    for (int i = 0; i < lm->n_stages; i++) {
        struct expert_block_config lc;
        assert_int_equal(expert_model_stage(lm, i, &lc), 0);
        assert_int_equal(expert_block_config_check(&lc), 0);
        assert_int_equal(lc.in, i ? lm->stages[i - 1].out : lm->n_in);
        struct expert_tensor_info t[EXPERT_BLOCK_MAX_TENSORS];
        size_t n;
        assert_true(expert_block_config_tensors(&lc, t, &n) > 0);
        total += n;
        assert_true(expert_stage_hash(lm, i) != 0);
    }
    assert_int_equal(lm->stages[lm->n_stages - 1].out, lm->n_out);
    assert_int_equal(total, 4903168);
    assert_int_equal(expert_stage_parse("tiny-lm.2", &pm, &idx), 0);
    assert_ptr_equal(pm, lm);
    assert_int_equal(expert_stage_parse("tiny-lm.3", &pm, &idx), -ENOENT);
    /* Every built-in is a valid model: its stages chain from n_in to n_out. */
    for (int k = 0; expert_model_at(k); k++) {
        const struct expert_model_spec *bm = expert_model_at(k);
        for (int i = 0; i < bm->n_stages; i++) {
            assert_int_equal(expert_block_config_check(&bm->stages[i]), 0);
            assert_int_equal(bm->stages[i].in, i ? bm->stages[i - 1].out : bm->n_in);
        }
        assert_int_equal(bm->stages[bm->n_stages - 1].out, bm->n_out);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_torch_linear),
        cmocka_unit_test(test_torch_resffn),
        cmocka_unit_test(test_torch_head),
        cmocka_unit_test(test_torch_crossentropy),
        cmocka_unit_test(test_gradcheck_blocks),
        cmocka_unit_test(test_init_and_config),
        cmocka_unit_test(test_model_spec),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
