/* Whole-model teacher-forced KL of the quantized formats against BF16 (issue 8's measure), on the
 * CPU backend:
 *
 *   build/quant_kl --model-path DIR [--fp8 DIR] [--nvfp4 DIR] [--sequences FILE] [--random N]
 *                  [--device cuda] [--matmul-precision high|medium]
 *
 * With --device cuda every model, BF16 included, runs on GPU 0 in the given precision (high by
 * default), so that the GPU's own formats are measured (in medium, FP8 experts from 16 pairs an
 * expert take the W8A8 kernels, h quantized per token per 128 channels: kernels/cuda/fp8_gemm.h).
 *
 * DIR is a BF16 checkpoint. The FP8 and NVFP4 models are DIR with --quantization fp8 and nvfp4
 * (the same weights, bit for bit, as scripts/make_quant_checkpoints.py's checkpoints:
 * tests/test_quant_model.c), or the quantized checkpoints named by --fp8 / --nvfp4. Each
 * sequence runs teacher-forced in one pass (prefill), and at every position p the next-token
 * distributions are compared: KL(P_bf16 || P_quant) = sum_v P_bf16(v) (log P_bf16(v) -
 * log P_quant(v)), in double over the whole vocabulary; the mean is over every position of every
 * sequence. Sequences: the teacher_forced input_ids of a reference file of
 * scripts/make_reference.py (default tests/data/reference-tiny-qwen3-moe.json: 6 GSM8K texts, 979
 * positions), or with
 * --random N one sequence of N random ids.
 *
 * Each format is measured three ways: as served (every projection quantized and the routed
 * experts' input in the experts' activation format, runner/model.h's expert_payload), with the
 * weights alone quantized (the activations left in fp32), which splits the KL between the two,
 * and with only the routed experts quantized (weights and input; attention and the dense MLP
 * left in BF16: model_load_opts.quantize_experts_only; not with --fp8 / --nvfp4). Printed beside
 * them, for the BF16 model: the mean entropy of its next-token distributions and the mean
 * log-probability of the actual next token, which say how peaked the checkpoint's predictions are
 * (the KL of a perturbation grows with that). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "common/log.h"
#include "runner/model.h"

enum { PAGE = 16 };

typedef struct {
    int n;
    int32_t *ids;
} sequence;

static void die(const char *fmt, const char *a) {
    fprintf(stderr, "quant_kl: ");
    fprintf(stderr, fmt, a);
    fprintf(stderr, "\n");
    exit(1);
}

/* The teacher_forced sequences of a reference file; returns their count. */
static int read_sequences(const char *path, sequence **out) {
    FILE *f = fopen(path, "rb");
    if (!f) die("%s: cannot open", path);
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *text = malloc((size_t)len + 1);
    if (fread(text, 1, (size_t)len, f) != (size_t)len) die("%s: short read", path);
    text[len] = '\0';
    fclose(f);
    cJSON *j = cJSON_Parse(text);
    free(text);
    const cJSON *tf = cJSON_GetObjectItemCaseSensitive(j, "teacher_forced");
    if (!cJSON_IsArray(tf)) die("%s: no teacher_forced array", path);
    int n = cJSON_GetArraySize(tf);
    *out = calloc((size_t)n, sizeof(sequence));
    for (int i = 0; i < n; i++) {
        const cJSON *ids = cJSON_GetObjectItemCaseSensitive(cJSON_GetArrayItem(tf, i), "input_ids");
        if (!cJSON_IsArray(ids)) die("%s: a teacher_forced entry has no input_ids", path);
        sequence *s = &(*out)[i];
        s->n = cJSON_GetArraySize(ids);
        s->ids = malloc(sizeof(int32_t) * (size_t)(s->n + 1));
        for (int t = 0; t < s->n; t++)
            s->ids[t] = (int32_t)cJSON_GetArrayItem(ids, t)->valueint;
    }
    cJSON_Delete(j);
    return n;
}

static const ops *backend; /* the CPU's, or with --device cuda GPU 0's */

static model *load(const char *dir, const char *quantization, bool experts_only) {
    char err[512];
    model_load_opts o = {.ep_rank = 0, .ep_size = 1, .quantization = quantization,
                         .quantize_experts_only = experts_only};
    model *m = model_load_with(dir, backend, &o, err, sizeof err);
    if (!m) die("%s", err);
    return m;
}

/* A copy of bytes at h where the backend's ops read them (the host's own on the CPU). */
static void *staged(const void *h, size_t bytes) {
    if (backend->device == DEVICE_CPU) return (void *)h;
    void *d = backend->dev_alloc(bytes);
    backend->to_device(d, h, bytes);
    return d;
}
static void unstage(void *d, const void *h) {
    if (d != h) backend->dev_free(d);
}

