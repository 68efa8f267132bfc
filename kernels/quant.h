/* The low-precision number formats of quantized experts and all-to-all payloads, element by
 * element, written once for the CPU and the GPU (the functions are host and device code):
 *   FP8 E4M3 (OCP "E4M3FN"): sign, 4 exponent bits (bias 7), 3 mantissa bits; largest 448, no
 *     infinities, S.1111.111 is NaN; subnormals down to 2^-9.
 *   FP4 E2M1 (NVFP4's elements): sign (bit 3), 2 exponent bits, 1 mantissa bit; magnitudes 0, 0.5,
 *     1, 1.5, 2, 3, 4, 6.
 * Conversions from float round to nearest, ties to even, and saturate: a finite value beyond the
 * largest becomes the largest of its sign (what DeepSeek's and ModelOpt's quantizers reach by
 * clamping first). NaN becomes E4M3's NaN; E2M1 has none (0). Rounding is rintf's: the default
 * mode, to nearest even, which nothing here changes. The block scalings built on these are in
 * kernels/cpu/quant.c. */
#ifndef MOESERVE_QUANT_H
#define MOESERVE_QUANT_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#ifdef __CUDACC__
#define QUANT_HD __host__ __device__
#else
#define QUANT_HD
#endif

#define FP8_E4M3_MAX 448.0f
#define FP4_E2M1_MAX 6.0f

/* The bits of a float, and back (host and device: memcpy is a register move on both). */
static inline QUANT_HD uint32_t quant_f32_bits(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    return u;
}
static inline QUANT_HD float quant_bits_f32(uint32_t u) {
    float x;
    memcpy(&x, &u, 4);
    return x;
}

/* The conversions work on the bits (no ldexpf, frexpf or fmodf, which are library calls on a GPU):
 * tests/test_quant.c checks them against the formulas, (1 + m/8) 2^(e-7) and a rounding of the
 * scaled value to an integer, on every float whose code can differ and on a sweep of all 2^32. */
static inline QUANT_HD float fp8_e4m3_to_float(uint8_t c) {
    const uint32_t sign = (uint32_t)(c & 0x80) << 24, em = c & 0x7fu;
    if (em == 0x7f) return quant_bits_f32(sign | 0x7fc00000u); /* NaN, its sign kept */
    if (em < 8) {                                              /* subnormal (and zero): m 2^-9 */
        const float v = (float)em * 0x1p-9f;
        return sign ? -v : v;
    }
    /* normal: e = em >> 3 becomes float's exponent field e + 120, m its top mantissa bits */
    return quant_bits_f32(sign | (em + (120u << 3)) << 20);
}

static inline QUANT_HD uint8_t fp8_e4m3_from_float(float x) {
    if (isnan(x)) return 0x7f;
    const uint32_t u = quant_f32_bits(x), b = u & 0x7fffffffu;
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80);
    const float a = fabsf(x);
    if (a >= FP8_E4M3_MAX) return sign | 0x7e; /* 448 = 2^8 x 1.75 */
    if (a < 0x1p-6f) /* subnormal range: steps of 2^-9, a 2^9 exact, rintf to nearest even */
        return sign | (uint8_t)rintf(a * 512.0f); /* 0 .. 8; 8 is the smallest normal */
    /* normal: the mantissa rounded to 3 bits, nearest even (half less one, plus the kept lsb),
     * a carry moving into the exponent; float's exponent field E is the code's e + 120. Below 448
     * nothing rounds past it. */
    return sign | (uint8_t)(((b + 0x7ffffu + ((b >> 20) & 1u)) >> 20) - (120u << 3));
}

static inline QUANT_HD float fp4_e2m1_to_float(uint8_t nib) {
    /* codes 0..7: 0, 0.5, 1, 1.5, 2, 3, 4, 6, as twice their value a byte each */
    const float v = 0.5f * (float)((0x0C08060403020100ull >> (8 * (nib & 7))) & 0xff);
    return (nib & 8) ? -v : v;
}

