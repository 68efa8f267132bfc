// NVFP4 weights at decode sizes (up to 8 tokens an expert) on Hopper, with the weights as wgmma's
// A operand from registers: how close a lean kernel comes to the copy rate, in three precisions.
// (issue 8: the tiles of kernels/cuda/moe.cu issue about 4.7 instructions a weight there and
// stream at about half the copy rate.)
//
//   build/bench_nvfp4_decode [--k K] [--rows N] [--waves W] [--stages S] [--reps R] [--tokens T]
//   build/bench_nvfp4_decode --layout-check [--k K]   the host's half alone, no device needed
//
// y[T, N] = x[T, K] w[N, K]^T, w in NVFP4 (E2M1 codes, an E4M3 scale a 16 k, a tensor scale).
// Each block is one consumer warpgroup and one producer warp; a tile is 64 rows of w, a stage 256
// of its k (8 KB of codes, 1 KB of scales, both one bulk copy, stored in stage order) and x's
// matching slice (a second bulk copy, from L2). The warpgroup decodes its A fragments in
// registers and reads x from shared memory through the descriptor (8 token columns, those past T
// zero):
//   w4a16  each code placed into BF16 bits (gemm_common.cuh's wq_decode, the W4A16 layout) times
//          its group scale (one bf16x2 product), m64n8k16 in BF16 with x rounded to BF16: the
//          tiles' exact products, medium precision's x;
//   w4a16h the same weights against x's hi and lo BF16 parts, two wgmma a k16 step on the same
//          sums: high precision's one chain;
//   w4a8   each code placed into E4M3 bits by a mask (four codes a word) or two shifts and two
//          masks (the other four): E2M1 s e1 e0 m is E4M3 s 0 0 e1 e0 m 0 0 times 2^6 exactly,
//          subnormals included; x quantized to E4M3 per token per 128 k (kernels/quant.h, as the
//          W8A8 experts do); m64n8k32 on the FP8 tensor cores (mma.sync's e4m3 shapes run as
//          conversions and FP16 products on sm_90a). A k32 step holds two groups of 16 with their
//          own scales, so it is two wgmma on the same A registers, each against x with the other
//          half's 16 k read from a zero block (the descriptor's leading byte offset points there),
//          each into fresh accumulators; the group sums take their scales in fp32 (and every
//          128 k x's), so no product ever sums more than 16 k on the tensor cores;
//   stream the same stages waited for and released, no arithmetic: the ceiling of this kernel's
//          reads.
// Each result is checked against a double-precision reference on the host with the same
// quantized operands; the rate counts the bytes of codes and scales over the median time of R
// launches, against a device copy measured in the same run (read + write over its time).
// --layout-check (tests/nvfp4_decode_layout_test.sh) decodes both layouts on the host as the
// kernels do and emulates their arithmetic on the bytes their stages hold (emulate_tile).
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include <cuda_fp16.h>

#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/gemm_common.cuh"
#include "kernels/cuda/hopper.cuh"
#include "kernels/quant.h"
#include "scripts/bench_timing.cuh"

enum { V_STREAM, V_W4A16, V_W4A8, V_W4A16H };
constexpr int BM = 64, BK = 256, NT = 8; // rows a tile, k a stage, token columns
constexpr int CODE_BYTES = BM * BK / 2, SF_BYTES = BM * BK / 16, W_BYTES = CODE_BYTES + SF_BYTES;
// x's slice of a stage: w4a16 32 chunks of 8 k x 8 tokens in BF16 (16 bytes a token); w4a8 a zero
// block, 16 chunks of 16 k x 8 tokens in E4M3, a zero block, then x's two scales a token
constexpr int X16_BYTES = BK / 8 * 128;
constexpr int X8_CHUNKS = 128, X8_Z1 = 128 + BK / 16 * 128, X8_SX = X8_Z1 + 128;
constexpr int X8_BYTES = (X8_SX + NT * 2 * 4 + 127) / 128 * 128;
// The B operand of each wgmma, {offset in x's slice, leading byte offset}: w4a16's k16 step k;
// w4a8's k32 step k, half 0 (x's chunk 2k, then the zero block after the chunks) and half 1 (the
// zero block before them, then chunk 2k + 1)
__host__ __device__ constexpr uint32_t w16_b_off(int k) { return k * 256; }
__host__ __device__ constexpr uint32_t w16_b_lbo(int) { return 128; }
__host__ __device__ constexpr uint32_t w8_b_off(int k, int half) {
    return half ? 0 : X8_CHUNKS + 2 * k * 128;
}
__host__ __device__ constexpr uint32_t w8_b_lbo(int k, int half) {
    return half ? X8_CHUNKS + (2 * k + 1) * 128 : X8_Z1 - w8_b_off(k, 0);
}
template <int V> __host__ __device__ constexpr int x_bytes() {
    return V == V_W4A8 ? X8_BYTES : V == V_W4A16H ? 2 * X16_BYTES : X16_BYTES;
}
template <int V> __host__ __device__ constexpr int stage_bytes() { return W_BYTES + x_bytes<V>(); }

struct bench_args {
    const uint8_t *w; // [tiles, nk, W_BYTES]
    const uint8_t *x; // [nk, x_bytes]
    float *y;         // [T, N]
    int tiles, nk, T, N, stages;
    float out_scale; // the tensor scale times what the decode's placement took out
};

