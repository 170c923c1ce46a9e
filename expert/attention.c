/* expert/attention.c: causal multi-head self-attention over a fused qkv, as
 * ../shared/bench/torch/train_lm.py's CausalSelfAttention computes it
 * between its two Linears: per head, att = softmax(q·kᵀ/√hd + M), out = att·v.
 *
 * Per (batch, head) pair the four products run as cblas_sgemm calls straight
 * on the strided views (q, k, v: row stride 3C; out: C), no copies. The T×T
 * matrix is cut into square tiles of tb rows; only tiles on or below the
 * diagonal are computed, so the causal half above it costs nothing (the
 * diagonal tiles compute their upper halves and the row pass overwrites
 * them). Scale, causal mask and softmax are one pass per row over j <= i;
 * in the backward the softmax backward and the scale are one pass too.
 *
 * Threads: the pairs are independent, so expert__parallel splits them into
 * parts and every part runs its GEMMs single-threaded. OpenBLAS (pthreads
 * build) runs a GEMM on one thread when M·N·K <= 65536·4; above that it
 * would start its own threads from every part at once, and its level-3
 * driver serialises concurrent threaded calls. So every GEMM here is kept
 * at or under that size: square tiles tb·tb·hd <= ATT_MNK, and the
 * per-tile-row GEMMs over [0, i1) are cut into chunks of that size. With
 * one BLAS thread the size cap is lifted (fewer, larger calls).
 *
 * Shapes (hd = C/NH, ld = 3C):
 *   q, k, v of pair (b,h): qkv + b·T·3C + h·hd (+ C, + 2C), (T, hd) stride ld
 *   att, scratch of pair (b,h): + (b·NH + h)·T·T, (T, T) contiguous
 *   out of pair (b,h): out + b·T·C + h·hd, (T, hd) stride C
 */
#include "expert/ops.h"
#include "expert/blas.h"
#include "expert/pool.h"
#include "expert/simd.h"

#include <cblas.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <string.h>

/* The largest GEMM (M·N·K) OpenBLAS runs single-threaded:
 * SMP_THRESHOLD_MIN (65536) × GEMM_MULTITHREAD_THRESHOLD (4, the default).
 * A build with another threshold is only slower, never wrong. */
#define ATT_MNK 262144L

struct att_plan {
    int T, C, NH, hd, tb;
    long mnk;    /* cap on one GEMM's M·N·K; LONG_MAX = none */
    float scale; /* 1/√hd */
};

static void att_plan_init(struct att_plan *p, int T, int C, int NH)
{
    p->T = T;
    p->C = C;
    p->NH = NH;
    p->hd = C / NH;
    p->scale = (float)(1.0 / sqrt((double)p->hd));
    p->mnk = expert_blas_threads() > 1 ? ATT_MNK : LONG_MAX;
    /* Tile: a multiple of 8 rows, tb²·hd within the cap; 64 at most with one
     * thread (the diagonal tiles' upper halves are wasted work). */
    int tb = 8;
    while (tb + 8 <= 64 && (long)(tb + 8) * (tb + 8) * p->hd <= ATT_MNK)
        tb += 8;
    if (p->mnk == LONG_MAX)
        tb = 64;
    p->tb = tb < T ? tb : T;
}

/* [lo, hi) (lo < hi) is cut into att_pieces pieces of at most w (w >= 1)
 * each; att_piece gives piece k of np. Balanced, so no sliver is left at
 * the end. */
static int att_pieces(int lo, int hi, long w)
{
    long n = hi - lo;
    return n <= w ? 1 : (int)((n - 1) / w + 1);
}

static void att_piece(int lo, int hi, int k, int np, int *a, int *b)
{
    long n = hi - lo;
    *a = lo + (int)(n * k / np);
    *b = lo + (int)(n * (k + 1) / np);
}

/* The longest extent along the T axis a GEMM with the two other sides m, hd
 * may have under the cap. */
static long att_span(const struct att_plan *p, int m)
{
    if (p->mnk == LONG_MAX)
        return LONG_MAX;
    long w = p->mnk / ((long)m * p->hd);
    return w > 0 ? w : 1;
}

/* Forward row pass over rows [i0, i1) of att (T,T) holding q·kᵀ for j <= i:
 * att[i][j] = softmax_j<=i(scale·s) and 0 for j > i. */
