/* Model loading: config, checkpoint, then the architecture named by model_type. */
#include "runner/model.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "kernels/quant.h"
#ifdef MOESERVE_CUDA
#include "kernels/cuda/a2a_cuda.h"
#endif

static const model_arch *const model_archs[] = {&qwen3_moe_arch};

model *model_load(const char *dir, const ops *ops, char *err, size_t errlen) {
    return model_load_ep(dir, ops, 0, 1, err, errlen);
}

model *model_load_ep(const char *dir, const ops *ops, int ep_rank, int ep_size, char *err,
                     size_t errlen) {
    model_load_opts o = {.ep_rank = ep_rank, .ep_size = ep_size};
    return model_load_with(dir, ops, &o, err, errlen);
}

model *model_load_with(const char *dir, const ops *ops, const model_load_opts *o, char *err,
                       size_t errlen) {
    int ep_rank = o->ep_rank, ep_size = o->ep_size;
    model *m = xcalloc(1, sizeof *m);
    m->dummy = o->dummy;
    m->dir = xstrdup(dir);
    m->ops = ops;
    if (model_config_load(&m->cfg, dir, err, errlen) != 0) goto fail;
    if (ep_size < 1 || ep_size > A2A_MAX_RANKS || ep_rank < 0 || ep_rank >= ep_size) {
        set_err(err, errlen, "expert parallelism: rank %d of %d is not a valid rank", ep_rank,
                ep_size);
        goto fail;
    }
    if (m->cfg.num_experts > 0 && m->cfg.num_experts < ep_size) {
        set_err(err, errlen,
                "%s/config.json: num_experts %d is below the %d ranks of the group: every rank "
                "must own at least one expert (use at most %d ranks)",
                dir, m->cfg.num_experts, ep_size, m->cfg.num_experts);
        goto fail;
    }
    m->ep_rank = ep_rank;
    m->ep_size = ep_size;
    int begin[A2A_MAX_RANKS + 1];
    a2a_split_experts(m->cfg.num_experts, ep_size, begin);
    m->expert_begin = begin[ep_rank];
    m->expert_end = begin[ep_rank + 1];
    for (size_t i = 0; i < sizeof model_archs / sizeof model_archs[0]; i++)
        if (strcmp(model_archs[i]->model_type, m->cfg.model_type) == 0) m->arch = model_archs[i];
    if (!m->arch) {
        set_err(err, errlen, "%s/config.json: model_type '%s' has no model definition", dir,
                m->cfg.model_type);
        goto fail;
    }
    if (o->quantization && o->quantization[0]) {
        const char *q = o->quantization;
        int want = !strcmp(q, "fp8")                                   ? MODEL_QUANT_FP8
                   : !strcmp(q, "modelopt_fp4") || !strcmp(q, "nvfp4") ? MODEL_QUANT_NVFP4
                                                                        : -1;
        if (want < 0) {
            set_err(err, errlen, "--quantization '%s': fp8, modelopt_fp4 (nvfp4) are known", q);
            goto fail;
        }
        if (m->cfg.quant != MODEL_QUANT_NONE && m->cfg.quant != want) {
            set_err(err, errlen, "--quantization %s: %s/config.json describes a checkpoint in %s",
                    q, dir, m->cfg.quant == MODEL_QUANT_FP8 ? "block FP8" : "NVFP4");
            goto fail;
        }
        const bool dummy_ok = want == MODEL_QUANT_NVFP4 ? ops->prepare_experts_nvfp4 != NULL
                                                        : ops->prepare_experts_fp8 != NULL;
        if (m->dummy && !dummy_ok) {
            set_err(err, errlen,
                    "--quantization %s with --load-format dummy: only nvfp4 (routed experts) "
                    "and fp8 (routed experts and projections) on a GPU are supported",
                    q);
            goto fail;
        }
        if (m->cfg.quant == MODEL_QUANT_NONE) m->online_quant = want;
        m->online_quant_experts_only = o->quantize_experts_only;
    }
    /* The experts' activation format follows their weights' format (model.h). */
    const int quant = m->online_quant != MODEL_QUANT_NONE ? m->online_quant : m->cfg.quant;
    m->expert_payload = !ops->moe_input_quant       ? A2A_PAYLOAD_F32
                        : quant == MODEL_QUANT_FP8   ? A2A_PAYLOAD_FP8
                        : quant == MODEL_QUANT_NVFP4 ? A2A_PAYLOAD_NVFP4
                                                     : A2A_PAYLOAD_F32;
    /* MOESERVE_EXPERT_ACT_QUANT=0: the experts read their input unrounded (the W8A16 / W4A16
     * kernels' BF16 activations, the format's weights alone): every rank of a run must agree */
    const char *aq = getenv("MOESERVE_EXPERT_ACT_QUANT");
    if (aq && strcmp(aq, "0") == 0) m->expert_payload = A2A_PAYLOAD_F32;
    if (m->expert_payload == A2A_PAYLOAD_NVFP4 && m->cfg.hidden_size % QUANT_FP4_GROUP != 0) {
        set_err(err, errlen, "%s/config.json: hidden_size %d: NVFP4 experts need a multiple of %d",
                dir, m->cfg.hidden_size, QUANT_FP4_GROUP);
        goto fail;
    }
    if (!m->dummy && checkpoint_open(&m->ckpt, dir, err, errlen) != 0) goto fail;
    if (m->arch->load(m, err, errlen) != 0) goto fail;
    return m;
fail:
    model_free(m);
    return NULL;
}

