/* The CPU backend's op table: every op of kernels/ops.h, in plain C with OpenMP. It is the
 * reference the CUDA kernels are tested against and the backend of machines without a GPU.
 * Its "device" is host memory: the memory ops are malloc and memcpy. */
#include <string.h>
#include <unistd.h>

#include "kernels/cpu/cpu_ops.h"

static void *cpu_dev_alloc(size_t bytes) { return malloc(bytes ? bytes : 1); }
static void cpu_dev_free(void *p) { free(p); }
static void cpu_copy(void *dst, const void *src, size_t bytes) {
    if (bytes) memcpy(dst, src, bytes);
}
static void cpu_dev_zero(void *p, size_t bytes) {
    if (bytes) memset(p, 0, bytes);
}
static int cpu_upload(tensor *t, char *err, size_t errlen) { return 0; }
static int cpu_prepare_experts(moe_experts *w, char *err, size_t errlen) { return 0; }
static void cpu_sync(void) {}

static void cpu_mem_info(size_t *free_bytes, size_t *total_bytes) {
    long page = sysconf(_SC_PAGE_SIZE), avail = sysconf(_SC_AVPHYS_PAGES);
    long phys = sysconf(_SC_PHYS_PAGES);
    *free_bytes = page > 0 && avail > 0 ? (size_t)avail * (size_t)page : 0;
    *total_bytes = page > 0 && phys > 0 ? (size_t)phys * (size_t)page : 0;
}

static void cpu_gather_rows(float *out, const float *x, const int32_t *rows, int n, int D) {
    for (int i = 0; i < n; i++)
        memcpy(out + (size_t)i * D, x + (size_t)rows[i] * D, (size_t)D * sizeof(float));
}

static void cpu_fill_random(void *p, dtype dt, int64_t n, uint64_t seed, float offset,
                            float scale) {
#pragma omp parallel for schedule(static) if (n >= (1 << 16))
    for (int64_t i = 0; i < n; i++) {
        float v = offset + scale * ops_random_uniform(seed, (uint64_t)i);
        if (dt == DTYPE_BF16)
            ((uint16_t *)p)[i] = f32_to_bf16(v);
        else
            ((float *)p)[i] = v;
    }
}

static const ops cpu_ops_table = {
    .name = "cpu",
    .device = DEVICE_CPU,
    .dev_alloc = cpu_dev_alloc,
    .dev_free = cpu_dev_free,
    .to_device = cpu_copy,
    .to_host = cpu_copy,
    .dev_zero = cpu_dev_zero,
    .upload = cpu_upload,
    .prepare_experts = cpu_prepare_experts,
    .sync = cpu_sync,
    .mem_info = cpu_mem_info,
    .gather_rows = cpu_gather_rows,
    .fill_random = cpu_fill_random,
    .embedding = cpu_embedding,
    .rmsnorm = cpu_rmsnorm,
    .add_rmsnorm = cpu_add_rmsnorm,
    .linear = cpu_linear,
    .rope = cpu_rope,
    .qk_norm_rope = cpu_qk_norm_rope,
    .qkv_prepare = cpu_qkv_prepare,
    .kv_store = cpu_kv_store,
    .attention = cpu_attention,
    .router_topk = cpu_router_topk,
    .moe_experts = cpu_moe_experts,
    .moe_experts_n = cpu_moe_experts_n,
    .moe_input_quant = cpu_moe_input_quant,
    .moe_experts_q = cpu_moe_experts_q,
    .moe_finalize = cpu_moe_finalize,
    .moe_finalize_add_rmsnorm = cpu_moe_finalize_add_rmsnorm,
    .silu_mul = cpu_silu_mul,
    .add = cpu_add,
};

const ops *ops_cpu(void) { return &cpu_ops_table; }

#ifndef MOESERVE_CUDA
const ops *ops_cuda(int device, char *err, size_t errlen) {
    set_err(err, errlen,
            "this build has no CUDA backend (build where nvcc is found, without CUDA=0)");
    return NULL;
}

/* The setting is kept so a caller can set and read it in any build; the CPU computes in fp32
 * whatever it says. */
static matmul_precision cpu_build_matmul_precision = MATMUL_PRECISION_HIGH;

int ops_cuda_set_matmul_precision(const char *name, char *err, size_t errlen) {
    if (name && strcmp(name, "high") == 0)
        cpu_build_matmul_precision = MATMUL_PRECISION_HIGH;
    else if (name && strcmp(name, "medium") == 0)
        cpu_build_matmul_precision = MATMUL_PRECISION_MEDIUM;
    else
        return set_err(err, errlen, "unknown matmul precision '%s' (high or medium)",
                       name ? name : "(null)");
    return 0;
}

matmul_precision ops_cuda_matmul_precision(void) { return cpu_build_matmul_precision; }

/* Kept likewise; the CPU backend is batch-invariant whatever it says. */
static bool cpu_build_deterministic;
void ops_cuda_set_deterministic(bool on) { cpu_build_deterministic = on; }
bool ops_cuda_deterministic(void) { return cpu_build_deterministic; }
#endif
