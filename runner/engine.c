/* Engine: batches every unfinished sequence into one forward pass per step. Prompts go in
 * chunks of at most chunk_tokens (shared by all sequences of the step); decode tokens always
 * fit. Logits are computed only for rows that score a prompt token or sample the next one.
 *
 * engine_step is the one copy of forward + score + sample; engine_generate drives it over a
 * fixed set of sequences, the scheduler over its running batch. A token's result does not depend
 * on what else is in the batch (the kernels sum in fixed orders), so both give the same bits. */
#include "runner/engine.h"

#include <math.h>
#include <omp.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/log.h"

int engine_init(engine *e, model *m, int n_pages, int page_size, int chunk_tokens, int kv_bf16,
                char *err, size_t errlen) {
    const model_config *c = &m->cfg;
    *e = (engine){.m = m, .chunk_tokens = chunk_tokens};
    if (kv_cache_init(&e->kv, m->ops, c->num_hidden_layers, n_pages, page_size,
                      c->num_key_value_heads, c->head_dim, kv_bf16, err, errlen))
        return -1;
    e->scratch = xmalloc((size_t)c->vocab_size * sizeof(float));
    e->scratch_threads = 1;
    return 0;
}

/* The device copies of the batch (backends whose memory is not the host's). */
static void engine_free_staging(engine *e) {
    const ops *o = e->m ? e->m->ops : NULL;
    void *bufs[] = {e->d_ids,   e->d_pos,    e->d_seq,       e->d_rows,
                    e->d_table, e->d_logits, e->d_sample_in, e->d_sample_out};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        if (bufs[i] && o) o->dev_free(bufs[i]); /* device buffers exist only with a model */
}

static void *dev_grow(const ops *o, void *p, size_t bytes) {
    if (p) o->dev_free(p);
    void *q = o->dev_alloc(bytes);
    if (!q) {
        fprintf(stderr, "engine: out of %s memory for %zu bytes of batch buffers\n", o->name,
                bytes);
        exit(1);
    }
    return q;
}

/* Copy the step's batch (T tokens, n_rows logit rows, the page table) to the device and point fb
 * at the copies. */
static void engine_stage(engine *e, forward_batch *fb, const int32_t *page_table, int n_table) {
    const ops *o = e->m->ops;
    int T = fb->T, n_rows = fb->n_logits;
    if (T > e->cap_d_T) {
        e->d_ids = dev_grow(o, e->d_ids, (size_t)T * sizeof(int32_t));
        e->d_pos = dev_grow(o, e->d_pos, (size_t)T * sizeof(int32_t));
        e->d_seq = dev_grow(o, e->d_seq, (size_t)T * sizeof(int32_t));
        e->d_rows = dev_grow(o, e->d_rows, (size_t)T * sizeof(int32_t));
        e->cap_d_T = T;
    }
    if ((size_t)n_table > e->cap_d_table) {
        e->d_table = dev_grow(o, e->d_table, (size_t)n_table * sizeof(int32_t));
        e->cap_d_table = (size_t)n_table;
    }
    if (n_rows > e->cap_d_logits) {
        e->d_logits = dev_grow(o, e->d_logits, (size_t)n_rows * e->m->cfg.vocab_size * sizeof(float));
        e->cap_d_logits = n_rows;
    }
    o->to_device(e->d_ids, fb->ids, (size_t)T * sizeof(int32_t));
    o->to_device(e->d_pos, fb->attn.pos, (size_t)T * sizeof(int32_t));
    o->to_device(e->d_seq, fb->attn.seq, (size_t)T * sizeof(int32_t));
    o->to_device(e->d_rows, fb->logit_rows, (size_t)n_rows * sizeof(int32_t));
    o->to_device(e->d_table, page_table, (size_t)n_table * sizeof(int32_t));
    fb->ids = e->d_ids;
    fb->attn.pos = e->d_pos;
    fb->attn.seq = e->d_seq;
    fb->attn.page_table = e->d_table;
    fb->logit_rows = e->d_rows;
}

static int log2_floor(int x) {
    int l = 0;
    while (x >= 2 << l)
        l++;
    return l;
}

/* Where v sits among 0, the powers of two up to max and max itself: 0, 1 + log2 v, the last
 * (pow2_slots(max) - 1); -1 for any other value. */
static int pow2_slots(int max) { return log2_floor(max) + 3; }

static int pow2_index(int v, int max) {
    if (v == 0) return 0;
    if (v < 0 || v > max) return -1;
    if ((v & (v - 1)) == 0) return 1 + log2_floor(v);
    return v == max ? pow2_slots(max) - 1 : -1;
}

/* Captured graphs, by the step's runtime_max (expert parallelism: a graph holds the
 * all-to-all's runtime_max; 0 alone, else a power of two up to graph_max_bs or graph_max_bs,
 * as scheduler.c rounds a group's), by the page-table stride (graph_pages) and by the padded
 * batch (graph_batch): the index of that graph, or -1 for a runtime_max without graphs. */
static int64_t graph_index(const engine *e, int runtime_max, int pages, int batch) {
    const int set = pow2_index(runtime_max, e->graph_max_bs);
    const int pb = pow2_index(pages, e->graph_max_pages);
    if (set < 0 || pb < 0) return -1;
    return ((int64_t)set * pow2_slots(e->graph_max_pages) + pb) * (e->graph_max_bs + 1) + batch;
}

