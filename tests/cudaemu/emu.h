// tests/cudaemu/emu.h: a CPU emulation of the parts of CUDA that cuda/*.cu
// use, so their kernels run (and are checked) on machines without a GPU.
// transform.py turns a .cu file into C++ for it; cuda/common.cuh compiles
// as it is, against the stand-in CUDA headers in include/.
//
// Execution model. Every CUDA thread of a block is a fiber on the calling
// OS thread (emu.cc); blocks run one after another. A fiber runs until it
// reaches a synchronisation point (__syncthreads, a warp shuffle or vote,
// __syncwarp) or exits; then the next ready fiber of the block runs. So:
//   - __syncthreads waits for every thread of the block that has not exited
//     (an exited thread no longer takes part, as on sm_70 and later); the
//     waiting threads must all be at the same __syncthreads (file and line),
//     otherwise the launch fails ("divergent __syncthreads").
//   - a warp op (__shfl_*_sync, __ballot_sync, __any_sync, __all_sync,
//     __syncwarp) waits for the lanes its mask names; every lane named must
//     exist and not have exited, the calling lane must be named, and all of
//     them must call the same op at the same place with the same mask. The
//     shuffles follow PTX shfl.sync (width, clamping); one whose source lane
//     is outside the mask fails the launch. Values of up to 8 bytes.
//   - threads that wait on each other with no ready thread left (a barrier
//     some thread never reaches while another waits in a shuffle) fail the
//     launch with "deadlock" instead of hanging.
//   - emu_set_schedule picks the order threads start and resume in, and
//     blocks run in (forward, reverse, random); in reverse and random order
//     a warp may run ahead of the others up to its next barrier. Tests run an
//     op under several orders: a missing barrier (a race) shows as different
//     results.
// Shared memory is per block: dynamic (extern __shared__) memory is the
// launch's byte count, static __shared__ arrays are rewritten by
// transform.py into references into per-block storage; both are filled with
// a NaN pattern (EMU_SMEM_FILL) when a block starts, and guard bytes after
// them are checked when it ends (a guard page follows the dynamic area, so
// a far access faults too). Static arrays are at most 48 KiB per block; more
// than 48 KiB of dynamic memory needs cudaFuncSetAttribute for that kernel,
// up to the device's opt-in (emu_set_smem_optin; H100's by default).
//
// Streams are queues: kernel launches, cudaMemcpyAsync and cudaMemsetAsync
// only record work, which runs at cudaStreamSynchronize,
// cudaDeviceSynchronize, cudaMemcpy, cudaMemset, cudaFree (which wait, as on
// a GPU) or emu_sync(). A launch's configuration (grid and block limits,
// __launch_bounds__, shared memory) is checked when it is queued: the error
// cudaGetLastError returns then. A fault while it runs is sticky (as an
// illegal address is on a GPU): every later call returns it, and queued
// work is dropped, until emu_reset_device().
//
// Device memory comes from cudaMalloc / emu_device_malloc: each allocation
// ends at a guard page (and unaligned tails are checked after each launch),
// a kernel's pointer arguments must point into one (a host pointer passed to
// a kernel fails the launch), and cudaMemcpy*'s ranges and kinds are checked
// against them. The host may read and write it directly (after a sync).
//
// Tensor cores: nvcuda::wmma (include/mma.h) for the m16n16k16 shape with
// bf16 operands and fp32 accumulators. A fragment holds the whole 16×16
// tile in every lane (the real per-lane element placement is opaque to code
// that uses only the wmma calls, and fragments here have no x[] or
// num_elements, so code that touches elements does not compile against the
// emulator). Every wmma call is warp-collective (emu_warp_collective): all
// 32 lanes of the warp must call it at the same place with the same
// arguments, and pass fragments with the same contents, otherwise the
// launch fails; loads and stores check CUDA's rules (a 256-bit aligned
// pointer, ldm a multiple of 16 bytes). The warp's memory access happens
// when its last lane arrives, as one converged warp instruction; mma_sync
// sums in fp32 in increasing k (the products of bf16 values are exact),
// one of the orders a tensor core may use, not bit for bit a GPU's.
//
// Not emulated: a GPU's timing, several streams or blocks running at once
// (there is one queue, and blocks run one at a time), host threads running
// kernels concurrently (the device is one lock), the GPU's libm (expf,
// erff, rsqrtf, ... are the host's: results agree to an ulp or two, not bit
// for bit; the IEEE operations and the __f*_rn intrinsics are exact), FMA
// contraction (nvcc fuses a*b+c by default; this build never does),
// __shared__ at file scope, cooperative groups, textures, graphs, the
// tensor cores' own accumulation order and the other wmma shapes and types,
// cuBLAS(Lt) and the driver API.
#ifndef TESTS_CUDAEMU_EMU_H
#define TESTS_CUDAEMU_EMU_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <tuple>
#include <type_traits>
#include <utility>