/* A weight the model handed out: the checkpoint's view, its data moved to the device by
 * ops->upload where the backend has one. */
struct model_tensor {
    struct model_tensor *next;
    tensor t;
    bool host_owned; /* t.data is a host buffer of the model's own (a dequantized weight) */
};

void model_free(model *m) {
    if (!m) return;
    if (m->arch && m->arch->free) m->arch->free(m);
    for (struct model_tensor *mt = m->tensors, *nx; mt; mt = nx) {
        nx = mt->next;
        if (mt->host_owned)
            free(mt->t.data);
        else if ((mt->t.device != DEVICE_CPU || m->dummy) && mt->t.data)
            m->ops->dev_free(mt->t.data);
        free(mt);
    }
    checkpoint_close(&m->ckpt);
    free(m->dir);
    free(m);
}

const char *model_config_diff(const model_config *a, const model_config *b) {
#define DIFF(f)                                                                                    \
    if (memcmp(&a->f, &b->f, sizeof a->f) != 0) return #f
    if (strcmp(a->model_type, b->model_type) != 0) return "model_type";
    DIFF(vocab_size);
    DIFF(hidden_size);
    DIFF(num_hidden_layers);
    DIFF(num_attention_heads);
    DIFF(num_key_value_heads);
    DIFF(head_dim);
    DIFF(intermediate_size);
    DIFF(moe_intermediate_size);
    DIFF(num_experts);
    DIFF(num_experts_per_tok);
    DIFF(decoder_sparse_step);
    DIFF(norm_topk_prob);
    DIFF(tie_word_embeddings);
    DIFF(rms_norm_eps);
    DIFF(rope_theta);
    DIFF(max_position_embeddings);
    DIFF(layer_is_moe);
    DIFF(bos_token_id);
    if (a->n_eos != b->n_eos ||
        memcmp(a->eos_token_ids, b->eos_token_ids, (size_t)a->n_eos * sizeof(int)) != 0)
        return "eos_token_id";
    if (a->quant != b->quant) return "quantization_config";
    DIFF(quant_block);
    DIFF(quant_group);
#undef DIFF
    return NULL;
}

void model_swap(model *m, model *fresh) {
    /* what the load made from the folder; the rest (config, ops, expert range, formats, the
     * all-to-all) is the same for both and is not written, since other threads read the config.
     * fresh may come from disk where m was made of dummy weights. */
#define SWAP(f)                                                                                    \
    do {                                                                                           \
        __typeof__(m->f) t_ = m->f;                                                                \
        m->f = fresh->f;                                                                           \
        fresh->f = t_;                                                                             \
    } while (0)
    SWAP(dir);
    SWAP(ckpt);
    SWAP(weights);
    SWAP(workspace);
    SWAP(tensors);
    SWAP(dummy); /* how model_free frees the tensors */
#undef SWAP
    const uint64_t epoch = m->ws_epoch > fresh->ws_epoch ? m->ws_epoch : fresh->ws_epoch;
    m->ws_epoch = epoch + 1;
}

uint64_t model_dummy_seed(const char *name) {
    uint64_t h = 14695981039346656037ull; /* FNV-1a */
    for (const unsigned char *p = (const unsigned char *)name; *p; p++) {
        h ^= *p;
        h *= 1099511628211ull;
    }
    return h;
}

