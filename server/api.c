/* Routing, authentication, the info endpoints, and the jobs that carry generation requests from
 * an HTTP exchange to the scheduler and back (see api.h and api_internal.h).
 *
 * Choices:
 *   - Authentication (--api-key) is checked before routing, as SGLang's middleware does, on every
 *     path but /health (a liveness probe that tells nothing): /health_generate runs the model and
 *     /metrics tells the load, so they need the key too (SGLang leaves them open). An unknown
 *     path without the key gets 401, not 404, so paths cannot be probed. The key is compared in
 *     constant time.
 *   - Errors use the OpenAI envelope {"error": {"message", "type", "param", "code"}} everywhere.
 *   - Every item is validated (parsing here, then scheduler_check) before anything is submitted:
 *     one bad item refuses the whole request with 400 and nothing runs.
 *   - max_new_tokens given by the client must fit the context (else 400); a defaulted one is
 *     fitted to what the context leaves.
 *   - A request without a seed gets a fresh one, so unseeded sampling differs between requests as
 *     clients expect; n samples with one seed use seed, seed + 1, ...
 *     Under --enable-deterministic-inference the seed of an unseeded request is fixed instead.
 *   - Output text is decoded here, incrementally, from the output ids. While a request runs, text
 *     that could still turn out to be the start of a stop string is held back, so a streamed delta
 *     never has to be taken back.
 *   - Without a tokenizer (--skip-tokenizer-init) nothing is decoded: the text stays empty, stop
 *     strings are refused here for every endpoint (they could not be seen), and logprob entries
 *     name tokens "token_id:N" where a string is needed.
 *   - Non-streaming exchanges are woken when a request is done, and at most every 0.25 s while
 *     tokens flow, so that a client that has gone away is noticed and its request aborted.
 *   - In a rank group with --load-balance, a generation request goes to the least-loaded rank
 *     (rank_group_pick, this rank's load live from the scheduler): another rank's request is
 *     relayed whole by server/proxy.h, after the checks of this rank (key, method, readiness) and
 *     before its body is read, so the rank that runs it parses it once. A relayed request carries
 *     X-Moeserve-Routed and is always run where it arrives. */
#include "server/api_internal.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"
#include "runner/rank_group.h"
#include "runner/sampler.h"

#define API_VERSION       "0.1.0"
#define API_WAKE_INTERVAL 0.25
#define API_RELAY_DRAIN_S 3.0 /* at shutdown, relays in flight get this long to end */
/* The seed of an unseeded request under --enable-deterministic-inference: one fixed value, so
 * that an unseeded sampled request also gives the same bits on every run. */
#define API_DETERMINISTIC_SEED 42

/* The one api of the process, for the notify callback (its context is a packed handle). */
static api_server *api_global;

double api_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ---- errors and answers ---- */

int api_fail(api_error *e, int status, const char *param, const char *fmt, ...) {
    e->status = status;
    snprintf(e->param, sizeof e->param, "%s", param ? param : "");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->message, sizeof e->message, fmt, ap);
    va_end(ap);
    return -1;
}

static const char *api_error_type(int status) {
    switch (status) {
    case 401: return "authentication_error";
    case 404: return "not_found_error";
    case 503: return "service_unavailable";
    default: return status >= 500 ? "server_error" : "invalid_request_error";
    }
}

void api_reply_json(api_server *a, http_exchange *x, int status, cJSON *json) {
    char *s = cJSON_PrintUnformatted(json);
    cJSON_Delete(json);
    http_reply(x, status, "application/json", s, strlen(s), NULL);
    free(s);
    if (a->met) metrics_count_http(a->met, status);
}

static void api_reply_error_header(api_server *a, http_exchange *x, const api_error *e,
                                   const char *extra_header) {
    cJSON *root = cJSON_CreateObject();
    cJSON *err = cJSON_AddObjectToObject(root, "error");
    cJSON_AddStringToObject(err, "message", e->message);
    cJSON_AddStringToObject(err, "type", api_error_type(e->status));
    if (e->param[0])
        cJSON_AddStringToObject(err, "param", e->param);
    else
        cJSON_AddNullToObject(err, "param");
    cJSON_AddNumberToObject(err, "code", e->status);
    char *s = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    http_reply(x, e->status, "application/json", s, strlen(s), extra_header);
    free(s);
    if (a->met) metrics_count_http(a->met, e->status);
    LOG_DEBUG("api", "%s %s -> %d: %s", http_method(x), http_path(x), e->status, e->message);
}

void api_reply_error(api_server *a, http_exchange *x, const api_error *e) {
    api_reply_error_header(a, x, e, NULL);
}

static void api_reply_text(api_server *a, http_exchange *x, int status, const char *type,
                           const char *text, size_t len) {
    http_reply(x, status, type, text, len, NULL);
    if (a->met) metrics_count_http(a->met, status);
}

void api_sse(http_buf *out, cJSON *json) {
    char *s = cJSON_PrintUnformatted(json);
    cJSON_Delete(json);
    http_buf_append(out, "data: ", 6);
    http_buf_append(out, s, strlen(s));
    http_buf_append(out, "\n\n", 2);
    free(s);
}

/* ---- JSON field readers ---- */

/* What a value is, for messages: the number itself, or its JSON type. */
static void api_json_kind(const cJSON *v, char *out, size_t n) {
    if (cJSON_IsNumber(v))
        snprintf(out, n, "%g", v->valuedouble);
    else
        snprintf(out, n, "%s",
                 cJSON_IsString(v)  ? "a string"
                 : cJSON_IsBool(v)  ? "a boolean"
                 : cJSON_IsArray(v) ? "a list"
                                    : "an object");
}

int api_get_int(const cJSON *obj, const char *key, long long lo, long long hi, long long *out,
                api_error *e) {
    return api_int_value(cJSON_GetObjectItemCaseSensitive(obj, key), key, lo, hi, out, e);
}

int api_int_value(const cJSON *v, const char *key, long long lo, long long hi, long long *out,
                  api_error *e) {
    if (!v || cJSON_IsNull(v)) return 0;
    if (!cJSON_IsNumber(v) || v->valuedouble != floor(v->valuedouble) ||
        v->valuedouble < (double)lo || v->valuedouble > (double)hi) {
        char got[64];
        api_json_kind(v, got, sizeof got);
        return api_fail(e, 400, key, "%s must be an integer in [%lld, %lld], got %s", key, lo, hi,
                        got);
    }
    *out = (long long)v->valuedouble;
    return 1;
}

int api_get_float(const cJSON *obj, const char *key, float *out, api_error *e) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    if (!v || cJSON_IsNull(v)) return 0;
    if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble) || fabs(v->valuedouble) > 1e30) {
        char got[64];
        api_json_kind(v, got, sizeof got);
        return api_fail(e, 400, key, "%s must be a number, got %s", key, got);
    }
    *out = (float)v->valuedouble;
    return 1;
}

int api_get_bool(const cJSON *obj, const char *key, bool *out, api_error *e) {
    return api_bool_value(cJSON_GetObjectItemCaseSensitive(obj, key), key, out, e);
}

int api_bool_value(const cJSON *v, const char *key, bool *out, api_error *e) {
    if (!v || cJSON_IsNull(v)) return 0;
    if (!cJSON_IsBool(v)) return api_fail(e, 400, key, "%s must be true or false", key);
    *out = cJSON_IsTrue(v);
    return 1;
}

