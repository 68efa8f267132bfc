/* Unit tests of moeserve-bench's arithmetic and parsing (scripts/bench/): numpy-compatible
 * percentiles and summaries, the serving metrics of recorded request timings (TTFT, TPOT
 * excluding the first token, ITL, throughputs, concurrency, per-second peaks), the reading of
 * recorded streams of the three APIs, the result block's format, GSM8K answer values and
 * few-shot prompts, and the random datasets.
 * Expected numbers were computed with numpy 2.4 (np.mean, np.median, np.std, np.percentile with
 * its default linear method, np.max) and pasted here; they must match within 1e-12 relative
 * (the C code follows numpy's summation and interpolation order, so they are in fact equal). */
#include <stdlib.h>
#include <string.h>

#include "scripts/bench/dataset.h"
#include "scripts/bench/gsm8k_prompt.h"
#include "scripts/bench/stats.h"
#include "scripts/bench/stream.h"
#include "tests/check.h"

#define RTOL 1e-12

static void check_summary(const bench_summary *s, const double want[7], const char *what) {
    static const char *const names[7] = {"mean", "median", "std", "p90", "p95", "p99", "max"};
    const double got[7] = {s->mean, s->median, s->std, s->p90, s->p95, s->p99, s->max};
    for (int k = 0; k < 7; k++) {
        char label[96];
        snprintf(label, sizeof label, "%s %s", what, names[k]);
        CHECK_CLOSE(got[k], want[k], 0, RTOL, label);
    }
}

static void test_summaries(void) {
    /* odd count, unsorted */
    const double v[] = {0.012,  0.0031, 0.0457, 0.0199, 0.0072, 0.0305,
                        0.0101, 0.0255, 0.0088, 0.0413, 0.0166};
    const double want_v[7] = {
        0.020063636363636363, 0.0166, 0.013494461673878235, 0.0413, 0.0435, 0.04526, 0.0457};
    bench_summary s;
    bench_summarize(v, 11, &s);
    check_summary(&s, want_v, "11 values");

    /* even count: the median is the mean of the middle two; P95 and P99 interpolate from the
     * upper end (t >= 0.5), P90 from the lower */
    const double w[] = {0.25, 0.5, 0.125, 1.0};
    const double want_w[7] = {0.46875,
                              0.375,
                              0.33511891546136274,
                              0.8500000000000001,
                              0.9249999999999998,
                              0.9849999999999999,
                              1.0};
    bench_summarize(w, 4, &s);
    check_summary(&s, want_w, "4 values");

    /* more than 128 values: numpy's pairwise sum */
    double big[300];
    for (int i = 0; i < 300; i++)
        big[i] = ((i * 37) % 101) / 1000.0 + i * 1e-6;
    const double want_big[7] = {
        0.05004283333333334, 0.0500655, 0.029163550232077177, 0.0901381, 0.09531940000000001,
        0.09926968,          0.100232};
    bench_summarize(big, 300, &s);
    check_summary(&s, want_big, "300 values");
    CHECK_CLOSE(bench_sum(big, 300), 15.012850000000002, 0, RTOL, "pairwise sum of 300");

    /* one value: every statistic is that value, std 0 */
    const double one = 0.042;
    bench_summarize(&one, 1, &s);
    const double want_one[7] = {0.042, 0.042, 0, 0.042, 0.042, 0.042, 0.042};
    check_summary(&s, want_one, "1 value");

    /* none: zeros, as SGLang's np.percentile(x or 0) */
    bench_summarize(NULL, 0, &s);
    const double zeros[7] = {0};
    check_summary(&s, zeros, "0 values");

    /* percentiles at the ends and in between, by hand: sorted {1, 2, 4, 8} */
    const double sorted[] = {1, 2, 4, 8};
    CHECK_CLOSE(bench_percentile_sorted(sorted, 4, 0), 1, 0, RTOL, "P0");
    CHECK_CLOSE(bench_percentile_sorted(sorted, 4, 100), 8, 0, RTOL, "P100");
    CHECK_CLOSE(bench_percentile_sorted(sorted, 4, 50), 3, 0, RTOL, "P50 = 2 + (4-2)*0.5");
    CHECK_CLOSE(bench_percentile_sorted(sorted, 4, 25), 1.75, 0, RTOL, "P25 = 1 + 1*0.75");
    CHECK_CLOSE(bench_percentile_sorted(sorted, 4, 90), 6.8, 0, RTOL, "P90 = 4 + 4*0.7");
}

