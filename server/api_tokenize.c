/* POST /tokenize and /detokenize (also under /v1/), as SGLang's and vLLM's servers answer them:
 * the model's own tokenizer over HTTP, so that a client can count a prompt's tokens against the
 * context length, or read ids back as text, without loading the tokenizer itself.
 *
 *   /tokenize    {"prompt": string | [string], "add_special_tokens": bool (true), "model"}
 *                -> {"tokens": [id] | [[id]], "count": n | [n], "max_model_len": context length}
 *   /detokenize  {"tokens": [id] | [[id]], "skip_special_tokens": bool (true), "model"}
 *                -> {"text": string | [string]}
 *
 * A list answers a list, in order. Ids must lie in [0, vocab_size) of the model's config (as
 * /generate's input_ids); an id the tokenizer lacks decodes to nothing, as in the Rust
 * tokenizers. "model", when given, must name the served model (as the OpenAI endpoints check it).
 * Without a tokenizer (--skip-tokenizer-init) both answer 400. */
#include "server/api_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int api_tokenize_common(api_server *a, const cJSON *body, const char *flag, bool *flag_out,
                               api_error *e) {
    if (!a->tok)
        return api_fail(e, 400, NULL,
                        "this server was started with --skip-tokenizer-init: it has no tokenizer");
    if (api_check_model(a, body, e)) return -1;
    return api_get_bool(body, flag, flag_out, e) < 0 ? -1 : 0;
}

/* The ids of one prompt as a JSON array; NULL with e set when the text is not valid UTF-8. */
static cJSON *api_encode(api_server *a, const cJSON *s, const char *param, bool add_special,
                         int *count, api_error *e) {
    int32_t *ids;
    int n;
    if (tokenizer_encode(a->tok, s->valuestring, strlen(s->valuestring), add_special, &ids, &n)) {
        api_fail(e, 400, param, "%s is not valid UTF-8", param);
        return NULL;
    }
    cJSON *arr = cJSON_CreateIntArray((const int *)ids, n);
    free(ids);
    *count = n;
    return arr;
}

void api_tokenize(api_server *a, http_exchange *x, const cJSON *body) {
    api_error e;
    bool add_special = true;
    if (api_tokenize_common(a, body, "add_special_tokens", &add_special, &e)) {
        api_reply_error(a, x, &e);
        return;
    }
    const cJSON *p = cJSON_GetObjectItemCaseSensitive(body, "prompt");
    bool list = cJSON_IsArray(p);
    if (!cJSON_IsString(p) && !list) {
        api_fail(&e, 400, "prompt", "prompt must be a string or a list of strings");
        api_reply_error(a, x, &e);
        return;
    }
    cJSON *root = cJSON_CreateObject();
    cJSON *tokens = list ? cJSON_AddArrayToObject(root, "tokens") : NULL;
    cJSON *counts = list ? cJSON_AddArrayToObject(root, "count") : NULL;
    int n_items = list ? cJSON_GetArraySize(p) : 1;
    for (int i = 0; i < n_items; i++) {
        const cJSON *s = list ? cJSON_GetArrayItem(p, i) : p;
        char param[32];
        snprintf(param, sizeof param, list ? "prompt[%d]" : "prompt", i);
        if (!cJSON_IsString(s)) {
            api_fail(&e, 400, "prompt", "%s must be a string", param);
            cJSON_Delete(root);
            api_reply_error(a, x, &e);
            return;
        }
        int n = 0;
        cJSON *ids = api_encode(a, s, param, add_special, &n, &e);
        if (!ids) {
            cJSON_Delete(root);
            api_reply_error(a, x, &e);
            return;
        }
        if (list) {
            cJSON_AddItemToArray(tokens, ids);
            cJSON_AddItemToArray(counts, cJSON_CreateNumber(n));
        } else {
            cJSON_AddItemToObject(root, "tokens", ids);
            cJSON_AddNumberToObject(root, "count", n);
        }
    }
    cJSON_AddNumberToObject(root, "max_model_len", a->args.context_length);
    api_reply_json(a, x, 200, root);
}

void api_detokenize(api_server *a, http_exchange *x, const cJSON *body) {
    api_error e;
    bool skip_special = true;
    if (api_tokenize_common(a, body, "skip_special_tokens", &skip_special, &e)) {
        api_reply_error(a, x, &e);
        return;
    }
    const cJSON *t = cJSON_GetObjectItemCaseSensitive(body, "tokens");
    if (!cJSON_IsArray(t)) {
        api_fail(&e, 400, "tokens", "tokens must be a list of token ids (or a list of such lists)");
        api_reply_error(a, x, &e);
        return;
    }
    /* A list of lists when its first item is a list; [] is one empty sequence. */
    bool lists = cJSON_IsArray(cJSON_GetArrayItem(t, 0));
    int n_items = lists ? cJSON_GetArraySize(t) : 1;
    cJSON *root = cJSON_CreateObject();
    cJSON *texts = lists ? cJSON_AddArrayToObject(root, "text") : NULL;
    for (int i = 0; i < n_items; i++) {
        const cJSON *l = lists ? cJSON_GetArrayItem(t, i) : t;
        char param[32];
        snprintf(param, sizeof param, lists ? "tokens[%d]" : "tokens", i);
        int32_t *ids;
        int n;
        if (api_parse_ids(l, param, a->cfg.vocab_size, &ids, &n, &e)) {
            cJSON_Delete(root);
            api_reply_error(a, x, &e);
            return;
        }
        char *s = tokenizer_decode(a->tok, ids, n, skip_special, NULL);
        free(ids);
        cJSON *str = cJSON_CreateString(s);
        free(s);
        if (lists)
            cJSON_AddItemToArray(texts, str);
        else
            cJSON_AddItemToObject(root, "text", str);
    }
    api_reply_json(a, x, 200, root);
}
