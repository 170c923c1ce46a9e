// tests/cudaemu/include/cublasLt.h: only the handle type cuda/common.cuh
// names (cuBLASLt itself is not emulated: cuda/matmul.cu is not run).
#ifndef TESTS_CUDAEMU_CUBLASLT_H
#define TESTS_CUDAEMU_CUBLASLT_H
typedef struct cublasLtContext *cublasLtHandle_t;
#endif
