/* expert/backend.h: where a block lives and computes.
 *
 * A backend is the CPU, a CUDA device, or a simulated device for tests. A
 * block carries its backend from creation to destruction: its parameters,
 * gradients, optimizer state and workspace activations are the backend's
 * memory, and every op the kinds run is the backend's (struct expert_ops,
 * expert/ops.h). The block API (expert/block.h) takes and returns host
 * memory; the block moves data to and from its backend's memory itself.
 *
 * Memory. Backend memory is only ever touched through the backend: alloc,
 * free, upload (host -> backend), download (backend -> host), copy and
 * zero (backend -> backend), and the ops. Only the CPU backend's memory is
 * host memory (host_memory = 1), where the block skips the copies.
 *
 * Streams and threads. Work is queued in order on the calling thread's
 * stream: every thread that calls a backend has its own (the CUDA backend
 * creates a stream, cuBLASLt workspace and scratch per thread on first use
 * and frees them when the thread exits). upload, copy, zero and the ops
 * return once the work is queued; download and sync wait for everything
 * the calling thread queued before them. Memory written on one thread and
 * read on another needs a sync by the writer first: every block call that
 * writes backend memory ends with a download or a sync, so calls on a block
 * from different threads never see each other's work half done.
 *
 * Errors. Calls return 0 or -errno. A failure inside queued work (a CUDA
 * kernel that faults, a scratch allocation that fails) is reported by the
 * next download or sync on that thread as -EIO (or -ENOMEM), and
 * expert_backend_last_error() holds a sentence that says what failed.
 *
 * Lifetime. Backends are process-wide and live until the process exits
 * (expert_backend_cpu(), cuda_backend_get() in cuda/cuda.h); only the
 * simulated device is created and destroyed (tests). A backend outlives
 * every block and workspace created on it.
 */
#ifndef EXPERT_BACKEND_H
#define EXPERT_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#include "expert/ops.h"

enum expert_device {
    EXPERT_DEVICE_CPU = 0,   /* host memory, OpenBLAS and our CPU kernels */
    EXPERT_DEVICE_CUDA = 1,  /* an NVIDIA GPU (cuda/) */
    EXPERT_DEVICE_SIM = 2,   /* the CPU ops behind device-style memory (tests) */
};

enum expert_precision {
    EXPERT_PRECISION_FP32 = 0, /* every op in fp32 */
    EXPERT_PRECISION_BF16 = 1, /* bf16 GEMM inputs, fp32 accumulation, master
                                  weights, optimizer state and everything else */
};

typedef struct expert_backend expert_backend;

struct expert_backend {
    char name[32];           /* "cpu", "cuda:0", "sim" */
    int device;              /* enum expert_device */
    int index;               /* the CUDA device index; 0 otherwise */
    int precision;           /* enum expert_precision */
    int host_memory;         /* 1: backend memory is host memory (the CPU) */
    struct expert_ops ops;   /* every op, in this backend's memory */

    /* Backend memory: NULL on failure; free accepts NULL. Allocation is
     * 256-byte aligned. alloc and free may synchronise the device. */
    void *(*alloc)(const expert_backend *be, size_t bytes);
    void (*free)(const expert_backend *be, void *p);
    /* Host -> backend. src must stay unchanged until the calling thread's
     * next download or sync (it is copied asynchronously from pinned host
     * memory, and staged synchronously from other host memory). */
    int (*upload)(const expert_backend *be, void *dst, const void *src, size_t bytes);
    /* Backend -> host; waits for the thread's queued work first. */
    int (*download)(const expert_backend *be, void *dst, const void *src, size_t bytes);
    /* Backend -> backend (regions must not overlap), and zero fill. */
    int (*copy)(const expert_backend *be, void *dst, const void *src, size_t bytes);
    int (*zero)(const expert_backend *be, void *dst, size_t bytes);
    /* Waits for the calling thread's queued work. */
    int (*sync)(const expert_backend *be);
    /* Host memory that the backend copies from and to fastest (pinned for
     * CUDA; plain aligned memory otherwise). NULL on failure. */
    void *(*host_alloc)(const expert_backend *be, size_t bytes);
    void (*host_free)(const expert_backend *be, void *p);
    /* Free and total bytes of backend memory (the CPU: available and total
     * RAM). Returns 0 or -errno. */
    int (*mem_info)(const expert_backend *be, size_t *free_out, size_t *total_out);

    void *impl;              /* the backend's own state */
};

/* The CPU backend: always available, fp32. */
const expert_backend *expert_backend_cpu(void);

/* A simulated device for tests: the CPU ops, run on memory that host code
 * cannot dereference (its addresses are moved out of the canonical range,
 * so a direct read or write faults at once), with a memory budget of
 * mem_limit bytes (0: no limit) that alloc and mem_info respect. It lets
 * machines without a GPU exercise every copy between host and device a
 * block makes. fp32 only. Returns NULL on failure. */
expert_backend *expert_backend_sim_create(size_t mem_limit);
void expert_backend_sim_destroy(expert_backend **p);
/* Bytes the simulated device has allocated now. */
size_t expert_backend_sim_used(const expert_backend *be);

/* Convenience wrappers over the function pointers above. */
void *expert_backend_alloc(const expert_backend *be, size_t bytes);
void expert_backend_free(const expert_backend *be, void *p);
int expert_backend_upload(const expert_backend *be, void *dst, const void *src, size_t bytes);
int expert_backend_download(const expert_backend *be, void *dst, const void *src, size_t bytes);
int expert_backend_copy(const expert_backend *be, void *dst, const void *src, size_t bytes);
int expert_backend_zero(const expert_backend *be, void *dst, size_t bytes);
int expert_backend_sync(const expert_backend *be);
void *expert_backend_host_alloc(const expert_backend *be, size_t bytes);
void expert_backend_host_free(const expert_backend *be, void *p);

/* The name of a precision ("fp32", "bf16"), and the precision named
 * (-EINVAL for another name). */
const char *expert_precision_name(int precision);
int expert_precision_parse(const char *name);

/* The last error sentence of the calling thread's backend calls ("" when
 * none): what a failed sync or download was about. */
const char *expert_backend_last_error(void);
/* Sets it (printf-style); for backends. Returns err. */
int expert_backend_set_error(int err, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

#endif
