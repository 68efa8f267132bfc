/* The relay between ranks (server/proxy.h) over real sockets: two http_servers in this process on
 * loopback, an "upstream" that answers whole JSON, errors, event streams fed over time by helper
 * threads, and an echo of what it received; and a "front" whose on_request relays everything to
 * the upstream (or, under /dead, to a closed port). libcurl plays the client.
 *
 * Checks: statuses, bodies and content types come through; the routed header, method, path, body
 * and Authorization reach the upstream; stream events arrive in order and before the last one is
 * produced; a closed port gives 502 naming the rank; a client that hangs up mid-stream cancels
 * the upstream exchange, also before its headers; done runs once per relay; 30 concurrent relays
 * complete; proxy_free with relays in flight ends their streams and returns. A raw socket
 * upstream breaks its answers off: an empty reply and a cut whole body give 502, a cut stream an
 * error event. */
#include <arpa/inet.h>
#include <cjson/cJSON.h>
#include <curl/curl.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"
#include "server/http.h"
#include "server/proxy.h"
#include "tests/check.h"

#define MAX_RELAYS   4096
#define N_CONCURRENT 30

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* ---- the upstream ---- */

static http_server *g_up;
static atomic_int g_helpers;         /* helper threads alive */
static atomic_int g_stream_produced; /* events produced by /stream helpers */
static atomic_int g_slow_closed;     /* /slow_stream exchanges ended ... */
static atomic_int g_slow_incomplete; /* ... with completed = false */
static atomic_int g_slow_started;

/* One streamed answer: a helper thread appends events and wakes the exchange. */
typedef struct {
    pthread_mutex_t mu;
    atomic_int refs;
    http_ref ref;
    http_buf pending;
    bool end, closed, slow;
    int n_events, interval_ms;
} up_stream;

static void up_stream_unref(up_stream *s) {
    if (atomic_fetch_sub(&s->refs, 1) != 1) return;
    http_buf_free(&s->pending);
    pthread_mutex_destroy(&s->mu);
    free(s);
}

static void *up_stream_main(void *arg) {
    up_stream *s = arg;
    for (int i = 0; i < s->n_events; i++) {
        sleep_ms(s->interval_ms);
        pthread_mutex_lock(&s->mu);
        bool closed = s->closed;
        if (!closed) {
            http_buf_printf(&s->pending, "data: {\"i\": %d}\n\n", i);
            if (i == s->n_events - 1) {
                http_buf_printf(&s->pending, "data: [DONE]\n\n");
                s->end = true;
            }
            if (!s->slow) atomic_fetch_add(&g_stream_produced, 1);
        }
        pthread_mutex_unlock(&s->mu);
        if (closed) break;
        if (http_ref_lock(g_up, s->ref)) {
            http_ref_wake_locked(g_up, s->ref);
            http_ref_unlock(g_up, s->ref);
        }
    }
    up_stream_unref(s);
    atomic_fetch_sub(&g_helpers, 1);
    return NULL;
}

static bool up_stream_fill(void *ctx, http_exchange *x, http_buf *out) {
    up_stream *s = ctx;
    pthread_mutex_lock(&s->mu);
    http_buf_append(out, s->pending.data ? s->pending.data : "", s->pending.len);
    s->pending.len = 0;
    bool more = !s->end;
    pthread_mutex_unlock(&s->mu);
    return more;
}

static void up_stream_close(void *ctx, bool completed) {
    up_stream *s = ctx;
    pthread_mutex_lock(&s->mu);
    s->closed = true;
    pthread_mutex_unlock(&s->mu);
    if (s->slow) {
        if (!completed) atomic_fetch_add(&g_slow_incomplete, 1);
        atomic_fetch_add(&g_slow_closed, 1);
    }
    up_stream_unref(s);
}

static void up_start_stream(http_exchange *x, int n_events, int interval_ms, bool slow) {
    up_stream *s = xcalloc(1, sizeof *s);
    pthread_mutex_init(&s->mu, NULL);
    atomic_init(&s->refs, 2);
    s->ref = http_exchange_ref(x);
    s->n_events = n_events;
    s->interval_ms = interval_ms;
    s->slow = slow;
    http_stream(x, "text/event-stream; charset=utf-8", s, up_stream_fill, up_stream_close);
    atomic_fetch_add(&g_helpers, 1);
    pthread_t t;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    MS_ASSERT(pthread_create(&t, &attr, up_stream_main, s) == 0);
    pthread_attr_destroy(&attr);
}

