// cuda/device.cu: device discovery for the CUDA backend.
#include <errno.h>
#include <stdio.h>

#include <cuda_runtime.h>

extern "C" {
#include "cuda/cuda.h"
}

extern "C" int cuda_built(void) { return 1; }

extern "C" int cuda_device_count(void)
{
    int n = 0;
    cudaError_t err = cudaGetDeviceCount(&n);
    if (err != cudaSuccess) {
        (void)cudaGetLastError(); // clear the sticky error so later calls are not poisoned
        return -ENODEV;
    }
    return n;
}

extern "C" int cuda_device_describe(int index, char *buf, size_t len)
{
    if (!buf || len == 0)
        return -EINVAL;
    int n = cuda_device_count();
    if (n < 0) {
        snprintf(buf, len, "no usable CUDA device");
        return n;
    }
    if (index < 0 || index >= n) {
        snprintf(buf, len, "no CUDA device %d (%d present)", index, n);
        return -ENODEV;
    }
    cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, index) != cudaSuccess) {
        (void)cudaGetLastError();
        snprintf(buf, len, "CUDA device %d: properties unavailable", index);
        return -ENODEV;
    }
    snprintf(buf, len, "%s, %.1f GiB, sm_%d%d", prop.name,
             (double)prop.totalGlobalMem / (1024.0 * 1024.0 * 1024.0), prop.major, prop.minor);
    return 0;
}
