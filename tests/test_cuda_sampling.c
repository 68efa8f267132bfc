/* Tests of ops->sample on the CUDA backend (kernels/cuda/sampling.cu) against the host path:
 * runner/sampler.c (sampler_sample, sampler_log_softmax) and the engine's top-N order (descending
 * logprob, ties by id), on random rows: V = 151936 and small V; peaked, normal, flat, quantized
 * (exact ties), all-equal rows and rows with -inf, NaN and +inf; greedy, temperatures, top-k small
 * and large, top-p, min-p, the three penalties over random prompt / output histories, seeds and
 * positions; scored rows with top-N.
 *
 * Tolerances:
 *   - greedy tokens and scored rows' tokens: exact;
 *   - logprobs (of the token, and the top-N values): |gpu - cpu| <= 1e-5 (fp32 exp and log may
 *     differ by ulps; -inf must match);
 *   - top-N ids: exact, except where the CPU's logprobs of the two ids are within 1e-6;
 *   - sampled tokens: the CPU's in at least 99.9% of draws, and every disagreement a boundary case:
 *     an edge of the GPU token's interval in the CPU's cumulative order within 1e-5 of u * kept
 *     mass (relative to the kept mass), or the two tokens' probabilities equal to 5e-7 (an order
 *     flip of equal-looking floats);
 *   - a chi-square test (p = 0.001) that GPU draws of one row over 20,000 positions follow the
 *     CPU's filtered distribution, with no draw outside it.
 * Then the engine on the test checkpoint (tests/data/tiny-qwen3-moe, CUDA): sampling on the device
 * against sampling on the host over the same device logits (e->sample_on_host): the same tokens,
 * logprobs within 1e-5, the same top-N.
 * Then figures: the op's time (cudaEvent) at n = 1, 64, 256 rows of V = 151936 for greedy and for
 * sampled parameters, beside the time to copy those rows to the host and sample them there.
 *
 *   test_cuda_sampling   GPU 0; without CUDA in the build or a usable GPU it prints
 *                        "skipped: <reason>" and "0 passed, 0 failed" */
#include <stdio.h>

#ifdef MOESERVE_CUDA

#include <cuda_runtime.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "common/counter_rng.h"
#include "common/log.h"
#include "kernels/ops.h"
#include "runner/engine.h"
#include "runner/model.h"
#include "runner/sampler.h"
#include "tests/check.h"

/* The CUDA backend's stream (kernels/cuda/ops_cuda.cu); the timings record events on it. */
cudaStream_t cuda_stream(void);

static const ops *gpu;

#define LP_TOL       1e-5
#define TIE_TOL      1e-6
#define BOUNDARY_TOL 1e-5
#define SWAP_TOL     5e-7
#define TOPN         8
#define QWEN_V       151936

/* ---- random numbers ---- */

static uint64_t rng_state = 0x5eed5a3b1e2c0ffeull;

