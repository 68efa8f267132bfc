/* Model configuration loader: config.json and the optional generation_config.json of a Hugging
 * Face model folder, parsed into a model_config and validated once so the runner can trust it.
 *
 * Choices:
 * - Types are strict: an integer field must be a JSON integer, a flag true/false. A field that is
 *   absent or null takes the transformers class default; a value of the wrong type is an error
 *   naming the field, never coerced.
 * - Settings that would change the arithmetic but that model_config cannot express (rope scaling
 *   other than the default, sliding-window attention, attention biases, an activation other than
 *   silu) are rejected rather than ignored, since ignoring them would give wrong logits silently.
 * - Unknown fields are ignored: configs carry many (torch_dtype, architectures, transformers
 *   version) that do not affect inference here.
 * - eos_token_id may be an int or a list in either file; the two are merged, config.json first,
 *   without duplicates. bos_token_id comes from config.json, else generation_config.json. */
#include "config/model_config.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "common/log.h"

#define CONFIG_MAX_FILE (64u << 20) /* config files are kilobytes; anything this big is not one */

static const char *const model_config_supported[] = {"qwen3_moe"};

/* Read and parse path. *root is NULL without error when the file is absent and optional. */
static int read_json(const char *path, bool optional, cJSON **root, char *err, size_t errlen) {
    *root = NULL;
    FILE *f = fopen(path, "rb");
    if (!f) {
        if (optional && errno == ENOENT) return 0;
        return set_err(err, errlen, "%s: cannot open: %s", path, strerror(errno));
    }
    size_t cap = 1 << 14, len = 0;
    char *text = xmalloc(cap);
    for (;;) {
        len += fread(text + len, 1, cap - len - 1, f);
        if (len < cap - 1 || cap > CONFIG_MAX_FILE) break;
        cap *= 2;
        text = xrealloc(text, cap);
    }
    bool read_error = ferror(f), too_big = !feof(f) && len == cap - 1;
    fclose(f);
    if (read_error || too_big) {
        free(text);
        return set_err(err, errlen, "%s: %s", path,
                       read_error ? "read error" : "file too large for a config");
    }
    text[len] = '\0';
    const char *end = NULL;
    *root = cJSON_ParseWithLengthOpts(text, len + 1, &end, 1);
    if (!*root) {
        size_t at = end ? (size_t)(end - text) : 0;
        free(text);
        return set_err(err, errlen, "%s: not valid JSON (error at byte %zu)", path, at);
    }
    free(text);
    if (!cJSON_IsObject(*root)) {
        cJSON_Delete(*root);
        *root = NULL;
        return set_err(err, errlen, "%s: not a JSON object", path);
    }
    return 0;
}

/* A field, or NULL when absent or null (both mean "use the default"). */
static const cJSON *field(const cJSON *obj, const char *key) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    return cJSON_IsNull(v) ? NULL : v;
}

static const char *json_type_name(const cJSON *v) {
    if (cJSON_IsString(v)) return "a string";
    if (cJSON_IsBool(v)) return "a boolean";
    if (cJSON_IsNumber(v)) return "a number";
    if (cJSON_IsArray(v)) return "an array";
    if (cJSON_IsObject(v)) return "an object";
    return "not a value";
}

static bool json_is_int(const cJSON *v) {
    if (!cJSON_IsNumber(v)) return false;
    double d = v->valuedouble;
    return d >= INT_MIN && d <= INT_MAX && d == floor(d);
}

/* The int field key, or def when absent; required fields must be present. */
static int get_int(const cJSON *obj, const char *key, bool required, int def, int *out,
                   const char *path, char *err, size_t errlen) {
    const cJSON *v = field(obj, key);
    if (!v) {
        if (required) return set_err(err, errlen, "%s: required field %s is missing", path, key);
        *out = def;
        return 0;
    }
    if (!json_is_int(v)) {
        if (cJSON_IsNumber(v))
            return set_err(err, errlen, "%s: field %s must be an integer, got %g", path, key,
                           v->valuedouble);
        return set_err(err, errlen, "%s: field %s must be an integer, got %s", path, key,
                       json_type_name(v));
    }
    *out = (int)v->valuedouble;
    return 0;
}

