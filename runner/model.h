/* A loaded model: its config, its checkpoint (weights stay memory-mapped), the op table that
 * runs it and the architecture's own weight table. Adding an architecture is one file in
 * runner/models/ that fills a model_arch. */
#ifndef MOESERVE_MODEL_H
#define MOESERVE_MODEL_H

#include "config/model_config.h"
#include "config/safetensors.h"
#include "kernels/a2a.h"
#include "kernels/ops.h"
#include "runner/kv_cache.h"

/* One forward pass over T tokens of one or more sequences. */
typedef struct {
    int T;
    const int32_t *ids; /* [T] token ids */
    attn_batch attn;    /* where each token sits: pos, seq, page table */
    int n_logits;
    const int32_t *logit_rows; /* [n_logits] rows of the batch whose logits are wanted */
    /* With expert parallelism: the step agreement's largest T of any rank (>= T, the same on
     * every rank); every rank runs the forward, T = 0 included, so each joins every all-to-all.
     * 0 when the model runs alone. */
    int runtime_max;
} forward_batch;

typedef struct model model;

typedef struct {
    const char *model_type;
    /* Fill m->weights from m->ckpt, validating every name and shape against m->cfg. */
    int (*load)(model *m, char *err, size_t errlen);
    /* logits[n_logits, V] for the rows b->logit_rows; stores the batch's KV into kv. 0, or -1
     * with m->err set when an all-to-all failed (the rank group is then unusable). */
    int (*forward)(model *m, kv_cache *kv, const forward_batch *b, float *logits);
    void (*free)(model *m);
} model_arch;

struct model {
    char *dir;
    model_config cfg;
    checkpoint ckpt;
    const ops *ops;
    const model_arch *arch;
    void *weights;   /* the architecture's weight table */
    void *workspace; /* the architecture's activation buffers */
    /* Expert parallelism: this rank holds experts [expert_begin, expert_end) of every MoE layer
     * (a2a_split_experts over ep_size ranks) and, when a2a is set, runs them for the tokens the
     * all-to-all brings it from every rank. ep_size 1: all experts, no all-to-all. */
    int ep_rank, ep_size;
    int expert_begin, expert_end;
    a2a *a2a;      /* set by the caller after loading (model_free does not destroy it) */
    struct a2a_gpu *a2a_gpu; /* or the GPU's (kernels/cuda/a2a_cuda.h), the same way */
    /* With an all-to-all: its partial combine (each owner rank's weighted sum of its slots in
     * BF16, one vector per token and rank; a2a_combine_partial) instead of every slot in fp32.
     * Fewer link bytes; results then depend on the expert split (within BF16's rounding). */
    bool a2a_partial;
    struct model_tensor *tensors; /* the weights model_weight handed out (a list) */
    bool dummy; /* --load-format dummy: no checkpoint; every weight is made by fill_random */
    int online_quant; /* MODEL_QUANT_*: BF16 projections quantized at load (--quantization) */
    bool online_quant_experts_only; /* only the routed experts' (model_load_opts) */
    /* The routed experts' activation format, an a2a_payload (kernels/a2a.h), one rule for every
     * rank count: A2A_PAYLOAD_FP8 with FP8 experts (DeepSeek-V3's W8A8: the input in E4M3 with
     * one fp32 scale per token per 128 channels), A2A_PAYLOAD_NVFP4 with NVFP4 experts (E2M1,
     * an E4M3 scale per 16 channels and the token's fp32 scale, as SGLang's flashinfer
     * dispatcher sends tokens to the trtllm routed experts), else A2A_PAYLOAD_F32 (no
     * rounding). The experts' input goes through it on every path: alone through
     * ops->moe_input_quant, with an all-to-all through its dispatch, whose payload must be this
     * one (the model checks each layer; the caller creates the all-to-all with it), so tokens
     * cross quantized and each rank's experts see the bits one process gives them. A backend
     * without moe_input_quant keeps F32. Only the experts' input: their down projection reads
     * silu(gate) * up unrounded (a W8A8 kernel that quantizes it too must say so in
     * moe_experts, with the CPU following). MOESERVE_EXPERT_ACT_QUANT=0 makes it F32 whatever
     * the weights (the quantized GEMMs against their dequantized weights alone, nothing else
     * rounded: gpu_check.sh's tight whole-model comparison of the GPU with the CPU). */
    int expert_payload;
    char err[512]; /* why the last forward failed */
    uint64_t ws_epoch; /* moves on whenever the activation buffers are reallocated */
};

