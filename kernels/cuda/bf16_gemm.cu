// BF16 grouped GEMM on Hopper's tensor cores (wgmma, sm_90a): the routed experts' two GEMMs at
// prefill sizes, in place of moe.cu's mma.sync tiles there (bf16_gemm.h says when).
//
// The same inputs as moe.cu's grouped path: x in BF16 (high: and its lo part), the pairs grouped
// by expert (offsets [E + 1] on the device), the experts' BF16 weights gate_up [E, 2F, D] and down
// [E, D, F]. GEMM 1 writes h = silu(x gate^T) * (x up^T) in BF16 in grouped row order (high: h's
// lo part after it), GEMM 2 writes each grouped row's D sums in fp32 to out's row of its pair.
// GEMM 2's form also runs deterministic mode's dense linears at prefill sizes (moe.cu's
// cuda_linear_bi, bf16_wgmma_linear): one expert, K cut into the weight's fixed ranges, each
// range's sums from zero into a scratch that moe.cu then adds in range order.
//
// The sums. Medium precision: each output sums its k16 products in increasing k into one fp32
// accumulator from zero, one wgmma m64nNk16 a k16 step. A wgmma k16 step gives the same bits as
// an mma.sync m16n8k16 on the same operands and accumulator (checked on the H200 over chains of
// 64 and 2048 k with wide exponent ranges and cancellations, 140 cases, every output equal; the
// test checks it through the experts), so these are moe.cu's sums bit for bit and a token's rows
// stay the same at any batch size, deterministic mode included. High precision: each k16 step's
// hi products then its lo products into the one accumulator (two wgmma), one chain (moe.cu's
// header says what that costs in truncation), and moe.cu's tiles sum the same way below this
// kernel's sizes (moe_tile_cfg's ONE; bf16_wgmma_one_chain: always in deterministic mode, and
// outside it unless MOESERVE_ONE_CHAIN=0, which puts back the tiles' fp32 add of the lo product,
// a wait on every step that wgmma cannot afford), so a token's rows do not depend on the batch's
// size. Until 2026-12-03 the hi and lo products ran in two chains added at the end: twice the
// accumulators, so high's tiles had 128 columns, half of medium's, and read x's rows twice as
// often.
//
// Shape: a block is a persistent producer warp (TMA) and two consumer warpgroups of 64 rows each
// on tiles of 128 rows x BN columns (BN 256; W8's 128, beside its scaled totals), a ring of stages
// of 64 k (one 128-byte swizzled row per tile row, hopper.cuh's layout), each stage's A tile (high:
// its hi and lo tiles) and B tile copied by TMA, A's two 64-row halves apart and only where the
// expert has rows. A half of 1 to 32 rows (bwg_short_half) is copied in boxes of 16 rows and
// multiplied with the operands swapped, so that it costs its rows rounded up to 16 rather than 64.
// Tried on the H200 and not kept: clusters of 2 or 4 blocks on neighbouring n-blocks of the same
// rows, each copying a share of A's rows into all of them by TMA multicast (A's reads from L2
// divided by the cluster's size; Qwen3-30B-A3B's experts at 64 pairs an expert in high 519.7 /
// 553.4 us against 488.9 without: every block waits for the slowest of its cluster before a stage
// is refilled). A consumer issues a stage's four wgmma k16 steps, commits, and frees the stage
// before it once those have completed (wait_group 1), so the tensor cores always hold a stage's
// work. GATE_UP: the B tile's first BN / 2 rows are gate rows and its last BN / 2 the matching up
// rows, so a thread holds the gate and the up sum of the same h element (n8 groups j and j + BN /
// 16). A's rows must be in grouped order for the TMA (it cannot gather): GEMM 1 first copies x's
// BF16 rows into grouped order (bwg_gather_kernel; the swapped kernel below may copy them
// itself); GEMM 2's A is h, grouped already. The copy
// costs what its bytes do (H200, Qwen3-30B-A3B at T = 2048, high: 48 us at 3.2 TB/s, beside 459 us
// for GEMM 1, ncu). Gathering the rows in GEMM 1 instead, one TMA a row (a box of one 128-byte row
// at its place in the swizzled tile: correct, the swizzle follows the shared address), made
// GEMM 1 ten times slower (4.2 ms): TMA wants few large boxes.
//
// NVFP4 experts (W4A16; bf16_gemm.h's bf16_wgmma_w4_takes): the same kernel with two or three
// more warps (BWG_CW) that write each stage's B tile themselves, decoding the weights' codes and
// group scales (moe.cu's nvfp4_pack_kernel layout, cp.async two k tiles ahead into their own
// staging) into BF16 with moe.cu's own decode (exact: e2m1 x e4m3 fits BF16), so the tensor cores
// see the W4A16 tiles' weights; the epilogues multiply by the tensor scales as the tiles' do.
// Medium's sums are the tiles' bit for bit, high's two chains (the tiles' NVFP4 sums are one
// chain). H200, Qwen3-30B-A3B's experts (test_cuda_moe --nvfp4, medium / high): T = 2048 681 /
// 976 us against the tiles' 963 / 1556, T = 4096 980 / 1478 against 1375 / 2321, but T = 1024
// (64 pairs an expert) 445 / 641 against 410 / 722; BF16's experts on this kernel take 701 / 1162
// us at T = 4096, so the converter warps are what bounds it (three of them in medium were 1.1 to
// 1.2 times as fast as two; a fourth does not fit the registers without setmaxnreg).
//
// FP8 experts (W8A16, high precision only; bf16_gemm.h's bf16_wgmma_w8_takes): the same
// converters on moe.cu's W8A16 codes (fp8_pack_kernel's layout, fp8_w8_decode times 2^120:
// e4m3 exactly in BF16), two warps. A weight row's block scale (one a 128-k block) cannot go into
// its BF16 weights exactly, so it goes on the sums, as the W8A16 tiles do it: each 128-k block's
// hi and lo products run into one accumulator from zero (acc; a block is 16 k16 steps, so the
// tensor cores' truncation stays near 2^-19 of its sum), and at the block's end, after the wait,
// acl (the totals) += scale x acc, with one scale a 64-row half of the tile (the halves lie in one
// 128 x 128 block: bwg_convert copies its pair into the stage). H200, Qwen3-30B-A3B's experts
// (test_cuda_moe --fp8, high): T = 2048 1100.8 us against the tiles' 1244.9, T = 4096 1642.1
// against 2150.9; a model's prefill of 1 / 8 x 2048 tokens 11092 / 11743 tokens/s against 10458 /
// 11104 on the tiles.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "common/log.h"
#include "kernels/cuda/bf16_gemm.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/gemm_common.cuh"
#include "kernels/cuda/hopper.cuh"
#include "kernels/quant.h"

#define BWG_BM      128 /* rows of a tile: two consumer warpgroups of 64 */
#define BWG_BK      64  /* k of a stage: 128 bytes of BF16 */
#define BWG_THREADS 288 /* two consumer warpgroups and the producer warp */
#define BWG_THREADS_W4(CW) (BWG_THREADS + 32 * (CW)) /* W4: and CW converter warps */
// W4's converter warps by the B tile's rows: three write 256 rows 1.1 to 1.2 times as fast as two
// (H200, Qwen3-30B-A3B's experts in medium, test_cuda_moe --nvfp4: T = 2048 681 us against 764, T
// = 4096 980 against 1104); 128 rows (high's tiles until its sums took one chain) three warps
// share unevenly (T = 2048 1018 us against 976). Four would need more registers than 416 threads
// leave a consumer.
#define BWG_CW(BN) ((BN) == 256 ? 3 : 2)
#define BWG_CS     3 /* W4: the converters' staging slots (codes requested two k tiles ahead) */

// The tile configuration of a precision and weight format: columns, stages (each A tile 16 KiB,
// high two, and a B tile of BN rows of 128 bytes; 192 KiB of stages either way). BN 256 but in
// W8, whose scaled totals (a second set of accumulators) keep it at 128: high's hi and lo
// products share one accumulator (moe.cu's header), so high has medium's columns and one stage
// less for its lo tiles.
template <bool SPLIT, int WQ = 0> struct bwg_cfg {
    static constexpr int BN = WQ == 8 ? 128 : 256;
    static constexpr int A_PARTS = SPLIT ? 2 : 1;
    static constexpr int A_BYTES = BWG_BM * 128, B_BYTES = BN * 128;
    static constexpr int STAGE_BYTES = A_PARTS * A_BYTES + B_BYTES;
    static constexpr int STAGES = SPLIT && BN == 256 ? 3 : 4;
    static constexpr size_t smem = (size_t)STAGES * STAGE_BYTES + 1024; // + alignment
    // W4: the converters' staging, after the stages: codes [BWG_CS][BN][32], scales [BWG_CS][BN][4]
    static constexpr size_t W4_CODES = (size_t)BWG_CS * BN * 32,
                            W4_SCALES = (size_t)BWG_CS * BN * 4;
    static constexpr size_t smem_w4 = smem + W4_CODES + W4_SCALES;
    // W8 (high only): codes [BWG_CS][BN][64], the two 64-row halves' block scales [BWG_CS][2] as
    // requested, then as a stage carries them [STAGES][2]
    static constexpr size_t W8_CODES = (size_t)BWG_CS * BN * 64, W8_SCALES = BWG_CS * 8;
    static constexpr size_t smem_w8 = smem + W8_CODES + W8_SCALES + STAGES * 8;
    static constexpr size_t smem_wq(int wq) { return wq == 8 ? smem_w8 : wq == 4 ? smem_w4 : smem; }
    static_assert(smem_wq(WQ) <= 227 * 1024, "shared memory of one block");
};

// d += A[64 x 16] B[N x 16]^T, fp32 accumulators in the m64nN fragment layout (scale-d 1: the
// accumulators start at zero in registers, so the first step adds to +0 as mma.sync's does).
template <int N>
__device__ __forceinline__ void bwg_wgmma(float (&d)[N / 2], uint64_t da, uint64_t db);
template <>
__device__ __forceinline__ void bwg_wgmma<128>(float (&d)[64], uint64_t da, uint64_t db) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" WGMMA_D64_STR "}, "
                 "%64, %65, 1, 1, 1, 0, 0;\n"
                 : WGMMA_D64_OUT(d)
                 : "l"(da), "l"(db));
}

template <>
__device__ __forceinline__ void bwg_wgmma<256>(float (&d)[128], uint64_t da, uint64_t db) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {" WGMMA_D128_STR "}, "
                 "%128, %129, 1, 1, 1, 0, 0;\n"
                 : WGMMA_D128_OUT(d)
                 : "l"(da), "l"(db));
}

#define BWS_D8_STR "%0, %1, %2, %3, %4, %5, %6, %7"
#define BWS_D8_OUT(d)                                                                              \
    "+f"((d)[0]), "+f"((d)[1]), "+f"((d)[2]), "+f"((d)[3]), "+f"((d)[4]), "+f"((d)[5]),            \
        "+f"((d)[6]), "+f"((d)[7])
#define BWS_D16_STR    BWS_D8_STR ", %8, %9, %10, %11, %12, %13, %14, %15"
#define BWS_D16_OUT(d) BWS_D8_OUT(d), BWS_D8_OUT((d) + 8)
#define BWS_D24_STR    BWS_D16_STR ", %16, %17, %18, %19, %20, %21, %22, %23"
#define BWS_D24_OUT(d) BWS_D16_OUT(d), BWS_D8_OUT((d) + 16)
#define BWS_D48_STR                                                                                \
    WGMMA_D32_STR ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, "  \
                  "%47"
#define BWS_D48_OUT(d) WGMMA_D32_OUT(d), BWS_D16_OUT((d) + 32)
#define BWS_D40_STR    WGMMA_D32_STR ", %32, %33, %34, %35, %36, %37, %38, %39"
#define BWS_D40_OUT(d) WGMMA_D32_OUT(d), BWS_D8_OUT((d) + 32)
#define BWS_D80_STR                                                                                \
    WGMMA_D64_STR ", %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, "  \
                  "%79"
