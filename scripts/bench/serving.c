/* moeserve-bench serving: SGLang's bench_serving in C.
 *
 * The run, as bench_serving does it: prompts drawn (dataset.h); warm-up requests (the first
 * prompt, at most 32 output tokens) that must not all fail; an optional /flush_cache; one second
 * of rest; then every prompt sent as a streaming request with ignore_eos at Poisson arrivals of
 * --request-rate (inf: all at once), at most --max-concurrency at a time, spread over the --url
 * values; timings read from the stream (stream.h) and folded (stats.h) into the "Serving
 * Benchmark Result" block. The duration runs from the first request sent to the last one ended.
 *
 * Requests per backend (the bodies of bench_serving's request functions):
 *   sglang       POST /generate {"text" | "input_ids", "sampling_params": {"temperature": 0,
 *                "max_new_tokens", "ignore_eos": true}, "stream": true, "return_logprob": false,
 *                "logprob_start_len": -1, "lora_path": null}
 *   openai       POST /v1/completions {"model", "prompt" (text or ids), "best_of": 1,
 *                "max_tokens", "stream": true, "temperature": 0, "ignore_eos": true,
 *                "stream_options": {"include_usage": true}}
 *   openai-chat  POST /v1/chat/completions {"model", "messages": [{"role": "user", "content"}],
 *                "max_completion_tokens", "stream": true, "temperature": 0, "ignore_eos": true,
 *                "stream_options": {"include_usage": true}}
 * The usage chunk is asked for (bench_serving does not) so that the output tokens are the
 * server's count; the input tokens are the server's prompt_tokens too (see stream.h). */
#include <cjson/cJSON.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "scripts/bench/bench.h"
#include "scripts/bench/dataset.h"
#include "scripts/bench/http.h"
#include "scripts/bench/stats.h"
#include "scripts/bench/stream.h"
#include "scripts/bench/util.h"

#define SERVING_MAX_URLS 64

typedef enum { SERVING_DATA_RANDOM, SERVING_DATA_RANDOM_IDS, SERVING_DATA_JSONL } serving_dataset;

typedef struct {
    const char *urls[SERVING_MAX_URLS];
    int n_urls;
    const char *backend_name;
    bench_api api;
    serving_dataset dataset;
    const char *dataset_name;
    const char *dataset_path;
    int num_prompts, input_len, output_len, vocab_size;
    double range_ratio, request_rate;
    int max_concurrency, warmup_requests, flush_cache, ignore_eos, progress;
    long seed;
    const char *model, *api_key, *output_file, *extra_body;
    double timeout_s;
} serving_args;

