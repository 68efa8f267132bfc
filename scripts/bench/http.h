/* The HTTP client of moeserve-bench: one thread drives every request through libcurl's multi
 * interface, so hundreds of streams run at once without a thread each, and every line of every
 * stream is stamped with the clock when it is read.
 *
 * A run is a list of jobs (POST path + JSON body). Each job may start once its arrival time has
 * come and fewer than max_concurrency jobs are running; jobs start in list order. A starting job
 * goes to the URL with the fewest jobs running (ties in turn), so requests are spread over the
 * ranks' URLs. Connections are kept and reused. */
#ifndef MOESERVE_BENCH_HTTP_H
#define MOESERVE_BENCH_HTTP_H

#include "scripts/bench/util.h"

typedef struct bench_http_job bench_http_job;

struct bench_http_job {
    /* set by the caller */
    const char *path; /* "/generate" */
    char *body;       /* JSON (owned by the caller) */
    double arrival;   /* seconds after the run's start before which the job does not start */
    void *user;
    /* set by the run */
    int url_index;
    double t_start;         /* clock time when the request was handed to curl */
    long status;            /* HTTP status, 0 when none came */
    const char *error;      /* transport error, NULL when none (valid in on_done) */
    bench_buf body_in;      /* the answer (non-200 answers, or all of it without on_line) */
    bench_buf partial_line; /* a stream line not yet complete */
    void *easy;             /* CURL * */
};

typedef struct {
    const char *const *urls; /* base URLs, "http://host:port" */
    int n_urls;
    int max_concurrency; /* 0: no limit */
    double timeout_s;    /* whole request; 0: none */
    const char *api_key; /* sent as "Authorization: Bearer KEY" when set */
    /* With on_line, a 200 answer is handed over line by line (blanks stripped, empty lines
     * skipped) and not kept; without it, the whole answer is kept in body_in. */
    void (*on_start)(bench_http_job *job, double now);
    void (*on_line)(bench_http_job *job, const char *line, size_t len, double now);
    /* Called once per job when it ends; returns 1 when the job succeeded (for the progress). */
    int (*on_done)(bench_http_job *job, double now);
    bench_progress *progress;
} bench_http_opts;

/* Runs the jobs; arrival times count from t0 (a clock time). Returns when every job has ended. */
void bench_http_run(const bench_http_opts *o, bench_http_job *jobs, int n, double t0);

/* One blocking GET of url: the body into out (appended), the status returned, 0 with err filled
 * (errlen bytes) when no answer came. */
long bench_http_get(const char *url, const char *api_key, double timeout_s, bench_buf *out,
                    char *err, size_t errlen);

/* The first model id of GET url/v1/models (a fresh string); stops the program when there is none.
 */
char *bench_http_model_id(const char *url, const char *api_key);

/* curl_global_init once, and the file limit raised for many connections. */
void bench_http_global_init(void);

#endif
