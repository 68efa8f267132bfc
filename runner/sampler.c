/* Sampling: penalties, temperature, top-k / top-p / min-p, and a seeded draw (see sampler.h).
 *
 * Choices:
 * - Reproducible by construction. The draw uses u = sampler_uniform(seed, position); the kept
 *   tokens are put in descending order of their fp32 probability, ties by ascending id, and
 *   every sum runs in a fixed order in double. The token therefore depends only on the logits,
 *   the parameters, the seed and the position: not on the platform, the batch or the thread.
 * - top-k, top-p and min-p each keep a prefix of that descending order, so once the candidates
 *   are ordered the three filters are cut points. A small top_k is found with a bounded heap
 *   (O(V log k)). Otherwise the order is built lazily: one counting pass groups the candidates
 *   into 1017 buckets by the top bits of their probability, walks step over whole buckets by
 *   their precomputed mass, and only a bucket that a cut point or the draw falls into gets
 *   sorted (a stable radix sort, so ties stay in id order). Even the unfiltered case over the
 *   whole vocabulary is then O(V) with one scatter, not a sort of V elements.
 * - top-p is measured on the probabilities renormalized over the top-k set, as vLLM and
 *   FlashInfer (top_k_first) do. min-p is relative to the largest probability, which the
 *   earlier filters never remove, so it commutes with them.
 * - Cheap pre-filters: tokens whose probability underflows to 0 can never be drawn and are
 *   dropped before ordering; when top-p is off, or top-k keeps everything, tokens below the
 *   min-p threshold are dropped too (there top-p's normalizer does not depend on them).
 * - top_k == 1 is greedy, as in SGLang (its is_all_greedy test is top_k <= 1), so it picks the
 *   argmax of the logits even where two probabilities round to the same float.
 * - No V-sized allocation per call: each thread keeps its scratch (sort keys, a mark array
 *   stamped with a generation number so it is never cleared in full, and an output-token
 *   count array that is zeroed again entry by entry after use).
 * - Parameters are validated once by sampling_params_check; sampler_sample still treats
 *   out-of-range values and out-of-vocabulary ids gently (clamps or skips) rather than
 *   trusting them with memory. */
#include "runner/sampler.h"

#include "common/counter_rng.h"
#include "common/log.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Slack on the top-p threshold. Each fp32 probability carries a relative rounding error of
 * about 6e-8, so a nucleus whose mass lands within this of top_p (".5 + .3 >= .8") is taken
 * as reaching it, and the smaller set wins instead of a coin flip on rounding. */
#define SAMPLER_TOP_P_SLACK 1e-6

/* Up to this top_k the selection is a bounded heap; above it the bucketed order (which sorts
 * the bucket holding the k-th token) is cheaper than n log k heap work. */
#define SAMPLER_HEAP_MAX_K 256

typedef struct sampler_scratch {
    uint64_t *keys; /* [cap] packed (probability, id) sort keys */
    uint64_t *tmp;  /* [cap] the keys grouped by bucket */
    size_t cap;     /* entries in keys and tmp */
    uint32_t *mark; /* [mark_v] generation stamp per token: seen in this call's context */
    int32_t *count; /* [mark_v] occurrences in the output; all zero between calls */
    int mark_v;     /* entries in mark and count */
    uint32_t gen;   /* current stamp; mark[i] == gen means token i already penalized */
    struct sampler_order *order;  /* bucket bookkeeping of the ordered view (see below) */
    struct sampler_scratch *next; /* every thread's scratch, linked for sampler_scratch_free */
} sampler_scratch;                /* one per thread */

/* A thread finds its scratch through tls_scratch while tls_epoch matches scratch_epoch;
 * sampler_scratch_free frees every block (the worker threads of a parallel region sample too,
 * and are not there to free their own) and moves the epoch on, so that a thread's old pointer
 * is never used again. */
static pthread_mutex_t scratch_lock = PTHREAD_MUTEX_INITIALIZER;
static sampler_scratch *scratch_all;
static atomic_uint scratch_epoch;
static _Thread_local sampler_scratch *tls_scratch;
static _Thread_local unsigned tls_epoch;

