// cuda/common.cuh: shared by the .cu files of the CUDA backend (never
// included above cuda/).
//
// Threads. The process uses one CUDA device (cuda_backend_get picks it;
// otherwise device 0). Every host thread that calls the backend gets its
// own context on first use (cuda__context): the device made current on
// that thread, a non-blocking stream, a cuBLASLt matmul workspace, an
// error flag on the device and a scratch buffer, freed when the thread
// exits. Every op queues its work on the calling thread's stream, so
// threads never wait on each other's work, and the ops of one thread run
// in the order they were called. The cuBLASLt handle is shared (the
// stream and workspace are passed per call).
#ifndef CUDA_COMMON_CUH
#define CUDA_COMMON_CUH

#include <errno.h>
#include <stddef.h>
#include <stdint.h>

#include <cuda_bf16.h>
#include <cublasLt.h>
#include <cuda_runtime.h>

extern "C" {
#include "cuda/cuda.h"
#include "cuda/ops.h"
#include "expert/backend.h"
}

// The calling thread's context, created by cuda__context() on first use.
struct cuda__ctx {
    int device;
    cudaStream_t stream;
    cublasLtHandle_t lt;      // the process's handle (shared)
    void *workspace;          // cuBLASLt matmul workspace (this thread's)
    size_t workspace_bytes;
    int tf32;                 // the process's setting (cuda_set_tf32)
    int *err_flag;            // device int: kernels report bad input here
    void *scratch;            // cuda__scratch's buffer (this thread's)
    size_t scratch_bytes;
    double *sums;             // 16 doubles of device memory for reductions
};

// Returns the calling thread's context, or NULL when no device can be used
// (cuda_strerror(cuda__init_error()) says why).
cuda__ctx *cuda__context(void);
int cuda__init_error(void);

// Maps the last launch's status to 0 / -EIO, recording a sentence for
// expert_backend_last_error() on failure (`what` names the op).
int cuda__launch_status_what(const char *what);
#define cuda__launch_status() cuda__launch_status_what(__func__)

// At least `bytes` of this thread's scratch device memory, valid until the
// next call that asks for scratch on this thread (ops run in stream order,
// so an op may use it for its own kernels). Growing it frees the old buffer
// (cudaFree waits for the device first). NULL when out of memory.
void *cuda__scratch(cuda__ctx *c, size_t bytes);

// Lets kernel fn use `bytes` of dynamic shared memory (over the default
// 48 KiB it must opt in). 0 when this device cannot give that much: the
// caller then takes its fallback.
template <typename F>
static inline int cuda__smem_ok(cuda__ctx *c, F *fn, size_t bytes)
{
    int optin = 0;
    if (cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, c->device) !=
        cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    if (bytes > (size_t)optin)
        return 0;
    if (cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes) !=
        cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return 1;
}

static inline unsigned cuda__blocks(long n, int threads)
{
    long b = (n + threads - 1) / threads;
    return (unsigned)(b < 1 ? 1 : (b > 65535L * 32 ? 65535L * 32 : b));
}

// dst (C) += Σ_b src[b] over (B, C) row-major src, summed in an order that
// depends on B and C alone (chunks of rows, then the chunks in order):
// deterministic, no atomics. Uses the thread's scratch.
int cuda__colsum_add(cuda__ctx *c, float *dst, const float *src, int B, int C);

// Deterministic sums of squares and the AdamW / SGD updates live in
// cuda/step.cu; the cuBLASLt matmul in cuda/matmul.cu.

__device__ __forceinline__ float cuda__warp_sum(float v)
{
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float cuda__warp_max(float v)
{
    for (int o = 16; o > 0; o >>= 1)
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ __forceinline__ double cuda__warp_sum_d(double v)
{
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

#endif
