/* The quantized test checkpoints (tests/data/tiny-qwen3-moe-fp8, -nvfp4) loaded by the model:
 * each quantized weight the loader hands out is, bit for bit, kernels/cpu/quant.c's round trip of
 * the BF16 checkpoint's weight (dequantized at load, runner/model.c); and the three checkpoints
 * teacher-forced on 256 tokens through the CPU model (the routed experts' input in their
 * activation format), with the mean KL(BF16 || quantized) of the next-token distributions
 * printed. This test checkpoint's random weights are drawn large (gains above 1, a near one-hot
 * router) and amplify any perturbation from layer to layer, so the KL it measures is far above
 * what the formats cost a model of realistic scales; tests/data/tiny-qwen3-moe-kl has such scales
 * (scripts/make_kl_checkpoint.py) and is measured the same way. Issue 8's limits (FP8 1e-3,
 * NVFP4 2e-2) are not met by either random checkpoint (docs/benchmarks.md has the figures,
 * build/quant_kl the fuller measure): the figures are printed, and only their sanity is checked
 * here (finite, NVFP4 above FP8, realistic scales below the test checkpoint's); the limits are
 * checked on a trained checkpoint by tests/quant_kl_test.sh. Also: --quantization
 * (model_load_opts) on the BF16 checkpoint gives the quantized checkpoints' logits bit for bit,
 * and bad values stop the load with a message. */
#include "runner/model.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/quant.h"

#include "tests/check.h"

#define DATA "tests/data/"
enum { T = 256, S = 16 };

/* logits[T, V] of one pass over ids (one sequence, positions 0..T-1). */
static float *run_model(const char *dir, const char *quantization, const int32_t *ids, int *V) {
    char err[512];
    model_load_opts o = {.ep_rank = 0, .ep_size = 1, .quantization = quantization};
    model *m = model_load_with(dir, ops_cpu(), &o, err, sizeof err);
    CHECK(m != NULL, "%s: %s", dir, err);
    if (!m) return NULL;
    *V = m->cfg.vocab_size;
    kv_cache kv;
    const int pages = (T + S - 1) / S;
    if (kv_cache_init(&kv, m->ops, m->cfg.num_hidden_layers, pages, S, m->cfg.num_key_value_heads,
                      m->cfg.head_dim, 0, err, sizeof err)) {
        CHECK(0, "kv cache: %s", err);
        model_free(m);
        return NULL;
    }
    int32_t pos[T], seq[T], rows[T], table[(T + S - 1) / S];
    for (int t = 0; t < T; t++)
        pos[t] = t, seq[t] = 0, rows[t] = t;
    for (int p = 0; p < pages; p++)
        table[p] = p;
    forward_batch b = {.T = T,
                       .ids = ids,
                       .attn = {.T = T, .pos = pos, .seq = seq, .page_table = table,
                                .max_pages = pages, .page_size = S},
                       .n_logits = T,
                       .logit_rows = rows};
    float *logits = malloc(sizeof(float) * T * *V);
    int rc = m->arch->forward(m, &kv, &b, logits);
    CHECK(rc == 0, "%s: forward", dir);
    kv_cache_free(&kv);
    model_free(m);
    return logits;
}

static void log_softmax(double *out, const float *x, int V) {
    double mx = -INFINITY, s = 0;
    for (int i = 0; i < V; i++)
        mx = x[i] > mx ? x[i] : mx;
    for (int i = 0; i < V; i++)
        s += exp(x[i] - mx);
    for (int i = 0; i < V; i++)
        out[i] = x[i] - mx - log(s);
}

/* Mean over the T positions of KL(softmax(ref) || softmax(q)) for logits [T, V]. */
static double mean_kl(const float *ref, const float *q, int V) {
    double *lp = malloc(sizeof(double) * V), *lq = malloc(sizeof(double) * V), sum = 0;
    for (int t = 0; t < T; t++) {
        log_softmax(lp, ref + (size_t)t * V, V);
        log_softmax(lq, q + (size_t)t * V, V);
        for (int i = 0; i < V; i++)
            sum += exp(lp[i]) * (lp[i] - lq[i]);
    }
    free(lp), free(lq);
    return sum / T;
}

/* The loader's weight `name` [N, K] of the quantized checkpoint against the C round trip of the
 * BF16 checkpoint's. */
