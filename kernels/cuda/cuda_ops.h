/* Private header of the CUDA backend: the functions behind ops_cuda()'s table, the stream they
 * all run on, and the helpers the kernel files share. Shape letters and contracts as in
 * kernels/ops.h: every pointer argument is device memory (ops->dev_alloc), weights are tensors
 * whose data was uploaded (ops->upload) or experts prepared (ops->prepare_experts).
 *
 * Every kernel is checked against the CPU op of the same name (tests/test_cuda_*.c) on random
 * inputs, with the tolerance stated in the test. Reductions use split sizes fixed by the
 * reduction length, never by the number of tokens, so a token's result does not depend on the
 * batch (what the deterministic mode builds on). */
#ifndef MOESERVE_KERNELS_CUDA_OPS_H
#define MOESERVE_KERNELS_CUDA_OPS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/tensor.h"
#include "kernels/ops.h"

#ifdef __cplusplus
#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>
extern "C" {
#endif

/* The stream every kernel of the backend is queued on (created by ops_cuda). */
#ifdef __cplusplus
cudaStream_t cuda_stream(void);

/* Host bytes into device memory, or device memory zeroed, ordered on cuda_stream() and complete
 * on return. A plain cudaMemcpy or cudaMemset runs on the legacy stream, which the backend's
 * non-blocking stream does not wait for, and a cudaMemcpy from pageable memory may return before
 * its bytes have landed: a kernel queued next on cuda_stream() could read what was there before
 * (test_cuda_ops saw FP8 weights' last rows come out wrong that way, in 3 runs of 4). */
static inline cudaError_t cuda_copy_to_device(void *dst, const void *src, size_t bytes) {
    cudaError_t e = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, cuda_stream());
    return e == cudaSuccess ? cudaStreamSynchronize(cuda_stream()) : e;
}
static inline cudaError_t cuda_zero_device(void *dst, size_t bytes) {
    cudaError_t e = cudaMemsetAsync(dst, 0, bytes, cuda_stream());
    return e == cudaSuccess ? cudaStreamSynchronize(cuda_stream()) : e;
}
#endif

/* A kernel file reallocated one of its device workspaces: CUDA graphs captured before point at the
 * old one (ops->graph_epoch moves on, and the engine captures them again). */
void cuda_workspace_changed(void);

/* A CUDA error inside an op is a broken invariant (bad launch, device fault): print where and
 * what, then abort. */
void cuda_fail(const char *file, int line, const char *what, const char *msg);

/* ops_cuda.cu: memory and weights */
void cuda_gather_rows(float *out, const float *x, const int32_t *rows, int n, int D);

/* elementwise.cu */
void cuda_embedding(float *out, const tensor *table, const int32_t *ids, int T, int D);
void cuda_rmsnorm(float *out, const float *x, const tensor *w, int R, int C, float eps);
void cuda_add_rmsnorm(float *x, float *h, const float *o, const tensor *w, int T, int D,
                      float eps);
void cuda_rope(float *q, float *k, const int32_t *pos, int T, int H, int Hkv, int Dh,
               double theta);
void cuda_qk_norm_rope(float *q, float *k, const tensor *q_norm, const tensor *k_norm,
                       const int32_t *pos, int T, int H, int Hkv, int Dh, double theta, float eps);
void cuda_qkv_prepare(float *q_out, kv_layer kv, const float *qkv, const tensor *q_norm,
                      const tensor *k_norm, const attn_batch *b, int H, int Hkv, int Dh,
                      double theta, float eps);
void cuda_moe_finalize_add_rmsnorm(float *x, float *h, const float *expert_out,
                                   const float *topk_w, const tensor *w, int T, int K, int D,
                                   float eps);
void cuda_kv_store(kv_layer kv, const float *k, const float *v, const attn_batch *b, int Hkv,
                   int Dh);
void cuda_router_topk(int32_t *topk_ids, float *topk_w, const float *logits, int T, int E, int K,
                      bool norm);
void cuda_moe_finalize(float *out, const float *expert_out, const float *topk_w, int T, int K,
                       int D);
void cuda_moe_input_quant(float *y, const float *x, int T, int D, int payload);
void cuda_silu_mul(float *out, const float *gate, const float *up, int T, int F);
void cuda_add(float *out, const float *a, const float *b, int64_t n);

/* linear.cu (cuBLASLt) */
void cuda_linear(float *out, const float *x, const tensor *w, int T, int N, int Kin);

