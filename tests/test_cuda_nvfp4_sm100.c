/* The NVFP4 x NVFP4 grouped GEMM on Blackwell's block-scaled tensor cores
 * (kernels/cuda/nvfp4_sm100.cu, sm_100a) against the CPU, and its speed against cuBLASLt's NVFP4
 * GEMM and the device copy rate in the same run. Runs only on a compute capability 10.0 GPU
 * (B200, GB200); elsewhere it prints "skipped: <reason>" and "0 passed, 0 failed". No such GPU
 * has run it yet.
 *
 * Reference: out[r, n] = sa[r] sb[e] sum_k (e2m1(a) e4m3(sfa)) (e2m1(b) e4m3(sfb)) in double on
 * the decoded codes (kernels/quant.h). Bound per output: |got - want| <= 2^-10 S with S the same
 * sum of absolute values (the tensor core's sums need not keep fp32's bits), and the issue's
 * figure beside it: max |got - want| over the rms of want, at most 1e-2. Outputs are poisoned with
 * NaN first: a valid row the kernel never wrote fails, and so does any write to a row past a
 * block's valid rows. Shapes: uneven experts (empty ones, one row, 128 and 130 rows, a block with
 * no rows, a block of no expert), K of one stage and of several, N of one and two tiles, and
 * Qwen3-30B-A3B's and DeepSeek-V3's expert shapes.
 *
 * Figures: 8 experts x 4096 rows, N 1536 and 4096, K 2048 and 7168, TFLOP/s against cuBLASLt's
 * NVFP4 GEMM of the same total rows; 8 experts x 1 to 64 rows (decode sizes): weight bytes
 * (codes and scales) per second against the 1 GiB device copy rate. */
#include <stdio.h>

#ifdef MOESERVE_CUDA

#include <cublasLt.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/quant.h"
#include "tests/check.h"

cudaStream_t cuda_stream(void); /* kernels/cuda/ops_cuda.cu */

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static double urand(void) { /* [0, 1) */
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (double)(rng >> 11) / 9007199254740992.0;
}

static void *dev_copy(const void *h, size_t bytes) {
    void *d = NULL;
    MS_ASSERT(cudaMalloc(&d, bytes ? bytes : 16) == cudaSuccess);
    if (bytes) MS_ASSERT(cudaMemcpy(d, h, bytes, cudaMemcpyHostToDevice) == cudaSuccess);
    return d;
}

/* Rows of E experts in blocks of 128: expert e's rows[e] rows fill ceil(rows[e] / 128) blocks;
 * extra blocks with no rows and with no expert are added when asked. */
typedef struct {
    int E, N, K, n_blk;
    int32_t *blk_e, *blk_rows;  /* [n_blk] */
    uint8_t *a, *sfa, *b, *sfb; /* codes [n_blk 128, K / 2], [E N, K / 2]; scales [rows, K / 16] */
    float *sa, *sb;             /* [n_blk 128], [E] */
} nv4_case;

/* A positive E4M3 scale code of 2^-3 to 2^3 (never NaN). */
static uint8_t scale_code(void) { return (uint8_t)(0x30 + (int)(urand() * 0x30)); }