static sampler_scratch *scratch_get(void) {
    unsigned epoch = atomic_load(&scratch_epoch);
    if (tls_scratch && tls_epoch == epoch) return tls_scratch;
    sampler_scratch *sc = xcalloc(1, sizeof *sc);
    pthread_mutex_lock(&scratch_lock);
    sc->next = scratch_all;
    scratch_all = sc;
    tls_epoch = atomic_load(&scratch_epoch);
    pthread_mutex_unlock(&scratch_lock);
    tls_scratch = sc;
    return sc;
}

void sampler_scratch_free(void) {
    pthread_mutex_lock(&scratch_lock);
    sampler_scratch *sc = scratch_all;
    scratch_all = NULL;
    atomic_fetch_add(&scratch_epoch, 1);
    pthread_mutex_unlock(&scratch_lock);
    while (sc) {
        sampler_scratch *next = sc->next;
        free(sc->keys);
        free(sc->tmp);
        free(sc->mark);
        free(sc->count);
        free(sc->order);
        free(sc);
        sc = next;
    }
    tls_scratch = NULL;
}

int sampler_scratch_blocks(void) {
    int n = 0;
    pthread_mutex_lock(&scratch_lock);
    for (const sampler_scratch *sc = scratch_all; sc; sc = sc->next)
        n++;
    pthread_mutex_unlock(&scratch_lock);
    return n;
}

static void scratch_reserve_keys(sampler_scratch *scratch, size_t n) {
    if (scratch->cap >= n) return;
    free(scratch->keys);
    free(scratch->tmp);
    scratch->keys = xmalloc(n * sizeof *scratch->keys);
    scratch->tmp = xmalloc(n * sizeof *scratch->tmp);
    scratch->cap = n;
}

static void scratch_reserve_marks(sampler_scratch *scratch, int V) {
    if (scratch->mark_v >= V) return;
    free(scratch->mark);
    free(scratch->count);
    scratch->mark = xcalloc((size_t)V, sizeof *scratch->mark);
    scratch->count = xcalloc((size_t)V, sizeof *scratch->count);
    scratch->mark_v = V;
    scratch->gen = 0;
}

/* A fresh stamp; on wrap-around the marks are cleared so an old stamp cannot collide. */
static uint32_t scratch_next_gen(sampler_scratch *scratch) {
    if (++scratch->gen == 0) {
        memset(scratch->mark, 0, (size_t)scratch->mark_v * sizeof *scratch->mark);
        scratch->gen = 1;
    }
    return scratch->gen;
}

sampling_params sampling_params_default(void) {
    sampling_params p = {
        .temperature = 1.0f,
        .top_p = 1.0f,
        .top_k = -1,
        .min_p = 0.0f,
        .repetition_penalty = 1.0f,
        .frequency_penalty = 0.0f,
        .presence_penalty = 0.0f,
        .seed = 0,
    };
    return p;
}

/* The message lives in a per-thread buffer, valid until the next failing check on the same
 * thread. Each test is written so that NaN fails it. */
const char *sampling_params_check(const sampling_params *p) {
    static _Thread_local char msg[128];
    if (!(p->temperature >= 0.0f && isfinite(p->temperature))) {
        snprintf(msg, sizeof msg, "temperature must be finite and >= 0, got %g",
                 (double)p->temperature);
        return msg;
    }
    if (!(p->top_p > 0.0f && p->top_p <= 1.0f)) {
        snprintf(msg, sizeof msg, "top_p must be in (0, 1], got %g", (double)p->top_p);
        return msg;
    }
    if (!(p->top_k == -1 || p->top_k >= 1)) {
        snprintf(msg, sizeof msg, "top_k must be -1 (all) or >= 1, got %d", p->top_k);
        return msg;
    }
    if (!(p->min_p >= 0.0f && p->min_p <= 1.0f)) {
        snprintf(msg, sizeof msg, "min_p must be in [0, 1], got %g", (double)p->min_p);
        return msg;
    }
    if (!(p->repetition_penalty > 0.0f && p->repetition_penalty <= 2.0f)) {
        snprintf(msg, sizeof msg, "repetition_penalty must be in (0, 2], got %g",
                 (double)p->repetition_penalty);
        return msg;
    }
    if (!(p->frequency_penalty >= -2.0f && p->frequency_penalty <= 2.0f)) {
        snprintf(msg, sizeof msg, "frequency_penalty must be in [-2, 2], got %g",
                 (double)p->frequency_penalty);
        return msg;
    }
    if (!(p->presence_penalty >= -2.0f && p->presence_penalty <= 2.0f)) {
        snprintf(msg, sizeof msg, "presence_penalty must be in [-2, 2], got %g",
                 (double)p->presence_penalty);
        return msg;
    }
    for (int i = 0; i < p->n_logit_bias; i++) {
        const sampler_bias *b = &p->logit_bias[i];
        if (b->id < 0) {
            snprintf(msg, sizeof msg, "logit_bias: token id %d is negative", (int)b->id);
            return msg;
        }
        if (!(b->bias >= -SAMPLER_MAX_BIAS && b->bias <= SAMPLER_MAX_BIAS)) {
            snprintf(msg, sizeof msg,
                     "logit_bias: the bias of token %d must be in [-100, 100], got %g", (int)b->id,
                     (double)b->bias);
            return msg;
        }
        for (int j = 0; j < i; j++)
            if (p->logit_bias[j].id == b->id) {
                snprintf(msg, sizeof msg, "logit_bias names token %d twice", (int)b->id);
                return msg;
            }
    }
    return NULL;
}