/* /hang: deferred and never answered; its close is counted. */
static atomic_int g_hang_closed, g_hang_incomplete;
static int g_hang_ctx;

static void up_hang_poll(void *ctx, http_exchange *x) {}

static void up_hang_close(void *ctx, bool completed) {
    if (!completed) atomic_fetch_add(&g_hang_incomplete, 1);
    atomic_fetch_add(&g_hang_closed, 1);
}

static void up_reply_json(http_exchange *x, int status, cJSON *o) {
    char *s = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    http_reply(x, status, "application/json", s, strlen(s), NULL);
    free(s);
}

static void up_add_header(cJSON *o, const char *key, http_exchange *x, const char *name) {
    const char *v = http_header(x, name);
    if (v)
        cJSON_AddStringToObject(o, key, v);
    else
        cJSON_AddNullToObject(o, key);
}

static void up_on_request(void *app, http_exchange *x) {
    const char *path = http_path(x);
    if (!strcmp(path, "/json")) {
        static const char body[] = "{\"ok\": true, \"n\": 1}";
        http_reply(x, 200, "application/json", body, sizeof body - 1, NULL);
    } else if (!strcmp(path, "/bad")) {
        static const char body[] = "{\"error\": {\"message\": \"bad thing\", \"type\": "
                                   "\"invalid_request_error\", \"param\": null, \"code\": 400}}";
        http_reply(x, 400, "application/json", body, sizeof body - 1, NULL);
    } else if (!strcmp(path, "/stream")) {
        up_start_stream(x, 5, 150, false);
    } else if (!strcmp(path, "/short_stream")) {
        up_start_stream(x, 3, 20, false);
    } else if (!strcmp(path, "/slow_stream")) {
        atomic_fetch_add(&g_slow_started, 1);
        up_start_stream(x, 400, 25, true);
    } else if (!strcmp(path, "/hang")) {
        http_defer(x, &g_hang_ctx, up_hang_poll, up_hang_close);
    } else if (!strcmp(path, "/big")) {
        size_t n = 3u << 20;
        char *b = xmalloc(n);
        for (size_t i = 0; i < n; i++)
            b[i] = (char)('a' + i % 26);
        http_reply(x, 200, "text/plain", b, n, NULL);
        free(b);
    } else if (!strcmp(path, "/echo")) {
        size_t len;
        const char *body = http_body(x, &len);
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "method", http_method(x));
        cJSON_AddStringToObject(o, "path", path);
        cJSON_AddStringToObject(o, "body", body);
        cJSON_AddNumberToObject(o, "body_len", (double)len);
        up_add_header(o, "routed", x, PROXY_ROUTED_HEADER);
        up_add_header(o, "authorization", x, "Authorization");
        up_add_header(o, "content_type", x, "Content-Type");
        up_add_header(o, "accept", x, "Accept");
        up_add_header(o, "expect", x, "Expect");
        up_reply_json(x, 201, o);
    } else {
        static const char body[] = "{\"error\": {\"message\": \"no such path\"}}";
        http_reply(x, 404, "application/json", body, sizeof body - 1, NULL);
    }
}

/* ---- a raw upstream that breaks its answers off ---- */

static int g_raw_fd = -1;
static atomic_bool g_raw_stop;

static void raw_write(int fd, const char *s) {
    size_t n = strlen(s), off = 0;
    while (off < n) {
        ssize_t w = send(fd, s + off, n - off, MSG_NOSIGNAL);
        if (w <= 0) return;
        off += (size_t)w;
    }
}

/* One connection: read the request head (and a body of its Content-Length), answer by path. */
static void raw_serve(int fd) {
    char req[16384];
    size_t len = 0;
    char *end = NULL;
    req[0] = '\0'; /* the first strstr runs before anything arrives */
    while (len < sizeof req - 1 && !(end = strstr(req, "\r\n\r\n"))) {
        ssize_t n = recv(fd, req + len, sizeof req - 1 - len, 0);
        if (n <= 0) return;
        len += (size_t)n;
        req[len] = '\0';
    }
    if (!end) return;
    const char *cl = strcasestr(req, "Content-Length:");
    size_t want = (size_t)(end + 4 - req) + (cl && cl < end ? strtoul(cl + 15, NULL, 10) : 0);
    while (len < want && len < sizeof req - 1) {
        ssize_t n = recv(fd, req + len, sizeof req - 1 - len, 0);
        if (n <= 0) return;
        len += (size_t)n;
    }
    req[len] = '\0';
    if (strstr(req, " /raw/body_cut ")) {
        raw_write(fd, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                      "Content-Length: 100\r\n\r\n{\"partial\"");
    } else if (strstr(req, " /raw/stream_cut ")) {
        raw_write(fd, "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                      "Transfer-Encoding: chunked\r\n\r\n"
                      "10\r\ndata: {\"i\": 0}\n\n\r\n");
        sleep_ms(100);
    } /* anything else (/raw/empty): no answer at all */
}

