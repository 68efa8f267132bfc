/* Qwen3-MoE (Qwen3MoeForCausalLM), as transformers defines it:
 *   x = embed(ids)
 *   per layer: x += o_proj(attn(rope(qk_norm(q, k)), v)) of rmsnorm(x)
 *              x += moe(rmsnorm(x))   or a dense SwiGLU MLP on mlp_only / non-sparse layers
 *   logits = lm_head(rmsnorm(x))      (lm_head = embed_tokens when tied)
 * Only the rows that need logits go through the final norm and lm_head.
 *
 * Quantized experts (FP8, NVFP4): the experts' input x goes through their activation format
 * (model.h's expert_payload) before the experts read it, whatever the rank count. The round trip
 * is an op with a CPU reference (ops->moe_input_quant, a GPU kernel later) that the model calls
 * when it runs alone, and the all-to-all's payload when it has one: the dispatch quantizes each
 * token once on its home rank, sends the codes (fewer bytes), and decodes them where the experts
 * are, its own rank included. Both are a2a_payload_roundtrip token by token, so the experts see
 * the same bits on one rank or many. The router reads the unquantized x (it stays BF16 in both
 * formats' checkpoints). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "kernels/quant.h"
#include "runner/model.h"
#ifdef MOESERVE_CUDA
#include "kernels/cuda/a2a_cuda.h"
#endif

typedef struct {
    const tensor *input_norm;    /* [D] */
    const tensor *post_norm;     /* [D] */
    const tensor *q_proj;        /* [H*Dh, D] (NULL when qkv_proj is loaded instead) */
    const tensor *k_proj;        /* [Hkv*Dh, D] */
    const tensor *v_proj;        /* [Hkv*Dh, D] */
    const tensor *qkv_proj;      /* [(H + 2 Hkv)*Dh, D]: q, k, v stacked (GPU), or NULL */
    const tensor *o_proj;        /* [D, H*Dh] */
    const tensor *q_norm;        /* [Dh] */
    const tensor *k_norm;        /* [Dh] */
    bool is_moe;
    const tensor *router;        /* [E, D] (MoE) */
    tensor *expert_gate;         /* [E] tensors of [F, D] (MoE) */
    tensor *expert_up;           /* [E] tensors of [F, D] */
    tensor *expert_down;         /* [E] tensors of [D, F] */
    moe_experts experts;         /* this rank's experts as the moe_experts op takes them */
    const tensor *mlp_gate;      /* [F, D] (dense) */
    const tensor *mlp_up;        /* [F, D] */
    const tensor *mlp_down;      /* [D, F] */
} qwen3_moe_layer;

typedef struct {
    const tensor *embed;   /* [V, D] */
    const tensor *norm;    /* [D] */
    const tensor *lm_head; /* [V, D], = embed when tied */
    qwen3_moe_layer *layers; /* [L] */
} qwen3_moe_weights;

/* Activation buffers, grown to the largest T seen. */
typedef struct {
    int cap_T;
    float *x;       /* [T, D] residual stream */
    float *h;       /* [T, D] normed */
    float *q;       /* [T, H*Dh] */
    float *qkv;     /* [T, (H + 2 Hkv)*Dh] (the stacked projection) */
    float *k;       /* [T, Hkv*Dh] */
    float *v;       /* [T, Hkv*Dh] */
    float *att;     /* [T, H*Dh] */
    float *o;       /* [T, D] */
    float *router;  /* [T, E] */
    int32_t *topk_ids; /* [T, K] */
    float *topk_w;  /* [T, K] */
    float *expert_out; /* [T, K, D] */
    float *xq;         /* [T, D] the experts' input in their activation format (alone) */
    float *recv_out;   /* [n, K, D] expert outputs of the tokens the all-to-all brought */
    size_t cap_recv;   /* floats */
    float *gate;    /* [T, F] dense */
    float *up;      /* [T, F] */
} qwen3_moe_workspace;

static int weight2(model *m, const char *name, int64_t d0, int64_t d1, const tensor **out,
                   char *err, size_t errlen) {
    int64_t shape[2] = {d0, d1};
    return model_weight(m, name, 2, shape, out, err, errlen);
}

static int weight1(model *m, const char *name, int64_t d0, const tensor **out, char *err,
                   size_t errlen) {
    return model_weight(m, name, 1, &d0, out, err, errlen);
}

/* A backend that takes NVFP4 experts (CUDA) and a checkpoint whose routed experts of layer i are
 * all stored in NVFP4, or a BF16 one loaded with --quantization nvfp4 (quantized here, as the CPU
 * gets them: model_weight_nvfp4_into): this rank's experts go to the backend as their codes and
 * scales, which its GEMMs decode (W4A16), instead of the dequantized weights. 1 when done, 0 when not taken (the
 * caller prepares the dequantized weights as before), -1 with err. MOESERVE_W4A16=0 turns it off
 * (the experts then run in BF16 from the dequantized weights: more bytes, and each weight rounded
 * to BF16 once more; docs/benchmarks.md, issue 8). */
