/* The scheduler: continuous batching on the engine thread.
 *
 * Each step: drop aborted requests; admit waiting requests first-come-first-served while the
 * running cap and the KV pages allow (prompt pages found in the radix prefix cache are shared,
 * not recomputed); build the batch from every running request's next token (decode) and prompt
 * chunks under the chunked-prefill token budget; run the forward pass; score and sample; publish
 * outputs to each request's channel. When decode runs out of pages, the most recently admitted
 * request is preempted: its pages are freed and it goes back to the front of the queue to be
 * recomputed (prompt + output so far) later; nothing is lost or corrupted.
 * Only the engine thread calls scheduler_step / scheduler_run; submit, flush and stats may be
 * called from any thread. */
#ifndef MOESERVE_SCHEDULER_H
#define MOESERVE_SCHEDULER_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "runner/model.h"
#include "runner/rank_group.h"
#include "runner/request.h"

typedef struct {
    int max_running_requests; /* cap on requests in the running batch; >= 1 */
    int max_total_tokens;     /* KV cache capacity in tokens (rounded up to whole pages);
                                 >= context_length */
    int page_size;            /* tokens per KV page; >= 1 */
    int chunked_prefill_size; /* prompt tokens per step, all requests together; >= 1 */
    bool kv_cache_bf16;       /* --kv-cache-dtype bfloat16: the KV cache in BF16 (else fp32) */
    int context_length;       /* prompt + max_new_tokens limit; <= max_position_embeddings;
                                 0 = max_position_embeddings */
    bool enable_radix_cache;  /* share prompt-prefix pages between requests */
    int cuda_graph_max_bs;    /* decode steps of up to this many requests replayed as graphs
                                 where the backend has them (0: never) */
    bool deterministic;       /* --enable-deterministic-inference: handed to the engine
                                 (engine.deterministic); the CPU backend is batch-invariant
                                 either way */
    model_load_opts load_opts; /* how m was loaded: scheduler_update_weights loads the same way */
    void (*on_peer_drain)(void *ctx, int rank); /* engine thread: another rank of the group
                                                   started draining, so this one does too
                                                   (NULL: nothing more to do) */
    void *on_peer_drain_ctx;
} scheduler_config;

/* Counters and gauges for /metrics and /get_server_info; a consistent snapshot. */
typedef struct {
    int n_running;
    int n_waiting;
    int kv_pages_used; /* pages held by running requests or the prefix cache */
    int kv_pages_total;
    int64_t n_requests_done;
    int64_t n_prompt_tokens;    /* prompt tokens of finished requests */
    int64_t n_generated_tokens; /* output tokens of finished requests */
    int64_t n_cached_tokens;    /* prompt tokens served from the prefix cache */
    int64_t n_preemptions;
    int64_t n_steps;
    double step_sched_seconds;   /* time in the scheduler outside forward passes, summed
                                    (includes step_sample_seconds) */
    double step_forward_seconds; /* time in forward passes, summed */
    double step_sample_seconds;  /* scoring (logprobs, top-N) and sampling after them, summed */
    double last_gen_throughput;  /* output tokens/s over the last few seconds */
} scheduler_stats;

typedef struct scheduler scheduler;

/* Build the KV cache and the prefix cache for m. Returns NULL with a message on a bad config
 * (e.g. fewer pages than one context needs). */
scheduler *scheduler_create(model *m, const scheduler_config *cfg, char *err, size_t errlen);
void scheduler_free(scheduler *s);

/* Validate r against the model and the config (empty prompt, ids outside the vocabulary, prompt +
 * max_new_tokens over the context length, sampling values, logprob_start_len): 0, or -1 with a
 * message for a 400. Does not take r. */
int scheduler_check(const scheduler *s, const request *r, char *err, size_t errlen);

/* Queue r (takes a reference). Call scheduler_check first; a request that fails the checks here
 * is finished at once with FINISH_ABORT and its error (so is one submitted after shutdown:
 * "server shutting down"); its notify then runs on the calling thread, before submit returns.
 * Thread-safe; wakes the engine thread.
 *
 * What the request sees afterwards (engine thread): cached_tokens at admission; after every step
 * that changed it, n_out / n_in / t_first_token under mu, then a broadcast of cv and notify
 * outside the lock; at the end finish, matched_token, error, t_done and done = true together,
 * then broadcast and notify once more. An abort (request_abort) is acted on at the next step:
 * FINISH_ABORT with error "aborted by client". */
