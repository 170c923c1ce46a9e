#include "peer/device.h"

#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/cuda.h"
#include "expert/expert.h"

static int parse_index(const char *s, long max, long *out)
{
    if (*s < '0' || *s > '9')
        return -1;
    char *end = NULL;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || *end || v < 0 || v > max)
        return -1;
    *out = v;
    return 0;
}

static int parse_cuda(const char *spec, long index, peer_device *out, char *err, size_t errlen)
{
    int n = cuda_device_count();
    if (n < 0) {
        snprintf(err, errlen, "cannot use device '%s': %s", spec, cuda_strerror(n));
        return n;
    }
    if (index >= n) {
        snprintf(err, errlen, "cannot use device '%s': this machine has %d CUDA device%s", spec, n,
                 n == 1 ? "" : "s");
        return -ENODEV;
    }
    out->kind = PEER_DEVICE_CUDA;
    out->index = (int)index;
    snprintf(out->name, sizeof out->name, "cuda:%d", out->index);
    char what[112];
    (void)cuda_device_describe(out->index, what, sizeof what);
    snprintf(out->desc, sizeof out->desc, "cuda:%d (%s)", out->index, what);
    return 0;
}

static void set_cpu(peer_device *out)
{
    out->kind = PEER_DEVICE_CPU;
    snprintf(out->name, sizeof out->name, "cpu");
    snprintf(out->desc, sizeof out->desc, "cpu (OpenBLAS %s, %d threads)", expert_blas_corename(),
             expert_blas_threads());
}

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
    long index = 0;
    if (strcmp(spec, "cpu") == 0) {
        set_cpu(out);
        return 0;
    }
    if (strcmp(spec, "auto") == 0) {
        if (cuda_device_count() > 0)
            return parse_cuda("cuda:0", 0, out, err, errlen);
        set_cpu(out);
        return 0;
    }
    if (strcmp(spec, "sim") == 0 || strncmp(spec, "sim:", 4) == 0) {
        long mib = 0;
        if (spec[3] == ':' && (parse_index(spec + 4, 1L << 30, &mib) != 0 || mib < 1)) {
            snprintf(err, errlen, "invalid device '%s': sim takes a memory budget in MiB, e.g. sim:512",
                     spec);
            return -EINVAL;
        }
        out->kind = PEER_DEVICE_SIM;
        out->sim_bytes = (size_t)mib << 20;
        snprintf(out->name, sizeof out->name, "sim");
        if (mib)
            snprintf(out->desc, sizeof out->desc, "sim (a simulated device for tests, %ld MiB)", mib);
        else
            snprintf(out->desc, sizeof out->desc, "sim (a simulated device for tests)");
        return 0;
    }
    if (strcmp(spec, "cuda") != 0 &&
        (strncmp(spec, "cuda:", 5) != 0 || parse_index(spec + 5, INT_MAX, &index) != 0)) {
        snprintf(err, errlen, "invalid device '%s': expected cpu, cuda, cuda:N or auto", spec);
        return -EINVAL;
    }
    return parse_cuda(spec, index, out, err, errlen);
}

int peer_device_precision(const peer_device *d, const char *name, char *err, size_t errlen)
{
    char dummy[1];
    if (!err) {
        err = dummy;
        errlen = sizeof dummy;
    }
    if (!d)
        return -EINVAL;
    if (!name)
        return d->kind == PEER_DEVICE_CUDA ? EXPERT_PRECISION_BF16 : EXPERT_PRECISION_FP32;
    int p = expert_precision_parse(name);
    if (p < 0) {
        snprintf(err, errlen, "invalid precision '%s': expected fp32 or bf16", name);
        return -EINVAL;
    }
    if (p == EXPERT_PRECISION_BF16 && d->kind != PEER_DEVICE_CUDA) {
        snprintf(err, errlen, "precision bf16 needs a GPU (--device cuda:N); %s computes in fp32",
                 d->name);
        return -EINVAL;
    }
    return p;
}

static pthread_mutex_t sim_mu = PTHREAD_MUTEX_INITIALIZER;
static expert_backend *sim_be;

int peer_device_open(const peer_device *d, int precision, const expert_backend **be_out, char *err,
                     size_t errlen)
{
    char dummy[1];
    if (!err) {
        err = dummy;
        errlen = sizeof dummy;
    }
    if (!d || !be_out)
        return -EINVAL;
    switch (d->kind) {
    case PEER_DEVICE_CPU:
        *be_out = expert_backend_cpu();
        return 0;
    case PEER_DEVICE_CUDA:
        return cuda_backend_get(d->index, precision, be_out, err, errlen);
    case PEER_DEVICE_SIM:
        pthread_mutex_lock(&sim_mu);
        if (!sim_be)
            sim_be = expert_backend_sim_create(d->sim_bytes);
        *be_out = sim_be;
        pthread_mutex_unlock(&sim_mu);
        if (!*be_out) {
            snprintf(err, errlen, "cannot create the simulated device: out of memory");
            return -ENOMEM;
        }
        return 0;
    }
    return -EINVAL;
}

void peer_device_close(void)
{
    pthread_mutex_lock(&sim_mu);
    expert_backend_sim_destroy(&sim_be);
    pthread_mutex_unlock(&sim_mu);
}

const char *peer_device_bytes(char *buf, size_t len, size_t bytes)
{
    double b = (double)bytes;
    if (b >= 1024.0 * 1024 * 1024)
        snprintf(buf, len, "%.1f GiB", b / (1024.0 * 1024 * 1024));
    else if (b >= 1024.0 * 1024)
        snprintf(buf, len, "%.1f MiB", b / (1024.0 * 1024));
    else
        snprintf(buf, len, "%.0f KiB", b / 1024.0);
    return buf;
}
