// cuda/attention_bf16.cu: flash-style causal multi-head self-attention for
// the bf16 backend: the four kinds of products on the tensor cores (WMMA,
// bf16 × bf16 → fp32), everything else in fp32. The contract is
// cuda_attention_forward / cuda_attention_backward's (cuda/attention.cu:
// layouts, saved = lse (B,NH,T) as the natural-log log-sum-exp of each
// row's scaled, masked scores, scratch (B,NH,T)), so the saved state of
// either path is the other's.
//
// Precision. qkv and dout stay fp32 in global memory; each tile is rounded
// to bf16 (round to nearest even) as it is copied into shared memory. The
// products S = Q·Kᵀ, O += P·V (forward), dP = dO·Vᵀ, dV += Pᵀ·dO,
// dK += dSᵀ·Q, dQ += dS·K (backward) take bf16 operands and accumulate in
// fp32; P and dS are rounded to bf16 only as operands of the products. The
// scaling, the causal mask, the online max and sum (fp32, over the
// unrounded p), lse, D_i = Σ_d dO_id·O_id and dS = P∘(dP − D) are fp32.
// D uses dout rounded to bf16 like the dP product, so that dS is the exact
// softmax backward of one upstream gradient (Σ_j dS_ij = 0 up to fp32
// rounding). Masked scores are -inf before exp2f, so they contribute
// exactly 0 (padding rows and columns past T are zero and masked too).
//
// Schedule (FlashAttention-2). Rows are cut into tiles of 64; a block of 4
// warps (128 threads) works on one (b, h) pair and one 64-row tile, each
// warp on 16 rows of it; the head dimension is padded to a bucket D of 32,
// 64 or 128 with zero columns (the padded columns are never written).
//   forward: block = (bh, query tile); loops over the key tiles 0..its own;
//            O in accumulators (registers).
//   dQ:      block = (bh, query tile); first D_i for its rows (written to
//            scratch for the next kernel), then the key tiles 0..its own.
//   dK/dV:   block = (bh, key tile); loops over the query tiles from its
//            own to the last; dK, dV in accumulators.
// A WMMA fragment's element placement is opaque, so the row-wise work
// (mask, max, exp, sum, dS) goes through shared memory: a warp stores its
// 16×64 fp32 score tile, each lane takes half a row (32 scores, in float4
// chunks interleaved with its partner lane: row stride 72 ≡ 8 mod 32 banks
// makes those reads and the stores conflict-free), and writes P (and dS) as
// bf16 into the same bytes for the next product. The forward rescales O
// (store, scale rows, load back) only when a row's running max grows by
// more than 2^8 (FA3's lazy rescaling): p is taken against a reference
// that may lag the true max by up to 8 in log2 units (p <= 256, which fp32
// and bf16 hold with the same relative precision), and lse = m + log(l)
// stays exact; after the first tiles of a row such growth is rare.
//
// Shared memory per block (bf16 tiles of 64 × (D + 8): 5, 9 or 17 KiB):
//   forward: Q, K, V tiles + 4 warps × 16 × max(72, D + 8) fp32
//            = 33 / 45 / 85 KiB for D = 32 / 64 / 128;
//   dQ, dK/dV: 4 tiles + 4 warps × 2 × 16 × 72 fp32 + 2 × 64 fp32
//            = 56.5 / 72.5 / 104.5 KiB.
// Blocks per H100 SM (228 KiB, 64 K registers; the register caps are the
// __launch_bounds__ below): forward 4 (D <= 64) or 2 (D = 128); dQ 3 or 2;
// dK/dV 3 (D = 32), 2 (D = 64, 175 registers), 2 (D = 128). A device whose
// opt-in maximum is smaller than any of the three kernels' needs for the
// bucket takes the fp32 path for forward and backward alike (a16_path
// decides both).
//
// Determinism: every output float is written by one thread after sums in a
// fixed order (the WMMA products of one warp in a fixed sequence, lane
// sums in a fixed order, then one xor-1 shuffle add, which is commutative);
// no atomics. The dQ kernel runs before the dK/dV kernel (which reads the
// D it wrote); dQ and dK/dV are separate kernels so no output is summed by
// several blocks.
//
// Other head sizes (not a multiple of 16, or over 128), grids too large, or
// devices without the shared memory: cuda_attention_forward / _backward
// (fp32), called from these functions, so the bf16 table entry always works.
#include <limits.h>
#include <math.h>
#include <stdint.h>

#include <mma.h>

#include "cuda/common.cuh"

using namespace nvcuda;

