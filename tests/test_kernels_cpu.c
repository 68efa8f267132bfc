/* Tests of the CPU backend (kernels/cpu/) against naive double-precision references written
 * plainly below. Inputs are random (fixed seed, never zeros); BF16 weights are rounded from random
 * floats and the references read the rounded values. Each comparison states its tolerance
 * |got - want| <= atol + rtol * |want| and prints its max error and first mismatches; integer
 * results and the determinism properties (batch invariance, prefill == decode) are exact.
 *
 *   test_kernels_cpu           run the tests
 *   test_kernels_cpu --bench   instead time linear: GB/s of weight reads at T = 1, GFLOP/s
 *                              at a few larger T */
#include <math.h>
#include <omp.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"
#include "common/tensor.h"
#include "kernels/ops.h"
#include "tests/check.h"

static const ops *cpu;

/* ---- random inputs ---- */

static uint64_t rng_state = 0x2545f4914f6cdd1dull;

static uint64_t rng_next(void) { /* splitmix64 */
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Uniform in [-1, 1), never exactly zero. */
static float rng_uniform(void) {
    float f;
    do {
        f = (float)((double)(rng_next() >> 11) / 9007199254740992.0 * 2.0 - 1.0);
    } while (f == 0.0f);
    return f;
}

static int rng_int(int n) { return (int)(rng_next() % (uint64_t)n); }

static float *rand_floats(int64_t n, float scale) {
    float *p = xmalloc((size_t)n * sizeof(float));
    for (int64_t i = 0; i < n; i++)
        p[i] = rng_uniform() * scale;
    return p;
}

/* A [rows, cols] weight of dtype dt (F32 or BF16) from random floats times scale; *vals gets the
 * values the tensor holds (after BF16 rounding), for the references. */
static tensor make_weight(dtype dt, int rows, int cols, float scale, float **vals) {
    const int64_t n = (int64_t)rows * cols;
    float *v = rand_floats(n, scale);
    tensor w = {.dtype = dt, .ndim = 2, .shape = {rows, cols}, .device = DEVICE_CPU};
    if (dt == DTYPE_BF16) {
        uint16_t *d = xmalloc((size_t)n * sizeof(uint16_t));
        for (int64_t i = 0; i < n; i++) {
            d[i] = f32_to_bf16(v[i]);
            v[i] = bf16_to_f32(d[i]);
        }
        w.data = d;
    } else {
        float *d = xmalloc((size_t)n * sizeof(float));
        memcpy(d, v, (size_t)n * sizeof(float));
        w.data = d;
    }
    if (vals)
        *vals = v;
    else
        free(v);
    return w;
}

/* ---- comparison ---- */

/* One CHECK for a whole array: every element within atol + rtol * |want|. */
static void compare(const char *what, const float *got, const double *want, int64_t n, double atol,
                    double rtol) {
    int64_t bad = 0;
    double max_err = 0.0;
    for (int64_t i = 0; i < n; i++) {
        const double err = fabs((double)got[i] - want[i]);
        const bool ok = err <= atol + rtol * fabs(want[i]); /* false for NaN */
        if (isnan(err))
            max_err = INFINITY;
        else if (err > max_err)
            max_err = err;
        if (!ok) {
            if (bad < 5)
                fprintf(stderr, "  %s: [%lld] got %.9g want %.9g err %.3g\n", what, (long long)i,
                        got[i], want[i], err);
            bad++;
        }
    }
    printf("  %-52s max abs err %.3g (atol %.0e rtol %.0e)\n", what, max_err, atol, rtol);
    CHECK(bad == 0, "%s: %lld of %lld outside atol %g + rtol %g, max abs err %.3g", what,
          (long long)bad, (long long)n, atol, rtol, max_err);
}

/* Bitwise equality of two float arrays (determinism properties). */
static void compare_exact(const char *what, const float *got, const float *want, int64_t n) {
    int64_t bad = 0;
    for (int64_t i = 0; i < n; i++) {
        if (memcmp(&got[i], &want[i], sizeof(float)) != 0) {
            if (bad < 5)
                fprintf(stderr, "  %s: [%lld] got %.9g want %.9g\n", what, (long long)i, got[i],
                        want[i]);
            bad++;
        }
    }
    printf("  %-52s %s\n", what, bad ? "DIFFERS" : "bit-identical");
    CHECK(bad == 0, "%s: %lld of %lld elements differ", what, (long long)bad, (long long)n);
}

/* ---- references, double precision, no cleverness ---- */

static void ref_linear(double *out, const float *x, const float *w, int T, int N, int Kin) {
    for (int t = 0; t < T; t++)
        for (int n = 0; n < N; n++) {
            double s = 0.0;
            for (int k = 0; k < Kin; k++)
                s += (double)x[t * Kin + k] * w[n * Kin + k];
            out[t * N + n] = s;
        }
}

static double ref_silu(double g) { return g / (1.0 + exp(-g)); }

/* ---- tests ---- */

static void test_embedding(void) {
    printf("embedding\n");
    const int V = 11, D = 37, T = 9;
    int32_t ids[9];
    for (int t = 0; t < T; t++)
        ids[t] = rng_int(V);
    ids[3] = ids[1]; /* a repeated token */
    ids[8] = V - 1;
    const dtype dts[] = {DTYPE_BF16, DTYPE_F32};
    for (int i = 0; i < 2; i++) {
        float *vals;
        tensor table = make_weight(dts[i], V, D, 1.0f, &vals);
        float *out = xmalloc(sizeof(float) * T * D);
        double *want = xmalloc(sizeof(double) * T * D);
        cpu->embedding(out, &table, ids, T, D);
        for (int t = 0; t < T; t++)
            for (int d = 0; d < D; d++)
                want[t * D + d] = vals[ids[t] * D + d];
        char what[64];
        snprintf(what, sizeof what, "embedding %s V=%d D=%d", dtype_name(dts[i]), V, D);
        compare(what, out, want, (int64_t)T * D, 0.0, 0.0);
        free(out);
        free(want);
        free(vals);
        free(table.data);
    }
}

static void test_rmsnorm(void) {
    printf("rmsnorm\n");
    const int R = 5, Cs[] = {70, 128};
    const float eps = 1e-6f;
    const dtype dts[] = {DTYPE_BF16, DTYPE_F32};
    for (int ci = 0; ci < 2; ci++)
        for (int di = 0; di < 2; di++) {
            const int C = Cs[ci];
            float *wv;
            tensor w = make_weight(dts[di], 1, C, 1.0f, &wv);
            w.ndim = 1;
            w.shape[0] = C;
            float *x = rand_floats((int64_t)R * C, 2.0f);
            float *out = xmalloc(sizeof(float) * R * C);
            double *want = xmalloc(sizeof(double) * R * C);
            cpu->rmsnorm(out, x, &w, R, C, eps);
            for (int r = 0; r < R; r++) {
                double ss = 0.0;
                for (int c = 0; c < C; c++)
                    ss += (double)x[r * C + c] * x[r * C + c];
                const double inv = 1.0 / sqrt(ss / C + eps);
                for (int c = 0; c < C; c++)
                    want[r * C + c] = x[r * C + c] * inv * wv[c];
            }
            char what[64];
            snprintf(what, sizeof what, "rmsnorm %s R=%d C=%d", dtype_name(dts[di]), R, C);
            compare(what, out, want, (int64_t)R * C, 1e-6, 1e-5);
            cpu->rmsnorm(x, x, &w, R, C, eps); /* in place */
            snprintf(what, sizeof what, "rmsnorm %s C=%d in place == out of place",
                     dtype_name(dts[di]), C);
            compare_exact(what, x, out, (int64_t)R * C);
            free(x);
            free(out);
            free(want);
            free(wv);
            free(w.data);
        }
}

static void test_linear(void) {
    printf("linear\n");
    const int Ts[] = {1, 3, 8, 17};
    const int shapes[][2] = {{33, 70}, {64, 128}, {5, 31}, {17, 32}, {40, 300}}; /* N, Kin */
    for (int si = 0; si < 5; si++) {
        const int N = shapes[si][0], Kin = shapes[si][1];
        float *wv;
        tensor wb = make_weight(DTYPE_BF16, N, Kin, 1.0f / sqrtf((float)Kin), &wv);
        /* The same values as F32. */
        tensor wf = {.dtype = DTYPE_F32, .ndim = 2, .shape = {N, Kin}, .data = wv};
        const int Tmax = 17;
        float *x = rand_floats((int64_t)Tmax * Kin, 1.0f);
        float *out = xmalloc(sizeof(float) * Tmax * N);
        float *out_f32 = xmalloc(sizeof(float) * Tmax * N);
        float *out_one = xmalloc(sizeof(float) * N);
        double *want = xmalloc(sizeof(double) * Tmax * N);
        ref_linear(want, x, wv, Tmax, N, Kin);
        for (int ti = 0; ti < 4; ti++) {
            const int T = Ts[ti];
            char what[80];
            cpu->linear(out, x, &wb, T, N, Kin);
            snprintf(what, sizeof what, "linear bf16 T=%d N=%d Kin=%d", T, N, Kin);
            compare(what, out, want, (int64_t)T * N, 1e-5, 1e-4);
            cpu->linear(out_f32, x, &wf, T, N, Kin);
            snprintf(what, sizeof what, "linear f32 == bf16 values, T=%d N=%d Kin=%d", T, N, Kin);
            compare_exact(what, out_f32, out, (int64_t)T * N);
        }
        /* Batch invariance: each row of the T = 17 result equals that token run alone. */
        cpu->linear(out, x, &wb, Tmax, N, Kin);
        int differ = 0;
        for (int t = 0; t < Tmax; t++) {
            cpu->linear(out_one, x + (int64_t)t * Kin, &wb, 1, N, Kin);
            if (memcmp(out_one, out + (int64_t)t * N, sizeof(float) * N) != 0) differ++;
        }
        char what[80];
        snprintf(what, sizeof what, "linear T=17 rows == T=1 each, N=%d Kin=%d", N, Kin);
        printf("  %-52s %s\n", what, differ ? "DIFFERS" : "bit-identical");
        CHECK(differ == 0, "linear N=%d Kin=%d: %d of %d tokens differ from their T=1 result", N,
              Kin, differ, Tmax);
        free(x);
        free(out);
        free(out_f32);
        free(out_one);
        free(want);
        free(wv);
        free(wb.data);
    }

    /* F16 weights: random halves in [2^-6, 4), compared with the same values as F32. */
    {
        const int N = 19, Kin = 75, T = 6;
        uint16_t *h = xmalloc(sizeof(uint16_t) * N * Kin);
        float *hv = xmalloc(sizeof(float) * N * Kin);
        for (int i = 0; i < N * Kin; i++) {
            const uint16_t sign = (uint16_t)(rng_next() & 1) << 15;
            const uint16_t ex = (uint16_t)(9 + rng_int(8)) << 10;
            h[i] = sign | ex | (uint16_t)rng_int(1024);
            hv[i] = f16_to_f32(h[i]);
        }
        tensor w16 = {.dtype = DTYPE_F16, .ndim = 2, .shape = {N, Kin}, .data = h};
        tensor w32 = {.dtype = DTYPE_F32, .ndim = 2, .shape = {N, Kin}, .data = hv};
        float *x = rand_floats((int64_t)T * Kin, 1.0f);
        float *a = xmalloc(sizeof(float) * T * N), *b = xmalloc(sizeof(float) * T * N);
        cpu->linear(a, x, &w16, T, N, Kin);
        cpu->linear(b, x, &w32, T, N, Kin);
        compare_exact("linear f16 == f32 values, T=6 N=19 Kin=75", a, b, (int64_t)T * N);
        free(h);
        free(hv);
        free(x);
        free(a);
        free(b);
    }
}

/* The Hugging Face inv_freq and angle, step by step in fp32 (the contract), then double. */
static void ref_rope(double *out, const float *x, const int32_t *pos, int T, int nh, int Dh,
                     double theta, bool fp32_angle) {
    const int half = Dh / 2;
    for (int t = 0; t < T; t++)
        for (int j = 0; j < half; j++) {
            double angle;
            if (fp32_angle) {
                const float e = (float)(2 * j) / (float)Dh;
                const float inv_freq = 1.0f / powf((float)theta, e);
                angle = (double)((float)pos[t] * inv_freq);
            } else {
                angle = pos[t] * pow(theta, -2.0 * j / Dh);
            }
            const double c = cos(angle), s = sin(angle);
            for (int h = 0; h < nh; h++) {
                const int64_t base = ((int64_t)t * nh + h) * Dh;
                const double x0 = x[base + j], x1 = x[base + j + half];
                out[base + j] = x0 * c - x1 * s;
                out[base + j + half] = x1 * c + x0 * s;
            }
        }
}

static void test_rope(void) {
    printf("rope\n");
    const int H = 4, Hkv = 2;
    const int Dhs[] = {64, 128};
    const double thetas[] = {1e6, 1e4};
    const int32_t pos[] = {0, 1, 7, 63, 1000, 65535, 500000, 4194303};
    const int T = 8;
    for (int ci = 0; ci < 2; ci++) {
        const int Dh = Dhs[ci];
        const double theta = thetas[ci];
        float *q = rand_floats((int64_t)T * H * Dh, 1.0f);
        float *k = rand_floats((int64_t)T * Hkv * Dh, 1.0f);
        float *q0 = xmalloc(sizeof(float) * T * H * Dh),
              *k0 = xmalloc(sizeof(float) * T * Hkv * Dh);
        memcpy(q0, q, sizeof(float) * T * H * Dh);
        memcpy(k0, k, sizeof(float) * T * Hkv * Dh);
        double *wq = xmalloc(sizeof(double) * T * H * Dh);
        double *wk = xmalloc(sizeof(double) * T * Hkv * Dh);
        cpu->rope(q, k, pos, T, H, Hkv, Dh, theta);

        char what[80];
        ref_rope(wq, q0, pos, T, H, Dh, theta, true);
        ref_rope(wk, k0, pos, T, Hkv, Dh, theta, true);
        snprintf(what, sizeof what, "rope q Dh=%d theta=%g, pos up to 4194303", Dh, theta);
        compare(what, q, wq, (int64_t)T * H * Dh, 2e-6, 1e-5);
        snprintf(what, sizeof what, "rope k Dh=%d theta=%g, pos up to 4194303", Dh, theta);
        compare(what, k, wk, (int64_t)T * Hkv * Dh, 2e-6, 1e-5);

        /* Small positions (the first 4 tokens) against the exact angle in double: the fp32 angle
         * error stays below pos * 2^-24. */
        ref_rope(wq, q0, pos, 4, H, Dh, theta, false);
        snprintf(what, sizeof what, "rope q Dh=%d pos <= 63 vs exact double angle", Dh);
        compare(what, q, wq, (int64_t)4 * H * Dh, 2e-5, 1e-5);
        free(q);
        free(k);
        free(q0);
        free(k0);
        free(wq);
        free(wk);
    }
}

/* Paged attention over several sequences with a scrambled page table. */
typedef struct {
    int page_size, H, Hkv, Dh, n_seq;
    int len[3];
} attn_case;

static void test_attention_case(const attn_case *c) {
    const int S = c->page_size, H = c->H, Hkv = c->Hkv, Dh = c->Dh, n_seq = c->n_seq;
    int max_len = 0, n_tok = 0;
    for (int s = 0; s < n_seq; s++) {
        if (c->len[s] > max_len) max_len = c->len[s];
        n_tok += c->len[s];
    }
    const int max_pages = (max_len + S - 1) / S + 1;
    const int P = n_seq * max_pages;
    const float scale = 1.0f / sqrtf((float)Dh);

    /* Every page of the pool in a shuffled order, handed out to the sequences in turn. */
    int32_t *page_table = xmalloc(sizeof(int32_t) * P);
    for (int i = 0; i < P; i++)
        page_table[i] = i;
    for (int i = P - 1; i > 0; i--) {
        const int j = rng_int(i + 1);
        const int32_t tmp = page_table[i];
        page_table[i] = page_table[j];
        page_table[j] = tmp;
    }

    /* Per-sequence q, k, v at every position: [n_seq, max_len, heads, Dh]. q is scaled up so the
     * softmax is far from uniform. */
    const int64_t qrow = (int64_t)H * Dh, kvrow = (int64_t)Hkv * Dh;
    float *q_all = rand_floats((int64_t)n_seq * max_len * qrow, 3.0f);
    float *k_all = rand_floats((int64_t)n_seq * max_len * kvrow, 1.0f);
    float *v_all = rand_floats((int64_t)n_seq * max_len * kvrow, 1.0f);

    /* The batch: every (seq, pos) once, in a shuffled order. */
    int32_t *tok_seq = xmalloc(sizeof(int32_t) * n_tok),
            *tok_pos = xmalloc(sizeof(int32_t) * n_tok);
    for (int s = 0, i = 0; s < n_seq; s++)
        for (int p = 0; p < c->len[s]; p++, i++) {
            tok_seq[i] = s;
            tok_pos[i] = p;
        }
    for (int i = n_tok - 1; i > 0; i--) {
        const int j = rng_int(i + 1);
        int32_t a = tok_seq[i], b = tok_pos[i];
        tok_seq[i] = tok_seq[j];
        tok_pos[i] = tok_pos[j];
        tok_seq[j] = a;
        tok_pos[j] = b;
    }
    float *q = xmalloc(sizeof(float) * n_tok * qrow), *k = xmalloc(sizeof(float) * n_tok * kvrow),
          *v = xmalloc(sizeof(float) * n_tok * kvrow);
    for (int i = 0; i < n_tok; i++) {
        const int64_t src = (int64_t)tok_seq[i] * max_len + tok_pos[i];
        memcpy(q + i * qrow, q_all + src * qrow, sizeof(float) * qrow);
        memcpy(k + i * kvrow, k_all + src * kvrow, sizeof(float) * kvrow);
        memcpy(v + i * kvrow, v_all + src * kvrow, sizeof(float) * kvrow);
    }

    /* Cache filled with NaN, so reading a slot never written shows up as a mismatch. */
    const int64_t cache_n = (int64_t)P * S * kvrow;
    kv_layer kv = {xmalloc(sizeof(float) * cache_n), xmalloc(sizeof(float) * cache_n), 0};
    for (int64_t i = 0; i < cache_n; i++)
        kv.k[i] = kv.v[i] = NAN;
    attn_batch b = {.T = n_tok,
                    .pos = tok_pos,
                    .seq = tok_seq,
                    .page_table = page_table,
                    .max_pages = max_pages,
                    .page_size = S};
    float *out = xmalloc(sizeof(float) * n_tok * qrow);
    cpu->kv_store(kv, k, v, &b, Hkv, Dh);
    cpu->attention(out, q, kv, &b, H, Hkv, Dh, scale);

    char what[96];
    snprintf(what, sizeof what, "attention S=%d H=%d Hkv=%d Dh=%d lens %d,%d,%d: kv_store", S, H,
             Hkv, Dh, c->len[0], c->len[1], c->len[2]);
    int misplaced = 0;
    for (int i = 0; i < n_tok; i++) {
        const int page = page_table[tok_seq[i] * max_pages + tok_pos[i] / S];
        const int64_t slot = (int64_t)page * S + tok_pos[i] % S;
        if (memcmp(kv.k + slot * kvrow, k + i * kvrow, sizeof(float) * kvrow) != 0 ||
            memcmp(kv.v + slot * kvrow, v + i * kvrow, sizeof(float) * kvrow) != 0)
            misplaced++;
    }
    printf("  %-52s %d misplaced\n", what, misplaced);
    CHECK(misplaced == 0, "%s: %d tokens not at their page slot", what, misplaced);

    /* Reference: each sequence's contiguous history, double softmax. */
    double *want = xmalloc(sizeof(double) * n_tok * qrow);
    double *sc = xmalloc(sizeof(double) * max_len);
    for (int i = 0; i < n_tok; i++) {
        const int s = tok_seq[i], pos = tok_pos[i];
        for (int h = 0; h < H; h++) {
            const int g = h / (H / Hkv);
            const float *qh = q + i * qrow + (int64_t)h * Dh;
            double m = -INFINITY, sum = 0.0;
            for (int p = 0; p <= pos; p++) {
                const float *kp = k_all + ((int64_t)s * max_len + p) * kvrow + (int64_t)g * Dh;
                double d = 0.0;
                for (int e = 0; e < Dh; e++)
                    d += (double)qh[e] * kp[e];
                sc[p] = d * scale;
                m = fmax(m, sc[p]);
            }
            for (int p = 0; p <= pos; p++)
                sum += (sc[p] = exp(sc[p] - m));
            for (int e = 0; e < Dh; e++) {
                double acc = 0.0;
                for (int p = 0; p <= pos; p++)
                    acc += sc[p] * v_all[((int64_t)s * max_len + p) * kvrow + (int64_t)g * Dh + e];
                want[i * qrow + (int64_t)h * Dh + e] = acc / sum;
            }
        }
    }
    snprintf(what, sizeof what, "attention S=%d H=%d Hkv=%d Dh=%d lens %d,%d,%d: prefill", S, H,
             Hkv, Dh, c->len[0], c->len[1], c->len[2]);
    compare(what, out, want, (int64_t)n_tok * qrow, 1e-5, 1e-4);

    /* Decode the same positions token by token (one token per sequence per step) into a fresh
     * cache: every output must be bit-identical to the prefill's. */
    for (int64_t i = 0; i < cache_n; i++)
        kv.k[i] = kv.v[i] = NAN;
    float *out_dec = xmalloc(sizeof(float) * n_tok * qrow);
    float *step_q = xmalloc(sizeof(float) * n_seq * qrow),
          *step_out = xmalloc(sizeof(float) * n_seq * qrow);
    float *step_k = xmalloc(sizeof(float) * n_seq * kvrow),
          *step_v = xmalloc(sizeof(float) * n_seq * kvrow);
    int32_t step_seq[3], step_pos[3], step_idx[3];
    for (int p = 0; p < max_len; p++) {
        int n = 0;
        for (int i = 0; i < n_tok; i++) {
            if (tok_pos[i] != p) continue;
            step_seq[n] = tok_seq[i];
            step_pos[n] = p;
            step_idx[n] = i;
            memcpy(step_q + n * qrow, q + i * qrow, sizeof(float) * qrow);
            memcpy(step_k + n * kvrow, k + i * kvrow, sizeof(float) * kvrow);
            memcpy(step_v + n * kvrow, v + i * kvrow, sizeof(float) * kvrow);
            n++;
        }
        attn_batch sb = {.T = n,
                         .pos = step_pos,
                         .seq = step_seq,
                         .page_table = page_table,
                         .max_pages = max_pages,
                         .page_size = S};
        cpu->kv_store(kv, step_k, step_v, &sb, Hkv, Dh);
        cpu->attention(step_out, step_q, kv, &sb, H, Hkv, Dh, scale);
        for (int j = 0; j < n; j++)
            memcpy(out_dec + step_idx[j] * qrow, step_out + j * qrow, sizeof(float) * qrow);
    }
    snprintf(what, sizeof what, "attention S=%d Dh=%d: decode == prefill", S, Dh);
    compare_exact(what, out_dec, out, (int64_t)n_tok * qrow);

    /* A BF16 cache: kv_store rounds each value to nearest even into its slot, and attention gives
     * the bits of an fp32 cache that holds the rounded values. */
    kv_layer kvb = {xmalloc(sizeof(uint16_t) * cache_n), xmalloc(sizeof(uint16_t) * cache_n), 1};
    for (int64_t i = 0; i < cache_n; i++)
        kv_k_bf16(kvb)[i] = kv_v_bf16(kvb)[i] = 0x7fc0; /* NaN */
    float *kr = xmalloc(sizeof(float) * n_tok * kvrow),
          *vr = xmalloc(sizeof(float) * n_tok * kvrow);
    for (int64_t i = 0; i < (int64_t)n_tok * kvrow; i++) {
        kr[i] = bf16_to_f32(f32_to_bf16(k[i]));
        vr[i] = bf16_to_f32(f32_to_bf16(v[i]));
    }
    for (int64_t i = 0; i < cache_n; i++)
        kv.k[i] = kv.v[i] = NAN;
    cpu->kv_store(kvb, k, v, &b, Hkv, Dh);
    cpu->kv_store(kv, kr, vr, &b, Hkv, Dh);
    misplaced = 0;
    for (int i = 0; i < n_tok; i++) {
        const int page = page_table[tok_seq[i] * max_pages + tok_pos[i] / S];
        const int64_t slot = (int64_t)page * S + tok_pos[i] % S;
        for (int64_t e = 0; e < kvrow; e++)
            if (kv_k_bf16(kvb)[slot * kvrow + e] != f32_to_bf16(k[i * kvrow + e]) ||
                kv_v_bf16(kvb)[slot * kvrow + e] != f32_to_bf16(v[i * kvrow + e]))
                misplaced++;
    }
    snprintf(what, sizeof what, "attention S=%d Dh=%d: BF16 kv_store", S, Dh);
    printf("  %-52s %d wrong\n", what, misplaced);
    CHECK(misplaced == 0, "%s: %d values not rounded into their slot", what, misplaced);
    float *out_b = xmalloc(sizeof(float) * n_tok * qrow);
    cpu->attention(out_b, q, kvb, &b, H, Hkv, Dh, scale);
    cpu->attention(out_dec, q, kv, &b, H, Hkv, Dh, scale);
    snprintf(what, sizeof what, "attention S=%d Dh=%d: BF16 cache == fp32 of its values", S, Dh);
    compare_exact(what, out_b, out_dec, (int64_t)n_tok * qrow);
    snprintf(what, sizeof what, "attention S=%d Dh=%d: BF16 cache near fp32", S, Dh);
    compare(what, out_b, want, (int64_t)n_tok * qrow, 2e-2, 2e-2);
    free(kvb.k);
    free(kvb.v);
    free(kr);
    free(vr);
    free(out_b);

    free(page_table);
    free(q_all);
    free(k_all);
    free(v_all);
    free(tok_seq);
    free(tok_pos);
    free(q);
    free(k);
    free(v);
    free(kv.k);
    free(kv.v);
    free(out);
    free(want);
    free(sc);
    free(out_dec);
    free(step_q);
    free(step_out);
    free(step_k);
    free(step_v);
}

static void test_attention(void) {
    printf("attention\n");
    const attn_case cases[] = {
        {.page_size = 4, .H = 4, .Hkv = 2, .Dh = 16, .n_seq = 3, .len = {5, 13, 22}},
        {.page_size = 16, .H = 4, .Hkv = 2, .Dh = 20, .n_seq = 3, .len = {1, 17, 40}},
        {.page_size = 4, .H = 4, .Hkv = 4, .Dh = 8, .n_seq = 2, .len = {9, 3, 0}},
    };
    for (int i = 0; i < 3; i++)
        test_attention_case(&cases[i]);
}

/* Reference router for one token: double softmax, stable sort by probability descending. */
static void ref_route(int32_t *ids, double *wts, const float *logits, int E, int K, bool norm) {
    double m = -INFINITY, sum = 0.0;
    double *p = xmalloc(sizeof(double) * E);
    for (int e = 0; e < E; e++)
        m = fmax(m, logits[e]);
    for (int e = 0; e < E; e++)
        sum += (p[e] = exp((double)logits[e] - m));
    for (int e = 0; e < E; e++)
        p[e] /= sum;
    bool *taken = xcalloc(E, sizeof(bool));
    for (int k = 0; k < K; k++) {
        int best = -1;
        for (int e = 0; e < E; e++)
            if (!taken[e] && (best < 0 || p[e] > p[best])) best = e;
        taken[best] = true;
        ids[k] = best;
        wts[k] = p[best];
    }
    if (norm) {
        double s = 0.0;
        for (int k = 0; k < K; k++)
            s += wts[k];
        for (int k = 0; k < K; k++)
            wts[k] /= s;
    }
    free(p);
    free(taken);
}

static void test_router_case(int T, int E, int K, bool with_ties) {
    float *logits = rand_floats((int64_t)T * E, 3.0f);
    if (with_ties) {
        /* Row 0: one clear winner, then four equal runners-up for the three places left. */
        for (int e = 0; e < E; e++)
            logits[e] = -1.0f - 0.01f * e;
        logits[14] = logits[9] = logits[3] = logits[12] = 2.0f;
        logits[5] = 2.5f;
        /* Row 1: all equal. */
        for (int e = 0; e < E; e++)
            logits[E + e] = 0.75f;
        /* Row 2: a tie across the K boundary and a tie inside the top K. */
        logits[2 * E + 1] = logits[2 * E + 14] = 1.5f;
        logits[2 * E + 7] = logits[2 * E + 8] = logits[2 * E + 0] = 4.0f;
    }
    int32_t *ids = xmalloc(sizeof(int32_t) * T * K), *want_ids = xmalloc(sizeof(int32_t) * T * K);
    float *w = xmalloc(sizeof(float) * T * K);
    double *want_w = xmalloc(sizeof(double) * T * K);
    for (int ni = 0; ni < 2; ni++) {
        const bool norm = ni == 1;
        cpu->router_topk(ids, w, logits, T, E, K, norm);
        for (int t = 0; t < T; t++)
            ref_route(want_ids + t * K, want_w + t * K, logits + (int64_t)t * E, E, K, norm);
        int wrong = 0;
        for (int i = 0; i < T * K; i++) {
            if (ids[i] != want_ids[i]) {
                if (wrong < 5)
                    fprintf(stderr, "  router: token %d slot %d got expert %d want %d\n", i / K,
                            i % K, ids[i], want_ids[i]);
                wrong++;
            }
        }
        char what[80];
        snprintf(what, sizeof what, "router T=%d E=%d K=%d norm=%d%s: ids", T, E, K, norm,
                 with_ties ? " ties" : "");
        printf("  %-52s %d wrong\n", what, wrong);
        CHECK(wrong == 0, "%s: %d of %d ids differ", what, wrong, T * K);
        snprintf(what, sizeof what, "router T=%d E=%d K=%d norm=%d%s: weights", T, E, K, norm,
                 with_ties ? " ties" : "");
        compare(what, w, want_w, (int64_t)T * K, 1e-6, 1e-5);
    }
    if (with_ties) {
        /* The rule spelled out, whatever the reference does. */
        cpu->router_topk(ids, w, logits, T, E, K, false);
        CHECK(ids[0] == 5 && ids[1] == 3 && ids[2] == 9 && ids[3] == 12,
              "router ties row 0: got %d %d %d %d, want 5 3 9 12", ids[0], ids[1], ids[2], ids[3]);
        CHECK(ids[K] == 0 && ids[K + 1] == 1 && ids[K + 2] == 2 && ids[K + 3] == 3,
              "router all-equal row: got %d %d %d %d, want 0 1 2 3", ids[K], ids[K + 1], ids[K + 2],
              ids[K + 3]);
    }
    free(logits);
    free(ids);
    free(want_ids);
    free(w);
    free(want_w);
}

static void test_router(void) {
    printf("router_topk\n");
    test_router_case(7, 16, 4, true);
    test_router_case(33, 128, 8, false);
    test_router_case(3, 5, 5, false);
}

/* MoE experts against a per-token, per-slot naive loop. */
static void test_moe_case(int T, int E, int K, int D, int F, const int32_t *ids, const char *name) {
    tensor *gate = xmalloc(sizeof(tensor) * E), *up = xmalloc(sizeof(tensor) * E),
           *down = xmalloc(sizeof(tensor) * E);
    float **gv = xmalloc(sizeof(float *) * E), **uv = xmalloc(sizeof(float *) * E),
          **dv = xmalloc(sizeof(float *) * E);
    for (int e = 0; e < E; e++) {
        gate[e] = make_weight(DTYPE_BF16, F, D, 1.0f / sqrtf((float)D), &gv[e]);
        up[e] = make_weight(DTYPE_BF16, F, D, 1.0f / sqrtf((float)D), &uv[e]);
        down[e] = make_weight(DTYPE_BF16, D, F, 1.0f / sqrtf((float)F), &dv[e]);
    }
    moe_experts w = {.E = E, .gate = gate, .up = up, .down = down};
    float *x = rand_floats((int64_t)T * D, 2.0f);
    float *out = xmalloc(sizeof(float) * T * K * D);
    double *want = xmalloc(sizeof(double) * T * K * D);
    double *h = xmalloc(sizeof(double) * F);
    cpu->moe_experts(out, x, ids, &w, T, K, D, F);
    for (int t = 0; t < T; t++)
        for (int k = 0; k < K; k++) {
            const int e = ids[t * K + k];
            const float *xt = x + (int64_t)t * D;
            for (int f = 0; f < F; f++) {
                double g = 0.0, u = 0.0;
                for (int d = 0; d < D; d++) {
                    g += (double)gv[e][f * D + d] * xt[d];
                    u += (double)uv[e][f * D + d] * xt[d];
                }
                h[f] = ref_silu(g) * u;
            }
            for (int d = 0; d < D; d++) {
                double y = 0.0;
                for (int f = 0; f < F; f++)
                    y += (double)dv[e][d * F + f] * h[f];
                want[((int64_t)t * K + k) * D + d] = y;
            }
        }
    char what[96];
    snprintf(what, sizeof what, "moe_experts %s T=%d E=%d K=%d D=%d F=%d", name, T, E, K, D, F);
    compare(what, out, want, (int64_t)T * K * D, 1e-5, 1e-4);

    /* Each token alone (few busy experts: the linears take the threads) must give the rows the
     * batch gave (many busy experts: threads across experts). */
    float *one = xmalloc(sizeof(float) * K * D);
    int differ = 0;
    for (int t = 0; t < T; t++) {
        cpu->moe_experts(one, x + (int64_t)t * D, ids + t * K, &w, 1, K, D, F);
        if (memcmp(one, out + (int64_t)t * K * D, sizeof(float) * K * D) != 0) differ++;
    }
    snprintf(what, sizeof what, "moe_experts %s: batch rows == T=1 each", name);
    printf("  %-52s %s\n", what, differ ? "DIFFERS" : "bit-identical");
    CHECK(differ == 0, "%s: %d of %d tokens differ", what, differ, T);

    for (int e = 0; e < E; e++) {
        free(gate[e].data);
        free(up[e].data);
        free(down[e].data);
        free(gv[e]);
        free(uv[e]);
        free(dv[e]);
    }
    free(gate);
    free(up);
    free(down);
    free(gv);
    free(uv);
    free(dv);
    free(x);
    free(out);
    free(want);
    free(h);
    free(one);
}

static void test_moe(void) {
    printf("moe_experts\n");
    /* Expert 3 in slot 0 of every token; slot 1 from {0, 1, 2, 4, 7}: experts 5 and 6 idle. */
    {
        const int T = 20, E = 8, K = 2;
        const int32_t others[] = {0, 1, 2, 4, 7};
        int32_t ids[40];
        for (int t = 0; t < T; t++) {
            ids[t * K] = 3;
            ids[t * K + 1] = others[rng_int(5)];
        }
        test_moe_case(T, E, K, 40, 24, ids, "one busy expert");
    }
    /* Few busy experts over a larger batch: the expert-after-expert path with tiled linears. */
    {
        const int T = 9, E = 4, K = 1;
        int32_t ids[9];
        for (int t = 0; t < T; t++)
            ids[t] = t % 3 == 0 ? 1 : 2;
        test_moe_case(T, E, K, 64, 96, ids, "two busy experts");
    }
    /* Top-8 of 16, random distinct experts per token. */
    {
        const int T = 11, E = 16, K = 8;
        int32_t ids[88];
        for (int t = 0; t < T; t++) {
            int perm[16];
            for (int e = 0; e < E; e++)
                perm[e] = e;
            for (int k = 0; k < K; k++) {
                const int j = k + rng_int(E - k);
                const int tmp = perm[k];
                perm[k] = perm[j];
                perm[j] = tmp;
                ids[t * K + k] = perm[k];
            }
        }
        test_moe_case(T, E, K, 48, 33, ids, "top-8 of 16");
    }
}

/* Slots another rank computes (negative ids): skipped, their rows of out left as they were.
 * Against the same call with every id kept: the computed rows bit-identical, the skipped rows
 * still holding the sentinel. skip_every = 0: every slot skipped. */
static void test_moe_skip_case(int T, int E, int K, int D, int F, int skip_every,
                               const char *name) {
    const float sentinel = 12345.0f;
    tensor *gate = xmalloc(sizeof(tensor) * E), *up = xmalloc(sizeof(tensor) * E),
           *down = xmalloc(sizeof(tensor) * E);
    for (int e = 0; e < E; e++) {
        gate[e] = make_weight(DTYPE_BF16, F, D, 1.0f / sqrtf((float)D), NULL);
        up[e] = make_weight(DTYPE_BF16, F, D, 1.0f / sqrtf((float)D), NULL);
        down[e] = make_weight(DTYPE_BF16, D, F, 1.0f / sqrtf((float)F), NULL);
    }
    moe_experts w = {.E = E, .gate = gate, .up = up, .down = down};
    const int64_t n_slots = (int64_t)T * K;
    float *x = rand_floats((int64_t)T * D + 1, 2.0f);
    int32_t *ids = xmalloc(sizeof(int32_t) * (n_slots + 1));
    int32_t *part = xmalloc(sizeof(int32_t) * (n_slots + 1));
    for (int t = 0; t < T; t++) { /* K distinct experts per token */
        int perm[64];
        for (int e = 0; e < E; e++)
            perm[e] = e;
        for (int k = 0; k < K; k++) {
            const int j = k + rng_int(E - k);
            const int tmp = perm[k];
            perm[k] = perm[j];
            perm[j] = tmp;
            ids[t * K + k] = perm[k];
        }
    }
    int64_t n_skipped = 0;
    for (int64_t i = 0; i < n_slots; i++) {
        const bool skip = skip_every == 0 || rng_int(skip_every) == 0;
        part[i] = skip ? (i % 5 == 4 ? -2 : -1) : ids[i]; /* any negative id is skipped */
        n_skipped += skip;
    }
    float *full = xmalloc(sizeof(float) * (n_slots * D + 1));
    float *out = xmalloc(sizeof(float) * (n_slots * D + 1));
    float *kept = xmalloc(sizeof(float) * (n_slots * D + 1));
    float *want_kept = xmalloc(sizeof(float) * (n_slots * D + 1));
    if (skip_every != 0) cpu->moe_experts(full, x, ids, &w, T, K, D, F);
    for (int64_t i = 0; i < n_slots * D + 1; i++)
        out[i] = sentinel; /* one past the end too: nothing may write there */
    cpu->moe_experts(out, x, part, &w, T, K, D, F);

    /* Computed rows against the full call (exact), skipped rows against the sentinel. */
    int64_t n_kept = 0, overwritten = 0;
    for (int64_t i = 0; i < n_slots; i++) {
        if (part[i] >= 0) {
            memcpy(kept + n_kept * D, out + i * D, sizeof(float) * D);
            memcpy(want_kept + n_kept * D, full + i * D, sizeof(float) * D);
            n_kept++;
            continue;
        }
        for (int d = 0; d < D; d++)
            if (memcmp(&out[i * D + d], &sentinel, sizeof(float)) != 0) {
                if (overwritten < 5)
                    fprintf(stderr, "  %s: skipped slot %lld (t %lld, k %lld) d %d = %.9g\n", name,
                            (long long)i, (long long)(i / K), (long long)(i % K), d,
                            out[i * D + d]);
                overwritten++;
            }
    }
    const bool past_end = memcmp(&out[n_slots * D], &sentinel, sizeof(float)) == 0;
    char what[128];
    snprintf(what, sizeof what, "moe_experts %s T=%d E=%d K=%d: kept rows", name, T, E, K);
    if (n_kept > 0) compare_exact(what, kept, want_kept, n_kept * D);
    snprintf(what, sizeof what, "moe_experts %s: %lld skipped slots", name, (long long)n_skipped);
    printf("  %-52s %s\n", what, overwritten || !past_end ? "WRITTEN" : "untouched");
    CHECK(overwritten == 0 && past_end, "%s: %lld values of skipped slots overwritten%s", what,
          (long long)overwritten, past_end ? "" : ", and the value past the end");
    CHECK(n_kept + n_skipped == n_slots && (skip_every != 0 || n_kept == 0),
          "%s: %lld kept + %lld skipped of %lld", name, (long long)n_kept, (long long)n_skipped,
          (long long)n_slots);

    for (int e = 0; e < E; e++) {
        free(gate[e].data);
        free(up[e].data);
        free(down[e].data);
    }
    free(gate);
    free(up);
    free(down);
    free(x);
    free(ids);
    free(part);
    free(full);
    free(out);
    free(kept);
    free(want_kept);
}

static void test_moe_skip(void) {
    printf("moe_experts with skipped slots (negative ids)\n");
    test_moe_skip_case(16, 16, 4, 48, 33, 3, "a third skipped, many busy");
    test_moe_skip_case(9, 4, 2, 64, 40, 2, "half skipped, few busy");
    test_moe_skip_case(1, 8, 8, 24, 16, 2, "one token, top-8");
    test_moe_skip_case(12, 8, 2, 32, 24, 0, "every slot skipped");
    test_moe_skip_case(0, 8, 2, 32, 24, 0, "T = 0");

    /* One busy expert among skipped slots: the pairs array is sized by the kept slots. */
    {
        const int T = 7, E = 6, K = 3, D = 16, F = 12;
        tensor g[6], u[6], dn[6];
        for (int e = 0; e < E; e++) {
            g[e] = make_weight(DTYPE_F32, F, D, 0.25f, NULL);
            u[e] = make_weight(DTYPE_F32, F, D, 0.25f, NULL);
            dn[e] = make_weight(DTYPE_F32, D, F, 0.25f, NULL);
        }
        moe_experts w = {.E = E, .gate = g, .up = u, .down = dn};
        float *x = rand_floats((int64_t)T * D, 1.0f);
        int32_t ids[21], one_id[3] = {-1, 5, -1};
        for (int i = 0; i < T * K; i++)
            ids[i] = i == 10 ? 5 : -1; /* token 3, slot 1 */
        float out[21 * 16], one[3 * 16];
        for (int i = 0; i < T * K * D; i++)
            out[i] = NAN;
        for (int i = 0; i < K * D; i++)
            one[i] = NAN;
        cpu->moe_experts(out, x, ids, &w, T, K, D, F);
        cpu->moe_experts(one, x + 3 * D, one_id, &w, 1, K, D, F);
        int nan_rows = 0;
        for (int i = 0; i < T * K; i++)
            if (i != 10 && isnan(out[i * D]) && isnan(out[i * D + D - 1])) nan_rows++;
        CHECK(nan_rows == T * K - 1, "one kept slot: %d of %d skipped rows still NaN", nan_rows,
              T * K - 1);
        CHECK(!isnan(out[10 * D]) && memcmp(out + 10 * D, one + D, sizeof(float) * D) == 0,
              "one kept slot: its row differs from the same token alone");
        printf("  %-52s %s\n", "one kept slot among 21", nan_rows == T * K - 1 ? "ok" : "WRONG");
        for (int e = 0; e < E; e++) {
            free(g[e].data);
            free(u[e].data);
            free(dn[e].data);
        }
        free(x);
    }
}

static void test_finalize_and_elementwise(void) {
    printf("moe_finalize, silu_mul, add\n");
    const int T = 5, K = 4, D = 37;
    float *eo = rand_floats((int64_t)T * K * D, 2.0f);
    float *tw = rand_floats((int64_t)T * K, 1.0f);
    float *out = xmalloc(sizeof(float) * T * D);
    double *want = xmalloc(sizeof(double) * T * K * D);
    cpu->moe_finalize(out, eo, tw, T, K, D);
    for (int t = 0; t < T; t++)
        for (int d = 0; d < D; d++) {
            double s = 0.0;
            for (int k = 0; k < K; k++)
                s += (double)tw[t * K + k] * eo[(t * K + k) * D + d];
            want[t * D + d] = s;
        }
    compare("moe_finalize T=5 K=4 D=37", out, want, (int64_t)T * D, 1e-6, 1e-5);

    const int F = 45;
    float *g = rand_floats((int64_t)T * F, 6.0f), *u = rand_floats((int64_t)T * F, 2.0f);
    float *o2 = xmalloc(sizeof(float) * T * F);
    cpu->silu_mul(o2, g, u, T, F);
    for (int i = 0; i < T * F; i++)
        want[i] = ref_silu(g[i]) * u[i];
    compare("silu_mul T=5 F=45", o2, want, (int64_t)T * F, 1e-6, 1e-5);

    cpu->add(o2, g, u, (int64_t)T * F);
    /* An fp32 add is the exact sum rounded once to fp32. */
    for (int i = 0; i < T * F; i++)
        want[i] = (float)((double)g[i] + u[i]);
    compare("add n=225 vs the exact sum rounded to fp32", o2, want, (int64_t)T * F, 0.0, 0.0);
    cpu->add(g, g, u, (int64_t)T * F); /* in place */
    compare_exact("add in place", g, o2, (int64_t)T * F);
    free(eo);
    free(tw);
    free(out);
    free(want);
    free(g);
    free(u);
    free(o2);
}

/* A [n] norm weight of dtype dt (values scale * uniform, BF16-rounded when BF16). */
static tensor make_norm_weight(dtype dt, int n, float scale) {
    tensor w = make_weight(dt, 1, n, scale, NULL);
    w.ndim = 1;
    w.shape[0] = n;
    return w;
}

/* The fused ops are defined as the unfused sequences they replace: the same bits, on random
 * inputs of several shapes (both sides of the OpenMP thresholds, odd sizes). */
static void test_fused(void) {
    printf("fused ops == their unfused sequences\n");
    const float eps = 1e-6f;
    static const struct {
        int T, D;
    } ar[] = {{1, 70}, {5, 128}, {3, 77}, {17, 2048}, {64, 2048}, {40, 4096}};
    const dtype dts[] = {DTYPE_BF16, DTYPE_F32};
    for (size_t c = 0; c < sizeof ar / sizeof ar[0]; c++)
        for (int di = 0; di < 2; di++) {
            const int T = ar[c].T, D = ar[c].D;
            const int64_t n = (int64_t)T * D;
            tensor w = make_norm_weight(dts[di], D, 1.5f);
            float *x = rand_floats(n, 3.0f), *o = rand_floats(n, 3.0f);
            float *x2 = xmalloc(sizeof(float) * n), *h = xmalloc(sizeof(float) * n);
            float *h2 = xmalloc(sizeof(float) * n);
            memcpy(x2, x, sizeof(float) * n);
            cpu->add_rmsnorm(x, h, o, &w, T, D, eps);
            cpu->add(x2, x2, o, n);
            cpu->rmsnorm(h2, x2, &w, T, D, eps);
            char what[80];
            snprintf(what, sizeof what, "add_rmsnorm x == add, %s T=%d D=%d", dtype_name(dts[di]),
                     T, D);
            compare_exact(what, x, x2, n);
            snprintf(what, sizeof what, "add_rmsnorm h == add + rmsnorm, %s T=%d D=%d",
                     dtype_name(dts[di]), T, D);
            compare_exact(what, h, h2, n);
            free(x);
            free(o);
            free(x2);
            free(h);
            free(h2);
            free(w.data);
        }

    static const struct {
        int T, H, Hkv, Dh;
        double theta;
    } qk[] = {{1, 4, 2, 64, 1e6}, {8, 4, 2, 128, 1e6}, {5, 3, 1, 6, 1e4}, {37, 32, 4, 128, 1e6}};
    for (size_t c = 0; c < sizeof qk / sizeof qk[0]; c++)
        for (int di = 0; di < 2; di++) {
            const int T = qk[c].T, H = qk[c].H, Hkv = qk[c].Hkv, Dh = qk[c].Dh;
            const int64_t nq = (int64_t)T * H * Dh, nk = (int64_t)T * Hkv * Dh;
            tensor qw = make_norm_weight(dts[di], Dh, 1.5f),
                   kw = make_norm_weight(dts[di], Dh, 1.5f);
            float *q = rand_floats(nq, 2.0f), *k = rand_floats(nk, 2.0f);
            float *q2 = xmalloc(sizeof(float) * nq), *k2 = xmalloc(sizeof(float) * nk);
            memcpy(q2, q, sizeof(float) * nq);
            memcpy(k2, k, sizeof(float) * nk);
            int32_t *pos = xmalloc(sizeof(int32_t) * T);
            for (int t = 0; t < T; t++)
                pos[t] = t == 0 ? 0 : rng_int(1 << 20);
            cpu->qk_norm_rope(q, k, &qw, &kw, pos, T, H, Hkv, Dh, qk[c].theta, eps);
            cpu->rmsnorm(q2, q2, &qw, T * H, Dh, eps);
            cpu->rmsnorm(k2, k2, &kw, T * Hkv, Dh, eps);
            cpu->rope(q2, k2, pos, T, H, Hkv, Dh, qk[c].theta);
            char what[80];
            snprintf(what, sizeof what, "qk_norm_rope q, %s T=%d H=%d Dh=%d", dtype_name(dts[di]),
                     T, H, Dh);
            compare_exact(what, q, q2, nq);
            snprintf(what, sizeof what, "qk_norm_rope k, %s T=%d Hkv=%d Dh=%d", dtype_name(dts[di]),
                     T, Hkv, Dh);
            compare_exact(what, k, k2, nk);
            free(q);
            free(k);
            free(q2);
            free(k2);
            free(pos);
            free(qw.data);
            free(kw.data);
        }
}

/* T = 0 everywhere: nothing is read or written. */
static void test_empty(void) {
    printf("T = 0\n");
    float sentinel[64];
    for (int i = 0; i < 64; i++)
        sentinel[i] = 12345.0f;
    float buf[64];
    memcpy(buf, sentinel, sizeof buf);
    int32_t ids[8] = {0};
    float *wv;
    tensor w = make_weight(DTYPE_BF16, 8, 8, 1.0f, &wv);
    tensor nw = {.dtype = DTYPE_F32, .ndim = 1, .shape = {8}, .data = wv};
    moe_experts me = {.E = 1, .gate = &w, .up = &w, .down = &w};
    int32_t pt[1] = {0};
    attn_batch b = {
        .T = 0, .pos = ids, .seq = ids, .page_table = pt, .max_pages = 1, .page_size = 4};
    kv_layer kv = {buf, buf, 0};

    cpu->embedding(buf, &w, ids, 0, 8);
    cpu->rmsnorm(buf, buf, &nw, 0, 8, 1e-6f);
    cpu->add_rmsnorm(buf, buf + 32, buf, &nw, 0, 8, 1e-6f);
    cpu->linear(buf, buf, &w, 0, 8, 8);
    cpu->rope(buf, buf, ids, 0, 2, 1, 8, 1e6);
    cpu->qk_norm_rope(buf, buf, &nw, &nw, ids, 0, 2, 1, 8, 1e6, 1e-6f);
    cpu->kv_store(kv, buf, buf, &b, 1, 8);
    cpu->attention(buf, buf, kv, &b, 2, 1, 8, 0.5f);
    cpu->router_topk(ids, buf, buf, 0, 8, 2, true);
    cpu->moe_experts(buf, buf, ids, &me, 0, 2, 8, 8);
    cpu->moe_finalize(buf, buf, buf, 0, 2, 8);
    cpu->silu_mul(buf, buf, buf, 0, 8);
    cpu->add(buf, buf, buf, 0);
    CHECK(memcmp(buf, sentinel, sizeof buf) == 0, "an op with T = 0 wrote its output");
    printf("  %-52s %s\n", "every op with T = 0",
           memcmp(buf, sentinel, sizeof buf) == 0 ? "nothing written" : "WROTE");
    free(w.data);
    free(wv);
}

/* A weight dtype the CPU kernels do not read is a broken invariant: the op aborts. Run in a
 * child process, its message sent to /dev/null. */
static void test_bad_dtype(void) {
    printf("unsupported weight dtype\n");
    fflush(stdout);
    fflush(stderr);
    const pid_t pid = fork();
    if (pid == 0) {
        if (!freopen("/dev/null", "w", stderr)) _exit(0);
        int32_t data[4] = {1, 2, 3, 4};
        tensor w = {.dtype = DTYPE_I32, .ndim = 2, .shape = {2, 2}, .data = data};
        float x[2] = {1.0f, 2.0f}, y[2];
        cpu->linear(y, x, &w, 1, 2, 2);
        _exit(0); /* not reached when the op asserts */
    }
    int status = 0;
    CHECK(pid > 0 && waitpid(pid, &status, 0) == pid, "fork/waitpid failed");
    const bool aborted = WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT;
    printf("  %-52s %s\n", "linear with I32 weights", aborted ? "aborted" : "DID NOT ABORT");
    CHECK(aborted, "linear with I32 weights did not abort (status %d)", status);
}

/* Under AddressSanitizer linear's inner loops are not instrumented (kernels/cpu/linear.c); an
 * operand shorter than its shape must still be reported, at the call. Elsewhere: nothing to do. */
#if defined(__SANITIZE_ADDRESS__)
#define TEST_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define TEST_ASAN 1
#endif
#endif
static void test_linear_extents(void) {
#ifdef TEST_ASAN
    printf("linear operands shorter than their shapes (AddressSanitizer build)\n");
    for (int which = 0; which < 3; which++) {
        static const char *names[] = {"x", "out", "w"};
        const int T = 3, N = 40, Kin = 64;
        fflush(stdout);
        fflush(stderr);
        int fds[2];
        CHECK(pipe(fds) == 0, "pipe");
        const pid_t pid = fork();
        if (pid == 0) {
            close(fds[0]);
            dup2(fds[1], 2);
            /* the short one lacks its last element */
            uint16_t *wd = xcalloc((size_t)N * Kin - (which == 2), sizeof(uint16_t));
            float *x = xcalloc((size_t)T * Kin - (which == 0), sizeof(float));
            float *out = xcalloc((size_t)T * N - (which == 1), sizeof(float));
            tensor w = {.dtype = DTYPE_BF16,
                        .ndim = 2,
                        .shape = {N, Kin},
                        .data = wd,
                        .device = DEVICE_CPU};
            cpu->linear(out, x, &w, T, N, Kin);
            _exit(0); /* not reached when the check reports */
        }
        close(fds[1]);
        char buf[4096];
        size_t got = 0;
        ssize_t r;
        while ((r = read(fds[0], buf + got, sizeof buf - 1 - got)) > 0 && got < sizeof buf - 1)
            got += (size_t)r;
        buf[got] = '\0';
        close(fds[0]);
        int status = 0;
        waitpid(pid, &status, 0);
        const bool told = !(WIFEXITED(status) && WEXITSTATUS(status) == 0) &&
                          strstr(buf, "heap-buffer-overflow") &&
                          strstr(buf, "linear_check_extents");
        printf("  %-52s %s\n", names[which], told ? "reported" : "NOT REPORTED");
        CHECK(told, "linear with a short %s: status %d, %.300s", names[which], status, buf);
    }
#endif
}

/* ---- benchmark (--bench) ---- */

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* linear at T = 1 with BF16 weights: "hot" repeats one matrix (L2/L3 resident when small),
 * "cold" cycles through matrices totalling 512 MiB so every call streams from DRAM. Best of 3.
 * Then a few batched sizes, and last a read of 1 GiB of fp32 with the same threads: the
 * bandwidth ceiling to compare the cold figures with. */
static void bench_linear(void) {
    printf("linear T=1, BF16 weights, %d threads\n", omp_get_max_threads());
    const int sizes[] = {1024, 2048, 3072, 4096};
    for (int si = 0; si < 4; si++) {
        const int N = sizes[si], Kin = sizes[si];
        const size_t bytes = (size_t)N * Kin * sizeof(uint16_t);
        int n_mat = (int)(((size_t)512 << 20) / bytes);
        if (n_mat < 2) n_mat = 2;
        tensor *w = xmalloc(sizeof(tensor) * n_mat);
        for (int m = 0; m < n_mat; m++)
            w[m] = make_weight(DTYPE_BF16, N, Kin, 0.03f, NULL);
        float *x = rand_floats(Kin, 1.0f), *y = xmalloc(sizeof(float) * N);
        for (int cold = 0; cold < 2; cold++) {
            const int reps = cold ? 2 * n_mat : 100;
            double best = 1e30;
            for (int r = 0; r < 3; r++) {
                const double t0 = now_s();
                for (int i = 0; i < reps; i++)
                    cpu->linear(y, x, &w[cold ? i % n_mat : 0], 1, N, Kin);
                const double dt = (now_s() - t0) / reps;
                if (dt < best) best = dt;
            }
            printf("  N=K=%-5d %-4s %8.1f us/call %6.1f GB/s\n", N, cold ? "cold" : "hot",
                   best * 1e6, bytes / best / 1e9);
        }
        for (int m = 0; m < n_mat; m++)
            free(w[m].data);
        free(w);
        free(x);
        free(y);
    }
    /* Batched calls (prefill, many decodes): compute rather than bandwidth. */
    for (int T = 4; T <= 64; T *= 4) {
        const int N = 2048, Kin = 2048;
        tensor w = make_weight(DTYPE_BF16, N, Kin, 0.03f, NULL);
        float *x = rand_floats((int64_t)T * Kin, 1.0f), *y = xmalloc(sizeof(float) * T * N);
        const int reps = 400 / T;
        double best = 1e30;
        for (int r = 0; r < 3; r++) {
            const double t0 = now_s();
            for (int i = 0; i < reps; i++)
                cpu->linear(y, x, &w, T, N, Kin);
            const double dt = (now_s() - t0) / reps;
            if (dt < best) best = dt;
        }
        printf("  T=%-3d N=K=%d    %8.1f us/call %6.1f GFLOP/s\n", T, N, best * 1e6,
               2.0 * T * N * Kin / best / 1e9);
        free(w.data);
        free(x);
        free(y);
    }
    const size_t n = (size_t)256 << 20;
    float *a = xmalloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++)
        a[i] = 1.0f;
    double best = 1e30;
    for (int r = 0; r < 3; r++) {
        const double t0 = now_s();
        float total = 0.0f;
#pragma omp parallel reduction(+ : total)
        {
            const size_t nth = omp_get_num_threads(), id = omp_get_thread_num();
            const float *p = a + n / nth * id;
            float acc[16] = {0};
            for (size_t i = 0; i + 16 <= n / nth; i += 16)
                for (int j = 0; j < 16; j++)
                    acc[j] += p[i + j];
            for (int j = 0; j < 16; j++)
                total += acc[j];
        }
        const double dt = now_s() - t0;
        if (dt < best) best = dt;
        if (total < 0) printf("?");
    }
    printf("  read baseline: 1 GiB fp32 summed, %6.1f GB/s\n", n * sizeof(float) / best / 1e9);
    free(a);
}

int main(int argc, char **argv) {
    cpu = ops_cpu();
    if (argc > 1 && strcmp(argv[1], "--bench") == 0) {
        bench_linear();
        return 0;
    }
    printf("CPU backend tests, %d OpenMP threads\n", omp_get_max_threads());
    test_embedding();
    test_rmsnorm();
    test_linear();
    test_rope();
    test_attention();
    test_router();
    test_moe();
    test_moe_skip();
    test_finalize_and_elementwise();
    test_fused();
    test_empty();
    test_bad_dtype();
    test_linear_extents();
    CHECK_SUMMARY();
}