#define BWS_D80_OUT(d) WGMMA_D64_OUT(d), BWS_D16_OUT((d) + 64)
// d += A[64 x 16] B[N x 16]^T, B a few grouped rows (16 to 80, twice that in high) and A 64 weight
// rows (the swapped kernel, and the grouped kernel's short halves)
#define BWS_WGMMA(N, DSTR, DOUT, DA, DB)                                                           \
    template <>                                                                                    \
    __device__ __forceinline__ void bws_wgmma<N>(float(&d)[N / 2], uint64_t da, uint64_t db) {     \
        asm volatile("wgmma.mma_async.sync.aligned.m64n" #N "k16.f32.bf16.bf16 {" DSTR "}, "       \
                     "%" #DA ", %" #DB ", 1, 1, 1, 0, 0;\n"                                        \
                     : DOUT(d)                                                                     \
                     : "l"(da), "l"(db));                                                          \
    }
template <int N>
__device__ __forceinline__ void bws_wgmma(float (&d)[N / 2], uint64_t da, uint64_t db);
BWS_WGMMA(16, BWS_D8_STR, BWS_D8_OUT, 8, 9)
BWS_WGMMA(32, BWS_D16_STR, BWS_D16_OUT, 16, 17)
BWS_WGMMA(48, BWS_D24_STR, BWS_D24_OUT, 24, 25)
BWS_WGMMA(64, WGMMA_D32_STR, WGMMA_D32_OUT, 32, 33)
BWS_WGMMA(96, BWS_D48_STR, BWS_D48_OUT, 48, 49)
BWS_WGMMA(128, WGMMA_D64_STR, WGMMA_D64_OUT, 64, 65)
BWS_WGMMA(80, BWS_D40_STR, BWS_D40_OUT, 40, 41)
BWS_WGMMA(160, BWS_D80_STR, BWS_D80_OUT, 80, 81)

// The kernel's arguments. Grouped row m (expert e: offsets[e] <= m < offsets[e + 1]) reads A's row
// m (high: and row a_lo + m, its lo part) and expert e's B rows (b [E, N, K]: GATE_UP's N = 2F,
// F gate rows then F up rows). GATE_UP writes h [*, N / 2] BF16 in grouped order (high: the lo
// parts from h + h_lo); otherwise out's row pairs[m] gets the N sums in fp32.
typedef struct {
    float *out;
    __nv_bfloat16 *h;
    int64_t h_lo;
    const int32_t *pairs;
    const int32_t *offsets;
    int a_lo;
    int E, N, K;
    // K cut into S ranges of nks k tiles, each summed from zero into part + s * part_stride (rows
    // as out's); S 1: all of K into out (cuda_linear_bi's ranges, moe.cu)
    int S, nks;
    float *part;
    int64_t part_stride;
    // W4: B as NVFP4 in moe.cu's W4A16 layout (nvfp4_pack_kernel): codes wq [E N, K / 2], scales
    // wsf [E N, K / 16], and the experts' tensor scales ws2 [E, 3] (gate, up, down; times 2^7).
    // W8: B as FP8 in moe.cu's W8A16 layout (fp8_pack_kernel): codes wq [E N, K], fp32 block
    // scales wsf [E, ceil(K / 128), N] a weight row each (equal over aligned groups of 64 rows)
    const uint8_t *wq, *wsf;
    const float *ws2;
    // a 64-row half of a tile with 1 to tail rows takes them as wgmma's B, the weights as A (the
    // grouped kernel's short halves, below; 0: never)
    int tail;
    // the swapped kernel's GEMM 1 with GATHER: grouped row m's A row is token pairs[m] / topk's
    // row of xb [parts T, K] (high: its lo part T rows on), copied by the kernel itself
    const __nv_bfloat16 *xb;
    int T, topk;
    int pre; // the swapped kernel: k tiles of its first tile's weights requested before its wait
} bwg_args;

// The CW converter warps (W4 and W8; the kernel's warps 9 on): ct = the thread among them, rows
// ct + 32 CW i of each B tile (the last ones fewer where 32 CW does not divide BN). The tiles and k
// tiles in the kernel's order (it: the k tiles so far, as the other roles count them). Staging
// slot it % BWG_CS holds k tile it's codes (and W4: group scales) of the thread's rows; the
// requests run two k tiles ahead within a tile.
// W4: a row's 64 k of a k tile, as nvfp4_pack_kernel stores them: code word 2t + w holds quad
// lane t's fragments of k16 steps 2w and 2w + 1, so the 16-byte chunk c of the BF16 row (k 8c ..
// 8c + 7) is, for t = 0..3, word 2t + c / 4's fragment register c % 4 times group c / 2's scale.
// W8: as fp8_pack_kernel stores them (kernels/quant.h), word 4t + s holds quad lane t's codes of
// k16 step s, so chunk c is, for t = 0..3, fp8_w8_decode of word 4t + c / 2, register c % 2, times
// 2^120 (exact). Thread 0 also requests the two 64-row halves' scales of the k tile's 128-k block
// and, once the tile is written, copies them into the stage's pair (the consumers' fold reads it).
template <class C, bool GATE_UP, int CW, int WQ>
__device__ void bwg_convert(const bwg_args &p, int nx, uint32_t staging, uint32_t b0,
                            int stage_bytes, uint32_t full0, uint32_t empty0) {
    constexpr bool W8 = WQ == 8;
    constexpr int CT = 32 * CW, BN = C::BN, RPT = (BN + CT - 1) / CT, STAGES = C::STAGES;
    constexpr int QB = W8 ? 64 : 32; // code bytes of a row's k tile
    const int ct = threadIdx.x - 9 * 32, lane = threadIdx.x & 31;
    const int N = p.N, nkb = p.K / BWG_BK, S = p.S, n_cols = GATE_UP ? BN / 2 : BN;
    const uint32_t st_codes = staging,
                   st_scales = staging + (uint32_t)(W8 ? C::W8_CODES : C::W4_CODES);
    const uint32_t stage_sc = staging + (uint32_t)(C::W8_CODES + C::W8_SCALES); // W8: [STAGES][2]
    const int64_t qrow = W8 ? p.K : p.K / 2, srow = p.K / 16; // a weight row's code, scale bytes
    const int n128 = (p.K + 127) / 128;                       // W8: 128-k blocks of a row
    int it = 0;
    for (int t = blockIdx.x;; t += gridDim.x) {
        const int2 tile = group_tile(p.offsets, p.E, t / (nx * S), BWG_BM);
        if (tile.x < 0) break;
        const int e = tile.x, n0 = (t % nx) * n_cols;
        const int k0 = t / nx % S * p.nks, nk = min(nkb, k0 + p.nks) - k0;
        int64_t grow[RPT]; // the global weight row of each of the thread's tile rows
#pragma unroll
        for (int i = 0; i < RPT; i++) {
            const int r = ct + CT * i; // (past BN: no row, grow unused)
            grow[i] = (int64_t)e * N + (GATE_UP && r >= BN / 2 ? N / 2 + n0 + r - BN / 2 : n0 + r);
        }
        // W8: the first rows of the tile's two halves within the expert (GATE_UP: gate, up)
        const int half_row[2] = {n0, GATE_UP ? N / 2 + n0 : n0 + BN / 2};
        const float *sf_e = reinterpret_cast<const float *>(p.wsf) + (int64_t)e * n128 * N;
        const int it0 = it;         // it at the tile's first k tile (the loop below moves it on)
        auto request = [&](int j) { // k tile k0 + j into slot (it0 + j) % BWG_CS, one group
            if (j < nk) {
                const int slot = (it0 + j) % BWG_CS;
#pragma unroll
                for (int i = 0; i < RPT; i++) {
                    const int r = ct + CT * i;
                    if (BN % CT && r >= BN) break;
                    const uint8_t *q = p.wq + grow[i] * qrow + (int64_t)(k0 + j) * QB;
                    const uint32_t dq = st_codes + (uint32_t)(slot * BN + r) * QB;
#pragma unroll
                    for (int c = 0; c < QB / 16; c++)
                        cp_async16(dq + 16 * c, q + 16 * c, 16);
                    if constexpr (!W8)
                        cp_async4(st_scales + (uint32_t)(slot * BN + r) * 4,
                                  p.wsf + grow[i] * srow + (int64_t)(k0 + j) * 4, 4);
                }
                if (W8 && ct == 0) {
                    const int kb = (k0 + j) / 2; // its 128-k block
#pragma unroll
                    for (int h = 0; h < 2; h++)
                        cp_async4(st_scales + (uint32_t)(slot * 2 + h) * 4,
                                  sf_e + (int64_t)kb * N + half_row[h], 4);
                }
            }
            cp_async_commit();
        };
        request(0);
        request(1);
        for (int j = 0; j < nk; j++, it++) {
            request(j + 2);
            cp_async_wait<2>(); // k tile j's requests are in
            const int s = it % STAGES, slot = it % BWG_CS;
            mbar_wait(empty0 + 8 * s, ((it / STAGES) & 1) ^ 1); // the consumers are done with s
            const uint32_t bt = b0 + s * stage_bytes;
#pragma unroll
            for (int i = 0; i < RPT; i++) {
                const int r = ct + CT * i;
                if (BN % CT && r >= BN) break;
                uint32_t w[QB / 4], sc = 0;
                const uint32_t dq = st_codes + (uint32_t)(slot * BN + r) * QB;
#pragma unroll
                for (int c = 0; c < QB / 16; c++)
                    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                                 : "=r"(w[4 * c]), "=r"(w[4 * c + 1]), "=r"(w[4 * c + 2]),
                                   "=r"(w[4 * c + 3])
                                 : "r"(dq + 16 * c));
                if constexpr (!W8)
                    asm volatile("ld.shared.u32 %0, [%1];\n"
                                 : "=r"(sc)
                                 : "r"(st_scales + (uint32_t)(slot * BN + r) * 4));
#pragma unroll
                for (int c = 0; c < 8; c++) {
                    uint32_t v[4];
                    if constexpr (W8) {
                        constexpr uint32_t p120 = FP8_W8_BF16_2P120 | FP8_W8_BF16_2P120 << 16;
#pragma unroll
                        for (int tq = 0; tq < 4; tq++)
                            v[tq] = bf16x2_mul(fp8_w8_decode(w[4 * tq + (c >> 1)], c & 1), p120);
                    } else {
                        const uint32_t sf2 = wq_scale2(sc, c >> 1);
#pragma unroll
                        for (int tq = 0; tq < 4; tq++)
                            v[tq] = bf16x2_mul(wq_decode(w[2 * tq + (c >> 2)], c & 3), sf2);
                    }
                    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(
                                     bt + r * 128 + ((c ^ (r & 7)) << 4)),
                                 "r"(v[0]), "r"(v[1]), "r"(v[2]), "r"(v[3])
                                 : "memory");
                }
            }
            if (W8 && ct == 0) { // the block scales of the stage, for the consumers' fold
                uint32_t a, b;
                asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n"
                             : "=r"(a), "=r"(b)
                             : "r"(st_scales + (uint32_t)slot * 8));
                asm volatile("st.shared.v2.u32 [%0], {%1, %2};\n" ::"r"(stage_sc + s * 8), "r"(a),
                             "r"(b)
                             : "memory");
            }
            // the B tile written through the generic proxy, read by wgmma through the async one
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
            __syncwarp();
            if (lane == 0) mbar_arrive(full0 + 8 * s);
        }
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");
}

// The rows of 64-row half h of a tile of rows rows (0: none).
__device__ __forceinline__ int bwg_half_rows(int rows, int h) {
    return max(0, min(64, rows - 64 * h));
}