#define A16_ROWS 64     // rows of every tile (queries or keys)
#define A16_THREADS 128 // 4 warps per block, 16 rows each
#define A16_WARPS 4
#define A16_SLD 72      // row stride (floats) of a warp's 16×64 fp32 score tile
#define A16_PLD 72      // row stride (bf16) of a warp's 16×64 bf16 P / dS tile
#define A16_TAU 8.0f    // forward: rescale O when a row's max grows by more (log2 units)
#define A16_FULL 0xffffffffu

// Blocks per SM each kernel is built for (its register cap is 65536 /
// (128 · n)): what an H100's shared memory (228 KiB) holds, except dK/dV,
// whose D = 64 code needs 175 registers (2 blocks: none spilled).
#define A16_FWD_BLOCKS(D) ((D) == 128 ? 2 : 4)
#define A16_DQ_BLOCKS(D) ((D) == 128 ? 2 : 3)
#define A16_DKDV_BLOCKS(D) 2

#define A16_LOG2E 1.4426950408889634f
#define A16_LN2 0.6931471805599453f

typedef wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> a16_frag_a;
// B = Xᵀ for a tile X stored [row][d] (K in Q·Kᵀ, Q in K·Qᵀ, ...): column-major.
typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> a16_frag_bt;
// B = X itself (V in P·V, dO in Pᵀ·dO, ...): row-major.
typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::row_major> a16_frag_b;
typedef wmma::fragment<wmma::accumulator, 16, 16, 16, float> a16_frag_c;

// Sizes for bucket D. Every region below starts at a multiple of 128 bytes
// (WMMA pointers must be 32-byte aligned).
template <int D>
struct a16_cfg {
    static constexpr int LDH = D + 8;                 // bf16 tile row stride
    static constexpr int TILE = A16_ROWS * LDH;       // bf16 elements of a tile
    static constexpr int OLD = D + 8;                 // fp32 stride of a warp's 16×D staging
    static constexpr int FWD_SCR = 16 * (OLD > A16_SLD ? OLD : A16_SLD); // floats per warp
    static constexpr int BWD_SCR = 2 * 16 * A16_SLD;  // floats per warp (S and dP)
    static_assert(16 * OLD <= BWD_SCR, "the backward stages dK, dV, dQ in a warp's scratch");
    static_assert(TILE * 2 % 128 == 0 && FWD_SCR * 4 % 128 == 0 && BWD_SCR * 4 % 128 == 0,
                  "regions keep 128-byte alignment");
    static size_t fwd_smem() { return 3 * (size_t)TILE * 2 + (size_t)A16_WARPS * FWD_SCR * 4; }
    static size_t bwd_smem()
    {
        return 4 * (size_t)TILE * 2 + (size_t)A16_WARPS * BWD_SCR * 4 + 2 * A16_ROWS * 4;
    }
};

// ---- Helpers ----

// Two floats as two bf16 (round to nearest even), lo in the low half.
__device__ __forceinline__ unsigned a16_pack(float lo, float hi)
{
    return (unsigned)__bfloat16_as_ushort(__float2bfloat16_rn(lo)) |
           ((unsigned)__bfloat16_as_ushort(__float2bfloat16_rn(hi)) << 16);
}

// Rows [r0, r0 + 64) of a (T, hd) fp32 matrix whose row r starts at
// src + r·ld, rounded to bf16, into a 64 × D tile of row stride D + 8.
// Rows at or past T and columns at or past hd are zero. hd, ld and the
// head's column offset are multiples of 4, so float4 loads are aligned
// when src is 16-byte aligned (else four scalar loads).
template <int D>
__device__ __forceinline__ void a16_load_tile(__nv_bfloat16 *dst, const float *src, size_t ld,
                                              int r0, int T, int hd)
{
    const bool vec = ((uintptr_t)src & 15) == 0;
    for (int idx = threadIdx.x; idx < A16_ROWS * (D / 4); idx += A16_THREADS) {
        const int r = idx / (D / 4), c = idx % (D / 4) * 4;
        float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (r0 + r < T && c < hd) {
            const float *p = src + (size_t)(r0 + r) * ld + c;
            if (vec)
                v = *reinterpret_cast<const float4 *>(p);
            else
                v = make_float4(p[0], p[1], p[2], p[3]);
        }
        uint2 u;
        u.x = a16_pack(v.x, v.y);
        u.y = a16_pack(v.z, v.w);
        *reinterpret_cast<uint2 *>(dst + r * (D + 8) + c) = u;
    }
}

// lse and D of rows [r0, r0 + 64) into shared memory (0 past T); lse in
// log2 units (times log2 e), as the kernels' exponents are.
__device__ __forceinline__ void a16_load_rows(float *lse_s, float *dd_s, const float *lse,
                                              const float *dvec, int r0, int T)
{
    for (int r = threadIdx.x; r < A16_ROWS; r += A16_THREADS) {
        const int i = r0 + r;
        lse_s[r] = i < T ? lse[i] * A16_LOG2E : 0.0f;
        dd_s[r] = i < T ? dvec[i] : 0.0f;
    }
}