static const char serving_usage[] =
    "usage: moeserve-bench serving [flags]\n"
    "\n"
    "SGLang's bench_serving against moeserve (or SGLang, or any server of the same API):\n"
    "streaming requests with ignore_eos, timings taken from the stream, the \"Serving Benchmark\n"
    "Result\" block on stdout. Exit status 0 when every request succeeded, 1 when one failed (the\n"
    "first error is printed), 2 for a usage error.\n"
    "\n"
    "  --url URL               a server, http://HOST:PORT; repeat it once per rank: each request\n"
    "                          goes to the URL with the fewest running (default\n"
    "                          http://127.0.0.1:30000; --base-url is the same flag; --host H\n"
    "                          --port P make one too)\n"
    "  --backend NAME          sglang (POST /generate), openai (POST /v1/completions) or\n"
    "                          openai-chat (POST /v1/chat/completions); bench_serving's names\n"
    "                          sglang-native, sglang-oai, sglang-oai-chat, vllm and vllm-chat are\n"
    "                          taken too (default sglang)\n"
    "  --dataset NAME          random (text of random words, or of --dataset-path's text, cut or\n"
    "                          repeated to the input length in words), random-ids (token ids of\n"
    "                          exact lengths; needs --vocab-size; not with openai-chat) or jsonl\n"
    "                          (rows of --dataset-path with \"prompt\", \"text\", \"question\" or\n"
    "                          \"conversations\", and an optional \"output_len\") (default "
    "random;\n"
    "                          --dataset-name is the same flag)\n"
    "  --dataset-path FILE     text or JSONL for random and jsonl\n"
    "  --num-prompts N         requests in the timed run (default 1000)\n"
    "  --random-input-len L    prompt length: tokens for random-ids, words for random (default\n"
    "                          1024)\n"
    "  --random-output-len L   output tokens per request (default 1024)\n"
    "  --random-range-ratio R  lengths drawn uniformly from [int(L*R), L], input at least 1\n"
    "                          (default 0.0)\n"
    "  --vocab-size V          token ids of random-ids are below V: the tokenizer's vocab_size\n"
    "                          (2048 for tests/data/tiny-qwen3-moe)\n"
    "  --request-rate R        requests per second, Poisson arrivals; inf sends all at once\n"
    "                          (default inf)\n"
    "  --max-concurrency C     at most C requests running at once (default no limit)\n"
    "  --seed S                seed of the lengths, prompts and arrivals (default 42)\n"
    "  --warmup-requests N     untimed requests (the first prompt, at most 32 output tokens)\n"
    "                          before the run (default 1)\n"
    "  --flush-cache           POST /flush_cache to every URL after the warm-up\n"
    "  --disable-ignore-eos    let requests stop at the end-of-sequence token\n"
    "  --extra-request-body JSON\n"
    "                          keys merged into every request body\n"
    "  --model NAME            the \"model\" of OpenAI requests (default: the first id of GET\n"
    "                          /v1/models)\n"
    "  --api-key KEY           sent as a Bearer token (default $OPENAI_API_KEY)\n"
    "  --timeout S             seconds one request may take (default 21600)\n"
    "  --output-file F         append one JSON line with the settings and results to F\n"
    "  --disable-progress      no progress bar (it is drawn on stderr only when that is a\n"
    "                          terminal; --disable-tqdm is the same flag)\n"
    "  --help                  this text\n"
    "\n"
    "Token counts are the server's: prompt_tokens and completion_tokens of meta_info (sglang) or\n"
    "of the usage chunk (openai, asked for with stream_options.include_usage).\n";

