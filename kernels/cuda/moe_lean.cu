// NVFP4 experts at decode sizes (up to 32 pairs of an expert a tile) with the weights as wgmma's
// A operand from registers (moe_lean.h). moe.cu's W4A16 tiles take the weights as mma.sync's B
// operand and x through ldmatrix: about 4.7 instructions a weight, about half the copy rate.
// scripts/bench_nvfp4_decode.cu's w4a16 form of the same decode is 3.0 (docs/benchmarks.md, "No
// device time (2026-12-05, sixteenth session)"); this is that form on moe.cu's data. Checked on
// an H100 and an H200 (test_cuda_moe --nvfp4: the tiles' bits) and timed on both
// (docs/benchmarks.md, "One H100 and one H200 (2026-12-06, seventeenth session)"): DeepSeek-V3's
// experts in medium, in a chain, at 2 to 8 pairs an expert 78 to 86% of the copy rate on the H100
// (form 1) against the tiles' 65 to 70%, 56 to 64% on the H200 against 48 to 49%; behind the tiles
// on Qwen3-30B-A3B's small experts at T = 1, which the default rule leaves to them. At 16 pairs an
// expert form 6 (two consumer warpgroups of two row tiles each, one block an SM) is ahead of the
// tiles on the H100 (twentieth session: DeepSeek-V3's 70.5 / 57% against 58 / 43%; FP8 in high
// 81 to 84% against 70%), and the producer's arrival one stage after a stage's copies instead of
// S - 1 (LAG) took DeepSeek-V3's NVFP4 experts at 8 pairs an expert from 82 / 70% to 85 / 75%.
//
// A block is one tile of an expert's pairs (at most NT, the tokens of wgmma's N) and 64 weight
// rows: GEMM 1's 32 gate rows and the 32 up rows of the same columns, or GEMM 2's 64 down rows.
// Warps 0-3 are one consumer warpgroup, warp 4 the producer (form 2: two consumer warpgroups, 128
// rows, warp 8 the producer; form 5: 128 rows, the one warpgroup taking both 64-row tiles in turn,
// each on its own sums; form 6: 256 rows, two such warpgroups; lean_form). A stage is 256 k:
//   - two TMA boxes of 32 rows x 128 bytes of codes (128-byte swizzle) and two of 32 rows x 16
//     scale bytes, on the stage's full barrier with their bytes;
//   - the tile's activation rows, 256 k of each in BF16 (split: then their lo parts), copied by
//     the producer's 32 lanes with cp.async into the 128-byte swizzled K-major layout wgmma reads
//     through a descriptor (8-row groups 1024 bytes apart; rows past the tile zeros); a lane
//     arrives on the full barrier once its copies have landed (a ring's length less one stage
//     later, cp.async.wait_group) and a proxy fence has made them visible to wgmma.
// A consumer thread (warp w, lane 4 g + q) holds A rows g and g + 8 of its warp's 16: GEMM 1's
// gate and up rows of column 8 w + g, so that silu(gate) x up is formed in registers; GEMM 2's
// rows 16 w + g and + 8. The tiles' layout (nvfp4_pack_kernel) gives lane q of a row one word a
// 64-k chunk for two k16 steps: registers a0 and a2 of a step come from row g's word, a1 and a3
// from row g + 8's, each through wq_decode and one bf16x2 product by its group scale, as the
// tiles decode their B fragments. The k16 steps go in increasing k, each one m64nNTk16 wgmma on the
// running sums (split: the hi part, then the lo part), as the tiles' one chain does: form 0 issues
// a stage's 16 as one group after decoding them all, forms 1 and 2 as four groups of a 64-k chunk,
// each chunk decoded while the one before runs; form 4 is form 1 with two groups' scales a
// register (lean_scale_pair), form 3 that with more blocks an SM, form 5 that with two row tiles a
// warpgroup (a chunk's group a row tile, the tiles in turn), form 6 form 5 with two warpgroups.
// The default picks by the tile's rows (lean_form_now).
// FP8 experts (W8) take the same kernels with a stage of 128 k, one block of the checkpoint's
// scales: the codes are as many bytes a stage (lane q's 16 bytes of a row's 64-k chunk, a word a
// k16 step in fp8_pack_kernel's layout, decoded by fp8_w8_decode and one bf16x2 product by 2^120,
// as the tiles decode theirs), the scales a TMA box of the block's 32 fp32 scales a box of rows
// ([E, Kd / 128, rows]); each block's sums start at zero and are folded into the totals times the
// row's scale by __fmaf_rn at the stage's end, as the tiles fold them. On an H100 (docs/
// benchmarks.md, "One H100 (2026-12-06, eighteenth session)"), DeepSeek-V3's experts in a chain
// at 1 to 8 pairs an expert: 95 to 100% of the copy rate in medium, 93 to 99% in high, against
// the tiles' 89 to 98% and 81 to 91%.
// The epilogues are the tiles': the tensor scales by __fmul_rn, silu(gate) x up rounded to BF16
// (split: hi and lo), GEMM 2's rows in fp32 to out by pair.
#include "kernels/cuda/moe_lean.h"

#include <algorithm>
#include <type_traits>

#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/gemm_common.cuh"
#include "kernels/cuda/hopper.cuh"
#include "kernels/quant.h"

typedef __nv_bfloat16 bf16;

#define LEAN_BK     256 /* k a stage */
#define LEAN_BOX    32  /* weight rows a TMA box, two a stage */
#define LEAN_CODES  (2 * LEAN_BOX * 128) /* 8192 */
#define LEAN_SF     (2 * LEAN_BOX * 16)  /* 1024 */

// The kernels' forms (moe_lean_kernel's FORM): 0 a stage's products in one group, one consumer
// warpgroup; 1 in four groups (pipe); 2 in four groups, two consumer warpgroups (wg) sharing the
// stage's activations, each with its own 64 weight rows; 3 as 1 with more blocks an SM (dense)
// and the scales two groups a register (pairs); 4 as 1 with the pairs; 5 as 4 with two 64-row
// tiles (rt) a consumer warpgroup sharing the stage's activations, as form 2's warpgroups do; 6
// as 5 with two consumer warpgroups (256 weight rows a stage, one block an SM).
template <int FORM> struct lean_form {
    static constexpr bool pipe = FORM >= 1;
    static constexpr int wg = FORM == 2 || FORM == 6 ? 2 : 1; // consumer warpgroups
    static constexpr int rt = FORM >= 5 ? 2 : 1;              // 64-row tiles a consumer warpgroup
    static constexpr int vw = wg * rt;           // 64-row tiles a block: the stage's layout
    static constexpr bool dense = FORM == 3;
    static constexpr bool pairs = FORM >= 3; // the scales two groups a register
    static constexpr int threads = 128 * wg + 32;
};

template <int NT, bool SPLIT, int WG = 1, bool DENSE = false, bool W8 = false> struct lean_stage {
    // k a stage: NVFP4 256 (128 code bytes a row), FP8 128 (as many bytes, one block of scales)
    static constexpr int bk = W8 ? LEAN_BK / 2 : LEAN_BK;
    static constexpr int part = NT * 128 * (bk / 64); // NT rows x 128 bytes, an atom a 64 k
    // the stage's code bytes, then its scale bytes (from codes), then the activations (codes +
    // sf). FP8: a box's 32 block scales (fp32) in 128 bytes, the room padded to 1024; sf_tx the
    // scale bytes TMA brings
    static constexpr int codes = WG * LEAN_CODES, sf = W8 ? 1024 : WG * LEAN_SF;
    static constexpr int sf_tx = W8 ? 2 * WG * 128 : sf;
    static constexpr int bytes = codes + sf + (SPLIT ? 2 : 1) * part;
    static_assert(sf_tx <= sf, "the scales in their room");
    static_assert(bytes % 1024 == 0, "stages on the swizzle's 1024-byte pattern");
    // blocks an SM (4-row tiles as 8-row ones): 8-row tiles four (their launch bounds hold them to
    // 96 registers a thread, which four blocks of 160 threads allow; 16-row tiles spill there and
    // take three), and as many stages (2 to 4) as fit them: 8 rows 4 in medium (13 KB a stage), 3
    // in high (17 KB; 4-row tiles 13 KB, 4);
    // 16 rows 4 in medium (17 KB), 2 in high (25 KB). That keeps 72 to 144 KB of weights in
    // flight an SM; the copy rate times a 1.5 us latency over 132 SMs is about 48
    // 32-row tiles two (their registers would allow three, the stages not): 4 in medium (25 KB),
    // 2 in high (41 KB); 24-row tiles as those. 128 rows a block (WG here: form 2's two warpgroups
    // of 288 threads, pipe up to 96 registers; form 5's one, 96 to 148 registers): two blocks, 110
    // KB each. DENSE (form 3: form 1's 79 and 88 registers allow it): 8-row tiles five blocks (3
    // stages in medium, 2 in high; the shared memory sized for five, but at 78 to 88 registers a
    // 5-warp block's warps fit 5 or 6 to a scheduler, so 4 run: ncu's occupancy, docs/
    // benchmarks.md, twenty-second session), 16-row tiles four (3, 2). 256 rows a block (form 6):
    // one block, 224 KB, so that 32-row tiles keep three stages of 36 KB of weights in flight in
    // medium (four of 52 KB), two in high (three of 68 KB), where form 5's two blocks keep two and
    // one of 18 KB each
    static constexpr int blocks = WG == 4    ? 1
                                  : WG == 2  ? 2
                                  : NT <= 8  ? (DENSE ? 5 : 4)
                                  : NT == 16 ? (DENSE ? 4 : 3)
                                             : 2;
    // what the launch bounds ask: 4 of the dense 8-row tiles (ptxas held to 80 registers
    // serializes their wgmma; form 1's 79 registers let 5 fit anyway)
    static constexpr int bound = DENSE && NT <= 8 ? 4 : blocks;
    static constexpr int room = (WG == 4    ? 224
                                 : WG == 2  ? 110
                                 : NT <= 8  ? (DENSE ? 42 : 53)
                                 : NT == 16 ? (DENSE ? 54 : 74)
                                            : 110) *
                                1024;
    static constexpr int stages = room / bytes > 4 ? 4 : room / bytes < 2 ? 2 : room / bytes;
    static constexpr size_t smem = (size_t)stages * bytes + 1024; // + the alignment
};