// X_w · Yᵀ for the warp's 16 rows X_w and the 64 rows of a tile ys (row
// stride D + 8), stored into the warp's 16 × A16_SLD fp32 scratch. X_w
// comes as fragments (xf, the forward's Q kept in registers) or from
// shared memory (xs, row stride D + 8).
template <int D>
__device__ __forceinline__ void a16_scores(float *scr, const a16_frag_a *xf,
                                           const __nv_bfloat16 *xs, const __nv_bfloat16 *ys)
{
    a16_frag_c acc[4];
#pragma unroll
    for (int c = 0; c < 4; c++)
        wmma::fill_fragment(acc[c], 0.0f);
#pragma unroll 1
    for (int dk = 0; dk < D / 16; dk++) {
        a16_frag_a a;
        if (!xf)
            wmma::load_matrix_sync(a, xs + 16 * dk, D + 8);
        const a16_frag_a &x = xf ? xf[dk] : a;
#pragma unroll
        for (int c = 0; c < 4; c++) {
            a16_frag_bt bt;
            wmma::load_matrix_sync(bt, ys + 16 * c * (D + 8) + 16 * dk, D + 8);
            wmma::mma_sync(acc[c], x, bt, acc[c]);
        }
    }
#pragma unroll
    for (int c = 0; c < 4; c++)
        wmma::store_matrix_sync(scr + 16 * c, acc[c], A16_SLD, wmma::mem_row_major);
}

// acc[c] += M · X for the warp's 16×64 bf16 tile M (row stride A16_PLD)
// and a 64 × D tile X (row stride D + 8).
template <int D>
__device__ __forceinline__ void a16_mul(a16_frag_c (&acc)[D / 16], const __nv_bfloat16 *m,
                                        const __nv_bfloat16 *xs)
{
#pragma unroll 1
    for (int kk = 0; kk < 4; kk++) {
        a16_frag_a a;
        wmma::load_matrix_sync(a, m + 16 * kk, A16_PLD);
#pragma unroll
        for (int c = 0; c < D / 16; c++) {
            a16_frag_b b;
            wmma::load_matrix_sync(b, xs + 16 * kk * (D + 8) + 16 * c, D + 8);
            wmma::mma_sync(acc[c], a, b, acc[c]);
        }
    }
}

// Writes the warp's 16 × D accumulators, times the lane's `mul`, to the
// global fp32 rows row0 .. row0 + 15 (row row0 + r at dst + r·ld; rows at
// or past T and columns at or past hd are skipped), staged through the
// warp's scratch. Lane: row lane/2, float4 chunks 2k + lane%2.
template <int D>
__device__ __forceinline__ void a16_write_rows(float *dst, size_t ld, int row0, int T, int hd,
                                               float *scr, const a16_frag_c (&acc)[D / 16],
                                               float mul)
{
    const int lane = threadIdx.x % 32, rl = lane >> 1, half = lane & 1;
    __syncwarp(); // the scratch's last readers are done
#pragma unroll
    for (int c = 0; c < D / 16; c++)
        wmma::store_matrix_sync(scr + 16 * c, acc[c], D + 8, wmma::mem_row_major);
    __syncwarp();
    if (row0 + rl < T) {
        float *row = dst + (size_t)rl * ld;
        const bool vec = ((uintptr_t)row & 15) == 0;
#pragma unroll
        for (int k = 0; k < D / 8; k++) {
            const int col = 8 * k + 4 * half;
            if (col < hd) {
                float4 t = *reinterpret_cast<const float4 *>(scr + rl * (D + 8) + col);
                t.x *= mul;
                t.y *= mul;
                t.z *= mul;
                t.w *= mul;
                if (vec) {
                    *reinterpret_cast<float4 *>(row + col) = t;
                } else {
                    row[col] = t.x;
                    row[col + 1] = t.y;
                    row[col + 2] = t.z;
                    row[col + 3] = t.w;
                }
            }
        }
    }
}

// ---- Forward ----