static int qwen3_moe_nvfp4_experts(model *m, int i, qwen3_moe_layer *l, char *err,
                                   size_t errlen) {
    const char *v = getenv("MOESERVE_W4A16");
    if ((v && strcmp(v, "0") == 0) || !m->ops->prepare_experts_nvfp4) return 0;
    const model_config *c = &m->cfg;
    const int E0 = m->expert_begin, El = m->expert_end - m->expert_begin;
    const int64_t D = c->hidden_size, F = c->moe_intermediate_size;
    if (El <= 0 || D % 64 || F % 64) return 0;
    const size_t mat = (size_t)F * D; /* elements of one gate, up or down matrix */
    uint8_t *guq = malloc((size_t)El * mat), *gus = malloc((size_t)El * mat / 8);
    uint8_t *dq = malloc((size_t)El * mat / 2), *ds = malloc((size_t)El * mat / 16);
    float *s2 = malloc((size_t)El * 3 * sizeof(float));
    int rc = 1;
    if (!guq || !gus || !dq || !ds || !s2) {
        set_err(err, errlen, "%s: layer %d: out of memory staging %d NVFP4 experts", m->dir, i, El);
        rc = -1;
    }
    static const char *const parts[3] = {"gate_proj", "up_proj", "down_proj"};
    char name[256];
    for (int e = 0; e < El && rc == 1; e++)
        for (int p = 0; p < 3 && rc == 1; p++) {
            snprintf(name, sizeof name, "model.layers.%d.mlp.experts.%d.%s.weight", i, E0 + e,
                     parts[p]);
            /* gate_up [El, 2F, D / 2]: expert e's gate rows, then its up rows; down [El, D, F / 2] */
            const size_t at = p == 2 ? (size_t)e : (size_t)2 * e + p;
            rc = model_weight_nvfp4_into(m, name, p == 2 ? D : F, p == 2 ? F : D,
                                         (p == 2 ? dq : guq) + at * mat / 2,
                                         (p == 2 ? ds : gus) + at * mat / 16, &s2[3 * e + p], err,
                                         errlen);
        }
    if (rc == 1 && m->ops->prepare_experts_nvfp4(&l->experts, guq, gus, dq, ds, s2, (int)D,
                                                 (int)F, err, errlen))
        rc = -1;
    free(guq);
    free(gus);
    free(dq);
    free(ds);
    free(s2);
    return rc;
}

/* The same for a checkpoint whose routed experts of layer i are all in block FP8 (or a BF16 one
 * with --quantization fp8), on a backend that takes FP8 experts: their codes and block scales (a
 * scale per weight row and 128-k block, quant_fp8_row_scales) go to the backend, whose GEMMs
 * decode the codes (W8A16) and scale each block's sums. MOESERVE_W8A16=0 turns it off (the experts then run in BF16 from the
 * dequantized weights, as with NVFP4's MOESERVE_W4A16=0). 1 when done, 0 when not taken, -1 with
 * err. */
static int qwen3_moe_fp8_experts(model *m, int i, qwen3_moe_layer *l, char *err, size_t errlen) {
    const char *v = getenv("MOESERVE_W8A16");
    if ((v && strcmp(v, "0") == 0) || !m->ops->prepare_experts_fp8) return 0;
    const model_config *c = &m->cfg;
    const int E0 = m->expert_begin, El = m->expert_end - m->expert_begin;
    const int64_t D = c->hidden_size, F = c->moe_intermediate_size;
    if (El <= 0 || D % 64 || F % 64) return 0;
    const int64_t nkd = (D + QUANT_FP8_BLOCK - 1) / QUANT_FP8_BLOCK,
                  nkf = (F + QUANT_FP8_BLOCK - 1) / QUANT_FP8_BLOCK;
    const size_t mat = (size_t)F * D; /* elements of one gate, up or down matrix */
    uint8_t *guq = malloc((size_t)El * 2 * mat), *dq = malloc((size_t)El * mat);
    float *gus = malloc((size_t)El * nkd * 2 * F * sizeof(float));
    float *ds = malloc((size_t)El * nkf * D * sizeof(float));
    float *s = malloc((size_t)(nkd * nkf) * sizeof(float)); /* one matrix's block scales */
    int rc = 1;
    if (!guq || !dq || !gus || !ds || !s) {
        set_err(err, errlen, "%s: layer %d: out of memory staging %d FP8 experts", m->dir, i, El);
        rc = -1;
    }
    static const char *const parts[3] = {"gate_proj", "up_proj", "down_proj"};
    char name[256];
    for (int e = 0; e < El && rc == 1; e++)
        for (int p = 0; p < 3 && rc == 1; p++) {
            snprintf(name, sizeof name, "model.layers.%d.mlp.experts.%d.%s.weight", i, E0 + e,
                     parts[p]);
            /* gate_up [El, 2F, D]: expert e's gate rows, then its up rows; down [El, D, F] */
            rc = model_weight_fp8_into(m, name, p == 2 ? D : F, p == 2 ? F : D,
                                       p == 2 ? dq + (size_t)e * mat
                                              : guq + (size_t)(2 * e + p) * mat,
                                       s, err, errlen);
            if (rc != 1) break;
            if (p == 2)
                quant_fp8_row_scales(ds + (size_t)e * nkf * D, D, s, (int)D, (int)F);
            else
                quant_fp8_row_scales(gus + (size_t)e * nkd * 2 * F + (size_t)p * F, 2 * F, s,
                                     (int)F, (int)D);
        }
    if (rc == 1 && m->ops->prepare_experts_fp8(&l->experts, guq, gus, dq, ds, (int)D, (int)F, err,
                                               errlen))
        rc = -1;
    free(guq);
    free(dq);
    free(gus);
    free(ds);
    free(s);
    return rc;
}

