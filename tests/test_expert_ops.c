/* tests/test_expert_ops.c: every CPU op against central differences, the
 * backward accumulation contract, GELU against libm's erf, bad arguments. */
#include "test_expert_util.h"

#include <errno.h>

#include "expert/blas.h"
#include "expert/ops.h"
#include "expert/pool.h"

#define SEED 20260101u

/* ---- linear ---- */
struct lin_ctx { float *inp, *w, *bias; int B, C, OC; };
static void lin_fwd(void *c, float *out)
{
    struct lin_ctx *x = c;
    assert_int_equal(expert_linear_forward(out, x->inp, x->w, x->bias, x->B, x->C, x->OC), 0);
}

static void test_linear_gradcheck(void **state)
{
    (void)state;
    uint64_t s = SEED;
    int B = 3, C = 5, OC = 4;
    struct lin_ctx c = { tx_alloc(B * C), tx_alloc(OC * C), tx_alloc(OC), B, C, OC };
    tx_fill(c.inp, B * C, &s, 1.0f);
    tx_fill(c.w, OC * C, &s, 1.0f);
    tx_fill(c.bias, OC, &s, 1.0f);
    float *r = tx_alloc(B * OC), *out = tx_alloc(B * OC);
    tx_fill(r, B * OC, &s, 1.0f);
    float *dinp = tx_alloc(B * C), *dw = tx_alloc(OC * C), *db = tx_alloc(OC);
    assert_int_equal(expert_linear_backward(dinp, dw, db, r, c.inp, c.w, B, C, OC), 0);
    int miss = 0;
    miss += tx_gradcheck("linear dinp", lin_fwd, &c, c.inp, B * C, dinp, out, r, B * OC, 1e-2f, 1e-3, 1e-2);
    miss += tx_gradcheck("linear dw", lin_fwd, &c, c.w, OC * C, dw, out, r, B * OC, 1e-2f, 1e-3, 1e-2);
    miss += tx_gradcheck("linear db", lin_fwd, &c, c.bias, OC, db, out, r, B * OC, 1e-2f, 1e-3, 1e-2);
    /* Contract: param grads +=, activation grads =. */
    float *dinp2 = tx_alloc(B * C), *dw2 = tx_alloc(OC * C), *db2 = tx_alloc(OC);
    memcpy(dw2, dw, sizeof(float) * OC * C);
    memcpy(db2, db, sizeof(float) * OC);
    for (int i = 0; i < B * C; i++)
        dinp2[i] = 1234.0f; /* must be overwritten, not added to */
    assert_int_equal(expert_linear_backward(dinp2, dw2, db2, r, c.inp, c.w, B, C, OC), 0);
    for (int i = 0; i < OC * C; i++)
        dw[i] *= 2.0f;
    for (int i = 0; i < OC; i++)
        db[i] *= 2.0f;
    miss += tx_check(dinp2, dinp, B * C, 0, 0, "linear dinp twice");
    miss += tx_check(dw2, dw, OC * C, 1e-6, 1e-6, "linear dw twice");
    miss += tx_check(db2, db, OC, 1e-6, 1e-6, "linear db twice");
    if (miss)
        fprintf(stderr, "seed %u\n", SEED);
    assert_int_equal(miss, 0);
    free(c.inp); free(c.w); free(c.bias); free(r); free(out);
    free(dinp); free(dw); free(db); free(dinp2); free(dw2); free(db2);
}

/* ---- bias ---- */
struct bias_ctx { float *inp, *bias; int B, C; };
static void bias_fwd(void *c, float *out)
{
    struct bias_ctx *x = c;
    assert_int_equal(expert_bias_forward(out, x->inp, x->bias, x->B, x->C), 0);
}

