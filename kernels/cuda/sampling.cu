// Scoring and sampling on the device (kernels/ops.h: sample), so that only tokens, logprobs and
// top-N logprobs come back instead of every logit row. The reference is runner/sampler.c (the draw)
// with sampler_log_softmax and the engine's top-N selection (the logprobs).
//
// Choices:
// - One block of 1024 threads per row (V is about 152k for Qwen3: ~150 elements a thread a pass).
//   Everything a row computes depends only on that row and its parameters: no atomics across
//   blocks, and every reduction is either exact (integers, max, min) or a fixed tree (the one
//   double sum of the logprob normalizer), so results are the same bits run after run and in any
//   batch.
// - Logprobs: max and its lowest id, then sum of exp(x - max) over the row in double, as
//   sampler_log_softmax does (exp is computed in double and rounded to float, which is what glibc's
//   expf returns but for rare last-bit cases). Top-N: a sorted list per thread, merged per warp,
//   then across warps; then re-sorted by (logprob desc, id asc), the CPU's order.
// - Penalties, then the logit bias, go to a copy of the row in the workspace (the caller's logits
//   stay as they were, so the logprobs read them), with the CPU's float operations in the CPU's
//   order (no fused multiply-add).
// - Greedy (temperature below OPS_SAMPLE_GREEDY_EPS, or top_k 1) is the exact argmax, lowest id on
//   ties. Otherwise each token's e = exp(x / T - max) (float, the largest exactly 1) becomes a key:
//   its float bits, which order like integers because e > 0. The descending order of the keys,
//   ties by id, is the CPU sampler's order. Each filter is a cut point in that order, and each cut
//   is found by a radix descent over the key bits in three digits of 10 bits: histograms of count
//   and mass per digit (the first digit's histogram made once with the keys, the two others by a
//   pass over the keys restricted to the bucket chosen so far), each scanned in descending order
//   to find the bucket holding the target; the last digit gives the exact key, and the position
//   among equal keys follows by arithmetic (they weigh the same), the token by the lowest id (or,
//   for a later tie, a pass that counts ids in order).
// - Masses are fixed point: round(e * 2^S) in 64-bit integers, S = 63 - bits(V) so that V of them
//   cannot overflow; the error is below 2^-S per token against a largest e of 1 (about 3e-14 for
//   V = 152k). Integer sums do not depend on the order of the atomics, which is what makes the
//   histograms deterministic, and the draw's target floor(u * kept) + 1 is exact, so the draw
//   always lands inside the kept set. The CPU sums in double in its own order; the two agree
//   except where u * kept falls within rounding of a token's boundary.
// - Order of the filters as on the CPU: top-k (a count target), top-p over the top-k mass
//   (target ceil((top_p - slack) * mass)), min-p (the tokens with e >= min_p, counted with the
//   keys: the largest e is 1, and they form a prefix of the order), then the draw at floor(u *
//   kept) + 1 with u from common/counter_rng.h.
// - The workspace ([n, V rounded up to 4] words: the penalized copy, then the keys) grows on demand
//   in stream order; one engine thread calls the ops, so it needs no lock.
// - Speed (H200, V = 151936, tests/test_cuda_sampling.c), for 1 / 64 / 256 rows: greedy 0.018 /
//   0.019 / 0.047 ms (256 rows read at about 3.3 TB/s); greedy, logprob and top-5 0.13 / 0.14 /
//   0.38 ms; temperature and top-p 0.31 / 0.32 / 0.71 ms; top-k, top-p, min-p, penalties, logprob
//   and top-5 0.53 / 0.57 / 1.31 ms. Copying the rows to the host alone: 0.09 / 3.7 / 14.6 ms.
//   One row is one SM's work, so a single row is latency-bound (each pass about 30-50 us); rows
//   split over a cluster of blocks would be the next step for batch 1.
#include <cfloat>
#include <climits>
#include <cmath>
#include <cstdint>

#include "common/counter_rng.h"
#include "kernels/cuda/cuda_ops.h"

