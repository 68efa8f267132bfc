/* Paged causal attention: kv_store writes a batch's keys and values into the cache pages, then
 * attention reads them back through the page table.
 *
 * Choices:
 * - One (token, head) pair is one work item: scores q.k * scale for positions 0..pos[t] into a
 *   per-thread buffer, max-subtracted softmax, then the weighted sum of values, all fp32. Two
 *   passes over the keys rather than an online softmax keep the arithmetic plain.
 * - Every sum runs over positions in increasing order and its shape depends on nothing but the
 *   position, so a token gives bit-identical output whether it comes in a prefill chunk or in a
 *   decode step, alone or in a batch (the deterministic-mode contract).
 * - GQA: query head h reads kv head h / (H / Hkv).
 * - A BF16 cache (kv.bf16): kv_store rounds k and v to nearest even; attention widens each row
 *   (exact) into a float buffer and runs the same arithmetic on it. */
#include <math.h>
#include <string.h>

#include "kernels/cpu/cpu_ops.h"

/* Row of cache slot (seq, p): index into [P * S] of the [P, S, Hkv, Dh] cache. */
static inline int64_t kv_slot(const attn_batch *b, int seq, int p) {
    const int page = b->page_table[(int64_t)seq * b->max_pages + p / b->page_size];
    return (int64_t)page * b->page_size + p % b->page_size;
}

/* k, v [T, Hkv, Dh] into the cache at (seq[t], pos[t]). */
void cpu_kv_store(kv_layer kv, const float *k, const float *v, const attn_batch *b, int Hkv,
                  int Dh) {
    const size_t row = (size_t)Hkv * Dh;
    for (int t = 0; t < b->T; t++) {
        MS_ASSERT(b->pos[t] >= 0 && b->pos[t] / b->page_size < b->max_pages);
        const int64_t slot = kv_slot(b, b->seq[t], b->pos[t]);
        if (kv.bf16) {
            uint16_t *kd = kv_k_bf16(kv) + slot * row, *vd = kv_v_bf16(kv) + slot * row;
            for (size_t i = 0; i < row; i++) {
                kd[i] = f32_to_bf16(k[t * row + i]);
                vd[i] = f32_to_bf16(v[t * row + i]);
            }
        } else {
            memcpy(kv.k + slot * row, k + t * row, row * sizeof(float));
            memcpy(kv.v + slot * row, v + t * row, row * sizeof(float));
        }
    }
}

/* Kv head g's Dh values of cache slot `slot` of pool p (kv.k or kv.v) as floats: in place for an
 * fp32 cache, else widened into buf [Dh]. */
static inline const float *kv_row(kv_layer kv, const float *p, int64_t slot, int64_t row, int g,
                                  int Dh, float *buf) {
    const int64_t off = slot * row + (int64_t)g * Dh;
    if (!kv.bf16) return p + off;
    const uint16_t *h = (const uint16_t *)(const void *)p + off;
    for (int d = 0; d < Dh; d++)
        buf[d] = bf16_to_f32(h[d]);
    return buf;
}

/* out[Dh] = softmax(q . k_p * scale over p = 0..pos) weighted sum of v_p, for one token and one
 * query head reading kv head g; scores [pos + 1] and buf [Dh] (a BF16 cache's row) are scratch. */
static void attend_one(float *out, const float *q, kv_layer kv, const attn_batch *b, int seq,
                       int pos, int g, int Hkv, int Dh, float scale, float *scores, float *buf) {
    const int64_t row = (int64_t)Hkv * Dh;
    float m = -INFINITY;
    for (int p = 0; p <= pos; p++) {
        const float *kp = kv_row(kv, kv.k, kv_slot(b, seq, p), row, g, Dh, buf);
        scores[p] = cpu_dot_f32(q, kp, Dh) * scale;
        if (scores[p] > m) m = scores[p];
    }
    float sum = 0.0f;
    for (int p = 0; p <= pos; p++) {
        scores[p] = expf(scores[p] - m);
        sum += scores[p];
    }
    for (int d = 0; d < Dh; d++)
        out[d] = 0.0f;
    for (int p = 0; p <= pos; p++) {
        const float *vp = kv_row(kv, kv.v, kv_slot(b, seq, p), row, g, Dh, buf);
        cpu_axpy_f32(out, scores[p], vp, Dh);
    }
    const float inv = 1.0f / sum;
    for (int d = 0; d < Dh; d++)
        out[d] *= inv;
}

/* out[T, H, Dh] = causal softmax(q k^T * scale) v over each token's own sequence; q [T, H, Dh];
 * the cache must already hold positions 0..pos[t] of seq[t]. */
void cpu_attention(float *out, const float *q, kv_layer kv, const attn_batch *b, int H, int Hkv,
                   int Dh, float scale) {
    const int T = b->T;
    if (T <= 0) return;
    MS_ASSERT(Hkv > 0 && H % Hkv == 0);
    const int group = H / Hkv;
    int max_pos = 0;
    for (int t = 0; t < T; t++) {
        MS_ASSERT(b->pos[t] >= 0 && b->pos[t] / b->page_size < b->max_pages);
        if (b->pos[t] > max_pos) max_pos = b->pos[t];
    }
    const int64_t items = (int64_t)T * H;
#pragma omp parallel if (items > 1)
    {
        float *scores = xmalloc(((size_t)max_pos + 1 + Dh) * sizeof(float));
        /* Dynamic: items differ in length by their position. Which thread runs an item does not
         * change its result. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < items; i++) {
            const int t = (int)(i / H), h = (int)(i % H);
            attend_one(out + i * Dh, q + i * Dh, kv, b, b->seq[t], b->pos[t], h / group, Hkv, Dh,
                       scale, scores, scores + max_pos + 1);
        }
        free(scores);
    }
}
