// Placeholder: the paged attention kernels land here (see cuda_ops.h).
#include "kernels/cuda/cuda_ops.h"
void cuda_attention(float *, const float *, kv_layer, const attn_batch *, int, int, int, float) {
    cuda_fail(__FILE__, __LINE__, "attention", "not implemented yet");
}