/* The generator lives in common/counter_rng.h so that the CUDA sampling kernels draw the same
 * bits. */
double sampler_uniform(uint64_t seed, uint64_t counter) {
    return counter_rng_uniform(seed, counter);
}

/* Lowest id among the largest values; NaN never wins. */
static int sampler_argmax(const float *x, int V) {
    int best = 0;
    float bv = -INFINITY;
    for (int i = 0; i < V; i++)
        if (x[i] > bv) {
            bv = x[i];
            best = i;
        }
    return best;
}

/* Repetition (vLLM / HF): once per distinct token of prompt + output, divide a positive logit
 * by rp and multiply a non-positive one. Then frequency and presence (OpenAI), output only:
 * logit -= frequency * count, then -= presence, in vLLM's order. */
static void sampler_apply_penalties(const sampling_params *p, float *logits, int V,
                                    const int32_t *prompt, int n_prompt, const int32_t *output,
                                    int n_output) {
    float rp = p->repetition_penalty;
    float fp = p->frequency_penalty, pp = p->presence_penalty;
    bool do_rep = rp != 1.0f && rp > 0.0f && n_prompt + n_output > 0;
    bool do_out = (fp != 0.0f || pp != 0.0f) && n_output > 0;
    if (!do_rep && !do_out) return;
    sampler_scratch *scratch = scratch_get();
    scratch_reserve_marks(scratch, V);
    if (do_rep) {
        uint32_t g = scratch_next_gen(scratch);
        for (int pass = 0; pass < 2; pass++) {
            const int32_t *ids = pass == 0 ? prompt : output;
            int n = pass == 0 ? n_prompt : n_output;
            for (int i = 0; i < n; i++) {
                int32_t id = ids[i];
                if (id < 0 || id >= V || scratch->mark[id] == g) continue;
                scratch->mark[id] = g;
                float x = logits[id];
                logits[id] = x > 0.0f ? x / rp : x * rp;
            }
        }
    }
    if (do_out) {
        for (int i = 0; i < n_output; i++)
            if (output[i] >= 0 && output[i] < V) scratch->count[output[i]]++;
        /* The first visit of each distinct id applies its penalty and zeroes its count, which
         * both prevents a second application and restores the all-zero invariant. */
        for (int i = 0; i < n_output; i++) {
            int32_t id = output[i];
            if (id < 0 || id >= V || scratch->count[id] == 0) continue;
            logits[id] -= fp * (float)scratch->count[id];
            logits[id] -= pp;
            scratch->count[id] = 0;
        }
    }
}

/* Sort keys: the complemented bits of a positive float probability in the high half (a larger
 * probability gives a smaller key) and the id in the low half, so ascending key order is
 * descending probability with ties by ascending id. */
static uint64_t key_pack(float prob, int id) {
    uint32_t bits;
    memcpy(&bits, &prob, sizeof bits);
    return ((uint64_t)~bits << 32) | (uint32_t)id;
}

static float key_prob(uint64_t key) {
    uint32_t bits = ~(uint32_t)(key >> 32);
    float prob;
    memcpy(&prob, &bits, sizeof prob);
    return prob;
}

static int key_id(uint64_t key) { return (int)(uint32_t)key; }

/* Stable LSD radix sort of a[n] by the high 32 bits (11 + 11 + 10 bit digits); used on one
 * bucket, whose keys arrive in id order, so stability is what orders ties by id. A digit that
 * is the same for every key skips its pass (within a bucket the top one always does). */
