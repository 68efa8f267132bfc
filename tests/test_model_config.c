/* Model config tests: good qwen3_moe configs (both rope_theta spellings, head_dim that is not
 * hidden/heads, mlp_only_layers, decoder_sparse_step, eos merged with generation_config.json),
 * then one broken config per rule, each expected to fail naming the file and the field. Every
 * config is written here, into a fresh temporary folder, as a base config plus one edit. */
#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "config/model_config.h"
#include "tests/check.h"

static char tmp_root[] = "/tmp/moeserve_test_model_config_XXXXXX";
static int dir_counter;

/* Shaped like Qwen3-30B-A3B, scaled down: 6 layers, hidden 2048 / 32 heads = 64 but head_dim
 * 128, 8 experts, top-2, every second layer sparse and layer 3 forced dense. */
static const char base_config[] =
    "{\"architectures\":[\"Qwen3MoeForCausalLM\"],\"model_type\":\"qwen3_moe\","
    "\"vocab_size\":151936,\"hidden_size\":2048,\"num_hidden_layers\":6,"
    "\"num_attention_heads\":32,\"num_key_value_heads\":4,\"head_dim\":128,"
    "\"intermediate_size\":6144,\"moe_intermediate_size\":768,\"num_experts\":8,"
    "\"num_experts_per_tok\":2,\"decoder_sparse_step\":2,\"mlp_only_layers\":[3],"
    "\"norm_topk_prob\":true,\"tie_word_embeddings\":false,\"rms_norm_eps\":1e-06,"
    "\"rope_theta\":1000000.0,\"rope_scaling\":null,\"max_position_embeddings\":40960,"
    "\"hidden_act\":\"silu\",\"attention_bias\":false,\"use_sliding_window\":false,"
    "\"sliding_window\":null,\"torch_dtype\":\"bfloat16\",\"dtype\":\"bfloat16\","
    "\"bos_token_id\":151643,\"eos_token_id\":[151645,151643]}";

static void write_text(const char *dir, const char *name, const char *text) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    if (!f || fputs(text, f) < 0 || fclose(f) != 0) {
        perror(path);
        exit(2);
    }
}

/* A fresh folder holding base_config with up to two edits: key set to the JSON value, or
 * removed when value is NULL. Returns a static buffer. */
static const char *config_dir(const char *key1, const char *value1, const char *key2,
                              const char *value2) {
    static char dir[512];
    snprintf(dir, sizeof dir, "%s/c%d", tmp_root, dir_counter++);
    if (mkdir(dir, 0700) != 0) {
        perror(dir);
        exit(2);
    }
    cJSON *j = cJSON_Parse(base_config);
    const char *keys[2] = {key1, key2}, *values[2] = {value1, value2};
    for (int i = 0; i < 2; i++) {
        if (!keys[i]) continue;
        cJSON_DeleteItemFromObjectCaseSensitive(j, keys[i]);
        if (values[i]) cJSON_AddItemToObject(j, keys[i], cJSON_Parse(values[i]));
    }
    char *text = cJSON_PrintUnformatted(j);
    write_text(dir, "config.json", text);
    free(text);
    cJSON_Delete(j);
    return dir;
}

static int rm_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw) {
    return remove(path);
}

/* Load dir and expect failure whose message names config.json (or file) and holds want. */
static void expect_fail_in(const char *dir, const char *file, const char *want, int line) {
    model_config c;
    char err[512] = "";
    char path[600];
    snprintf(path, sizeof path, "%s/%s", dir, file);
    int rc = model_config_load(&c, dir, err, sizeof err);
    CHECK(rc == -1, "line %d: expected failure (%s)", line, want);
    CHECK(strstr(err, path) != NULL, "line %d: message does not name %s: %s", line, path, err);
    CHECK(strstr(err, want) != NULL, "line %d: message lacks \"%s\": %s", line, want, err);
}
#define EXPECT_FAIL(dir, want) expect_fail_in((dir), "config.json", (want), __LINE__)

