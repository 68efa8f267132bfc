/* The serving benchmark's arithmetic (see stats.h). Where numpy's rounding could differ from a
 * plain loop (its pairwise sum, its interpolation that counts from the nearer end), this follows
 * numpy, so that the figures match SGLang's to the last printed digit. */
#include "scripts/bench/stats.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "scripts/bench/util.h"

void bench_request_add_itl(bench_request *r, double gap) {
    if (r->n_itl == r->cap_itl) {
        r->cap_itl = r->cap_itl ? 2 * r->cap_itl : 64;
        r->itl = bench_realloc(r->itl, (size_t)r->cap_itl * sizeof *r->itl);
    }
    r->itl[r->n_itl++] = gap;
}

void bench_request_free(bench_request *r) {
    free(r->itl);
    free(r->error);
    *r = (bench_request){0};
}

/* numpy's pairwise_sum for float64: blocks of 8 partial sums up to 128 values, halves above */
double bench_sum(const double *v, int n) {
    if (n < 8) {
        double s = 0.0;
        for (int i = 0; i < n; i++)
            s += v[i];
        return s;
    }
    if (n <= 128) {
        double r[8];
        for (int k = 0; k < 8; k++)
            r[k] = v[k];
        int i;
        for (i = 8; i < n - (n % 8); i += 8)
            for (int k = 0; k < 8; k++)
                r[k] += v[i + k];
        double s = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for (; i < n; i++)
            s += v[i];
        return s;
    }
    int n2 = n / 2;
    n2 -= n2 % 8;
    return bench_sum(v, n2) + bench_sum(v + n2, n - n2);
}

double bench_percentile_sorted(const double *sorted, int n, double q) {
    double vi = q / 100.0 * (double)(n - 1);
    double lo_f = floor(vi);
    int lo = (int)lo_f;
    int hi = lo + 1 < n ? lo + 1 : n - 1;
    if (lo > n - 1) lo = n - 1;
    double t = vi - lo_f;
    double a = sorted[lo], b = sorted[hi], diff = b - a;
    /* numpy's _lerp: from the lower end below one half, from the upper end at and above it */
    return t >= 0.5 ? b - diff * (1.0 - t) : a + diff * t;
}

static int bench_cmp_double(const void *x, const void *y) {
    double a = *(const double *)x, b = *(const double *)y;
    return (a > b) - (a < b);
}

void bench_summarize(const double *v, int n, bench_summary *out) {
    *out = (bench_summary){0};
    if (n <= 0) return;
    double *s = bench_malloc((size_t)n * sizeof *s);
    memcpy(s, v, (size_t)n * sizeof *s);
    qsort(s, (size_t)n, sizeof *s, bench_cmp_double);
    out->mean = bench_sum(v, n) / n;
    double *dev = bench_malloc((size_t)n * sizeof *dev);
    for (int i = 0; i < n; i++) {
        double d = v[i] - out->mean;
        dev[i] = d * d;
    }
    out->std = sqrt(bench_sum(dev, n) / n);
    free(dev);
    out->median = n % 2 ? s[n / 2] : (s[n / 2 - 1] + s[n / 2]) / 2.0;
    out->p90 = bench_percentile_sorted(s, n, 90);
    out->p95 = bench_percentile_sorted(s, n, 95);
    out->p99 = bench_percentile_sorted(s, n, 99);
    out->max = s[n - 1];
    free(s);
}

void bench_serving_compute(const bench_request *reqs, int n, double duration,
                           bench_serving_metrics *m) {
    *m = (bench_serving_metrics){.duration = duration};
    double *e2e = bench_malloc((size_t)(n + 1) * sizeof *e2e);
    double *ttft = bench_malloc((size_t)(n + 1) * sizeof *ttft);
    double *tpot = bench_malloc((size_t)(n + 1) * sizeof *tpot);
    int n_tpot = 0;
    long n_itl = 0;
    for (int i = 0; i < n; i++)
        if (reqs[i].ok) n_itl += reqs[i].n_itl;
    double *itl = bench_malloc((size_t)(n_itl + 1) * sizeof *itl);
    n_itl = 0;
    double first_start = 0, last_end = 0;
    for (int i = 0; i < n; i++) {
        const bench_request *r = &reqs[i];
        if (!r->ok) {
            if (!m->failed) m->first_error = r->error;
            m->failed++;
            continue;
        }
        if (!m->completed || r->start < first_start) first_start = r->start;
        if (!m->completed || r->start + r->latency > last_end) last_end = r->start + r->latency;
        m->total_input += r->prompt_len;
        m->total_output += r->output_len;
        if (r->output_len > 1) tpot[n_tpot++] = (r->latency - r->ttft) / (r->output_len - 1);
        if (r->n_itl) memcpy(itl + n_itl, r->itl, (size_t)r->n_itl * sizeof *itl);
        n_itl += r->n_itl;
        ttft[m->completed] = r->ttft;
        e2e[m->completed] = r->latency;
        m->completed++;
    }
    if (duration > 0) {
        m->request_throughput = m->completed / duration;
        m->input_throughput = m->total_input / duration;
        m->output_throughput = m->total_output / duration;
        m->total_throughput = (m->total_input + m->total_output) / duration;
        m->concurrency = bench_sum(e2e, m->completed) / duration;
    }
    bench_summarize(e2e, m->completed, &m->e2e);
    bench_summarize(ttft, m->completed, &m->ttft);
    bench_summarize(tpot, n_tpot, &m->tpot);
    bench_summarize(itl, (int)n_itl, &m->itl);

    /* Per-second peaks, as SGLang counts them: one token at start + ttft, one more at each
     * inter-token gap after it; a request is running in every second from its start to its end. */
    if (m->completed) {
        int seconds = (int)ceil(last_end - first_start) + 1;
        double *tokens = calloc((size_t)seconds, sizeof *tokens);
        int *running = calloc((size_t)seconds, sizeof *running);
        if (!tokens || !running) bench_die("out of memory");
        for (int i = 0; i < n; i++) {
            const bench_request *r = &reqs[i];
            if (!r->ok) continue;
            double t = r->start + r->ttft;
            for (int k = -1; k < r->n_itl; k++) {
                if (k >= 0) t += r->itl[k];
                int b = (int)(t - first_start);
                if (b >= 0 && b < seconds) tokens[b] += 1;
            }
            int s0 = (int)(r->start - first_start), s1 = (int)(r->start + r->latency - first_start);
            for (int s = s0; s <= s1 && s < seconds; s++)
                running[s]++;
        }
        for (int s = 0; s < seconds; s++) {
            if (tokens[s] > m->peak_output_throughput) m->peak_output_throughput = tokens[s];
            if (running[s] > m->peak_concurrent) m->peak_concurrent = running[s];
        }
        free(tokens);
        free(running);
    }
    free(e2e);
    free(ttft);
    free(tpot);
    free(itl);
}

