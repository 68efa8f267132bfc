/* Sampling: one token from one row of logits, as SGLang and vLLM do it.
 *
 * Order: penalties (repetition over prompt + output, frequency and presence over output) ->
 * logit bias -> temperature -> top-k -> top-p -> min-p -> draw. temperature < 1e-6 is greedy
 * (argmax of the penalized and biased logits, lowest id on ties). The draw uses a counter-based
 * generator keyed by (seed, position), so a request's sampled output does not depend on what else
 * runs. */
#ifndef MOESERVE_SAMPLER_H
#define MOESERVE_SAMPLER_H

#include <stdbool.h>
#include <stdint.h>

#define SAMPLER_GREEDY_EPS 1e-6f

/* One entry of a logit bias (OpenAI's logit_bias): bias is added to token id's logit. */
typedef struct {
    int32_t id;
    float bias;
} sampler_bias;

#define SAMPLER_MAX_BIAS 100.0f /* |bias| at most, as OpenAI's API allows */

typedef struct {
    float temperature;        /* >= 0; default 1 */
    float top_p;              /* (0, 1]; default 1 */
    int top_k;                /* -1 or >= 1; default -1 (all) */
    float min_p;              /* [0, 1]; default 0 */
    float repetition_penalty; /* (0, 2]; default 1 (off) */
    float frequency_penalty;  /* [-2, 2]; default 0 */
    float presence_penalty;   /* [-2, 2]; default 0 */
    uint64_t seed;            /* per request */
    /* [n_logit_bias] distinct ids, owned by whoever owns the params (a request copies them);
     * NULL / 0: none */
    const sampler_bias *logit_bias;
    int n_logit_bias;
} sampling_params;

/* The defaults above. */
sampling_params sampling_params_default(void);

/* Returns NULL when p is valid, else a message naming the bad field (for a 400 / flag error). */
const char *sampling_params_check(const sampling_params *p);

/* A uniform double in [0, 1) from (seed, counter): splitmix64 of both, 53 bits
 * (common/counter_rng.h, which the CUDA sampling kernels share). */
double sampler_uniform(uint64_t seed, uint64_t counter);

/* Sample one token from logits[V] (modified in place: scratch). prompt[n_prompt] and
 * output[n_output] are the ids seen so far (for the penalties); position is the index of the
 * token being sampled in its sequence (the generator's counter). */
int sampler_sample(const sampling_params *p, float *logits, int V, const int32_t *prompt,
                   int n_prompt, const int32_t *output, int n_output, uint64_t position);

/* logprobs[V] = log_softmax(logits[V]) in fp32 with a max-shift (double accumulation of the
 * normalizer). Safe when logprobs == logits. */
void sampler_log_softmax(float *logprobs, const float *logits, int V);

/* Frees every thread's sampling scratch (each thread keeps one between calls so that no call
 * allocates V-sized buffers). Call it when no thread is sampling, before the threads that
 * sampled exit; a later call allocates again. */
void sampler_scratch_free(void);

/* How many threads' scratch blocks are held now (tests). */
int sampler_scratch_blocks(void);

#endif
