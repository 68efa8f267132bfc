/* Block scalings of FP8 and NVFP4 (kernels/quant.h), the CPU reference of the CUDA quantizers and
 * of the quantize-at-load path. Plain loops in row order, a row or a block a thread from
 * QUANT_PARALLEL_MIN elements: amax and scales are exact (max and one division), so the results do
 * not depend on any order of evaluation. Also the quantized GEMMs'
 * references: FP8 W8A8 (DeepSeek-V3's recipe) and NVFP4 W4A16 (how Hopper runs NVFP4); each
 * output is one fixed-order fp32 sum, so threads do not change a bit. */
#include <string.h>

#include "kernels/quant.h"

#include "kernels/cpu/cpu_ops.h"

/* Elements from which the loops below run on the OpenMP threads (each row or block on one thread,
 * so the threads change no bit): the weights quantized at load, not one token's payload. */
#define QUANT_PARALLEL_MIN (1 << 16)

static float amax_of(const float *x, int n, int64_t stride) {
    float m = 0.0f;
    for (int i = 0; i < n; i++) {
        float a = fabsf(x[(int64_t)i * stride]);
        if (a > m) m = a; /* NaN never wins */
    }
    return m;
}

void quant_fp8_rows(uint8_t *q, float *s, const float *x, int T, int D) {
    const int G = (D + QUANT_FP8_GROUP - 1) / QUANT_FP8_GROUP;
#pragma omp parallel for schedule(static) if ((int64_t)T * D >= QUANT_PARALLEL_MIN)
    for (int t = 0; t < T; t++)
        for (int g = 0; g < G; g++) {
            const int c0 = g * QUANT_FP8_GROUP, n = D - c0 < QUANT_FP8_GROUP ? D - c0 : QUANT_FP8_GROUP;
            const float *xr = x + (int64_t)t * D + c0;
            float a = amax_of(xr, n, 1);
            const float sc = (a > 1e-10f ? a : 1e-10f) / FP8_E4M3_MAX;
            s[(int64_t)t * G + g] = sc;
            for (int i = 0; i < n; i++)
                q[(int64_t)t * D + c0 + i] = fp8_e4m3_from_float(xr[i] / sc);
        }
}

void dequant_fp8_rows(float *x, const uint8_t *q, const float *s, int T, int D) {
    const int G = (D + QUANT_FP8_GROUP - 1) / QUANT_FP8_GROUP;
#pragma omp parallel for schedule(static) if ((int64_t)T * D >= QUANT_PARALLEL_MIN)
    for (int t = 0; t < T; t++)
        for (int c = 0; c < D; c++)
            x[(int64_t)t * D + c] =
                fp8_e4m3_to_float(q[(int64_t)t * D + c]) * s[(int64_t)t * G + c / QUANT_FP8_GROUP];
}

void quant_fp8_blocks(uint8_t *q, float *s, const float *w, int N, int K) {
    const int BN = (N + QUANT_FP8_BLOCK - 1) / QUANT_FP8_BLOCK;
    const int BK = (K + QUANT_FP8_BLOCK - 1) / QUANT_FP8_BLOCK;
#pragma omp parallel for schedule(static) if ((int64_t)N * K >= QUANT_PARALLEL_MIN)
    for (int bn = 0; bn < BN; bn++)
        for (int bk = 0; bk < BK; bk++) {
            const int r0 = bn * QUANT_FP8_BLOCK, c0 = bk * QUANT_FP8_BLOCK;
            const int nr = N - r0 < QUANT_FP8_BLOCK ? N - r0 : QUANT_FP8_BLOCK;
            const int nc = K - c0 < QUANT_FP8_BLOCK ? K - c0 : QUANT_FP8_BLOCK;
            float a = 0.0f;
            for (int r = 0; r < nr; r++) {
                float m = amax_of(w + (int64_t)(r0 + r) * K + c0, nc, 1);
                if (m > a) a = m;
            }
            const float sc = a > 0.0f ? a / FP8_E4M3_MAX : 1.0f;
            s[(int64_t)bn * BK + bk] = sc;
            for (int r = 0; r < nr; r++)
                for (int c = 0; c < nc; c++) {
                    const int64_t i = (int64_t)(r0 + r) * K + c0 + c;
                    q[i] = fp8_e4m3_from_float(w[i] / sc);
                }
        }
}

