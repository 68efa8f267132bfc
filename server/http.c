/* HTTP transport over libmicrohttpd (see http.h for the model).
 *
 * Choices:
 *   - One internal polling thread with epoll; MHD_ALLOW_SUSPEND_RESUME so that a request waiting
 *     for the engine costs nothing while it waits. No thread per connection: a slow client (a
 *     byte a second) costs one slot and one socket, never a thread others wait for; one that
 *     sends and takes nothing for timeout_s is closed (a suspended connection, waiting for the
 *     engine, is not idle: libmicrohttpd restarts its clock when it is resumed).
 *   - Each connection needs a file descriptor: the soft RLIMIT_NOFILE (often 1024) is raised to
 *     cover max_connections plus what the rest of the process holds, as the hard limit allows
 *     (llama.cpp and vLLM's servers do the same). The listening socket is made here (bind errors
 *     get a clear message; SO_REUSEADDR so a restart finds its port).
 *   - Exchanges live in a table allocated once, one slot per allowed connection; a slot has a
 *     mutex and a generation that is bumped when its exchange ends. An http_ref is (generation,
 *     slot), so a wake from the engine for an exchange that has gone is a harmless no-op.
 *   - suspended / wake_pending are kept under the slot lock: a wake that arrives while the
 *     exchange is running marks it pending and the exchange does not go to sleep; a wake for a
 *     sleeping exchange resumes it. MHD_resume_connection is only called for a connection this
 *     code suspended and has not resumed since.
 *   - A body over max_body_bytes: refused with 413 on the Content-Length header before reading;
 *     a chunked body that grows past the limit is dropped as it arrives and answered 413.
 *   - MHD_stop_daemon must not see a suspended connection: at stop every pending exchange is
 *     marked closing and resumed, and the handlers then end its connection.
 *   - At stop the listening socket is closed first, so that a new client is refused at once
 *     (nothing sent, safe to retry); the connections the kernel had already queued, whose
 *     requests libmicrohttpd never read, are accepted here and answered 503 rather than reset.
 *   - MHD does not watch a suspended connection's socket, so a janitor thread looks at the
 *     sockets of suspended exchanges twice a second and resumes those whose client has gone;
 *     their handlers then end them. A request still queued or in a long prefill is thus aborted
 *     soon after its client leaves, not only when its next token is ready. */
#include "server/http.h"

#include <errno.h>
#include <fcntl.h>
#include <microhttpd.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"

#define HTTP_SLOT_BITS    16
#define HTTP_MAX_SLOTS    (1 << HTTP_SLOT_BITS)
#define HTTP_STREAM_BLOCK (16 * 1024)

typedef enum {
    HTTP_MODE_NONE,   /* body still arriving or not answered yet */
    HTTP_MODE_REPLY,  /* a complete answer is queued */
    HTTP_MODE_DEFER,  /* waiting for poll to answer */
    HTTP_MODE_STREAM, /* streaming answer queued */
} http_mode;

struct http_exchange {
    pthread_mutex_t mu;
    uint64_t gen; /* bumped when the exchange ends */
    int index;
    bool in_use;
    http_server *srv;
    struct MHD_Connection *conn;
    int fd; /* the connection's socket */
    char method[16];
    char *path;
    http_buf body;
    bool too_large;
    http_mode mode;
    void *ctx;
    http_poll_fn poll;
    http_fill_fn fill;
    http_close_fn close;
    bool suspended;    /* suspended by this code and not resumed since */
    bool wake_pending; /* woken while running: do not go to sleep */
    bool closing;      /* the server is stopping: end the connection */
    http_buf out;      /* streaming: bytes produced by fill, not yet handed to MHD */
    size_t out_off;
    bool stream_end;
};

struct http_server {
    struct MHD_Daemon *daemon;
    http_config cfg;
    int listen_fd;
    int port;
    int n_slots;
    http_exchange *slots;
    pthread_mutex_t free_mu;
    int *free_list;
    int n_free;
    atomic_int n_pending;
    pthread_t janitor;
    pthread_mutex_t janitor_mu;
    pthread_cond_t janitor_cv;
    bool janitor_stop;
};

