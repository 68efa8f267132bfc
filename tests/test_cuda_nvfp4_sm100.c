/* The NVFP4 x NVFP4 grouped GEMM on Blackwell's block-scaled tensor cores
 * (kernels/cuda/nvfp4_sm100.cu, sm_100a) against the CPU, and its speed against cuBLASLt's NVFP4
 * GEMM and the device copy rate in the same run; and the activations' kernels of the same experts
 * (kernels/cuda/nvfp4_act.cu: rows quantized into the GEMM's blocks, silu * up quantized, the rows
 * scattered back) against kernels/cpu/quant.c, bit for bit. The activations' checks run on any
 * GPU; the GEMM's only on compute capability 10.0 (B200, GB200), which no run has had yet.
 * Without a GPU it prints "skipped: <reason>" and "0 passed, 0 failed".
 *
 * Reference: out[r, n] = sa[r] sb[e] sum_k (e2m1(a) e4m3(sfa)) (e2m1(b) e4m3(sfb)) in double on
 * the decoded codes (kernels/quant.h). Bound per output: |got - want| <= 2^-10 S with S the same
 * sum of absolute values (the tensor core's sums need not keep fp32's bits), and the issue's
 * figure beside it: max |got - want| over the rms of want, at most 1e-2. Outputs are poisoned with
 * NaN first: a valid row the kernel never wrote fails, and so does any write to a row past a
 * block's valid rows. Shapes: uneven experts (empty ones, one row, 128 and 130 rows, a block with
 * no rows, a block of no expert), K of one stage and of several, N of one and two tiles, and
 * Qwen3-30B-A3B's and DeepSeek-V3's expert shapes.
 *
 * Figures: 8 experts x 4096 rows, N 1536 and 4096, K 2048 and 7168, TFLOP/s against cuBLASLt's
 * NVFP4 GEMM of the same total rows; 8 experts x 1 to 64 rows (decode sizes): weight bytes
 * (codes and scales) per second against the 1 GiB device copy rate. */
#include <stdio.h>

#ifdef MOESERVE_CUDA

#include <cublasLt.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/quant.h"
#include "tests/check.h"
#include "tests/cublaslt_time.h"

cudaStream_t cuda_stream(void); /* kernels/cuda/ops_cuda.cu */

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static double urand(void) { /* [0, 1) */
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (double)(rng >> 11) / 9007199254740992.0;
}

static void *dev_copy(const void *h, size_t bytes) {
    void *d = NULL;
    MS_ASSERT(cudaMalloc(&d, bytes ? bytes : 16) == cudaSuccess);
    if (bytes) MS_ASSERT(cudaMemcpy(d, h, bytes, cudaMemcpyHostToDevice) == cudaSuccess);
    /* the legacy stream's copy, landed before a kernel on the backend's non-blocking stream */
    MS_ASSERT(cudaDeviceSynchronize() == cudaSuccess);
    return d;
}

/* Rows of E experts in blocks of 128: expert e's rows[e] rows fill ceil(rows[e] / 128) blocks;
 * extra blocks with no rows and with no expert are added when asked. */
typedef struct {
    int E, N, K, n_blk;
    int32_t *blk_e, *blk_rows;  /* [n_blk] */
    uint8_t *a, *sfa, *b, *sfb; /* codes [n_blk 128, K / 2], [E N, K / 2]; scales [rows, K / 16] */
    float *sa, *sb;             /* [n_blk 128], [E, N / 128] */
} nv4_case;

/* A positive E4M3 scale code of 2^-3 to 2^3 (never NaN). */
static uint8_t scale_code(void) { return (uint8_t)(0x30 + (int)(urand() * 0x30)); }

static nv4_case case_make(int E, const int *rows, int N, int K, int extra_blocks) {
    nv4_case c = {.E = E, .N = N, .K = K};
    int n = 0;
    for (int e = 0; e < E; e++)
        n += (rows[e] + 127) / 128;
    c.n_blk = n + (extra_blocks ? 2 : 0);
    c.blk_e = malloc(sizeof(int32_t) * (c.n_blk + 1));
    c.blk_rows = malloc(sizeof(int32_t) * (c.n_blk + 1));
    int b = 0;
    for (int e = 0; e < E; e++)
        for (int left = rows[e]; left > 0; left -= 128, b++) {
            c.blk_e[b] = e;
            c.blk_rows[b] = left < 128 ? left : 128;
        }
    if (extra_blocks) { /* a block of expert 0 with no rows; a block of no expert */
        c.blk_e[b] = 0;
        c.blk_rows[b++] = 0;
        c.blk_e[b] = -1;
        c.blk_rows[b++] = 128;
    }
    const int64_t R = (int64_t)c.n_blk * 128, RB = (int64_t)E * N;
    c.a = malloc((size_t)(R * K / 2) + 1);
    c.b = malloc((size_t)(RB * K / 2));
    c.sfa = malloc((size_t)(R * K / 16) + 1);
    c.sfb = malloc((size_t)(RB * K / 16));
    c.sa = malloc(sizeof(float) * (size_t)(R + 1));
    c.sb = malloc(sizeof(float) * (size_t)(E * N / 128));
    for (int64_t i = 0; i < R * K / 2; i++)
        c.a[i] = (uint8_t)(urand() * 256);
    for (int64_t i = 0; i < RB * K / 2; i++)
        c.b[i] = (uint8_t)(urand() * 256);
    for (int64_t i = 0; i < R * K / 16; i++)
        c.sfa[i] = scale_code();
    for (int64_t i = 0; i < RB * K / 16; i++)
        c.sfb[i] = scale_code();
    for (int64_t i = 0; i < R; i++)
        c.sa[i] = ldexpf(1.0f + (float)urand(), -4 + (int)(urand() * 6));
    for (int i = 0; i < E * N / 128; i++)
        c.sb[i] = ldexpf(1.0f + (float)urand(), -4 + (int)(urand() * 6));
    return c;
}