// Shared memory: Qs, Ks, Vs (bf16 tiles), then each warp's fp32 scratch
// (scores, P as bf16 in the same bytes, O staging). Grid: one block per
// (bh, query tile), blockIdx.x = bh·nt + (nt − 1 − query tile): the tiles
// with the most key tiles start first, and the blocks of one (b, h) run
// together (its K and V stay in L2).
template <int D>
static __global__ void __launch_bounds__(A16_THREADS, A16_FWD_BLOCKS(D))
a16_fwd(float *out, float *lse, const float *qkv, int T, int C, int NH, int nt, float sl2)
{
    typedef a16_cfg<D> P;
    extern __shared__ __align__(128) unsigned char a16_smem[];
    __nv_bfloat16 *Qs = reinterpret_cast<__nv_bfloat16 *>(a16_smem);
    __nv_bfloat16 *Ks = Qs + P::TILE, *Vs = Ks + P::TILE;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    float *scr = reinterpret_cast<float *>(Vs + P::TILE) + warp * P::FWD_SCR;
    __nv_bfloat16 *Pt = reinterpret_cast<__nv_bfloat16 *>(scr); // 16 × A16_PLD, over the scores

    const int hd = C / NH;
    const size_t ld = 3 * (size_t)C;
    const int bh = (int)blockIdx.x / nt, qt = nt - 1 - (int)blockIdx.x % nt;
    const int b = bh / NH, h = bh % NH;
    const int i0 = qt * A16_ROWS, w0 = i0 + 16 * warp; // the warp's first query row
    const int rl = lane >> 1, half = lane & 1, i = w0 + rl; // the lane's row (and half of it)
    const float *q = qkv + (size_t)b * T * ld + (size_t)h * hd; // row 0 of this head's q
    const float *k = q + C, *v = q + 2 * (size_t)C;

    a16_load_tile<D>(Qs, q, ld, i0, T, hd);
    __syncthreads();
    a16_frag_c o[D / 16];
#pragma unroll
    for (int c = 0; c < D / 16; c++)
        wmma::fill_fragment(o[c], 0.0f);
    // The lane's row: the reference m of its p (log2 units) and l = Σ p.
    // Both lanes of a row hold the same values, bit for bit.
    float m = -INFINITY, l = 0.0f;

    for (int kt = 0; kt <= qt; kt++) {
        const int j0 = kt * A16_ROWS;
        __syncthreads(); // the previous key tile is no longer read
        a16_load_tile<D>(Ks, k, ld, j0, T, hd);
        a16_load_tile<D>(Vs, v, ld, j0, T, hd);
        __syncthreads();
        // No row of this warp exists (all at or past T), or none sees a key
        // of this tile: the warp skips it (warp-uniform).
        if (w0 >= T || j0 > w0 + 15)
            continue;

        a16_scores<D>(scr, NULL, Qs + 16 * warp * (D + 8), Ks); // S = Q·Kᵀ
        __syncwarp();
        float x[32]; // the lane's scores, log2 units: chunk kk holds columns 8kk + 4half + e
        float mx = -INFINITY;
#pragma unroll
        for (int kk = 0; kk < 8; kk++) {
            const int col = 8 * kk + 4 * half;
            const float4 t = *reinterpret_cast<const float4 *>(scr + rl * A16_SLD + col);
            const float tv[4] = { t.x, t.y, t.z, t.w };
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int j = j0 + col + e;
                // The scale first, then the causal mask (and the columns past T).
                x[4 * kk + e] = (j <= i && j < T) ? tv[e] * sl2 : -INFINITY;
                mx = fmaxf(mx, x[4 * kk + e]);
            }
        }
        mx = fmaxf(mx, __shfl_xor_sync(A16_FULL, mx, 1));
        // Move the reference only when the max grows by more than A16_TAU
        // (always on a row's first tile: m = -inf).
        const bool grow = mx > m + A16_TAU;
        const float mref = grow ? mx : m;
        const float alpha = grow ? exp2f(m - mx) : 1.0f; // m = -inf: 0
        // A row with no unmasked score yet would keep m = -inf (none does:
        // every row sees key 0 in the first tile); exp2 against 0 then
        // gives p = 0 instead of NaN.
        const float mexp = mref == -INFINITY ? 0.0f : mref;
        const bool moved = grow && m != -INFINITY; // O holds terms against the old m
        // p = 2^(x − m): exactly 0 where masked. The sum is over the fp32
        // p; the product takes them rounded to bf16.
        float rs = 0.0f;
        unsigned pk[16];
#pragma unroll
        for (int e = 0; e < 16; e++) {
            const float p0 = exp2f(x[2 * e] - mexp), p1 = exp2f(x[2 * e + 1] - mexp);
            rs += p0;
            rs += p1;
            pk[e] = a16_pack(p0, p1);
        }
        rs += __shfl_xor_sync(A16_FULL, rs, 1);
        l = l * alpha + rs;
        m = mref;
        __syncwarp(); // every lane has read its scores
        if (__any_sync(A16_FULL, moved)) {
            // Some row of the warp moved its reference: O's rows times
            // alpha (1 for the rows that did not), through the scratch.
#pragma unroll
            for (int c = 0; c < D / 16; c++)
                wmma::store_matrix_sync(scr + 16 * c, o[c], D + 8, wmma::mem_row_major);
            __syncwarp();
#pragma unroll
            for (int kk = 0; kk < D / 8; kk++) {
                float4 *p = reinterpret_cast<float4 *>(scr + rl * (D + 8) + 8 * kk + 4 * half);
                float4 t = *p;
                t.x *= alpha;
                t.y *= alpha;
                t.z *= alpha;
                t.w *= alpha;
                *p = t;
            }
            __syncwarp();
#pragma unroll
            for (int c = 0; c < D / 16; c++)
                wmma::load_matrix_sync(o[c], scr + 16 * c, D + 8, wmma::mem_row_major);
            __syncwarp();
        }
#pragma unroll
        for (int kk = 0; kk < 8; kk++) {
            uint2 u;
            u.x = pk[2 * kk];
            u.y = pk[2 * kk + 1];
            *reinterpret_cast<uint2 *>(Pt + rl * A16_PLD + 8 * kk + 4 * half) = u;
        }
        __syncwarp();
        a16_mul<D>(o, Pt, Vs); // O += P·V
    }

    if (w0 >= T)
        return; // (warp-uniform; no barrier follows)
    float *orow0 = out + ((size_t)b * T + w0) * C + (size_t)h * hd;
    a16_write_rows<D>(orow0, (size_t)C, w0, T, hd, scr, o, 1.0f / l);
    if (i < T && half == 0)
        lse[(size_t)bh * T + i] = (m + log2f(l)) * A16_LN2;
}