static uint64_t rng_next(void) {
    return counter_rng_splitmix64(rng_state += 0x9e3779b97f4a7c15ull);
}
static double rng_uniform(void) { return (double)(rng_next() >> 11) / 9007199254740992.0; }
static int rng_int(int n) { return (int)(rng_next() % (uint64_t)n); }
static double rng_normal(void) {
    double u1 = rng_uniform(), u2 = rng_uniform();
    return sqrt(-2.0 * log(u1 + 1e-300)) * cos(2.0 * M_PI * u2);
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

enum {
    ROW_NORMAL,
    ROW_PEAKED,
    ROW_FLAT,
    ROW_QUANT,
    ROW_EQUAL,
    ROW_NEGINF,
    ROW_POSINF,
    N_ROW_KINDS
};
static const char *row_kind_name[] = {"normal", "peaked",   "flat", "quantized",
                                      "equal",  "-inf/NaN", "+inf"};

static void make_row(float *x, int V, int kind) {
    switch (kind) {
    case ROW_NORMAL:
        for (int i = 0; i < V; i++)
            x[i] = (float)(2.5 * rng_normal());
        break;
    case ROW_PEAKED:
        for (int i = 0; i < V; i++)
            x[i] = (float)rng_normal();
        for (int s = 0; s < 1 + V / 4000 && s < 40; s++)
            x[rng_int(V)] = (float)(9.0 + 2.0 * rng_normal());
        break;
    case ROW_FLAT:
        for (int i = 0; i < V; i++)
            x[i] = (float)(1e-3 * rng_uniform());
        break;
    case ROW_QUANT:
        for (int i = 0; i < V; i++)
            x[i] = (float)(0.5 * round(4.0 * rng_normal()));
        break;
    case ROW_EQUAL:
        for (int i = 0; i < V; i++)
            x[i] = 1.25f;
        break;
    case ROW_NEGINF:
        for (int i = 0; i < V; i++)
            x[i] = rng_int(5) == 0 ? -INFINITY : (float)(2.0 * rng_normal());
        x[rng_int(V)] = NAN;
        break;
    case ROW_POSINF:
        for (int i = 0; i < V; i++)
            x[i] = (float)rng_normal();
        x[rng_int(V)] = INFINITY;
        x[rng_int(V)] = INFINITY;
        break;
    }
}

/* ---- one test case: a row, what to do with it, and the CPU's answers ---- */

typedef struct {
    int V, kind;
    float *x; /* [V] */
    sample_row row;
    sampling_params sp;
    int32_t *prompt, *output;
    int n_prompt, n_output;
    sample_penalty *pen;
    int n_pen;
    sampler_bias *bias; /* sp.logit_bias */
    int n_bias;
    /* the CPU */
    int32_t cpu_tok;
    float cpu_lp;
    int32_t cpu_top_ids[TOPN];
    float cpu_top_lps[TOPN];
    float *cpu_xT;  /* sampler_sample's scratch afterwards: the penalized row / T (draws) */
    float *cpu_lps; /* [V] log_softmax of the row (freed after checking) */
    /* the GPU */
    int32_t gpu_tok;
    float gpu_lp;
    int32_t gpu_top_ids[TOPN];
    float gpu_top_lps[TOPN];
} tcase;

static bool case_greedy(const tcase *c) {
    return !(c->sp.temperature >= SAMPLER_GREEDY_EPS) || c->sp.top_k == 1;
}

/* The penalty list as ops->sample wants it, built independently of the engine: counts over the
 * outputs, then every prompt id when the repetition penalty is on. */
static void case_penalties(tcase *c) {
    int V = c->V;
    bool rep = c->sp.repetition_penalty != 1.0f;
    bool out = c->sp.frequency_penalty != 0.0f || c->sp.presence_penalty != 0.0f;
    c->pen = xmalloc((size_t)(c->n_prompt + c->n_output + 1) * sizeof *c->pen);
    c->n_pen = 0;
    if (!rep && !out) return;
    int32_t *cnt = xcalloc((size_t)V, sizeof *cnt);
    uint8_t *seen = xcalloc((size_t)V, 1);
    for (int i = 0; i < c->n_output; i++)
        cnt[c->output[i]]++;
    for (int i = 0; i < c->n_output; i++) {
        int32_t id = c->output[i];
        if (seen[id]) continue;
        seen[id] = 1;
        c->pen[c->n_pen++] = (sample_penalty){.id = id, .count = cnt[id]};
    }
    for (int i = 0; rep && i < c->n_prompt; i++) {
        int32_t id = c->prompt[i];
        if (seen[id]) continue;
        seen[id] = 1;
        c->pen[c->n_pen++] = (sample_penalty){.id = id, .count = 0};
    }
    free(cnt);
    free(seen);
}

static const float temps[] = {0.0f, 0.5f, 1.0f, 1.7f};
static const int topks[] = {-1, -1, 1, 2, 20, 300, 5000};
static const float topps[] = {1.0f, 1.0f, 0.95f, 0.7f, 0.2f};
static const float minps[] = {0.0f, 0.0f, 0.02f, 0.3f};
static const float reps[] = {1.0f, 1.0f, 1.3f, 0.7f};
static const float freqs[] = {0.0f, 0.0f, 0.6f, -0.5f};
static const float press[] = {0.0f, 0.0f, 0.4f, -0.3f};
#define PICK(a) a[rng_int((int)(sizeof a / sizeof a[0]))]

static void case_init(tcase *c, int V, int kind, bool score) {
    memset(c, 0, sizeof *c);
    c->V = V;
    c->kind = kind;
    c->x = xmalloc((size_t)V * sizeof(float));
    make_row(c->x, V, kind);
    sampling_params sp = sampling_params_default();
    sp.temperature = PICK(temps);
    sp.top_k = PICK(topks);
    sp.top_p = PICK(topps);
    sp.min_p = PICK(minps);
    sp.repetition_penalty = PICK(reps);
    sp.frequency_penalty = PICK(freqs);
    sp.presence_penalty = PICK(press);
    sp.seed = rng_next();
    c->sp = sp;
    /* histories: ids from a small pool so that they repeat */
    int pool = V < 64 ? V : 64 + rng_int(V - 63);
    c->n_prompt = rng_int(300);
    c->n_output = rng_int(3) == 0 ? 0 : rng_int(120);
    c->prompt = xmalloc((size_t)(c->n_prompt + 1) * sizeof(int32_t));
    c->output = xmalloc((size_t)(c->n_output + 1) * sizeof(int32_t));
    for (int i = 0; i < c->n_prompt; i++)
        c->prompt[i] = rng_int(pool);
    for (int i = 0; i < c->n_output; i++)
        c->output[i] = rng_int(pool);
    case_penalties(c);
    /* a logit bias on a third of the draws: distinct ids, some of them among the penalized ones
     * (the bias goes after the penalties) and some at +-100, which decide a greedy pick */
    c->bias = xmalloc(40 * sizeof *c->bias);
    if (!score && rng_int(3) == 0) {
        int want = 1 + rng_int(40 < V ? 40 : V);
        for (int k = 0; k < want; k++) {
            int32_t id = k < c->n_pen && rng_int(2) ? c->pen[k].id : rng_int(V);
            bool dup = false;
            for (int j = 0; j < c->n_bias; j++)
                dup |= c->bias[j].id == id;
            if (dup) continue;
            float b = rng_int(8) == 0 ? (rng_int(2) ? 100.0f : -100.0f)
                                      : (float)(rng_uniform() * 20.0 - 10.0);
            c->bias[c->n_bias++] = (sampler_bias){.id = id, .bias = b};
        }
        c->sp.logit_bias = c->bias;
        c->sp.n_logit_bias = c->n_bias;
    }
    uint64_t position = (uint64_t)(c->n_prompt + c->n_output) + rng_next() % 1000;
    int top_n = rng_int(3) == 0 ? 0 : 1 + rng_int(TOPN);
    if (score) {
        c->row = (sample_row){
            .mode = SAMPLE_SCORE, .target = rng_int(V), .want_logprob = 1, .top_n = top_n};
        c->n_pen = 0;
    } else {
        c->row = (sample_row){.seed = sp.seed,
                              .position = position,
                              .temperature = sp.temperature,
                              .top_p = sp.top_p,
                              .min_p = sp.min_p,
                              .top_k = sp.top_k,
                              .repetition_penalty = sp.repetition_penalty,
                              .frequency_penalty = sp.frequency_penalty,
                              .presence_penalty = sp.presence_penalty,
                              .mode = SAMPLE_DRAW,
                              .target = -1,
                              .n_pen = c->n_pen,
                              .want_logprob = rng_int(2),
                              .top_n = top_n,
                              .n_bias = c->n_bias};
    }
}

static void case_free(tcase *c) {
    free(c->x);
    free(c->prompt);
    free(c->output);
    free(c->pen);
    free(c->bias);
    free(c->cpu_xT);
    free(c->cpu_lps);
}

/* The N largest of lp[V], descending, ties by id (the engine's top_n_select order). */
static void ref_top_n(int32_t *ids, float *vals, const float *lp, int V, int N) {
    if (N > V) N = V;
    int n = 0;
    for (int i = 0; i < V; i++) {
        float v = lp[i];
        if (n == N && !(v > vals[N - 1])) continue; /* ascending ids: a tie loses */
        int j = n < N ? n++ : N - 1;
        for (; j > 0 && v > vals[j - 1]; j--) {
            vals[j] = vals[j - 1];
            ids[j] = ids[j - 1];
        }
        vals[j] = v;
        ids[j] = i;
    }
}

static void case_cpu(tcase *c) {
    int V = c->V;
    c->cpu_lps = xmalloc((size_t)V * sizeof(float));
    sampler_log_softmax(c->cpu_lps, c->x, V);
    if (c->row.top_n > 0) ref_top_n(c->cpu_top_ids, c->cpu_top_lps, c->cpu_lps, V, c->row.top_n);
    if (c->row.mode == SAMPLE_SCORE) {
        c->cpu_tok = c->row.target;
        c->cpu_lp = c->cpu_lps[c->row.target];
        return;
    }
    c->cpu_xT = xmalloc((size_t)V * sizeof(float));
    memcpy(c->cpu_xT, c->x, (size_t)V * sizeof(float));
    c->cpu_tok = sampler_sample(&c->sp, c->cpu_xT, V, c->prompt, c->n_prompt, c->output,
                                c->n_output, c->row.position);
    c->cpu_lp = c->row.want_logprob ? c->cpu_lps[c->cpu_tok] : NAN;
}

/* ---- where a GPU draw that differs from the CPU's sits in the CPU's order ---- */

typedef struct {
    float e;
    int id;
} ref_entry;

static int ref_cmp(const void *a, const void *b) {
    const ref_entry *x = a, *y = b;
    if (x->e != y->e) return x->e > y->e ? -1 : 1;
    return (x->id > y->id) - (x->id < y->id);
}

/* The CPU's filtered order of a draw over xT[V] (penalized logits / T): order[0 .. *n) by
 * descending e, *lim kept, *kept their mass, the draw's target u * kept. Returns the entries
 * (caller frees). */
static ref_entry *ref_order(const float *xT, int V, const sampling_params *p, uint64_t position,
                            int *n_out, int *lim_out, double *kept_out, double *target_out) {
    float m = -INFINITY;
    for (int i = 0; i < V; i++)
        if (xT[i] > m) m = xT[i];
    ref_entry *o = xmalloc((size_t)V * sizeof *o);
    int n = 0;
    double total = 0.0;
    for (int i = 0; i < V; i++) {
        float e = expf(xT[i] - m);
        if (!(e > 0.0f)) continue;
        total += e;
        o[n++] = (ref_entry){e, i};
    }
    qsort(o, (size_t)n, sizeof *o, ref_cmp);
    int k = p->top_k >= 1 && p->top_k < V ? p->top_k : V;
    int lim = k < n ? k : n;
    if (p->top_p < 1.0f) {
        double norm = 0.0, cum = 0.0;
        if (k < V)
            for (int i = 0; i < lim; i++)
                norm += o[i].e;
        else
            norm = total;
        for (int i = 0; i < lim; i++) {
            cum += o[i].e;
            if (cum >= ((double)p->top_p - 1e-6) * norm) {
                lim = i + 1;
                break;
            }
        }
    }
    if (p->min_p > 0.0f) {
        int c = 0;
        while (c < lim && o[c].e >= p->min_p)
            c++;
        lim = c > 1 ? c : 1;
    }
    double kept = 0.0;
    for (int i = 0; i < lim; i++)
        kept += o[i].e;
    *n_out = n;
    *lim_out = lim;
    *kept_out = kept;
    *target_out = sampler_uniform(p->seed, position) * kept;
    return o;
}

/* How far (relative to the kept mass) u * kept is from the nearest edge of gpu_tok's interval in
 * the CPU's order; whether the two tokens' e are equal to SWAP_TOL. */
static double draw_boundary(const tcase *c, int gpu_tok, bool *swap) {
    int n, lim;
    double kept, target;
    ref_entry *o = ref_order(c->cpu_xT, c->V, &c->sp, c->row.position, &n, &lim, &kept, &target);
    double cum = 0.0, dist = INFINITY;
    float eg = -1.0f, ec = -1.0f;
    for (int i = 0; i < n; i++) {
        if (o[i].id == gpu_tok) {
            eg = o[i].e;
            dist = fmin(fabs(cum - target), fabs(cum + o[i].e - target)) / kept;
        }
        if (o[i].id == c->cpu_tok) ec = o[i].e;
        cum += o[i].e;
    }
    *swap = eg > 0.0f && ec > 0.0f && fabs((double)eg - ec) <= SWAP_TOL * ec;
    free(o);
    return dist;
}

/* ---- running cases on the GPU and comparing ---- */

typedef struct {
    long n_greedy, bad_greedy, n_score, bad_score, n_draw, draw_diff, draw_unexplained, swaps;
    long n_lp, bad_lp, n_top, bad_top_id, bad_top_lp;
    double worst_lp, worst_boundary;
    int printed;
} tstats;

static bool lp_close(float g, float c, double *err) {
    if (isinf(c) || isinf(g)) {
        *err = g == c ? 0.0 : INFINITY;
        return g == c;
    }
    if (isnan(c) || isnan(g)) {
        *err = isnan(c) && isnan(g) ? 0.0 : INFINITY;
        return isnan(c) && isnan(g);
    }
    *err = fabs((double)g - c);
    return *err <= LP_TOL;
}

#define REPORT(st, ...)                                                                            \
    do {                                                                                           \
        if ((st)->printed++ < 12) {                                                                \
            fprintf(stderr, "  mismatch: ");                                                       \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fprintf(stderr, "\n");                                                                 \
        }                                                                                          \
    } while (0)

/* Runs cases[n] (one V) through ops->sample in one call, the CPU on each, and compares. */
static void run_cases(tcase *cs, int n, tstats *st) {
    int V = cs[0].V;
    size_t n_pen = 0, n_bias = 0;
    for (int i = 0; i < n; i++) {
        cs[i].row.pen_start = (int32_t)n_pen;
        n_pen += (size_t)cs[i].n_pen;
        cs[i].row.bias_start = (int32_t)n_bias;
        n_bias += (size_t)cs[i].n_bias;
    }
    float *hx = xmalloc((size_t)n * V * sizeof(float));
    sample_row *hr = xmalloc((size_t)n * sizeof *hr);
    sample_penalty *hp = xmalloc((n_pen + 1) * sizeof *hp);
    sample_bias *hb = xmalloc((n_bias + 1) * sizeof *hb);
    for (int i = 0, k = 0, kb = 0; i < n; i++) {
        memcpy(hx + (size_t)i * V, cs[i].x, (size_t)V * sizeof(float));
        hr[i] = cs[i].row;
        memcpy(hp + k, cs[i].pen, (size_t)cs[i].n_pen * sizeof *hp);
        k += cs[i].n_pen;
        for (int j = 0; j < cs[i].n_bias; j++)
            hb[kb++] = (sample_bias){.id = cs[i].bias[j].id, .bias = cs[i].bias[j].bias};
    }
    float *dx = gpu->dev_alloc((size_t)n * V * sizeof(float));
    sample_row *dr = gpu->dev_alloc((size_t)n * sizeof *dr);
    sample_penalty *dp = gpu->dev_alloc((n_pen + 1) * sizeof *dp);
    sample_bias *db = gpu->dev_alloc((n_bias + 1) * sizeof *db);
    int32_t *dtok = gpu->dev_alloc((size_t)n * sizeof(int32_t));
    float *dlp = gpu->dev_alloc((size_t)n * sizeof(float));
    int32_t *dtid = gpu->dev_alloc((size_t)n * TOPN * sizeof(int32_t));
    float *dtlp = gpu->dev_alloc((size_t)n * TOPN * sizeof(float));
    MS_ASSERT(dx && dr && dp && db && dtok && dlp && dtid && dtlp);
    gpu->to_device(dx, hx, (size_t)n * V * sizeof(float));
    gpu->to_device(dr, hr, (size_t)n * sizeof *dr);
    gpu->to_device(dp, hp, (n_pen + 1) * sizeof *dp);
    gpu->to_device(db, hb, (n_bias + 1) * sizeof *db);
    gpu->dev_zero(dtid, (size_t)n * TOPN * sizeof(int32_t));
    gpu->sample(dtok, dlp, dtid, dtlp, dx, dr, dp, db, n, V, TOPN);
    int32_t *htok = xmalloc((size_t)n * sizeof(int32_t)), *htid = xmalloc((size_t)n * TOPN * 4);
    float *hlp = xmalloc((size_t)n * sizeof(float)), *htlp = xmalloc((size_t)n * TOPN * 4);
    gpu->to_host(htok, dtok, (size_t)n * sizeof(int32_t));
    gpu->to_host(hlp, dlp, (size_t)n * sizeof(float));
    gpu->to_host(htid, dtid, (size_t)n * TOPN * sizeof(int32_t));
    gpu->to_host(htlp, dtlp, (size_t)n * TOPN * sizeof(float));
    for (int i = 0; i < n; i++) {
        cs[i].gpu_tok = htok[i];
        cs[i].gpu_lp = hlp[i];
        memcpy(cs[i].gpu_top_ids, htid + (size_t)i * TOPN, TOPN * sizeof(int32_t));
        memcpy(cs[i].gpu_top_lps, htlp + (size_t)i * TOPN, TOPN * sizeof(float));
    }
    void *dev[] = {dx, dr, dp, db, dtok, dlp, dtid, dtlp};
    for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++)
        gpu->dev_free(dev[i]);
    free(hx);
    free(hr);
    free(hp);
    free(hb);
    free(htok);
    free(hlp);
    free(htid);
    free(htlp);

#pragma omp parallel for schedule(dynamic, 1)
    for (int i = 0; i < n; i++)
        case_cpu(&cs[i]);

    for (int i = 0; i < n; i++) {
        tcase *c = &cs[i];
        const char *kn = row_kind_name[c->kind];
        double err;
        /* the token */
        if (c->row.mode == SAMPLE_SCORE) {
            st->n_score++;
            if (c->gpu_tok != c->cpu_tok) {
                st->bad_score++;
                REPORT(st, "V %d %s: scored row says token %d, want %d", V, kn, c->gpu_tok,
                       c->cpu_tok);
            }
        } else if (case_greedy(c)) {
            st->n_greedy++;
            if (c->gpu_tok != c->cpu_tok) {
                st->bad_greedy++;
                REPORT(st, "V %d %s greedy (T %g, top_k %d, rp %g fp %g pp %g): %d, want %d", V, kn,
                       c->sp.temperature, c->sp.top_k, c->sp.repetition_penalty,
                       c->sp.frequency_penalty, c->sp.presence_penalty, c->gpu_tok, c->cpu_tok);
            }
        } else {
            st->n_draw++;
            if (c->gpu_tok != c->cpu_tok) {
                st->draw_diff++;
                bool swap = false;
                double d = (c->gpu_tok >= 0 && c->gpu_tok < V) ? draw_boundary(c, c->gpu_tok, &swap)
                                                               : INFINITY;
                if (swap) st->swaps++;
                if (d > st->worst_boundary && !swap) st->worst_boundary = d;
                if (!(d <= BOUNDARY_TOL) && !swap) {
                    st->draw_unexplained++;
                    REPORT(st,
                           "V %d %s draw (T %g, top_k %d, top_p %g, min_p %g, rp %g fp %g pp %g, "
                           "%d penalty ids, pos %llu): %d, want %d, %.3g of the kept mass from "
                           "the token's edge",
                           V, kn, c->sp.temperature, c->sp.top_k, c->sp.top_p, c->sp.min_p,
                           c->sp.repetition_penalty, c->sp.frequency_penalty,
                           c->sp.presence_penalty, c->n_pen, (unsigned long long)c->row.position,
                           c->gpu_tok, c->cpu_tok, d);
                }
            }
        }
        /* its logprob (the CPU's at the GPU's token, so that a boundary draw still compares) */
        if (c->row.mode == SAMPLE_SCORE || c->row.want_logprob) {
            float want = (c->gpu_tok >= 0 && c->gpu_tok < V) ? c->cpu_lps[c->gpu_tok] : NAN;
            st->n_lp++;
            if (!lp_close(c->gpu_lp, want, &err)) {
                st->bad_lp++;
                REPORT(st, "V %d %s: logprob of %d is %.9g, want %.9g", V, kn, c->gpu_tok,
                       c->gpu_lp, want);
            }
            if (err > st->worst_lp && isfinite(err)) st->worst_lp = err;
        } else if (!isnan(c->gpu_lp)) {
            st->bad_lp++;
            REPORT(st, "V %d %s: logprob %g where none was wanted (NaN)", V, kn, c->gpu_lp);
        }
        /* top-N */
        int nt = c->row.top_n < V ? c->row.top_n : V;
        for (int k = 0; k < nt; k++) {
            int32_t g = c->gpu_top_ids[k], w = c->cpu_top_ids[k];
            st->n_top++;
            bool id_ok = g == w || (g >= 0 && g < V &&
                                    (fabsf(c->cpu_lps[g] - c->cpu_lps[w]) <= TIE_TOL ||
                                     c->cpu_lps[g] == c->cpu_lps[w]));
            if (!id_ok) {
                st->bad_top_id++;
                REPORT(st, "V %d %s: top-%d entry %d is id %d (cpu logprob %.9g), want %d (%.9g)",
                       V, kn, nt, k, g, g >= 0 && g < V ? c->cpu_lps[g] : NAN, w, c->cpu_lps[w]);
            }
            if (!lp_close(c->gpu_top_lps[k], c->cpu_top_lps[k], &err)) {
                st->bad_top_lp++;
                REPORT(st, "V %d %s: top-%d entry %d logprob %.9g, want %.9g", V, kn, nt, k,
                       c->gpu_top_lps[k], c->cpu_top_lps[k]);
            }
            if (err > st->worst_lp && isfinite(err)) st->worst_lp = err;
        }
    }
}

