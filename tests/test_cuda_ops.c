/* Every CUDA op against the CPU reference on the same seeded inputs.
 *
 * Outputs are poisoned with NaN first (0xFF bytes), so an element the GPU
 * never wrote fails; the check is written `!(|got - want| <= tol)` so NaN
 * fails too. Every compared tensor prints one line ("ok" or "FAIL", the
 * worst element relative to its tolerance, the max abs and rel
 * differences) and a FAIL prints its first mismatches, so one run on a GPU
 * says what went wrong where; a test with a failed check fails in its
 * teardown after it has checked everything. Each test starts from the same
 * seed (1234), so a failure reproduces on its own.
 *
 * Tolerances (u = 2^-24, fp32's unit roundoff; u16 = 2^-8, bf16's):
 *   - fp32 GEMMs (cuBLASLt against OpenBLAS): atol = 16·u·(K·sa·sb + 2),
 *     rtol 1e-5, for dot products of length K whose factors are uniform in
 *     [-sa, sa] and [-sb, sb] (mm_atol). Two summation orders differ by
 *     about u·K·sa·sb/10 (random-sign roundings of partial sums that grow
 *     like √k); 16·u·K·sa·sb is two orders above that and still four to
 *     six orders below one wrong or missing term (~sa·sb/4).
 *   - bf16 GEMMs, two checks. (a) Against the CPU run on the operands
 *     rounded to bf16 as the contract says (inp, w, dout): the products of
 *     bf16 values are exact in fp32, so only the fp32 accumulation differs:
 *     64·u·(K·sa·sb + 2) (4× the fp32 figure for the tensor cores'
 *     accumulation). (b) Against the plain fp32 reference: a rigorous
 *     per-element bound (2·u16 + u16²)·Σ_k |a_k·b_k| (each factor rounded
 *     to bf16 moves a product by at most that), the "~1e-2 relative,
 *     growing with the dot-product length" of llm.c's test_gpt2.cu made
 *     exact per element, plus the fp32 atol. (a) is the sharp one; (b) is
 *     the contract users see.
 *   - attention (flash-style, online softmax, expf): forward 3e-5 + 3e-4
 *     relative, gradients 2e-4 + 2e-3 relative; T = 1024 four times that.
 *     With q, k in [-3, 3] the scores spread over e^±9; their rounding
 *     (~u·√hd·9) moves probabilities by ~1e-6 relative, so outputs move by
 *     ~1e-6 and gradients by ~1e-5, while a dropped or misplaced key moves
 *     them by ≥ 1e-3.
 *   - attention in bf16 (the bf16 backend's table): against the CPU run on
 *     q, k, v and dout rounded to bf16 as the kernels round them, within a
 *     rigorous per-element bound for the rounding of P and dS to bf16 and
 *     every fp32 effect (tests/cudaemu/att_bf16_bound.h derives it), plus
 *     1e-6; other head sizes must give the fp32 path's bits.
 *   - element-wise ops and sums: see each test.
 *   - the optimizer updates and the bf16 cast are exact (the kernels do the
 *     CPU's operations in the CPU's order, no FMA contraction).
 *
 * Exits 77 (skipped) without CUDA in the build or without a GPU. */
#include <errno.h>
#include <float.h>
#include <math.h>

#include "config.h"
#include "cuda/cuda.h"
#include "cuda/ops.h"
#include "expert/backend.h"
#include "expert/ops.h"
#include "expert/optim.h"
#include "test_util.h"
#include "tests/cudaemu/att_bf16_bound.h"

#define U32 0x1p-24 /* fp32 unit roundoff */
#define U16 0x1p-8  /* bf16 unit roundoff (8 significant bits) */

static struct expert_ops G;                 /* the CUDA table (fp32) */
static const struct expert_backend *g_be16; /* the CUDA backend in bf16 */
static unsigned g_seed = 1234;
static int g_bad;          /* failed checks in the running test */
static char g_case[192];   /* what the running test is at, for messages */

/* ---- Memory the new tests hold until their teardown ---- */

#define MAX_HELD 4096
static void *g_host[MAX_HELD], *g_dev[MAX_HELD];
static int g_nhost, g_ndev;

static void *hold(void *p)
{
    assert_non_null(p);
    assert_true(g_nhost < MAX_HELD);
    g_host[g_nhost++] = p;
    return p;
}

static void *dhold(void *p)
{
    if (!p)
        fail_msg("%s: cuda_malloc failed (%s)", g_case, expert_backend_last_error());
    assert_true(g_ndev < MAX_HELD);
    g_dev[g_ndev++] = p;
    return p;
}

static void release_all(void)
{
    while (g_nhost > 0)
        free(g_host[--g_nhost]);
    while (g_ndev > 0)
        cuda_free(g_dev[--g_ndev]);
}

static int setup(void **state)
{
    (void)state;
    g_seed = 1234;
    g_bad = 0;
    snprintf(g_case, sizeof g_case, "(setup)");
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    release_all();
    int bad = g_bad;
    g_bad = 0;
    if (bad)
        fprintf(stderr, "%d check(s) failed in this test: see the FAIL lines above\n", bad);
    return bad ? -1 : 0;
}

/* A call that must return 0; says which case and call failed, and why. */
#define OK(call)                                                                               \
    do {                                                                                       \
        int ok_rc_ = (call);                                                                   \
        if (ok_rc_ != 0)                                                                       \
            fail_msg("%s: %s returned %d (%s); backend says: %s", g_case, #call, ok_rc_,      \
                     cuda_strerror(ok_rc_), expert_backend_last_error());                      \
    } while (0)

/* ---- Host and device buffers ---- */

static float *rnd(size_t n, float scale)
{
    float *x = malloc((n ? n : 1) * sizeof *x);
    assert_non_null(x);
    for (size_t i = 0; i < n; i++)
        x[i] = ((float)rand_r(&g_seed) / (float)RAND_MAX * 2.0f - 1.0f) * scale;
    return x;
}

static float *hrnd(size_t n, float scale) { return hold(rnd(n, scale)); }
static float *hnew(size_t n) { return hold(malloc((n ? n : 1) * sizeof(float))); }
static float *hzero(size_t n) { return hold(calloc(n ? n : 1, sizeof(float))); }

static float *hdup(const float *x, size_t n)
{
    float *y = hnew(n);
    memcpy(y, x, n * sizeof *y);
    return y;
}

static float *hscaled(const float *x, size_t n, float s)
{
    float *y = hnew(n);
    for (size_t i = 0; i < n; i++)
        y[i] = x[i] * s;
    return y;
}

static float *habs(const float *x, size_t n)
{
    float *y = hnew(n);
    for (size_t i = 0; i < n; i++)
        y[i] = fabsf(x[i]);
    return y;
}

