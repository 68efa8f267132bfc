/* rmsnorm, as Hugging Face's Qwen3MoeRMSNorm computes it in fp32: r = 1 / sqrt(mean(x^2) + eps),
 * then (x * r) * w. The sum of squares is accumulated in double, in index order, so it is exact
 * enough that its order does not matter and depends on nothing but the row. Rows are independent,
 * so OpenMP splits them; one row is only C values, so small batches stay on one thread. */
#include <math.h>

#include "kernels/cpu/cpu_ops.h"

/* out[R, C] = x[R, C] / sqrt(mean(x^2) + eps) * w[C]; out may equal x. */
void cpu_rmsnorm(float *out, const float *x, const tensor *w, int R, int C, float eps) {
    if (R <= 0) return;
    CPU_ASSERT_WEIGHT(w, "rmsnorm");
    MS_ASSERT(tensor_numel(w) == C);
#pragma omp parallel for schedule(static) if ((int64_t)R * C >= (1 << 16))
    for (int r = 0; r < R; r++) {
        const float *xr = x + (int64_t)r * C;
        float *o = out + (int64_t)r * C;
        double ss = 0.0;
        for (int c = 0; c < C; c++)
            ss += (double)xr[c] * xr[c];
        const float ms = (float)(ss / C);
        const float inv = 1.0f / sqrtf(ms + eps);
        for (int c = 0; c < C; c++)
            o[c] = (xr[c] * inv) * tensor_get_f32(w, c);
    }
}
