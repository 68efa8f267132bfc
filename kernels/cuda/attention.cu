// Paged causal attention over the KV cache (kernels/ops.h: attention), split over the KV sequence
// in chunks of a fixed size. The CPU reference is kernels/cpu/attention.c.
//
// Choices:
// - Each token's KV range 0..pos[t] is cut into chunks of ATTN_CHUNK positions, a constant. Kernel 1
//   (attn_chunk_kernel) computes, for one (token, head group, chunk), each head's chunk max score m,
//   sum of exp(s - m) l and unnormalized weighted V sum o, all in fp32. Kernel 2
//   (attn_combine_kernel) combines a token's chunks in increasing order: M = max m_c,
//   L = sum_c l_c exp(m_c - M), out = sum_c exp(m_c - M) o_c / L.
// - Nothing in a token's arithmetic depends on anything but its own q, sequence and position: the
//   chunking, the positions each lane and warp takes, every reduction tree and the combine order are
//   fixed by the shapes (Dh, H / Hkv). So a token's output is bit-identical alone or in any batch,
//   and one kernel serves prefill chunks and decode steps alike: prefill and decode of the same
//   position give bit-identical results (the deterministic-mode contract). The price: a prefill
//   chunk of many tokens of one sequence reads the same KV once per token (from L2 mostly, as the
//   grid puts a sequence's consecutive tokens next to each other); a query-tiled prefill path that
//   keeps this arithmetic is left for later.
// - GQA: one block serves G query heads that share one kv head (G = H / Hkv, or a divisor of it when
//   G * Dh would not fit the registers), so each K/V row is read once per group.
// - Inside a chunk: a warp takes 32 contiguous positions and goes through them on its own (no
//   block barrier until its partial sums are done). Scores: 8 lanes share a position (16-byte
//   loads, coalesced), each lane runs a sequential fma chain over its elements, then a 3-step xor
//   butterfly; q comes from shared memory. Softmax over the warp's positions (m_w, l_w), the warp's
//   first V rows already requested. Weighted V: lanes own head-dim slices (one 16-byte load per lane
//   per row), positions in increasing order. The block then merges its warps in warp order:
//   m = max m_w, o = sum_w exp(m_w - m) o_w, l likewise.
// - Speed (H200, Qwen3-30B-A3B's H 32, Hkv 4, Dh 128, fp32 KV): decode reads the cache at about
//   70% of the device copy rate (read + write) from batch 64 up; see tests/test_cuda_attention.c
//   --bench. Three blocks a multiprocessor (80 registers) beat two; requesting the next batch of
//   rows before computing on the current one (two register buffers, two blocks) was slower, and
//   the softmax over the whole chunk behind block barriers was about 9% slower at large batch.
// - Positions live on the device and are not read back: the grid is sized from the upper bound
//   max_pages * S / ATTN_CHUNK chunks per token; blocks past a token's length exit at once. The chunk
//   results go to a workspace that grows on demand (stream-ordered); a batch whose workspace would pass
//   ATTN_WORKSPACE_CAP is processed in slices of tokens, which changes no token's result.
// - One engine thread per process calls the ops, so the workspace needs no lock.
#include <cstdint>
#include <cstdio>

#include "kernels/cuda/cuda_ops.h"

enum {
    ATTN_CHUNK = 256,              // KV positions per chunk: fixed, never chosen by T
    ATTN_WARPS = 8,                // warps per chunk block
    ATTN_THREADS = ATTN_WARPS * 32,
    ATTN_WARP_POS = ATTN_CHUNK / ATTN_WARPS, // positions of a chunk each warp takes
    ATTN_COMBINE_THREADS = 256,
};
static const size_t ATTN_WORKSPACE_CAP = (size_t)256 << 20; // bytes of chunk results per slice

