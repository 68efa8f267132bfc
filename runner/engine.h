/* The engine: runs generation requests over a model and a paged KV cache. Each step takes every
 * unfinished sequence: the next chunk of its prompt (prefill, under a token budget) or its last
 * sampled token (decode), runs one forward pass over all of them, then scores and samples.
 * It sees token ids only; text is the edge's business (stop strings come back through
 * on_token).
 *
 * Two users share one step core (engine_step): engine_generate, which runs a fixed set of
 * requests to completion (the CLI), and the scheduler (runner/scheduler.h), which adds and drops
 * sequences between steps. The core never allocates KV pages; its caller does. */
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

/* One sequence as the step core sees it. tokens holds the prompt, then every sampled token; the
 * KV of tokens[0 .. n_computed) is stored in pages[]. After a preemption the caller drops the
 * pages and sets n_computed to 0: the next steps recompute prompt + outputs without scoring or
 * sampling again, because scoring starts at next_score and sampling happens only at the last
 * token.
 *
 * The sinks are the caller's arrays (a gen_result, a request's output channel). The step writes
 * only entries at or beyond the counts the caller has published (n_out, next_score), then
 * advances the counts; a caller that shares the arrays with reader threads publishes the new
 * counts under its own lock. */
typedef struct {
    const gen_request *req;
    int32_t *tokens; /* [n_prompt + max_new_tokens + 1] prompt, then outputs */
    int n_tokens;
    int n_computed; /* leading tokens whose KV is stored */
    int slot;       /* its row of the page table passed to engine_step */
    int32_t *pages; /* [max_pages] that row */
    int n_pages;
    int take;       /* tokens to forward in the next step, from n_computed */
    int next_score; /* next prompt position whose input logprob is wanted; n_prompt when none */
    int top_n;      /* top logprobs kept per scored position; 0 = none */
    /* sinks */
    int32_t *out_ids;        /* [max_new_tokens + 1] */
    float *out_logprobs;     /* [max_new_tokens + 1] or NULL */
    int32_t *out_top_ids;    /* [max_new_tokens + 1, top_n] or NULL */
    float *out_top_logprobs; /* [max_new_tokens + 1, top_n] or NULL */
    float *in_logprobs;      /* [n_prompt - start]: prompt[start..] or NULL */
    int32_t *in_top_ids;     /* [n_prompt - start, top_n] or NULL */
    float *in_top_logprobs;  /* [n_prompt - start, top_n] or NULL */
    int n_out;
    finish_kind finish;
    int32_t matched_token;
} engine_seq;

enum { ROW_SCORED, ROW_NOTHING, ROW_SAMPLED };

typedef struct {
    model *m;
    kv_cache kv;
    int chunk_tokens; /* prefill token budget per step */
    float *logits;    /* [cap_logits, V] */
    int cap_logits;
    float *scratch;                     /* [scratch_threads, V] one row per OpenMP thread */
    int scratch_threads;
    /* per logit row of a step: its sequence, what it did, its token and logprob */
    int32_t *row_seq, *row_token;
    float *row_logprob;
    uint8_t *row_kind; /* ROW_SCORED, ROW_NOTHING, ROW_SAMPLED */
    int cap_rows;
    int32_t *ids, *pos, *seq_of, *rows; /* [cap_T] the step's batch */
    int cap_T;
    /* Device copies for a backend whose memory is not the host's: the batch, the page table,
     * the logits (staged each step; NULL on the CPU, which reads the host arrays). */
    int32_t *d_ids, *d_pos, *d_seq, *d_rows, *d_table;
    int cap_d_T;
    size_t cap_d_table;
    float *d_logits;
    int cap_d_logits;
    /* Decode graphs (engine_enable_graphs): one captured forward per batch size up to
     * graph_max_bs, batches padded to 1, 2, 4, 8 or a multiple of 8, per page-table stride (the
     * batch's longest table rounded up to a power of two) and, with expert parallelism, per
     * runtime_max (engine.c's graph_index), over buffers of their own that are never
     * reallocated; recaptured when the backend's or the model's workspaces move (graph_epoch). */
    int graph_max_bs;    /* 0: off */
    int graph_max_pages; /* the longest page table a graph takes */
    void **graphs;       /* by runtime_max, stride and batch (graph_index), NULL until captured */
    uint64_t graph_epoch;
    int32_t *g_ids, *g_pos, *g_seq, *g_rows, *g_table; /* device, one block from g_ids */
    int32_t *g_host;                                   /* host staging of the same */
    float *g_logits;                                   /* device [graph_max_bs, V] */
    /* With expert parallelism, set by the caller before each engine_step: the step agreement's
     * runtime_max; the forward then runs even with no tokens here. 0 = alone. */
    int runtime_max;
    /* --enable-deterministic-inference (set by the caller after engine_init): every request's
     * results must not depend on the batch, the step's split into prefill and decode, the prefix
     * cache or the ranks. The CPU backend keeps that in every mode, so nothing reads this there;
     * it is where a backend whose fast kernels follow the batch's size (CUDA's cuBLASLt choices)
     * will learn to take its fixed-order ones. */
    bool deterministic;
    double last_forward_seconds; /* wall time of the last engine_step's forward pass */
    double last_sample_seconds;  /* and of its scoring and sampling after the forward */
    /* Scoring and sampling on the device (ops->sample, where the backend has it and its memory is
     * not the host's): only tokens, logprobs and top-N come back. sample_on_host (a caller's
     * switch, off by default) keeps the host path: logits copied back, runner/sampler.c. */
    bool sample_on_host;
    void *h_sample_in, *d_sample_in;   /* a step's sample_row[n_rows], then its penalty lists */
    size_t cap_sample_in;              /* bytes of each */
    void *h_sample_out, *d_sample_out; /* tokens, logprobs, top ids, top logprobs of a step */
    size_t cap_sample_out;             /* bytes of each */
    uint32_t *pen_mark;                /* [V] generation stamps while building a penalty list */
    int32_t *pen_slot;                 /* [V] a marked id's entry in the list */
    uint32_t pen_gen;
} engine;

