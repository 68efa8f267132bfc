// The FP8 x FP8 grouped GEMM's way into the routed experts (kernels/cuda/fp8_gemm.cu), for
// moe.cu: CUDA C++ only. The C entry point for tests is cuda_fp8_grouped_gemm (cuda_ops.h).
#ifndef MOESERVE_KERNELS_CUDA_FP8_GEMM_H
#define MOESERVE_KERNELS_CUDA_FP8_GEMM_H

#include <cuda_bf16.h>

#include <cstddef>
#include <cstdint>

// Whether the experts' GEMM 1 takes the FP8 x FP8 kernel for n_pairs (token, expert) pairs over E
// local experts of block-FP8 weights (D hidden, F expert width): medium precision outside
// deterministic mode, more than MOESERVE_W8A8_MIN pairs an expert on average (default 15),
// D % 128 == 0 and F % 64 == 0, unless MOESERVE_W8A8=0.
bool fp8_w8a8_takes(int64_t n_pairs, int E, int D, int F);

// Whether the experts' GEMM 2 takes it too (fp8_w8a8_down), where GEMM 1 does: F % 128 == 0, unless
// MOESERVE_W8A8_DOWN=0.
bool fp8_w8a8_down_takes(int64_t n_pairs, int E, int D, int F);

// The scratch fp8_w8a8_gate_up and fp8_w8a8_down need for x [T, D] and n_pairs grouped rows: x's
// codes and scales and their copies in grouped order, then h's codes and scales.
size_t fp8_w8a8_scratch_bytes(int T, int64_t n_pairs, int D, int F);

// GEMM 1 of the experts on FP8 tensor cores: x [T, D] quantized per token per 128 channels (the
// FP8 payload's formula), then for grouped row m (pair pairs[m] of token pairs[m] / K, expert e by
// offsets [E + 1]) h[m, F] = silu(x gate_e^T) * (x up_e^T) in BF16, with w the experts' gate_up
// codes [E, 2F, D] in the W8A16 layout (fp8_w8_pack64 per 64 k; x's codes are packed the same
// way, so every product pairs the same k) and wsc their scales [E, D / 128, 2F] (equal over each
// aligned group of 64 gate rows and of 64 up rows: 128 x 128 block scales repeated over their
// rows).
void fp8_w8a8_gate_up(__nv_bfloat16 *h, const float *x, int T, int D, int F, const int32_t *pairs,
                      int K, const uint8_t *w, const float *wsc, const int32_t *offsets, int E,
                      int64_t n_pairs, unsigned char *scratch);

// GEMM 2 of the experts on FP8 tensor cores, after fp8_w8a8_gate_up: h [n_pairs, F] (grouped rows)
// quantized per row per 128 channels with the same formula as x, then out[pairs[m], D] = h_m
// down_e^T in fp32 for each grouped row m < offsets[E], with w the down codes [E, D, F] (W8A16
// layout) and wsc their scales [E, F / 128, D] (equal over aligned groups of 64 rows). scratch:
// fp8_w8a8_gate_up's (T tokens), past its x regions (fp8_w8a8_scratch_bytes).
void fp8_w8a8_down(float *out, const __nv_bfloat16 *h, int T, int D, int F, const int32_t *pairs,
                   const uint8_t *w, const float *wsc, const int32_t *offsets, int E,
                   int64_t n_pairs, unsigned char *scratch);

#endif