EXPERT__CLONES
static void att_fwd_rows(float *att, int T, int i0, int i1, float scale)
{
    for (int i = i0; i < i1; i++) {
        float *row = att + (size_t)i * T;
        expert__softmax_row(row, row, i + 1, scale);
        memset(row + i + 1, 0, (size_t)(T - 1 - i) * sizeof(float));
    }
}

/* Backward row pass over rows [i0, i1): ds holds dP = dO·vᵀ for j <= i, p
 * the probabilities; ds[i][j] = scale·p·(dP − Σ_j p·dP) for j <= i and 0
 * for i < j < zend (the rest of the diagonal tile, which the dk GEMM reads). */
EXPERT__CLONES
static void att_bwd_rows(float *ds, const float *p, int T, int i0, int i1, int zend,
                         float scale)
{
    for (int i = i0; i < i1; i++) {
        float *d = ds + (size_t)i * T;
        const float *pr = p + (size_t)i * T;
        int n = i + 1;
        float dot = expert__vdot(pr, d, n);
        for (int j = 0; j < n; j++)
            d[j] = scale * pr[j] * (d[j] - dot);
        if (zend > n)
            memset(d + n, 0, (size_t)(zend - n) * sizeof(float));
    }
}

/* One (b,h) pair's forward. q, k, v: (T, hd) stride ld; out (T, hd) stride
 * C; att (T, T). */
static void att_fwd_pair(const struct att_plan *p, float *out, float *att, const float *q,
                         const float *k, const float *v)
{
    const int T = p->T, C = p->C, hd = p->hd, tb = p->tb, ld = 3 * C;
    for (int i0 = 0; i0 < T; i0 += tb) {
        int i1 = i0 + tb < T ? i0 + tb : T, ni = i1 - i0;
        int np = att_pieces(0, i1, att_span(p, ni));
        /* att[i0:i1, 0:i1] = q[i0:i1] · k[0:i1]ᵀ */
        for (int c = 0; c < np; c++) {
            int j0, j1;
            att_piece(0, i1, c, np, &j0, &j1);
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, ni, j1 - j0, hd, 1.0f,
                        q + (size_t)i0 * ld, ld, k + (size_t)j0 * ld, ld, 0.0f,
                        att + (size_t)i0 * T + j0, T);
        }
        att_fwd_rows(att, T, i0, i1, p->scale);
        /* out[i0:i1] = att[i0:i1, 0:i1] · v[0:i1] */
        for (int c = 0; c < np; c++) {
            int j0, j1;
            att_piece(0, i1, c, np, &j0, &j1);
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, ni, hd, j1 - j0, 1.0f,
                        att + (size_t)i0 * T + j0, T, v + (size_t)j0 * ld, ld,
                        c ? 1.0f : 0.0f, out + (size_t)i0 * C, C);
        }
    }
}

/* One (b,h) pair's backward. dq, dk, dv: (T, hd) stride ld (written);
 * ds (T, T) scratch; dO (T, hd) stride C; att from the forward. */
static void att_bwd_pair(const struct att_plan *p, float *dq, float *dk, float *dv,
                         float *ds, const float *dO, const float *q, const float *k,
                         const float *v, const float *att)
{
    const int T = p->T, C = p->C, hd = p->hd, tb = p->tb, ld = 3 * C;
    /* By tile rows: dP = dO·vᵀ, then dS in place, then dq = dS·k. */
    for (int i0 = 0; i0 < T; i0 += tb) {
        int i1 = i0 + tb < T ? i0 + tb : T, ni = i1 - i0;
        int np = att_pieces(0, i1, att_span(p, ni));
        for (int c = 0; c < np; c++) {
            int j0, j1;
            att_piece(0, i1, c, np, &j0, &j1);
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, ni, j1 - j0, hd, 1.0f,
                        dO + (size_t)i0 * C, C, v + (size_t)j0 * ld, ld, 0.0f,
                        ds + (size_t)i0 * T + j0, T);
        }
        att_bwd_rows(ds, att, T, i0, i1, i1, p->scale);
        for (int c = 0; c < np; c++) {
            int j0, j1;
            att_piece(0, i1, c, np, &j0, &j1);
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, ni, hd, j1 - j0, 1.0f,
                        ds + (size_t)i0 * T + j0, T, k + (size_t)j0 * ld, ld,
                        c ? 1.0f : 0.0f, dq + (size_t)i0 * ld, ld);
        }
    }
    /* By tile columns: dk = dSᵀ·q and dv = attᵀ·dO over rows [j0, T) (rows
     * above j0 are zero in those columns; the diagonal tile's upper part
     * is zero in both att and ds). */
    for (int j0 = 0; j0 < T; j0 += tb) {
        int j1 = j0 + tb < T ? j0 + tb : T, nj = j1 - j0;
        int np = att_pieces(j0, T, att_span(p, nj));
        for (int c = 0; c < np; c++) {
            int r0, r1;
            att_piece(j0, T, c, np, &r0, &r1);
            cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, nj, hd, r1 - r0, 1.0f,
                        ds + (size_t)r0 * T + j0, T, q + (size_t)r0 * ld, ld,
                        c ? 1.0f : 0.0f, dk + (size_t)j0 * ld, ld);
            cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, nj, hd, r1 - r0, 1.0f,
                        att + (size_t)r0 * T + j0, T, dO + (size_t)r0 * C, C,
                        c ? 1.0f : 0.0f, dv + (size_t)j0 * ld, ld);
        }
    }
}