static void *raw_main(void *arg) {
    while (!atomic_load(&g_raw_stop)) {
        struct pollfd pfd = {.fd = g_raw_fd, .events = POLLIN};
        if (poll(&pfd, 1, 50) <= 0) continue;
        int fd = accept(g_raw_fd, NULL, NULL);
        if (fd < 0) continue;
        raw_serve(fd);
        close(fd);
    }
    return NULL;
}

/* Listen on a free loopback port; its number. */
static int raw_listen(void) {
    g_raw_fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    if (bind(g_raw_fd, (struct sockaddr *)&a, sizeof a) || listen(g_raw_fd, 16)) return -1;
    socklen_t alen = sizeof a;
    getsockname(g_raw_fd, (struct sockaddr *)&a, &alen);
    return ntohs(a.sin_port);
}

/* ---- the front ---- */

static pthread_mutex_t g_front_mu = PTHREAD_MUTEX_INITIALIZER;
static proxy *g_proxy; /* NULL once freed: the front then answers 503 */
static char g_up_url[64], g_dead_url[64], g_raw_url[64];
static atomic_int g_n_forwarded, g_n_done, g_done_bad;
static atomic_int g_done_count[MAX_RELAYS];

static void front_done(void *ctx, int to_rank) {
    intptr_t i = (intptr_t)ctx;
    if (atomic_fetch_add(&g_done_count[i], 1) != 0) atomic_fetch_add(&g_done_bad, 1);
    if (to_rank < 1 || to_rank > 3) atomic_fetch_add(&g_done_bad, 1);
    atomic_fetch_add(&g_n_done, 1);
}

static void front_on_request(void *app, http_exchange *x) {
    pthread_mutex_lock(&g_front_mu);
    if (!g_proxy) {
        static const char body[] = "{\"error\": {\"message\": \"no relay\"}}";
        http_reply(x, 503, "application/json", body, sizeof body - 1, NULL);
    } else {
        int i = atomic_fetch_add(&g_n_forwarded, 1);
        MS_ASSERT(i < MAX_RELAYS);
        const char *path = http_path(x);
        int to = !strncmp(path, "/dead", 5) ? 2 : !strncmp(path, "/raw", 4) ? 3 : 1;
        proxy_forward(g_proxy, x,
                      to == 2   ? g_dead_url
                      : to == 3 ? g_raw_url
                                : g_up_url,
                      0, to, front_done, (void *)(intptr_t)i);
    }
    pthread_mutex_unlock(&g_front_mu);
}

/* ---- the client ---- */

static int g_front_port;

typedef struct {
    long status;
    char content_type[128];
    http_buf body;
    CURLcode rc;
    /* streaming */
    int produced_at_first; /* g_stream_produced when the first event arrived (-1: none yet) */
    bool hang_up_after_first;
    long timeout_ms; /* 0: 30 s */
} client_result;

static size_t client_on_body(char *buf, size_t size, size_t n, void *ud) {
    client_result *c = ud;
    http_buf_append(&c->body, buf, size * n);
    if (c->produced_at_first < 0 && strstr(c->body.data, "data: ")) {
        c->produced_at_first = atomic_load(&g_stream_produced);
        if (c->hang_up_after_first) return 0;
    }
    return size * n;
}