static void case_free(nv4_case *c) {
    free(c->blk_e);
    free(c->blk_rows);
    free(c->a);
    free(c->b);
    free(c->sfa);
    free(c->sfb);
    free(c->sa);
    free(c->sb);
}

typedef struct {
    void *a, *sfa, *b, *sfb, *sa, *sb, *blk_e, *blk_rows;
    float *out;
} nv4_dev;

static nv4_dev dev_make(const nv4_case *c) {
    const int64_t R = (int64_t)c->n_blk * 128, RB = (int64_t)c->E * c->N;
    nv4_dev d;
    uint8_t *atoms = malloc(quant_nvfp4_sf_atoms_bytes(R > RB ? R : RB, c->K) + 1);
    d.a = dev_copy(c->a, (size_t)(R * c->K / 2));
    d.b = dev_copy(c->b, (size_t)(RB * c->K / 2));
    quant_nvfp4_sf_atoms(atoms, c->sfa, R, c->K);
    d.sfa = dev_copy(atoms, quant_nvfp4_sf_atoms_bytes(R, c->K));
    quant_nvfp4_sf_atoms(atoms, c->sfb, RB, c->K);
    d.sfb = dev_copy(atoms, quant_nvfp4_sf_atoms_bytes(RB, c->K));
    free(atoms);
    d.sa = dev_copy(c->sa, sizeof(float) * (size_t)R);
    d.sb = dev_copy(c->sb, sizeof(float) * (size_t)(c->E * c->N / 128));
    d.blk_e = dev_copy(c->blk_e, sizeof(int32_t) * (size_t)c->n_blk);
    d.blk_rows = dev_copy(c->blk_rows, sizeof(int32_t) * (size_t)c->n_blk);
    MS_ASSERT(cudaMalloc((void **)&d.out, sizeof(float) * (size_t)(R * c->N) + 16) == cudaSuccess);
    return d;
}

static void dev_free(nv4_dev *d) {
    cudaFree(d->a);
    cudaFree(d->sfa);
    cudaFree(d->b);
    cudaFree(d->sfb);
    cudaFree(d->sa);
    cudaFree(d->sb);
    cudaFree(d->blk_e);
    cudaFree(d->blk_rows);
    cudaFree(d->out);
}

static void dev_run(const nv4_case *c, const nv4_dev *d) {
    cuda_nvfp4_sm100_gemm(d->out, d->a, d->sfa, d->sa, d->b, d->sfb, d->sb, d->blk_e, d->blk_rows,
                          c->n_blk, c->N, c->K, c->E);
}

/* the value of code nibble k of a row of packed codes */
static double code_at(const uint8_t *row, int k) {
    return fp4_e2m1_to_float(k % 2 ? row[k / 2] >> 4 : row[k / 2] & 15);
}