// The operands swapped (the weights as wgmma's A): the k loop of nk k tiles of BK (64: 128-byte
// rows, the 128-byte swizzle; 32: 64-byte rows, the 64-byte swizzle) from the ring (it: the k
// tiles so far), stage s's NA 64-row weight slices at its byte a_off + 128 BK a times its NT rows
// at b_off (high: PARTS 2, the lo parts' NT rows right after), into acc from zero, each k16 step's
// hi then lo products into the one sum (moe.cu's header); each stage freed once its products have
// completed. Then the sum of slice a's weight row r0 + 8 (q >> 1) and row 8 j + c0 + (q & 1) is
// acc[a][4 j + q], with r0 = 16 (warp % 4) + lane / 4 and c0 = 2 (lane % 4).
template <int NA, int NT, int PARTS, int STAGES, int STAGE_BYTES, int BK = BWG_BK>
__device__ __forceinline__ void bws_k_loop(float (&acc)[NA][NT / 2], int nk, int &it,
                                           uint32_t smem0, uint32_t a_off, uint32_t b_off,
                                           uint32_t bar0) {
#pragma unroll
    for (int a = 0; a < NA; a++)
#pragma unroll
        for (int i = 0; i < NT / 2; i++)
            acc[a][i] = 0.0f;
    auto release = [&](int s) {
        __syncwarp();
        if ((threadIdx.x & 31) == 0) mbar_arrive(bar0 + 8 * (STAGES + s));
    };
    for (int kb = 0; kb < nk; kb++, it++) {
        const int s = it % STAGES;
        mbar_wait(bar0 + 8 * s, (it / STAGES) & 1);
        const uint32_t st = smem0 + s * STAGE_BYTES;
        auto desc = [](uint32_t addr) {
            return BK == 64 ? wgmma_desc_sw128(addr) : wgmma_desc_sw64(addr);
        };
        uint64_t db[PARTS];
#pragma unroll
        for (int part = 0; part < PARTS; part++)
            db[part] = desc(st + b_off + part * NT * BK * 2);
        uint64_t da[NA];
#pragma unroll
        for (int a = 0; a < NA; a++)
            da[a] = desc(st + a_off + a * 128 * BK);
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
        for (int k = 0; k < BK / 16; k++) // + 32 bytes a k16 step: 2 in the address
#pragma unroll
            for (int a = 0; a < NA; a++)
#pragma unroll
                for (int part = 0; part < PARTS; part++)
                    bws_wgmma<NT>(acc[a], da[a] + 2 * k, db[part] + 2 * k);
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
        if (kb > 0) release((it - 1) % STAGES);
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    release((it - 1) % STAGES);
}

// A short half (1 to p.tail rows; never W8, whose block scales fold the m64 sums): the operands
// swapped, as in the swapped kernel below, so its products cost its rows rounded up to 16 instead
// of 64 (at 64 pairs an expert on average about half the experts have 65 to 80 rows). The
// producer puts the half's NB boxes of 16 rows at the half's place in the stage's A tile, high's lo
// boxes right after its hi ones (bws_k_loop's two parts); the B tile's 64-row
// slices are the A operands (NA = BN / 64: GATE_UP's first NA / 2 the gate rows, the rest the
// matching up rows). A k16 step's sum of an output is the same whichever operand holds the weight,
// so a row's outputs are the m64 path's bits. range: the tile's range of K (S > 1).
template <bool SPLIT, bool GATE_UP, int WQ, int NB>
__device__ __forceinline__ void bwg_short_half(const bwg_args &p, int e, int m0, int rows, int n0,
                                               int range, int nk, int &it, uint32_t smem0,
                                               uint32_t bar0) {
    typedef bwg_cfg<SPLIT, WQ> C;
    constexpr int NA = C::BN / 64, NT = 16 * NB, STAGES = C::STAGES;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wg = warp >> 2;
    float acc[NA][NT / 2];
    bws_k_loop<NA, NT, C::A_PARTS, STAGES, C::STAGE_BYTES>(
        acc, nk, it, smem0, C::A_PARTS * C::A_BYTES, wg * 8192, bar0);
    // acc[a][4 j + q]: row r0 + 8 (q >> 1) of slice a, the half's row 8 j + c0 + (q & 1)
    const int r0 = (warp & 3) * 16 + (lane >> 2), c0 = 2 * (lane & 3);
    auto sum = [&](int a, int j, int q) { return acc[a][4 * j + q]; };
    constexpr bool W4 = WQ == 4;
#pragma unroll
    for (int j = 0; j < NT / 8; j++) {
#pragma unroll
        for (int q = 0; q < 4; q++) {
            const int c = 64 * wg + 8 * j + c0 + (q & 1), r = r0 + 8 * (q >> 1);
            if (c >= rows) continue;
            if constexpr (GATE_UP) {
                const int F = p.N / 2;
#pragma unroll
                for (int a = 0; a < NA / 2; a++) {
                    float g = sum(a, j, q), u = sum(a + NA / 2, j, q);
                    if constexpr (W4) { // the gate's and the up projection's tensor scales
                        g = __fmul_rn(g, __ldg(&p.ws2[3 * e]));
                        u = __fmul_rn(u, __ldg(&p.ws2[3 * e + 1]));
                    }
                    const float v = __fmul_rn(silu(g), u);
                    __nv_bfloat16 *dst = p.h + (int64_t)(m0 + c) * F + n0 + 64 * a + r;
                    const __nv_bfloat16 hi = __float2bfloat16_rn(v);
                    *dst = hi;
                    if constexpr (SPLIT)
                        dst[p.h_lo] = __float2bfloat16_rn(__fsub_rn(v, __bfloat162float(hi)));
                }
            } else {
                float *dst = (p.S > 1 ? p.part + range * p.part_stride : p.out) +
                             (int64_t)__ldg(&p.pairs[m0 + c]) * p.N + n0 + r;
#pragma unroll
                for (int a = 0; a < NA; a++) {
                    float y = sum(a, j, q);
                    if constexpr (W4) y = __fmul_rn(y, __ldg(&p.ws2[3 * e + 2])); // down's scale
                    dst[64 * a] = y;
                }
            }
        }
    }
}

// Block b takes tiles t = b, b + gridDim.x, ...: n-block t % nx of row tile t / (nx S), range
// t / nx % S (the blocks at work at once share A's row tiles and B's expert); the ring runs on
// across its tiles.
// ta: A [rows, K] BF16 in boxes of 64 rows (a half of a tile), tt the same in boxes of 16 (short
// halves); tb: b [E N, K] in boxes of BN (GATE_UP: BN / 2) rows. A half without rows is not copied.
// W4 (NVFP4 weights, W4A16): no tb; CW more warps (the converters, BN / (32 CW) rows of each B
// tile a thread, rounded up) request their rows' codes and scales of a k tile two k tiles ahead
// (cp.async into their own staging), decode them into the stage's BF16 B tile as moe.cu's W4A16
// fragments decode them (wq_decode times the group scale: the same BF16 values), and each arrives
// on the stage's full barrier with the producer's A tile; the epilogue applies the tensor scales.
template <bool SPLIT, bool GATE_UP, int WQ, int CW = 2>
__global__ void __launch_bounds__(WQ ? BWG_THREADS_W4(CW) : BWG_THREADS, 1)
    bf16_grouped_gemm_kernel(const __grid_constant__ CUtensorMap ta,
                             const __grid_constant__ CUtensorMap tt,
                             const __grid_constant__ CUtensorMap tb, const bwg_args p, int nx) {
#if MOESERVE_WGMMA_DEVICE
    typedef bwg_cfg<SPLIT, WQ> C;
    // WQ: B's weights as codes the converter warps decode (4: NVFP4, 8: FP8), 0: BF16 by TMA
    constexpr bool W4 = WQ == 4, W8 = WQ == 8, CONV = WQ != 0;
    static_assert(!W8 || SPLIT, "W8: high precision (the fold's totals in acl)");
    constexpr int BN = C::BN, STAGES = C::STAGES, STAGE_BYTES = C::STAGE_BYTES;
    extern __shared__ __align__(16) unsigned char bwg_smem[];
    __shared__ __align__(8) uint64_t bars[2 * STAGES]; // full[s], then empty[s]
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int N = p.N, nkb = p.K / BWG_BK, S = p.S;
    const int tail = W8 ? 0 : p.tail; // short halves (bwg_short_half)
    // tile t: row tile t / (nx S), range t / nx % S, n-block t % nx
    auto row_tile = [&](int t) { return t / (nx * S); };
    auto range_of = [&](int t) { return t / nx % S; };
    auto k_first = [&](int t) { return range_of(t) * p.nks; }; // the k tiles of t's range
    auto k_end = [&](int t) { return min(nkb, k_first(t) + p.nks); };
    const uint32_t bar0 = (uint32_t)__cvta_generic_to_shared(bars);
    auto full = [&](int s) { return bar0 + 8 * s; };
    auto empty = [&](int s) { return bar0 + 8 * (STAGES + s); };
    if (tid == 0) {
        for (int s = 0; s < STAGES; s++) {
            mbar_init(full(s),
                      CONV ? 1 + CW : 1); // the producer's arrival with the bytes (and the
                                          // converter warps')
            mbar_init(empty(s), 8); // the consumer warps
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    const uint32_t smem_raw = (uint32_t)__cvta_generic_to_shared(bwg_smem);
    const uint32_t smem0 = (smem_raw + 1023u) & ~1023u;
    auto stage_a = [&](int s) { return smem0 + s * STAGE_BYTES; }; // then the lo tile (high)
    auto stage_b = [&](int s) { return stage_a(s) + C::A_PARTS * C::A_BYTES; };
    const int n_cols = GATE_UP ? BN / 2 : BN; // output columns of a tile (GATE_UP: h's)
    auto n_first = [&](int t) { return t % nx * n_cols; };
    int it = 0; // the k tiles this thread's role has gone through, over all the block's tiles
    // W8: each stage's pair of block scales (bwg_convert writes it with the B tile)
    const uint32_t w8_stage_sc =
        smem0 + STAGES * STAGE_BYTES + (uint32_t)(C::W8_CODES + C::W8_SCALES);
    (void)w8_stage_sc;

    if constexpr (CONV) {
        if (warp >= 9) { // the converters
            bwg_convert<C, GATE_UP, CW, WQ>(p, nx, smem0 + STAGES * STAGE_BYTES, stage_b(0),
                                            STAGE_BYTES, full(0), empty(0));
            return;
        }
    }
    if (warp == 8) { // the producer: lane 0 copies, the warp searches the tiles (group_tile)
        if (lane == 0) {
            asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&ta))
                         : "memory");
            if (!CONV)
                asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&tb))
                             : "memory");
        }
        for (int t = blockIdx.x;; t += gridDim.x) {
            const int2 tile = group_tile(p.offsets, p.E, row_tile(t), BWG_BM);
            if (tile.x < 0) break;
            const int e = tile.x, m0 = tile.y, n0 = n_first(t);
            const int b_row = e * N + n0; // GATE_UP: the up rows from b_row + N / 2
            const int rows = min(BWG_BM, __ldg(&p.offsets[e + 1]) - m0);
            uint32_t a_bytes = 0; // a full half's parts, a short one's boxes, none
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int rw = bwg_half_rows(rows, h);
                a_bytes += C::A_PARTS * (rw > tail ? 8192 : (rw + 15) / 16 * 2048);
            }
            for (int kb = k_first(t); kb < k_end(t) && lane == 0; kb++, it++) {
                const int s = it % STAGES, kx = kb * 128; // k in bytes
                mbar_wait(empty(s), ((it / STAGES) & 1) ^ 1);
                mbar_arrive_tx(full(s), a_bytes + (CONV ? 0 : C::B_BYTES));
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const int rw = bwg_half_rows(rows, h), nb = (rw + 15) / 16;
                    const uint32_t sa = stage_a(s) + h * 8192;
                    for (int part = 0; part < C::A_PARTS; part++)
                        if (rw > tail)
                            tma_load_2d(sa + part * C::A_BYTES, &ta, kx,
                                        part * p.a_lo + m0 + 64 * h, full(s));
                        else
                            for (int i = 0; i < nb; i++)
                                tma_load_2d(sa + (part * nb + i) * 2048, &tt, kx,
                                            part * p.a_lo + m0 + 64 * h + 16 * i, full(s));
                }
                if (CONV) { // the converters write the B tile
                } else if (GATE_UP) {
                    tma_load_2d(stage_b(s), &tb, kx, b_row, full(s));
                    tma_load_2d(stage_b(s) + BN / 2 * 128, &tb, kx, b_row + N / 2, full(s));
                } else {
                    tma_load_2d(stage_b(s), &tb, kx, b_row, full(s));
                }
            }
            __syncwarp(); // the other lanes wait for lane 0's copies of the tile to be issued
        }
        return;
    }
    // the consumers: warpgroup wg (warps 4 wg .. 4 wg + 3) on the tile's rows 64 wg ..
    const int wg = warp >> 2;
    const int r0 = wg * 64 + (warp & 3) * 16 + (lane >> 2), r1 = r0 + 8, c0 = 2 * (lane & 3);
    // this warp is done with stage s (its wgmma have completed): lane 0 tells the producer
    auto release = [&](int s) {
        __syncwarp();
        if (lane == 0) mbar_arrive(empty(s));
    };
    for (int t = blockIdx.x;; t += gridDim.x) {
        const int2 tile = group_tile(p.offsets, p.E, row_tile(t), BWG_BM);
        if (tile.x < 0) break;
        const int e = tile.x, m0 = tile.y, n0 = n_first(t);
        const int rows = min(BWG_BM, __ldg(&p.offsets[e + 1]) - m0);
        const int nk = k_end(t) - k_first(t); // the k tiles of the tile's range
        const int rw = bwg_half_rows(rows, wg);
        if (rw == 0) { // no rows here (an expert's last, short tile): the stages only
            for (int kb = 0; kb < nk; kb++, it++) {
                mbar_wait(full(it % STAGES), (it / STAGES) & 1);
                release(it % STAGES);
            }
            continue;
        }
        if (rw <= tail) {
            if constexpr (!W8) {
                if (rw <= 16)
                    bwg_short_half<SPLIT, GATE_UP, WQ, 1>(p, e, m0, rows, n0, range_of(t), nk, it,
                                                          smem0, bar0);
                else
                    bwg_short_half<SPLIT, GATE_UP, WQ, 2>(p, e, m0, rows, n0, range_of(t), nk, it,
                                                          smem0, bar0);
            }
            continue;
        }
        float acc[BN / 2], acl[W8 ? BN / 2 : 1]; // W8: acl the scaled totals
#pragma unroll
        for (int i = 0; i < BN / 2; i++)
            acc[i] = 0.0f;
        if constexpr (W8) {
#pragma unroll
            for (int i = 0; i < BN / 2; i++)
                acl[i] = 0.0f;
        }
        for (int kb = 0; kb < nk; kb++, it++) {
            const int s = it % STAGES;
            mbar_wait(full(s), (it / STAGES) & 1);
            const uint64_t da = wgmma_desc_sw128(stage_a(s) + wg * 64 * 128);
            const uint64_t db = wgmma_desc_sw128(stage_b(s));
            const uint64_t dl = wgmma_desc_sw128(stage_a(s) + C::A_BYTES + wg * 64 * 128);
            asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
            for (int k = 0; k < BWG_BK / 16; k++) { // + 32 bytes a k16 step: 2 in the address
                bwg_wgmma<BN>(acc, da + 2 * k, db + 2 * k);
                // high: the lo products into the same sum (W8: the 128-k block's)
                if constexpr (SPLIT) bwg_wgmma<BN>(acc, dl + 2 * k, db + 2 * k);
            }
            asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
            // the k tile before this one has completed: its stage is free
            asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
            if (kb > 0) release((it - 1) % STAGES);
            if constexpr (W8) { // a 128-k block ends here: its sums into the totals, times its
                                // weight rows' block scale (one a 64-row half of the tile)
                if (((k_first(t) + kb) & 1) || kb == nk - 1) {
                    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
#pragma unroll
                    for (int i = 0; i < BN / 2; i++) // the sums are read after the wait
                        asm volatile("" : "+f"(acc[i])::"memory");
                    float s0, s1;
                    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n"
                                 : "=f"(s0), "=f"(s1)
                                 : "r"(w8_stage_sc + s * 8));
#pragma unroll
                    for (int i = 0; i < BN / 2; i++) {
                        acl[i] = __fmaf_rn(i / 4 < BN / 16 ? s0 : s1, acc[i], acl[i]);
                        acc[i] = 0.0f;
                    }
                }
            }
        }
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
        release((it - 1) % STAGES);

        // the sums of rows r0 and r1 (those below rows), columns n0 + 8 j + c0 and + 1
        auto sum = [&](int i) {
            if constexpr (W8)
                return acl[i]; // the totals
            else
                return acc[i];
        };
        if constexpr (GATE_UP) {
            const int F = N / 2;
#pragma unroll
            for (int j = 0; j < BN / 16; j++) {
                const int col = n0 + 8 * j + c0, u = 4 * (j + BN / 16);
#pragma unroll
                for (int hr = 0; hr < 2; hr++) {
                    const int r = hr ? r1 : r0;
                    if (r >= rows) continue;
                    __nv_bfloat16 *dst = p.h + (int64_t)(m0 + r) * F + col;
                    float g0 = sum(4 * j + 2 * hr), g1 = sum(4 * j + 2 * hr + 1);
                    float u0 = sum(u + 2 * hr), u1 = sum(u + 2 * hr + 1);
                    if constexpr (W4) { // the gate's and the up projection's tensor scales
                        const float sg = __ldg(&p.ws2[3 * e]), su = __ldg(&p.ws2[3 * e + 1]);
                        g0 = __fmul_rn(g0, sg);
                        g1 = __fmul_rn(g1, sg);
                        u0 = __fmul_rn(u0, su);
                        u1 = __fmul_rn(u1, su);
                    }
                    if constexpr (SPLIT) {
                        uint32_t hi, lo;
                        split_bf16x2(__fmul_rn(silu(g0), u0), __fmul_rn(silu(g1), u1), &hi, &lo);
                        *reinterpret_cast<uint32_t *>(dst) = hi;
                        *reinterpret_cast<uint32_t *>(dst + p.h_lo) = lo;
                    } else {
                        *reinterpret_cast<uint32_t *>(dst) =
                            pack_bf16x2(silu(g0) * u0, silu(g1) * u1);
                    }
                }
            }
        } else {
#pragma unroll
            for (int hr = 0; hr < 2; hr++) {
                const int r = hr ? r1 : r0;
                if (r >= rows) continue;
                float *dst = (S > 1 ? p.part + range_of(t) * p.part_stride : p.out) +
                             (int64_t)__ldg(&p.pairs[m0 + r]) * N + n0 + c0;
                const float sd = W4 ? __ldg(&p.ws2[3 * e + 2]) : 1.0f; // down's tensor scale
#pragma unroll
                for (int j = 0; j < BN / 8; j++) {
                    float y0 = sum(4 * j + 2 * hr), y1 = sum(4 * j + 2 * hr + 1);
                    if constexpr (W4) {
                        y0 = __fmul_rn(y0, sd);
                        y1 = __fmul_rn(y1, sd);
                    }
                    *reinterpret_cast<float2 *>(dst + 8 * j) = make_float2(y0, y1);
                }
            }
        }
    }