namespace {

constexpr int SB = 1024;    // threads per block, one block per row
constexpr int NW = SB / 32; // warps per block: also the lanes of a reduction's last step
constexpr int NBINS = 1024; // a radix digit of 10 bits: one bin per thread
constexpr int TOPN = OPS_SAMPLE_TOP_N_MAX;
constexpr int LOADS = 4; // 16-byte key loads a thread issues at once in a descent's passes
constexpr unsigned FULL = 0xffffffffu;
constexpr uint32_t KEY_ONE = 0x3f800000u; // the bits of 1.0f, the largest key
typedef unsigned long long u64;

static_assert(NBINS == SB, "one bin per thread");
static_assert(NW == 32, "a reduction's last step takes one warp");

struct sample_smem {
    uint32_t cnt1[NBINS]; // first digit (key >> 20): tokens per bucket, kept across queries
    u64 mass1[NBINS];     // and their fixed-point mass
    uint32_t cnt[NBINS];  // second or third digit of the current query
    u64 mass[NBINS];
    uint32_t minid[NBINS]; // third digit: lowest id per key
    float tn_v[NW][TOPN];  // each warp's top N
    int32_t tn_i[NW][TOPN];
    float fin_v[TOPN]; // the row's top N
    int32_t fin_i[TOPN];
    float red_f[NW];
    int32_t red_i[NW];
    double red_d[NW];
    u64 red_u64[NW];
    uint32_t red_u32[NW];
    uint32_t sel_bin, sel_ca, sel_found, sel_tok;
    u64 sel_ma;
};

// (va, ia) comes before (vb, ib): larger value, then lower id.
__device__ __forceinline__ bool better(float va, int ia, float vb, int ib) {
    return va > vb || (va == vb && ia < ib);
}

__device__ __forceinline__ void warp_argmax(float &v, int &i) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float v2 = __shfl_xor_sync(FULL, v, o);
        const int i2 = __shfl_xor_sync(FULL, i, o);
        if (better(v2, i2, v, i)) {
            v = v2;
            i = i2;
        }
    }
}

// Every thread gets the block's best (v, i).
__device__ void block_argmax(float &v, int &i, sample_smem &s) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    warp_argmax(v, i);
    if (lane == 0) {
        s.red_f[warp] = v;
        s.red_i[warp] = i;
    }
    __syncthreads();
    v = s.red_f[lane];
    i = s.red_i[lane];
    warp_argmax(v, i);
    __syncthreads();
}

// Every thread gets the block's sum; xor butterflies, so the tree (and a double's rounding) is
// fixed and every lane holds the same value.
template <typename U> __device__ U block_sum(U x, U *red) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        x += __shfl_xor_sync(FULL, x, o);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = x;
    __syncthreads();
    x = red[threadIdx.x & 31];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        x += __shfl_xor_sync(FULL, x, o);
    __syncthreads();
    return x;
}

// Inclusive scan over the threads in index order (integers).
template <typename U> __device__ U block_incl_scan(U x, U *red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const U y = __shfl_up_sync(FULL, x, o);
        if (lane >= o) x += y;
    }
    if (lane == 31) red[warp] = x;
    __syncthreads();
    U base = 0;
    for (int w = 0; w < warp; w++)
        base += red[w];
    __syncthreads();
    return x + base;
}

// Four consecutive elements q*4 .. q*4+3 of a row (NaN past V). vec: the row is 16-byte aligned and
// readable up to a multiple of 4 elements.
__device__ __forceinline__ float4 load4(const float *x, int q, int V, bool vec) {
    if (vec) return reinterpret_cast<const float4 *>(x)[q];
    const int i = q << 2;
    float4 v;
    v.x = i < V ? x[i] : NAN;
    v.y = i + 1 < V ? x[i + 1] : NAN;
    v.z = i + 2 < V ? x[i + 2] : NAN;
    v.w = i + 3 < V ? x[i + 3] : NAN;
    return v;
}

