/* Prompts of the serving benchmark (see dataset.h). */
#include "scripts/bench/dataset.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

/* common English words; in most tokenizers each is one or two tokens */
static const char *const bench_words[] = {
    "the",   "of",    "and",   "to",     "in",   "is",    "you",    "that",   "it",    "he",
    "was",   "for",   "on",    "are",    "as",   "with",  "his",    "they",   "at",    "be",
    "this",  "have",  "from",  "or",     "one",  "had",   "by",     "word",   "but",   "not",
    "what",  "all",   "were",  "we",     "when", "your",  "can",    "said",   "there", "use",
    "an",    "each",  "which", "she",    "do",   "how",   "their",  "if",     "will",  "up",
    "other", "about", "out",   "many",   "then", "them",  "these",  "so",     "some",  "her",
    "would", "make",  "like",  "him",    "into", "time",  "has",    "look",   "two",   "more",
    "write", "go",    "see",   "number", "no",   "way",   "could",  "people", "my",    "than",
    "first", "water", "been",  "call",   "who",  "oil",   "its",    "now",    "find",  "long",
    "down",  "day",   "did",   "get",    "come", "made",  "may",    "part",   "money", "apples",
    "store", "week",  "price", "total",  "half", "bread", "garden", "left"};
#define BENCH_N_WORDS ((int)(sizeof bench_words / sizeof bench_words[0]))

void bench_random_lens(bench_rng *r, int *out, int n, int full, double ratio, int lo_min) {
    if (full <= 0) {
        memset(out, 0, (size_t)n * sizeof *out);
        return;
    }
    int lo = (int)(full * ratio); /* Python's int(): toward zero */
    if (lo < lo_min) lo = lo_min;
    if (lo > full) lo = full;
    for (int i = 0; i < n; i++)
        out[i] = (int)bench_rng_int(r, lo, full);
}

static bench_prompt *bench_prompts_new(int n) {
    bench_prompt *p = calloc((size_t)n + 1, sizeof *p);
    if (!p) bench_die("out of memory");
    return p;
}

bench_prompt *bench_dataset_random_ids(bench_rng *r, int n, int input_len, int output_len,
                                       double ratio, int vocab_size) {
    if (vocab_size <= 0)
        bench_die("random-ids needs the tokenizer's vocabulary size (--vocab-size)");
    int *in = bench_malloc((size_t)n * sizeof *in), *out = bench_malloc((size_t)n * sizeof *out);
    bench_random_lens(r, in, n, input_len, ratio, 1);
    bench_random_lens(r, out, n, output_len, ratio, 0);
    bench_prompt *p = bench_prompts_new(n);
    for (int i = 0; i < n; i++) {
        long offset = bench_rng_int(r, 0, vocab_size - 1);
        p[i].ids = bench_malloc((size_t)in[i] * sizeof *p[i].ids);
        for (int j = 0; j < in[i]; j++)
            p[i].ids[j] = (int)((offset + i + j) % vocab_size);
        p[i].n_ids = in[i];
        p[i].prompt_len = in[i];
        p[i].output_len = out[i];
    }
    free(in);
    free(out);
    return p;
}

/* the prompt text of a JSONL row (a fresh string), or NULL; a "question" takes GSM8K's form */
static char *bench_row_text(const cJSON *row) {
    static const char *const keys[] = {"prompt", "text"};
    for (int k = 0; k < 2; k++) {
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(row, keys[k]);
        if (v && cJSON_IsString(v) && v->valuestring[0]) return bench_strdup(v->valuestring);
    }
    const cJSON *q = cJSON_GetObjectItemCaseSensitive(row, "question");
    if (cJSON_IsString(q) && q->valuestring[0]) {
        bench_buf b = {0};
        bench_buf_appendf(&b, "Question: %s\nAnswer:", q->valuestring);
        return b.data;
    }
    const cJSON *conv = cJSON_GetObjectItemCaseSensitive(row, "conversations");
    if (!conv) conv = cJSON_GetObjectItemCaseSensitive(row, "conversation");
    const cJSON *first = cJSON_IsArray(conv) ? cJSON_GetArrayItem(conv, 0) : NULL;
    const cJSON *v = first ? cJSON_GetObjectItemCaseSensitive(first, "value") : NULL;
    if (v && cJSON_IsString(v) && v->valuestring[0]) return bench_strdup(v->valuestring);
    return NULL;
}

static void bench_shuffle(bench_rng *r, int *idx, int n) {
    for (int i = n - 1; i > 0; i--) {
        int j = (int)bench_rng_int(r, 0, i);
        int t = idx[i];
        idx[i] = idx[j];
        idx[j] = t;
    }
}