void model_dummy_fill(const model *m, void *p, const char *name, int64_t n, int ndim,
                      int64_t in_features) {
    float offset = ndim == 1 ? 1.0f : 0.0f;
    float scale = ndim == 1 ? 0.05f : 1.0f / sqrtf((float)(in_features > 0 ? in_features : 1));
    m->ops->fill_random(p, DTYPE_BF16, n, model_dummy_seed(name), offset, scale);
}

/* Whether --quantization applies to checkpoint tensor `name`: a projection (its name ends in
 * _proj.weight), only the routed experts' with quantize_experts_only. */
static bool online_quantized(const model *m, const char *name) {
    const size_t len = strlen(name);
    return m->online_quant != MODEL_QUANT_NONE && len > 12 &&
           strcmp(name + len - 12, "_proj.weight") == 0 &&
           (!m->online_quant_experts_only || strstr(name, ".mlp.experts."));
}

void model_dummy_bytes(uint64_t *x, uint8_t *dst, size_t n, uint64_t mask, uint64_t set) {
    for (size_t k = 0; k < n; k += 8) {
        *x ^= *x >> 12, *x ^= *x << 25, *x ^= *x >> 27;
        const uint64_t r = ((*x * 2685821657736338717ull) & mask) | set;
        memcpy(dst + k, &r, n - k < 8 ? n - k : 8);
    }
}

void model_dummy_fp8(uint64_t *x, uint8_t *dst, size_t n) {
    /* sign, exponent 6 or 7, any mantissa */
    model_dummy_bytes(x, dst, n, 0x8F8F8F8F8F8F8F8Full, 0x3030303030303030ull);
}

float model_dummy_fp8_scale(int64_t in_features) {
    const float rms = sqrtf(1.34f); /* E[v^2] over E4M3 0x30..0x3F */
    return 1.0f / (rms * sqrtf((float)in_features));
}

/* Dense projections names[0 .. n) ([rows[i], K] each, stacked by rows into one weight) on a
 * backend that takes block FP8 weights (ops->prepare_linear_fp8, W8A16; MOESERVE_W8A16=0: not):
 * stored in FP8 or quantized to it at load (model_weight_fp8_into), or with --load-format dummy
 * --quantization fp8 random codes (model_dummy_fp8, as the dummy FP8 experts); their codes and scales a row into *t, no F32 copy
 * made. 1 done, 0 not taken (the caller goes the usual way), -1 with err. */
static int fp8_linear(model *m, int n, const char *const *names, const int64_t *rows, int64_t K,
                      tensor *t, char *err, size_t errlen) {
    const char *v = getenv("MOESERVE_W8A16");
    if (!m->ops->prepare_linear_fp8 || (v && strcmp(v, "0") == 0) || K <= 0 || K % 64 != 0)
        return 0;
    const bool online = m->online_quant == MODEL_QUANT_FP8 && online_quantized(m, names[0]);
    if (m->dummy && !online) return 0;
    if (!m->dummy && !online) { /* stored in FP8? (the parts' own checks come below) */
        const checkpoint_tensor *ct = checkpoint_find(&m->ckpt, names[0]);
        if (!ct || ct->t.dtype != DTYPE_F8_E4M3 || m->cfg.quant != MODEL_QUANT_FP8) return 0;
    }
    int64_t N = 0, most = 0;
    for (int i = 0; i < n; i++) {
        N += rows[i];
        most = rows[i] > most ? rows[i] : most;
    }
    if (N <= 0 || N % 8 != 0) return 0;
    const int64_t nk = (K + QUANT_FP8_BLOCK - 1) / QUANT_FP8_BLOCK;
    uint8_t *q = malloc((size_t)(N * K));
    float *rs = malloc((size_t)(nk * N) * sizeof(float));
    /* one part's block scales: at most those of its largest (most >= 1: N > 0) */
    const int64_t ns = (most + QUANT_FP8_BLOCK - 1) / QUANT_FP8_BLOCK * nk;
    float *s = malloc((size_t)(ns > 0 ? ns : 1) * sizeof(float));
    int rc = 1;
    if (!q || !rs || !s) {
        set_err(err, errlen, "%s: out of memory staging '%s' in FP8", m->dir, names[0]);
        rc = -1;
    }
    for (int i = 0, r0 = 0; i < n && rc == 1; r0 += (int)rows[i], i++) {
        uint8_t *qi = q + (size_t)r0 * K;
        if (m->dummy) {
            uint64_t x = model_dummy_seed(names[i]) | 1;
            model_dummy_fp8(&x, qi, (size_t)(rows[i] * K));
            for (int64_t b = 0; b < (rows[i] + QUANT_FP8_BLOCK - 1) / QUANT_FP8_BLOCK * nk; b++)
                s[b] = model_dummy_fp8_scale(K);
        } else {
            rc = model_weight_fp8_into(m, names[i], rows[i], K, qi, s, err, errlen);
        }
        if (rc == 1) quant_fp8_row_scales(rs + r0, N, s, (int)rows[i], (int)K);
    }
    char why[512];
    if (rc == 1 && m->ops->prepare_linear_fp8(t, q, rs, (int)N, (int)K, why, sizeof why))
        rc = set_err(err, errlen, "%s: tensor '%s': %s", m->dir, names[0], why);
    free(q);
    free(rs);
    free(s);
    return rc;
}