/* method, path on the front, body (NULL: none), extra headers (NULL-terminated list or NULL). */
static void client_do(client_result *c, const char *method, const char *path, const char *body,
                      size_t body_len, const char *const *headers) {
    long timeout_ms = c->timeout_ms;
    memset(c, 0, sizeof *c);
    c->produced_at_first = -1;
    CURL *e = curl_easy_init();
    char url[256];
    snprintf(url, sizeof url, "http://127.0.0.1:%d%s", g_front_port, path);
    curl_easy_setopt(e, CURLOPT_URL, url);
    curl_easy_setopt(e, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(e, CURLOPT_PROXY, "");
    curl_easy_setopt(e, CURLOPT_TIMEOUT_MS, timeout_ms ? timeout_ms : 30000L);
    curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, client_on_body);
    curl_easy_setopt(e, CURLOPT_WRITEDATA, c);
    if (body) {
        curl_easy_setopt(e, CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)body_len);
        curl_easy_setopt(e, CURLOPT_POSTFIELDS, body);
    }
    if (strcmp(method, body ? "POST" : "GET")) curl_easy_setopt(e, CURLOPT_CUSTOMREQUEST, method);
    struct curl_slist *h = NULL;
    for (int i = 0; headers && headers[i]; i++)
        h = curl_slist_append(h, headers[i]);
    if (h) curl_easy_setopt(e, CURLOPT_HTTPHEADER, h);
    c->rc = curl_easy_perform(e);
    curl_easy_getinfo(e, CURLINFO_RESPONSE_CODE, &c->status);
    char *ct = NULL;
    curl_easy_getinfo(e, CURLINFO_CONTENT_TYPE, &ct);
    snprintf(c->content_type, sizeof c->content_type, "%s", ct ? ct : "");
    if (!c->body.data) http_buf_append(&c->body, "", 0);
    curl_slist_free_all(h);
    curl_easy_cleanup(e);
}

static void client_free(client_result *c) { http_buf_free(&c->body); }

/* Wait up to timeout_s for *v to reach want. */
static bool wait_int(atomic_int *v, int want, double timeout_s) {
    double t0 = now_s();
    while (atomic_load(v) != want && now_s() - t0 < timeout_s)
        sleep_ms(5);
    return atomic_load(v) == want;
}

static bool wait_active(int want, double timeout_s) {
    double t0 = now_s();
    while (proxy_n_active(g_proxy) != want && now_s() - t0 < timeout_s)
        sleep_ms(5);
    return proxy_n_active(g_proxy) == want;
}

/* Every relay so far has ended and called done exactly once. */
static void check_done_all(const char *what) {
    CHECK(wait_active(0, 5.0), "%s: %d relays still active", what, proxy_n_active(g_proxy));
    int fwd = atomic_load(&g_n_forwarded);
    CHECK(atomic_load(&g_n_done) == fwd, "%s: done ran %d times for %d relays", what,
          atomic_load(&g_n_done), fwd);
    CHECK(atomic_load(&g_done_bad) == 0, "%s: %d bad done calls", what, atomic_load(&g_done_bad));
}

/* ---- tests ---- */

static void test_whole_answers(void) {
    client_result c = {0};
    client_do(&c, "GET", "/json", NULL, 0, NULL);
    CHECK(c.rc == CURLE_OK && c.status == 200, "json: rc %d status %ld", c.rc, c.status);
    CHECK(!strcmp(c.body.data, "{\"ok\": true, \"n\": 1}"), "json body: %s", c.body.data);
    CHECK(!strcmp(c.content_type, "application/json"), "json type: %s", c.content_type);
    client_free(&c);

    client_do(&c, "POST", "/bad", "{}", 2, NULL);
    CHECK(c.status == 400, "bad: status %ld", c.status);
    CHECK(strstr(c.body.data, "\"bad thing\"") != NULL, "bad body: %s", c.body.data);
    CHECK(!strcmp(c.content_type, "application/json"), "bad type: %s", c.content_type);
    client_free(&c);

    client_do(&c, "GET", "/nowhere", NULL, 0, NULL);
    CHECK(c.status == 404 && strstr(c.body.data, "no such path"), "404: %ld %s", c.status,
          c.body.data);
    client_free(&c);

    client_do(&c, "GET", "/big", NULL, 0, NULL);
    bool same = c.body.len == (3u << 20);
    for (size_t i = 0; same && i < c.body.len; i++)
        same = c.body.data[i] == (char)('a' + i % 26);
    CHECK(c.status == 200 && same, "big: status %ld, %zu bytes", c.status, c.body.len);
    CHECK(!strcmp(c.content_type, "text/plain"), "big type: %s", c.content_type);
    client_free(&c);
    check_done_all("whole answers");
}

