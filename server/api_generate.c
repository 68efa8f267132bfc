/* POST /generate: SGLang's native generation endpoint (notes/api.md).
 *
 * A prompt is text (string, or a list for a batch) or input_ids (a list of ints, or a list of
 * lists for a batch). sampling_params is one object for every prompt or a list with one per
 * prompt; return_logprob, logprob_start_len, top_logprobs_num and rid may likewise be lists.
 * With n > 1 each prompt gives n answers, prompt-major (prompt i, sample j -> i * n + j), as
 * SGLang orders them. A batch or n > 1 answers a JSON array; its stream chunks carry "index".
 * Stream chunks are cumulative (text, output_ids, completion_tokens); finish_reason is null
 * until the last chunk of each request, which alone has e2e_latency.
 * Without a tokenizer (--skip-tokenizer-init) a text prompt is refused with 400 and answers
 * (whole or streamed) have no "text" key, as SGLang's token-id answers: output_ids and
 * meta_info; return_text_in_logprobs gives null texts. */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "server/api_internal.h"
#include "server/generate_json.h"

/* The value of key for prompt i: element i of a per-prompt list, or the value itself. */
static const cJSON *api_gen_pick(const cJSON *body, const char *key, int i, int n_prompts,
                                 bool batch, api_error *e, bool *bad) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(body, key);
    if (!v || !cJSON_IsArray(v)) return v;
    if (!batch || cJSON_GetArraySize(v) != n_prompts) {
        *bad = true;
        api_fail(e, 400, key, "%s must be a single value%s", key,
                 batch ? " or a list with one value per prompt" : "");
        return NULL;
    }
    return cJSON_GetArrayItem(v, i);
}

/* One prompt's settings: its sampling_params object and the top-level logprob fields. */
static int api_gen_params(api_server *a, const cJSON *body, int i, int n_prompts, bool batch,
                          api_params *p, api_error *e) {
    bool bad = false;
    const cJSON *sp = cJSON_GetObjectItemCaseSensitive(body, "sampling_params");
    if (sp && cJSON_IsArray(sp)) {
        if (!batch || cJSON_GetArraySize(sp) != n_prompts)
            return api_fail(e, 400, "sampling_params",
                            "sampling_params must be an object, or a list with one object per "
                            "prompt");
        sp = cJSON_GetArrayItem(sp, i);
    }
    if (sp && !cJSON_IsNull(sp) && !cJSON_IsObject(sp))
        return api_fail(e, 400, "sampling_params", "sampling_params must be an object");
    long long v;
    int rc;
    if ((rc = api_get_int(sp, "max_new_tokens", 0, INT_MAX / 2, &v, e)) < 0) return -1;
    if (rc) {
        p->gen.max_new_tokens = (int)v;
        p->max_new_given = true;
    }
    if ((rc = api_get_int(sp, "min_new_tokens", 0, INT_MAX / 2, &v, e)) < 0) return -1;
    if (rc) p->gen.min_new_tokens = (int)v;
    if ((rc = api_get_int(sp, "sampling_seed", -(1LL << 53), 1LL << 53, &v, e)) < 0) return -1;
    if (rc) {
        p->gen.sampling.seed = (uint64_t)v;
        p->seed_given = true;
    }
    if (api_read_sampling(sp, p, e) || api_check_sampling(p, e)) return -1;

    bool return_logprob = false;
    const cJSON *f = api_gen_pick(body, "return_logprob", i, n_prompts, batch, e, &bad);
    if (bad || api_bool_value(f, "return_logprob", &return_logprob, e) < 0) return -1;
    p->gen.return_logprob = return_logprob;
    f = api_gen_pick(body, "logprob_start_len", i, n_prompts, batch, e, &bad);
    if (bad) return -1;
    if ((rc = api_int_value(f, "logprob_start_len", -1, INT_MAX / 2, &v, e)) < 0) return -1;
    if (rc && return_logprob) p->gen.logprob_start_len = (int)v;
    f = api_gen_pick(body, "top_logprobs_num", i, n_prompts, batch, e, &bad);
    if (bad) return -1;
    if ((rc = api_int_value(f, "top_logprobs_num", 0, API_MAX_TOP_LOGPROBS, &v, e)) < 0) return -1;
    if (rc && return_logprob) p->top_logprobs_num = (int)v;
    (void)a;
    return 0;
}

