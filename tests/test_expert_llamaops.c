/* The Llama-family ops (expert/ops.h: RMSNorm, rotary embeddings, the
 * SwiGLU gate, causal grouped-query attention) against naive
 * double-precision references written from
 * train_llama.py's specification: forwards to fp32 rounding, backwards
 * against central finite differences of the double reference's loss
 * L = sum(R * out) for a random R; RoPE's tables against the definition,
 * its inverse undoing it, and positions taken modulo the context. Bad
 * arguments are refused. */
#include <errno.h>
#include <math.h>
#include <string.h>

#include "expert/ops.h"
#include "test_util.h"

static uint64_t rng = 0x243f6a8885a308d3ULL;

static double unif(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (double)(rng >> 11) / (double)(1ULL << 53) * 2.0 - 1.0;
}

static void fill(float *x, size_t n, double scale)
{
    for (size_t i = 0; i < n; i++)
        x[i] = (float)(unif() * scale);
}

/* ---- RMSNorm ---- */

static void rms_ref(double *out, const double *x, const double *w, double eps, int N, int C)
{
    for (int n = 0; n < N; n++) {
        double ss = 0;
        for (int c = 0; c < C; c++)
            ss += x[n * C + c] * x[n * C + c];
        double r = 1.0 / sqrt(ss / C + eps);
        for (int c = 0; c < C; c++)
            out[n * C + c] = w[c] * x[n * C + c] * r;
    }
}

static double rms_loss(const double *x, const double *w, const double *R, double eps, int N, int C)
{
    double out[4 * 24], L = 0;
    rms_ref(out, x, w, eps, N, C);
    for (int i = 0; i < N * C; i++)
        L += R[i] * out[i];
    return L;
}

static void test_rmsnorm(void **state)
{
    (void)state;
    enum { N = 4, C = 24 };
    const float eps = 1e-5f;
    float x[N * C], w[C], out[N * C], rstd[N], R[N * C], dx[N * C], dw[C];
    double xd[N * C], wd[C], Rd[N * C], ref[N * C];
    fill(x, N * C, 2.0);
    x[5] += 30.0f; /* a large value in one row */
    fill(w, C, 1.0);
    fill(R, N * C, 1.0);
    for (int i = 0; i < N * C; i++) {
        xd[i] = x[i];
        Rd[i] = R[i];
    }
    for (int c = 0; c < C; c++)
        wd[c] = w[c];
    assert_int_equal(expert_rmsnorm_forward(out, rstd, x, w, eps, N, C), 0);
    rms_ref(ref, xd, wd, eps, N, C);
    for (int i = 0; i < N * C; i++)
        if (fabs(out[i] - ref[i]) > 2e-6 * (1 + fabs(ref[i])))
            fail_msg("rmsnorm out[%d] = %.9g, reference %.9g", i, (double)out[i], ref[i]);
    memset(dw, 0, sizeof dw);
    dw[0] = 1.0f; /* accumulated into */
    assert_int_equal(expert_rmsnorm_backward(dx, dw, R, x, w, rstd, N, C), 0);
    for (int i = 0; i < N * C; i++) {
        double keep = xd[i], h = 1e-6 * (1 + fabs(keep));
        xd[i] = keep + h;
        double lp = rms_loss(xd, wd, Rd, eps, N, C);
        xd[i] = keep - h;
        double lm = rms_loss(xd, wd, Rd, eps, N, C);
        xd[i] = keep;
        double g = (lp - lm) / (2 * h);
        if (fabs(dx[i] - g) > 1e-4 * (1 + fabs(g)))
            fail_msg("rmsnorm dx[%d] = %.9g, finite difference %.9g", i, (double)dx[i], g);
    }
    for (int c = 0; c < C; c++) {
        double keep = wd[c], h = 1e-6;
        wd[c] = keep + h;
        double lp = rms_loss(xd, wd, Rd, eps, N, C);
        wd[c] = keep - h;
        double lm = rms_loss(xd, wd, Rd, eps, N, C);
        wd[c] = keep;
        double g = (lp - lm) / (2 * h) + (c == 0 ? 1.0 : 0.0);
        if (fabs(dw[c] - g) > 1e-4 * (1 + fabs(g)))
            fail_msg("rmsnorm dw[%d] = %.9g, finite difference %.9g", c, (double)dw[c], g);
    }
    assert_int_equal(expert_rmsnorm_forward(x, rstd, x, w, eps, N, C), -EINVAL); /* in place */
    assert_int_equal(expert_rmsnorm_forward(out, rstd, x, w, 0.0f, N, C), -EINVAL);
    assert_int_equal(expert_rmsnorm_backward(dx, dw, R, x, w, NULL, N, C), -EINVAL);
}

/* ---- RoPE ---- */

