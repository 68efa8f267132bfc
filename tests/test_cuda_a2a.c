/* Tests for the GPU all-to-all (kernels/cuda/a2a_nvlink.cu, kernels/cuda/a2a_nccl.cu), an MPI
 * program for the GPU machine: `mpirun --allow-run-as-root -np 2 build/tests/test_cuda_a2a`
 * (each rank on GPU rank % device count; run alone it is one rank). Without CUDA, or without a
 * device, it prints "skipped" and "0 passed, 0 failed", so the CPU `make test` passes over it.
 * Only rank 0 prints the summary, with every rank's counts summed.
 *
 * The reference is the CPU shm transport (kernels/cpu/a2a_shm.c), created in the same processes
 * over the same communicator with the same config, given the same inputs each round. Compared
 * bit for bit (memcmp), for every payload (f32, bf16, fp8, nvfp4) and both GPU transports
 * (nvlink_one_sided, nccl): the received count, rows x (after the payload's round trip), local
 * ids and weights; the combined out[T, K, D] (slots form); and the partial form's out[T, D]
 * against the sum written here from the shm slots: per rank, the rank's slots w * out in slot
 * order in fp32, rounded to BF16, then the ranks' partials added in rank order.
 *
 * Rounds: random routing with T random in [0, max] on each rank (runtime_max = the max, different
 * every round), skewed (every slot to rank 0's experts), T = 0 on one rank, T = 0 everywhere (with
 * runtime_max 0 and 5), uneven expert splits, D = 144 (a partial FP8 group), and runtime_max
 * up to 8500 (chunks of 1 to 34 rows: one row per block, several, a warp per row, more rows than
 * a block takes at once). Then: a dispatch + combine captured in a CUDA graph
 * and replayed on new inputs (one-sided); a runtime_max that differs between ranks (every rank
 * reports it); 10,000 rounds without a hang (every 1000th compared with shm); and a rank that
 * skips a round (the others report it by rank within the timeout instead of hanging). */
#include "tests/check.h"

#include <limits.h>
#include <mpi.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef MOESERVE_CUDA
#include "common/tensor.h"
#include "kernels/a2a.h"
#include "kernels/cuda/a2a_cuda.h"

#include <cuda_runtime.h>
#include <time.h>

static int g_rank, g_size;
static cudaStream_t g_stream;

static void ok(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void ok(const char *fmt, ...) {
    if (g_rank != 0) return;
    va_list ap;
    va_start(ap, fmt);
    printf("ok   ");
    vprintf(fmt, ap);
    printf("\n");
    va_end(ap);
}

#define CU(call)                                                                                   \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess) {                                                                   \
            fprintf(stderr, "rank %d: %s failed at %s:%d: %s\n", g_rank, #call, __FILE__,          \
                    __LINE__, cudaGetErrorString(e_));                                             \
            MPI_Abort(MPI_COMM_WORLD, 1);                                                          \
        }                                                                                          \
    } while (0)

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

/* ---- deterministic inputs ---- */

static uint64_t mix(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}
static double unif(uint64_t *s) { return (double)((*s = mix(*s)) >> 11) * 0x1.0p-53; }

/* Values across a few binades, both signs, so the FP8 / NVFP4 scales and subnormals all act. */
static float value(uint64_t *s) {
    double m = unif(s) * 2.0 - 1.0;
    int e = (int)(unif(s) * 8.0) - 4;
    return (float)ldexp(m, e);
}

enum { ROUTE_RANDOM, ROUTE_SKEWED };

static void make_inputs(const a2a_config *c, int T, int route, uint64_t seed, float *x,
                        int32_t *ids, float *w) {
    uint64_t s = seed;
    const int D = c->hidden, K = c->top_k;
    const int lo = route == ROUTE_SKEWED ? c->expert_begin[0] : 0;
    const int n = route == ROUTE_SKEWED ? c->expert_begin[1] - c->expert_begin[0] : c->n_experts;
    for (int t = 0; t < T; t++) {
        for (int d = 0; d < D; d++)
            x[(size_t)t * D + d] = value(&s);
        for (int k = 0; k < K; k++) {
            int e, dup;
            do { /* K distinct experts */
                e = lo + (int)(unif(&s) * n);
                dup = 0;
                for (int k2 = 0; k2 < k; k2++)
                    dup |= ids[(size_t)t * K + k2] == e;
            } while (dup);
            ids[(size_t)t * K + k] = e;
            w[(size_t)t * K + k] = (float)(0.05 + unif(&s));
        }
    }
}

