/* What kernels/cuda/a2a_nvlink.cu (the object, the kernels, the one-sided transport) shares with
 * kernels/cuda/a2a_nccl.cu (the two-sided baseline): the object, the device state, the kernel
 * arguments and the launchers. CUDA C++ only.
 *
 * Segment of one rank (one-sided; offsets in bytes, each peer maps every segment):
 *   count line [src]            {flag, count, runtime_max}, one A2A_GPU_LINE each; src writes it
 *                               in its route kernel, flag = 2N+1 last (release)
 *   dispatch chunk flags [src][A2A_GPU_NCHUNK]  2N+1 once rows [c ch, (c+1) ch) of src are here
 *   combine chunk flags [src][A2A_GPU_NCHUNK]   2N+2 once src's returns for those rows are here
 *   combine end flag [src]      2N+2 once src is done with round N (its sends and its reads);
 *                               the route kernel of N+1 waits for it before writing into src, so
 *                               the next round cannot overtake a slow reader
 *   recv region [src][runtime_max] x record      (record: codes | scales | ids[K] | w[K])
 *   comb region [src][runtime_max] x (K D fp32 slots, or D BF16 partial sums)
 * The segment is shared by CUDA IPC, or by cuMem POSIX-descriptor or fabric handles
 * (a2a_segment.cu, MOESERVE_A2A_MEM).
 * A chunk is ch = ceil(runtime_max / A2A_GPU_NCHUNK) rows of one source (fewer chunks with
 * MOESERVE_A2A_CHUNKS, a tuning knob that every rank must set alike), so the receiver decodes
 * (and the home rank gathers) a chunk as soon as it lands, while the rest is still on the wire. */
#ifndef MOESERVE_A2A_CUDA_INTERNAL_H
#define MOESERVE_A2A_CUDA_INTERNAL_H

#include "kernels/cuda/a2a_cuda.h"

#include <cuda_runtime.h>
#include <pthread.h>

#define A2A_GPU_LINE          128
#define A2A_GPU_NCHUNK        256
#define A2A_GPU_THREADS       256
#define A2A_GPU_ROUTE_THREADS 1024
#define A2A_GPU_KMAX          32
/* one-sided rounds of runtime_max <= A2A_FUSED_T over <= 8 ranks: every dispatch block routes
 * the round itself, no route kernel before it (kp.fused) */
#define A2A_FUSED_T 256

/* error codes of a2a_gpu_err.code */
enum {
    A2A_GPU_E_NONE,
    A2A_GPU_E_TIMEOUT,
    A2A_GPU_E_RUNTIME_MAX,
    A2A_GPU_E_COUNT,
    A2A_GPU_E_EXPERT,
    A2A_GPU_E_PEER_GONE /* a wait left on the host watch's word (cfg.check_peers named a peer) */
};
/* which wait timed out (a2a_gpu_err.where) */
enum { A2A_GPU_W_DISPATCH, A2A_GPU_W_DISPATCH_DATA, A2A_GPU_W_COMBINE_DATA, A2A_GPU_W_COMBINE_END };
/* roles of one kernel launch (one-sided: all of them in one launch) */
enum {
    A2A_GPU_SEND = 1,   /* this rank's rows to the other ranks */
    A2A_GPU_SELF = 2,   /* this rank's rows to itself */
    A2A_GPU_RECV = 4,   /* dispatch: decode what arrived; combine: gather the returns (home) */
    A2A_GPU_FINISH = 8, /* combine: the end barrier and the round's advance */
};

/* points of the optional timeline (a2a_gpu_trace) */
enum {
    A2A_TR_ROUTE,            /* route kernel starts */
    A2A_TR_ROUTE_SCANNED,    /* rows handed out */
    A2A_TR_ROUTE_END,        /* count line to rank 0 written (after its end flag) */
    A2A_TR_DISPATCH,         /* dispatch kernel, block 0 past the PDL wait */
    A2A_TR_DISPATCH_SENT,    /* block 0 done with its SEND / SELF items */
    A2A_TR_DISPATCH_COUNTS,  /* last block has every count line */
    A2A_TR_DISPATCH_END,     /* last block done with its RECV items */
    A2A_TR_COMBINE,          /* combine kernel, block 0 */
    A2A_TR_COMBINE_SENT,     /* block 0 done with its SEND / SELF items */
    A2A_TR_COMBINE_GATHERED, /* last block done with its gathers */
    A2A_TR_COMBINE_END,      /* the last block to arrive has written the end flags */
    A2A_TR_N
};

