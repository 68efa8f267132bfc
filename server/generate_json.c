/* SGLang-shaped /generate answers. Logprob entries are [logprob, token_id, text-or-null]; a
 * logprob with no context (the first prompt position) is null, and so is the top-logprobs list
 * of that position. */
#include "server/generate_json.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static cJSON *generate_json_entry(float lp, int32_t id, const tokenizer *tok) {
    cJSON *e = cJSON_CreateArray();
    cJSON_AddItemToArray(e, isnan(lp) ? cJSON_CreateNull() : cJSON_CreateNumber(lp));
    cJSON_AddItemToArray(e, cJSON_CreateNumber(id));
    if (tok) {
        char *text = tokenizer_decode(tok, &id, 1, false, NULL);
        cJSON_AddItemToArray(e, cJSON_CreateString(text));
        free(text);
    } else {
        cJSON_AddItemToArray(e, cJSON_CreateNull());
    }
    return e;
}

static cJSON *generate_json_logprobs(const float *lp, const int32_t *ids, int n,
                                     const tokenizer *tok) {
    cJSON *arr = cJSON_CreateArray();
    for (int i = 0; i < n; i++)
        cJSON_AddItemToArray(arr, generate_json_entry(lp[i], ids[i], tok));
    return arr;
}

/* One list of top entries per position; a position without any (first prompt token) is null. */
static cJSON *generate_json_top(const int32_t *ids, const float *lp, int n, int k,
                                const tokenizer *tok) {
    cJSON *arr = cJSON_CreateArray();
    for (int i = 0; i < n; i++) {
        const int32_t *row_ids = ids + (size_t)i * k;
        const float *row_lp = lp + (size_t)i * k;
        if (k > 0 && row_ids[0] < 0) {
            cJSON_AddItemToArray(arr, cJSON_CreateNull());
            continue;
        }
        cJSON *row = cJSON_CreateArray();
        for (int j = 0; j < k && row_ids[j] >= 0; j++)
            cJSON_AddItemToArray(row, generate_json_entry(row_lp[j], row_ids[j], tok));
        cJSON_AddItemToArray(arr, row);
    }
    return arr;
}

static cJSON *generate_json_finish(const generate_fields *f) {
    cJSON *o = cJSON_CreateObject();
    switch (f->finish) {
    case FINISH_STOP_TOKEN:
        cJSON_AddStringToObject(o, "type", "stop");
        cJSON_AddNumberToObject(o, "matched", f->matched_token);
        break;
    case FINISH_STOP_STRING:
        cJSON_AddStringToObject(o, "type", "stop");
        cJSON_AddStringToObject(o, "matched", f->matched_stop ? f->matched_stop : "");
        break;
    case FINISH_LENGTH:
        cJSON_AddStringToObject(o, "type", "length");
        cJSON_AddNumberToObject(o, "length", f->n_output);
        break;
    case FINISH_ABORT:
        cJSON_AddStringToObject(o, "type", "abort");
        cJSON_AddStringToObject(
            o, "message", f->abort_message && *f->abort_message ? f->abort_message : "aborted");
        break;
    case FINISH_NONE: cJSON_Delete(o); return cJSON_CreateNull();
    }
    return o;
}

cJSON *generate_json_build(const generate_fields *f) {
    cJSON *root = cJSON_CreateObject();
    if (f->text && !f->omit_text) {
        /* cJSON strings are NUL-terminated: copy the visible part */
        char *t = malloc(f->text_len + 1);
        memcpy(t, f->text, f->text_len);
        t[f->text_len] = '\0';
        cJSON_AddStringToObject(root, "text", t);
        free(t);
    } else if (!f->omit_text) {
        cJSON_AddNullToObject(root, "text");
    }
    /* cJSON_CreateIntArray gives NULL for a NULL array, even of length 0 */
    cJSON_AddItemToObject(root, "output_ids",
                          f->n_output
                              ? cJSON_CreateIntArray((const int *)f->output_ids, f->n_output)
                              : cJSON_CreateArray());
    cJSON *meta = cJSON_AddObjectToObject(root, "meta_info");
    cJSON_AddStringToObject(meta, "id", f->id);
    cJSON_AddItemToObject(meta, "finish_reason", generate_json_finish(f));
    cJSON_AddNumberToObject(meta, "prompt_tokens", f->n_prompt);
    cJSON_AddNumberToObject(meta, "completion_tokens", f->n_output);
    cJSON_AddNumberToObject(meta, "cached_tokens", f->cached_tokens);
    if (f->e2e_latency >= 0) cJSON_AddNumberToObject(meta, "e2e_latency", f->e2e_latency);
    if (f->return_logprob) {
        cJSON_AddItemToObject(meta, "input_token_logprobs",
                              generate_json_logprobs(f->input_logprobs, f->input_ids,
                                                     f->n_input_logprobs, f->logprob_tok));
        cJSON_AddItemToObject(
            meta, "output_token_logprobs",
            generate_json_logprobs(f->output_logprobs, f->output_ids, f->n_output, f->logprob_tok));
        if (f->top_logprobs_num > 0) {
            cJSON_AddItemToObject(meta, "input_top_logprobs",
                                  generate_json_top(f->input_top_ids, f->input_top_logprobs,
                                                    f->n_input_logprobs, f->top_logprobs_num,
                                                    f->logprob_tok));
            cJSON_AddItemToObject(meta, "output_top_logprobs",
                                  generate_json_top(f->output_top_ids, f->output_top_logprobs,
                                                    f->n_output, f->top_logprobs_num,
                                                    f->logprob_tok));
        }
    }
    return root;
}

cJSON *generate_json_answer(const generate_answer *a) {
    const gen_request *q = a->req;
    const gen_result *r = a->res;
    char *text = NULL;
    size_t len = 0;
    if (a->tok) {
        text = tokenizer_decode(a->tok, r->output_ids, r->n_output, a->skip_special_tokens, &len);
        if (r->finish == FINISH_STOP_STRING && a->matched_stop) {
            char *at = strstr(text, a->matched_stop);
            if (at) len = (size_t)(at - text);
        }
    }
    int start = q->logprob_start_len >= 0 ? q->logprob_start_len : q->n_prompt;
    generate_fields f = {.id = a->id,
                         .text = text,
                         .text_len = len,
                         .output_ids = r->output_ids,
                         .n_output = r->n_output,
                         .n_prompt = q->n_prompt,
                         .finish = r->finish,
                         .matched_token = r->matched_token,
                         .matched_stop = a->matched_stop,
                         .e2e_latency = a->e2e_latency,
                         .return_logprob = q->return_logprob,
                         .input_ids = q->prompt + start,
                         .input_logprobs = r->input_logprobs,
                         .n_input_logprobs = r->n_input_logprobs,
                         .output_logprobs = r->output_logprobs};
    cJSON *root = generate_json_build(&f);
    free(text);
    return root;
}
