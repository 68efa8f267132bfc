// NVFP4 and FP8 experts at decode sizes with the weights as wgmma's A operand from registers
// (kernels/cuda/moe_lean.cu), for moe.cu: CUDA C++ only. The sizes it takes by default are those
// where it was timed faster than the tiles (docs/benchmarks.md, "One H100 and one H200
// (2026-12-06, seventeenth session)"; FP8: "One H100 (2026-12-06, eighteenth session)"; NVFP4
// from 9 pairs an expert: "One H100 (2026-12-06, nineteenth session)"; FP8 in high precision from
// 9: "One H100 (2026-12-06, twentieth session)").
#ifndef MOESERVE_KERNELS_CUDA_MOE_LEAN_H
#define MOESERVE_KERNELS_CUDA_MOE_LEAN_H

#include <cuda_bf16.h>

#include <cstdint>

// The rows of a tile (8, 16, 24 or 32 pairs of one expert, about twice the average; 4 at one
// pair an expert or fewer in high precision (split) with the products stacked, by
// MOESERVE_LEAN_ROWS4) in which the lean kernels take n_pairs pairs over E local experts of NVFP4
// weights (D hidden, F expert width), or 0 where they do not: on a Hopper device, D and F
// multiples of 256, and by MOESERVE_NVFP4_LEAN: 1, up to 16 pairs an expert on average; 2 (the
// default), up to 16 where 32-row tiles run in form 5 or 6 (their default forms; else up to 8),
// and where moe.cu takes its tiny path (tiny) only on experts of at least 4 M weights a matrix; 0
// never. (moe.cu adds its own conditions: outside deterministic mode, and in high precision only
// where its NVFP4 tiles sum in one chain.)
int moe_lean_w4_rows(int64_t n_pairs, int E, int D, int F, bool tiny, bool split);

// Both GEMMs from moe.cu's prepared inputs, its prepare kernel run with tiles of `rows` rows:
// xb [AP, T, D] (x in BF16; split: its lo parts xb_lo elements on), pairs [n_pairs] in grouped
// order, tiles [max_tiles] {expert, first row, end row} and their count n_tiles (device). h [AP,
// n_pairs, F] receives the hidden rows in grouped order (split: the lo parts n_pairs F elements
// on); out [T K, D] fp32, row p for pair p. The weights as cuda_prepare_experts_nvfp4 leaves them:
// codes and scale bytes of gate_up [E, 2F, D] and down [E, D, F], tensor scales s2 [E, 3]. The
// sums are the tiles' (each output's k16 products in increasing k, split: hi then lo on the same
// sums), the epilogues theirs.
void moe_lean_w4_experts(float *out, const __nv_bfloat16 *xb, int64_t xb_lo, const int32_t *pairs,
                         const int4 *tiles, const int32_t *n_tiles, int max_tiles, int K,
                         const uint8_t *gate_up_q, const uint8_t *gate_up_sf, const uint8_t *down_q,
                         const uint8_t *down_sf, const float *s2, int E, int D, int F,
                         int64_t n_pairs, int rows, bool split, __nv_bfloat16 *h);

// The most pairs a call takes the kernels with no prepare kernel at (MOESERVE_LEAN_TINY_PAIRS:
// 16 when unset, moe.cu's tiny path's sizes; at most LEAN_TINY_MAX_PAIRS, what their grouping
// takes: one pair a lane of a warp).
#define LEAN_TINY_MAX_PAIRS 32
int moe_lean_tiny_pairs(void);

// Whether the tiny path's n_pairs pairs (moe.cu's T K up to 16) take moe_lean_w4_experts_tiny
// (MOESERVE_LEAN_TINY: on small experts when unset, and where the 4-row tiles would take them in
// high precision were they not tiny; split: high precision, else medium, unless
// MOESERVE_LEAN_TINY_MEDIUM=0).
bool moe_lean_w4_tiny(int64_t n_pairs, int E, int D, int F, bool split);

// Both GEMMs at those sizes with no prepare kernel: each block groups topk_ids [T, K] (n_rows:
// NULL, or the device count of tokens to take) itself, GEMM 1 reads x [T, D] in fp32 and
// converts it as the prepare kernel does, h [2, T K, F] holds the hidden rows by pair id (the lo
// parts T K F elements on). The same sums as moe_lean_w4_experts on 4-row tiles (split: in high
// precision), or in medium precision (the lo parts zero) on 8-row tiles.
void moe_lean_w4_experts_tiny(float *out, const float *x, const int32_t *topk_ids,
                              const int32_t *n_rows, int T, int K, const uint8_t *gate_up_q,
                              const uint8_t *gate_up_sf, const uint8_t *down_q,
                              const uint8_t *down_sf, const float *s2, int E, int D, int F,
                              bool split, __nv_bfloat16 *h);

// The same for FP8 experts (E4M3 codes in fp8_pack_kernel's layout, fp32 scales a 128 x 128
// block as [E, Kd / 128, rows]), by MOESERVE_FP8_LEAN (the same values, 2 when unset: up to 8
// pairs an expert, in high precision (split) up to 16 where 32-row tiles run in form 6), D and F
// multiples of 128.
int moe_lean_w8_rows(int64_t n_pairs, int E, int D, int F, bool tiny, bool split);

// moe_lean_w4_experts for FP8 experts as cuda_prepare_experts_fp8 leaves them: each 128-k block's
// sums folded into the totals times its rows' scale, as the tiles do; no tensor scales.
void moe_lean_w8_experts(float *out, const __nv_bfloat16 *xb, int64_t xb_lo, const int32_t *pairs,
                         const int4 *tiles, const int32_t *n_tiles, int max_tiles, int K,
                         const uint8_t *gate_up_q, const float *gate_up_s, const uint8_t *down_q,
                         const float *down_s, int E, int D, int F, int64_t n_pairs, int rows,
                         bool split, __nv_bfloat16 *h);

// Whether FP8's tiny sizes take moe_lean_w8_experts_tiny (MOESERVE_FP8_LEAN_TINY, off when
// unset; where the 8-row tiles in form 1 would take them were they not tiny; split: high
// precision, in one chain).
bool moe_lean_w8_tiny(int64_t n_pairs, int E, int D, int F, bool split);

// Both GEMMs of FP8 experts at those sizes with no prepare kernel, as moe_lean_w4_experts_tiny:
// the same sums as moe_lean_w8_experts on 8-row tiles.
void moe_lean_w8_experts_tiny(float *out, const float *x, const int32_t *topk_ids,
                              const int32_t *n_rows, int T, int K, const uint8_t *gate_up_q,
                              const float *gate_up_s, const uint8_t *down_q, const float *down_s,
                              int E, int D, int F, bool split, __nv_bfloat16 *h);

#endif
