/* net/tensorfmt.h: compressed tensor wire formats (pure: no I/O, no state).
 *
 * Activations and gradients sent between pipeline stages, and the slices
 * exchanged while averaging, are float32 today. This module defines smaller
 * encodings of a flat float32 array and converts to and from them; it does
 * not know about messages. docs/rpc.md ("Tensor formats") is the byte-level
 * reference. Every multi-byte field is little-endian.
 *
 *   PEER_FMT_F32  (0)  4n bytes: the floats themselves, bit for bit.
 *   PEER_FMT_F16  (1)  2n bytes: IEEE 754 binary16, rounded to nearest, ties
 *                      to even. Inf stays Inf, NaN stays NaN (a quiet NaN of
 *                      the same sign; the payload is not kept), and values
 *                      whose magnitude rounds above 65504 (|x| >= 65520)
 *                      become Inf of their sign, as a C cast to _Float16
 *                      does. Bound: relative error <= 2^-11 for 2^-14 <= |x|
 *                      <= 65504 (the normal range), absolute error <= 2^-25
 *                      below 2^-14 (the subnormal range; |x| <= 2^-25
 *                      becomes +-0).
 *   PEER_FMT_BF16 (2)  2n bytes: the upper half of the float32, rounded to
 *                      nearest, ties to even (bfloat16). Same exponent range
 *                      as float32: Inf and NaN kept as for F16, and only
 *                      |x| >= 2^128 - 2^119 (above bf16's largest finite
 *                      value by half a step) becomes Inf. Bound: relative
 *                      error <= 2^-8 for |x| >= 2^-126 (FLT_MIN); absolute
 *                      <= 2^-134 below it.
 *   PEER_FMT_Q8   (3)  blockwise 8-bit: the values are cut into blocks of
 *                      `block` consecutive values (the last block holds the
 *                      n % block left over, if any). Each block is a float32
 *                      scale = absmax/127 (absmax: the largest |x| of the
 *                      block) followed by one int8 code per value, code =
 *                      x/scale rounded to nearest (ties to even), so codes
 *                      lie in [-127, 127]; a value decodes to scale * code.
 *                      Size: n + 4 * ceil(n / block) bytes. Bound: absolute
 *                      error <= scale/2 = absmax/254 per value, plus float
 *                      rounding of at most absmax * 2^-21 (+ 2^-149 when the
 *                      scale is a float32 subnormal, absmax < 2^-119).
 *                      Every finite value decodes finite (near FLT_MAX the
 *                      scale is taken down one step so 127 * scale does
 *                      not round to Inf). An
 *                      all-zero block has scale 0 and decodes to +0
 *                      (a -0 input is not kept).
 *                      Q8 cannot represent Inf or NaN: a block that holds
 *                      any non-finite value is written with a NaN scale
 *                      (and zero codes) and decodes to NaN in all of its
 *                      values, so a receiver's existing non-finite checks
 *                      still see the bad tensor; the rest of the tensor is
 *                      unaffected.
 *
 * `block` is Q8's block length: a power of two in [PEER_FMT_Q8_BLOCK_MIN,
 * PEER_FMT_Q8_BLOCK_MAX], PEER_FMT_Q8_BLOCK (64) unless the sender chose
 * another. The other formats ignore it (pass 0).
 *
 * The decoder treats its input as hostile: the length must match n exactly,
 * and a Q8 scale that is negative (-0 is fine) or infinite is refused with
 * -EBADMSG; it reads nothing outside [src, src + len) and writes nothing
 * outside dst[0..n). A NaN scale is accepted (see above). A code of -128,
 * which the encoder never writes, decodes to -128 * scale. A finite scale
 * larger than any encoder writes is accepted too, so hostile bytes can
 * decode to +-Inf, as an f32 payload can hold Inf: receivers check decoded
 * tensors for non-finite values as they do today.
 *
 * The conversions are exact functions of their input in the default
 * floating-point environment (round to nearest, subnormals not flushed:
 * what C gives unless a thread sets FTZ/DAZ or -ffast-math is used).
 *
 * Threads: every function is thread-safe (no shared state). Memory: all
 * buffers are the caller's, borrowed for the duration of the call; input
 * and output must not overlap.
 */
#ifndef NET_TENSORFMT_H
#define NET_TENSORFMT_H

#include <stddef.h>
#include <stdint.h>

typedef enum peer_fmt {
    PEER_FMT_F32 = 0,
    PEER_FMT_F16 = 1,
    PEER_FMT_BF16 = 2,
    PEER_FMT_Q8 = 3,
} peer_fmt;
#define PEER_FMT_COUNT 4

#define PEER_FMT_Q8_BLOCK 64        /* the default Q8 block length */
#define PEER_FMT_Q8_BLOCK_MIN 16
#define PEER_FMT_Q8_BLOCK_MAX 4096

/* The set of formats a peer accepts: bit f set for format f. */
typedef uint32_t peer_fmt_mask;
#define PEER_FMT_BIT(f) ((peer_fmt_mask)1 << (f))
#define PEER_FMT_MASK_ALL ((peer_fmt_mask)((1u << PEER_FMT_COUNT) - 1))