static void sampler_radix_sort(uint64_t *a, uint64_t *tmp, int n) {
    static const int shift[3] = {32, 43, 54};
    static const uint32_t mask[3] = {2047, 2047, 1023};
    uint32_t hist[3][2048];
    memset(hist, 0, sizeof hist);
    for (int i = 0; i < n; i++) {
        uint64_t k = a[i];
        for (int d = 0; d < 3; d++)
            hist[d][(k >> shift[d]) & mask[d]]++;
    }
    uint64_t *src = a, *dst = tmp;
    for (int d = 0; d < 3; d++) {
        uint32_t *h = hist[d];
        if (h[(src[0] >> shift[d]) & mask[d]] == (uint32_t)n) continue;
        uint32_t sum = 0;
        for (uint32_t b = 0; b <= mask[d]; b++) {
            uint32_t c = h[b];
            h[b] = sum;
            sum += c;
        }
        for (int i = 0; i < n; i++)
            dst[h[(src[i] >> shift[d]) & mask[d]]++] = src[i];
        uint64_t *t = src;
        src = dst;
        dst = t;
    }
    if (src != a) memcpy(a, src, (size_t)n * sizeof *a);
}

static void heap_sift_down(uint64_t *h, int n, int i) {
    uint64_t v = h[i];
    for (;;) {
        int c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && h[c + 1] > h[c]) c++;
        if (h[c] <= v) break;
        h[i] = h[c];
        i = c;
    }
    h[i] = v;
}

/* The k smallest keys of a[n] (k <= n), left ascending in a[0..k): a max-heap of the best k
 * so far, whose root is the one to beat; then a heap sort of the survivors. */
static void sampler_select_smallest(uint64_t *a, int n, int k) {
    for (int i = k / 2 - 1; i >= 0; i--)
        heap_sift_down(a, k, i);
    for (int i = k; i < n; i++)
        if (a[i] < a[0]) {
            a[0] = a[i];
            heap_sift_down(a, k, 0);
        }
    for (int end = k - 1; end > 0; end--) {
        uint64_t t = a[0];
        a[0] = a[end];
        a[end] = t;
        heap_sift_down(a, end, 0);
    }
}

/* Probability buckets: the top 12 bits of a probability's float bits (sign, exponent, three
 * mantissa bits), numbered so that bucket 0 holds the largest probability (exactly 1) and
 * numbers grow as probabilities shrink; each spans an eighth of an octave. */
#define SAMPLER_N_BUCKETS 1017 /* 1.0f has bits 0x3f800000, so 0x3f8 + 1 buckets */

static int key_bucket(uint64_t key) { return (int)(key >> 52) - 0xc07; /* 0xfff - 0x3f8 */ }

/* The candidates in descending probability order, materialized lazily. A single counting pass
 * groups them by bucket (stable, so each bucket stays in id order); a bucket is sorted only
 * when a walk has to look inside it, i.e. when a cut point or the draw falls in it. Walks step
 * over whole buckets with their precomputed mass. Every cumulative mass below is therefore
 * "whole-bucket masses in bucket order, then the sorted elements of the bucket being entered",
 * a fixed order of double additions, so the result is still reproducible bit for bit. */
typedef struct sampler_order {
    uint64_t *g;                      /* [n] keys grouped by bucket, bucket 0 first */
    uint64_t *tmp;                    /* [n] scratch for sorting one bucket in place */
    int start[SAMPLER_N_BUCKETS + 1]; /* bucket b is g[start[b] .. start[b + 1]) */
    double mass[SAMPLER_N_BUCKETS];   /* sum of bucket b's probabilities, in input order */
    bool sorted[SAMPLER_N_BUCKETS];   /* bucket b is in final order */
    int cursor[SAMPLER_N_BUCKETS];    /* scatter positions while grouping */
} sampler_order;

/* Building the order takes three steps so that the counting can ride along with the pass
 * that makes the keys: order_reset, order_count for each key, then order_group to scatter
 * keys[n] into g[n] (presorted: keys are already in final order, as the heap leaves them). */
static void order_reset(sampler_order *o) {
    memset(o->start, 0, sizeof o->start);
    memset(o->mass, 0, sizeof o->mass);
}

static inline void order_count(sampler_order *o, uint64_t key, float prob) {
    int b = key_bucket(key);
    o->start[b + 1]++;
    o->mass[b] += prob;
}

