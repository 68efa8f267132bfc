/* The routed experts of a MoE layer and the weighted sum of their outputs.
 *
 * moe_experts groups the (token, slot) pairs of a batch by expert with a counting sort, so each
 * expert's weights are streamed once per call whatever the number of its tokens; per expert it
 * gathers the tokens into a contiguous buffer, runs gate and up through cpu_linear, silu * up, then
 * down, and scatters the rows to out[t, k, :].
 *
 * Threads: with many experts busy (decode: T*K pairs over as many experts) each thread takes whole
 * experts, busiest first, and the linears run single-threaded inside; with few busy experts the
 * experts go one after another and each linear splits its rows across threads. Never both, so
 * OpenMP regions do not nest. Every linear is bit-identical however it is threaded and whatever
 * its token count, so a token's output does not depend on the batch or on the choice made here.
 *
 * moe_input_quant is the experts' activation format (FP8 or NVFP4 experts): each token through
 * the all-to-all payload's round trip, a2a_payload_roundtrip itself, so that one process and the
 * quantized dispatch of several ranks hand the experts the same bits by construction.
 *
 * moe_finalize sums the K slots of each token in slot order 0..K-1, in fp32. */
#include <math.h>
#include <omp.h>
#include <string.h>

#include "kernels/a2a.h"
#include "kernels/cpu/cpu_ops.h"

/* One expert over its n pairs: out[pair, D] for pair in pairs[n] (pair = t * K + k).
 * scratch holds n * (D + 2F) floats. */
static void run_expert(float *out, const float *x, const int32_t *pairs, int n, int e,
                       const moe_experts *w, int K, int D, int F, bool threaded, float *scratch) {
    float *xg = scratch;            /* [n, D] gathered tokens, later the down output */
    float *g = xg + (int64_t)n * D; /* [n, F] gate, then silu(gate) * up */
    float *u = g + (int64_t)n * F;  /* [n, F] up */
    for (int i = 0; i < n; i++)
        memcpy(xg + (int64_t)i * D, x + (int64_t)(pairs[i] / K) * D, (size_t)D * sizeof(float));
    cpu_linear_ex(g, xg, &w->gate[e], n, F, D, threaded);
    cpu_linear_ex(u, xg, &w->up[e], n, F, D, threaded);
    /* cpu_silu_mul's arithmetic, inline here so it never opens a nested parallel region. */
    for (int64_t i = 0; i < (int64_t)n * F; i++)
        g[i] = cpu_silu(g[i]) * u[i];
    cpu_linear_ex(xg, g, &w->down[e], n, D, F, threaded);
    for (int i = 0; i < n; i++)
        memcpy(out + (int64_t)pairs[i] * D, xg + (int64_t)i * D, (size_t)D * sizeof(float));
}

/* out[T, K, D]: slot k of token t = down(silu(gate(x_t)) * up(x_t)) of expert topk_ids[t, k];
 * x [T, D]; experts' gate/up [F, D], down [D, F]. A slot with a negative id is skipped. */
