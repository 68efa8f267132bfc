// NVFP4 experts at decode sizes (up to 16 pairs of an expert a tile) with the weights as wgmma's
// A operand from registers (moe_lean.h). moe.cu's W4A16 tiles take the weights as mma.sync's B
// operand and x through ldmatrix: about 4.7 instructions a weight, about half the copy rate.
// scripts/bench_nvfp4_decode.cu's w4a16 form of the same decode is 3.0 (docs/benchmarks.md, "No
// device time (2026-12-05, sixteenth session)"); this is that form on moe.cu's data. Written
// without a device: off unless MOESERVE_NVFP4_LEAN=1 until a device call has checked it
// (tests/test_cuda_moe --nvfp4 with the switch on) and timed it.
//
// A block is one tile of an expert's pairs (at most NT, the tokens of wgmma's N) and 64 weight
// rows: GEMM 1's 32 gate rows and the 32 up rows of the same columns, or GEMM 2's 64 down rows.
// Warps 0-3 are one consumer warpgroup, warp 4 the producer. A stage is 256 k:
//   - two TMA boxes of 32 rows x 128 bytes of codes (128-byte swizzle) and two of 32 rows x 16
//     scale bytes, on the stage's full barrier with their bytes;
//   - the tile's activation rows, 256 k of each in BF16 (split: then their lo parts), copied by
//     the producer's 32 lanes with cp.async into the 128-byte swizzled K-major layout wgmma reads
//     through a descriptor (8-row groups 1024 bytes apart; rows past the tile zeros); a lane
//     arrives on the full barrier once its copies have landed (three stages later,
//     cp.async.wait_group) and a proxy fence has made them visible to wgmma.
// A consumer thread (warp w, lane 4 g + q) holds A rows g and g + 8 of its warp's 16: GEMM 1's
// gate and up rows of column 8 w + g, so that silu(gate) x up is formed in registers; GEMM 2's
// rows 16 w + g and + 8. The tiles' layout (nvfp4_pack_kernel) gives lane q of a row one word a
// 64-k chunk for two k16 steps: registers a0 and a2 of a step come from row g's word, a1 and a3
// from row g + 8's, each through wq_decode and one bf16x2 product by its group scale, as the
// tiles decode their B fragments. The k16 steps go in increasing k, each one m64nNTk16 wgmma on the
// running sums (split: the hi part, then the lo part), as the tiles' one chain does.
// The epilogues are the tiles': the tensor scales by __fmul_rn, silu(gate) x up rounded to BF16
// (split: hi and lo), GEMM 2's rows in fp32 to out by pair.
#include "kernels/cuda/moe_lean.h"

#include <algorithm>

#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/gemm_common.cuh"
#include "kernels/cuda/hopper.cuh"

typedef __nv_bfloat16 bf16;

#define LEAN_BK     256 /* k a stage */
#define LEAN_BOX    32  /* weight rows a TMA box, two a stage */
#define LEAN_STAGES 4
#define LEAN_CODES  (2 * LEAN_BOX * 128) /* 8192 */
#define LEAN_SF     (2 * LEAN_BOX * 16)  /* 1024 */

template <int NT, bool SPLIT> struct lean_stage {
    static constexpr int part = NT * 128 * (LEAN_BK / 64); // NT rows x 128 bytes, 4 atoms of 64 k
    static constexpr int bytes = LEAN_CODES + LEAN_SF + (SPLIT ? 2 : 1) * part;
    static_assert(bytes % 1024 == 0, "stages on the swizzle's 1024-byte pattern");
    static constexpr size_t smem = (size_t)LEAN_STAGES * bytes + 1024; // + the alignment
};

struct lean_args {
    const bf16 *act; // GATE_UP: xb [T, Kd], rows by pair / topk; else h [n, Kd] in grouped order
    int64_t act_lo;  // split: elements from act to its lo part
    const int32_t *pairs;
    const int4 *tiles;
    const int32_t *n_tiles;
    bf16 *h; // GATE_UP's output [n, N] (split: the lo parts h_lo elements on)
    int64_t h_lo;
    float *out;       // GEMM 2's output [T K, N], rows by pair
    const float *ws2; // tensor scales [E, 3]
    int Kd, N, topk, n_col_blocks, w_rows;
};

// d += a b over k16, B (NT tokens) through descriptor b
template <int NT>
__device__ __forceinline__ void lean_wgmma(float *d, const uint32_t (&a)[4], uint64_t b);
template <>
__device__ __forceinline__ void lean_wgmma<8>(float *d, const uint32_t (&a)[4], uint64_t b) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0, %1, %2, %3}, "
                 "{%4, %5, %6, %7}, %8, 1, 1, 1, 0;\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}
