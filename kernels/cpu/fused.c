/* The fused ops of kernels/ops.h on the CPU, written as the compositions they replace, so they are
 * the reference for the GPU's single-pass kernels by construction:
 *   qkv_prepare               split qkv -> qk_norm_rope -> kv_store
 *   moe_finalize_add_rmsnorm  moe_finalize -> add_rmsnorm
 * The model calls qkv_prepare only where it fused the q, k and v weights (the GPU); the CPU keeps
 * the three projections and the unfused ops. moe_finalize_add_rmsnorm runs on both. */
#include <string.h>

#include "kernels/cpu/cpu_ops.h"

void cpu_qkv_prepare(float *q_out, kv_layer kv, const float *qkv, const tensor *q_norm,
                     const tensor *k_norm, const attn_batch *b, int H, int Hkv, int Dh,
                     double theta, float eps) {
    const int T = b->T;
    if (T <= 0) return;
    const int64_t qd = (int64_t)H * Dh, kvd = (int64_t)Hkv * Dh, row = qd + 2 * kvd;
    float *k = xmalloc((size_t)T * kvd * sizeof(float));
    float *v = xmalloc((size_t)T * kvd * sizeof(float));
    for (int t = 0; t < T; t++) {
        const float *r = qkv + t * row;
        memcpy(q_out + t * qd, r, (size_t)qd * sizeof(float));
        memcpy(k + t * kvd, r + qd, (size_t)kvd * sizeof(float));
        memcpy(v + t * kvd, r + qd + kvd, (size_t)kvd * sizeof(float));
    }
    cpu_qk_norm_rope(q_out, k, q_norm, k_norm, b->pos, T, H, Hkv, Dh, theta, eps);
    cpu_kv_store(kv, k, v, b, Hkv, Dh);
    free(k);
    free(v);
}

/* The finalize sums go through a buffer kept between calls: the ops run on one engine thread per
 * process, and a decode step would otherwise allocate once per layer. */
void cpu_moe_finalize_add_rmsnorm(float *x, float *h, const float *expert_out,
                                  const float *topk_w, const tensor *w, int T, int K, int D,
                                  float eps) {
    static float *o;
    static size_t cap;
    if (T <= 0) return;
    const size_t n = (size_t)T * D;
    if (n > cap) {
        free(o);
        o = xmalloc(n * sizeof(float));
        cap = n;
    }
    cpu_moe_finalize(o, expert_out, topk_w, T, K, D);
    cpu_add_rmsnorm(x, h, o, w, T, D, eps);
}