int api_parse_ids(const cJSON *v, const char *param, int vocab, int32_t **ids, int *n,
                  api_error *e) {
    if (!cJSON_IsArray(v)) return api_fail(e, 400, param, "%s must be a list of token ids", param);
    int len = cJSON_GetArraySize(v), i = 0;
    int32_t *out = xmalloc((size_t)(len ? len : 1) * sizeof(int32_t));
    const cJSON *it;
    cJSON_ArrayForEach(it, v) {
        if (!cJSON_IsNumber(it) || it->valuedouble != floor(it->valuedouble)) {
            free(out);
            return api_fail(e, 400, param, "%s[%d] is not a token id (an integer)", param, i);
        }
        if (it->valuedouble < 0 || it->valuedouble >= vocab) {
            free(out);
            return api_fail(e, 400, param,
                            "%s[%d] = %.0f is outside the vocabulary [0, %d) of the model", param,
                            i, it->valuedouble, vocab);
        }
        out[i++] = (int32_t)it->valuedouble;
    }
    *ids = out;
    *n = len;
    return 0;
}

void api_free_stops(char **stops, int n) {
    for (int i = 0; i < n; i++)
        free(stops[i]);
    free(stops);
}

int api_parse_stops(const cJSON *v, const char *param, char ***stops, int *n, api_error *e) {
    *stops = NULL;
    *n = 0;
    if (!v || cJSON_IsNull(v)) return 0;
    if (!cJSON_IsString(v) && !cJSON_IsArray(v))
        return api_fail(e, 400, param, "%s must be a string or a list of strings", param);
    int count = cJSON_IsString(v) ? 1 : cJSON_GetArraySize(v);
    if (count > API_MAX_STOPS)
        return api_fail(e, 400, param, "%s: at most %d stop strings", param, API_MAX_STOPS);
    char **out = xcalloc((size_t)(count ? count : 1), sizeof(char *));
    int k = 0;
    for (int i = 0; i < count; i++) {
        const cJSON *s = cJSON_IsString(v) ? v : cJSON_GetArrayItem(v, i);
        if (!cJSON_IsString(s)) {
            api_free_stops(out, k);
            return api_fail(e, 400, param, "%s[%d] must be a string", param, i);
        }
        size_t len = strlen(s->valuestring);
        if (len > API_MAX_STOP_LEN) {
            api_free_stops(out, k);
            return api_fail(e, 400, param, "%s[%d] is longer than %d bytes", param, i,
                            API_MAX_STOP_LEN);
        }
        if (len) out[k++] = xstrdup(s->valuestring);
    }
    *stops = out;
    *n = k;
    return 0;
}

void api_params_init(api_params *p) {
    memset(p, 0, sizeof *p);
    p->gen.sampling = sampling_params_default();
    p->gen.max_new_tokens = API_DEFAULT_MAX_NEW_TOKENS;
    p->gen.logprob_start_len = -1;
    p->skip_special = true;
    p->n = 1;
}

void api_params_free(api_params *p) {
    api_free_stops(p->stops, p->n_stops);
    free((void *)p->gen.stop_token_ids);
    free(p->bias);
    p->stops = NULL;
    p->n_stops = 0;
    p->gen.stop_token_ids = NULL;
    p->bias = NULL;
    p->gen.sampling.logit_bias = NULL;
    p->gen.sampling.n_logit_bias = 0;
}

/* logit_bias: {"token id": bias, ...}, OpenAI's (and SGLang's sampling_params'): ids as decimal
 * strings, biases numbers; at most API_MAX_LOGIT_BIAS entries. Their ranges (bias in [-100, 100],
 * no id twice) are sampling_params_check's, the ids against the vocabulary scheduler_check's. */
static int api_parse_logit_bias(const cJSON *v, api_params *p, api_error *e) {
    if (!v || cJSON_IsNull(v)) return 0;
    if (!cJSON_IsObject(v))
        return api_fail(e, 400, "logit_bias", "logit_bias must be an object of token id -> bias");
    const int n = cJSON_GetArraySize(v);
    if (n > API_MAX_LOGIT_BIAS)
        return api_fail(e, 400, "logit_bias", "logit_bias has %d entries; at most %d", n,
                        API_MAX_LOGIT_BIAS);
    sampler_bias *b = xmalloc((size_t)(n ? n : 1) * sizeof *b);
    int k = 0;
    const cJSON *it;
    cJSON_ArrayForEach(it, v) {
        const char *key = it->string;
        char *end = NULL;
        errno = 0;
        const long id = key && key[0] >= '0' && key[0] <= '9' ? strtol(key, &end, 10) : -1;
        if (id < 0 || !end || *end || errno || id > INT32_MAX) {
            free(b);
            return api_fail(e, 400, "logit_bias", "logit_bias: the key '%.32s' is not a token id",
                            key ? key : "");
        }
        if (!cJSON_IsNumber(it)) {
            free(b);
            return api_fail(e, 400, "logit_bias",
                            "logit_bias: the bias of token %ld is not a number", id);
        }
        b[k++] = (sampler_bias){.id = (int32_t)id, .bias = (float)it->valuedouble};
    }
    free(p->bias);
    p->bias = b;
    p->gen.sampling.logit_bias = b;
    p->gen.sampling.n_logit_bias = k;
    return 0;
}

int api_read_sampling(const cJSON *o, api_params *p, api_error *e) {
    static const char *const unsupported[] = {"regex", "json_schema", "ebnf", "structural_tag"};
    for (size_t i = 0; i < sizeof unsupported / sizeof unsupported[0]; i++) {
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, unsupported[i]);
        if (v && !cJSON_IsNull(v))
            return api_fail(e, 400, unsupported[i], "%s: constrained decoding is not supported",
                            unsupported[i]);
    }
    sampling_params *sp = &p->gen.sampling;
    long long v;
    int rc;
    if (api_get_float(o, "temperature", &sp->temperature, e) < 0 ||
        api_get_float(o, "top_p", &sp->top_p, e) < 0 ||
        api_get_float(o, "min_p", &sp->min_p, e) < 0 ||
        api_get_float(o, "frequency_penalty", &sp->frequency_penalty, e) < 0 ||
        api_get_float(o, "presence_penalty", &sp->presence_penalty, e) < 0 ||
        api_get_float(o, "repetition_penalty", &sp->repetition_penalty, e) < 0 ||
        api_get_bool(o, "ignore_eos", &p->gen.ignore_eos, e) < 0 ||
        api_get_bool(o, "skip_special_tokens", &p->skip_special, e) < 0 ||
        api_get_bool(o, "no_stop_trim", &p->no_stop_trim, e) < 0)
        return -1;
    if ((rc = api_get_int(o, "top_k", -(1LL << 30), 1LL << 30, &v, e)) < 0) return -1;
    if (rc) sp->top_k = (int)v;
    if ((rc = api_get_int(o, "n", 1, 128, &v, e)) < 0) return -1;
    if (rc) p->n = (int)v;
    api_free_stops(p->stops, p->n_stops);
    p->stops = NULL;
    p->n_stops = 0;
    if (api_parse_stops(cJSON_GetObjectItemCaseSensitive(o, "stop"), "stop", &p->stops, &p->n_stops,
                        e))
        return -1;
    if (api_parse_logit_bias(cJSON_GetObjectItemCaseSensitive(o, "logit_bias"), p, e)) return -1;
    const cJSON *ids = cJSON_GetObjectItemCaseSensitive(o, "stop_token_ids");
    if (ids && !cJSON_IsNull(ids)) {
        int32_t *out;
        int n;
        if (api_parse_ids(ids, "stop_token_ids", INT32_MAX, &out, &n, e)) return -1;
        free((void *)p->gen.stop_token_ids);
        p->gen.stop_token_ids = out;
        p->gen.n_stop_token_ids = n;
    }
    return 0;
}

