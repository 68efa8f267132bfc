/* moeserve-bench gsm8k: SGLang's benchmark/gsm8k/bench_sglang.py in C.
 *
 * Prompts and answer values as bench_sglang.py makes and reads them (gsm8k_prompt.h); one
 * non-streaming request per question, --parallel at a time, spread over the --url values:
 *   sglang  POST /generate {"text", "sampling_params": {"max_new_tokens", "temperature",
 *           "stop": ["Question", "Assistant:", "<|separator|>"]}}; text and
 *           meta_info.completion_tokens read back
 *   openai  POST /v1/completions {"model", "prompt", "max_tokens", "temperature", "stop"};
 *           choices[0].text and usage.completion_tokens read back
 * Then the closing lines of bench_sglang.py: Accuracy (answers equal to the label's value),
 * Invalid (answers without a value), Latency (wall time of all requests) and Output throughput
 * (completion tokens / latency). A failed request counts as an invalid answer. */
#include <cjson/cJSON.h>
#include <stdlib.h>
#include <string.h>

#include "scripts/bench/bench.h"
#include "scripts/bench/gsm8k_prompt.h"
#include "scripts/bench/http.h"
#include "scripts/bench/util.h"

#define GSM8K_MAX_URLS  64
#define GSM8K_VALUE_LEN 64

typedef struct {
    const char *urls[GSM8K_MAX_URLS];
    int n_urls;
    const char *data_path, *backend, *model, *api_key, *output_file;
    int openai, num_shots, num_questions, parallel, max_new_tokens, progress;
    double temperature, timeout_s;
} gsm8k_args;

static const char gsm8k_usage[] =
    "usage: moeserve-bench gsm8k --data-path FILE [flags]\n"
    "\n"
    "SGLang's GSM8K few-shot benchmark (benchmark/gsm8k/bench_sglang.py): the first --num-shots\n"
    "rows of FILE as examples, then each of the first --num-questions questions, greedy, stop at\n"
    "\"Question\"; the answer is the last number of the text. Prints Accuracy, Invalid, Latency "
    "and\n"
    "Output throughput. Exit status 0 when every request succeeded, 1 when one failed, 2 for a\n"
    "usage error.\n"
    "\n"
    "  --data-path FILE    GSM8K JSONL, rows {\"question\", \"answer\"} (the public test set:\n"
    "                      grade_school_math/data/test.jsonl of\n"
    "                      github.com/openai/grade-school-math)\n"
    "  --url URL           a server, http://HOST:PORT; repeat it once per rank: each request goes\n"
    "                      to the URL with the fewest running (default http://127.0.0.1:30000;\n"
    "                      --host H --port P make one too)\n"
    "  --backend NAME      sglang (POST /generate) or openai (POST /v1/completions) (default\n"
    "                      sglang; srt is taken as sglang)\n"
    "  --num-shots K       examples before each question (default 8)\n"
    "  --num-questions N   questions, from the file's start (default 200)\n"
    "  --parallel P        requests at once (default 64)\n"
    "  --max-new-tokens N  output tokens per answer at most (default 512)\n"
    "  --temperature T     sampling temperature (default 0: greedy)\n"
    "  --model NAME        the \"model\" of OpenAI requests (default: the first id of GET\n"
    "                      /v1/models)\n"
    "  --api-key KEY       sent as a Bearer token (default $OPENAI_API_KEY)\n"
    "  --timeout S         seconds one request may take (default 21600)\n"
    "  --output-file F     append one JSON line with the settings and results to F (--result-file\n"
    "                      is the same flag)\n"
    "  --disable-progress  no progress bar (it is drawn on stderr only when that is a terminal)\n"
    "  --help              this text\n";

