/* GPU all-to-all benchmark: nvlink_one_sided against nccl in one run, on two GPUs of one node.
 *   mpirun --allow-run-as-root -np 2 build/bench_a2a_cuda [--quick] [--hidden D] [--payload P]
 * (NCCL_NVLS_ENABLE=0 in the environment.) For hidden 2048 and 7168, payloads bf16, fp8 and
 * nvfp4, tokens per rank 1, 8, 32, 128, 512, 2048, 8192, top-8 of 256 experts, random routing
 * (every rank its own), runtime_max = T on every rank:
 *   one-sided   10 rounds (dispatch, combine partial, dispatch, combine slots, ...) captured in
 *               one CUDA graph with event record nodes between the pieces, the graph replayed;
 *               as in the engine, where the all-to-all sits inside the captured forward pass,
 *               what is timed is the GPU's work without the host's launch latency;
 *   nccl        the same rounds as plain calls, events between them (its dispatch reads the
 *               counts on the host, so it cannot be captured).
 * Each figure is the median over the rounds of the slower rank's median. Bytes are only those
 * that cross NVLink, per direction (the mean of what each rank sends to the other): dispatch =
 * (token, remote rank) pairs x record bytes; partial = pairs x 2 D; slots = remote slots x 4 D
 * (nccl's slots form sends all K slots of a returned row, twice that at two ranks; not counted).
 * GB/s = those bytes / the time. The link's ceiling is measured first in the same run: a 1 GiB
 * cudaMemcpyPeer from GPU 0 to GPU 1, and both ways at once. */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef MOESERVE_CUDA
#include "kernels/cuda/a2a_cuda.h"

#include <cuda_runtime.h>

static int g_rank, g_size;

#define CU(call)                                                                                   \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess) {                                                                   \
            fprintf(stderr, "rank %d: %s failed at %s:%d: %s\n", g_rank, #call, __FILE__,          \
                    __LINE__, cudaGetErrorString(e_));                                             \
            MPI_Abort(MPI_COMM_WORLD, 1);                                                          \
        }                                                                                          \
    } while (0)
#define A2A(call)                                                                                  \
    do {                                                                                           \
        if ((call) != 0) {                                                                         \
            fprintf(stderr, "rank %d: %s\n", g_rank, err);                                         \
            MPI_Abort(MPI_COMM_WORLD, 1);                                                          \
        }                                                                                          \
    } while (0)

static uint64_t mix(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}
static double unif(uint64_t *s) { return (double)((*s = mix(*s)) >> 11) * 0x1.0p-53; }