static int get_bool(const cJSON *obj, const char *key, bool def, bool *out, const char *path,
                    char *err, size_t errlen) {
    const cJSON *v = field(obj, key);
    if (!v) {
        *out = def;
        return 0;
    }
    if (!cJSON_IsBool(v))
        return set_err(err, errlen, "%s: field %s must be true or false, got %s", path, key,
                       json_type_name(v));
    *out = cJSON_IsTrue(v);
    return 0;
}

/* A number field; *found says whether it was there (out is untouched when not). */
static int get_number(const cJSON *obj, const char *key, const char *shown, double *out,
                      bool *found, const char *path, char *err, size_t errlen) {
    const cJSON *v = field(obj, key);
    *found = v != NULL;
    if (!v) return 0;
    if (!cJSON_IsNumber(v))
        return set_err(err, errlen, "%s: field %s must be a number, got %s", path, shown,
                       json_type_name(v));
    *out = v->valuedouble;
    return 0;
}

/* Append the token ids of an eos_token_id field (an int or a list of ints), skipping ids already
 * present. */
static int merge_eos(model_config *c, const cJSON *obj, const char *path, char *err,
                     size_t errlen) {
    const cJSON *v = field(obj, "eos_token_id");
    if (!v) return 0;
    int n = cJSON_IsArray(v) ? cJSON_GetArraySize(v) : 1;
    for (int i = 0; i < n; i++) {
        const cJSON *id = cJSON_IsArray(v) ? cJSON_GetArrayItem(v, i) : v;
        if (!json_is_int(id) || id->valuedouble < 0) {
            if (cJSON_IsArray(v))
                return set_err(err, errlen,
                               "%s: field eos_token_id[%d] must be a non-negative integer", path,
                               i);
            return set_err(err, errlen,
                           "%s: field eos_token_id must be a non-negative integer or a list of "
                           "them",
                           path);
        }
        int tok = (int)id->valuedouble;
        if (tok >= c->vocab_size)
            return set_err(err, errlen, "%s: field eos_token_id %d is outside [0, vocab_size = %d)",
                           path, tok, c->vocab_size);
        bool seen = false;
        for (int k = 0; k < c->n_eos; k++)
            seen |= c->eos_token_ids[k] == tok;
        if (seen) continue;
        if (c->n_eos == MODEL_CONFIG_MAX_EOS)
            return set_err(err, errlen, "%s: field eos_token_id: more than %d distinct ids", path,
                           MODEL_CONFIG_MAX_EOS);
        c->eos_token_ids[c->n_eos++] = tok;
    }
    return 0;
}

/* bos_token_id of obj, if present, must be a token id; -1 stays "none". */
static int get_bos(const cJSON *obj, int *bos, int vocab_size, const char *path, char *err,
                   size_t errlen) {
    if (get_int(obj, "bos_token_id", false, -1, bos, path, err, errlen) != 0) return -1;
    if (field(obj, "bos_token_id") && (*bos < 0 || *bos >= vocab_size))
        return set_err(err, errlen, "%s: field bos_token_id %d is outside [0, vocab_size = %d)",
                       path, *bos, vocab_size);
    return 0;
}

/* rope_scaling / rope_parameters may only name the default (unscaled) rotation. */
static int check_rope_type(const cJSON *obj, const char *key, const char *path, char *err,
                           size_t errlen) {
    const cJSON *v = field(obj, key);
    if (!v) return 0;
    if (!cJSON_IsObject(v))
        return set_err(err, errlen, "%s: field %s must be an object, got %s", path, key,
                       json_type_name(v));
    const char *names[] = {"rope_type", "type"};
    for (int i = 0; i < 2; i++) {
        const cJSON *t = field(v, names[i]);
        if (!t) continue;
        if (!cJSON_IsString(t))
            return set_err(err, errlen, "%s: field %s.%s must be a string, got %s", path, key,
                           names[i], json_type_name(t));
        if (strcmp(t->valuestring, "default") != 0)
            return set_err(err, errlen,
                           "%s: field %s.%s is \"%s\"; only \"default\" rope is supported", path,
                           key, names[i], t->valuestring);
    }
    return 0;
}