/* --load-format dummy --quantization fp8 on a backend that takes FP8 experts: layer i's experts
 * as random E4M3 codes of magnitude 0.5 to 1.875 (either sign) and one block scale a matrix that
 * gives the weights an RMS of about 1 / sqrt(in_features), as model_dummy_fill's BF16 ones have;
 * each expert from its own seed, so a rank holds the experts one process would. */
static int qwen3_moe_dummy_fp8(model *m, int i, qwen3_moe_layer *l, char *err, size_t errlen) {
    const model_config *c = &m->cfg;
    const int E0 = m->expert_begin, El = m->expert_end - m->expert_begin;
    const int64_t D = c->hidden_size, F = c->moe_intermediate_size;
    const int64_t nkd = (D + QUANT_FP8_BLOCK - 1) / QUANT_FP8_BLOCK,
                  nkf = (F + QUANT_FP8_BLOCK - 1) / QUANT_FP8_BLOCK;
    const size_t mat = (size_t)F * D, sgu = (size_t)nkd * 2 * F, sd = (size_t)nkf * D;
    uint8_t *guq = malloc((size_t)El * 2 * mat), *dq = malloc((size_t)El * mat);
    float *gus = malloc((size_t)El * sgu * sizeof(float));
    float *ds = malloc((size_t)El * sd * sizeof(float));
    int rc = 0;
    if (!guq || !dq || !gus || !ds) {
        set_err(err, errlen, "%s: layer %d: out of host memory for %d dummy FP8 experts", m->dir,
                i, El);
        rc = -1;
    }
    for (int e = 0; e < El && rc == 0; e++) {
        char name[96];
        snprintf(name, sizeof name, "model.layers.%d.mlp.experts.%d.fp8", i, E0 + e);
        uint64_t x = model_dummy_seed(name) | 1;
        model_dummy_fp8(&x, guq + (size_t)e * 2 * mat, 2 * mat);
        model_dummy_fp8(&x, dq + (size_t)e * mat, mat);
        for (size_t k = 0; k < sgu; k++)
            gus[(size_t)e * sgu + k] = model_dummy_fp8_scale(D);
        for (size_t k = 0; k < sd; k++)
            ds[(size_t)e * sd + k] = model_dummy_fp8_scale(F);
    }
    if (rc == 0 &&
        m->ops->prepare_experts_fp8(&l->experts, guq, gus, dq, ds, (int)D, (int)F, err, errlen))
        rc = -1;
    free(guq);
    free(dq);
    free(gus);
    free(ds);
    return rc;
}

/* --load-format dummy --quantization nvfp4 on a backend that takes NVFP4 experts: layer i's
 * experts as random codes (every nibble equally likely), E4M3 group scales from 0.5 to 1.875 and
 * tensor scales that give the weights an RMS of about 1 / sqrt(in_features), as model_dummy_fill's
 * BF16 ones have; each expert from its own seed, so a rank holds the experts one process would. */
static int qwen3_moe_dummy_nvfp4(model *m, int i, qwen3_moe_layer *l, char *err, size_t errlen) {
    const model_config *c = &m->cfg;
    const int E0 = m->expert_begin, El = m->expert_end - m->expert_begin;
    const int64_t D = c->hidden_size, F = c->moe_intermediate_size;
    const size_t q1 = (size_t)F * D / 2, s1 = (size_t)F * D / 16; /* one matrix's codes, scales */
    uint8_t *guq = malloc((size_t)El * 2 * q1), *dq = malloc((size_t)El * q1);
    uint8_t *gus = malloc((size_t)El * 2 * s1), *ds = malloc((size_t)El * s1);
    float *s2 = malloc((size_t)El * 3 * sizeof(float));
    int rc = 0;
    if (!guq || !dq || !gus || !ds || !s2) {
        set_err(err, errlen, "%s: layer %d: out of host memory for %d dummy NVFP4 experts", m->dir,
                i, El);
        rc = -1;
    }
    /* E[e2m1^2] over the 16 codes is 8.5625, E[sf^2] over E4M3 0x30..0x3F 1.34 */
    const float rms = sqrtf(8.5625f * 1.34f);
    for (int e = 0; e < El && rc == 0; e++) {
        char name[96];
        snprintf(name, sizeof name, "model.layers.%d.mlp.experts.%d.nvfp4", i, E0 + e);
        uint64_t x = model_dummy_seed(name) | 1;
        uint8_t *parts[4] = {guq + (size_t)e * 2 * q1, dq + (size_t)e * q1,
                             gus + (size_t)e * 2 * s1, ds + (size_t)e * s1};
        const size_t sizes[4] = {2 * q1, q1, 2 * s1, s1};
        for (int p = 0; p < 4; p++) /* codes any; scales E4M3 0x30..0x3F, 0.5 to 1.875 */
            model_dummy_bytes(&x, parts[p], sizes[p], p >= 2 ? 0x0F0F0F0F0F0F0F0Full : ~0ull,
                              p >= 2 ? 0x3030303030303030ull : 0);
        s2[3 * e] = s2[3 * e + 1] = 1.0f / (rms * sqrtf((float)D));
        s2[3 * e + 2] = 1.0f / (rms * sqrtf((float)F));
    }
    if (rc == 0 && m->ops->prepare_experts_nvfp4(&l->experts, guq, gus, dq, ds, s2, (int)D, (int)F,
                                                 err, errlen))
        rc = -1;
    free(guq);
    free(dq);
    free(gus);
    free(ds);
    free(s2);
    return rc;
}

