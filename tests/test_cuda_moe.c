/* CUDA moe_experts against the CPU reference, in both matmul precisions, and its speed.
 *
 * ops_cuda()->prepare_experts + ->moe_experts on device buffers against ops_cpu()->moe_experts on
 * the same host tensors: random BF16 expert weights (windows at different offsets into one random
 * pool per model, so hundreds of experts cost little host memory while every expert differs),
 * random fp32 x (never zeros), routing random (K distinct experts per token), balanced (every
 * expert T*K/E pairs), skewed (every slot to one expert), with skipped slots (negative ids), all
 * slots skipped, T = 0. Shapes: small odd ones (E=3, D=40, F=24, K=2, T=1..37, also F32 and F16
 * weights), the tiny test model's (E=8, D=64, F=64, K=2), Qwen3-30B-A3B's (E=128, D=2048, F=768,
 * K=8) and a DeepSeek-V3-like one (E=256, D=7168, F=2048, K=8) where memory allows. Large batches
 * are compared on a spread subset of their tokens (a token's result does not depend on the others).
 * Every case runs in both precisions (ops_cuda_set_matmul_precision "high" and "medium") on the
 * same inputs against one CPU reference.
 *
 * Tolerance, medium. The GPU rounds x and the hidden h = silu(g) * u to BF16 (8 significant bits:
 * relative error <= 2^-8 each, about 2^-8 / sqrt(3) = 2.3e-3 rms); the CPU keeps both in fp32; both
 * read the same BF16 weights and accumulate in fp32. The roundings enter dot products of
 * random-sign terms, so an output element's error spreads like 3e-3 to 4e-3 of its row's rms (x's
 * rounding reaches y through g and u, h's directly), and the largest of D of them stays within
 * about 4 to 5 spreads (1.2e-2 to 1.5e-2 seen on the shapes with D >= 64, up to 1.9e-2 with
 * D = 40). Allowed: max |gpu - cpu| over a row <= 2^-5 * rms(cpu row).
 *
 * Tolerance, high. x and h travel as hi + lo, two BF16 numbers; what is left is lo's rounding,
 * <= 2^-8 |a - hi| <= 2^-16 |a|: at most 2^-8 of medium's error per element, typically less since
 * |a - hi| spreads below its bound. Medium's largest seen, 1.9e-2, scaled by 2^-8 is 7.4e-5:
 * allowed 2^-13 (1.2e-4) for it, medium's 2^-5 scaled by 2^-8. At this level the sums count too:
 * the tensor cores add each k16 step into the accumulator with truncation toward zero (up to an
 * ulp, 2^-23 of |acc|, per step, on average half of it, biased, so it grows with the steps, unlike
 * the CPU's rounding to nearest). That error reaches g and u in D/16 steps, y in F/16 more, both g
 * and u enter h, and a row's largest element sits about 4 rms out: allowed 2^-21 (8 x 2^-24) of the
 * row rms per step. Together: 2^-13 + (D + F) / 16 * 2^-21 of the row rms; 1.2e-4 at D = 40, 2.1e-4
 * for Qwen3-30B-A3B, 4.0e-4 for the DeepSeek-V3-like shape. A model of these sums (exact products,
 * fp32 accumulator truncated per k16 step) gave 2.9e-5, 2.9e-5 and 8.9e-5 on random data; seen on
 * the H200: 3.0e-5 (small, tiny), 3.6e-5 and 8.9e-5, against medium's 1.9e-2, 1.5e-2 and 1.4e-2.
 *
 * NVFP4 experts (cuda_prepare_experts_nvfp4; shapes E=8, D=256, F=128, K=2, and with --nvfp4
 * Qwen3-30B-A3B's):
 * the weights quantized by kernels/cpu/quant.c, the CPU reading the dequantized fp32 weights
 * e2m1(q) e4m3(sf) s2. The GPU decodes e2m1(q) e4m3(sf), exact in BF16, and multiplies the sums by
 * s2 (one more fp32 rounding): BF16's tolerances above. `--nvfp4` runs these alone and times them
 * at decode sizes (weight bytes: codes and scales, 0.5625 a weight).
 *
 * FP8 experts (W8A16, cuda_prepare_experts_fp8; the same shapes, and D=320, F=192 for partial
 * 128-k blocks): the weights quantized by kernels/cpu/quant.c in 128 x 128 blocks, the CPU
 * reading the dequantized fp32 weights e4m3(q) s. The GPU decodes e4m3(q), exact in BF16, sums
 * each 128 k apart and adds the sum times s into the total (one fp32 fma a block): BF16's
 * tolerances. `--fp8` runs these alone and times them (weight bytes: 1 a weight and the scales).
 *
 * F32 / F16 weights are rounded to BF16 in the device copy while the CPU reads them as they are: a
 * rounding in every term of both dot products, the same in both precisions (2.5e-2 seen at D = 40
 * in medium): allowed 2^-4 * rms in both. Exact in both: skipped rows keep their sentinel bit for
 * bit; a token run alone gives bit-identical rows (batch invariance, across tile shapes); the same
 * call twice gives bit-identical output.
 *
 * Timing (CUDA events on the backend's stream, after warm-up, median), both precisions side by side
 * on the same inputs: microseconds per call; for decode sizes the bytes of expert weights the
 * routing touches (busy experts x 3 F D x 2) over the time, against the device copy bandwidth
 * measured here (cudaMemcpyAsync device to device of 1 GiB, bytes read + written), and beside it
 * the time of a device copy moving as many bytes (half read, half written: what fixed costs leave
 * of the copy rate at that size); routings rotate among 8 sets so the weights do not sit in L2.
 * Sizes: T = 1, 2, 4, 8, then mean pairs per expert 1, 2, ..., 64 (T = E / K * 2^i), random
 * routing, for Qwen3-30B-A3B and the DeepSeek-V3-like shape. For T = 4096 with balanced routing:
 * TFLOP/s (6 T K D F flops, the useful ones: high does twice the tensor work for them) beside
 * cuBLAS run per expert on the same grouping (cublasGemmEx BF16 in, fp32 accumulate: gate_up then
 * down, 2 E launches; it gets its tokens pre-gathered and does no SiLU, gather or scatter).
 *
 *   test_cuda_moe           everything
 *   test_cuda_moe --small   only the small and tiny shapes (quick; for compute-sanitizer)
 *   test_cuda_moe --timing [MAX_T]           only the Qwen3 timings up to MAX_T tokens, no
 *                                            comparisons (quick; for a profiler)
 *   test_cuda_moe --timing-deepseek [MAX_T]  the same for the DeepSeek-V3-like shape
 *   test_cuda_moe --decode                   only the Qwen3 comparisons up to T = 64
 *   test_cuda_moe --nvfp4                    only the NVFP4 comparisons, and their timings
 *   test_cuda_moe --nvfp4-timing T           the Qwen3 NVFP4 timing at T tokens alone
 *   test_cuda_moe --fp8 [C]                  only the FP8 comparisons, and their timings
 *   test_cuda_moe --fp8-timing T [C]         the Qwen3 FP8 timing at T tokens alone
 *                                            (C: the FP8 x FP8 GEMM's tile configuration)
 *   test_cuda_moe --deepseek-q-timing E T..  FP8 and NVFP4 experts of DeepSeek-V3's shape (E of
 *                                            them, top-8; fewer than 256 keep the host's fp32
 *                                            copies small) timed at each T
 *   test_cuda_moe --deepseek-fp8-timing E T..
 *                                            FP8 alone, in the FP8 x FP8 GEMM's configuration
 *                                            $FP8G_CONFIG
 *   test_cuda_moe --deepseek-nvfp4-timing E T..
 *                                            NVFP4 alone
 * With MOE_TIMING_PROFILE set, each timing is one warm-up call and one timed call, without the
 * chain of calls: four launches of the experts' GEMMs a size and precision, for a profiler.
 *
 * Without a CUDA build or a usable GPU: "skipped: <reason>", 0 passed, 0 failed. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/log.h"
#include "common/tensor.h"
#include "kernels/a2a.h"
#include "kernels/ops.h"
#include "kernels/quant.h"
#include "tests/check.h"

#ifndef MOESERVE_CUDA

int main(void) {
    printf("skipped: built without CUDA\n");
    CHECK_SUMMARY();
}

#else

/* The C tests build without the CUDA include path: the few runtime and cuBLAS entry points this test
 * calls, with their C signatures from cuda_runtime_api.h and cublas_api.h (enums as int). */
typedef struct CUstream_st *cudaStream_t;
typedef struct CUevent_st *cudaEvent_t;
typedef struct cublasContext *cublasHandle_t;
int cudaEventCreate(cudaEvent_t *ev);
int cudaEventDestroy(cudaEvent_t ev);
int cudaEventRecord(cudaEvent_t ev, cudaStream_t s);
int cudaEventSynchronize(cudaEvent_t ev);
int cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t end);
int cudaMemcpyAsync(void *dst, const void *src, size_t bytes, int kind, cudaStream_t s);
int cudaMemGetInfo(size_t *free_bytes, size_t *total_bytes);
const char *cudaGetErrorString(int e);
int cublasCreate_v2(cublasHandle_t *h);
int cublasDestroy_v2(cublasHandle_t h);
int cublasSetStream_v2(cublasHandle_t h, cudaStream_t s);
int cublasGemmEx(cublasHandle_t h, int transa, int transb, int m, int n, int k, const void *alpha,
                 const void *A, int Atype, int lda, const void *B, int Btype, int ldb,
                 const void *beta, void *C, int Ctype, int ldc, int compute_type, int algo);
#define CUDA_MEMCPY_D2D     3
#define CUBLAS_OP_N_        0
#define CUBLAS_OP_T_        1
#define CUDA_R_32F_         0
#define CUDA_R_16BF_        14
#define CUBLAS_COMPUTE_32F_ 68
#define CUBLAS_GEMM_DEFAULT_ (-1)
typedef struct CUgraph_st *cudaGraph_t;
typedef struct CUgraphExec_st *cudaGraphExec_t;
int cudaStreamBeginCapture(cudaStream_t s, int mode);
int cudaStreamEndCapture(cudaStream_t s, cudaGraph_t *g);
int cudaGraphInstantiateWithFlags(cudaGraphExec_t *e, cudaGraph_t g, unsigned long long flags);
int cudaGraphLaunch(cudaGraphExec_t e, cudaStream_t s);
int cudaGraphExecDestroy(cudaGraphExec_t e);
int cudaGraphDestroy(cudaGraph_t g);
int cudaGetLastError(void);
#define CUDA_CAPTURE_THREAD_LOCAL 1
/* kernels/cuda/cuda_ops.h: the stream every op of the backend runs on. */
cudaStream_t cuda_stream(void);

#define TOL_ROW_RMS_HIGH      (1.0 / 8192)    /* 2^-13: BF16 weights, x and h as hi + lo ... */
#define TOL_ROW_RMS_HIGH_STEP (1.0 / 2097152) /* ... plus 2^-21 per k16 step of both GEMMs */
#define TOL_ROW_RMS_MEDIUM    0.03125         /* 2^-5: BF16 weights, x and h rounded */
#define TOL_ROW_RMS_CONVERTED 0.0625          /* 2^-4: F32 / F16 weights rounded to BF16 as well */
#define TOL_FP8_H             0.5      /* 2^-1: an element, h on the FP8 grid (run_case: why) */
#define TOL_FP8_H_RMS         0.015625 /* 2^-6: all the rows' errors together, h on the FP8 grid */
#define SENTINEL    (-7.25f)
#define POOL_SPREAD (1 << 20) /* elements past one matrix that expert windows start within */
#define N_PRECISIONS          2

static const ops *gpu, *cpu;

/* ---- the two precisions, indexed by matmul_precision ---- */

static const char *precision_name[N_PRECISIONS] = {"high", "medium"};

static void set_precision(matmul_precision p) {
    char err[256] = "";
    if (ops_cuda_set_matmul_precision(precision_name[p], err, sizeof err) != 0) {
        fprintf(stderr, "FAIL: ops_cuda_set_matmul_precision(%s): %s\n", precision_name[p], err);
        printf("%d passed, %d failed\n", check_passed, check_failed + 1);
        exit(1);
    }
}

/* The worst max|gpu - cpu| / rms per shape and precision, for the summary. */
typedef struct {
    char name[32];
    double worst[N_PRECISIONS];
    int cases;
} worst_row;

static worst_row worst_rows[16];
static int n_worst_rows;

static void note_worst(const char *name, matmul_precision p, double w) {
    int i = 0;
    while (i < n_worst_rows && strcmp(worst_rows[i].name, name) != 0)
        i++;
    if (i == n_worst_rows) {
        if (n_worst_rows == (int)(sizeof worst_rows / sizeof worst_rows[0])) return;
        memset(&worst_rows[i], 0, sizeof worst_rows[i]);
        snprintf(worst_rows[i].name, sizeof worst_rows[i].name, "%s", name);
        n_worst_rows++;
    }
    if (w > worst_rows[i].worst[p]) worst_rows[i].worst[p] = w;
    worst_rows[i].cases += p == MATMUL_PRECISION_HIGH;
}

/* ---- random inputs ---- */

static uint64_t rng_state = 0x853c49e6748fea9bull;

