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

// dw (C) += Σ_rows dout·n and db (C) += Σ_rows dout, in two passes so that
// no two threads ever add into the same float (the result depends on N and
// C alone, never on the order in which blocks run), as cuda__colsum_add:
//   pass 1: partw[k][c], partb[k][c] = the sums over the rows of chunk k
//           (LN_ROWS_PER_CHUNK rows, in increasing row order);
//   pass 2: dw[c] += Σ_k partw[k][c], db[c] += Σ_k partb[k][c], over the
//           chunks in increasing order.
#define LN_ROWS_PER_CHUNK 256
#define LN_COL_THREADS 256

// Pass 1. Grid: x covers the columns, y steps over the chunks (a loop, in
// case there are more chunks than gridDim.y may hold). partw and partb are
// (chunks, C) each.
static __global__ void layernorm_param_chunks_kernel(float *partw, float *partb,
                                                     const float *dout, const float *inp,
                                                     const float *mean, const float *rstd,
                                                     int N, int C, int chunks)
{
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C)
        return;
    for (int k = blockIdx.y; k < chunks; k += gridDim.y) {
        int r0 = k * LN_ROWS_PER_CHUNK, r1 = min(N, r0 + LN_ROWS_PER_CHUNK);
        float aw = 0.0f, ab = 0.0f;
        for (int r = r0; r < r1; r++) {
            float dy = dout[(size_t)r * C + c];
            aw += dy * (inp[(size_t)r * C + c] - mean[r]) * rstd[r];
            ab += dy;
        }
        partw[(size_t)k * C + c] = aw;
        partb[(size_t)k * C + c] = ab;
    }
}

// Pass 2: one thread per column adds the chunks' sums in chunk order.
static __global__ void layernorm_param_finish_kernel(float *dw, float *db, const float *partw,
                                                     const float *partb, int chunks, int C)
{
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C)
        return;
    float tw = 0.0f, tb = 0.0f;
    for (int k = 0; k < chunks; k++) {
        tw += partw[(size_t)k * C + c];
        tb += partb[(size_t)k * C + c];
    }
    dw[c] += tw;
    db[c] += tb;
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
    int chunks = (N + LN_ROWS_PER_CHUNK - 1) / LN_ROWS_PER_CHUNK;
    float *partw = (float *)cuda__scratch(ctx, 2 * (size_t)chunks * (size_t)C * sizeof(float));
    if (!partw)
        return -ENOMEM;
    float *partb = partw + (size_t)chunks * C;
    // The parameter grads first: they read dout and inp, which dinp may
    // alias (the dinp kernel reads a row whole before writing it, element
    // by element, as the CPU reference does).
    unsigned col_blocks = (unsigned)((C + LN_COL_THREADS - 1) / LN_COL_THREADS);
    dim3 grid(col_blocks, (unsigned)(chunks < 65535 ? chunks : 65535));
    layernorm_param_chunks_kernel<<<grid, LN_COL_THREADS, 0, ctx->stream>>>(partw, partb, dout, inp, mean, rstd, N, C, chunks);
    int rc = cuda__launch_status();
    if (rc)
        return rc;
    layernorm_param_finish_kernel<<<col_blocks, LN_COL_THREADS, 0, ctx->stream>>>(dw, db, partw, partb, chunks, C);
    rc = cuda__launch_status();
    if (rc)
        return rc;
    layernorm_dinp_kernel<<<(unsigned)((N + 7) / 8), 256, 0, ctx->stream>>>(dinp, dout, inp, w, mean, rstd, N, C);
    return cuda__launch_status();
}