static void check_case(const char *what, int E, const int *rows, int N, int K, int extra) {
    nv4_case c = case_make(E, rows, N, K, extra);
    const int64_t R = (int64_t)c.n_blk * 128;
    nv4_dev d = dev_make(&c);
    const size_t ob = sizeof(float) * (size_t)(R * N);
    cudaMemset(d.out, 0xff, ob); /* NaN */
    cudaDeviceSynchronize();     /* before the kernels on the non-blocking stream */
    dev_run(&c, &d);
    const cudaError_t ce = cudaStreamSynchronize(cuda_stream());
    CHECK(ce == cudaSuccess, "nvfp4 sm100 %s: %s", what, cudaGetErrorString(ce));
    float *out = malloc(ob + 16);
    MS_ASSERT(cudaMemcpy(out, d.out, ob, cudaMemcpyDeviceToHost) == cudaSuccess);
    /* every row's values decoded once: A's rows, then each weight row as it comes */
    const int G = K / 16;
    double *av = malloc(sizeof(double) * (size_t)(R * K) + 8), *bv = malloc(sizeof(double) * K);
    for (int64_t r = 0; r < R; r++)
        for (int k = 0; k < K; k++)
            av[r * K + k] = code_at(c.a + r * K / 2, k) * fp8_e4m3_to_float(c.sfa[r * G + k / 16]);
    double worst = 0.0, max_err = 0.0, sq = 0.0;
    int64_t bad = 0, n_valid = 0, touched = 0;
    for (int blk = 0; blk < c.n_blk; blk++) /* rows the kernel must leave alone stay NaN */
        for (int i = 0; i < 128; i++)
            if (c.blk_e[blk] < 0 || i >= c.blk_rows[blk])
                for (int n = 0; n < N; n++)
                    touched += !isnan(out[((int64_t)blk * 128 + i) * N + n]);
    for (int e = 0; e < E; e++)
        for (int n = 0; n < N; n++) {
            const int64_t rb = (int64_t)e * N + n;
            for (int k = 0; k < K; k++)
                bv[k] = code_at(c.b + rb * K / 2, k) * fp8_e4m3_to_float(c.sfb[rb * G + k / 16]);
            for (int blk = 0; blk < c.n_blk; blk++) {
                if (c.blk_e[blk] != e) continue;
                for (int i = 0; i < c.blk_rows[blk]; i++) {
                    const int64_t r = (int64_t)blk * 128 + i;
                    double sum = 0.0, S = 0.0;
                    for (int k = 0; k < K; k++) {
                        const double p = av[r * K + k] * bv[k];
                        sum += p;
                        S += fabs(p);
                    }
                    const double sc = (double)c.sa[r] * c.sb[e * N / 128 + n / 128];
                    const double want = sc * sum;
                    const double lim = sc * S * 0x1p-10, got = out[r * N + n];
                    const double err = fabs(got - want);
                    if (!(err <= lim + 1e-30) && bad++ < 5)
                        fprintf(stderr, "  nvfp4 sm100 %s: row %lld col %d got %.9g want %.9g\n",
                                what, (long long)r, n, got, want);
                    if (isnan(err) || err > max_err) max_err = isnan(err) ? INFINITY : err;
                    const double rel = S > 0 ? err / (sc * S) : err;
                    if (isnan(rel) || rel > worst) worst = isnan(rel) ? INFINITY : rel;
                    sq += want * want;
                    n_valid++;
                }
            }
        }
    free(av);
    free(bv);
    const double rms = n_valid ? sqrt(sq / (double)n_valid) : 0.0;
    printf("  %-34s E=%d N=%-5d K=%-5d blocks %-3d worst err/S %.3g, max err / rms %.3g\n", what, E,
           N, K, c.n_blk, worst, rms > 0 ? max_err / rms : 0.0);
    CHECK(bad == 0, "nvfp4 sm100 %s: %lld of %lld outputs outside 2^-10 S", what, (long long)bad,
          (long long)n_valid);
    CHECK(rms == 0.0 || max_err / rms <= 1e-2, "nvfp4 sm100 %s: max err / rms %.3g > 1e-2", what,
          max_err / rms);
    CHECK(touched == 0, "nvfp4 sm100 %s: %lld outputs written past the valid rows", what,
          (long long)touched);
    free(out);
    dev_free(&d);
    case_free(&c);
}

/* ---- the activations' kernels (kernels/cuda/nvfp4_act.cu), on any GPU ---- */

/* A grouping of n pairs over E experts: counts, offsets [E + 1], pairs [n] (distinct slots of T
 * tokens x topk), and the blocks the CPU expects: pblk [E + 1], blk_e / blk_rows [n_blk]. */
typedef struct {
    int E, topk, T, n_blk;
    int64_t n;
    int32_t *off, *pairs, *pblk, *blk_e, *blk_rows;
} grouping;

static grouping grouping_make(int E, const int *counts, int T, int topk) {
    grouping g = {.E = E, .topk = topk, .T = T};
    g.off = malloc(sizeof(int32_t) * (E + 1));
    g.pblk = malloc(sizeof(int32_t) * (E + 1));
    g.off[0] = g.pblk[0] = 0;
    for (int e = 0; e < E; e++) {
        g.off[e + 1] = g.off[e] + counts[e];
        g.pblk[e + 1] = g.pblk[e] + (counts[e] + 127) / 128;
    }
    g.n = g.off[E];
    MS_ASSERT(g.n <= (int64_t)T * topk);
    g.n_blk = cuda_nvfp4_blocks_max(g.n, E);
    g.pairs = malloc(sizeof(int32_t) * (size_t)(g.n + 1));
    int32_t *slot = malloc(sizeof(int32_t) * (size_t)T * topk); /* a shuffle of the slots */
    for (int i = 0; i < T * topk; i++)
        slot[i] = i;
    for (int i = T * topk - 1; i > 0; i--) {
        const int j = (int)(urand() * (i + 1));
        const int32_t t = slot[i];
        slot[i] = slot[j];
        slot[j] = t;
    }
    memcpy(g.pairs, slot, sizeof(int32_t) * (size_t)g.n);
    free(slot);
    g.blk_e = malloc(sizeof(int32_t) * (size_t)g.n_blk);
    g.blk_rows = malloc(sizeof(int32_t) * (size_t)g.n_blk);
    for (int b = 0; b < g.n_blk; b++) {
        g.blk_e[b] = -1;
        g.blk_rows[b] = 0;
    }
    for (int e = 0; e < E; e++)
        for (int b = g.pblk[e]; b < g.pblk[e + 1]; b++) {
            const int left = counts[e] - (b - g.pblk[e]) * 128;
            g.blk_e[b] = e;
            g.blk_rows[b] = left < 128 ? left : 128;
        }
    return g;
}

