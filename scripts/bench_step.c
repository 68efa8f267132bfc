/* Engine step benchmark: decode step time at several batch sizes against the memory floor, and
 * prefill throughput, on one device, with a real checkpoint or dummy weights.
 *
 *   build/bench_step --model-path DIR [--load-format dummy] [--device cuda|cpu]
 *                    [--quantization nvfp4|fp8] (dummy: experts in NVFP4 W4A16 or FP8 W8A16)
 *                    [--batches 1,8,64,256] [--context 1024] [--steps 16]
 *                    [--prefill-prompts 1,8,32] [--prefill-len 2048] [--chunk 8192]
 *                    [--routing model|random] [--kv-cache-dtype auto|float32|bfloat16]
 *                    [--context-length N]
 *
 * Decode: B sequences with a random prompt of --context tokens are prefilled, then --steps decode
 * steps (one token per sequence, greedy) are timed one by one through engine_step, the program's
 * own step core; the median is reported with the forward pass alone. The floor of a step is the
 * bytes it must read over the device's measured bandwidth: every dense weight (attention, router,
 * norms, lm_head), the experts the batch touches (expected distinct experts per layer under
 * uniform routing, E (1 - (1 - K/E)^B)), and the KV cache of every sequence, over the device's
 * bandwidth: one 1 GiB device-to-device copy (bytes read + written over its time), measured in the
 * same run. Quantized weights count the bytes the model holds them in (decode_floor_bytes' caller;
 * before 2026-12-06 every weight counted 2 bytes, so quantized steps' floors were too high).
 * Prefill: P prompts of --prefill-len tokens through steps of at most --chunk tokens; tokens/s.
 *
 * --skip OPS (comma-separated: attention, experts, linear, qkv_prepare, router, norms) replaces
 * those ops with ones that do nothing during the timed decode steps (the prefill and the KV it
 * leaves are real), so the step time that remains shows what the skipped ops cost in place, with
 * the overlap of their neighbours (programmatic dependent launch, graphs) that a profiler running
 * one kernel at a time does not see. The tokens such steps make are meaningless. With graphs, the
 * graph of each batch size is captured with the skipped ops. linear is every projection (lm_head
 * too), router the top-k alone, norms the residual adds with their norms (add_rmsnorm and the
 * experts' moe_finalize_add_rmsnorm).
 * --deterministic 1: the CUDA backend's deterministic mode (ops_cuda_set_deterministic), to
 * measure what --enable-deterministic-inference costs a step.
 * --kv-cache-dtype: the server's names and default (auto: bfloat16 on cuda, float32 on cpu); with
 * a BF16 cache the floor counts 2 bytes an element.
 * --routing random: during the timed decode steps each token's experts are drawn uniformly (the
 * router's logits overwritten with fill_random before its top-k, a stream per call, so each layer
 * of a captured graph keeps its own draw), so the experts a batch touches are the ones the floor
 * counts whatever the weights' own routing does (a real checkpoint's may favour a few experts).
 * Default: model (the router's own choice). With the dummy weights both give the same steps
 * (H200, Qwen3-30B-A3B, context 1024, batch 256: 40.08 ms model, 40.30 random). It adds one small
 * kernel a layer.
 * --context-length N: page tables with room for N positions a sequence, as the server's are (its
 * --context-length, by default the model's max_position_embeddings), instead of the positions the
 * benchmark uses; the kernels size their grids from that bound. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/log.h"
#include "runner/engine.h"
#include "runner/model.h"

#ifdef MOESERVE_CUDA
#include <cuda_runtime.h>
#endif

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int parse_list(const char *s, int *out, int cap) {
    int n = 0;
    while (*s && n < cap) {
        out[n++] = atoi(s);
        const char *c = strchr(s, ',');
        if (!c) break;
        s = c + 1;
    }
    return n;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Device copy bandwidth in GB/s (read + write), or 0 where it cannot be measured. */
