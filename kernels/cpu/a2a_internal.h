/* What kernels/a2a.c shares with the CPU transports (a2a_shm.c, a2a_mpi.c): the a2a struct, the
 * workspace layout both transports use, the routing records, the record packing, the compaction
 * of what was received, the gather of the combine region, and the backed-off wait.
 *
 * Workspace: one segment per rank, the same layout for shm (MPI_Win_allocate_shared) and mpi
 * (MPI_Win_allocate). All offsets in bytes from the segment base:
 *
 *   line 0                      round value this rank last published (diagnostics)
 *   line 1 + p                  dispatch_flag[p]: round value written by peer p (2N+1)
 *   line 1 + ep + p             combine_flag[p]:  round value written by peer p (2N+2)
 *   line 1 + 2 ep + p           count line from peer p: {tokens sent to me, its runtime_max}
 *   recv_off                    receive region [src][runtime_max] x record
 *                                 record = payload (a2a_payload_bytes, padded to 4 bytes: the
 *                                 fp32 x[D] by default) | ids[K] int32 (local, -1) | w[K] floats
 *   comb_off                    combine region [receiver][runtime_max][K][D] floats
 *
 * Each line is A2A_LINE bytes, so no two writers share a cache line (128 covers the adjacent-line
 * prefetcher on x86 and the 128-byte lines of some ARM parts). Regions are sized by
 * max_tokens_per_rank and indexed with runtime_max, as the GPU transport will be.
 *
 * A rank's traffic to itself skips its own segment (one copy less each way for that share, half
 * of all traffic at two ranks): dispatch packs its own tokens straight into the received arrays,
 * combine copies their slots straight from expert_out to out. Count lines and flags still go
 * to itself, so the waits treat every rank alike. */
#ifndef MOESERVE_A2A_INTERNAL_H
#define MOESERVE_A2A_INTERNAL_H

#include "kernels/a2a.h"

#include <stdint.h>

#define A2A_LINE 128

typedef enum {
    A2A_PHASE_IDLE,       /* ready for dispatch */
    A2A_PHASE_DISPATCHED, /* dispatch done, combine expected */
    A2A_PHASE_BROKEN,     /* a wait failed: peers may still write into the workspace */
} a2a_phase;

typedef struct {
    size_t line_round;  /* offsets of the header lines, see the file comment */
    size_t line_dflag0; /* dispatch_flag[0]; flag p at + p * A2A_LINE */
    size_t line_cflag0; /* combine_flag[0] */
    size_t line_count0; /* count line of peer 0 */
    size_t pay_bytes;   /* the payload part of a record, padded to 4 bytes */
    size_t rec_bytes;   /* one record: pay_bytes + 2K * 4 */
    size_t recv_off;    /* receive region */
    size_t comb_off;    /* combine region */
    size_t seg_bytes;   /* whole segment, a multiple of 4096 */
} a2a_layout;

/* The count line a peer writes into my header before its dispatch flag. */
typedef struct {
    int32_t count;       /* tokens it sent me this round */
    int32_t runtime_max; /* its runtime_max: must equal mine */
} a2a_count_line;

struct a2a_transport_ops;

struct a2a {
    a2a_config cfg;
    MPI_Comm comm; /* a duplicate of the caller's communicator, errors returned */
    a2a_layout layout;
    int32_t *owner; /* [E] rank owning each global expert */
    a2a_phase phase;
    uint64_t round; /* completed rounds; dispatch of round N publishes 2N+1, combine 2N+2 */
    char broken_why[256];

    /* This round, set by dispatch. */
    int T;
    int runtime_max;
    /* Routing records for combine, [T, K] each: slot k of token t went to rank slot_rank at
     * slot slot_index of that rank's [me] region; slot_first marks the slot that carried the
     * token (the first slot per target rank: a token travels once per rank). */
    int32_t *slot_rank;
    int32_t *slot_index;
    uint8_t *slot_first;
    int32_t *send_count; /* [ep] tokens sent to each rank */

