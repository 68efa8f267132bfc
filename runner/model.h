/* A loaded model: its config, its checkpoint (weights stay memory-mapped), the op table that
 * runs it and the architecture's own weight table. Adding an architecture is one file in
 * runner/models/ that fills a model_arch. */
#ifndef MOESERVE_MODEL_H
#define MOESERVE_MODEL_H

#include "config/model_config.h"
#include "config/safetensors.h"
#include "kernels/ops.h"
#include "runner/kv_cache.h"

/* One forward pass over T tokens of one or more sequences. */
typedef struct {
    int T;
    const int32_t *ids; /* [T] token ids */
    attn_batch attn;    /* where each token sits: pos, seq, page table */
    int n_logits;
    const int32_t *logit_rows; /* [n_logits] rows of the batch whose logits are wanted */
} forward_batch;

typedef struct model model;

typedef struct {
    const char *model_type;
    /* Fill m->weights from m->ckpt, validating every name and shape against m->cfg. */
    int (*load)(model *m, char *err, size_t errlen);
    /* logits[n_logits, V] for the rows b->logit_rows; stores the batch's KV into kv. */
    void (*forward)(model *m, kv_cache *kv, const forward_batch *b, float *logits);
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
};

/* Load the model folder dir: config.json, generation_config.json, safetensors. Returns NULL
 * with a message naming the file and field on any problem. */
model *model_load(const char *dir, const ops *ops, char *err, size_t errlen);
void model_free(model *m);

/* Look up a tensor by name and check its shape (ndim dims from shape[]); ok -> 0 and *out set.
 * The message names the checkpoint folder, the tensor and both shapes. */
int model_weight(const model *m, const char *name, int ndim, const int64_t *shape,
                 const tensor **out, char *err, size_t errlen);

extern const model_arch qwen3_moe_arch;

#endif
