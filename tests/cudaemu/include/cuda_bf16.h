// tests/cudaemu/include/cuda_bf16.h: the bfloat16 type and the conversions
// the kernels may use, as CUDA's cuda_bf16.hpp defines them.
#ifndef TESTS_CUDAEMU_CUDA_BF16_H
#define TESTS_CUDAEMU_CUDA_BF16_H
#include "emu.h"

struct __nv_bfloat16 {
    unsigned short __x;
};
typedef __nv_bfloat16 nv_bfloat16;

// Round to nearest even; every NaN becomes the canonical 0x7fff.
static inline __nv_bfloat16 __float2bfloat16_rn(float f)
{
    unsigned u = __float_as_uint(f);
    __nv_bfloat16 r;
    if ((u & 0x7fffffffu) > 0x7f800000u)
        r.__x = 0x7fffu;
    else
        r.__x = (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    return r;
}
static inline __nv_bfloat16 __float2bfloat16(float f) { return __float2bfloat16_rn(f); }
static inline float __bfloat162float(__nv_bfloat16 h) { return __uint_as_float((unsigned)h.__x << 16); }
static inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.__x; }
static inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short u)
{
    __nv_bfloat16 r;
    r.__x = u;
    return r;
}
#endif
