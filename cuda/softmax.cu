// cuda/softmax.cu: row softmax (max-subtracted) and its backward, one warp
// per row as in cuda/crossentropy.cu.
//
// A row's reductions are warp butterflies over the lanes' partial results,
// so they are summed in an order fixed by V alone. Every lane reads and
// writes only the columns lane, lane + 32, ... of its row, and every read
// of a column comes before the write to it, so out may alias inp (forward)
// and dinp may alias dout (backward).
#include "cuda/common.cuh"

#define SM_THREADS 256
#define SM_ROWS_PER_BLOCK (SM_THREADS / 32)

// out[row] = exp(inp[row] - max) / Σ exp(inp[row] - max).
static __global__ void softmax_forward_kernel(float *out, const float *inp, int N, int V)
{
    int row = blockIdx.x * SM_ROWS_PER_BLOCK + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= N)
        return;
    const float *x = inp + (size_t)row * V;
    float *y = out + (size_t)row * V;
    float mx = -INFINITY;
    for (int i = lane; i < V; i += 32)
        mx = fmaxf(mx, x[i]);
    mx = cuda__warp_max(mx);
    float s = 0.0f;
    for (int i = lane; i < V; i += 32)
        s += expf(x[i] - mx);
    s = cuda__warp_sum(s);
    // Normalised by one reciprocal, as the CPU reference does.
    float inv = 1.0f / s;
    for (int i = lane; i < V; i += 32)
        y[i] = expf(x[i] - mx) * inv;
}

// dinp[row] = out ⊙ (dout − Σ_j dout_j·out_j).
static __global__ void softmax_backward_kernel(float *dinp, const float *dout, const float *out,
                                               int N, int V)
{
    int row = blockIdx.x * SM_ROWS_PER_BLOCK + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= N)
        return;
    const float *dy = dout + (size_t)row * V, *y = out + (size_t)row * V;
    float *dx = dinp + (size_t)row * V;
    float dot = 0.0f;
    for (int i = lane; i < V; i += 32)
        dot += dy[i] * y[i];
    dot = cuda__warp_sum(dot);
    for (int i = lane; i < V; i += 32)
        dx[i] = y[i] * (dy[i] - dot);
}

extern "C" int cuda_softmax_forward(float *out, const float *inp, int N, int V)
{
    if (!out || !inp || N < 0 || V <= 0)
        return -EINVAL;
    cuda__ctx *ctx = cuda__context();
    if (!ctx)
        return -ENODEV;
    if (N == 0)
        return 0;
    unsigned blocks = (unsigned)((N + SM_ROWS_PER_BLOCK - 1) / SM_ROWS_PER_BLOCK);
    softmax_forward_kernel<<<blocks, SM_THREADS, 0, ctx->stream>>>(out, inp, N, V);
    return cuda__launch_status();
}

extern "C" int cuda_softmax_backward(float *dinp, const float *dout, const float *out, int N, int V)
{
    if (!dinp || !dout || !out || N < 0 || V <= 0)
        return -EINVAL;
    cuda__ctx *ctx = cuda__context();
    if (!ctx)
        return -ENODEV;
    if (N == 0)
        return 0;
    unsigned blocks = (unsigned)((N + SM_ROWS_PER_BLOCK - 1) / SM_ROWS_PER_BLOCK);
    softmax_backward_kernel<<<blocks, SM_THREADS, 0, ctx->stream>>>(dinp, dout, out, N, V);
    return cuda__launch_status();
}
