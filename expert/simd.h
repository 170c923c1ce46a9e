/* expert/simd.h (internal): helpers for the elementwise CPU kernels.
 *
 * The hot elementwise loops (bias+GELU, GELU backward, layernorm, residual)
 * are written as plain loops the compiler vectorises, and compiled once per
 * x86 ISA level with target_clones, so one binary runs AVX-512 code on
 * AVX-512 CPUs and AVX2 or SSE2 code elsewhere (glibc's ifunc picks at load
 * time). Scalar libm erff/expf do not vectorise and cost 10-40 ns each, which
 * at 1M hidden activations per call would rival the GEMMs, so GELU uses the
 * branch-free approximations below instead.
 */
#ifndef EXPERT_SIMD_H
#define EXPERT_SIMD_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(__SANITIZE_ADDRESS__)
#define EXPERT__CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define EXPERT__CLONES
#endif

#define EXPERT__INLINE static inline __attribute__((always_inline))

/* 16 floats as one GCC vector: one zmm register in the AVX-512 clone, two
 * ymm in the AVX2 one, four xmm otherwise. Plain scalar loops with these
 * formulas do not vectorise (GCC will not if-convert the clamps and signs),
 * so the GELU kernels use the vector form explicitly. */
#define EXPERT__VW 16
typedef float expert__vf __attribute__((vector_size(64)));
typedef int32_t expert__vi __attribute__((vector_size(64)));

/* Lane by lane: mask ? a : b (mask lanes all ones or all zeros). */
EXPERT__INLINE expert__vf expert__vsel(expert__vi mask, expert__vf a, expert__vf b)
{
    expert__vi ai, bi;
    memcpy(&ai, &a, sizeof ai);
    memcpy(&bi, &b, sizeof bi);
    ai = (ai & mask) | (bi & ~mask);
    memcpy(&a, &ai, sizeof a);
    return a;
}

EXPERT__INLINE expert__vf expert__vsplat(float x)
{
    expert__vf v = { x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x };
    return v;
}

/* exp(x) for x in [-87, 88] (clamped outside), relative error ~2e-7:
 * Cephes expf's range reduction and polynomial, without branches. */
