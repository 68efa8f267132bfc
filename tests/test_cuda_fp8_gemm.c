/* The FP8 x FP8 grouped GEMM (kernels/cuda/fp8_gemm.cu, wgmma) against the CPU reference, and its
 * speed against cuBLASLt's FP8 GEMM in the same run.
 *
 * Reference: out[m, n] = sum over 128-k blocks of sa[m, kb] sb[e, kb, n] sum_k a[m, k] b[e, n, k]
 * in double on the decoded codes (kernels/quant.h). Bound per output: |got - want| <= 2^-10 S
 * with S = sum_kb |sa sb| sum_k |a b| (the tensor cores' FP8 sums keep fewer bits than fp32, and
 * each 128-k block is one of them), and the figure beside it: max |got - want| over the
 * rms of want, at most 1e-2. Device outputs are poisoned with NaN first, so a row the kernel never
 * wrote fails. Shapes: uneven experts (empty ones, one row, 128 and 129 rows, a tile cut short),
 * Qwen3-30B-A3B's and DeepSeek-V3's expert shapes; every pipeline depth and the warp-specialized
 * form give the same bits at the same tile width.
 *
 * GEMM 1's form (h = silu(gate) up in BF16) against the plain form's sums of the same
 * configuration.
 *
 * Figures: cuBLASLt's FP8 GEMM (E4M3 in, BF16 out) at 8192^3, the peak the issue measures against,
 * and at the grouped shapes' total (8 experts x 4096 tokens as one GEMM); the grouped GEMM at
 * 8 experts x 4096 tokens, N 1536 and 4096, K 2048 and 7168, TFLOP/s and its share of the peak, in
 * each configuration (fp32 out) and as the experts run those shapes (GEMM 1: N = 2F, h in BF16);
 * the experts' GEMM 2 (h quantized, rows scattered to their pairs, fp32) at a prefill chunk's
 * sizes in GEMM 2's configurations.
 *
 *   test_cuda_fp8_gemm        on GPU 0; without CUDA in the build or without a Hopper GPU it
 *                             prints "skipped: <reason>" and "0 passed, 0 failed"
 *   test_cuda_fp8_gemm --profile C [N K [h]]   only configuration C's timing at 8 x 4096, N 4096
 *                             and K 7168 unless given (h: GEMM 1's form; 12 calls; for a profiler)
 *   test_cuda_fp8_gemm --sweep C   configuration C over K from 1024 to 7168 beside cuBLASLt
 *   test_cuda_fp8_gemm --configs 0,5,7   the checks and figures of those configurations (the
 *                             first of each width is the others' reference; GEMM 2's are those
 *                             of 128 columns) */
#include <stdio.h>

#ifdef MOESERVE_CUDA

#include <cublasLt.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/tensor.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/quant.h"
#include "tests/check.h"
#include "tests/cublaslt_time.h"

/* kernels/cuda/ops_cuda.cu (its declaration in cuda_ops.h is visible to CUDA C++ only) */
cudaStream_t cuda_stream(void);
/* kernels/cuda/fp8_gemm.cu, for tests: the tile configuration from now on (0 to 3: 128 columns
 * with 4 or 3 stages, 64 columns with 4 or 6; 4 and 5 the warp-specialized form with TMA, 128
 * columns, 6 or 4 stages; 6 that with 4 stages in clusters of two; 7 with tiles of 192 rows, 8 of
 * 64 rows, 9 as 7 storing from registers, 11 as 7 in clusters of two, 13 as 11 with the
 * warpgroups' products in turn, 14 as 13 with its descriptors in uniform registers; -1, the
 * default, 14, 7, 5 or 8 by the rows an expert); returns the one before */
int cuda_fp8_grouped_gemm_config(int config);

/* kernels/cuda/fp8_gemm.cu, for tests: the experts' GEMM 1's form (b's rows per expert F gate rows
 * then F up rows, N = 2F) into h [M, F] BF16 = silu(gate sums) * (up sums), device pointers */
void cuda_fp8_grouped_gemm_h(uint16_t *h, const uint8_t *a, const float *sa, const uint8_t *b,
                             const float *sb, const int32_t *offsets, int E, int M, int N, int K);

/* kernels/cuda/fp8_gemm.cu, for tests: the experts' GEMM 2 on the FP8 tensor cores
 * (fp8_w8a8_down), device pointers; waits for it unless nowait */
void cuda_fp8_w8a8_down(float *out, const uint16_t *h, const int32_t *pairs, const int32_t *offsets,
                        int E, int64_t n_pairs, int D, int F, const uint8_t *w, const float *wsc,
                        int nowait);

/* the configurations this run checks and times */
enum { MAX_CONFIGS = 16 };
/* the default set (--configs replaces it) */
static int configs[MAX_CONFIGS] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 13, 14}, n_configs = 13;
/* GEMM 2's (its outputs are 128 columns wide): the default's forms and the plain kernel,
 * or with --configs those of its configurations of 128 columns */