static void grouping_free(grouping *g) {
    free(g->off);
    free(g->pairs);
    free(g->pblk);
    free(g->blk_e);
    free(g->blk_rows);
}

/* What the CPU makes of rows: codes [R, C / 2], scales [R, C / 16] (then atoms) and s2 [R], each
 * row quantized alone (quant_nvfp4 with its own tensor scale); rows with no value stay zero. */
typedef struct {
    uint8_t *q, *sf, *atoms;
    float *s2;
} cpu_rows;

static cpu_rows cpu_rows_make(int64_t R, int C) {
    cpu_rows r;
    r.q = calloc((size_t)(R * C / 2) + 1, 1);
    r.sf = calloc((size_t)(R * C / 16) + 1, 1);
    r.atoms = malloc(quant_nvfp4_sf_atoms_bytes(R, C) + 1);
    r.s2 = calloc((size_t)R + 1, sizeof(float));
    return r;
}
static void cpu_rows_set(cpu_rows *r, int64_t R, const float *v, int C) {
    r->s2[R] = quant_nvfp4(r->q + R * C / 2, r->sf + R * C / 16, v, 1, C, 0.0f);
}
static void cpu_rows_free(cpu_rows *r) {
    free(r->q);
    free(r->sf);
    free(r->atoms);
    free(r->s2);
}

/* bytes of the device buffer d against h: the count that differ */
static int64_t dev_diff(const void *d, const void *h, size_t bytes) {
    uint8_t *g = malloc(bytes + 1);
    MS_ASSERT(cudaMemcpy(g, d, bytes, cudaMemcpyDeviceToHost) == cudaSuccess);
    int64_t n = 0;
    for (size_t i = 0; i < bytes; i++)
        n += g[i] != ((const uint8_t *)h)[i];
    free(g);
    return n;
}

