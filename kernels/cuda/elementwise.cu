// Elementwise and per-row kernels of the CUDA backend: embedding, rmsnorm, add_rmsnorm, rope,
// qk_norm_rope, kv_store, router_topk, moe_finalize, silu_mul, add. Each matches the CPU op of the
// same name in kernels/cpu/ (tests/test_cuda_ops.c compares them, tolerances stated there).
//
// Choices:
// - Arithmetic that the CPU does as separate fp32 multiplies and adds is written here with
//   __fmul_rn / __fadd_rn, so nvcc does not contract it into FMAs: rmsnorm, rope, moe_finalize and
//   add then give the CPU's bits exactly (the CPU is built as ISO C, which contracts nothing).
// - rmsnorm: one warp per row. The squares of 4-element chunks are summed in double (as the CPU
//   does) into 256 partials, chunk ch into partial ch % 256 (lane l holds partials l + 32 j), the
//   partials folded pairwise and the lanes added by an xor butterfly, which leaves every lane with
//   the same sum (norm_fold below). The order depends on C only, never on R or on the pointer's
//   alignment (the aligned and unaligned paths read the same chunks), so a row's result does not
//   depend on the batch.
// - add_rmsnorm and qk_norm_rope are the fused forms of add + rmsnorm and rmsnorm (q, k) + rope.
//   They share rmsnorm's chunks, its square helper and its butterfly, and rope's angles, through
//   the same device functions, so each gives the bits of the unfused kernels it replaces.
//   add_rmsnorm: one warp per row reads x and o once, writes x and h; for rows of up to 2048
//   (aligned) the sums stay in registers between the two passes, longer rows read back the
//   elements the lane itself just wrote. qk_norm_rope: one block per token, one warp per head at
//   a time; the normed head waits in shared memory for its rotation, so q and k are read and
//   written once.
// - rope: the inverse frequencies are computed on the host with the CPU's exact powf formula and
//   passed in the kernel's arguments; cos and sin of the fp32 angle are taken in double and
//   rounded, which is the correctly rounded value the CPU's cosf/sinf give in all but rare cases.
// - router_topk: one warp per token. exp in double rounded to fp32 (the CPU's expf is correctly
//   rounded in practice), the softmax sum as 32 lanes' partial sums added pairwise in the order
//   the CPU's softmax_sum (kernels/cpu/router.c) writes down, then K
//   rounds of a warp argmax ordered by (probability descending, expert id ascending): the CPU's tie
//   rule, so the ids agree exactly.
// - silu_mul uses the device expf (at most 2 ulp from the CPU's). It and rope (whose cos/sin can
//   still land an ulp from glibc's) are the ops here that may differ from the CPU in the last bit;
//   the others gave the CPU's bits on every test input.
// - Streaming ops take 16-byte accesses when every pointer is 16-byte aligned and fall back to
//   scalar ones otherwise; the arithmetic per element is the same on both paths.
// - An index a request could not have produced (a token id outside the vocabulary, a KV position
//   past the page table) is a broken invariant: the kernel traps and the next CUDA_CHECK aborts.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <cstdio>

#include "common/log.h"
#include "kernels/a2a.h"
#include "kernels/cuda/act_quant.cuh"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/kv_types.cuh"
#include "kernels/quant.h"

#define EW_THREADS    256       /* threads per block of the streaming kernels */
#define EW_MAX_BLOCKS (1 << 16) /* grid cap; the kernels loop over what is left */
#define NORM_WARPS    4         /* rows per rmsnorm block (one warp each) */
#define NORM_KEEP_MAX 16        /* float4 chunks per lane add_rmsnorm keeps in registers */
#define QK_MAX_WARPS  16        /* heads of a token normed and rotated at once (one warp each) */
#define QK_SMALL_WARPS 4        /* warps per block when a token's heads are spread over blocks */
#define QK_SPREAD_MAX_T 64      /* below this many tokens they are */
#define ROUTER_WARPS  4         /* tokens per router block (one warp each) */
#define ROPE_MAX_HALF 256       /* Dh / 2 at most (the frequencies travel in the arguments) */
#define FULL_MASK     0xffffffffu
#define FIN_BATCH     8         /* moe_finalize: slots whose loads are issued together */
#define ROW_THREADS   256       /* threads per row of the row kernel */
#define ROW_MAX_T     64        /* add_rmsnorm takes the row kernel below this many rows */

__host__ __device__ static inline bool aligned16(const void *p) { return ((uintptr_t)p & 15) == 0; }

static inline int ew_blocks(int64_t n) {
    int64_t b = (n + EW_THREADS - 1) / EW_THREADS;
    return (int)(b < EW_MAX_BLOCKS ? (b > 0 ? b : 1) : EW_MAX_BLOCKS);
}

// Element i of a weight of dtype DT (F32, BF16 or F16), widened exactly to fp32.
template <int DT> __device__ __forceinline__ float load_w(const void *p, int64_t i) {
    if constexpr (DT == DTYPE_F32) return ((const float *)p)[i];
    if constexpr (DT == DTYPE_BF16) return __bfloat162float(((const __nv_bfloat16 *)p)[i]);
    return __half2float(((const __half *)p)[i]);
}

// The three weight dtypes the kernels read; anything else reaching them is a loader bug.
static void assert_weight(const tensor *w, const char *op) {
    if (w->device != DEVICE_CUDA ||
        (w->dtype != DTYPE_F32 && w->dtype != DTYPE_BF16 && w->dtype != DTYPE_F16)) {
        char msg[160];
        snprintf(msg, sizeof msg,
                 "weight of dtype %s on device %d; expected an uploaded F32, BF16 "
                 "or F16 tensor",
                 dtype_name(w->dtype), (int)w->device);
        cuda_fail(__FILE__, __LINE__, op, msg);
    }
}

// ---- embedding: out[T, D] = table[ids[t], :] ----

template <int DT>
__global__ void embedding_kernel(float *out, const void *table, const int32_t *ids, int64_t V,
                                 int D) {
    const int32_t id = ids[blockIdx.x];
    if (id < 0 || id >= V) __trap(); // ids are checked where requests enter the server
    const int64_t row = (int64_t)id * D;
    float *o = out + (int64_t)blockIdx.x * D;
    for (int d = threadIdx.x; d < D; d += blockDim.x)
        o[d] = load_w<DT>(table, row + d);
}

void cuda_embedding(float *out, const tensor *table, const int32_t *ids, int T, int D) {
    if (T <= 0) return;
    assert_weight(table, "embedding");
    MS_ASSERT(table->ndim == 2 && table->shape[1] == D);
    const int64_t V = table->shape[0];
    cudaStream_t s = cuda_stream();
    switch (table->dtype) {
    case DTYPE_F32:
        embedding_kernel<DTYPE_F32><<<T, EW_THREADS, 0, s>>>(out, table->data, ids, V, D);
        break;
    case DTYPE_BF16:
        embedding_kernel<DTYPE_BF16><<<T, EW_THREADS, 0, s>>>(out, table->data, ids, V, D);
        break;
    default:
        embedding_kernel<DTYPE_F16><<<T, EW_THREADS, 0, s>>>(out, table->data, ids, V, D);
        break;
    }
    CUDA_CHECK_LAUNCH();
}

// ---- rmsnorm: out[R, C] = x / sqrt(mean(x^2) + eps) * w ----

// The pieces every norm kernel here is made of, so that rmsnorm, add_rmsnorm and qk_norm_rope
// do the same arithmetic in the same order. A row of C values is cut into 4-element chunks; lane
// l of the row's warp owns chunks l, l + 32, ...

// ss plus the square of v, in double as the CPU.
__device__ __forceinline__ double norm_sq(double ss, float v) { return ss + (double)v * v; }

__device__ __forceinline__ double norm_sq4(double ss, float4 v) {
    return norm_sq(norm_sq(norm_sq(norm_sq(ss, v.x), v.y), v.z), v.w);
}

// The order of a row's sum of squares, the same in every norm kernel here (it depends on the row's
// length alone): chunk ch goes to partial ch % 256, each partial adding its chunks in turn from 0;
// partial p then takes partial p + off for off = 128, 64, 32 (a lane holds partials l + 32 j,
// j < NORM_PARTS: norm_fold), then 16, 8, 4, 2, 1 (norm_inv's butterfly). A lane's partials are
// independent chains, so a row of 2048 is 2 chunks deep instead of 16. (The CPU adds in index
// order; in double either order rounds to the same float but for ties of about 2^-29.)
#define NORM_PARTS 8
__device__ __forceinline__ double norm_fold(const double (&s)[NORM_PARTS]) {
    const double a0 = s[0] + s[4], a1 = s[1] + s[5], a2 = s[2] + s[6], a3 = s[3] + s[7];
    return (a0 + a2) + (a1 + a3);
}

