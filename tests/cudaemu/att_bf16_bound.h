/* tests/cudaemu/att_bf16_bound.h: per-element error bounds for the bf16
 * attention (cuda/attention_bf16.cu) against the CPU reference
 * (expert_attention_forward / _backward) run on the same inputs rounded to
 * bf16. Shared by tests/cudaemu/emu_test.cc (the kernels on the emulator)
 * and tests/test_cuda_ops.c (on a GPU). Plain C, static functions.
 *
 * What the kernels round: q, k, v and dout to bf16 (round to nearest even)
 * as they enter shared memory, and P and dS to bf16 as operands of the
 * products; everything else is fp32 (products of bf16 values are exact in
 * fp32, sums are fp32 in some order). Rounding q, k, v and dout is exact
 * data, not error: the reference runs on the rounded values (att_b16_round),
 * so only P's and dS's rounding (u = 2^-8 relative each) and fp32 effects
 * remain. The bound is a worst case over every rounding error and every
 * summation order (first order in u, with the second-order terms kept
 * where they multiply u and a 1.05 factor for the rest), computed per
 * element from the data in double, so a correct kernel meets it on any
 * device, with any accumulation order, for any inputs: it cannot be flaky.
 * A dropped, duplicated or misplaced (unmasked) key or a P·V on the wrong
 * rows moves an element by a whole term, far outside it.
 *
 * Notation per (b, h): q, k, v, dO rounded; s_ij = scale·q_i·k_j (scale =
 * (float)(1/√hd) as both sides take it), w_ij = exp(s_ij − lse_i) the
 * exact weights (j <= i), out*_i = Σ_j w_ij v_j, dP*_ij = dO_i·v_j,
 * D*_i = dO_i·out*_i, dS*_ij = w_ij (dP*_ij − D*_i). u32 = 2^-24, and
 * g(n) = 4(n + 8)·u32 for a sum of n products in fp32 in any order (the
 * classical (n−1)·u32, doubled for tensor cores that truncate, doubled
 * again as margin). With ΣA_ij = Σ_d |q_id||k_jd|:
 *   σ_i  = scale·(g(hd) + 8·u32)·max_j ΣA_ij   the fp32 score error (the
 *          dot, the scale and log2 e products, the subtraction of the max);
 *   η_i  = (8·nt + 64)·u32 + g(T) + 8·u32·|lse_i|   exp2f, the rescale
 *          chain (nt key tiles), the sum l, lse's log and product;
 *   e_i  = 2·(2σ_i + η_i)   a weight's relative fp32 error, kernel and
 *          reference each (the normalisation doubles a score error);
 *   ε_i  = (u + e_i)(1 + u)   a bf16-rounded weight's relative error.
 * Then, per element:
 *   out_id: ε_i·A_id + 2·g(T)·A_id, A_id = Σ_j w_ij |v_jd|
 *           (out = Σ_j P̃_ij v_j / l_i with the fp32 sum l = Σ_j p_ij);
 *   lse_i:  2(σ_i + η_i) + 2·u32·|lse_i|   (against lse in double);
 *   D_i:    Δ_i = |Σ_d dO_id (out_id − out*_id)| when the kernel's forward
 *           output is given (the backward's D uses it; the difference is
 *           measured), else Σ_d |dO_id|·bound(out_id); plus
 *           g(hd)·Σ_d |dO_id||out_id| and the reference's own D error
 *           g(T)·Σ_j w_ij |dP*_ij|;
 *   dS_ij:  E_ij = w_ij [(u + e_i(1 + u))·|dP*_ij − D*_i|
 *                        + (1 + u)(1 + e_i)(2τ_ij + Δ_i)],
 *           τ_ij = g(hd)·Σ_d |dO_id||v_jd| (dP's fp32 sum);
 *   dq_id:  scale·Σ_{j<=i} (E_ij + 2g(T)(|dS*_ij| + E_ij))·|k_jd|;
 *   dk_jd:  scale·Σ_{i>=j} (E_ij + 2g(T)(|dS*_ij| + E_ij))·|q_id|;
 *   dv_jd:  Σ_{i>=j} (ε_i + 2g(T)(1 + u))·w_ij·|dO_id|;
 * every bound times 1.05. (The u terms dominate: u = 3.9e-3 against
 * g(1024) = 2.5e-4; D's term is the kernel's own forward error.) */
