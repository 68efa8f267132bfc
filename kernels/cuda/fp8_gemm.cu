// FP8 x FP8 grouped GEMM on Hopper's tensor cores (wgmma, sm_90a), for the experts at prefill
// sizes (issue 8's W8A8 path): both operands E4M3 codes with fp32 block scales, as DeepSeek-V3's
// FP8 recipe has them.
//
//   out[m, n] = sum over 128-k blocks kb of sa[kb, m] sb[e, kb, n] sum_{k in kb} a[m, k] b[e, n, k]
//
// a [M, K]: the tokens' codes, rows grouped by expert (expert e owns rows offsets[e] ..
// offsets[e + 1] - 1; offsets on the device, so no count goes to the host), sa [K / 128, M] a
// scale per token per 128 channels (row-major by k block, so a tile's 128 scales of a k block
// are one line); b [E, N, K] the experts' weight rows (K-major, as stored), sb
// [E, K / 128, N] a scale per weight row and 128-k block (the layout of moe.cu's FP8 experts; a
// checkpoint's 128 x 128 block scale repeated over its rows), equal over each aligned group of 64
// rows: the warp-specialized configurations read one a 64-column half of a tile. K and N are
// multiples of 128.
//
// Tiles: 128 rows x 128 columns a block, two warpgroups of 64 rows, k tiles of 128 (one 128-byte
// row of codes per tile row, the 128-byte swizzle's width). Each k tile is one stage of a ring
// (codes of both operands and their scales; filled by cp.async in configurations 0 to 3, by TMA in
// 4 to 7); each warpgroup runs four m64n128k32 wgmma on it
// into a fresh partial sum, waits for them, and adds the partial into its fp32 total times
// sa[m] sb[n]. The tensor cores' FP8 sums keep fewer bits than fp32 (DeepSeek-V3's report, and
// DeepGEMM, promote every 128 k for that reason); promoting at every k tile keeps at most 128
// products in one tensor-core sum. The blocks of a row of tiles run side by side (n fastest), so
// a tile of A is read from L2 by all its column blocks.
//
// Smem layout of a tile (A or B, 128 rows of 128 bytes; hopper.cuh): row r at 128 r, its 16-byte
// chunk c at chunk c ^ (r % 8): the 128-byte swizzle the wgmma descriptors name (layout type 1),
// with the tile 1024-byte aligned. A descriptor starts at the warpgroup's first row; stepping k by
// 32 (one instruction) adds 32 bytes to the start address, inside the swizzled row.
//
// The CPU reference is the test's (tests/test_cuda_fp8_gemm.c): the same sum in fp64 on the
// decoded codes (kernels/quant.h's fp8_e4m3_to_float) times the scales.
//
// Status: checked against that reference, and timed, on the H200 (the test's figures; cuBLASLt's
// FP8 GEMM at 8192^3 gives 1763 TFLOP/s in the same run):
// - configuration 7 (below: a TMA producer, three consumer warpgroups on tiles of 192 rows that
//   drift apart, a persistent grid): 911, 963, 1107 and 1115 TFLOP/s on 8 experts x 4096 tokens,
//   N 1536 / 4096 at K 2048, N 1536 / 4096 at K 7168 (52, 55, 63 and 63% of cuBLASLt's), storing
//   from registers; with its stores by TMA (TS, below), on an H100 (cuBLASLt 1575 TFLOP/s): 980,
//   1009, 1093 and 1114 (62, 64, 69 and 71%) against 881, 943, 1037 and 1067 the old way;
// - configuration 13 (7 in clusters of two sharing A's tiles, the warpgroups' products in turn):
//   992, 1010, 1158 and 1162 TFLOP/s on that H100 (cuBLASLt 1594) against 7's 979, 1000, 1109 and
//   1119 in the same run; with the producer warpgroup's work split over two warps and the tiles
//   passed to the consumers in the stages (below), 1010, 1058, 1202 and 1193 on an H100
//   (cuBLASLt 1609: 63, 66, 75 and 74%), and 1008, 1061, 1180 and 1167 in GEMM 1's form (h in
//   BF16); configuration 14, the same with the consumers' descriptors in uniform registers, the
//   default from 128 rows an expert (fp8g_config_for): on the H200 (cuBLASLt 1761) 1084, 1121,
//   1235 and 1159 (62, 64, 70 and 66%) against 13's 1025, 1050, 1161 and 1119 in the same run;
// - configuration 5 (two consumer warpgroups, tiles of 128 rows): 861 to 1066 there; 773 at 128
//   experts x 256 tokens (Qwen3-30B-A3B's GEMM 1 over a 4096-token chunk at top-8) and 868 at 256
//   x 128, N 4096, K 7168 (DeepSeek-V3's), where 7 gives 712 and 839; the default from 48 rows
//   an expert to 14's (experts of 8M weights or more: to 96, then 7);
// - configuration 8 (one consumer warpgroup, tiles of 64 rows, two blocks a multiprocessor): 741
//   to 760 there; the default up to 48 rows an expert, where the experts' both GEMMs are as fast
//   as with 5 or up to 1% faster;
// - configuration 0 (a cp.async ring, the block's barrier a stage, both warpgroups in step): 487
//   to 594; 64-column tiles and other depths no better.
// The promotion was the largest cost: with a scale per column (16 shared loads and 64 products
// of scales a k tile a thread, beside the 64 fma) configuration 7 gave 793 to 947 TFLOP/s in the
// same runs; with one B scale a half tile, read before the stage is freed, it is 64 fma. Skipping
// the promotion altogether (the wrong sums, as a bound) gave 1030 to 1275 with L2 at 82% of its
// peak (ncu), so what is left is mostly L2's and the tensor cores' own. Tried and not kept
// (figures in docs/benchmarks.md): 6 stages (configuration 4); clusters of two blocks sharing A's
// tiles through TMA multicast (configuration 6: L2 at 58% instead of 65%, no faster; its remote
// arrivals on the empty barriers once had release.cluster semantics, which halved its rate), and
// the same with three consumer warpgroups (then 43 to 51%: registers spilled; now configuration
// 11, 0 to 5% faster than 7 at K 7168, no faster at K 2048); clusters of four (slower); two
// partial sums a warpgroup, a pair of k tiles started before the wait (no faster than 5, with
// either promotion).
// The experts call it in medium precision from 16 pairs an expert (fp8_gemm.h): GEMM 1 on x's
// codes, and GEMM 2 on h's, h quantized per row per 128 channels with x's formula (as DeepSeek-V3's
// recipe and SGLang's block-FP8 experts quantize the down projection's input; until 2026-12-02
// GEMM 2 kept the W8A16 tiles, which at 16 to 64 pairs an expert took as long as GEMM 1 for half
// its bytes: ncu, H200). The sums inside the tensor cores keep fewer bits than high precision
// allows: 2.3e-4 of sum |a b| at worst in the test, against high's 2^-13 of a row's rms.
//
// Every configuration gives the same bits (the test checks it): the tensor cores' sum of an
// output does not depend on the tile's width.

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "common/log.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/fp8_gemm.h"
#include "kernels/cuda/gemm_common.cuh"
#include "kernels/cuda/hopper.cuh"
#include "kernels/cuda/moe_lean.h"
#include "kernels/quant.h"

#define FP8G_BM      128 /* rows of a tile (two warpgroups of 64) */
#define FP8G_BK      128 /* k of a stage: one 128-byte swizzled row of codes */
#define FP8G_THREADS 256

// One stage: A's codes (16 KiB), B's (BN rows of 128 bytes), A's row scales and B's column
// scales for the stage's k tile, padded to a multiple of 1024 bytes so that every tile stays
// aligned.
#define FP8G_TILE_BYTES (FP8G_BM * FP8G_BK)
template <int BN, int BM = FP8G_BM> struct fp8g_stage {
    static constexpr int bytes = BM * FP8G_BK + BN * FP8G_BK + ((BM + BN) * 4 + 1023) / 1024 * 1024;
};

// d (+)= A[64 x 32] B[BN x 32]^T, fp32 accumulators in the m64nBN fragment layout; accumulate 0
// starts the sum afresh.
template <int BN>
__device__ __forceinline__ void fp8g_wgmma(float (&d)[BN / 2], uint64_t da, uint64_t db,
                                           int accumulate);
template <>
__device__ __forceinline__ void fp8g_wgmma<128>(float (&d)[64], uint64_t da, uint64_t db,
                                                int accumulate) {
    asm volatile("{\n"
                 ".reg .pred p;\n"
                 "setp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {" WGMMA_D64_STR "}, "
                 "%64, %65, p, 1, 1;\n"
                 "}\n"
                 : WGMMA_D64_OUT(d)
                 : "l"(da), "l"(db), "r"(accumulate));
}

