// cuda/crossentropy.cu: fused softmax + cross-entropy, one warp per row.
#include "cuda/common.cuh"

static __global__ void crossentropy_forward_kernel(float *losses, float *probs, const float *logits,
                                                   const int32_t *targets, int B, int V, int *err)
{
    int warps = blockDim.x / 32;
    int row = blockIdx.x * warps + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= B)
        return;
    int t = targets[row];
    if (t < 0 || t >= V) {
        if (lane == 0)
            atomicExch(err, 1);
        return;
    }
    const float *z = logits + (size_t)row * V;
    float mx = -INFINITY;
    for (int i = lane; i < V; i += 32)
        mx = fmaxf(mx, z[i]);
    mx = cuda__warp_max(mx);
    float s = 0.0f;
    for (int i = lane; i < V; i += 32)
        s += expf(z[i] - mx);
    s = cuda__warp_sum(s);
    float *p = probs + (size_t)row * V;
    for (int i = lane; i < V; i += 32)
        p[i] = expf(z[i] - mx) / s;
    if (lane == 0)
        losses[row] = logf(s) - (z[t] - mx);
}

static __global__ void crossentropy_backward_kernel(float *dlogits, const float *probs,
                                                    const int32_t *targets, float dloss, int B,
                                                    int V)
{
    long n = (long)B * V;
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n;
         i += (long)gridDim.x * blockDim.x) {
        int row = (int)(i / V), col = (int)(i % V);
        int t = targets[row];
        float onehot = col == t ? 1.0f : 0.0f;
        dlogits[i] = (probs[i] - onehot) * dloss;
    }
}

// err = 1 when any target is outside [0, V).
static __global__ void targets_check_kernel(const int32_t *targets, int B, int V, int *err)
{
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < B; i += gridDim.x * blockDim.x)
        if (targets[i] < 0 || targets[i] >= V)
            atomicExch(err, 1);
}

// Checks every target before anything is written, as the CPU does: an
// out-of-range one is -EINVAL and nothing is written. Waits for the flag.
static int check_targets(cuda__ctx *ctx, const int32_t *targets, int B, int V)
{
    if (cudaMemsetAsync(ctx->err_flag, 0, sizeof(int), ctx->stream) != cudaSuccess)
        return cuda__launch_status();
    targets_check_kernel<<<cuda__blocks(B, 256), 256, 0, ctx->stream>>>(targets, B, V, ctx->err_flag);
    int rc = cuda__launch_status();
    if (rc)
        return rc;
    int err = 0;
    if (cudaMemcpyAsync(&err, ctx->err_flag, sizeof err, cudaMemcpyDeviceToHost, ctx->stream) != cudaSuccess ||
        cudaStreamSynchronize(ctx->stream) != cudaSuccess)
        return expert_backend_set_error(-EIO, "CUDA: cross-entropy's target check failed");
    return err ? -EINVAL : 0;
}

extern "C" int cuda_crossentropy_forward(float *losses, float *probs, const float *logits,
                                         const int32_t *targets, int B, int V)
{
    if (!losses || !probs || !logits || !targets || B < 0 || V <= 0)
        return -EINVAL;
    cuda__ctx *ctx = cuda__context();
    if (!ctx)
        return -ENODEV;
    if (B == 0)
        return 0;
    int rc = check_targets(ctx, targets, B, V);
    if (rc)
        return rc;
    crossentropy_forward_kernel<<<(unsigned)((B + 7) / 8), 256, 0, ctx->stream>>>(losses, probs, logits, targets, B, V, ctx->err_flag);
    return cuda__launch_status();
}

extern "C" int cuda_crossentropy_backward(float *dlogits, const float *probs, const int32_t *targets,
                                          float dloss, int B, int V)
{
    if (!dlogits || !probs || !targets || B < 0 || V <= 0)
        return -EINVAL;
    cuda__ctx *ctx = cuda__context();
    if (!ctx)
        return -ENODEV;
    long n = (long)B * V;
    if (n == 0)
        return 0;
    int rc = check_targets(ctx, targets, B, V);
    if (rc)
        return rc;
    crossentropy_backward_kernel<<<cuda__blocks(n, 256), 256, 0, ctx->stream>>>(dlogits, probs, targets, dloss, B, V);
    return cuda__launch_status();
}
