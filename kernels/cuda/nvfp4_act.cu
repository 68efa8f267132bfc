// The activations' side of the NVFP4 x NVFP4 experts for Blackwell (docs/blackwell_nvfp4.md,
// steps 2 and 3; the GEMM is kernels/cuda/nvfp4_sm100.cu). Plain CUDA, built for every target,
// so its test runs on Hopper too. The rows of the experts live in blocks of 128, each block one
// expert's, an expert's rows from its first block (pblk) on; a row is stored as the GEMM reads it:
// E2M1 codes (two a byte, the even k in the low nibble), E4M3 group scales in the 128 x 4 atoms of
// quant_nvfp4_sf_atoms (kernels/quant.h), and its tensor scale s2 in fp32. The quantization is
// kernels/cpu/quant.c's quant_nvfp4 of one row with s2 from the row's own amax (the NVFP4 payload's
// formula, kernels/a2a.h), the same divisions rounded to nearest, so a row's codes are the CPU's
// bit for bit.
// - cuda_nvfp4_blocks: from the experts' row offsets, each expert's first block and each block's
//   expert and rows (one block of threads, a prefix sum over the experts).
// - cuda_nvfp4_quant_pairs: the grouped rows (pairs, as moe.cu's prepare orders them) quantized
// from
//   their tokens' x into the blocks, with the pair each row came from.
// - cuda_nvfp4_silu_quant: GEMM 1's fp32 rows [gate F | up F] to h = silu(gate) up, quantized into
//   the same blocks for GEMM 2.
// - cuda_nvfp4_scatter: GEMM 2's rows back to their pairs' slot rows.
#include <cuda_runtime.h>

#include <cstdint>

#include "common/log.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/quant.h"

enum { NV4A_THREADS = 128, NV4A_MAX_E = 1024 };

__global__ void nv4_blocks_kernel(int32_t *blk_e, int32_t *blk_rows, int32_t *pblk,
                                  const int32_t *offsets, int E, int n_blk) {
    __shared__ int32_t first[NV4A_MAX_E + 1];
    if (threadIdx.x == 0) { // E is at most a few hundred: one thread's prefix sum
        int b = 0;
        for (int e = 0; e < E; e++) {
            first[e] = b;
            b += (offsets[e + 1] - offsets[e] + 127) / 128;
        }
        first[E] = b;
    }
    __syncthreads();
    for (int e = threadIdx.x; e <= E; e += blockDim.x)
        pblk[e] = first[e];
    for (int blk = threadIdx.x; blk < n_blk; blk += blockDim.x) {
        int lo = 0, hi = E; // the expert whose blocks hold blk: first[lo] <= blk < first[lo + 1]
        while (hi - lo > 1) {
            const int mid = (lo + hi) / 2;
            if (first[mid] <= blk)
                lo = mid;
            else
                hi = mid;
        }
        const bool in = blk < first[E];
        const int rows = in ? offsets[lo + 1] - offsets[lo] - (blk - first[lo]) * 128 : 0;
        blk_e[blk] = in ? lo : -1;
        blk_rows[blk] = rows < 128 ? rows : 128;
    }
}

__device__ __forceinline__ float nv4a_block_amax(float a, float *red) {
    for (int o = 16; o > 0; o >>= 1)
        a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, o));
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads(); // red may still be read from the row before
    if (lane == 0) red[warp] = a;
    __syncthreads();
    a = 0.0f;
    for (int w = 0; w < (int)(blockDim.x >> 5); w++)
        a = fmaxf(a, red[w]);
    return a;
}