/* E2M1's code of a = |x| (not NaN), two ways to the same code, each the faster on its machine
 * (tests/test_quant.c checks both against the formula on every float that matters):
 *  - counting the midpoints between neighbouring values that a passes, the even code winning a
 *    tie (0.25 -> 0, 0.75 -> 2, 1.25 -> 2, 1.75 -> 4, 2.5 -> 4, 3.5 -> 6, 5 -> 6), 7 from 6 on:
 *    no branch for random inputs to mispredict (the faster on the CPU);
 *  - steps of 0.5 from 0 to 2 (codes 0..4), of 1 from 2 to 4 (4..6), then 6 or 7, each rounded
 *    by rintf (to nearest even) and one selected: fewer instructions on a GPU. */
static inline QUANT_HD int fp4_e2m1_code_count(float a) {
    return (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) +
           (a > 5.0f);
}
static inline QUANT_HD int fp4_e2m1_code_select(float a) {
    const float lo = rintf(a * 2.0f), mid = rintf(a) + 2.0f, hi = a > 5.0f ? 7.0f : 6.0f;
    return (int)(a < 2.0f ? lo : a < 4.0f ? mid : hi);
}

static inline QUANT_HD uint8_t fp4_e2m1_from_float(float x) {
    if (isnan(x)) return 0;
    const uint8_t sign = signbit(x) ? 8 : 0;
#ifdef __CUDA_ARCH__
    return sign | (uint8_t)fp4_e2m1_code_select(fabsf(x));
#else
    return sign | (uint8_t)fp4_e2m1_code_count(fabsf(x));
#endif
}

/* ---- FP8 weights as the W8A16 expert GEMMs read them (kernels/cuda/moe.cu) ----
 * Within each 64 k of a row the code bytes are rearranged once at load so that lane t (0..3) of
 * an mma.sync B-fragment quad owns bytes [16t, 16t + 16): its word s (the k16 step s of the 64)
 * holds the codes of k = 16s + 2t + {0, 8, 1, 9} as bytes 0..3. fp8_w8_decode(word, j) is then
 * fragment register j (j = 0: k 16s + 2t and 2t + 1; j = 1: k 16s + 2t + 8 and 2t + 9; the lower
 * k in the low half) as two BF16 numbers worth e4m3 2^-120, exactly: the sign to bit 15, exponent
 * and mantissa to bits 4..10 (an E4M3 subnormal becomes a BF16 one). A shift and a mask or two;
 * the kernel multiplies by FP8_W8_BF16_2P120 (2^120) in BF16, exact. A NaN code would decode to
 * 480, so loading refuses it. */
#define FP8_W8_BF16_2P120 0x7B80u /* 2^120 in BF16: exponent field 247 */

static inline QUANT_HD void fp8_w8_pack64(uint8_t *dst, const uint8_t *src) {
    for (int t = 0; t < 4; t++)
        for (int s = 0; s < 4; s++)
            for (int j = 0; j < 4; j++)
                dst[16 * t + 4 * s + j] = src[16 * s + 2 * t + 8 * (j & 1) + (j >> 1)];
}

static inline QUANT_HD uint32_t fp8_w8_decode(uint32_t w, int j) {
    if (j == 0) return ((w << 8) & 0x80008000u) | ((w << 4) & 0x07F007F0u); /* bytes 0 and 2 */
    return (w & 0x80008000u) | ((w >> 4) & 0x07F007F0u);                    /* bytes 1 and 3 */
}

/* ---- block scalings (kernels/cpu/quant.c: the CPU reference) ----
 * FP8 activations (DeepSeek-V3's dynamic scheme): each token's D channels in groups of
 * QUANT_FP8_GROUP; group g of row t: s = max(amax, 1e-10) / 448, q = e4m3(x / s), x ~ q s.
 * FP8 weights (DeepSeek-V3's checkpoints): blocks of 128 x 128; s = amax / 448 (1 for a zero
 * block), q = e4m3(w / s), w ~ q s (the checkpoint's weight_scale_inv is s, despite its name).
 * NVFP4 (NVIDIA ModelOpt): a tensor scale s2 = amax / (6 448) (1 for a zero tensor); each group of
 * QUANT_FP4_GROUP consecutive elements of a row has sf = e4m3(amax_group / (6 s2)) and
 * q = e2m1(x / (e4m3(sf) s2)), packed two a byte (the even element in the low nibble); x ~ e2m1(q)
 * e4m3(sf) s2. Weights and activations use the same formula (for activations s2 is the
 * checkpoint's input_scale, or the tensor's own amax when the caller passes s2 <= 0). */
