/* The arithmetic of the serving benchmark, as SGLang's bench_serving does it (calculate_metrics):
 * per request E2E latency, TTFT, TPOT excluding the first token and the inter-token latencies;
 * over the run mean, median, standard deviation, P90 / P95 / P99 (numpy's default linear
 * interpolation) and max, token totals, throughputs, concurrency and the per-second peaks; and
 * the "Serving Benchmark Result" block. Pure computation on recorded timings: no I/O but the
 * printing, so the unit tests drive it with numbers written down by hand. */
#ifndef MOESERVE_BENCH_STATS_H
#define MOESERVE_BENCH_STATS_H

#include <stdio.h>

/* One request as the client saw it. Times are seconds; start is counted from the run's start. */
typedef struct {
    int ok;         /* HTTP 200 and a stream that ended cleanly */
    char *error;    /* what went wrong (owned), NULL when ok */
    double start;   /* when the request was sent */
    double ttft;    /* from start to the first chunk that carried text */
    double latency; /* from start to the last line of the stream (E2E) */
    double *itl;    /* gaps between the later text chunks, spread over the tokens they add */
    int n_itl, cap_itl;
    int prompt_len;                     /* prompt tokens: the server's count where it gave one */
    int output_len;                     /* output tokens: the server's count where it gave one */
    int prompt_counted, output_counted; /* the server gave prompt_len / output_len */
} bench_request;

void bench_request_add_itl(bench_request *r, double gap);
void bench_request_free(bench_request *r);

/* mean, median, population std, percentiles and max of a list of values (same unit in and out) */
typedef struct {
    double mean, median, std, p90, p95, p99, max;
} bench_summary;

/* numpy.percentile(v, q) with the default "linear" method over ascending sorted values
 * (n >= 1, q in [0, 100]). */
double bench_percentile_sorted(const double *sorted, int n, double q);
/* numpy's sum (pairwise, as numpy adds a float64 array) */
double bench_sum(const double *v, int n);
/* Summary of n values (copied and sorted inside); n == 0 gives all zeros, as SGLang's `or 0`. */
void bench_summarize(const double *v, int n, bench_summary *out);

typedef struct {
    int completed, failed;
    long total_input, total_output;
    double duration; /* seconds, from the first request sent to the last one finished */
    double request_throughput, input_throughput, output_throughput, total_throughput;
    double concurrency;                 /* sum of E2E latencies / duration */
    double peak_output_throughput;      /* most output tokens seen in one whole second of the run */
    int peak_concurrent;                /* most requests running during one second */
    bench_summary e2e, ttft, tpot, itl; /* seconds */
    const char *first_error;            /* the first failed request's error (borrowed), or NULL */
} bench_serving_metrics;

/* Fold n requests of a run that took duration seconds. Failed requests count only in failed. */
void bench_serving_compute(const bench_request *reqs, int n, double duration,
                           bench_serving_metrics *m);

/* The "Serving Benchmark Result" block with SGLang's labels and widths (milliseconds for
 * latencies). request_rate <= 0 or infinite prints "inf"; max_concurrency 0 prints "not set". */
void bench_serving_print(FILE *f, const bench_serving_metrics *m, const char *backend,
                         double request_rate, int max_concurrency);

/* s centred in n columns, padded with c as Python's "{:c^n}" does (extra pad on the right) */
void bench_print_centered(FILE *f, const char *s, int n, char c);

#endif