/* Documents of a text source: each JSONL row's text, or the whole of a plain file. */
static char **bench_read_docs(const char *path, int *n_docs) {
    FILE *f = fopen(path, "rb");
    if (!f) bench_die("cannot open %s: %s", path, strerror(errno));
    int c;
    while ((c = fgetc(f)) == ' ' || c == '\n' || c == '\r' || c == '\t')
        ;
    char **docs = NULL;
    *n_docs = 0;
    if (c == '{') {
        fclose(f);
        int n_rows;
        cJSON **rows = bench_jsonl_read(path, &n_rows);
        docs = bench_malloc((size_t)(n_rows + 1) * sizeof *docs);
        for (int i = 0; i < n_rows; i++) {
            char *t = bench_row_text(rows[i]);
            if (t) docs[(*n_docs)++] = t;
        }
        bench_jsonl_free(rows, n_rows);
    } else {
        bench_buf b = {0};
        if (c != EOF) {
            char ch = (char)c;
            bench_buf_append(&b, &ch, 1);
        }
        char chunk[65536];
        size_t got;
        while ((got = fread(chunk, 1, sizeof chunk, f)) > 0)
            bench_buf_append(&b, chunk, got);
        fclose(f);
        docs = bench_malloc(sizeof *docs);
        if (b.len) docs[(*n_docs)++] = b.data;
    }
    if (*n_docs == 0) bench_die("%s has no text to make prompts of", path);
    return docs;
}

/* the words of a text (split on blanks); *n gets the count; the words point into text */
static char **bench_split_words(char *text, int *n) {
    int cap = 64;
    char **w = bench_malloc((size_t)cap * sizeof *w);
    *n = 0;
    for (char *tok = strtok(text, " \t\r\n"); tok; tok = strtok(NULL, " \t\r\n")) {
        if (*n == cap) {
            cap *= 2;
            w = bench_realloc(w, (size_t)cap * sizeof *w);
        }
        w[(*n)++] = tok;
    }
    return w;
}

bench_prompt *bench_dataset_random_text(bench_rng *r, int n, int input_len, int output_len,
                                        double ratio, const char *path) {
    int *in = bench_malloc((size_t)n * sizeof *in), *out = bench_malloc((size_t)n * sizeof *out);
    bench_random_lens(r, in, n, input_len, ratio, 1);
    bench_random_lens(r, out, n, output_len, ratio, 0);
    bench_prompt *p = bench_prompts_new(n);
    int n_docs = 0;
    char **docs = path ? bench_read_docs(path, &n_docs) : NULL;
    int *order = NULL;
    if (docs) {
        order = bench_malloc((size_t)n_docs * sizeof *order);
        for (int i = 0; i < n_docs; i++)
            order[i] = i;
        bench_shuffle(r, order, n_docs);
    }
    int used = 0;
    for (int i = 0; i < n; i++) {
        bench_buf b = {0};
        bench_buf_append(&b, "", 0);
        if (docs) {
            /* the next document with words, repeated or cut to in[i] words */
            char **w = NULL;
            int nw = 0;
            for (int tries = 0; tries < n_docs && nw == 0; tries++) {
                free(w);
                char *copy = bench_strdup(docs[order[used++ % n_docs]]);
                w = bench_split_words(copy, &nw);
                if (nw == 0) {
                    free(copy);
                    continue;
                }
                for (int j = 0; j < in[i]; j++)
                    bench_buf_appendf(&b, "%s%s", j ? " " : "", w[j % nw]);
                free(copy);
            }
            free(w);
            if (nw == 0) bench_die("%s has no words to make prompts of", path);
        } else {
            for (int j = 0; j < in[i]; j++)
                bench_buf_appendf(&b, "%s%s", j ? " " : "",
                                  bench_words[bench_rng_int(r, 0, BENCH_N_WORDS - 1)]);
        }
        p[i].text = b.data;
        p[i].prompt_len = in[i];
        p[i].output_len = out[i];
    }
    for (int i = 0; docs && i < n_docs; i++)
        free(docs[i]);
    free(docs);
    free(order);
    free(in);
    free(out);
    return p;
}

static int bench_count_words(const char *s) {
    int n = 0, in_word = 0;
    for (; *s; s++) {
        int blank = *s == ' ' || *s == '\t' || *s == '\n' || *s == '\r';
        if (!blank && !in_word) n++;
        in_word = !blank;
    }
    return n;
}

bench_prompt *bench_dataset_jsonl(bench_rng *r, int n, const char *path, int output_len,
                                  double ratio) {
    if (!path) bench_die("--dataset jsonl needs --dataset-path FILE");
    int n_rows;
    cJSON **rows = bench_jsonl_read(path, &n_rows);
    int *order = bench_malloc((size_t)(n_rows + 1) * sizeof *order);
    int n_ok = 0;
    for (int i = 0; i < n_rows; i++) {
        char *t = bench_row_text(rows[i]);
        if (t) order[n_ok++] = i;
        free(t);
    }
    if (n_ok == 0)
        bench_die("%s: no row has a \"prompt\", \"text\", \"question\" or \"conversations\"", path);
    bench_shuffle(r, order, n_ok);
    int *out = bench_malloc((size_t)n * sizeof *out);
    bench_random_lens(r, out, n, output_len, ratio, 0);
    bench_prompt *p = bench_prompts_new(n);
    for (int i = 0; i < n; i++) {
        const cJSON *row = rows[order[i % n_ok]];
        p[i].text = bench_row_text(row);
        p[i].prompt_len = bench_count_words(p[i].text);
        const cJSON *ol = cJSON_GetObjectItemCaseSensitive(row, "output_len");
        p[i].output_len = cJSON_IsNumber(ol) && ol->valueint >= 0 ? ol->valueint : out[i];
    }
    free(out);
    free(order);
    bench_jsonl_free(rows, n_rows);
    return p;
}

void bench_prompts_free(bench_prompt *p, int n) {
    if (!p) return;
    for (int i = 0; i < n; i++) {
        free(p[i].text);
        free(p[i].ids);
    }
    free(p);
}
