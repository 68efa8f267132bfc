/* Prometheus metrics for GET /metrics (served when --enable-metrics is given).
 *
 * Latency histograms are observed where the events happen: time to first token and inter-token
 * latency on the engine thread (from the per-request token callback), end-to-end latency and
 * finished requests on the HTTP side. Queue sizes, KV pages and token totals are read from the
 * scheduler's stats when the page is rendered. Names follow SGLang's (sglang:time_to_first_token_
 * seconds ...) under the moeserve: prefix, with a model_name label. Thread-safe. */
#ifndef MOESERVE_METRICS_H
#define MOESERVE_METRICS_H

#include <stddef.h>

#include "runner/engine.h"
#include "runner/scheduler.h"

typedef struct metrics metrics;

metrics *metrics_create(const char *model_name);
void metrics_free(metrics *m);

void metrics_observe_ttft(metrics *m, double seconds);
void metrics_observe_itl(metrics *m, double seconds);
/* One finished generation request: its end-to-end latency and how it finished. */
void metrics_observe_request(metrics *m, double e2e_seconds, finish_kind finish);
/* One HTTP answer with this status (every endpoint). */
void metrics_count_http(metrics *m, int status);

/* The exposition text (malloc'ed, *len bytes); st may be NULL while the engine is starting. */
char *metrics_render(metrics *m, const scheduler_stats *st, size_t *len);

#endif
