/* Tests of the radix prefix cache (runner/radix_cache.c) over a small KV page pool: insert,
 * match (full, partial, page granularity), reference counts, LRU eviction order, flush. After
 * every operation the page accounting is checked: each page's reference count equals the
 * tree's holding plus the test's, and free + referenced == total (nothing leaked or freed
 * twice). Run from the repository root. */
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

#include "runner/radix_cache.h"
#include "tests/check.h"

#define S 4  /* tokens per page */
#define P 32 /* pages in the pool */

static kv_cache kv;
static radix_cache rc;
static int held[P]; /* the test's own references per page */

static void tree_pages(const radix_node *n, int *in_tree) {
    for (int i = 0; i < n->n_pages; i++)
        in_tree[n->pages[i]]++;
    for (int i = 0; i < n->n_children; i++)
        tree_pages(n->children[i], in_tree);
}

static void check_accounting(const char *where) {
    char err[256];
    CHECK(radix_cache_validate(&rc, err, sizeof err) == 0, "%s: %s", where, err);
    int in_tree[P] = {0}, used = 0, bad = -1;
    tree_pages(rc.root, in_tree);
    for (int p = 0; p < P; p++) {
        if (kv_cache_page_refs(&kv, p) != in_tree[p] + held[p] && bad < 0) bad = p;
        if (kv_cache_page_refs(&kv, p) > 0) used++;
    }
    CHECK(bad < 0, "%s: page %d has %d refs, tree %d + test %d", where, bad,
          bad < 0 ? 0 : kv_cache_page_refs(&kv, bad), bad < 0 ? 0 : in_tree[bad],
          bad < 0 ? 0 : held[bad]);
    CHECK(kv.n_free + used == P, "%s: %d free + %d used != %d", where, kv.n_free, used, P);
}

/* A "request" computing n_tokens: fresh pages for every page it touches (the test holds them). */
static int compute(int n_tokens, int32_t *pages) {
    int n = (n_tokens + S - 1) / S;
    for (int i = 0; i < n; i++) {
        pages[i] = kv_cache_alloc_page(&kv);
        if (pages[i] < 0) return -1;
        held[pages[i]]++;
    }
    return n;
}

static void drop(const int32_t *pages, int n) {
    for (int i = 0; i < n; i++) {
        held[pages[i]]--;
        kv_cache_release_page(&kv, pages[i]);
    }
}

static int match(const int32_t *tokens, int max_tokens, int32_t *pages) {
    int m = radix_cache_match(&rc, tokens, max_tokens, pages);
    for (int i = 0; i < m / S; i++)
        held[pages[i]]++;
    return m;
}

static void setup(void) {
    char err[256];
    memset(held, 0, sizeof held);
    if (kv_cache_init(&kv, NULL, 1, P, S, 1, 1, 0, err, sizeof err)) {
        fprintf(stderr, "%s\n", err);
        return;
    }
    radix_cache_init(&rc, &kv);
}

static void teardown(void) {
    radix_cache_free(&rc);
    CHECK(kv.n_free == P, "after free: %d of %d pages free", kv.n_free, P);
    kv_cache_free(&kv);
}

static void test_insert_match(void) {
    setup();
    int32_t a[12] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
    int32_t pa[3] = {0}, pm[8] = {0};
    CHECK(compute(12, pa) == 3, "compute");
    CHECK(radix_cache_insert(&rc, a, 12, pa) == 3, "insert adds 3 pages");
    CHECK(rc.n_pages == 3, "tree holds %d pages", rc.n_pages);
    for (int i = 0; i < 3; i++)
        CHECK(kv_cache_page_refs(&kv, pa[i]) == 2, "shared page %d: %d refs", i,
              kv_cache_page_refs(&kv, pa[i]));
    check_accounting("insert");
    drop(pa, 3); /* the request finishes: the tree keeps them */
    check_accounting("request done");
    CHECK(kv.n_free == P - 3, "3 pages cached");

    /* whole match */
    int m = match(a, 12, pm);
    CHECK(m == 12, "full match %d", m);
    CHECK(!memcmp(pm, pa, sizeof pa), "same pages");
    check_accounting("full match");
    drop(pm, m / S);

    /* page granularity: 11 tokens allowed -> 2 pages */
    m = match(a, 11, pm);
    CHECK(m == 8, "match capped to whole pages: %d", m);
    CHECK(pm[0] == pa[0] && pm[1] == pa[1], "prefix pages");
    drop(pm, m / S);
    m = match(a, 3, pm);
    CHECK(m == 0, "less than a page matches nothing: %d", m);

    /* partial: diverges inside the second page -> only the first page */
    int32_t b[12] = {1, 2, 3, 4, 5, 6, 99, 8, 9, 10, 11, 12};
    m = match(b, 12, pm);
    CHECK(m == 4, "partial match %d", m);
    CHECK(pm[0] == pa[0], "first page shared");
    check_accounting("partial match");
    drop(pm, 1);
    /* different first page */
    int32_t c[8] = {7, 7, 7, 7, 1, 2, 3, 4};
    CHECK(match(c, 8, pm) == 0, "no match");
    check_accounting("no match");
    teardown();
}

