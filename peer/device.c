#include "peer/device.h"

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/cuda.h"
#include "expert/expert.h"

int peer_device_parse(const char *spec, peer_device *out, char *err, size_t errlen)
{
    char dummy[1];
    if (!err) {
        err = dummy;
        errlen = sizeof dummy;
    }
    if (!spec || !out) {
        snprintf(err, errlen, "no device given");
        return -EINVAL;
    }
    memset(out, 0, sizeof *out);
    if (strcmp(spec, "cpu") == 0) {
        out->kind = PEER_DEVICE_CPU;
        snprintf(out->desc, sizeof out->desc, "cpu (OpenBLAS %s, %d threads)",
                 expert_blas_corename(), expert_blas_threads());
        return 0;
    }
    long index = 0;
    if (strcmp(spec, "cuda") != 0) {
        if (strncmp(spec, "cuda:", 5) != 0 || spec[5] < '0' || spec[5] > '9') {
            snprintf(err, errlen, "invalid device '%s': expected cpu, cuda or cuda:N", spec);
            return -EINVAL;
        }
        char *end = NULL;
        errno = 0;
        index = strtol(spec + 5, &end, 10);
        if (errno || *end || index < 0 || index > INT_MAX) {
            snprintf(err, errlen, "invalid device '%s': expected cpu, cuda or cuda:N", spec);
            return -EINVAL;
        }
    }
    int n = cuda_device_count();
    if (n < 0) {
        snprintf(err, errlen, "cannot use device '%s': %s", spec, cuda_strerror(n));
        return n;
    }
    if (index >= n) {
        snprintf(err, errlen, "cannot use device '%s': this machine has %d CUDA device%s",
                 spec, n, n == 1 ? "" : "s");
        return -ENODEV;
    }
    out->kind = PEER_DEVICE_CUDA;
    out->index = (int)index;
    char what[96];
    (void)cuda_device_describe(out->index, what, sizeof what);
    snprintf(out->desc, sizeof out->desc, "cuda:%d (%s)", out->index, what);
    return 0;
}
