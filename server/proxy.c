/* Relay of one HTTP exchange to another rank's endpoint (see proxy.h).
 *
 * Choices:
 *   - One relay thread owns the curl multi handle: it adds, removes and finishes every transfer.
 *     Other threads only queue work for it (under the proxy's mutex) and curl_multi_wakeup it, so
 *     the polling thread never waits for a peer.
 *   - A relay record is shared by the exchange (its ctx) and the relay thread, and counted: the
 *     exchange's reference goes in its close callback, the thread's when the transfer has
 *     finished, and a queued cancellation holds one of its own. The exchange may end at any time
 *     (its client gone) while curl still writes; the thread reaches it only through its http_ref,
 *     which is harmless once stale.
 *   - Locks are taken in one order: the exchange, then the record's mutex, then the proxy's. The
 *     relay thread never holds a record's mutex while it locks an exchange.
 *   - The exchange is deferred until the upstream status line and headers are in. A 200
 *     text/event-stream answer is then streamed (each write from curl wakes the exchange); any
 *     other answer is relayed whole, with its status and Content-Type, once it is complete.
 *   - A transfer that fails before anything was relayed is answered 502 with a JSON error naming
 *     the rank and its URL; one that fails mid-stream ends the stream with an SSE error event.
 *   - Only the connection has a timeout: a generation may run for minutes without a byte (a
 *     whole answer) and that is fine. TCP keepalive notices a peer host that has vanished.
 *   - The peers are reached directly: curl's proxy settings from the environment are ignored. */
#include "server/proxy.h"

#include <cjson/cJSON.h>
#include <curl/curl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#include "common/log.h"

#define PROXY_CONNECT_TIMEOUT_MS 5000
#define PROXY_POLL_MS            1000
#define PROXY_CT_LEN             256
#define PROXY_NOTE_TIMEOUT_MS    2000 /* proxy_post_all: each peer's answer, all at once */

typedef struct proxy_relay proxy_relay;

struct proxy {
    http_server *http;
    CURLM *multi;
    pthread_t thread;
    atomic_int n_active;
    pthread_mutex_t mu;   /* guards the queues and stopping */
    proxy_relay *adds;    /* new relays for the thread (linked by next_add) */
    proxy_relay *cancels; /* relays whose client has gone (linked by next_cancel) */
    bool stopping;
    proxy_relay *attached; /* relay thread only: transfers in the multi handle */
};

struct proxy_relay {
    atomic_int refs;
    proxy *p;
    http_server *http;
    http_ref ref;
    int from_rank, to_rank;
    void (*done)(void *ctx, int to_rank);
    void *done_ctx;
    char *base_url;
    char *body;
    struct curl_slist *headers;
    proxy_relay *next_add, *next_cancel;

    /* relay thread only */
    CURL *easy;
    char errbuf[CURL_ERROR_SIZE];
    char ct_seen[PROXY_CT_LEN]; /* Content-Type of the answer whose headers are arriving */
    bool attached;
    bool ended;
    proxy_relay *prev, *next; /* in p->attached */

    /* shared, under mu */
    pthread_mutex_t mu;
    bool head_done; /* status line and headers are in */
    long status;
    char content_type[PROXY_CT_LEN];
    bool streaming;
    http_buf data; /* answer bytes not yet handed to the exchange */
    bool finished; /* the transfer has ended */
    bool failed;
    char error[768]; /* the message when failed */
    bool client_gone;
};

/* ---- the record ---- */

static void relay_unref(proxy_relay *r) {
    if (atomic_fetch_sub(&r->refs, 1) != 1) return;
    pthread_mutex_destroy(&r->mu);
    http_buf_free(&r->data);
    curl_slist_free_all(r->headers);
    free(r->base_url);
    free(r->body);
    free(r);
}

/* {"error": {"message", "type", "param", "code"}}, the api's error object, for a 502. */
static char *proxy_error_json(const char *message) {
    cJSON *root = cJSON_CreateObject();
    cJSON *err = cJSON_AddObjectToObject(root, "error");
    cJSON_AddStringToObject(err, "message", message);
    cJSON_AddStringToObject(err, "type", "BadGatewayError");
    cJSON_AddNullToObject(err, "param");
    cJSON_AddNumberToObject(err, "code", 502);
    char *s = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    return s;
}