static void test_echo(void) {
    const char *body = "{\"text\": \"hello\", \"stream\": false}";
    const char *const headers[] = {"Content-Type: application/json", "Authorization: Bearer k123",
                                   "Accept: application/json", "X-Other: dropped", NULL};
    client_result c = {0};
    client_do(&c, "POST", "/echo", body, strlen(body), headers);
    CHECK(c.status == 201, "echo: status %ld (%s)", c.status, c.body.data);
    cJSON *o = cJSON_Parse(c.body.data);
    CHECK(o != NULL, "echo: not JSON: %s", c.body.data);
    if (o) {
        const char *want[][2] = {{"method", "POST"},
                                 {"path", "/echo"},
                                 {"body", body},
                                 {"routed", "0"},
                                 {"authorization", "Bearer k123"},
                                 {"content_type", "application/json"},
                                 {"accept", "application/json"}};
        for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
            const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, want[i][0]);
            CHECK(cJSON_IsString(v) && !strcmp(v->valuestring, want[i][1]), "echo %s: %s",
                  want[i][0], cJSON_IsString(v) ? v->valuestring : "(not a string)");
        }
        CHECK(cJSON_IsNull(cJSON_GetObjectItemCaseSensitive(o, "expect")), "echo: Expect sent");
        cJSON_Delete(o);
    }
    client_free(&c);

    /* PUT, no headers of the client: no Content-Type invented, a large body intact */
    size_t n = 300 * 1000;
    char *big = xmalloc(n + 1);
    for (size_t i = 0; i < n; i++)
        big[i] = (char)('A' + i % 23);
    big[n] = '\0';
    const char *const no_type[] = {"Content-Type:", NULL}; /* curl would add a form type */
    client_do(&c, "PUT", "/echo", big, n, no_type);
    o = cJSON_Parse(c.body.data);
    const cJSON *m = o ? cJSON_GetObjectItemCaseSensitive(o, "method") : NULL;
    const cJSON *b = o ? cJSON_GetObjectItemCaseSensitive(o, "body") : NULL;
    const cJSON *ct = o ? cJSON_GetObjectItemCaseSensitive(o, "content_type") : NULL;
    const cJSON *auth = o ? cJSON_GetObjectItemCaseSensitive(o, "authorization") : NULL;
    CHECK(c.status == 201 && cJSON_IsString(m) && !strcmp(m->valuestring, "PUT"), "put: %ld",
          c.status);
    CHECK(cJSON_IsString(b) && !strcmp(b->valuestring, big), "put: body of %zu bytes changed",
          cJSON_IsString(b) ? strlen(b->valuestring) : 0);
    CHECK(cJSON_IsNull(ct), "put: Content-Type %s", cJSON_IsString(ct) ? ct->valuestring : "?");
    CHECK(cJSON_IsNull(auth), "put: Authorization invented");
    cJSON_Delete(o);
    free(big);
    client_free(&c);

    client_do(&c, "GET", "/echo", NULL, 0, NULL);
    o = cJSON_Parse(c.body.data);
    m = o ? cJSON_GetObjectItemCaseSensitive(o, "method") : NULL;
    CHECK(c.status == 201 && cJSON_IsString(m) && !strcmp(m->valuestring, "GET"), "get: %ld %s",
          c.status, c.body.data);
    cJSON_Delete(o);
    client_free(&c);
    check_done_all("echo");
}

/* "data: {"i": k}" events 0..n-1 then [DONE], in order, nothing else. */
static bool stream_ok(const char *body, int n) {
    http_buf want = {0};
    for (int i = 0; i < n; i++)
        http_buf_printf(&want, "data: {\"i\": %d}\n\n", i);
    http_buf_printf(&want, "data: [DONE]\n\n");
    bool ok = !strcmp(body, want.data);
    http_buf_free(&want);
    return ok;
}

static void test_stream(void) {
    atomic_store(&g_stream_produced, 0);
    client_result c = {0};
    client_do(&c, "POST", "/stream", "{\"stream\": true}", 16, NULL);
    CHECK(c.rc == CURLE_OK && c.status == 200, "stream: rc %d status %ld", c.rc, c.status);
    CHECK(!strcmp(c.content_type, "text/event-stream; charset=utf-8"), "stream type: %s",
          c.content_type);
    CHECK(stream_ok(c.body.data, 5), "stream body: %s", c.body.data);
    CHECK(c.produced_at_first >= 1 && c.produced_at_first < 5,
          "the first event arrived when %d of 5 were produced (want it before the last)",
          c.produced_at_first);
    client_free(&c);
    check_done_all("stream");
}