/* a successful request of recorded timings */
static bench_request recorded(double start, double ttft, double latency, int prompt_len,
                              int output_len, const double *itl, int n_itl) {
    bench_request r = {.ok = 1,
                       .start = start,
                       .ttft = ttft,
                       .latency = latency,
                       .prompt_len = prompt_len,
                       .output_len = output_len};
    for (int i = 0; i < n_itl; i++)
        bench_request_add_itl(&r, itl[i]);
    return r;
}

static void test_serving_metrics(void) {
    const double itl0[] = {0.1, 0.1, 0.1, 0.1}, itl1[] = {0.2, 0.2, 0.2};
    bench_request reqs[4];
    reqs[0] = recorded(0.0, 0.10, 0.50, 10, 5, itl0, 4);
    reqs[1] = recorded(0.05, 0.20, 0.80, 20, 4, itl1, 3);
    reqs[2] = recorded(1.2, 0.05, 0.30, 7, 1, NULL, 0); /* one token: no TPOT */
    reqs[3] = (bench_request){
        .ok = 0, .error = strdup("HTTP 400: context exceeded"), .prompt_len = 99, .output_len = 99};
    bench_serving_metrics m;
    bench_serving_compute(reqs, 4, 1.6, &m);
    CHECK(m.completed == 3, "completed %d", m.completed);
    CHECK(m.failed == 1, "failed %d", m.failed);
    CHECK(m.first_error && !strcmp(m.first_error, "HTTP 400: context exceeded"), "first error");
    CHECK(m.total_input == 37, "total input %ld (failed requests do not count)", m.total_input);
    CHECK(m.total_output == 10, "total output %ld", m.total_output);
    CHECK_CLOSE(m.duration, 1.6, 0, RTOL, "duration");
    CHECK_CLOSE(m.request_throughput, 3 / 1.6, 0, RTOL, "request throughput");
    CHECK_CLOSE(m.input_throughput, 37 / 1.6, 0, RTOL, "input throughput");
    CHECK_CLOSE(m.output_throughput, 10 / 1.6, 0, RTOL, "output throughput");
    CHECK_CLOSE(m.total_throughput, 47 / 1.6, 0, RTOL, "total throughput");
    CHECK_CLOSE(m.concurrency, 1.0, 0, RTOL, "concurrency = sum(E2E) / duration");
    /* numpy over e2e [0.5, 0.8, 0.3], ttft [0.1, 0.2, 0.05], tpot [(0.5-0.1)/4, (0.8-0.2)/3],
     * itl [0.1]*4 + [0.2]*3 */
    const double e2e[7] = {0.5333333333333333, 0.5, 0.20548046676563259, 0.74, 0.77, 0.794, 0.8};
    const double ttft[7] = {
        0.11666666666666668, 0.1, 0.062360956446232366, 0.18000000000000002, 0.19, 0.198, 0.2};
    const double tpot[7] = {0.15000000000000002, 0.15000000000000002, 0.05000000000000002,
                            0.19000000000000003, 0.19500000000000003, 0.19900000000000004,
                            0.20000000000000004};
    const double itl[7] = {0.14285714285714285, 0.1, 0.049487165930539354, 0.2, 0.2, 0.2, 0.2};
    check_summary(&m.e2e, e2e, "E2E");
    check_summary(&m.ttft, ttft, "TTFT");
    check_summary(&m.tpot, tpot, "TPOT");
    check_summary(&m.itl, itl, "ITL");
    /* tokens at 0.1..0.5 (request 0), 0.25..0.85 (request 1) in second 0, 1.25 in second 1;
     * requests 0 and 1 run in second 0, request 2 in second 1 */
    CHECK_CLOSE(m.peak_output_throughput, 9, 0, 0, "peak output tokens in one second");
    CHECK(m.peak_concurrent == 2, "peak concurrent %d", m.peak_concurrent);

    /* every request failed: zeros, no division by zero */
    bench_serving_compute(&reqs[3], 1, 2.0, &m);
    CHECK(m.completed == 0 && m.failed == 1 && m.total_output == 0, "all failed");
    CHECK(m.request_throughput == 0 && m.e2e.mean == 0 && m.peak_concurrent == 0,
          "all failed: zero figures");
    for (int i = 0; i < 4; i++)
        bench_request_free(&reqs[i]);
}