// A lane's part of a row's sum in that order, folded: sq(ch, s) returns s plus the squares of
// chunk ch (in its element order), called for the lane's chunks ch = lane, lane + 32, ... in turn.
template <class SQ> __device__ __forceinline__ double norm_lane_sum(int lane, int n_chunks, SQ sq) {
    double ss[NORM_PARTS] = {};
    for (int base = lane; base < n_chunks; base += 32 * NORM_PARTS)
#pragma unroll
        for (int j = 0; j < NORM_PARTS; j++) {
            const int ch = base + 32 * j;
            if (ch >= n_chunks) break;
            ss[j] = sq(ch, ss[j]);
        }
    return norm_fold(ss);
}

// The lanes' partial sums added by an xor butterfly (every lane gets the same total), then
// 1 / sqrt(mean + eps) with IEEE division and square root (no fast math).
__device__ __forceinline__ float norm_inv(double ss, int C, float eps) {
    for (int off = 16; off > 0; off >>= 1)
        ss += __shfl_xor_sync(FULL_MASK, ss, off);
    const float ms = (float)(ss / C);
    return 1.0f / sqrtf(ms + eps);
}

// (v * inv) * w[c], two roundings like the CPU's.
template <int DT>
__device__ __forceinline__ float norm_scale(float v, float inv, const void *w, int c) {
    return __fmul_rn(__fmul_rn(v, inv), load_w<DT>(w, c));
}

template <int DT>
__device__ __forceinline__ float4 norm_scale4(float4 v, float inv, const void *w, int c) {
    return make_float4(norm_scale<DT>(v.x, inv, w, c), norm_scale<DT>(v.y, inv, w, c + 1),
                       norm_scale<DT>(v.z, inv, w, c + 2), norm_scale<DT>(v.w, inv, w, c + 3));
}

// Weights c .. c + 3 widened, and norm_scale4 with them already loaded (the same arithmetic).
template <int DT> __device__ __forceinline__ float4 load_w4(const void *w, int c) {
    return make_float4(load_w<DT>(w, c), load_w<DT>(w, c + 1), load_w<DT>(w, c + 2),
                       load_w<DT>(w, c + 3));
}

__device__ __forceinline__ float4 norm_scale4w(float4 v, float inv, float4 w) {
    return make_float4(__fmul_rn(__fmul_rn(v.x, inv), w.x), __fmul_rn(__fmul_rn(v.y, inv), w.y),
                       __fmul_rn(__fmul_rn(v.z, inv), w.z), __fmul_rn(__fmul_rn(v.w, inv), w.w));
}

// One warp per row; VEC reads the 4-element chunks as float4 (x and out 16-byte aligned, C % 4 ==
// 0). out may equal x: each lane writes only the elements it read itself, after the reduction.
template <int DT, bool VEC>
__global__ void rmsnorm_kernel(float *out, const float *x, const void *w, int R, int C, float eps) {
    const int lane = threadIdx.x & 31;
    const int64_t row = (int64_t)blockIdx.x * NORM_WARPS + (threadIdx.x >> 5);
    if (row >= R) return;
    const float *xr = x + row * C;
    float *o = out + row * C;
    const int n_chunks = (C + 3) / 4;

    const double ss = norm_lane_sum(lane, n_chunks, [&](int ch, double s) {
        if constexpr (VEC) {
            s = norm_sq4(s, ((const float4 *)xr)[ch]);
        } else {
            const int c1 = min(4 * ch + 4, C);
            for (int c = 4 * ch; c < c1; c++)
                s = norm_sq(s, xr[c]);
        }
        return s;
    });
    const float inv = norm_inv(ss, C, eps);

    for (int ch = lane; ch < n_chunks; ch += 32) {
        if constexpr (VEC) {
            ((float4 *)o)[ch] = norm_scale4<DT>(((const float4 *)xr)[ch], inv, w, 4 * ch);
        } else {
            const int c1 = min(4 * ch + 4, C);
            for (int c = 4 * ch; c < c1; c++)
                o[c] = norm_scale<DT>(xr[c], inv, w, c);
        }
    }
}

// One warp: dst[C] = src[C] normed with w, rmsnorm_kernel's chunks and arithmetic, for rows of up
// to 32 * 4 * N values (16-byte aligned, C % 4 == 0). All of a lane's chunks and their weights are
// loaded before its sum starts, and the stores come last: a load issued after a store that may
// alias it would wait for that store, once per chunk. dst may equal src.
// FULL: C is 32 * 4 * N (no lane's chunk is missing), so no chunk is a branch of its own and
// ptxas issues all the loads before the first square (with the tests it left 4 of the 16 rows'
// loads among the sums: cuobjdump -sass, sm_90a; H200, rmsnorm of 8192 x 2048 37.0 us
// against 44.0).
template <int DT, int N, bool FULL = false>
__device__ __forceinline__ void warp_norm_row(float4 *dst, const float4 *src, const void *w, int C,
                                              float eps) {
    const int lane = threadIdx.x & 31, n_chunks = C / 4;
    auto in = [&](int i) { return FULL || lane + 32 * i < n_chunks; };
    float4 v[N], wv[N];
#pragma unroll
    for (int i = 0; i < N; i++)
        if (in(i)) {
            v[i] = src[lane + 32 * i];
            wv[i] = load_w4<DT>(w, 4 * (lane + 32 * i));
        }
    double ss[NORM_PARTS] = {};
#pragma unroll
    for (int i = 0; i < N; i++)
        if (in(i)) ss[i % NORM_PARTS] = norm_sq4(ss[i % NORM_PARTS], v[i]);
    const float inv = norm_inv(norm_fold(ss), C, eps);
#pragma unroll
    for (int i = 0; i < N; i++)
        if (in(i)) dst[lane + 32 * i] = norm_scale4w(v[i], inv, wv[i]);
}

// rmsnorm_kernel's VEC path for rows of up to 32 * 4 * KEEP values, one warp_norm_row a warp: the
// same chunks, in the same order, the same bits. FULL: C = 32 * 4 * KEEP.
template <int DT, int KEEP, bool FULL = false>
__global__ void rmsnorm_keep_kernel(float *out, const float *x, const void *w, int R, int C,
                                    float eps) {
    const int64_t row = (int64_t)blockIdx.x * NORM_WARPS + (threadIdx.x >> 5);
    if (row >= R) return;
    const float4 *xr = (const float4 *)(x + row * C);
    float4 *o = (float4 *)(out + row * C);
    warp_norm_row<DT, KEEP, FULL>(o, xr, w, C, eps);
}

template <int DT>
static void rmsnorm_launch(float *out, const float *x, const void *w, int R, int C, float eps) {
    const int blocks = (R + NORM_WARPS - 1) / NORM_WARPS;
    const int per_lane = (C / 4 + 31) / 32; // chunks per lane
    const bool vec = C % 4 == 0 && aligned16(x) && aligned16(out);
    if (vec && per_lane <= 1)
        rmsnorm_keep_kernel<DT, 1>
            <<<blocks, 32 * NORM_WARPS, 0, cuda_stream()>>>(out, x, w, R, C, eps);
    else if (vec && per_lane <= 4)
        rmsnorm_keep_kernel<DT, 4>
            <<<blocks, 32 * NORM_WARPS, 0, cuda_stream()>>>(out, x, w, R, C, eps);
    else if (vec && C == 32 * 4 * NORM_KEEP_MAX)
        rmsnorm_keep_kernel<DT, NORM_KEEP_MAX, true>
            <<<blocks, 32 * NORM_WARPS, 0, cuda_stream()>>>(out, x, w, R, C, eps);
    else if (vec && per_lane <= NORM_KEEP_MAX)
        rmsnorm_keep_kernel<DT, NORM_KEEP_MAX>
            <<<blocks, 32 * NORM_WARPS, 0, cuda_stream()>>>(out, x, w, R, C, eps);
    else if (vec)
        rmsnorm_kernel<DT, true>
            <<<blocks, 32 * NORM_WARPS, 0, cuda_stream()>>>(out, x, w, R, C, eps);
    else
        rmsnorm_kernel<DT, false>
            <<<blocks, 32 * NORM_WARPS, 0, cuda_stream()>>>(out, x, w, R, C, eps);
}

void cuda_rmsnorm(float *out, const float *x, const tensor *w, int R, int C, float eps) {
    if (R <= 0) return;
    assert_weight(w, "rmsnorm");
    MS_ASSERT(tensor_numel(w) == C);
    switch (w->dtype) {
    case DTYPE_F32: rmsnorm_launch<DTYPE_F32>(out, x, w->data, R, C, eps); break;
    case DTYPE_BF16: rmsnorm_launch<DTYPE_BF16>(out, x, w->data, R, C, eps); break;
    default: rmsnorm_launch<DTYPE_F16>(out, x, w->data, R, C, eps); break;
    }
    CUDA_CHECK_LAUNCH();
}