static nv4_case case_make(int E, const int *rows, int N, int K, int extra_blocks) {
    nv4_case c = {.E = E, .N = N, .K = K};
    int n = 0;
    for (int e = 0; e < E; e++)
        n += (rows[e] + 127) / 128;
    c.n_blk = n + (extra_blocks ? 2 : 0);
    c.blk_e = malloc(sizeof(int32_t) * (c.n_blk + 1));
    c.blk_rows = malloc(sizeof(int32_t) * (c.n_blk + 1));
    int b = 0;
    for (int e = 0; e < E; e++)
        for (int left = rows[e]; left > 0; left -= 128, b++) {
            c.blk_e[b] = e;
            c.blk_rows[b] = left < 128 ? left : 128;
        }
    if (extra_blocks) { /* a block of expert 0 with no rows; a block of no expert */
        c.blk_e[b] = 0;
        c.blk_rows[b++] = 0;
        c.blk_e[b] = -1;
        c.blk_rows[b++] = 128;
    }
    const int64_t R = (int64_t)c.n_blk * 128, RB = (int64_t)E * N;
    c.a = malloc((size_t)(R * K / 2) + 1);
    c.b = malloc((size_t)(RB * K / 2));
    c.sfa = malloc((size_t)(R * K / 16) + 1);
    c.sfb = malloc((size_t)(RB * K / 16));
    c.sa = malloc(sizeof(float) * (size_t)(R + 1));
    c.sb = malloc(sizeof(float) * (size_t)E);
    for (int64_t i = 0; i < R * K / 2; i++)
        c.a[i] = (uint8_t)(urand() * 256);
    for (int64_t i = 0; i < RB * K / 2; i++)
        c.b[i] = (uint8_t)(urand() * 256);
    for (int64_t i = 0; i < R * K / 16; i++)
        c.sfa[i] = scale_code();
    for (int64_t i = 0; i < RB * K / 16; i++)
        c.sfb[i] = scale_code();
    for (int64_t i = 0; i < R; i++)
        c.sa[i] = ldexpf(1.0f + (float)urand(), -4 + (int)(urand() * 6));
    for (int e = 0; e < E; e++)
        c.sb[e] = ldexpf(1.0f + (float)urand(), -4 + (int)(urand() * 6));
    return c;
}

static void case_free(nv4_case *c) {
    free(c->blk_e);
    free(c->blk_rows);
    free(c->a);
    free(c->b);
    free(c->sfa);
    free(c->sfb);
    free(c->sa);
    free(c->sb);
}

typedef struct {
    void *a, *sfa, *b, *sfb, *sa, *sb, *blk_e, *blk_rows;
    float *out;
} nv4_dev;

static nv4_dev dev_make(const nv4_case *c) {
    const int64_t R = (int64_t)c->n_blk * 128, RB = (int64_t)c->E * c->N;
    nv4_dev d;
    uint8_t *atoms = malloc(quant_nvfp4_sf_atoms_bytes(R > RB ? R : RB, c->K) + 1);
    d.a = dev_copy(c->a, (size_t)(R * c->K / 2));
    d.b = dev_copy(c->b, (size_t)(RB * c->K / 2));
    quant_nvfp4_sf_atoms(atoms, c->sfa, R, c->K);
    d.sfa = dev_copy(atoms, quant_nvfp4_sf_atoms_bytes(R, c->K));
    quant_nvfp4_sf_atoms(atoms, c->sfb, RB, c->K);
    d.sfb = dev_copy(atoms, quant_nvfp4_sf_atoms_bytes(RB, c->K));
    free(atoms);
    d.sa = dev_copy(c->sa, sizeof(float) * (size_t)R);
    d.sb = dev_copy(c->sb, sizeof(float) * (size_t)c->E);
    d.blk_e = dev_copy(c->blk_e, sizeof(int32_t) * (size_t)c->n_blk);
    d.blk_rows = dev_copy(c->blk_rows, sizeof(int32_t) * (size_t)c->n_blk);
    MS_ASSERT(cudaMalloc((void **)&d.out, sizeof(float) * (size_t)(R * c->N) + 16) == cudaSuccess);
    return d;
}

static void dev_free(nv4_dev *d) {
    cudaFree(d->a);
    cudaFree(d->sfa);
    cudaFree(d->b);
    cudaFree(d->sfb);
    cudaFree(d->sa);
    cudaFree(d->sb);
    cudaFree(d->blk_e);
    cudaFree(d->blk_rows);
    cudaFree(d->out);
}

static void dev_run(const nv4_case *c, const nv4_dev *d) {
    cuda_nvfp4_sm100_gemm(d->out, d->a, d->sfa, d->sa, d->b, d->sfb, d->sb, d->blk_e, d->blk_rows,
                          c->n_blk, c->N, c->K, c->E);
}

/* the value of code nibble k of a row of packed codes */
static double code_at(const uint8_t *row, int k) {
    return fp4_e2m1_to_float(k % 2 ? row[k / 2] >> 4 : row[k / 2] & 15);
}