void scheduler_submit(scheduler *s, request *r);

/* One step on the engine thread. Returns the number of tokens forwarded (0: nothing to do). */
int scheduler_step(scheduler *s);

/* Engine-thread loop: step while there is work, sleep on a condition variable while idle, return
 * when *stop becomes true (after scheduler_wake). Every request still queued or running is
 * finished with FINISH_ABORT ("server shutting down") before it returns.
 *
 * In a rank group of more than one rank (g; NULL = alone) every step starts with the step
 * agreement: this rank's planned token count, load and stop wish go to every rank; the group's
 * runtime_max sets the step (0: idle, each rank sleeps up to 2 ms or until its own work arrives,
 * then asks again); a rank with nothing planned still runs the forward with zero tokens. Any
 * rank's stop stops every rank after that exchange. Returns 0, or -1 with err when the group
 * failed (a peer gone or silent, an all-to-all failed): every request left is then finished
 * with FINISH_ABORT and "the rank group failed: ...", and nothing collective may follow. */
int scheduler_run(scheduler *s, rank_group *g, atomic_bool *stop, char *err, size_t errlen);
void scheduler_wake(scheduler *s);

/* Graceful shutdown: from now on new requests are refused ("server shutting down") and
 * scheduler_run returns once every request queued or running has finished; in a rank group
 * every rank drains with the first one that does (on_peer_drain tells the others) and the group
 * returns together, once no rank has anything left. *stop still stops at once (the rest is
 * aborted). Thread-safe; a second call does nothing. */
void scheduler_drain(scheduler *s);

/* Empty the prefix cache (pages held by running requests stay). Thread-safe: applied at the
 * start of the next step; returns at once. */
void scheduler_flush_cache(scheduler *s);

/* Abort the requests, queued or running, whose rid or client_rid is rid (every request when all;
 * nothing for an empty rid): at the start of the next step they finish with FINISH_ABORT and
 * "aborted by /abort_request", keeping what they generated. Requests submitted after the call
 * and before that step are matched too. Thread-safe; returns at once (SGLang's
 * /abort_request). */
void scheduler_abort(scheduler *s, const char *rid, bool all);

/* SGLang's /update_weights_from_disk: load the checkpoint in folder dir (cfg.load_opts; from disk
 * also where the served model is dummy weights) and serve
 * it in place of the current weights. Requests are no longer admitted; with abort_running every
 * request queued or running is aborted ("aborted by /update_weights_from_disk"), else the
 * running ones finish first. With nothing running the engine thread loads dir while the old
 * weights stay (room for both is needed), checks that its config equals the served one
 * (model_config_diff), swaps (model_swap), frees the old weights and empties the prefix cache;
 * then admission resumes (a request preempted before the update and still queued resumes on the
 * new weights). On any failure the old weights stay in service. Blocks until done: 0,
 * or -1 with a message in msg (a model that does not load, a config that differs, another update
 * in progress). *n_aborted gets the requests the call aborted on this rank. Thread-safe.
 * In a rank group every rank does the same together: the asking rank's folder reaches them all
 * through the step agreement, each pauses (and aborts its own requests where asked), and once
 * nothing runs anywhere each loads its share of the experts; only when every rank has loaded do
 * all swap, else all keep the old weights and msg names the first rank that failed. Requests to
 * several ranks at once run one after another, the lowest rank's first. */
int scheduler_update_weights(scheduler *s, const char *dir, bool abort_running, int *n_aborted,
                             char *msg, size_t msglen);

/* The folder of the weights served (dir as the last successful update named it), or "" before any
 * update. Thread-safe. */
void scheduler_model_dir(scheduler *s, char *out, size_t len);

void scheduler_get_stats(scheduler *s, scheduler_stats *out);

/* Check the page accounting: every page's reference count equals its holders (the prefix cache
 * and the running requests), the free list holds exactly the unreferenced pages, queued requests
 * hold none, and the prefix cache's tree is well formed. 0, or -1 with a message. Engine thread
 * only (tests call it between steps). */
int scheduler_validate(scheduler *s, char *err, size_t errlen);

#endif
