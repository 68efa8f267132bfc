/* MoE all-to-all on the GPU: the device twin of kernels/a2a.h. One object per rank, created with
 * the same a2a_config (transport A2A_NVLINK_ONE_SIDED or A2A_NCCL); every pointer argument is
 * device memory, every call is queued on the caller's stream (a cudaStream_t passed as void *,
 * NULL for the legacy default stream). C API, callable from gcc-compiled C.
 *
 * Transports:
 *   nvlink_one_sided  every rank cudaMalloc's one symmetric segment; CUDA IPC handles
 *                     (cudaIpcGetMemHandle) go round with MPI_Allgather and every rank maps every
 *                     peer's segment. Kernels store straight into the peer's memory and signal
 *                     with st.release.sys / ld.acquire.sys flags. No host sync and no host-visible
 *                     count inside a round: counts and round values live in device memory, so a
 *                     dispatch + combine pair can be captured in a CUDA graph and replayed (each
 *                     replay is a new round). The segment can be shared three ways
 *                     (MOESERVE_A2A_MEM, the same on every rank): ipc (CUDA IPC, one node),
 *                     posix_fd (cuMem with POSIX descriptors passed over Unix sockets, one
 *                     node) and fabric (cuMem fabric handles over MPI: multi-node NVLink such
 *                     as GB200 NVL72); auto, the default, takes fabric where every device
 *                     reports it and it works, ipc otherwise (kernels/cuda/a2a_segment.cu).
 *   nccl              the two-sided baseline: counts exchanged with ncclSend/ncclRecv, read by
 *                     the host (a stream sync inside dispatch), then grouped ncclSend/ncclRecv of
 *                     the exact records, and back for combine. Not capturable; no device-side
 *                     timeout (a missing rank hangs NCCL).
 *
 * Contract of a round, as kernels/a2a.h: every rank calls dispatch then combine, in the same
 * order, even with T = 0; runtime_max (host) is identical on every rank and >= every T. The
 * identical-runtime_max rule is checked on the device: each rank's count line carries its
 * runtime_max and a receiver that sees another value flags an error (and leaves the round).
 *
 * Results equal the CPU transports' bit for bit for every payload: the payload's encoding and
 * decoding are kernels/quant.h's element conversions in a2a_payload_roundtrip's order, the
 * received tokens are ordered by source rank then by the source's order, and combine's slots form
 * copies each slot's fp32 output unchanged.
 *
 * Errors inside a round (a peer that does not arrive within cfg.timeout_s, a runtime_max
 * mismatch, a bad count, an expert id out of range) are written by the kernel into mapped host
 * memory and every later kernel of this object returns at once; a2a_gpu_check syncs the stream
 * and turns the record into a message. The object is then unusable (a late peer may still write
 * into the workspace): report and exit. A kernel cannot call cfg.check_peers: when it is given
 * (and ep_size > 1), a host thread calls it every 100 ms, and a peer it reports gone ends the
 * waits of nvlink_one_sided within about 0.1 s with its message (nccl still waits: NCCL has no
 * timeout of its own here). A peer gone where check_peers cannot see it (another node) shows
 * as a timeout naming it.
 *
 * Sizes: each rank holds ep * max_tokens_per_rank received rows of D fp32, and (one-sided) a
 * segment of ep * max_tokens_per_rank * (record + K D 4) bytes: choose max_tokens_per_rank with
 * care at large D (2 ranks, 8192 tokens, D 7168, K 8: 4.2 GB of segment). */
#ifndef MOESERVE_A2A_CUDA_H
#define MOESERVE_A2A_CUDA_H

#if defined(__cplusplus) && !defined(OMPI_SKIP_MPICXX)
#define OMPI_SKIP_MPICXX  1 /* the C bindings only */
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#include "kernels/a2a.h"

typedef struct a2a_gpu a2a_gpu;

/* What dispatch left on this rank, all device memory, valid until the next dispatch: rows ordered
 * by source rank, then by the source's order (kernels/a2a.h's a2a_received). The count is on the
 * device (*n, with count[p] and begin[p] per source); n_max = ep * runtime_max bounds it on the
 * host (size grids with it; rows >= *n are stale). ids are LOCAL expert ids, -1 where this rank
 * owns no expert of the slot. */