template <>
__device__ __forceinline__ void fp8g_wgmma<64>(float (&d)[32], uint64_t da, uint64_t db,
                                               int accumulate) {
    asm volatile("{\n"
                 ".reg .pred p;\n"
                 "setp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {" WGMMA_D32_STR "}, "
                 "%32, %33, p, 1, 1;\n"
                 "}\n"
                 : WGMMA_D32_OUT(d)
                 : "l"(da), "l"(db), "r"(accumulate));
}

// A warpgroup's products of one k tile: the four m64nBNk32 of the stage's A rows (da) and B rows
// (db) into part, a fresh sum, committed as one group and left running.
template <int BN>
__device__ __forceinline__ void fp8g_issue(float (&part)[BN / 2], uint64_t da, uint64_t db) {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
    for (int k = 0; k < FP8G_BK / 32; k++)
        fp8g_wgmma<BN>(part, da + 2 * k, db + 2 * k, k); // + 32 bytes: (32 >> 4) in the address
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
// until at most N of this warpgroup's groups are still running
template <int N> __device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// fp8g_issue, waited for
template <int BN>
__device__ __forceinline__ void fp8g_products(float (&part)[BN / 2], uint64_t da, uint64_t db) {
    fp8g_issue<BN>(part, da, db);
    wgmma_wait<0>();
}

// part into the totals: acc += part sa[row] sb[column], with the stage's scales ssa (the tile's
// rows) and ssb (its columns); rows r0 and r1 = r0 + 8, columns 8 j + c0 and + 1.
template <int BN>
__device__ __forceinline__ void fp8g_promote(float (&acc)[BN / 2], const float (&part)[BN / 2],
                                             const float *ssa, const float *ssb, int r0, int r1,
                                             int c0) {
    const float a0 = ssa[r0], a1 = ssa[r1];
#pragma unroll
    for (int j = 0; j < BN / 8; j++) {
        const float2 bs = *reinterpret_cast<const float2 *>(ssb + 8 * j + c0);
        acc[4 * j] = fmaf(part[4 * j], a0 * bs.x, acc[4 * j]);
        acc[4 * j + 1] = fmaf(part[4 * j + 1], a0 * bs.y, acc[4 * j + 1]);
        acc[4 * j + 2] = fmaf(part[4 * j + 2], a1 * bs.x, acc[4 * j + 2]);
        acc[4 * j + 3] = fmaf(part[4 * j + 3], a1 * bs.y, acc[4 * j + 3]);
    }
}

// The same with one B scale a 64-column half of the tile: x0 = sa[r0] sb[first half], x1 =
// sa[r1] sb[first half], y0 and y1 the same with the second half's (the same products as
// fp8g_promote's where sb is equal over each half, so the same bits).
template <int BN>
__device__ __forceinline__ void fp8g_promote_halves(float (&acc)[BN / 2],
                                                    const float (&part)[BN / 2], float x0, float x1,
                                                    float y0, float y1) {
#pragma unroll
    for (int j = 0; j < BN / 8; j++) {
        const float s0 = j < BN / 16 ? x0 : y0, s1 = j < BN / 16 ? x1 : y1;
        acc[4 * j] = fmaf(part[4 * j], s0, acc[4 * j]);
        acc[4 * j + 1] = fmaf(part[4 * j + 1], s0, acc[4 * j + 1]);
        acc[4 * j + 2] = fmaf(part[4 * j + 2], s1, acc[4 * j + 2]);
        acc[4 * j + 3] = fmaf(part[4 * j + 3], s1, acc[4 * j + 3]);
    }
}

// The totals of tile rows r0 and r1 (those below rows) into out [*, N] from row m0, columns n0 +
// 8 j + c0 and + 1: grouped row m at out's row m, or (out_rows) at row out_rows[m].
template <int BN>
__device__ __forceinline__ void fp8g_store(float *out, const int32_t *out_rows,
                                           const float (&acc)[BN / 2], int m0, int rows, int N,
                                           int n0, int r0, int r1, int c0) {
    const int64_t o0 = r0 < rows ? (out_rows ? __ldg(&out_rows[m0 + r0]) : m0 + r0) : 0;
    const int64_t o1 = r1 < rows ? (out_rows ? __ldg(&out_rows[m0 + r1]) : m0 + r1) : 0;
#pragma unroll
    for (int j = 0; j < BN / 8; j++) {
        const int col = n0 + 8 * j + c0;
        if (r0 < rows)
            *reinterpret_cast<float2 *>(out + o0 * N + col) =
                make_float2(acc[4 * j], acc[4 * j + 1]);
        if (r1 < rows)
            *reinterpret_cast<float2 *>(out + o1 * N + col) =
                make_float2(acc[4 * j + 2], acc[4 * j + 3]);
    }
}

// GATE_UP's store (moe.cu's GEMM 1 epilogue in medium precision, the same formula): the tile's
// first 64 columns are gate sums and its last 64 the up sums of h's columns n0 .. n0 + 63, so
// n8 groups j and j + 8 hold the gate and the up sum of the same element; h [*, F] BF16.
__device__ __forceinline__ void fp8g_store_h(__nv_bfloat16 *h, const float (&acc)[64], int m0,
                                             int rows, int F, int n0, int r0, int r1, int c0) {
#pragma unroll
    for (int j = 0; j < 8; j++) {
        const int col = n0 + 8 * j + c0;
        const float *g = acc + 4 * j, *u = acc + 4 * (j + 8);
        if (r0 < rows)
            *reinterpret_cast<uint32_t *>(h + (int64_t)(m0 + r0) * F + col) =
                pack_bf16x2(silu(g[0]) * u[0], silu(g[1]) * u[1]);
        if (r1 < rows)
            *reinterpret_cast<uint32_t *>(h + (int64_t)(m0 + r1) * F + col) =
                pack_bf16x2(silu(g[2]) * u[2], silu(g[3]) * u[3]);
    }
}

// TS's store (configurations 5, 7 and 11): a consumer warpgroup's 64 rows of the tile
// (all of them the expert's) by TMA through its 16 KB of shared memory at stg, in boxes of 64
// rows x 128 bytes with the 128-byte swizzle, so that the warpgroup goes on to its next tile
// while the copy engine writes: out's fp32 in four boxes of 32 columns, two at a time; GATE_UP's
// h (the same formula as fp8g_store_h) in one box of its 64 columns. to: out (or h) as a byte
// matrix in boxes of 64 rows; y its first row; lr0 the warpgroup's row of r0 (lr0 + 8 that of
// r1); leader the warpgroup's thread 0, which issues the copies; bar its named barrier.
__device__ __forceinline__ uint32_t fp8g_box_at(uint32_t box, int row, int byte) {
    return box + row * 128 + ((((byte >> 4) ^ row) & 7) << 4) + (byte & 15);
}
template <int BN, bool GATE_UP>
__device__ __forceinline__ void fp8g_store_tma(const CUtensorMap *to, uint32_t stg,
                                               const float (&acc)[BN / 2], int y, int n0, int lr0,
                                               int c0, bool leader, int bar) {
    static_assert(BN == 128, "tiles of 128 columns");
    if (leader) bulk_wait_read<0>(); // the last tile's copies have read the staging
    named_bar_sync(bar, 128);
    if constexpr (GATE_UP) {
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const float *g = acc + 4 * j, *u = acc + 4 * (j + 8);
            const int byte = (8 * j + c0) * 2;
            asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(fp8g_box_at(stg, lr0, byte)),
                         "r"(pack_bf16x2(silu(g[0]) * u[0], silu(g[1]) * u[1]))
                         : "memory");
            asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(fp8g_box_at(stg, lr0 + 8, byte)),
                         "r"(pack_bf16x2(silu(g[2]) * u[2], silu(g[3]) * u[3]))
                         : "memory");
        }
        fence_proxy_async();
        named_bar_sync(bar, 128);
        if (leader) {
            tma_store_2d(to, stg, n0 * 2, y);
            bulk_commit();
        }
    } else {
#pragma unroll
        for (int half = 0; half < 2; half++) {
            if (half) {
                if (leader) bulk_wait_read<0>();
                named_bar_sync(bar, 128);
            }
#pragma unroll
            for (int jj = 0; jj < 8; jj++) {
                const int j = 8 * half + jj;
                const uint32_t box = stg + (jj / 4) * 8192;
                const int byte = (8 * (jj % 4) + c0) * 4;
                asm volatile(
                    "st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(fp8g_box_at(box, lr0, byte)),
                    "f"(acc[4 * j]), "f"(acc[4 * j + 1])
                    : "memory");
                asm volatile(
                    "st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(fp8g_box_at(box, lr0 + 8, byte)),
                    "f"(acc[4 * j + 2]), "f"(acc[4 * j + 3])
                    : "memory");
            }
            fence_proxy_async();
            named_bar_sync(bar, 128);
            if (leader) {
                tma_store_2d(to, stg, (n0 + 64 * half) * 4, y);
                tma_store_2d(to, stg + 8192, (n0 + 64 * half + 32) * 4, y);
                bulk_commit();
            }
        }
    }
}

