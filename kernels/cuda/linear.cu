// linear on the GPU through cuBLASLt: out[T, N] fp32 = x[T, Kin] fp32 . w[N, Kin]^T.
//
// Choices:
// - 16-bit weights (BF16, F16): x is rounded to the weight's dtype (nearest even) into a device
//   scratch buffer, grown as needed and kept, and the product runs on the tensor cores with fp32
//   accumulation and fp32 output. The rounding of x is the one loss against the CPU, which
//   multiplies fp32 x by the widened weights: at most 2^-8 (BF16) or 2^-11 (F16) of
//   sum_k |x_k||w_nk| per output (the tolerance tests/test_cuda_ops.c states).
// - F32 weights: an fp32 GEMM with CUBLAS_COMPUTE_32F, which excludes TF32, for accuracy.
// - Row-major to column-major: cuBLASLt sees w as a column-major [Kin, N] matrix and x as
//   [Kin, T], and computes out^T [N, T] = op(w)^T . x (transa = T, transb = N: the "TN" layout the
//   tensor-core kernels prefer), which is out [T, N] row-major.
// - One handle and a 32 MiB workspace, made on first use; every matmul is queued on cuda_stream().
//   The algorithm comes from cublasLtMatmulAlgoGetHeuristic (the first answer) and is cached per
//   (T, N, Kin, dtype, pointer alignments), with its descriptors, in a direct-mapped table: a
//   serving run sees one shape per layer kind and batch size, and a collision only costs a new
//   query. Each new plan logs cuBLASLt's choice (algorithm, tile, stages, split-K, reduction) at
//   debug level. Not thread-safe: one engine thread per process calls the ops.
//
// Batch invariance (what the deterministic mode will need): for one cached algorithm the result
// is the same bits on every run. Across T, though, the heuristic may pick another tile shape, a
// split-K with any of its reduction schemes, or a stream-K kernel, each of which sums the Kin
// products in another order, so a token's row may differ in its last bits between batch sizes.
// Nothing here picks split-K by T; the deterministic mode will have to pin one algorithm per
// (N, Kin, dtype) with no split (CUBLASLT_ALGO_CONFIG_SPLITK_NUM = 1, reduction scheme NONE) and
// use it for every T.
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstdio>

#include "common/log.h"
#include "kernels/cuda/cuda_ops.h"

#define LINEAR_WORKSPACE_BYTES ((size_t)32 << 20)
#define LINEAR_PLAN_SLOTS      1024 /* cached (shape, dtype, alignment) plans */

