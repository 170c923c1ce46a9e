// cuda/matmul.cu: the linear layer through cuBLASLt, with its epilogues:
// out = [res +] inp·wᵀ [+ bias] and its backward, in fp32 and in bf16
// (bf16 inputs, fp32 accumulation and outputs); and the old linear ops on
// top of them.
//
// Row-major (B,C) data is column-major (C,B) to cuBLAS, so with w (OC,C)
// row-major, i.e. (C,OC) column-major:
//   out  (OC,B)cm = wᵀ(cm)ᵀ · inp(cm) [+ res]  -> op(A)=T, op(B)=N, m=OC, n=B,  k=C
//   dinp (C,B)cm  = w(cm) · dout(cm)            -> N, N,  m=C,  n=B,  k=OC
//   dw   (C,OC)cm += inp(cm) · dout(cm)ᵀ        -> N, T,  m=C,  n=OC, k=B, beta=1
// The forward adds the bias in the matmul's epilogue (CUBLASLT_EPILOGUE_BIAS,
// a vector of length m broadcast over columns) and the residual as C with
// beta = 1 (D = A·B + C). cuBLASLt's GELU epilogue is the tanh
// approximation, not the exact erf GELU the models use, so GELU stays a
// kernel of its own (cuda/gelu.cu).
//
// The algorithm for a shape is asked of cuBLASLt's heuristic once and kept
// in a small per-thread cache: the heuristic costs tens of microseconds,
// as much as a small matmul.
#include <string.h>

#include "cuda/common.cuh"

struct mm_key {
    int ta, tb, m, n, k, lda, ldb, ldc;
    int atype, ctype, compute, epilogue;
    int beta_one;
    int align[4];   // of A, B, C, D in bytes (the heuristic picks for these)
};

// The largest power of two (at most 256) that divides p's address. The
// heuristic assumes 256-byte aligned operands unless told otherwise, and a
// block's tensors sit at any float offset in its flat parameter array.
static int align_of(const void *p)
{
    uintptr_t u = (uintptr_t)p;
    int a = 256;
    while (a > 4 && (u % (uintptr_t)a) != 0)
        a >>= 1;
    return a;
}

struct mm_entry {
    struct mm_key key;
    cublasLtMatmulAlgo_t algo;
    int valid;
};

#define MM_CACHE 64
static thread_local struct mm_entry t_cache[MM_CACHE];
static thread_local unsigned t_next;