/* A dummy weight: BF16 on the backend's device, filled by model_dummy_fill. */
static int dummy_weight(model *m, const char *name, int ndim, const int64_t *shape,
                        struct model_tensor *mt, char *err, size_t errlen) {
    mt->t = (tensor){.dtype = DTYPE_BF16, .ndim = ndim, .device = m->ops->device};
    for (int i = 0; i < ndim; i++)
        mt->t.shape[i] = shape[i];
    size_t bytes = tensor_nbytes(&mt->t);
    mt->t.data = m->ops->dev_alloc(bytes);
    if (!mt->t.data)
        return set_err(err, errlen, "%s: dummy tensor '%s': out of %s memory for %zu bytes",
                       m->dir, name, m->ops->name, bytes);
    model_dummy_fill(m, mt->t.data, name, tensor_numel(&mt->t), ndim, ndim > 1 ? shape[1] : 0);
    return 0;
}

int model_weight(model *m, const char *name, int ndim, const int64_t *shape, const tensor **out,
                 char *err, size_t errlen) {
    if (ndim == 2) {
        struct model_tensor *mt = xcalloc(1, sizeof *mt);
        const int rc = fp8_linear(m, 1, &name, shape, shape[1], &mt->t, err, errlen);
        if (rc != 0) {
            mt->next = m->tensors;
            m->tensors = mt;
            *out = &mt->t;
            return rc < 0 ? -1 : 0;
        }
        free(mt);
    }
    if (m->dummy) {
        struct model_tensor *mt = xcalloc(1, sizeof *mt);
        mt->next = m->tensors;
        m->tensors = mt;
        if (dummy_weight(m, name, ndim, shape, mt, err, errlen)) return -1;
        *out = &mt->t;
        return 0;
    }
    const tensor *view = NULL;
    if (model_weight_info(m, name, ndim, shape, &view, err, errlen) || !view) return -1;
    struct model_tensor *mt = xcalloc(1, sizeof *mt);
    mt->t = *view;
    mt->next = m->tensors;
    m->tensors = mt;
    char why[512];
    if (m->ops->upload(&mt->t, why, sizeof why))
        return set_err(err, errlen, "%s: tensor '%s': %s", m->dir, name, why);
    *out = &mt->t;
    return 0;
}

int model_weight_rows(model *m, int n, const char *const *names, const int64_t *rows,
                      int64_t cols, const tensor **out, char *err, size_t errlen) {
    MS_ASSERT(m->ops->device != DEVICE_CPU && n >= 1);
    struct model_tensor *mt = xcalloc(1, sizeof *mt);
    mt->next = m->tensors;
    m->tensors = mt;
    int64_t total = 0;
    for (int i = 0; i < n; i++)
        total += rows[i];
    mt->t = (tensor){.ndim = 2, .shape = {total, cols}};
    const int fp8 = fp8_linear(m, n, names, rows, cols, &mt->t, err, errlen);
    if (fp8 != 0) {
        *out = &mt->t;
        return fp8 < 0 ? -1 : 0;
    }
    if (m->dummy) { /* each part filled as model_weight fills it alone: the same values */
        mt->t.dtype = DTYPE_BF16;
        mt->t.device = m->ops->device;
        mt->t.data = m->ops->dev_alloc(tensor_nbytes(&mt->t));
        if (!mt->t.data)
            return set_err(err, errlen, "%s: dummy tensor '%s' and %d more: out of %s memory",
                           m->dir, names[0], n - 1, m->ops->name);
        size_t off = 0;
        for (int i = 0; i < n; i++) {
            model_dummy_fill(m, (char *)mt->t.data + off, names[i], rows[i] * cols, 2, cols);
            off += (size_t)rows[i] * cols * dtype_size(DTYPE_BF16);
        }
        *out = &mt->t;
        return 0;
    }
    const tensor *views[8];
    MS_ASSERT(n <= 8);
    for (int i = 0; i < n; i++) {
        int64_t shape[2] = {rows[i], cols};
        if (model_weight_info(m, names[i], 2, shape, &views[i], err, errlen)) return -1;
        /* set whenever model_weight_info returns 0 (set_err, in another file, returns -1) */
        // NOLINTNEXTLINE(clang-analyzer-core.NullDereference)
        if (views[i]->dtype != views[0]->dtype)
            return set_err(err, errlen, "%s: tensor '%s' has dtype %s but '%s' has %s", m->dir,
                           names[i], dtype_name(views[i]->dtype), names[0],
                           dtype_name(views[0]->dtype));
    }
    mt->t.dtype = views[0]->dtype;
    mt->t.device = DEVICE_CPU;
    char *host = xmalloc(tensor_nbytes(&mt->t));
    size_t off = 0;
    for (int i = 0; i < n; i++) {
        memcpy(host + off, views[i]->data, tensor_nbytes(views[i]));
        off += tensor_nbytes(views[i]);
    }
    mt->t.data = host;
    char why[512];
    int rc = m->ops->upload(&mt->t, why, sizeof why);
    free(host);
    if (rc) {
        mt->t.data = NULL;
        return set_err(err, errlen, "%s: tensors '%s' and %d more, stacked: %s", m->dir, names[0],
                       n - 1, why);
    }
    *out = &mt->t;
    return 0;
}