static void gsm8k_parse(int argc, char **argv, gsm8k_args *a) {
    *a = (gsm8k_args){.backend = "sglang",
                      .num_shots = 8,
                      .num_questions = 200,
                      .parallel = 64,
                      .max_new_tokens = 512,
                      .progress = 1,
                      .timeout_s = 21600,
                      .api_key = getenv("OPENAI_API_KEY")};
    const char *host = NULL, *port = NULL;
    for (int i = 1; i < argc; i++) {
        const char *v;
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            fputs(gsm8k_usage, stdout);
            exit(0);
        } else if ((v = bench_flag(argc, argv, &i, "--url")) ||
                   (v = bench_flag(argc, argv, &i, "--base-url"))) {
            if (a->n_urls == GSM8K_MAX_URLS) bench_die("at most %d --url", GSM8K_MAX_URLS);
            a->urls[a->n_urls++] = bench_base_url(v);
        } else if ((v = bench_flag(argc, argv, &i, "--host"))) {
            host = v;
        } else if ((v = bench_flag(argc, argv, &i, "--port"))) {
            port = v;
        } else if ((v = bench_flag(argc, argv, &i, "--data-path"))) {
            a->data_path = v;
        } else if ((v = bench_flag(argc, argv, &i, "--backend"))) {
            if (!strcmp(v, "sglang") || !strcmp(v, "srt"))
                a->openai = 0;
            else if (!strcmp(v, "openai"))
                a->openai = 1;
            else
                bench_die("--backend: '%s' is not sglang or openai", v);
            a->backend = a->openai ? "openai" : "sglang";
        } else if ((v = bench_flag(argc, argv, &i, "--num-shots"))) {
            a->num_shots = (int)bench_flag_long("--num-shots", v, 0);
        } else if ((v = bench_flag(argc, argv, &i, "--num-questions"))) {
            a->num_questions = (int)bench_flag_long("--num-questions", v, 1);
        } else if ((v = bench_flag(argc, argv, &i, "--parallel"))) {
            a->parallel = (int)bench_flag_long("--parallel", v, 1);
        } else if ((v = bench_flag(argc, argv, &i, "--max-new-tokens"))) {
            a->max_new_tokens = (int)bench_flag_long("--max-new-tokens", v, 1);
        } else if ((v = bench_flag(argc, argv, &i, "--temperature"))) {
            a->temperature = bench_flag_double("--temperature", v, 0);
        } else if ((v = bench_flag(argc, argv, &i, "--model"))) {
            a->model = v;
        } else if ((v = bench_flag(argc, argv, &i, "--api-key"))) {
            a->api_key = v;
        } else if ((v = bench_flag(argc, argv, &i, "--timeout"))) {
            a->timeout_s = bench_flag_double("--timeout", v, 0);
        } else if ((v = bench_flag(argc, argv, &i, "--output-file")) ||
                   (v = bench_flag(argc, argv, &i, "--result-file"))) {
            a->output_file = v;
        } else if (!strcmp(argv[i], "--disable-progress") || !strcmp(argv[i], "--disable-tqdm")) {
            a->progress = 0;
        } else {
            bench_die("gsm8k: unknown flag '%s' (moeserve-bench gsm8k --help lists them)", argv[i]);
        }
    }
    if (host || port) {
        if (a->n_urls == GSM8K_MAX_URLS) bench_die("at most %d --url", GSM8K_MAX_URLS);
        bench_buf b = {0};
        bench_buf_appendf(&b, "%s:%s", host ? host : "127.0.0.1", port ? port : "30000");
        a->urls[a->n_urls++] = bench_base_url(b.data);
        bench_buf_free(&b);
    }
    if (a->n_urls == 0) a->urls[a->n_urls++] = bench_base_url("http://127.0.0.1:30000");
    if (!a->data_path)
        bench_die(
            "gsm8k needs --data-path FILE (GSM8K test.jsonl, see moeserve-bench gsm8k --help)");
}

/* one question's answer */
typedef struct {
    int openai; /* the request went to /v1/completions */
    int ok;
    char *error;
    char *text;
    int completion_tokens;
} gsm8k_answer;

