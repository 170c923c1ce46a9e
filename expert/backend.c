/* expert/backend.c: the CPU backend object, the calls every backend shares
 * (wrappers, precision names, the per-thread error sentence). The CPU ops
 * themselves are expert/<op>.c; their table is expert/ops.c. */
#include "expert/backend.h"

#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static _Thread_local char last_error[256];

const char *expert_backend_last_error(void)
{
    return last_error;
}

int expert_backend_set_error(int err, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error, sizeof last_error, fmt, ap);
    va_end(ap);
    return err;
}

const char *expert_precision_name(int precision)
{
    switch (precision) {
    case EXPERT_PRECISION_FP32: return "fp32";
    case EXPERT_PRECISION_BF16: return "bf16";
    default: return "?";
    }
}

int expert_precision_parse(const char *name)
{
    if (!name)
        return -EINVAL;
    if (strcmp(name, "fp32") == 0)
        return EXPERT_PRECISION_FP32;
    if (strcmp(name, "bf16") == 0)
        return EXPERT_PRECISION_BF16;
    return -EINVAL;
}

/* ---------------------------------------------------------------- CPU -- */

static void *cpu_alloc(const expert_backend *be, size_t bytes)
{
    (void)be;
    void *p = NULL;
    /* 64 bytes would do for AVX-512; 256 is the contract for every backend. */
    if (posix_memalign(&p, 256, bytes ? bytes : 1) != 0)
        return NULL;
    return p;
}

static void cpu_free(const expert_backend *be, void *p)
{
    (void)be;
    free(p);
}

static int cpu_move(const expert_backend *be, void *dst, const void *src, size_t bytes)
{
    (void)be;
    if ((!dst || !src) && bytes)
        return -EINVAL;
    if (bytes && dst != src)
        memmove(dst, src, bytes);
    return 0;
}

static int cpu_zero(const expert_backend *be, void *dst, size_t bytes)
{
    (void)be;
    if (!dst && bytes)
        return -EINVAL;
    if (bytes)
        memset(dst, 0, bytes);
    return 0;
}

static int cpu_sync(const expert_backend *be)
{
    (void)be;
    return 0;
}

static int cpu_mem_info(const expert_backend *be, size_t *free_out, size_t *total_out)
{
    (void)be;
    long page = sysconf(_SC_PAGESIZE), avail = sysconf(_SC_AVPHYS_PAGES), total = sysconf(_SC_PHYS_PAGES);
    if (page <= 0 || avail < 0 || total <= 0)
        return -ENOSYS;
    if (free_out)
        *free_out = (size_t)avail * (size_t)page;
    if (total_out)
        *total_out = (size_t)total * (size_t)page;
    return 0;
}

static expert_backend cpu_backend;
static pthread_once_t cpu_once = PTHREAD_ONCE_INIT;

static void cpu_init(void)
{
    expert_backend *b = &cpu_backend;
    snprintf(b->name, sizeof b->name, "cpu");
    b->device = EXPERT_DEVICE_CPU;
    b->precision = EXPERT_PRECISION_FP32;
    b->host_memory = 1;
    expert_ops_init_cpu(&b->ops);
    b->alloc = cpu_alloc;
    b->free = cpu_free;
    b->upload = cpu_move;
    b->download = cpu_move;
    b->copy = cpu_move;
    b->zero = cpu_zero;
    b->sync = cpu_sync;
    b->host_alloc = cpu_alloc;
    b->host_free = cpu_free;
    b->mem_info = cpu_mem_info;
}

const expert_backend *expert_backend_cpu(void)
{
    pthread_once(&cpu_once, cpu_init);
    return &cpu_backend;
}

/* ----------------------------------------------------------- wrappers -- */

void *expert_backend_alloc(const expert_backend *be, size_t bytes)
{
    return be ? be->alloc(be, bytes) : NULL;
}

void expert_backend_free(const expert_backend *be, void *p)
{
    if (be && p)
        be->free(be, p);
}

int expert_backend_upload(const expert_backend *be, void *dst, const void *src, size_t bytes)
{
    return be ? be->upload(be, dst, src, bytes) : -EINVAL;
}

int expert_backend_download(const expert_backend *be, void *dst, const void *src, size_t bytes)
{
    return be ? be->download(be, dst, src, bytes) : -EINVAL;
}

int expert_backend_copy(const expert_backend *be, void *dst, const void *src, size_t bytes)
{
    return be ? be->copy(be, dst, src, bytes) : -EINVAL;
}

int expert_backend_zero(const expert_backend *be, void *dst, size_t bytes)
{
    return be ? be->zero(be, dst, bytes) : -EINVAL;
}

int expert_backend_sync(const expert_backend *be)
{
    return be ? be->sync(be) : -EINVAL;
}

void *expert_backend_host_alloc(const expert_backend *be, size_t bytes)
{
    return be ? be->host_alloc(be, bytes) : NULL;
}

void expert_backend_host_free(const expert_backend *be, void *p)
{
    if (be && p)
        be->host_free(be, p);
}