static void test_bias_gradcheck(void **state)
{
    (void)state;
    uint64_t s = SEED + 1;
    int B = 4, C = 19;
    struct bias_ctx c = { tx_alloc(B * C), tx_alloc(C), B, C };
    tx_fill(c.inp, B * C, &s, 1.0f);
    tx_fill(c.bias, C, &s, 1.0f);
    float *r = tx_alloc(B * C), *out = tx_alloc(B * C), *db = tx_alloc(C);
    tx_fill(r, B * C, &s, 1.0f);
    assert_int_equal(expert_bias_backward(db, r, B, C), 0);
    int miss = tx_gradcheck("bias db", bias_fwd, &c, c.bias, C, db, out, r, B * C, 1e-2f, 1e-3, 1e-2);
    assert_int_equal(expert_bias_backward(db, r, B, C), 0);
    float *db1 = tx_alloc(C);
    assert_int_equal(expert_bias_backward(db1, r, B, C), 0);
    for (int i = 0; i < C; i++)
        db1[i] *= 2.0f;
    miss += tx_check(db, db1, C, 1e-6, 1e-6, "bias db twice");
    assert_int_equal(miss, 0);
    free(c.inp); free(c.bias); free(r); free(out); free(db); free(db1);
}

/* ---- layernorm ---- */
struct ln_ctx { float *inp, *w, *b; int N, C; };
static void ln_fwd(void *c, float *out)
{
    struct ln_ctx *x = c;
    assert_int_equal(expert_layernorm_forward(out, NULL, NULL, x->inp, x->w, x->b, x->N, x->C), 0);
}

static void test_layernorm_gradcheck(void **state)
{
    (void)state;
    uint64_t s = SEED + 2;
    int N = 3, C = 7;
    struct ln_ctx c = { tx_alloc(N * C), tx_alloc(C), tx_alloc(C), N, C };
    tx_fill(c.inp, N * C, &s, 2.0f);
    for (int i = 0; i < N * C; i++)
        c.inp[i] += 0.5f; /* non-zero mean */
    tx_fill(c.w, C, &s, 1.0f);
    tx_fill(c.b, C, &s, 1.0f);
    float *r = tx_alloc(N * C), *out = tx_alloc(N * C), *mean = tx_alloc(N), *rstd = tx_alloc(N);
    tx_fill(r, N * C, &s, 1.0f);
    assert_int_equal(expert_layernorm_forward(out, mean, rstd, c.inp, c.w, c.b, N, C), 0);
    /* Normalised rows: with w=1, b=0 each row has mean 0 and variance 1. */
    float *ones = tx_alloc(C), *zeros = tx_alloc(C), *o2 = tx_alloc(N * C);
    for (int i = 0; i < C; i++)
        ones[i] = 1.0f;
    assert_int_equal(expert_layernorm_forward(o2, NULL, NULL, c.inp, ones, zeros, N, C), 0);
    for (int n = 0; n < N; n++) {
        double m = 0, v = 0;
        for (int i = 0; i < C; i++)
            m += o2[n * C + i];
        m /= C;
        for (int i = 0; i < C; i++)
            v += (o2[n * C + i] - m) * (o2[n * C + i] - m);
        v /= C;
        assert_true(fabs(m) < 1e-5);
        assert_true(fabs(v - 1.0) < 1e-3);
    }
    float *dinp = tx_alloc(N * C), *dw = tx_alloc(C), *db = tx_alloc(C);
    assert_int_equal(expert_layernorm_backward(dinp, dw, db, r, c.inp, c.w, mean, rstd, N, C), 0);
    int miss = 0;
    miss += tx_gradcheck("ln dinp", ln_fwd, &c, c.inp, N * C, dinp, out, r, N * C, 1e-2f, 2e-3, 2e-2);
    miss += tx_gradcheck("ln dw", ln_fwd, &c, c.w, C, dw, out, r, N * C, 1e-2f, 1e-3, 1e-2);
    miss += tx_gradcheck("ln db", ln_fwd, &c, c.b, C, db, out, r, N * C, 1e-2f, 1e-3, 1e-2);
    float *dinp2 = tx_alloc(N * C);
    for (int i = 0; i < N * C; i++)
        dinp2[i] = -7.0f;
    float *dw2 = tx_alloc(C), *db2 = tx_alloc(C);
    memcpy(dw2, dw, sizeof(float) * C);
    memcpy(db2, db, sizeof(float) * C);
    assert_int_equal(expert_layernorm_backward(dinp2, dw2, db2, r, c.inp, c.w, mean, rstd, N, C), 0);
    for (int i = 0; i < C; i++) {
        dw[i] *= 2.0f;
        db[i] *= 2.0f;
    }
    miss += tx_check(dinp2, dinp, N * C, 0, 0, "ln dinp twice");
    miss += tx_check(dw2, dw, C, 1e-6, 1e-6, "ln dw twice");
    miss += tx_check(db2, db, C, 1e-6, 1e-6, "ln db twice");
    assert_int_equal(miss, 0);
    free(c.inp); free(c.w); free(c.b); free(r); free(out); free(mean); free(rstd);
    free(ones); free(zeros); free(o2); free(dinp); free(dw); free(db);
    free(dinp2); free(dw2); free(db2);
}

