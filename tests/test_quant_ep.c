/* Quantized experts under expert parallelism, an MPI program: tests/a2a_test.sh runs it under
 * mpirun -np 1, 2 and 3 (run alone it is one rank). Only rank 0 prints the "N passed, M failed"
 * line, with every rank's counts summed.
 *
 * The experts' activation format (runner/model.h's expert_payload) is one rule for every rank
 * count: alone the model rounds the experts' input through ops->moe_input_quant, under an
 * all-to-all the dispatch's payload does it. For the test checkpoint in BF16, block FP8, NVFP4,
 * and BF16 with --quantization fp8 and nvfp4, each rank loads its share of the experts, creates
 * the all-to-all (shm; none on one rank) with the model's payload and runs two steps over its own
 * sequence (a prefill of a length that differs per rank, the third rank none, then one decode
 * token): the logits must equal, bit for bit, those of the whole model in one process without an
 * all-to-all on the same steps. Also: the payload each format picks, the op against
 * a2a_payload_roundtrip, and an all-to-all made with another payload than the experts' refused by
 * the forward with a message on every rank (before any token moves, so nobody waits). */
#include "kernels/a2a.h"
#include "runner/model.h"

#include <stdlib.h>
#include <string.h>

#include "tests/check.h"

#define DATA "tests/data/"
enum { S = 16, MAX_T = 96 };

static int g_rank, g_size;

#if defined(__SANITIZE_ADDRESS__) /* OpenMPI's allocations from MPI_Init (see test_a2a.c) */
const char *__lsan_default_options(void) { return "fast_unwind_on_malloc=0:print_suppressions=0"; }
const char *__lsan_default_suppressions(void) {
    return "leak:libmpi.so\nleak:libopen-pal.so\nleak:libevent_core\n";
}
#endif

/* Rank r's sequence: a prefill of prefill_len(r) tokens, then one decode token (none at all for
 * the third rank, which joins every all-to-all with zero tokens). */
static int prefill_len(int r) { return r == 2 ? 0 : 37 + 27 * r; }

static int32_t token(int r, int t) {
    uint64_t z = (uint64_t)(r * 1000 + t) * 0x9E3779B97F4A7C15ull;
    return (int32_t)((z >> 33) % 2048);
}

/* Two forward steps of this rank's sequence through m (with m->a2a when set): logits of every
 * prefill row, then of the decode row, into logits[(T + 1), V]. 0, or -1 with m->err set. */