void dequant_fp8_blocks(float *w, const uint8_t *q, const float *s, int N, int K) {
    const int BK = (K + QUANT_FP8_BLOCK - 1) / QUANT_FP8_BLOCK;
#pragma omp parallel for schedule(static) if ((int64_t)N * K >= QUANT_PARALLEL_MIN)
    for (int r = 0; r < N; r++)
        for (int c = 0; c < K; c++) {
            const int64_t i = (int64_t)r * K + c;
            w[i] = fp8_e4m3_to_float(q[i]) *
                   s[(int64_t)(r / QUANT_FP8_BLOCK) * BK + c / QUANT_FP8_BLOCK];
        }
}

void quant_fp8_row_scales(float *dst, int64_t ld, const float *s, int N, int K) {
    const int BK = (K + QUANT_FP8_BLOCK - 1) / QUANT_FP8_BLOCK;
    for (int kb = 0; kb < BK; kb++)
        for (int r = 0; r < N; r++)
            dst[(int64_t)kb * ld + r] = s[(int64_t)(r / QUANT_FP8_BLOCK) * BK + kb];
}

float quant_nvfp4(uint8_t *q, uint8_t *sf, const float *x, int R, int C, float s2) {
    MS_ASSERT(C % QUANT_FP4_GROUP == 0);
    const bool par = (int64_t)R * C >= QUANT_PARALLEL_MIN;
    if (!(s2 > 0.0f)) {
        float a = 0.0f; /* a row's amax is never NaN, so max is exact in any order */
#pragma omp parallel for schedule(static) reduction(max : a) if (par)
        for (int r = 0; r < R; r++) {
            float m = amax_of(x + (int64_t)r * C, C, 1);
            if (m > a) a = m;
        }
        s2 = a > 0.0f ? a / (FP4_E2M1_MAX * FP8_E4M3_MAX) : 1.0f;
    }
    const int G = C / QUANT_FP4_GROUP;
#pragma omp parallel for schedule(static) if (par)
    for (int r = 0; r < R; r++)
        for (int g = 0; g < G; g++) {
            const float *xg = x + (int64_t)r * C + g * QUANT_FP4_GROUP;
            const uint8_t code = fp8_e4m3_from_float(amax_of(xg, QUANT_FP4_GROUP, 1) /
                                                     (FP4_E2M1_MAX * s2));
            sf[(int64_t)r * G + g] = code;
            const float scale = fp8_e4m3_to_float(code) * s2; /* 0 for an all-zero group */
            uint8_t *qg = q + ((int64_t)r * C + g * QUANT_FP4_GROUP) / 2;
            for (int i = 0; i < QUANT_FP4_GROUP; i += 2) {
                const uint8_t lo = scale > 0.0f ? fp4_e2m1_from_float(xg[i] / scale) : 0;
                const uint8_t hi = scale > 0.0f ? fp4_e2m1_from_float(xg[i + 1] / scale) : 0;
                qg[i / 2] = (uint8_t)(lo | hi << 4);
            }
        }
    return s2;
}

void dequant_nvfp4(float *x, const uint8_t *q, const uint8_t *sf, float s2, int R, int C) {
    const int G = C / QUANT_FP4_GROUP;
#pragma omp parallel for schedule(static) if ((int64_t)R * C >= QUANT_PARALLEL_MIN)
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            const int64_t i = (int64_t)r * C + c;
            const uint8_t byte = q[i / 2];
            /* e2m1 x e4m3 is exact in fp32 (2 x 4 significant bits): one rounding, by s2 */
            x[i] = fp4_e2m1_to_float(c % 2 ? byte >> 4 : byte & 15) *
                   fp8_e4m3_to_float(sf[(int64_t)r * G + c / QUANT_FP4_GROUP]) * s2;
        }
}