/* ---- one object pair: the GPU transport and its shm reference ---- */

typedef struct {
    a2a_config cfg;
    a2a *cpu;
    a2a_gpu *gpu;
    const char *name;
    float *x, *w, *eo, *out_cpu, *out_gpu, *rx, *rw, *ref;
    int32_t *ids, *rids;
    float *d_x, *d_w, *d_eo, *d_out;
    int32_t *d_ids;
} pair;

static a2a_config make_cfg(a2a_transport tr, a2a_payload pl, int M, int D, int K, int E) {
    a2a_config c;
    memset(&c, 0, sizeof c);
    c.transport = tr;
    c.ep_size = g_size;
    c.rank = g_rank;
    c.max_tokens_per_rank = M;
    c.hidden = D;
    c.top_k = K;
    c.n_experts = E;
    c.payload = pl;
    c.timeout_s = 20;
    a2a_split_experts(E, g_size, c.expert_begin);
    return c;
}

/* Once: which way the one-sided segment is shared; with MOESERVE_A2A_MEM naming one, that one. */
static void segment_kind_check(const a2a_gpu *g) {
    static bool done;
    if (done || !g) return;
    done = true;
    const char *want = getenv("MOESERVE_A2A_MEM"), *got = a2a_gpu_segment_kind(g);
    if (g_rank == 0) printf("nvlink_one_sided: the segment is shared by %s\n", got);
    if (want && *want && strcmp(want, "auto") != 0)
        CHECK(strcmp(want, got) == 0, "MOESERVE_A2A_MEM=%s, but the segment is shared by %s", want,
              got);
}

static bool pair_open(pair *P, a2a_config cfg) {
    memset(P, 0, sizeof *P);
    P->cfg = cfg;
    char err[512];
    a2a_config cc = cfg;
    cc.transport = A2A_SHM;
    P->cpu = a2a_create(&cc, MPI_COMM_WORLD, err, sizeof err);
    CHECK(P->cpu != NULL, "shm: %s", err);
    P->gpu = a2a_gpu_create(&cfg, MPI_COMM_WORLD, err, sizeof err);
    CHECK(P->gpu != NULL, "%s: %s", a2a_transport_name(cfg.transport), err);
    if (!P->cpu || !P->gpu) return false;
    if (cfg.transport == A2A_NVLINK_ONE_SIDED) segment_kind_check(P->gpu);
    const size_t M = (size_t)cfg.max_tokens_per_rank, D = (size_t)cfg.hidden, K = (size_t)cfg.top_k,
                 ep = (size_t)cfg.ep_size;
    P->x = malloc(M * D * 4);
    P->ids = malloc(M * K * 4);
    P->w = malloc(M * K * 4);
    P->eo = malloc(ep * M * K * D * 4);
    P->out_cpu = malloc(M * K * D * 4);
    P->out_gpu = malloc(M * K * D * 4);
    P->ref = malloc(M * D * 4);
    P->rx = malloc(ep * M * D * 4);
    P->rids = malloc(ep * M * K * 4);
    P->rw = malloc(ep * M * K * 4);
    CU(cudaMalloc((void **)&P->d_x, M * D * 4));
    CU(cudaMalloc((void **)&P->d_ids, M * K * 4));
    CU(cudaMalloc((void **)&P->d_w, M * K * 4));
    CU(cudaMalloc((void **)&P->d_eo, ep * M * K * D * 4));
    CU(cudaMalloc((void **)&P->d_out, M * K * D * 4));
    /* expert outputs: random rows, the same for both transports (rows are received in the same
     * order); NaN in slots nobody should read */
    uint64_t s = 1234 + (uint64_t)g_rank;
    for (size_t i = 0; i < ep * M * K * D; i++)
        P->eo[i] = value(&s);
    CU(cudaMemcpy(P->d_eo, P->eo, ep * M * K * D * 4, cudaMemcpyHostToDevice));
    CU(cudaDeviceSynchronize()); /* landed before g_stream (non-blocking) reads it */
    return true;
}

