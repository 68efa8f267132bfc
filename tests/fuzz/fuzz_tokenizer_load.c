/* Fuzz target: tokenizer.json loading (server/tokenizer.c: the model, added tokens, normalizer,
 * pre-tokenizer regexes, post-processor and decoder sections are all read and checked there).
 *
 * The input is the file. A tokenizer that loads must then encode and decode a fixed text with
 * special-token markers, odd bytes and a long run, and every id it gives must be inside its
 * vocabulary. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "server/tokenizer.h"
#include "tests/fuzz/fuzz_files.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fuzz_write("tokenizer.json", data, (long)size);
    char path[512], err[512];
    fuzz_path(path, sizeof path, "tokenizer.json");
    tokenizer *tok = tokenizer_load(path, err, sizeof err);
    if (!tok) return 0;
    static const char text[] = "Hello, world! <|im_start|>user\n  caf\xc3\xa9 \xe4\xb8\xad 12345 "
                               "\xf0\x9f\x98\x80<|endoftext|>aaaaaaaaaaaaaaaaaaaaaaaa\xff";
    int vocab = tokenizer_vocab_size(tok);
    for (int add = 0; add < 2; add++) {
        int32_t *ids = NULL;
        int n = 0;
        if (tokenizer_encode(tok, text, sizeof text - 2, add, &ids, &n) == 0) {
            for (int i = 0; i < n; i++)
                if (ids[i] < 0 || ids[i] >= vocab) abort();
            free(tokenizer_decode(tok, ids, n, add, NULL));
        }
        free(ids);
    }
    int32_t probe[] = {0, 1, vocab - 1, vocab, -1};
    free(tokenizer_decode(tok, probe, 5, false, NULL));
    tokenizer_token_id(tok, "<|im_start|>");
    tokenizer_free(tok);
    return 0;
}