// ---- Backward ----

// dQ of one query tile, and D for its rows. Shared memory: Qs, dOs, Ks, Vs
// (bf16 tiles), each warp's scratch (S and dP fp32; dS as bf16 over S),
// lse_s, dd_s (64 each). Grid as the forward's (most key tiles first).
template <int D>
static __global__ void __launch_bounds__(A16_THREADS, A16_DQ_BLOCKS(D))
a16_bwd_dq(float *dqkv, float *dvec, const float *dout, const float *out, const float *qkv,
           const float *lse, int T, int C, int NH, int nt, float scale, float sl2)
{
    typedef a16_cfg<D> P;
    extern __shared__ __align__(128) unsigned char a16_smem[];
    __nv_bfloat16 *Qs = reinterpret_cast<__nv_bfloat16 *>(a16_smem);
    __nv_bfloat16 *dOs = Qs + P::TILE, *Ks = dOs + P::TILE, *Vs = Ks + P::TILE;
    float *scr0 = reinterpret_cast<float *>(Vs + P::TILE);
    float *lse_s = scr0 + A16_WARPS * P::BWD_SCR, *dd_s = lse_s + A16_ROWS;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    float *sS = scr0 + warp * P::BWD_SCR, *sP = sS + 16 * A16_SLD;
    __nv_bfloat16 *dSb = reinterpret_cast<__nv_bfloat16 *>(sS);

    const int hd = C / NH;
    const size_t ld = 3 * (size_t)C;
    const int bh = (int)blockIdx.x / nt, qt = nt - 1 - (int)blockIdx.x % nt;
    const int b = bh / NH, h = bh % NH;
    const int i0 = qt * A16_ROWS, w0 = i0 + 16 * warp;
    const int rl = lane >> 1, half = lane & 1, r = 16 * warp + rl, i = i0 + r;
    const float *q = qkv + (size_t)b * T * ld + (size_t)h * hd;
    const float *k = q + C, *v = q + 2 * (size_t)C;
    const float *dO = dout + (size_t)b * T * C + (size_t)h * hd;

    a16_load_tile<D>(Qs, q, ld, i0, T, hd);
    a16_load_tile<D>(dOs, dO, (size_t)C, i0, T, hd);
    __syncthreads();
    // D_i = Σ_{d<hd} bf16(dout_id)·out_id: the lane's half (its float4
    // chunks in order), then its partner's. Kept for the rows of this warp
    // (dd_s), and written to dvec for the dK/dV kernel.
    {
        float sum = 0.0f;
        if (i < T) {
            const float *orow = out + ((size_t)b * T + i) * C + (size_t)h * hd;
            const __nv_bfloat16 *drow = dOs + r * (D + 8);
#pragma unroll
            for (int kk = 0; kk < D / 8; kk++) {
                const int col = 8 * kk + 4 * half;
                if (col < hd) {
#pragma unroll
                    for (int e = 0; e < 4; e++)
                        sum = fmaf(__bfloat162float(drow[col + e]), orow[col + e], sum);
                }
            }
        }
        sum += __shfl_xor_sync(A16_FULL, sum, 1);
        if (half == 0) {
            dd_s[r] = i < T ? sum : 0.0f;
            lse_s[r] = i < T ? lse[(size_t)bh * T + i] * A16_LOG2E : 0.0f;
            if (i < T)
                dvec[(size_t)bh * T + i] = sum;
        }
    }

    a16_frag_c dq[D / 16];
#pragma unroll
    for (int c = 0; c < D / 16; c++)
        wmma::fill_fragment(dq[c], 0.0f);

    for (int kt = 0; kt <= qt; kt++) {
        const int j0 = kt * A16_ROWS;
        __syncthreads(); // the previous key tile is no longer read
        a16_load_tile<D>(Ks, k, ld, j0, T, hd);
        a16_load_tile<D>(Vs, v, ld, j0, T, hd);
        __syncthreads(); // (the first time also dd_s, lse_s)
        if (w0 >= T || j0 > w0 + 15)
            continue;
        a16_scores<D>(sS, NULL, Qs + 16 * warp * (D + 8), Ks);  // S = Q·Kᵀ
        a16_scores<D>(sP, NULL, dOs + 16 * warp * (D + 8), Vs); // dP = dO·Vᵀ
        __syncwarp();
        const float lse2 = lse_s[r], dd = dd_s[r];
        unsigned pk[16];
#pragma unroll
        for (int kk = 0; kk < 8; kk++) {
            const int col = 8 * kk + 4 * half;
            const float4 ts = *reinterpret_cast<const float4 *>(sS + rl * A16_SLD + col);
            const float4 tp = *reinterpret_cast<const float4 *>(sP + rl * A16_SLD + col);
            const float sv[4] = { ts.x, ts.y, ts.z, ts.w }, pv[4] = { tp.x, tp.y, tp.z, tp.w };
            float ds[4];
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int j = j0 + col + e;
                ds[e] = 0.0f;
                if (j <= i && i < T) {
                    const float p = exp2f(sv[e] * sl2 - lse2);
                    ds[e] = p * (pv[e] - dd);
                }
            }
            pk[2 * kk] = a16_pack(ds[0], ds[1]);
            pk[2 * kk + 1] = a16_pack(ds[2], ds[3]);
        }
        __syncwarp(); // every lane has read its scores
#pragma unroll
        for (int kk = 0; kk < 8; kk++) {
            uint2 u;
            u.x = pk[2 * kk];
            u.y = pk[2 * kk + 1];
            *reinterpret_cast<uint2 *>(dSb + rl * A16_PLD + 8 * kk + 4 * half) = u;
        }
        __syncwarp();
        a16_mul<D>(dq, dSb, Ks); // dQ += dS·K
    }

    if (w0 >= T)
        return;
    a16_write_rows<D>(dqkv + ((size_t)b * T + w0) * ld + (size_t)h * hd, ld, w0, T, hd, sS, dq,
                      scale);
}