/* ---- buffers ---- */

void http_buf_append(http_buf *b, const char *s, size_t n) {
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->len + n + 1)
            cap *= 2;
        b->data = xrealloc(b->data, cap);
        b->cap = cap;
    }
    if (n) memcpy(b->data + b->len, s, n);
    b->len += n;
    b->data[b->len] = '\0';
}

void http_buf_printf(http_buf *b, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    char small[256];
    int n = vsnprintf(small, sizeof small, fmt, ap);
    va_end(ap);
    if (n < 0) return;
    if ((size_t)n < sizeof small) {
        http_buf_append(b, small, (size_t)n);
        return;
    }
    http_buf_append(b, "", 0);
    if (b->len + (size_t)n + 1 > b->cap) {
        b->data = xrealloc(b->data, b->len + (size_t)n + 1);
        b->cap = b->len + (size_t)n + 1;
    }
    va_start(ap, fmt);
    vsnprintf(b->data + b->len, (size_t)n + 1, fmt, ap);
    va_end(ap);
    b->len += (size_t)n;
}

void http_buf_free(http_buf *b) {
    free(b->data);
    *b = (http_buf){0};
}

/* ---- slots ---- */

static http_ref http_ref_make(const http_exchange *x) {
    return (x->gen << HTTP_SLOT_BITS) | (uint64_t)x->index;
}

static http_exchange *http_slot_acquire(http_server *s) {
    pthread_mutex_lock(&s->free_mu);
    http_exchange *x = s->n_free ? &s->slots[s->free_list[--s->n_free]] : NULL;
    pthread_mutex_unlock(&s->free_mu);
    if (!x) return NULL;
    pthread_mutex_lock(&x->mu);
    x->in_use = true;
    x->mode = HTTP_MODE_NONE;
    x->too_large = false;
    x->ctx = NULL;
    x->poll = NULL;
    x->fill = NULL;
    x->close = NULL;
    x->suspended = x->wake_pending = x->closing = x->stream_end = false;
    x->out.len = x->out_off = 0;
    x->body.len = 0;
    if (x->body.data) x->body.data[0] = '\0';
    pthread_mutex_unlock(&x->mu);
    return x;
}

/* With x locked: end the exchange (runs close, bumps the generation). */
static void http_exchange_end(http_exchange *x, bool completed) {
    if (x->close) x->close(x->ctx, completed);
    if (x->mode == HTTP_MODE_DEFER || x->mode == HTTP_MODE_STREAM)
        atomic_fetch_sub(&x->srv->n_pending, 1);
    x->ctx = NULL;
    x->close = NULL;
    x->poll = NULL;
    x->fill = NULL;
    x->conn = NULL;
    x->fd = -1;
    x->in_use = false;
    x->gen = (x->gen + 1) & ((UINT64_C(1) << (HTTP_REF_BITS - HTTP_SLOT_BITS)) - 1);
    if (x->gen == 0) x->gen = 1; /* ref 0 means none */
    free(x->path);
    x->path = NULL;
    if (x->body.cap > (1u << 20)) http_buf_free(&x->body); /* keep small buffers for reuse */
    if (x->out.cap > (1u << 20)) http_buf_free(&x->out);
}

static void http_slot_release(http_server *s, http_exchange *x) {
    pthread_mutex_lock(&s->free_mu);
    s->free_list[s->n_free++] = x->index;
    pthread_mutex_unlock(&s->free_mu);
}