/* logits[n, V] of one teacher-forced pass over s. */
static void forward(model *m, const sequence *s, float *logits) {
    char err[512];
    const int n = s->n, pages = (n + PAGE - 1) / PAGE;
    kv_cache kv;
    if (kv_cache_init(&kv, m->ops, m->cfg.num_hidden_layers, pages, PAGE,
                      m->cfg.num_key_value_heads, m->cfg.head_dim, 0, err, sizeof err))
        die("kv cache: %s", err);
    int32_t *pos = malloc(sizeof(int32_t) * n), *seq = calloc((size_t)n, sizeof(int32_t));
    int32_t *rows = malloc(sizeof(int32_t) * n), *table = malloc(sizeof(int32_t) * pages);
    for (int t = 0; t < n; t++)
        pos[t] = rows[t] = t;
    for (int p = 0; p < pages; p++)
        table[p] = p;
    const size_t V = (size_t)m->cfg.vocab_size, lb = sizeof(float) * (size_t)n * V;
    int32_t *d_ids = staged(s->ids, 4 * (size_t)n), *d_pos = staged(pos, 4 * (size_t)n);
    int32_t *d_seq = staged(seq, 4 * (size_t)n), *d_rows = staged(rows, 4 * (size_t)n);
    int32_t *d_table = staged(table, 4 * (size_t)pages);
    float *d_logits = backend->device == DEVICE_CPU ? logits : backend->dev_alloc(lb);
    forward_batch b = {.T = n,
                       .ids = d_ids,
                       .attn = {.T = n,
                                .pos = d_pos,
                                .seq = d_seq,
                                .page_table = d_table,
                                .max_pages = pages,
                                .page_size = PAGE},
                       .n_logits = n,
                       .logit_rows = d_rows};
    if (m->arch->forward(m, &kv, &b, d_logits)) die("forward: %s", m->err);
    if (d_logits != logits) {
        backend->to_host(logits, d_logits, lb);
        backend->dev_free(d_logits);
    }
    unstage(d_ids, s->ids), unstage(d_pos, pos), unstage(d_seq, seq), unstage(d_rows, rows);
    unstage(d_table, table);
    kv_cache_free(&kv);
    free(pos), free(seq), free(rows), free(table);
}

static void log_softmax(double *out, const float *x, int V) {
    double mx = -INFINITY, sum = 0;
    for (int i = 0; i < V; i++)
        mx = x[i] > mx ? x[i] : mx;
    for (int i = 0; i < V; i++)
        sum += exp(x[i] - mx);
    for (int i = 0; i < V; i++)
        out[i] = x[i] - mx - log(sum);
}

static int argmax(const double *x, int V) {
    int best = 0;
    for (int i = 1; i < V; i++)
        if (x[i] > x[best]) best = i;
    return best;
}