static int parse_config(model_config *c, const cJSON *j, const char *path, char *err,
                        size_t errlen) {
    const cJSON *mt = field(j, "model_type");
    char supported[256] = "";
    for (size_t i = 0; i < sizeof model_config_supported / sizeof *model_config_supported; i++)
        snprintf(supported + strlen(supported), sizeof supported - strlen(supported), "%s%s",
                 i ? ", " : "", model_config_supported[i]);
    if (!mt)
        return set_err(err, errlen, "%s: required field model_type is missing (supported: %s)",
                       path, supported);
    if (!cJSON_IsString(mt))
        return set_err(err, errlen, "%s: field model_type must be a string, got %s", path,
                       json_type_name(mt));
    bool known = false;
    for (size_t i = 0; i < sizeof model_config_supported / sizeof *model_config_supported; i++)
        known |= strcmp(mt->valuestring, model_config_supported[i]) == 0;
    if (!known)
        return set_err(err, errlen, "%s: field model_type \"%s\" is not supported (supported: %s)",
                       path, mt->valuestring, supported);
    snprintf(c->model_type, sizeof c->model_type, "%s", mt->valuestring);

    /* Integer fields: {key, required, default, destination}. The MoE and dense widths are
     * optional here and checked below once it is known which layers need them. */
    const struct {
        const char *key;
        bool required;
        int def;
        int *out;
    } ints[] = {
        {"vocab_size", true, 0, &c->vocab_size},
        {"hidden_size", true, 0, &c->hidden_size},
        {"num_hidden_layers", true, 0, &c->num_hidden_layers},
        {"num_attention_heads", true, 0, &c->num_attention_heads},
        {"num_key_value_heads", false, -1, &c->num_key_value_heads},
        {"head_dim", false, -1, &c->head_dim},
        {"intermediate_size", false, 0, &c->intermediate_size},
        {"moe_intermediate_size", false, 0, &c->moe_intermediate_size},
        {"num_experts", false, 0, &c->num_experts},
        {"num_experts_per_tok", false, 0, &c->num_experts_per_tok},
        {"decoder_sparse_step", false, 1, &c->decoder_sparse_step},
        {"max_position_embeddings", false, 32768, &c->max_position_embeddings},
    };
    for (size_t i = 0; i < sizeof ints / sizeof *ints; i++)
        if (get_int(j, ints[i].key, ints[i].required, ints[i].def, ints[i].out, path, err,
                    errlen) != 0)
            return -1;
    /* transformers 5 saves the expert count of Qwen3-MoE as num_local_experts. */
    if (!field(j, "num_experts") &&
        get_int(j, "num_local_experts", false, 0, &c->num_experts, path, err, errlen) != 0)
        return -1;

    if (get_bool(j, "norm_topk_prob", false, &c->norm_topk_prob, path, err, errlen) != 0 ||
        get_bool(j, "tie_word_embeddings", false, &c->tie_word_embeddings, path, err, errlen) != 0)
        return -1;

    bool found;
    double eps = 1e-6;
    if (get_number(j, "rms_norm_eps", "rms_norm_eps", &eps, &found, path, err, errlen) != 0)
        return -1;
    c->rms_norm_eps = (float)eps;

    /* transformers 5 moved rope_theta into rope_parameters; accept either, top level first. */
    c->rope_theta = 10000.0;
    if (get_number(j, "rope_theta", "rope_theta", &c->rope_theta, &found, path, err, errlen) != 0)
        return -1;
    if (check_rope_type(j, "rope_parameters", path, err, errlen) != 0 ||
        check_rope_type(j, "rope_scaling", path, err, errlen) != 0)
        return -1;
    const cJSON *rp = field(j, "rope_parameters");
    if (!found && rp &&
        get_number(rp, "rope_theta", "rope_parameters.rope_theta", &c->rope_theta, &found, path,
                   err, errlen) != 0)
        return -1;

    /* Accepted without use: the checkpoint's own dtypes are what count. */
    const char *dtype_keys[] = {"torch_dtype", "dtype"};
    for (int i = 0; i < 2; i++) {
        const cJSON *v = field(j, dtype_keys[i]);
        if (v && !cJSON_IsString(v))
            return set_err(err, errlen, "%s: field %s must be a string, got %s", path,
                           dtype_keys[i], json_type_name(v));
    }

    bool flag = false;
    if (get_bool(j, "use_sliding_window", false, &flag, path, err, errlen) != 0) return -1;
    if (flag)
        return set_err(err, errlen, "%s: field use_sliding_window is true; not supported", path);
    if (get_bool(j, "attention_bias", false, &flag, path, err, errlen) != 0) return -1;
    if (flag) return set_err(err, errlen, "%s: field attention_bias is true; not supported", path);
    const cJSON *act = field(j, "hidden_act");
    if (act && !cJSON_IsString(act))
        return set_err(err, errlen, "%s: field hidden_act must be a string, got %s", path,
                       json_type_name(act));
    if (act && strcmp(act->valuestring, "silu") != 0)
        return set_err(err, errlen, "%s: field hidden_act is \"%s\"; only \"silu\" is supported",
                       path, act->valuestring);

    /* Token ids are checked against vocab_size as they are read, so the message names the file
     * they came from; a non-positive vocab_size is reported first. */
    if (c->vocab_size <= 0)
        return set_err(err, errlen, "%s: field vocab_size must be positive, got %d", path,
                       c->vocab_size);
    if (get_bos(j, &c->bos_token_id, c->vocab_size, path, err, errlen) != 0) return -1;

    /* mlp_only_layers is checked after num_hidden_layers is validated; read it here. */
    const cJSON *mlp_only = field(j, "mlp_only_layers");
    if (mlp_only && !cJSON_IsArray(mlp_only))
        return set_err(err, errlen,
                       "%s: field mlp_only_layers must be a list of layer indices, "
                       "got %s",
                       path, json_type_name(mlp_only));
    return merge_eos(c, j, path, err, errlen);
}