static void check_weight(model *bf, model *q, const char *name, int N, int K, bool fp8) {
    const tensor *w0, *wq;
    char err[512];
    int64_t shape[2] = {N, K};
    CHECK(model_weight_info(bf, name, 2, shape, &w0, err, sizeof err) == 0, "%s", err);
    CHECK(model_weight_info(q, name, 2, shape, &wq, err, sizeof err) == 0, "%s", err);
    if (!w0 || !wq || wq->dtype != DTYPE_F32) {
        CHECK(0, "%s: no F32 weight from the quantized checkpoint", name);
        return;
    }
    float *w = malloc(sizeof(float) * N * K), *want = malloc(sizeof(float) * N * K);
    for (int64_t i = 0; i < (int64_t)N * K; i++)
        w[i] = bf16_to_f32(((const uint16_t *)w0->data)[i]);
    if (fp8) {
        const int nb = ((N + 127) / 128) * ((K + 127) / 128);
        uint8_t *codes = malloc((size_t)N * K);
        float *s = malloc(sizeof(float) * nb);
        quant_fp8_blocks(codes, s, w, N, K);
        dequant_fp8_blocks(want, codes, s, N, K);
        free(codes), free(s);
    } else {
        uint8_t *codes = malloc((size_t)N * K / 2), *sf = malloc((size_t)N * K / 16);
        float s2 = quant_nvfp4(codes, sf, w, N, K, 0.0f);
        dequant_nvfp4(want, codes, sf, s2, N, K);
        free(codes), free(sf);
    }
    CHECK(memcmp(want, wq->data, sizeof(float) * N * K) == 0,
          "%s (%s): the loaded weight is not the round trip of the BF16 one", name,
          fp8 ? "fp8" : "nvfp4");
    free(w), free(want);
}

/* model_weight_nvfp4, the parts a W4A16 backend gets: on the NVFP4 checkpoint they decode to the
 * loader's F32 weight bit for bit; the BF16 and FP8 checkpoints have none; a wrong shape is an
 * error naming the tensor. */
static void check_nvfp4_parts(model *bf, model *f8, model *f4, const char *name, int N, int K) {
    const uint8_t *q = NULL, *sf = NULL;
    float s2 = 0.0f;
    char err[512] = "";
    CHECK(model_weight_nvfp4(bf, name, N, K, &q, &sf, &s2, err, sizeof err) == 0 &&
              model_weight_nvfp4(f8, name, N, K, &q, &sf, &s2, err, sizeof err) == 0,
          "%s: no NVFP4 parts in the BF16 and FP8 checkpoints", name);
    CHECK(model_weight_nvfp4(f4, name, N, 2 * K, &q, &sf, &s2, err, sizeof err) == -1 &&
              strstr(err, name),
          "%s with twice its K: refused (%s)", name, err);
    const int rc = model_weight_nvfp4(f4, name, N, K, &q, &sf, &s2, err, sizeof err);
    CHECK(rc == 1 && q && sf && s2 > 0.0f, "%s: NVFP4 parts (%d: %s)", name, rc, err);
    if (rc != 1) return;
    const tensor *wq;
    int64_t shape[2] = {N, K};
    CHECK(model_weight_info(f4, name, 2, shape, &wq, err, sizeof err) == 0, "%s", err);
    float *w = malloc(sizeof(float) * N * K);
    dequant_nvfp4(w, q, sf, s2, N, K);
    CHECK(memcmp(w, wq->data, sizeof(float) * N * K) == 0,
          "%s: its NVFP4 parts decode to the loaded weight", name);
    free(w);
}

/* model_weight_fp8_into / _nvfp4_into, the codes a W8A16 / W4A16 backend gets: a quantized
 * checkpoint's own; with --quantization on the BF16 checkpoint, codes that decode to the weight
 * the loader hands the CPU, bit for bit (so the GPU's experts are the CPU's); none otherwise. */
