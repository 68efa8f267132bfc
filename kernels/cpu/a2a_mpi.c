/* The mpi all-to-all transport: the shm protocol over one-sided MPI, for ranks that share no
 * memory (several nodes, or a launcher that maps none).
 *
 * Each rank exposes one MPI_Win_allocate window with the same layout as the shm segment
 * (a2a_internal.h). Synchronization is passive target: MPI_Win_lock_all once at create, then
 * per phase
 *   MPI_Put of the payload and the count line to each peer, MPI_Win_flush_all (the data is
 *   complete at every target), MPI_Accumulate(MPI_REPLACE) of the round value into each peer's
 *   flag, MPI_Win_flush_all; then poll this rank's own flags with MPI_Fetch_and_op(MPI_NO_OP)
 *   + MPI_Win_flush (atomic with the peers' accumulates, and it drives MPI's progress for
 *   components that need the target to call in), with the shared backoff and timeout; then
 *   MPI_Win_sync before the payload is read with plain loads.
 * Chosen over MPI_Win_fence (simpler, also correct) because a fence cannot time out or say which
 * rank is missing, and one flag per peer keeps the protocol identical to shm and nvlink.
 *
 * Dispatch stages the records per target in a local buffer [target][slot] and sends each
 * target's tokens with one MPI_Put (contiguous at the target: [my_rank][0..count)). Combine sends
 * only the slots the receiver owns with one MPI_Put per home rank, described by an indexed-block
 * datatype that has the same shape on both sides ([j][k] of D floats). */
#include "kernels/cpu/a2a_internal.h"

#include "common/log.h"

#include <stdlib.h>
#include <string.h>

typedef struct {
    MPI_Win win;
    char *base; /* this rank's window */
    bool locked;
    char *stage;               /* [ep][max_tokens] records, dispatch's send buffer */
    MPI_Datatype rec_type;     /* one record, rec_bytes */
    MPI_Datatype slot_type;    /* one slot's output, D floats */
    int *displs;               /* [max_tokens * K] combine scratch */
    a2a_count_line *count_out; /* [ep] count lines being sent */
    uint64_t *flag_in;         /* [ep] results of the flag polls */
    uint64_t flag_out;         /* the round value being sent */
} mpi_state;