static int64_t graph_count(const engine *e) {
    return (int64_t)pow2_slots(e->graph_max_bs) * pow2_slots(e->graph_max_pages) *
           (e->graph_max_bs + 1);
}

/* Free every captured graph (their buffers stay). */
static void engine_drop_graphs(engine *e) {
    if (!e->graphs || !e->m) return; /* none captured, or no model to free them with */
    const int64_t n = graph_count(e);
    for (int64_t b = 0; b < n; b++)
        if (e->graphs[b]) {
            e->m->ops->graph_free(e->graphs[b]);
            e->graphs[b] = NULL;
        }
}

/* The graphs' per-token arrays in their device block: B entries, rounded up to 32 (128 bytes),
 * so that each starts aligned as a buffer of its own would. */
static size_t graph_stride(int B) { return ((size_t)B + 31) / 32 * 32; }

static void engine_free_graphs(engine *e) {
    const ops *o = e->m ? e->m->ops : NULL;
    if (e->graphs) engine_drop_graphs(e);
    free(e->graphs);
    void *bufs[] = {e->g_ids /* the block of g_ids .. g_table */, e->g_logits};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        if (bufs[i] && o) o->dev_free(bufs[i]);
    free(e->g_host);
    e->g_ids = e->g_pos = e->g_seq = e->g_rows = e->g_table = e->g_host = NULL;
    e->g_logits = NULL;
    e->graphs = NULL;
    e->graph_max_bs = 0;
}

int engine_enable_graphs(engine *e, int max_bs, int max_pages, char *err, size_t errlen) {
    const ops *o = e->m->ops;
    if (!o->graph_begin)
        return set_err(err, errlen, "the %s backend has no graphs", o->name);
    if (max_bs < 1 || max_pages < 1)
        return set_err(err, errlen, "graphs: batch %d and pages %d must be >= 1", max_bs,
                       max_pages);
    engine_free_graphs(e);
    size_t V = (size_t)e->m->cfg.vocab_size, B = (size_t)max_bs, G = (size_t)max_pages;
    /* one block, [ids][pos][seq][rows] of graph_stride(B) each, then [table B G], staged on the
     * host in the same layout, so that a step's batch goes up in one copy */
    const size_t P = graph_stride(max_bs), n = 4 * P + B * G;
    e->g_ids = o->dev_alloc(n * sizeof(int32_t));
    e->g_logits = o->dev_alloc(B * V * sizeof(float));
    e->g_host = xcalloc(n, sizeof(int32_t));
    e->graph_max_bs = max_bs;
    e->graph_max_pages = max_pages;
    e->graphs = xcalloc((size_t)graph_count(e), sizeof(void *));
    e->graph_epoch = 0;
    if (!e->g_ids || !e->g_logits) {
        engine_free_graphs(e);
        return set_err(err, errlen, "graphs: out of %s memory for batches of %d", o->name,
                       max_bs);
    }
    e->g_pos = e->g_ids + P;
    e->g_seq = e->g_pos + P;
    e->g_rows = e->g_seq + P;
    e->g_table = e->g_rows + P;
    return 0;
}

/* The batch a decode graph runs: T rounded up to 1, 2, 4, 8 or a multiple of 8, at most
 * graph_max_bs (as SGLang's capture sizes), so a few dozen graphs cover every batch: a graph is
 * captured on a batch's first step (an eager step, then the recording), and one per exact size
 * meant a capture at most of the sizes a busy server passes through. Never above the step's
 * runtime_max: scheduler.c rounds that up to a power of two (or graph_max_bs), at least this. */
static int graph_batch(const engine *e, int T) {
    const int b = T <= 2 ? T : T <= 4 ? 4 : T <= 8 ? 8 : (T + 7) / 8 * 8;
    return b < e->graph_max_bs ? b : e->graph_max_bs;
}

/* The page-table stride, and bound on positions, a decode graph runs with: the batch's longest
 * table rounded up to a power of two of at least 16 pages, at most graph_max_pages. The
 * attention sizes its grids from that bound, and the context length's (a 40960-token context:
 * 161 chunks of 256 positions a token, nearly all empty) made a graph's decode step slower than
 * an eager one with the batch's own longest table. */
static int graph_pages(const engine *e, engine_seq *const *seqs, int n) {
    int mp = 1, b = 16;
    for (int i = 0; i < n; i++)
        if (seqs[i]->n_pages > mp) mp = seqs[i]->n_pages;
    while (b < mp)
        b <<= 1;
    return b < e->graph_max_pages ? b : e->graph_max_pages;
}

/* A step the graphs can take: decode only (one token per sequence, each sampled), alone or with
 * a runtime_max that has a set of graphs. */
static bool graph_step_ok(const engine *e, engine_seq *const *seqs, int n, int T, int n_rows) {
    if (e->graph_max_bs == 0 || pow2_index(e->runtime_max, e->graph_max_bs) < 0 || T != n ||
        T > e->graph_max_bs || n_rows != T || T == 0)
        return false;
    for (int i = 0; i < n; i++)
        if (seqs[i]->take != 1 || seqs[i]->n_pages > e->graph_max_pages) return false;
    return true;
}

static uint64_t graph_epoch_now(const engine *e) {
    return e->m->ops->graph_epoch() * 0x9E3779B97F4A7C15ull ^ e->m->ws_epoch;
}

/* The forward of a decode step through the graphs: the batch goes into the graphs' own buffers
 * (sequence t reads page-table row t), then the graph of this batch size is replayed, or, the
 * first time, the step runs eagerly and is captured. */
