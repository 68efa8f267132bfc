/* Tests of the CUDA backend (kernels/cuda/) against the CPU reference (kernels/cpu/): the same
 * random inputs (fixed seed, never zeros) go through ops_cpu() on host buffers and ops_cuda() on
 * device buffers (weights: a copy of the host tensor made usable with ops->upload). Device outputs
 * are poisoned with NaN first, so an element a kernel never wrote fails. Each comparison states
 * its tolerance |got - want| <= atol + rtol * |want| (linear: a bound relative to sum |x||w| per
 * output), prints the first mismatches, and the worst error of each op is listed at the end;
 * top-k ids and pure copies (embedding, kv_store) must match exactly.
 *
 * linear runs in both matmul precisions (ops_cuda_set_matmul_precision), each with its bound.
 *
 * Then, in the same run, figures: time per call of linear in both precisions on Qwen3-30B-A3B's
 * shapes (hidden 2048, q 4096, kv 512, 128 experts, vocab 151936) at decode and prefill token
 * counts, with the achieved bandwidth and TFLOP/s against two ceilings measured first: a 1 GiB
 * device-to-device copy and one 8192^3 BF16 GEMM through cuBLASLt; and, for T = 1..64, high
 * precision's decode kernel against its cuBLASLt path (where the threshold between them comes
 * from).
 *
 *   test_cuda_ops     run on GPU 0; without CUDA in the build or without a usable GPU it prints
 *                     "skipped: <reason>" and "0 passed, 0 failed"
 *   test_cuda_ops --chain   the decode GEMVs in one persistent launch against the same links
 *                     as kernels (check_decode_chain: bits and time a link); alone, outside the
 *                     default run until it has run on a GPU (a persistent kernel that waited
 *                     forever would hold scripts/gpu_check.sh until its timeout) */
#include <stdio.h>

#ifdef MOESERVE_CUDA

#include <cublasLt.h>
#include <cuda_runtime.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/tensor.h"
#include "kernels/a2a.h"
#include "kernels/ops.h"
#include "tests/check.h"
#include "tests/cublaslt_time.h"

/* The CUDA backend's stream (kernels/cuda/ops_cuda.cu, C linkage; its declaration in
 * kernels/cuda/cuda_ops.h is visible to CUDA C++ only). The timings record events on it. */
cudaStream_t cuda_stream(void);

static const ops *cpu, *gpu;

/* ---- random inputs ---- */

static uint64_t rng_state = 0x2545f4914f6cdd1dull;

static uint64_t mix64(uint64_t z) { /* splitmix64's output function */
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint64_t rng_next(void) { return mix64(rng_state += 0x9e3779b97f4a7c15ull); }

static int rng_int(int n) { return (int)(rng_next() % (uint64_t)n); }

/* Uniform in [-1, 1) from a 64-bit value, never exactly zero. */
static float to_uniform(uint64_t z) {
    float f = (float)((double)(z >> 11) / 9007199254740992.0 * 2.0 - 1.0);
    return f != 0.0f ? f : 0.5f;
}

/* p[n] uniform in [-scale, scale), never zero; counter-based so large fills run in parallel. */
static void fill_uniform(float *p, int64_t n, float scale) {
    const uint64_t seed = rng_next();
#pragma omp parallel for schedule(static) if (n >= (1 << 16))
    for (int64_t i = 0; i < n; i++)
        p[i] = to_uniform(mix64(seed + (uint64_t)i * 0x9e3779b97f4a7c15ull)) * scale;
}

static float *rand_floats(int64_t n, float scale) {
    float *p = xmalloc((size_t)(n > 0 ? n : 1) * sizeof(float));
    fill_uniform(p, n, scale);
    return p;
}

/* float -> IEEE half, nearest even, for values in the normal half range. */
static uint16_t f32_to_f16_normal(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint32_t sign = (u >> 16) & 0x8000u;
    const uint32_t e = ((u >> 23) & 0xffu) - 127 + 15, m = u & 0x7fffffu;
    uint32_t h = (e << 10) | (m >> 13);
    const uint32_t rest = m & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h++;
    return (uint16_t)(sign | h);
}

/* A host weight [rows, cols] of dtype dt (F32, BF16 or F16) from random floats in
 * [-scale, scale); F16 values stay in the normal range (|v| >= 2^-14). */
static tensor make_weight(dtype dt, int64_t rows, int64_t cols, float scale) {
    const int64_t n = rows * cols;
    float *v = rand_floats(n, scale);
    tensor w = {.dtype = dt, .ndim = 2, .shape = {rows, cols}, .device = DEVICE_CPU};
    if (dt == DTYPE_F32) {
        w.data = v;
        return w;
    }
    uint16_t *d = xmalloc((size_t)(n > 0 ? n : 1) * sizeof(uint16_t));
    for (int64_t i = 0; i < n; i++) {
        if (dt == DTYPE_BF16) {
            d[i] = f32_to_bf16(v[i]);
        } else {
            float f = v[i];
            if (fabsf(f) < 0x1p-14f) f = copysignf(0x1p-14f + fabsf(f), f);
            d[i] = f32_to_f16_normal(f);
        }
    }
    free(v);
    w.data = d;
    return w;
}

/* ---- device buffers ---- */

static void *gdup(const void *h, size_t bytes) {
    void *d = gpu->dev_alloc(bytes);
    MS_ASSERT(d);
    gpu->to_device(d, h, bytes);
    return d;
}

/* A device buffer of `bytes` filled with 0xff bytes (a NaN in every float). */
static void *galloc_poisoned(size_t bytes) {
    void *h = xmalloc(bytes ? bytes : 1);
    memset(h, 0xff, bytes);
    void *d = gdup(h, bytes);
    free(h);
    return d;
}

static void gpoison(void *d, size_t bytes) {
    void *h = xmalloc(bytes ? bytes : 1);
    memset(h, 0xff, bytes);
    gpu->to_device(d, h, bytes);
    free(h);
}

static void *gfetch(const void *d, size_t bytes) {
    void *h = xmalloc(bytes ? bytes : 1);
    gpu->to_host(h, d, bytes);
    return h;
}

/* The device copy of a host weight (upload points the copy's data at device memory). */
static tensor gpu_weight(const tensor *h) {
    tensor t = *h;
    char err[256];
    const int rc = gpu->upload(&t, err, sizeof err);
    CHECK(rc == 0, "upload: %s", err);
    MS_ASSERT(rc == 0);
    return t;
}

/* ---- comparison and the per-op summary ---- */

#define MAX_OPS 64
static struct {
    char op[48];
    char tolerance[48];
    double worst;      /* largest |got - want| (linear: divided by sum |x||w|) */
    double worst_frac; /* largest error / allowed error */
    int64_t checked;
} op_stats[MAX_OPS];
static int n_op_stats;

static void stat_add(const char *op, const char *tolerance, double worst, double frac, int64_t n) {
    int i = 0;
    while (i < n_op_stats && strcmp(op_stats[i].op, op) != 0)
        i++;
    if (i == n_op_stats) {
        MS_ASSERT(n_op_stats < MAX_OPS);
        n_op_stats++;
        snprintf(op_stats[i].op, sizeof op_stats[i].op, "%s", op);
        snprintf(op_stats[i].tolerance, sizeof op_stats[i].tolerance, "%s", tolerance);
    }
    if (worst > op_stats[i].worst || isnan(worst)) op_stats[i].worst = worst;
    if (frac > op_stats[i].worst_frac || isnan(frac)) op_stats[i].worst_frac = frac;
    op_stats[i].checked += n;
}

/* One CHECK for a whole array: every element within atol + rtol * |want| (NaN never is). */
static void compare(const char *op, const char *what, const float *got, const float *want,
                    int64_t n, double atol, double rtol) {
    int64_t bad = 0;
    double max_err = 0.0, max_frac = 0.0;
    for (int64_t i = 0; i < n; i++) {
        const double err = fabs((double)got[i] - want[i]);
        const double allowed = atol + rtol * fabs(want[i]);
        if (!(err <= allowed)) {
            if (bad < 5)
                fprintf(stderr, "  %s: [%lld] got %.9g want %.9g err %.3g\n", what, (long long)i,
                        got[i], want[i], err);
            bad++;
        }
        if (isnan(err) || err > max_err) max_err = isnan(err) ? INFINITY : err;
        if (allowed > 0 && err / allowed > max_frac) max_frac = err / allowed;
    }
    printf("  %-58s max abs err %.3g\n", what, max_err);
    char tol[64];
    snprintf(tol, sizeof tol, "atol %.0e + rtol %.0e", atol, rtol);
    stat_add(op, tol, max_err, max_frac, n);
    CHECK(bad == 0, "%s: %lld of %lld outside atol %g + rtol %g, max abs err %.3g", what,
          (long long)bad, (long long)n, atol, rtol, max_err);
}

/* Bitwise equality of two arrays of `n` elements of `size` bytes. */
static void compare_bits(const char *op, const char *what, const void *got, const void *want,
                         int64_t n, size_t size) {
    int64_t bad = 0;
    for (int64_t i = 0; i < n; i++)
        if (memcmp((const char *)got + i * size, (const char *)want + i * size, size) != 0) {
            if (bad < 5) fprintf(stderr, "  %s: element %lld differs\n", what, (long long)i);
            bad++;
        }
    printf("  %-58s %s\n", what, bad ? "DIFFERS" : "bit-identical");
    stat_add(op, "exact", bad ? INFINITY : 0.0, bad ? INFINITY : 0.0, n);
    CHECK(bad == 0, "%s: %lld of %lld elements differ", what, (long long)bad, (long long)n);
}

/* ---- the ops ---- */

static void test_embedding(void) {
    printf("embedding\n");
    static const struct {
        int V, D, T;
    } cases[] = {{1000, 2048, 37}, {50, 7, 1}, {300, 129, 0}, {32000, 2048, 4096}};
    const dtype dts[] = {DTYPE_F32, DTYPE_BF16, DTYPE_F16};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++)
        for (int di = 0; di < 3; di++) {
            const int V = cases[c].V, D = cases[c].D, T = cases[c].T;
            tensor table = make_weight(dts[di], V, D, 1.0f);
            tensor gtable = gpu_weight(&table);
            int32_t *ids = xmalloc(sizeof(int32_t) * (T + 1));
            for (int t = 0; t < T; t++)
                ids[t] = rng_int(V);
            if (T > 2) {
                ids[0] = V - 1;
                ids[1] = 0;
                ids[2] = ids[T - 1]; /* a repeated token */
            }
            const size_t bytes = sizeof(float) * (size_t)T * D;
            float *want = xmalloc(bytes + 4);
            cpu->embedding(want, &table, ids, T, D);
            int32_t *gids = gdup(ids, sizeof(int32_t) * T);
            float *gout = galloc_poisoned(bytes);
            gpu->embedding(gout, &gtable, gids, T, D);
            float *got = gfetch(gout, bytes);
            char what[96];
            snprintf(what, sizeof what, "embedding %s V=%d D=%d T=%d", dtype_name(dts[di]), V, D,
                     T);
            compare_bits("embedding", what, got, want, (int64_t)T * D, sizeof(float));
            free(got);
            free(want);
            free(ids);
            free(table.data);
            gpu->dev_free(gids);
            gpu->dev_free(gout);
            gpu->dev_free(gtable.data);
        }
}

static void test_rmsnorm(void) {
    printf("rmsnorm (atol 1e-6 + rtol 1e-6; the kernel repeats the CPU's arithmetic)\n");
    static const struct {
        int R, C, offset, in_place;
    } cases[] = {{1, 2048, 0, 0},  {37, 2048, 0, 0},   {512, 128, 0, 0},
                 {3, 77, 0, 0},    {0, 128, 0, 0},     {5, 128, 1, 0},
                 {64, 2048, 0, 1}, {8192, 2048, 0, 0}, {9, 4096, 1, 1}};
    const dtype dts[] = {DTYPE_F32, DTYPE_BF16, DTYPE_F16};
    const float eps = 1e-6f;
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++)
        for (int di = 0; di < 3; di++) {
            const int R = cases[c].R, C = cases[c].C, off = cases[c].offset;
            tensor w = make_weight(dts[di], 1, C, 1.5f);
            w.ndim = 1;
            w.shape[0] = C;
            tensor gw = gpu_weight(&w);
            const int64_t n = (int64_t)R * C;
            float *x = rand_floats(n, 3.0f);
            float *want = xmalloc(sizeof(float) * (n + 1));
            cpu->rmsnorm(want, x, &w, R, C, eps);
            /* device buffers of n + 1 floats; `off` = 1 shifts x and out off 16-byte alignment */
            float *gx = galloc_poisoned(sizeof(float) * (n + 1));
            gpu->to_device(gx + off, x, sizeof(float) * n);
            float *gout = cases[c].in_place ? gx : galloc_poisoned(sizeof(float) * (n + 1));
            gpu->rmsnorm(gout + off, gx + off, &gw, R, C, eps);
            float *got = gfetch(gout + off, sizeof(float) * n);
            char what[96];
            snprintf(what, sizeof what, "rmsnorm %s R=%d C=%d%s%s", dtype_name(dts[di]), R, C,
                     off ? " unaligned" : "", cases[c].in_place ? " in place" : "");
            compare("rmsnorm", what, got, want, n, 1e-6, 1e-6);
            /* a row's result does not depend on the batch: row R-1 alone, bit for bit */
            if (R > 1 && !cases[c].in_place) {
                gpu->to_device(gx + off, x + (int64_t)(R - 1) * C, sizeof(float) * C);
                gpu->rmsnorm(gout + off, gx + off, &gw, 1, C, eps);
                float *one = gfetch(gout + off, sizeof(float) * C);
                snprintf(what, sizeof what, "rmsnorm %s C=%d last row alone == in the batch",
                         dtype_name(dts[di]), C);
                compare_bits("rmsnorm batch invariance", what, one, got + (int64_t)(R - 1) * C, C,
                             sizeof(float));
                free(one);
            }
            free(got);
            free(want);
            free(x);
            free(w.data);
            if (gout != gx) gpu->dev_free(gout);
            gpu->dev_free(gx);
            gpu->dev_free(gw.data);
            if (R >= 4096) break; /* the large case in F32 weights only */
        }
}

static void test_rope(void) {
    printf("rope (atol 1e-6 + rtol 1e-6: cos/sin may differ from the CPU's by an ulp)\n");
    static const struct {
        int T, H, Hkv, Dh;
        double theta;
    } cases[] = {{1, 32, 4, 128, 1e6}, {37, 32, 4, 128, 1e6}, {5, 3, 1, 6, 1e4},
                 {0, 32, 4, 128, 1e6}, {7, 16, 16, 64, 1e4},  {2048, 32, 4, 128, 1e6}};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const int T = cases[c].T, H = cases[c].H, Hkv = cases[c].Hkv, Dh = cases[c].Dh;
        const int64_t nq = (int64_t)T * H * Dh, nk = (int64_t)T * Hkv * Dh;
        float *q = rand_floats(nq, 2.0f), *k = rand_floats(nk, 2.0f);
        int32_t *pos = xmalloc(sizeof(int32_t) * (T + 1));
        for (int t = 0; t < T; t++)
            pos[t] = rng_int(131072);
        if (T > 2) {
            pos[0] = 0;
            pos[1] = 131071;
            pos[2] = 1;
        }
        float *gq = gdup(q, sizeof(float) * nq), *gk = gdup(k, sizeof(float) * nk);
        int32_t *gpos = gdup(pos, sizeof(int32_t) * T);
        cpu->rope(q, k, pos, T, H, Hkv, Dh, cases[c].theta);
        gpu->rope(gq, gk, gpos, T, H, Hkv, Dh, cases[c].theta);
        float *got_q = gfetch(gq, sizeof(float) * nq), *got_k = gfetch(gk, sizeof(float) * nk);
        char what[96];
        snprintf(what, sizeof what, "rope q T=%d H=%d Dh=%d theta=%g", T, H, Dh, cases[c].theta);
        compare("rope", what, got_q, q, nq, 1e-6, 1e-6);
        snprintf(what, sizeof what, "rope k T=%d Hkv=%d Dh=%d theta=%g", T, Hkv, Dh,
                 cases[c].theta);
        compare("rope", what, got_k, k, nk, 1e-6, 1e-6);
        free(got_q);
        free(got_k);
        free(q);
        free(k);
        free(pos);
        gpu->dev_free(gq);
        gpu->dev_free(gk);
        gpu->dev_free(gpos);
    }
}

