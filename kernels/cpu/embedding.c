/* embedding: copy one table row per token, widened to fp32. The table stays in its dtype (the
 * checkpoint's mmap); only the T rows a batch touches are converted. */
#include <string.h>

#include "kernels/cpu/cpu_ops.h"

/* out[T, D] = table[ids[t], :], table [V, D]. */
void cpu_embedding(float *out, const tensor *table, const int32_t *ids, int T, int D) {
    if (T <= 0) return;
    CPU_ASSERT_WEIGHT(table, "embedding");
    MS_ASSERT(table->ndim == 2 && table->shape[1] == D);
    const int64_t V = table->shape[0];
    for (int t = 0; t < T; t++) {
        /* Token ids are checked against the vocabulary where requests enter the server. */
        MS_ASSERT(ids[t] >= 0 && ids[t] < V);
        const int64_t row = (int64_t)ids[t] * D;
        float *o = out + (int64_t)t * D;
        if (table->dtype == DTYPE_F32) {
            memcpy(o, (const float *)table->data + row, (size_t)D * sizeof(float));
        } else {
            for (int d = 0; d < D; d++)
                o[d] = tensor_get_f32(table, row + d);
        }
    }
}
