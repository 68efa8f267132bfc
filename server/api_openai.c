/* The OpenAI-compatible endpoints: POST /v1/completions, POST /v1/chat/completions, GET
 * /v1/models (notes/api.md).
 *
 * Choices:
 *   - model: absent or null means the served model; the served name and the model path are both
 *     accepted; anything else is 404 (model_not_found).
 *   - Choices are prompt-major: prompt i, sample j -> index i * n + j. Usage counts each prompt
 *     once, however many samples it has.
 *   - Streams carry text deltas. A chat stream opens each choice with a {"role": "assistant",
 *     "content": ""} delta when its first token arrives (benchmarks count chunks with choices as
 *     tokens, so nothing is sent before), and closes it with an empty delta carrying
 *     finish_reason; a completion stream puts finish_reason on its last text delta. The usage
 *     chunk ("choices": []) is sent only when stream_options.include_usage asks for it.
 *   - max_tokens defaults to 16 for completions (OpenAI's default) and, for chat, to whatever the
 *     context leaves after the prompt.
 *   - A request the server gave up on (shutdown) is answered 503 when not streaming, and with
 *     finish_reason "abort" when streaming.
 *   - Without a tokenizer (--skip-tokenizer-init): completions take token-id prompts only and
 *     answer empty text with the usual usage (a stream sends an empty-text chunk as tokens
 *     arrive, so the client sees progress); logprobs name tokens "token_id:N" at text_offset 0.
 *     Chat needs a tokenizer and a template: 400. */
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "server/api_internal.h"

#define API_OPENAI_DEFAULT_MAX_TOKENS 16

/* ---- GET /v1/models ---- */

static cJSON *api_model_entry(api_server *a) {
    cJSON *m = cJSON_CreateObject();
    cJSON_AddStringToObject(m, "id", a->args.served_model_name);
    cJSON_AddStringToObject(m, "object", "model");
    cJSON_AddNumberToObject(m, "created", (double)a->created);
    cJSON_AddStringToObject(m, "owned_by", "moeserve");
    cJSON_AddStringToObject(m, "root", a->args.served_model_name);
    cJSON_AddNullToObject(m, "parent");
    cJSON_AddNumberToObject(m, "max_model_len", a->args.context_length);
    return m;
}

void api_models(api_server *a, http_exchange *x) {
    cJSON *root = cJSON_CreateObject();
    cJSON_AddStringToObject(root, "object", "list");
    cJSON *data = cJSON_AddArrayToObject(root, "data");
    cJSON_AddItemToArray(data, api_model_entry(a));
    api_reply_json(a, x, 200, root);
}

void api_model_retrieve(api_server *a, http_exchange *x, const char *id) {
    if (strcmp(id, a->args.served_model_name)) {
        api_error e;
        api_fail(&e, 404, "model", "the model '%s' does not exist (this server serves '%s')", id,
                 a->args.served_model_name);
        api_reply_error(a, x, &e);
        return;
    }
    api_reply_json(a, x, 200, api_model_entry(a));
}

/* ---- requests ---- */

int api_check_model(api_server *a, const cJSON *body, api_error *e) {
    const cJSON *m = cJSON_GetObjectItemCaseSensitive(body, "model");
    if (!m || cJSON_IsNull(m)) return 0;
    if (!cJSON_IsString(m)) return api_fail(e, 400, "model", "model must be a string");
    if (!strcmp(m->valuestring, a->args.served_model_name) ||
        !strcmp(m->valuestring, a->args.model_path))
        return 0;
    return api_fail(e, 404, "model", "the model '%s' does not exist (this server serves '%s')",
                    m->valuestring, a->args.served_model_name);
}

static void api_openai_id(api_server *a, api_job *j, const char *prefix) {
    static const char hex[] = "0123456789abcdef";
    size_t n = strlen(prefix);
    memcpy(j->id, prefix, n);
    uint64_t r1 = (uint64_t)(uintptr_t)j ^ (uint64_t)(j->t_arrival * 1e9);
    uint64_t r2 = atomic_fetch_add(&a->seed_counter, UINT64_C(0x9E3779B97F4A7C15));
    for (int i = 0; i < 32; i++) {
        uint64_t *r = i < 16 ? &r1 : &r2;
        *r = *r * UINT64_C(6364136223846793005) + UINT64_C(1442695040888963407);
        j->id[n + i] = hex[(*r >> 60) & 15];
    }
    j->id[n + 32] = '\0';
}