static void proxy_reply_502(http_exchange *x, const char *message) {
    char *s = proxy_error_json(message);
    http_reply(x, 502, "application/json", s, strlen(s), NULL);
    free(s);
}

/* Make the exchange's poll or fill run again (any thread; no record lock held). */
static void relay_wake(proxy_relay *r) {
    if (!http_ref_lock(r->http, r->ref)) return; /* the exchange has ended */
    http_ref_wake_locked(r->http, r->ref);
    http_ref_unlock(r->http, r->ref);
}

/* ---- exchange callbacks (polling thread, exchange locked) ---- */

static bool relay_fill(void *ctx, http_exchange *x, http_buf *out) {
    proxy_relay *r = ctx;
    (void)x;
    pthread_mutex_lock(&r->mu);
    http_buf_append(out, r->data.data ? r->data.data : "", r->data.len);
    r->data.len = 0;
    bool more = !r->finished;
    if (r->finished && r->failed) {
        char *s = proxy_error_json(r->error);
        http_buf_printf(out, "data: %s\n\n", s);
        free(s);
    }
    pthread_mutex_unlock(&r->mu);
    return more;
}

static void relay_close(void *ctx, bool completed);

static void relay_poll(void *ctx, http_exchange *x) {
    proxy_relay *r = ctx;
    pthread_mutex_lock(&r->mu);
    bool nothing_relayed = r->finished && r->failed && r->data.len == 0;
    if (r->head_done && r->streaming && !nothing_relayed) {
        char ct[PROXY_CT_LEN];
        memcpy(ct, r->content_type, sizeof ct);
        pthread_mutex_unlock(&r->mu);
        http_stream(x, ct, r, relay_fill, relay_close);
        return;
    }
    if (r->finished) {
        if (r->failed)
            proxy_reply_502(x, r->error);
        else
            http_reply(x, (int)r->status, r->content_type[0] ? r->content_type : NULL,
                       r->data.data ? r->data.data : "", r->data.len, NULL);
    }
    pthread_mutex_unlock(&r->mu); /* not finished: sleep until the next wake */
}

static void relay_close(void *ctx, bool completed) {
    proxy_relay *r = ctx;
    (void)completed;
    pthread_mutex_lock(&r->mu);
    r->client_gone = true;
    if (!r->finished) {
        /* The thread cannot finish r (and so cannot exit and let p go) while r->mu is held. */
        proxy *p = r->p;
        atomic_fetch_add(&r->refs, 1);
        pthread_mutex_lock(&p->mu);
        r->next_cancel = p->cancels;
        p->cancels = r;
        pthread_mutex_unlock(&p->mu);
        curl_multi_wakeup(p->multi);
    }
    pthread_mutex_unlock(&r->mu);
    relay_unref(r);
}

/* ---- curl callbacks (relay thread) ---- */

static size_t relay_on_header(char *buf, size_t size, size_t n, void *ud) {
    proxy_relay *r = ud;
    size_t len = size * n;
    if (r->head_done) return len; /* trailers */
    if (len >= 5 && !strncmp(buf, "HTTP/", 5)) {
        r->ct_seen[0] = '\0'; /* a new answer (after an interim 1xx) */
        return len;
    }
    if (len >= 13 && !strncasecmp(buf, "Content-Type:", 13)) {
        const char *v = buf + 13;
        size_t vl = len - 13;
        while (vl && (*v == ' ' || *v == '\t'))
            v++, vl--;
        while (vl && (v[vl - 1] == '\r' || v[vl - 1] == '\n' || v[vl - 1] == ' '))
            vl--;
        if (vl >= sizeof r->ct_seen) vl = sizeof r->ct_seen - 1;
        memcpy(r->ct_seen, v, vl);
        r->ct_seen[vl] = '\0';
        return len;
    }
    if (len > 2 || (buf[0] != '\r' && buf[0] != '\n')) return len;
    long status = 0; /* the blank line: the headers are complete */
    curl_easy_getinfo(r->easy, CURLINFO_RESPONSE_CODE, &status);
    if (status >= 100 && status < 200) return len;
    pthread_mutex_lock(&r->mu);
    r->head_done = true;
    r->status = status;
    memcpy(r->content_type, r->ct_seen, sizeof r->content_type);
    r->streaming = status == 200 && !strncasecmp(r->ct_seen, "text/event-stream", 17);
    bool wake = r->streaming;
    pthread_mutex_unlock(&r->mu);
    if (wake) relay_wake(r);
    return len;
}