static int gsm8k_on_done(bench_http_job *job, double now) {
    (void)now;
    gsm8k_answer *ans = job->user;
    bench_buf err = {0};
    cJSON *root = NULL;
    if (job->error) {
        bench_buf_appendf(&err, "%s", job->error);
    } else if (job->status != 200) {
        bench_buf_appendf(&err, "HTTP %ld: %.300s", job->status,
                          job->body_in.data ? job->body_in.data : "");
    } else {
        root = cJSON_Parse(job->body_in.data ? job->body_in.data : "");
        const cJSON *text = NULL, *counts = NULL;
        if (ans->openai) {
            const cJSON *c0 =
                cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(root, "choices"), 0);
            text = cJSON_GetObjectItemCaseSensitive(c0, "text");
            counts = cJSON_GetObjectItemCaseSensitive(root, "usage");
        } else {
            text = cJSON_GetObjectItemCaseSensitive(root, "text");
            counts = cJSON_GetObjectItemCaseSensitive(root, "meta_info");
        }
        const cJSON *n = cJSON_GetObjectItemCaseSensitive(counts, "completion_tokens");
        if (!cJSON_IsString(text) || !cJSON_IsNumber(n)) {
            bench_buf_appendf(&err, "an answer without %s: %.300s",
                              ans->openai ? "choices[0].text and usage" : "text and meta_info",
                              job->body_in.data ? job->body_in.data : "");
        } else {
            ans->text = bench_strdup(text->valuestring);
            ans->completion_tokens = (int)n->valuedouble;
        }
    }
    if (err.data)
        for (char *c = err.data; *c; c++)
            if (*c == '\n' || *c == '\r') *c = ' ';
    ans->ok = err.data == NULL;
    ans->error = err.data;
    cJSON_Delete(root);
    bench_buf_free(&job->body_in);
    return ans->ok;
}

static const char *gsm8k_field(const cJSON *row, const char *key, const char *path, int i) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(row, key);
    if (!cJSON_IsString(v)) bench_die("%s: row %d has no string \"%s\"", path, i + 1, key);
    return v->valuestring;
}