static void test_insert_shared_prefix(void) {
    setup();
    int32_t a[12] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
    int32_t b[14] = {1, 2, 3, 4, 5, 6, 7, 8, 20, 21, 22, 23, 24, 25};
    int32_t pa[3] = {0}, pb[4] = {0}, pm[4] = {0};
    compute(12, pa);
    radix_cache_insert(&rc, a, 12, pa);
    drop(pa, 3);
    /* b computed its own pages (say it started before a was cached): the tree keeps its own for
     * the shared 2 pages and takes b's third; b's partial 4th page is never cached */
    compute(14, pb);
    CHECK(radix_cache_insert(&rc, b, 14, pb) == 1, "only the new full page is added");
    CHECK(rc.n_pages == 4, "tree %d pages", rc.n_pages);
    CHECK(kv_cache_page_refs(&kv, pb[0]) == 1 && kv_cache_page_refs(&kv, pb[1]) == 1,
          "b's duplicate pages stay b's alone");
    CHECK(kv_cache_page_refs(&kv, pb[2]) == 2, "b's new page shared");
    check_accounting("insert shared");
    drop(pb, 4);
    check_accounting("b done");
    CHECK(kv.n_free == P - 4, "%d free", kv.n_free);
    int m = match(b, 13, pm);
    CHECK(m == 12, "b's 3 full pages match: %d", m);
    CHECK(pm[0] == pa[0] && pm[1] == pa[1] && pm[2] == pb[2], "the tree's pages");
    drop(pm, 3);
    m = match(a, 12, pm);
    CHECK(m == 12 && pm[2] == pa[2], "a still whole");
    drop(pm, 3);
    /* inserting the same thing again adds nothing */
    CHECK(radix_cache_insert(&rc, a, 12, pa) == 0, "re-insert adds nothing");
    check_accounting("re-insert");
    teardown();
}

static void test_refcounts_block_eviction(void) {
    setup();
    int32_t a[8] = {1, 2, 3, 4, 5, 6, 7, 8}, b[8] = {9, 9, 9, 9, 8, 8, 8, 8};
    int32_t pa[2] = {0}, pb[2] = {0}, pm[2] = {0};
    compute(8, pa);
    radix_cache_insert(&rc, a, 8, pa);
    drop(pa, 2);
    compute(8, pb);
    radix_cache_insert(&rc, b, 8, pb);
    drop(pb, 2);
    /* a running request holds a's pages */
    CHECK(match(a, 8, pm) == 8, "match a");
    int freed = radix_cache_evict(&rc, 100);
    CHECK(freed == 2, "only b's 2 pages are evictable: %d", freed);
    check_accounting("evict with a held");
    CHECK(rc.n_pages == 2, "a stays cached");
    /* a partially held: the request holds the first page only after a split */
    drop(pm, 2);
    CHECK(match(a, 7, pm) == 4, "match first page of a");
    freed = radix_cache_evict(&rc, 100);
    CHECK(freed == 1, "the unheld tail of a goes: %d", freed);
    CHECK(kv_cache_page_refs(&kv, pm[0]) == 2, "held page still cached");
    check_accounting("evict split");
    drop(pm, 1);
    CHECK(radix_cache_evict(&rc, 100) == 1, "now the last page");
    CHECK(rc.n_pages == 0 && rc.n_nodes == 0, "empty");
    CHECK(kv.n_free == P, "all free");
    check_accounting("evict all");
    teardown();
}