/* The sampling fields of an OpenAI body (shared by both endpoints). */
static int api_openai_params(api_server *a, const cJSON *body, api_params *p, bool chat,
                             api_error *e) {
    long long v;
    int rc;
    if (api_read_sampling(body, p, e)) return -1;
    /* chat: max_completion_tokens wins over the older max_tokens */
    static const char *const chat_keys[] = {"max_completion_tokens", "max_tokens"};
    static const char *const completion_keys[] = {"max_tokens"};
    const char *const *keys = chat ? chat_keys : completion_keys;
    int n_keys = chat ? 2 : 1;
    p->gen.max_new_tokens = chat ? a->args.context_length : API_OPENAI_DEFAULT_MAX_TOKENS;
    for (int k = 0; k < n_keys; k++) {
        if ((rc = api_get_int(body, keys[k], 0, INT_MAX / 2, &v, e)) < 0) return -1;
        if (rc) {
            p->gen.max_new_tokens = (int)v;
            p->max_new_given = true;
            p->max_new_key = keys[k];
            break;
        }
    }
    if ((rc = api_get_int(body, "min_tokens", 0, INT_MAX / 2, &v, e)) < 0) return -1;
    if (rc) p->gen.min_new_tokens = (int)v;
    if ((rc = api_get_int(body, "seed", -(1LL << 53), 1LL << 53, &v, e)) < 0) return -1;
    if (rc) {
        p->gen.sampling.seed = (uint64_t)v;
        p->seed_given = true;
    }
    bool include_stop = false; /* vLLM's name for no_stop_trim */
    if (api_get_bool(body, "include_stop_str_in_output", &include_stop, e) < 0) return -1;
    if (include_stop) p->no_stop_trim = true;
    return api_check_sampling(p, e);
}

static int api_openai_stream_opts(const cJSON *body, api_job *j, api_error *e) {
    if (api_get_bool(body, "stream", &j->stream, e) < 0) return -1;
    const cJSON *so = cJSON_GetObjectItemCaseSensitive(body, "stream_options");
    if (so && !cJSON_IsNull(so)) {
        if (!cJSON_IsObject(so))
            return api_fail(e, 400, "stream_options", "stream_options must be an object");
        if (api_get_bool(so, "include_usage", &j->include_usage, e) < 0) return -1;
    }
    return 0;
}

/* Create the job's items: n samples of every prompt. Takes nothing. */
static int api_openai_items(api_job *j, int32_t **prompts, const int *lens, api_params *p,
                            api_error *e) {
    int item = 0;
    for (int i = 0; i < j->n_prompts; i++) {
        j->prompt_len[i] = lens[i];
        for (int s = 0; s < p->n; s++, item++) {
            if (api_job_add(j, item, prompts[i], lens[i], p, s, NULL, e)) return -1;
            j->items[item].prompt_index = i;
        }
    }
    return 0;
}

