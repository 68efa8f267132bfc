/* The quantized test checkpoints (tests/data/tiny-qwen3-moe-fp8 and -nvfp4, written by
 * scripts/make_quant_checkpoints.py with numpy) against the C quantizers of kernels/cpu/quant.c
 * run on the BF16 checkpoint's weights: every code, scale and tensor scale byte for byte, so the
 * two independent implementations of the published formulas agree; and the modules the formats
 * leave in BF16 (router, embedding, lm_head, norms) are the BF16 checkpoint's. */
#include "config/safetensors.h"
#include "kernels/quant.h"

#include <stdlib.h>
#include <string.h>

#include "tests/check.h"

#define DATA "tests/data/"

static int quantized(const char *name) {
    size_t n = strlen(name);
    return n > 12 && strcmp(name + n - 12, "_proj.weight") == 0;
}

static const checkpoint_tensor *find(const checkpoint *ck, const char *base, const char *suffix) {
    char name[320];
    snprintf(name, sizeof name, "%.255s%.32s", base, suffix);
    return checkpoint_find(ck, name);
}

int main(void) {
    checkpoint bf, f8, f4;
    char err[512];
    int rc = checkpoint_open(&bf, DATA "tiny-qwen3-moe", err, sizeof err);
    CHECK(rc == 0, "open the BF16 checkpoint: %s", err);
    int rc8 = checkpoint_open(&f8, DATA "tiny-qwen3-moe-fp8", err, sizeof err);
    CHECK(rc8 == 0, "open the FP8 checkpoint: %s", err);
    int rc4 = checkpoint_open(&f4, DATA "tiny-qwen3-moe-nvfp4", err, sizeof err);
    CHECK(rc4 == 0, "open the NVFP4 checkpoint: %s", err);
    if (rc || rc8 || rc4) CHECK_SUMMARY();

    int n_quant = 0, bad8 = 0, bad4 = 0, bad_kept = 0;
    for (int i = 0; i < bf.n_tensors; i++) {
        const checkpoint_tensor *src = &bf.tensors[i];
        const char *name = src->name;
        const checkpoint_tensor *a = checkpoint_find(&f8, name), *b = checkpoint_find(&f4, name);
        if (!a || !b) {
            CHECK(0, "%s: missing from a quantized checkpoint", name);
            continue;
        }
        if (!quantized(name)) { /* kept: the same BF16 bytes */
            size_t nb = tensor_nbytes(&src->t);
            if (a->t.dtype != DTYPE_BF16 || b->t.dtype != DTYPE_BF16 ||
                memcmp(a->t.data, src->t.data, nb) || memcmp(b->t.data, src->t.data, nb))
                bad_kept++;
            continue;
        }
        n_quant++;
        const int N = (int)src->t.shape[0], K = (int)src->t.shape[1];
        float *w = malloc(sizeof(float) * N * K);
        for (int64_t j = 0; j < (int64_t)N * K; j++)
            w[j] = bf16_to_f32(((const uint16_t *)src->t.data)[j]);
        char base[256];
        snprintf(base, sizeof base, "%.*s", (int)(strlen(name) - 7), name); /* drop ".weight" */

        /* FP8 blocks */
        const int BN = (N + 127) / 128, BK = (K + 127) / 128;
        uint8_t *q = malloc((size_t)N * K);
        float *s = malloc(sizeof(float) * BN * BK);
        quant_fp8_blocks(q, s, w, N, K);
        const checkpoint_tensor *si = find(&f8, base, ".weight_scale_inv");
        if (a->t.dtype != DTYPE_F8_E4M3 || a->t.shape[0] != N || a->t.shape[1] != K || !si ||
            si->t.dtype != DTYPE_F32 || tensor_numel(&si->t) != BN * BK ||
            memcmp(a->t.data, q, (size_t)N * K) || memcmp(si->t.data, s, sizeof(float) * BN * BK)) {
            if (bad8++ < 3) fprintf(stderr, "fp8 %s differs\n", name);
        }

        /* NVFP4 */
        uint8_t *q4 = malloc((size_t)N * K / 2), *sf = malloc((size_t)N * K / 16);
        float s2 = quant_nvfp4(q4, sf, w, N, K, 0.0f);
        const checkpoint_tensor *ws = find(&f4, base, ".weight_scale");
        const checkpoint_tensor *w2 = find(&f4, base, ".weight_scale_2");
        const checkpoint_tensor *is = find(&f4, base, ".input_scale");
        if (b->t.dtype != DTYPE_U8 || b->t.shape[0] != N || b->t.shape[1] != K / 2 || !ws ||
            ws->t.dtype != DTYPE_F8_E4M3 || ws->t.shape[1] != K / 16 || !w2 || w2->t.ndim != 0 ||
            w2->t.dtype != DTYPE_F32 || !is || is->t.ndim != 0 ||
            memcmp(b->t.data, q4, (size_t)N * K / 2) || memcmp(ws->t.data, sf, (size_t)N * K / 16) ||
            memcmp(w2->t.data, &s2, 4)) {
            if (bad4++ < 3) fprintf(stderr, "nvfp4 %s differs\n", name);
        }
        free(w), free(q), free(s), free(q4), free(sf);
    }
    CHECK(n_quant == 4 * 4 + 3 * 8 * 3 + 3, "quantized linears: %d", n_quant);
    CHECK(bad8 == 0, "fp8: %d of %d tensors differ from quant_fp8_blocks", bad8, n_quant);
    CHECK(bad4 == 0, "nvfp4: %d of %d tensors differ from quant_nvfp4", bad4, n_quant);
    CHECK(bad_kept == 0, "%d tensors left in BF16 differ from the BF16 checkpoint", bad_kept);
    checkpoint_close(&bf);
    checkpoint_close(&f8);
    checkpoint_close(&f4);
    CHECK_SUMMARY();
}