void bench_print_centered(FILE *f, const char *s, int n, char c) {
    int len = (int)strlen(s);
    int pad = n > len ? n - len : 0;
    int left = pad / 2;
    for (int i = 0; i < left; i++)
        fputc(c, f);
    fputs(s, f);
    for (int i = left; i < pad; i++)
        fputc(c, f);
    fputc('\n', f);
}

static void bench_line_f(FILE *f, const char *label, double v) {
    fprintf(f, "%-40s %-10.2f\n", label, v);
}

static void bench_line_d(FILE *f, const char *label, long v) {
    fprintf(f, "%-40s %-10ld\n", label, v);
}

static void bench_line_s(FILE *f, const char *label, const char *v) {
    fprintf(f, "%-40s %-10s\n", label, v);
}

/* mean, median, P90, P95, P99 (and max) of one latency, in milliseconds */
static void bench_print_latency(FILE *f, const char *title, const char *name,
                                const bench_summary *s, int with_max) {
    char label[64];
    bench_print_centered(f, title, 50, '-');
    snprintf(label, sizeof label, "Mean %s (ms):", name);
    bench_line_f(f, label, s->mean * 1000);
    snprintf(label, sizeof label, "Median %s (ms):", name);
    bench_line_f(f, label, s->median * 1000);
    snprintf(label, sizeof label, "P90 %s (ms):", name);
    bench_line_f(f, label, s->p90 * 1000);
    snprintf(label, sizeof label, "P95 %s (ms):", name);
    bench_line_f(f, label, s->p95 * 1000);
    snprintf(label, sizeof label, "P99 %s (ms):", name);
    bench_line_f(f, label, s->p99 * 1000);
    if (with_max) {
        snprintf(label, sizeof label, "Max %s (ms):", name);
        bench_line_f(f, label, s->max * 1000);
    }
}

void bench_serving_print(FILE *f, const bench_serving_metrics *m, const char *backend,
                         double request_rate, int max_concurrency) {
    char v[64];
    fputc('\n', f);
    bench_print_centered(f, " Serving Benchmark Result ", 50, '=');
    bench_line_s(f, "Backend:", backend);
    if (request_rate <= 0 || isinf(request_rate))
        snprintf(v, sizeof v, "inf");
    else if (request_rate == floor(request_rate) && request_rate < 1e15)
        snprintf(v, sizeof v, "%.1f", request_rate); /* Python's str(2.0) */
    else
        snprintf(v, sizeof v, "%g", request_rate);
    bench_line_s(f, "Traffic request rate:", v);
    if (max_concurrency > 0)
        snprintf(v, sizeof v, "%d", max_concurrency);
    else
        snprintf(v, sizeof v, "not set");
    bench_line_s(f, "Max request concurrency:", v);
    bench_line_d(f, "Successful requests:", m->completed);
    bench_line_d(f, "Failed requests:", m->failed);
    bench_line_f(f, "Benchmark duration (s):", m->duration);
    bench_line_d(f, "Total input tokens:", m->total_input);
    bench_line_d(f, "Total generated tokens:", m->total_output);
    bench_line_f(f, "Request throughput (req/s):", m->request_throughput);
    bench_line_f(f, "Input token throughput (tok/s):", m->input_throughput);
    bench_line_f(f, "Output token throughput (tok/s):", m->output_throughput);
    bench_line_f(f, "Peak output token throughput (tok/s):", m->peak_output_throughput);
    bench_line_d(f, "Peak concurrent requests:", m->peak_concurrent);
    bench_line_f(f, "Total token throughput (tok/s):", m->total_throughput);
    bench_line_f(f, "Concurrency:", m->concurrency);
    bench_print_latency(f, "End-to-End Latency", "E2E Latency", &m->e2e, 0);
    bench_print_latency(f, "Time to First Token", "TTFT", &m->ttft, 0);
    bench_print_latency(f, "Time per Output Token (excl. 1st token)", "TPOT", &m->tpot, 0);
    bench_print_latency(f, "Inter-Token Latency", "ITL", &m->itl, 1);
    for (int i = 0; i < 50; i++)
        fputc('=', f);
    fputc('\n', f);
}