void api_completions(api_server *a, http_exchange *x, const cJSON *body) {
    api_error e;
    api_params p;
    api_params_init(&p);
    api_job *j = NULL;
    int32_t **prompts = NULL;
    int *lens = NULL, n_prompts = 0;
    char **texts = NULL;
    if (api_check_model(a, body, &e) || api_openai_params(a, body, &p, false, &e)) goto fail;

    const cJSON *prompt = cJSON_GetObjectItemCaseSensitive(body, "prompt");
    if (!prompt || cJSON_IsNull(prompt)) {
        api_fail(&e, 400, "prompt", "prompt is required");
        goto fail;
    }
    /* string | [string] | [int] | [[int]] */
    bool ids_list = cJSON_IsArray(prompt) && cJSON_IsNumber(cJSON_GetArrayItem(prompt, 0));
    if (cJSON_IsString(prompt) || ids_list)
        n_prompts = 1;
    else if (cJSON_IsArray(prompt))
        n_prompts = cJSON_GetArraySize(prompt);
    else {
        api_fail(&e, 400, "prompt",
                 "prompt must be a string, a list of strings, a list of token ids or a list of "
                 "lists of token ids");
        goto fail;
    }
    if (n_prompts == 0) {
        api_fail(&e, 400, "prompt", "prompt is empty");
        goto fail;
    }
    if ((long long)n_prompts * p.n > API_MAX_ITEMS) {
        api_fail(&e, 400, "n", "at most %d choices in one request", API_MAX_ITEMS);
        goto fail;
    }
    bool echo = false;
    long long logprobs = -1;
    if (api_get_bool(body, "echo", &echo, &e) < 0 ||
        api_get_int(body, "logprobs", 0, API_MAX_TOP_LOGPROBS, &logprobs, &e) < 0)
        goto fail;
    prompts = xcalloc((size_t)n_prompts, sizeof(int32_t *));
    lens = xcalloc((size_t)n_prompts, sizeof(int));
    texts = xcalloc((size_t)n_prompts, sizeof(char *));
    for (int i = 0; i < n_prompts; i++) {
        const cJSON *pi = n_prompts == 1 && (cJSON_IsString(prompt) || ids_list)
                              ? prompt
                              : cJSON_GetArrayItem(prompt, i);
        char param[32];
        snprintf(param, sizeof param, n_prompts == 1 && pi == prompt ? "prompt" : "prompt[%d]", i);
        if (cJSON_IsString(pi) && !a->tok) {
            api_fail(&e, 400, "prompt",
                     "%s: text prompts need a tokenizer, and this server was started with "
                     "--skip-tokenizer-init: give the prompt as token ids",
                     param);
            goto fail;
        } else if (cJSON_IsString(pi)) {
            if (tokenizer_encode(a->tok, pi->valuestring, strlen(pi->valuestring), true,
                                 &prompts[i], &lens[i])) {
                api_fail(&e, 400, "prompt", "%s is not valid UTF-8", param);
                goto fail;
            }
            texts[i] = xstrdup(pi->valuestring);
        } else if (cJSON_IsArray(pi)) {
            if (api_parse_ids(pi, param, a->cfg.vocab_size, &prompts[i], &lens[i], &e)) goto fail;
            texts[i] =
                a->tok ? tokenizer_decode(a->tok, prompts[i], lens[i], false, NULL) : xstrdup("");
        } else {
            api_fail(&e, 400, "prompt", "%s must be a string or a list of token ids", param);
            goto fail;
        }
        if (lens[i] == 0) {
            api_fail(&e, 400, "prompt", "%s: the prompt is empty", param);
            goto fail;
        }
    }
    if (logprobs >= 0) {
        p.gen.return_logprob = true;
        p.top_logprobs_num = (int)logprobs;
        if (echo) p.gen.logprob_start_len = 0;
    }
    j = api_job_new(a, x, API_KIND_COMPLETION, n_prompts * p.n);
    api_openai_id(a, j, "cmpl-");
    j->model = xstrdup(a->args.served_model_name);
    j->echo = echo;
    j->logprobs = (int)logprobs;
    j->n_prompts = n_prompts;
    j->prompt_len = xcalloc((size_t)n_prompts, sizeof(int));
    j->prompt_text = texts;
    texts = NULL;
    if (api_openai_stream_opts(body, j, &e) || api_openai_items(j, prompts, lens, &p, &e))
        goto fail;
    for (int i = 0; i < n_prompts; i++)
        free(prompts[i]);
    free(prompts);
    free(lens);
    api_params_free(&p);
    api_job_start(j, x);
    return;
fail:
    if (j) api_job_free(j);
    for (int i = 0; i < n_prompts && prompts; i++)
        free(prompts[i]);
    for (int i = 0; i < n_prompts && texts; i++)
        free(texts[i]);
    free(prompts);
    free(lens);
    free(texts);
    api_params_free(&p);
    api_reply_error(a, x, &e);
}

