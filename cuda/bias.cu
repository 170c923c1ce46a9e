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

// The column sum runs in two passes so that no two threads ever add into
// the same float: the result depends on B and C alone, never on the order
// in which blocks happen to run.
//   pass 1: part[k][c] = Σ src[r][c] over the rows r of chunk k
//           (ROWS_PER_CHUNK rows, in increasing r);
//   pass 2: dst[c] += Σ part[k][c] over the chunks k in increasing order.
// Threads of a block read consecutive columns of the same row, so the loads
// of both passes coalesce.
#define ROWS_PER_CHUNK 256
#define COLSUM_THREADS 256

// Pass 1. Grid: x covers the columns, y steps over the chunks (a loop, in
// case there are more chunks than gridDim.y may hold).
static __global__ void colsum_chunks_kernel(float *part, const float *src, int B, int C,
                                            int chunks)
{
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C)
        return;
    for (int k = blockIdx.y; k < chunks; k += gridDim.y) {
        int r0 = k * ROWS_PER_CHUNK;
        int r1 = min(B, r0 + ROWS_PER_CHUNK);
        float acc = 0.0f;
        for (int r = r0; r < r1; r++)
            acc += src[(size_t)r * C + c];
        part[(size_t)k * C + c] = acc;
    }
}

// Pass 2: one thread per column adds the chunks' sums in chunk order, then
// adds the total into dst.
static __global__ void colsum_finish_kernel(float *dst, const float *part, int chunks, int C)
{
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C)
        return;
    float total = 0.0f;
    for (int k = 0; k < chunks; k++)
        total += part[(size_t)k * C + c];
    dst[c] += total;
}

int cuda__colsum_add(cuda__ctx *c, float *dst, const float *src, int B, int C)
{
    if (!c || !dst || !src || B < 0 || C <= 0)
        return -EINVAL;
    if (B == 0)
        return 0;
    int chunks = (B + ROWS_PER_CHUNK - 1) / ROWS_PER_CHUNK;
    float *part = (float *)cuda__scratch(c, (size_t)chunks * (size_t)C * sizeof(float));
    if (!part)
        return -ENOMEM;
    unsigned col_blocks = (unsigned)((C + COLSUM_THREADS - 1) / COLSUM_THREADS);
    dim3 grid(col_blocks, (unsigned)(chunks < 65535 ? chunks : 65535));
    colsum_chunks_kernel<<<grid, COLSUM_THREADS, 0, c->stream>>>(part, src, B, C, chunks);
    int rc = cuda__launch_status();
    if (rc)
        return rc;
    colsum_finish_kernel<<<col_blocks, COLSUM_THREADS, 0, c->stream>>>(dst, part, chunks, C);
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
    return cuda__colsum_add(ctx, dbias, dout, B, C);
}