EXPERT__INLINE expert__vf expert__vexp(expert__vf x)
{
    const expert__vf lo = expert__vsplat(-87.0f), hi = expert__vsplat(88.0f);
    x = expert__vsel(x < lo, lo, x);
    x = expert__vsel(x > hi, hi, x);
    expert__vf fx = x * 1.44269504088896341f + 0.5f;
    expert__vi n = __builtin_convertvector(fx, expert__vi);     /* truncates */
    n += (expert__vi)(__builtin_convertvector(n, expert__vf) > fx); /* floor: -1 where above */
    expert__vf fn = __builtin_convertvector(n, expert__vf);
    expert__vf r = x - fn * 0.693359375f + fn * 2.12194440e-4f;
    expert__vf r2 = r * r;
    expert__vf p = expert__vsplat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r2 + r + 1.0f;
    expert__vi bits = (n + 127) << 23;
    expert__vf scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* GELU(x) = x·Φ(x) and GELU'(x) = Φ(x) + x·φ(x), exact-erf form.
 * Φ uses Abramowitz & Stegun 7.1.26 for erf (absolute error <= 1.5e-7), whose
 * exp(-z²) with z = x/√2 is also the exp(-x²/2) that φ needs, so one exp
 * serves both. */
EXPERT__INLINE void expert__vgelu(expert__vf x, expert__vf *g, expert__vf *dg)
{
    const float p = 0.3275911f;
    const float a1 = 0.254829592f, a2 = -0.284496736f, a3 = 1.421413741f,
                a4 = -1.453152027f, a5 = 1.061405429f;
    expert__vf z = x * 0.70710678118654752f;
    expert__vi zi, sign;
    memcpy(&zi, &z, sizeof zi);
    sign = zi & (int32_t)0x80000000;
    expert__vi azi = zi & 0x7fffffff;
    expert__vf az;
    memcpy(&az, &azi, sizeof az);
    expert__vf t = 1.0f / (1.0f + p * az);
    expert__vf e = expert__vexp(-(z * z));          /* = exp(-x²/2) */
    expert__vf poly = ((((a5 * t + a4) * t + a3) * t + a2) * t + a1) * t;
    expert__vf erfa = 1.0f - poly * e;              /* erf(|z|) */
    expert__vi ei;
    memcpy(&ei, &erfa, sizeof ei);
    ei |= sign;
    expert__vf erfz;
    memcpy(&erfz, &ei, sizeof erfz);
    expert__vf cdf = 0.5f * (1.0f + erfz);
    *g = x * cdf;
    *dg = cdf + x * e * 0.39894228040143268f;       /* 1/√(2π) */
}

/* Horizontal sum and max of the lanes. */
EXPERT__INLINE float expert__vhsum(expert__vf v)
{
    float s = 0.0f;
    for (int k = 0; k < EXPERT__VW; k++)
        s += v[k];
    return s;
}

EXPERT__INLINE float expert__vhmax(expert__vf v)
{
    float m = v[0];
    for (int k = 1; k < EXPERT__VW; k++)
        m = v[k] > m ? v[k] : m;
    return m;
}

/* The first n (< EXPERT__VW) floats of p; the other lanes hold fill. */
EXPERT__INLINE expert__vf expert__vload_part(const float *p, long n, float fill)
{
    float b[EXPERT__VW];
    for (int k = 0; k < EXPERT__VW; k++)
        b[k] = k < n ? p[k] : fill;
    expert__vf v;
    memcpy(&v, b, sizeof v);
    return v;
}

EXPERT__INLINE void expert__vstore_part(float *p, expert__vf v, long n)
{
    float b[EXPERT__VW];
    memcpy(b, &v, sizeof v);
    memcpy(p, b, (size_t)n * sizeof(float));
}

/* Σ a[j]·b[j], j < n, in EXPERT__VW float lanes. */
EXPERT__INLINE float expert__vdot(const float *a, const float *b, long n)
{
    expert__vf acc = expert__vsplat(0.0f), x, y;
    long j = 0;
    for (; j + EXPERT__VW <= n; j += EXPERT__VW) {
        memcpy(&x, a + j, sizeof x);
        memcpy(&y, b + j, sizeof y);
        acc += x * y;
    }
    if (j < n)
        acc += expert__vload_part(a + j, n - j, 0.0f) * expert__vload_part(b + j, n - j, 0.0f);
    return expert__vhsum(acc);
}

/* out[j] = softmax(scale·x)[j] over j < n (scale > 0), computed as
 * exp((x[j] - max x)·scale) / Σ. Arguments below -87 give exactly 0 (so a
 * -inf logit gets probability 0, not the clamp's 1e-38). A NaN or +inf in
 * the row, or a row of -inf only, makes the row NaN, as in PyTorch (the max
 * skips NaN, but its exp is NaN and so is the sum). out may alias x. */
EXPERT__INLINE void expert__softmax_row(float *out, const float *x, long n, float scale)
{
    const expert__vf ninf = expert__vsplat(-INFINITY), lo = expert__vsplat(-87.0f),
                     zero = expert__vsplat(0.0f);
    expert__vf vm = ninf, v, e;
    long j = 0;
    for (; j + EXPERT__VW <= n; j += EXPERT__VW) {
        memcpy(&v, x + j, sizeof v);
        vm = expert__vsel(v > vm, v, vm);
    }
    if (j < n) {
        v = expert__vload_part(x + j, n - j, -INFINITY);
        vm = expert__vsel(v > vm, v, vm);
    }
    float m = expert__vhmax(vm);
    expert__vf vs = zero;
    for (j = 0; j + EXPERT__VW <= n; j += EXPERT__VW) {
        memcpy(&v, x + j, sizeof v);
        v = (v - m) * scale;
        e = expert__vsel(v < lo, zero, expert__vexp(v));
        memcpy(out + j, &e, sizeof e);
        vs += e;
    }
    if (j < n) {
        v = (expert__vload_part(x + j, n - j, -INFINITY) - m) * scale;
        e = expert__vsel(v < lo, zero, expert__vexp(v));
        expert__vstore_part(out + j, e, n - j);
        vs += e;
    }
    float inv = 1.0f / expert__vhsum(vs);
    for (j = 0; j < n; j++)
        out[j] *= inv;
}

/* Scalar GELU through the same formulas (for tails and tests). */
EXPERT__INLINE void expert__gelu(float x, float *g, float *dg)
{
    expert__vf v = expert__vsplat(x), vg, vd;
    expert__vgelu(v, &vg, &vd);
    *g = vg[0];
    *dg = vd[0];
}

#endif
