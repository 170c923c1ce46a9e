/* tests/test_expert_ops_seq.c: the sequence ops (softmax, causal attention,
 * embedding) against central differences and naive double-precision
 * references, the backward accumulation contract, edge cases (T=1, huge
 * logits, -inf) and bad arguments. */
#include "test_expert_util.h"

#include <errno.h>

#include "expert/blas.h"
#include "expert/ops.h"

#define SEED 20260202u

/* Fills x (n) with a value a backward must overwrite, NaN included: a GEMM
 * with beta = 0 or a plain store forgets it, an accumulation does not. */
static void fill_garbage(float *x, size_t n)
{
    for (size_t i = 0; i < n; i++)
        x[i] = (i % 3 == 0) ? NAN : 1234.5f;
}

static int all_finite(const float *x, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (!isfinite(x[i]))
            return 0;
    return 1;
}

/* ---- softmax ---- */
struct sm_ctx { float *inp; int N, V; };
static void sm_fwd(void *c, float *out)
{
    struct sm_ctx *x = c;
    assert_int_equal(expert_softmax_forward(out, x->inp, x->N, x->V), 0);
}

static void test_softmax(void **state)
{
    (void)state;
    uint64_t s = SEED;
    /* V = 21: one full vector of 16 and a padded tail of 5. */
    int N = 3, V = 21;
    size_t n = (size_t)N * V;
    struct sm_ctx c = { tx_alloc(n), N, V };
    tx_fill(c.inp, n, &s, 3.0f);
    float *out = tx_alloc(n), *want = tx_alloc(n), *r = tx_alloc(n), *o2 = tx_alloc(n);
    tx_fill(r, n, &s, 1.0f);
    assert_int_equal(expert_softmax_forward(out, c.inp, N, V), 0);
    for (int i = 0; i < N; i++) {
        double m = -INFINITY, sum = 0.0;
        for (int v = 0; v < V; v++)
            m = fmax(m, c.inp[i * V + v]);
        for (int v = 0; v < V; v++)
            sum += exp((double)c.inp[i * V + v] - m);
        for (int v = 0; v < V; v++)
            want[i * V + v] = (float)(exp((double)c.inp[i * V + v] - m) / sum);
    }
    int miss = tx_check(out, want, n, 1e-7, 1e-5, "softmax vs double");
    /* In place. */
    memcpy(o2, c.inp, n * sizeof(float));
    assert_int_equal(expert_softmax_forward(o2, o2, N, V), 0);
    miss += tx_check(o2, out, n, 0, 0, "softmax in place");

    float *dinp = tx_alloc(n), *dinp2 = tx_alloc(n);
    assert_int_equal(expert_softmax_backward(dinp, r, out, N, V), 0);
    miss += tx_gradcheck("softmax dinp", sm_fwd, &c, c.inp, n, dinp, o2, r, n, 1e-2f, 1e-3, 1e-2);
    /* = contract: garbage in dinp is overwritten; in place over dout. */
    fill_garbage(dinp2, n);
    assert_int_equal(expert_softmax_backward(dinp2, r, out, N, V), 0);
    miss += tx_check(dinp2, dinp, n, 0, 0, "softmax dinp twice");
    memcpy(dinp2, r, n * sizeof(float));
    assert_int_equal(expert_softmax_backward(dinp2, dinp2, out, N, V), 0);
    miss += tx_check(dinp2, dinp, n, 0, 0, "softmax dinp aliasing dout");

    /* -inf gives exactly 0; huge logits stay finite and sum to 1. */
    float row[40];
    for (int v = 0; v < 40; v++)
        row[v] = (v % 4 == 1) ? -INFINITY : 1e30f * (float)((v * 7) % 11) / 11.0f;
    assert_int_equal(expert_softmax_forward(row, row, 2, 20), 0);
    for (int i = 0; i < 2; i++) {
        double sum = 0.0;
        for (int v = 0; v < 20; v++) {
            assert_true(isfinite(row[i * 20 + v]));
            if (v % 4 == 1)
                assert_true(row[i * 20 + v] == 0.0f);
            sum += row[i * 20 + v];
        }
        assert_true(fabs(sum - 1.0) < 1e-6);
    }
    /* V = 1: probability 1. */
    float one = 123.0f;
    assert_int_equal(expert_softmax_forward(&one, &one, 1, 1), 0);
    assert_true(one == 1.0f);

    /* Bad arguments change nothing. */
    memcpy(o2, out, n * sizeof(float));
    assert_int_equal(expert_softmax_forward(NULL, c.inp, N, V), -EINVAL);
    assert_int_equal(expert_softmax_forward(o2, NULL, N, V), -EINVAL);
    assert_int_equal(expert_softmax_forward(o2, c.inp, -1, V), -EINVAL);
    assert_int_equal(expert_softmax_forward(o2, c.inp, N, 0), -EINVAL);
    assert_int_equal(expert_softmax_backward(o2, NULL, out, N, V), -EINVAL);
    assert_int_equal(expert_softmax_backward(o2, r, NULL, N, V), -EINVAL);
    assert_int_equal(expert_softmax_backward(NULL, r, out, N, V), -EINVAL);
    assert_int_equal(expert_softmax_backward(o2, r, out, N, -3), -EINVAL);
    miss += tx_check(o2, out, n, 0, 0, "softmax after bad args");
    assert_int_equal(miss, 0);
    free(c.inp); free(out); free(want); free(r); free(o2); free(dinp); free(dinp2);
}