#else
    __trap(); // not built for this device (hopper.cuh)
#endif
}

// Experts of few rows (decode sizes: up to BWG_SWAP_MAX pairs an expert on average) take the same
// sums with the operands swapped: the weights are wgmma's A (64 weight rows a wgmma) and a chunk of
// up to BT (80; 96 in high from BWS_BT_WIDE_MIN pairs an expert) of the expert's grouped rows its
// B, so a chunk's products cost its rows rounded up to 16, where the kernel above rounds an
// expert's rows up to 64 a warpgroup (at 64 pairs an expert on average, about half the experts
// have 65 to 80 and cost 128), and an expert of up to BT rows streams its weights once (chunks of
// 64 read them twice for those experts: 546.5 us in high at T = 1024 against 463.2 with chunks of
// 80). High precision puts a row's lo parts after the hi ones in B, and each k16 step takes the
// hi then the lo products into the one sum, as above. A k16 step's sum of an output element is
// the same whichever operand holds the weight, so these are the kernel above's sums (the test
// compares a token's rows bit for bit across batch sizes).
// A block: a producer warpgroup whose first warp copies (TMA: 2 NA 64-row weight boxes a stage,
// the chunk's rows in boxes of 16, each part; GATHER: its other warps copy the rows) and two
// consumer warpgroups sharing the chunk, each
// on NA 64-row A tiles: warpgroup w takes, GATE_UP, h's columns 64 NA x + 32 NA w .. (A: their
// gate rows, then their up rows), else out's columns 128 NA x + 64 NA w ... Tile t: chunk t / nx,
// column block t % nx, the first E chunks each expert's first (bws_tile), so that a block knows
// its first tile's expert before the grouping is in and requests its weights' first k tiles
// before its wait (p.pre of them). The producers give their registers to the
// consumers (setmaxnreg), and each role runs its own loop so that the compiler allocates the
// consumers' code to their count.
// Every column block reads the chunk's rows again (from L2), so the more weight rows a block
// takes, the fewer those reads. NA 4 halves them against NA 2, but its stages are larger: with
// 128-byte rows two of 84 KB in high (H200, Qwen3-30B-A3B's experts at 64 pairs an expert, high:
// 612.4 us against 442.8 with NA 2), with 64-byte rows (k tiles of 32, the 64-byte swizzle, as NA
// 4 has them now) five of 42 KB (489.6 against 443.0); medium with NA 4 took 426.9 us against the
// kernel above's 383.3. So NA is 2 by default (MOESERVE_WGMMA_SWAP_NA; but see GATHER below).
// Chunks of 96 rows in high were slower at 64 pairs an expert (471.5 us against 443.0, the same
// call) and faster from 72 (484.1 against 492.2; at 80 512.6 against 581.9), hence BWS_BT_WIDE_MIN.
// ncu at 64 pairs an expert, high, chunks of 96 (`ncu --clock-control none -k regex:bf16_swap
// --launch-count 2
// --section SpeedOfLight --section MemoryWorkloadAnalysis build/tests/test_cuda_moe --bf16-timing
// 1024`): GEMM 1 272.6 us, DRAM at 69% of its peak, L2 at 81%, SM 45%; GEMM 2 145.3 us, 70%, 82%,
// 43%: neither memory saturated. What holds it is the epilogues: while both consumer warpgroups
// store a tile, no stage is freed and the block's weights stop once the ring is full. Taken out
// (a scratch build, times only) at 64 pairs an expert in high: 343 us against 395 (GEMM 1's alone
// 369, GEMM 2's 369); clusters sharing the chunk's rows by TMA multicast changed nothing
// (docs/benchmarks.md, "the experts' epilogues").
// GEMM 1 may copy the chunk's rows of x itself (GATHER: three more producer warps, cp.async from
// xb by the pairs' tokens, each thread's copies arriving on the stage's full barrier as they
// land), so that the grouped copy of x is not made. H200, Qwen3-30B-A3B's experts at 64 pairs an
// expert, high (ncu, us): the copy kernel 23.4 and GEMM 1 with NA 2 254.9; GEMM 1 with NA 2 and
// GATHER 296.4 (the copies of a stage slow each chunk's k loop more than the copy kernel costs),
// with NA 4 and GATHER 262.6 (half the column blocks, so half the copies); GEMM 2 145.1 with NA
// 2, 164.1 with NA 4. So high at more than BWS_MIX_MIN up to BWS_MIX_MAX pairs an expert takes
// GEMM 1 with NA 4 and GATHER, GEMM 2 with NA 2: test_cuda_moe --bf16-timing 1024 425.1 / 424.9
// us against 443.7 / 443.2 (67.3% of the copy rate against 64.5%). At 48 and 68 pairs an expert
// the same pair lost (414.2 against 410.0 us, 507.2 against 485.0), as did GATHER with NA 2 at 64
// (450.5 against 441.5) and 80 (541.1 against 512.8). Between them it won at every size measured
// (MOESERVE_WGMMA_SWAP_NA=42 against =2, us: 50 pairs an expert 414.6 / 420.4, 56 428.9 / 432.9,
// 60 419.8 / 437.4, 62 420.6 / 440.9, 64 420.5 / 440.1; 66 lost, 493.8 / 471.3)
// (test_cuda_moe --bf16-timing T). On DeepSeek-V3's shape (E 256, D 7168, F 2048) at 64 pairs an
// expert two calls disagreed (test_cuda_moe --deepseek-timing 2048: 6464 against 6772 us, then
// 7093 against 6916), so it keeps 2 and 2 there. Both GEMMs are launched with programmatic
// dependent launch, and GEMM 2 requests its first tile's weights, a ring of them, before its wait
// (MOESERVE_WGMMA_SWAP_PRE2; its blocks take the multiprocessors GEMM 1's leave as its last tiles
// run): Qwen3-30B-A3B's experts, high, T = 1024 412.1 to 412.9 us against 413.9 to 415.0
// without, T = 900 410.8 against 412.5 (test_cuda_moe --bf16-timing T, the same call). GEMM 1
// does not (measured with a switch since taken out): two k tiles 412.7 to 413.2, a ring of them
// 415.1 to 419.3 at T = 1024: a globaltimer timeline showed the early requests slowing x's
// conversion, still running then, by 5 us, and GEMM 1 waits for it. Tried and not kept: GEMM 1's
// producer warps copying x's rows from x in fp32, splitting them as the prepare kernel does (no
// conversion before it, so its blocks could be resident during the grouping): 522 us at T = 1024
// against 419 (each copying thread waits for its loads before it can write the stage, where
// cp.async does not). Tried on the H200 and not kept (Qwen3-30B-A3B's experts at 64 pairs an
// expert, T = 1024, high, two chains then; this kernel with chunks of 64 rows 546.5 us): the two
// warpgroups sharing one set of weight tiles, each taking half of up to 128 rows (664.8 us: each
// wgmma of fewer rows reads the same A from shared memory), and each warpgroup its own 64 weight
// rows over up to 112 rows, so that an expert of 65 to 128 rows streams its weights once instead of
// twice (618.7 us: 16 KB of weights a stage, half of these, leave too few bytes in flight).
#define BWS_BT      80 /* rows of a chunk (BWS_BT_WIDE from BWS_BT_WIDE_MIN pairs an expert in high) */
#define BWS_BT_WIDE 96
#define BWS_THREADS                                                                                \
    384 /* two consumer warpgroups and the producer warpgroup (its first warp copies) */