// warp 0's fp8g_tile into s_tile {expert, first row}
__device__ __forceinline__ void fp8g_find_tile(const int32_t *offsets, int E, int y, int *s_tile) {
    const int2 t = group_tile(offsets, E, y, FP8G_BM);
    if ((threadIdx.x & 31) == 0) s_tile[0] = t.x, s_tile[1] = t.y;
}

// The kernel's arguments. Row m of the grouping (expert e: offsets[e] <= m < offsets[e + 1],
// offsets [E + 1] on the device) reads a's row a_rows[m] / topk (a_rows NULL: row m) and sa's of
// the same row (sa [K / 128, sa_rows]); b [E, N, K], sb [E, K / 128, N]; out fp32 with N columns,
// grouped row m at its row out_rows[m] (out_rows NULL: row m), or (GATE_UP) h [rows, N / 2] BF16.
typedef struct {
    float *out;
    const int32_t *out_rows;
    __nv_bfloat16 *h;
    const uint8_t *a;
    const float *sa;
    int64_t sa_rows;
    const int32_t *a_rows;
    int topk;
    const uint8_t *b;
    const float *sb;
    const int32_t *offsets;
    int E, N, K;
} fp8g_args;

// a's row of grouped row m: the token of its pair (a_rows), or m itself
__device__ __forceinline__ int fp8g_a_row(const fp8g_args &p, int m) {
    return p.a_rows ? __ldg(&p.a_rows[m]) / p.topk : m;
}

// Block (n-block x, tile y): tile y of the experts' tiles in expert order (each expert's rows cut
// into tiles of 128); blocks past the last tile return at once (the grid is an upper bound:
// ceil(M / 128) + E tiles).
// GATE_UP (the experts' GEMM 1): b's rows are E blocks of F gate rows then F up rows (N = 2F);
// block x takes h's columns 64 x .. 64 x + 63, the tile's first 64 columns their gate rows and the
// last 64 their up rows, so that a thread holds the gate and the up sum of the same h element
// (n8 groups j and j + 8) and writes h = silu(gate) * up in BF16, rows in grouped order.
template <int STAGES, int BN, bool GATE_UP>
__global__ void __launch_bounds__(FP8G_THREADS, BN == 64 ? 2 : 1)
    fp8_grouped_gemm_kernel(const fp8g_args p) {
#if MOESERVE_WGMMA_DEVICE
    static_assert(!GATE_UP || BN == 128, "GATE_UP: 64 gate and 64 up columns a tile");
    const uint8_t *__restrict__ a = p.a;
    const float *__restrict__ sa = p.sa;
    const int32_t *__restrict__ offsets = p.offsets;
    const int E = p.E, N = p.N, K = p.K;
    extern __shared__ __align__(16) unsigned char fp8g_smem[];
    __shared__ int s_tile[2]; // expert, first row
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = warp >> 2;
    const int nkb = K / FP8G_BK;

    if (warp == 0) fp8g_find_tile(offsets, E, blockIdx.y, s_tile);
    __syncthreads();
    const int e = s_tile[0];
    if (e < 0) return;
    const int m0 = s_tile[1], rows = min(FP8G_BM, __ldg(&offsets[e + 1]) - m0);
    const int n0 = blockIdx.x * (GATE_UP ? BN / 2 : BN); // GATE_UP: h's first column
    constexpr int STAGE_BYTES = fp8g_stage<BN>::bytes;

    // the stages from the first 1024-byte boundary (the launch adds 1024 bytes for it)
    const uint32_t smem_raw = (uint32_t)__cvta_generic_to_shared(fp8g_smem);
    const uint32_t smem0 = (smem_raw + 1023u) & ~1023u;
    unsigned char *const smem_gen = fp8g_smem + (smem0 - smem_raw);
    const uint8_t *b_e = p.b + (int64_t)e * N * K;
    const float *sb_e = p.sb + (int64_t)e * nkb * N;
    // b's row of tile row r: GATE_UP's gate rows, then its up rows (F = N / 2)
    auto b_row = [&](int r) { return GATE_UP && r >= BN / 2 ? N / 2 + n0 + r - BN / 2 : n0 + r; };
    // a's row of each tile row r < rows
    int a_row[FP8G_BM * 8 / FP8G_THREADS];
#pragma unroll
    for (int i = 0; i < FP8G_BM * 8 / FP8G_THREADS; i++) {
        const int r = (i * FP8G_THREADS + tid) >> 3;
        a_row[i] = r >= rows ? 0 : fp8g_a_row(p, m0 + r);
    }
    const int sa_row = tid >= rows ? 0 : fp8g_a_row(p, m0 + tid);
    // stage s: A tile, B tile, A's scales [128], B's scales [128]
    auto stage_a = [&](int s) { return smem0 + s * STAGE_BYTES; };
    auto stage_b = [&](int s) { return stage_a(s) + FP8G_TILE_BYTES; };
    auto stage_sa = [&](int s) { return stage_b(s) + BN * FP8G_BK; };
    auto stage_sb = [&](int s) { return stage_sa(s) + FP8G_BM * 4; };
    auto load = [&](int s, int kb) {
        const int k0 = kb * FP8G_BK;
#pragma unroll
        for (int i = 0; i < FP8G_BM * 8 / FP8G_THREADS; i++) { // 16-byte chunks of each tile
            const int id = i * FP8G_THREADS + tid, r = id >> 3, c = id & 7;
            const uint32_t off = r * 128 + ((c ^ (r & 7)) << 4);
            const bool ok = r < rows;
            cp_async16(stage_a(s) + off, ok ? a + (int64_t)a_row[i] * K + k0 + c * 16 : a,
                       ok ? 16 : 0);
        }
#pragma unroll
        for (int i = 0; i < BN * 8 / FP8G_THREADS; i++) {
            const int id = i * FP8G_THREADS + tid, r = id >> 3, c = id & 7;
            cp_async16(stage_b(s) + r * 128 + ((c ^ (r & 7)) << 4),
                       b_e + (int64_t)b_row(r) * K + k0 + c * 16, 16);
        }
        if (tid < FP8G_BM) {
            const bool ok = tid < rows;
            cp_async4(stage_sa(s) + tid * 4, ok ? sa + kb * p.sa_rows + sa_row : sa, ok ? 4 : 0);
        } else if (tid < FP8G_BM + BN / 4) {
            const int c = tid - FP8G_BM; // 4 columns' scales (the 4 rows never straddle gate / up)
            cp_async16(stage_sb(s) + c * 16, sb_e + (int64_t)kb * N + b_row(4 * c), 16);
        }
    };

#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
        if (s < nkb) load(s, s);
        cp_async_commit();
    }

    float acc[BN / 2], part[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; i++)
        acc[i] = 0.0f;
    // this thread's rows (within the tile) and first column of each n8 group: the m64n128
    // fragment layout, warp w of the warpgroup on rows 16 w .. 16 w + 15
    const int r0 = wg * 64 + (warp & 3) * 16 + (lane >> 2), r1 = r0 + 8;
    const int c0 = 2 * (lane & 3);

    for (int kb = 0; kb < nkb; kb++) {
        const int s = kb % STAGES;
        cp_async_wait<STAGES - 2>();
        // the stage's bytes, written through cp.async, are read by wgmma (the async proxy)
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        __syncthreads();
        // the stage the previous k tile used: every warpgroup has waited for its wgmma there
        if (kb + STAGES - 1 < nkb) load((kb + STAGES - 1) % STAGES, kb + STAGES - 1);
        cp_async_commit();

        fp8g_products<BN>(part, wgmma_desc_sw128(stage_a(s) + wg * 64 * 128),
                          wgmma_desc_sw128(stage_b(s)));
        const float *ssa = reinterpret_cast<const float *>(smem_gen + s * STAGE_BYTES +
                                                           FP8G_TILE_BYTES + BN * FP8G_BK);
        fp8g_promote<BN>(acc, part, ssa, ssa + FP8G_BM, r0, r1, c0);
    }
    cp_async_wait<0>();

    if constexpr (GATE_UP)
        fp8g_store_h(p.h, acc, m0, rows, N / 2, n0, r0, r1, c0);
    else
        fp8g_store<BN>(p.out, p.out_rows, acc, m0, rows, N, n0, r0, r1, c0);