/* add_rmsnorm: x against the CPU's bits (an fp32 add is exact to compare), h with rmsnorm's
 * tolerance; and against CUDA's own add then rmsnorm, bit for bit (the fused kernel shares their
 * arithmetic). Cases cover each kernel path: sums kept in registers (D up to 2048, aligned), read
 * back (D = 4096), scalar (unaligned, D % 4 != 0). */
static void test_add_rmsnorm(void) {
    printf("add_rmsnorm (x exact; h atol 1e-6 + rtol 1e-6 as rmsnorm; == CUDA add + rmsnorm "
           "exactly)\n");
    static const struct {
        int T, D, offset;
    } cases[] = {{1, 2048, 0}, {37, 2048, 0}, {512, 128, 0},  {3, 77, 0},
                 {0, 128, 0},  {5, 128, 1},   {4, 260, 0},    {7, 1000, 0},
                 {9, 4096, 0}, {9, 4096, 1},  {8192, 2048, 0}};
    const dtype dts[] = {DTYPE_F32, DTYPE_BF16, DTYPE_F16};
    const float eps = 1e-6f;
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++)
        for (int di = 0; di < 3; di++) {
            const int T = cases[c].T, D = cases[c].D, off = cases[c].offset;
            tensor w = make_weight(dts[di], 1, D, 1.5f);
            w.ndim = 1;
            w.shape[0] = D;
            tensor gw = gpu_weight(&w);
            const int64_t n = (int64_t)T * D;
            const size_t bytes = sizeof(float) * n, padded = sizeof(float) * (n + 1);
            float *x = rand_floats(n, 3.0f), *o = rand_floats(n, 3.0f);
            float *want_x = xmalloc(padded), *want_h = xmalloc(padded);
            memcpy(want_x, x, bytes);
            cpu->add_rmsnorm(want_x, want_h, o, &w, T, D, eps);
            /* fused; `off` = 1 shifts every buffer off 16-byte alignment */
            float *gx = galloc_poisoned(padded), *go = galloc_poisoned(padded);
            float *gh = galloc_poisoned(padded);
            gpu->to_device(gx + off, x, bytes);
            gpu->to_device(go + off, o, bytes);
            gpu->add_rmsnorm(gx + off, gh + off, go + off, &gw, T, D, eps);
            float *got_x = gfetch(gx + off, bytes), *got_h = gfetch(gh + off, bytes);
            /* unfused on the GPU, same buffers refilled */
            gpu->to_device(gx + off, x, bytes);
            gpoison(gh, padded);
            gpu->add(gx + off, gx + off, go + off, n);
            gpu->rmsnorm(gh + off, gx + off, &gw, T, D, eps);
            float *un_x = gfetch(gx + off, bytes), *un_h = gfetch(gh + off, bytes);
            char what[96];
            const char *tail = off ? " unaligned" : "";
            snprintf(what, sizeof what, "add_rmsnorm x %s T=%d D=%d%s", dtype_name(dts[di]), T, D,
                     tail);
            compare_bits("add_rmsnorm x", what, got_x, want_x, n, sizeof(float));
            snprintf(what, sizeof what, "add_rmsnorm h %s T=%d D=%d%s", dtype_name(dts[di]), T, D,
                     tail);
            compare("add_rmsnorm h", what, got_h, want_h, n, 1e-6, 1e-6);
            snprintf(what, sizeof what, "add_rmsnorm x == CUDA add %s T=%d D=%d%s",
                     dtype_name(dts[di]), T, D, tail);
            compare_bits("add_rmsnorm vs unfused CUDA", what, got_x, un_x, n, sizeof(float));
            snprintf(what, sizeof what, "add_rmsnorm h == CUDA add + rmsnorm %s T=%d D=%d%s",
                     dtype_name(dts[di]), T, D, tail);
            compare_bits("add_rmsnorm vs unfused CUDA", what, got_h, un_h, n, sizeof(float));
            free(got_x);
            free(got_h);
            free(un_x);
            free(un_h);
            free(want_x);
            free(want_h);
            free(x);
            free(o);
            free(w.data);
            gpu->dev_free(gx);
            gpu->dev_free(go);
            gpu->dev_free(gh);
            gpu->dev_free(gw.data);
            if (T >= 4096) break; /* the large case in F32 weights only */
        }
}

/* qk_norm_rope against the CPU's with rope's tolerance (cos/sin may differ by an ulp), and
 * against CUDA's own rmsnorm, rmsnorm, rope bit for bit. q_norm and k_norm of different dtypes
 * take the unfused kernels (the last case). */
static void test_qk_norm_rope(void) {
    printf("qk_norm_rope (atol 1e-6 + rtol 1e-6 as rope; == CUDA rmsnorm + rope exactly)\n");
    static const struct {
        int T, H, Hkv, Dh, offset;
        double theta;
        dtype kdt; /* k_norm's dtype; DTYPE_I32 = q_norm's */
    } cases[] = {{1, 32, 4, 128, 0, 1e6, DTYPE_I32},    {37, 32, 4, 128, 0, 1e6, DTYPE_I32},
                 {5, 3, 1, 6, 0, 1e4, DTYPE_I32},       {0, 32, 4, 128, 0, 1e6, DTYPE_I32},
                 {7, 16, 16, 64, 0, 1e4, DTYPE_I32},    {3, 40, 8, 128, 0, 1e6, DTYPE_I32},
                 {2, 4, 2, 512, 0, 1e4, DTYPE_I32},     {9, 8, 2, 128, 1, 1e6, DTYPE_I32},
                 {2048, 32, 4, 128, 0, 1e6, DTYPE_I32}, {6, 8, 2, 128, 0, 1e6, DTYPE_F32}};
    const dtype dts[] = {DTYPE_F32, DTYPE_BF16, DTYPE_F16};
    const float eps = 1e-6f;
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++)
        for (int di = 0; di < 3; di++) {
            const int T = cases[c].T, H = cases[c].H, Hkv = cases[c].Hkv, Dh = cases[c].Dh;
            const int off = cases[c].offset;
            const double theta = cases[c].theta;
            const dtype kdt = cases[c].kdt == DTYPE_I32 ? dts[di] : cases[c].kdt;
            if (kdt == dts[di] && cases[c].kdt != DTYPE_I32) continue; /* not mixed after all */
            tensor qw = make_weight(dts[di], 1, Dh, 1.5f), kw = make_weight(kdt, 1, Dh, 1.5f);
            qw.ndim = kw.ndim = 1;
            qw.shape[0] = kw.shape[0] = Dh;
            tensor gqw = gpu_weight(&qw), gkw = gpu_weight(&kw);
            const int64_t nq = (int64_t)T * H * Dh, nk = (int64_t)T * Hkv * Dh;
            float *q = rand_floats(nq, 2.0f), *k = rand_floats(nk, 2.0f);
            int32_t *pos = xmalloc(sizeof(int32_t) * (T + 1));
            for (int t = 0; t < T; t++)
                pos[t] = rng_int(131072);
            if (T > 2) {
                pos[0] = 0;
                pos[1] = 131071;
                pos[2] = 1;
            }
            float *gq = galloc_poisoned(sizeof(float) * (nq + 1));
            float *gk = galloc_poisoned(sizeof(float) * (nk + 1));
            int32_t *gpos = gdup(pos, sizeof(int32_t) * T);
            gpu->to_device(gq + off, q, sizeof(float) * nq);
            gpu->to_device(gk + off, k, sizeof(float) * nk);
            gpu->qk_norm_rope(gq + off, gk + off, &gqw, &gkw, gpos, T, H, Hkv, Dh, theta, eps);
            float *got_q = gfetch(gq + off, sizeof(float) * nq);
            float *got_k = gfetch(gk + off, sizeof(float) * nk);
            gpu->to_device(gq + off, q, sizeof(float) * nq);
            gpu->to_device(gk + off, k, sizeof(float) * nk);
            gpu->rmsnorm(gq + off, gq + off, &gqw, T * H, Dh, eps);
            gpu->rmsnorm(gk + off, gk + off, &gkw, T * Hkv, Dh, eps);
            gpu->rope(gq + off, gk + off, gpos, T, H, Hkv, Dh, theta);
            float *un_q = gfetch(gq + off, sizeof(float) * nq);
            float *un_k = gfetch(gk + off, sizeof(float) * nk);
            cpu->qk_norm_rope(q, k, &qw, &kw, pos, T, H, Hkv, Dh, theta, eps);
            char what[112], dts_name[24];
            if (kdt == dts[di])
                snprintf(dts_name, sizeof dts_name, "%s", dtype_name(dts[di]));
            else
                snprintf(dts_name, sizeof dts_name, "%s/%s", dtype_name(dts[di]), dtype_name(kdt));
            snprintf(what, sizeof what, "qk_norm_rope q %s T=%d H=%d Dh=%d%s", dts_name, T, H, Dh,
                     off ? " unaligned" : "");
            compare("qk_norm_rope", what, got_q, q, nq, 1e-6, 1e-6);
            snprintf(what, sizeof what, "qk_norm_rope k %s T=%d Hkv=%d Dh=%d%s", dts_name, T, Hkv,
                     Dh, off ? " unaligned" : "");
            compare("qk_norm_rope", what, got_k, k, nk, 1e-6, 1e-6);
            snprintf(what, sizeof what, "qk_norm_rope q == CUDA rmsnorm + rope %s T=%d H=%d Dh=%d",
                     dts_name, T, H, Dh);
            compare_bits("qk_norm_rope vs unfused CUDA", what, got_q, un_q, nq, sizeof(float));
            snprintf(what, sizeof what, "qk_norm_rope k == CUDA rmsnorm + rope %s T=%d Hkv=%d",
                     dts_name, T, Hkv);
            compare_bits("qk_norm_rope vs unfused CUDA", what, got_k, un_k, nk, sizeof(float));
            free(got_q);
            free(got_k);
            free(un_q);
            free(un_k);
            free(q);
            free(k);
            free(pos);
            free(qw.data);
            free(kw.data);
            gpu->dev_free(gq);
            gpu->dev_free(gk);
            gpu->dev_free(gpos);
            gpu->dev_free(gqw.data);
            gpu->dev_free(gkw.data);
            if (T >= 1024) break; /* the large case in F32 weights only */
        }
}

static void test_kv_store(void) {
    printf("kv_store (exact)\n");
    static const struct {
        int T, n_seq, max_pages, S, Hkv, Dh;
    } cases[] = {{1, 2, 4, 16, 4, 128},
                 {37, 3, 4, 16, 4, 128},
                 {5, 2, 3, 5, 1, 7},
                 {0, 2, 4, 16, 4, 128},
                 {2048, 8, 32, 16, 4, 128}};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const int T = cases[c].T, n_seq = cases[c].n_seq, max_pages = cases[c].max_pages;
        const int S = cases[c].S, Hkv = cases[c].Hkv, Dh = cases[c].Dh;
        const int P = n_seq * max_pages, cap = max_pages * S;
        const int64_t row = (int64_t)Hkv * Dh, cache_n = (int64_t)P * S * row;
        /* pages: a random permutation; tokens: T distinct (seq, pos) slots, in random order */
        int32_t *table = xmalloc(sizeof(int32_t) * P);
        for (int i = 0; i < P; i++)
            table[i] = i;
        for (int i = P - 1; i > 0; i--) {
            const int j = rng_int(i + 1), tmp = table[i];
            table[i] = table[j];
            table[j] = tmp;
        }
        int32_t *slots = xmalloc(sizeof(int32_t) * n_seq * cap);
        for (int i = 0; i < n_seq * cap; i++)
            slots[i] = i;
        for (int i = 0; i < T; i++) {
            const int j = i + rng_int(n_seq * cap - i), tmp = slots[i];
            slots[i] = slots[j];
            slots[j] = tmp;
        }
        int32_t *pos = xmalloc(sizeof(int32_t) * (T + 1)),
                *seq = xmalloc(sizeof(int32_t) * (T + 1));
        for (int t = 0; t < T; t++) {
            seq[t] = slots[t] / cap;
            pos[t] = slots[t] % cap;
        }
        float *k = rand_floats((int64_t)T * row, 1.0f), *v = rand_floats((int64_t)T * row, 1.0f);
        float *kc = rand_floats(cache_n, 1.0f), *vc = rand_floats(cache_n, 1.0f);
        float *gk = gdup(k, sizeof(float) * T * row), *gv = gdup(v, sizeof(float) * T * row);
        float *gkc = gdup(kc, sizeof(float) * cache_n), *gvc = gdup(vc, sizeof(float) * cache_n);
        int32_t *gpos = gdup(pos, sizeof(int32_t) * T), *gseq = gdup(seq, sizeof(int32_t) * T);
        int32_t *gtable = gdup(table, sizeof(int32_t) * P);
        attn_batch hb = {.T = T,
                         .pos = pos,
                         .seq = seq,
                         .page_table = table,
                         .max_pages = max_pages,
                         .page_size = S};
        attn_batch gb = {.T = T,
                         .pos = gpos,
                         .seq = gseq,
                         .page_table = gtable,
                         .max_pages = max_pages,
                         .page_size = S};
        cpu->kv_store((kv_layer){kc, vc, 0}, k, v, &hb, Hkv, Dh);
        gpu->kv_store((kv_layer){gkc, gvc, 0}, gk, gv, &gb, Hkv, Dh);
        float *got_k = gfetch(gkc, sizeof(float) * cache_n);
        float *got_v = gfetch(gvc, sizeof(float) * cache_n);
        char what[96];
        snprintf(what, sizeof what, "kv_store T=%d pages=%d S=%d Hkv=%d Dh=%d (whole cache)", T, P,
                 S, Hkv, Dh);
        compare_bits("kv_store", what, got_k, kc, cache_n, sizeof(float));
        compare_bits("kv_store", what, got_v, vc, cache_n, sizeof(float));
        { /* a BF16 cache: the CPU's rounding, bit for bit */
            uint16_t *bk = xmalloc(sizeof(uint16_t) * cache_n),
                     *bv = xmalloc(sizeof(uint16_t) * cache_n);
            for (int64_t i = 0; i < cache_n; i++)
                bk[i] = f32_to_bf16(kc[i] * 0.5f), bv[i] = f32_to_bf16(vc[i] * 0.5f);
            uint16_t *gbk = gdup(bk, sizeof(uint16_t) * cache_n),
                     *gbv = gdup(bv, sizeof(uint16_t) * cache_n);
            cpu->kv_store((kv_layer){(float *)(void *)bk, (float *)(void *)bv, 1}, k, v, &hb, Hkv,
                          Dh);
            gpu->kv_store((kv_layer){(float *)(void *)gbk, (float *)(void *)gbv, 1}, gk, gv, &gb,
                          Hkv, Dh);
            uint16_t *got_bk = gfetch(gbk, sizeof(uint16_t) * cache_n);
            uint16_t *got_bv = gfetch(gbv, sizeof(uint16_t) * cache_n);
            snprintf(what, sizeof what, "kv_store BF16 T=%d pages=%d S=%d Hkv=%d Dh=%d", T, P, S,
                     Hkv, Dh);
            compare_bits("kv_store bf16", what, got_bk, bk, cache_n, sizeof(uint16_t));
            compare_bits("kv_store bf16", what, got_bv, bv, cache_n, sizeof(uint16_t));
            free(bk), free(bv), free(got_bk), free(got_bv);
            gpu->dev_free(gbk);
            gpu->dev_free(gbv);
        }
        free(got_k);
        free(got_v);
        free(k);
        free(v);
        free(kc);
        free(vc);
        free(pos);
        free(seq);
        free(table);
        free(slots);
        gpu->dev_free(gk);
        gpu->dev_free(gv);
        gpu->dev_free(gkc);
        gpu->dev_free(gvc);
        gpu->dev_free(gpos);
        gpu->dev_free(gseq);
        gpu->dev_free(gtable);
    }
}