#define LT_CHECK(call)                                                                             \
    do {                                                                                           \
        cublasStatus_t s_ = (call);                                                                \
        if (s_ != CUBLAS_STATUS_SUCCESS)                                                           \
            cuda_fail(__FILE__, __LINE__, #call, cublasLtGetStatusString(s_));                     \
    } while (0)

// Everything one matmul of one shape needs, made once.
struct linear_plan {
    bool used;
    int T, N, Kin;
    dtype dt;
    uint16_t align_w, align_x, align_out; // bytes, powers of two up to 256
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t lw, lx, lout; // w [Kin, N], x [Kin, T], out [N, T], column-major
    cublasLtMatmulAlgo_t algo;
};

static cublasLtHandle_t g_lt;
static void *g_workspace;
static void *g_xs; // x in the weight's 16-bit dtype [T, Kin]
static size_t g_xs_bytes;
static linear_plan g_plans[LINEAR_PLAN_SLOTS];

// The largest power of two up to 256 that divides the address (cuBLASLt's alignment classes).
static uint16_t ptr_align(const void *p) {
    const uintptr_t a = (uintptr_t)p;
    uint16_t al = 256;
    while (al > 1 && (a & (al - 1)))
        al >>= 1;
    return al;
}

static void linear_init(void) {
    LT_CHECK(cublasLtCreate(&g_lt));
    CUDA_CHECK(cudaMalloc(&g_workspace, LINEAR_WORKSPACE_BYTES));
}

// The scratch for x in 16 bits, at least `bytes`. Growing frees the old buffer only after the
// work queued on it is done.
static void *linear_scratch(size_t bytes) {
    if (bytes <= g_xs_bytes) return g_xs;
    size_t want = g_xs_bytes * 2 > bytes ? g_xs_bytes * 2 : bytes;
    if (g_xs) {
        CUDA_CHECK(cudaStreamSynchronize(cuda_stream()));
        CUDA_CHECK(cudaFree(g_xs));
    }
    CUDA_CHECK(cudaMalloc(&g_xs, want));
    g_xs_bytes = want;
    return g_xs;
}

static void plan_destroy(linear_plan *p) {
    if (!p->used) return;
    LT_CHECK(cublasLtMatrixLayoutDestroy(p->lw));
    LT_CHECK(cublasLtMatrixLayoutDestroy(p->lx));
    LT_CHECK(cublasLtMatrixLayoutDestroy(p->lout));
    LT_CHECK(cublasLtMatmulDescDestroy(p->desc));
    p->used = false;
}

static cudaDataType_t cuda_dtype(dtype dt) {
    return dt == DTYPE_BF16 ? CUDA_R_16BF : dt == DTYPE_F16 ? CUDA_R_16F : CUDA_R_32F;
}

// The cached plan of this call, made (descriptors + heuristic) when missing.
static linear_plan *plan_get(int T, int N, int Kin, dtype dt, uint16_t aw, uint16_t ax,
                             uint16_t ao) {
    uint64_t h = (uint64_t)T * 0x9e3779b97f4a7c15ull;
    h ^= ((uint64_t)N << 32 | (uint32_t)Kin) * 0xbf58476d1ce4e5b9ull;
    h ^= ((uint64_t)dt << 24 | (uint64_t)aw << 16 | (uint64_t)ax << 8 | ao) * 0x94d049bb133111ebull;
    h ^= h >> 31;
    linear_plan *p = &g_plans[h % LINEAR_PLAN_SLOTS];
    if (p->used && p->T == T && p->N == N && p->Kin == Kin && p->dt == dt && p->align_w == aw &&
        p->align_x == ax && p->align_out == ao)
        return p;
    plan_destroy(p);

    const cudaDataType_t tin = cuda_dtype(dt);
    LT_CHECK(cublasLtMatmulDescCreate(&p->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t opT = CUBLAS_OP_T, opN = CUBLAS_OP_N;
    LT_CHECK(
        cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &opT, sizeof opT));
    LT_CHECK(
        cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &opN, sizeof opN));
    LT_CHECK(cublasLtMatrixLayoutCreate(&p->lw, tin, Kin, N, Kin));
    LT_CHECK(cublasLtMatrixLayoutCreate(&p->lx, tin, Kin, T, Kin));
    LT_CHECK(cublasLtMatrixLayoutCreate(&p->lout, CUDA_R_32F, N, T, N));

    cublasLtMatmulPreference_t pref;
    LT_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    const uint64_t ws = LINEAR_WORKSPACE_BYTES;
    const uint32_t a_w = aw, a_x = ax, a_o = ao;
    LT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                  &ws, sizeof ws));
    LT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                                                  &a_w, sizeof a_w));
    LT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                                                  &a_x, sizeof a_x));
    LT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                                                  &a_o, sizeof a_o));
    LT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                                                  &a_o, sizeof a_o));
    cublasLtMatmulHeuristicResult_t res;
    int n_res = 0;
    LT_CHECK(cublasLtMatmulAlgoGetHeuristic(g_lt, p->desc, p->lw, p->lx, p->lout, p->lout, pref, 1,
                                            &res, &n_res));
    LT_CHECK(cublasLtMatmulPreferenceDestroy(pref));
    if (n_res < 1) {
        char msg[160];
        snprintf(msg, sizeof msg, "cuBLASLt has no algorithm for T=%d N=%d Kin=%d %s", T, N, Kin,
                 dtype_name(dt));
        cuda_fail(__FILE__, __LINE__, "linear", msg);
    }
    p->algo = res.algo;
    if (log_threshold <= LOG_LEVEL_DEBUG) { // what cuBLASLt chose, for the batch-invariance work
        int32_t id = 0, split = 0;
        uint32_t tile = 0, stages = 0, reduction = 0;
        cublasLtMatmulAlgoConfigGetAttribute(&res.algo, CUBLASLT_ALGO_CONFIG_ID, &id, sizeof id,
                                             nullptr);
        cublasLtMatmulAlgoConfigGetAttribute(&res.algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile,
                                             sizeof tile, nullptr);
        cublasLtMatmulAlgoConfigGetAttribute(&res.algo, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stages,
                                             sizeof stages, nullptr);
        cublasLtMatmulAlgoConfigGetAttribute(&res.algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &split,
                                             sizeof split, nullptr);
        cublasLtMatmulAlgoConfigGetAttribute(&res.algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME,
                                             &reduction, sizeof reduction, nullptr);
        LOG_DEBUG("linear",
                  "plan T=%d N=%d Kin=%d %s: algo %d tile %u stages %u split-k %d reduction %u "
                  "workspace %zu waves %.2f",
                  T, N, Kin, dtype_name(dt), id, tile, stages, split, reduction, res.workspaceSize,
                  res.wavesCount);
    }
    p->T = T;
    p->N = N;
    p->Kin = Kin;
    p->dt = dt;
    p->align_w = aw;
    p->align_x = ax;
    p->align_out = ao;
    p->used = true;
    return p;
}

