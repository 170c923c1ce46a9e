/* Compressed tensor formats (net/tensorfmt.h): names, sizes, round trips
 * within each format's documented bound, exact values and rounding ties
 * against an independent reference, Inf/NaN rules, hostile payloads, and
 * error feedback keeping the sum of decoded gradients on track. */
#include <errno.h>
#include <float.h>
#include <limits.h>
#include <math.h>

#include "net/tensorfmt.h"
#include "test_util.h"

#define SEED 20240611u

static uint32_t rng = SEED;
static uint32_t next_rand(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 17;
    rng ^= rng << 5;
    return rng;
}

/* Uniform in [0, 1). */
static double unif(void)
{
    return (double)(next_rand() >> 8) * 0x1.0p-24;
}

/* Random sign, magnitude log-uniform in [lo, hi]. */
static float logunif(double lo, double hi)
{
    double m = exp(log(lo) + unif() * (log(hi) - log(lo)));
    return (float)((next_rand() & 1) ? -m : m);
}

static uint32_t f2u(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static float u2f(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static const peer_fmt all_fmts[] = {PEER_FMT_F32, PEER_FMT_F16, PEER_FMT_BF16, PEER_FMT_Q8};

/* Encodes into a buffer of exactly the encoded size (so ASan sees any
 * overrun), checking the size function and -ENOBUFS on the way. */
static uint8_t *enc(peer_fmt fmt, int block, const float *x, size_t n, size_t *len_out)
{
    size_t len = peer_tensorfmt_size(fmt, block, n);
    uint8_t *buf = malloc(len ? len : 1);
    assert_non_null(buf);
    if (len)
        assert_int_equal(peer_tensorfmt_encode(fmt, block, x, n, buf, len - 1), -ENOBUFS);
    long rc = peer_tensorfmt_encode(fmt, block, x, n, buf, len);
    if (rc != (long)len)
        fail_msg("%s block %d n %zu: encode gave %ld, size %zu", peer_tensorfmt_name(fmt), block,
                 n, rc, len);
    *len_out = len;
    return buf;
}

/* Encodes and decodes x; returns the decoded copy (malloc'ed). */
static float *roundtrip(peer_fmt fmt, int block, const float *x, size_t n)
{
    size_t len;
    uint8_t *buf = enc(fmt, block, x, n, &len);
    float *y = malloc((n ? n : 1) * sizeof *y);
    assert_non_null(y);
    int rc = peer_tensorfmt_decode(fmt, block, buf, len, n, y);
    if (rc)
        fail_msg("%s block %d n %zu: decode gave %d", peer_tensorfmt_name(fmt), block, n, rc);
    free(buf);
    return y;
}

/* The largest |x| of x[i0 .. min(i0+block, n)). */
static double block_absmax(const float *x, size_t n, size_t i0, size_t block)
{
    double m = 0;
    for (size_t i = i0; i < n && i < i0 + block; i++)
        m = fmax(m, fabs((double)x[i]));
    return m;
}

/* Q8's documented bound for one value of a block whose largest |x| is amax:
 * amax/254, plus float rounding (amax * 2^-21), plus 2^-149 when the scale
 * is subnormal. */
static double q8_bound(double amax)
{
    return amax / 254.0 + amax * 0x1.0p-21 + 0x1.0p-149;
}

/* Checks y against x within fmt's documented bound; returns the number of
 * misses and prints the first few. Written as !(err <= bound) so that a NaN
 * counts as a miss. */
static int check_bound(peer_fmt fmt, int block, const float *x, const float *y, size_t n,
                       const char *what)
{
    int miss = 0;
    for (size_t i = 0; i < n; i++) {
        double a = fabs((double)x[i]), err = fabs((double)y[i] - (double)x[i]), bound;
        switch (fmt) {
        case PEER_FMT_F32:
            bound = 0;
            break;
        case PEER_FMT_F16:
            bound = a >= 0x1.0p-14 ? a * 0x1.0p-11 : 0x1.0p-25;
            break;
        case PEER_FMT_BF16:
            bound = a >= 0x1.0p-126 ? a * 0x1.0p-8 : 0x1.0p-134;
            break;
        default: {
            size_t b0 = i / (size_t)block * (size_t)block;
            bound = q8_bound(block_absmax(x, n, b0, (size_t)block));
        }
        }
        if (!(err <= bound)) {
            if (miss < 5)
                fprintf(stderr, "seed %u %s %s block %d n %zu: x[%zu]=%.9g y=%.9g err %.3g > %.3g\n",
                        SEED, what, peer_tensorfmt_name(fmt), block, n, i, (double)x[i],
                        (double)y[i], err, bound);
            miss++;
        }
    }
    return miss;
}

static void test_names(void **state)
{
    (void)state;
    for (int f = 0; f < PEER_FMT_COUNT; f++) {
        const char *name = peer_tensorfmt_name((peer_fmt)f);
        assert_non_null(name);
        peer_fmt g;
        assert_int_equal(peer_tensorfmt_parse(name, &g), 0);
        assert_int_equal(g, f);
    }
    assert_string_equal(peer_tensorfmt_name(PEER_FMT_F32), "f32");
    assert_string_equal(peer_tensorfmt_name(PEER_FMT_F16), "f16");
    assert_string_equal(peer_tensorfmt_name(PEER_FMT_BF16), "bf16");
    assert_string_equal(peer_tensorfmt_name(PEER_FMT_Q8), "q8");
    assert_null(peer_tensorfmt_name((peer_fmt)4));
    assert_null(peer_tensorfmt_name((peer_fmt)-1));
    peer_fmt g = PEER_FMT_Q8;
    static const char *const bad[] = {"", "F32", "f8", "q8 ", " q8", "q", "bf16x", "f32,f16"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        assert_int_equal(peer_tensorfmt_parse(bad[i], &g), -EINVAL);
    assert_int_equal(g, PEER_FMT_Q8);
    assert_int_equal(peer_tensorfmt_parse(NULL, &g), -EINVAL);

    peer_fmt_mask m = 0;
    assert_int_equal(peer_tensorfmt_mask_parse("f32,q8", &m), 0);
    assert_int_equal(m, PEER_FMT_BIT(PEER_FMT_F32) | PEER_FMT_BIT(PEER_FMT_Q8));
    assert_true(peer_fmt_mask_has(m, PEER_FMT_Q8));
    assert_false(peer_fmt_mask_has(m, PEER_FMT_F16));
    assert_false(peer_fmt_mask_has(PEER_FMT_MASK_ALL | 0x10u, (peer_fmt)4));
    assert_int_equal(peer_tensorfmt_mask_parse("q8,bf16,f16,f32,q8", &m), 0);
    assert_int_equal(m, PEER_FMT_MASK_ALL);
    static const char *const badl[] = {"", ",", "f32,", ",f32", "f32,,q8", "f32;q8", "f32, q8"};
    for (size_t i = 0; i < sizeof badl / sizeof badl[0]; i++) {
        m = 7;
        assert_int_equal(peer_tensorfmt_mask_parse(badl[i], &m), -EINVAL);
        assert_int_equal(m, 7);
    }

    char buf[32];
    assert_int_equal(peer_tensorfmt_mask_format(PEER_FMT_MASK_ALL, buf, sizeof buf), 15);
    assert_string_equal(buf, "f32,f16,bf16,q8");
    assert_int_equal(peer_tensorfmt_mask_format(PEER_FMT_BIT(PEER_FMT_Q8), buf, sizeof buf), 2);
    assert_string_equal(buf, "q8");
    assert_int_equal(peer_tensorfmt_mask_format(0, buf, sizeof buf), 0);
    assert_string_equal(buf, "");
    assert_int_equal(peer_tensorfmt_mask_format(PEER_FMT_MASK_ALL, buf, 15), -ENOSPC);
    assert_int_equal(peer_tensorfmt_mask_format(PEER_FMT_MASK_ALL, buf, 16), 15);
    assert_int_equal(peer_tensorfmt_mask_format(0, buf, 0), -ENOSPC);
    assert_int_equal(peer_tensorfmt_mask_format(0x10u, buf, sizeof buf), -EINVAL);
    /* format and parse agree on every mask */
    for (peer_fmt_mask k = 1; k <= PEER_FMT_MASK_ALL; k++) {
        assert_true(peer_tensorfmt_mask_format(k, buf, sizeof buf) > 0);
        assert_int_equal(peer_tensorfmt_mask_parse(buf, &m), 0);
        assert_int_equal(m, k);
    }
}

static void test_sizes(void **state)
{
    (void)state;
    static const size_t ns[] = {0, 1, 15, 16, 17, 63, 64, 65, 255, 256, 257, 1000, 4097};
    for (size_t k = 0; k < sizeof ns / sizeof ns[0]; k++) {
        size_t n = ns[k];
        assert_int_equal(peer_tensorfmt_size(PEER_FMT_F32, 0, n), 4 * n);
        assert_int_equal(peer_tensorfmt_size(PEER_FMT_F16, 0, n), 2 * n);
        assert_int_equal(peer_tensorfmt_size(PEER_FMT_BF16, 12345, n), 2 * n);
        for (int block = 16; block <= 4096; block *= 2)
            assert_int_equal(peer_tensorfmt_size(PEER_FMT_Q8, block, n),
                             n + 4 * ((n + (size_t)block - 1) / (size_t)block));
    }
    assert_int_equal(peer_tensorfmt_size(PEER_FMT_Q8, 64, 1), 5);
    assert_int_equal(peer_tensorfmt_size(PEER_FMT_Q8, 64, 63), 67);
    assert_int_equal(peer_tensorfmt_size(PEER_FMT_Q8, 64, 65), 73);
    assert_int_equal(peer_tensorfmt_size(PEER_FMT_Q8, 64, 1000), 1064);
    assert_int_equal(peer_tensorfmt_size(PEER_FMT_Q8, 256, 1000), 1016);
    /* sizes that do not fit */
    assert_int_equal(peer_tensorfmt_size(PEER_FMT_F32, 0, SIZE_MAX / 4 + 1), 0);
    assert_int_equal(peer_tensorfmt_size(PEER_FMT_F16, 0, SIZE_MAX / 2 + 1), 0);
    assert_int_equal(peer_tensorfmt_size(PEER_FMT_Q8, 16, SIZE_MAX - 8), 0);
    float x = 1;
    uint8_t b[8];
    assert_int_equal(peer_tensorfmt_encode(PEER_FMT_F32, 0, &x, SIZE_MAX / 4 + 1, b, sizeof b),
                     -EOVERFLOW);
    assert_int_equal(peer_tensorfmt_encode(PEER_FMT_F16, 0, &x, (size_t)LONG_MAX, b, sizeof b),
                     -EOVERFLOW);
    assert_int_equal(peer_tensorfmt_decode(PEER_FMT_F32, 0, b, 4, SIZE_MAX / 4 + 1, &x), -EBADMSG);
    /* n = 0 */
    for (size_t f = 0; f < 4; f++) {
        int block = all_fmts[f] == PEER_FMT_Q8 ? 64 : 0;
        assert_int_equal(peer_tensorfmt_encode(all_fmts[f], block, NULL, 0, NULL, 0), 0);
        assert_int_equal(peer_tensorfmt_decode(all_fmts[f], block, NULL, 0, 0, NULL), 0);
        assert_int_equal(peer_tensorfmt_decode(all_fmts[f], block, b, 1, 0, NULL), -EBADMSG);
    }
}

static void test_invalid_args(void **state)
{
    (void)state;
    float x[64] = {0}, y[64];
    uint8_t b[512];
    static const int bad_fmts[] = {-1, 4, 5, 255, 1 << 30};
    for (size_t i = 0; i < sizeof bad_fmts / sizeof bad_fmts[0]; i++) {
        peer_fmt f = (peer_fmt)bad_fmts[i];
        assert_int_equal(peer_tensorfmt_check(f, 64), -EINVAL);
        assert_int_equal(peer_tensorfmt_size(f, 64, 10), 0);
        assert_int_equal(peer_tensorfmt_encode(f, 64, x, 10, b, sizeof b), -EINVAL);
        assert_int_equal(peer_tensorfmt_decode(f, 64, b, 40, 10, y), -EINVAL);
        assert_int_equal(peer_tensorfmt_encode_ef(f, 64, x, 10, y, b, sizeof b), -EINVAL);
    }
    static const int bad_blocks[] = {0, 1, 8, 15, 17, 24, 48, 100, 4095, 8192, -64, INT32_MIN};
    for (size_t i = 0; i < sizeof bad_blocks / sizeof bad_blocks[0]; i++) {
        int blk = bad_blocks[i];
        assert_int_equal(peer_tensorfmt_check(PEER_FMT_Q8, blk), -EINVAL);
        assert_int_equal(peer_tensorfmt_size(PEER_FMT_Q8, blk, 10), 0);
        assert_int_equal(peer_tensorfmt_encode(PEER_FMT_Q8, blk, x, 10, b, sizeof b), -EINVAL);
        assert_int_equal(peer_tensorfmt_decode(PEER_FMT_Q8, blk, b, 14, 10, y), -EINVAL);
        assert_int_equal(peer_tensorfmt_encode_ef(PEER_FMT_Q8, blk, x, 10, y, b, sizeof b),
                         -EINVAL);
    }
    for (int blk = 16; blk <= 4096; blk *= 2)
        assert_int_equal(peer_tensorfmt_check(PEER_FMT_Q8, blk), 0);
    /* the other formats ignore block */
    assert_int_equal(peer_tensorfmt_check(PEER_FMT_F16, -3), 0);
    assert_int_equal(peer_tensorfmt_encode(PEER_FMT_BF16, 7, x, 10, b, sizeof b), 20);
    /* NULL buffers with values to move */
    assert_int_equal(peer_tensorfmt_encode(PEER_FMT_F16, 0, NULL, 10, b, sizeof b), -EINVAL);
    assert_int_equal(peer_tensorfmt_encode(PEER_FMT_F16, 0, x, 10, NULL, sizeof b), -EINVAL);
    assert_int_equal(peer_tensorfmt_decode(PEER_FMT_F16, 0, NULL, 20, 10, y), -EINVAL);
    assert_int_equal(peer_tensorfmt_decode(PEER_FMT_F16, 0, b, 20, 10, NULL), -EINVAL);
    assert_int_equal(peer_tensorfmt_encode_ef(PEER_FMT_F16, 0, x, 10, NULL, b, sizeof b), -EINVAL);
    assert_int_equal(peer_tensorfmt_encode_ef(PEER_FMT_Q8, 64, x, 10, y, b, 13), -ENOBUFS);
}

/* Every format over random data of several shapes, within its bound. */
static void test_roundtrip_random(void **state)
{
    (void)state;
    static const size_t ns[] = {1, 2, 15, 16, 17, 63, 64, 65, 1000, 4099};
    static const int blocks[] = {16, 64, 256, 4096};
    size_t nmax = 4099;
    float *x = malloc(nmax * sizeof *x);
    assert_non_null(x);
    /* kinds of data: mixed magnitudes 1e-6..1e4 in every block; blocks of
     * one magnitude each (so Q8's bound is tight); tiny (Q8's subnormal
     * scales and f16's subnormals); huge (near FLT_MAX, for bf16 and q8) */
    for (int kind = 0; kind < 6; kind++) {
        for (size_t k = 0; k < sizeof ns / sizeof ns[0]; k++) {
            size_t n = ns[k];
            double mag = kind == 1 ? pow(10.0, -6.0 + 10.0 * unif()) : 1.0;
            for (size_t i = 0; i < n; i++) {
                switch (kind) {
                case 0:
                    x[i] = logunif(1e-6, 1e4);
                    break;
                case 1:
                    x[i] = (float)(mag * (2.0 * unif() - 1.0));
                    break;
                case 2:
                    x[i] = logunif(1e-9, 1e-3);
                    break;
                case 3:
                    x[i] = logunif(1e-44, 1e-36);
                    break;
                case 4:
                    x[i] = logunif(1e30, 3e38);
                    break;
                default:
                    x[i] = (float)(2.0 * unif() - 1.0);
                    if (i % 7 == 3)
                        x[i] = 0.0f;
                }
            }
            for (size_t f = 0; f < 4; f++) {
                peer_fmt fmt = all_fmts[f];
                /* values above f16's range are covered by test_nonfinite */
                if (fmt == PEER_FMT_F16 && kind == 4)
                    continue;
                size_t nb = fmt == PEER_FMT_Q8 ? 4 : 1;
                for (size_t bi = 0; bi < nb; bi++) {
                    int block = fmt == PEER_FMT_Q8 ? blocks[bi] : 0;
                    float *y = roundtrip(fmt, block, x, n);
                    char what[32];
                    snprintf(what, sizeof what, "kind %d", kind);
                    int miss = check_bound(fmt, block, x, y, n, what);
                    if (miss)
                        fail_msg("%d values outside the bound", miss);
                    if (fmt == PEER_FMT_F32)
                        assert_memory_equal(x, y, n * sizeof *x);
                    free(y);
                }
            }
        }
    }
    free(x);
}

/* An independent f16 reference: the positive finite halves in order, the
 * nearest one found by bisection, ties to the even code, and Inf from
 * 65520 (= 65504 + half a step) up. */
static double f16_val[0x7C00];

static void f16_table(void)
{
    for (uint32_t h = 0; h < 0x7C00; h++) {
        uint32_t e = h >> 10, m = h & 0x3FF;
        f16_val[h] = e ? ldexp(1024.0 + m, (int)e - 25) : ldexp((double)m, -24);
    }
}

static uint16_t ref_f16(float x)
{
    uint16_t sign = signbit(x) ? 0x8000 : 0;
    if (isnan(x))
        return sign | 0x7E00;
    double a = fabs((double)x);
    if (a >= 65520.0)
        return sign | 0x7C00;
    uint32_t lo = 0, hi = 0x7BFF;   /* f16_val[lo] <= a */
    if (a >= f16_val[hi])
        return sign | 0x7BFF;
    while (hi - lo > 1) {
        uint32_t mid = (lo + hi) / 2;
        if (f16_val[mid] <= a)
            lo = mid;
        else
            hi = mid;
    }
    double dl = a - f16_val[lo], dh = f16_val[hi] - a;
    uint32_t r = dl < dh ? lo : dh < dl ? hi : (lo & 1 ? hi : lo);
    return (uint16_t)(sign | r);
}

/* bf16 reference: the two neighbours of x in double, ties to even; the
 * neighbour past the largest finite value is Inf at 2^128. */
static uint16_t ref_bf16(float x)
{
    uint32_t w = f2u(x);
    if (isnan(x))
        return (uint16_t)((w >> 16) | 0x40);
    uint32_t t = w >> 16, sign = t & 0x8000, lo = t & 0x7FFF;
    if (lo == 0x7F80)
        return (uint16_t)t;
    uint32_t hi = lo + 1;
    double a = fabs((double)x), vl = (double)u2f(lo << 16);
    double vh = hi == 0x7F80 ? ldexp(1.0, 128) : (double)u2f(hi << 16);
    double dl = a - vl, dh = vh - a;
    uint32_t r = dl < dh ? lo : dh < dl ? hi : (lo & 1 ? hi : lo);
    return (uint16_t)(sign | r);
}

static uint16_t enc1(peer_fmt fmt, float x)
{
    uint16_t h;
    assert_int_equal(peer_tensorfmt_encode(fmt, 0, &x, 1, &h, 2), 2);
    return h;
}

static float dec1(peer_fmt fmt, uint16_t h)
{
    float y;
    assert_int_equal(peer_tensorfmt_decode(fmt, 0, &h, 2, 1, &y), 0);
    return y;
}

static void test_exact_and_ties(void **state)
{
    (void)state;
    f16_table();
    /* every half decodes to its value and encodes back to itself */
    for (uint32_t h = 0; h < 0x10000; h++) {
        float y = dec1(PEER_FMT_F16, (uint16_t)h);
        int nan = (h & 0x7C00) == 0x7C00 && (h & 0x3FF);
        if (nan) {
            assert_true(isnan(y));
            assert_int_equal(!!signbit(y), h >> 15);
            assert_int_equal(enc1(PEER_FMT_F16, y) & 0x7FFF, 0x7E00);
            continue;
        }
        double want = (h & 0x7FFF) == 0x7C00 ? INFINITY : f16_val[h & 0x7FFF];
        if (h & 0x8000)
            want = -want;
        if ((double)y != want || !!signbit(y) != (int)(h >> 15))
            fail_msg("half %04x decoded to %.9g, want %.9g", h, (double)y, want);
        if (enc1(PEER_FMT_F16, y) != h)
            fail_msg("half %04x: %.9g encoded to %04x", h, (double)y, enc1(PEER_FMT_F16, y));
    }
    /* every midpoint between neighbouring halves (the ties) and a float
     * step either side of it, against the reference */
    for (uint32_t h = 0; h < 0x7BFF; h++) {
        float mid = (float)((f16_val[h] + f16_val[h + 1]) / 2);   /* exact in float */
        float cand[3] = {mid, nextafterf(mid, 0.0f), nextafterf(mid, INFINITY)};
        for (int c = 0; c < 3; c++)
            for (int s = 0; s < 2; s++) {
                float v = s ? -cand[c] : cand[c];
                if (enc1(PEER_FMT_F16, v) != ref_f16(v))
                    fail_msg("f16(%a) = %04x, reference %04x", (double)v, enc1(PEER_FMT_F16, v),
                             ref_f16(v));
            }
    }
    /* every bf16 decodes and encodes back to itself (NaNs stay NaN) */
    for (uint32_t h = 0; h < 0x10000; h++) {
        float y = dec1(PEER_FMT_BF16, (uint16_t)h);
        assert_int_equal(f2u(y), h << 16);
        uint16_t back = enc1(PEER_FMT_BF16, y);
        if (isnan(y))
            assert_true(isnan(dec1(PEER_FMT_BF16, back)) && (back & 0x8000) == (h & 0x8000));
        else
            assert_int_equal(back, h);
    }
    /* random float bit patterns (all exponents, NaNs included) against the
     * references */
    for (int i = 0; i < 300000; i++) {
        float v = u2f(next_rand());
        uint16_t a = enc1(PEER_FMT_F16, v), b = enc1(PEER_FMT_BF16, v);
        if (a != ref_f16(v))
            fail_msg("seed %u: f16(%a) = %04x, reference %04x", SEED, (double)v, a, ref_f16(v));
        if (b != ref_bf16(v))
            fail_msg("seed %u: bf16(%a) = %04x, reference %04x", SEED, (double)v, b, ref_bf16(v));
    }
    /* named values */
    struct { float x; uint16_t f16, bf16; } v[] = {
        {0.0f, 0x0000, 0x0000},
        {-0.0f, 0x8000, 0x8000},
        {1.0f, 0x3C00, 0x3F80},
        {-2.0f, 0xC000, 0xC000},
        {0.5f, 0x3800, 0x3F00},
        {0x1.0p15f, 0x7800, 0x4700},
        {0x1.0p-14f, 0x0400, 0x3880},              /* f16's smallest normal */
        {0x1.0p-24f, 0x0001, 0x3380},              /* f16's smallest subnormal */
        {0x1.ff8p-15f, 0x03FF, 0x3880},            /* f16's largest subnormal */
        {0x1.0p-25f, 0x0000, 0x3300},              /* a tie, to even (0) */
        {0x1.8p-25f, 0x0001, 0x3340},
        {65504.0f, 0x7BFF, 0x4780},                /* f16's largest finite */
        {65519.0f, 0x7BFF, 0x4780},
        {65520.0f, 0x7C00, 0x4780},                /* past it by half a step: Inf */
        {1.0f + 0x1.0p-11f, 0x3C00, 0x3F80},       /* ties to even */
        {1.0f + 0x1.8p-10f, 0x3C02, 0x3F80},
        {1.0f + 0x1.0p-8f, 0x3C04, 0x3F80},
        {1.0f + 0x1.8p-7f, 0x3C0C, 0x3F82},
        {0x1.0p-126f, 0x0000, 0x0080},
        {0x1.0p-133f, 0x0000, 0x0001},             /* bf16's smallest subnormal */
        {0x1.0p127f, 0x7C00, 0x7F00},
        {FLT_MAX, 0x7C00, 0x7F80},                 /* rounds past bf16's largest */
        {0x1.fep127f, 0x7C00, 0x7F7F},             /* bf16's largest finite */
    };
    for (size_t i = 0; i < sizeof v / sizeof v[0]; i++) {
        if (enc1(PEER_FMT_F16, v[i].x) != v[i].f16 || enc1(PEER_FMT_BF16, v[i].x) != v[i].bf16)
            fail_msg("%a: f16 %04x (want %04x), bf16 %04x (want %04x)", (double)v[i].x,
                     enc1(PEER_FMT_F16, v[i].x), v[i].f16, enc1(PEER_FMT_BF16, v[i].x), v[i].bf16);
    }
    /* every power of two in each format's range is exact */
    for (int e = -24; e <= 15; e++)
        assert_true(dec1(PEER_FMT_F16, enc1(PEER_FMT_F16, ldexpf(1.0f, e))) == ldexpf(1.0f, e));
    for (int e = -133; e <= 127; e++)
        assert_true(dec1(PEER_FMT_BF16, enc1(PEER_FMT_BF16, ldexpf(1.0f, e))) == ldexpf(1.0f, e));

    /* Q8: a block whose absmax is 127 has scale 1, so integers are exact;
     * zero and -0 decode to 0; an all-zero block has scale 0 */
    float q[65], y[65];
    for (int i = 0; i < 65; i++)
        q[i] = (float)(i * 4 - 127);   /* -127 .. 125 in block 0 */
    q[63] = -0.0f;
    q[64] = -0.0f;
    size_t len;
    uint8_t *b = enc(PEER_FMT_Q8, 64, q, 65, &len);
    assert_int_equal(len, 73);
    float s;
    memcpy(&s, b, 4);
    assert_true(s == 1.0f);
    memcpy(&s, b + 68, 4);
    assert_true(s == 0.0f && !signbit(s));
    assert_int_equal(b[72], 0);
    assert_int_equal(peer_tensorfmt_decode(PEER_FMT_Q8, 64, b, len, 65, y), 0);
    for (int i = 0; i < 65; i++)
        assert_true(y[i] == q[i]);
    free(b);
    /* values at the top of float's range decode finite, within the bound
     * (FLT_MAX/127 rounds up: 127 times it would be Inf) */
    const float top[] = {FLT_MAX, -FLT_MAX, nextafterf(FLT_MAX, 0), 0x1.fffffap127f, 1.0f,
                         -0x1.8p127f, 0x1.0p127f, -3e38f, 0.0f, 1e38f, -FLT_MAX, 2e38f, 7.0f,
                         0x1.fffffcp127f, -0x1.fffffep126f, 1e30f};
    float topy[16];
    b = enc(PEER_FMT_Q8, 16, top, 16, &len);
    assert_int_equal(peer_tensorfmt_decode(PEER_FMT_Q8, 16, b, len, 16, topy), 0);
    for (int i = 0; i < 16; i++)
        assert_true(isfinite(topy[i]));
    assert_int_equal(check_bound(PEER_FMT_Q8, 16, top, topy, 16, "top"), 0);
    free(b);
    for (int i = 0; i < 64; i++) {
        float one = nextafterf(FLT_MAX, 0), back;
        for (int k = 0; k < i; k++)
            one = nextafterf(one, 0);
        b = enc(PEER_FMT_Q8, 16, &one, 1, &len);
        assert_int_equal(peer_tensorfmt_decode(PEER_FMT_Q8, 16, b, len, 1, &back), 0);
        assert_true(isfinite(back) && fabs((double)back - (double)one) <= q8_bound(one));
        free(b);
    }
    /* a short block of one value: code 127 or -127 */
    for (int sgn = -1; sgn <= 1; sgn += 2) {
        float one = (float)sgn * 3.25f, back;
        b = enc(PEER_FMT_Q8, 16, &one, 1, &len);
        assert_int_equal(len, 5);
        assert_int_equal((int8_t)b[4], sgn * 127);
        assert_int_equal(peer_tensorfmt_decode(PEER_FMT_Q8, 16, b, 5, 1, &back), 0);
        assert_true(fabsf(back - one) <= (float)q8_bound(3.25));
        free(b);
    }
}

/* The byte layouts docs/rpc.md shows. */
static void test_doc_example(void **state)
{
    (void)state;
    const float x[4] = {254.0f, -128.0f, 2.0f, 0.0f};
    uint8_t b[16];
    static const uint8_t f16[] = {0xf0, 0x5b, 0x00, 0xd8, 0x00, 0x40, 0x00, 0x00};
    static const uint8_t bf16[] = {0x7e, 0x43, 0x00, 0xc3, 0x00, 0x40, 0x00, 0x00};
    static const uint8_t q8[] = {0x00, 0x00, 0x00, 0x40, 0x7f, 0xc0, 0x01, 0x00};
    assert_int_equal(peer_tensorfmt_encode(PEER_FMT_F16, 0, x, 4, b, sizeof b), 8);
    assert_memory_equal(b, f16, 8);
    assert_int_equal(peer_tensorfmt_encode(PEER_FMT_BF16, 0, x, 4, b, sizeof b), 8);
    assert_memory_equal(b, bf16, 8);
    assert_int_equal(peer_tensorfmt_encode(PEER_FMT_Q8, 16, x, 4, b, sizeof b), 8);
    assert_memory_equal(b, q8, 8);
}

static void test_nonfinite(void **state)
{
    (void)state;
    const float nan = u2f(0x7FC00000u), nnan = u2f(0xFFC00000u), snan = u2f(0x7F800001u);
    const float vals[] = {INFINITY, -INFINITY, nan, nnan, snan, 1e5f, -1e5f, FLT_MAX};
    for (size_t i = 0; i < sizeof vals / sizeof vals[0]; i++) {
        float x = vals[i];
        for (int f = 1; f <= 2; f++) {
            peer_fmt fmt = (peer_fmt)f;
            float y = dec1(fmt, enc1(fmt, x));
            if (isnan(x)) {
                assert_true(isnan(y));
                assert_int_equal(!!signbit(y), !!signbit(x));
            } else if (isinf(x) || (fmt == PEER_FMT_F16 && fabsf(x) >= 65520.0f) ||
                       x == FLT_MAX) {
                /* FLT_MAX rounds past bf16's largest finite value */
                assert_true(isinf(y));
                assert_int_equal(!!signbit(y), !!signbit(x));
            } else {
                assert_int_equal(check_bound(fmt, 0, &x, &y, 1, "finite"), 0);
            }
        }
    }
    /* Q8: block 1 holds a NaN, block 2 an Inf, block 3 (short) a -Inf: each
     * is written with a NaN scale and decodes all-NaN; block 0 is fine. */
    float x[200], y[200];
    for (int i = 0; i < 200; i++)
        x[i] = (float)sin(i * 0.37);
    x[70] = nan;
    x[130] = INFINITY;
    x[199] = -INFINITY;
    size_t len;
    uint8_t *b = enc(PEER_FMT_Q8, 64, x, 200, &len);
    for (int k = 1; k < 4; k++) {
        float s;
        memcpy(&s, b + 68 * k, 4);
        assert_true(isnan(s));
    }
    assert_int_equal(peer_tensorfmt_decode(PEER_FMT_Q8, 64, b, len, 200, y), 0);
    assert_int_equal(check_bound(PEER_FMT_Q8, 64, x, y, 64, "finite block"), 0);
    for (int i = 64; i < 200; i++)
        assert_true(isnan(y[i]));
    free(b);
}

/* Q8 scales the decoder must refuse, and the ones it accepts. */
static void test_q8_scales(void **state)
{
    (void)state;
    float x[80], y[80];
    for (int i = 0; i < 80; i++)
        x[i] = (float)i - 40.0f;
    size_t len;
    uint8_t *b = enc(PEER_FMT_Q8, 64, x, 80, &len);   /* blocks of 64 and 16 */
    static const uint32_t refused[] = {0xBF800000u, 0x80000001u, 0xFF7FFFFFu, 0x7F800000u,
                                       0xFF800000u};
    static const uint32_t accepted[] = {0x00000000u, 0x80000000u, 0x7FC00000u, 0xFFC00000u,
                                        0x7F800001u, 0x00000001u, 0x3F800000u};
    for (int blk = 0; blk < 2; blk++) {
        size_t off = blk ? 68 : 0;
        uint8_t save[4];
        memcpy(save, b + off, 4);
        for (size_t i = 0; i < sizeof refused / sizeof refused[0]; i++) {
            memcpy(b + off, &refused[i], 4);
            for (int k = 0; k < 80; k++)
                y[k] = 12345.0f;
            assert_int_equal(peer_tensorfmt_decode(PEER_FMT_Q8, 64, b, len, 80, y), -EBADMSG);
            for (int k = 0; k < 80; k++)
                assert_true(y[k] == 12345.0f);   /* untouched on failure */
        }
        for (size_t i = 0; i < sizeof accepted / sizeof accepted[0]; i++) {
            memcpy(b + off, &accepted[i], 4);
            assert_int_equal(peer_tensorfmt_decode(PEER_FMT_Q8, 64, b, len, 80, y), 0);
            float s = u2f(accepted[i]);
            for (int k = blk * 64; k < (blk ? 80 : 64); k++) {
                if (isnan(s))
                    assert_true(isnan(y[k]));
                else
                    assert_true(y[k] == s * (float)(int8_t)b[off + 4 + (size_t)(k - blk * 64)]);
            }
        }
        memcpy(b + off, save, 4);
    }
    free(b);
}

/* Wrong lengths and random bytes: -EBADMSG or a clean decode, never a
 * crash or a read outside the buffer (ASan checks that: every buffer has
 * exactly the length passed). */
static void test_hostile(void **state)
{
    (void)state;
    float x[300];
    for (int i = 0; i < 300; i++)
        x[i] = logunif(1e-3, 10);
    static const size_t ns[] = {1, 63, 65, 300};
    for (size_t f = 0; f < 4; f++)
        for (size_t k = 0; k < 4; k++) {
            peer_fmt fmt = all_fmts[f];
            int block = fmt == PEER_FMT_Q8 ? 64 : 0;
            size_t n = ns[k], len;
            uint8_t *good = enc(fmt, block, x, n, &len);
            /* every shorter length, a few longer ones; values for n-1, n+1 */
            for (size_t l = 0; l <= len + 8; l++) {
                if (l == len)
                    continue;
                uint8_t *p = malloc(l ? l : 1);
                assert_non_null(p);
                memcpy(p, good, l < len ? l : len);
                if (l > len)
                    memset(p + len, 0, l - len);
                float *y = malloc(n * sizeof *y);
                assert_non_null(y);
                y[0] = 7.0f;
                int rc = peer_tensorfmt_decode(fmt, block, p, l, n, y);
                if (rc != -EBADMSG)
                    fail_msg("%s n %zu: %zu bytes of %zu gave %d", peer_tensorfmt_name(fmt), n, l,
                             len, rc);
                assert_true(y[0] == 7.0f);
                free(y);
                free(p);
            }
            float *y = malloc((n + 1) * sizeof *y);
            assert_non_null(y);
            assert_int_equal(peer_tensorfmt_decode(fmt, block, good, len, n + 1, y), -EBADMSG);
            if (n > 1)
                assert_int_equal(peer_tensorfmt_decode(fmt, block, good, len, n - 1, y), -EBADMSG);
            free(y);
            free(good);
        }

    /* fuzz: random formats (some invalid), blocks (some invalid), counts,
     * lengths (mostly the right one, so the body is parsed) and bytes */
    static const int fblocks[] = {16, 32, 64, 256, 4096, 0, 48, -16};
    for (int iter = 0; iter < 10000; iter++) {
        peer_fmt fmt = (peer_fmt)(next_rand() % 5);   /* 4 is invalid */
        int block = fblocks[next_rand() % 8];
        size_t n = next_rand() % 300;
        size_t want = peer_tensorfmt_size(fmt, block, n);
        int valid = peer_tensorfmt_check(fmt, block) == 0;
        size_t len;
        switch (next_rand() % 4) {
        case 0:
            len = next_rand() % (2 * want + 8);
            break;
        case 1:
            len = want + next_rand() % 5 - 2;   /* want-2 .. want+2 (wraps when tiny) */
            len = len > 4 * want + 16 ? 0 : len;
            break;
        default:
            len = want;
        }
        uint8_t *p = malloc(len ? len : 1);
        float *y = malloc((n ? n : 1) * sizeof *y);
        assert_non_null(p);
        assert_non_null(y);
        /* random bytes; half the time Q8 scales are made plausible so the
         * codes get decoded */
        for (size_t i = 0; i < len; i++)
            p[i] = (uint8_t)next_rand();
        if (fmt == PEER_FMT_Q8 && valid && len == want && (iter & 1))
            for (size_t i = 0, off = 0; i < n; i += (size_t)block) {
                size_t m = n - i < (size_t)block ? n - i : (size_t)block;
                p[off + 3] &= 0x7F;   /* positive, and maybe NaN or Inf */
                off += 4 + m;
            }
        int rc = peer_tensorfmt_decode(fmt, block, p, len, n, y);
        int ok = rc == 0 || rc == -EBADMSG || rc == -EINVAL;
        if (!ok || (!valid && rc != -EINVAL) || (valid && len != want && rc != -EBADMSG) ||
            (valid && len == want && fmt != PEER_FMT_Q8 && rc != 0))
            fail_msg("seed %u iter %d: fmt %d block %d n %zu len %zu (want %zu) gave %d", SEED,
                     iter, fmt, block, n, len, want, rc);
        if (rc == 0 && fmt != PEER_FMT_F32) {
            /* decoding is a function of the bytes; f16 and bf16 bytes
             * re-encode to themselves (NaN payloads aside) */
            float *y2 = malloc((n ? n : 1) * sizeof *y2);
            assert_non_null(y2);
            assert_int_equal(peer_tensorfmt_decode(fmt, block, p, len, n, y2), 0);
            assert_memory_equal(y, y2, n * sizeof *y);
            if (fmt != PEER_FMT_Q8)
                for (size_t i = 0; i < n; i++) {
                    uint16_t h, back = enc1(fmt, y[i]);
                    memcpy(&h, p + 2 * i, 2);
                    if (!isnan(y[i]) && back != h)
                        fail_msg("seed %u iter %d: %04x -> %a -> %04x", SEED, iter, h,
                                 (double)y[i], back);
                }
            free(y2);
        }
        free(y);
        free(p);
    }
}

/* Error feedback. Each step's gradient has, in every Q8 block, one big value
 * (|g| in [0.5, 1], random sign) and small positive ones in [0.5e-3,
 * 1.5e-3], below half of Q8's step (scale/2 >= 0.5/254): plain encoding
 * rounds them to 0 every time, so the decoded sum drifts by about 1e-3 per
 * value per step. With error feedback the sum of decoded values must stay
 * within one step's bound of the true sum at every step (plus float
 * rounding of the running sums), and the residual must stay bounded. */
#define EF_N 256
#define EF_BLOCK 64
#define EF_STEPS 1000

static void gen_grad(peer_fmt fmt, float *g)
{
    for (int i = 0; i < EF_N; i++) {
        if (fmt == PEER_FMT_Q8)
            g[i] = i % EF_BLOCK == 0 ? (float)((next_rand() & 1 ? -1 : 1) * (0.5 + 0.5 * unif()))
                                     : (float)(0.5e-3 + 1e-3 * unif());
        else if (fmt == PEER_FMT_F16)   /* 1 + u, u < 2^-12: rounds to 1 */
            g[i] = (float)(1.0 + unif() * 0x1.0p-12);
        else   /* bf16: 1 + u, u < 2^-9: rounds to 1 */
            g[i] = (float)(1.0 + unif() * 0x1.0p-9);
    }
}

/* One step's bound: the error of one encoding of v = g + r, for a block
 * absmax (Q8) or value (f16, bf16) of v of a. */
static double ef_step_bound(peer_fmt fmt, double a)
{
    switch (fmt) {
    case PEER_FMT_Q8:
        return q8_bound(a);
    case PEER_FMT_F16:
        return a * 0x1.0p-11;
    default:
        return a * 0x1.0p-8;
    }
}

static double run_ef(peer_fmt fmt, int use_ef, double *worst_ratio)
{
    int block = fmt == PEER_FMT_Q8 ? EF_BLOCK : 0;
    float g[EF_N], r[EF_N] = {0}, y[EF_N];
    double sum_true[EF_N] = {0}, sum_dec[EF_N] = {0}, v[EF_N];
    size_t len = peer_tensorfmt_size(fmt, block, EF_N);
    uint8_t *b = malloc(len);
    assert_non_null(b);
    double max_drift = 0;
    *worst_ratio = 0;
    for (int t = 1; t <= EF_STEPS; t++) {
        gen_grad(fmt, g);
        for (int i = 0; i < EF_N; i++)
            v[i] = (double)g[i] + (use_ef ? (double)r[i] : 0.0);
        long rc = use_ef ? peer_tensorfmt_encode_ef(fmt, block, g, EF_N, r, b, len)
                         : peer_tensorfmt_encode(fmt, block, g, EF_N, b, len);
        assert_int_equal(rc, (long)len);
        assert_int_equal(peer_tensorfmt_decode(fmt, block, b, len, EF_N, y), 0);
        for (int i = 0; i < EF_N; i++) {
            sum_true[i] += g[i];
            sum_dec[i] += y[i];
            double a = fabs(v[i]);
            if (fmt == PEER_FMT_Q8) {
                a = 0;
                for (int k = i / EF_BLOCK * EF_BLOCK; k < (i / EF_BLOCK + 1) * EF_BLOCK; k++)
                    a = fmax(a, fabs(v[k]));
            }
            /* the sums differ by the last residual, plus the float
             * rounding of v = g + r (half an ulp of |v| per step) */
            double bound = ef_step_bound(fmt, a) + t * a * 0x1.0p-23;
            double drift = fabs(sum_dec[i] - sum_true[i]);
            max_drift = fmax(max_drift, drift);
            if (use_ef) {
                *worst_ratio = fmax(*worst_ratio, drift / bound);
                if (!(drift <= bound))
                    fail_msg("seed %u %s step %d value %d: |sum decoded - sum true| = %.3g > %.3g",
                             SEED, peer_tensorfmt_name(fmt), t, i, drift, bound);
                if (!(fabs((double)r[i]) <= ef_step_bound(fmt, a)))
                    fail_msg("seed %u %s step %d value %d: residual %.3g > %.3g", SEED,
                             peer_tensorfmt_name(fmt), t, i, (double)r[i], ef_step_bound(fmt, a));
            }
        }
    }
    free(b);
    return max_drift;
}

static void test_error_feedback(void **state)
{
    (void)state;
    for (int f = 1; f <= 3; f++) {
        peer_fmt fmt = (peer_fmt)f;
        double ratio, unused;
        double with = run_ef(fmt, 1, &ratio);
        double without = run_ef(fmt, 0, &unused);
        /* one step's bound at the largest |v| (at most 1 + 1/253 for q8,
         * 1 + 2^-9 + 2^-8 otherwise) */
        double step = ef_step_bound(fmt, 1.01);
        print_message("%s: max drift %.3g with error feedback (%.2f of the bound), %.3g without "
                      "(one step's bound %.3g)\n", peer_tensorfmt_name(fmt), with, ratio, without,
                      step);
        assert_true(with <= 1.05 * step);
        /* without feedback the bias adds up: ~1000 steps x 1e-3 (q8),
         * x 2^-13 (f16) or x 2^-10 (bf16) */
        assert_true(without > 50 * step);
    }

    /* F32: lossless, the residual stays 0 */
    float g[100], r[100] = {0}, y[100];
    uint8_t b[400];
    for (int i = 0; i < 100; i++)
        g[i] = logunif(1e-6, 1e4);
    assert_int_equal(peer_tensorfmt_encode_ef(PEER_FMT_F32, 0, g, 100, r, b, sizeof b), 400);
    assert_memory_equal(b, g, 400);
    for (int i = 0; i < 100; i++)
        assert_true(r[i] == 0.0f);

    /* non-finite values leave a 0 residual, not a poisoned one: a NaN in a
     * Q8 block zeroes that block's residual; an f16 overflow too */
    for (int i = 0; i < 100; i++) {
        g[i] = 1e-4f * (float)(i + 1);
        r[i] = 1e-5f;
    }
    g[20] = u2f(0x7FC00000u);
    size_t len = peer_tensorfmt_size(PEER_FMT_Q8, 16, 100);
    assert_int_equal(peer_tensorfmt_encode_ef(PEER_FMT_Q8, 16, g, 100, r, b, len), (long)len);
    assert_int_equal(peer_tensorfmt_decode(PEER_FMT_Q8, 16, b, len, 100, y), 0);
    for (int i = 0; i < 100; i++) {
        assert_true(isfinite(r[i]));
        if (i >= 16 && i < 32)
            assert_true(r[i] == 0.0f && isnan(y[i]));
        else
            assert_true(fabsf(r[i]) <= 1e-2f / 253.0f);
    }
    g[20] = 1e5f;
    r[20] = 0.0f;
    assert_int_equal(peer_tensorfmt_encode_ef(PEER_FMT_F16, 0, g, 100, r, b, 200), 200);
    assert_true(r[20] == 0.0f);
    /* on failure the residual is left alone */
    float before[100];
    memcpy(before, r, sizeof r);
    assert_int_equal(peer_tensorfmt_encode_ef(PEER_FMT_F16, 0, g, 100, r, b, 199), -ENOBUFS);
    assert_memory_equal(before, r, sizeof r);
}

/* ---- stochastic rounding (peer_tensorfmt_encode_sr) ---- */

/* One step of Q8 plus the float rounding of scale and product: the bound
 * of a stochastically rounded value whose block has absmax amax. */
static double q8_sr_bound(double amax)
{
    return amax / 127.0 + amax * 0x1.0p-21 + 0x1.0p-149;
}

/* Q8 codes are rounded stochastically: over many seeds the mean decoded
 * value is x (within a few standard errors), where rounding to nearest
 * maps values below half a step to 0 every time; each value is within one
 * step; and the two codes seen are the neighbours of x / scale. */
static void test_sr_unbiased(void **state)
{
    (void)state;
    enum { N = 70, BLOCK = 16, SEEDS = 20000 };
    const double step0 = 1.0 / 127.0;    /* blocks whose absmax is 1 */
    static const double fr[] = {0.3, -0.3, 0.05, -0.05, 0.5, 0.7, 1.5, -2.25, 12.25, -40.9, 126.6, -126.2, 0.0};
    float x[N], y[N];
    double sum[N] = {0}, lo[N], hi[N];
    for (int i = 0; i < N; i++) {
        if (i % BLOCK == 0 || i == N - 1)
            x[i] = (i / BLOCK) % 2 ? -1.0f : 1.0f;    /* every block's absmax 1, the last (6 values) too */
        else
            x[i] = (float)(fr[i % 13] * step0);
        lo[i] = INFINITY;
        hi[i] = -INFINITY;
    }
    size_t len = peer_tensorfmt_size(PEER_FMT_Q8, BLOCK, N);
    uint8_t *b = malloc(len), *nb = malloc(len);
    assert_true(b && nb);
    /* to nearest: the values below half a step decode to 0 */
    assert_int_equal(peer_tensorfmt_encode(PEER_FMT_Q8, BLOCK, x, N, nb, len), (long)len);
    assert_int_equal(peer_tensorfmt_decode(PEER_FMT_Q8, BLOCK, nb, len, N, y), 0);
    for (int i = 0; i < N; i++)
        if (fabs((double)x[i]) < 0.49 * step0)
            assert_true(y[i] == 0.0f);
    for (uint64_t seed = 0; seed < SEEDS; seed++) {
        assert_int_equal(peer_tensorfmt_encode_sr(PEER_FMT_Q8, BLOCK, x, N, seed * 7919u + 1, b, len), (long)len);
        /* the layout is Q8's: the same scales as to nearest */
        for (size_t k = 0; k < len; k += 4 + BLOCK)
            assert_memory_equal(b + k, nb + k, 4);
        assert_int_equal(peer_tensorfmt_decode(PEER_FMT_Q8, BLOCK, b, len, N, y), 0);
        for (int i = 0; i < N; i++) {
            double err = fabs((double)y[i] - (double)x[i]);
            if (!(err <= q8_sr_bound(1.0)))
                fail_msg("seed %llu x[%d] = %.9g: decoded %.9g, more than a step away",
                         (unsigned long long)seed, i, (double)x[i], (double)y[i]);
            sum[i] += y[i];
            lo[i] = fmin(lo[i], y[i]);
            hi[i] = fmax(hi[i], y[i]);
        }
    }
    int below_half = 0;
    for (int i = 0; i < N; i++) {
        double mean = sum[i] / SEEDS, xv = x[i];
        /* standard error <= step / (2 sqrt(SEEDS)) = 0.0035 steps */
        if (!(fabs(mean - xv) <= 0.02 * step0))
            fail_msg("x[%d] = %.6g steps: mean of %d stochastic roundings %.6g steps (bias %.3g steps)", i,
                     xv / step0, SEEDS, mean / step0, (mean - xv) / step0);
        double v = xv / step0;
        if (v != floor(v)) {
            /* both neighbours seen, nothing else */
            assert_true(fabs(lo[i] / step0 - floor(v)) < 1e-4 && fabs(hi[i] / step0 - ceil(v)) < 1e-4);
        } else {
            assert_true(lo[i] == hi[i]);
        }
        if (fabs(v) < 0.49 && v != 0)
            below_half++;
    }
    assert_true(below_half >= 8); /* the case rounding to nearest loses */
    free(b);
    free(nb);
}

/* Deterministic per seed; other seeds give other codes; f32, f16 and bf16
 * are encoded as by peer_tensorfmt_encode; non-finite and zero blocks as
 * there too; errors as there. */
static void test_sr_formats_and_blocks(void **state)
{
    (void)state;
    enum { N = 1000 };
    static float x[N];
    static uint8_t a[4 * N], c[4 * N], ref[4 * N];
    for (int i = 0; i < N; i++)
        x[i] = logunif(1e-4, 1e3);
    for (size_t f = 0; f < 4; f++) {
        peer_fmt fmt = all_fmts[f];
        static const int qb[] = {16, 64, 4096};
        for (size_t bi = 0; bi < (fmt == PEER_FMT_Q8 ? 3u : 1u); bi++) {
            int block = fmt == PEER_FMT_Q8 ? qb[bi] : 0;
            size_t len = peer_tensorfmt_size(fmt, block, N);
            assert_int_equal(peer_tensorfmt_encode(fmt, block, x, N, ref, len), (long)len);
            for (uint64_t seed = 1; seed < 2000000; seed = seed * 1000 + 7) {
                assert_int_equal(peer_tensorfmt_encode_sr(fmt, block, x, N, seed, a, len), (long)len);
                assert_int_equal(peer_tensorfmt_encode_sr(fmt, block, x, N, seed, c, len), (long)len);
                assert_memory_equal(a, c, len); /* deterministic */
                if (fmt != PEER_FMT_Q8) {
                    assert_memory_equal(a, ref, len); /* as to nearest */
                } else {
                    assert_int_equal(peer_tensorfmt_encode_sr(fmt, block, x, N, seed + 1, c, len), (long)len);
                    assert_memory_not_equal(a, c, len);
                    assert_memory_not_equal(a, ref, len);
                }
                /* -ENOBUFS, nothing written */
                memset(c, 0xEE, len);
                assert_int_equal(peer_tensorfmt_encode_sr(fmt, block, x, N, seed, c, len - 1), -ENOBUFS);
                for (size_t k = 0; k < len; k++)
                    assert_int_equal(c[k], 0xEE);
            }
        }
    }
    /* Q8: a block with NaN, one with +Inf, one with -Inf, an all-zero one
     * (with -0), then a finite one and a short last one with NaN: the
     * non-finite and zero blocks are written as by peer_tensorfmt_encode
     * (NaN scale and zero codes; scale 0), and decode the same. */
    float q[16 * 5 + 5], y1[16 * 5 + 5], y2[16 * 5 + 5];
    for (int i = 0; i < 85; i++)
        q[i] = (float)sin(i * 0.7) * 3.0f;
    q[3] = u2f(0x7FC00000u);
    q[16 + 15] = INFINITY;
    q[32] = -INFINITY;
    for (int i = 48; i < 64; i++)
        q[i] = (i & 1) ? -0.0f : 0.0f;
    q[83] = u2f(0xFFC00001u);
    size_t len = peer_tensorfmt_size(PEER_FMT_Q8, 16, 85);
    assert_int_equal(peer_tensorfmt_encode(PEER_FMT_Q8, 16, q, 85, ref, len), (long)len);
    for (uint64_t seed = 0; seed < 50; seed++) {
        assert_int_equal(peer_tensorfmt_encode_sr(PEER_FMT_Q8, 16, q, 85, seed, a, len), (long)len);
        for (int blk = 0; blk < 6; blk++) {
            size_t off = (size_t)blk * 20, m = blk == 5 ? 9 : 20;
            if (blk != 4)
                assert_memory_equal(a + off, ref + off, m); /* scale and codes */
            else
                assert_memory_equal(a + off, ref + off, 4); /* the scale */
        }
        assert_int_equal(peer_tensorfmt_decode(PEER_FMT_Q8, 16, a, len, 85, y1), 0);
        assert_int_equal(peer_tensorfmt_decode(PEER_FMT_Q8, 16, ref, len, 85, y2), 0);
        for (int i = 0; i < 85; i++) {
            if (i < 48 || i >= 80) {
                assert_true(isnan(y1[i]) && isnan(y2[i]));
            } else if (i < 64) {
                assert_true(y1[i] == 0.0f && !signbit(y1[i]));
            } else {
                double amax = 0;
                for (int k = 64; k < 80; k++)
                    amax = fmax(amax, fabs((double)q[k]));
                assert_true(fabs((double)y1[i] - (double)q[i]) <= q8_sr_bound(amax));
            }
        }
    }
    /* errors as peer_tensorfmt_encode */
    assert_int_equal(peer_tensorfmt_encode_sr(PEER_FMT_Q8, 100, x, 10, 1, a, sizeof a), -EINVAL);
    assert_int_equal(peer_tensorfmt_encode_sr(PEER_FMT_Q8, 0, x, 10, 1, a, sizeof a), -EINVAL);
    assert_int_equal(peer_tensorfmt_encode_sr((peer_fmt)4, 0, x, 10, 1, a, sizeof a), -EINVAL);
    assert_int_equal(peer_tensorfmt_encode_sr(PEER_FMT_Q8, 64, NULL, 10, 1, a, sizeof a), -EINVAL);
    assert_int_equal(peer_tensorfmt_encode_sr(PEER_FMT_Q8, 64, x, 10, 1, NULL, sizeof a), -EINVAL);
    assert_int_equal(peer_tensorfmt_encode_sr(PEER_FMT_Q8, 64, NULL, 0, 1, NULL, 0), 0);
    assert_int_equal(peer_tensorfmt_encode_sr(PEER_FMT_F32, 0, x, SIZE_MAX / 4 + 1, 1, a, sizeof a), -EOVERFLOW);
}

/* Random data of every kind test_roundtrip_random uses but the tiniest:
 * each stochastically rounded value is within one step of x. */
static void test_sr_bound_random(void **state)
{
    (void)state;
    enum { N = 4099 };
    static float x[N], y[N];
    static uint8_t b[2 * N + 4 * N];
    static const int blocks[] = {16, 64, 256, 4096};
    for (int kind = 0; kind < 4; kind++) {
        for (int i = 0; i < N; i++)
            x[i] = kind == 0   ? logunif(1e-6, 1e4)
                   : kind == 1 ? (float)(2.0 * unif() - 1.0)
                   : kind == 2 ? logunif(1e-30, 1e-20)
                               : logunif(1e30, 3e38);
        for (size_t bi = 0; bi < 4; bi++) {
            int block = blocks[bi];
            size_t len = peer_tensorfmt_size(PEER_FMT_Q8, block, N);
            assert_int_equal(peer_tensorfmt_encode_sr(PEER_FMT_Q8, block, x, N, 0xC0FFEEu + (uint64_t)kind, b, len),
                             (long)len);
            assert_int_equal(peer_tensorfmt_decode(PEER_FMT_Q8, block, b, len, N, y), 0);
            for (int i = 0; i < N; i++) {
                size_t b0 = (size_t)i / (size_t)block * (size_t)block;
                double bound = q8_sr_bound(block_absmax(x, N, b0, (size_t)block));
                double err = fabs((double)y[i] - (double)x[i]);
                if (!(err <= bound) || !isfinite(y[i]))
                    fail_msg("kind %d block %d x[%d] = %.9g: decoded %.9g, error %.3g > %.3g", kind, block, i,
                             (double)x[i], (double)y[i], err, bound);
            }
        }
    }
}

/* Q8 blocks whose scale is a float32 subnormal (absmax below ~2^-119): the
 * header promises the error bound absmax/254 + absmax * 2^-21 + 2^-149 for
 * rounding to nearest (and one step, absmax/127, plus rounding for
 * stochastic rounding). Codes computed against absmax/127 rather than the
 * scale actually stored break it when the scale's own rounding (up to
 * 2^-150, times a code of up to 127) is larger than the step; a block of
 * absmax 3 * 2^-149 even gets the scale 0 and decodes to all zeros. */
static void test_q8_subnormal_scale_bound(void **state)
{
    (void)state;
    static const double amaxes[] = {3 * 0x1.0p-149, 71 * 0x1.0p-149, 1000 * 0x1.0p-149, 0x1.0p-135, 0x1.0p-130,
                                    0x1.0p-122};
    float x[16], y[16];
    uint8_t b[20];
    int miss = 0;
    for (size_t k = 0; k < sizeof amaxes / sizeof amaxes[0]; k++) {
        for (int i = 0; i < 16; i++)
            x[i] = (float)(amaxes[k] * (i + 1) / 16.0 * ((i & 1) ? -1 : 1));
        double amax = block_absmax(x, 16, 0, 16), worst_n = 0, worst_sr = 0;
        assert_int_equal(peer_tensorfmt_encode(PEER_FMT_Q8, 16, x, 16, b, sizeof b), 20);
        assert_int_equal(peer_tensorfmt_decode(PEER_FMT_Q8, 16, b, sizeof b, 16, y), 0);
        float scale;
        memcpy(&scale, b, 4);
        for (int i = 0; i < 16; i++)
            worst_n = fmax(worst_n, fabs((double)y[i] - (double)x[i]) / q8_bound(amax));
        for (uint64_t seed = 0; seed < 20; seed++) {
            assert_int_equal(peer_tensorfmt_encode_sr(PEER_FMT_Q8, 16, x, 16, seed, b, sizeof b), 20);
            assert_int_equal(peer_tensorfmt_decode(PEER_FMT_Q8, 16, b, sizeof b, 16, y), 0);
            for (int i = 0; i < 16; i++)
                worst_sr = fmax(worst_sr, fabs((double)y[i] - (double)x[i]) / q8_sr_bound(amax));
        }
        if (!(worst_n <= 1.0) || !(worst_sr <= 1.0)) {
            fprintf(stderr, "  absmax %.4g (%.6g * 2^-149), scale %.4g (%.6g * 2^-149): worst error %.2f x the bound "
                    "to nearest, %.2f x stochastically\n", amax, amax / 0x1.0p-149, (double)scale,
                    (double)scale / 0x1.0p-149, worst_n, worst_sr);
            miss++;
        }
    }
    if (miss)
        fail_msg("%d of %zu tiny blocks decode outside Q8's documented bound", miss,
                 sizeof amaxes / sizeof amaxes[0]);
}

/* --wire-format values: "FMT" or "q8:BLOCK". */
static void test_spec_parse(void **state)
{
    (void)state;
    static const struct { const char *spec; peer_fmt fmt; int block; } good[] = {
        {"f32", PEER_FMT_F32, 0}, {"f16", PEER_FMT_F16, 0}, {"bf16", PEER_FMT_BF16, 0},
        {"q8", PEER_FMT_Q8, PEER_FMT_Q8_BLOCK}, {"q8:16", PEER_FMT_Q8, 16}, {"q8:32", PEER_FMT_Q8, 32},
        {"q8:64", PEER_FMT_Q8, 64}, {"q8:256", PEER_FMT_Q8, 256}, {"q8:4096", PEER_FMT_Q8, 4096},
    };
    for (size_t i = 0; i < sizeof good / sizeof good[0]; i++) {
        peer_fmt f = (peer_fmt)99;
        int blk = -7;
        if (peer_tensorfmt_spec_parse(good[i].spec, &f, &blk) != 0 || f != good[i].fmt || blk != good[i].block)
            fail_msg("\"%s\": got (%d, %d)", good[i].spec, (int)f, blk);
    }
    assert_int_equal(PEER_FMT_Q8_BLOCK, 64);
    static const char *const bad[] = {
        "q8:15", "q8:100", "q8:8192", "q8:8", "q8:0", "q8:-16", "q8:4097", "q8:2048x", "f16:64", "f32:16",
        "bf16:16", "q8:", "q8:64x", "q8:64:64", "Q8", "F32", "q8 ", "", ":", ":64", "q", "q8,f16", "q16",
        "q8:99999999999999999999", "q8:4294967312", "q8:0x40", "f32:",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        peer_fmt f = (peer_fmt)99;
        int blk = -7;
        int rc = peer_tensorfmt_spec_parse(bad[i], &f, &blk);
        if (rc != -EINVAL || f != (peer_fmt)99 || blk != -7)
            fail_msg("\"%s\": got %d, (%d, %d)", bad[i], rc, (int)f, blk);
    }
    peer_fmt f;
    int blk;
    assert_int_equal(peer_tensorfmt_spec_parse(NULL, &f, &blk), -EINVAL);
    assert_int_equal(peer_tensorfmt_spec_parse("q8", NULL, &blk), -EINVAL);
    assert_int_equal(peer_tensorfmt_spec_parse("q8", &f, NULL), -EINVAL);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_names),
        cmocka_unit_test(test_sizes),
        cmocka_unit_test(test_invalid_args),
        cmocka_unit_test(test_roundtrip_random),
        cmocka_unit_test(test_exact_and_ties),
        cmocka_unit_test(test_doc_example),
        cmocka_unit_test(test_nonfinite),
        cmocka_unit_test(test_q8_scales),
        cmocka_unit_test(test_hostile),
        cmocka_unit_test(test_error_feedback),
        cmocka_unit_test(test_sr_unbiased),
        cmocka_unit_test(test_sr_formats_and_blocks),
        cmocka_unit_test(test_sr_bound_random),
        cmocka_unit_test(test_q8_subnormal_scale_bound),
        cmocka_unit_test(test_spec_parse),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
