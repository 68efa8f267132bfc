/* moeserve command line: serve (the default), generate, tokenize, detokenize.
 *
 * Every flag is parsed and validated here, once; a bad one stops the program with a message that
 * names it. Text <-> ids conversion happens here, at the edge; the engine sees ids.
 *
 * serve builds, in order: model config (for the defaults) -> tokenizer (none with
 * --skip-tokenizer-init: the API then speaks token ids only) -> chat template -> metrics -> api ->
 * HTTP listener (answers 503 until ready) -> model -> scheduler -> engine thread; then waits for
 * SIGINT or SIGTERM and takes it all down in reverse: refuse new requests (503, /health too), let
 * the engine finish what is queued and running for up to --shutdown-timeout seconds (in a rank
 * group every rank drains with the first one signalled, and they stop together), then stop the
 * engine loop (it finishes every request left with an abort, so each gets an answer), let the
 * answers go out, stop HTTP, free, exit 0. A second signal while draining aborts at once. The
 * signals are blocked in every thread and taken by sigtimedwait in the main thread, so no
 * handler runs inside library code; the engine thread tells the main thread what it learns (its
 * loop ended, another rank drains) through flags the main thread polls, never by a signal. */
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <omp.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"
#include "kernels/a2a.h"
#ifdef MOESERVE_CUDA
#include "kernels/cuda/a2a_cuda.h"
#endif
#include "kernels/ops.h"
#include "runner/engine.h"
#include "runner/model.h"
#include "runner/rank_group.h"
#include "runner/sampler.h"
#include "runner/scheduler.h"
#include "server/api.h"
#include "server/chat_template.h"
#include "server/generate_json.h"
#include "server/http.h"
#include "server/metrics.h"
#include "server/tokenizer.h"

#define MAX_STOP_STRINGS 16

static const char usage_main[] =
    "usage: moeserve [command] [flags]\n"
    "\n"
    "commands:\n"
    "  serve        HTTP server: SGLang /generate and OpenAI /v1 endpoints (the default command:\n"
    "               `moeserve --model-path DIR` serves)\n"
    "  generate     run one prompt through the model and print an SGLang /generate answer (JSON)\n"
    "  tokenize     read text on stdin, print its token ids as a JSON array\n"
    "  detokenize   read a JSON array of ids on stdin, print the text\n"
    "\n"
    "`moeserve <command> --help` explains the flags of a command.\n";

static const char usage_generate[] =
    "usage: moeserve generate --model-path DIR (--prompt TEXT | --input-ids 1,2,3) [flags]\n"
    "\n"
    "  --model-path DIR         Hugging Face model folder (config.json, *.safetensors, "
    "tokenizer.json)\n"
    "  --prompt TEXT            prompt text, tokenized with DIR/tokenizer.json (no special tokens "
    "added\n"
    "                           unless the tokenizer's post-processor adds them)\n"
    "  --input-ids LIST         prompt as comma-separated token ids\n"
    "  --max-new-tokens N       tokens to generate (default 128; 0 scores the prompt only)\n"
    "  --min-new-tokens N       ignore eos and stop ids before N tokens (default 0)\n"
    "  --temperature T          sampling temperature, >= 0 (default 1; below 1e-6 is greedy)\n"
    "  --top-p P                nucleus mass in (0, 1] (default 1)\n"
    "  --top-k K                keep the K most likely tokens, -1 = all (default -1)\n"
    "  --min-p P                drop tokens below P x the top probability, in [0, 1] (default 0)\n"
    "  --repetition-penalty R   in (0, 2] over prompt and output (default 1)\n"
    "  --frequency-penalty F    in [-2, 2] over output (default 0)\n"
    "  --presence-penalty F     in [-2, 2] over output (default 0)\n"
    "  --seed S                 sampling seed; the same seed gives the same output (default 0)\n"
    "  --stop TEXT              stop when the text contains TEXT (repeatable, trimmed from text)\n"
    "  --stop-token-ids LIST    stop on any of these ids (comma-separated)\n"
    "  --ignore-eos             do not stop on the model's eos ids\n"
    "  --no-skip-special-tokens keep special tokens in the output text\n"
    "  --return-logprob         add input_token_logprobs and output_token_logprobs to meta_info\n"
    "  --logprob-start-len N    first prompt position scored (default -1: output only)\n"
    "  --device cpu|cuda        where the model runs (default cpu; cuda uses GPU 0)\n"
    "  --cuda-graph-max-bs N    replay decode steps as CUDA graphs (default 0: off)\n"
    "  --kv-cache-dtype D       auto (default: bfloat16 on cuda, float32 on cpu), float32,\n"
    "                           bfloat16 (half the cache's bytes; k and v rounded to BF16 once\n"
    "                           as they are stored)\n"
    "  --matmul-precision P     CUDA GEMM inputs: high (default: faithful to fp32 activations)\n"
    "                           or medium (activations rounded to BF16: faster prefill)\n"
    "  --load-format F          auto (default) or safetensors: the checkpoint; dummy: random\n"
    "                           weights from config.json alone (give --input-ids)\n"
    "  --quantization Q         fp8 or modelopt_fp4 (nvfp4): quantize a BF16 checkpoint's\n"
    "                           projections as they load (default: the checkpoint's format)\n"
    "  --threads N              CPU threads (default: all cores; their waits sleep unless\n"
    "                           OMP_WAIT_POLICY=active is set)\n"
    "  --enable-deterministic-inference\n"
    "                           results that never depend on the batch (the CPU always\n"
    "                           computes this way; --device cuda pins its GEMMs' algorithms)\n"
    "  --log-level LEVEL        debug, info, warn or error (default warn)\n";

