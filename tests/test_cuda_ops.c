/* Every CUDA op against the CPU reference on the same seeded inputs.
 * Outputs are poisoned with NaN first (0xFF bytes), so an element the GPU
 * never wrote fails; the check is written `!(|got - want| <= tol)` so NaN
 * fails too. Exits 77 (skipped) without CUDA in the build or without a GPU. */
#include <errno.h>
#include <math.h>

#include "cuda/cuda.h"
#include "cuda/ops.h"
#include "expert/ops.h"
#include "test_util.h"

static struct expert_ops G;  /* the CUDA table */
static unsigned g_seed = 1234;

static float *rnd(size_t n, float scale)
{
    float *x = malloc(n * sizeof *x);
    assert_non_null(x);
    for (size_t i = 0; i < n; i++)
        x[i] = ((float)rand_r(&g_seed) / (float)RAND_MAX * 2.0f - 1.0f) * scale;
    return x;
}

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

static void check(const char *what, const float *got, const float *want, size_t n, float atol,
                  float rtol)
{
    size_t miss = 0;
    double maxd = 0;
    for (size_t i = 0; i < n; i++) {
        float tol = atol + rtol * fabsf(want[i]);
        float d = fabsf(got[i] - want[i]);
        if (!(d <= tol)) {
            if (miss < 5)
                fprintf(stderr, "%s[%zu]: gpu %.8g cpu %.8g\n", what, i, (double)got[i], (double)want[i]);
            miss++;
        }
        if (d > maxd)
            maxd = d;
    }
    if (miss)
        fail_msg("%s: %zu of %zu elements out of tolerance (max |diff| %g, seed %u)", what, miss, n,
                 maxd, g_seed);
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

int main(void)
{
    int rc = cuda_ops_init(&G);
    if (rc != 0) {
        fprintf(stderr, "skipped: %s\n", cuda_strerror(rc));
        return TEST_SKIP;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_linear),
        cmocka_unit_test(test_layernorm),
        cmocka_unit_test(test_gelu_bias_residual),
        cmocka_unit_test(test_crossentropy),
        cmocka_unit_test(test_bad_arguments),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
