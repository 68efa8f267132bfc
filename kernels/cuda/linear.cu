// linear on the GPU: out[T, N] fp32 = x[T, Kin] fp32 . w[N, Kin]^T.
//
// Matmul precision (16-bit weights, BF16 or F16). The weights are exact; what differs is how much
// of the fp32 activations x the product sees. One process-wide setting, named after PyTorch's
// float32 matmul precision and read on every call (ops_cuda_set_matmul_precision; the grouped
// GEMM of moe.cu reads it too):
// - medium: x is rounded to the weight's dtype (nearest even) into a device scratch buffer and
//   the product runs on the tensor cores with fp32 accumulation and fp32 output. The rounding of x
//   is the one loss against the CPU, which multiplies fp32 x by the widened weights: at most 2^-8
//   (BF16) or 2^-11 (F16) of S = sum_k |x_k||w_nk| per output. Through the whole model (test
//   checkpoint, H200) that moved teacher-forced logprobs by up to 0.8 from the CPU backend's.
//   At decode sizes outside deterministic mode (medium_decode_max_t) medium takes high's decode
//   kernel instead: more exact than medium asks, and faster there than rounding x for a GEMM.
// - high (the default): faithful to fp32 x, three ways by batch size (the thresholds, from H200
//   timings, are decode_max_t and stack_max_t below):
//   * decode (T <= 2 to 16, by the weight's bytes): decode_kernel multiplies fp32 x by the widened
//     weights in fp32 FMAs on the CUDA cores, as the CPU does but in another fixed order (below):
//     only fp32 rounding, at most about 2 Kin 2^-24 S against the CPU. A decode step is bound by
//     the weight bytes, so this is faster than medium's GEMM there (q_proj, T = 1: 6.6 us against
//     8.4); from some T on, the T FMAs per weight make it slower than the tensor cores.
//   * stacked GEMM (up to T = Kin / 8): x = hi + lo with hi = rn(x), lo = rn(x - hi) in the
//     weight's dtype (x - hi is exact in fp32), so hi + lo holds x to 2^-16 (BF16; F16 2^-22).
//     [hi; lo] is stacked as 2T rows of one cuBLASLt GEMM, so the weights are read once, into an
//     fp32 scratch [2T, N], and a small kernel adds each token's two rows into out. Bounded
//     scratch: at most LINEAR_STACK_T tokens a pass, and the rows of w cut into blocks so the fp32
//     scratch stays under LINEAR_STACK_BYTES (lm_head).
//   * two GEMMs (larger T, compute-bound): out = w hi, then out += w lo in the second GEMM's
//     epilogue (beta = 1): the weights are read twice, the scratch round trip is saved.
//   Either GEMM way, the error is about 2^-16 S instead of 2^-8 S, for twice the tensor-core work:
//   prefill takes about twice medium's time (1.6 to 2.1 times at T = 8192 on Qwen3-30B-A3B's
//   shapes). For F16, lo is scaled by 2^11 before the rounding (and back after the GEMM, exactly)
//   so it does not fall into F16's subnormals; x beyond F16's range (65504) overflows here as it
//   does in medium.
// - Either precision, BF16 weights, opt-in until timed (tiles_min_t): moe.cu's tiles
//   (cuda_linear_tiles), the deterministic mode's kernels with k ranges chosen by T; in high the
//   hi and lo products in one chain through the tensor cores' accumulator (moe.cu's header).
// - F32 weights, either precision: an fp32 GEMM with CUBLAS_COMPUTE_32F, which excludes TF32.
// - Block FP8 weights (DTYPE_F8_E4M3, cuda_prepare_linear_fp8): at a few rows outside
//   deterministic mode (fp8_decode_max_t) the decode kernel below, fp32 x times each weight
//   widened and times its block's scale in fp32 (the CPU's dequantized weight; u = 0); otherwise
//   moe.cu's W8A16 tiles (cuda_linear_fp8), the codes decoded exactly and each 128-k block's sums
//   times its scale, x as the precision says (medium: BF16; high: BF16 hi + lo), in
//   deterministic mode with k ranges fixed by the weight's shape.
//
// The decode kernel (shape letters as in kernels/ops.h):
// - A lane owns 8-wide k vectors (one 16-byte load of weights, nc, no L1 allocation) of R rows,
//   strided by the lanes of its row group; x is read in fp32 through L1 (small, reused by every
//   block). All T tokens of the call are done at once (R x TT accumulators per lane, TT = T rounded
//   up to a power of two; tokens T..TT-1 repeat token T - 1 and are not stored, which keeps the
//   loop free of branches on T), so every weight byte is read once per call.
// - A row group is wpr warps (1, 2, 4 or 8, from N and Kin only, see decode_wpr): the rows are
//   few at N = 512, so Kin is split over more lanes to keep every multiprocessor busy (128 to 256
//   blocks of 8 warps there), and each lane keeps at least one vector.
// - Sums, per output: each lane runs through its vectors in increasing k, 8 FMAs a vector in k
//   order; then the 32 lanes of a warp are added pairwise (lanes l and l ^ 16, then ^ 8, ^ 4, ^ 2,
//   ^ 1; carried out as a reduce-scatter, whose pairings are those of the plain butterfly, and fp32
//   addition commutes); then the warps of the row group in warp order. All of it depends on N and
//   Kin only, never on T or on the token's place in the batch, so a token's row is bit-identical
//   alone or in any batch the kernel takes (tests/test_cuda_ops.c checks it up to T = 32).
//   Unaligned x or w, or Kin % 8 != 0, take the same kernel with element loads (k >= Kin as
//   zeros): the same order.
//
// cuBLASLt calls:
// - Row-major to column-major: cuBLASLt sees w as a column-major [Kin, N] matrix and x as
//   [Kin, T], and computes out^T [N, T] = op(w)^T . x (transa = T, transb = N: the "TN" layout the
//   tensor-core kernels prefer), which is out [T, N] row-major.
// - One handle and a 32 MiB workspace, made on first use; every matmul is queued on cuda_stream().
//   The algorithm comes from cublasLtMatmulAlgoGetHeuristic (the first answer) and is cached per
//   (T, N, Kin, dtype, pointer alignments), with its descriptors, in a direct-mapped table: a
//   serving run sees one shape per layer kind and batch size, and a collision only costs a new
//   query. Each new plan logs cuBLASLt's choice (algorithm, tile, stages, split-K, reduction) at
//   debug level. Not thread-safe: one engine thread per process calls the ops.
// - Batch invariance: for one cached algorithm the result is the same bits on every run. Across
//   T, though, the heuristic may pick another tile shape, a split-K with any of its reduction
//   schemes, or a stream-K kernel, each of which sums the Kin products in another order, so a
//   token's row may differ in its last bits between batch sizes that take a GEMM (in high
//   precision above the decode kernel's threshold, in medium at any T).
// - Deterministic mode (ops_cuda_set_deterministic): one way for every T, so a token's row is the
//   same bits alone or in any batch. BF16 weights of whole 16-byte rows take moe.cu's
//   cuda_linear_bi (its header: tensor-core tiles whose sums T does not change, Kd cut into
//   ranges fixed by the weight's shape so that batch 1 keeps every multiprocessor busy), by
//   default; with MOESERVE_DET_LINEAR=cublas, and for other weights, the pinned cuBLASLt way:
//   high precision always takes the stacked GEMM (never the
//   decode kernel, never two GEMMs), medium its one GEMM, and every GEMM of a weight runs one
//   pinned algorithm: chosen once per (N, Kin, dtype) of the weight (the stacked GEMM's blocks of
//   rows use their weight's), from the heuristic at LINEAR_DET_T tokens with split-K ruled out
//   (reduction scheme NONE, split count 1 set again on the algorithm), then checked for every new
//   shape (cublasLtMatmulAlgoCheck; a shape it cannot run is a hard error, never a silent other
//   algorithm). With no split-K an output element is one CTA's sum over Kin in the kernel's own k
//   order, which T does not change (tests/test_cuda_ops.c: T = 1 to 2048, both precisions, every
//   Qwen3-30B-A3B shape, bit for bit). What it costs (H200, Qwen3-30B-A3B dummy weights, high):
//   a batch-1 step 5.36 ms against 3.21 (the decode kernel streams the weights from every
//   multiprocessor; a pinned tile of 128 weight rows puts 16 to 40 CTAs on them, and the stacked
//   GEMM adds its two small kernels), batch 8 +9%, 64 +2%, 256 -3%, prefill unchanged. Tried:
//   the heuristic at 64 tokens (batch 1 4.80 ms, prefill -4%), a forced 64 x 256 tile (9.39 ms),
//   split-K in place with a fixed split (cuBLASLt cannot run it at prefill shapes). Against it,
//   cuda_linear_bi (two runs of the same command, one build): batch 1 3.71 ms, 8 -11%, 64 +1%,
//   256 +3%, prefill 9% slower (our tiles' mma.sync against cuBLASLt's kernels); serving at
//   concurrency 1 / 64 / 256: -8% / -8% / -13% output tokens/s against the mode off, where the
//   pinned algorithm gave -36% / -2% / -2% (docs/benchmarks.md). Since its prefill sizes run on
//   wgmma (bf16_gemm.cu): -3.0% / -4.7% / -5.6%.
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "common/log.h"
#include "kernels/cuda/cuda_ops.h"