static size_t relay_on_body(char *buf, size_t size, size_t n, void *ud) {
    proxy_relay *r = ud;
    size_t len = size * n;
    pthread_mutex_lock(&r->mu);
    if (r->client_gone) {
        pthread_mutex_unlock(&r->mu);
        return 0; /* ends the transfer with CURLE_WRITE_ERROR */
    }
    http_buf_append(&r->data, buf, len);
    bool wake = r->streaming;
    pthread_mutex_unlock(&r->mu);
    if (wake) relay_wake(r);
    return len;
}

/* ---- the relay thread ---- */

static void relay_detach(proxy *p, proxy_relay *r) {
    if (!r->attached) return;
    curl_multi_remove_handle(p->multi, r->easy);
    if (r->prev)
        r->prev->next = r->next;
    else
        p->attached = r->next;
    if (r->next) r->next->prev = r->prev;
    r->prev = r->next = NULL;
    r->attached = false;
}

/* The transfer has ended (rc), or is ended here (why != NULL: cancelled or stopping). */
static void relay_finish(proxy *p, proxy_relay *r, CURLcode rc, const char *why) {
    relay_detach(p, r);
    r->ended = true;
    pthread_mutex_lock(&r->mu);
    bool gone = r->client_gone;
    r->finished = true;
    if (why || rc != CURLE_OK || !r->head_done) {
        r->failed = true;
        const char *detail = why              ? why
                             : rc != CURLE_OK ? (r->errbuf[0] ? r->errbuf : curl_easy_strerror(rc))
                                              : "the connection closed without an answer";
        if (!r->head_done)
            snprintf(r->error, sizeof r->error, "rank %d at %s could not be reached: %s",
                     r->to_rank, r->base_url, detail);
        else if (r->streaming)
            snprintf(r->error, sizeof r->error, "rank %d at %s failed mid-stream: %s", r->to_rank,
                     r->base_url, detail);
        else
            snprintf(r->error, sizeof r->error,
                     "rank %d at %s failed before its answer was complete: %s", r->to_rank,
                     r->base_url, detail);
    }
    bool failed = r->failed;
    pthread_mutex_unlock(&r->mu);
    if (failed && !gone) LOG_WARN("proxy", "rank %d -> %s", r->from_rank, r->error);
    relay_wake(r);
    curl_easy_cleanup(r->easy);
    r->easy = NULL;
    if (r->done) r->done(r->done_ctx, r->to_rank);
    atomic_fetch_sub(&p->n_active, 1);
    relay_unref(r);
}

static void *proxy_main(void *arg) {
    proxy *p = arg;
    for (;;) {
        pthread_mutex_lock(&p->mu);
        proxy_relay *adds = p->adds, *cancels = p->cancels;
        p->adds = p->cancels = NULL;
        bool stopping = p->stopping;
        pthread_mutex_unlock(&p->mu);

        proxy_relay *fifo = NULL; /* queued newest first: start them in arrival order */
        while (adds) {
            proxy_relay *r = adds;
            adds = r->next_add;
            r->next_add = fifo;
            fifo = r;
        }
        while (fifo) {
            proxy_relay *r = fifo;
            fifo = r->next_add;
            CURLMcode mc = stopping ? CURLM_OK : curl_multi_add_handle(p->multi, r->easy);
            if (stopping) {
                relay_finish(p, r, CURLE_OK, "the relay was stopped (the server is shutting down)");
            } else if (mc != CURLM_OK) {
                relay_finish(p, r, CURLE_OK, curl_multi_strerror(mc));
            } else {
                r->attached = true;
                r->prev = NULL;
                r->next = p->attached;
                if (p->attached) p->attached->prev = r;
                p->attached = r;
            }
        }
        while (cancels) {
            proxy_relay *r = cancels;
            cancels = r->next_cancel;
            if (!r->ended) relay_finish(p, r, CURLE_OK, "the client has gone");
            /* relay_finish dropped the transfer's reference; this one is still held */
            // NOLINTNEXTLINE(clang-analyzer-unix.Malloc)
            relay_unref(r); /* the queue's reference */
        }
        if (stopping) {
            while (p->attached)
                relay_finish(p, p->attached, CURLE_OK,
                             "the relay was stopped (the server is shutting down)");
            return NULL;
        }

        int running = 0;
        curl_multi_perform(p->multi, &running);
        CURLMsg *m;
        int left;
        while ((m = curl_multi_info_read(p->multi, &left))) {
            if (m->msg != CURLMSG_DONE) continue;
            CURL *easy = m->easy_handle;
            CURLcode rc = m->data.result; /* m is invalid once the handle is removed */
            proxy_relay *r = NULL;
            curl_easy_getinfo(easy, CURLINFO_PRIVATE, (char **)&r);
            relay_finish(p, r, rc, NULL);
        }
        curl_multi_poll(p->multi, NULL, 0, PROXY_POLL_MS, NULL);
    }
}