// dK and dV of one key tile. Shared memory: Ks, Vs, Qs, dOs (bf16 tiles),
// each warp's scratch (Sᵀ and dPᵀ fp32, 16 keys × 64 queries; Pᵀ and dSᵀ
// as bf16 over them), lse_s, dd_s (64 each). Grid: blockIdx.x = bh·nt +
// key tile (tile 0 has the most query tiles and starts first).
template <int D>
static __global__ void __launch_bounds__(A16_THREADS, A16_DKDV_BLOCKS(D))
a16_bwd_dkdv(float *dqkv, const float *dout, const float *qkv, const float *lse,
             const float *dvec, int T, int C, int NH, int nt, float scale, float sl2)
{
    typedef a16_cfg<D> P;
    extern __shared__ __align__(128) unsigned char a16_smem[];
    __nv_bfloat16 *Ks = reinterpret_cast<__nv_bfloat16 *>(a16_smem);
    __nv_bfloat16 *Vs = Ks + P::TILE, *Qs = Vs + P::TILE, *dOs = Qs + P::TILE;
    float *scr0 = reinterpret_cast<float *>(dOs + P::TILE);
    float *lse_s = scr0 + A16_WARPS * P::BWD_SCR, *dd_s = lse_s + A16_ROWS;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    float *sS = scr0 + warp * P::BWD_SCR, *sP = sS + 16 * A16_SLD;
    __nv_bfloat16 *Pb = reinterpret_cast<__nv_bfloat16 *>(sS);
    __nv_bfloat16 *dSb = reinterpret_cast<__nv_bfloat16 *>(sP);

    const int hd = C / NH;
    const size_t ld = 3 * (size_t)C;
    const int bh = (int)blockIdx.x / nt, kt = (int)blockIdx.x % nt;
    const int b = bh / NH, h = bh % NH;
    const int j0 = kt * A16_ROWS, w0 = j0 + 16 * warp; // the warp's first key
    const int rl = lane >> 1, half = lane & 1, j = w0 + rl; // the lane's key
    const float *q = qkv + (size_t)b * T * ld + (size_t)h * hd;
    const float *k = q + C, *v = q + 2 * (size_t)C;
    const float *dO = dout + (size_t)b * T * C + (size_t)h * hd;
    const float *lse_bh = lse + (size_t)bh * T, *dvec_bh = dvec + (size_t)bh * T;

    a16_load_tile<D>(Ks, k, ld, j0, T, hd);
    a16_load_tile<D>(Vs, v, ld, j0, T, hd);

    a16_frag_c dk[D / 16], dv[D / 16];
#pragma unroll
    for (int c = 0; c < D / 16; c++) {
        wmma::fill_fragment(dk[c], 0.0f);
        wmma::fill_fragment(dv[c], 0.0f);
    }

    // Query tiles before kt only hold queries i < j for every key here.
    for (int qt = kt; qt < nt; qt++) {
        const int i0 = qt * A16_ROWS;
        __syncthreads(); // the previous query tile is no longer read
        a16_load_tile<D>(Qs, q, ld, i0, T, hd);
        a16_load_tile<D>(dOs, dO, (size_t)C, i0, T, hd);
        a16_load_rows(lse_s, dd_s, lse_bh, dvec_bh, i0, T);
        __syncthreads(); // (the first time also Ks, Vs)
        // No key of this warp exists, or every query of the tile precedes
        // every key of the warp (warp-uniform).
        if (w0 >= T || i0 + A16_ROWS - 1 < w0)
            continue;
        a16_scores<D>(sS, NULL, Ks + 16 * warp * (D + 8), Qs);  // Sᵀ = K·Qᵀ
        a16_scores<D>(sP, NULL, Vs + 16 * warp * (D + 8), dOs); // dPᵀ = V·dOᵀ
        __syncwarp();
        unsigned pk[16], sk[16];
#pragma unroll
        for (int kk = 0; kk < 8; kk++) {
            const int col = 8 * kk + 4 * half;
            const float4 ts = *reinterpret_cast<const float4 *>(sS + rl * A16_SLD + col);
            const float4 tp = *reinterpret_cast<const float4 *>(sP + rl * A16_SLD + col);
            const float sv[4] = { ts.x, ts.y, ts.z, ts.w }, pv[4] = { tp.x, tp.y, tp.z, tp.w };
            float p[4], ds[4];
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int ii = i0 + col + e;
                p[e] = 0.0f;
                ds[e] = 0.0f;
                if (j <= ii && ii < T) {
                    p[e] = exp2f(sv[e] * sl2 - lse_s[col + e]);
                    ds[e] = p[e] * (pv[e] - dd_s[col + e]);
                }
            }
            pk[2 * kk] = a16_pack(p[0], p[1]);
            pk[2 * kk + 1] = a16_pack(p[2], p[3]);
            sk[2 * kk] = a16_pack(ds[0], ds[1]);
            sk[2 * kk + 1] = a16_pack(ds[2], ds[3]);
        }
        __syncwarp(); // every lane has read its scores
#pragma unroll
        for (int kk = 0; kk < 8; kk++) {
            uint2 u;
            u.x = pk[2 * kk];
            u.y = pk[2 * kk + 1];
            *reinterpret_cast<uint2 *>(Pb + rl * A16_PLD + 8 * kk + 4 * half) = u;
            u.x = sk[2 * kk];
            u.y = sk[2 * kk + 1];
            *reinterpret_cast<uint2 *>(dSb + rl * A16_PLD + 8 * kk + 4 * half) = u;
        }
        __syncwarp();
        a16_mul<D>(dv, Pb, dOs); // dV += Pᵀ·dO
        a16_mul<D>(dk, dSb, Qs); // dK += dSᵀ·Q
    }

    if (w0 >= T)
        return;
    float *row0 = dqkv + ((size_t)b * T + w0) * ld + (size_t)h * hd;
    a16_write_rows<D>(row0 + C, ld, w0, T, hd, sS, dk, scale);
    a16_write_rows<D>(row0 + 2 * (size_t)C, ld, w0, T, hd, sS, dv, 1.0f);
}