/* The companion tensor `suffix` of weight `name` (name's ".weight" replaced), checked for dtype
 * and element count. */
static const checkpoint_tensor *quant_part(const model *m, const char *name, const char *suffix,
                                           dtype dt, int64_t numel, char *err, size_t errlen) {
    char part[320];
    size_t n = strlen(name);
    snprintf(part, sizeof part, "%.*s%s", (int)(n > 7 ? n - 7 : n), name, suffix);
    const checkpoint_tensor *ct = checkpoint_find(&m->ckpt, part);
    if (!ct) {
        set_err(err, errlen, "%s: tensor '%s' is quantized but '%s' is missing from the checkpoint",
                m->dir, name, part);
        return NULL;
    }
    if (ct->t.dtype != dt || tensor_numel(&ct->t) != numel) {
        char got[128];
        tensor_format_shape(got, sizeof got, ct->t.ndim, ct->t.shape);
        set_err(err, errlen, "%s: tensor '%s' is %s %s; expected %s of %lld elements", ct->file,
                part, dtype_name(ct->t.dtype), got, dtype_name(dt), (long long)numel);
        return NULL;
    }
    return ct;
}

/* w [N, K] (malloc'd) as an F32 host tensor the model owns and frees. */
static const tensor *own_f32(model *m, float *w, int64_t N, int64_t K) {
    struct model_tensor *mt = xcalloc(1, sizeof *mt);
    mt->t = (tensor){.dtype = DTYPE_F32, .ndim = 2, .shape = {N, K}, .device = DEVICE_CPU, .data = w};
    mt->host_owned = true;
    mt->next = m->tensors;
    m->tensors = mt;
    return &mt->t;
}

/* The checks of a quantized checkpoint tensor that stands for an [N, K] weight, nothing read
 * from its data: its dtype against config.json's quantization_config, its shape, its scale
 * tensors (FP8: *s the weight_scale_inv; NVFP4: *s the weight_scale, *s2 the weight_scale_2).
 * 0, or -1 with err naming the file and tensor. */