/* Prompt i as token ids (malloc'ed). */
static int api_gen_prompt(api_server *a, const cJSON *text, const cJSON *ids, int i, bool batch,
                          int32_t **out, int *n, api_error *e) {
    char param[32];
    if (text) {
        const cJSON *t = batch ? cJSON_GetArrayItem(text, i) : text;
        snprintf(param, sizeof param, batch ? "text[%d]" : "text", i);
        if (!cJSON_IsString(t)) return api_fail(e, 400, "text", "%s must be a string", param);
        if (tokenizer_encode(a->tok, t->valuestring, strlen(t->valuestring), true, out, n))
            return api_fail(e, 400, "text", "%s is not valid UTF-8", param);
    } else {
        const cJSON *l = batch ? cJSON_GetArrayItem(ids, i) : ids;
        snprintf(param, sizeof param, batch ? "input_ids[%d]" : "input_ids", i);
        if (api_parse_ids(l, param, a->cfg.vocab_size, out, n, e)) return -1;
    }
    if (*n == 0) {
        free(*out);
        *out = NULL;
        return api_fail(e, 400, text ? "text" : "input_ids", "%s: the prompt is empty", param);
    }
    return 0;
}

void api_generate(api_server *a, http_exchange *x, const cJSON *body) {
    api_error e;
    const cJSON *text = cJSON_GetObjectItemCaseSensitive(body, "text");
    const cJSON *ids = cJSON_GetObjectItemCaseSensitive(body, "input_ids");
    if (cJSON_IsNull(text)) text = NULL;
    if (cJSON_IsNull(ids)) ids = NULL;
    static const char *const unsupported[] = {"input_embeds", "image_data", "audio_data",
                                              "video_data"};
    for (size_t i = 0; i < sizeof unsupported / sizeof unsupported[0]; i++) {
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(body, unsupported[i]);
        if (v && !cJSON_IsNull(v)) {
            api_fail(&e, 400, unsupported[i], "%s is not supported (text models only)",
                     unsupported[i]);
            api_reply_error(a, x, &e);
            return;
        }
    }
    if (!text == !ids) {
        api_fail(&e, 400, NULL, "give exactly one of text and input_ids");
        api_reply_error(a, x, &e);
        return;
    }
    if (text && !a->tok) {
        api_fail(&e, 400, "text",
                 "text prompts need a tokenizer, and this server was started with "
                 "--skip-tokenizer-init: send input_ids");
        api_reply_error(a, x, &e);
        return;
    }
    int n_prompts = 1;
    bool batch = false;
    if (text) {
        if (cJSON_IsArray(text)) {
            batch = true;
            n_prompts = cJSON_GetArraySize(text);
        } else if (!cJSON_IsString(text)) {
            api_fail(&e, 400, "text", "text must be a string or a list of strings");
            api_reply_error(a, x, &e);
            return;
        }
    } else {
        if (!cJSON_IsArray(ids)) {
            api_fail(&e, 400, "input_ids",
                     "input_ids must be a list of token ids or a list of lists");
            api_reply_error(a, x, &e);
            return;
        }
        if (cJSON_IsArray(cJSON_GetArrayItem(ids, 0))) {
            batch = true;
            n_prompts = cJSON_GetArraySize(ids);
        }
    }
    if (n_prompts == 0) {
        api_fail(&e, 400, text ? "text" : "input_ids", "the batch is empty");
        api_reply_error(a, x, &e);
        return;
    }
    if (n_prompts > API_MAX_ITEMS) {
        api_fail(&e, 400, NULL, "at most %d prompts in one request", API_MAX_ITEMS);
        api_reply_error(a, x, &e);
        return;
    }
    bool stream = false, text_in_logprobs = false;
    if (api_get_bool(body, "stream", &stream, &e) < 0 ||
        api_get_bool(body, "return_text_in_logprobs", &text_in_logprobs, &e) < 0) {
        api_reply_error(a, x, &e);
        return;
    }
    const cJSON *rid = cJSON_GetObjectItemCaseSensitive(body, "rid");
    if (rid && !cJSON_IsNull(rid) && !(cJSON_IsString(rid) && !batch) &&
        !(cJSON_IsArray(rid) && batch && cJSON_GetArraySize(rid) == n_prompts)) {
        api_fail(&e, 400, "rid", "rid must be a string (or, for a batch, a list of strings)");
        api_reply_error(a, x, &e);
        return;
    }

    /* every prompt's ids and settings first: nothing is created before all are valid */
    api_params *params = xcalloc((size_t)n_prompts, sizeof(api_params));
    int32_t **prompt = xcalloc((size_t)n_prompts, sizeof(int32_t *));
    int *prompt_len = xcalloc((size_t)n_prompts, sizeof(int));
    int n_items = 0, i = 0;
    bool ok = true;
    for (i = 0; i < n_prompts && ok; i++) {
        api_params_init(&params[i]);
        ok = !api_gen_params(a, body, i, n_prompts, batch, &params[i], &e) &&
             !api_gen_prompt(a, text, ids, i, batch, &prompt[i], &prompt_len[i], &e);
        if (ok) n_items += params[i].n;
        if (ok && n_items > API_MAX_ITEMS) {
            api_fail(&e, 400, "n", "at most %d answers in one request", API_MAX_ITEMS);
            ok = false;
        }
    }
    int n_parsed = i;
    api_job *j = NULL;
    if (ok) {
        j = api_job_new(a, x, API_KIND_GENERATE, n_items);
        j->stream = stream;
        j->batch = batch || n_items > 1;
        j->text_in_logprobs = text_in_logprobs;
        int item = 0;
        for (i = 0; i < n_prompts && ok; i++) {
            const cJSON *r = cJSON_IsArray(rid) ? cJSON_GetArrayItem(rid, i) : rid;
            const char *rs = cJSON_IsString(r) ? r->valuestring : NULL;
            if (r && !cJSON_IsNull(r) && (!rs || strlen(rs) > 48)) {
                api_fail(&e, 400, "rid", "rid must be a string of at most 48 bytes");
                ok = false;
                break;
            }
            for (int s = 0; s < params[i].n && ok; s++, item++) {
                ok = !api_job_add(j, item, prompt[i], prompt_len[i], &params[i], s, rs, &e);
                j->items[item].prompt_index = i;
            }
        }
    }
    for (i = 0; i < n_parsed; i++) {
        api_params_free(&params[i]);
        free(prompt[i]);
    }
    free(params);
    free(prompt);
    free(prompt_len);
    if (!ok) {
        if (j) api_job_free(j);
        api_reply_error(a, x, &e);
        return;
    }
    api_job_start(j, x);
}

