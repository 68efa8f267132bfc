/* Model configuration: config.json (+ generation_config.json) of a Hugging Face model folder,
 * parsed and validated once at load. Supported model_type: qwen3_moe. */
#ifndef MOESERVE_MODEL_CONFIG_H
#define MOESERVE_MODEL_CONFIG_H

#include <stdbool.h>
#include <stddef.h>

#define MODEL_CONFIG_MAX_LAYERS 1024
#define MODEL_CONFIG_MAX_EOS 16

typedef struct {
    char model_type[64];
    int vocab_size;              /* V */
    int hidden_size;             /* D */
    int num_hidden_layers;       /* L */
    int num_attention_heads;     /* H */
    int num_key_value_heads;     /* Hkv; defaults to H */
    int head_dim;                /* Dh; read, defaults to D / H only when absent */
    int intermediate_size;       /* F of dense layers */
    int moe_intermediate_size;   /* F of each expert */
    int num_experts;             /* E (0 = dense model) */
    int num_experts_per_tok;     /* K */
    int decoder_sparse_step;     /* default 1 */
    bool norm_topk_prob;         /* default false, as the transformers class */
    bool tie_word_embeddings;    /* default false */
    float rms_norm_eps;          /* default 1e-6 */
    double rope_theta;           /* rope_theta or rope_parameters.rope_theta; default 10000 */
    int max_position_embeddings; /* default 32768 */
    bool layer_is_moe[MODEL_CONFIG_MAX_LAYERS]; /* derived: not in mlp_only_layers, E > 0,
                                                   (i + 1) % decoder_sparse_step == 0 */
    int n_eos;
    int eos_token_ids[MODEL_CONFIG_MAX_EOS]; /* config.json and generation_config.json, merged */
    int bos_token_id;                        /* -1 when absent */
    /* The checkpoint's quantization (config.json's quantization_config, else hf_quant_config.json):
     * MODEL_QUANT_FP8 = DeepSeek-V3's block FP8 (weight F8_E4M3, weight_scale_inv per block of
     * quant_block rows x columns), MODEL_QUANT_NVFP4 = ModelOpt NVFP4 (weight U8, two E2M1 a byte,
     * weight_scale F8_E4M3 per quant_group, weight_scale_2). Each tensor's dtype in the
     * safetensors header decides whether it is quantized (the ignore lists are not needed). */
    int quant; /* MODEL_QUANT_* */
    int quant_block[2];
    int quant_group;
} model_config;

enum { MODEL_QUANT_NONE, MODEL_QUANT_FP8, MODEL_QUANT_NVFP4 };

/* Read dir/config.json (required) and dir/generation_config.json (optional). Returns 0, or -1
 * with a message naming the file and the field: unknown model_type, missing or mistyped
 * field, value out of range. */
int model_config_load(model_config *c, const char *dir, char *err, size_t errlen);

#endif
