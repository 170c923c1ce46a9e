/* expert/cast.c: fp32 -> bfloat16 on the CPU (the reference for the
 * backends that keep bf16 copies of the weights). */
#include "expert/ops.h"

#include <errno.h>
#include <string.h>

/* Round to nearest even on the upper 16 bits; a NaN keeps a set mantissa
 * bit, so it stays a NaN (the rounding could carry it into Inf). */
static uint16_t to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x0040u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

int expert_cast_bf16(uint16_t *dst, const float *src, size_t n)
{
    if ((!dst || !src) && n)
        return -EINVAL;
    for (size_t i = 0; i < n; i++)
        dst[i] = to_bf16(src[i]);
    return 0;
}