/* The client closed its end (or reset it). */
static bool http_peer_gone(http_exchange *x) {
    if (x->fd < 0) return false;
    char c;
    ssize_t n = recv(x->fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
    if (n == 0) return true;
    return n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR;
}

/* With x locked, on the polling thread: nothing to do now, sleep until woken. */
static void http_exchange_sleep(http_exchange *x) {
    if (x->wake_pending) {
        x->wake_pending = false; /* woken meanwhile: MHD calls us again at once */
        return;
    }
    x->suspended = true;
    MHD_suspend_connection(x->conn);
}

/* ---- accessors and answers ---- */

const char *http_method(const http_exchange *x) { return x->method; }
const char *http_path(const http_exchange *x) { return x->path; }
const char *http_body(const http_exchange *x, size_t *len) {
    if (len) *len = x->body.len;
    return x->body.data ? x->body.data : "";
}
const char *http_header(const http_exchange *x, const char *name) {
    return MHD_lookup_connection_value(x->conn, MHD_HEADER_KIND, name);
}
http_ref http_exchange_ref(const http_exchange *x) { return http_ref_make(x); }
http_server *http_exchange_server(const http_exchange *x) { return x->srv; }

static void http_queue(http_exchange *x, struct MHD_Response *resp, int status) {
    if (MHD_queue_response(x->conn, (unsigned)status, resp) != MHD_YES)
        LOG_WARN("http", "could not queue a %d answer for %s %s", status, x->method,
                 x->path ? x->path : "?");
    MHD_destroy_response(resp);
}

static void http_add_extra_header(struct MHD_Response *resp, const char *extra) {
    if (!extra) return;
    const char *colon = strchr(extra, ':');
    if (!colon) return;
    char name[128];
    size_t n = (size_t)(colon - extra);
    if (n >= sizeof name) return;
    memcpy(name, extra, n);
    name[n] = '\0';
    const char *value = colon + 1;
    while (*value == ' ')
        value++;
    MHD_add_response_header(resp, name, value);
}

void http_reply(http_exchange *x, int status, const char *content_type, const char *body,
                size_t len, const char *extra_header) {
    MS_ASSERT(x->mode == HTTP_MODE_NONE || x->mode == HTTP_MODE_DEFER);
    struct MHD_Response *resp =
        MHD_create_response_from_buffer(len, (void *)body, MHD_RESPMEM_MUST_COPY);
    if (content_type) MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, content_type);
    http_add_extra_header(resp, extra_header);
    if (x->mode == HTTP_MODE_DEFER) atomic_fetch_sub(&x->srv->n_pending, 1);
    x->mode = HTTP_MODE_REPLY;
    http_queue(x, resp, status);
}

void http_defer(http_exchange *x, void *ctx, http_poll_fn poll, http_close_fn close) {
    MS_ASSERT(x->mode == HTTP_MODE_NONE);
    x->mode = HTTP_MODE_DEFER;
    x->ctx = ctx;
    x->poll = poll;
    x->close = close;
    atomic_fetch_add(&x->srv->n_pending, 1);
}

static ssize_t http_on_read(void *cls, uint64_t pos, char *buf, size_t max) {
    http_exchange *x = cls;
    pthread_mutex_lock(&x->mu);
    ssize_t ret;
    if (x->closing) {
        ret = MHD_CONTENT_READER_END_WITH_ERROR;
    } else {
        if (x->out_off == x->out.len) {
            x->out.len = x->out_off = 0;
            if (!x->stream_end) {
                x->wake_pending = false;
                if (!x->fill(x->ctx, x, &x->out)) x->stream_end = true;
            }
        }
        if (x->out_off < x->out.len) {
            size_t n = x->out.len - x->out_off;
            if (n > max) n = max;
            memcpy(buf, x->out.data + x->out_off, n);
            x->out_off += n;
            ret = (ssize_t)n;
        } else if (x->stream_end) {
            ret = MHD_CONTENT_READER_END_OF_STREAM;
        } else if (http_peer_gone(x)) {
            ret = MHD_CONTENT_READER_END_WITH_ERROR;
        } else {
            http_exchange_sleep(x);
            ret = 0;
        }
    }
    pthread_mutex_unlock(&x->mu);
    return ret;
}

void http_stream(http_exchange *x, const char *content_type, void *ctx, http_fill_fn fill,
                 http_close_fn close) {
    MS_ASSERT(x->mode == HTTP_MODE_NONE || x->mode == HTTP_MODE_DEFER);
    if (x->mode == HTTP_MODE_NONE) /* a deferred exchange is counted already */
        atomic_fetch_add(&x->srv->n_pending, 1);
    x->mode = HTTP_MODE_STREAM;
    x->ctx = ctx;
    x->fill = fill;
    x->close = close;
    struct MHD_Response *resp = MHD_create_response_from_callback(
        MHD_SIZE_UNKNOWN, HTTP_STREAM_BLOCK, http_on_read, x, NULL);
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, content_type);
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
    http_queue(x, resp, 200);
}

