/* Prompts of the serving benchmark. The client has no tokenizer, so:
 *   random-ids  token ids, SGLang's "random-ids": prompt i of length L_i is
 *               (offset_i + i + j) mod vocab for j < L_i, offset_i drawn from [0, vocab). Sent as
 *               input_ids (backend sglang) or as a prompt of ids (backend openai); its length is
 *               exact.
 *   random      text of L_i words: SGLang's "random" takes each prompt from a dataset's text and
 *               repeats or cuts it to L_i tokens; here the text of --dataset-path (JSONL rows'
 *               "prompt", "text", "question" or first "conversations" turn, else plain text) is
 *               repeated or cut to L_i words, and without a file the words are drawn from a
 *               built-in list of common English words. Its length in tokens is what the server
 *               reports (prompt_tokens), not L_i.
 *   jsonl       one prompt per row of --dataset-path ("prompt", "text", "question" as GSM8K's
 *               "Question: ...\nAnswer:", or the first "conversations" turn), rows shuffled;
 *               a row's "output_len" overrides the drawn output length.
 * Lengths are drawn as SGLang draws them: input uniformly from [max(int(L * r), 1), L], output
 * from [int(L_out * r), L_out], with r = --random-range-ratio. */
#ifndef MOESERVE_BENCH_DATASET_H
#define MOESERVE_BENCH_DATASET_H

#include "scripts/bench/util.h"

typedef struct {
    char *text; /* the prompt as text, or NULL when it is ids */
    int *ids;   /* the prompt as token ids (n_ids), or NULL */
    int n_ids;
    int prompt_len; /* tokens for ids; words for text (an estimate until the server counts) */
    int output_len; /* tokens to generate */
} bench_prompt;

/* n lengths drawn from [max(int(full * ratio), lo_min), full] (all 0 when full <= 0) */
void bench_random_lens(bench_rng *r, int *out, int n, int full, double ratio, int lo_min);

bench_prompt *bench_dataset_random_ids(bench_rng *r, int n, int input_len, int output_len,
                                       double ratio, int vocab_size);
bench_prompt *bench_dataset_random_text(bench_rng *r, int n, int input_len, int output_len,
                                        double ratio, const char *path /* NULL: built-in */);
bench_prompt *bench_dataset_jsonl(bench_rng *r, int n, const char *path, int output_len,
                                  double ratio);
void bench_prompts_free(bench_prompt *p, int n);

#endif