// xs[n] = x[n] rounded to nearest even in OUT (__nv_bfloat16 or __half); 4 at a time when x is
// 16-byte aligned (xs, from cudaMalloc, always is).
template <typename OUT> __device__ __forceinline__ OUT narrow(float f);
template <> __device__ __forceinline__ __nv_bfloat16 narrow(float f) {
    return __float2bfloat16_rn(f);
}
template <> __device__ __forceinline__ __half narrow(float f) { return __float2half_rn(f); }

template <typename OUT> struct alignas(8) narrow4 { OUT v[4]; };

template <typename OUT, bool VEC>
__global__ void narrow_kernel(OUT *xs, const float *x, int64_t n) {
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if constexpr (VEC) {
        for (; i < n / 4; i += stride) {
            const float4 v = ((const float4 *)x)[i];
            narrow4<OUT> o;
            o.v[0] = narrow<OUT>(v.x);
            o.v[1] = narrow<OUT>(v.y);
            o.v[2] = narrow<OUT>(v.z);
            o.v[3] = narrow<OUT>(v.w);
            ((narrow4<OUT> *)xs)[i] = o; // one 8-byte store
        }
        i = n / 4 * 4 + (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
        if (i < n) xs[i] = narrow<OUT>(x[i]);
    } else {
        for (; i < n; i += stride)
            xs[i] = narrow<OUT>(x[i]);
    }
}

template <typename OUT> static void narrow_launch(void *xs, const float *x, int64_t n) {
    const bool vec = ((uintptr_t)x & 15) == 0;
    const int64_t work = vec ? (n + 3) / 4 : n;
    int64_t blocks = (work + 255) / 256;
    if (blocks > (1 << 16)) blocks = 1 << 16;
    if (vec)
        narrow_kernel<OUT, true><<<(int)blocks, 256, 0, cuda_stream()>>>((OUT *)xs, x, n);
    else
        narrow_kernel<OUT, false><<<(int)blocks, 256, 0, cuda_stream()>>>((OUT *)xs, x, n);
    CUDA_CHECK_LAUNCH();
}

void cuda_linear(float *out, const float *x, const tensor *w, int T, int N, int Kin) {
    if (T <= 0 || N <= 0) return;
    if (w->device != DEVICE_CUDA ||
        (w->dtype != DTYPE_F32 && w->dtype != DTYPE_BF16 && w->dtype != DTYPE_F16)) {
        char msg[160];
        snprintf(msg, sizeof msg,
                 "weight of dtype %s on device %d; expected an uploaded F32, "
                 "BF16 or F16 tensor",
                 dtype_name(w->dtype), (int)w->device);
        cuda_fail(__FILE__, __LINE__, "linear", msg);
    }
    MS_ASSERT(tensor_numel(w) == (int64_t)N * Kin);
    cudaStream_t s = cuda_stream();
    if (Kin <= 0) { // an empty sum, as the CPU writes it
        CUDA_CHECK(cudaMemsetAsync(out, 0, (size_t)T * N * sizeof(float), s));
        return;
    }
    if (!g_lt) linear_init();

    const void *xin = x;
    if (w->dtype != DTYPE_F32) {
        const int64_t n = (int64_t)T * Kin;
        void *xs = linear_scratch((size_t)n * 2);
        if (w->dtype == DTYPE_BF16)
            narrow_launch<__nv_bfloat16>(xs, x, n);
        else
            narrow_launch<__half>(xs, x, n);
        xin = xs;
    }
    linear_plan *p =
        plan_get(T, N, Kin, w->dtype, ptr_align(w->data), ptr_align(xin), ptr_align(out));
    const float alpha = 1.0f, beta = 0.0f;
    LT_CHECK(cublasLtMatmul(g_lt, p->desc, &alpha, w->data, p->lw, xin, p->lx, &beta, out, p->lout,
                            out, p->lout, &p->algo, g_workspace, LINEAR_WORKSPACE_BYTES, s));
}