static int down_configs[MAX_CONFIGS] = {5, 7, 13, 14, 8, 0}, n_down = 6;
/* a configuration's tile width: 64 columns for 2 and 3 */
static int width(int config) { return config == 2 || config == 3 ? 64 : 128; }

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static double urand(void) { /* [0, 1) */
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (double)(rng >> 11) / 9007199254740992.0;
}
static float nrand(void) { /* about N(0, 1) */
    return (float)((urand() + urand() + urand() + urand() - 2.0) * 1.7320508);
}

static void *dev_copy(const void *h, size_t bytes) {
    void *d = NULL;
    MS_ASSERT(cudaMalloc(&d, bytes ? bytes : 16) == cudaSuccess);
    if (bytes) MS_ASSERT(cudaMemcpy(d, h, bytes, cudaMemcpyHostToDevice) == cudaSuccess);
    /* the legacy stream's copy, landed before a kernel on the backend's non-blocking stream */
    MS_ASSERT(cudaDeviceSynchronize() == cudaSuccess);
    return d;
}

typedef struct {
    int E, M, N, K;
    int32_t *off; /* [E + 1] */
    uint8_t *a, *b;
    float *sa, *sb;
} fp8_case;

/* Random codes (the E4M3 rounding of normal values, never NaN) and scales of 2^-6 .. 2^2. */
static fp8_case case_make(int E, const int *rows, int N, int K) {
    fp8_case c = {.E = E, .N = N, .K = K};
    c.off = malloc(sizeof(int32_t) * (E + 1));
    c.off[0] = 0;
    for (int e = 0; e < E; e++)
        c.off[e + 1] = c.off[e] + rows[e];
    c.M = c.off[E];
    const int nkb = K / 128;
    c.a = malloc((size_t)c.M * K + 1);
    c.b = malloc((size_t)E * N * K);
    c.sa = malloc(sizeof(float) * ((size_t)c.M * nkb + 1));
    c.sb = malloc(sizeof(float) * (size_t)E * nkb * N);
    for (int64_t i = 0; i < (int64_t)c.M * K; i++)
        c.a[i] = fp8_e4m3_from_float(nrand() * 8.0f);
    for (int64_t i = 0; i < (int64_t)E * N * K; i++)
        c.b[i] = fp8_e4m3_from_float(nrand() * 8.0f);
    for (int64_t i = 0; i < (int64_t)c.M * nkb; i++)
        c.sa[i] = ldexpf(1.0f + (float)urand(), -6 + (int)(urand() * 8));
    /* a scale per 64 rows of b and 128-k block, repeated over those rows: the finest the kernels'
     * contract allows (checkpoints' 128 x 128 blocks are coarser), so that the two halves of a
     * 128-column tile differ */
    for (int64_t i = 0; i < (int64_t)E * nkb * N; i++)
        c.sb[i] = i % 64 ? c.sb[i - 1] : ldexpf(1.0f + (float)urand(), -6 + (int)(urand() * 8));
    return c;
}

static void case_free(fp8_case *c) {
    free(c->off);
    free(c->a);
    free(c->b);
    free(c->sa);
    free(c->sb);
}

/* The GPU's out [M, N] for c with the given tile configuration (host copy, caller frees); with h,
 * also GEMM 1's form into *h [M, N / 2] (host copy, caller frees). */
static float *gpu_run(const fp8_case *c, int config, uint16_t **h) {
    const int nkb = c->K / 128;
    void *da = dev_copy(c->a, (size_t)c->M * c->K),
         *db = dev_copy(c->b, (size_t)c->E * c->N * c->K);
    /* the C API takes sa by k block: [nkb, M] */
    float *sa_t = malloc(sizeof(float) * ((size_t)c->M * nkb + 1));
    for (int m = 0; m < c->M; m++)
        for (int kb = 0; kb < nkb; kb++)
            sa_t[(size_t)kb * c->M + m] = c->sa[(size_t)m * nkb + kb];
    void *dsa = dev_copy(sa_t, sizeof(float) * (size_t)c->M * nkb);
    free(sa_t);
    void *dsb = dev_copy(c->sb, sizeof(float) * (size_t)c->E * nkb * c->N);
    void *doff = dev_copy(c->off, sizeof(int32_t) * (c->E + 1));
    const size_t ob = sizeof(float) * (size_t)c->M * c->N;
    float *dout = NULL;
    MS_ASSERT(cudaMalloc((void **)&dout, ob ? ob : 16) == cudaSuccess);
    cudaMemset(dout, 0xff, ob); /* NaN */
    cudaDeviceSynchronize();    /* before the kernels on the non-blocking stream */
    const int old = cuda_fp8_grouped_gemm_config(config);
    cuda_fp8_grouped_gemm(dout, da, dsa, db, dsb, doff, c->E, c->M, c->N, c->K);
    if (h) {
        const size_t hb = sizeof(uint16_t) * (size_t)c->M * (c->N / 2);
        uint16_t *dh = NULL;
        MS_ASSERT(cudaMalloc((void **)&dh, hb ? hb : 16) == cudaSuccess);
        cudaMemset(dh, 0xff, hb); /* NaN */
        cudaDeviceSynchronize();  /* before the kernels on the non-blocking stream */
        cuda_fp8_grouped_gemm_h(dh, da, dsa, db, dsb, doff, c->E, c->M, c->N, c->K);
        *h = malloc(hb ? hb : 16);
        MS_ASSERT(cudaStreamSynchronize(cuda_stream()) == cudaSuccess);
        if (hb) MS_ASSERT(cudaMemcpy(*h, dh, hb, cudaMemcpyDeviceToHost) == cudaSuccess);
        cudaFree(dh);
    }
    cuda_fp8_grouped_gemm_config(old);
    float *out = malloc(ob ? ob : 16);
    MS_ASSERT(cudaStreamSynchronize(cuda_stream()) == cudaSuccess);
    if (ob) MS_ASSERT(cudaMemcpy(out, dout, ob, cudaMemcpyDeviceToHost) == cudaSuccess);
    cudaFree(da);
    cudaFree(db);
    cudaFree(dsa);
    cudaFree(dsb);
    cudaFree(doff);
    cudaFree(dout);
    return out;
}