typedef struct {
    int n_max;
    const int32_t *n;     /* [1] */
    const int32_t *count; /* [ep] rows from each source */
    const int32_t *begin; /* [ep + 1] first row of each source */
    const float *x;       /* [ep * max_tokens_per_rank, D] */
    const int32_t *ids;   /* [ep * max_tokens_per_rank, K] */
    const float *w;       /* [ep * max_tokens_per_rank, K] */
} a2a_gpu_received;

/* Collective over comm; uses the current CUDA device (cudaSetDevice first). Besides a2a_create's
 * checks: hidden % 16 == 0, top_k <= 32, and for nvlink_one_sided peer access to every rank's
 * device. NULL with a message on failure (every rank fails together). */
a2a_gpu *a2a_gpu_create(const a2a_config *cfg, MPI_Comm comm, char *err, size_t errlen);
/* Collective: syncs the device, waits for every rank, unmaps and frees. */
void a2a_gpu_destroy(a2a_gpu *a);

/* x[T, D] fp32, topk_ids[T, K] global expert ids, topk_w[T, K] -> the owner ranks, each token
 * once per rank, as the config's payload. 0, or -1 with a message for what the host can see
 * (T > runtime_max, runtime_max > max_tokens_per_rank, phase errors, an earlier failure). */
int a2a_gpu_dispatch(a2a_gpu *a, const float *x, const int32_t *topk_ids, const float *topk_w,
                     int T, int runtime_max, void *stream, char *err, size_t errlen);

a2a_gpu_received a2a_gpu_get_received(const a2a_gpu *a);

/* Combine, slots form: expert_out[n, K, D] (fp32, row i = received row i, slot k meaningful where
 * ids[i, k] >= 0) -> out[T, K, D] on the home rank, slot k of token t = the output of expert
 * topk_ids[t, k], copied unchanged. Exact and deterministic whatever the rank count (the home
 * rank's finalize sums the slots in order k = 0..K-1). Moves 4 D bytes per remote slot. */
int a2a_gpu_combine(a2a_gpu *a, const float *expert_out, float *out, void *stream, char *err,
                    size_t errlen);

/* Combine, partial form (TensorRT-LLM's): each owner rank sums, per received token, its own
 * slots' w[i, k] * expert_out[i, k, :] in slot order in fp32 (no fused multiply-add), rounds the
 * sum to BF16 (its own tokens too) and sends one vector per token; the home rank writes
 * out[t, :] = the sum over ranks in rank order of the BF16 partials, in fp32. 2 D bytes per
 * (token, remote rank) instead of 4 D per remote slot, but NOT deterministic across rank
 * counts: which slots share a partial, and the BF16 rounding of each partial, depend on the
 * expert split. */
int a2a_gpu_combine_partial(a2a_gpu *a, const float *expert_out, float *out /* [T, D] */,
                            void *stream, char *err, size_t errlen);

/* Syncs the stream of the last call, then reports any error a kernel recorded: 0, or -1 with a
 * message such as "all-to-all rank 0: rank 1 did not arrive within 10 s (dispatch counts, round
 * 7)". After -1 the object is broken. While that stream is being captured into a CUDA graph it
 * returns 0 at once (nothing ran yet): check after each replay instead. */
int a2a_gpu_check(a2a_gpu *a, char *err, size_t errlen);

/* With MOESERVE_A2A_TRACE=1 in the environment at create: the %globaltimer nanoseconds of the
 * last round's fixed points (route start, rows handed out, count lines out, dispatch start,
 * sends done, counts in, receives done, combine start, sends done, gathers done, end flags out),
 * up to n of them; returns how many (0 without the trace). Diagnostics only. */
int a2a_gpu_trace(const a2a_gpu *a, unsigned long long *t, int n);

/* How the one-sided segment is shared: "ipc", "posix_fd" or "fabric" ("none" for nccl). */
const char *a2a_gpu_segment_kind(const a2a_gpu *a);

/* Bytes of one dispatched record (payload, ids, weights, padded to 16) of this object: what a
 * (token, remote rank) pair moves over the link in dispatch. */
size_t a2a_gpu_record_bytes(const a2a_gpu *a);

#ifdef __cplusplus
}
#endif

#endif