static void test_rows(void) {
    tstats st = {0};
    static const int vs[] = {QWEN_V, 5000, 2051, 257, 7, 1};
    static const int per_v[] = {96, 400, 400, 400, 300, 60};
    const int batch = 64;
    for (size_t vi = 0; vi < sizeof vs / sizeof vs[0]; vi++) {
        int V = vs[vi];
        for (int done = 0; done < per_v[vi]; done += batch) {
            int n = per_v[vi] - done < batch ? per_v[vi] - done : batch;
            tcase *cs = xmalloc((size_t)n * sizeof *cs);
            for (int i = 0; i < n; i++) {
                int kind = rng_int(N_ROW_KINDS);
                /* mostly the common kinds; the rest keep every path visited */
                if (rng_int(3) != 0) kind = rng_int(2) ? ROW_NORMAL : ROW_PEAKED;
                case_init(&cs[i], V, kind, rng_int(5) == 0);
            }
            run_cases(cs, n, &st);
            for (int i = 0; i < n; i++)
                case_free(&cs[i]);
            free(cs);
        }
    }
    printf("rows: %ld greedy, %ld scored, %ld drawn (%ld differ from the CPU, %ld of them "
           "unexplained, %ld equal-probability swaps; worst boundary distance %.3g), %ld logprobs, "
           "%ld top-N entries; worst logprob error %.3g (tolerance %g)\n",
           st.n_greedy, st.n_score, st.n_draw, st.draw_diff, st.draw_unexplained, st.swaps,
           st.worst_boundary, st.n_lp, st.n_top, st.worst_lp, LP_TOL);
    CHECK(st.bad_greedy == 0, "%ld of %ld greedy tokens differ", st.bad_greedy, st.n_greedy);
    CHECK(st.bad_score == 0, "%ld of %ld scored rows' tokens differ", st.bad_score, st.n_score);
    CHECK(st.bad_lp == 0, "%ld of %ld logprobs off by more than %g", st.bad_lp, st.n_lp, LP_TOL);
    CHECK(st.bad_top_id == 0, "%ld of %ld top-N ids differ", st.bad_top_id, st.n_top);
    CHECK(st.bad_top_lp == 0, "%ld of %ld top-N logprobs off", st.bad_top_lp, st.n_top);
    CHECK(st.draw_unexplained == 0, "%ld drawn tokens differ from the CPU's off any boundary",
          st.draw_unexplained);
    CHECK((double)st.draw_diff <= 1e-3 * (double)st.n_draw, "%ld of %ld draws differ (> 0.1%%)",
          st.draw_diff, st.n_draw);
}

