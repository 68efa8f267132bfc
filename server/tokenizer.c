/* Byte-level BPE from a Hugging Face tokenizer.json, meant to be token for token identical to
 * the Rust `tokenizers` library. Checked against it (tests/test_tokenizer.c) with Qwen2/3-style
 * and Llama-3-style files; DeepSeek's files use the same steps (several Splits, then ByteLevel).
 *
 * Choices:
 * - BPE runs on raw bytes, not on the GPT-2 "byte-to-unicode" characters: every vocab string
 *   made only of alphabet characters is mapped back to its bytes at load, so encode never builds
 *   the mapped string. The mapping is a bijection, so ranks and ids are unchanged.
 * - Merges are applied as the Rust `Word::merge_all` does: a min-heap ordered by (rank, position),
 *   stale entries re-validated against the merge table. This is O(n log n) per pre-token, so a
 *   long run of letters with no spaces is not quadratic.
 * - The Split regex is the file's own string run by PCRE2 (UTF + UCP, JIT). The only difference
 *   from Oniguruma (what `tokenizers` uses) that matters for these patterns is \s: PCRE2 also
 *   counts U+180E, Oniguruma follows the Unicode White_Space property. \s and \S are therefore
 *   rewritten into explicit White_Space classes before compiling.
 * - Added tokens are matched leftmost-longest (as the aho-corasick matcher does) before
 *   normalization for "normalized": false tokens and after it for "normalized": true ones.
 * - The tokenizer is read-only after load: encode keeps its scratch space on its own, so threads
 *   may share one tokenizer. There is no per-word cache for the same reason.
 * - Decoding reverses the byte alphabet for every token, added tokens included (the ByteLevel
 *   decoder does the same; a character outside the alphabet keeps the token's UTF-8 as is), then
 *   replaces each maximal invalid UTF-8 subsequence with U+FFFD as String::from_utf8_lossy. */
#define PCRE2_CODE_UNIT_WIDTH 8

#include "server/tokenizer.h"

#include "common/log.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <pcre2.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

/* Ids above this are taken for a corrupt file rather than allocated for. */
#define TOKENIZER_MAX_ID (1 << 24)

/* ---------------------------------------------------------------- small utilities */

/* Strings that live as long as the tokenizer, allocated from 64 KiB blocks. */
typedef struct arena_block {
    struct arena_block *next;
    size_t used, cap;
    char data[];
} arena_block;

static char *arena_alloc(arena_block **head, size_t n) {
    arena_block *b = *head;
    if (!b || b->cap - b->used < n) {
        size_t cap = n > 65536 ? n : 65536;
        arena_block *nb = xmalloc(sizeof(arena_block) + cap);
        nb->used = 0;
        nb->cap = cap;
        nb->next = b;
        *head = nb;
        b = nb;
    }
    char *p = b->data + b->used;
    b->used += n;
    return p;
}

static void arena_free(arena_block *b) {
    while (b) {
        arena_block *next = b->next;
        free(b);
        b = next;
    }
}

static uint64_t hash_bytes(const char *s, size_t n) {
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (size_t i = 0; i < n; i++)
        h = (h ^ (unsigned char)s[i]) * 1099511628211ull;
    return h ^ (h >> 29);
}

static uint64_t hash_u64(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    return x ^ (x >> 33);
}

/* Byte string -> id, open addressing. Keys are not owned (they point into the arena). */
typedef struct {
    const char *key; /* NULL: empty slot */
    uint32_t len;
    int32_t val;
} str_slot;

typedef struct {
    str_slot *slots;
    size_t mask, count;
} str_map;

static void str_map_init(str_map *m, size_t expect) {
    size_t cap = 16;
    while (cap < expect * 2)
        cap <<= 1;
    m->slots = xcalloc(cap, sizeof(str_slot));
    m->mask = cap - 1;
    m->count = 0;
}

static void str_map_put(str_map *m, const char *key, size_t len, int32_t val);

static void str_map_grow(str_map *m) {
    str_map old = *m;
    str_map_init(m, (old.mask + 1));
    for (size_t i = 0; i <= old.mask; i++)
        if (old.slots[i].key) str_map_put(m, old.slots[i].key, old.slots[i].len, old.slots[i].val);
    free(old.slots);
}

/* Insert or overwrite (a later duplicate wins, as when Rust collects into a HashMap). */
static void str_map_put(str_map *m, const char *key, size_t len, int32_t val) {
    if ((m->count + 1) * 2 > m->mask + 1) str_map_grow(m);
    size_t i = hash_bytes(key, len) & m->mask;
    while (m->slots[i].key) {
        if (m->slots[i].len == len && memcmp(m->slots[i].key, key, len) == 0) {
            m->slots[i].val = val;
            return;
        }
        i = (i + 1) & m->mask;
    }
    m->slots[i] = (str_slot){key, (uint32_t)len, val};
    m->count++;
}

static int32_t str_map_get(const str_map *m, const char *key, size_t len) {
    if (!m->slots) return -1;
    size_t i = hash_bytes(key, len) & m->mask;
    while (m->slots[i].key) {
        if (m->slots[i].len == len && memcmp(m->slots[i].key, key, len) == 0)
            return m->slots[i].val;
        i = (i + 1) & m->mask;
    }
    return -1;
}

/* (left id, right id) -> (rank, merged id). */
typedef struct {
    uint64_t key; /* UINT64_MAX: empty slot; ids are below 2^31 so no real key is */
    int32_t rank, new_id;
} merge_slot;

typedef struct {
    merge_slot *slots;
    size_t mask;
} merge_map;

static uint64_t merge_key(int32_t a, int32_t b) {
    return ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
}

static const merge_slot *merge_map_get(const merge_map *m, int32_t a, int32_t b) {
    if (!m->slots) return NULL;
    uint64_t key = merge_key(a, b);
    size_t i = hash_u64(key) & m->mask;
    while (m->slots[i].key != UINT64_MAX) {
        if (m->slots[i].key == key) return &m->slots[i];
        i = (i + 1) & m->mask;
    }
    return NULL;
}

/* ---------------------------------------------------------------- UTF-8 */

/* Look at the UTF-8 sequence at s[0..n): returns k > 0 for a complete valid character of k
 * bytes, -k for an invalid maximal subpart of k bytes (replaced by one U+FFFD), or 0 when all n
 * bytes are a valid but unfinished prefix. Ranges follow the Unicode table of well-formed byte
 * sequences, which is what from_utf8_lossy implements. */
static int utf8_scan(const unsigned char *s, size_t n) {
    unsigned char c = s[0];
    if (c < 0x80) return 1;
    int need;
    unsigned char lo = 0x80, hi = 0xBF;
    if (c >= 0xC2 && c <= 0xDF) {
        need = 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
        need = 3;
        if (c == 0xE0) lo = 0xA0;
        if (c == 0xED) hi = 0x9F;
    } else if (c >= 0xF0 && c <= 0xF4) {
        need = 4;
        if (c == 0xF0) lo = 0x90;
        if (c == 0xF4) hi = 0x8F;
    } else {
        return -1;
    }
    for (int i = 1; i < need; i++) {
        if ((size_t)i >= n) return 0;
        if (s[i] < lo || s[i] > hi) return -i;
        lo = 0x80;
        hi = 0xBF;
    }
    return need;
}

static bool utf8_valid(const char *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        int k = utf8_scan((const unsigned char *)s + i, n - i);
        if (k <= 0) return false;
        i += (size_t)k;
    }
    return true;
}