// The places the kernels and the host check (cuda_moe_lean_host_check) share.
// The weight rows of a stage's box (two a consumer warpgroup, WG of them), block column nb: GEMM
// 1's warpgroup w the gate rows nb 32 WG + 32 w .. (box 2 w) and the up rows of the same columns
// (2 w + 1), GEMM 2's rows nb 64 WG + 32 box ..
__host__ __device__ inline int lean_wrow(bool gate_up, int box, int e, int w_rows, int nb, int N,
                                         int WG) {
    if (gate_up) return e * w_rows + nb * WG * LEAN_BOX + (box >> 1) * LEAN_BOX + (box & 1) * N;
    return e * w_rows + nb * WG * 2 * LEAN_BOX + box * LEAN_BOX;
}
// A rows g and g + 8 of consumer warp w (0 .. 4 WG - 1) as {box, row}: GEMM 1's gate and up rows
// of column 8 w + g, GEMM 2's rows 16 w + g and + 8
struct lean_rows {
    int bg, rg, bh, rh;
};
__host__ __device__ inline lean_rows lean_a_rows(bool gate_up, int warp, int g) {
    if (gate_up)
        return {2 * (warp >> 2), 8 * (warp & 3) + g, 2 * (warp >> 2) + 1, 8 * (warp & 3) + g};
    return {warp >> 1, 16 * (warp & 1) + g, warp >> 1, 16 * (warp & 1) + g + 8};
}
// the output column of A row g of warp w: GEMM 1's h column (its row g + 8 the same column's up
// row), GEMM 2's out column (row g + 8: + 8)
__host__ __device__ inline int lean_out_col(bool gate_up, int nb, int warp, int g, int WG) {
    return gate_up ? nb * WG * LEAN_BOX + 8 * warp + g : nb * WG * 2 * LEAN_BOX + 16 * warp + g;
}
// byte offset in a stage of lane q's word pair (8 bytes) of 64-k chunk c of box b's row r: unit
// 2 c + q / 2 of the row, the 128-byte swizzle TMA writes
__host__ __device__ inline int lean_word_off(int b, int r, int c, int q) {
    return b * LEAN_BOX * 128 + r * 128 + (((2 * c + (q >> 1)) ^ (r & 7)) * 16) + 8 * (q & 1);
}
// FP8: byte offset in a stage of lane q's 16 bytes (a word a k16 step, fp8_pack_kernel's layout)
// of 64-k chunk c (0, 1) of box b's row r: unit 4 c + q of the row, swizzled as above
__host__ __device__ inline int lean_word8_off(int b, int r, int c, int q) {
    return b * LEAN_BOX * 128 + r * 128 + (((4 * c + q) ^ (r & 7)) * 16);
}
// byte offset in an activation part of token row n's 16-byte chunk u (8 k) of the stage: atom
// u / 8 (64 k), the 128-byte swizzle wgmma's descriptor reads
template <int NT> __host__ __device__ inline int lean_act_off(int u, int n) {
    return (u / 8) * (NT * 128) + n * 128 + (((u % 8) ^ (n & 7)) * 16);
}
// k16 step k's B operand: its start in the activation part (atom k / 4, 32 bytes a step)
template <int NT> __host__ __device__ constexpr int lean_b_off(int k) {
    return (k / 4) * (NT * 128) + (k % 4) * 32;
}
// Stacked (high precision, lean_stack_on): x's hi and lo parts as one B of 2 NT rows, their 8-row
// groups in turn (hi rows 0-7, lo rows 0-7, hi 8-15, ...), so that one wgmma of n 2 NW takes a
// tile's first NW columns' hi and lo products: row n's part p (0 hi, 1 lo) at B row
// 16 (n / 8) + 8 p + n % 8 of atoms of 2 NT rows. 4-row tiles: the hi rows 0-3, then the lo rows,
// one 8-row group (B row 4 p + n), so that n8 takes both.
template <int NT> __host__ __device__ constexpr int lean_stack_row(int n, int p) {
    return NT == 4 ? 4 * p + n : 16 * (n / 8) + 8 * p + n % 8;
}
template <int NT> __host__ __device__ inline int lean_act_off_stacked(int u, int n, int p) {
    const int br = lean_stack_row<NT>(n, p);
    return (u / 8) * (2 * NT * 128) + br * 128 + (((u % 8) ^ (br & 7)) * 16);
}

struct lean_args {
    const bf16 *act; // GATE_UP: xb [T, Kd], rows by pair / topk; else h [n, Kd] in grouped order
    int64_t act_lo;  // split: elements from act to its lo part
    const int32_t *pairs;
    const int4 *tiles;
    const int32_t *n_tiles;
    bf16 *h; // GATE_UP's output [n, N] (split: the lo parts h_lo elements on)
    int64_t h_lo;
    float *out;       // GEMM 2's output [T K, N], rows by pair
    const float *ws2; // NVFP4's tensor scales [E, 3] (FP8: none)
    int Kd, N, topk, n_col_blocks, w_rows;
    int narrow; // MOESERVE_LEAN_NARROW: 24-row tiles of up to 16 rows on wgmma's n16
    // TINY (no prepare kernel): GEMM 1's x [T, Kd] in fp32 and the n_ids expert ids of topk_ids
    // over E experts, which each block groups itself (tiny_group); h rows are pair ids
    const float *x;
    const int32_t *topk_ids, *n_rows; // n_rows: NULL, or the device count of tokens to take
    int n_ids, E;
};

// Groups 2 h and 2 h + 1 of a word of four scale bytes as one pair of BF16 scales (lo, hi): each
// half as wq_scale2 makes it (byte c to (c << 4) + WQ_SF_BIAS), two groups for one PRMT and one
// IMAD; lean_mul_half takes one half of it in both lanes, which the multiply reads as an operand
// swizzle (HMUL2's .H0_H0 / .H1_H1), so that the products are the tiles' to the bit.
__device__ __forceinline__ uint32_t lean_scale_pair(uint32_t scales, int h) {
    return __byte_perm(scales, 0, h ? 0x4342 : 0x4140) * 16u + (WQ_SF_BIAS | WQ_SF_BIAS << 16);
}
__device__ __forceinline__ uint32_t lean_mul_half(uint32_t x, uint32_t s, int hi) {
    uint32_t d;
    if (hi)
        asm("{.reg .b16 l, h;\n .reg .b32 t;\n mov.b32 {l, h}, %2;\n mov.b32 t, {h, h};\n "
            "mul.rn.bf16x2 %0, %1, t;}\n"
            : "=r"(d)
            : "r"(x), "r"(s));
    else
        asm("{.reg .b16 l, h;\n .reg .b32 t;\n mov.b32 {l, h}, %2;\n mov.b32 t, {l, l};\n "
            "mul.rn.bf16x2 %0, %1, t;}\n"
            : "=r"(d)
            : "r"(x), "r"(s));
    return d;
}

// Stacked (lean_act_off_stacked): sum i of an n8 block j (i = 4 j + r) as the hi sums in the
// accumulators' block 2 j plus the lo sums in block 2 j + 1
__device__ __forceinline__ float lean_hi_lo(const float *acc, int i) {
    return __fadd_rn(acc[i + 4 * (i / 4)], acc[i + 4 * (i / 4) + 4]);
}

// A fragments that an issued wgmma may still read: a use the compiler must keep them intact for,
// placed after the wait that retires it.
__device__ __forceinline__ void lean_keep(uint32_t (&f)[4][4]) {
#pragma unroll
    for (int i = 0; i < 4; i++)
        asm volatile("" : "+r"(f[i][0]), "+r"(f[i][1]), "+r"(f[i][2]), "+r"(f[i][3])::"memory");
}

