/* Tests of the scheduler (runner/scheduler.c) and the request channel (runner/request.c) on
 * the committed tiny checkpoint, driven step by step from the test thread (and once from a
 * scheduler_run thread with waiting client threads).
 *
 * The reference for every request is engine_generate running it alone: a request's output ids
 * and its input and output logprobs must be bit-identical to that whatever else shares its steps
 * (16 requests at once), whether its prefix came from the prefix cache, whether it was preempted
 * and recomputed, and whatever the chunked-prefill budget. The page accounting is checked after
 * every step (scheduler_validate). Run from the repository root. */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "runner/scheduler.h"
#include "tests/check.h"

#define MODEL_DIR "tests/data/tiny-qwen3-moe"
#define MAX_STEPS 20000

static model *mdl;
static engine ref_engine; /* engine_generate, one request at a time */
static int V;

static uint64_t rng_state = 12345;
static int32_t rand_id(void) {
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    return (int32_t)((rng_state >> 33) % (uint64_t)(V - 3)); /* clear of the eos ids */
}

static int32_t *rand_prompt(int n) {
    int32_t *p = malloc((size_t)n * sizeof(int32_t));
    for (int i = 0; i < n; i++)
        p[i] = rand_id();
    return p;
}

static gen_request greedy(const int32_t *prompt, int n, int max_new, int start) {
    gen_request g = {.prompt = prompt,
                     .n_prompt = n,
                     .sampling = sampling_params_default(),
                     .max_new_tokens = max_new,
                     .ignore_eos = true,
                     .return_logprob = true,
                     .logprob_start_len = start};
    g.sampling.temperature = 0.0f;
    return g;
}

static scheduler_config config(int max_running, int max_total, int page, int chunk, int ctx,
                               bool radix) {
    return (scheduler_config){.max_running_requests = max_running,
                              .max_total_tokens = max_total,
                              .page_size = page,
                              .chunked_prefill_size = chunk,
                              .context_length = ctx,
                              .enable_radix_cache = radix};
}

static scheduler *make_scheduler(scheduler_config c) {
    char err[256];
    scheduler *s = scheduler_create(mdl, &c, err, sizeof err);
    CHECK(s != NULL, "scheduler_create: %s", err);
    return s;
}

static bool all_done(request **rs, int n) {
    for (int i = 0; i < n; i++) {
        bool done;
        request_progress(rs[i], NULL, NULL, &done);
        if (!done) return false;
    }
    return true;
}

/* Step until every request is done; the accounting is checked after each step. */
static int run_until_done(scheduler *s, request **rs, int n) {
    int steps = 0;
    char err[256];
    bool valid = true;
    while (!all_done(rs, n) && steps < MAX_STEPS) {
        scheduler_step(s);
        steps++;
        if (valid && scheduler_validate(s, err, sizeof err)) {
            CHECK(false, "step %d: %s", steps, err);
            valid = false;
        }
    }
    CHECK(steps < MAX_STEPS, "requests did not finish in %d steps", MAX_STEPS);
    return steps;
}

static bool bits_equal(const float *a, const float *b, int n) {
    return n == 0 || (a && b && !memcmp(a, b, (size_t)n * sizeof(float)));
}

/* r's results against engine_generate's for the same request: bit for bit. */
static void check_same(const request *r, const gen_result *g, const char *what) {
    const gen_request *q = &r->gen;
    CHECK(r->done, "%s: not done", what);
    CHECK(r->finish == g->finish, "%s: finish %d vs %d", what, r->finish, g->finish);
    CHECK(r->n_out == g->n_output, "%s: %d vs %d outputs", what, r->n_out, g->n_output);
    int n = r->n_out < g->n_output ? r->n_out : g->n_output;
    int first = -1;
    for (int i = 0; i < n && first < 0; i++)
        if (r->out_ids[i] != g->output_ids[i]) first = i;
    CHECK(first < 0, "%s: output %d: %d vs %d", what, first, first < 0 ? 0 : r->out_ids[first],
          first < 0 ? 0 : g->output_ids[first]);
    if (q->return_logprob) {
        CHECK(bits_equal(r->out_logprobs, g->output_logprobs, n), "%s: output logprobs differ",
              what);
        CHECK(r->n_in == g->n_input_logprobs, "%s: %d vs %d input logprobs", what, r->n_in,
              g->n_input_logprobs);
        int k = r->n_in < g->n_input_logprobs ? r->n_in : g->n_input_logprobs;
        CHECK(bits_equal(r->in_logprobs, g->input_logprobs, k), "%s: input logprobs differ", what);
    }
    if (g->finish == FINISH_STOP_TOKEN)
        CHECK(r->matched_token == g->matched_token, "%s: matched %d vs %d", what, r->matched_token,
              g->matched_token);
}

static gen_result reference(const gen_request *q) {
    gen_result g = {0};
    char err[256];
    int rc = engine_generate(&ref_engine, q, &g, 1, err, sizeof err);
    CHECK(rc == 0, "engine_generate: %s", err);
    return g;
}