static const char usage_serve[] =
    "usage: moeserve serve --model-path DIR [flags]\n"
    "\n"
    "  --model-path DIR              Hugging Face model folder (config.json, *.safetensors,\n"
    "                                tokenizer.json, tokenizer_config.json)\n"
    "  --load-format F               auto (default) or safetensors: the checkpoint; dummy: random\n"
    "                                weights from config.json alone (the same on every run)\n"
    "  --quantization Q              fp8 or modelopt_fp4 (nvfp4): quantize a BF16 checkpoint's\n"
    "                                projections as they load (default: the checkpoint's format)\n"
    "  --skip-tokenizer-init         load no tokenizer (the folder may have none): /generate\n"
    "                                takes input_ids and answers output_ids without text,\n"
    "                                /v1/completions takes token-id prompts, chat answers 400,\n"
    "                                stop strings answer 400 (stop_token_ids still work)\n"
    "  --host ADDR                   address to listen on (default 127.0.0.1)\n"
    "  --port N                      TCP port (default 30000; 0 = any free port)\n"
    "  --device cpu|cuda             where the model runs (default cpu)\n"
    "  --cuda-graph-max-bs N         replay decode steps of up to N requests as CUDA graphs\n"
    "                                (default with --device cuda: 256, or --max-running-\n"
    "                                requests if fewer; 0 or --disable-cuda-graph: off)\n"
    "  --matmul-precision P          CUDA GEMM inputs: high (default; faithful to the fp32\n"
    "                                activations) or medium (rounded to BF16; faster prefill)\n"
    "  --max-running-requests N      requests decoded together at most (default 64; 256 on a\n"
    "                                GPU)\n"
    "  --max-total-tokens N          KV cache capacity in tokens (default: 4 full contexts or\n"
    "                                65536 tokens, whichever is more, within a quarter of RAM;\n"
    "                                on a GPU: from --mem-fraction-static)\n"
    "  --mem-fraction-static F       share of the device's memory for the weights and the KV\n"
    "                                pool together, in (0, 1) (default 0.85 on a GPU; on the\n"
    "                                CPU only when given)\n"
    "  --chunked-prefill-size N      prompt tokens per engine step, all requests (default 512;\n"
    "                                8192 on a GPU)\n"
    "  --context-length N            prompt + output limit per request (default: the model's\n"
    "                                max_position_embeddings, also the largest allowed)\n"
    "  --page-size N                 tokens per KV cache page (default 16)\n"
    "  --kv-cache-dtype D            auto (default: bfloat16 on cuda, float32 on cpu), float32,\n"
    "                                bfloat16 (bf16): half the bytes a token takes, so twice the\n"
    "                                tokens in the same memory; k and v rounded to BF16 once as\n"
    "                                they are stored\n"
    "  --served-model-name NAME      the model id of /v1/models and OpenAI answers (default: the\n"
    "                                model path)\n"
    "  --api-key KEY                 require 'Authorization: Bearer KEY' on every endpoint but\n"
    "                                /health\n"
    "  --enable-metrics              serve Prometheus metrics at GET /metrics\n"
    "  --disable-radix-cache         do not share prompt-prefix KV pages between requests\n"
    "  --enable-deterministic-inference\n"
    "                                a request's tokens and logprobs do not depend on what else\n"
    "                                runs (batch, ranks, prefill chunks, prefix cache), and an\n"
    "                                unseeded sampled request draws with seed 42; the CPU\n"
    "                                always computes this way, --device cuda pins its GEMMs\n"
    "  --log-level LEVEL             debug, info, warn (or warning) or error (default info)\n"
    "  --threads N                   CPU threads of the engine (default: all cores; their waits\n"
    "                                sleep unless OMP_WAIT_POLICY=active is set)\n"
    "  --max-body-bytes N            largest request body; larger ones get 413 (default 16777216)\n"
    "  --max-queued-requests N       requests waiting to run at most; more get 503 with "
    "Retry-After\n"
    "                                (default 4096; 0: no limit)\n"
    "  --connection-timeout S        close a connection that sends and takes nothing for S\n"
    "                                seconds (default 60; one waiting for its answer is not idle)\n"
    "  --shutdown-timeout S          on SIGTERM or SIGINT, refuse new requests and finish the\n"
    "                                queued and running ones for up to S seconds, then abort the\n"
    "                                rest and exit 0 (default 30; 0: abort at once; a second\n"
    "                                signal aborts at once)\n"
    "\n"
    "Several ranks (mpirun -np N moeserve serve ...): rank r serves on port PORT + r and runs\n"
    "attention for its own requests; every MoE layer's experts are split over the ranks.\n"
    "  --moe-a2a-backend NAME        all-to-all: none (one rank), shm (ranks on one node), mpi\n"
    "                                (one-sided MPI), nvlink_one_sided or nccl (CUDA builds);\n"
    "                                default: none for one rank, shm on one node, else mpi.\n"
    "                                flashinfer_nvlink_one_sided = nvlink_one_sided\n"
    "  --moe-a2a-combine FORM        how expert outputs come home: slots (every slot's output\n"
    "                                in fp32, summed at home in slot order: any rank count gives\n"
    "                                one process's bits) or partial (each owner rank's weighted\n"
    "                                sum in BF16, a vector per token and rank: fewer link bytes,\n"
    "                                results within BF16's rounding); default auto: partial on\n"
    "                                GPUs, slots on CPUs and with\n"
    "                                --enable-deterministic-inference\n"
    "  --load-balance                place each generation request on the least-loaded rank,\n"
    "                                whichever rank it reached (default)\n"
    "  --no-load-balance             each rank runs the requests that reach it\n"
    "  --tp N, --dp N, --ep N        SGLang's sizes (also --tp-size, --dp-size, --ep-size): each\n"
    "                                must equal the number of ranks when given\n"
    "  --enable-dp-attention         accepted: attention is always data-parallel over the ranks\n"
    "  --dist-timeout S              seconds a rank waits for the others before it gives up\n"
    "                                (default 60; a peer on the same node that dies is noticed\n"
    "                                at once)\n"
    "\n"
    "Logs \"serving on http://HOST:PORT\" when ready; SIGINT or SIGTERM shut it down cleanly. "
    "Under\n"
    "mpirun, signal a rank (every rank drains with it) or use scripts/launch.sh: mpirun itself\n"
    "answers SIGTERM by killing its ranks a second later.\n"
    "Endpoints: POST /generate, /v1/completions, /v1/chat/completions, /tokenize, /detokenize,\n"
    "/abort_request, /update_weights_from_disk; GET /v1/models, /health, /health_generate,\n"
    "/get_model_info, /model_info, /get_server_info, /server_info, /metrics;\n"
    "GET|POST /flush_cache.\n";

static const char usage_tokenize[] =
    "usage: moeserve tokenize --model-path DIR [--add-special-tokens]\n"
    "  reads UTF-8 text on stdin and prints its ids as a JSON array\n"
    "usage: moeserve detokenize --model-path DIR [--skip-special-tokens]\n"
    "  reads a JSON array of ids on stdin and prints the text\n";