/* GEMM 1's form (cuda_fp8_grouped_gemm_h) against the plain form's sums out [M, N] of the same
 * configuration (the same tensor-core sums: the tile's width changes none): h = silu(gate) * up
 * rounded to BF16, within 2^-7 of it (BF16's rounding, the kernel's approximate reciprocal and
 * exponential) plus 2^-20 of h's rms for values near 0; every element written. */
static void check_gate_up(const char *name, const fp8_case *c, int cf, const float *out,
                          const uint16_t *h) {
    const int F = c->N / 2;
    const int64_t n = (int64_t)c->M * F;
    double sq = 0.0;
    for (int64_t i = 0; i < n; i++) {
        const double g = out[i / F * c->N + i % F], u = out[i / F * c->N + F + i % F];
        const double r = g / (1.0 + exp(-g)) * u;
        sq += r * r;
    }
    const double rms = n ? sqrt(sq / n) : 0.0;
    int64_t bad = 0;
    double worst = 0.0;
    for (int64_t i = 0; i < n; i++) {
        const double g = out[i / F * c->N + i % F], u = out[i / F * c->N + F + i % F];
        const double r = g / (1.0 + exp(-g)) * u, v = bf16_to_f32(h[i]);
        const double err = fabs(v - r), tol = 0x1p-7 * fabs(r) + 0x1p-20 * rms;
        if (!(err <= tol)) {
            if (bad < 3)
                fprintf(stderr, "  %s, configuration %d: h[%lld, %lld] = %.9g, want %.9g\n", name,
                        cf, (long long)(i / F), (long long)(i % F), v, r);
            bad++;
        }
        if (tol > 0 && err / tol > worst) worst = err / tol;
    }
    CHECK(bad == 0,
          "fp8 grouped GEMM %s, configuration %d, GEMM 1's form: %lld of %lld h values "
          "off silu(gate) up",
          name, cf, (long long)bad, (long long)n);
    printf("  %-24s configuration %d, GEMM 1's form (h in BF16): worst err / bound %.2e\n", name,
           cf, worst);
}