/* ---- attention ---- */

/* Naive reference in double, straight from the definition:
 * att = softmax(q·kᵀ/√hd + M), out = att·v per head; and, when dout is
 * given, dqkv by the chain rule through the same loops. */
static void ref_attention(float *out, float *att, float *dqkv, const float *dout,
                          const float *qkv, int B, int T, int C, int NH)
{
    int hd = C / NH;
    double scale = 1.0 / sqrt((double)hd);
    double *p = calloc((size_t)T * T, sizeof(double));
    double *dp = calloc((size_t)T, sizeof(double));
    double *g = dqkv ? calloc((size_t)B * T * 3 * C, sizeof(double)) : NULL;
    assert_non_null(p);
    assert_non_null(dp);
    for (int b = 0; b < B; b++)
        for (int h = 0; h < NH; h++) {
            const float *base = qkv + (size_t)b * T * 3 * C;
#define Q(i, d) ((double)base[(size_t)(i) * 3 * C + h * hd + (d)])
#define K(i, d) ((double)base[(size_t)(i) * 3 * C + C + h * hd + (d)])
#define V(i, d) ((double)base[(size_t)(i) * 3 * C + 2 * C + h * hd + (d)])
#define DO(i, d) ((double)dout[((size_t)b * T + (i)) * C + h * hd + (d)])
#define G(i, part, d) g[((size_t)b * T + (i)) * 3 * C + (part) * C + h * hd + (d)]
            for (int i = 0; i < T; i++) {
                double m = -INFINITY, sum = 0.0;
                for (int j = 0; j <= i; j++) {
                    double dot = 0.0;
                    for (int d = 0; d < hd; d++)
                        dot += Q(i, d) * K(j, d);
                    p[(size_t)i * T + j] = dot * scale;
                    m = fmax(m, dot * scale);
                }
                for (int j = 0; j <= i; j++) {
                    p[(size_t)i * T + j] = exp(p[(size_t)i * T + j] - m);
                    sum += p[(size_t)i * T + j];
                }
                for (int j = 0; j < T; j++) {
                    p[(size_t)i * T + j] = j <= i ? p[(size_t)i * T + j] / sum : 0.0;
                    if (att)
                        att[(((size_t)b * NH + h) * T + i) * T + j] = (float)p[(size_t)i * T + j];
                }
                for (int d = 0; d < hd; d++) {
                    double o = 0.0;
                    for (int j = 0; j <= i; j++)
                        o += p[(size_t)i * T + j] * V(j, d);
                    out[((size_t)b * T + i) * C + h * hd + d] = (float)o;
                }
            }
            if (!dqkv)
                continue;
            for (int i = 0; i < T; i++) {
                double dot = 0.0;
                for (int j = 0; j <= i; j++) {
                    double v = 0.0;
                    for (int d = 0; d < hd; d++)
                        v += DO(i, d) * V(j, d);
                    dp[j] = v;
                    dot += v * p[(size_t)i * T + j];
                }
                for (int j = 0; j <= i; j++) {
                    double pij = p[(size_t)i * T + j], ds = pij * (dp[j] - dot) * scale;
                    for (int d = 0; d < hd; d++) {
                        G(j, 2, d) += pij * DO(i, d);
                        G(i, 0, d) += ds * K(j, d);
                        G(j, 1, d) += ds * Q(i, d);
                    }
                }
            }
#undef Q
#undef K
#undef V
#undef DO
#undef G
        }
    if (dqkv)
        for (size_t i = 0; i < (size_t)B * T * 3 * C; i++)
            dqkv[i] = (float)g[i];
    free(p); free(dp); free(g);
}

