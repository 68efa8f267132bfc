/* The engine: runs generation requests over a model and a paged KV cache. Each step takes every
 * unfinished sequence: the next chunk of its prompt (prefill, under a token budget) or its last
 * sampled token (decode), runs one forward pass over all of them, then scores and samples.
 * It sees token ids only; text is the edge's business (stop strings come back through
 * on_token). */
#ifndef MOESERVE_ENGINE_H
#define MOESERVE_ENGINE_H

#include <stdbool.h>
#include <stdint.h>

#include "runner/kv_cache.h"
#include "runner/model.h"
#include "runner/sampler.h"

typedef enum {
    FINISH_NONE,
    FINISH_STOP_TOKEN,  /* an eos id or a stop_token_id; matched_token says which */
    FINISH_STOP_STRING, /* on_token asked to stop */
    FINISH_LENGTH,      /* max_new_tokens reached */
    FINISH_ABORT,       /* aborted (client gone, shutdown, rejected); see the request's error */
} finish_kind;

typedef struct {
    const int32_t *prompt; /* [n_prompt], every id < V */
    int n_prompt;
    sampling_params sampling;
    int max_new_tokens; /* >= 0; 0 = score the prompt only */
    int min_new_tokens; /* eos and stop ids are ignored before this many */
    bool ignore_eos;
    const int32_t *stop_token_ids;
    int n_stop_token_ids;
    bool return_logprob;
    int logprob_start_len; /* -1: output only; else 0 <= start < n_prompt */
    /* Called after each sampled token (may be NULL); returns true to stop the request. */
    bool (*on_token)(void *ctx, int32_t token);
    void *ctx;
} gen_request;

typedef struct {
    int32_t *output_ids; /* [n_output] */
    int n_output;
    float *input_logprobs; /* [n_input_logprobs]: prompt[start..]; NaN for position 0 */
    int n_input_logprobs;
    float *output_logprobs; /* [n_output] when return_logprob */
    finish_kind finish;
    int32_t matched_token;
} gen_result;

typedef struct {
    model *m;
    kv_cache kv;
    int chunk_tokens; /* prefill token budget per step */
    float *logits;    /* [cap_logits, V] */
    int cap_logits;
    float *scratch;   /* [V] */
} engine;

/* n_pages pages of page_size tokens; chunk_tokens tokens at most per forward pass. */
int engine_init(engine *e, model *m, int n_pages, int page_size, int chunk_tokens, char *err,
                size_t errlen);
void engine_free(engine *e);

/* Run n requests together to completion; results[i] answers reqs[i] (free with
 * gen_result_free). Returns 0, or -1 with a message when a request cannot fit (context length,
 * KV pages). */
int engine_generate(engine *e, const gen_request *reqs, gen_result *results, int n, char *err,
                    size_t errlen);
void gen_result_free(gen_result *r);

#endif
