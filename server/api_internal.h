/* Shared by api.c (routing, jobs, info endpoints), api_generate.c (/generate) and api_openai.c
 * (/v1/...). Not a public interface.
 *
 * A job is the work of one HTTP exchange: one or more items (a batch, n samples), each one engine
 * request. The job belongs to its exchange: it is only touched on the polling thread, or by the
 * engine's notify callback through http_ref_lock, so always under the exchange's lock. The one
 * piece of per-request state the engine thread uses on its own is the watch (the on_token
 * context: stop strings and latency metrics); it outlives the job when the request is still
 * running at close, and is freed once the request is done (api_reap). */
#ifndef MOESERVE_API_INTERNAL_H
#define MOESERVE_API_INTERNAL_H

#include <cjson/cJSON.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#include "runner/request.h"
#include "server/api.h"
#include "server/proxy.h"

#define API_MAX_ITEMS              4096 /* requests per exchange (batch x n) */
#define API_ITEM_BITS              12
#define API_MAX_STOPS              64
#define API_MAX_STOP_LEN           1024
#define API_MAX_TOP_LOGPROBS       20
#define API_DEFAULT_MAX_NEW_TOKENS 128

typedef enum { API_STATE_STARTING, API_STATE_READY, API_STATE_DRAINING } api_state;

typedef enum {
    API_KIND_GENERATE,   /* SGLang /generate */
    API_KIND_COMPLETION, /* /v1/completions */
    API_KIND_CHAT,       /* /v1/chat/completions */
    API_KIND_HEALTH,     /* /health_generate */
} api_kind;

/* The engine thread's companion of one request (the on_token context). */
typedef struct api_watch {
    struct api_watch *next; /* in the retired list */
    request *r;             /* a reference: the watch may outlive its job */
    metrics *met;
    double t_last;
    int n_tokens;
    detok_stream ds;
    char *text;
    size_t len, cap;
    char **stops;
    int n_stops;
    int matched; /* index into stops, -1 */
} api_watch;

/* One engine request of a job and what has been sent of it. */
typedef struct {
    request *r;
    api_watch *w;      /* NULL when neither stop strings nor metrics need one */
    int prompt_index;  /* which prompt of the batch */
    bool skip_special; /* decode without special tokens */
    bool no_stop_trim;
    bool hold_token;   /* hold back the newest token's text until done (stop token trimming) */
    size_t hold_bytes; /* hold back this much text until done (longest stop string - 1) */
    bool submitted;
    /* decoded output (polling thread) */
    detok_stream ds;
    char *text;
    size_t len, cap;
    int n_decoded;
    bool decode_finished;
    /* streaming progress */
    size_t text_sent; /* bytes of text sent */
    int ids_sent;     /* output ids covered by the last chunk */
    int lp_sent;      /* output logprobs sent (OpenAI deltas) */
    size_t lp_chars;  /* characters covered by the logprobs sent (text_offset) */
    bool started;     /* first chunk (role, echo) sent */
    bool finished;    /* final chunk sent */
    bool counted;     /* metrics recorded */
} api_item;

typedef struct {
    api_server *srv;
    http_ref ref;
    api_kind kind;
    bool stream;
    bool batch;            /* /generate: answer a JSON array; chunks carry "index" */
    bool text_in_logprobs; /* /generate: return_text_in_logprobs */
    int n_items;
    api_item *items;
    double t_arrival;
    double t_last_wake;
    /* OpenAI */
    char id[48];
    long created;
    char *model;
    int n_prompts;
    char **prompt_text; /* [n_prompts] for echo (NULL without echo) */
    int *prompt_len;    /* [n_prompts] tokens, for usage */
    bool echo;
    int logprobs; /* -1: none; completions: top count; chat: top_logprobs */
    bool include_usage;
    bool done_sent;
} api_job;

struct api_server {
    server_args args;
    char *tokenizer_path; /* the model folder, absolute, so a client elsewhere can load it */
    const tokenizer *tok;
    const chat_template *tpl;
    metrics *met;
    http_server *http;
    scheduler *sched;
    model_config cfg; /* of the loaded model (vocab size, eos ids) */
    atomic_int state;
    pthread_mutex_t submit_mu; /* submit vs drain */
    api_watch *retired;        /* polling thread only */
    long created;              /* start time, seconds since the epoch */
    atomic_uint_fast64_t seed_counter;
    struct rank_group *group; /* NULL: a group of one */
    proxy *relay;             /* relays to other ranks (a group with load_balance); under
                                 submit_mu once serving, NULL after api_stop_relays */
};

/* An error answer: message, OpenAI type and the offending parameter (may be NULL). */
typedef struct {
    int status;
    char message[512];
    char param[64]; /* "" when none */
} api_error;