/* ---- gelu and bias+gelu ---- */
struct gelu_ctx { float *inp; long N; };
static void gelu_fwd(void *c, float *out)
{
    struct gelu_ctx *x = c;
    assert_int_equal(expert_gelu_forward(out, x->inp, x->N), 0);
}

static void test_gelu_accuracy(void **state)
{
    (void)state;
    /* Against the exact-erf definition in double, across the range that
     * matters, including the tails where x·Φ(x) is tiny or ~x; 37 elements
     * so the padded tail path runs too. */
    enum { N = 4001 };
    float *x = tx_alloc(N), *g = tx_alloc(N), *dg = tx_alloc(N), *ones = tx_alloc(N);
    float *wg = tx_alloc(N), *wdg = tx_alloc(N);
    for (int i = 0; i < N; i++) {
        x[i] = -12.0f + 24.0f * (float)i / (N - 1);
        ones[i] = 1.0f;
        double xd = x[i], cdf = 0.5 * (1.0 + erf(xd / sqrt(2.0)));
        wg[i] = (float)(xd * cdf);
        wdg[i] = (float)(cdf + xd * exp(-0.5 * xd * xd) / sqrt(2.0 * M_PI));
    }
    assert_int_equal(expert_gelu_forward(g, x, N), 0);
    assert_int_equal(expert_gelu_backward(dg, ones, x, N), 0);
    int miss = tx_check(g, wg, N, 2e-6, 1e-6, "gelu vs erf");
    miss += tx_check(dg, wdg, N, 2e-6, 1e-6, "gelu' vs erf");
    /* Non-finite input stays non-finite rather than turning into a number. */
    float nan_in = NAN, nan_out = 0.0f;
    assert_int_equal(expert_gelu_forward(&nan_out, &nan_in, 1), 0);
    assert_true(isnan(nan_out));
    assert_int_equal(miss, 0);
    free(x); free(g); free(dg); free(ones); free(wg); free(wdg);
}

static void test_gelu_gradcheck(void **state)
{
    (void)state;
    uint64_t s = SEED + 3;
    long N = 37;
    struct gelu_ctx c = { tx_alloc(N), N };
    tx_fill(c.inp, N, &s, 3.0f);
    float *r = tx_alloc(N), *out = tx_alloc(N), *din = tx_alloc(N);
    tx_fill(r, N, &s, 1.0f);
    assert_int_equal(expert_gelu_backward(din, r, c.inp, N), 0);
    int miss = tx_gradcheck("gelu dinp", gelu_fwd, &c, c.inp, N, din, out, r, N, 1e-2f, 1e-3, 1e-2);
    assert_int_equal(miss, 0);
    free(c.inp); free(r); free(out); free(din);
}

struct bg_ctx { float *inp, *bias, *pre; int B, C; };
static void bg_fwd(void *c, float *out)
{
    struct bg_ctx *x = c;
    memcpy(x->pre, x->inp, sizeof(float) * x->B * x->C);
    assert_int_equal(expert_bias_gelu_forward(out, NULL, x->pre, x->bias, x->B, x->C), 0);
}

