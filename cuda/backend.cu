// cuda/backend.cu: the CUDA backend object (expert/backend.h): device
// memory, pinned host memory, copies on the calling thread's stream, and
// the op table in fp32 or bf16.
#include <stdio.h>
#include <string.h>

#include <pthread.h>

#include "cuda/common.cuh"

extern "C" int cuda__use_device(int index);

static int fail(const char *what, cudaError_t e)
{
    (void)cudaGetLastError();
    return expert_backend_set_error(e == cudaErrorMemoryAllocation ? -ENOMEM : -EIO, "CUDA: %s: %s",
                                    what, cudaGetErrorString(e));
}

static void *be_alloc(const expert_backend *be, size_t bytes)
{
    (void)be;
    void *p = NULL;
    if (!cuda__context())
        return NULL;
    cudaError_t e = cudaMalloc(&p, bytes ? bytes : 1);
    if (e != cudaSuccess) {
        fail("cudaMalloc", e);
        return NULL;
    }
    return p;
}

static void be_free(const expert_backend *be, void *p)
{
    (void)be;
    if (p && cuda__context())
        cudaFree(p);
}

static int be_upload(const expert_backend *be, void *dst, const void *src, size_t bytes)
{
    (void)be;
    cuda__ctx *c = cuda__context();
    if (!c)
        return -ENODEV;
    if (!bytes)
        return 0;
    // From pinned memory the copy is asynchronous; from pageable memory
    // the driver stages it before returning, so src may change after.
    cudaError_t e = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, c->stream);
    return e == cudaSuccess ? 0 : fail("upload", e);
}

static int be_download(const expert_backend *be, void *dst, const void *src, size_t bytes)
{
    (void)be;
    cuda__ctx *c = cuda__context();
    if (!c)
        return -ENODEV;
    cudaError_t e = bytes ? cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, c->stream)
                          : cudaSuccess;
    if (e == cudaSuccess)
        e = cudaStreamSynchronize(c->stream);
    return e == cudaSuccess ? 0 : fail("download (or the work queued before it)", e);
}

static int be_copy(const expert_backend *be, void *dst, const void *src, size_t bytes)
{
    (void)be;
    cuda__ctx *c = cuda__context();
    if (!c)
        return -ENODEV;
    if (!bytes || dst == src)
        return 0;
    cudaError_t e = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, c->stream);
    return e == cudaSuccess ? 0 : fail("device copy", e);
}

static int be_zero(const expert_backend *be, void *dst, size_t bytes)
{
    (void)be;
    cuda__ctx *c = cuda__context();
    if (!c)
        return -ENODEV;
    if (!bytes)
        return 0;
    cudaError_t e = cudaMemsetAsync(dst, 0, bytes, c->stream);
    return e == cudaSuccess ? 0 : fail("device memset", e);
}

static int be_sync(const expert_backend *be)
{
    (void)be;
    cuda__ctx *c = cuda__context();
    if (!c)
        return -ENODEV;
    cudaError_t e = cudaStreamSynchronize(c->stream);
    return e == cudaSuccess ? 0 : fail("the queued work", e);
}

static void *be_host_alloc(const expert_backend *be, size_t bytes)
{
    (void)be;
    void *p = NULL;
    if (!cuda__context())
        return NULL;
    cudaError_t e = cudaMallocHost(&p, bytes ? bytes : 1);
    if (e != cudaSuccess) {
        fail("cudaMallocHost", e);
        return NULL;
    }
    return p;
}

static void be_host_free(const expert_backend *be, void *p)
{
    (void)be;
    if (p && cuda__context())
        cudaFreeHost(p);
}

static int be_mem_info(const expert_backend *be, size_t *free_out, size_t *total_out)
{
    (void)be;
    if (!cuda__context())
        return -ENODEV;
    size_t f = 0, t = 0;
    cudaError_t e = cudaMemGetInfo(&f, &t);
    if (e != cudaSuccess)
        return fail("cudaMemGetInfo", e);
    if (free_out)
        *free_out = f;
    if (total_out)
        *total_out = t;
    return 0;
}

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static expert_backend g_be[2]; // fp32, bf16
static int g_ready[2];

