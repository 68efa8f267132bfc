/* Logging and checked allocation. */
#include "common/log.h"

#include <stdarg.h>
#include <stdbool.h>
#include <string.h>
#include <time.h>

log_level log_threshold = LOG_LEVEL_INFO;
int log_rank = -1;

static const char *const log_level_names[] = {"DEBUG", "INFO", "WARN", "ERROR"};

void log_write(log_level level, const char *component, const char *fmt, ...) {
    char line[2048];
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    struct tm tm;
    gmtime_r(&ts.tv_sec, &tm);
    char rank[24] = "";
    if (log_rank >= 0) snprintf(rank, sizeof rank, "rank %d ", log_rank);
    int n = snprintf(line, sizeof line, "[%02d:%02d:%02d.%03ld %s %s%s] ", tm.tm_hour, tm.tm_min,
                     tm.tm_sec, ts.tv_nsec / 1000000, log_level_names[level], rank, component);
    va_list ap;
    va_start(ap, fmt);
    if (n > 0 && (size_t)n < sizeof line) vsnprintf(line + n, sizeof line - n, fmt, ap);
    va_end(ap);
    fprintf(stderr, "%s\n", line);
}

static void *xcheck(void *p, size_t n, const char *file, int line) {
    if (!p && n) {
        fprintf(stderr, "%s:%d: out of memory allocating %zu bytes\n", file, line, n);
        exit(1);
    }
    return p;
}

void *xmalloc_at(size_t n, const char *file, int line) { return xcheck(malloc(n), n, file, line); }

void *xcalloc_at(size_t n, size_t size, const char *file, int line) {
    return xcheck(calloc(n, size), n * size, file, line);
}

void *xrealloc_at(void *p, size_t n, const char *file, int line) {
    return xcheck(realloc(p, n), n, file, line);
}

char *xstrdup_at(const char *s, const char *file, int line) {
    return xcheck(strdup(s), strlen(s) + 1, file, line);
}

char *path_join(const char *dir, const char *name) {
    size_t nd = strlen(dir), nn = strlen(name);
    bool slash = nd > 0 && dir[nd - 1] != '/';
    char *p = xmalloc(nd + slash + nn + 1);
    memcpy(p, dir, nd);
    if (slash) p[nd] = '/';
    memcpy(p + nd + slash, name, nn + 1);
    return p;
}

int set_err(char *err, size_t errlen, const char *fmt, ...) {
    if (err && errlen) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, errlen, fmt, ap);
        va_end(ap);
    }
    return -1;
}