static void die(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
static void die(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    if (log_rank >= 0)
        fprintf(stderr, "moeserve (rank %d): ", log_rank);
    else
        fputs("moeserve: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    exit(1);
}

static long parse_long(const char *flag, const char *s, long lo, long hi) {
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi)
        die("%s: '%s' is not an integer in [%ld, %ld]", flag, s, lo, hi);
    return v;
}

static float parse_float(const char *flag, const char *s) {
    char *end;
    errno = 0;
    float v = strtof(s, &end);
    if (errno || end == s || *end || !isfinite(v)) die("%s: '%s' is not a number", flag, s);
    return v;
}

/* "1,2,3" -> ids; each in [0, INT32_MAX]. */
static int32_t *parse_ids(const char *flag, const char *s, int *n) {
    int cap = 16;
    int32_t *ids = xmalloc(cap * sizeof(int32_t));
    *n = 0;
    const char *p = s;
    while (*p) {
        char *end;
        errno = 0;
        long v = strtol(p, &end, 10);
        if (errno || end == p || v < 0 || v > INT32_MAX || (*end && *end != ','))
            die("%s: '%s' is not a comma-separated list of token ids", flag, s);
        if (*n == cap) ids = xrealloc(ids, (cap *= 2) * sizeof(int32_t));
        ids[(*n)++] = (int32_t)v;
        p = *end ? end + 1 : end;
        if (*end && !*p) die("%s: '%s' ends with a comma", flag, s);
    }
    return ids;
}

static char *read_stdin(size_t *len) {
    size_t cap = 1 << 16, n = 0;
    char *buf = xmalloc(cap);
    size_t got;
    while ((got = fread(buf + n, 1, cap - n - 1, stdin)) > 0) {
        n += got;
        if (cap - n - 1 == 0) buf = xrealloc(buf, cap *= 2);
    }
    buf[n] = '\0';
    *len = n;
    return buf;
}

static tokenizer *load_tokenizer(const char *dir, bool required) {
    char path[4096], err[1024];
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    FILE *f = fopen(path, "rb");
    if (!f && !required) return NULL;
    if (f) fclose(f);
    tokenizer *tok = tokenizer_load(path, err, sizeof err);
    if (!tok) die("%s", err);
    return tok;
}

/* serve's tokenizer: required unless --skip-tokenizer-init. A folder without one (a config.json
 * alone, as config/models/ holds for --load-format dummy) stops start-up with the hint. */
static tokenizer *serve_load_tokenizer(const char *dir) {
    char path[4096];
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    if (access(path, F_OK) != 0)
        die("%s: no such file; serve needs the model's tokenizer to take text. Start with "
            "--skip-tokenizer-init to serve token ids only (input_ids in, output_ids out), as "
            "with --load-format dummy on a folder that holds only config.json",
            path);
    return load_tokenizer(dir, true);
}

/* Stop strings: the decoded output is kept up to date token by token and searched near its end. */
typedef struct {
    const tokenizer *tok;
    detok_stream ds;
    char *text;
    size_t len, cap;
    const char *stops[MAX_STOP_STRINGS];
    int n_stops;
    const char *matched;
} stop_watch;

static bool stop_watch_on_token(void *ctx, int32_t token) {
    stop_watch *w = ctx;
    size_t before = w->len;
    size_t added = detok_stream_push(&w->ds, token, &w->text, &w->len, &w->cap);
    if (added == 0) return false;
    for (int i = 0; i < w->n_stops; i++) {
        size_t sl = strlen(w->stops[i]);
        size_t from = before >= sl ? before - sl + 1 : 0; /* a match must end in the new bytes */
        if (sl && memmem(w->text + from, w->len - from, w->stops[i], sl)) {
            w->matched = w->stops[i];
            return true;
        }
    }
    return false;
}

/* --enable-deterministic-inference promises a request the same bits whatever else runs. The CPU
 * backend computes that way in every mode (each op's reduction order depends on its row, its
 * position and the shapes alone: kernels/cpu/linear.c, attention.c, moe.c; the sampler draws
 * from (seed, position)). The CUDA backend's experts, attention, norms and sampler do too; its
 * linear is put into its deterministic mode (ops_cuda_set_deterministic: one GEMM way and one
 * pinned cuBLASLt algorithm per weight for every token count). Besides that the flag changes the
 * default seed and what /server_info says. */
static void apply_deterministic(bool on) { ops_cuda_set_deterministic(on); }

/* --kv-cache-dtype: kv_cache_dtype_parse's value (auto is resolved once the device is known). */
static int parse_kv_cache_dtype(const char *v) {
    const int d = kv_cache_dtype_parse(v);
    if (d < 0) die("--kv-cache-dtype: '%s' is not one of auto, float32, bfloat16", v);
    return d;
}

static int cmd_generate(int argc, char **argv) {
    const char *model_path = NULL, *prompt = NULL, *input_ids = NULL, *stop_ids_arg = NULL;
    gen_request q = {
        .sampling = sampling_params_default(), .max_new_tokens = 128, .logprob_start_len = -1};
    bool skip_special = true, deterministic = false;
    int threads = 0, graph_bs = 0, kv_dtype = KV_DTYPE_AUTO;
    const char *device = "cpu", *load_format = "auto", *precision = "high", *quantization = NULL;
    stop_watch sw = {0};
    log_threshold = LOG_LEVEL_WARN;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            fputs(usage_generate, stdout);
            return 0;
        }
        /* flags without a value */
        if (!strcmp(a, "--return-logprob")) {
            q.return_logprob = true;
            continue;
        }
        if (!strcmp(a, "--ignore-eos")) {
            q.ignore_eos = true;
            continue;
        }
        if (!strcmp(a, "--no-skip-special-tokens")) {
            skip_special = false;
            continue;
        }
        if (!strcmp(a, "--enable-deterministic-inference")) {
            deterministic = true;
            continue;
        }
        if (i + 1 >= argc) die("generate: %s needs a value (see moeserve generate --help)", a);
        const char *v = argv[++i];
        if (!strcmp(a, "--model-path"))
            model_path = v;
        else if (!strcmp(a, "--prompt"))
            prompt = v;
        else if (!strcmp(a, "--input-ids"))
            input_ids = v;
        else if (!strcmp(a, "--max-new-tokens"))
            q.max_new_tokens = (int)parse_long(a, v, 0, INT_MAX / 2);
        else if (!strcmp(a, "--min-new-tokens"))
            q.min_new_tokens = (int)parse_long(a, v, 0, INT_MAX / 2);
        else if (!strcmp(a, "--temperature"))
            q.sampling.temperature = parse_float(a, v);
        else if (!strcmp(a, "--top-p"))
            q.sampling.top_p = parse_float(a, v);
        else if (!strcmp(a, "--top-k"))
            q.sampling.top_k = (int)parse_long(a, v, INT_MIN, INT_MAX);
        else if (!strcmp(a, "--min-p"))
            q.sampling.min_p = parse_float(a, v);
        else if (!strcmp(a, "--repetition-penalty"))
            q.sampling.repetition_penalty = parse_float(a, v);
        else if (!strcmp(a, "--frequency-penalty"))
            q.sampling.frequency_penalty = parse_float(a, v);
        else if (!strcmp(a, "--presence-penalty"))
            q.sampling.presence_penalty = parse_float(a, v);
        else if (!strcmp(a, "--seed"))
            q.sampling.seed = (uint64_t)parse_long(a, v, 0, LONG_MAX);
        else if (!strcmp(a, "--logprob-start-len"))
            q.logprob_start_len = (int)parse_long(a, v, -1, INT_MAX);
        else if (!strcmp(a, "--stop-token-ids"))
            stop_ids_arg = v;
        else if (!strcmp(a, "--threads"))
            threads = (int)parse_long(a, v, 1, 4096);
        else if (!strcmp(a, "--device"))
            device = v;
        else if (!strcmp(a, "--load-format"))
            load_format = v;
        else if (!strcmp(a, "--quantization"))
            quantization = v;
        else if (!strcmp(a, "--matmul-precision"))
            precision = v;
        else if (!strcmp(a, "--cuda-graph-max-bs"))
            graph_bs = (int)parse_long(a, v, 0, 4096);
        else if (!strcmp(a, "--kv-cache-dtype"))
            kv_dtype = parse_kv_cache_dtype(v);
        else if (!strcmp(a, "--stop")) {
            if (sw.n_stops == MAX_STOP_STRINGS)
                die("--stop: at most %d stop strings", MAX_STOP_STRINGS);
            if (!*v) die("--stop: a stop string cannot be empty");
            sw.stops[sw.n_stops++] = v;
        } else if (!strcmp(a, "--log-level")) {
            static const char *const names[] = {"debug", "info", "warn", "error"};
            int lv = -1;
            for (int k = 0; k < 4; k++)
                if (!strcmp(v, names[k])) lv = k;
            if (lv < 0) die("--log-level: '%s' is not one of debug, info, warn, error", v);
            log_threshold = (log_level)lv;
        } else
            die("generate: unknown flag '%s' (see moeserve generate --help)", a);
    }
    if (!model_path) die("generate: --model-path is required");
    if (!!prompt == !!input_ids) die("generate: give exactly one of --prompt and --input-ids");
    apply_deterministic(deterministic);
    const char *bad = sampling_params_check(&q.sampling);
    if (bad) die("generate: %s", bad);
    if (threads) omp_set_num_threads(threads);

    char err[2048];
    const ops *backend = ops_cpu();
    if (ops_cuda_set_matmul_precision(precision, err, sizeof err))
        die("--matmul-precision: %s", err);
    if (!strcmp(device, "cuda")) {
        backend = ops_cuda(0, err, sizeof err);
        if (!backend) die("--device cuda: %s", err);
    } else if (strcmp(device, "cpu")) {
        die("--device: '%s' is not one of cpu, cuda", device);
    }
    if (strcmp(load_format, "auto") && strcmp(load_format, "safetensors") &&
        strcmp(load_format, "dummy"))
        die("--load-format: '%s' is not one of auto, safetensors, dummy", load_format);
    model_load_opts lo = {.ep_rank = 0,
                          .ep_size = 1,
                          .dummy = !strcmp(load_format, "dummy"),
                          .quantization = quantization};
    model *m = model_load_with(model_path, backend, &lo, err, sizeof err);
    if (!m) die("%s", err);
    tokenizer *tok = load_tokenizer(model_path, prompt != NULL || sw.n_stops > 0);
    int32_t *ids;
    int n_ids;
    if (prompt) {
        if (tokenizer_encode(tok, prompt, strlen(prompt), true, &ids, &n_ids))
            die("--prompt: the text is not valid UTF-8");
    } else {
        ids = parse_ids("--input-ids", input_ids, &n_ids);
    }
    if (n_ids == 0) die("generate: the prompt is empty");
    for (int i = 0; i < n_ids; i++)
        if (ids[i] >= m->cfg.vocab_size)
            die("--input-ids: id %d at position %d is outside the vocabulary [0, %d) of "
                "%s/config.json",
                ids[i], i, m->cfg.vocab_size, model_path);
    int32_t *stop_ids = NULL;
    if (stop_ids_arg) stop_ids = parse_ids("--stop-token-ids", stop_ids_arg, &q.n_stop_token_ids);
    q.stop_token_ids = stop_ids;
    if (q.logprob_start_len >= n_ids)
        die("--logprob-start-len: %d must be below the prompt length %d", q.logprob_start_len,
            n_ids);
    q.prompt = ids;
    q.n_prompt = n_ids;
    if (sw.n_stops) {
        sw.tok = tok;
        detok_stream_init(&sw.ds, tok, skip_special);
        q.on_token = stop_watch_on_token;
        q.ctx = &sw;
    }

    const int page_size = 16;
    int n_pages = (n_ids + q.max_new_tokens + page_size) / page_size + 1;
    engine e;
    const int kv_bf16 = kv_cache_dtype_bf16(kv_dtype, !strcmp(device, "cuda"));
    if (engine_init(&e, m, n_pages, page_size, 512, kv_bf16, err, sizeof err)) die("%s", err);
    e.deterministic = deterministic;
    if (graph_bs > 0 && !backend->graph_begin)
        LOG_WARN("generate", "--cuda-graph-max-bs: the %s backend has no graphs; steps run eagerly",
                 backend->name);
    else if (graph_bs > 0 && engine_enable_graphs(&e, graph_bs, n_pages, err, sizeof err))
        die("--cuda-graph-max-bs: %s", err);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    gen_result res;
    if (engine_generate(&e, &q, &res, 1, err, sizeof err)) die("generate: %s", err);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double secs = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);

    generate_answer ans = {.id = "generate-0",
                           .req = &q,
                           .res = &res,
                           .tok = tok,
                           .skip_special_tokens = skip_special,
                           .matched_stop = sw.matched,
                           .e2e_latency = secs};
    cJSON *json = generate_json_answer(&ans);
    char *out = cJSON_PrintUnformatted(json);
    puts(out);
    free(out);
    cJSON_Delete(json);
    LOG_INFO("generate", "%d prompt + %d new tokens in %.3f s", n_ids, res.n_output, secs);

    gen_result_free(&res);
    engine_free(&e);
    free(sw.text);
    free(stop_ids);
    free(ids);
    tokenizer_free(tok);
    model_free(m);
    return 0;
}

