// The KV cache's element types on the device (kernels/ops.h's kv_layer): float, or __nv_bfloat16
// where kv.bf16 is set. The stores round to nearest even (the CPU's f32_to_bf16); the loads widen
// exactly, four elements (one "piece") at a time, so a kernel computes on an fp32 cache and on a
// BF16 one with the same arithmetic. A BF16 piece is an 8-byte load where fp32's is 16, so the
// attention kernels hold twice the pieces in flight (attention.cu's attn_layout) and copy two at a
// time into shared memory.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

template <class KV> struct kv_elem;

template <> struct kv_elem<float> {
    typedef float4 piece; // four elements: 16 bytes
    static __device__ __forceinline__ float4 widen(float4 p) { return p; }
    static __device__ __forceinline__ void put(float *d, float x) { *d = x; }
    static __device__ __forceinline__ void put4(float *d, float4 v) {
        *reinterpret_cast<float4 *>(d) = v;
    }
};

template <> struct kv_elem<__nv_bfloat16> {
    typedef uint2 piece; // four elements: 8 bytes, element i in the low half of word i / 2 first
    static __device__ __forceinline__ float lo(uint32_t w) { return __uint_as_float(w << 16); }
    static __device__ __forceinline__ float hi(uint32_t w) {
        return __uint_as_float(w & 0xffff0000u);
    }
    static __device__ __forceinline__ float4 widen(uint2 p) {
        return make_float4(lo(p.x), hi(p.x), lo(p.y), hi(p.y));
    }
    static __device__ __forceinline__ uint32_t pack(float a, float b) {
        return (uint32_t)__bfloat16_as_ushort(__float2bfloat16_rn(a)) |
               (uint32_t)__bfloat16_as_ushort(__float2bfloat16_rn(b)) << 16;
    }
    static __device__ __forceinline__ void put(__nv_bfloat16 *d, float x) {
        *d = __float2bfloat16_rn(x);
    }
    static __device__ __forceinline__ void put4(__nv_bfloat16 *d, float4 v) {
        *reinterpret_cast<uint2 *>(d) = make_uint2(pack(v.x, v.y), pack(v.z, v.w));
    }
};