/* (1) one request alone vs beside 15 others, and the same against engine_generate. */
static void test_batch_invariance(void) {
    int32_t *prompts[16];
    request *rs[16];
    gen_request gs[16];
    for (int i = 0; i < 16; i++) {
        int n = 5 + 7 * i % 53;
        prompts[i] = rand_prompt(n);
        gs[i] = greedy(prompts[i], n, 4 + (i * 5) % 17, i % 3 == 0 ? 0 : (i % 3 == 1 ? -1 : 2));
        if (i % 4 == 3) { /* some sampled, with penalties */
            gs[i].sampling.temperature = 0.9f;
            gs[i].sampling.top_p = 0.95f;
            gs[i].sampling.repetition_penalty = 1.1f;
            gs[i].sampling.seed = 100 + i;
        }
    }
    scheduler *s = make_scheduler(config(32, 4096, 16, 64, 512, false));
    request *alone = request_create(&gs[0], "alone", 0);
    scheduler_submit(s, alone);
    run_until_done(s, &alone, 1);
    for (int i = 0; i < 16; i++) {
        rs[i] = request_create(&gs[i], NULL, 0);
        scheduler_submit(s, rs[i]);
    }
    run_until_done(s, rs, 16);
    scheduler_stats st;
    scheduler_get_stats(s, &st); /* now: the throughput covers the last few seconds */
    gen_result g0 = reference(&gs[0]);
    check_same(alone, &g0, "alone vs engine_generate");
    check_same(rs[0], &g0, "in a batch of 16 vs engine_generate");
    CHECK(rs[0]->n_in == gs[0].n_prompt && isnan(rs[0]->in_logprobs[0]), "input logprobs %d",
          rs[0]->n_in);
    for (int i = 1; i < 16; i++) {
        gen_result g = reference(&gs[i]);
        char what[64];
        snprintf(what, sizeof what, "batch member %d", i);
        check_same(rs[i], &g, what);
        gen_result_free(&g);
    }
    CHECK(strcmp(alone->rid, "alone") == 0, "rid kept");
    CHECK(strlen(rs[1]->rid) == 32 && strcmp(rs[1]->rid, rs[2]->rid), "generated rids");
    CHECK(st.n_requests_done == 17, "%lld done", (long long)st.n_requests_done);
    CHECK(st.kv_pages_used == 0, "%d pages still used", st.kv_pages_used);
    CHECK(st.n_steps > 0 && st.step_forward_seconds > 0 && st.step_sample_seconds > 0 &&
              st.step_sched_seconds >= st.step_sample_seconds,
          "step stats");
    CHECK(st.last_gen_throughput > 0, "throughput %g", st.last_gen_throughput);
    gen_result_free(&g0);
    request_release(alone);
    for (int i = 0; i < 16; i++) {
        request_release(rs[i]);
        free(prompts[i]);
    }
    scheduler_free(s);
}