// TINY: 0 after the prepare kernel; 1 no prepare kernel (each block groups topk_ids itself), high
// precision; 2 the same in medium precision, x's and h's lo parts zero (GEMM 1 stores zeros for
// x's and writes no h lo, GEMM 2 fills its lo rows with zeros), so that the stacked sums are the
// hi products' alone, medium precision's, on the 4-row tiles' wgmma of n8
template <bool GATE_UP, bool SPLIT, int NT, int FORM, bool W8, bool STACK, int TINY>
__global__ void
__launch_bounds__(lean_form<FORM>::threads,
                  lean_stage<NT, SPLIT, lean_form<FORM>::vw, lean_form<FORM>::dense, W8>::bound)
    moe_lean_kernel(const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tsf,
                    const lean_args a) {
#if MOESERVE_WGMMA_DEVICE
    constexpr bool PIPE = lean_form<FORM>::pipe, PAIRS = lean_form<FORM>::pairs && !W8;
    constexpr int WG = lean_form<FORM>::wg, RT = lean_form<FORM>::rt, VW = WG * RT;
    typedef lean_stage<NT, SPLIT, VW, lean_form<FORM>::dense, W8> L;
    constexpr int S = L::stages, SB = L::bytes, BK = L::bk, KS = BK / 16; // k16 steps a stage
    // STACK (lean_stack_on): high precision's hi and lo products of a k16 step as one wgmma's
    // columns (lean_act_off_stacked), in two sums added at the end
    static_assert(!STACK || SPLIT, "stacked: high precision");
    static_assert(NT != 4 || (STACK && !W8), "4-row tiles: NVFP4 stacked alone");
    static_assert(!TINY || NT == 4 || (W8 && NT == 8 && TINY == 1 && !STACK),
                  "TINY: NVFP4's 4-row tiles, FP8's 8-row tiles in one chain");
    extern __shared__ __align__(1024) unsigned char lean_smem[];
    __shared__ __align__(8) uint64_t bars[2 * S];
    const uint32_t raw0 = (uint32_t)__cvta_generic_to_shared(lean_smem);
    const uint32_t smem0 = (raw0 + 1023u) & ~1023u; // the swizzle's pattern
    const unsigned char *smem = lean_smem + (smem0 - raw0);
    const uint32_t bar0 = (uint32_t)__cvta_generic_to_shared(bars);
    auto full = [&](int s) { return bar0 + 8 * s; };
    auto empty = [&](int s) { return bar0 + 8 * (S + s); };
    if (GATE_UP) { // the prepare kernel's outputs; GEMM 2 may take the SMs as blocks finish
        pdl_wait();
        pdl_trigger();
    }
    // GEMM 2 reads the tile table before its wait: the prepare kernel wrote it, complete before
    // GEMM 1's blocks passed their waits (and so before this grid could launch). TINY: each block
    // groups topk_ids itself (warp 0, tiny_group: the tiny path's tiles, its rows' pair ids and
    // tokens in s_tiny), GEMM 2 before its wait too (the ids were complete before GEMM 1's blocks
    // passed theirs)
    const int tile = blockIdx.x / a.n_col_blocks, nb = blockIdx.x % a.n_col_blocks;
    __shared__ int s_tiny[TINY ? 2 + 2 * NT : 1]; // {expert, rows}, pair ids [NT], tokens [NT]
    int e, row0 = 0, rows;
    if constexpr (TINY) {
        if (threadIdx.x < 32) { // warp 0
            const int n = a.n_rows ? min(a.n_ids, max(0, __ldcg(a.n_rows)) * a.topk) : a.n_ids;
            tiny_group(a.topk_ids, n, a.E, NT, a.topk, tile, s_tiny, s_tiny + 2, s_tiny + 2 + NT);
        }
    } else {
        if (tile >= __ldcg(a.n_tiles)) return; // idle block of the upper-bound grid
        const int4 ti = __ldcg(&a.tiles[tile]);
        e = ti.x, row0 = ti.y, rows = ti.z - ti.y;
    }
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    if (tid == 0) {
        for (int s = 0; s < S; s++) {
            mbar_init(full(s), 1 + 32);  // the TMA lane's arrival, the producer lanes' copies
            mbar_init(empty(s), 4 * WG); // each consumer warp
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    if constexpr (TINY) {
        e = s_tiny[0], rows = s_tiny[1];
        if (e < 0) return; // idle block of the upper-bound grid
    }
    // TINY: row r's pair id (GEMM 1's h row, GEMM 2's activation and output row) and token
    [[maybe_unused]] auto pair_of = [&](int r) { return s_tiny[2 + r]; };
    const int nk = a.Kd / BK;

    if (warp == 4 * WG) { // the producer
        auto weights = [&](int kt, int s) {
            if (lane == 0) {
                const uint32_t st = smem0 + s * SB;
                mbar_arrive_tx(full(s), L::codes + L::sf_tx);
#pragma unroll
                for (int b = 0; b < 2 * VW; b++) {
                    const int wr = lean_wrow(GATE_UP, b, e, a.w_rows, nb, a.N, VW);
                    tma_load_2d(st + b * LEAN_BOX * 128, &tq, kt * 128, wr, full(s));
                    if constexpr (W8) // the box's 32 scales of block kt: [E, nk, w_rows] fp32
                        tma_load_2d(st + L::codes + b * 128, &tsf, (wr - e * a.w_rows) * 4,
                                    e * nk + kt, full(s));
                    else
                        tma_load_2d(st + L::codes + b * LEAN_BOX * 16, &tsf, kt * 16, wr, full(s));
                }
            }
        };
        int pre = 0;
        if (!GATE_UP) { // the first stages' weights before the wait for h
            pre = min(S, nk);
            for (int kt = 0; kt < pre; kt++)
                weights(kt, kt);
            pdl_wait();
        }
        // this lane's activation row n = lane % NT (NULL past the tile: zeros) and its chunks of
        // 8 k, u = lane / NT + (32 / NT) j
        const int n = lane % NT;
        const bf16 *src = nullptr;
        if (TINY && n < rows)
            src = GATE_UP ? nullptr : a.act + (int64_t)pair_of(n) * a.Kd; // GEMM 1: xs below
        else if (n < rows)
            src =
                a.act + (int64_t)(GATE_UP ? __ldcg(&a.pairs[row0 + n]) / a.topk : row0 + n) * a.Kd;
        // TINY's GEMM 1: row n's x in fp32, a stage's chunks loaded one stage ahead into xr and
        // converted to BF16 (split: hi and lo) as the prepare kernel converts them (prep_convert)
        constexpr bool XF = TINY && GATE_UP;
        constexpr int XCH = NT * BK / 256; // chunks of 8 k a lane a stage
        [[maybe_unused]] const float *xs =
            XF && n < rows ? a.x + (int64_t)s_tiny[2 + NT + n] * a.Kd : nullptr;
        [[maybe_unused]] float4 xr[XF ? XCH : 1][2];
        [[maybe_unused]] auto x_load = [&](int kt) {
#pragma unroll
            for (int j = 0; j < XCH; j++) {
                const int u = lane / NT + (32 / NT) * j;
                const float4 *p = reinterpret_cast<const float4 *>(xs + kt * BK + u * 8);
                xr[j][0] = xs ? __ldcg(p) : make_float4(0.f, 0.f, 0.f, 0.f);
                xr[j][1] = xs ? __ldcg(p + 1) : make_float4(0.f, 0.f, 0.f, 0.f);
            }
        };
        if constexpr (XF) x_load(0);
        // a stage's copies are one group. A lane makes its group of stage kt visible to wgmma
        // (the async proxy: a proxy fence once it has landed) and arrives for the stage one
        // stage later (LAG), so that its wait does not hold back the next stage's loads: their
        // group was requested a round before. The arrival for stage kt comes after the loads of
        // stage kt + LAG, which wait for the release of stage kt + LAG - S; with LAG = S - 1 (as
        // until the twentieth session) the consumers, done with stage kt - 1, waited for the
        // producer's next round (its wake-up, the loads' issue) before they could start stage kt
        // (H100: DeepSeek-V3's experts at 8 pairs an expert 70 -> 75% of the copy rate in high,
        // docs/benchmarks.md). With two stages LAG 0 was slower in high on 8-row tiles.
        constexpr int LAG = 1;
        int s = 0, ph = 0;
        for (int kt = 0; kt < nk; kt++) {
            if (kt >= pre) {
                mbar_wait(empty(s), ph ^ 1);
                weights(kt, s);
            }
            const uint32_t act = smem0 + s * SB + L::codes + L::sf;
            if constexpr (XF) { // x's chunks of this stage converted, the next stage's loaded
#pragma unroll
                for (int j = 0; j < XCH; j++) {
                    const int u = lane / NT + (32 / NT) * j;
                    uint4 hi, lo{};
                    if constexpr (SPLIT)
                        split_bf16x8(xr[j][0], xr[j][1], &hi, &lo);
                    else
                        hi = pack_bf16x8(xr[j][0], xr[j][1]);
                    if constexpr (TINY == 2) lo = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
                    for (int part = 0; part < (SPLIT ? 2 : 1); part++) {
                        const uint4 w = part ? lo : hi;
                        const uint32_t dst = STACK ? act + lean_act_off_stacked<NT>(u, n, part)
                                                   : act + lean_act_off<NT>(u, n) + part * L::part;
                        asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(dst),
                                     "r"(w.x), "r"(w.y), "r"(w.z), "r"(w.w)
                                     : "memory");
                    }
                }
                if (kt + 1 < nk) x_load(kt + 1);
            }
            // lane n copies chunks u of row n % NT; 24-row tiles: lanes 0 to 23 their row's all
            constexpr bool ROW_LANES = NT == 24;
#pragma unroll
            for (int j = 0; j < (XF ? 0 : ROW_LANES ? BK / 8 : NT * BK / 256); j++) {
                if (ROW_LANES && lane >= NT) break;
                const int u = ROW_LANES ? j : lane / NT + (32 / NT) * j; // chunk of the stage's BK
                const bf16 *p = src ? src + kt * BK + u * 8 : a.act;
#pragma unroll
                for (int part = 0; part < (SPLIT ? 2 : 1); part++) {
                    const uint32_t dst = STACK ? act + lean_act_off_stacked<NT>(u, n, part)
                                               : act + lean_act_off<NT>(u, n) + part * L::part;
                    cp_async16(dst, p + (src ? part * a.act_lo : 0),
                               src && !(TINY == 2 && part) ? 16 : 0); // TINY 2: h's lo none
                }
            }
            cp_async_commit();
            if (kt >= LAG) {
                cp_async_wait<LAG>();
                fence_proxy_async();
                mbar_arrive(full((kt - LAG) % S));
            }
            if (++s == S) s = 0, ph ^= 1;
        }
        cp_async_wait<0>();
        fence_proxy_async();
        for (int kt = max(0, nk - LAG); kt < nk; kt++)
            mbar_arrive(full(kt % S));
        return;
    }

    // the consumers: A rows g and g + 8 of the warp, as box b row r, in each of its RT row tiles
    // (row tile t: the rows of warp w + 4 WG t of the stage's layout)
    const int g = lane >> 2, q = lane & 3;
    int bg[RT], rg[RT], bh[RT], rh[RT];
#pragma unroll
    for (int t = 0; t < RT; t++) {
        const lean_rows ar = lean_a_rows(GATE_UP, warp + 4 * WG * t, g);
        bg[t] = ar.bg, rg[t] = ar.rg, bh[t] = ar.bh, rh[t] = ar.rh;
    }
    // acc: the running sums (FP8: of the stage's block of 128 k, folded into tot times their
    // rows' block scales at its end, as the tiles do)
    constexpr int NA = STACK ? NT : NT / 2; // accumulators a row tile
    float acc[RT][NA], tot[RT][W8 ? NT / 2 : 1];
#pragma unroll
    for (int t = 0; t < RT; t++) {
#pragma unroll
        for (int i = 0; i < NA; i++)
            acc[t][i] = 0.0f;
#pragma unroll
        for (int i = 0; i < (W8 ? NT / 2 : 1); i++)
            tot[t][i] = 0.0f;
    }
    // the stage loop; NARROW: 24-row tiles of 16 rows or fewer (a.narrow), whose products take
    // wgmma's n16 (the first 16 of the tile's columns, the same sums) for a third less work
    auto stages = [&](auto narrow_c) {
        constexpr bool NARROW = decltype(narrow_c)::value;
        constexpr int NW = NARROW ? 16 : NT;
        int s = 0, ph = 0;
        for (int kt = 0; kt < nk; kt++) {
            mbar_wait(full(s), ph);
            const unsigned char *st = smem + s * SB;
            // NVFP4: a word pair a 64-k chunk and row (4 chunks), the rows' group scale bytes; FP8:
            // 16 bytes a chunk and row (2 chunks), a word a k16 step
            [[maybe_unused]] uint2 wg[RT][W8 ? 1 : 4], wh[RT][W8 ? 1 : 4];
            [[maybe_unused]] uint4 cg[RT][W8 ? 2 : 1], chh[RT][W8 ? 2 : 1];
            [[maybe_unused]] uint32_t sgw[RT][4] = {}, shw[RT][4] = {};
#pragma unroll
            for (int t = 0; t < RT; t++) {
                if constexpr (W8) {
#pragma unroll
                    for (int c = 0; c < 2; c++) {
                        cg[t][c] = *reinterpret_cast<const uint4 *>(
                            st + lean_word8_off(bg[t], rg[t], c, q));
                        chh[t][c] = *reinterpret_cast<const uint4 *>(
                            st + lean_word8_off(bh[t], rh[t], c, q));
                    }
                } else {
#pragma unroll
                    for (int c = 0; c < 4; c++) {
                        wg[t][c] = *reinterpret_cast<const uint2 *>(
                            st + lean_word_off(bg[t], rg[t], c, q));
                        wh[t][c] = *reinterpret_cast<const uint2 *>(
                            st + lean_word_off(bh[t], rh[t], c, q));
                    }
                    const uint4 sg = *reinterpret_cast<const uint4 *>(
                        st + L::codes + (bg[t] * LEAN_BOX + rg[t]) * 16);
                    const uint4 sh = *reinterpret_cast<const uint4 *>(
                        st + L::codes + (bh[t] * LEAN_BOX + rh[t]) * 16);
                    sgw[t][0] = sg.x, sgw[t][1] = sg.y, sgw[t][2] = sg.z, sgw[t][3] = sg.w;
                    shw[t][0] = sh.x, shw[t][1] = sh.y, shw[t][2] = sh.z, shw[t][3] = sh.w;
                }
            }
            // row tile t's k16 step k's A fragments. NVFP4: chunk k / 4, word (k % 4) / 2; PAIRS:
            // its group scale the half k % 2 of the scale pair k / 2 (lean_scale_pair: a product
            // wq_scale2 gives too). FP8: chunk k / 4, word k % 4, decoded to e4m3 2^-120 and
            // multiplied by 2^120
            auto decode = [&](int t, int k, uint32_t(&f)[4]) {
                if constexpr (W8) {
                    constexpr uint32_t p120 = FP8_W8_BF16_2P120 | FP8_W8_BF16_2P120 << 16;
                    const uint4 &vg = cg[t][k / 4], &vh = chh[t][k / 4];
                    const uint32_t qg = k % 4 == 0   ? vg.x
                                        : k % 4 == 1 ? vg.y
                                        : k % 4 == 2 ? vg.z
                                                     : vg.w;
                    const uint32_t qh = k % 4 == 0   ? vh.x
                                        : k % 4 == 1 ? vh.y
                                        : k % 4 == 2 ? vh.z
                                                     : vh.w;
                    f[0] = bf16x2_mul(fp8_w8_decode(qg, 0), p120);
                    f[1] = bf16x2_mul(fp8_w8_decode(qh, 0), p120);
                    f[2] = bf16x2_mul(fp8_w8_decode(qg, 1), p120);
                    f[3] = bf16x2_mul(fp8_w8_decode(qh, 1), p120);
                } else if constexpr (PAIRS) {
                    const int c = k / 4, jb = 2 * (k % 2);
                    const uint32_t qg = (k % 4) < 2 ? wg[t][c].x : wg[t][c].y;
                    const uint32_t qh = (k % 4) < 2 ? wh[t][c].x : wh[t][c].y;
                    const uint32_t ag = lean_scale_pair(sgw[t][c], (k % 4) / 2);
                    const uint32_t ah = lean_scale_pair(shw[t][c], (k % 4) / 2);
                    f[0] = lean_mul_half(wq_decode(qg, jb), ag, k % 2);
                    f[1] = lean_mul_half(wq_decode(qh, jb), ah, k % 2);
                    f[2] = lean_mul_half(wq_decode(qg, jb + 1), ag, k % 2);
                    f[3] = lean_mul_half(wq_decode(qh, jb + 1), ah, k % 2);
                } else {
                    const int c = k / 4, jb = 2 * (k % 2);
                    const uint32_t qg = (k % 4) < 2 ? wg[t][c].x : wg[t][c].y;
                    const uint32_t qh = (k % 4) < 2 ? wh[t][c].x : wh[t][c].y;
                    const uint32_t ag = wq_scale2(sgw[t][c], k % 4),
                                   ah = wq_scale2(shw[t][c], k % 4);
                    f[0] = bf16x2_mul(wq_decode(qg, jb), ag);
                    f[1] = bf16x2_mul(wq_decode(qh, jb), ah);
                    f[2] = bf16x2_mul(wq_decode(qg, jb + 1), ag);
                    f[3] = bf16x2_mul(wq_decode(qh, jb + 1), ah);
                }
            };
            // step k's B: atom k / 4, its 32 bytes (k % 4); the descriptor's start field is the
            // address / 16, below 2^14, so the offsets add to stage 0's without a carry
            const uint64_t d0 =
                wgmma_desc_sw128(smem0 + L::codes + L::sf) + (uint32_t)(s * (SB >> 4));
            auto mma = [&](int t, int k, const uint32_t(&f)[4]) {
                if constexpr (STACK) {
                    wgmma_rs_bf16<2 * NW>(acc[t], f, d0 + (uint32_t)(lean_b_off<2 * NT>(k) >> 4));
                } else {
                    const uint64_t d = d0 + (uint32_t)(lean_b_off<NT>(k) >> 4);
                    wgmma_rs_bf16<NW>(acc[t], f, d);
                    if constexpr (SPLIT) wgmma_rs_bf16<NW>(acc[t], f, d + (L::part >> 4));
                }
            };
            // the stage's end, every group retired: FP8 folds its block's sums into the totals
            // times the rows' scales (acc[t][4 j + i]: i 0, 1 row g, 2, 3 row g + 8) and starts the
            // next block's at zero; then the stage is released
            auto release = [&]() {
                if constexpr (W8) {
#pragma unroll
                    for (int t = 0; t < RT; t++) {
                        const float sg = *reinterpret_cast<const float *>(st + L::codes +
                                                                          bg[t] * 128 + rg[t] * 4);
                        const float sh = *reinterpret_cast<const float *>(st + L::codes +
                                                                          bh[t] * 128 + rh[t] * 4);
#pragma unroll
                        for (int i = 0; i < NT / 2; i++)
                            tot[t][i] =
                                __fmaf_rn(i % 4 < 2 ? sg : sh,
                                          STACK ? lean_hi_lo(acc[t], i) : acc[t][i], tot[t][i]);
#pragma unroll
                        for (int i = 0; i < NA; i++)
                            acc[t][i] = 0.0f;
                    }
                }
                __syncwarp();
                if (lane == 0) mbar_arrive(empty(s));
            };
            if constexpr (PIPE) {
                // a 64-k chunk (4 steps) of a row tile a group, chunk by chunk and in each the row
                // tiles in turn, two buffers: a group decodes while the one before runs. From the
                // third group on a buffer is rewritten once the group that read it has retired (at
                // most one pending); its registers are kept live to there (lean_keep), so that the
                // compiler gives them to nothing else meanwhile. The stage ends with every group
                // retired, as the producer's delayed arrivals need: its stage kt + 1 completes only
                // once this stage is released.
                uint32_t fr[2][4][4];
#pragma unroll
                for (int c = 0; c < KS / 4; c++)
#pragma unroll
                    for (int t = 0; t < RT; t++) {
                        const int G = c * RT + t;
                        uint32_t(&f)[4][4] = fr[G & 1];
                        if (G >= 2) {
                            asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
                            lean_keep(f);
                        }
#pragma unroll
                        for (int i = 0; i < 4; i++)
                            decode(t, 4 * c + i, f[i]);
                        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
                        for (int i = 0; i < 4; i++)
                            mma(t, 4 * c + i, f[i]);
                        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
                    }
                asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
                lean_keep(fr[0]);
                lean_keep(fr[1]);
                release();
            } else {
                static_assert(RT == 1, "form 0: one row tile a warpgroup");
                uint32_t fr[KS][4];
#pragma unroll
                for (int k = 0; k < KS; k++)
                    decode(0, k, fr[k]);
                asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
                for (int k = 0; k < KS; k++)
                    mma(0, k, fr[k]);
                asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
                asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
                release();
            }
            if (++s == S) s = 0, ph ^= 1;
        }
    };
    if constexpr (NT == 24) {
        if (a.narrow && rows <= 16)
            stages(std::true_type());
        else
            stages(std::false_type());
    } else {
        stages(std::false_type());
    }
    pdl_wait(); // before the first write (a no-op where the kernel waited at its start)
    // acc[t][4 j + i] (FP8: tot): n8 block j; i 0, 1 row g columns 8 j + 2 q, + 1; i 2, 3 row
    // g + 8. NVFP4 multiplies the sums by the tensor scales; FP8 has none. 4-row tiles: lanes q
    // 0 and 1 hold the hi sums of rows 2 q, 2 q + 1, lanes q + 2 their lo sums (lo4, from them)
    const float s0 = W8 ? 1.0f : __ldg(&a.ws2[3 * e + (GATE_UP ? 0 : 2)]);
    const float s1 = W8 ? 1.0f : __ldg(&a.ws2[3 * e + 1]);
#pragma unroll
    for (int t = 0; t < RT; t++) {
        const int col = lean_out_col(GATE_UP, nb, warp + 4 * WG * t, g, VW);
        [[maybe_unused]] float lo4[4];
        if constexpr (NT == 4)
#pragma unroll
            for (int i = 0; i < 4; i++)
                lo4[i] = __shfl_xor_sync(0xffffffffu, acc[t][i], 2);
        auto sum = [&](int i, float sc) {
            if constexpr (W8)
                return tot[t][i];
            else if constexpr (NT == 4)
                return __fmul_rn(__fadd_rn(acc[t][i], lo4[i]), sc);
            else if constexpr (STACK)
                return __fmul_rn(lean_hi_lo(acc[t], i), sc);
            else
                return __fmul_rn(acc[t][i], sc);
        };
#pragma unroll
        for (int j = 0; j < (NT + 7) / 8; j++)
#pragma unroll
            for (int i = 0; i < 2; i++) {
                const int r = 8 * j + 2 * q + i;
                if (r >= rows) continue;
                if constexpr (GATE_UP) { // row g the gate, row g + 8 the up projection of col
                    const float gv = sum(4 * j + i, s0), uv = sum(4 * j + 2 + i, s1);
                    bf16 *dst = a.h + (int64_t)(TINY ? pair_of(r) : row0 + r) * a.N + col;
                    if constexpr (SPLIT) {
                        const float v = __fmul_rn(silu(gv), uv);
                        const bf16 hi = __float2bfloat16_rn(v);
                        *dst = hi;
                        if constexpr (TINY != 2)
                            dst[a.h_lo] = __float2bfloat16_rn(__fsub_rn(v, __bfloat162float(hi)));
                    } else {
                        *dst = __float2bfloat16_rn(silu(gv) * uv);
                    }
                } else { // rows g and g + 8: columns col and col + 8
                    float *dst = a.out +
                                 (int64_t)(TINY ? pair_of(r) : __ldcg(&a.pairs[row0 + r])) * a.N +
                                 col;
                    dst[0] = sum(4 * j + i, s0);
                    dst[8] = sum(4 * j + 2 + i, s0);
                }
            }
    }
#else
    __trap(); // sm_100a: no wgmma (moe_lean_w4_rows takes a Hopper device only)
#endif
}

static int g_lean = -1, g_lean8 = -1;

// Test hooks (tests/test_cuda_moe): the lean kernels as MOESERVE_NVFP4_LEAN=on (NVFP4) or
// MOESERVE_FP8_LEAN=on (FP8) says from now on (0 off, 1 wherever they fit, 2 the sizes timed
// faster), or back to the variable (-1); return the setting before.
extern "C" int cuda_moe_w4_lean(int on) {
    const int old = g_lean;
    g_lean = on < 0 ? -1 : on;
    return old;
}
extern "C" int cuda_moe_w8_lean(int on) {
    const int old = g_lean8;
    g_lean8 = on < 0 ? -1 : on;
    return old;
}

// MOESERVE_NVFP4_LEAN_FORM: the kernels' form (lean_form): 0 a stage's products in one group; 1
// in groups of a 64-k chunk, each chunk's decode beside the products of the one before; 2 in
// those groups, two consumer warpgroups a block; 3 as 1 with more blocks an SM and the scales two
// groups a register; 4 as 1 with those scales; 5 as 4 with two 64-row tiles a consumer warpgroup,
// so that a stage's activations, read from L2, meet 128 weight rows instead of 64; 6 as 5 with
// two consumer warpgroups (256 rows, one block an SM). Unset (or 7+), by the tile's rows: NVFP4
// form 3 for 8 rows in medium precision, 4 in high; for 16 form 5 on experts of 4 M weights a
// matrix or more (big), 4 on smaller ones (fewer column blocks: Qwen3-30B-A3B's lost 2 points in
// high in form 5); for 32 (and 24) form 6, except small experts in medium precision (form 5:
// Qwen3-30B-A3B's at T = 256 198 against 206 us, where in high form 6 took 239 against 267); FP8
// form 1, 5 for 16 rows of big experts in high, and 6 for 32 (24) rows. On an H100 those were the
// fastest or within a point of it at every size timed (docs/benchmarks.md, "One H100 (2026-12-06,
// twentieth session)"). On an H200 (twenty-fourth session) two took the lead: form 3's 8-row
// tiles in high hold 82 registers, so four blocks an SM run where five were meant, with two
// stages each (form 4: three), and on the H200's bandwidth that leaves too little in flight
// (DeepSeek-V3's experts at T = 1 to 16: 62 to 65% of the copy rate against form 4's 65 to 70%);
// FP8's 16-row tiles in high read as many activation bytes from L2 as weight bytes in form 1, the
// L2 at 88% of its peak (ncu), which form 5's two row tiles halve (T = 32: 74 -> 79%, and on the
// H100 92 -> 94%, twentieth session). FP8 takes forms 0 to 2, 5 and 6 (3 and 4, whose difference
// is NVFP4's group scales, run as 1).
#define LEAN_FORM_BY_ROWS 7
static int g_lean_form = -1;
static int lean_form_now(int rows, bool w8, bool big, bool split) {
    const int f = cuda_env_count("MOESERVE_NVFP4_LEAN_FORM", LEAN_FORM_BY_ROWS, &g_lean_form);
    if (f < LEAN_FORM_BY_ROWS) return f;
    if (rows >= 24) return big || split || w8 ? 6 : 5;
    if (w8) return rows == 16 && big && split ? 5 : 1;
    return rows <= 8 ? (split ? 4 : 3) : big ? 5 : 4;
}
static bool lean_big(int D, int F) { return (int64_t)D * F >= (4 << 20); }

// MOESERVE_LEAN_ROWS24 (1 when unset; 0: 32 rows): tiles of 24 rows instead of 32 from 9 to 16
// pairs an expert (wgmma's m64n24k16: a quarter fewer products and activation bytes a stage for
// the padded rows, where random routing puts 16 +- 4 pairs on an expert at 16 on average; the few
// experts past 24 take a second tile). On an H100, DeepSeek-V3's NVFP4 experts at 16 pairs an
// expert 70.0 -> 71.7% of the copy rate in medium, 58.7 -> 60.7% in high; FP8 in high 84.6 ->
// 85.0%; Qwen3-30B-A3B's NVFP4 at T = 256 in high 47.3 -> 48.9% (docs/benchmarks.md, "One H100
// (2026-12-06, twenty-first session)"). Forms 5 and 6 only: the others run 24-row tiles as form 5.
static int g_rows24 = -1;
static bool lean_rows24_on() { return cuda_env_count("MOESERVE_LEAN_ROWS24", 1, &g_rows24) == 1; }
extern "C" int cuda_moe_lean_rows24(int on) { // test hook: on (1), off (0), the variable (-1)
    const int old = g_rows24;
    g_rows24 = on < 0 ? -1 : on;
    return old;
}

// The rows of a tile by the switch's mode: 0 off, 1 wherever the kernels fit, 2 where they were
// timed faster than the tiles, up to max_per pairs an expert on average (Kd: the multiple both
// GEMMs' k must be, a stage's k)
static int lean_tile_rows(int mode, int64_t n_pairs, int E, int D, int F, bool tiny, int Kd,
                          int max_per) {
    if ((mode != 1 && mode != 2) || !cuda_wgmma_device()) return 0;
    if (D % Kd || F % Kd || E <= 0) return 0;
    // tiles of twice the average pairs an expert, so that few experts take two (random routing:
    // 2 % of them at 4 an expert with 8 rows); 2: up to max_per an expert, and on the tiny path
    // only where the experts' bytes hide the prepare kernel (DeepSeek-V3's at T = 1, not
    // Qwen3-30B-A3B's; tiny: the caller's say, moe_lean_w4_rows)
    const int64_t per = (n_pairs + E - 1) / E; // pairs an expert, on average
    if (mode == 2 && (per > max_per || (tiny && !lean_big(D, F)))) return 0;
    return per <= 4 ? 8 : per <= 8 ? 16 : per <= 16 ? (lean_rows24_on() ? 24 : 32) : 0;
}

// MOESERVE_LEAN_ROWS4 (1 when unset; 0: 8 rows): NVFP4's tiles of 4 rows at one pair an expert
// or fewer on average in high precision with the products stacked. x's hi and lo rows of a stage
// then fill one 8-row group, wgmma's n8, instead of two: 4 KB a stage less (13 KB instead of 17),
// so that form 4's 53 KB a block hold four stages of weights in flight instead of three; the same
// sums as 8-row tiles stacked. DeepSeek-V3's experts over 256 of them reach one pair an expert at
// 32 tokens a step. On an H100 (docs/benchmarks.md, "One H100 (2026-12-07, twenty-fifth
// session)"), DeepSeek-V3's shape over 32 experts in a chain at T = 1 / 2 / 4 (means of the
// second call's two runs): 82.2 / 142.7 / 199.6 -> 80.9 / 140.4 / 198.4 us; Qwen3-30B-A3B's at
// T = 8: 64.8 -> 62.6 us, at T = 16: 95.2 -> 91.9; its decode steps at batch 8 and 16 in high
// 1.4 and 2.2% faster (means of two). (Form 3 was faster
// still there, 79.9 / 139.6 / 197.2 us; form 4 stays, as on the H200 form 4's extra stage is
// what made the 8-row tiles faster; the H200 has not run 4-row tiles yet.)
static int g_rows4 = -1;
static bool lean_stack_on(bool w8);
static bool lean_rows4_on() { return cuda_env_count("MOESERVE_LEAN_ROWS4", 1, &g_rows4) == 1; }
extern "C" int cuda_moe_lean_rows4(int on) { // test hook: on (1), off (0), the variable (-1)
    const int old = g_rows4;
    g_rows4 = on < 0 ? -1 : on;
    return old;
}

int moe_lean_w4_rows(int64_t n_pairs, int E, int D, int F, bool tiny, bool split) {
    // MOESERVE_NVFP4_LEAN (cuda_env_count: the value, 2 when unset): up to 8 pairs an expert, and
    // up to 16 where 32-row tiles run in form 5 or 6 (two row tiles a warpgroup), which the H100's
    // timings put ahead of the tiles there
    const int max_per = lean_form_now(32, false, lean_big(D, F), false) >= 5 ? 16 : 8;
    // and on the tiny path's small experts in high precision past 8 pairs (more than one token
    // at K 8), where the tiny GEMMs' high precision is the slower: on an H100, Qwen3-30B-A3B's
    // experts at T = 2 in a chain 28.0 -> 24.5 us, its decode steps at batch 2 3.765 -> 3.634 ms
    // (means of two), T = 1 level (19.3 / 19.5 us) (docs/benchmarks.md, "One H100 (2026-12-07,
    // twenty-seventh session)")
    const bool tiny_path = tiny && !(split && n_pairs > 8);
    const int rows = lean_tile_rows(cuda_env_count("MOESERVE_NVFP4_LEAN", 2, &g_lean), n_pairs, E,
                                    D, F, tiny_path, LEAN_BK, max_per);
    const bool four = rows == 8 && n_pairs <= E && split && lean_stack_on(false) &&
                      lean_rows4_on() && lean_form_now(4, false, lean_big(D, F), true) != 0;
    return four ? 4 : rows;
}
// MOESERVE_LEAN_TINY (2 when unset: on small experts; 1: on every size; 0: off): the tiny path's
// sizes (moe.cu's T K up to 16) in stacked high precision on the lean kernels' 4-row tiles with
// no prepare kernel (TINY: each block groups topk_ids itself, GEMM 1 converts its rows of x from
// fp32 a stage ahead, h rows by pair id), wherever the 4-row tiles would take the size were it
// not tiny; the same sums as the 4-row tiles after the prepare kernel. On an H100
// (docs/benchmarks.md, "One H100 (2026-12-07, twenty-eighth session)"), Qwen3-30B-A3B's experts
// in a chain in high at T = 1: 19.4 -> 15.5 us (the tiny path's kernels before), at T = 2: 24.5
// -> 22.2 us (the 4-row tiles after the prepare kernel); its decode steps at batch 1: 3.13 ->
// 2.99 ms, at batch 2: 3.64 -> 3.47 ms (means of two). DeepSeek-V3's experts (lean_big) keep the
// prepare kernel: level at T = 1 (79.3 us), slower at T = 2 (137.8 -> 141.9 us).
static int g_lean_tiny = -1;
// a no-prepare-kernel switch's mode (1 every size, 2 small experts) on experts of D x F
static bool lean_tiny_mode(int mode, int D, int F) {
    return mode == 1 || (mode == 2 && !lean_big(D, F));
}
extern "C" int cuda_moe_lean_tiny(int on) { // test hook: on (1), off (0), the variable (-1)
    const int old = g_lean_tiny;
    g_lean_tiny = on < 0 ? -1 : on;
    return old;
}
// MOESERVE_LEAN_TINY_PAIRS (16 when unset, moe.cu's tiny path's sizes; at most 32, the pairs
// tiny_group takes, one a lane): the most pairs a call takes the kernels with no prepare kernel
// (MOESERVE_LEAN_TINY, _MEDIUM, MOESERVE_FP8_LEAN_TINY) at; from 17 on the same bits as the 4- or
// 8-row tiles after the prepare kernel that run those sizes otherwise. Past 16 not yet run on a
// GPU (docs/benchmarks.md, twenty-eighth session).
static int g_lean_tiny_pairs = -1;
extern "C" int cuda_moe_lean_tiny_pairs(int n) { // test hook: n pairs, or the variable (-1)
    const int old = g_lean_tiny_pairs;
    g_lean_tiny_pairs = n < 0 ? -1 : n;
    return old;
}
int moe_lean_tiny_pairs() {
    return std::min(LEAN_TINY_MAX_PAIRS,
                    cuda_env_count("MOESERVE_LEAN_TINY_PAIRS", 16, &g_lean_tiny_pairs));
}
// MOESERVE_LEAN_TINY_MEDIUM (1 when unset; 0 off): in medium precision too, where
// MOESERVE_LEAN_TINY takes the size in high, on the same stacked kernels with x's and h's lo
// parts zero (moe_lean_kernel's TINY 2): the hi products' sums alone, medium precision's (the
// 8-row tiles' after the prepare kernel, to the bit) on the wgmma of n8 that 8-row tiles take as
// well. On an H100 (docs/benchmarks.md, "One H100 (2026-12-07, twenty-eighth session)"),
// Qwen3-30B-A3B's experts in a chain in medium at T = 1: 17.4 -> 14.9 us, at T = 2: 24.4 -> 21.7
// us (the tiny path's kernels before); its decode steps in medium at batch 1: 3.004 -> 2.982 ms,
// at batch 2: 3.583 -> 3.456 ms (means of two).
static int g_lean_tiny_medium = -1;
extern "C" int cuda_moe_lean_tiny_medium(int on) { // test hook: on (1), off (0), the variable (-1)
    const int old = g_lean_tiny_medium;
    g_lean_tiny_medium = on < 0 ? -1 : on;
    return old;
}
bool moe_lean_w4_tiny(int64_t n_pairs, int E, int D, int F, bool split) {
    const int mode = cuda_env_count("MOESERVE_LEAN_TINY", 2, &g_lean_tiny);
    if (!split && cuda_env_count("MOESERVE_LEAN_TINY_MEDIUM", 1, &g_lean_tiny_medium) != 1)
        return false;
    return lean_tiny_mode(mode, D, F) && moe_lean_w4_rows(n_pairs, E, D, F, false, true) == 4;
}

extern "C" int cuda_moe_w4_lean_tiny_on(int64_t n_pairs, int E, int D, int F, int split) {
    return moe_lean_w4_tiny(n_pairs, E, D, F, split != 0); // test hook
}

// Test hook: the rows moe_lean_w4_rows gives (0: not on the lean kernels)
extern "C" int cuda_moe_w4_lean_rows(int64_t n_pairs, int E, int D, int F, int tiny, int split) {
    return moe_lean_w4_rows(n_pairs, E, D, F, tiny != 0, split != 0);
}

int moe_lean_w8_rows(int64_t n_pairs, int E, int D, int F, bool tiny, bool split) {
    // MOESERVE_FP8_LEAN (2 when unset): NVFP4's rule to 8 pairs an expert, which the H100's
    // timings bear out for FP8 too (docs/benchmarks.md, "One H100 (2026-12-06, eighteenth
    // session)"), and in high precision up to 16 where 32-row tiles run in form 6 (DeepSeek-V3's
    // experts at 16 pairs an expert: 84% of the copy rate against the tiles' 70%; in medium the
    // W8A8 GEMMs' 97%, "One H100 (2026-12-06, twentieth session)")
    const int max_per = split && lean_form_now(32, true, lean_big(D, F), true) == 6 ? 16 : 8;
    return lean_tile_rows(cuda_env_count("MOESERVE_FP8_LEAN", 2, &g_lean8), n_pairs, E, D, F, tiny,
                          LEAN_BK / 2, max_per);
}

// MOESERVE_FP8_LEAN_TINY (0 when unset; 2 on small experts; 1 on every size): FP8's experts at
// the tiny path's sizes (moe.cu's T K up to 16) on the lean kernels' 8-row tiles with no prepare
// kernel, as MOESERVE_LEAN_TINY runs NVFP4's on 4-row tiles (TINY: each block groups topk_ids
// itself, GEMM 1 converts its rows of x, h rows by pair id): in both precisions, high in one
// chain (not with MOESERVE_LEAN_STACK=2), wherever the 8-row tiles in form 1 would take the size
// were it not tiny; the same sums as they after the prepare kernel. Not yet run on a GPU
// (docs/benchmarks.md, twenty-eighth session).
static int g_fp8_tiny = -1;
extern "C" int cuda_moe_fp8_lean_tiny(int on) { // test hook: 0, 1, 2 as the variable, or it (-1)
    const int old = g_fp8_tiny;
    g_fp8_tiny = on < 0 ? -1 : on;
    return old;
}
bool moe_lean_w8_tiny(int64_t n_pairs, int E, int D, int F, bool split) {
    const int mode = cuda_env_count("MOESERVE_FP8_LEAN_TINY", 0, &g_fp8_tiny);
    if (!lean_tiny_mode(mode, D, F) || (split && lean_stack_on(true))) return false;
    const int form = lean_form_now(8, true, lean_big(D, F), split); // forms 3 and 4 run as 1
    return (form == 1 || form == 3 || form == 4) &&
           moe_lean_w8_rows(n_pairs, E, D, F, false, split) == 8;
}
extern "C" int cuda_moe_w8_lean_tiny_on(int64_t n_pairs, int E, int D, int F, int split) {
    return moe_lean_w8_tiny(n_pairs, E, D, F, split != 0); // test hook
}

// Test hook (tests/test_cuda_moe): the kernels' form from now on (0 to 6, 7 by the tile's rows),
// or back to MOESERVE_NVFP4_LEAN_FORM (-1); returns the setting before.
extern "C" int cuda_moe_w4_lean_form(int form) {
    const int old = g_lean_form;
    g_lean_form = form < 0 ? -1 : form;
    return old;
}

// MOESERVE_LEAN_NARROW (1 when unset; 0 off): a 24-row tile of 16 rows or fewer (about half of
// them at 16 pairs an expert on average) runs its products on wgmma's m64n16k16, a third less
// tensor work for the same sums. On an H100, DeepSeek-V3's NVFP4 experts at 16 pairs an expert
// 71.7 -> 72.9% of the copy rate in medium, high and FP8 unchanged (docs/benchmarks.md, "One H100
// (2026-12-06, twenty-first session)").
static int g_lean_narrow = -1;
extern "C" int cuda_moe_lean_narrow(int on) { // test hook: on (1), off (0), the variable (-1)
    const int old = g_lean_narrow;
    g_lean_narrow = on < 0 ? -1 : on;
    return old;
}

template <bool GATE_UP, bool SPLIT, int NT, int FORM, bool W8, bool STACK, int TINY>
static void lean_launch(const CUtensorMap &tq, const CUtensorMap &tsf, lean_args a, int max_tiles) {
    typedef lean_stage<NT, SPLIT, lean_form<FORM>::vw, lean_form<FORM>::dense, W8> L;
    auto kernel = moe_lean_kernel<GATE_UP, SPLIT, NT, FORM, W8, STACK, TINY>;
    static size_t set = 0;
    cuda_smem_allow(kernel, L::smem, &set);
    a.narrow = cuda_env_count("MOESERVE_LEAN_NARROW", 1, &g_lean_narrow) == 1;
    const int64_t blocks = (int64_t)max_tiles * a.n_col_blocks;
    cuda_launch_pdl(kernel, dim3((unsigned)blocks), dim3(lean_form<FORM>::threads), L::smem, tq,
                    tsf, a);
}

// the tensor maps of one GEMM's weights [E w_rows, Kd]: the codes in boxes of 32 rows x 128 bytes
// (128-byte swizzle); NVFP4's scale bytes [E w_rows, Kd / 16] in boxes of 32 rows x 16 bytes,
// FP8's block scales [E, Kd / 128, w_rows] fp32 in boxes of 32 scales of one block
template <bool W8>
static void lean_maps(CUtensorMap *q, CUtensorMap *sf, const uint8_t *codes, const uint8_t *scales,
                      int E, int w_rows, int Kd) {
    const int64_t n = (int64_t)E * w_rows;
    *q = tma_map_rows(codes, n, W8 ? Kd : Kd / 2, LEAN_BOX);
    *sf = W8 ? tma_map_rows(scales, (int64_t)E * (Kd / 128), (int64_t)w_rows * 4, 1, 128, true)
             : tma_map_rows(scales, n, Kd / 16, LEAN_BOX, 16, true);
}

// MOESERVE_LEAN_FORM2: GEMM 2's form where GEMM 1 runs form 6: 5 or 6; unset (or another value)
// 5 in medium precision and 6 in high. GEMM 2 has 8 stages a block at DeepSeek-V3's k 2048,
// where form 6's one block an SM leaves each block's start and end exposed and form 5's two
// overlap them. On an H100, DeepSeek-V3's NVFP4 experts at 16 pairs an expert: medium +1.1
// points, high -4.3 (docs/benchmarks.md, "One H100 (2026-12-06, twenty-first session)").
static int g_lean_form2 = -1;
extern "C" int cuda_moe_lean_form2(int form) { // test hook: 5, 6, 0 (by precision), -1 the variable
    const int old = g_lean_form2;
    g_lean_form2 = form < 0 ? -1 : form;
    return old;
}

// MOESERVE_LEAN_STACK (1 when unset: NVFP4; 2 NVFP4 and FP8; 0 neither): high precision takes a
// k16 step's hi and lo products as one wgmma of twice the columns (x's hi rows and lo rows stacked
// as B), in two sums added at the end (FP8: at each block's fold), instead of two wgmma on one
// chain. A wgmma of n8 or n16 costs a multiprocessor about 14 cycles either way
// (build/bench_wgmma_rate, H100), so high precision's two products a 64 x 16 block of weights hold
// it to 36 weights a cycle, one stacked product to 74. On an H100, DeepSeek-V3's NVFP4 experts in
// high precision, in a chain (means of two rounds): 77.6 -> 80.9% of the copy rate at T = 1, 84.0
// -> 88.3% at 16, 73.6 -> 79.4% at 32, 1.3 to 5.8 points at each T (docs/benchmarks.md, "One H100
// (2026-12-06, twenty-second session)"); on an H200, 3.2 to 5.1 points at every T, 57.1 -> 61.2%
// at T = 1 ("One H100, then one H200 (2026-12-06, twenty-third session)"). FP8's decode is
// lighter: stacked, its experts gained 0.4 to 0.5 points at T = 1 to 8 on an H100 and 0.65 to
// 1.15 at T = 1 to 4 on an H200, nothing above (same section), too little for the trade, so FP8
// keeps its one chain unless asked. Other sums than the tiles' one chain: a token's stacked rows
// in high precision then depend on whether its batch's size takes the lean kernels or the tiles
// (0 keeps the one chain and those bits); deterministic mode never runs the lean kernels.
static int g_lean_stack = -1;
static bool lean_stack_on(bool w8) {
    const int v = cuda_env_count("MOESERVE_LEAN_STACK", 1, &g_lean_stack);
    return w8 ? v == 2 : v == 1 || v == 2;
}
extern "C" int cuda_moe_lean_stack(int on) { // test hook: 0, 1, 2 as the variable, or it (-1)
    const int old = g_lean_stack;
    g_lean_stack = on < 0 ? -1 : on;
    return old;
}
// the switch for NVFP4 (w8 0) or FP8 (1); form 0 and FP8's 32-row tiles never stack
extern "C" int cuda_moe_lean_stacked(int w8) { return lean_stack_on(w8); }

template <bool SPLIT, int NT, int FORM, bool W8, int FORM2, bool STACK, int TINY = 0>
static void lean_both(lean_args a, int max_tiles, const uint8_t *gate_up_q,
                      const uint8_t *gate_up_sf, const uint8_t *down_q, const uint8_t *down_sf,
                      int E, int D, int F) {
    constexpr int WG = lean_form<FORM>::vw, WG2 = lean_form<FORM2>::vw; // 64-row tiles a block
    CUtensorMap q, sf;
    // GEMM 1: gate_up [E 2F rows, D]
    lean_maps<W8>(&q, &sf, gate_up_q, gate_up_sf, E, 2 * F, D);
    a.Kd = D;
    a.N = F;
    a.w_rows = 2 * F;
    a.n_col_blocks = F / (WG * LEAN_BOX);
    lean_launch<true, SPLIT, NT, FORM, W8, STACK, TINY>(q, sf, a, max_tiles);
    // GEMM 2: down [E D rows, F], its activations h in grouped order (TINY: by pair id)
    lean_maps<W8>(&q, &sf, down_q, down_sf, E, D, F);
    a.act = a.h;
    a.act_lo = a.h_lo;
    a.Kd = F;
    a.N = D;
    a.w_rows = D;
    a.n_col_blocks = D / (WG2 * 2 * LEAN_BOX);
    lean_launch<false, SPLIT, NT, FORM2, W8, STACK, TINY>(q, sf, a, max_tiles);
}

template <bool W8>
static void lean_experts(float *out, const bf16 *xb, int64_t xb_lo, const int32_t *pairs,
                         const int4 *tiles, const int32_t *n_tiles, int max_tiles, int K,
                         const uint8_t *gate_up_q, const uint8_t *gate_up_sf, const uint8_t *down_q,
                         const uint8_t *down_sf, const float *s2, int E, int D, int F,
                         int64_t n_pairs, int rows, bool split, bf16 *h, const float *x = nullptr,
                         const int32_t *topk_ids = nullptr, const int32_t *n_rows = nullptr) {
    lean_args a = {};
    a.x = x; // TINY (topk_ids given): x and topk_ids in place of the prepare kernel's outputs
    a.topk_ids = topk_ids;
    a.n_rows = n_rows;
    a.n_ids = (int)n_pairs;
    a.E = E;
    a.act = xb;
    a.act_lo = xb_lo;
    a.pairs = pairs;
    a.tiles = tiles;
    a.n_tiles = n_tiles;
    a.h = h;
    a.h_lo = split || topk_ids ? n_pairs * F : 0;
    a.out = out;
    a.ws2 = s2;
    a.topk = K;
    const int form = lean_form_now(rows, W8, lean_big(D, F), split);
    auto both = [&](auto nt) {
        constexpr int NT = decltype(nt)::value;
        auto go = [&](auto fm) { // GEMM 1 in form FORM, GEMM 2 in FORM2
            constexpr int FORM = decltype(fm)::value;
            // stacked: not form 0 (it would serialize the products), nor FP8's 32-row tiles
            // (168 registers and spills, where 148 hold the one chain)
            [[maybe_unused]] constexpr bool STACKS = FORM != 0 && !(W8 && NT == 32);
            auto run = [&](auto fm2) {
                constexpr int FORM2 = decltype(fm2)::value;
                if constexpr (NT == 4) { // stacked high precision alone (moe_lean_w4_rows), and
                    // with topk_ids (TINY) medium precision as its hi products
                    if (topk_ids && split)
                        lean_both<true, NT, FORM, W8, FORM2, true, 1>(
                            a, max_tiles, gate_up_q, gate_up_sf, down_q, down_sf, E, D, F);
                    else if (topk_ids)
                        lean_both<true, NT, FORM, W8, FORM2, true, 2>(
                            a, max_tiles, gate_up_q, gate_up_sf, down_q, down_sf, E, D, F);
                    else
                        lean_both<true, NT, FORM, W8, FORM2, true>(
                            a, max_tiles, gate_up_q, gate_up_sf, down_q, down_sf, E, D, F);
                } else {
                    if constexpr (W8 && NT == 8 && FORM == 1) // FP8's TINY: 8 rows, one chain
                        if (topk_ids) {
                            if (split)
                                lean_both<true, NT, FORM, W8, FORM2, false, 1>(
                                    a, max_tiles, gate_up_q, gate_up_sf, down_q, down_sf, E, D, F);
                            else
                                lean_both<false, NT, FORM, W8, FORM2, false, 1>(
                                    a, max_tiles, gate_up_q, gate_up_sf, down_q, down_sf, E, D, F);
                            return;
                        }
                    if (!split)
                        lean_both<false, NT, FORM, W8, FORM2, false>(
                            a, max_tiles, gate_up_q, gate_up_sf, down_q, down_sf, E, D, F);
                    else if (STACKS && lean_stack_on(W8))
                        lean_both<true, NT, FORM, W8, FORM2, STACKS>(
                            a, max_tiles, gate_up_q, gate_up_sf, down_q, down_sf, E, D, F);
                    else
                        lean_both<true, NT, FORM, W8, FORM2, false>(
                            a, max_tiles, gate_up_q, gate_up_sf, down_q, down_sf, E, D, F);
                }
            };
            if constexpr (FORM == 6) {
                const int f2 = cuda_env_count("MOESERVE_LEAN_FORM2", 0, &g_lean_form2);
                if (f2 == 5 || (f2 != 6 && !split)) return run(std::integral_constant<int, 5>());
            }
            run(fm);
        };
        constexpr int F3 = W8 ? 1 : 3, F4 = W8 ? 1 : 4; // FP8: forms 3 and 4 as 1
        if constexpr (NT == 4) {                        // 4 rows: forms 3 and 4 alone
            if (form == 3)
                go(std::integral_constant<int, 3>());
            else
                go(std::integral_constant<int, 4>());
        } else if constexpr (NT == 24) { // 24 rows: forms 5 and 6 alone
            if (form == 6 && D % 256 == 0)
                go(std::integral_constant<int, 6>());
            else
                go(std::integral_constant<int, 5>());
        } else if (form == 0)
            go(std::integral_constant<int, 0>());
        else if (form == 1)
            go(std::integral_constant<int, 1>());
        else if (form == 2)
            go(std::integral_constant<int, 2>());
        else if (form == 3)
            go(std::integral_constant<int, F3>());
        else if (form == 4)
            go(std::integral_constant<int, F4>());
        else if (form == 5 || D % 256) // form 6: D a multiple of 256 (FP8's lean D: of 128)
            go(std::integral_constant<int, 5>());
        else
            go(std::integral_constant<int, 6>());
    };
    if constexpr (!W8)
        if (rows == 4) return both(std::integral_constant<int, 4>());
    if (rows == 8)
        both(std::integral_constant<int, 8>());
    else if (rows == 16)
        both(std::integral_constant<int, 16>());
    else if (rows == 24)
        both(std::integral_constant<int, 24>());
    else
        both(std::integral_constant<int, 32>());
}

void moe_lean_w4_experts(float *out, const bf16 *xb, int64_t xb_lo, const int32_t *pairs,
                         const int4 *tiles, const int32_t *n_tiles, int max_tiles, int K,
                         const uint8_t *gate_up_q, const uint8_t *gate_up_sf, const uint8_t *down_q,
                         const uint8_t *down_sf, const float *s2, int E, int D, int F,
                         int64_t n_pairs, int rows, bool split, bf16 *h) {
    lean_experts<false>(out, xb, xb_lo, pairs, tiles, n_tiles, max_tiles, K, gate_up_q, gate_up_sf,
                        down_q, down_sf, s2, E, D, F, n_pairs, rows, split, h);
}

// the most tiles tiny_group makes of n_pairs pairs over E experts in chunks of R rows: each busy
// expert's pairs rounded up to R
static int lean_tiny_max_tiles(int64_t n_pairs, int E, int R) {
    const int64_t busy = std::min<int64_t>(E, n_pairs);
    return (int)std::min<int64_t>(n_pairs, (n_pairs + busy * (R - 1)) / R);
}

void moe_lean_w4_experts_tiny(float *out, const float *x, const int32_t *topk_ids,
                              const int32_t *n_rows, int T, int K, const uint8_t *gate_up_q,
                              const uint8_t *gate_up_sf, const uint8_t *down_q,
                              const uint8_t *down_sf, const float *s2, int E, int D, int F,
                              bool split, bf16 *h) {
    const int64_t n_pairs = (int64_t)T * K;
    const int max_tiles = lean_tiny_max_tiles(n_pairs, E, 4);
    lean_experts<false>(out, nullptr, 0, nullptr, nullptr, nullptr, max_tiles, K, gate_up_q,
                        gate_up_sf, down_q, down_sf, s2, E, D, F, n_pairs, 4, split, h, x, topk_ids,
                        n_rows);
}

void moe_lean_w8_experts_tiny(float *out, const float *x, const int32_t *topk_ids,
                              const int32_t *n_rows, int T, int K, const uint8_t *gate_up_q,
                              const float *gate_up_s, const uint8_t *down_q, const float *down_s,
                              int E, int D, int F, bool split, bf16 *h) {
    const int64_t n_pairs = (int64_t)T * K;
    const int max_tiles = lean_tiny_max_tiles(n_pairs, E, 8);
    lean_experts<true>(out, nullptr, 0, nullptr, nullptr, nullptr, max_tiles, K, gate_up_q,
                       (const uint8_t *)gate_up_s, down_q, (const uint8_t *)down_s, nullptr, E, D,
                       F, n_pairs, 8, split, h, x, topk_ids, n_rows);
}

void moe_lean_w8_experts(float *out, const bf16 *xb, int64_t xb_lo, const int32_t *pairs,
                         const int4 *tiles, const int32_t *n_tiles, int max_tiles, int K,
                         const uint8_t *gate_up_q, const float *gate_up_s, const uint8_t *down_q,
                         const float *down_s, int E, int D, int F, int64_t n_pairs, int rows,
                         bool split, bf16 *h) {
    lean_experts<true>(out, xb, xb_lo, pairs, tiles, n_tiles, max_tiles, K, gate_up_q,
                       (const uint8_t *)gate_up_s, down_q, (const uint8_t *)down_s, nullptr, E, D,
                       F, n_pairs, rows, split, h);
}

// ---- the host check: the kernels' places, emulated without a device ----
//
// cuda_moe_lean_host_check runs every block of both GEMMs of a small problem (2 experts, D 512,
// F 256, a tile of NT - 1 tokens each; each NT, both precisions, one and two consumer warpgroups)
// on the host. The weights go through the tiles' packing (wq_pack_chunk) and their scale bytes; a
// stage's bytes are placed as TMA's 128-byte swizzle places boxes and as the producer places the
// activations (lean_act_off); each consumer thread reads its words and scales where the kernel does
// (lean_a_rows, lean_word_off), decodes them, and the wgmma products read A from the threads'
// fragments (PTX's layout: a0 rows g, k 2q, 2q + 1; a1 row g + 8; a2, a3 k + 8) and B through the
// descriptor as the hardware reads a 128-byte swizzled K-major operand (lean_b_off's start, 8-row
// groups 1024 bytes apart, 16-byte units XOR the address bits above 128). The outputs land where
// the epilogues put them (lean_out_col) and are compared with a double-precision reference. What
// it cannot check is the hardware itself: the barriers, the proxies, the instructions' layouts.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

namespace {

struct lean_problem {
    int E = 2, D = 512, F = 256, T = 0;
    std::vector<uint8_t> gu_q, gu_sf, dn_q, dn_sf; // packed as the device holds them
    std::vector<float> gu_sc, dn_sc;               // FP8: block scales [E, Kd / 128, w_rows]
    std::vector<float> gu_w, dn_w;                 // dequantized, no tensor scale
    std::vector<float> s2;                         // [E, 3] (FP8: ones)
};

uint32_t lean_rng = 2463534242u;
uint32_t lean_rand() {
    lean_rng ^= lean_rng << 13;
    lean_rng ^= lean_rng >> 17;
    lean_rng ^= lean_rng << 5;
    return lean_rng;
}

// rows x K random codes and normal E4M3 scales: packed (codes as wq_pack_chunk, scale bytes c with
// (c << 4) + WQ_SF_BIAS the BF16 bits of the scale 2^119) and dequantized
void lean_matrix(int rows, int K, std::vector<uint8_t> &q, std::vector<uint8_t> &sf,
                 std::vector<float> &w) {
    q.assign((size_t)rows * K / 2, 0);
    sf.assign((size_t)rows * K / 16, 0);
    w.assign((size_t)rows * K, 0.0f);
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < K / 64; c++) {
            uint32_t in[8] = {}, out[8];
            const bool zero[4] = {false, false, false, false};
            for (int k = 0; k < 64; k++) {
                const uint32_t nib = lean_rand() & 15u;
                in[k / 8] |= nib << (4 * (k % 8));
                w[(size_t)r * K + c * 64 + k] = fp4_e2m1_to_float((uint8_t)nib);
            }
            for (int g = 0; g < 4; g++) {
                const uint8_t e = (uint8_t)(8 + lean_rand() % 80); // 2^-6 .. 2^3
                const float f = ldexpf(fp8_e4m3_to_float(e), WQ_SF_EXP);
                uint32_t u;
                memcpy(&u, &f, 4);
                sf[(size_t)r * (K / 16) + c * 4 + g] = (uint8_t)(((u >> 16) - WQ_SF_BIAS) >> 4);
                for (int k = 0; k < 16; k++)
                    w[(size_t)r * K + c * 64 + 16 * g + k] *= fp8_e4m3_to_float(e);
            }
            wq_pack_chunk(out, in, zero);
            memcpy(&q[(size_t)r * (K / 2) + c * 32], out, 32);
        }
}

// FP8: E experts' w_rows x K random E4M3 codes (no NaN) packed as fp8_pack_kernel does
// (fp8_w8_pack64), random block scales a row and 128 k ([E, K / 128, w_rows]), dequantized
void lean_matrix8(int E, int w_rows, int K, std::vector<uint8_t> &q, std::vector<float> &sc,
                  std::vector<float> &w) {
    const int rows = E * w_rows, nkb = K / 128;
    q.assign((size_t)rows * K, 0);
    sc.assign((size_t)E * nkb * w_rows, 0.0f);
    w.assign((size_t)rows * K, 0.0f);
    for (int r = 0; r < rows; r++)
        for (int kb = 0; kb < nkb; kb++)
            sc[((size_t)(r / w_rows) * nkb + kb) * w_rows + r % w_rows] =
                ldexpf(1.0f + (float)(lean_rand() % 64) / 64.0f, (int)(lean_rand() % 9) - 12);
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < K / 64; c++) {
            uint8_t in[64];
            for (int k = 0; k < 64; k++) {
                uint8_t b = (uint8_t)lean_rand();
                if ((b & 0x7f) == 0x7f) b ^= 1; // not NaN
                in[k] = b;
                const int kk = c * 64 + k;
                w[(size_t)r * K + kk] =
                    fp8_e4m3_to_float(b) *
                    sc[((size_t)(r / w_rows) * nkb + kk / 128) * w_rows + r % w_rows];
            }
            fp8_w8_pack64(&q[(size_t)r * K + c * 64], in);
        }
}