/* This rank's per-expert views of layer l as shapes alone (gate, up [F, D], down [D, F]), for a
 * backend that reads its own stacked copies (moe_experts), no data of their own. */
static void expert_shape_views(const model *m, qwen3_moe_layer *l, int El, int64_t D, int64_t F) {
    tensor *dst[3] = {l->expert_gate, l->expert_up, l->expert_down};
    for (int e = 0; e < El; e++)
        for (int p = 0; p < 3; p++)
            dst[p][e] = (tensor){.dtype = DTYPE_BF16, .ndim = 2, .device = m->ops->device,
                                 .shape = {p == 2 ? D : F, p == 2 ? F : D}};
}

/* Dummy experts of layer i (no checkpoint). The CPU gets every expert tensor as model_weight
 * makes it. A backend with its own memory gets its stacked copies (moe_experts) filled in place,
 * with the same values the per-expert tensors would hold, so no expert exists twice. */
static int qwen3_moe_dummy_experts(model *m, int i, qwen3_moe_layer *l, char *err,
                                   size_t errlen) {
    const model_config *c = &m->cfg;
    int E0 = m->expert_begin, El = m->expert_end - m->expert_begin;
    int64_t D = c->hidden_size, F = c->moe_intermediate_size;
    int64_t fd[2] = {F, D}, df[2] = {D, F};
    char name[256];
    static const char *const parts[3] = {"gate_proj", "up_proj", "down_proj"};
    tensor *dst[3] = {l->expert_gate, l->expert_up, l->expert_down};
    l->experts = (moe_experts){
        .E = El, .gate = l->expert_gate, .up = l->expert_up, .down = l->expert_down};
    if (m->ops->device == DEVICE_CPU) {
        for (int e = 0; e < El; e++)
            for (int p = 0; p < 3; p++) {
                const tensor *t;
                snprintf(name, sizeof name, "model.layers.%d.mlp.experts.%d.%s.weight", i, E0 + e,
                         parts[p]);
                if (model_weight(m, name, 2, p == 2 ? df : fd, &t, err, errlen)) return -1;
                dst[p][e] = *t;
            }
        return 0;
    }
    if ((m->online_quant == MODEL_QUANT_NVFP4 && m->ops->prepare_experts_nvfp4) ||
        (m->online_quant == MODEL_QUANT_FP8 && m->ops->prepare_experts_fp8)) {
        expert_shape_views(m, l, El, D, F);
        return m->online_quant == MODEL_QUANT_FP8 ? qwen3_moe_dummy_fp8(m, i, l, err, errlen)
                                                  : qwen3_moe_dummy_nvfp4(m, i, l, err, errlen);
    }
    size_t half = (size_t)F * D; /* elements of one gate, up or down matrix */
    uint16_t *gate_up = m->ops->dev_alloc((size_t)El * 2 * half * sizeof(uint16_t));
    uint16_t *down = m->ops->dev_alloc((size_t)El * half * sizeof(uint16_t));
    l->experts.gate_up = gate_up;
    l->experts.down_all = down;
    l->experts.wdtype = DTYPE_BF16;
    if (!gate_up || !down)
        return set_err(err, errlen, "%s: layer %d: out of %s memory for %d dummy experts", m->dir,
                       i, m->ops->name, El);
    for (int e = 0; e < El; e++)
        for (int p = 0; p < 3; p++) {
            snprintf(name, sizeof name, "model.layers.%d.mlp.experts.%d.%s.weight", i, E0 + e,
                     parts[p]);
            uint16_t *at = p == 2 ? down + (size_t)e * half : gate_up + ((size_t)2 * e + p) * half;
            model_dummy_fill(m, at, name, (int64_t)half, 2, p == 2 ? F : D);
        }
    expert_shape_views(m, l, El, D, F);
    return 0;
}