/* (2) the same prompt twice: the second takes its prefix from the cache, same bits. */
static void test_prefix_cache(void) {
    int n = 45;
    int32_t *p = rand_prompt(n);
    int32_t *p2 = malloc((size_t)(n + 3) * sizeof(int32_t)); /* same prefix, longer */
    memcpy(p2, p, (size_t)n * sizeof(int32_t));
    p2[n] = 7, p2[n + 1] = 8, p2[n + 2] = 9;
    gen_request gs[4] = {greedy(p, n, 12, 38), greedy(p, n, 12, 20), greedy(p, n, 12, -1),
                         greedy(p2, n + 3, 12, 0)};
    scheduler *s = make_scheduler(config(8, 2048, 16, 512, 512, true));
    request *rs[4];
    for (int i = 0; i < 4; i++) {
        rs[i] = request_create(&gs[i], NULL, 0);
        scheduler_submit(s, rs[i]);
        run_until_done(s, &rs[i], 1);
        gen_result g = reference(&gs[i]);
        char what[64];
        snprintf(what, sizeof what, "prefix cache request %d", i);
        check_same(rs[i], &g, what);
        gen_result_free(&g);
    }
    CHECK(rs[0]->cached_tokens == 0, "first: %d cached", rs[0]->cached_tokens);
    /* start 20: positions >= 19 are computed (row 19 scores position 20), so one whole page
     * (16 tokens) comes cached */
    CHECK(rs[1]->cached_tokens == 16, "second: %d cached", rs[1]->cached_tokens);
    /* no input logprobs: everything but the last token may come cached (prompt + outputs of the
     * earlier ones were inserted): 44 -> 2 pages */
    CHECK(rs[2]->cached_tokens == 32, "third: %d cached", rs[2]->cached_tokens);
    /* start 0 needs every row: nothing cached */
    CHECK(rs[3]->cached_tokens == 0, "fourth: %d cached", rs[3]->cached_tokens);
    scheduler_stats st;
    scheduler_get_stats(s, &st);
    CHECK(st.n_cached_tokens == 48, "stats cached %lld", (long long)st.n_cached_tokens);

    /* a request whose prompt is an earlier prompt + output: its prefix comes from the cache */
    int n4 = n + 12;
    int32_t *p4 = malloc((size_t)n4 * sizeof(int32_t));
    memcpy(p4, p, (size_t)n * sizeof(int32_t));
    memcpy(p4 + n, rs[2]->out_ids, 12 * sizeof(int32_t));
    gen_request g4 = greedy(p4, n4, 5, -1);
    request *r4 = request_create(&g4, NULL, 0);
    scheduler_submit(s, r4);
    run_until_done(s, &r4, 1);
    CHECK(r4->cached_tokens == 48, "prompt + output cached: %d", r4->cached_tokens);
    gen_result g = reference(&g4);
    check_same(r4, &g, "prompt + output from the cache");
    gen_result_free(&g);

    /* (8) flush: the cache lets its pages go; the next request finds nothing */
    scheduler_get_stats(s, &st);
    CHECK(st.kv_pages_used > 0, "cached pages count as used: %d", st.kv_pages_used);
    scheduler_flush_cache(s);
    CHECK(scheduler_step(s) == 0, "a step with nothing to do forwards nothing");
    scheduler_get_stats(s, &st);
    CHECK(st.kv_pages_used == 0, "after flush %d pages used", st.kv_pages_used);
    request *r5 = request_create(&gs[2], NULL, 0);
    scheduler_submit(s, r5);
    run_until_done(s, &r5, 1);
    CHECK(r5->cached_tokens == 0, "after flush: %d cached", r5->cached_tokens);

    /* flush while a request holds cached pages: they stay valid until it finishes */
    request *r6 = request_create(&gs[2], NULL, 0);
    scheduler_submit(s, r6);
    scheduler_step(s);
    CHECK(r6->cached_tokens == 32, "r6 cached %d", r6->cached_tokens);
    scheduler_flush_cache(s);
    run_until_done(s, &r6, 1);
    g = reference(&gs[2]);
    check_same(r6, &g, "flushed under a running request");
    gen_result_free(&g);
    for (int i = 0; i < 4; i++)
        request_release(rs[i]);
    request_release(r4);
    request_release(r5);
    request_release(r6);
    scheduler_free(s);
    free(p);
    free(p2);
    free(p4);
}

/* (7b) requests submitted together that share a prompt (n samples) or a long prefix compute it
 * once: the first runs its prefill, the others wait in their places and then take its pages from
 * the prefix cache; a request that shares nothing, or less than half its prompt, is admitted
 * meanwhile. Results equal the reference. Prompts of 70 tokens in chunks of 32 (a prefill of three
 * steps), pages of 16. */
static void test_shared_prefill(void) {
    enum { N = 6, L = 70 };
    int32_t *p = rand_prompt(L), *q = rand_prompt(L), *other = rand_prompt(20);
    int32_t *head = rand_prompt(L);
    memcpy(q, p, 50 * sizeof(int32_t));    /* shares 50 tokens: 3 whole pages of 69 */
    memcpy(head, p, 20 * sizeof(int32_t)); /* shares 20: one page, under half: does not wait */
    gen_request gs[N] = {greedy(p, L, 6, -1), greedy(p, L, 6, -1), greedy(other, 20, 6, -1),
                         greedy(p, L, 6, -1), greedy(q, L, 6, -1), greedy(head, L, 6, -1)};
    scheduler *s = make_scheduler(config(8, 2048, 16, 32, 512, true));
    request *rs[N];
    for (int i = 0; i < N; i++) {
        rs[i] = request_create(&gs[i], NULL, 0);
        scheduler_submit(s, rs[i]);
    }
    scheduler_step(s);
    scheduler_stats st;
    scheduler_get_stats(s, &st);
    CHECK(st.n_running == 3 && st.n_waiting == 3,
          "first step: the leader, the unrelated request and the one sharing one page run, the "
          "sharers wait (%d running, %d waiting)",
          st.n_running, st.n_waiting);
    run_until_done(s, rs, N);
    CHECK(rs[0]->cached_tokens == 0 && rs[2]->cached_tokens == 0, "leader %d, other %d cached",
          rs[0]->cached_tokens, rs[2]->cached_tokens);
    CHECK(rs[1]->cached_tokens == 64 && rs[3]->cached_tokens == 64,
          "the same prompt: 64 of 70 tokens cached (%d, %d)", rs[1]->cached_tokens,
          rs[3]->cached_tokens);
    CHECK(rs[4]->cached_tokens == 48, "50 shared tokens: 48 cached (%d)", rs[4]->cached_tokens);
    CHECK(rs[5]->cached_tokens == 0, "20 shared tokens, run at once: %d cached",
          rs[5]->cached_tokens);
    for (int i = 0; i < N; i++) {
        gen_result g = reference(&gs[i]);
        char what[64];
        snprintf(what, sizeof what, "shared prefill, request %d", i);
        check_same(rs[i], &g, what);
        gen_result_free(&g);
        request_release(rs[i]);
    }
    /* the prefix cache off: nobody waits */
    scheduler *s2 = make_scheduler(config(8, 2048, 16, 32, 512, false));
    for (int i = 0; i < N; i++) {
        rs[i] = request_create(&gs[i], NULL, 0);
        scheduler_submit(s2, rs[i]);
    }
    scheduler_step(s2);
    scheduler_get_stats(s2, &st);
    CHECK(st.n_running == N && st.n_waiting == 0, "no prefix cache: all %d run (%d waiting)",
          st.n_running, st.n_waiting);
    run_until_done(s2, rs, N);
    for (int i = 0; i < N; i++)
        request_release(rs[i]);
    scheduler_free(s2);
    scheduler_free(s);
    free(p);
    free(q);
    free(other);
    free(head);
}

