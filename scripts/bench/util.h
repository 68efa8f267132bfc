/* Small helpers of moeserve-bench: checked allocation, a growable byte buffer, the monotonic
 * clock, a seeded random number generator, JSONL reading and the progress bar on stderr.
 * Nothing here talks HTTP, so the unit tests link it as it is. */
#ifndef MOESERVE_BENCH_UTIL_H
#define MOESERVE_BENCH_UTIL_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include <cjson/cJSON.h>

/* A failure the user can fix (bad flag, missing file): message on stderr, exit status 2. */
void bench_die(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));

/* Out of memory is fatal with file:line. */
void *bench_malloc_at(size_t n, const char *file, int line);
void *bench_realloc_at(void *p, size_t n, const char *file, int line);
char *bench_strdup_at(const char *s, const char *file, int line);
#define bench_malloc(n)     bench_malloc_at((n), __FILE__, __LINE__)
#define bench_realloc(p, n) bench_realloc_at((p), (n), __FILE__, __LINE__)
#define bench_strdup(s)     bench_strdup_at((s), __FILE__, __LINE__)

/* Bytes that grow; data is always NUL-terminated (data may be NULL while len is 0). */
typedef struct {
    char *data;
    size_t len, cap;
} bench_buf;

void bench_buf_append(bench_buf *b, const void *p, size_t n);
void bench_buf_appendf(bench_buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void bench_buf_free(bench_buf *b);

/* Seconds on the monotonic clock (the client's perf_counter). */
double bench_now(void);

/* xoshiro256** seeded through splitmix64: the same seed gives the same draws on every machine.
 * (The draws are not numpy's: prompt lengths and arrival gaps follow the same distributions as
 * SGLang's bench_serving, not the same numbers.) */
typedef struct {
    uint64_t s[4];
} bench_rng;

void bench_rng_init(bench_rng *r, uint64_t seed);
uint64_t bench_rng_next(bench_rng *r);
double bench_rng_uniform(bench_rng *r);                  /* [0, 1) */
long bench_rng_int(bench_rng *r, long lo, long hi);      /* lo..hi, both included; lo <= hi */
double bench_rng_exponential(bench_rng *r, double mean); /* gap of a Poisson process */

/* Every non-blank line of a JSONL file, parsed; *n_out gets the count. A line that is not a JSON
 * object stops the program with the file name and line number. */
cJSON **bench_jsonl_read(const char *path, int *n_out);
void bench_jsonl_free(cJSON **rows, int n);

/* Command-line flags: "--name VALUE" or "--name=VALUE" at argv[*i]. Returns the value (and moves
 * *i past it), or NULL when argv[*i] is another flag; a missing value stops the program. */
const char *bench_flag(int argc, char **argv, int *i, const char *name);
/* The value of a flag as a number; anything else (or below min) stops the program naming it. */
long bench_flag_long(const char *name, const char *v, long min);
double bench_flag_double(const char *name, const char *v, double min);

/* A base URL as the client uses it: "http://" added when no scheme is given, trailing '/' cut. */
char *bench_base_url(const char *url);

/* A progress bar on stderr, drawn only when stderr is a terminal and enabled is set. */
typedef struct {
    int enabled;
    int total, done, failed;
    double t0, last_draw;
    const char *what;
} bench_progress;

void bench_progress_start(bench_progress *p, int total, const char *what, int enabled);
void bench_progress_tick(bench_progress *p, int ok);
void bench_progress_end(bench_progress *p);

#endif
