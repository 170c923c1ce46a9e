// cuda/step.cu: the optimizer step on the GPU: the gradient's squared norm,
// the checked AdamW and SGD updates, and the fp32 -> bf16 cast of weights.
//
// Determinism. A sum is cut into fixed chunks of CHUNK elements (the cut
// depends on n alone); a block of 256 threads sums one chunk in double
// (each thread a fixed stride, then a fixed tree), writes it to scratch,
// and one block adds the chunks' sums in order with the same tree. No
// atomics: the same n and data give the same bits on every run.
//
// The updates compute element for element what the CPU's
// expert_adamw_update_checked and expert_sgd_update_checked compute: the
// same operations in the same order, with __fmul_rn/__fadd_rn so that nvcc
// does not contract them into FMAs (the CPU build, in ISO C mode, does not
// either), and IEEE division and square root (nvcc's defaults). So a step
// on the GPU gives the CPU's weights bit for bit, given the same
// gradients. The sums that check the step (Σ Δp², Σ p'² + 0·moments) are
// taken in double here and in float lanes on the CPU: they only feed a
// relative change and a finiteness test.
#include "cuda/common.cuh"

#include "expert/optim.h"

#include <math.h>

#define THREADS 256
#define CHUNK (THREADS * 16)

// Sums v over the block in a fixed order; the result is valid in thread 0.
__device__ static double block_sum(double v, double *sh)
{
    v = cuda__warp_sum_d(v);
    int lane = threadIdx.x % 32, w = threadIdx.x / 32;
    if (lane == 0)
        sh[w] = v;
    __syncthreads();
    v = 0.0;
    if (w == 0) {
        v = lane < THREADS / 32 ? sh[lane] : 0.0;
        v = cuda__warp_sum_d(v);
    }
    __syncthreads();
    return v;
}

// part[chunk] = Σ x² over the chunk.
static __global__ void sq_chunks_kernel(double *part, const float *x, size_t n)
{
    __shared__ double sh[THREADS / 32];
    size_t lo = (size_t)blockIdx.x * CHUNK, hi = lo + CHUNK < n ? lo + CHUNK : n;
    double s = 0.0;
    for (size_t i = lo + threadIdx.x; i < hi; i += THREADS) {
        double v = (double)x[i];
        s += v * v;
    }
    s = block_sum(s, sh);
    if (threadIdx.x == 0)
        part[blockIdx.x] = s;
}

// out[k] = Σ_chunk part[chunk·K + k] for k < K, in chunk order per thread,
// then the fixed tree (one block).
static __global__ void sum_parts_kernel(double *out, const double *part, size_t chunks, int K)
{
    __shared__ double sh[THREADS / 32];
    for (int k = 0; k < K; k++) {
        double s = 0.0;
        for (size_t i = threadIdx.x; i < chunks; i += THREADS)
            s += part[i * (size_t)K + (size_t)k];
        s = block_sum(s, sh);
        if (threadIdx.x == 0)
            out[k] = s;
    }
}

// Sums K values per chunk (written to part) into host out[K]; waits.
static int finish_sums(cuda__ctx *c, double *part, size_t chunks, int K, double *out)
{
    sum_parts_kernel<<<1, THREADS, 0, c->stream>>>(c->sums, part, chunks, K);
    int rc = cuda__launch_status();
    if (rc != 0)
        return rc;
    if (cudaMemcpyAsync(out, c->sums, (size_t)K * sizeof(double), cudaMemcpyDeviceToHost,
                        c->stream) != cudaSuccess)
        return cuda__launch_status();
    cudaError_t e = cudaStreamSynchronize(c->stream);
    if (e != cudaSuccess)
        return expert_backend_set_error(-EIO, "CUDA: the step's work failed: %s", cudaGetErrorString(e));
    return 0;
}

extern "C" int cuda_sqnorm(double *out, const float *x, size_t n)
{
    if (!out || (!x && n))
        return -EINVAL;
    cuda__ctx *c = cuda__context();
    if (!c)
        return -ENODEV;
    if (n == 0) {
        *out = 0.0;
        return 0;
    }
    size_t chunks = (n + CHUNK - 1) / CHUNK;
    double *part = (double *)cuda__scratch(c, chunks * sizeof(double));
    if (!part)
        return -ENOMEM;
    sq_chunks_kernel<<<(unsigned)chunks, THREADS, 0, c->stream>>>(part, x, n);
    int rc = cuda__launch_status();
    return rc ? rc : finish_sums(c, part, chunks, 1, out);
}

struct adamw_k {
    float gscale, b1, b2, eps, decay, step_size, bc2_sqrt;
};

static __global__ void adamw_kernel(float *__restrict__ p_out, const float *__restrict__ p_in,
                                    const float *__restrict__ g, float *__restrict__ m,
                                    float *__restrict__ v, size_t n, struct adamw_k k,
                                    double *part)
{
    __shared__ double sh[THREADS / 32];
    size_t lo = (size_t)blockIdx.x * CHUNK, hi = lo + CHUNK < n ? lo + CHUNK : n;
    double dd = 0.0, pp = 0.0;
    const float one_b1 = 1.0f - k.b1, one_b2 = 1.0f - k.b2; // as the CPU: (1.0f - b)
    for (size_t i = lo + threadIdx.x; i < hi; i += THREADS) {
        float gi = __fmul_rn(g[i], k.gscale);
        float p = __fmul_rn(p_in[i], k.decay);
        float mi = __fadd_rn(__fmul_rn(m[i], k.b1), __fmul_rn(one_b1, gi));
        float vi = __fadd_rn(__fmul_rn(v[i], k.b2), __fmul_rn(__fmul_rn(one_b2, gi), gi));
        m[i] = mi;
        v[i] = vi;
        float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), k.bc2_sqrt), k.eps);
        float po = __fsub_rn(p, __fmul_rn(k.step_size, __fdiv_rn(mi, denom)));
        p_out[i] = po;
        float d = __fsub_rn(po, p_in[i]);
        dd += (double)d * d;
        pp += (double)po * po + (double)(mi + vi) * 0.0;
    }
    dd = block_sum(dd, sh);
    pp = block_sum(pp, sh);
    if (threadIdx.x == 0) {
        part[2 * (size_t)blockIdx.x] = dd;
        part[2 * (size_t)blockIdx.x + 1] = pp;
    }
}