static void pair_close(pair *P) {
    if (P->gpu) a2a_gpu_destroy(P->gpu);
    if (P->cpu) a2a_destroy(P->cpu);
    free(P->x), free(P->ids), free(P->w), free(P->eo), free(P->out_cpu), free(P->out_gpu);
    free(P->ref), free(P->rx), free(P->rids), free(P->rw);
    cudaFree(P->d_x), cudaFree(P->d_ids), cudaFree(P->d_w), cudaFree(P->d_eo), cudaFree(P->d_out);
}

/* First differing float of two arrays, or -1. */
static long first_diff(const float *a, const float *b, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (memcmp(a + i, b + i, 4) != 0) return (long)i;
    return -1;
}

/* The partial form's expected out[T, D] from the exact slots. */
static void partial_ref(const pair *P, int T) {
    const int D = P->cfg.hidden, K = P->cfg.top_k, ep = P->cfg.ep_size;
    int owner_k[64];
    for (int t = 0; t < T; t++) {
        for (int k = 0; k < K; k++) {
            int e = P->ids[(size_t)t * K + k], r = 0;
            while (e >= P->cfg.expert_begin[r + 1])
                r++;
            owner_k[k] = r;
        }
        for (int d = 0; d < D; d++) {
            float sum = 0.0f;
            for (int r = 0; r < ep; r++) {
                float acc = 0.0f;
                int any = 0;
                for (int k = 0; k < K; k++) {
                    if (owner_k[k] != r) continue;
                    float prod = P->w[(size_t)t * K + k] * P->out_cpu[((size_t)t * K + k) * D + d];
                    acc = acc + prod;
                    any = 1;
                }
                if (any) sum = sum + bf16_to_f32(f32_to_bf16(acc));
            }
            P->ref[(size_t)t * D + d] = sum;
        }
    }
}

/* Run the GPU round on inputs already in P->x/ids/w (and on the device), the shm round too, and
 * compare. form 0: slots, 1: partial. Returns false when something failed. */
static bool compare_round(pair *P, int T, int rm, int form, bool gpu_already_ran,
                          const char *label) {
    char err[512];
    const int D = P->cfg.hidden, K = P->cfg.top_k;
    bool good = true;
    int rc = a2a_dispatch(P->cpu, P->x, P->ids, P->w, T, rm, err, sizeof err);
    CHECK(rc == 0, "%s: shm dispatch: %s", label, err);
    if (rc != 0) return false;
    if (!gpu_already_ran) {
        rc = a2a_gpu_dispatch(P->gpu, P->d_x, P->d_ids, P->d_w, T, rm, g_stream, err, sizeof err);
        if (rc == 0) rc = a2a_gpu_check(P->gpu, err, sizeof err);
        CHECK(rc == 0, "%s: gpu dispatch: %s", label, err);
        if (rc != 0) return false;
    }
    a2a_received r = a2a_get_received(P->cpu);
    a2a_gpu_received g = a2a_gpu_get_received(P->gpu);
    int n = -1;
    CU(cudaMemcpy(&n, g.n, 4, cudaMemcpyDeviceToHost));
    CHECK(n == r.n, "%s: received %d rows, shm %d", label, n, r.n);
    if (n != r.n) good = false;
    if (good && n > 0) {
        CU(cudaMemcpy(P->rx, g.x, (size_t)n * D * 4, cudaMemcpyDeviceToHost));
        CU(cudaMemcpy(P->rids, g.ids, (size_t)n * K * 4, cudaMemcpyDeviceToHost));
        CU(cudaMemcpy(P->rw, g.w, (size_t)n * K * 4, cudaMemcpyDeviceToHost));
        long d = first_diff(P->rx, r.x, (size_t)n * D);
        CHECK(d < 0, "%s: received x differs at row %ld col %ld: %.9g, shm %.9g", label, d / D,
              d % D, d >= 0 ? P->rx[d] : 0.0, d >= 0 ? r.x[d] : 0.0);
        int di = memcmp(P->rids, r.ids, (size_t)n * K * 4);
        CHECK(di == 0, "%s: received ids differ", label);
        int dw = memcmp(P->rw, r.w, (size_t)n * K * 4);
        CHECK(dw == 0, "%s: received weights differ", label);
        if (d >= 0 || di || dw) good = false;
    }
    rc = a2a_combine(P->cpu, P->eo, P->out_cpu, err, sizeof err);
    CHECK(rc == 0, "%s: shm combine: %s", label, err);
    if (rc != 0) return false;
    if (!gpu_already_ran) {
        rc = form ? a2a_gpu_combine_partial(P->gpu, P->d_eo, P->d_out, g_stream, err, sizeof err)
                  : a2a_gpu_combine(P->gpu, P->d_eo, P->d_out, g_stream, err, sizeof err);
        if (rc == 0) rc = a2a_gpu_check(P->gpu, err, sizeof err);
        CHECK(rc == 0, "%s: gpu combine: %s", label, err);
        if (rc != 0) return false;
    }
    if (T > 0) {
        size_t len = form ? (size_t)T * D : (size_t)T * K * D;
        CU(cudaMemcpy(P->out_gpu, P->d_out, len * 4, cudaMemcpyDeviceToHost));
        const float *want = P->out_cpu;
        if (form) {
            partial_ref(P, T);
            want = P->ref;
        }
        long d = first_diff(P->out_gpu, want, len);
        CHECK(d < 0, "%s: %s out differs at %ld: %.9g, expected %.9g", label,
              form ? "partial" : "slots", d, d >= 0 ? P->out_gpu[d] : 0.0, d >= 0 ? want[d] : 0.0);
        if (d >= 0) good = false;
    }
    return good;
}