/* ---- from any thread ---- */

static http_exchange *http_ref_slot(http_server *s, http_ref ref) {
    uint64_t index = ref & (HTTP_MAX_SLOTS - 1);
    if (ref == 0 || index >= (uint64_t)s->n_slots) return NULL;
    return &s->slots[index];
}

void *http_ref_lock(http_server *s, http_ref ref) {
    http_exchange *x = http_ref_slot(s, ref);
    if (!x) return NULL;
    pthread_mutex_lock(&x->mu);
    if (x->in_use && http_ref_make(x) == ref && x->ctx) return x->ctx;
    pthread_mutex_unlock(&x->mu);
    return NULL;
}

void http_ref_unlock(http_server *s, http_ref ref) {
    pthread_mutex_unlock(&http_ref_slot(s, ref)->mu);
}

void http_ref_wake_locked(http_server *s, http_ref ref) {
    http_exchange *x = http_ref_slot(s, ref);
    if (x->suspended) {
        x->suspended = false;
        MHD_resume_connection(x->conn);
    } else {
        x->wake_pending = true;
    }
}

/* ---- MHD callbacks (polling thread) ---- */

static void http_reply_static(struct MHD_Connection *conn, int status, const char *json) {
    struct MHD_Response *resp =
        MHD_create_response_from_buffer(strlen(json), (void *)json, MHD_RESPMEM_PERSISTENT);
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, "application/json");
    MHD_queue_response(conn, (unsigned)status, resp);
    MHD_destroy_response(resp);
}

static void http_reply_too_large(http_exchange *x) {
    char msg[256];
    int n = snprintf(msg, sizeof msg,
                     "{\"error\": {\"message\": \"request body is larger than %zu bytes "
                     "(--max-body-bytes)\", \"type\": \"invalid_request_error\", "
                     "\"param\": null, \"code\": 413}}",
                     x->srv->cfg.max_body_bytes);
    http_reply(x, 413, "application/json", msg, (size_t)n, "Connection: close");
}

static enum MHD_Result http_on_access(void *cls, struct MHD_Connection *conn, const char *url,
                                      const char *method, const char *version,
                                      const char *upload_data, size_t *upload_data_size,
                                      void **con_cls) {
    http_server *s = cls;
    http_exchange *x = *con_cls;
    if (!x) {
        x = http_slot_acquire(s);
        if (!x) {
            http_reply_static(conn, 503,
                              "{\"error\": {\"message\": \"too many connections\", \"type\": "
                              "\"server_error\", \"param\": null, \"code\": 503}}");
            return MHD_YES;
        }
        *con_cls = x;
        pthread_mutex_lock(&x->mu);
        x->conn = conn;
        const union MHD_ConnectionInfo *ci =
            MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CONNECTION_FD);
        x->fd = ci ? ci->connect_fd : -1;
        snprintf(x->method, sizeof x->method, "%s", method);
        x->path = xstrdup(url);
        const char *cl = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "Content-Length");
        if (cl) {
            char *end;
            errno = 0;
            unsigned long long n = strtoull(cl, &end, 10);
            if (errno || *end || n > s->cfg.max_body_bytes) {
                x->too_large = true;
                http_reply_too_large(x);
            }
        }
        pthread_mutex_unlock(&x->mu);
        return MHD_YES;
    }
    enum MHD_Result ret = MHD_YES;
    pthread_mutex_lock(&x->mu);
    if (*upload_data_size) {
        if (!x->too_large && x->body.len + *upload_data_size <= s->cfg.max_body_bytes)
            http_buf_append(&x->body, upload_data, *upload_data_size);
        else
            x->too_large = true;
        *upload_data_size = 0;
    } else if (x->mode == HTTP_MODE_NONE) {
        if (x->too_large) {
            http_reply_too_large(x);
        } else {
            http_buf_append(&x->body, "", 0); /* NUL-terminated even when empty */
            s->cfg.on_request(s->cfg.app, x);
            if (x->mode == HTTP_MODE_DEFER) {
                http_exchange_sleep(x);
            } else if (x->mode == HTTP_MODE_NONE) {
                LOG_ERROR("http", "no answer for %s %s", x->method, x->path);
                http_reply_static(conn, 500,
                                  "{\"error\": {\"message\": \"internal error: no answer\", "
                                  "\"type\": \"server_error\", \"param\": null, \"code\": 500}}");
                x->mode = HTTP_MODE_REPLY;
            }
        }
    } else if (x->mode == HTTP_MODE_DEFER) {
        if (x->closing || http_peer_gone(x)) {
            ret = MHD_NO; /* close the connection; on_completed runs close(ctx, false) */
        } else {
            x->wake_pending = false;
            x->poll(x->ctx, x);
            if (x->mode == HTTP_MODE_DEFER) http_exchange_sleep(x);
        }
    }
    pthread_mutex_unlock(&x->mu);
    return ret;
}