static int cmd_tokenize(int argc, char **argv, bool reverse) {
    const char *model_path = NULL;
    bool flag = false; /* --add-special-tokens / --skip-special-tokens */
    for (int i = 0; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            fputs(usage_tokenize, stdout);
            return 0;
        } else if (!strcmp(argv[i], "--model-path") && i + 1 < argc) {
            model_path = argv[++i];
        } else if (!strcmp(argv[i], reverse ? "--skip-special-tokens" : "--add-special-tokens")) {
            flag = true;
        } else {
            die("%s: unknown flag '%s'", reverse ? "detokenize" : "tokenize", argv[i]);
        }
    }
    if (!model_path) die("%s: --model-path is required", reverse ? "detokenize" : "tokenize");
    tokenizer *tok = load_tokenizer(model_path, true);
    size_t len;
    char *in = read_stdin(&len);
    if (!reverse) {
        int32_t *ids;
        int n;
        if (tokenizer_encode(tok, in, len, flag, &ids, &n))
            die("tokenize: stdin is not valid UTF-8");
        cJSON *arr = cJSON_CreateIntArray((const int *)ids, n);
        char *s = cJSON_PrintUnformatted(arr);
        puts(s);
        free(s);
        cJSON_Delete(arr);
        free(ids);
    } else {
        cJSON *arr = cJSON_Parse(in);
        if (!cJSON_IsArray(arr)) die("detokenize: stdin must be a JSON array of token ids");
        int n = cJSON_GetArraySize(arr), V = tokenizer_vocab_size(tok);
        int32_t *ids = xmalloc((n ? n : 1) * sizeof(int32_t));
        for (int i = 0; i < n; i++) {
            cJSON *it = cJSON_GetArrayItem(arr, i);
            if (!cJSON_IsNumber(it) || it->valuedouble != (int)it->valuedouble ||
                it->valueint < 0 || it->valueint >= V)
                die("detokenize: item %d is not a token id in [0, %d)", i, V);
            ids[i] = it->valueint;
        }
        size_t out_len;
        char *text = tokenizer_decode(tok, ids, n, flag, &out_len);
        fwrite(text, 1, out_len, stdout);
        free(text);
        free(ids);
        cJSON_Delete(arr);
    }
    free(in);
    tokenizer_free(tok);
    return 0;
}

/* ---- serve ---- */

typedef struct {
    scheduler *sched;
    rank_group *group;
    atomic_bool stop;   /* set by main: stop (the group stops with this rank) */
    atomic_bool failed; /* the rank group failed; err says why */
    atomic_bool ended;  /* the engine loop has returned */
    atomic_int peer_drain; /* the rank whose drain this one joins (-1: none) */
    int threads;
    const ops *backend;
    char err[1024];
} serve_engine;

/* The engine thread: owns the model and the KV cache through the scheduler, and, in a rank
 * group, every MPI call while it runs. When the loop ends for a reason of its own (the group
 * failed, another rank stopped) the main thread sees ended (serve_wait). */
static void *serve_engine_main(void *p) {
    serve_engine *e = p;
    if (e->threads) omp_set_num_threads(e->threads);
    if (e->backend->bind_thread) e->backend->bind_thread(); /* the ops run on this thread */
    int rc = scheduler_run(e->sched, e->group, &e->stop, e->err, sizeof e->err);
    if (rc != 0) {
        LOG_ERROR("serve", "%s", e->err);
        atomic_store(&e->failed, true);
    }
    atomic_store(&e->ended, true);
    sampler_scratch_free();
    return NULL;
}

/* Engine thread: another rank is draining; the main thread drains this one as if signalled
 * (a flag, not a signal to itself: that would read as a second signal, which aborts). */
static void serve_on_peer_drain(void *ctx, int rank) {
    serve_engine *e = ctx;
    atomic_store(&e->peer_drain, rank);
}

/* Main thread, once serving: wait for SIGINT or SIGTERM (returned), for the engine loop to end
 * by itself, or for another rank to start draining (0 for those two). */
static int serve_wait(serve_engine *e, const sigset_t *sigs) {
    for (;;) {
        struct timespec ts = {0, 100 * 1000 * 1000};
        int sig = sigtimedwait(sigs, NULL, &ts);
        if (sig == SIGINT || sig == SIGTERM) return sig;
        if (atomic_load(&e->ended) || atomic_load(&e->peer_drain) >= 0) return 0;
    }
}

