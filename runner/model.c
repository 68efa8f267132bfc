/* Model loading: config, checkpoint, then the architecture named by model_type. */
#include "runner/model.h"

#include <stdio.h>
#include <string.h>

#include "common/log.h"

static const model_arch *const model_archs[] = {&qwen3_moe_arch};

model *model_load(const char *dir, const ops *ops, char *err, size_t errlen) {
    model *m = xcalloc(1, sizeof *m);
    m->dir = xstrdup(dir);
    m->ops = ops;
    if (model_config_load(&m->cfg, dir, err, errlen) != 0) goto fail;
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

void model_free(model *m) {
    if (!m) return;
    if (m->arch && m->arch->free) m->arch->free(m);
    checkpoint_close(&m->ckpt);
    free(m->dir);
    free(m);
}

int model_weight(const model *m, const char *name, int ndim, const int64_t *shape,
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