extern "C" int cuda_backend_get(int index, int precision, const struct expert_backend **out,
                                char *err, size_t errlen)
{
    char dummy[1];
    if (!err) {
        err = dummy;
        errlen = sizeof dummy;
    }
    if (!out || index < 0 ||
        (precision != EXPERT_PRECISION_FP32 && precision != EXPERT_PRECISION_BF16)) {
        snprintf(err, errlen, "invalid CUDA device or precision");
        return -EINVAL;
    }
    int n = cuda_device_count();
    if (n < 0) {
        snprintf(err, errlen, "cannot use cuda:%d: %s", index, cuda_strerror(n));
        return n;
    }
    if (index >= n) {
        snprintf(err, errlen, "cannot use cuda:%d: this machine has %d CUDA device%s", index, n,
                 n == 1 ? "" : "s");
        return -ENODEV;
    }
    int rc = cuda__use_device(index);
    if (rc == -EBUSY) {
        snprintf(err, errlen, "cannot use cuda:%d: this process already uses another CUDA device "
                 "(one device per process: run one peer per GPU)", index);
        return rc;
    }
    if (rc != 0 || !cuda__context()) {
        snprintf(err, errlen, "cannot use cuda:%d: %s", index,
                 cuda_strerror(rc ? rc : cuda__init_error()));
        return rc ? rc : -ENODEV;
    }
    pthread_mutex_lock(&g_mu);
    expert_backend *be = &g_be[precision];
    if (!g_ready[precision]) {
        memset(be, 0, sizeof *be);
        snprintf(be->name, sizeof be->name, "cuda:%d", index);
        be->device = EXPERT_DEVICE_CUDA;
        be->index = index;
        be->precision = precision;
        be->host_memory = 0;
        rc = cuda_ops_init(&be->ops);
        if (rc == 0 && precision == EXPERT_PRECISION_BF16) {
            be->ops.matmul_forward = cuda_matmul_forward_bf16;
            be->ops.matmul_backward = cuda_matmul_backward_bf16;
            be->ops.attention_forward = cuda_attention_forward_bf16;
            be->ops.attention_backward = cuda_attention_backward_bf16;
        }
        be->alloc = be_alloc;
        be->free = be_free;
        be->upload = be_upload;
        be->download = be_download;
        be->copy = be_copy;
        be->zero = be_zero;
        be->sync = be_sync;
        be->host_alloc = be_host_alloc;
        be->host_free = be_host_free;
        be->mem_info = be_mem_info;
        g_ready[precision] = rc == 0;
    }
    pthread_mutex_unlock(&g_mu);
    if (rc != 0) {
        snprintf(err, errlen, "cannot use cuda:%d: %s", index, cuda_strerror(rc));
        return rc;
    }
    *out = be;
    return 0;
}

extern "C" int cuda_mem_info(int index, size_t *free_out, size_t *total_out)
{
    int n = cuda_device_count();
    if (n < 0)
        return n;
    if (index < 0 || index >= n)
        return -ENODEV;
    int prev = 0;
    if (cudaGetDevice(&prev) != cudaSuccess || cudaSetDevice(index) != cudaSuccess) {
        (void)cudaGetLastError();
        return -ENODEV;
    }
    size_t f = 0, t = 0;
    cudaError_t e = cudaMemGetInfo(&f, &t);
    cudaSetDevice(prev);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return -ENODEV;
    }
    if (free_out)
        *free_out = f;
    if (total_out)
        *total_out = t;
    return 0;
}

extern "C" int cuda_versions(char *driver, size_t dlen, char *runtime, size_t rlen)
{
    int d = 0, r = 0;
    if (cudaDriverGetVersion(&d) != cudaSuccess || cudaRuntimeGetVersion(&r) != cudaSuccess) {
        (void)cudaGetLastError();
        return -ENODEV;
    }
    if (driver && dlen)
        snprintf(driver, dlen, "%d.%d", d / 1000, (d % 1000) / 10);
    if (runtime && rlen)
        snprintf(runtime, rlen, "%d.%d", r / 1000, (r % 1000) / 10);
    return 0;
}