static int qwen3_moe_load_layer(model *m, int i, qwen3_moe_layer *l, char *err, size_t errlen) {
    const model_config *c = &m->cfg;
    int64_t D = c->hidden_size, H = c->num_attention_heads, Hkv = c->num_key_value_heads;
    int64_t Dh = c->head_dim;
    char name[256];
#define W1(field, suffix, d0)                                                                      \
    snprintf(name, sizeof name, "model.layers.%d.%s", i, suffix);                                 \
    if (weight1(m, name, d0, &l->field, err, errlen)) return -1
#define W2(field, suffix, d0, d1)                                                                  \
    snprintf(name, sizeof name, "model.layers.%d.%s", i, suffix);                                 \
    if (weight2(m, name, d0, d1, &l->field, err, errlen)) return -1
    W1(input_norm, "input_layernorm.weight", D);
    W1(post_norm, "post_attention_layernorm.weight", D);
    W2(o_proj, "self_attn.o_proj.weight", D, H * Dh);
    W1(q_norm, "self_attn.q_norm.weight", Dh);
    W1(k_norm, "self_attn.k_norm.weight", Dh);
    /* A backend with its own memory runs q, k and v as one linear followed by one qkv_prepare
     * (three weight reads in one launch, and the split, the norms, RoPE and the cache store in
     * another); the CPU keeps them apart, reading the checkpoint in place. */
    if (m->ops->device != DEVICE_CPU && l->q_norm->dtype == l->k_norm->dtype) {
        char qn[256], kn[256], vn[256];
        snprintf(qn, sizeof qn, "model.layers.%d.self_attn.q_proj.weight", i);
        snprintf(kn, sizeof kn, "model.layers.%d.self_attn.k_proj.weight", i);
        snprintf(vn, sizeof vn, "model.layers.%d.self_attn.v_proj.weight", i);
        const char *const names[3] = {qn, kn, vn};
        const int64_t rows[3] = {H * Dh, Hkv * Dh, Hkv * Dh};
        if (model_weight_rows(m, 3, names, rows, D, &l->qkv_proj, err, errlen)) return -1;
    } else {
        W2(q_proj, "self_attn.q_proj.weight", H * Dh, D);
        W2(k_proj, "self_attn.k_proj.weight", Hkv * Dh, D);
        W2(v_proj, "self_attn.v_proj.weight", Hkv * Dh, D);
    }
    l->is_moe = c->layer_is_moe[i];
    if (!l->is_moe) {
        int64_t F = c->intermediate_size;
        W2(mlp_gate, "mlp.gate_proj.weight", F, D);
        W2(mlp_up, "mlp.up_proj.weight", F, D);
        W2(mlp_down, "mlp.down_proj.weight", D, F);
        return 0;
    }
    int E = c->num_experts, E0 = m->expert_begin, El = m->expert_end - m->expert_begin;
    int64_t F = c->moe_intermediate_size;
    W2(router, "mlp.gate.weight", E, D);
    /* Every expert's tensors are checked (headers, and a quantized one's scale tensors), so a
     * bad checkpoint fails on every rank alike; only this rank's range is kept, indexed from 0. */
    l->expert_gate = xcalloc(El > 0 ? El : 1, sizeof(tensor));
    l->expert_up = xcalloc(El > 0 ? El : 1, sizeof(tensor));
    l->expert_down = xcalloc(El > 0 ? El : 1, sizeof(tensor));
    if (m->dummy) return qwen3_moe_dummy_experts(m, i, l, err, errlen);
    static const char *const parts[3] = {"gate_proj", "up_proj", "down_proj"};
    const int64_t fd[2] = {F, D}, df[2] = {D, F};
    for (int e = 0; e < E; e++)
        for (int p = 0; p < 3; p++) {
            snprintf(name, sizeof name, "model.layers.%d.mlp.experts.%d.%s.weight", i, e,
                     parts[p]);
            if (model_weight_check(m, name, 2, p == 2 ? df : fd, err, errlen)) return -1;
        }
    /* The backend's copies of the experts: quantized ones as their codes where it takes them
     * (CUDA, W4A16 / W8A16: nothing dequantized on the host, the views below shapes alone), else
     * from the views (CUDA: stacked on the device in BF16; the CPU reads them in place: the
     * checkpoint's, or the F32 weights a quantized tensor stands for). */
    l->experts = (moe_experts){
        .E = El, .gate = l->expert_gate, .up = l->expert_up, .down = l->expert_down};
    int wq = qwen3_moe_nvfp4_experts(m, i, l, err, errlen);
    if (wq == 0) wq = qwen3_moe_fp8_experts(m, i, l, err, errlen);
    if (wq < 0) return -1;
    if (wq) {
        expert_shape_views(m, l, El, D, F);
        return 0;
    }
    tensor *dst[3] = {l->expert_gate, l->expert_up, l->expert_down};
    for (int e = 0; e < El; e++)
        for (int p = 0; p < 3; p++) {
            const tensor *t;
            snprintf(name, sizeof name, "model.layers.%d.mlp.experts.%d.%s.weight", i, E0 + e,
                     parts[p]);
            if (model_weight_info(m, name, 2, p == 2 ? df : fd, &t, err, errlen)) return -1;
            dst[p][e] = *t;
        }
    char why[512];
    if (El > 0 && m->ops->prepare_experts(&l->experts, why, sizeof why))
        return set_err(err, errlen, "%s: layer %d experts: %s", m->dir, i, why);
#undef W1
#undef W2
    return 0;
}