/* moe.cu */
int cuda_prepare_experts(moe_experts *w, char *err, size_t errlen);
/* The experts in NVFP4 (W4A16: codes decoded exactly to BF16 in the GEMMs, the tensor scale in
 * their epilogues): copies the host arrays, in the layout of moe_experts' MOE_W_NVFP4 fields, to
 * the device and sets those fields (w->gate / up / down stay as they are). D and F multiples of
 * 64. 0, or -1 with err. The Qwen3-MoE loader takes it by default (MOESERVE_W4A16=0: not). */
int cuda_prepare_experts_nvfp4(moe_experts *w, const uint8_t *gate_up_q,
                               const uint8_t *gate_up_sf, const uint8_t *down_q,
                               const uint8_t *down_sf, const float *s2, int D, int F, char *err,
                               size_t errlen);
/* The experts in FP8 (W8A16: codes decoded exactly to BF16 in the GEMMs, each 128-k block's sums
 * times its rows' scales): copies the host arrays, in the layout of moe_experts' MOE_W_FP8 fields
 * (codes in checkpoint order; rearranged on the device), and sets those fields. D and F multiples
 * of 64; a NaN code or a scale that is not finite is refused. 0, or -1 with err. The Qwen3-MoE
 * loader takes it by default (MOESERVE_W8A16=0: not). */
int cuda_prepare_experts_fp8(moe_experts *w, const uint8_t *gate_up_q, const float *gate_up_s,
                             const uint8_t *down_q, const float *down_s, int D, int F, char *err,
                             size_t errlen);
void cuda_moe_experts(float *out, const float *x, const int32_t *topk_ids, const moe_experts *w,
                      int T, int K, int D, int F);
void cuda_moe_experts_n(float *out, const float *x, const int32_t *topk_ids,
                        const int32_t *n_rows, const moe_experts *w, int T, int K, int D, int F);
void cuda_moe_experts_q(float *out, float *xq, const float *x, const int32_t *topk_ids,
                        const moe_experts *w, int T, int K, int D, int F, int payload);
/* out[T, N] = x[T, Kd] w[N, Kd]^T with w BF16 on the device: every row the same bits at any T
 * (the grouped GEMM with one expert, Kd cut into ranges fixed by (N, Kd); Kd and N multiples of 8,
 * x and w 16-byte aligned). In the matmul precision in force. */
void cuda_linear_bi(float *out, const float *x, const void *w, int T, int N, int Kd);
/* The same kernels outside deterministic mode (linear.cu's choice by T and shape): Kd in ranges
 * that follow T as well, none once the tiles fill the GPU. */
void cuda_linear_tiles(float *out, const float *x, const void *w, int T, int N, int Kd);
/* A dense weight [N, K] in block FP8 on the device as cuda_linear_fp8 reads it: t becomes a
 * DTYPE_F8_E4M3 tensor holding the codes (rearranged for the W8A16 kernels) and the scales a row
 * per 128-k block (row_scales [ceil(K / 128), N]: quant_fp8_row_scales). N a multiple of 8, K of
 * 64; a NaN code or a scale that is not finite is refused. 0, or -1 with err. */
int cuda_prepare_linear_fp8(tensor *t, const uint8_t *codes, const float *row_scales, int N,
                            int K, char *err, size_t errlen);
/* out[T, N] = x[T, K] w^T with w such a tensor: W8A16 through linear_bi's kernels (moe.cu). With
 * fixed_ranges (deterministic mode) every row is the same bits at any T. (cuda_linear takes the
 * decode kernel of linear.cu at a few rows outside deterministic mode.) */
void cuda_linear_fp8(float *out, const float *x, const tensor *w, int T, int N, int K,
                     bool fixed_ranges);
/* Such a tensor's scales [ceil(K / 128), N] (the codes are at w->data, in the W8A16 layout). */
const float *cuda_linear_fp8_scales(const tensor *w);

/* attention.cu */
/* FP8 x FP8 grouped GEMM (kernels/cuda/fp8_gemm.cu, wgmma): out [M, N] fp32, row m of expert e
 * (offsets[e] <= m < offsets[e + 1], offsets on the device) = sum over 128-k blocks kb of
 * sa[kb, m] sb[e, kb, n] sum_k a[m, k] b[e, n, k]; a [M, K] and b [E, N, K] E4M3 codes, sa
 * [K / 128, M], sb [E, K / 128, N] equal over each aligned group of 64 rows n (a 128 x 128 block
 * scale repeated over its rows, as checkpoints have them); K and N multiples of 128. */