static int cmp_float(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return x < y ? -1 : x > y;
}
static float median(float *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp_float);
    return n ? v[n / 2] : 0.0f;
}
static float slowest(float v) {
    float m = 0;
    MPI_Allreduce(&v, &m, 1, MPI_FLOAT, MPI_MAX, MPI_COMM_WORLD);
    return m;
}
static double mean_over_ranks(double v) {
    double s = 0;
    MPI_Allreduce(&v, &s, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    return s / g_size;
}

static void link_ceiling(void) {
    int n_dev = 0;
    cudaGetDeviceCount(&n_dev);
    if (g_rank == 0 && n_dev >= 2) {
        const size_t bytes = (size_t)1 << 30;
        void *a0, *a1, *b0, *b1;
        cudaStream_t s0, s1;
        CU(cudaSetDevice(1));
        CU(cudaMalloc(&a1, bytes));
        CU(cudaMalloc(&b1, bytes));
        CU(cudaStreamCreate(&s1));
        CU(cudaSetDevice(0));
        CU(cudaMalloc(&a0, bytes));
        CU(cudaMalloc(&b0, bytes));
        CU(cudaStreamCreate(&s0));
        cudaDeviceEnablePeerAccess(1, 0);
        cudaGetLastError();
        cudaEvent_t e0, e1;
        CU(cudaEventCreate(&e0));
        CU(cudaEventCreate(&e1));
        float best = 1e30f, best2 = 1e30f;
        for (int i = 0; i < 5; i++) {
            CU(cudaEventRecord(e0, s0));
            CU(cudaMemcpyPeerAsync(a1, 1, a0, 0, bytes, s0));
            CU(cudaEventRecord(e1, s0));
            CU(cudaEventSynchronize(e1));
            float ms;
            CU(cudaEventElapsedTime(&ms, e0, e1));
            if (ms < best) best = ms;
        }
        for (int i = 0; i < 5; i++) { /* both ways at once, one stream each */
            CU(cudaDeviceSynchronize());
            double t0 = MPI_Wtime();
            CU(cudaMemcpyPeerAsync(a1, 1, a0, 0, bytes, s0));
            CU(cudaMemcpyPeerAsync(b0, 0, b1, 1, bytes, s1));
            CU(cudaStreamSynchronize(s0));
            CU(cudaStreamSynchronize(s1));
            float ms = (float)((MPI_Wtime() - t0) * 1e3);
            if (ms < best2) best2 = ms;
        }
        printf("link ceiling: cudaMemcpyPeer 1 GiB GPU 0 -> 1: %.1f GB/s; both ways at once: %.1f "
               "GB/s per direction\n",
               bytes / (best * 1e-3) / 1e9, bytes / (best2 * 1e-3) / 1e9);
        cudaDeviceDisablePeerAccess(1); /* the all-to-all maps its peers itself */
        cudaGetLastError();
        cudaFree(a0), cudaFree(b0);
        CU(cudaSetDevice(1));
        cudaFree(a1), cudaFree(b1);
        cudaStreamDestroy(s1);
        CU(cudaSetDevice(0));
        cudaStreamDestroy(s0);
    }
    MPI_Barrier(MPI_COMM_WORLD);
}

typedef struct {
    float disp, part, slots; /* microseconds, median of the slower rank */
} times;

#define NR 10 /* rounds in one captured graph */

/* Rounds on a: dispatch then combine (partial on even rounds, slots on odd). One-sided: NR
 * rounds captured in one CUDA graph with event record nodes between the pieces (so what is
 * timed is the GPU's work, not the host's launches), the graph replayed reps times. nccl: plain
 * calls, events between them. */
static times run_rounds(a2a_gpu *a, bool graphs, const float *x, const int32_t *ids, const float *w,
                        const float *eo, float *out, int T, int reps, cudaStream_t s) {
    char err[512];
    const int R = graphs ? NR : reps;
    cudaEvent_t ev[3 * NR + 3 * 400];
    for (int i = 0; i < 3 * R; i++)
        CU(cudaEventCreate(&ev[i]));
    /* warm-up */
    A2A(a2a_gpu_dispatch(a, x, ids, w, T, T, s, err, sizeof err));
    A2A(a2a_gpu_combine_partial(a, eo, out, s, err, sizeof err));
    A2A(a2a_gpu_dispatch(a, x, ids, w, T, T, s, err, sizeof err));
    A2A(a2a_gpu_combine(a, eo, out, s, err, sizeof err));
    A2A(a2a_gpu_check(a, err, sizeof err));
    cudaGraphExec_t exec = NULL;
    if (graphs) {
        cudaGraph_t g;
        CU(cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed));
        for (int r = 0; r < R; r++) {
            CU(cudaEventRecordWithFlags(ev[3 * r], s, cudaEventRecordExternal));
            A2A(a2a_gpu_dispatch(a, x, ids, w, T, T, s, err, sizeof err));
            CU(cudaEventRecordWithFlags(ev[3 * r + 1], s, cudaEventRecordExternal));
            if (r & 1)
                A2A(a2a_gpu_combine(a, eo, out, s, err, sizeof err));
            else
                A2A(a2a_gpu_combine_partial(a, eo, out, s, err, sizeof err));
            CU(cudaEventRecordWithFlags(ev[3 * r + 2], s, cudaEventRecordExternal));
        }
        CU(cudaStreamEndCapture(s, &g));
        CU(cudaGraphInstantiate(&exec, g, 0));
        cudaGraphDestroy(g);
        CU(cudaGraphLaunch(exec, s)); /* warm-up */
        A2A(a2a_gpu_check(a, err, sizeof err));
    }
    const int n_rep = graphs ? (reps + NR - 1) / NR : 1;
    float *d = malloc(sizeof(float) * (size_t)(R * n_rep)),
          *p = malloc(sizeof(float) * (size_t)(R * n_rep)),
          *sl = malloc(sizeof(float) * (size_t)(R * n_rep));
    int nd = 0, np = 0, ns = 0;
    for (int rep = 0; rep < n_rep; rep++) {
        CU(cudaStreamSynchronize(s));
        MPI_Barrier(MPI_COMM_WORLD);
        if (graphs) {
            CU(cudaGraphLaunch(exec, s));
        } else {
            for (int r = 0; r < R; r++) {
                CU(cudaEventRecord(ev[3 * r], s));
                A2A(a2a_gpu_dispatch(a, x, ids, w, T, T, s, err, sizeof err));
                CU(cudaEventRecord(ev[3 * r + 1], s));
                if (r & 1)
                    A2A(a2a_gpu_combine(a, eo, out, s, err, sizeof err));
                else
                    A2A(a2a_gpu_combine_partial(a, eo, out, s, err, sizeof err));
                CU(cudaEventRecord(ev[3 * r + 2], s));
            }
        }
        A2A(a2a_gpu_check(a, err, sizeof err));
        for (int r = 0; r < R; r++) {
            float ms;
            CU(cudaEventElapsedTime(&ms, ev[3 * r], ev[3 * r + 1]));
            d[nd++] = ms * 1e3f;
            CU(cudaEventElapsedTime(&ms, ev[3 * r + 1], ev[3 * r + 2]));
            if (r & 1)
                sl[ns++] = ms * 1e3f;
            else
                p[np++] = ms * 1e3f;
        }
    }
    times t = {slowest(median(d, nd)), slowest(median(p, np)), slowest(median(sl, ns))};
    for (int i = 0; i < 3 * R; i++)
        cudaEventDestroy(ev[i]);
    free(d), free(p), free(sl);
    if (exec) cudaGraphExecDestroy(exec);
    return t;
}

