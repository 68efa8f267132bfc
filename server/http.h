/* HTTP transport: libmicrohttpd with one internal polling thread (epoll) and suspend/resume.
 *
 * One exchange = one HTTP request and its answer. The transport reads the whole body (up to
 * max_body_bytes; a larger Content-Length is refused with 413 before a byte of it is read) and
 * hands the exchange to the application's on_request callback, which answers in one of three
 * ways:
 *   - http_reply: a complete answer now;
 *   - http_defer: the connection is suspended; each http_ref_wake resumes it and calls the
 *     exchange's poll callback, which answers (http_reply) or lets it sleep again;
 *   - http_stream: a 200 answer whose body is produced piece by piece (chunked encoding): the
 *     fill callback appends whatever is new; when nothing is, the connection is suspended until
 *     the next wake. Nothing ever busy-waits.
 *
 * Threads: every callback (on_request, poll, fill, close) runs on the polling thread with the
 * exchange's lock held. Other threads (the engine) reach an exchange only through its http_ref,
 * a handle that goes stale when the exchange ends: http_ref_lock returns NULL for a stale one, so
 * a late wake can never touch a closed connection. The exchange table is allocated once and
 * outlives every exchange.
 *
 * A client that goes away is noticed when its connection is next processed (a write fails, or a
 * woken deferred exchange finds its socket closed): the close callback then runs with
 * completed = false. */
#ifndef MOESERVE_HTTP_H
#define MOESERVE_HTTP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct http_server http_server;
typedef struct http_exchange http_exchange;
typedef uint64_t http_ref; /* 0 = none; fits in 52 bits */

#define HTTP_REF_BITS 52

/* A growable byte buffer (kept NUL-terminated). */
typedef struct {
    char *data;
    size_t len, cap;
} http_buf;

void http_buf_append(http_buf *b, const char *s, size_t n);
void http_buf_printf(http_buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void http_buf_free(http_buf *b);

typedef struct {
    const char *host;      /* numeric address or a name getaddrinfo resolves */
    int port;              /* 0 = any free port (see http_server_port) */
    size_t max_body_bytes; /* larger bodies get 413 */
    int max_connections;   /* connections held at once; one more is closed at accept */
    unsigned timeout_s;    /* a connection that sends and takes nothing this long is closed
                              (0: never); one waiting for the engine is not counted idle */
    /* Runs once per complete request; must answer it, defer it or stream it. */
    void (*on_request)(void *app, http_exchange *x);
    void *app;
} http_config;

/* Start listening (the polling thread starts here). Raises the process's open-file limit to
 * what max_connections needs, as far as the hard limit allows. NULL with a message when the
 * address cannot be used (bad host, port in use). */
http_server *http_server_start(const http_config *cfg, char *err, size_t errlen);
/* The port actually bound. */
int http_server_port(const http_server *s);
/* Exchanges that are deferred or streaming right now. */
int http_server_n_pending(http_server *s);
/* Wait up to timeout_s for every pending exchange to finish; then end the ones left (their
 * connections are closed) and stop the daemon. Frees s. */
void http_server_stop(http_server *s, double timeout_s);

/* ---- inside on_request / poll / fill (polling thread, exchange locked) ---- */
const char *http_method(const http_exchange *x);
const char *http_path(const http_exchange *x);                     /* without the query string */
const char *http_body(const http_exchange *x, size_t *len);        /* NUL-terminated */
const char *http_header(const http_exchange *x, const char *name); /* NULL when absent */
http_ref http_exchange_ref(const http_exchange *x);
http_server *http_exchange_server(const http_exchange *x);

/* Answer with status and body (copied); content_type NULL -> none. extra_header "Name: value"
 * or NULL. */
void http_reply(http_exchange *x, int status, const char *content_type, const char *body,
                size_t len, const char *extra_header);

typedef void (*http_poll_fn)(void *ctx, http_exchange *x);
/* Append what is new to out; return false when the body ends after what was appended. */
typedef bool (*http_fill_fn)(void *ctx, http_exchange *x, http_buf *out);
/* The exchange ended: completed = the whole answer went out. Frees ctx. */
typedef void (*http_close_fn)(void *ctx, bool completed);

/* Suspend until woken; poll(ctx) then runs, until it replies. close runs when the exchange ends
 * (also when the client goes away before the answer). */
void http_defer(http_exchange *x, void *ctx, http_poll_fn poll, http_close_fn close);
/* 200 with content_type, body from fill (chunked, flushed piece by piece). Also from the poll of
 * a deferred exchange (a relay learns only then whether its answer is a stream). */
void http_stream(http_exchange *x, const char *content_type, void *ctx, http_fill_fn fill,
                 http_close_fn close);

/* ---- from any thread ---- */
/* Lock the exchange named by ref and return its ctx; NULL (nothing locked) when it has ended or
 * has no ctx. Must not be called with an engine-side request lock held. */
void *http_ref_lock(http_server *s, http_ref ref);
void http_ref_unlock(http_server *s, http_ref ref);
/* With the exchange locked: make its poll / fill run again soon (resumes it if suspended). */
void http_ref_wake_locked(http_server *s, http_ref ref);

#endif