#else
    __trap(); // not built for this device (hopper.cuh)
#endif
}

template <int STAGES, int BN, bool GATE_UP>
static void fp8_grouped_gemm_launch(const fp8g_args &p, int64_t max_rows) {
    auto kernel = fp8_grouped_gemm_kernel<STAGES, BN, GATE_UP>;
    const size_t smem = (size_t)STAGES * fp8g_stage<BN>::bytes + 1024;
    static size_t attr_set = 0;
    cuda_smem_allow(kernel, smem, &attr_set);
    // GATE_UP: F / 64 blocks of 64 gate and 64 up rows, N / BN as well
    const dim3 grid((unsigned)(p.N / BN), (unsigned)((max_rows + FP8G_BM - 1) / FP8G_BM + p.E));
    kernel<<<grid, FP8G_THREADS, smem, cuda_stream()>>>(p);
    CUDA_CHECK_LAUNCH();
}

// ---- the warp-specialized form (configurations 4 to 7, and the experts' GEMM 1) ----
//
// The same tiles and the same sums (four m64n128k32 a k tile, promoted as above), with the loads
// and the products no longer in step: a producer warp only loads, a ring of STAGES stages ahead,
// and each consumer warpgroup (two, or three in configuration 7) waits for the stage it needs
// and frees it on its own, through mbarriers instead of the block's barrier, so one warpgroup's
// promotion runs while another's products do. The kernel is persistent: a block a
// multiprocessor takes tiles t = blockIdx.x, + gridDim.x, ... (n-block t % nx, row tile t / nx,
// so the blocks at work at once share A's row tiles and B's expert), and the ring runs on across
// its tiles, so the next tile's loads go on while the consumers store the last one.
// - The tiles: TMA copies (cp.async.bulk.tensor, the 128-byte swizzle of the layout above) by the
//   producer warp's lane 0, A's 128 (or 192) rows and B's 128 (GATE_UP: its 64 gate and 64 up
//   rows apart). A's rows must be the grouping's (a_rows NULL; a TMA cannot gather), so the
//   experts' GEMM 1 copies its rows into grouped order first. A tile's rows past the expert's
//   are the next expert's (read, never stored) or, past a's last row, zeros.
// - The scales: cp.async by the lanes of the producer warp, or (a producer warpgroup, beside
//   three consumer warpgroups) of its second warp, so that neither warp's instructions a stage
//   (about 140 for both, from one warp sharing its scheduler with three busy consumer warps) set
//   the ring's pace: splitting them took configuration 13 from 207 to 202 us at 8 experts x
//   4096 tokens, N 1536, K 2048, and from 1654 to 1612 at N 4096, K 7168 (H100,
//   docs/benchmarks.md), where a profile had the producer issuing 93% of the time.
// - The tile: the producer looks up each tile (group_tile, two round trips to L2) and its TMA
//   lane writes {rows, first row} into the tile's first stage before arriving, so the consumers
//   read it there once that stage is full instead of looking it up on their own at every tile
//   start (rows -1, in a stage of its own: no tile left).
// A stage's "full" barrier completes when the TMA lane has announced the bytes (arrive.expect_tx),
// those bytes have landed and every scale lane's copies have (cp.async.mbarrier.arrive.noinc,
// one arrival each): 33 arrivals; its "empty" barrier when the consumer warps have taken their
// products of it and read its scales (each warp's lane 0 arrives once its lanes are done; the
// promotion itself runs after).
// Tried: a producer warp that copied both tiles with cp.async (64 copies a lane a stage) ran at a
// third of configuration 0's rate; a producer warpgroup that gathered A's rows with cp.async (one
// row a thread) and a TMA for B took as long as configuration 0 in the experts (550 us for GEMM 1
// of 4096 tokens of Qwen3-30B-A3B, ncu), where the copy into grouped order and A by TMA take
// (see fp8_w8a8_gate_up).

// WG consumer warpgroups, then the producer: one warp beside one or two consumer warpgroups;
// beside three (configuration 7) a warpgroup, so that it can give its registers to the consumers
// (setmaxnreg works a warpgroup at a time): 32 of them, and 160 to each consumer; two of its
// warps work (TMA, scales), the other two leave. One consumer
// warpgroup (configuration 8, tiles of 64 rows) leaves room for two blocks a multiprocessor.
template <int WG> struct fp8g_ws {
    static constexpr bool lend = WG == 3;
    static constexpr int threads = lend ? 128 * WG + 128 : 128 * WG + 32;
    static constexpr int min_blocks = WG == 1 ? 2 : 1;
    static constexpr int producer_regs = 32, consumer_regs = 160;
};
// ta: a [M, K] in boxes of BM / CL rows; tb: b [E N, K] in boxes of 128 rows (GATE_UP: 64). nx:
// the n-blocks of a row tile (CL 2: even).
// CL 2 (configuration 6): clusters of two blocks on two neighbouring n-blocks of the same row
// tile, so they share A's tiles: each block fetches half of a stage's A rows and the TMA writes
// them into both blocks' stage (multicast), which halves A's reads from L2. A stage is then
// refilled only when the consumers of both blocks have freed it: each consumer warp arrives on
// its own block's empty barrier and on the other's (4 WG CL arrivals).
// WG 3 (configuration 7): tiles of 192 rows, three consumer warpgroups on the tensor cores; WG 1
// (configuration 8): tiles of 64 rows, for experts of few rows (a 128-row tile of 16 rows leaves
// its second warpgroup idle), two blocks a multiprocessor, so twice the stages in flight.
// B's scales: one a 64-column half of the tile and k block, its first column's (sb is equal over
// aligned groups of 64 rows), so that a promotion is one fma an accumulator.
// TS 1 (configurations 5, 7 and 11): a consumer warpgroup whose 64 rows are all the expert's, in
// an output of grouped rows, stores them by TMA (fp8g_store_tma, through 16 KB of shared memory
// a warpgroup after the ring) and goes on to its next tile while the copy engine writes; the
// others store from registers. Storing from registers cost 48 of configuration 7's 231 us at 8
// experts x 4096 tokens, N 1536, K 2048, fp32 out (H100; docs/benchmarks.md); as we read it, a
// block's warpgroups stall on their stores together, and every block at the same point.
// The staging a consumer warpgroup, after the ring (1 KB aligned): TS 1 a box of 64 rows of 128
// bytes (two of them, fp32).
template <int TS> struct fp8g_staging {
    static_assert(TS == 0 || TS == 1, "stores from registers, or whole warpgroups' rows by TMA");
    static constexpr int bytes = TS == 0 ? 0 : 16384;
};
// ORD (configuration 13): the consumer warpgroups start their k tiles' products in turn,
// warpgroup 0, 1, (2,) 0, ... (each waits at a named barrier for the one before it to have
// started its own, then lets the next one go), so that the tensor cores take one
// warpgroup's four products after the other's instead of all of them interleaved: the first
// warpgroup's finish a third of the way through and it promotes while the others' run, where
// together they all finished at the end and the tensor cores waited through their promotions.
// A warpgroup with no rows in a tile keeps its turns.
template <int STAGES, bool GATE_UP, int CL, int WG = 2, int TS = 0, bool ORD = false,
          bool LEAN = false>