/* Decode the valid character at s (utf8_scan said k > 0). */
static int32_t utf8_decode(const unsigned char *s, int k) {
    switch (k) {
    case 1: return s[0];
    case 2: return ((s[0] & 0x1F) << 6) | (s[1] & 0x3F);
    case 3: return ((s[0] & 0x0F) << 12) | ((s[1] & 0x3F) << 6) | (s[2] & 0x3F);
    default:
        return ((s[0] & 0x07) << 18) | ((s[1] & 0x3F) << 12) | ((s[2] & 0x3F) << 6) | (s[3] & 0x3F);
    }
}

/* The code point that ends at s[end) (valid UTF-8 before end assumed). */
static int32_t utf8_last(const char *s, size_t end, size_t *start) {
    size_t i = end - 1;
    while (i > 0 && ((unsigned char)s[i] & 0xC0) == 0x80)
        i--;
    *start = i;
    return utf8_decode((const unsigned char *)s + i, (int)(end - i));
}

/* Rust char::is_whitespace: the Unicode White_Space property. */
static bool is_white_space(int32_t c) {
    return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
           (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F ||
           c == 0x205F || c == 0x3000;
}

/* Regex \w in Unicode mode (letters, marks, decimal digits, connector punctuation, joiners);
 * used for added tokens marked single_word. */
static bool is_word_char(int32_t c) {
    if (c == 0x200C || c == 0x200D) return true;
    switch (utf8proc_category(c)) {
    case UTF8PROC_CATEGORY_LU:
    case UTF8PROC_CATEGORY_LL:
    case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM:
    case UTF8PROC_CATEGORY_LO:
    case UTF8PROC_CATEGORY_MN:
    case UTF8PROC_CATEGORY_MC:
    case UTF8PROC_CATEGORY_ME:
    case UTF8PROC_CATEGORY_ND:
    case UTF8PROC_CATEGORY_NL:
    case UTF8PROC_CATEGORY_PC: return true;
    default: return false;
    }
}

/* ---------------------------------------------------------------- the GPT-2 byte alphabet */

/* Byte b is written as one code point: printable Latin-1 bytes stand for themselves, the
 * other 68 are shifted to U+0100.. in byte order. Only the inverse is needed (file strings to
 * bytes); it is built per tokenizer so that loading shares no mutable state between threads. */
#define BYTE_ALPHABET_END (256 + 68)

static void byte_alphabet_inverse(int16_t char_byte[BYTE_ALPHABET_END]) {
    int n = 0;
    for (int c = 0; c < BYTE_ALPHABET_END; c++)
        char_byte[c] = -1;
    for (int b = 0; b < 256; b++) {
        bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
        char_byte[printable ? b : 256 + n++] = (int16_t)b;
    }
}

/* ---------------------------------------------------------------- the tokenizer */

typedef struct {
    const char *str;   /* as written in the file (byte-level characters), NUL-terminated */
    const char *bytes; /* what the token decodes to */
    uint32_t n_bytes;
    bool present, special;
} tok_entry;

typedef struct {
    const char *content; /* matched text: normalized when the token is "normalized" */
    size_t len;
    int32_t id;
    bool special, single_word, lstrip, rstrip, normalized;
} added_token;

/* Added tokens of one kind (normalized or not), bucketed by first byte, longest first, so that
 * the first hit at a position is the longest. */
typedef struct {
    int *order;     /* indices into tokenizer.added */
    int start[257]; /* order[start[b] .. start[b+1]) begin with byte b */
    bool any;
} added_set;

typedef enum { PRE_SPLIT, PRE_BYTE_LEVEL } pre_kind;

typedef struct {
    pre_kind kind;
    pcre2_code *re;        /* Split's pattern, or GPT-2's for ByteLevel with use_regex */
    bool add_prefix_space; /* ByteLevel */
} pre_step;

struct tokenizer {
    int vocab_size;
    tok_entry *entries;  /* [vocab_size] */
    str_map vocab_bytes; /* raw bytes -> id, for BPE (tokens made only of alphabet characters) */
    str_map vocab_str;   /* file string -> id */
    str_map added_str;   /* added token content -> id */
    merge_map merges;
    int32_t byte_id[256];                 /* id of each single byte, -1 if missing */
    int16_t char_byte[BYTE_ALPHABET_END]; /* alphabet code point -> byte, -1 if not in it */
    bool ignore_merges;
    int32_t unk_id; /* -1: unknown bytes are dropped, as the Rust code does without unk_token */
    bool fuse_unk;
    added_token *added;
    int n_added;
    added_set added_raw, added_norm;
    bool nfc;
    pre_step *steps;
    int n_steps;
    int32_t *prefix, *suffix; /* post-processor template around $A */
    int n_prefix, n_suffix;
    arena_block *arena;
};

static const char gpt2_pattern[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

/* White_Space and its complement as class contents (see the header comment). */
static const char ws_class[] =
    "\\x{9}-\\x{d}\\x{20}\\x{85}\\x{a0}\\x{1680}\\x{2000}-\\x{200a}\\x{2028}\\x{2029}\\x{202f}"
    "\\x{205f}\\x{3000}";
static const char non_ws_class[] =
    "\\x{0}-\\x{8}\\x{e}-\\x{1f}\\x{21}-\\x{84}\\x{86}-\\x{9f}\\x{a1}-\\x{167f}\\x{1681}-\\x{1fff}"
    "\\x{200b}-\\x{2027}\\x{202a}-\\x{202e}\\x{2030}-\\x{205e}\\x{2060}-\\x{2fff}"
    "\\x{3001}-\\x{10ffff}";

/* Rewrite \s and \S into explicit classes; everything else is copied. Inside [...] the class
 * contents are spliced in (a union, which is right in both [..] and [^..]). */
static char *rewrite_space_escapes(const char *pat) {
    size_t n = strlen(pat), cap = n * 4 + 64, o = 0;
    char *out = xmalloc(cap);
    bool in_class = false;
    for (size_t i = 0; i < n; i++) {
        char c = pat[i];
        size_t need = o + sizeof(non_ws_class) + 8;
        if (need > cap) {
            cap = need * 2;
            out = xrealloc(out, cap);
        }
        if (c == '\\' && i + 1 < n) {
            char e = pat[i + 1];
            if (e == 's' || e == 'S') {
                const char *cls = e == 's' ? ws_class : non_ws_class;
                if (!in_class) out[o++] = '[';
                memcpy(out + o, cls, strlen(cls));
                o += strlen(cls);
                if (!in_class) out[o++] = ']';
            } else {
                out[o++] = c;
                out[o++] = e;
            }
            i++;
            continue;
        }
        if (!in_class && c == '[') {
            in_class = true;
            out[o++] = c;
            /* A ']' right after '[' or '[^' is a literal. */
            if (i + 1 < n && pat[i + 1] == '^') out[o++] = pat[++i];
            if (i + 1 < n && pat[i + 1] == ']') out[o++] = pat[++i];
            continue;
        }
        if (in_class && c == '[' && i + 1 < n && pat[i + 1] == ':') {
            const char *end = strstr(pat + i + 2, ":]"); /* POSIX class inside a class */
            if (end) {
                size_t k = (size_t)(end + 2 - (pat + i));
                if (o + k + 8 > cap) {
                    cap = (o + k) * 2 + 64;
                    out = xrealloc(out, cap);
                }
                memcpy(out + o, pat + i, k);
                o += k;
                i += k - 1;
                continue;
            }
        }
        if (in_class && c == ']') in_class = false;
        out[o++] = c;
    }
    out[o] = 0;
    return out;
}

static pcre2_code *compile_regex(const char *pattern, bool literal, const char *path,
                                 const char *field, char *err, size_t errlen) {
    char *pat = literal ? xstrdup(pattern) : rewrite_space_escapes(pattern);
    int code;
    PCRE2_SIZE off;
    uint32_t opts = PCRE2_UTF | PCRE2_UCP | (literal ? PCRE2_LITERAL : 0);
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)pat, PCRE2_ZERO_TERMINATED, opts, &code, &off, NULL);
    free(pat);
    if (!re) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(code, msg, sizeof msg);
        set_err(err, errlen, "%s: %s: regex \"%s\" does not compile: %s", path, field, pattern,
                (char *)msg);
        return NULL;
    }
    /* Without JIT (not built in, or no executable memory) the interpreter gives the same
     * matches, only slower. */
    pcre2_jit_compile(re, PCRE2_JIT_COMPLETE);
    return re;
}