static double serve_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* The graceful part of a shutdown (new requests are refused already): the engine finishes what
 * is queued and running, every rank of a group together, and its loop then ends by itself.
 * Returns when it has, after timeout_s, or at a second SIGINT / SIGTERM (signalled: the drain
 * began with one; else, when it began with another rank's, the first signal is not the second);
 * the caller then stops the loop, which aborts whatever is left. */
static void serve_drain(serve_engine *e, const sigset_t *sigs, double timeout_s, bool signalled) {
    scheduler_stats st;
    scheduler_get_stats(e->sched, &st);
    LOG_INFO("serve",
             "draining: %d running, %d waiting; new requests get 503 (up to %g s, "
             "--shutdown-timeout; a second signal stops at once)",
             st.n_running, st.n_waiting, timeout_s);
    scheduler_drain(e->sched);
    const double t0 = serve_now();
    while (!atomic_load(&e->ended)) {
        if (serve_now() - t0 >= timeout_s) {
            scheduler_get_stats(e->sched, &st);
            LOG_WARN("serve", "--shutdown-timeout %g s passed: aborting %d running, %d waiting",
                     timeout_s, st.n_running, st.n_waiting);
            return;
        }
        struct timespec ts = {0, 50 * 1000 * 1000};
        int sig = sigtimedwait(sigs, NULL, &ts);
        if ((sig == SIGINT || sig == SIGTERM) && !atomic_load(&e->ended)) {
            if (!signalled) {
                LOG_INFO("serve", "%s: draining already", sig == SIGINT ? "SIGINT" : "SIGTERM");
                signalled = true;
                continue;
            }
            LOG_WARN("serve", "%s again: aborting what is left", sig == SIGINT ? "SIGINT" : "SIGTERM");
            return;
        }
    }
    LOG_INFO("serve", "drained in %.1f s", serve_now() - t0);
}

/* --moe-a2a-backend, or the machine's choice: none for one rank; on the GPU nvlink_one_sided;
 * on the CPU shm when every rank is on this node, else mpi. */
static a2a_transport serve_transport(const char *name, const rank_group *g, bool cuda) {
    a2a_transport t;
    if (!name) {
        if (rank_group_size(g) == 1) return A2A_NONE;
        if (cuda) return A2A_NVLINK_ONE_SIDED;
        return rank_group_same_node(g) ? A2A_SHM : A2A_MPI;
    }
    if (!strcmp(name, "flashinfer")) {
        LOG_WARN("serve", "--moe-a2a-backend flashinfer is deprecated: it means "
                          "flashinfer_nvlink_one_sided, i.e. nvlink_one_sided");
        name = "nvlink_one_sided";
    }
    if (!a2a_transport_parse(name, &t))
        die("--moe-a2a-backend: '%s' is not one of none, shm, mpi, nvlink_one_sided "
            "(flashinfer_nvlink_one_sided), nccl",
            name);
#ifdef MOESERVE_CUDA
    if ((t == A2A_NVLINK_ONE_SIDED || t == A2A_NCCL) && !cuda)
        die("--moe-a2a-backend %s: moves GPU memory and needs --device cuda; on the CPU use shm "
            "(ranks on one node) or mpi",
            a2a_transport_name(t));
    if ((t == A2A_SHM || t == A2A_MPI) && cuda)
        die("--moe-a2a-backend %s: moves host memory; with --device cuda use nvlink_one_sided or "
            "nccl",
            a2a_transport_name(t));
#else
    if (t == A2A_NVLINK_ONE_SIDED || t == A2A_NCCL)
        die("--moe-a2a-backend %s: moves GPU memory and needs --device cuda, which this build "
            "does not have; on the CPU use shm (ranks on one node) or mpi",
            a2a_transport_name(t));
#endif
    if (t == A2A_NONE && rank_group_size(g) > 1)
        die("--moe-a2a-backend none: serves one rank, this group has %d (use %s)",
            rank_group_size(g), cuda ? "nvlink_one_sided or nccl" : "shm or mpi");
    if (t == A2A_SHM && !rank_group_same_node(g))
        die("--moe-a2a-backend shm: the ranks are on more than one node (use mpi)");
    return t;
}

/* --moe-a2a-combine: "slots" or "partial". auto takes partial where the outputs cross a GPU link
 * (nvlink_one_sided, nccl: K fp32 slots a token against one BF16 vector per rank), slots on the
 * CPU transports (shared or MPI memory; every rank count then gives one process's bits) and in
 * the deterministic mode, which refuses partial: its sums depend on the expert split. */
static const char *serve_combine(const char *name, a2a_transport t, bool deterministic) {
    if (!name || !strcmp(name, "auto"))
        return !deterministic && (t == A2A_NVLINK_ONE_SIDED || t == A2A_NCCL) ? "partial" : "slots";
    if (strcmp(name, "slots") && strcmp(name, "partial"))
        die("--moe-a2a-combine: '%s' is not one of auto, slots, partial", name);
    if (t == A2A_NONE) return "slots"; /* one rank: nothing comes home */
    if (deterministic && !strcmp(name, "partial"))
        die("--moe-a2a-combine partial: its sums depend on how the experts are split over the "
            "ranks, which --enable-deterministic-inference forbids (use slots)");
    return name;
}

/* Wait for the engine thread at most timeout_s; false when it did not end. */
static bool serve_join(pthread_t th, double timeout_s) {
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += (time_t)timeout_s;
    return pthread_timedjoin_np(th, NULL, &until) == 0;
}

static long long serve_phys_bytes(void) {
    long pages = sysconf(_SC_PHYS_PAGES), size = sysconf(_SC_PAGE_SIZE);
    return pages > 0 && size > 0 ? (long long)pages * size : 8LL << 30;
}

/* SGLang's --mem-fraction-static: weights + KV pool take this share of the device's memory; what
 * the weights left of it goes to the pool (the rest stays for activations and workspaces). */
static int serve_kv_tokens(const server_args *a, const ops *o, long long kv_bytes_per_token) {
    double frac = a->mem_fraction_static > 0 ? a->mem_fraction_static : 0.85;
    size_t free_b = 0, total_b = 0;
    o->sync();
    o->mem_info(&free_b, &total_b);
    double used = (double)total_b - (double)free_b;
    double pool = (double)total_b * frac - used;
    long long tokens = pool > 0 ? (long long)(pool / (double)kv_bytes_per_token) : 0;
    tokens -= tokens % a->page_size;
    if (tokens < (long long)a->context_length + a->page_size)
        die("--mem-fraction-static %g: %.1f GiB of the %s's %.1f GiB, %.1f GiB already in use "
            "(the weights and everything else), leaves room for %lld KV tokens, fewer than one full context (%d): raise "
            "it, or lower --context-length",
            frac, (double)total_b * frac / (1 << 30), o->name, (double)total_b / (1 << 30),
            used / (1 << 30), tokens, a->context_length);
    if (tokens > INT_MAX / 2) tokens = INT_MAX / 2;
    LOG_INFO("serve", "KV pool: %lld tokens (%.1f GiB) in %.2f of the %s's %.1f GiB", tokens,
             (double)tokens * (double)kv_bytes_per_token / (1 << 30), frac, o->name,
             (double)total_b / (1 << 30));
    return (int)tokens;
}

static int cmd_serve(int argc, char **argv) {
    server_args a = {.host = "127.0.0.1",
                     .port = 30000,
                     .device = "cpu",
                     .page_size = 16,
                     .log_level = "info",
                     .max_body_bytes = 16u << 20,
                     .max_queued_requests = 4096,
                     .shutdown_timeout = 30,
                     .connection_timeout = 60,
                     .load_balance = true,
                     .load_format = "auto",
                     .cuda_graph_max_bs = -1}; /* by device, below */
    char err0[256];
    int kv_dtype = KV_DTYPE_AUTO;
    log_threshold = LOG_LEVEL_INFO;
    for (int i = 0; i < argc; i++) {
        const char *f = argv[i];
        if (!strcmp(f, "--help") || !strcmp(f, "-h")) {
            fputs(usage_serve, stdout);
            return 0;
        }
        if (!strcmp(f, "--enable-metrics")) {
            a.enable_metrics = true;
            continue;
        }
        if (!strcmp(f, "--disable-radix-cache")) {
            a.disable_radix_cache = true;
            continue;
        }
        if (!strcmp(f, "--load-balance") || !strcmp(f, "--no-load-balance")) {
            a.load_balance = !strcmp(f, "--load-balance");
            continue;
        }
        if (!strcmp(f, "--disable-cuda-graph")) {
            a.cuda_graph_max_bs = 0;
            continue;
        }
        if (!strcmp(f, "--enable-dp-attention")) {
            a.enable_dp_attention = true;
            continue;
        }
        if (!strcmp(f, "--skip-tokenizer-init")) {
            a.skip_tokenizer_init = true;
            continue;
        }
        if (!strcmp(f, "--enable-deterministic-inference")) {
            a.enable_deterministic_inference = true;
            continue;
        }
        static const char *const with_value[] = {"--model-path",
                                                 "--host",
                                                 "--port",
                                                 "--device",
                                                 "--matmul-precision",
                                                 "--mem-fraction-static",
                                                 "--cuda-graph-max-bs",
                                                 "--max-running-requests",
                                                 "--max-total-tokens",
                                                 "--chunked-prefill-size",
                                                 "--context-length",
                                                 "--page-size",
                                                 "--kv-cache-dtype",
                                                 "--served-model-name",
                                                 "--api-key",
                                                 "--threads",
                                                 "--max-body-bytes",
                                                 "--max-queued-requests",
                                                 "--connection-timeout",
                                                 "--shutdown-timeout",
                                                 "--log-level",
                                                 "--moe-a2a-backend",
                                                 "--moe-a2a-combine",
                                                 "--tp",
                                                 "--tp-size",
                                                 "--dp",
                                                 "--dp-size",
                                                 "--ep",
                                                 "--ep-size",
                                                 "--dist-timeout",
                                                 "--load-format",
                                                 "--quantization"};
        bool known = false;
        for (size_t k = 0; k < sizeof with_value / sizeof with_value[0]; k++)
            known = known || !strcmp(f, with_value[k]);
        if (!known) die("serve: unknown flag '%s' (see moeserve serve --help)", f);
        if (i + 1 >= argc) die("serve: %s needs a value (see moeserve serve --help)", f);
        const char *v = argv[++i];
        if (!strcmp(f, "--model-path"))
            a.model_path = v;
        else if (!strcmp(f, "--host"))
            a.host = v;
        else if (!strcmp(f, "--port"))
            a.port = (int)parse_long(f, v, 0, 65535);
        else if (!strcmp(f, "--device"))
            a.device = v;
        else if (!strcmp(f, "--cuda-graph-max-bs"))
            a.cuda_graph_max_bs = (int)parse_long(f, v, 0, 4096);
        else if (!strcmp(f, "--mem-fraction-static")) {
            float x = parse_float(f, v);
            if (!(x > 0 && x < 1)) die("--mem-fraction-static: %g is outside (0, 1)", x);
            a.mem_fraction_static = x;
        } else if (!strcmp(f, "--matmul-precision")) {
            if (ops_cuda_set_matmul_precision(v, err0, sizeof err0))
                die("--matmul-precision: %s", err0);
        }
        else if (!strcmp(f, "--max-running-requests"))
            a.max_running_requests = (int)parse_long(f, v, 1, 1 << 16);
        else if (!strcmp(f, "--max-total-tokens"))
            a.max_total_tokens = (int)parse_long(f, v, 1, INT_MAX / 2);
        else if (!strcmp(f, "--chunked-prefill-size"))
            a.chunked_prefill_size = (int)parse_long(f, v, 1, 1 << 20);
        else if (!strcmp(f, "--context-length"))
            a.context_length = (int)parse_long(f, v, 2, INT_MAX / 2);
        else if (!strcmp(f, "--page-size"))
            a.page_size = (int)parse_long(f, v, 1, 4096);
        else if (!strcmp(f, "--kv-cache-dtype"))
            kv_dtype = parse_kv_cache_dtype(v);
        else if (!strcmp(f, "--served-model-name"))
            a.served_model_name = v;
        else if (!strcmp(f, "--api-key"))
            a.api_key = v;
        else if (!strcmp(f, "--threads"))
            a.threads = (int)parse_long(f, v, 1, 4096);
        else if (!strcmp(f, "--max-body-bytes"))
            a.max_body_bytes = (size_t)parse_long(f, v, 1024, 1L << 40);
        else if (!strcmp(f, "--max-queued-requests"))
            a.max_queued_requests = (int)parse_long(f, v, 0, 1L << 24);
        else if (!strcmp(f, "--connection-timeout"))
            a.connection_timeout = (double)parse_long(f, v, 1, 86400);
        else if (!strcmp(f, "--shutdown-timeout")) {
            float t = parse_float(f, v);
            if (!(t >= 0) || t > 86400) die("--shutdown-timeout: %g seconds is outside [0, 86400]", t);
            a.shutdown_timeout = t;
        }
        else if (!strcmp(f, "--moe-a2a-backend"))
            a.moe_a2a_backend = v;
        else if (!strcmp(f, "--moe-a2a-combine"))
            a.moe_a2a_combine = v;
        else if (!strcmp(f, "--load-format"))
            a.load_format = v;
        else if (!strcmp(f, "--quantization"))
            a.quantization = v;
        else if (!strcmp(f, "--tp") || !strcmp(f, "--tp-size"))
            a.tp = (int)parse_long(f, v, 1, A2A_MAX_RANKS);
        else if (!strcmp(f, "--dp") || !strcmp(f, "--dp-size"))
            a.dp = (int)parse_long(f, v, 1, A2A_MAX_RANKS);
        else if (!strcmp(f, "--ep") || !strcmp(f, "--ep-size"))
            a.ep = (int)parse_long(f, v, 1, A2A_MAX_RANKS);
        else if (!strcmp(f, "--dist-timeout")) {
            float t = parse_float(f, v);
            if (!(t > 0) || t > 1e6) die("--dist-timeout: %g seconds is outside (0, 1e6]", t);
            a.dist_timeout = t;
        }
        else if (!strcmp(f, "--log-level")) {
            static const char *const names[] = {"debug", "info", "warn", "error"};
            int lv = -1;
            for (int k = 0; k < 4; k++)
                if (!strcmp(v, names[k])) lv = k;
            if (!strcmp(v, "warning")) lv = LOG_LEVEL_WARN;
            if (lv < 0) die("--log-level: '%s' is not one of debug, info, warn, error", v);
            log_threshold = (log_level)lv;
            a.log_level = names[lv];
        } else
            die("serve: unknown flag '%s' (see moeserve serve --help)", f);
    }
    if (!a.model_path) die("serve: --model-path is required (see moeserve serve --help)");
    if (strcmp(a.device, "cpu") && strcmp(a.device, "cuda"))
        die("--device: '%s' is not one of cpu, cuda", a.device);
    a.kv_cache_bf16 = kv_cache_dtype_bf16(kv_dtype, !strcmp(a.device, "cuda"));
    apply_deterministic(a.enable_deterministic_inference);
    if (!*a.host) die("--host: the address is empty");
    if (strcmp(a.load_format, "auto") && strcmp(a.load_format, "safetensors") &&
        strcmp(a.load_format, "dummy"))
        die("--load-format: '%s' is not one of auto, safetensors, dummy", a.load_format);
    if (a.api_key && !*a.api_key) die("--api-key: the key is empty");
    if (a.served_model_name && !*a.served_model_name) die("--served-model-name: the name is empty");
    if (!a.served_model_name) a.served_model_name = a.model_path;
    struct stat st;
    if (stat(a.model_path, &st) || !S_ISDIR(st.st_mode))
        die("--model-path %s: not a folder", a.model_path);

    char err[2048];
    /* The rank group first: MPI starts before any thread does. MPI_Init starts threads of its
     * own (OpenMPI's runtime): they must block SIGINT and SIGTERM too, or a signal sent to the
     * process may land on one of them and kill it instead of reaching sigwait below; the main
     * thread takes them back until it is ready to wait for them. */
    sigset_t stop_sigs, old_sigs;
    sigemptyset(&stop_sigs);
    sigaddset(&stop_sigs, SIGINT);
    sigaddset(&stop_sigs, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &stop_sigs, &old_sigs);
    rank_group *group = rank_group_init(NULL, NULL, false, a.dist_timeout, err, sizeof err);
    pthread_sigmask(SIG_SETMASK, &old_sigs, NULL);
    if (!group) die("%s", err);
    const int rank = rank_group_rank(group), world = rank_group_size(group);
    if (world > 1) log_rank = rank;
    if (rank_group_check_parallel_flags(world, a.tp, a.dp, a.ep, a.enable_dp_attention, err,
                                        sizeof err))
        die("%s", err);
    a2a_transport transport = serve_transport(a.moe_a2a_backend, group, !strcmp(a.device, "cuda"));
    a.moe_a2a_backend = a2a_transport_name(transport);
    a.moe_a2a_combine =
        serve_combine(a.moe_a2a_combine, transport, a.enable_deterministic_inference);
    if (a.port && a.port + world - 1 > 65535)
        die("--port %d: ranks 0..%d need ports up to %d, above 65535", a.port, world - 1,
            a.port + world - 1);
    if (a.port) a.port += rank;
    if (!a.threads && rank_group_local_size(group) > 1) {
        /* ranks on one node share its cores */
        int cores = omp_get_num_procs(), per = cores / rank_group_local_size(group);
        a.threads = per > 0 ? per : 1;
    }

    /* Batch limits by device, as SGLang sizes them for a large GPU: the CPU decodes few requests
     * at a time and prefills in small steps; an H200 needs many of both to fill its bandwidth. */
    bool on_gpu = !strcmp(a.device, "cuda");
    if (!a.max_running_requests) a.max_running_requests = on_gpu ? 256 : 64;
    if (!a.chunked_prefill_size) a.chunked_prefill_size = on_gpu ? 8192 : 512;
    /* Decode graphs on a GPU unless told otherwise (SGLang's default too): batches of up to 256
     * requests, or --max-running-requests if fewer. The CPU has none. */
    const bool graphs_asked = a.cuda_graph_max_bs > 0;
    if (a.cuda_graph_max_bs < 0)
        a.cuda_graph_max_bs =
            on_gpu ? (a.max_running_requests < 256 ? a.max_running_requests : 256) : 0;
    if (on_gpu && world > 1 && a.cuda_graph_max_bs > 0 && transport != A2A_NVLINK_ONE_SIDED) {
        if (graphs_asked)
            LOG_WARN("serve",
                     "--cuda-graph-max-bs: decode steps run eagerly with the %s all-to-all (its "
                     "dispatch reads counts on the host: no graph can hold it); "
                     "nvlink_one_sided runs them as graphs",
                     a2a_transport_name(transport));
        else
            LOG_INFO("serve", "decode steps run eagerly with the %s all-to-all (no graphs)",
                     a2a_transport_name(transport));
        a.cuda_graph_max_bs = 0;
    }

    model_config cfg;
    if (model_config_load(&cfg, a.model_path, err, sizeof err)) die("%s", err);
    if (!a.context_length) a.context_length = cfg.max_position_embeddings;
    if (a.context_length > cfg.max_position_embeddings)
        die("--context-length %d: above the model's max_position_embeddings %d (%s/config.json)",
            a.context_length, cfg.max_position_embeddings, a.model_path);
    long long kv_bytes_per_token = 2LL * cfg.num_hidden_layers * cfg.num_key_value_heads *
                                   cfg.head_dim * (long long)kv_cache_elem_bytes(a.kv_cache_bf16);
    long long budget = serve_phys_bytes() / 4 / (kv_bytes_per_token > 0 ? kv_bytes_per_token : 1);
    /* On a GPU, or with --mem-fraction-static, the pool is sized after the weights are loaded. */
    bool size_after_load = !a.max_total_tokens && (a.mem_fraction_static > 0 ||
                                                   !strcmp(a.device, "cuda"));
    if (!a.max_total_tokens && !size_after_load) {
        long long want = 4LL * a.context_length > 65536 ? 4LL * a.context_length : 65536;
        if (want > budget) want = budget;
        if (want < a.context_length + a.page_size) {
            want = a.context_length + a.page_size;
            LOG_WARN("serve",
                     "the KV cache for one full context (%lld tokens) exceeds a quarter of "
                     "this machine's memory; consider --context-length",
                     want);
        }
        if (want > INT_MAX / 2) want = INT_MAX / 2;
        a.max_total_tokens = (int)want;
    }
    if (a.max_total_tokens && a.max_total_tokens < a.context_length)
        die("--max-total-tokens %d: below --context-length %d, so a full-length request could "
            "never fit; raise it or lower --context-length",
            a.max_total_tokens, a.context_length);

    tokenizer *tok = NULL;
    chat_template tpl = {.kind = CHAT_TEMPLATE_NONE};
    if (a.skip_tokenizer_init) {
        snprintf(tpl.why, sizeof tpl.why,
                 "the server was started with --skip-tokenizer-init (no tokenizer, no template)");
        LOG_INFO("serve", "--skip-tokenizer-init: no tokenizer; requests give token ids "
                          "(input_ids, or token-id prompts on /v1/completions)");
    } else {
        tok = serve_load_tokenizer(a.model_path);
        chat_template_load(&tpl, a.model_path);
        if (tpl.kind == CHAT_TEMPLATE_NONE)
            LOG_WARN("serve", "%s: /v1/chat/completions will answer 400", tpl.why);
    }
    metrics *met = a.enable_metrics ? metrics_create(a.served_model_name) : NULL;
    api_server *api = api_create(&a, tok, &tpl, met);

    /* every thread started from here on inherits the blocked signals */
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGINT);
    sigaddset(&sigs, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &sigs, NULL);
    signal(SIGPIPE, SIG_IGN);

    http_config hc = {.host = a.host,
                      .port = a.port,
                      .max_body_bytes = a.max_body_bytes,
                      .max_connections = 4096,
                      .timeout_s = (unsigned)a.connection_timeout,
                      .on_request = api_on_request,
                      .app = api};
    http_server *http = http_server_start(&hc, err, sizeof err);
    if (!http) die("%s", err);
    api_set_http(api, http);
    if (rank_group_share_endpoints(group, a.host, http_server_port(http), err, sizeof err))
        die("%s", err);
    if (world > 1) api_set_group(api, group);

    LOG_INFO("serve", "loading %s", a.model_path);
    if (a.threads) omp_set_num_threads(a.threads);
    const ops *backend = ops_cpu();
    if (!strcmp(a.device, "cuda")) {
        backend = ops_cuda(rank_group_local_rank(group), err, sizeof err);
        if (!backend) die("--device cuda: %s", err);
    }
    if (a.cuda_graph_max_bs > 0 && !backend->graph_begin)
        LOG_WARN("serve", "--cuda-graph-max-bs: the %s backend has no graphs; steps run eagerly",
                 backend->name);
    model_load_opts lo = {
        .ep_rank = rank,
        .ep_size = world,
        .dummy = !strcmp(a.load_format, "dummy"),
        .quantization = a.quantization};
    model *m = model_load_with(a.model_path, backend, &lo, err, sizeof err);
    if (!m) die("%s", err);
    if (size_after_load)
        a.max_total_tokens = serve_kv_tokens(&a, backend, kv_bytes_per_token);
    a2a *all_to_all = NULL;
    struct a2a_gpu *all_to_all_gpu = NULL;
    if (world > 1 && cfg.num_experts > 0) {
        a2a_config ac = {.transport = transport,
                         .ep_size = world,
                         .rank = rank,
                         .max_tokens_per_rank = a.max_running_requests + a.chunked_prefill_size,
                         .hidden = cfg.hidden_size,
                         .top_k = cfg.num_experts_per_tok,
                         .n_experts = cfg.num_experts,
                         .payload = (a2a_payload)m->expert_payload, /* fp8 / nvfp4 experts */
                         .timeout_s = rank_group_timeout(group),
                         .check_peers = rank_group_check_peers_cb,
                         .check_ctx = group};
        a2a_split_experts(cfg.num_experts, world, ac.expert_begin);
        if (transport == A2A_NVLINK_ONE_SIDED || transport == A2A_NCCL) {
#ifdef MOESERVE_CUDA
            all_to_all_gpu = a2a_gpu_create(&ac, rank_group_comm(group), err, sizeof err);
            if (!all_to_all_gpu) die("%s", err);
            m->a2a_gpu = all_to_all_gpu;
#endif
        } else {
            all_to_all = a2a_create(&ac, rank_group_comm(group), err, sizeof err);
            if (!all_to_all) die("%s", err);
            m->a2a = all_to_all;
        }
        m->a2a_partial = !strcmp(a.moe_a2a_combine, "partial");
    }
    if (world > 1)
        LOG_INFO("serve",
                 "rank %d of %d (%d on this node): experts [%d, %d) of %d, all-to-all %s "
                 "(%s tokens), %s combine, %d threads",
                 rank, world, rank_group_local_size(group), m->expert_begin, m->expert_end,
                 cfg.num_experts, a.moe_a2a_backend,
                 a2a_payload_name((a2a_payload)m->expert_payload), a.moe_a2a_combine,
                 a.threads ? a.threads : omp_get_max_threads());
    scheduler_config sc = {.max_running_requests = a.max_running_requests,
                           .max_total_tokens = a.max_total_tokens,
                           .page_size = a.page_size,
                           .chunked_prefill_size = a.chunked_prefill_size,
                           .kv_cache_bf16 = a.kv_cache_bf16,
                           .context_length = a.context_length,
                           .enable_radix_cache = !a.disable_radix_cache,
                           .deterministic = a.enable_deterministic_inference,
                           .cuda_graph_max_bs = a.cuda_graph_max_bs,
                           .load_opts = lo};
    serve_engine eng = {.group = group, .threads = a.threads, .backend = backend};
    atomic_init(&eng.stop, false);
    atomic_init(&eng.failed, false);
    atomic_init(&eng.ended, false);
    atomic_init(&eng.peer_drain, -1);
    sc.on_peer_drain = serve_on_peer_drain;
    sc.on_peer_drain_ctx = &eng;
    scheduler *sched = scheduler_create(m, &sc, err, sizeof err);
    if (!sched) die("%s", err);
    eng.sched = sched;
    pthread_t engine_thread;
    if (pthread_create(&engine_thread, NULL, serve_engine_main, &eng))
        die("serve: cannot start the engine thread");
    api_set_ready(api, sched, &m->cfg);
    bool v6 = strchr(a.host, ':') != NULL;
    LOG_INFO("serve", "model %s: context %d, KV cache %d tokens in pages of %d, up to %d running",
             a.served_model_name, a.context_length, a.max_total_tokens, a.page_size,
             a.max_running_requests);
    LOG_INFO("serve", "serving on http://%s%s%s:%d", v6 ? "[" : "", a.host, v6 ? "]" : "",
             http_server_port(http));

    int sig = serve_wait(&eng, &sigs);
    char gone[256];
    bool peers_gone = false;
    if (!atomic_load(&eng.ended)) {
        if (sig)
            LOG_INFO("serve", "%s: shutting down", sig == SIGINT ? "SIGINT" : "SIGTERM");
        else
            LOG_INFO("serve", "rank %d is draining: shutting down with it",
                     atomic_load(&eng.peer_drain));
        /* mpirun ends the job this way when a rank dies: say which */
        peers_gone = rank_group_check_peers(group, gone, sizeof gone) != 0;
        if (peers_gone) LOG_ERROR("serve", "%s: the rank group cannot go on", gone);
    }
    api_drain(api);
    if (!peers_gone && a.shutdown_timeout > 0 && !atomic_load(&eng.ended))
        serve_drain(&eng, &sigs, a.shutdown_timeout, sig != 0);
    atomic_store(&eng.stop, true);
    scheduler_wake(sched);
    /* A group that lost a rank fails its waits within a fraction of a second (same node) or
     * at --dist-timeout; the join waits a little longer than that. */
    if (!serve_join(engine_thread, rank_group_timeout(group) + 5.0)) {
        LOG_ERROR("serve", "the engine did not stop within %.0f s: leaving",
                  rank_group_timeout(group) + 5.0);
        _exit(1);
    }
    if (atomic_load(&eng.failed)) {
        /* Nothing collective after a failure; every request was answered with the error. */
        api_stop_relays(api);
        http_server_stop(http, 2.0);
        LOG_ERROR("serve", "stopped: %s", eng.err);
        _exit(1);
    }
    api_stop_relays(api);
    http_server_stop(http, 10.0);
    api_reap(api);
    api_free(api);
    scheduler_free(sched);
    a2a_destroy(all_to_all);
#ifdef MOESERVE_CUDA
    if (all_to_all_gpu) a2a_gpu_destroy(all_to_all_gpu);
#endif
    model_free(m);
    metrics_free(met);
    tokenizer_free(tok);
    rank_group_finalize(group);
    LOG_INFO("serve", "stopped");
    return 0;
}