// ---- Host side ----

static int a16_dims_ok(int B, int T, int C, int NH)
{
    return B > 0 && T > 0 && C > 0 && NH > 0 && C % NH == 0 && C <= INT_MAX / 3;
}

// The padded head dimension for hd: 32, 64 or 128 for a multiple of 16 up
// to 128; 0 for the fp32 kernels.
static int a16_bucket(int hd)
{
    if (hd <= 0 || hd % 16 != 0 || hd > 128)
        return 0;
    return hd <= 32 ? 32 : hd <= 64 ? 64 : 128;
}

// 1 when all three kernels of bucket D get their shared memory here.
template <int D>
static int a16_ready(cuda__ctx *c)
{
    typedef a16_cfg<D> P;
    return cuda__smem_ok(c, a16_fwd<D>, P::fwd_smem()) &&
           cuda__smem_ok(c, a16_bwd_dq<D>, P::bwd_smem()) &&
           cuda__smem_ok(c, a16_bwd_dkdv<D>, P::bwd_smem());
}

// The bucket the bf16 kernels run this shape in, or 0: the fp32 kernels.
// Forward and backward both ask this, with the same answer for one shape
// on one device (hd, the grid, and every bf16 kernel's shared memory), so
// a forward and its backward take the same path. (The saved lse has one
// layout in both paths; only the rounding of the scores differs.)
static int a16_path(cuda__ctx *c, int B, int T, int C, int NH)
{
    const int D = a16_bucket(C / NH);
    const long nt = ((long)T + A16_ROWS - 1) / A16_ROWS;
    if (!D || (long)B * NH * nt > INT_MAX)
        return 0;
    switch (D) {
    case 32: return a16_ready<32>(c) ? 32 : 0;
    case 64: return a16_ready<64>(c) ? 64 : 0;
    default: return a16_ready<128>(c) ? 128 : 0;
    }
}