// ---- add_rmsnorm: x[T, D] += o, h = x / sqrt(mean(x^2) + eps) * w ----

__device__ __forceinline__ float4 add4(float4 a, float4 b) {
    return make_float4(__fadd_rn(a.x, b.x), __fadd_rn(a.y, b.y), __fadd_rn(a.z, b.z),
                       __fadd_rn(a.w, b.w));
}

// One warp per row, rmsnorm's chunks, each lane's sums kept in registers between the two passes:
// x, h, o 16-byte aligned, D % 4 == 0, at most KEEP chunks per lane (D <= 32 * 4 * KEEP; FULL:
// D = 32 * 4 * KEEP, no chunk tests, as warp_norm_row's). The bound of 3 blocks a multiprocessor
// lets ptxas hold all 32 loads in flight (162 registers); left to itself it kept to 96 and issued
// 15 of them after the first square, each a wait of its own (H200, T = 8192, D = 2048: 72.8 us
// against 85.7).
template <int DT, int KEEP, bool FULL = false>
__global__ void __launch_bounds__(32 * NORM_WARPS, 3)
    add_rmsnorm_keep_kernel(float *x, float *h, const float *o, const void *w, int T, int D,
                            float eps) {
    const int lane = threadIdx.x & 31;
    const int64_t row = (int64_t)blockIdx.x * NORM_WARPS + (threadIdx.x >> 5);
    if (row >= T) return;
    float4 *xr = (float4 *)(x + row * D), *hr = (float4 *)(h + row * D);
    const float4 *orow = (const float4 *)(o + row * D);
    const int n_chunks = D / 4;

    // Every load is issued before the first store, so the lane waits for memory once, not once
    // per chunk (a store to x between two loads would hold the later load back: x may alias o).
    float4 keep[KEEP], other[KEEP];
#pragma unroll
    for (int i = 0; i < KEEP; i++) {
        const int ch = lane + 32 * i;
        if (FULL || ch < n_chunks) {
            keep[i] = xr[ch];
            other[i] = orow[ch];
        }
    }
    double ss[NORM_PARTS] = {};
#pragma unroll
    for (int i = 0; i < KEEP; i++) {
        const int ch = lane + 32 * i;
        if (FULL || ch < n_chunks) {
            keep[i] = add4(keep[i], other[i]);
            ss[i % NORM_PARTS] = norm_sq4(ss[i % NORM_PARTS], keep[i]);
        }
    }
#pragma unroll
    for (int i = 0; i < KEEP; i++) {
        const int ch = lane + 32 * i;
        if (FULL || ch < n_chunks) xr[ch] = keep[i];
    }
    const float inv = norm_inv(norm_fold(ss), D, eps);
#pragma unroll
    for (int i = 0; i < KEEP; i++) {
        const int ch = lane + 32 * i;
        if (FULL || ch < n_chunks) hr[ch] = norm_scale4<DT>(keep[i], inv, w, 4 * ch);
    }
}

// The same for any D: the second pass reads back from x the elements the lane itself wrote in
// the first. VEC as rmsnorm_kernel's (x, h, o aligned, D % 4 == 0).
template <int DT, bool VEC>
__global__ void add_rmsnorm_kernel(float *x, float *h, const float *o, const void *w, int T, int D,
                                   float eps) {
    const int lane = threadIdx.x & 31;
    const int64_t row = (int64_t)blockIdx.x * NORM_WARPS + (threadIdx.x >> 5);
    if (row >= T) return;
    float *xr = x + row * D, *hr = h + row * D;
    const float *orow = o + row * D;
    const int n_chunks = (D + 3) / 4;

    const double ss = norm_lane_sum(lane, n_chunks, [&](int ch, double s) {
        if constexpr (VEC) {
            const float4 v = add4(((const float4 *)xr)[ch], ((const float4 *)orow)[ch]);
            ((float4 *)xr)[ch] = v;
            s = norm_sq4(s, v);
        } else {
            const int c1 = min(4 * ch + 4, D);
            for (int c = 4 * ch; c < c1; c++) {
                const float v = __fadd_rn(xr[c], orow[c]);
                xr[c] = v;
                s = norm_sq(s, v);
            }
        }
        return s;
    });
    const float inv = norm_inv(ss, D, eps);
    for (int ch = lane; ch < n_chunks; ch += 32) {
        if constexpr (VEC) {
            ((float4 *)hr)[ch] = norm_scale4<DT>(((const float4 *)xr)[ch], inv, w, 4 * ch);
        } else {
            const int c1 = min(4 * ch + 4, D);
            for (int c = 4 * ch; c < c1; c++)
                hr[c] = norm_scale<DT>(xr[c], inv, w, c);
        }
    }
}

template <int DT>
static void add_rmsnorm_launch(float *x, float *h, const float *o, const void *w, int T, int D,
                               float eps) {
    const int blocks = (T + NORM_WARPS - 1) / NORM_WARPS, threads = 32 * NORM_WARPS;
    const int per_lane = ((D + 3) / 4 + 31) / 32; // chunks per lane
    cudaStream_t s = cuda_stream();
    if (D % 4 != 0 || !aligned16(x) || !aligned16(h) || !aligned16(o))
        add_rmsnorm_kernel<DT, false><<<blocks, threads, 0, s>>>(x, h, o, w, T, D, eps);
    else if (per_lane <= 4)
        add_rmsnorm_keep_kernel<DT, 4><<<blocks, threads, 0, s>>>(x, h, o, w, T, D, eps);
    else if (D == 32 * 4 * NORM_KEEP_MAX)
        add_rmsnorm_keep_kernel<DT, NORM_KEEP_MAX, true>
            <<<blocks, threads, 0, s>>>(x, h, o, w, T, D, eps);
    else if (per_lane <= NORM_KEEP_MAX)
        add_rmsnorm_keep_kernel<DT, NORM_KEEP_MAX>
            <<<blocks, threads, 0, s>>>(x, h, o, w, T, D, eps);
    else
        add_rmsnorm_kernel<DT, true><<<blocks, threads, 0, s>>>(x, h, o, w, T, D, eps);
}

static bool add_rmsnorm_row_launch(float *x, float *h, const float *o, const float *topk_w, int K,
                                   const tensor *w, int T, int D, float eps);

void cuda_add_rmsnorm(float *x, float *h, const float *o, const tensor *w, int T, int D,
                      float eps) {
    if (T <= 0) return;
    assert_weight(w, "add_rmsnorm");
    MS_ASSERT(tensor_numel(w) == D);
    // Few rows: a block per row (a warp per row leaves a decode step's GPU nearly idle).
    if (T < ROW_MAX_T && add_rmsnorm_row_launch(x, h, o, nullptr, 0, w, T, D, eps)) {
        CUDA_CHECK_LAUNCH();
        return;
    }
    switch (w->dtype) {
    case DTYPE_F32: add_rmsnorm_launch<DTYPE_F32>(x, h, o, w->data, T, D, eps); break;
    case DTYPE_BF16: add_rmsnorm_launch<DTYPE_BF16>(x, h, o, w->data, T, D, eps); break;
    default: add_rmsnorm_launch<DTYPE_F16>(x, h, o, w->data, T, D, eps); break;
    }
    CUDA_CHECK_LAUNCH();
}

// ---- rope: rotate-half, in place, at positions pos[T] ----

struct rope_freqs {
    float inv_freq[ROPE_MAX_HALF]; // [Dh / 2], the CPU's fp32 values
};

// Rotate n_heads heads of x[n_heads, Dh] by cs/sn [Dh / 2], threads striding over (head, j).
__device__ __forceinline__ void rope_rotate(float *x, const float *cs, const float *sn, int n_heads,
                                            int half) {
    const int Dh = 2 * half;
    for (int i = threadIdx.x; i < n_heads * half; i += blockDim.x) {
        const int h = i / half, j = i - h * half;
        float *a = x + (int64_t)h * Dh;
        const float x0 = a[j], x1 = a[j + half];
        a[j] = __fsub_rn(__fmul_rn(x0, cs[j]), __fmul_rn(x1, sn[j]));
        a[j + half] = __fadd_rn(__fmul_rn(x1, cs[j]), __fmul_rn(x0, sn[j]));
    }
}

// cs, sn [Dh / 2] = cos, sin of token position p's angles, the block's threads striding over j.
__device__ __forceinline__ void rope_angles(float *cs, float *sn, int32_t p, const rope_freqs &f,
                                            int half) {
    const float pf = (float)p;
    for (int j = threadIdx.x; j < half; j += blockDim.x) {
        const float angle = __fmul_rn(pf, f.inv_freq[j]);
        double s, c;
        sincos((double)angle, &s, &c);
        cs[j] = (float)c;
        sn[j] = (float)s;
    }
}