static void check_case(const char *name, int E, const int *rows, int N, int K) {
    fp8_case c = case_make(E, rows, N, K);
    const int nkb = K / 128;
    float *fa = malloc(sizeof(float) * (size_t)c.M * K + 4);
    float *fb = malloc(sizeof(float) * (size_t)E * N * K);
    for (int64_t i = 0; i < (int64_t)c.M * K; i++)
        fa[i] = fp8_e4m3_to_float(c.a[i]);
    for (int64_t i = 0; i < (int64_t)E * N * K; i++)
        fb[i] = fp8_e4m3_to_float(c.b[i]);
    /* the reference and its bound's S, per output */
    double *want = malloc(sizeof(double) * ((size_t)c.M * N + 1));
    double *S = malloc(sizeof(double) * ((size_t)c.M * N + 1));
    double sq = 0.0;
    for (int e = 0; e < E; e++)
        for (int m = c.off[e]; m < c.off[e + 1]; m++)
            for (int j = 0; j < N; j++) {
                double w_ = 0.0, S_ = 0.0;
                for (int kb = 0; kb < nkb; kb++) {
                    const float *x = fa + (int64_t)m * K + kb * 128;
                    const float *w = fb + ((int64_t)e * N + j) * K + kb * 128;
                    double t = 0.0, ta = 0.0;
                    for (int k = 0; k < 128; k++) {
                        t += (double)x[k] * w[k];
                        ta += fabs((double)x[k] * w[k]);
                    }
                    const double sc =
                        (double)c.sa[(int64_t)m * nkb + kb] * c.sb[((int64_t)e * nkb + kb) * N + j];
                    w_ += sc * t;
                    S_ += fabs(sc) * ta;
                }
                want[(int64_t)m * N + j] = w_;
                S[(int64_t)m * N + j] = S_;
                sq += w_ * w_;
            }
    const int64_t n = (int64_t)c.M * N;
    const double rms = n ? sqrt(sq / n) : 0.0;
    float *got[MAX_CONFIGS];
    for (int ci = 0; ci < n_configs; ci++) {
        const int cf = configs[ci];
        uint16_t *h = NULL;
        got[ci] = gpu_run(&c, cf, width(cf) == 128 ? &h : NULL);
        if (h) check_gate_up(name, &c, cf, got[ci], h);
        free(h);
        double worst = 0.0, max_err = 0.0;
        int64_t bad = 0;
        for (int64_t i = 0; i < n; i++) {
            const double err = fabs((double)got[ci][i] - want[i]);
            if (!(err <= 0x1p-10 * S[i] + 1e-30)) {
                if (bad < 3)
                    fprintf(stderr,
                            "  %s, configuration %d: out[%lld, %lld] = %.9g, want %.9g (S "
                            "%.3g)\n",
                            name, cf, (long long)(i / N), (long long)(i % N), got[ci][i], want[i],
                            S[i]);
                bad++;
            }
            if (S[i] > 0 && err / S[i] > worst) worst = err / S[i];
            if (err > max_err || isnan(err)) max_err = isnan(err) ? INFINITY : err;
        }
        CHECK(bad == 0, "fp8 grouped GEMM %s, configuration %d: %lld of %lld outside 2^-10 S", name,
              cf, (long long)bad, (long long)n);
        CHECK(n == 0 || max_err <= 1e-2 * rms,
              "fp8 grouped GEMM %s, configuration %d: max |err| %.3g over rms %.3g", name, cf,
              max_err, rms);
        printf(
            "  %-24s E=%d M=%-4d N=%-4d K=%-4d configuration %d: worst err / S %.2e, max |err| / "
            "rms %.2e%s\n",
            name, E, c.M, N, K, cf, worst, n ? max_err / rms : 0.0,
            ci && memcmp(got[ci], got[0], sizeof(float) * (size_t)n) == 0 ? " (bits of 0)" : "");
    }
    /* the pipeline depth and the warp roles change no sum: the same bits at the same width as
     * the first configuration of that width */
    for (int ci = 1; ci < n_configs; ci++) {
        int first = 0;
        while (width(configs[first]) != width(configs[ci]))
            first++;
        if (first != ci)
            CHECK(memcmp(got[ci], got[first], sizeof(float) * (size_t)n) == 0,
                  "fp8 grouped GEMM %s: configuration %d gives other bits than %d", name,
                  configs[ci], configs[first]);
    }
    for (int ci = 0; ci < n_configs; ci++)
        free(got[ci]);
    free(want);
    free(S);
    free(fa);
    free(fb);
    case_free(&c);
}

/* 0 .. n - 1 in a random order (malloc'd) */
static int32_t *shuffled_ids(int64_t n) {
    int32_t *p = malloc(sizeof(int32_t) * (size_t)n);
    for (int64_t i = 0; i < n; i++)
        p[i] = (int32_t)i;
    for (int64_t i = n - 1; i > 0; i--) {
        const int64_t j = (int64_t)(urand() * (double)(i + 1));
        const int32_t t = p[i];
        p[i] = p[j];
        p[j] = t;
    }
    return p;
}

/* The experts' GEMM 2 on the FP8 tensor cores (fp8_w8a8_down): h [n_pairs, F] BF16 in grouped
 * order (rows past the grouping NaN: never read into a stored output), quantized by the kernel
 * with quant_fp8_rows' formula, so the reference quantizes the same BF16 values and gets the same
 * codes; grouped row m written to out's row pairs[m] (a permutation of T K pair ids with some left
 * out: those rows keep their NaN), against the same bound as the GEMM above. The weights go to the
 * device packed per 64 k as cuda_prepare_experts_fp8 packs them (fp8_w8_pack64); h's codes are
 * packed the same way by the kernel, so every product pairs the same k. */
