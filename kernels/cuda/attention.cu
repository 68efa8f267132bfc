// Paged causal attention over the KV cache (kernels/ops.h: attention), split over the KV sequence
// in chunks of a fixed size. The CPU reference is kernels/cpu/attention.c.
//
// The arithmetic of one (token, query head), fixed by Dh alone (every path below does it exactly):
// - positions 0..pos[t] are cut into chunks of ATTN_CHUNK (256) positions and each chunk into
//   slices of ATTN_SLICE (32). Score of position p: q . k_p as LK lanes' sequential fma chains
//   over their pieces of four elements, summed by an xor butterfly over the LK lanes, times scale.
// - a slice: m_w = max score, e_p = exp(s_p - m_w), l_w = sum of e_p as a 32-lane xor butterfly
//   (lane = position in the slice), o_w = sum of e_p v_p as RV interleaved sequential chains over
//   the positions (RV = 1 from Dh 128 up) summed by an xor butterfly.
// - a chunk merges its slices in order: m = max m_w, f_w = exp(m_w - m), l = sum_w l_w f_w and
//   o = f_0 o_0 + f_1 o_1 + ... (fma chains); all tokens' chunks are then merged in increasing
//   order: M = max m_c, L = sum_c l_c exp(m_c - M), out = sum_c exp(m_c - M) o_c / L.
// Nothing in it depends on the batch, on which block or kernel computes a piece or on the head
// group a block takes, so a token's output is bit-identical alone or in any batch, and prefill and
// decode of the same position give bit-identical results (the deterministic-mode contract). The
// kernels differ only in how the work is spread, chosen from T and the shapes:
// - attn_cluster_kernel (one token: batch-1 decode; off by default, ATTN_CLUSTER_T, see below; the
//   test forces it and checks it like the others): a thread-block cluster of ATTN_CLUSTER_CS (16)
//   blocks per (token, head group, two chunks), one slice a block, computed as attn_slice_kernel
//   computes it; the slices' o_w, m_w, l_w stay in the blocks' shared memory. After a hardware
//   cluster barrier each of a chunk's 8 blocks merges an eighth of the chunk's outputs, reading the
//   slices from the other blocks' shared memory, in the order above. A token of at most two chunks
//   is then merged the same way behind a second barrier (each block a sixteenth of the outputs),
//   with no global atomic and no round trip through global memory; a longer one writes its chunk
//   results out and the last of its clusters (an atomic counter, left at zero) merges them.
//   The grid has only as many clusters a (token, head group) as fit the device at once (occupancy
//   query); each takes chunk groups z, z + ZC, ... so the clusters past a short context that exit
//   at once stay few. Measured against the slice kernel (same binary, --bench, H200): context 1024
//   11.1 us against 14.4 (11.1 against 11.7 with page tables of 40960 positions, as the server's
//   graphs have), 2048 12.9 against 15.9 (13.0 against 15.2); but 8192 46.0 against 34.6, where
//   the clusters loop over chunk groups and fewer slices run at once. At 2 to 4 tokens it lost
//   everywhere (B=4 context 1024: 24.8 against 15.9), as did 2 slices a block (10.5 us at 1024
//   but 18.3 at 2048) and clusters of 8 (12.5, 14.3), so those take the slice kernel. Off by
//   default: the host cannot pick it by context (positions live on the device and the page
//   table's bound is the server's whole context length), and a loss of 11 us at 8192 outweighs
//   the 0.6 to 2.2 us it gains at 1024 to 2048 with the server's page tables. It becomes the
//   default when it wins at every context (several slices a cluster at once, or the slice
//   kernel's way taken inside it for long contexts).
// - attn_slice_kernel (batches of 2 to ATTN_SMALL_T tokens, and one token where no cluster fits):
//   one block per (token, head group, slice), so a batch-1 decode at context 1024 has 128 blocks.
//   The slice's K and V rows are requested at once into shared memory (cp.async), so each block
//   waits for the cache about once. The combine is in the same launch: the last block of a chunk to
//   finish (an atomic counter) merges the chunk's slices, and the last chunk of a token merges the
//   chunks; which block does it varies, the order of the arithmetic does not. Each merging block
//   requests the slices' (then the chunks') outputs before it reads their maxima and sums, so the
//   two sets of reads overlap (batch-1 decode at context 1024: 13.3 us against 14.3 when they
//   followed one another). A token of one chunk (256 positions or fewer) has its chunk's merge
//   write the output itself, and a token of one slice (32 or fewer) its one block, with none of
//   the rounds through global memory: the merges left out take weights exp(0) = 1, so the bits
//   are the same (batch-1 decode, H200: context 32 5.0 us against 8.8, 256 7.3 against 9.0; the
//   division after the chunk's adds, not inside them, kept the kernel at 95 registers). The
//   counters return to zero, so the launch can be replayed from a CUDA graph. Launched with
//   programmatic dependent launch, so its blocks are resident while the previous kernel finishes
//   (the cluster kernel too).
// - attn_chunk_kernel (larger batches): one block per (token, head group, chunk), a warp per slice;
//   each warp goes through its 32 positions on its own (scores, softmax, weighted V, rows requested
//   in batches into registers), the block merges its warps in warp order. Three blocks a
//   multiprocessor (80 registers) beat two; requesting the next batch of rows before computing on
//   the current one (two register buffers, two blocks) was slower, and the softmax over the whole
//   chunk behind block barriers was about 9% slower at large batch. attn_combine_kernel then merges
//   the chunks.
// - attn_tile_kernel (larger batches, prefill): a group of consecutive tokens of the batch that
//   belong to one sequence (a tile of ATTN_TILE_ROWS query rows = tokens x heads of the group) and
//   one chunk: each K row is read once for the whole tile, each V row once from L2 for it (from L1
//   after); the chunk kernel leaves those tokens alone. So a prefill chunk no longer reads the
//   whole KV once per token. The slices' o_w are folded into the chunk sum as they are done, which
//   is the chunk merge above because every f_w is known (the scores come first).
// - The cache holds float or BF16 (kv.bf16): each path reads it in pieces of four elements and
//   widens them exactly (kv_types.cuh), so the arithmetic above is the same on both. The chunk
//   kernel keeps 128 bytes a lane in flight either way (16 BF16 pieces, widened as used), and
//   cp.async copies 16 bytes (two BF16 pieces) at a time.
// - GQA: a block serves G query heads that share one kv head (G = H / Hkv, or a divisor of it when
//   G * Dh would not fit the registers), so each K/V row is read once per group.
// - Positions live on the device and are not read back: grids are sized from the upper bound
//   max_pages * S positions a token; blocks past a token's length exit at once, and so do the
//   blocks of a tile that is not one sequence. The partial results go to a workspace that grows on
//   demand (stream-ordered; cuda_workspace_changed); a batch whose workspace would pass
//   ATTN_WORKSPACE_CAP is processed in slices of tokens, which changes no token's result.
// - Speed (H200, Qwen3-30B-A3B's H 32, Hkv 4, Dh 128, fp32 KV unless named; the --bench of
//   tests/test_cuda_attention.c): batch-1 decode 11.1 us at context 1024 and 12.9 us at 2048 (the
//   slice kernel: 13.3, 14.9; two kernels before that: 25.7, 26.1), still far from the 1-2 us of KV
//   reads: the chain of dependent requests (position, page table, rows, the merges) is most of it.
//   From batch 64 the chunk kernel reads an fp32 cache at 62-79% of the copy rate (256 sequences at
//   context 1024: 352 us; a BF16 cache, half the bytes: 325 us, so the BF16 path is bound by the
//   blocks' chains of requests and their arithmetic, not by the bytes). Prefill of 2048-token
//   prompts (one sequence or eight): 16.3 TFLOP/s of fp32 arithmetic, 1.2x one chunk block per
//   token. The tile kernel's scores were bound by reads of q from shared memory (four positions a
//   read instead of two: 2282 -> 2107 us for one prompt); its weighted V reads a V piece from
//   shared memory for four rows' products (2 blocks a multiprocessor, 128 registers).
// - One engine thread per process calls the ops, so the workspaces need no lock.
#include <cstdint>
#include <cstdio>

#include <cooperative_groups.h>

#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/kv_types.cuh"

namespace cg = cooperative_groups;

enum {
    ATTN_CHUNK = 256,              // KV positions per chunk: fixed, never chosen by T
    ATTN_SLICE = 32,               // positions per slice (one warp's share of a chunk)
    ATTN_SLICES = ATTN_CHUNK / ATTN_SLICE,
    ATTN_WARPS = ATTN_SLICES,      // warps per chunk block: one per slice
    ATTN_THREADS = ATTN_WARPS * 32,
    ATTN_WARP_POS = ATTN_SLICE,
    ATTN_COMBINE_THREADS = 256,
    ATTN_SMALL_T = 4,              // batches up to this many tokens take the slice kernel (at batch 8
                                   // the chunk kernel is as fast at context 2048, faster at 8192)
    ATTN_TILE_ROWS = 32,           // query rows (tokens x heads) of a prefill tile
    ATTN_TILE_WARPS = 8,
    ATTN_TILE_THREADS = ATTN_TILE_WARPS * 32,
    ATTN_TILE_ZC = 4,              // chunk columns of the tile grid (a block takes every 4th chunk)
};
// The cluster kernel's shape: slices a block (fewer where Dh * SPB > 512) and blocks a cluster
// (16 needs cudaFuncAttributeNonPortableClusterSizeAllowed).
#ifndef ATTN_CLUSTER_SPB
#define ATTN_CLUSTER_SPB 1
#endif
#ifndef ATTN_CLUSTER_CS
#define ATTN_CLUSTER_CS 16
#endif
// Clusters a (token, head group) at most: so many that WAVES waves of clusters fill the device.
#ifndef ATTN_CLUSTER_WAVES
#define ATTN_CLUSTER_WAVES 1
#endif
// Batches up to this many tokens take the cluster kernel (0: none, the default, see the header),
// up to ATTN_SMALL_T the slice kernel.
#ifndef ATTN_CLUSTER_T
#define ATTN_CLUSTER_T 0
#endif
static const size_t ATTN_WORKSPACE_CAP = (size_t)256 << 20; // bytes of partial results per slice

// The lane layout of the slices for head dim DH; a warp requests 128 bytes a lane at once (K rows
// in the scores, V rows in the weighted sum): DEPTH pieces of the cache's element type KV, 8 of
// fp32 or 16 of BF16, held as loaded and widened where they are used (256 bytes, two blocks a
// multiprocessor, was slower on H200: a BF16 cache took 374 against 325 us for 256 sequences at
// context 1024, docs/benchmarks.md). LK, FK (and so PK) and LV, FV, RV are part of the
// arithmetic; the batch depths UK, UV are not, so both types sum alike.
template <int DH, class KV = float> struct attn_layout {
    static constexpr int DEPTH = 128 / (int)sizeof(typename kv_elem<KV>::piece);
    static constexpr int PREG = (int)sizeof(typename kv_elem<KV>::piece) / 4; // registers a piece
    // scores: LK lanes per position, each with DH / LK elements in FK 16-byte pieces
    static constexpr int LK = DH >= 32 ? 8 : DH / 4;
    static constexpr int FK = DH / LK / 4;
    static constexpr int PK = 32 / LK; // positions per warp step
    static constexpr int UK0 = DEPTH / FK > 0 ? DEPTH / FK : 1;
    static constexpr int UK = UK0 * PK <= ATTN_WARP_POS ? UK0 : ATTN_WARP_POS / PK; // steps at once
    // weighted V: LV lanes per row, each with FV 16-byte pieces
    static constexpr int LV = DH / 4 < 32 ? DH / 4 : 32;
    static constexpr int FV = DH / (4 * LV);
    static constexpr int RV = 32 / LV; // rows per warp step
    static constexpr int UV0 = DEPTH / FV > 0 ? DEPTH / FV : 1;
    static constexpr int UV = UV0 * RV <= ATTN_WARP_POS ? UV0 : ATTN_WARP_POS / RV; // steps at once
};