// One block per token: cos/sin of its Dh / 2 angles into shared memory, then every head of q, k.
__global__ void rope_kernel(float *q, float *k, const int32_t *pos, int H, int Hkv, int half,
                            const __grid_constant__ rope_freqs f) {
    __shared__ float cs[ROPE_MAX_HALF], sn[ROPE_MAX_HALF];
    const int t = blockIdx.x;
    rope_angles(cs, sn, pos[t], f, half);
    __syncthreads();
    rope_rotate(q + (int64_t)t * H * 2 * half, cs, sn, H, half);
    rope_rotate(k + (int64_t)t * Hkv * 2 * half, cs, sn, Hkv, half);
}

// kernels/cpu/rope.c's inverse frequencies, step by step in fp32. Kept for the last (theta, Dh):
// a model uses one pair, so the powf calls run once.
static const rope_freqs &rope_freqs_for(double theta, int Dh) {
    static rope_freqs f;
    static double f_theta = -1.0;
    static int f_dh = -1;
    if (theta != f_theta || Dh != f_dh) {
        const float theta_f = (float)theta;
        for (int j = 0; j < Dh / 2; j++) {
            const float e = (float)(2 * j) / (float)Dh;
            f.inv_freq[j] = 1.0f / powf(theta_f, e);
        }
        f_theta = theta;
        f_dh = Dh;
    }
    return f;
}

void cuda_rope(float *q, float *k, const int32_t *pos, int T, int H, int Hkv, int Dh,
               double theta) {
    if (T <= 0) return;
    MS_ASSERT(Dh % 2 == 0 && Dh / 2 <= ROPE_MAX_HALF);
    const int half = Dh / 2;
    const int threads = half * (H > Hkv ? H : Hkv) >= 512 ? 512 : 128;
    rope_kernel<<<T, threads, 0, cuda_stream()>>>(q, k, pos, H, Hkv, half,
                                                  rope_freqs_for(theta, Dh));
    CUDA_CHECK_LAUNCH();
}

// ---- qk_norm_rope: every head of q and k normed, then rotated, in place ----

// One head of Dh = 2 half values, by one warp: src normed with w (rmsnorm_kernel's chunks and
// arithmetic) into the warp's row of shared memory, then rotated from there into dst with
// rope_rotate's arithmetic (cs, sn: the token's angles). dst may equal src. VEC: src, dst 16-byte
// aligned and Dh % 4 == 0. OUT: dst's element (a BF16 KV cache's k rows: rounded as stored).
template <int DT, bool VEC, class OUT = float>
__device__ __forceinline__ void head_norm_rope(OUT *dst, const float *src, const void *w,
                                               float *row, const float *cs, const float *sn,
                                               int half, float eps) {
    const int lane = threadIdx.x & 31, Dh = 2 * half;
    const int n_chunks = (Dh + 3) / 4;
    if constexpr (VEC) { // a lane's chunks and weights loaded at once (Dh <= 512: 4 chunks)
        warp_norm_row<DT, 2 * ROPE_MAX_HALF / 4 / 32>((float4 *)row, (const float4 *)src, w, Dh,
                                                      eps);
    } else {
        const double ss = norm_lane_sum(lane, n_chunks, [&](int ch, double s) {
            const int c1 = min(4 * ch + 4, Dh);
            for (int c = 4 * ch; c < c1; c++) {
                row[c] = src[c];
                s = norm_sq(s, row[c]);
            }
            return s;
        });
        const float inv = norm_inv(ss, Dh, eps);
        for (int ch = lane; ch < n_chunks; ch += 32) {
            const int c1 = min(4 * ch + 4, Dh);
            for (int c = 4 * ch; c < c1; c++)
                row[c] = norm_scale<DT>(row[c], inv, w, c);
        }
    }
    __syncwarp(); // the rotation pairs elements that other lanes normed
    for (int j = lane; j < half; j += 32) {
        const float x0 = row[j], x1 = row[j + half];
        kv_elem<OUT>::put(dst + j, __fsub_rn(__fmul_rn(x0, cs[j]), __fmul_rn(x1, sn[j])));
        kv_elem<OUT>::put(dst + j + half, __fadd_rn(__fmul_rn(x1, cs[j]), __fmul_rn(x0, sn[j])));
    }
    __syncwarp(); // the row is read before the warp's next head overwrites it
}

// Block (t, y): token t's angles as rope_kernel takes them, then warp w takes heads y warps + w,
// then every warps gridDim.y further, of the H q heads followed by the Hkv k heads.
template <int DT, bool VEC>
__global__ void qk_norm_rope_kernel(float *q, float *k, const void *q_norm, const void *k_norm,
                                    const int32_t *pos, int H, int Hkv, int half, float eps,
                                    const __grid_constant__ rope_freqs f) {
    __shared__ float cs[ROPE_MAX_HALF], sn[ROPE_MAX_HALF];
    __shared__ __align__(16) float rows[QK_MAX_WARPS][2 * ROPE_MAX_HALF];
    const int t = blockIdx.x, Dh = 2 * half;
    rope_angles(cs, sn, pos[t], f, half);
    __syncthreads();
    const int warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    for (int hd = blockIdx.y * warps + warp; hd < H + Hkv; hd += warps * gridDim.y) {
        const bool is_q = hd < H;
        float *x = is_q ? q + ((int64_t)t * H + hd) * Dh : k + ((int64_t)t * Hkv + hd - H) * Dh;
        head_norm_rope<DT, VEC>(x, x, is_q ? q_norm : k_norm, rows[warp], cs, sn, half, eps);
    }
}

// The cache slot of token t (kv_store's lookup); a position past the page table traps.
__device__ __forceinline__ int64_t kv_slot(const attn_batch &b, int t) {
    const int p = b.pos[t];
    if (p < 0 || p / b.page_size >= b.max_pages) __trap();
    const int page = b.page_table[(int64_t)b.seq[t] * b.max_pages + p / b.page_size];
    return (int64_t)page * b.page_size + p % b.page_size;
}

// qkv_prepare: qk_norm_rope_kernel's blocks and head loop over the H + 2 Hkv heads of a row of
// qkv: q heads normed and rotated into q_out, k heads normed and rotated into the cache slot, v
// heads copied into it (a warp's one 16-byte access per lane for Dh = 128).
// The body is block (t, y) of ny blocks a token; dep as cuda_ops.h's pdl_dep (the wrapper below).
// KV: the cache's element (kv_types.cuh).
template <int DT, bool VEC, class KV, class DEP>
__device__ __forceinline__ void
qkv_prepare_block(int t, int y, int ny, DEP dep, float *q_out, KV *kc, KV *vc, const float *qkv,
                  const void *q_norm, const void *k_norm, const attn_batch &b, int H, int Hkv,
                  int half, float eps, const rope_freqs &f) {
    __shared__ float cs[ROPE_MAX_HALF], sn[ROPE_MAX_HALF];
    __shared__ __align__(16) float rows[QK_MAX_WARPS][2 * ROPE_MAX_HALF];
    const int Dh = 2 * half;
    dep.start();
    dep.wait();
    rope_angles(cs, sn, b.pos[t], f, half);
    const int64_t slot = kv_slot(b, t);
    __syncthreads();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const float *src_row = qkv + (int64_t)t * (H + 2 * Hkv) * Dh;
    for (int hd = y * warps + warp; hd < H + 2 * Hkv; hd += warps * ny) {
        const float *src = src_row + (int64_t)hd * Dh;
        if (hd < H) {
            head_norm_rope<DT, VEC>(q_out + ((int64_t)t * H + hd) * Dh, src, q_norm, rows[warp],
                                    cs, sn, half, eps);
        } else if (hd < H + Hkv) {
            head_norm_rope<DT, VEC, KV>(kc + (slot * Hkv + hd - H) * Dh, src, k_norm, rows[warp],
                                        cs, sn, half, eps);
        } else {
            KV *dst = vc + (slot * Hkv + hd - H - Hkv) * Dh;
            if constexpr (VEC) {
                for (int ch = lane; ch < Dh / 4; ch += 32)
                    kv_elem<KV>::put4(dst + 4 * ch, ((const float4 *)src)[ch]);
            } else {
                for (int c = lane; c < Dh; c += 32)
                    kv_elem<KV>::put(dst + c, src[c]);
            }
        }
    }
}

