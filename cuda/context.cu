// cuda/context.cu: the process's device and cuBLASLt handle, each thread's
// context (stream, matmul workspace, scratch), the device memory helpers
// for tests and the fp32 function table.
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include <pthread.h>

#include "cuda/common.cuh"

#define WORKSPACE_BYTES (32u << 20)

// The process's state, under g_mu.
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static int g_device = -1;          // chosen by cuda__use_device, else 0 on first use
static int g_state;                // 0 untried, 1 ready, < 0 the error
static cublasLtHandle_t g_lt;
static int g_tf32;
static pthread_key_t g_key;        // destroys a thread's context at its exit

static thread_local cuda__ctx *t_ctx;

static void ctx_free(cuda__ctx *c)
{
    if (!c)
        return;
    cudaSetDevice(c->device);
    if (c->stream)
        cudaStreamSynchronize(c->stream);
    cudaFree(c->workspace);
    cudaFree(c->err_flag);
    cudaFree(c->scratch);
    cudaFree(c->sums);
    if (c->stream)
        cudaStreamDestroy(c->stream);
    free(c);
}

static void thread_exit(void *p)
{
    ctx_free((cuda__ctx *)p);
}

// Sets up the process's device and handle (g_mu held).
static int proc_init(void)
{
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n <= 0) {
        (void)cudaGetLastError();
        return -ENODEV;
    }
    if (g_device < 0)
        g_device = 0;
    if (g_device >= n)
        return -ENODEV;
    if (cudaSetDevice(g_device) != cudaSuccess) {
        (void)cudaGetLastError();
        return -ENODEV;
    }
    if (cublasLtCreate(&g_lt) != CUBLAS_STATUS_SUCCESS)
        return -ENOMEM;
    if (pthread_key_create(&g_key, thread_exit) != 0)
        return -ENOMEM;
    return 0;
}

// Makes `index` the process's device. Returns 0, -EBUSY (another device is
// in use), or proc_init's error.
extern "C" int cuda__use_device(int index)
{
    pthread_mutex_lock(&g_mu);
    int rc = 0;
    if (g_state == 1 || g_device >= 0)
        rc = g_device == index ? (g_state < 0 ? g_state : 0) : -EBUSY;
    if (rc == 0 && g_state == 0) {
        g_device = index;
        rc = proc_init();
        g_state = rc == 0 ? 1 : rc;
    }
    pthread_mutex_unlock(&g_mu);
    return rc;
}

int cuda__init_error(void)
{
    pthread_mutex_lock(&g_mu);
    int s = g_state;
    pthread_mutex_unlock(&g_mu);
    return s < 0 ? s : s == 0 ? -ENODEV : 0;
}

static int ctx_init(cuda__ctx *c)
{
    c->device = g_device;
    if (cudaSetDevice(c->device) != cudaSuccess)
        return -ENODEV;
    if (cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking) != cudaSuccess)
        return -ENOMEM;
    c->lt = g_lt;
    c->workspace_bytes = WORKSPACE_BYTES;
    if (cudaMalloc(&c->workspace, c->workspace_bytes) != cudaSuccess)
        return -ENOMEM;
    if (cudaMalloc(&c->err_flag, sizeof(int)) != cudaSuccess)
        return -ENOMEM;
    if (cudaMalloc(&c->sums, 16 * sizeof(double)) != cudaSuccess)
        return -ENOMEM;
    if (cudaMemsetAsync(c->err_flag, 0, sizeof(int), c->stream) != cudaSuccess ||
        cudaStreamSynchronize(c->stream) != cudaSuccess)
        return -EIO;
    return 0;
}

cuda__ctx *cuda__context(void)
{
    cuda__ctx *c = t_ctx;
    if (c) {
        c->tf32 = __atomic_load_n(&g_tf32, __ATOMIC_RELAXED);
        return c;
    }
    pthread_mutex_lock(&g_mu);
    if (g_state == 0) {
        int rc = proc_init();
        g_state = rc == 0 ? 1 : rc;
    }
    int ok = g_state == 1;
    pthread_mutex_unlock(&g_mu);
    if (!ok)
        return NULL;
    c = (cuda__ctx *)calloc(1, sizeof *c);
    if (!c)
        return NULL;
    if (ctx_init(c) != 0) {
        (void)cudaGetLastError();
        ctx_free(c);
        return NULL;
    }
    c->tf32 = __atomic_load_n(&g_tf32, __ATOMIC_RELAXED);
    pthread_setspecific(g_key, c);
    t_ctx = c;
    return c;
}

int cuda__launch_status_what(const char *what)
{
    cudaError_t e = cudaGetLastError();
    if (e == cudaSuccess)
        return 0;
    return expert_backend_set_error(-EIO, "CUDA: %s failed: %s", what, cudaGetErrorString(e));
}

void *cuda__scratch(cuda__ctx *c, size_t bytes)
{
    if (bytes <= c->scratch_bytes)
        return c->scratch;
    size_t want = c->scratch_bytes ? c->scratch_bytes : (1u << 20);
    while (want < bytes)
        want *= 2;
    // cudaFree waits for the device, so no queued kernel still uses it.
    cudaFree(c->scratch);
    c->scratch = NULL;
    c->scratch_bytes = 0;
    if (cudaMalloc(&c->scratch, want) != cudaSuccess) {
        (void)cudaGetLastError();
        expert_backend_set_error(-ENOMEM, "CUDA: out of device memory for %zu bytes of scratch",
                                 want);
        return NULL;
    }
    c->scratch_bytes = want;
    return c->scratch;
}

extern "C" int cuda_set_tf32(int on)
{
    if (!cuda__context())
        return -ENODEV;
    __atomic_store_n(&g_tf32, on != 0, __ATOMIC_RELAXED);
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
    if (p && cuda__context())
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
        return cuda__init_error();
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
    ops->softmax_forward = cuda_softmax_forward;
    ops->softmax_backward = cuda_softmax_backward;
    ops->attention_forward = cuda_attention_forward;
    ops->attention_backward = cuda_attention_backward;
    ops->embedding_forward = cuda_embedding_forward;
    ops->embedding_backward = cuda_embedding_backward;
    ops->matmul_forward = cuda_matmul_forward;
    ops->matmul_backward = cuda_matmul_backward;
    ops->attention_sizes = cuda_attention_sizes;
    ops->sqnorm = cuda_sqnorm;
    ops->adamw_update = cuda_adamw_update;
    ops->sgd_update = cuda_sgd_update;
    ops->cast_bf16 = cuda_cast_bf16;
    return 0;
}