template <int D>
static void a16_fwd_launch(cuda__ctx *c, float *out, float *lse, const float *qkv, int B, int T,
                           int C, int NH)
{
    const int nt = (T + A16_ROWS - 1) / A16_ROWS;
    const float sl2 = (float)(1.4426950408889634 / sqrt((double)(C / NH)));
    a16_fwd<D><<<(unsigned)(B * NH * nt), A16_THREADS, a16_cfg<D>::fwd_smem(), c->stream>>>(
        out, lse, qkv, T, C, NH, nt, sl2);
}

template <int D>
static int a16_bwd_launch(cuda__ctx *c, float *dqkv, float *dvec, const float *dout,
                          const float *out, const float *qkv, const float *lse, int B, int T,
                          int C, int NH)
{
    const int hd = C / NH, nt = (T + A16_ROWS - 1) / A16_ROWS;
    const float scale = (float)(1.0 / sqrt((double)hd));
    const float sl2 = (float)(1.4426950408889634 / sqrt((double)hd));
    const unsigned grid = (unsigned)(B * NH * nt);
    const size_t smem = a16_cfg<D>::bwd_smem();
    // dQ first: it writes D (dvec), which the dK/dV kernel reads.
    a16_bwd_dq<D><<<grid, A16_THREADS, smem, c->stream>>>(dqkv, dvec, dout, out, qkv, lse, T, C,
                                                          NH, nt, scale, sl2);
    int rc = cuda__launch_status();
    if (rc)
        return rc;
    a16_bwd_dkdv<D><<<grid, A16_THREADS, smem, c->stream>>>(dqkv, dout, qkv, lse, dvec, T, C, NH,
                                                            nt, scale, sl2);
    return cuda__launch_status();
}

extern "C" int cuda_attention_forward_bf16(float *out, float *att, const float *qkv, int B, int T,
                                           int C, int NH)
{
    if (!out || !att || !qkv || !a16_dims_ok(B, T, C, NH))
        return -EINVAL;
    cuda__ctx *ctx = cuda__context();
    if (!ctx)
        return -ENODEV;
    switch (a16_path(ctx, B, T, C, NH)) {
    case 32: a16_fwd_launch<32>(ctx, out, att, qkv, B, T, C, NH); break;
    case 64: a16_fwd_launch<64>(ctx, out, att, qkv, B, T, C, NH); break;
    case 128: a16_fwd_launch<128>(ctx, out, att, qkv, B, T, C, NH); break;
    default: return cuda_attention_forward(out, att, qkv, B, T, C, NH);
    }
    return cuda__launch_status();
}

extern "C" int cuda_attention_backward_bf16(float *dqkv, float *scratch, const float *dout,
                                            const float *out, const float *qkv, const float *saved,
                                            int B, int T, int C, int NH)
{
    if (!dqkv || !scratch || !dout || !out || !qkv || !saved || !a16_dims_ok(B, T, C, NH))
        return -EINVAL;
    cuda__ctx *ctx = cuda__context();
    if (!ctx)
        return -ENODEV;
    switch (a16_path(ctx, B, T, C, NH)) {
    case 32: return a16_bwd_launch<32>(ctx, dqkv, scratch, dout, out, qkv, saved, B, T, C, NH);
    case 64: return a16_bwd_launch<64>(ctx, dqkv, scratch, dout, out, qkv, saved, B, T, C, NH);
    case 128: return a16_bwd_launch<128>(ctx, dqkv, scratch, dout, out, qkv, saved, B, T, C, NH);
    default: return cuda_attention_backward(dqkv, scratch, dout, out, qkv, saved, B, T, C, NH);
    }
}