static void feed(bench_stream *s, const char *line, double now) {
    bench_stream_line(s, line, strlen(line), now);
}

static void test_stream_generate(void) {
    bench_request r = {0};
    bench_stream s;
    bench_stream_begin(&s, BENCH_API_GENERATE, &r, 100.0, 5, 8);
    CHECK(r.prompt_len == 5 && r.output_len == 8, "the dataset's counts stand at first");
    feed(&s, ": keep-alive", 100.1);
    feed(&s, "data: {\"text\":\"\",\"meta_info\":{\"prompt_tokens\":12,\"completion_tokens\":0}}",
         100.2);
    feed(&s, "data: {\"text\":\"A\",\"meta_info\":{\"prompt_tokens\":12,\"completion_tokens\":1}}",
         100.30);
    feed(&s, "data: {\"text\":\"AB\",\"meta_info\":{\"completion_tokens\":3}}", 100.35);
    feed(&s, "data: {\"text\":\"AB\",\"meta_info\":{\"completion_tokens\":3}}", 100.37);
    feed(&s, "data:{\"text\":\"ABC\",\"meta_info\":{\"completion_tokens\":4}}", 100.45);
    feed(&s, "data: [DONE]", 100.46);
    bench_stream_end(&s, 200, NULL, NULL);
    CHECK(r.ok, "ok (%s)", r.error ? r.error : "");
    CHECK(r.prompt_len == 12 && r.prompt_counted, "prompt tokens from meta_info: %d", r.prompt_len);
    CHECK(r.output_len == 4 && r.output_counted, "output tokens = last completion_tokens: %d",
          r.output_len);
    CHECK_CLOSE(r.ttft, 100.30 - 100.0, 0, RTOL, "TTFT at the first chunk with text");
    CHECK_CLOSE(r.latency, 100.46 - 100.0, 0, RTOL, "E2E at [DONE]");
    /* 2 tokens in 50 ms: two gaps of 25 ms; the chunk that adds nothing is skipped and the
     * next gap runs from the last counted chunk */
    CHECK(r.n_itl == 3, "ITL count %d", r.n_itl);
    if (r.n_itl == 3) {
        CHECK_CLOSE(r.itl[0], (100.35 - 100.30) / 2, 0, RTOL, "ITL 0");
        CHECK_CLOSE(r.itl[1], (100.35 - 100.30) / 2, 0, RTOL, "ITL 1");
        CHECK_CLOSE(r.itl[2], 100.45 - 100.35, 0, RTOL, "ITL 2");
    }
    bench_serving_metrics m;
    bench_serving_compute(&r, 1, 1.0, &m);
    CHECK_CLOSE(m.tpot.mean, (r.latency - r.ttft) / 3, 0, RTOL, "TPOT = (E2E - TTFT) / (out - 1)");
    CHECK_CLOSE(m.tpot.mean, 0.0533333333333322, 0, 1e-9, "TPOT recorded");
    bench_request_free(&r);

    /* an error object mid-stream fails the request; HTTP and transport errors too */
    bench_stream_begin(&s, BENCH_API_GENERATE, &r, 0, 5, 8);
    feed(&s, "data: {\"text\":\"A\",\"meta_info\":{\"completion_tokens\":1}}", 0.1);
    feed(&s, "data: {\"error\":{\"message\":\"rank 1 has exited\",\"code\":502}}", 0.2);
    bench_stream_end(&s, 200, NULL, NULL);
    CHECK(!r.ok && r.error && !strcmp(r.error, "rank 1 has exited"), "error event: %s",
          r.error ? r.error : "(none)");
    bench_request_free(&r);
    bench_stream_begin(&s, BENCH_API_GENERATE, &r, 0, 5, 8);
    bench_stream_end(&s, 400, NULL, "{\"error\":{\"message\":\"too long\"}}\n");
    CHECK(!r.ok && r.error && !strncmp(r.error, "HTTP 400: {\"error\"", 18) &&
              !strchr(r.error, '\n'),
          "HTTP error on one line: %s", r.error ? r.error : "(none)");
    bench_request_free(&r);
    bench_stream_begin(&s, BENCH_API_GENERATE, &r, 0, 5, 8);
    feed(&s, "data: {not json", 0.1);
    bench_stream_end(&s, 200, NULL, NULL);
    CHECK(!r.ok && r.error && strstr(r.error, "not a JSON object"), "bad chunk: %s",
          r.error ? r.error : "(none)");
    bench_request_free(&r);
    bench_stream_begin(&s, BENCH_API_GENERATE, &r, 0, 5, 8);
    bench_stream_end(&s, 0, "Couldn't connect to server", NULL);
    CHECK(!r.ok && r.error && !strcmp(r.error, "Couldn't connect to server"), "transport");
    bench_request_free(&r);
}

