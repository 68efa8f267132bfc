/* The client's HTTP runs over libcurl's multi interface (see http.h).
 *
 * Choices:
 *   - One thread, one multi handle: curl_multi_poll waits for the sockets or for the next
 *     arrival, whichever comes first, so an arrival is late by the time one batch of reads takes.
 *   - A line is stamped when curl hands over the bytes that complete it, before anything else is
 *     done with them; the JSON is read after the stamp.
 *   - Proxy settings of the environment are ignored (a benchmark talks to the server itself), and
 *     "Expect: 100-continue" is never sent (it would add a round trip to large prompts). */
#include "scripts/bench/http.h"

#include <cjson/cJSON.h>
#include <curl/curl.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#define BENCH_HTTP_MAX_BODY           (64u << 20) /* bytes of an answer kept; more is cut */
#define BENCH_HTTP_CONNECT_TIMEOUT_MS 10000L
#define BENCH_HTTP_POLL_MS            100

typedef struct {
    const bench_http_opts *o;
    bench_http_job *job;
    char errbuf[CURL_ERROR_SIZE];
    char error[CURL_ERROR_SIZE + 64];
} bench_http_slot;

void bench_http_global_init(void) {
    static int done;
    if (done) return;
    done = 1;
    if (curl_global_init(CURL_GLOBAL_DEFAULT) != CURLE_OK) bench_die("curl_global_init failed");
    struct rlimit rl; /* as SGLang's set_ulimit: many streams at once need many sockets */
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
        rl.rlim_cur = rl.rlim_max;
        setrlimit(RLIMIT_NOFILE, &rl);
    }
}