int api_fail(api_error *e, int status, const char *param, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
void api_reply_error(api_server *a, http_exchange *x, const api_error *e);
void api_reply_json(api_server *a, http_exchange *x, int status, cJSON *json);
double api_now(void);

/* ---- JSON field readers: 1 = set, 0 = absent or null (out untouched), -1 = error in e ---- */
int api_int_value(const cJSON *v, const char *name, long long lo, long long hi, long long *out,
                  api_error *e);
int api_bool_value(const cJSON *v, const char *name, bool *out, api_error *e);
int api_get_int(const cJSON *obj, const char *key, long long lo, long long hi, long long *out,
                api_error *e);
int api_get_float(const cJSON *obj, const char *key, float *out, api_error *e);
int api_get_bool(const cJSON *obj, const char *key, bool *out, api_error *e);
/* A token id list: every id in [0, vocab). */
int api_parse_ids(const cJSON *v, const char *param, int vocab, int32_t **ids, int *n,
                  api_error *e);
/* stop: a string or a list of strings (empty strings dropped). */
int api_parse_stops(const cJSON *v, const char *param, char ***stops, int *n, api_error *e);
void api_free_stops(char **stops, int n);

/* Engine-side settings of one item, read from the request's fields. */
typedef struct {
    gen_request gen;
    bool max_new_given; /* max_new_tokens came from the client (else it is fitted to the context) */
    const char *max_new_key; /* the field it came in (max_tokens, ...); NULL: max_new_tokens */
    bool seed_given;
    int top_logprobs_num;
    char **stops;
    int n_stops;
    bool skip_special;
    bool no_stop_trim;
    int n; /* samples */
    sampler_bias *bias; /* gen.sampling.logit_bias, owned */
} api_params;

#define API_MAX_LOGIT_BIAS 1024 /* logit_bias entries a request may give */

void api_params_init(api_params *p);
/* The sampling fields both APIs share (temperature, top_p, top_k, min_p, the penalties, stop,
 * stop_token_ids, ignore_eos, skip_special_tokens, no_stop_trim, n), then the range check of
 * the sampler. Constrained decoding (regex, json_schema, ebnf) is refused. */
int api_read_sampling(const cJSON *o, api_params *p, api_error *e);
/* The finished sampler settings: ranges checked. */
int api_check_sampling(const api_params *p, api_error *e);
void api_params_free(api_params *p);

/* Job building: create the item's request from prompt ids and params (seed and max tokens
 * fitted), check it with the scheduler. 0, or -1 with e set. */
api_job *api_job_new(api_server *a, http_exchange *x, api_kind kind, int n_items);
int api_job_add(api_job *j, int item, const int32_t *ids, int n_ids, const api_params *p,
                int sample, const char *rid, api_error *e);
/* Register the job with the exchange (defer or stream) and submit its requests. Takes j. */
void api_job_start(api_job *j, http_exchange *x);
void api_job_free(api_job *j);

/* What one item's channel holds now (copied under its lock). */
typedef struct {
    int n_out;
    int32_t *ids;
    float *out_lp;
    int32_t *out_top_ids;
    float *out_top_lp;
    int n_in;
    float *in_lp;
    int32_t *in_top_ids;
    float *in_top_lp;
    int cached_tokens;
    finish_kind finish;
    int32_t matched_token;
    char error[256];
    bool done;
    double t_done;
} api_snap;

void api_snap_take(const api_item *it, api_snap *s);
void api_snap_free(api_snap *s);
/* Bring the item's decoded text up to the snapshot; returns the length that may be shown
 * (stop strings trimmed when done, held-back bytes left out while running). */
size_t api_item_visible(api_server *a, api_item *it, const api_snap *s);
const char *api_item_matched_stop(const api_item *it, const api_snap *s);
/* Record the finished item in the metrics (once). */
void api_item_count(api_job *j, api_item *it, const api_snap *s);
/* A whole (not streamed) answer's item: its snapshot into s (api_snap_free after), counted in
 * the metrics; returns the length of its text that may be shown. The first item the server
 * aborted sets *abort_msg to its reason (kept in buf): the exchange then fails with 503
 * (api_reply_aborted); an abort asked for by /abort_request answers what was generated, with
 * finish_reason abort, as SGLang does. */
size_t api_item_final(api_job *j, api_item *it, api_snap *s, const char **abort_msg, char *buf,
                      size_t buflen);
/* The 503 of a whole answer that the server aborted (api_item_final's abort_msg). */
void api_reply_aborted(api_server *a, http_exchange *x, const char *abort_msg);
/* The text of one token as logprob entries show it (malloc'ed; special tokens kept). */
char *api_token_text(const api_server *a, int32_t id, size_t *len);

/* ---- endpoints ---- */
void api_generate(api_server *a, http_exchange *x, const cJSON *body);
void api_completions(api_server *a, http_exchange *x, const cJSON *body);
void api_chat(api_server *a, http_exchange *x, const cJSON *body);
void api_models(api_server *a, http_exchange *x);
/* The body's "model", when given: 0 for the served model's name (or its path), else 400 (not a
 * string) or 404 (another model) in e. */
int api_check_model(api_server *a, const cJSON *body, api_error *e);
/* GET /v1/models/ID: the served model's entry, 404 for any other ID. */
void api_model_retrieve(api_server *a, http_exchange *x, const char *id);
void api_tokenize(api_server *a, http_exchange *x, const cJSON *body);
/* api_weights.c */
void api_update_weights(api_server *a, http_exchange *x, const cJSON *body);
void api_detokenize(api_server *a, http_exchange *x, const cJSON *body);

/* Per-kind answers, run under the exchange lock when every item is done (non-streaming), or to
 * append the new SSE events (streaming; returns true once the stream is complete). */
void api_generate_answer(api_job *j, http_exchange *x);
bool api_generate_fill(api_job *j, http_buf *out);
void api_openai_answer(api_job *j, http_exchange *x);
bool api_openai_fill(api_job *j, http_buf *out);

/* "data: <json>\n\n" (takes json). */
void api_sse(http_buf *out, cJSON *json);

#endif
