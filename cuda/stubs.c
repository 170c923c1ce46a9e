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
