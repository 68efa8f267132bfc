/* Fuzz target: the model folder's JSON files, read by model_config_load (config.json,
 * generation_config.json, hf_quant_config.json) and chat_template_load (tokenizer_config.json).
 *
 * The input is up to four files separated by NUL bytes, in that order; a missing part leaves its
 * file absent (each optional file's "absent" path is taken too). A config that loads must hold
 * what the loader promises to have validated: sizes in range, 1 <= K <= E for a MoE model (a
 * dense one, E = 0, ignores K), eos ids inside the vocabulary. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "config/model_config.h"
#include "server/chat_template.h"
#include "tests/fuzz/fuzz_files.h"

static const char *const fuzz_config_files[] = {"config.json", "generation_config.json",
                                                "hf_quant_config.json", "tokenizer_config.json"};

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    size_t at = 0;
    for (int i = 0; i < 4; i++) {
        if (at > size || (i > 0 && at == size)) {
            fuzz_write(fuzz_config_files[i], NULL, -1);
            continue;
        }
        size_t n = fuzz_split(data + at, size - at);
        fuzz_write(fuzz_config_files[i], data + at, (long)n);
        at += n + 1;
    }
    model_config c;
    char err[512];
    if (model_config_load(&c, fuzz_dir(), err, sizeof err) == 0) {
        if (c.vocab_size <= 0 || c.hidden_size <= 0 || c.num_hidden_layers <= 0 ||
            c.num_hidden_layers > MODEL_CONFIG_MAX_LAYERS || c.num_attention_heads <= 0 ||
            c.num_key_value_heads <= 0 || c.head_dim <= 0 || c.n_eos < 0 ||
            c.n_eos > MODEL_CONFIG_MAX_EOS ||
            (c.num_experts > 0 && (c.num_experts_per_tok < 1 ||
                                   c.num_experts_per_tok > c.num_experts)))
            abort();
        for (int i = 0; i < c.n_eos; i++)
            if (c.eos_token_ids[i] < 0 || c.eos_token_ids[i] >= c.vocab_size) abort();
    }
    chat_template t;
    chat_template_load(&t, fuzz_dir());
    if (t.kind != CHAT_TEMPLATE_NONE) {
        chat_message m = {"user", "hi"};
        free(chat_template_render(&t, &m, 1, true));
    }
    return 0;
}