/* ---- the distribution of one row's draws over 20,000 positions ---- */

/* Upper critical value of chi-square with df degrees of freedom at p = 0.001 (Wilson-Hilferty). */
static double chi2_crit(int df) {
    double z = 3.0902, a = 2.0 / (9.0 * df);
    double t = 1.0 - a + z * sqrt(a);
    return df * t * t * t;
}

static void test_chi_square(void) {
    const int V = QWEN_V, draws = 20000, chunk = 2000;
    float *x = xmalloc((size_t)V * sizeof(float));
    make_row(x, V, ROW_PEAKED);
    for (int s = 0; s < 60; s++) /* more spikes: a few dozen tokens carry the mass */
        x[rng_int(V)] = (float)(7.0 + 1.5 * rng_normal());
    sampling_params sp = sampling_params_default();
    sp.temperature = 0.9f;
    sp.top_k = 100;
    sp.top_p = 0.95f;
    sp.min_p = 0.001f;
    sp.seed = 20250131;
    /* the CPU's filtered distribution */
    float *xT = xmalloc((size_t)V * sizeof(float));
    memcpy(xT, x, (size_t)V * sizeof(float));
    sampler_sample(&sp, xT, V, NULL, 0, NULL, 0, 0); /* leaves xT = x / T */
    int n, lim;
    double kept, target;
    ref_entry *o = ref_order(xT, V, &sp, 0, &n, &lim, &kept, &target);
    int *slot = xmalloc((size_t)V * sizeof(int));
    for (int i = 0; i < V; i++)
        slot[i] = -1;
    for (int i = 0; i < lim; i++)
        slot[o[i].id] = i;

    float *dx = gpu->dev_alloc((size_t)chunk * V * sizeof(float));
    sample_row *dr = gpu->dev_alloc((size_t)chunk * sizeof *dr);
    int32_t *dtok = gpu->dev_alloc((size_t)chunk * sizeof(int32_t));
    float *dlp = gpu->dev_alloc((size_t)chunk * sizeof(float));
    MS_ASSERT(dx && dr && dtok && dlp);
    for (int i = 0; i < chunk; i++)
        gpu->to_device(dx + (size_t)i * V, x, (size_t)V * sizeof(float));
    sample_row *hr = xmalloc((size_t)chunk * sizeof *hr);
    int32_t *tok = xmalloc((size_t)draws * sizeof(int32_t));
    for (int c0 = 0; c0 < draws; c0 += chunk) {
        for (int i = 0; i < chunk; i++)
            hr[i] = (sample_row){.seed = sp.seed,
                                 .position = (uint64_t)(c0 + i),
                                 .temperature = sp.temperature,
                                 .top_p = sp.top_p,
                                 .min_p = sp.min_p,
                                 .top_k = sp.top_k,
                                 .repetition_penalty = 1.0f,
                                 .mode = SAMPLE_DRAW};
        gpu->to_device(dr, hr, (size_t)chunk * sizeof *hr);
        gpu->sample(dtok, dlp, NULL, NULL, dx, dr, NULL, NULL, chunk, V, 0);
        gpu->to_host(tok + c0, dtok, (size_t)chunk * sizeof(int32_t));
    }
    /* the CPU's draws at the same positions */
    long agree = 0;
#pragma omp parallel
    {
        float *buf = xmalloc((size_t)V * sizeof(float));
#pragma omp for reduction(+ : agree) schedule(static)
        for (int i = 0; i < draws; i++) {
            memcpy(buf, x, (size_t)V * sizeof(float));
            agree += sampler_sample(&sp, buf, V, NULL, 0, NULL, 0, (uint64_t)i) == tok[i];
        }
        free(buf);
    }
    sampler_scratch_free();
    /* chi-square over the kept tokens with expected counts >= 5, the rest of the kept set pooled */
    long *count = xcalloc((size_t)lim + 1, sizeof(long));
    long outside = 0;
    for (int i = 0; i < draws; i++) {
        int s = tok[i] >= 0 && tok[i] < V ? slot[tok[i]] : -1;
        if (s < 0)
            outside++;
        else
            count[s]++;
    }
    double chi2 = 0.0, pooled_exp = 0.0;
    long pooled_obs = 0;
    int bins = 0;
    for (int i = 0; i < lim; i++) {
        double ex = draws * o[i].e / kept;
        if (ex >= 5.0) {
            chi2 += (count[i] - ex) * (count[i] - ex) / ex;
            bins++;
        } else {
            pooled_exp += ex;
            pooled_obs += count[i];
        }
    }
    if (pooled_exp >= 5.0) {
        chi2 += (pooled_obs - pooled_exp) * (pooled_obs - pooled_exp) / pooled_exp;
        bins++;
    }
    int df = bins > 1 ? bins - 1 : 1;
    printf("chi-square: %d kept tokens, %d bins, chi2 %.1f (df %d, p = 0.001 bound %.1f), %ld of "
           "%d draws outside the kept set, %ld of %d equal to the CPU's draws\n",
           lim, bins, chi2, df, chi2_crit(df), outside, draws, agree, draws);
    CHECK(bins >= 5, "the test row kept too few tokens (%d bins)", bins);
    CHECK(chi2 <= chi2_crit(df), "chi2 %.1f over %d bins exceeds %.1f", chi2, bins, chi2_crit(df));
    CHECK(outside == 0, "%ld draws outside the kept set", outside);
    CHECK(agree >= (long)(0.999 * draws), "only %ld of %d draws equal the CPU's", agree, draws);
    void *dev[] = {dx, dr, dtok, dlp};
    for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++)
        gpu->dev_free(dev[i]);
    free(x);
    free(xT);
    free(o);
    free(slot);
    free(hr);
    free(tok);
    free(count);
}

