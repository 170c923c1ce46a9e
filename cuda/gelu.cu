// cuda/gelu.cu: GELU in the exact erf form (torch.nn.GELU()), and the fused
// bias + GELU pass over the feed-forward block's hidden activations.
#include "cuda/common.cuh"

#define INV_SQRT2 0.70710678118654752440f
#define INV_SQRT_2PI 0.39894228040143267794f

__device__ __forceinline__ float gelu_val(float x)
{
    return 0.5f * x * (1.0f + erff(x * INV_SQRT2));
}

__device__ __forceinline__ float gelu_grad(float x)
{
    return 0.5f * (1.0f + erff(x * INV_SQRT2)) + x * INV_SQRT_2PI * expf(-0.5f * x * x);
}

static __global__ void gelu_forward_kernel(float *out, const float *inp, long n)
{
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n;
         i += (long)gridDim.x * blockDim.x)
        out[i] = gelu_val(inp[i]);
}

static __global__ void gelu_backward_kernel(float *dinp, const float *dout, const float *inp, long n)
{
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n;
         i += (long)gridDim.x * blockDim.x)
        dinp[i] = dout[i] * gelu_grad(inp[i]);
}

// pre += bias; out = gelu(pre); dgelu = gelu'(pre) when dgelu != NULL.
static __global__ void bias_gelu_forward_kernel(float *out, float *dgelu, float *pre,
                                                const float *bias, long n, int C)
{
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n;
         i += (long)gridDim.x * blockDim.x) {
        float x = pre[i] + bias[i % C];
        pre[i] = x;
        out[i] = gelu_val(x);
        if (dgelu)
            dgelu[i] = gelu_grad(x);
    }
}

static __global__ void mul_kernel(float *out, const float *a, const float *b, long n)
{
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n;
         i += (long)gridDim.x * blockDim.x)
        out[i] = a[i] * b[i];
}

extern "C" int cuda_gelu_forward(float *out, const float *inp, long N)
{
    if (!out || !inp || N < 0)
        return -EINVAL;
    cuda__ctx *ctx = cuda__context();
    if (!ctx)
        return -ENODEV;
    if (N == 0)
        return 0;
    gelu_forward_kernel<<<cuda__blocks(N, 256), 256, 0, ctx->stream>>>(out, inp, N);
    return cuda__launch_status();
}

extern "C" int cuda_gelu_backward(float *dinp, const float *dout, const float *inp, long N)
{
    if (!dinp || !dout || !inp || N < 0)
        return -EINVAL;
    cuda__ctx *ctx = cuda__context();
    if (!ctx)
        return -ENODEV;
    if (N == 0)
        return 0;
    gelu_backward_kernel<<<cuda__blocks(N, 256), 256, 0, ctx->stream>>>(dinp, dout, inp, N);
    return cuda__launch_status();
}

extern "C" int cuda_bias_gelu_forward(float *out, float *dgelu, float *pre, const float *bias,
                                      int B, int C)
{
    if (!out || !pre || !bias || B < 0 || C <= 0)
        return -EINVAL;
    cuda__ctx *ctx = cuda__context();
    if (!ctx)
        return -ENODEV;
    long n = (long)B * C;
    if (n == 0)
        return 0;
    bias_gelu_forward_kernel<<<cuda__blocks(n, 256), 256, 0, ctx->stream>>>(out, dgelu, pre, bias, n, C);
    return cuda__launch_status();
}

// dpre = dout · dgelu (=, may alias dout); dbias += Σ_b dpre.
extern "C" int cuda_bias_gelu_backward(float *dpre, float *dbias, const float *dout,
                                       const float *dgelu, int B, int C)
{
    if (!dpre || !dbias || !dout || !dgelu || B < 0 || C <= 0)
        return -EINVAL;
    cuda__ctx *ctx = cuda__context();
    if (!ctx)
        return -ENODEV;
    long n = (long)B * C;
    if (n == 0)
        return 0;
    mul_kernel<<<cuda__blocks(n, 256), 256, 0, ctx->stream>>>(dpre, dout, dgelu, n);
    int rc = cuda__launch_status();
    return rc ? rc : cuda__colsum_add(ctx, dbias, dpre, B, C);
}