/* The text of one message content: a string, null, or a list of {"type": "text", "text"}. */
static char *api_chat_content(const cJSON *c, int i, api_error *e) {
    if (!c || cJSON_IsNull(c)) return xstrdup("");
    if (cJSON_IsString(c)) return xstrdup(c->valuestring);
    if (!cJSON_IsArray(c)) {
        api_fail(e, 400, "messages", "messages[%d].content must be a string or a list of parts", i);
        return NULL;
    }
    size_t len = 0;
    char *out = xstrdup("");
    const cJSON *part;
    cJSON_ArrayForEach(part, c) {
        const cJSON *type = cJSON_GetObjectItemCaseSensitive(part, "type");
        const cJSON *text = cJSON_GetObjectItemCaseSensitive(part, "text");
        if (!cJSON_IsString(type) || strcmp(type->valuestring, "text") || !cJSON_IsString(text)) {
            free(out);
            api_fail(e, 400, "messages",
                     "messages[%d].content: only parts {\"type\": \"text\", \"text\": ...} are "
                     "supported",
                     i);
            return NULL;
        }
        size_t n = strlen(text->valuestring);
        out = xrealloc(out, len + n + 1);
        memcpy(out + len, text->valuestring, n + 1);
        len += n;
    }
    return out;
}

void api_chat(api_server *a, http_exchange *x, const cJSON *body) {
    api_error e;
    api_params p;
    api_params_init(&p);
    api_job *j = NULL;
    chat_message *msgs = NULL;
    int n_msgs = 0;
    int32_t *ids = NULL;
    int n_ids = 0;
    char *prompt_text = NULL;
    if (api_check_model(a, body, &e)) goto fail;
    if (!a->tok) {
        api_fail(&e, 400, NULL,
                 "chat needs a tokenizer and a chat template, and this server was started with "
                 "--skip-tokenizer-init: use /generate with input_ids, or /v1/completions with "
                 "a prompt of token ids");
        goto fail;
    }
    if (a->tpl->kind == CHAT_TEMPLATE_NONE) {
        api_fail(&e, 400, NULL, "chat is not available: %s", a->tpl->why);
        goto fail;
    }
    const cJSON *messages = cJSON_GetObjectItemCaseSensitive(body, "messages");
    if (!cJSON_IsArray(messages) || cJSON_GetArraySize(messages) == 0) {
        api_fail(&e, 400, "messages", "messages must be a non-empty list of messages");
        goto fail;
    }
    const cJSON *tools = cJSON_GetObjectItemCaseSensitive(body, "tools");
    if (tools && !cJSON_IsNull(tools) && !(cJSON_IsArray(tools) && !tools->child)) {
        api_fail(&e, 400, "tools", "tools are not supported");
        goto fail;
    }
    const cJSON *rf = cJSON_GetObjectItemCaseSensitive(body, "response_format");
    const cJSON *rft = cJSON_GetObjectItemCaseSensitive(rf, "type");
    if (rf && !cJSON_IsNull(rf) && !(cJSON_IsString(rft) && !strcmp(rft->valuestring, "text"))) {
        api_fail(&e, 400, "response_format", "response_format other than text is not supported");
        goto fail;
    }
    if (api_openai_params(a, body, &p, true, &e)) goto fail;
    bool logprobs = false, add_generation_prompt = true;
    long long top = 0;
    int rc_top;
    if (api_get_bool(body, "logprobs", &logprobs, &e) < 0 ||
        (rc_top = api_get_int(body, "top_logprobs", 0, API_MAX_TOP_LOGPROBS, &top, &e)) < 0 ||
        api_get_bool(body, "add_generation_prompt", &add_generation_prompt, &e) < 0)
        goto fail;
    if (rc_top && !logprobs) {
        api_fail(&e, 400, "top_logprobs", "top_logprobs needs logprobs: true");
        goto fail;
    }
    n_msgs = cJSON_GetArraySize(messages);
    msgs = xcalloc((size_t)n_msgs, sizeof *msgs);
    for (int i = 0; i < n_msgs; i++) {
        const cJSON *m = cJSON_GetArrayItem(messages, i);
        const cJSON *role = cJSON_GetObjectItemCaseSensitive(m, "role");
        if (!cJSON_IsObject(m) || !cJSON_IsString(role) || !role->valuestring[0]) {
            api_fail(&e, 400, "messages", "messages[%d] must be an object with a string role", i);
            goto fail;
        }
        msgs[i].role = role->valuestring;
        msgs[i].content = api_chat_content(cJSON_GetObjectItemCaseSensitive(m, "content"), i, &e);
        if (!msgs[i].content) goto fail;
    }
    prompt_text = chat_template_render(a->tpl, msgs, n_msgs, add_generation_prompt);
    if (tokenizer_encode(a->tok, prompt_text, strlen(prompt_text), false, &ids, &n_ids)) {
        api_fail(&e, 400, "messages", "the messages are not valid UTF-8");
        goto fail;
    }
    if (p.n > API_MAX_ITEMS) {
        api_fail(&e, 400, "n", "at most %d choices in one request", API_MAX_ITEMS);
        goto fail;
    }
    if (logprobs) {
        p.gen.return_logprob = true;
        p.top_logprobs_num = (int)top;
    }
    j = api_job_new(a, x, API_KIND_CHAT, p.n);
    api_openai_id(a, j, "chatcmpl-");
    j->model = xstrdup(a->args.served_model_name);
    j->logprobs = logprobs ? (int)top : -1;
    j->n_prompts = 1;
    j->prompt_len = xcalloc(1, sizeof(int));
    if (api_openai_stream_opts(body, j, &e) || api_openai_items(j, &ids, &n_ids, &p, &e)) goto fail;
    free(ids);
    free(prompt_text);
    for (int i = 0; i < n_msgs; i++)
        free((char *)msgs[i].content);
    free(msgs);
    api_params_free(&p);
    api_job_start(j, x);
    return;
fail:
    if (j) api_job_free(j);
    free(ids);
    free(prompt_text);
    for (int i = 0; i < n_msgs && msgs; i++)
        free((char *)msgs[i].content);
    free(msgs);
    api_params_free(&p);
    api_reply_error(a, x, &e);
}