static void test_stream_openai(void) {
    bench_request r = {0};
    bench_stream s;
    bench_stream_begin(&s, BENCH_API_COMPLETIONS, &r, 10.0, 3, 16);
    feed(&s, "data: {\"choices\":[{\"index\":0,\"text\":\"x\"}],\"usage\":null}", 10.2);
    feed(&s, "data: {\"choices\":[{\"index\":0,\"text\":\"\"}]}", 10.25);
    feed(&s, "data: {\"choices\":[{\"index\":0,\"text\":\"y\",\"finish_reason\":\"length\"}]}",
         10.3);
    feed(&s, "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":2}}",
         10.31);
    feed(&s, "data: [DONE]", 10.32);
    bench_stream_end(&s, 200, NULL, NULL);
    CHECK(r.ok, "completions ok");
    CHECK(r.prompt_len == 9 && r.output_len == 2, "usage chunk counts: %d %d", r.prompt_len,
          r.output_len);
    CHECK_CLOSE(r.ttft, 10.2 - 10.0, 0, RTOL, "completions TTFT");
    CHECK(r.n_itl == 1, "completions: one gap per chunk with text (%d)", r.n_itl);
    if (r.n_itl == 1) CHECK_CLOSE(r.itl[0], 10.3 - 10.2, 0, RTOL, "completions ITL");
    CHECK_CLOSE(r.latency, 10.32 - 10.0, 0, RTOL, "completions E2E");
    bench_request_free(&r);

    /* no usage chunk: the requested output length stands (SGLang's fallback) */
    bench_stream_begin(&s, BENCH_API_COMPLETIONS, &r, 0, 3, 16);
    feed(&s, "data: {\"choices\":[{\"text\":\"x\"}]}", 0.1);
    feed(&s, "data: [DONE]", 0.2);
    bench_stream_end(&s, 200, NULL, NULL);
    CHECK(r.ok && r.output_len == 16 && !r.output_counted && r.prompt_len == 3,
          "fallback counts %d %d", r.output_len, r.prompt_len);
    bench_request_free(&r);

    /* chat: the role chunk has empty content and does not count; reasoning_content counts */
    bench_stream_begin(&s, BENCH_API_CHAT, &r, 0, 3, 16);
    feed(&s, "data: {\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}", 0.05);
    feed(&s, "data: {\"choices\":[{\"delta\":{\"reasoning_content\":\"hm\"}}]}", 0.15);
    feed(&s, "data: {\"choices\":[{\"delta\":{\"content\":\"ok\"}}]}", 0.25);
    feed(&s, "data: {\"choices\":[{\"delta\":{},\"finish_reason\":\"length\"}]}", 0.26);
    feed(&s, "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":13,\"completion_tokens\":2}}",
         0.27);
    feed(&s, "data: [DONE]", 0.28);
    bench_stream_end(&s, 200, NULL, NULL);
    CHECK(r.ok && r.prompt_len == 13 && r.output_len == 2, "chat counts");
    CHECK_CLOSE(r.ttft, 0.15, 0, RTOL, "chat TTFT skips the empty role chunk");
    CHECK(r.n_itl == 1 && fabs(r.itl[0] - 0.10) < 1e-12, "chat ITL");
    CHECK_CLOSE(r.latency, 0.28, 0, RTOL, "chat E2E");
    bench_request_free(&r);
}