/* qkv_prepare against the CPU's (the composition it replaces: split, qk_norm_rope, kv_store) with
 * rope's tolerance for q and the k cache, v exactly; and against CUDA's own split + qk_norm_rope
 * + kv_store bit for bit. Cases: a decode token, a few tokens (heads spread over blocks), 70
 * tokens (one block per token), an odd head size (scalar path). */
static void test_qkv_prepare(void) {
    printf("qkv_prepare (q, k cache atol 1e-6 + rtol 1e-6 as rope; v exact; == CUDA split + "
           "qk_norm_rope + kv_store exactly)\n");
    static const struct {
        int T, n_seq, max_pages, S, H, Hkv, Dh;
    } cases[] = {{1, 2, 4, 16, 32, 4, 128}, {37, 3, 4, 16, 32, 4, 128}, {70, 4, 8, 16, 32, 4, 128},
                 {5, 2, 3, 5, 3, 1, 6},     {0, 2, 4, 16, 32, 4, 128},  {9, 2, 4, 16, 8, 2, 64}};
    const dtype dts[] = {DTYPE_F32, DTYPE_BF16, DTYPE_F16};
    const float eps = 1e-6f;
    const double theta = 1e6;
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++)
        for (int di = 0; di < 3; di++) {
            const int T = cases[c].T, n_seq = cases[c].n_seq, max_pages = cases[c].max_pages;
            const int S = cases[c].S, H = cases[c].H, Hkv = cases[c].Hkv, Dh = cases[c].Dh;
            const int P = n_seq * max_pages, cap = max_pages * S;
            const int64_t qd = (int64_t)H * Dh, kvd = (int64_t)Hkv * Dh, row = qd + 2 * kvd;
            const int64_t cache_n = (int64_t)P * S * kvd;
            tensor qw = make_weight(dts[di], 1, Dh, 1.5f), kw = make_weight(dts[di], 1, Dh, 1.5f);
            qw.ndim = kw.ndim = 1;
            qw.shape[0] = kw.shape[0] = Dh;
            tensor gqw = gpu_weight(&qw), gkw = gpu_weight(&kw);
            /* pages: a random permutation; tokens: T distinct (seq, pos) slots in random order */
            int32_t *table = xmalloc(sizeof(int32_t) * P);
            for (int i = 0; i < P; i++)
                table[i] = i;
            for (int i = P - 1; i > 0; i--) {
                const int j = rng_int(i + 1), tmp = table[i];
                table[i] = table[j];
                table[j] = tmp;
            }
            int32_t *slots = xmalloc(sizeof(int32_t) * n_seq * cap);
            for (int i = 0; i < n_seq * cap; i++)
                slots[i] = i;
            for (int i = 0; i < T; i++) {
                const int j = i + rng_int(n_seq * cap - i), tmp = slots[i];
                slots[i] = slots[j];
                slots[j] = tmp;
            }
            int32_t *pos = xmalloc(sizeof(int32_t) * (T + 1)),
                    *seq = xmalloc(sizeof(int32_t) * (T + 1));
            for (int t = 0; t < T; t++) {
                seq[t] = slots[t] / cap;
                pos[t] = slots[t] % cap;
            }
            float *qkv = rand_floats(T * row, 2.0f);
            float *kc = rand_floats(cache_n, 1.0f), *vc = rand_floats(cache_n, 1.0f);
            float *q = xmalloc(sizeof(float) * (T * qd + 1));
            float *k = xmalloc(sizeof(float) * (T * kvd + 1)), *v = xmalloc(sizeof(float) * (T * kvd + 1));
            for (int t = 0; t < T; t++) {
                memcpy(q + t * qd, qkv + t * row, sizeof(float) * qd);
                memcpy(k + t * kvd, qkv + t * row + qd, sizeof(float) * kvd);
                memcpy(v + t * kvd, qkv + t * row + qd + kvd, sizeof(float) * kvd);
            }
            int32_t *gpos = gdup(pos, sizeof(int32_t) * T), *gseq = gdup(seq, sizeof(int32_t) * T);
            int32_t *gtable = gdup(table, sizeof(int32_t) * P);
            attn_batch hb = {.T = T, .pos = pos, .seq = seq, .page_table = table,
                             .max_pages = max_pages, .page_size = S};
            attn_batch gb = {.T = T, .pos = gpos, .seq = gseq, .page_table = gtable,
                             .max_pages = max_pages, .page_size = S};
            /* fused on the GPU */
            float *gqkv = gdup(qkv, sizeof(float) * T * row);
            float *gkc = gdup(kc, sizeof(float) * cache_n), *gvc = gdup(vc, sizeof(float) * cache_n);
            float *gq = galloc_poisoned(sizeof(float) * (T * qd + 1));
            gpu->qkv_prepare(gq, (kv_layer){gkc, gvc, 0}, gqkv, &gqw, &gkw, &gb, H, Hkv, Dh, theta,
                             eps);
            float *got_q = gfetch(gq, sizeof(float) * T * qd);
            float *got_kc = gfetch(gkc, sizeof(float) * cache_n);
            float *got_vc = gfetch(gvc, sizeof(float) * cache_n);
            /* unfused on the GPU, from the host's split */
            gpu->to_device(gkc, kc, sizeof(float) * cache_n);
            gpu->to_device(gvc, vc, sizeof(float) * cache_n);
            float *gk = gdup(k, sizeof(float) * T * kvd), *gv = gdup(v, sizeof(float) * T * kvd);
            gpu->to_device(gq, q, sizeof(float) * T * qd);
            gpu->qk_norm_rope(gq, gk, &gqw, &gkw, gpos, T, H, Hkv, Dh, theta, eps);
            gpu->kv_store((kv_layer){gkc, gvc, 0}, gk, gv, &gb, Hkv, Dh);
            float *un_q = gfetch(gq, sizeof(float) * T * qd);
            float *un_kc = gfetch(gkc, sizeof(float) * cache_n);
            float *un_vc = gfetch(gvc, sizeof(float) * cache_n);
            /* the CPU reference */
            float *want_q = xmalloc(sizeof(float) * (T * qd + 1));
            cpu->qkv_prepare(want_q, (kv_layer){kc, vc, 0}, qkv, &qw, &kw, &hb, H, Hkv, Dh, theta,
                             eps);
            char what[112];
            snprintf(what, sizeof what, "qkv_prepare %s T=%d H=%d Hkv=%d Dh=%d", dtype_name(dts[di]),
                     T, H, Hkv, Dh);
            compare("qkv_prepare q", what, got_q, want_q, T * qd, 1e-6, 1e-6);
            compare("qkv_prepare k cache", what, got_kc, kc, cache_n, 1e-6, 1e-6);
            compare_bits("qkv_prepare v cache", what, got_vc, vc, cache_n, sizeof(float));
            compare_bits("qkv_prepare vs unfused q", what, got_q, un_q, T * qd, sizeof(float));
            compare_bits("qkv_prepare vs unfused k", what, got_kc, un_kc, cache_n,
                         sizeof(float));
            compare_bits("qkv_prepare vs unfused v", what, got_vc, un_vc, cache_n,
                         sizeof(float));
            { /* into a BF16 cache: fused == unfused bit for bit, v == the CPU's rounding */
                const size_t hb16 = sizeof(uint16_t) * cache_n;
                uint16_t *bz = xcalloc(cache_n, sizeof(uint16_t));
                uint16_t *gbk = gdup(bz, hb16), *gbv = gdup(bz, hb16);
                const kv_layer gkv = {(float *)(void *)gbk, (float *)(void *)gbv, 1};
                float *gqkv2 = gdup(qkv, sizeof(float) * T * row);
                gpu->qkv_prepare(gq, gkv, gqkv2, &gqw, &gkw, &gb, H, Hkv, Dh, theta, eps);
                uint16_t *f_k = gfetch(gbk, hb16), *f_v = gfetch(gbv, hb16);
                gpu->to_device(gbk, bz, hb16);
                gpu->to_device(gbv, bz, hb16);
                gpu->to_device(gk, k, sizeof(float) * T * kvd);
                gpu->to_device(gq, q, sizeof(float) * T * qd);
                gpu->qk_norm_rope(gq, gk, &gqw, &gkw, gpos, T, H, Hkv, Dh, theta, eps);
                gpu->kv_store(gkv, gk, gv, &gb, Hkv, Dh);
                uint16_t *u_k = gfetch(gbk, hb16), *u_v = gfetch(gbv, hb16);
                uint16_t *c_k = xcalloc(cache_n, sizeof(uint16_t)),
                         *c_v = xcalloc(cache_n, sizeof(uint16_t));
                float *cq = xmalloc(sizeof(float) * (T * qd + 1));
                cpu->qkv_prepare(cq, (kv_layer){(float *)(void *)c_k, (float *)(void *)c_v, 1}, qkv,
                                 &qw, &kw, &hb, H, Hkv, Dh, theta, eps);
                compare_bits("qkv_prepare bf16 vs unfused k", what, f_k, u_k, cache_n,
                             sizeof(uint16_t));
                compare_bits("qkv_prepare bf16 vs unfused v", what, f_v, u_v, cache_n,
                             sizeof(uint16_t));
                compare_bits("qkv_prepare bf16 v cache", what, f_v, c_v, cache_n, sizeof(uint16_t));
                int64_t far =
                    0; /* k: the fp32 values agree within 1e-6, so at most one BF16 step */
                for (int64_t i = 0; i < cache_n; i++)
                    far += fabsf(bf16_to_f32(f_k[i]) - bf16_to_f32(c_k[i])) >
                           fabsf(bf16_to_f32(c_k[i])) * 0x1p-7f;
                CHECK(far == 0, "%s: qkv_prepare bf16 k cache: %lld values past one BF16 step",
                      what, (long long)far);
                free(bz), free(f_k), free(f_v), free(u_k), free(u_v), free(c_k), free(c_v),
                    free(cq);
                gpu->dev_free(gbk);
                gpu->dev_free(gbv);
                gpu->dev_free(gqkv2);
            }
            free(got_q), free(got_kc), free(got_vc), free(un_q), free(un_kc), free(un_vc);
            free(want_q), free(q), free(k), free(v), free(qkv), free(kc), free(vc);
            free(pos), free(seq), free(table), free(slots), free(qw.data), free(kw.data);
            void *g[] = {gq, gk, gv, gqkv, gkc, gvc, gpos, gseq, gtable, gqw.data, gkw.data};
            for (size_t i = 0; i < sizeof g / sizeof g[0]; i++)
                gpu->dev_free(g[i]);
        }
}

/* moe_finalize_add_rmsnorm: x against the CPU's bits (finalize and the add are exact to compare),
 * h with rmsnorm's tolerance; and bit for bit against CUDA's moe_finalize then add_rmsnorm. */
static void test_moe_finalize_add_rmsnorm(void) {
    printf("moe_finalize_add_rmsnorm (x exact; h atol 1e-6 + rtol 1e-6; == CUDA moe_finalize + "
           "add_rmsnorm exactly)\n");
    static const struct {
        int T, K, D;
    } cases[] = {{1, 8, 2048}, {37, 8, 2048}, {5, 3, 7168}, {0, 8, 2048}, {300, 8, 2048},
                 {4, 1, 64},   {3, 9, 4096}};
    const dtype dts[] = {DTYPE_F32, DTYPE_BF16, DTYPE_F16};
    const float eps = 1e-6f;
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++)
        for (int di = 0; di < 3; di++) {
            const int T = cases[c].T, K = cases[c].K, D = cases[c].D;
            tensor w = make_weight(dts[di], 1, D, 1.5f);
            w.ndim = 1;
            w.shape[0] = D;
            tensor gw = gpu_weight(&w);
            const int64_t n = (int64_t)T * D;
            float *x = rand_floats(n, 3.0f), *eo = rand_floats(n * K, 3.0f);
            float *tw = rand_floats((int64_t)T * K, 1.0f);
            float *want_x = xmalloc(sizeof(float) * (n + 1)), *want_h = xmalloc(sizeof(float) * (n + 1));
            memcpy(want_x, x, sizeof(float) * n);
            cpu->moe_finalize_add_rmsnorm(want_x, want_h, eo, tw, &w, T, K, D, eps);
            float *gx = gdup(x, sizeof(float) * n), *geo = gdup(eo, sizeof(float) * n * K);
            float *gtw = gdup(tw, sizeof(float) * T * K);
            float *gh = galloc_poisoned(sizeof(float) * (n + 1));
            float *go = galloc_poisoned(sizeof(float) * (n + 1));
            gpu->moe_finalize_add_rmsnorm(gx, gh, geo, gtw, &gw, T, K, D, eps);
            float *got_x = gfetch(gx, sizeof(float) * n), *got_h = gfetch(gh, sizeof(float) * n);
            gpu->to_device(gx, x, sizeof(float) * n);
            gpu->moe_finalize(go, geo, gtw, T, K, D);
            gpu->add_rmsnorm(gx, gh, go, &gw, T, D, eps);
            float *un_x = gfetch(gx, sizeof(float) * n), *un_h = gfetch(gh, sizeof(float) * n);
            char what[96];
            snprintf(what, sizeof what, "moe_finalize_add_rmsnorm %s T=%d K=%d D=%d",
                     dtype_name(dts[di]), T, K, D);
            compare_bits("moe_finalize_add_rmsnorm x", what, got_x, want_x, n, sizeof(float));
            compare("moe_finalize_add_rmsnorm h", what, got_h, want_h, n, 1e-6, 1e-6);
            compare_bits("moe_fin_add_rmsnorm vs unfused x", what, got_x, un_x, n,
                         sizeof(float));
            compare_bits("moe_fin_add_rmsnorm vs unfused h", what, got_h, un_h, n,
                         sizeof(float));
            free(got_x), free(got_h), free(un_x), free(un_h), free(want_x), free(want_h);
            free(x), free(eo), free(tw), free(w.data);
            void *g[] = {gx, geo, gtw, gh, go, gw.data};
            for (size_t i = 0; i < sizeof g / sizeof g[0]; i++)
                gpu->dev_free(g[i]);
        }
}