static void check_codes_into(const char *name, int N, int K) {
    char err[512] = "";
    model_load_opts o8 = {.ep_rank = 0, .ep_size = 1, .quantization = "fp8"};
    model_load_opts o4 = {.ep_rank = 0, .ep_size = 1, .quantization = "nvfp4"};
    model *bf = model_load(DATA "tiny-qwen3-moe", ops_cpu(), err, sizeof err);
    model *q8 = model_load_with(DATA "tiny-qwen3-moe", ops_cpu(), &o8, err, sizeof err);
    model *q4 = model_load_with(DATA "tiny-qwen3-moe", ops_cpu(), &o4, err, sizeof err);
    model *f8 = model_load(DATA "tiny-qwen3-moe-fp8", ops_cpu(), err, sizeof err);
    CHECK(bf && q8 && q4 && f8, "load: %s", err);
    if (!bf || !q8 || !q4 || !f8) goto out;
    const int nb = (N + 127) / 128 * ((K + 127) / 128);
    uint8_t *q = malloc((size_t)N * K), *sf = malloc((size_t)N * K / 16);
    float *s = malloc(sizeof(float) * nb), *w = malloc(sizeof(float) * N * K), s2 = 0;
    const int64_t shape[2] = {N, K};
    const tensor *t;
    CHECK(model_weight_fp8_into(bf, name, N, K, q, s, err, sizeof err) == 0 &&
              model_weight_nvfp4_into(bf, name, N, K, q, sf, &s2, err, sizeof err) == 0 &&
              model_weight_nvfp4_into(q8, name, N, K, q, sf, &s2, err, sizeof err) == 0,
          "%s: no codes from the BF16 checkpoint, nor NVFP4 ones under --quantization fp8", name);
    int rc = model_weight_fp8_into(q8, name, N, K, q, s, err, sizeof err);
    CHECK(rc == 1 && model_weight_info(q8, name, 2, shape, &t, err, sizeof err) == 0,
          "%s: --quantization fp8 codes (%d: %s)", name, rc, err);
    if (rc == 1) {
        dequant_fp8_blocks(w, q, s, N, K);
        CHECK(memcmp(w, t->data, sizeof(float) * N * K) == 0,
              "%s: --quantization fp8 codes decode to the loaded weight", name);
    }
    rc = model_weight_nvfp4_into(q4, name, N, K, q, sf, &s2, err, sizeof err);
    CHECK(rc == 1 && model_weight_info(q4, name, 2, shape, &t, err, sizeof err) == 0,
          "%s: --quantization nvfp4 codes (%d: %s)", name, rc, err);
    if (rc == 1) {
        dequant_nvfp4(w, q, sf, s2, N, K);
        CHECK(memcmp(w, t->data, sizeof(float) * N * K) == 0,
              "%s: --quantization nvfp4 codes decode to the loaded weight", name);
    }
    const uint8_t *cq = NULL;
    const float *cs = NULL;
    rc = model_weight_fp8_into(f8, name, N, K, q, s, err, sizeof err);
    CHECK(rc == 1 && model_weight_fp8(f8, name, N, K, &cq, &cs, err, sizeof err) == 1 &&
              memcmp(q, cq, (size_t)N * K) == 0 && memcmp(s, cs, sizeof(float) * nb) == 0,
          "%s: the FP8 checkpoint's own codes and scales (%d: %s)", name, rc, err);
    CHECK(model_weight_fp8_into(f8, name, N, 2 * K, q, s, err, sizeof err) == -1 &&
              strstr(err, name),
          "%s with twice its K: refused (%s)", name, err);
    free(q), free(sf), free(s), free(w);
out:
    model_free(bf);
    model_free(q8);
    model_free(q4);
    model_free(f8);
}

static void test_loaded_weights(void) {
    char err[512];
    model *bf = model_load(DATA "tiny-qwen3-moe", ops_cpu(), err, sizeof err);
    model *f8 = model_load(DATA "tiny-qwen3-moe-fp8", ops_cpu(), err, sizeof err);
    model *f4 = model_load(DATA "tiny-qwen3-moe-nvfp4", ops_cpu(), err, sizeof err);
    CHECK(bf && f8 && f4, "load: %s", err);
    if (bf && f8 && f4) {
        CHECK(f8->cfg.quant == MODEL_QUANT_FP8 && f4->cfg.quant == MODEL_QUANT_NVFP4 &&
                  bf->cfg.quant == MODEL_QUANT_NONE,
              "quantization read from the configs: %d %d %d", bf->cfg.quant, f8->cfg.quant,
              f4->cfg.quant);
        static const struct {
            const char *name;
            int N, K;
        } w[] = {{"model.layers.0.self_attn.q_proj.weight", 128, 64},
                 {"model.layers.0.self_attn.o_proj.weight", 64, 128},
                 {"model.layers.1.mlp.up_proj.weight", 128, 64},
                 {"model.layers.2.mlp.experts.5.down_proj.weight", 64, 64},
                 {"model.layers.3.mlp.experts.0.gate_proj.weight", 64, 64}};
        for (size_t i = 0; i < sizeof w / sizeof w[0]; i++) {
            check_weight(bf, f8, w[i].name, w[i].N, w[i].K, true);
            check_weight(bf, f4, w[i].name, w[i].N, w[i].K, false);
            check_nvfp4_parts(bf, f8, f4, w[i].name, w[i].N, w[i].K);
        }
        check_codes_into("model.layers.2.mlp.experts.5.down_proj.weight", 64, 64);
        check_codes_into("model.layers.0.self_attn.q_proj.weight", 128, 64);
    }
    model_free(bf);
    model_free(f8);
    model_free(f4);
}

