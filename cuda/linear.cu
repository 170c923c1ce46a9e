// cuda/linear.cu: out = inp·wᵀ + bias and its backward, through cuBLASLt.
//
// Row-major (B,C) data is column-major (C,B) to cuBLAS, so with w (OC,C)
// row-major, i.e. (C,OC) column-major:
//   out  (OC,B)cm = wᵀ(cm)ᵀ · inp(cm)          -> op(A)=T, op(B)=N, m=OC, n=B,  k=C
//   dinp (C,B)cm  = w(cm) · dout(cm)            -> N, N,  m=C,  n=B,  k=OC
//   dw   (C,OC)cm += inp(cm) · dout(cm)ᵀ        -> N, T,  m=C,  n=OC, k=B, beta=1
// The forward adds the bias in the matmul's epilogue (CUBLASLT_EPILOGUE_BIAS,
// a vector of length m broadcast over columns).
#include "cuda/common.cuh"

static int lt_matmul(cuda__ctx *c, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                     const float *A, int lda, const float *B, int ldb, float *C, int ldc,
                     float beta, const float *bias)
{
    cublasLtMatmulDesc_t op = NULL;
    cublasLtMatrixLayout_t la = NULL, lb = NULL, lc = NULL;
    cublasLtMatmulPreference_t pref = NULL;
    cublasLtMatmulHeuristicResult_t heur;
    int nres = 0, rc = -EIO;
    const float alpha = 1.0f;
    cublasComputeType_t ct = c->tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;

    if (cublasLtMatmulDescCreate(&op, ct, CUDA_R_32F) != CUBLAS_STATUS_SUCCESS)
        goto out;
    if (cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta) != CUBLAS_STATUS_SUCCESS ||
        cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb) != CUBLAS_STATUS_SUCCESS)
        goto out;
    if (bias) {
        cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;
        if (cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi) != CUBLAS_STATUS_SUCCESS ||
            cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias) != CUBLAS_STATUS_SUCCESS)
            goto out;
    }
    if (cublasLtMatrixLayoutCreate(&la, CUDA_R_32F, ta == CUBLAS_OP_N ? m : k, ta == CUBLAS_OP_N ? k : m, lda) != CUBLAS_STATUS_SUCCESS ||
        cublasLtMatrixLayoutCreate(&lb, CUDA_R_32F, tb == CUBLAS_OP_N ? k : n, tb == CUBLAS_OP_N ? n : k, ldb) != CUBLAS_STATUS_SUCCESS ||
        cublasLtMatrixLayoutCreate(&lc, CUDA_R_32F, m, n, ldc) != CUBLAS_STATUS_SUCCESS)
        goto out;
    if (cublasLtMatmulPreferenceCreate(&pref) != CUBLAS_STATUS_SUCCESS ||
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                             &c->workspace_bytes, sizeof c->workspace_bytes) != CUBLAS_STATUS_SUCCESS)
        goto out;
    if (cublasLtMatmulAlgoGetHeuristic(c->lt, op, la, lb, lc, lc, pref, 1, &heur, &nres) != CUBLAS_STATUS_SUCCESS ||
        nres < 1) {
        rc = -ENOSYS;
        goto out;
    }
    if (cublasLtMatmul(c->lt, op, &alpha, A, la, B, lb, &beta, C, lc, C, lc, &heur.algo,
                       c->workspace, c->workspace_bytes, c->stream) == CUBLAS_STATUS_SUCCESS)
        rc = 0;
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

extern "C" int cuda_linear_forward(float *out, const float *inp, const float *w, const float *bias,
                                   int B, int C, int OC)
{
    if (!out || !inp || !w || B < 0 || C <= 0 || OC <= 0)
        return -EINVAL;
    cuda__ctx *ctx = cuda__context();
    if (!ctx)
        return -ENODEV;
    if (B == 0)
        return 0;
    return lt_matmul(ctx, CUBLAS_OP_T, CUBLAS_OP_N, OC, B, C, w, C, inp, C, out, OC, 0.0f, bias);
}

extern "C" int cuda_linear_backward(float *dinp, float *dw, float *dbias, const float *dout,
                                    const float *inp, const float *w, int B, int C, int OC)
{
    if (!dw || !dout || !inp || !w || B < 0 || C <= 0 || OC <= 0)
        return -EINVAL;
    cuda__ctx *ctx = cuda__context();
    if (!ctx)
        return -ENODEV;
    if (B == 0) {
        /* dinp is (0, C): nothing to write, nothing to accumulate. */
        return 0;
    }
    int rc = 0;
    if (dinp)
        rc = lt_matmul(ctx, CUBLAS_OP_N, CUBLAS_OP_N, C, B, OC, w, C, dout, OC, dinp, C, 0.0f, NULL);
    if (rc == 0)
        rc = lt_matmul(ctx, CUBLAS_OP_N, CUBLAS_OP_T, C, OC, B, inp, C, dout, OC, dw, C, 1.0f, NULL);
    if (rc == 0 && dbias)
        rc = cuda__colsum_add(dbias, dout, B, OC, ctx->stream);
    return rc;
}
