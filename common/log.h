/* Logging and start-up error helpers: one macro family, level checked before formatting,
 * every line prefixed with the component. Errors a user can cause are reported through
 * err buffers (see config/); LOG_* is for the operator. */
#ifndef MOESERVE_LOG_H
#define MOESERVE_LOG_H

#include <stdio.h>
#include <stdlib.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { LOG_LEVEL_DEBUG, LOG_LEVEL_INFO, LOG_LEVEL_WARN, LOG_LEVEL_ERROR } log_level;

extern log_level log_threshold; /* default LOG_LEVEL_INFO; set once at start-up */
extern int log_rank; /* -1 (default): alone; else every line names this rank of the group */

void log_write(log_level level, const char *component, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

#define LOG_AT(level, comp, ...)                                                                   \
    do {                                                                                           \
        if ((level) >= log_threshold) log_write((level), (comp), __VA_ARGS__);                     \
    } while (0)
#define LOG_DEBUG(comp, ...) LOG_AT(LOG_LEVEL_DEBUG, comp, __VA_ARGS__)
#define LOG_INFO(comp, ...) LOG_AT(LOG_LEVEL_INFO, comp, __VA_ARGS__)
#define LOG_WARN(comp, ...) LOG_AT(LOG_LEVEL_WARN, comp, __VA_ARGS__)
#define LOG_ERROR(comp, ...) LOG_AT(LOG_LEVEL_ERROR, comp, __VA_ARGS__)

/* A broken invariant: print where and abort. Never used for input a user controls. */
#define MS_ASSERT(cond)                                                                            \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "%s:%d: assertion failed: %s\n", __FILE__, __LINE__, #cond);           \
            abort();                                                                               \
        }                                                                                          \
    } while (0)

/* Allocation that cannot fail silently: out of memory is fatal with file:line. */
void *xmalloc_at(size_t n, const char *file, int line);
void *xcalloc_at(size_t n, size_t size, const char *file, int line);
void *xrealloc_at(void *p, size_t n, const char *file, int line);
char *xstrdup_at(const char *s, const char *file, int line);
#define xmalloc(n) xmalloc_at((n), __FILE__, __LINE__)
#define xcalloc(n, s) xcalloc_at((n), (s), __FILE__, __LINE__)
#define xrealloc(p, n) xrealloc_at((p), (n), __FILE__, __LINE__)
#define xstrdup(s) xstrdup_at((s), __FILE__, __LINE__)

/* dir + "/" + name, malloc'ed (no doubled slash). */
char *path_join(const char *dir, const char *name);

/* Format an error message into err[errlen] (snprintf semantics) and return -1, so that
 * loaders can write `return set_err(err, errlen, "%s: field %s ...", file, field);`. */
int set_err(char *err, size_t errlen, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

#ifdef __cplusplus
}
#endif

#endif