static int run_steps(model *m, float *logits) {
    char err[512];
    const int T = prefill_len(g_rank), V = m->cfg.vocab_size, pages = (MAX_T + S - 1) / S;
    kv_cache kv;
    if (kv_cache_init(&kv, m->ops, m->cfg.num_hidden_layers, pages, S, m->cfg.num_key_value_heads,
                      m->cfg.head_dim, 0, err, sizeof err)) {
        CHECK(0, "kv cache: %s", err);
        return -1;
    }
    int32_t ids[MAX_T], pos[MAX_T], seq[MAX_T], rows[MAX_T], table[(MAX_T + S - 1) / S];
    for (int p = 0; p < pages; p++)
        table[p] = p;
    int rc = 0;
    for (int step = 0; step < 2 && rc == 0; step++) {
        const int n = step == 0 ? T : T > 0, p0 = step == 0 ? 0 : T;
        for (int t = 0; t < n; t++)
            ids[t] = token(g_rank, p0 + t), pos[t] = p0 + t, seq[t] = 0, rows[t] = t;
        int runtime_max = 0;
        if (m->a2a) MPI_Allreduce(&n, &runtime_max, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
        forward_batch b = {.T = n,
                           .ids = ids,
                           .attn = {.T = n, .pos = pos, .seq = seq, .page_table = table,
                                    .max_pages = pages, .page_size = S},
                           .n_logits = n,
                           .logit_rows = rows,
                           .runtime_max = runtime_max};
        rc = m->arch->forward(m, &kv, &b, logits + (size_t)p0 * V);
    }
    kv_cache_free(&kv);
    return rc;
}

static model *load(const char *dir, const char *quantization, int ep_rank, int ep_size) {
    char err[512];
    model_load_opts o = {.ep_rank = ep_rank, .ep_size = ep_size, .quantization = quantization};
    model *m = model_load_with(dir, ops_cpu(), &o, err, sizeof err);
    CHECK(m != NULL, "rank %d: %s: %s", g_rank, dir, err);
    return m;
}

static a2a *make_a2a(const model *m, a2a_payload payload) {
    char err[512];
    a2a_config c = {.transport = g_size > 1 ? A2A_SHM : A2A_NONE,
                    .ep_size = g_size,
                    .rank = g_rank,
                    .max_tokens_per_rank = MAX_T,
                    .hidden = m->cfg.hidden_size,
                    .top_k = m->cfg.num_experts_per_tok,
                    .n_experts = m->cfg.num_experts,
                    .payload = payload,
                    .timeout_s = 30};
    a2a_split_experts(m->cfg.num_experts, g_size, c.expert_begin);
    a2a *a = a2a_create(&c, MPI_COMM_WORLD, err, sizeof err);
    CHECK(a != NULL, "rank %d: a2a_create: %s", g_rank, err);
    return a;
}

static void test_checkpoint(const char *dir, const char *quantization, a2a_payload want) {
    char what[256];
    snprintf(what, sizeof what, "%s%s%s (np %d, rank %d)", dir, quantization ? " --quantization " : "",
             quantization ? quantization : "", g_size, g_rank);
    model *one = load(dir, quantization, 0, 1), *part = load(dir, quantization, g_rank, g_size);
    int ok = one && part, all_ok = 0;
    MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_LAND, MPI_COMM_WORLD);
    if (!all_ok) {
        model_free(one), model_free(part);
        return;
    }
    CHECK(part->expert_payload == (int)want && one->expert_payload == (int)want,
          "%s: the experts' payload is %s, want %s", what,
          a2a_payload_name((a2a_payload)part->expert_payload), a2a_payload_name(want));
    const int T = prefill_len(g_rank), V = one->cfg.vocab_size;
    float *ref = calloc((size_t)(T + 1) * V, sizeof(float));
    float *got = calloc((size_t)(T + 1) * V, sizeof(float));
    CHECK(run_steps(one, ref) == 0, "%s: one process: %s", what, one->err);

    part->a2a = make_a2a(part, (a2a_payload)part->expert_payload);
    if (part->a2a) {
        int rc = run_steps(part, got);
        CHECK(rc == 0, "%s: forward with the all-to-all: %s", what, part->err);
        const size_t n = (size_t)(T > 0 ? T + 1 : 0) * V;
        size_t diff = 0, first = 0;
        for (size_t i = n; i-- > 0;)
            if (memcmp(&got[i], &ref[i], sizeof(float)) != 0) diff++, first = i;
        CHECK(rc == 0 && diff == 0,
              "%s: %zu of %zu logits differ from one process (first: row %zu, %.9g vs %.9g)",
              what, diff, n, first / V, got[first], ref[first]);
        a2a_destroy(part->a2a);
    }
    /* An all-to-all that would hand the experts other values than one process gives them. */
    a2a_payload other = want == A2A_PAYLOAD_F32 ? A2A_PAYLOAD_FP8 : A2A_PAYLOAD_F32;
    part->a2a = make_a2a(part, other);
    if (part->a2a) {
        int rc = run_steps(part, got);
        CHECK(rc != 0 && strstr(part->err, a2a_payload_name(other)) &&
                  strstr(part->err, a2a_payload_name(want)),
              "%s: an all-to-all of %s tokens is refused: rc %d, '%s'", what,
              a2a_payload_name(other), rc, part->err);
        a2a_destroy(part->a2a);
    }
    part->a2a = NULL;
    free(ref), free(got);
    model_free(one), model_free(part);
}

/* ops->moe_input_quant is a2a_payload_roundtrip token by token, in place or not. */
static void test_op(void) {
    enum { T = 5, D = 96 };
    float x[T * D], y[T * D], z[T * D], want[D];
    for (int i = 0; i < T * D; i++)
        x[i] = (float)((i * 37 % 101) - 50) * (i % 7 == 0 ? 3.1f : 0.013f);
    for (int p = A2A_PAYLOAD_F32; p <= A2A_PAYLOAD_NVFP4; p++) {
        ops_cpu()->moe_input_quant(y, x, T, D, p);
        memcpy(z, x, sizeof z);
        ops_cpu()->moe_input_quant(z, z, T, D, p);
        int same = 1;
        for (int t = 0; t < T; t++) {
            a2a_payload_roundtrip((a2a_payload)p, want, x + t * D, D);
            same &= !memcmp(want, y + t * D, sizeof want) && !memcmp(want, z + t * D, sizeof want);
        }
        CHECK(same, "moe_input_quant %s: not a2a_payload_roundtrip per token",
              a2a_payload_name((a2a_payload)p));
    }
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &g_size);
    if (g_rank == 0) test_op();
    test_checkpoint(DATA "tiny-qwen3-moe", NULL, A2A_PAYLOAD_F32);
    test_checkpoint(DATA "tiny-qwen3-moe-fp8", NULL, A2A_PAYLOAD_FP8);
    test_checkpoint(DATA "tiny-qwen3-moe-nvfp4", NULL, A2A_PAYLOAD_NVFP4);
    test_checkpoint(DATA "tiny-qwen3-moe", "fp8", A2A_PAYLOAD_FP8);
    test_checkpoint(DATA "tiny-qwen3-moe", "nvfp4", A2A_PAYLOAD_NVFP4);
    int mine[2] = {check_passed, check_failed}, sum[2] = {0, 0};
    MPI_Allreduce(mine, sum, 2, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    if (g_rank == 0) printf("%d passed, %d failed\n", sum[0], sum[1]);
    MPI_Finalize();
    return sum[1] ? 1 : 0;
}