/* ---- answers ---- */

static const char *api_openai_finish(finish_kind f) {
    switch (f) {
    case FINISH_STOP_TOKEN:
    case FINISH_STOP_STRING: return "stop";
    case FINISH_LENGTH: return "length";
    case FINISH_ABORT: return "abort";
    case FINISH_NONE: break;
    }
    return NULL;
}

static void api_openai_add_finish(cJSON *choice, const api_item *it, const api_snap *s) {
    const char *f = s->done ? api_openai_finish(s->finish) : NULL;
    if (f)
        cJSON_AddStringToObject(choice, "finish_reason", f);
    else
        cJSON_AddNullToObject(choice, "finish_reason");
    const char *stop = api_item_matched_stop(it, s);
    if (s->done && s->finish == FINISH_STOP_TOKEN)
        cJSON_AddNumberToObject(choice, "matched_stop", s->matched_token);
    else if (s->done && stop)
        cJSON_AddStringToObject(choice, "matched_stop", stop);
    else
        cJSON_AddNullToObject(choice, "matched_stop");
}

static size_t api_utf8_chars(const char *s, size_t n) {
    size_t c = 0;
    for (size_t i = 0; i < n; i++)
        c += ((unsigned char)s[i] & 0xC0) != 0x80;
    return c;
}

/* Completions logprobs of tokens ids[from..to): {tokens, token_logprobs, top_logprobs,
 * text_offset}; offsets count characters from *offset, which advances. */
typedef struct {
    cJSON *tokens, *token_logprobs, *top_logprobs, *text_offset;
} api_lp_lists;

static void api_lp_lists_init(api_lp_lists *l, cJSON *parent) {
    l->tokens = cJSON_AddArrayToObject(parent, "tokens");
    l->token_logprobs = cJSON_AddArrayToObject(parent, "token_logprobs");
    l->top_logprobs = cJSON_AddArrayToObject(parent, "top_logprobs");
    l->text_offset = cJSON_AddArrayToObject(parent, "text_offset");
}