struct att_ctx { float *qkv, *att; int B, T, C, NH; };
static void att_fwd(void *c, float *out)
{
    struct att_ctx *x = c;
    assert_int_equal(expert_attention_forward(out, x->att, x->qkv, x->B, x->T, x->C, x->NH), 0);
}

/* Causal rows: every row of every head sums to 1, entries above the
 * diagonal are exactly 0. Returns the number of bad rows. */
static int check_probs(const float *att, int B, int T, int NH)
{
    int bad = 0;
    for (size_t bh = 0; bh < (size_t)B * NH; bh++)
        for (int i = 0; i < T; i++) {
            const float *row = att + (bh * T + i) * T;
            double sum = 0.0;
            int ok = 1;
            for (int j = 0; j < T; j++) {
                if (j > i && row[j] != 0.0f)
                    ok = 0;
                if (!(row[j] >= 0.0f))
                    ok = 0;
                sum += row[j];
            }
            if (!ok || !(fabs(sum - 1.0) < 1e-5)) {
                if (bad < 5)
                    fprintf(stderr, "  att pair %zu row %d: sum %.8g%s\n", bh, i, sum,
                            ok ? "" : ", nonzero above the diagonal or negative");
                bad++;
            }
        }
    return bad;
}

static void test_attention_gradcheck(void **state)
{
    (void)state;
    uint64_t s = SEED + 1;
    int B = 2, T = 5, C = 12, NH = 3;
    size_t nqkv = (size_t)B * T * 3 * C, nout = (size_t)B * T * C, natt = (size_t)B * NH * T * T;
    struct att_ctx c = { tx_alloc(nqkv), tx_alloc(natt), B, T, C, NH };
    tx_fill(c.qkv, nqkv, &s, 1.5f);
    float *out = tx_alloc(nout), *r = tx_alloc(nout), *att = tx_alloc(natt);
    float *scratch = tx_alloc(natt), *dqkv = tx_alloc(nqkv), *dqkv2 = tx_alloc(nqkv);
    tx_fill(r, nout, &s, 1.0f);
    fill_garbage(att, natt);
    assert_int_equal(expert_attention_forward(out, att, c.qkv, B, T, C, NH), 0);
    int miss = check_probs(att, B, T, NH);
    fill_garbage(dqkv, nqkv);
    fill_garbage(scratch, natt);
    assert_int_equal(expert_attention_backward(dqkv, scratch, r, c.qkv, att, B, T, C, NH), 0);
    float *tmp = tx_alloc(nout);
    miss += tx_gradcheck("attention dqkv", att_fwd, &c, c.qkv, nqkv, dqkv, tmp, r, nout, 1e-2f,
                         2e-3, 2e-2);
    free(tmp);
    /* = contract: a second backward over garbage gives the same. */
    fill_garbage(dqkv2, nqkv);
    fill_garbage(scratch, natt);
    assert_int_equal(expert_attention_backward(dqkv2, scratch, r, c.qkv, att, B, T, C, NH), 0);
    miss += tx_check(dqkv2, dqkv, nqkv, 0, 0, "attention dqkv twice");
    /* The definition, in double. */
    float *wout = tx_alloc(nout), *watt = tx_alloc(natt), *wd = tx_alloc(nqkv);
    ref_attention(wout, watt, wd, r, c.qkv, B, T, C, NH);
    miss += tx_check(out, wout, nout, 1e-6, 1e-5, "attention out vs ref");
    miss += tx_check(att, watt, natt, 1e-7, 1e-5, "attention att vs ref");
    miss += tx_check(dqkv, wd, nqkv, 1e-6, 1e-4, "attention dqkv vs ref");
    assert_int_equal(miss, 0);
    free(c.qkv); free(c.att); free(out); free(r); free(att); free(scratch);
    free(dqkv); free(dqkv2); free(wout); free(watt); free(wd);
}