static float bf16_to_f32(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* x rounded to bf16 (expert_cast_bf16) and widened back to fp32. */
static float *hbf16(const float *x, size_t n)
{
    uint16_t *t = hold(malloc((n ? n : 1) * sizeof *t));
    OK(expert_cast_bf16(t, x, n));
    float *y = hnew(n);
    for (size_t i = 0; i < n; i++)
        y[i] = bf16_to_f32(t[i]);
    return y;
}

/* Device memory: n floats at float offset `off` inside an allocation of
 * n + off floats (off > 0 puts a tensor at an unaligned address, as the
 * packed parameters of a block do). */
static float *dnew(size_t n, size_t off)
{
    float *d = dhold(cuda_malloc((n + off + 1) * sizeof(float)));
    return d + off;
}

static void h2d(float *d, const float *h, size_t n)
{
    if (n)
        OK(cuda_memcpy_h2d(d, h, n * sizeof *d));
}

static float *dup_dev(const float *h, size_t n, size_t off)
{
    float *d = dnew(n, off);
    h2d(d, h, n);
    return d;
}

static float *dnan(size_t n, size_t off)
{
    float *d = dnew(n, off);
    OK(cuda_memset(d, 0xFF, n * sizeof *d));
    return d;
}

static float *dzero(size_t n, size_t off)
{
    float *d = dnew(n, off);
    OK(cuda_memset(d, 0, n * sizeof *d));
    return d;
}

/* Waits for the queued work and copies n floats back. */
static float *dl(const float *d, size_t n)
{
    float *h = hnew(n);
    OK(cuda_sync());
    if (n)
        OK(cuda_memcpy_d2h(h, d, n * sizeof *h));
    return h;
}

/* ---- Comparisons ---- */

/* |got − want| <= atol (+ bound[i] when bound is not NULL) + rtol·|want|
 * for every element, written so that NaN fails. */
static void check_b(const char *what, const float *got, const float *want, const float *bound,
                    size_t n, float atol, float rtol)
{
    size_t miss = 0, worst = 0, nonfinite = 0;
    double maxd = 0, maxr = 0, maxq = 0;
    for (size_t i = 0; i < n; i++) {
        float tol = atol + (bound ? bound[i] : 0.0f) + rtol * fabsf(want[i]);
        float d = fabsf(got[i] - want[i]);
        if (!(d <= tol)) {
            if (miss < 5)
                fprintf(stderr, "  %s [%zu]: got %.9g want %.9g |diff| %.3g tol %.3g\n", what, i,
                        (double)got[i], (double)want[i], (double)d, (double)tol);
            miss++;
        }
        if (!isfinite(got[i]) && isfinite(want[i])) {
            nonfinite++;
            continue;
        }
        if (d > maxd)
            maxd = d;
        if (want[i] != 0.0f && (double)d / fabsf(want[i]) > maxr)
            maxr = (double)d / fabsf(want[i]);
        double q = tol > 0 ? (double)d / tol : (d > 0 ? INFINITY : 0);
        if (q > maxq) {
            maxq = q;
            worst = i;
        }
    }
    fprintf(stderr, "%s %s: n %zu, max |diff| %.3g, max rel %.3g, worst |diff|/tol %.3g at [%zu]",
            miss ? "FAIL" : "ok  ", what, n, maxd, maxr, maxq, worst);
    if (nonfinite)
        fprintf(stderr, ", %zu non-finite where the reference is finite", nonfinite);
    if (miss)
        fprintf(stderr, "; %zu of %zu out of tolerance (atol %.3g rtol %.3g%s; seed %u)", miss, n,
                (double)atol, (double)rtol, bound ? " + a bound per element" : "", g_seed);
    fprintf(stderr, "\n");
    if (miss)
        g_bad++;
}

static void check(const char *what, const float *got, const float *want, size_t n, float atol,
                  float rtol)
{
    check_b(what, got, want, NULL, n, atol, rtol);
}

static uint32_t f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

/* Bit for bit (same_nan: any NaN equals any NaN, whose payloads the CPU
 * and the GPU make differently). */
static void check_bits(const char *what, const float *got, const float *want, size_t n,
                       int same_nan)
{
    size_t miss = 0;
    for (size_t i = 0; i < n; i++) {
        if (f32_bits(got[i]) == f32_bits(want[i]) || (same_nan && isnan(got[i]) && isnan(want[i])))
            continue;
        if (miss < 5)
            fprintf(stderr, "  %s [%zu]: got %.9g (0x%08x) want %.9g (0x%08x)\n", what, i,
                    (double)got[i], (unsigned)f32_bits(got[i]), (double)want[i],
                    (unsigned)f32_bits(want[i]));
        miss++;
    }
    fprintf(stderr, "%s %s: n %zu, bit for bit%s", miss ? "FAIL" : "ok  ", what, n,
            same_nan ? " (NaN = NaN)" : "");
    if (miss)
        fprintf(stderr, "; %zu of %zu elements differ", miss, n);
    fprintf(stderr, "\n");
    if (miss)
        g_bad++;
}

/* Every byte of device memory [d, d + bytes) is `byte` (0: zeros, 0xFF:
 * the NaN poison), i.e. nothing wrote there. */
static void check_dev_bytes(const char *what, const void *d, size_t bytes, int byte)
{
    unsigned char *h = hold(malloc(bytes ? bytes : 1));
    OK(cuda_sync());
    if (bytes)
        OK(cuda_memcpy_d2h(h, d, bytes));
    size_t miss = 0, first = 0;
    for (size_t i = 0; i < bytes; i++)
        if (h[i] != (unsigned char)byte && miss++ == 0)
            first = i;
    fprintf(stderr, "%s %s: %zu bytes all 0x%02x", miss ? "FAIL" : "ok  ", what, bytes, byte);
    if (miss)
        fprintf(stderr, "; %zu differ, the first at byte %zu (0x%02x)", miss, first, h[first]);
    fprintf(stderr, "\n");
    if (miss)
        g_bad++;
}

/* A double against a reference: |got − want| <= rtol·|want| (both
 * non-finite also passes when want is). */
static void check_d(const char *what, double got, double want, double rtol)
{
    double d = fabs(got - want);
    int ok = d <= rtol * fabs(want) || (!isfinite(want) && !isfinite(got));
    fprintf(stderr, "%s %s: got %.17g want %.17g, rel diff %.3g (rtol %.3g)\n", ok ? "ok  " : "FAIL",
            what, got, want, want != 0 ? d / fabs(want) : d, rtol);
    if (!ok)
        g_bad++;
}

/* A condition that is not a tensor comparison. */
static void check_true(const char *what, int cond)
{
    fprintf(stderr, "%s %s\n", cond ? "ok  " : "FAIL", what);
    if (!cond)
        g_bad++;
}

/* fp32 GEMM tolerance (see the top of the file). */
static float mm_atol(double factor, int K, double sa, double sb)
{
    return (float)(factor * U32 * ((double)K * sa * sb + 2.0));
}

/* The name of a check inside the running case. */
static char g_nm[320];
static const char *nm(const char *what)
{
    snprintf(g_nm, sizeof g_nm, "%s: %s", g_case, what);
    return g_nm;
}

/* ---- The tests that were here first (linear through the old entries,
 * layernorm, GELU, bias, residual, cross-entropy) ---- */

static float *up(const float *h, size_t n)
{
    float *d = cuda_malloc(n * sizeof *d);
    assert_non_null(d);
    assert_int_equal(cuda_memcpy_h2d(d, h, n * sizeof *d), 0);
    return d;
}

static float *nan_dev(size_t n)
{
    float *d = cuda_malloc(n * sizeof *d);
    assert_non_null(d);
    assert_int_equal(cuda_memset(d, 0xFF, n * sizeof *d), 0);
    return d;
}

static float *down(const float *d, size_t n)
{
    float *h = malloc(n * sizeof *h);
    assert_non_null(h);
    assert_int_equal(cuda_sync(), 0);
    assert_int_equal(cuda_memcpy_d2h(h, d, n * sizeof *h), 0);
    return h;
}

static void test_linear(void **state)
{
    (void)state;
    const int B = 37, C = 64, OC = 48;
    float *x = rnd((size_t)B * C, 1), *w = rnd((size_t)OC * C, 0.2f), *b = rnd(OC, 0.5f);
    float *dy = rnd((size_t)B * OC, 1);
    float *y = malloc(sizeof(float) * B * OC), *dx = malloc(sizeof(float) * B * C);
    float *dw = calloc((size_t)OC * C, sizeof(float)), *db = calloc(OC, sizeof(float));
    assert_int_equal(expert_linear_forward(y, x, w, b, B, C, OC), 0);
    assert_int_equal(expert_linear_backward(dx, dw, db, dy, x, w, B, C, OC), 0);

    float *gx = up(x, (size_t)B * C), *gw = up(w, (size_t)OC * C), *gb = up(b, OC), *gdy = up(dy, (size_t)B * OC);
    float *gy = nan_dev((size_t)B * OC), *gdx = nan_dev((size_t)B * C);
    float *zero_w = calloc((size_t)OC * C, sizeof(float)), *zero_b = calloc(OC, sizeof(float));
    float *gdw = up(zero_w, (size_t)OC * C), *gdb = up(zero_b, OC);
    assert_int_equal(G.linear_forward(gy, gx, gw, gb, B, C, OC), 0);
    assert_int_equal(G.linear_backward(gdx, gdw, gdb, gdy, gx, gw, B, C, OC), 0);
    float *hy = down(gy, (size_t)B * OC), *hdx = down(gdx, (size_t)B * C);
    float *hdw = down(gdw, (size_t)OC * C), *hdb = down(gdb, OC);
    check("linear out", hy, y, (size_t)B * OC, 1e-4f, 1e-4f);
    check("linear dinp", hdx, dx, (size_t)B * C, 1e-4f, 1e-4f);
    check("linear dw", hdw, dw, (size_t)OC * C, 1e-4f, 1e-4f);
    check("linear dbias", hdb, db, OC, 1e-4f, 1e-4f);

    /* Accumulation contract: a second backward doubles dw/dbias, rewrites dinp. */
    assert_int_equal(G.linear_backward(gdx, gdw, gdb, gdy, gx, gw, B, C, OC), 0);
    free(hdx);
    free(hdw);
    free(hdb);
    hdx = down(gdx, (size_t)B * C);
    hdw = down(gdw, (size_t)OC * C);
    hdb = down(gdb, OC);
    for (int i = 0; i < OC * C; i++)
        dw[i] *= 2;
    for (int i = 0; i < OC; i++)
        db[i] *= 2;
    check("linear dinp (twice)", hdx, dx, (size_t)B * C, 1e-4f, 1e-4f);
    check("linear dw (twice)", hdw, dw, (size_t)OC * C, 2e-4f, 1e-4f);
    check("linear dbias (twice)", hdb, db, OC, 2e-4f, 1e-4f);

    float *ptrs[] = {gx, gw, gb, gdy, gy, gdx, gdw, gdb};
    for (size_t i = 0; i < sizeof ptrs / sizeof ptrs[0]; i++)
        cuda_free(ptrs[i]);
    float *hp[] = {x, w, b, dy, y, dx, dw, db, zero_w, zero_b, hy, hdx, hdw, hdb};
    for (size_t i = 0; i < sizeof hp / sizeof hp[0]; i++)
        free(hp[i]);
}

static void test_layernorm(void **state)
{
    (void)state;
    const int N = 37, C = 300;
    size_t n = (size_t)N * C;
    float *x = rnd(n, 3), *w = rnd(C, 1), *b = rnd(C, 1), *dy = rnd(n, 1);
    for (size_t i = 0; i < n; i++)
        x[i] += 5.0f; /* a large mean, as residual streams have */
    float *y = malloc(n * 4), *mean = malloc(N * 4), *rstd = malloc(N * 4), *dx = malloc(n * 4);
    float *dw = calloc(C, 4), *db = calloc(C, 4);
    assert_int_equal(expert_layernorm_forward(y, mean, rstd, x, w, b, N, C), 0);
    assert_int_equal(expert_layernorm_backward(dx, dw, db, dy, x, w, mean, rstd, N, C), 0);

    float *gx = up(x, n), *gw = up(w, C), *gb = up(b, C), *gdy = up(dy, n);
    float *gy = nan_dev(n), *gm = nan_dev(N), *gr = nan_dev(N), *gdx = nan_dev(n);
    float *zc = calloc(C, 4);
    float *gdw = up(zc, C), *gdb = up(zc, C);
    assert_int_equal(G.layernorm_forward(gy, gm, gr, gx, gw, gb, N, C), 0);
    assert_int_equal(G.layernorm_backward(gdx, gdw, gdb, gdy, gx, gw, gm, gr, N, C), 0);
    float *hy = down(gy, n), *hm = down(gm, N), *hr = down(gr, N), *hdx = down(gdx, n);
    float *hdw = down(gdw, C), *hdb = down(gdb, C);
    check("layernorm out", hy, y, n, 1e-4f, 1e-4f);
    check("layernorm mean", hm, mean, N, 1e-5f, 1e-5f);
    check("layernorm rstd", hr, rstd, N, 1e-5f, 1e-4f);
    check("layernorm dinp", hdx, dx, n, 1e-4f, 1e-3f);
    check("layernorm dw", hdw, dw, C, 1e-4f, 1e-3f);
    check("layernorm db", hdb, db, C, 1e-4f, 1e-4f);
    float *dp[] = {gx, gw, gb, gdy, gy, gm, gr, gdx, gdw, gdb};
    for (size_t i = 0; i < sizeof dp / sizeof dp[0]; i++)
        cuda_free(dp[i]);
    float *hp[] = {x, w, b, dy, y, mean, rstd, dx, dw, db, zc, hy, hm, hr, hdx, hdw, hdb};
    for (size_t i = 0; i < sizeof hp / sizeof hp[0]; i++)
        free(hp[i]);
}

static void test_gelu_bias_residual(void **state)
{
    (void)state;
    const int B = 19, C = 130;
    size_t n = (size_t)B * C;
    float *x = rnd(n, 4), *bias = rnd(C, 1), *dy = rnd(n, 1), *x2 = rnd(n, 1);

    /* gelu forward/backward */
    float *y = malloc(n * 4), *dx = malloc(n * 4);
    assert_int_equal(expert_gelu_forward(y, x, (long)n), 0);
    assert_int_equal(expert_gelu_backward(dx, dy, x, (long)n), 0);
    float *gx = up(x, n), *gdy = up(dy, n), *gy = nan_dev(n), *gdx = nan_dev(n);
    assert_int_equal(G.gelu_forward(gy, gx, (long)n), 0);
    assert_int_equal(G.gelu_backward(gdx, gdy, gx, (long)n), 0);
    float *hy = down(gy, n), *hdx = down(gdx, n);
    check("gelu out", hy, y, n, 1e-5f, 1e-5f);
    check("gelu dinp", hdx, dx, n, 1e-5f, 1e-4f);

    /* fused bias + gelu */
    float *pre = malloc(n * 4), *out = malloc(n * 4), *dg = malloc(n * 4), *dpre = malloc(n * 4);
    float *dbias = calloc(C, 4);
    memcpy(pre, x, n * 4);
    assert_int_equal(expert_bias_gelu_forward(out, dg, pre, bias, B, C), 0);
    assert_int_equal(expert_bias_gelu_backward(dpre, dbias, dy, dg, B, C), 0);
    float *gpre = up(x, n), *gbias = up(bias, C), *gout = nan_dev(n), *gdg = nan_dev(n), *gdpre = nan_dev(n);
    float *zc = calloc(C, 4);
    float *gdbias = up(zc, C);
    assert_int_equal(G.bias_gelu_forward(gout, gdg, gpre, gbias, B, C), 0);
    assert_int_equal(G.bias_gelu_backward(gdpre, gdbias, gdy, gdg, B, C), 0);
    float *hpre = down(gpre, n), *hout = down(gout, n), *hdg = down(gdg, n), *hdpre = down(gdpre, n);
    float *hdbias = down(gdbias, C);
    check("bias_gelu pre", hpre, pre, n, 1e-6f, 1e-6f);
    check("bias_gelu out", hout, out, n, 1e-5f, 1e-5f);
    check("bias_gelu dgelu", hdg, dg, n, 1e-5f, 1e-4f);
    check("bias_gelu dpre", hdpre, dpre, n, 1e-5f, 1e-4f);
    check("bias_gelu dbias", hdbias, dbias, C, 1e-4f, 1e-4f);

    /* bias and residual */
    float *bo = malloc(n * 4), *db2 = calloc(C, 4), *ro = malloc(n * 4);
    assert_int_equal(expert_bias_forward(bo, x, bias, B, C), 0);
    assert_int_equal(expert_bias_backward(db2, dy, B, C), 0);
    assert_int_equal(expert_residual_forward(ro, x, x2, (long)n), 0);
    float *gbo = nan_dev(n), *gx2 = up(x2, n), *gro = nan_dev(n), *gdb2 = up(zc, C);
    float *gda = nan_dev(n), *gdb = nan_dev(n);
    assert_int_equal(G.bias_forward(gbo, gx, gbias, B, C), 0);
    assert_int_equal(G.bias_backward(gdb2, gdy, B, C), 0);
    assert_int_equal(G.residual_forward(gro, gx, gx2, (long)n), 0);
    assert_int_equal(G.residual_backward(gda, gdb, gdy, (long)n), 0);
    float *hbo = down(gbo, n), *hdb2 = down(gdb2, C), *hro = down(gro, n);
    float *hda = down(gda, n), *hdb = down(gdb, n);
    check("bias out", hbo, bo, n, 1e-6f, 1e-6f);
    check("bias dbias", hdb2, db2, C, 1e-4f, 1e-4f);
    check("residual out", hro, ro, n, 1e-6f, 1e-6f);
    check("residual da", hda, dy, n, 0, 0);
    check("residual db", hdb, dy, n, 0, 0);

    float *dp[] = {gx, gdy, gy, gdx, gpre, gbias, gout, gdg, gdpre, gdbias, gbo, gx2, gro, gdb2, gda, gdb};
    for (size_t i = 0; i < sizeof dp / sizeof dp[0]; i++)
        cuda_free(dp[i]);
    float *hp[] = {x, bias, dy, x2, y, dx, hy, hdx, pre, out, dg, dpre, dbias, zc, hpre, hout, hdg,
                   hdpre, hdbias, bo, db2, ro, hbo, hdb2, hro, hda, hdb};
    for (size_t i = 0; i < sizeof hp / sizeof hp[0]; i++)
        free(hp[i]);
}

static void test_crossentropy(void **state)
{
    (void)state;
    const int B = 37, V = 10;
    size_t n = (size_t)B * V;
    float *z = rnd(n, 6);
    int32_t t[37];
    for (int i = 0; i < B; i++)
        t[i] = (int32_t)(rand_r(&g_seed) % V);
    float *loss = malloc(B * 4), *p = malloc(n * 4), *dz = malloc(n * 4);
    assert_int_equal(expert_crossentropy_forward(loss, p, z, t, B, V), 0);
    assert_int_equal(expert_crossentropy_backward(dz, p, t, 1.0f / B, B, V), 0);
    float *gz = up(z, n), *gl = nan_dev(B), *gp = nan_dev(n), *gdz = nan_dev(n);
    int32_t *gt = cuda_malloc(sizeof t);
    assert_non_null(gt);
    assert_int_equal(cuda_memcpy_h2d(gt, t, sizeof t), 0);
    assert_int_equal(G.crossentropy_forward(gl, gp, gz, gt, B, V), 0);
    assert_int_equal(G.crossentropy_backward(gdz, gp, gt, 1.0f / B, B, V), 0);
    float *hl = down(gl, B), *hp = down(gp, n), *hdz = down(gdz, n);
    check("xent loss", hl, loss, B, 1e-5f, 1e-5f);
    check("xent probs", hp, p, n, 1e-6f, 1e-5f);
    check("xent dlogits", hdz, dz, n, 1e-7f, 1e-5f);
    /* An out-of-range target is an error, as on the CPU. */
    t[3] = V;
    assert_int_equal(cuda_memcpy_h2d(gt, t, sizeof t), 0);
    assert_int_equal(G.crossentropy_forward(gl, gp, gz, gt, B, V), -EINVAL);
    cuda_free(gz);
    cuda_free(gl);
    cuda_free(gp);
    cuda_free(gdz);
    cuda_free(gt);
    float *fp[] = {z, loss, p, dz, hl, hp, hdz};
    for (size_t i = 0; i < sizeof fp / sizeof fp[0]; i++)
        free(fp[i]);
}

static void test_bad_arguments(void **state)
{
    (void)state;
    float *d = cuda_malloc(64);
    assert_int_equal(G.linear_forward(NULL, d, d, NULL, 1, 1, 1), -EINVAL);
    assert_int_equal(G.layernorm_forward(d, NULL, NULL, d, d, d, 1, 0), -EINVAL);
    assert_int_equal(G.gelu_forward(d, d, -1), -EINVAL);
    assert_int_equal(G.bias_gelu_backward(d, NULL, d, d, 1, 1), -EINVAL);
    cuda_free(d);
}


/* ---- matmul (the kinds' linear layer) in fp32 and bf16 ---- */

typedef decl_matmul_fwd_fn(mm_fwd_fn);
typedef decl_matmul_bwd_fn(mm_bwd_fn);

struct mm_shape {
    int B, C, OC;
    int odd; /* every tensor at an odd float offset (packed parameters) */
};

/* One shape through the forward's four epilogue combinations, res
 * aliasing out, and the backward: the accumulation contract (twice), dbias
 * NULL, dinp NULL, dinp aliasing inp. w and bias (and dw and dbias) sit in
 * one packed array each, as a block's flat parameters and gradients; the
 * slots around them hold NaN (parameters: reading outside shows) or 0
 * (gradients: writing outside shows). bf16: use_w16 passes the bf16 copy
 * of the packed parameters made by cuda_cast_bf16, else NULL. */
static void mm_case(const char *prec, mm_fwd_fn *fwd, mm_bwd_fn *bwd, int bf16, int use_w16,
                    struct mm_shape s)
{
    const int B = s.B, C = s.C, OC = s.OC;
    const size_t nin = (size_t)B * C, nw = (size_t)OC * C, nout = (size_t)B * OC;
    const float sw = 0.2f; /* w in [-0.2, 0.2]; inp, res, dout in [-1, 1]; bias in [-0.5, 0.5] */
    const size_t ao = s.odd ? 1 : 0;
    snprintf(g_case, sizeof g_case, "matmul %s%s B=%d C=%d OC=%d%s", prec,
             bf16 ? (use_w16 ? " (w16 given)" : " (w16 NULL)") : "", B, C, OC,
             s.odd ? " at odd offsets" : "");
    fprintf(stderr, "-- %s\n", g_case);

    float *x = hrnd(nin, 1), *w = hrnd(nw, sw), *bias = hrnd((size_t)OC, 0.5f);
    float *res = hrnd(nout, 1), *dy = hrnd(nout, 1);
    /* The GEMMs' operands as the contract says the backend sees them. */
    const float *xe = bf16 ? hbf16(x, nin) : x, *we = bf16 ? hbf16(w, nw) : w;
    const float *dye = bf16 ? hbf16(dy, nout) : dy;

    float *r_mm = hnew(nout), *r_b = hnew(nout), *r_r = hnew(nout), *r_rb = hnew(nout);
    OK(expert_matmul_forward(r_mm, NULL, xe, we, NULL, NULL, B, C, OC));
    OK(expert_matmul_forward(r_b, NULL, xe, we, NULL, bias, B, C, OC));
    OK(expert_matmul_forward(r_r, res, xe, we, NULL, NULL, B, C, OC));
    OK(expert_matmul_forward(r_rb, res, xe, we, NULL, bias, B, C, OC));
    float *r_dx = hnew(nin), *r_dw = hzero(nw), *r_db = hzero((size_t)OC);
    OK(expert_matmul_backward(r_dx, r_dw, NULL, dye, xe, we, NULL, B, C, OC));
    OK(expert_bias_backward(r_db, dy, B, OC)); /* dbias sums the fp32 dout in both */
    float *r_dw2 = hscaled(r_dw, nw, 2), *r_db2 = hscaled(r_db, (size_t)OC, 2);

    const double f = bf16 ? 64 : 16;
    const float at_f = mm_atol(f, C, 1, sw), at_dx = mm_atol(f, OC, 1, sw);
    const float at_dw = mm_atol(f, B, 1, 1), at_db = mm_atol(16, B, 1, 1), rt = 1e-5f;

    /* Packed parameters: [pad] w [pad] bias [pad], bias at an odd offset too. */
    size_t off_w = s.odd ? 1 : 0, off_b = off_w + nw;
    if (s.odd && off_b % 2 == 0)
        off_b++;
    const size_t np = off_b + (size_t)OC + 1;
    float *params = dnan(np, 0);
    h2d(params + off_w, w, nw);
    h2d(params + off_b, bias, (size_t)OC);
    const float *d_w = params + off_w, *d_b = params + off_b;
    const uint16_t *d_w16 = NULL;
    if (use_w16) {
        uint16_t *p16 = dhold(cuda_malloc(np * sizeof *p16));
        OK(G.cast_bf16(p16, params, np));
        d_w16 = p16 + off_w;
    }
    float *d_x = dup_dev(x, nin, ao), *d_res = dup_dev(res, nout, ao);
    float *d_dy = dup_dev(dy, nout, ao), *d_out = dnan(nout, ao);

    /* Forward, every combination of res and bias. */
    const struct {
        const char *name;
        int r, b;
        const float *want;
    } fv[4] = {
        { "out = inp·wᵀ", 0, 0, r_mm },
        { "out = inp·wᵀ + bias", 0, 1, r_b },
        { "out = res + inp·wᵀ", 1, 0, r_r },
        { "out = res + inp·wᵀ + bias", 1, 1, r_rb },
    };
    float *g_rb = NULL;
    for (int k = 0; k < 4; k++) {
        OK(cuda_memset(d_out, 0xFF, nout * sizeof(float)));
        OK(fwd(d_out, fv[k].r ? d_res : NULL, d_x, d_w, d_w16, fv[k].b ? d_b : NULL, B, C, OC));
        float *g = dl(d_out, nout);
        check(nm(fv[k].name), g, fv[k].want, nout, at_f, rt);
        if (k == 3)
            g_rb = g;
    }
    h2d(d_out, res, nout);
    OK(fwd(d_out, d_out, d_x, d_w, d_w16, d_b, B, C, OC));
    check(nm("out = out + inp·wᵀ + bias (res aliases out)"), dl(d_out, nout), r_rb, nout, at_f, rt);

    /* Backward into packed gradients. */
    float *grads = dzero(np, 0);
    float *d_dw = grads + off_w, *d_db = grads + off_b;
    float *d_dx = dnan(nin, ao);
    OK(bwd(d_dx, d_dw, d_db, d_dy, d_x, d_w, d_w16, B, C, OC));
    float *g_dx = dl(d_dx, nin), *g_dw = dl(d_dw, nw);
    check(nm("dinp"), g_dx, r_dx, nin, at_dx, rt);
    check(nm("dw"), g_dw, r_dw, nw, at_dw, rt);
    check(nm("dbias"), dl(d_db, (size_t)OC), r_db, (size_t)OC, at_db, rt);
    {
        float *g_all = dl(grads, np), *z = hzero(np);
        /* the slots outside dw and dbias: copy them out of both and compare */
        for (size_t i = 0; i < nw; i++)
            g_all[off_w + i] = 0;
        for (int i = 0; i < OC; i++)
            g_all[off_b + (size_t)i] = 0;
        check_bits(nm("gradient slots around dw and dbias stay 0"), g_all, z, np, 0);
    }

    /* The accumulation contract: again doubles dw and dbias, rewrites dinp. */
    OK(bwd(d_dx, d_dw, d_db, d_dy, d_x, d_w, d_w16, B, C, OC));
    check(nm("dinp after a second backward (=)"), dl(d_dx, nin), r_dx, nin, at_dx, rt);
    check(nm("dw after a second backward (+=, doubled)"), dl(d_dw, nw), r_dw2, nw, 2 * at_dw, rt);
    check(nm("dbias after a second backward (+=, doubled)"), dl(d_db, (size_t)OC), r_db2,
          (size_t)OC, 2 * at_db, rt);

    /* dbias NULL: dbias's slots are left alone. */
    OK(cuda_memset(grads, 0, np * sizeof(float)));
    OK(cuda_memset(d_dx, 0xFF, nin * sizeof(float)));
    OK(bwd(d_dx, d_dw, NULL, d_dy, d_x, d_w, d_w16, B, C, OC));
    check(nm("dinp (dbias NULL)"), dl(d_dx, nin), r_dx, nin, at_dx, rt);
    check(nm("dw (dbias NULL)"), dl(d_dw, nw), r_dw, nw, at_dw, rt);
    check_dev_bytes(nm("dbias untouched (dbias NULL)"), d_db, (size_t)OC * sizeof(float), 0);

    /* dinp NULL: the NaN-poisoned dinp buffer is not written. */
    OK(cuda_memset(grads, 0, np * sizeof(float)));
    OK(cuda_memset(d_dx, 0xFF, nin * sizeof(float)));
    OK(bwd(NULL, d_dw, d_db, d_dy, d_x, d_w, d_w16, B, C, OC));
    check(nm("dw (dinp NULL)"), dl(d_dw, nw), r_dw, nw, at_dw, rt);
    check(nm("dbias (dinp NULL)"), dl(d_db, (size_t)OC), r_db, (size_t)OC, at_db, rt);
    check_dev_bytes(nm("dinp buffer untouched (dinp NULL)"), d_dx, nin * sizeof(float), 0xFF);

    /* dinp aliasing inp: dw must still see the original inp. */
    OK(cuda_memset(grads, 0, np * sizeof(float)));
    float *d_xa = dup_dev(x, nin, ao);
    OK(bwd(d_xa, d_dw, d_db, d_dy, d_xa, d_w, d_w16, B, C, OC));
    check(nm("dinp (dinp aliases inp)"), dl(d_xa, nin), r_dx, nin, at_dx, rt);
    check(nm("dw (dinp aliases inp)"), dl(d_dw, nw), r_dw, nw, at_dw, rt);
    check(nm("dbias (dinp aliases inp)"), dl(d_db, (size_t)OC), r_db, (size_t)OC, at_db, rt);

    if (bf16) {
        /* (b) Against the plain fp32 reference, within the rigorous bound
         * (2·u16 + u16²)·Σ_k |a_k·b_k| per element. */
        float *f_rb = hnew(nout), *f_dx = hnew(nin), *f_dw = hzero(nw);
        OK(expert_matmul_forward(f_rb, res, x, w, NULL, bias, B, C, OC));
        OK(expert_matmul_backward(f_dx, f_dw, NULL, dy, x, w, NULL, B, C, OC));
        float *ax = habs(x, nin), *aw = habs(w, nw), *ady = habs(dy, nout);
        float *s_out = hnew(nout), *s_dx = hnew(nin), *s_dw = hzero(nw);
        OK(expert_matmul_forward(s_out, NULL, ax, aw, NULL, NULL, B, C, OC));
        OK(expert_matmul_backward(s_dx, s_dw, NULL, ady, ax, aw, NULL, B, C, OC));
        const float k16 = (float)((2 * U16 + U16 * U16) * (1 + 1e-5));
        for (size_t i = 0; i < nout; i++)
            s_out[i] *= k16;
        for (size_t i = 0; i < nin; i++)
            s_dx[i] *= k16;
        for (size_t i = 0; i < nw; i++)
            s_dw[i] *= k16;
        check_b(nm("out = res + inp·wᵀ + bias vs fp32 (bf16 bound)"), g_rb, f_rb, s_out, nout,
                mm_atol(16, C, 1, sw), rt);
        check_b(nm("dinp vs fp32 (bf16 bound)"), g_dx, f_dx, s_dx, nin, mm_atol(16, OC, 1, sw), rt);
        check_b(nm("dw vs fp32 (bf16 bound)"), g_dw, f_dw, s_dw, nw, mm_atol(16, B, 1, 1), rt);
    }
}

static const struct mm_shape mm_shapes[] = {
    { 37, 50, 23, 1 },   /* odd sizes, every tensor at an odd offset */
    { 37, 64, 48, 0 },   /* aligned: the bias epilogue path */
    { 1, 7, 3, 1 },      /* one row, tiny */
    { 64, 257, 65, 1 },
    { 200, 128, 384, 0 },
};

static void test_matmul_fp32(void **state)
{
    (void)state;
    for (size_t i = 0; i < sizeof mm_shapes / sizeof mm_shapes[0]; i++)
        mm_case("fp32", G.matmul_forward, G.matmul_backward, 0, 0, mm_shapes[i]);
}

static void test_matmul_bf16(void **state)
{
    (void)state;
    if (!g_be16)
        fail_msg("no bf16 CUDA backend (cuda_backend_get failed in main: see above)");
    for (size_t i = 0; i < sizeof mm_shapes / sizeof mm_shapes[0]; i++)
        for (int w16 = 1; w16 >= 0; w16--)
            mm_case("bf16", g_be16->ops.matmul_forward, g_be16->ops.matmul_backward, 1, w16,
                    mm_shapes[i]);
}

/* ---- attention ---- */

struct att_case {
    int B, T, C, NH;
    float loose; /* tolerance multiplier */
};

/* dst (rows, C) = the part'th C columns of src (rows, 3C). */
static float *qkv_part(const float *src, size_t rows, int C, int part)
{
    float *d = hnew(rows * (size_t)C);
    for (size_t r = 0; r < rows; r++)
        memcpy(d + r * (size_t)C, src + r * 3 * (size_t)C + (size_t)part * (size_t)C,
               (size_t)C * sizeof(float));
    return d;
}

static void att_run(struct att_case a)
{
    const int B = a.B, T = a.T, C = a.C, NH = a.NH, hd = C / NH;
    const size_t rows = (size_t)B * T, nqkv = rows * 3 * (size_t)C, nout = rows * (size_t)C;
    snprintf(g_case, sizeof g_case, "attention B=%d T=%d C=%d NH=%d (hd %d)", B, T, C, NH, hd);
    fprintf(stderr, "-- %s\n", g_case);

    /* q and k in [-3, 3] (scores spread over e^±9: the max subtraction
     * matters), v and dout in [-1, 1]. */
    float *qkv = hnew(nqkv);
    for (size_t r = 0; r < rows; r++)
        for (int c = 0; c < 3 * C; c++)
            qkv[r * 3 * (size_t)C + (size_t)c] =
                ((float)rand_r(&g_seed) / (float)RAND_MAX * 2.0f - 1.0f) * (c < 2 * C ? 3.0f : 1.0f);
    float *dout = hrnd(nout, 1);

    const size_t natt = (size_t)B * NH * T * T;
    float *r_out = hnew(nout), *r_att = hnew(natt), *r_scr = hnew(natt), *r_dqkv = hnew(nqkv);
    OK(expert_attention_forward(r_out, r_att, qkv, B, T, C, NH));
    OK(expert_attention_backward(r_dqkv, r_scr, dout, qkv, r_att, B, T, C, NH));

    size_t ns = 0, nsc = 0;
    G.attention_sizes(T, NH, &ns, &nsc);
    check_true(nm("attention_sizes: NH·T saved and scratch floats per sequence"),
               ns == (size_t)NH * T && nsc == (size_t)NH * T);
    if (ns < (size_t)NH * T || nsc < (size_t)NH * T)
        fail_msg("%s: attention_sizes gave saved %zu scratch %zu floats per sequence", g_case, ns,
                 nsc);

    float *d_qkv = dup_dev(qkv, nqkv, 0), *d_dout = dup_dev(dout, nout, 0);
    float *d_out = dnan(nout, 0), *d_saved = dnan((size_t)B * ns, 0);
    float *d_scr = dnan((size_t)B * nsc, 0), *d_dqkv = dnan(nqkv, 0);
    OK(G.attention_forward(d_out, d_saved, d_qkv, B, T, C, NH));
    float *g_out = dl(d_out, nout);
    const float L = a.loose;
    check(nm("out"), g_out, r_out, nout, 3e-5f * L, 3e-4f * L);

    OK(G.attention_backward(d_dqkv, d_scr, d_dout, d_out, d_qkv, d_saved, B, T, C, NH));
    float *g_dqkv = dl(d_dqkv, nqkv);
    static const char *part_name[3] = { "dq", "dk", "dv" };
    for (int p = 0; p < 3; p++)
        check(nm(part_name[p]), qkv_part(g_dqkv, rows, C, p), qkv_part(r_dqkv, rows, C, p), nout,
              2e-4f * L, 2e-3f * L);

    /* Determinism: the same bits again (into freshly poisoned outputs). */
    float *d_out2 = dnan(nout, 0), *d_saved2 = dnan((size_t)B * ns, 0), *d_dqkv2 = dnan(nqkv, 0);
    OK(G.attention_forward(d_out2, d_saved2, d_qkv, B, T, C, NH));
    check_bits(nm("out, second run"), dl(d_out2, nout), g_out, nout, 0);
    OK(G.attention_backward(d_dqkv2, d_scr, d_dout, d_out, d_qkv, d_saved, B, T, C, NH));
    check_bits(nm("dqkv, second run"), dl(d_dqkv2, nqkv), g_dqkv, nqkv, 0);
}

static void test_attention(void **state)
{
    (void)state;
    const struct att_case cases[] = {
        { 2, 1, 64, 4, 1 },      /* T = 1 */
        { 1, 1, 256, 2, 1 },     /* T = 1, hd 128 */
        { 2, 67, 16, 2, 1 },     /* hd 8 (padded to 32) */
        { 2, 67, 64, 2, 1 },     /* hd 32 */
        { 2, 67, 128, 2, 1 },    /* hd 64 */
        { 1, 130, 256, 2, 1 },   /* hd 128, T = 2 tiles + 2 */
        { 2, 67, 96, 2, 1 },     /* hd 48 (padded to 64) */
        { 3, 64, 48, 3, 1 },     /* hd 16, T exactly one tile */
        { 2, 67, 320, 2, 1 },    /* hd 160: the generic fallback */
        { 1, 33, 200, 1, 1 },    /* hd 200, one head: fallback */
        { 1, 1024, 64, 2, 4 },   /* long: 16 tiles of keys per row tile */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        att_run(cases[i]);
}

/* ---- attention in bf16 (the bf16 backend's table) ---- */

struct att16_case {
    int B, T, C, NH;
    int tc;      /* the bf16 kernels run (else the fp32 functions' bits) */
    size_t off;  /* every tensor at this float offset (1: unaligned) */
    float ramp;  /* > 0: scores growing by about this much along the sequence */
};

static void att16_run(struct att16_case a)
{
    const int B = a.B, T = a.T, C = a.C, NH = a.NH, hd = C / NH;
    const size_t rows = (size_t)B * T, nqkv = rows * 3 * (size_t)C, nout = rows * (size_t)C;
    const size_t nsv = (size_t)B * NH * T, off = a.off;
    snprintf(g_case, sizeof g_case, "attention bf16 B=%d T=%d C=%d NH=%d (hd %d)%s%s", B, T, C, NH,
             hd, off ? " unaligned" : "", a.ramp > 0 ? " ramp" : "");
    fprintf(stderr, "-- %s\n", g_case);
    const struct expert_ops *o16 = &g_be16->ops;

    float *qkv = hnew(nqkv);
    for (size_t r = 0; r < rows; r++)
        for (int c = 0; c < 3 * C; c++)
            qkv[r * 3 * (size_t)C + (size_t)c] =
                ((float)rand_r(&g_seed) / (float)RAND_MAX * 2.0f - 1.0f) * (c < 2 * C ? 3.0f : 1.0f);
    if (a.ramp > 0) /* q >= 0, k rising with the position: every row's max keeps growing */
        for (size_t r = 0; r < rows; r++)
            for (int c = 0; c < C; c++) {
                float *x = qkv + r * 3 * (size_t)C;
                x[c] = fabsf(x[c]);
                x[C + c] = x[C + c] * 0.1f +
                           (float)(a.ramp / (1.5 * sqrt((double)hd)) * (double)(r % (size_t)T) / T);
            }
    float *dout = hrnd(nout, 1);

    float *d_qkv = dup_dev(qkv, nqkv, off), *d_dout = dup_dev(dout, nout, off);
    float *d_out = dnan(nout, off), *d_saved = dnan(nsv, off), *d_scr = dnan(nsv, off);
    float *d_dqkv = dnan(nqkv, off);
    OK(o16->attention_forward(d_out, d_saved, d_qkv, B, T, C, NH));
    OK(o16->attention_backward(d_dqkv, d_scr, d_dout, d_out, d_qkv, d_saved, B, T, C, NH));
    float *g_out = dl(d_out, nout), *g_saved = dl(d_saved, nsv), *g_dqkv = dl(d_dqkv, nqkv);

    if (a.tc) {
        /* The CPU on the inputs rounded as the kernels round them. */
        float *qkv_r = hnew(nqkv), *dout_r = hnew(nout);
        att_b16_round(qkv_r, qkv, nqkv);
        att_b16_round(dout_r, dout, nout);
        const size_t natt = (size_t)B * NH * T * T;
        float *r_out = hnew(nout), *r_att = hnew(natt), *r_scr = hnew(natt), *r_dqkv = hnew(nqkv);
        OK(expert_attention_forward(r_out, r_att, qkv_r, B, T, C, NH));
        OK(expert_attention_backward(r_dqkv, r_scr, dout_r, qkv_r, r_att, B, T, C, NH));
        double *lse = hold(malloc(nsv * sizeof *lse));
        float *b_out = hnew(nout), *b_lse = hnew(nsv), *b_dqkv = hnew(nqkv), *r_lse = hnew(nsv);
        if (att_b16_bounds(qkv_r, dout_r, g_out, B, T, C, NH, lse, b_out, b_lse, b_dqkv) != 0)
            fail_msg("%s: out of memory for the bounds", g_case);
        for (size_t i = 0; i < nsv; i++)
            r_lse[i] = (float)lse[i];
        check_b(nm("out (bf16 bound)"), g_out, r_out, b_out, nout, 1e-6f, 0);
        check_b(nm("saved log-sum-exp (fp32 bound)"), g_saved, r_lse, b_lse, nsv, 1e-6f, 0);
        static const char *part_name[3] = { "dq (bf16 bound)", "dk (bf16 bound)", "dv (bf16 bound)" };
        for (int p = 0; p < 3; p++)
            check_b(nm(part_name[p]), qkv_part(g_dqkv, rows, C, p), qkv_part(r_dqkv, rows, C, p),
                    qkv_part(b_dqkv, rows, C, p), nout, 1e-6f, 0);
    } else {
        /* Other head sizes: the fp32 functions, bit for bit. */
        float *d_out2 = dnan(nout, 0), *d_saved2 = dnan(nsv, 0), *d_dqkv2 = dnan(nqkv, 0);
        OK(G.attention_forward(d_out2, d_saved2, d_qkv, B, T, C, NH));
        OK(G.attention_backward(d_dqkv2, d_scr, d_dout, d_out2, d_qkv, d_saved2, B, T, C, NH));
        check_bits(nm("out = the fp32 path's"), g_out, dl(d_out2, nout), nout, 0);
        check_bits(nm("saved = the fp32 path's"), g_saved, dl(d_saved2, nsv), nsv, 0);
        check_bits(nm("dqkv = the fp32 path's"), g_dqkv, dl(d_dqkv2, nqkv), nqkv, 0);
    }
    size_t nonfinite = 0;
    for (size_t i = 0; i < nqkv; i++)
        nonfinite += !isfinite(g_dqkv[i]);
    check_true(nm("dqkv fully written (NaN-poisoned first)"), nonfinite == 0);

    /* Determinism: the same bits again, into freshly poisoned outputs. */
    float *d_out2 = dnan(nout, off), *d_saved2 = dnan(nsv, off), *d_dqkv2 = dnan(nqkv, off);
    OK(o16->attention_forward(d_out2, d_saved2, d_qkv, B, T, C, NH));
    check_bits(nm("out, second run"), dl(d_out2, nout), g_out, nout, 0);
    check_bits(nm("saved, second run"), dl(d_saved2, nsv), g_saved, nsv, 0);
    OK(o16->attention_backward(d_dqkv2, d_scr, d_dout, d_out, d_qkv, d_saved, B, T, C, NH));
    check_bits(nm("dqkv, second run"), dl(d_dqkv2, nqkv), g_dqkv, nqkv, 0);
}

static void test_attention_bf16(void **state)
{
    (void)state;
    if (!g_be16)
        fail_msg("no bf16 CUDA backend (cuda_backend_get failed in main: see above)");
    const struct att16_case cases[] = {
        { 2, 1, 64, 2, 1, 0, 0 },      /* T = 1, hd 32 */
        { 1, 16, 128, 2, 1, 0, 0 },    /* T = 16, hd 64 */
        { 2, 67, 64, 2, 1, 0, 0 },     /* hd 32, 2 tiles, the last 3 rows */
        { 1, 130, 256, 2, 1, 0, 0 },   /* hd 128, 3 tiles */
        { 1, 256, 128, 2, 1, 0, 0 },   /* hd 64, 4 tiles */
        { 2, 67, 96, 2, 1, 0, 0 },     /* hd 48 (padded to 64) */
        { 3, 64, 48, 3, 1, 0, 0 },     /* hd 16 (padded to 32), T one tile */
        { 1, 67, 128, 2, 1, 1, 0 },    /* every tensor at an odd float offset */
        { 1, 256, 128, 2, 1, 0, 60 },  /* rising maxima: the forward rescales */
        { 2, 130, 64, 2, 1, 0, 400 },  /* steep: the rescale factor underflows to 0 */
        { 1, 1024, 128, 2, 1, 0, 0 },  /* long: 16 key tiles per query tile, hd 64 */
        { 1, 33, 200, 1, 0, 0, 0 },    /* hd 200: the fp32 path */
        { 2, 40, 80, 2, 0, 0, 0 },     /* hd 40 (not a multiple of 16): the fp32 path */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        att16_run(cases[i]);
}

/* ---- embedding ---- */

static void test_embedding(void **state)
{
    (void)state;
    const int B = 4, T = 67, C = 50, V = 97, TMAX = 80; /* wpe longer than T */
    const size_t n = (size_t)B * T, nout = n * (size_t)C;
    const size_t nwte = (size_t)V * C, nwpe = (size_t)TMAX * C;
    snprintf(g_case, sizeof g_case, "embedding B=%d T=%d C=%d V=%d (wpe %d rows)", B, T, C, V, TMAX);
    fprintf(stderr, "-- %s\n", g_case);

    /* Every other position is token 7 (134 repeats), the rest random,
     * with the first and the last token ids present. */
    int32_t *tok = hold(malloc(n * sizeof *tok));
    for (size_t i = 0; i < n; i++)
        tok[i] = i % 2 == 0 ? 7 : (int32_t)(rand_r(&g_seed) % (unsigned)V);
    tok[1] = 0;
    tok[3] = V - 1;
    int kmax = 0;
    for (int v = 0; v < V; v++) {
        int k = 0;
        for (size_t i = 0; i < n; i++)
            k += tok[i] == v;
        kmax = k > kmax ? k : kmax;
    }

    float *wte = hrnd(nwte, 1), *wpe = hrnd(nwpe, 1), *dout = hrnd(nout, 1);
    float *r_out = hnew(nout);
    OK(expert_embedding_forward(r_out, tok, wte, wpe, B, T, C, V));
    float *d_wte = dup_dev(wte, nwte, 0), *d_wpe = dup_dev(wpe, nwpe, 0), *d_out = dnan(nout, 0);
    OK(G.embedding_forward(d_out, tok, d_wte, d_wpe, B, T, C, V));
    /* One add per element, the same on both: exact. */
    check(nm("out (exact)"), dl(d_out, nout), r_out, nout, 0, 0);

    /* Backward onto non-zero gradients (+=); wpe rows >= T stay as they were. */
    float *g0te = hrnd(nwte, 1), *g0pe = hrnd(nwpe, 1);
    float *r_dwte = hdup(g0te, nwte), *r_dwpe = hdup(g0pe, nwpe);
    OK(expert_embedding_backward(r_dwte, r_dwpe, dout, tok, B, T, C, V));
    float *d_dout = dup_dev(dout, nout, 0);
    float *d_dwte = dup_dev(g0te, nwte, 0), *d_dwpe = dup_dev(g0pe, nwpe, 0);
    OK(G.embedding_backward(d_dwte, d_dwpe, d_dout, tok, B, T, C, V));
    /* A sum of up to kmax terms in [-1, 1] onto a value in [-1, 1]. */
    check(nm("dwte (+=)"), dl(d_dwte, nwte), r_dwte, nwte, mm_atol(16, kmax + 1, 1, 1), 1e-5f);
    check(nm("dwpe (+=)"), dl(d_dwpe, nwpe), r_dwpe, nwpe, mm_atol(16, B + 1, 1, 1), 1e-5f);

    /* Determinism: twice from zero, the same bits. */
    OK(cuda_memset(d_dwte, 0, nwte * sizeof(float)));
    OK(cuda_memset(d_dwpe, 0, nwpe * sizeof(float)));
    OK(G.embedding_backward(d_dwte, d_dwpe, d_dout, tok, B, T, C, V));
    float *a_te = dl(d_dwte, nwte), *a_pe = dl(d_dwpe, nwpe);
    OK(cuda_memset(d_dwte, 0, nwte * sizeof(float)));
    OK(cuda_memset(d_dwpe, 0, nwpe * sizeof(float)));
    OK(G.embedding_backward(d_dwte, d_dwpe, d_dout, tok, B, T, C, V));
    check_bits(nm("dwte, second run from zero"), dl(d_dwte, nwte), a_te, nwte, 0);
    check_bits(nm("dwpe, second run from zero"), dl(d_dwpe, nwpe), a_pe, nwpe, 0);

    /* Out of range (the last token V, then the first -1): -EINVAL and
     * nothing written. */
    int32_t *bad = hold(malloc(n * sizeof *bad));
    for (int which = 0; which < 2; which++) {
        memcpy(bad, tok, n * sizeof *bad);
        if (which == 0)
            bad[n - 1] = V;
        else
            bad[0] = -1;
        const char *tag = which == 0 ? "token V at the end" : "token -1 at the start";
        char what[96];
        OK(cuda_memset(d_out, 0xFF, nout * sizeof(float)));
        int rc = G.embedding_forward(d_out, bad, d_wte, d_wpe, B, T, C, V);
        snprintf(what, sizeof what, "forward with %s: -EINVAL (got %d)", tag, rc);
        check_true(nm(what), rc == -EINVAL);
        snprintf(what, sizeof what, "forward with %s: out untouched", tag);
        check_dev_bytes(nm(what), d_out, nout * sizeof(float), 0xFF);
        h2d(d_dwte, g0te, nwte);
        h2d(d_dwpe, g0pe, nwpe);
        rc = G.embedding_backward(d_dwte, d_dwpe, d_dout, bad, B, T, C, V);
        snprintf(what, sizeof what, "backward with %s: -EINVAL (got %d)", tag, rc);
        check_true(nm(what), rc == -EINVAL);
        snprintf(what, sizeof what, "backward with %s: dwte unchanged", tag);
        check_bits(nm(what), dl(d_dwte, nwte), g0te, nwte, 0);
        snprintf(what, sizeof what, "backward with %s: dwpe unchanged", tag);
        check_bits(nm(what), dl(d_dwpe, nwpe), g0pe, nwpe, 0);
    }
}

/* ---- softmax ---- */

static void test_softmax(void **state)
{
    (void)state;
    const struct {
        int N, V;
        float scale;
    } cases[] = { { 37, 300, 5 }, { 5, 1, 1 }, { 3, 33, 1 }, { 64, 1000, 30 } };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const int N = cases[c].N, V = cases[c].V;
        const size_t n = (size_t)N * V;
        snprintf(g_case, sizeof g_case, "softmax N=%d V=%d logits in ±%g", N, V,
                 (double)cases[c].scale);
        fprintf(stderr, "-- %s\n", g_case);
        float *x = hrnd(n, cases[c].scale), *dy = hrnd(n, 1);
        float *r_y = hnew(n), *r_dx = hnew(n);
        OK(expert_softmax_forward(r_y, x, N, V));
        OK(expert_softmax_backward(r_dx, dy, r_y, N, V));
        /* Probabilities: expf against the CPU's polynomial exp (2e-7
         * relative) and a sum of V terms: 1e-5 relative; 1e-7 absolute for
         * the tiny ones (the CPU flushes exp(< -87) to 0). dinp =
         * y·(dy − ⟨dy, y⟩): the dot's rounding (a few u, Σy = 1) times y. */
        float *d_x = dup_dev(x, n, 0), *d_y = dnan(n, 0);
        OK(G.softmax_forward(d_y, d_x, N, V));
        check(nm("out"), dl(d_y, n), r_y, n, 1e-7f, 1e-5f);
        OK(G.softmax_forward(d_x, d_x, N, V));
        check(nm("out (aliases inp)"), dl(d_x, n), r_y, n, 1e-7f, 1e-5f);
        /* The backward from the CPU's probabilities, so only it differs. */
        float *d_ry = dup_dev(r_y, n, 0), *d_dy = dup_dev(dy, n, 0), *d_dx = dnan(n, 0);
        OK(G.softmax_backward(d_dx, d_dy, d_ry, N, V));
        check(nm("dinp"), dl(d_dx, n), r_dx, n, 1e-6f, 1e-5f);
        OK(G.softmax_backward(d_dy, d_dy, d_ry, N, V));
        check(nm("dinp (aliases dout)"), dl(d_dy, n), r_dx, n, 1e-6f, 1e-5f);
    }
}

/* ---- the step: sqnorm, AdamW, SGD, the bf16 cast ---- */

static void test_sqnorm(void **state)
{
    (void)state;
    const size_t sizes[] = { 0, 1, 4097, 1000003 };
    for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
        const size_t n = sizes[k];
        snprintf(g_case, sizeof g_case, "sqnorm n=%zu", n);
        fprintf(stderr, "-- %s\n", g_case);
        float *x = hrnd(n, 3);
        float *d = dup_dev(x, n, 1); /* at an odd offset */
        double cpu = NAN, g1 = NAN, g2 = NAN;
        OK(expert_sqnorm_op(&cpu, x, n));
        OK(G.sqnorm(&g1, d, n));
        OK(G.sqnorm(&g2, d, n));
        if (n == 0) {
            check_true(nm("Σ x² of nothing is 0 (written)"), g1 == 0.0 && cpu == 0.0);
            continue;
        }
        /* Both sum in double, in different orders: the rounding of n
         * additions of positive terms is below n·2^-53 ≈ 1e-10 relative at
         * the very worst, ~1e-15 in practice. */
        check_d(nm("Σ x² vs expert_sqnorm_op"), g1, cpu, 1e-12);
        check_true(nm("the same bits on a second run"), memcmp(&g1, &g2, sizeof g1) == 0);
    }
}

/* Σ over the CPU's outputs of what the update's sums hold, in long double. */
static void exact_sums(const float *p_out, const float *p_in, size_t n, double out[2])
{
    long double dd = 0, pp = 0;
    for (size_t i = 0; i < n; i++) {
        float d = p_out[i] - p_in[i];
        dd += (long double)d * d;
        pp += (long double)p_out[i] * p_out[i];
    }
    out[0] = (double)dd;
    out[1] = (double)pp;
}

/* The CPU keeps the sums in 16 float lanes: a lane of k = n/16 positive
 * terms has a relative error of about u·√k/3 (worst case k·u); the GPU's
 * are double. 1e-6 + 4·u·√k is ≥ 40 of those standard deviations. */
static double lanes_rtol(size_t n)
{
    return 1e-6 + 4 * U32 * sqrt((double)n / 16 + 1);
}

/* The checks of an update's sums, or of its non-finite sums[1]. */
static void check_sums(const double gs[2], const double cs[2], const double init[2],
                       const float *p_out, const float *p_in, size_t n, int nonfinite)
{
    if (nonfinite) {
        check_true(nm("a non-finite gradient gives a non-finite sums[1] (GPU)"), !isfinite(gs[1]));
        check_true(nm("a non-finite gradient gives a non-finite sums[1] (CPU)"), !isfinite(cs[1]));
        return;
    }
    double ex[2];
    exact_sums(p_out, p_in, n, ex);
    check_d(nm("sums[0] += Σ Δp² vs exact (GPU)"), gs[0], init[0] + ex[0], 1e-12);
    check_d(nm("sums[1] += Σ p'² vs exact (GPU)"), gs[1], init[1] + ex[1], 1e-12);
    check_d(nm("sums[0] vs the CPU's (float lanes)"), gs[0] - init[0], cs[0], lanes_rtol(n));
    check_d(nm("sums[1] vs the CPU's (float lanes)"), gs[1] - init[1], cs[1], lanes_rtol(n));
}

static void adamw_case(size_t n, uint64_t t, float wd, int nonfinite)
{
    struct expert_optim o;
    expert_optim_default_adamw(&o);
    o.lr = 3e-3f;
    o.weight_decay = wd;
    snprintf(g_case, sizeof g_case, "adamw n=%zu t=%llu lr=%g wd=%g%s", n, (unsigned long long)t,
             (double)o.lr, (double)wd,
             nonfinite == 1 ? " with a NaN gradient" : nonfinite == 2 ? " with an Inf gradient" : "");
    fprintf(stderr, "-- %s\n", g_case);
    const float gscale = 0.7f;
    float *p = hrnd(n, 1), *g = hrnd(n, 2);
    float *m = t > 1 ? hrnd(n, 0.1f) : hzero(n);
    float *v = t > 1 ? habs(hrnd(n, 0.01f), n) : hzero(n);
    if (nonfinite)
        g[n / 2] = nonfinite == 1 ? NAN : INFINITY;

    float *c_p = hnew(n), *c_m = hdup(m, n), *c_v = hdup(v, n);
    double cs[2] = { 0, 0 };
    OK(expert_adamw_op(c_p, p, g, c_m, c_v, n, gscale, &o, t, cs));

    /* The GPU's sums start from the CPU's (finite case): += shows. */
    double init[2] = { nonfinite ? 0 : cs[0], nonfinite ? 0 : cs[1] };
    double gs[2] = { init[0], init[1] };
    float *d_p = dup_dev(p, n, 0), *d_g = dup_dev(g, n, 0), *d_m = dup_dev(m, n, 0);
    float *d_v = dup_dev(v, n, 0), *d_po = dnan(n, 0);
    OK(G.adamw_update(d_po, d_p, d_g, d_m, d_v, n, gscale, &o, t, gs));
    float *g_p = dl(d_po, n);
    check_bits(nm("p_out vs expert_adamw_op"), g_p, c_p, n, 1);
    check_bits(nm("m vs expert_adamw_op"), dl(d_m, n), c_m, n, 1);
    check_bits(nm("v vs expert_adamw_op"), dl(d_v, n), c_v, n, 1);
    check_bits(nm("p_in unchanged"), dl(d_p, n), p, n, 0);
    check_sums(gs, cs, init, c_p, p, n, nonfinite);
}

static void test_adamw(void **state)
{
    (void)state;
    adamw_case(1, 1, 0, 0);
    adamw_case(4097, 1, 0, 0);
    adamw_case(4097, 7, 0.1f, 0);
    adamw_case(100003, 1000, 0.01f, 0);
    adamw_case(4097, 3, 0.1f, 1);
    adamw_case(4097, 3, 0, 2);
}

static void sgd_case(size_t n, float momentum, float wd, int warm, int nonfinite)
{
    struct expert_optim o;
    expert_optim_default_sgd(&o);
    o.momentum = momentum;
    o.weight_decay = wd;
    snprintf(g_case, sizeof g_case, "sgd n=%zu lr=%g momentum=%g wd=%g%s%s", n, (double)o.lr,
             (double)momentum, (double)wd, warm ? " (buffer warm)" : "",
             nonfinite == 1 ? " with a NaN gradient" : nonfinite == 2 ? " with an Inf gradient" : "");
    fprintf(stderr, "-- %s\n", g_case);
    const float gscale = 0.7f;
    float *p = hrnd(n, 1), *g = hrnd(n, 2), *buf = warm ? hrnd(n, 0.5f) : hzero(n);
    if (nonfinite)
        g[n / 2] = nonfinite == 1 ? NAN : INFINITY;
    float *c_p = hnew(n), *c_buf = hdup(buf, n);
    double cs[2] = { 0, 0 };
    OK(expert_sgd_op(c_p, p, g, c_buf, n, gscale, &o, cs));
    double init[2] = { nonfinite ? 0 : cs[0], nonfinite ? 0 : cs[1] };
    double gs[2] = { init[0], init[1] };
    float *d_p = dup_dev(p, n, 0), *d_g = dup_dev(g, n, 0), *d_buf = dup_dev(buf, n, 0);
    float *d_po = dnan(n, 0);
    OK(G.sgd_update(d_po, d_p, d_g, d_buf, n, gscale, &o, gs));
    float *g_p = dl(d_po, n);
    check_bits(nm("p_out vs expert_sgd_op"), g_p, c_p, n, 1);
    check_bits(nm("momentum buffer vs expert_sgd_op"), dl(d_buf, n), c_buf, n, 1);
    check_sums(gs, cs, init, c_p, p, n, nonfinite);
}

static void test_sgd(void **state)
{
    (void)state;
    sgd_case(1, 0.9f, 0, 0, 0);
    sgd_case(4097, 0.9f, 0, 1, 0);
    sgd_case(4097, 0, 0.01f, 0, 0);
    sgd_case(100003, 0.9f, 0.01f, 1, 0);
    sgd_case(4097, 0.9f, 0, 1, 1);
    sgd_case(4097, 0.9f, 0, 1, 2);
}

static float f32_of_bits(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static void test_cast_bf16(void **state)
{
    (void)state;
    snprintf(g_case, sizeof g_case, "cast_bf16");
    /* Special values with their bf16 by hand (round to nearest even; a NaN
     * keeps a set quiet bit), then random bit patterns (NaNs, denormals,
     * infinities among them). */
    static const struct {
        uint32_t in;
        uint16_t out;
    } sp[] = {
        { 0x00000000u, 0x0000 }, { 0x80000000u, 0x8000 },  /* ±0 */
        { 0x3f800000u, 0x3f80 }, { 0xbf800000u, 0xbf80 },  /* ±1 */
        { 0x3f808000u, 0x3f80 },                           /* tie, even below: down */
        { 0x3f818000u, 0x3f82 },                           /* tie, odd below: up */
        { 0x3f808001u, 0x3f81 }, { 0x3f807fffu, 0x3f80 },  /* just above / below a tie */
        { 0xbf818000u, 0xbf82 },                           /* a negative tie */
        { 0x7f7fffffu, 0x7f80 },                           /* FLT_MAX rounds to Inf */
        { 0x7f7f8000u, 0x7f80 },                           /* tie at the top: up to Inf */
        { 0x7f7f7fffu, 0x7f7f },
        { 0x00000001u, 0x0000 }, { 0x00008000u, 0x0000 },  /* denormals: tie to even 0 */
        { 0x00018000u, 0x0002 }, { 0x807fffffu, 0x8080 },
        { 0x7f800000u, 0x7f80 }, { 0xff800000u, 0xff80 },  /* ±Inf */
        { 0x7fc00000u, 0x7fc0 }, { 0xffc00000u, 0xffc0 },  /* quiet NaNs */
        { 0x7f800001u, 0x7fc0 }, { 0xff800001u, 0xffc0 },  /* NaNs that truncate to Inf */
        { 0x7fffffffu, 0x7fff }, { 0x7f810000u, 0x7fc1 },
    };
    const size_t ns = sizeof sp / sizeof sp[0], nr = 100003, n = ns + nr;
    float *src = hnew(n);
    for (size_t i = 0; i < ns; i++)
        src[i] = f32_of_bits(sp[i].in);
    for (size_t i = ns; i < n; i++) {
        uint32_t u = ((uint32_t)rand_r(&g_seed) << 16) ^ (uint32_t)rand_r(&g_seed);
        src[i] = f32_of_bits(i % 2 ? u : f32_bits((float)rand_r(&g_seed) / (float)RAND_MAX - 0.5f));
    }
    uint16_t *cpu = hold(malloc(n * sizeof *cpu)), *gpu = hold(malloc((n + 1) * sizeof *gpu));
    OK(expert_cast_bf16(cpu, src, n));
    size_t hand = 0;
    for (size_t i = 0; i < ns; i++)
        if (cpu[i] != sp[i].out) {
            fprintf(stderr, "  CPU cast of 0x%08x: 0x%04x, expected 0x%04x\n", (unsigned)sp[i].in,
                    cpu[i], sp[i].out);
            hand++;
        }
    check_true("cast_bf16: the CPU reference gives the hand-made special values", hand == 0);

    /* src and dst at odd offsets (4- and 2-byte aligned). */
    float *d_src = dup_dev(src, n, 1);
    uint16_t *d_base = dhold(cuda_malloc((n + 1) * sizeof *d_base)), *d_dst = d_base + 1;
    OK(cuda_memset(d_base, 0xFF, (n + 1) * sizeof *d_base));
    OK(G.cast_bf16(d_dst, d_src, n));
    OK(cuda_sync());
    OK(cuda_memcpy_d2h(gpu, d_base, (n + 1) * sizeof *gpu));
    size_t miss = 0;
    for (size_t i = 0; i < n; i++)
        if (gpu[i + 1] != cpu[i]) {
            if (miss < 8)
                fprintf(stderr, "  cast_bf16 [%zu]: 0x%08x -> GPU 0x%04x, CPU 0x%04x\n", i,
                        (unsigned)f32_bits(src[i]), gpu[i + 1], cpu[i]);
            miss++;
        }
    fprintf(stderr, "%s cast_bf16: %zu values (%zu special) bit for bit%s\n", miss ? "FAIL" : "ok  ",
            n, ns, miss ? "; some differ" : "");
    if (miss)
        g_bad++;
    check_true("cast_bf16: the element before dst untouched", gpu[0] == 0xFFFF);
    /* n = 0 writes nothing and succeeds. */
    OK(G.cast_bf16(d_dst, d_src, 0));
}

/* ---- determinism of the summing backwards over many rows ---- */

static void test_determinism(void **state)
{
    (void)state;
    const int B = 4096; /* 16 chunks of 256 rows in cuda__colsum_add */

    /* matmul backward, fp32 and bf16: dinp, dw, dbias twice from zero. */
    for (int bf = 0; bf < 2; bf++) {
        const int C = 100, OC = 72;
        const size_t nin = (size_t)B * C, nw = (size_t)OC * C, nout = (size_t)B * OC;
        mm_bwd_fn *bwd = bf ? (g_be16 ? g_be16->ops.matmul_backward : NULL) : G.matmul_backward;
        snprintf(g_case, sizeof g_case, "determinism: matmul backward %s B=%d C=%d OC=%d",
                 bf ? "bf16" : "fp32", B, C, OC);
        fprintf(stderr, "-- %s\n", g_case);
        if (!bwd)
            fail_msg("%s: no bf16 backend", g_case);
        float *x = hrnd(nin, 1), *w = hrnd(nw, 0.2f), *dy = hrnd(nout, 1);
        float *d_x = dup_dev(x, nin, 0), *d_w = dup_dev(w, nw, 0), *d_dy = dup_dev(dy, nout, 0);
        float *d_dx = dnan(nin, 0), *d_dw = dzero(nw, 0), *d_db = dzero((size_t)OC, 0);
        OK(bwd(d_dx, d_dw, d_db, d_dy, d_x, d_w, NULL, B, C, OC));
        float *a_dx = dl(d_dx, nin), *a_dw = dl(d_dw, nw), *a_db = dl(d_db, (size_t)OC);
        OK(cuda_memset(d_dx, 0xFF, nin * sizeof(float)));
        OK(cuda_memset(d_dw, 0, nw * sizeof(float)));
        OK(cuda_memset(d_db, 0, (size_t)OC * sizeof(float)));
        OK(bwd(d_dx, d_dw, d_db, d_dy, d_x, d_w, NULL, B, C, OC));
        check_bits(nm("dinp, second run"), dl(d_dx, nin), a_dx, nin, 0);
        check_bits(nm("dw, second run"), dl(d_dw, nw), a_dw, nw, 0);
        check_bits(nm("dbias, second run"), dl(d_db, (size_t)OC), a_db, (size_t)OC, 0);
        /* and right */
        const float *xe = bf ? hbf16(x, nin) : x, *we = bf ? hbf16(w, nw) : w;
        const float *dye = bf ? hbf16(dy, nout) : dy;
        float *r_dx = hnew(nin), *r_dw = hzero(nw), *r_db = hzero((size_t)OC);
        OK(expert_matmul_backward(r_dx, r_dw, NULL, dye, xe, we, NULL, B, C, OC));
        OK(expert_bias_backward(r_db, dy, B, OC));
        const double f = bf ? 64 : 16;
        check(nm("dinp vs CPU"), a_dx, r_dx, nin, mm_atol(f, OC, 1, 0.2), 1e-5f);
        check(nm("dw vs CPU"), a_dw, r_dw, nw, mm_atol(f, B, 1, 1), 1e-5f);
        check(nm("dbias vs CPU"), a_db, r_db, (size_t)OC, mm_atol(16, B, 1, 1), 1e-5f);
    }

    /* layernorm backward: dinp, dw, db. */
    {
        const int C = 200;
        const size_t n = (size_t)B * C;
        snprintf(g_case, sizeof g_case, "determinism: layernorm backward N=%d C=%d", B, C);
        fprintf(stderr, "-- %s\n", g_case);
        float *x = hrnd(n, 3), *w = hrnd((size_t)C, 1), *b = hrnd((size_t)C, 1), *dy = hrnd(n, 1);
        float *mean = hnew((size_t)B), *rstd = hnew((size_t)B), *y = hnew(n);
        OK(expert_layernorm_forward(y, mean, rstd, x, w, b, B, C));
        float *r_dx = hnew(n), *r_dw = hzero((size_t)C), *r_db = hzero((size_t)C);
        OK(expert_layernorm_backward(r_dx, r_dw, r_db, dy, x, w, mean, rstd, B, C));
        float *d_x = dup_dev(x, n, 0), *d_w = dup_dev(w, (size_t)C, 0), *d_dy = dup_dev(dy, n, 0);
        float *d_m = dup_dev(mean, (size_t)B, 0), *d_r = dup_dev(rstd, (size_t)B, 0);
        float *d_dx = dnan(n, 0), *d_dw = dzero((size_t)C, 0), *d_db = dzero((size_t)C, 0);
        OK(G.layernorm_backward(d_dx, d_dw, d_db, d_dy, d_x, d_w, d_m, d_r, B, C));
        float *a_dx = dl(d_dx, n), *a_dw = dl(d_dw, (size_t)C), *a_db = dl(d_db, (size_t)C);
        OK(cuda_memset(d_dx, 0xFF, n * sizeof(float)));
        OK(cuda_memset(d_dw, 0, (size_t)C * sizeof(float)));
        OK(cuda_memset(d_db, 0, (size_t)C * sizeof(float)));
        OK(G.layernorm_backward(d_dx, d_dw, d_db, d_dy, d_x, d_w, d_m, d_r, B, C));
        check_bits(nm("dinp, second run"), dl(d_dx, n), a_dx, n, 0);
        check_bits(nm("dw, second run"), dl(d_dw, (size_t)C), a_dw, (size_t)C, 0);
        check_bits(nm("db, second run"), dl(d_db, (size_t)C), a_db, (size_t)C, 0);
        /* dw = Σ over 4096 rows of dout·x̂ (|x̂| < 2): a 4096-term sum. */
        check(nm("dinp vs CPU"), a_dx, r_dx, n, 1e-4f, 1e-3f);
        check(nm("dw vs CPU"), a_dw, r_dw, (size_t)C, mm_atol(16, B, 1, 2), 1e-4f);
        check(nm("db vs CPU"), a_db, r_db, (size_t)C, mm_atol(16, B, 1, 1), 1e-4f);
    }

    /* bias backward (cuda__colsum_add) and the fused bias+GELU backward. */
    {
        const int C = 300;
        const size_t n = (size_t)B * C;
        snprintf(g_case, sizeof g_case, "determinism: bias backward B=%d C=%d", B, C);
        fprintf(stderr, "-- %s\n", g_case);
        float *dy = hrnd(n, 1), *r_db = hzero((size_t)C);
        OK(expert_bias_backward(r_db, dy, B, C));
        float *d_dy = dup_dev(dy, n, 0), *d_db = dzero((size_t)C, 0);
        OK(G.bias_backward(d_db, d_dy, B, C));
        float *a_db = dl(d_db, (size_t)C);
        OK(cuda_memset(d_db, 0, (size_t)C * sizeof(float)));
        OK(G.bias_backward(d_db, d_dy, B, C));
        check_bits(nm("dbias, second run"), dl(d_db, (size_t)C), a_db, (size_t)C, 0);
        check(nm("dbias vs CPU"), a_db, r_db, (size_t)C, mm_atol(16, B, 1, 1), 1e-5f);

        snprintf(g_case, sizeof g_case, "determinism: bias+GELU backward B=%d C=%d", B, C);
        float *dg = hrnd(n, 1.1f);
        float *d_dg = dup_dev(dg, n, 0), *d_dpre = dnan(n, 0);
        OK(cuda_memset(d_db, 0, (size_t)C * sizeof(float)));
        OK(G.bias_gelu_backward(d_dpre, d_db, d_dy, d_dg, B, C));
        float *a_dpre = dl(d_dpre, n), *a_db2 = dl(d_db, (size_t)C);
        OK(cuda_memset(d_db, 0, (size_t)C * sizeof(float)));
        OK(cuda_memset(d_dpre, 0xFF, n * sizeof(float)));
        OK(G.bias_gelu_backward(d_dpre, d_db, d_dy, d_dg, B, C));
        check_bits(nm("dpre, second run"), dl(d_dpre, n), a_dpre, n, 0);
        check_bits(nm("dbias, second run"), dl(d_db, (size_t)C), a_db2, (size_t)C, 0);
    }
}

/* ---- the backend object ---- */

static void test_backend(void **state)
{
    (void)state;
    snprintf(g_case, sizeof g_case, "backend");
    char err[256] = "";
    const struct expert_backend *be = NULL, *be16 = NULL, *again = NULL;
    int rc = cuda_backend_get(0, EXPERT_PRECISION_FP32, &be, err, sizeof err);
    if (rc != 0 || !be)
        fail_msg("cuda_backend_get(0, fp32) returned %d: %s", rc, err);
    rc = cuda_backend_get(0, EXPERT_PRECISION_BF16, &be16, err, sizeof err);
    if (rc != 0 || !be16)
        fail_msg("cuda_backend_get(0, bf16) returned %d: %s", rc, err);
    OK(cuda_backend_get(0, EXPERT_PRECISION_FP32, &again, NULL, 0));
    check_true("backend: a second get returns the same object", again == be);
    fprintf(stderr, "     backends: \"%s\" (%s), \"%s\" (%s)\n", be->name,
            expert_precision_name(be->precision), be16->name, expert_precision_name(be16->precision));
    check_true("backend: fp32 fields (cuda:0, device CUDA, index 0, fp32, not host memory)",
               strcmp(be->name, "cuda:0") == 0 && be->device == EXPERT_DEVICE_CUDA && be->index == 0 &&
                   be->precision == EXPERT_PRECISION_FP32 && be->host_memory == 0);
    check_true("backend: bf16 fields", be16->device == EXPERT_DEVICE_CUDA &&
                                           be16->precision == EXPERT_PRECISION_BF16 &&
                                           be16->host_memory == 0);
    int unset = 0;
    for (int p = 0; p < 2; p++) {
        const struct expert_backend *b = p ? be16 : be;
        const struct expert_ops *o = &b->ops;
#define SET(f)                                                                                  \
    do {                                                                                        \
        if (!o->f) {                                                                            \
            fprintf(stderr, "  %s: ops." #f " is NULL\n", expert_precision_name(b->precision)); \
            unset++;                                                                            \
        }                                                                                       \
    } while (0)
        SET(name); SET(linear_forward); SET(linear_backward); SET(bias_forward); SET(bias_backward);
        SET(layernorm_forward); SET(layernorm_backward); SET(gelu_forward); SET(gelu_backward);
        SET(bias_gelu_forward); SET(bias_gelu_backward); SET(residual_forward);
        SET(residual_backward); SET(crossentropy_forward); SET(crossentropy_backward);
        SET(softmax_forward); SET(softmax_backward); SET(attention_forward);
        SET(attention_backward); SET(embedding_forward); SET(embedding_backward);
        SET(matmul_forward); SET(matmul_backward); SET(attention_sizes); SET(sqnorm);
        SET(adamw_update); SET(sgd_update); SET(cast_bf16);
#undef SET
        if (!b->alloc || !b->free || !b->upload || !b->download || !b->copy || !b->zero ||
            !b->sync || !b->host_alloc || !b->host_free || !b->mem_info) {
            fprintf(stderr, "  %s: a memory function is NULL\n", expert_precision_name(b->precision));
            unset++;
        }
    }
    check_true("backend: every op and memory function is set (fp32 and bf16)", unset == 0);
    check_true("backend: bf16's matmul and attention differ from fp32's, the rest is the same",
               be16->ops.matmul_forward != be->ops.matmul_forward &&
                   be16->ops.matmul_backward != be->ops.matmul_backward &&
                   be16->ops.attention_forward != be->ops.attention_forward &&
                   be16->ops.attention_backward != be->ops.attention_backward &&
                   be16->ops.attention_sizes == be->ops.attention_sizes &&
                   be16->ops.softmax_forward == be->ops.softmax_forward);
#if HAVE_CUDA
    check_true("backend: the tables hold cuda_matmul_{forward,backward}[_bf16]",
               be->ops.matmul_forward == cuda_matmul_forward &&
                   be->ops.matmul_backward == cuda_matmul_backward &&
                   be16->ops.matmul_forward == cuda_matmul_forward_bf16 &&
                   be16->ops.matmul_backward == cuda_matmul_backward_bf16);
    check_true("backend: the bf16 table holds cuda_attention_{forward,backward}_bf16",
               be16->ops.attention_forward == cuda_attention_forward_bf16 &&
                   be16->ops.attention_backward == cuda_attention_backward_bf16);
    check_true("backend: the fp32 table holds the cuda/ops.h functions the tests call through G",
               G.attention_forward == cuda_attention_forward &&
                   G.attention_backward == cuda_attention_backward &&
                   G.attention_sizes == cuda_attention_sizes &&
                   G.embedding_forward == cuda_embedding_forward &&
                   G.embedding_backward == cuda_embedding_backward &&
                   G.softmax_forward == cuda_softmax_forward &&
                   G.softmax_backward == cuda_softmax_backward && G.sqnorm == cuda_sqnorm &&
                   G.adamw_update == cuda_adamw_update && G.sgd_update == cuda_sgd_update &&
                   G.cast_bf16 == cuda_cast_bf16 && G.matmul_forward == cuda_matmul_forward &&
                   G.matmul_backward == cuda_matmul_backward);
#endif

    /* Bytes round-trip: upload, copy, zero part, download (odd sizes and
     * offsets). */
    const size_t nb = 4099;
    unsigned char *h = hold(malloc(nb)), *got = hold(malloc(nb));
    for (size_t i = 0; i < nb; i++)
        h[i] = (unsigned char)(i * 131 + 7);
    unsigned char *a = be->alloc(be, nb), *b2 = be->alloc(be, nb);
    assert_non_null(a);
    assert_non_null(b2);
    OK(be->upload(be, a, h, nb));
    OK(be->copy(be, b2, a, nb));
    OK(be->zero(be, b2 + 5, 1000));
    OK(be->sync(be));
    memset(got, 0xAA, nb);
    OK(be->download(be, got, a, nb));
    check_true("backend: upload then download gives the bytes back", memcmp(got, h, nb) == 0);
    OK(be->download(be, got, b2, nb));
    size_t bad = 0;
    for (size_t i = 0; i < nb; i++)
        bad += got[i] != (i >= 5 && i < 1005 ? 0 : h[i]);
    check_true("backend: copy, then zero of bytes [5, 1005), downloads as expected", bad == 0);
    OK(be->upload(be, a, h, 0));
    OK(be->download(be, got, a, 0));
    /* Through pinned host memory (asynchronous uploads). */
    unsigned char *ph = be->host_alloc(be, nb), *pg = be->host_alloc(be, nb);
    assert_non_null(ph);
    assert_non_null(pg);
    memcpy(ph, h, nb);
    OK(be->upload(be, b2, ph, nb));
    OK(be->download(be, pg, b2, nb));
    check_true("backend: a round trip through pinned host memory", memcmp(pg, h, nb) == 0);
    be->host_free(be, ph);
    be->host_free(be, pg);
    be->free(be, a);
    be->free(be, b2);
    be->free(be, NULL);

    size_t fr = 0, tot = 0, fr2 = 0, tot2 = 0;
    OK(be->mem_info(be, &fr, &tot));
    OK(cuda_mem_info(0, &fr2, &tot2));
    fprintf(stderr, "     memory: %zu of %zu bytes free (cuda_mem_info: %zu of %zu)\n", fr, tot, fr2,
            tot2);
    check_true("backend: mem_info reports 0 < free <= total", tot > 0 && fr > 0 && fr <= tot);
    check_true("backend: cuda_mem_info agrees on the total", tot2 == tot && fr2 <= tot2);

    /* Another device: none (one GPU), or busy (this process uses device 0). */
    int ndev = cuda_device_count();
    const struct expert_backend *other = NULL;
    err[0] = '\0';
    rc = cuda_backend_get(1, EXPERT_PRECISION_FP32, &other, err, sizeof err);
    fprintf(stderr, "     cuda_backend_get(1) on %d device(s): %d, \"%s\"\n", ndev, rc, err);
    check_true("backend: cuda:1 fails (-ENODEV with one device, -EBUSY with more)",
               rc == (ndev == 1 ? -ENODEV : -EBUSY) && other == NULL);
    check_true("backend: ... with a sentence that names cuda:1", strstr(err, "cuda:1") != NULL);
    rc = cuda_backend_get(0, 7, &other, err, sizeof err);
    check_true("backend: an unknown precision is -EINVAL", rc == -EINVAL && other == NULL);
    rc = cuda_backend_get(0, EXPERT_PRECISION_FP32, NULL, err, sizeof err);
    check_true("backend: a NULL out is -EINVAL", rc == -EINVAL);
}

/* ---- arguments the new ops refuse ---- */

static void test_bad_arguments_more(void **state)
{
    (void)state;
    snprintf(g_case, sizeof g_case, "bad arguments");
    float *d = dnew(64, 0);
    struct expert_optim o;
    expert_optim_default_sgd(&o);
    double s[2] = { 0, 0 }, q = 0;
    int32_t tok[2] = { 0, 0 };
    check_true("matmul_forward w NULL: -EINVAL",
               G.matmul_forward(d, NULL, d, NULL, NULL, NULL, 1, 1, 1) == -EINVAL);
    check_true("matmul_backward dw NULL: -EINVAL",
               G.matmul_backward(d, NULL, NULL, d, d, d, NULL, 1, 1, 1) == -EINVAL);
    check_true("matmul_forward B = 0: 0", G.matmul_forward(d, NULL, d, d, NULL, NULL, 0, 4, 4) == 0);
    check_true("attention_forward C % NH != 0: -EINVAL",
               G.attention_forward(d, d, d, 1, 2, 6, 4) == -EINVAL);
    check_true("attention_backward saved NULL: -EINVAL",
               G.attention_backward(d, d, d, d, d, NULL, 1, 2, 4, 2) == -EINVAL);
    check_true("embedding_forward B = 0: -EINVAL",
               G.embedding_forward(d, tok, d, d, 0, 2, 4, 4) == -EINVAL);
    check_true("softmax_forward V = 0: -EINVAL", G.softmax_forward(d, d, 1, 0) == -EINVAL);
    check_true("sqnorm out NULL: -EINVAL", G.sqnorm(NULL, d, 4) == -EINVAL);
    check_true("sqnorm x NULL, n > 0: -EINVAL", G.sqnorm(&q, NULL, 4) == -EINVAL);
    check_true("adamw_update with an SGD config: -EINVAL",
               G.adamw_update(d, d + 8, d + 16, d + 24, d + 32, 8, 1, &o, 1, s) == -EINVAL);
    check_true("sgd_update sums NULL: -EINVAL",
               G.sgd_update(d, d + 8, d + 16, d + 24, 8, 1, &o, NULL) == -EINVAL);
    check_true("cast_bf16 src NULL, n > 0: -EINVAL", G.cast_bf16((uint16_t *)d, NULL, 4) == -EINVAL);
}

int main(void)
{
    int n = cuda_device_count();
    if (n <= 0) {
        fprintf(stderr, "skipped: %s\n", cuda_strerror(n == 0 ? -ENODEV : n));
        return TEST_SKIP;
    }
    char desc[256] = "", drv[32] = "?", rt[32] = "?";
    cuda_device_describe(0, desc, sizeof desc);
    cuda_versions(drv, sizeof drv, rt, sizeof rt);
    fprintf(stderr, "device 0 of %d: %s (driver %s, runtime %s)\n", n, desc, drv, rt);
    int rc = cuda_ops_init(&G);
    if (rc != 0) {
        fprintf(stderr, "cuda_ops_init failed with a device present: %d (%s)\n", rc, cuda_strerror(rc));
        return 1;
    }
    /* Full fp32 products (the default, but say so: TF32 would need other
     * tolerances). */
    rc = cuda_set_tf32(0);
    if (rc != 0) {
        fprintf(stderr, "cuda_set_tf32(0) failed: %d (%s)\n", rc, cuda_strerror(rc));
        return 1;
    }
    char err[256] = "";
    rc = cuda_backend_get(0, EXPERT_PRECISION_BF16, &g_be16, err, sizeof err);
    if (rc != 0) {
        fprintf(stderr, "cuda_backend_get(0, bf16) failed: %d: %s (the bf16 tests will fail)\n", rc,
                err);
        g_be16 = NULL;
    }
#define T_(f) cmocka_unit_test_setup_teardown(f, setup, teardown)
    const struct CMUnitTest tests[] = {
        T_(test_linear),
        T_(test_layernorm),
        T_(test_gelu_bias_residual),
        T_(test_crossentropy),
        T_(test_bad_arguments),
        T_(test_matmul_fp32),
        T_(test_matmul_bf16),
        T_(test_attention),
        T_(test_attention_bf16),
        T_(test_embedding),
        T_(test_softmax),
        T_(test_sqnorm),
        T_(test_adamw),
        T_(test_sgd),
        T_(test_cast_bf16),
        T_(test_determinism),
        T_(test_backend),
        T_(test_bad_arguments_more),
    };
#undef T_
    return cmocka_run_group_tests(tests, NULL, NULL);
}