/* Replay decode steps of up to max_bs sequences as CUDA graphs (steps where every sequence
 * forwards one token and samples it, with page tables of at most max_pages; in a rank group,
 * steps whose runtime_max is one of the graph sets' values, as the scheduler rounds it, and
 * with an all-to-all that a graph can hold). A batch runs padded to 1, 2, 4, 8 or a multiple of
 * 8 sequences (the extra rows repeat the first); a padded size not seen yet runs eagerly once,
 * is captured, and later steps of that size replay the capture. 0, or -1 with a message when
 * the backend has no graphs. */
int engine_enable_graphs(engine *e, int max_bs, int max_pages, char *err, size_t errlen);

/* n_pages pages of page_size tokens, the KV cache in bfloat16 when kv_bf16 (else float32);
 * chunk_tokens tokens at most per forward pass. */
int engine_init(engine *e, model *m, int n_pages, int page_size, int chunk_tokens, int kv_bf16,
                char *err, size_t errlen);
void engine_free(engine *e);

/* Check one request against the model: non-empty prompt, ids in the vocabulary, max and min
 * new tokens >= 0, prompt + max_new_tokens within context_length (which the caller keeps <=
 * max_position_embeddings), logprob_start_len, stop ids, sampling values. 0, or -1 with a
 * message fit for a client. */
int engine_check_request(const engine *e, const gen_request *q, int context_length, char *err,
                         size_t errlen);

/* The next step of a fixed set of sequences (engine_generate's, a benchmark's): decode tokens
 * first (they always fit), then prompt chunks under chunk_tokens, each sequence given the pages
 * its tokens need from the cache. Fills batch[] and every take; returns the batch's size (0: all
 * finished), or -1 with a message when the pages run out. */
int engine_plan_step(engine *e, engine_seq *seqs, int n, engine_seq **batch, char *err,
                     size_t errlen);

/* Run n requests together to completion; results[i] answers reqs[i] (free with
 * gen_result_free). Returns 0, or -1 with a message when a request cannot fit (context length,
 * KV pages). */
int engine_generate(engine *e, const gen_request *reqs, gen_result *results, int n, char *err,
                    size_t errlen);
void gen_result_free(gen_result *r);

/* s for q with room for every output: the prompt copied into tokens, nothing computed, scoring
 * from logprob_start_len when q returns logprobs, the sinks NULL (the caller points them at its
 * arrays; out_ids is required). */
void engine_seq_init(engine_seq *s, const gen_request *q, int top_n);
void engine_seq_free(engine_seq *s);

/* Input logprobs the sequence has finished: entries of in_logprobs that are final (position 0's
 * NaN counts from the start). 0 when it scores nothing. */
int engine_seq_n_in(const engine_seq *s);

/* The step core. One forward pass over seqs[i]->take tokens of each sequence (from its
 * n_computed; its pages must already cover them; sequences with take 0 are skipped), in the
 * order given. Then, in batch order: every row that scores a wanted prompt token writes its
 * input logprob (and top-N); the row of a sequence's last token samples the next one (position
 * = n_tokens, penalties over prompt + outputs), appends it with its logprob (and top-N), runs
 * on_token and sets finish (stop ids and eos after min_new_tokens, unless ignore_eos;
 * on_token -> FINISH_STOP_STRING; max_new_tokens -> FINISH_LENGTH; max_new_tokens 0 ->
 * FINISH_LENGTH without sampling). n_computed advances by take. page_table is
 * [n_slots, max_pages]; seqs[i]->slot names its row. Returns the tokens forwarded, or -1 when
 * the forward failed (an all-to-all: e->m->err says why; the rank group is unusable, nothing
 * of the step was applied). */
int engine_step(engine *e, engine_seq *const *seqs, int n, const int32_t *page_table,
                int max_pages);

#endif