static void check_down(const char *name, int E, const int *rows, int D, int F, int T, int K) {
    const int nkb = F / 128;
    int32_t *off = malloc(sizeof(int32_t) * (E + 1));
    off[0] = 0;
    for (int e = 0; e < E; e++)
        off[e + 1] = off[e] + rows[e];
    const int M = off[E], n_pairs = T * K;
    MS_ASSERT(M <= n_pairs);
    /* pairs: a shuffled permutation of the pair ids, the first M grouped */
    int32_t *pairs = shuffled_ids(n_pairs);
    uint16_t *h = malloc(sizeof(uint16_t) * (size_t)n_pairs * F);
    for (int64_t i = 0; i < (int64_t)n_pairs * F; i++)
        h[i] = i < (int64_t)M * F ? f32_to_bf16(nrand() * ldexpf(1.0f, (int)(urand() * 6) - 3))
                                  : 0x7fc0; /* NaN */
    uint8_t *w = malloc((size_t)E * D * F), *wp = malloc((size_t)E * D * F);
    for (int64_t i = 0; i < (int64_t)E * D * F; i++)
        w[i] = fp8_e4m3_from_float(nrand() * 8.0f);
    for (int64_t i = 0; i < (int64_t)E * D * F; i += 64)
        fp8_w8_pack64(wp + i, w + i);
    float *wsc = malloc(sizeof(float) * (size_t)E * nkb * D);
    for (int64_t i = 0; i < (int64_t)E * nkb * D; i++) /* equal over 64 rows, as the contract */
        wsc[i] = i % 64 ? wsc[i - 1] : ldexpf(1.0f + (float)urand(), -6 + (int)(urand() * 8));

    float *dout = NULL;
    const size_t ob = sizeof(float) * (size_t)n_pairs * D;
    MS_ASSERT(cudaMalloc((void **)&dout, ob) == cudaSuccess);
    void *dh = dev_copy(h, sizeof(uint16_t) * (size_t)n_pairs * F),
         *dp = dev_copy(pairs, 4 * n_pairs);
    void *doff = dev_copy(off, sizeof(int32_t) * (E + 1)), *dw = dev_copy(wp, (size_t)E * D * F);
    void *dsc = dev_copy(wsc, sizeof(float) * (size_t)E * nkb * D);
    float *got = malloc(ob);
    /* the reference and its bound's S for each grouped row m and column d, once */
    double *want = malloc(sizeof(double) * ((size_t)M * D + 1)),
           *S = malloc(sizeof(double) * ((size_t)M * D + 1));
    float *hf = malloc(sizeof(float) * F), *hs = malloc(sizeof(float) * nkb);
    uint8_t *hq = malloc(F);
    for (int e = 0; e < E; e++)
        for (int m = off[e]; m < off[e + 1]; m++) {
            for (int k = 0; k < F; k++)
                hf[k] = bf16_to_f32(h[(int64_t)m * F + k]);
            quant_fp8_rows(hq, hs, hf, 1, F);
            for (int d = 0; d < D; d++) {
                double wv = 0.0, sv = 0.0;
                for (int kb = 0; kb < nkb; kb++) {
                    double t = 0.0, ta = 0.0;
                    for (int k = kb * 128; k < kb * 128 + 128; k++) {
                        const double p = (double)fp8_e4m3_to_float(hq[k]) *
                                         fp8_e4m3_to_float(w[((int64_t)e * D + d) * F + k]);
                        t += p;
                        ta += fabs(p);
                    }
                    const double sc = (double)hs[kb] * wsc[((int64_t)e * nkb + kb) * D + d];
                    wv += sc * t;
                    sv += fabs(sc) * ta;
                }
                want[(int64_t)m * D + d] = wv;
                S[(int64_t)m * D + d] = sv;
            }
        }
    for (int ci = 0; ci < n_down; ci++) {
        const int cf = down_configs[ci];
        cudaMemset(dout, 0xff, ob); /* NaN */
        cudaDeviceSynchronize();    /* before the kernels on the non-blocking stream */
        const int old = cuda_fp8_grouped_gemm_config(cf);
        cuda_fp8_w8a8_down(dout, dh, dp, doff, E, n_pairs, D, F, dw, dsc, 0);
        cuda_fp8_grouped_gemm_config(old);
        MS_ASSERT(cudaMemcpy(got, dout, ob, cudaMemcpyDeviceToHost) == cudaSuccess);

        int64_t bad = 0, untouched_bad = 0;
        double worst = 0.0;
        for (int m = 0; m < M; m++)
            for (int d = 0; d < D; d++) {
                const int64_t i = (int64_t)m * D + d;
                const double g = got[(int64_t)pairs[m] * D + d], err = fabs(g - want[i]);
                if (!(err <= 0x1p-10 * S[i] + 1e-30)) {
                    if (bad < 3)
                        fprintf(stderr,
                                "  down %s, configuration %d: row %d (pair %d) d %d: %.9g, want "
                                "%.9g (S %.3g)\n",
                                name, cf, m, pairs[m], d, g, want[i], S[i]);
                    bad++;
                }
                if (S[i] > 0 && err / S[i] > worst) worst = err / S[i];
            }
        for (int i = M; i < n_pairs; i++) /* pairs outside the grouping: never written */
            for (int d = 0; d < D; d++)
                untouched_bad += !isnan(got[(int64_t)pairs[i] * D + d]);
        CHECK(bad == 0, "fp8 experts' GEMM 2 %s, configuration %d: %lld of %lld outside 2^-10 S",
              name, cf, (long long)bad, (long long)M * D);
        CHECK(untouched_bad == 0,
              "fp8 experts' GEMM 2 %s, configuration %d: %lld values written outside the grouping",
              name, cf, (long long)untouched_bad);
        printf(
            "  %-24s E=%d rows %-5d of %-5d D=%-4d F=%-4d configuration %d: worst err / S %.2e\n",
            name, E, M, n_pairs, D, F, cf, worst);
    }
    free(want);
    free(S);
    cudaFree(dout);
    cudaFree(dh);
    cudaFree(dp);
    cudaFree(doff);
    cudaFree(dw);
    cudaFree(dsc);
    free(off);
    free(pairs);
    free(h);
    free(w);
    free(wp);
    free(wsc);
    free(got);
    free(hf);
    free(hs);
    free(hq);
}

