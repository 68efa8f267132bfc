/* Paged KV cache: contiguous pools per layer and a LIFO free list (recently freed pages are
 * warm in cache when reused). */
#include "runner/kv_cache.h"

#include <stdlib.h>

#include "common/log.h"

int kv_cache_init(kv_cache *kv, int n_layers, int n_pages, int page_size, int n_kv_heads,
                  int head_dim, char *err, size_t errlen) {
    *kv = (kv_cache){.n_layers = n_layers,
                     .n_pages = n_pages,
                     .page_size = page_size,
                     .n_kv_heads = n_kv_heads,
                     .head_dim = head_dim};
    size_t n = (size_t)n_layers * n_pages * page_size * n_kv_heads * head_dim;
    kv->k = malloc(n * sizeof(float));
    kv->v = malloc(n * sizeof(float));
    kv->free_pages = malloc((size_t)n_pages * sizeof(int32_t));
    if (!kv->k || !kv->v || !kv->free_pages) {
        kv_cache_free(kv);
        return set_err(err, errlen, "KV cache: cannot allocate %d pages of %d tokens (%.1f MiB)",
                       n_pages, page_size, 2.0 * n * sizeof(float) / (1 << 20));
    }
    for (int i = 0; i < n_pages; i++) kv->free_pages[i] = n_pages - 1 - i;
    kv->n_free = n_pages;
    return 0;
}

void kv_cache_free(kv_cache *kv) {
    free(kv->k);
    free(kv->v);
    free(kv->free_pages);
    *kv = (kv_cache){0};
}

kv_layer kv_cache_layer(const kv_cache *kv, int layer) {
    size_t stride = (size_t)kv->n_pages * kv->page_size * kv->n_kv_heads * kv->head_dim;
    return (kv_layer){.k = kv->k + layer * stride, .v = kv->v + layer * stride};
}

int32_t kv_cache_alloc_page(kv_cache *kv) {
    return kv->n_free > 0 ? kv->free_pages[--kv->n_free] : -1;
}

void kv_cache_release_page(kv_cache *kv, int32_t page) {
    MS_ASSERT(page >= 0 && page < kv->n_pages && kv->n_free < kv->n_pages);
    kv->free_pages[kv->n_free++] = page;
}
