/* Fuzz target: the checkpoint reader (config/safetensors.c).
 *
 * An input that starts with '{' is a model.safetensors.index.json, read beside one fixed valid
 * shard (model-00001-of-00001.safetensors: tensors "a" F32 [2] and "b" BF16 [3]); any other input
 * is a model.safetensors read alone. A checkpoint that opens must keep the reader's promise:
 * every tensor's bytes lie inside its file's mapping (or in an aligned heap copy), and their
 * count is numel x dtype size; every byte is read here so that a bad view faults. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "config/safetensors.h"
#include "tests/fuzz/fuzz_files.h"

#define FUZZ_SHARD "model-00001-of-00001.safetensors"

static void fuzz_write_shard(void) {
    static const char header[] = "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                                 "\"b\":{\"dtype\":\"BF16\",\"shape\":[3],\"data_offsets\":[8,14]}}";
    unsigned char buf[8 + sizeof header + 14] = {0};
    size_t hl = sizeof header - 1;
    for (int i = 0; i < 8; i++)
        buf[i] = (unsigned char)(hl >> (8 * i));
    memcpy(buf + 8, header, hl);
    for (size_t i = 0; i < 14; i++)
        buf[8 + hl + i] = (unsigned char)(i + 1);
    fuzz_write(FUZZ_SHARD, buf, (long)(8 + hl + 14));
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static bool shard_written;
    if (!shard_written) {
        fuzz_write_shard();
        shard_written = true;
    }
    bool index = size > 0 && data[0] == '{';
    fuzz_write("model.safetensors.index.json", data, index ? (long)size : -1);
    fuzz_write("model.safetensors", data, index ? -1 : (long)size);

    checkpoint ck;
    char err[512];
    if (checkpoint_open(&ck, fuzz_dir(), err, sizeof err) != 0) return 0;
    volatile unsigned sum = 0;
    for (int i = 0; i < ck.n_tensors; i++) {
        const checkpoint_tensor *ct = &ck.tensors[i];
        if (checkpoint_find(&ck, ct->name) != ct) abort();
        size_t n = tensor_nbytes(&ct->t);
        int f = 0;
        while (f < ck.n_files && ck.file_paths[f] != ct->file)
            f++;
        if (f == ck.n_files) abort();
        const unsigned char *p = ct->t.data, *lo = ck.maps[f], *hi = lo + ck.map_sizes[f];
        bool mapped = p >= lo && p <= hi;
        if (mapped && (size_t)(hi - p) < n) abort();
        for (size_t k = 0; k < n; k++)
            sum += p[k];
    }
    (void)sum;
    checkpoint_close(&ck);
    return 0;
}
