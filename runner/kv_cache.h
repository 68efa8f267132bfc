/* The paged KV cache: for every layer, k and v pools of [P, S, Hkv, Dh] float32 (or bfloat16, bf16
 * set: kernels/ops.h's kv_layer), and one page allocator shared by all layers (page p holds the
 * same positions in every layer). A sequence owns a list of pages; position i of it lives in page
 * list[i / S], slot i % S.
 *
 * Pages are reference counted so that several holders can share one: the prefix cache and every
 * running request whose prompt starts with the cached tokens. A page is free exactly when its
 * count is 0; only full pages are ever shared, so a shared page is never written again. */
#ifndef MOESERVE_KV_CACHE_H
#define MOESERVE_KV_CACHE_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/ops.h"

typedef struct {
    int n_layers;        /* L */
    int n_pages;         /* P */
    int page_size;       /* S */
    int n_kv_heads;      /* Hkv */
    int head_dim;        /* Dh */
    float *k;            /* [L, P, S, Hkv, Dh] on the backend's device (bf16: uint16_t elements) */
    float *v;            /* [L, P, S, Hkv, Dh] */
    int bf16;            /* elements in bfloat16 */
    const struct ops *mem; /* whose dev_alloc made k and v (NULL: malloc) */
    int32_t *free_pages; /* [P] stack of free page ids, n_free of them */
    int n_free;
    int32_t *refs; /* [P] holders of each page; 0 = free */
} kv_cache;

/* --kv-cache-dtype's names: KV_DTYPE_BF16 for bfloat16 (bf16), KV_DTYPE_FLOAT32 for float32
 * (fp32), KV_DTYPE_AUTO for auto, -1 otherwise. */
enum { KV_DTYPE_FLOAT32 = 0, KV_DTYPE_BF16 = 1, KV_DTYPE_AUTO = 2 };
int kv_cache_dtype_parse(const char *name);

/* Whether a cache of parsed dtype d is BF16 on the given device: auto is bfloat16 on CUDA (the
 * type of the weights there and of SGLang's auto for a BF16 checkpoint: half the bytes a token,
 * and faster decode attention) and float32 on the CPU (the reference's exact cache). */
static inline int kv_cache_dtype_bf16(int d, int cuda) {
    return d == KV_DTYPE_AUTO ? cuda != 0 : d == KV_DTYPE_BF16;
}

/* Bytes of one cache element. */
static inline size_t kv_cache_elem_bytes(int bf16) { return bf16 ? 2 : sizeof(float); }

/* Allocate the pools on o's device (o NULL: host memory), in bfloat16 when bf16 (else float32);
 * the page bookkeeping stays on the host. Returns 0, or -1 with a message when memory is short. */
int kv_cache_init(kv_cache *kv, const struct ops *o, int n_layers, int n_pages, int page_size,
                  int n_kv_heads, int head_dim, int bf16, char *err, size_t errlen);
void kv_cache_free(kv_cache *kv);

/* The pools of one layer. */
kv_layer kv_cache_layer(const kv_cache *kv, int layer);

/* Take a free page with one reference (the caller's); -1 when none is left. */
int32_t kv_cache_alloc_page(kv_cache *kv);
/* Add a holder to a page in use. */
void kv_cache_retain_page(kv_cache *kv, int32_t page);
/* Drop one holder; the last one gives the page back to the free list. */
void kv_cache_release_page(kv_cache *kv, int32_t page);
/* Holders of a page in use (0 when free). */
int kv_cache_page_refs(const kv_cache *kv, int32_t page);

#endif