static int quant_check(const model *m, const checkpoint_tensor *ct, const char *name,
                       const int64_t *shape, const checkpoint_tensor **s,
                       const checkpoint_tensor **s2, char *err, size_t errlen) {
    const model_config *c = &m->cfg;
    const int64_t N = shape[0], K = shape[1];
    const bool fp8 = ct->t.dtype == DTYPE_F8_E4M3;
    if (fp8 ? c->quant != MODEL_QUANT_FP8 : c->quant != MODEL_QUANT_NVFP4)
        return set_err(err, errlen,
                       "%s: tensor '%s' has dtype %s, which %s/config.json's quantization_config "
                       "does not describe (%s)",
                       ct->file, name, dtype_name(ct->t.dtype), m->dir,
                       c->quant == MODEL_QUANT_NONE ? "it has none" : "another format");
    const int64_t want1 = fp8 ? K : K / 2;
    if (ct->t.ndim != 2 || ct->t.shape[0] != N || ct->t.shape[1] != want1 ||
        (!fp8 && K % QUANT_FP4_GROUP != 0)) {
        char got[128];
        tensor_format_shape(got, sizeof got, ct->t.ndim, ct->t.shape);
        return set_err(err, errlen, "%s: tensor '%s' has shape %s but config.json implies [%lld, %lld]%s",
                       ct->file, name, got, (long long)N, (long long)want1,
                       fp8 ? "" : " (packed: two values a byte)");
    }
    *s2 = NULL;
    if (fp8) {
        const int64_t bn = (N + QUANT_FP8_BLOCK - 1) / QUANT_FP8_BLOCK;
        const int64_t bk = (K + QUANT_FP8_BLOCK - 1) / QUANT_FP8_BLOCK;
        *s = quant_part(m, name, ".weight_scale_inv", DTYPE_F32, bn * bk, err, errlen);
        return *s ? 0 : -1;
    }
    *s = quant_part(m, name, ".weight_scale", DTYPE_F8_E4M3, N * K / QUANT_FP4_GROUP, err, errlen);
    *s2 = *s ? quant_part(m, name, ".weight_scale_2", DTYPE_F32, 1, err, errlen) : NULL;
    return *s2 ? 0 : -1;
}

/* A quantized checkpoint tensor as the F32 [N, K] weight it stands for (kernels/cpu/quant.c's
 * formulas), made once at load and owned by the model: FP8 codes times their block's
 * weight_scale_inv, or NVFP4 codes times their group's weight_scale times weight_scale_2. The
 * backends then read it as any F32 weight (the CUDA experts round it to BF16 unless the backend
 * takes the codes themselves: qwen3_moe.c). */
static int dequant_weight(model *m, const checkpoint_tensor *ct, const char *name,
                          const int64_t *shape, const tensor **out, char *err, size_t errlen) {
    const int64_t N = shape[0], K = shape[1];
    const checkpoint_tensor *s = NULL, *s2 = NULL;
    if (quant_check(m, ct, name, shape, &s, &s2, err, errlen) || !s) return -1;
    float *w = malloc((size_t)N * K * sizeof(float));
    if (!w) return set_err(err, errlen, "%s: out of memory dequantizing '%s'", m->dir, name);
    if (ct->t.dtype == DTYPE_F8_E4M3)
        dequant_fp8_blocks(w, ct->t.data, s->t.data, (int)N, (int)K);
    else if (s2)
        dequant_nvfp4(w, ct->t.data, s->t.data, *(const float *)s2->t.data, (int)N, (int)K);
    *out = own_f32(m, w, N, K);
    return 0;
}

/* --quantization on a BF16 (F16, F32) checkpoint: projection `name` [N, K] through the format's
 * round trip (quantize, then dequantize as dequant_weight does), the same F32 weight the
 * quantized checkpoint of scripts/make_quant_checkpoints.py gives. */
static int quantize_weight(model *m, const checkpoint_tensor *ct, const char *name,
                           const tensor **out, char *err, size_t errlen) {
    const int64_t N = ct->t.shape[0], K = ct->t.shape[1];
    if (m->online_quant == MODEL_QUANT_NVFP4 && K % QUANT_FP4_GROUP != 0)
        return set_err(err, errlen, "%s: tensor '%s' has %lld columns: NVFP4 needs a multiple of %d",
                       ct->file, name, (long long)K, QUANT_FP4_GROUP);
    float *w = malloc((size_t)N * K * sizeof(float));
    if (!w) return set_err(err, errlen, "%s: out of memory quantizing '%s'", m->dir, name);
#pragma omp parallel for schedule(static) if (N * K >= (1 << 16)) /* a large checkpoint's load */
    for (int64_t i = 0; i < N * K; i++)
        w[i] = tensor_get_f32(&ct->t, i);
    if (m->online_quant == MODEL_QUANT_FP8) {
        const int64_t nb = ((N + QUANT_FP8_BLOCK - 1) / QUANT_FP8_BLOCK) *
                           ((K + QUANT_FP8_BLOCK - 1) / QUANT_FP8_BLOCK);
        uint8_t *q = xmalloc((size_t)(N * K));
        float *s = xmalloc((size_t)nb * sizeof(float));
        quant_fp8_blocks(q, s, w, (int)N, (int)K);
        dequant_fp8_blocks(w, q, s, (int)N, (int)K);
        free(q);
        free(s);
    } else {
        uint8_t *q = xmalloc((size_t)(N * K / 2)), *sf = xmalloc((size_t)(N * K / QUANT_FP4_GROUP));
        float s2 = quant_nvfp4(q, sf, w, (int)N, (int)K, 0.0f);
        dequant_nvfp4(w, q, sf, s2, (int)N, (int)K);
        free(q);
        free(sf);
    }
    *out = own_f32(m, w, N, K);
    return 0;
}