/* (3) a KV cache of 16 pages of 4 tokens for 6 requests that need up to 11 pages each. */
static void test_preemption(bool radix) {
    enum { N = 6 };
    int32_t *prompts[N];
    gen_request gs[N];
    request *rs[N];
    for (int i = 0; i < N; i++) {
        int n = 8 + 3 * i;
        prompts[i] = rand_prompt(n);
        gs[i] = greedy(prompts[i], n, 30, i % 2 ? 0 : -1);
        if (i % 3 == 2) {
            gs[i].sampling.temperature = 1.0f;
            gs[i].sampling.frequency_penalty = 0.5f;
            gs[i].sampling.seed = 7 * i;
        }
    }
    /* two requests share a prompt so the cache has something to give */
    if (radix) gs[1] = greedy(prompts[0], gs[0].n_prompt, 30, -1);
    scheduler *s = make_scheduler(config(N, 64, 4, 16, 64, radix));
    for (int i = 0; i < N; i++) {
        rs[i] = request_create(&gs[i], NULL, 0);
        scheduler_submit(s, rs[i]);
    }
    run_until_done(s, rs, N);
    scheduler_stats st;
    scheduler_get_stats(s, &st);
    CHECK(st.n_preemptions > 0, "no preemption happened");
    for (int i = 0; i < N; i++) {
        gen_result g = reference(&gs[i]);
        char what[64];
        snprintf(what, sizeof what, "preempted set%s, request %d", radix ? " (radix)" : "", i);
        check_same(rs[i], &g, what);
        gen_result_free(&g);
        request_release(rs[i]);
    }
    for (int i = 0; i < N; i++)
        free(prompts[i]);
    scheduler_free(s);
}

/* (4) abort mid-decode gives every page back; (also: an aborted queued request). */
static void test_abort(void) {
    scheduler *s = make_scheduler(config(1, 512, 16, 64, 512, false));
    int32_t *p = rand_prompt(20);
    gen_request g = greedy(p, 20, 200, -1);
    request *r = request_create(&g, NULL, 0), *queued = request_create(&g, NULL, 0);
    scheduler_submit(s, r);
    scheduler_submit(s, queued);
    for (int i = 0; i < 1000 && r->n_out < 5; i++)
        scheduler_step(s);
    scheduler_stats st;
    scheduler_get_stats(s, &st);
    CHECK(st.kv_pages_used == 2 && st.n_running == 1 && st.n_waiting == 1,
          "mid-decode: %d pages, %d running, %d waiting", st.kv_pages_used, st.n_running,
          st.n_waiting);
    request_abort(r);
    request_abort(queued);
    request_abort(r); /* idempotent */
    scheduler_step(s);
    CHECK(r->done && r->finish == FINISH_ABORT, "aborted: done %d finish %d", r->done, r->finish);
    CHECK(strcmp(r->error, "aborted by client") == 0, "error '%s'", r->error);
    CHECK(r->n_out >= 5 && r->n_out < 200, "outputs kept: %d", r->n_out);
    CHECK(queued->done && queued->finish == FINISH_ABORT && queued->n_out == 0, "queued aborted");
    scheduler_get_stats(s, &st);
    CHECK(st.kv_pages_used == 0 && st.n_running == 0 && st.n_waiting == 0,
          "after abort: %d pages, %d running, %d waiting", st.kv_pages_used, st.n_running,
          st.n_waiting);
    request_abort(r); /* after done: only the flag */
    request_release(r);
    request_release(queued);
    free(p);
    scheduler_free(s);
}

/* (4b) scheduler_abort: by rid (a running and a queued request), by the client's rid of n
 * samples, nothing for an unknown or empty rid, then every request; the others run on. */