// The lane layout of a chunk block for head dim DH; a warp requests DEPTH 16-byte pieces a lane
// at once (K rows in the scores, V rows in the weighted sum).
template <int DH> struct attn_layout {
    static constexpr int DEPTH = 8;
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
// V rows in flight, or K rows in flight and the scores).
template <int DH, int G> constexpr int attn_min_blocks() {
    using L = attn_layout<DH>;
    constexpr int rv = 4 * L::FV * (G + L::UV), rk = 4 * L::FK * L::UK + G;
    constexpr int regs = rv > rk ? rv : rk;
    return regs <= 64 ? 3 : regs <= 96 ? 2 : 1;
}

static __device__ __forceinline__ void fma4(float &acc, float4 a, float4 b) {
    acc = fmaf(a.x, b.x, acc);
    acc = fmaf(a.y, b.y, acc);
    acc = fmaf(a.z, b.z, acc);
    acc = fmaf(a.w, b.w, acc);
}

// One (token t0 + blockIdx.x, head group blockIdx.y, chunk blockIdx.z).
//   part_o  [Ts, H / G, NC, G, DH]  unnormalized weighted V of each chunk
//   part_ml [Ts, H / G, NC, 2, G]   chunk max score m, then sum of exp l
//   q [T, H, DH], kc / vc [P, S, Hkv, DH], pos / seq [T], page_table [n_seq, max_pages]
template <int DH, int G, int MINB>
__global__ void __launch_bounds__(ATTN_THREADS, MINB)
    attn_chunk_kernel(float *__restrict__ part_o, float *__restrict__ part_ml,
                      const float *__restrict__ q, const float *__restrict__ kc,
                      const float *__restrict__ vc, const int32_t *__restrict__ pos,
                      const int32_t *__restrict__ seq, const int32_t *__restrict__ page_table,
                      int t0, int H, int Hkv, int max_pages, int S, int NC, float scale) {
    using L = attn_layout<DH>;
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
    if (p0 >= n) return;
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
    const int64_t rs = (int64_t)Hkv * DH; // floats per cache row
    const float *kg = kc + (int64_t)g * DH;
    const float *vg = vc + (int64_t)g * DH;
    const int wbeg = w * ATTN_WARP_POS, wend = min(wbeg + ATTN_WARP_POS, nv);
    const int nkb = wbeg < wend ? (wend - wbeg + KSTEP - 1) / KSTEP : 0; // K batches
    const int nvb = wbeg < wend ? (wend - wbeg + VSTEP - 1) / VSTEP : 0; // V batches

    // scores: LK lanes share a position, lane `sub` takes pieces sub, sub + LK, ...
    const int sub = lane % LK, pp = lane / LK;
    const float4 *q4 = reinterpret_cast<const float4 *>(buf);
    auto load_k = [&](float4(&kr)[UK][FK], int i0) {
#pragma unroll
        for (int u = 0; u < UK; u++) {
            const int i = i0 + u * PK + pp;
            const float4 *kp =
                reinterpret_cast<const float4 *>(kg + (int64_t)rows[i < wend ? i : wbeg] * rs);
#pragma unroll
            for (int f = 0; f < FK; f++)
                kr[u][f] = i < wend ? __ldg(kp + f * LK + sub) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
    };
    // s[p][h] = (q_h . k_p) * scale: a sequential fma chain over the lane's pieces, then an xor
    // butterfly over the LK lanes (the same sum in each)
    auto score = [&](const float4(&kr)[UK][FK], int i0) {
#pragma unroll
        for (int u = 0; u < UK; u++) {
            float acc[G];
#pragma unroll
            for (int h = 0; h < G; h++) {
                acc[h] = 0.0f;
#pragma unroll
                for (int f = 0; f < FK; f++)
                    fma4(acc[h], q4[h * (DH / 4) + f * LK + sub], kr[u][f]);
            }
#pragma unroll
            for (int off = LK / 2; off > 0; off /= 2)
#pragma unroll
                for (int h = 0; h < G; h++)
                    acc[h] += __shfl_xor_sync(0xffffffffu, acc[h], off);
            const int i = i0 + u * PK + pp;
            if (i < wend) {
#pragma unroll
                for (int h = 0; h < G; h++)
                    if (h % LK == sub) s[i * G + h] = acc[h] * scale;
            }
        }
    };
    // weighted V: LV lanes share a row, lane group rv takes rows wbeg + rv, + RV, ...
    const int subv = lane % LV, rv = lane / LV;
    auto load_v = [&](float4(&vr)[UV][FV], int i0) {
#pragma unroll
        for (int u = 0; u < UV; u++) {
            const int i = i0 + u * RV + rv;
            const float4 *vp =
                reinterpret_cast<const float4 *>(vg + (int64_t)rows[i < wend ? i : wbeg] * rs);
#pragma unroll
            for (int f = 0; f < FV; f++)
                vr[u][f] = i < wend ? __ldg(vp + f * LV + subv) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
    };
    float4 acc[G][FV];
#pragma unroll
    for (int h = 0; h < G; h++)
#pragma unroll
        for (int f = 0; f < FV; f++)
            acc[h][f] = make_float4(0.f, 0.f, 0.f, 0.f);
    auto accumulate = [&](const float4(&vr)[UV][FV], int i0) {
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
                for (int h = 0; h < G; h++)
#pragma unroll
                    for (int f = 0; f < FV; f++) {
                        acc[h][f].x = fmaf(e[h], vr[u][f].x, acc[h][f].x);
                        acc[h][f].y = fmaf(e[h], vr[u][f].y, acc[h][f].y);
                        acc[h][f].z = fmaf(e[h], vr[u][f].z, acc[h][f].z);
                        acc[h][f].w = fmaf(e[h], vr[u][f].w, acc[h][f].w);
                    }
            }
        }
    };

    // ---- scores of the warp's positions; then its first V rows are requested, to arrive during
    // the softmax ----
    for (int j = 0; j < nkb; j++) {
        float4 kr[UK][FK];
        load_k(kr, wbeg + j * KSTEP);
        score(kr, wbeg + j * KSTEP);
    }
    float4 vr[UV][FV];
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
                        x = make_float4(fw * a.x, fw * a.y, fw * a.z, fw * a.w);
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

// The chunk results of one slice of tokens: grown on demand, in stream order.
static float *g_ws;
static size_t g_ws_bytes;

static bool ws_reserve(size_t bytes) {
    if (bytes <= g_ws_bytes) return true;
    cudaStream_t st = cuda_stream();
    if (g_ws) CUDA_CHECK(cudaFreeAsync(g_ws, st));
    cuda_workspace_changed(); /* graphs that used the old buffer are stale */
    g_ws = nullptr;
    g_ws_bytes = 0;
    void *p = nullptr;
    if (cudaMallocAsync(&p, bytes, st) != cudaSuccess) {
        cudaGetLastError(); // not sticky: clear it
        return false;
    }
    g_ws = static_cast<float *>(p);
    g_ws_bytes = bytes;
    return true;
}

template <int DH, int G>
static void launch_chunks(float *part_o, float *part_ml, const float *q, kv_layer kv,
                          const attn_batch *b, int t0, int Ts, int H, int Hkv, int NC,
                          float scale) {
    const dim3 grid(Ts, H / G, NC);
    attn_chunk_kernel<DH, G, attn_min_blocks<DH, G>()><<<grid, ATTN_THREADS, 0, cuda_stream()>>>(
        part_o, part_ml, q, kv.k, kv.v, b->pos, b->seq, b->page_table, t0, H, Hkv, b->max_pages,
        b->page_size, NC, scale);
    CUDA_CHECK_LAUNCH();
}

template <int DH>
static void launch_chunks_dh(int G, float *part_o, float *part_ml, const float *q, kv_layer kv,
                             const attn_batch *b, int t0, int Ts, int H, int Hkv, int NC,
                             float scale) {
    switch (G) {
    case 1: launch_chunks<DH, 1>(part_o, part_ml, q, kv, b, t0, Ts, H, Hkv, NC, scale); break;
    case 2: launch_chunks<DH, 2>(part_o, part_ml, q, kv, b, t0, Ts, H, Hkv, NC, scale); break;
    case 4: launch_chunks<DH, 4>(part_o, part_ml, q, kv, b, t0, Ts, H, Hkv, NC, scale); break;
    case 8: launch_chunks<DH, 8>(part_o, part_ml, q, kv, b, t0, Ts, H, Hkv, NC, scale); break;
    default:
        if constexpr (16 * DH <= 2048) {
            launch_chunks<DH, 16>(part_o, part_ml, q, kv, b, t0, Ts, H, Hkv, NC, scale);
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

    // workspace per token: every head group's chunk results
    const size_t per_token = (size_t)(H / G) * NC * G * (Dh + 2) * sizeof(float);
    int slice = (int)(ATTN_WORKSPACE_CAP / per_token);
    if (slice < 1) slice = 1;
    if (slice > T) slice = T;
    if (slice > 65535) slice = 65535;
    while (!ws_reserve((size_t)slice * per_token)) {
        if (slice == 1)
            cuda_fail(__FILE__, __LINE__, "attention", "out of device memory for the workspace");
        slice = (slice + 1) / 2;
    }
    float *part_o = g_ws;
    float *part_ml = g_ws + (size_t)slice * (H / G) * NC * G * Dh;

    const size_t combine_smem = ((size_t)NC * G + G) * sizeof(float);
    static size_t combine_smem_set = 48 << 10;
    if (combine_smem > combine_smem_set) {
        CUDA_CHECK(cudaFuncSetAttribute(attn_combine_kernel,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        (int)combine_smem));
        combine_smem_set = combine_smem;
    }

    for (int t0 = 0; t0 < T; t0 += slice) {
        const int Ts = T - t0 < slice ? T - t0 : slice;
        switch (Dh) {
        case 16: launch_chunks_dh<16>(G, part_o, part_ml, q, kv, b, t0, Ts, H, Hkv, NC, scale); break;
        case 32: launch_chunks_dh<32>(G, part_o, part_ml, q, kv, b, t0, Ts, H, Hkv, NC, scale); break;
        case 64: launch_chunks_dh<64>(G, part_o, part_ml, q, kv, b, t0, Ts, H, Hkv, NC, scale); break;
        case 128: launch_chunks_dh<128>(G, part_o, part_ml, q, kv, b, t0, Ts, H, Hkv, NC, scale); break;
        case 256: launch_chunks_dh<256>(G, part_o, part_ml, q, kv, b, t0, Ts, H, Hkv, NC, scale); break;
        }
        attn_combine_kernel<<<dim3(Ts, H / G), ATTN_COMBINE_THREADS, combine_smem, cuda_stream()>>>(
            out, part_o, part_ml, b->pos, t0, H, G, Dh, NC);
        CUDA_CHECK_LAUNCH();
    }
}
