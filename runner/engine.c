/* Engine: batches every unfinished sequence into one forward pass per step. Prompts go in
 * chunks of at most chunk_tokens (shared by all sequences of the step); decode tokens always
 * fit. Logits are computed only for rows that score a prompt token or sample the next one. */
#include "runner/engine.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"

typedef struct {
    const gen_request *req;
    gen_result *res;
    int32_t *tokens; /* [n_tokens] prompt then output */
    int n_tokens;
    int n_computed; /* tokens whose KV is stored */
    int32_t *pages; /* [max_pages] */
    int n_pages;
    bool finished;
} engine_seq;

int engine_init(engine *e, model *m, int n_pages, int page_size, int chunk_tokens, char *err,
                size_t errlen) {
    const model_config *c = &m->cfg;
    *e = (engine){.m = m, .chunk_tokens = chunk_tokens};
    if (kv_cache_init(&e->kv, c->num_hidden_layers, n_pages, page_size, c->num_key_value_heads,
                      c->head_dim, err, errlen))
        return -1;
    e->scratch = xmalloc((size_t)c->vocab_size * sizeof(float));
    return 0;
}

void engine_free(engine *e) {
    kv_cache_free(&e->kv);
    free(e->logits);
    free(e->scratch);
}

void gen_result_free(gen_result *r) {
    free(r->output_ids);
    free(r->input_logprobs);
    free(r->output_logprobs);
    *r = (gen_result){0};
}

static bool ids_contain(const int32_t *ids, int n, int32_t id) {
    for (int i = 0; i < n; i++)
        if (ids[i] == id) return true;
    return false;
}

/* After sampling token t for s: record it and decide whether s is done. */
static void engine_seq_append(engine *e, engine_seq *s, int32_t t, float logprob) {
    const gen_request *q = s->req;
    gen_result *r = s->res;
    const model_config *c = &e->m->cfg;
    s->tokens[s->n_tokens++] = t;
    r->output_ids[r->n_output] = t;
    if (r->output_logprobs) r->output_logprobs[r->n_output] = logprob;
    r->n_output++;
    bool may_stop = r->n_output >= q->min_new_tokens;
    if (may_stop && !q->ignore_eos && ids_contain(c->eos_token_ids, c->n_eos, t)) {
        r->finish = FINISH_STOP_TOKEN;
        r->matched_token = t;
    } else if (may_stop && ids_contain(q->stop_token_ids, q->n_stop_token_ids, t)) {
        r->finish = FINISH_STOP_TOKEN;
        r->matched_token = t;
    }
    if (q->on_token && q->on_token(q->ctx, t) && r->finish == FINISH_NONE)
        r->finish = FINISH_STOP_STRING;
    if (r->finish == FINISH_NONE && r->n_output >= q->max_new_tokens) r->finish = FINISH_LENGTH;
    s->finished = r->finish != FINISH_NONE;
}

static int engine_check_request(const engine *e, const gen_request *q, char *err, size_t errlen) {
    const model_config *c = &e->m->cfg;
    int total = q->n_prompt + q->max_new_tokens;
    if (q->n_prompt < 1) return set_err(err, errlen, "the prompt is empty");
    if (q->max_new_tokens < 0) return set_err(err, errlen, "max_new_tokens must be >= 0");
    for (int i = 0; i < q->n_prompt; i++)
        if (q->prompt[i] < 0 || q->prompt[i] >= c->vocab_size)
            return set_err(err, errlen, "input id %d at position %d is outside the vocabulary [0, %d)",
                           q->prompt[i], i, c->vocab_size);
    if (total > c->max_position_embeddings)
        return set_err(err, errlen,
                       "prompt (%d tokens) + max_new_tokens (%d) exceeds the context length %d",
                       q->n_prompt, q->max_new_tokens, c->max_position_embeddings);
    if (q->logprob_start_len < -1 || q->logprob_start_len >= q->n_prompt)
        return set_err(err, errlen, "logprob_start_len %d must be -1 or in [0, %d)",
                       q->logprob_start_len, q->n_prompt);
    const char *bad = sampling_params_check(&q->sampling);
    if (bad) return set_err(err, errlen, "%s", bad);
    return 0;
}

