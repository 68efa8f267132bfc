// Placeholder: the MoE grouped GEMM lands here (see cuda_ops.h).
#include "common/log.h"
#include "kernels/cuda/cuda_ops.h"
int cuda_prepare_experts(moe_experts *, char *err, size_t errlen) {
    return set_err(err, errlen, "CUDA: the MoE kernels are not implemented yet");
}
void cuda_moe_experts(float *, const float *, const int32_t *, const moe_experts *, int, int, int,
                      int) {
    cuda_fail(__FILE__, __LINE__, "moe_experts", "not implemented yet");
}