template <int DT, bool VEC, class KV>
__global__ void qkv_prepare_kernel(float *q_out, KV *kc, KV *vc, const float *qkv,
                                   const void *q_norm, const void *k_norm, attn_batch b, int H,
                                   int Hkv, int half, float eps,
                                   const __grid_constant__ rope_freqs f) {
    qkv_prepare_block<DT, VEC, KV>(blockIdx.x, blockIdx.y, gridDim.y, pdl_dep(), q_out, kc, vc, qkv,
                                   q_norm, k_norm, b, H, Hkv, half, eps, f);
}

template <int DT>
static void qk_norm_rope_launch(float *q, float *k, const void *q_norm, const void *k_norm,
                                const int32_t *pos, int T, int H, int Hkv, int Dh, float eps,
                                const rope_freqs &f) {
    // Few tokens: the heads of a token spread over blocks of QK_SMALL_WARPS warps, one head per
    // warp, so a decode step's 36 heads run at once instead of three at a time behind each other;
    // many tokens: one block per token of up to QK_MAX_WARPS warps, which computes the angles once.
    const int heads = H + Hkv, cap = T < QK_SPREAD_MAX_T ? QK_SMALL_WARPS : QK_MAX_WARPS;
    const int warps = heads < cap ? heads : cap;
    const dim3 grid(T, T < QK_SPREAD_MAX_T ? (heads + warps - 1) / warps : 1);
    cudaStream_t s = cuda_stream();
    if (Dh % 4 == 0 && aligned16(q) && aligned16(k))
        qk_norm_rope_kernel<DT, true>
            <<<grid, 32 * warps, 0, s>>>(q, k, q_norm, k_norm, pos, H, Hkv, Dh / 2, eps, f);
    else
        qk_norm_rope_kernel<DT, false>
            <<<grid, 32 * warps, 0, s>>>(q, k, q_norm, k_norm, pos, H, Hkv, Dh / 2, eps, f);
}

void cuda_qk_norm_rope(float *q, float *k, const tensor *q_norm, const tensor *k_norm,
                       const int32_t *pos, int T, int H, int Hkv, int Dh, double theta, float eps) {
    if (T <= 0) return;
    assert_weight(q_norm, "qk_norm_rope");
    assert_weight(k_norm, "qk_norm_rope");
    MS_ASSERT(tensor_numel(q_norm) == Dh && tensor_numel(k_norm) == Dh);
    MS_ASSERT(Dh % 2 == 0 && Dh / 2 <= ROPE_MAX_HALF && H + Hkv > 0);
    if (q_norm->dtype != k_norm->dtype) { // one dtype per kernel; the unfused ops give the same
        cuda_rmsnorm(q, q, q_norm, T * H, Dh, eps);
        cuda_rmsnorm(k, k, k_norm, T * Hkv, Dh, eps);
        cuda_rope(q, k, pos, T, H, Hkv, Dh, theta);
        return;
    }
    const rope_freqs &f = rope_freqs_for(theta, Dh);
    switch (q_norm->dtype) {
    case DTYPE_F32:
        qk_norm_rope_launch<DTYPE_F32>(q, k, q_norm->data, k_norm->data, pos, T, H, Hkv, Dh, eps,
                                       f);
        break;
    case DTYPE_BF16:
        qk_norm_rope_launch<DTYPE_BF16>(q, k, q_norm->data, k_norm->data, pos, T, H, Hkv, Dh, eps,
                                        f);
        break;
    default:
        qk_norm_rope_launch<DTYPE_F16>(q, k, q_norm->data, k_norm->data, pos, T, H, Hkv, Dh, eps,
                                       f);
        break;
    }
    CUDA_CHECK_LAUNCH();
}

void cuda_qkv_prepare(float *q_out, kv_layer kv, const float *qkv, const tensor *q_norm,
                      const tensor *k_norm, const attn_batch *b, int H, int Hkv, int Dh,
                      double theta, float eps) {
    const int T = b->T;
    if (T <= 0) return;
    assert_weight(q_norm, "qkv_prepare");
    assert_weight(k_norm, "qkv_prepare");
    MS_ASSERT(tensor_numel(q_norm) == Dh && tensor_numel(k_norm) == Dh);
    MS_ASSERT(Dh % 2 == 0 && Dh / 2 <= ROPE_MAX_HALF && H > 0 && Hkv > 0);
    if (q_norm->dtype != k_norm->dtype)
        cuda_fail(__FILE__, __LINE__, "qkv_prepare", "q_norm and k_norm differ in dtype");
    const rope_freqs &f = rope_freqs_for(theta, Dh);
    // qk_norm_rope_launch's block shapes, over H + 2 Hkv heads
    const int heads = H + 2 * Hkv, cap = T < QK_SPREAD_MAX_T ? QK_SMALL_WARPS : QK_MAX_WARPS;
    const int warps = heads < cap ? heads : cap;
    const dim3 grid(T, T < QK_SPREAD_MAX_T ? (heads + warps - 1) / warps : 1);
    const bool vec = Dh % 4 == 0 && aligned16(q_out) && aligned16(qkv) && aligned16(kv.k) &&
                     aligned16(kv.v);
#define QKV_LAUNCH(DT, KV)                                                                         \
    do {                                                                                           \
        KV *kc = reinterpret_cast<KV *>(kv.k), *vc = reinterpret_cast<KV *>(kv.v);                 \
        if (vec)                                                                                   \
            cuda_launch_pdl(qkv_prepare_kernel<DT, true, KV>, grid, 32 * warps, 0, q_out, kc, vc,  \
                            qkv, q_norm->data, k_norm->data, *b, H, Hkv, Dh / 2, eps, f);          \
        else                                                                                       \
            cuda_launch_pdl(qkv_prepare_kernel<DT, false, KV>, grid, 32 * warps, 0, q_out, kc, vc, \
                            qkv, q_norm->data, k_norm->data, *b, H, Hkv, Dh / 2, eps, f);          \
    } while (0)
#define QKV_LAUNCH_KV(DT)                                                                          \
    do {                                                                                           \
        if (kv.bf16)                                                                               \
            QKV_LAUNCH(DT, __nv_bfloat16);                                                         \
        else                                                                                       \
            QKV_LAUNCH(DT, float);                                                                 \
    } while (0)
    switch (q_norm->dtype) {
    case DTYPE_F32: QKV_LAUNCH_KV(DTYPE_F32); break;
    case DTYPE_BF16: QKV_LAUNCH_KV(DTYPE_BF16); break;
    default: QKV_LAUNCH_KV(DTYPE_F16); break;
    }
#undef QKV_LAUNCH_KV
#undef QKV_LAUNCH
    CUDA_CHECK_LAUNCH();
}

// ---- kv_store: k, v [T, Hkv, Dh] into the paged cache at (seq[t], pos[t]) ----

template <class KV>
__global__ void kv_store_kernel(KV *kc, KV *vc, const float *k, const float *v, attn_batch b,
                                int row) {
    const int t = blockIdx.x;
    const float *ks = k + (int64_t)t * row, *vs = v + (int64_t)t * row;
    // A decode token's row (Hkv Dh = 512 floats) is one float4 of k and one of v per thread:
    // loaded before the page lookup, so the two waits overlap.
    const bool one = (row & 3) == 0 && row / 4 <= (int)blockDim.x && aligned16(ks) && aligned16(vs);
    float4 k4 = make_float4(0.f, 0.f, 0.f, 0.f), v4 = k4;
    if (one && (int)threadIdx.x < row / 4) {
        k4 = ((const float4 *)ks)[threadIdx.x];
        v4 = ((const float4 *)vs)[threadIdx.x];
    }
    const int64_t slot = kv_slot(b, t);
    KV *kd = kc + slot * row, *vd = vc + slot * row;
    typedef kv_elem<KV> E;
    if (one && aligned16(kd) && aligned16(vd)) {
        if ((int)threadIdx.x < row / 4) {
            E::put4(kd + 4 * threadIdx.x, k4);
            E::put4(vd + 4 * threadIdx.x, v4);
        }
    } else if ((row & 3) == 0 && aligned16(ks) && aligned16(vs) && aligned16(kd) && aligned16(vd)) {
        for (int i = threadIdx.x; i < row / 4; i += blockDim.x) {
            E::put4(kd + 4 * i, ((const float4 *)ks)[i]);
            E::put4(vd + 4 * i, ((const float4 *)vs)[i]);
        }
    } else {
        for (int i = threadIdx.x; i < row; i += blockDim.x) {
            E::put(kd + i, ks[i]);
            E::put(vd + i, vs[i]);
        }
    }
}

void cuda_kv_store(kv_layer kv, const float *k, const float *v, const attn_batch *b, int Hkv,
                   int Dh) {
    if (b->T <= 0) return;
    const int row = Hkv * Dh, threads = row / 4 <= 128 ? 128 : row / 4 <= 256 ? 256 : 128;
    if (kv.bf16)
        kv_store_kernel<<<b->T, threads, 0, cuda_stream()>>>(
            reinterpret_cast<__nv_bfloat16 *>(kv.k), reinterpret_cast<__nv_bfloat16 *>(kv.v), k, v,
            *b, row);
    else
        kv_store_kernel<<<b->T, threads, 0, cuda_stream()>>>(kv.k, kv.v, k, v, *b, row);
    CUDA_CHECK_LAUNCH();
}

