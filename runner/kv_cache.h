/* The paged KV cache: for every layer, k and v pools of [P, S, Hkv, Dh] float32, and one page
 * allocator shared by all layers (page p holds the same positions in every layer). A sequence
 * owns a list of pages; position i of it lives in page list[i / S], slot i % S. */
#ifndef MOESERVE_KV_CACHE_H
#define MOESERVE_KV_CACHE_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/ops.h"

typedef struct {
    int n_layers;  /* L */
    int n_pages;   /* P */
    int page_size; /* S */
    int n_kv_heads; /* Hkv */
    int head_dim;   /* Dh */
    float *k;       /* [L, P, S, Hkv, Dh] */
    float *v;       /* [L, P, S, Hkv, Dh] */
    int32_t *free_pages; /* stack of free page ids */
    int n_free;
} kv_cache;

/* Allocate the pools. Returns 0, or -1 with a message when memory is short. */
int kv_cache_init(kv_cache *kv, int n_layers, int n_pages, int page_size, int n_kv_heads,
                  int head_dim, char *err, size_t errlen);
void kv_cache_free(kv_cache *kv);

/* The pools of one layer. */
kv_layer kv_cache_layer(const kv_cache *kv, int layer);

/* Take a free page; -1 when none is left. */
int32_t kv_cache_alloc_page(kv_cache *kv);
/* Give a page back. */
void kv_cache_release_page(kv_cache *kv, int32_t page);

#endif