extern "C" int cuda_adamw_update(float *p_out, const float *p_in, const float *g, float *m, float *v,
                                 size_t n, float gscale, const struct expert_optim *o, uint64_t t,
                                 double sums[2])
{
    if (!p_out || !p_in || !g || !m || !v || !o || !sums || o->kind != EXPERT_OPTIM_ADAMW)
        return -EINVAL;
    cuda__ctx *c = cuda__context();
    if (!c)
        return -ENODEV;
    if (n == 0)
        return 0;
    // The scalars exactly as expert_adamw_update_checked derives them.
    double bc1 = 1.0 - pow((double)o->beta1, (double)t);
    double bc2 = 1.0 - pow((double)o->beta2, (double)t);
    struct adamw_k k = { gscale, o->beta1, o->beta2, o->eps, 1.0f - o->lr * o->weight_decay,
                         (float)(o->lr / bc1), (float)sqrt(bc2) };
    size_t chunks = (n + CHUNK - 1) / CHUNK;
    double *part = (double *)cuda__scratch(c, 2 * chunks * sizeof(double));
    if (!part)
        return -ENOMEM;
    adamw_kernel<<<(unsigned)chunks, THREADS, 0, c->stream>>>(p_out, p_in, g, m, v, n, k, part);
    int rc = cuda__launch_status();
    double s[2];
    if (rc == 0)
        rc = finish_sums(c, part, chunks, 2, s);
    if (rc == 0) {
        sums[0] += s[0];
        sums[1] += s[1];
    }
    return rc;
}

static __global__ void sgd_kernel(float *__restrict__ p_out, const float *__restrict__ p_in,
                                  const float *__restrict__ g, float *__restrict__ buf, size_t n,
                                  float gscale, float lr, float wd, float mom, double *part)
{
    __shared__ double sh[THREADS / 32];
    size_t lo = (size_t)blockIdx.x * CHUNK, hi = lo + CHUNK < n ? lo + CHUNK : n;
    double dd = 0.0, pp = 0.0;
    for (size_t i = lo + threadIdx.x; i < hi; i += THREADS) {
        float gi = __fadd_rn(__fmul_rn(g[i], gscale), __fmul_rn(wd, p_in[i]));
        float b = __fadd_rn(__fmul_rn(mom, buf[i]), gi);
        buf[i] = b;
        float po = __fsub_rn(p_in[i], __fmul_rn(lr, b));
        p_out[i] = po;
        float d = __fsub_rn(po, p_in[i]);
        dd += (double)d * d;
        pp += (double)po * po + (double)b * 0.0;
    }
    dd = block_sum(dd, sh);
    pp = block_sum(pp, sh);
    if (threadIdx.x == 0) {
        part[2 * (size_t)blockIdx.x] = dd;
        part[2 * (size_t)blockIdx.x + 1] = pp;
    }
}

extern "C" int cuda_sgd_update(float *p_out, const float *p_in, const float *g, float *buf, size_t n,
                               float gscale, const struct expert_optim *o, double sums[2])
{
    if (!p_out || !p_in || !g || !buf || !o || !sums || o->kind != EXPERT_OPTIM_SGD)
        return -EINVAL;
    cuda__ctx *c = cuda__context();
    if (!c)
        return -ENODEV;
    if (n == 0)
        return 0;
    size_t chunks = (n + CHUNK - 1) / CHUNK;
    double *part = (double *)cuda__scratch(c, 2 * chunks * sizeof(double));
    if (!part)
        return -ENOMEM;
    sgd_kernel<<<(unsigned)chunks, THREADS, 0, c->stream>>>(p_out, p_in, g, buf, n, gscale, o->lr,
                                                           o->weight_decay, o->momentum, part);
    int rc = cuda__launch_status();
    double s[2];
    if (rc == 0)
        rc = finish_sums(c, part, chunks, 2, s);
    if (rc == 0) {
        sums[0] += s[0];
        sums[1] += s[1];
    }
    return rc;
}

// Round to nearest even; a NaN keeps a set mantissa bit (as expert/cast.c).
static __global__ void cast_bf16_kernel(uint16_t *dst, const float *src, size_t n)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        uint32_t u = __float_as_uint(src[i]);
        if ((u & 0x7fffffffu) > 0x7f800000u)
            dst[i] = (uint16_t)((u >> 16) | 0x0040u);
        else
            dst[i] = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
}

extern "C" int cuda_cast_bf16(uint16_t *dst, const float *src, size_t n)
{
    if ((!dst || !src) && n)
        return -EINVAL;
    cuda__ctx *c = cuda__context();
    if (!c)
        return -ENODEV;
    if (n == 0)
        return 0;
    cast_bf16_kernel<<<cuda__blocks((long)n, 256), 256, 0, c->stream>>>(dst, src, n);
    return cuda__launch_status();
}