#define LINEAR_WORKSPACE_BYTES ((size_t)32 << 20)
#define LINEAR_PLAN_SLOTS      1024 /* cached (shape, dtype, alignment) plans */
#define LINEAR_DECODE_TT_MAX   32   /* the largest token tile the decode kernel is built for */
#define LINEAR_STACK_T         4096 /* tokens per stacked GEMM */
#define LINEAR_STACK_BYTES     ((size_t)64 << 20) /* its fp32 output scratch [2T, N block] */
#define DECODE_WARPS           8    /* warps per block of the decode kernel */
#define LINEAR_DET_T           256  /* tokens of the query that picks a pinned algorithm */
#define LINEAR_DET_SLOTS       256  /* pinned algorithms (weights of distinct shapes) */

#define LT_CHECK(call)                                                                             \
    do {                                                                                           \
        cublasStatus_t s_ = (call);                                                                \
        if (s_ != CUBLAS_STATUS_SUCCESS)                                                           \
            cuda_fail(__FILE__, __LINE__, #call, cublasLtGetStatusString(s_));                     \
    } while (0)

// ---- the precision setting ----

static matmul_precision g_precision = MATMUL_PRECISION_HIGH;
static bool g_deterministic; // ops_cuda_set_deterministic
// Deterministic mode's kernel for BF16 weights: 1 moe.cu's cuda_linear_bi (the default), 0 the
// pinned cuBLASLt algorithm (MOESERVE_DET_LINEAR=cublas, or cuda_linear_det_kernel below).
static int g_det_kernel = -1;
static int g_decode_override = -1, g_stack_override = -1; // the test hooks below; -1: none

// High precision: the largest T that takes the decode kernel, by the weight's bytes. From the
// H200 timings of tests/test_cuda_ops.c (CUDA graph replay, per call, against the stacked GEMM):
// - up to 4 MiB (k/v_proj 2 MiB, router 0.5 MiB): T <= 16. k/v_proj 4.3 us against 8.0 at T = 16,
//   9.4 against 8.0 at T = 24; the router still wins at T = 32 (5.2 against 7.4).
// - up to 64 MiB (q_proj, o_proj 16 MiB): T <= 8. At T = 4 q_proj 7.1 us against 10.0, o_proj 6.6
//   against 11.1; at T = 8 q_proj 9.8 against 9.5, o_proj 9.7 against 11.3; at T = 12 both lose
//   (16.4 and 15.9 against 9.4 and 11.3).
// - larger (lm_head, 594 MiB, many waves of blocks): T <= 2, 142.9 us against 156.9 at T = 2.
//   From T = 3 (token tile 4: 2 blocks a multiprocessor by registers, not 4) the kernel streams
//   at 91% of the copy rate, not 102%, and the stacked GEMM is as fast: 160.0 against 158.8 us.
static int decode_max_t(int N, int Kin) {
    if (g_decode_override >= 0) return g_decode_override;
    const int64_t wbytes = (int64_t)N * Kin * 2;
    return wbytes <= ((int64_t)4 << 20) ? 16 : wbytes <= ((int64_t)64 << 20) ? 8 : 2;
}

// Medium precision, outside deterministic mode: the decode kernel up to this T, against medium's
// one GEMM on rounded x (test_cuda_ops' figures, H200, graph time per call, decode against
// medium): q_proj 5.5 against 8.8 us at T = 1, 7.6 against 8.9 at 4, 10.1 against 8.0 at 8; o_proj
// 5.2 against 9.7 at 1, 9.4 against 9.7 at 8; k/v_proj and the router win to T = 8 and past;
// lm_head 137.5 against 151.6 at 1, 153.0 against 153.4 at 4, 219 against 155 at 8. So by the
// weight's bytes as decode_max_t: up to 4 MiB T <= 16, up to 64 MiB T <= 4, larger T <= 2.
static int medium_decode_max_t(int N, int Kin) {
    if (g_decode_override >= 0) return g_decode_override;
    const int64_t wbytes = (int64_t)N * Kin * 2;
    const int t = wbytes <= ((int64_t)4 << 20) ? 16 : wbytes <= ((int64_t)64 << 20) ? 4 : 2;
    return t < decode_max_t(N, Kin) ? t : decode_max_t(N, Kin);
}

// Block-FP8 weights outside deterministic mode: the decode kernel up to this T (either precision:
// it multiplies fp32 x by the exact weights), moe.cu's W8A16 tiles above. By the codes' bytes, as
// decode_max_t, from the H200 (test_cuda_ops' figures, graph time, decode against tiles): at T = 1
// the kernel won on every shape (q/k/v stacked, 10 MiB: 7.7 us against 8.8; o_proj, 8 MiB: 5.1
// against 8.0; k/v_proj, 1 MiB: 2.4 against 4.7); q/k/v lost from T = 2 (11.2 against 9.0),
// o_proj from T = 8 (11.5 against 8.8), k/v_proj from T = 32. With max_t >= 0 the hook (tests)
// puts T up to max_t on the decode kernel for every weight; -1 ends it; it returns the one before.
static int g_fp8_decode_override = -1;
static int fp8_decode_max_t(int N, int Kin) {
    if (g_fp8_decode_override >= 0) return g_fp8_decode_override;
    const int64_t bytes = (int64_t)N * Kin;
    return bytes <= ((int64_t)2 << 20) ? 16 : bytes <= ((int64_t)9 << 20) ? 4 : 1;
}
extern "C" int cuda_linear_fp8_decode_max_t(int max_t);
extern "C" int cuda_linear_fp8_decode_t(int N, int Kin);
int cuda_linear_fp8_decode_max_t(int max_t) {
    const int was = g_fp8_decode_override;
    g_fp8_decode_override = max_t < 0 ? -1 : max_t > LINEAR_DECODE_TT_MAX ? LINEAR_DECODE_TT_MAX
                                                                          : max_t;
    return was;
}
int cuda_linear_fp8_decode_t(int N, int Kin) { return fp8_decode_max_t(N, Kin); }

// High precision above the decode kernel: the stacked GEMM up to T = Kin / 8, two GEMMs above. By
// bytes alone the two break even at T = Kin / 4: the stacked GEMM moves 8 T N bytes more through
// its fp32 scratch, the two GEMMs read the 2 N Kin bytes of weights twice. Measured (H200, as
// above), the crossover came near Kin / 8: q_proj (Kin 2048) 19.5 us either way at T = 256, 34.5
// stacked against 31.0 at 512; o_proj (Kin 4096) 32.4 against 37.9 at 512, 60.7 against 58.6 at
// 1024; lm_head 315 against 388 us at 128, 603 against 558 at 256.
static int stack_max_t(int Kin) { return g_stack_override >= 0 ? g_stack_override : Kin / 8; }

// Outside deterministic mode, BF16 weights above the decode kernel's sizes: from this T on,
// moe.cu's tiles (cuda_linear_tiles: the wgmma kernel from 97 rows where the shape allows, the
// grouped GEMM's tiles below, k ranges by T) instead of cuBLASLt, in either precision. Off by
// default (INT_MAX) until timed against cuBLASLt on the GPU: test_cuda_ops' figures time both. The
// deterministic mode's batch-256 step on the same kernels (21.2 ms against 27.1 with the mode off,
// docs/benchmarks.md) is why they are a candidate. MOESERVE_LINEAR_TILES=T takes them from T on
// (0: never); the test hook g_tiles_override does the same.
static int g_tiles_override = -2;
static int tiles_min_t() {
    if (g_tiles_override == -2) {
        const char *e = getenv("MOESERVE_LINEAR_TILES");
        g_tiles_override = !e ? -1 : atoi(e) > 0 ? atoi(e) : INT_MAX;
    }
    return g_tiles_override >= 0 ? g_tiles_override : INT_MAX;
}
static bool tiles_take(const tensor *w, const float *x, int T, int N, int Kin) {
    return w->dtype == DTYPE_BF16 && T >= tiles_min_t() && Kin % 8 == 0 && N % 8 == 0 &&
           ((uintptr_t)w->data & 15) == 0 && ((uintptr_t)x & 15) == 0;
}

int ops_cuda_set_matmul_precision(const char *name, char *err, size_t errlen) {
    if (name && strcmp(name, "high") == 0)
        g_precision = MATMUL_PRECISION_HIGH;
    else if (name && strcmp(name, "medium") == 0)
        g_precision = MATMUL_PRECISION_MEDIUM;
    else
        return set_err(err, errlen, "unknown matmul precision '%s' (high or medium)",
                       name ? name : "(null)");
    return 0;
}

matmul_precision ops_cuda_matmul_precision(void) { return g_precision; }

void ops_cuda_set_deterministic(bool on) { g_deterministic = on; }

static int det_kernel(void) {
    if (g_det_kernel < 0) {
        const char *v = getenv("MOESERVE_DET_LINEAR");
        g_det_kernel = !(v && strcmp(v, "cublas") == 0);
    }
    return g_det_kernel;
}
// For tests/test_cuda_ops.c (which declares it): deterministic mode's kernel for BF16 weights from
// now on (0 cuBLASLt pinned, 1 cuda_linear_bi); returns the one before.
extern "C" int cuda_linear_det_kernel(int k);
int cuda_linear_det_kernel(int k) {
    const int old = det_kernel();
    g_det_kernel = k ? 1 : 0;
    return old;
}
bool ops_cuda_deterministic(void) { return g_deterministic; }

// For tests/test_cuda_ops.c (which declares them), to check and time every high-precision path
// at the same T: with max_t >= 0, T up to max_t takes the decode kernel (at most
// LINEAR_DECODE_TT_MAX), or the stacked GEMM, for every weight from now on; with -1, the choice
// above again. Each returns the value in force before the call (-1: the choice above).
extern "C" int cuda_linear_decode_max_t(int max_t);
extern "C" int cuda_linear_stack_max_t(int max_t);
int cuda_linear_decode_max_t(int max_t) {
    const int old = g_decode_override;
    g_decode_override = max_t < LINEAR_DECODE_TT_MAX ? max_t : LINEAR_DECODE_TT_MAX;
    if (g_decode_override < 0) g_decode_override = -1;
    return old;
}
int cuda_linear_stack_max_t(int max_t) {
    const int old = g_stack_override;
    g_stack_override = max_t < 0 ? -1 : max_t;
    return old;
}
extern "C" int cuda_linear_tiles_min_t(int min_t);
int cuda_linear_tiles_min_t(int min_t) {
    const int old = g_tiles_override;
    g_tiles_override = min_t < 0 ? -1 : min_t;
    return old;
}

// ---- cuBLASLt plans ----

// Everything one matmul of one shape needs, made once.
struct linear_plan {
    bool used;
    int T, N, Kin;
    int pin_n; // deterministic mode: the N of the weight whose pinned algorithm runs (0: none)
    dtype dt;
    uint16_t align_w, align_x, align_out; // bytes, powers of two up to 256
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t lw, lx, lout; // w [Kin, N], x [Kin, T], out [N, T], column-major
    cublasLtMatmulAlgo_t algo;
};

// A device buffer grown as needed and kept.
struct linear_scratch {
    void *p;
    size_t bytes;
};

static cublasLtHandle_t g_lt;
static void *g_workspace;
static linear_scratch g_xs; // x in the weight's 16-bit dtype: [T, Kin], high: [2T, Kin]
static linear_scratch g_ys; // high, stacked GEMM: its fp32 output [2T, N block]
static linear_plan g_plans[LINEAR_PLAN_SLOTS];

// Deterministic mode: one algorithm per weight shape (N, Kin, dtype) and GEMM form (rows = T, or
// 2T stacked), for every T.
struct linear_pin {
    bool used;
    int N, Kin, stacked;
    dtype dt;
    cublasLtMatmulAlgo_t algo;
};
static linear_pin g_pins[LINEAR_DET_SLOTS];

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

// The scratch buffer s, at least `bytes`. Growing frees the old buffer only after the work queued
// on it is done (so never while a CUDA graph is being captured: the eager calls before a capture
// have sized it).
static void *scratch_get(linear_scratch *s, size_t bytes) {
    if (bytes <= s->bytes) return s->p;
    size_t want = s->bytes * 2 > bytes ? s->bytes * 2 : bytes;
    if (s->p) {
        CUDA_CHECK(cudaStreamSynchronize(cuda_stream()));
        CUDA_CHECK(cudaFree(s->p));
    }
    cuda_workspace_changed(); /* graphs that used the old buffer are stale */
    CUDA_CHECK(cudaMalloc(&s->p, want));
    s->bytes = want;
    return s->p;
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

// The descriptors of a matmul out^T [N, T] = w^T x (transposes and layouts, as the header says).
static void plan_descriptors(linear_plan *p, int T, int N, int Kin, dtype dt) {
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
}

// The heuristic's first algorithm for p's descriptors and these alignments (bytes); with
// no_split, among those that sum over Kin in one CTA (no split-K reduction). False when it has
// none.
static bool plan_heuristic(const linear_plan *p, uint16_t aw, uint16_t ax, uint16_t ao,
                           bool no_split, cublasLtMatmulHeuristicResult_t *res) {
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
    if (no_split) {
        const uint32_t mask = CUBLASLT_REDUCTION_SCHEME_NONE;
        LT_CHECK(cublasLtMatmulPreferenceSetAttribute(
            pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &mask, sizeof mask));
    }
    int n_res = 0;
    LT_CHECK(cublasLtMatmulAlgoGetHeuristic(g_lt, p->desc, p->lw, p->lx, p->lout, p->lout, pref, 1,
                                            res, &n_res));
    LT_CHECK(cublasLtMatmulPreferenceDestroy(pref));
    return n_res >= 1;
}

static void plan_log(const char *what, int T, int N, int Kin, dtype dt,
                     const cublasLtMatmulAlgo_t *algo, size_t ws_bytes, float waves) {
    // what cuBLASLt chose, for the batch-invariance work
    if (log_threshold > LOG_LEVEL_DEBUG) return;
    int32_t id = 0, split = 0;
    uint32_t tile = 0, stages = 0, reduction = 0;
    cublasLtMatmulAlgoConfigGetAttribute(algo, CUBLASLT_ALGO_CONFIG_ID, &id, sizeof id, nullptr);
    cublasLtMatmulAlgoConfigGetAttribute(algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof tile,
                                         nullptr);
    cublasLtMatmulAlgoConfigGetAttribute(algo, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stages,
                                         sizeof stages, nullptr);
    cublasLtMatmulAlgoConfigGetAttribute(algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &split,
                                         sizeof split, nullptr);
    cublasLtMatmulAlgoConfigGetAttribute(algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &reduction,
                                         sizeof reduction, nullptr);
    LOG_DEBUG("linear",
              "%s T=%d N=%d Kin=%d %s: algo %d tile %u stages %u split-k %d reduction %u "
              "workspace %zu waves %.2f",
              what, T, N, Kin, dtype_name(dt), id, tile, stages, split, reduction, ws_bytes, waves);
}

[[noreturn]] static void linear_no_algo(const char *why, int T, int N, int Kin, dtype dt) {
    char msg[200];
    snprintf(msg, sizeof msg, "cuBLASLt %s for T=%d N=%d Kin=%d %s", why, T, N, Kin,
             dtype_name(dt));
    cuda_fail(__FILE__, __LINE__, "linear", msg);
    abort(); // cuda_fail does not return
}

// Deterministic mode: the algorithm pinned for a weight of [N, Kin] in dtype dt, its GEMM run as
// T rows (stacked = 0) or 2T (stacked = 1); chosen on first use, from the heuristic at
// LINEAR_DET_T tokens for 16-byte aligned operands (every weight, scratch and activation buffer of
// the models served is), with split-K ruled out.
static const cublasLtMatmulAlgo_t *pin_get(int N, int Kin, dtype dt, int stacked) {
    uint64_t h = ((uint64_t)N << 32 | (uint32_t)Kin) * 0x9e3779b97f4a7c15ull;
    h ^= ((uint64_t)dt << 8 | (uint64_t)stacked) * 0xbf58476d1ce4e5b9ull;
    h ^= h >> 29;
    for (int i = 0; i < LINEAR_DET_SLOTS; i++) { // open addressing: a pin is never replaced
        linear_pin *q = &g_pins[(h + i) % LINEAR_DET_SLOTS];
        if (q->used && q->N == N && q->Kin == Kin && q->dt == dt && q->stacked == stacked)
            return &q->algo;
        if (q->used) continue;
        linear_plan rep = {};
        const int T = stacked ? 2 * LINEAR_DET_T : LINEAR_DET_T;
        plan_descriptors(&rep, T, N, Kin, dt);
        cublasLtMatmulHeuristicResult_t res;
        const bool ok = plan_heuristic(&rep, 16, 16, 16, true, &res);
        rep.used = true;
        plan_destroy(&rep);
        if (!ok) linear_no_algo("has no algorithm without split-K", T, N, Kin, dt);
        const int32_t one = 1;
        const uint32_t none = CUBLASLT_REDUCTION_SCHEME_NONE;
        LT_CHECK(cublasLtMatmulAlgoConfigSetAttribute(&res.algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM,
                                                      &one, sizeof one));
        LT_CHECK(cublasLtMatmulAlgoConfigSetAttribute(
            &res.algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &none, sizeof none));
        plan_log("pinned", T, N, Kin, dt, &res.algo, res.workspaceSize, res.wavesCount);
        *q = {true, N, Kin, stacked, dt, res.algo};
        return &q->algo;
    }
    linear_no_algo("pinned-algorithm table full", 0, N, Kin, dt);
}

// The cached plan of this call, made (descriptors + algorithm) when missing. pin_n > 0
// (deterministic mode): the algorithm pinned for the weight [pin_n, Kin] (stacked: its GEMM form)
// rather than the heuristic's choice for this shape.
static linear_plan *plan_get(int T, int N, int Kin, dtype dt, uint16_t aw, uint16_t ax, uint16_t ao,
                             int pin_n = 0, int stacked = 0) {
    uint64_t h = (uint64_t)T * 0x9e3779b97f4a7c15ull;
    h ^= ((uint64_t)N << 32 | (uint32_t)Kin) * 0xbf58476d1ce4e5b9ull;
    h ^= ((uint64_t)dt << 24 | (uint64_t)aw << 16 | (uint64_t)ax << 8 | ao) * 0x94d049bb133111ebull;
    h ^= ((uint64_t)pin_n << 1 | (uint64_t)stacked) * 0xd6e8feb86659fd93ull;
    h ^= h >> 31;
    linear_plan *p = &g_plans[h % LINEAR_PLAN_SLOTS];
    if (p->used && p->T == T && p->N == N && p->Kin == Kin && p->dt == dt && p->align_w == aw &&
        p->align_x == ax && p->align_out == ao && p->pin_n == pin_n)
        return p;
    plan_destroy(p);
    plan_descriptors(p, T, N, Kin, dt);
    if (pin_n > 0) {
        if (aw < 16 || ax < 16 || ao < 16)
            linear_no_algo("pinned algorithm needs 16-byte aligned operands", T, N, Kin, dt);
        p->algo = *pin_get(pin_n, Kin, dt, stacked);
        cublasLtMatmulHeuristicResult_t chk;
        if (cublasLtMatmulAlgoCheck(g_lt, p->desc, p->lw, p->lx, p->lout, p->lout, &p->algo,
                                    &chk) != CUBLAS_STATUS_SUCCESS ||
            chk.workspaceSize > LINEAR_WORKSPACE_BYTES)
            linear_no_algo("pinned algorithm cannot run this shape", T, N, Kin, dt);
    } else {
        cublasLtMatmulHeuristicResult_t res;
        if (!plan_heuristic(p, aw, ax, ao, false, &res))
            linear_no_algo("has no algorithm", T, N, Kin, dt);
        p->algo = res.algo;
        plan_log("plan", T, N, Kin, dt, &res.algo, res.workspaceSize, res.wavesCount);
    }
    p->T = T;
    p->N = N;
    p->Kin = Kin;
    p->pin_n = pin_n;
    p->dt = dt;
    p->align_w = aw;
    p->align_x = ax;
    p->align_out = ao;
    p->used = true;
    return p;
}

// One cuBLASLt matmul of a plan: y[M, n] = alpha xin[M, Kin] . w[n, Kin]^T + beta y (M, n as in
// the plan; beta = 0: y is only written).
static void plan_run(const linear_plan *p, const void *w, const void *xin, float *y, float alpha,
                     float beta) {
    LT_CHECK(cublasLtMatmul(g_lt, p->desc, &alpha, w, p->lw, xin, p->lx, &beta, y, p->lout, y,
                            p->lout, &p->algo, g_workspace, LINEAR_WORKSPACE_BYTES, cuda_stream()));
}

// ---- x in 16 bits: medium (rounded) and high (hi and lo parts) ----

template <typename OUT> __device__ __forceinline__ OUT narrow(float f);
template <> __device__ __forceinline__ __nv_bfloat16 narrow(float f) {
    return __float2bfloat16_rn(f);
}
template <> __device__ __forceinline__ __half narrow(float f) { return __float2half_rn(f); }

__device__ __forceinline__ float widen(__nv_bfloat16 h) { return __bfloat162float(h); }
__device__ __forceinline__ float widen(__half h) { return __half2float(h); }

template <typename OUT> struct alignas(8) narrow4 {
    OUT v[4];
};

// xs[i] = rn(x[i]) in OUT; with lo: also lo[i] = rn((x[i] - xs[i]) * lo_scale), the part of x
// that xs missed (x - xs is exact in fp32). 4 at a time when x is 16-byte aligned (xs and lo, in
// the scratch at multiples of 4 elements from its start, then are 8-byte aligned).
template <typename OUT, bool VEC, bool LO>
__global__ void narrow_kernel(OUT *xs, OUT *lo, const float *x, int64_t n, float lo_scale) {
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    auto one = [&](float f, OUT *h, OUT *l) {
        *h = narrow<OUT>(f);
        if constexpr (LO) *l = narrow<OUT>(__fmul_rn(__fsub_rn(f, widen(*h)), lo_scale));
    };
    if constexpr (VEC) {
        for (; i < n / 4; i += stride) {
            const float4 v = ((const float4 *)x)[i];
            narrow4<OUT> h, l;
            one(v.x, &h.v[0], &l.v[0]);
            one(v.y, &h.v[1], &l.v[1]);
            one(v.z, &h.v[2], &l.v[2]);
            one(v.w, &h.v[3], &l.v[3]);
            ((narrow4<OUT> *)xs)[i] = h; // one 8-byte store
            if constexpr (LO) ((narrow4<OUT> *)lo)[i] = l;
        }
        i = n / 4 * 4 + (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
        if (i < n) one(x[i], &xs[i], LO ? &lo[i] : nullptr);
    } else {
        for (; i < n; i += stride)
            one(x[i], &xs[i], LO ? &lo[i] : nullptr);
    }
}

template <typename OUT, bool LO>
static void narrow_launch(void *xs, void *lo, const float *x, int64_t n, float lo_scale) {
    const bool vec = ((uintptr_t)x & 15) == 0 && (!LO || n % 4 == 0);
    const int64_t work = vec ? (n + 3) / 4 : n;
    int64_t blocks = (work + 255) / 256;
    if (blocks > (1 << 16)) blocks = 1 << 16;
    if (blocks < 1) blocks = 1;
    if (vec)
        narrow_kernel<OUT, true, LO>
            <<<(int)blocks, 256, 0, cuda_stream()>>>((OUT *)xs, (OUT *)lo, x, n, lo_scale);
    else
        narrow_kernel<OUT, false, LO>
            <<<(int)blocks, 256, 0, cuda_stream()>>>((OUT *)xs, (OUT *)lo, x, n, lo_scale);
    CUDA_CHECK_LAUNCH();
}

// ---- high precision, larger T: the stacked GEMM ----

// out[t, j] (row stride ldo) = y[t, j] + y[tc + t, j] * lo_inv for y [2 tc, nc]: each token's hi
// and lo rows of the stacked product. fma of an exact power-of-two scaling: one rounding.
template <bool VEC>
__global__ void stack_sum_kernel(float *out, const float *y, int tc, int nc, int64_t ldo,
                                 float lo_inv) {
    const int cols = VEC ? nc / 4 : nc;
    const int64_t n = (int64_t)tc * cols, stride = (int64_t)gridDim.x * blockDim.x;
    const int64_t lo_off = (int64_t)tc * nc;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const int64_t t = i / cols;
        const int j = (int)(i - t * cols);
        if constexpr (VEC) {
            const float4 h = ((const float4 *)y)[i], l = ((const float4 *)(y + lo_off))[i];
            float4 o;
            o.x = __fmaf_rn(l.x, lo_inv, h.x);
            o.y = __fmaf_rn(l.y, lo_inv, h.y);
            o.z = __fmaf_rn(l.z, lo_inv, h.z);
            o.w = __fmaf_rn(l.w, lo_inv, h.w);
            *(float4 *)(out + t * ldo + 4 * j) = o;
        } else {
            out[t * ldo + j] = __fmaf_rn(y[lo_off + i], lo_inv, y[i]);
        }
    }
}

template <typename OUT>
static void linear_stacked(float *out, const float *x, const tensor *w, int T, int N, int Kin) {
    const float lo_scale = std::is_same<OUT, __half>::value ? 2048.0f : 1.0f;
    const size_t wrow = (size_t)Kin * sizeof(OUT);
    for (int t0 = 0; t0 < T; t0 += LINEAR_STACK_T) {
        const int tc = T - t0 < LINEAR_STACK_T ? T - t0 : LINEAR_STACK_T;
        OUT *xs = (OUT *)scratch_get(&g_xs, (size_t)2 * tc * wrow);
        narrow_launch<OUT, true>(xs, xs + (size_t)tc * Kin, x + (int64_t)t0 * Kin,
                                 (int64_t)tc * Kin, lo_scale);
        // rows of w per GEMM: all of them, or a multiple of 128 that keeps y under the budget
        int64_t nc = (int64_t)(LINEAR_STACK_BYTES / ((size_t)8 * tc)) / 128 * 128;
        if (nc < 128) nc = 128;
        if (nc > N) nc = N;
        float *y = (float *)scratch_get(&g_ys, (size_t)2 * tc * nc * sizeof(float));
        for (int n0 = 0; n0 < N; n0 += (int)nc) {
            const int ncur = N - n0 < nc ? N - n0 : (int)nc;
            const void *wb = (const char *)w->data + (size_t)n0 * wrow;
            const linear_plan *p =
                plan_get(2 * tc, ncur, Kin, w->dtype, ptr_align(wb), ptr_align(xs), ptr_align(y),
                         g_deterministic ? N : 0, 1);
            plan_run(p, wb, xs, y, 1.0f, 0.0f);
            float *o = out + (int64_t)t0 * N + n0;
            const bool vec = ncur % 4 == 0 && N % 4 == 0 && ((uintptr_t)o & 15) == 0;
            const int64_t work = (int64_t)tc * (vec ? ncur / 4 : ncur);
            int64_t blocks = (work + 255) / 256;
            if (blocks > (1 << 16)) blocks = 1 << 16;
            if (vec)
                stack_sum_kernel<true>
                    <<<(int)blocks, 256, 0, cuda_stream()>>>(o, y, tc, ncur, N, 1.0f / lo_scale);
            else
                stack_sum_kernel<false>
                    <<<(int)blocks, 256, 0, cuda_stream()>>>(o, y, tc, ncur, N, 1.0f / lo_scale);
            CUDA_CHECK_LAUNCH();
        }
    }
}

// Prefill: out = w hi, then out += w lo in the second GEMM's epilogue (beta = 1). The weights are
// read twice, which costs little once the GEMM is bound by the tensor cores, and no fp32 scratch
// is written and read back.
template <typename OUT>
static void linear_two_gemms(float *out, const float *x, const tensor *w, int T, int N, int Kin) {
    const float lo_scale = std::is_same<OUT, __half>::value ? 2048.0f : 1.0f;
    const int64_t n = (int64_t)T * Kin;
    OUT *xs = (OUT *)scratch_get(&g_xs, (size_t)2 * n * sizeof(OUT));
    narrow_launch<OUT, true>(xs, xs + n, x, n, lo_scale);
    const uint16_t aw = ptr_align(w->data), ao = ptr_align(out);
    // each plan is used before the next plan_get, which may take its slot
    plan_run(plan_get(T, N, Kin, w->dtype, aw, ptr_align(xs), ao), w->data, xs, out, 1.0f, 0.0f);
    plan_run(plan_get(T, N, Kin, w->dtype, aw, ptr_align(xs + n), ao), w->data, xs + n, out,
             1.0f / lo_scale, 1.0f);
}

// ---- high precision, small T: the decode kernel ----

// Rows per row group for a token tile of TT (R x TT accumulators per lane: x is reused across R
// rows from registers, and 64 accumulators is as many as leave room for the weights in flight),
// and weight vectors per row loaded ahead (U x R 16-byte loads in flight per lane).
template <int TT> struct decode_shape {
    static constexpr int R = TT <= 2 ? 2 : TT <= 16 ? 4 : 2;
    static constexpr int V = R * TT; // accumulators per lane, a power of two
    static constexpr int U = 8 / R;
    // blocks per multiprocessor the registers must allow (64 and 128 registers a thread): all the
    // blocks of q_proj (N 4096) in one wave at T <= 8
    static constexpr int MIN_BLOCKS = TT <= 2 ? 4 : TT <= 8 ? 2 : 1;
    static constexpr int LOG_V = V >= 64   ? 6
                                 : V >= 32 ? 5
                                 : V >= 16 ? 4
                                 : V >= 8  ? 3
                                 : V >= 4  ? 2
                                           : 1;
};

// 16 bytes of weights that are read once: no L1 allocation, so x keeps L1 for itself.
__device__ __forceinline__ uint4 ld_weights16(const void *p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}

// The decode kernel's block-FP8 weights (cuda_prepare_linear_fp8's tensor): a lane's vector is 8
// bytes of the codes as the W8A16 kernels store them (fp8_w8_pack64 of kernels/quant.h): vector v
// of a row is byte group g = v % 8 of its 64-k chunk c = v / 8, holding for t = g / 2 and the two
// k16 steps s = 2 (g % 2), s + 1 the codes of k = 64 c + 16 s + 2t + {0, 8, 1, 9}.
struct fp8_codes {};

// 8 bytes of weights that are read once (the FP8 decode kernel's vector).
__device__ __forceinline__ uint2 ld_weights8(const void *p) {
    uint2 v;
    asm("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
}

// Two E4M3 codes (bytes 0 and 1 of u) as fp32, exactly (E4M3 fits in F16).
__device__ __forceinline__ float2 fp8x2_to_float2(uint32_t u) {
    const __half2_raw h =
        __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(u & 0xffffu), __NV_E4M3);
    return __half22float2(*reinterpret_cast<const __half2 *>(&h));
}

// Two 16-bit weights (element 2i in the low half) as fp32, exactly.
template <typename W> __device__ __forceinline__ float2 widen2(uint32_t u);
template <> __device__ __forceinline__ float2 widen2<__nv_bfloat16>(uint32_t u) {
    return make_float2(__uint_as_float(u << 16), __uint_as_float(u & 0xffff0000u));
}
template <> __device__ __forceinline__ float2 widen2<__half>(uint32_t u) {
    return __half22float2(*reinterpret_cast<const __half2 *>(&u));
}

// One level of the warp's pairwise sums, lanes paired by xor (16 >> LVL). While a lane holds
// cnt >= 2 values it keeps one half (by its lane bit) and sends the other: a reduce-scatter, after
// which lane l holds the outputs from l * V / 32 on (V >= 32) or output l >> (5 - log2 V)
// (V < 32; the lanes that differ in the low bits hold copies). Each output's pairings are those
// of the plain butterfly, so its bits do not depend on V.
template <int V, int LVL> __device__ __forceinline__ void warp_sums(float *acc, int lane) {
    if constexpr (LVL < 5) {
        constexpr int m = 16 >> LVL, cnt = V >> LVL;
        if constexpr (cnt >= 2) {
            const bool upper = lane & m;
#pragma unroll
            for (int i = 0; i < cnt / 2; i++) {
                const float send = upper ? acc[i] : acc[i + cnt / 2];
                const float keep = upper ? acc[i + cnt / 2] : acc[i];
                acc[i] = __fadd_rn(keep, __shfl_xor_sync(0xffffffffu, send, m));
            }
        } else {
            acc[0] = __fadd_rn(acc[0], __shfl_xor_sync(0xffffffffu, acc[0], m));
        }
        warp_sums<V, LVL + 1>(acc, lane);
    }
}

// out[T, N] = x[T, Kin] . w[N, Kin]^T for T <= TT, fp32 FMAs on widened 16-bit weights.
// Block: DECODE_WARPS warps = DECODE_WARPS / wpr row groups of R rows; a row group's 32 wpr lanes
// split Kin in 8-wide vectors (lane s of the group: vectors s, s + 32 wpr, ...). The order of
// every sum is in the file's header. VEC: 16-byte loads (Kin % 8 == 0, x and w 16-byte aligned);
// otherwise element loads with k >= Kin read as zeros, in the same order.
// W = fp8_codes: block-FP8 codes (VEC only: Kin % 64 == 0, x 8-byte aligned), 8-byte vectors in
// their stored order (above), each weight widened and times its 128-k block's scale (wsc, a row
// per block: [Kin / 128, N]) in fp32, the CPU's dequantized weight bit for bit; x read at the
// vector's k, pairs of floats.
// The body is block `block`'s work, and `dep` says when the kernel before may still be writing:
// dep.start() once at the start, dep.wait() before the first read of x (and before any store);
// decode_kernel passes blockIdx.x and programmatic dependent launch's pair (pdl_dep), so that a
// persistent kernel can run the same blocks as tasks behind its own waits
// (docs/decode_megakernel.md). decode_io<DEP> says where x is read from and how an output is
// stored: for pdl_dep, x through the read-only path and plain stores.
template <class DEP> struct decode_io {
    static __device__ __forceinline__ const float *x(const DEP &, const float *x) { return x; }
    template <class V> static __device__ __forceinline__ V ld(const V *p) { return __ldg(p); }
    static __device__ __forceinline__ void st(const DEP &, float *out, int64_t i, float v) {
        out[i] = v;
    }
};

template <typename W, int TT, bool VEC, class DEP>
__device__ __forceinline__ void decode_block(int block, DEP dep, float *__restrict__ out,
                                             const float *__restrict__ x,
                                             const uint16_t *__restrict__ w, int T, int N, int Kin,
                                             int wpr, const float *__restrict__ wsc) {
    constexpr bool F8 = std::is_same<W, fp8_codes>::value;
    static_assert(!F8 || VEC, "FP8: vectors only");
    using shape = decode_shape<TT>;
    constexpr int R = shape::R, V = shape::V, U = shape::U;
    __shared__ float red[DECODE_WARPS][V]; // per warp, its lane sums (wpr > 1)
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int groups = DECODE_WARPS / wpr, group = warp / wpr;
    const int n0 = (block * groups + group) * R; // the group's first row
    const int lanes = 32 * wpr, slice = (warp - group * wpr) * 32 + lane;
    const int nvec = (Kin + 7) >> 3;
    using io = decode_io<DEP>;
    x = io::x(dep, x);
    dep.start(); // the next kernel may launch now; it waits for this one before its reads

    float acc[V]; // [R][TT]
#pragma unroll
    for (int i = 0; i < V; i++)
        acc[i] = 0.0f;

    for (int v0 = slice; v0 < nvec; v0 += lanes * U) {
        uint4 wv[U][R]; // all loads first: U x R in flight
#pragma unroll
        for (int u = 0; u < U; u++)
#pragma unroll
            for (int r = 0; r < R; r++) {
                const int v = v0 + u * lanes, n = n0 + r;
                uint4 q = make_uint4(0, 0, 0, 0);
                if (v < nvec && n < N) {
                    const uint16_t *p = w + (int64_t)n * Kin + (int64_t)v * 8;
                    if constexpr (F8) {
                        const uint2 c = ld_weights8(reinterpret_cast<const unsigned char *>(w) +
                                                    (int64_t)n * Kin + (int64_t)v * 8);
                        q = make_uint4(c.x, c.y, 0u, 0u);
                    } else if constexpr (VEC) {
                        q = ld_weights16(p);
                    } else {
                        uint32_t e[8];
#pragma unroll
                        for (int j = 0; j < 8; j++)
                            e[j] = v * 8 + j < Kin ? p[j] : 0u;
                        q = make_uint4(e[0] | e[1] << 16, e[2] | e[3] << 16, e[4] | e[5] << 16,
                                       e[6] | e[7] << 16);
                    }
                }
                wv[u][r] = q;
            }
        // The weights of the first round are on their way: only now wait for the kernel before
        // this one (launched with PDL, this one overlaps it with its weight reads), whose output
        // is x.
        if (v0 == slice) dep.wait();
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int v = v0 + u * lanes;
            if (v >= nvec) break;
            float wf[R][8];
            // F8: element 4 i + {0, 1, 2, 3} of wf is k = k8 + 16 i + {0, 1, 8, 9}
            const int k8 = F8 ? (v >> 3) * 64 + (v & 1) * 32 + ((v & 7) >> 1) * 2 : 0;
#pragma unroll
            for (int r = 0; r < R; r++) {
                const uint32_t q[4] = {wv[u][r].x, wv[u][r].y, wv[u][r].z, wv[u][r].w};
                if constexpr (F8) { // bytes of each word: k + 0, + 8, + 1, + 9
                    const int n = n0 + r < N ? n0 + r : N - 1;
                    const float sc = __ldg(wsc + (int64_t)(k8 >> 7) * N + n);
#pragma unroll
                    for (int i = 0; i < 2; i++) {
                        const float2 a = fp8x2_to_float2(q[i]), b = fp8x2_to_float2(q[i] >> 16);
                        wf[r][4 * i] = __fmul_rn(a.x, sc);
                        wf[r][4 * i + 1] = __fmul_rn(b.x, sc);
                        wf[r][4 * i + 2] = __fmul_rn(a.y, sc);
                        wf[r][4 * i + 3] = __fmul_rn(b.y, sc);
                    }
                } else {
#pragma unroll
                    for (int h = 0; h < 4; h++) {
                        const float2 f = widen2<W>(q[h]);
                        wf[r][2 * h] = f.x;
                        wf[r][2 * h + 1] = f.y;
                    }
                }
            }
            const float *xv = x + (F8 ? (int64_t)k8 : (int64_t)v * 8);
#pragma unroll
            for (int t = 0; t < TT; t++) {
                // Tokens T..TT-1 of the tile read token T - 1 and sum into accumulators that are
                // never stored: no branch on T, so the loads of all tokens can be in flight
                // together.
                float xf[8];
                const float *xt = xv + (int64_t)(t < T ? t : T - 1) * Kin;
                if constexpr (F8) {
#pragma unroll
                    for (int i = 0; i < 2; i++) {
                        const float2 a = io::ld((const float2 *)(xt + 16 * i)),
                                     b = io::ld((const float2 *)(xt + 16 * i + 8));
                        xf[4 * i] = a.x, xf[4 * i + 1] = a.y, xf[4 * i + 2] = b.x,
                               xf[4 * i + 3] = b.y;
                    }
                } else if constexpr (VEC) {
                    const float4 a = io::ld((const float4 *)xt), b = io::ld((const float4 *)xt + 1);
                    xf[0] = a.x, xf[1] = a.y, xf[2] = a.z, xf[3] = a.w;
                    xf[4] = b.x, xf[5] = b.y, xf[6] = b.z, xf[7] = b.w;
                } else {
#pragma unroll
                    for (int j = 0; j < 8; j++)
                        xf[j] = v * 8 + j < Kin ? io::ld(xt + j) : 0.0f;
                }
#pragma unroll
                for (int r = 0; r < R; r++)
#pragma unroll
                    for (int j = 0; j < 8; j++)
                        acc[r * TT + t] = __fmaf_rn(xf[j], wf[r][j], acc[r * TT + t]);
            }
        }
    }

    dep.wait(); // a lane with no vectors waits here, before any store
    warp_sums<V, 0>(acc, lane);

    // output o = r * TT + t of row group g: row (block * groups + g) * R + r, token t
    auto store = [&](int g, int o, float val) {
        const int n = (block * groups + g) * R + o / TT, t = o % TT;
        if (t < T && n < N) io::st(dep, out, (int64_t)t * N + n, val);
    };
    constexpr int PER = V >= 32 ? V / 32 : 1; // outputs held per lane
    constexpr int SHIFT = V >= 32 ? 0 : 5 - shape::LOG_V;
    const bool holder = V >= 32 || (lane & ((1 << SHIFT) - 1)) == 0;
    const int o0 = V >= 32 ? lane * PER : lane >> SHIFT;
    if (wpr == 1) {
        if (holder)
#pragma unroll
            for (int i = 0; i < PER; i++)
                store(group, o0 + i, acc[i]);
        return;
    }
    if (holder)
#pragma unroll
        for (int i = 0; i < PER; i++)
            red[warp][o0 + i] = acc[i];
    __syncthreads();
    for (int idx = threadIdx.x; idx < groups * V; idx += blockDim.x) {
        const int g = idx / V, o = idx - g * V;
        float s = red[g * wpr][o];
        for (int q = 1; q < wpr; q++) // the group's warps in order
            s = __fadd_rn(s, red[g * wpr + q][o]);
        store(g, o, s);
    }
}

template <typename W, int TT, bool VEC>
__global__ void __launch_bounds__(DECODE_WARPS * 32, decode_shape<TT>::MIN_BLOCKS)
    decode_kernel(float *__restrict__ out, const float *__restrict__ x,
                  const uint16_t *__restrict__ w, int T, int N, int Kin, int wpr,
                  const float *__restrict__ wsc) {
    decode_block<W, TT, VEC>(blockIdx.x, pdl_dep(), out, x, w, T, N, Kin, wpr, wsc);
}

// Warps per row group, from N and Kin only: doubled from 1 while N * wpr < 8192 (blocks =
// N wpr / (8 R): from 8192 on, 512 blocks at R = 2 and 256 at R = 4) and each lane keeps at least
// one vector; at most 8. N = 512 gets 8: 256 blocks at R = 2, 128 at R = 4.
static int decode_wpr(int N, int Kin) {
    int wpr = 1;
    while (wpr < DECODE_WARPS && (int64_t)N * wpr < 8192 && Kin >= 512 * wpr)
        wpr *= 2;
    return wpr;
}

template <typename W, int TT>
static void decode_launch_tt(float *out, const float *x, const void *w, int T, int N, int Kin,
                             const float *wsc) {
    const int wpr = decode_wpr(N, Kin);
    const int rows = DECODE_WARPS / wpr * decode_shape<TT>::R; // per block
    const int blocks = (int)(((int64_t)N + rows - 1) / rows);
    constexpr bool F8 = std::is_same<W, fp8_codes>::value; // vectors: the caller checked
    const bool vec = Kin % 8 == 0 && ((uintptr_t)x & 15) == 0 && ((uintptr_t)w & 15) == 0;
    if (F8 || vec)
        cuda_launch_pdl(decode_kernel<W, TT, true>, blocks, DECODE_WARPS * 32, 0, out, x,
                        (const uint16_t *)w, T, N, Kin, wpr, wsc);
    else if constexpr (!F8)
        cuda_launch_pdl(decode_kernel<W, TT, false>, blocks, DECODE_WARPS * 32, 0, out, x,
                        (const uint16_t *)w, T, N, Kin, wpr, wsc);
    CUDA_CHECK_LAUNCH();
}

template <typename W>
static void decode_launch(float *out, const float *x, const void *w, int T, int N, int Kin,
                          const float *wsc = nullptr) {
    static_assert(LINEAR_DECODE_TT_MAX == 32, "the token tiles below");
    if (T <= 1)
        decode_launch_tt<W, 1>(out, x, w, T, N, Kin, wsc);
    else if (T <= 2)
        decode_launch_tt<W, 2>(out, x, w, T, N, Kin, wsc);
    else if (T <= 4)
        decode_launch_tt<W, 4>(out, x, w, T, N, Kin, wsc);
    else if (T <= 8)
        decode_launch_tt<W, 8>(out, x, w, T, N, Kin, wsc);
    else if (T <= 16)
        decode_launch_tt<W, 16>(out, x, w, T, N, Kin, wsc);
    else
        decode_launch_tt<W, 32>(out, x, w, T, N, Kin, wsc);
}

// ---- the op ----

void cuda_linear(float *out, const float *x, const tensor *w, int T, int N, int Kin) {
    if (T <= 0 || N <= 0) return;
    if (w->dtype == DTYPE_F8_E4M3 && w->device == DEVICE_CUDA) { // block FP8 (the header)
        if (!g_deterministic && T <= fp8_decode_max_t(N, Kin) && Kin % 64 == 0 &&
            ((uintptr_t)x & 7) == 0)
            decode_launch<fp8_codes>(out, x, w->data, T, N, Kin, cuda_linear_fp8_scales(w));
        else
            cuda_linear_fp8(out, x, w, T, N, Kin, g_deterministic);
        return;
    }
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
    if (Kin <= 0) { // an empty sum, as the CPU writes it
        CUDA_CHECK(cudaMemsetAsync(out, 0, (size_t)T * N * sizeof(float), cuda_stream()));
        return;
    }
    if (!g_lt) linear_init();
    const bool bf16 = w->dtype == DTYPE_BF16;
    // deterministic, BF16 weights of whole 16-byte rows: the batch-invariant grouped GEMM when
    // chosen, in either precision (by the weight alone, so every T of a weight goes one way)
    if (g_deterministic && bf16 && det_kernel() && Kin % 8 == 0 && N % 8 == 0 &&
        ((uintptr_t)w->data & 15) == 0) {
        cuda_linear_bi(out, x, w->data, T, N, Kin);
        return;
    }

    if (w->dtype != DTYPE_F32 && g_precision == MATMUL_PRECISION_HIGH) {
        if (g_deterministic) { // one way for every T (the header)
            if (bf16)
                linear_stacked<__nv_bfloat16>(out, x, w, T, N, Kin);
            else
                linear_stacked<__half>(out, x, w, T, N, Kin);
        } else if (T <= decode_max_t(N, Kin)) {
            if (bf16)
                decode_launch<__nv_bfloat16>(out, x, w->data, T, N, Kin);
            else
                decode_launch<__half>(out, x, w->data, T, N, Kin);
        } else if (tiles_take(w, x, T, N, Kin)) {
            cuda_linear_tiles(out, x, w->data, T, N, Kin);
        } else if (T <= stack_max_t(Kin)) {
            if (bf16)
                linear_stacked<__nv_bfloat16>(out, x, w, T, N, Kin);
            else
                linear_stacked<__half>(out, x, w, T, N, Kin);
        } else {
            if (bf16)
                linear_two_gemms<__nv_bfloat16>(out, x, w, T, N, Kin);
            else
                linear_two_gemms<__half>(out, x, w, T, N, Kin);
        }
        return;
    }

    if (w->dtype != DTYPE_F32 && !g_deterministic && T <= medium_decode_max_t(N, Kin)) {
        if (bf16) // medium at decode sizes: high's decode kernel (medium_decode_max_t)
            decode_launch<__nv_bfloat16>(out, x, w->data, T, N, Kin);
        else
            decode_launch<__half>(out, x, w->data, T, N, Kin);
        return;
    }
    if (!g_deterministic && tiles_take(w, x, T, N, Kin)) {
        cuda_linear_tiles(out, x, w->data, T, N, Kin);
        return;
    }
    const void *xin = x; // F32 weights: x as it is
    if (w->dtype != DTYPE_F32) { // medium: x rounded to the weight's dtype
        const int64_t n = (int64_t)T * Kin;
        void *xs = scratch_get(&g_xs, (size_t)n * 2);
        if (bf16)
            narrow_launch<__nv_bfloat16, false>(xs, nullptr, x, n, 1.0f);
        else
            narrow_launch<__half, false>(xs, nullptr, x, n, 1.0f);
        xin = xs;
    }
    const linear_plan *p = plan_get(T, N, Kin, w->dtype, ptr_align(w->data), ptr_align(xin),
                                    ptr_align(out), g_deterministic ? N : 0);
    plan_run(p, w->data, xin, out, 1.0f, 0.0f);
}

// ---- an experiment: decode GEMVs in one persistent launch (docs/decode_megakernel.md) ----
//
// A chain of n links at one token, link l out_l = x_l . w_l^T with BF16 weights, each x_l written
// by an earlier link (or before the launch): the decode kernel's blocks (decode_block, the same
// bits as cuda_linear through the decode kernel) run as tasks of one kernel of as many blocks as
// the device holds at once. Task i of the flattened list goes to block i % gridDim.x, each block
// takes its tasks in order, and a link's tasks wait, after their weight requests are out, for a
// counter that every task of the link before adds one to once its stores are visible (fence,
// block barrier, atomic add) instead of a kernel boundary. No block waits for a task behind its
// own, and all blocks are resident, so the chain always completes. test_cuda_ops times it against
// the same links as separate kernels in one CUDA graph: what the boundaries cost, and what a
// task's weights requested before the link before has finished gain.

// Ways of waiting and signalling, measured side by side (test_cuda_ops --chain):
//   CHAIN_PAD          each link's counter on its own 128-byte line (else packed)
//   CHAIN_ONE_SIGNAL   the block's barrier, then one thread's fence and add (else every thread
//                      fences before the barrier)
//   CHAIN_BLOCK_POLL   one poller a block, then the block's barrier (else one a warp); needs every
//                      thread of a task to wait at the same point (make checks the shapes)
//   CHAIN_SLEEP        a short sleep between polls
//   CHAIN_NO_WAIT      no wait at all: the links' bits are wrong, the time is the streaming alone
//   CHAIN_LL           no counters: each output is also stored as one 64-bit word (the value's
//                      bits, the run's epoch above them) and a task's block copies its x from
//                      those words into its shared memory, loading again each word whose epoch is
//                      not yet the run's (no fence, no add, no poll of a shared line: what a link
//                      waits for is its data's own arrival, as NCCL's LL protocol does)
enum {
    CHAIN_PAD = 1,
    CHAIN_ONE_SIGNAL = 2,
    CHAIN_BLOCK_POLL = 4,
    CHAIN_SLEEP = 8,
    CHAIN_NO_WAIT = 16,
    CHAIN_LL = 32,
};
#define CHAIN_MODES(X)                                                                             \
    X(0)                                                                                           \
    X(CHAIN_PAD | CHAIN_ONE_SIGNAL)                                                                \
    X(CHAIN_PAD | CHAIN_ONE_SIGNAL | CHAIN_SLEEP)                                                  \
    X(CHAIN_PAD | CHAIN_ONE_SIGNAL | CHAIN_BLOCK_POLL)                                             \
    X(CHAIN_PAD | CHAIN_ONE_SIGNAL | CHAIN_BLOCK_POLL | CHAIN_SLEEP)                               \
    X(CHAIN_PAD | CHAIN_ONE_SIGNAL | CHAIN_NO_WAIT)                                                \
    X(CHAIN_LL)
constexpr int CHAIN_STRIDE = 32;  // ints: a counter a line under CHAIN_PAD
constexpr int CHAIN_MAX_K = 4096; // x's length at most (CHAIN_LL's shared copy)

// The link before's counter as decode_block's dependency: each thread waits once. The poller
// (the first lane of the threads that call together, or thread 0 under CHAIN_BLOCK_POLL) loads
// with acquire at the GPU's scope until every task of the link before has counted; the warp's (or
// block's) barrier orders the others' reads after it.
template <int MODE> struct chain_dep {
    const int *cnt;
    int target;
    bool done;
    // CHAIN_LL: the link before's words (null for the first link), x's length, this link's words,
    // the run's epoch and the block's copy of x
    const unsigned long long *ll_in;
    int K;
    unsigned long long *ll_out;
    unsigned epoch;
    float *xs;
    __device__ __forceinline__ void start() {}
    __device__ __forceinline__ void ll_wait() {
        constexpr int P = CHAIN_MAX_K / (DECODE_WARPS * 32);
        unsigned long long v[P];
#pragma unroll
        for (int j = 0; j < P; j++) {
            const int i = threadIdx.x + j * DECODE_WARPS * 32;
            if (i < K)
                asm volatile("ld.relaxed.gpu.global.b64 %0, [%1];\n"
                             : "=l"(v[j])
                             : "l"(ll_in + i)
                             : "memory");
        }
#pragma unroll
        for (int j = 0; j < P; j++) {
            const int i = threadIdx.x + j * DECODE_WARPS * 32;
            if (i >= K) break;
            while ((unsigned)(v[j] >> 32) != epoch)
                asm volatile("ld.relaxed.gpu.global.b64 %0, [%1];\n"
                             : "=l"(v[j])
                             : "l"(ll_in + i)
                             : "memory");
            xs[i] = __uint_as_float((unsigned)v[j]);
        }
        __syncthreads();
    }
    __device__ __forceinline__ void poll() {
        int v;
        for (;;) {
            asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(cnt) : "memory");
            if (v >= target) break;
            if constexpr ((MODE & CHAIN_SLEEP) != 0) __nanosleep(32);
        }
    }
    __device__ __forceinline__ void wait() {
        if constexpr ((MODE & CHAIN_LL) != 0) {
            if (!done && ll_in) ll_wait();
            done = true;
            return;
        }
        if (done || !cnt) return;
        done = true;
        if constexpr ((MODE & CHAIN_NO_WAIT) != 0) return;
        if constexpr ((MODE & CHAIN_BLOCK_POLL) != 0) {
            if (threadIdx.x == 0) poll();
            __syncthreads();
        } else {
            const unsigned m = __activemask();
            if ((int)(threadIdx.x & 31) == __ffs(m) - 1) poll();
            __syncwarp(m);
        }
    }
};