// f(i, x[i]) for each element of the row this thread owns (groups of four, strided by the block):
// the same mapping whether or not the loads are vectorized.
template <typename F>
__device__ __forceinline__ void for_row(const float *x, int V, bool vec, F f) {
    const int n4 = (V + 3) >> 2;
#pragma unroll 2
    for (int q = threadIdx.x; q < n4; q += SB) {
        const float4 v = load4(x, q, V, vec);
        const int i = q << 2;
        f(i, v.x);
        if (i + 1 < V) f(i + 1, v.y);
        if (i + 2 < V) f(i + 2, v.z);
        if (i + 3 < V) f(i + 3, v.w);
    }
}

// Fixed-point mass of a key (the bits of e in (0, 1]).
__device__ __forceinline__ u64 key_mass(uint32_t key, double scale) {
    return __double2ull_rn((double)__uint_as_float(key) * scale);
}

// The bin of this digit (count or mass, in descending key order, with ca0 / ma0 tokens and mass
// above the bucket) that holds the target-th unit; thread t holds bin NBINS - 1 - t's c and m.
// Leaves s.sel_found (0: the target is past the level's total), s.sel_bin, s.sel_ca, s.sel_ma
// (count and mass above that bin, the bucket's above included).
__device__ void select_bin(sample_smem &s, uint32_t c, u64 m, u64 target, bool by_mass,
                           uint32_t ca0, u64 ma0) {
    const int tid = threadIdx.x;
    if (tid == 0) s.sel_found = 0;
    const uint32_t ci = block_incl_scan<uint32_t>(c, s.red_u32);
    const u64 mi = block_incl_scan<u64>(m, s.red_u64);
    const uint32_t ca = ca0 + (ci - c);
    const u64 ma = ma0 + (mi - m);
    const u64 above = by_mass ? ma : (u64)ca, here = by_mass ? m : (u64)c;
    if (above < target && target - above <= here) {
        s.sel_bin = NBINS - 1 - tid;
        s.sel_ca = ca;
        s.sel_ma = ma;
        s.sel_found = 1;
    }
    __syncthreads();
}

// Where the cumulative count (or mass) of the descending order first reaches target: the key
// there, the tokens and mass above that key, the rank t (from 1) among the tokens of that key, and
// the lowest id holding it. found = false when the target exceeds the row's total.
struct pick {
    uint32_t key, t, minid, cnt_above;
    u64 mass_above;
    bool found;
};

__device__ __forceinline__ void bin_add(sample_smem &s, uint32_t k, int i, uint32_t prefix,
                                        int shift, double scale) {
    if (k != 0u && (k >> (shift + 10)) == prefix) {
        const uint32_t b = (k >> shift) & (NBINS - 1);
        atomicAdd(&s.cnt[b], 1u);
        atomicAdd(&s.mass[b], key_mass(k, scale));
        if (shift == 0) atomicMin(&s.minid[b], (uint32_t)i);
    }
}

__device__ __noinline__ pick descend(sample_smem &s, const uint32_t *keys, int Vp, u64 target,
                                     bool by_mass, double scale) {
    const int tid = threadIdx.x;
    pick q = {};
    select_bin(s, s.cnt1[NBINS - 1 - tid], s.mass1[NBINS - 1 - tid], target, by_mass, 0, 0);
    bool found = s.sel_found;
    uint32_t prefix = s.sel_bin, ca = s.sel_ca;
    u64 ma = s.sel_ma;
    __syncthreads(); // everyone has read sel_* before anyone writes them again
    if (!found) return q;
    for (int level = 0; level < 2; level++) {
        const int shift = level == 0 ? 10 : 0;
        s.cnt[tid] = 0;
        s.mass[tid] = 0;
        s.minid[tid] = UINT32_MAX;
        __syncthreads();
        const int n4 = Vp >> 2;
        for (int q0 = tid; q0 < n4; q0 += SB * LOADS) {
            uint4 k[LOADS];
#pragma unroll
            for (int u = 0; u < LOADS; u++)
                if (q0 + u * SB < n4) k[u] = reinterpret_cast<const uint4 *>(keys)[q0 + u * SB];
#pragma unroll
            for (int u = 0; u < LOADS; u++) {
                if (q0 + u * SB >= n4) break;
                const int i = (q0 + u * SB) << 2;
                bin_add(s, k[u].x, i, prefix, shift, scale);
                bin_add(s, k[u].y, i + 1, prefix, shift, scale);
                bin_add(s, k[u].z, i + 2, prefix, shift, scale);
                bin_add(s, k[u].w, i + 3, prefix, shift, scale);
            }
        }
        __syncthreads();
        const int b = NBINS - 1 - tid;
        select_bin(s, s.cnt[b], s.mass[b], target, by_mass, ca, ma);
        found = s.sel_found;
        const uint32_t sb = s.sel_bin;
        ca = s.sel_ca;
        ma = s.sel_ma;
        if (level == 1 && found) q.minid = s.minid[sb];
        __syncthreads();
        if (!found) return q; // not reached: the target lies inside the bucket chosen above
        prefix = prefix << 10 | sb;
    }
    q.key = prefix;
    q.cnt_above = ca;
    q.mass_above = ma;
    const u64 w = by_mass ? key_mass(q.key, scale) : 1, above = by_mass ? ma : (u64)ca;
    q.t = (uint32_t)((target - above + w - 1) / w);
    q.found = true;
    return q;
}

