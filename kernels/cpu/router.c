/* router_topk: softmax over the E router logits in fp32 (max-shifted), then the K largest
 * probabilities in descending order, ties to the lower expert id, optionally renormalized to sum
 * to one (Qwen3-MoE's norm_topk_prob). The softmax's sum goes in the order a GPU warp adds it
 * (softmax_sum below), so the GPU's weights are these bits. Selection is an insertion into a K-long
 * sorted list while scanning experts in id order: O(E K), and a strict comparison gives the tie
 * rule for free. E is at most a few hundred, so tokens are split across threads only for large
 * batches. */
#include <math.h>

#include "kernels/cpu/cpu_ops.h"

/* The sum of e[0..E-1] in a warp's order: 32 partial sums, partial l adding e[l], e[l + 32], ...
 * in turn from 0, then halves added pairwise (partial l += partial l + off for off = 16, 8, 4, 2,
 * 1, l < off): a chain of E / 32 + 5 adds instead of E. */
static float softmax_sum(const float *e, int E) {
    float s[32];
    for (int l = 0; l < 32; l++) {
        s[l] = 0.0f;
        for (int i = l; i < E; i += 32)
            s[l] += e[i];
    }
    for (int off = 16; off > 0; off /= 2)
        for (int l = 0; l < off; l++)
            s[l] += s[l + off];
    return s[0];
}

/* topk_ids, topk_w [K] of one token from its logits [E]; probs [E] is scratch. */
static void route_one(int32_t *ids, float *wts, const float *logits, int E, int K, bool norm,
                      float *probs) {
    float m = logits[0];
    for (int e = 1; e < E; e++)
        if (logits[e] > m) m = logits[e];
    for (int e = 0; e < E; e++)
        probs[e] = expf(logits[e] - m);
    const float sum = softmax_sum(probs, E);
    for (int e = 0; e < E; e++)
        probs[e] /= sum;

    int n = 0; /* entries of ids/wts filled so far, kept sorted descending */
    for (int e = 0; e < E; e++) {
        const float p = probs[e];
        if (n == K && !(p > wts[K - 1])) continue;
        int i = n < K ? n++ : K - 1;
        while (i > 0 && p > wts[i - 1]) {
            wts[i] = wts[i - 1];
            ids[i] = ids[i - 1];
            i--;
        }
        wts[i] = p;
        ids[i] = e;
    }

    if (norm) {
        float s = 0.0f;
        for (int k = 0; k < K; k++)
            s += wts[k];
        for (int k = 0; k < K; k++)
            wts[k] /= s;
    }
}

/* topk_ids, topk_w [T, K] from logits [T, E]; K <= E. */
void cpu_router_topk(int32_t *topk_ids, float *topk_w, const float *logits, int T, int E, int K,
                     bool norm) {
    if (T <= 0) return;
    MS_ASSERT(K >= 1 && K <= E);
#pragma omp parallel if (T >= 64)
    {
        float *probs = xmalloc((size_t)E * sizeof(float));
#pragma omp for schedule(static)
        for (int t = 0; t < T; t++)
            route_one(topk_ids + (int64_t)t * K, topk_w + (int64_t)t * K, logits + (int64_t)t * E,
                      E, K, norm, probs);
        free(probs);
    }
}