static void api_lp_lists_add(api_server *a, api_lp_lists *l, const int32_t *ids, const float *lp,
                             const int32_t *top_ids, const float *top_lp, int k, int from, int to,
                             size_t *offset) {
    for (int t = from; t < to; t++) {
        size_t len;
        char *tok = api_token_text(a, ids[t], &len);
        cJSON_AddItemToArray(l->tokens, cJSON_CreateString(tok));
        cJSON_AddItemToArray(l->token_logprobs,
                             isnan(lp[t]) ? cJSON_CreateNull() : cJSON_CreateNumber(lp[t]));
        cJSON_AddItemToArray(l->text_offset, cJSON_CreateNumber((double)*offset));
        if (a->tok) *offset += api_utf8_chars(tok, len); /* else there is no text to point in */
        free(tok);
        if (isnan(lp[t]) || (k > 0 && top_ids[(size_t)t * k] < 0)) {
            cJSON_AddItemToArray(l->top_logprobs, cJSON_CreateNull());
            continue;
        }
        cJSON *d = cJSON_CreateObject();
        for (int q = 0; q < k && top_ids[(size_t)t * k + q] >= 0; q++) {
            char *tt = api_token_text(a, top_ids[(size_t)t * k + q], NULL);
            if (!cJSON_GetObjectItemCaseSensitive(d, tt))
                cJSON_AddNumberToObject(d, tt, top_lp[(size_t)t * k + q]);
            free(tt);
        }
        cJSON_AddItemToArray(l->top_logprobs, d);
    }
}

/* Chat logprobs entries of output tokens [from, to) appended to content. */
static void api_chat_lp_add(api_server *a, cJSON *content, const api_snap *s, int k, int from,
                            int to) {
    for (int t = from; t < to; t++) {
        cJSON *e = cJSON_CreateObject();
        for (int q = -1; q < k; q++) {
            int32_t id = q < 0 ? s->ids[t] : s->out_top_ids[(size_t)t * k + q];
            float lp = q < 0 ? s->out_lp[t] : s->out_top_lp[(size_t)t * k + q];
            if (id < 0) break;
            cJSON *dst = e;
            if (q >= 0) {
                cJSON *tops = cJSON_GetObjectItemCaseSensitive(e, "top_logprobs");
                dst = cJSON_CreateObject();
                cJSON_AddItemToArray(tops, dst);
            }
            size_t len;
            char *tok = api_token_text(a, id, &len);
            size_t blen = 0;
            const char *bytes = a->tok ? tokenizer_token_bytes(a->tok, id, &blen) : NULL;
            cJSON_AddStringToObject(dst, "token", tok);
            cJSON_AddNumberToObject(dst, "logprob", lp);
            cJSON *b = cJSON_AddArrayToObject(dst, "bytes");
            for (size_t i = 0; bytes && i < blen; i++)
                cJSON_AddItemToArray(b, cJSON_CreateNumber((unsigned char)bytes[i]));
            free(tok);
            if (q < 0) cJSON_AddArrayToObject(e, "top_logprobs");
        }
        cJSON_AddItemToArray(content, e);
    }
}

static cJSON *api_openai_envelope(api_job *j) {
    cJSON *root = cJSON_CreateObject();
    cJSON_AddStringToObject(root, "id", j->id);
    const char *object = j->kind == API_KIND_CHAT
                             ? (j->stream ? "chat.completion.chunk" : "chat.completion")
                             : "text_completion";
    cJSON_AddStringToObject(root, "object", object);
    cJSON_AddNumberToObject(root, "created", (double)j->created);
    cJSON_AddStringToObject(root, "model", j->model);
    return root;
}

static cJSON *api_openai_usage(api_job *j) {
    long long prompt = 0, completion = 0;
    for (int i = 0; i < j->n_prompts; i++)
        prompt += j->prompt_len[i];
    for (int i = 0; i < j->n_items; i++) {
        request *r = j->items[i].r;
        pthread_mutex_lock(&r->mu);
        completion += r->n_out;
        pthread_mutex_unlock(&r->mu);
    }
    cJSON *u = cJSON_CreateObject();
    cJSON_AddNumberToObject(u, "prompt_tokens", (double)prompt);
    cJSON_AddNumberToObject(u, "completion_tokens", (double)completion);
    cJSON_AddNumberToObject(u, "total_tokens", (double)(prompt + completion));
    return u;
}

/* The logprobs of one completion choice: echo's prompt tokens (when first) and output tokens
 * [from, to). */