// Blocks per multiprocessor to ask the compiler for: what the live registers allow (V sums and
// V rows in flight, or K rows in flight and the scores). The scores of a batch and its widened
// pieces are not counted: with them a BF16 cache's batch of 16 pieces a lane gets 2 blocks of 128
// registers, where 3 of 80 (spilling 48 bytes) ran 12% faster (H200, 256 sequences at context
// 1024: 325 against 369 us).
template <int DH, int G, class KV> constexpr int attn_min_blocks() {
    using L = attn_layout<DH, KV>;
    constexpr int rv = 4 * L::FV * G + L::PREG * L::FV * L::UV;
    constexpr int rk = L::PREG * L::FK * L::UK + G;
    constexpr int regs = rv > rk ? rv : rk;
    return regs <= 64 ? 3 : regs <= 96 ? 2 : 1;
}

static __device__ __forceinline__ void fma4(float &acc, float4 a, float4 b) {
    acc = fmaf(a.x, b.x, acc);
    acc = fmaf(a.y, b.y, acc);
    acc = fmaf(a.z, b.z, acc);
    acc = fmaf(a.w, b.w, acc);
}

static __device__ __forceinline__ float4 fma4v(float e, float4 v, float4 acc) {
    return make_float4(fmaf(e, v.x, acc.x), fmaf(e, v.y, acc.y), fmaf(e, v.z, acc.z),
                       fmaf(e, v.w, acc.w));
}

static __device__ __forceinline__ float4 mul4v(float f, float4 a) {
    return make_float4(__fmul_rn(f, a.x), __fmul_rn(f, a.y), __fmul_rn(f, a.z), __fmul_rn(f, a.w));
}

// a / l, each component correctly rounded (the one division of every path's output)
static __device__ __forceinline__ float4 div4(float4 a, float l) {
    return make_float4(a.x / l, a.y / l, a.z / l, a.w / l);
}

static __device__ __forceinline__ void shfl_add4(float4 &a, int off) {
    a.x += __shfl_xor_sync(0xffffffffu, a.x, off);
    a.y += __shfl_xor_sync(0xffffffffu, a.y, off);
    a.z += __shfl_xor_sync(0xffffffffu, a.z, off);
    a.w += __shfl_xor_sync(0xffffffffu, a.w, off);
}

// 16 bytes global -> shared without registers (cp.async), in commit groups.
static __device__ __forceinline__ void cp_async16(void *smem, const void *gmem) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}
// The first nv rows of a slice (cache rows rw[i], D4 pieces each from src + rw[i] * rs4) into
// dst [nv][D4], the work spread over NT threads from tid, in 16-byte copies: an fp32 piece, or
// two BF16 pieces (D4 is even, so BF16 rows start on 16 bytes too).
template <int D4, class P>
static __device__ __forceinline__ void cp_async_rows(P *dst, const P *src, const int *rw,
                                                     int64_t rs4, int nv, int tid, int NT) {
    constexpr int PC = 16 / (int)sizeof(P), DC = D4 / PC; // pieces a copy, copies a row
    static_assert(D4 % PC == 0, "rows of whole 16-byte copies");
    for (int e = tid; e < nv * DC; e += NT)
        cp_async16(dst + PC * e, src + rw[e / DC] * rs4 + PC * (e % DC));
}
static __device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N> static __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Whether token tl of the slice [t0, t0 + Ts) belongs to a tile of attn_tile_kernel: its group of
// qt tokens (tl / qt) is whole and all of one sequence.
static __device__ __forceinline__ bool in_tile_group(const int32_t *__restrict__ seq, int t0, int Ts,
                                                     int tl, int qt) {
    const int g0 = tl / qt * qt;
    if (g0 + qt > Ts) return false;
    const int s0 = seq[t0 + g0];
    for (int k = 1; k < qt; k++)
        if (seq[t0 + g0 + k] != s0) return false;
    return true;
}

// One (token t0 + blockIdx.x, head group blockIdx.y, chunk blockIdx.z); tokens of tile groups
// (tile_qt > 0) are attn_tile_kernel's.
//   part_o  [Ts, H / G, NC, G, DH]  unnormalized weighted V of each chunk
//   part_ml [Ts, H / G, NC, 2, G]   chunk max score m, then sum of exp l
//   q [T, H, DH], kc / vc [P, S, Hkv, DH] of KV (float or BF16), pos / seq [T],
//   page_table [n_seq, max_pages]
template <int DH, int G, int MINB, class KV>
__global__ void __launch_bounds__(ATTN_THREADS, MINB)
    attn_chunk_kernel(float *__restrict__ part_o, float *__restrict__ part_ml,
                      const float *__restrict__ q, const KV *__restrict__ kc,
                      const KV *__restrict__ vc, const int32_t *__restrict__ pos,
                      const int32_t *__restrict__ seq, const int32_t *__restrict__ page_table,
                      int t0, int Ts, int tile_qt, int H, int Hkv, int max_pages, int S, int NC,
                      float scale) {
    using L = attn_layout<DH, KV>;
    typedef kv_elem<KV> E;
    typedef typename E::piece P;
    constexpr int LK = L::LK, FK = L::FK, PK = L::PK, UK = L::UK;
    constexpr int LV = L::LV, FV = L::FV, RV = L::RV, UV = L::UV;
    constexpr int KSTEP = PK * UK, VSTEP = RV * UV; // positions a batch of rows covers
    static_assert(DH % 16 == 0 && DH <= 256, "head dim");
    static_assert(ATTN_WARP_POS % KSTEP == 0 && ATTN_WARP_POS % VSTEP == 0, "steps");
    static_assert(G * DH <= 2048, "accumulators per lane");

    const int tl = blockIdx.x, hg = blockIdx.y, c = blockIdx.z;
    const int t = t0 + tl;
    const int n = pos[t] + 1; // positions 0..pos[t]
    const int p0 = c * ATTN_CHUNK;
    if (p0 >= n) return; // first: most blocks of a short context leave here, after one load
    if (tile_qt > 0 && in_tile_group(seq, t0, Ts, tl, tile_qt)) return; // attn_tile_kernel's
    const int nv = min(ATTN_CHUNK, n - p0); // valid positions of this chunk
    const int g = hg * G / (H / Hkv);       // kv head

    __shared__ int rows[ATTN_CHUNK];                  // cache row (page * S + slot)
    __shared__ __align__(16) float s[ATTN_CHUNK * G]; // scores, then exp weights [p][h]
    __shared__ __align__(16) float buf[G * DH];       // q [G][DH], then the V sum
    __shared__ float sm[G], sl[G];                    // the chunk's m and l
    __shared__ float wm[ATTN_WARPS * G], wl[ATTN_WARPS * G], wf[ATTN_WARPS * G]; // per warp

    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    const int32_t *pt = page_table + (int64_t)seq[t] * max_pages;
    for (int i = tid; i < nv; i += ATTN_THREADS) {
        const int p = p0 + i;
        rows[i] = pt[p / S] * S + p % S;
    }
    const float4 *qt = reinterpret_cast<const float4 *>(q + ((int64_t)t * H + hg * G) * DH);
    for (int i = tid; i < G * DH / 4; i += ATTN_THREADS)
        reinterpret_cast<float4 *>(buf)[i] = qt[i];
    __syncthreads();

    // A warp takes positions [wbeg, wend) of the chunk, in batches of rows.
    const int64_t rs = (int64_t)Hkv * DH; // elements per cache row
    const KV *kg = kc + (int64_t)g * DH;
    const KV *vg = vc + (int64_t)g * DH;
    const int wbeg = w * ATTN_WARP_POS, wend = min(wbeg + ATTN_WARP_POS, nv);
    const int nkb = wbeg < wend ? (wend - wbeg + KSTEP - 1) / KSTEP : 0; // K batches
    const int nvb = wbeg < wend ? (wend - wbeg + VSTEP - 1) / VSTEP : 0; // V batches

    // scores: LK lanes share a position, lane `sub` takes pieces sub, sub + LK, ...
    const int sub = lane % LK, pp = lane / LK;
    const float4 *q4 = reinterpret_cast<const float4 *>(buf);
    auto load_k = [&](P(&kr)[UK][FK], int i0) {
#pragma unroll
        for (int u = 0; u < UK; u++) {
            const int i = i0 + u * PK + pp;
            const P *kp = reinterpret_cast<const P *>(kg + (int64_t)rows[i < wend ? i : wbeg] * rs);
#pragma unroll
            for (int f = 0; f < FK; f++)
                kr[u][f] = i < wend ? __ldg(kp + f * LK + sub) : P{};
        }
    };
    // s[p][h] = (q_h . k_p) * scale: a sequential fma chain over the lane's pieces, then an xor
    // butterfly over the LK lanes (the same sum in each)
    // (all UK positions of a batch at once, so a lane reads each of its G * FK pieces of q from
    // shared memory once a batch: read once a position step, those reads took more time than the
    // rows' own; a chain's order over f is the same)
    auto score = [&](const P(&kr)[UK][FK], int i0) {
        float acc[UK][G];
#pragma unroll
        for (int u = 0; u < UK; u++)
#pragma unroll
            for (int h = 0; h < G; h++)
                acc[u][h] = 0.0f;
#pragma unroll
        for (int f = 0; f < FK; f++) {
            float4 kw[UK];
#pragma unroll
            for (int u = 0; u < UK; u++)
                kw[u] = E::widen(kr[u][f]);
#pragma unroll
            for (int h = 0; h < G; h++) {
                const float4 qv = q4[h * (DH / 4) + f * LK + sub];
#pragma unroll
                for (int u = 0; u < UK; u++)
                    fma4(acc[u][h], qv, kw[u]);
            }
        }
#pragma unroll
        for (int off = LK / 2; off > 0; off /= 2)
#pragma unroll
            for (int u = 0; u < UK; u++)
#pragma unroll
                for (int h = 0; h < G; h++)
                    acc[u][h] += __shfl_xor_sync(0xffffffffu, acc[u][h], off);
#pragma unroll
        for (int u = 0; u < UK; u++) {
            const int i = i0 + u * PK + pp;
            if (i < wend) {
#pragma unroll
                for (int h = 0; h < G; h++)
                    if (h % LK == sub) s[i * G + h] = __fmul_rn(acc[u][h], scale);
            }
        }
    };
    // weighted V: LV lanes share a row, lane group rv takes rows wbeg + rv, + RV, ...
    const int subv = lane % LV, rv = lane / LV;
    auto load_v = [&](P(&vr)[UV][FV], int i0) {
#pragma unroll
        for (int u = 0; u < UV; u++) {
            const int i = i0 + u * RV + rv;
            const P *vp = reinterpret_cast<const P *>(vg + (int64_t)rows[i < wend ? i : wbeg] * rs);
#pragma unroll
            for (int f = 0; f < FV; f++)
                vr[u][f] = i < wend ? __ldg(vp + f * LV + subv) : P{};
        }
    };
    float4 acc[G][FV];
#pragma unroll
    for (int h = 0; h < G; h++)
#pragma unroll
        for (int f = 0; f < FV; f++)
            acc[h][f] = make_float4(0.f, 0.f, 0.f, 0.f);
    auto accumulate = [&](const P(&vr)[UV][FV], int i0) {
#pragma unroll
        for (int u = 0; u < UV; u++) {
            const int i = i0 + u * RV + rv;
            if (i < wend) {
                float e[G];
                if constexpr (G % 4 == 0) {
#pragma unroll
                    for (int h = 0; h < G; h += 4) {
                        const float4 e4 = *reinterpret_cast<const float4 *>(&s[i * G + h]);
                        e[h] = e4.x, e[h + 1] = e4.y, e[h + 2] = e4.z, e[h + 3] = e4.w;
                    }
                } else {
#pragma unroll
                    for (int h = 0; h < G; h++)
                        e[h] = s[i * G + h];
                }
#pragma unroll
                for (int f = 0; f < FV; f++) {
                    const float4 v = E::widen(vr[u][f]);
#pragma unroll
                    for (int h = 0; h < G; h++) {
                        acc[h][f].x = fmaf(e[h], v.x, acc[h][f].x);
                        acc[h][f].y = fmaf(e[h], v.y, acc[h][f].y);
                        acc[h][f].z = fmaf(e[h], v.z, acc[h][f].z);
                        acc[h][f].w = fmaf(e[h], v.w, acc[h][f].w);
                    }
                }
            }
        }
    };

    // ---- scores of the warp's positions; then its first V rows are requested, to arrive during
    // the softmax ----
    for (int j = 0; j < nkb; j++) {
        P kr[UK][FK];
        load_k(kr, wbeg + j * KSTEP);
        score(kr, wbeg + j * KSTEP);
    }
    P vr[UV][FV];
    if (nvb > 0) load_v(vr, wbeg);
    __syncwarp();

    // ---- per head, over the warp's positions: m_w = max s, weights exp(s - m_w) in place,
    // l_w = their sum (no block barrier: each warp goes on at its own pace) ----
    if (wbeg < wend) {
        for (int h = 0; h < G; h++) {
            float m = -INFINITY;
            for (int i = wbeg + lane; i < wend; i += 32)
                m = fmaxf(m, s[i * G + h]);
#pragma unroll
            for (int off = 16; off > 0; off /= 2)
                m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
            float l = 0.0f;
            for (int i = wbeg + lane; i < wend; i += 32) {
                const float e = expf(s[i * G + h] - m);
                s[i * G + h] = e;
                l += e;
            }
#pragma unroll
            for (int off = 16; off > 0; off /= 2)
                l += __shfl_xor_sync(0xffffffffu, l, off);
            if (lane == 0) {
                wm[w * G + h] = m;
                wl[w * G + h] = l;
            }
        }
    }
    __syncwarp();

    // ---- o_w[h] = sum over the warp's positions of e[p][h] v_p, in increasing p ----
    for (int j = 0; j < nvb; j++) {
        if (j > 0) load_v(vr, wbeg + j * VSTEP);
        accumulate(vr, wbeg + j * VSTEP);
    }
    // rows taken by the RV lane groups of the warp: xor butterfly (the same sum in every lane)
#pragma unroll
    for (int off = 16; off >= LV; off /= 2)
#pragma unroll
        for (int h = 0; h < G; h++)
#pragma unroll
            for (int f = 0; f < FV; f++) {
                acc[h][f].x += __shfl_xor_sync(0xffffffffu, acc[h][f].x, off);
                acc[h][f].y += __shfl_xor_sync(0xffffffffu, acc[h][f].y, off);
                acc[h][f].z += __shfl_xor_sync(0xffffffffu, acc[h][f].z, off);
                acc[h][f].w += __shfl_xor_sync(0xffffffffu, acc[h][f].w, off);
            }

    // ---- the chunk: m = max_w m_w, l = sum_w l_w exp(m_w - m), o = sum_w exp(m_w - m) o_w,
    // warps in order; only the nw warps that had positions take part ----
    const int nw = (nv + ATTN_WARP_POS - 1) / ATTN_WARP_POS;
    __syncthreads(); // every warp's m_w, l_w; every warp is past its scores, so buf (q) is free
    if (tid < G) {
        float m = -INFINITY;
        for (int ww = 0; ww < nw; ww++)
            m = fmaxf(m, wm[ww * G + tid]);
        float l = 0.0f;
        for (int ww = 0; ww < nw; ww++) {
            const float fw = expf(wm[ww * G + tid] - m);
            wf[ww * G + tid] = fw;
            l = fmaf(wl[ww * G + tid], fw, l);
        }
        sm[tid] = m;
        sl[tid] = l;
    }
    __syncthreads();
    for (int ww = 0; ww < nw; ww++) {
        if (w == ww && rv == 0) {
#pragma unroll
            for (int h = 0; h < G; h++) {
                const float fw = wf[ww * G + h];
#pragma unroll
                for (int f = 0; f < FV; f++) {
                    float4 *b = reinterpret_cast<float4 *>(buf) + h * (DH / 4) + f * LV + subv;
                    const float4 a = acc[h][f];
                    float4 x;
                    if (ww == 0) {
                        x = make_float4(__fmul_rn(fw, a.x), __fmul_rn(fw, a.y), __fmul_rn(fw, a.z),
                                        __fmul_rn(fw, a.w));
                    } else {
                        x = *b;
                        x = make_float4(fmaf(fw, a.x, x.x), fmaf(fw, a.y, x.y), fmaf(fw, a.z, x.z),
                                        fmaf(fw, a.w, x.w));
                    }
                    *b = x;
                }
            }
        }
        __syncthreads();
    }

    const int64_t blk = ((int64_t)tl * (H / G) + hg) * NC + c;
    float4 *po = reinterpret_cast<float4 *>(part_o + blk * (G * DH));
    for (int i = tid; i < G * DH / 4; i += ATTN_THREADS)
        po[i] = reinterpret_cast<const float4 *>(buf)[i];
    if (tid < G) {
        part_ml[blk * 2 * G + tid] = sm[tid];
        part_ml[blk * 2 * G + G + tid] = sl[tid];
    }
}

