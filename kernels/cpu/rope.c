/* rope: rotate-half (NeoX) rotary embedding, in place, computed the way Hugging Face's Qwen3-MoE
 * computes it in fp32 so that large positions agree with it too:
 *   inv_freq[j] = 1 / theta^((2j) / Dh)     every step in fp32, j < Dh/2
 *   angle       = (float)pos * inv_freq[j]  one fp32 multiply
 *   cos, sin of the fp32 angle; x'[j] = x[j] cos - x[j + Dh/2] sin,
 *                               x'[j + Dh/2] = x[j + Dh/2] cos + x[j] sin.
 * At position 1e5 one ulp of the fp32 angle is about 0.008 rad, so computing the angle in double
 * would not be more accurate, only different from the model's training-time reference. */
#include <math.h>

#include "kernels/cpu/cpu_ops.h"

/* Rotate n_heads heads of x[n_heads, Dh] by cos/sin[Dh/2]. */
static void rope_heads(float *x, const float *cs, const float *sn, int n_heads, int Dh) {
    const int half = Dh / 2;
    for (int h = 0; h < n_heads; h++) {
        float *a = x + (int64_t)h * Dh;
        float *b = a + half;
        for (int j = 0; j < half; j++) {
            const float x0 = a[j], x1 = b[j];
            a[j] = x0 * cs[j] - x1 * sn[j];
            b[j] = x1 * cs[j] + x0 * sn[j];
        }
    }
}

/* q[T, H, Dh] and k[T, Hkv, Dh] rotated in place at positions pos[T]; Dh even. */
void cpu_rope(float *q, float *k, const int32_t *pos, int T, int H, int Hkv, int Dh, double theta) {
    if (T <= 0) return;
    MS_ASSERT(Dh % 2 == 0);
    const int half = Dh / 2;
    const float theta_f = (float)theta;
#pragma omp parallel if (T > 1)
    {
        float *inv_freq = xmalloc(3 * (size_t)half * sizeof(float));
        float *cs = inv_freq + half, *sn = cs + half;
        for (int j = 0; j < half; j++) {
            const float e = (float)(2 * j) / (float)Dh;
            inv_freq[j] = 1.0f / powf(theta_f, e);
        }
#pragma omp for schedule(static)
        for (int t = 0; t < T; t++) {
            const float p = (float)pos[t];
            for (int j = 0; j < half; j++) {
                const float angle = p * inv_freq[j];
                cs[j] = cosf(angle);
                sn[j] = sinf(angle);
            }
            rope_heads(q + (int64_t)t * H * Dh, cs, sn, H, Dh);
            rope_heads(k + (int64_t)t * Hkv * Dh, cs, sn, Hkv, Dh);
        }
        free(inv_freq);
    }
}