void tokenizer_free(tokenizer *tok) {
    if (!tok) return;
    free(tok->entries);
    free(tok->vocab_bytes.slots);
    free(tok->vocab_str.slots);
    free(tok->added_str.slots);
    free(tok->merges.slots);
    free(tok->added);
    free(tok->added_raw.order);
    free(tok->added_norm.order);
    for (int i = 0; i < tok->n_steps; i++)
        pcre2_code_free(tok->steps[i].re);
    free(tok->steps);
    free(tok->prefix);
    free(tok->suffix);
    arena_free(tok->arena);
    free(tok);
}

/* ---------------------------------------------------------------- loading */

static char *read_whole_file(const char *path, size_t *len, char *err, size_t errlen) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        set_err(err, errlen, "%s: cannot open: %s", path, strerror(errno));
        return NULL;
    }
    size_t cap = 1 << 16, n = 0;
    char *buf = xmalloc(cap);
    for (;;) {
        if (n == cap) buf = xrealloc(buf, cap *= 2);
        size_t got = fread(buf + n, 1, cap - n, f);
        n += got;
        if (got == 0) break;
    }
    bool bad = ferror(f);
    fclose(f);
    if (bad) {
        free(buf);
        set_err(err, errlen, "%s: read error", path);
        return NULL;
    }
    *len = n;
    return buf;
}

static char *arena_dup(tokenizer *tok, const char *s, size_t n) {
    char *p = arena_alloc(&tok->arena, n + 1);
    memcpy(p, s, n);
    p[n] = 0;
    return p;
}

/* The bytes a file-form token string stands for: each character reversed through the byte
 * alphabet, or, when one character is outside it, the string's own UTF-8 (what the ByteLevel
 * decoder does). *in_alphabet says which. */
static const char *token_string_bytes(tokenizer *tok, const char *s, size_t n, uint32_t *n_out,
                                      bool *in_alphabet) {
    char *out = arena_alloc(&tok->arena, n + 1);
    size_t o = 0, i = 0;
    *in_alphabet = true;
    while (i < n) {
        int k = utf8_scan((const unsigned char *)s + i, n - i);
        if (k <= 0) {
            *in_alphabet = false;
            break;
        }
        int32_t c = utf8_decode((const unsigned char *)s + i, k);
        if (c >= BYTE_ALPHABET_END || tok->char_byte[c] < 0) {
            *in_alphabet = false;
            break;
        }
        out[o++] = (char)tok->char_byte[c];
        i += (size_t)k;
    }
    if (!*in_alphabet) {
        memcpy(out, s, n);
        o = n;
    }
    out[o] = 0;
    *n_out = (uint32_t)o;
    return out;
}

/* The range is checked before the value is taken as an integer: converting a double outside
 * int64_t (1e300 in a file) is undefined. */
static bool json_is_int(const cJSON *v, int64_t lo, int64_t hi) {
    if (!cJSON_IsNumber(v)) return false;
    double d = v->valuedouble;
    return d >= (double)lo && d <= (double)hi && d == (double)(int64_t)d;
}

static const char *json_type_name(const cJSON *v) {
    const cJSON *t = cJSON_GetObjectItemCaseSensitive(v, "type");
    return cJSON_IsString(t) ? t->valuestring : NULL;
}

static bool json_flag(const cJSON *obj, const char *name, bool dflt) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, name);
    if (cJSON_IsBool(v)) return cJSON_IsTrue(v);
    return dflt;
}

