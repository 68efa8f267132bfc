/* Model loading: config, checkpoint, then the architecture named by model_type. */
#include "runner/model.h"

#include <stdio.h>
#include <string.h>

#include "common/log.h"

static const model_arch *const model_archs[] = {&qwen3_moe_arch};

model *model_load(const char *dir, const ops *ops, char *err, size_t errlen) {
    return model_load_ep(dir, ops, 0, 1, err, errlen);
}

model *model_load_ep(const char *dir, const ops *ops, int ep_rank, int ep_size, char *err,
                     size_t errlen) {
    model *m = xcalloc(1, sizeof *m);
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
    if (checkpoint_open(&m->ckpt, dir, err, errlen) != 0) goto fail;
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
};

void model_free(model *m) {
    if (!m) return;
    if (m->arch && m->arch->free) m->arch->free(m);
    for (struct model_tensor *mt = m->tensors, *nx; mt; mt = nx) {
        nx = mt->next;
        if (mt->t.device != DEVICE_CPU) m->ops->dev_free(mt->t.data);
        free(mt);
    }
    checkpoint_close(&m->ckpt);
    free(m->dir);
    free(m);
}

int model_weight(model *m, const char *name, int ndim, const int64_t *shape, const tensor **out,
                 char *err, size_t errlen) {
    const tensor *view;
    if (model_weight_info(m, name, ndim, shape, &view, err, errlen)) return -1;
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

int model_weight_info(const model *m, const char *name, int ndim, const int64_t *shape,
                      const tensor **out, char *err, size_t errlen) {
    const checkpoint_tensor *ct = checkpoint_find(&m->ckpt, name);
    if (!ct) return set_err(err, errlen, "%s: tensor '%s' is missing from the checkpoint", m->dir, name);
    bool same = ct->t.ndim == ndim;
    for (int i = 0; same && i < ndim; i++) same = ct->t.shape[i] == shape[i];
    if (!same) {
        char got[128], want[128];
        tensor_format_shape(got, sizeof got, ct->t.ndim, ct->t.shape);
        tensor_format_shape(want, sizeof want, ndim, shape);
        return set_err(err, errlen, "%s: tensor '%s' has shape %s but config.json implies %s",
                       ct->file, name, got, want);
    }
    if (ct->t.dtype != DTYPE_BF16 && ct->t.dtype != DTYPE_F32 && ct->t.dtype != DTYPE_F16)
        return set_err(err, errlen, "%s: tensor '%s' has dtype %s; supported: BF16, F16, F32",
                       ct->file, name, dtype_name(ct->t.dtype));
    *out = &ct->t;
    return 0;
}