int bench_gsm8k_main(int argc, char **argv) {
    gsm8k_args a;
    gsm8k_parse(argc, argv, &a);
    bench_http_global_init();
    int n_rows;
    cJSON **rows = bench_jsonl_read(a.data_path, &n_rows);
    if (n_rows < a.num_shots)
        bench_die("%s has %d rows, fewer than --num-shots %d", a.data_path, n_rows, a.num_shots);
    int n = a.num_questions < n_rows ? a.num_questions : n_rows;
    if (n == 0) bench_die("%s has no questions", a.data_path);
    const char **questions = bench_malloc((size_t)n_rows * sizeof *questions);
    const char **answers = bench_malloc((size_t)n_rows * sizeof *answers);
    for (int i = 0; i < n_rows && i < (n > a.num_shots ? n : a.num_shots); i++) {
        questions[i] = gsm8k_field(rows[i], "question", a.data_path, i);
        answers[i] = gsm8k_field(rows[i], "answer", a.data_path, i);
    }
    char *few_shot = gsm8k_few_shot(questions, answers, a.num_shots);
    char(*labels)[GSM8K_VALUE_LEN] = bench_malloc((size_t)n * sizeof *labels);
    for (int i = 0; i < n; i++)
        if (!gsm8k_answer_value(answers[i], labels[i], GSM8K_VALUE_LEN))
            bench_die("%s: row %d: the answer has no number to compare with", a.data_path, i + 1);

    char *model = NULL;
    if (a.openai)
        model = a.model ? bench_strdup(a.model) : bench_http_model_id(a.urls[0], a.api_key);

    bench_http_job *jobs = calloc((size_t)n, sizeof *jobs);
    gsm8k_answer *ans = calloc((size_t)n, sizeof *ans);
    if (!jobs || !ans) bench_die("out of memory");
    for (int i = 0; i < n; i++) {
        bench_buf prompt = {0};
        bench_buf_append(&prompt, few_shot, strlen(few_shot));
        gsm8k_example(&prompt, questions[i], NULL);
        cJSON *root = cJSON_CreateObject();
        cJSON *stop = cJSON_CreateStringArray(gsm8k_stop, 3);
        if (a.openai) {
            cJSON_AddStringToObject(root, "model", model);
            cJSON_AddStringToObject(root, "prompt", prompt.data);
            cJSON_AddNumberToObject(root, "max_tokens", a.max_new_tokens);
            cJSON_AddNumberToObject(root, "temperature", a.temperature);
            cJSON_AddItemToObject(root, "stop", stop);
        } else {
            cJSON_AddStringToObject(root, "text", prompt.data);
            cJSON *sp = cJSON_AddObjectToObject(root, "sampling_params");
            cJSON_AddNumberToObject(sp, "max_new_tokens", a.max_new_tokens);
            cJSON_AddNumberToObject(sp, "temperature", a.temperature);
            cJSON_AddItemToObject(sp, "stop", stop);
        }
        jobs[i] = (bench_http_job){.path = a.openai ? "/v1/completions" : "/generate",
                                   .body = cJSON_PrintUnformatted(root),
                                   .user = &ans[i]};
        ans[i].openai = a.openai;
        if (!jobs[i].body) bench_die("out of memory");
        cJSON_Delete(root);
        bench_buf_free(&prompt);
    }

    bench_progress progress;
    bench_progress_start(&progress, n, "gsm8k", a.progress);
    bench_http_opts o = {.urls = a.urls,
                         .n_urls = a.n_urls,
                         .max_concurrency = a.parallel,
                         .timeout_s = a.timeout_s,
                         .api_key = a.api_key,
                         .on_done = gsm8k_on_done,
                         .progress = &progress};
    double tic = bench_now();
    bench_http_run(&o, jobs, n, tic);
    double latency = bench_now() - tic;
    bench_progress_end(&progress);

    int correct = 0, invalid = 0, failed = 0;
    long output_tokens = 0;
    const char *first_error = NULL;
    for (int i = 0; i < n; i++) {
        char pred[GSM8K_VALUE_LEN];
        if (!ans[i].ok) {
            if (!failed++) first_error = ans[i].error;
            invalid++;
            continue;
        }
        output_tokens += ans[i].completion_tokens;
        if (!gsm8k_answer_value(ans[i].text, pred, sizeof pred))
            invalid++;
        else if (!strcmp(pred, labels[i]))
            correct++;
    }
    double accuracy = (double)correct / n, invalid_rate = (double)invalid / n;
    double throughput = latency > 0 ? output_tokens / latency : 0;
    printf("Questions: %d, shots: %d, backend: %s, urls: %d\n", n, a.num_shots, a.backend,
           a.n_urls);
    printf("Failed requests: %d\n", failed);
    if (failed) printf("First error: %s\n", first_error ? first_error : "unknown");
    printf("Accuracy: %.3f\n", accuracy);
    printf("Invalid: %.3f\n", invalid_rate);
    printf("Latency: %.3f s\n", latency);
    printf("Output throughput: %.3f token/s\n", throughput);
    fflush(stdout);

    if (a.output_file) {
        FILE *f = fopen(a.output_file, "a");
        if (!f) bench_die("cannot open --output-file %s", a.output_file);
        cJSON *r = cJSON_CreateObject();
        cJSON_AddStringToObject(r, "task", "gsm8k");
        cJSON_AddStringToObject(r, "backend", a.backend);
        cJSON_AddNumberToObject(r, "num_urls", a.n_urls);
        cJSON_AddNumberToObject(r, "latency", latency);
        cJSON_AddNumberToObject(r, "accuracy", accuracy);
        cJSON_AddNumberToObject(r, "invalid", invalid_rate);
        cJSON_AddNumberToObject(r, "output_throughput", throughput);
        cJSON_AddNumberToObject(r, "num_requests", n);
        cJSON_AddNumberToObject(r, "failed", failed);
        cJSON *other = cJSON_AddObjectToObject(r, "other");
        cJSON_AddNumberToObject(other, "num_questions", n);
        cJSON_AddNumberToObject(other, "num_shots", a.num_shots);
        cJSON_AddNumberToObject(other, "parallel", a.parallel);
        cJSON_AddNumberToObject(other, "max_new_tokens", a.max_new_tokens);
        cJSON_AddNumberToObject(other, "temperature", a.temperature);
        cJSON_AddNumberToObject(other, "output_tokens", (double)output_tokens);
        char *s = cJSON_PrintUnformatted(r);
        fprintf(f, "%s\n", s);
        free(s);
        cJSON_Delete(r);
        fclose(f);
    }

    for (int i = 0; i < n; i++) {
        free(jobs[i].body);
        free(ans[i].error);
        free(ans[i].text);
    }
    free(jobs);
    free(ans);
    free(labels);
    free(model);
    free(few_shot);
    free(questions);
    free(answers);
    bench_jsonl_free(rows, n_rows);
    for (int u = 0; u < a.n_urls; u++)
        free((char *)a.urls[u]);
    return failed ? 1 : 0;
}
