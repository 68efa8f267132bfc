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
struct scheduler;

struct request {
    /* ---- inputs (immutable after submit) ---- */
    char rid[64];         /* request id, as given by the client or generated */
    /* The rid the client gave for its prompt ("" when none): the same as rid but for the n
     * samples of one prompt (rid-0, rid-1, ...), which share it. scheduler_abort matches both. */
    char client_rid[64];
    gen_request gen;      /* gen.prompt / gen.stop_token_ids point at the owned copies below */
    int32_t *prompt;      /* [gen.n_prompt], owned */
    int32_t *stop_ids;    /* [gen.n_stop_token_ids], owned */
    sampler_bias *logit_bias; /* [gen.sampling.n_logit_bias], owned */
    int top_logprobs_num; /* > 0: also keep the top-N (id, logprob) of every scored position */
    double t_submit;      /* seconds, CLOCK_MONOTONIC, set by scheduler_submit */
    /* Called on the engine thread after new output is published and after done is set
     * (e.g. to resume a suspended HTTP connection). Must not block. */
    void (*notify)(void *ctx);
    void *notify_ctx;

    /* ---- output channel (engine writes, others read under mu) ---- */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int32_t *out_ids;        /* [n_out] */
    float *out_logprobs;     /* [n_out] when gen.return_logprob */
    int32_t *out_top_ids;    /* [n_out, top_logprobs_num] */
    float *out_top_logprobs; /* [n_out, top_logprobs_num] */
    int n_out;
    /* [n_in]: prompt[start..]; NaN at position 0. n_in grows as prompt chunks are scored and
     * ends at n_prompt - start (allocated when return_logprob and logprob_start_len >= 0). */
    float *in_logprobs;
    int32_t *in_top_ids; /* [n_in, top_logprobs_num]; position 0 rows are -1 / NaN */
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
    atomic_bool abort; /* set by anyone: the scheduler finishes it with FINISH_ABORT */
    atomic_bool abort_api; /* the abort came from scheduler_abort (its message says so) */
    atomic_int refs;
    /* The scheduler it was submitted to, under mu: set by scheduler_submit, cleared when done.
     * request_abort uses it to wake an idle engine thread. */
    struct scheduler *sched;
};

/* Sizes past which request_create allocates no output arrays (out_ids stays NULL, or the top-N
 * arrays do) and scheduler_check rejects the request: prompt + max_new_tokens tokens, and
 * top_logprobs_num * (output + input positions) entries. */
#define REQUEST_MAX_TOKENS      (1 << 24)
#define REQUEST_MAX_TOP_ENTRIES (1 << 24)

/* A request for prompt[n_prompt] (copied) with the settings of *gen (its prompt and stop ids
 * are copied too; on_token/ctx kept). rid NULL -> a generated unique id. */
request *request_create(const gen_request *gen, const char *rid, int top_logprobs_num);
void request_retain(request *r);
void request_release(request *r);

/* Block until done or until n_out > seen (whichever first); returns n_out. For thread-per-
 * waiter callers (the CLI, tests); the HTTP side uses notify instead. */
int request_wait(request *r, int seen);

/* Ask the scheduler to stop this request (client gone); thread-safe, idempotent. Sets abort and,
 * when the request is queued or running, wakes the engine thread (scheduler_wake), which then
 * finishes it within one step: FINISH_ABORT, error "aborted by client", its KV pages freed,
 * done set and notify called. Once done, it only sets the flag. The scheduler must not be freed
 * while another thread may still call this on one of its unfinished requests (scheduler_free
 * finishes them all first). */
void request_abort(request *r);

/* A consistent copy of the progress counters under mu, for pollers: n_out, n_in, done. Any of
 * the pointers may be NULL. */
void request_progress(request *r, int *n_out, int *n_in, bool *done);

#endif