static void test_abort_by_rid(void) {
    scheduler *s = make_scheduler(config(2, 1024, 16, 64, 512, false));
    int32_t *p = rand_prompt(12);
    gen_request g = greedy(p, 12, 200, -1);
    request *run = request_create(&g, "run-1", 0), *other = request_create(&g, "other", 0);
    request *queued = request_create(&g, "wait-1", 0);
    request *s0 = request_create(&g, "job-0", 0), *s1 = request_create(&g, "job-1", 0);
    snprintf(s0->client_rid, sizeof s0->client_rid, "job");
    snprintf(s1->client_rid, sizeof s1->client_rid, "job");
    request *all[] = {run, other, queued, s0, s1};
    for (int i = 0; i < 5; i++)
        scheduler_submit(s, all[i]);
    for (int i = 0; i < 1000 && other->n_out < 3; i++)
        scheduler_step(s);
    scheduler_abort(s, "nobody", false);
    scheduler_abort(s, "", false);
    scheduler_step(s);
    CHECK(!run->done && !other->done && !queued->done, "an unknown or empty rid aborted something");
    scheduler_abort(s, "run-1", false);
    scheduler_abort(s, "wait-1", false);
    scheduler_step(s);
    CHECK(run->done && run->finish == FINISH_ABORT && run->n_out >= 3 && run->n_out < 200,
          "running by rid: done %d finish %d n_out %d", run->done, run->finish, run->n_out);
    CHECK(strcmp(run->error, "aborted by /abort_request") == 0, "error '%s'", run->error);
    CHECK(queued->done && queued->finish == FINISH_ABORT && queued->n_out == 0,
          "queued by rid: done %d n_out %d", queued->done, queued->n_out);
    CHECK(!other->done && !s0->done && !s1->done, "others stopped with them");
    for (int i = 0; i < 1000 && s0->n_out < 2; i++)
        scheduler_step(s);
    scheduler_abort(s, "job", false);
    scheduler_step(s);
    CHECK(s0->done && s1->done && s0->finish == FINISH_ABORT && s1->finish == FINISH_ABORT,
          "samples by the client's rid: %d %d", s0->done, s1->done);
    CHECK(!other->done, "other stopped with the samples");
    request *late = request_create(&g, NULL, 0);
    scheduler_submit(s, late);
    scheduler_abort(s, NULL, true);
    scheduler_step(s);
    CHECK(other->done && other->finish == FINISH_ABORT && late->done &&
              late->finish == FINISH_ABORT,
          "abort_all: other %d, late %d", other->done, late->done);
    scheduler_stats st;
    scheduler_get_stats(s, &st);
    CHECK(st.kv_pages_used == 0 && st.n_running == 0 && st.n_waiting == 0,
          "after the aborts: %d pages, %d running, %d waiting", st.kv_pages_used, st.n_running,
          st.n_waiting);
    /* a new request runs to its end */
    request *after = request_create(&g, "run-1", 0);
    scheduler_submit(s, after);
    run_until_done(s, &after, 1);
    CHECK(after->finish == FINISH_LENGTH && after->n_out == 200, "after: finish %d n_out %d",
          after->finish, after->n_out);
    for (int i = 0; i < 5; i++)
        request_release(all[i]);
    request_release(late);
    request_release(after);
    free(p);
    scheduler_free(s);
}

/* (5) the running cap. */
static void test_running_cap(void) {
    scheduler *s = make_scheduler(config(2, 1024, 16, 64, 512, false));
    request *rs[5];
    int32_t *p = rand_prompt(10);
    for (int i = 0; i < 5; i++) {
        gen_request g = greedy(p, 10 - i, 6, -1);
        rs[i] = request_create(&g, NULL, 0);
        scheduler_submit(s, rs[i]);
    }
    int max_running = 0, steps = 0;
    while (!all_done(rs, 5) && steps++ < MAX_STEPS) {
        scheduler_step(s);
        scheduler_stats st;
        scheduler_get_stats(s, &st);
        if (st.n_running > max_running) max_running = st.n_running;
    }
    CHECK(max_running == 2, "at most 2 running: saw %d", max_running);
    /* first come, first served: finish times in submit order (same lengths, cap 2) */
    CHECK(rs[0]->t_done <= rs[2]->t_done && rs[1]->t_done <= rs[3]->t_done &&
              rs[2]->t_done <= rs[4]->t_done,
          "FCFS order");
    for (int i = 0; i < 5; i++)
        request_release(rs[i]);
    free(p);
    scheduler_free(s);
}

/* (6) a small chunked-prefill budget gives the same bits as one big chunk. */
static void test_chunked_prefill(void) {
    int32_t *p = rand_prompt(70), *p2 = rand_prompt(33);
    gen_request g = greedy(p, 70, 8, 0), g2 = greedy(p2, 33, 8, 3);
    request *big[2], *small[2];
    scheduler *s = make_scheduler(config(4, 1024, 16, 512, 512, false));
    big[0] = request_create(&g, NULL, 0);
    big[1] = request_create(&g2, NULL, 0);
    scheduler_submit(s, big[0]);
    scheduler_submit(s, big[1]);
    int steps_big = run_until_done(s, big, 2);
    scheduler_free(s);
    s = make_scheduler(config(4, 1024, 16, 7, 512, false));
    small[0] = request_create(&g, NULL, 0);
    small[1] = request_create(&g2, NULL, 0);
    scheduler_submit(s, small[0]);
    scheduler_submit(s, small[1]);
    int steps_small = run_until_done(s, small, 2);
    CHECK(steps_small > steps_big + 10, "chunks of 7: %d steps vs %d", steps_small, steps_big);
    for (int i = 0; i < 2; i++) {
        gen_result ref = reference(i ? &g2 : &g);
        check_same(big[i], &ref, "one chunk");
        check_same(small[i], &ref, "chunks of 7");
        gen_result_free(&ref);
        request_release(big[i]);
        request_release(small[i]);
    }
    scheduler_free(s);
    free(p);
    free(p2);
}