static int lt_matmul(cuda__ctx *c, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                     const void *A, int lda, const void *B, int ldb, cudaDataType_t abtype,
                     const float *Cin, float *D, int ldc, float beta, const float *bias)
{
    cublasLtMatmulDesc_t op = NULL;
    cublasLtMatrixLayout_t la = NULL, lb = NULL, lc = NULL;
    cublasLtMatmulPreference_t pref = NULL;
    int rc = -EIO;
    const float alpha = 1.0f;
    cublasComputeType_t ct = abtype == CUDA_R_32F && c->tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32
                                                             : CUBLAS_COMPUTE_32F;
    cublasLtEpilogue_t epi = bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
    struct mm_key key;
    memset(&key, 0, sizeof key);
    key = (struct mm_key){ (int)ta, (int)tb, m, n, k, lda, ldb, ldc, (int)abtype, (int)CUDA_R_32F,
                           (int)ct, (int)epi, beta != 0.0f,
                           { align_of(A), align_of(B), align_of(Cin ? Cin : D), align_of(D) } };
    struct mm_entry *hit = NULL;
    for (int i = 0; i < MM_CACHE; i++)
        if (t_cache[i].valid && memcmp(&t_cache[i].key, &key, sizeof key) == 0) {
            hit = &t_cache[i];
            break;
        }

    if (cublasLtMatmulDescCreate(&op, ct, CUDA_R_32F) != CUBLAS_STATUS_SUCCESS)
        goto out;
    if (cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta) != CUBLAS_STATUS_SUCCESS ||
        cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb) != CUBLAS_STATUS_SUCCESS)
        goto out;
    if (bias) {
        if (cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi) != CUBLAS_STATUS_SUCCESS ||
            cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias) != CUBLAS_STATUS_SUCCESS)
            goto out;
    }
    if (cublasLtMatrixLayoutCreate(&la, abtype, ta == CUBLAS_OP_N ? m : k, ta == CUBLAS_OP_N ? k : m, lda) != CUBLAS_STATUS_SUCCESS ||
        cublasLtMatrixLayoutCreate(&lb, abtype, tb == CUBLAS_OP_N ? k : n, tb == CUBLAS_OP_N ? n : k, ldb) != CUBLAS_STATUS_SUCCESS ||
        cublasLtMatrixLayoutCreate(&lc, CUDA_R_32F, m, n, ldc) != CUBLAS_STATUS_SUCCESS)
        goto out;
    if (!hit) {
        cublasLtMatmulHeuristicResult_t heur;
        int nres = 0;
        if (cublasLtMatmulPreferenceCreate(&pref) != CUBLAS_STATUS_SUCCESS ||
            cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                 &c->workspace_bytes, sizeof c->workspace_bytes) != CUBLAS_STATUS_SUCCESS)
            goto out;
        static const cublasLtMatmulPreferenceAttributes_t align_attr[4] = {
            CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
            CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
        };
        for (int i = 0; i < 4; i++) {
            uint32_t a = (uint32_t)key.align[i];
            if (cublasLtMatmulPreferenceSetAttribute(pref, align_attr[i], &a, sizeof a) != CUBLAS_STATUS_SUCCESS)
                goto out;
        }
        if (cublasLtMatmulAlgoGetHeuristic(c->lt, op, la, lb, lc, lc, pref, 1, &heur, &nres) != CUBLAS_STATUS_SUCCESS ||
            nres < 1) {
            rc = -ENOSYS;
            goto out;
        }
        hit = &t_cache[t_next++ % MM_CACHE];
        hit->key = key;
        hit->algo = heur.algo;
        hit->valid = 1;
    }
    // beta == 0: cuBLASLt does not read C, so Cin may be D.
    if (cublasLtMatmul(c->lt, op, &alpha, A, la, B, lb, &beta, Cin ? Cin : D, lc, D, lc, &hit->algo,
                       c->workspace, c->workspace_bytes, c->stream) == CUBLAS_STATUS_SUCCESS)
        rc = 0;
    else
        rc = expert_backend_set_error(-EIO, "CUDA: cublasLtMatmul (m %d, n %d, k %d) failed", m, n, k);
out:
    if (pref)
        cublasLtMatmulPreferenceDestroy(pref);
    if (lc)
        cublasLtMatrixLayoutDestroy(lc);
    if (lb)
        cublasLtMatrixLayoutDestroy(lb);
    if (la)
        cublasLtMatrixLayoutDestroy(la);
    if (op)
        cublasLtMatmulDescDestroy(op);
    return rc;
}

// The same, and when cuBLASLt has no algorithm with the bias epilogue for
// this shape and type, the matmul without it and the bias as a kernel.
static int lt_matmul_bias(cuda__ctx *c, cublasOperation_t ta, cublasOperation_t tb, int m, int n,
                          int k, const void *A, int lda, const void *B, int ldb,
                          cudaDataType_t abtype, const float *Cin, float *D, int ldc, float beta,
                          const float *bias)
{
    // A bias vector less than 16-byte aligned (a tensor at an odd offset
    // of the flat parameters) is not handed to the epilogue, whose vector
    // loads may assume more.
    int rc = -ENOSYS;
    if (!bias || align_of(bias) >= 16)
        rc = lt_matmul(c, ta, tb, m, n, k, A, lda, B, ldb, abtype, Cin, D, ldc, beta, bias);
    if (rc != -ENOSYS || !bias)
        return rc;
    rc = lt_matmul(c, ta, tb, m, n, k, A, lda, B, ldb, abtype, Cin, D, ldc, beta, NULL);
    // D is (n rows of m) row-major here: the bias runs along m.
    return rc ? rc : cuda_bias_forward(D, D, bias, n, m);
}

