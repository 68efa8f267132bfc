/* The request channel (see request.h): owned copies of the inputs, output arrays sized once at
 * creation (max_new_tokens + 1 entries, so the engine never reallocates what readers look at),
 * an atomic reference count, and a mutex + condition variable for waiting readers.
 *
 * Generated ids are 32 hex digits from a process-wide counter mixed with the start time and the
 * process id, unique within a process and unlikely to repeat across restarts. */
#include "runner/request.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"
#include "runner/scheduler.h"

static atomic_ullong request_counter;

static uint64_t mix64(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static void request_make_id(char *out, size_t n) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t c = atomic_fetch_add(&request_counter, 1);
    uint64_t base = mix64((uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec) ^
                    mix64((uint64_t)getpid());
    snprintf(out, n, "%016llx%016llx", (unsigned long long)mix64(base),
             (unsigned long long)mix64(base ^ mix64(c + 1)));
}

request *request_create(const gen_request *gen, const char *rid, int top_logprobs_num) {
    request *r = xcalloc(1, sizeof *r);
    r->gen = *gen;
    int n_prompt = gen->n_prompt > 0 ? gen->n_prompt : 0;
    int n_stop = gen->n_stop_token_ids > 0 && gen->stop_token_ids ? gen->n_stop_token_ids : 0;
    r->prompt = xmalloc(((size_t)n_prompt + 1) * sizeof(int32_t));
    if (n_prompt) memcpy(r->prompt, gen->prompt, (size_t)n_prompt * sizeof(int32_t));
    r->stop_ids = xmalloc(((size_t)n_stop + 1) * sizeof(int32_t));
    if (n_stop) memcpy(r->stop_ids, gen->stop_token_ids, (size_t)n_stop * sizeof(int32_t));
    r->gen.prompt = r->prompt;
    r->gen.stop_token_ids = r->stop_ids;
    const int n_bias = gen->sampling.n_logit_bias > 0 ? gen->sampling.n_logit_bias : 0;
    r->logit_bias = xmalloc(((size_t)n_bias + 1) * sizeof(sampler_bias));
    if (n_bias)
        memcpy(r->logit_bias, gen->sampling.logit_bias, (size_t)n_bias * sizeof(sampler_bias));
    r->gen.sampling.logit_bias = n_bias ? r->logit_bias : NULL;
    r->gen.sampling.n_logit_bias = n_bias;
    r->gen.n_stop_token_ids = gen->n_stop_token_ids > 0 ? n_stop : gen->n_stop_token_ids;
    r->top_logprobs_num = top_logprobs_num;
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->cv, NULL);
    atomic_init(&r->abort, false);
    atomic_init(&r->abort_api, false);
    atomic_init(&r->refs, 1);
    if (rid && *rid)
        snprintf(r->rid, sizeof r->rid, "%s", rid);
    else
        request_make_id(r->rid, sizeof r->rid);

    /* Output arrays, sized once. A request with absurd sizes (which scheduler_check rejects)
     * gets none rather than a huge allocation, so creating one is always safe. */
    int max_new = gen->max_new_tokens > 0 ? gen->max_new_tokens : 0;
    int start = gen->logprob_start_len;
    bool want_in = gen->return_logprob && start >= 0 && start < n_prompt;
    size_t n_out = (size_t)max_new + 1, n_in = want_in ? (size_t)(n_prompt - start) : 0;
    size_t N = top_logprobs_num > 0 ? (size_t)top_logprobs_num : 0;
    if ((size_t)n_prompt + n_out > REQUEST_MAX_TOKENS) return r;
    if (N * (n_out + n_in) > REQUEST_MAX_TOP_ENTRIES) N = 0;
    r->out_ids = xmalloc(n_out * sizeof(int32_t));
    if (gen->return_logprob) r->out_logprobs = xmalloc(n_out * sizeof(float));
    if (N) {
        r->out_top_ids = xmalloc(n_out * N * sizeof(int32_t));
        r->out_top_logprobs = xmalloc(n_out * N * sizeof(float));
    }
    if (want_in) {
        r->in_logprobs = xmalloc(n_in * sizeof(float));
        if (start == 0) r->in_logprobs[0] = NAN;
        if (N) {
            r->in_top_ids = xmalloc(n_in * N * sizeof(int32_t));
            r->in_top_logprobs = xmalloc(n_in * N * sizeof(float));
            if (start == 0)
                for (size_t k = 0; k < N; k++)
                    r->in_top_ids[k] = -1, r->in_top_logprobs[k] = NAN;
        }
    }
    return r;
}

void request_retain(request *r) { atomic_fetch_add(&r->refs, 1); }

void request_release(request *r) {
    if (!r) return;
    int before = atomic_fetch_sub(&r->refs, 1);
    MS_ASSERT(before > 0);
    if (before != 1) return;
    pthread_mutex_destroy(&r->mu);
    pthread_cond_destroy(&r->cv);
    free(r->prompt);
    free(r->stop_ids);
    free(r->logit_bias);
    free(r->out_ids);
    free(r->out_logprobs);
    free(r->out_top_ids);
    free(r->out_top_logprobs);
    free(r->in_logprobs);
    free(r->in_top_ids);
    free(r->in_top_logprobs);
    free(r);
}

int request_wait(request *r, int seen) {
    pthread_mutex_lock(&r->mu);
    while (!r->done && r->n_out <= seen)
        pthread_cond_wait(&r->cv, &r->mu);
    int n = r->n_out;
    pthread_mutex_unlock(&r->mu);
    return n;
}

void request_abort(request *r) {
    atomic_store(&r->abort, true);
    /* Lock order: request mu, then the scheduler's. The engine thread never takes them the
     * other way round, and while done is false the scheduler still holds the request, so it is
     * alive. */
    pthread_mutex_lock(&r->mu);
    if (!r->done && r->sched) scheduler_wake(r->sched);
    pthread_mutex_unlock(&r->mu);
}

void request_progress(request *r, int *n_out, int *n_in, bool *done) {
    pthread_mutex_lock(&r->mu);
    if (n_out) *n_out = r->n_out;
    if (n_in) *n_in = r->n_in;
    if (done) *done = r->done;
    pthread_mutex_unlock(&r->mu);
}