/* ---- the engine: device sampling against host sampling over the same device logits ---- */

typedef struct {
    int32_t *ids;
    float *lps, *in_lps;
    int32_t *top_ids, *in_top_ids;
    float *top_lps, *in_top_lps;
    int n_out, n_in;
    finish_kind finish;
} run_out;

static void engine_run(engine *e, const gen_request *reqs, int n, int top_n, run_out *outs) {
    const model_config *c = &e->m->cfg;
    int S = e->kv.page_size, max_pages = (c->max_position_embeddings + S - 1) / S;
    engine_seq *seqs = xcalloc((size_t)n, sizeof *seqs);
    engine_seq **batch = xcalloc((size_t)n, sizeof *batch);
    int32_t *table = xcalloc((size_t)n * max_pages, sizeof(int32_t));
    for (int i = 0; i < n; i++) {
        const gen_request *q = &reqs[i];
        run_out *r = &outs[i];
        engine_seq *s = &seqs[i];
        size_t M = (size_t)q->max_new_tokens + 1, P = (size_t)q->n_prompt;
        memset(r, 0, sizeof *r);
        r->ids = xcalloc(M, sizeof(int32_t));
        r->lps = xcalloc(M, sizeof(float));
        r->top_ids = xcalloc(M * top_n + 1, sizeof(int32_t));
        r->top_lps = xcalloc(M * top_n + 1, sizeof(float));
        r->in_lps = xcalloc(P, sizeof(float));
        r->in_top_ids = xcalloc(P * top_n + 1, sizeof(int32_t));
        r->in_top_lps = xcalloc(P * top_n + 1, sizeof(float));
        engine_seq_init(s, q, top_n);
        s->slot = i;
        s->pages = table + (size_t)i * max_pages;
        s->out_ids = r->ids;
        s->out_logprobs = q->return_logprob ? r->lps : NULL;
        s->out_top_ids = top_n > 0 ? r->top_ids : NULL;
        s->out_top_logprobs = top_n > 0 ? r->top_lps : NULL;
        if (q->return_logprob && q->logprob_start_len >= 0) {
            s->in_logprobs = r->in_lps;
            s->in_top_ids = top_n > 0 ? r->in_top_ids : NULL;
            s->in_top_logprobs = top_n > 0 ? r->in_top_lps : NULL;
        }
    }
    char err[256];
    for (;;) {
        int nb = engine_plan_step(e, seqs, n, batch, err, sizeof err);
        MS_ASSERT(nb >= 0);
        if (nb == 0) break;
        MS_ASSERT(engine_step(e, batch, nb, table, max_pages) >= 0);
    }
    for (int i = 0; i < n; i++) {
        engine_seq *s = &seqs[i];
        for (int j = 0; j < s->n_pages; j++)
            kv_cache_release_page(&e->kv, s->pages[j]);
        outs[i].n_out = s->n_out;
        outs[i].n_in = engine_seq_n_in(s);
        outs[i].finish = s->finish;
        engine_seq_free(s);
    }
    free(seqs);
    free(batch);
    free(table);
}