template <>
__device__ __forceinline__ void lean_wgmma<16>(float *d, const uint32_t (&a)[4], uint64_t b) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, "
                 "%6, %7}, {%8, %9, %10, %11}, %12, 1, 1, 1, 0;\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
                   "+f"(d[6]), "+f"(d[7])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

template <bool GATE_UP, bool SPLIT, int NT>
__global__ void __launch_bounds__(160)
    moe_lean_kernel(const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tsf,
                    const lean_args a) {
#if MOESERVE_WGMMA_DEVICE
    typedef lean_stage<NT, SPLIT> L;
    constexpr int S = LEAN_STAGES, SB = L::bytes;
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
    // GEMM 1's blocks passed their waits (and so before this grid could launch)
    const int tile = blockIdx.x / a.n_col_blocks, nb = blockIdx.x % a.n_col_blocks;
    if (tile >= __ldcg(a.n_tiles)) return; // idle block of the upper-bound grid
    const int4 ti = __ldcg(&a.tiles[tile]);
    const int e = ti.x, row0 = ti.y, rows = ti.z - ti.y;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    if (tid == 0) {
        for (int s = 0; s < S; s++) {
            mbar_init(full(s), 1 + 32); // the TMA lane's arrival, the producer lanes' copies
            mbar_init(empty(s), 4);     // each consumer warp
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    const int nk = a.Kd / LEAN_BK;
    // the weight rows of the stage's two boxes: GATE_UP's gate and up rows of columns nb 32 ..,
    // GEMM 2's rows nb 64 .. and + 32
    const int wrow0 = e * a.w_rows + nb * (GATE_UP ? LEAN_BOX : 2 * LEAN_BOX);
    const int wrow1 = wrow0 + (GATE_UP ? a.N : LEAN_BOX);

    if (warp == 4) { // the producer
        auto weights = [&](int kt, int s) {
            if (lane == 0) {
                const uint32_t st = smem0 + s * SB;
                mbar_arrive_tx(full(s), LEAN_CODES + LEAN_SF);
                tma_load_2d(st, &tq, kt * 128, wrow0, full(s));
                tma_load_2d(st + LEAN_BOX * 128, &tq, kt * 128, wrow1, full(s));
                tma_load_2d(st + LEAN_CODES, &tsf, kt * 16, wrow0, full(s));
                tma_load_2d(st + LEAN_CODES + LEAN_BOX * 16, &tsf, kt * 16, wrow1, full(s));
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
        if (n < rows)
            src =
                a.act + (int64_t)(GATE_UP ? __ldcg(&a.pairs[row0 + n]) / a.topk : row0 + n) * a.Kd;
        // a stage's copies are one group. A lane makes its group of stage kt visible to wgmma
        // (the async proxy: a proxy fence once it has landed) and arrives for the stage LAG
        // stages later, so that its waits never hold back the stages in flight; LAG = S - 1
        // keeps the producer from waiting on a stage the consumers still need it to arrive for
        constexpr int LAG = S - 1;
        int s = 0, ph = 0;
        for (int kt = 0; kt < nk; kt++) {
            if (kt >= pre) {
                mbar_wait(empty(s), ph ^ 1);
                weights(kt, s);
            }
            const uint32_t act = smem0 + s * SB + LEAN_CODES + LEAN_SF;
#pragma unroll
            for (int j = 0; j < NT; j++) {
                const int u = lane / NT + (32 / NT) * j; // chunk of the stage's 256 k
                const uint32_t dst =
                    act + (u / 8) * (NT * 128) + n * 128 + (((u % 8) ^ (n & 7)) * 16);
                const bf16 *p = src ? src + kt * LEAN_BK + u * 8 : a.act;
#pragma unroll
                for (int part = 0; part < (SPLIT ? 2 : 1); part++)
                    cp_async16(dst + part * L::part, p + (src ? part * a.act_lo : 0), src ? 16 : 0);
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

    // the consumers: A rows g and g + 8 of the warp, as box b row r
    const int g = lane >> 2, q = lane & 3;
    const int bg = GATE_UP ? 0 : warp >> 1, bh = GATE_UP ? 1 : warp >> 1;
    const int rg = GATE_UP ? 8 * warp + g : 16 * (warp & 1) + g, rh = GATE_UP ? rg : rg + 8;
    // a row's lane-q word pair of 64-k chunk c: 16-byte unit 2 c + q / 2 of the swizzled row
    auto word_off = [&](int b, int r, int c) {
        return b * LEAN_BOX * 128 + r * 128 + (((2 * c + (q >> 1)) ^ (r & 7)) * 16) + 8 * (q & 1);
    };
    float acc[NT / 2];
#pragma unroll
    for (int i = 0; i < NT / 2; i++)
        acc[i] = 0.0f;
    int s = 0, ph = 0;
    for (int kt = 0; kt < nk; kt++) {
        mbar_wait(full(s), ph);
        const unsigned char *st = smem + s * SB;
        uint2 wg[4], wh[4];
#pragma unroll
        for (int c = 0; c < 4; c++) {
            wg[c] = *reinterpret_cast<const uint2 *>(st + word_off(bg, rg, c));
            wh[c] = *reinterpret_cast<const uint2 *>(st + word_off(bh, rh, c));
        }
        const uint4 sg =
            *reinterpret_cast<const uint4 *>(st + LEAN_CODES + (bg * LEAN_BOX + rg) * 16);
        const uint4 sh =
            *reinterpret_cast<const uint4 *>(st + LEAN_CODES + (bh * LEAN_BOX + rh) * 16);
        const uint32_t sgw[4] = {sg.x, sg.y, sg.z, sg.w}, shw[4] = {sh.x, sh.y, sh.z, sh.w};
        uint32_t fr[16][4];
#pragma unroll
        for (int k = 0; k < 16; k++) { // k16 step k: chunk k / 4, word (k % 4) / 2
            const int c = k / 4, jb = 2 * (k % 2);
            const uint32_t qg = (k % 4) < 2 ? wg[c].x : wg[c].y;
            const uint32_t qh = (k % 4) < 2 ? wh[c].x : wh[c].y;
            const uint32_t ag = wq_scale2(sgw[k / 4], k % 4), ah = wq_scale2(shw[k / 4], k % 4);
            fr[k][0] = bf16x2_mul(wq_decode(qg, jb), ag);
            fr[k][1] = bf16x2_mul(wq_decode(qh, jb), ah);
            fr[k][2] = bf16x2_mul(wq_decode(qg, jb + 1), ag);
            fr[k][3] = bf16x2_mul(wq_decode(qh, jb + 1), ah);
        }
        // step k's B: atom k / 4, its 32 bytes (k % 4); the descriptor's start field is the
        // address / 16, below 2^14, so the offsets add to stage 0's without a carry
        const uint64_t d0 =
            wgmma_desc_sw128(smem0 + LEAN_CODES + LEAN_SF) + (uint32_t)(s * (SB >> 4));
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
        for (int k = 0; k < 16; k++) {
            const uint64_t d = d0 + (uint32_t)(((k / 4) * (NT * 128) + (k % 4) * 32) >> 4);
            lean_wgmma<NT>(acc, fr[k], d);
            if constexpr (SPLIT) lean_wgmma<NT>(acc, fr[k], d + (L::part >> 4));
        }
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
        __syncwarp();
        if (lane == 0) mbar_arrive(empty(s));
        if (++s == S) s = 0, ph ^= 1;
    }
    pdl_wait(); // before the first write (a no-op where the kernel waited at its start)
    // acc[4 j + i]: n8 block j; i 0, 1 row g columns 8 j + 2 q, + 1; i 2, 3 row g + 8
    if constexpr (GATE_UP) {
        const int f = nb * LEAN_BOX + 8 * warp + g;
        const float sgt = __ldg(&a.ws2[3 * e]), sut = __ldg(&a.ws2[3 * e + 1]);
#pragma unroll
        for (int j = 0; j < NT / 8; j++)
#pragma unroll
            for (int i = 0; i < 2; i++) {
                const int r = 8 * j + 2 * q + i;
                if (r >= rows) continue;
                const float gv = __fmul_rn(acc[4 * j + i], sgt);
                const float uv = __fmul_rn(acc[4 * j + 2 + i], sut);
                bf16 *dst = a.h + (int64_t)(row0 + r) * a.N + f;
                if constexpr (SPLIT) {
                    const float v = __fmul_rn(silu(gv), uv);
                    const bf16 hi = __float2bfloat16_rn(v);
                    *dst = hi;
                    dst[a.h_lo] = __float2bfloat16_rn(__fsub_rn(v, __bfloat162float(hi)));
                } else {
                    *dst = __float2bfloat16_rn(silu(gv) * uv);
                }
            }
    } else {
        const int d0 = nb * 2 * LEAN_BOX + 16 * warp + g;
        const float sdt = __ldg(&a.ws2[3 * e + 2]);
#pragma unroll
        for (int j = 0; j < NT / 8; j++)
#pragma unroll
            for (int i = 0; i < 2; i++) {
                const int r = 8 * j + 2 * q + i;
                if (r >= rows) continue;
                float *dst = a.out + (int64_t)__ldcg(&a.pairs[row0 + r]) * a.N + d0;
                dst[0] = __fmul_rn(acc[4 * j + i], sdt);
                dst[8] = __fmul_rn(acc[4 * j + 2 + i], sdt);
            }
    }
#endif
}

static int g_lean = -1;

// Test hook (tests/test_cuda_moe): the lean kernels on (1) or off (0) from now on, or back to
// MOESERVE_NVFP4_LEAN (-1); returns the setting before.
extern "C" int cuda_moe_w4_lean(int on) {
    const int old = g_lean;
    g_lean = on < 0 ? -1 : on != 0;
    return old;
}

int moe_lean_w4_rows(int64_t n_pairs, int E, int D, int F) {
    // off unless MOESERVE_NVFP4_LEAN=1 (cuda_env_count: the value, 0 when unset)
    if (cuda_env_count("MOESERVE_NVFP4_LEAN", 0, &g_lean) != 1 || !cuda_wgmma_device()) return 0;
    if (D % LEAN_BK || F % LEAN_BK || E <= 0) return 0;
    return n_pairs <= 8 * (int64_t)E ? 8 : n_pairs <= 16 * (int64_t)E ? 16 : 0;
}

template <bool GATE_UP, bool SPLIT, int NT>
static void lean_launch(const CUtensorMap &tq, const CUtensorMap &tsf, const lean_args &a,
                        int max_tiles) {
    auto kernel = moe_lean_kernel<GATE_UP, SPLIT, NT>;
    static size_t set = 0;
    cuda_smem_allow(kernel, lean_stage<NT, SPLIT>::smem, &set);
    const int64_t blocks = (int64_t)max_tiles * a.n_col_blocks;
    cuda_launch_pdl(kernel, dim3((unsigned)blocks), dim3(160), lean_stage<NT, SPLIT>::smem, tq, tsf,
                    a);
}

template <bool SPLIT, int NT>
static void lean_both(lean_args a, int max_tiles, const uint8_t *gate_up_q,
                      const uint8_t *gate_up_sf, const uint8_t *down_q, const uint8_t *down_sf,
                      int E, int D, int F) {
    // GEMM 1: gate_up [E 2F rows, D / 2 code bytes, D / 16 scale bytes]
    const CUtensorMap q1 = tma_map_rows(gate_up_q, (int64_t)E * 2 * F, D / 2, LEAN_BOX);
    const CUtensorMap s1 = tma_map_rows(gate_up_sf, (int64_t)E * 2 * F, D / 16, LEAN_BOX, 16, true);
    a.Kd = D;
    a.N = F;
    a.w_rows = 2 * F;
    a.n_col_blocks = F / LEAN_BOX;
    lean_launch<true, SPLIT, NT>(q1, s1, a, max_tiles);
    // GEMM 2: down [E D rows, F / 2, F / 16], its activations h in grouped order
    const CUtensorMap q2 = tma_map_rows(down_q, (int64_t)E * D, F / 2, LEAN_BOX);
    const CUtensorMap s2 = tma_map_rows(down_sf, (int64_t)E * D, F / 16, LEAN_BOX, 16, true);
    a.act = a.h;
    a.act_lo = a.h_lo;
    a.Kd = F;
    a.N = D;
    a.w_rows = D;
    a.n_col_blocks = D / (2 * LEAN_BOX);
    lean_launch<false, SPLIT, NT>(q2, s2, a, max_tiles);
}

void moe_lean_w4_experts(float *out, const bf16 *xb, int64_t xb_lo, const int32_t *pairs,
                         const int4 *tiles, const int32_t *n_tiles, int max_tiles, int K,
                         const uint8_t *gate_up_q, const uint8_t *gate_up_sf, const uint8_t *down_q,
                         const uint8_t *down_sf, const float *s2, int E, int D, int F,
                         int64_t n_pairs, int rows, bool split, bf16 *h) {
    lean_args a = {};
    a.act = xb;
    a.act_lo = xb_lo;
    a.pairs = pairs;
    a.tiles = tiles;
    a.n_tiles = n_tiles;
    a.h = h;
    a.h_lo = split ? n_pairs * F : 0;
    a.out = out;
    a.ws2 = s2;
    a.topk = K;
    if (rows == 8)
        split ? lean_both<true, 8>(a, max_tiles, gate_up_q, gate_up_sf, down_q, down_sf, E, D, F)
              : lean_both<false, 8>(a, max_tiles, gate_up_q, gate_up_sf, down_q, down_sf, E, D, F);
    else
        split ? lean_both<true, 16>(a, max_tiles, gate_up_q, gate_up_sf, down_q, down_sf, E, D, F)
              : lean_both<false, 16>(a, max_tiles, gate_up_q, gate_up_sf, down_q, down_sf, E, D, F);
}
