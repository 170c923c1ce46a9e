/* expert/gqa.c: causal grouped-query attention, the CPU reference (the
 * full T x T probabilities are kept for the backward; see ops.h). */
#include "expert/ops.h"

#include <errno.h>
#include <math.h>
#include <string.h>

static int gqa_dims_ok(int B, int T, int H, int KV, int hd)
{
    return B >= 0 && T >= 1 && H >= 1 && KV >= 1 && hd >= 1 && H % KV == 0;
}

int expert_gqa_forward(float *out, float *att, const float *q, const float *k, const float *v, int B, int T, int H,
                       int KV, int hd)
{
    if (!out || !att || !q || !k || !v || !gqa_dims_ok(B, T, H, KV, hd))
        return -EINVAL;
    const float scale = (float)(1.0 / sqrt((double)hd));
    const int rep = H / KV;
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++) {
            int g = h / rep;
            for (int i = 0; i < T; i++) {
                const float *qi = q + (((size_t)b * T + i) * H + h) * hd;
                float *p = att + (((size_t)b * H + h) * T + i) * T;
                float mx = -INFINITY;
                for (int j = 0; j <= i; j++) {
                    const float *kj = k + (((size_t)b * T + j) * KV + g) * hd;
                    float s = 0.0f;
                    for (int c = 0; c < hd; c++)
                        s += qi[c] * kj[c];
                    p[j] = s * scale;
                    mx = p[j] > mx ? p[j] : mx;
                }
                float sum = 0.0f;
                for (int j = 0; j <= i; j++) {
                    p[j] = expf(p[j] - mx);
                    sum += p[j];
                }
                for (int j = 0; j <= i; j++)
                    p[j] /= sum;
                for (int j = i + 1; j < T; j++)
                    p[j] = 0.0f;
                float *o = out + (((size_t)b * T + i) * H + h) * hd;
                memset(o, 0, (size_t)hd * sizeof *o);
                for (int j = 0; j <= i; j++) {
                    const float *vj = v + (((size_t)b * T + j) * KV + g) * hd;
                    for (int c = 0; c < hd; c++)
                        o[c] += p[j] * vj[c];
                }
            }
        }
    return 0;
}

/* dP = dO·vᵀ; dS = P ⊙ (dP - Σ_j dP⊙P); dq = dS·k·scale; dk += dSᵀ·q·scale;
 * dv += Pᵀ·dO. */
int expert_gqa_backward(float *dq, float *dk, float *dv, const float *dout, const float *att, const float *q,
                        const float *k, const float *v, int B, int T, int H, int KV, int hd)
{
    if (!dq || !dk || !dv || !dout || !att || !q || !k || !v || !gqa_dims_ok(B, T, H, KV, hd))
        return -EINVAL;
    const float scale = (float)(1.0 / sqrt((double)hd));
    const int rep = H / KV;
    memset(dk, 0, (size_t)B * T * KV * hd * sizeof *dk);
    memset(dv, 0, (size_t)B * T * KV * hd * sizeof *dv);
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++) {
            int g = h / rep;
            for (int i = 0; i < T; i++) {
                const float *p = att + (((size_t)b * H + h) * T + i) * T;
                const float *go = dout + (((size_t)b * T + i) * H + h) * hd;
                const float *qi = q + (((size_t)b * T + i) * H + h) * hd;
                float *dqi = dq + (((size_t)b * T + i) * H + h) * hd;
                /* dot = Σ_j dP[j]·P[j]; dP[j] is recomputed in the second pass. */
                float dot = 0.0f;
                for (int j = 0; j <= i; j++) {
                    const float *vj = v + (((size_t)b * T + j) * KV + g) * hd;
                    float s = 0.0f;
                    for (int c = 0; c < hd; c++)
                        s += go[c] * vj[c];
                    dot += s * p[j];
                }
                memset(dqi, 0, (size_t)hd * sizeof *dqi);
                for (int j = 0; j <= i; j++) {
                    const float *vj = v + (((size_t)b * T + j) * KV + g) * hd;
                    const float *kj = k + (((size_t)b * T + j) * KV + g) * hd;
                    float *dkj = dk + (((size_t)b * T + j) * KV + g) * hd;
                    float *dvj = dv + (((size_t)b * T + j) * KV + g) * hd;
                    float s = 0.0f;
                    for (int c = 0; c < hd; c++)
                        s += go[c] * vj[c];
                    float ds = p[j] * (s - dot) * scale;
                    for (int c = 0; c < hd; c++) {
                        dqi[c] += ds * kj[c];
                        dkj[c] += ds * qi[c];
                        dvj[c] += p[j] * go[c];
                    }
                }
            }
        }
    return 0;
}