/* The first error of the object, written by a kernel into mapped host memory; peer_gone is
 * the other way round: the host's watch thread sets it, and a wait that has gone on for a
 * millisecond reads it now and then. */
typedef struct {
    int code, peer, where, a, b, c;
    unsigned long long round;
    int peer_gone;
} a2a_gpu_err;

/* Device memory of this rank only. */
typedef struct {
    unsigned long long round;     /* completed rounds: dispatch N publishes 2N+1, combine 2N+2 */
    unsigned int arrive;          /* blocks of the running combine past their items */
    int err;                      /* != 0 once a kernel recorded an error: every kernel returns */
    int n;                        /* rows received this round */
    int count[A2A_MAX_RANKS];     /* rows from each source */
    int begin[A2A_MAX_RANKS + 1]; /* first row of each source */
    int send[A2A_MAX_RANKS];      /* tokens sent to each rank */
} a2a_gpu_state;

/* A source's count line in the receiver's header (one-sided) or in the exchanged array (nccl). */
typedef struct {
    unsigned long long flag;
    int count;
    int runtime_max;
} a2a_gpu_count_line;

/* Everything a kernel needs, passed by value. */
typedef struct {
    int ep, me, D, K, E, M, T, rm, ch, nch, payload, roles, one_sided, fused;
    int rec, off_sc, off_s2, off_ids, off_w; /* record sections, bytes */
    unsigned long long timeout_ns;
    a2a_gpu_state *st;
    a2a_gpu_err *herr;     /* mapped host memory */
    const int32_t *owner;  /* [E] owner rank of each expert */
    int eper;              /* E / ep where rank r owns [r eper, (r + 1) eper), else 0 */
    const int32_t *ebegin; /* [ep + 1] */
    int32_t *slot_rank;    /* [M, K] owner rank of slot k of token t */
    int32_t *slot_index;   /* [M, K] the token's row at that rank's [me] region */
    int32_t *inv;          /* [ep, M] token of row j sent to rank r */
    float *rx;             /* [ep M, D] received, decoded */
    int32_t *rids;         /* [ep M, K] */
    float *rw;             /* [ep M, K] */
    /* one-sided: every rank's segment; nccl: NULL */
    char *const *peer;
    size_t off_count, off_dchunk, off_cchunk, off_cdone, off_recv, off_comb;
    /* where this rank's records and returns are staged (nccl) */
    char *send_buf;  /* [ep][rm] records */
    char *csend_buf; /* [ep][rm] returns */
    char *recv_base; /* [ep][rm] records that arrived */
    char *comb_base; /* [ep][rm] returns that arrived */
    char *cnt_base;  /* count lines, cnt_stride bytes apart */
    int cnt_stride;
    a2a_gpu_count_line *cnt_out; /* nccl: [ep] this rank's lines, sent by NCCL */
    int partial;                 /* combine form */
    unsigned long long *trace;   /* [A2A_TR_N] or NULL */
    const float *x, *w;
    const int32_t *ids;
    const float *eo; /* expert_out [n, K, D] */
    float *out;
} a2a_kp;

typedef enum { A2A_GPU_IDLE, A2A_GPU_DISPATCHED, A2A_GPU_BROKEN } a2a_gpu_phase;

/* How the one-sided segment is shared (a2a_segment.cu): CUDA IPC, cuMem with POSIX descriptors,
 * cuMem with fabric handles. */
enum { A2A_SEG_IPC, A2A_SEG_POSIX_FD, A2A_SEG_FABRIC };

