// Device helpers shared by the grouped GEMMs (moe.cu, moe_lean.cu, fp8_gemm.cu, bf16_gemm.cu):
// cp.async copies into shared memory, a pair of fp32 values as BF16, high precision's hi + lo
// split of them, the experts' SiLU, the decode of NVFP4 weights, and the tiny path's grouping. The
// same functions in both files keep the gate and up products' BF16 outputs the same bits whichever
// kernel computed them.
#ifndef MOESERVE_KERNELS_CUDA_GEMM_COMMON_CUH
#define MOESERVE_KERNELS_CUDA_GEMM_COMMON_CUH

#include <cuda_bf16.h>

#include <cstdint>

// 16 bytes (src_bytes of them, the rest zeros) from global memory to shared address saddr, L2 only;
// and 4 bytes through L1.
__device__ __forceinline__ void cp_async16(uint32_t saddr, const void *g, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(saddr), "l"(g),
                 "r"(src_bytes));
}
__device__ __forceinline__ void cp_async4(uint32_t saddr, const void *g, int src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(saddr), "l"(g),
                 "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// all but the newest N groups of this thread's copies complete
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

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
// Eight activations (p then q) as BF16 in one 16-byte chunk: rounded, or split into hi and lo
// (the prepare kernel's conversion, and every kernel that converts x itself)
__device__ __forceinline__ uint4 pack_bf16x8(const float4 &p, const float4 &q) {
    return make_uint4(pack_bf16x2(p.x, p.y), pack_bf16x2(p.z, p.w), pack_bf16x2(q.x, q.y),
                      pack_bf16x2(q.z, q.w));
}
__device__ __forceinline__ void split_bf16x8(const float4 &p, const float4 &q, uint4 *hi,
                                             uint4 *lo) {
    split_bf16x2(p.x, p.y, &hi->x, &lo->x);
    split_bf16x2(p.z, p.w, &hi->y, &lo->y);
    split_bf16x2(q.x, q.y, &hi->z, &lo->z);
    split_bf16x2(q.z, q.w, &hi->w, &lo->w);
}

// silu(g) = g / (1 + e^-g), the division by the approximate reciprocal (__fdividef: 2 ulp, no
// branch): the IEEE division's check for its slow path put a branch around every output, so a
// GEMM's epilogue ran its silu one at a time (the swapped kernel's GEMM 1: 35 instructions an
// output behind convergence barriers, while its weights' stream waited). Every GPU kernel of the
// experts takes this one, so their h is the same bits whichever computes it; the CPU's
// (kernels/cpu) differs from it within the tests' tolerances.
__device__ __forceinline__ float silu(float g) { return __fdividef(g, 1.0f + expf(-g)); }

// NVFP4 weights in the W4A16 layout (moe.cu's nvfp4_pack_kernel), decoded as both moe.cu's tiles
// and bf16_gemm.cu's converters decode them, so both see the same BF16 weights.
// A group scale byte c stands for the BF16 bits (c << 4) + WQ_SF_BIAS: the scale times 2^119.
#define WQ_SF_BIAS 0x7600u /* 236 << 7: c = 8 is 2^-9 2^119 */
#define WQ_SF_EXP  119     /* the decoded weights carry 2^-126 2^119: the tensor scale 2^7 */
// Fragment register j (0..3) of a packed code word as two BF16 values: the E2M1 codes s e1 e0 m
// of its two halves become s at bits 15 and 31, e1 e0 m at bits 8..6 and 24..22, BF16 bits whose
// value is e2m1 2^-126 (0.5 a subnormal), exactly. moe.cu's nvfp4_pack_kernel puts each code's
// bits where a left rotation of the word by wq_rot(j, false) brings its magnitude and one by
// wq_rot(j, true) its sign (wq_code_pos): register 0 takes a mask, 2 a rotation and a mask, 1 and
// 3 two rotations and two masks; 11 instructions a word, where codes as nibbles at 4-bit steps
// took 15; scripts/nvfp4_code_layout.py finds none cheaper by exhaustive search, and checks the
// layout against the nibbles. Four of the five rotations are shifts under their masks
// (wq_rotl_masked), so that 7 of the 11 are ALU instructions and 4 go to the FMA pipe.
#define WQ_MAG_MASK  0x01C001C0u
#define WQ_SIGN_MASK 0x80008000u
__device__ __host__ constexpr int wq_rot(int j, bool sign) {
    return j == 0 ? 0 : j == 1 ? (sign ? 1 : 3) : j == 2 ? 6 : (sign ? 5 : 11);
}
// bit b (0 m, 1 e0, 2 e1, 3 s) of half h's code of register j: its position in the packed word
__device__ __host__ constexpr int wq_code_pos(int j, int h, int b) {
    return ((b == 3 ? 15 : 6 + b) + 16 * h - wq_rot(j, b == 3)) & 31;
}
// One row's 64 k in the W4A16 layout (moe.cu's nvfp4_pack_kernel, and the host checks that
// follow it): in, the codes as nibbles (k's at bits 4 (k % 8) of word k / 8); zero[s], group s's
// scale is zero (its codes become +0). Lane t of a quad takes the mma B fragment's k 16 s + 2 t +
// {0, 1} (b0) and 16 s + 8 + 2 t + {0, 1} (b1) of k16 step s: its 16 codes become out[2 t] and
// out[2 t + 1], word w holding steps 2 w and 2 w + 1 as registers j = 2 (s - 2 w) + b, each
// code's even k in the low half, each bit where wq_code_pos puts it.
__host__ __device__ __forceinline__ void wq_pack_chunk(uint32_t out[8], const uint32_t in[8],
                                                       const bool zero[4]) {
    for (int i = 0; i < 8; i++)
        out[i] = 0;
    for (int t = 0; t < 4; t++)
        for (int w = 0; w < 2; w++)
            for (int j = 0; j < 4; j++)
                for (int l = 0; l < 2; l++) {
                    const int s = 2 * w + j / 2, k = 16 * s + 8 * (j % 2) + 2 * t + l;
                    const uint32_t nib = zero[s] ? 0u : (in[k / 8] >> (4 * (k % 8))) & 15u;
                    for (int b = 0; b < 4; b++)
                        out[2 * t + w] |= ((nib >> b) & 1u) << wq_code_pos(j, l, b);
                }
}
// A rotation whose wrapped bits (the lowest r) miss the masks is a plain left shift under them,
// which the compiler may place on the FMA pipe (IMAD.SHL) rather than the ALU's; only register
// 3's magnitude (a rotation by 11, whose wrapped bits land at 6..8) needs the funnel shift.
__device__ __forceinline__ uint32_t wq_rotl_masked(uint32_t q, int r) {
    return r == 0 ? q : r <= 6 ? q << r : __funnelshift_l(q, q, r);
}
__device__ __forceinline__ uint32_t wq_decode(uint32_t q, int j) {
    const int rm = wq_rot(j, false), rs = wq_rot(j, true);
    const uint32_t m = wq_rotl_masked(q, rm);
    if (rm == rs) return m & (WQ_MAG_MASK | WQ_SIGN_MASK);
    return (m & WQ_MAG_MASK) | (wq_rotl_masked(q, rs) & WQ_SIGN_MASK);
}
__device__ __forceinline__ uint32_t bf16x2_mul(uint32_t x, uint32_t y) {
    uint32_t d;
    asm("mul.rn.bf16x2 %0, %1, %2;\n" : "=r"(d) : "r"(x), "r"(y));
    return d;
}
// group g's (0..3) scale of a word of four scale bytes, in both halves as BF16 bits
__device__ __forceinline__ uint32_t wq_scale2(uint32_t scales, int g) {
    return __byte_perm(scales, 0, 0x4040 + g * 0x0101) * 16u + (WQ_SF_BIAS | WQ_SF_BIAS << 16);
}

// The tiny path's grouping, by warp 0 of a block from topk_ids[n] (n <= 32) alone: tiles are the
// busy experts in order of their first pair, each cut into chunks of R rows; a tile's rows are its
// expert's pairs in (t, k) order. Writes s_tile = {expert, rows} of tile `tile` ({-1, 0} past the
// last tile), s_pair[r] = the pair id of row r and s_tok[r] its token (pair / topk: one
// division a lane here, not one a chunk of x in each thread). The same function in GEMM 1 and
// GEMM 2 (with their R) gives each the same pairs; h rows are addressed by pair id, so the two
// need not agree on tiles. (moe_lean.cu's TINY kernels group the same way, with h rows by pair id
// too.)
__device__ inline void tiny_group(const int32_t *topk_ids, int n, int E, int R, int topk, int tile,
                                  int *s_tile, int *s_pair, int *s_tok) {
    const int lane = threadIdx.x & 31;
    const unsigned full = 0xffffffffu;
    const int id = lane < n ? __ldcg(&topk_ids[lane]) : -1;
    if (id >= E) __trap(); // broken invariant: ids index the local experts
    const unsigned same = __match_any_sync(full, id);
    const bool leader = id >= 0 && __ffs(same) - 1 == lane;
    const int nch = leader ? (unsigned)(__popc(same) + R - 1) / R : 0;
    int incl = nch;
    for (int o = 1; o < 32; o <<= 1) {
        const int v = __shfl_up_sync(full, incl, o);
        if (lane >= o) incl += v;
    }
    const int base = incl - nch;
    const unsigned hit = __ballot_sync(full, leader && tile >= base && tile < base + nch);
    if (!hit) {
        if (lane == 0) s_tile[0] = -1, s_tile[1] = 0;
        return;
    }
    const int L = __ffs(hit) - 1;
    const unsigned mask = __shfl_sync(full, same, L);
    const int e = __shfl_sync(full, id, L);
    const int first = (tile - __shfl_sync(full, base, L)) * R;
    if ((mask >> lane) & 1u) {
        const int rank = __popc(mask & ((1u << lane) - 1u));
        if (rank >= first && rank < first + R) {
            s_pair[rank - first] = lane;
            s_tok[rank - first] = (unsigned)lane / topk;
        }
    }
    if (lane == 0) s_tile[0] = e, s_tile[1] = min(R, __popc(mask) - first);
}

#endif