// Row R (of the blocks) from the C values v(c): codes q[R, C / 2], scales into the atoms, sa[R].
// A thread a group of 16, in turn.
template <class V>
__device__ void nv4a_quant_row(uint8_t *q, uint8_t *atoms, float *sa, int64_t R, int C, V v) {
    __shared__ float red[32];
    float a = 0.0f;
    for (int c = threadIdx.x; c < C; c += blockDim.x)
        a = fmaxf(a, fabsf(v(c)));
    a = nv4a_block_amax(a, red);
    const float s2 = a > 0.0f ? __fdiv_rn(a, FP4_E2M1_MAX * FP8_E4M3_MAX) : 1.0f;
    const int G = C / QUANT_FP4_GROUP;
    uint8_t *qr = q + R * (C / 2);
    for (int g = threadIdx.x; g < G; g += blockDim.x) {
        float x[QUANT_FP4_GROUP], m = 0.0f;
#pragma unroll
        for (int i = 0; i < QUANT_FP4_GROUP; i++) {
            x[i] = v(g * QUANT_FP4_GROUP + i);
            m = fmaxf(m, fabsf(x[i]));
        }
        const uint8_t code = fp8_e4m3_from_float(__fdiv_rn(m, __fmul_rn(FP4_E2M1_MAX, s2)));
        const float scale = __fmul_rn(fp8_e4m3_to_float(code), s2); // 0 for an all-zero group
        uint32_t w[2] = {0u, 0u};
#pragma unroll
        for (int i = 0; i < QUANT_FP4_GROUP; i++) {
            const uint32_t nib = scale > 0.0f ? fp4_e2m1_from_float(__fdiv_rn(x[i], scale)) : 0u;
            w[i / 8] |= nib << (4 * (i % 8));
        }
        *reinterpret_cast<uint2 *>(qr + g * (QUANT_FP4_GROUP / 2)) = make_uint2(w[0], w[1]);
        atoms[((R / 128) * (C / 64) + g / 4) * 512 + (R % 32) * 16 + (R / 32 % 4) * 4 + g % 4] =
            code;
    }
    if (threadIdx.x == 0) sa[R] = s2;
}

// Block m: grouped row m (expert e by offsets), the pair pairs[m] of token pairs[m] / topk; blocks
// past offsets[E] have no row.
__global__ void nv4_quant_pairs_kernel(uint8_t *q, uint8_t *atoms, float *sa, int32_t *row_pair,
                                       const float *x, int D, const int32_t *pairs, int topk,
                                       const int32_t *offsets, const int32_t *pblk, int E) {
    const int m = blockIdx.x;
    if (m >= __ldg(&offsets[E])) return; // n_pairs may bound the rows from above
    int lo = 0, hi = E; // offsets[lo] <= m < offsets[lo + 1]
    while (hi - lo > 1) {
        const int mid = (lo + hi) / 2;
        if (__ldg(&offsets[mid]) <= m)
            lo = mid;
        else
            hi = mid;
    }
    const int64_t R = (int64_t)__ldg(&pblk[lo]) * 128 + (m - __ldg(&offsets[lo]));
    const int32_t pair = __ldg(&pairs[m]);
    const float *xr = x + (int64_t)(pair / topk) * D;
    nv4a_quant_row(q, atoms, sa, R, D, [&](int c) { return __ldg(&xr[c]); });
    if (threadIdx.x == 0) row_pair[R] = pair;
}

// Block R: a row of the blocks, quantized from GEMM 1's fp32 row [gate F | up F] when it is valid.
__global__ void nv4_silu_quant_kernel(uint8_t *q, uint8_t *atoms, float *sa, const float *g1,
                                      const int32_t *blk_rows, int F) {
    const int64_t R = blockIdx.x;
    if ((int)(R % 128) >= __ldg(&blk_rows[R / 128])) return; // padding: left zero
    const float *gr = g1 + R * 2 * F;
    nv4a_quant_row(q, atoms, sa, R, F, [&](int c) {
        const float g = gr[c];
        return __fmul_rn(__fdiv_rn(g, 1.0f + expf(-g)), gr[F + c]); // kernels/cpu's silu * up
    });
}

