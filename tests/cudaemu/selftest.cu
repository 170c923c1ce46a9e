// tests/cudaemu/selftest.cu: the emulator's own semantics, checked with
// small kernels that go through transform.py like cuda/*.cu: shared memory
// per block, barriers with exited threads, shuffles and votes, 2D/3D
// indices, templates and __launch_bounds__, launch checks, and the faults
// it must catch (out-of-bounds shared and device writes, deadlocks,
// divergent barriers, host pointers in kernels), and nvcuda::wmma (its
// products, layouts, and the rules it enforces).
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <mma.h>

#include <stdio.h>
#include <string.h>

#include <vector>

#include "selftest.h"

#define FULL 0xffffffffu

namespace {

int g_fails;

#define CHECK(cond, ...)                                   \
    do {                                                   \
        if (!(cond)) {                                     \
            g_fails++;                                     \
            printf("FAIL selftest %s:%d: ", __FILE__, __LINE__); \
            printf(__VA_ARGS__);                           \
            printf("\n");                                  \
        }                                                  \
    } while (0)

template <typename T>
T *dalloc(size_t n)
{
    return (T *)emu_device_malloc(n * sizeof(T));
}

// A launch that must fault at run time: the sticky error and the fault's
// message (which must contain `what`); then the device is reset.
void expect_fault(const char *name, cudaError_t want, const char *what)
{
    cudaError_t e = emu_sync();
    CHECK(e == want, "%s: sync gives %s, want %s", name, cudaGetErrorName(e), cudaGetErrorName(want));
    CHECK(strstr(emu_last_fault(), what) != NULL, "%s: fault \"%s\" does not say \"%s\"", name,
          emu_last_fault(), what);
    CHECK(cudaGetLastError() == want, "%s: the error is sticky", name);
    emu_reset_device();
    CHECK(emu_sync() == cudaSuccess && cudaGetLastError() == cudaSuccess, "%s: reset", name);
    printf("ok   selftest: %s is caught\n", name);
}

// ---- Static shared memory is per block; it starts as the fill pattern ----

__device__ int add_shared_neighbour(int t)
{
    __shared__ int helper[64];  // in a device function: still one per block
    helper[t] = t * 3;
    __syncthreads();
    return helper[(t + 63) % 64];
}

static __global__ void k_static(int *out, unsigned *first, int *dev)
{
    __shared__ int sh[64];
    __shared__ double acc;
    __shared__ float mat[4][16];
    int t = threadIdx.x;
    unsigned u;
    memcpy(&u, &sh[t], sizeof u);
    first[blockIdx.x * 64 + t] = u;
    sh[t] = (int)blockIdx.x * 1000 + t;
    mat[t / 16][t % 16] = (float)t;
    if (t == 0)
        acc = 0.5 * blockIdx.x;
    __syncthreads();
    out[blockIdx.x * 64 + t] = sh[(t + 1) % 64] + (int)(acc * 2) * 100000 +
                               (int)mat[(63 - t) / 16][(63 - t) % 16] * 1000000;
    dev[blockIdx.x * 64 + t] = add_shared_neighbour(t);
}

void test_static_shared()
{
    const int G = 3;
    int *out = dalloc<int>(G * 64), *dev = dalloc<int>(G * 64);
    unsigned *first = dalloc<unsigned>(G * 64);
    k_static<<<G, 64>>>(out, first, dev);
    CHECK(cudaGetLastError() == cudaSuccess, "k_static launch");
    CHECK(emu_sync() == cudaSuccess, "k_static: %s", emu_last_fault());
    int bad = 0;
    for (int b = 0; b < G; b++)
        for (int t = 0; t < 64; t++) {
            int want = b * 1000 + (t + 1) % 64 + b * 100000 + (63 - t) * 1000000;
            bad += out[b * 64 + t] != want;
            bad += first[b * 64 + t] != EMU_SMEM_FILL;
            bad += dev[b * 64 + t] != (t + 63) % 64 * 3;
        }
    CHECK(bad == 0, "static __shared__: %d wrong values", bad);
    if (!bad)
        printf("ok   selftest: static __shared__ arrays are per block and start as NaN\n");
    emu_device_free(out);
    emu_device_free(dev);
    emu_device_free(first);
}

// ---- Exited threads do not take part in __syncthreads ----

static __global__ void k_early(int *out, int live)
{
    __shared__ int sh[256];
    int t = threadIdx.x;
    if (t >= live)
        return;
    sh[t] = t;
    __syncthreads();
    int s = 0;
    for (int i = 0; i < live; i++)
        s += sh[i];
    __syncthreads();
    out[t] = s;
}

void test_early_exit()
{
    int *out = dalloc<int>(256);
    const int lives[] = { 100, 1, 256, 33 };
    for (int live : lives) {
        k_early<<<2, 256>>>(out, live);
        CHECK(emu_sync() == cudaSuccess, "k_early live=%d: %s", live, emu_last_fault());
        int bad = 0;
        for (int t = 0; t < live; t++)
            bad += out[t] != live * (live - 1) / 2;
        CHECK(bad == 0, "early exit live=%d: %d wrong", live, bad);
    }
    printf("ok   selftest: threads that return early leave later barriers to the others\n");
    emu_device_free(out);
}

// ---- Shuffles and votes ----

static __global__ void k_shfl(float *f, double *d, int *i, unsigned *v)
{
    int t = threadIdx.x, lane = t % 32;
    f[t * 2 + 0] = __shfl_xor_sync(FULL, (float)t + 0.5f, 5);
    // Width 16: lanes 0-15 would read a later segment and keep their own value;
    // lanes 16-31 read the earlier one (PTX shfl.sync's clamp).
    f[t * 2 + 1] = __shfl_xor_sync(FULL, (float)t, 16, 16);
    d[t * 2 + 0] = __shfl_down_sync(FULL, (double)t * 1e10, 3);
    double s = (double)t + 1e-9;
    for (int o = 16; o > 0; o >>= 1)
        s += __shfl_xor_sync(FULL, s, o);
    d[t * 2 + 1] = s;
    i[t * 4 + 0] = __shfl_up_sync(FULL, t * 7, 2);
    i[t * 4 + 1] = __shfl_sync(FULL, t, 7);
    i[t * 4 + 2] = __shfl_down_sync(FULL, t, 3, 16);
    i[t * 4 + 3] = __shfl_sync(FULL, t, 3, 8);
    v[t * 3 + 0] = __ballot_sync(FULL, lane % 3 == 0);
    v[t * 3 + 1] = (unsigned)__any_sync(FULL, t == 40);
    v[t * 3 + 2] = (unsigned)__all_sync(FULL, t < 60);
    __syncwarp();
    unsigned long long big = (unsigned long long)t << 40;
    big = __shfl_xor_sync(FULL, big, 1);
    if ((big >> 40) != (unsigned long long)(t ^ 1))
        v[t * 3 + 0] = 0;
}

void test_shuffles()
{
    const int N = 64;
    float *f = dalloc<float>(N * 2);
    double *d = dalloc<double>(N * 2);
    int *iv = dalloc<int>(N * 4);
    unsigned *v = dalloc<unsigned>(N * 3);
    k_shfl<<<1, N>>>(f, d, iv, v);
    CHECK(emu_sync() == cudaSuccess, "k_shfl: %s", emu_last_fault());
    int bad = 0;
    for (int t = 0; t < N; t++) {
        int w = t / 32 * 32, l = t % 32;
        bad += f[t * 2] != (float)(w + (l ^ 5)) + 0.5f;
        bad += f[t * 2 + 1] != (float)(l >= 16 ? t - 16 : t);
        bad += d[t * 2] != (double)(l + 3 <= 31 ? t + 3 : t) * 1e10;
        double s = 0;
        for (int k = 0; k < 32; k++)
            s += (double)(w + k) + 1e-9;
        bad += fabs(d[t * 2 + 1] - s) > 1e-6;
        bad += iv[t * 4] != (l >= 2 ? t - 2 : t) * 7;
        bad += iv[t * 4 + 1] != w + 7;
        bad += iv[t * 4 + 2] != (l % 16 + 3 <= 15 ? t + 3 : t);
        bad += iv[t * 4 + 3] != w + l / 8 * 8 + 3;
        bad += v[t * 3] != 0x49249249u;
        bad += v[t * 3 + 1] != (t >= 32 ? 1u : 0u);
        bad += v[t * 3 + 2] != (t < 32 ? 1u : 0u);
    }
    CHECK(bad == 0, "shuffles and votes: %d wrong", bad);
    if (!bad)
        printf("ok   selftest: __shfl_{xor,down,up,}_sync (float, double, int, 64-bit, width < 32), "
               "votes, __syncwarp\n");
    emu_device_free(f);
    emu_device_free(d);
    emu_device_free(iv);
    emu_device_free(v);
}

// ---- 2D and 3D indices ----

static __global__ void k_dims(int *out)
{
    int lin = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    int blk = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    int nthreads = blockDim.x * blockDim.y * blockDim.z;
    // Warps are cut from the linear index: lane 8 apart is threadIdx.y +- 1 here.
    int other = __shfl_xor_sync(FULL, lin, 8);
    out[blk * nthreads + lin] = blk * 100000 + lin * 100 + (other == (lin ^ 8));
}

void test_dims()
{
    const dim3 grids[] = { dim3(2, 3), dim3(2, 2, 2) }, blocks[] = { dim3(8, 8), dim3(8, 4, 2) };
    for (int c = 0; c < 2; c++) {
        dim3 g = grids[c], b = blocks[c];
        int nb = (int)(g.x * g.y * g.z), nt = (int)(b.x * b.y * b.z);
        int *out = dalloc<int>((size_t)nb * nt);
        k_dims<<<g, b>>>(out);
        CHECK(emu_sync() == cudaSuccess, "k_dims: %s", emu_last_fault());
        int bad = 0;
        for (int k = 0; k < nb * nt; k++)
            bad += out[k] != (k / nt) * 100000 + (k % nt) * 100 + 1;
        CHECK(bad == 0, "2D/3D indices, case %d: %d wrong", c, bad);
        emu_device_free(out);
    }
    printf("ok   selftest: threadIdx/blockIdx/blockDim/gridDim in x, y, z\n");
}

// ---- Templates, __launch_bounds__, launch configuration ----

template <int N>
static __global__ void __launch_bounds__(64) k_tmpl(int *out)
{
    out[threadIdx.x] = N * (int)threadIdx.x;
}

static __global__ void k_big(int *out)
{
    __syncthreads();
    out[threadIdx.x] = (int)threadIdx.x;
}

void test_launch_config()
{
    int *out = dalloc<int>(1024);
    k_tmpl<3><<<1, 64, 0, 0>>>(out);
    CHECK(cudaGetLastError() == cudaSuccess, "template launch");
    CHECK(emu_sync() == cudaSuccess && out[10] == 30, "template kernel");
    emu_set_fault_print(0);
    k_tmpl<3><<<1, 96>>>(out);
    CHECK(cudaGetLastError() == cudaErrorLaunchOutOfResources,
          "a block larger than __launch_bounds__ is refused");
    CHECK(cudaGetLastError() == cudaSuccess, "cudaGetLastError clears a launch error");
    k_big<<<1, 1025>>>(out);
    CHECK(cudaGetLastError() == cudaErrorInvalidConfiguration, "1025 threads are refused");
    k_big<<<0, 32>>>(out);
    CHECK(cudaGetLastError() == cudaErrorInvalidConfiguration, "an empty grid is refused");
    k_big<<<dim3(1, 65536), 32>>>(out);
    CHECK(cudaGetLastError() == cudaErrorInvalidConfiguration, "gridDim.y > 65535 is refused");
    emu_set_fault_print(1);
    k_big<<<1, 1024>>>(out);
    CHECK(emu_sync() == cudaSuccess && out[1023] == 1023, "1024 threads with a barrier");
    printf("ok   selftest: templates, __launch_bounds__, launch configuration checks\n");
    emu_device_free(out);
}

// ---- Dynamic shared memory ----

static __global__ void k_dyn(unsigned *first, int n, int past)
{
    extern __shared__ float dsm[];
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        first[blockIdx.x * n + i] = __float_as_uint(dsm[i]);
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        dsm[i] = 1.0f;
    if (past && threadIdx.x == 0)
        dsm[n] = 2.0f;
}

void test_dynamic_shared()
{
    const int n = 15000;  // 60000 bytes: over the default 48 KiB
    unsigned *first = dalloc<unsigned>(3 * n);
    emu_set_fault_print(0);
    k_dyn<<<3, 128, n * sizeof(float)>>>(first, n, 0);
    CHECK(cudaGetLastError() == cudaErrorInvalidValue,
          "over 48 KiB of dynamic shared memory without cudaFuncSetAttribute is refused");
    emu_set_fault_print(1);
    CHECK(cudaFuncSetAttribute(k_dyn, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               n * (int)sizeof(float)) == cudaSuccess,
          "cudaFuncSetAttribute");
    k_dyn<<<3, 128, n * sizeof(float)>>>(first, n, 0);
    CHECK(cudaGetLastError() == cudaSuccess, "k_dyn launch");
    CHECK(emu_sync() == cudaSuccess, "k_dyn: %s", emu_last_fault());
    int bad = 0;
    for (int i = 0; i < 3 * n; i++)
        bad += first[i] != EMU_SMEM_FILL;
    CHECK(bad == 0, "dynamic shared memory starts as NaN in every block: %d not", bad);
    printf("ok   selftest: dynamic shared memory (opt-in over 48 KiB, NaN at every block start)\n");
    emu_set_fault_print(0);
    k_dyn<<<3, 128, 1001 * sizeof(float)>>>(first, 1001, 1);  // 4004 bytes: the write lands in the padding
    expect_fault("a write past the end of dynamic shared memory", cudaErrorIllegalAddress,
                 "past the end of dynamic shared memory");
    emu_set_fault_print(1);
    emu_device_free(first);
}

// ---- Faults ----

static __global__ void k_static_oob(int *out, int k)
{
    __shared__ int sh[64];
    int *p = sh;  // (through a pointer: UBSan's bounds check would stop at sh[64] first)
    sh[threadIdx.x] = 1;
    __syncthreads();
    if (threadIdx.x == 0)
        p[k] = 2;
    out[threadIdx.x] = sh[threadIdx.x];
}

static __global__ void k_global_oob(float *p, int n) { p[n + threadIdx.x] = 1.0f; }

static __global__ void k_deadlock(int *out)
{
    int t = threadIdx.x;
    if (t == 0)
        __syncthreads();
    else
        out[t] = __shfl_xor_sync(FULL, t, 1);
}

static __global__ void k_divergent(int *out)
{
    if (threadIdx.x < 32)
        __syncthreads();
    else
        __syncthreads();
    out[threadIdx.x] = 1;
}

static __global__ void k_exited_lane(int *out)
{
    int t = threadIdx.x;
    if (t == 5)
        return;
    out[t] = __shfl_xor_sync(FULL, t, 1);
}

static __global__ void k_partial_warp(int *out)
{
    out[threadIdx.x] = __shfl_xor_sync(FULL, (int)threadIdx.x, 1);
}

void test_faults()
{
    int *out = dalloc<int>(64);
    float *small = dalloc<float>(10);
    emu_set_fault_print(0);

    k_static_oob<<<2, 64>>>(out, 64);
    expect_fault("a write past the end of a static __shared__ array", cudaErrorIllegalAddress,
                 "static __shared__");
    k_global_oob<<<1, 1>>>(small, 10);
    expect_fault("a write past the end of a device allocation", cudaErrorIllegalAddress,
                 "past the end of a device allocation");
    k_deadlock<<<1, 64>>>(out);
    expect_fault("a deadlock (barrier against shuffle)", cudaErrorLaunchFailure, "deadlock");
    k_divergent<<<1, 64>>>(out);
    expect_fault("a divergent __syncthreads", cudaErrorLaunchFailure, "divergent __syncthreads");
    k_exited_lane<<<1, 32>>>(out);
    expect_fault("a shuffle naming an exited lane", cudaErrorLaunchFailure, "exit");
    k_partial_warp<<<1, 48>>>(out);
    expect_fault("a full-mask shuffle in a partial warp", cudaErrorLaunchFailure,
                 "do not exist");
    int host[64];
    k_static_oob<<<1, 64>>>(host, 0);
    CHECK(cudaGetLastError() == cudaSuccess, "a host pointer is not a launch error");
    expect_fault("a host pointer passed to a kernel", cudaErrorIllegalAddress,
                 "not device memory");
    // A fault drops the work queued behind it.
    out[0] = 7;
    k_deadlock<<<1, 64>>>(out);
    k_tmpl<5><<<1, 64>>>(out);
    cudaError_t e = emu_sync();
    CHECK(e == cudaErrorLaunchFailure && out[0] == 7,
          "work queued after a fault does not run (%s, out[0] = %d)", cudaGetErrorName(e), out[0]);
    emu_reset_device();

    // Copies are checked against the allocations.
    float h[32] = { 0 };
    CHECK(cudaMemcpyAsync(small, h, 11 * sizeof(float), cudaMemcpyHostToDevice, 0) ==
              cudaErrorInvalidValue,
          "a copy past the end of an allocation is refused");
    CHECK(cudaMemcpyAsync(h, small, 4, cudaMemcpyHostToDevice, 0) == cudaErrorInvalidValue,
          "a copy of the wrong kind is refused");
    CHECK(cudaMemsetAsync(h, 0, 4, 0) == cudaErrorInvalidValue, "a memset of host memory is refused");
    CHECK(cudaGetLastError() == cudaErrorInvalidValue && cudaGetLastError() == cudaSuccess,
          "refused copies are not sticky");
    emu_set_fault_print(1);
    printf("ok   selftest: refused copies\n");
    emu_device_free(out);
    emu_device_free(small);
}

// ---- Streams are queues ----

static __global__ void k_set(float *p, float v) { p[threadIdx.x] = v; }

void test_deferred()
{
    float *d = dalloc<float>(32), h[32];
    cudaStream_t s;
    CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess, "stream");
    for (int i = 0; i < 32; i++)
        h[i] = 1.0f;
    CHECK(cudaMemcpyAsync(d, h, sizeof h, cudaMemcpyHostToDevice, s) == cudaSuccess, "h2d");
    for (int i = 0; i < 32; i++)
        h[i] = 2.0f;  // the copy reads the host buffer when it runs
    k_set<<<1, 16, 0, s>>>(d, 3.0f);
    float back[32];
    CHECK(cudaMemcpyAsync(back, d, sizeof back, cudaMemcpyDeviceToHost, s) == cudaSuccess, "d2h");
    CHECK(d[20] != 2.0f && d[0] != 3.0f, "nothing ran before the sync");
    CHECK(cudaStreamSynchronize(s) == cudaSuccess, "sync");
    CHECK(back[0] == 3.0f && back[15] == 3.0f && back[16] == 2.0f && back[31] == 2.0f,
          "stream order: copy, kernel, copy back");
    CHECK(cudaStreamDestroy(s) == cudaSuccess, "stream destroy");
    printf("ok   selftest: streams run in order at the sync\n");
    emu_device_free(d);
}

