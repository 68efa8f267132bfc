/* The scheduler (see scheduler.h): continuous batching over the engine's step core.
 *
 * Choices:
 * - One mutex (mu) guards what other threads touch: the waiting queue, the wake flag and the
 *   stats snapshot. Everything else (running set, KV pages, prefix cache) belongs to the engine
 *   thread and needs no lock. A request's own mutex is never taken while mu is held; request_abort
 *   takes the request's mutex and then mu (through scheduler_wake), never the other way round.
 * - Order of a step: flush, drop aborted requests, give every decoding request the page its next
 *   token needs (evicting from the prefix cache, then preempting the most recently admitted
 *   request), admit from the queue head while pages allow, then build the batch (decode tokens
 *   first, then prompt chunks in admission order under the chunked-prefill budget). Decode pages
 *   come before admission so that a request is not admitted only to be preempted in the same
 *   step.
 * - Admission is first come, first served: a request that does not fit blocks the rest. A request
 *   is admitted when the free pages, less those already promised to running prompts, cover its
 *   uncomputed tokens plus one page of headroom (capped at the most it can ever use, so a
 *   request that fits the cache alone is always admitted once the rest has drained). One that
 *   shares at least half its prompt with a running request whose prefill is not yet in the
 *   prefix cache waits in its place until it is (and later ones may pass it meanwhile), then
 *   takes those pages from the cache: the n samples of a prompt, or prompts with a common
 *   few-shot prefix sent together, compute the shared part once. Cached and computed prefixes
 *   give the same bits, so this changes no result.
 *   scheduler_create makes the cache hold at least one full context, and scheduler_check
 *   rejects requests longer than a context, so every admitted request can finish.
 * - The prefix cache receives a request's prompt pages when its prefill completes (so that
 *   concurrent requests with the same prefix share them) and all its full computed pages when it
 *   finishes. A match leaves at least one token to compute (the last position's logits sample the
 *   next token) and never covers a position whose input logprob is still to be scored, nor the
 *   one before it (its row scores it).
 * - Preemption drops the victim's pages (cached prefix pages stay in the cache) and puts it at
 *   the front of the queue. Its tokens (prompt + outputs so far), published outputs and scoring
 *   progress stay, so the recomputation neither scores nor samples twice. */
#include "runner/scheduler.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/log.h"
#include "runner/radix_cache.h"

#define SCHED_RATE_WINDOW 5.0  /* seconds of history behind last_gen_throughput */
#define SCHED_RATE_RING   4096 /* steps remembered for it */
/* An idle rank of a group looks for work of the others this often (a request reaching another
 * rank waits at most this long for the group to start its first step). */
#define SCHED_IDLE_POLL_NS 2000000L
/* Requests that wait for a running prefill passed over in one admission at most (admit). */
#define SCHED_HOLD_SCAN 64

typedef struct sched_seq sched_seq;

struct sched_seq {
    request *r;
    engine_seq es;          /* tokens, pages, progress; its sinks are r's arrays */
    int32_t *pages;         /* [page_cap] es.pages */
    int page_cap;           /* most pages it can ever hold */
    int published_out;      /* n_out as last published to r */
    int published_in;       /* n_in as last published to r */
    bool admitted_once;     /* cached_tokens is set at the first admission */
    bool prompt_cached;     /* its prompt pages went into the prefix cache */
    int matched;            /* tokens the prefix cache gave it at its latest admission */
    sched_seq *prev, *next; /* waiting queue links */
};

typedef struct {
    double t0, t1; /* start and end of a step */
    int n;         /* tokens it generated */
} sched_rate_entry;

struct scheduler {
    model *m;
    scheduler_config cfg;
    engine e;
    radix_cache rc;

    /* engine thread only */
    sched_seq **running; /* [n_running] in admission order */
    int n_running, cap_running;
    engine_seq **batch;     /* [cap_running] the step's sequences */
    sched_seq **batch_seqs; /* [cap_running] their owners */
    int32_t *step_table;    /* [n_batch, stride] the step's page table */
    size_t cap_table;

    /* shared, under mu */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    sched_seq *wait_head, *wait_tail;
    int n_waiting;
    bool wake_pending;
    bool stopped;  /* shut down: new requests are refused */
    bool draining; /* scheduler_drain: new requests are refused, the rest runs to its end */
    scheduler_stats stats;
    sched_rate_entry rate[SCHED_RATE_RING];
    int rate_next, rate_n;
    double t_first_gen; /* start of the first step that generated, 0 before */

    atomic_bool flush_pending;
    /* scheduler_abort's requests, under mu, applied by the next step: request ids to abort, and
     * whether to abort everything. */
    char **abort_rids;
    int n_abort_rids;
    bool abort_every;
    /* scheduler_update_weights's request, under mu: the folder (NULL: none), whether to abort,
     * then the engine thread's answer (upd_done, upd_rc, upd_msg) broadcast on upd_cv */
    const char *upd_dir;
    bool upd_abort, upd_done;
    int upd_rc, upd_aborted;
    char upd_msg[600];
    pthread_cond_t upd_cv;
    bool upd_is_running; /* engine thread: admission paused for an update */
    bool in_group;       /* engine thread: run_group runs the steps (updates are the group's) */
    bool upd_aborting;   /* engine thread: this pause has aborted every request */
    char served_dir[4096]; /* under mu: the folder of the last successful update ("" before) */
};

static double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int pages_for(const scheduler *s, int n_tokens) {
    int S = s->cfg.page_size;
    return (n_tokens + S - 1) / S;
}

/* ---------------------------------------------------------------- creation and checks */

