/* The nccl all-to-all transport: the two-sided baseline the one-sided transport is measured
 * against, with the same C API (kernels/cuda/a2a_cuda.h) and the same kernels
 * (a2a_nvlink.cu), staged through local buffers instead of peer memory.
 *
 * Dispatch: the route kernel writes this rank's count lines {count, runtime_max} into a local
 * array; a grouped ncclSend/ncclRecv swaps them (every rank with every rank); the host reads
 * them (a stream sync: two-sided transfers need their sizes on the host) and checks the
 * runtime_max of every rank; the dispatch kernel encodes the records for each peer into
 * send_buf[peer][row]; a grouped ncclSend/ncclRecv moves exactly count records each way into
 * recv_buf[src][row]; a second dispatch launch decodes them and this rank's own tokens.
 * Combine: the owner packs the returns (slots or BF16 partials) into csend_buf[home][row], own
 * tokens go straight into out (slots) or comb_buf[me] (partial); grouped ncclSend/ncclRecv; the
 * home gathers as the one-sided transport does. The slots form sends all K slots of each
 * returned row (the ones this rank does not own too: the baseline does not compact them).
 *
 * Not capturable in a CUDA graph (the host reads the counts), and a missing rank hangs NCCL
 * instead of timing out: the baseline, not the transport to serve with. */
#include "kernels/cuda/a2a_cuda_internal.h"

#ifndef MOESERVE_NO_NCCL
#include <nccl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    ncclComm_t comm;
    char *send_buf, *recv_buf, *csend_buf, *comb_buf;
    a2a_gpu_count_line *lines;      /* device [2 ep]: this rank's lines, then every rank's for it */
    a2a_gpu_count_line *lines_host; /* pinned [2 ep] */
} nccl_state;

static int nccl_fail(char *err, size_t errlen, int rank, const char *what, ncclResult_t r) {
    snprintf(err, errlen, "all-to-all nccl rank %d: %s failed: %s", rank, what,
             ncclGetErrorString(r));
    return -1;
}

#define NTRY(call, what)                                                                           \
    do {                                                                                           \
        ncclResult_t r_ = (call);                                                                  \
        if (r_ != ncclSuccess) return nccl_fail(err, errlen, a->cfg.rank, what, r_);               \
    } while (0)
#define CTRY(call, what)                                                                           \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess) return a2a_gpu_cuda_fail(err, errlen, a->cfg.rank, what, e_);       \
    } while (0)

int a2a_nccl_init(a2a_gpu *a, char *err, size_t errlen) {
    const int ep = a->cfg.ep_size, me = a->cfg.rank;
    const size_t M = (size_t)a->cfg.max_tokens_per_rank;
    nccl_state *s = (nccl_state *)calloc(1, sizeof *s);
    a->nccl = s;
    ncclUniqueId id;
    memset(&id, 0, sizeof id);
    ncclResult_t r = me == 0 ? ncclGetUniqueId(&id) : ncclSuccess;
    /* every rank joins the broadcast even when rank 0 failed (it then sends zeros) */
    if (MPI_Bcast(&id, (int)sizeof id, MPI_BYTE, 0, a->comm) != MPI_SUCCESS) {
        snprintf(err, errlen, "all-to-all nccl rank %d: MPI_Bcast of the NCCL id failed", me);
        return -1;
    }
    if (r != ncclSuccess) return nccl_fail(err, errlen, me, "ncclGetUniqueId", r);
    NTRY(ncclCommInitRank(&s->comm, ep, id, me), "ncclCommInitRank");
    const size_t ret = a2a_gpu_return_bytes(a, 0);
    CTRY(cudaMalloc((void **)&s->send_buf, (size_t)ep * M * a->rec), "cudaMalloc");
    CTRY(cudaMalloc((void **)&s->recv_buf, (size_t)ep * M * a->rec), "cudaMalloc");
    CTRY(cudaMalloc((void **)&s->csend_buf, (size_t)ep * M * ret), "cudaMalloc");
    CTRY(cudaMalloc((void **)&s->comb_buf, (size_t)ep * M * ret), "cudaMalloc");
    CTRY(cudaMalloc((void **)&s->lines, 2 * (size_t)ep * sizeof(a2a_gpu_count_line)), "cudaMalloc");
    CTRY(cudaMallocHost((void **)&s->lines_host, 2 * (size_t)ep * sizeof(a2a_gpu_count_line)),
         "cudaMallocHost");
    return 0;
}

void a2a_nccl_free(a2a_gpu *a) {
    nccl_state *s = (nccl_state *)a->nccl;
    if (!s) return;
    if (s->comm) ncclCommDestroy(s->comm);
    cudaFree(s->send_buf);
    cudaFree(s->recv_buf);
    cudaFree(s->csend_buf);
    cudaFree(s->comb_buf);
    cudaFree(s->lines);
    if (s->lines_host) cudaFreeHost(s->lines_host);
    free(s);
    a->nccl = NULL;
}

static void stage(const a2a_gpu *a, a2a_kp *kp) {
    nccl_state *s = (nccl_state *)a->nccl;
    kp->send_buf = s->send_buf;
    kp->csend_buf = s->csend_buf;
    kp->recv_base = s->recv_buf;
    kp->comb_base = s->comb_buf;
    kp->cnt_out = s->lines;
    kp->cnt_base = (char *)(s->lines + a->cfg.ep_size);
    kp->cnt_stride = (int)sizeof(a2a_gpu_count_line);
}