// CHAIN_LL: x from the block's shared copy (plain loads: the read-only path is for data no thread
// of the kernel writes), and each output also as its word
template <int MODE> struct decode_io<chain_dep<MODE>> {
    using D = chain_dep<MODE>;
    static __device__ __forceinline__ const float *x(const D &d, const float *x) {
        if constexpr ((MODE & CHAIN_LL) != 0) return d.ll_in ? d.xs : x;
        return x;
    }
    template <class V> static __device__ __forceinline__ V ld(const V *p) {
        if constexpr ((MODE & CHAIN_LL) != 0) return *p;
        return __ldg(p);
    }
    static __device__ __forceinline__ void st(const D &d, float *out, int64_t i, float v) {
        out[i] = v;
        if constexpr ((MODE & CHAIN_LL) != 0) {
            const unsigned long long wv =
                (unsigned long long)d.epoch << 32 | (unsigned long long)__float_as_uint(v);
            asm volatile("st.relaxed.gpu.global.b64 [%0], %1;\n" ::"l"(d.ll_out + i), "l"(wv)
                         : "memory");
        }
    }
};

struct chain_link {
    float *out;
    const float *x;
    const uint16_t *w;
    unsigned long long *ll; // CHAIN_LL: the output's words
    int N, Kin, wpr, blocks;
};

