/* Hugging Face tokenizer.json: byte-level BPE as used by Qwen, Llama-3 and DeepSeek.
 *
 * encode: added/special tokens are matched first (longest match at each position), the text
 * between them goes through the normalizer (NFC via utf8proc when the file has one), the
 * pre-tokenizer (Split with the file's own regex, run by PCRE2, then ByteLevel), and BPE merges
 * by rank; a post-processor that adds BOS (TemplateProcessing) is applied when add_special.
 * decode: ids -> bytes (byte-level alphabet reversed, added tokens verbatim); invalid UTF-8
 * becomes U+FFFD as in Hugging Face's decode.
 * Text <-> ids happens at the edge (server/); the runner sees ids only. */
#ifndef MOESERVE_TOKENIZER_H
#define MOESERVE_TOKENIZER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct tokenizer tokenizer;

/* Load path (a tokenizer.json). Returns NULL with a message naming the file and field for an
 * unsupported model type, pre-tokenizer, normalizer or a malformed file. */
tokenizer *tokenizer_load(const char *path, char *err, size_t errlen);
void tokenizer_free(tokenizer *tok);

/* Vocabulary size including added tokens (largest id + 1). */
int tokenizer_vocab_size(const tokenizer *tok);

/* The id of a token string (vocab or added), or -1. */
int tokenizer_token_id(const tokenizer *tok, const char *token);

/* True for added tokens marked "special": true. */
bool tokenizer_is_special(const tokenizer *tok, int id);

/* Encode len bytes of text. *ids is malloc'ed (caller frees), *n_ids its length. add_special
 * applies the post-processor's BOS/EOS template when the file has one. Returns 0, or -1 on
 * invalid input (never for valid UTF-8 text). */
int tokenizer_encode(const tokenizer *tok, const char *text, size_t len, bool add_special,
                     int32_t **ids, int *n_ids);

/* Decode ids to a malloc'ed NUL-terminated UTF-8 string (invalid sequences -> U+FFFD).
 * skip_special drops special added tokens. *len_out (may be NULL) gets the byte length. */
char *tokenizer_decode(const tokenizer *tok, const int32_t *ids, int n, bool skip_special,
                       size_t *len_out);

/* The raw bytes of one token (byte-level alphabet reversed), not NUL-terminated; NULL for an id
 * outside the vocabulary. */
const char *tokenizer_token_bytes(const tokenizer *tok, int id, size_t *len);

/* Incremental detokenizer for streaming: feed ids one at a time, get back only whole UTF-8
 * characters; bytes of an unfinished character wait for the next token. */
typedef struct {
    const tokenizer *tok;
    bool skip_special;
    char pending[8]; /* bytes of an incomplete UTF-8 character */
    int n_pending;
} detok_stream;

void detok_stream_init(detok_stream *s, const tokenizer *tok, bool skip_special);
/* Append the text that token id completes to *out (a malloc'ed buffer of *out_len bytes, *cap
 * capacity, grown as needed, kept NUL-terminated). Returns the number of bytes appended. */
size_t detok_stream_push(detok_stream *s, int32_t id, char **out, size_t *out_len, size_t *cap);
/* Flush what is pending at the end (incomplete bytes become U+FFFD). */
size_t detok_stream_finish(detok_stream *s, char **out, size_t *out_len, size_t *cap);

#endif