/* NFC of s[0..n) into a malloc'ed buffer; s must be valid UTF-8. */
static char *nfc_dup(const char *s, size_t n, size_t *n_out) {
    utf8proc_uint8_t *dst = NULL;
    utf8proc_ssize_t r = utf8proc_map((const utf8proc_uint8_t *)s, (utf8proc_ssize_t)n, &dst,
                                      (utf8proc_option_t)(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
    if (r < 0) return NULL;
    *n_out = (size_t)r;
    return (char *)dst;
}

static int load_model(tokenizer *tok, const cJSON *model, const char *path, char *err,
                      size_t errlen) {
    if (!cJSON_IsObject(model)) return set_err(err, errlen, "%s: field \"model\" is missing", path);
    const char *type = json_type_name(model);
    const cJSON *merges = cJSON_GetObjectItemCaseSensitive(model, "merges");
    /* Old files leave out "type"; a model with merges is BPE, as the Rust loader infers. */
    if (type ? strcmp(type, "BPE") != 0 : !merges)
        return set_err(err, errlen, "%s: model.type \"%s\" is not supported (only \"BPE\")", path,
                       type ? type : "(none)");
    const cJSON *vocab = cJSON_GetObjectItemCaseSensitive(model, "vocab");
    if (!cJSON_IsObject(vocab))
        return set_err(err, errlen, "%s: model.vocab must be an object of token -> id", path);
    if (!cJSON_IsArray(merges))
        return set_err(err, errlen, "%s: model.merges must be an array", path);
    const char *unsupported[] = {"continuing_subword_prefix", "end_of_word_suffix"};
    for (int i = 0; i < 2; i++) {
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(model, unsupported[i]);
        if (cJSON_IsString(v) && v->valuestring[0])
            return set_err(err, errlen, "%s: model.%s is not supported by byte-level BPE", path,
                           unsupported[i]);
    }
    if (json_flag(model, "byte_fallback", false))
        return set_err(err, errlen, "%s: model.byte_fallback is not supported by byte-level BPE",
                       path);
    const cJSON *dropout = cJSON_GetObjectItemCaseSensitive(model, "dropout");
    if (cJSON_IsNumber(dropout) && dropout->valuedouble != 0.0)
        return set_err(err, errlen, "%s: model.dropout is not supported (inference only)", path);
    tok->ignore_merges = json_flag(model, "ignore_merges", false);
    tok->fuse_unk = json_flag(model, "fuse_unk", false);

    /* First pass: the largest id, so entries can be an array. */
    int max_id = -1, n_vocab = 0;
    for (const cJSON *e = vocab->child; e; e = e->next) {
        if (!json_is_int(e, 0, TOKENIZER_MAX_ID))
            return set_err(err, errlen, "%s: model.vocab[\"%s\"] is not an id in [0, %d]", path,
                           e->string, TOKENIZER_MAX_ID);
        if ((int)e->valuedouble > max_id) max_id = (int)e->valuedouble;
        n_vocab++;
    }
    tok->vocab_size = max_id + 1;
    tok->entries = xcalloc((size_t)tok->vocab_size + 1, sizeof(tok_entry));
    str_map_init(&tok->vocab_bytes, (size_t)n_vocab);
    str_map_init(&tok->vocab_str, (size_t)n_vocab);
    for (int b = 0; b < 256; b++)
        tok->byte_id[b] = -1;
    for (const cJSON *e = vocab->child; e; e = e->next) {
        int id = (int)e->valuedouble;
        size_t n = strlen(e->string);
        const char *s = arena_dup(tok, e->string, n);
        bool in_alphabet;
        uint32_t nb;
        const char *bytes = token_string_bytes(tok, s, n, &nb, &in_alphabet);
        tok->entries[id] = (tok_entry){s, bytes, nb, true, false};
        str_map_put(&tok->vocab_str, s, n, id);
        if (in_alphabet) {
            str_map_put(&tok->vocab_bytes, bytes, nb, id);
            if (nb == 1) tok->byte_id[(unsigned char)bytes[0]] = id;
        }
    }

    tok->unk_id = -1;
    const cJSON *unk = cJSON_GetObjectItemCaseSensitive(model, "unk_token");
    if (cJSON_IsString(unk)) {
        tok->unk_id = str_map_get(&tok->vocab_str, unk->valuestring, strlen(unk->valuestring));
        if (tok->unk_id < 0)
            return set_err(err, errlen, "%s: model.unk_token \"%s\" is not in model.vocab", path,
                           unk->valuestring);
    }

    int n_merges = cJSON_GetArraySize(merges);
    size_t cap = 16;
    while (cap < (size_t)n_merges * 2)
        cap <<= 1;
    tok->merges.slots = xmalloc(cap * sizeof(merge_slot));
    tok->merges.mask = cap - 1;
    for (size_t i = 0; i < cap; i++)
        tok->merges.slots[i].key = UINT64_MAX;
    int rank = 0;
    char *joined = NULL;
    size_t joined_cap = 0;
    for (const cJSON *m = merges->child; m; m = m->next, rank++) {
        const char *a, *b;
        size_t na, nb;
        if (cJSON_IsString(m)) { /* "a b": exactly one space (byte-level tokens have none) */
            const char *sp = strchr(m->valuestring, ' ');
            if (!sp || strchr(sp + 1, ' ')) {
                free(joined);
                return set_err(err, errlen, "%s: model.merges[%d] \"%s\" is not \"a b\"", path,
                               rank, m->valuestring);
            }
            a = m->valuestring;
            na = (size_t)(sp - a);
            b = sp + 1;
            nb = strlen(b);
        } else if (cJSON_IsArray(m) && cJSON_GetArraySize(m) == 2 && cJSON_IsString(m->child) &&
                   cJSON_IsString(m->child->next)) {
            a = m->child->valuestring;
            na = strlen(a);
            b = m->child->next->valuestring;
            nb = strlen(b);
        } else {
            free(joined);
            return set_err(err, errlen, "%s: model.merges[%d] is neither \"a b\" nor [a, b]", path,
                           rank);
        }
        if (na + nb + 1 > joined_cap) {
            joined_cap = (na + nb + 1) * 2;
            joined = xrealloc(joined, joined_cap);
        }
        memcpy(joined, a, na);
        memcpy(joined + na, b, nb);
        int32_t ia = str_map_get(&tok->vocab_str, a, na);
        int32_t ib = str_map_get(&tok->vocab_str, b, nb);
        int32_t inew = str_map_get(&tok->vocab_str, joined, na + nb);
        if (ia < 0 || ib < 0 || inew < 0) {
            free(joined);
            return set_err(err, errlen,
                           "%s: model.merges[%d]: a token of the merge is not in "
                           "model.vocab",
                           path, rank);
        }
        uint64_t key = merge_key(ia, ib);
        size_t j = hash_u64(key) & tok->merges.mask;
        while (tok->merges.slots[j].key != UINT64_MAX && tok->merges.slots[j].key != key)
            j = (j + 1) & tok->merges.mask;
        tok->merges.slots[j] = (merge_slot){key, rank, inew};
    }
    free(joined);
    return 0;
}

static int cmp_added_order(const void *pa, const void *pb, void *ctx) {
    const added_token *added = ctx;
    const added_token *a = &added[*(const int *)pa], *b = &added[*(const int *)pb];
    unsigned char fa = (unsigned char)a->content[0], fb = (unsigned char)b->content[0];
    if (fa != fb) return fa < fb ? -1 : 1;
    if (a->len != b->len) return a->len > b->len ? -1 : 1;
    return *(const int *)pa - *(const int *)pb;
}

static void added_set_build(tokenizer *tok, added_set *set, bool normalized) {
    set->order = xmalloc(((size_t)tok->n_added + 1) * sizeof(int));
    int n = 0;
    for (int i = 0; i < tok->n_added; i++)
        if (tok->added[i].normalized == normalized && tok->added[i].len > 0) set->order[n++] = i;
    qsort_r(set->order, (size_t)n, sizeof(int), cmp_added_order, tok->added);
    int k = 0;
    for (int b = 0; b <= 256; b++) {
        set->start[b] = k;
        while (b < 256 && k < n && (unsigned char)tok->added[set->order[k]].content[0] == b)
            k++;
    }
    set->any = n > 0;
}

static int load_added_tokens(tokenizer *tok, const cJSON *arr, const char *path, char *err,
                             size_t errlen) {
    if (!arr || cJSON_IsNull(arr)) arr = NULL;
    if (arr && !cJSON_IsArray(arr))
        return set_err(err, errlen, "%s: added_tokens must be an array", path);
    int n = arr ? cJSON_GetArraySize(arr) : 0;
    tok->added = xcalloc((size_t)n + 1, sizeof(added_token));
    str_map_init(&tok->added_str, (size_t)n);
    int max_id = tok->vocab_size - 1;
    for (const cJSON *a = arr ? arr->child : NULL; a; a = a->next) {
        const cJSON *id = cJSON_GetObjectItemCaseSensitive(a, "id");
        const cJSON *content = cJSON_GetObjectItemCaseSensitive(a, "content");
        if (!json_is_int(id, 0, TOKENIZER_MAX_ID) || !cJSON_IsString(content))
            return set_err(err, errlen,
                           "%s: added_tokens[%d] needs an integer id and a string "
                           "content",
                           path, tok->n_added);
        added_token *t = &tok->added[tok->n_added++];
        t->id = (int32_t)id->valuedouble;
        t->special = json_flag(a, "special", false);
        t->single_word = json_flag(a, "single_word", false);
        t->lstrip = json_flag(a, "lstrip", false);
        t->rstrip = json_flag(a, "rstrip", false);
        t->normalized = json_flag(a, "normalized", !t->special);
        size_t len = strlen(content->valuestring);
        t->content = arena_dup(tok, content->valuestring, len);
        t->len = len;
        if (t->id > max_id) max_id = t->id;
    }
    if (max_id + 1 > tok->vocab_size) {
        tok->entries = xrealloc(tok->entries, ((size_t)max_id + 2) * sizeof(tok_entry));
        memset(tok->entries + tok->vocab_size, 0,
               ((size_t)max_id + 2 - (size_t)tok->vocab_size) * sizeof(tok_entry));
        tok->vocab_size = max_id + 1;
    }
    for (int i = 0; i < tok->n_added; i++) {
        added_token *t = &tok->added[i];
        bool in_alphabet;
        uint32_t nb;
        const char *bytes = token_string_bytes(tok, t->content, t->len, &nb, &in_alphabet);
        /* An id listed both in the vocab and as an added token decodes as the added token. */
        tok->entries[t->id] = (tok_entry){t->content, bytes, nb, true, t->special};
        str_map_put(&tok->added_str, t->content, t->len, t->id);
    }
    return 0;
}

/* Once the normalizer is known, normalized added tokens are matched in their normalized form. */
static void normalize_added_tokens(tokenizer *tok) {
    for (int i = 0; i < tok->n_added; i++) {
        added_token *t = &tok->added[i];
        if (!t->normalized || !tok->nfc || !utf8_valid(t->content, t->len)) continue;
        size_t n;
        char *s = nfc_dup(t->content, t->len, &n);
        if (!s) continue;
        t->content = arena_dup(tok, s, n);
        t->len = n;
        free(s);
    }
}

static int load_normalizer(tokenizer *tok, const cJSON *norm, const char *path, char *err,
                           size_t errlen) {
    if (!norm || cJSON_IsNull(norm)) return 0;
    const char *type = json_type_name(norm);
    if (type && strcmp(type, "NFC") == 0) {
        tok->nfc = true;
        return 0;
    }
    if (type && strcmp(type, "Sequence") == 0) {
        const cJSON *list = cJSON_GetObjectItemCaseSensitive(norm, "normalizers");
        if (cJSON_IsArray(list)) {
            for (const cJSON *n = list->child; n; n = n->next) {
                const char *t = json_type_name(n);
                if (!t || strcmp(t, "NFC") != 0)
                    return set_err(err, errlen,
                                   "%s: normalizer: \"%s\" in the Sequence is not "
                                   "supported (only NFC)",
                                   path, t ? t : "(no type)");
                tok->nfc = true;
            }
            return 0;
        }
    }
    return set_err(err, errlen,
                   "%s: normalizer \"%s\" is not supported (null, NFC, or a "
                   "Sequence of NFC)",
                   path, type ? type : "(no type)");
}

static int add_pre_step(tokenizer *tok, const cJSON *p, const char *path, char *err,
                        size_t errlen) {
    const char *type = json_type_name(p);
    if (type && strcmp(type, "Split") == 0) {
        const cJSON *pattern = cJSON_GetObjectItemCaseSensitive(p, "pattern");
        const cJSON *behavior = cJSON_GetObjectItemCaseSensitive(p, "behavior");
        const cJSON *regex = cJSON_GetObjectItemCaseSensitive(pattern, "Regex");
        const cJSON *literal = cJSON_GetObjectItemCaseSensitive(pattern, "String");
        if (!cJSON_IsString(regex) && !cJSON_IsString(literal))
            return set_err(err, errlen,
                           "%s: pre_tokenizer Split needs pattern {\"Regex\": ...} "
                           "or {\"String\": ...}",
                           path);
        if (!cJSON_IsString(behavior) || strcmp(behavior->valuestring, "Isolated") != 0)
            return set_err(err, errlen,
                           "%s: pre_tokenizer Split behavior \"%s\" is not "
                           "supported (only Isolated)",
                           path, cJSON_IsString(behavior) ? behavior->valuestring : "(none)");
        if (json_flag(p, "invert", false))
            return set_err(err, errlen, "%s: pre_tokenizer Split with invert is not supported",
                           path);
        if (tok->n_steps > 0 && tok->steps[tok->n_steps - 1].kind == PRE_BYTE_LEVEL)
            return set_err(err, errlen,
                           "%s: pre_tokenizer: a Split after ByteLevel is not "
                           "supported",
                           path);
        pcre2_code *re = compile_regex(regex ? regex->valuestring : literal->valuestring, !regex,
                                       path, "pre_tokenizer", err, errlen);
        if (!re) return -1;
        tok->steps = xrealloc(tok->steps, (size_t)(tok->n_steps + 1) * sizeof(pre_step));
        tok->steps[tok->n_steps++] = (pre_step){PRE_SPLIT, re, false};
        return 0;
    }
    if (type && strcmp(type, "ByteLevel") == 0) {
        if (tok->n_steps > 0 && tok->steps[tok->n_steps - 1].kind == PRE_BYTE_LEVEL)
            return set_err(err, errlen, "%s: pre_tokenizer: two ByteLevel steps", path);
        pcre2_code *re = NULL;
        if (json_flag(p, "use_regex", true)) {
            re = compile_regex(gpt2_pattern, false, path, "pre_tokenizer", err, errlen);
            if (!re) return -1;
        }
        tok->steps = xrealloc(tok->steps, (size_t)(tok->n_steps + 1) * sizeof(pre_step));
        tok->steps[tok->n_steps++] =
            (pre_step){PRE_BYTE_LEVEL, re, json_flag(p, "add_prefix_space", true)};
        return 0;
    }
    return set_err(err, errlen,
                   "%s: pre_tokenizer \"%s\" is not supported (Split, ByteLevel, or "
                   "a Sequence of them)",
                   path, type ? type : "(no type)");
}

static int load_pre_tokenizer(tokenizer *tok, const cJSON *pre, const char *path, char *err,
                              size_t errlen) {
    const char *type = pre ? json_type_name(pre) : NULL;
    if (type && strcmp(type, "Sequence") == 0) {
        const cJSON *list = cJSON_GetObjectItemCaseSensitive(pre, "pretokenizers");
        if (!cJSON_IsArray(list))
            return set_err(err, errlen, "%s: pre_tokenizer Sequence needs \"pretokenizers\"", path);
        for (const cJSON *p = list->child; p; p = p->next)
            if (add_pre_step(tok, p, path, err, errlen)) return -1;
    } else if (pre && !cJSON_IsNull(pre)) {
        if (add_pre_step(tok, pre, path, err, errlen)) return -1;
    }
    /* BPE here runs on bytes, which is only right when ByteLevel maps the text to bytes last. */
    if (tok->n_steps == 0 || tok->steps[tok->n_steps - 1].kind != PRE_BYTE_LEVEL)
        return set_err(err, errlen,
                       "%s: pre_tokenizer must end with ByteLevel (only byte-level "
                       "BPE is supported)",
                       path);
    return 0;
}

static int template_ids(tokenizer *tok, const cJSON *proc, const char *path, char *err,
                        size_t errlen) {
    const cJSON *single = cJSON_GetObjectItemCaseSensitive(proc, "single");
    const cJSON *specials = cJSON_GetObjectItemCaseSensitive(proc, "special_tokens");
    if (!cJSON_IsArray(single))
        return set_err(err, errlen, "%s: post_processor TemplateProcessing needs \"single\"", path);
    int n_seq = 0;
    for (const cJSON *item = single->child; item; item = item->next) {
        const cJSON *seq = cJSON_GetObjectItemCaseSensitive(item, "Sequence");
        const cJSON *sp = cJSON_GetObjectItemCaseSensitive(item, "SpecialToken");
        if (seq) {
            const cJSON *sid = cJSON_GetObjectItemCaseSensitive(seq, "id");
            if (!cJSON_IsString(sid) || strcmp(sid->valuestring, "A") != 0 || n_seq++)
                return set_err(err, errlen,
                               "%s: post_processor: the single template must hold "
                               "$A exactly once",
                               path);
            continue;
        }
        const cJSON *name = cJSON_GetObjectItemCaseSensitive(sp, "id");
        const cJSON *def = cJSON_IsString(name)
                               ? cJSON_GetObjectItemCaseSensitive(specials, name->valuestring)
                               : NULL;
        const cJSON *ids = cJSON_GetObjectItemCaseSensitive(def, "ids");
        if (!cJSON_IsArray(ids))
            return set_err(err, errlen,
                           "%s: post_processor: template item is neither $A nor a "
                           "special token listed in special_tokens",
                           path);
        for (const cJSON *id = ids->child; id; id = id->next) {
            if (!json_is_int(id, 0, tok->vocab_size - 1))
                return set_err(err, errlen, "%s: post_processor: special token id out of range",
                               path);
            int32_t v = (int32_t)id->valuedouble;
            if (n_seq == 0) {
                tok->prefix = xrealloc(tok->prefix, (size_t)(tok->n_prefix + 1) * sizeof(int32_t));
                tok->prefix[tok->n_prefix++] = v;
            } else {
                tok->suffix = xrealloc(tok->suffix, (size_t)(tok->n_suffix + 1) * sizeof(int32_t));
                tok->suffix[tok->n_suffix++] = v;
            }
        }
    }
    if (n_seq != 1)
        return set_err(err, errlen, "%s: post_processor: the single template has no $A", path);
    return 0;
}

static int load_post_processor(tokenizer *tok, const cJSON *proc, const char *path, char *err,
                               size_t errlen, int depth) {
    if (!proc || cJSON_IsNull(proc)) return 0;
    const char *type = json_type_name(proc);
    if (type && strcmp(type, "ByteLevel") == 0) return 0; /* offsets only */
    if (type && strcmp(type, "TemplateProcessing") == 0) {
        if (tok->n_prefix || tok->n_suffix)
            return set_err(err, errlen, "%s: post_processor: more than one template", path);
        return template_ids(tok, proc, path, err, errlen);
    }
    if (type && strcmp(type, "Sequence") == 0 && depth == 0) {
        const cJSON *list = cJSON_GetObjectItemCaseSensitive(proc, "processors");
        for (const cJSON *p = cJSON_IsArray(list) ? list->child : NULL; p; p = p->next)
            if (load_post_processor(tok, p, path, err, errlen, 1)) return -1;
        return 0;
    }
    return set_err(err, errlen,
                   "%s: post_processor \"%s\" is not supported (null, ByteLevel, "
                   "TemplateProcessing)",
                   path, type ? type : "(no type)");
}

static int load_decoder(const cJSON *dec, const char *path, char *err, size_t errlen) {
    if (!dec || cJSON_IsNull(dec)) return 0;
    const char *type = json_type_name(dec);
    if (type && strcmp(type, "ByteLevel") == 0) return 0;
    return set_err(err, errlen, "%s: decoder \"%s\" is not supported (only ByteLevel)", path,
                   type ? type : "(no type)");
}

tokenizer *tokenizer_load(const char *path, char *err, size_t errlen) {
    size_t len;
    char *text = read_whole_file(path, &len, err, errlen);
    if (!text) return NULL;
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(text, len, &end, false);
    if (!root) {
        size_t at = end ? (size_t)(end - text) : 0;
        set_err(err, errlen, "%s: malformed JSON near byte %zu", path, at);
        free(text);
        return NULL;
    }
    free(text);
    tokenizer *tok = xcalloc(1, sizeof(tokenizer));
    byte_alphabet_inverse(tok->char_byte);
    int rc = -1;
    if (!cJSON_IsObject(root)) {
        set_err(err, errlen, "%s: the top level is not a JSON object", path);
        goto done;
    }
    if (load_model(tok, cJSON_GetObjectItemCaseSensitive(root, "model"), path, err, errlen))
        goto done;
    if (load_added_tokens(tok, cJSON_GetObjectItemCaseSensitive(root, "added_tokens"), path, err,
                          errlen))
        goto done;
    if (load_normalizer(tok, cJSON_GetObjectItemCaseSensitive(root, "normalizer"), path, err,
                        errlen))
        goto done;
    if (load_pre_tokenizer(tok, cJSON_GetObjectItemCaseSensitive(root, "pre_tokenizer"), path, err,
                           errlen))
        goto done;
    if (load_post_processor(tok, cJSON_GetObjectItemCaseSensitive(root, "post_processor"), path,
                            err, errlen, 0))
        goto done;
    if (load_decoder(cJSON_GetObjectItemCaseSensitive(root, "decoder"), path, err, errlen))
        goto done;
    normalize_added_tokens(tok);
    added_set_build(tok, &tok->added_raw, false);
    added_set_build(tok, &tok->added_norm, true);
    rc = 0;
done:
    cJSON_Delete(root);
    if (rc) {
        tokenizer_free(tok);
        return NULL;
    }
    return tok;
}

/* ---------------------------------------------------------------- lookups */

int tokenizer_vocab_size(const tokenizer *tok) { return tok->vocab_size; }

int tokenizer_token_id(const tokenizer *tok, const char *token) {
    size_t n = strlen(token);
    int32_t id = str_map_get(&tok->added_str, token, n);
    return id >= 0 ? id : str_map_get(&tok->vocab_str, token, n);
}

bool tokenizer_is_special(const tokenizer *tok, int id) {
    return id >= 0 && id < tok->vocab_size && tok->entries[id].special;
}

const char *tokenizer_token_bytes(const tokenizer *tok, int id, size_t *len) {
    if (id < 0 || id >= tok->vocab_size || !tok->entries[id].present) return NULL;
    *len = tok->entries[id].n_bytes;
    return tok->entries[id].bytes;
}

/* ---------------------------------------------------------------- encoding */

typedef struct {
    int32_t rank, new_id;
    int pos;
} bpe_merge;

/* Per-call state: nothing here is shared between threads. */
typedef struct {
    const tokenizer *tok;
    int32_t *ids;
    size_t n_ids, cap_ids;
    /* BPE symbols: a doubly linked list over an array (prev/next indices, -1 at the ends). */
    int32_t *sym_id;
    int *sym_prev, *sym_next;
    size_t cap_sym;
    bpe_merge *heap;
    size_t n_heap, cap_heap;
    pcre2_match_data **md; /* one per pre-tokenizer step */
    char *prefix_buf;      /* ByteLevel add_prefix_space: " " + piece */
    size_t cap_prefix;
    int failed;
} encode_ctx;

static void emit(encode_ctx *c, int32_t id) {
    if (c->n_ids == c->cap_ids) {
        c->cap_ids = c->cap_ids ? c->cap_ids * 2 : 64;
        c->ids = xrealloc(c->ids, c->cap_ids * sizeof(int32_t));
    }
    c->ids[c->n_ids++] = id;
}

static bool merge_before(const bpe_merge *a, const bpe_merge *b) {
    return a->rank != b->rank ? a->rank < b->rank : a->pos < b->pos;
}

static void heap_push(encode_ctx *c, bpe_merge m) {
    if (c->n_heap == c->cap_heap) {
        c->cap_heap = c->cap_heap ? c->cap_heap * 2 : 64;
        c->heap = xrealloc(c->heap, c->cap_heap * sizeof(bpe_merge));
    }
    size_t i = c->n_heap++;
    while (i > 0) {
        size_t parent = (i - 1) / 2;
        if (!merge_before(&m, &c->heap[parent])) break;
        c->heap[i] = c->heap[parent];
        i = parent;
    }
    c->heap[i] = m;
}

static bpe_merge heap_pop(encode_ctx *c) {
    bpe_merge top = c->heap[0], last = c->heap[--c->n_heap];
    size_t i = 0, n = c->n_heap;
    for (;;) {
        size_t l = 2 * i + 1, best = i;
        const bpe_merge *bm = &last;
        if (l < n && merge_before(&c->heap[l], bm)) best = l, bm = &c->heap[l];
        if (l + 1 < n && merge_before(&c->heap[l + 1], bm)) best = l + 1;
        if (best == i) break;
        c->heap[i] = c->heap[best];
        i = best;
    }
    if (n) c->heap[i] = last;
    return top;
}

static void push_pair(encode_ctx *c, int pos) {
    int nx = c->sym_next[pos];
    if (nx < 0) return;
    const merge_slot *m = merge_map_get(&c->tok->merges, c->sym_id[pos], c->sym_id[nx]);
    if (m) heap_push(c, (bpe_merge){m->rank, m->new_id, pos});
}

/* BPE over the bytes of one pre-token, ids appended to c->ids. */
static void bpe_piece(encode_ctx *c, const char *s, size_t n) {
    const tokenizer *tok = c->tok;
    if (n == 0) return;
    if (n == 1 && tok->byte_id[(unsigned char)s[0]] >= 0) {
        emit(c, tok->byte_id[(unsigned char)s[0]]);
        return;
    }
    if (tok->ignore_merges) {
        int32_t id = str_map_get(&tok->vocab_bytes, s, n);
        if (id >= 0) {
            emit(c, id);
            return;
        }
    }
    if (n > c->cap_sym) {
        c->cap_sym = n * 2;
        c->sym_id = xrealloc(c->sym_id, c->cap_sym * sizeof(int32_t));
        c->sym_prev = xrealloc(c->sym_prev, c->cap_sym * sizeof(int));
        c->sym_next = xrealloc(c->sym_next, c->cap_sym * sizeof(int));
    }
    /* Bytes without a vocab entry are dropped (or become unk), as in the Rust BPE. */
    int m = 0;
    for (size_t i = 0; i < n; i++) {
        int32_t id = tok->byte_id[(unsigned char)s[i]];
        if (id < 0) {
            if (tok->unk_id < 0) continue;
            if (tok->fuse_unk && m > 0 && c->sym_id[m - 1] == tok->unk_id) continue;
            id = tok->unk_id;
        }
        c->sym_id[m] = id;
        c->sym_prev[m] = m - 1;
        c->sym_next[m] = m + 1;
        m++;
    }
    if (m == 0) return;
    c->sym_next[m - 1] = -1;
    c->n_heap = 0;
    for (int i = 0; i + 1 < m; i++)
        push_pair(c, i);
    while (c->n_heap) {
        bpe_merge top = heap_pop(c);
        int pos = top.pos;
        if (c->sym_id[pos] < 0) continue; /* merged into its left neighbour */
        int nx = c->sym_next[pos];
        if (nx < 0) continue;
        /* Stale entry: the pair changed since it was pushed. */
        const merge_slot *cur = merge_map_get(&tok->merges, c->sym_id[pos], c->sym_id[nx]);
        if (!cur || cur->new_id != top.new_id) continue;
        c->sym_id[pos] = top.new_id;
        c->sym_id[nx] = -1;
        c->sym_next[pos] = c->sym_next[nx];
        if (c->sym_next[nx] >= 0) c->sym_prev[c->sym_next[nx]] = pos;
        if (c->sym_prev[pos] >= 0) push_pair(c, c->sym_prev[pos]);
        push_pair(c, pos);
    }
    for (int i = 0; i >= 0; i = c->sym_next[i])
        emit(c, c->sym_id[i]);
}

/* Find the next match of re in s[0..n) at or after *from; false when there is none. An empty
 * match is skipped (it would only make an empty piece). */
static bool regex_next(encode_ctx *c, const pcre2_code *re, pcre2_match_data *md, const char *s,
                       size_t n, size_t from, size_t *ms, size_t *me) {
    while (from < n) {
        int rc = pcre2_match(re, (PCRE2_SPTR)s, n, from, PCRE2_NO_UTF_CHECK, md, NULL);
        if (rc == PCRE2_ERROR_JIT_STACKLIMIT)
            rc = pcre2_match(re, (PCRE2_SPTR)s, n, from, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, md,
                             NULL);
        if (rc == PCRE2_ERROR_NOMATCH) return false;
        if (rc < 0) {
            c->failed = 1;
            return false;
        }
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
        if (ov[1] > ov[0]) {
            *ms = ov[0];
            *me = ov[1];
            return true;
        }
        from = ov[0] + 1; /* past the empty match, then to the next character start */
        while (from < n && ((unsigned char)s[from] & 0xC0) == 0x80)
            from++;
    }
    return false;
}

/* Run pre-tokenizer steps [step..] over s[0..n): Split cuts at every match, keeping both the
 * matches and the text between them (Isolated); ByteLevel is last and hands pieces to BPE. */
static void pre_tokenize(encode_ctx *c, int step, const char *s, size_t n) {
    if (n == 0 || c->failed) return;
    const pre_step *p = &c->tok->steps[step];
    if (p->kind == PRE_BYTE_LEVEL) {
        if (p->add_prefix_space && s[0] != ' ') {
            if (n + 1 > c->cap_prefix) {
                c->cap_prefix = (n + 1) * 2;
                c->prefix_buf = xrealloc(c->prefix_buf, c->cap_prefix);
            }
            c->prefix_buf[0] = ' ';
            memcpy(c->prefix_buf + 1, s, n);
            s = c->prefix_buf;
            n++;
        }
        if (!p->re) {
            bpe_piece(c, s, n);
            return;
        }
    }
    size_t prev = 0, ms, me;
    while (regex_next(c, p->re, c->md[step], s, n, prev, &ms, &me)) {
        if (ms > prev) {
            if (p->kind == PRE_SPLIT)
                pre_tokenize(c, step + 1, s + prev, ms - prev);
            else
                bpe_piece(c, s + prev, ms - prev);
        }
        if (p->kind == PRE_SPLIT)
            pre_tokenize(c, step + 1, s + ms, me - ms);
        else
            bpe_piece(c, s + ms, me - ms);
        prev = me;
    }
    if (c->failed) return;
    if (prev < n) {
        if (p->kind == PRE_SPLIT)
            pre_tokenize(c, step + 1, s + prev, n - prev);
        else
            bpe_piece(c, s + prev, n - prev);
    }
}

/* One stretch of text between added tokens, split further by the added tokens of set; the text
 * pieces are handed to sink. Mirrors AddedVocabulary::find_matches: leftmost-longest matches;
 * single_word needs no word character on either side; lstrip/rstrip take the adjacent
 * whitespace into the token. */
typedef void (*text_sink)(encode_ctx *c, const char *s, size_t n);

static void split_added(encode_ctx *c, const added_set *set, const char *s, size_t n,
                        text_sink sink) {
    const tokenizer *tok = c->tok;
    if (!set->any) {
        sink(c, s, n);
        return;
    }
    size_t text_start = 0, i = 0;
    while (i < n) {
        unsigned char b = (unsigned char)s[i];
        int hit = -1;
        for (int k = set->start[b]; k < set->start[b + 1]; k++) {
            const added_token *t = &tok->added[set->order[k]];
            if (t->len <= n - i && memcmp(s + i, t->content, t->len) == 0) {
                hit = set->order[k];
                break;
            }
        }
        if (hit < 0) {
            i++;
            continue;
        }
        const added_token *t = &tok->added[hit];
        size_t start = i, stop = i + t->len, cs;
        if (t->single_word) {
            bool left_ok = start == 0 || !is_word_char(utf8_last(s, start, &cs));
            bool right_ok = true;
            if (stop < n) {
                int k = utf8_scan((const unsigned char *)s + stop, n - stop);
                right_ok = !is_word_char(utf8_decode((const unsigned char *)s + stop, k));
            }
            if (!left_ok || !right_ok) {
                i = stop; /* the matcher resumes after the rejected match */
                continue;
            }
        }
        if (t->lstrip) {
            size_t ns = start;
            while (ns > text_start) {
                int32_t ch = utf8_last(s, ns, &cs);
                if (!is_white_space(ch)) break;
                ns = cs;
            }
            start = ns;
        }
        if (t->rstrip) {
            while (stop < n) {
                int k = utf8_scan((const unsigned char *)s + stop, n - stop);
                if (!is_white_space(utf8_decode((const unsigned char *)s + stop, k))) break;
                stop += (size_t)k;
            }
        }
        if (start > text_start) sink(c, s + text_start, start - text_start);
        emit(c, t->id);
        text_start = i = stop;
    }
    if (n > text_start) sink(c, s + text_start, n - text_start);
}

static void sink_pre_tokenize(encode_ctx *c, const char *s, size_t n) { pre_tokenize(c, 0, s, n); }

static bool is_ascii(const char *s, size_t n) {
    for (size_t i = 0; i < n; i++)
        if ((unsigned char)s[i] >= 0x80) return false;
    return true;
}

static void sink_normalize(encode_ctx *c, const char *s, size_t n) {
    const tokenizer *tok = c->tok;
    if (!tok->nfc || is_ascii(s, n)) { /* ASCII is its own NFC */
        split_added(c, &tok->added_norm, s, n, sink_pre_tokenize);
        return;
    }
    size_t nn;
    char *norm = nfc_dup(s, n, &nn);
    if (!norm) {
        c->failed = 1;
        return;
    }
    split_added(c, &tok->added_norm, norm, nn, sink_pre_tokenize);
    free(norm);
}

int tokenizer_encode(const tokenizer *tok, const char *text, size_t len, bool add_special,
                     int32_t **ids, int *n_ids) {
    *ids = NULL;
    *n_ids = 0;
    if (!utf8_valid(text, len)) return -1;
    encode_ctx c = {.tok = tok};
    c.md = xcalloc((size_t)tok->n_steps, sizeof(pcre2_match_data *));
    for (int i = 0; i < tok->n_steps; i++)
        if (tok->steps[i].re)
            c.md[i] = pcre2_match_data_create_from_pattern(tok->steps[i].re, NULL);
    if (add_special)
        for (int i = 0; i < tok->n_prefix; i++)
            emit(&c, tok->prefix[i]);
    split_added(&c, &tok->added_raw, text, len, sink_normalize);
    if (add_special)
        for (int i = 0; i < tok->n_suffix; i++)
            emit(&c, tok->suffix[i]);
    for (int i = 0; i < tok->n_steps; i++)
        pcre2_match_data_free(c.md[i]);
    free(c.md);
    free(c.sym_id);
    free(c.sym_prev);
    free(c.sym_next);
    free(c.heap);
    free(c.prefix_buf);
    if (c.failed || c.n_ids > (size_t)INT32_MAX) {
        free(c.ids);
        return -1;
    }
    if (!c.ids) c.ids = xmalloc(sizeof(int32_t)); /* a valid pointer even for no tokens */
    *ids = c.ids;
    *n_ids = (int)c.n_ids;
    return 0;
}

/* ---------------------------------------------------------------- decoding */

/* Append bytes s[0..n) to dst as UTF-8, each maximal invalid subsequence as U+FFFD. When
 * keep_tail, a valid but unfinished sequence at the end is not written; its length is returned
 * so the caller can keep it for later. dst must have room for 3 * n bytes. */
static size_t utf8_lossy(const char *s, size_t n, char *dst, size_t *dst_len, bool keep_tail) {
    size_t i = 0, o = *dst_len;
    while (i < n) {
        int k = utf8_scan((const unsigned char *)s + i, n - i);
        if (k > 0) {
            memcpy(dst + o, s + i, (size_t)k);
            o += (size_t)k;
            i += (size_t)k;
            continue;
        }
        if (k == 0 && keep_tail) break;
        memcpy(dst + o, "\xEF\xBF\xBD", 3);
        o += 3;
        i += k == 0 ? n - i : (size_t)-k;
    }
    *dst_len = o;
    return n - i;
}

char *tokenizer_decode(const tokenizer *tok, const int32_t *ids, int n, bool skip_special,
                       size_t *len_out) {
    size_t total = 0;
    for (int i = 0; i < n; i++)
        if (ids[i] >= 0 && ids[i] < tok->vocab_size) total += tok->entries[ids[i]].n_bytes;
    char *raw = xmalloc(total + 1);
    size_t r = 0;
    for (int i = 0; i < n; i++) {
        /* Unknown ids are skipped, as id_to_token returning None is in the Rust decode. */
        if (ids[i] < 0 || ids[i] >= tok->vocab_size) continue;
        const tok_entry *e = &tok->entries[ids[i]];
        if (!e->present || (skip_special && e->special)) continue;
        memcpy(raw + r, e->bytes, e->n_bytes);
        r += e->n_bytes;
    }
    char *out = xmalloc(r * 3 + 1);
    size_t o = 0;
    utf8_lossy(raw, r, out, &o, false);
    out[o] = 0;
    free(raw);
    if (len_out) *len_out = o;
    return out;
}

void detok_stream_init(detok_stream *s, const tokenizer *tok, bool skip_special) {
    s->tok = tok;
    s->skip_special = skip_special;
    s->n_pending = 0;
}

static void out_reserve(char **out, size_t *out_len, size_t *cap, size_t extra) {
    if (!*out || *out_len + extra + 1 > *cap) {
        size_t nc = (*out_len + extra + 1) * 2;
        if (nc < 64) nc = 64;
        *out = xrealloc(*out, nc);
        *cap = nc;
    }
    (*out)[*out_len] = 0;
}

/* Pending bytes plus the new token's bytes: whole characters (and U+FFFD for what is already
 * known to be invalid) go out, an unfinished character stays in pending (at most 3 bytes). */
static size_t stream_emit(detok_stream *s, const char *b, size_t nb, bool final, char **out,
                          size_t *out_len, size_t *cap) {
    size_t n = (size_t)s->n_pending + nb;
    char small[64];
    char *buf = n <= sizeof small ? small : xmalloc(n);
    memcpy(buf, s->pending, (size_t)s->n_pending);
    if (nb) memcpy(buf + s->n_pending, b, nb);
    out_reserve(out, out_len, cap, n * 3);
    size_t before = *out_len;
    size_t tail = utf8_lossy(buf, n, *out, out_len, !final);
    MS_ASSERT(tail <= 3);
    memcpy(s->pending, buf + n - tail, tail);
    s->n_pending = (int)tail;
    (*out)[*out_len] = 0;
    if (buf != small) free(buf);
    return *out_len - before;
}

size_t detok_stream_push(detok_stream *s, int32_t id, char **out, size_t *out_len, size_t *cap) {
    size_t nb;
    const char *b = tokenizer_token_bytes(s->tok, id, &nb);
    out_reserve(out, out_len, cap, 0);
    if (!b || (s->skip_special && tokenizer_is_special(s->tok, id))) return 0;
    return stream_emit(s, b, nb, false, out, out_len, cap);
}

size_t detok_stream_finish(detok_stream *s, char **out, size_t *out_len, size_t *cap) {
    out_reserve(out, out_len, cap, 0);
    if (s->n_pending == 0) return 0;
    return stream_emit(s, NULL, 0, true, out, out_len, cap);
}
