/* SGLang-shaped /generate answers. Logprob entries are [logprob, token_id, null]; a logprob with
 * no context (the first input position) is null. */
#include "server/generate_json.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static cJSON *generate_json_logprobs(const float *lp, const int32_t *ids, int n) {
    cJSON *arr = cJSON_CreateArray();
    for (int i = 0; i < n; i++) {
        cJSON *e = cJSON_CreateArray();
        cJSON_AddItemToArray(e, isnan(lp[i]) ? cJSON_CreateNull() : cJSON_CreateNumber(lp[i]));
        cJSON_AddItemToArray(e, cJSON_CreateNumber(ids[i]));
        cJSON_AddItemToArray(e, cJSON_CreateNull());
        cJSON_AddItemToArray(arr, e);
    }
    return arr;
}

static cJSON *generate_json_finish(const generate_answer *a) {
    const gen_result *r = a->res;
    cJSON *f = cJSON_CreateObject();
    switch (r->finish) {
    case FINISH_STOP_TOKEN:
        cJSON_AddStringToObject(f, "type", "stop");
        cJSON_AddNumberToObject(f, "matched", r->matched_token);
        break;
    case FINISH_STOP_STRING:
        cJSON_AddStringToObject(f, "type", "stop");
        cJSON_AddStringToObject(f, "matched", a->matched_stop ? a->matched_stop : "");
        break;
    case FINISH_LENGTH:
        cJSON_AddStringToObject(f, "type", "length");
        cJSON_AddNumberToObject(f, "length", r->n_output);
        break;
    case FINISH_ABORT:
        cJSON_AddStringToObject(f, "type", "abort");
        cJSON_AddStringToObject(f, "message", "aborted");
        break;
    case FINISH_NONE:
        cJSON_Delete(f);
        return cJSON_CreateNull();
    }
    return f;
}

cJSON *generate_json_answer(const generate_answer *a) {
    const gen_request *q = a->req;
    const gen_result *r = a->res;
    cJSON *root = cJSON_CreateObject();
    if (a->tok) {
        char *text = tokenizer_decode(a->tok, r->output_ids, r->n_output, a->skip_special_tokens,
                                      NULL);
        if (r->finish == FINISH_STOP_STRING && a->matched_stop) {
            char *at = strstr(text, a->matched_stop);
            if (at) *at = '\0';
        }
        cJSON_AddStringToObject(root, "text", text);
        free(text);
    } else {
        cJSON_AddNullToObject(root, "text");
    }
    cJSON_AddItemToObject(root, "output_ids", cJSON_CreateIntArray((const int *)r->output_ids,
                                                                   r->n_output));
    cJSON *meta = cJSON_AddObjectToObject(root, "meta_info");
    cJSON_AddStringToObject(meta, "id", a->id);
    cJSON_AddItemToObject(meta, "finish_reason", generate_json_finish(a));
    cJSON_AddNumberToObject(meta, "prompt_tokens", q->n_prompt);
    cJSON_AddNumberToObject(meta, "completion_tokens", r->n_output);
    cJSON_AddNumberToObject(meta, "cached_tokens", 0);
    cJSON_AddNumberToObject(meta, "e2e_latency", a->e2e_latency);
    if (q->return_logprob) {
        int start = q->logprob_start_len >= 0 ? q->logprob_start_len : q->n_prompt;
        cJSON_AddItemToObject(meta, "input_token_logprobs",
                              generate_json_logprobs(r->input_logprobs, q->prompt + start,
                                                     r->n_input_logprobs));
        cJSON_AddItemToObject(meta, "output_token_logprobs",
                              generate_json_logprobs(r->output_logprobs, r->output_ids,
                                                     r->n_output));
    }
    return root;
}