static void check_act(const char *what, int E, const int *counts, int T, int topk, int D, int F) {
    grouping g = grouping_make(E, counts, T, topk);
    const int64_t R = (int64_t)g.n_blk * 128;
    float *x = malloc(sizeof(float) * (size_t)T * D);
    for (int64_t i = 0; i < (int64_t)T * D; i++)
        x[i] = (float)((urand() - 0.5) * ldexp(1.0, (int)(i / 16 % 9) - 4));
    int32_t *d_off = dev_copy(g.off, sizeof(int32_t) * (E + 1)),
            *d_pairs = dev_copy(g.pairs, sizeof(int32_t) * (size_t)g.n);
    float *d_x = dev_copy(x, sizeof(float) * (size_t)T * D);
    int32_t *d_pblk, *d_be, *d_br, *d_rp;
    uint8_t *d_q, *d_at;
    float *d_sa;
    MS_ASSERT(cudaMalloc((void **)&d_pblk, sizeof(int32_t) * (E + 1)) == cudaSuccess &&
              cudaMalloc((void **)&d_be, sizeof(int32_t) * (size_t)g.n_blk + 4) == cudaSuccess &&
              cudaMalloc((void **)&d_br, sizeof(int32_t) * (size_t)g.n_blk + 4) == cudaSuccess &&
              cudaMalloc((void **)&d_rp, sizeof(int32_t) * (size_t)R + 4) == cudaSuccess &&
              cudaMalloc((void **)&d_q, (size_t)(R * (D > F ? D : F) / 2) + 16) == cudaSuccess &&
              cudaMalloc((void **)&d_at, quant_nvfp4_sf_atoms_bytes(R, D > F ? D : F) + 16) ==
                  cudaSuccess &&
              cudaMalloc((void **)&d_sa, sizeof(float) * (size_t)R + 16) == cudaSuccess);
    cuda_nvfp4_blocks(d_be, d_br, d_pblk, d_off, E, g.n_blk);
    cuda_nvfp4_quant_pairs(d_q, d_at, d_sa, d_rp, d_x, D, d_pairs, topk, d_off, d_pblk, E, g.n,
                           g.n_blk);
    MS_ASSERT(cudaStreamSynchronize(cuda_stream()) == cudaSuccess);
    CHECK(dev_diff(d_pblk, g.pblk, sizeof(int32_t) * (E + 1)) == 0 &&
              dev_diff(d_be, g.blk_e, sizeof(int32_t) * (size_t)g.n_blk) == 0 &&
              dev_diff(d_br, g.blk_rows, sizeof(int32_t) * (size_t)g.n_blk) == 0,
          "nvfp4 blocks %s: first blocks, blocks' experts or rows differ from the CPU's", what);
    /* the CPU's rows: grouped row m of expert e at pblk[e] 128 + m - off[e] */
    cpu_rows c = cpu_rows_make(R, D);
    int32_t *rp = malloc(sizeof(int32_t) * (size_t)R);
    for (int64_t r = 0; r < R; r++)
        rp[r] = -1;
    for (int e = 0; e < E; e++)
        for (int m = g.off[e]; m < g.off[e + 1]; m++) {
            const int64_t r = (int64_t)g.pblk[e] * 128 + (m - g.off[e]);
            cpu_rows_set(&c, r, x + (int64_t)(g.pairs[m] / topk) * D, D);
            rp[r] = g.pairs[m];
        }
    quant_nvfp4_sf_atoms(c.atoms, c.sf, R, D);
    const int64_t dq = dev_diff(d_q, c.q, (size_t)(R * D / 2)),
                  da = dev_diff(d_at, c.atoms, quant_nvfp4_sf_atoms_bytes(R, D)),
                  ds = dev_diff(d_sa, c.s2, sizeof(float) * (size_t)R),
                  dr = dev_diff(d_rp, rp, sizeof(int32_t) * (size_t)R);
    printf("  %-26s E=%d pairs %-5lld blocks %-3d D=%-5d codes, atoms, s2, pairs differing: %lld "
           "%lld %lld %lld\n",
           what, E, (long long)g.n, g.n_blk, D, (long long)dq, (long long)da, (long long)ds,
           (long long)dr);
    CHECK(dq == 0 && da == 0 && ds == 0 && dr == 0,
          "nvfp4 quant_pairs %s: the rows differ from quant_nvfp4's", what);
    cpu_rows_free(&c);

    /* GEMM 1's rows [gate F | up F] to h, quantized (glibc's expf against the GPU's: a code may
     * differ where silu lands on a rounding boundary, so: few codes, s2 within 1e-6) */
    float *g1 = malloc(sizeof(float) * (size_t)(R * 2 * F)), *h = malloc(sizeof(float) * F);
    for (int64_t i = 0; i < R * 2 * F; i++)
        g1[i] = (float)((urand() - 0.5) * 8.0);
    float *d_g1 = dev_copy(g1, sizeof(float) * (size_t)(R * 2 * F));
    cuda_nvfp4_silu_quant(d_q, d_at, d_sa, d_g1, d_br, g.n_blk, F);
    MS_ASSERT(cudaStreamSynchronize(cuda_stream()) == cudaSuccess);
    cpu_rows ch = cpu_rows_make(R, F);
    for (int b = 0; b < g.n_blk; b++)
        for (int i = 0; i < g.blk_rows[b]; i++) {
            const int64_t r = (int64_t)b * 128 + i;
            for (int f = 0; f < F; f++) {
                const float gt = g1[r * 2 * F + f];
                h[f] = gt / (1.0f + expf(-gt)) * g1[r * 2 * F + F + f];
            }
            cpu_rows_set(&ch, r, h, F);
        }
    quant_nvfp4_sf_atoms(ch.atoms, ch.sf, R, F);
    float *gs2 = malloc(sizeof(float) * (size_t)R);
    MS_ASSERT(cudaMemcpy(gs2, d_sa, sizeof(float) * (size_t)R, cudaMemcpyDeviceToHost) ==
              cudaSuccess);
    double s2_worst = 0.0;
    for (int64_t r = 0; r < R; r++) {
        const double d = fabs((double)gs2[r] - ch.s2[r]) / (ch.s2[r] > 0 ? ch.s2[r] : 1.0);
        if (!(d <= s2_worst)) s2_worst = isnan(d) ? INFINITY : d;
    }
    const int64_t hq = dev_diff(d_q, ch.q, (size_t)(R * F / 2)),
                  ha = dev_diff(d_at, ch.atoms, quant_nvfp4_sf_atoms_bytes(R, F));
    printf("  %-26s silu * up, F=%-5d code bytes differing %lld of %lld, atom bytes %lld, s2 "
           "worst relative %.2g\n",
           what, F, (long long)hq, (long long)(g.n * F / 2), (long long)ha, s2_worst);
    CHECK(hq * 1000 <= g.n * F / 2 && ha * 1000 <= g.n * F / 16 && s2_worst <= 1e-6,
          "nvfp4 silu_quant %s: %lld code bytes, %lld scales differ (allowed 1 in 1000), s2 %.2g",
          what, (long long)hq, (long long)ha, s2_worst);
    cpu_rows_free(&ch);

    /* GEMM 2's rows back to their slots */
    float *d_out;
    const size_t ob = sizeof(float) * (size_t)T * topk * D;
    MS_ASSERT(cudaMalloc((void **)&d_out, ob) == cudaSuccess);
    cudaMemset(d_out, 0, ob);
    cudaDeviceSynchronize(); /* before the kernels on the non-blocking stream */
    float *rows = malloc(sizeof(float) * (size_t)(R * D)), *out = malloc(ob);
    for (int64_t i = 0; i < R * D; i++)
        rows[i] = (float)(i % 1000) + 0.5f;
    float *d_rows = dev_copy(rows, sizeof(float) * (size_t)(R * D));
    cuda_nvfp4_scatter(d_out, d_rows, d_rp, g.n_blk, D);
    MS_ASSERT(cudaMemcpy(out, d_out, ob, cudaMemcpyDeviceToHost) == cudaSuccess);
    int64_t bad = 0;
    for (int64_t r = 0; r < R; r++)
        if (rp[r] >= 0)
            for (int d = 0; d < D; d++)
                bad += out[(int64_t)rp[r] * D + d] != rows[r * D + d];
    CHECK(bad == 0, "nvfp4 scatter %s: %lld values misplaced", what, (long long)bad);
    free(rows);
    free(out);
    free(rp);
    free(g1);
    free(h);
    free(gs2);
    free(x);
    cudaFree(d_out);
    cudaFree(d_rows);
    cudaFree(d_g1);
    cudaFree(d_off);
    cudaFree(d_pairs);
    cudaFree(d_x);
    cudaFree(d_pblk);
    cudaFree(d_be);
    cudaFree(d_br);
    cudaFree(d_rp);
    cudaFree(d_q);
    cudaFree(d_at);
    cudaFree(d_sa);
    grouping_free(&g);
}

