/* Parts of the cuda/ API that are the same with and without CUDA. */
#include "cuda/cuda.h"

#include <errno.h>
#include <string.h>

const char *cuda_strerror(int err)
{
    switch (err) {
    case 0: return "success";
    case -ENOSYS: return "no CUDA in this build (rebuild with meson -Dcuda=enabled on a machine with the CUDA Toolkit)";
    case -ENODEV: return "no usable CUDA device (no GPU, or the driver is missing)";
    case -EINVAL: return "invalid CUDA device index";
    default: return strerror(err < 0 ? -err : err);
    }
}