/* ---- figures ---- */

/* Seconds per call of cuBLASLt's FP8 GEMM out [M, N] (BF16) = x [M, K] w [N, K]^T, E4M3 both;
 * NAN if cuBLASLt offers no algorithm. */
static double time_cublaslt_fp8(int M, int N, int K, void *ws, size_t ws_bytes) {
    void *w = NULL, *x = NULL, *o = NULL;
    if (cudaMalloc(&w, (size_t)N * K) != cudaSuccess ||
        cudaMalloc(&x, (size_t)M * K) != cudaSuccess ||
        cudaMalloc(&o, (size_t)M * N * 2) != cudaSuccess) {
        cudaFree(w);
        cudaFree(x);
        return NAN;
    }
    cudaMemset(w, 0x38, (size_t)N * K); /* 1.0 */
    cudaMemset(x, 0x38, (size_t)M * K);
    cudaDeviceSynchronize(); /* before the kernels on the non-blocking stream */
    const double s = cublaslt_seconds(CUDA_R_8F_E4M3, CUDA_R_16BF, M, N, K, w, x, o, ws, ws_bytes,
                                      cuda_stream(), 2, 10);
    cudaFree(w);
    cudaFree(x);
    cudaFree(o);
    return s;
}

/* double secs: the seconds a run of CALL takes on the backend's stream (10 runs timed by events,
 * after 2 not timed) */
#define TIME_CALLS(secs, CALL)                                                                     \
    double secs;                                                                                   \
    do {                                                                                           \
        cudaEvent_t e0_, e1_;                                                                      \
        cudaEventCreate(&e0_);                                                                     \
        cudaEventCreate(&e1_);                                                                     \
        for (int r_ = 0; r_ < 12; r_++) {                                                          \
            if (r_ == 2) cudaEventRecord(e0_, cuda_stream());                                      \
            CALL;                                                                                  \
        }                                                                                          \
        cudaEventRecord(e1_, cuda_stream());                                                       \
        cudaEventSynchronize(e1_);                                                                 \
        float ms_ = 0.0f;                                                                          \
        cudaEventElapsedTime(&ms_, e0_, e1_);                                                      \
        cudaEventDestroy(e0_);                                                                     \
        cudaEventDestroy(e1_);                                                                     \
        secs = ms_ / 1e3 / 10;                                                                     \
    } while (0)

/* Seconds a call of the grouped GEMM over E experts of T rows, N x K: the plain form (fp32 out
 * [E T, N]), or with gate_up GEMM 1's (h [E T, N / 2] BF16). */
static double time_grouped(int E, int T, int N, int K, int config, bool gate_up) {
    const int M = E * T, nkb = K / 128;
    void *a = NULL, *b = NULL, *sa = NULL, *sb = NULL, *off = NULL, *o = NULL;
    MS_ASSERT(cudaMalloc(&a, (size_t)M * K) == cudaSuccess &&
              cudaMalloc(&b, (size_t)E * N * K) == cudaSuccess &&
              cudaMalloc(&sa, sizeof(float) * (size_t)M * nkb) == cudaSuccess &&
              cudaMalloc(&sb, sizeof(float) * (size_t)E * nkb * N) == cudaSuccess &&
              cudaMalloc(&off, sizeof(int32_t) * (E + 1)) == cudaSuccess &&
              cudaMalloc(&o, sizeof(float) * (size_t)M * N) == cudaSuccess);
    cudaMemset(a, 0x38, (size_t)M * K);
    cudaMemset(b, 0x38, (size_t)E * N * K);
    cudaMemset(sa, 0, sizeof(float) * (size_t)M * nkb);
    cudaMemset(sb, 0, sizeof(float) * (size_t)E * nkb * N);
    cudaDeviceSynchronize(); /* before the kernels on the non-blocking stream */
    int32_t *h = malloc(sizeof(int32_t) * (E + 1));
    for (int e = 0; e <= E; e++)
        h[e] = e * T;
    cudaMemcpy(off, h, sizeof(int32_t) * (E + 1), cudaMemcpyHostToDevice);
    cudaDeviceSynchronize(); /* before the kernels on the non-blocking stream */
    free(h);
    const int old = cuda_fp8_grouped_gemm_config(config);
    TIME_CALLS(secs, gate_up ? cuda_fp8_grouped_gemm_h(o, a, sa, b, sb, off, E, M, N, K)
                             : cuda_fp8_grouped_gemm(o, a, sa, b, sb, off, E, M, N, K));
    cuda_fp8_grouped_gemm_config(old);
    cudaFree(a);
    cudaFree(b);
    cudaFree(sa);
    cudaFree(sb);
    cudaFree(off);
    cudaFree(o);
    return secs;
}

/* Seconds a call of the experts' GEMM 2 (cuda_fp8_w8a8_down: h quantized, then the GEMM with
 * its rows scattered to their pairs, fp32) over E experts of T rows, D x F weights, T E pairs in a
 * shuffled order, in one configuration. */