// dst (n) = src as bf16, on the thread's stream.
static __global__ void to_bf16_kernel(__nv_bfloat16 *dst, const float *src, long n)
{
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n;
         i += (long)gridDim.x * blockDim.x)
        dst[i] = __float2bfloat16_rn(src[i]);
}

static int to_bf16(cuda__ctx *c, __nv_bfloat16 *dst, const float *src, long n)
{
    if (n <= 0)
        return 0;
    to_bf16_kernel<<<cuda__blocks(n, 256), 256, 0, c->stream>>>(dst, src, n);
    return cuda__launch_status();
}

static int mm_args_ok(const void *out, const void *inp, const void *w, int B, int C, int OC)
{
    return out && inp && w && B >= 0 && C > 0 && OC > 0;
}

extern "C" int cuda_matmul_forward(float *out, const float *res, const float *inp, const float *w,
                                   const uint16_t *w16, const float *bias, int B, int C, int OC)
{
    (void)w16;
    if (!mm_args_ok(out, inp, w, B, C, OC))
        return -EINVAL;
    cuda__ctx *c = cuda__context();
    if (!c)
        return -ENODEV;
    if (B == 0)
        return 0;
    return lt_matmul_bias(c, CUBLAS_OP_T, CUBLAS_OP_N, OC, B, C, w, C, inp, C, CUDA_R_32F, res, out,
                          OC, res ? 1.0f : 0.0f, bias);
}

extern "C" int cuda_matmul_backward(float *dinp, float *dw, float *dbias, const float *dout,
                                    const float *inp, const float *w, const uint16_t *w16, int B,
                                    int C, int OC)
{
    (void)w16;
    if (!dw || !mm_args_ok(dout, inp, w, B, C, OC))
        return -EINVAL;
    cuda__ctx *c = cuda__context();
    if (!c)
        return -ENODEV;
    if (B == 0)
        return 0;
    int rc = dbias ? cuda__colsum_add(c, dbias, dout, B, OC) : 0;
    if (rc == 0) // dw first: dinp may alias inp
        rc = lt_matmul(c, CUBLAS_OP_N, CUBLAS_OP_T, C, OC, B, inp, C, dout, OC, CUDA_R_32F, dw, dw, C,
                       1.0f, NULL);
    if (rc == 0 && dinp)
        rc = lt_matmul(c, CUBLAS_OP_N, CUBLAS_OP_N, C, B, OC, w, C, dout, OC, CUDA_R_32F, NULL, dinp,
                       C, 0.0f, NULL);
    return rc;
}

// Scratch for the bf16 copies of up to three operands, each rounded up to
// 256 bytes.
static size_t r256(size_t bytes)
{
    return (bytes + 255) & ~(size_t)255;
}

extern "C" int cuda_matmul_forward_bf16(float *out, const float *res, const float *inp,
                                        const float *w, const uint16_t *w16, const float *bias,
                                        int B, int C, int OC)
{
    if (!mm_args_ok(out, inp, w, B, C, OC))
        return -EINVAL;
    cuda__ctx *c = cuda__context();
    if (!c)
        return -ENODEV;
    if (B == 0)
        return 0;
    size_t nin = (size_t)B * C, nw = (size_t)OC * C;
    size_t need = r256(nin * 2) + (w16 ? 0 : r256(nw * 2));
    char *s = (char *)cuda__scratch(c, need);
    if (!s)
        return -ENOMEM;
    __nv_bfloat16 *in16 = (__nv_bfloat16 *)s;
    const __nv_bfloat16 *wb = (const __nv_bfloat16 *)w16;
    int rc = to_bf16(c, in16, inp, (long)nin);
    if (rc == 0 && !wb) {
        __nv_bfloat16 *tmp = (__nv_bfloat16 *)(s + r256(nin * 2));
        rc = to_bf16(c, tmp, w, (long)nw);
        wb = tmp;
    }
    if (rc == 0)
        rc = lt_matmul_bias(c, CUBLAS_OP_T, CUBLAS_OP_N, OC, B, C, wb, C, in16, C, CUDA_R_16BF, res,
                            out, OC, res ? 1.0f : 0.0f, bias);
    // A shape cuBLASLt has no bf16 algorithm for (bf16 tensor cores want
    // leading dimensions in multiples of 8): fp32 products instead.
    if (rc == -ENOSYS)
        rc = cuda_matmul_forward(out, res, inp, w, NULL, bias, B, C, OC);
    return rc;
}