static void test_unreachable(void) {
    client_result c = {0};
    client_do(&c, "POST", "/dead/generate", "{}", 2, NULL);
    CHECK(c.status == 502, "dead: status %ld", c.status);
    CHECK(!strcmp(c.content_type, "application/json"), "dead type: %s", c.content_type);
    cJSON *o = cJSON_Parse(c.body.data);
    const cJSON *err = o ? cJSON_GetObjectItemCaseSensitive(o, "error") : NULL;
    const cJSON *msg = cJSON_GetObjectItemCaseSensitive(err, "message");
    const cJSON *type = cJSON_GetObjectItemCaseSensitive(err, "type");
    const cJSON *code = cJSON_GetObjectItemCaseSensitive(err, "code");
    char want[128];
    snprintf(want, sizeof want, "rank 2 at %s could not be reached: ", g_dead_url);
    CHECK(cJSON_IsString(msg) && !strncmp(msg->valuestring, want, strlen(want)) &&
              strlen(msg->valuestring) > strlen(want),
          "dead message: %s", c.body.data);
    CHECK(cJSON_IsString(type) && !strcmp(type->valuestring, "BadGatewayError"), "dead type: %s",
          c.body.data);
    CHECK(cJSON_IsNumber(code) && code->valueint == 502, "dead code: %s", c.body.data);
    CHECK(cJSON_HasObjectItem(err, "param"), "dead param: %s", c.body.data);
    cJSON_Delete(o);
    client_free(&c);
    check_done_all("unreachable");
}

static void test_client_gone(void) {
    atomic_store(&g_slow_closed, 0);
    atomic_store(&g_slow_incomplete, 0);
    client_result c;
    memset(&c, 0, sizeof c);
    c.hang_up_after_first = true;
    /* client_do resets c: hang up through a variant of it */
    CURL *e = curl_easy_init();
    char url[128];
    snprintf(url, sizeof url, "http://127.0.0.1:%d/slow_stream", g_front_port);
    c.produced_at_first = -1;
    curl_easy_setopt(e, CURLOPT_URL, url);
    curl_easy_setopt(e, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(e, CURLOPT_PROXY, "");
    curl_easy_setopt(e, CURLOPT_TIMEOUT, 30L);
    curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, client_on_body);
    curl_easy_setopt(e, CURLOPT_WRITEDATA, &c);
    double t0 = now_s();
    c.rc = curl_easy_perform(e);
    curl_easy_cleanup(e); /* closes the connection */
    double t_gone = now_s();
    CHECK(c.rc == CURLE_WRITE_ERROR && c.body.data && strstr(c.body.data, "data: {\"i\": 0}"),
          "hang-up client: rc %d after %.2f s, body %s", c.rc, t_gone - t0,
          c.body.data ? c.body.data : "");
    bool closed = wait_int(&g_slow_closed, 1, 3.0);
    CHECK(closed, "the upstream exchange was not ended within 3 s of the client leaving");
    CHECK(atomic_load(&g_slow_incomplete) == 1, "upstream close saw completed = true");
    client_free(&c);
    check_done_all("client gone");
}

typedef struct {
    int id;
    bool ok_echo, ok_stream;
    char why[256];
} conc_arg;

static void *conc_main(void *p) {
    conc_arg *a = p;
    char body[64];
    int n = snprintf(body, sizeof body, "{\"client\": %d}", a->id);
    client_result c = {0};
    client_do(&c, "POST", "/echo", body, (size_t)n, NULL);
    cJSON *o = cJSON_Parse(c.body.data);
    const cJSON *b = o ? cJSON_GetObjectItemCaseSensitive(o, "body") : NULL;
    a->ok_echo = c.status == 201 && b && cJSON_IsString(b) && !strcmp(b->valuestring, body);
    if (!a->ok_echo) snprintf(a->why, sizeof a->why, "echo %ld %s", c.status, c.body.data);
    cJSON_Delete(o);
    client_free(&c);
    client_do(&c, "GET", "/short_stream", NULL, 0, NULL);
    a->ok_stream = c.status == 200 && stream_ok(c.body.data, 3);
    if (!a->ok_stream) snprintf(a->why, sizeof a->why, "stream %ld %s", c.status, c.body.data);
    client_free(&c);
    return NULL;
}