/* Load the model folder dir: config.json, generation_config.json, safetensors. Returns NULL
 * with a message naming the file and field on any problem. */
model *model_load(const char *dir, const ops *ops, char *err, size_t errlen);
/* The same for rank ep_rank of ep_size: every tensor is checked, but only this rank's experts
 * are kept (the others' bytes are never read: the checkpoint is memory-mapped). */
model *model_load_ep(const char *dir, const ops *ops, int ep_rank, int ep_size, char *err,
                     size_t errlen);

typedef struct {
    int ep_rank, ep_size; /* 0 and 1 alone */
    /* No checkpoint (SGLang's and vLLM's --load-format dummy): dir needs only config.json; every
     * weight is BF16 made on the backend's device by fill_random, seeded by the tensor's name, so
     * every rank and every backend makes the same model. Matrices are uniform in
     * [-1/sqrt(in), 1/sqrt(in)), norm weights in [0.95, 1.05). */
    bool dummy;
    /* SGLang's --quantization: NULL or "" keeps the checkpoint's own format; "fp8" (block FP8)
     * or "modelopt_fp4" / "nvfp4" (NVFP4) quantizes a BF16 checkpoint's projections as it loads,
     * with the same formulas as scripts/make_quant_checkpoints.py, so the weights equal those of
     * the checkpoint that script writes; on a checkpoint already quantized it must name its
     * format. */
    const char *quantization;
    /* With quantization on a BF16 checkpoint: only the routed experts' projections
     * (.mlp.experts.*), the rest left as the checkpoint has it; what the experts' format alone
     * costs (scripts/quant_kl.c measures it). */
    bool quantize_experts_only;
} model_load_opts;
model *model_load_with(const char *dir, const ops *ops, const model_load_opts *o, char *err,
                        size_t errlen);

/* The seed of a dummy tensor: a hash of its name. */
uint64_t model_dummy_seed(const char *name);
/* dst[0 .. n) from the xorshift64* generator at *x, word by word, each word's bits (r & mask) |
 * set: the dummy quantized weights' codes and scales. */
void model_dummy_bytes(uint64_t *x, uint8_t *dst, size_t n, uint64_t mask, uint64_t set);
/* Dummy FP8 weights: n E4M3 codes of magnitude 0.5 to 1.875, either sign (from *x as above), and
 * the one block scale that gives them an RMS of about 1 / sqrt(in_features). */
void model_dummy_fp8(uint64_t *x, uint8_t *dst, size_t n);
float model_dummy_fp8_scale(int64_t in_features);
/* Fill n elements at p (BF16, on the backend's device) as the dummy tensor `name` of the given
 * input width has them (element i of the tensor = element i of the stream). */
void model_dummy_fill(const model *m, void *p, const char *name, int64_t n, int ndim,
                      int64_t in_features);
void model_free(model *m);
/* The first field in which two configs differ (config.json's name; "layer_is_moe" for
 * mlp_only_layers / decoder_sparse_step, "eos_token_id" for the merged EOS list), or NULL where
 * they agree in everything. */
const char *model_config_diff(const model_config *a, const model_config *b);
/* m takes fresh's weights, checkpoint, folder and activation buffers, and fresh takes m's, so that
 * model_free(fresh) then frees the old ones; ws_epoch moves on past both, so nothing captured over
 * the old buffers (decode graphs) is replayed. Both loaded with the same ops and options and equal
 * configs (model_config_diff), so everything else (the all-to-all, sized by the config, included)
 * stays as it is. */