void cuda_fp8_grouped_gemm(float *out, const uint8_t *a, const float *sa, const uint8_t *b,
                           const float *sb, const int32_t *offsets, int E, int M, int N, int K);

/* NVFP4 x NVFP4 grouped GEMM on Blackwell's block-scaled tensor cores (kernels/cuda/nvfp4_sm100.cu,
 * sm_100a). Rows come in n_blk blocks of 128, block i expert blk_e[i]'s (< 0: none) with its first
 * blk_rows[i] rows valid; for a valid row r of expert e, out[r, n] = sa[r] sb[e, n / 128] sum_k
 * (a[r, k] sfa(r, k / 16)) (b[e, n, k] sfb(e n, k / 16)): a [n_blk 128, K / 2] and b [E, N, K / 2]
 * E2M1 codes (two a byte, the even k in the low nibble), their group scales E4M3 in the 128 x 4
 * atoms of quant_nvfp4_sf_atoms (a over n_blk 128 rows, b over E N), sa [n_blk 128] and sb
 * [E, N / 128] fp32 (a tensor scale a 128 rows of b: gate and up keep their own); out [n_blk 128,
 * N] fp32, other rows untouched. N % 128 == 0, K % 256 == 0. Only where
 * cuda_nvfp4_sm100_available: a compute capability 10.0 device and the kernel in the build. */
int cuda_nvfp4_sm100_available(void);
void cuda_nvfp4_sm100_gemm(float *out, const uint8_t *a, const uint8_t *sfa, const float *sa,
                           const uint8_t *b, const uint8_t *sfb, const float *sb,
                           const int32_t *blk_e, const int32_t *blk_rows, int n_blk, int N, int K,
                           int E);
/* The activations of those experts in the GEMM's blocks (kernels/cuda/nvfp4_act.cu, any device):
 * rows quantized as quant_nvfp4 quantizes one row with its own tensor scale, codes [n_blk 128,
 * C / 2], scales in atoms, s2 in sa [n_blk 128]; padding rows zero.
 * - cuda_nvfp4_blocks_max: blocks enough for n_pairs rows over E experts.
 * - cuda_nvfp4_blocks: from the experts' grouped offsets [E + 1], pblk [E + 1] (expert e's rows
 *   from block pblk[e] on), blk_e and blk_rows [n_blk] (blocks past the rows: -1 and 0).
 * - cuda_nvfp4_quant_pairs: grouped row m < offsets[E] (expert e by offsets) from x's row
 *   pairs[m] / topk into row pblk[e] 128 + m - offsets[e]; row_pair [n_blk 128] the pair of each
 *   row, -1 for padding. n_pairs may be an upper bound of offsets[E].
 * - cuda_nvfp4_silu_quant: the valid rows of g1 [n_blk 128, 2F] (GEMM 1: gate, then up) as
 *   h = silu(gate) up, C = F.
 * - cuda_nvfp4_scatter: out[row_pair[r]] = rows[r] ([n_blk 128, D] fp32) for every row with a pair.
 */
int cuda_nvfp4_blocks_max(int64_t n_pairs, int E);
void cuda_nvfp4_blocks(int32_t *blk_e, int32_t *blk_rows, int32_t *pblk, const int32_t *offsets,
                       int E, int n_blk);
void cuda_nvfp4_quant_pairs(uint8_t *q, uint8_t *atoms, float *sa, int32_t *row_pair,
                            const float *x, int D, const int32_t *pairs, int topk,
                            const int32_t *offsets, const int32_t *pblk, int E, int64_t n_pairs,
                            int n_blk);
void cuda_nvfp4_silu_quant(uint8_t *q, uint8_t *atoms, float *sa, const float *g1,
                           const int32_t *blk_rows, int n_blk, int F);
void cuda_nvfp4_scatter(float *out, const float *rows, const int32_t *row_pair, int n_blk, int D);
/* The experts' two GEMMs as NVFP4 x NVFP4 on Blackwell (nvfp4_sm100.cu): for grouped row m (pair
 * pairs[m] of token pairs[m] / topk, expert e by offsets [E + 1]), out[pairs[m]] = down_e
 * q(silu(gate_e q(x)) up_e q(x)) with q() a row's NVFP4 quantization (cuda_nvfp4_quant_pairs) and
 * the GEMMs cuda_nvfp4_sm100_gemm's: gate_up codes [E, 2F, D / 2] (F gate rows, then F up rows),
 * down [E, D, F / 2], their atoms, and tensor scales a 128 rows (gate_up_s2 [E, 2F / 128], down_s2
 * [E, D / 128]). D and F multiples of 256; scratch of cuda_nvfp4_sm100_experts_scratch bytes,
 * 256-byte aligned. Slot rows of no pair are untouched. */