// ---- router_topk: softmax over E in fp32, the K largest, ties to the lower id ----

// The CPU's softmax_sum over a warp (kernels/cpu/router.c): lane l holds its partial sum; for off
// = 16, 8, 4, 2, 1 lane l < off adds lane l + off's; every lane gets lane 0's total.
__device__ __forceinline__ float warp_sum_halves(float s) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1)
        s = __fadd_rn(s, __shfl_down_sync(FULL_MASK, s, off));
    return __shfl_sync(FULL_MASK, s, 0);
}

// One warp per token. Shared memory per warp: probs [E], then the chosen weights [K].
__global__ void router_topk_kernel(int32_t *topk_ids, float *topk_w, const float *logits, int T,
                                   int E, int K, bool norm) {
    extern __shared__ float router_smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t t = (int64_t)blockIdx.x * ROUTER_WARPS + warp;
    if (t >= T) return;
    float *probs = router_smem + (int64_t)warp * (E + K);
    float *chosen = probs + E;
    const float *l = logits + t * E;

    float m = -INFINITY;
    for (int e = lane; e < E; e += 32)
        m = fmaxf(m, l[e]);
    for (int off = 16; off > 0; off >>= 1)
        m = fmaxf(m, __shfl_xor_sync(FULL_MASK, m, off));
    float sum = 0.0f; // softmax_sum's order: this lane's experts in turn, then the halves
    for (int e = lane; e < E; e += 32) {
        probs[e] = (float)exp((double)__fsub_rn(l[e], m));
        sum = __fadd_rn(sum, probs[e]);
    }
    sum = warp_sum_halves(sum);
    for (int e = lane; e < E; e += 32)
        probs[e] = __fdiv_rn(probs[e], sum);

    // Probabilities are >= 0, so -1 marks an expert already taken.
    for (int k = 0; k < K; k++) {
        float bp = -1.0f;
        int be = E;
        for (int e = lane; e < E; e += 32)
            if (probs[e] > bp) { // strict: the lowest id of equal values stays
                bp = probs[e];
                be = e;
            }
        for (int off = 16; off > 0; off >>= 1) {
            const float op = __shfl_xor_sync(FULL_MASK, bp, off);
            const int oe = __shfl_xor_sync(FULL_MASK, be, off);
            if (op > bp || (op == bp && oe < be)) {
                bp = op;
                be = oe;
            }
        }
        if (be < E && lane == (be & 31)) probs[be] = -1.0f; // the lane that owns expert be
        if (lane == 0) {
            topk_ids[t * K + k] = be;
            chosen[k] = bp;
        }
    }
    if (lane == 0) {
        float s = 0.0f;
        if (norm)
            for (int k = 0; k < K; k++)
                s = __fadd_rn(s, chosen[k]);
        for (int k = 0; k < K; k++)
            topk_w[t * K + k] = norm ? __fdiv_rn(chosen[k], s) : chosen[k];
    }
}

// router_topk_kernel for E <= 32 * NPL: the same arithmetic in the same order, with a lane's
// logits and probabilities in registers (loaded at once, not one dependent load at a time), and
// the K rounds over registers. Expert e = lane + 32 i lives in lane e % 32, slot i. One warp's
// token: l its E logits, ids and tw its K outputs.
template <int NPL>
__device__ __forceinline__ void router_topk_warp(int32_t *ids, float *tw, const float *l, int E,
                                                 int K, bool norm) {
    const int lane = threadIdx.x & 31;
    float v[NPL];
#pragma unroll
    for (int i = 0; i < NPL; i++)
        v[i] = lane + 32 * i < E ? l[lane + 32 * i] : -INFINITY;
    float m = -INFINITY;
#pragma unroll
    for (int i = 0; i < NPL; i++)
        m = fmaxf(m, v[i]);
    for (int off = 16; off > 0; off >>= 1)
        m = fmaxf(m, __shfl_xor_sync(FULL_MASK, m, off));
    float sum = 0.0f; // softmax_sum's order: this lane's experts in turn, then the halves
#pragma unroll
    for (int i = 0; i < NPL; i++)
        if (lane + 32 * i < E) {
            v[i] = (float)exp((double)__fsub_rn(v[i], m));
            sum = __fadd_rn(sum, v[i]);
        }
    sum = warp_sum_halves(sum);
#pragma unroll
    for (int i = 0; i < NPL; i++)
        v[i] = lane + 32 * i < E ? __fdiv_rn(v[i], sum) : -1.0f;

    // Each round takes the largest probability, the lowest id among equal ones, as two warp
    // reductions (redux.sync) rather than a butterfly of value and id: the key of a probability
    // p >= 0 is its bits (sign cleared) + 1, which order as the values do, 0 for one taken (-1)
    // or NaN, so the largest key is the largest p, and the lowest id among the lanes holding it
    // is the lowest id of that p (a lane offers its own lowest). No key above 0: bp -1, be E, as
    // the butterfly gave.
    float s = 0.0f, mine = 0.0f; // lane k keeps the k-th weight (K <= 32)
    for (int k = 0; k < K; k++) {
        unsigned kb = 0u;
        int be = E;
#pragma unroll
        for (int i = 0; i < NPL; i++) {
            const unsigned key = v[i] >= 0.0f ? (__float_as_uint(v[i]) & 0x7fffffffu) + 1u : 0u;
            if (key > kb) { // strict, in increasing id: the lowest id of equal values stays
                kb = key;
                be = lane + 32 * i;
            }
        }
        const unsigned top = __reduce_max_sync(FULL_MASK, kb);
        be = (int)__reduce_min_sync(FULL_MASK, kb == top ? (unsigned)be : (unsigned)E);
        const float bp = top ? __uint_as_float(top - 1u) : -1.0f;
#pragma unroll
        for (int i = 0; i < NPL; i++)
            if (be == lane + 32 * i) v[i] = -1.0f; // the lane that owns expert be
        if (lane == k) {
            ids[k] = be;
            mine = bp;
        }
        if (norm) s = __fadd_rn(s, bp); // every lane holds bp: the CPU's sum, in k order
    }
    if (lane < K) tw[lane] = norm ? __fdiv_rn(mine, s) : mine;
}

template <int NPL>
__global__ void router_topk_small_kernel(int32_t *topk_ids, float *topk_w, const float *logits,
                                         int T, int E, int K, bool norm) {
    const int warp = threadIdx.x >> 5;
    const int64_t t = (int64_t)blockIdx.x * ROUTER_WARPS + warp;
    if (t >= T) return;
    pdl_trigger();
    pdl_wait();
    router_topk_warp<NPL>(topk_ids + t * K, topk_w + t * K, logits + t * E, E, K, norm);
}

void cuda_router_topk(int32_t *topk_ids, float *topk_w, const float *logits, int T, int E, int K,
                      bool norm) {
    if (T <= 0) return;
    MS_ASSERT(K >= 1 && K <= E);
    const int blocks = (T + ROUTER_WARPS - 1) / ROUTER_WARPS;
    if (K <= 32 && E <= 256) {
        if (E <= 128)
            cuda_launch_pdl(router_topk_small_kernel<4>, blocks, 32 * ROUTER_WARPS, 0, topk_ids,
                            topk_w, logits, T, E, K, norm);
        else
            cuda_launch_pdl(router_topk_small_kernel<8>, blocks, 32 * ROUTER_WARPS, 0, topk_ids,
                            topk_w, logits, T, E, K, norm);
        CUDA_CHECK_LAUNCH();
        return;
    }
    const size_t smem = (size_t)ROUTER_WARPS * (E + K) * sizeof(float);
    MS_ASSERT(smem <= 48 * 1024); // E up to ~3000: far above any router
    router_topk_kernel<<<blocks, 32 * ROUTER_WARPS, smem, cuda_stream()>>>(topk_ids, topk_w, logits,
                                                                           T, E, K, norm);
    CUDA_CHECK_LAUNCH();
}

// ---- moe_finalize: out[T, D] = sum over k = 0..K-1 of topk_w[t, k] * expert_out[t, k, :] ----