static void test_good(void) {
    const char *dir = config_dir(NULL, NULL, NULL, NULL);
    write_text(dir, "generation_config.json",
               "{\"bos_token_id\":151643,\"eos_token_id\":[151643,2,151645],"
               "\"do_sample\":true,\"temperature\":0.6}");
    model_config c;
    char err[512] = "";
    int rc = model_config_load(&c, dir, err, sizeof err);
    CHECK(rc == 0, "load: %s", err);
    if (rc != 0) return;
    CHECK(strcmp(c.model_type, "qwen3_moe") == 0, "model_type %s", c.model_type);
    CHECK(c.vocab_size == 151936 && c.hidden_size == 2048 && c.num_hidden_layers == 6, "sizes");
    CHECK(c.num_attention_heads == 32 && c.num_key_value_heads == 4, "heads");
    CHECK(c.head_dim == 128, "head_dim %d (read, not hidden/heads)", c.head_dim);
    CHECK(c.intermediate_size == 6144 && c.moe_intermediate_size == 768, "widths");
    CHECK(c.num_experts == 8 && c.num_experts_per_tok == 2 && c.decoder_sparse_step == 2, "moe");
    CHECK(c.norm_topk_prob && !c.tie_word_embeddings, "flags");
    CHECK_CLOSE(c.rms_norm_eps, 1e-6, 0, 1e-6, "rms_norm_eps");
    CHECK(c.rope_theta == 1e6, "rope_theta %g", c.rope_theta);
    CHECK(c.max_position_embeddings == 40960, "max_position_embeddings");
    /* (i + 1) % 2 == 0 gives layers 1, 3, 5; layer 3 is in mlp_only_layers. */
    const bool want_moe[6] = {false, true, false, false, false, true};
    for (int i = 0; i < 6; i++)
        CHECK(c.layer_is_moe[i] == want_moe[i], "layer_is_moe[%d] = %d", i, c.layer_is_moe[i]);
    CHECK(c.n_eos == 3, "n_eos %d", c.n_eos);
    CHECK(c.eos_token_ids[0] == 151645 && c.eos_token_ids[1] == 151643 && c.eos_token_ids[2] == 2,
          "eos merged in order without duplicates: %d %d %d", c.eos_token_ids[0],
          c.eos_token_ids[1], c.eos_token_ids[2]);
    CHECK(c.bos_token_id == 151643, "bos %d", c.bos_token_id);
}

static void test_defaults_and_rope_parameters(void) {
    /* transformers 5 layout: rope_theta inside rope_parameters; no head_dim, no kv heads, no
     * sparse step, no mlp_only_layers (every layer MoE, so intermediate_size is not needed);
     * a single eos id; no bos anywhere; no generation_config.json. */
    const char *dir = config_dir(NULL, NULL, NULL, NULL);
    cJSON *j = cJSON_Parse(base_config);
    const char *drop[] = {"rope_theta",          "head_dim",
                          "num_key_value_heads", "decoder_sparse_step",
                          "mlp_only_layers",     "intermediate_size",
                          "bos_token_id",        "norm_topk_prob",
                          "rms_norm_eps",        "max_position_embeddings",
                          "tie_word_embeddings"};
    for (size_t i = 0; i < sizeof drop / sizeof *drop; i++)
        cJSON_DeleteItemFromObjectCaseSensitive(j, drop[i]);
    cJSON_AddItemToObject(j, "rope_parameters",
                          cJSON_Parse("{\"rope_type\":\"default\",\"rope_theta\":5000000}"));
    cJSON_ReplaceItemInObjectCaseSensitive(j, "eos_token_id", cJSON_CreateNumber(151645));
    char *text = cJSON_PrintUnformatted(j);
    write_text(dir, "config.json", text);
    free(text);
    cJSON_Delete(j);

    model_config c;
    char err[512] = "";
    int rc = model_config_load(&c, dir, err, sizeof err);
    CHECK(rc == 0, "load: %s", err);
    if (rc != 0) return;
    CHECK(c.rope_theta == 5e6, "rope_parameters.rope_theta %g", c.rope_theta);
    CHECK(c.head_dim == 64, "head_dim default hidden/heads: %d", c.head_dim);
    CHECK(c.num_key_value_heads == 32, "kv heads default H: %d", c.num_key_value_heads);
    CHECK(c.decoder_sparse_step == 1, "sparse step default");
    for (int i = 0; i < 6; i++)
        CHECK(c.layer_is_moe[i], "layer %d should be MoE", i);
    CHECK(c.n_eos == 1 && c.eos_token_ids[0] == 151645, "single eos");
    CHECK(c.bos_token_id == -1, "bos absent: %d", c.bos_token_id);
    CHECK(!c.norm_topk_prob && !c.tie_word_embeddings, "flag defaults");
    CHECK_CLOSE(c.rms_norm_eps, 1e-6, 0, 1e-6, "rms_norm_eps default");
    CHECK(c.max_position_embeddings == 32768, "max_position_embeddings default");

    /* No rope theta anywhere: 10000. */
    dir = config_dir("rope_theta", NULL, NULL, NULL);
    rc = model_config_load(&c, dir, err, sizeof err);
    CHECK(rc == 0 && c.rope_theta == 10000.0, "rope default: %s", err);

    /* Top-level rope_theta wins over rope_parameters. */
    dir = config_dir("rope_parameters", "{\"rope_theta\":7}", NULL, NULL);
    rc = model_config_load(&c, dir, err, sizeof err);
    CHECK(rc == 0 && c.rope_theta == 1e6, "rope_theta precedence: %s", err);

    /* A dense model (num_experts 0): every layer dense, MoE widths not needed. */
    dir = config_dir("num_experts", "0", "num_experts_per_tok", NULL);
    rc = model_config_load(&c, dir, err, sizeof err);
    CHECK(rc == 0, "dense: %s", err);
    for (int i = 0; rc == 0 && i < 6; i++)
        CHECK(!c.layer_is_moe[i], "dense layer %d", i);

    /* transformers 5 writes the expert count as num_local_experts. */
    dir = config_dir("num_experts", NULL, "num_local_experts", "8");
    rc = model_config_load(&c, dir, err, sizeof err);
    CHECK(rc == 0 && c.num_experts == 8 && c.layer_is_moe[1], "num_local_experts: %s", err);

    /* bos from generation_config.json when config.json has none; eos only there. */
    dir = config_dir("bos_token_id", NULL, "eos_token_id", NULL);
    write_text(dir, "generation_config.json", "{\"bos_token_id\":1,\"eos_token_id\":2}");
    rc = model_config_load(&c, dir, err, sizeof err);
    CHECK(rc == 0 && c.bos_token_id == 1 && c.n_eos == 1 && c.eos_token_ids[0] == 2,
          "generation_config ids: %s", err);
}