// A merge's reads requested ahead: pre[i][k] = part k's element tid + i NT (parts of E float4
// each, from base; k < n, elements < E), for the first PF elements of the thread.
template <int NT, int E, int PF, int N>
__device__ __forceinline__ void merge_request(float4 (&pre)[PF][N], const float4 *base, int n,
                                              int tid) {
#pragma unroll
    for (int i = 0; i < PF; i++)
        if (tid + i * NT < E)
#pragma unroll
            for (int k = 0; k < N; k++)
                if (k < n) pre[i][k] = __ldcg(base + k * E + tid + i * NT);
}

// A slice's arithmetic (the header's), for the GW heads h0.. of one warp: the scores of its nv
// positions (K rows ks [nv][DH / 4] pieces, q of the block's G heads qs) into s [p][h], then the
// softmax over the slice: s becomes the exp weights e_p, wm and wl the slice's m_w and l_w per
// head (-inf and 0 where nv is 0). Lane layout as in attn_chunk_kernel.
template <int DH, int G, int GW, class E>
__device__ __forceinline__ void attn_slice_softmax(float (&wm)[GW], float (&wl)[GW], float *s,
                                                   const float4 *qs, const typename E::piece *ks,
                                                   int h0, int nv, int lane, float scale) {
    using L = attn_layout<DH>;
    constexpr int D4 = DH / 4, LK = L::LK, FK = L::FK, PK = L::PK;
    const int sub = lane % LK, pp = lane / LK;
#pragma unroll
    for (int i0 = 0; i0 < ATTN_SLICE; i0 += PK) {
        if (i0 >= nv) break; // the same for the whole warp
        const int i = i0 + pp, ic = i < nv ? i : 0;
        float4 kr[FK];
#pragma unroll
        for (int f = 0; f < FK; f++)
            kr[f] = E::widen(ks[ic * D4 + f * LK + sub]);
        float acc[GW];
#pragma unroll
        for (int h = 0; h < GW; h++) {
            acc[h] = 0.0f;
#pragma unroll
            for (int f = 0; f < FK; f++)
                fma4(acc[h], qs[(h0 + h) * D4 + f * LK + sub], kr[f]);
        }
#pragma unroll
        for (int off = LK / 2; off > 0; off /= 2)
#pragma unroll
            for (int h = 0; h < GW; h++)
                acc[h] += __shfl_xor_sync(0xffffffffu, acc[h], off);
        if (i < nv) {
#pragma unroll
            for (int h = 0; h < GW; h++)
                if (h % LK == sub) s[i * G + h0 + h] = __fmul_rn(acc[h], scale);
        }
    }
    __syncwarp();
    // per head: lane = position
#pragma unroll
    for (int hh = 0; hh < GW; hh++) {
        const int h = h0 + hh;
        float m = -INFINITY;
        if (lane < nv) m = s[lane * G + h];
#pragma unroll
        for (int off = 16; off > 0; off /= 2)
            m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
        float l = 0.0f;
        if (lane < nv) {
            const float e = expf(s[lane * G + h] - m);
            s[lane * G + h] = e;
            l += e;
        }
#pragma unroll
        for (int off = 16; off > 0; off /= 2)
            l += __shfl_xor_sync(0xffffffffu, l, off);
        wm[hh] = m;
        wl[hh] = l;
    }
}

// The slice's o_w for the same heads: RV interleaved chains over the positions (V rows vs, in
// shared memory and complete), then an xor butterfly; lanes with lane / LV == 0 hold the sums.
template <int DH, int G, int GW, class E>
__device__ __forceinline__ void attn_slice_weighted_v(float4 (&acc)[GW][attn_layout<DH>::FV],
                                                      const float *s, const typename E::piece *vs,
                                                      int h0, int nv, int lane) {
    using L = attn_layout<DH>;
    constexpr int D4 = DH / 4, LV = L::LV, FV = L::FV, RV = L::RV;
    const int subv = lane % LV, rv = lane / LV;
#pragma unroll
    for (int h = 0; h < GW; h++)
#pragma unroll
        for (int f = 0; f < FV; f++)
            acc[h][f] = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int k = 0; k < ATTN_SLICE / RV; k++) {
        const int i = k * RV + rv; // increasing for each lane group
        if (i < nv) {
            float e[GW];
#pragma unroll
            for (int h = 0; h < GW; h++)
                e[h] = s[i * G + h0 + h];
#pragma unroll
            for (int f = 0; f < FV; f++) {
                const float4 v = E::widen(vs[i * D4 + f * LV + subv]);
#pragma unroll
                for (int h = 0; h < GW; h++)
                    acc[h][f] = fma4v(e[h], v, acc[h][f]);
            }
        }
    }
#pragma unroll
    for (int off = 16; off >= LV; off /= 2)
#pragma unroll
        for (int h = 0; h < GW; h++)
#pragma unroll
            for (int f = 0; f < FV; f++)
                shfl_add4(acc[h][f], off);
}