static void test_print(void) {
    const double itl0[] = {0.1, 0.1, 0.1, 0.1};
    bench_request r = recorded(0.0, 0.10, 0.50, 10, 5, itl0, 4);
    bench_serving_metrics m;
    bench_serving_compute(&r, 1, 0.5, &m);
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    bench_serving_print(f, &m, "sglang", INFINITY, 0);
    fclose(f);
    static const char *const want[] = {"\n============ Serving Benchmark Result ============\n",
                                       "Backend:                                 sglang    \n",
                                       "Traffic request rate:                    inf       \n",
                                       "Max request concurrency:                 not set   \n",
                                       "Successful requests:                     1         \n",
                                       "Failed requests:                         0         \n",
                                       "Benchmark duration (s):                  0.50      \n",
                                       "Total input tokens:                      10        \n",
                                       "Total generated tokens:                  5         \n",
                                       "Request throughput (req/s):              2.00      \n",
                                       "Input token throughput (tok/s):          20.00     \n",
                                       "Output token throughput (tok/s):         10.00     \n",
                                       "Total token throughput (tok/s):          30.00     \n",
                                       "Concurrency:                             1.00      \n",
                                       "----------------End-to-End Latency----------------\n",
                                       "Mean E2E Latency (ms):                   500.00    \n",
                                       "P90 E2E Latency (ms):                    500.00    \n",
                                       "---------------Time to First Token----------------\n",
                                       "Median TTFT (ms):                        100.00    \n",
                                       "-----Time per Output Token (excl. 1st token)------\n",
                                       "P99 TPOT (ms):                           100.00    \n",
                                       "---------------Inter-Token Latency----------------\n",
                                       "Max ITL (ms):                            100.00    \n",
                                       "\n==================================================\n"};
    for (size_t k = 0; k < sizeof want / sizeof want[0]; k++)
        CHECK(strstr(text, want[k]) != NULL, "result block has \"%s\"", want[k]);
    free(text);
    text = NULL;
    f = open_memstream(&text, &len);
    bench_serving_print(f, &m, "openai", 2.0, 8);
    fclose(f);
    CHECK(strstr(text, "Traffic request rate:                    2.0       \n") != NULL,
          "a rate prints as Python prints 2.0");
    CHECK(strstr(text, "Max request concurrency:                 8         \n") != NULL,
          "concurrency limit");
    free(text);
    bench_request_free(&r);
}

static void check_value(const char *text, const char *want) {
    char out[64] = "";
    int ok = gsm8k_answer_value(text, out, sizeof out);
    if (want)
        CHECK(ok && !strcmp(out, want), "answer of \"%s\": want %s, got %s", text, want,
              ok ? out : "invalid");
    else
        CHECK(!ok, "answer of \"%s\": want invalid, got %s", text, out);
}