static void check_case(const char *what, int E, const int *rows, int N, int K, int extra) {
    nv4_case c = case_make(E, rows, N, K, extra);
    const int64_t R = (int64_t)c.n_blk * 128;
    nv4_dev d = dev_make(&c);
    const size_t ob = sizeof(float) * (size_t)(R * N);
    cudaMemset(d.out, 0xff, ob); /* NaN */
    dev_run(&c, &d);
    const cudaError_t ce = cudaStreamSynchronize(cuda_stream());
    CHECK(ce == cudaSuccess, "nvfp4 sm100 %s: %s", what, cudaGetErrorString(ce));
    float *out = malloc(ob + 16);
    MS_ASSERT(cudaMemcpy(out, d.out, ob, cudaMemcpyDeviceToHost) == cudaSuccess);
    /* every row's values decoded once: A's rows, then each weight row as it comes */
    const int G = K / 16;
    double *av = malloc(sizeof(double) * (size_t)(R * K) + 8), *bv = malloc(sizeof(double) * K);
    for (int64_t r = 0; r < R; r++)
        for (int k = 0; k < K; k++)
            av[r * K + k] = code_at(c.a + r * K / 2, k) * fp8_e4m3_to_float(c.sfa[r * G + k / 16]);
    double worst = 0.0, max_err = 0.0, sq = 0.0;
    int64_t bad = 0, n_valid = 0, touched = 0;
    for (int blk = 0; blk < c.n_blk; blk++) /* rows the kernel must leave alone stay NaN */
        for (int i = 0; i < 128; i++)
            if (c.blk_e[blk] < 0 || i >= c.blk_rows[blk])
                for (int n = 0; n < N; n++)
                    touched += !isnan(out[((int64_t)blk * 128 + i) * N + n]);
    for (int e = 0; e < E; e++)
        for (int n = 0; n < N; n++) {
            const int64_t rb = (int64_t)e * N + n;
            for (int k = 0; k < K; k++)
                bv[k] = code_at(c.b + rb * K / 2, k) * fp8_e4m3_to_float(c.sfb[rb * G + k / 16]);
            for (int blk = 0; blk < c.n_blk; blk++) {
                if (c.blk_e[blk] != e) continue;
                for (int i = 0; i < c.blk_rows[blk]; i++) {
                    const int64_t r = (int64_t)blk * 128 + i;
                    double sum = 0.0, S = 0.0;
                    for (int k = 0; k < K; k++) {
                        const double p = av[r * K + k] * bv[k];
                        sum += p;
                        S += fabs(p);
                    }
                    const double sc = (double)c.sa[r] * c.sb[e], want = sc * sum;
                    const double lim = sc * S * 0x1p-10, got = out[r * N + n];
                    const double err = fabs(got - want);
                    if (!(err <= lim + 1e-30) && bad++ < 5)
                        fprintf(stderr, "  nvfp4 sm100 %s: row %lld col %d got %.9g want %.9g\n",
                                what, (long long)r, n, got, want);
                    if (isnan(err) || err > max_err) max_err = isnan(err) ? INFINITY : err;
                    const double rel = S > 0 ? err / (sc * S) : err;
                    if (isnan(rel) || rel > worst) worst = isnan(rel) ? INFINITY : rel;
                    sq += want * want;
                    n_valid++;
                }
            }
        }
    free(av);
    free(bv);
    const double rms = n_valid ? sqrt(sq / (double)n_valid) : 0.0;
    printf("  %-34s E=%d N=%-5d K=%-5d blocks %-3d worst err/S %.3g, max err / rms %.3g\n", what, E,
           N, K, c.n_blk, worst, rms > 0 ? max_err / rms : 0.0);
    CHECK(bad == 0, "nvfp4 sm100 %s: %lld of %lld outputs outside 2^-10 S", what, (long long)bad,
          (long long)n_valid);
    CHECK(rms == 0.0 || max_err / rms <= 1e-2, "nvfp4 sm100 %s: max err / rms %.3g > 1e-2", what,
          max_err / rms);
    CHECK(touched == 0, "nvfp4 sm100 %s: %lld outputs written past the valid rows", what,
          (long long)touched);
    free(out);
    dev_free(&d);
    case_free(&c);
}