int main(void) {
    test_loaded_weights();
    int32_t ids[T];
    uint64_t r = 12345;
    int V = 0, V8 = 0, V4 = 0;
    for (int t = 0; t < T; t++) {
        r = r * 6364136223846793005ull + 1442695040888963407ull;
        ids[t] = (int32_t)((r >> 33) % 2048);
    }
    float *ref = run_model(DATA "tiny-qwen3-moe", NULL, ids, &V);
    float *f8 = run_model(DATA "tiny-qwen3-moe-fp8", NULL, ids, &V8);
    float *f4 = run_model(DATA "tiny-qwen3-moe-nvfp4", NULL, ids, &V4);
    if (!ref || !f8 || !f4 || V != V8 || V != V4) CHECK_SUMMARY();
    /* --quantization on the BF16 checkpoint: the same model as the quantized checkpoint's */
    int Vq = 0;
    float *q8 = run_model(DATA "tiny-qwen3-moe", "fp8", ids, &Vq);
    CHECK(q8 && memcmp(q8, f8, sizeof(float) * T * V) == 0,
          "--quantization fp8: logits differ from the FP8 checkpoint's");
    float *q4 = run_model(DATA "tiny-qwen3-moe", "modelopt_fp4", ids, &Vq);
    CHECK(q4 && memcmp(q4, f4, sizeof(float) * T * V) == 0,
          "--quantization modelopt_fp4: logits differ from the NVFP4 checkpoint's");
    free(q8), free(q4);
    char err[512];
    model_load_opts bad = {.ep_rank = 0, .ep_size = 1, .quantization = "nvfp4"};
    model *m = model_load_with(DATA "tiny-qwen3-moe-fp8", ops_cpu(), &bad, err, sizeof err);
    CHECK(!m && strstr(err, "block FP8"), "nvfp4 on the FP8 checkpoint: '%s'", err);
    model_free(m);
    bad.quantization = "int4";
    m = model_load_with(DATA "tiny-qwen3-moe", ops_cpu(), &bad, err, sizeof err);
    CHECK(!m && strstr(err, "int4"), "an unknown --quantization: '%s'", err);
    model_free(m);
    double *lp = malloc(sizeof(double) * V), *lq = malloc(sizeof(double) * V);
    double kl8 = 0, kl4 = 0, worst8 = 0, worst4 = 0;
    for (int t = 0; t < T; t++) {
        log_softmax(lp, ref + (size_t)t * V, V);
        for (int which = 0; which < 2; which++) {
            log_softmax(lq, (which ? f4 : f8) + (size_t)t * V, V);
            double kl = 0;
            for (int i = 0; i < V; i++)
                kl += exp(lp[i]) * (lp[i] - lq[i]);
            if (which) {
                kl4 += kl / T;
                worst4 = kl > worst4 ? kl : worst4;
            } else {
                kl8 += kl / T;
                worst8 = kl > worst8 ? kl : worst8;
            }
        }
    }
    printf("teacher-forced KL(BF16 || quantized) over %d positions: FP8 mean %.3g (worst %.3g), "
           "NVFP4 mean %.3g (worst %.3g)\n",
           T, kl8, worst8, kl4, worst4);
    CHECK(isfinite(kl8) && isfinite(kl4) && kl8 > 0 && kl4 > kl8,
          "the formats change the model, NVFP4 more than FP8 (%.3g, %.3g)", kl8, kl4);
    /* The same measure on the checkpoint of realistic scales, quantized at load. */
    int Vr = 0, Vr8 = 0, Vr4 = 0;
    float *r0 = run_model(DATA "tiny-qwen3-moe-kl", NULL, ids, &Vr);
    float *r8 = run_model(DATA "tiny-qwen3-moe-kl", "fp8", ids, &Vr8);
    float *r4 = run_model(DATA "tiny-qwen3-moe-kl", "nvfp4", ids, &Vr4);
    if (r0 && r8 && r4 && Vr == V && Vr8 == V && Vr4 == V) {
        const double rk8 = mean_kl(r0, r8, V), rk4 = mean_kl(r0, r4, V);
        printf("tiny-qwen3-moe-kl (realistic scales): FP8 mean %.3g, NVFP4 mean %.3g (issue 8's "
               "limits: 1e-3 and 2e-2)\n",
               rk8, rk4);
        CHECK(isfinite(rk8) && isfinite(rk4) && rk8 > 0 && rk4 > rk8 && rk8 < kl8 && rk4 < kl4,
              "realistic scales: NVFP4 (%.3g) above FP8 (%.3g), both below the test "
              "checkpoint's (%.3g, %.3g)",
              rk4, rk8, kl4, kl8);
    }
    free(r0), free(r8), free(r4);
    free(lp), free(lq), free(ref), free(f8), free(f4);
    CHECK_SUMMARY();
}