static void serving_parse(int argc, char **argv, serving_args *a) {
    *a = (serving_args){.backend_name = "sglang",
                        .api = BENCH_API_GENERATE,
                        .dataset = SERVING_DATA_RANDOM,
                        .dataset_name = "random",
                        .num_prompts = 1000,
                        .input_len = 1024,
                        .output_len = 1024,
                        .request_rate = INFINITY,
                        .warmup_requests = 1,
                        .ignore_eos = 1,
                        .progress = 1,
                        .seed = 42,
                        .timeout_s = 21600,
                        .api_key = getenv("OPENAI_API_KEY")};
    const char *host = NULL, *port = NULL;
    for (int i = 1; i < argc; i++) {
        const char *v;
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            fputs(serving_usage, stdout);
            exit(0);
        } else if ((v = bench_flag(argc, argv, &i, "--url")) ||
                   (v = bench_flag(argc, argv, &i, "--base-url"))) {
            if (a->n_urls == SERVING_MAX_URLS) bench_die("at most %d --url", SERVING_MAX_URLS);
            a->urls[a->n_urls++] = bench_base_url(v);
        } else if ((v = bench_flag(argc, argv, &i, "--host"))) {
            host = v;
        } else if ((v = bench_flag(argc, argv, &i, "--port"))) {
            port = v;
        } else if ((v = bench_flag(argc, argv, &i, "--backend"))) {
            a->backend_name = v;
            if (!strcmp(v, "sglang") || !strcmp(v, "sglang-native"))
                a->api = BENCH_API_GENERATE;
            else if (!strcmp(v, "openai") || !strcmp(v, "sglang-oai") || !strcmp(v, "vllm"))
                a->api = BENCH_API_COMPLETIONS;
            else if (!strcmp(v, "openai-chat") || !strcmp(v, "sglang-oai-chat") ||
                     !strcmp(v, "vllm-chat"))
                a->api = BENCH_API_CHAT;
            else
                bench_die("--backend: '%s' is not sglang, openai or openai-chat", v);
        } else if ((v = bench_flag(argc, argv, &i, "--dataset")) ||
                   (v = bench_flag(argc, argv, &i, "--dataset-name"))) {
            a->dataset_name = v;
            if (!strcmp(v, "random"))
                a->dataset = SERVING_DATA_RANDOM;
            else if (!strcmp(v, "random-ids"))
                a->dataset = SERVING_DATA_RANDOM_IDS;
            else if (!strcmp(v, "jsonl"))
                a->dataset = SERVING_DATA_JSONL;
            else
                bench_die("--dataset: '%s' is not random, random-ids or jsonl", v);
        } else if ((v = bench_flag(argc, argv, &i, "--dataset-path"))) {
            a->dataset_path = v;
        } else if ((v = bench_flag(argc, argv, &i, "--num-prompts"))) {
            a->num_prompts = (int)bench_flag_long("--num-prompts", v, 1);
        } else if ((v = bench_flag(argc, argv, &i, "--random-input-len"))) {
            a->input_len = (int)bench_flag_long("--random-input-len", v, 1);
        } else if ((v = bench_flag(argc, argv, &i, "--random-output-len"))) {
            a->output_len = (int)bench_flag_long("--random-output-len", v, 0);
        } else if ((v = bench_flag(argc, argv, &i, "--random-range-ratio"))) {
            a->range_ratio = bench_flag_double("--random-range-ratio", v, 0);
            if (a->range_ratio > 1) bench_die("--random-range-ratio: '%s' is above 1", v);
        } else if ((v = bench_flag(argc, argv, &i, "--vocab-size"))) {
            a->vocab_size = (int)bench_flag_long("--vocab-size", v, 1);
        } else if ((v = bench_flag(argc, argv, &i, "--request-rate"))) {
            a->request_rate = bench_flag_double("--request-rate", v, 0);
            if (a->request_rate == 0) bench_die("--request-rate: give a rate above 0, or inf");
        } else if ((v = bench_flag(argc, argv, &i, "--max-concurrency"))) {
            a->max_concurrency = (int)bench_flag_long("--max-concurrency", v, 1);
        } else if ((v = bench_flag(argc, argv, &i, "--seed"))) {
            a->seed = bench_flag_long("--seed", v, 0);
        } else if ((v = bench_flag(argc, argv, &i, "--warmup-requests"))) {
            a->warmup_requests = (int)bench_flag_long("--warmup-requests", v, 0);
        } else if (!strcmp(argv[i], "--flush-cache")) {
            a->flush_cache = 1;
        } else if (!strcmp(argv[i], "--disable-ignore-eos")) {
            a->ignore_eos = 0;
        } else if ((v = bench_flag(argc, argv, &i, "--extra-request-body"))) {
            a->extra_body = v;
        } else if ((v = bench_flag(argc, argv, &i, "--model"))) {
            a->model = v;
        } else if ((v = bench_flag(argc, argv, &i, "--api-key"))) {
            a->api_key = v;
        } else if ((v = bench_flag(argc, argv, &i, "--timeout"))) {
            a->timeout_s = bench_flag_double("--timeout", v, 0);
        } else if ((v = bench_flag(argc, argv, &i, "--output-file"))) {
            a->output_file = v;
        } else if (!strcmp(argv[i], "--disable-progress") || !strcmp(argv[i], "--disable-tqdm")) {
            a->progress = 0;
        } else {
            bench_die("serving: unknown flag '%s' (moeserve-bench serving --help lists them)",
                      argv[i]);
        }
    }
    if (host || port) {
        if (a->n_urls == SERVING_MAX_URLS) bench_die("at most %d --url", SERVING_MAX_URLS);
        bench_buf b = {0};
        bench_buf_appendf(&b, "%s:%s", host ? host : "127.0.0.1", port ? port : "30000");
        a->urls[a->n_urls++] = bench_base_url(b.data);
        bench_buf_free(&b);
    }
    if (a->n_urls == 0) a->urls[a->n_urls++] = bench_base_url("http://127.0.0.1:30000");
    if (a->dataset == SERVING_DATA_RANDOM_IDS && a->api == BENCH_API_CHAT)
        bench_die("--dataset random-ids sends token ids, which a chat message cannot carry: use "
                  "--dataset random with --backend openai-chat");
    if (a->dataset == SERVING_DATA_RANDOM_IDS && a->vocab_size <= 0)
        bench_die("--dataset random-ids needs --vocab-size (the tokenizer's vocab_size)");
    if (a->dataset == SERVING_DATA_JSONL && !a->dataset_path)
        bench_die("--dataset jsonl needs --dataset-path FILE");
}