// ---- Types ----

struct uint3 {
    unsigned x, y, z;
};

struct dim3 {
    unsigned x, y, z;
    constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
    constexpr dim3(uint3 u) : x(u.x), y(u.y), z(u.z) {}
};

enum cudaError {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorMemoryAllocation = 2,
    cudaErrorInvalidConfiguration = 9,
    cudaErrorInvalidDeviceFunction = 98,
    cudaErrorInvalidDevice = 101,
    cudaErrorInvalidResourceHandle = 400,
    cudaErrorIllegalAddress = 700,
    cudaErrorLaunchOutOfResources = 701,
    cudaErrorLaunchFailure = 719,
};
typedef enum cudaError cudaError_t;

typedef struct emu_stream *cudaStream_t;

enum cudaMemcpyKind {
    cudaMemcpyHostToHost = 0,
    cudaMemcpyHostToDevice = 1,
    cudaMemcpyDeviceToHost = 2,
    cudaMemcpyDeviceToDevice = 3,
    cudaMemcpyDefault = 4,
};

enum cudaDeviceAttr {
    cudaDevAttrMaxThreadsPerBlock = 1,
    cudaDevAttrMaxSharedMemoryPerBlock = 8,
    cudaDevAttrWarpSize = 10,
    cudaDevAttrMultiProcessorCount = 16,
    cudaDevAttrMaxSharedMemoryPerBlockOptin = 97,
};

enum cudaFuncAttribute {
    cudaFuncAttributeMaxDynamicSharedMemorySize = 8,
    cudaFuncAttributePreferredSharedMemoryCarveout = 9,
};

enum { cudaStreamNonBlocking = 1 };

// Vector types (as CUDA aligns them).
struct alignas(8) float2 {
    float x, y;
};
struct alignas(16) float4 {
    float x, y, z, w;
};
struct alignas(16) double2 {
    double x, y;
};
struct alignas(8) int2 {
    int x, y;
};
struct alignas(16) int4 {
    int x, y, z, w;
};
struct alignas(8) uint2 {
    unsigned x, y;
};
struct alignas(16) uint4 {
    unsigned x, y, z, w;
};
static inline float2 make_float2(float x, float y) { return float2{ x, y }; }
static inline float4 make_float4(float x, float y, float z, float w) { return float4{ x, y, z, w }; }
static inline int2 make_int2(int x, int y) { return int2{ x, y }; }
static inline uint3 make_uint3(unsigned x, unsigned y, unsigned z) { return uint3{ x, y, z }; }

// ---- Qualifiers ----

#define __global__
#define __device__
#define __host__
#define __constant__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
// transform.py rewrites every __shared__ declaration; one it missed must
// not compile into a per-thread variable.
#define __shared__ _Pragma("GCC error \"__shared__ left for the compiler: run it through tests/cudaemu/transform.py\"")
// __restrict__ is a GCC keyword already.

// ---- Built-in variables ----