template <int MODE>
__global__ void __launch_bounds__(DECODE_WARPS * 32, decode_shape<1>::MIN_BLOCKS)
    decode_chain_kernel(const chain_link *__restrict__ links, int n, int *cnt, unsigned epoch) {
    constexpr int CS = (MODE & CHAIN_PAD) != 0 ? CHAIN_STRIDE : 1;
    constexpr bool LL = (MODE & CHAIN_LL) != 0;
    __shared__ float xs[LL ? CHAIN_MAX_K : 1];
    int base = 0; // the link's first task in the flattened list
    for (int l = 0; l < n; l++) {
        const chain_link L = links[l];
        const int first = (int)((blockIdx.x + gridDim.x - base % gridDim.x) % gridDim.x);
        for (int i = first; i < L.blocks; i += gridDim.x) {
            chain_dep<MODE> dep = {l ? cnt + (l - 1) * CS : nullptr,
                                   l ? links[l - 1].blocks : 0,
                                   false,
                                   l ? links[l - 1].ll : nullptr,
                                   L.Kin,
                                   L.ll,
                                   epoch,
                                   xs};
            decode_block<__nv_bfloat16, 1, true>(i, dep, L.out, L.x, L.w, 1, L.N, L.Kin, L.wpr,
                                                 nullptr);
            if constexpr (LL) {
                __syncthreads(); // the block's copy of x is read before the next task's
            } else if constexpr ((MODE & CHAIN_ONE_SIGNAL) != 0) {
                __syncthreads();
                if (threadIdx.x == 0) {
                    __threadfence();
                    atomicAdd(cnt + l * CS, 1);
                }
            } else {
                __threadfence();
                __syncthreads();
                if (threadIdx.x == 0) atomicAdd(cnt + l * CS, 1);
            }
        }
        base += L.blocks;
    }
}