static void test_router_topk(void) {
    printf("router_topk (ids exact; weights atol 1e-7 + rtol 1e-6)\n");
    static const struct {
        int T, E, K, norm, ties;
    } cases[] = {{1, 128, 8, 1, 0}, {37, 128, 8, 1, 0},  {37, 128, 8, 0, 0},  {5, 7, 3, 1, 0},
                 {0, 128, 8, 1, 0}, {64, 256, 8, 1, 0},  {100, 128, 8, 1, 1}, {3, 8, 8, 1, 0},
                 {33, 60, 4, 0, 1}, {4096, 128, 8, 1, 0}};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const int T = cases[c].T, E = cases[c].E, K = cases[c].K;
        const bool norm = cases[c].norm;
        float *logits = rand_floats((int64_t)T * E, 4.0f);
        if (cases[c].ties) /* a few distinct values: many equal probabilities */
            for (int64_t i = 0; i < (int64_t)T * E; i++)
                logits[i] = roundf(logits[i]) * 0.5f + 0.25f;
        int32_t *ids = xmalloc(sizeof(int32_t) * (T * K + 1));
        float *w = xmalloc(sizeof(float) * (T * K + 1));
        cpu->router_topk(ids, w, logits, T, E, K, norm);
        float *glogits = gdup(logits, sizeof(float) * T * E);
        int32_t *gids = galloc_poisoned(sizeof(int32_t) * T * K);
        float *gw = galloc_poisoned(sizeof(float) * T * K);
        gpu->router_topk(gids, gw, glogits, T, E, K, norm);
        int32_t *got_ids = gfetch(gids, sizeof(int32_t) * T * K);
        float *got_w = gfetch(gw, sizeof(float) * T * K);
        char what[96];
        snprintf(what, sizeof what, "router_topk ids T=%d E=%d K=%d%s%s", T, E, K,
                 norm ? " norm" : "", cases[c].ties ? " ties" : "");
        compare_bits("router_topk ids", what, got_ids, ids, (int64_t)T * K, sizeof(int32_t));
        snprintf(what, sizeof what, "router_topk weights T=%d E=%d K=%d%s%s", T, E, K,
                 norm ? " norm" : "", cases[c].ties ? " ties" : "");
        compare("router_topk weights", what, got_w, w, (int64_t)T * K, 1e-7, 1e-6);
        free(got_ids);
        free(got_w);
        free(ids);
        free(w);
        free(logits);
        gpu->dev_free(glogits);
        gpu->dev_free(gids);
        gpu->dev_free(gw);
    }
}

static void test_moe_finalize(void) {
    printf("moe_finalize (atol 1e-6 + rtol 1e-6; the same slot order and roundings as the CPU)\n");
    static const struct {
        int T, K, D, offset;
    } cases[] = {{1, 8, 2048, 0}, {37, 8, 2048, 0}, {5, 3, 7, 0},
                 {0, 8, 2048, 0}, {3, 8, 2048, 1},  {4096, 8, 2048, 0}};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const int T = cases[c].T, K = cases[c].K, D = cases[c].D, off = cases[c].offset;
        const int64_t n_in = (int64_t)T * K * D, n = (int64_t)T * D;
        float *eo = rand_floats(n_in, 2.0f), *w = rand_floats((int64_t)T * K, 1.0f);
        float *want = xmalloc(sizeof(float) * (n + 1));
        cpu->moe_finalize(want, eo, w, T, K, D);
        float *geo = galloc_poisoned(sizeof(float) * (n_in + 1));
        gpu->to_device(geo + off, eo, sizeof(float) * n_in);
        float *gw = gdup(w, sizeof(float) * T * K);
        float *gout = galloc_poisoned(sizeof(float) * (n + 1));
        gpu->moe_finalize(gout + off, geo + off, gw, T, K, D);
        float *got = gfetch(gout + off, sizeof(float) * n);
        char what[96];
        snprintf(what, sizeof what, "moe_finalize T=%d K=%d D=%d%s", T, K, D,
                 off ? " unaligned" : "");
        compare("moe_finalize", what, got, want, n, 1e-6, 1e-6);
        free(got);
        free(want);
        free(eo);
        free(w);
        gpu->dev_free(geo);
        gpu->dev_free(gw);
        gpu->dev_free(gout);
    }
}

/* moe_input_quant: each token through the fp8 or nvfp4 payload's round trip, bit for bit the
 * CPU's (a2a_payload_roundtrip); rows of zeros, tiny and huge values, a partial FP8 group. */
static void test_moe_input_quant(void) {
    printf("moe_input_quant (fp8, nvfp4: exact)\n");
    static const struct {
        int T, D;
    } cases[] = {{1, 2048}, {5, 7168}, {37, 2048}, {3, 144}, {4, 64}, {0, 2048}};
    const int payloads[] = {A2A_PAYLOAD_FP8, A2A_PAYLOAD_NVFP4, A2A_PAYLOAD_F32};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++)
        for (int pi = 0; pi < 3; pi++) {
            const int T = cases[c].T, D = cases[c].D, p = payloads[pi];
            const int64_t n = (int64_t)T * D;
            float *x = rand_floats(n, 3.0f);
            for (int t = 0; t < T; t++) { /* row 1 zeros, row 2 tiny, row 3 huge */
                float f = t == 1 ? 0.0f : t == 2 ? 1e-30f : t == 3 ? 1e30f : 1.0f;
                for (int d = 0; d < D; d++)
                    x[(int64_t)t * D + d] *= f;
            }
            float *want = xmalloc(sizeof(float) * (n + 1));
            cpu->moe_input_quant(want, x, T, D, p);
            float *gx = gdup(x, sizeof(float) * (n + 1)), *gy = galloc_poisoned(sizeof(float) * (n + 1));
            gpu->moe_input_quant(gy, gx, T, D, p);
            float *got = gfetch(gy, sizeof(float) * n);
            gpu->moe_input_quant(gx, gx, T, D, p); /* in place */
            float *got_in = gfetch(gx, sizeof(float) * n);
            char what[96];
            snprintf(what, sizeof what, "moe_input_quant %s T=%d D=%d",
                     a2a_payload_name((a2a_payload)p), T, D);
            compare_bits("moe_input_quant", what, got, want, n, sizeof(float));
            compare_bits("moe_input_quant in place", what, got_in, want, n, sizeof(float));
            free(x), free(want), free(got), free(got_in);
            gpu->dev_free(gx), gpu->dev_free(gy);
        }
}

static void test_silu_mul(void) {
    printf("silu_mul (atol 1e-7 + rtol 1e-6: the device expf is within 2 ulp)\n");
    static const struct {
        int T, F, offset, in_place;
    } cases[] = {{1, 768, 0, 0}, {37, 768, 0, 0}, {3, 77, 0, 0},     {0, 768, 0, 0},
                 {5, 768, 1, 0}, {9, 768, 0, 1},  {4096, 6144, 0, 0}};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const int T = cases[c].T, F = cases[c].F, off = cases[c].offset;
        const int64_t n = (int64_t)T * F;
        float *g = rand_floats(n, 12.0f), *u = rand_floats(n, 2.0f);
        float *want = xmalloc(sizeof(float) * (n + 1));
        cpu->silu_mul(want, g, u, T, F);
        float *gg = galloc_poisoned(sizeof(float) * (n + 1));
        float *gu = galloc_poisoned(sizeof(float) * (n + 1));
        gpu->to_device(gg + off, g, sizeof(float) * n);
        gpu->to_device(gu + off, u, sizeof(float) * n);
        float *gout = cases[c].in_place ? gg : galloc_poisoned(sizeof(float) * (n + 1));
        gpu->silu_mul(gout + off, gg + off, gu + off, T, F);
        float *got = gfetch(gout + off, sizeof(float) * n);
        char what[96];
        snprintf(what, sizeof what, "silu_mul T=%d F=%d%s%s", T, F, off ? " unaligned" : "",
                 cases[c].in_place ? " in place" : "");
        compare("silu_mul", what, got, want, n, 1e-7, 1e-6);
        free(got);
        free(want);
        free(g);
        free(u);
        if (gout != gg) gpu->dev_free(gout);
        gpu->dev_free(gg);
        gpu->dev_free(gu);
    }
}

static void test_add(void) {
    printf("add (exact)\n");
    static const struct {
        int64_t n;
        int offset, in_place;
    } cases[] = {{1, 0, 0},       {7, 0, 0},    {1000003, 0, 0}, {0, 0, 0},
                 {1000003, 1, 0}, {4099, 0, 1}, {1 << 24, 0, 0}};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const int64_t n = cases[c].n;
        const int off = cases[c].offset;
        float *a = rand_floats(n, 4.0f), *b = rand_floats(n, 4.0f);
        float *want = xmalloc(sizeof(float) * (n + 1));
        cpu->add(want, a, b, n);
        float *ga = galloc_poisoned(sizeof(float) * (n + 1));
        float *gb = galloc_poisoned(sizeof(float) * (n + 1));
        gpu->to_device(ga + off, a, sizeof(float) * n);
        gpu->to_device(gb + off, b, sizeof(float) * n);
        float *gout = cases[c].in_place ? ga : galloc_poisoned(sizeof(float) * (n + 1));
        gpu->add(gout + off, ga + off, gb + off, n);
        float *got = gfetch(gout + off, sizeof(float) * n);
        char what[96];
        snprintf(what, sizeof what, "add n=%lld%s%s", (long long)n, off ? " unaligned" : "",
                 cases[c].in_place ? " in place" : "");
        compare_bits("add", what, got, want, n, sizeof(float));
        free(got);
        free(want);
        free(a);
        free(b);
        if (gout != ga) gpu->dev_free(gout);
        gpu->dev_free(ga);
        gpu->dev_free(gb);
    }
}

/* linear: the CPU multiplies fp32 x by the widened weights and sums in fp32. Per output, with
 * S = sum_k |x_k||w_nk|, the GPU is within (u + 2 Kin 2^-24) S of it, where 2 Kin 2^-24 S bounds
 * the fp32 accumulation error of each side and u is what happens to x first:
 *   medium  x rounded to the weight's 16-bit dtype: u = 2^-8 (BF16), 2^-11 (F16)
 *   high    x carried as hi + lo in 16 bits (stacked GEMM, two GEMMs): u = 2^-16 (BF16), 2^-22
 *           (F16); the decode kernel keeps x in fp32 (u = 0) and is held to the same bound
 *   F32 weights, either precision: u = 0.
 * Every high-precision path is checked at every T it can take (the decode kernel up to T = 32,
 * its largest tile), whatever the thresholds. The worst err / S is printed. A token's row from
 * the decode kernel must be the same bits alone as in the batch (token 0 and token T - 1, each at
 * T = 1); through cuBLASLt another T may bring another algorithm, so there the difference is only
 * reported (see kernels/cuda/linear.cu). */

/* kernels/cuda/linear.cu, for tests: with max_t >= 0, T up to max_t takes the decode kernel, or
 * the stacked GEMM, in high precision; each returns the value in force before. */
int cuda_linear_decode_max_t(int max_t);
int cuda_linear_stack_max_t(int max_t);
/* From T = min_t on (0: every T; -1: linear.cu's choice again), BF16 weights outside deterministic
 * mode take moe.cu's tiles (cuda_linear_tiles) in either precision; returns the value before. */
int cuda_linear_tiles_min_t(int min_t);
/* The blocks cuda_linear_tiles cuts k ranges for (<= 0: its default); returns the value before. */
int cuda_linear_tiles_blocks(int blocks);

static const char *prec_name(matmul_precision p) {
    return p == MATMUL_PRECISION_HIGH ? "high" : "medium";
}

static void set_precision(matmul_precision p) {
    char err[128];
    const int rc = ops_cuda_set_matmul_precision(prec_name(p), err, sizeof err);
    CHECK(rc == 0 && ops_cuda_matmul_precision() == p, "set matmul precision %s: %s",
          prec_name(p), err);
}

static double linear_u(dtype dt, matmul_precision p) {
    if (dt == DTYPE_F32) return 0.0;
    if (p == MATMUL_PRECISION_MEDIUM) return dt == DTYPE_BF16 ? 0x1p-8 : 0x1p-11;
    return dt == DTYPE_BF16 ? 0x1p-16 : 0x1p-22;
}

static const char *linear_u_name(dtype dt, matmul_precision p) {
    if (dt == DTYPE_F32) return "0";
    if (p == MATMUL_PRECISION_MEDIUM) return dt == DTYPE_BF16 ? "2^-8" : "2^-11";
    return dt == DTYPE_BF16 ? "2^-16" : "2^-22";
}

/* One weight [N, Kin] of dtype dt, on both sides, with |w| in F32 for the bound. */
typedef struct {
    tensor w, gw, aw;
    int N, Kin;
} linear_weight;

static linear_weight linear_weight_make(dtype dt, int N, int Kin) {
    linear_weight lw = {.N = N, .Kin = Kin};
    lw.w = make_weight(dt, N, Kin, 1.0f / sqrtf((float)(Kin > 0 ? Kin : 1)));
    lw.gw = gpu_weight(&lw.w);
    lw.aw = make_weight(DTYPE_F32, N, Kin, 1.0f);
    float *awd = lw.aw.data;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < (int64_t)N * Kin; i++)
        awd[i] = fabsf(tensor_get_f32(&lw.w, i));
    return lw;
}

static void linear_weight_free(linear_weight *lw) {
    free(lw->w.data);
    free(lw->aw.data);
    gpu->dev_free(lw->gw.data);
}

/* Row `row` of the batch's result got[T, N] against the same token run alone (T = 1) from x's
 * device copy gx (its rows at gx + t Kin). check: must be bit-identical; else reported. */
static void linear_token_alone(const linear_weight *lw, const float *gx, const float *got, int T,
                               int row, bool check, const char *label) {
    const int N = lw->N, Kin = lw->Kin;
    float *gone = galloc_poisoned(sizeof(float) * N);
    gpu->linear(gone, gx + (int64_t)row * Kin, &lw->gw, 1, N, Kin);
    float *one = gfetch(gone, sizeof(float) * N);
    char what[128];
    snprintf(what, sizeof what, "%s token %d alone == in the batch of T=%d", label, row, T);
    if (check) {
        compare_bits("linear batch invariance", what, one, got + (int64_t)row * N, N,
                     sizeof(float));
    } else {
        int diff = 0;
        double md = 0.0;
        for (int i = 0; i < N; i++)
            if (memcmp(&one[i], &got[(int64_t)row * N + i], sizeof(float)) != 0) {
                diff++;
                const double d = fabs((double)one[i] - got[(int64_t)row * N + i]);
                if (d > md) md = d;
            }
        printf("  %-58s %d of %d differ (max %.3g; cuBLASLt, not checked)\n", what, diff, N, md);
    }
    free(one);
    gpu->dev_free(gone);
}

/* The ways linear can run for 16-bit weights: high precision through each of its four paths
 * (forced with the hooks of kernels/cuda/linear.cu, so each is checked at every T whatever the
 * thresholds say), and medium through cuBLASLt and through the tiles (BF16 weights of aligned
 * shapes; other weights and unaligned x take cuBLASLt on those paths). */
typedef enum {
    LINEAR_DECODE,
    LINEAR_STACKED,
    LINEAR_TWO_GEMMS,
    LINEAR_TILES,
    LINEAR_MEDIUM,
    LINEAR_MEDIUM_TILES,
    LINEAR_PATHS
} linear_path;
static const char *const linear_path_names[] = {"high decode", "high stacked", "high 2 GEMMs",
                                                "high tiles",  "medium",       "medium tiles"};

static bool path_medium(linear_path path) {
    return path == LINEAR_MEDIUM || path == LINEAR_MEDIUM_TILES;
}

/* Puts the precision and the hooks so that T tokens take `path`; linear_path_reset undoes it. */
static void linear_path_set(linear_path path) {
    set_precision(path_medium(path) ? MATMUL_PRECISION_MEDIUM : MATMUL_PRECISION_HIGH);
    cuda_linear_decode_max_t(path == LINEAR_DECODE ? 32 : 0);
    cuda_linear_stack_max_t(path == LINEAR_STACKED ? 1 << 30 : 0);
    cuda_linear_tiles_min_t(path == LINEAR_TILES || path == LINEAR_MEDIUM_TILES ? 0 : 1 << 30);
}

/* Back to the default: high precision, each path where kernels/cuda/linear.cu puts it. */
static void linear_path_reset(void) {
    set_precision(MATMUL_PRECISION_HIGH);
    cuda_linear_decode_max_t(-1);
    cuda_linear_stack_max_t(-1);
    cuda_linear_tiles_min_t(-1);
}

