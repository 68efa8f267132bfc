// The CUDA backend's op table (kernels/ops.h): device memory, weight upload, and the kernels of
// elementwise.cu, linear.cu, moe.cu and attention.cu. One device per process (the rank group
// picks it by local rank), one stream for every kernel, so ops run in the order they are called;
// to_host waits for everything queued before it.
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "common/log.h"
#include "kernels/cuda/cuda_ops.h"

#include <cuda_bf16.h>

static cudaStream_t g_stream;
static int g_device = -1;

cudaStream_t cuda_stream(void) { return g_stream; }
static void *cuda_native_stream(void) { return g_stream; }
static void cuda_bind_thread(void) { CUDA_CHECK(cudaSetDevice(g_device)); }

void cuda_fail(const char *file, int line, const char *what, const char *msg) {
    fprintf(stderr, "%s:%d: CUDA error in %s: %s\n", file, line, what, msg);
    abort();
}

static void *cuda_dev_alloc(size_t bytes) {
    void *p = nullptr;
    if (cudaMalloc(&p, bytes ? bytes : 1) != cudaSuccess) {
        cudaGetLastError(); // clear the sticky-free error state of a failed allocation
        return nullptr;
    }
    return p;
}

static void cuda_dev_free(void *p) {
    if (p) CUDA_CHECK(cudaFree(p));
}

static void cuda_to_device(void *dst, const void *src, size_t bytes) {
    if (!bytes) return;
    // complete on return: the source may be a stack buffer the caller reuses at once
    CUDA_CHECK(cuda_copy_to_device(dst, src, bytes));
}

static void cuda_to_host(void *dst, const void *src, size_t bytes) {
    if (!bytes) return;
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, g_stream));
    CUDA_CHECK(cudaStreamSynchronize(g_stream));
}

static void cuda_dev_zero(void *p, size_t bytes) {
    if (bytes) CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, g_stream));
}

static void cuda_sync(void) { CUDA_CHECK(cudaStreamSynchronize(g_stream)); }

static uint64_t g_epoch;

void cuda_workspace_changed(void) { g_epoch++; }

static uint64_t cuda_graph_epoch(void) { return g_epoch; }

static int cuda_graph_begin(char *err, size_t errlen) {
    cudaError_t e = cudaStreamBeginCapture(g_stream, cudaStreamCaptureModeThreadLocal);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return set_err(err, errlen, "CUDA graph: cannot start a capture: %s", cudaGetErrorString(e));
    }
    return 0;
}

static void *cuda_graph_end(char *err, size_t errlen) {
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    cudaError_t e = cudaStreamEndCapture(g_stream, &graph);
    if (e == cudaSuccess) e = cudaGraphInstantiate(&exec, graph, 0);
    if (graph) cudaGraphDestroy(graph);
    if (e != cudaSuccess) {
        cudaGetLastError(); // an invalidated capture is not sticky: the stream goes on
        set_err(err, errlen, "CUDA graph: capture failed: %s", cudaGetErrorString(e));
        return nullptr;
    }
    return exec;
}

static void cuda_graph_launch(void *graph) {
    CUDA_CHECK(cudaGraphLaunch((cudaGraphExec_t)graph, g_stream));
}

static void cuda_graph_free(void *graph) {
    if (graph) CUDA_CHECK(cudaGraphExecDestroy((cudaGraphExec_t)graph));
}

static void cuda_mem_info(size_t *free_bytes, size_t *total_bytes) {
    CUDA_CHECK(cudaMemGetInfo(free_bytes, total_bytes));
}

static int cuda_upload(tensor *t, char *err, size_t errlen) {
    if (t->device == DEVICE_CUDA) return 0;
    size_t bytes = tensor_nbytes(t);
    void *d = cuda_dev_alloc(bytes);
    if (!d)
        return set_err(err, errlen, "CUDA: out of device memory for a weight of %zu bytes", bytes);
    cudaError_t e = cuda_copy_to_device(d, t->data, bytes);
    if (e != cudaSuccess) {
        cudaFree(d);
        return set_err(err, errlen, "CUDA: copying a weight of %zu bytes to the device: %s",
                       bytes, cudaGetErrorString(e));
    }
    t->data = d;
    t->device = DEVICE_CUDA;
    return 0;
}

__global__ void gather_rows_kernel(float *out, const float *x, const int32_t *rows, int D) {
    const float *src = x + (size_t)rows[blockIdx.x] * D;
    float *dst = out + (size_t)blockIdx.x * D;
    for (int d = threadIdx.x; d < D; d += blockDim.x)
        dst[d] = src[d];
}