static void http_on_completed(void *cls, struct MHD_Connection *conn, void **con_cls,
                              enum MHD_RequestTerminationCode toe) {
    http_server *s = cls;
    http_exchange *x = *con_cls;
    if (!x) return;
    *con_cls = NULL;
    pthread_mutex_lock(&x->mu);
    http_exchange_end(x, toe == MHD_REQUEST_TERMINATED_COMPLETED_OK);
    pthread_mutex_unlock(&x->mu);
    http_slot_release(s, x);
}

static void http_mhd_log(void *cls, const char *fmt, va_list ap) {
    if (log_threshold > LOG_LEVEL_DEBUG) return;
    char line[512];
    vsnprintf(line, sizeof line, fmt, ap);
    size_t n = strlen(line);
    while (n && (line[n - 1] == '\n' || line[n - 1] == '\r'))
        line[--n] = '\0';
    LOG_DEBUG("http", "libmicrohttpd: %s", line);
}

/* ---- the janitor ---- */

static void *http_janitor_main(void *p) {
    http_server *s = p;
    pthread_mutex_lock(&s->janitor_mu);
    while (!s->janitor_stop) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 500 * 1000 * 1000;
        if (ts.tv_nsec >= 1000 * 1000 * 1000) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000 * 1000 * 1000;
        }
        pthread_cond_timedwait(&s->janitor_cv, &s->janitor_mu, &ts);
        if (s->janitor_stop) break;
        pthread_mutex_unlock(&s->janitor_mu);
        for (int i = 0; i < s->n_slots; i++) {
            http_exchange *x = &s->slots[i];
            pthread_mutex_lock(&x->mu);
            if (x->in_use && x->suspended && http_peer_gone(x)) {
                x->suspended = false;
                MHD_resume_connection(x->conn); /* its handler sees the client gone */
            }
            pthread_mutex_unlock(&x->mu);
        }
        pthread_mutex_lock(&s->janitor_mu);
    }
    pthread_mutex_unlock(&s->janitor_mu);
    return NULL;
}

/* ---- start / stop ---- */

static int http_listen(const char *host, int port, int *fd_out, char *err, size_t errlen) {
    char port_str[16];
    snprintf(port_str, sizeof port_str, "%d", port);
    struct addrinfo hints = {.ai_family = AF_UNSPEC,
                             .ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_PASSIVE | AI_NUMERICSERV};
    struct addrinfo *res = NULL;
    int rc = getaddrinfo(host, port_str, &hints, &res);
    if (rc) return set_err(err, errlen, "--host %s: %s", host, gai_strerror(rc));
    int fd = -1, saved = 0;
    for (struct addrinfo *a = res; a; a = a->ai_next) {
        fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
        if (fd < 0) {
            saved = errno;
            continue;
        }
        int one = 1;
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (bind(fd, a->ai_addr, a->ai_addrlen) == 0 && listen(fd, 1024) == 0) break;
        saved = errno;
        close(fd);
        fd = -1;
    }
    freeaddrinfo(res);
    if (fd < 0) {
        if (saved == EADDRINUSE)
            return set_err(err, errlen, "--port %d: the address %s:%d is already in use", port,
                           host, port);
        return set_err(err, errlen, "cannot listen on %s:%d: %s", host, port, strerror(saved));
    }
    *fd_out = fd;
    return 0;
}