static void test_bias_gelu(void **state)
{
    (void)state;
    uint64_t s = SEED + 4;
    int B = 3, C = 21;
    size_t n = (size_t)B * C;
    struct bg_ctx c = { tx_alloc(n), tx_alloc(C), tx_alloc(n), B, C };
    tx_fill(c.inp, n, &s, 2.0f);
    tx_fill(c.bias, C, &s, 1.0f);
    float *r = tx_alloc(n), *out = tx_alloc(n), *dg = tx_alloc(n), *dpre = tx_alloc(n);
    float *db = tx_alloc(C), *ref = tx_alloc(n), *x = tx_alloc(n);
    tx_fill(r, n, &s, 1.0f);
    /* Fused forward equals bias then gelu, and saves pre = inp + bias. */
    memcpy(c.pre, c.inp, sizeof(float) * n);
    assert_int_equal(expert_bias_gelu_forward(out, dg, c.pre, c.bias, B, C), 0);
    assert_int_equal(expert_bias_forward(x, c.inp, c.bias, B, C), 0);
    assert_int_equal(expert_gelu_forward(ref, x, (long)n), 0);
    int miss = tx_check(out, ref, n, 0, 0, "bias_gelu out");
    miss += tx_check(c.pre, x, n, 0, 0, "bias_gelu pre");
    /* In place (out aliases pre), as the block uses it. */
    float *inplace = tx_alloc(n);
    memcpy(inplace, c.inp, sizeof(float) * n);
    assert_int_equal(expert_bias_gelu_forward(inplace, NULL, inplace, c.bias, B, C), 0);
    miss += tx_check(inplace, ref, n, 0, 0, "bias_gelu in place");
    assert_int_equal(expert_bias_gelu_backward(dpre, db, r, dg, B, C), 0);
    miss += tx_gradcheck("bias_gelu dinp", bg_fwd, &c, c.inp, n, dpre, out, r, n, 1e-2f, 1e-3, 1e-2);
    miss += tx_gradcheck("bias_gelu db", bg_fwd, &c, c.bias, C, db, out, r, n, 1e-2f, 1e-3, 1e-2);
    assert_int_equal(miss, 0);
    free(c.inp); free(c.bias); free(c.pre); free(r); free(out); free(dg); free(dpre);
    free(db); free(ref); free(x); free(inplace);
}

/* ---- residual ---- */
static void test_residual(void **state)
{
    (void)state;
    uint64_t s = SEED + 5;
    long N = 29;
    float *a = tx_alloc(N), *b = tx_alloc(N), *out = tx_alloc(N), *d = tx_alloc(N);
    float *da = tx_alloc(N), *db = tx_alloc(N);
    tx_fill(a, N, &s, 1.0f);
    tx_fill(b, N, &s, 1.0f);
    tx_fill(d, N, &s, 1.0f);
    assert_int_equal(expert_residual_forward(out, a, b, N), 0);
    for (long i = 0; i < N; i++)
        assert_true(out[i] == a[i] + b[i]);
    for (int rep = 0; rep < 2; rep++) {  /* "=" semantics: the same twice */
        assert_int_equal(expert_residual_backward(da, db, d, N), 0);
        assert_int_equal(tx_check(da, d, N, 0, 0, "residual da"), 0);
        assert_int_equal(tx_check(db, d, N, 0, 0, "residual db"), 0);
    }
    assert_int_equal(expert_residual_backward(NULL, d, d, N), 0); /* alias ok */
    free(a); free(b); free(out); free(d); free(da); free(db);
}

/* ---- cross-entropy ---- */
struct ce_ctx { float *logits, *probs; int32_t *t; int B, V; };
static void ce_fwd(void *c, float *out)
{
    struct ce_ctx *x = c;
    assert_int_equal(expert_crossentropy_forward(out, x->probs, x->logits, x->t, x->B, x->V), 0);
}