int a2a_nccl_dispatch(a2a_gpu *a, a2a_kp *kp, cudaStream_t st, char *err, size_t errlen) {
    nccl_state *s = (nccl_state *)a->nccl;
    const int ep = a->cfg.ep_size, me = a->cfg.rank;
    const size_t rm = (size_t)a->runtime_max, line = sizeof(a2a_gpu_count_line);
    stage(a, kp);
    kp->roles = A2A_GPU_SEND;
    if (a2a_gpu_launch_route(a, kp, st, err, errlen) != 0) return -1;
    if (a2a_gpu_launch_dispatch(a, kp, st, err, errlen) != 0) return -1;
    NTRY(ncclGroupStart(), "ncclGroupStart");
    for (int p = 0; p < ep; p++) {
        NTRY(ncclSend(s->lines + p, line, ncclChar, p, s->comm, st), "ncclSend of the counts");
        NTRY(ncclRecv(s->lines + ep + p, line, ncclChar, p, s->comm, st), "ncclRecv of the counts");
    }
    NTRY(ncclGroupEnd(), "ncclGroupEnd");
    CTRY(cudaMemcpyAsync(s->lines_host, s->lines, 2 * ep * line, cudaMemcpyDeviceToHost, st),
         "cudaMemcpyAsync of the counts");
    CTRY(cudaStreamSynchronize(st), "cudaStreamSynchronize");
    const a2a_gpu_count_line *out = s->lines_host, *in = s->lines_host + ep;
    for (int p = 0; p < ep; p++)
        if (in[p].runtime_max != a->runtime_max || in[p].count < 0 ||
            in[p].count > a->runtime_max) {
            snprintf(err, errlen,
                     "all-to-all nccl rank %d: rank %d dispatched with runtime_max %d and %d "
                     "tokens for this rank, this rank with runtime_max %d: runtime_max must be "
                     "the same on every rank",
                     me, p, in[p].runtime_max, in[p].count, a->runtime_max);
            return -1;
        }
    NTRY(ncclGroupStart(), "ncclGroupStart");
    for (int p = 0; p < ep; p++) {
        if (p == me) continue;
        if (out[p].count > 0)
            NTRY(ncclSend(s->send_buf + (size_t)p * rm * a->rec, (size_t)out[p].count * a->rec,
                          ncclChar, p, s->comm, st),
                 "ncclSend of the records");
        if (in[p].count > 0)
            NTRY(ncclRecv(s->recv_buf + (size_t)p * rm * a->rec, (size_t)in[p].count * a->rec,
                          ncclChar, p, s->comm, st),
                 "ncclRecv of the records");
    }
    NTRY(ncclGroupEnd(), "ncclGroupEnd");
    kp->roles = A2A_GPU_SELF | A2A_GPU_RECV;
    return a2a_gpu_launch_dispatch(a, kp, st, err, errlen);
}

int a2a_nccl_combine(a2a_gpu *a, a2a_kp *kp, cudaStream_t st, char *err, size_t errlen) {
    nccl_state *s = (nccl_state *)a->nccl;
    const int ep = a->cfg.ep_size, me = a->cfg.rank;
    const size_t rm = (size_t)a->runtime_max, ret = a2a_gpu_return_bytes(a, kp->partial);
    /* the counts of this round, read by the host in dispatch */
    const a2a_gpu_count_line *out = s->lines_host, *in = s->lines_host + ep;
    stage(a, kp);
    kp->roles = A2A_GPU_SEND | A2A_GPU_SELF;
    if (a2a_gpu_launch_combine(a, kp, st, err, errlen) != 0) return -1;
    NTRY(ncclGroupStart(), "ncclGroupStart");
    for (int p = 0; p < ep; p++) {
        if (p == me) continue;
        if (in[p].count > 0)
            NTRY(ncclSend(s->csend_buf + (size_t)p * rm * ret, (size_t)in[p].count * ret, ncclChar,
                          p, s->comm, st),
                 "ncclSend of the returns");
        if (out[p].count > 0)
            NTRY(ncclRecv(s->comb_buf + (size_t)p * rm * ret, (size_t)out[p].count * ret, ncclChar,
                          p, s->comm, st),
                 "ncclRecv of the returns");
    }
    NTRY(ncclGroupEnd(), "ncclGroupEnd");
    kp->roles = A2A_GPU_RECV | A2A_GPU_FINISH;
    return a2a_gpu_launch_combine(a, kp, st, err, errlen);
}

#else /* built without nccl.h (the Makefile found none): the transport says so at create */

#include <stdio.h>

int a2a_nccl_init(a2a_gpu *a, char *err, size_t errlen) {
    snprintf(err, errlen,
             "all-to-all rank %d: this build has no NCCL (nccl.h was not found): use the "
             "nvlink_one_sided transport, or install NCCL and rebuild",
             a->cfg.rank);
    return -1;
}
void a2a_nccl_free(a2a_gpu *a) {}
int a2a_nccl_dispatch(a2a_gpu *a, a2a_kp *kp, cudaStream_t s, char *err, size_t errlen) {
    return a2a_nccl_init(a, err, errlen);
}
int a2a_nccl_combine(a2a_gpu *a, a2a_kp *kp, cudaStream_t s, char *err, size_t errlen) {
    return a2a_nccl_init(a, err, errlen);
}

#endif