/* One item's answer (final) or chunk (running). */
static cJSON *api_gen_item_json(api_job *j, api_item *it, const api_snap *s, size_t visible) {
    request *r = it->r;
    bool final = s->done;
    generate_fields f = {
        .id = r->rid,
        .omit_text = !j->srv->tok,
        .text = it->text,
        .text_len = visible,
        .output_ids = s->ids,
        .n_output = s->n_out,
        .n_prompt = r->gen.n_prompt,
        .finish = s->finish,
        .matched_token = s->matched_token,
        .matched_stop = api_item_matched_stop(it, s),
        .abort_message = s->error,
        .cached_tokens = s->cached_tokens,
        .e2e_latency = final ? (s->t_done > 0 ? s->t_done : api_now()) - j->t_arrival : -1.0,
        .return_logprob = r->gen.return_logprob,
        .input_ids = r->prompt + (r->gen.n_prompt - s->n_in),
        .input_logprobs = s->in_lp,
        .n_input_logprobs = s->n_in,
        .output_logprobs = s->out_lp,
        .top_logprobs_num = r->top_logprobs_num,
        .input_top_ids = s->in_top_ids,
        .input_top_logprobs = s->in_top_lp,
        .output_top_ids = s->out_top_ids,
        .output_top_logprobs = s->out_top_lp,
        .logprob_tok = j->text_in_logprobs ? j->srv->tok : NULL,
    };
    return generate_json_build(&f);
}

void api_generate_answer(api_job *j, http_exchange *x) {
    cJSON *arr = cJSON_CreateArray();
    const char *abort_msg = NULL;
    char abort_buf[256];
    for (int i = 0; i < j->n_items; i++) {
        api_item *it = &j->items[i];
        api_snap s;
        size_t visible = api_item_final(j, it, &s, &abort_msg, abort_buf, sizeof abort_buf);
        cJSON_AddItemToArray(arr, api_gen_item_json(j, it, &s, visible));
        api_snap_free(&s);
    }
    if (abort_msg) { /* as SGLang: a request the server gave up on is a 503 with its reason */
        cJSON_Delete(arr);
        api_reply_aborted(j->srv, x, abort_msg);
        return;
    }
    if (j->batch) {
        api_reply_json(j->srv, x, 200, arr);
    } else {
        cJSON *one = cJSON_DetachItemFromArray(arr, 0);
        cJSON_Delete(arr);
        api_reply_json(j->srv, x, 200, one);
    }
}

bool api_generate_fill(api_job *j, http_buf *out) {
    bool all = true;
    for (int i = 0; i < j->n_items; i++) {
        api_item *it = &j->items[i];
        if (it->finished) continue;
        api_snap s;
        api_snap_take(it, &s);
        size_t visible = api_item_visible(j->srv, it, &s);
        if (s.done || s.n_out > it->ids_sent) {
            cJSON *chunk = api_gen_item_json(j, it, &s, visible);
            if (j->batch) cJSON_AddNumberToObject(chunk, "index", i);
            api_sse(out, chunk);
            it->ids_sent = s.n_out;
            it->text_sent = visible;
        }
        if (s.done) {
            it->finished = true;
            api_item_count(j, it, &s);
        } else {
            all = false;
        }
        api_snap_free(&s);
    }
    if (all && !j->done_sent) {
        http_buf_append(out, "data: [DONE]\n\n", 14);
        j->done_sent = true;
    }
    return all;
}
