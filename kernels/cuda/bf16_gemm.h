// The BF16 wgmma grouped GEMM's way into the routed experts (kernels/cuda/bf16_gemm.cu), for
// moe.cu: CUDA C++ only. Tests ask cuda_moe_bf16_wgmma (cuda_ops.h) whether it runs a call.
#ifndef MOESERVE_KERNELS_CUDA_BF16_GEMM_H
#define MOESERVE_KERNELS_CUDA_BF16_GEMM_H

#include <cuda_bf16.h>

#include <cstddef>
#include <cstdint>

// Whether the experts' two GEMMs of n_pairs (token, expert) pairs over E local experts of BF16
// weights (D hidden, F expert width) take the wgmma kernels: more than 48 pairs an expert on
// average (MOESERVE_WGMMA_MIN), or on shapes of long k loops (D and F from 2048) from 12 to 48 on
// the kernel with the operands swapped (MOESERVE_WGMMA_SWAP_MAX; bf16_gemm.cu says when); D and F
// multiples of the tiles (D % 256, F % 128 in either precision), unless
// MOESERVE_WGMMA=0.
bool bf16_wgmma_takes(int64_t n_pairs, int E, int D, int F, bool split);
// Whether high-precision experts of this shape sum the hi and lo products in one chain at every
// size (the wgmma kernel's sums, moe.cu's ONE tiles below its sizes), so a token's rows are the
// same bits at any batch size: for the shapes the kernel takes in high, unless MOESERVE_WGMMA=0;
// outside deterministic mode also unless MOESERVE_ONE_CHAIN=0.
bool bf16_wgmma_one_chain(int D, int F);
// The scratch bf16_wgmma_experts needs: x's BF16 rows (high: and their lo parts) in grouped order.
size_t bf16_wgmma_scratch_bytes(int64_t n_pairs, int D, bool split);
// Both GEMMs from moe.cu's prepared inputs: xb [AP, T, D] (x in BF16, split: then its lo parts),
// pairs [n_pairs] grouped by expert by offsets [E + 1]; h [AP, n_pairs, F] the hidden rows in
// grouped order (written); out [T K, D] fp32, row p for pair p (skipped pairs untouched).
void bf16_wgmma_experts(float *out, const __nv_bfloat16 *xb, int T, const int32_t *pairs,
                        const int32_t *offsets, int K, const __nv_bfloat16 *gate_up,
                        const __nv_bfloat16 *down, int E, int D, int F, int64_t n_pairs, bool split,
                        __nv_bfloat16 *h, unsigned char *scratch);

// NVFP4 experts (W4A16) on the same kernel unless MOESERVE_W4A16_WGMMA=0, outside deterministic
// mode, for the shapes bf16_wgmma_takes takes and more than MOESERVE_W4A16_WGMMA_MIN pairs an
// expert (default 96 in medium, 56 in high): the weights as moe.cu's W4A16 tiles read them (codes,
// scales and tensor scales s2 [E, 3] of cuda_prepare_experts_nvfp4), decoded into BF16 tiles in
// shared memory by two or three more warps with the tiles' own decode, the tensor scales applied
// in the epilogues.
bool bf16_wgmma_w4_takes(int64_t n_pairs, int E, int D, int F, bool split);
void bf16_wgmma_experts_w4(float *out, const __nv_bfloat16 *xb, int T, const int32_t *pairs,
                           const int32_t *offsets, int K, const uint8_t *gate_up,
                           const uint8_t *gate_up_sf, const uint8_t *down, const uint8_t *down_sf,
                           const float *s2, int E, int D, int F, int64_t n_pairs, bool split,
                           __nv_bfloat16 *h, unsigned char *scratch);

// FP8 experts (W8A16) on the same kernel, high precision only, outside deterministic mode;
// on unless MOESERVE_W8A16_WGMMA=0; more than MOESERVE_W8A16_WGMMA_MIN pairs an expert (default
// 96). The codes and fp32 block scales of cuda_prepare_experts_fp8 (scales equal
// over aligned groups of 64 weight rows, as 128 x 128 blocks give), decoded into BF16 tiles (e4m3
// exactly) by two more warps; the hi and the lo products of each 128-k block summed in one fp32
// accumulator, then added into the totals times the block's scale (the W8A16 tiles' fold).
bool bf16_wgmma_w8_takes(int64_t n_pairs, int E, int D, int F, bool split);
void bf16_wgmma_experts_w8(float *out, const __nv_bfloat16 *xb, int T, const int32_t *pairs,
                           const int32_t *offsets, int K, const uint8_t *gate_up,
                           const float *gate_up_s, const uint8_t *down, const float *down_s, int E,
                           int D, int F, int64_t n_pairs, __nv_bfloat16 *h, unsigned char *scratch);

// Whether bf16_wgmma_linear takes a weight [N, Kd] (medium: N % 256, high (split): N % 128;
// Kd % 64), unless MOESERVE_WGMMA=0.
bool bf16_wgmma_linear_takes(int N, int Kd, bool split);
// moe.cu's cuda_linear_bi at prefill sizes: out[T, N] = x w^T with Kd in ranges of L (a multiple
// of 64), from the prepare kernel's xb [AP, T, Kd] (x in BF16, split: then its lo parts), rows
// (row m's output row, m itself) and offsets {0, T}; with more than one range each range's sums
// go to part [S, T, N] (the caller adds them in order), else to out. Medium: the mma.sync tiles'
// sums; high: each range's hi and lo products in one chain.
void bf16_wgmma_linear(float *out, float *part, const __nv_bfloat16 *xb, const int32_t *rows,
                       const int32_t *offsets, const __nv_bfloat16 *w, int T, int N, int Kd, int L,
                       bool split);

#endif