static void test_crossentropy(void **state)
{
    (void)state;
    uint64_t s = SEED + 6;
    int B = 4, V = 6;
    int32_t t[4] = { 0, 5, 2, 2 };
    struct ce_ctx c = { tx_alloc(B * V), tx_alloc(B * V), t, B, V };
    tx_fill(c.logits, B * V, &s, 3.0f);
    float *losses = tx_alloc(B), *r = tx_alloc(B), *dl = tx_alloc(B * V);
    for (int i = 0; i < B; i++)
        r[i] = 1.0f;
    assert_int_equal(expert_crossentropy_forward(losses, c.probs, c.logits, t, B, V), 0);
    assert_int_equal(expert_crossentropy_backward(dl, c.probs, t, 1.0f, B, V), 0);
    int miss = tx_gradcheck("ce dlogits", ce_fwd, &c, c.logits, B * V, dl, losses, r, B, 1e-2f, 1e-3, 1e-2);
    /* Huge logits do not overflow. */
    c.logits[0] = 1e30f;
    assert_int_equal(expert_crossentropy_forward(losses, c.probs, c.logits, t, B, V), 0);
    for (int i = 0; i < B; i++)
        assert_true(isfinite(losses[i]));
    /* Out-of-range targets are refused. */
    int32_t bad[4] = { 0, 6, 0, 0 };
    assert_int_equal(expert_crossentropy_forward(losses, c.probs, c.logits, bad, B, V), -EINVAL);
    bad[1] = -1;
    assert_int_equal(expert_crossentropy_backward(dl, c.probs, bad, 1.0f, B, V), -EINVAL);
    assert_int_equal(miss, 0);
    free(c.logits); free(c.probs); free(losses); free(r); free(dl);
}

static void test_ops_table_and_bad_args(void **state)
{
    (void)state;
    struct expert_ops ops;
    expert_ops_init_cpu(&ops);
    assert_string_equal(ops.name, "cpu");
    void (**fns)(void) = (void (**)(void))&ops.linear_forward;
    size_t nfn = (sizeof ops - offsetof(struct expert_ops, linear_forward)) / sizeof(void *);
    for (size_t i = 0; i < nfn; i++)
        assert_non_null(fns[i]);
    float x[4] = { 0 };
    assert_int_equal(ops.linear_forward(NULL, x, x, NULL, 1, 1, 1), -EINVAL);
    assert_int_equal(ops.linear_forward(x, x, x, NULL, 1, 0, 1), -EINVAL);
    assert_int_equal(ops.linear_backward(x, NULL, x, x, x, x, 1, 1, 1), -EINVAL);
    assert_int_equal(ops.layernorm_forward(x, NULL, NULL, x, x, x, -1, 2), -EINVAL);
    assert_int_equal(ops.layernorm_backward(x, x, x, x, x, x, NULL, x, 1, 2), -EINVAL);
    assert_int_equal(ops.gelu_forward(x, NULL, 1), -EINVAL);
    assert_int_equal(ops.bias_gelu_forward(x, NULL, x, x, 1, 0), -EINVAL);
    assert_int_equal(ops.residual_forward(x, x, x, -1), -EINVAL);
    assert_int_equal(ops.crossentropy_forward(x, x, x, NULL, 1, 2), -EINVAL);
    assert_int_equal(ops.bias_forward(x, x, NULL, 1, 1), -EINVAL);
    assert_int_equal(ops.softmax_forward(x, x, 1, 0), -EINVAL);
    assert_int_equal(ops.attention_forward(x, x, x, 1, 1, 3, 2), -EINVAL); /* C % NH */
    int32_t tok = 2; /* >= V */
    assert_int_equal(ops.embedding_backward(x, x, x, &tok, 1, 1, 1, 2), -EINVAL);
}

/* Large passes split across the helper pool when BLAS has 2+ threads; each
 * element is computed by the same code either way, so the results must be
 * bit-identical to one thread (and the pool must not lose a part). */