int api_check_sampling(const api_params *p, api_error *e) {
    const char *bad = sampling_params_check(&p->gen.sampling);
    if (bad) return api_fail(e, 400, NULL, "%s", bad);
    return 0;
}

/* ---- the engine-side watch (on_token runs on the engine thread) ---- */

static bool api_watch_on_token(void *ctx, int32_t token) {
    api_watch *w = ctx;
    if (w->met) {
        double now = api_now();
        if (w->n_tokens == 0)
            metrics_observe_ttft(w->met, now - w->r->t_submit);
        else
            metrics_observe_itl(w->met, now - w->t_last);
        w->t_last = now;
        w->n_tokens++;
    }
    if (!w->n_stops) return false;
    size_t before = w->len;
    if (detok_stream_push(&w->ds, token, &w->text, &w->len, &w->cap) == 0) return false;
    for (int i = 0; i < w->n_stops; i++) {
        size_t sl = strlen(w->stops[i]);
        size_t from = before >= sl ? before - sl + 1 : 0; /* a match must end in the new bytes */
        if (memmem(w->text + from, w->len - from, w->stops[i], sl)) {
            w->matched = i;
            return true;
        }
    }
    return false;
}

static void api_watch_free(api_watch *w) {
    free(w->text);
    api_free_stops(w->stops, w->n_stops);
    free(w);
}

static bool api_request_done(request *r) {
    pthread_mutex_lock(&r->mu);
    bool done = r->done;
    pthread_mutex_unlock(&r->mu);
    return done;
}

void api_reap(api_server *a) {
    api_watch **pp = &a->retired;
    while (*pp) {
        api_watch *w = *pp;
        if (api_request_done(w->r)) {
            *pp = w->next;
            request_release(w->r);
            api_watch_free(w);
        } else {
            pp = &w->next;
        }
    }
}

/* ---- jobs ---- */

static void api_notify(void *ctx) {
    api_server *a = api_global;
    uintptr_t v = (uintptr_t)ctx;
    http_ref ref = (http_ref)(v >> API_ITEM_BITS);
    int idx = (int)(v & ((1u << API_ITEM_BITS) - 1));
    api_job *j = http_ref_lock(a->http, ref);
    if (!j) return; /* the exchange has ended */
    if (idx < j->n_items) {
        bool wake = j->stream || api_request_done(j->items[idx].r);
        double now = api_now();
        if (wake || now - j->t_last_wake >= API_WAKE_INTERVAL) {
            j->t_last_wake = now;
            http_ref_wake_locked(a->http, ref);
        }
    }
    http_ref_unlock(a->http, ref);
}

api_job *api_job_new(api_server *a, http_exchange *x, api_kind kind, int n_items) {
    api_job *j = xcalloc(1, sizeof *j);
    j->srv = a;
    j->ref = http_exchange_ref(x);
    j->kind = kind;
    j->n_items = n_items;
    j->items = xcalloc((size_t)n_items, sizeof(api_item));
    j->t_arrival = api_now();
    j->created = (long)time(NULL);
    j->logprobs = -1;
    return j;
}

static uint64_t api_random_seed(api_server *a) {
    uint64_t z = atomic_fetch_add(&a->seed_counter, UINT64_C(0x9E3779B97F4A7C15));
    z = (z ^ (z >> 30)) * UINT64_C(0xBF58476D1CE4E5B9);
    z = (z ^ (z >> 27)) * UINT64_C(0x94D049BB133111EB);
    return z ^ (z >> 31);
}

int api_job_add(api_job *j, int item, const int32_t *ids, int n_ids, const api_params *p,
                int sample, const char *rid, api_error *e) {
    api_server *a = j->srv;
    api_item *it = &j->items[item];
    if (p->n_stops && !a->tok)
        return api_fail(e, 400, "stop",
                        "stop strings need a tokenizer, and this server was started with "
                        "--skip-tokenizer-init: use stop_token_ids");
    gen_request g = p->gen;
    g.prompt = ids;
    g.n_prompt = n_ids;
    if (!p->max_new_given) {
        int room = a->args.context_length - n_ids;
        if (room >= 0 && g.max_new_tokens > room) g.max_new_tokens = room;
    } else if (n_ids <= a->args.context_length &&
               (long long)n_ids + g.max_new_tokens > a->args.context_length) {
        const char *key = p->max_new_key ? p->max_new_key : "max_new_tokens";
        return api_fail(e, 400, key,
                        "prompt (%d tokens) + %s (%d) exceeds the context length %d: at most %d "
                        "new tokens for this prompt",
                        n_ids, key, g.max_new_tokens, a->args.context_length,
                        a->args.context_length - n_ids);
    }
    if (p->seed_given)
        g.sampling.seed = p->gen.sampling.seed + (uint64_t)sample;
    else if (a->args.enable_deterministic_inference)
        g.sampling.seed = API_DETERMINISTIC_SEED + (uint64_t)sample;
    else
        g.sampling.seed = api_random_seed(a);
    g.on_token = NULL;
    g.ctx = NULL;
    api_watch *w = NULL;
    metrics *met = j->kind == API_KIND_HEALTH ? NULL : a->met;
    if (p->n_stops || met) {
        w = xcalloc(1, sizeof *w);
        w->met = met;
        w->matched = -1;
        w->n_stops = p->n_stops;
        w->stops = xcalloc((size_t)(p->n_stops ? p->n_stops : 1), sizeof(char *));
        for (int i = 0; i < p->n_stops; i++)
            w->stops[i] = xstrdup(p->stops[i]);
        detok_stream_init(&w->ds, a->tok, p->skip_special);
        g.on_token = api_watch_on_token;
        g.ctx = w;
    }
    char rid_buf[64];
    const char *client_rid = rid;
    if (rid && p->n > 1) {
        snprintf(rid_buf, sizeof rid_buf, "%.48s-%d", rid, sample);
        rid = rid_buf;
    }
    request *r = request_create(&g, rid, p->top_logprobs_num);
    if (client_rid) snprintf(r->client_rid, sizeof r->client_rid, "%s", client_rid);
    if (w) {
        request_retain(r);
        w->r = r;
    }
    r->notify = api_notify;
    r->notify_ctx = (void *)(uintptr_t)((j->ref << API_ITEM_BITS) | (uint64_t)item);
    it->r = r;
    it->w = w;
    it->skip_special = p->skip_special;
    it->no_stop_trim = p->no_stop_trim;
    it->hold_token = !p->no_stop_trim && (p->gen.n_stop_token_ids > 0 || !p->skip_special);
    it->hold_bytes = 0;
    if (!p->no_stop_trim)
        for (int i = 0; i < p->n_stops; i++)
            if (strlen(p->stops[i]) - 1 > it->hold_bytes) it->hold_bytes = strlen(p->stops[i]) - 1;
    detok_stream_init(&it->ds, a->tok, p->skip_special);
    char err[512];
    if (scheduler_check(a->sched, r, err, sizeof err)) return api_fail(e, 400, NULL, "%s", err);
    return 0;
}

