/* The shm all-to-all transport: CPU ranks on one node, the CPU twin of nvlink_one_sided.
 *
 * Every rank allocates its segment with MPI_Win_allocate_shared (layout in a2a_internal.h) and
 * maps every peer's with MPI_Win_shared_query; from then on MPI is out of the data path: ranks
 * store straight into each other's memory and synchronize with C11 atomics.
 *
 * Dispatch (push): for each local token and each rank owning one of its experts, the record
 * (x, ids local to that rank, weights) is written into that rank's receive region at
 * [my_rank][slot] (offsets from runtime_max); then the count line, then, with a release store,
 * the round value into each peer's dispatch_flag[me]. Each rank waits with acquire loads until
 * its dispatch flags from every peer hold the round value, checks the count lines and compacts
 * what it received.
 *
 * Combine (push, like dispatch): the receiver writes each received token's outputs, only the
 * slots it owns, into the home rank's combine region at [receiver][slot], then release-stores
 * combine_flag[me] in the home rank; the home rank waits for all its combine flags and gathers
 * out[t, k, :] from the region of the rank owning slot k. Push rather than pull because then both
 * phases are the same pattern (remote stores, local reads, one flag per peer): on NVLink remote
 * stores are posted while remote loads stall a round trip, and a push needs no second signal
 * saying "I have finished reading your region".
 *
 * Why the regions are safe to reuse without more flags: a rank writes into a peer's receive
 * region for round N+1 only after its combine N completed, which needs that peer's combine flag
 * N, which the peer stores after it compacted its round-N receive region; the same chain (via
 * dispatch N+1) protects the combine region. Round values never repeat (2N+1, 2N+2), so a flag
 * equal to the expected value can only come from this round. */
#include "kernels/cpu/a2a_internal.h"

#include "common/log.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    MPI_Win win;
    char **peer; /* [ep] every rank's segment, mapped into this process */
    bool locked;
} shm_state;

static _Atomic uint64_t *shm_line(char *segment, size_t off) {
    return (_Atomic uint64_t *)(void *)(segment + off);
}

/* Wait until flag[p] of this rank's segment (line flag0 + p) equals v for every peer p. */
static int shm_wait(a2a *a, size_t flag0, uint64_t v, const char *what, char *err, size_t errlen) {
    shm_state *s = a->impl;
    const int ep = a->cfg.ep_size, me = a->cfg.rank;
    bool arrived[A2A_MAX_RANKS] = {false};
    int left = ep;
    a2a_backoff b;
    a2a_backoff_start(&b, &a->cfg);
    for (;;) {
        for (int p = 0; p < ep; p++) {
            if (arrived[p]) continue;
            _Atomic uint64_t *f = shm_line(s->peer[me], flag0 + (size_t)p * A2A_LINE);
            if (atomic_load_explicit(f, memory_order_acquire) == v) {
                arrived[p] = true;
                left--;
            }
        }
        if (left == 0) return 0;
        if (!a2a_backoff_pause(&b)) break;
    }
    if (b.gone[0])
        return a2a_fail(a, err, errlen, "a2a shm rank %d: %s of round %llu: %s", me, what,
                        (unsigned long long)a->round, b.gone);
    int first = 0;
    while (arrived[first])
        first++;
    uint64_t seen =
        atomic_load_explicit(shm_line(s->peer[first], a->layout.line_round), memory_order_relaxed);
    char missing[128];
    a2a_format_missing(missing, sizeof missing, arrived, ep);
    return a2a_fail(a, err, errlen,
                    "a2a shm rank %d: %s of round %llu: %s did not arrive within %.3g s (rank %d "
                    "last published round value %llu, expected %llu); a peer that died or skipped "
                    "this step leaves the group unusable",
                    me, what, (unsigned long long)a->round, missing, a->cfg.timeout_s, first,
                    (unsigned long long)seen, (unsigned long long)v);
}

static int shm_dispatch(a2a *a, const float *x, const int32_t *topk_ids, const float *topk_w,
                        char *err, size_t errlen) {
    shm_state *s = a->impl;
    const a2a_layout *L = &a->layout;
    const int ep = a->cfg.ep_size, me = a->cfg.rank, D = a->cfg.hidden, K = a->cfg.top_k;
    const size_t rm = (size_t)a->runtime_max;

    for (int t = 0; t < a->T; t++)
        for (int k = 0; k < K; k++) {
            size_t tk = (size_t)t * K + k;
            if (!a->slot_first[tk]) continue;
            int r = a->slot_rank[tk];
            if (r == me) continue; /* packed at compaction, see a2a_internal.h */
            char *rec =
                s->peer[r] + L->recv_off + ((size_t)me * rm + a->slot_index[tk]) * L->rec_bytes;
            a2a_pack_record(a, rec, r, x + (size_t)t * D, topk_ids + (size_t)t * K,
                            topk_w + (size_t)t * K);
        }
    const uint64_t v = 2 * a->round + 1;
    for (int r = 0; r < ep; r++) {
        a2a_count_line c = {a->send_count[r], a->runtime_max};
        memcpy(s->peer[r] + L->line_count0 + (size_t)me * A2A_LINE, &c, sizeof c);
    }
    /* Release: every record and count line above is visible to a peer that sees the flag. */
    for (int r = 0; r < ep; r++)
        atomic_store_explicit(shm_line(s->peer[r], L->line_dflag0 + (size_t)me * A2A_LINE), v,
                              memory_order_release);
    atomic_store_explicit(shm_line(s->peer[me], L->line_round), v, memory_order_relaxed);

    if (shm_wait(a, L->line_dflag0, v, "dispatch", err, errlen) != 0) return -1;
    if (a2a_read_counts(a, s->peer[me], err, errlen) != 0) return -1;
    a2a_compact_received(a, s->peer[me], x, topk_ids, topk_w);
    return 0;
}