static void run_out_free(run_out *r) {
    free(r->ids);
    free(r->lps);
    free(r->in_lps);
    free(r->top_ids);
    free(r->top_lps);
    free(r->in_top_ids);
    free(r->in_top_lps);
}

static void test_engine(void) {
    const char *dir = "tests/data/tiny-qwen3-moe";
    struct stat sb;
    if (stat(dir, &sb) != 0) {
        printf("engine: skipped (%s not found; run from the repository root)\n", dir);
        return;
    }
    char err[256];
    model *m = model_load(dir, gpu, err, sizeof err);
    CHECK(m != NULL, "loading %s: %s", dir, err);
    if (!m) return;
    int V = m->cfg.vocab_size;
    enum { NREQ = 5, TOP = 5 };
    int32_t prompts[NREQ][40];
    int lens[NREQ] = {37, 12, 25, 9, 30};
    for (int i = 0; i < NREQ; i++)
        for (int j = 0; j < lens[i]; j++)
            prompts[i][j] = rng_int(V - 1);
    gen_request reqs[NREQ];
    for (int i = 0; i < NREQ; i++)
        reqs[i] = (gen_request){.prompt = prompts[i],
                                .n_prompt = lens[i],
                                .sampling = sampling_params_default(),
                                .max_new_tokens = 16,
                                .ignore_eos = true,
                                .return_logprob = true,
                                .logprob_start_len = -1};
    reqs[0].sampling.temperature = 0.0f; /* greedy, every prompt position scored */
    reqs[0].logprob_start_len = 0;
    reqs[1].sampling.top_p = 0.9f; /* temperature 1 */
    reqs[1].sampling.seed = 7;
    reqs[2].sampling = (sampling_params){.temperature = 0.8f,
                                         .top_p = 0.95f,
                                         .top_k = 20,
                                         .min_p = 0.02f,
                                         .repetition_penalty = 1.3f,
                                         .frequency_penalty = 0.5f,
                                         .presence_penalty = 0.3f,
                                         .seed = 11};
    reqs[2].logprob_start_len = 5;
    /* logit bias: on the penalized draws (ids the penalties also move, so the order of the two
     * counts), and +100 on one token of a draw at temperature 1.3, which then takes it */
    sampler_bias bias2[] = {{prompts[2][0], 3.5f}, {prompts[2][1], -2.0f}, {7, 1.25f}};
    reqs[2].sampling.logit_bias = bias2;
    reqs[2].sampling.n_logit_bias = 3;
    sampler_bias bias4[] = {{prompts[4][3], 100.0f}};
    reqs[4].sampling.logit_bias = bias4;
    reqs[4].sampling.n_logit_bias = 1;
    reqs[3].max_new_tokens = 0; /* scores its prompt only */
    reqs[3].logprob_start_len = 2;
    reqs[4].sampling.temperature = 1.3f; /* no logprobs */
    reqs[4].sampling.seed = 99;
    reqs[4].return_logprob = false;
    run_out host[NREQ], dev[NREQ];
    for (int mode = 0; mode < 2; mode++) {
        engine e;
        if (engine_init(&e, m, 64, 16, 16, 0, err,
                        sizeof err)) { /* 16-token chunks: prompts span steps */
            CHECK(0, "engine_init: %s", err);
            model_free(m);
            return;
        }
        e.sample_on_host = mode == 0;
        engine_run(&e, reqs, NREQ, TOP, mode == 0 ? host : dev);
        engine_free(&e);
    }
    int bad_tok = 0, bad_lp = 0, bad_top = 0, n_tok = 0, n_lp = 0;
    double worst = 0.0, err_lp;
    for (int i = 0; i < NREQ; i++) {
        const run_out *h = &host[i], *d = &dev[i];
        CHECK(h->n_out == d->n_out && h->n_in == d->n_in && h->finish == d->finish,
              "request %d: host %d outputs, %d input logprobs, finish %d; device %d, %d, %d", i,
              h->n_out, h->n_in, (int)h->finish, d->n_out, d->n_in, (int)d->finish);
        int n_out = h->n_out < d->n_out ? h->n_out : d->n_out;
        int first_diff = n_out;
        for (int j = 0; j < n_out; j++, n_tok++)
            if (h->ids[j] != d->ids[j]) {
                bad_tok++;
                if (j < first_diff) first_diff = j;
                if (bad_tok <= 5)
                    fprintf(stderr, "  request %d output %d: device %d, host %d\n", i, j, d->ids[j],
                            h->ids[j]);
            }
        /* logprobs and top-N: the prompt's, and the outputs' up to the first difference */
        for (int pass = 0; pass < 2; pass++) {
            int cnt = pass == 0 ? (h->n_in < d->n_in ? h->n_in : d->n_in) : first_diff;
            if (pass == 0 && reqs[i].logprob_start_len < 0) cnt = 0;
            if (pass == 1 && !reqs[i].return_logprob) cnt = 0;
            const float *hl = pass == 0 ? h->in_lps : h->lps, *dl = pass == 0 ? d->in_lps : d->lps;
            const int32_t *hti = pass == 0 ? h->in_top_ids : h->top_ids;
            const int32_t *dti = pass == 0 ? d->in_top_ids : d->top_ids;
            const float *htl = pass == 0 ? h->in_top_lps : h->top_lps;
            const float *dtl = pass == 0 ? d->in_top_lps : d->top_lps;
            for (int j = pass == 0 && reqs[i].logprob_start_len == 0 ? 1 : 0; j < cnt; j++) {
                n_lp++;
                if (!lp_close(dl[j], hl[j], &err_lp)) {
                    bad_lp++;
                    if (bad_lp <= 5)
                        fprintf(stderr, "  request %d %s logprob %d: device %.9g, host %.9g\n", i,
                                pass == 0 ? "input" : "output", j, dl[j], hl[j]);
                }
                if (isfinite(err_lp) && err_lp > worst) worst = err_lp;
                for (int k = 0; k < TOP; k++) {
                    size_t at = (size_t)j * TOP + k;
                    bool ok = dti[at] == hti[at] || fabsf(dtl[at] - htl[at]) <= TIE_TOL;
                    ok = ok && lp_close(dtl[at], htl[at], &err_lp);
                    if (!ok && ++bad_top <= 5)
                        fprintf(stderr,
                                "  request %d %s top %d of %d: device %d %.9g, host %d %.9g\n", i,
                                pass == 0 ? "input" : "output", k, j, dti[at], dtl[at], hti[at],
                                htl[at]);
                }
            }
        }
    }
    printf("engine (tiny-qwen3-moe, V %d): %d output tokens, %d logprobs with top-%d compared, "
           "device sampling against host sampling: %d tokens differ, worst logprob error %.3g\n",
           V, n_tok, n_lp, TOP, bad_tok, worst);
    CHECK(bad_tok == 0, "%d of %d tokens differ between device and host sampling", bad_tok, n_tok);
    CHECK(bad_lp == 0, "%d of %d logprobs differ by more than %g", bad_lp, n_lp, LP_TOL);
    CHECK(bad_top == 0, "%d top-N entries differ", bad_top);
    for (int i = 0; i < NREQ; i++) {
        run_out_free(&host[i]);
        run_out_free(&dev[i]);
    }
    model_free(m);
}