    /* What this rank received, compacted: ordered by source rank, then by source slot. */
    int32_t *recv_count; /* [ep] */
    int32_t *recv_begin; /* [ep + 1] prefix sums of recv_count */
    float *recv_x;       /* [ep * max_tokens, D] */
    int32_t *recv_ids;   /* [ep * max_tokens, K] local expert ids or -1 */
    float *recv_w;       /* [ep * max_tokens, K] */
    float *partial_slots; /* [max_tokens, K, D] and [D]: the slots a2a_combine_partial sums
                             and its scratch (made on its first call) */

    const struct a2a_transport_ops *ops;
    void *impl; /* the transport's own state */
};

/* A transport: dispatch moves the records (a->slot_* are filled), waits for every peer and fills
 * a->recv_*; combine moves expert_out home, waits and fills out. Both return 0 or -1 with err;
 * a failed wait must leave a->phase = A2A_PHASE_BROKEN (a2a_fail does it). */
typedef struct a2a_transport_ops {
    int (*dispatch)(a2a *a, const float *x, const int32_t *topk_ids, const float *topk_w, char *err,
                    size_t errlen);
    int (*combine)(a2a *a, const float *expert_out, float *out, char *err, size_t errlen);
    void (*destroy)(a2a *a);
} a2a_transport_ops;

/* Transport set-up, collective over a->comm; a->cfg, a->layout and the host arrays are ready.
 * 0, or -1 with err (every rank of the group fails together where the cause is shared). */
int a2a_shm_init(a2a *a, char *err, size_t errlen);
int a2a_mpi_init(a2a *a, char *err, size_t errlen);

/* Record helpers, one token: payload (x in the config's format) | ids[K] (local to target, -1
 * where target does not own the slot) | w[K]. */
void a2a_pack_record(const a2a *a, void *rec, int target, const float *x_t /* [D] */,
                     const int32_t *ids_t /* [K] */, const float *w_t /* [K] */);

/* recv region [src][runtime_max] of this rank's segment -> a->recv_* (counts in a->recv_count).
 * This rank's own tokens never enter its segment: they are packed here from the inputs. */
void a2a_compact_received(a2a *a, const char *segment, const float *x /* [T, D] */,
                          const int32_t *topk_ids /* [T, K] */, const float *topk_w /* [T, K] */);

/* Combine region of this rank's segment -> out[T, K, D] by the routing records; the slots this
 * rank computed itself come straight from expert_out[n, K, D]. */
void a2a_gather_out(const a2a *a, const char *segment, const float *expert_out, float *out);

/* Every count line of this rank's segment: counts into a->recv_count, and a check that each peer
 * used this round's runtime_max. 0, or -1 with err (and the a2a is broken). */
int a2a_read_counts(a2a *a, const char *segment, char *err, size_t errlen);

/* Mark the a2a unusable (a peer may still write into the workspace) and format err. */
int a2a_fail(a2a *a, char *err, size_t errlen, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* The wait shared by the transports: spin briefly, then sched_yield, then sleep with a growing
 * interval (capped at 1 ms), so oversubscribed ranks do not starve the rank they wait for. */
typedef struct {
    double start;      /* monotonic seconds */
    double deadline;   /* start + timeout */
    double next_check; /* next call of the config's check_peers */
    long polls;
    const a2a_config *cfg;
    char gone[192]; /* set when check_peers reported a peer gone */
} a2a_backoff;

double a2a_now(void);
void a2a_backoff_start(a2a_backoff *b, const a2a_config *cfg);
/* Pause once; returns false when the deadline has passed or a peer is gone (b->gone says which,
 * else it is empty). */
bool a2a_backoff_pause(a2a_backoff *b);

/* "rank 2" / "ranks 1, 3" ... for the peers whose arrived[p] is false (at most a few named). */
void a2a_format_missing(char *buf, size_t len, const bool *arrived, int ep);

#endif