// One (token t0 + blockIdx.x, head group blockIdx.y, slice blockIdx.z) of a small batch: G / GW
// warps, each with GW heads of the group, over the slice's 32 positions; then the in-launch
// combine.
//   slice_o [Ts, H / G, NS, G, DH], slice_ml [Ts, H / G, NS, 2, G]  each slice's o_w, then m_w, l_w
//   part_o, part_ml as for attn_chunk_kernel; out [T, H, DH]
//   cnt [Ts, H / G, NC + 1] finished slices of each chunk, then finished chunks (left at zero)
// Dynamic shared memory: max(2 * ATTN_SLICE * DH, 2 * NC * G) floats.
// The body is block (tl, hg, j)'s work; dep.start() at the start, dep.wait() before the first read
// of what the kernel before writes (cuda_ops.h's pdl_dep; attn_slice_kernel below).
template <int DH, int G, int GW, class KV, class DEP>
__device__ __forceinline__ void
attn_slice_block(int tl, int hg, int j, DEP dep, float *__restrict__ out,
                 float *__restrict__ slice_o, float *__restrict__ slice_ml,
                 float *__restrict__ part_o, float *__restrict__ part_ml, int *__restrict__ cnt,
                 const float *__restrict__ q, const KV *__restrict__ kc, const KV *__restrict__ vc,
                 const int32_t *__restrict__ pos, const int32_t *__restrict__ seq,
                 const int32_t *__restrict__ page_table, int t0, int T, int H, int Hkv,
                 int max_pages, int S, int NC, float scale) {
    using L = attn_layout<DH>;
    constexpr int NT = G / GW * 32, D4 = DH / 4;
    constexpr int LV = L::LV, FV = L::FV;
    static_assert(G % GW == 0 && G / GW <= 32, "warps");

    typedef kv_elem<KV> E;
    typedef typename E::piece P;
    extern __shared__ __align__(16) float4 attn_dyn[];
    P *ks = reinterpret_cast<P *>(attn_dyn); // [ATTN_SLICE][D4] K rows of the slice
    P *vs = ks + ATTN_SLICE * D4;            // [ATTN_SLICE][D4] V rows
    __shared__ __align__(16) float4 qs[G * D4];
    __shared__ float s[ATTN_SLICE * G];   // scores, then exp weights [p][h]
    __shared__ int rows[ATTN_SLICE];
    __shared__ float fw[ATTN_SLICES * G], sm[G], sl[G];
    __shared__ int last;

    // Before the wait for the kernel before (programmatic dependent launch) only what that kernel
    // cannot be writing is read: the batch's positions, sequences and page table (staged before
    // the step), and the cache rows of positions no token of this batch stores. A decode step's
    // past context is then on its way while the q/k/v projection still runs; q and this step's
    // own rows are read after the wait.
    dep.start();
    const int t = t0 + tl, tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    const int n = pos[t] + 1; // positions 0..pos[t]
    const int sq = seq[t];
    const int p0 = j * ATTN_SLICE;
    if (p0 >= n) return;
    int first_new = n - 1; // the lowest position a token of this batch stores for sequence sq
    for (int u = 0; u < T; u++)
        if (seq[u] == sq && pos[u] < first_new) first_new = pos[u];
    const int nv = min(ATTN_SLICE, n - p0); // valid positions of this slice
    const bool early = p0 + nv <= first_new; // every row of the slice was stored by an earlier step
    const int c = j / ATTN_SLICES;
    const int g = hg * G / (H / Hkv); // kv head
    if (tid < nv) {
        const int p = p0 + tid;
        rows[tid] = page_table[(int64_t)sq * max_pages + p / S] * S + p % S;
    }
    __syncthreads();
    const int64_t rs4 = (int64_t)Hkv * D4; // pieces per cache row
    const P *kg = reinterpret_cast<const P *>(kc) + (int64_t)g * D4;
    const P *vg = reinterpret_cast<const P *>(vc) + (int64_t)g * D4;
    if (early) {
        cp_async_rows<D4>(ks, kg, rows, rs4, nv, tid, NT);
        cp_async_commit(); // group: K
        cp_async_rows<D4>(vs, vg, rows, rs4, nv, tid, NT);
        cp_async_commit(); // group: V
    }
    dep.wait();
    const float4 *qt = reinterpret_cast<const float4 *>(q + ((int64_t)t * H + hg * G) * DH);
    for (int i = tid; i < G * D4; i += NT)
        cp_async16(&qs[i], qt + i);
    if (!early) cp_async_rows<D4>(ks, kg, rows, rs4, nv, tid, NT);
    cp_async_commit(); // group: q (and K)
    if (!early) {
        cp_async_rows<D4>(vs, vg, rows, rs4, nv, tid, NT);
        cp_async_commit(); // group: V
        cp_async_wait<1>(); // q and K
    } else {
        cp_async_wait<0>(); // K and V long since, q now
    }
    __syncthreads();

    const int h0 = w * GW, subv = lane % LV, rv = lane / LV;
    float wm_[GW], wl_[GW];
    attn_slice_softmax<DH, G, GW, E>(wm_, wl_, s, qs, ks, h0, nv, lane, scale);
    cp_async_wait<0>();
    __syncthreads(); // V rows of every thread's copies
    float4 acc[GW][FV];
    attn_slice_weighted_v<DH, G, GW, E>(acc, s, vs, h0, nv, lane);

    // The token's outputs, for the shortcuts below: with a single slice (n <= ATTN_SLICE) the
    // chunk's merge takes f_0 = exp(0) = 1 and l = l_0, and with a single chunk the token's merge
    // takes exp(0) = 1 and L = l, so out = o / l exactly, in the same bits (no sum is ever -0: the
    // chains start from +0); those tokens skip the round trips through global memory.
    float4 *const fin = reinterpret_cast<float4 *>(out + ((int64_t)t * H + hg * G) * DH);
    if (n <= ATTN_SLICE) {
        if (rv == 0) {
#pragma unroll
            for (int h = 0; h < GW; h++)
#pragma unroll
                for (int f = 0; f < FV; f++)
                    fin[(h0 + h) * D4 + f * LV + subv] = div4(acc[h][f], wl_[h]);
        }
        return;
    }
    const int NS = NC * ATTN_SLICES;
    const int64_t tg = (int64_t)tl * (H / G) + hg; // (token, head group)
    const int64_t sblk = tg * NS + j;
    if (rv == 0) {
#pragma unroll
        for (int h = 0; h < GW; h++)
#pragma unroll
            for (int f = 0; f < FV; f++)
                reinterpret_cast<float4 *>(slice_o + (sblk * G + h0 + h) * DH)[f * LV + subv] =
                    acc[h][f];
    }
    if (lane == 0) {
#pragma unroll
        for (int h = 0; h < GW; h++) {
            slice_ml[sblk * 2 * G + h0 + h] = wm_[h];
            slice_ml[sblk * 2 * G + G + h0 + h] = wl_[h];
        }
    }

    // ---- the last slice of the chunk to finish merges the chunk's slices in order ----
    __threadfence();
    __syncthreads();
    int *cnt_c = cnt + tg * (NC + 1) + c, *cnt_t = cnt + tg * (NC + 1) + NC;
    const int nsl = min(ATTN_SLICES, (n - c * ATTN_CHUNK + ATTN_SLICE - 1) / ATTN_SLICE);
    if (tid == 0) {
        const int done = atomicAdd(cnt_c, 1) + 1;
        last = done == nsl;
        if (done == nsl) *cnt_c = 0; // every slice has counted: ready for the next launch
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    // The merges below read what other blocks wrote: each thread requests its first PF elements'
    // rows before the maxima and weights are worked out, so those reads overlap instead of
    // following one another (the arithmetic and its order are unchanged).
    constexpr int EPT = (G * D4 + NT - 1) / NT, PF = EPT < 2 ? EPT : 2;
    {
        const float *so = slice_o + (tg * NS + c * ATTN_SLICES) * G * DH;
        const float *sml = slice_ml + (tg * NS + c * ATTN_SLICES) * 2 * G;
        float4 pre[PF][ATTN_SLICES];
        merge_request<NT, G * D4>(pre, reinterpret_cast<const float4 *>(so), nsl, tid);
        if (tid < G) {
            float mw[ATTN_SLICES], lw[ATTN_SLICES];
#pragma unroll
            for (int ww = 0; ww < ATTN_SLICES; ww++)
                if (ww < nsl) {
                    mw[ww] = __ldcg(sml + ww * 2 * G + tid);
                    lw[ww] = __ldcg(sml + ww * 2 * G + G + tid);
                }
            float m = -INFINITY;
#pragma unroll
            for (int ww = 0; ww < ATTN_SLICES; ww++)
                if (ww < nsl) m = fmaxf(m, mw[ww]);
            float l = 0.0f;
#pragma unroll
            for (int ww = 0; ww < ATTN_SLICES; ww++)
                if (ww < nsl) {
                    const float f = expf(mw[ww] - m);
                    fw[ww * G + tid] = f;
                    l = fmaf(lw[ww], f, l);
                }
            sm[tid] = m;
            sl[tid] = l;
        }
        __syncthreads();
        const int64_t cblk = tg * NC + c;
        float4 *po = reinterpret_cast<float4 *>(part_o + cblk * G * DH);
        float4 xs[EPT]; // the chunk's sums, stored once every slice's are read
#pragma unroll
        for (int i = 0; i < EPT; i++) {
            const int e = tid + i * NT;
            if (e >= G * D4) break;
            const int h = e / D4;
            float4 a[ATTN_SLICES];
#pragma unroll
            for (int ww = 0; ww < ATTN_SLICES; ww++)
                if (ww < nsl)
                    a[ww] = i < PF ? pre[i < PF ? i : 0][ww]
                                   : __ldcg(reinterpret_cast<const float4 *>(so) + ww * G * D4 + e);
            float4 x = mul4v(fw[h], a[0]);
#pragma unroll
            for (int ww = 1; ww < ATTN_SLICES; ww++)
                if (ww < nsl) x = fma4v(fw[ww * G + h], a[ww], x);
            xs[i] = x;
        }
        if (n <= ATTN_CHUNK) { // one chunk: its merge is the token's (above)
#pragma unroll
            for (int i = 0; i < EPT; i++)
                if (tid + i * NT < G * D4) fin[tid + i * NT] = div4(xs[i], sl[(tid + i * NT) / D4]);
            return;
        }
#pragma unroll
        for (int i = 0; i < EPT; i++)
            if (tid + i * NT < G * D4) po[tid + i * NT] = xs[i];
        if (tid < G) {
            part_ml[cblk * 2 * G + tid] = sm[tid];
            part_ml[cblk * 2 * G + G + tid] = sl[tid];
        }
    }

    // ---- the last chunk of the token merges the chunks in increasing order ----
    __threadfence();
    __syncthreads();
    const int nc = (n - 1) / ATTN_CHUNK + 1;
    if (tid == 0) {
        const int done = atomicAdd(cnt_t, 1) + 1;
        last = done == nc;
        if (done == nc) *cnt_t = 0;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    {
        constexpr int PC = 4; // chunks whose outputs are requested ahead
        const float4 *po = reinterpret_cast<const float4 *>(part_o + tg * NC * G * DH);
        float4 pre[PF][PC];
        merge_request<NT, G * D4>(pre, po, nc, tid);
        float *wc = reinterpret_cast<float *>(attn_dyn); // [nc][G] chunk m, then weights
        float *lc = wc + nc * G;                         // [nc][G] chunk l
        const float *pml = part_ml + tg * NC * 2 * G;
        for (int i = tid; i < nc * G; i += NT) {
            const int cc = i / G, h = i % G;
            wc[i] = __ldcg(pml + cc * 2 * G + h);
            lc[i] = __ldcg(pml + cc * 2 * G + G + h);
        }
        __syncthreads();
        if (tid < G) {
            float M = -INFINITY;
            for (int cc = 0; cc < nc; cc++)
                M = fmaxf(M, wc[cc * G + tid]);
            sm[tid] = M;
        }
        __syncthreads();
        for (int i = tid; i < nc * G; i += NT)
            wc[i] = expf(wc[i] - sm[i % G]);
        __syncthreads();
        if (tid < G) {
            float Lh = 0.0f;
            for (int cc = 0; cc < nc; cc++)
                Lh = fmaf(lc[cc * G + tid], wc[cc * G + tid], Lh);
            sl[tid] = Lh;
        }
        __syncthreads();
#pragma unroll
        for (int i = 0; i < EPT; i++) {
            const int e = tid + i * NT;
            if (e >= G * D4) break;
            const int h = e / D4;
            float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
            if (i < PF) {
#pragma unroll
                for (int cc = 0; cc < PC; cc++)
                    if (cc < nc) o = fma4v(wc[cc * G + h], pre[i < PF ? i : 0][cc], o);
            }
#pragma unroll 4
            for (int cc = i < PF ? PC : 0; cc < nc; cc++)
                o = fma4v(wc[cc * G + h], __ldcg(po + cc * G * D4 + e), o);
            fin[e] = div4(o, sl[h]);
        }
    }
}

template <int DH, int G, int GW, class KV>
__global__ void __launch_bounds__(G / GW * 32)
    attn_slice_kernel(float *__restrict__ out, float *__restrict__ slice_o,
                      float *__restrict__ slice_ml, float *__restrict__ part_o,
                      float *__restrict__ part_ml, int *__restrict__ cnt,
                      const float *__restrict__ q, const KV *__restrict__ kc,
                      const KV *__restrict__ vc, const int32_t *__restrict__ pos,
                      const int32_t *__restrict__ seq, const int32_t *__restrict__ page_table,
                      int t0, int T, int H, int Hkv, int max_pages, int S, int NC, float scale) {
    attn_slice_block<DH, G, GW, KV>(blockIdx.x, blockIdx.y, blockIdx.z, pdl_dep(), out, slice_o,
                                    slice_ml, part_o, part_ml, cnt, q, kc, vc, pos, seq, page_table,
                                    t0, T, H, Hkv, max_pages, S, NC, scale);
}
// ZC = gridDim.z / CS clusters of CS blocks per (token t0 + blockIdx.x, head group blockIdx.y);
// cluster z takes the groups of CPC consecutive chunks z, z + ZC, ... in turn. Block r of the
// cluster takes SPB consecutive slices of chunk r / BPC of the group (a group of G / GW warps each,
// as attn_slice_kernel's block does one) and keeps each slice's o_w, m_w, l_w in its shared memory.
// After a cluster barrier the BPC blocks of a chunk merge its slices (each block a range of the
// G * DH outputs, reading the slices from the cluster's shared memory); a token of one group then
// merges its chunks the same way, behind a second barrier. Longer ones write the chunk results to
// part_o, part_ml, and the last of the token's clusters to finish (an atomic counter of groups,
// left at zero) merges them from there. The arithmetic is attn_slice_kernel's, in the same order.
//   part_o, part_ml as for attn_chunk_kernel; out [T, H, DH]
//   cnt [Ts, H / G, NC + 1]: entry NC counts finished chunk groups (left at zero)
// Dynamic shared memory: max(2 * SPB * ATTN_SLICE * DH, 2 * NC * G) floats.
template <int DH, int G, int GW, int SPB, int CS, class KV>
__global__ void __launch_bounds__(SPB *G / GW * 32)
    attn_cluster_kernel(float *__restrict__ out, float *__restrict__ part_o,
                        float *__restrict__ part_ml, int *__restrict__ cnt,
                        const float *__restrict__ q, const KV *__restrict__ kc,
                        const KV *__restrict__ vc, const int32_t *__restrict__ pos,
                        const int32_t *__restrict__ seq, const int32_t *__restrict__ page_table,
                        int t0, int T, int H, int Hkv, int max_pages, int S, int NC, float scale) {
    using L = attn_layout<DH>;
    constexpr int NTG = G / GW * 32, NT = SPB * NTG, D4 = DH / 4;
    constexpr int LV = L::LV, FV = L::FV;
    constexpr int BPC = ATTN_SLICES / SPB;    // blocks a chunk
    constexpr int CPC = CS / BPC;             // chunks a cluster
    constexpr int GE = G * D4;                // float4 of a chunk's o
    constexpr int EPB = (GE + BPC - 1) / BPC; // of them merged by each block of the chunk
    constexpr int EPF = (GE + CS - 1) / CS;   // outputs merged by each block of the cluster
    static_assert(G % GW == 0 && G / GW <= 32 && NT <= 1024, "warps");
    static_assert(ATTN_SLICES % SPB == 0 && CS % BPC == 0, "cluster shape");

    typedef kv_elem<KV> E;
    typedef typename E::piece P;
    cg::cluster_group cluster = cg::this_cluster();
    extern __shared__ __align__(16) float4 attn_dyn[];
    P *ks = reinterpret_cast<P *>(attn_dyn); // [SPB][ATTN_SLICE][D4] K rows of the slices
    P *vs = ks + SPB * ATTN_SLICE * D4;      // [SPB][ATTN_SLICE][D4] V rows
    __shared__ __align__(16) float4 qs[GE];
    __shared__ __align__(16) float4 so[SPB][GE]; // each slice's o_w
    __shared__ __align__(16) float4 co[EPB];     // this block's range of its chunk's o
    __shared__ float s[SPB][ATTN_SLICE * G];     // scores, then exp weights [p][h]
    __shared__ int rows[SPB][ATTN_SLICE];
    __shared__ float sml[SPB][2 * G];                   // each slice's m_w, then l_w
    __shared__ float fw[ATTN_SLICES * G], cm[G], cl[G]; // slice weights; the chunk's m, l
    __shared__ float wcs[CPC * G], fl[G];               // chunk weights, L (in-cluster merge)
    __shared__ int last;

    // Before the wait for the kernel before, only what it cannot be writing is read (as in
    // attn_slice_kernel): positions, sequences, page table and the rows no token of the batch
    // stores.
    pdl_trigger();
    const int tl = blockIdx.x, hg = blockIdx.y;
    const int t = t0 + tl, tid = threadIdx.x;
    const int r = (int)cluster.block_rank();
    const int zc = blockIdx.z / CS, ZC = gridDim.z / CS; // cluster of the token, clusters a token
    const int n = pos[t] + 1;                            // positions 0..pos[t]
    if (zc * CPC * ATTN_CHUNK >= n) return; // the whole cluster: the same test in each block
    const int sq = seq[t];
    int first_new = n - 1; // the lowest position a token of this batch stores for sequence sq
    for (int u = 0; u < T; u++)
        if (seq[u] == sq && pos[u] < first_new) first_new = pos[u];
    const int nc = (n - 1) / ATTN_CHUNK + 1, ncl = (nc + CPC - 1) / CPC; // chunks, groups of CPC
    const int64_t tg = (int64_t)tl * (H / G) + hg;                       // (token, head group)
    float4 *ot = reinterpret_cast<float4 *>(out + ((int64_t)t * H + hg * G) * DH);
    const int gs = tid / NTG, gt = tid % NTG, lane = tid & 31, w = gt >> 5;
    const int k = r % BPC; // this block's place in its chunk
    int groups = 0;        // chunk groups this cluster took
    for (int cgr = zc; cgr < ncl; cgr += ZC, groups++) {
        const int c = cgr * CPC + r / BPC;            // this block's chunk
        const int j = c * ATTN_SLICES + k * SPB + gs; // the slice of warp group gs
        const int p0 = j * ATTN_SLICE;
        const int nv = max(0, min(ATTN_SLICE, n - p0)); // valid positions of the slice
        const bool early = p0 + nv <= first_new;
        const int g = hg * G / (H / Hkv); // kv head
        if (gt < nv) {
            const int p = p0 + gt;
            rows[gs][gt] = page_table[(int64_t)sq * max_pages + p / S] * S + p % S;
        }
        __syncthreads();
        const int64_t rs4 = (int64_t)Hkv * D4; // pieces per cache row
        const P *kg = reinterpret_cast<const P *>(kc) + (int64_t)g * D4;
        const P *vg = reinterpret_cast<const P *>(vc) + (int64_t)g * D4;
        P *ksg = ks + gs * ATTN_SLICE * D4, *vsg = vs + gs * ATTN_SLICE * D4;
        const int *rw = rows[gs];
        if (early) {
            cp_async_rows<D4>(ksg, kg, rw, rs4, nv, gt, NTG);
            cp_async_commit(); // group: K
            cp_async_rows<D4>(vsg, vg, rw, rs4, nv, gt, NTG);
            cp_async_commit(); // group: V
        }
        pdl_wait();
        const float4 *qt = reinterpret_cast<const float4 *>(q + ((int64_t)t * H + hg * G) * DH);
        for (int i = tid; i < GE; i += NT)
            cp_async16(&qs[i], qt + i);
        if (!early) cp_async_rows<D4>(ksg, kg, rw, rs4, nv, gt, NTG);
        cp_async_commit(); // group: q (and K)
        if (!early) {
            cp_async_rows<D4>(vsg, vg, rw, rs4, nv, gt, NTG);
            cp_async_commit();  // group: V
            cp_async_wait<1>(); // q and K
        } else {
            cp_async_wait<0>(); // K and V long since, q now
        }
        __syncthreads();

        // ---- the slice of warp group gs, as attn_slice_kernel computes it ----
        const int h0 = w * GW, subv = lane % LV, rv = lane / LV;
        float *sg = s[gs];
        float wm_[GW], wl_[GW];
        attn_slice_softmax<DH, G, GW, E>(wm_, wl_, sg, qs, ksg, h0, nv, lane, scale);
        cp_async_wait<0>();
        __syncthreads(); // V rows of every thread's copies
        float4 acc[GW][FV];
        attn_slice_weighted_v<DH, G, GW, E>(acc, sg, vsg, h0, nv, lane);
        if (rv == 0) {
#pragma unroll
            for (int h = 0; h < GW; h++)
#pragma unroll
                for (int f = 0; f < FV; f++)
                    so[gs][(h0 + h) * D4 + f * LV + subv] = acc[h][f];
        }
        if (lane == 0) {
#pragma unroll
            for (int h = 0; h < GW; h++) {
                sml[gs][h0 + h] = wm_[h];
                sml[gs][G + h0 + h] = wl_[h];
            }
        }
        cluster.sync(); // every slice's o_w, m_w, l_w

        // ---- the chunk's slices ww < nsl (held by blocks r - k + ww / SPB) in order; block k of
        // the chunk takes its outputs k * EPB .. ----
        const int nsl = c * ATTN_CHUNK < n
                            ? min(ATTN_SLICES, (n - c * ATTN_CHUNK + ATTN_SLICE - 1) / ATTN_SLICE)
                            : 0;
        const int rc = r - k; // the chunk's first block
        if (nsl > 0) {
            if (tid < G) {
                float mw[ATTN_SLICES], lw[ATTN_SLICES];
#pragma unroll
                for (int ww = 0; ww < ATTN_SLICES; ww++)
                    if (ww < nsl) {
                        const float *ml = cluster.map_shared_rank(&sml[ww % SPB][0], rc + ww / SPB);
                        mw[ww] = ml[tid];
                        lw[ww] = ml[G + tid];
                    }
                float m = -INFINITY;
#pragma unroll
                for (int ww = 0; ww < ATTN_SLICES; ww++)
                    if (ww < nsl) m = fmaxf(m, mw[ww]);
                float l = 0.0f;
#pragma unroll
                for (int ww = 0; ww < ATTN_SLICES; ww++)
                    if (ww < nsl) {
                        const float f = expf(mw[ww] - m);
                        fw[ww * G + tid] = f;
                        l = fmaf(lw[ww], f, l);
                    }
                cm[tid] = m;
                cl[tid] = l;
            }
            __syncthreads();
            for (int i = tid; i < EPB; i += NT) {
                const int e = k * EPB + i;
                if (e >= GE) break;
                const int h = e / D4;
                float4 a[ATTN_SLICES];
#pragma unroll
                for (int ww = 0; ww < ATTN_SLICES; ww++)
                    if (ww < nsl)
                        a[ww] = cluster.map_shared_rank(&so[ww % SPB][0], rc + ww / SPB)[e];
                float4 x = mul4v(fw[h], a[0]);
#pragma unroll
                for (int ww = 1; ww < ATTN_SLICES; ww++)
                    if (ww < nsl) x = fma4v(fw[ww * G + h], a[ww], x);
                co[i] = x;
            }
        }

        // ---- the token's chunks in increasing order ----
        if (ncl == 1) { // all in this cluster: from its shared memory
            cluster.sync(); // every chunk's range of o, m and l
            if (r * EPF < GE) {
                if (tid < G) {
                    float M = -INFINITY;
                    for (int cc = 0; cc < nc; cc++)
                        M = fmaxf(M, cluster.map_shared_rank(cm, cc * BPC)[tid]);
                    float Lh = 0.0f;
                    for (int cc = 0; cc < nc; cc++) {
                        const float wc = expf(cluster.map_shared_rank(cm, cc * BPC)[tid] - M);
                        wcs[cc * G + tid] = wc;
                        Lh = fmaf(cluster.map_shared_rank(cl, cc * BPC)[tid], wc, Lh);
                    }
                    fl[tid] = Lh;
                }
                __syncthreads();
                for (int i = tid; i < EPF; i += NT) {
                    const int e = r * EPF + i;
                    if (e >= GE) break;
                    const int h = e / D4;
                    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
                    for (int cc = 0; cc < nc; cc++)
                        o = fma4v(wcs[cc * G + h],
                                  cluster.map_shared_rank(co, cc * BPC + e / EPB)[e % EPB], o);
                    const float Lh = fl[h];
                    ot[e] = make_float4(o.x / Lh, o.y / Lh, o.z / Lh, o.w / Lh);
                }
            }
            cluster.sync(); // no block leaves while its shared memory is read
            return;
        }

        // longer: the chunk results through global memory, the last cluster merges them
        if (nsl > 0) {
            const int64_t cblk = tg * NC + c;
            float4 *po = reinterpret_cast<float4 *>(part_o + cblk * G * DH);
            for (int i = tid; i < EPB; i += NT) {
                const int e = k * EPB + i;
                if (e >= GE) break;
                po[e] = co[i];
            }
            if (k == 0 && tid < G) {
                part_ml[cblk * 2 * G + tid] = cm[tid];
                part_ml[cblk * 2 * G + G + tid] = cl[tid];
            }
        }
        __threadfence();
        // every block's chunk results are out, its shared memory free for the next group
        cluster.sync();
    }
    if (r == 0 && tid == 0) {
        int *cnt_t = cnt + tg * (NC + 1) + NC;
        const int done = atomicAdd(cnt_t, groups) + groups;
        if (done == ncl) *cnt_t = 0; // every cluster has counted: ready for the next launch
        for (int rr = 0; rr < CS; rr++)
            *cluster.map_shared_rank(&last, rr) = done == ncl;
    }
    cluster.sync();
    if (!last || r * EPF >= GE) return;
    __threadfence();
    {
        float *wc = reinterpret_cast<float *>(attn_dyn); // [nc][G] chunk m, then weights
        float *lc = wc + nc * G;                         // [nc][G] chunk l
        const float *pml = part_ml + tg * NC * 2 * G;
        for (int i = tid; i < nc * G; i += NT) {
            const int cc = i / G, h = i % G;
            wc[i] = __ldcg(pml + cc * 2 * G + h);
            lc[i] = __ldcg(pml + cc * 2 * G + G + h);
        }
        __syncthreads();
        if (tid < G) {
            float M = -INFINITY;
            for (int cc = 0; cc < nc; cc++)
                M = fmaxf(M, wc[cc * G + tid]);
            cm[tid] = M;
        }
        __syncthreads();
        for (int i = tid; i < nc * G; i += NT)
            wc[i] = expf(wc[i] - cm[i % G]);
        __syncthreads();
        if (tid < G) {
            float Lh = 0.0f;
            for (int cc = 0; cc < nc; cc++)
                Lh = fmaf(lc[cc * G + tid], wc[cc * G + tid], Lh);
            fl[tid] = Lh;
        }
        __syncthreads();
        const float4 *po = reinterpret_cast<const float4 *>(part_o + tg * NC * G * DH);
        for (int i = tid; i < EPF; i += NT) {
            const int e = r * EPF + i;
            if (e >= GE) break;
            const int h = e / D4;
            float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
            for (int cc = 0; cc < nc; cc++)
                o = fma4v(wc[cc * G + h], __ldcg(po + cc * G * D4 + e), o);
            const float Lh = fl[h];
            ot[e] = make_float4(o.x / Lh, o.y / Lh, o.z / Lh, o.w / Lh);
        }
    }
}
// One (tile blockIdx.x: QT = ATTN_TILE_ROWS / G consecutive tokens t0 + QT * blockIdx.x ..., head
// group blockIdx.y, chunks blockIdx.z, + gridDim.z, ...), for a tile whose tokens are all of one
// sequence: each token's chunk results, as attn_chunk_kernel gives them. Rows r = k * G + h (token k
// of the tile, head h). Three passes over a chunk: scores of all rows (each K row read once, LK lanes
// per position as in the chunk kernel; the first V slices are requested meanwhile); each (slice,
// row)'s softmax (a thread each, the 32-lane butterfly sum written out as its tree); then per warp
// RW rows' weighted V, slice by slice from shared memory (two slice buffers filled by cp.async),
// each slice's o_w folded into the chunk sum with its weight f_w. The grid's few chunk columns
// keep the blocks that exit at once (decode batches, which have no tiles) few.
// Dynamic shared memory: q [ATTN_TILE_ROWS][DH], scores [ATTN_CHUNK][ATTN_TILE_ROWS], then V
// [2][ATTN_SLICE][DH] floats.
template <int DH, int G, class KV>
__global__ void __launch_bounds__(ATTN_TILE_THREADS, 2)
    attn_tile_kernel(float *__restrict__ part_o, float *__restrict__ part_ml,
                     const float *__restrict__ q, const KV *__restrict__ kc,
                     const KV *__restrict__ vc, const int32_t *__restrict__ pos,
                     const int32_t *__restrict__ seq, const int32_t *__restrict__ page_table,
                     int t0, int Ts, int H, int Hkv, int max_pages, int S, int NC, float scale) {
    using L = attn_layout<DH>;
    typedef kv_elem<KV> E;
    typedef typename E::piece P;
    constexpr int R = ATTN_TILE_ROWS, QT = R / G, D4 = DH / 4;
    // A lane's scores: UK position steps of K pieces in registers against RB rows of q at a time,
    // so each piece of q read from shared memory serves UK positions. H200, prefill of one
    // 2048-token prompt (test_cuda_attention --bench): UK 4, RB 4 2107 us; UK 2, RB 8 2282; UK 4,
    // RB 8 2408 (spills). Neither is part of the arithmetic.
    constexpr int LK = L::LK, FK = L::FK, PK = L::PK, UK = 4;
    constexpr int LV = L::LV, FV = L::FV, RV = L::RV;
    constexpr int RW = R / ATTN_TILE_WARPS; // rows of a warp in the weighted V
    constexpr int RB = 4;                   // rows at once in the scores
    static_assert(R % G == 0 && R == 32 && RW == 4 && ATTN_TILE_WARPS == ATTN_SLICES, "tile");

    extern __shared__ __align__(16) float4 attn_dyn[];
    float4 *qs = attn_dyn;                              // [R][D4]
    float *sc = reinterpret_cast<float *>(qs + R * D4); // [ATTN_CHUNK][R] scores, then exp weights
    P *vsm = reinterpret_cast<P *>(sc + ATTN_CHUNK * R); // [2][ATTN_SLICE][D4] V slices
    __shared__ int rows[ATTN_CHUNK];
    __shared__ int nvk[QT]; // positions of the chunk each token sees (<= 0: none)
    __shared__ float wm[ATTN_SLICES * R], wl[ATTN_SLICES * R], fw[ATTN_SLICES * R];
    __shared__ float cm[R], cl[R];

    const int gi = blockIdx.x, hg = blockIdx.y;
    const int tq = t0 + gi * QT; // first token of the tile
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    if (!in_tile_group(seq, t0, Ts, gi * QT, QT)) return; // tokens of several sequences
    int nmax = 0;
    for (int k = 0; k < QT; k++)
        nmax = max(nmax, pos[tq + k] + 1);
    const int ncmax = (nmax - 1) / ATTN_CHUNK + 1; // chunks the tile sees
    if ((int)blockIdx.z >= ncmax) return;
    const int g = hg * G / (H / Hkv); // kv head
    for (int i = tid; i < R * D4; i += ATTN_TILE_THREADS) {
        const int k = i / (G * D4); // a token's G heads are contiguous in q
        qs[i] = reinterpret_cast<const float4 *>(q + ((int64_t)(tq + k) * H + hg * G) *
                                                         DH)[i - k * G * D4];
    }
    const int32_t *pt = page_table + (int64_t)seq[tq] * max_pages;
    const int64_t rs4 = (int64_t)Hkv * D4; // pieces per cache row
    const P *kg = reinterpret_cast<const P *>(kc) + (int64_t)g * D4;
    const P *vg = reinterpret_cast<const P *>(vc) + (int64_t)g * D4;

    for (int c = blockIdx.z; c < ncmax; c += gridDim.z) {
        const int p0 = c * ATTN_CHUNK;
        const int nvmax = min(ATTN_CHUNK, nmax - p0);
        const int nsl = (nvmax + ATTN_SLICE - 1) / ATTN_SLICE; // slices any token of the tile sees
        if (tid < QT) nvk[tid] = min(ATTN_CHUNK, pos[tq + tid] + 1 - p0);
        for (int i = tid; i < nvmax; i += ATTN_TILE_THREADS) {
            const int p = p0 + i;
            rows[i] = pt[p / S] * S + p % S;
        }
        __syncthreads();
        // V slice jj into buffer jj & 1, one commit group per slice
        auto stage_v = [&](int jj) {
            const int i0 = jj * ATTN_SLICE, cntv = min(ATTN_SLICE, nvmax - i0);
            P *dst = vsm + (jj & 1) * ATTN_SLICE * D4;
            cp_async_rows<D4>(dst, vg, rows + i0, rs4, cntv, tid, ATTN_TILE_THREADS);
            cp_async_commit();
        };
        stage_v(0);
        if (nsl > 1) stage_v(1);

        // ---- scores: warps take UK * PK positions at a time; sc[p][r] = (q_r . k_p) * scale ----
        {
            const int sub = lane % LK, pp = lane / LK;
            for (int i0 = w * UK * PK; i0 < nvmax; i0 += ATTN_TILE_WARPS * UK * PK) {
                float4 kr[UK][FK];
#pragma unroll
                for (int u = 0; u < UK; u++) {
                    const int i = i0 + u * PK + pp;
                    const P *kp = kg + rows[i < nvmax ? i : i0] * rs4;
#pragma unroll
                    for (int f = 0; f < FK; f++)
                        kr[u][f] = i < nvmax ? E::widen(__ldg(kp + f * LK + sub))
                                             : make_float4(0.f, 0.f, 0.f, 0.f);
                }
#pragma unroll 1
                for (int r0 = 0; r0 < R; r0 += RB) {
                    float acc[UK][RB];
#pragma unroll
                    for (int u = 0; u < UK; u++)
#pragma unroll
                        for (int rr = 0; rr < RB; rr++)
                            acc[u][rr] = 0.0f;
#pragma unroll
                    for (int f = 0; f < FK; f++)
#pragma unroll
                        for (int rr = 0; rr < RB; rr++) {
                            const float4 qv = qs[(r0 + rr) * D4 + f * LK + sub];
#pragma unroll
                            for (int u = 0; u < UK; u++)
                                fma4(acc[u][rr], qv, kr[u][f]);
                        }
#pragma unroll
                    for (int off = LK / 2; off > 0; off /= 2)
#pragma unroll
                        for (int u = 0; u < UK; u++)
#pragma unroll
                            for (int rr = 0; rr < RB; rr++)
                                acc[u][rr] += __shfl_xor_sync(0xffffffffu, acc[u][rr], off);
#pragma unroll
                    for (int u = 0; u < UK; u++) {
                        const int i = i0 + u * PK + pp;
                        if (i < nvmax) {
#pragma unroll
                            for (int rr = 0; rr < RB; rr++)
                                if (rr % LK == sub)
                                    sc[i * R + r0 + rr] = __fmul_rn(acc[u][rr], scale);
                        }
                    }
                }
            }
        }
        __syncthreads();

        // ---- softmax of (slice w, row lane): m_w, exp weights in place, l_w as the butterfly's
        // tree ----
        {
            const int r = lane;
            const int cnt = min(ATTN_SLICE, nvk[r / G] - w * ATTN_SLICE);
            if (cnt > 0) {
                float *col = sc + w * ATTN_SLICE * R + r;
                float m = -INFINITY;
                for (int i = 0; i < cnt; i++)
                    m = fmaxf(m, col[i * R]);
                float a[ATTN_SLICE];
#pragma unroll
                for (int i = 0; i < ATTN_SLICE; i++) {
                    float e = 0.0f;
                    if (i < cnt) {
                        e = expf(col[i * R] - m);
                        col[i * R] = e;
                    }
                    a[i] = e;
                }
                // lane i of an xor butterfly ends with a[i] + a[i ^ off] at each step: this tree
                static_assert(ATTN_SLICE == 32, "the tree below");
#pragma unroll
                for (int i = 0; i < 16; i++)
                    a[i] = a[i] + a[i + 16];
#pragma unroll
                for (int i = 0; i < 8; i++)
                    a[i] = a[i] + a[i + 8];
#pragma unroll
                for (int i = 0; i < 4; i++)
                    a[i] = a[i] + a[i + 4];
#pragma unroll
                for (int i = 0; i < 2; i++)
                    a[i] = a[i] + a[i + 2];
                a[0] = a[0] + a[1];
                wm[w * R + r] = m;
                wl[w * R + r] = a[0];
            }
        }
        __syncthreads();
        // ---- each row's chunk m, l and slice weights f_w, slices in order ----
        if (tid < R) {
            const int nv = nvk[tid / G];
            if (nv > 0) {
                const int nw = (nv + ATTN_SLICE - 1) / ATTN_SLICE;
                float m = -INFINITY;
                for (int ww = 0; ww < nw; ww++)
                    m = fmaxf(m, wm[ww * R + tid]);
                float l = 0.0f;
                for (int ww = 0; ww < nw; ww++) {
                    const float f = expf(wm[ww * R + tid] - m);
                    fw[ww * R + tid] = f;
                    l = fmaf(wl[ww * R + tid], f, l);
                }
                cm[tid] = m;
                cl[tid] = l;
            }
        }
        __syncthreads();

        // ---- weighted V of the warp's rows r0..r0 + RW - 1, slice by slice ----
        {
            const int subv = lane % LV, rv = lane / LV, r0 = w * RW;
            int nvr[RW];
#pragma unroll
            for (int rr = 0; rr < RW; rr++)
                nvr[rr] = nvk[(r0 + rr) / G];
            float4 och[RW][FV];
#pragma unroll
            for (int rr = 0; rr < RW; rr++)
#pragma unroll
                for (int f = 0; f < FV; f++)
                    och[rr][f] = make_float4(0.f, 0.f, 0.f, 0.f);
            for (int jj = 0; jj < nsl; jj++) {
                if (jj + 1 < nsl)
                    cp_async_wait<1>();
                else
                    cp_async_wait<0>();
                __syncthreads(); // slice jj's V rows of every thread's copies
                const P *vb = vsm + (jj & 1) * ATTN_SLICE * D4;
                const int ib0 = jj * ATTN_SLICE, cntv = min(ATTN_SLICE, nvmax - ib0);
                float4 acc[RW][FV];
#pragma unroll
                for (int rr = 0; rr < RW; rr++)
#pragma unroll
                    for (int f = 0; f < FV; f++)
                        acc[rr][f] = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
                for (int k = 0; k < ATTN_SLICE / RV; k++) {
                    const int il = k * RV + rv; // increasing for each lane group
                    if (il < cntv) {
                        const int i = ib0 + il;
                        const float4 e4 = *reinterpret_cast<const float4 *>(sc + i * R + r0);
                        const float e[RW] = {e4.x, e4.y, e4.z, e4.w};
                        float4 v[FV];
#pragma unroll
                        for (int f = 0; f < FV; f++)
                            v[f] = E::widen(vb[il * D4 + f * LV + subv]);
#pragma unroll
                        for (int rr = 0; rr < RW; rr++)
                            if (i < nvr[rr]) {
#pragma unroll
                                for (int f = 0; f < FV; f++)
                                    acc[rr][f] = fma4v(e[rr], v[f], acc[rr][f]);
                            }
                    }
                }
#pragma unroll
                for (int off = 16; off >= LV; off /= 2)
#pragma unroll
                    for (int rr = 0; rr < RW; rr++)
#pragma unroll
                        for (int f = 0; f < FV; f++)
                            shfl_add4(acc[rr][f], off);
#pragma unroll
                for (int rr = 0; rr < RW; rr++)
                    if (ib0 < nvr[rr]) {
                        const float f = fw[jj * R + r0 + rr];
#pragma unroll
                        for (int ff = 0; ff < FV; ff++)
                            och[rr][ff] = jj == 0 ? mul4v(f, acc[rr][ff])
                                                  : fma4v(f, acc[rr][ff], och[rr][ff]);
                    }
                __syncthreads(); // every warp is done with buffer jj & 1
                if (jj + 2 < nsl) stage_v(jj + 2);
            }
            if (rv == 0) {
#pragma unroll
                for (int rr = 0; rr < RW; rr++)
                    if (nvr[rr] > 0) {
                        const int r = r0 + rr, k = r / G, h = r % G;
                        const int64_t cblk = ((int64_t)(tq - t0 + k) * (H / G) + hg) * NC + c;
#pragma unroll
                        for (int f = 0; f < FV; f++)
                            reinterpret_cast<float4 *>(part_o + (cblk * G + h) *
                                                                    DH)[f * LV + subv] = och[rr][f];
                    }
            }
        }
        if (tid < R && nvk[tid / G] > 0) {
            const int k = tid / G, h = tid % G;
            const int64_t cblk = ((int64_t)(tq - t0 + k) * (H / G) + hg) * NC + c;
            part_ml[cblk * 2 * G + h] = cm[tid];
            part_ml[cblk * 2 * G + G + h] = cl[tid];
        }
        __syncthreads(); // the next chunk rewrites rows, nvk and the scores
    }
}
// One (token t0 + blockIdx.x, head group blockIdx.y): out[t, hg * G + h, :] from the token's
// chunks c = 0..pos[t] / ATTN_CHUNK, in that order. Dynamic shared memory: [NC][G] chunk weights,
// then [G] sums L.
__global__ void __launch_bounds__(ATTN_COMBINE_THREADS)
    attn_combine_kernel(float *__restrict__ out, const float *__restrict__ part_o,
                        const float *__restrict__ part_ml, const int32_t *__restrict__ pos, int t0,
                        int H, int G, int DH, int NC) {
    extern __shared__ float wsh[];
    const int tl = blockIdx.x, hg = blockIdx.y;
    const int t = t0 + tl;
    const int nc = pos[t] / ATTN_CHUNK + 1;
    const int64_t blk0 = ((int64_t)tl * (H / G) + hg) * NC;
    float *wc = wsh, *Ls = wsh + (size_t)NC * G;
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    for (int h = w; h < G; h += ATTN_COMBINE_THREADS / 32) {
        float M = -INFINITY;
        for (int c = lane; c < nc; c += 32)
            M = fmaxf(M, part_ml[(blk0 + c) * 2 * G + h]);
#pragma unroll
        for (int off = 16; off > 0; off /= 2)
            M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, off));
        for (int c = lane; c < nc; c += 32)
            wc[c * G + h] = expf(part_ml[(blk0 + c) * 2 * G + h] - M);
        __syncwarp();
        if (lane == 0) {
            float L = 0.0f;
            for (int c = 0; c < nc; c++)
                L = fmaf(part_ml[(blk0 + c) * 2 * G + G + h], wc[c * G + h], L);
            Ls[h] = L;
        }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < G * DH; e += ATTN_COMBINE_THREADS) {
        const int h = e / DH;
        float o = 0.0f;
        for (int c = 0; c < nc; c++)
            o = fmaf(wc[c * G + h], part_o[(blk0 + c) * G * DH + e], o);
        out[((int64_t)t * H + hg * G) * DH + e] = o / Ls[h];
    }
}