static void order_group(sampler_order *o, const uint64_t *keys, int n, uint64_t *g,
                        bool presorted) {
    o->g = g;
    for (int b = 0; b < SAMPLER_N_BUCKETS; b++) {
        o->start[b + 1] += o->start[b];
        o->cursor[b] = o->start[b];
        o->sorted[b] = presorted || o->start[b + 1] - o->start[b] <= 1;
    }
    for (int i = 0; i < n; i++)
        g[o->cursor[key_bucket(keys[i])]++] = keys[i];
}

static void order_sort_bucket(sampler_order *o, int b) {
    if (o->sorted[b]) return;
    uint64_t *a = o->g + o->start[b];
    int c = o->start[b + 1] - o->start[b];
    if (c <= 32) {
        /* Keys are unique (they hold the id), so insertion sort gives the same order. */
        for (int i = 1; i < c; i++) {
            uint64_t v = a[i];
            int j = i;
            for (; j > 0 && a[j - 1] > v; j--)
                a[j] = a[j - 1];
            a[j] = v;
        }
    } else {
        sampler_radix_sort(a, o->tmp + o->start[b], c);
    }
    o->sorted[b] = true;
}

/* Mass of the first lim candidates in final order. */
static double order_prefix_mass(sampler_order *o, int lim) {
    double cum = 0.0;
    for (int b = 0; b < SAMPLER_N_BUCKETS && o->start[b] < lim; b++) {
        if (o->start[b + 1] <= lim) {
            cum += o->mass[b];
            continue;
        }
        order_sort_bucket(o, b);
        for (int i = o->start[b]; i < lim; i++)
            cum += key_prob(o->g[i]);
        break;
    }
    return cum;
}

/* The smallest j in [1, lim] whose prefix mass reaches target (>= target, or > target when
 * strict); lim when none does. If a bucket's mass says the crossing is inside it but the
 * element-wise sum falls short by rounding, the bucket's last element is taken. */
static int order_find_crossing(sampler_order *o, double target, int lim, bool strict) {
    double cum = 0.0;
    for (int b = 0; b < SAMPLER_N_BUCKETS && o->start[b] < lim; b++) {
        int s = o->start[b], e = o->start[b + 1] < lim ? o->start[b + 1] : lim;
        if (s == e) continue;
        if (e == o->start[b + 1]) {
            double next = cum + o->mass[b];
            if (!(strict ? next > target : next >= target)) {
                cum = next;
                continue;
            }
        }
        order_sort_bucket(o, b);
        for (int i = s; i < e; i++) {
            cum += key_prob(o->g[i]);
            if (strict ? cum > target : cum >= target) return i + 1;
        }
        return e;
    }
    return lim;
}

/* How many of the first lim candidates have probability >= min_p (at least 1). Buckets above
 * min_p's bucket are all in, those below all out; inside its bucket the ones that pass would
 * form the sorted prefix, so counting them is enough and nothing needs sorting here. */
static int order_min_p_cut(const sampler_order *o, float min_p, int lim) {
    uint32_t bits;
    memcpy(&bits, &min_p, sizeof bits);
    int bm = 0x3f8 - (int)(bits >> 20);
    if (bm < 0) bm = 0;
    if (bm >= SAMPLER_N_BUCKETS) bm = SAMPLER_N_BUCKETS - 1;
    int cut = o->start[bm];
    for (int i = o->start[bm]; i < o->start[bm + 1]; i++)
        cut += key_prob(o->g[i]) >= min_p;
    if (cut > lim) cut = lim;
    return cut > 1 ? cut : 1;
}