static int engine_graph_forward(engine *e, forward_batch *fb, engine_seq *const *seqs,
                                const int32_t *page_table, int max_pages) {
    model *m = e->m;
    const ops *o = m->ops;
    const int T = fb->T, Tb = graph_batch(e, T), B = e->graph_max_bs;
    const int G = graph_pages(e, seqs, T); /* the table's stride here, <= graph_max_pages */
    const size_t P = graph_stride(B);      /* the device block's layout (engine_enable_graphs) */
    int32_t *h_ids = e->g_host, *h_pos = h_ids + P, *h_seq = h_pos + P, *h_rows = h_seq + P,
            *h_table = h_rows + P;
    /* Rows past T copy row 0 (its token, position and page-table row): they store the same
     * key and value into the same slot, and their logits are not read. */
    for (int t = 0; t < Tb; t++) {
        const int src = t < T ? t : 0;
        h_seq[t] = src;
        h_rows[t] = t;
        h_ids[t] = fb->ids[src];
        h_pos[t] = fb->attn.pos[src];
        if (t < T)
            memcpy(h_table + (size_t)t * G, page_table + (size_t)seqs[t]->slot * max_pages,
                   (size_t)seqs[t]->n_pages * sizeof(int32_t));
    }
    /* one copy (each waits for the device: five of them took four more round trips a step),
     * the rows past Tb along (a graph of Tb rows reads none of them) */
    o->to_device(e->g_ids, h_ids, (4 * P + (size_t)T * G) * sizeof(int32_t));
    forward_batch g = *fb;
    g.T = g.attn.T = g.n_logits = Tb;
    g.ids = e->g_ids;
    g.attn.pos = e->g_pos;
    g.attn.seq = e->g_seq;
    g.attn.page_table = e->g_table;
    g.attn.max_pages = G;
    g.logit_rows = e->g_rows;

    if (graph_epoch_now(e) != e->graph_epoch) engine_drop_graphs(e);
    void **slot = &e->graphs[graph_index(e, e->runtime_max, G, Tb)];
    if (*slot) {
        o->graph_launch(*slot);
        /* what the all-to-all's kernels recorded in the replay (nothing alone) */
        return e->runtime_max ? model_step_check(m) : 0;
    }
    /* First step of this size: eagerly (it sizes every workspace), then captured. */
    if (m->arch->forward(m, &e->kv, &g, e->g_logits)) return -1;
    uint64_t epoch = graph_epoch_now(e);
    if (epoch != e->graph_epoch) { /* the eager step moved a workspace: older graphs go */
        engine_drop_graphs(e);
        e->graph_epoch = epoch;
    }
    char why[256];
    void *graph = NULL;
    if (o->graph_begin(why, sizeof why) == 0) {
        int rc = m->arch->forward(m, &e->kv, &g, e->g_logits);
        graph = o->graph_end(why, sizeof why);
        if (rc != 0 && graph) {
            o->graph_free(graph);
            graph = NULL;
        }
    }
    if (!graph || graph_epoch_now(e) != epoch) {
        LOG_WARN("engine", "decode graphs turned off: %s",
                 graph ? "a workspace moved during the capture" : why);
        if (graph) o->graph_free(graph);
        engine_drop_graphs(e);
        e->graph_max_bs = 0; /* the eager step above already produced this step's logits */
        return 0;
    }
    *slot = graph; /* the eager step produced this step's logits */
    return 0;
}

void engine_free(engine *e) {
    engine_free_graphs(e);
    engine_free_staging(e);
    kv_cache_free(&e->kv);
    free(e->logits);
    free(e->scratch);
    free(e->row_seq);
    free(e->row_token);
    free(e->row_logprob);
    free(e->row_kind);
    free(e->ids);
    free(e->pos);
    free(e->seq_of);
    free(e->rows);
    free(e->h_sample_in);
    free(e->h_sample_out);
    free(e->pen_mark);
    free(e->pen_slot);
    *e = (engine){0};
}

void gen_result_free(gen_result *r) {
    free(r->output_ids);
    free(r->input_logprobs);
    free(r->output_logprobs);
    *r = (gen_result){0};
}

void engine_seq_init(engine_seq *s, const gen_request *q, int top_n) {
    *s = (engine_seq){.req = q, .top_n = top_n, .n_tokens = q->n_prompt};
    s->tokens = xmalloc(((size_t)q->n_prompt + q->max_new_tokens + 1) * sizeof(int32_t));
    memcpy(s->tokens, q->prompt, (size_t)q->n_prompt * sizeof(int32_t));
    /* Position 0 has nothing before it to score it: its entry is NaN from the start. */
    bool wanted = q->return_logprob && q->logprob_start_len >= 0;
    s->next_score = wanted ? (q->logprob_start_len > 1 ? q->logprob_start_len : 1) : q->n_prompt;
    if (s->next_score > q->n_prompt) s->next_score = q->n_prompt;
}

void engine_seq_free(engine_seq *s) {
    free(s->tokens);
    s->tokens = NULL;
}

int engine_seq_n_in(const engine_seq *s) {
    if (!s->in_logprobs) return 0;
    return s->next_score - s->req->logprob_start_len;
}

static bool ids_contain(const int32_t *ids, int n, int32_t id) {
    for (int i = 0; i < n; i++)
        if (ids[i] == id) return true;
    return false;
}