static void test_bad(void) {
    EXPECT_FAIL(config_dir("model_type", "\"llama\"", NULL, NULL), "model_type \"llama\"");
    EXPECT_FAIL(config_dir("model_type", "\"llama\"", NULL, NULL), "supported: qwen3_moe");
    EXPECT_FAIL(config_dir("model_type", NULL, NULL, NULL), "model_type is missing");
    EXPECT_FAIL(config_dir("model_type", "3", NULL, NULL), "model_type must be a string");

    /* Required fields. */
    const char *required[] = {
        "vocab_size",          "hidden_size",           "num_hidden_layers",
        "num_attention_heads", "moe_intermediate_size", "num_experts_per_tok"};
    for (size_t i = 0; i < sizeof required / sizeof *required; i++) {
        char want[128];
        snprintf(want, sizeof want, "required field %s is missing", required[i]);
        EXPECT_FAIL(config_dir(required[i], NULL, NULL, NULL), want);
    }
    EXPECT_FAIL(config_dir("intermediate_size", NULL, NULL, NULL),
                "intermediate_size is missing (layer 0 is dense)");

    /* Mistyped fields. */
    EXPECT_FAIL(config_dir("hidden_size", "\"2048\"", NULL, NULL),
                "hidden_size must be an integer, got a string");
    EXPECT_FAIL(config_dir("num_experts", "8.5", NULL, NULL),
                "num_experts must be an integer, got 8.5");
    EXPECT_FAIL(config_dir("head_dim", "[128]", NULL, NULL), "head_dim must be an integer");
    EXPECT_FAIL(config_dir("vocab_size", "1e12", NULL, NULL), "vocab_size must be an integer");
    EXPECT_FAIL(config_dir("norm_topk_prob", "1", NULL, NULL), "norm_topk_prob must be true or");
    EXPECT_FAIL(config_dir("rms_norm_eps", "\"1e-6\"", NULL, NULL),
                "rms_norm_eps must be a number");
    EXPECT_FAIL(config_dir("rope_theta", NULL, "rope_parameters", "{\"rope_theta\":\"big\"}"),
                "rope_parameters.rope_theta must be a number");
    EXPECT_FAIL(config_dir("mlp_only_layers", "3", NULL, NULL), "mlp_only_layers must be a list");
    EXPECT_FAIL(config_dir("mlp_only_layers", "[\"3\"]", NULL, NULL),
                "mlp_only_layers[0] must be an integer");
    EXPECT_FAIL(config_dir("eos_token_id", "\"</s>\"", NULL, NULL), "eos_token_id must be");
    EXPECT_FAIL(config_dir("eos_token_id", "[1,-2]", NULL, NULL), "eos_token_id[1]");
    EXPECT_FAIL(config_dir("torch_dtype", "16", NULL, NULL), "torch_dtype must be a string");

    /* Ranges. */
    EXPECT_FAIL(config_dir("hidden_size", "-2048", NULL, NULL), "hidden_size must be positive");
    EXPECT_FAIL(config_dir("vocab_size", "0", NULL, NULL), "vocab_size must be positive");
    EXPECT_FAIL(config_dir("num_key_value_heads", "5", NULL, NULL),
                "num_attention_heads (32) is not a multiple of num_key_value_heads (5)");
    EXPECT_FAIL(config_dir("num_key_value_heads", "0", NULL, NULL),
                "num_key_value_heads must be positive");
    EXPECT_FAIL(config_dir("num_experts_per_tok", "9", NULL, NULL),
                "num_experts_per_tok must be in [1, num_experts = 8], got 9");
    EXPECT_FAIL(config_dir("num_experts", "-1", NULL, NULL), "num_experts must be >= 0");
    EXPECT_FAIL(config_dir("head_dim", "127", NULL, NULL), "head_dim must be positive and even");
    EXPECT_FAIL(config_dir("head_dim", NULL, "num_attention_heads", "36"),
                "head_dim is absent and hidden_size (2048) is not a multiple");
    EXPECT_FAIL(config_dir("num_hidden_layers", "2000", NULL, NULL),
                "num_hidden_layers is 2000, more than the 1024 supported");
    EXPECT_FAIL(config_dir("mlp_only_layers", "[0,6]", NULL, NULL),
                "mlp_only_layers[1] = 6 is outside [0, num_hidden_layers = 6)");
    EXPECT_FAIL(config_dir("decoder_sparse_step", "0", NULL, NULL),
                "decoder_sparse_step must be positive");
    EXPECT_FAIL(config_dir("moe_intermediate_size", "0", NULL, NULL),
                "moe_intermediate_size must be positive");
    EXPECT_FAIL(config_dir("intermediate_size", "0", NULL, NULL),
                "intermediate_size must be positive (layer 0 is dense)");
    EXPECT_FAIL(config_dir("rms_norm_eps", "0", NULL, NULL), "rms_norm_eps must be positive");
    EXPECT_FAIL(config_dir("rope_theta", "-1", NULL, NULL), "rope_theta must be positive");
    EXPECT_FAIL(config_dir("bos_token_id", "151936", NULL, NULL), "bos_token_id 151936 is outside");
    EXPECT_FAIL(config_dir("eos_token_id", "[151936]", NULL, NULL),
                "eos_token_id 151936 is outside");

    /* Settings that would change the arithmetic. */
    EXPECT_FAIL(config_dir("rope_scaling", "{\"rope_type\":\"yarn\",\"factor\":4}", NULL, NULL),
                "rope_scaling.rope_type is \"yarn\"");
    EXPECT_FAIL(config_dir("rope_theta", NULL, "rope_parameters",
                           "{\"rope_type\":\"yarn\",\"rope_theta\":1e6}"),
                "rope_parameters.rope_type is \"yarn\"");
    EXPECT_FAIL(config_dir("use_sliding_window", "true", NULL, NULL), "use_sliding_window");
    EXPECT_FAIL(config_dir("attention_bias", "true", NULL, NULL), "attention_bias");
    EXPECT_FAIL(config_dir("hidden_act", "\"gelu\"", NULL, NULL), "hidden_act is \"gelu\"");

    /* Broken files. */
    const char *dir = config_dir(NULL, NULL, NULL, NULL);
    write_text(dir, "config.json", "{\"model_type\": \"qwen3_moe\",");
    EXPECT_FAIL(dir, "not valid JSON");
    dir = config_dir(NULL, NULL, NULL, NULL);
    write_text(dir, "config.json", "[]");
    EXPECT_FAIL(dir, "not a JSON object");
    dir = config_dir(NULL, NULL, NULL, NULL);
    char path[600];
    snprintf(path, sizeof path, "%s/config.json", dir);
    remove(path);
    EXPECT_FAIL(dir, "cannot open");

    /* generation_config.json problems name that file. */
    dir = config_dir(NULL, NULL, NULL, NULL);
    write_text(dir, "generation_config.json", "{\"eos_token_id\":\"x\"}");
    expect_fail_in(dir, "generation_config.json", "eos_token_id", __LINE__);
    dir = config_dir(NULL, NULL, NULL, NULL);
    write_text(dir, "generation_config.json", "{\"eos_token_id\":[1,999999]}");
    expect_fail_in(dir, "generation_config.json", "eos_token_id 999999 is outside", __LINE__);
    dir = config_dir(NULL, NULL, NULL, NULL);
    write_text(dir, "generation_config.json", "{\"bos_token_id\":true}");
    expect_fail_in(dir, "generation_config.json", "bos_token_id must be an integer", __LINE__);
    dir = config_dir(NULL, NULL, NULL, NULL);
    write_text(dir, "generation_config.json", "{");
    expect_fail_in(dir, "generation_config.json", "not valid JSON", __LINE__);
    dir = config_dir(NULL, NULL, NULL, NULL);
    write_text(dir, "generation_config.json",
               "{\"eos_token_id\":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17]}");
    expect_fail_in(dir, "generation_config.json", "more than 16 distinct ids", __LINE__);
}

int main(void) {
    if (!mkdtemp(tmp_root)) {
        perror("mkdtemp");
        return 2;
    }
    test_good();
    test_defaults_and_rope_parameters();
    test_bad();
    nftw(tmp_root, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
    CHECK_SUMMARY();
}
