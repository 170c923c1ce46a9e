// cuda/common.cuh: shared by the .cu files of the CUDA backend (never
// included above cuda/).
#ifndef CUDA_COMMON_CUH
#define CUDA_COMMON_CUH

#include <errno.h>
#include <stddef.h>

#include <cublasLt.h>
#include <cuda_runtime.h>

extern "C" {
#include "cuda/cuda.h"
#include "cuda/ops.h"
}

// The backend's per-process state, created by cuda__context() on first use.
struct cuda__ctx {
    int device;
    cudaStream_t stream;
    cublasLtHandle_t lt;
    void *workspace;          // cuBLASLt matmul workspace
    size_t workspace_bytes;
    int tf32;
    int *err_flag;            // device int: kernels report bad input here
};

// Returns the context, or NULL when no device can be used.
cuda__ctx *cuda__context(void);

// Maps the last launch's status to 0 / -EIO (and clears a sticky error).
int cuda__launch_status(void);

static inline unsigned cuda__blocks(long n, int threads)
{
    long b = (n + threads - 1) / threads;
    return (unsigned)(b < 1 ? 1 : (b > 65535L * 32 ? 65535L * 32 : b));
}

// Sums (B, C) row-major src over rows into dst (C): dst += Σ_b src[b].
int cuda__colsum_add(float *dst, const float *src, int B, int C, cudaStream_t s);

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

#endif