int model_weight_fp8(const model *m, const char *name, int64_t N, int64_t K, const uint8_t **q,
                     const float **s, char *err, size_t errlen) {
    if (m->dummy || m->cfg.quant != MODEL_QUANT_FP8) return 0;
    const checkpoint_tensor *ct = checkpoint_find(&m->ckpt, name);
    if (!ct || ct->t.dtype != DTYPE_F8_E4M3) return 0;
    if (ct->t.ndim != 2 || ct->t.shape[0] != N || ct->t.shape[1] != K)
        return set_err(err, errlen, "%s: tensor '%s' is not FP8 codes of [%lld, %lld]", ct->file,
                       name, (long long)N, (long long)K);
    const int64_t bn = (N + QUANT_FP8_BLOCK - 1) / QUANT_FP8_BLOCK;
    const int64_t bk = (K + QUANT_FP8_BLOCK - 1) / QUANT_FP8_BLOCK;
    const checkpoint_tensor *sc =
        quant_part(m, name, ".weight_scale_inv", DTYPE_F32, bn * bk, err, errlen);
    if (!sc) return -1;
    *q = ct->t.data;
    *s = sc->t.data;
    return 1;
}

int model_weight_nvfp4(const model *m, const char *name, int64_t N, int64_t K, const uint8_t **q,
                       const uint8_t **sf, float *s2, char *err, size_t errlen) {
    if (m->dummy || m->cfg.quant != MODEL_QUANT_NVFP4) return 0;
    const checkpoint_tensor *ct = checkpoint_find(&m->ckpt, name);
    if (!ct || ct->t.dtype != DTYPE_U8) return 0;
    if (ct->t.ndim != 2 || ct->t.shape[0] != N || ct->t.shape[1] != K / 2 || K % QUANT_FP4_GROUP)
        return set_err(err, errlen, "%s: tensor '%s' is not NVFP4 codes of [%lld, %lld]", ct->file,
                       name, (long long)N, (long long)K);
    const checkpoint_tensor *f =
        quant_part(m, name, ".weight_scale", DTYPE_F8_E4M3, N * K / QUANT_FP4_GROUP, err, errlen);
    const checkpoint_tensor *t =
        f ? quant_part(m, name, ".weight_scale_2", DTYPE_F32, 1, err, errlen) : NULL;
    if (!t) return -1;
    *q = ct->t.data;
    *sf = f->t.data;
    *s2 = *(const float *)t->t.data;
    return 1;
}

/* Checkpoint tensor `name`, found and checked against shape (quantized ones with their scales,
 * nothing read from them): NULL with err when it is missing or malformed. */
static const checkpoint_tensor *weight_checked(model *m, const char *name, int ndim,
                                               const int64_t *shape, char *err, size_t errlen) {
    if (m->dummy) {
        set_err(err, errlen, "%s: tensor '%s': a dummy model has no checkpoint views", m->dir,
                name);
        return NULL;
    }
    const checkpoint_tensor *ct = checkpoint_find(&m->ckpt, name);
    if (!ct) {
        set_err(err, errlen, "%s: tensor '%s' is missing from the checkpoint", m->dir, name);
        return NULL;
    }
    if (ndim == 2 && (ct->t.dtype == DTYPE_F8_E4M3 || ct->t.dtype == DTYPE_U8)) {
        const checkpoint_tensor *s, *s2;
        return quant_check(m, ct, name, shape, &s, &s2, err, errlen) ? NULL : ct;
    }
    bool same = ct->t.ndim == ndim;
    for (int i = 0; same && i < ndim; i++) same = ct->t.shape[i] == shape[i];
    if (!same) {
        char got[128], want[128];
        tensor_format_shape(got, sizeof got, ct->t.ndim, ct->t.shape);
        tensor_format_shape(want, sizeof want, ndim, shape);
        set_err(err, errlen, "%s: tensor '%s' has shape %s but config.json implies %s", ct->file,
                name, got, want);
        return NULL;
    }
    if (ct->t.dtype != DTYPE_BF16 && ct->t.dtype != DTYPE_F32 && ct->t.dtype != DTYPE_F16) {
        set_err(err, errlen, "%s: tensor '%s' has dtype %s; supported: BF16, F16, F32", ct->file,
                name, dtype_name(ct->t.dtype));
        return NULL;
    }
    return ct;
}

