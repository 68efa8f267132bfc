/* Unit tests of the server's pure parts: chat template detection and rendering, the Prometheus
 * text of metrics, and the /generate answer builder (empty outputs, running chunks, top
 * logprobs). The HTTP endpoints themselves are tested end to end against the real binary
 * (tests/test_http.py). Run from the repository root. */
#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "server/chat_template.h"
#include "server/generate_json.h"
#include "server/metrics.h"
#include "tests/check.h"

static char tmpdir[] = "/tmp/moeserve-server-parts-XXXXXX";

static void write_file(const char *dir, const char *name, const char *text) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    if (!f) return;
    fputs(text, f);
    fclose(f);
}

static void make_dir(const char *name, char *out, size_t n) {
    snprintf(out, n, "%s/%s", tmpdir, name);
    mkdir(out, 0755);
}

static void test_chat_template(void) {
    chat_template t;
    chat_template_load(&t, "models/tiny-qwen3-moe");
    CHECK(t.kind == CHAT_TEMPLATE_CHATML, "default model: kind %d (%s)", t.kind, t.why);
    chat_message msgs[2] = {{"system", "Be brief."}, {"user", "Hi"}};
    char *s = chat_template_render(&t, msgs, 2, true);
    const char *want = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                       "<|im_start|>assistant\n";
    CHECK(!strcmp(s, want), "render: '%s'", s);
    free(s);
    s = chat_template_render(&t, msgs + 1, 1, false);
    CHECK(!strcmp(s, "<|im_start|>user\nHi<|im_end|>\n"), "no generation prompt: '%s'", s);
    free(s);

    char d[512];
    make_dir("none", d, sizeof d);
    write_file(d, "tokenizer_config.json", "{\"bos_token\": null}");
    chat_template_load(&t, d);
    CHECK(t.kind == CHAT_TEMPLATE_NONE && strstr(t.why, "no chat template"), "absent: %s", t.why);

    make_dir("llama", d, sizeof d);
    write_file(d, "tokenizer_config.json",
               "{\"chat_template\": \"{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
               "<|end_header_id|>{% endfor %}\"}");
    chat_template_load(&t, d);
    CHECK(t.kind == CHAT_TEMPLATE_NONE && strstr(t.why, "not a supported"), "llama: %s", t.why);

    make_dir("list", d, sizeof d);
    write_file(d, "tokenizer_config.json",
               "{\"chat_template\": [{\"name\": \"tool_use\", \"template\": \"x\"}, {\"name\": "
               "\"default\", \"template\": \"<|im_start|>{{ role }}<|im_end|>\"}]}");
    chat_template_load(&t, d);
    CHECK(t.kind == CHAT_TEMPLATE_CHATML, "list with default: kind %d (%s)", t.kind, t.why);

    make_dir("jinja", d, sizeof d);
    write_file(d, "tokenizer_config.json", "{}");
    write_file(d, "chat_template.jinja", "{{ '<|im_start|>' + role }}...<|im_end|>");
    chat_template_load(&t, d);
    CHECK(t.kind == CHAT_TEMPLATE_CHATML, "chat_template.jinja: kind %d (%s)", t.kind, t.why);
}

/* The value of the sample line that starts with prefix, or NAN. */
static double metrics_sample(const char *text, const char *prefix) {
    size_t n = strlen(prefix);
    for (const char *line = text; line && *line;
         line = strchr(line, '\n') ? strchr(line, '\n') + 1 : NULL)
        if (!strncmp(line, prefix, n)) return strtod(line + n, NULL);
    return NAN;
}

static void test_metrics(void) {
    metrics *m = metrics_create("my \"model\"");
    metrics_observe_ttft(m, 0.003);
    metrics_observe_ttft(m, 500.0); /* past the last bound: only +Inf */
    metrics_observe_itl(m, 0.0001);
    metrics_observe_request(m, 0.5, FINISH_LENGTH);
    metrics_observe_request(m, 0.5, FINISH_STOP_STRING);
    metrics_count_http(m, 404);
    scheduler_stats st = {.n_running = 3,
                          .n_waiting = 2,
                          .kv_pages_used = 5,
                          .kv_pages_total = 10,
                          .n_generated_tokens = 77};
    size_t len;
    char *text = metrics_render(m, &st, &len);
    CHECK(len == strlen(text), "length %zu vs %zu", len, strlen(text));
    const char *lbl = "{model_name=\"my \\\"model\\\"\"";
    char key[256];
    snprintf(key, sizeof key, "moeserve:num_running_reqs%s} ", lbl);
    CHECK(metrics_sample(text, key) == 3, "running: %s", text);
    snprintf(key, sizeof key, "moeserve:token_usage%s} ", lbl);
    CHECK(metrics_sample(text, key) == 0.5, "token usage");
    snprintf(key, sizeof key, "moeserve:generation_tokens_total%s} ", lbl);
    CHECK(metrics_sample(text, key) == 77, "generated tokens");
    snprintf(key, sizeof key, "moeserve:time_to_first_token_seconds_bucket%s,le=\"0.005\"} ", lbl);
    CHECK(metrics_sample(text, key) == 1, "ttft bucket 0.005 (cumulative)");
    snprintf(key, sizeof key, "moeserve:time_to_first_token_seconds_bucket%s,le=\"+Inf\"} ", lbl);
    CHECK(metrics_sample(text, key) == 2, "ttft +Inf bucket");
    snprintf(key, sizeof key, "moeserve:time_to_first_token_seconds_count%s} ", lbl);
    CHECK(metrics_sample(text, key) == 2, "ttft count");
    snprintf(key, sizeof key, "moeserve:finished_requests_total%s,reason=\"stop\"} ", lbl);
    CHECK(metrics_sample(text, key) == 1, "finished by stop");
    snprintf(key, sizeof key, "moeserve:http_responses_total%s,status=\"4xx\"} ", lbl);
    CHECK(metrics_sample(text, key) == 1, "4xx answers");
    CHECK(strstr(text, "# TYPE moeserve:inter_token_latency_seconds histogram\n") != NULL,
          "itl type line");
    free(text);
    text = metrics_render(m, NULL, &len); /* engine not started yet */
    snprintf(key, sizeof key, "moeserve:num_running_reqs%s} ", lbl);
    CHECK(metrics_sample(text, key) == 0, "no stats -> 0");
    free(text);
    metrics_free(m);
}