extern "C" int cuda_matmul_backward_bf16(float *dinp, float *dw, float *dbias, const float *dout,
                                         const float *inp, const float *w, const uint16_t *w16,
                                         int B, int C, int OC)
{
    if (!dw || !mm_args_ok(dout, inp, w, B, C, OC))
        return -EINVAL;
    cuda__ctx *c = cuda__context();
    if (!c)
        return -ENODEV;
    if (B == 0)
        return 0;
    // The bias gradient first: it uses the scratch the copies below take.
    int rc = dbias ? cuda__colsum_add(c, dbias, dout, B, OC) : 0;
    if (rc != 0)
        return rc;
    size_t nin = (size_t)B * C, nout = (size_t)B * OC, nw = (size_t)OC * C;
    size_t need = r256(nin * 2) + r256(nout * 2) + (w16 || !dinp ? 0 : r256(nw * 2));
    char *s = (char *)cuda__scratch(c, need);
    if (!s)
        return -ENOMEM;
    __nv_bfloat16 *in16 = (__nv_bfloat16 *)s;
    __nv_bfloat16 *dout16 = (__nv_bfloat16 *)(s + r256(nin * 2));
    rc = to_bf16(c, in16, inp, (long)nin);
    if (rc == 0)
        rc = to_bf16(c, dout16, dout, (long)nout);
    if (rc == 0) // dw first: dinp may alias inp (in16 holds its copy anyway)
        rc = lt_matmul(c, CUBLAS_OP_N, CUBLAS_OP_T, C, OC, B, in16, C, dout16, OC, CUDA_R_16BF, dw, dw,
                       C, 1.0f, NULL);
    if (rc == -ENOSYS) // no bf16 algorithm for this shape: fp32 (as the forward)
        rc = lt_matmul(c, CUBLAS_OP_N, CUBLAS_OP_T, C, OC, B, inp, C, dout, OC, CUDA_R_32F, dw, dw, C,
                       1.0f, NULL);
    if (rc == 0 && dinp) {
        const __nv_bfloat16 *wb = (const __nv_bfloat16 *)w16;
        if (!wb) {
            __nv_bfloat16 *tmp = (__nv_bfloat16 *)(s + r256(nin * 2) + r256(nout * 2));
            rc = to_bf16(c, tmp, w, (long)nw);
            wb = tmp;
        }
        if (rc == 0)
            rc = lt_matmul(c, CUBLAS_OP_N, CUBLAS_OP_N, C, B, OC, wb, C, dout16, OC, CUDA_R_16BF, NULL,
                           dinp, C, 0.0f, NULL);
        if (rc == -ENOSYS)
            rc = lt_matmul(c, CUBLAS_OP_N, CUBLAS_OP_N, C, B, OC, w, C, dout, OC, CUDA_R_32F, NULL, dinp, C,
                           0.0f, NULL);
    }
    return rc;
}

extern "C" int cuda_linear_forward(float *out, const float *inp, const float *w, const float *bias,
                                   int B, int C, int OC)
{
    return cuda_matmul_forward(out, NULL, inp, w, NULL, bias, B, C, OC);
}

extern "C" int cuda_linear_backward(float *dinp, float *dw, float *dbias, const float *dout,
                                    const float *inp, const float *w, int B, int C, int OC)
{
    return cuda_matmul_backward(dinp, dw, dbias, dout, inp, w, NULL, B, C, OC);
}