float lean_bf16(float v) { // round to nearest even
    uint32_t u;
    memcpy(&u, &v, 4);
    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    memcpy(&v, &u, 4);
    return v;
}
float lean_bf16_bits(uint16_t b) {
    const uint32_t u = (uint32_t)b << 16;
    float v;
    memcpy(&v, &u, 4);
    return v;
}
uint16_t lean_to_bits(float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    return (uint16_t)(u >> 16);
}
float lean_silu(float g) { return g / (1.0f + expf(-g)); }

// one GEMM's every block on the host: act [rows, Kd] (BF16 values; split: act_lo too), weights
// q [E w_rows, Kd / 2 | Kd] with NVFP4's scale bytes sf [E w_rows, Kd / 16] or FP8's block scales
// sc [E, Kd / 128, w_rows], expert e's tile of `rows` rows; y [rows, N] (GEMM 1: h's fp32 values
// before rounding, from the gate and up rows; GEMM 2: out)
template <int NT, bool SPLIT, int WG, bool W8, bool STACK>
void lean_emulate(bool gate_up, const std::vector<float> &act, const std::vector<float> &act_lo,
                  int rows, const std::vector<uint8_t> &q, const std::vector<uint8_t> &sf,
                  const std::vector<float> &sc, int e, int w_rows, int Kd, int N, const float *s2e,
                  std::vector<double> &y) {
    typedef lean_stage<NT, SPLIT, WG, false, W8> L;
    constexpr int BK = L::bk, KS = BK / 16;
    const int64_t row_bytes = W8 ? Kd : Kd / 2;
    std::vector<uint8_t> st(L::bytes);
    const int nk = Kd / BK, ncb = gate_up ? N / (WG * LEAN_BOX) : N / (WG * 2 * LEAN_BOX);
    y.assign((size_t)rows * N, 0.0);
    for (int nb = 0; nb < ncb; nb++) {
        std::vector<double> acc(64 * WG * NT, 0.0); // [A row of the block][token]
        for (int kt = 0; kt < nk; kt++) {
            std::fill(st.begin(), st.end(), 0);
            for (int b = 0; b < 2 * WG; b++) { // the TMA boxes
                const int wr = lean_wrow(gate_up, b, e, w_rows, nb, N, WG);
                for (int r = 0; r < LEAN_BOX; r++)
                    for (int i = 0; i < 128; i++) {
                        const int l = r * 128 + i; // the box's 128-byte swizzle
                        st[b * LEAN_BOX * 128 + (l ^ (((l >> 7) & 7) << 4))] =
                            q[(size_t)(wr + r) * row_bytes + kt * 128 + i];
                    }
                for (int r = 0; r < LEAN_BOX; r++)
                    if (W8) // block kt's scales of the box's rows, in a row of the map
                        memcpy(&st[L::codes + b * 128 + r * 4],
                               &sc[((size_t)e * nk + kt) * w_rows + (wr - e * w_rows) + r], 4);
                    else
                        memcpy(&st[L::codes + (b * LEAN_BOX + r) * 16],
                               &sf[(size_t)(wr + r) * (Kd / 16) + kt * 16], 16);
            }
            for (int part = 0; part < (SPLIT ? 2 : 1); part++) // the producer's copies
                for (int n = 0; n < rows; n++)
                    for (int u = 0; u < BK / 8; u++)
                        for (int i = 0; i < 8; i++) {
                            const std::vector<float> &src = part ? act_lo : act;
                            const uint16_t bits =
                                lean_to_bits(src[(size_t)n * Kd + kt * BK + u * 8 + i]);
                            const int off = STACK ? lean_act_off_stacked<NT>(u, n, part)
                                                  : part * L::part + lean_act_off<NT>(u, n);
                            memcpy(&st[L::codes + L::sf + off + 2 * i], &bits, 2);
                        }
            // A: every thread's fragments, as values; FP8: each A row's block scale
            std::vector<double> A((size_t)64 * WG * BK), rsc(64 * WG, 1.0);
            for (int warp = 0; warp < 4 * WG; warp++)
                for (int lane = 0; lane < 32; lane++) {
                    const int g = lane >> 2, qq = lane & 3;
                    const lean_rows ar = lean_a_rows(gate_up, warp, g);
                    for (int k = 0; k < KS; k++) {
                        const int c = k / 4, jb = 2 * (k % 2);
                        for (int half = 0; half < 2; half++) { // rows g, g + 8
                            const int b = half ? ar.bh : ar.bg, r = half ? ar.rh : ar.rg;
                            const int arow = 16 * warp + g + 8 * half;
                            if (W8) {
                                uint32_t word;
                                memcpy(&word, &st[lean_word8_off(b, r, c, qq) + 4 * (k % 4)], 4);
                                float s;
                                memcpy(&s, &st[L::codes + b * 128 + r * 4], 4);
                                rsc[arow] = s;
                                for (int j = 0; j < 2; j++) { // a0 / a1: j = 0; a2 / a3: 1
                                    const uint32_t d = fp8_w8_decode(word, j);
                                    for (int h = 0; h < 2; h++) {
                                        const float v = lean_bf16_bits((uint16_t)(d >> (16 * h)));
                                        const int kk = k * 16 + 2 * qq + h + 8 * j;
                                        A[(size_t)arow * BK + kk] = ldexp((double)v, 120);
                                    }
                                }
                                continue;
                            }
                            uint32_t wp[2];
                            memcpy(wp, &st[lean_word_off(b, r, c, qq)], 8);
                            const uint32_t word = (k % 4) < 2 ? wp[0] : wp[1];
                            const uint8_t scb = st[L::codes + (b * LEAN_BOX + r) * 16 + k];
                            const uint32_t sbits = (((uint32_t)scb << 4) + WQ_SF_BIAS) << 16;
                            float scale;
                            memcpy(&scale, &sbits, 4);
                            for (int j = jb; j < jb + 2; j++) { // a0 / a1: j = jb; a2 / a3: jb + 1
                                const int rm = wq_rot(j, false), rs = wq_rot(j, true);
                                auto rotl = [](uint32_t v, int rr) {
                                    return rr ? v << rr | v >> (32 - rr) : v;
                                };
                                const uint32_t d = (rotl(word, rm) & WQ_MAG_MASK) |
                                                   (rotl(word, rs) & WQ_SIGN_MASK);
                                for (int h = 0; h < 2; h++) {
                                    const float v = lean_bf16_bits((uint16_t)(d >> (16 * h)));
                                    const int kk = k * 16 + 2 * qq + h + (j == jb ? 0 : 8);
                                    A[(size_t)arow * BK + kk] =
                                        (double)v * scale; // code 2^-126 x scale 2^119
                                }
                            }
                        }
                    }
                }
            // the products, B as the descriptor reads it; FP8: the stage's block times its rows'
            // scales
            for (int part = 0; part < (SPLIT ? 2 : 1); part++)
                for (int k = 0; k < KS; k++)
                    for (int row = 0; row < 64 * WG; row++)
                        for (int n = 0; n < NT; n++) {
                            double sum = 0.0;
                            // STACK: B of 2 NT rows, token n's part at row bn
                            const int bn = STACK ? lean_stack_row<NT>(n, part) : n;
                            const int b0 =
                                STACK ? lean_b_off<2 * NT>(k) : part * L::part + lean_b_off<NT>(k);
                            for (int kk = 0; kk < 16; kk++) {
                                const int l = b0 + (bn / 8) * 1024 + (bn % 8) * 128 + 2 * kk;
                                uint16_t bits;
                                memcpy(&bits, &st[L::codes + L::sf + (l ^ (((l >> 7) & 7) << 4))],
                                       2);
                                sum += A[(size_t)row * BK + k * 16 + kk] * lean_bf16_bits(bits);
                            }
                            acc[row * NT + n] += sum * rsc[row];
                        }
        }
        // the epilogues' places (NVFP4's sums are the values x 2^-7)
        const double f = W8 ? 1.0 : 0x1p7;
        for (int warp = 0; warp < 4 * WG; warp++)
            for (int g = 0; g < 8; g++)
                for (int n = 0; n < rows; n++) {
                    const double lo = acc[(16 * warp + g) * NT + n] * f,
                                 hi = acc[(16 * warp + g + 8) * NT + n] * f;
                    const int col = lean_out_col(gate_up, nb, warp, g, WG);
                    if (gate_up) {
                        const float gv = (float)(lo * s2e[0]), uv = (float)(hi * s2e[1]);
                        y[(size_t)n * N + col] = (double)lean_silu(gv) * uv;
                    } else {
                        y[(size_t)n * N + col] = lo * s2e[2];
                        y[(size_t)n * N + col + 8] = hi * s2e[2];
                    }
                }
    }
}

