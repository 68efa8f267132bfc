/* The CPU backend's op table: every op of kernels/ops.h, in plain C with OpenMP. It is the
 * reference the CUDA kernels are tested against and the backend of machines without a GPU. */
#include "kernels/cpu/cpu_ops.h"

static const ops cpu_ops_table = {
    .name = "cpu",
    .embedding = cpu_embedding,
    .rmsnorm = cpu_rmsnorm,
    .linear = cpu_linear,
    .rope = cpu_rope,
    .kv_store = cpu_kv_store,
    .attention = cpu_attention,
    .router_topk = cpu_router_topk,
    .moe_experts = cpu_moe_experts,
    .moe_finalize = cpu_moe_finalize,
    .silu_mul = cpu_silu_mul,
    .add = cpu_add,
};

const ops *ops_cpu(void) { return &cpu_ops_table; }