__global__ void __launch_bounds__(fp8g_ws<WG>::threads, fp8g_ws<WG>::min_blocks)
    fp8_grouped_gemm_ws_kernel(const __grid_constant__ CUtensorMap ta,
                               const __grid_constant__ CUtensorMap tb,
                               const __grid_constant__ CUtensorMap to, const fp8g_args p, int nx) {
#if MOESERVE_WGMMA_DEVICE
    static_assert(CL == 1 || CL == 2, "clusters of one or two blocks");
    static_assert(WG == 2 || WG == 3 || (WG == 1 && CL == 1),
                  "one consumer warpgroup alone, or two or three");
    static_assert(!LEAN || WG == 3, "LEAN: the tiles passed in the stages (three warpgroups)");
    typedef fp8g_ws<WG> W;
    constexpr int BN = 128, BM = 64 * WG, STAGE_BYTES = fp8g_stage<BN, BM>::bytes;
    constexpr int STG = fp8g_staging<TS>::bytes; // a consumer warpgroup's staging (TS)
    extern __shared__ __align__(16) unsigned char fp8g_smem[];
    __shared__ __align__(8) uint64_t bars[2 * STAGES]; // full[s], then empty[s]
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int N = p.N, K = p.K, nkb = K / FP8G_BK;
    const uint32_t bar0 = (uint32_t)__cvta_generic_to_shared(bars);
    auto full = [&](int s) { return bar0 + 8 * s; };
    auto empty = [&](int s) { return bar0 + 8 * (STAGES + s); };
    if (tid == 0) {
        for (int s = 0; s < STAGES; s++) {
            mbar_init(full(s), 33);
            mbar_init(empty(s), 4 * WG * CL); // the consumer warps of the cluster
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    if constexpr (CL > 1)
        cluster_sync_all(); // the other block's barriers are ready for this one's copies
    else
        __syncthreads();
    // the cluster's blocks take the same row tiles: t over groups of CL n-blocks, rank r the
    // group's n-block CL (t % (nx / CL)) + r
    const int rank = CL > 1 ? (int)(blockIdx.x & (CL - 1)) : 0;
    const int t0 = blockIdx.x / CL, dt = gridDim.x / CL, nxc = nx / CL;
    auto n_block = [&](int t) { return CL * (t % nxc) + rank; };
    // this warp is done with stage s: its lanes have read it (wgmma waited for), then lane 0
    // tells both blocks' empty barriers
    auto release = [&](int s) {
        __syncwarp();
        if (lane == 0) {
            mbar_arrive(empty(s));
#pragma unroll
            for (int r = 1; r < CL; r++)
                mbar_arrive_cluster(empty(s), rank ^ r);
        }
    };
    const uint32_t smem_raw = (uint32_t)__cvta_generic_to_shared(fp8g_smem);
    const uint32_t smem0 = (smem_raw + 1023u) & ~1023u;
    const unsigned char *const smem_gen = fp8g_smem + (smem0 - smem_raw);
    auto stage_a = [&](int s) { return smem0 + s * STAGE_BYTES; };
    auto stage_b = [&](int s) { return stage_a(s) + BM * FP8G_BK; };
    auto stage_sa = [&](int s) { return stage_b(s) + BN * FP8G_BK; };
    auto stage_sb = [&](int s) { return stage_sa(s) + BM * 4; };
    // a producer warpgroup (W::lend) passes each tile's {rows, first row} to the consumers in the
    // tile's first stage, after B's scales (rows -1: no tile left); else each role looks it up
    constexpr bool TILE_IN_STAGE = W::lend;
    auto stage_tile = [&](int s) { return stage_sb(s) + 16; };
    // it: the k tiles this thread's role has gone through, over all the block's tiles
    int it = 0;

    if (warp >= 4 * WG) { // the producer
        // a producer warpgroup (W::lend): its first warp issues the TMA copies, its second the
        // scales' cp.async; a producer warp alone does both
        if constexpr (W::lend) {
            setmaxnreg_dec<W::producer_regs>();
            if (warp > 4 * WG + 1) return;
        }
        const bool do_tma = !W::lend || warp == 4 * WG, do_scales = !W::lend || warp > 4 * WG;
        if (lane == 0 && do_tma) {
            asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&ta))
                         : "memory");
            asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&tb))
                         : "memory");
        }
        for (int t = t0;; t += dt) {
            const int2 tile = group_tile(p.offsets, p.E, t / nxc, BM);
            const int e = tile.x, m0 = tile.y;
            if (e < 0) {
                if (!TILE_IN_STAGE) break;
                // the consumers' sign to stop: a stage of its own, its 33 arrivals
                const int s = it % STAGES;
                mbar_wait(empty(s), ((it / STAGES) & 1) ^ 1);
                if (lane == 0 && do_tma) {
                    asm volatile("st.shared.v2.s32 [%0], {%1, %1};\n" ::"r"(stage_tile(s)), "r"(-1)
                                 : "memory");
                    mbar_arrive(full(s));
                }
                if (do_scales) mbar_arrive(full(s));
                break;
            }
            const int rows = min(BM, __ldg(&p.offsets[e + 1]) - m0);
            const int n0 = n_block(t) * (GATE_UP ? BN / 2 : BN); // GATE_UP: h's first column
            const float *sb_e = p.sb + (int64_t)e * nkb * N;
            const int b_row = e * N + n0; // GATE_UP: the up rows from b_row + N / 2
            // lanes 0 and 1: the scale column of the tile's first and second half (GATE_UP: of
            // its gate and up rows)
            const int sb_col = lane == 0 ? n0 : GATE_UP ? N / 2 + n0 : n0 + 64;
            for (int kb = 0; kb < nkb; kb++, it++) {
                const int s = it % STAGES, k0 = kb * FP8G_BK;
                mbar_wait(empty(s), ((it / STAGES) & 1) ^ 1);
                if (lane == 0 && do_tma) {
                    if (TILE_IN_STAGE && kb == 0) // the tile for the consumers (released by
                                                  // the arrival)
                        asm volatile("st.shared.v2.s32 [%0], {%1, %2};\n" ::"r"(stage_tile(s)),
                                     "r"(rows), "r"(m0)
                                     : "memory");
                    mbar_arrive_tx(full(s), BM * FP8G_BK + BN * FP8G_BK);
                    if constexpr (CL > 1) // this block's share of A's rows, into every block
                        tma_load_2d_multicast(stage_a(s) + rank * (BM * FP8G_BK / CL), &ta, k0,
                                              m0 + rank * (BM / CL), full(s), (1 << CL) - 1);
                    else
                        tma_load_2d(stage_a(s), &ta, k0, m0, full(s));
                    if (GATE_UP) {
                        tma_load_2d(stage_b(s), &tb, k0, b_row, full(s));
                        tma_load_2d(stage_b(s) + 64 * FP8G_BK, &tb, k0, b_row + N / 2, full(s));
                    } else {
                        tma_load_2d(stage_b(s), &tb, k0, b_row, full(s));
                    }
                }
                if (!do_scales) continue;
#pragma unroll
                for (int i = 0; i < BM / 32; i++) {
                    const int r = lane + 32 * i;
                    const bool ok = r < rows;
                    cp_async4(stage_sa(s) + r * 4, ok ? p.sa + kb * p.sa_rows + m0 + r : p.sa,
                              ok ? 4 : 0);
                }
                if (lane < 2) cp_async4(stage_sb(s) + lane * 4, sb_e + (int64_t)kb * N + sb_col, 4);
                // the stage's full barrier hears from this lane once its copies have landed
                asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(full(s))
                             : "memory");
            }
        }
        if (do_scales) asm volatile("cp.async.wait_all;\n" ::: "memory");
    } else {
        if constexpr (W::lend) setmaxnreg_inc<W::consumer_regs>();
        // the consumers: warpgroup wg (warps 4 wg .. 4 wg + 3) on the tile's rows 64 wg ..
        // LEAN: the warpgroup and the tile's rows broadcast from lane 0, so that the compiler
        // knows them warp-uniform and builds the descriptors in uniform registers
        const int wg = LEAN ? __shfl_sync(0xffffffffu, warp >> 2, 0) : warp >> 2;
        const int r0 = wg * 64 + (warp & 3) * 16 + (lane >> 2), r1 = r0 + 8;
        const int c0 = 2 * (lane & 3);
        // ORD's turns: named barrier 4 + w (the 256 threads of warpgroups w - 1 and w) tells
        // warpgroup w that w - 1 has started its products; the last warpgroup lets 0 start first
        auto turn_wait = [&] {
            if constexpr (ORD) named_bar_sync(4 + wg, 256);
        };
        auto turn_pass = [&] {
            if constexpr (ORD) named_bar_arrive(4 + (wg + 1) % WG, 256);
        };
        if (ORD && wg == WG - 1) turn_pass();
        for (int t = t0;; t += dt) {
            int rows, m0;
            if constexpr (TILE_IN_STAGE) { // from the tile's first stage
                mbar_wait(full(it % STAGES), (it / STAGES) & 1);
                asm volatile("ld.shared.v2.s32 {%0, %1}, [%2];\n"
                             : "=r"(rows), "=r"(m0)
                             : "r"(stage_tile(it % STAGES))
                             : "memory");
                if constexpr (LEAN) {
                    rows = __shfl_sync(0xffffffffu, rows, 0);
                    m0 = __shfl_sync(0xffffffffu, m0, 0);
                }
                if (rows < 0) break;
            } else {
                const int2 tile = group_tile(p.offsets, p.E, t / nxc, BM);
                if (tile.x < 0) break;
                m0 = tile.y;
                rows = min(BM, __ldg(&p.offsets[tile.x + 1]) - m0);
            }
            const int n0 = n_block(t) * (GATE_UP ? BN / 2 : BN);
            if (wg * 64 >= rows) { // no rows here (an expert's last, short tile): the stages only
                for (int kb = 0; kb < nkb; kb++, it++) {
                    mbar_wait(full(it % STAGES), (it / STAGES) & 1);
                    turn_wait();
                    turn_pass();
                    release(it % STAGES);
                }
                continue;
            }
            float acc[BN / 2], part[BN / 2];
#pragma unroll
            for (int i = 0; i < BN / 2; i++)
                acc[i] = 0.0f;
            // the scales of stage s: the tile's rows', then its columns'
            auto scales = [&](int s) {
                return reinterpret_cast<const float *>(smem_gen + s * STAGE_BYTES + BM * FP8G_BK +
                                                       BN * FP8G_BK);
            };
            // LEAN: stage s's descriptors are stage 0's plus s stages (the address field is the
            // shared address / 16, below 2^14 in every stage, so the sums never carry)
            const uint64_t da0 = wgmma_desc_sw128(stage_a(0) + wg * 64 * 128);
            const uint64_t db0 = wgmma_desc_sw128(stage_b(0));
            for (int kb = 0; kb < nkb; kb++, it++) {
                // k tile it: its stage waited for, its products into part; then part into the
                // totals, the scales of rows r0 and r1 times each half's (the stage is free once
                // they are read)
                const int s = LEAN ? (int)((unsigned)it % STAGES) : it % STAGES;
                mbar_wait(full(s), LEAN ? ((unsigned)it / STAGES) & 1 : (it / STAGES) & 1);
                turn_wait();
                if constexpr (LEAN)
                    fp8g_issue<BN>(part, da0 + (uint32_t)s * (STAGE_BYTES >> 4),
                                   db0 + (uint32_t)s * (STAGE_BYTES >> 4));
                else
                    fp8g_issue<BN>(part, wgmma_desc_sw128(stage_a(s) + wg * 64 * 128),
                                   wgmma_desc_sw128(stage_b(s)));
                turn_pass();
                wgmma_wait<0>();
                const float *ss = scales(s);
                const float a0 = ss[r0], a1 = ss[r1], b0 = ss[BM], b1 = ss[BM + 1];
                const float g0 = a0 * b0, g1 = a1 * b0, u0 = a0 * b1, u1 = a1 * b1;
                release(s);
                fp8g_promote_halves<BN>(acc, part, g0, g1, u0, u1);
            }
            if (TS && (GATE_UP || !p.out_rows) && rows - 64 * wg >= 64)
                fp8g_store_tma<BN, GATE_UP>(&to, stage_a(STAGES) + wg * STG, acc, m0 + 64 * wg, n0,
                                            r0 - 64 * wg, c0, (tid & 127) == 0, 1 + wg);
            else if constexpr (GATE_UP)
                fp8g_store_h(p.h, acc, m0, rows, N / 2, n0, r0, r1, c0);
            else
                fp8g_store<BN>(p.out, p.out_rows, acc, m0, rows, N, n0, r0, r1, c0);
        }
        if (TS) bulk_wait<0>();          // the copies done before the block leaves
        if (ORD && wg == 0) turn_wait(); // the last warpgroup's last pass, so none is left open
    }
    // no block leaves while the other may still write into it or arrive on its barriers
    if constexpr (CL > 1) cluster_sync_all();