// The finalize sum of one 4-element chunk: sum over k = 0..K-1, in that order, of w[k] * src[k *
// stride] (src: the chunk in slot 0; stride: float4s between slots). Slots go in groups of
// FIN_BATCH, each group's loads issued before its sums: one wait per group rather than per slot.
__device__ __forceinline__ float4 finalize4(const float4 *src, const float *w, int K,
                                            int64_t stride) {
    float4 o = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int k0 = 0; k0 < K; k0 += FIN_BATCH) {
        float wk[FIN_BATCH];
        float4 v[FIN_BATCH];
#pragma unroll
        for (int j = 0; j < FIN_BATCH; j++)
            if (k0 + j < K) {
                wk[j] = w[k0 + j];
                v[j] = src[(int64_t)(k0 + j) * stride];
            }
#pragma unroll
        for (int j = 0; j < FIN_BATCH; j++)
            if (k0 + j < K) {
                o.x = __fadd_rn(o.x, __fmul_rn(wk[j], v[j].x));
                o.y = __fadd_rn(o.y, __fmul_rn(wk[j], v[j].y));
                o.z = __fadd_rn(o.z, __fmul_rn(wk[j], v[j].z));
                o.w = __fadd_rn(o.w, __fmul_rn(wk[j], v[j].w));
            }
    }
    return o;
}

// ---- the row kernel: add_rmsnorm for a few rows, and moe_finalize_add_rmsnorm ----

// One block of ROW_THREADS per row, so a decode step's single row is spread over 256 threads
// rather than one warp. Thread i owns chunks i, i + ROW_THREADS, ... (at most CPT): it loads
// x, the addend (o, or with FIN the finalize sum of expert_out with finalize4) and the norm
// weights before storing anything, adds with add4, and sums its chunks' squares in turn: with
// ROW_THREADS = 256 that is partial i of the order above (norm_fold). Warp 0 then folds the
// partials and adds them as add_rmsnorm_keep_kernel's warp does, so the bits are add_rmsnorm's
// (with FIN: moe_finalize's followed by add_rmsnorm's). x, h, o 16-byte aligned, D % 4 == 0,
// D / 4 <= CPT ROW_THREADS.
// The body is row t's block; dep as cuda_ops.h's pdl_dep (the wrapper below).
template <int DT, int CPT, bool FIN, class DEP>
__device__ __forceinline__ void add_rmsnorm_row_block(int64_t t, DEP dep, float *x, float *h,
                                                      const float *o, const float *topk_w, int K,
                                                      const void *w, int D, float eps) {
    static_assert(ROW_THREADS == 32 * NORM_PARTS, "a thread a partial of the sum");
    __shared__ double part[ROW_THREADS];
    __shared__ float row_inv;
    const int n_chunks = D / 4;
    float4 *xr = (float4 *)(x + t * D), *hr = (float4 *)(h + t * D);
    float4 xv[CPT], ov[CPT], wv[CPT];
    dep.start();
#pragma unroll
    for (int i = 0; i < CPT; i++) // the weights before the wait for the kernel before
        if (threadIdx.x + i * ROW_THREADS < n_chunks)
            wv[i] = load_w4<DT>(w, 4 * (threadIdx.x + i * ROW_THREADS));
    dep.wait();
#pragma unroll
    for (int i = 0; i < CPT; i++) {
        const int ch = threadIdx.x + i * ROW_THREADS;
        if (ch < n_chunks) {
            xv[i] = xr[ch];
            if constexpr (!FIN) ov[i] = ((const float4 *)(o + t * D))[ch];
        }
    }
    if constexpr (FIN) {
        const float4 *src = (const float4 *)(o + t * K * D);
#pragma unroll
        for (int i = 0; i < CPT; i++) {
            const int ch = threadIdx.x + i * ROW_THREADS;
            if (ch < n_chunks) ov[i] = finalize4(src + ch, topk_w + t * K, K, n_chunks);
        }
    }
    double ss = 0.0;
#pragma unroll
    for (int i = 0; i < CPT; i++) {
        const int ch = threadIdx.x + i * ROW_THREADS;
        if (ch < n_chunks) {
            xv[i] = add4(xv[i], ov[i]);
            xr[ch] = xv[i];
            ss = norm_sq4(ss, xv[i]);
        }
    }
    part[threadIdx.x] = ss;
    __syncthreads();
    if (threadIdx.x < 32) {
        double sp[NORM_PARTS];
#pragma unroll
        for (int j = 0; j < NORM_PARTS; j++)
            sp[j] = part[threadIdx.x + 32 * j];
        const float inv = norm_inv(norm_fold(sp), D, eps);
        if (threadIdx.x == 0) row_inv = inv;
    }
    __syncthreads();
    const float inv = row_inv;
#pragma unroll
    for (int i = 0; i < CPT; i++) {
        const int ch = threadIdx.x + i * ROW_THREADS;
        if (ch < n_chunks) hr[ch] = norm_scale4w(xv[i], inv, wv[i]);
    }
}

template <int DT, int CPT, bool FIN>
__global__ void __launch_bounds__(ROW_THREADS)
    add_rmsnorm_row_kernel(float *x, float *h, const float *o, const float *topk_w, int K,
                           const void *w, int D, float eps) {
    add_rmsnorm_row_block<DT, CPT, FIN>(blockIdx.x, pdl_dep(), x, h, o, topk_w, K, w, D, eps);
}

// The row kernel for T rows (o: the addend, or with topk_w the experts' outputs [T, K, D] to
// finalize); false when the shapes or the alignment do not fit it.
static bool add_rmsnorm_row_launch(float *x, float *h, const float *o, const float *topk_w, int K,
                                   const tensor *w, int T, int D, float eps) {
    const int n_chunks = D / 4, cpt = (n_chunks + ROW_THREADS - 1) / ROW_THREADS;
    if (D % 4 != 0 || cpt > 8 || !aligned16(x) || !aligned16(h) || !aligned16(o)) return false;
#define ROW_LAUNCH(DT, CPT)                                                                        \
    do {                                                                                           \
        if (topk_w)                                                                                \
            cuda_launch_pdl(add_rmsnorm_row_kernel<DT, CPT, true>, T, ROW_THREADS, 0, x, h, o,    \
                            topk_w, K, w->data, D, eps);                                           \
        else                                                                                       \
            cuda_launch_pdl(add_rmsnorm_row_kernel<DT, CPT, false>, T, ROW_THREADS, 0, x, h, o,   \
                            topk_w, K, w->data, D, eps);                                           \
    } while (0)
#define ROW_LAUNCH_CPT(DT)                                                                         \
    do {                                                                                           \
        if (cpt <= 1) ROW_LAUNCH(DT, 1);                                                           \
        else if (cpt <= 2) ROW_LAUNCH(DT, 2);                                                      \
        else if (cpt <= 4) ROW_LAUNCH(DT, 4);                                                      \
        else ROW_LAUNCH(DT, 8);                                                                    \
    } while (0)
    switch (w->dtype) {
    case DTYPE_F32: ROW_LAUNCH_CPT(DTYPE_F32); break;
    case DTYPE_BF16: ROW_LAUNCH_CPT(DTYPE_BF16); break;
    default: ROW_LAUNCH_CPT(DTYPE_F16); break;
    }
#undef ROW_LAUNCH_CPT
#undef ROW_LAUNCH
    return true;
}

template <bool VEC>
__global__ void moe_finalize_kernel(float *out, const float *eo, const float *topk_w, int T, int K,
                                    int D) {
    const int W = VEC ? 4 : 1; // elements per thread step
    const int64_t per_row = D / W, n = (int64_t)T * per_row;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t t = i / per_row, d = (i - t * per_row) * W;
        const float *w = topk_w + t * K;
        const float *src = eo + t * K * D + d;
        if constexpr (VEC) {
            const float4 o = finalize4((const float4 *)src, w, K, D / 4);
            *(float4 *)(out + t * D + d) = o;
        } else {
            float o = 0.0f;
            for (int k = 0; k < K; k++)
                o = __fadd_rn(o, __fmul_rn(w[k], src[(int64_t)k * D]));
            out[t * D + d] = o;
        }
    }
}

void cuda_moe_finalize(float *out, const float *expert_out, const float *topk_w, int T, int K,
                       int D) {
    if (T <= 0 || D <= 0) return;
    if (D % 4 == 0 && aligned16(out) && aligned16(expert_out))
        moe_finalize_kernel<true><<<ew_blocks((int64_t)T * D / 4), EW_THREADS, 0, cuda_stream()>>>(
            out, expert_out, topk_w, T, K, D);
    else
        moe_finalize_kernel<false><<<ew_blocks((int64_t)T * D), EW_THREADS, 0, cuda_stream()>>>(
            out, expert_out, topk_w, T, K, D);
    CUDA_CHECK_LAUNCH();
}

// ---- moe_finalize_add_rmsnorm: x += finalize(expert_out), h = rmsnorm(x) * w ----