// The t-th lowest id (t >= 1) whose key is key: each thread counts a contiguous slice of ids,
// a scan finds the slice, its thread walks it.
__device__ __noinline__ int tie_select(sample_smem &s, const uint32_t *keys, int Vp, uint32_t key,
                                       uint32_t t) {
    const int tid = threadIdx.x, C = (Vp + SB - 1) / SB;
    const int lo = min(tid * C, Vp), hi = min(lo + C, Vp);
    uint32_t c = 0;
    for (int i = lo; i < hi; i++)
        c += keys[i] == key;
    if (tid == 0) s.sel_tok = 0;
    const uint32_t ci = block_incl_scan<uint32_t>(c, s.red_u32);
    if (ci - c < t && t <= ci) {
        uint32_t need = t - (ci - c);
        for (int i = lo; i < hi; i++)
            if (keys[i] == key && --need == 0) {
                s.sel_tok = (uint32_t)i;
                break;
            }
    }
    __syncthreads();
    const int tok = (int)s.sel_tok;
    __syncthreads();
    return tok;
}

// Merge the threads' sorted top-N lists (tv, ti) into s.fin_v / s.fin_i: per warp, then warp 0
// over the warps' lists.
__device__ __noinline__ void top_n_merge(sample_smem &s, const float *tv, const int *ti, int N) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int h = 0;
    for (int k = 0; k < N; k++) {
        const float v = h < N ? tv[h] : -INFINITY;
        const int id = h < N ? ti[h] : INT_MAX;
        float bv = v;
        int bi = id;
        warp_argmax(bv, bi);
        if (h < N && id == bi) h++;
        if (lane == 0) {
            s.tn_v[warp][k] = bv;
            s.tn_i[warp][k] = bi;
        }
    }
    __syncthreads();
    if (warp == 0) {
        h = 0;
        for (int k = 0; k < N; k++) {
            const float v = h < N ? s.tn_v[lane][h] : -INFINITY;
            const int id = h < N ? s.tn_i[lane][h] : INT_MAX;
            float bv = v;
            int bi = id;
            warp_argmax(bv, bi);
            if (h < N && id == bi) h++;
            if (lane == 0) {
                s.fin_v[k] = bv;
                s.fin_i[k] = bi;
            }
        }
    }
    __syncthreads();
}

