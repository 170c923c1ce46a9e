// cuda/attention.cu: flash-style causal multi-head self-attention in fp32
// (FlashAttention-2's schedule, scalar FMAs, no tensor cores).
//
// Layouts (hd = C/NH, ld = 3C, expert/ops.h):
//   qkv (B,T,3C): q of (b, t, head h) at qkv[(b·T + t)·ld + h·hd + d],
//                 k at + C, v at + 2C, d < hd;
//   out, dout (B,T,C): (b, t, h) at [(b·T + t)·C + h·hd + d];
//   saved (B,NH,T): lse[(b·NH + h)·T + i] = m + log(l), the natural-log
//                 log-sum-exp of row i's scaled, masked scores
//                 s_ij = scale·q_i·k_j (scale = 1/√hd, j <= i);
//   scratch (B,NH,T): D_i = Σ_d dout[i][d]·out[i][d] over the head's columns.
//
// Forward, per row i: P_ij = exp(s_ij − lse_i), out_i = Σ_j P_ij v_j.
// Backward, with dP_ij = dout_i·v_j and dS_ij = P_ij (dP_ij − D_i):
//   dq_i = scale Σ_{j<=i} dS_ij k_j,  dk_j = scale Σ_{i>=j} dS_ij q_i,
//   dv_j = Σ_{i>=j} P_ij dout_i.
// (D_i = dout_i·out_i equals Σ_j P_ij dP_ij, the softmax backward's dot.)
//
// Tiled kernels (hd <= 128). The head dimension is padded to a bucket D of
// 32, 64 or 128 with zero columns (zeros add nothing to any dot product, and
// the padded columns are never written out). Rows are cut into tiles of
// ATT_TILE = 64; a block of 256 threads works on one (b, h) pair and one
// 64-row tile. Thread (ty, tx) = (tid / 16, tid % 16) owns, in every 64×64
// score tile, the rows ty + 16a (a < 4) and the columns tx + 16b (b < 4),
// and in every 64×D result tile the rows ty + 16a and the columns tx + 16c
// (c < D/16). The 16 threads of one ty are 16 consecutive lanes of one warp,
// so a row's max and sum are butterflies over those 16 lanes.
//   forward:    block = (bh, query tile); loops over key tiles 0..its own,
//               online softmax in registers; writes out and lse.
//   dK/dV:      block = (bh, key tile); loops over query tiles from its own
//               to the last; keeps dk, dv in registers.
//   dQ:         block = (bh, query tile); loops over key tiles 0..its own;
//               keeps dq in registers.
// Operand tiles sit in shared memory with row stride D + 1 and score tiles
// with row stride 65, so the reads of the inner loops hit distinct banks or
// broadcast. No T×T matrix is ever stored in global memory.
//
// Fallback (hd > 128, or a device without the shared memory the tiled
// kernels ask for): one warp per (b, h, row); slow, simple, any hd.
//
// Determinism: every output float is written by exactly one thread, which
// sums its terms in a fixed order (the d, j or i loops below); reductions
// across threads are warp butterflies in a fixed pattern. No atomics, so
// the results are bit for bit the same on every run of one configuration.
#include <limits.h>
#include <math.h>

#include "cuda/common.cuh"

#define ATT_TILE 64      // rows of every tile (queries or keys)
#define ATT_THREADS 256  // 16 × 16 threads per block
#define ATT_SLD 65       // row stride of a 64×64 score tile in shared memory

// ---- Helpers of the tiled kernels ----

// Loads rows [r0, r0 + 64) of a (T, hd) matrix whose row r starts at
// src + r·ld into a 64 × D shared tile of row stride D + 1. Rows at or past
// T and columns at or past hd are zero.
template <int D>
__device__ __forceinline__ void att_load_tile(float *dst, const float *src, size_t ld, int r0,
                                              int T, int hd)
{
    for (int idx = threadIdx.x; idx < ATT_TILE * D; idx += ATT_THREADS) {
        int r = idx / D, d = idx % D;
        float v = 0.0f;
        if (r0 + r < T && d < hd)
            v = src[(size_t)(r0 + r) * ld + d];
        dst[r * (D + 1) + d] = v;
    }
}

