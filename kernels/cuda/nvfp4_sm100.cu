// NVFP4 x NVFP4 grouped GEMM on Blackwell's block-scaled tensor cores (sm_100a: tcgen05.mma
// .kind::mxf4nvf4, scale_vec::4X): the first piece of docs/blackwell_nvfp4.md. Built for sm_100a
// alone (the Makefile's rule for *_sm100.cu); the host runs it only where the device reports
// compute capability 10.0 (cuda_nvfp4_sm100_available). No Blackwell GPU has been lent to this
// project: the kernel compiles, and tests/test_cuda_nvfp4_sm100.c checks it against the CPU on
// such a GPU (elsewhere it says "skipped"); the serving path takes it only when asked
// (MOESERVE_NVFP4_SM100=1, moe.cu's cuda_prepare_experts_nvfp4).
//
// What it computes (cuda_ops.h, cuda_nvfp4_sm100_gemm): rows in blocks of 128, each block one
// expert's (blk_e) with its first blk_rows rows valid; out[r, n] = sa[r] sb[e, n / 128] sum_k
// (a[r, k] sfa[r, k / 16]) (b_e[n, k] sfb_e[n, k / 16]), a and b E2M1 codes, sfa and sfb E4M3 group
// scales (NVFP4's record: kernels/quant.h), summed in the tensor core in fp32.
//
// The layout the hardware reads:
// - codes: K-major rows of K / 2 bytes (the even element in the low nibble, as the checkpoints
//   store them), fetched by TMA in boxes of 128 bytes (256 k) x 128 rows with the 128-byte
//   swizzle; each MMA of K = 64 reads 32 bytes of every row, so the descriptors' start address
//   moves by 32 bytes within the swizzled rows, as the Hopper wgmma kernels do for their k16.
// - group scales: the 128 x 4 atoms (quant_nvfp4_sf_atoms, kernels/quant.h), 512 bytes for 128
//   rows and 64 k: row r's four scales at (r % 32) * 16 + (r / 32) * 4. tcgen05.cp .32x128b
//   .warpx4 copies one atom to four TMEM columns of every lane quarter; the MMA finds row r's
//   scales at lane r % 32, column r / 32. A stage (256 k) carries four atoms of each operand,
//   one bulk copy each, and they go to the stage's own TMEM columns (a stage's columns are written
//   again only after its empty barrier, when the MMAs that read them have completed).
// - the accumulator: M = 128 TMEM lanes (row r at lane r) by N = 128 fp32 columns.
//
// Roles (192 threads, one block an SM, persistent over the tiles t = blockIdx.x + i gridDim.x,
// n-block t % nb of row block t / nb):
// - warp 0, lane 0: the producer. Per stage: codes of A and B by TMA, the eight atoms by two bulk
//   copies, all counted on the stage's full barrier.
// - warp 1: allocates the TMEM (256 columns: the accumulator, then 32 a stage for the scales);
//   lane 0 issues the scale copies and the MMAs, then tcgen05.commit to the stage's empty barrier,
//   and after a tile's last stage to the accumulator's full barrier.
// - warps 2 to 5: the epilogue. Warp w reads the lanes of quarter w % 4 (tcgen05.ld 32x32b, a row
//   a thread), multiplies by sa[r] sb[e, n / 128] and stores fp32; then arrives on the
//   accumulator's empty barrier so that the next tile's MMAs may start.
// One accumulator: a tile's MMAs wait for the epilogue of the tile before (two buffers, the design
// paper's next step, would overlap them).
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

#include "common/log.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/hopper.cuh"