void cpu_moe_experts(float *out, const float *x, const int32_t *topk_ids, const moe_experts *w,
                     int T, int K, int D, int F) {
    if (T <= 0) return;
    const int E = w->E;
    const int n_pairs = T * K;

    /* Counting sort of the pairs by expert; within an expert, pairs stay in (t, k) order.
     * Negative ids (slots another rank computes) are left out. */
    int *offsets = xcalloc((size_t)E + 1, sizeof(int)); /* [E + 1] */
    for (int i = 0; i < n_pairs; i++) {
        MS_ASSERT(topk_ids[i] < E);
        if (topk_ids[i] >= 0) offsets[topk_ids[i] + 1]++;
    }
    for (int e = 0; e < E; e++)
        offsets[e + 1] += offsets[e];
    int32_t *pairs = xmalloc(((size_t)offsets[E] + 1) * sizeof(int32_t)); /* grouped by expert */
    int *cursor = xmalloc(((size_t)E + 1) * sizeof(int));
    memcpy(cursor, offsets, (size_t)E * sizeof(int));
    for (int i = 0; i < n_pairs; i++)
        if (topk_ids[i] >= 0) pairs[cursor[topk_ids[i]]++] = i;

    /* Busy experts, most pairs first (ties by id), so dynamic scheduling balances the load. */
    int *busy = cursor; /* reused: [n_busy] expert ids */
    int n_busy = 0, max_count = 0;
    for (int e = 0; e < E; e++) {
        const int c = offsets[e + 1] - offsets[e];
        if (c == 0) continue;
        if (c > max_count) max_count = c;
        int i = n_busy++;
        while (i > 0 && offsets[busy[i - 1] + 1] - offsets[busy[i - 1]] < c) {
            busy[i] = busy[i - 1];
            i--;
        }
        busy[i] = e;
    }

    const size_t scratch_floats = (size_t)max_count * ((size_t)D + 2 * (size_t)F);
    const int n_threads = omp_get_max_threads();
    if (n_threads > 1 && n_busy >= 2 * n_threads) {
#pragma omp parallel
        {
            float *scratch = xmalloc(scratch_floats * sizeof(float));
#pragma omp for schedule(dynamic, 1)
            for (int i = 0; i < n_busy; i++) {
                const int e = busy[i];
                run_expert(out, x, pairs + offsets[e], offsets[e + 1] - offsets[e], e, w, K, D, F,
                           false, scratch);
            }
            free(scratch);
        }
    } else {
        float *scratch = xmalloc(scratch_floats * sizeof(float));
        for (int i = 0; i < n_busy; i++) {
            const int e = busy[i];
            run_expert(out, x, pairs + offsets[e], offsets[e + 1] - offsets[e], e, w, K, D, F, true,
                       scratch);
        }
        free(scratch);
    }
    free(pairs);
    free(cursor);
    free(offsets);
}

/* y[T, D] = x[T, D] token by token through payload's round trip (y may equal x). Tokens are
 * independent, so the thread split cannot change a bit. */
void cpu_moe_input_quant(float *y, const float *x, int T, int D, int payload) {
    MS_ASSERT((unsigned)payload <= (unsigned)A2A_PAYLOAD_NVFP4);
    if (T <= 0) return;
#pragma omp parallel for schedule(static) if ((int64_t)T * D >= (1 << 16))
    for (int t = 0; t < T; t++)
        a2a_payload_roundtrip((a2a_payload)payload, y + (int64_t)t * D, x + (int64_t)t * D, D);
}

/* out[T, D] = sum over k = 0..K-1, in that order, of topk_w[t, k] * expert_out[t, k, :]. */
void cpu_moe_finalize(float *out, const float *expert_out, const float *topk_w, int T, int K,
                      int D) {
    if (T <= 0) return;
#pragma omp parallel for schedule(static) if ((int64_t)T * K * D >= (1 << 16))
    for (int t = 0; t < T; t++) {
        float *o = out + (int64_t)t * D;
        for (int d = 0; d < D; d++)
            o[d] = 0.0f;
        for (int k = 0; k < K; k++) {
            const float wk = topk_w[(int64_t)t * K + k];
            const float *src = expert_out + ((int64_t)t * K + k) * D;
            for (int d = 0; d < D; d++)
                o[d] += wk * src[d];
        }
    }
}

void cpu_moe_experts_n(float *out, const float *x, const int32_t *topk_ids, const int32_t *n_rows,
                       const moe_experts *w, int T, int K, int D, int F) {
    const int n = *n_rows < T ? *n_rows : T;
    cpu_moe_experts(out, x, topk_ids, w, n > 0 ? n : 0, K, D, F);
}

/* The two ops in turn: x through payload's round trip into xq, then the experts on xq. */
void cpu_moe_experts_q(float *out, float *xq, const float *x, const int32_t *topk_ids,
                       const moe_experts *w, int T, int K, int D, int F, int payload) {
    cpu_moe_input_quant(xq, x, T, D, payload);
    cpu_moe_experts(out, xq, topk_ids, w, T, K, D, F);
}