extern const uint3 *emu_cur_tid;  // the running CUDA thread's index
extern uint3 emu_block_idx, emu_block_dim, emu_grid_dim;
#define threadIdx (*emu_cur_tid)
#define blockIdx (static_cast<const uint3 &>(emu_block_idx))
#define blockDim (static_cast<const uint3 &>(emu_block_dim))
#define gridDim (static_cast<const uint3 &>(emu_grid_dim))
#define warpSize 32

// ---- Synchronisation ----

void emu_syncthreads(const char *file, int line);
#define __syncthreads() emu_syncthreads(__FILE__, __LINE__)

enum emu_warp_kind {
    EMU_WARP_SYNC,
    EMU_WARP_SHFL_IDX,
    EMU_WARP_SHFL_UP,
    EMU_WARP_SHFL_DOWN,
    EMU_WARP_SHFL_XOR,
    EMU_WARP_BALLOT,
    EMU_WARP_ANY,
    EMU_WARP_ALL,
    EMU_WARP_COLLECTIVE,  // emu_warp_collective (the wmma calls)
};
// One lane's part in a warp op: its value (up to 8 bytes), the op's operand
// b and its c (PTX shfl.sync: segment mask and clamp). Returns the lane's
// result bits.
uint64_t emu_warp_op(const char *file, int line, int kind, unsigned mask, uint64_t value, int b,
                     int c);

template <typename T>
static inline uint64_t emu_bits(T v)
{
    static_assert(std::is_trivially_copyable<T>::value && sizeof(T) <= 8,
                  "warp shuffles move values of up to 8 bytes");
    uint64_t u = 0;
    memcpy(&u, &v, sizeof v);
    return u;
}

template <typename T>
static inline T emu_from_bits(uint64_t u)
{
    T v;
    memcpy(&v, &u, sizeof v);
    return v;
}

// c as nvcc encodes it: the segment mask (32 - width) in bits 8-12, the
// clamp in bits 0-4 (0 for up, 31 for the others).
static inline int emu_shfl_c(int width, int clamp) { return ((32 - width) << 8) | clamp; }

template <typename T>
static inline T emu_shfl(const char *file, int line, int kind, unsigned mask, T v, int b, int width,
                         int clamp)
{
    return emu_from_bits<T>(
        emu_warp_op(file, line, kind, mask, emu_bits(v), b, emu_shfl_c(width, clamp)));
}

#define __shfl_sync(mask, v, ...) emu_shfl_idx(__FILE__, __LINE__, mask, v, __VA_ARGS__)
#define __shfl_up_sync(mask, v, ...) emu_shfl_up(__FILE__, __LINE__, mask, v, __VA_ARGS__)
#define __shfl_down_sync(mask, v, ...) emu_shfl_down(__FILE__, __LINE__, mask, v, __VA_ARGS__)
#define __shfl_xor_sync(mask, v, ...) emu_shfl_xor(__FILE__, __LINE__, mask, v, __VA_ARGS__)

template <typename T>
static inline T emu_shfl_idx(const char *f, int l, unsigned mask, T v, int src, int width = 32)
{
    return emu_shfl(f, l, EMU_WARP_SHFL_IDX, mask, v, src, width, 31);
}
template <typename T>
static inline T emu_shfl_up(const char *f, int l, unsigned mask, T v, unsigned d, int width = 32)
{
    return emu_shfl(f, l, EMU_WARP_SHFL_UP, mask, v, (int)d, width, 0);
}
template <typename T>
static inline T emu_shfl_down(const char *f, int l, unsigned mask, T v, unsigned d, int width = 32)
{
    return emu_shfl(f, l, EMU_WARP_SHFL_DOWN, mask, v, (int)d, width, 31);
}
template <typename T>
static inline T emu_shfl_xor(const char *f, int l, unsigned mask, T v, int lane_mask,
                             int width = 32)
{
    return emu_shfl(f, l, EMU_WARP_SHFL_XOR, mask, v, lane_mask, width, 31);
}

