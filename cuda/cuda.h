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

struct expert_ops;

/* Fills ops with the CUDA backend (cuda/<op>.cu twins of expert/<op>.c) on
 * the current device, creating the backend's context (cuBLASLt handle,
 * stream, matmul workspace) on first use. Every pointer the CUDA ops take is
 * device memory; ops are asynchronous on the backend's stream (call
 * cuda_sync before reading results on the host) except crossentropy_forward,
 * which synchronises to report an out-of-range target.
 * Returns 0, -ENOSYS (no CUDA in this build), -ENODEV (no device) or -ENOMEM. */
int cuda_ops_init(struct expert_ops *ops);

/* Matrix products in TF32 (on != 0) or full fp32 (the default). */
int cuda_set_tf32(int on);

/* Device memory for tests, benchmarks and the GPU blocks. cuda_malloc
 * returns NULL on failure (or in a build without CUDA); cuda_free accepts
 * NULL. The copy and set calls are synchronous and return 0, -EIO or -ENOSYS. */
void *cuda_malloc(size_t bytes);
void cuda_free(void *p);
int cuda_memcpy_h2d(void *dst, const void *src, size_t bytes);
int cuda_memcpy_d2h(void *dst, const void *src, size_t bytes);
int cuda_memset(void *dst, int byte, size_t bytes);

/* Waits for all work on the backend's stream. Returns 0, -EIO, -ENOSYS. */
int cuda_sync(void);

/* A sentence for users explaining err from the functions above. Static. */
const char *cuda_strerror(int err);

#endif