enum {
    NV4_BM = 128,   // rows a tile (MMA M)
    NV4_BN = 128,   // columns a tile (MMA N)
    NV4_BK = 256,   // k a stage: 128 bytes of codes a row
    NV4_MMA_K = 64, // k an MMA
    NV4_STAGES = 4,
    NV4_CODE_BYTES = NV4_BM * NV4_BK / 2,               // 16 KiB of A (and of B) a stage
    NV4_ATOM_BYTES = 512,                               // 128 rows x 64 k of scales
    NV4_SF_BYTES = NV4_BK / NV4_MMA_K * NV4_ATOM_BYTES, // 2 KiB of scales an operand a stage
    NV4_STAGE_BYTES = 2 * NV4_CODE_BYTES + 2 * NV4_SF_BYTES,
    NV4_THREADS = 192,
    NV4_TMEM_COLS = 256,                            // accumulator 128, scales 32 a stage
    NV4_SF_COL = NV4_BN,                            // the first scale column
    NV4_SMEM = NV4_STAGES * NV4_STAGE_BYTES + 1024, // + the 1024-byte alignment of the stages
};
static_assert(NV4_STAGE_BYTES % 1024 == 0, "stages stay 1024-byte aligned");
static_assert(NV4_SF_COL + NV4_STAGES * 32 <= NV4_TMEM_COLS, "scale columns fit");

typedef struct {
    float *out;               // [n_blk 128, N]
    const float *sa, *sb;     // [n_blk 128], [E N / 128]
    const uint8_t *sfa, *sfb; // atoms [n_blk][K / 64], [E N / 128][K / 64]
    const int32_t *blk_e, *blk_rows;
    int n_blk, N, K;
} nv4_args;

// The shared-memory descriptor of a K-major 128-byte-swizzled tile (Blackwell's form): start >> 4
// (bits 0-13), leading byte offset 1 (unused here), stride 1024 >> 4 between groups of eight rows
// (bits 32-45), descriptor version 1 (bits 46-47), layout 2 = 128-byte swizzle (bits 61-63).
__device__ __forceinline__ uint64_t nv4_desc_sw128(uint32_t addr) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | (uint64_t)1 << 16 | (uint64_t)(1024 >> 4) << 32 |
           (uint64_t)1 << 46 | (uint64_t)2 << 61;
}
// The descriptor tcgen05.cp reads an atom of scales through: 32 rows of 16 bytes, no swizzle,
// eight-row groups 128 bytes apart.
__device__ __forceinline__ uint64_t nv4_desc_sf(uint32_t addr) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | (uint64_t)(128 >> 4) << 32 | (uint64_t)1 << 46;
}
// The instruction descriptor of kind::mxf4nvf4: A and B E2M1 (format 1, bits 7-9 and 10-12), both
// K-major (bits 15, 16 zero), N >> 3 (bits 17-22), scales UE4M3 (bit 23 zero), M >> 4 (bits
// 24-28), scale ids 0, K = 64 (bit 31 zero).
constexpr uint32_t NV4_IDESC =
    1u << 7 | 1u << 10 | (uint32_t)(NV4_BN >> 3) << 17 | (uint32_t)(NV4_BM >> 4) << 24;

__device__ __forceinline__ void tc_fence_before() {
    asm volatile("tcgen05.fence::before_thread_sync;\n" ::: "memory");
}
__device__ __forceinline__ void tc_fence_after() {
    asm volatile("tcgen05.fence::after_thread_sync;\n" ::: "memory");
}
// D (+)= (A sfa) (B sfb)^T for one K = 64 step
__device__ __forceinline__ void nv4_mma(uint32_t d, uint64_t a, uint64_t b, uint32_t sfa,
                                        uint32_t sfb, int accumulate) {
    asm volatile("{\n"
                 ".reg .pred p;\n"
                 "setp.ne.b32 p, %4, 0;\n"
                 "tcgen05.mma.cta_group::1.kind::mxf4nvf4.block_scale.scale_vec::4X [%0], %1, %2, "
                 "%3, [%5], [%6], p;\n"
                 "}\n" ::"r"(d),
                 "l"(a), "l"(b), "r"(NV4_IDESC), "r"(accumulate), "r"(sfa), "r"(sfb)
                 : "memory");
}
// the barrier at bar gets one arrival when every tcgen05 operation this thread issued is done
__device__ __forceinline__ void tc_commit(uint32_t bar) {
    asm volatile(
        "tcgen05.commit.cta_group::1.mbarrier::arrive::one.shared::cluster.b64 [%0];\n" ::"r"(bar)
        : "memory");
}
// 16 fp32 columns of the warp's lane quarter from TMEM address taddr, a row a lane (the wait in
// the same statement, so that nothing reads v before the load is complete)
__device__ __forceinline__ void tc_ld16(uint32_t taddr, float *v) {
    uint32_t r[16];
    asm volatile("tcgen05.ld.sync.aligned.32x32b.x16.b32 {%0, %1, %2, %3, %4, %5, %6, %7, %8, "
                 "%9, %10, %11, %12, %13, %14, %15}, [%16];\n"
                 "tcgen05.wait::ld.sync.aligned;\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]), "=r"(r[4]), "=r"(r[5]),
                   "=r"(r[6]), "=r"(r[7]), "=r"(r[8]), "=r"(r[9]), "=r"(r[10]), "=r"(r[11]),
                   "=r"(r[12]), "=r"(r[13]), "=r"(r[14]), "=r"(r[15])
                 : "r"(taddr)
                 : "memory");
#pragma unroll
    for (int i = 0; i < 16; i++)
        v[i] = __uint_as_float(r[i]);
}