// acc[a][b] = Σ_{d<D} A[ty + 16a][d] · Bm[tx + 16b][d], for two 64 × D
// shared tiles of row stride D + 1 (d in increasing order).
template <int D>
__device__ __forceinline__ void att_tile_dot(float (&acc)[4][4], const float *A, const float *Bm,
                                             int ty, int tx)
{
#pragma unroll
    for (int a = 0; a < 4; a++)
#pragma unroll
        for (int b = 0; b < 4; b++)
            acc[a][b] = 0.0f;
#pragma unroll 4
    for (int d = 0; d < D; d++) {
        float x[4], y[4];
#pragma unroll
        for (int a = 0; a < 4; a++)
            x[a] = A[(ty + 16 * a) * (D + 1) + d];
#pragma unroll
        for (int b = 0; b < 4; b++)
            y[b] = Bm[(tx + 16 * b) * (D + 1) + d];
#pragma unroll
        for (int a = 0; a < 4; a++)
#pragma unroll
            for (int b = 0; b < 4; b++)
                acc[a][b] = fmaf(x[a], y[b], acc[a][b]);
    }
}

// acc[a][c] += Σ_{j<64} M[ty + 16a][j] · X[j][tx + 16c], for M a 64×64
// score tile (row stride ATT_SLD) and X a 64 × D tile (row stride D + 1),
// j in increasing order.
template <int D>
__device__ __forceinline__ void att_tile_mul(float (&acc)[4][D / 16], const float *M,
                                             const float *X, int ty, int tx)
{
#pragma unroll 4
    for (int j = 0; j < ATT_TILE; j++) {
        float p[4], x[D / 16];
#pragma unroll
        for (int a = 0; a < 4; a++)
            p[a] = M[(ty + 16 * a) * ATT_SLD + j];
#pragma unroll
        for (int c = 0; c < D / 16; c++)
            x[c] = X[j * (D + 1) + tx + 16 * c];
#pragma unroll
        for (int a = 0; a < 4; a++)
#pragma unroll
            for (int c = 0; c < D / 16; c++)
                acc[a][c] = fmaf(p[a], x[c], acc[a][c]);
    }
}

