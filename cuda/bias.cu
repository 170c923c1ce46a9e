// cuda/bias.cu: bias add and the column sums that every bias gradient needs.
#include "cuda/common.cuh"

// out (B,C) = inp + bias (C), broadcast over rows; out may alias inp.
static __global__ void bias_forward_kernel(float *out, const float *inp, const float *bias,
                                           long n, int C)
{
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n;
         i += (long)gridDim.x * blockDim.x)
        out[i] = inp[i] + bias[i % C];
}

// dst (C) += Σ over a chunk of rows of src (B,C). Threads of a block read
// consecutive columns of the same row, so loads coalesce; each block column
// handles ROWS_PER_CHUNK rows and adds its partial sum with one atomic.
#define ROWS_PER_CHUNK 256
static __global__ void colsum_add_kernel(float *dst, const float *src, int B, int C)
{
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C)
        return;
    int r0 = blockIdx.y * ROWS_PER_CHUNK;
    int r1 = min(B, r0 + ROWS_PER_CHUNK);
    float acc = 0.0f;
    for (int r = r0; r < r1; r++)
        acc += src[(size_t)r * C + c];
    if (gridDim.y == 1)
        dst[c] += acc;
    else
        atomicAdd(&dst[c], acc);
}

int cuda__colsum_add(float *dst, const float *src, int B, int C, cudaStream_t s)
{
    if (B == 0)
        return 0;
    dim3 grid((unsigned)((C + 255) / 256), (unsigned)((B + ROWS_PER_CHUNK - 1) / ROWS_PER_CHUNK));
    colsum_add_kernel<<<grid, 256, 0, s>>>(dst, src, B, C);
    return cuda__launch_status();
}

extern "C" int cuda_bias_forward(float *out, const float *inp, const float *bias, int B, int C)
{
    if (!out || !inp || !bias || B < 0 || C <= 0)
        return -EINVAL;
    cuda__ctx *ctx = cuda__context();
    if (!ctx)
        return -ENODEV;
    long n = (long)B * C;
    if (n == 0)
        return 0;
    bias_forward_kernel<<<cuda__blocks(n, 256), 256, 0, ctx->stream>>>(out, inp, bias, n, C);
    return cuda__launch_status();
}

extern "C" int cuda_bias_backward(float *dbias, const float *dout, int B, int C)
{
    if (!dbias || !dout || B < 0 || C <= 0)
        return -EINVAL;
    cuda__ctx *ctx = cuda__context();
    if (!ctx)
        return -ENODEV;
    return cuda__colsum_add(dbias, dout, B, C, ctx->stream);
}