/* ---- the experts' two GEMMs (cuda_nvfp4_sm100_experts), compute capability 10.0 only ---- */

/* Expert weights [E, rows, C] quantized to NVFP4 a matrix at a time, `parts` matrices an expert
 * (gate and up: 2, each rows / 2 rows; down: 1), each with its own tensor scale; the codes, the
 * atoms of the scales, the tensor scale of each 128 rows, and the dequantized values. */
typedef struct {
    uint8_t *q, *atoms;
    float *s2, *deq; /* s2 [E rows / 128] */
} nv4_weights;

static nv4_weights weights_make(int E, int rows, int C, int parts) {
    nv4_weights w;
    const int64_t n = (int64_t)E * rows * C, pr = rows / parts;
    float *v = malloc(sizeof(float) * (size_t)n);
    uint8_t *sf = malloc((size_t)(n / 16));
    w.q = malloc((size_t)(n / 2));
    w.deq = malloc(sizeof(float) * (size_t)n);
    w.s2 = malloc(sizeof(float) * (size_t)(E * rows / 128));
    w.atoms = malloc(quant_nvfp4_sf_atoms_bytes((int64_t)E * rows, C));
    for (int64_t i = 0; i < n; i++)
        v[i] = (float)((urand() - 0.5) * 0.2);
    for (int64_t m = 0; m < (int64_t)E * parts; m++) { /* matrix m: rows m pr .. */
        const int64_t o = m * pr * C;
        const float s2 = quant_nvfp4(w.q + o / 2, sf + o / 16, v + o, (int)pr, C, 0.0f);
        dequant_nvfp4(w.deq + o, w.q + o / 2, sf + o / 16, s2, (int)pr, C);
        for (int64_t b = m * pr / 128; b < (m + 1) * pr / 128; b++)
            w.s2[b] = s2;
    }
    quant_nvfp4_sf_atoms(w.atoms, sf, (int64_t)E * rows, C);
    free(v);
    free(sf);
    return w;
}

static void weights_free(nv4_weights *w) {
    free(w->q);
    free(w->atoms);
    free(w->s2);
    free(w->deq);
}

/* a row quantized alone and decoded, as the kernels see it */
static void quant_deq_row(float *y, const float *x, int C) {
    uint8_t *q = malloc((size_t)C / 2), *sf = malloc((size_t)C / 16);
    const float s2 = quant_nvfp4(q, sf, x, 1, C, 0.0f);
    dequant_nvfp4(y, q, sf, s2, 1, C);
    free(q);
    free(sf);
}