static void test_lru_order(void) {
    setup();
    int32_t seqs[4][4] = {{1, 1, 1, 1}, {2, 2, 2, 2}, {3, 3, 3, 3}, {4, 4, 4, 4}};
    int32_t pages[4][1] = {{0}}, pm[1] = {0};
    for (int i = 0; i < 4; i++) {
        compute(4, pages[i]);
        radix_cache_insert(&rc, seqs[i], 4, pages[i]);
        drop(pages[i], 1);
    }
    /* touch 0 and 2: the LRU order becomes 1, 3, 0, 2 */
    CHECK(match(seqs[0], 4, pm) == 4, "touch 0");
    drop(pm, 1);
    CHECK(match(seqs[2], 4, pm) == 4, "touch 2");
    drop(pm, 1);
    int order[4] = {1, 3, 0, 2};
    for (int k = 0; k < 4; k++) {
        CHECK(radix_cache_evict(&rc, 1) == 1, "evict one");
        check_accounting("lru step");
        for (int i = 0; i < 4; i++) {
            bool gone = false;
            for (int j = 0; j <= k; j++)
                gone |= order[j] == i;
            int m = match(seqs[i], 4, pm);
            if (m) drop(pm, 1);
            CHECK((m == 0) == gone, "after %d evictions sequence %d %s", k + 1, i,
                  gone ? "should be gone" : "should stay");
        }
        /* the matches above touched the survivors in index order; restore the intended order
         * by touching them again in the order they should leave */
        for (int j = k + 1; j < 4; j++) {
            int m = match(seqs[order[j]], 4, pm);
            if (m) drop(pm, 1);
        }
    }
    CHECK(radix_cache_evict(&rc, 1) == 0, "nothing left");
    teardown();
}

static void test_leaf_then_parent(void) {
    setup();
    /* a chain: parent page [1..4], children [5..8] and [9..12]; the parent is evicted only
     * after both children */
    int32_t a[8] = {1, 2, 3, 4, 5, 6, 7, 8}, b[8] = {1, 2, 3, 4, 9, 10, 11, 12};
    int32_t pa[2] = {0}, pb[2] = {0}, pm[2] = {0};
    compute(8, pa);
    radix_cache_insert(&rc, a, 8, pa);
    drop(pa, 2);
    compute(8, pb);
    radix_cache_insert(&rc, b, 8, pb);
    drop(pb, 2);
    CHECK(rc.n_pages == 3 && rc.n_nodes == 3, "3 nodes of 1 page: %d pages %d nodes", rc.n_pages,
          rc.n_nodes);
    CHECK(radix_cache_evict(&rc, 1) == 1, "one leaf");
    CHECK(match(a, 4, pm) == 4, "parent stays");
    drop(pm, 1);
    CHECK(radix_cache_evict(&rc, 2) == 2, "the other leaf, then the parent");
    CHECK(rc.n_pages == 0, "empty");
    check_accounting("chain");
    teardown();
}

static void test_flush(void) {
    setup();
    int32_t a[8] = {1, 2, 3, 4, 5, 6, 7, 8}, b[4] = {5, 5, 5, 5};
    int32_t pa[2] = {0}, pb[1] = {0}, pm[2] = {0};
    compute(8, pa);
    radix_cache_insert(&rc, a, 8, pa);
    drop(pa, 2);
    compute(4, pb);
    radix_cache_insert(&rc, b, 4, pb);
    drop(pb, 1);
    CHECK(match(a, 8, pm) == 8, "held by a running request");
    radix_cache_flush(&rc);
    CHECK(rc.n_pages == 0 && rc.n_nodes == 0, "flushed");
    CHECK(kv_cache_page_refs(&kv, pm[0]) == 1 && kv_cache_page_refs(&kv, pm[1]) == 1,
          "held pages stay valid");
    CHECK(kv.n_free == P - 2, "b's page freed, a's held: %d free", kv.n_free);
    check_accounting("flush");
    int32_t pm2[2];
    CHECK(match(a, 8, pm2) == 0, "nothing matches after a flush");
    drop(pm, 2);
    CHECK(kv.n_free == P, "all free once the request ends");
    check_accounting("after flush");
    teardown();
}

int main(void) {
    test_insert_match();
    test_insert_shared_prefix();
    test_refcounts_block_eviction();
    test_lru_order();
    test_leaf_then_parent();
    test_flush();
    CHECK_SUMMARY();
}