// setmaxnreg: the producer warpgroup gives its registers to the consumers (the sums of NA 4 tiles
// of a chunk of 80 rows are 160 registers a thread)
#define BWS_PRODUCER_REGS 40
#define BWS_CONSUMER_REGS 232
template <bool SPLIT, int NA, int BT = BWS_BT> struct bws_cfg {
    static constexpr int PARTS = SPLIT ? 2 : 1;
    static constexpr int BK = NA == 4 ? 32 : BWG_BK;    // k of a stage, 2 BK bytes a row
    static constexpr int A_BYTES = 2 * NA * 128 * BK;   // NA 64-row weight tiles a warpgroup
    static constexpr int B_BYTES = PARTS * BT * 2 * BK; // BT rows of a chunk
    static constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
    static constexpr int STAGES = std::min(6, (226 * 1024) / STAGE_BYTES);
    static constexpr size_t smem = (size_t)STAGES * STAGE_BYTES + 1024; // + alignment
    static_assert(STAGES >= 2 && smem <= 227 * 1024, "shared memory of one block");
};

// The first output column of warpgroup w's A tile a in column block x: GATE_UP h's (gate and up
// tiles a and a + NA / 2 share it), else out's.
template <bool GATE_UP, int NA> __device__ __forceinline__ int bws_col(int x, int w, int a) {
    if constexpr (GATE_UP)
        return 64 * NA * x + 32 * NA * w + 64 * (a % (NA / 2));
    else
        return 128 * NA * x + 64 * NA * w + 64 * a;
}
// The weight row of that tile in expert e (b [E N, K]; GATE_UP: F = N / 2 gate rows, then up).
template <bool GATE_UP, int NA>
__device__ __forceinline__ int bws_wrow(int N, int e, int x, int w, int a) {
    return e * N + (GATE_UP && a >= NA / 2 ? N / 2 : 0) + bws_col<GATE_UP, NA>(x, w, a);
}

// One warpgroup's tile of a chunk of rows (NT: its rows rounded up to 16): the k loop over the
// ring, then the epilogue. it: the k tiles this thread has gone through.
template <bool SPLIT, bool GATE_UP, int NA, int BT, int NT>
__device__ __forceinline__ void bws_consume(const bwg_args &p, int m0, int rows, int x, int &it,
                                            uint32_t smem0, uint32_t bar0) {
    typedef bws_cfg<SPLIT, NA, BT> C;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wg = warp >> 2;
    const int nk = p.K / C::BK;
    float acc[NA][NT / 2];
    bws_k_loop<NA, NT, C::PARTS, C::STAGES, C::STAGE_BYTES, C::BK>(
        acc, nk, it, smem0, wg * NA * 128 * C::BK, C::A_BYTES, bar0);
    // acc[a][4 j + q]: weight row r0 + 8 (q >> 1) of A tile a, chunk row 8 j + c0 + (q & 1)
    const int r0 = (warp & 3) * 16 + (lane >> 2), c0 = 2 * (lane & 3);
#pragma unroll
    for (int j = 0; j < NT / 8; j++) {
#pragma unroll
        for (int q = 0; q < 4; q++) {
            const int c = 8 * j + c0 + (q & 1), r = r0 + 8 * (q >> 1);
            if (c >= rows) continue;
            if constexpr (GATE_UP) {
                const int F = p.N / 2;
#pragma unroll
                for (int a = 0; a < NA / 2; a++) {
                    __nv_bfloat16 *dst =
                        p.h + (int64_t)(m0 + c) * F + bws_col<true, NA>(x, wg, a) + r;
                    const float v = __fmul_rn(silu(acc[a][4 * j + q]), acc[a + NA / 2][4 * j + q]);
                    const __nv_bfloat16 hi = __float2bfloat16_rn(v);
                    *dst = hi;
                    if constexpr (SPLIT)
                        dst[p.h_lo] = __float2bfloat16_rn(__fsub_rn(v, __bfloat162float(hi)));
                }
            } else {
                float *dst = p.out + (int64_t)__ldg(&p.pairs[m0 + c]) * p.N +
                             bws_col<false, NA>(x, wg, 0) + r;
#pragma unroll
                for (int a = 0; a < NA; a++)
                    dst[64 * a] = acc[a][4 * j + q];
            }
        }
    }
}

// GATHER (GEMM 1): the producer warpgroup's other three warps copy the chunk's rows of x from xb
// themselves, and the grouped copy of x's rows is not made.
#define BWS_GATHER_THREADS 96

// Tile t: chunk t / nx, column block x = t % nx. Chunk c < E is expert c's first BT rows (rows 0:
// it has none), the chunks after them each expert's further BT rows in expert order. False past
// the last tile. A warp's call (group_tile).
__device__ __forceinline__ bool bws_tile(const bwg_args &p, int nx, int BT, int t, int &e, int &m0,
                                         int &x, int &rows) {
    const int c = t / nx;
    x = t % nx;
    if (c < p.E) {
        e = c;
        m0 = __ldg(&p.offsets[c]);
    } else {
        const int2 tile = group_tile(p.offsets, p.E, c - p.E, BT, 1);
        if (tile.x < 0) return false;
        e = tile.x;
        m0 = tile.y;
    }
    rows = min(BT, __ldg(&p.offsets[e + 1]) - m0);
    return true;
}