/* linear's got[n] against the CPU's want within rel S (S = sum_k |x_k||w_nk| per output); one
 * line with the worst err / S, a stat, a check. */
static void linear_check(const char *what, const char *op, const char *tol, const float *got,
                      const float *want, const float *S, int64_t n, double rel) {
    int64_t bad = 0;
    double worst = 0.0;
    for (int64_t i = 0; i < n; i++) {
        const double err = fabs((double)got[i] - want[i]), lim = rel * S[i] + 1e-30;
        if (!(err <= lim) && bad++ < 5)
            fprintf(stderr, "  linear: [%lld] got %.9g want %.9g err %.3g > %.3g\n",
                    (long long)i, got[i], want[i], err, lim);
        const double r = S[i] > 0 ? err / S[i] : (err > 0 ? INFINITY : 0.0);
        if (isnan(r) || r > worst) worst = isnan(r) ? INFINITY : r;
    }
    printf("  %-66s max err/S %.3g (allowed %.3g)\n", what, worst, rel);
    stat_add(op, tol, worst, worst / rel, n);
    CHECK(bad == 0, "%s: %lld of %lld outside the bound", what, (long long)bad, (long long)n);
}

/* T random tokens through the weight on the CPU and on the GPU in every path (x and out `off`
 * floats past 16-byte alignment; F32 weights: high and medium, both an fp32 GEMM). */
static void linear_case(const linear_weight *lw, int T, int off) {
    const int N = lw->N, Kin = lw->Kin;
    const dtype dt = lw->w.dtype;
    const int64_t nx = (int64_t)T * Kin, n = (int64_t)T * N;
    float *x = rand_floats(nx, 2.0f);
    float *want = xmalloc(sizeof(float) * (n + 1));
    cpu->linear(want, x, &lw->w, T, N, Kin);
    /* S = |x| |w|^T, by the same CPU op on absolute values (its own error is far below the
     * tolerance) */
    float *ax = xmalloc(sizeof(float) * (nx + 1));
    for (int64_t i = 0; i < nx; i++)
        ax[i] = fabsf(x[i]);
    float *S = xmalloc(sizeof(float) * (n + 1));
    cpu->linear(S, ax, &lw->aw, T, N, Kin);
    float *gx = galloc_poisoned(sizeof(float) * (nx + 1));
    gpu->to_device(gx + off, x, sizeof(float) * nx);
    float *gout = galloc_poisoned(sizeof(float) * (n + 1));

    for (int pi = 0; pi < LINEAR_PATHS; pi++) {
        const linear_path path = (linear_path)pi;
        if (dt == DTYPE_F32 && path != LINEAR_STACKED && path != LINEAR_MEDIUM) continue;
        if (path == LINEAR_DECODE && T > 32) continue; /* the decode kernel's largest tile */
        linear_path_set(path);
        const matmul_precision p =
            path_medium(path) ? MATMUL_PRECISION_MEDIUM : MATMUL_PRECISION_HIGH;
        const double rel = linear_u(dt, p) + 2.0 * Kin * 0x1p-24;
        gpoison(gout, sizeof(float) * (n + 1));
        gpu->linear(gout + off, gx + off, &lw->gw, T, N, Kin);
        float *got = gfetch(gout + off, sizeof(float) * n);
        const char *pname = dt == DTYPE_F32 ? prec_name(p) : linear_path_names[path];
        char what[128], op[48], tol[64];
        snprintf(what, sizeof what, "linear %s %-12s T=%d N=%d Kin=%d%s", dtype_name(dt), pname, T,
                 N, Kin, off ? " unaligned" : "");
        snprintf(op, sizeof op, "linear %s %s", dtype_name(dt), pname);
        snprintf(tol, sizeof tol, "(%s + 2 Kin 2^-24) S", linear_u_name(dt, p));
        linear_check(what, op, tol, got, want, S, n, rel);

        /* a token alone (T = 1 takes the decode kernel in high precision whatever the hooks say
         * above 0, so here with the decode hook at 32) against its row of the batch */
        if (path == LINEAR_DECODE && T > 1) {
            linear_token_alone(lw, gx + off, got, T, 0, true, "linear high decode");
            linear_token_alone(lw, gx + off, got, T, T - 1, true, "linear high decode");
        }
        if (path == LINEAR_STACKED && T > 1 && dt != DTYPE_F32 && !off)
            linear_token_alone(lw, gx, got, T, 0, false, "linear high stacked");
        free(got);
    }
    linear_path_reset();
    free(want);
    free(x);
    free(ax);
    free(S);
    gpu->dev_free(gx);
    gpu->dev_free(gout);
}

static void test_linear(void) {
    printf("linear (|err| <= (u + 2 Kin 2^-24) sum|x||w|; u: medium 2^-8 BF16, 2^-11 F16; high "
           "2^-16 BF16, 2^-22 F16; 0 F32; each high-precision path at every T it can take)\n");
    /* odd shapes, every dtype: element loads (Kin % 8, unaligned x), tiny N, empty T */
    static const struct {
        int T, N, Kin, offset;
    } cases[] = {{1, 4096, 2048, 0}, {37, 512, 2048, 0}, {5, 77, 129, 0},   {0, 64, 64, 0},
                 {1, 1, 1, 0},       {7, 300, 257, 1},   {16, 300, 264, 1}, {13, 520, 1000, 0},
                 {3, 128, 8, 0},     {31, 136, 4096, 0}, {256, 2048, 4096, 0}};
    const dtype dts[] = {DTYPE_BF16, DTYPE_F16, DTYPE_F32};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++)
        for (int di = 0; di < 3; di++) {
            linear_weight lw = linear_weight_make(dts[di], cases[c].N, cases[c].Kin);
            linear_case(&lw, cases[c].T, cases[c].offset);
            linear_weight_free(&lw);
        }
    /* Qwen3-30B-A3B's shapes in BF16, decode to prefill batch sizes (lm_head: sampled rows) */
    static const struct {
        int N, Kin, max_T;
    } shapes[] = {{4096, 2048, 1 << 30}, {512, 2048, 1 << 30}, {2048, 4096, 1 << 30},
                  {128, 2048, 1 << 30},  {151936, 2048, 64}};
    static const int Ts[] = {1, 2, 7, 16, 17, 31, 64, 256, 2048};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        linear_weight lw = linear_weight_make(DTYPE_BF16, shapes[s].N, shapes[s].Kin);
        for (size_t t = 0; t < sizeof Ts / sizeof Ts[0]; t++)
            if (Ts[t] <= shapes[s].max_T) linear_case(&lw, Ts[t], 0);
        linear_weight_free(&lw);
    }
    /* T from 17 to 32 in the decode kernel (its largest tile) on odd shapes too */
    static const struct {
        int T, N, Kin;
        dtype dt;
    } wide[] = {{32, 136, 4096, DTYPE_F16}, {24, 300, 257, DTYPE_BF16}};
    for (size_t c = 0; c < sizeof wide / sizeof wide[0]; c++) {
        linear_weight lw = linear_weight_make(wide[c].dt, wide[c].N, wide[c].Kin);
        linear_case(&lw, wide[c].T, 0);
        linear_weight_free(&lw);
    }
}

/* Deterministic mode (ops_cuda_set_deterministic): each token's row is the same bits at every T
 * (the batch's first T tokens against the largest batch, and a token alone from another row), in
 * both precisions, on Qwen3-30B-A3B's shapes (lm_head's rows cut into blocks that depend on T in
 * high precision), plus odd shapes and F16 / F32 weights; and still within linear's bound of the
 * CPU. */
static void linear_det_case(const linear_weight *lw, int max_T) {
    const int N = lw->N, Kin = lw->Kin;
    static const int Ts[] = {1, 2, 3, 7, 16, 17, 33, 64, 255, 256, 1000, 2048};
    float *x = rand_floats((int64_t)max_T * Kin, 2.0f);
    float *gx = gdup(x, sizeof(float) * (size_t)max_T * Kin);
    float *gref = galloc_poisoned(sizeof(float) * (size_t)max_T * N);
    const matmul_precision precs[] = {MATMUL_PRECISION_HIGH, MATMUL_PRECISION_MEDIUM};
    for (int pi = 0; pi < 2; pi++) {
        if (lw->w.dtype == DTYPE_F32 && pi) continue; /* one fp32 GEMM either way */
        set_precision(precs[pi]);
        ops_cuda_set_deterministic(true);
        gpu->linear(gref, gx, &lw->gw, max_T, N, Kin);
        float *ref = gfetch(gref, sizeof(float) * (size_t)max_T * N);
        /* the bound of linear_case against the CPU, on the largest batch's first rows */
        const int tc = max_T < 8 ? max_T : 8;
        float *want = xmalloc(sizeof(float) * (size_t)tc * N);
        cpu->linear(want, x, &lw->w, tc, N, Kin);
        float *ax = xmalloc(sizeof(float) * (size_t)tc * Kin);
        for (int64_t i = 0; i < (int64_t)tc * Kin; i++)
            ax[i] = fabsf(x[i]);
        float *S = xmalloc(sizeof(float) * (size_t)tc * N);
        cpu->linear(S, ax, &lw->aw, tc, N, Kin);
        const double rel = linear_u(lw->w.dtype, precs[pi]) + 2.0 * Kin * 0x1p-24;
        int64_t bad = 0;
        for (int64_t i = 0; i < (int64_t)tc * N; i++)
            if (!(fabs((double)ref[i] - want[i]) <= rel * S[i] + 1e-30)) bad++;
        CHECK(bad == 0, "linear deterministic %s %s N=%d Kin=%d T=%d: %lld of %lld outside the "
              "bound", dtype_name(lw->w.dtype), prec_name(precs[pi]), N, Kin, max_T,
              (long long)bad, (long long)tc * N);
        free(want);
        free(ax);
        free(S);
        int n_diff = 0, n_T = 0;
        for (size_t t = 0; t < sizeof Ts / sizeof Ts[0] && Ts[t] < max_T; t++) {
            const int T = Ts[t];
            float *gout = galloc_poisoned(sizeof(float) * (size_t)T * N);
            gpu->linear(gout, gx, &lw->gw, T, N, Kin);
            float *got = gfetch(gout, sizeof(float) * (size_t)T * N);
            if (memcmp(got, ref, sizeof(float) * (size_t)T * N)) {
                n_diff++;
                fprintf(stderr, "  linear deterministic: T=%d differs from T=%d\n", T, max_T);
                int shown = 0;
                for (int64_t i = 0; i < (int64_t)T * N && shown < 3; i++)
                    if (memcmp(&got[i], &ref[i], sizeof(float)))
                        fprintf(stderr, "    [%lld] %.9g vs %.9g\n", (long long)i, got[i], ref[i]),
                            shown++;
            }
            n_T++;
            free(got);
            gpu->dev_free(gout);
        }
        char what[128];
        snprintf(what, sizeof what, "deterministic %s %s N=%d Kin=%d, %d batch sizes < %d",
                 dtype_name(lw->w.dtype), prec_name(precs[pi]), N, Kin, n_T, max_T);
        compare_bits("linear deterministic", what, &n_diff, &(int){0}, 1, sizeof(int));
        /* the last token alone against its row of the largest batch */
        float *gone = galloc_poisoned(sizeof(float) * N);
        gpu->linear(gone, gx + (int64_t)(max_T - 1) * Kin, &lw->gw, 1, N, Kin);
        float *one = gfetch(gone, sizeof(float) * N);
        snprintf(what, sizeof what, "deterministic %s %s N=%d token %d alone",
                 dtype_name(lw->w.dtype), prec_name(precs[pi]), N, max_T - 1);
        compare_bits("linear deterministic", what, one, ref + (int64_t)(max_T - 1) * N, N,
                     sizeof(float));
        free(one);
        gpu->dev_free(gone);
        free(ref);
        ops_cuda_set_deterministic(false);
    }
    set_precision(MATMUL_PRECISION_HIGH);
    free(x);
    gpu->dev_free(gx);
    gpu->dev_free(gref);
}

int cuda_linear_det_kernel(int k);
int cuda_linear_bi_cluster(int on);

static void test_linear_deterministic(void) {
    printf("linear, deterministic mode (every T the same bits)\n");
    static const struct {
        int N, Kin, max_T;
        dtype dt;
    } cases[] = {{4096, 2048, 2048, DTYPE_BF16}, {512, 2048, 2048, DTYPE_BF16},
                 {2048, 4096, 2048, DTYPE_BF16}, {128, 2048, 2048, DTYPE_BF16},
                 {151936, 2048, 300, DTYPE_BF16}, {520, 1000, 300, DTYPE_F16},
                 {136, 264, 300, DTYPE_F32}};
    /* with each kernel of the mode: the pinned cuBLASLt algorithm, moe.cu's cuda_linear_bi (BF16
     * weights only; the others keep cuBLASLt), and cuda_linear_bi with the ranges of a few rows
     * added by the reduction kernel instead of in a cluster (its BF16 cases) */
    static const char *const names[] = {"cuBLASLt, pinned", "cuda_linear_bi",
                                        "cuda_linear_bi, no cluster"};
    for (int k = 0; k < 3; k++) {
        const int old = cuda_linear_det_kernel(k ? 1 : 0);
        const int old_c = cuda_linear_bi_cluster(k != 2);
        printf("  deterministic linear: %s\n", names[k]);
        for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
            if (k == 2 && cases[c].dt != DTYPE_BF16) continue;
            linear_weight lw = linear_weight_make(cases[c].dt, cases[c].N, cases[c].Kin);
            linear_det_case(&lw, cases[c].max_T);
            linear_weight_free(&lw);
        }
        cuda_linear_bi_cluster(old_c);
        cuda_linear_det_kernel(old);
    }
}

/* ---- linear with block-FP8 weights (W8A16, kernels/cuda/moe.cu's cuda_linear_fp8) ----
 * The CPU runs the dequantized F32 weight (codes times their 128 x 128 block's scale); the GPU the
 * codes, decoded exactly, each 128-k block's sums times the scale. Bound per output: (u + 4 Kin
 * 2^-24) S, S = sum_k |x_k||w_nk|, u as for 16-bit weights (x in BF16, or hi + lo), 4 Kin 2^-24
 * for both sides' fp32 sums and the per-block scaling. Rows are the same bits alone and in the
 * batch with fixed ranges (deterministic mode); generic linear takes the same way. */
int cuda_prepare_linear_fp8(tensor *t, const uint8_t *codes, const float *row_scales, int N,
                            int K, char *err, size_t errlen);
void cuda_linear_fp8(float *out, const float *x, const tensor *w, int T, int N, int K,
                     bool fixed_ranges);
void quant_fp8_blocks(uint8_t *q, float *s, const float *w, int N, int K);
void dequant_fp8_blocks(float *w, const uint8_t *q, const float *s, int N, int K);
void quant_fp8_row_scales(float *dst, int64_t ld, const float *s, int N, int K);

/* The device tensor's bytes (cuda_prepare_linear_fp8's layout: codes, then at the next 256
 * bytes the scales a row per 128-k block). */
static int64_t fp8_linear_bytes(int N, int K) {
    return ((int64_t)N * K + 255) / 256 * 256 + (int64_t)(K + 127) / 128 * N * 4;
}

typedef struct {
    tensor wd, aw, gw; /* dequantized F32 (host), |wd| (host), the FP8 tensor (device) */
    int N, K;
} fp8_weight;

/* A random weight [N, K] through block FP8, each block its own magnitude (2^-3 .. 2^3 apart), so
 * that a block's scale applied to the wrong sums shows. */