/* ---- figures ---- */

static int cmp_float(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

static void figures(void) {
    const int V = QWEN_V, NMAX = 256, reps = 7;
    printf("\ntimes at V = %d (median of %d; op: cudaEvent around ops->sample; host path: copy "
           "the rows to pageable memory, then runner/sampler.c on %d threads)\n",
           V, reps, omp_get_max_threads());
    float *hx = xmalloc((size_t)NMAX * V * sizeof(float));
    for (int r = 0; r < NMAX; r++)
        make_row(hx + (size_t)r * V, V, ROW_PEAKED);
    float *dx = gpu->dev_alloc((size_t)NMAX * V * sizeof(float));
    sample_row *dr = gpu->dev_alloc((size_t)NMAX * sizeof *dr);
    sample_penalty *dp = gpu->dev_alloc((size_t)NMAX * 64 * sizeof *dp);
    int32_t *dtok = gpu->dev_alloc((size_t)NMAX * sizeof(int32_t));
    float *dlp = gpu->dev_alloc((size_t)NMAX * sizeof(float));
    int32_t *dtid = gpu->dev_alloc((size_t)NMAX * 5 * sizeof(int32_t));
    float *dtlp = gpu->dev_alloc((size_t)NMAX * 5 * sizeof(float));
    MS_ASSERT(dx && dr && dp && dtok && dlp && dtid && dtlp);
    gpu->to_device(dx, hx, (size_t)NMAX * V * sizeof(float));
    sample_penalty *hp = xmalloc((size_t)NMAX * 64 * sizeof *hp);
    for (int i = 0; i < NMAX * 64; i++)
        hp[i] = (sample_penalty){.id = rng_int(V), .count = i % 3};
    /* distinct ids per row: stride them */
    for (int r = 0; r < NMAX; r++)
        for (int j = 0; j < 64; j++)
            hp[r * 64 + j].id = (r * 977 + j * 2371) % V;
    gpu->to_device(dp, hp, (size_t)NMAX * 64 * sizeof *hp);
    float *host = xmalloc((size_t)NMAX * V * sizeof(float));
    struct {
        const char *name;
        sampling_params sp;
        int want_lp, top_n, n_pen;
    } cfg[] = {
        {"greedy",
         {.temperature = 0.0f, .top_p = 1, .top_k = -1, .repetition_penalty = 1},
         0,
         0,
         0},
        {"greedy + logprob + top-5",
         {.temperature = 0.0f, .top_p = 1, .top_k = -1, .repetition_penalty = 1},
         1,
         5,
         0},
        {"T 0.8, top_p 0.95",
         {.temperature = 0.8f, .top_p = 0.95f, .top_k = -1, .repetition_penalty = 1},
         0,
         0,
         0},
        {"T 1, top_k 50, top_p 0.9, min_p 0.05, penalties, logprob + top-5",
         {.temperature = 1.0f,
          .top_p = 0.9f,
          .top_k = 50,
          .min_p = 0.05f,
          .repetition_penalty = 1.1f,
          .frequency_penalty = 0.3f,
          .presence_penalty = 0.2f},
         1,
         5,
         64},
    };
    static const int ns[] = {1, 64, 256};
    sample_row *hr = xmalloc((size_t)NMAX * sizeof *hr);
    cudaEvent_t ev0, ev1;
    cudaEventCreate(&ev0);
    cudaEventCreate(&ev1);
    printf("%-66s %6s %10s %14s\n", "parameters", "rows", "op ms", "host path ms");
    for (size_t ci = 0; ci < sizeof cfg / sizeof cfg[0]; ci++) {
        for (size_t ni = 0; ni < sizeof ns / sizeof ns[0]; ni++) {
            int n = ns[ni];
            for (int r = 0; r < n; r++) {
                const sampling_params *sp = &cfg[ci].sp;
                hr[r] = (sample_row){.seed = 1234 + r,
                                     .position = 1000,
                                     .temperature = sp->temperature,
                                     .top_p = sp->top_p,
                                     .min_p = sp->min_p,
                                     .top_k = sp->top_k,
                                     .repetition_penalty = sp->repetition_penalty,
                                     .frequency_penalty = sp->frequency_penalty,
                                     .presence_penalty = sp->presence_penalty,
                                     .mode = SAMPLE_DRAW,
                                     .pen_start = r * 64,
                                     .n_pen = cfg[ci].n_pen,
                                     .want_logprob = cfg[ci].want_lp,
                                     .top_n = cfg[ci].top_n};
            }
            gpu->to_device(dr, hr, (size_t)n * sizeof *hr);
            float op[16], hostt[16];
            for (int k = 0; k < reps + 1; k++) {
                cudaEventRecord(ev0, cuda_stream());
                gpu->sample(dtok, dlp, dtid, dtlp, dx, dr, dp, NULL, n, V, 5);
                cudaEventRecord(ev1, cuda_stream());
                cudaEventSynchronize(ev1);
                float ms = 0;
                cudaEventElapsedTime(&ms, ev0, ev1);
                if (k > 0) op[k - 1] = ms;
            }
            for (int k = 0; k < reps; k++) {
                double t0 = now_s();
                gpu->to_host(host, dx, (size_t)n * V * sizeof(float));
#pragma omp parallel
                {
                    float *buf = xmalloc((size_t)V * sizeof(float));
#pragma omp for schedule(dynamic, 1)
                    for (int r = 0; r < n; r++) {
                        sampling_params sp = cfg[ci].sp;
                        sp.seed = 1234 + r;
                        float *lg = host + (size_t)r * V;
                        if (cfg[ci].want_lp) sampler_log_softmax(buf, lg, V);
                        sampler_sample(&sp, lg, V, NULL, 0, NULL, 0, 1000);
                    }
                    free(buf);
                }
                hostt[k] = (float)((now_s() - t0) * 1e3);
            }
            qsort(op, reps, sizeof(float), cmp_float);
            qsort(hostt, reps, sizeof(float), cmp_float);
            printf("%-66s %6d %10.3f %14.3f\n", cfg[ci].name, n, op[reps / 2], hostt[reps / 2]);
        }
    }
    /* the copy alone */
    for (size_t ni = 0; ni < sizeof ns / sizeof ns[0]; ni++) {
        int n = ns[ni];
        float t[16];
        for (int k = 0; k < reps; k++) {
            double t0 = now_s();
            gpu->to_host(host, dx, (size_t)n * V * sizeof(float));
            t[k] = (float)((now_s() - t0) * 1e3);
        }
        qsort(t, reps, sizeof(float), cmp_float);
        printf("copy of %d rows to pageable host memory: %.3f ms (%.1f GB/s)\n", n, t[reps / 2],
               (double)n * V * 4 / (t[reps / 2] * 1e-3) / 1e9);
    }
    cudaEventDestroy(ev0);
    cudaEventDestroy(ev1);
    void *dev[] = {dx, dr, dp, dtok, dlp, dtid, dtlp};
    for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++)
        gpu->dev_free(dev[i]);
    free(hx);
    free(hp);
    free(hr);
    free(host);
}

int main(void) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    char err[256];
    gpu = ops_cuda(0, err, sizeof err);
    if (!gpu) {
        printf("skipped: %s\n", err);
        printf("0 passed, 0 failed\n");
        return 0;
    }
    CHECK(gpu->sample != NULL, "the CUDA backend has no sample op");
    CHECK(ops_cpu()->sample == NULL, "the CPU backend must leave sample NULL");
    CHECK(OPS_SAMPLE_GREEDY_EPS == SAMPLER_GREEDY_EPS, "greedy thresholds differ");
    if (!gpu->sample) CHECK_SUMMARY();
    double t0 = now_s();
    test_rows();
    printf("(rows: %.1f s)\n", now_s() - t0);
    t0 = now_s();
    test_chi_square();
    printf("(chi-square: %.1f s)\n", now_s() - t0);
    test_engine();
    figures();
    sampler_scratch_free();
    CHECK_SUMMARY();
}

#else

int main(void) {
    printf("skipped: this build has no CUDA (nvcc not found, or make CUDA=0)\n");
    printf("0 passed, 0 failed\n");
    return 0;
}

#endif
