// The experts' input formats on the device, a group of values at a time: kernels/cpu/quant.c's
// arithmetic in the same order with the same roundings (no contraction: __fdiv_rn, __fmul_rn),
// used by elementwise.cu's moe_input kernels, so they give the CPU's bits by construction. Needs
// kernels/quant.h's element conversions.
#pragma once

#include "kernels/quant.h"

// NVFP4's token scale s2 from the token's maximum |x| (1 for a zero token).
__device__ __forceinline__ float nvfp4_token_scale(float amax) {
    return amax > 0.0f ? __fdiv_rn(amax, FP4_E2M1_MAX * FP8_E4M3_MAX) : 1.0f;
}

// v through NVFP4: m the maximum |v| over the whole group of QUANT_FP4_GROUP (these N values may
// be part of it), s2 the token scale: the group's E4M3 scale, then each value's E2M1 code, decoded.
template <int N> __device__ __forceinline__ void nvfp4_roundtrip(float (&v)[N], float m, float s2) {
    const float s6 = __fmul_rn(FP4_E2M1_MAX, s2);
    const uint8_t code = fp8_e4m3_from_float(__fdiv_rn(m, s6));
    const float sf = fp8_e4m3_to_float(code), scale = __fmul_rn(sf, s2);
#pragma unroll
    for (int i = 0; i < N; i++) {
        const uint8_t q = scale > 0.0f ? fp4_e2m1_from_float(__fdiv_rn(v[i], scale)) : 0;
        v[i] = __fmul_rn(__fmul_rn(fp4_e2m1_to_float(q), sf), s2);
    }
}

// v through FP8: m the maximum |v| over the whole group of QUANT_FP8_GROUP channels.
template <int N> __device__ __forceinline__ void fp8_roundtrip(float (&v)[N], float m) {
    const float sc = __fdiv_rn(m > 1e-10f ? m : 1e-10f, FP8_E4M3_MAX);
#pragma unroll
    for (int i = 0; i < N; i++)
        v[i] = __fmul_rn(fp8_e4m3_to_float(fp8_e4m3_from_float(__fdiv_rn(v[i], sc))), sc);
}