/* Ranges and cross-field rules; derives layer_is_moe. */
static int validate(model_config *c, const cJSON *j, const char *path, char *err, size_t errlen) {
    const struct {
        const char *key;
        int value;
    } positive[] = {
        {"vocab_size", c->vocab_size},
        {"hidden_size", c->hidden_size},
        {"num_hidden_layers", c->num_hidden_layers},
        {"num_attention_heads", c->num_attention_heads},
        {"decoder_sparse_step", c->decoder_sparse_step},
        {"max_position_embeddings", c->max_position_embeddings},
    };
    for (size_t i = 0; i < sizeof positive / sizeof *positive; i++)
        if (positive[i].value <= 0)
            return set_err(err, errlen, "%s: field %s must be positive, got %d", path,
                           positive[i].key, positive[i].value);
    if (c->num_hidden_layers > MODEL_CONFIG_MAX_LAYERS)
        return set_err(err, errlen, "%s: field num_hidden_layers is %d, more than the %d supported",
                       path, c->num_hidden_layers, MODEL_CONFIG_MAX_LAYERS);

    if (!field(j, "num_key_value_heads")) c->num_key_value_heads = c->num_attention_heads;
    if (c->num_key_value_heads <= 0)
        return set_err(err, errlen, "%s: field num_key_value_heads must be positive, got %d", path,
                       c->num_key_value_heads);
    if (c->num_attention_heads % c->num_key_value_heads != 0)
        return set_err(err, errlen,
                       "%s: field num_attention_heads (%d) is not a multiple of "
                       "num_key_value_heads (%d)",
                       path, c->num_attention_heads, c->num_key_value_heads);

    if (!field(j, "head_dim")) {
        if (c->hidden_size % c->num_attention_heads != 0)
            return set_err(err, errlen,
                           "%s: field head_dim is absent and hidden_size (%d) is not a multiple of "
                           "num_attention_heads (%d)",
                           path, c->hidden_size, c->num_attention_heads);
        c->head_dim = c->hidden_size / c->num_attention_heads;
    }
    if (c->head_dim <= 0 || c->head_dim % 2 != 0)
        return set_err(err, errlen,
                       "%s: field head_dim must be positive and even (RoPE pairs), got %d", path,
                       c->head_dim);

    if (c->num_experts < 0)
        return set_err(err, errlen, "%s: field num_experts must be >= 0, got %d", path,
                       c->num_experts);
    if (c->num_experts > 0) {
        if (!field(j, "moe_intermediate_size"))
            return set_err(
                err, errlen,
                "%s: required field moe_intermediate_size is missing (num_experts is %d)", path,
                c->num_experts);
        if (!field(j, "num_experts_per_tok"))
            return set_err(err, errlen,
                           "%s: required field num_experts_per_tok is missing (num_experts is %d)",
                           path, c->num_experts);
        if (c->moe_intermediate_size <= 0)
            return set_err(err, errlen, "%s: field moe_intermediate_size must be positive, got %d",
                           path, c->moe_intermediate_size);
        if (c->num_experts_per_tok <= 0 || c->num_experts_per_tok > c->num_experts)
            return set_err(err, errlen,
                           "%s: field num_experts_per_tok must be in [1, num_experts = %d], got %d",
                           path, c->num_experts, c->num_experts_per_tok);
    }

    double eps = c->rms_norm_eps;
    if (!(eps > 0.0) || !isfinite(eps))
        return set_err(err, errlen, "%s: field rms_norm_eps must be positive and finite, got %g",
                       path, eps);
    if (!(c->rope_theta > 0.0) || !isfinite(c->rope_theta))
        return set_err(err, errlen, "%s: field rope_theta must be positive and finite, got %g",
                       path, c->rope_theta);

    for (int i = 0; i < c->num_hidden_layers; i++)
        c->layer_is_moe[i] = c->num_experts > 0 && (i + 1) % c->decoder_sparse_step == 0;
    const cJSON *mlp_only = field(j, "mlp_only_layers");
    int idx = 0;
    const cJSON *v;
    cJSON_ArrayForEach(v, mlp_only) {
        if (!json_is_int(v))
            return set_err(err, errlen, "%s: field mlp_only_layers[%d] must be an integer, got %s",
                           path, idx, json_type_name(v));
        int layer = (int)v->valuedouble;
        if (layer < 0 || layer >= c->num_hidden_layers)
            return set_err(err, errlen,
                           "%s: field mlp_only_layers[%d] = %d is outside [0, num_hidden_layers = "
                           "%d)",
                           path, idx, layer, c->num_hidden_layers);
        c->layer_is_moe[layer] = false;
        idx++;
    }
    for (int i = 0; i < c->num_hidden_layers; i++) {
        if (c->layer_is_moe[i]) continue;
        if (!field(j, "intermediate_size"))
            return set_err(err, errlen,
                           "%s: required field intermediate_size is missing (layer %d is dense)",
                           path, i);
        if (c->intermediate_size <= 0)
            return set_err(err, errlen,
                           "%s: field intermediate_size must be positive (layer %d is dense), got "
                           "%d",
                           path, i, c->intermediate_size);
        break;
    }

    return 0;
}