static const char *serving_path(bench_api api) {
    switch (api) {
    case BENCH_API_GENERATE: return "/generate";
    case BENCH_API_COMPLETIONS: return "/v1/completions";
    case BENCH_API_CHAT: return "/v1/chat/completions";
    }
    return "/generate";
}

static cJSON *serving_ids(const bench_prompt *p) {
    cJSON *ids = cJSON_CreateArray();
    for (int j = 0; j < p->n_ids; j++)
        cJSON_AddItemToArray(ids, cJSON_CreateNumber(p->ids[j]));
    return ids;
}

/* the JSON body of one request (a fresh string) */
static char *serving_body(const serving_args *a, const char *model, const bench_prompt *p,
                          int output_len, const cJSON *extra) {
    cJSON *root = cJSON_CreateObject();
    if (a->api == BENCH_API_GENERATE) {
        if (p->text)
            cJSON_AddStringToObject(root, "text", p->text);
        else
            cJSON_AddItemToObject(root, "input_ids", serving_ids(p));
        cJSON *sp = cJSON_AddObjectToObject(root, "sampling_params");
        cJSON_AddNumberToObject(sp, "temperature", 0.0);
        cJSON_AddNumberToObject(sp, "max_new_tokens", output_len);
        cJSON_AddBoolToObject(sp, "ignore_eos", a->ignore_eos);
        cJSON_AddBoolToObject(root, "stream", 1);
        cJSON_AddBoolToObject(root, "return_logprob", 0);
        cJSON_AddNumberToObject(root, "logprob_start_len", -1);
        cJSON_AddNullToObject(root, "lora_path");
    } else {
        cJSON_AddStringToObject(root, "model", model);
        if (a->api == BENCH_API_COMPLETIONS) {
            if (p->text)
                cJSON_AddStringToObject(root, "prompt", p->text);
            else
                cJSON_AddItemToObject(root, "prompt", serving_ids(p));
            cJSON_AddNumberToObject(root, "best_of", 1);
            cJSON_AddNumberToObject(root, "max_tokens", output_len);
        } else {
            cJSON *msgs = cJSON_AddArrayToObject(root, "messages");
            cJSON *m = cJSON_CreateObject();
            cJSON_AddStringToObject(m, "role", "user");
            cJSON_AddStringToObject(m, "content", p->text);
            cJSON_AddItemToArray(msgs, m);
            cJSON_AddNumberToObject(root, "max_completion_tokens", output_len);
        }
        cJSON_AddBoolToObject(root, "stream", 1);
        cJSON_AddNumberToObject(root, "temperature", 0.0);
        cJSON_AddBoolToObject(root, "ignore_eos", a->ignore_eos);
        cJSON *so = cJSON_AddObjectToObject(root, "stream_options");
        cJSON_AddBoolToObject(so, "include_usage", 1);
    }
    for (const cJSON *e = extra ? extra->child : NULL; e; e = e->next) {
        cJSON_DeleteItemFromObjectCaseSensitive(root, e->string);
        cJSON_AddItemToObject(root, e->string, cJSON_Duplicate(e, 1));
    }
    char *s = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    if (!s) bench_die("out of memory");
    return s;
}