// A descriptor of a K-major operand with no swizzle: 8 x 16-byte core matrices, the next along k
// lbo bytes on (given as the stride between rows of core matrices too: with 8 columns there is
// one, so either reading of the two fields finds k's). desc_base(addr) + desc_off(off, lbo) is the
// descriptor at addr + off: the start field (address / 16 < 2^14 in shared memory) never carries.
__device__ __forceinline__ uint64_t desc_base(uint32_t addr) { return (addr & 0x3FFFF) >> 4; }
__host__ __device__ constexpr uint64_t desc_off(uint32_t off, uint32_t lbo) {
    return (uint64_t)(off >> 4) | (uint64_t)(lbo >> 4) << 16 | (uint64_t)(lbo >> 4) << 32;
}
__device__ __forceinline__ void wg_fence() {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wg_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wg_wait_all() {
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
}
// d += a x b (BF16, k16)
__device__ __forceinline__ void wg_bf16(float (&d)[4], const uint32_t (&a)[4], uint64_t b) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0, %1, %2, %3}, "
                 "{%4, %5, %6, %7}, %8, 1, 1, 1, 0;\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}
// d = a x b (E4M3, k32), from zero
__device__ __forceinline__ void wg_e4m3(float (&d)[4], const uint32_t (&a)[4], uint64_t b) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0, %1, %2, %3}, "
                 "{%4, %5, %6, %7}, %8, 0, 1, 1;\n"
                 : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}
// two E4M3 codes (the low 16 bits of v, the first in the low byte) as floats, exactly
__device__ __forceinline__ float2 e4m3x2_float2(uint32_t v) {
    uint32_t h;
    asm("{\n.reg .b16 t;\ncvt.u16.u32 t, %1;\ncvt.rn.f16x2.e4m3x2 %0, t;\n}\n" : "=r"(h) : "r"(v));
    return __half22float2(*reinterpret_cast<const __half2 *>(&h));
}
// a word of the w4a8 layout: four codes in E4M3 bits by a mask, the other four by two shifts
#define W8_MASK 0x9C9C9C9Cu
__host__ __device__ __forceinline__ uint32_t w8_first(uint32_t w) { return w & W8_MASK; }
__host__ __device__ __forceinline__ uint32_t w8_second(uint32_t w) {
    return ((w << 2) & 0x8C8C8C8Cu) | ((w >> 2) & 0x10101010u);
}

