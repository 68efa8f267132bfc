/* Radix prefix cache (see radix_cache.h): nodes keyed by whole pages of tokens, LRU eviction of
 * unreferenced leaves through a binary min-heap on last_access, built afresh per eviction (the
 * candidates change with every request that starts or ends, so a standing heap would need
 * updates from everywhere for little gain). */
#include "runner/radix_cache.h"

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"

static radix_node *node_new(radix_node *parent, const int32_t *key, const int32_t *pages,
                            int n_pages, int S) {
    radix_node *n = xcalloc(1, sizeof *n);
    n->parent = parent;
    n->n_pages = n_pages;
    if (n_pages > 0) {
        n->key = xmalloc((size_t)n_pages * S * sizeof(int32_t));
        n->pages = xmalloc((size_t)n_pages * sizeof(int32_t));
        memcpy(n->key, key, (size_t)n_pages * S * sizeof(int32_t));
        memcpy(n->pages, pages, (size_t)n_pages * sizeof(int32_t));
    }
    return n;
}

static void node_add_child(radix_node *parent, radix_node *child) {
    if (parent->n_children == parent->cap_children) {
        parent->cap_children = parent->cap_children ? 2 * parent->cap_children : 4;
        parent->children =
            xrealloc(parent->children, (size_t)parent->cap_children * sizeof(radix_node *));
    }
    parent->children[parent->n_children++] = child;
    child->parent = parent;
}

static void node_remove_child(radix_node *parent, radix_node *child) {
    for (int i = 0; i < parent->n_children; i++)
        if (parent->children[i] == child) {
            parent->children[i] = parent->children[--parent->n_children];
            return;
        }
    MS_ASSERT(!"child not found under its parent");
}

/* The child of n whose first page of tokens equals page[S]; NULL if none. */
static radix_node *node_find_child(const radix_node *n, const int32_t *page, int S) {
    for (int i = 0; i < n->n_children; i++)
        if (!memcmp(n->children[i]->key, page, (size_t)S * sizeof(int32_t))) return n->children[i];
    return NULL;
}

/* Leading whole pages on which n's key and tokens[max_pages * S] agree. */
static int node_common_pages(const radix_node *n, const int32_t *tokens, int max_pages, int S) {
    int lim = n->n_pages < max_pages ? n->n_pages : max_pages, k = 0;
    while (k < lim &&
           !memcmp(n->key + (size_t)k * S, tokens + (size_t)k * S, (size_t)S * sizeof(int32_t)))
        k++;
    return k;
}

/* Cut n after its first k pages (0 < k < n_pages): a new node takes those k pages in n's place
 * and n, keeping the rest, becomes its only child. Returns the new node. */
static radix_node *node_split(radix_cache *rc, radix_node *n, int k) {
    int S = rc->page_size;
    MS_ASSERT(k > 0 && k < n->n_pages);
    radix_node *parent = n->parent;
    radix_node *mid = node_new(NULL, n->key, n->pages, k, S);
    mid->last_access = n->last_access;
    for (int i = 0; i < parent->n_children; i++)
        if (parent->children[i] == n) parent->children[i] = mid;
    mid->parent = parent;
    int rest = n->n_pages - k;
    memmove(n->key, n->key + (size_t)k * S, (size_t)rest * S * sizeof(int32_t));
    memmove(n->pages, n->pages + k, (size_t)rest * sizeof(int32_t));
    n->n_pages = rest;
    node_add_child(mid, n);
    rc->n_nodes++;
    return mid;
}

/* Free n and its subtree, dropping the tree's page references. */
static void node_free_tree(radix_cache *rc, radix_node *n) {
    for (int i = 0; i < n->n_children; i++)
        node_free_tree(rc, n->children[i]);
    for (int i = 0; i < n->n_pages; i++)
        kv_cache_release_page(rc->kv, n->pages[i]);
    free(n->children);
    free(n->key);
    free(n->pages);
    free(n);
}

void radix_cache_init(radix_cache *rc, kv_cache *kv) {
    *rc = (radix_cache){.kv = kv, .page_size = kv->page_size};
    rc->root = node_new(NULL, NULL, NULL, 0, kv->page_size);
}

void radix_cache_free(radix_cache *rc) {
    if (rc->root) node_free_tree(rc, rc->root);
    *rc = (radix_cache){0};
}

void radix_cache_flush(radix_cache *rc) {
    kv_cache *kv = rc->kv;
    radix_cache_free(rc);
    radix_cache_init(rc, kv);
}

int radix_cache_match(radix_cache *rc, const int32_t *tokens, int max_tokens, int32_t *pages_out) {
    int S = rc->page_size, max_pages = max_tokens > 0 ? max_tokens / S : 0, got = 0;
    uint64_t now = ++rc->clock;
    radix_node *n = rc->root;
    while (got < max_pages) {
        const int32_t *rest = tokens + (size_t)got * S;
        radix_node *c = node_find_child(n, rest, S);
        if (!c) break;
        int k = node_common_pages(c, rest, max_pages - got, S);
        bool partial = k < c->n_pages;
        if (partial) c = node_split(rc, c, k);
        c->last_access = now;
        for (int i = 0; i < k; i++) {
            kv_cache_retain_page(rc->kv, c->pages[i]);
            pages_out[got + i] = c->pages[i];
        }
        got += k;
        n = c;
        if (partial) break;
    }
    return got * S;
}

