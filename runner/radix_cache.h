/* The radix prefix cache: a tree over token ids that maps prompt prefixes to the KV pages that
 * hold them, so a request whose prompt starts like an earlier one reuses those pages instead of
 * recomputing them (SGLang's RadixAttention, at page granularity).
 *
 * Choices:
 * - Only full pages are cached: every node's key is a whole number of pages (n_pages * S tokens)
 *   and a match is a whole number of pages. A cached page is therefore never written again, and
 *   a request that shares it writes its own positions into pages of its own.
 * - The tree holds one reference (kv_cache_retain_page) on every page it stores, and every
 *   caller of radix_cache_match gets one more on each matched page. A page is in use by a request
 *   while its count is above 1; such a page is never evicted. Flushing or evicting only drops the
 *   tree's reference, so pages still held by running requests stay valid.
 * - Eviction takes leaves whose pages nobody else holds, least recently used first (a logical
 *   clock ticks on every match and insert); a parent emptied of children becomes a candidate.
 * - Matching splits a node where the match ends, so the pages a request shares always form whole
 *   nodes from the root down.
 * Single-threaded: only the engine thread uses it. */
#ifndef MOESERVE_RADIX_CACHE_H
#define MOESERVE_RADIX_CACHE_H

#include <stddef.h>
#include <stdint.h>

#include "runner/kv_cache.h"

typedef struct radix_node radix_node;

struct radix_node {
    radix_node *parent;    /* NULL for the root */
    radix_node **children; /* [n_children]; siblings differ in their first page of tokens */
    int n_children;
    int cap_children;
    int32_t *key;         /* [n_pages * S] token ids */
    int32_t *pages;       /* [n_pages] KV page ids, one tree reference each */
    int n_pages;          /* 0 only for the root */
    uint64_t last_access; /* logical clock of the last match or insert through this node */
};

typedef struct {
    kv_cache *kv;     /* the page pool (not owned) */
    int page_size;    /* S */
    radix_node *root; /* empty key */
    int n_pages;      /* pages held by the tree */
    int n_nodes;      /* nodes other than the root */
    uint64_t clock;
} radix_cache;

/* An empty cache over the pages of kv. */
void radix_cache_init(radix_cache *rc, kv_cache *kv);
/* Drop the tree's references and free the nodes. */
void radix_cache_free(radix_cache *rc);

/* The longest cached prefix of tokens[0 .. max_tokens), in whole pages. Writes its page ids to
 * pages_out[max_tokens / S] (each with a new reference for the caller, who releases it) and
 * returns the matched length in tokens (a multiple of S). Marks the path as recently used. */
int radix_cache_match(radix_cache *rc, const int32_t *tokens, int max_tokens, int32_t *pages_out);

/* Store the prefix tokens[0 .. n_tokens) rounded down to whole pages, whose KV lives in
 * pages[n_tokens / S]. Where the tree already holds a page for a part, it keeps its own (the
 * caller's copy stays the caller's); for the new part it takes a reference on the caller's pages.
 * Returns the number of pages added. */
int radix_cache_insert(radix_cache *rc, const int32_t *tokens, int n_tokens, const int32_t *pages);

/* Free at least n_pages pages if possible by evicting unreferenced leaves, least recently used
 * first. Returns the number of pages given back to the pool. */
int radix_cache_evict(radix_cache *rc, int n_pages);

/* Drop every node (pages still held by requests stay valid with their other references). */
void radix_cache_flush(radix_cache *rc);

/* Check the tree's invariants (keys and page counts, sibling first pages distinct, no page held
 * twice, every held page referenced). Returns 0, or -1 with a message. For tests. */
int radix_cache_validate(const radix_cache *rc, char *err, size_t errlen);

#endif
