/* Tests of the CUDA paged attention (kernels/cuda/attention.cu) against the CPU reference
 * (kernels/cpu/attention.c), and its decode timing.
 *
 * Random paged caches (pages handed to the sequences in random order, every cache value random in
 * [-1, 1) and never zero, unused page-table entries -1) and batches of decode tokens, prefill
 * chunks over cached prefixes, and both mixed; fp32 on both sides. Tolerance per output element:
 * |cuda - cpu| <= 1e-4 * max|v| (the output is a convex combination of v rows). Exact
 * (bit-identical): each token of a batch of 64 against the same token alone, decode of a position
 * against the same position inside a prefill chunk, the four paths of the kernel file (slices,
 * chunks, tiles, clusters; cuda_attention_debug_path forces one) against each other on the same
 * batch, batches of 1 to 4 tokens with contexts of 1 to 40000 positions against each token alone
 * and the slice and chunk kernels, and a captured CUDA graph replayed twice against the direct
 * call. The same checks run again on BF16 caches (--kv-cache-dtype bfloat16): the host values
 * are rounded to BF16, so the CPU reference computes on what the device holds.
 *
 *   test_cuda_attention               run the tests (skipped without a CUDA build or a GPU)
 *   test_cuda_attention --bench       then time decode and prefill at Qwen3-30B-A3B's attention
 *                                     shape (H 32, Hkv 4, Dh 128, S 16) against a 1 GiB
 *                                     device-to-device copy
 *   test_cuda_attention --bench-only  the timing without the tests */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "kernels/ops.h"
#include "tests/check.h"

#ifndef MOESERVE_CUDA

int main(void) {
    printf("skipped: built without CUDA\n");
    printf("0 passed, 0 failed\n");
    return 0;
}

#else

/* The few CUDA runtime calls the timing needs. C files are built without CUDA's include path;
 * these are the runtime library's C entry points (linked into every CUDA build), with the enum
 * arguments and results as int and the stream as a pointer. */
typedef struct CUevent_st *cuda_event;
extern int cudaEventCreate(cuda_event *event);
extern int cudaEventRecord(cuda_event event, void *stream);
extern int cudaEventSynchronize(cuda_event event);
extern int cudaEventElapsedTime(float *ms, cuda_event start, cuda_event end);
extern int cudaEventDestroy(cuda_event event);
extern int cudaMemcpyAsync(void *dst, const void *src, size_t count, int kind, void *stream);
enum { CUDA_MEMCPY_DEVICE_TO_DEVICE = 3 };
void *cuda_stream(void); /* kernels/cuda/ops_cuda.cu: the stream every op runs on */
/* kernels/cuda/attention.cu: force a path (0 slices, 1 chunks, 2 tiles, 3 clusters; -1 the usual
 * choice).
 * Weak: a build of the kernel file without it (an older one, timed for comparison) skips the
 * checks that need it. */
extern void cuda_attention_debug_path(int path) __attribute__((weak));
enum { PATH_AUTO = -1, PATH_SLICES = 0, PATH_CHUNKS = 1, PATH_TILES = 2, PATH_CLUSTERS = 3 };
static const char *const path_names[] = {"slices", "chunks", "tiles", "clusters"};

static void set_path(int path) {
    if (cuda_attention_debug_path) cuda_attention_debug_path(path);
}

static const ops *cpu, *gpu;