#ifndef TESTS_CUDAEMU_ATT_BF16_BOUND_H
#define TESTS_CUDAEMU_ATT_BF16_BOUND_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* x rounded to bf16 (round to nearest even, as __float2bfloat16_rn; the
 * tests have no NaN) and widened back. */
static float att_b16(float x)
{
    uint32_t u;
    memcpy(&u, &x, 4);
    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    memcpy(&x, &u, 4);
    return x;
}

static void att_b16_round(float *dst, const float *src, size_t n)
{
    for (size_t i = 0; i < n; i++)
        dst[i] = att_b16(src[i]);
}

/* Bounds for every output of B sequences (layouts of expert/ops.h):
 * qkv (B,T,3C) and dout (B,T,C) already rounded to bf16; out_dev (B,T,C)
 * the kernel's forward output the backward ran on, or NULL. Writes lse
 * (B,NH,T, in double, the reference for the saved state) and the bounds
 * b_out (B,T,C), b_lse (B,NH,T), b_dqkv (B,T,3C). Returns 0, or -1 when
 * out of memory. */
static int att_b16_bounds(const float *qkv, const float *dout, const float *out_dev, int B, int T,
                          int C, int NH, double *lse, float *b_out, float *b_lse, float *b_dqkv)
{
    const int hd = C / NH, nt = (T + 63) / 64;
    const size_t ld = 3 * (size_t)C, TT = (size_t)T * (size_t)T;
    const double u = 0x1p-8, u32 = 0x1p-24, K = 1.05;
    const double gT = 4.0 * (T + 8) * u32, gd = 4.0 * (hd + 8) * u32;
    const double scale = (double)(float)(1.0 / sqrt((double)hd));
    double *w = (double *)malloc(TT * sizeof(double));     /* w_ij */
    double *dss = (double *)malloc(TT * sizeof(double));   /* |dS*_ij| */
    double *E = (double *)malloc(TT * sizeof(double));     /* E_ij */
    double *eps = (double *)malloc((size_t)T * sizeof(double));
    double *s = (double *)malloc((size_t)T * sizeof(double));
    double *ostar = (double *)malloc((size_t)hd * sizeof(double));
    double *bo = (double *)malloc((size_t)hd * sizeof(double));
    if (!w || !dss || !E || !eps || !s || !ostar || !bo) {
        free(w), free(dss), free(E), free(eps), free(s), free(ostar), free(bo);
        return -1;
    }
    for (int b = 0; b < B; b++)
        for (int h = 0; h < NH; h++) {
            const float *q = qkv + (size_t)b * T * ld + (size_t)h * hd;
            const float *k = q + C, *v = q + 2 * (size_t)C;
            const float *dO = dout + (size_t)b * T * C + (size_t)h * hd;
            const size_t bh = (size_t)b * NH + (size_t)h;
            for (int i = 0; i < T; i++) {
                const float *qi = q + (size_t)i * ld, *dOi = dO + (size_t)i * C;
                double m = -INFINITY, amax = 0, l = 0;
                for (int j = 0; j <= i; j++) {
                    const float *kj = k + (size_t)j * ld;
                    double dot = 0, a = 0;
                    for (int d = 0; d < hd; d++) {
                        dot += (double)qi[d] * kj[d];
                        a += fabs((double)qi[d] * kj[d]);
                    }
                    s[j] = scale * dot;
                    m = s[j] > m ? s[j] : m;
                    amax = a > amax ? a : amax;
                }
                for (int j = 0; j <= i; j++)
                    l += exp(s[j] - m);
                const double L = m + log(l);
                lse[bh * T + i] = L;
                for (int j = 0; j <= i; j++)
                    w[(size_t)i * T + j] = exp(s[j] - L);
                const double sig = scale * (gd + 8 * u32) * amax;
                const double eta = (8.0 * nt + 64) * u32 + gT + 8 * u32 * fabs(L);
                const double e = 2 * (2 * sig + eta);
                eps[i] = (u + e) * (1 + u);
                b_lse[bh * T + i] = (float)(K * (2 * (sig + eta) + 2 * u32 * fabs(L)));

                /* out and its bound; D*, Δ. */
                for (int d = 0; d < hd; d++) {
                    double o = 0, A = 0;
                    for (int j = 0; j <= i; j++) {
                        const double vj = v[(size_t)j * ld + d];
                        o += w[(size_t)i * T + j] * vj;
                        A += w[(size_t)i * T + j] * fabs(vj);
                    }
                    ostar[d] = o;
                    bo[d] = eps[i] * A + 2 * gT * A;
                    b_out[((size_t)b * T + i) * C + (size_t)h * hd + d] = (float)(K * bo[d]);
                }
                double Dst = 0, Delta = 0, dO_o = 0, wdp = 0;
                const float *od = out_dev ? out_dev + ((size_t)b * T + i) * C + (size_t)h * hd : NULL;
                for (int d = 0; d < hd; d++) {
                    Dst += (double)dOi[d] * ostar[d];
                    dO_o += fabs((double)dOi[d]) * fabs(od ? (double)od[d] : ostar[d]);
                }
                if (od) {
                    double diff = 0;
                    for (int d = 0; d < hd; d++)
                        diff += (double)dOi[d] * ((double)od[d] - ostar[d]);
                    Delta = fabs(diff);
                } else {
                    for (int d = 0; d < hd; d++)
                        Delta += fabs((double)dOi[d]) * bo[d];
                }
                /* dP*, dS*, E for the row. */
                for (int j = 0; j <= i; j++) {
                    const float *vj = v + (size_t)j * ld;
                    double dp = 0, ta = 0;
                    for (int d = 0; d < hd; d++) {
                        dp += (double)dOi[d] * vj[d];
                        ta += fabs((double)dOi[d] * vj[d]);
                    }
                    s[j] = dp; /* (s is free again) */
                    E[(size_t)i * T + j] = gd * ta; /* τ_ij for now */
                    wdp += w[(size_t)i * T + j] * fabs(dp);
                }
                Delta += gd * dO_o + gT * wdp;
                for (int j = 0; j <= i; j++) {
                    const double wij = w[(size_t)i * T + j], g = s[j] - Dst;
                    const double tau = E[(size_t)i * T + j];
                    dss[(size_t)i * T + j] = wij * fabs(g);
                    E[(size_t)i * T + j] =
                        wij * ((u + e * (1 + u)) * fabs(g) + (1 + u) * (1 + e) * (2 * tau + Delta));
                }
            }
            /* dq (row i over j <= i), dk and dv (row j over i >= j). */
            for (int i = 0; i < T; i++)
                for (int d = 0; d < hd; d++) {
                    double bq = 0, bk = 0, bv = 0;
                    for (int j = 0; j <= i; j++) {
                        const size_t x = (size_t)i * T + j;
                        bq += (E[x] + 2 * gT * (dss[x] + E[x])) * fabs((double)k[(size_t)j * ld + d]);
                    }
                    for (int r = i; r < T; r++) { /* key i, queries r >= i */
                        const size_t x = (size_t)r * T + i;
                        bk += (E[x] + 2 * gT * (dss[x] + E[x])) * fabs((double)q[(size_t)r * ld + d]);
                        bv += (eps[r] + 2 * gT * (1 + u)) * w[x] * fabs((double)dO[(size_t)r * C + d]);
                    }
                    float *row = b_dqkv + ((size_t)b * T + i) * ld + (size_t)h * hd + d;
                    row[0] = (float)(K * scale * bq);
                    row[C] = (float)(K * scale * bk);
                    row[2 * (size_t)C] = (float)(K * bv);
                }
        }
    free(w), free(dss), free(E), free(eps), free(s), free(ostar), free(bo);
    return 0;
}

#endif