size_t cuda_nvfp4_sm100_experts_scratch(int64_t n_pairs, int E, int D, int F);
void cuda_nvfp4_sm100_experts(float *out, const float *x, int D, int F, int topk,
                              const int32_t *pairs, const int32_t *offsets, int E, int64_t n_pairs,
                              const uint8_t *gate_up, const uint8_t *gate_up_atoms,
                              const float *gate_up_s2, const uint8_t *down,
                              const uint8_t *down_atoms, const float *down_s2,
                              unsigned char *scratch);

void cuda_attention(float *out, const float *q, kv_layer kv, const attn_batch *b, int H, int Hkv,
                    int Dh, float scale);

/* sampling.cu */
void cuda_sample(int32_t *tokens, float *logprobs, int32_t *top_ids, float *top_logprobs,
                 const float *logits, const sample_row *rows, const sample_penalty *pen,
                 const sample_bias *bias, int n, int V, int top_n_max);

#ifdef __cplusplus
}
#endif

#define CUDA_CHECK(call)                                                                           \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess) cuda_fail(__FILE__, __LINE__, #call, cudaGetErrorString(e_));       \
    } while (0)

/* After a kernel launch: the launch itself must have succeeded. */
#define CUDA_CHECK_LAUNCH() CUDA_CHECK(cudaGetLastError())

#ifdef __CUDACC__
/* Programmatic dependent launch (sm_90). A kernel launched by cuda_launch_pdl may start while the
 * kernel before it on the stream is still running, once every block of that one has called
 * pdl_trigger (or exited). It must call pdl_wait before it reads anything the earlier kernels
 * wrote and before it writes anything: the wait returns when the kernel before has completed and
 * its writes are visible (and so, in turn, every kernel before that). What it may do earlier is
 * read weights: a decode step's GEMV fetches its weights while the norm before it runs. In a
 * kernel launched the ordinary way both calls do nothing. */
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }
__device__ __forceinline__ void pdl_trigger() {
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}
/* The same pair as a block body's dependency (start: the next kernel may launch; wait: what the
 * kernel before wrote is visible), for bodies written as device functions of a block index and a
 * dependency (linear.cu's decode_block, attention.cu's attn_slice_block), so that a persistent
 * kernel can run them as tasks behind waits of its own (docs/decode_megakernel.md). */
struct pdl_dep {
    __device__ __forceinline__ void start() const { pdl_trigger(); }
    __device__ __forceinline__ void wait() const { pdl_wait(); }
};

/* Raises a kernel's dynamic shared memory limit to bytes where *set (what it was raised to, 0 at
 * first; one device per process) is below that: static + dynamic past 48 KiB needs it. */
template <typename K> static inline void cuda_smem_allow(K kernel, size_t bytes, size_t *set) {
    if (bytes > *set) {
        CUDA_CHECK(
            cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
        *set = bytes;
    }
}

/* The kernels' environment switches (README's table), read once a process into *cached (-1
 * until then; test hooks may set it): on unless NAME=0; and a count, NAME when it is a
 * non-negative integer, else dflt. */
static inline int cuda_env_on(const char *name, int *cached) {
    if (*cached < 0) {
        const char *e = getenv(name);
        *cached = !(e && strcmp(e, "0") == 0);
    }
    return *cached;
}
static inline int cuda_env_count(const char *name, int dflt, int *cached) {
    if (*cached < 0) {
        const char *e = getenv(name);
        *cached = e && atoi(e) >= 0 ? atoi(e) : dflt;
    }
    return *cached;
}

/* The launch attribute of thread-block clusters of x * y * z blocks. */
static inline cudaLaunchAttribute cuda_cluster_attr(unsigned x, unsigned y, unsigned z) {
    cudaLaunchAttribute a = {};
    a.id = cudaLaunchAttributeClusterDimension;
    a.val.clusterDim.x = x;
    a.val.clusterDim.y = y;
    a.val.clusterDim.z = z;
    return a;
}

template <typename... KArgs, typename... Args>
static inline void cuda_launch_pdl(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem,
                                   Args... args) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = cuda_stream();
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, static_cast<KArgs>(args)...));
}
#endif

#endif