static uint64_t rng_next(void) { /* splitmix64 */
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Uniform in [-1, 1), never exactly zero. */
static float rng_uniform(void) {
    float f;
    do {
        f = (float)((double)(rng_next() >> 40) * (1.0 / 8388608.0) - 1.0);
    } while (f == 0.0f);
    return f;
}

static double rng_unit(void) { return (double)(rng_next() >> 11) * (1.0 / 9007199254740992.0); }

/* float32 -> IEEE half, round to nearest even; values under the half normal range become zero. */
static uint16_t f32_to_f16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    const int exp = (int)((u >> 23) & 0xffu) - 127 + 15;
    const uint32_t mant = u & 0x7fffffu;
    if (exp <= 0) return sign;
    if (exp >= 31) return sign | 0x7c00u;
    uint32_t h = ((uint32_t)exp << 10) | (mant >> 13);
    const uint32_t rest = mant & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h++;
    return (uint16_t)(sign | h);
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* kernels/cuda/fp8_gemm.cu, for tests: whether GEMM 1 of FP8 experts takes the FP8 tensor cores
 * for n_pairs pairs over E experts of shape D, F, at the precision and mode in force */
int cuda_moe_fp8_w8a8(int64_t n_pairs, int E, int D, int F);
int cuda_moe_fp8_w8a8_down(int64_t n_pairs, int E, int D, int F);
int cuda_moe_bf16_wgmma(int64_t n_pairs, int E, int D, int F, int high);
/* tests: the BF16 wgmma kernels' least pairs an expert and the swapped one's most (< 0 the
 * variables MOESERVE_WGMMA_MIN, MOESERVE_WGMMA_SWAP_MAX); the old setting */
int cuda_moe_bf16_wgmma_min(int pairs);
int cuda_moe_bf16_swap_max(int pairs);
int cuda_moe_bf16_wgmma_tail(int rows);
void cuda_moe_bf16_swap_na(int na);
int cuda_moe_bf16_swap_gather(int on);
int cuda_moe_w4_wgmma_takes(int64_t n_pairs, int E, int D, int F, int high);
int cuda_moe_w8_wgmma_takes(int64_t n_pairs, int E, int D, int F, int high);
/* kernels/cuda/bf16_gemm.cu: the FP8 experts on the wgmma kernel in high precision from now on
 * (1 on, 0 off, -1 as MOESERVE_W8A16_WGMMA says: on unless 0); returns the setting before */
int cuda_moe_w8_wgmma(int on);
int cuda_moe_bf16_one_chain(int D, int F);
int cuda_moe_q_one_chain(void);
/* kernels/cuda/moe_lean.cu: high precision's products stacked (MOESERVE_LEAN_STACK) for NVFP4
 * (1), NVFP4 and FP8 (2), neither (0) or as the variable says (-1), returning the setting before;
 * and whether the switch stacks NVFP4's (w8 0) or FP8's (1) now (form 0 never stacks them) */
int cuda_moe_lean_stack(int on);
int cuda_moe_lean_stacked(int w8);
/* kernels/cuda/fp8_gemm.cu: the FP8 x FP8 GEMM's tile configuration from now on (returns the
 * old one) */
int cuda_fp8_grouped_gemm_config(int config);

/* ---- a model's experts ---- */

typedef struct {
    const char *name;
    int E, D, F, K;
    dtype dt;
    moe_experts w;
    tensor *gate, *up, *down; /* [E] host tensors, windows into the pools */
    void *pool_in, *pool_out; /* gate/up values scaled by sqrt(3/D), down values by sqrt(3/F) */
    double wbytes;            /* device bytes per weight: 2 (BF16), 0.5625 (NVFP4: codes, scales) */
    bool quantized;           /* model_nvfp4's, model_fp8's: the host tensors are the dequantized
                                 weights, which the device decodes exactly */
    float *deq;               /* model_nvfp4's, model_fp8's: their storage */
    bool fp8_input;           /* model_fp8's: x rounded to the FP8 payload's grid first, as the
                                 experts receive it served (medium precision's GEMM 1 at prefill
                                 sizes quantizes x itself, fp8_gemm.h) */
} model;

static void *make_pool(dtype dt, size_t n, float scale) {
    void *p = xmalloc(n * dtype_size(dt));
    for (size_t i = 0; i < n; i++) {
        const float v = rng_uniform() * scale;
        if (dt == DTYPE_BF16)
            ((uint16_t *)p)[i] = f32_to_bf16(v);
        else if (dt == DTYPE_F16)
            ((uint16_t *)p)[i] = f32_to_f16(v);
        else
            ((float *)p)[i] = v;
    }
    return p;
}

/* Window idx of a pool: a multiple of 8 elements in [0, POOL_SPREAD). */
static void *pool_window(void *pool, dtype dt, int idx) {
    const size_t off = ((size_t)idx * 104729u * 8u) % POOL_SPREAD;
    return (char *)pool + off * dtype_size(dt);
}

static void model_init(model *m, const char *name, int E, int D, int F, int K, dtype dt) {
    memset(m, 0, sizeof *m);
    m->name = name;
    m->E = E;
    m->D = D;
    m->F = F;
    m->K = K;
    m->dt = dt;
    const size_t n = (size_t)F * D + POOL_SPREAD;
    m->pool_in = make_pool(dt, n, sqrtf(3.0f / D));
    m->pool_out = make_pool(dt, n, sqrtf(3.0f / F));
    m->gate = xcalloc((size_t)E, sizeof(tensor));
    m->up = xcalloc((size_t)E, sizeof(tensor));
    m->down = xcalloc((size_t)E, sizeof(tensor));
    for (int e = 0; e < E; e++) {
        tensor *g = &m->gate[e], *u = &m->up[e], *d = &m->down[e];
        g->dtype = u->dtype = d->dtype = dt;
        g->ndim = u->ndim = d->ndim = 2;
        g->device = u->device = d->device = DEVICE_CPU;
        g->shape[0] = u->shape[0] = F;
        g->shape[1] = u->shape[1] = D;
        d->shape[0] = D;
        d->shape[1] = F;
        g->data = pool_window(m->pool_in, dt, 2 * e);
        u->data = pool_window(m->pool_in, dt, 2 * e + 1);
        d->data = pool_window(m->pool_out, dt, e);
    }
    m->w.E = E;
    m->w.gate = m->gate;
    m->w.up = m->up;
    m->w.down = m->down;
    m->wbytes = 2.0;
}

/* 0 when the experts are on the device. */
static int model_prepare(model *m) {
    char err[256] = "";
    const double t0 = now_s();
    const int rc = gpu->prepare_experts(&m->w, err, sizeof err);
    const double dt = now_s() - t0;
    CHECK(rc == 0, "%s: prepare_experts: %s", m->name, err);
    if (rc) return -1;
    CHECK(m->w.gate_up && m->w.down_all && m->w.wdtype == DTYPE_BF16, "%s: backend copies",
          m->name);
    const double gib = (double)m->E * 3 * m->F * m->D * 2 / (1 << 30);
    printf("%s: prepare_experts (%s weights): %.2f GiB of BF16 in %.2f s (%.1f GB/s)\n", m->name,
           dtype_name(m->dt), gib, dt, gib * 1.073741824 / dt);
    return 0;
}

static void model_free(model *m) {
    if (m->w.gate_up) gpu->dev_free(m->w.gate_up);
    if (m->w.down_all) gpu->dev_free(m->w.down_all);
    if (m->w.gate_up_sf) gpu->dev_free(m->w.gate_up_sf);
    if (m->w.down_sf) gpu->dev_free(m->w.down_sf);
    if (m->w.s2) gpu->dev_free(m->w.s2);
    free(m->deq);
    free(m->gate);
    free(m->up);
    free(m->down);
    free(m->pool_in);
    free(m->pool_out);
    memset(m, 0, sizeof *m);
}

/* ---- routing ---- */

enum { ROUTE_RANDOM, ROUTE_BALANCED, ROUTE_ONE, ROUTE_NONE };
static const char *route_name[] = {"random", "balanced", "one", "none"};

/* ids[T, K]: random = K distinct experts per token; balanced = (t K + k) mod E; one = every slot
 * to expert E - 1; none = every slot skipped. Then each slot is skipped (a negative id) with
 * probability skip. */
static void make_routing(int32_t *ids, int T, int K, int E, int mode, double skip) {
    int *perm = xmalloc((size_t)E * sizeof(int));
    for (int e = 0; e < E; e++)
        perm[e] = e;
    for (int t = 0; t < T; t++)
        for (int k = 0; k < K; k++) {
            int32_t id;
            if (mode == ROUTE_RANDOM) {
                const int j = k + (int)(rng_next() % (uint64_t)(E - k));
                const int tmp = perm[k];
                perm[k] = perm[j];
                perm[j] = tmp;
                id = perm[k];
            } else if (mode == ROUTE_BALANCED) {
                id = (int32_t)(((int64_t)t * K + k) % E);
            } else if (mode == ROUTE_ONE) {
                id = E - 1;
            } else {
                id = -1;
            }
            if (skip > 0 && rng_unit() < skip) id = -1 - (int32_t)(rng_next() % 3);
            ids[(int64_t)t * K + k] = id;
        }
    free(perm);
}

/* Experts with at least one routed slot. */
static int busy_experts(const int32_t *ids, int64_t n, int E) {
    char *seen = xcalloc((size_t)E, 1);
    int busy = 0;
    for (int64_t i = 0; i < n; i++)
        if (ids[i] >= 0 && !seen[ids[i]]) {
            seen[ids[i]] = 1;
            busy++;
        }
    free(seen);
    return busy;
}

/* ---- the GPU op on host arrays ---- */

static void *dev_alloc_checked(size_t bytes) {
    void *p = gpu->dev_alloc(bytes);
    if (!p) {
        fprintf(stderr, "FAIL: out of device memory for %zu bytes\n", bytes);
        printf("%d passed, %d failed\n", check_passed, check_failed + 1);
        exit(1);
    }
    return p;
}

/* out_h[T, K, D] = the GPU's moe_experts with out starting as SENTINEL everywhere. */
static void gpu_moe(const model *m, float *out_h, const float *x_h, const int32_t *ids_h, int T) {
    const size_t nx = (size_t)T * m->D, no = (size_t)T * m->K * m->D, ni = (size_t)T * m->K;
    float *x = dev_alloc_checked(nx * 4 + 4), *out = dev_alloc_checked(no * 4 + 4);
    int32_t *ids = dev_alloc_checked(ni * 4 + 4);
    for (size_t i = 0; i < no; i++)
        out_h[i] = SENTINEL;
    gpu->to_device(out, out_h, no * 4);
    gpu->to_device(x, x_h, nx * 4);
    gpu->to_device(ids, ids_h, ni * 4);
    gpu->moe_experts(out, x, ids, &m->w, T, m->K, m->D, m->F);
    gpu->to_host(out_h, out, no * 4);
    gpu->dev_free(x);
    gpu->dev_free(out);
    gpu->dev_free(ids);
}

static bool is_sentinel_row(const float *row, int D) {
    const float s = SENTINEL;
    for (int d = 0; d < D; d++)
        if (memcmp(&row[d], &s, sizeof s) != 0) return false;
    return true;
}

/* The high precision's tolerance on a row, over its rms (see the header). */
static double tol_high(const model *m) {
    return TOL_ROW_RMS_HIGH + (double)(m->D + m->F) / 16 * TOL_ROW_RMS_HIGH_STEP;
}

/* Compares the GPU's rows (out[T, K, D]) of the checked tokens tok[ns] with the CPU's (ref[ns, K,
 * D], slots is[ns, K]); prints the first mismatches. Returns the worst max|err| / rms over the rows
 * and counts the rows over tol * rms into *n_bad, the rows compared into *n_rows. */
/* The CPU reference where GEMM 2 runs on the FP8 tensor cores as well (cuda_moe_fp8_w8a8_down:
 * medium precision from 16 pairs an expert): h = silu(gate x) * (up x) rounded to BF16, as GEMM 1
 * stores it, then through the FP8 payload's round trip (per row per 128 channels, quant_fp8_rows),
 * then down; ref [ns, K, D] as cpu->moe_experts writes it, skipped slots left alone. */
static void ref_w8a8_down(float *ref, const model *m, const float *xs, const int32_t *is, int ns) {
    const int K = m->K, D = m->D, F = m->F;
    float *g = xmalloc((size_t)F * sizeof(float)), *u = xmalloc((size_t)F * sizeof(float));
    float *sc = xmalloc((size_t)(F + 127) / 128 * sizeof(float));
    uint8_t *q = xmalloc((size_t)F);
    for (int i = 0; i < ns; i++)
        for (int k = 0; k < K; k++) {
            const int e = is[i * K + k];
            if (e < 0) continue;
            cpu->linear(g, xs + (size_t)i * D, &m->gate[e], 1, F, D);
            cpu->linear(u, xs + (size_t)i * D, &m->up[e], 1, F, D);
            cpu->silu_mul(g, g, u, 1, F);
            for (int j = 0; j < F; j++)
                g[j] = bf16_to_f32(f32_to_bf16(g[j]));
            quant_fp8_rows(q, sc, g, 1, F);
            dequant_fp8_rows(g, q, sc, 1, F);
            cpu->linear(ref + ((size_t)i * K + k) * D, g, &m->down[e], 1, D, F);
        }
    free(g);
    free(u);
    free(sc);
    free(q);
}

static double compare_rows(const model *m, const char *what, int T, const float *out,
                           const float *ref, const int32_t *is, const int *tok, int ns, double tol,
                           int *n_rows, int *n_bad) {
    const int K = m->K, D = m->D;
    double worst = 0.0;
    *n_rows = *n_bad = 0;
    for (int i = 0; i < ns; i++)
        for (int k = 0; k < K; k++) {
            if (is[i * K + k] < 0) continue;
            const float *r = ref + ((size_t)i * K + k) * D;
            const float *g = out + ((size_t)tok[i] * K + k) * D;
            double ss = 0.0, err = 0.0;
            int at = 0;
            for (int d = 0; d < D; d++) {
                ss += (double)r[d] * r[d];
                const double e = fabs((double)g[d] - r[d]);
                if (!(e <= err)) {
                    err = e;
                    at = d;
                }
            }
            const double rms = sqrt(ss / D);
            const double ratio = err / rms;
            (*n_rows)++;
            if (!(ratio <= worst)) worst = ratio;
            if (!(err <= tol * rms)) {
                if (*n_bad < 5)
                    fprintf(stderr,
                            "  mismatch %s %s T=%d t=%d k=%d expert %d d=%d: gpu %.9g cpu %.9g "
                            "(row rms %.4g)\n",
                            m->name, what, T, tok[i], k, is[i * K + k], at, g[at], r[at], rms);
                (*n_bad)++;
            }
        }
    return worst;
}

/* One batch, in each precision on the same inputs: the GPU over all T tokens against the CPU
 * (computed once) on up to max_check tokens spread over the batch (first and last included);
 * skipped rows, batch invariance (token T-1 alone) and, when repeat, a second identical call.
 * worst[p] (when not NULL) = the worst max|err| / rms over the compared rows in precision p. The
 * precision is left at high, the default. */
static void run_case(const model *m, int T, int mode, double skip, int max_check, bool repeat,
                     double *worst) {
    const int K = m->K, D = m->D;
    const int64_t n_pairs = (int64_t)T * K;
    float *x = xmalloc(((size_t)T * D + 1) * sizeof(float));
    int32_t *ids = xmalloc(((size_t)n_pairs + 1) * sizeof(int32_t));
    float *out = xmalloc(((size_t)n_pairs * D + 1) * sizeof(float));
    for (int64_t i = 0; i < (int64_t)T * D; i++)
        x[i] = rng_uniform();
    if (m->fp8_input && T > 0) { /* the FP8 payload's round trip (kernels/cpu/quant.c) */
        uint8_t *q = xmalloc((size_t)T * D);
        float *sc = xmalloc(sizeof(float) * (size_t)T * ((D + 127) / 128));
        quant_fp8_rows(q, sc, x, T, D);
        dequant_fp8_rows(x, q, sc, T, D);
        free(q);
        free(sc);
    }
    make_routing(ids, T, K, m->E, mode, skip);

    /* the CPU reference on a spread subset of the tokens */
    const int ns = T < max_check ? T : max_check;
    float *xs = xmalloc(((size_t)ns * D + 1) * sizeof(float));
    int32_t *is = xmalloc(((size_t)ns * K + 1) * sizeof(int32_t));
    float *ref = xmalloc(((size_t)ns * K * D + 1) * sizeof(float));
    int *tok = xmalloc(((size_t)ns + 1) * sizeof(int));
    for (int i = 0; i < ns; i++) {
        tok[i] = ns == 1 ? T - 1 : (int)((int64_t)i * (T - 1) / (ns - 1));
        memcpy(xs + (size_t)i * D, x + (size_t)tok[i] * D, (size_t)D * sizeof(float));
        memcpy(is + (size_t)i * K, ids + (size_t)tok[i] * K, (size_t)K * sizeof(int32_t));
    }
    for (size_t i = 0; i < (size_t)ns * K * D; i++)
        ref[i] = SENTINEL;
    if (ns > 0) cpu->moe_experts(ref, xs, is, &m->w, ns, K, D, m->F);

    for (int pi = 0; pi < N_PRECISIONS; pi++) {
        const matmul_precision p = (matmul_precision)pi;
        const char *pn = precision_name[p];
        /* NVFP4, FP8: the weights reach the tensor cores exactly (e2m1 x e4m3, e4m3 in BF16), the
         * tensor scale or block scales after the sums: BF16's tolerances */
        const double tol = m->dt != DTYPE_BF16 && !m->quantized ? TOL_ROW_RMS_CONVERTED
                           : p == MATMUL_PRECISION_HIGH ? tol_high(m)
                                                        : TOL_ROW_RMS_MEDIUM;
        set_precision(p);
        gpu_moe(m, out, x, ids, T);
        /* GEMM 2 on the FP8 tensor cores: h on the FP8 grid in the reference too */
        const bool w8a8_down = m->fp8_input && cuda_moe_fp8_w8a8_down(n_pairs, m->E, D, m->F);
        float *ref_p = ref;
        if (w8a8_down) {
            ref_p = xmalloc(((size_t)ns * K * D + 1) * sizeof(float));
            memcpy(ref_p, ref, ((size_t)ns * K * D + 1) * sizeof(float));
            ref_w8a8_down(ref_p, m, xs, is, ns);
        }

        /* every row: skipped ones keep the sentinel, computed ones are finite */
        int64_t bad_skip = 0, bad_kept = 0;
        for (int64_t q = 0; q < n_pairs; q++) {
            const float *row = out + q * D;
            if (ids[q] < 0) {
                bad_skip += !is_sentinel_row(row, D);
            } else {
                bool ok = !is_sentinel_row(row, D);
                for (int d = 0; d < D && ok; d++)
                    ok = isfinite(row[d]);
                bad_kept += !ok;
            }
        }
        CHECK(bad_skip == 0, "%s %s T=%d %s: %lld skipped rows were written", m->name, pn, T,
              route_name[mode], (long long)bad_skip);
        CHECK(bad_kept == 0, "%s %s T=%d %s: %lld computed rows unwritten or not finite", m->name,
              pn, T, route_name[mode], (long long)bad_kept);

        int n_rows = 0, n_bad = 0;
        double w;
        if (w8a8_down) {
            /* h on the FP8 grid: GEMM 1's sums on the FP8 tensor cores differ from the CPU's in
             * their last bits, so in places h's BF16 rounding or a group's scale differs and a code
             * moves one E4M3 step (2^-3 of its binade); with the test weights' block magnitudes (up
             * to 2^6 apart) one such step can move an output by a tenth of its row's rms. So over
             * all the checked rows together: rms(gpu - ref) within TOL_FP8_H_RMS of rms(ref), and
             * no element past TOL_FP8_H of its row's rms (test_cuda_fp8_gemm checks GEMM 2 itself
             * on the same h codes, tightly). */
            double e2 = 0.0, r2 = 0.0;
            for (int i = 0; i < ns; i++)
                for (int k = 0; k < K; k++) {
                    if (is[i * K + k] < 0) continue;
                    const float *r = ref_p + ((size_t)i * K + k) * D;
                    const float *g = out + ((size_t)tok[i] * K + k) * D;
                    for (int d = 0; d < D; d++) {
                        const double e = (double)g[d] - r[d];
                        e2 += isfinite(e) ? e * e : INFINITY;
                        r2 += (double)r[d] * r[d];
                    }
                }
            const double agg = r2 > 0 ? sqrt(e2 / r2) : sqrt(e2);
            CHECK(agg <= TOL_FP8_H_RMS,
                  "%s %s T=%d %s skip %.2f: rms of the error %.3g of the rms (tol %.3g)", m->name,
                  pn, T, route_name[mode], skip, agg, TOL_FP8_H_RMS);
            w = compare_rows(m, pn, T, out, ref_p, is, tok, ns, TOL_FP8_H, &n_rows, &n_bad);
            printf("  %-16s %-6s T=%-5d %-8s skip %.2f: h on the FP8 grid: rms of the error %.2e "
                   "of the rms (tol %.2e)\n",
                   m->name, pn, T, route_name[mode], skip, agg, TOL_FP8_H_RMS);
            free(ref_p);
        } else {
            w = compare_rows(m, pn, T, out, ref, is, tok, ns, tol, &n_rows, &n_bad);
        }
        CHECK(n_bad == 0, "%s %s T=%d %s skip %.2f: %d of %d rows over %.3g * rms (worst %.3g)",
              m->name, pn, T, route_name[mode], skip, n_bad, n_rows, w8a8_down ? TOL_FP8_H : tol,
              w);
        if (worst) worst[p] = w;
        note_worst(m->name, p, w);

        /* batch invariance: the last token alone gives the same bits as its rows in the batch.
         * Where the batch's GEMM 1 ran on the FP8 tensor cores (medium precision at prefill sizes,
         * outside deterministic mode: other sums than the token alone's W8A16 tiles), or its GEMMs
         * on wgmma in high precision with the tiles' fp32 add of the lo products
         * (MOESERVE_ONE_CHAIN=0), or the lean kernels stack high precision's products
         * (MOESERVE_LEAN_STACK: two sums, where the tiles keep one chain), it stays within the
         * tolerance of them instead. Medium's wgmma sums are the mma.sync tiles' bit for bit.
         */
        if (T > 1) {
            float *one = xmalloc((size_t)K * D * sizeof(float));
            gpu_moe(m, one, x + (size_t)(T - 1) * D, ids + (size_t)(T - 1) * K, 1);
            const float *row = out + (size_t)(T - 1) * K * D;
            const bool other_sums =
                (m->fp8_input && cuda_moe_fp8_w8a8(n_pairs, m->E, D, m->F)) ||
                (!m->quantized && p == MATMUL_PRECISION_HIGH && !cuda_moe_bf16_one_chain(D, m->F) &&
                 cuda_moe_bf16_wgmma(n_pairs, m->E, D, m->F, 1)) ||
                (m->w.wformat == MOE_W_NVFP4 && p == MATMUL_PRECISION_HIGH &&
                 !cuda_moe_q_one_chain() && cuda_moe_w4_wgmma_takes(n_pairs, m->E, D, m->F, 1)) ||
                (m->w.wformat == MOE_W_NVFP4 && p == MATMUL_PRECISION_HIGH &&
                 cuda_moe_lean_stacked(0)) ||
                (m->w.wformat == MOE_W_FP8 && p == MATMUL_PRECISION_HIGH &&
                 cuda_moe_lean_stacked(1)) ||
                (m->w.wformat == MOE_W_FP8 && p == MATMUL_PRECISION_HIGH &&
                 !cuda_moe_q_one_chain() && cuda_moe_w8_wgmma_takes(n_pairs, m->E, D, m->F, 1));
            if (w8a8_down) { /* h on the FP8 grid in the batch: the token alone against the CPU */
                int n1 = 0, bad1 = 0;
                const int last = ns - 1; /* tok[ns - 1] = T - 1 */
                compare_rows(m, pn, 1, one, ref + (size_t)last * K * D, is + (size_t)last * K,
                             (int[]){0}, 1, tol, &n1, &bad1);
                CHECK(bad1 == 0, "%s %s T=%d %s: token T-1 alone: %d of %d rows over %.3g * rms",
                      m->name, pn, T, route_name[mode], bad1, n1, tol);
            } else if (other_sums) {
                double r2 = 0.0, mx = 0.0;
                for (size_t i = 0; i < (size_t)K * D; i++) {
                    const double d = fabs((double)one[i] - row[i]);
                    mx = d > mx ? d : mx;
                    r2 += (double)row[i] * row[i];
                }
                const double rms = sqrt(r2 / ((double)K * D));
                CHECK(mx <= tol * rms,
                      "%s %s T=%d %s: token T-1 alone %.3g * rms from its rows in the batch "
                      "(other sums there; tolerance %.3g)",
                      m->name, pn, T, route_name[mode], rms > 0 ? mx / rms : mx, tol);
            } else {
                CHECK(memcmp(one, row, (size_t)K * D * sizeof(float)) == 0,
                      "%s %s T=%d %s: token T-1 alone differs from its rows in the batch", m->name,
                      pn, T, route_name[mode]);
            }
            free(one);
        }
        /* run to run: the same call gives the same bits */
        if (repeat) {
            float *again = xmalloc(((size_t)n_pairs * D + 1) * sizeof(float));
            gpu_moe(m, again, x, ids, T);
            CHECK(memcmp(again, out, (size_t)n_pairs * D * sizeof(float)) == 0,
                  "%s %s T=%d %s: a second identical call differs", m->name, pn, T,
                  route_name[mode]);
            free(again);
        }
        printf("  %-16s %-6s T=%-5d %-8s skip %.2f: worst max|gpu-cpu|/rms %.2e (tol %.2e) over "
               "%d rows of %d tokens\n",
               m->name, pn, T, route_name[mode], skip, w, tol, n_rows, ns);
    }
    set_precision(MATMUL_PRECISION_HIGH);
    free(xs);
    free(is);
    free(ref);
    free(tok);
    free(x);
    free(ids);
    free(out);
}

/* T = 0 and every slot skipped leave out untouched, in both precisions. */
static void run_empty_cases(const model *m) {
    const int K = m->K, D = m->D, T = 5;
    float *x = xmalloc((size_t)T * D * sizeof(float)), *out = xmalloc((size_t)T * K * D * 4);
    int32_t *ids = xmalloc((size_t)T * K * sizeof(int32_t));
    float *dout = dev_alloc_checked((size_t)T * K * D * 4);
    for (int i = 0; i < T * D; i++)
        x[i] = rng_uniform();
    for (int pi = 0; pi < N_PRECISIONS; pi++) {
        const char *pn = precision_name[pi];
        set_precision((matmul_precision)pi);
        make_routing(ids, T, K, m->E, ROUTE_NONE, 0.0);
        gpu_moe(m, out, x, ids, T);
        bool all = true;
        for (int p = 0; p < T * K; p++)
            all = all && is_sentinel_row(out + (size_t)p * D, D);
        CHECK(all, "%s %s: every slot skipped: out was written", m->name, pn);
        gpu_moe(m, out, x, ids, 0); /* T = 0: nothing to do, nothing touched */
        for (int i = 0; i < T * K * D; i++)
            out[i] = SENTINEL;
        gpu->to_device(dout, out, (size_t)T * K * D * 4);
        make_routing(ids, T, K, m->E, ROUTE_RANDOM, 0.0);
        gpu->moe_experts(dout, x /* not read */, ids /* not read */, &m->w, 0, K, D, m->F);
        gpu->to_host(out, dout, (size_t)T * K * D * 4);
        all = true;
        for (int p = 0; p < T * K; p++)
            all = all && is_sentinel_row(out + (size_t)p * D, D);
        CHECK(all, "%s %s: T = 0 wrote to out", m->name, pn);
    }
    set_precision(MATMUL_PRECISION_HIGH);
    gpu->dev_free(dout);
    free(x);
    free(out);
    free(ids);
}

/* ---- timing ---- */

typedef struct {
    char label[48];
    int T;
    double weight_gb; /* expert weights the routing touches */
    double us[N_PRECISIONS], gbs[N_PRECISIONS], pct[N_PRECISIONS], tflops[N_PRECISIONS]; /* ours */
    double cublas_us, cublas_tflops; /* per-expert cuBLAS (prefill rows only) */
    double copy_same_us;             /* a device copy moving as many bytes (read + write) */
    double chain_us[N_PRECISIONS];   /* time_moe_chain's, decode sizes (0: not timed) */
} timing_row;

static timing_row rows[32];
static int n_rows;
static double copy_gbs;

static int cmp_float(const void *a, const void *b) {
    const float x = *(const float *)a, y = *(const float *)b;
    return x < y ? -1 : x > y;
}

/* Median milliseconds of iters timed runs of fn(i) after warm warm-up runs. */
static float time_median(void (*fn)(void *, int), void *ctx, int warm, int iters) {
    for (int i = 0; i < warm; i++)
        fn(ctx, i);
    cudaEvent_t *ev = xmalloc((size_t)iters * 2 * sizeof(cudaEvent_t));
    float *ms = xmalloc((size_t)iters * sizeof(float));
    for (int i = 0; i < 2 * iters; i++)
        cudaEventCreate(&ev[i]);
    for (int i = 0; i < iters; i++) {
        cudaEventRecord(ev[2 * i], cuda_stream());
        fn(ctx, warm + i);
        cudaEventRecord(ev[2 * i + 1], cuda_stream());
    }
    cudaEventSynchronize(ev[2 * iters - 1]);
    for (int i = 0; i < iters; i++)
        cudaEventElapsedTime(&ms[i], ev[2 * i], ev[2 * i + 1]);
    for (int i = 0; i < 2 * iters; i++)
        cudaEventDestroy(ev[i]);
    qsort(ms, (size_t)iters, sizeof(float), cmp_float);
    const float med = ms[iters / 2];
    free(ev);
    free(ms);
    return med;
}

typedef struct {
    void *dst, *src;
    size_t bytes;
} copy_ctx;

static void copy_once(void *c, int i) {
    (void)i;
    copy_ctx *cc = c;
    cudaMemcpyAsync(cc->dst, cc->src, cc->bytes, CUDA_MEMCPY_D2D, cuda_stream());
}

static double measure_copy_bandwidth(void) {
    copy_ctx c = {dev_alloc_checked(1u << 30), dev_alloc_checked(1u << 30), 1u << 30};
    const float ms = time_median(copy_once, &c, 2, 7);
    gpu->dev_free(c.dst);
    gpu->dev_free(c.src);
    return 2.0 * (double)c.bytes / (ms * 1e-3) / 1e9;
}

typedef struct {
    const model *m;
    float *out, *x;
    int32_t *ids; /* [n_sets, T, K] */
    int T, n_sets;
} moe_ctx;

static void moe_once(void *c, int i) {
    moe_ctx *mc = c;
    const model *m = mc->m;
    gpu->moe_experts(mc->out, mc->x, mc->ids + (size_t)(i % mc->n_sets) * mc->T * m->K, &m->w,
                     mc->T, m->K, m->D, m->F);
}

static double time_moe_chain(moe_ctx *c);

/* Times moe_experts at T tokens over n_sets routings of the given mode, in each precision on the
 * same inputs; adds a timing row. The precision is left at high. */
static timing_row *time_moe(const model *m, int T, int mode, int n_sets, int iters) {
    const int K = m->K, D = m->D;
    const size_t nx = (size_t)T * D, ni = (size_t)T * K;
    float *x_h = xmalloc(nx * sizeof(float));
    int32_t *ids_h = xmalloc(ni * n_sets * sizeof(int32_t));
    for (size_t i = 0; i < nx; i++)
        x_h[i] = rng_uniform();
    double busy = 0;
    for (int s = 0; s < n_sets; s++) {
        make_routing(ids_h + s * ni, T, K, m->E, mode, 0.0);
        busy += busy_experts(ids_h + s * ni, (int64_t)ni, m->E);
    }
    busy /= n_sets;
    moe_ctx c = {m, dev_alloc_checked(ni * D * 4), dev_alloc_checked(nx * 4),
                 dev_alloc_checked(ni * n_sets * 4), T, n_sets};
    gpu->to_device(c.x, x_h, nx * 4);
    gpu->to_device(c.ids, ids_h, ni * n_sets * 4);
    timing_row *r = &rows[n_rows++];
    memset(r, 0, sizeof *r);
    snprintf(r->label, sizeof r->label, "%s %s", m->name, route_name[mode]);
    r->T = T;
    r->weight_gb = busy * 3.0 * m->F * m->D * m->wbytes / 1e9;
    if (r->weight_gb <= 2.0) { /* the copy rate at this size: read + write = the weight bytes */
        const size_t half = (size_t)(r->weight_gb * 1e9 / 2) & ~(size_t)255;
        copy_ctx cc = {dev_alloc_checked(half), dev_alloc_checked(half), half};
        r->copy_same_us = time_median(copy_once, &cc, 3, iters) * 1e3;
        gpu->dev_free(cc.dst);
        gpu->dev_free(cc.src);
    }
    const bool profile = getenv("MOE_TIMING_PROFILE") != NULL;
    for (int p = 0; p < N_PRECISIONS; p++) {
        set_precision((matmul_precision)p);
        const float ms =
            profile ? time_median(moe_once, &c, 1, 1) : time_median(moe_once, &c, 3, iters);
        r->us[p] = ms * 1e3;
        r->gbs[p] = r->weight_gb / (ms * 1e-3);
        r->pct[p] = 100.0 * r->gbs[p] / copy_gbs;
        r->tflops[p] = 6.0 * T * K * (double)D * m->F / (ms * 1e-3) / 1e12;
        if (T <= 64 && n_sets >= 8 && !profile) r->chain_us[p] = time_moe_chain(&c);
    }
    set_precision(MATMUL_PRECISION_HIGH);
    gpu->dev_free(c.out);
    gpu->dev_free(c.x);
    gpu->dev_free(c.ids);
    free(x_h);
    free(ids_h);
    return r;
}

/* The in-step cost of moe_experts at T tokens: MOE_CHAIN calls (the routings in turn) captured in
 * one CUDA graph, each waiting for the one before as a decode step's layers do, replayed; the
 * median of 5 replays per call. */
#define MOE_CHAIN 48
static double time_moe_chain(moe_ctx *c) {
    cudaStream_t st = cuda_stream();
    cudaGraph_t g = NULL;
    cudaGraphExec_t ge = NULL;
    double us = NAN;
    if (cudaStreamBeginCapture(st, CUDA_CAPTURE_THREAD_LOCAL) == 0) {
        for (int i = 0; i < MOE_CHAIN; i++)
            moe_once(c, i);
        if (cudaStreamEndCapture(st, &g) == 0 && cudaGraphInstantiateWithFlags(&ge, g, 0) == 0) {
            cudaEvent_t e[2];
            cudaEventCreate(&e[0]);
            cudaEventCreate(&e[1]);
            float ms[5];
            cudaGraphLaunch(ge, st); /* warm-up */
            for (int r = 0; r < 5; r++) {
                cudaEventRecord(e[0], st);
                cudaGraphLaunch(ge, st);
                cudaEventRecord(e[1], st);
                cudaEventSynchronize(e[1]);
                cudaEventElapsedTime(&ms[r], e[0], e[1]);
            }
            qsort(ms, 5, sizeof(float), cmp_float);
            us = ms[2] * 1e3 / MOE_CHAIN;
            cudaEventDestroy(e[0]);
            cudaEventDestroy(e[1]);
        }
    }
    if (isnan(us)) { /* a failed capture leaves an error behind: clear it, print no figure */
        cudaGetLastError();
        printf("  (moe_experts at T=%d: graph capture failed, no chain figure)\n", c->T);
    }
    if (ge) cudaGraphExecDestroy(ge);
    if (g) cudaGraphDestroy(g);
    return us;
}

typedef struct {
    const model *m;
    cublasHandle_t h;
    void *a, *hid, *y; /* a [n, D] bf16 grouped tokens, hid [n, 2F] bf16, y [n, D] fp32 */
    int per_expert;    /* rows per expert */
    int status;        /* first non-zero cuBLAS status */
} cublas_ctx;

static void cublas_once(void *c, int it) {
    (void)it;
    cublas_ctx *cc = c;
    const model *m = cc->m;
    const int D = m->D, F = m->F, n = cc->per_expert;
    const float one = 1.0f, zero = 0.0f;
    for (int e = 0; e < m->E; e++) {
        const uint16_t *w1 = (const uint16_t *)m->w.gate_up + (size_t)e * 2 * F * D;
        const uint16_t *w2 = (const uint16_t *)m->w.down_all + (size_t)e * D * F;
        const uint16_t *a = (const uint16_t *)cc->a + (size_t)e * n * D;
        uint16_t *hid = (uint16_t *)cc->hid + (size_t)e * n * 2 * F;
        float *y = (float *)cc->y + (size_t)e * n * D;
        /* column-major view: hid^T [2F, n] = W1 [2F, D] a^T [D, n]; y^T [D, n] = W2 [D, F] h^T */
        int s = cublasGemmEx(cc->h, CUBLAS_OP_T_, CUBLAS_OP_N_, 2 * F, n, D, &one, w1,
                             CUDA_R_16BF_, D, a, CUDA_R_16BF_, D, &zero, hid, CUDA_R_16BF_, 2 * F,
                             CUBLAS_COMPUTE_32F_, CUBLAS_GEMM_DEFAULT_);
        if (s && !cc->status) cc->status = s;
        s = cublasGemmEx(cc->h, CUBLAS_OP_T_, CUBLAS_OP_N_, D, n, F, &one, w2, CUDA_R_16BF_, F,
                         hid, CUDA_R_16BF_, 2 * F, &zero, y, CUDA_R_32F_, D, CUBLAS_COMPUTE_32F_,
                         CUBLAS_GEMM_DEFAULT_);
        if (s && !cc->status) cc->status = s;
    }
}

/* cuBLAS per expert on balanced routing at T tokens, into row r. */
static void time_cublas(const model *m, int T, timing_row *r) {
    const int K = m->K, D = m->D, F = m->F;
    const size_t n = (size_t)T * K;
    cublas_ctx c = {m, NULL, NULL, NULL, NULL, (int)(n / m->E), 0};
    if (n % m->E || cublasCreate_v2(&c.h) != 0 || cublasSetStream_v2(c.h, cuda_stream()) != 0) {
        CHECK(false, "%s: cuBLAS could not start", m->name);
        return;
    }
    uint16_t *a_h = xmalloc(n * D * 2);
    for (size_t i = 0; i < n * D; i++)
        a_h[i] = f32_to_bf16(rng_uniform());
    c.a = dev_alloc_checked(n * D * 2);
    c.hid = dev_alloc_checked(n * 2 * F * 2);
    c.y = dev_alloc_checked(n * D * 4);
    gpu->to_device(c.a, a_h, n * D * 2);
    free(a_h);
    const float ms = time_median(cublas_once, &c, 2, 5);
    CHECK(c.status == 0, "%s: cublasGemmEx status %d", m->name, c.status);
    r->cublas_us = ms * 1e3;
    r->cublas_tflops = 6.0 * n * (double)D * F / (ms * 1e-3) / 1e12;
    gpu->dev_free(c.a);
    gpu->dev_free(c.hid);
    gpu->dev_free(c.y);
    cublasDestroy_v2(c.h);
}

static void print_timings(void) {
    printf("\ndevice copy bandwidth (1 GiB device to device, read + write): %.0f GB/s\n",
           copy_gbs);
    printf("%-26s %5s %9s | %-31s | %-31s | %6s | %-8s | %s\n", "", "", "", "medium (x, h in BF16)",
           "high (x, h as BF16 hi + lo)", "high /", "copy of", "cuBLAS per expert");
    printf("%-26s %5s %9s | %8s %6s %6s %8s | %8s %6s %6s %8s | %6s | %8s | %8s %8s\n",
           "moe_experts", "T", "weight GB", "us", "GB/s", "% copy", "TFLOP/s", "us", "GB/s",
           "% copy", "TFLOP/s", "medium", "as many", "us", "TFLOP/s");
    for (int i = 0; i < n_rows; i++) {
        const timing_row *r = &rows[i];
        const int M = MATMUL_PRECISION_MEDIUM, H = MATMUL_PRECISION_HIGH;
        printf("%-26s %5d %9.3f | %8.1f %6.0f %5.1f%% %8.1f | %8.1f %6.0f %5.1f%% %8.1f | %6.2f |",
               r->label, r->T, r->weight_gb, r->us[M], r->gbs[M], r->pct[M], r->tflops[M], r->us[H],
               r->gbs[H], r->pct[H], r->tflops[H], r->us[H] / r->us[M]);
        if (r->copy_same_us > 0)
            printf(" %5.1f us |", r->copy_same_us);
        else
            printf(" %8s |", "");
        if (r->cublas_us > 0) printf(" %8.1f %8.1f", r->cublas_us, r->cublas_tflops);
        printf("\n");
    }
    printf("in a chain (calls captured in one CUDA graph, each after the one before; %% of the "
           "copy rate):\n");
    for (int i = 0; i < n_rows; i++) {
        const timing_row *r = &rows[i];
        const int M = MATMUL_PRECISION_MEDIUM, H = MATMUL_PRECISION_HIGH;
        if (r->chain_us[H] > 0)
            printf("%-26s %5d | medium %8.1f us %5.1f%% | high %8.1f us %5.1f%%\n", r->label,
                   r->T, r->chain_us[M], 100.0 * r->weight_gb / (r->chain_us[M] * 1e-6) / copy_gbs,
                   r->chain_us[H], 100.0 * r->weight_gb / (r->chain_us[H] * 1e-6) / copy_gbs);
    }
}

static void print_worst(void) {
    printf("\nworst max|gpu - cpu| / row rms per shape (tolerance: high %.2e + %.2e per k16 step, "
           "medium %.2e, F32 / F16 weights %.2e in both)\n",
           TOL_ROW_RMS_HIGH, TOL_ROW_RMS_HIGH_STEP, TOL_ROW_RMS_MEDIUM, TOL_ROW_RMS_CONVERTED);
    printf("%-18s %6s %10s %10s %8s\n", "shape", "cases", "high", "medium", "ratio");
    for (int i = 0; i < n_worst_rows; i++) {
        const worst_row *w = &worst_rows[i];
        const double h = w->worst[MATMUL_PRECISION_HIGH], md = w->worst[MATMUL_PRECISION_MEDIUM];
        printf("%-18s %6d %10.2e %10.2e %8.0f\n", w->name, w->cases, h, md, h > 0 ? md / h : 0.0);
    }
}

/* ---- the shapes ---- */

/* The process-wide setting: high by default, each name selects its precision, others refused. */
static void test_precision_setting(void) {
    char err[256] = "";
    CHECK(ops_cuda_matmul_precision() == MATMUL_PRECISION_HIGH, "the default precision is high");
    CHECK(ops_cuda_set_matmul_precision("medium", err, sizeof err) == 0 &&
              ops_cuda_matmul_precision() == MATMUL_PRECISION_MEDIUM,
          "medium selected (%s)", err);
    err[0] = '\0';
    CHECK(ops_cuda_set_matmul_precision("low", err, sizeof err) != 0 && err[0] &&
              ops_cuda_matmul_precision() == MATMUL_PRECISION_MEDIUM,
          "an unknown name is refused and changes nothing (%s)", err);
    CHECK(ops_cuda_set_matmul_precision("high", err, sizeof err) == 0 &&
              ops_cuda_matmul_precision() == MATMUL_PRECISION_HIGH,
          "high selected (%s)", err);
}

static void test_prepare_errors(void) {
    model m;
    model_init(&m, "bad", 2, 16, 8, 1, DTYPE_BF16);
    m.down[1].shape[0] = 8; /* [8, 8] where [16, 8] belongs */
    char err[256] = "";
    CHECK(gpu->prepare_experts(&m.w, err, sizeof err) == -1 && err[0] && !m.w.gate_up,
          "a misshapen down tensor is refused (%s)", err);
    model_free(&m);
}

static void test_small(void) {
    model m;
    model_init(&m, "small", 3, 40, 24, 2, DTYPE_BF16);
    if (model_prepare(&m) == 0) {
        double worst[N_PRECISIONS] = {0}, w[N_PRECISIONS];
        for (int T = 1; T <= 37; T++) {
            run_case(&m, T, ROUTE_RANDOM, T % 2 ? 0.0 : 0.2, 64, T == 37, w);
            for (int p = 0; p < N_PRECISIONS; p++)
                if (w[p] > worst[p]) worst[p] = w[p];
        }
        printf("  small: T = 1..37 worst high %.2e, medium %.2e\n", worst[MATMUL_PRECISION_HIGH],
               worst[MATMUL_PRECISION_MEDIUM]);
        run_case(&m, 64, ROUTE_ONE, 0.1, 64, true, NULL);
        run_empty_cases(&m);
    }
    model_free(&m);
    const dtype other[] = {DTYPE_F32, DTYPE_F16};
    for (int i = 0; i < 2; i++) {
        model_init(&m, i ? "small-f16" : "small-f32", 3, 40, 24, 2, other[i]);
        if (model_prepare(&m) == 0) {
            run_case(&m, 17, ROUTE_RANDOM, 0.0, 64, false, NULL);
            run_case(&m, 150, ROUTE_RANDOM, 0.2, 150, false, NULL);
        }
        model_free(&m);
    }
}

/* Batches the wgmma kernel takes (bf16_gemm.cu: more than 96 pairs an expert) on a model of a few
 * experts: several row tiles an expert and a short last one, skipped slots, every pair on one
 * expert (the others empty), an expert's rows straddling the tiles of 128; against the CPU, and
 * in medium bit for bit against the token alone (mma.sync tiles). */
static void test_wgmma(void) {
    model m;
    model_init(&m, "wgmma-6x512x256", 6, 512, 256, 2, DTYPE_BF16);
    if (model_prepare(&m) == 0) {
        const int64_t n = 400 * 2;
        const char *off = getenv("MOESERVE_WGMMA");
        if (!(off && strcmp(off, "0") == 0))
            CHECK(cuda_moe_bf16_wgmma(n, 6, 512, 256, 0) && cuda_moe_bf16_wgmma(n, 6, 512, 256, 1),
                  "the wgmma kernel takes %lld pairs over 6 experts", (long long)n);
        run_case(&m, 400, ROUTE_RANDOM, 0.0, 64, true, NULL);
        run_case(&m, 1000, ROUTE_RANDOM, 0.2, 64, false, NULL);
        run_case(&m, 333, ROUTE_ONE, 0.0, 32, true, NULL);
        run_case(&m, 1500, ROUTE_BALANCED, 0.1, 32, false, NULL);
        /* halves of a tile with 1 to 32 rows as wgmma's B (bwg_short_half) and as m64 rows: the
         * same bits as the token alone either way */
        for (int tail = 0; tail <= 32; tail += 32) {
            const int old_tail = cuda_moe_bf16_wgmma_tail(tail);
            printf("  halves of up to %d rows swapped\n", tail);
            static const int Ts[] = {210, 240, 270, 420, 470};
            for (size_t i = 0; i < sizeof Ts / sizeof Ts[0]; i++)
                run_case(&m, Ts[i], ROUTE_RANDOM, i == 1 ? 0.2 : 0.0, 64, true, NULL);
            cuda_moe_bf16_wgmma_tail(old_tail);
        }
        /* the swapped kernel (weights as wgmma's A, chunks of up to 96 rows as its B) at every
         * size past the tiny path, with 2 and 4 weight tiles a warpgroup in both GEMMs and 4 then
         * 2, GEMM 1 copying x's rows itself and from their grouped copy: chunks of 1 to 96 rows,
         * experts of several chunks, one expert with them all; against the CPU, and a token alone
         * bit for bit against its batch */
        const int old_min = cuda_moe_bf16_wgmma_min(0), old_max = cuda_moe_bf16_swap_max(100000);
        for (int gather = 1; gather >= 0; gather--) {
            const int old_gather = cuda_moe_bf16_swap_gather(gather);
            static const int nas[] = {42, 2, 4}; /* 42: GEMM 1's 4 tiles, GEMM 2's 2 */
            for (int ni = 0; ni < 3; ni++) {
                const int na = nas[ni];
                cuda_moe_bf16_swap_na(na);
                printf("  on the swapped kernel, %d and %d weight tiles a warpgroup (GEMM 1, 2), "
                       "x's rows %s\n",
                       na == 42 ? 4 : na, na == 42 ? 2 : na,
                       gather ? "copied by GEMM 1" : "from their grouped copy");
                static const int Ts[] = {9, 20, 100, 250, 400};
                for (size_t i = 0; i < sizeof Ts / sizeof Ts[0]; i++)
                    run_case(&m, Ts[i], ROUTE_RANDOM, i == 3 ? 0.25 : 0.0, 64, i == 2, NULL);
                run_case(&m, 333, ROUTE_ONE, 0.0, 32, true, NULL);
            }
            cuda_moe_bf16_swap_gather(old_gather);
        }
        cuda_moe_bf16_swap_na(-1);
        cuda_moe_bf16_wgmma_min(old_min);
        cuda_moe_bf16_swap_max(old_max);
    }
    model_free(&m);
}

/* Deterministic mode: a token's rows are the same bits at every batch size in both precisions,
 * the wgmma kernel's sizes included (in high every size then sums in one chain): T from the
 * tiny path through the decode and middle tiles to the wgmma kernel. */
static void test_deterministic_sizes(const char *name, int E, int D, int F, int K, const int *Ts,
                                     int nT) {
    model m;
    model_init(&m, name, E, D, F, K, DTYPE_BF16);
    ops_cuda_set_deterministic(true);
    if (model_prepare(&m) == 0)
        for (int i = 0; i < nT; i++)
            run_case(&m, Ts[i], ROUTE_RANDOM, Ts[i] % 3 ? 0.0 : 0.1, 64, false, NULL);
    ops_cuda_set_deterministic(false);
    model_free(&m);
}

static void test_deterministic(bool large) {
    const int small_T[] = {1, 2, 7, 20, 40, 100, 250, 400, 1000};
    test_deterministic_sizes("wgmma-6x512x256 det", 6, 512, 256, 2, small_T, 9);
    if (!large) return;
    const int qwen_T[] = {1, 2, 3, 8, 64, 256, 1024, 2048};
    test_deterministic_sizes("qwen3-30b-a3b det", 128, 2048, 768, 8, qwen_T, 8);
}

/* moe_experts_n: rows 0..n-1 of a batch bounded by T, n on the device (the all-to-all's received
 * count), in both precisions: the rows below n are moe_experts' of those n rows bit for bit, the
 * rows from n on keep the sentinel (their ids are never read: they hold out-of-range garbage). */
static void run_rows_n(const model *m, int T, int n) {
    const int K = m->K, D = m->D;
    const size_t nx = (size_t)T * D, no = (size_t)T * K * D;
    float *x = xmalloc(nx * 4 + 4), *want = xmalloc(no * 4 + 4), *got = xmalloc(no * 4 + 4);
    int32_t *ids = xmalloc((size_t)T * K * 4 + 4);
    for (size_t i = 0; i < nx; i++)
        x[i] = rng_uniform();
    make_routing(ids, T, K, m->E, ROUTE_RANDOM, 0.1);
    for (int64_t i = (int64_t)n * K; i < (int64_t)T * K; i++)
        ids[i] = m->E + 7; /* out of range: reading it would trap */
    float *gx = dev_alloc_checked(nx * 4 + 4), *gout = dev_alloc_checked(no * 4 + 4);
    int32_t *gids = dev_alloc_checked((size_t)T * K * 4 + 4), *gn = dev_alloc_checked(4);
    gpu->to_device(gx, x, nx * 4);
    gpu->to_device(gids, ids, (size_t)T * K * 4);
    gpu->to_device(gn, &n, 4);
    for (int pi = 0; pi < N_PRECISIONS; pi++) {
        set_precision((matmul_precision)pi);
        for (size_t i = 0; i < no; i++)
            want[i] = SENTINEL;
        if (n > 0) gpu_moe(m, want, x, ids, n);
        for (size_t i = 0; i < no; i++)
            got[i] = SENTINEL;
        gpu->to_device(gout, got, no * 4);
        gpu->moe_experts_n(gout, gx, gids, gn, &m->w, T, K, D, m->F);
        gpu->to_host(got, gout, no * 4);
        CHECK(memcmp(got, want, no * 4) == 0,
              "%s %s moe_experts_n: %d of T = %d rows on the device == moe_experts of %d rows, "
              "the rest untouched",
              m->name, precision_name[pi], n, T, n);
    }
    set_precision(MATMUL_PRECISION_HIGH);
    gpu->dev_free(gx), gpu->dev_free(gout), gpu->dev_free(gids), gpu->dev_free(gn);
    free(x), free(want), free(got), free(ids);
}

static void test_tiny(void) {
    model m;
    model_init(&m, "tiny", 8, 64, 64, 2, DTYPE_BF16);
    if (model_prepare(&m) == 0) {
        const int Ts[] = {1, 2, 7, 64, 96, 300, 500, 1000};
        for (size_t i = 0; i < sizeof Ts / sizeof Ts[0]; i++)
            run_case(&m, Ts[i], ROUTE_RANDOM, 0.0, 1000, true, NULL);
        run_case(&m, 77, ROUTE_RANDOM, 0.3, 1000, true, NULL);
        run_case(&m, 600, ROUTE_RANDOM, 0.5, 1000, true, NULL);
        run_case(&m, 200, ROUTE_ONE, 0.0, 200, true, NULL);
        run_case(&m, 1000, ROUTE_ONE, 0.2, 1000, true, NULL);
        run_case(&m, 512, ROUTE_BALANCED, 0.0, 512, true, NULL);
        run_empty_cases(&m);
        const int rows_n[][2] = {{2, 1}, {2, 0}, {2, 2}, {9, 4}, {64, 33}, {300, 299}, {600, 10}};
        for (size_t i = 0; i < sizeof rows_n / sizeof rows_n[0]; i++)
            run_rows_n(&m, rows_n[i][0], rows_n[i][1]);
    }
    model_free(&m);
}

/* Timings up to max_T tokens (0: all): the decode sizes T = 1, 2, 4, 8, then mean pairs per expert
 * 1, 2, 4, ..., 64 (T = E / K * 2^i, random routing), then a balanced prefill-size batch with
 * cuBLAS beside it. */
static void time_model(const model *m, int max_T) {
    int Tt[16], n = 0;
    for (int T = 1; T < m->E / m->K; T *= 2)
        Tt[n++] = T;
    for (int i = 0; i <= 7; i++) /* up to 128 pairs an expert (the wgmma kernel's sizes) */
        Tt[n++] = m->E / m->K << i;
    for (int i = 0; i < n; i++)
        if (!max_T || Tt[i] <= max_T)
            time_moe(m, Tt[i], ROUTE_RANDOM, 8, Tt[i] <= 256 ? 50 : Tt[i] <= 1024 ? 10 : 5);
    if (!max_T || 4096 <= max_T)
        time_cublas(m, 4096, time_moe(m, 4096, ROUTE_BALANCED, 1, m->D > 4096 ? 5 : 10));
}

/* compare: the comparisons (decode_only: those up to T = 64), then timings up to max_T tokens
 * unless decode_only. */
static void test_qwen3(bool compare, bool decode_only, int max_T) {
    model m;
    model_init(&m, "qwen3-30b-a3b", 128, 2048, 768, 8, DTYPE_BF16);
    if (model_prepare(&m) == 0 && compare) {
        const int Ts[] = {1, 2, 3, 4, 5, 8, 64, 256, 512, 1024, 2048};
        for (size_t i = 0; i < sizeof Ts / sizeof Ts[0]; i++)
            if (!decode_only || Ts[i] <= 64)
                run_case(&m, Ts[i], ROUTE_RANDOM, 0.0, 128, Ts[i] <= 256, NULL);
        if (decode_only) {
            run_case(&m, 3, ROUTE_RANDOM, 0.25, 3, true, NULL);
            run_case(&m, 4, ROUTE_ONE, 0.0, 4, true, NULL);
            model_free(&m);
            return;
        }
        run_case(&m, 3, ROUTE_RANDOM, 0.25, 3, true, NULL);
        run_case(&m, 64, ROUTE_RANDOM, 0.25, 64, true, NULL);
        run_case(&m, 4, ROUTE_ONE, 0.0, 4, true, NULL); /* 32 rows of one expert: split tiles */
        run_case(&m, 256, ROUTE_ONE, 0.0, 32, false, NULL);
        run_case(&m, 4096, ROUTE_BALANCED, 0.0, 32, false, NULL);
        run_empty_cases(&m);
    }
    if (m.w.gate_up) time_model(&m, max_T);
    model_free(&m);
}

static void test_deepseek(bool compare, int max_T) {
    const int E = 256, D = 7168, F = 2048, K = 8;
    size_t free_b = 0, total_b = 0;
    cudaMemGetInfo(&free_b, &total_b);
    const size_t need = (size_t)E * 3 * F * D * 2 + ((size_t)6 << 30);
    if (free_b < need) {
        printf("deepseek-v3-like: skipped, %.1f GiB free on the device, %.1f GiB needed\n",
               free_b / 1073741824.0, need / 1073741824.0);
        return;
    }
    model m;
    model_init(&m, "deepseek-v3-like", E, D, F, K, DTYPE_BF16);
    if (model_prepare(&m) == 0) {
        if (compare) {
            run_case(&m, 1, ROUTE_RANDOM, 0.0, 1, false, NULL);
            run_case(&m, 3, ROUTE_RANDOM, 0.0, 3, false, NULL);
            run_case(&m, 64, ROUTE_RANDOM, 0.0, 64, false, NULL);
            run_case(&m, 4096, ROUTE_BALANCED, 0.0, 16, false, NULL);
        }
        time_model(&m, max_T);
    }
    model_free(&m);
}

/* ---- quantized experts: the cases both formats run ---- */

/* The small shape: every tile shape from tiny to prefill, batch invariance, skipped slots, one
 * busy expert, empty calls. */
/* moe_experts_q (the model's call) against moe_input_quant then moe_experts: the same bits at T =
 * 1 to 3 (the tiny path's sizes and one past them at K = 8), 12 and 40, in both precisions. */
static void check_experts_q(const model *m, int payload) {
    static const int Ts[] = {1, 2, 3, 12, 40};
    const int D = m->D, K = m->K;
    for (size_t ti = 0; ti < sizeof Ts / sizeof Ts[0]; ti++) {
        const int T = Ts[ti];
        const size_t nx = (size_t)T * D, no = (size_t)T * K * D;
        float *x_h = xmalloc(nx * 4), *a_h = xmalloc(no * 4), *b_h = xmalloc(no * 4);
        int32_t *ids_h = xmalloc((size_t)T * K * 4);
        for (size_t i = 0; i < nx; i++)
            x_h[i] = rng_uniform();
        for (int t = 0; t < T; t++) /* K distinct experts a token */
            for (int k = 0; k < K; k++)
                ids_h[t * K + k] = (t * 3 + k * (m->E / K)) % m->E;
        float *x = dev_alloc_checked(nx * 4), *xq = dev_alloc_checked(nx * 4);
        float *out = dev_alloc_checked(no * 4);
        int32_t *ids = dev_alloc_checked((size_t)T * K * 4);
        gpu->to_device(x, x_h, nx * 4);
        gpu->to_device(ids, ids_h, (size_t)T * K * 4);
        for (int p = 0; p < N_PRECISIONS; p++) {
            set_precision((matmul_precision)p);
            gpu->moe_input_quant(xq, x, T, D, payload);
            gpu->moe_experts(out, xq, ids, &m->w, T, K, D, m->F);
            gpu->to_host(a_h, out, no * 4);
            gpu->moe_experts_q(out, xq, x, ids, &m->w, T, K, D, m->F, payload);
            gpu->to_host(b_h, out, no * 4);
            CHECK(memcmp(a_h, b_h, no * 4) == 0,
                  "%s %s T=%d: moe_experts_q differs from moe_input_quant then moe_experts",
                  m->name, precision_name[p], T);
        }
        set_precision(MATMUL_PRECISION_HIGH);
        gpu->dev_free(x);
        gpu->dev_free(xq);
        gpu->dev_free(out);
        gpu->dev_free(ids);
        free(x_h);
        free(a_h);
        free(b_h);
        free(ids_h);
    }
}

static void quant_small_cases(const model *m) {
    const int Ts[] = {1, 2, 3, 8, 9, 64, 300, 400};
    for (size_t i = 0; i < sizeof Ts / sizeof Ts[0]; i++)
        run_case(m, Ts[i], ROUTE_RANDOM, 0.0, 64, Ts[i] <= 64, NULL);
    run_case(m, 5, ROUTE_RANDOM, 0.25, 5, true, NULL);
    run_case(m, 40, ROUTE_ONE, 0.0, 40, false, NULL);
    run_empty_cases(m);
}

/* Qwen3-30B-A3B's shape: checked at decode sizes and 1024, then timed. */
static void quant_qwen3_cases(const model *m) {
    const int Ts[] = {1, 2, 3, 8, 64, 1024};
    for (size_t i = 0; i < sizeof Ts / sizeof Ts[0]; i++)
        run_case(m, Ts[i], ROUTE_RANDOM, 0.0, 32, Ts[i] <= 64, NULL);
    time_model(m, 1024);
}

/* ---- NVFP4 experts (W4A16) ---- */

int cuda_prepare_experts_nvfp4(moe_experts *w, const uint8_t *gate_up_q,
                               const uint8_t *gate_up_sf, const uint8_t *down_q,
                               const uint8_t *down_sf, const float *s2, int D, int F, char *err,
                               size_t errlen);

/* m's experts (F32 pools) quantized to NVFP4 by kernels/cpu/quant.c's formula: the host tensors
 * then hold the dequantized weights (the CPU reference is an fp32 GEMM on them) and the device the
 * codes and scales. 0 when the experts are on the device. */
static int model_nvfp4(model *m, const char *name, int E, int D, int F, int K) {
    model_init(m, name, E, D, F, K, DTYPE_F32);
    m->quantized = true;
    m->wbytes = 0.5 + 1.0 / 16;
    const size_t mat = (size_t)F * D;
    uint8_t *guq = xmalloc((size_t)E * mat), *gus = xmalloc((size_t)E * mat / 8);
    uint8_t *dq = xmalloc((size_t)E * mat / 2), *ds = xmalloc((size_t)E * mat / 16);
    float *s2 = xmalloc((size_t)E * 3 * sizeof(float));
    m->deq = xmalloc((size_t)E * 3 * mat * sizeof(float));
    const double t0 = now_s();
#pragma omp parallel for schedule(dynamic)
    for (int e = 0; e < E; e++) {
        float *dg = m->deq + (size_t)3 * e * mat, *du = dg + mat, *dd = du + mat;
        /* gate_up [E, 2F, D / 2]: expert e's F gate rows, then its F up rows */
        uint8_t *qg = guq + (size_t)e * mat, *qu = qg + mat / 2;
        uint8_t *sg = gus + (size_t)e * mat / 8, *su = sg + mat / 16;
        uint8_t *qd = dq + (size_t)e * mat / 2, *sd = ds + (size_t)e * mat / 16;
        s2[3 * e] = quant_nvfp4(qg, sg, m->gate[e].data, F, D, 0.0f);
        dequant_nvfp4(dg, qg, sg, s2[3 * e], F, D);
        s2[3 * e + 1] = quant_nvfp4(qu, su, m->up[e].data, F, D, 0.0f);
        dequant_nvfp4(du, qu, su, s2[3 * e + 1], F, D);
        s2[3 * e + 2] = quant_nvfp4(qd, sd, m->down[e].data, D, F, 0.0f);
        dequant_nvfp4(dd, qd, sd, s2[3 * e + 2], D, F);
        m->gate[e].data = dg;
        m->up[e].data = du;
        m->down[e].data = dd;
    }
    char err[256] = "";
    const int rc = cuda_prepare_experts_nvfp4(&m->w, guq, gus, dq, ds, s2, D, F, err, sizeof err);
    CHECK(rc == 0, "%s: cuda_prepare_experts_nvfp4: %s", name, err);
    if (rc == 0)
        printf("%s: %d experts quantized to NVFP4 on the host in %.1f s, %.2f GiB on the device\n",
               name, E, now_s() - t0, (double)E * 3 * mat * m->wbytes / (1 << 30));
    free(guq);
    free(gus);
    free(dq);
    free(ds);
    free(s2);
    return rc;
}

/* NVFP4 experts against the fp32 GEMMs on their dequantized weights, batch invariance included
 * (the tiny path against the grouped one, every tile shape), a bad shape refused; with full (the
 * --nvfp4 run) also Qwen3-30B-A3B's shape, checked and timed at decode sizes, the weight bytes
 * read being codes and scales. */
/* kernels/cuda/bf16_gemm.cu: the NVFP4 experts on the wgmma kernel from now on (1 on, 0 off, -1
 * as MOESERVE_W4A16_WGMMA says: on unless 0); returns the setting before */
int cuda_moe_w4_wgmma(int on);
/* the same: from how many pairs an expert on average (< 0: MOESERVE_W4A16_WGMMA_MIN, default 96) */
int cuda_moe_w4_wgmma_min(int pairs);

/* kernels/cuda/moe_lean.cu: the NVFP4 experts' lean kernels from now on (1 wherever they fit, 2
 * the sizes timed faster, 0 off, -1 as MOESERVE_NVFP4_LEAN says: 2 unless set); returns the
 * setting before */
int cuda_moe_w4_lean(int on);
/* the same for their form (0 to 6, 7 by the tile's rows; -1: MOESERVE_NVFP4_LEAN_FORM, by the
 * tile's rows unless set) */
int cuda_moe_w4_lean_form(int form);

/* A quantized format's experts on the wgmma kernel (set: its test hook, forced on here; line: the
 * variable, printed), against the CPU at the sizes of Ts (n of them; random routing, the second
 * size with a quarter of the slots skipped; max_check rows checked) */
static void wgmma_cases(const model *m, int (*set)(int), const char *line, const int *Ts, int n,
                        int max_check) {
    const int old = set(1), old_lean = cuda_moe_w4_lean(0); /* the lean kernels would come first */
    printf("  on the wgmma kernel (%s)\n", line);
    for (int i = 0; i < n; i++)
        run_case(m, Ts[i], ROUTE_RANDOM, i == 1 ? 0.25 : 0.0, max_check, false, NULL);
    set(old);
    cuda_moe_w4_lean(old_lean);
}

/* The same timed beside the tiles at each of Ts (the rows "qwen3 <fmt> wgmma" and "qwen3 <fmt>
 * tiles"; from 4096 tokens balanced routing), the kernel forced on, then off. */
static void wgmma_against_tiles(const model *m, int (*set)(int), const char *fmt, const int *Ts,
                                int n) {
    char nw[64], nt[64];
    snprintf(nw, sizeof nw, "qwen3 %s wgmma", fmt);
    snprintf(nt, sizeof nt, "qwen3 %s tiles", fmt);
    model mw = *m, mt = *m;
    mw.name = nw;
    mt.name = nt;
    const int old = set(1), old_lean = cuda_moe_w4_lean(0);
    for (int pass = 0; pass < 2; pass++) {
        set(pass == 0);
        for (int i = 0; i < n; i++)
            time_moe(pass == 0 ? &mw : &mt, Ts[i], Ts[i] >= 4096 ? ROUTE_BALANCED : ROUTE_RANDOM,
                     Ts[i] >= 4096 ? 1 : 2, Ts[i] <= 1024 ? 10 : 5);
    }
    set(old);
    cuda_moe_w4_lean(old_lean);
}

/* the same file: every block of both lean GEMMs on a small problem emulated on the host, their
 * places (stage bytes, fragments, descriptors, epilogues) against a reference; 0 or -1, a line in
 * msg */
int cuda_moe_lean_host_check(char *msg, size_t n);

/* the same file: 24-row tiles from 9 to 16 pairs an expert (MOESERVE_LEAN_ROWS24) on (1), off (0)
 * or as the variable says (-1); returns the setting before */
int cuda_moe_lean_rows24(int on);

/* m's cases on the lean kernels (set: the format's switch, var its name) in each of forms[n_forms],
 * the tiles of 9 to 16 pairs an expert 24 rows (rows24 1) or 32 (0) */
static void lean_form_cases(const model *m, int (*set)(int), const char *var, const int *forms,
                            int n_forms, int rows24) {
    const int old = set(1), old_form = cuda_moe_w4_lean_form(0);
    const int old24 = cuda_moe_lean_rows24(rows24);
    printf("  tiles of %d rows from 9 to 16 pairs an expert (MOESERVE_LEAN_ROWS24=%d)\n",
           rows24 ? 24 : 32, rows24);
    for (int f = 0; f < n_forms; f++) {
        const int form = forms[f];
        /* 1: tiles of 8 rows to T = 16 (4 pairs an expert), of 32 at T = 64 and 40 (16 and 10 an
         * expert); 2: of 16 at T = 24 (6), at T = 64 the tiles (NVFP4 in forms 5 and 6, FP8 in
         * high precision in form 6: tiles of 32 rows) */
        cuda_moe_w4_lean_form(form);
        set(1);
        printf("  on the lean kernels (%s=1, form %d)\n", var, form);
        quant_small_cases(m);
        set(2);
        printf("  on the lean kernels (%s=2, form %d)\n", var, form);
        run_case(m, 24, ROUTE_RANDOM, 0.0, 24, true, NULL);
        run_case(m, 64, ROUTE_RANDOM, 0.0, 64, true, NULL);
    }
    cuda_moe_lean_rows24(old24);
    cuda_moe_w4_lean_form(old_form);
    set(old);
}

/* the same file: GEMM 2's form under form 6 (MOESERVE_LEAN_FORM2) 5 or 6, by the precision (0),
 * or as the variable says (-1); returns the setting before */
int cuda_moe_lean_form2(int form);

/* the same file: 24-row tiles of up to 16 rows on wgmma's n16 (MOESERVE_LEAN_NARROW) on (1), off
 * (0) or as the variable says (-1); returns the setting before */
int cuda_moe_lean_narrow(int on);

/* m's cases in every form given with 32-row tiles, then in forms 5 and 6 (the forms that take
 * them) with 24-row tiles, the default (those of up to 16 rows on wgmma's n16, GEMM 2 under form 6
 * in form 5 in medium precision and 6 in high); then form 6 with GEMM 2 in form 5 and in form 6
 * in both precisions, and forms 5 and 6 with every 24-row tile on n24 */
static void lean_all_cases(const model *m, int (*set)(int), const char *var, const int *forms,
                           int n_forms) {
    static const int forms24[] = {5, 6}, form6[] = {6};
    lean_form_cases(m, set, var, forms, n_forms, 0);
    lean_form_cases(m, set, var, forms24, 2, 1);
    for (int f2 = 5; f2 <= 6; f2++) {
        const int old2 = cuda_moe_lean_form2(f2);
        printf("  GEMM 2 in form %d (MOESERVE_LEAN_FORM2=%d)\n", f2, f2);
        lean_form_cases(m, set, var, form6, 1, 1);
        lean_form_cases(m, set, var, form6, 1, 0);
        cuda_moe_lean_form2(old2);
    }
    const int old_narrow = cuda_moe_lean_narrow(0);
    printf("  24-row tiles on n24 whatever their rows (MOESERVE_LEAN_NARROW=0)\n");
    lean_form_cases(m, set, var, forms24, 2, 1);
    cuda_moe_lean_narrow(old_narrow);
}

/* the same file: NVFP4's 4-row tiles at one pair an expert or fewer in stacked high precision
 * (MOESERVE_LEAN_ROWS4) on (1), off (0) or as the variable says (-1); returns the setting before */
int cuda_moe_lean_rows4(int on);
/* the same file: the tile rows the NVFP4 lean kernels take n_pairs pairs in (0: not theirs) */
int cuda_moe_w4_lean_rows(int64_t n_pairs, int E, int D, int F, int tiny, int split);

/* the same file: the tiny path's sizes on the 4-row tiles with no prepare kernel
 * (MOESERVE_LEAN_TINY) on (1), off (0) or as the variable says (-1); returns the setting before */
int cuda_moe_lean_tiny(int on);
/* the same in medium precision (MOESERVE_LEAN_TINY_MEDIUM), as cuda_moe_lean_tiny */
int cuda_moe_lean_tiny_medium(int on);
/* whether n_pairs pairs at the tiny path's sizes take it (moe_lean_w4_tiny; split: in high
 * precision, else in medium) */
int cuda_moe_w4_lean_tiny_on(int64_t n_pairs, int E, int D, int F, int split);

/* m's experts on x and ids (T tokens) in both precisions with set(off), then set(on): the same
 * bits (what: the switch, for the message) */
static void same_bits_switched(const model *m, const float *x, const int32_t *ids, int T,
                               int (*set)(int), int off, int on, const char *what) {
    const size_t no = (size_t)T * m->K * m->D;
    float *a = xmalloc(no * 4), *b = xmalloc(no * 4);
    for (int pi = 0; pi < N_PRECISIONS; pi++) {
        set_precision((matmul_precision)pi);
        set(off);
        gpu_moe(m, a, x, ids, T);
        set(on);
        gpu_moe(m, b, x, ids, T);
        CHECK(memcmp(a, b, no * 4) == 0, "%s %s T=%d: %s, the same bits", m->name,
              precision_name[pi], T, what);
    }
    set_precision(MATMUL_PRECISION_HIGH);
    free(a);
    free(b);
}

/* NVFP4's 4-row tiles: taken where the rule says (stacked high precision, at most one pair an
 * expert on average), against the CPU, and the same bits as 8-row tiles in forms 3 and 4 (their
 * hi and lo rows in one n8 instead of n16: each column's sums the same), at T = 1 to 4 of m (whose
 * E holds them). MOESERVE_LEAN_TINY there (each block grouping topk_ids itself, x converted in
 * GEMM 1): the same bits as the 4-row tiles after the prepare kernel, in medium precision
 * (MOESERVE_LEAN_TINY_MEDIUM, the lo parts zero) as the 8-row tiles', against the CPU with skipped
 * slots, and moe_experts_n with a device count of rows; and the rules of both switches. */
static void lean_rows4_cases(const model *m) {
    const int E = m->E, D = m->D, F = m->F, K = m->K;
    const int old_lean = cuda_moe_w4_lean(1), old_form = cuda_moe_w4_lean_form(-1);
    const int old4 = cuda_moe_lean_rows4(1), old_stack = cuda_moe_lean_stack(1);
    const int old_tiny = cuda_moe_lean_tiny(2), old_tiny_m = cuda_moe_lean_tiny_medium(0);
    CHECK(cuda_moe_w4_lean_rows(E, E, D, F, 0, 1) == 4, "4-row tiles at %d pairs over %d experts",
          E, E);
    CHECK(cuda_moe_w4_lean_rows(E + 1, E, D, F, 0, 1) == 8, "8-row tiles past one pair an expert");
    CHECK(cuda_moe_w4_lean_rows(E, E, D, F, 0, 0) == 8, "8-row tiles in medium precision");
    cuda_moe_lean_stack(0);
    CHECK(cuda_moe_w4_lean_rows(E, E, D, F, 0, 1) == 8, "8-row tiles in one chain");
    cuda_moe_lean_stack(1);
    cuda_moe_lean_rows4(0);
    CHECK(cuda_moe_w4_lean_rows(E, E, D, F, 0, 1) == 8, "8-row tiles, MOESERVE_LEAN_ROWS4=0");
    cuda_moe_lean_rows4(1);
    /* the rule (2): the tiny path's sizes on small experts (Qwen3-30B-A3B's) take the lean
     * kernels in high precision past 8 pairs alone */
    cuda_moe_w4_lean(2);
    CHECK(cuda_moe_w4_lean_rows(16, 128, 2048, 768, 1, 1) == 4, "the tiny path's 16 pairs in high");
    CHECK(cuda_moe_w4_lean_rows(8, 128, 2048, 768, 1, 1) == 0, "the tiny path's 8 pairs in high");
    CHECK(cuda_moe_w4_lean_rows(16, 128, 2048, 768, 1, 0) == 0, "the tiny path's 16 in medium");
    /* MOESERVE_LEAN_TINY's rule (2): there with no prepare kernel on small experts alone; 1: on
     * DeepSeek-V3's too; 0: nowhere */
    CHECK(cuda_moe_w4_lean_tiny_on(16, 128, 2048, 768, 1),
          "no prepare kernel at 16 pairs, Qwen3's");
    CHECK(cuda_moe_w4_lean_tiny_on(8, 128, 2048, 768, 1), "no prepare kernel at 8 pairs, Qwen3's");
    CHECK(!cuda_moe_w4_lean_tiny_on(16, 256, 7168, 2048, 1), "the prepare kernel, DeepSeek-V3's");
    CHECK(!cuda_moe_w4_lean_tiny_on(8, 128, 2048, 768, 0), "..._MEDIUM=0: the tiny path");
    cuda_moe_lean_tiny_medium(1);
    CHECK(cuda_moe_w4_lean_tiny_on(8, 128, 2048, 768, 0), "MOESERVE_LEAN_TINY_MEDIUM=1, Qwen3's");
    CHECK(!cuda_moe_w4_lean_tiny_on(8, 256, 7168, 2048, 0), "..._MEDIUM=1, DeepSeek-V3's not");
    cuda_moe_lean_tiny_medium(0);
    cuda_moe_lean_tiny(1);
    CHECK(cuda_moe_w4_lean_tiny_on(16, 256, 7168, 2048, 1),
          "MOESERVE_LEAN_TINY=1 on DeepSeek-V3's");
    cuda_moe_lean_tiny(0);
    CHECK(!cuda_moe_w4_lean_tiny_on(16, 128, 2048, 768, 1), "MOESERVE_LEAN_TINY=0 on Qwen3's");
    cuda_moe_w4_lean(1);
    set_precision(MATMUL_PRECISION_HIGH);
    for (int T = 1; T <= 4 && T * K <= E; T++) {
        const size_t no = (size_t)T * K * D;
        float *x = xmalloc((size_t)T * D * sizeof(float)), *a = xmalloc(no * 4),
              *b = xmalloc(no * 4);
        int32_t *ids = xmalloc((size_t)T * K * sizeof(int32_t));
        for (size_t i = 0; i < (size_t)T * D; i++)
            x[i] = rng_uniform();
        make_routing(ids, T, K, E, ROUTE_RANDOM, 0.0);
        for (int form = 3; form <= 4; form++) {
            cuda_moe_w4_lean_form(form);
            cuda_moe_lean_rows4(1);
            printf("  4-row tiles (MOESERVE_LEAN_ROWS4=1, form %d), T=%d\n", form, T);
            run_case(m, T, ROUTE_RANDOM, 0.0, T, true, NULL); /* against the CPU */
            set_precision(MATMUL_PRECISION_HIGH);
            gpu_moe(m, a, x, ids, T);
            cuda_moe_lean_rows4(0);
            gpu_moe(m, b, x, ids, T);
            CHECK(memcmp(a, b, no * 4) == 0, "%s T=%d form %d: 4-row tiles the 8-row tiles' bits",
                  m->name, T, form);
            cuda_moe_lean_rows4(1);
            /* with no prepare kernel: high precision the 4-row tiles' bits, medium (the lo parts
             * zero) the 8-row tiles' */
            cuda_moe_lean_tiny_medium(1);
            same_bits_switched(m, x, ids, T, cuda_moe_lean_tiny, 0, 1,
                               form == 3 ? "no prepare kernel (MOESERVE_LEAN_TINY), form 3"
                                         : "no prepare kernel (MOESERVE_LEAN_TINY), form 4");
            cuda_moe_lean_tiny(1);
            printf("  4-row tiles with no prepare kernel (MOESERVE_LEAN_TINY=1, _MEDIUM=1, form "
                   "%d), T=%d\n",
                   form, T);
            run_case(m, T, ROUTE_RANDOM, 0.25, T, true, NULL); /* skipped slots, against the CPU */
            if (T > 1) run_rows_n(m, T, T - 1);
            set_precision(MATMUL_PRECISION_HIGH);
            cuda_moe_lean_tiny(0);
            cuda_moe_lean_tiny_medium(0);
        }
        free(x);
        free(a);
        free(b);
        free(ids);
    }
    cuda_moe_lean_tiny(old_tiny);
    cuda_moe_lean_tiny_medium(old_tiny_m);
    cuda_moe_lean_stack(old_stack);
    cuda_moe_lean_rows4(old4);
    cuda_moe_w4_lean_form(old_form);
    cuda_moe_w4_lean(old_lean);
}

/* The lean kernels (moe_lean.cu, the weights as wgmma's A operand) on a shape they take (D and F
 * multiples of 256), switched on: against the CPU at decode sizes in both precisions, with skipped
 * slots and every pair on one expert, and each batch's last token alone bit for bit against its
 * rows in the batch: lean against lean (tiles of 8, 16 and 32 rows) up to 16 pairs an expert,
 * lean against the tiles and the wgmma kernel above (T 300, 400); in each of the kernels' seven
 * forms, and with 24-row tiles (MOESERVE_LEAN_ROWS24) in forms 5 and 6. High precision's products
 * stacked (the default: other sums than the tiles', so the token alone within the tolerance of its
 * rows instead; at one pair an expert or fewer in 4-row tiles, lean_rows4_cases), then in one
 * chain in forms 1 to 6 (bit for bit). */
static void lean_tiny32_cases(const model *m, bool w8);
static void test_nvfp4_lean(void) {
    static const int forms[] = {0, 1, 2, 3, 4, 5, 6};
    model m;
    if (model_nvfp4(&m, "nvfp4-tiny32", 32, 256, 256, 4) == 0) lean_tiny32_cases(&m, false);
    model_free(&m);
    if (model_nvfp4(&m, "nvfp4-lean", 8, 512, 256, 2) == 0) {
        lean_all_cases(&m, cuda_moe_w4_lean, "MOESERVE_NVFP4_LEAN", forms, 7);
        lean_rows4_cases(&m);
        /* the cases above stack high precision's products (the default); forms 1 to 6 again
         * with them in one chain, the tiles' sums bit for bit */
        static const int chained[] = {1, 2, 3, 4, 5, 6}, chained24[] = {5, 6};
        const int old_stack = cuda_moe_lean_stack(0);
        printf("  high precision's products in one chain (MOESERVE_LEAN_STACK=0)\n");
        lean_form_cases(&m, cuda_moe_w4_lean, "MOESERVE_NVFP4_LEAN", chained, 6, 0);
        lean_form_cases(&m, cuda_moe_w4_lean, "MOESERVE_NVFP4_LEAN", chained24, 2, 1);
        cuda_moe_lean_stack(old_stack);
    }
    model_free(&m);
}

static void test_nvfp4(bool full) {
    printf("NVFP4 experts (W4A16)\n");
    model m;
    test_nvfp4_lean();
    if (model_nvfp4(&m, "nvfp4-small", 8, 256, 128, 2) == 0) {
        /* the W4A16 tiles at every size, then the wgmma kernel at prefill sizes (more than 96
         * pairs an expert), B tiles decoded in shared memory */
        const int old = cuda_moe_w4_wgmma(0);
        quant_small_cases(&m);
        check_experts_q(&m, A2A_PAYLOAD_NVFP4);
        cuda_moe_w4_wgmma(old);
        /* (330 and 560: tiles with a half of 1 to 32 rows, bwg_short_half) */
        static const int Ts[] = {400, 1000, 330, 560};
        wgmma_cases(&m, cuda_moe_w4_wgmma, "MOESERVE_W4A16_WGMMA=1", Ts, 4, 64);
    }
    model_free(&m);
    {
        moe_experts w = {.E = 2};
        char err[256] = "";
        uint8_t b[16] = {0};
        float s2[6] = {1, 1, 1, 1, 1, 1};
        CHECK(cuda_prepare_experts_nvfp4(&w, b, b, b, b, s2, 96, 64, err, sizeof err) != 0 &&
                  strstr(err, "multiples of 64") && !w.gate_up,
              "NVFP4 experts with D = 96 refused (%s)", err);
    }
    { /* a negative group scale is refused (the kernels' scale encoding has no sign) */
        moe_experts w = {.E = 1};
        char err[256] = "";
        static uint8_t q[64 * 64 * 2], sf[64 * 64 * 2 / 16];
        memset(sf, 0x38, sizeof sf); /* 1.0 */
        sf[5] = 0xB8;                /* -1.0 */
        float s2[3] = {1, 1, 1};
        CHECK(cuda_prepare_experts_nvfp4(&w, q, sf, q, sf, s2, 64, 64, err, sizeof err) != 0 &&
                  strstr(err, "negative or NaN") && !w.gate_up,
              "NVFP4 experts with a negative group scale refused (%s)", err);
    }
    if (!full) return;
    if (model_nvfp4(&m, "qwen3-30b-a3b nvfp4", 128, 2048, 768, 8) == 0) {
        quant_qwen3_cases(&m);
        check_experts_q(&m, A2A_PAYLOAD_NVFP4);
        /* prefill sizes on the wgmma kernel, then against the tiles side by side, from 8 pairs
         * an expert (T 256, 1024: issue 8's decode sizes, where the tiles' decode bounds them) */
        const int old_min = cuda_moe_w4_wgmma_min(8);
        static const int Tc[] = {2048, 256}, Tw[] = {256, 1024, 2048, 4096};
        wgmma_cases(&m, cuda_moe_w4_wgmma, "MOESERVE_W4A16_WGMMA=1", Tc, 2, 16);
        wgmma_against_tiles(&m, cuda_moe_w4_wgmma, "nvfp4", Tw, 4);
        cuda_moe_w4_wgmma_min(old_min);
    }
    model_free(&m);
}

/* ---- FP8 experts (W8A16) ---- */

int cuda_prepare_experts_fp8(moe_experts *w, const uint8_t *gate_up_q, const float *gate_up_s,
                             const uint8_t *down_q, const float *down_s, int D, int F, char *err,
                             size_t errlen);

/* m's experts (F32 pools) quantized to block FP8 by kernels/cpu/quant.c's formula: the host
 * tensors then hold the dequantized weights (the CPU reference is an fp32 GEMM on them) and the
 * device the codes and the scales a row each. Each matrix's blocks are scaled by a factor of its
 * own (up to 2^+-3 apart) so that a wrong block's scale shows. 0 when the experts are on the
 * device. */
static int model_fp8(model *m, const char *name, int E, int D, int F, int K) {
    model_init(m, name, E, D, F, K, DTYPE_F32);
    m->quantized = true;
    m->fp8_input = true;
    const int nkd = (D + 127) / 128, nkf = (F + 127) / 128, nbf = (F + 127) / 128,
              nbd = (D + 127) / 128;
    m->wbytes = 1.0 + 4.0 / 128;
    const size_t mat = (size_t)F * D;
    uint8_t *guq = xmalloc((size_t)E * 2 * mat), *dq = xmalloc((size_t)E * mat);
    float *gus = xmalloc((size_t)E * nkd * 2 * F * sizeof(float));
    float *ds = xmalloc((size_t)E * nkf * D * sizeof(float));
    m->deq = xmalloc((size_t)E * 3 * mat * sizeof(float));
    const double t0 = now_s();
#pragma omp parallel for schedule(dynamic)
    for (int e = 0; e < E; e++) {
        float *dg = m->deq + (size_t)3 * e * mat, *du = dg + mat, *dd = du + mat;
        const float *src[3] = {m->gate[e].data, m->up[e].data, m->down[e].data};
        float *deq[3] = {dg, du, dd};
        for (int p = 0; p < 3; p++) {
            const int N = p == 2 ? D : F, Kd = p == 2 ? F : D;
            const int nb = p == 2 ? nbd : nbf, nk = p == 2 ? nkf : nkd;
            float *sc = xmalloc((size_t)nb * nk * sizeof(float));
            uint8_t *q = p == 2 ? dq + (size_t)e * mat : guq + (size_t)(2 * e + p) * mat;
            /* each block of rows / k its own magnitude: blocks mixed up would show */
            for (int r = 0; r < N; r++)
                for (int k = 0; k < Kd; k++) {
                    const int sh = (r / 128 * 3 + k / 128 + e + 2 * p) % 7 - 3;
                    deq[p][(size_t)r * Kd + k] = src[p][(size_t)r * Kd + k] * ldexpf(1.0f, sh);
                }
            quant_fp8_blocks(q, sc, deq[p], N, Kd);
            dequant_fp8_blocks(deq[p], q, sc, N, Kd);
            if (p == 2)
                quant_fp8_row_scales(ds + (size_t)e * nkf * D, D, sc, D, F);
            else
                quant_fp8_row_scales(gus + (size_t)e * nkd * 2 * F + (size_t)p * F, 2 * F, sc, F,
                                     D);
            free(sc);
        }
        m->gate[e].data = dg;
        m->up[e].data = du;
        m->down[e].data = dd;
    }
    char err[256] = "";
    const int rc = cuda_prepare_experts_fp8(&m->w, guq, gus, dq, ds, D, F, err, sizeof err);
    CHECK(rc == 0, "%s: cuda_prepare_experts_fp8: %s", name, err);
    if (rc == 0)
        printf("%s: %d experts quantized to FP8 on the host in %.1f s, %.2f GiB on the device\n",
               name, E, now_s() - t0, (double)E * 3 * mat * m->wbytes / (1 << 30));
    free(guq);
    free(dq);
    free(gus);
    free(ds);
    return rc;
}

/* the same file: the FP8 experts' lean kernels (MOESERVE_FP8_LEAN; 2 when unset) */
int cuda_moe_w8_lean(int on);
/* their tiny sizes with no prepare kernel (MOESERVE_FP8_LEAN_TINY: 0, 1, 2 as the variable, -1 it;
 * returns the setting before), and whether n_pairs pairs take them (split: in high precision) */
int cuda_moe_fp8_lean_tiny(int on);
int cuda_moe_w8_lean_tiny_on(int64_t n_pairs, int E, int D, int F, int split);

/* FP8's tiny sizes on the 8-row tiles with no prepare kernel (MOESERVE_FP8_LEAN_TINY): the rule,
 * then at T K = 2 to 16 (up to 2 pairs an expert, and every pair on one expert: two tiles of it)
 * in both precisions the same bits as the 8-row tiles after the prepare kernel, against the CPU
 * with a quarter of the slots skipped, and moe_experts_n with a device count of rows. */
static void lean_tiny8_cases(const model *m) {
    const int K = m->K, D = m->D;
    const int old_lean = cuda_moe_w8_lean(1), old_form = cuda_moe_w4_lean_form(-1);
    const int old_stack = cuda_moe_lean_stack(1), old_tiny = cuda_moe_fp8_lean_tiny(2);
    CHECK(cuda_moe_w8_lean_tiny_on(16, 128, 2048, 768, 1), "FP8 no prepare kernel, Qwen3's, high");
    CHECK(cuda_moe_w8_lean_tiny_on(8, 128, 2048, 768, 0), "FP8 no prepare kernel, Qwen3's, medium");
    CHECK(!cuda_moe_w8_lean_tiny_on(16, 256, 7168, 2048, 1), "FP8: the prepare kernel, DeepSeek's");
    cuda_moe_lean_stack(2);
    CHECK(!cuda_moe_w8_lean_tiny_on(16, 128, 2048, 768, 1), "FP8 stacked: the prepare kernel");
    CHECK(cuda_moe_w8_lean_tiny_on(16, 128, 2048, 768, 0), "FP8 stacked: medium unaffected");
    cuda_moe_lean_stack(1);
    cuda_moe_w4_lean_form(2);
    CHECK(!cuda_moe_w8_lean_tiny_on(16, 128, 2048, 768, 1), "FP8 in form 2: the prepare kernel");
    cuda_moe_w4_lean_form(-1);
    cuda_moe_fp8_lean_tiny(1);
    CHECK(cuda_moe_w8_lean_tiny_on(16, 256, 7168, 2048, 1), "MOESERVE_FP8_LEAN_TINY=1, DeepSeek's");
    cuda_moe_fp8_lean_tiny(0);
    CHECK(!cuda_moe_w8_lean_tiny_on(16, 128, 2048, 768, 1), "MOESERVE_FP8_LEAN_TINY=0");
    for (int T = 1; T * K <= 16; T++) {
        float *x = xmalloc((size_t)T * D * sizeof(float));
        int32_t *ids = xmalloc((size_t)T * K * sizeof(int32_t));
        for (size_t i = 0; i < (size_t)T * D; i++)
            x[i] = rng_uniform();
        for (int route = 0; route < 2; route++) {
            make_routing(ids, T, K, m->E, route ? ROUTE_ONE : ROUTE_RANDOM, 0.0);
            same_bits_switched(m, x, ids, T, cuda_moe_fp8_lean_tiny, 0, 1,
                               route ? "no prepare kernel (MOESERVE_FP8_LEAN_TINY), one expert"
                                     : "no prepare kernel (MOESERVE_FP8_LEAN_TINY)");
        }
        printf("  8-row tiles with no prepare kernel (MOESERVE_FP8_LEAN_TINY=1), T=%d\n", T);
        run_case(m, T, ROUTE_RANDOM, 0.25, T, true, NULL); /* skipped slots, against the CPU */
        if (T > 1) run_rows_n(m, T, T - 1);
        set_precision(MATMUL_PRECISION_HIGH);
        cuda_moe_fp8_lean_tiny(0);
        free(x);
        free(ids);
    }
    cuda_moe_fp8_lean_tiny(old_tiny);
    cuda_moe_lean_stack(old_stack);
    cuda_moe_w4_lean_form(old_form);
    cuda_moe_w8_lean(old_lean);
}

/* the same file: the most pairs the kernels with no prepare kernel take (MOESERVE_LEAN_TINY_PAIRS,
 * 16 when unset), or the variable (-1); returns the setting before */
int cuda_moe_lean_tiny_pairs(int n);

/* The kernels with no prepare kernel past the tiny path's 16 pairs (MOESERVE_LEAN_TINY_PAIRS=32),
 * on m's experts (E 32, K 4: 20 to 32 pairs at one an expert or fewer; NVFP4's 4-row tiles, FP8's
 * 8-row tiles with MOESERVE_FP8_LEAN_TINY=1): in both precisions the same bits as the tiles after
 * the prepare kernel that take those sizes with the switch at 16, against the CPU with a quarter of
 * the slots skipped, and moe_experts_n with a device count of rows. */
static void lean_tiny32_cases(const model *m, bool w8) {
    const int K = m->K, D = m->D;
    const int old_pairs = cuda_moe_lean_tiny_pairs(16), old_tiny8 = cuda_moe_fp8_lean_tiny(1);
    const int old_tiny = cuda_moe_lean_tiny(1), old_tiny_m = cuda_moe_lean_tiny_medium(1);
    for (int T = 5; T <= 8 && T * K <= 32; T++) {
        float *x = xmalloc((size_t)T * D * sizeof(float));
        int32_t *ids = xmalloc((size_t)T * K * sizeof(int32_t));
        for (size_t i = 0; i < (size_t)T * D; i++)
            x[i] = rng_uniform();
        make_routing(ids, T, K, m->E, ROUTE_RANDOM, 0.0);
        same_bits_switched(m, x, ids, T, cuda_moe_lean_tiny_pairs, 16, 32,
                           "no prepare kernel past 16 pairs (MOESERVE_LEAN_TINY_PAIRS=32)");
        printf("  %s: no prepare kernel at %d pairs (MOESERVE_LEAN_TINY_PAIRS=32)\n",
               w8 ? "FP8" : "NVFP4", T * K);
        run_case(m, T, ROUTE_RANDOM, 0.25, T, true, NULL); /* skipped slots, against the CPU */
        run_rows_n(m, T, T - 1);
        set_precision(MATMUL_PRECISION_HIGH);
        cuda_moe_lean_tiny_pairs(16);
        free(x);
        free(ids);
    }
    cuda_moe_lean_tiny_medium(old_tiny_m);
    cuda_moe_lean_tiny(old_tiny);
    cuda_moe_fp8_lean_tiny(old_tiny8);
    cuda_moe_lean_tiny_pairs(old_pairs);
}

/* The FP8 experts' lean kernels (moe_lean.cu: a stage a block of 128 k, its sums folded into the
 * totals times the rows' scales as the tiles fold them), switched on, as test_nvfp4_lean checks
 * NVFP4's: in forms 0 to 2, 5 and 6 (3 and 4 run as 1 on FP8), 24-row tiles in 5 and 6, on D 512
 * F 256 and on F 384 (a multiple of 128, not of 256); high precision's products in one chain
 * (the default: bit for bit), then stacked in forms 1, 2, 5 and 6 (within the tolerance); the
 * tiny sizes with no prepare kernel (lean_tiny8_cases). */
static void test_fp8_lean(void) {
    static const struct {
        const char *name;
        int D, F;
    } shapes[] = {{"fp8-lean", 512, 256}, {"fp8-lean-384", 256, 384}};
    static const int forms[] = {0, 1, 2, 5, 6}; /* 3 and 4 run as 1 */
    for (int si = 0; si < 2; si++) {
        model m;
        if (model_fp8(&m, shapes[si].name, 8, shapes[si].D, shapes[si].F, 2) == 0) {
            lean_all_cases(&m, cuda_moe_w8_lean, "MOESERVE_FP8_LEAN", forms, 5);
            lean_tiny8_cases(&m);
            /* high precision's products stacked (MOESERVE_LEAN_STACK=2; not the default) */
            static const int stacked[] = {1, 2, 5, 6}, stacked24[] = {5, 6};
            const int old_stack = cuda_moe_lean_stack(2);
            printf("  high precision's products stacked (MOESERVE_LEAN_STACK=2)\n");
            lean_form_cases(&m, cuda_moe_w8_lean, "MOESERVE_FP8_LEAN", stacked, 4, 0);
            lean_form_cases(&m, cuda_moe_w8_lean, "MOESERVE_FP8_LEAN", stacked24, 2, 1);
            cuda_moe_lean_stack(old_stack);
        }
        model_free(&m);
    }
    model m;
    if (model_fp8(&m, "fp8-tiny32", 32, 256, 256, 4) == 0) lean_tiny32_cases(&m, true);
    model_free(&m);
}

/* FP8 experts against the fp32 GEMMs on their dequantized weights, batch invariance included
 * (the tiny path against the grouped one, every tile shape), partial 128-k blocks, bad input
 * refused; with full (the --fp8 run) also Qwen3-30B-A3B's shape, checked and timed. */
static void test_fp8(bool full) {
    printf("FP8 experts (W8A16)\n");
    model m;
    test_fp8_lean();
    if (model_fp8(&m, "fp8-small", 8, 256, 128, 2) == 0) {
        /* the tiles at every size (the lean kernels, on by default up to 8 pairs an expert, have
         * their cases above) */
        const int old_lean = cuda_moe_w8_lean(0);
        quant_small_cases(&m);
        cuda_moe_w8_lean(old_lean);
        check_experts_q(&m, A2A_PAYLOAD_FP8);
        /* high precision at prefill sizes on the wgmma kernel (forced on here): B tiles
         * decoded in shared memory, each 128-k block's sums folded into the totals times its
         * scale */
        static const int Ts[] = {400, 1000};
        wgmma_cases(&m, cuda_moe_w8_wgmma, "MOESERVE_W8A16_WGMMA=1, high", Ts, 2, 64);
    }
    model_free(&m);
    /* the same with a partial 128-k block in GEMM 2 (F = 192) */
    if (model_fp8(&m, "fp8-wgmma-partial", 4, 256, 192, 2) == 0) {
        static const int Ts[] = {400};
        wgmma_cases(&m, cuda_moe_w8_wgmma, "MOESERVE_W8A16_WGMMA=1, high", Ts, 1, 64);
    }
    model_free(&m);
    /* the test checkpoint's shape: one partial 128-k block both ways */
    if (model_fp8(&m, "fp8-64", 8, 64, 64, 2) == 0) quant_small_cases(&m);
    model_free(&m);
    if (model_fp8(&m, "fp8-partial-blocks", 4, 320, 192, 2) == 0) { /* Kd % 128 == 64 both ways */
        const int Ts[] = {1, 2, 8, 40, 300};
        for (size_t i = 0; i < sizeof Ts / sizeof Ts[0]; i++)
            run_case(&m, Ts[i], ROUTE_RANDOM, 0.0, 64, Ts[i] <= 40, NULL);
    }
    model_free(&m);
    {
        moe_experts w = {.E = 2};
        char err[256] = "";
        static uint8_t q[2 * 96 * 64 * 2];
        static float sc[2 * 2 * 96 * 2];
        CHECK(cuda_prepare_experts_fp8(&w, q, sc, q, sc, 96, 64, err, sizeof err) != 0 &&
                  strstr(err, "multiples of 64") && !w.gate_up,
              "FP8 experts with D = 96 refused (%s)", err);
    }
    { /* a NaN code is refused (it would decode to 480) */
        moe_experts w = {.E = 1};
        char err[256] = "";
        static uint8_t q[64 * 64 * 2];
        static float sc[2 * 64];
        for (int i = 0; i < 2 * 64; i++)
            sc[i] = 1.0f;
        q[77] = 0xFF;
        CHECK(cuda_prepare_experts_fp8(&w, q, sc, q, sc, 64, 64, err, sizeof err) != 0 &&
                  strstr(err, "NaN") && !w.gate_up,
              "FP8 experts with a NaN code refused (%s)", err);
        q[77] = 0;
        sc[3] = INFINITY;
        CHECK(cuda_prepare_experts_fp8(&w, q, sc, q, sc, 64, 64, err, sizeof err) != 0 &&
                  strstr(err, "not finite") && !w.gate_up,
              "FP8 experts with an infinite block scale refused (%s)", err);
    }
    if (!full) return;
    if (model_fp8(&m, "qwen3-30b-a3b fp8", 128, 2048, 768, 8) == 0) {
        quant_qwen3_cases(&m);
        check_experts_q(&m, A2A_PAYLOAD_FP8);
        if (full) time_moe(&m, 4096, ROUTE_RANDOM, 8, 5); /* a prefill chunk (medium: W8A8 GEMM 1) */
        /* high at prefill sizes on the wgmma kernel, then against the tiles side by side
         * (medium's rows are the same path in both) */
        static const int Tc[] = {2048}, Tw[] = {2048, 4096};
        wgmma_cases(&m, cuda_moe_w8_wgmma, "MOESERVE_W8A16_WGMMA=1, high", Tc, 1, 16);
        wgmma_against_tiles(&m, cuda_moe_w8_wgmma, "fp8", Tw, 2);
    }
    model_free(&m);
}

int main(int argc, char **argv) {
    const bool small_only = argc > 1 && strcmp(argv[1], "--small") == 0;
    const bool timing_only = argc > 1 && strcmp(argv[1], "--timing") == 0;
    const bool timing_deepseek = argc > 1 && strcmp(argv[1], "--timing-deepseek") == 0;
    const bool decode_only = argc > 1 && strcmp(argv[1], "--decode") == 0;
    const int max_T = (timing_only || timing_deepseek) && argc > 2 ? atoi(argv[2]) : 0;
    char err[256] = "";
    { /* the lean kernels' places, emulated on the host: no device needed */
        char msg[256] = "";
        CHECK(cuda_moe_lean_host_check(msg, sizeof msg) == 0, "%s", msg);
        printf("%s\n", msg);
    }
    gpu = ops_cuda(0, err, sizeof err);
    if (!gpu) {
        printf("skipped: %s\n", err);
        CHECK_SUMMARY();
    }
    cpu = ops_cpu();
    if (argc > 1 && strcmp(argv[1], "--nvfp4") == 0) { /* the NVFP4 checks and their timings */
        copy_gbs = measure_copy_bandwidth();
        test_nvfp4(true);
        print_timings();
        print_worst();
        CHECK_SUMMARY();
    }
    if (argc > 2 && strcmp(argv[1], "--nvfp4-timing") == 0) { /* one size, for a profiler */
        model m;
        copy_gbs = measure_copy_bandwidth();
        if (model_nvfp4(&m, "qwen3-30b-a3b nvfp4", 128, 2048, 768, 8) == 0)
            time_moe(&m, atoi(argv[2]), ROUTE_RANDOM, 8, 50);
        model_free(&m);
        print_timings();
        CHECK_SUMMARY();
    }
    /* --bf16-timing T (Qwen3-30B-A3B's experts), --deepseek-timing T: one size, for a profiler */
    const bool ds_timing = argc > 2 && strcmp(argv[1], "--deepseek-timing") == 0;
    if (ds_timing || (argc > 2 && strcmp(argv[1], "--bf16-timing") == 0)) {
        model m;
        if (ds_timing)
            model_init(&m, "deepseek-v3-like", 256, 7168, 2048, 8, DTYPE_BF16);
        else
            model_init(&m, "qwen3-30b-a3b", 128, 2048, 768, 8, DTYPE_BF16);
        copy_gbs = measure_copy_bandwidth();
        if (model_prepare(&m) == 0)
            time_moe(&m, atoi(argv[2]), ROUTE_RANDOM, 8, ds_timing ? 10 : 50);
        model_free(&m);
        print_timings();
        CHECK_SUMMARY();
    }
    /* issue 8's decode sizes on DeepSeek-V3's shape; --deepseek-fp8-timing: FP8 alone, in the
     * FP8 x FP8 GEMM's configuration $FP8G_CONFIG (default -1) */
    const bool ds_fp8 = argc > 3 && strcmp(argv[1], "--deepseek-fp8-timing") == 0;
    const bool ds_nvfp4 = argc > 3 && strcmp(argv[1], "--deepseek-nvfp4-timing") == 0;
    if (ds_fp8 || ds_nvfp4 || (argc > 3 && strcmp(argv[1], "--deepseek-q-timing") == 0)) {
        if (argc - 3 > (int)(sizeof rows / sizeof rows[0]) / 2) {
            fprintf(stderr, "%s: at most %d sizes\n", argv[1],
                    (int)(sizeof rows / sizeof rows[0]) / 2);
            return 2;
        }
        copy_gbs = measure_copy_bandwidth();
        const int E = atoi(argv[2]);
        const char *cfg = getenv("FP8G_CONFIG");
        if (cfg) cuda_fp8_grouped_gemm_config(atoi(cfg));
        model m;
        memset(&m, 0, sizeof m);
        if (!ds_nvfp4 && model_fp8(&m, "deepseek-v3-like fp8", E, 7168, 2048, 8) == 0)
            for (int i = 3; i < argc; i++)
                time_moe(&m, atoi(argv[i]), ROUTE_RANDOM, 8, 10);
        model_free(&m);
        if (!ds_fp8 && model_nvfp4(&m, "deepseek-v3-like nvfp4", E, 7168, 2048, 8) == 0)
            for (int i = 3; i < argc; i++)
                time_moe(&m, atoi(argv[i]), ROUTE_RANDOM, 8, 10);
        model_free(&m);
        print_timings();
        CHECK_SUMMARY();
    }
    /* --fp8 [C], --fp8-timing T [C]: with the FP8 x FP8 GEMM's tile configuration C */
    if (argc > 1 && strncmp(argv[1], "--fp8", 5) == 0 && argc > (argv[1][5] ? 3 : 2))
        cuda_fp8_grouped_gemm_config(atoi(argv[argv[1][5] ? 3 : 2]));
    if (argc > 1 && strcmp(argv[1], "--fp8") == 0) { /* the FP8 checks and their timings */
        copy_gbs = measure_copy_bandwidth();
        test_fp8(true);
        print_timings();
        print_worst();
        CHECK_SUMMARY();
    }
    if (argc > 2 && strcmp(argv[1], "--fp8-timing") == 0) { /* one size, for a profiler */
        model m;
        copy_gbs = measure_copy_bandwidth();
        if (model_fp8(&m, "qwen3-30b-a3b fp8", 128, 2048, 768, 8) == 0)
            time_moe(&m, atoi(argv[2]), ROUTE_RANDOM, 8, 50);
        model_free(&m);
        print_timings();
        CHECK_SUMMARY();
    }
    if (argc > 1 &&
        strcmp(argv[1], "--quant-small") == 0) { /* the quantized formats' small shapes */
        test_nvfp4(false);
        test_fp8(false);
        print_worst();
        CHECK_SUMMARY();
    }
    if (argc > 1 && strcmp(argv[1], "--det") == 0) { /* deterministic mode's sizes alone */
        test_deterministic(true);
        print_worst();
        CHECK_SUMMARY();
    }
    if (decode_only) {
        test_qwen3(true, true, 0);
        print_worst();
        CHECK_SUMMARY();
    }
    if (!timing_only) {
        test_precision_setting();
        test_prepare_errors();
        test_small();
        test_tiny();
        test_wgmma();
        test_deterministic(!small_only);
        if (!timing_deepseek) test_nvfp4(false);
        if (!timing_deepseek) test_fp8(false);
    }
    if (!small_only) {
        copy_gbs = measure_copy_bandwidth();
        if (!timing_deepseek) test_qwen3(!timing_only, false, max_T);
        if (!timing_only) test_deepseek(!timing_deepseek, max_T);
        print_timings();
    }
    if (!timing_only && !timing_deepseek) print_worst();
    CHECK_SUMMARY();
}

#endif