// ---- Scheduling: a race shows, every block runs once ----

static __global__ void k_race(int *out)
{
    __shared__ int sh[64];
    int t = threadIdx.x;
    sh[t] = t;
    // (no __syncthreads: the read races with the neighbour's write)
    out[t] = sh[(t + 1) % 64];
}

static __global__ void k_count(int *out, int *counter)
{
    if (threadIdx.x == 0)
        out[blockIdx.x] = atomicAdd(counter, 1);
}

void test_schedule()
{
    int *a = dalloc<int>(64), *b = dalloc<int>(64);
    // (The order applies when the queue runs, at the sync.)
    emu_set_schedule(EMU_ORDER_FORWARD, 0);
    k_race<<<1, 64>>>(a);
    CHECK(emu_sync() == cudaSuccess, "k_race");
    emu_set_schedule(EMU_ORDER_REVERSE, 0);
    k_race<<<1, 64>>>(b);
    CHECK(emu_sync() == cudaSuccess, "k_race");
    emu_set_schedule(EMU_ORDER_FORWARD, 0);
    CHECK(memcmp(a, b, 64 * sizeof(int)) != 0, "a missing __syncthreads changes the result "
                                                "between schedules");
    const int G = 1000;
    int *o = dalloc<int>(G), *cnt = dalloc<int>(1);
    *cnt = 0;
    emu_set_schedule(EMU_ORDER_RANDOM, 12345);
    k_count<<<G, 32>>>(o, cnt);
    CHECK(emu_sync() == cudaSuccess, "k_count");
    emu_set_schedule(EMU_ORDER_FORWARD, 0);
    std::vector<int> seen(G, 0);
    int inorder = 0;
    for (int i = 0; i < G; i++) {
        if (o[i] >= 0 && o[i] < G)
            seen[o[i]]++;
        inorder += o[i] == i;
    }
    int once = 0;
    for (int i = 0; i < G; i++)
        once += seen[i] == 1;
    CHECK(*cnt == G && once == G && inorder < G, "random block order: every block once");
    printf("ok   selftest: schedules (a missing barrier shows; random block order)\n");
    emu_device_free(a);
    emu_device_free(b);
    emu_device_free(o);
    emu_device_free(cnt);
}