static void test_gsm8k(void) {
    check_value("Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs.\n#### 18", "18");
    check_value("The answer is 1,234.", "1234");
    check_value("1,000,000 and then 2", "2");
    check_value("12,34", "1234");
    check_value("a list: 1, 2", "2");
    check_value("It fell to -5 degrees", "5"); /* \d+ has no sign, as in SGLang */
    check_value("3.75", "75");
    check_value("0", "0");
    check_value("00", "0");               /* ast.literal_eval("00") == 0 */
    check_value("the code is 007", NULL); /* ast.literal_eval("007") is a SyntaxError */
    check_value("no number here", NULL);
    check_value("", NULL);
    check_value("x = 42 Question", "42");

    const char *q[] = {"How many?", "How much?"};
    const char *a[] = {"2 + 2 = 4\n#### 4", "#### 7"};
    char *fs = gsm8k_few_shot(q, a, 2);
    CHECK(!strcmp(fs, "Question: How many?\nAnswer: 2 + 2 = 4\n#### 4\n\n"
                      "Question: How much?\nAnswer: #### 7\n\n"),
          "few-shot block: %s", fs);
    bench_buf b = {0};
    bench_buf_append(&b, fs, strlen(fs));
    gsm8k_example(&b, "And now?", NULL);
    CHECK(!strcmp(b.data + strlen(fs), "Question: And now?\nAnswer:"), "question: %s",
          b.data + strlen(fs));
    bench_buf_free(&b);
    free(fs);
    fs = gsm8k_few_shot(q, a, 0);
    CHECK(fs && fs[0] == '\0', "zero shots: empty prefix");
    free(fs);
    CHECK(!strcmp(gsm8k_stop[0], "Question") && !strcmp(gsm8k_stop[1], "Assistant:") &&
              !strcmp(gsm8k_stop[2], "<|separator|>"),
          "stop strings");
}

static void test_datasets(void) {
    bench_rng r;
    bench_rng_init(&r, 42);
    int lens[2000];
    bench_random_lens(&r, lens, 2000, 100, 0.25, 1);
    int lo = 1000, hi = 0;
    for (int i = 0; i < 2000; i++) {
        if (lens[i] < lo) lo = lens[i];
        if (lens[i] > hi) hi = lens[i];
    }
    CHECK(lo == 25 && hi == 100, "lengths cover [int(100 * 0.25), 100]: %d..%d", lo, hi);
    bench_random_lens(&r, lens, 100, 7, 0.0, 1);
    lo = 1000;
    for (int i = 0; i < 100; i++)
        if (lens[i] < lo) lo = lens[i];
    CHECK(lo >= 1, "input lengths at least 1");
    bench_random_lens(&r, lens, 10, 50, 1.0, 0);
    int same = 1;
    for (int i = 0; i < 10; i++)
        same &= lens[i] == 50;
    CHECK(same, "range ratio 1: every length is L");

    bench_rng_init(&r, 7);
    bench_prompt *p = bench_dataset_random_ids(&r, 5, 40, 16, 1.0, 2048);
    int ok = 1;
    for (int i = 0; i < 5; i++) {
        ok &= p[i].n_ids == 40 && p[i].prompt_len == 40 && p[i].output_len == 16 && !p[i].text;
        for (int j = 0; j + 1 < p[i].n_ids; j++)
            ok &= p[i].ids[j + 1] == (p[i].ids[j] + 1) % 2048 && p[i].ids[j] < 2048;
    }
    CHECK(ok, "random-ids: runs of consecutive ids below the vocabulary size");
    bench_rng r2;
    bench_rng_init(&r2, 7);
    bench_prompt *p2 = bench_dataset_random_ids(&r2, 5, 40, 16, 1.0, 2048);
    CHECK(!memcmp(p[3].ids, p2[3].ids, 40 * sizeof(int)), "the same seed gives the same ids");
    bench_prompts_free(p, 5);
    bench_prompts_free(p2, 5);

    p = bench_dataset_random_text(&r, 3, 12, 8, 1.0, NULL);
    ok = 1;
    for (int i = 0; i < 3; i++) {
        int words = 1;
        for (const char *c = p[i].text; *c; c++)
            words += *c == ' ';
        ok &= words == 12 && p[i].prompt_len == 12 && p[i].output_len == 8 && !p[i].ids;
    }
    CHECK(ok, "random text: 12 words each");
    bench_prompts_free(p, 3);
}

int main(void) {
    test_summaries();
    test_serving_metrics();
    test_stream_generate();
    test_stream_openai();
    test_print();
    test_gsm8k();
    test_datasets();
    CHECK_SUMMARY();
}