static int qwen3_moe_load(model *m, char *err, size_t errlen) {
    const model_config *c = &m->cfg;
    qwen3_moe_weights *w = xcalloc(1, sizeof *w);
    m->weights = w;
    m->workspace = xcalloc(1, sizeof(qwen3_moe_workspace));
    if (weight2(m, "model.embed_tokens.weight", c->vocab_size, c->hidden_size, &w->embed, err,
                errlen))
        return -1;
    if (weight1(m, "model.norm.weight", c->hidden_size, &w->norm, err, errlen)) return -1;
    if (c->tie_word_embeddings) {
        w->lm_head = w->embed;
    } else if (weight2(m, "lm_head.weight", c->vocab_size, c->hidden_size, &w->lm_head, err,
                       errlen)) {
        return -1;
    }
    w->layers = xcalloc(c->num_hidden_layers, sizeof(qwen3_moe_layer));
    for (int i = 0; i < c->num_hidden_layers; i++)
        if (qwen3_moe_load_layer(m, i, &w->layers[i], err, errlen)) return -1;
    for (int i = 0; i < c->num_hidden_layers; i++) { /* what the routed experts run as */
        const moe_experts *x = &w->layers[i].experts;
        if (!w->layers[i].is_moe || x->E <= 0) continue;
        if (x->wformat != MOE_W_PLAIN)
            LOG_INFO("model",
                     "routed experts: %s codes on the %s, decoded in the GEMMs (%s); "
                     "their input as %s",
                     x->wformat == MOE_W_FP8 ? "FP8" : "NVFP4", m->ops->name,
                     x->wformat == MOE_W_FP8           ? "W8A16"
                     : x->wformat == MOE_W_NVFP4_SM100 ? "W4A4, Blackwell's block-scaled MMA"
                                                       : "W4A16",
                     a2a_payload_name((a2a_payload)m->expert_payload));
        break;
    }
    return 0;
}

/* A buffer of the backend's device, grown to bytes (contents not kept). */
static void *ws_grow(model *m, void *p, size_t bytes) {
    m->ws_epoch++; /* graphs captured with the old buffers are stale */
    if (p) m->ops->dev_free(p);
    void *q = m->ops->dev_alloc(bytes ? bytes : 1);
    if (!q) {
        fprintf(stderr, "%s: out of %s memory for %zu bytes of activations\n", m->dir,
                m->ops->name, bytes);
        exit(1);
    }
    return q;
}

static void qwen3_moe_workspace_reserve(model *m, qwen3_moe_workspace *ws, int T) {
    const model_config *c = &m->cfg;
    if (T <= ws->cap_T) return;
    size_t D = c->hidden_size, QD = (size_t)c->num_attention_heads * c->head_dim;
    size_t KVD = (size_t)c->num_key_value_heads * c->head_dim;
    size_t E = c->num_experts, K = c->num_experts_per_tok;
    size_t F = c->intermediate_size > 0 ? c->intermediate_size : 1;
    ws->x = ws_grow(m, ws->x, T * D * sizeof(float));
    ws->h = ws_grow(m, ws->h, T * D * sizeof(float));
    ws->q = ws_grow(m, ws->q, T * QD * sizeof(float));
    ws->qkv = ws_grow(m, ws->qkv, T * (QD + 2 * KVD) * sizeof(float));
    ws->k = ws_grow(m, ws->k, T * KVD * sizeof(float));
    ws->v = ws_grow(m, ws->v, T * KVD * sizeof(float));
    ws->att = ws_grow(m, ws->att, T * QD * sizeof(float));
    ws->o = ws_grow(m, ws->o, T * D * sizeof(float));
    ws->router = ws_grow(m, ws->router, T * (E ? E : 1) * sizeof(float));
    ws->topk_ids = ws_grow(m, ws->topk_ids, T * (K ? K : 1) * sizeof(int32_t));
    ws->topk_w = ws_grow(m, ws->topk_w, T * (K ? K : 1) * sizeof(float));
    ws->expert_out = ws_grow(m, ws->expert_out, T * (K ? K : 1) * D * sizeof(float));
    ws->xq = ws_grow(m, ws->xq, T * D * sizeof(float));
    ws->gate = ws_grow(m, ws->gate, T * F * sizeof(float));
    ws->up = ws_grow(m, ws->up, T * F * sizeof(float));
    ws->cap_T = T;
}

/* ws->recv_out for the K slot outputs of D channels of n received tokens. */
static void recv_out_reserve(model *m, qwen3_moe_workspace *ws, size_t n) {
    size_t need = n * m->cfg.num_experts_per_tok * m->cfg.hidden_size;
    if (need > ws->cap_recv) {
        ws->recv_out = ws_grow(m, ws->recv_out, need * sizeof(float));
        ws->cap_recv = need;
    }
}

/* Whether moe_block leaves the experts' weighted sum ([T, D]) rather than their slots. */
static bool moe_partial(const model *m) { return m->a2a_partial && (m->a2a || m->a2a_gpu); }

/* The routed experts of layer l for T tokens in ws->h -> ws->expert_out [T, K, D] and ws->topk_w
 * (the caller finalizes them, fused with what follows). Alone: every expert is here.
 * With the all-to-all: each token goes to the ranks owning its experts, this rank runs its own
 * experts on what it received (from every rank, itself included), the outputs come home slot by
 * slot and are summed in slot order, so the sum is the one a single process computes. With its
 * partial combine (moe_partial) ws->expert_out is [T, D] instead: the owners' BF16 partial sums
 * added in rank order, the weights already applied. */