static fp8_weight fp8_weight_make(int N, int K) {
    fp8_weight f = {.N = N, .K = K};
    const int nb = (N + 127) / 128, nk = (K + 127) / 128;
    float *w = rand_floats((int64_t)N * K, 1.0f / sqrtf((float)K));
    for (int r = 0; r < N; r++)
        for (int k = 0; k < K; k++)
            w[(int64_t)r * K + k] *= ldexpf(1.0f, (r / 128 * 3 + k / 128) % 7 - 3);
    uint8_t *q = xmalloc((size_t)N * K);
    float *sc = xmalloc(sizeof(float) * nb * nk), *rs = xmalloc(sizeof(float) * nk * N);
    quant_fp8_blocks(q, sc, w, N, K);
    dequant_fp8_blocks(w, q, sc, N, K);
    quant_fp8_row_scales(rs, N, sc, N, K);
    f.wd = (tensor){.dtype = DTYPE_F32, .ndim = 2, .shape = {N, K}, .data = w};
    f.aw = make_weight(DTYPE_F32, N, K, 1.0f);
    float *a = f.aw.data;
    for (int64_t i = 0; i < (int64_t)N * K; i++)
        a[i] = fabsf(w[i]);
    char err[256] = "";
    CHECK(cuda_prepare_linear_fp8(&f.gw, q, rs, N, K, err, sizeof err) == 0 &&
              f.gw.dtype == DTYPE_F8_E4M3,
          "FP8 linear [%d, %d] prepared (%s)", N, K, err);
    free(q), free(sc), free(rs);
    return f;
}

static void fp8_weight_free(fp8_weight *f) {
    free(f->wd.data);
    free(f->aw.data);
    if (f->gw.data) gpu->dev_free(f->gw.data);
}

/* kernels/cuda/linear.cu, for tests: block-FP8 weights take the decode kernel up to T = max_t
 * (-1: each its default); returns the override before. cuda_linear_fp8_decode_t: the largest T of
 * a weight's decode kernel now. */
int cuda_linear_fp8_decode_max_t(int max_t);
int cuda_linear_fp8_decode_t(int N, int Kin);

/* Rows 0 and T - 1 of got (T > 1), each run alone through run(one row), bit for bit. */
static void fp8_alone(const fp8_weight *f, const float *gx, const float *got, int T,
                      const char *label, void (*run)(float *, const float *, const fp8_weight *)) {
    float *gone = galloc_poisoned(sizeof(float) * f->N);
    const int rows[2] = {0, T - 1};
    for (int j = 0; j < 2; j++) {
        gpoison(gone, sizeof(float) * f->N);
        run(gone, gx + (int64_t)rows[j] * f->K, f);
        float *one = gfetch(gone, sizeof(float) * f->N);
        char what[192];
        snprintf(what, sizeof what, "%.100s token %d alone == in T=%d", label, rows[j], T);
        compare_bits("linear F8_E4M3 batch invariance", what, one, got + (int64_t)rows[j] * f->N,
                     f->N, sizeof(float));
        free(one);
    }
    gpu->dev_free(gone);
}
static void fp8_run_fixed(float *o, const float *x, const fp8_weight *f) {
    cuda_linear_fp8(o, x, &f->gw, 1, f->N, f->K, true);
}
static void fp8_run_generic(float *o, const float *x, const fp8_weight *f) {
    gpu->linear(o, x, &f->gw, 1, f->N, f->K);
}

/* T tokens through every way an FP8 weight runs: linear_bi's tiles (ranges by size, and fixed:
 * rows the same bits alone) in both precisions, the decode kernel (forced up to T = 32; fp32 on
 * the exact weights, held to the fp32 bound alone, rows the same bits alone), and the generic op's
 * own choice (bit for bit the way it takes). */
static void linear_fp8_case(const fp8_weight *f, int T) {
    const int N = f->N, K = f->K;
    const int64_t nx = (int64_t)T * K, n = (int64_t)T * N;
    float *x = rand_floats(nx, 2.0f), *ax = xmalloc(sizeof(float) * nx);
    for (int64_t i = 0; i < nx; i++)
        ax[i] = fabsf(x[i]);
    float *want = xmalloc(sizeof(float) * n), *S = xmalloc(sizeof(float) * n);
    cpu->linear(want, x, &f->wd, T, N, K);
    cpu->linear(S, ax, &f->aw, T, N, K);
    float *gx = gdup(x, sizeof(float) * nx), *gout = galloc_poisoned(sizeof(float) * n);
    char what[128], op[48];
    float *tiles_high = NULL, *dec = NULL;
    const matmul_precision precs[] = {MATMUL_PRECISION_HIGH, MATMUL_PRECISION_MEDIUM};
    for (int pi = 0; pi < 2; pi++)
        for (int fixed = 0; fixed < 2; fixed++) {
            set_precision(precs[pi]);
            const double rel = (precs[pi] == MATMUL_PRECISION_HIGH ? 0x1p-16 : 0x1p-8) +
                               4.0 * K * 0x1p-24;
            gpoison(gout, sizeof(float) * n);
            cuda_linear_fp8(gout, gx, &f->gw, T, N, K, fixed);
            float *got = gfetch(gout, sizeof(float) * n);
            snprintf(what, sizeof what, "linear F8_E4M3 %-6s tiles, %s T=%d N=%d Kin=%d",
                     prec_name(precs[pi]), fixed ? "fixed ranges" : "by size     ", T, N, K);
            snprintf(op, sizeof op, "linear F8_E4M3 tiles %s", prec_name(precs[pi]));
            linear_check(what, op, "(u + 4 Kin 2^-24) S", got, want, S, n, rel);
            if (fixed && T > 1) {
                snprintf(what, sizeof what, "linear F8_E4M3 %s fixed", prec_name(precs[pi]));
                fp8_alone(f, gx, got, T, what, fp8_run_fixed);
            }
            if (pi == 0 && !fixed)
                tiles_high = got;
            else
                free(got);
        }
    set_precision(MATMUL_PRECISION_HIGH);
    if (T <= 32) { /* the decode kernel, forced */
        cuda_linear_fp8_decode_max_t(32);
        gpoison(gout, sizeof(float) * n);
        gpu->linear(gout, gx, &f->gw, T, N, K);
        dec = gfetch(gout, sizeof(float) * n);
        snprintf(what, sizeof what, "linear F8_E4M3 decode kernel T=%d N=%d Kin=%d", T, N, K);
        linear_check(what, "linear F8_E4M3 decode", "2 Kin 2^-24 S", dec, want, S, n,
                  2.0 * K * 0x1p-24);
        if (T > 1) fp8_alone(f, gx, dec, T, "linear F8_E4M3 decode", fp8_run_generic);
        cuda_linear_fp8_decode_max_t(-1);
    }
    /* the generic op by default: the decode kernel at a few rows, the tiles by size above */
    gpoison(gout, sizeof(float) * n);
    gpu->linear(gout, gx, &f->gw, T, N, K);
    float *via = gfetch(gout, sizeof(float) * n);
    const bool decode = T <= cuda_linear_fp8_decode_t(N, K);
    snprintf(what, sizeof what, "T=%d N=%d Kin=%d: gpu->linear == its %s", T, N, K,
             decode ? "decode kernel" : "tiles by size");
    if (tiles_high && (decode ? dec != NULL : true))
        compare_bits("linear F8_E4M3 dispatch", what, via, decode ? dec : tiles_high, n,
                     sizeof(float));
    free(via), free(dec), free(tiles_high);
    free(x), free(ax), free(want), free(S);
    gpu->dev_free(gx);
    gpu->dev_free(gout);
}

static void test_linear_fp8(void) {
    printf("linear, block-FP8 weights (W8A16; |err| <= (u + 4 Kin 2^-24) sum|x||w|, u: high "
           "2^-16, medium 2^-8)\n");
    static const struct {
        int N, K, maxT;
    } shapes[] = {{64, 64, 700}, {200, 320, 700}, {512, 2048, 700}, {5120, 2048, 200},
                  {2048, 4096, 200}};
    static const int Ts[] = {1, 2, 5, 12, 13, 40, 64, 200, 700};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        fp8_weight f = fp8_weight_make(shapes[s].N, shapes[s].K);
        if (f.gw.data)
            for (size_t t = 0; t < sizeof Ts / sizeof Ts[0]; t++)
                if (Ts[t] <= shapes[s].maxT) linear_fp8_case(&f, Ts[t]);
        fp8_weight_free(&f);
    }
    /* refused: a NaN code, a block scale that is not finite, K not a multiple of 64, N of 8 */
    static uint8_t q[64 * 128];
    static float rs[64];
    for (int i = 0; i < 64; i++)
        rs[i] = 1.0f;
    tensor t = {0};
    char err[256] = "";
    q[100] = 0x7F;
    CHECK(cuda_prepare_linear_fp8(&t, q, rs, 64, 64, err, sizeof err) != 0 && strstr(err, "NaN") &&
              !t.data,
          "FP8 linear with a NaN code refused (%s)", err);
    q[100] = 0;
    rs[7] = NAN;
    CHECK(cuda_prepare_linear_fp8(&t, q, rs, 64, 64, err, sizeof err) != 0 &&
              strstr(err, "not finite") && !t.data,
          "FP8 linear with a NaN block scale refused (%s)", err);
    rs[7] = 1.0f;
    CHECK(cuda_prepare_linear_fp8(&t, q, rs, 64, 96, err, sizeof err) != 0 &&
              strstr(err, "of 64") && !t.data,
          "FP8 linear with K = 96 refused (%s)", err);
    CHECK(cuda_prepare_linear_fp8(&t, q, rs, 12, 64, err, sizeof err) != 0 &&
              strstr(err, "multiple of 8") && !t.data,
          "FP8 linear with N = 12 refused (%s)", err);
}

/* ---- figures ---- */

/* A device buffer of n random BF16 values (host-made in parallel, then copied). */
static uint16_t *gpu_random_bf16(int64_t n) {
    uint16_t *h = xmalloc((size_t)n * sizeof(uint16_t));
    const uint64_t seed = rng_next();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; i++)
        h[i] = f32_to_bf16(to_uniform(mix64(seed + (uint64_t)i * 0x9e3779b97f4a7c15ull)) * 0.05f);
    uint16_t *d = gdup(h, (size_t)n * sizeof(uint16_t));
    free(h);
    return d;
}

static float *gpu_random_f32(int64_t n) {
    float *h = rand_floats(n, 1.0f);
    float *d = gdup(h, (size_t)n * sizeof(float));
    free(h);
    return d;
}

#define POOL_BYTES ((int64_t)768 << 20) /* weight pool: many times the 60 MB L2 */

/* The ceilings measured in this run: device-to-device copy (GB/s, read + write) and the 8192^3
 * BF16 GEMM (TFLOP/s). */
static double ceiling_copy_gbs = NAN, ceiling_gemm_tflops = NAN;

typedef struct {
    double eager, graph; /* seconds per call */
} linear_time;

/* Time per call of linear with BF16 weights [N, Kin] at T tokens in the precision in force, two
 * ways: calls issued one by one (eager: what the runner does today; below ~15 us the host's launch
 * cost sets the pace) and the same calls captured in one CUDA graph and replayed (the device's own
 * time). Each call reads another copy of the weights from a pool larger than the L2, so the
 * weights come from device memory as they do in a model's forward. With a name, one line: times,
 * then bandwidth and TFLOP/s from the graph time and their share of the ceilings (bytes = weights
 * + x fp32 + out fp32; FLOPs = 2 T N Kin, the product's, whatever the precision costs). */
static linear_time time_linear_w(const char *name, void *pool, dtype dt, int64_t wbytes, int T,
                                 int N, int Kin) {
    const int64_t stride = (wbytes + 255) / 256 * 256;
    const int copies = (int)(POOL_BYTES / stride);
    MS_ASSERT(copies >= 1);
    float *gx = gpu_random_f32((int64_t)T * Kin);
    float *gout = gpu->dev_alloc(sizeof(float) * (size_t)T * N);
    MS_ASSERT(gout);
    tensor w = {.dtype = dt, .ndim = 2, .shape = {N, Kin}, .device = DEVICE_CUDA};
    const int warm = 3, reps = 40;
    cudaStream_t st = cuda_stream();
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    for (int r = 0; r < warm + reps; r++) {
        if (r == warm) cudaEventRecord(e0, st);
        w.data = (char *)pool + (int64_t)(r % copies) * stride;
        gpu->linear(gout, gx, &w, T, N, Kin);
    }
    cudaEventRecord(e1, st);
    cudaEventSynchronize(e1);
    float ms = 0.0f;
    cudaEventElapsedTime(&ms, e0, e1);
    linear_time lt = {.eager = ms / 1e3 / reps, .graph = NAN};

    cudaGraph_t g = NULL;
    cudaGraphExec_t ge = NULL;
    if (cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal) == cudaSuccess) {
        for (int r = 0; r < reps; r++) {
            w.data = (char *)pool + (int64_t)(r % copies) * stride;
            gpu->linear(gout, gx, &w, T, N, Kin);
        }
        if (cudaStreamEndCapture(st, &g) == cudaSuccess &&
            cudaGraphInstantiate(&ge, g, 0) == cudaSuccess) {
            cudaGraphLaunch(ge, st); /* warm-up */
            cudaEventRecord(e0, st);
            cudaGraphLaunch(ge, st);
            cudaEventRecord(e1, st);
            if (cudaEventSynchronize(e1) == cudaSuccess &&
                cudaEventElapsedTime(&ms, e0, e1) == cudaSuccess)
                lt.graph = ms / 1e3 / reps;
        }
    }
    if (isnan(lt.graph))
        printf("  (graph capture failed: %s)\n", cudaGetErrorString(cudaGetLastError()));
    if (ge) cudaGraphExecDestroy(ge);
    if (g) cudaGraphDestroy(g);

    if (name) {
        const double bytes = (double)wbytes + 4.0 * T * Kin + 4.0 * T * N;
        const double gbs = bytes / lt.graph / 1e9, tflops = 2.0 * T * N * Kin / lt.graph / 1e12;
        printf("  %-9s %-4s %-6s T=%-5d N=%-6d Kin=%-5d %8.1f us %8.1f us  %6.0f GB/s %3.0f%%  "
               "%6.1f TFLOP/s %3.0f%%\n",
               name, dtype_name(dt), prec_name(ops_cuda_matmul_precision()), T, N, Kin,
               lt.eager * 1e6,
               lt.graph * 1e6, gbs, 100.0 * gbs / ceiling_copy_gbs, tflops,
               100.0 * tflops / ceiling_gemm_tflops);
    }
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    gpu->dev_free(gx);
    gpu->dev_free(gout);
    return lt;
}

static linear_time time_linear(const char *name, uint16_t *pool, int T, int N, int Kin) {
    return time_linear_w(name, pool, DTYPE_BF16, (int64_t)N * Kin * 2, T, N, Kin);
}

/* Deterministic mode at decode sizes: cuda_linear_bi with its ranges added in a cluster and by
 * the reduction kernel, against the mode off (the decode kernel), in high precision; graph time
 * per call and the share of the copy rate. */
typedef struct {
    const char *name;
    int N, Kin;
} linear_shape;