int engine_generate(engine *e, const gen_request *reqs, gen_result *results, int n, char *err,
                    size_t errlen) {
    model *m = e->m;
    const model_config *c = &m->cfg;
    int V = c->vocab_size, S = e->kv.page_size;
    int max_pages = (c->max_position_embeddings + S - 1) / S;
    for (int i = 0; i < n; i++)
        if (engine_check_request(e, &reqs[i], err, errlen)) return -1;

    engine_seq *seqs = xcalloc(n, sizeof *seqs);
    int32_t *page_table = xcalloc((size_t)n * max_pages, sizeof(int32_t));
    int cap_T = e->chunk_tokens + n;
    int32_t *ids = xmalloc(cap_T * sizeof(int32_t)), *pos = xmalloc(cap_T * sizeof(int32_t));
    int32_t *seq_of = xmalloc(cap_T * sizeof(int32_t)), *rows = xmalloc(cap_T * sizeof(int32_t));
    int rc = 0;
    for (int i = 0; i < n; i++) {
        const gen_request *q = &reqs[i];
        gen_result *r = &results[i];
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
        seqs[i] = (engine_seq){.req = q, .res = r, .pages = page_table + (size_t)i * max_pages};
        seqs[i].tokens = xmalloc(((size_t)q->n_prompt + q->max_new_tokens + 1) * sizeof(int32_t));
        memcpy(seqs[i].tokens, q->prompt, q->n_prompt * sizeof(int32_t));
        seqs[i].n_tokens = q->n_prompt;
    }

    for (;;) {
        /* Build the step: decode tokens first (they always fit), then prompt chunks. */
        int T = 0, n_rows = 0, budget = e->chunk_tokens;
        int take[n > 0 ? n : 1];
        for (int pass = 0; pass < 2; pass++) {
            for (int i = 0; i < n; i++) {
                engine_seq *s = &seqs[i];
                int left = s->n_tokens - s->n_computed;
                bool decode = s->n_computed >= s->req->n_prompt;
                if (pass == 0) take[i] = 0;
                if (s->finished || left == 0 || decode != (pass == 0)) continue;
                int cnt = decode ? left : (left < budget ? left : budget);
                if (cnt <= 0) continue;
                if (!decode) budget -= cnt;
                int need_pages = (s->n_computed + cnt + S - 1) / S;
                while (s->n_pages < need_pages) {
                    int32_t p = kv_cache_alloc_page(&e->kv);
                    if (p < 0) {
                        rc = set_err(err, errlen, "KV cache: out of pages (%d of %d tokens)",
                                     e->kv.n_pages, S);
                        goto done;
                    }
                    s->pages[s->n_pages++] = p;
                }
                take[i] = cnt;
                const gen_request *q = s->req;
                /* prompt position i is scored by the row of position i - 1 */
                int score_from = q->return_logprob && q->logprob_start_len >= 0
                                     ? q->logprob_start_len - 1
                                     : q->n_prompt;
                for (int j = 0; j < cnt; j++) {
                    int p = s->n_computed + j;
                    ids[T] = s->tokens[p];
                    pos[T] = p;
                    seq_of[T] = i;
                    /* a row scores prompt token p + 1, or samples after the last token */
                    if ((p >= score_from && p + 1 < q->n_prompt) || p == s->n_tokens - 1)
                        rows[n_rows++] = T;
                    T++;
                }
            }
        }
        if (T == 0) break;
        if (n_rows > e->cap_logits) {
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
                            .logit_rows = rows};
        m->arch->forward(m, &e->kv, &fb, e->logits);

        /* Score and sample, in row order (rows are in batch order). */
        for (int r = 0; r < n_rows; r++) {
            int t = rows[r];
            engine_seq *s = &seqs[seq_of[t]];
            const gen_request *q = s->req;
            float *lg = e->logits + (size_t)r * V;
            int p = pos[t];
            if (p + 1 < q->n_prompt) {
                sampler_log_softmax(e->scratch, lg, V);
                s->res->input_logprobs[p + 1 - q->logprob_start_len] = e->scratch[s->tokens[p + 1]];
                continue;
            }
            if (q->max_new_tokens == 0) {
                s->res->finish = FINISH_LENGTH;
                s->finished = true;
                continue;
            }
            if (q->return_logprob) sampler_log_softmax(e->scratch, lg, V);
            float lp = q->return_logprob ? 0.0f : NAN;
            int32_t tok = sampler_sample(&q->sampling, lg, V, q->prompt, q->n_prompt,
                                         s->res->output_ids, s->res->n_output, (uint64_t)s->n_tokens);
            if (q->return_logprob) lp = e->scratch[tok];
            engine_seq_append(e, s, tok, lp);
        }
        for (int i = 0; i < n; i++) seqs[i].n_computed += take[i];
    }
done:
    for (int i = 0; i < n; i++) {
        for (int j = 0; j < seqs[i].n_pages; j++) kv_cache_release_page(&e->kv, seqs[i].pages[j]);
        free(seqs[i].tokens);
        if (rc) gen_result_free(&results[i]);
    }
    free(seqs);
    free(page_table);
    free(ids);
    free(pos);
    free(seq_of);
    free(rows);
    return rc;
}