static void check_experts(const char *what, int E, const int *counts, int T, int topk, int D,
                          int F) {
    grouping g = grouping_make(E, counts, T, topk);
    nv4_weights gu = weights_make(E, 2 * F, D, 2), dn = weights_make(E, D, F, 1);
    float *x = malloc(sizeof(float) * (size_t)T * D);
    for (int64_t i = 0; i < (int64_t)T * D; i++)
        x[i] = (float)(urand() - 0.5) * 4.0f;
    void *d_x = dev_copy(x, sizeof(float) * (size_t)T * D),
         *d_off = dev_copy(g.off, sizeof(int32_t) * (E + 1)),
         *d_pairs = dev_copy(g.pairs, sizeof(int32_t) * (size_t)g.n),
         *d_gu = dev_copy(gu.q, (size_t)E * 2 * F * D / 2),
         *d_gua = dev_copy(gu.atoms, quant_nvfp4_sf_atoms_bytes((int64_t)E * 2 * F, D)),
         *d_gus = dev_copy(gu.s2, sizeof(float) * (size_t)(E * 2 * F / 128)),
         *d_dn = dev_copy(dn.q, (size_t)E * D * F / 2),
         *d_dna = dev_copy(dn.atoms, quant_nvfp4_sf_atoms_bytes((int64_t)E * D, F)),
         *d_dns = dev_copy(dn.s2, sizeof(float) * (size_t)(E * D / 128)), *d_ws = NULL;
    float *d_out = NULL;
    const size_t ob = sizeof(float) * (size_t)T * topk * D;
    MS_ASSERT(cudaMalloc(&d_ws, cuda_nvfp4_sm100_experts_scratch(g.n, E, D, F)) == cudaSuccess &&
              cudaMalloc((void **)&d_out, ob) == cudaSuccess);
    cudaMemset(d_out, 0xff, ob); /* NaN */
    cudaDeviceSynchronize();     /* before the kernels on the non-blocking stream */
    cuda_nvfp4_sm100_experts(d_out, d_x, D, F, topk, d_pairs, d_off, E, g.n, d_gu, d_gua, d_gus,
                             d_dn, d_dna, d_dns, d_ws);
    const cudaError_t ce = cudaStreamSynchronize(cuda_stream());
    CHECK(ce == cudaSuccess, "nvfp4 sm100 experts %s: %s", what, cudaGetErrorString(ce));
    float *out = malloc(ob);
    MS_ASSERT(cudaMemcpy(out, d_out, ob, cudaMemcpyDeviceToHost) == cudaSuccess);
    /* the CPU: each pair's row through the same quantizations, sums in double */
    float *xq = malloc(sizeof(float) * D), *h = malloc(sizeof(float) * F),
          *hq = malloc(sizeof(float) * F);
    char *used = calloc((size_t)T * topk, 1);
    double se = 0.0, sw = 0.0;
    for (int e = 0; e < E; e++)
        for (int m = g.off[e]; m < g.off[e + 1]; m++) {
            const int32_t p = g.pairs[m];
            used[p] = 1;
            quant_deq_row(xq, x + (int64_t)(p / topk) * D, D);
            for (int f = 0; f < F; f++) {
                const float *wg = gu.deq + ((int64_t)e * 2 * F + f) * D,
                            *wu = gu.deq + ((int64_t)e * 2 * F + F + f) * D;
                double a = 0.0, b = 0.0;
                for (int k = 0; k < D; k++) {
                    a += (double)wg[k] * xq[k];
                    b += (double)wu[k] * xq[k];
                }
                const float ga = (float)a;
                h[f] = ga / (1.0f + expf(-ga)) * (float)b;
            }
            quant_deq_row(hq, h, F);
            for (int d = 0; d < D; d++) {
                const float *wd = dn.deq + ((int64_t)e * D + d) * F;
                double a = 0.0;
                for (int f = 0; f < F; f++)
                    a += (double)wd[f] * hq[f];
                const double err = out[(int64_t)p * D + d] - a;
                se += isnan(err) ? INFINITY : err * err;
                sw += a * a;
            }
        }
    int64_t touched = 0;
    for (int64_t p = 0; p < (int64_t)T * topk; p++)
        if (!used[p])
            for (int d = 0; d < D; d++)
                touched += !isnan(out[p * D + d]);
    const double rel = sw > 0 ? sqrt(se / sw) : sqrt(se);
    printf("  %-26s E=%d pairs %-5lld D=%-5d F=%-5d rms error / rms %.3g (h's quantization may "
           "round a value the other way)\n",
           what, E, (long long)g.n, D, F, rel);
    CHECK(rel <= 1e-2, "nvfp4 sm100 experts %s: rms error / rms %.3g > 1e-2", what, rel);
    CHECK(touched == 0, "nvfp4 sm100 experts %s: %lld values written to slots of no pair", what,
          (long long)touched);
    free(x);
    free(xq);
    free(h);
    free(hq);
    free(used);
    free(out);
    cudaFree(d_x);
    cudaFree(d_off);
    cudaFree(d_pairs);
    cudaFree(d_gu);
    cudaFree(d_gua);
    cudaFree(d_gus);
    cudaFree(d_dn);
    cudaFree(d_dna);
    cudaFree(d_dns);
    cudaFree(d_ws);
    cudaFree(d_out);
    weights_free(&gu);
    weights_free(&dn);
    grouping_free(&g);
}

/* seconds per call: warm calls, then reps timed ones */
static double time_case(const nv4_case *c, const nv4_dev *d, int reps) {
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    for (int r = 0; r < 3; r++)
        dev_run(c, d);
    cudaEventRecord(e0, cuda_stream());
    for (int r = 0; r < reps; r++)
        dev_run(c, d);
    cudaEventRecord(e1, cuda_stream());
    cudaEventSynchronize(e1);
    float ms = 0.0f;
    cudaEventElapsedTime(&ms, e0, e1);
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    return ms / 1e3 / reps;
}

/* cuBLASLt's NVFP4 GEMM (E2M1 in with UE4M3 scales a 16-vector, the same atoms; fp32 out) of M
 * rows against expert 0's weights, the peer at prefill sizes. NAN when cuBLASLt offers nothing. */
static double cublaslt_nvfp4_seconds(const nv4_dev *d, int M, int N, int K, int reps) {
    const uint64_t ws_bytes = 32u << 20;
    void *ws = NULL;
    if (cudaMalloc(&ws, ws_bytes) != cudaSuccess) return NAN;
    const double s = cublaslt_seconds_scaled(
        CUDA_R_4F_E2M1, CUDA_R_32F, M, N, K, d->b, d->a, d->out, ws, ws_bytes, cuda_stream(), 3,
        reps, CUBLASLT_MATMUL_MATRIX_SCALE_VEC16_UE4M3, d->sfb, d->sfa);
    cudaFree(ws);
    return s;
}