// ---- nvcuda::wmma ----

using namespace nvcuda;

// d = c + a·b for one 16×16×16 tile per warp: a (bf16) row- or column-major
// from global memory (lda 24), b (bf16) through shared memory (ldb 40,
// row- or column-major), c (float) read with layout c_col, d written
// row-major (warp 0) or column-major (warp 1) into dsts[warp].
template <typename LA, typename LB>
static __global__ void k_wmma(float *d, const __nv_bfloat16 *a, const __nv_bfloat16 *b,
                              const float *c, int c_col)
{
    __shared__ __align__(32) __nv_bfloat16 bs[16 * 40];
    const int warp = threadIdx.x / 32;
    for (int i = threadIdx.x; i < 16 * 40; i += blockDim.x)
        bs[i] = b[i];
    __syncthreads();
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, LA> fa;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, LB> fb;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> fc, fd;
    wmma::load_matrix_sync(fa, a, 24);
    wmma::load_matrix_sync(fb, bs, 40);
    wmma::load_matrix_sync(fc, c, 16, c_col ? wmma::mem_col_major : wmma::mem_row_major);
    wmma::fill_fragment(fd, -1.0f);
    wmma::mma_sync(fd, fa, fb, fc);
    wmma::mma_sync(fc, fa, fb, fc);  // d aliasing c
    wmma::store_matrix_sync(d + warp * 512, fd, 16, warp ? wmma::mem_col_major : wmma::mem_row_major);
    wmma::store_matrix_sync(d + warp * 512 + 256, fc, 16, wmma::mem_row_major);
}

