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

int cuda_backend_get(int index, int precision, const struct expert_backend **out, char *err,
                     size_t errlen)
{
    (void)index, (void)precision;
    if (out)
        *out = NULL;
    if (err && errlen)
        snprintf(err, errlen, "cannot use a CUDA device: %s", cuda_strerror(-ENOSYS));
    return -ENOSYS;
}

int cuda_mem_info(int index, size_t *free_out, size_t *total_out)
{
    (void)index, (void)free_out, (void)total_out;
    return -ENOSYS;
}

int cuda_versions(char *driver, size_t dlen, char *runtime, size_t rlen)
{
    (void)driver, (void)dlen, (void)runtime, (void)rlen;
    return -ENOSYS;
}