/* ---- public ---- */

proxy *proxy_create(http_server *h, char *err, size_t errlen) {
    if (curl_global_init(CURL_GLOBAL_DEFAULT) != CURLE_OK) {
        set_err(err, errlen, "libcurl could not be initialised");
        return NULL;
    }
    proxy *p = xcalloc(1, sizeof *p);
    p->http = h;
    p->multi = curl_multi_init();
    if (!p->multi) {
        free(p);
        curl_global_cleanup();
        set_err(err, errlen, "libcurl: curl_multi_init failed");
        return NULL;
    }
    atomic_init(&p->n_active, 0);
    pthread_mutex_init(&p->mu, NULL);
    if (pthread_create(&p->thread, NULL, proxy_main, p)) {
        curl_multi_cleanup(p->multi);
        pthread_mutex_destroy(&p->mu);
        free(p);
        curl_global_cleanup();
        set_err(err, errlen, "cannot start the relay thread");
        return NULL;
    }
    return p;
}

void proxy_free(proxy *p) {
    if (!p) return;
    pthread_mutex_lock(&p->mu);
    p->stopping = true;
    pthread_mutex_unlock(&p->mu);
    curl_multi_wakeup(p->multi);
    pthread_join(p->thread, NULL);
    /* Every relay has finished; cancellations queued after the thread's last look hold only a
     * reference. No relay can be queued any more (stopping refuses new ones). */
    pthread_mutex_lock(&p->mu);
    proxy_relay *cancels = p->cancels;
    p->cancels = NULL;
    pthread_mutex_unlock(&p->mu);
    while (cancels) {
        proxy_relay *r = cancels;
        cancels = r->next_cancel;
        relay_unref(r);
    }
    /* Notes still out (proxy_post_all) end within their timeout. */
    while (atomic_load(&p->n_active) > 0) {
        struct timespec ts = {0, 10 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    MS_ASSERT(!p->adds && !p->attached);
    curl_multi_cleanup(p->multi);
    pthread_mutex_destroy(&p->mu);
    free(p);
    curl_global_cleanup();
}

/* "Name: value" into the upstream headers when the client sent it. */
static struct curl_slist *proxy_copy_header(struct curl_slist *l, http_exchange *x,
                                            const char *name) {
    const char *v = http_header(x, name);
    if (!v) return l;
    char line[8192];
    snprintf(line, sizeof line, "%s: %s", name, v);
    return curl_slist_append(l, line);
}

static void proxy_forward_fail(http_exchange *x, proxy_relay *r, const char *detail) {
    char msg[768];
    snprintf(msg, sizeof msg, "rank %d at %s could not be reached: %s", r->to_rank, r->base_url,
             detail);
    LOG_WARN("proxy", "rank %d -> %s", r->from_rank, msg);
    proxy_reply_502(x, msg);
    if (r->done) r->done(r->done_ctx, r->to_rank);
    if (r->easy) curl_easy_cleanup(r->easy);
    relay_unref(r);
}

void proxy_forward(proxy *p, http_exchange *x, const char *base_url, int from_rank, int to_rank,
                   void (*done)(void *ctx, int to_rank), void *ctx) {
    proxy_relay *r = xcalloc(1, sizeof *r);
    atomic_init(&r->refs, 1);
    pthread_mutex_init(&r->mu, NULL);
    r->p = p;
    r->http = http_exchange_server(x);
    r->ref = http_exchange_ref(x);
    r->from_rank = from_rank;
    r->to_rank = to_rank;
    r->done = done;
    r->done_ctx = ctx;
    r->base_url = xstrdup(base_url);
    size_t body_len;
    const char *body = http_body(x, &body_len);
    r->body = xmalloc(body_len + 1);
    memcpy(r->body, body, body_len);
    r->body[body_len] = '\0';

    r->easy = curl_easy_init();
    if (!r->easy) {
        proxy_forward_fail(x, r, "libcurl: curl_easy_init failed");
        return;
    }
    const char *path = http_path(x), *method = http_method(x);
    size_t ul = strlen(base_url) + strlen(path) + 1;
    char *url = xmalloc(ul);
    snprintf(url, ul, "%s%s", base_url, path);
    CURL *e = r->easy;
    curl_easy_setopt(e, CURLOPT_URL, url); /* copied by curl */
    free(url);
    curl_easy_setopt(e, CURLOPT_PRIVATE, r);
    curl_easy_setopt(e, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(e, CURLOPT_PROXY, ""); /* never through an http_proxy of the environment */
    curl_easy_setopt(e, CURLOPT_CONNECTTIMEOUT_MS, (long)PROXY_CONNECT_TIMEOUT_MS);
    curl_easy_setopt(e, CURLOPT_TCP_KEEPALIVE, 1L);
    curl_easy_setopt(e, CURLOPT_TCP_NODELAY, 1L);
    curl_easy_setopt(e, CURLOPT_ERRORBUFFER, r->errbuf);
    curl_easy_setopt(e, CURLOPT_HEADERFUNCTION, relay_on_header);
    curl_easy_setopt(e, CURLOPT_HEADERDATA, r);
    curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, relay_on_body);
    curl_easy_setopt(e, CURLOPT_WRITEDATA, r);
    if (!strcmp(method, "GET")) {
        curl_easy_setopt(e, CURLOPT_HTTPGET, 1L);
    } else if (!strcmp(method, "HEAD")) {
        curl_easy_setopt(e, CURLOPT_NOBODY, 1L);
    } else {
        curl_easy_setopt(e, CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)body_len);
        curl_easy_setopt(e, CURLOPT_POSTFIELDS, r->body);
        if (strcmp(method, "POST")) curl_easy_setopt(e, CURLOPT_CUSTOMREQUEST, method);
    }
    struct curl_slist *h = NULL;
    h = proxy_copy_header(h, x, "Content-Type");
    if (!http_header(x, "Content-Type")) h = curl_slist_append(h, "Content-Type:"); /* none */
    h = proxy_copy_header(h, x, "Accept");
    h = proxy_copy_header(h, x, "Authorization");
    char routed[64];
    snprintf(routed, sizeof routed, "%s: %d", PROXY_ROUTED_HEADER, from_rank);
    h = curl_slist_append(h, routed);
    h = curl_slist_append(h, "Expect:"); /* no 100-continue round trip */
    r->headers = h;
    curl_easy_setopt(e, CURLOPT_HTTPHEADER, h);

    pthread_mutex_lock(&p->mu);
    bool stopping = p->stopping;
    if (!stopping) {
        atomic_fetch_add(&r->refs, 1); /* the relay thread's */
        atomic_fetch_add(&p->n_active, 1);
        r->next_add = p->adds;
        p->adds = r;
    }
    pthread_mutex_unlock(&p->mu);
    if (stopping) {
        proxy_forward_fail(x, r, "the relay was stopped (the server is shutting down)");
        return;
    }
    /* The thread may already run the transfer, but it reaches x only through its lock, which
     * the polling thread holds until on_request returns. */
    http_defer(x, r, relay_poll, relay_close);
    curl_multi_wakeup(p->multi);
}

int proxy_n_active(proxy *p) { return atomic_load(&p->n_active); }

/* ---- notes to every peer ---- */

typedef struct {
    proxy *p;
    char **urls;
    int n;
    char *body;
    char *auth; /* the Authorization header line, or NULL */
    int from_rank;
} proxy_note;

static size_t proxy_discard(char *data, size_t size, size_t n, void *ctx) {
    (void)data;
    (void)ctx;
    return size * n;
}

static void *proxy_note_main(void *arg) {
    proxy_note *nt = arg;
    CURLM *m = curl_multi_init();
    CURL **easy = xcalloc((size_t)nt->n, sizeof *easy);
    struct curl_slist *h = curl_slist_append(NULL, "Content-Type: application/json");
    char routed[64];
    snprintf(routed, sizeof routed, "%s: %d", PROXY_ROUTED_HEADER, nt->from_rank);
    h = curl_slist_append(h, routed);
    h = curl_slist_append(h, "Expect:");
    if (nt->auth) h = curl_slist_append(h, nt->auth);
    for (int i = 0; m && i < nt->n; i++) {
        CURL *e = easy[i] = curl_easy_init();
        if (!e) continue;
        curl_easy_setopt(e, CURLOPT_URL, nt->urls[i]);
        curl_easy_setopt(e, CURLOPT_PROXY, "");
        curl_easy_setopt(e, CURLOPT_HTTPHEADER, h);
        curl_easy_setopt(e, CURLOPT_POSTFIELDS, nt->body);
        curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, proxy_discard);
        curl_easy_setopt(e, CURLOPT_TIMEOUT_MS, (long)PROXY_NOTE_TIMEOUT_MS);
        curl_easy_setopt(e, CURLOPT_NOSIGNAL, 1L);
        curl_multi_add_handle(m, e);
    }
    int running = 1;
    while (m && running > 0) {
        if (curl_multi_perform(m, &running) != CURLM_OK) break;
        if (running > 0) curl_multi_poll(m, NULL, 0, 100, NULL);
    }
    for (int i = 0; i < nt->n; i++) {
        long status = 0;
        if (easy[i]) {
            curl_easy_getinfo(easy[i], CURLINFO_RESPONSE_CODE, &status);
            curl_multi_remove_handle(m, easy[i]);
            curl_easy_cleanup(easy[i]);
        }
        if (status != 200)
            LOG_WARN("proxy", "%s: answered %ld (0: no answer)", nt->urls[i], status);
        free(nt->urls[i]);
    }
    if (m) curl_multi_cleanup(m);
    curl_slist_free_all(h);
    free(easy);
    free(nt->urls);
    free(nt->body);
    free(nt->auth);
    proxy *p = nt->p;
    free(nt);
    atomic_fetch_sub(&p->n_active, 1); /* last: proxy_free may follow at once */
    return NULL;
}

