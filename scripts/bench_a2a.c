/* All-to-all benchmark: dispatch + combine time of the shm and mpi transports (kernels/a2a.h)
 * against MPI_Alltoallv moving the same bytes, side by side in one run.
 *
 *   mpirun -np 2 build/bench_a2a [tokens per rank ...]   (make bench runs it at np 2 and 4)
 *
 * Setting: D = 2048, K = 8, E = 128 split evenly, uniform random routing (K distinct experts per
 * token), fp32 payloads, 1 to 4096 tokens per rank. One round = dispatch, then combine of the
 * per-slot outputs ([T, K, D] back home). The expert is not run inside the timed region: its
 * outputs are written once, after the first dispatch (routing is the same every round).
 *
 * Baseline, doing the same work with two-sided MPI: pack each token once per owner rank (x, local
 * ids, weights), MPI_Alltoall of the counts, MPI_Alltoallv, unpack into x/ids/w arrays; then pack
 * the owned slots' outputs per home rank, MPI_Alltoallv, unpack into out[t, k, :]. Packing and
 * unpacking are timed: the one-sided transports do the equivalent copies.
 *
 * Time of a round = the slowest rank's (MPI_Allreduce max after a barrier); the median over the
 * measured rounds after warm-up is printed. GB/s counts only bytes that cross ranks (records sent
 * to other ranks, slot outputs returned from other ranks), averaged over ranks, as notes/a2a.md
 * asks. All three methods must return bit-identical out; the run says so. */
#include "kernels/a2a.h"

#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { D = 2048, K = 8, E = 128, WARMUP = 3 };
static const int token_counts[] = {1, 4, 16, 64, 256, 1024, 4096};

static int g_rank, g_size;
static int g_begin[A2A_MAX_RANKS + 1];
static int32_t g_owner[E];