// __syncwarp() or __syncwarp(mask): the macro names a call site, whose
// operator() takes the optional mask.
struct emu_syncwarp_at {
    const char *file;
    int line;
    void operator()(unsigned mask = 0xffffffffu) const
    {
        (void)emu_warp_op(file, line, EMU_WARP_SYNC, mask, 0, 0, 0);
    }
};
#define __syncwarp emu_syncwarp_at{__FILE__, __LINE__}
#define __ballot_sync(mask, p) \
    ((unsigned)emu_warp_op(__FILE__, __LINE__, EMU_WARP_BALLOT, mask, (p) != 0, 0, 0))
#define __any_sync(mask, p) ((int)emu_warp_op(__FILE__, __LINE__, EMU_WARP_ANY, mask, (p) != 0, 0, 0))
#define __all_sync(mask, p) ((int)emu_warp_op(__FILE__, __LINE__, EMU_WARP_ALL, mask, (p) != 0, 0, 0))

// A warp-collective operation (the wmma calls of include/mma.h): all 32
// lanes of the warp (they must exist and not have exited) call it at the
// same place (file, line) with the same `what` and the same argument bytes
// (args, at most EMU_COLLECTIVE_ARGS of them); lane_data is the calling
// lane's own pointer (its fragments). When the last lane arrives, run(data,
// args) is called once, on that lane, with data[l] lane l's lane_data;
// then every lane goes on. A lane with other arguments, at another place,
// or arriving while others wait in a shuffle fails the launch.
#define EMU_COLLECTIVE_ARGS 64
typedef void (*emu_collective_fn)(void *const *lane_data, const void *args);
void emu_warp_collective(const char *file, int line, const char *what, const void *args,
                         size_t args_len, void *lane_data, emu_collective_fn run);