size_t quant_nvfp4_sf_atoms_bytes(int64_t R, int C) {
    return (size_t)((R + 127) / 128) * (size_t)(C / 64) * 512;
}

void quant_nvfp4_sf_atoms(uint8_t *dst, const uint8_t *sf, int64_t R, int C) {
    MS_ASSERT(C % 64 == 0);
    const int G = C / QUANT_FP4_GROUP, A = C / 64; /* groups and atoms a row */
    memset(dst, 0, quant_nvfp4_sf_atoms_bytes(R, C));
    for (int64_t r = 0; r < R; r++)
        for (int g = 0; g < G; g++)
            dst[((r / 128) * A + g / 4) * 512 + (r % 32) * 16 + (r / 32 % 4) * 4 + g % 4] =
                sf[r * G + g];
}

void quant_linear_fp8(float *out, const float *x, const uint8_t *w_q, const float *w_s, int T,
                      int N, int K) {
    const int G = (K + QUANT_FP8_GROUP - 1) / QUANT_FP8_GROUP;
    uint8_t *xq = xmalloc((size_t)T * K + 1);
    float *xs = xmalloc(sizeof(float) * ((size_t)T * G + 1));
    quant_fp8_rows(xq, xs, x, T, K);
    float wv[256]; /* E4M3 decode table */
    for (int c = 0; c < 256; c++)
        wv[c] = fp8_e4m3_to_float((uint8_t)c);
#pragma omp parallel for schedule(static) if ((int64_t)T * N * K >= (1 << 20))
    for (int n = 0; n < N; n++)
        for (int t = 0; t < T; t++) {
            const uint8_t *a = xq + (int64_t)t * K, *b = w_q + (int64_t)n * K;
            float acc = 0.0f;
            for (int g = 0; g < G; g++) {
                const int k0 = g * QUANT_FP8_GROUP, k1 = k0 + QUANT_FP8_GROUP < K ? k0 + QUANT_FP8_GROUP : K;
                float part = 0.0f; /* products of two E4M3 values are exact in fp32 */
                for (int k = k0; k < k1; k++)
                    part += wv[a[k]] * wv[b[k]];
                acc += part * (xs[(int64_t)t * G + g] * w_s[(int64_t)(n / QUANT_FP8_BLOCK) * G + g]);
            }
            out[(int64_t)t * N + n] = acc;
        }
    free(xq);
    free(xs);
}

void quant_linear_nvfp4(float *out, const float *x, const uint8_t *w_q, const uint8_t *w_sf,
                        float w_s2, int T, int N, int K, int act_bf16) {
    MS_ASSERT(K % QUANT_FP4_GROUP == 0);
    const int G = K / QUANT_FP4_GROUP;
    float *xa = xmalloc(sizeof(float) * ((size_t)T * K + 1)); /* the activations as read */
    for (int64_t i = 0; i < (int64_t)T * K; i++)
        xa[i] = act_bf16 ? bf16_to_f32(f32_to_bf16(x[i])) : x[i];
#pragma omp parallel for schedule(static) if ((int64_t)T * N * K >= (1 << 20))
    for (int n = 0; n < N; n++) {
        float wr[QUANT_FP4_GROUP]; /* one group of row n, decoded without its tensor scale */
        for (int t = 0; t < T; t++) {
            const float *a = xa + (int64_t)t * K;
            float acc = 0.0f;
            for (int g = 0; g < G; g++) {
                const float sf = fp8_e4m3_to_float(w_sf[(int64_t)n * G + g]);
                const uint8_t *qg = w_q + ((int64_t)n * K + g * QUANT_FP4_GROUP) / 2;
                for (int i = 0; i < QUANT_FP4_GROUP; i++)
                    wr[i] = fp4_e2m1_to_float(i % 2 ? qg[i / 2] >> 4 : qg[i / 2] & 15) * sf;
                for (int i = 0; i < QUANT_FP4_GROUP; i++)
                    acc += a[g * QUANT_FP4_GROUP + i] * wr[i];
            }
            out[(int64_t)t * N + n] = acc * w_s2;
        }
    }
    free(xa);
}