void proxy_post_all(proxy *p, const char *const *base_urls, int n, const char *path,
                    const char *body, const char *authorization, int from_rank) {
    if (n <= 0) return;
    proxy_note *nt = xcalloc(1, sizeof *nt);
    nt->p = p;
    nt->n = n;
    nt->urls = xcalloc((size_t)n, sizeof *nt->urls);
    for (int i = 0; i < n; i++) {
        size_t len = strlen(base_urls[i]) + strlen(path) + 1;
        nt->urls[i] = xmalloc(len);
        snprintf(nt->urls[i], len, "%s%s", base_urls[i], path);
    }
    nt->body = xstrdup(body);
    if (authorization) {
        size_t len = strlen(authorization) + 32;
        nt->auth = xmalloc(len);
        snprintf(nt->auth, len, "Authorization: %s", authorization);
    }
    nt->from_rank = from_rank;
    atomic_fetch_add(&p->n_active, 1);
    pthread_t t;
    pthread_attr_t at;
    pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    if (pthread_create(&t, &at, proxy_note_main, nt)) {
        LOG_WARN("proxy", "no thread for a note to %d peers: not sent", n);
        for (int i = 0; i < n; i++)
            free(nt->urls[i]);
        free(nt->urls);
        free(nt->body);
        free(nt->auth);
        free(nt);
        atomic_fetch_sub(&p->n_active, 1);
    }
    pthread_attr_destroy(&at);
}