static void test_generate_json(void) {
    /* a prompt scored with nothing generated: output_ids must be [], not missing */
    const int32_t prompt[3] = {5, 6, 7};
    const float in_lp[3] = {NAN, -1.5f, -0.25f};
    const int32_t in_top[6] = {-1, -1, 6, 9, 7, 8};
    const float in_top_lp[6] = {NAN, NAN, -1.5f, -2.0f, -0.25f, -3.0f};
    generate_fields f = {.id = "r1",
                         .text = "",
                         .n_prompt = 3,
                         .finish = FINISH_LENGTH,
                         .e2e_latency = 0.5,
                         .return_logprob = true,
                         .input_ids = prompt,
                         .input_logprobs = in_lp,
                         .n_input_logprobs = 3,
                         .top_logprobs_num = 2,
                         .input_top_ids = in_top,
                         .input_top_logprobs = in_top_lp};
    cJSON *j = generate_json_build(&f);
    char *s = cJSON_PrintUnformatted(j);
    const cJSON *ids = cJSON_GetObjectItem(j, "output_ids");
    CHECK(cJSON_IsArray(ids) && cJSON_GetArraySize(ids) == 0, "empty output_ids: %s", s);
    const cJSON *meta = cJSON_GetObjectItem(j, "meta_info");
    const cJSON *in = cJSON_GetObjectItem(meta, "input_token_logprobs");
    CHECK(cJSON_GetArraySize(in) == 3 &&
              cJSON_IsNull(cJSON_GetArrayItem(cJSON_GetArrayItem(in, 0), 0)),
          "first input logprob null: %s", s);
    const cJSON *top = cJSON_GetObjectItem(meta, "input_top_logprobs");
    CHECK(cJSON_GetArraySize(top) == 3 && cJSON_IsNull(cJSON_GetArrayItem(top, 0)) &&
              cJSON_GetArraySize(cJSON_GetArrayItem(top, 1)) == 2,
          "input_top_logprobs: %s", s);
    const cJSON *fr = cJSON_GetObjectItem(meta, "finish_reason");
    CHECK(!strcmp(cJSON_GetObjectItem(fr, "type")->valuestring, "length") &&
              cJSON_GetObjectItem(fr, "length")->valueint == 0,
          "finish_reason length 0: %s", s);
    CHECK(cJSON_GetObjectItem(meta, "e2e_latency") != NULL, "e2e_latency when finished");
    free(s);
    cJSON_Delete(j);

    /* a running chunk: finish_reason null, no e2e_latency, text cut at text_len */
    const int32_t out[2] = {40, 41};
    generate_fields c = {.id = "r2",
                         .text = "hello world",
                         .text_len = 5,
                         .output_ids = out,
                         .n_output = 2,
                         .n_prompt = 3,
                         .finish = FINISH_NONE,
                         .e2e_latency = -1};
    j = generate_json_build(&c);
    s = cJSON_PrintUnformatted(j);
    meta = cJSON_GetObjectItem(j, "meta_info");
    CHECK(!strcmp(cJSON_GetObjectItem(j, "text")->valuestring, "hello"), "text cut: %s", s);
    CHECK(cJSON_IsNull(cJSON_GetObjectItem(meta, "finish_reason")), "finish null: %s", s);
    CHECK(!cJSON_GetObjectItem(meta, "e2e_latency"), "no e2e_latency while running: %s", s);
    CHECK(cJSON_GetObjectItem(meta, "completion_tokens")->valueint == 2, "completion_tokens");
    CHECK(!cJSON_GetObjectItem(meta, "output_token_logprobs"), "no logprobs unless asked: %s", s);
    free(s);
    cJSON_Delete(j);

    /* stop string and abort reasons */
    c.finish = FINISH_STOP_STRING;
    c.matched_stop = "wor";
    j = generate_json_build(&c);
    fr = cJSON_GetObjectItem(cJSON_GetObjectItem(j, "meta_info"), "finish_reason");
    CHECK(!strcmp(cJSON_GetObjectItem(fr, "matched")->valuestring, "wor"), "matched stop string");
    cJSON_Delete(j);
    c.finish = FINISH_ABORT;
    c.abort_message = "server shutting down";
    j = generate_json_build(&c);
    fr = cJSON_GetObjectItem(cJSON_GetObjectItem(j, "meta_info"), "finish_reason");
    CHECK(!strcmp(cJSON_GetObjectItem(fr, "type")->valuestring, "abort") &&
              !strcmp(cJSON_GetObjectItem(fr, "message")->valuestring, "server shutting down"),
          "abort message");
    cJSON_Delete(j);
}

int main(void) {
    if (!mkdtemp(tmpdir)) {
        perror("mkdtemp");
        return 1;
    }
    test_chat_template();
    test_metrics();
    test_generate_json();
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf %s", tmpdir);
    if (system(cmd)) fprintf(stderr, "could not remove %s\n", tmpdir);
    printf("%d passed, %d failed\n", check_passed, check_failed);
    return check_failed != 0;
}
