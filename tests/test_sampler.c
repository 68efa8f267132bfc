/* Tests for runner/sampler.c: parameter checks, the generator, greedy and each filter, the
 * penalties, log_softmax, an exact comparison with a slow readable reference sampler, and
 * timing at a Qwen-sized vocabulary (V = 151936).
 *
 * Statistical checks are deterministic (the generator is keyed by seed and position), and each
 * states its tolerance: an empirical frequency f of a token with probability p over N draws
 * must satisfy |f - p| <= 5 * sqrt(p (1 - p) / N), about 0.018 at N = 20000 and p = 0.5. */
#include "common/counter_rng.h"
#include "runner/sampler.h"
#include "tests/check.h"

#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Must equal SAMPLER_TOP_P_SLACK in sampler.c: the reference applies the same nucleus rule. */
#define REF_TOP_P_SLACK 1e-6

/* The per-sample time limit. It is a property of an optimized build; AddressSanitizer
 * instruments every load and store (3 to 5 times slower here), so its builds get 5x. */
#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define TEST_SANITIZED 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__) && !defined(TEST_SANITIZED)
#define TEST_SANITIZED 1
#endif
#ifdef TEST_SANITIZED
#define SAMPLE_LIMIT_MS 50.0
#else
#define SAMPLE_LIMIT_MS 10.0
#endif

static uint64_t rng_state = 0x1234567887654321ull;