static int moe_block(model *m, const qwen3_moe_layer *l, qwen3_moe_workspace *ws, int T,
                     int runtime_max) {
    const model_config *c = &m->cfg;
    const ops *op = m->ops;
    int D = c->hidden_size, E = c->num_experts, K = c->num_experts_per_tok;
    int F = c->moe_intermediate_size;
    if (T > 0) {
        op->linear(ws->router, ws->h, l->router, T, E, D);
        op->router_topk(ws->topk_ids, ws->topk_w, ws->router, T, E, K, c->norm_topk_prob);
    }
#ifdef MOESERVE_CUDA
    if (m->a2a_gpu) { /* the same on the GPU, nothing read back: the received count stays there */
        void *s = op->native_stream();
        if (a2a_gpu_dispatch(m->a2a_gpu, ws->h, ws->topk_ids, ws->topk_w, T, runtime_max, s,
                             m->err, sizeof m->err))
            return -1;
        a2a_gpu_received rv = a2a_gpu_get_received(m->a2a_gpu);
        recv_out_reserve(m, ws, (size_t)rv.n_max);
        op->moe_experts_n(ws->recv_out, rv.x, rv.ids, rv.n, &l->experts, rv.n_max, K, D, F);
        if (m->a2a_partial)
            return a2a_gpu_combine_partial(m->a2a_gpu, ws->recv_out, ws->expert_out, s, m->err,
                                           sizeof m->err);
        return a2a_gpu_combine(m->a2a_gpu, ws->recv_out, ws->expert_out, s, m->err,
                               sizeof m->err);
    }
#endif
    if (!m->a2a) {
        const float *x = ws->h;
        if (m->expert_payload != A2A_PAYLOAD_F32 && op->moe_experts_q) { /* the two in one */
            op->moe_experts_q(ws->expert_out, ws->xq, ws->h, ws->topk_ids, &l->experts, T, K, D, F,
                              m->expert_payload);
            return 0;
        }
        if (m->expert_payload != A2A_PAYLOAD_F32) { /* what the dispatch would do to them */
            op->moe_input_quant(ws->xq, ws->h, T, D, m->expert_payload);
            x = ws->xq;
        }
        op->moe_experts(ws->expert_out, x, ws->topk_ids, &l->experts, T, K, D, F);
    } else {
        const a2a_payload p = a2a_get_config(m->a2a)->payload;
        if ((int)p != m->expert_payload) {
            snprintf(m->err, sizeof m->err,
                     "the all-to-all sends %s tokens but the experts read %s: create it with "
                     "the model's expert_payload",
                     a2a_payload_name(p), a2a_payload_name((a2a_payload)m->expert_payload));
            return -1;
        }
        if (a2a_dispatch(m->a2a, ws->h, ws->topk_ids, ws->topk_w, T, runtime_max, m->err,
                         sizeof m->err))
            return -1;
        a2a_received rv = a2a_get_received(m->a2a);
        recv_out_reserve(m, ws, (size_t)rv.n);
        op->moe_experts(ws->recv_out, rv.x, rv.ids, &l->experts, rv.n, K, D, F);
        if (m->a2a_partial
                ? a2a_combine_partial(m->a2a, ws->recv_out, ws->topk_w, ws->expert_out, m->err,
                                      sizeof m->err)
                : a2a_combine(m->a2a, ws->recv_out, ws->expert_out, m->err, sizeof m->err))
            return -1;
    }
    return 0;
}

/* A rank with no tokens this step: only the all-to-alls of the MoE layers, in layer order. The
 * forwards end with model_step_check: what the GPU all-to-all's kernels recorded. */
static int qwen3_moe_forward_empty(model *m, const forward_batch *b) {
    const qwen3_moe_weights *w = m->weights;
    qwen3_moe_workspace *ws = m->workspace;
    for (int i = 0; i < m->cfg.num_hidden_layers; i++)
        if (w->layers[i].is_moe && moe_block(m, &w->layers[i], ws, 0, b->runtime_max)) return -1;
    return model_step_check(m);
}