/* With MOESERVE_A2A_TRACE=1: 20 plain rounds (dispatch, combine partial), each read back, and
 * the median time of each point of the round's timeline (a2a_gpu_trace) on every rank. */
static void trace_rounds(a2a_gpu *a, const float *x, const int32_t *ids, const float *w,
                         const float *eo, float *out, int T, cudaStream_t s) {
    enum { N = 11, R = 21 };
    char err[512];
    float v[N][R];
    unsigned long long t[N];
    for (int r = 0; r < R; r++) {
        CU(cudaStreamSynchronize(s));
        MPI_Barrier(MPI_COMM_WORLD);
        A2A(a2a_gpu_dispatch(a, x, ids, w, T, T, s, err, sizeof err));
        A2A(a2a_gpu_combine_partial(a, eo, out, s, err, sizeof err));
        A2A(a2a_gpu_check(a, err, sizeof err));
        if (a2a_gpu_trace(a, t, N) != N) return;
        for (int i = 0; i < N; i++)
            v[i][r] = (float)((double)(t[i] - t[i < 7 ? 0 : 7]) * 1e-3);
    }
    float med[N], all[2 * N];
    for (int i = 0; i < N; i++)
        med[i] = median(v[i], R);
    if (g_size != 2) return;
    MPI_Gather(med, N, MPI_FLOAT, all, N, MPI_FLOAT, 0, MPI_COMM_WORLD);
    if (g_rank == 0)
        for (int r = 0; r < 2; r++) {
            const float *m = all + r * N;
            printf(
                "  trace T=%d rank %d, us from the route kernel's start: rows handed out %.1f, "
                "count "
                "lines out %.1f, dispatch kernel in %.1f, block 0 sent %.1f, last block has the "
                "counts %.1f, received %.1f; from the combine kernel's start: block 0 sent %.1f, "
                "gathered %.1f, end flags out %.1f\n",
                T, r, m[1], m[2], m[3], m[4], m[5], m[6], m[8], m[9], m[10]);
        }
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &g_size);
    bool quick = false;
    int only_d = 0, only_p = -1;
    for (int i = 1; i < argc; i++) {
        a2a_payload pl;
        if (strcmp(argv[i], "--quick") == 0)
            quick = true;
        else if (strcmp(argv[i], "--hidden") == 0 && i + 1 < argc)
            only_d = atoi(argv[++i]);
        else if (strcmp(argv[i], "--payload") == 0 && i + 1 < argc &&
                 a2a_payload_parse(argv[i + 1], &pl))
            only_p = (int)pl, i++;
        else {
            if (g_rank == 0)
                fprintf(
                    stderr,
                    "usage: bench_a2a_cuda [--quick] [--hidden D] [--payload bf16|fp8|nvfp4]\n");
            MPI_Finalize();
            return 2;
        }
    }
    int n_dev = 0;
    if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev == 0) {
        if (g_rank == 0) printf("bench_a2a_cuda: no CUDA device\n");
        MPI_Finalize();
        return 0;
    }
    link_ceiling();
    CU(cudaSetDevice(g_rank % n_dev));
    cudaStream_t s;
    CU(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    const int Ds[] = {2048, 7168}, Ts[] = {1, 8, 32, 128, 512, 2048, 8192};
    const a2a_payload pls[] = {A2A_PAYLOAD_BF16, A2A_PAYLOAD_FP8, A2A_PAYLOAD_NVFP4};
    const int E = 256, K = 8, M = quick ? 2048 : 8192, nT = quick ? 6 : 7;
    char err[512];
    if (g_rank == 0)
        printf("%d ranks, top-%d of %d experts, random routing; us = median of the slower rank; "
               "MB and GB/s: bytes crossing NVLink per direction\n",
               g_size, K, E);
    for (int di = 0; di < 2; di++) {
        const int D = Ds[di];
        if (only_d && D != only_d) continue;
        float *x, *w, *eo, *out;
        int32_t *ids;
        CU(cudaMalloc((void **)&x, (size_t)M * D * 4));
        CU(cudaMalloc((void **)&ids, (size_t)M * K * 4));
        CU(cudaMalloc((void **)&w, (size_t)M * K * 4));
        CU(cudaMalloc((void **)&eo, (size_t)g_size * M * K * D * 4));
        CU(cudaMalloc((void **)&out, (size_t)M * K * D * 4));
        CU(cudaMemset(eo, 0, (size_t)g_size * M * K * D * 4));
        {
            float *hx = malloc((size_t)M * D * 4);
            uint64_t sd = 99 + (uint64_t)g_rank;
            for (size_t i = 0; i < (size_t)M * D; i++)
                hx[i] = (float)(unif(&sd) * 4.0 - 2.0);
            CU(cudaMemcpy(x, hx, (size_t)M * D * 4, cudaMemcpyHostToDevice));
            free(hx);
        }
        for (int pi = 0; pi < 3; pi++) {
            if (only_p >= 0 && (int)pls[pi] != only_p) continue;
            a2a_config c;
            memset(&c, 0, sizeof c);
            c.ep_size = g_size;
            c.rank = g_rank;
            c.max_tokens_per_rank = M;
            c.hidden = D;
            c.top_k = K;
            c.n_experts = E;
            c.payload = pls[pi];
            c.timeout_s = 60;
            a2a_split_experts(E, g_size, c.expert_begin);
            c.transport = A2A_NVLINK_ONE_SIDED;
            a2a_gpu *one = a2a_gpu_create(&c, MPI_COMM_WORLD, err, sizeof err);
            A2A(one ? 0 : -1);
            c.transport = A2A_NCCL;
            a2a_gpu *two = a2a_gpu_create(&c, MPI_COMM_WORLD, err, sizeof err);
            A2A(two ? 0 : -1);
            const size_t rec = a2a_gpu_record_bytes(one);
            if (g_rank == 0)
                printf("\nD=%d %s (record %zu B, segment shared by %s)\n%6s | %-28s | %-34s | %-28s | %s\n", D,
                       a2a_payload_name(pls[pi]), rec, a2a_gpu_segment_kind(one), "T", "one-sided us: disp part slots",
                       "MB disp / part; GB/s disp part slots", "nccl us: disp part slots",
                       "nccl/one-sided disp part");
            for (int ti = 0; ti < nT; ti++) {
                const int T = Ts[ti];
                int32_t *hid = malloc((size_t)T * K * 4);
                float *hw = malloc((size_t)T * K * 4);
                uint64_t sd = 1000 + 17 * (uint64_t)T + (uint64_t)g_rank;
                long pairs = 0, rslots = 0;
                for (int t = 0; t < T; t++) {
                    bool remote[A2A_MAX_RANKS] = {false};
                    for (int k = 0; k < K; k++) {
                        int e, dup;
                        do {
                            e = (int)(unif(&sd) * E);
                            dup = 0;
                            for (int k2 = 0; k2 < k; k2++)
                                dup |= hid[t * K + k2] == e;
                        } while (dup);
                        hid[t * K + k] = e;
                        hw[t * K + k] = (float)unif(&sd);
                        int r = 0;
                        while (e >= c.expert_begin[r + 1])
                            r++;
                        if (r != g_rank) {
                            rslots++;
                            if (!remote[r]) pairs++;
                            remote[r] = true;
                        }
                    }
                }
                CU(cudaMemcpy(ids, hid, (size_t)T * K * 4, cudaMemcpyHostToDevice));
                CU(cudaMemcpy(w, hw, (size_t)T * K * 4, cudaMemcpyHostToDevice));
                free(hid), free(hw);
                const int R = T <= 512 ? 200 : T <= 2048 ? 60 : 20;
                times a = run_rounds(one, true, x, ids, w, eo, out, T, R, s);
                times b = run_rounds(two, false, x, ids, w, eo, out, T, R, s);
                if (getenv("MOESERVE_A2A_TRACE")) trace_rounds(one, x, ids, w, eo, out, T, s);
                const double bd = mean_over_ranks((double)pairs * rec);
                const double bp = mean_over_ranks((double)pairs * D * 2);
                const double bs = mean_over_ranks((double)rslots * D * 4);
                if (g_rank == 0)
                    printf("%6d | %8.1f %8.1f %9.1f | %7.2f %6.2f  %5.0f %5.0f %5.0f | %8.1f %8.1f "
                           "%9.1f | %5.2fx %5.2fx\n",
                           T, a.disp, a.part, a.slots, bd / 1e6, bp / 1e6, bd / (a.disp * 1e3),
                           bp / (a.part * 1e3), bs / (a.slots * 1e3), b.disp, b.part, b.slots,
                           b.disp / a.disp, b.part / a.part);
            }
            a2a_gpu_destroy(two);
            a2a_gpu_destroy(one);
        }
        cudaFree(x), cudaFree(ids), cudaFree(w), cudaFree(eo), cudaFree(out);
    }
    cudaStreamDestroy(s);
    MPI_Finalize();
    return 0;
}

#else

int main(void) {
    printf("bench_a2a_cuda: this build has no CUDA\n");
    return 0;
}

#endif