static double copy_bandwidth(const ops *o) {
#ifdef MOESERVE_CUDA
    if (o->device == DEVICE_CUDA) {
        size_t n = (size_t)1 << 30;
        void *a = o->dev_alloc(n), *b = o->dev_alloc(n);
        if (!a || !b) return 0;
        o->dev_zero(a, n);
        cudaEvent_t e0, e1;
        cudaEventCreate(&e0);
        cudaEventCreate(&e1);
        cudaMemcpy(b, a, n, cudaMemcpyDeviceToDevice);
        cudaEventRecord(e0, 0);
        for (int i = 0; i < 5; i++)
            cudaMemcpy(b, a, n, cudaMemcpyDeviceToDevice);
        cudaEventRecord(e1, 0);
        cudaEventSynchronize(e1);
        float ms = 0;
        cudaEventElapsedTime(&ms, e0, e1);
        o->dev_free(a);
        o->dev_free(b);
        return 5.0 * 2.0 * (double)n / (ms * 1e-3) / 1e9;
    }
#endif
    (void)o;
    return 0;
}

typedef struct {
    engine *e;
    int n;
    gen_request *reqs;
    engine_seq *seqs;
    engine_seq **batch;
    int32_t **prompts;
    int32_t *outs;
    int32_t *table;
    int max_pages;
} bench_set;

static int g_room; /* --context-length: positions a page table has room for (0: what is used) */

static void set_init(bench_set *b, engine *e, int n, int prompt_len, int new_tokens,
                     uint64_t seed) {
    const model_config *c = &e->m->cfg;
    int S = e->kv.page_size;
    *b = (bench_set){.e = e, .n = n};
    b->max_pages = (prompt_len + new_tokens + 1 + S - 1) / S;
    if ((g_room + S - 1) / S > b->max_pages) b->max_pages = (g_room + S - 1) / S;
    b->reqs = xcalloc(n, sizeof *b->reqs);
    b->seqs = xcalloc(n, sizeof *b->seqs);
    b->batch = xcalloc(n, sizeof *b->batch);
    b->prompts = xcalloc(n, sizeof *b->prompts);
    b->outs = xcalloc((size_t)n * (new_tokens + 1), sizeof(int32_t));
    b->table = xcalloc((size_t)n * b->max_pages, sizeof(int32_t));
    for (int i = 0; i < n; i++) {
        b->prompts[i] = xmalloc((size_t)prompt_len * sizeof(int32_t));
        for (int j = 0; j < prompt_len; j++)
            b->prompts[i][j] =
                (int32_t)((ops_random_uniform(seed + (uint64_t)i, (uint64_t)j) + 1.0f) * 0.5f *
                          (float)(c->vocab_size - 1));
        gen_request *q = &b->reqs[i];
        *q = (gen_request){.prompt = b->prompts[i],
                           .n_prompt = prompt_len,
                           .sampling = sampling_params_default(),
                           .max_new_tokens = new_tokens,
                           .ignore_eos = true,
                           .logprob_start_len = -1};
        q->sampling.temperature = 0;
        engine_seq_init(&b->seqs[i], q, 0);
        b->seqs[i].slot = i;
        b->seqs[i].pages = b->table + (size_t)i * b->max_pages;
        b->seqs[i].out_ids = b->outs + (size_t)i * (new_tokens + 1);
    }
}

static void set_free(bench_set *b) {
    for (int i = 0; i < b->n; i++) {
        for (int j = 0; j < b->seqs[i].n_pages; j++)
            kv_cache_release_page(&b->e->kv, b->seqs[i].pages[j]);
        engine_seq_free(&b->seqs[i]);
        free(b->prompts[i]);
    }
    free(b->reqs);
    free(b->seqs);
    free(b->batch);
    free(b->prompts);
    free(b->outs);
    free(b->table);
}

/* One step of the set's sequences from `from` on (engine_plan_step). Returns the tokens forwarded
 * (0: all done). */