static int bench_is_blank(char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\n'; }

static void bench_http_emit_line(bench_http_slot *s, const char *p, size_t n, double now) {
    while (n && bench_is_blank(*p)) {
        p++;
        n--;
    }
    while (n && bench_is_blank(p[n - 1]))
        n--;
    if (n) s->o->on_line(s->job, p, n, now);
}

static size_t bench_http_write(char *ptr, size_t size, size_t nmemb, void *ud) {
    bench_http_slot *s = ud;
    bench_http_job *job = s->job;
    size_t n = size * nmemb;
    long status = 0;
    curl_easy_getinfo((CURL *)job->easy, CURLINFO_RESPONSE_CODE, &status);
    if (!s->o->on_line || status != 200) {
        size_t room =
            BENCH_HTTP_MAX_BODY > job->body_in.len ? BENCH_HTTP_MAX_BODY - job->body_in.len : 0;
        bench_buf_append(&job->body_in, ptr, n < room ? n : room);
        return n;
    }
    double now = bench_now();
    const char *p = ptr, *end = ptr + n;
    while (p < end) {
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        if (!nl) {
            bench_buf_append(&job->partial_line, p, (size_t)(end - p));
            break;
        }
        if (job->partial_line.len) {
            bench_buf_append(&job->partial_line, p, (size_t)(nl - p));
            bench_http_emit_line(s, job->partial_line.data, job->partial_line.len, now);
            job->partial_line.len = 0;
        } else {
            bench_http_emit_line(s, p, (size_t)(nl - p), now);
        }
        p = nl + 1;
    }
    return n;
}

static CURL *bench_http_easy(const char *url, const char *api_key, double timeout_s,
                             struct curl_slist **headers) {
    CURL *e = curl_easy_init();
    if (!e) bench_die("curl_easy_init failed");
    curl_easy_setopt(e, CURLOPT_URL, url);
    curl_easy_setopt(e, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(e, CURLOPT_PROXY, "");
    curl_easy_setopt(e, CURLOPT_TCP_NODELAY, 1L);
    curl_easy_setopt(e, CURLOPT_CONNECTTIMEOUT_MS, BENCH_HTTP_CONNECT_TIMEOUT_MS);
    if (timeout_s > 0) curl_easy_setopt(e, CURLOPT_TIMEOUT_MS, (long)ceil(timeout_s * 1000));
    if (!*headers) {
        *headers = curl_slist_append(NULL, "Content-Type: application/json");
        *headers = curl_slist_append(*headers, "Expect:");
        if (api_key && *api_key) {
            bench_buf auth = {0};
            bench_buf_appendf(&auth, "Authorization: Bearer %s", api_key);
            *headers = curl_slist_append(*headers, auth.data);
            bench_buf_free(&auth);
        }
    }
    curl_easy_setopt(e, CURLOPT_HTTPHEADER, *headers);
    return e;
}

void bench_http_run(const bench_http_opts *o, bench_http_job *jobs, int n, double t0) {
    bench_http_global_init();
    CURLM *m = curl_multi_init();
    if (!m) bench_die("curl_multi_init failed");
    struct curl_slist *headers = NULL;
    bench_http_slot *slots = calloc((size_t)n + 1, sizeof *slots);
    int *url_running = calloc((size_t)o->n_urls, sizeof *url_running);
    if (!slots || !url_running) bench_die("out of memory");
    int next = 0, running = 0, done = 0, turn = 0;
    bench_buf url = {0};
    while (done < n) {
        double now = bench_now();
        while (next < n && (o->max_concurrency <= 0 || running < o->max_concurrency) &&
               t0 + jobs[next].arrival <= now) {
            bench_http_job *job = &jobs[next];
            bench_http_slot *s = &slots[next++];
            s->o = o;
            s->job = job;
            /* the URL with the fewest running, ties in turn */
            int best = -1;
            for (int k = 0; k < o->n_urls; k++) {
                int u = (turn + k) % o->n_urls;
                if (best < 0 || url_running[u] < url_running[best]) best = u;
            }
            turn = (best + 1) % o->n_urls;
            url_running[best]++;
            job->url_index = best;
            url.len = 0;
            bench_buf_appendf(&url, "%s%s", o->urls[best], job->path);
            CURL *e = bench_http_easy(url.data, o->api_key, o->timeout_s, &headers);
            job->easy = e;
            curl_easy_setopt(e, CURLOPT_POSTFIELDS, job->body);
            curl_easy_setopt(e, CURLOPT_POSTFIELDSIZE, (long)strlen(job->body));
            curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, bench_http_write);
            curl_easy_setopt(e, CURLOPT_WRITEDATA, s);
            curl_easy_setopt(e, CURLOPT_PRIVATE, s);
            curl_easy_setopt(e, CURLOPT_ERRORBUFFER, s->errbuf);
            job->t_start = bench_now();
            if (o->on_start) o->on_start(job, job->t_start);
            curl_multi_add_handle(m, e);
            running++;
        }
        int still = 0;
        curl_multi_perform(m, &still);
        CURLMsg *msg;
        int left;
        while ((msg = curl_multi_info_read(m, &left))) {
            if (msg->msg != CURLMSG_DONE) continue;
            CURL *e = msg->easy_handle;
            CURLcode rc = msg->data.result;
            bench_http_slot *s = NULL;
            curl_easy_getinfo(e, CURLINFO_PRIVATE, (char **)&s);
            bench_http_job *job = s->job;
            double end = bench_now();
            curl_easy_getinfo(e, CURLINFO_RESPONSE_CODE, &job->status);
            if (job->status == 200 && o->on_line && job->partial_line.len)
                bench_http_emit_line(s, job->partial_line.data, job->partial_line.len, end);
            job->error = NULL;
            if (rc != CURLE_OK) {
                snprintf(s->error, sizeof s->error, "%s%s%s", curl_easy_strerror(rc),
                         s->errbuf[0] ? ": " : "", s->errbuf);
                job->error = s->error;
            }
            curl_multi_remove_handle(m, e);
            curl_easy_cleanup(e);
            job->easy = NULL;
            url_running[job->url_index]--;
            running--;
            done++;
            int ok = o->on_done ? o->on_done(job, end) : (rc == CURLE_OK && job->status == 200);
            if (o->progress) bench_progress_tick(o->progress, ok);
            bench_buf_free(&job->partial_line);
        }
        if (done == n) break;
        int wait_ms = BENCH_HTTP_POLL_MS;
        if (next < n && (o->max_concurrency <= 0 || running < o->max_concurrency)) {
            double dt = t0 + jobs[next].arrival - bench_now();
            if (dt <= 0) continue;
            if (dt * 1000 < wait_ms) wait_ms = (int)ceil(dt * 1000);
        }
        curl_multi_poll(m, NULL, 0, wait_ms, NULL);
    }
    bench_buf_free(&url);
    curl_slist_free_all(headers);
    curl_multi_cleanup(m);
    free(slots);
    free(url_running);
}

static size_t bench_http_get_write(char *ptr, size_t size, size_t nmemb, void *ud) {
    bench_buf *b = ud;
    size_t n = size * nmemb;
    if (b->len < BENCH_HTTP_MAX_BODY) bench_buf_append(b, ptr, n);
    return n;
}

long bench_http_get(const char *url, const char *api_key, double timeout_s, bench_buf *out,
                    char *err, size_t errlen) {
    bench_http_global_init();
    struct curl_slist *headers = NULL;
    CURL *e = bench_http_easy(url, api_key, timeout_s, &headers);
    char errbuf[CURL_ERROR_SIZE] = "";
    curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, bench_http_get_write);
    curl_easy_setopt(e, CURLOPT_WRITEDATA, out);
    curl_easy_setopt(e, CURLOPT_ERRORBUFFER, errbuf);
    CURLcode rc = curl_easy_perform(e);
    long status = 0;
    if (rc == CURLE_OK) {
        curl_easy_getinfo(e, CURLINFO_RESPONSE_CODE, &status);
    } else if (err && errlen) {
        snprintf(err, errlen, "%s%s%s", curl_easy_strerror(rc), errbuf[0] ? ": " : "", errbuf);
    }
    curl_easy_cleanup(e);
    curl_slist_free_all(headers);
    return status;
}

char *bench_http_model_id(const char *url, const char *api_key) {
    bench_buf u = {0}, body = {0};
    bench_buf_appendf(&u, "%s/v1/models", url);
    char err[CURL_ERROR_SIZE + 64] = "";
    long status = bench_http_get(u.data, api_key, 30, &body, err, sizeof err);
    if (status != 200)
        bench_die("GET %s: %s%.300s (or name the model with --model)", u.data,
                  status ? "HTTP error " : err, status ? (body.data ? body.data : "") : "");
    cJSON *root = cJSON_Parse(body.data);
    const cJSON *data = cJSON_GetObjectItemCaseSensitive(root, "data");
    const cJSON *id = cJSON_GetObjectItemCaseSensitive(cJSON_GetArrayItem(data, 0), "id");
    if (!cJSON_IsString(id))
        bench_die("GET %s: no model id in the answer (or use --model)", u.data);
    char *out = bench_strdup(id->valuestring);
    cJSON_Delete(root);
    bench_buf_free(&u);
    bench_buf_free(&body);
    return out;
}