// ta: A's codes [n_blk 128, K / 2] bytes; tb: B's [E N, K / 2]; boxes of 128 bytes x 128 rows.
__global__ void __launch_bounds__(NV4_THREADS, 1)
    nv4_gemm_kernel(const __grid_constant__ CUtensorMap ta, const __grid_constant__ CUtensorMap tb,
                    const nv4_args p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 1000 // built for another device: never launched there
    __trap();
#else
    extern __shared__ __align__(16) unsigned char nv4_smem[];
    // full[s], empty[s], then the accumulator's full and empty
    __shared__ __align__(8) uint64_t bars[2 * NV4_STAGES + 2];
    __shared__ uint32_t tmem_slot;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const uint32_t bar0 = (uint32_t)__cvta_generic_to_shared(bars);
    auto full = [&](int s) { return bar0 + 8 * s; };
    auto empty = [&](int s) { return bar0 + 8 * (NV4_STAGES + s); };
    const uint32_t acc_full = bar0 + 8 * (2 * NV4_STAGES), acc_empty = acc_full + 8;
    if (tid == 0) {
        for (int s = 0; s < NV4_STAGES; s++) {
            mbar_init(full(s), 1);  // the producer's arrival with the bytes
            mbar_init(empty(s), 1); // the MMA thread's commit
        }
        mbar_init(acc_full, 1);       // the commit after a tile's last stage
        mbar_init(acc_empty, 4 * 32); // every epilogue thread
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    if (warp == 1) { // the whole warp allocates; the address lands in tmem_slot
        asm volatile("tcgen05.alloc.cta_group::1.sync.aligned.shared::cta.b32 [%0], %1;\n" ::"r"(
                         (uint32_t)__cvta_generic_to_shared(&tmem_slot)),
                     "r"((uint32_t)NV4_TMEM_COLS)
                     : "memory");
        asm volatile("tcgen05.relinquish_alloc_permit.cta_group::1.sync.aligned;\n" ::: "memory");
    }
    tc_fence_before();
    __syncthreads();
    tc_fence_after();
    const uint32_t tmem = tmem_slot;
    const uint32_t smem_raw = (uint32_t)__cvta_generic_to_shared(nv4_smem);
    const uint32_t smem0 = (smem_raw + 1023u) & ~1023u;
    auto stage_a = [&](int s) { return smem0 + s * NV4_STAGE_BYTES; };
    auto stage_b = [&](int s) { return stage_a(s) + NV4_CODE_BYTES; };
    auto stage_sfa = [&](int s) { return stage_b(s) + NV4_CODE_BYTES; };
    auto stage_sfb = [&](int s) { return stage_sfa(s) + NV4_SF_BYTES; };
    const int nb = p.N / NV4_BN, nks = p.K / NV4_BK, atoms_k = p.K / NV4_MMA_K;
    const int tiles = p.n_blk * nb;
    // a tile's expert, or -1 when the block has no rows (every role skips it alike)
    auto tile_expert = [&](int t) {
        const int blk = t / nb, e = __ldg(&p.blk_e[blk]);
        return e >= 0 && __ldg(&p.blk_rows[blk]) > 0 ? e : -1;
    };

    if (warp == 0) { // the producer
        if (lane == 0) {
            asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&ta))
                         : "memory");
            asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&tb))
                         : "memory");
            int it = 0;
            for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
                const int e = tile_expert(t);
                if (e < 0) continue;
                const int blk = t / nb, nblk_b = e * nb + t % nb; // B's 128-row block
                for (int ks = 0; ks < nks; ks++, it++) {
                    const int s = it % NV4_STAGES;
                    mbar_wait(empty(s), ((it / NV4_STAGES) & 1) ^ 1);
                    mbar_arrive_tx(full(s), NV4_STAGE_BYTES);
                    tma_load_2d(stage_a(s), &ta, ks * (NV4_BK / 2), blk * NV4_BM, full(s));
                    tma_load_2d(stage_b(s), &tb, ks * (NV4_BK / 2), nblk_b * NV4_BN, full(s));
                    const int64_t atom = (int64_t)ks * (NV4_BK / NV4_MMA_K);
                    bulk_load(stage_sfa(s),
                              p.sfa + ((int64_t)blk * atoms_k + atom) * NV4_ATOM_BYTES,
                              NV4_SF_BYTES, full(s));
                    bulk_load(stage_sfb(s),
                              p.sfb + ((int64_t)nblk_b * atoms_k + atom) * NV4_ATOM_BYTES,
                              NV4_SF_BYTES, full(s));
                }
            }
        }
    } else if (warp == 1) { // the MMA thread
        if (lane == 0) {
            int it = 0, n_tile = 0;
            for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
                if (tile_expert(t) < 0) continue;
                mbar_wait(acc_empty, (n_tile & 1) ^ 1); // the epilogue of the tile before is done
                tc_fence_after();
                for (int ks = 0; ks < nks; ks++, it++) {
                    const int s = it % NV4_STAGES;
                    mbar_wait(full(s), (it / NV4_STAGES) & 1);
                    tc_fence_after();
                    const uint32_t sf_col = tmem + NV4_SF_COL + 32 * s; // A's 16, then B's 16
#pragma unroll
                    for (int j = 0; j < NV4_BK / NV4_MMA_K; j++) {
                        asm volatile("tcgen05.cp.cta_group::1.32x128b.warpx4 [%0], %1;\n" ::"r"(
                                         sf_col + 4 * j),
                                     "l"(nv4_desc_sf(stage_sfa(s) + j * NV4_ATOM_BYTES))
                                     : "memory");
                        asm volatile("tcgen05.cp.cta_group::1.32x128b.warpx4 [%0], %1;\n" ::"r"(
                                         sf_col + 16 + 4 * j),
                                     "l"(nv4_desc_sf(stage_sfb(s) + j * NV4_ATOM_BYTES))
                                     : "memory");
                    }
                    const uint64_t da = nv4_desc_sw128(stage_a(s)), db = nv4_desc_sw128(stage_b(s));
#pragma unroll
                    for (int j = 0; j < NV4_BK / NV4_MMA_K; j++) // 32 bytes of each row a step
                        nv4_mma(tmem, da + 2 * j, db + 2 * j, sf_col + 4 * j, sf_col + 16 + 4 * j,
                                ks > 0 || j > 0);
                    tc_commit(empty(s)); // the stage is free once these MMAs are done
                }
                tc_commit(acc_full);
                n_tile++;
            }
        }
    } else { // the epilogue: warp quarter q reads TMEM lanes 32 q .. 32 q + 31
        const int q = warp & 3, r_in = 32 * q + lane;
        int n_tile = 0;
        for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
            const int e = tile_expert(t);
            if (e < 0) continue;
            const int blk = t / nb, n0 = (t % nb) * NV4_BN;
            mbar_wait(acc_full, n_tile & 1);
            tc_fence_after();
            const bool valid = r_in < __ldg(&p.blk_rows[blk]);
            const int64_t r = (int64_t)blk * NV4_BM + r_in;
            const float scale = valid ? __ldg(&p.sa[r]) * __ldg(&p.sb[e * nb + t % nb]) : 0.0f;
            float *o = p.out + r * p.N + n0;
#pragma unroll 1
            for (int c = 0; c < NV4_BN; c += 16) {
                float v[16];
                tc_ld16(tmem + ((uint32_t)(32 * q) << 16) + c, v); // every lane: .sync.aligned
                if (valid) {
#pragma unroll
                    for (int i = 0; i < 16; i += 4)
                        *reinterpret_cast<float4 *>(o + c + i) = make_float4(
                            v[i] * scale, v[i + 1] * scale, v[i + 2] * scale, v[i + 3] * scale);
                }
            }
            tc_fence_before();
            mbar_arrive(acc_empty);
            n_tile++;
        }
    }
    tc_fence_before();
    __syncthreads();
    if (warp == 1) {
        tc_fence_after();
        asm volatile("tcgen05.dealloc.cta_group::1.sync.aligned.b32 %0, %1;\n" ::"r"(tmem),
                     "r"((uint32_t)NV4_TMEM_COLS)
                     : "memory");
    }