static void figures_det_small(uint16_t *pool, const linear_shape *shapes, size_t n) {
    printf("deterministic mode, small T: cuda_linear_bi, ranges added in a cluster / by a "
           "kernel; the mode off (high, graph time per call)\n");
    static const int Ts[] = {1, 2, 8};
    set_precision(MATMUL_PRECISION_HIGH);
    const int old_k = cuda_linear_det_kernel(1);
    for (size_t s = 0; s < n; s++)
        for (size_t t = 0; t < sizeof Ts / sizeof Ts[0]; t++) {
            const int T = Ts[t], N = shapes[s].N, Kin = shapes[s].Kin;
            const double off = time_linear(NULL, pool, T, N, Kin).graph;
            ops_cuda_set_deterministic(true);
            const int old_c = cuda_linear_bi_cluster(1);
            const double cl = time_linear(NULL, pool, T, N, Kin).graph;
            cuda_linear_bi_cluster(0);
            const double rk = time_linear(NULL, pool, T, N, Kin).graph;
            cuda_linear_bi_cluster(old_c);
            ops_cuda_set_deterministic(false);
            const double bytes = 2.0 * N * Kin + 4.0 * T * Kin + 4.0 * T * N;
            printf("  %-9s T=%-3d N=%-6d Kin=%-5d  cluster %7.1f us (%3.0f%%)  kernel %7.1f us  "
                   "mode off %7.1f us (%3.0f%%)\n",
                   shapes[s].name, T, N, Kin, cl * 1e6, 100.0 * bytes / cl / 1e9 / ceiling_copy_gbs,
                   rk * 1e6, off * 1e6, 100.0 * bytes / off / 1e9 / ceiling_copy_gbs);
        }
    cuda_linear_det_kernel(old_k);
}

/* Device-to-device copy bandwidth (bytes read + written) of 1 GiB, in GB/s. */
static double time_copy(const uint16_t *pool) {
    const size_t bytes = (size_t)1 << 30;
    void *a = gpu->dev_alloc(bytes), *b = gpu->dev_alloc(bytes);
    MS_ASSERT(a && b);
    for (size_t o = 0; o < bytes; o += (size_t)POOL_BYTES) /* random data, not zeros */
        cudaMemcpyAsync((char *)a + o, pool,
                        bytes - o < (size_t)POOL_BYTES ? bytes - o : (size_t)POOL_BYTES,
                        cudaMemcpyDeviceToDevice, cuda_stream());
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    const int warm = 2, reps = 10;
    for (int r = 0; r < warm + reps; r++) {
        if (r == warm) cudaEventRecord(e0, cuda_stream());
        cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, cuda_stream());
    }
    cudaEventRecord(e1, cuda_stream());
    cudaEventSynchronize(e1);
    float ms = 0.0f;
    cudaEventElapsedTime(&ms, e0, e1);
    const double s = ms / 1e3 / reps;
    printf("  device-to-device copy of 1 GiB: %.0f us, %.0f GB/s (read + write)\n", s * 1e6,
           2.0 * bytes / s / 1e9);
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    gpu->dev_free(a);
    gpu->dev_free(b);
    return 2.0 * bytes / s / 1e9;
}

/* One 8192^3 BF16 GEMM (BF16 in and out, fp32 accumulation) straight through cuBLASLt, in
 * TFLOP/s (NAN when cuBLASLt could not be set up). */
static double time_gemm_bf16(uint16_t *pool) {
    const int n = 8192;
    const int64_t mat = (int64_t)n * n * 2;
    MS_ASSERT(2 * mat <= POOL_BYTES);
    void *C = gpu->dev_alloc((size_t)mat), *ws = gpu->dev_alloc((size_t)32 << 20);
    MS_ASSERT(C && ws);
    const double s = cublaslt_seconds(CUDA_R_16BF, CUDA_R_16BF, n, n, n, pool, (char *)pool + mat,
                                      C, ws, (uint64_t)32 << 20, cuda_stream(), 3, 10);
    gpu->dev_free(C);
    gpu->dev_free(ws);
    CHECK(!isnan(s), "cuBLASLt 8192^3 BF16 GEMM: no algorithm, or a call failed");
    if (isnan(s)) return NAN;
    printf("  cuBLASLt BF16 GEMM 8192^3 (BF16 out): %.0f us, %.0f TFLOP/s\n", s * 1e6,
           2.0 * n * n * (double)n / s / 1e12);
    return 2.0 * n * n * (double)n / s / 1e12;
}

/* Mean time per call of `call` over 20 calls after 2 warm-up calls, and the bandwidth of `bytes`
 * (each input read once, each output written once) in that time. */
#define TIME_OP(label, bytes, call)                                                                \
    do {                                                                                           \
        cudaEvent_t e0_, e1_;                                                                      \
        cudaEventCreate(&e0_);                                                                     \
        cudaEventCreate(&e1_);                                                                     \
        for (int r_ = 0; r_ < 22; r_++) {                                                          \
            if (r_ == 2) cudaEventRecord(e0_, cuda_stream());                                      \
            call;                                                                                  \
        }                                                                                          \
        cudaEventRecord(e1_, cuda_stream());                                                       \
        cudaEventSynchronize(e1_);                                                                 \
        float ms_ = 0.0f;                                                                          \
        cudaEventElapsedTime(&ms_, e0_, e1_);                                                      \
        const double s_ = ms_ / 1e3 / 20;                                                          \
        printf("  %-44s %8.1f us  %6.0f GB/s\n", (label), s_ * 1e6, (double)(bytes) / s_ / 1e9);   \
        cudaEventDestroy(e0_);                                                                     \
        cudaEventDestroy(e1_);                                                                     \
    } while (0)

/* A decode step's small ops one after another as the step has them: CHAIN calls captured in one
 * CUDA graph and replayed, time per call. Each kernel waits for the one before (programmatic
 * dependent launch where the op has it), so this is what one costs in a step's chain of launches,
 * its launch and the wait for its neighbour included. */
#define CHAIN 96
#define TIME_CHAIN(label, call)                                                                    \
    do {                                                                                           \
        cudaStream_t st_ = cuda_stream();                                                          \
        cudaGraph_t g_ = NULL;                                                                     \
        cudaGraphExec_t ge_ = NULL;                                                                \
        float ms_ = NAN;                                                                           \
        if (cudaStreamBeginCapture(st_, cudaStreamCaptureModeThreadLocal) == cudaSuccess) {        \
            for (int r_ = 0; r_ < CHAIN; r_++)                                                     \
                call;                                                                              \
            if (cudaStreamEndCapture(st_, &g_) == cudaSuccess &&                                   \
                cudaGraphInstantiate(&ge_, g_, 0) == cudaSuccess) {                                \
                cudaEvent_t e0_, e1_;                                                              \
                cudaEventCreate(&e0_);                                                             \
                cudaEventCreate(&e1_);                                                             \
                cudaGraphLaunch(ge_, st_);                                                         \
                cudaEventRecord(e0_, st_);                                                         \
                for (int r_ = 0; r_ < 5; r_++)                                                     \
                    cudaGraphLaunch(ge_, st_);                                                     \
                cudaEventRecord(e1_, st_);                                                         \
                cudaEventSynchronize(e1_);                                                         \
                cudaEventElapsedTime(&ms_, e0_, e1_);                                              \
                cudaEventDestroy(e0_);                                                             \
                cudaEventDestroy(e1_);                                                             \
            }                                                                                      \
        }                                                                                          \
        printf("  %-52s %6.2f us a call\n", (label), ms_ * 1e3 / (5 * CHAIN));                      \
        if (ge_) cudaGraphExecDestroy(ge_);                                                        \
        if (g_) cudaGraphDestroy(g_);                                                              \
    } while (0)

/* kernels/cuda/linear.cu: decode GEMVs in one persistent launch (an experiment for
 * docs/decode_megakernel.md): link l out_l = xs[l] . ws[l]^T at one token, BF16 weights */
void *cuda_decode_chain_make(float *const *outs, const float *const *xs, const tensor *const *ws,
                             int n);
bool cuda_decode_chain_run(void *chain, int mode);
int cuda_decode_chain_modes(int *modes, int max);
void cuda_decode_chain_free(void *chain);

/* A chain of GEMVs as a decode step has them (q_proj's and o_proj's shapes in turn, each link's
 * input the output of the one before, eight weights of each shape in turn: 256 MB, past L2), as
 * separate kernels in one CUDA graph and as one persistent launch: the same bits, and the time a
 * link. */
static void check_decode_chain(void) {
    enum { L = 96, NW = 8 };
    const int D = 2048, Q = 4096;
    printf("decode GEMVs in a chain of %d (T = 1, N %d / %d): kernels in a CUDA graph against one "
           "persistent launch\n",
           L, Q, D);
    tensor wq[NW], wo[NW];
    for (int i = 0; i < NW; i++) {
        tensor a = make_weight(DTYPE_BF16, Q, D, 0.02f), b = make_weight(DTYPE_BF16, D, Q, 0.02f);
        wq[i] = gpu_weight(&a);
        wo[i] = gpu_weight(&b);
        free(a.data);
        free(b.data);
    }
    float *x0 = gpu_random_f32(D), *outs[L];
    const float *xs[L];
    const tensor *ws[L];
    for (int l = 0; l < L; l++) {
        ws[l] = l % 2 ? &wo[l / 2 % NW] : &wq[l / 2 % NW];
        outs[l] = gpu->dev_alloc(sizeof(float) * (size_t)ws[l]->shape[0]);
        MS_ASSERT(outs[l]);
        xs[l] = l ? outs[l - 1] : x0;
    }
    float *ref = xmalloc(sizeof(float) * (size_t)L * Q), *got = xmalloc(sizeof(float) * Q);
    for (int l = 0; l < L; l++)
        gpu->linear(outs[l], xs[l], ws[l], 1, (int)ws[l]->shape[0], (int)ws[l]->shape[1]);
    for (int l = 0; l < L; l++)
        gpu->to_host(ref + (size_t)l * Q, outs[l], sizeof(float) * (size_t)ws[l]->shape[0]);
    void *chain = cuda_decode_chain_make(outs, xs, ws, L);
    int modes[16];
    const int nm = cuda_decode_chain_modes(modes, 16);
    MS_ASSERT(nm <= 16);
    for (int m = 0; m < nm; m++) {
        if (modes[m] & 16) continue; /* no waits: the bits are not the kernels' */
        for (int l = 0; l < L; l++)  /* NaN: a link the chain leaves unwritten shows */
            cudaMemsetAsync(outs[l], 0xff, sizeof(float) * (size_t)ws[l]->shape[0], cuda_stream());
        CHECK(cuda_decode_chain_run(chain, modes[m]), "decode chain: mode %d runs", modes[m]);
        int bad = 0;
        for (int l = 0; l < L; l++) {
            const size_t n = (size_t)ws[l]->shape[0];
            gpu->to_host(got, outs[l], sizeof(float) * n);
            bad += memcmp(got, ref + (size_t)l * Q, sizeof(float) * n) != 0;
        }
        CHECK(bad == 0, "decode chain, mode %d: %d of %d links differ from the kernels' bits",
              modes[m], bad, L);
    }

    /* times: the kernels in one graph, then the persistent launch in each mode, five runs each,
     * the whole set three times */
    cudaStream_t st = cuda_stream();
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    cudaGraph_t g = NULL;
    cudaGraphExec_t ge = NULL;
    if (cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal) == cudaSuccess) {
        for (int l = 0; l < L; l++)
            gpu->linear(outs[l], xs[l], ws[l], 1, (int)ws[l]->shape[0], (int)ws[l]->shape[1]);
        if (cudaStreamEndCapture(st, &g) != cudaSuccess ||
            cudaGraphInstantiate(&ge, g, 0) != cudaSuccess)
            ge = NULL;
    }
    printf("  mode: 1 counters a line apart, 2 one signal a block, 4 one poller a block, 8 sleep "
           "between polls, 16 no wait (streaming alone); us a link, three rounds\n");
    for (int round = 0; round < 3; round++) {
        float ms = NAN;
        if (ge) {
            cudaGraphLaunch(ge, st);
            cudaEventRecord(e0, st);
            for (int r = 0; r < 5; r++)
                cudaGraphLaunch(ge, st);
            cudaEventRecord(e1, st);
            cudaEventSynchronize(e1);
            cudaEventElapsedTime(&ms, e0, e1);
        }
        printf("  kernels in a graph %6.2f |", ms * 1e3 / (5 * L));
        for (int m = 0; m < nm; m++) {
            cuda_decode_chain_run(chain, modes[m]);
            cudaEventRecord(e0, st);
            for (int r = 0; r < 5; r++)
                cuda_decode_chain_run(chain, modes[m]);
            cudaEventRecord(e1, st);
            cudaEventSynchronize(e1);
            cudaEventElapsedTime(&ms, e0, e1);
            printf(" mode %2d %6.2f", modes[m], ms * 1e3 / (5 * L));
        }
        printf("\n");
    }
    if (ge) cudaGraphExecDestroy(ge);
    if (g) cudaGraphDestroy(g);
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    cuda_decode_chain_free(chain);
    for (int l = 0; l < L; l++)
        gpu->dev_free(outs[l]);
    for (int i = 0; i < NW; i++) {
        gpu->dev_free(wq[i].data);
        gpu->dev_free(wo[i].data);
    }
    gpu->dev_free(x0);
    free(ref);
    free(got);
}

static void time_chain(void) {
    printf("decode-size ops in a chain of %d (one CUDA graph, T = 1, Qwen3-30B-A3B shapes)\n",
           CHAIN);
    const int D = 2048, E = 128, K = 8;
    float *a = gpu_random_f32((int64_t)K * D), *b = gpu_random_f32((int64_t)K * D);
    float *o = gpu_random_f32((int64_t)K * D), *lg = gpu_random_f32(E);
    float *tw = gpu_random_f32(K);
    tensor hw = make_weight(DTYPE_BF16, 1, D, 1.0f);
    hw.ndim = 1;
    hw.shape[0] = D;
    tensor w = gpu_weight(&hw);
    tensor hr = make_weight(DTYPE_BF16, E, D, 0.02f), wr = gpu_weight(&hr);
    int32_t *tk = gpu->dev_alloc(sizeof(int32_t) * K);
    MS_ASSERT(tk);
    TIME_CHAIN("add_rmsnorm D=2048", gpu->add_rmsnorm(a, o, b, &w, 1, D, 1e-6f));
    TIME_CHAIN("moe_finalize_add_rmsnorm K=8 D=2048",
               gpu->moe_finalize_add_rmsnorm(a, o, b, tw, &w, 1, K, D, 1e-6f));
    TIME_CHAIN("router_topk E=128 K=8", gpu->router_topk(tk, tw, lg, 1, E, K, true));
    TIME_CHAIN("linear (router) N=128 Kin=2048", gpu->linear(lg, o, &wr, 1, E, D));
    TIME_CHAIN("router linear + router_topk",
               (gpu->linear(lg, o, &wr, 1, E, D), gpu->router_topk(tk, tw, lg, 1, E, K, true)));
    TIME_CHAIN("add_rmsnorm + router linear + router_topk",
               (gpu->add_rmsnorm(a, o, b, &w, 1, D, 1e-6f), gpu->linear(lg, o, &wr, 1, E, D),
                gpu->router_topk(tk, tw, lg, 1, E, K, true)));
    free(hw.data);
    free(hr.data);
    gpu->dev_free(w.data);
    gpu->dev_free(wr.data);
    gpu->dev_free(tk);
    gpu->dev_free(a);
    gpu->dev_free(b);
    gpu->dev_free(o);
    gpu->dev_free(lg);
    gpu->dev_free(tw);
}

/* The other ops at prefill sizes of Qwen3-30B-A3B (T = 8192 tokens; K = 8 of 128 experts, expert
 * FFN 768): memory-bound passes, compared with the copy ceiling. */