static void test_rope(void **state)
{
    (void)state;
    enum { T = 7, HD = 8, H = 3, N = 2 * T + 3 };
    const double theta = 10000.0;
    float cs[T * HD / 2], sn[T * HD / 2];
    assert_int_equal(expert_rope_tables(cs, sn, T, HD, theta), 0);
    for (int p = 0; p < T; p++)
        for (int i = 0; i < HD / 2; i++) {
            double a = p * pow(theta, -2.0 * i / HD);
            assert_true(cs[p * HD / 2 + i] == (float)cos(a) && sn[p * HD / 2 + i] == (float)sin(a));
        }
    float x[N * H * HD], y[N * H * HD];
    fill(x, N * H * HD, 3.0);
    memcpy(y, x, sizeof y);
    assert_int_equal(expert_rope(y, cs, sn, N, T, H, HD, 0), 0);
    /* Each pair (u[i], u[i+hd/2]) is the complex number u[i] + i u[i+hd/2]
     * times e^{i a}, a = the row's position (n mod T) times inv_freq[i]. */
    for (int n = 0; n < N; n++)
        for (int k = 0; k < H; k++)
            for (int i = 0; i < HD / 2; i++) {
                const float *u = x + (n * H + k) * HD, *v = y + (n * H + k) * HD;
                double a = (n % T) * pow(theta, -2.0 * i / HD);
                double re = u[i] * cos(a) - u[i + HD / 2] * sin(a), im = u[i + HD / 2] * cos(a) + u[i] * sin(a);
                if (fabs(v[i] - re) > 2e-6 || fabs(v[i + HD / 2] - im) > 2e-6)
                    fail_msg("rope row %d head %d pair %d: (%g, %g), reference (%g, %g)", n, k, i, (double)v[i],
                             (double)v[i + HD / 2], re, im);
            }
    /* The inverse undoes it; applied to R it is the gradient of sum(R * y)
     * (a rotation's transpose is its inverse). */
    assert_int_equal(expert_rope(y, cs, sn, N, T, H, HD, 1), 0);
    for (int i = 0; i < N * H * HD; i++)
        assert_true(fabs(y[i] - x[i]) < 1e-5);
    float R[N * H * HD], g[N * H * HD];
    fill(R, N * H * HD, 1.0);
    memcpy(g, R, sizeof g);
    assert_int_equal(expert_rope(g, cs, sn, N, T, H, HD, 1), 0);
    for (int j = 0; j < N * H * HD; j += 5) {
        float xp[N * H * HD], xm[N * H * HD];
        memcpy(xp, x, sizeof xp);
        memcpy(xm, x, sizeof xm);
        xp[j] += 1e-2f;
        xm[j] -= 1e-2f;
        expert_rope(xp, cs, sn, N, T, H, HD, 0);
        expert_rope(xm, cs, sn, N, T, H, HD, 0);
        double lp = 0, lm = 0;
        for (int i = 0; i < N * H * HD; i++) {
            lp += (double)R[i] * xp[i];
            lm += (double)R[i] * xm[i];
        }
        double fd = (lp - lm) / 2e-2;
        if (fabs(g[j] - fd) > 1e-3)
            fail_msg("rope gradient[%d] = %g, finite difference %g", j, (double)g[j], fd);
    }
    assert_int_equal(expert_rope(y, cs, sn, N, T, H, 7, 0), -EINVAL); /* odd head */
    assert_int_equal(expert_rope_tables(cs, sn, T, HD, 0.0), -EINVAL);
}

/* ---- SwiGLU ---- */

static double silu_d(double z)
{
    return z / (1.0 + exp(-z));
}

static void test_swiglu(void **state)
{
    (void)state;
    enum { N = 64 };
    float g[N], u[N], out[N], R[N], dg[N], du[N];
    fill(g, N, 8.0);
    fill(u, N, 2.0);
    fill(R, N, 1.0);
    g[0] = 90.0f;  /* exp(-z) underflows */
    g[1] = -90.0f; /* exp(-z) is huge */
    assert_int_equal(expert_swiglu_forward(out, g, u, N), 0);
    for (int i = 0; i < N; i++) {
        double ref = silu_d(g[i]) * u[i];
        if (fabs(out[i] - ref) > 2e-6 * (1 + fabs(ref)) || !isfinite(out[i]))
            fail_msg("swiglu out[%d] = %.9g, reference %.9g", i, (double)out[i], ref);
    }
    assert_int_equal(expert_swiglu_backward(dg, du, R, g, u, N), 0);
    for (int i = 0; i < N; i++) {
        double h = 1e-6 * (1 + fabs(g[i]));
        double fdg = R[i] * u[i] * (silu_d(g[i] + h) - silu_d(g[i] - h)) / (2 * h);
        double fdu = R[i] * silu_d(g[i]);
        if (fabs(dg[i] - fdg) > 1e-4 * (1 + fabs(fdg)) || fabs(du[i] - fdu) > 1e-5 * (1 + fabs(fdu)))
            fail_msg("swiglu grads[%d] = (%g, %g), finite differences (%g, %g)", i, (double)dg[i], (double)du[i],
                     fdg, fdu);
    }
    assert_int_equal(expert_swiglu_forward(NULL, g, u, N), -EINVAL);
    assert_int_equal(expert_swiglu_forward(NULL, NULL, NULL, 0), 0);
}