/* Room for n connections' sockets besides the process's other files (model, MPI, relays). */
static void http_raise_fd_limit(int n) {
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl)) return;
    rlim_t want = (rlim_t)n + 1024;
    if (rl.rlim_cur != RLIM_INFINITY && rl.rlim_cur < want) {
        rlim_t was = rl.rlim_cur;
        rl.rlim_cur = rl.rlim_max == RLIM_INFINITY || rl.rlim_max > want ? want : rl.rlim_max;
        if (setrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < want)
            LOG_WARN("http", "open files limited to %llu (hard limit; was %llu): fewer than the %d "
                             "connections allowed can be held at once",
                     (unsigned long long)rl.rlim_cur, (unsigned long long)was, n);
    }
}

http_server *http_server_start(const http_config *cfg, char *err, size_t errlen) {
    int fd = -1;
    http_raise_fd_limit(cfg->max_connections);
    if (http_listen(cfg->host, cfg->port, &fd, err, errlen)) return NULL;
    http_server *s = xcalloc(1, sizeof *s);
    s->cfg = *cfg;
    s->listen_fd = fd;
    s->n_slots = cfg->max_connections;
    if (s->n_slots < 1) s->n_slots = 1;
    if (s->n_slots > HTTP_MAX_SLOTS) s->n_slots = HTTP_MAX_SLOTS;
    s->slots = xcalloc((size_t)s->n_slots, sizeof *s->slots);
    s->free_list = xmalloc((size_t)s->n_slots * sizeof(int));
    pthread_mutex_init(&s->free_mu, NULL);
    /* Recursive: a request refused inside scheduler_submit is finished (and notified) on the
     * polling thread while on_request still holds its exchange's lock. */
    pthread_mutexattr_t recursive;
    pthread_mutexattr_init(&recursive);
    pthread_mutexattr_settype(&recursive, PTHREAD_MUTEX_RECURSIVE);
    for (int i = 0; i < s->n_slots; i++) {
        http_exchange *x = &s->slots[i];
        pthread_mutex_init(&x->mu, &recursive);
        x->index = i;
        x->fd = -1;
        x->gen = 1;
        x->srv = s;
        s->free_list[s->n_slots - 1 - i] = i;
    }
    s->n_free = s->n_slots;
    pthread_mutexattr_destroy(&recursive);

    struct sockaddr_storage addr = {0};
    socklen_t alen = sizeof addr;
    s->port = cfg->port;
    if (getsockname(fd, (struct sockaddr *)&addr, &alen) == 0) {
        if (addr.ss_family == AF_INET) s->port = ntohs(((struct sockaddr_in *)&addr)->sin_port);
        if (addr.ss_family == AF_INET6) s->port = ntohs(((struct sockaddr_in6 *)&addr)->sin6_port);
    }
    unsigned flags = MHD_USE_EPOLL_INTERNAL_THREAD | MHD_ALLOW_SUSPEND_RESUME | MHD_USE_ERROR_LOG;
    s->daemon = MHD_start_daemon(flags, 0, NULL, NULL, http_on_access, s, MHD_OPTION_LISTEN_SOCKET,
                                 fd, MHD_OPTION_NOTIFY_COMPLETED, http_on_completed, s,
                                 MHD_OPTION_CONNECTION_LIMIT, (unsigned)s->n_slots,
                                 MHD_OPTION_CONNECTION_TIMEOUT, cfg->timeout_s,
                                 MHD_OPTION_EXTERNAL_LOGGER, http_mhd_log, s, MHD_OPTION_END);
    if (!s->daemon) {
        close(fd);
        pthread_mutex_destroy(&s->free_mu);
        for (int i = 0; i < s->n_slots; i++)
            pthread_mutex_destroy(&s->slots[i].mu);
        free(s->slots);
        free(s->free_list);
        free(s);
        set_err(err, errlen, "libmicrohttpd could not start on %s:%d", cfg->host, cfg->port);
        return NULL;
    }
    pthread_mutex_init(&s->janitor_mu, NULL);
    pthread_cond_init(&s->janitor_cv, NULL);
    if (pthread_create(&s->janitor, NULL, http_janitor_main, s)) {
        LOG_ERROR("http", "cannot start the janitor thread");
        abort();
    }
    return s;
}