#endif
}

int cuda_nvfp4_sm100_available(void) {
    static int ok = -1;
    if (ok < 0) {
        int dev = 0, major = 0, minor = 0;
        cudaFuncAttributes fa;
        // sm_100a code runs on compute capability 10.0 alone (B200, GB200)
        ok =
            cudaGetDevice(&dev) == cudaSuccess &&
            cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess &&
            cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) == cudaSuccess &&
            major == 10 && minor == 0 && cudaFuncGetAttributes(&fa, nv4_gemm_kernel) == cudaSuccess;
        cudaGetLastError(); // a device without the kernel's image leaves an error: not ours
    }
    return ok;
}

void cuda_nvfp4_sm100_gemm(float *out, const uint8_t *a, const uint8_t *sfa, const float *sa,
                           const uint8_t *b, const uint8_t *sfb, const float *sb,
                           const int32_t *blk_e, const int32_t *blk_rows, int n_blk, int N, int K,
                           int E) {
    MS_ASSERT(cuda_nvfp4_sm100_available());
    MS_ASSERT(N > 0 && N % NV4_BN == 0 && K > 0 && K % NV4_BK == 0 && E > 0 && n_blk >= 0);
    MS_ASSERT(((uintptr_t)a & 15) == 0 && ((uintptr_t)b & 15) == 0 && ((uintptr_t)sfa & 15) == 0 &&
              ((uintptr_t)sfb & 15) == 0 && ((uintptr_t)out & 15) == 0);
    if (n_blk == 0) return;
    const CUtensorMap ta = tma_map_rows(a, (int64_t)n_blk * NV4_BM, K / 2, NV4_BM);
    const CUtensorMap tb = tma_map_rows(b, (int64_t)E * N, K / 2, NV4_BN);
    nv4_args p = {};
    p.out = out;
    p.sa = sa;
    p.sb = sb;
    p.sfa = sfa;
    p.sfb = sfb;
    p.blk_e = blk_e;
    p.blk_rows = blk_rows;
    p.n_blk = n_blk;
    p.N = N;
    p.K = K;
    static size_t attr_set = 0;
    cuda_smem_allow(nv4_gemm_kernel, NV4_SMEM, &attr_set);
    static int sms = 0;
    if (!sms) {
        int dev = 0;
        CUDA_CHECK(cudaGetDevice(&dev));
        CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    }
    const int64_t tiles = (int64_t)n_blk * (N / NV4_BN);
    const unsigned grid = (unsigned)(tiles < sms ? tiles : sms);
    nv4_gemm_kernel<<<grid, NV4_THREADS, NV4_SMEM, cuda_stream()>>>(ta, tb, p);
    CUDA_CHECK_LAUNCH();
}