/* A round whose T per rank comes from a seed every rank shares (so every rank knows the max). */
static bool random_round(pair *P, int route, int form, uint64_t seed, int force_T, int zero_rank,
                         const char *label) {
    const int M = P->cfg.max_tokens_per_rank;
    int Ts[256], rm = 0;
    uint64_t s = seed;
    for (int r = 0; r < g_size; r++) {
        Ts[r] = force_T >= 0 ? force_T : (int)(unif(&s) * (M + 1));
        if (r == zero_rank) Ts[r] = 0;
        if (Ts[r] > rm) rm = Ts[r];
    }
    const int T = Ts[g_rank];
    make_inputs(&P->cfg, T, route, seed * 977 + (uint64_t)g_rank, P->x, P->ids, P->w);
    const size_t D = (size_t)P->cfg.hidden, K = (size_t)P->cfg.top_k;
    if (T > 0) {
        CU(cudaMemcpy(P->d_x, P->x, T * D * 4, cudaMemcpyHostToDevice));
        CU(cudaMemcpy(P->d_ids, P->ids, T * K * 4, cudaMemcpyHostToDevice));
        CU(cudaMemcpy(P->d_w, P->w, T * K * 4, cudaMemcpyHostToDevice));
        CU(cudaDeviceSynchronize()); /* landed before g_stream (non-blocking) reads it */
    }
    return compare_round(P, T, rm, form, false, label);
}

static const a2a_payload payloads[] = {A2A_PAYLOAD_F32, A2A_PAYLOAD_BF16, A2A_PAYLOAD_FP8,
                                       A2A_PAYLOAD_NVFP4};