template <typename LA, typename LB>
int wmma_case(int a_col, int b_col, int c_col)
{
    __nv_bfloat16 *a = dalloc<__nv_bfloat16>(16 * 24), *b = dalloc<__nv_bfloat16>(16 * 40);
    float *c = dalloc<float>(256), *d = dalloc<float>(1024);
    float A[16][16], Bm[16][16], Cm[16][16];
    for (int i = 0; i < 16; i++)
        for (int j = 0; j < 16; j++) {
            // Small integers and halves: exact in bf16; sums of products exact in float.
            A[i][j] = (float)((i * 7 + j * 3) % 11 - 5) * 0.5f;
            Bm[i][j] = (float)((i * 5 + j * 13) % 9 - 4);
            Cm[i][j] = (float)(i - j) * 0.25f;
        }
    for (int i = 0; i < 16 * 24; i++)
        a[i] = __float2bfloat16_rn(1e30f);  // the padding columns: would show
    for (int i = 0; i < 16 * 40; i++)
        b[i] = __float2bfloat16_rn(1e30f);
    for (int i = 0; i < 16; i++)
        for (int j = 0; j < 16; j++) {
            a[a_col ? j * 24 + i : i * 24 + j] = __float2bfloat16_rn(A[i][j]);
            b[b_col ? j * 40 + i : i * 40 + j] = __float2bfloat16_rn(Bm[i][j]);
            c[c_col ? j * 16 + i : i * 16 + j] = Cm[i][j];
        }
    k_wmma<LA, LB><<<1, 64>>>(d, a, b, c, c_col);
    int bad = -1;
    if (emu_sync() == cudaSuccess) {
        bad = 0;
        for (int w = 0; w < 2; w++)
            for (int i = 0; i < 16; i++)
                for (int j = 0; j < 16; j++) {
                    float s = Cm[i][j];
                    for (int k = 0; k < 16; k++)
                        s += A[i][k] * Bm[k][j];
                    const float *dw = d + w * 512;
                    bad += dw[w ? j * 16 + i : i * 16 + j] != s;
                    bad += dw[256 + i * 16 + j] != s;
                }
    }
    emu_device_free(a);
    emu_device_free(b);
    emu_device_free(c);
    emu_device_free(d);
    return bad;
}