// Device memory of the op, grown on demand in stream order: the partial results of one slice of
// tokens, and the slice kernel's counters (zeroed when allocated; every launch leaves them at zero).
static float *g_ws;
static size_t g_ws_bytes;
static int *g_cnt;
static size_t g_cnt_n;

static bool dev_grow(void **p, size_t *have, size_t bytes, bool zero) {
    if (bytes <= *have) return true;
    cudaStream_t st = cuda_stream();
    if (*p) CUDA_CHECK(cudaFreeAsync(*p, st));
    cuda_workspace_changed(); /* graphs that used the old buffer are stale */
    *p = nullptr;
    *have = 0;
    if (cudaMallocAsync(p, bytes, st) != cudaSuccess) {
        cudaGetLastError(); // not sticky: clear it
        *p = nullptr;
        return false;
    }
    if (zero) CUDA_CHECK(cudaMemsetAsync(*p, 0, bytes, st));
    *have = bytes;
    return true;
}

static bool ws_reserve(size_t bytes) {
    void *p = g_ws;
    const bool ok = dev_grow(&p, &g_ws_bytes, bytes, false);
    g_ws = static_cast<float *>(p);
    return ok;
}

static void cnt_reserve(size_t n) {
    void *p = g_cnt;
    size_t bytes = g_cnt_n * sizeof(int);
    if (!dev_grow(&p, &bytes, n * sizeof(int), true))
        cuda_fail(__FILE__, __LINE__, "attention", "out of device memory for the counters");
    g_cnt = static_cast<int *>(p);
    g_cnt_n = bytes / sizeof(int);
}