scheduler *scheduler_create(model *m, const scheduler_config *cfg, char *err, size_t errlen) {
    scheduler_config c = *cfg;
    int max_pos = m->cfg.max_position_embeddings;
    if (c.context_length == 0) c.context_length = max_pos;
    if (c.max_running_requests < 1) {
        set_err(err, errlen, "max_running_requests must be >= 1, got %d", c.max_running_requests);
        return NULL;
    }
    if (c.page_size < 1) {
        set_err(err, errlen, "page_size must be >= 1, got %d", c.page_size);
        return NULL;
    }
    if (c.chunked_prefill_size < 1) {
        set_err(err, errlen, "chunked_prefill_size must be >= 1, got %d", c.chunked_prefill_size);
        return NULL;
    }
    if (c.context_length < 1 || c.context_length > max_pos) {
        set_err(err, errlen, "context_length %d must be in [1, %d] (max_position_embeddings)",
                c.context_length, max_pos);
        return NULL;
    }
    if (c.max_total_tokens < c.context_length) {
        set_err(err, errlen,
                "max_total_tokens (%d) must hold at least one full context (context_length %d)",
                c.max_total_tokens, c.context_length);
        return NULL;
    }
    int n_pages = (int)(((int64_t)c.max_total_tokens + c.page_size - 1) / c.page_size);
    scheduler *s = xcalloc(1, sizeof *s);
    s->m = m;
    s->cfg = c;
    if (engine_init(&s->e, m, n_pages, c.page_size, c.chunked_prefill_size, c.kv_cache_bf16, err,
                    errlen)) {
        free(s);
        return NULL;
    }
    /* Graphs are a speed-up: without their buffers (device memory) the steps run eagerly, as
     * they do when a capture fails (engine.c). */
    char why[256];
    if (c.cuda_graph_max_bs > 0 && m->ops->graph_begin &&
        engine_enable_graphs(&s->e, c.cuda_graph_max_bs, pages_for(s, c.context_length) + 1, why,
                             sizeof why))
        LOG_WARN("scheduler", "decode graphs off, steps run eagerly: %s", why);
    s->e.deterministic = c.deterministic;
    radix_cache_init(&s->rc, &s->e.kv);
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    pthread_cond_init(&s->upd_cv, NULL);
    atomic_init(&s->flush_pending, false);
    s->stats.kv_pages_total = n_pages;
    LOG_INFO("scheduler",
             "%d KV pages of %d tokens; up to %d running, %d prefill tokens per step, context %d, "
             "prefix cache %s%s",
             n_pages, c.page_size, c.max_running_requests, c.chunked_prefill_size, c.context_length,
             c.enable_radix_cache ? "on" : "off", c.deterministic ? ", deterministic" : "");
    return s;
}

int scheduler_check(const scheduler *s, const request *r, char *err, size_t errlen) {
    const gen_request *q = &r->gen;
    if (engine_check_request(&s->e, q, s->cfg.context_length, err, errlen)) return -1;
    int V = s->m->cfg.vocab_size;
    if (r->top_logprobs_num < 0 || r->top_logprobs_num > V)
        return set_err(err, errlen, "top_logprobs_num %d must be in [0, %d]", r->top_logprobs_num,
                       V);
    if (!r->out_ids)
        return set_err(err, errlen, "max_new_tokens %d is too large", q->max_new_tokens);
    if (r->top_logprobs_num > 0 && !r->out_top_ids)
        return set_err(err, errlen, "top_logprobs_num %d over %d positions is too many",
                       r->top_logprobs_num, q->max_new_tokens + 1);
    return 0;
}

/* ---------------------------------------------------------------- publishing */

/* Copy q's progress into its request under the request's lock; when kind is not FINISH_NONE,
 * finish it too. Then wake waiters and call notify, outside the lock. */
static void seq_publish(scheduler *s, sched_seq *q, finish_kind kind, const char *error) {
    request *r = q->r;
    engine_seq *es = &q->es;
    int n_in = engine_seq_n_in(es);
    bool changed = kind != FINISH_NONE || es->n_out != q->published_out || n_in != q->published_in;
    if (!changed) return;
    double now = now_seconds();
    pthread_mutex_lock(&r->mu);
    r->n_out = es->n_out;
    r->n_in = n_in;
    if (es->n_out > 0 && r->t_first_token == 0.0) r->t_first_token = now;
    if (kind != FINISH_NONE) {
        r->finish = kind;
        r->matched_token = es->matched_token;
        if (error) snprintf(r->error, sizeof r->error, "%s", error);
        r->done = true;
        r->t_done = now;
        r->sched = NULL;
    }
    pthread_mutex_unlock(&r->mu);
    pthread_cond_broadcast(&r->cv);
    q->published_out = es->n_out;
    q->published_in = n_in;
    if (r->notify) r->notify(r->notify_ctx);
}

/* Give back q's pages; with cache, first offer its full computed pages to the prefix cache. */
static void seq_drop_pages(scheduler *s, sched_seq *q, bool cache) {
    engine_seq *es = &q->es;
    if (cache && s->cfg.enable_radix_cache && es->n_computed >= s->cfg.page_size)
        radix_cache_insert(&s->rc, es->tokens, es->n_computed, es->pages);
    for (int i = 0; i < es->n_pages; i++)
        kv_cache_release_page(&s->e.kv, es->pages[i]);
    es->n_pages = 0;
    es->n_computed = 0;
    es->take = 0;
}

static void seq_free(sched_seq *q) {
    engine_seq_free(&q->es);
    free(q->pages);
    free(q);
}

/* Finish q (no longer queued or running): pages back, request finished and notified, the
 * scheduler's reference dropped. */
static void seq_retire(scheduler *s, sched_seq *q, finish_kind kind, const char *error) {
    seq_drop_pages(s, q, true);
    if (kind == FINISH_ABORT) q->es.matched_token = 0;
    seq_publish(s, q, kind, error);
    pthread_mutex_lock(&s->mu);
    s->stats.n_requests_done++;
    s->stats.n_prompt_tokens += q->r->gen.n_prompt;
    s->stats.n_generated_tokens += q->es.n_out;
    pthread_mutex_unlock(&s->mu);
    request_release(q->r);
    seq_free(q);
}

/* ---------------------------------------------------------------- queue (callers hold mu) */

static void queue_push_back(scheduler *s, sched_seq *q) {
    q->next = NULL;
    q->prev = s->wait_tail;
    if (s->wait_tail)
        s->wait_tail->next = q;
    else
        s->wait_head = q;
    s->wait_tail = q;
    s->n_waiting++;
}

static void queue_push_front(scheduler *s, sched_seq *q) {
    q->prev = NULL;
    q->next = s->wait_head;
    if (s->wait_head)
        s->wait_head->prev = q;
    else
        s->wait_tail = q;
    s->wait_head = q;
    s->n_waiting++;
}