/* seconds per call: warm calls, then reps timed ones */
static double time_case(const nv4_case *c, const nv4_dev *d, int reps) {
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    for (int r = 0; r < 3; r++)
        dev_run(c, d);
    cudaEventRecord(e0, cuda_stream());
    for (int r = 0; r < reps; r++)
        dev_run(c, d);
    cudaEventRecord(e1, cuda_stream());
    cudaEventSynchronize(e1);
    float ms = 0.0f;
    cudaEventElapsedTime(&ms, e0, e1);
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    return ms / 1e3 / reps;
}

/* cuBLASLt's NVFP4 GEMM (E2M1 in with UE4M3 scales a 16-vector, fp32 out) of M rows, the peer at
 * prefill sizes: the same codes and atoms as one matrix. NAN when cuBLASLt offers nothing. */
static double cublaslt_nvfp4_seconds(const nv4_dev *d, int M, int N, int K, int reps) {
    cublasLtHandle_t lt = NULL;
    cublasLtMatmulDesc_t desc = NULL;
    cublasLtMatrixLayout_t la = NULL, lb = NULL, lc = NULL;
    cublasLtMatmulPreference_t pref = NULL;
    const cublasOperation_t opT = CUBLAS_OP_T, opN = CUBLAS_OP_N;
    const cublasLtMatmulMatrixScale_t mode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC16_UE4M3;
    uint64_t ws_bytes = 32u << 20;
    void *ws = NULL;
    cublasLtMatmulHeuristicResult_t res;
    int n_res = 0;
    /* out^T [N, M] = (b as [K, N])^T (a as [K, M]): A is the weights, B the rows */
    const int ok =
        cudaMalloc(&ws, ws_bytes) == cudaSuccess && cublasLtCreate(&lt) == CUBLAS_STATUS_SUCCESS &&
        cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F) == 0 &&
        cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &opT, sizeof opT) == 0 &&
        cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &opN, sizeof opN) == 0 &&
        cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode,
                                       sizeof mode) == 0 &&
        cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode,
                                       sizeof mode) == 0 &&
        cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &d->sfb,
                                       sizeof d->sfb) == 0 &&
        cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &d->sfa,
                                       sizeof d->sfa) == 0 &&
        cublasLtMatrixLayoutCreate(&la, CUDA_R_4F_E2M1, K, N, K) == 0 &&
        cublasLtMatrixLayoutCreate(&lb, CUDA_R_4F_E2M1, K, M, K) == 0 &&
        cublasLtMatrixLayoutCreate(&lc, CUDA_R_32F, N, M, N) == 0 &&
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
        for (int r = 0; r < 3 + reps; r++) {
            if (r == 3) cudaEventRecord(e0, cuda_stream());
            status |= cublasLtMatmul(lt, desc, &alpha, d->b, la, d->a, lb, &beta, d->out, lc,
                                     d->out, lc, &res.algo, ws, ws_bytes, cuda_stream());
        }
        cudaEventRecord(e1, cuda_stream());
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
    cudaFree(ws);
    return s;
}

/* device-to-device copy rate of 1 GiB (bytes read + written over time, counted once) */
static double copy_gbs(void) {
    const size_t bytes = (size_t)1 << 30;
    void *a = NULL, *b = NULL;
    if (cudaMalloc(&a, bytes) != cudaSuccess || cudaMalloc(&b, bytes) != cudaSuccess) return NAN;
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, cuda_stream());
    cudaEventRecord(e0, cuda_stream());
    for (int r = 0; r < 5; r++)
        cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, cuda_stream());
    cudaEventRecord(e1, cuda_stream());
    cudaEventSynchronize(e1);
    float ms = 0.0f;
    cudaEventElapsedTime(&ms, e0, e1);
    cudaFree(a);
    cudaFree(b);
    return 5.0 * (double)bytes / (ms / 1e3) / 1e9;
}