/* Sizes where the tiled sgemm path runs: several row tiles, partial ones,
 * GEMMs cut into pieces (hd = 128 with 2+ threads), forward and backward
 * against the reference, at 1 and 3 BLAS threads (3 > cores: the pool
 * parts interleave), with garbage in every output beforehand. */
static void test_attention_vs_ref(void **state)
{
    (void)state;
    /* The last one is above EXPERT__POOL_MIN_WORK: the pool splits it. */
    static const int shapes[][4] = { { 2, 70, 64, 4 }, { 1, 100, 256, 2 }, { 3, 75, 48, 8 } };
    int old = expert_blas_threads(), miss = 0;
    for (size_t k = 0; k < sizeof shapes / sizeof shapes[0]; k++) {
        int B = shapes[k][0], T = shapes[k][1], C = shapes[k][2], NH = shapes[k][3];
        uint64_t s = SEED + 10 + k;
        size_t nqkv = (size_t)B * T * 3 * C, nout = (size_t)B * T * C,
               natt = (size_t)B * NH * T * T;
        float *qkv = tx_alloc(nqkv), *dout = tx_alloc(nout);
        tx_fill(qkv, nqkv, &s, 2.0f);
        tx_fill(dout, nout, &s, 1.0f);
        float *wout = tx_alloc(nout), *watt = tx_alloc(natt), *wd = tx_alloc(nqkv);
        ref_attention(wout, watt, wd, dout, qkv, B, T, C, NH);
        for (int th = 1; th <= 3; th += 2) {
            expert_blas_set_threads(th);
            float *out = tx_alloc(nout), *att = tx_alloc(natt), *scr = tx_alloc(natt),
                  *d = tx_alloc(nqkv);
            fill_garbage(out, nout);
            fill_garbage(att, natt);
            fill_garbage(scr, natt);
            fill_garbage(d, nqkv);
            assert_int_equal(expert_attention_forward(out, att, qkv, B, T, C, NH), 0);
            assert_int_equal(expert_attention_backward(d, scr, dout, qkv, att, B, T, C, NH), 0);
            int m = tx_check(out, wout, nout, 2e-6, 1e-4, "attention out vs ref");
            m += tx_check(att, watt, natt, 1e-7, 1e-4, "attention att vs ref");
            m += tx_check(d, wd, nqkv, 1e-5, 1e-3, "attention dqkv vs ref");
            m += check_probs(att, B, T, NH);
            if (m)
                fprintf(stderr, "shape B=%d T=%d C=%d NH=%d, %d threads\n", B, T, C, NH, th);
            miss += m;
            free(out); free(att); free(scr); free(d);
        }
        free(qkv); free(dout); free(wout); free(watt); free(wd);
    }
    expert_blas_set_threads(old);
    assert_int_equal(miss, 0);
}