/* quantization_config of config.json (or the "quantization" object of ModelOpt's
 * hf_quant_config.json): the formats this server reads, with the published parameters. */
static int parse_quant(model_config *c, const cJSON *q, const char *path, char *err,
                       size_t errlen) {
    const cJSON *method = cJSON_GetObjectItemCaseSensitive(q, "quant_method");
    const cJSON *algo = cJSON_GetObjectItemCaseSensitive(q, "quant_algo");
    if (cJSON_IsString(method) && strcmp(method->valuestring, "fp8") == 0) {
        c->quant = MODEL_QUANT_FP8;
        c->quant_block[0] = c->quant_block[1] = 128;
        const cJSON *fmt = cJSON_GetObjectItemCaseSensitive(q, "fmt");
        if (fmt && !(cJSON_IsString(fmt) && strcmp(fmt->valuestring, "e4m3") == 0))
            return set_err(err, errlen, "%s: quantization_config.fmt: only \"e4m3\" is read", path);
        const cJSON *bs = cJSON_GetObjectItemCaseSensitive(q, "weight_block_size");
        if (bs) {
            if (!cJSON_IsArray(bs) || cJSON_GetArraySize(bs) != 2 ||
                !cJSON_IsNumber(cJSON_GetArrayItem(bs, 0)) ||
                !cJSON_IsNumber(cJSON_GetArrayItem(bs, 1)))
                return set_err(err, errlen,
                               "%s: quantization_config.weight_block_size must be [rows, columns]",
                               path);
            c->quant_block[0] = cJSON_GetArrayItem(bs, 0)->valueint;
            c->quant_block[1] = cJSON_GetArrayItem(bs, 1)->valueint;
        }
        if (c->quant_block[0] != 128 || c->quant_block[1] != 128)
            return set_err(err, errlen,
                           "%s: quantization_config.weight_block_size [%d, %d]: only [128, 128] "
                           "is read",
                           path, c->quant_block[0], c->quant_block[1]);
        return 0;
    }
    if ((cJSON_IsString(method) && strcmp(method->valuestring, "modelopt") == 0) ||
        (!method && cJSON_IsString(algo))) {
        if (!cJSON_IsString(algo) || strcmp(algo->valuestring, "NVFP4") != 0)
            return set_err(err, errlen, "%s: quantization quant_algo %s%s%s: only \"NVFP4\" is read",
                           path, cJSON_IsString(algo) ? "\"" : "",
                           cJSON_IsString(algo) ? algo->valuestring : "(missing)",
                           cJSON_IsString(algo) ? "\"" : "");
        c->quant = MODEL_QUANT_NVFP4;
        c->quant_group = 16;
        const cJSON *gs = cJSON_GetObjectItemCaseSensitive(q, "group_size");
        if (gs && (!cJSON_IsNumber(gs) || gs->valueint != 16))
            return set_err(err, errlen, "%s: quantization group_size: NVFP4 groups are 16", path);
        return 0;
    }
    const char *name = method && cJSON_IsString(method) ? method->valuestring : NULL;
    return set_err(err, errlen, "%s: quantization_config.quant_method %s%s%s: fp8 and modelopt "
                   "(NVFP4) are read",
                   path, name ? "\"" : "", name ? name : "(missing)", name ? "\"" : "");
}

