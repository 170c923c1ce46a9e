// tests/cudaemu/emu_ctx.cc: what cuda/context.cu gives the kernels' files
// (cuda/common.cuh), over the emulator: the calling thread's context, the
// launch status, scratch memory.
#include "cuda/common.cuh"
#include "emu_ctx.h"

#include <stdlib.h>

namespace {

thread_local cuda__ctx *t_ctx;
int g_no_device;

}  // namespace

void emu_ctx_set_no_device(int on) { g_no_device = on; }

cuda__ctx *cuda__context(void)
{
    if (g_no_device)
        return NULL;
    if (t_ctx)
        return t_ctx;
    cuda__ctx *c = (cuda__ctx *)calloc(1, sizeof *c);
    if (!c)
        return NULL;
    c->device = 0;
    if (cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking) != cudaSuccess ||
        cudaMalloc(&c->err_flag, sizeof(int)) != cudaSuccess ||
        cudaMalloc(&c->sums, 16 * sizeof(double)) != cudaSuccess ||
        cudaMemsetAsync(c->err_flag, 0, sizeof(int), c->stream) != cudaSuccess ||
        cudaStreamSynchronize(c->stream) != cudaSuccess) {
        free(c);
        return NULL;
    }
    t_ctx = c;
    return c;
}

int cuda__init_error(void) { return g_no_device ? -ENODEV : 0; }

int cuda__launch_status_what(const char *what)
{
    cudaError_t e = cudaGetLastError();
    if (e == cudaSuccess)
        return 0;
    return expert_backend_set_error(-EIO, "CUDA: %s failed: %s", what, cudaGetErrorString(e));
}

// The contract (cuda/common.cuh): at least `bytes`, valid until the next
// call that asks for scratch on this thread. Stricter than context.cu on
// purpose: every call waits for the queued work (as context.cu's cudaFree
// does when it grows the buffer), frees the old buffer and returns a new one
// of exactly `bytes` that ends at a guard page and holds NaN (0xFF bytes),
// so a kernel that reads scratch it never wrote, reads past what it asked
// for, or uses an older op's scratch pointer shows up.
void *cuda__scratch(cuda__ctx *c, size_t bytes)
{
    cudaFree(c->scratch);
    c->scratch = NULL;
    c->scratch_bytes = 0;
    void *p = emu_device_malloc(bytes);
    if (!p) {
        expert_backend_set_error(-ENOMEM, "CUDA: out of device memory for %zu bytes of scratch",
                                 bytes);
        return NULL;
    }
    c->scratch = p;
    c->scratch_bytes = bytes;
    return p;
}