static void test_rounds(a2a_transport tr) {
    const char *tn = a2a_transport_name(tr);
    struct {
        int M, D, K, E, rounds;
    } shapes[] = {{64, 256, 8, 64, 6},
                  {40, 144, 6, 11, 4}, /* an uneven split, K not dividing 32 */
                  {600, 2048, 8, 256, 3},
                  {1100, 256, 8, 64, 2},
                  {8500, 64, 4, 16, 2}};
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++)
        for (size_t pi = 0; pi < 4; pi++) {
            pair P;
            a2a_config c =
                make_cfg(tr, payloads[pi], shapes[si].M, shapes[si].D, shapes[si].K, shapes[si].E);
            bool good = pair_open(&P, c);
            char label[160];
            int n_ok = 0, n = 0;
            for (int i = 0; good && i < shapes[si].rounds; i++, n++) {
                snprintf(label, sizeof label, "%s %s D=%d random round %d", tn,
                         a2a_payload_name(c.payload), c.hidden, i);
                /* round 0 full everywhere: the largest chunks (rows per chunk flag) */
                n_ok += random_round(&P, ROUTE_RANDOM, i & 1, 100 + 31 * i + si,
                                     i ? -1 : c.max_tokens_per_rank, -1, label);
            }
            if (good && si == 0) {
                for (int form = 0; form < 2; form++, n += 5) {
                    snprintf(label, sizeof label, "%s %s skewed form %d", tn,
                             a2a_payload_name(c.payload), form);
                    n_ok += random_round(&P, ROUTE_SKEWED, form, 7 + form, -1, -1, label);
                    snprintf(label, sizeof label, "%s %s last rank empty form %d", tn,
                             a2a_payload_name(c.payload), form);
                    n_ok += random_round(&P, ROUTE_RANDOM, form, 9 + form, c.max_tokens_per_rank,
                                         g_size - 1, label);
                    snprintf(label, sizeof label, "%s %s all empty, runtime_max 0 form %d", tn,
                             a2a_payload_name(c.payload), form);
                    n_ok += random_round(&P, ROUTE_RANDOM, form, 11, 0, -1, label);
                    snprintf(label, sizeof label, "%s %s all empty, runtime_max 5 form %d", tn,
                             a2a_payload_name(c.payload), form);
                    n_ok += compare_round(&P, 0, 5, form, false, label);
                    snprintf(label, sizeof label, "%s %s full form %d", tn,
                             a2a_payload_name(c.payload), form);
                    n_ok +=
                        random_round(&P, ROUTE_RANDOM, form, 13, c.max_tokens_per_rank, -1, label);
                }
            }
            if (good && n_ok == n)
                ok("%s %s M=%d D=%d K=%d E=%d: %d rounds equal shm bit for bit%s", tn,
                   a2a_payload_name(c.payload), c.max_tokens_per_rank, c.hidden, c.top_k,
                   c.n_experts, n,
                   si == 0 ? " (random, skewed, empty, full; slots and partial)" : "");
            pair_close(&P);
        }
}

static void test_graph(void) {
    pair P;
    a2a_config c = make_cfg(A2A_NVLINK_ONE_SIDED, A2A_PAYLOAD_BF16, 64, 256, 8, 64);
    if (!pair_open(&P, c)) {
        pair_close(&P);
        return;
    }
    char err[512];
    const int T = 20 + 7 * g_rank, rm = 20 + 7 * (g_size - 1);
    cudaGraph_t graph = NULL;
    cudaGraphExec_t exec = NULL;
    CU(cudaStreamBeginCapture(g_stream, cudaStreamCaptureModeRelaxed));
    int rc = a2a_gpu_dispatch(P.gpu, P.d_x, P.d_ids, P.d_w, T, rm, g_stream, err, sizeof err);
    if (rc == 0) rc = a2a_gpu_combine(P.gpu, P.d_eo, P.d_out, g_stream, err, sizeof err);
    cudaError_t e = cudaStreamEndCapture(g_stream, &graph);
    CHECK(rc == 0 && e == cudaSuccess, "graph capture: %s / %s", err, cudaGetErrorString(e));
    if (rc != 0 || e != cudaSuccess) {
        pair_close(&P);
        return;
    }
    CU(cudaGraphInstantiate(&exec, graph, 0));
    int good = 0;
    for (int rep = 0; rep < 4; rep++) {
        make_inputs(&c, T, ROUTE_RANDOM, 555 + 10 * rep + g_rank, P.x, P.ids, P.w);
        CU(cudaMemcpy(P.d_x, P.x, (size_t)T * c.hidden * 4, cudaMemcpyHostToDevice));
        CU(cudaMemcpy(P.d_ids, P.ids, (size_t)T * c.top_k * 4, cudaMemcpyHostToDevice));
        CU(cudaMemcpy(P.d_w, P.w, (size_t)T * c.top_k * 4, cudaMemcpyHostToDevice));
        CU(cudaDeviceSynchronize()); /* landed before g_stream (non-blocking) reads it */
        CU(cudaGraphLaunch(exec, g_stream));
        rc = a2a_gpu_check(P.gpu, err, sizeof err);
        CHECK(rc == 0, "graph replay %d: %s", rep, err);
        char label[64];
        snprintf(label, sizeof label, "graph replay %d", rep);
        if (rc == 0) good += compare_round(&P, T, rm, 0, true, label);
    }
    if (good == 4)
        ok("nvlink_one_sided: dispatch + combine captured in a CUDA graph, 4 replays on new inputs "
           "equal shm");
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    pair_close(&P);
}