void model_swap(model *m, model *fresh);
/* After a step's work is queued where the forward itself did not check (a replayed decode
 * graph): waits for it and reports what the GPU all-to-all's kernels recorded (a peer that did
 * not arrive in time, a runtime_max mismatch) into m->err. 0 where there is nothing to check. */
int model_step_check(model *m);

/* Look up a tensor by name and check its shape (ndim dims from shape[]) and dtype; ok -> 0 and
 * *out set to the checkpoint's view (host memory), or, for a weight stored quantized (F8_E4M3 or
 * packed U8, as cfg.quant says), to the F32 weight it stands for, dequantized once and owned by
 * the model. The message names the checkpoint file or folder, the tensor and both shapes. */
int model_weight_info(model *m, const char *name, int ndim, const int64_t *shape,
                      const tensor **out, char *err, size_t errlen);
/* The same checks (a quantized weight's scale tensors included), nothing dequantized or read:
 * for tensors that a backend takes in their stored format, or that this rank does not hold. */
int model_weight_check(model *m, const char *name, int ndim, const int64_t *shape, char *err,
                       size_t errlen);
/* Weight `name` [N, K] as the checkpoint stores it in NVFP4 (config.json's quantization says
 * NVFP4 and the tensor is packed U8): 1 with *q its codes [N, K / 2], *sf its E4M3 group scales
 * [N, K / 16] (checkpoint views) and *s2 its tensor scale; 0 when it is stored otherwise; -1 with
 * err when a part is missing or malformed. model_weight_fp8: the same for block FP8 (*q its
 * E4M3 codes [N, K], *s its weight_scale_inv [ceil(N / 128), ceil(K / 128)]). */
int model_weight_fp8(const model *m, const char *name, int64_t N, int64_t K, const uint8_t **q,
                     const float **s, char *err, size_t errlen);
int model_weight_nvfp4(const model *m, const char *name, int64_t N, int64_t K, const uint8_t **q,
                       const uint8_t **sf, float *s2, char *err, size_t errlen);
/* The same parts copied into the caller's arrays (q [N, K], s [ceil(N / 128) * ceil(K / 128)];
 * NVFP4: q [N, K / 2], sf [N, K / 16], *s2), from the checkpoint's quantized tensor, or, with
 * --quantization fp8 / nvfp4 on a BF16 (F16, F32) checkpoint, quantized from its weight at load
 * by the formulas the loaded F32 weight goes through (model_weight_info): the codes a W8A16 /
 * W4A16 backend takes for what the CPU runs. 1 done, 0 when neither applies, -1 with err. */
int model_weight_fp8_into(model *m, const char *name, int64_t N, int64_t K, uint8_t *q, float *s,
                          char *err, size_t errlen);
int model_weight_nvfp4_into(model *m, const char *name, int64_t N, int64_t K, uint8_t *q,
                            uint8_t *sf, float *s2, char *err, size_t errlen);
/* model_weight_info, then the model's own copy of the view, made usable by its backend
 * (ops->upload: on the device for CUDA); the copy lives as long as the model. */
int model_weight(model *m, const char *name, int ndim, const int64_t *shape, const tensor **out,
                 char *err, size_t errlen);

/* For a backend with its own memory (not the CPU): the 2-D weights names[0 .. n) (n <= 8), of
 * rows[i] x cols each and one dtype, stacked by rows into one device tensor the model owns (a
 * dummy model fills each part as model_weight would). Lets several projections of the same input
 * run as one linear. */
int model_weight_rows(model *m, int n, const char *const *names, const int64_t *rows,
                      int64_t cols, const tensor **out, char *err, size_t errlen);

extern const model_arch qwen3_moe_arch;

#endif