int http_server_port(const http_server *s) { return s->port; }

int http_server_n_pending(http_server *s) { return atomic_load(&s->n_pending); }

static double http_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void http_wait_pending(http_server *s, double timeout_s) {
    double t0 = http_now();
    while (atomic_load(&s->n_pending) > 0 && http_now() - t0 < timeout_s) {
        struct timespec ts = {0, 10 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
}

/* Accept what the kernel queued on fd (libmicrohttpd has stopped accepting), answer each 503 and
 * close it: its request was never read, and a reset would leave its client unsure whether it
 * ran. The request is read first so that the close sends FIN, not RST (which could destroy the
 * answer before the client reads it). At most about a second in all. */
static void http_refuse_backlog(int fd) {
    static const char body[] = "{\"error\": {\"message\": \"the server is shutting down\", \"type\": "
                               "\"service_unavailable\", \"param\": null, \"code\": 503}}";
    char head[256];
    int head_len = snprintf(head, sizeof head,
                            "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                            "Content-Length: %zu\r\nRetry-After: 1\r\nConnection: close\r\n\r\n",
                            sizeof body - 1);
    int flags = fcntl(fd, F_GETFL);
    if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0) return;
    const double t0 = http_now();
    int n = 0;
    for (;;) {
        int c = accept4(fd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (c < 0) break;
        char buf[4096];
        struct pollfd p = {.fd = c, .events = POLLIN};
        if (poll(&p, 1, 20) > 0)
            while (recv(c, buf, sizeof buf, 0) > 0) {
            }
        if (send(c, head, (size_t)head_len, MSG_NOSIGNAL) == head_len)
            send(c, body, sizeof body - 1, MSG_NOSIGNAL);
        shutdown(c, SHUT_WR);
        close(c);
        n++;
        if (http_now() - t0 > 1.0) break;
    }
    if (n) LOG_INFO("http", "%d connections waiting to be accepted at shutdown: answered 503", n);
}

void http_server_stop(http_server *s, double timeout_s) {
    MHD_quiesce_daemon(s->daemon); /* libmicrohttpd accepts no more connections */
    http_refuse_backlog(s->listen_fd);
    close(s->listen_fd); /* a new client is refused */
    s->listen_fd = -1;
    pthread_mutex_lock(&s->janitor_mu);
    s->janitor_stop = true;
    pthread_cond_signal(&s->janitor_cv);
    pthread_mutex_unlock(&s->janitor_mu);
    pthread_join(s->janitor, NULL);
    pthread_mutex_destroy(&s->janitor_mu);
    pthread_cond_destroy(&s->janitor_cv);
    http_wait_pending(s, timeout_s);
    for (int i = 0; i < s->n_slots; i++) {
        http_exchange *x = &s->slots[i];
        pthread_mutex_lock(&x->mu);
        if (x->in_use && (x->mode == HTTP_MODE_DEFER || x->mode == HTTP_MODE_STREAM)) {
            x->closing = true;
            if (x->suspended) {
                x->suspended = false;
                MHD_resume_connection(x->conn);
            }
        }
        pthread_mutex_unlock(&x->mu);
    }
    http_wait_pending(s, 2.0);
    if (atomic_load(&s->n_pending) > 0)
        LOG_WARN("http", "%d exchanges still open at shutdown", atomic_load(&s->n_pending));
    MHD_stop_daemon(s->daemon);
    for (int i = 0; i < s->n_slots; i++) {
        http_exchange *x = &s->slots[i];
        free(x->path);
        http_buf_free(&x->body);
        http_buf_free(&x->out);
        pthread_mutex_destroy(&x->mu);
    }
    pthread_mutex_destroy(&s->free_mu);
    free(s->slots);
    free(s->free_list);
    free(s);
}
