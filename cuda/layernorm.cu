// cuda/layernorm.cu: LayerNorm forward and backward, one warp per row.
#include "cuda/common.cuh"

// Two passes over the row (mean, then centred squares), as the CPU
// reference does, so rows with a large mean keep their digits.
static __global__ void layernorm_forward_kernel(float *out, float *mean, float *rstd,
                                                const float *inp, const float *w,
                                                const float *b, int N, int C)
{
    int warps = blockDim.x / 32;
    int row = blockIdx.x * warps + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= N)
        return;
    const float *x = inp + (size_t)row * C;
    float s = 0.0f;
    for (int i = lane; i < C; i += 32)
        s += x[i];
    float m = cuda__warp_sum(s) / C;
    float v = 0.0f;
    for (int i = lane; i < C; i += 32) {
        float d = x[i] - m;
        v += d * d;
    }
    float r = rsqrtf(cuda__warp_sum(v) / C + EXPERT_LN_EPS);
    float *o = out + (size_t)row * C;
    for (int i = lane; i < C; i += 32)
        o[i] = (x[i] - m) * r * w[i] + b[i];
    if (lane == 0) {
        if (mean)
            mean[row] = m;
        if (rstd)
            rstd[row] = r;
    }
}

// dinp (=) per row: with n = (x - mean)·rstd and g = dout·w,
// dinp = rstd · (g - mean(g) - n · mean(g·n)).
static __global__ void layernorm_dinp_kernel(float *dinp, const float *dout, const float *inp,
                                             const float *w, const float *mean,
                                             const float *rstd, int N, int C)
{
    int warps = blockDim.x / 32;
    int row = blockIdx.x * warps + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= N)
        return;
    const float *x = inp + (size_t)row * C, *dy = dout + (size_t)row * C;
    float m = mean[row], r = rstd[row];
    float sg = 0.0f, sgn = 0.0f;
    for (int i = lane; i < C; i += 32) {
        float g = dy[i] * w[i];
        sg += g;
        sgn += g * (x[i] - m) * r;
    }
    sg = cuda__warp_sum(sg) / C;
    sgn = cuda__warp_sum(sgn) / C;
    float *dx = dinp + (size_t)row * C;
    for (int i = lane; i < C; i += 32) {
        float n = (x[i] - m) * r;
        dx[i] = r * (dy[i] * w[i] - sg - n * sgn);
    }
}

// dw (C) += Σ_rows dout·n, db (C) += Σ_rows dout, over chunks of rows.
#define LN_ROWS_PER_CHUNK 256
static __global__ void layernorm_param_grad_kernel(float *dw, float *db, const float *dout,
                                                   const float *inp, const float *mean,
                                                   const float *rstd, int N, int C)
{
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C)
        return;
    int r0 = blockIdx.y * LN_ROWS_PER_CHUNK, r1 = min(N, r0 + LN_ROWS_PER_CHUNK);
    float aw = 0.0f, ab = 0.0f;
    for (int r = r0; r < r1; r++) {
        float dy = dout[(size_t)r * C + c];
        aw += dy * (inp[(size_t)r * C + c] - mean[r]) * rstd[r];
        ab += dy;
    }
    atomicAdd(&dw[c], aw);
    atomicAdd(&db[c], ab);
}

extern "C" int cuda_layernorm_forward(float *out, float *mean, float *rstd, const float *inp,
                                      const float *w, const float *b, int N, int C)
{
    if (!out || !inp || !w || !b || N < 0 || C <= 0)
        return -EINVAL;
    cuda__ctx *ctx = cuda__context();
    if (!ctx)
        return -ENODEV;
    if (N == 0)
        return 0;
    layernorm_forward_kernel<<<(unsigned)((N + 7) / 8), 256, 0, ctx->stream>>>(out, mean, rstd, inp, w, b, N, C);
    return cuda__launch_status();
}

extern "C" int cuda_layernorm_backward(float *dinp, float *dw, float *db, const float *dout,
                                       const float *inp, const float *w, const float *mean,
                                       const float *rstd, int N, int C)
{
    if (!dinp || !dw || !db || !dout || !inp || !w || !mean || !rstd || N < 0 || C <= 0)
        return -EINVAL;
    cuda__ctx *ctx = cuda__context();
    if (!ctx)
        return -ENODEV;
    if (N == 0)
        return 0;
    layernorm_dinp_kernel<<<(unsigned)((N + 7) / 8), 256, 0, ctx->stream>>>(dinp, dout, inp, w, mean, rstd, N, C);
    dim3 grid((unsigned)((C + 255) / 256), (unsigned)((N + LN_ROWS_PER_CHUNK - 1) / LN_ROWS_PER_CHUNK));
    layernorm_param_grad_kernel<<<grid, 256, 0, ctx->stream>>>(dw, db, dout, inp, mean, rstd, N, C);
    return cuda__launch_status();
}
