/* Reading one streamed answer the way SGLang's bench_serving reads it, chunk by chunk, into a
 * bench_request (stats.h). Three wire formats:
 *   BENCH_API_GENERATE     POST /generate, SGLang native: cumulative text; TTFT at the first chunk
 *                          with text, then each later chunk's gap is spread over the tokens it
 *                          adds (growth of meta_info.completion_tokens), a chunk that adds none
 *                          is skipped; output tokens = the last completion_tokens.
 *   BENCH_API_COMPLETIONS  POST /v1/completions: text deltas; one gap per chunk with text.
 *   BENCH_API_CHAT         POST /v1/chat/completions: content (and reasoning_content) deltas.
 * E2E latency is the time of the last line of the stream ([DONE] included).
 * Token counts: prompt tokens are the server's (meta_info or usage prompt_tokens) whenever it
 * reports them, output tokens the server's completion_tokens (the OpenAI requests ask for the
 * usage chunk with stream_options.include_usage); where the server says nothing the dataset's
 * prompt length and the requested output length stand, as in SGLang.
 * Unlike SGLang, an error object in the stream ({"error": ...}) fails the request. */
#ifndef MOESERVE_BENCH_STREAM_H
#define MOESERVE_BENCH_STREAM_H

#include <stddef.h>

#include "scripts/bench/stats.h"

typedef enum { BENCH_API_GENERATE, BENCH_API_COMPLETIONS, BENCH_API_CHAT } bench_api;

typedef struct {
    bench_api api;
    bench_request *req; /* filled as lines arrive (borrowed) */
    double st;          /* clock time when the request was sent */
    double recent;      /* clock time of the last chunk that counted */
    int seen_text;
    int last_output_len;
    char *error; /* an error object seen in the stream (owned until end) */
} bench_stream;

/* Start reading: req gets the dataset's prompt length and the requested output length, which
 * stand until the server reports its own counts. st is the clock time of sending. */
void bench_stream_begin(bench_stream *s, bench_api api, bench_request *req, double st,
                        int prompt_len, int requested_output_len);
/* One line of the event stream, received at clock time now (surrounding blanks stripped,
 * non-empty). Lines other than "data: ..." (comments, event names) are ignored. */
void bench_stream_line(bench_stream *s, const char *line, size_t len, double now);
/* The transfer has ended: HTTP status (0: none), transport_error (NULL: none) and, for a status
 * other than 200, the answer's body. Sets req->ok, or req->error with the first cause. */
void bench_stream_end(bench_stream *s, long status, const char *transport_error, const char *body);

#endif
