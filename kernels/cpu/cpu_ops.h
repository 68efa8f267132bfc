/* Private header of the CPU backend: the functions behind ops_cpu()'s table and the few helpers
 * the kernel files share. Shape letters as in kernels/ops.h.
 *
 * Every reduction here has one fixed order that depends only on the reduction length, never on
 * T or on the thread count: that is what makes a token's result identical whether it is computed
 * alone, in a batch, in prefill or in decode (the deterministic-mode contract). */
#ifndef MOESERVE_KERNELS_CPU_OPS_H
#define MOESERVE_KERNELS_CPU_OPS_H

#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "common/log.h"
#include "common/tensor.h"
#include "kernels/ops.h"

void cpu_embedding(float *out, const tensor *table, const int32_t *ids, int T, int D);
void cpu_rmsnorm(float *out, const float *x, const tensor *w, int R, int C, float eps);
void cpu_add_rmsnorm(float *x, float *h, const float *o, const tensor *w, int T, int D, float eps);
void cpu_linear(float *out, const float *x, const tensor *w, int T, int N, int Kin);
void cpu_rope(float *q, float *k, const int32_t *pos, int T, int H, int Hkv, int Dh, double theta);
void cpu_qk_norm_rope(float *q, float *k, const tensor *q_norm, const tensor *k_norm,
                      const int32_t *pos, int T, int H, int Hkv, int Dh, double theta, float eps);
void cpu_kv_store(kv_layer kv, const float *k, const float *v, const attn_batch *b, int Hkv,
                  int Dh);
void cpu_attention(float *out, const float *q, kv_layer kv, const attn_batch *b, int H, int Hkv,
                   int Dh, float scale);
void cpu_router_topk(int32_t *topk_ids, float *topk_w, const float *logits, int T, int E, int K,
                     bool norm);
void cpu_moe_experts(float *out, const float *x, const int32_t *topk_ids, const moe_experts *w,
                     int T, int K, int D, int F);
void cpu_moe_experts_n(float *out, const float *x, const int32_t *topk_ids, const int32_t *n_rows,
                       const moe_experts *w, int T, int K, int D, int F);
void cpu_moe_input_quant(float *y, const float *x, int T, int D, int payload);
void cpu_moe_experts_q(float *out, float *xq, const float *x, const int32_t *topk_ids,
                       const moe_experts *w, int T, int K, int D, int F, int payload);
void cpu_moe_finalize(float *out, const float *expert_out, const float *topk_w, int T, int K,
                      int D);
void cpu_silu_mul(float *out, const float *gate, const float *up, int T, int F);
void cpu_qkv_prepare(float *q_out, kv_layer kv, const float *qkv, const tensor *q_norm,
                     const tensor *k_norm, const attn_batch *b, int H, int Hkv, int Dh,
                     double theta, float eps);
void cpu_moe_finalize_add_rmsnorm(float *x, float *h, const float *expert_out, const float *topk_w,
                                  const tensor *w, int T, int K, int D, float eps);
void cpu_add(float *out, const float *a, const float *b, int64_t n);

/* cpu_linear with the OpenMP split over N switched on or off: callers that already run inside a
 * parallel region (moe_experts across experts) pass threaded = false so threads never nest. The
 * result is bit-identical either way. */
void cpu_linear_ex(float *out, const float *x, const tensor *w, int T, int N, int Kin,
                   bool threaded);

/* The weight dtypes the CPU kernels read directly. Anything else reaching a CPU kernel means the
 * loader or the config validation let it through: a broken invariant. */
static inline bool cpu_dtype_supported(dtype t) {
    return t == DTYPE_F32 || t == DTYPE_BF16 || t == DTYPE_F16;
}

#define CPU_ASSERT_WEIGHT(w, op_name)                                                              \
    do {                                                                                           \
        if (!cpu_dtype_supported((w)->dtype) || (w)->device != DEVICE_CPU) {                       \
            fprintf(stderr,                                                                        \
                    "%s:%d: %s: weight of dtype %s on device %d; the CPU backend reads F32, "      \
                    "BF16 or F16 host tensors\n",                                                  \
                    __FILE__, __LINE__, (op_name), dtype_name((w)->dtype), (int)(w)->device);      \
            abort();                                                                               \
        }                                                                                          \
    } while (0)

/* silu(g) = g / (1 + exp(-g)) in fp32, the form PyTorch's CPU kernel uses. */
static inline float cpu_silu(float g) { return g / (1.0f + expf(-g)); }

/* fp32 dot product in a fixed order: 16 lane accumulators over the blocks of 16, a pairwise sum of
 * the lanes, then the tail in index order. The lanes let gcc vectorize without -ffast-math; the
 * order depends only on n. */
#define CPU_DOT_LANES 16

/* Sanitizer builds (make asan, make fuzz): the hot inner loops carry CPU_HOT and are not
 * instrumented (with a check on every load they neither vectorize nor keep their accumulators in
 * registers, and ran 20-30x slower, most of a sanitized end-to-end test's time); their callers
 * ask AddressSanitizer about every byte of the operands first (cpu_check_region), so an operand
 * shorter than its shape is still reported, at the call. Other builds: no effect. */
#if defined(__SANITIZE_ADDRESS__)
#define CPU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define CPU_ASAN 1
#endif
#endif
#ifdef CPU_ASAN
#include <sanitizer/asan_interface.h>
#define CPU_HOT __attribute__((no_sanitize("address", "undefined")))
/* Every byte of [p, p + bytes) addressable, or AddressSanitizer's report on the first that is not
 * (a load of it, instrumented here). */
static inline void cpu_check_region(const void *p, size_t bytes) {
    const volatile char *bad =
        (const volatile char *)__asan_region_is_poisoned((void *)(uintptr_t)p, bytes);
    if (bad) (void)*bad;
}
#else
#define CPU_HOT
/* nothing, its arguments not even evaluated */
#define cpu_check_region(p, bytes) ((void)0)
#endif

static inline CPU_HOT float cpu_dot_f32_loop(const float *a, const float *b, int n) {
    float acc[CPU_DOT_LANES] = {0};
    int i = 0;
    for (; i + CPU_DOT_LANES <= n; i += CPU_DOT_LANES)
        for (int j = 0; j < CPU_DOT_LANES; j++)
            acc[j] = fmaf(a[i + j], b[i + j], acc[j]);
    for (int w = CPU_DOT_LANES / 2; w > 0; w /= 2)
        for (int j = 0; j < w; j++)
            acc[j] += acc[j + w];
    float s = acc[0];
    for (; i < n; i++)
        s = fmaf(a[i], b[i], s);
    return s;
}

static inline float cpu_dot_f32(const float *a, const float *b, int n) {
    cpu_check_region(a, (size_t)n * sizeof(float));
    cpu_check_region(b, (size_t)n * sizeof(float));
    return cpu_dot_f32_loop(a, b, n);
}

static inline CPU_HOT void cpu_axpy_f32_loop(float *y, float a, const float *x, int n) {
    for (int i = 0; i < n; i++)
        y[i] = fmaf(a, x[i], y[i]);
}

/* y[i] = fma(a, x[i], y[i]) for i < n, in index order. */
static inline void cpu_axpy_f32(float *y, float a, const float *x, int n) {
    cpu_check_region(y, (size_t)n * sizeof(float));
    cpu_check_region(x, (size_t)n * sizeof(float));
    cpu_axpy_f32_loop(y, a, x, n);
}

#endif