int model_weight_check(model *m, const char *name, int ndim, const int64_t *shape, char *err,
                       size_t errlen) {
    return weight_checked(m, name, ndim, shape, err, errlen) ? 0 : -1;
}

/* Checkpoint tensor `name` [N, K] in BF16, F16 or F32 as floats (malloc'd), for --quantization
 * at load: NULL with err. */
static float *weight_floats(model *m, const char *name, int64_t N, int64_t K, char *err,
                            size_t errlen) {
    const int64_t shape[2] = {N, K};
    const checkpoint_tensor *ct = weight_checked(m, name, 2, shape, err, errlen);
    if (!ct) return NULL;
    float *w = malloc((size_t)N * K * sizeof(float));
    if (!w) {
        set_err(err, errlen, "%s: out of memory quantizing '%s'", m->dir, name);
        return NULL;
    }
#pragma omp parallel for schedule(static) if (N * K >= (1 << 16)) /* a large checkpoint's load */
    for (int64_t i = 0; i < N * K; i++)
        w[i] = tensor_get_f32(&ct->t, i);
    return w;
}

int model_weight_fp8_into(model *m, const char *name, int64_t N, int64_t K, uint8_t *q, float *s,
                          char *err, size_t errlen) {
    const uint8_t *cq = NULL;
    const float *cs = NULL;
    const int rc = model_weight_fp8(m, name, N, K, &cq, &cs, err, errlen);
    const int64_t nb = ((N + QUANT_FP8_BLOCK - 1) / QUANT_FP8_BLOCK) *
                       ((K + QUANT_FP8_BLOCK - 1) / QUANT_FP8_BLOCK);
    if (rc == 1 && cq && cs) {
        memcpy(q, cq, (size_t)(N * K));
        memcpy(s, cs, (size_t)nb * sizeof(float));
    }
    if (rc != 0 || m->dummy || m->online_quant != MODEL_QUANT_FP8 || !online_quantized(m, name))
        return rc;
    float *w = weight_floats(m, name, N, K, err, errlen);
    if (!w) return -1;
    quant_fp8_blocks(q, s, w, (int)N, (int)K); /* quantize_weight's codes */
    free(w);
    return 1;
}

int model_weight_nvfp4_into(model *m, const char *name, int64_t N, int64_t K, uint8_t *q,
                            uint8_t *sf, float *s2, char *err, size_t errlen) {
    const uint8_t *cq = NULL, *csf = NULL;
    const int rc = model_weight_nvfp4(m, name, N, K, &cq, &csf, s2, err, errlen);
    if (rc == 1 && cq && csf) {
        memcpy(q, cq, (size_t)(N * K / 2));
        memcpy(sf, csf, (size_t)(N * K / QUANT_FP4_GROUP));
    }
    if (rc != 0 || m->dummy || m->online_quant != MODEL_QUANT_NVFP4 || !online_quantized(m, name))
        return rc;
    if (K % QUANT_FP4_GROUP != 0)
        return set_err(err, errlen,
                       "%s: tensor '%s' has %lld columns: NVFP4 needs a multiple of %d", m->dir,
                       name, (long long)K, QUANT_FP4_GROUP);
    float *w = weight_floats(m, name, N, K, err, errlen);
    if (!w) return -1;
    *s2 = quant_nvfp4(q, sf, w, (int)N, (int)K, 0.0f); /* quantize_weight's codes */
    free(w);
    return 1;
}

int model_weight_info(model *m, const char *name, int ndim, const int64_t *shape,
                      const tensor **out, char *err, size_t errlen) {
    const checkpoint_tensor *ct = weight_checked(m, name, ndim, shape, err, errlen);
    if (!ct) return -1;
    if (ndim == 2 && (ct->t.dtype == DTYPE_F8_E4M3 || ct->t.dtype == DTYPE_U8))
        return dequant_weight(m, ct, name, shape, out, err, errlen);
    if (ndim == 2 && online_quantized(m, name))
        return quantize_weight(m, ct, name, out, err, errlen);
    *out = &ct->t;
    return 0;
}

int model_step_check(model *m) {
#ifdef MOESERVE_CUDA
    if (m->a2a_gpu) return a2a_gpu_check(m->a2a_gpu, m->err, sizeof m->err);
#endif
    (void)m;
    return 0;
}