static void test_concurrent(void) {
    pthread_t t[N_CONCURRENT];
    conc_arg args[N_CONCURRENT];
    double t0 = now_s();
    for (int i = 0; i < N_CONCURRENT; i++) {
        args[i] = (conc_arg){.id = i};
        pthread_create(&t[i], NULL, conc_main, &args[i]);
    }
    int ok = 0;
    for (int i = 0; i < N_CONCURRENT; i++) {
        pthread_join(t[i], NULL);
        if (args[i].ok_echo && args[i].ok_stream)
            ok++;
        else
            fprintf(stderr, "client %d: %s\n", i, args[i].why);
    }
    CHECK(ok == N_CONCURRENT, "%d of %d concurrent clients got their answers (%.2f s)", ok,
          N_CONCURRENT, now_s() - t0);
    check_done_all("concurrent");
}

/* A client that gives up while the upstream has not answered: the relay is cancelled and the
 * upstream exchange ends. */
static void test_client_gone_before_headers(void) {
    client_result c = {.timeout_ms = 300};
    client_do(&c, "POST", "/hang", "{}", 2, NULL);
    CHECK(c.rc == CURLE_OPERATION_TIMEDOUT, "hang: rc %d status %ld", c.rc, c.status);
    client_free(&c);
    CHECK(wait_int(&g_hang_closed, 1, 3.0),
          "the deferred upstream exchange was not ended within 3 s");
    CHECK(atomic_load(&g_hang_incomplete) == 1, "upstream close saw completed = true");
    check_done_all("client gone before headers");
}

/* Answers broken off by the upstream. */
static void test_broken_upstream(void) {
    client_result c = {0};
    client_do(&c, "GET", "/raw/empty", NULL, 0, NULL);
    char want[128];
    snprintf(want, sizeof want, "rank 3 at %s could not be reached: ", g_raw_url);
    CHECK(c.status == 502 && strstr(c.body.data, want), "empty reply: %ld %s", c.status,
          c.body.data);
    client_free(&c);

    client_do(&c, "GET", "/raw/body_cut", NULL, 0, NULL);
    snprintf(want, sizeof want, "rank 3 at %s failed before its answer was complete: ", g_raw_url);
    CHECK(c.status == 502 && strstr(c.body.data, want) && !strstr(c.body.data, "partial"),
          "cut body: %ld %s", c.status, c.body.data);
    CHECK(!strcmp(c.content_type, "application/json"), "cut body type: %s", c.content_type);
    client_free(&c);

    client_do(&c, "POST", "/raw/stream_cut", "{\"stream\": true}", 16, NULL);
    snprintf(want, sizeof want, "rank 3 at %s failed mid-stream: ", g_raw_url);
    const char *ev = strstr(c.body.data, "data: {\"error\":");
    CHECK(c.rc == CURLE_OK && c.status == 200 &&
              !strncmp(c.body.data, "data: {\"i\": 0}\n\n", 16) && ev && strstr(ev, want) &&
              strstr(ev, "\"code\":502") && !strcmp(ev + strlen(ev) - 3, "}\n\n"),
          "cut stream: rc %d %ld %s", c.rc, c.status, c.body.data);
    CHECK(!strcmp(c.content_type, "text/event-stream"), "cut stream type: %s", c.content_type);
    client_free(&c);
    check_done_all("broken upstream");
}

static void *slow_client_main(void *p) {
    client_result *c = p;
    client_do(c, "GET", "/slow_stream", NULL, 0, NULL);
    return NULL;
}