#define QUANT_FP8_GROUP 128
#define QUANT_FP8_BLOCK 128
#define QUANT_FP4_GROUP 16

#ifdef __cplusplus
extern "C" {
#endif

/* q[T, D], s[T, ceil(D / 128)] from x[T, D]; and back. */
void quant_fp8_rows(uint8_t *q, float *s, const float *x, int T, int D);
void dequant_fp8_rows(float *x, const uint8_t *q, const float *s, int T, int D);

/* q[N, K], s[ceil(N / 128), ceil(K / 128)] from w[N, K]; and back. */
void quant_fp8_blocks(uint8_t *q, float *s, const float *w, int N, int K);
void dequant_fp8_blocks(float *w, const uint8_t *q, const float *s, int N, int K);
/* The W8A16 kernels' scales of one FP8 weight [N, K] with block scales s [ceil(N / 128),
 * ceil(K / 128)]: dst[kb * ld + r] = s[r / 128][kb] for each row r < N and 128-k block kb, a scale
 * per row, so that the gate's and the up projection's rows stacked in one array keep their own. */
void quant_fp8_row_scales(float *dst, int64_t ld, const float *s, int N, int K);

/* q[R, C / 2] (packed), sf[R, C / 16] (E4M3 codes) from x[R, C] (C % 16 == 0) with tensor scale
 * s2 (<= 0: computed from x's amax and returned); and back. */
float quant_nvfp4(uint8_t *q, uint8_t *sf, const float *x, int R, int C, float s2);
void dequant_nvfp4(float *x, const uint8_t *q, const uint8_t *sf, float s2, int R, int C);
/* NVFP4 group scales sf [R, C / 16] (E4M3 codes, C % 64 == 0) in the layout Blackwell's
 * block-scaled MMA reads (kernels/cuda/nvfp4_sm100.cu): atoms of 512 bytes, one per 128 rows and
 * 64 columns, in [ceil(R / 128), C / 64] order; in an atom, row r's four scales (16 columns each)
 * at byte (r % 32) 16 + (r / 32 % 4) 4 + g. Rows past R are zero. dst holds
 * quant_nvfp4_sf_atoms_bytes(R, C). */
size_t quant_nvfp4_sf_atoms_bytes(int64_t R, int C);
void quant_nvfp4_sf_atoms(uint8_t *dst, const uint8_t *sf, int64_t R, int C);

/* The FP8 GEMM of DeepSeek-V3's scheme, the reference of the quantized kernels: out[T, N] =
 * x[T, K] w[N, K]^T with x quantized per token per 128 channels (quant_fp8_rows) and w in 128 x 128
 * blocks (codes w_q [N, K], scales w_s [ceil(N / 128), ceil(K / 128)]): each 128-wide slice of K
 * sums its products of decoded codes (exact in fp32) in increasing k in fp32, is multiplied by the
 * product of its two scales, and the slices are added in increasing K. */
void quant_linear_fp8(float *out, const float *x, const uint8_t *w_q, const float *w_s, int T,
                      int N, int K);

/* The NVFP4 GEMM as Hopper runs it (W4A16: no FP4 tensor cores there), the reference of the
 * W4A16 kernels: out[T, N] = x[T, K] w[N, K]^T with w in NVFP4 (codes w_q [N, K / 2] packed,
 * group scales w_sf [N, K / 16] as E4M3 codes, tensor scale w_s2; K % 16 == 0) and x in 16 bits
 * (act_bf16: x rounded to BF16, nearest even, as a kernel reading BF16 activations sees it) or
 * fp32. Each weight decodes to e2m1(q) e4m3(sf), exact in BF16 (at most 6 significant bits),
 * the products are summed in increasing k in fp32 and the sum is multiplied by w_s2 once (the
 * tensor scale folded into the epilogue). */
void quant_linear_nvfp4(float *out, const float *x, const uint8_t *w_q, const uint8_t *w_sf,
                        float w_s2, int T, int N, int K, int act_bf16);

#ifdef __cplusplus
}
#endif

#endif