static cJSON *api_completion_lp(api_job *j, api_item *it, const api_snap *s, bool with_prompt,
                                int from, int to, size_t *offset) {
    if (j->logprobs < 0) return cJSON_CreateNull();
    api_server *a = j->srv;
    request *r = it->r;
    int k = r->top_logprobs_num;
    cJSON *o = cJSON_CreateObject();
    api_lp_lists l;
    api_lp_lists_init(&l, o);
    if (with_prompt && s->n_in > 0)
        api_lp_lists_add(a, &l, r->prompt + (r->gen.n_prompt - s->n_in), s->in_lp, s->in_top_ids,
                         s->in_top_lp, k, 0, s->n_in, offset);
    api_lp_lists_add(a, &l, s->ids, s->out_lp, s->out_top_ids, s->out_top_lp, k, from, to, offset);
    return o;
}

void api_openai_answer(api_job *j, http_exchange *x) {
    cJSON *root = api_openai_envelope(j);
    cJSON *choices = cJSON_AddArrayToObject(root, "choices");
    const char *abort_msg = NULL;
    char abort_buf[256];
    for (int i = 0; i < j->n_items; i++) {
        api_item *it = &j->items[i];
        api_snap s;
        size_t visible = api_item_final(j, it, &s, &abort_msg, abort_buf, sizeof abort_buf);
        cJSON *c = cJSON_CreateObject();
        cJSON_AddNumberToObject(c, "index", i);
        char *text = xmalloc(visible + 1);
        memcpy(text, it->text, visible);
        text[visible] = '\0';
        if (j->kind == API_KIND_CHAT) {
            cJSON *msg = cJSON_AddObjectToObject(c, "message");
            cJSON_AddStringToObject(msg, "role", "assistant");
            cJSON_AddStringToObject(msg, "content", text);
            if (j->logprobs >= 0) {
                cJSON *lp = cJSON_AddObjectToObject(c, "logprobs");
                api_chat_lp_add(j->srv, cJSON_AddArrayToObject(lp, "content"), &s,
                                it->r->top_logprobs_num, 0, s.n_out);
            } else {
                cJSON_AddNullToObject(c, "logprobs");
            }
        } else {
            const char *echo = j->echo ? j->prompt_text[it->prompt_index] : "";
            size_t el = strlen(echo);
            char *full = xmalloc(el + visible + 1);
            memcpy(full, echo, el);
            memcpy(full + el, text, visible + 1);
            cJSON_AddStringToObject(c, "text", full);
            free(full);
            size_t offset = 0;
            cJSON_AddItemToObject(c, "logprobs",
                                  api_completion_lp(j, it, &s, j->echo, 0, s.n_out, &offset));
        }
        free(text);
        api_openai_add_finish(c, it, &s);
        cJSON_AddItemToArray(choices, c);
        api_snap_free(&s);
    }
    if (abort_msg) {
        cJSON_Delete(root);
        api_reply_aborted(j->srv, x, abort_msg);
        return;
    }
    cJSON_AddItemToObject(root, "usage", api_openai_usage(j));
    api_reply_json(j->srv, x, 200, root);
}

/* A chunk with one choice; returns the choice to fill. */
static cJSON *api_openai_chunk(api_job *j, int index, cJSON **root) {
    *root = api_openai_envelope(j);
    cJSON *choices = cJSON_AddArrayToObject(*root, "choices");
    cJSON *c = cJSON_CreateObject();
    cJSON_AddNumberToObject(c, "index", index);
    cJSON_AddItemToArray(choices, c);
    return c;
}