// ---- the experts' two GEMMs (cuda_ops.h, cuda_nvfp4_sm100_experts) ----

// The scratch's pieces, each 256-byte aligned: the blocks' tables, x's (then h's) codes, atoms and
// tensor scales, GEMM 1's fp32 rows, GEMM 2's.
typedef struct {
    size_t blk_e, blk_rows, pblk, row_pair, q, atoms, sa, g1, g2, end;
} nv4_scratch;

static nv4_scratch nv4_scratch_layout(int64_t n_pairs, int E, int D, int F) {
    const int64_t n_blk = cuda_nvfp4_blocks_max(n_pairs, E), R = n_blk * NV4_BM;
    const int64_t C = D > F ? D : F;
    nv4_scratch l;
    size_t at = 0;
    auto take = [&](size_t bytes) {
        const size_t here = at;
        at += (bytes + 255) / 256 * 256;
        return here;
    };
    l.blk_e = take(sizeof(int32_t) * (size_t)n_blk);
    l.blk_rows = take(sizeof(int32_t) * (size_t)n_blk);
    l.pblk = take(sizeof(int32_t) * (size_t)(E + 1));
    l.row_pair = take(sizeof(int32_t) * (size_t)R);
    l.q = take((size_t)(R * C / 2));
    l.atoms = take((size_t)n_blk * (size_t)(C / 64) * NV4_ATOM_BYTES);
    l.sa = take(sizeof(float) * (size_t)R);
    l.g1 = take(sizeof(float) * (size_t)(R * 2 * F));
    l.g2 = take(sizeof(float) * (size_t)(R * D));
    l.end = at;
    return l;
}