struct att_job {
    struct att_plan p;
    int B;
    float *out, *att, *dqkv, *scratch;
    const float *qkv, *dout, *catt;
};

static void att_fwd_task(void *ctx, int i, int n)
{
    struct att_job *j = ctx;
    const struct att_plan *p = &j->p;
    size_t lo, hi, T = (size_t)p->T, C = (size_t)p->C;
    expert__split((size_t)j->B * p->NH, i, n, 1, &lo, &hi);
    for (size_t bh = lo; bh < hi; bh++) {
        size_t b = bh / (size_t)p->NH, h = bh % (size_t)p->NH;
        const float *q = j->qkv + b * T * 3 * C + h * (size_t)p->hd;
        att_fwd_pair(p, j->out + b * T * C + h * (size_t)p->hd, j->att + bh * T * T, q,
                     q + C, q + 2 * C);
    }
}

static void att_bwd_task(void *ctx, int i, int n)
{
    struct att_job *j = ctx;
    const struct att_plan *p = &j->p;
    size_t lo, hi, T = (size_t)p->T, C = (size_t)p->C;
    expert__split((size_t)j->B * p->NH, i, n, 1, &lo, &hi);
    for (size_t bh = lo; bh < hi; bh++) {
        size_t b = bh / (size_t)p->NH, h = bh % (size_t)p->NH;
        size_t off = b * T * 3 * C + h * (size_t)p->hd;
        float *dq = j->dqkv + off;
        const float *q = j->qkv + off;
        att_bwd_pair(p, dq, dq + C, dq + 2 * C, j->scratch + bh * T * T,
                     j->dout + b * T * C + h * (size_t)p->hd, q, q + C, q + 2 * C,
                     j->catt + bh * T * T);
    }
}

static int att_dims_ok(int B, int T, int C, int NH)
{
    return B > 0 && T > 0 && C > 0 && NH > 0 && C % NH == 0 && C <= INT_MAX / 3;
}

int expert_attention_forward(float *out, float *att, const float *qkv, int B, int T, int C,
                             int NH)
{
    if (!out || !att || !qkv || !att_dims_ok(B, T, C, NH))
        return -EINVAL;
    struct att_job j = { .B = B, .out = out, .att = att, .qkv = qkv };
    att_plan_init(&j.p, T, C, NH);
    expert__parallel(att_fwd_task, &j, (size_t)B * NH * T * T);
    return 0;
}

int expert_attention_backward(float *dqkv, float *scratch, const float *dout,
                              const float *qkv, const float *att, int B, int T, int C,
                              int NH)
{
    if (!dqkv || !scratch || !dout || !qkv || !att || !att_dims_ok(B, T, C, NH))
        return -EINVAL;
    struct att_job j = { .B = B, .dqkv = dqkv, .scratch = scratch, .qkv = qkv,
                         .dout = dout, .catt = att };
    att_plan_init(&j.p, T, C, NH);
    expert__parallel(att_bwd_task, &j, (size_t)B * NH * T * T);
    return 0;
}

int expert_attention_backward2(float *dqkv, float *scratch, const float *dout, const float *out,
                               const float *qkv, const float *saved, int B, int T, int C, int NH)
{
    (void)out; /* the probabilities are kept whole: the output is not needed */
    return expert_attention_backward(dqkv, scratch, dout, qkv, saved, B, T, C, NH);
}

void expert_attention_sizes(int T, int NH, size_t *saved_out, size_t *scratch_out)
{
    size_t n = (size_t)NH * (size_t)T * (size_t)T;
    if (saved_out)
        *saved_out = n;
    if (scratch_out)
        *scratch_out = n;
}