/* OpenMP threads that spin at barriers starve whatever shares their cores: the HTTP threads, the
 * client, other ranks on the node. Measured on 2 cores under load, decode ran 6-100x slower with
 * spinning (libgomp's default) than with sleeping waits. libgomp reads OMP_WAIT_POLICY once, when
 * it is loaded, so the only way to change its default is to set it and start the program again;
 * an explicit OMP_WAIT_POLICY from the user is left alone. */
static void omp_default_passive(char **argv) {
    if (getenv("OMP_WAIT_POLICY")) return;
    setenv("OMP_WAIT_POLICY", "passive", 1);
    execv("/proc/self/exe", argv);
    /* exec failed (no /proc): go on with the runtime's default */
}

int main(int argc, char **argv) {
    omp_default_passive(argv);
    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") ||
        !strcmp(argv[1], "help")) {
        fputs(usage_main, argc < 2 ? stderr : stdout);
        return argc < 2 ? 1 : 0;
    }
    if (!strcmp(argv[1], "serve")) return cmd_serve(argc - 2, argv + 2);
    if (argv[1][0] == '-') return cmd_serve(argc - 1, argv + 1); /* serve is the default */
    if (!strcmp(argv[1], "generate")) return cmd_generate(argc - 2, argv + 2);
    if (!strcmp(argv[1], "tokenize")) return cmd_tokenize(argc - 2, argv + 2, false);
    if (!strcmp(argv[1], "detokenize")) return cmd_tokenize(argc - 2, argv + 2, true);
    die("unknown command '%s' (see moeserve --help)", argv[1]);
}
