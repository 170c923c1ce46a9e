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
struct expert_backend;

/* The CUDA backend (expert/backend.h) on device `index` at `precision`
 * (EXPERT_PRECISION_FP32 or _BF16), created on first use and kept for the
 * process's life (a block carries it: it must outlive every block). One
 * process uses one device: asking for another once one is in use is
 * -EBUSY. On success *out is set; on failure err (may be NULL) receives a
 * sentence for users. Returns 0, -ENOSYS (no CUDA in this build), -ENODEV
 * (no such device, or the driver fails), -EBUSY, -EINVAL or -ENOMEM. */
int cuda_backend_get(int index, int precision, const struct expert_backend **out, char *err,
                     size_t errlen);

/* Free and total bytes of device memory on device `index` (as the driver
 * reports them now). Returns 0, -ENOSYS, -ENODEV. */
int cuda_mem_info(int index, size_t *free_out, size_t *total_out);

/* The driver's version ("13.0") and the runtime's, for reports. Returns 0,
 * -ENOSYS, -ENODEV. */
int cuda_versions(char *driver, size_t dlen, char *runtime, size_t rlen);

/* Fills ops with the CUDA backend's fp32 ops (cuda/<op>.cu twins of
 * expert/<op>.c) on the process's device (device 0 unless cuda_backend_get
 * chose another), creating the calling thread's context (stream, matmul
 * workspace) on first use. Every pointer the CUDA ops take is device
 * memory; ops are asynchronous on the calling thread's stream (call
 * cuda_sync before reading results on the host) except the ones that
 * return a host value (crossentropy_forward reports an out-of-range
 * target; sqnorm and the updates return sums).
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

/* Waits for the work the calling thread queued. Returns 0, -EIO, -ENOSYS. */
int cuda_sync(void);

/* A sentence for users explaining err from the functions above. Static. */
const char *cuda_strerror(int err);

#endif
