/* Checkpoint reader: safetensors files, single or sharded (model.safetensors.index.json),
 * memory-mapped read-only. Every header is validated once at open (size limit, JSON shape,
 * dtype names, offsets inside the file, no overlap, size = numel x dtype size); downstream
 * code trusts the tensors it gets. */
#ifndef MOESERVE_SAFETENSORS_H
#define MOESERVE_SAFETENSORS_H

#include "common/tensor.h"

#define SAFETENSORS_MAX_HEADER (100u << 20) /* 100 MB, as the reference implementation */

typedef struct {
    char *name;       /* tensor name as in the header */
    tensor t;         /* dtype, shape, data (points into the mapping) */
    const char *file; /* path of the file that holds it (owned by the checkpoint) */
} checkpoint_tensor;

typedef struct {
    int n_files;
    char **file_paths;    /* [n_files] */
    void **maps;          /* [n_files] mmap bases */
    size_t *map_sizes;    /* [n_files] */
    int n_tensors;
    checkpoint_tensor *tensors; /* sorted by name */
} checkpoint;

/* Open every safetensors file of the model folder dir: model.safetensors.index.json when present
 * (each file its weight_map names, and every name it maps must be found in that file), else
 * every *.safetensors in dir. Returns 0, or -1 with a message naming the file and the field. */
int checkpoint_open(checkpoint *ck, const char *dir, char *err, size_t errlen);

/* Open one safetensors file (used by checkpoint_open and by tests). */
int checkpoint_open_file(checkpoint *ck, const char *path, char *err, size_t errlen);

/* The tensor called name, or NULL. O(log n). */
const checkpoint_tensor *checkpoint_find(const checkpoint *ck, const char *name);

void checkpoint_close(checkpoint *ck);

#endif