int main(int argc, char **argv) {
    const char *dir = NULL, *fp8_dir = NULL, *nvfp4_dir = NULL, *device = "cpu";
    const char *precision = NULL;
    const char *seq_path = "tests/data/reference-tiny-qwen3-moe.json";
    int random_n = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) die("%s needs a value", a);
        if (!strcmp(a, "--model-path"))
            dir = v;
        else if (!strcmp(a, "--fp8"))
            fp8_dir = v;
        else if (!strcmp(a, "--nvfp4"))
            nvfp4_dir = v;
        else if (!strcmp(a, "--sequences"))
            seq_path = v;
        else if (!strcmp(a, "--random"))
            random_n = atoi(v);
        else if (!strcmp(a, "--device"))
            device = v;
        else if (!strcmp(a, "--matmul-precision"))
            precision = v;
        else
            die("unknown flag %s (see the header of scripts/quant_kl.c)", a);
        i++;
    }
    if (!dir) die("%s", "--model-path DIR (a BF16 checkpoint) is required");
    log_threshold = LOG_LEVEL_WARN;
    char err[256] = "";
    if (!strcmp(device, "cpu")) {
        backend = ops_cpu();
        if (precision) die("%s", "--matmul-precision is the CUDA backend's (--device cuda)");
    } else if (!strcmp(device, "cuda")) {
        backend = ops_cuda(0, err, sizeof err);
        if (!backend) die("--device cuda: %s", err);
        if (precision && ops_cuda_set_matmul_precision(precision, err, sizeof err))
            die("--matmul-precision: %s", err);
    } else {
        die("--device %s: cpu or cuda", device);
    }

    sequence *seqs;
    int n_seq;
    if (random_n > 0) {
        n_seq = 1;
        seqs = calloc(1, sizeof(sequence));
        seqs->n = random_n;
        seqs->ids = malloc(sizeof(int32_t) * (size_t)random_n);
        uint64_t r = 12345;
        for (int t = 0; t < random_n; t++) {
            r = r * 6364136223846793005ull + 1442695040888963407ull;
            seqs->ids[t] = (int32_t)((r >> 33) % 2048);
        }
    } else {
        n_seq = read_sequences(seq_path, &seqs);
    }

    /* The BF16 model's log-probabilities at every position, kept for the comparisons. */
    model *ref = load(dir, NULL, false);
    const int V = ref->cfg.vocab_size;
    int total = 0, max_n = 0;
    for (int i = 0; i < n_seq; i++) {
        total += seqs[i].n;
        max_n = seqs[i].n > max_n ? seqs[i].n : max_n;
    }
    if (total == 0 || max_n == 0) die("%s: no token sequences to score", dir);
    float *logits = malloc(sizeof(float) * (size_t)max_n * V);
    double *lp_ref = malloc(sizeof(double) * (size_t)total * V), *lq = malloc(sizeof(double) * V);
    double entropy = 0, nll = 0;
    int n_next = 0;
    for (int i = 0, at = 0; i < n_seq; at += seqs[i].n, i++) {
        forward(ref, &seqs[i], logits);
        for (int t = 0; t < seqs[i].n; t++) {
            double *lp = lp_ref + (size_t)(at + t) * V;
            log_softmax(lp, logits + (size_t)t * V, V);
            for (int v = 0; v < V; v++)
                entropy -= exp(lp[v]) * lp[v];
            if (t + 1 < seqs[i].n) nll -= lp[seqs[i].ids[t + 1]], n_next++;
        }
    }
    model_free(ref);
    printf("%s: %d sequences, %d positions; BF16: mean entropy %.3f nats, mean log-probability "
           "of the next token %.3f\n",
           dir, n_seq, total, entropy / total, n_next ? -nll / n_next : 0.0);

    static const struct {
        const char *name, *quantization;
        int act, experts_only;
    } variants[] = {
        {"FP8 (W8A8: weights, experts' input per token per 128)", "fp8", 1, 0},
        {"FP8 weights only", "fp8", 0, 0},
        {"FP8 routed experts only (attention, dense MLP BF16)", "fp8", 1, 1},
        {"NVFP4 (weights, experts' input as the nvfp4 payload)", "nvfp4", 1, 0},
        {"NVFP4 weights only", "nvfp4", 0, 0},
        {"NVFP4 routed experts only (attention, dense MLP BF16)", "nvfp4", 1, 1}};
    for (size_t k = 0; k < sizeof variants / sizeof variants[0]; k++) {
        const bool fp8 = !strcmp(variants[k].quantization, "fp8");
        const char *qdir = fp8 ? fp8_dir : nvfp4_dir;
        if (qdir && variants[k].experts_only) continue; /* a quantized checkpoint is what it is */
        model *m = qdir ? load(qdir, NULL, false)
                        : load(dir, variants[k].quantization, variants[k].experts_only);
        if (m->cfg.vocab_size != V) die("%s: another vocabulary than the BF16 model's", qdir);
        if (!variants[k].act) m->expert_payload = A2A_PAYLOAD_F32;
        double kl_sum = 0, worst = 0;
        int same_top1 = 0;
        for (int i = 0, at = 0; i < n_seq; at += seqs[i].n, i++) {
            forward(m, &seqs[i], logits);
            for (int t = 0; t < seqs[i].n; t++) {
                const double *lp = lp_ref + (size_t)(at + t) * V;
                log_softmax(lq, logits + (size_t)t * V, V);
                double kl = 0;
                for (int v = 0; v < V; v++)
                    kl += exp(lp[v]) * (lp[v] - lq[v]);
                kl_sum += kl;
                worst = kl > worst ? kl : worst;
                same_top1 += argmax(lp, V) == argmax(lq, V);
            }
        }
        printf("  %-56s mean KL %.3g (worst %.3g), top-1 token as BF16's at %.1f%% of positions\n",
               variants[k].name, kl_sum / total, worst, 100.0 * same_top1 / total);
        model_free(m);
    }
    for (int i = 0; i < n_seq; i++)
        free(seqs[i].ids);
    free(seqs), free(logits), free(lp_ref), free(lq);
    return 0;
}