__global__ void nv4_scatter_kernel(float *out, const float *rows, const int32_t *row_pair, int D) {
    const int64_t R = blockIdx.x;
    const int32_t p = __ldg(&row_pair[R]);
    if (p < 0) return;
    const float4 *src = reinterpret_cast<const float4 *>(rows + R * D);
    float4 *dst = reinterpret_cast<float4 *>(out + (int64_t)p * D);
    for (int i = threadIdx.x; i < D / 4; i += blockDim.x)
        dst[i] = src[i];
}

int cuda_nvfp4_blocks_max(int64_t n_pairs, int E) { return (int)((n_pairs + 127) / 128) + E; }

void cuda_nvfp4_blocks(int32_t *blk_e, int32_t *blk_rows, int32_t *pblk, const int32_t *offsets,
                       int E, int n_blk) {
    MS_ASSERT(E > 0 && E <= NV4A_MAX_E && n_blk >= 0);
    nv4_blocks_kernel<<<1, 256, 0, cuda_stream()>>>(blk_e, blk_rows, pblk, offsets, E, n_blk);
    CUDA_CHECK_LAUNCH();
}

void cuda_nvfp4_quant_pairs(uint8_t *q, uint8_t *atoms, float *sa, int32_t *row_pair,
                            const float *x, int D, const int32_t *pairs, int topk,
                            const int32_t *offsets, const int32_t *pblk, int E, int64_t n_pairs,
                            int n_blk) {
    MS_ASSERT(D > 0 && D % 64 == 0 && topk > 0 && E > 0);
    const int64_t R = (int64_t)n_blk * 128;
    cudaStream_t s = cuda_stream();
    CUDA_CHECK(cudaMemsetAsync(q, 0, (size_t)(R * D / 2), s));
    CUDA_CHECK(cudaMemsetAsync(atoms, 0, (size_t)n_blk * (D / 64) * 512, s));
    CUDA_CHECK(cudaMemsetAsync(sa, 0, sizeof(float) * (size_t)R, s));
    CUDA_CHECK(cudaMemsetAsync(row_pair, 0xff, sizeof(int32_t) * (size_t)R, s)); // -1: padding
    if (n_pairs <= 0) return;
    nv4_quant_pairs_kernel<<<(unsigned)n_pairs, NV4A_THREADS, 0, s>>>(
        q, atoms, sa, row_pair, x, D, pairs, topk, offsets, pblk, E);
    CUDA_CHECK_LAUNCH();
}

void cuda_nvfp4_silu_quant(uint8_t *q, uint8_t *atoms, float *sa, const float *g1,
                           const int32_t *blk_rows, int n_blk, int F) {
    MS_ASSERT(F > 0 && F % 64 == 0 && n_blk >= 0);
    const int64_t R = (int64_t)n_blk * 128;
    cudaStream_t s = cuda_stream();
    CUDA_CHECK(cudaMemsetAsync(q, 0, (size_t)(R * F / 2), s));
    CUDA_CHECK(cudaMemsetAsync(atoms, 0, (size_t)n_blk * (F / 64) * 512, s));
    CUDA_CHECK(cudaMemsetAsync(sa, 0, sizeof(float) * (size_t)R, s));
    if (R == 0) return;
    nv4_silu_quant_kernel<<<(unsigned)R, NV4A_THREADS, 0, s>>>(q, atoms, sa, g1, blk_rows, F);
    CUDA_CHECK_LAUNCH();
}

void cuda_nvfp4_scatter(float *out, const float *rows, const int32_t *row_pair, int n_blk, int D) {
    MS_ASSERT(D > 0 && D % 4 == 0 && ((uintptr_t)out & 15) == 0 && ((uintptr_t)rows & 15) == 0);
    if (n_blk <= 0) return;
    nv4_scatter_kernel<<<(unsigned)n_blk * 128, 128, 0, cuda_stream()>>>(out, rows, row_pair, D);
    CUDA_CHECK_LAUNCH();
}
