/* The SGLang /generate answer: used by `moeserve generate` (from an engine result) and by the
 * HTTP server (from a request's output channel, whole or as one streamed chunk), so both print
 * the same fields the same way. */
#ifndef MOESERVE_GENERATE_JSON_H
#define MOESERVE_GENERATE_JSON_H

#include <cjson/cJSON.h>
#include <stdbool.h>

#include "runner/engine.h"
#include "server/tokenizer.h"

/* Everything one answer (or one streamed chunk) shows. Arrays are read, not kept. */
typedef struct {
    const char *id;   /* request id */
    bool omit_text;   /* no "text" key at all (a server without tokenizer, as SGLang's) */
    const char *text; /* decoded output, stop string already trimmed; NULL -> null */
    size_t text_len;
    const int32_t *output_ids; /* [n_output] */
    int n_output;
    int n_prompt;
    finish_kind finish;    /* FINISH_NONE: "finish_reason": null (a chunk of a running request) */
    int32_t matched_token; /* FINISH_STOP_TOKEN */
    const char *matched_stop;  /* FINISH_STOP_STRING */
    const char *abort_message; /* FINISH_ABORT */
    int cached_tokens;
    double e2e_latency; /* seconds; < 0 leaves the field out */
    /* logprobs, when return_logprob */
    bool return_logprob;
    const int32_t *input_ids;    /* [n_input_logprobs]: the prompt tokens scored */
    const float *input_logprobs; /* [n_input_logprobs]; NaN -> null */
    int n_input_logprobs;
    const float *output_logprobs; /* [n_output] */
    int top_logprobs_num;         /* > 0: input_top_logprobs and output_top_logprobs too */
    const int32_t *input_top_ids; /* [n_input_logprobs, top_logprobs_num]; -1 = no entry */
    const float *input_top_logprobs;
    const int32_t *output_top_ids; /* [n_output, top_logprobs_num] */
    const float *output_top_logprobs;
    const tokenizer *logprob_tok; /* non-NULL: each entry's third item is the token's text */
} generate_fields;

/* {"text", "output_ids", "meta_info": {...}}. */
cJSON *generate_json_build(const generate_fields *f);

/* The `moeserve generate` view of an engine result. */
typedef struct {
    const char *id; /* request id */
    const gen_request *req;
    const gen_result *res;
    const tokenizer *tok; /* NULL: text fields are null */
    bool skip_special_tokens;
    const char *matched_stop; /* the stop string that ended it (FINISH_STOP_STRING) */
    double e2e_latency;       /* seconds */
} generate_answer;

/* generate_json_build over an engine result; the text has a matched stop string trimmed. */
cJSON *generate_json_answer(const generate_answer *a);

#endif