static double time_down(int E, int T, int D, int F, int config) {
    const int64_t n = (int64_t)E * T;
    void *h = NULL, *w = NULL, *sc = NULL, *off = NULL, *pr = NULL, *o = NULL;
    MS_ASSERT(cudaMalloc(&h, sizeof(uint16_t) * (size_t)n * F) == cudaSuccess &&
              cudaMalloc(&w, (size_t)E * D * F) == cudaSuccess &&
              cudaMalloc(&sc, sizeof(float) * (size_t)E * (F / 128) * D) == cudaSuccess &&
              cudaMalloc(&off, sizeof(int32_t) * (E + 1)) == cudaSuccess &&
              cudaMalloc(&pr, sizeof(int32_t) * (size_t)n) == cudaSuccess &&
              cudaMalloc(&o, sizeof(float) * (size_t)n * D) == cudaSuccess);
    cudaMemset(h, 0x3f, sizeof(uint16_t) * (size_t)n * F); /* about 0.75 */
    cudaMemset(w, 0x38, (size_t)E * D * F);
    cudaMemset(sc, 0, sizeof(float) * (size_t)E * (F / 128) * D);
    int32_t *hoff = malloc(sizeof(int32_t) * (E + 1)), *hp = shuffled_ids(n);
    for (int e = 0; e <= E; e++)
        hoff[e] = e * T;
    cudaMemcpy(off, hoff, sizeof(int32_t) * (E + 1), cudaMemcpyHostToDevice);
    cudaMemcpy(pr, hp, sizeof(int32_t) * (size_t)n, cudaMemcpyHostToDevice);
    cudaDeviceSynchronize(); /* before the kernels on the non-blocking stream */
    free(hoff);
    free(hp);
    const int old = cuda_fp8_grouped_gemm_config(config);
    TIME_CALLS(secs, cuda_fp8_w8a8_down(o, h, pr, off, E, n, D, F, w, sc, 1));
    cuda_fp8_grouped_gemm_config(old);
    cudaFree(h);
    cudaFree(w);
    cudaFree(sc);
    cudaFree(off);
    cudaFree(pr);
    cudaFree(o);
    return secs;
}

static void figures(void) {
    const size_t ws_bytes = (size_t)32 << 20;
    void *ws = NULL;
    MS_ASSERT(cudaMalloc(&ws, ws_bytes) == cudaSuccess);
    const int n = 8192;
    const double s_peak = time_cublaslt_fp8(n, n, n, ws, ws_bytes);
    const double peak = 2.0 * n * n * (double)n / s_peak / 1e12;
    printf("figures: cuBLASLt FP8 GEMM 8192^3 (E4M3 in, BF16 out): %.0f us, %.0f TFLOP/s (the "
           "peak below)\n",
           s_peak * 1e6, peak);
    /* experts, tokens an expert, N, K: 8 large experts, then the experts of a prefill chunk of
     * 4096 tokens at top-8 in Qwen3-30B-A3B's GEMM 1 (128 experts) and DeepSeek-V3's (256) */
    static const int shapes[][4] = {{8, 4096, 1536, 2048},  {8, 4096, 4096, 2048},
                                    {8, 4096, 1536, 7168},  {8, 4096, 4096, 7168},
                                    {128, 256, 1536, 2048}, {256, 128, 4096, 7168}};
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        const int E = shapes[i][0], T = shapes[i][1], N = shapes[i][2], K = shapes[i][3];
        const double fl = 2.0 * E * T * (double)N * K;
        const double cb = time_cublaslt_fp8(E * T, N, K, ws, ws_bytes);
        printf(
            "  %d experts x %d tokens, N %-4d K %-4d: cuBLASLt one GEMM of %d rows %7.1f us %4.0f "
            "TFLOP/s\n",
            E, T, N, K, E * T, cb * 1e6, fl / cb / 1e12);
        for (int ci = 0; ci < n_configs; ci++) {
            const int cf = configs[ci];
            const double g = time_grouped(E, T, N, K, cf, false);
            printf("    grouped, configuration %d: %7.1f us %4.0f TFLOP/s, %3.0f%% of the peak\n",
                   cf, g * 1e6, fl / g / 1e12, 100.0 * fl / g / 1e12 / peak);
        }
        /* as the experts run these shapes (N = 2F: GEMM 1): h = silu(gate) up in BF16, a quarter
         * of the fp32 form's output bytes, in the default configuration */
        const double g = time_grouped(E, T, N, K, -1, true);
        printf(
            "    GEMM 1's form (h in BF16, N / 2 columns), default configuration: %7.1f us %4.0f "
            "TFLOP/s, %3.0f%% of the peak\n",
            g * 1e6, fl / g / 1e12, 100.0 * fl / g / 1e12 / peak);
    }
    /* the experts' GEMM 2 at the prefill chunk's sizes (h quantized, rows scattered, fp32) */
    static const int downs[][4] = {{128, 256, 2048, 768}, {256, 128, 7168, 2048}};
    for (size_t i = 0; i < sizeof downs / sizeof downs[0]; i++) {
        const int E = downs[i][0], T = downs[i][1], D = downs[i][2], F = downs[i][3];
        const double fl = 2.0 * E * T * (double)D * F;
        printf("  GEMM 2's form, %d experts x %d tokens, D %d F %d (rows scattered, fp32):\n", E, T,
               D, F);
        for (int ci = 0; ci < n_down; ci++) {
            const double g = time_down(E, T, D, F, down_configs[ci]);
            printf("    configuration %d: %7.1f us %4.0f TFLOP/s, %3.0f%% of the peak\n",
                   down_configs[ci], g * 1e6, fl / g / 1e12, 100.0 * fl / g / 1e12 / peak);
        }
    }
    cudaFree(ws);
}