static void api_poll_cb(void *ctx, http_exchange *x);
static bool api_fill_cb(void *ctx, http_exchange *x, http_buf *out);
static void api_close_cb(void *ctx, bool completed);

/* A request that will never be submitted: finish it here so that its answer can be built. */
static void api_item_refuse(api_item *it, const char *why) {
    request *r = it->r;
    pthread_mutex_lock(&r->mu);
    r->finish = FINISH_ABORT;
    snprintf(r->error, sizeof r->error, "%s", why);
    r->done = true;
    pthread_mutex_unlock(&r->mu);
}

void api_job_start(api_job *j, http_exchange *x) {
    api_server *a = j->srv;
    /* --max-queued-requests: a job whose requests would take the waiting queue past the limit is
     * refused whole, before anything of it runs (the check and the submits share submit_mu, so
     * concurrent jobs cannot pass it together). */
    const int limit = a->args.max_queued_requests;
    if (limit > 0) {
        pthread_mutex_lock(&a->submit_mu);
        scheduler_stats st;
        scheduler_get_stats(a->sched, &st);
        if (st.n_waiting + j->n_items > limit) {
            pthread_mutex_unlock(&a->submit_mu);
            api_error e = {0};
            api_fail(&e, 503, NULL,
                     "the waiting queue is full (%d waiting, --max-queued-requests %d): retry later",
                     st.n_waiting, limit);
            api_job_free(j);
            api_reply_error_header(a, x, &e, "Retry-After: 1");
            return;
        }
        pthread_mutex_unlock(&a->submit_mu);
    }
    if (j->stream)
        http_stream(x, "text/event-stream", j, api_fill_cb, api_close_cb);
    else
        http_defer(x, j, api_poll_cb, api_close_cb);
    pthread_mutex_lock(&a->submit_mu);
    bool open = atomic_load(&a->state) == API_STATE_READY;
    for (int i = 0; i < j->n_items; i++) {
        if (open) {
            j->items[i].submitted = true;
            scheduler_submit(a->sched, j->items[i].r);
        } else {
            api_item_refuse(&j->items[i], "the server is shutting down");
        }
    }
    pthread_mutex_unlock(&a->submit_mu);
    if (!open) http_ref_wake_locked(a->http, j->ref);
}

void api_job_free(api_job *j) {
    api_server *a = j->srv;
    bool aborted = false;
    for (int i = 0; i < j->n_items; i++) {
        api_item *it = &j->items[i];
        if (it->r) {
            bool running = it->submitted && !api_request_done(it->r);
            if (running) {
                request_abort(it->r);
                aborted = true;
            }
            if (it->w) {
                if (running) { /* the engine may still call on_token: keep the watch */
                    it->w->next = a->retired;
                    a->retired = it->w;
                } else {
                    request_release(it->w->r);
                    api_watch_free(it->w);
                }
            }
            request_release(it->r);
        } else if (it->w) {
            api_watch_free(it->w);
        }
        free(it->text);
    }
    if (aborted) {
        scheduler_wake(a->sched);
        LOG_DEBUG("api", "client gone: aborted its unfinished requests");
    }
    for (int i = 0; i < j->n_prompts; i++)
        free(j->prompt_text ? j->prompt_text[i] : NULL);
    free(j->prompt_text);
    free(j->prompt_len);
    free(j->model);
    free(j->items);
    free(j);
}

static bool api_job_all_done(const api_job *j) {
    for (int i = 0; i < j->n_items; i++)
        if (!api_request_done(j->items[i].r)) return false;
    return true;
}

static void api_health_answer(api_job *j, http_exchange *x) {
    api_snap s;
    api_snap_take(&j->items[0], &s);
    if (s.finish == FINISH_ABORT) {
        api_error e;
        api_fail(&e, 503, NULL, "health check generation failed: %s", s.error);
        api_reply_error(j->srv, x, &e);
    } else {
        api_reply_text(j->srv, x, 200, NULL, "", 0);
    }
    api_snap_free(&s);
}

static void api_poll_cb(void *ctx, http_exchange *x) {
    api_job *j = ctx;
    if (!api_job_all_done(j)) return;
    switch (j->kind) {
    case API_KIND_GENERATE: api_generate_answer(j, x); break;
    case API_KIND_COMPLETION:
    case API_KIND_CHAT: api_openai_answer(j, x); break;
    case API_KIND_HEALTH: api_health_answer(j, x); break;
    }
}

static bool api_fill_cb(void *ctx, http_exchange *x, http_buf *out) {
    api_job *j = ctx;
    bool complete =
        j->kind == API_KIND_GENERATE ? api_generate_fill(j, out) : api_openai_fill(j, out);
    return !complete;
}

static void api_close_cb(void *ctx, bool completed) {
    api_job *j = ctx;
    if (j->stream && j->srv->met) metrics_count_http(j->srv->met, 200);
    api_job_free(j);
}

/* ---- snapshots and text ---- */

static void *api_dup(const void *p, size_t n) {
    if (!p || !n) return NULL;
    void *q = xmalloc(n);
    memcpy(q, p, n);
    return q;
}

void api_snap_take(const api_item *it, api_snap *s) {
    request *r = it->r;
    int k = r->top_logprobs_num > 0 ? r->top_logprobs_num : 0;
    bool lp = r->gen.return_logprob;
    memset(s, 0, sizeof *s);
    pthread_mutex_lock(&r->mu);
    s->n_out = r->n_out;
    s->ids = api_dup(r->out_ids, (size_t)r->n_out * sizeof(int32_t));
    if (lp) {
        s->out_lp = api_dup(r->out_logprobs, (size_t)r->n_out * sizeof(float));
        s->n_in = r->in_logprobs ? r->n_in : 0;
        s->in_lp = api_dup(r->in_logprobs, (size_t)s->n_in * sizeof(float));
        if (k) {
            s->out_top_ids = api_dup(r->out_top_ids, (size_t)r->n_out * k * sizeof(int32_t));
            s->out_top_lp = api_dup(r->out_top_logprobs, (size_t)r->n_out * k * sizeof(float));
            s->in_top_ids = api_dup(r->in_top_ids, (size_t)s->n_in * k * sizeof(int32_t));
            s->in_top_lp = api_dup(r->in_top_logprobs, (size_t)s->n_in * k * sizeof(float));
        }
    }
    s->cached_tokens = r->cached_tokens;
    s->finish = r->finish;
    s->matched_token = r->matched_token;
    memcpy(s->error, r->error, sizeof s->error);
    s->error[sizeof s->error - 1] = '\0';
    s->done = r->done;
    s->t_done = r->t_done;
    pthread_mutex_unlock(&r->mu);
    if (!s->done) s->finish = FINISH_NONE;
    /* arrays the engine did not fill (e.g. logprobs of a request that was refused) read as 0 */
    if (lp && !s->out_lp && s->n_out) s->out_lp = xcalloc((size_t)s->n_out, sizeof(float));
    if (k && !s->out_top_ids && s->n_out) {
        s->out_top_ids = xmalloc((size_t)s->n_out * k * sizeof(int32_t));
        memset(s->out_top_ids, 0xff, (size_t)s->n_out * k * sizeof(int32_t));
        s->out_top_lp = xcalloc((size_t)s->n_out * k, sizeof(float));
    }
    if (k && !s->in_top_ids && s->n_in) {
        s->in_top_ids = xmalloc((size_t)s->n_in * k * sizeof(int32_t));
        memset(s->in_top_ids, 0xff, (size_t)s->n_in * k * sizeof(int32_t));
        s->in_top_lp = xcalloc((size_t)s->n_in * k, sizeof(float));
    }
}