static void test_attention_edges(void **state)
{
    (void)state;
    uint64_t s = SEED + 2;
    /* T = 1: att = 1, out = v; dq = dk = 0, dv = dout. */
    {
        int B = 2, T = 1, C = 8, NH = 2;
        float qkv[2 * 24], out[16], att[4], scr[4], dout[16], d[48];
        tx_fill(qkv, 48, &s, 1.0f);
        tx_fill(dout, 16, &s, 1.0f);
        assert_int_equal(expert_attention_forward(out, att, qkv, B, T, C, NH), 0);
        assert_int_equal(expert_attention_backward(d, scr, dout, qkv, att, B, T, C, NH), 0);
        for (int i = 0; i < 4; i++)
            assert_true(att[i] == 1.0f);
        for (int b = 0; b < B; b++)
            for (int c = 0; c < C; c++) {
                assert_true(out[b * C + c] == qkv[b * 3 * C + 2 * C + c]);
                assert_true(d[b * 3 * C + c] == 0.0f);
                assert_true(d[b * 3 * C + C + c] == 0.0f);
                assert_true(d[b * 3 * C + 2 * C + c] == dout[b * C + c]);
            }
    }
    /* Huge logits (q, k ~ 1e3, products ~1e6·hd): finite, rows still sum
     * to 1, backward finite. */
    {
        int B = 2, T = 40, C = 32, NH = 2;
        size_t nqkv = (size_t)B * T * 3 * C, nout = (size_t)B * T * C,
               natt = (size_t)B * NH * T * T;
        float *qkv = tx_alloc(nqkv), *out = tx_alloc(nout), *att = tx_alloc(natt);
        float *scr = tx_alloc(natt), *dout = tx_alloc(nout), *d = tx_alloc(nqkv);
        tx_fill(qkv, nqkv, &s, 1e3f);
        tx_fill(dout, nout, &s, 1.0f);
        assert_int_equal(expert_attention_forward(out, att, qkv, B, T, C, NH), 0);
        assert_int_equal(expert_attention_backward(d, scr, dout, qkv, att, B, T, C, NH), 0);
        assert_true(all_finite(out, nout));
        assert_true(all_finite(att, natt));
        assert_true(all_finite(d, nqkv));
        assert_int_equal(check_probs(att, B, T, NH), 0);
        free(qkv); free(out); free(att); free(scr); free(dout); free(d);
    }
}

static void test_attention_bad_args(void **state)
{
    (void)state;
    float buf[64], keep[64];
    for (int i = 0; i < 64; i++)
        buf[i] = keep[i] = (float)i;
    float *x = buf;
    /* Valid shape would be B=1, T=2, C=4, NH=2 (qkv 24, att 8, out 8). */
    assert_int_equal(expert_attention_forward(NULL, x, x, 1, 2, 4, 2), -EINVAL);
    assert_int_equal(expert_attention_forward(x, NULL, x, 1, 2, 4, 2), -EINVAL);
    assert_int_equal(expert_attention_forward(x, x, NULL, 1, 2, 4, 2), -EINVAL);
    assert_int_equal(expert_attention_forward(x, x, x, 0, 2, 4, 2), -EINVAL);
    assert_int_equal(expert_attention_forward(x, x, x, 1, 0, 4, 2), -EINVAL);
    assert_int_equal(expert_attention_forward(x, x, x, 1, 2, 0, 2), -EINVAL);
    assert_int_equal(expert_attention_forward(x, x, x, 1, 2, 4, 0), -EINVAL);
    assert_int_equal(expert_attention_forward(x, x, x, 1, 2, 4, -2), -EINVAL);
    assert_int_equal(expert_attention_forward(x, x, x, -1, 2, 4, 2), -EINVAL);
    assert_int_equal(expert_attention_forward(x, x, x, 1, 2, 4, 3), -EINVAL); /* C % NH */
    assert_int_equal(expert_attention_backward(NULL, x, x, x, x, 1, 2, 4, 2), -EINVAL);
    assert_int_equal(expert_attention_backward(x, NULL, x, x, x, 1, 2, 4, 2), -EINVAL);
    assert_int_equal(expert_attention_backward(x, x, NULL, x, x, 1, 2, 4, 2), -EINVAL);
    assert_int_equal(expert_attention_backward(x, x, x, NULL, x, 1, 2, 4, 2), -EINVAL);
    assert_int_equal(expert_attention_backward(x, x, x, x, NULL, 1, 2, 4, 2), -EINVAL);
    assert_int_equal(expert_attention_backward(x, x, x, x, x, 1, -2, 4, 2), -EINVAL);
    assert_int_equal(expert_attention_backward(x, x, x, x, x, 1, 2, 6, 4), -EINVAL);
    assert_int_equal(expert_attention_backward(x, x, x, x, x, 1, 2, 4, 0), -EINVAL);
    assert_memory_equal(buf, keep, sizeof buf);
}