__global__ void __launch_bounds__(SB, 1)
    sample_kernel(int32_t *tokens, float *logprobs, int32_t *top_ids, float *top_lps,
                  const float *logits, uint32_t *ws_all, const sample_row *rows,
                  const sample_penalty *pen, const sample_bias *bias, int V, int Vp, int top_n_max,
                  int vec_logits, double scale) {
    __shared__ sample_smem s;
    const int r = blockIdx.x, tid = threadIdx.x;
    const sample_row p = rows[r];
    const float *x = logits + (size_t)r * V;
    uint32_t *ws = ws_all + (size_t)r * Vp;
    float *wsf = reinterpret_cast<float *>(ws);
    if (p.mode != SAMPLE_DRAW && p.mode != SAMPLE_SCORE) {
        if (tid == 0) {
            tokens[r] = -1;
            logprobs[r] = NAN;
        }
        return;
    }
    const bool draw = p.mode == SAMPLE_DRAW;
    const int N = min(max(p.top_n, 0), top_n_max);
    const bool want_lp = !draw || p.want_logprob;
    const float rp = p.repetition_penalty, fp = p.frequency_penalty, pp = p.presence_penalty;
    const bool do_rep = rp != 1.0f && rp > 0.0f, do_out = fp != 0.0f || pp != 0.0f;
    const bool pen_on = p.n_pen > 0 && (do_rep || do_out), bias_on = p.n_bias > 0;
    const bool penalized = draw && (pen_on || bias_on); // the row goes to a copy
    const bool vec = vec_logits != 0;

    // ---- the row as given: its max (lowest id), +inf count and top N; then the normalizer
    float rmax = -INFINITY;
    int rarg = INT_MAX;
    double shift = 0.0;
    bool special = false;
    float share = -INFINITY;
    const bool raw = want_lp || N > 0;
    if (raw) {
        float tv[TOPN];
        int ti[TOPN];
        for (int k = 0; k < N; k++) {
            tv[k] = -INFINITY;
            ti[k] = INT_MAX;
        }
        uint32_t n_inf = 0;
        float bv = -INFINITY;
        int bi = INT_MAX;
        for_row(x, V, vec, [&](int i, float v) {
            if (penalized) wsf[i] = v;
            if (v == v && better(v, i, bv, bi)) {
                bv = v;
                bi = i;
            }
            n_inf += v == INFINITY;
            if (N > 0) {
                const float c = v == v ? v : -INFINITY;
                if (better(c, i, tv[N - 1], ti[N - 1])) {
                    int j = N - 1;
                    for (; j > 0 && better(c, i, tv[j - 1], ti[j - 1]); j--) {
                        tv[j] = tv[j - 1];
                        ti[j] = ti[j - 1];
                    }
                    tv[j] = c;
                    ti[j] = i;
                }
            }
        });
        block_argmax(bv, bi, s);
        rmax = bv;
        rarg = bi;
        n_inf = block_sum<uint32_t>(n_inf, s.red_u32);
        special = !(rmax > -INFINITY) || rmax == INFINITY;
        share = n_inf > 0 ? -logf((float)n_inf) : -INFINITY;
        if (!special) {
            double acc = 0.0;
            for_row(x, V, vec, [&](int i, float v) {
                const float e = (float)exp((double)__fsub_rn(v, rmax));
                if (e > 0.0f) acc += (double)e;
            });
            acc = block_sum<double>(acc, s.red_d);
            shift = (double)rmax + log(acc);
        }
        if (N > 0) top_n_merge(s, tv, ti, N);
    } else if (penalized) {
        for_row(x, V, vec, [&](int i, float v) { wsf[i] = v; });
    }
    // log_softmax(row) at a value of the row, as sampler_log_softmax gives it
    auto lp_of = [&](float v) -> float {
        if (special) return v == INFINITY ? share : -INFINITY;
        return v == v ? (float)((double)v - shift) : -INFINITY;
    };
    auto finish = [&](int token) {
        if (tid == 0) {
            tokens[r] = token;
            logprobs[r] = want_lp && token >= 0 && token < V ? lp_of(x[token]) : NAN;
            const int n_top = min(N, V);
            float lv[TOPN];
            int li[TOPN];
            for (int k = 0; k < n_top; k++) { // re-sorted by logprob, the CPU's key
                const float v = lp_of(s.fin_v[k]);
                const int id = s.fin_i[k];
                int j = k;
                for (; j > 0 && better(v, id, lv[j - 1], li[j - 1]); j--) {
                    lv[j] = lv[j - 1];
                    li[j] = li[j - 1];
                }
                lv[j] = v;
                li[j] = id;
            }
            for (int k = 0; k < n_top; k++) {
                top_ids[(size_t)r * top_n_max + k] = li[k];
                top_lps[(size_t)r * top_n_max + k] = lv[k];
            }
        }
    };
    if (!draw) {
        finish(p.target);
        return;
    }

    // ---- penalties on the copy, in the CPU's float operations; then the logit bias (an id may
    // be in both lists, so the bias waits for every penalty)
    if (penalized) __syncthreads(); // the copy is complete
    if (penalized && pen_on) {
        for (int j = tid; j < p.n_pen; j += SB) {
            const sample_penalty e = pen[p.pen_start + j];
            if (e.id < 0 || e.id >= V) continue;
            float v = wsf[e.id];
            if (do_rep) v = v > 0.0f ? __fdiv_rn(v, rp) : __fmul_rn(v, rp);
            if (do_out && e.count > 0) {
                v = __fsub_rn(v, __fmul_rn(fp, (float)e.count));
                v = __fsub_rn(v, pp);
            }
            wsf[e.id] = v;
        }
        __syncthreads();
    }
    if (penalized && bias_on) {
        for (int j = tid; j < p.n_bias; j += SB) {
            const sample_bias e = bias[p.bias_start + j];
            if (e.id >= 0 && e.id < V) wsf[e.id] = __fadd_rn(wsf[e.id], e.bias);
        }
        __syncthreads();
    }
    const float *w = penalized ? wsf : x;
    const bool vec_w = penalized || vec;
    float pmax = rmax;
    int parg = rarg;
    if (penalized || !raw) {
        float bv = -INFINITY;
        int bi = INT_MAX;
        for_row(w, V, vec_w, [&](int i, float v) {
            if (v == v && better(v, i, bv, bi)) {
                bv = v;
                bi = i;
            }
        });
        block_argmax(bv, bi, s);
        pmax = bv;
        parg = bi;
    }
    const float T = p.temperature;
    if (!(T >= OPS_SAMPLE_GREEDY_EPS) || p.top_k == 1) { // greedy; 0 when nothing beats -inf
        finish(pmax > -INFINITY ? parg : 0);
        return;
    }
    // x / T is monotone in x, so its max is max / T (the CPU's m).
    const float mT = __fdiv_rn(pmax, T);
    if (!(mT > -INFINITY)) {
        finish(0);
        return;
    }
    if (mT == INFINITY) { // no distribution: the argmax of x / T
        float bv = -INFINITY;
        int bi = INT_MAX;
        for_row(w, V, vec_w, [&](int i, float v) {
            const float y = __fdiv_rn(v, T);
            if (y == y && better(y, i, bv, bi)) {
                bv = y;
                bi = i;
            }
        });
        block_argmax(bv, bi, s);
        finish(bi);
        return;
    }

    // ---- keys (e's bits, 0 for e == 0 or NaN) and the first digit's histogram
    s.cnt1[tid] = 0;
    s.mass1[tid] = 0;
    __syncthreads();
    const float min_p = p.min_p;
    const bool use_min_p = min_p > 0.0f;
    uint32_t c_ge = 0; // tokens with e >= min_p, and their mass
    u64 m_ge = 0;
    auto key_of = [&](float v, int i) -> uint32_t {
        if (i >= V) return 0u;
        const float e = (float)exp((double)__fsub_rn(__fdiv_rn(v, T), mT));
        if (!(e > 0.0f)) return 0u;
        const uint32_t k = __float_as_uint(e);
        const u64 mk = key_mass(k, scale);
        const uint32_t b = min(k >> 20, (uint32_t)(NBINS - 1));
        atomicAdd(&s.cnt1[b], 1u);
        atomicAdd(&s.mass1[b], mk);
        if (use_min_p && e >= min_p) {
            c_ge++;
            m_ge += mk;
        }
        return k;
    };
    const int n4 = Vp >> 2;
#pragma unroll 2
    for (int q = tid; q < n4; q += SB) {
        const float4 v = load4(w, q, V, vec_w);
        const int i = q << 2;
        uint4 k;
        k.x = key_of(v.x, i);
        k.y = key_of(v.y, i + 1);
        k.z = key_of(v.z, i + 2);
        k.w = key_of(v.w, i + 3);
        reinterpret_cast<uint4 *>(ws)[q] = k;
    }
    __syncthreads();
    const u64 n_cand = block_sum<uint32_t>(s.cnt1[tid], s.red_u32);
    const u64 total = block_sum<u64>(s.mass1[tid], s.red_u64);
    c_ge = block_sum<uint32_t>(c_ge, s.red_u32);
    m_ge = block_sum<u64>(m_ge, s.red_u64);

    // ---- the cuts: lim tokens kept, of mass kept
    const u64 k = p.top_k >= 1 && p.top_k < V ? (u64)p.top_k : (u64)V;
    u64 lim = n_cand, kept = total;
    if (k < n_cand) {
        const pick q = descend(s, ws, Vp, k, false, scale);
        if (q.found) {
            lim = k;
            kept = q.mass_above + (u64)q.t * key_mass(q.key, scale);
        }
    }
    if (p.top_p < 1.0f) { // measured on the top-k mass (the whole mass when top-k keeps all)
        const double tgt = ceil(((double)p.top_p - OPS_SAMPLE_TOP_P_SLACK) * (double)kept);
        const u64 target = tgt < 1.0 ? 1 : (u64)tgt;
        const pick q = descend(s, ws, Vp, target, true, scale);
        if (q.found && (u64)q.cnt_above + q.t < lim) {
            lim = (u64)q.cnt_above + q.t;
            kept = q.mass_above + (u64)q.t * key_mass(q.key, scale);
        }
    }
    if (use_min_p) {
        u64 c = c_ge, mc = m_ge;
        if (c == 0) { // min_p above 1: the largest alone
            c = 1;
            mc = key_mass(KEY_ONE, scale);
        }
        if (c < lim) {
            lim = c;
            kept = mc;
        }
    }

    // ---- the draw: the first token whose cumulative mass passes u * kept
    const uint64_t bits = counter_rng_bits(p.seed, p.position);
    const u64 target = __umul64hi(bits & ~0x7ffull, kept) + 1; // floor(u * kept) + 1 <= kept
    const pick q = descend(s, ws, Vp, target, true, scale);
    int token = parg; // not reached: the target lies inside the row's mass
    if (q.found) token = q.t <= 1 ? (int)q.minid : tie_select(s, ws, Vp, q.key, q.t);
    finish(token);
}