void api_snap_free(api_snap *s) {
    free(s->ids);
    free(s->out_lp);
    free(s->out_top_ids);
    free(s->out_top_lp);
    free(s->in_lp);
    free(s->in_top_ids);
    free(s->in_top_lp);
    memset(s, 0, sizeof *s);
}

const char *api_item_matched_stop(const api_item *it, const api_snap *s) {
    if (s->finish != FINISH_STOP_STRING || !it->w || it->w->matched < 0) return NULL;
    return it->w->stops[it->w->matched];
}

size_t api_item_visible(api_server *a, api_item *it, const api_snap *s) {
    int target = s->n_out;
    if (s->done) {
        if (s->finish == FINISH_STOP_TOKEN && !it->no_stop_trim && target > 0) target--;
    } else if (it->hold_token && target > 0) {
        target--;
    }
    if (!a->tok) { /* --skip-tokenizer-init: no text, but the count of tokens "shown" moves on */
        if (it->n_decoded < target) it->n_decoded = target;
        if (!it->text) {
            it->cap = 64;
            it->text = xcalloc(it->cap, 1);
        }
        return 0;
    }
    for (; it->n_decoded < target; it->n_decoded++)
        detok_stream_push(&it->ds, s->ids[it->n_decoded], &it->text, &it->len, &it->cap);
    if (s->done && !it->decode_finished) {
        detok_stream_finish(&it->ds, &it->text, &it->len, &it->cap);
        it->decode_finished = true;
    }
    if (!it->text) { /* nothing decoded yet */
        it->cap = 64;
        it->text = xcalloc(it->cap, 1);
    }
    size_t v = it->len;
    if (s->done) {
        const char *stop = api_item_matched_stop(it, s);
        if (stop && !it->no_stop_trim && it->text) {
            const char *at = memmem(it->text, it->len, stop, strlen(stop));
            if (at) v = (size_t)(at - it->text);
        }
    } else if (it->hold_bytes) {
        v = it->len > it->hold_bytes ? it->len - it->hold_bytes : 0;
        while (v > 0 && ((unsigned char)it->text[v] & 0xC0) == 0x80)
            v--; /* whole characters */
    }
    if (v < it->text_sent) v = it->text_sent; /* never take back what was sent */
    return v;
}

void api_item_count(api_job *j, api_item *it, const api_snap *s) {
    if (it->counted || !s->done || !j->srv->met || j->kind == API_KIND_HEALTH) return;
    it->counted = true;
    double end = s->t_done > 0 ? s->t_done : api_now();
    metrics_observe_request(j->srv->met, end - j->t_arrival, s->finish);
}

size_t api_item_final(api_job *j, api_item *it, api_snap *s, const char **abort_msg, char *buf,
                      size_t buflen) {
    api_snap_take(it, s);
    size_t visible = api_item_visible(j->srv, it, s);
    api_item_count(j, it, s);
    if (s->finish == FINISH_ABORT && !atomic_load(&it->r->abort_api) && !*abort_msg) {
        snprintf(buf, buflen, "%s", s->error[0] ? s->error : "aborted");
        *abort_msg = buf;
    }
    return visible;
}

void api_reply_aborted(api_server *a, http_exchange *x, const char *abort_msg) {
    api_error e;
    api_fail(&e, 503, NULL, "%s", abort_msg);
    api_reply_error(a, x, &e);
}

char *api_token_text(const api_server *a, int32_t id, size_t *len) {
    if (a->tok) return tokenizer_decode(a->tok, &id, 1, false, len);
    /* no tokenizer: vLLM's --return-tokens-as-token-ids spelling, unique per id */
    char buf[32];
    int n = snprintf(buf, sizeof buf, "token_id:%d", (int)id);
    if (len) *len = (size_t)n;
    return xstrdup(buf);
}

/* ---- info endpoints ---- */

static void api_health(api_server *a, http_exchange *x) {
    if (atomic_load(&a->state) == API_STATE_READY) {
        api_reply_text(a, x, 200, NULL, "", 0);
        return;
    }
    api_error e;
    api_fail(&e, 503, NULL, "%s",
             atomic_load(&a->state) == API_STATE_STARTING ? "the server is starting"
                                                          : "the server is shutting down");
    api_reply_error(a, x, &e);
}

static void api_health_generate(api_server *a, http_exchange *x) {
    if (atomic_load(&a->state) != API_STATE_READY) {
        api_health(a, x);
        return;
    }
    api_job *j = api_job_new(a, x, API_KIND_HEALTH, 1);
    api_params p;
    api_params_init(&p);
    p.gen.max_new_tokens = 1;
    p.gen.sampling.temperature = 0;
    p.max_new_given = true;
    const int32_t prompt[1] = {0};
    api_error e;
    char rid[64];
    snprintf(rid, sizeof rid, "HEALTH_CHECK_%.6f", api_now());
    if (api_job_add(j, 0, prompt, 1, &p, 0, rid, &e)) {
        api_job_free(j);
        api_reply_error(a, x, &e);
        return;
    }
    api_job_start(j, x);
}

static void api_model_info(api_server *a, http_exchange *x) {
    cJSON *o = cJSON_CreateObject();
    char dir[4096] = "";
    if (a->sched) scheduler_model_dir(a->sched, dir, sizeof dir);
    cJSON_AddStringToObject(o, "model_path", dir[0] ? dir : a->args.model_path);
    cJSON_AddStringToObject(o, "tokenizer_path", a->tokenizer_path);
    cJSON_AddBoolToObject(o, "is_generation", true);
    cJSON_AddNullToObject(o, "preferred_sampling_params");
    cJSON_AddStringToObject(o, "weight_version", "default");
    api_reply_json(a, x, 200, o);
}

