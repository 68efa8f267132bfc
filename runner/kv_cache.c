/* Paged KV cache: contiguous pools per layer, a LIFO free list (recently freed pages are warm in
 * cache when reused) and a reference count per page. A double release or a retain of a free
 * page is a broken invariant and aborts.
 *
 * In host memory (the CPU backend) the pools are written once here: the operating system hands
 * out a page of a large allocation only when it is first touched, so an untouched pool would
 * make the process grow as pages are first used (up to the whole pool, pages kept by the
 * prefix cache included), look like a leak under load, and fail late on a machine that cannot
 * hold it. Written at start, the pool is resident from the start and stays what it is. */
#include "runner/kv_cache.h"

#include <stdlib.h>
#include <string.h>

#include "common/log.h"

int kv_cache_dtype_parse(const char *name) {
    if (!strcmp(name, "bfloat16") || !strcmp(name, "bf16")) return KV_DTYPE_BF16;
    if (!strcmp(name, "float32") || !strcmp(name, "fp32")) return KV_DTYPE_FLOAT32;
    if (!strcmp(name, "auto")) return KV_DTYPE_AUTO;
    return -1;
}

int kv_cache_init(kv_cache *kv, const struct ops *o, int n_layers, int n_pages, int page_size,
                  int n_kv_heads, int head_dim, int bf16, char *err, size_t errlen) {
    *kv = (kv_cache){.n_layers = n_layers,
                     .n_pages = n_pages,
                     .page_size = page_size,
                     .n_kv_heads = n_kv_heads,
                     .head_dim = head_dim,
                     .bf16 = bf16 != 0,
                     .mem = o};
    const size_t el = kv_cache_elem_bytes(bf16);
    size_t n = (size_t)n_layers * n_pages * page_size * n_kv_heads * head_dim;
    kv->k = o ? o->dev_alloc(n * el) : malloc(n * el);
    kv->v = o ? o->dev_alloc(n * el) : malloc(n * el);
    kv->free_pages = malloc((size_t)n_pages * sizeof(int32_t));
    kv->refs = calloc((size_t)n_pages, sizeof(int32_t));
    if (!kv->k || !kv->v || !kv->free_pages || !kv->refs) {
        kv_cache_free(kv);
        return set_err(err, errlen, "KV cache: cannot allocate %d pages of %d tokens (%.1f MiB)",
                       n_pages, page_size, 2.0 * n * el / (1 << 20));
    }
    if (!o || !strcmp(o->name, "cpu")) {
        memset(kv->k, 0, n * el);
        memset(kv->v, 0, n * el);
    }
    for (int i = 0; i < n_pages; i++)
        kv->free_pages[i] = n_pages - 1 - i;
    kv->n_free = n_pages;
    return 0;
}

void kv_cache_free(kv_cache *kv) {
    if (kv->mem) {
        if (kv->k) kv->mem->dev_free(kv->k);
        if (kv->v) kv->mem->dev_free(kv->v);
    } else {
        free(kv->k);
        free(kv->v);
    }
    free(kv->free_pages);
    free(kv->refs);
    *kv = (kv_cache){0};
}

kv_layer kv_cache_layer(const kv_cache *kv, int layer) {
    const size_t stride = (size_t)kv->n_pages * kv->page_size * kv->n_kv_heads * kv->head_dim *
                          kv_cache_elem_bytes(kv->bf16) * layer;
    return (kv_layer){.k = (float *)(void *)((char *)kv->k + stride),
                      .v = (float *)(void *)((char *)kv->v + stride),
                      .bf16 = kv->bf16};
}

int32_t kv_cache_alloc_page(kv_cache *kv) {
    if (kv->n_free == 0) return -1;
    int32_t page = kv->free_pages[--kv->n_free];
    MS_ASSERT(kv->refs[page] == 0);
    kv->refs[page] = 1;
    return page;
}

void kv_cache_retain_page(kv_cache *kv, int32_t page) {
    MS_ASSERT(page >= 0 && page < kv->n_pages && kv->refs[page] > 0);
    kv->refs[page]++;
}

void kv_cache_release_page(kv_cache *kv, int32_t page) {
    MS_ASSERT(page >= 0 && page < kv->n_pages && kv->refs[page] > 0);
    if (--kv->refs[page] > 0) return;
    MS_ASSERT(kv->n_free < kv->n_pages);
    kv->free_pages[kv->n_free++] = page;
}

int kv_cache_page_refs(const kv_cache *kv, int32_t page) {
    MS_ASSERT(page >= 0 && page < kv->n_pages);
    return kv->refs[page];
}
