/* Fuzz target: the tokenizer's encode, decode and streaming decode (server/tokenizer.c), over the
 * test tokenizers: tests/data/tokenizer.json (Qwen-style, NFC normalizer, byte-level BPE) and
 * tests/data/tokenizer_llama3.json (no normalizer, BOS post-processor).
 *
 * Input: byte 0 chooses the tokenizer (bit 0), add_special (bit 1) and skip_special (bit 2); the
 * rest is the text. Checked on every input, beyond what the sanitizers see:
 *   - every id encode gives is in the vocabulary;
 *   - the streaming decoder, fed one id at a time, gives exactly what decode gives at once;
 *   - valid UTF-8 text without NUL round-trips: decode(encode(x)) is x, or NFC(x) where the file
 *     normalizes (no special tokens added, none skipped);
 *   - the text's bytes read as 16-bit ids (some outside the vocabulary) decode without fault. */
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

#include "server/tokenizer.h"

typedef struct {
    const char *path;
    bool nfc;
    tokenizer *tok;
} fuzz_tok;

static fuzz_tok fuzz_toks[2] = {{"tests/data/tokenizer.json", true, NULL},
                                {"tests/data/tokenizer_llama3.json", false, NULL}};

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    const char *root = getenv("MOESERVE_ROOT");
    for (int i = 0; i < 2; i++) {
        char path[512], err[512];
        snprintf(path, sizeof path, "%s%s%s", root ? root : "", root ? "/" : "", fuzz_toks[i].path);
        fuzz_toks[i].tok = tokenizer_load(path, err, sizeof err);
        if (!fuzz_toks[i].tok) {
            fprintf(stderr, "fuzz_tokenizer: %s (run from the repository root, or set "
                            "MOESERVE_ROOT)\n", err);
            exit(1);
        }
    }
    return 0;
}

/* decode(ids) and the stream's output must agree; returns decode's text (caller frees). */
static char *fuzz_decode_both(const tokenizer *tok, const int32_t *ids, int n, bool skip) {
    size_t len;
    char *whole = tokenizer_decode(tok, ids, n, skip, &len);
    detok_stream ds;
    detok_stream_init(&ds, tok, skip);
    char *out = NULL;
    size_t out_len = 0, cap = 0;
    for (int i = 0; i < n; i++)
        detok_stream_push(&ds, ids[i], &out, &out_len, &cap);
    detok_stream_finish(&ds, &out, &out_len, &cap);
    if (out_len != len || (len && memcmp(out, whole, len))) {
        fprintf(stderr, "stream decode (%zu bytes) differs from decode (%zu bytes)\n", out_len,
                len);
        abort();
    }
    free(out);
    return whole;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    const fuzz_tok *ft = &fuzz_toks[data[0] & 1];
    const tokenizer *tok = ft->tok;
    bool add_special = data[0] & 2, skip = data[0] & 4;
    const char *text = (const char *)data + 1;
    size_t len = size - 1;
    int vocab = tokenizer_vocab_size(tok);

    int32_t *ids = NULL;
    int n = 0;
    if (tokenizer_encode(tok, text, len, add_special, &ids, &n) == 0) {
        for (int i = 0; i < n; i++)
            if (ids[i] < 0 || ids[i] >= vocab) abort();
        free(fuzz_decode_both(tok, ids, n, skip));
    }
    free(ids);

    /* round trip of valid UTF-8 */
    char *s = malloc(len + 1);
    memcpy(s, text, len);
    s[len] = 0;
    utf8proc_uint8_t *nfc = NULL;
    if (strlen(s) == len && utf8proc_decompose((const utf8proc_uint8_t *)s, (utf8proc_ssize_t)len,
                                               NULL, 0, 0) >= 0) {
        nfc = ft->nfc ? utf8proc_NFC((const utf8proc_uint8_t *)s) : NULL;
        const char *want = nfc ? (const char *)nfc : s;
        if (tokenizer_encode(tok, s, len, false, &ids, &n) != 0) abort(); /* valid text */
        char *back = fuzz_decode_both(tok, ids, n, false);
        if (strcmp(back, want)) {
            fprintf(stderr, "round trip of %zu bytes gave %zu bytes back\n", strlen(want),
                    strlen(back));
            abort();
        }
        free(back);
        free(ids);
    }
    free(nfc);
    free(s);

    /* the bytes as ids */
    int m = (int)(len / 2);
    int32_t *raw = malloc(((size_t)m + 1) * sizeof *raw);
    for (int i = 0; i < m; i++)
        raw[i] = (int32_t)((uint16_t)((unsigned char)text[2 * i] | (unsigned char)text[2 * i + 1] << 8) %
                           (unsigned)(vocab + 8)) - 4;
    free(fuzz_decode_both(tok, raw, m, skip));
    free(raw);
    return 0;
}