/* ---- random inputs ---- */

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static uint64_t rng_next(void) { /* splitmix64 */
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Uniform in [-1, 1), never exactly zero. */
static float rng_uniform(void) {
    float f;
    do {
        f = (float)((double)(rng_next() >> 11) / 9007199254740992.0 * 2.0 - 1.0);
    } while (f == 0.0f);
    return f;
}

static int rng_int(int n) { return (int)(rng_next() % (uint64_t)n); }

/* 1..max, log-uniform: short and long sequences alike. */
static int rng_len(int max) {
    const int l = (int)exp(log((double)max) * (double)(rng_next() >> 11) / 9007199254740992.0);
    return l < 1 ? 1 : l > max ? max : l;
}

static void fill_uniform(float *p, int64_t n, float scale) {
    for (int64_t i = 0; i < n; i++)
        p[i] = rng_uniform() * scale;
}

/* ---- a paged cache on both sides ---- */

typedef struct {
    int H, Hkv, Dh, S;
    int n_seq, max_pages, P;
    int *len;           /* [n_seq] positions stored */
    int32_t *pt;        /* [n_seq, max_pages] host page table, -1 where unused */
    float *k, *v;       /* host [P, S, Hkv, Dh] */
    int32_t *dpt;       /* device copies */
    float *dk, *dv;
} paged_cache;

/* Caches made from now on hold BF16 on the device (the host copy: the same values as floats). */
static int g_bf16;

/* The device copy of host cache values: float, or BF16 with g_bf16 (h then already rounded). */
static void *cache_upload(const float *h, int64_t n) {
    if (!g_bf16) {
        void *d = gpu->dev_alloc((size_t)n * sizeof(float));
        MS_ASSERT(d);
        gpu->to_device(d, h, (size_t)n * sizeof(float));
        return d;
    }
    uint16_t *b = xmalloc((size_t)n * sizeof(uint16_t));
    for (int64_t i = 0; i < n; i++)
        b[i] = f32_to_bf16(h[i]);
    void *d = gpu->dev_alloc((size_t)n * sizeof(uint16_t));
    MS_ASSERT(d);
    gpu->to_device(d, b, (size_t)n * sizeof(uint16_t));
    free(b);
    return d;
}

/* Host values as a BF16 cache holds them, where g_bf16. */
static void cache_round(float *h, int64_t n) {
    if (g_bf16)
        for (int64_t i = 0; i < n; i++)
            h[i] = bf16_to_f32(f32_to_bf16(h[i]));
}

/* n_seq sequences holding len[s] positions each, room for max_pages pages each; the pages of all
 * sequences are one random permutation of the cache (plus two spare pages no one owns). */
static paged_cache cache_make(int H, int Hkv, int Dh, int S, int n_seq, const int *len,
                              int max_pages) {
    paged_cache c = {.H = H, .Hkv = Hkv, .Dh = Dh, .S = S, .n_seq = n_seq,
                     .max_pages = max_pages};
    c.len = xmalloc((size_t)n_seq * sizeof(int));
    memcpy(c.len, len, (size_t)n_seq * sizeof(int));
    int P = 2;
    for (int s = 0; s < n_seq; s++) {
        MS_ASSERT(len[s] >= 1 && (len[s] + S - 1) / S <= max_pages);
        P += (len[s] + S - 1) / S;
    }
    c.P = P;
    int32_t *perm = xmalloc((size_t)P * sizeof(int32_t));
    for (int i = 0; i < P; i++)
        perm[i] = i;
    for (int i = P - 1; i > 0; i--) {
        const int j = rng_int(i + 1);
        const int32_t x = perm[i];
        perm[i] = perm[j];
        perm[j] = x;
    }
    c.pt = xmalloc((size_t)n_seq * max_pages * sizeof(int32_t));
    int next = 0;
    for (int s = 0; s < n_seq; s++)
        for (int j = 0; j < max_pages; j++)
            c.pt[(size_t)s * max_pages + j] = j < (len[s] + S - 1) / S ? perm[next++] : -1;
    free(perm);
    const int64_t n = (int64_t)P * S * Hkv * Dh;
    c.k = xmalloc((size_t)n * sizeof(float));
    c.v = xmalloc((size_t)n * sizeof(float));
    fill_uniform(c.k, n, 1.0f);
    fill_uniform(c.v, n, 1.0f);
    cache_round(c.k, n);
    cache_round(c.v, n);
    c.dk = cache_upload(c.k, n);
    c.dv = cache_upload(c.v, n);
    c.dpt = gpu->dev_alloc((size_t)n_seq * max_pages * sizeof(int32_t));
    MS_ASSERT(c.dpt);
    gpu->to_device(c.dpt, c.pt, (size_t)n_seq * max_pages * sizeof(int32_t));
    return c;
}

static void cache_free(paged_cache *c) {
    gpu->dev_free(c->dk);
    gpu->dev_free(c->dv);
    gpu->dev_free(c->dpt);
    free(c->len);
    free(c->pt);
    free(c->k);
    free(c->v);
}

/* ---- batches ---- */

typedef struct {
    int T, cap;
    int32_t *seq, *pos; /* [T] */
    float *q;           /* [T, H, Dh] */
} batch;

static void batch_add(batch *b, const paged_cache *c, int seq, int pos, float qscale) {
    const int HD = c->H * c->Dh;
    if (b->T == b->cap) {
        b->cap = b->cap ? 2 * b->cap : 64;
        b->seq = realloc(b->seq, (size_t)b->cap * sizeof(int32_t));
        b->pos = realloc(b->pos, (size_t)b->cap * sizeof(int32_t));
        b->q = realloc(b->q, (size_t)b->cap * HD * sizeof(float));
        MS_ASSERT(b->seq && b->pos && b->q);
    }
    MS_ASSERT(pos >= 0 && pos < c->len[seq]);
    b->seq[b->T] = seq;
    b->pos[b->T] = pos;
    fill_uniform(b->q + (size_t)b->T * HD, HD, qscale);
    b->T++;
}

/* Token `from` of src, with its q, appended to dst. */
static void batch_copy_token(batch *dst, const paged_cache *c, const batch *src, int from) {
    const int HD = c->H * c->Dh;
    batch_add(dst, c, src->seq[from], src->pos[from], 1.0f);
    memcpy(dst->q + (size_t)(dst->T - 1) * HD, src->q + (size_t)from * HD, HD * sizeof(float));
}

/* Positions lo..hi-1 of sequence seq (a prefill chunk, or a decode token when hi = lo + 1). */
static void batch_add_range(batch *b, const paged_cache *c, int seq, int lo, int hi, float qscale) {
    for (int p = lo; p < hi; p++)
        batch_add(b, c, seq, p, qscale);
}

static void batch_free(batch *b) {
    free(b->seq);
    free(b->pos);
    free(b->q);
    memset(b, 0, sizeof *b);
}

static float attn_scale(const paged_cache *c) { return 1.0f / sqrtf((float)c->Dh); }

/* out [T, H, Dh] from the CPU backend. */
static void run_cpu(float *out, const paged_cache *c, const batch *b) {
    attn_batch ab = {.T = b->T, .pos = b->pos, .seq = b->seq, .page_table = c->pt,
                     .max_pages = c->max_pages, .page_size = c->S};
    kv_layer kv = {.k = c->k, .v = c->v, .bf16 = 0};
    cpu->attention(out, b->q, kv, &ab, c->H, c->Hkv, c->Dh, attn_scale(c));
}

/* out [T, H, Dh] from the CUDA backend (inputs copied over, output copied back). */
static void run_gpu(float *out, const paged_cache *c, const batch *b) {
    const size_t qbytes = (size_t)b->T * c->H * c->Dh * sizeof(float);
    float *dq = gpu->dev_alloc(qbytes), *dout = gpu->dev_alloc(qbytes);
    int32_t *dpos = gpu->dev_alloc((size_t)b->T * sizeof(int32_t));
    int32_t *dseq = gpu->dev_alloc((size_t)b->T * sizeof(int32_t));
    MS_ASSERT(dq && dout && dpos && dseq);
    gpu->to_device(dq, b->q, qbytes);
    gpu->to_device(dpos, b->pos, (size_t)b->T * sizeof(int32_t));
    gpu->to_device(dseq, b->seq, (size_t)b->T * sizeof(int32_t));
    attn_batch ab = {.T = b->T, .pos = dpos, .seq = dseq, .page_table = c->dpt,
                     .max_pages = c->max_pages, .page_size = c->S};
    kv_layer kv = {.k = c->dk, .v = c->dv, .bf16 = g_bf16};
    gpu->attention(dout, dq, kv, &ab, c->H, c->Hkv, c->Dh, attn_scale(c));
    gpu->to_host(out, dout, qbytes);
    gpu->dev_free(dq);
    gpu->dev_free(dout);
    gpu->dev_free(dpos);
    gpu->dev_free(dseq);
}

/* ---- comparison ---- */

static const double ATTN_TOL = 1e-4; /* times max|v| of the cache */

/* CUDA against the CPU reference over a whole batch: one CHECK, worst error printed. */
static void check_case(const char *what, const paged_cache *c, const batch *b) {
    const int64_t n = (int64_t)b->T * c->H * c->Dh;
    float *want = xmalloc((size_t)n * sizeof(float)), *got = xmalloc((size_t)n * sizeof(float));
    run_cpu(want, c, b);
    run_gpu(got, c, b);
    double vmax = 0.0, omax = 0.0, max_err = 0.0;
    for (int64_t i = 0; i < (int64_t)c->P * c->S * c->Hkv * c->Dh; i++)
        if (fabs(c->v[i]) > vmax) vmax = fabs(c->v[i]);
    const double tol = ATTN_TOL * vmax;
    int64_t bad = 0;
    for (int64_t i = 0; i < n; i++) {
        const double err = fabs((double)got[i] - want[i]);
        if (fabs(want[i]) > omax) omax = fabs(want[i]);
        if (isnan(err) || err > max_err) max_err = isnan(err) ? INFINITY : err;
        if (!(err <= tol)) {
            if (bad < 5) {
                const int64_t t = i / ((int64_t)c->H * c->Dh);
                fprintf(stderr, "  %s: token %lld (seq %d pos %d) head %lld d %lld: got %.9g want "
                        "%.9g\n", what, (long long)t, b->seq[t], b->pos[t],
                        (long long)(i / c->Dh % c->H), (long long)(i % c->Dh), got[i], want[i]);
            }
            bad++;
        }
    }
    printf("  %-62s T=%-5d worst |err| %.3g (%.2g of max|out| %.3g), tol %.1e\n", what, b->T,
           max_err, omax > 0 ? max_err / omax : 0.0, omax, tol);
    CHECK(bad == 0, "%s: %lld of %lld elements off by more than %g, worst %.3g", what,
          (long long)bad, (long long)n, tol, max_err);
    free(want);
    free(got);
}

static int64_t count_diff(const float *a, const float *b, int64_t n) {
    int64_t d = 0;
    for (int64_t i = 0; i < n; i++)
        d += memcmp(&a[i], &b[i], sizeof(float)) != 0;
    return d;
}

/* ---- correctness cases ---- */

/* Decode only: one token per sequence, at its last stored position. */
static void test_decode(const char *what, int H, int Hkv, int Dh, int S, int n_seq, int max_len,
                        float qscale) {
    int *len = xmalloc((size_t)n_seq * sizeof(int));
    /* the edges of the chunking first, then log-uniform lengths */
    const int edges[] = {1, 2, 255, 256, 257, 511, 512, 513, 4096, max_len};
    for (int s = 0; s < n_seq; s++) {
        len[s] = s < (int)(sizeof edges / sizeof edges[0]) ? edges[s] : rng_len(max_len);
        if (len[s] > max_len) len[s] = max_len;
    }
    const int max_pages = (max_len + S - 1) / S;
    paged_cache c = cache_make(H, Hkv, Dh, S, n_seq, len, max_pages);
    batch b = {0};
    for (int s = 0; s < n_seq; s++)
        batch_add(&b, &c, s, len[s] - 1, qscale);
    check_case(what, &c, &b);
    batch_free(&b);
    cache_free(&c);
    free(len);
}

/* Prefill only: chunks [lo, hi) of three sequences after cached prefixes [0, lo). */
static void test_prefill(const char *what, int H, int Hkv, int Dh, int S, const int lo[3],
                         const int hi[3], int max_len, float qscale) {
    const int max_pages = (max_len + S - 1) / S;
    paged_cache c = cache_make(H, Hkv, Dh, S, 3, hi, max_pages);
    batch b = {0};
    for (int s = 0; s < 3; s++)
        batch_add_range(&b, &c, s, lo[s], hi[s], qscale);
    check_case(what, &c, &b);
    batch_free(&b);
    cache_free(&c);
}

/* Mixed: decode tokens of n_dec sequences, then prefill chunks of n_pre more sequences. */
static void test_mixed(const char *what, int H, int Hkv, int Dh, int S, int n_dec, int n_pre,
                       int max_len, int max_chunk) {
    const int n_seq = n_dec + n_pre;
    int *len = xmalloc((size_t)n_seq * sizeof(int)), *lo = xmalloc((size_t)n_seq * sizeof(int));
    for (int s = 0; s < n_seq; s++) {
        len[s] = rng_len(max_len);
        if (s < n_dec) {
            lo[s] = len[s] - 1;
        } else {
            int chunk = rng_len(max_chunk);
            if (chunk > len[s]) chunk = len[s];
            lo[s] = len[s] - chunk;
        }
    }
    paged_cache c = cache_make(H, Hkv, Dh, S, n_seq, len, (max_len + S - 1) / S);
    batch b = {0};
    for (int s = 0; s < n_seq; s++)
        batch_add_range(&b, &c, s, lo[s], len[s], s % 2 ? 3.0f : 1.0f);
    check_case(what, &c, &b);
    batch_free(&b);
    cache_free(&c);
    free(len);
    free(lo);
}

/* A batch of 64 tokens (decodes of long and short sequences and a prefill chunk): each token's
 * output alone equals its output in the batch, bit for bit. */
static void test_batch_invariance(const char *what, int H, int Hkv, int Dh, int S, int max_len) {
    const int n_dec = 40, n_seq = n_dec + 1;
    int len[41];
    for (int s = 0; s < n_seq; s++)
        len[s] = s == 0 ? max_len : rng_len(max_len);
    paged_cache c = cache_make(H, Hkv, Dh, S, n_seq, len, (max_len + S - 1) / S);
    batch b = {0};
    for (int s = 1; s < n_seq; s++)
        batch_add(&b, &c, s, len[s] - 1, 1.0f);
    batch_add_range(&b, &c, 0, max_len - (64 - n_dec), max_len, 1.0f); /* 24-token chunk */
    MS_ASSERT(b.T == 64);
    const int HD = H * Dh;
    float *all = xmalloc((size_t)b.T * HD * sizeof(float)), *one = xmalloc(HD * sizeof(float));
    run_gpu(all, &c, &b);
    int64_t diff = 0;
    int bad_tokens = 0;
    for (int t = 0; t < b.T; t++) {
        batch solo = {0};
        batch_copy_token(&solo, &c, &b, t);
        run_gpu(one, &c, &solo);
        const int64_t d = count_diff(one, all + (size_t)t * HD, HD);
        if (d && bad_tokens++ < 3)
            fprintf(stderr, "  %s: token %d (seq %d pos %d) alone differs in %lld elements\n",
                    what, t, b.seq[t], b.pos[t], (long long)d);
        diff += d;
        batch_free(&solo);
    }
    printf("  %-62s %s\n", what, diff ? "DIFFERS" : "bit-identical");
    CHECK(diff == 0, "%s: %d of 64 tokens differ alone", what, bad_tokens);
    free(all);
    free(one);
    batch_free(&b);
    cache_free(&c);
}

/* Prefill of positions 0..L-1 of one sequence against decode steps of some of those positions
 * (each alone, with the same q): bit-identical rows. Also against the CPU reference. */
static void test_decode_vs_prefill(const char *what, int H, int Hkv, int Dh, int S, int L) {
    paged_cache c = cache_make(H, Hkv, Dh, S, 1, &L, (L + S - 1) / S + 1);
    batch pre = {0};
    batch_add_range(&pre, &c, 0, 0, L, 1.0f);
    const int HD = H * Dh;
    float *all = xmalloc((size_t)L * HD * sizeof(float)), *one = xmalloc(HD * sizeof(float));
    run_gpu(all, &c, &pre);
    const int probe[] = {L - 1, 0, L / 2, 255, 256, 257, L - 2};
    int64_t diff = 0;
    for (size_t i = 0; i < sizeof probe / sizeof probe[0]; i++) {
        const int p = probe[i];
        if (p < 0 || p >= L) continue;
        batch dec = {0};
        batch_copy_token(&dec, &c, &pre, p);
        run_gpu(one, &c, &dec);
        const int64_t d = count_diff(one, all + (size_t)p * HD, HD);
        if (d) fprintf(stderr, "  %s: position %d differs in %lld elements\n", what, p, (long long)d);
        diff += d;
        batch_free(&dec);
    }
    printf("  %-62s %s\n", what, diff ? "DIFFERS" : "bit-identical");
    CHECK(diff == 0, "%s: decode differs from prefill", what);
    free(all);
    free(one);
    batch_free(&pre);
    cache_free(&c);
}

/* One batch (decode tokens of n_dec sequences, then prefill chunks of n_pre more) through every
 * path: each bit-identical to the usual choice, which is checked against the CPU. */
static void test_paths(const char *what, int H, int Hkv, int Dh, int S, int n_dec, int n_pre,
                       int max_len, int max_chunk) {
    if (!cuda_attention_debug_path) return;
    const int n_seq = n_dec + n_pre;
    int *len = xmalloc((size_t)n_seq * sizeof(int)), *lo = xmalloc((size_t)n_seq * sizeof(int));
    for (int s = 0; s < n_seq; s++) {
        len[s] = rng_len(max_len);
        lo[s] = len[s] - 1;
        if (s >= n_dec) {
            int chunk = rng_len(max_chunk);
            if (chunk > len[s]) chunk = len[s];
            lo[s] = len[s] - chunk;
        }
    }
    paged_cache c = cache_make(H, Hkv, Dh, S, n_seq, len, (max_len + S - 1) / S);
    batch b = {0};
    for (int s = 0; s < n_seq; s++)
        batch_add_range(&b, &c, s, lo[s], len[s], 1.0f);
    check_case(what, &c, &b);
    const int64_t n = (int64_t)b.T * H * Dh;
    float *want = xmalloc((size_t)n * sizeof(float)), *got = xmalloc((size_t)n * sizeof(float));
    run_gpu(want, &c, &b);
    for (int p = PATH_SLICES; p <= PATH_CLUSTERS; p++) {
        set_path(p);
        run_gpu(got, &c, &b);
        const int64_t d = count_diff(got, want, n);
        printf("  %-62s %s: %s\n", what, path_names[p], d ? "DIFFERS" : "bit-identical");
        CHECK(d == 0, "%s: path %s differs from the usual one in %lld elements", what,
              path_names[p], (long long)d);
    }
    set_path(PATH_AUTO);
    free(want);
    free(got);
    batch_free(&b);
    cache_free(&c);
    free(len);
    free(lo);
}

/* Batches of 1 to 4 tokens (the cluster kernel for one, the slice kernel for more) over sequences
 * of 1 to 40000 positions, many chunks and few: each batch against the CPU, each token against
 * itself alone and each batch against the slice and chunk kernels, bit for bit. The last batches
 * hold three positions of one sequence (rows the batch itself stores) and a decode of another. */
static void test_small_batches(const char *what, int H, int Hkv, int Dh, int S) {
    enum { N = 11 };
    const int len[N] = {40000, 1, 2049, 257, 1024, 33, 8192, 512, 4097, 20, 256};
    int max_pages = 0;
    for (int s = 0; s < N; s++)
        if ((len[s] + S - 1) / S > max_pages) max_pages = (len[s] + S - 1) / S;
    paged_cache c = cache_make(H, Hkv, Dh, S, N, len, max_pages);
    const int HD = H * Dh;
    float *alone = xmalloc((size_t)N * HD * sizeof(float));
    batch b1[N];
    for (int s = 0; s < N; s++) {
        memset(&b1[s], 0, sizeof b1[s]);
        batch_add(&b1[s], &c, s, len[s] - 1, 1.0f);
        run_gpu(alone + (size_t)s * HD, &c, &b1[s]);
    }
    float *got = xmalloc((size_t)4 * HD * sizeof(float));
    float *ref = xmalloc((size_t)4 * HD * sizeof(float));
    int64_t diff_alone = 0, diff_path = 0;
    int n_batches = 0;
    for (int T = 1; T <= 4; T++)
        for (int s0 = 0; s0 < N; s0 += T) {
            batch b = {0};
            for (int k = 0; k < T; k++)
                batch_copy_token(&b, &c, &b1[(s0 + k) % N], 0);
            if (s0 == 0) check_case(what, &c, &b);
            run_gpu(got, &c, &b);
            for (int k = 0; k < T; k++)
                diff_alone +=
                    count_diff(got + (size_t)k * HD, alone + (size_t)((s0 + k) % N) * HD, HD);
            for (int p = PATH_SLICES; cuda_attention_debug_path && p <= PATH_CHUNKS; p++) {
                set_path(p);
                run_gpu(ref, &c, &b);
                diff_path += count_diff(got, ref, (int64_t)T * HD);
            }
            set_path(PATH_AUTO);
            n_batches++;
            batch_free(&b);
        }
    /* positions 39997..39999 of sequence 0 in one batch, then a decode of sequence 2 */
    for (int T = 3; T <= 4; T++) {
        batch b = {0};
        batch_add_range(&b, &c, 0, len[0] - 3, len[0], 1.0f);
        if (T == 4) batch_add(&b, &c, 2, len[2] - 1, 1.0f);
        check_case(what, &c, &b);
        run_gpu(got, &c, &b);
        for (int k = 0; k < T; k++) {
            batch one = {0};
            batch_copy_token(&one, &c, &b, k);
            run_gpu(ref, &c, &one);
            diff_alone += count_diff(got + (size_t)k * HD, ref, HD);
            batch_free(&one);
        }
        for (int p = PATH_SLICES; cuda_attention_debug_path && p <= PATH_CHUNKS; p++) {
            set_path(p);
            run_gpu(ref, &c, &b);
            diff_path += count_diff(got, ref, (int64_t)T * HD);
        }
        set_path(PATH_AUTO);
        batch_free(&b);
    }
    printf("  %-62s %d batches: alone %s, slices/chunks %s\n", what, n_batches + 2,
           diff_alone ? "DIFFERS" : "bit-identical", diff_path ? "DIFFER" : "bit-identical");
    CHECK(diff_alone == 0, "%s: %lld elements differ from the token alone", what,
          (long long)diff_alone);
    CHECK(diff_path == 0, "%s: %lld elements differ from the slice or chunk kernel", what,
          (long long)diff_path);
    for (int s = 0; s < N; s++)
        batch_free(&b1[s]);
    free(alone);
    free(got);
    free(ref);
    cache_free(&c);
}

/* A batch of n_dec decode tokens and one prefill chunk of n_pre tokens, captured as a CUDA graph
 * and replayed twice (the slice kernel's counters must be back at zero): bit-identical to the
 * direct call each time. */
static void test_graph(const char *what, int H, int Hkv, int Dh, int S, int n_dec, int n_pre,
                       int max_len) {
    if (!gpu->graph_begin) return;
    const int n_seq = n_dec + 1;
    int *len = xmalloc((size_t)n_seq * sizeof(int));
    for (int s = 0; s < n_seq; s++)
        len[s] = s == n_dec ? max_len : rng_len(max_len);
    paged_cache c = cache_make(H, Hkv, Dh, S, n_seq, len, (max_len + S - 1) / S);
    batch b = {0};
    for (int s = 0; s < n_dec; s++)
        batch_add(&b, &c, s, len[s] - 1, 1.0f);
    batch_add_range(&b, &c, n_dec, max_len - n_pre, max_len, 1.0f);
    const size_t qbytes = (size_t)b.T * H * Dh * sizeof(float);
    float *dq = gpu->dev_alloc(qbytes), *dout = gpu->dev_alloc(qbytes);
    int32_t *dpos = gpu->dev_alloc((size_t)b.T * sizeof(int32_t));
    int32_t *dseq = gpu->dev_alloc((size_t)b.T * sizeof(int32_t));
    MS_ASSERT(dq && dout && dpos && dseq);
    gpu->to_device(dq, b.q, qbytes);
    gpu->to_device(dpos, b.pos, (size_t)b.T * sizeof(int32_t));
    gpu->to_device(dseq, b.seq, (size_t)b.T * sizeof(int32_t));
    attn_batch ab = {.T = b.T, .pos = dpos, .seq = dseq, .page_table = c.dpt,
                     .max_pages = c.max_pages, .page_size = c.S};
    kv_layer kv = {.k = c.dk, .v = c.dv, .bf16 = g_bf16};
    float *want = xmalloc(qbytes), *got = xmalloc(qbytes);
    gpu->attention(dout, dq, kv, &ab, H, Hkv, Dh, attn_scale(&c)); /* sizes the workspace */
    gpu->to_host(want, dout, qbytes);
    char err[256] = "";
    const uint64_t epoch = gpu->graph_epoch();
    void *graph = NULL;
    if (gpu->graph_begin(err, sizeof err) == 0) {
        gpu->attention(dout, dq, kv, &ab, H, Hkv, Dh, attn_scale(&c));
        graph = gpu->graph_end(err, sizeof err);
    }
    CHECK(graph != NULL, "%s: capture failed: %s", what, err);
    CHECK(gpu->graph_epoch() == epoch, "%s: the capture reallocated a workspace", what);
    int64_t diff = 0;
    for (int r = 0; graph && r < 2; r++) {
        gpu->dev_zero(dout, qbytes);
        gpu->graph_launch(graph);
        gpu->to_host(got, dout, qbytes);
        diff += count_diff(got, want, (int64_t)b.T * H * Dh);
    }
    printf("  %-62s T=%-5d %s\n", what, b.T, graph ? (diff ? "DIFFERS" : "bit-identical") : "-");
    CHECK(diff == 0, "%s: graph replays differ from the direct call in %lld elements", what,
          (long long)diff);
    if (graph) gpu->graph_free(graph);
    free(want);
    free(got);
    gpu->dev_free(dq);
    gpu->dev_free(dout);
    gpu->dev_free(dpos);
    gpu->dev_free(dseq);
    batch_free(&b);
    cache_free(&c);
    free(len);
}

static void run_tests(void) {
    printf("decode only\n");
    test_decode("decode 1 seq len 1, H4 Hkv2 Dh32 S16", 4, 2, 32, 16, 1, 1, 1.0f);
    test_decode("decode 256 seqs len 1..8192, H4 Hkv2 Dh32 S16", 4, 2, 32, 16, 256, 8192, 1.0f);
    test_decode("decode 256 seqs len 1..8192, q x4, H4 Hkv2 Dh32 S16", 4, 2, 32, 16, 256, 8192,
                4.0f);
    test_decode("decode 64 seqs len 1..8192, H32 Hkv4 Dh128 S16", 32, 4, 128, 16, 64, 8192, 1.0f);
    test_decode("decode 32 seqs len 1..3000, H8 Hkv1 Dh16 S1", 8, 1, 16, 1, 32, 3000, 2.0f);
    test_decode("decode 32 seqs len 1..3000, H16 Hkv16 Dh64 S7", 16, 16, 64, 7, 32, 3000, 2.0f);
    test_decode("decode 16 seqs len 1..3000, H16 Hkv1 Dh256 S300", 16, 1, 256, 300, 16, 3000, 2.0f);
    test_decode("decode 16 seqs len 1..3000, H32 Hkv2 Dh128 S64", 32, 2, 128, 64, 16, 3000, 2.0f);

    printf("prefill only (chunks after cached prefixes)\n");
    {
        const int lo[3] = {3000, 0, 100}, hi[3] = {5048, 1, 800};
        test_prefill("prefill 2048+1+700 tokens, H4 Hkv2 Dh32 S16", 4, 2, 32, 16, lo, hi, 8192,
                     1.0f);
        test_prefill("prefill 2048+1+700 tokens, q x4, H4 Hkv2 Dh16 S16", 4, 2, 16, 16, lo, hi,
                     8192, 4.0f);
    }
    {
        /* 8192 positions of room: 532 KB of chunk results a token, so 2 slices */
        const int lo[3] = {1000, 0, 0}, hi[3] = {1512, 1, 37};
        test_prefill("prefill 512+1+37 tokens, H32 Hkv4 Dh128 S16", 32, 4, 128, 16, lo, hi, 8192,
                     1.0f);
    }

    printf("mixed (decode tokens and prefill chunks in one batch)\n");
    test_mixed("mixed 48 decodes + 4 chunks, H4 Hkv2 Dh32 S16", 4, 2, 32, 16, 48, 4, 8192, 1024);
    test_mixed("mixed 16 decodes + 2 chunks, H32 Hkv4 Dh128 S16", 32, 4, 128, 16, 16, 2, 4096, 300);
    test_mixed("mixed 8 decodes + 2 chunks, H8 Hkv8 Dh64 S5", 8, 8, 64, 5, 8, 2, 2000, 600);

    printf("batch invariance (each of 64 tokens alone == in the batch)\n");
    test_batch_invariance("alone vs batch of 64, H4 Hkv2 Dh32 S16", 4, 2, 32, 16, 8192);
    test_batch_invariance("alone vs batch of 64, H32 Hkv4 Dh128 S16", 32, 4, 128, 16, 4096);

    printf("decode == prefill of the same positions\n");
    test_decode_vs_prefill("decode vs prefill L=1000, H4 Hkv2 Dh32 S16", 4, 2, 32, 16, 1000);
    test_decode_vs_prefill("decode vs prefill L=4097, H4 Hkv2 Dh32 S16", 4, 2, 32, 16, 4097);
    test_decode_vs_prefill("decode vs prefill L=3000, H32 Hkv4 Dh128 S16", 32, 4, 128, 16, 3000);
    test_decode_vs_prefill("decode vs prefill L=600, H16 Hkv1 Dh256 S16", 16, 1, 256, 16, 600);
    test_decode_vs_prefill("decode vs prefill L=300, H8 Hkv8 Dh64 S5", 8, 8, 64, 5, 300);

    printf("batches of 1 to 4 tokens, contexts 1 to 40000\n");
    test_small_batches("small batches, H32 Hkv4 Dh128 S16", 32, 4, 128, 16);
    test_small_batches("small batches, H4 Hkv2 Dh32 S16", 4, 2, 32, 16);
    test_small_batches("small batches, H16 Hkv1 Dh256 S16", 16, 1, 256, 16);
    test_small_batches("small batches, H16 Hkv16 Dh64 S7", 16, 16, 64, 7);
    test_small_batches("small batches, H8 Hkv1 Dh16 S1", 8, 1, 16, 1);

    printf("every path (slices, chunks, tiles, clusters) == the usual one\n");
    test_paths("paths: 12 decodes + 3 chunks, H32 Hkv4 Dh128 S16", 32, 4, 128, 16, 12, 3, 5000,
               400);
    test_paths("paths: 5 decodes + 2 chunks, H4 Hkv2 Dh32 S16", 4, 2, 32, 16, 5, 2, 3000, 300);
    test_paths("paths: 9 decodes + 2 chunks, H16 Hkv16 Dh64 S7", 16, 16, 64, 7, 9, 2, 2000, 200);
    test_paths("paths: 3 decodes + 1 chunk, H16 Hkv1 Dh256 S16", 16, 1, 256, 16, 3, 1, 1500, 100);
    test_paths("paths: 7 decodes + 2 chunks, H8 Hkv1 Dh16 S1", 8, 1, 16, 1, 7, 2, 1200, 200);

    printf("BF16 caches (the host values rounded to BF16 for the reference)\n");
    g_bf16 = 1;
    test_decode("bf16 decode 64 seqs len 1..8192, H32 Hkv4 Dh128 S16", 32, 4, 128, 16, 64, 8192,
                1.0f);
    test_decode("bf16 decode 32 seqs len 1..3000, H16 Hkv16 Dh64 S7", 16, 16, 64, 7, 32, 3000,
                2.0f);
    {
        const int lo[3] = {1000, 0, 0}, hi[3] = {1512, 1, 37};
        test_prefill("bf16 prefill 512+1+37 tokens, H32 Hkv4 Dh128 S16", 32, 4, 128, 16, lo, hi,
                     8192, 1.0f);
    }
    test_mixed("bf16 mixed 16 decodes + 2 chunks, H32 Hkv4 Dh128 S16", 32, 4, 128, 16, 16, 2, 4096,
               300);
    test_decode_vs_prefill("bf16 decode vs prefill L=3000, H32 Hkv4 Dh128 S16", 32, 4, 128, 16,
                           3000);
    test_small_batches("bf16 small batches, H32 Hkv4 Dh128 S16", 32, 4, 128, 16);
    test_paths("bf16 paths: 12 decodes + 3 chunks, H32 Hkv4 Dh128 S16", 32, 4, 128, 16, 12, 3, 5000,
               400);
    test_paths("bf16 paths: 7 decodes + 2 chunks, H8 Hkv1 Dh16 S1", 8, 1, 16, 1, 7, 2, 1200, 200);
    test_graph("bf16 graph: 4 decodes + 3-token chunk, H32 Hkv4 Dh128 S16", 32, 4, 128, 16, 4, 3,
               3000);
    g_bf16 = 0;

    printf("CUDA graph replay == direct call\n");
    test_graph("graph: 1 decode, H32 Hkv4 Dh128 S16", 32, 4, 128, 16, 0, 1, 3000);
    test_graph("graph: 1 decode of 40000, H32 Hkv4 Dh128 S16", 32, 4, 128, 16, 0, 1, 40000);
    test_graph("graph: 3 decodes, H32 Hkv4 Dh128 S16", 32, 4, 128, 16, 2, 1, 700);
    test_graph("graph: 4 decodes + 3-token chunk, H32 Hkv4 Dh128 S16", 32, 4, 128, 16, 4, 3, 3000);
    test_graph("graph: 40 decodes + 24-token chunk, H32 Hkv4 Dh128 S16", 32, 4, 128, 16, 40, 24,
               3000);
}

/* ---- timing ---- */

static double event_ms(cuda_event a, cuda_event b) {
    float ms = 0.0f;
    MS_ASSERT(cudaEventSynchronize(b) == 0 && cudaEventElapsedTime(&ms, a, b) == 0);
    return ms;
}

/* Device-to-device copy of 1 GiB: bytes read + written per second. */
static double bench_copy(cuda_event e0, cuda_event e1) {
    const size_t bytes = (size_t)1 << 30;
    void *a = gpu->dev_alloc(bytes), *b = gpu->dev_alloc(bytes);
    MS_ASSERT(a && b);
    gpu->dev_zero(a, bytes);
    void *st = cuda_stream();
    for (int i = 0; i < 2; i++)
        MS_ASSERT(cudaMemcpyAsync(b, a, bytes, CUDA_MEMCPY_DEVICE_TO_DEVICE, st) == 0);
    const int iters = 10;
    cudaEventRecord(e0, st);
    for (int i = 0; i < iters; i++)
        cudaMemcpyAsync(b, a, bytes, CUDA_MEMCPY_DEVICE_TO_DEVICE, st);
    cudaEventRecord(e1, st);
    const double s = event_ms(e0, e1) / 1e3 / iters;
    gpu->dev_free(a);
    gpu->dev_free(b);
    const double gbs = 2.0 * bytes / s / 1e9;
    printf("device copy 1 GiB: %.1f us, %.0f GB/s (read + write)\n", s * 1e6, gbs);
    return gbs;
}

/* Seconds a call of iters calls (after 3 to warm up). */
static double time_calls(float *dout, const float *dq, kv_layer kv, const attn_batch *ab, int H,
                         int Hkv, int Dh, float scale, int iters, cuda_event e0, cuda_event e1) {
    for (int i = 0; i < 3; i++)
        gpu->attention(dout, dq, kv, ab, H, Hkv, Dh, scale);
    cudaEventRecord(e0, cuda_stream());
    for (int i = 0; i < iters; i++)
        gpu->attention(dout, dq, kv, ab, H, Hkv, Dh, scale);
    cudaEventRecord(e1, cuda_stream());
    return event_ms(e0, e1) / 1e3 / iters;
}

/* B sequences 0..B-1 of one decode token each at position ctx - 1, staged on the device (dpos,
 * dseq from hpos, hseq), over page table dpt of max_pages pages a sequence. */
static attn_batch decode_batch(int B, int ctx, int32_t *hpos, int32_t *hseq, int32_t *dpos,
                               int32_t *dseq, const int32_t *dpt, int max_pages, int S) {
    for (int t = 0; t < B; t++) {
        hseq[t] = t;
        hpos[t] = ctx - 1;
    }
    gpu->to_device(dpos, hpos, B * sizeof(int32_t));
    gpu->to_device(dseq, hseq, B * sizeof(int32_t));
    return (attn_batch){.T = B,
                        .pos = dpos,
                        .seq = dseq,
                        .page_table = dpt,
                        .max_pages = max_pages,
                        .page_size = S};
}

static void bench(void) {
    const int H = 32, Hkv = 4, Dh = 128, S = 16, max_len = 8192, max_b = 256;
    const int max_pages = max_len / S, P = max_b * max_pages;
    const float scale = 1.0f / sqrtf((float)Dh);
    cuda_event e0, e1;
    MS_ASSERT(cudaEventCreate(&e0) == 0 && cudaEventCreate(&e1) == 0);
    printf("timing (CUDA events after warm-up), H %d Hkv %d Dh %d S %d, fp32 KV\n", H, Hkv, Dh, S);
    const double copy_gbs = bench_copy(e0, e1);

    /* the cache: 256 sequences of 8192 positions, pages in random order, filled from a random
     * 64 MiB block */
    const size_t kv_bytes = (size_t)P * S * Hkv * Dh * sizeof(float);
    float *dk = gpu->dev_alloc(kv_bytes), *dv = gpu->dev_alloc(kv_bytes);
    MS_ASSERT(dk && dv);
    {
        const size_t blk = (size_t)64 << 20;
        float *h = xmalloc(blk), *d = gpu->dev_alloc(blk);
        fill_uniform(h, blk / sizeof(float), 1.0f);
        gpu->to_device(d, h, blk);
        for (size_t off = 0; off < kv_bytes; off += blk) {
            const size_t n = kv_bytes - off < blk ? kv_bytes - off : blk;
            cudaMemcpyAsync((char *)dk + off, d, n, CUDA_MEMCPY_DEVICE_TO_DEVICE, cuda_stream());
            cudaMemcpyAsync((char *)dv + off, d, n, CUDA_MEMCPY_DEVICE_TO_DEVICE, cuda_stream());
        }
        gpu->sync();
        gpu->dev_free(d);
        free(h);
    }
    int32_t *pt = xmalloc((size_t)P * sizeof(int32_t));
    for (int i = 0; i < P; i++)
        pt[i] = i;
    for (int i = P - 1; i > 0; i--) {
        const int j = rng_int(i + 1);
        const int32_t x = pt[i];
        pt[i] = pt[j];
        pt[j] = x;
    }
    int32_t *dpt = gpu->dev_alloc((size_t)P * sizeof(int32_t));
    gpu->to_device(dpt, pt, (size_t)P * sizeof(int32_t));
    kv_layer kv = {.k = dk, .v = dv, .bf16 = 0};
    const kv_layer kvb = {.k = dk, .v = dv, .bf16 = 1}; /* for the time alone */

    const int max_t = 8 * 2048;
    const size_t qbytes = (size_t)max_t * H * Dh * sizeof(float);
    float *hq = xmalloc(qbytes);
    fill_uniform(hq, (int64_t)max_t * H * Dh, 1.0f);
    float *dq = gpu->dev_alloc(qbytes), *dout = gpu->dev_alloc(qbytes);
    int32_t *hpos = xmalloc(max_t * sizeof(int32_t)), *hseq = xmalloc(max_t * sizeof(int32_t));
    int32_t *dpos = gpu->dev_alloc(max_t * sizeof(int32_t));
    int32_t *dseq = gpu->dev_alloc(max_t * sizeof(int32_t));
    MS_ASSERT(dq && dout && dpos && dseq);
    gpu->to_device(dq, hq, qbytes);

    /* decode: B sequences, one token each at position ctx - 1; the usual path, then (where the
     * kernel file can be told) each path forced */
    const int batches[] = {1, 2, 4, 8, 64, 256}, ctxs[] = {1024, 2048, 8192};
    const int n_forced = cuda_attention_debug_path ? 2 : 0;
    const int forced[] = {PATH_SLICES, PATH_CHUNKS};
    for (int ci = 0; ci < 3; ci++)
        for (int bi = 0; bi < 6; bi++) {
            const int B = batches[bi], ctx = ctxs[ci];
            attn_batch ab = decode_batch(B, ctx, hpos, hseq, dpos, dseq, dpt, max_pages, S);
            const double bytes = (double)B * ctx * Hkv * Dh * sizeof(float) * 2;
            int iters = (int)(3e-2 * 4e12 / bytes);
            iters = iters < 10 ? 10 : iters > 2000 ? 2000 : iters;
            printf("decode B=%-3d ctx=%-5d KV %7.1f MB", B, ctx, bytes / 1e6);
            for (int k = -1; k < n_forced; k++) {
                set_path(k < 0 ? PATH_AUTO : forced[k]);
                const double sec = time_calls(dout, dq, kv, &ab, H, Hkv, Dh, scale, iters, e0, e1);
                if (k < 0)
                    printf(" %9.1f us %6.0f GB/s %5.1f%% of copy", sec * 1e6, bytes / sec / 1e9,
                           100.0 * bytes / sec / 1e9 / copy_gbs);
                else
                    printf(" | %s %8.1f us", path_names[forced[k]], sec * 1e6);
            }
            set_path(PATH_AUTO);
            if (ci != 1 && (bi == 0 || bi >= 4)) /* a BF16 cache: the same bytes read as BF16 */
                printf(" | BF16 KV %8.1f us",
                       1e6 * time_calls(dout, dq, kvb, &ab, H, Hkv, Dh, scale, iters, e0, e1));
            printf("\n");
        }

    /* short contexts at small batches: one slice (32 positions), one chunk (256) and just past it
     */
    {
        const int sctx[] = {16, 32, 200, 256, 257};
        for (int ci = 0; ci < 5; ci++)
            for (int bi = 0; bi < 3; bi++) {
                const int B = batches[bi], ctx = sctx[ci];
                attn_batch ab = decode_batch(B, ctx, hpos, hseq, dpos, dseq, dpt, max_pages, S);
                printf("decode B=%-3d ctx=%-5d %9.1f us | BF16 KV %8.1f us\n", B, ctx,
                       1e6 * time_calls(dout, dq, kv, &ab, H, Hkv, Dh, scale, 500, e0, e1),
                       1e6 * time_calls(dout, dq, kvb, &ab, H, Hkv, Dh, scale, 500, e0, e1));
            }
    }

    /* decode again with page tables of 2560 pages a sequence (the graphs of a server for 40960
     * positions): the grids are sized from that bound. Sequence t's first pages are those of the
     * table above. */
    const int room = 2560, room_b = batches[5];
    int32_t *pt_room = xcalloc((size_t)room_b * room, sizeof(int32_t));
    for (int t = 0; t < room_b; t++)
        memcpy(pt_room + (size_t)t * room, pt + (size_t)t * max_pages,
               (size_t)max_pages * sizeof(int32_t));
    int32_t *dpt_room = gpu->dev_alloc((size_t)room_b * room * sizeof(int32_t));
    gpu->to_device(dpt_room, pt_room, (size_t)room_b * room * sizeof(int32_t));
    free(pt_room);
    for (int ci = 0; ci < 2; ci++)
        for (int bi = 0; bi < 6; bi++) {
            const int B = batches[bi], ctx = ctxs[ci];
            attn_batch ab = decode_batch(B, ctx, hpos, hseq, dpos, dseq, dpt_room, room, S);
            const int iters = B >= 64 ? 50 : 500;
            printf("decode B=%-3d ctx=%-5d room %d", B, ctx, room * S);
            for (int k = -1; k < n_forced; k++) {
                set_path(k < 0 ? PATH_AUTO : forced[k]);
                const double sec = time_calls(dout, dq, kv, &ab, H, Hkv, Dh, scale, iters, e0, e1);
                if (k < 0)
                    printf(" %9.1f us", sec * 1e6);
                else
                    printf(" | %s %8.1f us", path_names[forced[k]], sec * 1e6);
            }
            set_path(PATH_AUTO);
            printf("\n");
        }

    /* prefill: n_seq sequences of Tp tokens each at positions lo..lo + Tp - 1, in one batch */
    const int pre[][3] = {{1, 2048, 0}, {8, 2048, 0}, {1, 2048, 2048}}; /* n_seq, Tp, lo */
    for (int pi = 0; pi < 3; pi++) {
        const int n_seq = pre[pi][0], Tp = pre[pi][1], lo = pre[pi][2], T = n_seq * Tp;
        double pairs = 0.0;
        for (int s = 0; s < n_seq; s++)
            for (int t = 0; t < Tp; t++) {
                hseq[s * Tp + t] = s;
                hpos[s * Tp + t] = lo + t;
                pairs += lo + t + 1;
            }
        gpu->to_device(dpos, hpos, T * sizeof(int32_t));
        gpu->to_device(dseq, hseq, T * sizeof(int32_t));
        attn_batch ab = {.T = T, .pos = dpos, .seq = dseq, .page_table = dpt,
                         .max_pages = max_pages, .page_size = S};
        const double flop = 4.0 * pairs * H * Dh; /* q.k and p.v, 2 flop a multiply-add */
        printf("prefill %d x %d tokens at positions %d..%d:", n_seq, Tp, lo, lo + Tp - 1);
        for (int k = -1; k < (n_forced ? 1 : 0); k++) {
            set_path(k < 0 ? PATH_AUTO : PATH_CHUNKS);
            gpu->attention(dout, dq, kv, &ab, H, Hkv, Dh, scale);
            const int iters = 5;
            cudaEventRecord(e0, cuda_stream());
            for (int i = 0; i < iters; i++)
                gpu->attention(dout, dq, kv, &ab, H, Hkv, Dh, scale);
            cudaEventRecord(e1, cuda_stream());
            const double sec = event_ms(e0, e1) / 1e3 / iters;
            if (k < 0)
                printf(" %9.1f us %5.1f TFLOP/s %7.0f tokens/s", sec * 1e6, flop / sec / 1e12,
                       T / sec);
            else
                printf(" | chunks %9.1f us", sec * 1e6);
        }
        set_path(PATH_AUTO);
        printf("\n");
    }

    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    gpu->dev_free(dk);
    gpu->dev_free(dv);
    gpu->dev_free(dpt);
    gpu->dev_free(dpt_room);
    gpu->dev_free(dq);
    gpu->dev_free(dout);
    gpu->dev_free(dpos);
    gpu->dev_free(dseq);
    free(pt);
    free(hq);
    free(hpos);
    free(hseq);
}

int main(int argc, char **argv) {
    char err[256] = "";
    setvbuf(stdout, NULL, _IOLBF, 0); /* lines out before an abort in a kernel */
    cpu = ops_cpu();
    gpu = ops_cuda(0, err, sizeof err);
    if (!gpu) {
        printf("skipped: %s\n", err);
        printf("0 passed, 0 failed\n");
        return 0;
    }
    printf("CUDA paged attention against the CPU reference (tolerance %.0e x max|v|)\n", ATTN_TOL);
    const bool bench_only = argc > 1 && strcmp(argv[1], "--bench-only") == 0;
    if (!bench_only) run_tests();
    if (bench_only || (argc > 1 && strcmp(argv[1], "--bench") == 0)) bench();
    CHECK_SUMMARY();
}

#endif