/* This rank's internal_states entry: live statistics of its scheduler. */
static cJSON *api_own_state(api_server *a) {
    scheduler_stats st = {0};
    if (a->sched) scheduler_get_stats(a->sched, &st);
    cJSON *s = cJSON_CreateObject();
    cJSON_AddNumberToObject(s, "last_gen_throughput", st.last_gen_throughput);
    cJSON_AddNumberToObject(s, "num_running_reqs", st.n_running);
    cJSON_AddNumberToObject(s, "num_waiting_reqs", st.n_waiting);
    cJSON_AddNumberToObject(s, "kv_pages_used", st.kv_pages_used);
    cJSON_AddNumberToObject(s, "kv_pages_total", st.kv_pages_total);
    cJSON_AddNumberToObject(s, "n_steps", (double)st.n_steps);
    cJSON_AddNumberToObject(s, "step_sched_seconds", st.step_sched_seconds);
    cJSON_AddNumberToObject(s, "step_forward_seconds", st.step_forward_seconds);
    cJSON_AddNumberToObject(s, "step_sample_seconds", st.step_sample_seconds);
    cJSON_AddNumberToObject(s, "n_preemptions", (double)st.n_preemptions);
    cJSON_AddNumberToObject(s, "n_cached_tokens", (double)st.n_cached_tokens);
    cJSON_AddNumberToObject(s, "n_requests_done", (double)st.n_requests_done);
    cJSON_AddNumberToObject(s, "n_generated_tokens", (double)st.n_generated_tokens);
    rank_group *g = a->group;
    int me = g ? rank_group_rank(g) : 0;
    cJSON_AddNumberToObject(s, "rank", me);
    if (g) {
        cJSON_AddStringToObject(s, "url", rank_group_url(g, me));
        cJSON_AddNumberToObject(s, "pid", rank_group_pid(g, me));
        cJSON_AddStringToObject(s, "hostname", rank_group_hostname(g, me));
    } else {
        /* as a peer would reach it: a wildcard listener through loopback */
        const char *h = a->args.host ? a->args.host : "";
        bool v6 = strchr(h, ':') != NULL;
        if (!*h || !strcmp(h, "0.0.0.0") || !strcmp(h, "::")) h = v6 ? "::1" : "127.0.0.1";
        char url[300];
        snprintf(url, sizeof url, "http://%s%s%s:%d", v6 ? "[" : "", h, v6 ? "]" : "",
                 a->http ? http_server_port(a->http) : a->args.port);
        cJSON_AddStringToObject(s, "url", url);
        char host[256] = "";
        if (gethostname(host, sizeof host)) host[0] = '\0';
        host[sizeof host - 1] = '\0';
        cJSON_AddNumberToObject(s, "pid", getpid());
        cJSON_AddStringToObject(s, "hostname", host);
    }
    cJSON_AddNumberToObject(s, "report_age_s", 0);
    return s;
}

/* Another rank's entry: its report from the latest step (age_s old; null before the first). */
static cJSON *api_peer_state(api_server *a, int r, const rank_report *rep, double age_s) {
    rank_group *g = a->group;
    cJSON *s = cJSON_CreateObject();
    cJSON_AddNumberToObject(s, "last_gen_throughput", (double)rep->gen_throughput_milli / 1000.0);
    cJSON_AddNumberToObject(s, "num_running_reqs", (double)rep->n_running);
    cJSON_AddNumberToObject(s, "num_waiting_reqs", (double)rep->n_waiting);
    cJSON_AddNumberToObject(s, "kv_pages_used", (double)rep->kv_pages_used);
    cJSON_AddNumberToObject(s, "kv_pages_total", (double)rep->kv_pages_total);
    cJSON_AddNumberToObject(s, "n_requests_done", (double)rep->n_requests_done);
    cJSON_AddNumberToObject(s, "n_generated_tokens", (double)rep->n_generated_tokens);
    cJSON_AddNumberToObject(s, "rank", r);
    cJSON_AddStringToObject(s, "url", rank_group_url(g, r));
    cJSON_AddNumberToObject(s, "pid", rank_group_pid(g, r));
    cJSON_AddStringToObject(s, "hostname", rank_group_hostname(g, r));
    if (age_s < 1e8)
        cJSON_AddNumberToObject(s, "report_age_s", age_s);
    else
        cJSON_AddNullToObject(s, "report_age_s");
    return s;
}

static void api_server_info(api_server *a, http_exchange *x) {
    const server_args *g = &a->args;
    /* The KV pool as built (on a GPU it is sized from free memory after the weights load). */
    double max_tokens = g->max_total_tokens;
    if (a->sched) {
        scheduler_stats pool;
        scheduler_get_stats(a->sched, &pool);
        max_tokens = (double)pool.kv_pages_total * g->page_size;
    }
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "model_path", g->model_path);
    cJSON_AddStringToObject(o, "tokenizer_path", a->tokenizer_path);
    cJSON_AddStringToObject(o, "served_model_name", g->served_model_name);
    cJSON_AddStringToObject(o, "host", g->host);
    cJSON_AddNumberToObject(o, "port", http_server_port(a->http));
    cJSON_AddStringToObject(o, "device", g->device);
    cJSON_AddNumberToObject(o, "context_length", g->context_length);
    cJSON_AddNumberToObject(o, "max_running_requests", g->max_running_requests);
    cJSON_AddNumberToObject(o, "max_total_tokens", max_tokens);
    cJSON_AddNumberToObject(o, "chunked_prefill_size", g->chunked_prefill_size);
    cJSON_AddNumberToObject(o, "page_size", g->page_size);
    cJSON_AddStringToObject(o, "kv_cache_dtype", g->kv_cache_bf16 ? "bfloat16" : "float32");
    cJSON_AddBoolToObject(o, "disable_radix_cache", g->disable_radix_cache);
    cJSON_AddNumberToObject(o, "cuda_graph_max_bs",
                            g->cuda_graph_max_bs > 0 ? g->cuda_graph_max_bs : 0);
    cJSON_AddBoolToObject(o, "disable_cuda_graph", g->cuda_graph_max_bs <= 0);
    cJSON_AddBoolToObject(o, "enable_metrics", g->enable_metrics);
    cJSON_AddBoolToObject(o, "enable_deterministic_inference", g->enable_deterministic_inference);
    cJSON_AddBoolToObject(o, "api_key_set", g->api_key != NULL);
    cJSON_AddStringToObject(o, "log_level", g->log_level);
    cJSON_AddNumberToObject(o, "threads", g->threads);
    cJSON_AddNumberToObject(o, "max_body_bytes", (double)g->max_body_bytes);
    cJSON_AddNumberToObject(o, "max_queued_requests", g->max_queued_requests);
    cJSON_AddNumberToObject(o, "shutdown_timeout", g->shutdown_timeout);
    cJSON_AddNumberToObject(o, "connection_timeout", g->connection_timeout);
    int world = a->group ? rank_group_size(a->group) : 1;
    int me = a->group ? rank_group_rank(a->group) : 0;
    cJSON_AddNumberToObject(o, "rank", me);
    cJSON_AddNumberToObject(o, "world_size", world);
    cJSON_AddBoolToObject(o, "load_balance", g->load_balance);
    cJSON_AddStringToObject(o, "moe_a2a_backend", g->moe_a2a_backend ? g->moe_a2a_backend : "none");
    cJSON_AddStringToObject(o, "moe_a2a_combine",
                            g->moe_a2a_combine ? g->moe_a2a_combine : "slots");
    cJSON_AddBoolToObject(o, "enable_dp_attention", g->enable_dp_attention);
    cJSON_AddNumberToObject(o, "tp_size", world);
    cJSON_AddNumberToObject(o, "dp_size", world);
    cJSON_AddNumberToObject(o, "ep_size", world);
    cJSON_AddNumberToObject(o, "stream_interval", 1);
    cJSON_AddBoolToObject(o, "skip_tokenizer_init", g->skip_tokenizer_init);
    cJSON_AddStringToObject(o, "load_format", g->load_format ? g->load_format : "auto");
    if (g->quantization)
        cJSON_AddStringToObject(o, "quantization", g->quantization);
    else
        cJSON_AddNullToObject(o, "quantization");
    cJSON_AddNumberToObject(o, "max_total_num_tokens", max_tokens);
    cJSON_AddNumberToObject(o, "max_req_input_len", g->context_length - 1);
    cJSON *states = cJSON_AddArrayToObject(o, "internal_states");
    rank_report *reports = NULL;
    double age = 0;
    if (a->group) {
        reports = xcalloc((size_t)world, sizeof *reports);
        age = rank_group_loads(a->group, reports);
    }
    for (int r = 0; r < world; r++)
        cJSON_AddItemToArray(states,
                             r == me ? api_own_state(a) : api_peer_state(a, r, &reports[r], age));
    free(reports);
    cJSON_AddStringToObject(o, "version", API_VERSION);
    api_reply_json(a, x, 200, o);
}

