/* linear: out[T, N] = x[T, Kin] w[N, Kin]^T, the hot path of the CPU backend.
 *
 * Choices:
 * - Weights are read in their own dtype and widened to fp32 a block at a time into a local array
 *   (BF16 is the top half of an fp32, so widening is a 16-bit shift); an fp32 copy of the weights
 *   would double both their memory and the bytes every decode step has to stream.
 * - Each (token, row) dot product keeps LINEAR_LANES fp32 accumulators, written as plain loops over
 *   a lane index with fmaf so gcc vectorizes them without -ffast-math; the lanes are summed
 *   pairwise and the Kin % LINEAR_LANES tail is added last, in index order. That order depends on
 *   Kin only, so a token's output is bit-identical for any T, any tiling and any thread count.
 * - Tokens are taken LINEAR_TILE at a time: one widened weight block feeds every token of the tile,
 *   so a weight row is loaded once per tile rather than once per token.
 * - OpenMP splits N into blocks of LINEAR_ROW_BLOCK rows with a static schedule: at T = 1 the op is
 *   a stream over the weights and the static split gives each core one contiguous slab. For T > 1 a
 *   block's rows stay in cache while every token tile passes over them.
 * - A software prefetch runs LINEAR_PREFETCH bytes ahead of the weight stream (see row_tile).
 * - Sanitizer builds (make asan, make fuzz) leave the inner loops below uninstrumented
 *   (CPU_HOT): with a check on every load they neither vectorize nor keep their accumulators
 *   in registers, and ran 20-30x slower, most of a sanitized end-to-end test's time. In their
 *   place cpu_linear_ex asks AddressSanitizer about every byte of x, w and out before the loops
 *   run (linear_check_extents, cpu_check_region in cpu_ops.h): an operand shorter than its
 *   shape is still reported, at the call. */
#include <math.h>
#include <omp.h>
#include <string.h>

#include "kernels/cpu/cpu_ops.h"

#define LINEAR_LANES     32   /* fp32 accumulators per token: 4 AVX2 or 2 AVX-512 registers */
#define LINEAR_TILE      4    /* tokens sharing one widened weight block */
#define LINEAR_ROW_BLOCK 16   /* rows per OpenMP work item */
#define LINEAR_PREFETCH  2048 /* bytes of weights requested ahead of the block being read */

/* dst[LINEAR_LANES] = w[off .. off + LINEAR_LANES) as fp32, for the 16-bit dtypes. */
static inline __attribute__((always_inline)) CPU_HOT void widen_block(float *dst, const void *w,
                                                                      int64_t off, dtype dt) {
    if (dt == DTYPE_BF16) {
        const uint16_t *p = (const uint16_t *)w + off;
        for (int j = 0; j < LINEAR_LANES; j++) {
            uint32_t u = (uint32_t)p[j] << 16;
            memcpy(&dst[j], &u, sizeof u);
        }
    } else {
        const uint16_t *p = (const uint16_t *)w + off;
        for (int j = 0; j < LINEAR_LANES; j++)
            dst[j] = f16_to_f32(p[j]);
    }
}

static inline __attribute__((always_inline)) CPU_HOT float widen_one(const void *w, int64_t i,
                                                                     dtype dt) {
    if (dt == DTYPE_BF16) return bf16_to_f32(((const uint16_t *)w)[i]);
    if (dt == DTYPE_F32) return ((const float *)w)[i];
    return f16_to_f32(((const uint16_t *)w)[i]);
}

/* out[t * ldo] = dot(x[t * ldx, 0:Kin], wrow[0:Kin]) for t < nt (nt <= LINEAR_TILE). Called with
 * constant nt and dt so each instance is specialized and its accumulators stay in registers. */
static inline __attribute__((always_inline)) CPU_HOT void row_tile(float *out, int64_t ldo,
                                                                   const float *x, int64_t ldx,
                                                                   const void *wrow, dtype dt,
                                                                   int nt, int Kin) {
    float acc[LINEAR_TILE][LINEAR_LANES];
    for (int t = 0; t < nt; t++)
        for (int j = 0; j < LINEAR_LANES; j++)
            acc[t][j] = 0.0f;

    const int esize = dt == DTYPE_F32 ? 4 : 2;
    float wf[LINEAR_LANES];
    int k = 0;
    for (; k + LINEAR_LANES <= Kin; k += LINEAR_LANES) {
        /* The hardware prefetcher alone leaves a third of the bandwidth unused at T = 1 on the
         * machines measured; asking for the line LINEAR_PREFETCH bytes ahead closes most of it.
         * Past the row's end this runs into the next row of the same slab, as intended. */
        const char *wb = (const char *)wrow + (int64_t)k * esize;
        for (int b = 0; b < LINEAR_LANES * esize; b += 64)
            __builtin_prefetch(wb + LINEAR_PREFETCH + b);
        /* F32 weights are used in place; the 16-bit ones are widened into wf. */
        const float *wk = wf;
        if (dt == DTYPE_F32)
            wk = (const float *)wrow + k;
        else
            widen_block(wf, wrow, k, dt);
        for (int t = 0; t < nt; t++) {
            const float *xt = x + t * ldx + k;
            for (int j = 0; j < LINEAR_LANES; j++)
                acc[t][j] = fmaf(xt[j], wk[j], acc[t][j]);
        }
    }

    for (int t = 0; t < nt; t++) {
        for (int w = LINEAR_LANES / 2; w > 0; w /= 2)
            for (int j = 0; j < w; j++)
                acc[t][j] += acc[t][j + w];
        float s = acc[t][0];
        for (int kk = k; kk < Kin; kk++)
            s = fmaf(x[t * ldx + kk], widen_one(wrow, kk, dt), s);
        out[t * ldo] = s;
    }
}

