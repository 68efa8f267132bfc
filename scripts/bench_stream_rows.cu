// How fast one H200 streams the experts' weights in the pattern of the tiny path's GEMMs
// (kernels/cuda/moe.cu), with no arithmetic: 128 threads a block, each block R rows of a
// row-major matrix [rows, row_bytes], step_bytes of each row a k tile copied by cp.async into a
// ring of stages (each thread waits for its copies of the oldest stage, then the block's barrier,
// as the kernel's k loop does). "tiled" reads each stage's bytes from one run of memory, as
// weights stored in stage order would be. Against a device copy measured in the same run.
//
//   build/bench_stream_rows [--reps R]
//
// The matrices are 8 experts x 4096 rows (DeepSeek-V3's GEMM 1 at T = 1, and the same block count
// for rows of D 2048), one block each 64 rows: 512 blocks. Each rep reads another copy of the
// matrix where the buffer holds several, so that L2 does not keep it.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "kernels/cuda/cuda_ops.h"

__device__ __forceinline__ void cp16(uint32_t dst, const void *src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}

template <int STAGES>
__global__ void __launch_bounds__(128)
    rows_kernel(const uint8_t *w, int R, int64_t row_bytes, int step_bytes, int tiled, int *sink) {
    extern __shared__ __align__(128) uint8_t sm[];
    const uint32_t s0 = (uint32_t)__cvta_generic_to_shared(sm);
    const int tid = threadIdx.x, cpr = step_bytes / 16, nk = (int)(row_bytes / step_bytes);
    const uint8_t *base = w + (int64_t)blockIdx.x * R * row_bytes;
    auto load = [&](int slot, int kt) {
        for (int i = tid; i < R * cpr; i += 128) {
            const int r = i / cpr, c = i % cpr;
            const uint8_t *src = tiled ? base + ((int64_t)kt * R + r) * step_bytes + c * 16
                                       : base + r * row_bytes + (int64_t)kt * step_bytes + c * 16;
            cp16(s0 + (slot * R + r) * step_bytes + c * 16, src);
        }
    };
    for (int s = 0; s < STAGES - 1; s++) {
        if (s < nk) load(s, s);
        asm volatile("cp.async.commit_group;\n");
    }
    int acc = 0;
    for (int kt = 0; kt < nk; kt++) {
        asm volatile("cp.async.wait_group %0;\n" ::"n"(STAGES - 2));
        __syncthreads();
        if (kt + STAGES - 1 < nk) load((kt + STAGES - 1) % STAGES, kt + STAGES - 1);
        asm volatile("cp.async.commit_group;\n");
        acc += sm[(kt % STAGES) * R * step_bytes + tid];
    }
    if (acc == 0x7fffffff) *sink = acc; // never: keeps the reads
}

int main(int argc, char **argv) {
    int reps = 20;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--reps") && i + 1 < argc) {
            reps = atoi(argv[++i]);
        } else {
            fprintf(stderr, "usage: %s [--reps R]\n", argv[0]);
            return 2;
        }
    }
    const int R = 64, blocks = 8 * 4096 / R;
    const size_t buf = (size_t)blocks * R * 14336; // the largest matrix below
    uint8_t *w, *x, *y;
    int *sink;
    CUDA_CHECK(cudaMalloc(&w, buf));
    CUDA_CHECK(cudaMalloc(&sink, sizeof(int)));
    CUDA_CHECK(cudaMemset(w, 1, buf));
    const size_t cb = (size_t)1 << 30;
    CUDA_CHECK(cudaMalloc(&x, cb));
    CUDA_CHECK(cudaMalloc(&y, cb));
    cudaEvent_t a, b;
    CUDA_CHECK(cudaEventCreate(&a));
    CUDA_CHECK(cudaEventCreate(&b));
    float ms = 0;
    CUDA_CHECK(cudaMemcpy(y, x, cb, cudaMemcpyDeviceToDevice));
    CUDA_CHECK(cudaEventRecord(a));
    for (int i = 0; i < 5; i++)
        CUDA_CHECK(cudaMemcpyAsync(y, x, cb, cudaMemcpyDeviceToDevice));
    CUDA_CHECK(cudaEventRecord(b));
    CUDA_CHECK(cudaEventSynchronize(b));
    CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    const double copy = 5 * 2.0 * cb / (ms * 1e-3) / 1e9;
    printf("device copy of 1 GiB: %.0f GB/s (read + write)\n", copy);
    printf("%-22s %-5s %6s %9s %9s %9s %7s\n", "weights (k tile)", "", "stages", "MB", "us", "GB/s",
           "% copy");
    const struct {
        const char *name;
        int row_bytes, step_bytes;
    } cases[] = {
        {"NVFP4 D 7168 (128)", 3584, 64},  {"NVFP4 D 7168 (256)", 3584, 128},
        {"NVFP4 D 7168 (512)", 3584, 256}, {"FP8 D 7168 (128)", 7168, 128},
        {"FP8 D 7168 (256)", 7168, 256},   {"BF16 D 7168 (128)", 14336, 256},
        {"NVFP4 D 2048 (128)", 1024, 64},  {"NVFP4 D 2048 (256)", 1024, 128},
        {"FP8 D 2048 (128)", 2048, 128},   {"BF16 D 2048 (128)", 4096, 256},
    };
    for (const auto &c : cases)
        for (int tiled = 0; tiled < 2; tiled++)
            for (int stages : {4, 8}) {
                const size_t bytes = (size_t)blocks * R * c.row_bytes;
                const int smem = stages * R * c.step_bytes, copies = (int)(buf / bytes);
                auto k = stages == 4 ? rows_kernel<4> : rows_kernel<8>;
                CUDA_CHECK(
                    cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
                k<<<blocks, 128, smem>>>(w, R, c.row_bytes, c.step_bytes, tiled, sink);
                CUDA_CHECK(cudaEventRecord(a));
                for (int i = 0; i < reps; i++)
                    k<<<blocks, 128, smem>>>(w + (i % copies) * bytes, R, c.row_bytes, c.step_bytes,
                                             tiled, sink);
                CUDA_CHECK(cudaEventRecord(b));
                CUDA_CHECK(cudaEventSynchronize(b));
                CUDA_CHECK(cudaGetLastError());
                CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
                const double us = ms * 1e3 / reps, gbs = bytes / (us * 1e-6) / 1e9;
                printf("%-22s %-5s %6d %9.1f %9.1f %9.0f %6.1f%%\n", c.name,
                       tiled ? "tiled" : "rows", stages, bytes / 1e6, us, gbs, 100.0 * gbs / copy);
            }
    return 0;
}