static uint64_t rng_next(void) {
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static double rng_uniform(void) { return (double)(rng_next() >> 11) / 9007199254740992.0; }

static double rng_normal(void) {
    double u1 = rng_uniform(), u2 = rng_uniform();
    return sqrt(-2.0 * log(u1 + 1e-300)) * cos(2.0 * M_PI * u2);
}

static double now_ms(clockid_t clock) {
    struct timespec ts;
    clock_gettime(clock, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* Samples once from a private copy of logits, so the caller's row stays intact. */
static int sample_copy(const sampling_params *p, const float *logits, int V, const int32_t *prompt,
                       int n_prompt, const int32_t *output, int n_output, uint64_t position) {
    float *tmp = malloc((size_t)V * sizeof *tmp);
    memcpy(tmp, logits, (size_t)V * sizeof *tmp);
    int t = sampler_sample(p, tmp, V, prompt, n_prompt, output, n_output, position);
    free(tmp);
    return t;
}

/* counts[V] of n_draws draws at positions 0 .. n_draws-1. */
static void draw_counts(const sampling_params *p, const float *logits, int V, int n_draws,
                        int *counts) {
    memset(counts, 0, (size_t)V * sizeof *counts);
    float *tmp = malloc((size_t)V * sizeof *tmp);
    for (int i = 0; i < n_draws; i++) {
        memcpy(tmp, logits, (size_t)V * sizeof *tmp);
        int t = sampler_sample(p, tmp, V, NULL, 0, NULL, 0, (uint64_t)i);
        if (t >= 0 && t < V) counts[t]++;
    }
    free(tmp);
}

/* The 5-sigma frequency check described at the top. */
static void check_freq(int count, int n, double p, const char *what, int id) {
    double f = (double)count / n;
    double tol = 5.0 * sqrt(p * (1.0 - p) / n) + 1e-12;
    CHECK(fabs(f - p) <= tol, "%s: token %d freq %.5f want %.5f (tol %.5f)", what, id, f, p, tol);
}

static void test_params(void) {
    sampling_params d = sampling_params_default();
    CHECK(d.temperature == 1.0f && d.top_p == 1.0f && d.top_k == -1 && d.min_p == 0.0f,
          "defaults: temperature %g top_p %g top_k %d min_p %g", d.temperature, d.top_p, d.top_k,
          d.min_p);
    CHECK(d.repetition_penalty == 1.0f && d.frequency_penalty == 0.0f &&
              d.presence_penalty == 0.0f && d.seed == 0,
          "default penalties / seed");
    CHECK(sampling_params_check(&d) == NULL, "defaults rejected: %s", sampling_params_check(&d));

    /* Boundary values that must pass. */
    sampling_params ok = d;
    ok.temperature = 0.0f;
    ok.top_p = 1.0f;
    ok.top_k = 1;
    ok.min_p = 1.0f;
    ok.repetition_penalty = 2.0f;
    ok.frequency_penalty = -2.0f;
    ok.presence_penalty = 2.0f;
    CHECK(sampling_params_check(&ok) == NULL, "boundaries rejected: %s",
          sampling_params_check(&ok));

    struct {
        const char *field;
        sampling_params p;
    } bad[32];
    int nb = 0;
#define BAD(fld, val)                                                                              \
    do {                                                                                           \
        bad[nb].field = #fld;                                                                      \
        bad[nb].p = d;                                                                             \
        bad[nb].p.fld = (val);                                                                     \
        nb++;                                                                                      \
    } while (0)
    BAD(temperature, -0.1f);
    BAD(temperature, NAN);
    BAD(temperature, INFINITY);
    BAD(top_p, 0.0f);
    BAD(top_p, -0.5f);
    BAD(top_p, 1.01f);
    BAD(top_p, NAN);
    BAD(top_k, 0);
    BAD(top_k, -2);
    BAD(min_p, -0.01f);
    BAD(min_p, 1.5f);
    BAD(min_p, NAN);
    BAD(repetition_penalty, 0.0f);
    BAD(repetition_penalty, -1.0f);
    BAD(repetition_penalty, 2.5f);
    BAD(repetition_penalty, NAN);
    BAD(frequency_penalty, -2.01f);
    BAD(frequency_penalty, 3.0f);
    BAD(frequency_penalty, NAN);
    BAD(presence_penalty, 2.5f);
    BAD(presence_penalty, -3.0f);
    BAD(presence_penalty, NAN);
#undef BAD
    for (int i = 0; i < nb; i++) {
        const char *msg = sampling_params_check(&bad[i].p);
        CHECK(msg != NULL, "bad %s accepted (case %d)", bad[i].field, i);
        if (msg) {
            CHECK(strncmp(msg, bad[i].field, strlen(bad[i].field)) == 0,
                  "message for %s does not name it: %s", bad[i].field, msg);
        }
    }
    sampling_params tp = d;
    tp.top_p = 0.0f;
    const char *msg = sampling_params_check(&tp);
    CHECK(msg && strcmp(msg, "top_p must be in (0, 1], got 0") == 0, "top_p message: %s",
          msg ? msg : "(null)");
}

static void test_uniform(void) {
    const int n = 200000;
    double sum = 0.0;
    int in_range = 1;
    for (int i = 0; i < n; i++) {
        double u = sampler_uniform(7, (uint64_t)i);
        in_range &= u >= 0.0 && u < 1.0;
        sum += u;
    }
    CHECK(in_range, "sampler_uniform left [0, 1)");
    double tol = 5.0 * sqrt(1.0 / 12.0 / n);
    CHECK(fabs(sum / n - 0.5) <= tol, "uniform mean %.5f, tol %.5f", sum / n, tol);
    CHECK(sampler_uniform(1, 5) == sampler_uniform(1, 5), "uniform not a function of its key");
    CHECK(sampler_uniform(1, 5) != sampler_uniform(2, 5), "seed ignored");
    CHECK(sampler_uniform(1, 5) != sampler_uniform(1, 6), "counter ignored");
    /* (seed, counter) and (seed ^ d, counter ^ d) must not collide. */
    CHECK(sampler_uniform(3, 0) != sampler_uniform(0, 3), "seed/counter symmetric");
    /* The bits are pinned: the generator lives in common/counter_rng.h, shared with the CUDA
     * sampling kernels, and a seeded request's output must not change when it moves. */
    CHECK(counter_rng_bits(1, 5) == 0xe17b6d147da182daull, "generator bits moved: %016llx",
          (unsigned long long)counter_rng_bits(1, 5));
    CHECK(sampler_uniform(1, 5) == (double)(0xe17b6d147da182daull >> 11) / 9007199254740992.0,
          "sampler_uniform is not the top 53 bits of counter_rng_bits");
}

static void test_greedy(void) {
    enum { V = 1000 };
    float logits[V];
    for (int i = 0; i < V; i++)
        logits[i] = (float)rng_normal();
    logits[417] = 9.0f;
    logits[800] = 9.0f; /* tie: the lower id wins */
    logits[5] = 8.99f;
    sampling_params p = sampling_params_default();
    p.temperature = 0.0f;
    int all = 1;
    for (uint64_t seed = 0; seed < 20; seed++) {
        p.seed = seed * 0x9e37u;
        for (uint64_t pos = 0; pos < 5; pos++)
            all &= sample_copy(&p, logits, V, NULL, 0, NULL, 0, pos) == 417;
    }
    CHECK(all, "temperature 0: not always the lowest-id argmax 417");
    p.temperature = 0.5f * SAMPLER_GREEDY_EPS;
    CHECK(sample_copy(&p, logits, V, NULL, 0, NULL, 0, 3) == 417, "temperature < eps not greedy");

    /* top_k 1 is greedy at any temperature. */
    sampling_params k1 = sampling_params_default();
    k1.top_k = 1;
    k1.temperature = 1.5f;
    all = 1;
    for (uint64_t pos = 0; pos < 200; pos++)
        all &= sample_copy(&k1, logits, V, NULL, 0, NULL, 0, pos) == 417;
    CHECK(all, "top_k 1 differs from greedy");

    /* Logits with -inf masks and a NaN: greedy ignores both. */
    float masked[4] = {-INFINITY, NAN, 0.5f, 0.25f};
    CHECK(sample_copy(&p, masked, 4, NULL, 0, NULL, 0, 0) == 2, "greedy with -inf / NaN");
    sampling_params t1 = sampling_params_default();
    int drew_bad = 0;
    for (uint64_t pos = 0; pos < 500; pos++) {
        int t = sample_copy(&t1, masked, 4, NULL, 0, NULL, 0, pos);
        drew_bad |= t == 0 || t == 1;
    }
    CHECK(!drew_bad, "sampled a -inf or NaN logit");
}

static void test_seed(void) {
    enum { V = 64 };
    float logits[V];
    for (int i = 0; i < V; i++)
        logits[i] = (float)rng_normal();
    sampling_params p = sampling_params_default();
    p.seed = 12345;
    int same = 1;
    for (uint64_t pos = 0; pos < 100; pos++)
        same &= sample_copy(&p, logits, V, NULL, 0, NULL, 0, pos) ==
                sample_copy(&p, logits, V, NULL, 0, NULL, 0, pos);
    CHECK(same, "same seed and position gave different tokens");

    /* Across seeds at a fixed position the draws follow the distribution: uniform over 4. */
    float flat[4] = {0, 0, 0, 0};
    int counts[4] = {0};
    const int n = 4000;
    for (int s = 0; s < n; s++) {
        p.seed = (uint64_t)s;
        counts[sample_copy(&p, flat, 4, NULL, 0, NULL, 0, 17)]++;
    }
    for (int i = 0; i < 4; i++)
        check_freq(counts[i], n, 0.25, "across seeds", i);
}

static void test_temperature_distribution(void) {
    enum { V = 8 };
    const float logits[V] = {1.0f, 0.5f, 0.2f, -0.3f, -1.0f, 0.8f, 0.0f, -2.0f};
    sampling_params p = sampling_params_default();
    p.temperature = 0.7f;
    p.seed = 42;
    const int n = 20000;
    int counts[V];
    draw_counts(&p, logits, V, n, counts);
    double ref[V], z = 0.0;
    for (int i = 0; i < V; i++)
        z += ref[i] = exp((double)(logits[i] / p.temperature));
    double chi2 = 0.0;
    for (int i = 0; i < V; i++) {
        ref[i] /= z;
        check_freq(counts[i], n, ref[i], "temperature 0.7", i);
        double e = ref[i] * n;
        chi2 += (counts[i] - e) * (counts[i] - e) / e;
    }
    /* 24.32 is the 0.999 quantile of chi-square with 7 degrees of freedom. */
    CHECK(chi2 < 24.32, "chi-square %.2f over 7 dof", chi2);
    printf("temperature 0.7, V=8, %d draws: chi-square %.2f (7 dof, limit 24.32)\n", n, chi2);
}

/* Logits whose softmax is exactly probs[] (up to fp32 rounding). */
static void logits_from_probs(float *logits, const double *probs, int V) {
    for (int i = 0; i < V; i++)
        logits[i] = (float)log(probs[i]);
}

static void test_top_k(void) {
    enum { V = 16 };
    float logits[V];
    for (int i = 0; i < V; i++)
        logits[i] = (float)(0.1 * i);
    logits[3] = 2.0f;
    logits[11] = 1.9f;
    sampling_params p = sampling_params_default();
    p.top_k = 2;
    const int n = 20000;
    int counts[V];
    draw_counts(&p, logits, V, n, counts);
    int others = n - counts[3] - counts[11];
    CHECK(others == 0, "top_k 2 drew %d tokens outside the best two", others);
    double p3 = 1.0 / (1.0 + exp(1.9 - 2.0));
    check_freq(counts[3], n, p3, "top_k 2 renormalized", 3);
}

static void test_top_p(void) {
    enum { V = 4 };
    const double probs[V] = {0.15, 0.5, 0.05, 0.3}; /* ids shuffled against probability */
    float logits[V];
    logits_from_probs(logits, probs, V);
    sampling_params p = sampling_params_default();
    p.top_p = 0.8f;
    const int n = 20000;
    int counts[V];
    draw_counts(&p, logits, V, n, counts);
    CHECK(counts[0] == 0 && counts[2] == 0, "top_p .8 drew outside the nucleus: %d %d", counts[0],
          counts[2]);
    check_freq(counts[1], n, 0.5 / 0.8, "top_p .8 ratio 5:3", 1);
    printf("top_p 0.8 over .5 .3 .15 .05: counts %d : %d (ratio %.3f, want 1.667)\n", counts[1],
           counts[3], (double)counts[1] / (counts[3] ? counts[3] : 1));

    /* Just above the two-token mass, the third joins. */
    p.top_p = 0.81f;
    draw_counts(&p, logits, V, n, counts);
    CHECK(counts[0] > 0 && counts[2] == 0, "top_p .81: %d %d", counts[0], counts[2]);
    check_freq(counts[0], n, 0.15 / 0.95, "top_p .81", 0);

    /* Tiny top_p keeps exactly one token. */
    p.top_p = 0.01f;
    draw_counts(&p, logits, V, 2000, counts);
    CHECK(counts[1] == 2000, "top_p .01 kept more than the best token (%d)", counts[1]);

    /* top-p after top-k measures the renormalized top-k mass (vLLM, FlashInfer): top_k 2 gives
     * .625 / .375, so top_p .6 keeps only the best token (unrenormalized, .5 < .6 would keep
     * two). */
    p.top_k = 2;
    p.top_p = 0.6f;
    draw_counts(&p, logits, V, 2000, counts);
    CHECK(counts[1] == 2000, "top_k 2 + top_p .6 kept %d of 2000 on the best", counts[1]);
}

static void test_min_p(void) {
    enum { V = 4 };
    const double probs[V] = {0.5, 0.3, 0.15, 0.05};
    float logits[V];
    logits_from_probs(logits, probs, V);
    sampling_params p = sampling_params_default();
    const int n = 20000;
    int counts[V];

    p.min_p = 0.25f; /* threshold .125: drops only .05 */
    draw_counts(&p, logits, V, n, counts);
    CHECK(counts[3] == 0 && counts[2] > 0, "min_p .25: %d %d", counts[2], counts[3]);
    check_freq(counts[2], n, 0.15 / 0.95, "min_p .25", 2);

    p.min_p = 0.5f; /* threshold .25: keeps .5 and .3 */
    draw_counts(&p, logits, V, n, counts);
    CHECK(counts[2] == 0 && counts[3] == 0, "min_p .5: %d %d", counts[2], counts[3]);
    check_freq(counts[0], n, 0.5 / 0.8, "min_p .5", 0);

    p.min_p = 1.0f;
    draw_counts(&p, logits, V, 2000, counts);
    CHECK(counts[0] == 2000, "min_p 1 kept more than the best (%d)", counts[0]);

    /* With top-p also on, top-p is measured before min-p. */
    p.min_p = 0.25f;
    p.top_p = 0.8f;
    draw_counts(&p, logits, V, 2000, counts);
    CHECK(counts[2] == 0 && counts[3] == 0, "min_p .25 + top_p .8: %d %d", counts[2], counts[3]);
}

static void test_repetition_penalty(void) {
    sampling_params p = sampling_params_default();
    p.temperature = 0.0f;
    p.repetition_penalty = 1.5f;

    /* Positive logits are divided: 2 / 1.5 = 1.33 < 1.5. Three occurrences divide once. */
    float pos[3] = {2.0f, 1.5f, -5.0f};
    int32_t prompt[3] = {0, 0, 7};
    int32_t out[1] = {0};
    int t = sampler_sample(&p, pos, 3, prompt, 3, out, 1, 0);
    CHECK(t == 1, "rp 1.5 on a positive logit: got %d want 1", t);
    CHECK_CLOSE(pos[0], 2.0 / 1.5, 1e-6, 0, "penalized positive logit, applied once");
    CHECK(pos[1] == 1.5f && pos[2] == -5.0f, "unseen logits changed");

    /* Negative logits are multiplied: -1 * 1.5 = -1.5 < -1.2. Output ids count too. */
    float neg[2] = {-1.0f, -1.2f};
    t = sampler_sample(&p, neg, 2, NULL, 0, out, 1, 0);
    CHECK(t == 1, "rp 1.5 on a negative logit: got %d want 1", t);
    CHECK_CLOSE(neg[0], -1.5, 1e-6, 0, "penalized negative logit");

    /* rp < 1 rewards repeats: 1 / 0.5 = 2 > 1.5. */
    p.repetition_penalty = 0.5f;
    float rew[2] = {1.5f, 1.0f};
    int32_t seen[1] = {1};
    t = sampler_sample(&p, rew, 2, seen, 1, NULL, 0, 0);
    CHECK(t == 1, "rp 0.5 reward: got %d want 1", t);

    /* Out-of-vocabulary ids are ignored, not trusted with memory. */
    float safe[2] = {1.0f, 0.5f};
    int32_t wild[3] = {-3, 2, 1 << 30};
    t = sampler_sample(&p, safe, 2, wild, 3, wild, 3, 0);
    CHECK(t == 0 && safe[0] == 1.0f && safe[1] == 0.5f, "out-of-range ids touched logits");
}

static void test_frequency_presence(void) {
    sampling_params p = sampling_params_default();
    p.temperature = 0.0f;
    int32_t out[3] = {0, 2, 0}; /* token 0 twice */
    float l[3];
    int t;

    p.frequency_penalty = 0.15f; /* 1 - 2 * .15 = .7 < .8 */
    memcpy(l, (float[]){1.0f, 0.8f, -1.0f}, sizeof l);
    t = sampler_sample(&p, l, 3, NULL, 0, out, 3, 0);
    CHECK(t == 1, "frequency .15 x2: got %d want 1", t);
    CHECK_CLOSE(l[0], 0.7, 1e-6, 0, "frequency penalty counts occurrences");
    CHECK_CLOSE(l[2], -1.15, 1e-6, 0, "frequency penalty once for one occurrence");

    p.frequency_penalty = 0.05f; /* 1 - .1 = .9 > .8 */
    memcpy(l, (float[]){1.0f, 0.8f, -1.0f}, sizeof l);
    t = sampler_sample(&p, l, 3, NULL, 0, out, 3, 0);
    CHECK(t == 0, "frequency .05 x2: got %d want 0", t);

    /* Presence applies once whatever the count: .85 > .8 keeps 0; .3 flips it. */
    p.frequency_penalty = 0.0f;
    p.presence_penalty = 0.15f;
    memcpy(l, (float[]){1.0f, 0.8f, -1.0f}, sizeof l);
    t = sampler_sample(&p, l, 3, NULL, 0, out, 3, 0);
    CHECK(t == 0, "presence .15: got %d want 0", t);
    CHECK_CLOSE(l[0], 0.85, 1e-6, 0, "presence penalty once");
    p.presence_penalty = 0.3f;
    memcpy(l, (float[]){1.0f, 0.8f, -1.0f}, sizeof l);
    t = sampler_sample(&p, l, 3, NULL, 0, out, 3, 0);
    CHECK(t == 1, "presence .3: got %d want 1", t);

    /* Negative frequency rewards: 0.8 + 0.3 = 1.1 > 1. */
    p.presence_penalty = 0.0f;
    p.frequency_penalty = -0.3f;
    int32_t out1[1] = {1};
    memcpy(l, (float[]){1.0f, 0.8f, -1.0f}, sizeof l);
    t = sampler_sample(&p, l, 3, NULL, 0, out1, 1, 0);
    CHECK(t == 1, "frequency -.3: got %d want 1", t);

    /* Prompt tokens do not count for frequency and presence. */
    p.frequency_penalty = 2.0f;
    p.presence_penalty = 2.0f;
    int32_t prompt[2] = {0, 0};
    memcpy(l, (float[]){1.0f, 0.8f, -1.0f}, sizeof l);
    t = sampler_sample(&p, l, 3, prompt, 2, NULL, 0, 0);
    CHECK(t == 0 && l[0] == 1.0f, "prompt-only token penalized by frequency/presence");

    /* The counts do not leak into the next call. */
    memcpy(l, (float[]){1.0f, 0.8f, -1.0f}, sizeof l);
    (void)sampler_sample(&p, l, 3, NULL, 0, out1, 1, 0);
    CHECK(l[0] == 1.0f && l[2] == -1.0f, "counts leaked across calls: %g %g", l[0], l[2]);
    CHECK_CLOSE(l[1], 0.8 - 4.0, 1e-6, 0, "frequency + presence on one occurrence");
}

/* logit_bias: added after the penalties, before the temperature; greedy and sampled draws follow
 * it; the checks of its values. */
static void test_logit_bias(void) {
    sampling_params p = sampling_params_default();
    p.temperature = 0.0f;
    float l[4];
    sampler_bias ban[1] = {{.id = 0, .bias = -100.0f}}, force[2] = {{3, 5.0f}, {1, -0.5f}};
    p.logit_bias = ban;
    p.n_logit_bias = 1;
    memcpy(l, (float[]){2.0f, 1.0f, 0.5f, -1.0f}, sizeof l);
    int t = sampler_sample(&p, l, 4, NULL, 0, NULL, 0, 0);
    CHECK(t == 1 && l[0] == 2.0f - 100.0f, "bias -100 on the argmax: got %d (%g)", t, l[0]);
    p.logit_bias = force;
    p.n_logit_bias = 2;
    memcpy(l, (float[]){2.0f, 1.0f, 0.5f, -1.0f}, sizeof l);
    t = sampler_sample(&p, l, 4, NULL, 0, NULL, 0, 0);
    CHECK(t == 3 && l[3] == 4.0f && l[1] == 0.5f, "bias +5 on token 3: got %d (%g, %g)", t, l[3],
          l[1]);
    /* after the presence penalty: 2 - 1.5 = .5, then + 1 = 1.5 > 1.2 */
    int32_t out[1] = {0};
    sampler_bias up[1] = {{0, 1.0f}};
    p.logit_bias = up;
    p.n_logit_bias = 1;
    p.presence_penalty = 1.5f;
    memcpy(l, (float[]){2.0f, 1.2f, 0.5f, -1.0f}, sizeof l);
    t = sampler_sample(&p, l, 4, NULL, 0, out, 1, 0);
    CHECK(t == 0 && l[0] == 1.5f, "bias after the penalty: got %d (%g)", t, l[0]);
    p.presence_penalty = 0.0f;
    /* sampled: every draw lands where a +100 bias points */
    p.temperature = 1.0f;
    p.logit_bias = force;
    force[0].bias = 100.0f;
    int counts[4];
    draw_counts(&p, (float[]){2.0f, 1.0f, 0.5f, -1.0f}, 4, 200, counts);
    CHECK(counts[3] == 200, "sampled with +100 on token 3: %d of 200", counts[3]);
    /* checks */
    sampler_bias bad[2] = {{1, 100.5f}, {2, 0.0f}};
    p.logit_bias = bad;
    p.n_logit_bias = 2;
    CHECK(sampling_params_check(&p) != NULL, "a bias above 100 passed the check");
    bad[0] = (sampler_bias){-1, 1.0f};
    CHECK(sampling_params_check(&p) != NULL, "a negative id passed the check");
    bad[0] = (sampler_bias){2, 1.0f};
    CHECK(sampling_params_check(&p) != NULL, "an id given twice passed the check");
    bad[0] = (sampler_bias){1, NAN};
    CHECK(sampling_params_check(&p) != NULL, "a NaN bias passed the check");
    bad[0] = (sampler_bias){1, -100.0f};
    CHECK(sampling_params_check(&p) == NULL, "a valid bias failed the check");
}

static void test_log_softmax(void) {
    enum { V = 5000 };
    float *x = malloc(V * sizeof *x), *y = malloc(V * sizeof *y);
    for (int i = 0; i < V; i++)
        x[i] = (float)(8.0 * rng_normal());
    x[10] = 40.0f;
    double m = -INFINITY;
    for (int i = 0; i < V; i++)
        m = x[i] > m ? x[i] : m;
    double z = 0.0;
    for (int i = 0; i < V; i++)
        z += exp((double)x[i] - m);
    double lz = m + log(z);

    sampler_log_softmax(y, x, V);
    /* Tolerance: 1e-6 + 1e-6 * |ref|, i.e. within fp32 rounding of the output. */
    double max_err = 0.0, psum = 0.0;
    int bad = 0;
    for (int i = 0; i < V; i++) {
        double ref = (double)x[i] - lz;
        double err = fabs((double)y[i] - ref);
        if (err > max_err) max_err = err;
        if (err > 1e-6 + 1e-6 * fabs(ref)) {
            if (bad < 5) fprintf(stderr, "  log_softmax[%d] = %.9g want %.9g\n", i, y[i], ref);
            bad++;
        }
        psum += exp((double)y[i]);
    }
    CHECK(bad == 0, "%d log_softmax values off the double reference (max err %.3g)", bad, max_err);
    CHECK_CLOSE(psum, 1.0, 1e-5, 0, "sum of exp(log_softmax)");
    printf("log_softmax V=%d: max abs error vs double %.3g, sum of probs - 1 = %.3g\n", V, max_err,
           psum - 1.0);

    /* In place gives the same bits. */
    float *inplace = malloc(V * sizeof *inplace);
    memcpy(inplace, x, V * sizeof *inplace);
    sampler_log_softmax(inplace, inplace, V);
    CHECK(memcmp(inplace, y, V * sizeof *y) == 0, "in-place log_softmax differs");

    /* A -inf entry gives -inf; an all-equal row gives log(1/V). */
    float row[3] = {0.0f, -INFINITY, 0.0f};
    sampler_log_softmax(row, row, 3);
    CHECK(row[1] == -INFINITY, "log_softmax of -inf: %g", row[1]);
    CHECK_CLOSE(row[0], log(0.5), 1e-7, 0, "log_softmax with a masked entry");
    free(x);
    free(y);
    free(inplace);
}

/* ---- a slow, readable reference: full qsort, each filter spelled out ---- */

typedef struct {
    float prob;
    int id;
} ref_entry;

static int ref_cmp(const void *a, const void *b) {
    const ref_entry *x = a, *y = b;
    if (x->prob != y->prob) return x->prob > y->prob ? -1 : 1;
    return (x->id > y->id) - (x->id < y->id);
}

static int ref_sample(const sampling_params *p, const float *logits_in, int V,
                      const int32_t *prompt, int n_prompt, const int32_t *output, int n_output,
                      uint64_t position) {
    float *x = malloc((size_t)V * sizeof *x);
    memcpy(x, logits_in, (size_t)V * sizeof *x);
    char *seen = calloc((size_t)V, 1);
    int *count = calloc((size_t)V, sizeof *count);
    for (int i = 0; i < n_prompt; i++)
        seen[prompt[i]] = 1;
    for (int i = 0; i < n_output; i++)
        seen[output[i]] = 1, count[output[i]]++;
    for (int i = 0; i < V; i++) {
        if (seen[i] && p->repetition_penalty != 1.0f)
            x[i] = x[i] > 0 ? x[i] / p->repetition_penalty : x[i] * p->repetition_penalty;
        if (count[i] && (p->frequency_penalty != 0.0f || p->presence_penalty != 0.0f)) {
            x[i] -= p->frequency_penalty * (float)count[i];
            x[i] -= p->presence_penalty;
        }
    }
    int result = -1;
    if (p->temperature < SAMPLER_GREEDY_EPS || p->top_k == 1) {
        result = 0;
        for (int i = 1; i < V; i++)
            if (x[i] > x[result]) result = i;
    } else {
        float m = -INFINITY;
        for (int i = 0; i < V; i++) {
            x[i] /= p->temperature;
            if (x[i] > m) m = x[i];
        }
        if (m == -INFINITY) { /* nothing to normalize: the argmax, i.e. token 0 */
            free(x);
            free(seen);
            free(count);
            return 0;
        }
        ref_entry *e = malloc((size_t)V * sizeof *e);
        for (int i = 0; i < V; i++)
            e[i] = (ref_entry){expf(x[i] - m), i};
        qsort(e, (size_t)V, sizeof *e, ref_cmp);
        int n = V;
        if (p->top_k > 0 && p->top_k < n) n = p->top_k;
        if (p->top_p < 1.0f) {
            double norm = 0.0, cum = 0.0;
            for (int i = 0; i < n; i++)
                norm += e[i].prob;
            for (int i = 0; i < n; i++) {
                cum += e[i].prob;
                if (cum >= ((double)p->top_p - REF_TOP_P_SLACK) * norm) {
                    n = i + 1;
                    break;
                }
            }
        }
        int keep = 1;
        while (keep < n && e[keep].prob >= p->min_p * e[0].prob)
            keep++;
        n = keep;
        while (n > 1 && e[n - 1].prob == 0.0f)
            n--;
        double mass = 0.0, cum = 0.0;
        for (int i = 0; i < n; i++)
            mass += e[i].prob;
        double target = sampler_uniform(p->seed, position) * mass;
        result = e[n - 1].id;
        for (int i = 0; i < n; i++) {
            cum += e[i].prob;
            if (target < cum) {
                result = e[i].id;
                break;
            }
        }
        free(e);
    }
    free(x);
    free(seen);
    free(count);
    return result;
}

static void test_against_reference(void) {
    static const int vs[] = {1, 2, 7, 300, 5000};
    static const float temps[] = {0.0f, 0.3f, 1.0f, 1.7f};
    static const int topks[] = {-1, 1, 2, 5, 50, 256, 257, 1000, 5000};
    static const float topps[] = {1.0f, 0.95f, 0.5f, 0.05f};
    static const float minps[] = {0.0f, 0.01f, 0.2f};
    const int trials = 3000;
    int mismatches = 0;
    for (int t = 0; t < trials; t++) {
        int V = vs[rng_next() % 5];
        sampling_params p = sampling_params_default();
        p.temperature = temps[rng_next() % 4];
        p.top_k = topks[rng_next() % 9];
        p.top_p = topps[rng_next() % 4];
        p.min_p = minps[rng_next() % 3];
        if (rng_next() % 2) p.repetition_penalty = (float)(0.5 + rng_uniform());
        if (rng_next() % 2) p.frequency_penalty = (float)(rng_uniform() - 0.5);
        if (rng_next() % 2) p.presence_penalty = (float)(rng_uniform() - 0.5);
        p.seed = rng_next();
        float *logits = malloc((size_t)V * sizeof *logits);
        int kind = (int)(rng_next() % 3);
        for (int i = 0; i < V; i++) {
            double g = 3.0 * rng_normal();
            /* kind 1: coarse values, so probabilities tie and id order decides; kind 2: some
             * masked tokens. */
            logits[i] = kind == 1 ? (float)round(g) : (float)g;
            if (kind == 2 && rng_next() % 4 == 0) logits[i] = -INFINITY;
        }
        int32_t prompt[64], output[32];
        int n_prompt = (int)(rng_next() % 64), n_output = (int)(rng_next() % 32);
        for (int i = 0; i < n_prompt; i++)
            prompt[i] = (int32_t)(rng_next() % (uint64_t)V);
        for (int i = 0; i < n_output; i++)
            output[i] = (int32_t)(rng_next() % (uint64_t)V);
        uint64_t pos = rng_next() % 100000;
        int want = ref_sample(&p, logits, V, prompt, n_prompt, output, n_output, pos);
        int got = sample_copy(&p, logits, V, prompt, n_prompt, output, n_output, pos);
        if (got != want) {
            if (mismatches < 5)
                fprintf(stderr,
                        "  trial %d: V=%d T=%g top_k=%d top_p=%g min_p=%g: got %d want %d\n", t, V,
                        p.temperature, p.top_k, p.top_p, p.min_p, got, want);
            mismatches++;
        }
        free(logits);
    }
    CHECK(mismatches == 0, "%d of %d samples differ from the reference sampler", mismatches,
          trials);
    printf("reference sampler: %d random configurations, %d mismatches\n", trials, mismatches);
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static void test_large_vocab(void) {
    enum { V = 151936, REPS = 21 };
    float *logits = malloc(V * sizeof *logits), *tmp = malloc(V * sizeof *tmp);
    /* Roughly LM-shaped: a broad body and a few strong candidates. */
    for (int i = 0; i < V; i++)
        logits[i] = (float)(2.5 * rng_normal() - 2.0);
    for (int i = 0; i < 20; i++)
        logits[rng_next() % V] = (float)(12.0 + rng_normal());
    int best = 0;
    for (int i = 1; i < V; i++)
        if (logits[i] > logits[best]) best = i;
    int32_t *prompt = malloc(8192 * sizeof *prompt), output[1024];
    for (int i = 0; i < 8192; i++)
        prompt[i] = (int32_t)(rng_next() % V);
    for (int i = 0; i < 1024; i++)
        output[i] = (int32_t)(rng_next() % V);

    struct {
        const char *name;
        float temperature, top_p, min_p, rp, fp;
        int top_k, penalties;
    } cfgs[] = {
        {"greedy", 0.0f, 1.0f, 0.0f, 1.0f, 0.0f, -1, 0},
        {"T=1, no filter (full order)", 1.0f, 1.0f, 0.0f, 1.0f, 0.0f, -1, 0},
        {"T=0.7 top_p=0.95", 0.7f, 0.95f, 0.0f, 1.0f, 0.0f, -1, 0},
        {"T=0.7 top_k=50", 0.7f, 1.0f, 0.0f, 1.0f, 0.0f, 50, 0},
        {"T=0.6 top_k=20 top_p=0.95", 0.6f, 0.95f, 0.0f, 1.0f, 0.0f, 20, 0},
        {"T=1 top_k=5000 top_p=0.9", 1.0f, 0.9f, 0.0f, 1.0f, 0.0f, 5000, 0},
        {"T=1 min_p=0.05", 1.0f, 1.0f, 0.05f, 1.0f, 0.0f, -1, 0},
        {"T=1 + penalties, 8192+1024 ctx", 1.0f, 1.0f, 0.0f, 1.1f, 0.5f, -1, 1},
    };
    int n_cfg = (int)(sizeof cfgs / sizeof cfgs[0]);
    printf("timing limit per sample: %g ms (cpu, median of %d)%s\n", SAMPLE_LIMIT_MS, REPS,
           SAMPLE_LIMIT_MS > 10.0 ? ", relaxed for a sanitizer build" : "");
    for (int c = 0; c < n_cfg; c++) {
        sampling_params p = sampling_params_default();
        p.temperature = cfgs[c].temperature;
        p.top_p = cfgs[c].top_p;
        p.top_k = cfgs[c].top_k;
        p.min_p = cfgs[c].min_p;
        p.repetition_penalty = cfgs[c].rp;
        p.frequency_penalty = cfgs[c].fp;
        p.seed = 99;
        /* Wall time is printed; the limit is checked on this thread's CPU time, which a
         * machine busy with other work does not inflate. */
        double wall[REPS], cpu[REPS];
        int in_range = 1, greedy_ok = 1;
        for (int r = 0; r < REPS; r++) {
            memcpy(tmp, logits, V * sizeof *tmp);
            double w0 = now_ms(CLOCK_MONOTONIC), c0 = now_ms(CLOCK_THREAD_CPUTIME_ID);
            int t = sampler_sample(&p, tmp, V, cfgs[c].penalties ? prompt : NULL,
                                   cfgs[c].penalties ? 8192 : 0, cfgs[c].penalties ? output : NULL,
                                   cfgs[c].penalties ? 1024 : 0, (uint64_t)r);
            cpu[r] = now_ms(CLOCK_THREAD_CPUTIME_ID) - c0;
            wall[r] = now_ms(CLOCK_MONOTONIC) - w0;
            in_range &= t >= 0 && t < V;
            if (p.temperature == 0.0f) greedy_ok &= t == best;
        }
        qsort(wall, REPS, sizeof wall[0], cmp_double);
        qsort(cpu, REPS, sizeof cpu[0], cmp_double);
        printf("V=%d %-32s median %.3f ms (cpu %.3f ms), max %.3f ms\n", V, cfgs[c].name,
               wall[REPS / 2], cpu[REPS / 2], wall[REPS - 1]);
        CHECK(in_range, "%s: token out of range", cfgs[c].name);
        CHECK(greedy_ok, "%s: not the argmax", cfgs[c].name);
        CHECK(cpu[REPS / 2] < SAMPLE_LIMIT_MS, "%s: median cpu %.3f ms, want < %g", cfgs[c].name,
              cpu[REPS / 2], SAMPLE_LIMIT_MS);
    }

    /* At full size, top_k 50 draws only among the 50 best; check against the reference. */
    sampling_params p = sampling_params_default();
    p.top_k = 50;
    p.temperature = 1.3f;
    int agree = 1;
    for (uint64_t pos = 0; pos < 20; pos++)
        agree &= sample_copy(&p, logits, V, NULL, 0, NULL, 0, pos) ==
                 ref_sample(&p, logits, V, NULL, 0, NULL, 0, pos);
    CHECK(agree, "V=%d top_k 50 differs from the reference", V);
    free(logits);
    free(tmp);
    free(prompt);
}

/* Threads that sample and exit without freeing: their scratch is still reachable, and
 * sampler_scratch_free on another thread frees it all; sampling goes on afterwards. */
static void *sample_on_thread(void *arg) {
    float logits[64];
    for (int i = 0; i < 64; i++)
        logits[i] = (float)((i * 7) % 13) * 0.25f;
    sampling_params p = sampling_params_default();
    p.top_p = 0.9f;
    p.repetition_penalty = 1.2f;
    int32_t prompt[2] = {3, 5};
    *(int *)arg = sampler_sample(&p, logits, 64, prompt, 2, NULL, 0, 1);
    return NULL;
}

static void test_scratch_threads(void) {
    sampler_scratch_free();
    pthread_t th[4];
    int tok[4];
    for (int t = 0; t < 4; t++)
        pthread_create(&th[t], NULL, sample_on_thread, &tok[t]);
    for (int t = 0; t < 4; t++)
        pthread_join(th[t], NULL);
    CHECK(sampler_scratch_blocks() == 4, "4 threads sampled: %d scratch blocks held",
          sampler_scratch_blocks());
    CHECK(tok[0] == tok[1] && tok[1] == tok[2] && tok[2] == tok[3], "same draw on every thread");
    sampler_scratch_free();
    CHECK(sampler_scratch_blocks() == 0, "after sampler_scratch_free: %d blocks",
          sampler_scratch_blocks());
    int again = -1;
    sample_on_thread(&again);
    CHECK(again == tok[0] && sampler_scratch_blocks() == 1,
          "sampling after the free: token %d (was %d), %d block", again, tok[0],
          sampler_scratch_blocks());
}

int main(void) {
    test_params();
    test_uniform();
    test_greedy();
    test_seed();
    test_temperature_distribution();
    test_top_k();
    test_top_p();
    test_min_p();
    test_repetition_penalty();
    test_frequency_presence();
    test_logit_bias();
    test_log_softmax();
    test_against_reference();
    test_large_vocab();
    test_scratch_threads();
    sampler_scratch_free();
    CHECK_SUMMARY();
}
