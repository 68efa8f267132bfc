/* rmsnorm, as Hugging Face's Qwen3MoeRMSNorm computes it in fp32: r = 1 / sqrt(mean(x^2) + eps),
 * then (x * r) * w. The sum of squares is accumulated in double, in index order, so it is exact
 * enough that its order does not matter and depends on nothing but the row. Rows are independent,
 * so OpenMP splits them; one row is only C values, so small batches stay on one thread.
 *
 * The two fused ops that end in a norm live here too, each defined as the unfused sequence it
 * replaces and giving its exact bits:
 * - add_rmsnorm adds the residual while it sums the squares: each sum is the one fp32 add of
 *   cpu_add, and the squares are then accumulated in the same order as cpu_rmsnorm's, so one pass
 *   per row gives what add then rmsnorm give in two.
 * - qk_norm_rope is the q norm, the k norm and rope called in that order. On the CPU these passes
 *   over q and k are small beside the projections that make them; the fusion is the GPU's (one
 *   launch instead of three, q and k read and written once). */
#include <math.h>

#include "kernels/cpu/cpu_ops.h"

/* Below this many elements in all, OpenMP costs more than it saves. */
#define RMSNORM_PARALLEL_MIN (1 << 16)

/* 1 / sqrt(mean + eps) of a row of C values whose squares sum to ss. */
static inline float rmsnorm_inv(double ss, int C, float eps) {
    const float ms = (float)(ss / C);
    return 1.0f / sqrtf(ms + eps);
}

/* o[C] = (x[C] * inv) * w[C]; o may equal x. */
static inline void rmsnorm_scale(float *o, const float *x, float inv, const tensor *w, int C) {
    for (int c = 0; c < C; c++)
        o[c] = (x[c] * inv) * tensor_get_f32(w, c);
}

/* out[R, C] = x[R, C] / sqrt(mean(x^2) + eps) * w[C]; out may equal x. */
void cpu_rmsnorm(float *out, const float *x, const tensor *w, int R, int C, float eps) {
    if (R <= 0) return;
    CPU_ASSERT_WEIGHT(w, "rmsnorm");
    MS_ASSERT(tensor_numel(w) == C);
#pragma omp parallel for schedule(static) if ((int64_t)R * C >= RMSNORM_PARALLEL_MIN)
    for (int r = 0; r < R; r++) {
        const float *xr = x + (int64_t)r * C;
        double ss = 0.0;
        for (int c = 0; c < C; c++)
            ss += (double)xr[c] * xr[c];
        rmsnorm_scale(out + (int64_t)r * C, xr, rmsnorm_inv(ss, C, eps), w, C);
    }
}

/* x[T, D] += o[T, D]; h[T, D] = x / sqrt(mean(x^2) + eps) * w[D]. h overlaps neither x nor o. */
void cpu_add_rmsnorm(float *x, float *h, const float *o, const tensor *w, int T, int D, float eps) {
    if (T <= 0) return;
    CPU_ASSERT_WEIGHT(w, "add_rmsnorm");
    MS_ASSERT(tensor_numel(w) == D);
#pragma omp parallel for schedule(static) if ((int64_t)T * D >= RMSNORM_PARALLEL_MIN)
    for (int t = 0; t < T; t++) {
        float *xr = x + (int64_t)t * D;
        const float *orow = o + (int64_t)t * D;
        double ss = 0.0;
        for (int c = 0; c < D; c++) {
            const float v = xr[c] + orow[c]; /* cpu_add's one fp32 add */
            xr[c] = v;
            ss += (double)v * v;
        }
        rmsnorm_scale(h + (int64_t)t * D, xr, rmsnorm_inv(ss, D, eps), w, D);
    }
}

/* q[T, H, Dh] and k[T, Hkv, Dh]: every head normed (q_norm, k_norm [Dh]), then rotated at pos. */
void cpu_qk_norm_rope(float *q, float *k, const tensor *q_norm, const tensor *k_norm,
                      const int32_t *pos, int T, int H, int Hkv, int Dh, double theta, float eps) {
    if (T <= 0) return;
    cpu_rmsnorm(q, q, q_norm, T * H, Dh, eps);
    cpu_rmsnorm(k, k, k_norm, T * Hkv, Dh, eps);
    cpu_rope(q, k, pos, T, H, Hkv, Dh, theta);
}