#else
    __trap(); // not built for this device (hopper.cuh)
#endif
}

// a has max_rows rows (the tiles' bound, and the A map's). CL 2 where the n-blocks pair up (else
// CL 1): as many clusters as the device holds at once, so that none waits for another's tiles.
template <int STAGES, bool GATE_UP, int CL, int WG = 2, int TS = 0, bool ORD = false,
          bool LEAN = false>
static void fp8_grouped_gemm_ws_launch(const fp8g_args &p, int64_t max_rows) {
    constexpr int BM = 64 * WG;
    // GATE_UP: F / 64 n-blocks of 64 gate and 64 up rows, N / 128 as well
    const int nx = p.N / 128;
    if (nx % CL) {
        fp8_grouped_gemm_ws_launch<STAGES, GATE_UP, 1, WG, TS, ORD, LEAN>(p, max_rows);
        return;
    }
    auto kernel = fp8_grouped_gemm_ws_kernel<STAGES, GATE_UP, CL, WG, TS, ORD, LEAN>;
    // TS: each consumer warpgroup's staging after the ring
    const size_t smem =
        (size_t)STAGES * fp8g_stage<128, BM>::bytes + WG * fp8g_staging<TS>::bytes + 1024;
    static size_t attr_set = 0;
    cuda_smem_allow(kernel, smem, &attr_set);
    MS_ASSERT(!p.a_rows);
    const CUtensorMap ta = tma_map_rows(p.a, max_rows, p.K, BM / CL);
    const CUtensorMap tb = tma_map_rows(p.b, (int64_t)p.E * p.N, p.K, GATE_UP ? 64 : 128);
    // TS: out [max_rows, N] fp32 or h [max_rows, N / 2] BF16, as bytes (else unused: ta again)
    const CUtensorMap to = !TS       ? ta
                           : GATE_UP ? tma_map_rows(p.h, max_rows, p.N, 64)
                                     : tma_map_rows(p.out, max_rows, 4 * (int64_t)p.N, 64);
    const int64_t tiles = (int64_t)nx * ((max_rows + BM - 1) / BM + p.E);

    cudaLaunchConfig_t cfg = {};
    cfg.blockDim = dim3(fp8g_ws<WG>::threads);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = cuda_stream();
    cudaLaunchAttribute attr[1] = {cuda_cluster_attr(CL, 1, 1)};
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    static int resident = 0; // clusters the device holds at once
    if (!resident) {
        cfg.gridDim = dim3((unsigned)CL);
        CUDA_CHECK(cudaOccupancyMaxActiveClusters(&resident, kernel, &cfg));
        MS_ASSERT(resident > 0);
    }
    cfg.gridDim = dim3((unsigned)(CL * std::min<int64_t>(tiles / CL, resident)));
    CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, ta, tb, to, p, nx));
}

// The tile configuration: 0 128 columns and 4 stages, 1 128 and 3, 2 64 columns and 4 stages (two
// blocks a multiprocessor), 3 64 and 6, 4 the warp-specialized form with 6 stages, 5 with 4, 6
// with 4 and clusters of two blocks, 7 with 4 and tiles of 192 rows, 8 with 4 and tiles of 64 rows,
// 9 as 7 storing from registers (7's form before TS), 11 as 7 in clusters of two sharing A's
// tiles (TS: 5, 7 and 11 store whole warpgroups' rows by TMA), 13 as 11 with the warpgroups'
// products in turn (ORD), 14 as 13 with LEAN (the consumers' descriptors in uniform registers:
// 141 instructions a k tile against 155, no R2UR, in the sm_90a SASS; on the H200, 8 experts x
// 4096 tokens, N 1536 / 4096 at K 2048 and 7168, 62, 64, 70 and 66% of cuBLASLt's FP8 peak against
// 13's 58, 60, 66 and 64%, docs/benchmarks.md "FP8 x FP8 at prefill sizes: configuration 14 on
// the H200");
// -1 (the default), by the rows an expert on average: 8 up to FP8G_WG1_MAX, 5 above it, 14 from
// FP8G_ORD_MIN; experts of N K from FP8G_LARGE weights (DeepSeek-V3's, 29M and 15M a GEMM, against
// Qwen3-30B-A3B's 3.1M and 1.6M) take 7 from 96 and 14 from FP8G_ORD_MIN_LARGE. Random routing
// spreads an expert's rows around the mean, so a tile of about the mean leaves half the experts a
// second, nearly empty tile, and those experts' long k loops make it cost. H100, since the
// producer warpgroup's split (test_cuda_moe --fp8-timing T C, Qwen3-30B-A3B's experts, both GEMMs
// in medium, us, two runs each, docs/benchmarks.md): 32 rows an expert 273.5 (8) against 276.0 (5)
// and 277.3 (13); 48 rows 295.1 all three; 64 rows 346.7 (8) against 314.7 (5) and 316.6 (13); 96
// rows 416.7 / 360.9 / 363.9; 128 rows 502.3 / 428.7 / 400.4; 192 rows 686.2 / 568.4 / 556.3; 256
// rows 705.8 (5) against 682.4 (13) and 695.0 (7); 512 rows 1199.5 (13) against 1220.4 (7).
// DeepSeek-V3's shape (--deepseek-fp8-timing with $FP8G_CONFIG, 32 experts): 32 rows 531.9 (8)
// against 538.2 (5); 64 rows 571.5 (5) against 668.0 (8) and 572.4 (13); 96 rows 601.1 (5), 603.6
// (7), 604.9 (13); 128 rows 647.5 (7) and 643.6 (13) against 734.7 (5). Before the split (H200)
// 64-row tiles were faster up to 128 rows (451.2 against 462.0 us there), and 13 lost 2.6% against
// 7 at 128 rows of DeepSeek-V3's experts in the 8-expert test (test_cuda_fp8_gemm, H100). The
// experts' GEMM 1 (128 columns only) takes 4 to 8 as they are (after copying its rows into grouped
// order), 1 as it is and the others as 0.
static int g_fp8g_config = -1;
#define FP8G_WG1_MAX       48        /* rows an expert on average, at most, for 64-row tiles */
#define FP8G_LARGE         (8 << 20) /* weights an expert's matrix from which 7 and 14 change */
#define FP8G_ORD_MIN       128       /* rows an expert on average, at least, for configuration 14 */
#define FP8G_ORD_MIN_LARGE 384       /* the same for large experts (7 from 96 below it) */