// ta: the grouped rows [parts n, K] in boxes of 16 rows (not read with GATHER); tb: b [E N, K] in
// boxes of 64 rows.
template <bool SPLIT, bool GATE_UP, int NA, int BT, bool GATHER>
__global__ void __launch_bounds__(BWS_THREADS, 1)
    bf16_swap_gemm_kernel(const __grid_constant__ CUtensorMap ta,
                          const __grid_constant__ CUtensorMap tb, const bwg_args p, int nx) {
#if MOESERVE_WGMMA_DEVICE
    typedef bws_cfg<SPLIT, NA, BT> C;
    constexpr int STAGES = C::STAGES;
    extern __shared__ __align__(16) unsigned char bwg_smem[];
    __shared__ __align__(8) uint64_t bars[2 * STAGES]; // full[s], then empty[s]
    __shared__ int src_row[BT];                        // GATHER: the chunk's rows' tokens
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const uint32_t bar0 = (uint32_t)__cvta_generic_to_shared(bars);
    if (tid == 0) {
        for (int s = 0; s < STAGES; s++) {
            // the producer's arrival with the bytes (GATHER: and each copying thread's, as its
            // copies land)
            mbar_init(bar0 + 8 * s, 1 + (GATHER ? BWS_GATHER_THREADS : 0));
            mbar_init(bar0 + 8 * (STAGES + s), 8); // the consumer warps
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    const uint32_t smem0 = ((uint32_t)__cvta_generic_to_shared(bwg_smem) + 1023u) & ~1023u;
    const int nk = p.K / C::BK;
    // k tile kb of tile (e, x) into stage s by TMA on its full barrier: the NA weight tiles of each
    // warpgroup; the chunk's nb boxes of 16 rows a part from grouped row m0 (not GATHER)
    auto load_w = [&](int s, int e, int x, int kb) {
        const uint32_t sa = smem0 + s * C::STAGE_BYTES, full = bar0 + 8 * s;
#pragma unroll
        for (int w = 0; w < 2; w++)
#pragma unroll
            for (int a = 0; a < NA; a++)
                tma_load_2d(sa + (NA * w + a) * 128 * C::BK, &tb, kb * 2 * C::BK,
                            bws_wrow<GATE_UP, NA>(p.N, e, x, w, a), full);
    };
    auto load_rows = [&](int s, int m0, int nb, int kb) {
        const uint32_t sb = smem0 + s * C::STAGE_BYTES + C::A_BYTES, full = bar0 + 8 * s;
        for (int part = 0; part < C::PARTS; part++)
            for (int i = 0; i < nb; i++)
                tma_load_2d(sb + (part * 16 * nb + 16 * i) * 2 * C::BK, &ta, kb * 2 * C::BK,
                            part * p.a_lo + m0 + 16 * i, full);
    };
    // The block's first tile's k tiles 0 .. pre - 1 of weights, requested before the wait (they do
    // not depend on the kernel before; a fresh ring): the bytes announced without the producer's
    // arrival, which comes after the wait (with the rows' bytes, or none with GATHER), so that no
    // phase completes before the rows are in. (GEMM 2 only, p.pre: GEMM 1's requests slowed x's
    // conversion, which it waits for.)
    const int pre = (int)blockIdx.x < nx * p.E ? min(p.pre, min(STAGES, nk)) : 0;
    if (warp == 8 && lane == 0)
        for (int kb = 0; kb < pre; kb++) {
            mbar_expect_tx(bar0 + 8 * kb, C::A_BYTES);
            load_w(kb, blockIdx.x / nx, blockIdx.x % nx, kb);
        }
    // Launched with programmatic dependent launch (cuda_launch_pdl): the blocks may be resident
    // while the kernel before finishes, and every thread waits for it before it reads the offsets
    // (the prepare kernel's) or x, h.
    pdl_wait();
    pdl_trigger();
    // a tile's k tiles: all, or where it has no rows none, but the block's first tile's requested
    // ones (each role goes through those stages without a product)
    auto tile_nk = [&](int t, int rows) { return rows > 0 ? nk : t == (int)blockIdx.x ? pre : 0; };
    int e, m0, x, rows, it = 0;
    if (warp >= 8) { // the producer: the first warp's lane 0 requests (GATHER: the others copy)
        setmaxnreg_dec<BWS_PRODUCER_REGS>();
        if (GATHER && warp > 8) {
            // warps 9 to 11: a stage's rows of the chunk, each row's k tile in 16-byte units
            // (thread g: unit g % U of rows g / U, g / U + 96 / U, ...), the rows past the chunk's
            // as zeros; each thread's copies arrive on the full barrier as they land
            constexpr int U = C::BK / 8, RS = BWS_GATHER_THREADS / U;
            const int g = tid - 9 * 32, u = g % U;
            for (int t = blockIdx.x; bws_tile(p, nx, BT, t, e, m0, x, rows); t += gridDim.x) {
                const int nr = 16 * ((rows + 15) / 16); // rows a part
                asm volatile("bar.sync 1, %0;\n" ::"n"(BWS_GATHER_THREADS) : "memory");
                for (int i = g; i < rows; i += BWS_GATHER_THREADS)
                    src_row[i] = __ldg(&p.pairs[m0 + i]) / p.topk;
                asm volatile("bar.sync 1, %0;\n" ::"n"(BWS_GATHER_THREADS) : "memory");
                for (int kb = 0, n_k = tile_nk(t, rows); kb < n_k; kb++, it++) {
                    const int s = it % STAGES;
                    const uint32_t b = smem0 + s * C::STAGE_BYTES + C::A_BYTES;
                    mbar_wait(bar0 + 8 * (STAGES + s), ((it / STAGES) & 1) ^ 1);
                    for (int part = 0; part < C::PARTS; part++)
                        for (int i = g / U; i < nr; i += RS) {
                            const int r = i < rows ? src_row[i] : 0;
                            const __nv_bfloat16 *src =
                                p.xb + ((int64_t)part * p.T + r) * p.K + kb * C::BK + 8 * u;
                            const uint32_t off = (uint32_t)((part * nr + i) * 2 * C::BK + 16 * u);
                            cp_async16(b + swizzled<2 * C::BK>(off), src, i < rows ? 16 : 0);
                        }
                    asm volatile(
                        "cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar0 + 8 * s)
                        : "memory");
                }
            }
            asm volatile("cp.async.wait_all;\n" ::: "memory");
            return;
        }
        if (warp > 8) return;
        for (int t = blockIdx.x; bws_tile(p, nx, BT, t, e, m0, x, rows); t += gridDim.x) {
            const int n_k = tile_nk(t, rows), k0 = t == (int)blockIdx.x ? pre : 0;
            const int nb = (rows + 15) / 16; // boxes of 16 rows a part
            const uint32_t rows_bytes = GATHER ? 0 : C::PARTS * nb * 16 * 2 * C::BK;
            if (lane == 0)
                for (int kb = 0; kb < n_k; kb++) {
                    const int s = (it + kb) % STAGES;
                    if (kb < k0) { // its weights requested before the wait
                        mbar_arrive_tx(bar0 + 8 * s, rows_bytes);
                    } else {
                        mbar_wait(bar0 + 8 * (STAGES + s), (((it + kb) / STAGES) & 1) ^ 1);
                        mbar_arrive_tx(bar0 + 8 * s, C::A_BYTES + rows_bytes);
                        load_w(s, e, x, kb);
                    }
                    if constexpr (!GATHER) load_rows(s, m0, nb, kb);
                }
            it += n_k;
            __syncwarp();
        }
        return;
    }
    setmaxnreg_inc<BWS_CONSUMER_REGS>();
    for (int t = blockIdx.x; bws_tile(p, nx, BT, t, e, m0, x, rows); t += gridDim.x) {
        if (rows == 0) { // the stages requested for a tile without rows: freed unused
            for (int kb = tile_nk(t, rows); kb > 0; kb--, it++) {
                const int s = it % STAGES;
                mbar_wait(bar0 + 8 * s, (it / STAGES) & 1);
                __syncwarp();
                if (lane == 0) mbar_arrive(bar0 + 8 * (STAGES + s));
            }
            continue;
        }
        switch ((rows + 15) / 16) {
        case 1: bws_consume<SPLIT, GATE_UP, NA, BT, 16>(p, m0, rows, x, it, smem0, bar0); break;
        case 2: bws_consume<SPLIT, GATE_UP, NA, BT, 32>(p, m0, rows, x, it, smem0, bar0); break;
        case 3: bws_consume<SPLIT, GATE_UP, NA, BT, 48>(p, m0, rows, x, it, smem0, bar0); break;
        case 4: bws_consume<SPLIT, GATE_UP, NA, BT, 64>(p, m0, rows, x, it, smem0, bar0); break;
        case 5: bws_consume<SPLIT, GATE_UP, NA, BT, 80>(p, m0, rows, x, it, smem0, bar0); break;
        default:
            if constexpr (BT > 80)
                bws_consume<SPLIT, GATE_UP, NA, BT, 96>(p, m0, rows, x, it, smem0, bar0);
            break;
        }
    }
#else
    __trap(); // not built for this device (hopper.cuh)
#endif
}

// Grouped row m < offsets[E] of xg [AP, n, D] = the row of its pair's token in xb [AP, T, D] (high:
// the lo parts after the hi ones in both). A block a row, 16 bytes a thread.
__global__ void bwg_gather_kernel(__nv_bfloat16 *xg, const __nv_bfloat16 *xb, int T, int D,
                                  const int32_t *pairs, const int32_t *offsets, int E, int topk,
                                  int parts) {
    const int64_t m = blockIdx.x, n = gridDim.x;
    if (m >= __ldg(&offsets[E])) return;
    const int64_t t = __ldg(&pairs[m]) / topk;
    for (int part = 0; part < parts; part++) {
        const uint4 *src = reinterpret_cast<const uint4 *>(xb + (part * (int64_t)T + t) * D);
        uint4 *dst = reinterpret_cast<uint4 *>(xg + (part * n + m) * D);
        for (int i = threadIdx.x; i < D / 8; i += blockDim.x)
            dst[i] = __ldg(&src[i]);
    }
}

// GEMM 1's A rows in grouped order (p: GEMM 1's arguments, K = D).
static void bwg_gather(__nv_bfloat16 *xg, const bwg_args &p, int parts, int64_t n_pairs) {
    bwg_gather_kernel<<<(unsigned)n_pairs, 128, 0, cuda_stream()>>>(xg, p.xb, p.T, p.K, p.pairs,
                                                                    p.offsets, p.E, p.topk, parts);
    CUDA_CHECK_LAUNCH();
}

static int wgmma_env() {
    static int on = -1;
    return cuda_env_on("MOESERVE_WGMMA", &on) && cuda_wgmma_device();
}

// Pairs an expert from which the wgmma kernels take the experts: the quantized formats' (moe.cu's
// prefill tiles from 96), BF16's, and the swapped kernel's ranges: on shapes of long k loops (D and
// F at least BWG_SWAP_LONG_K), and in high precision above BWG_SWAP_HIGH_MIN up to
// BWG_SWAP_HIGH_MAX on any. High with the hi and lo products in one chain (H200, Qwen3-30B-A3B's
// experts, test_cuda_moe --bf16-timing T with MOESERVE_WGMMA_MIN=0 and MOESERVE_WGMMA_SWAP_MAX 0
// then 200, us): at 24 / 32 / 40 / 48 / 64 / 72 / 80 / 88 / 96 pairs an expert the kernel above
// 390.8 / 399.4 / 408.8 / 422.1 / 530.0 / 570.2 / 581.3 / 593.5 / 596.7, swapped in chunks of 80
// 364.6 / 372.7 / 385.4 / 410.7 / 443.0 / 492.2 / 581.9 / 676.1 / 722.3 and of 96 (from 72)
// 484.1 / 512.6 / 551.8 / 653.4, the tiles (up to 48) 342.5 / 362.3 / 384.6. Medium keeps the
// kernel above (at 80 pairs an expert 406.5 us against 491.1 swapped). H200, test_cuda_moe --timing
// 1024 and --timing-deepseek 2048, us, medium / high (docs/benchmarks.md; the swapped kernel's
// chunks were 64 rows then):
//   Qwen3-30B-A3B, 64 an expert (T = 1024): the tiles 405.7 / 569.6, this kernel (from 24) 386.8
//   / 515.7, swapped 452.6 / 546.5; 32 an expert (T = 512): the tiles 340.3 / 369.2, this kernel
//   351.4 / 432.1, swapped 348.4 / 380.2.
//   DeepSeek-V3's shape (D 7168, F 2048): 32 an expert (T = 1024) the tiles 5704.1 / 6478.9,
//   swapped 5521.9 / 5851.0; 16 (T = 512) 5453.9 / 5698.3 against 5352.1 / 5522.5; 8 (T = 256)
//   5146.3 / 5277.9 against 5142.5 / 5271.9.
#define BWG_MIN_PAIRS_PER_EXPERT 96
#define BWG_MIN_PAIRS_BF16       48
#define BWG_SWAP_MIN             12
#define BWG_SWAP_MAX             48
#define BWG_SWAP_LONG_K          2048
#define BWG_SWAP_HIGH_MIN        40
#define BWG_SWAP_HIGH_MAX        88
#define BWS_BT_WIDE_MIN          68
#define BWG_TAIL                 32
#define BWS_MIX_MIN              48 /* high: GEMM 1 NA 4 with the gather, GEMM 2 NA 2, from */
#define BWS_MIX_MAX              64 /* more than BWS_MIX_MIN up to BWS_MIX_MAX pairs an expert */

// The shapes the tiles take: D and F multiples of the tile's columns and of a stage's k.
static bool bwg_shape_ok(int D, int F, bool split) {
    const int BN = split ? bwg_cfg<true>::BN : bwg_cfg<false>::BN;
    return D > 0 && F > 0 && D % BN == 0 && F % (BN / 2) == 0 && F % BWG_BK == 0 && D % BWG_BK == 0;
}

bool bf16_wgmma_one_chain(int D, int F) {
    // outside the mode too unless MOESERVE_ONE_CHAIN=0 (a token's rows the same bits at any batch
    // size in high precision as well)
    static int off_mode = -1;
    return (ops_cuda_deterministic() || cuda_env_on("MOESERVE_ONE_CHAIN", &off_mode)) &&
           bwg_shape_ok(D, F, true) && wgmma_env();
}

// More than min_pairs pairs an expert on average, a shape the tiles take, the kernel allowed.
static bool bwg_takes(int64_t n_pairs, int E, int D, int F, bool split, int min_pairs) {
    return n_pairs > (int64_t)min_pairs * E && E > 0 && bwg_shape_ok(D, F, split) && wgmma_env();
}

// BF16's minimum pairs an expert (MOESERVE_WGMMA_MIN, default BWG_MIN_PAIRS_BF16) and the swapped
// kernel's maximum (MOESERVE_WGMMA_SWAP_MAX; -1: from the variables). Given
// MOESERVE_WGMMA_SWAP_MAX=N, the swapped kernel takes every grouped size up to N pairs an expert
// on any shape it can (F % 128, D % 256; 0: none); by default only from BWG_SWAP_MIN to
// BWG_SWAP_MAX pairs an expert on shapes of long k loops (above; on Qwen3-30B-A3B's, K 2048 and
// 768, the tiles and the kernel above were faster).
static int g_bf16_min = -1, g_swap_max = -1;
// The swapped kernel's A tiles a warpgroup, GEMM 1's and GEMM 2's, for n_pairs over E experts of
// width F (MOESERVE_WGMMA_SWAP_NA=2 or 4: both; 42: GEMM 1's 4, GEMM 2's 2). By default 2 and 2
// but in high precision from more than BWS_MIX_MIN up to BWS_MIX_MAX pairs an expert on experts
// narrower than BWG_SWAP_LONG_K (the shape it was measured to win on): 4 (its rows gathered by
// the kernel, bws_gather) and 2. (Our reading of its loss at 68 pairs an expert: GEMM 1's 3 column
// blocks a chunk make about 393 tiles at 64, three waves of the H200's 132 blocks, and the
// experts of more than 80 rows at 68 add a fourth.)
static int g_swap_na[2] = {-1, -1};
static int2 bws_nas(bool split, int64_t n_pairs, int E, int F) {
    const int na = cuda_env_count("MOESERVE_WGMMA_SWAP_NA", 0, &g_swap_na[split]);
    if (na == 2 || na == 4) return make_int2(na, na);
    const bool mix =
        na == 42 || (na == 0 && split && F < BWG_SWAP_LONG_K &&
                     n_pairs > (int64_t)BWS_MIX_MIN * E && n_pairs <= (int64_t)BWS_MIX_MAX * E);
    return make_int2(mix ? 4 : 2, 2);
}
// Whether the swapped kernel's GEMM 1 of na1 tiles a warpgroup copies x's rows itself
// (MOESERVE_WGMMA_SWAP_GATHER=1, 0: from the grouped copy; by default with 4 tiles, not 2).
static int g_swap_gather = -1, g_wide_min = -1;
static bool bws_gather(int na1) {
    const int g = cuda_env_count("MOESERVE_WGMMA_SWAP_GATHER", 2, &g_swap_gather);
    return g == 2 ? na1 == 4 : g == 1;
}
// The k tiles of weights GEMM 2 of the swapped kernel requests before its wait
// (MOESERVE_WGMMA_SWAP_PRE2; at most the ring's stages).
static int g_swap_pre2 = -1;
// High's pairs an expert above which the swapped kernel's chunks are BWS_BT_WIDE rows
// (MOESERVE_WGMMA_SWAP_WIDE_MIN, default BWS_BT_WIDE_MIN), where both GEMMs take 2 tiles.
static int bws_wide_min() {
    return cuda_env_count("MOESERVE_WGMMA_SWAP_WIDE_MIN", BWS_BT_WIDE_MIN, &g_wide_min);
}
static bool bws_takes(int64_t n_pairs, int E, int D, int F, bool split) {
    const int2 na = bws_nas(split, n_pairs, E, F); // a block's columns: F in 64 NA, D in 128 NA
    if (F % (64 * na.x) || D % (128 * na.x) || F % (64 * na.y) || D % (128 * na.y)) return false;
    const int max = cuda_env_count("MOESERVE_WGMMA_SWAP_MAX", -1, &g_swap_max);
    if (max >= 0) return n_pairs <= (int64_t)max * E;
    if (split && n_pairs > (int64_t)BWG_SWAP_HIGH_MIN * E &&
        n_pairs <= (int64_t)BWG_SWAP_HIGH_MAX * E)
        return true;
    return n_pairs > (int64_t)BWG_SWAP_MIN * E && n_pairs <= (int64_t)BWG_SWAP_MAX * E &&
           D >= BWG_SWAP_LONG_K && F >= BWG_SWAP_LONG_K;
}
bool bf16_wgmma_takes(int64_t n_pairs, int E, int D, int F, bool split) {
    const int min = cuda_env_count("MOESERVE_WGMMA_MIN", BWG_MIN_PAIRS_BF16, &g_bf16_min);
    return bwg_takes(n_pairs, E, D, F, split, min) ||
           (E > 0 && bws_takes(n_pairs, E, D, F, split) && bwg_shape_ok(D, F, split) &&
            wgmma_env());
}
extern "C" int cuda_moe_bf16_wgmma(int64_t n_pairs, int E, int D, int F, int high) {
    return bf16_wgmma_takes(n_pairs, E, D, F, high != 0);
}
extern "C" int cuda_moe_bf16_one_chain(int D, int F) { return bf16_wgmma_one_chain(D, F); }

size_t bf16_wgmma_scratch_bytes(int64_t n_pairs, int D, bool split) {
    return (split ? 2 : 1) * (size_t)n_pairs * D * sizeof(__nv_bfloat16);
}

// A's rows (a [rows, K]) as the kernel copies them: the halves of a tile and the short halves'
// boxes.
struct bwg_rows_map {
    CUtensorMap half, box;
    bwg_rows_map(const void *a, int64_t rows, int K) {
        half = tma_map_rows(a, rows, (int64_t)K * 2, 64);
        box = tma_map_rows(a, rows, (int64_t)K * 2, 16);
    }
};

// Short halves (bwg_short_half) from MOESERVE_WGMMA_TAIL rows (0 to 32; default BWG_TAIL).
static int g_tail = -1;
static int bwg_tail() {
    return std::min(cuda_env_count("MOESERVE_WGMMA_TAIL", BWG_TAIL, &g_tail), 32);
}

template <bool SPLIT, bool GATE_UP, int WQ = 0, int CW = 2>
static void bwg_launch(const bwg_rows_map &ta, const CUtensorMap &tb, bwg_args p,
                       int64_t max_rows) {
    typedef bwg_cfg<SPLIT, WQ> C;
    auto kernel = bf16_grouped_gemm_kernel<SPLIT, GATE_UP, WQ, CW>;
    const size_t smem = C::smem_wq(WQ);
    static size_t attr_set = 0;
    cuda_smem_allow(kernel, smem, &attr_set);
    static int sms = 0; // one device a process
    if (!sms) {
        int dev = 0;
        CUDA_CHECK(cudaGetDevice(&dev));
        CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    }
    const int nx = p.N / C::BN; // GATE_UP: h's F = N / 2 columns in blocks of BN / 2
    const int64_t tiles = (int64_t)nx * p.S * ((max_rows + BWG_BM - 1) / BWG_BM + p.E);
    const unsigned grid = (unsigned)std::min<int64_t>(tiles, sms);
    p.tail = WQ == 8 ? 0 : bwg_tail();
    kernel<<<grid, WQ ? BWG_THREADS_W4(CW) : BWG_THREADS, smem, cuda_stream()>>>(ta.half, ta.box,
                                                                                 tb, p, nx);
    CUDA_CHECK_LAUNCH();
}

// The swapped kernel's launch: a block a multiprocessor, or fewer where there are fewer tiles.
template <bool SPLIT, bool GATE_UP, int NA, int BT, bool GATHER = false>
static void bws_launch(const CUtensorMap &ta, const CUtensorMap &tb, const bwg_args &p,
                       int64_t n_pairs) {
    typedef bws_cfg<SPLIT, NA, BT> C;
    auto kernel = bf16_swap_gemm_kernel<SPLIT, GATE_UP, NA, BT, GATHER>;
    static size_t attr_set = 0;
    cuda_smem_allow(kernel, C::smem, &attr_set);
    static int sms = 0; // one device a process
    if (!sms) {
        int dev = 0;
        CUDA_CHECK(cudaGetDevice(&dev));
        CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    }
    const int nx = GATE_UP ? p.N / 2 / (64 * NA) : p.N / (128 * NA);
    const int64_t tiles = (int64_t)nx * ((n_pairs + BT - 1) / BT + p.E);
    const unsigned grid = (unsigned)std::min<int64_t>(tiles, sms);
    cuda_launch_pdl(kernel, dim3(grid), dim3(BWS_THREADS), C::smem, ta, tb, p, nx);
}

// Both GEMMs on the swapped kernel, NA tiles a warpgroup, chunks of BT rows (p: GEMM 1's
// arguments). GEMM 1 copies x's rows from p.xb itself (GATHER) where bws_gather says so, else
// from their grouped copy xg.
template <bool SPLIT, int NA1, int NA2, int BT>
static void bws_experts(bwg_args p, float *out, __nv_bfloat16 *xg, const void *gate_up,
                        const void *down, __nv_bfloat16 *h, int D, int F, int64_t n_pairs) {
    const int parts = SPLIT ? 2 : 1; // a box's bytes a row: 2 BK of the GEMM's NA
    const int bb = 2 * bws_cfg<SPLIT, NA1>::BK, bb2 = 2 * bws_cfg<SPLIT, NA2>::BK;
    const CUtensorMap tb1 = tma_map_rows(gate_up, (int64_t)p.E * 2 * F, (int64_t)D * 2, 64, bb);
    if (bws_gather(NA1)) {
        bws_launch<SPLIT, true, NA1, BT, true>(tb1, tb1, p, n_pairs);
    } else {
        bwg_gather(xg, p, parts, n_pairs);
        const CUtensorMap ta1 = tma_map_rows(xg, parts * n_pairs, (int64_t)D * 2, 16, bb);
        bws_launch<SPLIT, true, NA1, BT>(ta1, tb1, p, n_pairs);
    }
    p.out = out;
    p.N = D;
    p.K = F;
    p.pre = cuda_env_count("MOESERVE_WGMMA_SWAP_PRE2", 8, &g_swap_pre2);
    const CUtensorMap ta2 = tma_map_rows(h, parts * n_pairs, (int64_t)F * 2, 16, bb2);
    const CUtensorMap tb2 = tma_map_rows(down, (int64_t)p.E * D, (int64_t)F * 2, 64, bb2);
    bws_launch<SPLIT, false, NA2, BT>(ta2, tb2, p, n_pairs);
}

// WQ 4: gate_up and down are NVFP4 codes with their scales gate_up_sf, down_sf and the tensor
// scales s2 (moe.cu's W4A16 layout); WQ 8: FP8 codes with their block scales (fp32, moe.cu's
// W8A16 layout; s2 NULL); 0: BF16 (the other three NULL).
template <bool SPLIT, int WQ>
static void bwg_experts(float *out, const __nv_bfloat16 *xb, int T, const int32_t *pairs,
                        const int32_t *offsets, int K, const void *gate_up, const void *down,
                        const uint8_t *gate_up_sf, const uint8_t *down_sf, const float *s2, int E,
                        int D, int F, int64_t n_pairs, __nv_bfloat16 *h, __nv_bfloat16 *xg) {
    typedef bwg_cfg<SPLIT, WQ> C;
    const int parts = C::A_PARTS;
    bwg_args p = {};
    p.S = 1;
    p.nks = (D > F ? D : F) / BWG_BK; // every k tile: one range
    p.h = h;
    p.h_lo = SPLIT ? n_pairs * F : 0;
    p.pairs = pairs;
    p.offsets = offsets;
    p.E = E;
    p.ws2 = s2;
    // GEMM 1: A = xg [parts n, D], x's rows in grouped order; B = gate_up [E 2F, D] in boxes of
    // BN / 2 rows (WQ: the converters read it)
    p.N = 2 * F;
    p.K = D;
    p.wq = (const uint8_t *)gate_up;
    p.wsf = gate_up_sf;
    p.xb = xb;
    p.T = T;
    p.topk = K;
    p.a_lo = (int)n_pairs;
    if (WQ == 0 && bws_takes(n_pairs, E, D, F, SPLIT)) { // few rows an expert: the operands swapped
        const int2 na = bws_nas(SPLIT, n_pairs, E, F);
        if (na.x == 4 && na.y == 4)
            bws_experts<SPLIT, 4, 4, BWS_BT>(p, out, xg, gate_up, down, h, D, F, n_pairs);
        else if (!SPLIT || n_pairs <= (int64_t)bws_wide_min() * E) {
            if (na.x == 4)
                bws_experts<SPLIT, 4, 2, BWS_BT>(p, out, xg, gate_up, down, h, D, F, n_pairs);
            else
                bws_experts<SPLIT, 2, 2, BWS_BT>(p, out, xg, gate_up, down, h, D, F, n_pairs);
        } else if constexpr (SPLIT) // chunks of 96 rows: high only, 2 tiles a warpgroup
            bws_experts<SPLIT, 2, 2, BWS_BT_WIDE>(p, out, xg, gate_up, down, h, D, F, n_pairs);
        return;
    }
    bwg_gather(xg, p, parts, n_pairs);
    const bwg_rows_map ta1(xg, parts * n_pairs, D);
    const CUtensorMap tb1 =
        WQ ? ta1.half : tma_map_rows(gate_up, (int64_t)E * 2 * F, (int64_t)D * 2, C::BN / 2);
    bwg_launch<SPLIT, true, WQ, WQ ? BWG_CW(C::BN) : 2>(ta1, tb1, p, n_pairs);
    // GEMM 2: A = h [parts n, F], B = down [E D, F] in boxes of BN rows
    p.out = out;
    p.a_lo = (int)n_pairs;
    p.N = D;
    p.K = F;
    p.wq = (const uint8_t *)down;
    p.wsf = down_sf;
    const bwg_rows_map ta2(h, parts * n_pairs, F);
    const CUtensorMap tb2 =
        WQ ? ta2.half : tma_map_rows(down, (int64_t)E * D, (int64_t)F * 2, C::BN);
    bwg_launch<SPLIT, false, WQ, WQ ? BWG_CW(C::BN) : 2>(ta2, tb2, p, n_pairs);
}

bool bf16_wgmma_linear_takes(int N, int Kd, bool split) {
    const int BN = split ? bwg_cfg<true>::BN : bwg_cfg<false>::BN;
    return N > 0 && Kd > 0 && N % BN == 0 && Kd % BWG_BK == 0 && wgmma_env();
}

void bf16_wgmma_linear(float *out, float *part, const __nv_bfloat16 *xb, const int32_t *rows,
                       const int32_t *offsets, const __nv_bfloat16 *w, int T, int N, int Kd, int L,
                       bool split) {
    MS_ASSERT(bf16_wgmma_linear_takes(N, Kd, split) && L % BWG_BK == 0 &&
              ((uintptr_t)xb & 15) == 0 && ((uintptr_t)w & 15) == 0 && ((uintptr_t)out & 7) == 0);
    if (T <= 0) return;
    bwg_args p = {};
    p.out = out;
    p.pairs = rows;
    p.offsets = offsets;
    p.a_lo = T;
    p.E = 1;
    p.N = N;
    p.K = Kd;
    p.S = (Kd + L - 1) / L;
    p.nks = L / BWG_BK;
    p.part = part;
    p.part_stride = (int64_t)T * N;
    const int parts = split ? 2 : 1;
    const bwg_rows_map ta(xb, parts * (int64_t)T, Kd);
    if (split) {
        const CUtensorMap tb = tma_map_rows(w, N, (int64_t)Kd * 2, bwg_cfg<true>::BN);
        bwg_launch<true, false>(ta, tb, p, T);
    } else {
        const CUtensorMap tb = tma_map_rows(w, N, (int64_t)Kd * 2, bwg_cfg<false>::BN);
        bwg_launch<false, false>(ta, tb, p, T);
    }
}

// The entry points: the checks, then the kernel of the precision (WQ: as bwg_experts; W8 in high
// precision only).
template <int WQ>
static void bwg_experts_entry(float *out, const __nv_bfloat16 *xb, int T, const int32_t *pairs,
                              const int32_t *offsets, int K, const void *gate_up, const void *down,
                              const uint8_t *gate_up_sf, const uint8_t *down_sf, const float *s2,
                              int E, int D, int F, int64_t n_pairs, bool split, __nv_bfloat16 *h,
                              unsigned char *scratch) {
    MS_ASSERT(((uintptr_t)xb & 15) == 0 && ((uintptr_t)h & 15) == 0 &&
              ((uintptr_t)scratch & 255) == 0 && ((uintptr_t)gate_up & 15) == 0 &&
              ((uintptr_t)down & 15) == 0 && ((uintptr_t)gate_up_sf & 3) == 0 &&
              ((uintptr_t)down_sf & 3) == 0 && ((uintptr_t)out & 7) == 0);
    if (n_pairs <= 0) return;
    __nv_bfloat16 *xg = reinterpret_cast<__nv_bfloat16 *>(scratch);
    MS_ASSERT(WQ != 8 || split);
    if (split)
        bwg_experts<true, WQ>(out, xb, T, pairs, offsets, K, gate_up, down, gate_up_sf, down_sf, s2,
                              E, D, F, n_pairs, h, xg);
    else if constexpr (WQ != 8)
        bwg_experts<false, WQ>(out, xb, T, pairs, offsets, K, gate_up, down, gate_up_sf, down_sf,
                               s2, E, D, F, n_pairs, h, xg);
}

void bf16_wgmma_experts(float *out, const __nv_bfloat16 *xb, int T, const int32_t *pairs,
                        const int32_t *offsets, int K, const __nv_bfloat16 *gate_up,
                        const __nv_bfloat16 *down, int E, int D, int F, int64_t n_pairs, bool split,
                        __nv_bfloat16 *h, unsigned char *scratch) {
    bwg_experts_entry<0>(out, xb, T, pairs, offsets, K, gate_up, down, nullptr, nullptr, nullptr, E,
                         D, F, n_pairs, split, h, scratch);
}

// The quantized formats' switches: on unless a variable is 0 (or a test hook's setting), from more
// than a number of pairs an expert on average by another, outside deterministic mode.
//   NVFP4: on unless MOESERVE_W4A16_WGMMA=0; MOESERVE_W4A16_WGMMA_MIN, default BF16's 96 in medium
//          and 56 in high. H200, tiles against the wgmma kernel, us: Qwen3-30B-A3B's experts at 16
//          pairs an expert 260.9 / 335.3 (medium / high) against 384.9 / 532.8, at 64 409.7 / 722.0
//          against 444.5 / 640.6, at 128 963.0 / 1555.6 against 681.0 / 976.2; DeepSeek-V3's
//          shape in high at 16 696.2 against 871.8, at 32 886.2 against 899.6, at 64 1578.6
//          against 1078.5 (docs/benchmarks.md).
//   FP8:   high precision only, on unless MOESERVE_W8A16_WGMMA=0; MOESERVE_W8A16_WGMMA_MIN,
//          default 96 (on the H200 the tiles were faster at 16 and 64 pairs an expert, and on
//          DeepSeek-V3's shape at 16 and 32; there the kernel was 2.6% faster at 64, even at 128).
#define BWG_MIN_UNSET (1 << 30) /* the variable is not set: the defaults */
struct bwg_switch {
    int on, min; // -1: from the variables
    const char *on_var, *min_var;
    int min_high; // the default minimum in high precision (medium: BWG_MIN_PAIRS_PER_EXPERT)
    bool takes(int64_t n_pairs, int E, int D, int F, bool split) {
        const int m = cuda_env_count(min_var, BWG_MIN_UNSET, &min);
        return cuda_env_on(on_var, &on) && !ops_cuda_deterministic() &&
               bwg_takes(n_pairs, E, D, F, split,
                         m != BWG_MIN_UNSET ? m
                         : split            ? min_high
                                            : BWG_MIN_PAIRS_PER_EXPERT);
    }
};
static bwg_switch g_w4 = {-1, -1, "MOESERVE_W4A16_WGMMA", "MOESERVE_W4A16_WGMMA_MIN", 56};
static bwg_switch g_w8 = {-1, -1, "MOESERVE_W8A16_WGMMA", "MOESERVE_W8A16_WGMMA_MIN",
                          BWG_MIN_PAIRS_PER_EXPERT};
static int swap_setting(int *v, int to) { // the test hooks: the new setting in, the old one out
    const int old = *v;
    *v = to;
    return old;
}
// tests: 1 on, 0 off, -1 the variable; the old setting
extern "C" int cuda_moe_w4_wgmma(int on) { return swap_setting(&g_w4.on, on); }
extern "C" int cuda_moe_w8_wgmma(int on) { return swap_setting(&g_w8.on, on); }
// tests: < 0 the variable; the old setting
extern "C" int cuda_moe_w4_wgmma_min(int pairs) { return swap_setting(&g_w4.min, pairs); }
extern "C" int cuda_moe_bf16_wgmma_min(int pairs) { return swap_setting(&g_bf16_min, pairs); }
extern "C" int cuda_moe_bf16_swap_max(int pairs) { return swap_setting(&g_swap_max, pairs); }
extern "C" int cuda_moe_bf16_wgmma_tail(int rows) { return swap_setting(&g_tail, rows); }
// tests: the swapped kernel's A tiles a warpgroup in both precisions (2, 4, 42: as
// MOESERVE_WGMMA_SWAP_NA; -1: the variable or the defaults)
extern "C" void cuda_moe_bf16_swap_na(int na) { g_swap_na[0] = g_swap_na[1] = na; }
// tests: the swapped kernel's GEMM 1 copying x's rows itself (1), from their grouped copy (0), as
// MOESERVE_WGMMA_SWAP_GATHER says (-1); the old setting
extern "C" int cuda_moe_bf16_swap_gather(int on) { return swap_setting(&g_swap_gather, on); }
bool bf16_wgmma_w4_takes(int64_t n_pairs, int E, int D, int F, bool split) {
    return g_w4.takes(n_pairs, E, D, F, split);
}
bool bf16_wgmma_w8_takes(int64_t n_pairs, int E, int D, int F, bool split) {
    return split && g_w8.takes(n_pairs, E, D, F, true);
}
extern "C" int cuda_moe_w4_wgmma_takes(int64_t n_pairs, int E, int D, int F, int high) {
    return bf16_wgmma_w4_takes(n_pairs, E, D, F, high != 0);
}
extern "C" int cuda_moe_w8_wgmma_takes(int64_t n_pairs, int E, int D, int F, int high) {
    return bf16_wgmma_w8_takes(n_pairs, E, D, F, high != 0);
}

void bf16_wgmma_experts_w4(float *out, const __nv_bfloat16 *xb, int T, const int32_t *pairs,
                           const int32_t *offsets, int K, const uint8_t *gate_up,
                           const uint8_t *gate_up_sf, const uint8_t *down, const uint8_t *down_sf,
                           const float *s2, int E, int D, int F, int64_t n_pairs, bool split,
                           __nv_bfloat16 *h, unsigned char *scratch) {
    bwg_experts_entry<4>(out, xb, T, pairs, offsets, K, gate_up, down, gate_up_sf, down_sf, s2, E,
                         D, F, n_pairs, split, h, scratch);
}

void bf16_wgmma_experts_w8(float *out, const __nv_bfloat16 *xb, int T, const int32_t *pairs,
                           const int32_t *offsets, int K, const uint8_t *gate_up,
                           const float *gate_up_s, const uint8_t *down, const float *down_s, int E,
                           int D, int F, int64_t n_pairs, __nv_bfloat16 *h,
                           unsigned char *scratch) {
    bwg_experts_entry<8>(
        out, xb, T, pairs, offsets, K, gate_up, down, reinterpret_cast<const uint8_t *>(gate_up_s),
        reinterpret_cast<const uint8_t *>(down_s), nullptr, E, D, F, n_pairs, true, h, scratch);
}