// Rule breakers: which = 0 half the warp calls, 1 two values, 2 a pointer
// 16 bytes off, 3 ldm 20 for bf16, 4 lanes pass different fragments, 5 the
// lanes pass different pointers, 6 a warp of 16 threads (block of 48).
static __global__ void k_wmma_bad(float *out, const __nv_bfloat16 *a, int which)
{
    const int lane = threadIdx.x % 32;
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa[2];
    wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> fb;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
    if (which == 0) {
        if (lane < 16)
            wmma::fill_fragment(acc, 1.0f);
        else
            wmma::fill_fragment(acc, 2.0f);
    } else if (which == 1) {
        wmma::fill_fragment(acc, lane < 16 ? 1.0f : 2.0f);
    } else if (which == 2) {
        wmma::load_matrix_sync(fa[0], a + 8, 16);
    } else if (which == 3) {
        wmma::load_matrix_sync(fa[0], a, 20);
    } else if (which == 4) {
        wmma::load_matrix_sync(fa[0], a, 16);
        wmma::load_matrix_sync(fa[1], a + 256, 16);
        wmma::load_matrix_sync(fb, a, 16);
        wmma::fill_fragment(acc, 0.0f);
        wmma::mma_sync(acc, fa[lane & 1], fb, acc);
    } else if (which == 5) {
        wmma::load_matrix_sync(fa[0], a + (lane & 1) * 16, 16);
    } else {
        wmma::fill_fragment(acc, 0.0f);
    }
    if (which != 0 && which != 1)
        wmma::fill_fragment(acc, 0.0f);
    wmma::store_matrix_sync(out, acc, 16, wmma::mem_row_major);
}

