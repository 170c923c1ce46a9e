// cuda/residual.cu: out = a + b and its backward.
#include "cuda/common.cuh"

static __global__ void residual_forward_kernel(float *out, const float *a, const float *b, long n)
{
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n;
         i += (long)gridDim.x * blockDim.x)
        out[i] = a[i] + b[i];
}

extern "C" int cuda_residual_forward(float *out, const float *a, const float *b, long N)
{
    if (!out || !a || !b || N < 0)
        return -EINVAL;
    cuda__ctx *ctx = cuda__context();
    if (!ctx)
        return -ENODEV;
    if (N == 0)
        return 0;
    residual_forward_kernel<<<cuda__blocks(N, 256), 256, 0, ctx->stream>>>(out, a, b, N);
    return cuda__launch_status();
}

// da = dout, db = dout (=); either may be NULL or alias dout.
extern "C" int cuda_residual_backward(float *da, float *db, const float *dout, long N)
{
    if (!dout || N < 0)
        return -EINVAL;
    cuda__ctx *ctx = cuda__context();
    if (!ctx)
        return -ENODEV;
    size_t bytes = (size_t)N * sizeof(float);
    if (da && da != dout && cudaMemcpyAsync(da, dout, bytes, cudaMemcpyDeviceToDevice, ctx->stream) != cudaSuccess)
        return -EIO;
    if (db && db != dout && cudaMemcpyAsync(db, dout, bytes, cudaMemcpyDeviceToDevice, ctx->stream) != cudaSuccess)
        return -EIO;
    return 0;
}