size_t cuda_nvfp4_sm100_experts_scratch(int64_t n_pairs, int E, int D, int F) {
    return nv4_scratch_layout(n_pairs, E, D, F).end;
}

void cuda_nvfp4_sm100_experts(float *out, const float *x, int D, int F, int topk,
                              const int32_t *pairs, const int32_t *offsets, int E, int64_t n_pairs,
                              const uint8_t *gate_up, const uint8_t *gate_up_atoms,
                              const float *gate_up_s2, const uint8_t *down,
                              const uint8_t *down_atoms, const float *down_s2,
                              unsigned char *scratch) {
    MS_ASSERT(D % NV4_BK == 0 && F % NV4_BK == 0 && ((uintptr_t)scratch & 255) == 0);
    if (n_pairs <= 0) return;
    const nv4_scratch l = nv4_scratch_layout(n_pairs, E, D, F);
    const int n_blk = cuda_nvfp4_blocks_max(n_pairs, E);
    int32_t *blk_e = (int32_t *)(scratch + l.blk_e), *blk_rows = (int32_t *)(scratch + l.blk_rows),
            *pblk = (int32_t *)(scratch + l.pblk), *row_pair = (int32_t *)(scratch + l.row_pair);
    uint8_t *q = scratch + l.q, *atoms = scratch + l.atoms;
    float *sa = (float *)(scratch + l.sa), *g1 = (float *)(scratch + l.g1),
          *g2 = (float *)(scratch + l.g2);
    cuda_nvfp4_blocks(blk_e, blk_rows, pblk, offsets, E, n_blk);
    cuda_nvfp4_quant_pairs(q, atoms, sa, row_pair, x, D, pairs, topk, offsets, pblk, E, n_pairs,
                           n_blk);
    cuda_nvfp4_sm100_gemm(g1, q, atoms, sa, gate_up, gate_up_atoms, gate_up_s2, blk_e, blk_rows,
                          n_blk, 2 * F, D, E);
    cuda_nvfp4_silu_quant(q, atoms, sa, g1, blk_rows, n_blk, F);
    cuda_nvfp4_sm100_gemm(g2, q, atoms, sa, down, down_atoms, down_s2, blk_e, blk_rows, n_blk, D, F,
                          E);
    cuda_nvfp4_scatter(out, g2, row_pair, n_blk, D);
}