static void figures(void) {
    printf("\nfigures (time per call, mean of the timed calls after 3 untimed)\n");
    static const int shapes[][2] = {{1536, 2048}, {4096, 2048}, {1536, 7168}, {4096, 7168}};
    const int rows8[8] = {4096, 4096, 4096, 4096, 4096, 4096, 4096, 4096};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        const int N = shapes[s][0], K = shapes[s][1];
        nv4_case c = case_make(8, rows8, N, K, 0);
        nv4_dev d = dev_make(&c);
        const double t = time_case(&c, &d, 20), flop = 2.0 * 8 * 4096 * (double)N * K;
        /* the peer: one GEMM of the same rows against expert 0's weights */
        const double tl = cublaslt_nvfp4_seconds(&d, 8 * 4096, N, K, 20);
        printf("  8 experts x 4096 rows, N %-5d K %-5d  %8.1f us  %6.0f TFLOP/s   cuBLASLt NVFP4 "
               "(one GEMM) %8.1f us  %6.0f TFLOP/s  (%.2f of it)\n",
               N, K, t * 1e6, flop / t / 1e12, tl * 1e6, flop / tl / 1e12, tl / t);
        dev_free(&d);
        case_free(&c);
    }
    const double gbs = copy_gbs();
    printf("  device copy of 1 GiB: %.0f GB/s\n", gbs);
    static const int decode_rows[] = {1, 8, 16, 64};
    for (size_t i = 0; i < sizeof decode_rows / sizeof decode_rows[0]; i++) {
        int rows[8];
        for (int e = 0; e < 8; e++)
            rows[e] = decode_rows[i];
        for (int s = 0; s < 2; s++) { /* Qwen3-30B-A3B's gate_up, DeepSeek-V3's */
            const int N = s ? 4096 : 1536, K = s ? 7168 : 2048;
            nv4_case c = case_make(8, rows, N, K, 0);
            nv4_dev d = dev_make(&c);
            const double t = time_case(&c, &d, 50);
            const double wbytes = 8.0 * N * K * (0.5 + 1.0 / 16);
            printf(
                "  8 experts x %-2d rows, N %-5d K %-5d  %8.1f us  weights %6.0f GB/s  (%.0f%% of "
                "the copy rate)\n",
                decode_rows[i], N, K, t * 1e6, wbytes / t / 1e9, 100.0 * wbytes / t / 1e9 / gbs);
            dev_free(&d);
            case_free(&c);
        }
    }
}

int main(void) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    char err[256];
    const ops *gpu = ops_cuda(0, err, sizeof err);
    if (!gpu) {
        printf("skipped: %s\n", err);
        printf("0 passed, 0 failed\n");
        return 0;
    }
    if (!cuda_nvfp4_sm100_available()) {
        printf("skipped: the kernel is built for sm_100a (compute capability 10.0: B200, GB200)\n");
        printf("0 passed, 0 failed\n");
        return 0;
    }
    printf("NVFP4 grouped GEMM (tcgen05, sm_100a) against the CPU\n");
    check_case("uneven experts", 5, (const int[]){0, 1, 130, 255, 7}, 256, 512, 1);
    check_case("one stage of k", 2, (const int[]){128, 3}, 128, 256, 0);
    check_case("whole blocks", 3, (const int[]){128, 128, 256}, 128, 2048, 0);
    check_case("Qwen3-30B-A3B gate_up", 4, (const int[]){40, 1, 300, 128}, 1536, 2048, 0);
    check_case("Qwen3-30B-A3B down", 3, (const int[]){17, 200, 64}, 2048, 768, 0);
    check_case("DeepSeek-V3 gate_up, 512 of its rows", 2, (const int[]){130, 9}, 512, 7168, 0);
    figures();
    CHECK_SUMMARY();
}

#else

int main(void) {
    printf("skipped: this build has no CUDA (nvcc not found, or make CUDA=0)\n");
    printf("0 passed, 0 failed\n");
    return 0;
}

#endif