struct decode_chain {
    chain_link *links;      // on the device
    int *cnt;               // [n * CHAIN_STRIDE] on the device, zeroed before each run
    unsigned long long *ll; // every link's words (CHAIN_LL), zeroed once
    unsigned epoch;         // the last run's
    int n, grid;
};

extern "C" void *cuda_decode_chain_make(float *const *outs, const float *const *xs,
                                        const tensor *const *ws, int n) {
    MS_ASSERT(n > 0);
    chain_link *h = (chain_link *)xmalloc(sizeof(chain_link) * n);
    int64_t tasks = 0, words = 0;
    for (int l = 0; l < n; l++) {
        const tensor *w = ws[l];
        MS_ASSERT(w->dtype == DTYPE_BF16 && w->device == DEVICE_CUDA && w->ndim == 2);
        const int N = (int)w->shape[0], Kin = (int)w->shape[1], wpr = decode_wpr(N, Kin);
        MS_ASSERT(Kin % 8 == 0 && ((uintptr_t)xs[l] & 15) == 0 && ((uintptr_t)w->data & 15) == 0);
        MS_ASSERT(32 * wpr <= Kin / 8); // every thread waits in its first round (CHAIN_BLOCK_POLL)
        MS_ASSERT(Kin <= CHAIN_MAX_K && (l == 0 || Kin == h[l - 1].N));
        const int rows = DECODE_WARPS / wpr * decode_shape<1>::R;
        h[l] = {outs[l], xs[l], (const uint16_t *)w->data, nullptr, N,
                Kin,     wpr,   (N + rows - 1) / rows};
        tasks += h[l].blocks;
        words += N;
    }
    decode_chain *c = (decode_chain *)xmalloc(sizeof *c);
    c->n = n;
    c->epoch = 0;
    CUDA_CHECK(cudaMalloc(&c->ll, sizeof(unsigned long long) * words));
    CUDA_CHECK(cuda_zero_device(c->ll, sizeof(unsigned long long) * words));
    for (int l = 0, off = 0; l < n; off += h[l].N, l++)
        h[l].ll = c->ll + off;
    CUDA_CHECK(cudaMalloc(&c->links, sizeof(chain_link) * n));
    CUDA_CHECK(cuda_copy_to_device(c->links, h, sizeof(chain_link) * n));
    CUDA_CHECK(cudaMalloc(&c->cnt, sizeof(int) * n * CHAIN_STRIDE));
    free(h);
    int dev = 0, sms = 0, per_sm = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    per_sm = 1 << 30; // the least of the modes': every block must be resident at once
#define CHAIN_OCC(M)                                                                               \
    {                                                                                              \
        int o = 0;                                                                                 \
        CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&o, decode_chain_kernel<M>,       \
                                                                 DECODE_WARPS * 32, 0));           \
        per_sm = std::min(per_sm, o);                                                              \
    }
    CHAIN_MODES(CHAIN_OCC)