// max |a - b| over max |b|
double lean_rel(const std::vector<double> &a, const std::vector<double> &b) {
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < b.size(); i++) {
        num = std::max(num, std::fabs(a[i] - b[i]));
        den = std::max(den, std::fabs(b[i]));
    }
    return den > 0.0 ? num / den : num;
}

template <int NT, bool SPLIT, int WG, bool W8, bool STACK = false>
double lean_check_one(lean_problem &p) {
    const int rows = NT - 1, D = p.D, F = p.F;
    double worst = 0.0;
    for (int e = 0; e < p.E; e++) {
        // x's rows in BF16 (split: and their lo parts), the reference's x the sum of both
        std::vector<float> xh((size_t)rows * D), xl((size_t)rows * D, 0.0f);
        for (int i = 0; i < rows * D; i++) {
            const float v = (float)((int)(lean_rand() % 2001) - 1000) / 500.0f;
            xh[i] = lean_bf16(v);
            xl[i] = SPLIT ? lean_bf16(v - xh[i]) : 0.0f;
        }
        const float *s2e = &p.s2[3 * e];
        std::vector<double> h;
        lean_emulate<NT, SPLIT, WG, W8, STACK>(true, xh, xl, rows, p.gu_q, p.gu_sf, p.gu_sc, e,
                                               2 * F, D, F, s2e, h);
        std::vector<double> href((size_t)rows * F);
        for (int n = 0; n < rows; n++)
            for (int f = 0; f < F; f++) {
                double gs = 0.0, us = 0.0;
                for (int k = 0; k < D; k++) {
                    const double xv = (double)xh[(size_t)n * D + k] + xl[(size_t)n * D + k];
                    gs += xv * p.gu_w[((size_t)e * 2 * F + f) * D + k];
                    us += xv * p.gu_w[((size_t)e * 2 * F + F + f) * D + k];
                }
                const float gv = (float)(gs * s2e[0]), uv = (float)(us * s2e[1]);
                href[(size_t)n * F + f] = (double)lean_silu(gv) * uv;
            }
        worst = std::max(worst, lean_rel(h, href));
        // GEMM 2 on h as the kernel stores it (BF16; split: hi and lo)
        std::vector<float> hh((size_t)rows * F), hl((size_t)rows * F, 0.0f);
        for (size_t i = 0; i < hh.size(); i++) {
            hh[i] = lean_bf16((float)h[i]);
            hl[i] = SPLIT ? lean_bf16((float)h[i] - hh[i]) : 0.0f;
        }
        std::vector<double> o, oref((size_t)rows * D);
        lean_emulate<NT, SPLIT, WG, W8, STACK>(false, hh, hl, rows, p.dn_q, p.dn_sf, p.dn_sc, e, D,
                                               F, D, s2e, o);
        for (int n = 0; n < rows; n++)
            for (int d = 0; d < D; d++) {
                double sum = 0.0;
                for (int f = 0; f < F; f++)
                    sum += ((double)hh[(size_t)n * F + f] + hl[(size_t)n * F + f]) *
                           p.dn_w[((size_t)e * D + d) * F + f];
                oref[(size_t)n * D + d] = sum * s2e[2];
            }
        worst = std::max(worst, lean_rel(o, oref));
    }
    return worst;
}

} // namespace

