/* Prometheus text exposition (format 0.0.4) of the server's counters and histograms.
 * Buckets reach down to a millisecond: on the CPU a small model answers in milliseconds, and the
 * same buckets still cover a large model's seconds. One mutex guards every series; it is held
 * only for a few additions. */
#include "server/metrics.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"

#define METRICS_MAX_BUCKETS 24

typedef struct {
    const char *name;
    const char *help;
    int n_bounds;
    const double *bounds;
    uint64_t counts[METRICS_MAX_BUCKETS + 1]; /* per bucket, not cumulative; last = +Inf */
    double sum;
    uint64_t count;
} metrics_histogram;

static const double metrics_ttft_bounds[] = {
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160};
static const double metrics_itl_bounds[] = {0.0005, 0.001, 0.002, 0.004, 0.006, 0.008, 0.01,
                                            0.015,  0.02,  0.025, 0.03,  0.04,  0.05,  0.075,
                                            0.1,    0.15,  0.2,   0.3,   0.5,   1,     2};
static const double metrics_e2e_bounds[] = {0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1,   2.5, 5,
                                            10,   20,    40,   80,  160,  320, 640, 1280};

#define METRICS_N(a) ((int)(sizeof(a) / sizeof((a)[0])))

enum { METRICS_HTTP_2XX, METRICS_HTTP_4XX, METRICS_HTTP_5XX, METRICS_HTTP_CLASSES };

struct metrics {
    pthread_mutex_t mu;
    char *model_name;
    metrics_histogram ttft, itl, e2e;
    uint64_t finished[5]; /* by finish_kind */
    uint64_t http[METRICS_HTTP_CLASSES];
};

metrics *metrics_create(const char *model_name) {
    metrics *m = xcalloc(1, sizeof *m);
    pthread_mutex_init(&m->mu, NULL);
    /* a label value: backslash, quote and newline escaped */
    m->model_name = xmalloc(2 * strlen(model_name) + 1);
    char *o = m->model_name;
    for (const char *c = model_name; *c; c++) {
        if (*c == '\\' || *c == '"') *o++ = '\\';
        if (*c == '\n') {
            *o++ = '\\';
            *o++ = 'n';
        } else {
            *o++ = *c;
        }
    }
    *o = '\0';
    m->ttft = (metrics_histogram){.name = "moeserve:time_to_first_token_seconds",
                                  .help = "Time from submission to the first output token.",
                                  .n_bounds = METRICS_N(metrics_ttft_bounds),
                                  .bounds = metrics_ttft_bounds};
    m->itl = (metrics_histogram){.name = "moeserve:inter_token_latency_seconds",
                                 .help = "Time between two output tokens of a request.",
                                 .n_bounds = METRICS_N(metrics_itl_bounds),
                                 .bounds = metrics_itl_bounds};
    m->e2e = (metrics_histogram){.name = "moeserve:e2e_request_latency_seconds",
                                 .help = "Time from arrival to the last output token.",
                                 .n_bounds = METRICS_N(metrics_e2e_bounds),
                                 .bounds = metrics_e2e_bounds};
    return m;
}

void metrics_free(metrics *m) {
    if (!m) return;
    pthread_mutex_destroy(&m->mu);
    free(m->model_name);
    free(m);
}

static void metrics_histogram_add(metrics_histogram *h, double v) {
    int b = 0;
    while (b < h->n_bounds && v > h->bounds[b])
        b++;
    h->counts[b]++;
    h->sum += v;
    h->count++;
}

void metrics_observe_ttft(metrics *m, double seconds) {
    pthread_mutex_lock(&m->mu);
    metrics_histogram_add(&m->ttft, seconds);
    pthread_mutex_unlock(&m->mu);
}

void metrics_observe_itl(metrics *m, double seconds) {
    pthread_mutex_lock(&m->mu);
    metrics_histogram_add(&m->itl, seconds);
    pthread_mutex_unlock(&m->mu);
}

void metrics_observe_request(metrics *m, double e2e_seconds, finish_kind finish) {
    pthread_mutex_lock(&m->mu);
    metrics_histogram_add(&m->e2e, e2e_seconds);
    if ((int)finish >= 0 && (int)finish < 5) m->finished[finish]++;
    pthread_mutex_unlock(&m->mu);
}

void metrics_count_http(metrics *m, int status) {
    pthread_mutex_lock(&m->mu);
    m->http[status >= 500   ? METRICS_HTTP_5XX
            : status >= 400 ? METRICS_HTTP_4XX
                            : METRICS_HTTP_2XX]++;
    pthread_mutex_unlock(&m->mu);
}

typedef struct {
    char *data;
    size_t len, cap;
} metrics_text;

static void metrics_printf(metrics_text *t, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
static void metrics_printf(metrics_text *t, const char *fmt, ...) {
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(t->data + t->len, t->cap - t->len, fmt, ap);
        va_end(ap);
        if (n < 0) return;
        if ((size_t)n < t->cap - t->len) {
            t->len += (size_t)n;
            return;
        }
        t->cap = t->cap * 2 + (size_t)n;
        t->data = xrealloc(t->data, t->cap);
    }
}