/* ---- grouped-query attention ---- */

enum { GB = 2, GT = 5, GH = 4, GKV = 2, GD = 3 };
#define QN (GB * GT * GH * GD)
#define KN (GB * GT * GKV * GD)

/* The double reference: per head, scores, causal softmax, weighted values. */
static void gqa_ref(double *out, const double *q, const double *k, const double *v)
{
    for (int b = 0; b < GB; b++)
        for (int h = 0; h < GH; h++)
            for (int i = 0; i < GT; i++) {
                int g = h / (GH / GKV);
                double s[GT], mx = -INFINITY, sum = 0;
                for (int j = 0; j <= i; j++) {
                    s[j] = 0;
                    for (int c = 0; c < GD; c++)
                        s[j] += q[((b * GT + i) * GH + h) * GD + c] * k[((b * GT + j) * GKV + g) * GD + c];
                    s[j] /= sqrt((double)GD);
                    mx = s[j] > mx ? s[j] : mx;
                }
                for (int j = 0; j <= i; j++)
                    sum += exp(s[j] - mx);
                for (int c = 0; c < GD; c++) {
                    double o = 0;
                    for (int j = 0; j <= i; j++)
                        o += exp(s[j] - mx) / sum * v[((b * GT + j) * GKV + g) * GD + c];
                    out[((b * GT + i) * GH + h) * GD + c] = o;
                }
            }
}

static double gqa_loss(const double *q, const double *k, const double *v, const double *R)
{
    double out[QN], L = 0;
    gqa_ref(out, q, k, v);
    for (int i = 0; i < QN; i++)
        L += R[i] * out[i];
    return L;
}

/* Central differences of the reference's loss in x[i]. */
static double fd(double *x, int i, const double *q, const double *k, const double *v, const double *R)
{
    double keep = x[i], h = 1e-6;
    x[i] = keep + h;
    double lp = gqa_loss(q, k, v, R);
    x[i] = keep - h;
    double lm = gqa_loss(q, k, v, R);
    x[i] = keep;
    return (lp - lm) / (2 * h);
}

static void test_gqa(void **state)
{
    (void)state;
    float q[QN], k[KN], v[KN], out[QN], att[GB * GH * GT * GT], R[QN], dq[QN], dk[KN], dv[KN];
    double qd[QN], kd[KN], vd[KN], Rd[QN], ref[QN];
    fill(q, QN, 2.0);
    fill(k, KN, 2.0);
    fill(v, KN, 1.0);
    fill(R, QN, 1.0);
    for (int i = 0; i < QN; i++) {
        qd[i] = q[i];
        Rd[i] = R[i];
    }
    for (int i = 0; i < KN; i++) {
        kd[i] = k[i];
        vd[i] = v[i];
    }
    assert_int_equal(expert_gqa_forward(out, att, q, k, v, GB, GT, GH, GKV, GD), 0);
    gqa_ref(ref, qd, kd, vd);
    for (int i = 0; i < QN; i++)
        if (fabs(out[i] - ref[i]) > 2e-6 * (1 + fabs(ref[i])))
            fail_msg("gqa out[%d] = %.9g, reference %.9g", i, (double)out[i], ref[i]);
    /* Causal: the first position attends to itself only. */
    assert_true(att[0] == 1.0f && att[1] == 0.0f);
    assert_int_equal(expert_gqa_backward(dq, dk, dv, R, att, q, k, v, GB, GT, GH, GKV, GD), 0);
    for (int i = 0; i < QN; i++) {
        double g = fd(qd, i, qd, kd, vd, Rd);
        if (fabs(dq[i] - g) > 1e-4 * (1 + fabs(g)))
            fail_msg("gqa dq[%d] = %.9g, finite difference %.9g", i, (double)dq[i], g);
    }
    for (int i = 0; i < KN; i++) {
        double gk = fd(kd, i, qd, kd, vd, Rd), gv = fd(vd, i, qd, kd, vd, Rd);
        if (fabs(dk[i] - gk) > 1e-4 * (1 + fabs(gk)) || fabs(dv[i] - gv) > 1e-4 * (1 + fabs(gv)))
            fail_msg("gqa dk, dv[%d] = %.9g, %.9g; finite differences %.9g, %.9g", i, (double)dk[i], (double)dv[i],
                     gk, gv);
    }
    assert_int_equal(expert_gqa_forward(out, att, q, k, v, GB, GT, 3, 2, GD), -EINVAL); /* KV must divide H */
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_rmsnorm),
        cmocka_unit_test(test_rope),
        cmocka_unit_test(test_swiglu),
        cmocka_unit_test(test_gqa),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