static void test_mismatch(a2a_transport tr) {
    char err[512] = "";
    a2a_config c = make_cfg(tr, A2A_PAYLOAD_BF16, 16, 64, 2, 8);
    a2a_gpu *a = a2a_gpu_create(&c, MPI_COMM_WORLD, err, sizeof err);
    CHECK(a != NULL, "create: %s", err);
    if (!a) return;
    float *x;
    int32_t *ids;
    float *w;
    CU(cudaMalloc((void **)&x, 16 * 64 * 4));
    CU(cudaMalloc((void **)&ids, 16 * 2 * 4));
    CU(cudaMalloc((void **)&w, 16 * 2 * 4));
    CU(cudaMemset(ids, 0, 16 * 2 * 4));
    CU(cudaMemset(x, 0, 16 * 64 * 4));
    CU(cudaMemset(w, 0, 16 * 2 * 4));
    CU(cudaDeviceSynchronize()); /* landed before g_stream (non-blocking) reads it */
    const int rm = g_rank == 0 ? 4 : 5;
    int rc = a2a_gpu_dispatch(a, x, ids, w, 3, rm, g_stream, err, sizeof err);
    if (rc == 0) rc = a2a_gpu_check(a, err, sizeof err);
    const bool named = rc != 0 && strstr(err, "runtime_max") != NULL;
    CHECK(named, "%s: runtime_max 4 on rank 0 and 5 elsewhere: rc %d, message: %s",
          a2a_transport_name(tr), rc, err);
    int all = 0, mine = named;
    MPI_Allreduce(&mine, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    if (g_rank == 0 && all) printf("     rank 0 says: %s\n", err);
    if (all)
        ok("%s: a runtime_max that differs between ranks is reported on every rank",
           a2a_transport_name(tr));
    a2a_gpu_destroy(a);
    cudaFree(x), cudaFree(ids), cudaFree(w);
}

static void test_many_rounds(a2a_transport tr, int n_rounds) {
    pair P;
    a2a_config c = make_cfg(tr, A2A_PAYLOAD_BF16, 32, 64, 4, 16);
    if (!pair_open(&P, c)) {
        pair_close(&P);
        return;
    }
    char err[512], label[96];
    /* static inputs of the full size; T and runtime_max change every round */
    make_inputs(&c, 32, ROUTE_RANDOM, 4242 + g_rank, P.x, P.ids, P.w);
    CU(cudaMemcpy(P.d_x, P.x, 32 * 64 * 4, cudaMemcpyHostToDevice));
    CU(cudaMemcpy(P.d_ids, P.ids, 32 * 4 * 4, cudaMemcpyHostToDevice));
    CU(cudaMemcpy(P.d_w, P.w, 32 * 4 * 4, cudaMemcpyHostToDevice));
    CU(cudaDeviceSynchronize()); /* landed before g_stream (non-blocking) reads it */
    double t0 = now_s();
    int failed = 0, compared = 0;
    for (int i = 0; i < n_rounds && !failed; i++) {
        uint64_t s = 77 + (uint64_t)i;
        int rm = 0, T = 0;
        for (int r = 0; r < g_size; r++) {
            int Tr = (int)(unif(&s) * 33);
            if (r == g_rank) T = Tr;
            if (Tr > rm) rm = Tr;
        }
        if (i % 1000 == 999) {
            snprintf(label, sizeof label, "%s round %d of %d", a2a_transport_name(tr), i, n_rounds);
            compared++;
            if (!compare_round(&P, T, rm, (i / 1000) & 1, false, label)) failed = 1;
            continue;
        }
        int rc = a2a_gpu_dispatch(P.gpu, P.d_x, P.d_ids, P.d_w, T, rm, g_stream, err, sizeof err);
        if (rc == 0)
            rc = (i & 1)
                     ? a2a_gpu_combine_partial(P.gpu, P.d_eo, P.d_out, g_stream, err, sizeof err)
                     : a2a_gpu_combine(P.gpu, P.d_eo, P.d_out, g_stream, err, sizeof err);
        if (rc == 0 && i % 1000 == 500) rc = a2a_gpu_check(P.gpu, err, sizeof err);
        CHECK(rc == 0, "%s round %d: %s", a2a_transport_name(tr), i, err);
        if (rc != 0) failed = 1;
    }
    int rc = a2a_gpu_check(P.gpu, err, sizeof err);
    CHECK(rc == 0, "%s after the rounds: %s", a2a_transport_name(tr), err);
    double dt = now_s() - t0;
    if (!failed && rc == 0)
        ok("%s: %d rounds (T and runtime_max new each round) without a hang in %.2f s, %d of them "
           "equal shm",
           a2a_transport_name(tr), n_rounds, dt, compared);
    pair_close(&P);
}

/* The zeroed inputs of a round of 16 tokens (D 64, K 2) that the failure tests dispatch. */
typedef struct {
    float *x, *w;
    int32_t *ids;
} zero_round;

static zero_round zero_round_alloc(void) {
    zero_round z;
    CU(cudaMalloc((void **)&z.x, 16 * 64 * 4));
    CU(cudaMalloc((void **)&z.ids, 16 * 2 * 4));
    CU(cudaMalloc((void **)&z.w, 16 * 2 * 4));
    CU(cudaMemset(z.ids, 0, 16 * 2 * 4));
    CU(cudaMemset(z.x, 0, 16 * 64 * 4));
    CU(cudaMemset(z.w, 0, 16 * 2 * 4));
    CU(cudaDeviceSynchronize()); /* landed before g_stream (non-blocking) reads it */
    return z;
}

static void zero_round_free(zero_round *z) {
    cudaFree(z->x);
    cudaFree(z->ids);
    cudaFree(z->w);
}

static void test_timeout(void) {
    char err[512] = "";
    a2a_config c = make_cfg(A2A_NVLINK_ONE_SIDED, A2A_PAYLOAD_BF16, 16, 64, 2, 8);
    c.timeout_s = 2;
    a2a_gpu *a = a2a_gpu_create(&c, MPI_COMM_WORLD, err, sizeof err);
    CHECK(a != NULL, "create: %s", err);
    if (!a) return;
    zero_round z = zero_round_alloc();
    float *x = z.x, *w = z.w;
    int32_t *ids = z.ids;
    const int skipper = g_size - 1;
    if (g_rank != skipper) {
        double t0 = now_s();
        int rc = a2a_gpu_dispatch(a, x, ids, w, 4, 4, g_stream, err, sizeof err);
        if (rc == 0) rc = a2a_gpu_check(a, err, sizeof err);
        double dt = now_s() - t0;
        char want[64];
        snprintf(want, sizeof want, "rank %d did not arrive", skipper);
        CHECK(rc != 0 && strstr(err, want) != NULL && dt < c.timeout_s + 3,
              "a skipped round: rc %d after %.2f s, message: %s", rc, dt, err);
        if (g_rank == 0 && rc != 0 && strstr(err, want)) {
            printf("     rank 0 says after %.2f s: %s\n", dt, err);
            ok("nvlink_one_sided: a rank that skips a round is named within the %g s timeout",
               c.timeout_s);
        }
        /* and the object refuses further rounds */
        rc = a2a_gpu_dispatch(a, x, ids, w, 4, 4, g_stream, err, sizeof err);
        CHECK(rc != 0, "dispatch after a failed round must be refused");
    }
    MPI_Barrier(MPI_COMM_WORLD);
    a2a_gpu_destroy(a);
    zero_round_free(&z);
}

/* The config's check_peers, on the ranks that wait: the skipper "has exited" from 0.3 s after
 * the round began. The watch thread asks it every 100 ms, and the kernels' waits leave on its
 * word: the round fails within about 0.5 s naming the skipper, far inside timeout_s (30 s). */
typedef struct {
    long long t0_us; /* when the round began; LLONG_MAX before */
    int skipper, calls;
} gone_watch;

static int gone_check(void *ctx, char *msg, size_t len) {
    gone_watch *w = (gone_watch *)ctx;
    __atomic_add_fetch(&w->calls, 1, __ATOMIC_RELAXED);
    long long t0 = __atomic_load_n(&w->t0_us, __ATOMIC_ACQUIRE);
    if (t0 == LLONG_MAX || now_s() * 1e6 - (double)t0 < 3e5) return 0;
    snprintf(msg, len, "rank %d (pid 4242 on testhost) has exited", w->skipper);
    return -1;
}

static void test_peer_gone(void) {
    char err[512] = "";
    gone_watch w = {LLONG_MAX, g_size - 1, 0};
    a2a_config c = make_cfg(A2A_NVLINK_ONE_SIDED, A2A_PAYLOAD_BF16, 16, 64, 2, 8);
    c.timeout_s = 30;
    if (g_rank != w.skipper) {
        c.check_peers = gone_check;
        c.check_ctx = &w;
    }
    a2a_gpu *a = a2a_gpu_create(&c, MPI_COMM_WORLD, err, sizeof err);
    CHECK(a != NULL, "create: %s", err);
    if (!a) return;
    zero_round z = zero_round_alloc();
    float *x = z.x, *wt = z.w;
    int32_t *ids = z.ids;
    if (g_rank != w.skipper) {
        double t0 = now_s();
        __atomic_store_n(&w.t0_us, (long long)(t0 * 1e6), __ATOMIC_RELEASE);
        int rc = a2a_gpu_dispatch(a, x, ids, wt, 4, 4, g_stream, err, sizeof err);
        if (rc == 0) rc = a2a_gpu_check(a, err, sizeof err);
        double dt = now_s() - t0;
        char want[64];
        snprintf(want, sizeof want, "rank %d (pid 4242 on testhost) has exited", w.skipper);
        CHECK(rc != 0 && strstr(err, want) != NULL && dt > 0.25 && dt < 2.0,
              "a peer reported gone: rc %d after %.2f s (%d checks), message: %s", rc, dt,
              w.calls, err);
        if (g_rank == 0 && rc != 0 && strstr(err, want)) {
            printf("     rank 0 says after %.2f s: %s\n", dt, err);
            ok("nvlink_one_sided: a peer that check_peers reports gone ends the wait in %.2f s "
               "(timeout 30 s)",
               dt);
        }
    }
    MPI_Barrier(MPI_COMM_WORLD);
    a2a_gpu_destroy(a);
    zero_round_free(&z);
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &g_size);
    int n_dev = 0;
    if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev == 0) {
        if (g_rank == 0) printf("skipped: no CUDA device\n0 passed, 0 failed\n");
        MPI_Finalize();
        return 0;
    }
    CU(cudaSetDevice(g_rank % n_dev));
    CU(cudaStreamCreateWithFlags(&g_stream, cudaStreamNonBlocking));
    if (g_rank == 0) {
        struct cudaDeviceProp prop;
        cudaGetDeviceProperties(&prop, 0);
        printf("%d ranks on %d x %s\n", g_size, n_dev, prop.name);
    }
    const char *only = argc > 1 ? argv[1] : "";
    if (!*only || strcmp(only, "rounds") == 0) {
        test_rounds(A2A_NVLINK_ONE_SIDED);
        test_rounds(A2A_NCCL);
    }
    if (!*only || strcmp(only, "graph") == 0) test_graph();
    if (g_size > 1 && (!*only || strcmp(only, "mismatch") == 0)) {
        test_mismatch(A2A_NVLINK_ONE_SIDED);
        test_mismatch(A2A_NCCL);
    }
    if (!*only || strcmp(only, "long") == 0) {
        test_many_rounds(A2A_NVLINK_ONE_SIDED, 10000);
        test_many_rounds(A2A_NCCL, 2000);
    }
    if (g_size > 1 && (!*only || strcmp(only, "timeout") == 0)) test_timeout();
    if (g_size > 1 && (!*only || strcmp(only, "timeout") == 0)) test_peer_gone();
    int mine[2] = {check_passed, check_failed}, sum[2] = {0, 0};
    MPI_Allreduce(mine, sum, 2, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    if (g_rank == 0) printf("%d passed, %d failed\n", sum[0], sum[1]);
    cudaStreamDestroy(g_stream);
    MPI_Finalize();
    return sum[1] ? 1 : 0;
}

#else

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    if (rank == 0)
        printf("skipped: this build has no CUDA (nvcc not found, or make CUDA=0)\n0 passed, 0 "
               "failed\n");
    MPI_Finalize();
    return 0;
}

#endif