static void metrics_head(metrics_text *t, const char *name, const char *type, const char *help) {
    metrics_printf(t, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

static void metrics_one(metrics_text *t, const metrics *m, const char *name, const char *type,
                        const char *help, double v) {
    metrics_head(t, name, type, help);
    metrics_printf(t, "%s{model_name=\"%s\"} %.17g\n", name, m->model_name, v);
}

static void metrics_histogram_print(metrics_text *t, const metrics *m, const metrics_histogram *h) {
    metrics_head(t, h->name, "histogram", h->help);
    uint64_t cum = 0;
    for (int b = 0; b < h->n_bounds; b++) {
        cum += h->counts[b];
        metrics_printf(t, "%s_bucket{model_name=\"%s\",le=\"%g\"} %llu\n", h->name, m->model_name,
                       h->bounds[b], (unsigned long long)cum);
    }
    cum += h->counts[h->n_bounds];
    metrics_printf(t, "%s_bucket{model_name=\"%s\",le=\"+Inf\"} %llu\n", h->name, m->model_name,
                   (unsigned long long)cum);
    metrics_printf(t, "%s_sum{model_name=\"%s\"} %.17g\n", h->name, m->model_name, h->sum);
    metrics_printf(t, "%s_count{model_name=\"%s\"} %llu\n", h->name, m->model_name,
                   (unsigned long long)h->count);
}

char *metrics_render(metrics *m, const scheduler_stats *st, size_t *len) {
    metrics_text t = {.data = xmalloc(8192), .cap = 8192};
    t.data[0] = '\0';
    scheduler_stats zero = {0};
    if (!st) st = &zero;
    pthread_mutex_lock(&m->mu);
    metrics_one(&t, m, "moeserve:num_running_reqs", "gauge", "Requests in the running batch.",
                st->n_running);
    metrics_one(&t, m, "moeserve:num_queue_reqs", "gauge",
                "Requests waiting to be admitted (the queue).", st->n_waiting);
    metrics_one(&t, m, "moeserve:kv_pages_used", "gauge",
                "KV cache pages held by running requests or the prefix cache.", st->kv_pages_used);
    metrics_one(&t, m, "moeserve:kv_pages_total", "gauge", "KV cache pages in the pool.",
                st->kv_pages_total);
    metrics_one(&t, m, "moeserve:token_usage", "gauge", "Fraction of the KV cache pages in use.",
                st->kv_pages_total ? (double)st->kv_pages_used / st->kv_pages_total : 0.0);
    metrics_one(&t, m, "moeserve:gen_throughput", "gauge",
                "Output tokens per second over the last few seconds.", st->last_gen_throughput);
    metrics_one(&t, m, "moeserve:prompt_tokens_total", "counter",
                "Prompt tokens of finished requests.", (double)st->n_prompt_tokens);
    metrics_one(&t, m, "moeserve:generation_tokens_total", "counter",
                "Output tokens of finished requests.", (double)st->n_generated_tokens);
    metrics_one(&t, m, "moeserve:cached_tokens_total", "counter",
                "Prompt tokens whose KV came from the prefix cache.", (double)st->n_cached_tokens);
    metrics_one(&t, m, "moeserve:num_preemptions_total", "counter",
                "Requests preempted (pages freed, recomputed later).", (double)st->n_preemptions);
    metrics_one(&t, m, "moeserve:num_requests_total", "counter",
                "Generation requests the scheduler finished.", (double)st->n_requests_done);
    metrics_one(&t, m, "moeserve:engine_steps_total", "counter", "Scheduler steps run.",
                (double)st->n_steps);
    metrics_one(&t, m, "moeserve:scheduler_seconds_total", "counter",
                "Time in the scheduler outside forward passes.", st->step_sched_seconds);
    metrics_one(&t, m, "moeserve:forward_seconds_total", "counter", "Time in forward passes.",
                st->step_forward_seconds);
    metrics_one(&t, m, "moeserve:sample_seconds_total", "counter",
                "Time scoring and sampling after forward passes (part of the scheduler time).",
                st->step_sample_seconds);

    const char *name = "moeserve:finished_requests_total";
    metrics_head(&t, name, "counter", "Answered generation requests by finish reason.");
    const uint64_t by_reason[3] = {m->finished[FINISH_STOP_TOKEN] + m->finished[FINISH_STOP_STRING],
                                   m->finished[FINISH_LENGTH], m->finished[FINISH_ABORT]};
    static const char *const reasons[3] = {"stop", "length", "abort"};
    for (int i = 0; i < 3; i++)
        metrics_printf(&t, "%s{model_name=\"%s\",reason=\"%s\"} %llu\n", name, m->model_name,
                       reasons[i], (unsigned long long)by_reason[i]);
    name = "moeserve:http_responses_total";
    metrics_head(&t, name, "counter", "HTTP answers by status class.");
    static const char *const classes[] = {"2xx", "4xx", "5xx"};
    for (int i = 0; i < METRICS_HTTP_CLASSES; i++)
        metrics_printf(&t, "%s{model_name=\"%s\",status=\"%s\"} %llu\n", name, m->model_name,
                       classes[i], (unsigned long long)m->http[i]);

    metrics_histogram_print(&t, m, &m->ttft);
    metrics_histogram_print(&t, m, &m->itl);
    metrics_histogram_print(&t, m, &m->e2e);
    pthread_mutex_unlock(&m->mu);
    *len = t.len;
    return t.data;
}