/* one request of a run: its stream reader and its record */
typedef struct {
    bench_stream stream;
    bench_request *req;
    const bench_prompt *prompt;
    int output_len;
    bench_api api;
    double t0;
} serving_job;

static void serving_on_start(bench_http_job *job, double now) {
    serving_job *j = job->user;
    bench_stream_begin(&j->stream, j->api, j->req, now, j->prompt->prompt_len, j->output_len);
    j->req->start = now - j->t0;
}

static void serving_on_line(bench_http_job *job, const char *line, size_t len, double now) {
    serving_job *j = job->user;
    bench_stream_line(&j->stream, line, len, now);
}

static int serving_on_done(bench_http_job *job, double now) {
    (void)now;
    serving_job *j = job->user;
    bench_stream_end(&j->stream, job->status, job->error, job->body_in.data);
    bench_buf_free(&job->body_in);
    return j->req->ok;
}

/* Sends count requests (prompt i % n_prompts, at arrivals[i] after t0) and fills reqs. */
static void serving_send(const serving_args *a, const char *model, const cJSON *extra,
                         const bench_prompt *prompts, int n_prompts, int count, int out_cap,
                         const double *arrivals, bench_request *reqs, double t0,
                         bench_progress *progress) {
    bench_http_job *jobs = calloc((size_t)count + 1, sizeof *jobs);
    serving_job *sj = calloc((size_t)count + 1, sizeof *sj);
    if (!jobs || !sj) bench_die("out of memory");
    for (int i = 0; i < count; i++) {
        const bench_prompt *p = &prompts[i % n_prompts];
        int out = out_cap >= 0 && p->output_len > out_cap ? out_cap : p->output_len;
        sj[i] =
            (serving_job){.req = &reqs[i], .prompt = p, .output_len = out, .api = a->api, .t0 = t0};
        jobs[i] = (bench_http_job){.path = serving_path(a->api),
                                   .body = serving_body(a, model, p, out, extra),
                                   .arrival = arrivals ? arrivals[i] : 0,
                                   .user = &sj[i]};
    }
    bench_http_opts o = {.urls = a->urls,
                         .n_urls = a->n_urls,
                         .max_concurrency = a->max_concurrency,
                         .timeout_s = a->timeout_s,
                         .api_key = a->api_key,
                         .on_start = serving_on_start,
                         .on_line = serving_on_line,
                         .on_done = serving_on_done,
                         .progress = progress};
    bench_http_run(&o, jobs, count, t0);
    for (int i = 0; i < count; i++)
        free(jobs[i].body);
    free(jobs);
    free(sj);
}

static void serving_flush_cache(const serving_args *a) {
    for (int u = 0; u < a->n_urls; u++) {
        bench_http_job job = {.path = "/flush_cache", .body = "{}"};
        bench_http_opts o = {
            .urls = &a->urls[u], .n_urls = 1, .timeout_s = 60, .api_key = a->api_key};
        bench_http_run(&o, &job, 1, bench_now());
        if (job.status != 200)
            fprintf(stderr, "moeserve-bench: POST %s/flush_cache: %s%ld\n", a->urls[u],
                    job.error ? job.error : "HTTP ", job.error ? 0L : job.status);
        bench_buf_free(&job.body_in);
    }
}

static void serving_json_summary(cJSON *o, const char *name, const bench_summary *s, int with_max) {
    char key[64];
    struct {
        const char *what;
        double v;
    } f[] = {{"mean", s->mean}, {"median", s->median}, {"std", s->std},
             {"p90", s->p90},   {"p95", s->p95},       {"p99", s->p99}};
    for (size_t k = 0; k < sizeof f / sizeof f[0]; k++) {
        snprintf(key, sizeof key, "%s_%s_ms", f[k].what, name);
        cJSON_AddNumberToObject(o, key, f[k].v * 1000);
    }
    if (with_max) {
        snprintf(key, sizeof key, "max_%s_ms", name);
        cJSON_AddNumberToObject(o, key, s->max * 1000);
    }
}