// the configuration for M rows over E experts of N x K weights
static int fp8g_config_for(int64_t M, int E, int N, int K) {
    const bool large = (int64_t)N * K >= FP8G_LARGE;
    const int64_t ord_min = large ? FP8G_ORD_MIN_LARGE : FP8G_ORD_MIN;
    const int64_t wg3_min = large ? 96 : FP8G_ORD_MIN;
    return g_fp8g_config >= 0              ? g_fp8g_config
           : M >= ord_min * (int64_t)E     ? 14
           : M >= wg3_min * (int64_t)E     ? 7
           : M > FP8G_WG1_MAX * (int64_t)E ? 5
                                           : 8;
}

extern "C" int cuda_fp8_grouped_gemm_config(int config) {
    const int old = g_fp8g_config;
    g_fp8g_config = config;
    return old;
}

// Configuration `config`'s kernel over a's max_rows rows, in the fp32 output's form (out) or
// GATE_UP's (H: h in BF16, whose tiles are 128 columns, 64 gate and 64 up: the 64-column
// configurations 2 and 3 take 0's form there).
template <bool H> static void fp8g_launch(const fp8g_args &p, int64_t max_rows, int config) {
    constexpr int BN64 = H ? 128 : 64;
    switch (config) {
    case 1: fp8_grouped_gemm_launch<3, 128, H>(p, max_rows); break;
    case 2: fp8_grouped_gemm_launch<4, BN64, H>(p, max_rows); break;
    case 3: fp8_grouped_gemm_launch<H ? 4 : 6, BN64, H>(p, max_rows); break;
    case 4: fp8_grouped_gemm_ws_launch<6, H, 1>(p, max_rows); break;
    case 5: fp8_grouped_gemm_ws_launch<4, H, 1, 2, 1>(p, max_rows); break;
    case 6: fp8_grouped_gemm_ws_launch<4, H, 2>(p, max_rows); break;
    case 7: fp8_grouped_gemm_ws_launch<4, H, 1, 3, 1>(p, max_rows); break;
    case 8: fp8_grouped_gemm_ws_launch<4, H, 1, 1>(p, max_rows); break;
    case 9: fp8_grouped_gemm_ws_launch<4, H, 1, 3>(p, max_rows); break;
    case 11: fp8_grouped_gemm_ws_launch<4, H, 2, 3, 1>(p, max_rows); break;
    case 13: fp8_grouped_gemm_ws_launch<4, H, 2, 3, 1, true>(p, max_rows); break;
    case 14: fp8_grouped_gemm_ws_launch<4, H, 2, 3, 1, true, true>(p, max_rows); break;
    default: fp8_grouped_gemm_launch<4, 128, H>(p, max_rows); break; // 0
    }
}

// cuda_fp8_grouped_gemm's and cuda_fp8_grouped_gemm_h's operands, checked (out: the output,
// aligned to out_align bytes), as the kernel's arguments without the output.
static fp8g_args fp8g_grouped_args(const void *out, uintptr_t out_align, const uint8_t *a,
                                   const float *sa, const uint8_t *b, const float *sb,
                                   const int32_t *offsets, int E, int M, int N, int K) {
    MS_ASSERT(K % FP8G_BK == 0 && N % 128 == 0 && K > 0 && cuda_wgmma_device());
    MS_ASSERT(((uintptr_t)a & 15) == 0 && ((uintptr_t)b & 15) == 0 && ((uintptr_t)sb & 15) == 0 &&
              ((uintptr_t)out & (out_align - 1)) == 0);
    return {.a = a,
            .sa = sa,
            .sa_rows = M,
            .b = b,
            .sb = sb,
            .offsets = offsets,
            .E = E,
            .N = N,
            .K = K};
}

void cuda_fp8_grouped_gemm(float *out, const uint8_t *a, const float *sa, const uint8_t *b,
                           const float *sb, const int32_t *offsets, int E, int M, int N, int K) {
    if (M <= 0 || N <= 0 || E <= 0) return;
    fp8g_args p = fp8g_grouped_args(out, 8, a, sa, b, sb, offsets, E, M, N, K);
    p.out = out;
    fp8g_launch<false>(p, M, fp8g_config_for(M, E, N, K));
}

// For tests (test_cuda_fp8_gemm): cuda_fp8_grouped_gemm's operands, b's rows per expert F gate
// rows then F up rows (N = 2F), into h [M, F] BF16 = silu(gate sums) * (up sums), grouped row m
// at h's row m: the experts' GEMM 1 on codes already in grouped order.
extern "C" void cuda_fp8_grouped_gemm_h(uint16_t *h, const uint8_t *a, const float *sa,
                                        const uint8_t *b, const float *sb, const int32_t *offsets,
                                        int E, int M, int N, int K) {
    if (M <= 0 || N <= 0 || E <= 0) return;
    fp8g_args p = fp8g_grouped_args(h, 4, a, sa, b, sb, offsets, E, M, N, K);
    p.h = reinterpret_cast<__nv_bfloat16 *>(h);
    fp8g_launch<true>(p, M, fp8g_config_for(M, E, N, K));
}

// ---- the experts' GEMM 1 (fp8_gemm.h) ----

// x [T, D] (D % 128 == 0; fp32, or BF16 for the experts' h) to E4M3 codes q [T, D], packed per 64
// k as the W8A16 weights are (fp8_w8_pack64), and scales s [D / 128, T]: the FP8 payload's formula
// (elementwise.cu's moe_input_fp8_kernel, kernels/cpu/quant.c): s = max(amax, 1e-10) / 448, q =
// e4m3(x / s). A warp per (row, 128 channels), eight a block (a block a row left most warps idle:
// ncu, 28 us for the experts' h at 8192 rows of 768, H200); rows from *n_rows on (n_rows non-NULL:
// the grouped rows' end, offsets[E]) are left alone.
#define FP8_CODES_WARPS 8
template <class IN>
__global__ void fp8_act_codes_kernel(uint8_t *q, float *s, const IN *x, int64_t T, int D,
                                     const int32_t *n_rows) {
    __shared__ uint8_t codes[FP8_CODES_WARPS][FP8G_BK];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, G = D / FP8G_BK;
    const int64_t i = (int64_t)blockIdx.x * FP8_CODES_WARPS + warp, t = i / G;
    const int g = (int)(i % G);
    if (t >= T || (n_rows && t >= __ldg(n_rows))) return; // the whole warp
    const IN *xg = x + t * D + g * FP8G_BK;
    float v[4], m = 0.0f;
#pragma unroll
    for (int k = 0; k < 4; k++) {
        v[k] = (float)xg[lane + 32 * k];
        const float av = fabsf(v[k]);
        m = av > m ? av : m; // NaN never wins
    }
    for (int off = 16; off > 0; off >>= 1)
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    const float sc = __fdiv_rn(m > 1e-10f ? m : 1e-10f, FP8_E4M3_MAX);
#pragma unroll
    for (int k = 0; k < 4; k++)
        codes[warp][lane + 32 * k] = fp8_e4m3_from_float(__fdiv_rn(v[k], sc));
    __syncwarp();
    // lane l writes packed bytes 4 l .. 4 l + 3: 64-k chunk l / 16, fp8_w8_pack64's t = l % 16 / 4
    // and s = l % 4, bytes j = k 16 s + 2 t + {0, 8, 1, 9}
    const int ch = lane >> 4, tt = (lane & 15) >> 2, ss = lane & 3;
    const uint8_t *src = codes[warp] + 64 * ch + 16 * ss + 2 * tt;
    const uint32_t w =
        (uint32_t)src[0] | (uint32_t)src[8] << 8 | (uint32_t)src[1] << 16 | (uint32_t)src[9] << 24;
    reinterpret_cast<uint32_t *>(q + t * D + g * FP8G_BK)[lane] = w;
    if (lane == 0) s[g * T + t] = sc;
}