int sampler_sample(const sampling_params *p, float *logits, int V, const int32_t *prompt,
                   int n_prompt, const int32_t *output, int n_output, uint64_t position) {
    MS_ASSERT(p && logits && V > 0);
    sampler_apply_penalties(p, logits, V, prompt, n_prompt, output, n_output);
    for (int i = 0; i < p->n_logit_bias; i++)
        if (p->logit_bias[i].id < V) logits[p->logit_bias[i].id] += p->logit_bias[i].bias;

    float T = p->temperature;
    if (!(T >= SAMPLER_GREEDY_EPS) || p->top_k == 1) return sampler_argmax(logits, V);

    /* Divide (rather than multiply by 1 / T) to round as the reference pipelines do. */
    float m = -INFINITY;
    for (int i = 0; i < V; i++) {
        float x = logits[i] / T;
        logits[i] = x;
        if (x > m) m = x;
    }
    /* All -inf (or NaN), or a +inf: no distribution to normalize; take the argmax. */
    if (!(m > -INFINITY) || m == INFINITY) return sampler_argmax(logits, V);

    int k = p->top_k >= 1 && p->top_k < V ? p->top_k : V;
    bool use_top_p = p->top_p < 1.0f;
    bool use_min_p = p->min_p > 0.0f;
    /* Capped at 1 so that the maximum (e == 1) always survives, even for an unchecked min_p. */
    float floor_e = use_min_p && (!use_top_p || k == V) ? fminf(p->min_p, 1.0f) : 0.0f;
    /* The heap path counts buckets only over its k survivors, after selection. */
    bool heap = k <= SAMPLER_HEAP_MAX_K && k < V;

    sampler_scratch *scratch = scratch_get();
    scratch_reserve_keys(scratch, (size_t)V);
    if (!scratch->order) scratch->order = xmalloc(sizeof *scratch->order);
    sampler_order *o = scratch->order;
    order_reset(o);
    uint64_t *keys = scratch->keys;
    int n = 0;
    double total = 0.0;
    /* Softmax numerators e = exp(x - max): the largest is exactly 1, the rest in [0, 1], their
     * double sum the normalizer. One pass also makes the sort keys of the candidates. */
    for (int i = 0; i < V; i++) {
        float e = expf(logits[i] - m);
        if (!(e > 0.0f)) continue; /* underflow or NaN: weighs nothing, never drawn */
        total += e;
        if (e < floor_e) continue;
        uint64_t key = key_pack(e, i);
        keys[n++] = key;
        if (!heap) order_count(o, key, e);
    }
    MS_ASSERT(n >= 1); /* the maximum has e == 1 and always passes */

    bool presorted = false;
    if (heap) {
        if (k < n) {
            sampler_select_smallest(keys, n, k);
            n = k;
            presorted = true;
        }
        for (int i = 0; i < n; i++)
            order_count(o, keys[i], key_prob(keys[i]));
    }
    order_group(o, keys, n, scratch->tmp, presorted);
    o->tmp = scratch->keys; /* the ungrouped keys are no longer needed */

    int lim = k < n ? k : n;
    if (use_top_p) {
        /* Normalizer: the top-k mass when top-k applies, else the full sum. */
        double norm = k < V ? order_prefix_mass(o, lim) : total;
        lim = order_find_crossing(o, ((double)p->top_p - SAMPLER_TOP_P_SLACK) * norm, lim, false);
    }
    if (use_min_p) lim = order_min_p_cut(o, p->min_p, lim);

    /* Inverse CDF over the kept prefix. */
    double target = sampler_uniform(p->seed, position) * order_prefix_mass(o, lim);
    return key_id(o->g[order_find_crossing(o, target, lim, true) - 1]);
}

void sampler_log_softmax(float *logprobs, const float *logits, int V) {
    MS_ASSERT(logprobs && logits && V > 0);
    float m = -INFINITY;
    int n_max = 0;
    for (int i = 0; i < V; i++) {
        if (logits[i] > m) {
            m = logits[i];
            n_max = 0;
        }
        n_max += logits[i] == m;
    }
    if (!(m > -INFINITY) || m == INFINITY) {
        /* No finite maximum. +inf entries share the mass evenly (the limit of the finite
         * case); everything else, and every entry when all are -inf or NaN, gets -inf. */
        float share = m == INFINITY ? -logf((float)n_max) : -INFINITY;
        for (int i = 0; i < V; i++)
            logprobs[i] = logits[i] == INFINITY ? share : -INFINITY;
        return;
    }
    double sum = 0.0;
    for (int i = 0; i < V; i++) {
        float e = expf(logits[i] - m);
        if (e > 0.0f) sum += e; /* NaN adds nothing */
    }
    /* sum >= 1: the maximum's own term is exp(0) */
    // cppcheck-suppress invalidFunctionArg
    double shift = (double)m + log(sum);
    /* Each output element reads only its own input, which is what makes in-place safe. NaN
     * inputs come out as -inf, matching the weight the sampler gives them. */
    for (int i = 0; i < V; i++)
        logprobs[i] = logits[i] == logits[i] ? (float)((double)logits[i] - shift) : -INFINITY;
}