static int set_step_from(bench_set *b, int from) {
    char err[256];
    int n_batch = engine_plan_step(b->e, b->seqs + from, b->n - from, b->batch, err, sizeof err);
    if (n_batch < 0) {
        fprintf(stderr, "bench_step: %s\n", err);
        exit(1);
    }
    if (n_batch == 0) return 0;
    int T = engine_step(b->e, b->batch, n_batch, b->table, b->max_pages);
    if (T < 0) {
        fprintf(stderr, "bench_step: forward failed: %s\n", b->e->m->err);
        exit(1);
    }
    return T;
}

static int set_step(bench_set *b) { return set_step_from(b, 0); }

/* --skip: ops that leave their outputs as they are. */
static void skip_add_rmsnorm(float *x, float *h, const float *o, const tensor *w, int T, int D,
                             float eps) {}
static void skip_linear(float *out, const float *x, const tensor *w, int T, int N, int Kin) {}
static void skip_attention(float *out, const float *q, kv_layer kv, const attn_batch *b, int H,
                           int Hkv, int Dh, float scale) {}
static void skip_router_topk(int32_t *ids, float *w, const float *logits, int T, int E, int K,
                             bool norm) {}
static void skip_moe_experts(float *out, const float *x, const int32_t *ids, const moe_experts *w,
                             int T, int K, int D, int F) {}
static void skip_qkv_prepare(float *q_out, kv_layer kv, const float *qkv, const tensor *q_norm,
                             const tensor *k_norm, const attn_batch *b, int H, int Hkv, int Dh,
                             double theta, float eps) {}
static void skip_finalize_add_rmsnorm(float *x, float *h, const float *expert_out,
                                      const float *topk_w, const tensor *w, int T, int K, int D,
                                      float eps) {}

/* A copy of o with the ops named in list (see the file comment) doing nothing; NULL with a
 * message for an unknown name. */
static const ops *skip_ops(const ops *o, const char *list) {
    static ops s;
    s = *o;
    char buf[256];
    snprintf(buf, sizeof buf, "%s", list);
    for (char *save = NULL, *w = strtok_r(buf, ",", &save); w; w = strtok_r(NULL, ",", &save)) {
        if (!strcmp(w, "attention")) s.attention = skip_attention;
        else if (!strcmp(w, "experts")) s.moe_experts = skip_moe_experts;
        else if (!strcmp(w, "linear")) s.linear = skip_linear;
        else if (!strcmp(w, "qkv_prepare")) s.qkv_prepare = skip_qkv_prepare;
        else if (!strcmp(w, "router")) s.router_topk = skip_router_topk;
        else if (!strcmp(w, "norms")) {
            s.add_rmsnorm = skip_add_rmsnorm;
            s.moe_finalize_add_rmsnorm = skip_finalize_add_rmsnorm;
        } else {
            fprintf(stderr, "bench_step: --skip: unknown op %s (attention, experts, linear, "
                            "qkv_prepare, router, norms)\n", w);
            return NULL;
        }
    }
    return &s;
}

/* --routing random: the router's logits redrawn uniformly before the real top-k (see the file
 * comment). */
static const ops *g_routed;
static uint64_t g_route_draws;
static void random_router_topk(int32_t *ids, float *w, const float *logits, int T, int E, int K,
                               bool norm) {
    /* logits is the model's own scratch, written by the router linear just before */
    g_routed->fill_random((void *)logits, DTYPE_F32, (int64_t)T * E, 0x7a11d0 + g_route_draws++,
                          0.0f, 1.0f);
    g_routed->router_topk(ids, w, logits, T, E, K, norm);
}

static const ops *random_routing_ops(const ops *o) {
    static ops s;
    s = *o;
    g_routed = o;
    s.router_topk = random_router_topk;
    return &s;
}

/* Bytes a decode step of B sequences at context ctx must read: the routed experts' weights at
 * wbytes_e bytes a weight, the other projections' at wbytes_p (the rest BF16). */