// The kernels' shared arguments.
struct attn_args {
    float *out, *part_o, *part_ml, *slice_o, *slice_ml;
    int *cnt;
    const float *q;
    kv_layer kv;
    const attn_batch *b;
    int t0, Ts, H, Hkv, NC;
    float scale;
};

static size_t slice_smem(int DH, int G, int NC) {
    const size_t a = (size_t)2 * ATTN_SLICE * DH, b = (size_t)2 * NC * G;
    return (a > b ? a : b) * sizeof(float);
}

template <int DH, int G, class KV> static void launch_slices(const attn_args &a) {
    constexpr int GW = G < 2 ? G : 2;
    auto kernel = attn_slice_kernel<DH, G, GW, KV>;
    static size_t smem_set = 0;
    const size_t smem = slice_smem(DH, G, a.NC);
    cuda_smem_allow(kernel, smem, &smem_set);
    const attn_batch *b = a.b;
    cuda_launch_pdl(kernel, dim3(a.Ts, a.H / G, a.NC * ATTN_SLICES), dim3(G / GW * 32), smem, a.out,
                    a.slice_o, a.slice_ml, a.part_o, a.part_ml, a.cnt, a.q, (const KV *)a.kv.k,
                    (const KV *)a.kv.v, b->pos, b->seq, b->page_table, a.t0, b->T, a.H, a.Hkv,
                    b->max_pages, b->page_size, a.NC, a.scale);
}