/* Whether mask m includes format f. */
static inline int peer_fmt_mask_has(peer_fmt_mask m, peer_fmt f)
{
    return (unsigned)f < PEER_FMT_COUNT && (m & PEER_FMT_BIT(f)) != 0;
}

/* "f32", "f16", "bf16" or "q8"; NULL for a value that is not a format. */
const char *peer_tensorfmt_name(peer_fmt fmt);

/* Parses one of the names above (exactly, lower case) into *out.
 * Returns 0 or -EINVAL. */
int peer_tensorfmt_parse(const char *name, peer_fmt *out);

/* Parses a comma-separated list of names ("f32,q8"; repeats allowed, no
 * spaces) into a mask. Returns 0, or -EINVAL for an empty list, an empty
 * item or an unknown name (then *out is unchanged). */
int peer_tensorfmt_mask_parse(const char *list, peer_fmt_mask *out);

/* Writes the names of m's formats, comma separated in format order, and a
 * NUL into buf (cap bytes). Returns the length without the NUL, -EINVAL if m
 * has a bit that is not a format, or -ENOSPC if cap is too small. An empty
 * mask gives "". */
int peer_tensorfmt_mask_format(peer_fmt_mask m, char *buf, size_t cap);

/* 0 if fmt is a format and block is valid for it (any value for F32, F16
 * and BF16; a power of two in [16, 4096] for Q8), else -EINVAL. */
int peer_tensorfmt_check(peer_fmt fmt, int block);

/* Encoded bytes for n values, or 0 when fmt/block are invalid or the size
 * does not fit in a size_t (n = 0 also gives 0). */
size_t peer_tensorfmt_size(peer_fmt fmt, int block, size_t n);

/* Encodes src (n floats) into dst (cap bytes). Returns the bytes written
 * (= peer_tensorfmt_size), -EINVAL (fmt/block invalid, NULL src or dst with
 * n > 0), -EOVERFLOW (the size does not fit in a long) or -ENOBUFS (cap too
 * small; nothing written). */
long peer_tensorfmt_encode(peer_fmt fmt, int block, const float *src, size_t n, void *dst,
                           size_t cap);

/* Decodes len bytes at src into dst (n floats). Returns 0, -EINVAL
 * (fmt/block invalid, NULL src or dst where bytes or values are expected)
 * or -EBADMSG (len is not exactly peer_tensorfmt_size(fmt, block, n), or a
 * Q8 scale is negative or infinite). On failure dst is left unchanged. */
int peer_tensorfmt_decode(peer_fmt fmt, int block, const void *src, size_t len, size_t n,
                          float *dst);

/* Encoding with stochastic rounding, for gradients that cross the wire once
 * (a stage's grad_outputs and grad_inputs): Q8 codes are floor(x / scale +
 * u) with u uniform in [0, 1) drawn from (seed, index) by SplitMix64, so
 * each decoded value is an unbiased estimate of x (E = x up to 2^-24 of a
 * step), where rounding to nearest shrinks every value below half a step
 * to 0, the same way every time. Error up to one step (absmax/127) per
 * value. Same layout and decoder as peer_tensorfmt_encode; F32, F16 and
 * BF16 are encoded as there (their steps are small). Returns as
 * peer_tensorfmt_encode. Deterministic for a given seed. */
long peer_tensorfmt_encode_sr(peer_fmt fmt, int block, const float *src, size_t n, uint64_t seed, void *dst,
                              size_t cap);

/* Parses "FMT" or "q8:BLOCK" (a --wire-format value) into *fmt and *block
 * (Q8's default block when not given, 0 for the others). Returns 0, or
 * -EINVAL (unknown name, a block for another format than q8, a block that
 * is not a power of two in [16, 4096]); the outputs are then unchanged. */
int peer_tensorfmt_spec_parse(const char *spec, peer_fmt *fmt, int *block);

/* Encoding with error feedback, for gradients. x is (n,), residual is (n,)
 * and holds what earlier calls could not send (zero it before the first
 * call). Encodes v = x + residual into dst like peer_tensorfmt_encode, then
 * stores v - decode(dst) into residual.
 *
 * Why: a lossy format rounds each step's gradient on its own, and rounding
 * that leans one way (say small gradients next to one big value in a Q8
 * block, all rounded to 0) adds up to a systematic error, step after step,
 * that plain SGD never corrects. With the loss carried into the next step,
 * the decoded values summed over steps 1..T equal the true ones summed
 * minus the last residual, so the error in the sum stays within one step's
 * bound (above) instead of growing with T: compressed SGD then converges
 * like SGD with a slightly delayed gradient. For F32 the residual becomes 0.
 *
 * A residual entry whose new value would not be finite (x or the residual
 * held Inf/NaN, or an F16 value overflowed) is set to 0: what cannot be
 * represented is dropped rather than poisoning later steps (the receiver
 * sees the non-finite value in this step's tensor).
 *
 * Returns as peer_tensorfmt_encode (also -EINVAL for a NULL residual with
 * n > 0); on failure residual and dst are unchanged. x, residual and dst must
 * not overlap. */
long peer_tensorfmt_encode_ef(peer_fmt fmt, int block, const float *x, size_t n,
                              float *residual, void *dst, size_t cap);

#endif