uint32_t *g_ws; // [n, Vp] words: grown on demand, in stream order
size_t g_ws_bytes;

} // namespace

void cuda_sample(int32_t *tokens, float *logprobs, int32_t *top_ids, float *top_logprobs,
                 const float *logits, const sample_row *rows, const sample_penalty *pen,
                 const sample_bias *bias, int n, int V, int top_n_max) {
    if (n <= 0) return;
    if (V < 1 || top_n_max < 0 || top_n_max > OPS_SAMPLE_TOP_N_MAX)
        cuda_fail(__FILE__, __LINE__, "sample", "V must be >= 1, top_n_max in [0, 32]");
    cudaStream_t st = cuda_stream();
    const int Vp = (V + 3) & ~3;
    const size_t bytes = (size_t)n * Vp * sizeof(uint32_t);
    if (bytes > g_ws_bytes) {
        if (g_ws) CUDA_CHECK(cudaFreeAsync(g_ws, st));
        cuda_workspace_changed(); /* the backend's rule for a moved workspace */
        g_ws = nullptr;
        g_ws_bytes = 0;
        void *p = nullptr;
        if (cudaMallocAsync(&p, bytes, st) != cudaSuccess) {
            cudaGetLastError(); // not sticky: clear it
            cuda_fail(__FILE__, __LINE__, "sample", "out of device memory for the workspace");
        }
        g_ws = static_cast<uint32_t *>(p);
        g_ws_bytes = bytes;
    }
    int bits = 0;
    while (bits < 31 && (V >> bits) != 0)
        bits++;
    const double scale = ldexp(1.0, 63 - bits); // V masses of at most 2^(63 - bits) sum below 2^63
    const int vec = V % 4 == 0 && (uintptr_t)logits % 16 == 0;
    sample_kernel<<<n, SB, 0, st>>>(tokens, logprobs, top_ids, top_logprobs, logits, g_ws, rows,
                                    pen, bias, V, Vp, top_n_max, vec, scale);
    CUDA_CHECK_LAUNCH();
}