static void time_elementwise(void) {
    printf("other ops at T = 8192 (bytes: inputs read once + outputs written once)\n");
    const int T = 8192, D = 2048, H = 32, Hkv = 4, Dh = 128, E = 128, K = 8, F = 768;
    const int64_t big = (int64_t)T * K * D; /* the largest buffer: expert outputs [T, K, D] */
    float *a = gpu_random_f32(big), *b = gpu_random_f32(big), *o = gpu_random_f32(big);
    tensor hw = make_weight(DTYPE_BF16, 1, D, 1.0f), hq = make_weight(DTYPE_BF16, 1, Dh, 1.0f);
    hw.ndim = hq.ndim = 1;
    hw.shape[0] = D;
    hq.shape[0] = Dh;
    tensor w = gpu_weight(&hw), wq = gpu_weight(&hq);
    tensor htab = make_weight(DTYPE_BF16, 151936, D, 1.0f), tab = gpu_weight(&htab);
    int32_t *ids = xmalloc(sizeof(int32_t) * T), *pos = xmalloc(sizeof(int32_t) * T);
    int32_t *seq = xmalloc(sizeof(int32_t) * T), *table = xmalloc(sizeof(int32_t) * 1024);
    for (int t = 0; t < T; t++) {
        ids[t] = rng_int(151936);
        seq[t] = t / 1024; /* 8 sequences of 1024 tokens, pages of 16: 64 pages each */
        pos[t] = t % 1024;
    }
    for (int i = 0; i < 1024; i++)
        table[i] = (i * 37) % 1024; /* scattered pages, a permutation */
    int32_t *gids = gdup(ids, sizeof(int32_t) * T), *gpos = gdup(pos, sizeof(int32_t) * T);
    int32_t *gseq = gdup(seq, sizeof(int32_t) * T), *gtable = gdup(table, sizeof(int32_t) * 1024);
    int32_t *tk = gpu->dev_alloc(sizeof(int32_t) * T * K);
    float *kc = gpu->dev_alloc(sizeof(float) * 1024 * 16 * Hkv * Dh);
    float *vc = gpu->dev_alloc(sizeof(float) * 1024 * 16 * Hkv * Dh);
    MS_ASSERT(tk && kc && vc);
    attn_batch ab = {
        .T = T, .pos = gpos, .seq = gseq, .page_table = gtable, .max_pages = 128, .page_size = 16};
    const double f4 = sizeof(float);
    TIME_OP("embedding BF16 D=2048", T * D * (2 + f4), gpu->embedding(o, &tab, gids, T, D));
    TIME_OP("rmsnorm R=8192 C=2048", 2 * f4 * T * D, gpu->rmsnorm(o, a, &w, T, D, 1e-6f));
    TIME_OP("rmsnorm R=262144 C=128 (q heads)", 2 * f4 * T * H * Dh,
            gpu->rmsnorm(o, a, &wq, T * H, Dh, 1e-6f));
    TIME_OP("rope H=32 Hkv=4 Dh=128", 2 * f4 * T * (H + Hkv) * Dh,
            gpu->rope(a, b, gpos, T, H, Hkv, Dh, 1e6));
    TIME_OP("add + rmsnorm D=2048 (two kernels)", 4 * f4 * T * D,
            (gpu->add(a, a, b, (int64_t)T * D), gpu->rmsnorm(o, a, &w, T, D, 1e-6f)));
    TIME_OP("add_rmsnorm D=2048 (fused)", 4 * f4 * T * D,
            gpu->add_rmsnorm(a, o, b, &w, T, D, 1e-6f));
    TIME_OP("q, k rmsnorm + rope H=32 Hkv=4 (three kernels)", 2 * f4 * T * (H + Hkv) * Dh,
            (gpu->rmsnorm(a, a, &wq, T * H, Dh, 1e-6f), gpu->rmsnorm(b, b, &wq, T * Hkv, Dh, 1e-6f),
             gpu->rope(a, b, gpos, T, H, Hkv, Dh, 1e6)));
    TIME_OP("qk_norm_rope H=32 Hkv=4 Dh=128 (fused)", 2 * f4 * T * (H + Hkv) * Dh,
            gpu->qk_norm_rope(a, b, &wq, &wq, gpos, T, H, Hkv, Dh, 1e6, 1e-6f));
    TIME_OP("kv_store Hkv=4 Dh=128", 4 * f4 * T * Hkv * Dh,
            gpu->kv_store((kv_layer){kc, vc, 0}, a, b, &ab, Hkv, Dh));
    TIME_OP("router_topk E=128 K=8", f4 * T * E + 8.0 * T * K,
            gpu->router_topk(tk, o, a, T, E, K, true));
    TIME_OP("moe_finalize K=8 D=2048", f4 * (T * K * D + T * K + T * D),
            gpu->moe_finalize(o, a, b, T, K, D));
    TIME_OP("silu_mul T*K=65536 F=768", 3 * f4 * T * K * F, gpu->silu_mul(o, a, b, T * K, F));
    TIME_OP("add n=8192*2048", 3 * f4 * T * D, gpu->add(o, a, b, (int64_t)T * D));
    free(ids);
    free(pos);
    free(seq);
    free(table);
    free(hw.data);
    free(hq.data);
    free(htab.data);
    gpu->dev_free(w.data);
    gpu->dev_free(wq.data);
    gpu->dev_free(tab.data);
    gpu->dev_free(gids);
    gpu->dev_free(gpos);
    gpu->dev_free(gseq);
    gpu->dev_free(gtable);
    gpu->dev_free(tk);
    gpu->dev_free(kc);
    gpu->dev_free(vc);
    gpu->dev_free(a);
    gpu->dev_free(b);
    gpu->dev_free(o);
}

/* FP8 weights against BF16 ones of the same shapes (high precision, graph time per call): a pool
 * of copies of one prepared FP8 weight, larger than the L2, as time_linear's BF16 pool. */
static void figures_fp8(uint16_t *pool) {
    printf("linear, block-FP8 weights (W8A16) against BF16, Qwen3-30B-A3B shapes (columns as "
           "above; bytes: codes + scales)\n");
    static const struct {
        const char *name;
        int N, Kin;
    } shapes[] = {{"qkv_proj", 5120, 2048}, {"k/v_proj", 512, 2048}, {"o_proj", 2048, 4096}};
    static const int Ts[] = {1, 8, 64, 256, 2048};
    void *fpool = gpu->dev_alloc((size_t)POOL_BYTES);
    MS_ASSERT(fpool);
    set_precision(MATMUL_PRECISION_HIGH);
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        const int N = shapes[s].N, K = shapes[s].Kin;
        fp8_weight f = fp8_weight_make(N, K);
        const int64_t bytes = fp8_linear_bytes(N, K), stride = (bytes + 255) / 256 * 256;
        for (int64_t c = 0; f.gw.data && (c + 1) * stride <= POOL_BYTES; c++)
            cudaMemcpy((char *)fpool + c * stride, f.gw.data, (size_t)bytes,
                       cudaMemcpyDeviceToDevice);
        cudaDeviceSynchronize(); /* the legacy stream's copies, before the timed kernels */
        for (size_t t = 0; f.gw.data && t < sizeof Ts / sizeof Ts[0]; t++) {
            time_linear_w(shapes[s].name, fpool, DTYPE_F8_E4M3, bytes, Ts[t], N, K);
            time_linear(shapes[s].name, pool, Ts[t], N, K);
        }
        /* where the decode kernel stops paying against the tiles (graph time per call) */
        static const int Tsmall[] = {1, 2, 4, 8, 16, 32};
        for (size_t t = 0; f.gw.data && t < sizeof Tsmall / sizeof Tsmall[0]; t++) {
            cuda_linear_fp8_decode_max_t(32);
            const double dec =
                time_linear_w(NULL, fpool, DTYPE_F8_E4M3, bytes, Tsmall[t], N, K).graph;
            cuda_linear_fp8_decode_max_t(0);
            const double til =
                time_linear_w(NULL, fpool, DTYPE_F8_E4M3, bytes, Tsmall[t], N, K).graph;
            cuda_linear_fp8_decode_max_t(-1);
            printf("  %-9s F8_E4M3 T=%-3d N=%-6d Kin=%-5d  decode kernel %7.1f us (%3.0f%% of "
                   "copy)  tiles %7.1f us%s\n",
                   shapes[s].name, Tsmall[t], N, K, dec * 1e6,
                   100.0 * bytes / dec / 1e9 / ceiling_copy_gbs, til * 1e6,
                   dec < til ? "  (decode faster)" : "");
        }
        fp8_weight_free(&f);
    }
    gpu->dev_free(fpool);
}

static void figures(void) {
    printf("\nfigures (BF16 weights; time per call = mean of 40 calls after warm-up, cudaEvent; "
           "bytes = weights + x fp32 + out fp32)\n");
    uint16_t *pool = gpu_random_bf16(POOL_BYTES / 2);
    printf("ceilings\n");
    ceiling_copy_gbs = time_copy(pool);
    ceiling_gemm_tflops = time_gemm_bf16(pool);
    printf("linear (per call: eager, then graph replay; GB/s and TFLOP/s from the graph time, "
           "each with its share of the ceiling above)\n");
    const matmul_precision precs[] = {MATMUL_PRECISION_HIGH, MATMUL_PRECISION_MEDIUM};
    for (int pi = 0; pi < 2; pi++) {
        set_precision(precs[pi]);
        time_linear("linear", pool, 8192, 8192, 8192);
    }
    printf("linear, Qwen3-30B-A3B shapes (same columns)\n");
    static const linear_shape shapes[] = {{"q_proj", 4096, 2048},  {"qkv_proj", 5120, 2048},
                                          {"k/v_proj", 512, 2048}, {"o_proj", 2048, 4096},
                                          {"router", 128, 2048},   {"lm_head", 151936, 2048}};
    static const int Ts[] = {1, 8, 64, 256, 8192};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
        for (size_t t = 0; t < sizeof Ts / sizeof Ts[0]; t++)
            for (int pi = 0; pi < 2; pi++) {
                if (shapes[s].N > 100000 && Ts[t] > 256) continue; /* lm_head: sampled rows */
                set_precision(precs[pi]);
                time_linear(shapes[s].name, pool, Ts[t], shapes[s].N, shapes[s].Kin);
            }

    /* Where each high-precision path stops paying: the decode kernel (built up to T = 32)
     * against the stacked hi + lo GEMM at small T, the stacked GEMM against two GEMMs at large T;
     * medium for scale. Graph time per call. */
    printf("high precision, small T: decode kernel vs stacked hi + lo GEMM; medium for scale "
           "(graph time per call; decode: its share of the copy rate)\n");
    static const int Tsmall[] = {1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
        for (size_t t = 0; t < sizeof Tsmall / sizeof Tsmall[0]; t++) {
            const int T = Tsmall[t], N = shapes[s].N, Kin = shapes[s].Kin;
            double dec = NAN;
            if (T <= 32) {
                linear_path_set(LINEAR_DECODE);
                dec = time_linear(NULL, pool, T, N, Kin).graph;
            }
            linear_path_set(LINEAR_STACKED);
            const double stk = time_linear(NULL, pool, T, N, Kin).graph;
            linear_path_set(LINEAR_TILES);
            const double til = time_linear(NULL, pool, T, N, Kin).graph;
            linear_path_set(LINEAR_MEDIUM);
            const double med = time_linear(NULL, pool, T, N, Kin).graph;
            const double bytes = 2.0 * N * Kin + 4.0 * T * Kin + 4.0 * T * N;
            char d[48] = "      -          ";
            if (!isnan(dec))
                snprintf(d, sizeof d, "%7.1f us (%3.0f%%)", dec * 1e6,
                         100.0 * bytes / dec / 1e9 / ceiling_copy_gbs);
            printf("  %-9s T=%-3d N=%-6d Kin=%-5d  decode %s  stacked %7.1f us  tiles %7.1f us  "
                   "medium %7.1f us%s\n",
                   shapes[s].name, T, N, Kin, d, stk * 1e6, til * 1e6, med * 1e6,
                   !isnan(dec) && dec < stk ? "  (decode faster)" : "");
        }
    printf("high precision, large T: stacked hi + lo GEMM vs two GEMMs vs the tiles (k ranges for "
           "256 blocks, then one range); medium through cuBLASLt and the tiles (graph time per "
           "call)\n");
    static const int Tlarge[] = {16, 32, 64, 128, 256, 512, 1024, 2048, 8192};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
        for (size_t t = 0; t < sizeof Tlarge / sizeof Tlarge[0]; t++) {
            const int T = Tlarge[t], N = shapes[s].N, Kin = shapes[s].Kin;
            if (N > 100000 && T > 2048) continue;
            linear_path_set(LINEAR_STACKED);
            const double stk = time_linear(NULL, pool, T, N, Kin).graph;
            linear_path_set(LINEAR_TWO_GEMMS);
            const double two = time_linear(NULL, pool, T, N, Kin).graph;
            linear_path_set(LINEAR_TILES);
            const double til = time_linear(NULL, pool, T, N, Kin).graph;
            const int old_b = cuda_linear_tiles_blocks(1);
            const double til1 = time_linear(NULL, pool, T, N, Kin).graph;
            linear_path_set(LINEAR_MEDIUM_TILES);
            const double mtil1 = time_linear(NULL, pool, T, N, Kin).graph;
            cuda_linear_tiles_blocks(old_b);
            const double mtil = time_linear(NULL, pool, T, N, Kin).graph;
            linear_path_set(LINEAR_MEDIUM);
            const double med = time_linear(NULL, pool, T, N, Kin).graph;
            const double cub = stk < two ? stk : two;
            printf("  %-9s T=%-5d N=%-6d Kin=%-5d  stacked %8.1f us  2 GEMMs %8.1f us  tiles %8.1f "
                   "/ %8.1f us (%.2fx)  medium %8.1f us  tiles %8.1f / %8.1f us (%.2fx)\n",
                   shapes[s].name, T, N, Kin, stk * 1e6, two * 1e6, til * 1e6, til1 * 1e6,
                   cub / (til < til1 ? til : til1), med * 1e6, mtil * 1e6, mtil1 * 1e6,
                   med / (mtil < mtil1 ? mtil : mtil1));
        }
    linear_path_reset();
    figures_det_small(pool, shapes, sizeof shapes / sizeof shapes[0]);
    figures_fp8(pool);
    gpu->dev_free(pool);
    time_chain();
    time_elementwise();
}

static void summary(void) {
    printf("\nworst error per op (linear: err / sum|x||w|)          worst     of allowed  "
           "tolerance\n");
    for (int i = 0; i < n_op_stats; i++)
        printf("  %-28s %10lld values  %10.3g  %8.3f    %s\n", op_stats[i].op,
               (long long)op_stats[i].checked, op_stats[i].worst, op_stats[i].worst_frac,
               op_stats[i].tolerance);
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0); /* in order with the log lines on stderr */
    char err[256];
    gpu = ops_cuda(0, err, sizeof err);
    if (!gpu) {
        printf("skipped: %s\n", err);
        printf("0 passed, 0 failed\n");
        return 0;
    }
    cpu = ops_cpu();
    if (argc > 1 && strcmp(argv[1], "--chain") == 0) { /* the persistent GEMV chain alone */
        check_decode_chain();
        CHECK_SUMMARY();
    }
    log_threshold = LOG_LEVEL_DEBUG; /* linear logs the algorithm cuBLASLt chose for each shape */
    struct cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess)
        printf("device 0: %s, %d SMs, %.0f MB L2, %.1f GiB; CPU threads %d\n", prop.name,
               prop.multiProcessorCount, prop.l2CacheSize / 1e6, prop.totalGlobalMem / 1073741824.0,
               omp_get_max_threads());
    test_embedding();
    test_rmsnorm();
    test_rope();
    test_add_rmsnorm();
    test_qk_norm_rope();
    test_kv_store();
    test_qkv_prepare();
    test_router_topk();
    test_moe_finalize();
    test_moe_finalize_add_rmsnorm();
    test_moe_input_quant();
    test_silu_mul();
    test_add();
    test_linear();
    test_linear_deterministic();
    test_linear_fp8();
    summary();
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