/* (7) every bad field is rejected with a message; a bad request submitted anyway is finished
 * at once; bad configurations are refused. */
static void test_check(void) {
    scheduler *s = make_scheduler(config(4, 256, 16, 64, 128, false));
    int32_t ok_ids[4] = {1, 2, 3, 4}, bad_id[2] = {1, 0}, neg_id[2] = {1, -1};
    bad_id[1] = V;
    struct {
        const char *what, *needle;
        gen_request g;
        int top;
    } cases[20];
    int n = 0;
    gen_request base = greedy(ok_ids, 4, 4, -1);
#define CASE(name, word, field_set, top_n)                                                         \
    do {                                                                                           \
        gen_request g_ = base;                                                                     \
        field_set;                                                                                 \
        cases[n].what = (name), cases[n].needle = (word), cases[n].g = g_, cases[n].top = top_n;   \
        n++;                                                                                       \
    } while (0)
    CASE("empty prompt", "empty", g_.n_prompt = 0, 0);
    CASE("id >= V", "vocabulary", (g_.prompt = bad_id, g_.n_prompt = 2), 0);
    CASE("id < 0", "vocabulary", (g_.prompt = neg_id, g_.n_prompt = 2), 0);
    CASE("max_new_tokens < 0", "max_new_tokens", g_.max_new_tokens = -1, 0);
    CASE("min_new_tokens < 0", "min_new_tokens", g_.min_new_tokens = -2, 0);
    CASE("over the context", "context length", g_.max_new_tokens = 125, 0);
    CASE("logprob_start_len >= n", "logprob_start_len", g_.logprob_start_len = 4, 0);
    CASE("logprob_start_len < -1", "logprob_start_len", g_.logprob_start_len = -2, 0);
    CASE("temperature < 0", "temperature", g_.sampling.temperature = -1.0f, 0);
    CASE("top_p 0", "top_p", g_.sampling.top_p = 0.0f, 0);
    CASE("top_p > 1", "top_p", g_.sampling.top_p = 1.5f, 0);
    CASE("top_k 0", "top_k", g_.sampling.top_k = 0, 0);
    CASE("min_p > 1", "min_p", g_.sampling.min_p = 2.0f, 0);
    CASE("repetition_penalty 0", "repetition_penalty", g_.sampling.repetition_penalty = 0.0f, 0);
    CASE("frequency_penalty 3", "frequency_penalty", g_.sampling.frequency_penalty = 3.0f, 0);
    CASE("presence_penalty -3", "presence_penalty", g_.sampling.presence_penalty = -3.0f, 0);
    CASE("top_logprobs_num < 0", "top_logprobs_num", (void)0, -1);
    CASE("top_logprobs_num > V", "top_logprobs_num", (void)0, V + 1);
    CASE("huge max_new_tokens", "context length", g_.max_new_tokens = 1 << 30, 0);
#undef CASE
    char err[256];
    request *good = request_create(&base, NULL, 3);
    CHECK(scheduler_check(s, good, err, sizeof err) == 0, "a good request passes: %s", err);
    request_release(good);
    for (int i = 0; i < n; i++) {
        request *r = request_create(&cases[i].g, NULL, cases[i].top);
        err[0] = '\0';
        int rc = scheduler_check(s, r, err, sizeof err);
        CHECK(rc == -1, "%s: accepted", cases[i].what);
        CHECK(strstr(err, cases[i].needle) != NULL, "%s: message '%s' lacks '%s'", cases[i].what,
              err, cases[i].needle);
        scheduler_submit(s, r); /* finished at once, never queued */
        CHECK(r->done && r->finish == FINISH_ABORT && !strcmp(r->error, err),
              "%s: submitted anyway: done %d finish %d error '%s'", cases[i].what, r->done,
              r->finish, r->error);
        request_release(r);
    }
    scheduler_stats st;
    scheduler_get_stats(s, &st);
    CHECK(st.n_waiting == 0 && scheduler_step(s) == 0, "nothing was queued");
    scheduler_free(s);

    struct {
        const char *what, *needle;
        scheduler_config c;
    } bad[] = {
        {"max_total_tokens < context", "max_total_tokens", config(4, 100, 16, 64, 128, false)},
        {"context over the model", "context_length", config(4, 4096, 16, 64, 4096, false)},
        {"max_running 0", "max_running_requests", config(0, 512, 16, 64, 128, false)},
        {"page_size 0", "page_size", config(4, 512, 0, 64, 128, false)},
        {"chunk 0", "chunked_prefill_size", config(4, 512, 16, 0, 128, false)},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        err[0] = '\0';
        scheduler *b = scheduler_create(mdl, &bad[i].c, err, sizeof err);
        CHECK(b == NULL, "%s: accepted", bad[i].what);
        CHECK(strstr(err, bad[i].needle) != NULL, "%s: message '%s'", bad[i].what, err);
        scheduler_free(b);
    }
    scheduler_config dflt = config(4, 512, 16, 64, 0, false);
    scheduler *d = scheduler_create(mdl, &dflt, err, sizeof err);
    CHECK(d != NULL, "context_length 0 means the model's: %s", err);
    scheduler_free(d);
}