// 0 when every emulated output is within 1e-5 of the reference (the emulation sums in double,
// the reference too: what differs is float's rounding of the gate and up sums); else -1 with the
// case in msg.
extern "C" int cuda_moe_lean_host_check(char *msg, size_t n) {
    double worst = 0.0;
    for (int w8 = 0; w8 < 2; w8++) { // NVFP4, then FP8
        lean_problem p;
        if (w8) {
            lean_matrix8(p.E, 2 * p.F, p.D, p.gu_q, p.gu_sc, p.gu_w);
            lean_matrix8(p.E, p.D, p.F, p.dn_q, p.dn_sc, p.dn_w);
        } else {
            lean_matrix(p.E * 2 * p.F, p.D, p.gu_q, p.gu_sf, p.gu_w);
            lean_matrix(p.E * p.D, p.F, p.dn_q, p.dn_sf, p.dn_w);
        }
        p.s2.resize((size_t)3 * p.E);
        for (auto &v : p.s2)
            v = w8 ? 1.0f : 0.5f + (float)(lean_rand() % 100) / 100.0f;
        // one 64-row tile a block (forms 0, 1, 3 and 4: the same places), two (forms 2 and 5)
        // and four (form 6); 24-row tiles in forms 5 and 6 alone, 4-row ones in forms 3 and 4
        struct one {
            int rows, vw;
            bool split, stack;
            double err;
        };
        auto all = [&](auto f8) {
            constexpr bool W8 = decltype(f8)::value;
            std::vector<one> v;
            auto add = [&](auto nt, auto vw) {
                constexpr int NT = decltype(nt)::value, VW = decltype(vw)::value;
                v.push_back({NT, VW, false, false, lean_check_one<NT, false, VW, W8>(p)});
                v.push_back({NT, VW, true, false, lean_check_one<NT, true, VW, W8>(p)});
                v.push_back({NT, VW, true, true, lean_check_one<NT, true, VW, W8, true>(p)});
            };
            auto rows = [&](auto vw) {
                add(std::integral_constant<int, 8>(), vw);
                add(std::integral_constant<int, 16>(), vw);
                add(std::integral_constant<int, 32>(), vw);
            };
            if constexpr (!W8) // 4-row tiles: NVFP4 stacked, one row tile a block
                v.push_back({4, 1, true, true, lean_check_one<4, true, 1, false, true>(p)});
            rows(std::integral_constant<int, 1>());
            rows(std::integral_constant<int, 2>());
            rows(std::integral_constant<int, 4>());
            add(std::integral_constant<int, 24>(), std::integral_constant<int, 2>());
            add(std::integral_constant<int, 24>(), std::integral_constant<int, 4>());
            return v;
        };
        for (const one &c : w8 ? all(std::true_type()) : all(std::false_type())) {
            if (!(c.err < 1e-5)) {
                snprintf(msg, n,
                         "lean kernels emulated, %s, %d rows, %s, %d row tiles a block: max rel "
                         "err %.3g",
                         w8 ? "FP8" : "NVFP4", c.rows,
                         c.stack   ? "high, stacked"
                         : c.split ? "high"
                                   : "medium",
                         c.vw, c.err);
                return -1;
            }
            worst = std::max(worst, c.err);
        }
    }
    snprintf(msg, n,
             "lean kernels emulated (NVFP4 and FP8; 8, 16, 24 and 32 rows, medium and high, high "
             "stacked too, one, two and four row tiles a block; NVFP4's 4 rows stacked): max rel "
             "err %.2g",
             worst);
    return 0;
}
