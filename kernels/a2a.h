/* MoE all-to-all: sends each token to the ranks that own its routed experts and brings the
 * expert outputs home. One interface, several transports:
 *   shm               CPU ranks on one node: MPI-3 shared-memory windows; peers write straight
 *                     into each other's receive regions, flags with release/acquire ordering
 *   mpi               one-sided MPI_Put into MPI_Win_allocate windows (ranks that share no memory)
 *   nvlink_one_sided  (CUDA backend, later) CUDA IPC / cuMem peer writes over NVLink
 *   nccl              (CUDA backend, later) two-sided ncclSend/ncclRecv baseline
 *   none              one rank: dispatch and combine are local copies
 *
 * Shapes: T tokens on this rank, D hidden, K experts per token, E experts in all.
 * Rank r owns experts [expert_begin[r], expert_begin[r + 1]) (contiguous ranges).
 *
 * One round = dispatch then combine; every rank of the group calls both, in the same order, every
 * step, even with T = 0 (else the others wait). runtime_max must be identical on every rank and
 * >= every rank's T (the step agreement gives it); it sets the receive offsets.
 *
 * Combine returns every slot's output separately ([T, K, D]) so that the home rank sums the K
 * outputs in slot order k = 0..K-1 in fp32 (moe_finalize), exactly as one process does: results do
 * not depend on which rank computed which expert. a2a_combine_partial gives the GPU's partial
 * form instead (a weighted sum per owner rank in BF16), whose results do. */
#ifndef MOESERVE_A2A_H
#define MOESERVE_A2A_H

#include <mpi.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef enum {
    A2A_NONE,
    A2A_SHM,
    A2A_MPI,
    A2A_NVLINK_ONE_SIDED,
    A2A_NCCL,
} a2a_transport;

/* "none", "shm", "mpi", "nvlink_one_sided", "nccl"; also "flashinfer_nvlink_one_sided" (= nvlink);
 * false for anything else. */
bool a2a_transport_parse(const char *s, a2a_transport *out);
const char *a2a_transport_name(a2a_transport t);

/* How dispatched tokens travel (combine always returns fp32 slots). Quantized payloads are made
 * with kernels/quant.h's formats and turned back into fp32 on arrival; a rank's tokens for its own
 * experts take the same round trip, so a token's expert input does not depend on where its expert
 * lives:
 *   f32    the activations as they are (4 D bytes a token)
 *   bf16   rounded to BF16, nearest even (2 D)
 *   fp8    E4M3 with one fp32 scale per 128 channels (D + 4 ceil(D / 128))
 *   nvfp4  E2M1 with an E4M3 scale per 16 channels and the token's own fp32 scale
 *          (D / 2 + D / 16 + 4; D % 16 == 0) */
typedef enum {
    A2A_PAYLOAD_F32,
    A2A_PAYLOAD_BF16,
    A2A_PAYLOAD_FP8,
    A2A_PAYLOAD_NVFP4,
} a2a_payload;

/* "f32" (also "fp32"), "bf16", "fp8", "nvfp4"; false for anything else. */
bool a2a_payload_parse(const char *s, a2a_payload *out);
const char *a2a_payload_name(a2a_payload p);
/* Bytes of one token's payload of D channels (before the record's ids and weights). */
size_t a2a_payload_bytes(a2a_payload p, int D);
/* What a token of D channels becomes after the payload's round trip: y = decode(encode(x)) (y may
 * equal x). The reference for every transport, the GPU's included. */
void a2a_payload_roundtrip(a2a_payload p, float *y, const float *x, int D);

#define A2A_MAX_RANKS 256

typedef struct {
    a2a_transport transport;
    int ep_size;             /* ranks in the group */
    int rank;                /* this rank */
    int max_tokens_per_rank; /* static maximum T of any rank in any step: sizes the buffers */
    int hidden;              /* D */
    int top_k;               /* K */
    int n_experts;           /* E */
    a2a_payload payload;     /* dispatch format (zero: f32) */
    int expert_begin[A2A_MAX_RANKS + 1]; /* [ep_size + 1] ownership ranges */
    double timeout_s;        /* a wait longer than this fails with a message naming the peer */
    /* Optional, called every 100 ms of a wait: -1 with a message when a peer is known to be gone
     * (the wait then fails at once with it), else 0. */
    int (*check_peers)(void *ctx, char *msg, size_t len);
    void *check_ctx;
} a2a_config;

/* Contiguous split of E experts over n ranks, the first E % n ranks one larger (10 on 3 -> 4,3,3). */
void a2a_split_experts(int n_experts, int n_ranks, int *expert_begin /* [n_ranks + 1] */);

/* What dispatch delivered to this rank: n tokens, ordered by source rank then by the source's
 * order. ids[i, k] is the LOCAL expert index (global id - expert_begin[rank]) of slot k when this
 * rank owns it, else -1; w[i, k] the router weight. Valid until the next dispatch. */
typedef struct {
    int n;
    const float *x;       /* [n, D] */
    const int32_t *ids;   /* [n, K] */
    const float *w;       /* [n, K] */
} a2a_received;

typedef struct a2a a2a;

/* Collective over comm (every rank calls it with the same config but its own rank). Returns NULL
 * with a message on failure (e.g. shm on ranks that share no node). */
a2a *a2a_create(const a2a_config *cfg, MPI_Comm comm, char *err, size_t errlen);
void a2a_destroy(a2a *a); /* collective */

/* Send x[T, D] with topk_ids[T, K] (global expert ids) and topk_w[T, K] to the owner ranks (each
 * token at most once per rank). Returns 0, or -1 with a message (peer timed out, dispatch twice
 * without a combine, T > runtime_max, runtime_max > max_tokens_per_rank). */
int a2a_dispatch(a2a *a, const float *x, const int32_t *topk_ids, const float *topk_w, int T,
                 int runtime_max, char *err, size_t errlen);

a2a_received a2a_get_received(const a2a *a);
/* The configuration it was created with (its payload: what the experts of the receiving ranks
 * are handed). */
const a2a_config *a2a_get_config(const a2a *a);

/* expert_out[n, K, D] for the received tokens (slot k meaningful where ids[i, k] >= 0) -> out[T, K,
 * D] on the home rank: slot k of token t = the output of expert topk_ids[t, k] from its owner.
 * Returns 0, or -1 with a message. */
int a2a_combine(a2a *a, const float *expert_out, float *out, char *err, size_t errlen);

/* The partial form (TensorRT-LLM's combine; kernels/cuda/a2a_cuda.h's a2a_gpu_combine_partial):
 * out[T, D] = the sum, over the ranks in rank order, of each owner rank's partial: its slots'
 * topk_w[t, k] expert_out[t, k] added in slot order in fp32 (no fused multiply-add), rounded to
 * BF16. On a GPU link it moves 2 D bytes per (token, remote rank) instead of 4 D per remote slot,
 * but which slots share a partial depends on the expert split: results are not the same across
 * rank counts (the slots form's are). Here the slots still travel and the home rank forms the
 * owners' partials from them (topk_w[T, K]: the dispatch's weights): the GPU's bits, not its
 * bytes. Returns 0, or -1 with a message. */
int a2a_combine_partial(a2a *a, const float *expert_out, const float *topk_w, float *out, char *err,
                        size_t errlen);

#endif