static int mpi_check(a2a *a, int rc, const char *call, char *err, size_t errlen) {
    if (rc == MPI_SUCCESS) return 0;
    char msg[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(rc, msg, &len);
    return a2a_fail(a, err, errlen, "a2a mpi rank %d: %s failed in round %llu: %s", a->cfg.rank,
                    call, (unsigned long long)a->round, msg);
}

#define MPI_TRY(call)                                                                              \
    do {                                                                                           \
        if (mpi_check(a, (call), #call, err, errlen) != 0) return -1;                              \
    } while (0)

/* Store the round value v into flag line flag0 + me of every peer; the caller flushed the data. */
static int mpi_signal(a2a *a, size_t flag0, uint64_t v, char *err, size_t errlen) {
    mpi_state *s = a->impl;
    const int me = a->cfg.rank;
    s->flag_out = v;
    for (int p = 0; p < a->cfg.ep_size; p++)
        MPI_TRY(MPI_Accumulate(&s->flag_out, 1, MPI_UINT64_T, p,
                               (MPI_Aint)(flag0 + (size_t)me * A2A_LINE), 1, MPI_UINT64_T,
                               MPI_REPLACE, s->win));
    MPI_TRY(MPI_Win_flush_all(s->win));
    return 0;
}

/* Wait until this rank's flag[p] (line flag0 + p) equals v for every peer p. */
static int mpi_wait(a2a *a, size_t flag0, uint64_t v, const char *what, char *err, size_t errlen) {
    mpi_state *s = a->impl;
    const int ep = a->cfg.ep_size, me = a->cfg.rank;
    bool arrived[A2A_MAX_RANKS] = {false};
    int left = ep;
    a2a_backoff b;
    a2a_backoff_start(&b, &a->cfg);
    for (;;) {
        for (int p = 0; p < ep; p++)
            if (!arrived[p])
                MPI_TRY(MPI_Fetch_and_op(NULL, &s->flag_in[p], MPI_UINT64_T, me,
                                         (MPI_Aint)(flag0 + (size_t)p * A2A_LINE), MPI_NO_OP,
                                         s->win));
        MPI_TRY(MPI_Win_flush(me, s->win));
        for (int p = 0; p < ep; p++)
            if (!arrived[p] && s->flag_in[p] == v) {
                arrived[p] = true;
                left--;
            }
        if (left == 0) break;
        if (!a2a_backoff_pause(&b)) {
            if (b.gone[0])
                return a2a_fail(a, err, errlen, "a2a mpi rank %d: %s of round %llu: %s", me, what,
                                (unsigned long long)a->round, b.gone);
            char missing[128];
            a2a_format_missing(missing, sizeof missing, arrived, ep);
            return a2a_fail(a, err, errlen,
                            "a2a mpi rank %d: %s of round %llu: %s did not arrive within %.3g s; a "
                            "peer that died or skipped this step leaves the group unusable",
                            me, what, (unsigned long long)a->round, missing, a->cfg.timeout_s);
        }
    }
    /* The peers' puts completed before their flags; make them visible to plain loads here. */
    MPI_TRY(MPI_Win_sync(s->win));
    return 0;
}

static int mpi_dispatch(a2a *a, const float *x, const int32_t *topk_ids, const float *topk_w,
                        char *err, size_t errlen) {
    mpi_state *s = a->impl;
    const a2a_layout *L = &a->layout;
    const int ep = a->cfg.ep_size, me = a->cfg.rank, D = a->cfg.hidden, K = a->cfg.top_k;
    const size_t M = (size_t)a->cfg.max_tokens_per_rank, rm = (size_t)a->runtime_max;

    for (int t = 0; t < a->T; t++)
        for (int k = 0; k < K; k++) {
            size_t tk = (size_t)t * K + k;
            if (!a->slot_first[tk]) continue;
            int r = a->slot_rank[tk];
            if (r == me) continue; /* packed at compaction, see a2a_internal.h */
            char *rec = s->stage + ((size_t)r * M + a->slot_index[tk]) * L->rec_bytes;
            a2a_pack_record(a, rec, r, x + (size_t)t * D, topk_ids + (size_t)t * K,
                            topk_w + (size_t)t * K);
        }
    for (int r = 0; r < ep; r++) {
        s->count_out[r] = (a2a_count_line){a->send_count[r], a->runtime_max};
        MPI_TRY(MPI_Put(&s->count_out[r], (int)sizeof(a2a_count_line), MPI_BYTE, r,
                        (MPI_Aint)(L->line_count0 + (size_t)me * A2A_LINE),
                        (int)sizeof(a2a_count_line), MPI_BYTE, s->win));
        if (a->send_count[r] > 0 && r != me)
            MPI_TRY(MPI_Put(s->stage + (size_t)r * M * L->rec_bytes, a->send_count[r], s->rec_type,
                            r, (MPI_Aint)(L->recv_off + (size_t)me * rm * L->rec_bytes),
                            a->send_count[r], s->rec_type, s->win));
    }
    MPI_TRY(MPI_Win_flush_all(s->win));
    if (mpi_signal(a, L->line_dflag0, 2 * a->round + 1, err, errlen) != 0) return -1;
    if (mpi_wait(a, L->line_dflag0, 2 * a->round + 1, "dispatch", err, errlen) != 0) return -1;
    if (a2a_read_counts(a, s->base, err, errlen) != 0) return -1;
    a2a_compact_received(a, s->base, x, topk_ids, topk_w);
    return 0;
}

static int mpi_combine(a2a *a, const float *expert_out, float *out, char *err, size_t errlen) {
    mpi_state *s = a->impl;
    const a2a_layout *L = &a->layout;
    const int ep = a->cfg.ep_size, me = a->cfg.rank, D = a->cfg.hidden, K = a->cfg.top_k;
    const size_t rm = (size_t)a->runtime_max;

    for (int p = 0; p < ep; p++) {
        if (p == me) continue; /* gathered straight from expert_out */
        int n = 0;
        const int32_t *ids = a->recv_ids + (size_t)a->recv_begin[p] * K;
        for (int j = 0; j < a->recv_count[p]; j++)
            for (int k = 0; k < K; k++)
                if (ids[(size_t)j * K + k] >= 0) s->displs[n++] = j * K + k;
        if (n == 0) continue;
        MPI_Datatype owned;
        MPI_TRY(MPI_Type_create_indexed_block(n, 1, s->displs, s->slot_type, &owned));
        MPI_TRY(MPI_Type_commit(&owned));
        /* The same datatype on both sides: rows [begin_p + j] here, [me][j] at the home rank. */
        int rc = MPI_Put(expert_out + (size_t)a->recv_begin[p] * K * D, 1, owned, p,
                         (MPI_Aint)(L->comb_off + (size_t)me * rm * K * D * sizeof(float)), 1,
                         owned, s->win);
        MPI_Type_free(&owned); /* pending operations keep what they need */
        MPI_TRY(rc);
    }
    MPI_TRY(MPI_Win_flush_all(s->win));
    if (mpi_signal(a, L->line_cflag0, 2 * a->round + 2, err, errlen) != 0) return -1;
    if (mpi_wait(a, L->line_cflag0, 2 * a->round + 2, "combine", err, errlen) != 0) return -1;
    a2a_gather_out(a, s->base, expert_out, out);
    return 0;
}

static void mpi_destroy(a2a *a) {
    mpi_state *s = a->impl;
    if (!s) return;
    if (s->locked) MPI_Win_unlock_all(s->win);
    if (s->win != MPI_WIN_NULL) MPI_Win_free(&s->win);
    if (s->rec_type != MPI_DATATYPE_NULL) MPI_Type_free(&s->rec_type);
    if (s->slot_type != MPI_DATATYPE_NULL) MPI_Type_free(&s->slot_type);
    free(s->stage);
    free(s->displs);
    free(s->count_out);
    free(s->flag_in);
    free(s);
    a->impl = NULL;
}

static const a2a_transport_ops mpi_ops = {mpi_dispatch, mpi_combine, mpi_destroy};

int a2a_mpi_init(a2a *a, char *err, size_t errlen) {
    const int ep = a->cfg.ep_size, me = a->cfg.rank;
    const size_t M = (size_t)a->cfg.max_tokens_per_rank, K = (size_t)a->cfg.top_k;
    mpi_state *s = xcalloc(1, sizeof *s);
    s->win = MPI_WIN_NULL;
    s->rec_type = MPI_DATATYPE_NULL;
    s->slot_type = MPI_DATATYPE_NULL;
    s->stage = xmalloc((size_t)ep * M * a->layout.rec_bytes);
    s->displs = xmalloc(M * K * sizeof(int));
    s->count_out = xcalloc((size_t)ep, sizeof(a2a_count_line));
    s->flag_in = xcalloc((size_t)ep, sizeof(uint64_t));
    a->impl = s;
    a->ops = &mpi_ops;

    MPI_Type_contiguous((int)a->layout.rec_bytes, MPI_BYTE, &s->rec_type);
    MPI_Type_commit(&s->rec_type);
    MPI_Type_contiguous(a->cfg.hidden, MPI_FLOAT, &s->slot_type);
    MPI_Type_commit(&s->slot_type);

    MPI_Info info;
    MPI_Info_create(&info);
    MPI_Info_set(info, "accumulate_ops", "same_op_no_op");
    MPI_Info_set(info, "same_size", "true");
    MPI_Info_set(info, "same_disp_unit", "true");
    int rc = MPI_Win_allocate((MPI_Aint)a->layout.seg_bytes, 1, info, a->comm, &s->base, &s->win);
    MPI_Info_free(&info);
    if (rc != MPI_SUCCESS) {
        s->win = MPI_WIN_NULL;
        char msg[MPI_MAX_ERROR_STRING];
        int len = 0;
        MPI_Error_string(rc, msg, &len);
        return set_err(err, errlen, "a2a mpi rank %d: MPI_Win_allocate of %zu bytes failed: %s", me,
                       a->layout.seg_bytes, msg);
    }
    MPI_Win_set_errhandler(s->win, MPI_ERRORS_RETURN);
    /* Zero the header (flags and count lines) before any peer can write into it; the payload
     * regions are written before they are read in every round. */
    MPI_Win_lock_all(MPI_MODE_NOCHECK, s->win);
    s->locked = true;
    memset(s->base, 0, a->layout.recv_off);
    MPI_Win_sync(s->win);
    rc = MPI_Barrier(a->comm);
    MPI_Win_sync(s->win);
    if (rc != MPI_SUCCESS) return set_err(err, errlen, "a2a mpi rank %d: MPI_Barrier failed", me);
    return 0;
}