static void serving_write_json(const serving_args *a, const bench_serving_metrics *m) {
    FILE *f = fopen(a->output_file, "a");
    if (!f) bench_die("cannot open --output-file %s", a->output_file);
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "backend", a->backend_name);
    cJSON_AddStringToObject(o, "dataset_name", a->dataset_name);
    if (isinf(a->request_rate))
        cJSON_AddStringToObject(o, "request_rate", "inf");
    else
        cJSON_AddNumberToObject(o, "request_rate", a->request_rate);
    if (a->max_concurrency > 0)
        cJSON_AddNumberToObject(o, "max_concurrency", a->max_concurrency);
    else
        cJSON_AddNullToObject(o, "max_concurrency");
    cJSON_AddNumberToObject(o, "num_prompts", a->num_prompts);
    cJSON_AddNumberToObject(o, "random_input_len", a->input_len);
    cJSON_AddNumberToObject(o, "random_output_len", a->output_len);
    cJSON_AddNumberToObject(o, "random_range_ratio", a->range_ratio);
    cJSON_AddNumberToObject(o, "seed", (double)a->seed);
    cJSON_AddNumberToObject(o, "num_urls", a->n_urls);
    cJSON_AddNumberToObject(o, "duration", m->duration);
    cJSON_AddNumberToObject(o, "completed", m->completed);
    cJSON_AddNumberToObject(o, "failed", m->failed);
    cJSON_AddNumberToObject(o, "total_input_tokens", (double)m->total_input);
    cJSON_AddNumberToObject(o, "total_output_tokens", (double)m->total_output);
    cJSON_AddNumberToObject(o, "request_throughput", m->request_throughput);
    cJSON_AddNumberToObject(o, "input_throughput", m->input_throughput);
    cJSON_AddNumberToObject(o, "output_throughput", m->output_throughput);
    cJSON_AddNumberToObject(o, "total_throughput", m->total_throughput);
    cJSON_AddNumberToObject(o, "max_output_tokens_per_s", m->peak_output_throughput);
    cJSON_AddNumberToObject(o, "max_concurrent_requests", m->peak_concurrent);
    serving_json_summary(o, "e2e_latency", &m->e2e, 0);
    serving_json_summary(o, "ttft", &m->ttft, 0);
    serving_json_summary(o, "tpot", &m->tpot, 0);
    serving_json_summary(o, "itl", &m->itl, 1);
    cJSON_AddNumberToObject(o, "concurrency", m->concurrency);
    if (m->first_error)
        cJSON_AddStringToObject(o, "first_error", m->first_error);
    else
        cJSON_AddNullToObject(o, "first_error");
    char *s = cJSON_PrintUnformatted(o);
    fprintf(f, "%s\n", s);
    free(s);
    cJSON_Delete(o);
    fclose(f);
}