/* ids[N], vals[N] = the N largest of lp[V] in descending order, ties by ascending id. The two
 * arrays first hold a heap whose root is the worst kept entry, then a heap sort leaves them
 * best first. */
static bool top_worse(float va, int32_t ia, float vb, int32_t ib) {
    return va < vb || (va == vb && ia > ib);
}

static void top_sift_down(int32_t *ids, float *vals, int n, int i) {
    for (;;) {
        int c = 2 * i + 1;
        if (c >= n) return;
        if (c + 1 < n && top_worse(vals[c + 1], ids[c + 1], vals[c], ids[c])) c++;
        if (!top_worse(vals[c], ids[c], vals[i], ids[i])) return;
        int32_t ti = ids[i];
        float tv = vals[i];
        ids[i] = ids[c], vals[i] = vals[c];
        ids[c] = ti, vals[c] = tv;
        i = c;
    }
}

static void top_n_select(int32_t *ids, float *vals, const float *lp, int V, int N) {
    if (N > V) N = V;
    for (int i = 0; i < N; i++)
        ids[i] = i, vals[i] = lp[i];
    for (int i = N / 2 - 1; i >= 0; i--)
        top_sift_down(ids, vals, N, i);
    for (int t = N; t < V; t++)
        if (top_worse(vals[0], ids[0], lp[t], t)) {
            ids[0] = t, vals[0] = lp[t];
            top_sift_down(ids, vals, N, 0);
        }
    for (int n = N - 1; n > 0; n--) {
        int32_t ti = ids[0];
        float tv = vals[0];
        ids[0] = ids[n], vals[0] = vals[n];
        ids[n] = ti, vals[n] = tv;
        top_sift_down(ids, vals, n, 0);
    }
}

/* After sampling token t for s: record it and decide whether s is done. */
static void engine_seq_append(engine *e, engine_seq *s, int32_t t, float logprob) {
    const gen_request *q = s->req;
    const model_config *c = &e->m->cfg;
    s->tokens[s->n_tokens++] = t;
    s->out_ids[s->n_out] = t;
    if (s->out_logprobs) s->out_logprobs[s->n_out] = logprob;
    s->n_out++;
    bool may_stop = s->n_out >= q->min_new_tokens;
    if (may_stop && ((!q->ignore_eos && ids_contain(c->eos_token_ids, c->n_eos, t)) ||
                     ids_contain(q->stop_token_ids, q->n_stop_token_ids, t))) {
        s->finish = FINISH_STOP_TOKEN;
        s->matched_token = t;
    }
    if (q->on_token && q->on_token(q->ctx, t) && s->finish == FINISH_NONE)
        s->finish = FINISH_STOP_STRING;
    if (s->finish == FINISH_NONE && s->n_out >= q->max_new_tokens) s->finish = FINISH_LENGTH;
}

static double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* The per-row results of a step's scoring and sampling, and one V-sized buffer per thread. */
static void engine_reserve_rows(engine *e, int n_rows) {
    int nth = omp_get_max_threads(), V = e->m->cfg.vocab_size;
    if (nth > e->scratch_threads) {
        e->scratch = xrealloc(e->scratch, (size_t)nth * V * sizeof(float));
        e->scratch_threads = nth;
    }
    if (n_rows <= e->cap_rows) return;
    e->row_seq = xrealloc(e->row_seq, (size_t)n_rows * sizeof(int32_t));
    e->row_token = xrealloc(e->row_token, (size_t)n_rows * sizeof(int32_t));
    e->row_logprob = xrealloc(e->row_logprob, (size_t)n_rows * sizeof(float));
    e->row_kind = xrealloc(e->row_kind, (size_t)n_rows);
    e->cap_rows = n_rows;
}

static void engine_reserve(engine *e, int T) {
    if (T <= e->cap_T) return;
    e->ids = xrealloc(e->ids, (size_t)T * sizeof(int32_t));
    e->pos = xrealloc(e->pos, (size_t)T * sizeof(int32_t));
    e->seq_of = xrealloc(e->seq_of, (size_t)T * sizeof(int32_t));
    e->rows = xrealloc(e->rows, (size_t)T * sizeof(int32_t));
    e->cap_T = T;
}

/* Whether this step scores and samples on the device (ops->sample): a backend with the op whose
 * memory is not the host's, unless the caller asked for the host path, and top-N within what the
 * op takes. */
static bool engine_device_sampling(const engine *e, engine_seq *const *seqs, int n) {
    const ops *o = e->m->ops;
    if (!o->sample || o->device == DEVICE_CPU || e->sample_on_host) return false;
    for (int i = 0; i < n; i++)
        if (seqs[i]->top_n > OPS_SAMPLE_TOP_N_MAX) return false;
    return true;
}

_Static_assert(sizeof(sample_bias) == sizeof(sampler_bias) &&
                   offsetof(sample_bias, bias) == offsetof(sampler_bias, bias),
               "ops->sample takes the requests' logit bias entries as they are");

static bool sampling_penalized(const sampling_params *p) {
    return (p->repetition_penalty != 1.0f && p->repetition_penalty > 0.0f) ||
           p->frequency_penalty != 0.0f || p->presence_penalty != 0.0f;
}

/* The penalty list of s's next draw (ops->sample's sample_penalty, what sampler_sample derives from
 * prompt and outputs): each distinct output id with its count, then, when the repetition penalty
 * is on, each prompt id not listed yet. Returns the entries written (at most n_prompt + n_out). */