/* ---- embedding ---- */
struct emb_ctx { float *wte, *wpe; const int32_t *tok; int B, T, C, V; };
static void emb_fwd(void *c, float *out)
{
    struct emb_ctx *x = c;
    assert_int_equal(expert_embedding_forward(out, x->tok, x->wte, x->wpe, x->B, x->T, x->C, x->V), 0);
}

static void test_embedding(void **state)
{
    (void)state;
    uint64_t s = SEED + 3;
    int B = 2, T = 5, C = 12, V = 7, TMAX = 9; /* wpe has more rows than T */
    int32_t tok[10] = { 0, 6, 3, 3, 1, 6, 0, 2, 3, 5 };
    struct emb_ctx c = { tx_alloc((size_t)V * C), tx_alloc((size_t)TMAX * C), tok, B, T, C, V };
    tx_fill(c.wte, (size_t)V * C, &s, 1.0f);
    tx_fill(c.wpe, (size_t)TMAX * C, &s, 1.0f);
    size_t nout = (size_t)B * T * C;
    float *out = tx_alloc(nout), *r = tx_alloc(nout), *o2 = tx_alloc(nout);
    tx_fill(r, nout, &s, 1.0f);
    fill_garbage(out, nout);
    assert_int_equal(expert_embedding_forward(out, tok, c.wte, c.wpe, B, T, C, V), 0);
    int miss = 0;
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++)
            for (int k = 0; k < C; k++)
                if (out[((size_t)b * T + t) * C + k] != c.wte[tok[b * T + t] * C + k] + c.wpe[t * C + k])
                    miss++;
    float *dwte = tx_alloc((size_t)V * C), *dwpe = tx_alloc((size_t)TMAX * C);
    assert_int_equal(expert_embedding_backward(dwte, dwpe, r, tok, B, T, C, V), 0);
    miss += tx_gradcheck("embedding dwte", emb_fwd, &c, c.wte, (size_t)V * C, dwte, o2, r, nout,
                         1e-2f, 1e-4, 1e-3);
    miss += tx_gradcheck("embedding dwpe", emb_fwd, &c, c.wpe, (size_t)TMAX * C, dwpe, o2, r, nout,
                         1e-2f, 1e-4, 1e-3);
    /* Rows of wpe past T get no gradient; tokens absent (4) get none. */
    for (int k = 0; k < C; k++) {
        assert_true(dwte[4 * C + k] == 0.0f);
        for (int t = T; t < TMAX; t++)
            assert_true(dwpe[t * C + k] == 0.0f);
    }
    /* += contract: twice doubles. */
    float *dwte2 = tx_alloc((size_t)V * C), *dwpe2 = tx_alloc((size_t)TMAX * C);
    memcpy(dwte2, dwte, sizeof(float) * V * C);
    memcpy(dwpe2, dwpe, sizeof(float) * TMAX * C);
    assert_int_equal(expert_embedding_backward(dwte2, dwpe2, r, tok, B, T, C, V), 0);
    for (int i = 0; i < V * C; i++)
        dwte[i] *= 2.0f;
    for (int i = 0; i < TMAX * C; i++)
        dwpe[i] *= 2.0f;
    miss += tx_check(dwte2, dwte, (size_t)V * C, 1e-6, 1e-6, "embedding dwte twice");
    miss += tx_check(dwpe2, dwpe, (size_t)TMAX * C, 1e-6, 1e-6, "embedding dwpe twice");

    /* Out-of-range tokens (V, -1, INT32_MIN), anywhere, the last one too:
     * -EINVAL, out and grads untouched. */
    static const int32_t bad[] = { 7, -1, INT32_MIN, INT32_MAX };
    memcpy(o2, out, nout * sizeof(float));
    memcpy(dwte, dwte2, sizeof(float) * V * C);
    memcpy(dwpe, dwpe2, sizeof(float) * TMAX * C);
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++)
        for (int pos = 0; pos < B * T; pos += B * T - 1) {
            int32_t t2[10];
            memcpy(t2, tok, sizeof t2);
            t2[pos] = bad[k];
            assert_int_equal(expert_embedding_forward(o2, t2, c.wte, c.wpe, B, T, C, V), -EINVAL);
            assert_int_equal(expert_embedding_backward(dwte2, dwpe2, r, t2, B, T, C, V), -EINVAL);
        }
    miss += tx_check(o2, out, nout, 0, 0, "embedding out after bad tokens");
    miss += tx_check(dwte2, dwte, (size_t)V * C, 0, 0, "embedding dwte after bad tokens");
    miss += tx_check(dwpe2, dwpe, (size_t)TMAX * C, 0, 0, "embedding dwpe after bad tokens");
    /* Bad arguments. */
    assert_int_equal(expert_embedding_forward(NULL, tok, c.wte, c.wpe, B, T, C, V), -EINVAL);
    assert_int_equal(expert_embedding_forward(o2, NULL, c.wte, c.wpe, B, T, C, V), -EINVAL);
    assert_int_equal(expert_embedding_forward(o2, tok, NULL, c.wpe, B, T, C, V), -EINVAL);
    assert_int_equal(expert_embedding_forward(o2, tok, c.wte, NULL, B, T, C, V), -EINVAL);
    assert_int_equal(expert_embedding_forward(o2, tok, c.wte, c.wpe, 0, T, C, V), -EINVAL);
    assert_int_equal(expert_embedding_forward(o2, tok, c.wte, c.wpe, B, -1, C, V), -EINVAL);
    assert_int_equal(expert_embedding_forward(o2, tok, c.wte, c.wpe, B, T, 0, V), -EINVAL);
    assert_int_equal(expert_embedding_forward(o2, tok, c.wte, c.wpe, B, T, C, 0), -EINVAL);
    assert_int_equal(expert_embedding_backward(NULL, dwpe2, r, tok, B, T, C, V), -EINVAL);
    assert_int_equal(expert_embedding_backward(dwte2, NULL, r, tok, B, T, C, V), -EINVAL);
    assert_int_equal(expert_embedding_backward(dwte2, dwpe2, NULL, tok, B, T, C, V), -EINVAL);
    assert_int_equal(expert_embedding_backward(dwte2, dwpe2, r, NULL, B, T, C, V), -EINVAL);
    assert_int_equal(expert_embedding_backward(dwte2, dwpe2, r, tok, B, T, -5, V), -EINVAL);
    assert_int_equal(expert_embedding_backward(dwte2, dwpe2, r, tok, B, T, C, -7), -EINVAL);
    miss += tx_check(o2, out, nout, 0, 0, "embedding out after bad args");
    miss += tx_check(dwte2, dwte, (size_t)V * C, 0, 0, "embedding dwte after bad args");
    assert_int_equal(miss, 0);
    free(c.wte); free(c.wpe); free(out); free(r); free(o2);
    free(dwte); free(dwpe); free(dwte2); free(dwpe2);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_softmax),
        cmocka_unit_test(test_attention_gradcheck),
        cmocka_unit_test(test_attention_vs_ref),
        cmocka_unit_test(test_attention_edges),
        cmocka_unit_test(test_attention_bad_args),
        cmocka_unit_test(test_embedding),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
