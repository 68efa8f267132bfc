/* A generation request as the engine thread and the HTTP side share it.
 *
 * Ownership: request_create returns a request with one reference (the creator's);
 * scheduler_submit takes a second one that the scheduler drops when the request is done.
 * request_release drops a reference; the last one frees it.
 *
 * Threads: the fields under "inputs" are written before submit and only read afterwards. The
 * engine thread appends to the output channel under mu, broadcasts cv and then calls notify (if
 * set) outside the lock; readers take mu to copy what they need. abort may be set by any thread.
 * on_token (in gen) runs on the engine thread. */
#ifndef MOESERVE_REQUEST_H
#define MOESERVE_REQUEST_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "runner/engine.h"

typedef struct request request;

struct request {
    /* ---- inputs (immutable after submit) ---- */
    char rid[64];       /* request id, as given by the client or generated */
    gen_request gen;    /* gen.prompt / gen.stop_token_ids point at the owned copies below */
    int32_t *prompt;    /* [gen.n_prompt], owned */
    int32_t *stop_ids;  /* [gen.n_stop_token_ids], owned */
    int top_logprobs_num; /* > 0: also keep the top-N (id, logprob) of every scored position */
    double t_submit;    /* seconds, CLOCK_MONOTONIC, set by scheduler_submit */
    /* Called on the engine thread after new output is published and after done is set
     * (e.g. to resume a suspended HTTP connection). Must not block. */
    void (*notify)(void *ctx);
    void *notify_ctx;

    /* ---- output channel (engine writes, others read under mu) ---- */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int32_t *out_ids;      /* [n_out] */
    float *out_logprobs;   /* [n_out] when gen.return_logprob */
    int32_t *out_top_ids;  /* [n_out, top_logprobs_num] */
    float *out_top_logprobs; /* [n_out, top_logprobs_num] */
    int n_out;
    float *in_logprobs;    /* [n_in]: prompt[start..]; NaN at position 0 */
    int32_t *in_top_ids;   /* [n_in, top_logprobs_num]; position 0 rows are -1 / NaN */
    float *in_top_logprobs;
    int n_in;
    int cached_tokens;     /* prompt tokens whose KV came from the prefix cache */
    finish_kind finish;    /* FINISH_NONE while running */
    int32_t matched_token; /* FINISH_STOP_TOKEN */
    char error[256];       /* FINISH_ABORT: why */
    bool done;             /* nothing more will be written */
    double t_first_token;  /* monotonic seconds of the first output token, 0 before */
    double t_done;

    /* ---- control ---- */
    atomic_bool abort;     /* set by anyone: the scheduler finishes it with FINISH_ABORT */
    atomic_int refs;
};

/* A request for prompt[n_prompt] (copied) with the settings of *gen (its prompt and stop ids
 * are copied too; on_token/ctx kept). rid NULL -> a generated unique id. */
request *request_create(const gen_request *gen, const char *rid, int top_logprobs_num);
void request_retain(request *r);
void request_release(request *r);

/* Block until done or until n_out > seen (whichever first); returns n_out. For thread-per-
 * waiter callers (the CLI, tests); the HTTP side uses notify instead. */
int request_wait(request *r, int seen);

/* Ask the scheduler to stop this request (client gone); thread-safe, idempotent. */
void request_abort(request *r);

#endif