template <int V> __global__ void __launch_bounds__(160) decode_kernel(const bench_args a) {
#if MOESERVE_WGMMA_DEVICE
    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ __align__(8) uint64_t bars[2 * 16];
    constexpr int SB = stage_bytes<V>();
    const uint32_t smem0 = (uint32_t)__cvta_generic_to_shared(smem);
    const uint32_t bar0 = (uint32_t)__cvta_generic_to_shared(bars);
    auto full = [&](int s) { return bar0 + 8 * s; };
    auto empty = [&](int s) { return bar0 + 8 * (16 + s); };
    const int S = a.stages, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    if (tid == 0) {
        for (int s = 0; s < S; s++) {
            mbar_init(full(s), 1);
            mbar_init(empty(s), 4);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    if (warp == 4) { // the producer
        if (lane == 0) {
            int s = 0, ph = 0;
            for (int t = blockIdx.x; t < a.tiles; t += gridDim.x)
                for (int kt = 0; kt < a.nk; kt++, s = s + 1 == S ? 0 : s + 1, ph ^= s == 0) {
                    mbar_wait(empty(s), ph ^ 1);
                    mbar_arrive_tx(full(s), SB);
                    bulk_load(smem0 + s * SB, a.w + ((int64_t)t * a.nk + kt) * W_BYTES, W_BYTES,
                              full(s));
                    bulk_load(smem0 + s * SB + W_BYTES, a.x + (int64_t)kt * x_bytes<V>(),
                              x_bytes<V>(), full(s));
                }
        }
        return;
    }
    const int g = lane >> 2, c0 = 2 * (lane & 3);
    int s = 0, ph = 0;
    for (int t = blockIdx.x; t < a.tiles; t += gridDim.x) {
        float tot[4] = {0.f, 0.f, 0.f, 0.f};
        for (int kt = 0; kt < a.nk; kt++, s = s + 1 == S ? 0 : s + 1, ph ^= s == 0) {
            mbar_wait(full(s), ph);
            const unsigned char *st = smem + s * SB;
            const uint32_t xs = smem0 + s * SB + W_BYTES;
            const uint64_t xd = desc_base(xs);
            // this thread's 16 code words (w4a16: one a k16 step; w4a8: two a k32 step) and its
            // rows' 16 group scales (unused by the stream kernel)
            uint32_t q[16], sg[4], sh[4];
#pragma unroll
            for (int c = 0; c < 4; c++) {
                const uint4 v = *reinterpret_cast<const uint4 *>(st + (c * 128 + tid) * 16);
                q[4 * c] = v.x, q[4 * c + 1] = v.y, q[4 * c + 2] = v.z, q[4 * c + 3] = v.w;
            }
            const uint4 vg =
                *reinterpret_cast<const uint4 *>(st + CODE_BYTES + ((warp * 8 + g) * 2) * 16);
            const uint4 vh =
                *reinterpret_cast<const uint4 *>(st + CODE_BYTES + ((warp * 8 + g) * 2 + 1) * 16);
            sg[0] = vg.x, sg[1] = vg.y, sg[2] = vg.z, sg[3] = vg.w;
            sh[0] = vh.x, sh[1] = vh.y, sh[2] = vh.z, sh[3] = vh.w;
            if constexpr (V == V_W4A16 || V == V_W4A16H) {
                uint32_t fr[16][4];
#pragma unroll
                for (int k = 0; k < 16; k++) {
                    const uint32_t ag = wq_scale2(sg[k / 4], k % 4),
                                   ah = wq_scale2(sh[k / 4], k % 4);
                    fr[k][0] = bf16x2_mul(wq_decode(q[k], 0), ag);
                    fr[k][1] = bf16x2_mul(wq_decode(q[k], 1), ah);
                    fr[k][2] = bf16x2_mul(wq_decode(q[k], 2), ag);
                    fr[k][3] = bf16x2_mul(wq_decode(q[k], 3), ah);
                }
                wg_fence();
#pragma unroll
                for (int k = 0; k < 16; k++) {
                    wg_bf16(tot, fr[k], xd + desc_off(w16_b_off(k), w16_b_lbo(k)));
                    if constexpr (V == V_W4A16H) // x's lo parts next, on the same sums
                        wg_bf16(tot, fr[k], xd + desc_off(X16_BYTES + w16_b_off(k), w16_b_lbo(k)));
                }
                wg_commit();
                wg_wait_all();
            } else if constexpr (V == V_W4A8) {
                uint32_t fr[8][4];
#pragma unroll
                for (int k = 0; k < 8; k++) {
                    fr[k][0] = w8_first(q[2 * k]);
                    fr[k][1] = w8_second(q[2 * k]);
                    fr[k][2] = w8_first(q[2 * k + 1]);
                    fr[k][3] = w8_second(q[2 * k + 1]);
                }
                float p[16][4];
                wg_fence();
#pragma unroll
                for (int k = 0; k < 8; k++) {
                    wg_e4m3(p[2 * k], fr[k], xd + desc_off(w8_b_off(k, 0), w8_b_lbo(k, 0)));
                    wg_e4m3(p[2 * k + 1], fr[k], xd + desc_off(w8_b_off(k, 1), w8_b_lbo(k, 1)));
                }
                wg_commit();
                wg_wait_all();
                const float *sx = reinterpret_cast<const float *>(st + W_BYTES + X8_SX);
#pragma unroll
                for (int kb = 0; kb < 2; kb++) { // x's 128-k blocks of the stage
                    float blk[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
                    for (int k = 4 * kb; k < 4 * kb + 4; k++) {
                        const int sw = k / 2, sshift = 16 * (k % 2);
                        const float2 fg = e4m3x2_float2(sg[sw] >> sshift);
                        const float2 fh = e4m3x2_float2(sh[sw] >> sshift);
                        blk[0] = fmaf(fg.y, p[2 * k + 1][0], fmaf(fg.x, p[2 * k][0], blk[0]));
                        blk[1] = fmaf(fg.y, p[2 * k + 1][1], fmaf(fg.x, p[2 * k][1], blk[1]));
                        blk[2] = fmaf(fh.y, p[2 * k + 1][2], fmaf(fh.x, p[2 * k][2], blk[2]));
                        blk[3] = fmaf(fh.y, p[2 * k + 1][3], fmaf(fh.x, p[2 * k][3], blk[3]));
                    }
                    const float x0 = sx[c0 * 2 + kb], x1 = sx[(c0 + 1) * 2 + kb];
                    tot[0] = fmaf(x0, blk[0], tot[0]);
                    tot[1] = fmaf(x1, blk[1], tot[1]);
                    tot[2] = fmaf(x0, blk[2], tot[2]);
                    tot[3] = fmaf(x1, blk[3], tot[3]);
                }
            }
            __syncwarp();
            if (lane == 0) mbar_arrive(empty(s));
        }
        if constexpr (V != V_STREAM) {
            const int r0 = t * BM + warp * 16 + g, r1 = r0 + 8;
            if (c0 < a.T) {
                a.y[(int64_t)c0 * a.N + r0] = tot[0] * a.out_scale;
                a.y[(int64_t)c0 * a.N + r1] = tot[2] * a.out_scale;
            }
            if (c0 + 1 < a.T) {
                a.y[(int64_t)(c0 + 1) * a.N + r0] = tot[1] * a.out_scale;
                a.y[(int64_t)(c0 + 1) * a.N + r1] = tot[3] * a.out_scale;
            }
        }
    }
#endif
}

// ---- host: data in the stage order above, and the references ----

struct problem {
    int N, K, T;
    std::vector<uint8_t> code; // [N, K] E2M1 codes, one a byte
    std::vector<uint8_t> sf;   // [N, K / 16] E4M3
    std::vector<float> x;      // [T, K]
    float s2;
};

static uint32_t rng_state = 12345;
static uint32_t rnd() {
    rng_state = rng_state * 1664525u + 1013904223u;
    return rng_state >> 8;
}

// w4a16's scale byte: c with (c << 4) + WQ_SF_BIAS the BF16 bits of the scale times 2^119, as
// moe.cu's nvfp4_pack_kernel stores it (exact: an E4M3 scale has 4 significant bits)
static uint8_t wq_sf_code(uint8_t e) {
    const float f = ldexpf(fp8_e4m3_to_float(e), WQ_SF_EXP);
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint8_t)(((u >> 16) - WQ_SF_BIAS) >> 4);
}
// and back: the scale a w4a16 byte stands for
static float wq_sf_value(uint8_t c) {
    const uint32_t u = (((uint32_t)c << 4) + WQ_SF_BIAS) << 16;
    float f;
    memcpy(&f, &u, 4);
    return ldexpf(f, -WQ_SF_EXP);
}

static void make_problem(problem *p, int rows, int K, int T) {
    p->N = rows, p->K = K, p->T = T, p->s2 = 0.75f;
    p->code.resize((size_t)rows * K);
    p->sf.resize((size_t)rows * (K / 16));
    p->x.resize((size_t)T * K);
    for (auto &c : p->code)
        c = (uint8_t)(rnd() & 15);
    for (auto &s : p->sf) // normal E4M3 scales from 2^-6 to 2^3
        s = (uint8_t)(8 + rnd() % 80);
    for (auto &v : p->x)
        v = (float)((int)(rnd() % 2001) - 1000) / 250.0f;
}

// bit b (0 m, 1 e0, 2 e1, 3 s) of a code at bit pos of w
static void put_code(uint32_t *w, int code, const int pos[4]) {
    for (int b = 0; b < 4; b++)
        *w |= (uint32_t)((code >> b) & 1) << pos[b];
}

static std::vector<uint8_t> pack_w(const problem &p, int V) {
    const int tiles = p.N / BM, nk = p.K / BK;
    std::vector<uint8_t> out((size_t)tiles * nk * W_BYTES, 0);
    int pos16[4][2][4];
    for (int j = 0; j < 4; j++)
        for (int h = 0; h < 2; h++)
            for (int b = 0; b < 4; b++)
                pos16[j][h][b] = wq_code_pos(j, h, b);
    for (int t = 0; t < tiles; t++)
        for (int kt = 0; kt < nk; kt++) {
            uint8_t *st = out.data() + ((size_t)t * nk + kt) * W_BYTES;
            for (int tid = 0; tid < 128; tid++) {
                const int warp = tid / 32, g = (tid % 32) / 4, tq = tid % 4;
                const int rg = t * BM + warp * 16 + g, rh = rg + 8;
                for (int wi = 0; wi < 16; wi++) {
                    uint32_t w = 0;
                    if (V != V_W4A8) { // word wi: k16 step wi, wq_code_pos's places
                        for (int j = 0; j < 4; j++)
                            for (int h = 0; h < 2; h++) {
                                const int r = j & 1 ? rh : rg;
                                const int k = kt * BK + wi * 16 + 2 * tq + h + (j >= 2 ? 8 : 0);
                                put_code(&w, p.code[(size_t)r * p.K + k], pos16[j][h]);
                            }
                    } else { // words 2s, 2s + 1: k32 step s's halves
                        const int s = wi / 2, hf = wi % 2;
                        for (int i = 0; i < 4; i++) {
                            const int k = kt * BK + s * 32 + hf * 16 + 4 * tq + i;
                            const int first[4] = {8 * i + 2, 8 * i + 3, 8 * i + 4, 8 * i + 7};
                            const int second[4] = {8 * i + 0, 8 * i + 1, 8 * i + 6, 8 * i + 5};
                            put_code(&w, p.code[(size_t)rg * p.K + k], first);
                            put_code(&w, p.code[(size_t)rh * p.K + k], second);
                        }
                    }
                    memcpy(st + ((wi / 4) * 128 + tid) * 16 + (wi % 4) * 4, &w, 4);
                }
            }
            for (int warp = 0; warp < 4; warp++)
                for (int g = 0; g < 8; g++)
                    for (int hh = 0; hh < 2; hh++) {
                        const int r = t * BM + warp * 16 + g + 8 * hh;
                        for (int i = 0; i < 16; i++) {
                            const uint8_t e = p.sf[(size_t)r * (p.K / 16) + kt * (BK / 16) + i];
                            st[CODE_BYTES + ((warp * 8 + g) * 2 + hh) * 16 + i] =
                                V == V_W4A8 ? e : wq_sf_code(e);
                        }
                    }
        }
    return out;
}

static float bf16_round(float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    memcpy(&v, &u, 4);
    return v;
}

// x's slices; xq / sxq: the E4M3 codes and scales of w4a8 (quant_fp8_rows)
static std::vector<uint8_t> pack_x(const problem &p, int V, const std::vector<uint8_t> &xq,
                                   const std::vector<float> &sxq) {
    const int nk = p.K / BK;
    const int XB = V == V_W4A8 ? X8_BYTES : V == V_W4A16H ? 2 * X16_BYTES : X16_BYTES;
    std::vector<uint8_t> out((size_t)nk * XB, 0);
    for (int kt = 0; kt < nk; kt++) {
        uint8_t *st = out.data() + (size_t)kt * XB;
        for (int n = 0; n < p.T; n++)
            for (int k = 0; k < BK; k++) {
                const int kk = kt * BK + k;
                if (V == V_W4A8) {
                    st[X8_CHUNKS + (k / 16) * 128 + n * 16 + k % 16] = xq[(size_t)n * p.K + kk];
                } else { // BF16: hi = bf16(x); w4a16h also lo = bf16(x - hi) after
                    const float v = p.x[(size_t)n * p.K + kk], hi = bf16_round(v);
                    const float parts[2] = {hi, bf16_round(v - hi)};
                    for (int part = 0; part < (V == V_W4A16H ? 2 : 1); part++) {
                        uint32_t u;
                        memcpy(&u, &parts[part], 4);
                        const uint16_t b = (uint16_t)(u >> 16);
                        memcpy(st + part * X16_BYTES + (k / 8) * 128 + n * 16 + (k % 8) * 2, &b, 2);
                    }
                }
            }
        if (V == V_W4A8)
            for (int n = 0; n < p.T; n++)
                for (int j = 0; j < 2; j++)
                    memcpy(st + X8_SX + (n * 2 + j) * 4, &sxq[(size_t)n * (p.K / 128) + kt * 2 + j],
                           4);
    }
    return out;
}

// Rows checked: every row of one tile in CHECK_EVERY (the host's reference takes its time)
#define CHECK_EVERY 8
static bool checked(int r) { return (r / BM) % CHECK_EVERY == 0; }

// y[T, N] in double from x' (the kernel's x: BF16-rounded or E4M3-dequantized) and w, on the
// rows checked
static std::vector<double> reference(const problem &p, const std::vector<float> &xv) {
    std::vector<double> y((size_t)p.T * p.N, 0.0);
    std::vector<float> wr(p.K);
    for (int r = 0; r < p.N; r++) {
        if (!checked(r)) continue;
        for (int k = 0; k < p.K; k++)
            wr[k] = fp4_e2m1_to_float(p.code[(size_t)r * p.K + k]) *
                    fp8_e4m3_to_float(p.sf[(size_t)r * (p.K / 16) + k / 16]);
        for (int n = 0; n < p.T; n++) {
            double acc = 0;
            for (int k = 0; k < p.K; k++)
                acc += (double)xv[(size_t)n * p.K + k] * wr[k];
            y[(size_t)n * p.N + r] = acc * p.s2;
        }
    }
    return y;
}

// the largest difference over the rows checked, over the largest |ref| there (y and ref [T, N])
static double rel_err(const std::vector<float> &y, const std::vector<double> &ref, int N) {
    double num = 0, den = 0;
    for (size_t i = 0; i < ref.size(); i++) {
        if (!checked((int)(i % N))) continue;
        num = std::max(num, std::fabs((double)y[i] - ref[i]));
        den = std::max(den, std::fabs(ref[i]));
    }
    return den > 0 ? num / den : num;
}

// The packed words of tile t decoded on the host as the kernels decode them, each value against
// its code at the place the fragment layouts give it: w4a16's register j of lane (g, q) holds
// rows g (j even) or g + 8 (odd) at k 2q + h (+ 8 for j >= 2) of its k16 step; w4a8's a0..a3 rows
// g, g + 8, g, g + 8 at k 4q + i (+ 16 for a2, a3) of its k32 step. Returns the mismatches.
static long layout_mismatches(const problem &p, int V, const std::vector<uint8_t> &w, int t) {
    const int nk = p.K / BK;
    long bad = 0;
    for (int kt = 0; kt < nk; kt++) {
        const uint8_t *st = w.data() + ((size_t)t * nk + kt) * W_BYTES;
        for (int tid = 0; tid < 128; tid++) {
            const int warp = tid / 32, g = (tid % 32) / 4, q = tid % 4;
            const int rg = t * BM + warp * 16 + g, rh = rg + 8;
            for (int wi = 0; wi < 16; wi++) {
                uint32_t word;
                memcpy(&word, st + ((wi / 4) * 128 + tid) * 16 + (wi % 4) * 4, 4);
                if (V == V_W4A16) {
                    for (int j = 0; j < 4; j++) {
                        // wq_decode on the host: rotations left by wq_rot, the two masks
                        auto rotl = [](uint32_t x, int r) {
                            return r ? x << r | x >> (32 - r) : x;
                        };
                        const uint32_t d = (rotl(word, wq_rot(j, false)) & WQ_MAG_MASK) |
                                           (rotl(word, wq_rot(j, true)) & WQ_SIGN_MASK);
                        for (int h = 0; h < 2; h++) {
                            const uint32_t bits = (d >> (16 * h) & 0xffffu) << 16;
                            float v;
                            memcpy(&v, &bits, 4);
                            const int r = j & 1 ? rh : rg;
                            const int k = kt * BK + wi * 16 + 2 * q + h + (j >= 2 ? 8 : 0);
                            bad += v * 0x1p126f != fp4_e2m1_to_float(p.code[(size_t)r * p.K + k]);
                        }
                    }
                    if (wi == 0) // this thread's rows' 16 group scales of the stage
                        for (int hh = 0; hh < 2; hh++)
                            for (int i = 0; i < 16; i++) {
                                const uint8_t c =
                                    st[CODE_BYTES + ((warp * 8 + g) * 2 + hh) * 16 + i];
                                const uint8_t e =
                                    p.sf[(size_t)(hh ? rh : rg) * (p.K / 16) + kt * (BK / 16) + i];
                                bad += wq_sf_value(c) != fp8_e4m3_to_float(e);
                            }
                } else {
                    const int step = wi / 2, hf = wi % 2;
                    const uint32_t regs[2] = {w8_first(word), w8_second(word)};
                    for (int j = 0; j < 2; j++)
                        for (int i = 0; i < 4; i++) {
                            const int r = j ? rh : rg;
                            const int k = kt * BK + step * 32 + hf * 16 + 4 * q + i;
                            const float v = fp8_e4m3_to_float((uint8_t)(regs[j] >> (8 * i)));
                            bad += v * 64.0f != fp4_e2m1_to_float(p.code[(size_t)r * p.K + k]);
                        }
                    if (wi == 0)
                        for (int hh = 0; hh < 2; hh++)
                            for (int i = 0; i < 16; i++)
                                bad +=
                                    st[CODE_BYTES + ((warp * 8 + g) * 2 + hh) * 16 + i] !=
                                    p.sf[(size_t)(hh ? rh : rg) * (p.K / 16) + kt * (BK / 16) + i];
                }
            }
        }
    }
    return bad;
}

// The kernels' arithmetic on the host, from the bytes a stage holds (the two bulk copies) to y's
// rows of tile t, under the fragment layouts PTX gives: A from registers as layout_mismatches
// reads it; B K-major through the descriptor (core matrix j along k at start + j lbo, token n at
// 16 n bytes in it); D's d0, d1 row g columns 2q, 2q + 1, d2, d3 row g + 8. Each wgmma is a sum
// in double. Checks the packing of x, the descriptors' offsets, the scales and the output's
// places; the hardware's reading of the same layouts is what the device run checks.
static void emulate_tile(const problem &p, int V, const std::vector<uint8_t> &w,
                         const std::vector<uint8_t> &x, int t, std::vector<double> &y) {
    const int nk = p.K / BK;
    const int XB = V == V_W4A8 ? X8_BYTES : V == V_W4A16H ? 2 * X16_BYTES : X16_BYTES;
    std::vector<uint8_t> st(W_BYTES + XB);
    double tot[128][4] = {};
    auto bval = [&](uint32_t start, uint32_t lbo, int kk, int n) -> double { // B(k, n)
        if (V == V_W4A8) {
            const int j = kk / 16, e = kk % 16;
            return fp8_e4m3_to_float(st[W_BYTES + start + j * lbo + n * 16 + e]);
        }
        const int j = kk / 8, e = kk % 8;
        uint16_t b;
        memcpy(&b, &st[W_BYTES + start + j * lbo + n * 16 + e * 2], 2);
        const uint32_t u = (uint32_t)b << 16;
        float f;
        memcpy(&f, &u, 4);
        return f;
    };
    for (int kt = 0; kt < nk; kt++) {
        memcpy(st.data(), w.data() + ((size_t)t * nk + kt) * W_BYTES, W_BYTES);
        memcpy(st.data() + W_BYTES, x.data() + (size_t)kt * XB, XB);
        // A's 64 rows of this stage, k 0..255, as the threads' registers hold them
        std::vector<std::array<double, BK>> A(BM);
        for (int tid = 0; tid < 128; tid++) {
            const int warp = tid / 32, g = (tid % 32) / 4, q = tid % 4;
            const int rg = warp * 16 + g, rh = rg + 8;
            uint32_t qw[16];
            uint8_t sgb[16], shb[16];
            for (int wi = 0; wi < 16; wi++)
                memcpy(&qw[wi], &st[((wi / 4) * 128 + tid) * 16 + (wi % 4) * 4], 4);
            memcpy(sgb, &st[CODE_BYTES + ((warp * 8 + g) * 2) * 16], 16);
            memcpy(shb, &st[CODE_BYTES + ((warp * 8 + g) * 2 + 1) * 16], 16);
            if (V != V_W4A8) {
                auto rotl = [](uint32_t v, int r) { return r ? v << r | v >> (32 - r) : v; };
                for (int k16 = 0; k16 < 16; k16++)
                    for (int j = 0; j < 4; j++) {
                        const uint32_t d = (rotl(qw[k16], wq_rot(j, false)) & WQ_MAG_MASK) |
                                           (rotl(qw[k16], wq_rot(j, true)) & WQ_SIGN_MASK);
                        for (int h = 0; h < 2; h++) {
                            const uint32_t bits = (d >> (16 * h) & 0xffffu) << 16;
                            float v;
                            memcpy(&v, &bits, 4);
                            const double sc = wq_sf_value(j & 1 ? shb[k16] : sgb[k16]);
                            // the bf16x2 product: code 2^-126 times scale 2^119, exact
                            A[j & 1 ? rh : rg][k16 * 16 + 2 * q + h + (j >= 2 ? 8 : 0)] =
                                (double)v * 0x1p126 * sc * 0x1p-7;
                        }
                    }
            } else {
                for (int k32 = 0; k32 < 8; k32++)
                    for (int hf = 0; hf < 2; hf++) {
                        const uint32_t regs[2] = {w8_first(qw[2 * k32 + hf]),
                                                  w8_second(qw[2 * k32 + hf])};
                        for (int j = 0; j < 2; j++)
                            for (int i = 0; i < 4; i++)
                                A[j ? rh : rg][k32 * 32 + hf * 16 + 4 * q + i] =
                                    fp8_e4m3_to_float((uint8_t)(regs[j] >> (8 * i)));
                    }
            }
        }
        for (int tid = 0; tid < 128; tid++) {
            const int warp = tid / 32, g = (tid % 32) / 4, c0 = 2 * (tid % 4);
            const int rows[4] = {warp * 16 + g, warp * 16 + g, warp * 16 + g + 8,
                                 warp * 16 + g + 8};
            const int cols[4] = {c0, c0 + 1, c0, c0 + 1};
            uint8_t sgb[16], shb[16];
            memcpy(sgb, &st[CODE_BYTES + ((warp * 8 + g) * 2) * 16], 16);
            memcpy(shb, &st[CODE_BYTES + ((warp * 8 + g) * 2 + 1) * 16], 16);
            if (V != V_W4A8) {
                for (int k16 = 0; k16 < 16; k16++) // the wg_bf16 of the step: hi, then (H) lo
                    for (int part = 0; part < (V == V_W4A16H ? 2 : 1); part++)
                        for (int o = 0; o < 4; o++)
                            for (int kk = 0; kk < 16; kk++)
                                tot[tid][o] += A[rows[o]][k16 * 16 + kk] *
                                               bval(part * X16_BYTES + w16_b_off(k16),
                                                    w16_b_lbo(k16), kk, cols[o]);
            } else {
                float sx[NT * 2];
                memcpy(sx, &st[W_BYTES + X8_SX], sizeof sx);
                for (int kb = 0; kb < 2; kb++) {
                    double blk[4] = {};
                    for (int k32 = 4 * kb; k32 < 4 * kb + 4; k32++) {
                        for (int o = 0; o < 4; o++) {
                            double p0 = 0, p1 = 0; // the two wgmma of the step, from zero
                            for (int kk = 0; kk < 32; kk++) {
                                const double a = A[rows[o]][k32 * 32 + kk];
                                p0 += a * bval(w8_b_off(k32, 0), w8_b_lbo(k32, 0), kk, cols[o]);
                                p1 += a * bval(w8_b_off(k32, 1), w8_b_lbo(k32, 1), kk, cols[o]);
                            }
                            const uint8_t *sb = o < 2 ? sgb : shb;
                            blk[o] += fp8_e4m3_to_float(sb[2 * k32]) * p0 +
                                      fp8_e4m3_to_float(sb[2 * k32 + 1]) * p1;
                        }
                    }
                    for (int o = 0; o < 4; o++)
                        tot[tid][o] += sx[cols[o] * 2 + kb] * blk[o];
                }
            }
        }
    }
    const double out_scale = p.s2 * (V == V_W4A8 ? 64.0 : 128.0);
    for (int tid = 0; tid < 128; tid++) {
        const int warp = tid / 32, g = (tid % 32) / 4, c0 = 2 * (tid % 4);
        const int r0 = t * BM + warp * 16 + g, r1 = r0 + 8;
        const int rr[4] = {r0, r0, r1, r1}, cc[4] = {c0, c0 + 1, c0, c0 + 1};
        for (int o = 0; o < 4; o++)
            if (cc[o] < p.T) y[(size_t)cc[o] * p.N + rr[o]] = tot[tid][o] * out_scale;
    }
}

static const char *vname(int V) {
    return V == V_STREAM ? "stream" : V == V_W4A16 ? "w4a16" : V == V_W4A8 ? "w4a8" : "w4a16h";
}

template <int V> static void set_smem(size_t smem) {
    CUDA_CHECK(cudaFuncSetAttribute(decode_kernel<V>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    (int)smem));
}
template <int V> static int resident(size_t smem) {
    int n = 0;
    CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, decode_kernel<V>, 160, smem));
    return n;
}