struct a2a_gpu {
    a2a_config cfg;
    MPI_Comm comm;
    int device, n_sm, cap_dispatch, cap_combine;
    int nchunks; /* chunks per source (A2A_GPU_NCHUNK, or MOESERVE_A2A_CHUNKS) */
    bool pdl;
    bool fuse; /* small one-sided rounds routed inside the dispatch kernel (MOESERVE_A2A_FUSE=0:
                  the route kernel at every size) */
    a2a_gpu_phase phase;
    char broken_why[480];
    int T, runtime_max;
    cudaStream_t stream; /* of the last call */

    /* record layout */
    int rec, off_sc, off_s2, off_ids, off_w;
    /* one-sided workspace */
    size_t off_count, off_dchunk, off_cchunk, off_cdone, off_recv, off_comb, seg_bytes;
    char *seg;      /* this rank's segment */
    int seg_kind;   /* A2A_SEG_*: how it is shared */
    size_t seg_map; /* cuMem ways: bytes mapped (seg_bytes rounded to the granularity) */
    unsigned long long *seg_handles; /* cuMem ways: [ep] allocation handles (own and imported) */
    char **peer_host;                /* [ep] mapped segments (peer_host[me] = seg) */
    char **peer_dev;                 /* the same table in device memory */

    a2a_gpu_state *st;
    a2a_gpu_err *herr, *herr_dev; /* mapped host memory, and its device address */
    int32_t *owner, *ebegin, *slot_rank, *slot_index, *inv, *rids;
    int eper; /* experts per rank where the split is even and in order (owner = id / eper) */
    float *rx, *rw;

    /* The watch thread (cfg.check_peers given, ep_size > 1): asks it every 100 ms; on an answer
     * naming a gone peer it keeps the message in watch_why and sets herr->peer_gone. */
    pthread_t watch;
    bool watching;
    pthread_mutex_t watch_mu;
    pthread_cond_t watch_cv;
    bool watch_stop;
    char watch_why[256];

    unsigned long long *trace; /* device [A2A_TR_N], MOESERVE_A2A_TRACE=1 only */
    void *nccl;                /* a2a_nccl.cu's state */
};

/* a2a_nvlink.cu */
/* kp for this round (sizes, pointers, inputs); the caller sets roles and partial. */
void a2a_gpu_params(const a2a_gpu *a, a2a_kp *kp, const float *x, const int32_t *ids,
                    const float *w, const float *eo, float *out);
/* Launch the route kernel / a dispatch / a combine kernel with kp's roles on stream s. 0 or -1. */
int a2a_gpu_launch_route(a2a_gpu *a, const a2a_kp *kp, cudaStream_t s, char *err, size_t errlen);
int a2a_gpu_launch_dispatch(a2a_gpu *a, const a2a_kp *kp, cudaStream_t s, char *err, size_t errlen);
int a2a_gpu_launch_combine(a2a_gpu *a, const a2a_kp *kp, cudaStream_t s, char *err, size_t errlen);
/* Bytes of one return (a combine row) in the given form. */
size_t a2a_gpu_return_bytes(const a2a_gpu *a, int partial);
int a2a_gpu_cuda_fail(char *err, size_t errlen, int rank, const char *what, cudaError_t e);
/* The message into err (printf format); returns -1. */
int a2a_gpu_errf(char *err, size_t errlen, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Every rank's ok true? A collective, so that the ranks go on, or fail, together. */
bool a2a_gpu_agree(MPI_Comm comm, bool ok);

/* a2a_segment.cu: allocate this rank's segment of seg_bytes and map every peer's into
 * peer_host (collective; MOESERVE_A2A_MEM picks the way), and undo it. */
int a2a_segment_setup(a2a_gpu *a, char *err, size_t errlen);
void a2a_segment_free(a2a_gpu *a);
const char *a2a_seg_kind_name(int kind);

/* a2a_nccl.cu */
int a2a_nccl_init(a2a_gpu *a, char *err, size_t errlen);
void a2a_nccl_free(a2a_gpu *a);
int a2a_nccl_dispatch(a2a_gpu *a, a2a_kp *kp, cudaStream_t s, char *err, size_t errlen);
int a2a_nccl_combine(a2a_gpu *a, a2a_kp *kp, cudaStream_t s, char *err, size_t errlen);

#endif