int radix_cache_insert(radix_cache *rc, const int32_t *tokens, int n_tokens, const int32_t *pages) {
    int S = rc->page_size, n_pages = n_tokens > 0 ? n_tokens / S : 0, done = 0;
    uint64_t now = ++rc->clock;
    radix_node *n = rc->root;
    while (done < n_pages) {
        const int32_t *rest = tokens + (size_t)done * S;
        radix_node *c = node_find_child(n, rest, S);
        if (!c) {
            int add = n_pages - done;
            c = node_new(NULL, rest, pages + done, add, S);
            c->last_access = now;
            for (int i = 0; i < add; i++)
                kv_cache_retain_page(rc->kv, c->pages[i]);
            node_add_child(n, c);
            rc->n_nodes++;
            rc->n_pages += add;
            return add;
        }
        int k = node_common_pages(c, rest, n_pages - done, S);
        if (k < c->n_pages) c = node_split(rc, c, k);
        c->last_access = now;
        done += k;
        n = c;
    }
    return 0;
}

/* A leaf whose pages nobody but the tree holds. */
static bool node_evictable(const radix_cache *rc, const radix_node *n) {
    if (n == rc->root || n->n_children > 0) return false;
    for (int i = 0; i < n->n_pages; i++)
        if (kv_cache_page_refs(rc->kv, n->pages[i]) != 1) return false;
    return true;
}

typedef struct {
    radix_node **items;
    int n, cap;
} node_heap; /* min-heap on last_access */

static void heap_push(node_heap *h, radix_node *x) {
    if (h->n == h->cap) {
        h->cap = h->cap ? 2 * h->cap : 16;
        h->items = xrealloc(h->items, (size_t)h->cap * sizeof *h->items);
    }
    int i = h->n++;
    while (i > 0) {
        int p = (i - 1) / 2;
        if (h->items[p]->last_access <= x->last_access) break;
        h->items[i] = h->items[p];
        i = p;
    }
    h->items[i] = x;
}

static radix_node *heap_pop(node_heap *h) {
    radix_node *top = h->items[0], *x = h->items[--h->n];
    int i = 0;
    for (;;) {
        int c = 2 * i + 1;
        if (c >= h->n) break;
        if (c + 1 < h->n && h->items[c + 1]->last_access < h->items[c]->last_access) c++;
        if (x->last_access <= h->items[c]->last_access) break;
        h->items[i] = h->items[c];
        i = c;
    }
    if (h->n > 0) h->items[i] = x;
    return top;
}

static void collect_evictable(const radix_cache *rc, radix_node *n, node_heap *h) {
    if (node_evictable(rc, n)) heap_push(h, n);
    for (int i = 0; i < n->n_children; i++)
        collect_evictable(rc, n->children[i], h);
}

int radix_cache_evict(radix_cache *rc, int n_pages) {
    if (n_pages <= 0 || rc->n_pages == 0) return 0;
    node_heap h = {0};
    collect_evictable(rc, rc->root, &h);
    int freed = 0;
    while (freed < n_pages && h.n > 0) {
        radix_node *leaf = heap_pop(&h), *parent = leaf->parent;
        node_remove_child(parent, leaf);
        freed += leaf->n_pages;
        rc->n_pages -= leaf->n_pages;
        rc->n_nodes--;
        node_free_tree(rc, leaf);
        if (node_evictable(rc, parent)) heap_push(&h, parent);
    }
    free(h.items);
    return freed;
}

/* Walk n's subtree checking its invariants; seen[P] marks pages met so far. */
static int validate_node(const radix_cache *rc, const radix_node *n, uint8_t *seen, int *pages,
                         int *nodes, char *err, size_t errlen) {
    int S = rc->page_size;
    if (n != rc->root) {
        if (n->n_pages < 1) return set_err(err, errlen, "radix: a non-root node has no pages");
        (*nodes)++;
        *pages += n->n_pages;
        for (int i = 0; i < n->n_pages; i++) {
            int32_t p = n->pages[i];
            if (p < 0 || p >= rc->kv->n_pages)
                return set_err(err, errlen, "radix: page id %d outside the pool", p);
            if (seen[p]) return set_err(err, errlen, "radix: page %d held twice", p);
            seen[p] = 1;
            if (kv_cache_page_refs(rc->kv, p) < 1)
                return set_err(err, errlen, "radix: page %d held by the tree is free", p);
        }
    }
    for (int i = 0; i < n->n_children; i++) {
        const radix_node *c = n->children[i];
        if (c->parent != n) return set_err(err, errlen, "radix: a child's parent link is wrong");
        for (int j = 0; j < i; j++)
            if (!memcmp(c->key, n->children[j]->key, (size_t)S * sizeof(int32_t)))
                return set_err(err, errlen, "radix: two siblings start with the same page");
        if (validate_node(rc, c, seen, pages, nodes, err, errlen)) return -1;
    }
    return 0;
}

int radix_cache_validate(const radix_cache *rc, char *err, size_t errlen) {
    uint8_t *seen = xcalloc((size_t)rc->kv->n_pages, 1);
    int pages = 0, nodes = 0;
    int rcode = validate_node(rc, rc->root, seen, &pages, &nodes, err, errlen);
    free(seen);
    if (rcode) return -1;
    if (rc->root->n_pages != 0) return set_err(err, errlen, "radix: the root has pages");
    if (pages != rc->n_pages)
        return set_err(err, errlen, "radix: %d pages in the nodes, %d counted", pages, rc->n_pages);
    if (nodes != rc->n_nodes)
        return set_err(err, errlen, "radix: %d nodes found, %d counted", nodes, rc->n_nodes);
    return 0;
}