/* (9) max_new_tokens 0: the prompt is scored, nothing generated. */
static void test_prefill_only(void) {
    scheduler *s = make_scheduler(config(4, 512, 16, 64, 512, true));
    int32_t *p = rand_prompt(25);
    gen_request g = greedy(p, 25, 0, 0);
    request *r = request_create(&g, NULL, 0);
    scheduler_submit(s, r);
    run_until_done(s, &r, 1);
    CHECK(r->n_out == 0 && r->finish == FINISH_LENGTH, "n_out %d finish %d", r->n_out, r->finish);
    CHECK(r->t_first_token == 0.0, "no first token");
    gen_result ref = reference(&g);
    check_same(r, &ref, "max_new_tokens 0");
    gen_result_free(&ref);
    request_release(r);
    free(p);
    scheduler_free(s);
}

/* (10) top-N logprobs: descending, the greedy token first with its logprob. */
static void test_top_logprobs(void) {
    scheduler *s = make_scheduler(config(4, 512, 16, 64, 512, false));
    int32_t *p = rand_prompt(12);
    enum { N = 5 };
    gen_request g = greedy(p, 12, 10, 0);
    request *r = request_create(&g, NULL, N);
    scheduler_submit(s, r);
    run_until_done(s, &r, 1);
    CHECK(r->n_out == 10, "n_out %d", r->n_out);
    for (int i = 0; i < r->n_out; i++) {
        const int32_t *ids = r->out_top_ids + i * N;
        const float *lp = r->out_top_logprobs + i * N;
        CHECK(ids[0] == r->out_ids[i], "output %d: top-1 %d vs sampled %d", i, ids[0],
              r->out_ids[i]);
        CHECK(lp[0] == r->out_logprobs[i], "output %d: top-1 logprob", i);
        for (int k = 1; k < N; k++)
            CHECK(lp[k] < lp[k - 1] || (lp[k] == lp[k - 1] && ids[k] > ids[k - 1]),
                  "output %d: order at %d", i, k);
    }
    CHECK(r->in_top_ids[0] == -1 && isnan(r->in_top_logprobs[0]), "position 0 row empty");
    for (int i = 1; i < r->n_in; i++) {
        const float *lp = r->in_top_logprobs + i * N;
        CHECK(r->in_logprobs[i] <= lp[0], "input %d: below top-1", i);
        for (int k = 1; k < N; k++)
            CHECK(lp[k] <= lp[k - 1], "input %d: order", i);
    }
    gen_result ref = reference(&g);
    check_same(r, &ref, "with top logprobs");
    gen_result_free(&ref);
    request_release(r);
    free(p);
    scheduler_free(s);
}

/* Stop conditions against engine_generate: stop ids after min_new_tokens, eos. */
static void test_stops(void) {
    scheduler *s = make_scheduler(config(4, 512, 16, 64, 512, true));
    int32_t *p = rand_prompt(9);
    gen_request g = greedy(p, 9, 40, -1);
    gen_result free_run = reference(&g);
    CHECK(free_run.n_output == 40, "free run %d", free_run.n_output);
    int32_t stop[2] = {free_run.output_ids[6], free_run.output_ids[3]};
    g.stop_token_ids = stop;
    g.n_stop_token_ids = 2;
    g.min_new_tokens = 5;
    request *r = request_create(&g, NULL, 0);
    g.stop_token_ids = NULL; /* the request holds its own copy */
    scheduler_submit(s, r);
    run_until_done(s, &r, 1);
    g.stop_token_ids = stop;
    gen_result ref = reference(&g);
    check_same(r, &ref, "stop ids");
    CHECK(r->finish == FINISH_STOP_TOKEN && r->n_out <= 7, "stopped: finish %d after %d", r->finish,
          r->n_out);
    gen_result_free(&ref);
    gen_result_free(&free_run);
    request_release(r);
    free(p);
    scheduler_free(s);
}

/* scheduler_run on its own thread, clients waiting from theirs, an abort that wakes it, and
 * shutdown. */
typedef struct {
    scheduler *s;
    gen_request g;
    request *r;
    atomic_int notified;
    int waits;
} client;

static void client_notify(void *ctx) { atomic_fetch_add(&((client *)ctx)->notified, 1); }