static uint64_t splitmix(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static void *xalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    if (!p) {
        fprintf(stderr, "bench_a2a rank %d: out of memory (%zu bytes)\n", g_rank, n);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    return p;
}

typedef struct {
    int T;
    float *x;     /* [T, D] */
    int32_t *ids; /* [T, K] */
    float *w;     /* [T, K] */
} inputs;

static void make_inputs(inputs *in, int T) {
    uint64_t s = 12345u + 1000003u * (uint64_t)g_rank + (uint64_t)T;
    in->T = T;
    in->x = xalloc((size_t)T * D * sizeof(float));
    in->ids = xalloc((size_t)T * K * sizeof(int32_t));
    in->w = xalloc((size_t)T * K * sizeof(float));
    for (size_t i = 0; i < (size_t)T * D; i++)
        in->x[i] = (float)(splitmix(&s) >> 40) / (float)(1 << 24) - 0.5f;
    for (int t = 0; t < T; t++) {
        int perm[E];
        for (int e = 0; e < E; e++)
            perm[e] = e;
        for (int k = 0; k < K; k++) {
            int j = k + (int)(splitmix(&s) % (uint64_t)(E - k));
            int tmp = perm[k];
            perm[k] = perm[j];
            perm[j] = tmp;
            in->ids[(size_t)t * K + k] = perm[k];
            in->w[(size_t)t * K + k] = (float)(splitmix(&s) >> 40) / (float)(1 << 24);
        }
    }
}

static void free_inputs(inputs *in) {
    free(in->x);
    free(in->ids);
    free(in->w);
}

/* The stand-in expert: writes only the slots this rank owns, as a real one would. */
static void fake_experts(float *expert_out, const float *x, const int32_t *ids, const float *w,
                         int n) {
    for (int i = 0; i < n; i++)
        for (int k = 0; k < K; k++) {
            int lid = ids[(size_t)i * K + k];
            if (lid < 0) continue;
            float *o = expert_out + ((size_t)i * K + k) * D;
            for (int d = 0; d < D; d++)
                o[d] = x[(size_t)i * D + d] * (float)(lid + 1) + w[(size_t)i * K + k];
        }
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}
static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* Per-rank cross-rank bytes of one round (dispatch records out + slot outputs back), averaged
 * over ranks. */
static double cross_bytes(const inputs *in) {
    double b = 0;
    for (int t = 0; t < in->T; t++) {
        bool seen[A2A_MAX_RANKS] = {false};
        for (int k = 0; k < K; k++) {
            int r = g_owner[in->ids[(size_t)t * K + k]];
            if (r == g_rank) continue;
            b += (double)D * 4; /* the slot's output comes back */
            if (!seen[r]) b += (double)(D + 2 * K) * 4;
            seen[r] = true;
        }
    }
    double sum = 0;
    MPI_Allreduce(&b, &sum, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    return sum / g_size;
}

/* One round's time: the slowest rank's, after a barrier. */
static double slowest(double dt) {
    double m = 0;
    MPI_Allreduce(&dt, &m, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    return m;
}

static int run_transport(a2a_transport tr, const inputs *in, int rounds, float *out,
                         double *median_us) {
    a2a_config c;
    memset(&c, 0, sizeof c);
    c.transport = tr;
    c.ep_size = g_size;
    c.rank = g_rank;
    c.max_tokens_per_rank = in->T;
    c.hidden = D;
    c.top_k = K;
    c.n_experts = E;
    memcpy(c.expert_begin, g_begin, sizeof g_begin);
    c.timeout_s = 120;
    char err[512];
    a2a *a = a2a_create(&c, MPI_COMM_WORLD, err, sizeof err);
    if (!a) {
        if (g_rank == 0) fprintf(stderr, "bench_a2a: %s\n", err);
        return -1;
    }
    double *times = xalloc((size_t)rounds * sizeof(double));
    float *expert_out = NULL;
    for (int r = 0; r < WARMUP + rounds; r++) {
        MPI_Barrier(MPI_COMM_WORLD);
        double t0 = MPI_Wtime();
        if (a2a_dispatch(a, in->x, in->ids, in->w, in->T, in->T, err, sizeof err) != 0) {
            fprintf(stderr, "bench_a2a: %s\n", err);
            MPI_Abort(MPI_COMM_WORLD, 1);
        }
        double t1 = MPI_Wtime();
        if (!expert_out) {
            a2a_received got = a2a_get_received(a);
            expert_out =
                xalloc((size_t)got.n * K * D * sizeof(float)); /* untouched pages stay free */
            fake_experts(expert_out, got.x, got.ids, got.w, got.n);
        }
        double t2 = MPI_Wtime();
        if (a2a_combine(a, expert_out, out, err, sizeof err) != 0) {
            fprintf(stderr, "bench_a2a: %s\n", err);
            MPI_Abort(MPI_COMM_WORLD, 1);
        }
        double dt = slowest((t1 - t0) + (MPI_Wtime() - t2));
        if (r >= WARMUP) times[r - WARMUP] = dt;
    }
    *median_us = 1e6 * median(times, rounds);
    free(times);
    free(expert_out);
    a2a_destroy(a);
    return 0;
}

/* The two-sided baseline; see the file comment. */
static void run_alltoallv(const inputs *in, int rounds, float *out, double *median_us) {
    const int P = g_size, T = in->T;
    const size_t rec = (size_t)(D + 2 * K) * 4, slot = (size_t)D * 4;
    /* Routing, as the a2a does it: the first slot per owner carries the token. */
    int *send_count = calloc((size_t)P, sizeof(int));
    int *slot_of = xalloc((size_t)T * K * sizeof(int)); /* slot at the owner of (t, k) */
    for (int t = 0; t < T; t++)
        for (int k = 0; k < K; k++) {
            int r = g_owner[in->ids[(size_t)t * K + k]], first = -1;
            for (int k2 = 0; k2 < k; k2++)
                if (g_owner[in->ids[(size_t)t * K + k2]] == r) first = k2;
            slot_of[(size_t)t * K + k] =
                first >= 0 ? slot_of[(size_t)t * K + first] : send_count[r]++;
        }
    int *sbeg = calloc((size_t)P + 1, sizeof(int)); /* tokens, prefix sums */
    for (int r = 0; r < P; r++)
        sbeg[r + 1] = sbeg[r] + send_count[r];
    int *tok_of = xalloc((size_t)sbeg[P] * sizeof(int) + 1); /* [target][slot] -> t */
    for (int t = 0; t < T; t++)
        for (int k = 0; k < K; k++) {
            int r = g_owner[in->ids[(size_t)t * K + k]];
            tok_of[sbeg[r] + slot_of[(size_t)t * K + k]] = t;
        }
    /* Slots this rank gets back from each owner, in (slot order, k) order. */
    int *cback = calloc((size_t)P, sizeof(int));
    for (size_t i = 0; i < (size_t)T * K; i++)
        // NOLINTNEXTLINE(clang-analyzer-core.uninitialized.ArraySubscript): ids[T * K] all set above
        cback[g_owner[in->ids[i]]]++;

    char *sendbuf = xalloc((size_t)sbeg[P] * rec);
    char *recvbuf = xalloc((size_t)P * T * rec);
    float *rx = xalloc((size_t)P * T * D * sizeof(float));
    int32_t *rids = xalloc((size_t)P * T * K * sizeof(int32_t));
    float *rw = xalloc((size_t)P * T * K * sizeof(float));
    float *csend = NULL, *crecv = xalloc((size_t)T * K * slot);
    float *expert_out = NULL;
    int sc[A2A_MAX_RANKS], sd[A2A_MAX_RANKS], rc[A2A_MAX_RANKS], rd[A2A_MAX_RANKS];
    int ntok[A2A_MAX_RANKS], cc[A2A_MAX_RANKS], cd[A2A_MAX_RANKS], crc[A2A_MAX_RANKS],
        crd[A2A_MAX_RANKS];
    double *times = xalloc((size_t)rounds * sizeof(double));

    for (int round = 0; round < WARMUP + rounds; round++) {
        MPI_Barrier(MPI_COMM_WORLD);
        double t0 = MPI_Wtime();
        /* dispatch: pack, counts, exchange, unpack */
        for (int r = 0; r < P; r++)
            for (int j = 0; j < send_count[r]; j++) {
                int t = tok_of[sbeg[r] + j];
                char *p = sendbuf + (size_t)(sbeg[r] + j) * rec;
                memcpy(p, in->x + (size_t)t * D, slot);
                int32_t *ids = (int32_t *)(p + slot);
                for (int k = 0; k < K; k++) {
                    int e = in->ids[(size_t)t * K + k];
                    ids[k] = g_owner[e] == r ? e - g_begin[r] : -1;
                }
                memcpy(ids + K, in->w + (size_t)t * K, (size_t)K * 4);
            }
        MPI_Alltoall(send_count, 1, MPI_INT, ntok, 1, MPI_INT, MPI_COMM_WORLD);
        int n = 0;
        for (int r = 0; r < P; r++) {
            sc[r] = send_count[r] * (int)rec;
            sd[r] = sbeg[r] * (int)rec;
            rc[r] = ntok[r] * (int)rec;
            rd[r] = n * (int)rec;
            n += ntok[r];
        }
        MPI_Alltoallv(sendbuf, sc, sd, MPI_BYTE, recvbuf, rc, rd, MPI_BYTE, MPI_COMM_WORLD);
        for (int i = 0; i < n; i++) {
            const char *p = recvbuf + (size_t)i * rec;
            memcpy(rx + (size_t)i * D, p, slot);
            memcpy(rids + (size_t)i * K, p + slot, (size_t)K * 4);
            memcpy(rw + (size_t)i * K, p + slot + (size_t)K * 4, (size_t)K * 4);
        }
        double t1 = MPI_Wtime();
        if (!expert_out) {
            expert_out = xalloc((size_t)n * K * slot);
            fake_experts(expert_out, rx, rids, rw, n);
            csend = xalloc((size_t)n * K * slot);
        }
        double t2 = MPI_Wtime();
        /* combine: pack owned slots per home rank, exchange, unpack into out[t, k, :] */
        size_t m = 0;
        int i = 0;
        for (int r = 0; r < P; r++) {
            cd[r] = (int)(m * slot);
            for (int j = 0; j < ntok[r]; j++, i++)
                for (int k = 0; k < K; k++)
                    if (rids[(size_t)i * K + k] >= 0)
                        memcpy(csend + m++ * D, expert_out + ((size_t)i * K + k) * D, slot);
            cc[r] = (int)(m * slot) - cd[r];
        }
        int off = 0;
        for (int r = 0; r < P; r++) {
            crc[r] = cback[r] * (int)slot;
            crd[r] = off;
            off += crc[r];
        }
        MPI_Alltoallv(csend, cc, cd, MPI_BYTE, crecv, crc, crd, MPI_BYTE, MPI_COMM_WORLD);
        for (int r = 0; r < P; r++) {
            const float *src = crecv + (size_t)crd[r] / 4;
            for (int j = 0; j < send_count[r]; j++) {
                int t = tok_of[sbeg[r] + j];
                for (int k = 0; k < K; k++)
                    if (g_owner[in->ids[(size_t)t * K + k]] == r) {
                        memcpy(out + ((size_t)t * K + k) * D, src, slot);
                        src += D;
                    }
            }
        }
        double dt = slowest((t1 - t0) + (MPI_Wtime() - t2));
        if (round >= WARMUP) times[round - WARMUP] = dt;
    }
    *median_us = 1e6 * median(times, rounds);
    free(times);
    free(send_count);
    free(slot_of);
    free(sbeg);
    free(tok_of);
    free(cback);
    free(sendbuf);
    free(recvbuf);
    free(rx);
    free(rids);
    free(rw);
    free(csend);
    free(crecv);
    free(expert_out);
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &g_size);
    a2a_split_experts(E, g_size, g_begin);
    for (int r = 0; r < g_size; r++)
        for (int e = g_begin[r]; e < g_begin[r + 1]; e++)
            g_owner[e] = r;
    if (g_rank == 0) {
        printf("all-to-all, %d ranks: D %d, K %d, E %d (uniform random routing), fp32; median of "
               "rounds after %d warm-up, slowest rank per round\n",
               g_size, D, K, E, WARMUP);
        printf("GB/s = bytes crossing ranks per rank (records out + slot outputs back) / time\n");
        printf("| tokens/rank | MB/rank | shm us | shm GB/s | mpi us | mpi GB/s | Alltoallv us | "
               "Alltoallv GB/s | shm vs Alltoallv |\n");
        printf("|---|---|---|---|---|---|---|---|---|\n");
        fflush(stdout);
    }
    /* Token counts: the command line's, else the standard list. */
    int counts[32], n_counts = 0;
    for (int i = 1; i < argc && n_counts < 32; i++)
        if (atoi(argv[i]) > 0) counts[n_counts++] = atoi(argv[i]);
    if (n_counts == 0)
        for (size_t i = 0; i < sizeof token_counts / sizeof token_counts[0]; i++)
            counts[n_counts++] = token_counts[i];
    int all_same = 1;
    for (int i = 0; i < n_counts; i++) {
        inputs in;
        make_inputs(&in, counts[i]);
        double bytes = cross_bytes(&in);
        /* About 1 GB of traffic per method and size, between 10 and 200 rounds. */
        int rounds = (int)(1e9 / (bytes + 1));
        rounds = rounds < 10 ? 10 : rounds > 200 ? 200 : rounds;
        size_t out_n = (size_t)in.T * K * D;
        float *out_shm = xalloc(out_n * 4), *out_mpi = xalloc(out_n * 4),
              *out_ref = xalloc(out_n * 4);
        double us_shm = 0, us_mpi = 0, us_ref = 0;
        int ok = run_transport(A2A_SHM, &in, rounds, out_shm, &us_shm) == 0;
        ok &= run_transport(A2A_MPI, &in, rounds, out_mpi, &us_mpi) == 0;
        run_alltoallv(&in, rounds, out_ref, &us_ref);
        int same = ok && memcmp(out_shm, out_ref, out_n * 4) == 0 &&
                   memcmp(out_mpi, out_ref, out_n * 4) == 0;
        int every = 0;
        MPI_Allreduce(&same, &every, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
        all_same &= every;
        if (g_rank == 0) {
            printf("| %d | %.3f | %.1f | %.2f | %.1f | %.2f | %.1f | %.2f | %.2fx |\n", in.T,
                   bytes / 1e6, us_shm, bytes / us_shm / 1e3, us_mpi, bytes / us_mpi / 1e3, us_ref,
                   bytes / us_ref / 1e3, us_ref / us_shm);
            fflush(stdout);
        }
        free(out_shm);
        free(out_mpi);
        free(out_ref);
        free_inputs(&in);
    }
    if (g_rank == 0)
        printf("outputs of shm, mpi and Alltoallv bit-identical: %s\n", all_same ? "yes" : "NO");
    MPI_Finalize();
    return all_same ? 0 : 1;
}
