// cuda/context.cu: the backend's context, device memory helpers and the
// function table.
#include <stdio.h>
#include <string.h>

#include <pthread.h>

#include "cuda/common.cuh"

static cuda__ctx g_ctx;
static int g_state;  // 0 untried, 1 ready, < 0 the error
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;

#define WORKSPACE_BYTES (32u << 20)

static int ctx_init(cuda__ctx *c)
{
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n <= 0) {
        (void)cudaGetLastError();
        return -ENODEV;
    }
    if (cudaGetDevice(&c->device) != cudaSuccess)
        return -ENODEV;
    if (cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking) != cudaSuccess)
        return -ENOMEM;
    if (cublasLtCreate(&c->lt) != CUBLAS_STATUS_SUCCESS)
        return -ENOMEM;
    c->workspace_bytes = WORKSPACE_BYTES;
    if (cudaMalloc(&c->workspace, c->workspace_bytes) != cudaSuccess)
        return -ENOMEM;
    if (cudaMalloc(&c->err_flag, sizeof(int)) != cudaSuccess)
        return -ENOMEM;
    if (cudaMemset(c->err_flag, 0, sizeof(int)) != cudaSuccess)
        return -EIO;
    return 0;
}

cuda__ctx *cuda__context(void)
{
    pthread_mutex_lock(&g_mu);
    if (g_state == 0) {
        int rc = ctx_init(&g_ctx);
        g_state = rc == 0 ? 1 : rc;
    }
    cuda__ctx *c = g_state == 1 ? &g_ctx : NULL;
    pthread_mutex_unlock(&g_mu);
    return c;
}

int cuda__launch_status(void)
{
    cudaError_t e = cudaGetLastError();
    return e == cudaSuccess ? 0 : -EIO;
}

extern "C" int cuda_set_tf32(int on)
{
    cuda__ctx *c = cuda__context();
    if (!c)
        return -ENODEV;
    c->tf32 = on != 0;
    return 0;
}

extern "C" void *cuda_malloc(size_t bytes)
{
    void *p = NULL;
    if (!cuda__context() || cudaMalloc(&p, bytes ? bytes : 1) != cudaSuccess)
        return NULL;
    return p;
}

extern "C" void cuda_free(void *p)
{
    if (p)
        cudaFree(p);
}

extern "C" int cuda_memcpy_h2d(void *dst, const void *src, size_t bytes)
{
    cuda__ctx *c = cuda__context();
    if (!c)
        return -ENODEV;
    if (cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, c->stream) != cudaSuccess ||
        cudaStreamSynchronize(c->stream) != cudaSuccess)
        return -EIO;
    return 0;
}

extern "C" int cuda_memcpy_d2h(void *dst, const void *src, size_t bytes)
{
    cuda__ctx *c = cuda__context();
    if (!c)
        return -ENODEV;
    if (cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, c->stream) != cudaSuccess ||
        cudaStreamSynchronize(c->stream) != cudaSuccess)
        return -EIO;
    return 0;
}

extern "C" int cuda_memset(void *dst, int byte, size_t bytes)
{
    cuda__ctx *c = cuda__context();
    if (!c)
        return -ENODEV;
    if (cudaMemsetAsync(dst, byte, bytes, c->stream) != cudaSuccess ||
        cudaStreamSynchronize(c->stream) != cudaSuccess)
        return -EIO;
    return 0;
}

extern "C" int cuda_sync(void)
{
    cuda__ctx *c = cuda__context();
    if (!c)
        return -ENODEV;
    return cudaStreamSynchronize(c->stream) == cudaSuccess ? 0 : -EIO;
}

extern "C" int cuda_ops_init(struct expert_ops *ops)
{
    if (!ops)
        return -EINVAL;
    if (!cuda__context())
        return g_state < 0 ? g_state : -ENODEV;
    memset(ops, 0, sizeof *ops);
    ops->name = "cuda";
    ops->linear_forward = cuda_linear_forward;
    ops->linear_backward = cuda_linear_backward;
    ops->bias_forward = cuda_bias_forward;
    ops->bias_backward = cuda_bias_backward;
    ops->layernorm_forward = cuda_layernorm_forward;
    ops->layernorm_backward = cuda_layernorm_backward;
    ops->gelu_forward = cuda_gelu_forward;
    ops->gelu_backward = cuda_gelu_backward;
    ops->bias_gelu_forward = cuda_bias_gelu_forward;
    ops->bias_gelu_backward = cuda_bias_gelu_backward;
    ops->residual_forward = cuda_residual_forward;
    ops->residual_backward = cuda_residual_backward;
    ops->crossentropy_forward = cuda_crossentropy_forward;
    ops->crossentropy_backward = cuda_crossentropy_backward;
    return 0;
}