/* The GEMM (8 experts x 4096 tokens) over K in one configuration, beside cuBLASLt's one
 * GEMM of the same rows: a tile's k loop against its fixed part (time = tiles a block x (fixed + k
 * tiles x a k tile's time), so a line through the points). */
static void sweep_k(int config) {
    const size_t ws_bytes = (size_t)32 << 20;
    void *ws = NULL;
    MS_ASSERT(cudaMalloc(&ws, ws_bytes) == cudaSuccess);
    static const int Ns[] = {1536, 4096}, Ks[] = {1024, 2048, 3072, 4096, 5120, 7168};
    for (size_t i = 0; i < sizeof Ns / sizeof Ns[0]; i++)
        for (size_t j = 0; j < sizeof Ks / sizeof Ks[0]; j++) {
            const int E = 8, T = 4096, N = Ns[i], K = Ks[j];
            const double fl = 2.0 * E * T * (double)N * K;
            const double cb = time_cublaslt_fp8(E * T, N, K, ws, ws_bytes);
            const double g = time_grouped(E, T, N, K, config, false);
            printf("sweep: configuration %d, N %d K %d: %8.1f us %5.0f TFLOP/s; cuBLASLt %8.1f us "
                   "%5.0f TFLOP/s\n",
                   config, N, K, g * 1e6, fl / g / 1e12, cb * 1e6, fl / cb / 1e12);
        }
    cudaFree(ws);
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    char err[256];
    const ops *gpu = ops_cuda(0, err, sizeof err);
    if (!gpu) {
        printf("skipped: %s\n", err);
        printf("0 passed, 0 failed\n");
        return 0;
    }
    struct cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess || prop.major != 9) {
        printf("skipped: the wgmma kernel is built for sm_90a (Hopper)\n");
        printf("0 passed, 0 failed\n");
        return 0;
    }
    if (argc > 2 && strcmp(argv[1], "--configs") == 0) {
        n_configs = 0;
        for (const char *c = argv[2]; *c && n_configs < MAX_CONFIGS;
             c += strcspn(c, ",") + (c[strcspn(c, ",")] != 0))
            configs[n_configs++] = atoi(c);
        n_down = 0;
        for (int ci = 0; ci < n_configs; ci++)
            if (width(configs[ci]) == 128) down_configs[n_down++] = configs[ci];
    }
    if (argc > 2 && strcmp(argv[1], "--profile") == 0) { /* one shape, one configuration */
        const int N = argc > 3 ? atoi(argv[3]) : 4096, K = argc > 4 ? atoi(argv[4]) : 7168;
        const bool h = argc > 5 && strcmp(argv[5], "h") == 0; /* GEMM 1's form */
        MS_ASSERT(N > 0 && N % 128 == 0 && K > 0 && K % 128 == 0);
        const double g = time_grouped(8, 4096, N, K, atoi(argv[2]), h);
        printf("configuration %s: 8 experts x 4096 tokens, N %d K %d%s: %.1f us\n", argv[2], N, K,
               h ? ", GEMM 1's form" : "", g * 1e6);
        return 0;
    }
    if (argc > 2 && strcmp(argv[1], "--sweep") == 0) { /* K from 1024 to 7168, one configuration */
        sweep_k(atoi(argv[2]));
        return 0;
    }
    printf("FP8 grouped GEMM (wgmma) against the CPU\n");
    check_case("uneven experts", 5, (const int[]){0, 1, 130, 255, 7}, 256, 384);
    check_case("whole and cut tiles", 3, (const int[]){128, 128, 129}, 128, 128);
    check_case("no rows", 2, (const int[]){0, 0}, 128, 128);
    check_case("Qwen3-30B-A3B gate_up", 8, (const int[]){130, 17, 64, 0, 129, 1, 40, 3}, 1536,
               2048);
    check_case("Qwen3-30B-A3B down", 4, (const int[]){77, 300, 5, 128}, 2048, 768);
    check_case("DeepSeek-V3 gate_up", 2, (const int[]){40, 9}, 4096, 7168);
    printf("The experts' GEMM 2 (h quantized, rows scattered to their pairs) against the CPU\n");
    check_down("uneven experts", 5, (const int[]){0, 1, 130, 255, 7}, 256, 384, 250, 2);
    check_down("Qwen3-30B-A3B down", 8, (const int[]){40, 17, 0, 129, 64, 3, 200, 90}, 2048, 768,
               80, 8);
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