void cuda_moe_finalize_add_rmsnorm(float *x, float *h, const float *expert_out,
                                   const float *topk_w, const tensor *w, int T, int K, int D,
                                   float eps) {
    if (T <= 0) return;
    assert_weight(w, "moe_finalize_add_rmsnorm");
    MS_ASSERT(tensor_numel(w) == D);
    if (!add_rmsnorm_row_launch(x, h, expert_out, topk_w, K, w, T, D, eps))
        cuda_fail(__FILE__, __LINE__, "moe_finalize_add_rmsnorm",
                  "rows must be 16-byte aligned, D % 4 == 0 and D <= 8192");
    CUDA_CHECK_LAUNCH();
}

// ---- silu_mul and add: flat passes over n elements ----

__device__ __forceinline__ float silu_mul_one(float g, float u) {
    return __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))), u);
}

template <bool VEC>
__global__ void silu_mul_kernel(float *out, const float *gate, const float *up, int64_t n) {
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if constexpr (VEC) {
        for (; i < n / 4; i += stride) {
            const float4 g = ((const float4 *)gate)[i], u = ((const float4 *)up)[i];
            ((float4 *)out)[i] = make_float4(silu_mul_one(g.x, u.x), silu_mul_one(g.y, u.y),
                                             silu_mul_one(g.z, u.z), silu_mul_one(g.w, u.w));
        }
        i = n / 4 * 4 + (int64_t)blockIdx.x * blockDim.x + threadIdx.x; // the tail, < 4 elements
        if (i < n) out[i] = silu_mul_one(gate[i], up[i]);
    } else {
        for (; i < n; i += stride)
            out[i] = silu_mul_one(gate[i], up[i]);
    }
}

void cuda_silu_mul(float *out, const float *gate, const float *up, int T, int F) {
    const int64_t n = (int64_t)T * F;
    if (n <= 0) return;
    if (aligned16(out) && aligned16(gate) && aligned16(up))
        silu_mul_kernel<true><<<ew_blocks(n / 4), EW_THREADS, 0, cuda_stream()>>>(out, gate, up, n);
    else
        silu_mul_kernel<false><<<ew_blocks(n), EW_THREADS, 0, cuda_stream()>>>(out, gate, up, n);
    CUDA_CHECK_LAUNCH();
}

template <bool VEC>
__global__ void add_kernel(float *out, const float *a, const float *b, int64_t n) {
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if constexpr (VEC) {
        for (; i < n / 4; i += stride) {
            const float4 x = ((const float4 *)a)[i], y = ((const float4 *)b)[i];
            ((float4 *)out)[i] = make_float4(__fadd_rn(x.x, y.x), __fadd_rn(x.y, y.y),
                                             __fadd_rn(x.z, y.z), __fadd_rn(x.w, y.w));
        }
        i = n / 4 * 4 + (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
        if (i < n) out[i] = __fadd_rn(a[i], b[i]);
    } else {
        for (; i < n; i += stride)
            out[i] = __fadd_rn(a[i], b[i]);
    }
}

void cuda_add(float *out, const float *a, const float *b, int64_t n) {
    if (n <= 0) return;
    if (aligned16(out) && aligned16(a) && aligned16(b))
        add_kernel<true><<<ew_blocks(n / 4), EW_THREADS, 0, cuda_stream()>>>(out, a, b, n);
    else
        add_kernel<false><<<ew_blocks(n), EW_THREADS, 0, cuda_stream()>>>(out, a, b, n);
    CUDA_CHECK_LAUNCH();
}

// ---- moe_input_quant: each token through an all-to-all payload's round trip ----
//
// The routed experts' input format (kernels/ops.h): y = decode(encode(x)) per token, with
// kernels/a2a.c's payload formulas (quant_fp8_rows / quant_nvfp4 then their dequantization,
// kernels/cpu/quant.c) and kernels/quant.h's element conversions, in the same order with the same
// roundings (no contraction: __fdiv_rn / __fmul_rn). Group maxima are order-free (NaN never wins,
// as the CPU's amax), so the thread split cannot change a bit. One block per token.

__device__ __forceinline__ float amax_one(float m, float v) {
    const float a = fabsf(v);
    return a > m ? a : m; // NaN never wins
}

__device__ __forceinline__ float warp_amax(float m) {
    for (int off = 16; off > 0; off >>= 1)
        m = fmaxf(m, __shfl_xor_sync(FULL_MASK, m, off));
    return m;
}

// FP8: a warp per group of QUANT_FP8_GROUP channels (the last one may be shorter). Launched with
// PDL, as the NVFP4 kernel below.
__global__ void moe_input_fp8_kernel(float *y, const float *x, int D) {
    pdl_wait();
    pdl_trigger();
    const int64_t t = blockIdx.x;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const float *xr = x + t * D;
    float *yr = y + t * D;
    const int G = (D + QUANT_FP8_GROUP - 1) / QUANT_FP8_GROUP;
    constexpr int PER = QUANT_FP8_GROUP / 32;
    for (int g = warp; g < G; g += nw) {
        const int c0 = g * QUANT_FP8_GROUP, n = min(QUANT_FP8_GROUP, D - c0);
        float v[PER], a = 0.0f;
#pragma unroll
        for (int i = 0; i < PER; i++) {
            const int c = lane + 32 * i;
            v[i] = c < n ? xr[c0 + c] : 0.0f;
            if (c < n) a = amax_one(a, v[i]);
        }
        fp8_roundtrip(v, warp_amax(a));
#pragma unroll
        for (int i = 0; i < PER; i++) {
            const int c = lane + 32 * i;
            if (c < n) yr[c0 + c] = v[i];
        }
    }
}

// NVFP4: the token's scale s2 from its amax (a block reduction), then four lanes per group of
// QUANT_FP4_GROUP channels, a float4 each (the group's amax over the four by shuffles): the same
// per-value arithmetic as kernels/cpu/quant.c. D % QUANT_FP4_GROUP == 0; blockDim a multiple of
// 32. Launched with PDL: it waits for x's writer, and the experts' GEMM 1 may start behind it.
__global__ void moe_input_nvfp4_kernel(float *y, const float *x, int D) {
    __shared__ float wmax[32];
    pdl_wait();
    pdl_trigger();
    const int64_t t = blockIdx.x;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const float4 *xr = reinterpret_cast<const float4 *>(x + t * D);
    float4 *yr = reinterpret_cast<float4 *>(y + t * D);
    const int n4 = D / 4;
    float a = 0.0f;
    for (int c = threadIdx.x; c < n4; c += blockDim.x) {
        const float4 v = xr[c];
        a = amax_one(amax_one(amax_one(amax_one(a, v.x), v.y), v.z), v.w);
    }
    a = warp_amax(a);
    if (lane == 0) wmax[warp] = a;
    __syncthreads();
    a = lane < nw ? wmax[lane] : 0.0f;
    const float s2 = nvfp4_token_scale(warp_amax(a));
    for (int c0 = 0; c0 < n4; c0 += blockDim.x) { // every lane of a warp in each round
        const int c = c0 + threadIdx.x;
        const bool in = c < n4;
        const float4 q4 = in ? xr[c] : make_float4(0.f, 0.f, 0.f, 0.f);
        float v[4] = {q4.x, q4.y, q4.z, q4.w}, m = 0.0f;
#pragma unroll
        for (int i = 0; i < 4; i++)
            m = amax_one(m, v[i]);
        m = fmaxf(m, __shfl_xor_sync(FULL_MASK, m, 1));
        m = fmaxf(m, __shfl_xor_sync(FULL_MASK, m, 2));
        nvfp4_roundtrip(v, m, s2);
        if (in) yr[c] = make_float4(v[0], v[1], v[2], v[3]);
    }
}

void cuda_moe_input_quant(float *y, const float *x, int T, int D, int payload) {
    if (T <= 0 || D <= 0) return;
    switch (payload) {
    case A2A_PAYLOAD_F32:
        if (y != x)
            CUDA_CHECK(cudaMemcpyAsync(y, x, (size_t)T * D * sizeof(float),
                                       cudaMemcpyDeviceToDevice, cuda_stream()));
        return;
    case A2A_PAYLOAD_FP8:
        cuda_launch_pdl(moe_input_fp8_kernel, T, 256, 0, y, x, D);
        break;
    case A2A_PAYLOAD_NVFP4:
        if (D % QUANT_FP4_GROUP != 0)
            cuda_fail(__FILE__, __LINE__, "moe_input_quant", "nvfp4 needs D % 16 == 0");
        cuda_launch_pdl(moe_input_nvfp4_kernel, T, D / 4 < 1024 ? (D / 4 + 31) / 32 * 32 : 1024,
                        0, y, x, D);
        break;
    default:
        cuda_fail(__FILE__, __LINE__, "moe_input_quant",
                  "payload must be f32, fp8 or nvfp4 (the experts' formats)");
    }
    CUDA_CHECK_LAUNCH();
}
