/* net/tensorfmt.c: compressed tensor wire formats (see tensorfmt.h,
 * docs/rpc.md "Tensor formats").
 *
 * Plain C that gcc -O2 vectorises. gcc 12's -O2 uses the "very cheap" cost
 * model, which only vectorises a loop whose trip count is a multiple of the
 * vector length (no scalar epilogue), so every kernel walks its array in
 * CHUNK-value pieces with a fixed inner count and finishes the last few
 * values with the same per-value function. Nor does it check at run time
 * whether two arrays overlap, so the kernels take restrict pointers. The
 * conversions are branch-free bit manipulations (masks, not ?: around float
 * arithmetic, which gcc turns into jumps), so the inner loops vectorise;
 * -fopt-info-vec lists every kernel's inner loop.
 *
 * The float16 conversions are the well-known exact ones built on float
 * arithmetic (Maratyszcza's FP16 library, also used by PyTorch's c10::Half):
 * the hardware's round-to-nearest-even does the rounding.
 */
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "net/tensorfmt.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the tensor formats are little-endian; port the (de)coders first"
#endif

#define CHUNK 16   /* values per inner loop; Q8 blocks are multiples of it */

static const char *const names[PEER_FMT_COUNT] = {"f32", "f16", "bf16", "q8"};

static inline uint32_t f2u(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float u2f(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* ---- names ---- */

const char *peer_tensorfmt_name(peer_fmt fmt)
{
    return (unsigned)fmt < PEER_FMT_COUNT ? names[fmt] : NULL;
}

static int parse_n(const char *s, size_t len, peer_fmt *out)
{
    for (int f = 0; f < PEER_FMT_COUNT; f++)
        if (strlen(names[f]) == len && memcmp(names[f], s, len) == 0) {
            *out = (peer_fmt)f;
            return 0;
        }
    return -EINVAL;
}

int peer_tensorfmt_parse(const char *name, peer_fmt *out)
{
    if (!name || !out)
        return -EINVAL;
    return parse_n(name, strlen(name), out);
}

int peer_tensorfmt_mask_parse(const char *list, peer_fmt_mask *out)
{
    if (!list || !out || !*list)
        return -EINVAL;
    peer_fmt_mask m = 0;
    const char *p = list;
    for (;;) {
        const char *comma = strchr(p, ',');
        size_t len = comma ? (size_t)(comma - p) : strlen(p);
        peer_fmt f;
        if (parse_n(p, len, &f))
            return -EINVAL;
        m |= PEER_FMT_BIT(f);
        if (!comma)
            break;
        p = comma + 1;
    }
    *out = m;
    return 0;
}

int peer_tensorfmt_mask_format(peer_fmt_mask m, char *buf, size_t cap)
{
    if ((m & ~PEER_FMT_MASK_ALL) || !buf)
        return -EINVAL;
    size_t len = 0;
    for (int f = 0; f < PEER_FMT_COUNT; f++) {
        if (!(m & PEER_FMT_BIT(f)))
            continue;
        size_t l = strlen(names[f]), sep = len > 0;
        if (len + sep + l + 1 > cap)
            return -ENOSPC;
        if (sep)
            buf[len++] = ',';
        memcpy(buf + len, names[f], l);
        len += l;
    }
    if (cap < 1)
        return -ENOSPC;
    buf[len] = '\0';
    return (int)len;
}

/* ---- sizes ---- */

int peer_tensorfmt_check(peer_fmt fmt, int block)
{
    if ((unsigned)fmt >= PEER_FMT_COUNT)
        return -EINVAL;
    if (fmt == PEER_FMT_Q8 && (block < PEER_FMT_Q8_BLOCK_MIN || block > PEER_FMT_Q8_BLOCK_MAX ||
                               (block & (block - 1)) != 0))
        return -EINVAL;
    return 0;
}

/* The encoded size of n values in *out; -EINVAL or -EOVERFLOW. */
static int size_of(peer_fmt fmt, int block, size_t n, size_t *out)
{
    int rc = peer_tensorfmt_check(fmt, block);
    if (rc)
        return rc;
    size_t w = fmt == PEER_FMT_F32 ? 4 : fmt == PEER_FMT_Q8 ? 1 : 2;
    if (n > SIZE_MAX / w)
        return -EOVERFLOW;
    size_t s = n * w;
    if (fmt == PEER_FMT_Q8) {
        size_t nb = n / (size_t)block + (n % (size_t)block != 0);
        if (nb > (SIZE_MAX - s) / 4)
            return -EOVERFLOW;
        s += nb * 4;
    }
    *out = s;
    return 0;
}

size_t peer_tensorfmt_size(peer_fmt fmt, int block, size_t n)
{
    size_t s;
    return size_of(fmt, block, n, &s) ? 0 : s;
}

/* ---- float16 and bfloat16, one value ---- */

static inline uint16_t f32_to_f16(float f)
{
    /* Scaling |f| by 2^112 then 2^-110 overflows to Inf what rounds above
     * 65504 and leaves the rest times 4 (exact for normals). Adding a power
     * of two chosen from f's exponent then makes the float adder round the
     * mantissa to f16's 10 bits (or to the subnormal grid): the result's
     * low bits are the f16 exponent and mantissa. */
    float base = (fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
    uint32_t w = f2u(f);
    uint32_t shl1_w = w + w;
    uint32_t sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xFF000000u;
    bias = bias < 0x71000000u ? 0x71000000u : bias;
    base = u2f((bias >> 1) + 0x07800000u) + base;
    uint32_t bits = f2u(base);
    uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
    uint32_t mant_bits = bits & 0x00000FFFu;
    uint32_t nonsign = exp_bits + mant_bits;
    /* NaN -> quiet NaN. A mask, not ?:, which gcc turns into a branch
     * around the float adds above and then cannot vectorise. */
    uint32_t nan = 0u - (uint32_t)(shl1_w > 0xFF000000u);
    return (uint16_t)((sign >> 16) | (nan & 0x7E00u) | (~nan & nonsign));
}

static inline float f16_to_f32(uint16_t h)
{
    /* Normals (and Inf/NaN): shift the exponent and mantissa into place,
     * rebias by multiplying with 2^-112. Subnormals: put the mantissa under
     * the exponent of 0.5 and subtract 0.5. */
    uint32_t w = (uint32_t)h << 16;
    uint32_t sign = w & 0x80000000u;
    uint32_t two_w = w + w;
    float normalized = u2f((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
    float denormalized = u2f((two_w >> 17) | (126u << 23)) - 0.5f;
    uint32_t sub = 0u - (uint32_t)(two_w < (1u << 27));   /* a mask, as above */
    return u2f(sign | (sub & f2u(denormalized)) | (~sub & f2u(normalized)));
}

static inline uint16_t f32_to_bf16(float f)
{
    uint32_t w = f2u(f);
    /* Round to nearest even: add 0x7FFF plus the lowest kept bit. A carry
     * into the exponent is right (it rounds up to the next binade, or to
     * Inf). NaN would carry into Inf or flip sign, so it is kept quiet. */
    uint32_t r = (w + 0x7FFFu + ((w >> 16) & 1u)) >> 16;
    return (uint16_t)((w & 0x7FFFFFFFu) > 0x7F800000u ? (w >> 16) | 0x0040u : r);
}

static inline float bf16_to_f32(uint16_t h)
{
    return u2f((uint32_t)h << 16);
}

static inline uint16_t ld16(const uint8_t *p)
{
    uint16_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void st16(uint8_t *p, uint16_t v)
{
    memcpy(p, &v, sizeof v);
}

/* ---- float16 and bfloat16, arrays ---- */

static void enc_f16(const float *restrict x, size_t n, uint8_t *restrict p)
{
    size_t i = 0;
    for (; i + CHUNK <= n; i += CHUNK)
        for (size_t j = 0; j < CHUNK; j++)
            st16(p + 2 * (i + j), f32_to_f16(x[i + j]));
    for (; i < n; i++)
        st16(p + 2 * i, f32_to_f16(x[i]));
}

static void dec_f16(const uint8_t *restrict p, size_t n, float *restrict y)
{
    size_t i = 0;
    for (; i + CHUNK <= n; i += CHUNK)
        for (size_t j = 0; j < CHUNK; j++)
            y[i + j] = f16_to_f32(ld16(p + 2 * (i + j)));
    for (; i < n; i++)
        y[i] = f16_to_f32(ld16(p + 2 * i));
}

static void enc_bf16(const float *restrict x, size_t n, uint8_t *restrict p)
{
    size_t i = 0;
    for (; i + CHUNK <= n; i += CHUNK)
        for (size_t j = 0; j < CHUNK; j++)
            st16(p + 2 * (i + j), f32_to_bf16(x[i + j]));
    for (; i < n; i++)
        st16(p + 2 * i, f32_to_bf16(x[i]));
}

static void dec_bf16(const uint8_t *restrict p, size_t n, float *restrict y)
{
    size_t i = 0;
    for (; i + CHUNK <= n; i += CHUNK)
        for (size_t j = 0; j < CHUNK; j++)
            y[i + j] = bf16_to_f32(ld16(p + 2 * (i + j)));
    for (; i < n; i++)
        y[i] = bf16_to_f32(ld16(p + 2 * i));
}

/* ---- Q8 ---- */

#define Q8_NAN_SCALE 0x7FC00000u   /* a quiet NaN */
/* Below this absmax 127/absmax would overflow a float: those blocks take
 * the double path. */
#define Q8_TINY 0x1.0p-100f
/* The largest scale whose 127 times is finite: FLT_MAX/127 rounds up to a
 * scale that decodes FLT_MAX to Inf, so that one scale step is taken off
 * (a block whose absmax is within 2 ulps of FLT_MAX). */
#define Q8_SCALE_MAX 0x1.020406p+121f

/* Rounds v (|v| < 2^22) to the nearest integer, ties to even, with the float
 * adder: adding 1.5 * 2^23 leaves no fraction bits. Plain SSE2, unlike
 * rintf. */
static inline float round_ne(float v)
{
    return (v + 0x1.8p23f) - 0x1.8p23f;
}

/* |x| <= absmax, so |x * inv| rounds to at most 127; the integer clamp is
 * only a guard (a float one would be a compare that can trap, which gcc
 * does not vectorise). */
static inline int8_t q8_code(float x, float inv)
{
    int q = (int)round_ne(x * inv);
    q = q > 127 ? 127 : q;
    q = q < -127 ? -127 : q;
    return (int8_t)q;
}

/* The largest |x| of x[0..m) as bits (|x|'s bits order like |x| for
 * non-NaN values; anything >= 0x7F800000 is Inf or NaN). Integer max
 * vectorises without -ffast-math, a float max with NaN rules does not. */
static uint32_t absmax_bits(const float *restrict x, size_t m)
{
    uint32_t lane[CHUNK] = {0};
    size_t i = 0;
    for (; i + CHUNK <= m; i += CHUNK)
        for (size_t j = 0; j < CHUNK; j++) {
            uint32_t a = f2u(x[i + j]) & 0x7FFFFFFFu;
            lane[j] = a > lane[j] ? a : lane[j];
        }
    for (; i < m; i++) {
        uint32_t a = f2u(x[i]) & 0x7FFFFFFFu;
        lane[0] = a > lane[0] ? a : lane[0];
    }
    uint32_t mx = 0;
    for (size_t j = 0; j < CHUNK; j++)
        mx = lane[j] > mx ? lane[j] : mx;
    return mx;
}

/* absmax/127 as a float32; below Q8_TINY (where it may be subnormal, so
 * rounded by up to half of 2^-149, a large part of it) rounded up instead,
 * so that codes of x / scale stay within [-127, 127] and the error within
 * scale/2 <= absmax/254 + 2^-150. */
static float tiny_scale(float amax)
{
    float scale = amax / 127.0f;
    if (amax < Q8_TINY && (double)scale * 127.0 < (double)amax)
        scale = nextafterf(scale, 1.0f);
    return scale;
}

/* One block of m values: the scale at p, the codes after it. */
static void enc_q8_block(const float *restrict x, size_t m, uint8_t *restrict p)
{
    uint32_t amax_bits = absmax_bits(x, m);
    int8_t *c = (int8_t *)(p + 4);
    if (amax_bits >= 0x7F800000u || amax_bits == 0) {
        uint32_t s = amax_bits ? Q8_NAN_SCALE : 0;
        memcpy(p, &s, 4);
        memset(c, 0, m);
        return;
    }
    float amax = u2f(amax_bits), scale = tiny_scale(amax);
    scale = scale > Q8_SCALE_MAX ? Q8_SCALE_MAX : scale;
    memcpy(p, &scale, 4);
    if (amax < Q8_TINY) {
        /* The codes against the scale as stored: a subnormal scale is
         * far from absmax/127 in relative terms. */
        double inv = 1.0 / (double)scale;
        for (size_t i = 0; i < m; i++) {
            double q = nearbyint((double)x[i] * inv);
            c[i] = (int8_t)(q > 127.0 ? 127 : q < -127.0 ? -127 : (int)q);
        }
        return;
    }
    float inv = 127.0f / amax;
    size_t i = 0;
    for (; i + CHUNK <= m; i += CHUNK)
        for (size_t j = 0; j < CHUNK; j++)
            c[i + j] = q8_code(x[i + j], inv);
    for (; i < m; i++)
        c[i] = q8_code(x[i], inv);
}

static void dec_q8_block(const uint8_t *restrict p, size_t m, float *restrict y)
{
    float s;
    memcpy(&s, p, 4);
    const int8_t *c = (const int8_t *)(p + 4);
    size_t i = 0;
    for (; i + CHUNK <= m; i += CHUNK)
        for (size_t j = 0; j < CHUNK; j++)
            y[i + j] = s * (float)c[i + j];
    for (; i < m; i++)
        y[i] = s * (float)c[i];
}

static void enc_q8(const float *x, size_t n, size_t block, uint8_t *p)
{
    for (size_t i = 0; i < n; i += block) {
        size_t m = n - i < block ? n - i : block;
        enc_q8_block(x + i, m, p);
        p += 4 + m;
    }
}

static void dec_q8(const uint8_t *p, size_t n, size_t block, float *y)
{
    for (size_t i = 0; i < n; i += block) {
        size_t m = n - i < block ? n - i : block;
        dec_q8_block(p, m, y + i);
        p += 4 + m;
    }
}

/* Whether every scale of a Q8 payload of n values (its length already
 * checked) is acceptable: not negative (-0 is), not infinite; NaN is. */
static int q8_scales_ok(const uint8_t *p, size_t n, size_t block)
{
    for (size_t i = 0; i < n; i += block) {
        size_t m = n - i < block ? n - i : block;
        uint32_t s;
        memcpy(&s, p, 4);
        uint32_t mag = s & 0x7FFFFFFFu;
        if (mag == 0x7F800000u || ((s & 0x80000000u) && mag != 0 && mag < 0x7F800000u))
            return 0;
        p += 4 + m;
    }
    return 1;
}

/* ---- public ---- */

static void encode(peer_fmt fmt, int block, const float *x, size_t n, uint8_t *p)
{
    switch (fmt) {
    case PEER_FMT_F32:
        if (n)
            memcpy(p, x, n * 4);
        break;
    case PEER_FMT_F16:
        enc_f16(x, n, p);
        break;
    case PEER_FMT_BF16:
        enc_bf16(x, n, p);
        break;
    case PEER_FMT_Q8:
        enc_q8(x, n, (size_t)block, p);
        break;
    }
}

/* Checks the arguments common to both encoders: 0 and *len_out, or an
 * error. */
static long enc_check(peer_fmt fmt, int block, const float *x, size_t n, const void *dst,
                      size_t cap, size_t *len_out)
{
    size_t len;
    int rc = size_of(fmt, block, n, &len);
    if (rc)
        return rc;
    if (n && (!x || !dst))
        return -EINVAL;
    if (len > LONG_MAX)
        return -EOVERFLOW;
    if (cap < len)
        return -ENOBUFS;
    *len_out = len;
    return 0;
}

long peer_tensorfmt_encode(peer_fmt fmt, int block, const float *src, size_t n, void *dst,
                           size_t cap)
{
    size_t len;
    long rc = enc_check(fmt, block, src, n, dst, cap, &len);
    if (rc)
        return rc;
    encode(fmt, block, src, n, dst);
    return (long)len;
}

/* A uniform value in [0, 1) from the 24 top bits of SplitMix64's output for
 * (seed, i): counter-based, so any value's draw is independent of the
 * others' and of the thread that encodes it. */
static inline float sr_uniform(uint64_t seed, uint64_t i)
{
    uint64_t z = seed + (i + 1) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (float)(z >> 40) * 0x1p-24f;
}

/* One Q8 block with stochastic rounding: code = floor(x / scale + u). */
static void enc_q8_block_sr(const float *restrict x, size_t m, uint64_t seed, uint64_t first,
                            uint8_t *restrict p)
{
    uint32_t amax_bits = absmax_bits(x, m);
    int8_t *c = (int8_t *)(p + 4);
    if (amax_bits >= 0x7F800000u || amax_bits == 0) {
        enc_q8_block(x, m, p); /* NaN or zero scale: nothing to round */
        return;
    }
    float amax = u2f(amax_bits), scale = tiny_scale(amax);
    scale = scale > Q8_SCALE_MAX ? Q8_SCALE_MAX : scale;
    memcpy(p, &scale, 4);
    double inv = amax < Q8_TINY ? 1.0 / (double)scale : 127.0 / (double)amax;
    for (size_t i = 0; i < m; i++) {
        double q = floor((double)x[i] * inv + (double)sr_uniform(seed, first + i));
        c[i] = (int8_t)(q > 127.0 ? 127 : q < -127.0 ? -127 : (int)q);
    }
}

long peer_tensorfmt_encode_sr(peer_fmt fmt, int block, const float *src, size_t n, uint64_t seed, void *dst,
                              size_t cap)
{
    size_t len;
    long rc = enc_check(fmt, block, src, n, dst, cap, &len);
    if (rc)
        return rc;
    if (fmt != PEER_FMT_Q8) {
        encode(fmt, block, src, n, dst);
        return (long)len;
    }
    uint8_t *p = dst;
    for (size_t i = 0; i < n; i += (size_t)block) {
        size_t m = n - i < (size_t)block ? n - i : (size_t)block;
        enc_q8_block_sr(src + i, m, seed, i, p);
        p += 4 + m;
    }
    return (long)len;
}

int peer_tensorfmt_spec_parse(const char *spec, peer_fmt *fmt, int *block)
{
    if (!spec || !fmt || !block)
        return -EINVAL;
    const char *colon = strchr(spec, ':');
    size_t len = colon ? (size_t)(colon - spec) : strlen(spec);
    peer_fmt f;
    if (parse_n(spec, len, &f))
        return -EINVAL;
    int b = f == PEER_FMT_Q8 ? PEER_FMT_Q8_BLOCK : 0;
    if (colon) {
        char *end;
        errno = 0;
        long v = strtol(colon + 1, &end, 10);
        if (f != PEER_FMT_Q8 || colon[1] < '1' || colon[1] > '9' || errno || *end || v < PEER_FMT_Q8_BLOCK_MIN ||
            v > PEER_FMT_Q8_BLOCK_MAX || peer_tensorfmt_check(f, (int)v))
            return -EINVAL;
        b = (int)v;
    }
    *fmt = f;
    *block = b;
    return 0;
}

int peer_tensorfmt_decode(peer_fmt fmt, int block, const void *src, size_t len, size_t n,
                          float *dst)
{
    int rc = peer_tensorfmt_check(fmt, block);
    if (rc)
        return rc;
    if ((len && !src) || (n && !dst))
        return -EINVAL;
    size_t want;
    if (size_of(fmt, block, n, &want) || len != want)
        return -EBADMSG;
    const uint8_t *p = src;
    switch (fmt) {
    case PEER_FMT_F32:
        if (n)
            memcpy(dst, p, n * 4);
        break;
    case PEER_FMT_F16:
        dec_f16(p, n, dst);
        break;
    case PEER_FMT_BF16:
        dec_bf16(p, n, dst);
        break;
    case PEER_FMT_Q8:
        if (!q8_scales_ok(p, n, (size_t)block))
            return -EBADMSG;
        dec_q8(p, n, (size_t)block, dst);
        break;
    }
    return 0;
}

/* A residual that is not finite becomes 0 (see tensorfmt.h). */
static inline float ef_keep(float v)
{
    return (f2u(v) & 0x7F800000u) == 0x7F800000u ? 0.0f : v;
}

/* r[i] = r[i] - y[i] over m values, kept finite. */
static void ef_sub(float *restrict r, const float *restrict y, size_t m)
{
    size_t i = 0;
    for (; i + CHUNK <= m; i += CHUNK)
        for (size_t j = 0; j < CHUNK; j++)
            r[i + j] = ef_keep(r[i + j] - y[i + j]);
    for (; i < m; i++)
        r[i] = ef_keep(r[i] - y[i]);
}

/* The same for one Q8 block at p: r[i] = r[i] - scale * code[i]. */
static void ef_sub_q8_block(float *restrict r, const uint8_t *restrict p, size_t m)
{
    float s;
    memcpy(&s, p, 4);
    const int8_t *c = (const int8_t *)(p + 4);
    size_t i = 0;
    for (; i + CHUNK <= m; i += CHUNK)
        for (size_t j = 0; j < CHUNK; j++)
            r[i + j] = ef_keep(r[i + j] - s * (float)c[i + j]);
    for (; i < m; i++)
        r[i] = ef_keep(r[i] - s * (float)c[i]);
}

/* r[i] += x[i] over n values. */
static void add_to(float *restrict r, const float *restrict x, size_t n)
{
    size_t i = 0;
    for (; i + CHUNK <= n; i += CHUNK)
        for (size_t j = 0; j < CHUNK; j++)
            r[i + j] += x[i + j];
    for (; i < n; i++)
        r[i] += x[i];
}

#define EF_BUF 256   /* floats decoded at a time (1 KiB of stack) */

long peer_tensorfmt_encode_ef(peer_fmt fmt, int block, const float *x, size_t n,
                              float *residual, void *dst, size_t cap)
{
    size_t len;
    long rc = enc_check(fmt, block, x, n, dst, cap, &len);
    if (rc)
        return rc;
    if (n && !residual)
        return -EINVAL;
    /* v = x + residual, in residual's memory. */
    add_to(residual, x, n);
    size_t i;
    encode(fmt, block, residual, n, dst);
    const uint8_t *p = dst;
    float y[EF_BUF];
    switch (fmt) {
    case PEER_FMT_F32:
        /* Lossless: v - v is 0, and a non-finite v leaves 0 too. */
        if (n)
            memset(residual, 0, n * sizeof *residual);
        break;
    case PEER_FMT_F16:
    case PEER_FMT_BF16:
        for (i = 0; i < n; i += EF_BUF) {
            size_t m = n - i < EF_BUF ? n - i : EF_BUF;
            if (fmt == PEER_FMT_F16)
                dec_f16(p + 2 * i, m, y);
            else
                dec_bf16(p + 2 * i, m, y);
            ef_sub(residual + i, y, m);
        }
        break;
    case PEER_FMT_Q8:
        for (i = 0; i < n; i += (size_t)block) {
            size_t m = n - i < (size_t)block ? n - i : (size_t)block;
            ef_sub_q8_block(residual + i, p, m);
            p += 4 + m;
        }
        break;
    }
    return (long)len;
}