static int qwen3_moe_forward(model *m, kv_cache *kv, const forward_batch *b, float *logits) {
    const model_config *c = &m->cfg;
    const ops *op = m->ops;
    const qwen3_moe_weights *w = m->weights;
    qwen3_moe_workspace *ws = m->workspace;
    int T = b->T, D = c->hidden_size, H = c->num_attention_heads, Hkv = c->num_key_value_heads;
    int Dh = c->head_dim;
    float eps = c->rms_norm_eps, scale = 1.0f / sqrtf((float)Dh);
    if (T == 0) return m->a2a || m->a2a_gpu ? qwen3_moe_forward_empty(m, b) : 0;
    qwen3_moe_workspace_reserve(m, ws, T > b->n_logits ? T : b->n_logits);

    /* Each residual add is fused with the norm that reads its result (add_rmsnorm): after
     * attention with the post-attention norm, after the MLP with the next layer's input norm (after
     * a MoE block the experts' finalize joins them: moe_finalize_add_rmsnorm). Only layer 0's
     * input norm (after the embedding) and the last layer's add (before the final norm of the
     * sampled rows) stand alone. */
    const int L = c->num_hidden_layers;
    op->embedding(ws->x, w->embed, b->ids, T, D);
    if (L > 0) op->rmsnorm(ws->h, ws->x, w->layers[0].input_norm, T, D, eps);
    for (int i = 0; i < L; i++) {
        const qwen3_moe_layer *l = &w->layers[i];
        kv_layer kvl = kv_cache_layer(kv, i);
        /* attention block; ws->h holds rmsnorm(x) with this layer's input norm */
        if (l->qkv_proj) {
            op->linear(ws->qkv, ws->h, l->qkv_proj, T, (H + 2 * Hkv) * Dh, D);
            op->qkv_prepare(ws->q, kvl, ws->qkv, l->q_norm, l->k_norm, &b->attn, H, Hkv, Dh,
                            c->rope_theta, eps);
        } else {
            op->linear(ws->q, ws->h, l->q_proj, T, H * Dh, D);
            op->linear(ws->k, ws->h, l->k_proj, T, Hkv * Dh, D);
            op->linear(ws->v, ws->h, l->v_proj, T, Hkv * Dh, D);
            op->qk_norm_rope(ws->q, ws->k, l->q_norm, l->k_norm, b->attn.pos, T, H, Hkv, Dh,
                             c->rope_theta, eps);
            op->kv_store(kvl, ws->k, ws->v, &b->attn, Hkv, Dh);
        }
        op->attention(ws->att, ws->q, kvl, &b->attn, H, Hkv, Dh, scale);
        op->linear(ws->o, ws->att, l->o_proj, T, D, H * Dh);
        /* MLP block */
        op->add_rmsnorm(ws->x, ws->h, ws->o, l->post_norm, T, D, eps);
        const float *mlp_out = ws->o;
        if (l->is_moe) {
            if (moe_block(m, l, ws, T, b->runtime_max)) return -1;
            int K = c->num_experts_per_tok;
            if (moe_partial(m)) { /* summed already: only the residual add and the norm below */
                mlp_out = ws->expert_out;
            } else if (i + 1 < L) { /* the finalize, the residual add and the next input norm */
                op->moe_finalize_add_rmsnorm(ws->x, ws->h, ws->expert_out, ws->topk_w,
                                             w->layers[i + 1].input_norm, T, K, D, eps);
                continue;
            } else {
                op->moe_finalize(ws->o, ws->expert_out, ws->topk_w, T, K, D);
            }
        } else {
            int F = c->intermediate_size;
            op->linear(ws->gate, ws->h, l->mlp_gate, T, F, D);
            op->linear(ws->up, ws->h, l->mlp_up, T, F, D);
            op->silu_mul(ws->gate, ws->gate, ws->up, T, F);
            op->linear(ws->o, ws->gate, l->mlp_down, T, D, F);
        }
        if (i + 1 < L)
            op->add_rmsnorm(ws->x, ws->h, mlp_out, w->layers[i + 1].input_norm, T, D, eps);
        else
            op->add(ws->x, ws->x, mlp_out, (int64_t)T * D);
    }
    if (b->n_logits == 0) return model_step_check(m);
    /* Only the rows that sample or score go through the final norm and lm_head. */
    op->gather_rows(ws->h, ws->x, b->logit_rows, b->n_logits, D);
    op->rmsnorm(ws->h, ws->h, w->norm, b->n_logits, D, eps);
    op->linear(logits, ws->h, w->lm_head, b->n_logits, c->vocab_size, D);
    return model_step_check(m);
}

static void qwen3_moe_free(model *m) {
    qwen3_moe_weights *w = m->weights;
    if (w) {
        for (int i = 0; w->layers && i < m->cfg.num_hidden_layers; i++) {
            qwen3_moe_layer *l = &w->layers[i];
            if (l->experts.gate_up) m->ops->dev_free(l->experts.gate_up);
            if (l->experts.down_all) m->ops->dev_free(l->experts.down_all);
            if (l->experts.gate_up_sf) m->ops->dev_free(l->experts.gate_up_sf);
            if (l->experts.down_sf) m->ops->dev_free(l->experts.down_sf);
            if (l->experts.s2) m->ops->dev_free(l->experts.s2);
            free(l->expert_gate);
            free(l->expert_up);
            free(l->expert_down);
        }
        free(w->layers);
        free(w);
    }
    qwen3_moe_workspace *ws = m->workspace;
    if (ws) {
        void *bufs[] = {ws->x,          ws->h,        ws->q,    ws->k,      ws->v,   ws->qkv,
                        ws->att,        ws->o,        ws->router, ws->topk_w, ws->expert_out,
                        ws->gate,       ws->up,       ws->topk_ids, ws->recv_out, ws->xq};
        for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
            if (bufs[i]) m->ops->dev_free(bufs[i]);
        free(ws);
    }
    m->weights = m->workspace = NULL;
}

const model_arch qwen3_moe_arch = {
    .model_type = "qwen3_moe",
    .load = qwen3_moe_load,
    .forward = qwen3_moe_forward,
    .free = qwen3_moe_free,
};