static void api_flush_cache(api_server *a, http_exchange *x) {
    if (!a->sched) {
        api_health(a, x);
        return;
    }
    scheduler_flush_cache(a->sched);
    static const char msg[] = "Cache flushed.\n";
    api_reply_text(a, x, 200, "text/plain; charset=utf-8", msg, sizeof msg - 1);
}

static void api_metrics(api_server *a, http_exchange *x) {
    if (!a->met) {
        api_error e;
        api_fail(&e, 404, NULL, "metrics are off (start the server with --enable-metrics)");
        api_reply_error(a, x, &e);
        return;
    }
    scheduler_stats st;
    if (a->sched) scheduler_get_stats(a->sched, &st);
    size_t len;
    char *text = metrics_render(a->met, a->sched ? &st : NULL, &len);
    metrics_count_http(a->met, 200);
    http_reply(x, 200, "text/plain; version=0.0.4; charset=utf-8", text, len, NULL);
    free(text);
}

/* POST /abort_request {"rid": "...", "abort_all": false} (SGLang's): the requests whose rid is
 * rid (or, for the n samples of one prompt, whose prompt's rid is) finish at the next step with
 * finish_reason abort, "aborted by /abort_request", keeping what they generated; abort_all
 * finishes every request. Answers 200 with an empty body whether or not anything matched, as
 * SGLang does. In a rank group with --load-balance a request may run on another rank than the
 * one it came to, so the abort also goes to every other rank (marked as relayed, so that none of
 * them passes it on again). */
static void api_abort_request(api_server *a, http_exchange *x, const cJSON *body) {
    api_error e;
    const cJSON *rid = cJSON_GetObjectItemCaseSensitive(body, "rid");
    bool all = false;
    if (rid && !cJSON_IsNull(rid) && !cJSON_IsString(rid)) {
        api_fail(&e, 400, "rid", "rid must be a string");
        api_reply_error(a, x, &e);
        return;
    }
    if (api_get_bool(body, "abort_all", &all, &e) < 0) {
        api_reply_error(a, x, &e);
        return;
    }
    const char *r = rid && cJSON_IsString(rid) ? rid->valuestring : "";
    if (!all && !*r) { /* nothing named: nothing to do */
        api_reply_text(a, x, 200, "text/plain; charset=utf-8", "", 0);
        return;
    }
    scheduler_abort(a->sched, r, all);
    LOG_INFO("api", "/abort_request: %s%s%s", all ? "every request" : "rid '", all ? "" : r,
             all ? "" : "'");
    pthread_mutex_lock(&a->submit_mu); /* api_stop_relays frees the relay under it */
    if (a->relay && !http_header(x, PROXY_ROUTED_HEADER)) {
        int n = rank_group_size(a->group), me = rank_group_rank(a->group), k = 0;
        const char **urls = xcalloc((size_t)n, sizeof *urls);
        for (int i = 0; i < n; i++)
            if (i != me) urls[k++] = rank_group_url(a->group, i);
        cJSON *note = cJSON_CreateObject();
        cJSON_AddStringToObject(note, "rid", r);
        cJSON_AddBoolToObject(note, "abort_all", all);
        char *s = cJSON_PrintUnformatted(note);
        cJSON_Delete(note);
        proxy_post_all(a->relay, urls, k, "/abort_request", s, http_header(x, "Authorization"), me);
        free(s);
        free(urls);
    }
    pthread_mutex_unlock(&a->submit_mu);
    api_reply_text(a, x, 200, "text/plain; charset=utf-8", "", 0);
}

/* ---- routing ---- */

typedef enum { API_BODY_NONE, API_BODY_JSON } api_body;

typedef struct {
    const char *path;
    const char *methods; /* as the Allow header lists them */
    api_body body;
    bool needs_engine;
    bool balanced; /* a generation request: may run on another rank */
    void (*plain)(api_server *a, http_exchange *x);
    void (*json)(api_server *a, http_exchange *x, const cJSON *body);
} api_route;

static const api_route api_routes[] = {
    {"/generate", "POST, PUT", API_BODY_JSON, true, true, NULL, api_generate},
    {"/v1/completions", "POST", API_BODY_JSON, true, true, NULL, api_completions},
    {"/v1/chat/completions", "POST", API_BODY_JSON, true, true, NULL, api_chat},
    {"/v1/models", "GET, HEAD", API_BODY_NONE, false, false, api_models, NULL},
    {"/health", "GET, HEAD", API_BODY_NONE, false, false, api_health, NULL},
    {"/health_generate", "GET, HEAD", API_BODY_NONE, false, false, api_health_generate, NULL},
    {"/get_model_info", "GET, HEAD", API_BODY_NONE, false, false, api_model_info, NULL},
    {"/model_info", "GET, HEAD", API_BODY_NONE, false, false, api_model_info, NULL},
    {"/get_server_info", "GET, HEAD", API_BODY_NONE, false, false, api_server_info, NULL},
    {"/server_info", "GET, HEAD", API_BODY_NONE, false, false, api_server_info, NULL},
    {"/flush_cache", "GET, HEAD, POST", API_BODY_NONE, false, false, api_flush_cache, NULL},
    {"/metrics", "GET, HEAD", API_BODY_NONE, false, false, api_metrics, NULL},
    {"/abort_request", "POST", API_BODY_JSON, true, false, NULL, api_abort_request},
    {"/update_weights_from_disk", "POST", API_BODY_JSON, true, false, NULL, api_update_weights},
    {"/tokenize", "POST", API_BODY_JSON, true, false, NULL, api_tokenize},
    {"/v1/tokenize", "POST", API_BODY_JSON, true, false, NULL, api_tokenize},
    {"/detokenize", "POST", API_BODY_JSON, true, false, NULL, api_detokenize},
    {"/v1/detokenize", "POST", API_BODY_JSON, true, false, NULL, api_detokenize},
};
/* GET /v1/models/ID (the OpenAI client's models.retrieve); ID may hold slashes. */
static const char api_model_prefix[] = "/v1/models/";

static bool api_method_allowed(const char *methods, const char *method) {
    size_t n = strlen(method);
    for (const char *p = methods; (p = strstr(p, method)); p += n)
        if ((p == methods || p[-1] == ' ') && (p[n] == ',' || p[n] == '\0')) return true;
    return false;
}