#undef CHAIN_OCC
    MS_ASSERT(per_sm > 0);
    c->grid = (int)std::min<int64_t>(tasks, (int64_t)per_sm * sms);
    return c;
}

// Runs the chain with the way of waiting `mode` (a CHAIN_MODES entry; returns false for others).
extern "C" bool cuda_decode_chain_run(void *chain, int mode) {
    decode_chain *c = (decode_chain *)chain;
    c->epoch++;
    CUDA_CHECK(cudaMemsetAsync(c->cnt, 0, sizeof(int) * c->n * CHAIN_STRIDE, cuda_stream()));
    switch (mode) {
#define CHAIN_CASE(M)                                                                              \
    case M:                                                                                        \
        decode_chain_kernel<M>                                                                     \
            <<<c->grid, DECODE_WARPS * 32, 0, cuda_stream()>>>(c->links, c->n, c->cnt, c->epoch);  \
        break;
        CHAIN_MODES(CHAIN_CASE)
#undef CHAIN_CASE
    default: return false;
    }
    CUDA_CHECK_LAUNCH();
    return true;
}

// The modes cuda_decode_chain_run takes, in order; returns their count.
extern "C" int cuda_decode_chain_modes(int *modes, int max) {
    int n = 0;
#define CHAIN_LIST(M)                                                                              \
    if (n < max) modes[n] = (M);                                                                   \
    n++;
    CHAIN_MODES(CHAIN_LIST)
#undef CHAIN_LIST
    return n;
}

extern "C" void cuda_decode_chain_free(void *chain) {
    decode_chain *c = (decode_chain *)chain;
    if (!c) return;
    cudaFree(c->links);
    cudaFree(c->cnt);
    cudaFree(c->ll);
    free(c);
}