void test_wmma()
{
    int bad = wmma_case<wmma::row_major, wmma::row_major>(0, 0, 0) +
              wmma_case<wmma::col_major, wmma::col_major>(1, 1, 1) +
              wmma_case<wmma::row_major, wmma::col_major>(0, 1, 0) +
              wmma_case<wmma::col_major, wmma::row_major>(1, 0, 1);
    CHECK(bad == 0, "wmma: %d wrong elements (-1: a fault: %s)", bad, emu_last_fault());
    if (bad == 0)
        printf("ok   selftest: wmma bf16 m16n16k16 (row/col-major a, b; accumulator layouts; "
               "global and shared memory; d aliasing c)\n");
    __nv_bfloat16 *a = dalloc<__nv_bfloat16>(1024);
    for (int i = 0; i < 1024; i++)
        a[i] = __float2bfloat16_rn((float)(i % 7));
    float *out = dalloc<float>(256);
    emu_set_fault_print(0);
    k_wmma_bad<<<1, 32>>>(out, a, 0);
    expect_fault("wmma called by half a warp", cudaErrorLaunchFailure, "all 32 lanes must call");
    k_wmma_bad<<<1, 32>>>(out, a, 1);
    expect_fault("wmma::fill_fragment with two values in one warp", cudaErrorLaunchFailure,
                 "other arguments");
    k_wmma_bad<<<1, 32>>>(out, a, 2);
    expect_fault("wmma::load_matrix_sync at a 16-byte aligned pointer", cudaErrorLaunchFailure,
                 "256-bit");
    k_wmma_bad<<<1, 32>>>(out, a, 3);
    expect_fault("wmma::load_matrix_sync with ldm 20 (bf16)", cudaErrorLaunchFailure,
                 "not a multiple of 8");
    k_wmma_bad<<<1, 32>>>(out, a, 4);
    expect_fault("wmma::mma_sync with different fragments per lane", cudaErrorLaunchFailure,
                 "differs from lane 0");
    k_wmma_bad<<<1, 32>>>(out, a, 5);
    expect_fault("wmma::load_matrix_sync with different pointers per lane", cudaErrorLaunchFailure,
                 "other arguments");
    k_wmma_bad<<<1, 48>>>(out, a, 6);
    expect_fault("wmma in a warp of 16 threads", cudaErrorLaunchFailure, "all 32 lanes");
    emu_set_fault_print(1);
    emu_device_free(a);
    emu_device_free(out);
}

}  // namespace

int emu_selftest(void)
{
    g_fails = 0;
    test_static_shared();
    test_early_exit();
    test_shuffles();
    test_dims();
    test_launch_config();
    test_dynamic_shared();
    test_faults();
    test_deferred();
    test_schedule();
    test_wmma();
    emu_reset_device();
    return g_fails;
}