/* device-to-device copy rate of 1 GiB (bytes read + written over time, counted once) */
static double copy_gbs(void) {
    const size_t bytes = (size_t)1 << 30;
    void *a = NULL, *b = NULL;
    if (cudaMalloc(&a, bytes) != cudaSuccess || cudaMalloc(&b, bytes) != cudaSuccess) return NAN;
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, cuda_stream());
    cudaEventRecord(e0, cuda_stream());
    for (int r = 0; r < 5; r++)
        cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, cuda_stream());
    cudaEventRecord(e1, cuda_stream());
    cudaEventSynchronize(e1);
    float ms = 0.0f;
    cudaEventElapsedTime(&ms, e0, e1);
    cudaFree(a);
    cudaFree(b);
    return 5.0 * (double)bytes / (ms / 1e3) / 1e9;
}

static void figures(void) {
    printf("\nfigures (time per call, mean of the timed calls after 3 untimed)\n");
    static const int shapes[][2] = {{1536, 2048}, {4096, 2048}, {1536, 7168}, {4096, 7168}};
    const int rows8[8] = {4096, 4096, 4096, 4096, 4096, 4096, 4096, 4096};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        const int N = shapes[s][0], K = shapes[s][1];
        nv4_case c = case_make(8, rows8, N, K, 0);
        nv4_dev d = dev_make(&c);
        const double t = time_case(&c, &d, 20), flop = 2.0 * 8 * 4096 * (double)N * K;
        /* the peer: one GEMM of the same rows against expert 0's weights */
        const double tl = cublaslt_nvfp4_seconds(&d, 8 * 4096, N, K, 20);
        printf("  8 experts x 4096 rows, N %-5d K %-5d  %8.1f us  %6.0f TFLOP/s   cuBLASLt NVFP4 "
               "(one GEMM) %8.1f us  %6.0f TFLOP/s  (%.2f of it)\n",
               N, K, t * 1e6, flop / t / 1e12, tl * 1e6, flop / tl / 1e12, tl / t);
        dev_free(&d);
        case_free(&c);
    }
    const double gbs = copy_gbs();
    printf("  device copy of 1 GiB: %.0f GB/s\n", gbs);
    static const int decode_rows[] = {1, 8, 16, 64};
    for (size_t i = 0; i < sizeof decode_rows / sizeof decode_rows[0]; i++) {
        int rows[8];
        for (int e = 0; e < 8; e++)
            rows[e] = decode_rows[i];
        for (int s = 0; s < 2; s++) { /* Qwen3-30B-A3B's gate_up, DeepSeek-V3's */
            const int N = s ? 4096 : 1536, K = s ? 7168 : 2048;
            nv4_case c = case_make(8, rows, N, K, 0);
            nv4_dev d = dev_make(&c);
            const double t = time_case(&c, &d, 50);
            const double wbytes = 8.0 * N * K * (0.5 + 1.0 / 16);
            printf(
                "  8 experts x %-2d rows, N %-5d K %-5d  %8.1f us  weights %6.0f GB/s  (%.0f%% of "
                "the copy rate)\n",
                decode_rows[i], N, K, t * 1e6, wbytes / t / 1e9, 100.0 * wbytes / t / 1e9 / gbs);
            dev_free(&d);
            case_free(&c);
        }
    }
}

int main(void) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    char err[256];
    const ops *gpu = ops_cuda(0, err, sizeof err);
    if (!gpu) {
        printf("skipped: %s\n", err);
        printf("0 passed, 0 failed\n");
        return 0;
    }
    printf("NVFP4 activations in the GEMM's blocks against the CPU (any GPU)\n");
    check_act("uneven experts", 6, (const int[]){0, 1, 127, 128, 129, 300}, 200, 4, 256, 128);
    check_act("Qwen3-30B-A3B", 8, (const int[]){5, 0, 64, 200, 1, 33, 130, 7}, 128, 8, 2048, 768);
    if (!cuda_nvfp4_sm100_available()) {
        printf("the GEMM: skipped (it is built for sm_100a: compute capability 10.0, B200 and "
               "GB200)\n");
        CHECK_SUMMARY();
    }
    printf("NVFP4 grouped GEMM (tcgen05, sm_100a) against the CPU\n");
    check_case("uneven experts", 5, (const int[]){0, 1, 130, 255, 7}, 256, 512, 1);
    check_case("one stage of k", 2, (const int[]){128, 3}, 128, 256, 0);
    check_case("whole blocks", 3, (const int[]){128, 128, 256}, 128, 2048, 0);
    check_case("Qwen3-30B-A3B gate_up", 4, (const int[]){40, 1, 300, 128}, 1536, 2048, 0);
    check_case("Qwen3-30B-A3B down", 3, (const int[]){17, 200, 64}, 2048, 768, 0);
    check_case("DeepSeek-V3 gate_up, 512 of its rows", 2, (const int[]){130, 9}, 512, 7168, 0);
    printf("the experts' two GEMMs (cuda_nvfp4_sm100_experts) against the CPU\n");
    check_experts("small", 4, (const int[]){3, 0, 140, 20}, 64, 4, 256, 256);
    check_experts("Qwen3-30B-A3B", 8, (const int[]){5, 0, 64, 200, 1, 33, 130, 7}, 128, 8, 2048,
                  768);
    figures();
    CHECK_SUMMARY();
}

#else

int main(void) {
    printf("skipped: this build has no CUDA (nvcc not found, or make CUDA=0)\n");
    printf("0 passed, 0 failed\n");
    return 0;
}

#endif