template <int DH> constexpr int cluster_spb() {
    return ATTN_CLUSTER_SPB * DH <= 512 ? ATTN_CLUSTER_SPB : 512 / DH;
}

// False where no cluster of the kernel fits a GPC (then the caller takes the slice kernel).
template <int DH, int G, class KV> static bool launch_clusters(const attn_args &a) {
    constexpr int GW = G < 2 ? G : 2, SPB = cluster_spb<DH>(), CS = ATTN_CLUSTER_CS;
    constexpr int CPC = CS * SPB / ATTN_SLICES;
    auto kernel = attn_cluster_kernel<DH, G, GW, SPB, CS, KV>;
    static size_t smem_set = 0, smem_checked = 0;
    static int max_active = 0; // clusters resident at once on the device
    const size_t kv = (size_t)2 * SPB * ATTN_SLICE * DH, ml = (size_t)2 * a.NC * G;
    const size_t smem = (kv > ml ? kv : ml) * sizeof(float);
    cuda_smem_allow(kernel, smem, &smem_set);
    const attn_batch *b = a.b;
    cudaLaunchConfig_t cfg = {};
    const int groups = (a.NC + CPC - 1) / CPC, pairs = a.Ts * (a.H / G);
    cfg.gridDim = dim3(a.Ts, a.H / G, CS); // for the occupancy query; z set below
    cfg.blockDim = dim3(SPB * G / GW * 32);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = cuda_stream();
    cudaLaunchAttribute attr[2];
    attr[0] = cuda_cluster_attr(1, 1, CS);
    attr[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[1].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 2;
    if (smem > smem_checked) {
        if (CS > 8)
            CUDA_CHECK(
                cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
        if (cudaOccupancyMaxActiveClusters(&max_active, kernel, &cfg) != cudaSuccess)
            max_active = 0;
        cudaGetLastError(); // not sticky: clear it
        smem_checked = smem;
    }
    if (max_active <= 0) return false;
    int zc = ATTN_CLUSTER_WAVES * max_active / pairs;
    zc = zc < 1 ? 1 : zc > groups ? groups : zc;
    cfg.gridDim.z = zc * CS;
    CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, a.out, a.part_o, a.part_ml, a.cnt, a.q,
                                  (const KV *)a.kv.k, (const KV *)a.kv.v, (const int32_t *)b->pos,
                                  (const int32_t *)b->seq, (const int32_t *)b->page_table, a.t0,
                                  b->T, a.H, a.Hkv, b->max_pages, b->page_size, a.NC, a.scale));
    return true;
}