// Fails the running launch with a message (the kernel, block and thread
// are added); for checks of device-side rules, such as the wmma ones.
[[noreturn]] void emu_kernel_fault(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
// The calling CUDA thread's lane (its index in the block modulo 32).
int emu_lane(void);

static inline void __threadfence(void) {}
static inline void __threadfence_block(void) {}
template <typename T>
static inline T __ldg(const T *p)
{
    return *p;
}

// ---- Shared memory ----

// Per-block storage for one static __shared__ declaration (key: its site).
void *emu_static_shared_alloc(const void *key, size_t bytes, size_t align);
template <typename T>
static inline T *emu_static_shared(const void *key, size_t align = alignof(T))
{
    return static_cast<T *>(emu_static_shared_alloc(key, sizeof(T), align));
}
// The block's dynamic shared memory (the launch's byte count).
void *emu_dynamic_shared_base(void);
template <typename T>
static inline T *emu_dynamic_shared(void)
{
    return static_cast<T *>(emu_dynamic_shared_base());
}

// What shared memory holds when a block starts: a NaN as float (and, two
// of them, as double); as an int, a large positive number.
#define EMU_SMEM_FILL 0x7ff80000u

// ---- Arithmetic ----

template <typename A, typename B>
static inline typename std::common_type<A, B>::type min(A a, B b)
{
    typedef typename std::common_type<A, B>::type R;
    return (R)b < (R)a ? (R)b : (R)a;
}
template <typename A, typename B>
static inline typename std::common_type<A, B>::type max(A a, B b)
{
    typedef typename std::common_type<A, B>::type R;
    return (R)a < (R)b ? (R)b : (R)a;
}

// IEEE round-to-nearest operations (this build never contracts a*b+c).
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline float __fsqrt_rn(float a) { return sqrtf(a); }
static inline float __frcp_rn(float a) { return 1.0f / a; }
static inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
static inline double __dadd_rn(double a, double b) { return a + b; }
static inline double __dsub_rn(double a, double b) { return a - b; }
static inline double __dmul_rn(double a, double b) { return a * b; }
static inline double __ddiv_rn(double a, double b) { return a / b; }
static inline double __dsqrt_rn(double a) { return sqrt(a); }
static inline double __fma_rn(double a, double b, double c) { return fma(a, b, c); }
// The GPU's approximate functions, here the host's libm (glibc declares __expf and
// __logf itself).
static inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
static inline double rsqrt(double x) { return 1.0 / sqrt(x); }
static inline float __fdividef(float a, float b) { return a / b; }
static inline float __saturatef(float x) { return x < 0.0f ? 0.0f : x > 1.0f ? 1.0f : x != x ? 0.0f : x; }

static inline unsigned __float_as_uint(float f) { return emu_from_bits<unsigned>(emu_bits(f)); }
static inline int __float_as_int(float f) { return emu_from_bits<int>(emu_bits(f)); }
static inline float __uint_as_float(unsigned u) { return emu_from_bits<float>(emu_bits(u)); }
static inline float __int_as_float(int u) { return emu_from_bits<float>(emu_bits(u)); }
static inline long long __double_as_longlong(double d) { return emu_from_bits<long long>(emu_bits(d)); }
static inline double __longlong_as_double(long long u) { return emu_from_bits<double>(emu_bits(u)); }
static inline int __popc(unsigned x) { return __builtin_popcount(x); }
static inline int __clz(int x) { return x ? __builtin_clz((unsigned)x) : 32; }
static inline int __ffs(int x) { return __builtin_ffs(x); }

// Atomics: fibers never run at once, so a read-modify-write is atomic.
template <typename T>
static inline T atomicAdd(T *p, T v)
{
    T o = *p;
    *p = o + v;
    return o;
}
template <typename T>
static inline T atomicExch(T *p, T v)
{
    T o = *p;
    *p = v;
    return o;
}
template <typename T>
static inline T atomicCAS(T *p, T cmp, T v)
{
    T o = *p;
    if (o == cmp)
        *p = v;
    return o;
}
template <typename T>
static inline T atomicMax(T *p, T v)
{
    T o = *p;
    *p = o < v ? v : o;
    return o;
}
template <typename T>
static inline T atomicMin(T *p, T v)
{
    T o = *p;
    *p = v < o ? v : o;
    return o;
}

// ---- Launches ----

struct emu_launch_base {
    const char *name, *file;
    int line;
    dim3 grid, block;
    size_t smem;
    int max_threads;     // __launch_bounds__, or 1024
    const void *kernel;  // the kernel's address: cudaFuncSetAttribute's key
    cudaStream_t stream;
    char bad_arg[192];   // why a pointer argument is not device memory ("" when fine)
    virtual void run() = 0;
    virtual ~emu_launch_base() {}
};

// Checks the configuration (the error is cudaGetLastError's), then queues
// l on its stream (taking it) or deletes it.
void emu_submit_launch(emu_launch_base *l);
// A kernel argument that is a pointer must point into device memory (or be
// NULL); a failure is recorded in l->bad_arg and fails the launch when it
// runs (as the illegal address it would be on a GPU).
void emu_check_kernel_pointer(emu_launch_base *l, int index, const void *p);

template <typename F>
static inline const void *emu_kernel_key(F *f)
{
    return reinterpret_cast<const void *>(f);
}

template <typename... P>
struct emu_launch_of : emu_launch_base {
    void (*fn)(P...);
    std::tuple<typename std::decay<P>::type...> args;
    template <typename... A>
    explicit emu_launch_of(void (*f)(P...), A &&...a) : fn(f), args(std::forward<A>(a)...)
    {
    }
    void run() override { std::apply(fn, args); }
};

template <typename T>
static inline void emu_check_arg(emu_launch_base *l, int i, const T &v)
{
    if constexpr (std::is_pointer<T>::value)
        emu_check_kernel_pointer(l, i, (const void *)v);
    else
        (void)l, (void)i, (void)v;
}

template <typename Tuple, size_t... I>
static inline void emu_check_args(emu_launch_base *l, const Tuple &t, std::index_sequence<I...>)
{
    (emu_check_arg(l, (int)I, std::get<I>(t)), ...);
}

// What transform.py turns kernel<<<grid, block, smem, stream>>>(args) into.
template <typename... P, typename... A>
static inline void emu_launch(const char *name, const char *file, int line, int max_threads,
                              dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                              void (*fn)(P...), A &&...a)
{
    static_assert(sizeof...(P) == sizeof...(A), "a kernel launch passes every parameter");
    auto *l = new emu_launch_of<P...>(fn, std::forward<A>(a)...);
    l->name = name;
    l->file = file;
    l->line = line;
    l->grid = grid;
    l->block = block;
    l->smem = smem;
    l->max_threads = max_threads;
    l->kernel = emu_kernel_key(fn);
    l->stream = stream;
    l->bad_arg[0] = 0;
    emu_check_args(l, l->args, std::index_sequence_for<P...>{});
    emu_submit_launch(l);
}

// ---- The runtime API ----

cudaError_t cudaGetLastError(void);
cudaError_t cudaPeekAtLastError(void);
const char *cudaGetErrorString(cudaError_t e);
const char *cudaGetErrorName(cudaError_t e);
cudaError_t cudaMalloc(void **p, size_t bytes);
template <typename T>
static inline cudaError_t cudaMalloc(T **p, size_t bytes)
{
    return cudaMalloc(reinterpret_cast<void **>(p), bytes);
}
cudaError_t cudaFree(void *p);
cudaError_t cudaMemcpy(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind);
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t s = 0);
cudaError_t cudaMemset(void *dst, int value, size_t bytes);
cudaError_t cudaMemsetAsync(void *dst, int value, size_t bytes, cudaStream_t s = 0);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned flags);
cudaError_t cudaStreamDestroy(cudaStream_t s);
cudaError_t cudaStreamSynchronize(cudaStream_t s);
cudaError_t cudaDeviceSynchronize(void);
cudaError_t cudaGetDevice(int *d);
cudaError_t cudaSetDevice(int d);
cudaError_t cudaDeviceGetAttribute(int *v, cudaDeviceAttr a, int device);
cudaError_t emu_func_set_attribute(const void *kernel, cudaFuncAttribute a, int v);
template <typename F>
static inline cudaError_t cudaFuncSetAttribute(F *f, cudaFuncAttribute a, int v)
{
    return emu_func_set_attribute(emu_kernel_key(f), a, v);
}