static void *client_main(void *arg) {
    client *c = arg;
    c->r = request_create(&c->g, NULL, 0);
    c->r->notify = client_notify;
    c->r->notify_ctx = c;
    scheduler_submit(c->s, c->r);
    int seen = 0;
    for (;;) {
        int n = request_wait(c->r, seen);
        c->waits++;
        bool done;
        request_progress(c->r, &seen, NULL, &done);
        if (done) break;
        (void)n;
    }
    return NULL;
}

static void *engine_main(void *arg) {
    void **a = arg;
    char err[512];
    if (scheduler_run(a[0], NULL, a[1], err, sizeof err)) fprintf(stderr, "scheduler_run: %s\n", err);
    return NULL;
}

static void test_threads(void) {
    enum { N = 8 };
    scheduler *s = make_scheduler(config(4, 512, 16, 32, 512, true));
    atomic_bool stop;
    atomic_init(&stop, false);
    void *args[2] = {s, &stop};
    pthread_t eng, cl[N];
    pthread_create(&eng, NULL, engine_main, args);
    client cs[N];
    int32_t *prompts[N];
    for (int i = 0; i < N; i++) {
        prompts[i] = rand_prompt(10 + 4 * i);
        cs[i] = (client){.s = s, .g = greedy(prompts[i], 10 + 4 * i, 12, i % 2 ? -1 : 1)};
        atomic_init(&cs[i].notified, 0);
        pthread_create(&cl[i], NULL, client_main, &cs[i]);
    }
    for (int i = 0; i < N; i++)
        pthread_join(cl[i], NULL);
    for (int i = 0; i < N; i++) {
        gen_result ref = reference(&cs[i].g);
        check_same(cs[i].r, &ref, "threaded client");
        gen_result_free(&ref);
        CHECK(atomic_load(&cs[i].notified) >= 2, "client %d notified %d times", i,
              atomic_load(&cs[i].notified));
        CHECK(cs[i].r->t_first_token >= cs[i].r->t_submit &&
                  cs[i].r->t_done >= cs[i].r->t_first_token,
              "timestamps");
    }

    /* The engine is idle now; an abort must wake it. */
    int32_t *p = rand_prompt(30);
    gen_request g = greedy(p, 30, 400, -1);
    request *r = request_create(&g, NULL, 0);
    scheduler_submit(s, r);
    request_wait(r, 0);
    request_abort(r);
    bool done = false;
    int seen = 0;
    while (!done) {
        request_wait(r, seen);
        request_progress(r, &seen, NULL, &done);
    }
    pthread_mutex_lock(&r->mu);
    finish_kind fk = r->finish;
    pthread_mutex_unlock(&r->mu);
    CHECK(done && fk == FINISH_ABORT, "abort from another thread: done %d finish %d", done, fk);

    /* Shutdown: a request still running is finished with the shutdown message. */
    request *last = request_create(&g, NULL, 0);
    scheduler_submit(s, last);
    request_wait(last, 0);
    atomic_store(&stop, true);
    scheduler_wake(s);
    pthread_join(eng, NULL);
    CHECK(last->done && last->finish == FINISH_ABORT &&
              !strcmp(last->error, "server shutting down"),
          "shutdown: done %d finish %d '%s'", last->done, last->finish, last->error);
    request *late = request_create(&g, NULL, 0);
    scheduler_submit(s, late);
    CHECK(late->done && !strcmp(late->error, "server shutting down"), "submit after shutdown");
    scheduler_stats st;
    scheduler_get_stats(s, &st);
    CHECK(st.n_running == 0 && st.n_waiting == 0, "drained");
    char err[256];
    CHECK(scheduler_validate(s, err, sizeof err) == 0, "%s", err);
    request_release(r);
    request_release(last);
    request_release(late);
    for (int i = 0; i < N; i++) {
        request_release(cs[i].r);
        free(prompts[i]);
    }
    free(p);
    scheduler_free(s);
}

int main(void) {
    char err[1024];
    log_threshold = LOG_LEVEL_WARN;
    mdl = model_load(MODEL_DIR, ops_cpu(), err, sizeof err);
    if (!mdl) {
        fprintf(stderr, "%s\n", err);
        CHECK(false, "model_load");
        CHECK_SUMMARY();
    }
    V = mdl->cfg.vocab_size;
    if (engine_init(&ref_engine, mdl, 64, 16, 512, 0, err, sizeof err)) {
        CHECK(false, "engine_init: %s", err);
        CHECK_SUMMARY();
    }
    test_batch_invariance();
    test_prefix_cache();
    test_shared_prefill();
    test_preemption(false);
    test_preemption(true);
    test_abort();
    test_abort_by_rid();
    test_running_cap();
    test_chunked_prefill();
    test_check();
    test_prefill_only();
    test_top_logprobs();
    test_stops();
    test_threads();
    engine_free(&ref_engine);
    model_free(mdl);
    sampler_scratch_free();
    CHECK_SUMMARY();
}
