/* The SGLang /generate answer, built from an engine result: used by `moeserve generate` and, later,
 * by the HTTP server, so both print the same fields the same way. */
#ifndef MOESERVE_GENERATE_JSON_H
#define MOESERVE_GENERATE_JSON_H

#include <cjson/cJSON.h>

#include "runner/engine.h"
#include "server/tokenizer.h"

typedef struct {
    const char *id;             /* request id */
    const gen_request *req;
    const gen_result *res;
    const tokenizer *tok;       /* NULL: text fields are null */
    bool skip_special_tokens;
    const char *matched_stop;   /* the stop string that ended it (FINISH_STOP_STRING) */
    double e2e_latency;         /* seconds */
} generate_answer;

/* {"text", "output_ids", "meta_info": {...}}; the text has a matched stop string trimmed. */
cJSON *generate_json_answer(const generate_answer *a);

#endif