/* Constant-time comparison of the Authorization header with "Bearer KEY". */
static bool api_key_ok(const char *header, const char *key) {
    if (!header || strncmp(header, "Bearer ", 7)) return false;
    const char *got = header + 7;
    size_t gl = strlen(got), kl = strlen(key);
    unsigned diff = (unsigned)(gl ^ kl);
    for (size_t i = 0; i < kl; i++)
        diff |= (unsigned char)key[i] ^ (unsigned char)got[i < gl ? i : 0];
    return diff == 0;
}

static cJSON *api_parse_body(http_exchange *x, api_error *e) {
    size_t len;
    const char *body = http_body(x, &len);
    const char *end = NULL;
    cJSON *json = cJSON_ParseWithLengthOpts(body, len, &end, false);
    if (!json) {
        size_t at = end && end >= body ? (size_t)(end - body) : 0;
        api_fail(e, 400, NULL, "the body is not valid JSON (error near byte %zu)", at);
        return NULL;
    }
    while (end && (size_t)(end - body) < len &&
           (*end == ' ' || *end == '\n' || *end == '\r' || *end == '\t'))
        end++;
    if (end && (size_t)(end - body) < len) {
        cJSON_Delete(json);
        api_fail(e, 400, NULL, "the body has characters after its JSON value (byte %zu)",
                 (size_t)(end - body));
        return NULL;
    }
    if (!cJSON_IsObject(json)) {
        cJSON_Delete(json);
        api_fail(e, 400, NULL, "the body must be a JSON object");
        return NULL;
    }
    return json;
}

/* Relay x to the least-loaded rank when that is another one; false: run it here. */
static bool api_relay(api_server *a, http_exchange *x) {
    rank_group *g = a->group;
    if (!g || !a->args.load_balance || http_header(x, PROXY_ROUTED_HEADER)) return false;
    scheduler_stats st;
    scheduler_get_stats(a->sched, &st);
    int me = rank_group_rank(g);
    int to = rank_group_pick(g, (int64_t)st.n_running + st.n_waiting);
    if (to == me) return false;
    pthread_mutex_lock(&a->submit_mu); /* api_stop_relays frees the relay under it */
    bool open = a->relay && atomic_load(&a->state) == API_STATE_READY;
    if (open) {
        LOG_DEBUG("api", "%s %s -> rank %d", http_method(x), http_path(x), to);
        proxy_forward(a->relay, x, rank_group_url(g, to), me, to, NULL, NULL);
    }
    pthread_mutex_unlock(&a->submit_mu);
    return open;
}

void api_on_request(void *app, http_exchange *x) {
    api_server *a = app;
    api_reap(a);
    const char *method = http_method(x), *path = http_path(x);
    api_error e;
    if (a->args.api_key && strcmp(path, "/health") &&
        !api_key_ok(http_header(x, "Authorization"), a->args.api_key)) {
        api_fail(&e, 401, NULL, "missing or wrong API key (send 'Authorization: Bearer KEY')");
        api_reply_error_header(a, x, &e, "WWW-Authenticate: Bearer");
        return;
    }
    const api_route *route = NULL;
    for (size_t i = 0; i < sizeof api_routes / sizeof api_routes[0]; i++)
        if (!strcmp(api_routes[i].path, path)) route = &api_routes[i];
    const size_t np = sizeof api_model_prefix - 1;
    if (!route && !strncmp(path, api_model_prefix, np) && path[np]) {
        if (strcmp(method, "GET") && strcmp(method, "HEAD")) {
            api_fail(&e, 405, NULL, "%s does not accept %s (allowed: GET, HEAD)", path, method);
            api_reply_error_header(a, x, &e, "Allow: GET, HEAD");
        } else {
            api_model_retrieve(a, x, path + np);
        }
        return;
    }
    if (!route) {
        api_fail(&e, 404, NULL, "no endpoint at %s", path);
        api_reply_error(a, x, &e);
        return;
    }
    if (!api_method_allowed(route->methods, method)) {
        char allow[64];
        snprintf(allow, sizeof allow, "Allow: %s", route->methods);
        api_fail(&e, 405, NULL, "%s does not accept %s (allowed: %s)", path, method,
                 route->methods);
        api_reply_error_header(a, x, &e, allow);
        return;
    }
    if (route->needs_engine && atomic_load(&a->state) != API_STATE_READY) {
        api_health(a, x);
        return;
    }
    if (route->balanced && api_relay(a, x)) return;
    if (route->plain) {
        route->plain(a, x);
        return;
    }
    cJSON *body = api_parse_body(x, &e);
    if (!body) {
        api_reply_error(a, x, &e);
        return;
    }
    route->json(a, x, body);
    cJSON_Delete(body);
}

/* ---- life cycle ---- */

api_server *api_create(const server_args *args, const tokenizer *tok, const chat_template *tpl,
                       metrics *met) {
    api_server *a = xcalloc(1, sizeof *a);
    a->args = *args;
    char *abs = realpath(args->model_path, NULL);
    a->tokenizer_path = abs ? abs : xstrdup(args->model_path);
    a->tok = tok;
    a->tpl = tpl;
    a->met = met;
    a->created = (long)time(NULL);
    atomic_init(&a->state, API_STATE_STARTING);
    atomic_init(&a->seed_counter, (uint64_t)time(NULL) * UINT64_C(1000003) ^ (uint64_t)getpid());
    pthread_mutex_init(&a->submit_mu, NULL);
    api_global = a;
    return a;
}

void api_set_http(api_server *a, http_server *h) { a->http = h; }

void api_set_group(api_server *a, rank_group *g) {
    a->group = g;
    if (!g || rank_group_size(g) < 2 || !a->args.load_balance) return;
    char err[256];
    a->relay = proxy_create(a->http, err, sizeof err);
    if (!a->relay) {
        fprintf(stderr, "%s:%d: rank %d: %s (start with --no-load-balance to run without relays)\n",
                __FILE__, __LINE__, rank_group_rank(g), err);
        exit(1);
    }
}

void api_stop_relays(api_server *a) {
    pthread_mutex_lock(&a->submit_mu);
    proxy *p = a->relay;
    a->relay = NULL;
    pthread_mutex_unlock(&a->submit_mu);
    if (!p) return;
    double t0 = api_now();
    while (proxy_n_active(p) > 0 && api_now() - t0 < API_RELAY_DRAIN_S) {
        struct timespec ts = {0, 10 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    if (proxy_n_active(p) > 0)
        LOG_WARN("api", "%d relayed requests still running at shutdown: cut", proxy_n_active(p));
    proxy_free(p);
}

void api_set_ready(api_server *a, scheduler *s, const model_config *cfg) {
    a->sched = s;
    a->cfg = *cfg;
    atomic_store(&a->state, API_STATE_READY);
}

void api_drain(api_server *a) {
    pthread_mutex_lock(&a->submit_mu);
    atomic_store(&a->state, API_STATE_DRAINING);
    pthread_mutex_unlock(&a->submit_mu);
}

void api_free(api_server *a) {
    if (!a) return;
    if (a->relay) {
        LOG_WARN("api", "api_stop_relays was not called before http_server_stop");
        api_stop_relays(a);
    }
    api_reap(a);
    if (a->retired) LOG_WARN("api", "requests still running at exit");
    pthread_mutex_destroy(&a->submit_mu);
    free(a->tokenizer_path);
    if (api_global == a) api_global = NULL;
    free(a);
}