static void queue_unlink(scheduler *s, sched_seq *q) {
    if (q->prev)
        q->prev->next = q->next;
    else
        s->wait_head = q->next;
    if (q->next)
        q->next->prev = q->prev;
    else
        s->wait_tail = q->prev;
    q->prev = q->next = NULL;
    s->n_waiting--;
}

/* ---------------------------------------------------------------- running set */

static void running_push(scheduler *s, sched_seq *q) {
    if (s->n_running == s->cap_running) {
        s->cap_running = s->cap_running ? 2 * s->cap_running : 16;
        s->running = xrealloc(s->running, (size_t)s->cap_running * sizeof *s->running);
        s->batch = xrealloc(s->batch, (size_t)s->cap_running * sizeof *s->batch);
        s->batch_seqs = xrealloc(s->batch_seqs, (size_t)s->cap_running * sizeof *s->batch_seqs);
    }
    s->running[s->n_running++] = q;
}

static void running_remove_at(scheduler *s, int i) {
    memmove(s->running + i, s->running + i + 1,
            (size_t)(s->n_running - i - 1) * sizeof *s->running);
    s->n_running--;
}

static void running_remove(scheduler *s, sched_seq *q) {
    for (int i = 0; i < s->n_running; i++)
        if (s->running[i] == q) {
            running_remove_at(s, i);
            return;
        }
    MS_ASSERT(!"finished request not in the running set");
}

/* Preempt the most recently admitted running request: pages dropped, back to the queue front. */
static void preempt_last(scheduler *s) {
    MS_ASSERT(s->n_running > 0);
    sched_seq *q = s->running[s->n_running - 1];
    s->n_running--;
    seq_drop_pages(s, q, false);
    LOG_DEBUG("scheduler", "preempt %s at %d tokens (%d out)", q->r->rid, q->es.n_tokens,
              q->es.n_out);
    pthread_mutex_lock(&s->mu);
    queue_push_front(s, q);
    s->stats.n_preemptions++;
    pthread_mutex_unlock(&s->mu);
}

/* A page for q, evicting from the prefix cache when the pool is empty. false: none to be had. */
static bool seq_alloc_page(scheduler *s, sched_seq *q) {
    MS_ASSERT(q->es.n_pages < q->page_cap);
    int32_t p = kv_cache_alloc_page(&s->e.kv);
    if (p < 0 && radix_cache_evict(&s->rc, 1) > 0) p = kv_cache_alloc_page(&s->e.kv);
    if (p < 0) return false;
    q->es.pages[q->es.n_pages++] = p;
    return true;
}

/* Decoding: only the last sampled token is uncomputed. */
static bool seq_decoding(const engine_seq *es) {
    return es->n_tokens - es->n_computed == 1 && es->n_tokens > es->req->n_prompt;
}

/* Pages promised to running requests for tokens they have not computed yet. */
static int pages_promised(const scheduler *s) {
    int n = 0;
    for (int i = 0; i < s->n_running; i++) {
        const engine_seq *es = &s->running[i]->es;
        int need = pages_for(s, es->n_tokens) - es->n_pages;
        if (need > 0) n += need;
    }
    return n;
}

/* Admit q if pages allow: share its cached prefix, check the pages for the rest (evicting from
 * the prefix cache if that makes room). false: it must wait (nothing changed). */
static bool seq_try_admit(scheduler *s, sched_seq *q) {
    engine_seq *es = &q->es;
    const gen_request *g = es->req;
    kv_cache *kv = &s->e.kv;
    int matched = 0;
    if (s->cfg.enable_radix_cache) {
        int lim = es->n_tokens - 1;
        if (es->next_score < g->n_prompt && es->next_score - 1 < lim) lim = es->next_score - 1;
        matched = radix_cache_match(&s->rc, es->tokens, lim, es->pages);
    }
    int have = matched / s->cfg.page_size;
    int want = pages_for(s, es->n_tokens) + 1;
    if (want > q->page_cap) want = q->page_cap;
    int need = want - have;
    int avail = kv->n_free - pages_promised(s);
    if (avail < need) {
        radix_cache_evict(&s->rc, need - avail);
        avail = kv->n_free - pages_promised(s);
    }
    if (avail < need) {
        for (int i = 0; i < have; i++)
            kv_cache_release_page(kv, es->pages[i]);
        return false;
    }
    es->n_pages = have;
    es->n_computed = matched;
    q->matched = matched;
    if (!q->admitted_once) {
        q->admitted_once = true;
        int cached = matched < g->n_prompt ? matched : g->n_prompt;
        pthread_mutex_lock(&q->r->mu);
        q->r->cached_tokens = cached;
        pthread_mutex_unlock(&q->r->mu);
        pthread_mutex_lock(&s->mu);
        s->stats.n_cached_tokens += cached;
        pthread_mutex_unlock(&s->mu);
    }
    return true;
}

/* ---------------------------------------------------------------- submit and control */

void scheduler_submit(scheduler *s, request *r) {
    request_retain(r);
    sched_seq *q = xcalloc(1, sizeof *q);
    q->r = r;
    char err[256];
    bool ok = scheduler_check(s, r, err, sizeof err) == 0;
    if (ok) {
        const gen_request *g = &r->gen;
        engine_seq_init(&q->es, g, r->top_logprobs_num);
        int64_t most = (int64_t)g->n_prompt + (g->max_new_tokens > 0 ? g->max_new_tokens - 1 : 0);
        q->page_cap = pages_for(s, (int)most);
        q->pages = xmalloc((size_t)q->page_cap * sizeof(int32_t));
        engine_seq *es = &q->es;
        es->pages = q->pages;
        es->out_ids = r->out_ids;
        es->out_logprobs = r->out_logprobs;
        es->out_top_ids = r->out_top_ids;
        es->out_top_logprobs = r->out_top_logprobs;
        es->in_logprobs = r->in_logprobs;
        es->in_top_ids = r->in_top_ids;
        es->in_top_logprobs = r->in_top_logprobs;
        q->published_in = -1; /* publish n_in once even when nothing else changes */
    }
    pthread_mutex_lock(&r->mu);
    r->t_submit = now_seconds();
    if (ok) r->sched = s;
    pthread_mutex_unlock(&r->mu);
    if (ok) {
        pthread_mutex_lock(&s->mu);
        if (!s->stopped && !s->draining) {
            queue_push_back(s, q);
            s->stats.n_waiting = s->n_waiting;
            s->wake_pending = true;
            pthread_cond_signal(&s->cv);
            q = NULL;
        } else {
            snprintf(err, sizeof err, "server shutting down");
        }
        pthread_mutex_unlock(&s->mu);
        if (!q) return;
    }
    /* Rejected: finished at once, never queued. */
    pthread_mutex_lock(&r->mu);
    r->finish = FINISH_ABORT;
    snprintf(r->error, sizeof r->error, "%s", err);
    r->done = true;
    r->t_done = now_seconds();
    r->sched = NULL;
    pthread_mutex_unlock(&r->mu);
    pthread_cond_broadcast(&r->cv);
    if (r->notify) r->notify(r->notify_ctx);
    seq_free(q);
    request_release(r);
}