void cuda_gather_rows(float *out, const float *x, const int32_t *rows, int n, int D) {
    if (n <= 0) return;
    gather_rows_kernel<<<n, 256, 0, g_stream>>>(out, x, rows, D);
    CUDA_CHECK_LAUNCH();
}

__global__ void fill_random_kernel(void *p, int is_bf16, int64_t n, uint64_t seed, float offset,
                                   float scale) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        // no fused multiply-add: the CPU rounds the product and the sum separately
        float v = __fadd_rn(offset, __fmul_rn(scale, ops_random_uniform(seed, (uint64_t)i)));
        if (is_bf16)
            ((__nv_bfloat16 *)p)[i] = __float2bfloat16_rn(v);
        else
            ((float *)p)[i] = v;
    }
}

static void cuda_fill_random(void *p, dtype dt, int64_t n, uint64_t seed, float offset,
                             float scale) {
    if (n <= 0) return;
    if (dt != DTYPE_BF16 && dt != DTYPE_F32)
        cuda_fail(__FILE__, __LINE__, "fill_random", "dtype must be F32 or BF16");
    int64_t blocks = (n + 255) / 256;
    fill_random_kernel<<<(unsigned)(blocks < 65536 ? blocks : 65536), 256, 0, g_stream>>>(
        p, dt == DTYPE_BF16, n, seed, offset, scale);
    CUDA_CHECK_LAUNCH();
}

static const ops cuda_ops_table = {
    .name = "cuda",
    .device = DEVICE_CUDA,
    .dev_alloc = cuda_dev_alloc,
    .dev_free = cuda_dev_free,
    .to_device = cuda_to_device,
    .to_host = cuda_to_host,
    .dev_zero = cuda_dev_zero,
    .upload = cuda_upload,
    .prepare_experts = cuda_prepare_experts,
    .prepare_experts_nvfp4 = cuda_prepare_experts_nvfp4,
    .prepare_experts_fp8 = cuda_prepare_experts_fp8,
    .prepare_linear_fp8 = cuda_prepare_linear_fp8,
    .sync = cuda_sync,
    .mem_info = cuda_mem_info,
    .graph_begin = cuda_graph_begin,
    .graph_end = cuda_graph_end,
    .graph_launch = cuda_graph_launch,
    .graph_free = cuda_graph_free,
    .graph_epoch = cuda_graph_epoch,
    .gather_rows = cuda_gather_rows,
    .fill_random = cuda_fill_random,
    .embedding = cuda_embedding,
    .rmsnorm = cuda_rmsnorm,
    .add_rmsnorm = cuda_add_rmsnorm,
    .linear = cuda_linear,
    .rope = cuda_rope,
    .qk_norm_rope = cuda_qk_norm_rope,
    .qkv_prepare = cuda_qkv_prepare,
    .kv_store = cuda_kv_store,
    .attention = cuda_attention,
    .router_topk = cuda_router_topk,
    .moe_experts = cuda_moe_experts,
    .moe_experts_n = cuda_moe_experts_n,
    .moe_input_quant = cuda_moe_input_quant,
    .moe_experts_q = cuda_moe_experts_q,
    .native_stream = cuda_native_stream,
    .bind_thread = cuda_bind_thread,
    .moe_finalize = cuda_moe_finalize,
    .moe_finalize_add_rmsnorm = cuda_moe_finalize_add_rmsnorm,
    .silu_mul = cuda_silu_mul,
    .add = cuda_add,
    .sample = cuda_sample,
};

extern "C" const ops *ops_cuda(int device, char *err, size_t errlen) {
    if (g_device >= 0) {
        if (device != g_device) {
            set_err(err, errlen, "CUDA: the backend is already running on device %d", g_device);
            return nullptr;
        }
        return &cuda_ops_table;
    }
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0) {
        set_err(err, errlen, "CUDA: no usable GPU (%s)",
                e != cudaSuccess ? cudaGetErrorString(e) : "no device found");
        return nullptr;
    }
    if (device < 0 || device >= n) {
        set_err(err, errlen, "CUDA: device %d does not exist (this node has %d)", device, n);
        return nullptr;
    }
    if ((e = cudaSetDevice(device)) != cudaSuccess ||
        (e = cudaStreamCreateWithFlags(&g_stream, cudaStreamNonBlocking)) != cudaSuccess) {
        set_err(err, errlen, "CUDA: device %d: %s", device, cudaGetErrorString(e));
        return nullptr;
    }
    g_device = device;
    return &cuda_ops_table;
}
