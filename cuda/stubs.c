/* Built instead of the .cu files when CUDA is off: every entry point says so. */
#include "cuda/cuda.h"

#include <errno.h>
#include <stdio.h>

int cuda_built(void) { return 0; }

int cuda_device_count(void) { return -ENOSYS; }

int cuda_device_describe(int index, char *buf, size_t len)
{
    (void)index;
    if (buf && len > 0)
        snprintf(buf, len, "no CUDA in this build");
    return -ENOSYS;
}

int cuda_ops_init(struct expert_ops *ops)
{
    (void)ops;
    return -ENOSYS;
}

int cuda_set_tf32(int on)
{
    (void)on;
    return -ENOSYS;
}

void *cuda_malloc(size_t bytes)
{
    (void)bytes;
    return NULL;
}

void cuda_free(void *p) { (void)p; }

int cuda_memcpy_h2d(void *dst, const void *src, size_t bytes)
{
    (void)dst, (void)src, (void)bytes;
    return -ENOSYS;
}

int cuda_memcpy_d2h(void *dst, const void *src, size_t bytes)
{
    (void)dst, (void)src, (void)bytes;
    return -ENOSYS;
}

int cuda_memset(void *dst, int byte, size_t bytes)
{
    (void)dst, (void)byte, (void)bytes;
    return -ENOSYS;
}

int cuda_sync(void) { return -ENOSYS; }