// Max and sum over the 16 threads of a row group (lanes 0-15 or 16-31 of a
// warp: the xor offsets stay below 16). Every lane of the group gets the
// same result, bit for bit (each step combines two equal partial results).
__device__ __forceinline__ float att_group_max(float v)
{
    for (int o = 8; o > 0; o >>= 1)
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ __forceinline__ float att_group_sum(float v)
{
    for (int o = 8; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// ---- Tiled forward ----

// Shared memory: Qs, Ks, Vs (64 × (D+1) each), Ps (64 × ATT_SLD).
// Grid: x = b·NH + h, y = query tile counted from the last (the causal
// tiles near the end of the sequence have the most key tiles, so they are
// started first).
template <int D>
static __global__ void __launch_bounds__(ATT_THREADS)
att_fwd_tiled(float *out, float *lse, const float *qkv, int T, int C, int NH, float scale)
{
    extern __shared__ float smem[];
    float *Qs = smem;
    float *Ks = Qs + ATT_TILE * (D + 1);
    float *Vs = Ks + ATT_TILE * (D + 1);
    float *Ps = Vs + ATT_TILE * (D + 1);

    const int hd = C / NH;
    const size_t ld = 3 * (size_t)C;
    const int bh = blockIdx.x, b = bh / NH, h = bh % NH;
    const int qt = (int)gridDim.y - 1 - (int)blockIdx.y;
    const int i0 = qt * ATT_TILE;
    const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
    const float *q = qkv + (size_t)b * T * ld + (size_t)h * hd; // row 0 of this head's q
    const float *k = q + C, *v = q + 2 * (size_t)C;

    att_load_tile<D>(Qs, q, ld, i0, T, hd);

    float m[4], l[4], o[4][D / 16];
#pragma unroll
    for (int a = 0; a < 4; a++) {
        m[a] = -INFINITY;
        l[a] = 0.0f;
#pragma unroll
        for (int c = 0; c < D / 16; c++)
            o[a][c] = 0.0f;
    }

    for (int kt = 0; kt <= qt; kt++) {
        const int j0 = kt * ATT_TILE;
        __syncthreads(); // the previous key tile's Ks, Vs, Ps are no longer read
        att_load_tile<D>(Ks, k, ld, j0, T, hd);
        att_load_tile<D>(Vs, v, ld, j0, T, hd);
        __syncthreads(); // Ks, Vs (and on the first pass Qs) are in place

        float s[4][4];
        att_tile_dot<D>(s, Qs, Ks, ty, tx); // s[a][b]: query i0+ty+16a, key j0+tx+16b
#pragma unroll
        for (int a = 0; a < 4; a++) {
            const int i = i0 + ty + 16 * a;
            float mx = -INFINITY;
#pragma unroll
            for (int b = 0; b < 4; b++) {
                const int j = j0 + tx + 16 * b;
                // The scale comes first, then the causal mask (and the
                // zero rows past T, which no valid row reaches anyway).
                s[a][b] = (j <= i && j < T) ? s[a][b] * scale : -INFINITY;
                mx = fmaxf(mx, s[a][b]);
            }
            mx = att_group_max(mx);
            const float m_new = fmaxf(m[a], mx);
            // A row with no unmasked score yet keeps m = -inf; exp against 0
            // then gives alpha = 0 and p = 0 instead of NaN. (A row i < T
            // always has j = 0 unmasked in the first key tile.)
            const float mref = m_new == -INFINITY ? 0.0f : m_new;
            const float alpha = expf(m[a] - mref);
            float rs = 0.0f;
#pragma unroll
            for (int b = 0; b < 4; b++) {
                const float p = expf(s[a][b] - mref); // exactly 0 where masked
                Ps[(ty + 16 * a) * ATT_SLD + tx + 16 * b] = p;
                rs += p;
            }
            rs = att_group_sum(rs);
            l[a] = l[a] * alpha + rs;
            m[a] = m_new;
#pragma unroll
            for (int c = 0; c < D / 16; c++)
                o[a][c] *= alpha;
        }
        __syncthreads(); // Ps is complete
        att_tile_mul<D>(o, Ps, Vs, ty, tx);
    }

#pragma unroll
    for (int a = 0; a < 4; a++) {
        const int i = i0 + ty + 16 * a;
        if (i >= T)
            continue;
        const float inv = 1.0f / l[a];
        float *orow = out + ((size_t)b * T + i) * C + (size_t)h * hd;
#pragma unroll
        for (int c = 0; c < D / 16; c++) {
            const int d = tx + 16 * c;
            if (d < hd)
                orow[d] = o[a][c] * inv;
        }
        if (tx == 0)
            lse[(size_t)bh * T + i] = m[a] + logf(l[a]);
    }
}

// ---- Tiled backward ----

// dK and dV of one key tile. Shared memory: Ks, Vs, Qs, dOs (64 × (D+1)
// each), Ps, dSs (64 × ATT_SLD each, indexed [key][query]), lse_s, dvec_s
// (64 each). Grid: x = b·NH + h, y = key tile (tile 0 has the most query
// tiles to visit and is started first).
template <int D>
static __global__ void __launch_bounds__(ATT_THREADS)
att_bwd_dkdv_tiled(float *dqkv, const float *dout, const float *qkv, const float *lse,
                   const float *dvec, int T, int C, int NH, float scale)
{
    extern __shared__ float smem[];
    float *Ks = smem;
    float *Vs = Ks + ATT_TILE * (D + 1);
    float *Qs = Vs + ATT_TILE * (D + 1);
    float *dOs = Qs + ATT_TILE * (D + 1);
    float *Ps = dOs + ATT_TILE * (D + 1);
    float *dSs = Ps + ATT_TILE * ATT_SLD;
    float *lse_s = dSs + ATT_TILE * ATT_SLD;
    float *dvec_s = lse_s + ATT_TILE;

    const int hd = C / NH;
    const size_t ld = 3 * (size_t)C;
    const int bh = blockIdx.x, b = bh / NH, h = bh % NH;
    const int nt = (int)gridDim.y;
    const int kt = (int)blockIdx.y;
    const int j0 = kt * ATT_TILE;
    const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
    const float *q = qkv + (size_t)b * T * ld + (size_t)h * hd;
    const float *k = q + C, *v = q + 2 * (size_t)C;
    const float *dO = dout + (size_t)b * T * C + (size_t)h * hd;
    const float *lse_bh = lse + (size_t)bh * T, *dvec_bh = dvec + (size_t)bh * T;

    att_load_tile<D>(Ks, k, ld, j0, T, hd);
    att_load_tile<D>(Vs, v, ld, j0, T, hd);

    // dk, dv: key rows j0 + ty + 16a, columns tx + 16c.
    float dk[4][D / 16], dv[4][D / 16];
#pragma unroll
    for (int a = 0; a < 4; a++)
#pragma unroll
        for (int c = 0; c < D / 16; c++) {
            dk[a][c] = 0.0f;
            dv[a][c] = 0.0f;
        }

    // Query tiles before kt are all masked for these keys (i < j).
    for (int qt = kt; qt < nt; qt++) {
        const int i0 = qt * ATT_TILE;
        __syncthreads(); // the previous query tile's Qs, dOs, Ps, dSs are no longer read
        att_load_tile<D>(Qs, q, ld, i0, T, hd);
        att_load_tile<D>(dOs, dO, (size_t)C, i0, T, hd);
        for (int r = threadIdx.x; r < ATT_TILE; r += ATT_THREADS) {
            const int i = i0 + r;
            lse_s[r] = i < T ? lse_bh[i] : 0.0f;
            dvec_s[r] = i < T ? dvec_bh[i] : 0.0f;
        }
        __syncthreads(); // this query tile (and on the first pass Ks, Vs) is in place

        // Transposed score tile: [a][b] is key j0+ty+16a, query i0+tx+16b.
        float s[4][4], dp[4][4];
        att_tile_dot<D>(s, Ks, Qs, ty, tx);
        att_tile_dot<D>(dp, Vs, dOs, ty, tx);
#pragma unroll
        for (int a = 0; a < 4; a++)
#pragma unroll
            for (int b = 0; b < 4; b++) {
                const int j = j0 + ty + 16 * a, i = i0 + tx + 16 * b;
                float p = 0.0f, ds = 0.0f;
                if (j <= i && i < T) {
                    p = expf(s[a][b] * scale - lse_s[tx + 16 * b]);
                    ds = p * (dp[a][b] - dvec_s[tx + 16 * b]);
                }
                Ps[(ty + 16 * a) * ATT_SLD + tx + 16 * b] = p;
                dSs[(ty + 16 * a) * ATT_SLD + tx + 16 * b] = ds;
            }
        __syncthreads(); // Ps, dSs are complete
        att_tile_mul<D>(dv, Ps, dOs, ty, tx);  // dv_j += Σ_i P_ij dout_i
        att_tile_mul<D>(dk, dSs, Qs, ty, tx);  // dk_j += Σ_i dS_ij q_i
    }

#pragma unroll
    for (int a = 0; a < 4; a++) {
        const int j = j0 + ty + 16 * a;
        if (j >= T)
            continue;
        float *row = dqkv + ((size_t)b * T + j) * ld + (size_t)h * hd;
#pragma unroll
        for (int c = 0; c < D / 16; c++) {
            const int d = tx + 16 * c;
            if (d < hd) {
                row[C + d] = dk[a][c] * scale;
                row[2 * (size_t)C + d] = dv[a][c];
            }
        }
    }
}

// dQ of one query tile. Shared memory: Qs, dOs, Ks, Vs (64 × (D+1) each),
// dSs (64 × ATT_SLD, indexed [query][key]), lse_s, dvec_s (64 each).
// Grid: x = b·NH + h, y = query tile counted from the last (most work first).
template <int D>
static __global__ void __launch_bounds__(ATT_THREADS)
att_bwd_dq_tiled(float *dqkv, const float *dout, const float *qkv, const float *lse,
                 const float *dvec, int T, int C, int NH, float scale)
{
    extern __shared__ float smem[];
    float *Qs = smem;
    float *dOs = Qs + ATT_TILE * (D + 1);
    float *Ks = dOs + ATT_TILE * (D + 1);
    float *Vs = Ks + ATT_TILE * (D + 1);
    float *dSs = Vs + ATT_TILE * (D + 1);
    float *lse_s = dSs + ATT_TILE * ATT_SLD;
    float *dvec_s = lse_s + ATT_TILE;

    const int hd = C / NH;
    const size_t ld = 3 * (size_t)C;
    const int bh = blockIdx.x, b = bh / NH, h = bh % NH;
    const int qt = (int)gridDim.y - 1 - (int)blockIdx.y;
    const int i0 = qt * ATT_TILE;
    const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
    const float *q = qkv + (size_t)b * T * ld + (size_t)h * hd;
    const float *k = q + C, *v = q + 2 * (size_t)C;
    const float *dO = dout + (size_t)b * T * C + (size_t)h * hd;
    const float *lse_bh = lse + (size_t)bh * T, *dvec_bh = dvec + (size_t)bh * T;

    att_load_tile<D>(Qs, q, ld, i0, T, hd);
    att_load_tile<D>(dOs, dO, (size_t)C, i0, T, hd);
    for (int r = threadIdx.x; r < ATT_TILE; r += ATT_THREADS) {
        const int i = i0 + r;
        lse_s[r] = i < T ? lse_bh[i] : 0.0f;
        dvec_s[r] = i < T ? dvec_bh[i] : 0.0f;
    }

    // dq: query rows i0 + ty + 16a, columns tx + 16c.
    float dq[4][D / 16];
#pragma unroll
    for (int a = 0; a < 4; a++)
#pragma unroll
        for (int c = 0; c < D / 16; c++)
            dq[a][c] = 0.0f;

    for (int kt = 0; kt <= qt; kt++) {
        const int j0 = kt * ATT_TILE;
        __syncthreads(); // the previous key tile's Ks, Vs, dSs are no longer read
        att_load_tile<D>(Ks, k, ld, j0, T, hd);
        att_load_tile<D>(Vs, v, ld, j0, T, hd);
        __syncthreads(); // Ks, Vs (and on the first pass Qs, dOs, lse_s, dvec_s) are in place

        // [a][b] is query i0+ty+16a, key j0+tx+16b.
        float s[4][4], dp[4][4];
        att_tile_dot<D>(s, Qs, Ks, ty, tx);
        att_tile_dot<D>(dp, dOs, Vs, ty, tx);
#pragma unroll
        for (int a = 0; a < 4; a++)
#pragma unroll
            for (int b = 0; b < 4; b++) {
                const int i = i0 + ty + 16 * a, j = j0 + tx + 16 * b;
                float ds = 0.0f;
                if (j <= i && i < T) {
                    const float p = expf(s[a][b] * scale - lse_s[ty + 16 * a]);
                    ds = p * (dp[a][b] - dvec_s[ty + 16 * a]);
                }
                dSs[(ty + 16 * a) * ATT_SLD + tx + 16 * b] = ds;
            }
        __syncthreads(); // dSs is complete
        att_tile_mul<D>(dq, dSs, Ks, ty, tx); // dq_i += Σ_j dS_ij k_j
    }

#pragma unroll
    for (int a = 0; a < 4; a++) {
        const int i = i0 + ty + 16 * a;
        if (i >= T)
            continue;
        float *row = dqkv + ((size_t)b * T + i) * ld + (size_t)h * hd;
#pragma unroll
        for (int c = 0; c < D / 16; c++) {
            const int d = tx + 16 * c;
            if (d < hd)
                row[d] = dq[a][c] * scale;
        }
    }
}

// ---- The backward's row dots (both paths) ----

// dvec[(b·NH + h)·T + i] = Σ_{d<hd} dout[b][i][h·hd + d] · out[b][i][h·hd + d]:
// one warp per (b, h, i) (a loop, so any size fits the grid).
static __global__ void att_bwd_rowdot(float *dvec, const float *dout, const float *out, int B,
                                      int T, int C, int NH)
{
    const int hd = C / NH;
    const int lane = threadIdx.x % 32, warps = blockDim.x / 32;
    const long rows = (long)B * NH * T;
    for (long r = blockIdx.x * (long)warps + threadIdx.x / 32; r < rows;
         r += (long)gridDim.x * warps) {
        const long bh = r / T;
        const int i = (int)(r % T), h = (int)(bh % NH);
        const long b = bh / NH;
        const size_t off = ((size_t)b * T + i) * C + (size_t)h * hd;
        float s = 0.0f;
        for (int d = lane; d < hd; d += 32)
            s = fmaf(dout[off + d], out[off + d], s);
        s = cuda__warp_sum(s);
        if (lane == 0)
            dvec[r] = s;
    }
}

// ---- Fallback: one warp per (b, h, row) ----

#define FB_WARPS 4  // warps (rows) per block
#define FB_COLS 4   // columns per lane per pass: a pass covers 128 columns

// Σ_{d<hd} x[d]·y[d]: lane takes d = lane, lane + 32, ...; the butterfly
// gives every lane the same sum. The whole warp must call it.
__device__ __forceinline__ float att_warp_dot(const float *x, const float *y, int hd, int lane)
{
    float s = 0.0f;
    for (int d = lane; d < hd; d += 32)
        s = fmaf(x[d], y[d], s);
    return cuda__warp_sum(s);
}

// Forward of row r = (b·NH + h)·T + i. Pass 1: lse_i by the online max/sum
// over j <= i. Pass 2, per block of 128 columns: out_i = Σ_j exp(s_ij −
// lse_i) v_j, recomputing the scores. The loops are uniform across the
// warp (they depend on r alone), so every lane reaches every shuffle.
static __global__ void att_fwd_rowwise(float *out, float *lse, const float *qkv, int B, int T,
                                       int C, int NH, float scale)
{
    const int hd = C / NH;
    const size_t ld = 3 * (size_t)C;
    const int lane = threadIdx.x % 32;
    const long rows = (long)B * NH * T;
    for (long r = blockIdx.x * (long)FB_WARPS + threadIdx.x / 32; r < rows;
         r += (long)gridDim.x * FB_WARPS) {
        const long bh = r / T;
        const int i = (int)(r % T), h = (int)(bh % NH);
        const long b = bh / NH;
        const float *q = qkv + (size_t)b * T * ld + (size_t)h * hd; // row 0 of this head's q
        const float *k = q + C, *v = q + 2 * (size_t)C;
        const float *qi = q + (size_t)i * ld;

        float m = -INFINITY, l = 0.0f;
        for (int j = 0; j <= i; j++) {
            const float s = att_warp_dot(qi, k + (size_t)j * ld, hd, lane) * scale;
            const float m_new = fmaxf(m, s);
            l = l * expf(m - m_new) + expf(s - m_new); // first j: 0·0 + 1
            m = m_new;
        }
        const float L = m + logf(l);

        float *o = out + ((size_t)b * T + i) * C + (size_t)h * hd;
        for (int c0 = 0; c0 < hd; c0 += 32 * FB_COLS) {
            float acc[FB_COLS];
#pragma unroll
            for (int u = 0; u < FB_COLS; u++)
                acc[u] = 0.0f;
            for (int j = 0; j <= i; j++) {
                const float p =
                    expf(att_warp_dot(qi, k + (size_t)j * ld, hd, lane) * scale - L);
                const float *vj = v + (size_t)j * ld;
#pragma unroll
                for (int u = 0; u < FB_COLS; u++) {
                    const int d = c0 + lane + 32 * u;
                    if (d < hd)
                        acc[u] = fmaf(p, vj[d], acc[u]);
                }
            }
#pragma unroll
            for (int u = 0; u < FB_COLS; u++) {
                const int d = c0 + lane + 32 * u;
                if (d < hd)
                    o[d] = acc[u];
            }
        }
        if (lane == 0)
            lse[r] = L;
    }
}

// Backward of row r = (b·NH + h)·T + t: the warp writes dq of row t
// (Σ over keys j <= t) and dk, dv of row t (Σ over queries i >= t), each in
// passes of 128 columns that recompute P and dS.
static __global__ void att_bwd_rowwise(float *dqkv, const float *dout, const float *qkv,
                                       const float *lse, const float *dvec, int B, int T, int C,
                                       int NH, float scale)
{
    const int hd = C / NH;
    const size_t ld = 3 * (size_t)C;
    const int lane = threadIdx.x % 32;
    const long rows = (long)B * NH * T;
    for (long r = blockIdx.x * (long)FB_WARPS + threadIdx.x / 32; r < rows;
         r += (long)gridDim.x * FB_WARPS) {
        const long bh = r / T;
        const int t = (int)(r % T), h = (int)(bh % NH);
        const long b = bh / NH;
        const float *q = qkv + (size_t)b * T * ld + (size_t)h * hd;
        const float *k = q + C, *v = q + 2 * (size_t)C;
        const float *dO = dout + (size_t)b * T * C + (size_t)h * hd;
        const float *lse_bh = lse + (size_t)bh * T, *dvec_bh = dvec + (size_t)bh * T;
        const float *qt = q + (size_t)t * ld, *kt = k + (size_t)t * ld, *vt = v + (size_t)t * ld;
        const float *dOt = dO + (size_t)t * C;
        float *dq = dqkv + ((size_t)b * T + t) * ld + (size_t)h * hd;
        float *dk = dq + C, *dv = dq + 2 * (size_t)C;

        // dq_t = scale Σ_{j<=t} dS_tj k_j.
        for (int c0 = 0; c0 < hd; c0 += 32 * FB_COLS) {
            float acc[FB_COLS];
#pragma unroll
            for (int u = 0; u < FB_COLS; u++)
                acc[u] = 0.0f;
            for (int j = 0; j <= t; j++) {
                const float *kj = k + (size_t)j * ld;
                const float p = expf(att_warp_dot(qt, kj, hd, lane) * scale - lse_bh[t]);
                const float dp = att_warp_dot(dOt, v + (size_t)j * ld, hd, lane);
                const float ds = p * (dp - dvec_bh[t]);
#pragma unroll
                for (int u = 0; u < FB_COLS; u++) {
                    const int d = c0 + lane + 32 * u;
                    if (d < hd)
                        acc[u] = fmaf(ds, kj[d], acc[u]);
                }
            }
#pragma unroll
            for (int u = 0; u < FB_COLS; u++) {
                const int d = c0 + lane + 32 * u;
                if (d < hd)
                    dq[d] = acc[u] * scale;
            }
        }

        // dk_t = scale Σ_{i>=t} dS_it q_i, dv_t = Σ_{i>=t} P_it dout_i.
        for (int c0 = 0; c0 < hd; c0 += 32 * FB_COLS) {
            float acck[FB_COLS], accv[FB_COLS];
#pragma unroll
            for (int u = 0; u < FB_COLS; u++) {
                acck[u] = 0.0f;
                accv[u] = 0.0f;
            }
            for (int i = t; i < T; i++) {
                const float *qi = q + (size_t)i * ld, *dOi = dO + (size_t)i * C;
                const float p = expf(att_warp_dot(qi, kt, hd, lane) * scale - lse_bh[i]);
                const float dp = att_warp_dot(dOi, vt, hd, lane);
                const float ds = p * (dp - dvec_bh[i]);
#pragma unroll
                for (int u = 0; u < FB_COLS; u++) {
                    const int d = c0 + lane + 32 * u;
                    if (d < hd) {
                        acck[u] = fmaf(ds, qi[d], acck[u]);
                        accv[u] = fmaf(p, dOi[d], accv[u]);
                    }
                }
            }
#pragma unroll
            for (int u = 0; u < FB_COLS; u++) {
                const int d = c0 + lane + 32 * u;
                if (d < hd) {
                    dk[d] = acck[u] * scale;
                    dv[d] = accv[u];
                }
            }
        }
    }
}

// ---- Host side ----

static int att_dims_ok(int B, int T, int C, int NH)
{
    return B > 0 && T > 0 && C > 0 && NH > 0 && C % NH == 0 && C <= INT_MAX / 3;
}

// The tiled kernels' padded head dimension for hd: 32, 64 or 128; 0 when
// hd needs the fallback.
static int att_bucket(int hd)
{
    return hd <= 32 ? 32 : hd <= 64 ? 64 : hd <= 128 ? 128 : 0;
}

// 1 when the tiled kernels' grid (x = B·NH, y = the tiles of T) fits.
static int att_grid_ok(int B, int T, int NH)
{
    long tiles = ((long)T + ATT_TILE - 1) / ATT_TILE;
    return (long)B * NH <= INT_MAX && tiles <= 65535;
}

static size_t att_fwd_smem(int D)
{
    return (3 * (size_t)ATT_TILE * (D + 1) + (size_t)ATT_TILE * ATT_SLD) * sizeof(float);
}

static size_t att_dkdv_smem(int D)
{
    return (4 * (size_t)ATT_TILE * (D + 1) + 2 * (size_t)ATT_TILE * ATT_SLD + 2 * ATT_TILE) *
           sizeof(float);
}

static size_t att_dq_smem(int D)
{
    return (4 * (size_t)ATT_TILE * (D + 1) + (size_t)ATT_TILE * ATT_SLD + 2 * ATT_TILE) *
           sizeof(float);
}

// Queues the tiled forward for bucket D; 0 (nothing queued) when the
// device lacks its shared memory.
template <int D>
static int att_fwd_tiled_launch(cuda__ctx *c, float *out, float *lse, const float *qkv, int B,
                                int T, int C, int NH, float scale)
{
    size_t smem = att_fwd_smem(D);
    if (!cuda__smem_ok(c, att_fwd_tiled<D>, smem))
        return 0;
    dim3 grid((unsigned)(B * NH), (unsigned)((T + ATT_TILE - 1) / ATT_TILE));
    att_fwd_tiled<D><<<grid, ATT_THREADS, smem, c->stream>>>(out, lse, qkv, T, C, NH, scale);
    return 1;
}

// Queues the tiled dK/dV and dQ kernels for bucket D; 0 (nothing queued)
// when the device lacks the shared memory of either.
template <int D>
static int att_bwd_tiled_launch(cuda__ctx *c, float *dqkv, const float *dout, const float *qkv,
                                const float *lse, const float *dvec, int B, int T, int C, int NH,
                                float scale)
{
    size_t s1 = att_dkdv_smem(D), s2 = att_dq_smem(D);
    if (!cuda__smem_ok(c, att_bwd_dkdv_tiled<D>, s1) || !cuda__smem_ok(c, att_bwd_dq_tiled<D>, s2))
        return 0;
    dim3 grid((unsigned)(B * NH), (unsigned)((T + ATT_TILE - 1) / ATT_TILE));
    att_bwd_dkdv_tiled<D><<<grid, ATT_THREADS, s1, c->stream>>>(dqkv, dout, qkv, lse, dvec, T, C,
                                                                NH, scale);
    att_bwd_dq_tiled<D><<<grid, ATT_THREADS, s2, c->stream>>>(dqkv, dout, qkv, lse, dvec, T, C,
                                                              NH, scale);
    return 1;
}

extern "C" int cuda_attention_forward(float *out, float *att, const float *qkv, int B, int T,
                                      int C, int NH)
{
    if (!out || !att || !qkv || !att_dims_ok(B, T, C, NH))
        return -EINVAL;
    cuda__ctx *ctx = cuda__context();
    if (!ctx)
        return -ENODEV;
    const int hd = C / NH;
    const float scale = (float)(1.0 / sqrt((double)hd));
    float *lse = att;
    int launched = 0;
    if (att_grid_ok(B, T, NH)) {
        switch (att_bucket(hd)) {
        case 32:
            launched = att_fwd_tiled_launch<32>(ctx, out, lse, qkv, B, T, C, NH, scale);
            break;
        case 64:
            launched = att_fwd_tiled_launch<64>(ctx, out, lse, qkv, B, T, C, NH, scale);
            break;
        case 128:
            launched = att_fwd_tiled_launch<128>(ctx, out, lse, qkv, B, T, C, NH, scale);
            break;
        default:
            break;
        }
    }
    if (!launched) {
        long rows = (long)B * NH * T;
        att_fwd_rowwise<<<cuda__blocks(rows, FB_WARPS), FB_WARPS * 32, 0, ctx->stream>>>(
            out, lse, qkv, B, T, C, NH, scale);
    }
    return cuda__launch_status();
}

extern "C" int cuda_attention_backward(float *dqkv, float *scratch, const float *dout,
                                       const float *out, const float *qkv, const float *saved,
                                       int B, int T, int C, int NH)
{
    if (!dqkv || !scratch || !dout || !out || !qkv || !saved || !att_dims_ok(B, T, C, NH))
        return -EINVAL;
    cuda__ctx *ctx = cuda__context();
    if (!ctx)
        return -ENODEV;
    const int hd = C / NH;
    const float scale = (float)(1.0 / sqrt((double)hd));
    const float *lse = saved;
    float *dvec = scratch;
    const long rows = (long)B * NH * T;

    att_bwd_rowdot<<<cuda__blocks(rows, 8), 256, 0, ctx->stream>>>(dvec, dout, out, B, T, C, NH);
    int rc = cuda__launch_status();
    if (rc)
        return rc;

    int launched = 0;
    if (att_grid_ok(B, T, NH)) {
        switch (att_bucket(hd)) {
        case 32:
            launched = att_bwd_tiled_launch<32>(ctx, dqkv, dout, qkv, lse, dvec, B, T, C, NH, scale);
            break;
        case 64:
            launched = att_bwd_tiled_launch<64>(ctx, dqkv, dout, qkv, lse, dvec, B, T, C, NH, scale);
            break;
        case 128:
            launched = att_bwd_tiled_launch<128>(ctx, dqkv, dout, qkv, lse, dvec, B, T, C, NH, scale);
            break;
        default:
            break;
        }
    }
    if (!launched)
        att_bwd_rowwise<<<cuda__blocks(rows, FB_WARPS), FB_WARPS * 32, 0, ctx->stream>>>(
            dqkv, dout, qkv, lse, dvec, B, T, C, NH, scale);
    return cuda__launch_status();
}

extern "C" void cuda_attention_sizes(int T, int NH, size_t *saved_out, size_t *scratch_out)
{
    size_t n = (size_t)(NH > 0 ? NH : 0) * (size_t)(T > 0 ? T : 0);
    if (saved_out)
        *saved_out = n;
    if (scratch_out)
        *scratch_out = n;
}
