/* The GPU tests' cuBLASLt peer, timed (CUDA builds only): one matmul out[M, N] = x[M, K] w[N, K]^T
 * in row-major terms. cuBLASLt sees it column-major as out^T [N, M] = (w as [K, N])^T (x as
 * [K, M]), the "TN" layout its tensor-core kernels prefer and FP8 needs. */
#ifndef MOESERVE_TESTS_CUBLASLT_TIME_H
#define MOESERVE_TESTS_CUBLASLT_TIME_H

#include <cublasLt.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

/* Seconds per call, inputs of type ab, out of type cd, fp32 accumulation, cuBLASLt's first
 * heuristic algorithm within ws_bytes of workspace ws, on stream st: warm untimed calls, then reps
 * timed ones. With block scales (scale_w, scale_x not NULL: cuBLASLt's scale mode `mode` for both,
 * the scale tensors in its layout) as block-scaled formats need. NAN when cuBLASLt offers no
 * algorithm or a call fails. */
static inline double cublaslt_seconds_scaled(cudaDataType_t ab, cudaDataType_t cd, int M, int N,
                                             int K, const void *w, const void *x, void *out,
                                             void *ws, uint64_t ws_bytes, cudaStream_t st, int warm,
                                             int reps, int mode, const void *scale_w,
                                             const void *scale_x) {
    cublasLtHandle_t lt = NULL;
    cublasLtMatmulDesc_t desc = NULL;
    cublasLtMatrixLayout_t la = NULL, lb = NULL, lc = NULL;
    cublasLtMatmulPreference_t pref = NULL;
    const cublasOperation_t opT = CUBLAS_OP_T, opN = CUBLAS_OP_N;
    cublasLtMatmulHeuristicResult_t res;
    int n_res = 0;
    int ok =
        cublasLtCreate(&lt) == CUBLAS_STATUS_SUCCESS &&
        cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F) == 0 &&
        cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &opT, sizeof opT) == 0 &&
        cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &opN, sizeof opN) == 0;
    if (ok && scale_w && scale_x) {
        const cublasLtMatmulMatrixScale_t m = (cublasLtMatmulMatrixScale_t)mode;
        ok = cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &m,
                                            sizeof m) == 0 &&
             cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &m,
                                            sizeof m) == 0 &&
             cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &scale_w,
                                            sizeof scale_w) == 0 &&
             cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &scale_x,
                                            sizeof scale_x) == 0;
    }
    ok = ok && cublasLtMatrixLayoutCreate(&la, ab, K, N, K) == 0 &&
         cublasLtMatrixLayoutCreate(&lb, ab, K, M, K) == 0 &&
         cublasLtMatrixLayoutCreate(&lc, cd, N, M, N) == 0 &&
         cublasLtMatmulPreferenceCreate(&pref) == 0 &&
         cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                              &ws_bytes, sizeof ws_bytes) == 0 &&
         cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, lc, lc, pref, 1, &res, &n_res) == 0 &&
         n_res == 1;
    double s = NAN;
    if (ok) {
        const float alpha = 1.0f, beta = 0.0f;
        cudaEvent_t e0, e1;
        cudaEventCreate(&e0);
        cudaEventCreate(&e1);
        int status = 0;
        for (int r = 0; r < warm + reps; r++) {
            if (r == warm) cudaEventRecord(e0, st);
            status |= cublasLtMatmul(lt, desc, &alpha, w, la, x, lb, &beta, out, lc, out, lc,
                                     &res.algo, ws, ws_bytes, st);
        }
        cudaEventRecord(e1, st);
        cudaEventSynchronize(e1);
        float ms = 0.0f;
        cudaEventElapsedTime(&ms, e0, e1);
        if (status == 0) s = ms / 1e3 / reps;
        cudaEventDestroy(e0);
        cudaEventDestroy(e1);
    }
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (lc) cublasLtMatrixLayoutDestroy(lc);
    if (lb) cublasLtMatrixLayoutDestroy(lb);
    if (la) cublasLtMatrixLayoutDestroy(la);
    if (desc) cublasLtMatmulDescDestroy(desc);
    if (lt) cublasLtDestroy(lt);
    return s;
}

/* The same without block scales. */
static inline double cublaslt_seconds(cudaDataType_t ab, cudaDataType_t cd, int M, int N, int K,
                                      const void *w, const void *x, void *out, void *ws,
                                      uint64_t ws_bytes, cudaStream_t st, int warm, int reps) {
    return cublaslt_seconds_scaled(ab, cd, M, N, K, w, x, out, ws, ws_bytes, st, warm, reps, 0,
                                   NULL, NULL);
}

#endif