static int shm_combine(a2a *a, const float *expert_out, float *out, char *err, size_t errlen) {
    shm_state *s = a->impl;
    const a2a_layout *L = &a->layout;
    const int ep = a->cfg.ep_size, me = a->cfg.rank, D = a->cfg.hidden, K = a->cfg.top_k;
    const size_t rm = (size_t)a->runtime_max;

    for (int p = 0; p < ep; p++) {
        if (p == me) continue; /* gathered straight from expert_out */
        float *dst = (float *)(s->peer[p] + L->comb_off) + (size_t)me * rm * K * D;
        for (int j = 0; j < a->recv_count[p]; j++) {
            size_t i = (size_t)a->recv_begin[p] + (size_t)j;
            for (int k = 0; k < K; k++)
                if (a->recv_ids[i * K + k] >= 0)
                    memcpy(dst + ((size_t)j * K + k) * D, expert_out + (i * K + k) * D,
                           (size_t)D * sizeof(float));
        }
    }
    const uint64_t v = 2 * a->round + 2;
    for (int p = 0; p < ep; p++)
        atomic_store_explicit(shm_line(s->peer[p], L->line_cflag0 + (size_t)me * A2A_LINE), v,
                              memory_order_release);
    atomic_store_explicit(shm_line(s->peer[me], L->line_round), v, memory_order_relaxed);

    if (shm_wait(a, L->line_cflag0, v, "combine", err, errlen) != 0) return -1;
    a2a_gather_out(a, s->peer[me], expert_out, out);
    return 0;
}

static void shm_destroy(a2a *a) {
    shm_state *s = a->impl;
    if (!s) return;
    if (s->locked) MPI_Win_unlock_all(s->win);
    if (s->win != MPI_WIN_NULL) MPI_Win_free(&s->win);
    free(s->peer);
    free(s);
    a->impl = NULL;
}

static const a2a_transport_ops shm_ops = {shm_dispatch, shm_combine, shm_destroy};

static int mpi_fail(char *err, size_t errlen, int rank, const char *call, int rc) {
    char msg[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(rc, msg, &len);
    return set_err(err, errlen, "a2a shm rank %d: %s failed: %s", rank, call, msg);
}

int a2a_shm_init(a2a *a, char *err, size_t errlen) {
    const int ep = a->cfg.ep_size, me = a->cfg.rank;
    MPI_Comm node;
    int rc = MPI_Comm_split_type(a->comm, MPI_COMM_TYPE_SHARED, me, MPI_INFO_NULL, &node);
    if (rc != MPI_SUCCESS) return mpi_fail(err, errlen, me, "MPI_Comm_split_type", rc);
    int node_size = 0;
    MPI_Comm_size(node, &node_size);
    MPI_Comm_free(&node);
    if (node_size != ep)
        return set_err(
            err, errlen,
            "a2a shm rank %d: only %d of the %d ranks share memory with this rank; shm needs every "
            "rank of the group on one node (use the mpi transport, --moe-a2a-backend mpi)",
            me, node_size, ep);

    shm_state *s = xcalloc(1, sizeof *s);
    s->win = MPI_WIN_NULL;
    s->peer = xcalloc((size_t)ep, sizeof(char *));
    a->impl = s;
    a->ops = &shm_ops;

    /* Non-contiguous: each segment starts page-aligned and is first touched by its owner. */
    MPI_Info info;
    MPI_Info_create(&info);
    MPI_Info_set(info, "alloc_shared_noncontig", "true");
    char *base = NULL;
    rc = MPI_Win_allocate_shared((MPI_Aint)a->layout.seg_bytes, 1, info, a->comm, &base, &s->win);
    MPI_Info_free(&info);
    if (rc != MPI_SUCCESS) {
        s->win = MPI_WIN_NULL;
        return mpi_fail(err, errlen, me, "MPI_Win_allocate_shared", rc);
    }
    MPI_Win_set_errhandler(s->win, MPI_ERRORS_RETURN);
    for (int p = 0; p < ep; p++) {
        MPI_Aint size = 0;
        int disp_unit = 0;
        void *pb = NULL;
        rc = MPI_Win_shared_query(s->win, p, &size, &disp_unit, &pb);
        if (rc != MPI_SUCCESS) return mpi_fail(err, errlen, me, "MPI_Win_shared_query", rc);
        if (!pb || (size_t)size < a->layout.seg_bytes)
            return set_err(err, errlen,
                           "a2a shm rank %d: rank %d's segment is not mapped here (%zu bytes); use "
                           "the mpi transport",
                           me, p, (size_t)size);
        s->peer[p] = pb;
    }
    /* A passive epoch over the window's whole life makes the direct loads and stores legal in
     * MPI's model; the header is zeroed before any peer may write a flag into it. Payload pages
     * are left untouched until a round writes them. */
    MPI_Win_lock_all(MPI_MODE_NOCHECK, s->win);
    s->locked = true;
    memset(base, 0, a->layout.recv_off);
    MPI_Win_sync(s->win);
    rc = MPI_Barrier(a->comm);
    MPI_Win_sync(s->win);
    if (rc != MPI_SUCCESS) return mpi_fail(err, errlen, me, "MPI_Barrier", rc);
    return 0;
}