static double decode_floor_bytes(const model_config *c, int B, int ctx, size_t kv_elem,
                                 double wbytes_e, double wbytes_p) {
    double D = c->hidden_size, Dh = c->head_dim, H = c->num_attention_heads;
    double Hkv = c->num_key_value_heads, E = c->num_experts, K = c->num_experts_per_tok;
    double F = c->moe_intermediate_size, L = c->num_hidden_layers, V = c->vocab_size;
    double attn =
        (H * Dh * D * 2 + Hkv * Dh * D * 2) * wbytes_p + (2 * D + 2 * Dh) * 2; /* q o, k v, norms */
    double experts = 0, dense = 0;
    int n_moe = 0;
    for (int l = 0; l < c->num_hidden_layers; l++)
        n_moe += c->layer_is_moe[l];
    if (E > 0) experts = E * (1.0 - pow(1.0 - K / E, B)) * 3 * F * D * wbytes_e + E * D * 2;
    dense = 3.0 * c->intermediate_size * D * wbytes_p;
    double weights = L * attn + n_moe * experts + (L - n_moe) * dense + V * D * 2 + D * 2;
    double kv = (double)B * ctx * L * 2 * Hkv * Dh * (double)kv_elem;
    return weights + kv;
}

int main(int argc, char **argv) {
    const char *model_path = NULL, *device = "cuda", *load_format = "auto", *quant = NULL;
    int batches[16] = {1, 8, 64, 256}, n_batches = 4, pre[16] = {1, 8, 32}, n_pre = 3;
    int context = 1024, steps = 16, prefill_len = 2048, chunk = 8192, graph_bs = 0;
    const char *skip = NULL;
    bool random_routing = false;
    int kv_dtype = KV_DTYPE_AUTO;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            puts("usage: bench_step --model-path DIR [--load-format dummy] [--device cuda|cpu]\n"
                 "       [--batches 1,8,64,256] [--context 1024] [--steps 16]\n"
                 "       [--prefill-prompts 1,8,32] [--prefill-len 2048] [--chunk 8192]\n"
                 "       [--matmul-precision high|medium] [--cuda-graph-max-bs N]\n"
                 "       [--skip attention,experts,linear,qkv_prepare,router,norms]\n"
                 "       [--deterministic 0|1] [--quantization nvfp4|fp8]\n"
                 "       [--routing model|random] [--kv-cache-dtype auto|float32|bfloat16]\n"
                 "       [--context-length N]");
            return 0;
        }
        if (!v) {
            fprintf(stderr, "bench_step: %s needs a value\n", a);
            return 2;
        }
        i++;
        if (!strcmp(a, "--model-path")) model_path = v;
        else if (!strcmp(a, "--device")) device = v;
        else if (!strcmp(a, "--load-format")) load_format = v;
        else if (!strcmp(a, "--quantization")) quant = v;
        else if (!strcmp(a, "--batches")) n_batches = parse_list(v, batches, 16);
        else if (!strcmp(a, "--prefill-prompts")) n_pre = parse_list(v, pre, 16);
        else if (!strcmp(a, "--context")) context = atoi(v);
        else if (!strcmp(a, "--context-length"))
            g_room = atoi(v);
        else if (!strcmp(a, "--steps")) steps = atoi(v);
        else if (!strcmp(a, "--prefill-len")) prefill_len = atoi(v);
        else if (!strcmp(a, "--chunk")) chunk = atoi(v);
        else if (!strcmp(a, "--cuda-graph-max-bs")) graph_bs = atoi(v);
        else if (!strcmp(a, "--skip")) skip = v;
        else if (!strcmp(a, "--routing")) {
            if (strcmp(v, "random") && strcmp(v, "model")) {
                fprintf(stderr, "bench_step: --routing must be model or random, not %s\n", v);
                return 2;
            }
            random_routing = !strcmp(v, "random");
        } else if (!strcmp(a, "--kv-cache-dtype")) { /* the server's names */
            kv_dtype = kv_cache_dtype_parse(v);
            if (kv_dtype < 0) {
                fprintf(stderr, "bench_step: --kv-cache-dtype must be auto, float32 or bfloat16\n");
                return 2;
            }
        } else if (!strcmp(a, "--deterministic"))
            ops_cuda_set_deterministic(atoi(v) != 0);
        else if (!strcmp(a, "--matmul-precision")) {
            char e2[256];
            if (ops_cuda_set_matmul_precision(v, e2, sizeof e2)) {
                fprintf(stderr, "bench_step: %s\n", e2);
                return 2;
            }
        }
        else {
            fprintf(stderr, "bench_step: unknown flag %s\n", a);
            return 2;
        }
    }
    if (!model_path || context < 1 || steps < 1 || prefill_len < 1 || chunk < 1 || g_room < 0) {
        fprintf(stderr, "bench_step: --model-path is required (see --help)\n");
        return 2;
    }
    char err[1024];
    const ops *o = ops_cpu();
    const int kv_bf16 = kv_cache_dtype_bf16(kv_dtype, !strcmp(device, "cuda"));
    if (!strcmp(device, "cuda")) {
        o = ops_cuda(0, err, sizeof err);
        if (!o) {
            fprintf(stderr, "bench_step: %s\n", err);
            return 1;
        }
    }
    model_load_opts lo = {.ep_rank = 0, .ep_size = 1, .dummy = !strcmp(load_format, "dummy"),
                          .quantization = quant};
    double t0 = now();
    model *m = model_load_with(model_path, o, &lo, err, sizeof err);
    if (!m) {
        fprintf(stderr, "bench_step: %s\n", err);
        return 1;
    }
    o->sync();
    const model_config *c = &m->cfg;
    printf("model %s (%s weights%s%s) on %s, matmul precision %s, kv cache %s, loaded in %.1f s\n",
           model_path, lo.dummy ? "dummy" : "checkpoint", quant ? ", " : "", quant ? quant : "",
           o->name, ops_cuda_matmul_precision() == MATMUL_PRECISION_HIGH ? "high" : "medium",
           kv_bf16 ? "bfloat16" : "float32", now() - t0);
    /* the weights' bytes as the model holds them: NVFP4 experts as codes and E4M3 group scales
     * (W4A16), FP8 ones as codes (W8A16; their block scales negligible), other projections in FP8
     * where --quantization fp8 made them so and the backend keeps FP8 linears, else BF16 (NVFP4
     * dense projections are dequantized at load) */
    const int wq = m->online_quant ? m->online_quant : c->quant;
    const double wbytes_e = wq == MODEL_QUANT_NVFP4 ? 0.5 + 1.0 / 16
                            : wq == MODEL_QUANT_FP8 ? 1.0
                                                    : 2.0;
    const double wbytes_p =
        m->online_quant == MODEL_QUANT_FP8 && !m->online_quant_experts_only && o->prepare_linear_fp8
            ? 1.0
            : 2.0;
    double bw = copy_bandwidth(o);
    if (bw > 0) printf("device copy bandwidth: %.0f GB/s (read + write)\n", bw);

    int max_b = 1, max_p = 1;
    for (int i = 0; i < n_batches; i++)
        if (batches[i] > max_b) max_b = batches[i];
    for (int i = 0; i < n_pre; i++)
        if (pre[i] > max_p) max_p = pre[i];
    int S = 16;
    long need_dec = (long)max_b * ((context + steps + 2 + S - 1) / S);
    long need_pre = (long)max_p * ((prefill_len + 2 + S - 1) / S);
    int n_pages = (int)(need_dec > need_pre ? need_dec : need_pre);
    engine e;
    if (engine_init(&e, m, n_pages, S, chunk, kv_bf16, err, sizeof err)) {
        fprintf(stderr, "bench_step: %s\n", err);
        return 1;
    }
    int graph_pages = (context + steps + 2 + S - 1) / S;
    if (graph_bs > 0 && engine_enable_graphs(&e, graph_bs, graph_pages, err, sizeof err)) {
        fprintf(stderr, "bench_step: %s\n", err);
        return 1;
    }
    if (graph_bs > 0) printf("decode steps of up to %d sequences replayed as CUDA graphs\n", graph_bs);
    const ops *timed_ops = o;
    if (skip) {
        timed_ops = skip_ops(o, skip);
        if (!timed_ops) return 2;
        printf("decode steps skip: %s (their tokens are meaningless)\n", skip);
    }
    if (random_routing) {
        timed_ops = random_routing_ops(timed_ops);
        printf("decode steps route each token to uniformly drawn experts\n");
    }

    printf("\ndecode, context %d, %d timed steps (median)\n", context, steps);
    printf("%6s %10s %10s %10s %12s %10s %8s\n", "batch", "step ms", "fwd ms", "tok/s",
           "floor GB", "floor ms", "x floor");
    for (int bi = 0; bi < n_batches; bi++) {
        int B = batches[bi];
        bench_set set;
        set_init(&set, &e, B, context, steps + 2, 1000 + (uint64_t)B);
        /* Prefill every prompt. Steps of `chunk` tokens take the prompts in order, so the ones
         * done are a prefix, held back from the steps after: a prompt done early would otherwise
         * decode in every later prefill step and reach its last token before the timed steps,
         * which would then run fewer sequences than B. */
        for (int first = 0;;) {
            while (first < B && set.seqs[first].n_computed >= context)
                first++;
            if (first == B) break;
            set_step_from(&set, first);
        }
        m->ops = timed_ops;
        set_step(&set); /* warm-up decode step */
        double *t_step = xcalloc(steps, sizeof(double)), *t_fwd = xcalloc(steps, sizeof(double));
        for (int s = 0; s < steps; s++) {
            double a = now();
            const int fwd_tokens = set_step(&set);
            t_step[s] = now() - a;
            t_fwd[s] = e.last_forward_seconds;
            if (fwd_tokens != B) {
                fprintf(stderr, "bench_step: timed step %d of batch %d ran %d tokens\n", s, B,
                        fwd_tokens);
                return 1;
            }
        }
        qsort(t_step, steps, sizeof(double), cmp_double);
        qsort(t_fwd, steps, sizeof(double), cmp_double);
        m->ops = o;
        double step = t_step[steps / 2], fwd = t_fwd[steps / 2];
        double bytes = decode_floor_bytes(c, B, context + steps / 2, kv_cache_elem_bytes(kv_bf16),
                                          wbytes_e, wbytes_p);
        double floor_s = bw > 0 ? bytes / (bw * 1e9) : 0;
        printf("%6d %10.3f %10.3f %10.0f %12.2f %10.3f %8.2f\n", B, step * 1e3, fwd * 1e3,
               B / step, bytes / 1e9, floor_s * 1e3, floor_s > 0 ? step / floor_s : 0);
        free(t_step);
        free(t_fwd);
        set_free(&set);
    }

    printf("\nprefill, prompts of %d tokens, steps of at most %d tokens\n", prefill_len, chunk);
    printf("%8s %10s %12s\n", "prompts", "seconds", "tokens/s");
    for (int pi = 0; pi < n_pre; pi++) {
        int P = pre[pi];
        bench_set set;
        set_init(&set, &e, P, prefill_len, 1, 5000 + (uint64_t)P);
        o->sync();
        double a = now();
        while (set_step(&set) > 0 && set.seqs[P - 1].n_computed < prefill_len) {
        }
        o->sync();
        double secs = now() - a;
        printf("%8d %10.3f %12.0f\n", P, secs, (double)P * prefill_len / secs);
        set_free(&set);
    }
    engine_free(&e);
    model_free(m);
    return 0;
}