// ---- For tests ----

// Device memory (cudaMalloc's), NULL when out of memory; emu_device_free
// accepts NULL. Neither waits.
void *emu_device_malloc(size_t bytes);
void emu_device_free(void *p);
// 1 when [p, p + bytes) lies in one device allocation.
int emu_is_device(const void *p, size_t bytes);
// Runs the queued work; returns the sticky error (cudaSuccess when none).
cudaError_t emu_sync(void);
// Drops queued work and clears the sticky and the last error.
void emu_reset_device(void);
// The order threads of a block start and resume in, and blocks run in:
// forward (threads and blocks in increasing order; the lanes of a warp op
// resume behind every ready thread, so warps advance together), reverse
// (decreasing order; a warp whose op completes runs on ahead of the others
// up to its next barrier) or random (random orders, a warp runs ahead or not
// at random; seeded).
enum { EMU_ORDER_FORWARD, EMU_ORDER_REVERSE, EMU_ORDER_RANDOM };
void emu_set_schedule(int order, uint64_t seed);
// cudaDevAttrMaxSharedMemoryPerBlockOptin (H100: 232448 bytes).
void emu_set_smem_optin(int bytes);
// The last fault's message ("" after emu_reset_device), and whether faults
// are printed to stderr (they are by default).
const char *emu_last_fault(void);
void emu_set_fault_print(int on);
// The kernels run since the last call, as "name[dynamic shared bytes]"
// joined by ", " (each distinct one once, in order); clears the log.
void emu_kernel_log(char *buf, size_t len);
// Counters since the start.
struct emu_stats {
    long launches, blocks, threads, switches;
};
emu_stats emu_get_stats(void);

#endif