template <int DH, int G, class KV> static void launch_chunks(const attn_args &a, int tile_qt) {
    const dim3 grid(a.Ts, a.H / G, a.NC);
    const attn_batch *b = a.b;
    attn_chunk_kernel<DH, G, attn_min_blocks<DH, G, KV>(), KV>
        <<<grid, ATTN_THREADS, 0, cuda_stream()>>>(a.part_o, a.part_ml, a.q, (const KV *)a.kv.k,
                                                   (const KV *)a.kv.v, b->pos, b->seq,
                                                   b->page_table, a.t0, a.Ts, tile_qt, a.H, a.Hkv,
                                                   b->max_pages, b->page_size, a.NC, a.scale);
    CUDA_CHECK_LAUNCH();
}

template <int DH, int G, class KV> static void launch_tiles(const attn_args &a) {
    constexpr int QT = ATTN_TILE_ROWS / G;
    if (a.Ts < QT) return;
    auto kernel = attn_tile_kernel<DH, G, KV>;
    static size_t smem_set = 0;
    const size_t smem = ((size_t)ATTN_TILE_ROWS * DH + (size_t)ATTN_CHUNK * ATTN_TILE_ROWS +
                         (size_t)2 * ATTN_SLICE * DH) * sizeof(float);
    cuda_smem_allow(kernel, smem, &smem_set);
    const attn_batch *b = a.b;
    const int zc = a.NC < ATTN_TILE_ZC ? a.NC : ATTN_TILE_ZC;
    kernel<<<dim3(a.Ts / QT, a.H / G, zc), ATTN_TILE_THREADS, smem, cuda_stream()>>>(
        a.part_o, a.part_ml, a.q, (const KV *)a.kv.k, (const KV *)a.kv.v, b->pos, b->seq,
        b->page_table, a.t0, a.Ts, a.H, a.Hkv, b->max_pages, b->page_size, a.NC, a.scale);
    CUDA_CHECK_LAUNCH();
}

static size_t g_combine_smem_set = 48 << 10; // one kernel for every shape: one limit

enum attn_path { ATTN_PATH_SLICES, ATTN_PATH_CHUNKS, ATTN_PATH_TILES, ATTN_PATH_CLUSTERS };

template <int DH, int G, class KV> static void launch_path_kv(attn_path path, const attn_args &a) {
    switch (path) {
    case ATTN_PATH_SLICES: launch_slices<DH, G, KV>(a); return;
    case ATTN_PATH_CLUSTERS:
        if (!launch_clusters<DH, G, KV>(a)) launch_slices<DH, G, KV>(a);
        return;
    case ATTN_PATH_TILES:
        launch_tiles<DH, G, KV>(a);
        launch_chunks<DH, G, KV>(a, ATTN_TILE_ROWS / G);
        break;
    case ATTN_PATH_CHUNKS: launch_chunks<DH, G, KV>(a, 0); break;
    }
    const size_t combine_smem = ((size_t)a.NC * G + G) * sizeof(float);
    cuda_smem_allow(attn_combine_kernel, combine_smem, &g_combine_smem_set);
    attn_combine_kernel<<<dim3(a.Ts, a.H / G), ATTN_COMBINE_THREADS, combine_smem, cuda_stream()>>>(
        a.out, a.part_o, a.part_ml, a.b->pos, a.t0, a.H, G, DH, a.NC);
    CUDA_CHECK_LAUNCH();
}

// The cache's element type (kv_types.cuh) as a template argument.
template <int DH, int G> static void launch_path(attn_path path, const attn_args &a) {
    if (a.kv.bf16)
        launch_path_kv<DH, G, __nv_bfloat16>(path, a);
    else
        launch_path_kv<DH, G, float>(path, a);
}

template <int DH> static void launch_dh(int G, attn_path path, const attn_args &a) {
    switch (G) {
    case 1: launch_path<DH, 1>(path, a); break;
    case 2: launch_path<DH, 2>(path, a); break;
    case 4: launch_path<DH, 4>(path, a); break;
    case 8: launch_path<DH, 8>(path, a); break;
    default:
        if constexpr (16 * DH <= 2048) {
            launch_path<DH, 16>(path, a);
            break;
        }
        cuda_fail(__FILE__, __LINE__, "attention", "no kernel for this head group");
    }
}

// Query heads per block: the largest of 16, 8, 4, 2, 1 that divides H / Hkv and keeps G * Dh
// accumulators within 64 registers a lane. Fixed by the shapes only.
static int heads_per_block(int group, int Dh) {
    for (int G = 16; G > 1; G /= 2)
        if (group % G == 0 && G * Dh <= 2048) return G;
    return 1;
}

// Which path the tests and the benchmark ask for: -1 the usual choice, else an attn_path. Any path
// gives bit-identical results; this only lets the test check that and time each one.
static int g_path_forced = -1;
extern "C" void cuda_attention_debug_path(int path) { g_path_forced = path; }

void cuda_attention(float *out, const float *q, kv_layer kv, const attn_batch *b, int H, int Hkv,
                    int Dh, float scale) {
    const int T = b->T;
    if (T <= 0) return;
    if (Hkv <= 0 || H % Hkv != 0)
        cuda_fail(__FILE__, __LINE__, "attention", "H must be a multiple of Hkv");
    if (Dh != 16 && Dh != 32 && Dh != 64 && Dh != 128 && Dh != 256)
        cuda_fail(__FILE__, __LINE__, "attention", "head dim must be 16, 32, 64, 128 or 256");
    if (((uintptr_t)q | (uintptr_t)out | (uintptr_t)kv.k | (uintptr_t)kv.v) % 16 != 0)
        cuda_fail(__FILE__, __LINE__, "attention", "q, out, k and v must be 16-byte aligned");
    const int G = heads_per_block(H / Hkv, Dh);
    const int64_t max_pos = (int64_t)b->max_pages * b->page_size;
    const int NC = (int)((max_pos + ATTN_CHUNK - 1) / ATTN_CHUNK); // chunks a token may have
    if (NC < 1 || NC > 65535)
        cuda_fail(__FILE__, __LINE__, "attention", "max_pages * page_size out of range");

    // The path, from T and the shapes only: slices where the batch is too small to fill the device
    // with chunks (and the in-launch combine fits shared memory), else chunks and tiles.
    const bool slices_fit =
        (int64_t)NC * ATTN_SLICES <= 65535 && slice_smem(Dh, G, NC) <= ((size_t)160 << 10);
    attn_path path = T > ATTN_SMALL_T || !slices_fit ? ATTN_PATH_TILES
                     : T <= ATTN_CLUSTER_T           ? ATTN_PATH_CLUSTERS
                                                     : ATTN_PATH_SLICES;
    if (g_path_forced >= 0) path = (attn_path)g_path_forced;
    const bool small = path == ATTN_PATH_SLICES || path == ATTN_PATH_CLUSTERS;
    if (small && !slices_fit) path = ATTN_PATH_CHUNKS;

    // workspace per token: every head group's chunk results, and for slices each slice's (for
    // clusters too: the slice kernel stands in where no cluster fits)
    const size_t chunk_res = (size_t)(H / G) * NC * G * (Dh + 2);
    const size_t per_token =
        (chunk_res * (small && slices_fit ? 1 + ATTN_SLICES : 1)) * sizeof(float);
    int slice = (int)(ATTN_WORKSPACE_CAP / per_token);
    if (slice < 1) slice = 1;
    if (slice > T) slice = T;
    if (slice > 65535) slice = 65535;
    if (slice > ATTN_TILE_ROWS) slice -= slice % ATTN_TILE_ROWS; // whole tiles in a slice
    while (!ws_reserve((size_t)slice * per_token)) {
        if (slice == 1)
            cuda_fail(__FILE__, __LINE__, "attention", "out of device memory for the workspace");
        slice = (slice + 1) / 2;
    }
    attn_args a = {};
    a.out = out;
    a.part_o = g_ws;
    a.part_ml = a.part_o + (size_t)slice * (H / G) * NC * G * Dh;
    if (path == ATTN_PATH_SLICES || path == ATTN_PATH_CLUSTERS) {
        a.slice_o = a.part_ml + (size_t)slice * (H / G) * NC * 2 * G;
        a.slice_ml = a.slice_o + (size_t)slice * (H / G) * NC * ATTN_SLICES * G * Dh;
        cnt_reserve((size_t)slice * (H / G) * (NC + 1));
        a.cnt = g_cnt;
    }
    a.q = q;
    a.kv = kv;
    a.b = b;
    a.H = H;
    a.Hkv = Hkv;
    a.NC = NC;
    a.scale = scale;
    for (int t0 = 0; t0 < T; t0 += slice) {
        a.t0 = t0;
        a.Ts = T - t0 < slice ? T - t0 : slice;
        switch (Dh) {
        case 16: launch_dh<16>(G, path, a); break;
        case 32: launch_dh<32>(G, path, a); break;
        case 64: launch_dh<64>(G, path, a); break;
        case 128: launch_dh<128>(G, path, a); break;
        case 256: launch_dh<256>(G, path, a); break;
        }
    }
}