int bench_serving_main(int argc, char **argv) {
    serving_args a;
    serving_parse(argc, argv, &a);
    bench_http_global_init();
    bench_rng rng;
    bench_rng_init(&rng, (uint64_t)a.seed);

    bench_prompt *prompts;
    switch (a.dataset) {
    case SERVING_DATA_RANDOM_IDS:
        prompts = bench_dataset_random_ids(&rng, a.num_prompts, a.input_len, a.output_len,
                                           a.range_ratio, a.vocab_size);
        break;
    case SERVING_DATA_JSONL:
        prompts =
            bench_dataset_jsonl(&rng, a.num_prompts, a.dataset_path, a.output_len, a.range_ratio);
        break;
    default:
        prompts = bench_dataset_random_text(&rng, a.num_prompts, a.input_len, a.output_len,
                                            a.range_ratio, a.dataset_path);
    }
    long planned_in = 0, planned_out = 0;
    for (int i = 0; i < a.num_prompts; i++) {
        planned_in += prompts[i].prompt_len;
        planned_out += prompts[i].output_len;
    }
    if (a.dataset == SERVING_DATA_RANDOM_IDS)
        printf("#Input tokens: %ld\n", planned_in);
    else
        printf("#Input words: %ld (the server counts the tokens)\n", planned_in);
    printf("#Output tokens: %ld\n", planned_out);

    cJSON *extra = NULL;
    if (a.extra_body) {
        extra = cJSON_Parse(a.extra_body);
        if (!cJSON_IsObject(extra)) bench_die("--extra-request-body is not a JSON object");
    }
    char *model = NULL;
    if (a.api != BENCH_API_GENERATE)
        model = a.model ? bench_strdup(a.model) : bench_http_model_id(a.urls[0], a.api_key);

    /* warm-up: the first prompt, at most 32 output tokens, at the run's concurrency */
    printf("Starting warmup with %d sequences...\n", a.warmup_requests);
    fflush(stdout);
    if (a.warmup_requests > 0) {
        bench_request *w = calloc((size_t)a.warmup_requests, sizeof *w);
        if (!w) bench_die("out of memory");
        serving_send(&a, model, extra, prompts, 1, a.warmup_requests, 32, NULL, w, bench_now(),
                     NULL);
        int any_ok = 0;
        for (int i = 0; i < a.warmup_requests; i++)
            any_ok |= w[i].ok;
        if (!any_ok)
            bench_die("warm-up failed - check the benchmark's flags. Error: %s",
                      w[0].error ? w[0].error : "unknown");
        for (int i = 0; i < a.warmup_requests; i++)
            bench_request_free(&w[i]);
        free(w);
    }
    printf("Warmup completed with %d sequences. Starting main benchmark run...\n",
           a.warmup_requests);
    fflush(stdout);
    if (a.flush_cache) serving_flush_cache(&a);
    struct timespec rest = {1, 0};
    nanosleep(&rest, NULL);

    /* arrivals: request 0 at once, then exponential gaps of mean 1 / rate */
    double *arrivals = bench_malloc((size_t)a.num_prompts * sizeof *arrivals);
    double t = 0;
    for (int i = 0; i < a.num_prompts; i++) {
        arrivals[i] = t;
        if (!isinf(a.request_rate)) t += bench_rng_exponential(&rng, 1.0 / a.request_rate);
    }
    bench_request *reqs = calloc((size_t)a.num_prompts, sizeof *reqs);
    if (!reqs) bench_die("out of memory");
    bench_progress progress;
    bench_progress_start(&progress, a.num_prompts, "serving", a.progress);
    double t0 = bench_now();
    serving_send(&a, model, extra, prompts, a.num_prompts, a.num_prompts, -1, arrivals, reqs, t0,
                 &progress);
    double duration = bench_now() - t0;
    bench_progress_end(&progress);

    bench_serving_metrics m;
    bench_serving_compute(reqs, a.num_prompts, duration, &m);
    int uncounted = 0;
    for (int i = 0; i < a.num_prompts; i++)
        if (reqs[i].ok && !(reqs[i].prompt_counted && reqs[i].output_counted)) uncounted++;
    if (uncounted)
        printf("Note: %d requests got no token counts from the server; for them the prompt's "
               "length and the requested output length are counted\n",
               uncounted);
    if (m.failed) printf("First error: %s\n", m.first_error ? m.first_error : "unknown");
    bench_serving_print(stdout, &m, a.backend_name, a.request_rate, a.max_concurrency);
    fflush(stdout);
    if (a.output_file) serving_write_json(&a, &m);

    int failed = m.failed;
    for (int i = 0; i < a.num_prompts; i++)
        bench_request_free(&reqs[i]);
    free(reqs);
    free(arrivals);
    free(model);
    cJSON_Delete(extra);
    bench_prompts_free(prompts, a.num_prompts);
    for (int u = 0; u < a.n_urls; u++)
        free((char *)a.urls[u]);
    return failed ? 1 : 0;
}
