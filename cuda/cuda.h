/* cuda/cuda.h: the GPU backend, as seen from plain C.
 *
 * This header includes no CUDA header, so layers above expert/ may call it.
 * In a build without CUDA (meson -Dcuda=disabled, or no nvcc/cuBLAS found)
 * cuda/stubs.c implements it and every call reports -ENOSYS.
 */
#ifndef CUDA_CUDA_H
#define CUDA_CUDA_H

#include <stddef.h>

/* 1 when this binary was built with the CUDA backend, else 0. */
int cuda_built(void);

/* The number of usable CUDA devices (>= 0), -ENOSYS in a build without CUDA,
 * or -ENODEV when the driver is missing or reports an error. */
int cuda_device_count(void);

/* Writes a one-line description of device `index` (name, memory, compute
 * capability) into buf (always NUL-terminated when len > 0).
 * Returns 0, -ENOSYS (no CUDA in this build), -ENODEV (no such device) or
 * -EINVAL. */
int cuda_device_describe(int index, char *buf, size_t len);

/* A sentence for users explaining err from the functions above. Static. */
const char *cuda_strerror(int err);

#endif