static int engine_penalty_list(engine *e, const engine_seq *s, sample_penalty *out) {
    const gen_request *q = s->req;
    const sampling_params *p = &q->sampling;
    if (!sampling_penalized(p)) return 0;
    bool rep = p->repetition_penalty != 1.0f && p->repetition_penalty > 0.0f;
    int V = e->m->cfg.vocab_size;
    if (!e->pen_mark) {
        e->pen_mark = xcalloc((size_t)V, sizeof *e->pen_mark);
        e->pen_slot = xmalloc((size_t)V * sizeof *e->pen_slot);
        e->pen_gen = 0;
    }
    if (++e->pen_gen == 0) { /* wrapped: an old stamp could collide */
        memset(e->pen_mark, 0, (size_t)V * sizeof *e->pen_mark);
        e->pen_gen = 1;
    }
    uint32_t g = e->pen_gen;
    int n = 0;
    const int32_t *outputs = s->tokens + q->n_prompt;
    for (int i = 0; i < s->n_out; i++) {
        int32_t id = outputs[i];
        if (id < 0 || id >= V) continue;
        if (e->pen_mark[id] != g) {
            e->pen_mark[id] = g;
            e->pen_slot[id] = n;
            out[n++] = (sample_penalty){.id = id, .count = 0};
        }
        out[e->pen_slot[id]].count++;
    }
    for (int i = 0; rep && i < q->n_prompt; i++) {
        int32_t id = q->prompt[i];
        if (id < 0 || id >= V || e->pen_mark[id] == g) continue;
        e->pen_mark[id] = g;
        out[n++] = (sample_penalty){.id = id, .count = 0};
    }
    return n;
}

/* Host and device buffers of at least bytes (contents not kept). */
static void sample_buf_reserve(const ops *o, void **h, void **d, size_t *cap, size_t bytes) {
    if (bytes <= *cap) return;
    size_t c = *cap * 2 > bytes ? *cap * 2 : bytes;
    free(*h);
    *h = xmalloc(c);
    *d = dev_grow(o, *d, c);
    *cap = c;
}

/* Score and sample the step's n_rows rows on the device from the logits at d_logits (ops->sample):
 * the rows' parameters and penalty lists go up in one copy, tokens, logprobs and top-N come back in
 * one. Fills what the host path fills: row_kind, row_token, row_logprob, and the input logprob and
 * top-N sinks (one sampled row per sequence: its n_out is still the entry's index). */