// fp8_act_codes_kernel over T rows of D
template <class IN>
static void fp8_act_codes(uint8_t *q, float *s, const IN *x, int64_t T, int D,
                          const int32_t *n_rows) {
    const int64_t warps = T * (D / FP8G_BK);
    fp8_act_codes_kernel<IN><<<(unsigned)((warps + FP8_CODES_WARPS - 1) / FP8_CODES_WARPS),
                               32 * FP8_CODES_WARPS, 0, cuda_stream()>>>(q, s, x, T, D, n_rows);
    CUDA_CHECK_LAUNCH();
}

// From more than MOESERVE_W8A8_MIN pairs an expert on average: default 15 (H200, Qwen3-30B-A3B's
// experts, medium, against the W8A16 tiles: 16 pairs an expert 253.9 us against 274.3, 32 278.2
// against 320.0; 48 until 2026-12-02). Not where the lean kernels take the size (moe.cu tries them
// first; MOESERVE_FP8_LEAN=1 takes them up to 16 pairs an expert).
bool fp8_w8a8_takes(int64_t n_pairs, int E, int D, int F) {
    static int on = -1, min = -1;
    return n_pairs > (int64_t)cuda_env_count("MOESERVE_W8A8_MIN", 15, &min) * E &&
           D % FP8G_BK == 0 && F % 64 == 0 && D > 0 && F > 0 &&
           ops_cuda_matmul_precision() == MATMUL_PRECISION_MEDIUM && !ops_cuda_deterministic() &&
           cuda_env_on("MOESERVE_W8A8", &on) && cuda_wgmma_device() &&
           !moe_lean_w8_rows(n_pairs, E, D, F, false, false);
}

extern "C" int cuda_moe_fp8_w8a8(int64_t n_pairs, int E, int D, int F) {
    return fp8_w8a8_takes(n_pairs, E, D, F);
}

bool fp8_w8a8_down_takes(int64_t n_pairs, int E, int D, int F) {
    static int on = -1;
    return cuda_env_on("MOESERVE_W8A8_DOWN", &on) && F % FP8G_BK == 0 &&
           fp8_w8a8_takes(n_pairs, E, D, F);
}

extern "C" int cuda_moe_fp8_w8a8_down(int64_t n_pairs, int E, int D, int F) {
    return fp8_w8a8_down_takes(n_pairs, E, D, F);
}

// Grouped row m of q [T, D] and s [D / 128, T] (the token of pair pairs[m]) into qg [m, D] and
// sg [D / 128, n] (n: the grid, the call's pairs): A's rows in the order the TMA reads them. A
// block a row, 16 bytes a thread. Past the grouped rows (offsets[E]: skipped slots never enter
// the grouping) pairs holds no pair ids, and the block does nothing.
__global__ void fp8_rows_group_kernel(uint8_t *qg, float *sg, const uint8_t *q, const float *s,
                                      int T, const int32_t *pairs, const int32_t *offsets, int E,
                                      int topk, int D) {
    const int64_t m = blockIdx.x, n = gridDim.x;
    if (m >= __ldg(&offsets[E])) return;
    const int64_t t = __ldg(&pairs[m]) / topk;
    const int G = D / FP8G_BK;
    const uint4 *src = reinterpret_cast<const uint4 *>(q + t * D);
    uint4 *dst = reinterpret_cast<uint4 *>(qg + m * D);
    for (int i = threadIdx.x; i < D / 16; i += blockDim.x)
        dst[i] = __ldg(&src[i]);
    for (int i = threadIdx.x; i < G; i += blockDim.x)
        sg[i * n + m] = __ldg(&s[i * (int64_t)T + t]);
}

// codes and scales of n rows of D, each part from a 256-byte boundary
static size_t fp8_rows_bytes(int64_t n, int D) {
    return ((size_t)n * D + 255) / 256 * 256 +
           ((size_t)n * (D / FP8G_BK) * sizeof(float) + 255) / 256 * 256;
}

size_t fp8_w8a8_scratch_bytes(int T, int64_t n_pairs, int D, int F) {
    return fp8_rows_bytes(T, D) + fp8_rows_bytes(n_pairs, D) + fp8_rows_bytes(n_pairs, F);
}

void fp8_w8a8_gate_up(__nv_bfloat16 *h, const float *x, int T, int D, int F, const int32_t *pairs,
                      int K, const uint8_t *w, const float *wsc, const int32_t *offsets, int E,
                      int64_t n_pairs, unsigned char *scratch) {
    MS_ASSERT(D % FP8G_BK == 0 && F % 64 == 0 && ((uintptr_t)w & 15) == 0 &&
              ((uintptr_t)wsc & 15) == 0 && ((uintptr_t)scratch & 255) == 0);
    if (T <= 0 || n_pairs <= 0) return;
    // the tokens' codes and scales, then (the warp-specialized form) the grouped rows' copies
    uint8_t *q = scratch;
    float *s = reinterpret_cast<float *>(scratch + ((size_t)T * D + 255) / 256 * 256);
    uint8_t *qg = scratch + fp8_rows_bytes(T, D);
    float *sg = reinterpret_cast<float *>(qg + ((size_t)n_pairs * D + 255) / 256 * 256);
    fp8_act_codes<float>(q, s, x, T, D, NULL);
    fp8g_args p = {.h = h,
                   .a = q,
                   .sa = s,
                   .sa_rows = T,
                   .a_rows = pairs,
                   .topk = K,
                   .b = w,
                   .sb = wsc,
                   .offsets = offsets,
                   .E = E,
                   .N = 2 * F,
                   .K = D};
    const int config = fp8g_config_for(n_pairs, E, 2 * F, D);
    if (config >= 4) {
        fp8_rows_group_kernel<<<(unsigned)n_pairs, 128, 0, cuda_stream()>>>(qg, sg, q, s, T, pairs,
                                                                            offsets, E, K, D);
        CUDA_CHECK_LAUNCH();
        p.a = qg;
        p.sa = sg;
        p.sa_rows = n_pairs;
        p.a_rows = NULL;
    }
    fp8g_launch<true>(p, n_pairs, config);
}

void fp8_w8a8_down(float *out, const __nv_bfloat16 *h, int T, int D, int F, const int32_t *pairs,
                   const uint8_t *w, const float *wsc, const int32_t *offsets, int E,
                   int64_t n_pairs, unsigned char *scratch) {
    MS_ASSERT(D % FP8G_BK == 0 && F % FP8G_BK == 0 && ((uintptr_t)w & 15) == 0 &&
              ((uintptr_t)wsc & 15) == 0 && ((uintptr_t)scratch & 255) == 0);
    if (n_pairs <= 0) return;
    // h's codes and scales, past the regions fp8_w8a8_gate_up used
    uint8_t *q = scratch + fp8_rows_bytes(T, D) + fp8_rows_bytes(n_pairs, D);
    float *s = reinterpret_cast<float *>(q + ((size_t)n_pairs * F + 255) / 256 * 256);
    fp8_act_codes<__nv_bfloat16>(q, s, h, n_pairs, F, offsets + E);
    const fp8g_args p = {.out = out,
                         .out_rows = pairs,
                         .a = q,
                         .sa = s,
                         .sa_rows = n_pairs,
                         .b = w,
                         .sb = wsc,
                         .offsets = offsets,
                         .E = E,
                         .N = D,
                         .K = F};
    fp8g_launch<false>(p, n_pairs, fp8g_config_for(n_pairs, E, D, F));
}

// For tests (test_cuda_fp8_gemm): fp8_w8a8_down on device buffers with a scratch of its own (kept
// for the next call, grown as needed); h BF16 [n_pairs, F] in grouped order, the weights as
// cuda_prepare_experts_fp8 leaves them. Waits for the kernels unless nowait (timing).
extern "C" void cuda_fp8_w8a8_down(float *out, const uint16_t *h, const int32_t *pairs,
                                   const int32_t *offsets, int E, int64_t n_pairs, int D, int F,
                                   const uint8_t *w, const float *wsc, int nowait) {
    static unsigned char *scratch = NULL;
    static size_t have = 0;
    const size_t need = fp8_w8a8_scratch_bytes(0, n_pairs, D, F);
    if (need > have) {
        CUDA_CHECK(cudaStreamSynchronize(cuda_stream()));
        CUDA_CHECK(cudaFree(scratch));
        CUDA_CHECK(cudaMalloc(&scratch, need));
        have = need;
    }
    fp8_w8a8_down(out, reinterpret_cast<const __nv_bfloat16 *>(h), 0, D, F, pairs, w, wsc, offsets,
                  E, n_pairs, scratch);
    if (!nowait) CUDA_CHECK(cudaStreamSynchronize(cuda_stream()));
}