int main(int argc, char **argv) {
    int K = 7168, rows = 0, waves = 1, stages = 4, reps = 20, T = 8, layout_only = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--layout-check"))
            layout_only = 1;
        else if (!strcmp(argv[i], "--k") && i + 1 < argc)
            K = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--rows") && i + 1 < argc)
            rows = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--waves") && i + 1 < argc)
            waves = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--stages") && i + 1 < argc)
            stages = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--reps") && i + 1 < argc)
            reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--tokens") && i + 1 < argc)
            T = atoi(argv[++i]);
        else {
            fprintf(stderr,
                    "usage: %s [--k K] [--rows N] [--waves W] [--stages S] [--reps R] "
                    "[--tokens T] [--layout-check]\n",
                    argv[0]);
            return 2;
        }
    }
    if (K % BK || K < BK || stages < 2 || stages > 16 || T < 1 || T > NT || rows % BM) {
        fprintf(stderr,
                "bench_nvfp4_decode: K a multiple of %d, 2 to 16 stages, 1 to %d tokens, "
                "rows a multiple of %d\n",
                BK, NT, BM);
        return 2;
    }
    if (layout_only) { // the host's half alone (no device): both layouts of a few tiles
        problem p;
        make_problem(&p, 4 * BM, K, T);
        long bad = 0;
        std::vector<uint8_t> xq((size_t)T * K);
        std::vector<float> sxq((size_t)T * (K / 128)), x8((size_t)T * K), x16(p.x.size());
        quant_fp8_rows(xq.data(), sxq.data(), p.x.data(), T, K);
        dequant_fp8_rows(x8.data(), xq.data(), sxq.data(), T, K);
        for (size_t i = 0; i < x16.size(); i++)
            x16[i] = bf16_round(p.x[i]);
        int fails = 0;
        for (int V : {V_W4A16, V_W4A8, V_W4A16H}) {
            const std::vector<uint8_t> w = pack_w(p, V), x = pack_x(p, V, xq, sxq);
            for (int t = 0; t < 4; t++)
                bad += layout_mismatches(p, V == V_W4A8 ? V_W4A8 : V_W4A16, w, t);
            std::vector<double> y((size_t)T * p.N, 0.0);
            for (int t = 0; t < 4; t++)
                emulate_tile(p, V, w, x, t, y);
            const std::vector<double> ref = reference(p, V == V_W4A8     ? x8
                                                         : V == V_W4A16H ? p.x
                                                                         : x16);
            double num = 0, den = 0;
            for (size_t i = 0; i < y.size(); i++) {
                if (!checked((int)(i % p.N))) continue;
                num = std::max(num, std::fabs(y[i] - ref[i]));
                den = std::max(den, std::fabs(ref[i]));
            }
            printf("%s emulated on the host, tile 0: max rel err %.2e\n", vname(V), num / den);
            // x8's products are rounded to float in the reference; hi + lo is x within 2^-16
            fails += !(num / den < (V == V_W4A16H ? 1e-4 : 1e-6));
        }
        printf("layouts of 4 tiles x %d k: %ld values differ from their codes\n", K, bad);
        return bad != 0 || fails;
    }
    int dev = 0, sms = 0, cc = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    CUDA_CHECK(cudaDeviceGetAttribute(&cc, cudaDevAttrComputeCapabilityMajor, dev));
    if (cc != 9) {
        fprintf(stderr, "bench_nvfp4_decode: needs a Hopper device (compute capability 9.x)\n");
        return 1;
    }
    // each kernel's shared memory and blocks an SM (the stream kernel reads w4a16's stages)
    const size_t smem[4] = {(size_t)stages * stage_bytes<V_W4A16>() + 128,
                            (size_t)stages * stage_bytes<V_W4A16>() + 128,
                            (size_t)stages * stage_bytes<V_W4A8>() + 128,
                            (size_t)stages * stage_bytes<V_W4A16H>() + 128};
    set_smem<V_STREAM>(smem[V_STREAM]);
    set_smem<V_W4A16>(smem[V_W4A16]);
    set_smem<V_W4A8>(smem[V_W4A8]);
    set_smem<V_W4A16H>(smem[V_W4A16H]);
    const int res[4] = {resident<V_STREAM>(smem[0]), resident<V_W4A16>(smem[1]),
                        resident<V_W4A8>(smem[2]), resident<V_W4A16H>(smem[3])};
    if (!rows) { // every block of every kernel the same number of tiles
        int l = 1;
        for (int V = 0; V < 4; V++) {
            int m = l;
            while (m % res[V])
                m += l;
            l = m;
        }
        rows = waves * sms * l * BM;
    }
    problem p;
    make_problem(&p, rows, K, T);
    for (int V : {V_W4A16, V_W4A8}) { // tile 0's layout, as the host reads it
        const long bad = layout_mismatches(p, V, pack_w(p, V), 0);
        if (bad) {
            fprintf(stderr, "bench_nvfp4_decode: %ld values of layout %d differ\n", bad, V);
            return 1;
        }
    }
    std::vector<uint8_t> xq((size_t)T * K);
    std::vector<float> sxq((size_t)T * (K / 128)), x8((size_t)T * K), x16(p.x.size());
    quant_fp8_rows(xq.data(), sxq.data(), p.x.data(), T, K);
    dequant_fp8_rows(x8.data(), xq.data(), sxq.data(), T, K);
    for (size_t i = 0; i < x16.size(); i++)
        x16[i] = bf16_round(p.x[i]);
    const std::vector<double> ref16 = reference(p, x16), ref8 = reference(p, x8),
                              ref32 = reference(p, p.x);

    const double wbytes = (double)p.N * K * 0.5 + (double)p.N * (K / 16);
    void *src = NULL, *dst = NULL;
    const size_t copy_bytes = (size_t)1 << 30;
    CUDA_CHECK(cudaMalloc(&src, copy_bytes));
    CUDA_CHECK(cudaMalloc(&dst, copy_bytes));
    CUDA_CHECK(cudaMemset(src, 1, copy_bytes));
    const double copy = copy_rate(dst, src, copy_bytes, reps, nullptr);
    CUDA_CHECK(cudaFree(src));
    CUDA_CHECK(cudaFree(dst));
    printf("device copy of 1 GiB: %.0f GB/s (read + write)\n", copy);
    printf("w: %d x %d NVFP4 (%.1f MB of codes and scales), %d token(s), %d stages; blocks an SM: "
           "stream %d, w4a16 %d, w4a8 %d, w4a16h %d\n",
           p.N, K, wbytes / 1e6, T, stages, res[0], res[1], res[2], res[3]);
    printf("%-8s %10s %9s %8s %12s %s\n", "kernel", "us", "GB/s", "of copy", "max rel err",
           "(against)");

    float *y = NULL;
    uint8_t *dw = NULL, *dx = NULL;
    CUDA_CHECK(cudaMalloc(&y, (size_t)T * p.N * sizeof(float)));
    std::vector<uint8_t> hw, hx;
    for (int V : {V_STREAM, V_W4A16, V_W4A16H, V_W4A8}) {
        // w4a16's codes and scales serve the stream kernel and w4a16h too; x's slices per kernel
        if (V == V_STREAM || V == V_W4A8) hw = pack_w(p, V);
        hx = pack_x(p, V == V_STREAM ? V_W4A16 : V, xq, sxq);
        CUDA_CHECK(cudaMalloc(&dw, hw.size()));
        CUDA_CHECK(cudaMalloc(&dx, hx.size()));
        CUDA_CHECK(cudaMemcpy(dw, hw.data(), hw.size(), cudaMemcpyHostToDevice));
        CUDA_CHECK(cudaMemcpy(dx, hx.data(), hx.size(), cudaMemcpyHostToDevice));
        CUDA_CHECK(cudaMemset(y, 0, (size_t)T * p.N * sizeof(float)));
        bench_args a = {};
        a.w = dw, a.x = dx, a.y = y, a.tiles = p.N / BM, a.nk = K / BK, a.T = T, a.N = p.N;
        a.stages = stages;
        // w4a16's products carry 2^-7 (gemm_common.cuh's WQ_SF_EXP), w4a8's codes 2^-6
        a.out_scale = p.s2 * (V == V_W4A8 ? 64.0f : 128.0f);
        const unsigned grid = (unsigned)std::min(a.tiles, sms * res[V]);
        const double us = median_ms(reps,
                                    [&] {
                                        switch (V) {
                                        case V_STREAM:
                                            decode_kernel<V_STREAM><<<grid, 160, smem[V]>>>(a);
                                            break;
                                        case V_W4A16:
                                            decode_kernel<V_W4A16><<<grid, 160, smem[V]>>>(a);
                                            break;
                                        case V_W4A8:
                                            decode_kernel<V_W4A8><<<grid, 160, smem[V]>>>(a);
                                            break;
                                        default:
                                            decode_kernel<V_W4A16H><<<grid, 160, smem[V]>>>(a);
                                            break;
                                        }
                                        CUDA_CHECK(cudaGetLastError());
                                    }) *
                          1e3;
        const double gbs = wbytes / (us * 1e-6) / 1e9;
        if (V == V_STREAM) {
            printf("%-8s %10.1f %9.0f %7.1f%%\n", vname(V), us, gbs, 100.0 * gbs / copy);
        } else {
            std::vector<float> hy((size_t)T * p.N);
            CUDA_CHECK(cudaMemcpy(hy.data(), y, hy.size() * sizeof(float), cudaMemcpyDeviceToHost));
            const std::vector<double> &ref = V == V_W4A8 ? ref8 : V == V_W4A16H ? ref32 : ref16;
            const double e = rel_err(hy, ref, p.N);
            printf("%-8s %10.1f %9.0f %7.1f%% %12.2e (x %s)", vname(V), us, gbs, 100.0 * gbs / copy,
                   e,
                   V == V_W4A8     ? "in E4M3"
                   : V == V_W4A16H ? "in fp32"
                                   : "in BF16");
            if (V != V_W4A16H) printf("; %.2e against x in fp32", rel_err(hy, ref32, p.N));
            // w4a8: the FP8 tensor cores sum a group's 16 products with fewer bits than fp32
            printf("%s\n", e < (V == V_W4A8 ? 1e-3 : 1e-4) ? "" : "  FAIL");
        }
        CUDA_CHECK(cudaFree(dw));
        CUDA_CHECK(cudaFree(dx));
    }
    CUDA_CHECK(cudaFree(y));
    return 0;
}