static void engine_sample_device(engine *e, engine_seq *const *seqs, const float *d_logits,
                                 int n_rows) {
    if (n_rows == 0) return;
    const ops *o = e->m->ops;
    int V = e->m->cfg.vocab_size, top_n_max = 0;
    const int32_t *rows = e->rows, *pos = e->pos;
    size_t n_pen_max = 0, n_bias_all = 0;
    for (int r = 0; r < n_rows; r++) {
        const engine_seq *s = seqs[e->row_seq[r]];
        const gen_request *q = s->req;
        bool scored = pos[rows[r]] + 1 < q->n_prompt;
        if (!scored && q->max_new_tokens == 0) continue;
        if (s->top_n > top_n_max && (scored ? s->in_top_ids : s->out_top_ids)) top_n_max = s->top_n;
        if (!scored && sampling_penalized(&q->sampling))
            n_pen_max += (size_t)q->n_prompt + (size_t)s->n_out;
        if (!scored) n_bias_all += (size_t)q->sampling.n_logit_bias;
    }
    /* one upload: the rows, the logit bias entries, then the penalty entries */
    size_t rows_bytes = (size_t)n_rows * sizeof(sample_row);
    size_t head_bytes = rows_bytes + n_bias_all * sizeof(sample_bias);
    sample_buf_reserve(o, &e->h_sample_in, &e->d_sample_in, &e->cap_sample_in,
                       head_bytes + n_pen_max * sizeof(sample_penalty));
    sample_row *sr = e->h_sample_in;
    sample_bias *bias = (sample_bias *)((char *)e->h_sample_in + rows_bytes);
    sample_penalty *pen = (sample_penalty *)((char *)e->h_sample_in + head_bytes);
    int n_pen = 0, n_bias = 0;
    for (int r = 0; r < n_rows; r++) {
        engine_seq *s = seqs[e->row_seq[r]];
        const gen_request *q = s->req;
        int p = pos[rows[r]], N = s->top_n;
        if (p + 1 < q->n_prompt) {
            sr[r] = (sample_row){.mode = SAMPLE_SCORE,
                                 .target = s->tokens[p + 1],
                                 .want_logprob = 1,
                                 .top_n = N > 0 && s->in_top_ids ? N : 0};
            e->row_kind[r] = ROW_SCORED;
            continue;
        }
        if (q->max_new_tokens == 0) {
            sr[r] = (sample_row){.mode = SAMPLE_SKIP};
            e->row_kind[r] = ROW_NOTHING;
            continue;
        }
        const sampling_params *sp = &q->sampling;
        int cnt = engine_penalty_list(e, s, pen + n_pen);
        if (sp->n_logit_bias > 0)
            memcpy(bias + n_bias, sp->logit_bias, (size_t)sp->n_logit_bias * sizeof(sample_bias));
        sr[r] = (sample_row){.seed = sp->seed,
                             .position = (uint64_t)s->n_tokens,
                             .temperature = sp->temperature,
                             .top_p = sp->top_p,
                             .min_p = sp->min_p,
                             .top_k = sp->top_k,
                             .repetition_penalty = sp->repetition_penalty,
                             .frequency_penalty = sp->frequency_penalty,
                             .presence_penalty = sp->presence_penalty,
                             .mode = SAMPLE_DRAW,
                             .target = -1,
                             .pen_start = n_pen,
                             .n_pen = cnt,
                             .want_logprob = q->return_logprob,
                             .top_n = N > 0 && s->out_top_ids ? N : 0,
                             .bias_start = n_bias,
                             .n_bias = sp->n_logit_bias};
        n_pen += cnt;
        n_bias += sp->n_logit_bias;
        e->row_kind[r] = ROW_SAMPLED;
    }
    o->to_device(e->d_sample_in, e->h_sample_in,
                 head_bytes + (size_t)n_pen * sizeof(sample_penalty));

    size_t NT = (size_t)top_n_max, R = (size_t)n_rows;
    sample_buf_reserve(o, &e->h_sample_out, &e->d_sample_out, &e->cap_sample_out,
                       R * (2 + 2 * NT) * sizeof(int32_t));
    int32_t *d_tok = e->d_sample_out;
    float *d_lp = (float *)(d_tok + R);
    int32_t *d_top_ids = (int32_t *)(d_lp + R);
    float *d_top_lps = (float *)(d_top_ids + R * NT);
    o->sample(d_tok, d_lp, d_top_ids, d_top_lps, d_logits, e->d_sample_in,
              (const sample_penalty *)((const char *)e->d_sample_in + head_bytes),
              (const sample_bias *)((const char *)e->d_sample_in + rows_bytes), n_rows, V,
              top_n_max);
    o->to_host(e->h_sample_out, e->d_sample_out, R * (2 + 2 * NT) * sizeof(int32_t));

    const int32_t *tok = e->h_sample_out;
    const float *lp = (const float *)(tok + R);
    const int32_t *top_ids = (const int32_t *)(lp + R);
    const float *top_lps = (const float *)(top_ids + R * NT);
    for (int r = 0; r < n_rows; r++) {
        engine_seq *s = seqs[e->row_seq[r]];
        const gen_request *q = s->req;
        int n_top = sr[r].top_n < V ? sr[r].top_n : V; /* as top_n_select writes */
        int32_t *sink_ids = NULL;
        float *sink_lps = NULL;
        if (e->row_kind[r] == ROW_SCORED) {
            int k = pos[rows[r]] + 1 - q->logprob_start_len;
            s->in_logprobs[k] = lp[r];
            if (n_top > 0) {
                sink_ids = s->in_top_ids + (size_t)k * s->top_n;
                sink_lps = s->in_top_logprobs + (size_t)k * s->top_n;
            }
        } else if (e->row_kind[r] == ROW_SAMPLED) {
            e->row_token[r] = tok[r];
            e->row_logprob[r] = q->return_logprob ? lp[r] : NAN;
            if (n_top > 0) {
                sink_ids = s->out_top_ids + (size_t)s->n_out * s->top_n;
                sink_lps = s->out_top_logprobs + (size_t)s->n_out * s->top_n;
            }
        }
        if (sink_ids) {
            memcpy(sink_ids, top_ids + (size_t)r * NT, (size_t)n_top * sizeof(int32_t));
            memcpy(sink_lps, top_lps + (size_t)r * NT, (size_t)n_top * sizeof(float));
        }
    }
}

/* Score and sample the step's n_rows rows on the host from e->logits (runner/sampler.c). The rows'
 * arithmetic (log-softmax, top-N, the draw, which depends only on the request's seed and the
 * position) runs in parallel, each thread with its own V-sized buffer. */
static void engine_sample_host(engine *e, engine_seq *const *seqs, int n_rows) {
    int V = e->m->cfg.vocab_size;
    const int32_t *rows = e->rows, *pos = e->pos;
#pragma omp parallel for schedule(dynamic, 1) if (n_rows > 1 && (int64_t)n_rows * V >= (1 << 16))
    for (int r = 0; r < n_rows; r++) {
        engine_seq *s = seqs[e->row_seq[r]];
        const gen_request *q = s->req;
        float *lg = e->logits + (size_t)r * V;
        float *buf = e->scratch + (size_t)omp_get_thread_num() * V;
        int t = rows[r], p = pos[t], start = q->logprob_start_len, N = s->top_n;
        if (p + 1 < q->n_prompt) {
            sampler_log_softmax(buf, lg, V);
            int k = p + 1 - start;
            s->in_logprobs[k] = buf[s->tokens[p + 1]];
            if (N > 0 && s->in_top_ids)
                top_n_select(s->in_top_ids + (size_t)k * N, s->in_top_logprobs + (size_t)k * N,
                             buf, V, N);
            e->row_kind[r] = ROW_SCORED;
            continue;
        }
        if (q->max_new_tokens == 0) {
            e->row_kind[r] = ROW_NOTHING;
            continue;
        }
        bool want_lp = q->return_logprob || (N > 0 && s->out_top_ids);
        if (want_lp) sampler_log_softmax(buf, lg, V);
        float lp = q->return_logprob ? 0.0f : NAN;
        int32_t tok = sampler_sample(&q->sampling, lg, V, q->prompt, q->n_prompt,
                                     s->tokens + q->n_prompt, s->n_out, (uint64_t)s->n_tokens);
        if (q->return_logprob) lp = buf[tok];
        if (N > 0 && s->out_top_ids) /* one sampled row per sequence: its n_out is still here */
            top_n_select(s->out_top_ids + (size_t)s->n_out * N,
                         s->out_top_logprobs + (size_t)s->n_out * N, buf, V, N);
        e->row_kind[r] = ROW_SAMPLED;
        e->row_token[r] = tok;
        e->row_logprob[r] = lp;
    }
}

