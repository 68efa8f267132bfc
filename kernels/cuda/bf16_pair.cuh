// Device helpers shared by the grouped GEMMs (moe.cu, fp8_gemm.cu): a pair of fp32 values as BF16,
// high precision's hi + lo split of them, and the experts' SiLU. The same functions in both files
// keep the gate and up products' BF16 outputs the same bits whichever kernel computed them.
#ifndef MOESERVE_KERNELS_CUDA_BF16_PAIR_CUH
#define MOESERVE_KERNELS_CUDA_BF16_PAIR_CUH

#include <cuda_bf16.h>

#include <cstdint>

// (lo, hi) rounded to BF16, lo in the low half.
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
    __nv_bfloat162 b = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&b);
}

// The high precision's two parts of a pair of activations (a0, a1): *hi = bf16(a), *lo =
// bf16(a - hi). a - hi is exact in fp32 (hi is a rounded to fewer bits of the same binade), so
// hi + lo is a to within 2^-8 |a - hi| <= 2^-16 |a|. __fsub_rn is never fused with whatever
// computed a, so every kernel and tile shape splits the same a into the same bits.
__device__ __forceinline__ void split_bf16x2(float a0, float a1, uint32_t *hi, uint32_t *lo) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(a0, a1);
    const float2 hf = __bfloat1622float2(h);
    *hi = *reinterpret_cast<const uint32_t *>(&h);
    *lo = pack_bf16x2(__fsub_rn(a0, hf.x), __fsub_rn(a1, hf.y));
}

__device__ __forceinline__ float silu(float g) { return g / (1.0f + expf(-g)); }

#endif