/* Row blocks [nb0, nb1) of the op for one weight dtype, over every token. */
static inline __attribute__((always_inline)) CPU_HOT void row_blocks(float *out, const float *x,
                                                                     const void *w, dtype dt, int T,
                                                                     int N, int Kin, int nb0,
                                                                     int nb1) {
    const size_t row_bytes = (size_t)Kin * dtype_size(dt);
    for (int nb = nb0; nb < nb1; nb++) {
        const int n0 = nb * LINEAR_ROW_BLOCK;
        const int n1 = n0 + LINEAR_ROW_BLOCK < N ? n0 + LINEAR_ROW_BLOCK : N;
        int t0 = 0;
        for (; t0 + LINEAR_TILE <= T; t0 += LINEAR_TILE)
            for (int n = n0; n < n1; n++)
                row_tile(out + (int64_t)t0 * N + n, N, x + (int64_t)t0 * Kin, Kin,
                         (const char *)w + n * row_bytes, dt, LINEAR_TILE, Kin);
        for (; t0 < T; t0++)
            for (int n = n0; n < n1; n++)
                row_tile(out + (int64_t)t0 * N + n, N, x + (int64_t)t0 * Kin, Kin,
                         (const char *)w + n * row_bytes, dt, 1, Kin);
    }
}

/* One specialization per dtype. The OpenMP region stays outside them: gcc outlines a parallel
 * region before it inlines, which would turn the constant dtype back into a runtime value. */
typedef void (*row_blocks_fn)(float *, const float *, const void *, int, int, int, int, int);

static CPU_HOT void row_blocks_bf16(float *out, const float *x, const void *w, int T, int N,
                                    int Kin, int nb0, int nb1) {
    row_blocks(out, x, w, DTYPE_BF16, T, N, Kin, nb0, nb1);
}

static CPU_HOT void row_blocks_f32(float *out, const float *x, const void *w, int T, int N, int Kin,
                                   int nb0, int nb1) {
    row_blocks(out, x, w, DTYPE_F32, T, N, Kin, nb0, nb1);
}

static CPU_HOT void row_blocks_f16(float *out, const float *x, const void *w, int T, int N, int Kin,
                                   int nb0, int nb1) {
    row_blocks(out, x, w, DTYPE_F16, T, N, Kin, nb0, nb1);
}

/* The operands' extents, byte by byte, for the sanitizer builds (see cpu_check_region). */
static void linear_check_extents(const float *out, const float *x, const tensor *w, int T, int N,
                                 int Kin) {
    cpu_check_region(x, (size_t)T * (size_t)Kin * sizeof(float));
    cpu_check_region(out, (size_t)T * (size_t)N * sizeof(float));
    cpu_check_region(w->data, tensor_nbytes(w));
}

void cpu_linear_ex(float *out, const float *x, const tensor *w, int T, int N, int Kin,
                   bool threaded) {
    if (T <= 0 || N <= 0) return;
    CPU_ASSERT_WEIGHT(w, "linear");
    MS_ASSERT(tensor_numel(w) == (int64_t)N * Kin);
    linear_check_extents(out, x, w, T, N, Kin);
    const row_blocks_fn fn = w->dtype == DTYPE_BF16  ? row_blocks_bf16
                             : w->dtype == DTYPE_F32 ? row_blocks_f32
                                                     : row_blocks_f16;
    const int n_blocks = (N + LINEAR_ROW_BLOCK - 1) / LINEAR_ROW_BLOCK;
    if (!threaded) {
        fn(out, x, w->data, T, N, Kin, 0, n_blocks);
        return;
    }
    /* Static split: each thread gets one contiguous slab of rows, the same slab every call. */
#pragma omp parallel
    {
        const int nth = omp_get_num_threads(), id = omp_get_thread_num();
        const int nb0 = (int)((int64_t)n_blocks * id / nth);
        const int nb1 = (int)((int64_t)n_blocks * (id + 1) / nth);
        fn(out, x, w->data, T, N, Kin, nb0, nb1);
    }
}

/* out[T, N] = x[T, Kin] w[N, Kin]^T; threads over N. */
void cpu_linear(float *out, const float *x, const tensor *w, int T, int N, int Kin) {
    cpu_linear_ex(out, x, w, T, N, Kin, true);
}