int model_config_load(model_config *c, const char *dir, char *err, size_t errlen) {
    memset(c, 0, sizeof *c);
    char *path = path_join(dir, "config.json");
    char *gen_path = path_join(dir, "generation_config.json");
    cJSON *j = NULL, *g = NULL;
    int rc = read_json(path, false, &j, err, errlen);
    if (rc == 0) rc = parse_config(c, j, path, err, errlen);
    if (rc == 0) rc = read_json(gen_path, true, &g, err, errlen);
    if (rc == 0 && g) {
        rc = merge_eos(c, g, gen_path, err, errlen);
        int bos = -1;
        if (rc == 0) rc = get_bos(g, &bos, c->vocab_size, gen_path, err, errlen);
        if (rc == 0 && c->bos_token_id == -1) c->bos_token_id = bos;
    }
    if (rc == 0) rc = validate(c, j, path, err, errlen);
    const cJSON *qc = rc == 0 ? cJSON_GetObjectItemCaseSensitive(j, "quantization_config") : NULL;
    if (qc) {
        rc = cJSON_IsObject(qc) ? parse_quant(c, qc, path, err, errlen)
                                : set_err(err, errlen, "%s: quantization_config: not an object",
                                          path);
    } else if (rc == 0) { /* ModelOpt's own file, when config.json says nothing */
        char *hq_path = path_join(dir, "hf_quant_config.json");
        cJSON *hq = NULL;
        rc = read_json(hq_path, true, &hq, err, errlen);
        if (rc == 0 && hq) {
            const cJSON *q = cJSON_GetObjectItemCaseSensitive(hq, "quantization");
            rc = cJSON_IsObject(q) ? parse_quant(c, q, hq_path, err, errlen)
                                   : set_err(err, errlen, "%s: no \"quantization\" object", hq_path);
        }
        cJSON_Delete(hq);
        free(hq_path);
    }
    cJSON_Delete(j);
    cJSON_Delete(g);
    free(path);
    free(gen_path);
    return rc;
}