int engine_step(engine *e, engine_seq *const *seqs, int n, const int32_t *page_table,
                int max_pages) {
    model *m = e->m;
    int V = m->cfg.vocab_size, S = e->kv.page_size, T = 0, n_rows = 0;
    e->last_forward_seconds = e->last_sample_seconds = 0.0;
    for (int i = 0; i < n; i++)
        T += seqs[i]->take;
    if (T == 0 && e->runtime_max == 0) return 0;
    MS_ASSERT(e->runtime_max == 0 || T <= e->runtime_max);
    engine_reserve(e, T > 0 ? T : 1);
    int32_t *ids = e->ids, *pos = e->pos, *seq_of = e->seq_of, *rows = e->rows;
    T = 0;
    for (int i = 0; i < n; i++) {
        engine_seq *s = seqs[i];
        const gen_request *q = s->req;
        MS_ASSERT(s->n_computed + s->take <= s->n_tokens);
        MS_ASSERT(s->take == 0 || (s->n_computed + s->take + S - 1) / S <= s->n_pages);
        for (int j = 0; j < s->take; j++) {
            int p = s->n_computed + j;
            ids[T] = s->tokens[p];
            pos[T] = p;
            seq_of[T] = s->slot; /* its page-table row */
            /* a row scores prompt token p + 1, or samples after the last token */
            if ((p + 1 >= s->next_score && p + 1 < q->n_prompt) || p == s->n_tokens - 1)
                rows[n_rows++] = T;
            T++;
        }
    }
    /* With sampling on the device the logits stay there (d_out): no host copy. */
    bool dev_sample = engine_device_sampling(e, seqs, n);
    const float *d_out = NULL;
    if (!dev_sample && n_rows > e->cap_logits) {
        e->logits = xrealloc(e->logits, (size_t)n_rows * V * sizeof(float));
        e->cap_logits = n_rows;
    }
    forward_batch fb = {.T = T,
                        .ids = ids,
                        .attn = {.T = T,
                                 .pos = pos,
                                 .seq = seq_of,
                                 .page_table = page_table,
                                 .max_pages = max_pages,
                                 .page_size = S},
                        .n_logits = n_rows,
                        .logit_rows = rows,
                        .runtime_max = e->runtime_max};
    double t0 = now_seconds();
    int rc;
    if (m->ops->device == DEVICE_CPU) {
        rc = m->arch->forward(m, &e->kv, &fb, e->logits);
    } else if (graph_step_ok(e, seqs, n, T, n_rows)) {
        rc = engine_graph_forward(e, &fb, seqs, page_table, max_pages);
        if (rc == 0 && dev_sample) {
            m->ops->sync(); /* the forward's time is its own */
            d_out = e->g_logits;
        } else if (rc == 0) {
            m->ops->to_host(e->logits, e->g_logits, (size_t)n_rows * V * sizeof(float));
        }
    } else {
        int n_seq = 0;
        for (int i = 0; i < n; i++)
            if (seqs[i]->slot + 1 > n_seq) n_seq = seqs[i]->slot + 1;
        engine_stage(e, &fb, page_table, n_seq * max_pages);
        rc = m->arch->forward(m, &e->kv, &fb, e->d_logits);
        if (rc == 0 && dev_sample) {
            m->ops->sync();
            d_out = e->d_logits;
        } else if (rc == 0) {
            m->ops->to_host(e->logits, e->d_logits, (size_t)n_rows * V * sizeof(float));
        }
    }
    double t1 = now_seconds();
    e->last_forward_seconds = t1 - t0;
    if (rc != 0) return -1;

    /* Score and sample. A row's sequence is found by walking the sequences alongside, since
     * both go in batch order. The rows' arithmetic runs on the host or on the device; then, in
     * row order, tokens are appended and the callbacks run. */
    engine_reserve_rows(e, n_rows);
    int si = 0, first = 0; /* seqs[si] owns batch rows [first, first + seqs[si]->take) */
    for (int r = 0; r < n_rows; r++) {
        while (rows[r] >= first + seqs[si]->take)
            first += seqs[si++]->take;
        e->row_seq[r] = si;
    }
    if (dev_sample)
        engine_sample_device(e, seqs, d_out, n_rows);
    else
        engine_sample_host(e, seqs, n_rows);
    for (int r = 0; r < n_rows; r++) {
        engine_seq *s = seqs[e->row_seq[r]];
        switch (e->row_kind[r]) {
        case ROW_SCORED: s->next_score = pos[rows[r]] + 2; break;
        case ROW_NOTHING: s->finish = FINISH_LENGTH; break;
        case ROW_SAMPLED: engine_seq_append(e, s, e->row_token[r], e->row_logprob[r]); break;
        }
    }
    for (int i = 0; i < n; i++) {
        seqs[i]->n_computed += seqs[i]->take;
        seqs[i]->take = 0;
    }
    e->last_sample_seconds = now_seconds() - t1;
    return T;
}

