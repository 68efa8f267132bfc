/* Fuzz target: the bodies of POST /generate, /v1/completions and /v1/chat/completions (and of
 * /tokenize, /detokenize and /abort_request), through
 * the server's own request path (api_on_request: body parsing, every field reader, prompt
 * tokenizing, the chat template, job building and scheduler_check), with the test model
 * (tests/data/tiny-qwen3-moe, the smallest: its tokenizer, chat template and weights).
 *
 * The HTTP transport is replaced by a stand-in exchange defined here (the server/http.h calls the
 * api makes: method, path, body, reply, defer, stream, the ref lock); everything behind it is the
 * server's real code. Input: byte 0 picks the endpoint (bits 0-1: /generate, /v1/completions,
 * /v1/chat/completions, /generate; with bit 6 set instead /tokenize, /detokenize, /abort_request,
 * /v1/detokenize) and, with bit 7 set, runs the engine up to 4 steps on this
 * thread, polling the deferred answer or filling the stream after each, so that answers, stream
 * chunks, stop strings and logprobs are built too; the rest is the body. The exchange is then
 * closed (the client goes away), and the scheduler drops what is left before the next input. */
#include <cjson/cJSON.h>
#include <omp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/ops.h"
#include "runner/model.h"
#include "runner/scheduler.h"
#include "server/api.h"
#include "server/http.h"

/* ---- the stand-in exchange (one at a time) ---- */

struct http_exchange {
    const char *path;
    const char *body;
    size_t len;
    int status; /* 0 until replied */
    void *ctx;  /* the api's job, from defer or stream */
    http_poll_fn poll;
    http_fill_fn fill;
    http_close_fn close;
};

static http_exchange *fuzz_x; /* the open exchange, NULL between inputs */

void http_buf_append(http_buf *b, const char *s, size_t n) {
    if (b->len + n + 1 > b->cap) {
        b->cap = (b->len + n + 1) * 2;
        b->data = realloc(b->data, b->cap);
        if (!b->data) abort();
    }
    memcpy(b->data + b->len, s, n);
    b->len += n;
    b->data[b->len] = 0;
}

void http_buf_printf(http_buf *b, const char *fmt, ...) {
    char tmp[4096];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n < 0 || (size_t)n >= sizeof tmp) abort(); /* the api prints short lines only */
    http_buf_append(b, tmp, (size_t)n);
}

void http_buf_free(http_buf *b) {
    free(b->data);
    memset(b, 0, sizeof *b);
}

const char *http_method(const http_exchange *x) { return "POST"; }
const char *http_path(const http_exchange *x) { return x->path; }
const char *http_body(const http_exchange *x, size_t *len) {
    *len = x->len;
    return x->body;
}
const char *http_header(const http_exchange *x, const char *name) { return NULL; }
http_ref http_exchange_ref(const http_exchange *x) { return 1; }
http_server *http_exchange_server(const http_exchange *x) { return NULL; }
int http_server_port(const http_server *s) { return 0; }

void http_reply(http_exchange *x, int status, const char *content_type, const char *body,
                size_t len, const char *extra_header) {
    if (x->status) abort(); /* answered twice */
    if (content_type && !strcmp(content_type, "application/json")) { /* answers parse */
        cJSON *j = cJSON_ParseWithLength(body, len);
        if (!j) abort();
        cJSON_Delete(j);
    }
    x->status = status;
}

void http_defer(http_exchange *x, void *ctx, http_poll_fn poll, http_close_fn close) {
    if (x->ctx || x->status) abort();
    x->ctx = ctx;
    x->poll = poll;
    x->close = close;
}

void http_stream(http_exchange *x, const char *content_type, void *ctx, http_fill_fn fill,
                 http_close_fn close) {
    if (x->status) abort();
    x->ctx = ctx;
    x->fill = fill;
    x->close = close;
    x->status = 200;
}

void *http_ref_lock(http_server *s, http_ref ref) {
    return ref == 1 && fuzz_x ? fuzz_x->ctx : NULL;
}
void http_ref_unlock(http_server *s, http_ref ref) {}
void http_ref_wake_locked(http_server *s, http_ref ref) {}

/* ---- the server ---- */

static api_server *fuzz_api;
static scheduler *fuzz_sched;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    const char *dir = getenv("MOESERVE_FUZZ_MODEL");
    if (!dir) dir = "tests/data/tiny-qwen3-moe";
    char err[512];
    omp_set_num_threads(1);
    static char tok_path[512];
    snprintf(tok_path, sizeof tok_path, "%s/tokenizer.json", dir);
    tokenizer *tok = tokenizer_load(tok_path, err, sizeof err);
    model *m = tok ? model_load(dir, ops_cpu(), err, sizeof err) : NULL;
    if (!m) {
        fprintf(stderr, "fuzz_api_request: %s (run from the repository root, or set "
                        "MOESERVE_FUZZ_MODEL)\n", err);
        exit(1);
    }
    static chat_template tpl;
    chat_template_load(&tpl, dir);
    server_args a = {.model_path = dir,
                     .host = "127.0.0.1",
                     .device = "cpu",
                     .max_running_requests = 8,
                     .max_total_tokens = 4096,
                     .chunked_prefill_size = 256,
                     .context_length = 512,
                     .page_size = 16,
                     .served_model_name = "fuzz-model",
                     .log_level = "error",
                     .max_body_bytes = 1 << 20,
                     .load_format = "auto",
                     .dist_timeout = 60};
    scheduler_config sc = {.max_running_requests = a.max_running_requests,
                           .max_total_tokens = a.max_total_tokens,
                           .page_size = a.page_size,
                           .chunked_prefill_size = a.chunked_prefill_size,
                           .context_length = a.context_length,
                           .enable_radix_cache = true};
    fuzz_sched = scheduler_create(m, &sc, err, sizeof err);
    if (!fuzz_sched) {
        fprintf(stderr, "fuzz_api_request: %s\n", err);
        exit(1);
    }
    fuzz_api = api_create(&a, tok, &tpl, metrics_create(a.served_model_name));
    api_set_ready(fuzz_api, fuzz_sched, &m->cfg);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    static const char *const paths[] = {"/generate",      "/v1/completions", "/v1/chat/completions",
                                        "/generate",      "/tokenize",       "/detokenize",
                                        "/abort_request", "/v1/detokenize"};
    http_exchange x = {.path = paths[(data[0] & 3) | (data[0] & 0x40 ? 4 : 0)],
                       .body = (const char *)data + 1,
                       .len = size - 1};
    bool engine = data[0] & 0x80;
    fuzz_x = &x;
    api_on_request(fuzz_api, &x);
    if (x.ctx) {
        http_buf out = {0};
        bool more = true;
        for (int step = 0; step < (engine ? 4 : 1) && more && !(x.poll && x.status); step++) {
            if (engine) scheduler_step(fuzz_sched);
            if (x.fill) more = x.fill(x.ctx, &x, &out);
            if (x.poll) x.poll(x.ctx, &x);
        }
        http_buf_free(&out);
        void *ctx = x.ctx;
        x.ctx = NULL;
        x.close(ctx, x.poll ? x.status != 0 : !more);
    } else if (!x.status) {
        abort(); /* neither answered nor kept */
    }
    fuzz_x = NULL;
    /* what the closed job aborted leaves the queue at the next step */
    for (int i = 0; i < 8; i++) {
        scheduler_stats st;
        scheduler_get_stats(fuzz_sched, &st);
        if (st.n_running + st.n_waiting == 0) break;
        scheduler_step(fuzz_sched);
    }
    return 0;
}