/* proxy_free with streams in flight: their clients see an error event and the end. */
static void test_free_in_flight(void) {
    enum { N = 5 };
    atomic_store(&g_slow_closed, 0);
    atomic_store(&g_slow_started, 0);
    pthread_t t[N];
    client_result c[N] = {0};
    for (int i = 0; i < N; i++)
        pthread_create(&t[i], NULL, slow_client_main, &c[i]);
    CHECK(wait_int(&g_slow_started, N, 5.0), "only %d slow streams started",
          atomic_load(&g_slow_started));
    sleep_ms(100); /* a few events through */
    CHECK(proxy_n_active(g_proxy) == N, "%d relays active, want %d", proxy_n_active(g_proxy), N);
    pthread_mutex_lock(&g_front_mu);
    proxy *p = g_proxy;
    g_proxy = NULL;
    pthread_mutex_unlock(&g_front_mu);
    double t0 = now_s();
    proxy_free(p);
    double took = now_s() - t0;
    CHECK(took < 2.0, "proxy_free took %.2f s", took);
    int ended = 0;
    for (int i = 0; i < N; i++) {
        pthread_join(t[i], NULL);
        bool ok = c[i].rc == CURLE_OK && c[i].status == 200 &&
                  strstr(c[i].body.data, "data: {\"i\": 0}") &&
                  strstr(c[i].body.data, "data: {\"error\":") &&
                  strstr(c[i].body.data, "rank 1 at ") && !strstr(c[i].body.data, "[DONE]");
        if (ok)
            ended++;
        else
            fprintf(stderr, "slow client %d: rc %d status %ld body %.300s\n", i, c[i].rc,
                    c[i].status, c[i].body.data);
        client_free(&c[i]);
    }
    CHECK(ended == N, "%d of %d streams ended with an error event", ended, N);
    CHECK(atomic_load(&g_n_done) == atomic_load(&g_n_forwarded), "done ran %d times for %d",
          atomic_load(&g_n_done), atomic_load(&g_n_forwarded));
    CHECK(wait_int(&g_slow_closed, N, 3.0), "%d of %d upstream streams ended",
          atomic_load(&g_slow_closed), N);
    client_result after = {0};
    client_do(&after, "GET", "/json", NULL, 0, NULL);
    CHECK(after.status == 503, "after proxy_free: %ld", after.status);
    client_free(&after);
}

/* A proxy created and freed with nothing relayed. */
static void test_create_free(http_server *front) {
    char err[256];
    proxy *p = proxy_create(front, err, sizeof err);
    CHECK(p != NULL, "proxy_create: %s", err);
    if (p) {
        CHECK(proxy_n_active(p) == 0, "fresh proxy active %d", proxy_n_active(p));
        proxy_free(p);
    }
}

/* A port nothing listens on. */
static int closed_port(void) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    CHECK(bind(fd, (struct sockaddr *)&a, sizeof a) == 0, "bind a free port");
    socklen_t len = sizeof a;
    getsockname(fd, (struct sockaddr *)&a, &len);
    close(fd);
    return ntohs(a.sin_port);
}

int main(void) {
    log_threshold = LOG_LEVEL_ERROR;
    curl_global_init(CURL_GLOBAL_DEFAULT);
    char err[256];
    http_config uc = {.host = "127.0.0.1",
                      .port = 0,
                      .max_body_bytes = 8u << 20,
                      .max_connections = 256,
                      .on_request = up_on_request};
    g_up = http_server_start(&uc, err, sizeof err);
    CHECK(g_up != NULL, "upstream: %s", err);
    http_config fc = uc;
    fc.on_request = front_on_request;
    http_server *front = http_server_start(&fc, err, sizeof err);
    CHECK(front != NULL, "front: %s", err);
    if (!g_up || !front) CHECK_SUMMARY();
    g_front_port = http_server_port(front);
    snprintf(g_up_url, sizeof g_up_url, "http://127.0.0.1:%d", http_server_port(g_up));
    snprintf(g_dead_url, sizeof g_dead_url, "http://127.0.0.1:%d", closed_port());
    int raw_port = raw_listen();
    CHECK(raw_port > 0, "raw upstream: cannot listen");
    snprintf(g_raw_url, sizeof g_raw_url, "http://127.0.0.1:%d", raw_port);
    pthread_t raw_thread;
    pthread_create(&raw_thread, NULL, raw_main, NULL);

    test_create_free(front);
    g_proxy = proxy_create(front, err, sizeof err);
    CHECK(g_proxy != NULL, "proxy_create: %s", err);
    if (!g_proxy) CHECK_SUMMARY();

    test_whole_answers();
    test_echo();
    test_stream();
    test_unreachable();
    test_client_gone();
    test_client_gone_before_headers();
    test_broken_upstream();
    test_concurrent();
    test_free_in_flight();

    http_server_stop(front, 2.0);
    CHECK(wait_int(&g_helpers, 0, 5.0), "%d helper threads left", atomic_load(&g_helpers));
    http_server_stop(g_up, 2.0);
    atomic_store(&g_raw_stop, true);
    pthread_join(raw_thread, NULL);
    close(g_raw_fd);
    curl_global_cleanup();
    CHECK_SUMMARY();
}