int engine_check_request(const engine *e, const gen_request *q, int context_length, char *err,
                         size_t errlen) {
    const model_config *c = &e->m->cfg;
    if (q->n_prompt < 1) return set_err(err, errlen, "the prompt is empty");
    if (q->max_new_tokens < 0) return set_err(err, errlen, "max_new_tokens must be >= 0");
    if (q->min_new_tokens < 0) return set_err(err, errlen, "min_new_tokens must be >= 0");
    for (int i = 0; i < q->n_prompt; i++)
        if (q->prompt[i] < 0 || q->prompt[i] >= c->vocab_size)
            return set_err(err, errlen,
                           "input id %d at position %d is outside the vocabulary [0, %d)",
                           q->prompt[i], i, c->vocab_size);
    if ((int64_t)q->n_prompt + q->max_new_tokens > context_length)
        return set_err(err, errlen,
                       "prompt (%d tokens) + max_new_tokens (%d) exceeds the context length %d",
                       q->n_prompt, q->max_new_tokens, context_length);
    if (q->logprob_start_len < -1 || q->logprob_start_len >= q->n_prompt)
        return set_err(err, errlen, "logprob_start_len %d must be -1 or in [0, %d)",
                       q->logprob_start_len, q->n_prompt);
    if (q->n_stop_token_ids < 0 || (q->n_stop_token_ids > 0 && !q->stop_token_ids))
        return set_err(err, errlen, "stop_token_ids: bad count %d", q->n_stop_token_ids);
    const char *bad = sampling_params_check(&q->sampling);
    if (bad) return set_err(err, errlen, "%s", bad);
    for (int i = 0; i < q->sampling.n_logit_bias; i++)
        if (q->sampling.logit_bias[i].id >= c->vocab_size)
            return set_err(err, errlen, "logit_bias: token id %d is outside the vocabulary [0, %d)",
                           (int)q->sampling.logit_bias[i].id, c->vocab_size);
    return 0;
}

int engine_plan_step(engine *e, engine_seq *seqs, int n, engine_seq **batch, char *err,
                     size_t errlen) {
    int S = e->kv.page_size, n_batch = 0, budget = e->chunk_tokens;
    for (int pass = 0; pass < 2; pass++) {
        for (int i = 0; i < n; i++) {
            engine_seq *s = &seqs[i];
            int left = s->n_tokens - s->n_computed;
            bool decode = s->n_computed >= s->req->n_prompt;
            if (s->finish != FINISH_NONE || left == 0 || decode != (pass == 0)) continue;
            int cnt = decode ? left : (left < budget ? left : budget);
            if (cnt <= 0) continue;
            if (!decode) budget -= cnt;
            int need_pages = (s->n_computed + cnt + S - 1) / S;
            while (s->n_pages < need_pages) {
                int32_t p = kv_cache_alloc_page(&e->kv);
                if (p < 0)
                    return set_err(err, errlen, "KV cache: out of pages (%d of %d tokens)",
                                   e->kv.n_pages, S);
                s->pages[s->n_pages++] = p;
            }
            s->take = cnt;
            batch[n_batch++] = s;
        }
    }
    return n_batch;
}

int engine_generate(engine *e, const gen_request *reqs, gen_result *results, int n, char *err,
                    size_t errlen) {
    const model_config *c = &e->m->cfg;
    int S = e->kv.page_size;
    int max_pages = (c->max_position_embeddings + S - 1) / S;
    for (int i = 0; i < n; i++)
        if (engine_check_request(e, &reqs[i], c->max_position_embeddings, err, errlen)) return -1;

    engine_seq *seqs = xcalloc(n > 0 ? n : 1, sizeof *seqs);
    engine_seq **batch = xcalloc(n > 0 ? n : 1, sizeof *batch);
    int32_t *page_table = xcalloc((size_t)(n > 0 ? n : 1) * max_pages, sizeof(int32_t));
    int rc = 0;
    for (int i = 0; i < n; i++) {
        const gen_request *q = &reqs[i];
        gen_result *r = &results[i];
        engine_seq *s = &seqs[i];
        *r = (gen_result){0};
        r->output_ids = xmalloc(((size_t)q->max_new_tokens + 1) * sizeof(int32_t));
        if (q->return_logprob) {
            r->output_logprobs = xmalloc(((size_t)q->max_new_tokens + 1) * sizeof(float));
            if (q->logprob_start_len >= 0) {
                r->n_input_logprobs = q->n_prompt - q->logprob_start_len;
                r->input_logprobs = xmalloc(r->n_input_logprobs * sizeof(float));
                r->input_logprobs[0] = NAN; /* overwritten unless start == 0 */
            }
        }
        engine_seq_init(s, q, 0);
        s->slot = i;
        s->pages = page_table + (size_t)i * max_pages;
        s->out_ids = r->output_ids;
        s->out_logprobs = r->output_logprobs;
        s->in_logprobs = r->input_logprobs;
    }

    for (;;) {
        int n_batch = engine_plan_step(e, seqs, n, batch, err, errlen);
        if (n_batch < 0) {
            rc = -1;
            break;
        }
        if (n_batch == 0) break;
        engine_step(e, batch, n_batch, page_table, max_pages);
    }
    for (int i = 0; i < n; i++) {
        engine_seq *s = &seqs[i];
        for (int j = 0; j < s->n_pages; j++)
            kv_cache_release_page(&e->kv, s->pages[j]);
        results[i].n_output = s->n_out;
        results[i].finish = s->finish;
        results[i].matched_token = s->matched_token;
        engine_seq_free(s);
        if (rc) gen_result_free(&results[i]);
    }
    free(seqs);
    free(batch);
    free(page_table);
    return rc;
}