static void api_chat_fill_item(api_job *j, int i, api_item *it, const api_snap *s, size_t visible,
                               http_buf *out) {
    cJSON *root, *c, *delta;
    if (!it->started && (s->n_out > 0 || s->done)) {
        c = api_openai_chunk(j, i, &root);
        delta = cJSON_AddObjectToObject(c, "delta");
        cJSON_AddStringToObject(delta, "role", "assistant");
        cJSON_AddStringToObject(delta, "content", "");
        cJSON_AddNullToObject(c, "logprobs");
        cJSON_AddNullToObject(c, "finish_reason");
        api_sse(out, root);
        it->started = true;
    }
    /* logprobs go with text: those of tokens whose text is out (all of them once done) */
    int lp_to = s->done ? s->n_out : it->n_decoded;
    if (visible > it->text_sent) {
        c = api_openai_chunk(j, i, &root);
        delta = cJSON_AddObjectToObject(c, "delta");
        char *t = xmalloc(visible - it->text_sent + 1);
        memcpy(t, it->text + it->text_sent, visible - it->text_sent);
        t[visible - it->text_sent] = '\0';
        cJSON_AddStringToObject(delta, "content", t);
        free(t);
        if (j->logprobs >= 0 && lp_to > it->lp_sent) {
            cJSON *lp = cJSON_AddObjectToObject(c, "logprobs");
            api_chat_lp_add(j->srv, cJSON_AddArrayToObject(lp, "content"), s,
                            it->r->top_logprobs_num, it->lp_sent, lp_to);
            it->lp_sent = lp_to;
        } else {
            cJSON_AddNullToObject(c, "logprobs");
        }
        cJSON_AddNullToObject(c, "finish_reason");
        api_sse(out, root);
        it->text_sent = visible;
    }
    if (s->done) {
        c = api_openai_chunk(j, i, &root);
        cJSON_AddObjectToObject(c, "delta");
        if (j->logprobs >= 0 && s->n_out > it->lp_sent) {
            cJSON *lp = cJSON_AddObjectToObject(c, "logprobs");
            api_chat_lp_add(j->srv, cJSON_AddArrayToObject(lp, "content"), s,
                            it->r->top_logprobs_num, it->lp_sent, s->n_out);
            it->lp_sent = s->n_out;
        } else {
            cJSON_AddNullToObject(c, "logprobs");
        }
        api_openai_add_finish(c, it, s);
        api_sse(out, root);
    }
}

static void api_completion_fill_item(api_job *j, int i, api_item *it, const api_snap *s,
                                     size_t visible, http_buf *out) {
    cJSON *root, *c;
    if (!it->started && j->echo) {
        c = api_openai_chunk(j, i, &root);
        cJSON_AddStringToObject(c, "text", j->prompt_text[it->prompt_index]);
        if (j->logprobs >= 0) {
            cJSON_AddItemToObject(c, "logprobs",
                                  api_completion_lp(j, it, s, true, 0, 0, &it->lp_chars));
        } else {
            cJSON_AddNullToObject(c, "logprobs");
        }
        cJSON_AddNullToObject(c, "finish_reason");
        cJSON_AddNullToObject(c, "matched_stop");
        api_sse(out, root);
    }
    it->started = true;
    bool new_ids = !j->srv->tok && it->n_decoded > it->ids_sent; /* progress without text */
    if (visible > it->text_sent || s->done || new_ids) {
        c = api_openai_chunk(j, i, &root);
        char *t = xmalloc(visible - it->text_sent + 1);
        memcpy(t, it->text + it->text_sent, visible - it->text_sent);
        t[visible - it->text_sent] = '\0';
        cJSON_AddStringToObject(c, "text", t);
        free(t);
        int lp_to = s->done ? s->n_out : it->n_decoded;
        cJSON_AddItemToObject(
            c, "logprobs", api_completion_lp(j, it, s, false, it->lp_sent, lp_to, &it->lp_chars));
        if (j->logprobs >= 0) it->lp_sent = lp_to;
        api_openai_add_finish(c, it, s);
        api_sse(out, root);
        it->text_sent = visible;
        it->ids_sent = it->n_decoded;
    }
}

bool api_openai_fill(api_job *j, http_buf *out) {
    bool all = true;
    for (int i = 0; i < j->n_items; i++) {
        api_item *it = &j->items[i];
        if (it->finished) continue;
        api_snap s;
        api_snap_take(it, &s);
        size_t visible = api_item_visible(j->srv, it, &s);
        if (j->kind == API_KIND_CHAT)
            api_chat_fill_item(j, i, it, &s, visible, out);
        else
            api_completion_fill_item(j, i, it, &s, visible, out);
        if (s.done) {
            it->finished = true;
            api_item_count(j, it, &s);
        } else {
            all = false;
        }
        api_snap_free(&s);
    }
    if (all && !j->done_sent) {
        if (j->include_usage) {
            cJSON *root = api_openai_envelope(j);
            cJSON_AddArrayToObject(root, "choices");
            cJSON_AddItemToObject(root, "usage", api_openai_usage(j));
            api_sse(out, root);
        }
        http_buf_append(out, "data: [DONE]\n\n", 14);
        j->done_sent = true;
    }
    return all;
}