static void test_pool_split_identical(void **state)
{
    (void)state;
    uint64_t s = SEED + 9;
    int B = 300, C = 1040; /* > EXPERT__POOL_MIN_WORK; C not a multiple of 16·n */
    size_t n = (size_t)B * C;
    float *x = tx_alloc(n), *bias = tx_alloc(C), *w = tx_alloc(C), *dy = tx_alloc(n);
    tx_fill(x, n, &s, 3.0f);
    tx_fill(bias, C, &s, 1.0f);
    tx_fill(w, C, &s, 1.0f);
    tx_fill(dy, n, &s, 1.0f);
    float *r[2][6];
    int old = expert_blas_threads();
    for (int k = 0; k < 2; k++) {
        expert_blas_set_threads(k ? 3 : 1);
        for (int j = 0; j < 6; j++)
            r[k][j] = tx_alloc(j == 4 ? (size_t)C : n);
        float *pre = r[k][0], *out = r[k][1], *dg = r[k][2], *dpre = r[k][3], *db = r[k][4];
        memcpy(pre, x, n * sizeof(float));
        assert_int_equal(expert_bias_gelu_forward(out, dg, pre, bias, B, C), 0);
        assert_int_equal(expert_bias_gelu_backward(dpre, db, dy, dg, B, C), 0);
        assert_int_equal(expert_layernorm_forward(r[k][5], NULL, NULL, x, w, bias, B, C), 0);
        assert_int_equal(expert_bias_forward(pre, pre, bias, B, C), 0);
        assert_int_equal(expert_residual_forward(out, out, dy, (long)n), 0);
    }
    expert_blas_set_threads(old);
    for (int j = 0; j < 6; j++) {
        assert_int_equal(tx_check(r[1][j], r[0][j], j == 4 ? (size_t)C : n, 0, 0, "pool vs 1 thread"), 0);
        free(r[0][j]);
        free(r[1][j]);
    }
    free(x); free(bias); free(w); free(dy);
}

/* Many short jobs back to back with more helpers than cores: helpers often
 * wake for a job that has already ended. Each job has its own heap context;
 * every part of every job must run exactly once, through that job's
 * context. A late helper that claimed a part of the next job would run it
 * on the previous job's freed context: the part would stay undone here
 * (and ASan would report the use after free). */
struct pool_job {
    int n;
    int done[2 * EXPERT__POOL_MAX];
};

static void pool_job_part(void *ctx, int i, int n)
{
    struct pool_job *j = ctx;
    j->n = n;
    j->done[i]++;
}

static void test_pool_jobs_back_to_back(void **state)
{
    (void)state;
    int old = expert_blas_threads();
    expert_blas_set_threads(EXPERT__POOL_MAX);
    int bad = 0, split = 0;
    for (int k = 0; k < 20000 && bad == 0; k++) {
        struct pool_job *j = calloc(1, sizeof *j);
        assert_non_null(j);
        expert__parallel(pool_job_part, j, EXPERT__POOL_MIN_WORK);
        assert_true(j->n >= 1 && j->n <= 2 * EXPERT__POOL_MAX);
        split += j->n > 1;
        for (int i = 0; i < j->n; i++)
            if (j->done[i] != 1) {
                fprintf(stderr, "job %d: part %d of %d ran %d times\n", k, i, j->n, j->done[i]);
                bad++;
            }
        free(j);
    }
    expert_blas_set_threads(old);
    assert_int_equal(bad, 0);
    assert_true(split > 0); /* the pool really split jobs */
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_linear_gradcheck),
        cmocka_unit_test(test_bias_gradcheck),
        cmocka_unit_test(test_layernorm_gradcheck),
        cmocka_unit_test(test_gelu_accuracy),
        cmocka_unit_test(test_gelu_gradcheck),
        cmocka_unit_test(test_bias_gelu),
        cmocka_unit_test(test_residual),
        cmocka_unit_test(test_crossentropy),
        cmocka_unit_test(test_ops_table_and_bad_args),
        cmocka_unit_test(test_pool_split_identical),
        cmocka_unit_test(test_pool_jobs_back_to_back),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