void scheduler_wake(scheduler *s) {
    pthread_mutex_lock(&s->mu);
    s->wake_pending = true;
    pthread_cond_signal(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

void scheduler_flush_cache(scheduler *s) {
    atomic_store(&s->flush_pending, true);
    scheduler_wake(s);
}

void scheduler_abort(scheduler *s, const char *rid, bool all) {
    pthread_mutex_lock(&s->mu);
    if (all) {
        s->abort_every = true;
    } else if (rid && *rid) {
        s->abort_rids = xrealloc(s->abort_rids, sizeof(char *) * (size_t)(s->n_abort_rids + 1));
        s->abort_rids[s->n_abort_rids++] = xstrdup(rid);
    }
    s->wake_pending = true;
    pthread_cond_signal(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

/* ---------------------------------------------------------------- the step */

/* Whether scheduler_abort's pending ask (rids[n], every) names r. */
static bool abort_names(const request *r, char *const *rids, int n, bool every) {
    if (every) return true;
    for (int i = 0; i < n; i++)
        if (!strcmp(r->rid, rids[i]) || (r->client_rid[0] && !strcmp(r->client_rid, rids[i])))
            return true;
    return false;
}

static void mark_api_abort(request *r) {
    atomic_store(&r->abort_api, true);
    atomic_store(&r->abort, true);
}

static const char *abort_reason(const scheduler *s, const request *r) {
    if (!atomic_load(&r->abort_api)) return "aborted by client";
    return s->upd_is_running ? "aborted by /update_weights_from_disk" : "aborted by /abort_request";
}

/* Finish every request that asked to abort, running or queued, after marking those that
 * scheduler_abort named since the last step. */
static void drop_aborted(scheduler *s) {
    pthread_mutex_lock(&s->mu);
    char **rids = s->abort_rids;
    int n_rids = s->n_abort_rids;
    bool every = s->abort_every;
    s->abort_rids = NULL;
    s->n_abort_rids = 0;
    s->abort_every = false;
    if (n_rids || every)
        for (sched_seq *q = s->wait_head; q; q = q->next)
            if (abort_names(q->r, rids, n_rids, every)) mark_api_abort(q->r);
    pthread_mutex_unlock(&s->mu);
    if (n_rids || every)
        for (int i = 0; i < s->n_running; i++)
            if (abort_names(s->running[i]->r, rids, n_rids, every))
                mark_api_abort(s->running[i]->r);
    for (int i = 0; i < n_rids; i++)
        free(rids[i]);
    free(rids);

    for (int i = 0; i < s->n_running;) {
        sched_seq *q = s->running[i];
        if (!atomic_load(&q->r->abort)) {
            i++;
            continue;
        }
        running_remove_at(s, i);
        seq_retire(s, q, FINISH_ABORT, abort_reason(s, q->r));
    }
    sched_seq *dropped = NULL;
    pthread_mutex_lock(&s->mu);
    for (sched_seq *q = s->wait_head, *nx; q; q = nx) {
        nx = q->next;
        if (!atomic_load(&q->r->abort)) continue;
        queue_unlink(s, q);
        q->next = dropped;
        dropped = q;
    }
    pthread_mutex_unlock(&s->mu);
    while (dropped) {
        sched_seq *q = dropped;
        dropped = q->next;
        seq_retire(s, q, FINISH_ABORT, abort_reason(s, q->r));
    }
}

/* Every decoding request gets the page its next token needs; when none is left, the most
 * recently admitted request is preempted, until the oldest ones fit. */
static void reserve_decode_pages(scheduler *s) {
    for (int i = 0; i < s->n_running; i++) {
        sched_seq *q = s->running[i];
        engine_seq *es = &q->es;
        if (!seq_decoding(es)) continue;
        int need = pages_for(s, es->n_computed + 1);
        while (es->n_pages < need && !seq_alloc_page(s, q)) {
            bool self = s->running[s->n_running - 1] == q;
            preempt_last(s);
            if (self) return; /* it was the last one: everything after it is gone too */
        }
    }
}

/* Whether q should wait for a running request's prefill: one whose prompt is not yet in the
 * prefix cache and shares with q's tokens whole pages beyond what that request found in the
 * cache itself, at least half of what q could take from the cache. Once its prefill completes
 * its prompt pages go into the cache, and q then takes them instead of computing them again
 * (n samples of one prompt, prompts that share a long few-shot prefix sent together). Only what
 * q can take from the cache counts: not its last token, not the positions whose logprobs it
 * still has to score (seq_try_admit's limit). A short common head (a system prompt) does not
 * make q wait for another's long prefill. */
static bool seq_shares_prefill(const scheduler *s, const sched_seq *q) {
    if (!s->cfg.enable_radix_cache) return false;
    const engine_seq *es = &q->es;
    int lim = es->n_tokens - 1;
    if (es->next_score < es->req->n_prompt && es->next_score - 1 < lim) lim = es->next_score - 1;
    const int S = s->cfg.page_size;
    if (lim < S) return false;
    for (int i = 0; i < s->n_running; i++) {
        const sched_seq *r = s->running[i];
        if (r->prompt_cached || r->es.n_computed >= r->es.req->n_prompt) continue;
        const int n = lim < r->es.req->n_prompt ? lim : r->es.req->n_prompt;
        int l = 0;
        while (l < n && es->tokens[l] == r->es.tokens[l])
            l++;
        const int gain = l / S * S - r->matched;
        if (gain > 0 && 2 * gain >= lim) return true;
    }
    return false;
}

/* Admit from the queue in order while the running cap and the pages allow. A request that
 * shares a running prefill (seq_shares_prefill) keeps its place and is passed over for this
 * step (at most SCHED_HOLD_SCAN of them); the first one that does not fit the free pages stops
 * admission, so no later one overtakes it. */
static void admit(scheduler *s) {
    sched_seq *held = NULL; /* the last request passed over */
    int n_held = 0;
    while (s->n_running < s->cfg.max_running_requests) {
        /* Only this thread removes from the queue or adds at its front; submit appends under mu. */
        pthread_mutex_lock(&s->mu);
        sched_seq *q = held ? held->next : s->wait_head;
        pthread_mutex_unlock(&s->mu);
        if (!q) return;
        if (seq_shares_prefill(s, q)) {
            if (++n_held > SCHED_HOLD_SCAN) return;
            held = q;
            continue;
        }
        if (!seq_try_admit(s, q)) return;
        pthread_mutex_lock(&s->mu);
        queue_unlink(s, q);
        pthread_mutex_unlock(&s->mu);
        running_push(s, q);
    }
}

/* The step's batch: decode tokens first, then prompt chunks in admission order under the
 * budget, each with the pages it needs (a chunk shrinks to the pages it can get). */
static int build_batch(scheduler *s) {
    int n = 0, budget = s->cfg.chunked_prefill_size, S = s->cfg.page_size;
    for (int pass = 0; pass < 2; pass++) {
        for (int i = 0; i < s->n_running; i++) {
            sched_seq *q = s->running[i];
            engine_seq *es = &q->es;
            bool decode = seq_decoding(es);
            if (decode != (pass == 0)) continue;
            int left = es->n_tokens - es->n_computed;
            int cnt = decode ? 1 : (left < budget ? left : budget);
            if (cnt <= 0) continue;
            int need = pages_for(s, es->n_computed + cnt);
            int short_by = need - es->n_pages - s->e.kv.n_free;
            if (short_by > 0) radix_cache_evict(&s->rc, short_by); /* one pass, not per page */
            while (es->n_pages < need && seq_alloc_page(s, q)) {
            }
            if (es->n_pages < need) cnt = es->n_pages * S - es->n_computed;
            if (cnt <= 0) continue;
            if (!decode) budget -= cnt;
            es->take = cnt;
            s->batch[n] = es;
            s->batch_seqs[n] = q;
            n++;
        }
    }
    return n;
}

static void record_rate(scheduler *s, double t0, double t1, int n_gen) {
    if (n_gen <= 0) return;
    if (s->t_first_gen == 0.0) s->t_first_gen = t0;
    s->rate[s->rate_next] = (sched_rate_entry){.t0 = t0, .t1 = t1, .n = n_gen};
    s->rate_next = (s->rate_next + 1) % SCHED_RATE_RING;
    if (s->rate_n < SCHED_RATE_RING) s->rate_n++;
}

/* The engine thread's pieces of an update. Pausing: admission stops (upd_is_running), and with
 * abort_all everything running or queued is aborted and answers what it has. */
static void update_pause(scheduler *s, const char *dir, bool abort_all, bool drop_now) {
    s->upd_is_running = true;
    LOG_INFO("scheduler", "update_weights_from_disk %s: %s", dir,
             abort_all ? "aborting every request" : "waiting for the running requests");
    if (!abort_all) return;
    s->upd_aborting = true;
    int n = s->n_running; /* as /abort_request's abort_all */
    pthread_mutex_lock(&s->mu);
    for (sched_seq *q = s->wait_head; q; q = q->next, n++)
        mark_api_abort(q->r);
    pthread_mutex_unlock(&s->mu);
    for (int i = 0; i < s->n_running; i++)
        mark_api_abort(s->running[i]->r);
    s->upd_aborted = n;
    if (drop_now) drop_aborted(s); /* else the next step's plan drops them */
}

/* Loading (nothing running): dir's weights beside the served ones, checked against them. The new
 * model, or NULL with err saying why. */
static model *update_load(scheduler *s, const char *dir, char *err, size_t errlen) {
    model_load_opts lo = s->cfg.load_opts;
    lo.dummy = false; /* from disk, also where the server started on dummy weights */
    model *fresh = model_load_with(dir, s->m->ops, &lo, err, errlen);
    const char *diff = fresh ? model_config_diff(&s->m->cfg, &fresh->cfg) : NULL;
    if (fresh && !diff && fresh->expert_payload != s->m->expert_payload) diff = "quantization";
    if (diff) {
        set_err(err, errlen, "%s/config.json: %s differs from the served model's (%s)", dir, diff,
                s->m->dir);
        model_free(fresh);
        return NULL;
    }
    return fresh;
}

/* The end: fresh (when every rank loaded) is swapped in and the prefix cache emptied, else freed;
 * admission resumes; answered (this rank's own request) with rc and msg. */
static void update_finish(scheduler *s, const char *dir, model *fresh, bool swap, bool answer,
                          const char *msg) {
    int rc = -1;
    if (fresh && swap) {
        model_swap(s->m, fresh);
        radix_cache_flush(&s->rc);
        rc = 0;
        pthread_mutex_lock(&s->mu);
        snprintf(s->served_dir, sizeof s->served_dir, "%s", dir);
        pthread_mutex_unlock(&s->mu);
        LOG_INFO("scheduler", "serving the weights of %s", s->m->dir);
    } else {
        LOG_WARN("scheduler", "update_weights_from_disk %s failed, the old weights stay: %s", dir,
                 msg);
    }
    model_free(fresh); /* the old weights after a swap, else the unused new ones */
    s->upd_is_running = s->upd_aborting = false;
    if (!answer) return;
    pthread_mutex_lock(&s->mu);
    s->upd_done = true;
    s->upd_rc = rc;
    snprintf(s->upd_msg, sizeof s->upd_msg, "%s",
             rc == 0 ? "Succeeded to update model weights." : msg);
    pthread_cond_broadcast(&s->upd_cv);
    pthread_mutex_unlock(&s->mu);
}

/* This rank's waiting request: its folder (NULL: none) and whether it aborts. */
static const char *update_waiting(scheduler *s, bool *abort_all) {
    pthread_mutex_lock(&s->mu);
    const char *dir = s->upd_dir && !s->upd_done ? s->upd_dir : NULL;
    *abort_all = dir && s->upd_abort;
    pthread_mutex_unlock(&s->mu);
    return dir;
}

/* One process: the engine thread's part of scheduler_update_weights at each step: takes a new
 * request (aborting everything first where asked), and once nothing runs, loads, checks and
 * swaps. (A rank group: run_group and group_update.) */
static void update_weights_step(scheduler *s) {
    bool abort_all = false;
    const char *dir = update_waiting(s, &abort_all);
    if (!dir) return;
    if (!s->upd_is_running) update_pause(s, dir, abort_all, true);
    if (s->n_running > 0) return; /* admission is paused meanwhile */
    char err[512] = "";
    model *fresh = update_load(s, dir, err, sizeof err);
    update_finish(s, dir, fresh, fresh != NULL, true, err);
}

/* A rank group's update, once every rank is paused with nothing running (collective): the folder
 * of the asking rank (root) reaches every rank, each loads its share of the experts, and only when
 * every rank has loaded do all swap; else all keep the old weights and root answers with the
 * first failing rank's message. 0, or -1 when the group itself failed (err). */
#define GROUP_DIR_BYTES 4096
typedef struct {
    int64_t ok;
    char msg[512];
} group_update_result;

static int group_update(scheduler *s, rank_group *g, int root, char *err, size_t errlen) {
    const int n = rank_group_size(g), me = rank_group_rank(g);
    char mine[GROUP_DIR_BYTES] = "";
    bool abort_all = false;
    const char *own = update_waiting(s, &abort_all);
    if (me == root) snprintf(mine, sizeof mine, "%s", own ? own : "");
    char *dirs = xmalloc((size_t)n * GROUP_DIR_BYTES);
    group_update_result res = {0}, *all = xcalloc((size_t)n, sizeof *all);
    model *fresh = NULL;
    int rc = rank_group_share(g, mine, sizeof mine, dirs, err, errlen);
    if (rc == 0) {
        const char *dir = dirs + (size_t)root * GROUP_DIR_BYTES;
        fresh = dir[0] ? update_load(s, dir, res.msg, sizeof res.msg) : NULL;
        if (!dir[0]) set_err(res.msg, sizeof res.msg, "the folder did not reach rank %d", me);
        res.ok = fresh != NULL;
        rc = rank_group_share(g, &res, sizeof res, all, err, errlen);
    }
    if (rc == 0) {
        int bad = -1;
        for (int r = 0; r < n && bad < 0; r++)
            if (!all[r].ok) bad = r;
        char msg[600];
        if (bad >= 0) {
            all[bad].msg[sizeof all[bad].msg - 1] = '\0';
            snprintf(msg, sizeof msg, "rank %d: %s", bad, all[bad].msg);
        }
        update_finish(s, dirs + (size_t)root * GROUP_DIR_BYTES, fresh, bad < 0, me == root && own,
                      bad >= 0 ? msg : "");
    } else {
        model_free(fresh);
    }
    free(dirs);
    free(all);
    return rc;
}

int scheduler_update_weights(scheduler *s, const char *dir, bool abort_running, int *n_aborted,
                             char *msg, size_t msglen) {
    if (n_aborted) *n_aborted = 0;
    pthread_mutex_lock(&s->mu);
    if (s->stopped || s->draining) {
        pthread_mutex_unlock(&s->mu);
        return set_err(msg, msglen, "server shutting down");
    }
    if (s->upd_dir) {
        pthread_mutex_unlock(&s->mu);
        return set_err(msg, msglen, "another weight update is in progress");
    }
    s->upd_dir = dir;
    s->upd_abort = abort_running;
    s->upd_done = false;
    s->upd_aborted = 0;
    s->wake_pending = true;
    pthread_cond_signal(&s->cv);
    while (!s->upd_done && !s->stopped)
        pthread_cond_wait(&s->upd_cv, &s->mu);
    int rc = s->upd_done ? s->upd_rc : -1;
    set_err(msg, msglen, "%s", s->upd_done ? s->upd_msg : "server shutting down");
    if (n_aborted) *n_aborted = s->upd_aborted;
    s->upd_dir = NULL;
    s->upd_done = false;
    pthread_mutex_unlock(&s->mu);
    return rc;
}

void scheduler_model_dir(scheduler *s, char *out, size_t len) {
    pthread_mutex_lock(&s->mu);
    snprintf(out, len, "%s", s->served_dir);
    pthread_mutex_unlock(&s->mu);
}

/* The first half of a step: everything up to the batch. Returns the batch's size (sequences);
 * *n_tokens gets its tokens. */
static int step_plan(scheduler *s, int *n_tokens) {
    if (atomic_exchange(&s->flush_pending, false)) radix_cache_flush(&s->rc);
    if (!s->in_group) update_weights_step(s); /* a rank group: run_group */
    drop_aborted(s);
    reserve_decode_pages(s);
    if (!s->upd_is_running) admit(s);

    int n_batch = build_batch(s);
    /* Running requests but no page for any of them: make room from the newest (never needed
     * while the page promises hold; it keeps the step loop from stalling if they do not). */
    while (n_batch == 0 && s->n_running > 1) {
        preempt_last(s);
        n_batch = build_batch(s);
    }
    int T = 0;
    for (int i = 0; i < n_batch; i++)
        T += s->batch[i]->take;
    *n_tokens = T;
    return n_batch;
}

/* The second half: the forward pass over the planned batch (with the group's runtime_max in
 * s->e.runtime_max, also when the batch is empty), then publishing. Returns the tokens
 * forwarded, or -1 when the forward failed. */
static int step_run(scheduler *s, int n_batch, double t0) {
    int T = 0, n_gen = 0;
    double t_forward = 0.0, t_sample = 0.0;
    if (n_batch == 0 && s->e.runtime_max > 0) {
        T = engine_step(&s->e, s->batch, 0, s->step_table, 1);
        if (T < 0) return -1;
        t_forward = s->e.last_forward_seconds;
    }
    if (n_batch > 0) {
        int stride = 1;
        for (int i = 0; i < n_batch; i++)
            if (s->batch[i]->n_pages > stride) stride = s->batch[i]->n_pages;
        size_t need = (size_t)n_batch * stride;
        if (need > s->cap_table) {
            s->step_table = xrealloc(s->step_table, need * sizeof(int32_t));
            s->cap_table = need;
        }
        for (int i = 0; i < n_batch; i++) {
            engine_seq *es = s->batch[i];
            es->slot = i;
            memcpy(s->step_table + (size_t)i * stride, es->pages,
                   (size_t)es->n_pages * sizeof(int32_t));
        }
        T = engine_step(&s->e, s->batch, n_batch, s->step_table, stride);
        if (T < 0) return -1;
        t_forward = s->e.last_forward_seconds;
        t_sample = s->e.last_sample_seconds;

        for (int i = 0; i < n_batch; i++) {
            sched_seq *q = s->batch_seqs[i];
            engine_seq *es = &q->es;
            n_gen += es->n_out - q->published_out;
            if (s->cfg.enable_radix_cache && !q->prompt_cached &&
                es->n_computed >= es->req->n_prompt) {
                radix_cache_insert(&s->rc, es->tokens, es->n_computed, es->pages);
                q->prompt_cached = true;
            }
            if (es->finish != FINISH_NONE) {
                running_remove(s, q);
                seq_retire(s, q, es->finish, NULL);
            } else {
                seq_publish(s, q, FINISH_NONE, NULL);
            }
        }
    }

    double t1 = now_seconds();
    pthread_mutex_lock(&s->mu);
    if (T > 0) {
        s->stats.n_steps++;
        s->stats.step_forward_seconds += t_forward;
        s->stats.step_sched_seconds += (t1 - t0) - t_forward;
        s->stats.step_sample_seconds += t_sample;
        record_rate(s, t0, t1, n_gen);
    }
    s->stats.n_running = s->n_running;
    s->stats.n_waiting = s->n_waiting;
    s->stats.kv_pages_used = s->e.kv.n_pages - s->e.kv.n_free;
    pthread_mutex_unlock(&s->mu);
    return T;
}

int scheduler_step(scheduler *s) {
    double t0 = now_seconds();
    int T;
    int n_batch = step_plan(s, &T);
    s->e.runtime_max = 0;
    return step_run(s, n_batch, t0);
}

/* ---------------------------------------------------------------- loop, shutdown, stats */

/* Finish everything queued or running with FINISH_ABORT and msg; refuse new requests. */
static void abort_all(scheduler *s, const char *msg) {
    while (s->n_running > 0) {
        sched_seq *q = s->running[s->n_running - 1];
        s->n_running--;
        seq_retire(s, q, FINISH_ABORT, msg);
    }
    pthread_mutex_lock(&s->mu);
    s->stopped = true;
    pthread_cond_broadcast(&s->upd_cv); /* a weight update waiting for the engine gives up */
    sched_seq *list = s->wait_head;
    s->wait_head = s->wait_tail = NULL;
    s->n_waiting = 0;
    pthread_mutex_unlock(&s->mu);
    while (list) {
        sched_seq *q = list;
        list = q->next;
        seq_retire(s, q, FINISH_ABORT, msg);
    }
    pthread_mutex_lock(&s->mu);
    s->stats.n_running = 0;
    s->stats.n_waiting = 0;
    s->stats.kv_pages_used = s->e.kv.n_pages - s->e.kv.n_free;
    pthread_mutex_unlock(&s->mu);
}

void scheduler_drain(scheduler *s) {
    pthread_mutex_lock(&s->mu);
    s->draining = true;
    s->wake_pending = true;
    pthread_cond_signal(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

static bool is_draining(scheduler *s) {
    pthread_mutex_lock(&s->mu);
    bool d = s->draining;
    pthread_mutex_unlock(&s->mu);
    return d;
}

/* Engine thread: draining and nothing left, queued or running. */
static bool drained(scheduler *s) {
    pthread_mutex_lock(&s->mu);
    bool d = s->draining && s->n_waiting == 0 && s->n_running == 0;
    pthread_mutex_unlock(&s->mu);
    return d;
}

static void run_alone(scheduler *s, atomic_bool *stop) {
    while (!atomic_load(stop)) {
        if (scheduler_step(s) > 0) continue;
        if (drained(s)) {
            LOG_INFO("scheduler", "drained: every request has finished");
            return;
        }
        pthread_mutex_lock(&s->mu);
        while (!s->wake_pending && !atomic_load(stop))
            pthread_cond_wait(&s->cv, &s->mu);
        s->wake_pending = false;
        pthread_mutex_unlock(&s->mu);
    }
}

/* Sleep until a request or a stop arrives here, or the idle poll interval has passed. */
static void idle_wait(scheduler *s, atomic_bool *stop) {
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_nsec += SCHED_IDLE_POLL_NS;
    if (until.tv_nsec >= 1000000000L) {
        until.tv_sec++;
        until.tv_nsec -= 1000000000L;
    }
    pthread_mutex_lock(&s->mu);
    if (!s->wake_pending && !atomic_load(stop)) pthread_cond_timedwait(&s->cv, &s->mu, &until);
    s->wake_pending = false;
    pthread_mutex_unlock(&s->mu);
}

static void fill_report(scheduler *s, int n_tokens, bool stopping, rank_report *r) {
    scheduler_stats st;
    scheduler_get_stats(s, &st);
    *r = (rank_report){.n_tokens = n_tokens,
                       .stop = stopping,
                       .n_running = s->n_running,
                       .n_waiting = st.n_waiting,
                       .kv_pages_used = s->e.kv.n_pages - s->e.kv.n_free,
                       .kv_pages_total = s->e.kv.n_pages,
                       .n_requests_done = st.n_requests_done,
                       .n_generated_tokens = st.n_generated_tokens,
                       .gen_throughput_milli = (int64_t)llround(st.last_gen_throughput * 1000.0)};
}

/* The runtime_max a step of the rank group runs with, the same on every rank. With decode
 * graphs (a backend that has them, cuda_graph_max_bs set: the same on every rank) the group's
 * largest batch goes up to a power of two, at most cuda_graph_max_bs: a captured step holds its
 * runtime_max, so a few values cover every decode step (runner/engine.c keys its graphs by
 * batch and by these). Larger steps keep theirs. */
static int step_runtime_max(const scheduler *s, int rm) {
    const int gmax = s->cfg.cuda_graph_max_bs;
    /* the all-to-all's max_tokens_per_rank (server/main.c): never above it */
    const int cap = s->cfg.max_running_requests + s->cfg.chunked_prefill_size;
    if (gmax <= 0 || !s->m->ops->graph_begin || rm > gmax) return rm;
    int b = 1;
    while (b < rm)
        b <<= 1;
    b = b < gmax ? b : gmax;
    b = b < cap ? b : cap;
    return b > rm ? b : rm;
}

static int run_group(scheduler *s, rank_group *g, atomic_bool *stop, char *err, size_t errlen) {
    s->in_group = true;
    for (;;) {
        double t0 = now_seconds();
        int T = 0;
        bool stopping = atomic_load(stop);
        bool draining = is_draining(s);
        int n_batch = stopping ? 0 : step_plan(s, &T);
        rank_report me;
        fill_report(s, T, stopping, &me);
        if (draining) me.drain = T == 0 && drained(s) ? 2 : 1;
        /* a weight update: asked here (the lowest asking rank's goes first), then every rank
         * pauses, and once none has anything running they load and swap together */
        bool upd_abort = false;
        if (update_waiting(s, &upd_abort)) me.update = upd_abort ? 2 : 1;
        me.update_idle = s->upd_is_running && s->n_running == 0 && n_batch == 0;
        rank_step st;
        if (rank_group_step(g, &me, &st, err, errlen) != 0) return -1;
        if (st.stop) {
            if (!stopping)
                LOG_INFO("scheduler", "rank %d is stopping: stopping with it", st.stop_rank);
            return 0;
        }
        if (st.drained) {
            LOG_INFO("scheduler", "drained: every request of every rank has finished");
            return 0;
        }
        if (st.drain && !draining) {
            LOG_INFO("scheduler", "rank %d is draining: draining with it", st.drain_rank);
            scheduler_drain(s);
            if (s->cfg.on_peer_drain) s->cfg.on_peer_drain(s->cfg.on_peer_drain_ctx, st.drain_rank);
        }
        if (st.update_ready) {
            if (group_update(s, g, st.update_rank, err, errlen) != 0) return -1;
            continue;
        }
        /* (a pause that began for an update without abort_all_requests aborts when a lower rank's
         * with it comes first) */
        if (st.update_rank >= 0 && (!s->upd_is_running || (st.update_abort && !s->upd_aborting))) {
            char from[48];
            snprintf(from, sizeof from, "from rank %d", st.update_rank);
            update_pause(s, from, st.update_abort, false);
        }
        if (st.runtime_max == 0) {
            idle_wait(s, stop);
            continue;
        }
        s->e.runtime_max = step_runtime_max(s, st.runtime_max);
        if (step_run(s, n_batch, t0) < 0) return set_err(err, errlen, "%s", s->m->err);
    }
}

int scheduler_run(scheduler *s, rank_group *g, atomic_bool *stop, char *err, size_t errlen) {
    int rc = 0;
    if (!g || rank_group_size(g) == 1) {
        run_alone(s, stop);
        abort_all(s, "server shutting down");
    } else {
        rc = run_group(s, g, stop, err, errlen);
        if (rc == 0) {
            abort_all(s, "server shutting down");
        } else {
            char msg[1200];
            snprintf(msg, sizeof msg, "the rank group failed: %s", err);
            abort_all(s, msg);
        }
    }
    sampler_scratch_free();
    return rc;
}

void scheduler_free(scheduler *s) {
    if (!s) return;
    abort_all(s, "server shutting down");
    radix_cache_free(&s->rc);
    engine_free(&s->e);
    free(s->running);
    free(s->batch);
    free(s->batch_seqs);
    free(s->step_table);
    for (int i = 0; i < s->n_abort_rids; i++)
        free(s->abort_rids[i]);
    free(s->abort_rids);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    pthread_cond_destroy(&s->upd_cv);
    free(s);
}

void scheduler_get_stats(scheduler *s, scheduler_stats *out) {
    double now = now_seconds(), from = now - SCHED_RATE_WINDOW;
    pthread_mutex_lock(&s->mu);
    *out = s->stats;
    int64_t sum = 0;
    int kept = 0;
    double oldest = now;
    for (int k = 0; k < s->rate_n; k++) {
        const sched_rate_entry *e =
            &s->rate[(s->rate_next - 1 - k + 2 * SCHED_RATE_RING) % SCHED_RATE_RING];
        if (e->t1 <= from) break;
        sum += e->n;
        oldest = e->t0;
        kept++;
    }
    /* The rate covers the window, or less of it when the ring or the run is younger. */
    double since = from;
    if (s->t_first_gen > since) since = s->t_first_gen;
    if (kept == SCHED_RATE_RING && oldest > since) since = oldest;
    pthread_mutex_unlock(&s->mu);
    out->last_gen_throughput = sum > 0 && now > since ? (double)sum / (now - since) : 0.0;
}

int scheduler_validate(scheduler *s, char *err, size_t errlen) {
    const kv_cache *kv = &s->e.kv;
    if (radix_cache_validate(&s->rc, err, errlen)) return -1;
    int64_t refs = 0;
    int n_zero = 0;
    for (int p = 0; p < kv->n_pages; p++) {
        refs += kv->refs[p];
        if (kv->refs[p] == 0) n_zero++;
    }
    int64_t held = s->rc.n_pages;
    for (int i = 0; i < s->n_running; i++)
        held += s->running[i]->es.n_pages;
    if (refs != held)
        return set_err(err, errlen, "pages: %lld references, %lld holdings", (long long)refs,
                       (long long)held);
    if (n_zero != kv->n_free)
        return set_err(err, errlen, "pages: %d unreferenced, %d on the free list", n_zero,
                       kv->n_free);
    pthread_mutex_lock(&s->mu);
    int waiting_pages = 0;
    for (sched_seq *q = s->wait_head; q; q = q->next)
        waiting_pages += q->es.n_pages;
    pthread_mutex_unlock(&s->mu);
    if (waiting_pages)
        return set_err(err, errlen, "pages: %d held by queued requests", waiting_pages);
    return 0;
}
