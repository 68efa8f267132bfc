/* Helpers of moeserve-bench (see util.h). */
#include "scripts/bench/util.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

void bench_die(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "moeserve-bench: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    exit(2);
}

void *bench_malloc_at(size_t n, const char *file, int line) {
    void *p = malloc(n ? n : 1);
    if (!p) {
        fprintf(stderr, "%s:%d: out of memory (%zu bytes)\n", file, line, n);
        abort();
    }
    return p;
}

void *bench_realloc_at(void *p, size_t n, const char *file, int line) {
    void *q = realloc(p, n ? n : 1);
    if (!q) {
        fprintf(stderr, "%s:%d: out of memory (%zu bytes)\n", file, line, n);
        abort();
    }
    return q;
}

char *bench_strdup_at(const char *s, const char *file, int line) {
    size_t n = strlen(s) + 1;
    char *d = bench_malloc_at(n, file, line);
    memcpy(d, s, n);
    return d;
}

static void bench_buf_reserve(bench_buf *b, size_t extra) {
    if (b->len + extra + 1 <= b->cap) return;
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->len + extra + 1)
        cap *= 2;
    b->data = bench_realloc(b->data, cap);
    b->cap = cap;
}

void bench_buf_append(bench_buf *b, const void *p, size_t n) {
    bench_buf_reserve(b, n);
    if (n) memcpy(b->data + b->len, p, n);
    b->len += n;
    b->data[b->len] = '\0';
}

void bench_buf_appendf(bench_buf *b, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    char small[256];
    int n = vsnprintf(small, sizeof small, fmt, ap);
    va_end(ap);
    if (n < 0) return;
    if ((size_t)n < sizeof small) {
        bench_buf_append(b, small, (size_t)n);
        return;
    }
    bench_buf_reserve(b, (size_t)n);
    va_start(ap, fmt);
    vsnprintf(b->data + b->len, (size_t)n + 1, fmt, ap);
    va_end(ap);
    b->len += (size_t)n;
}

void bench_buf_free(bench_buf *b) {
    free(b->data);
    b->data = NULL;
    b->len = b->cap = 0;
}

double bench_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static uint64_t bench_splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

void bench_rng_init(bench_rng *r, uint64_t seed) {
    uint64_t x = seed;
    for (int i = 0; i < 4; i++)
        r->s[i] = bench_splitmix64(&x);
}

static uint64_t bench_rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

uint64_t bench_rng_next(bench_rng *r) {
    uint64_t *s = r->s;
    uint64_t out = bench_rotl(s[1] * 5, 7) * 9;
    uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = bench_rotl(s[3], 45);
    return out;
}

double bench_rng_uniform(bench_rng *r) { return (double)(bench_rng_next(r) >> 11) * 0x1.0p-53; }

long bench_rng_int(bench_rng *r, long lo, long hi) {
    uint64_t span = (uint64_t)(hi - lo) + 1;
    /* rejection keeps every value equally likely */
    uint64_t limit = UINT64_MAX - UINT64_MAX % span;
    uint64_t x;
    do {
        x = bench_rng_next(r);
    } while (x >= limit);
    return lo + (long)(x % span);
}

double bench_rng_exponential(bench_rng *r, double mean) {
    return -mean * log1p(-bench_rng_uniform(r));
}

cJSON **bench_jsonl_read(const char *path, int *n_out) {
    FILE *f = fopen(path, "rb");
    if (!f) bench_die("cannot open %s: %s", path, strerror(errno));
    cJSON **rows = NULL;
    int n = 0, cap = 0, lineno = 0;
    char *line = NULL;
    size_t line_cap = 0;
    ssize_t len;
    while ((len = getline(&line, &line_cap, f)) >= 0) {
        lineno++;
        ssize_t i = 0;
        while (i < len && (line[i] == ' ' || line[i] == '\t' || line[i] == '\r' || line[i] == '\n'))
            i++;
        if (i == len) continue;
        cJSON *row = cJSON_Parse(line);
        if (!cJSON_IsObject(row)) bench_die("%s:%d: not a JSON object", path, lineno);
        if (n == cap) {
            cap = cap ? 2 * cap : 256;
            rows = bench_realloc(rows, (size_t)cap * sizeof *rows);
        }
        rows[n++] = row;
    }
    free(line);
    fclose(f);
    *n_out = n;
    return rows;
}

void bench_jsonl_free(cJSON **rows, int n) {
    for (int i = 0; i < n; i++)
        cJSON_Delete(rows[i]);
    free(rows);
}

const char *bench_flag(int argc, char **argv, int *i, const char *name) {
    const char *a = argv[*i];
    size_t n = strlen(name);
    if (strncmp(a, name, n) != 0) return NULL;
    if (a[n] == '=') return a + n + 1;
    if (a[n] != '\0') return NULL;
    if (*i + 1 >= argc) bench_die("%s needs a value (--help lists the flags)", name);
    return argv[++*i];
}

long bench_flag_long(const char *name, const char *v, long min) {
    char *end;
    errno = 0;
    long x = strtol(v, &end, 10);
    if (errno || end == v || *end || x < min)
        bench_die("%s: '%s' is not a whole number of at least %ld", name, v, min);
    return x;
}

double bench_flag_double(const char *name, const char *v, double min) {
    char *end;
    errno = 0;
    double x = strtod(v, &end);
    if (errno || end == v || *end || !(x >= min))
        bench_die("%s: '%s' is not a number of at least %g", name, v, min);
    return x;
}

char *bench_base_url(const char *url) {
    bench_buf b = {0};
    if (!strstr(url, "://")) bench_buf_append(&b, "http://", 7);
    bench_buf_append(&b, url, strlen(url));
    while (b.len && b.data[b.len - 1] == '/')
        b.data[--b.len] = '\0';
    return b.data;
}

#define BENCH_PROGRESS_WIDTH 30

static void bench_progress_draw(bench_progress *p, double now) {
    int filled = p->total ? (int)((long)BENCH_PROGRESS_WIDTH * p->done / p->total) : 0;
    char bar[BENCH_PROGRESS_WIDTH + 1];
    for (int i = 0; i < BENCH_PROGRESS_WIDTH; i++)
        bar[i] = i < filled ? '#' : '.';
    bar[BENCH_PROGRESS_WIDTH] = '\0';
    double elapsed = now - p->t0;
    fprintf(stderr, "\r%s [%s] %d/%d %3d%% %.1f s", p->what, bar, p->done, p->total,
            p->total ? 100 * p->done / p->total : 100, elapsed);
    if (p->done > 0 && p->done < p->total)
        fprintf(stderr, ", %.1f s left", elapsed / p->done * (p->total - p->done));
    if (p->failed) fprintf(stderr, ", %d failed", p->failed);
    fprintf(stderr, "\033[K");
    fflush(stderr);
    p->last_draw = now;
}

void bench_progress_start(bench_progress *p, int total, const char *what, int enabled) {
    *p = (bench_progress){.enabled = enabled && isatty(STDERR_FILENO),
                          .total = total,
                          .what = what,
                          .t0 = bench_now()};
    if (p->enabled) bench_progress_draw(p, p->t0);
}

void bench_progress_tick(bench_progress *p, int ok) {
    p->done++;
    if (!ok) p->failed++;
    if (!p->enabled) return;
    double now = bench_now();
    if (now - p->last_draw >= 0.1 || p->done == p->total) bench_progress_draw(p, now);
}

void bench_progress_end(bench_progress *p) {
    if (!p->enabled) return;
    bench_progress_draw(p, bench_now());
    fprintf(stderr, "\n");
    p->enabled = 0;
}
