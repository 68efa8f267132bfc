// How fast one H200 streams a weight matrix in the shapes the wgmma kernels' TMA boxes read it,
// with no arithmetic: the ceiling of a GEMM whose k loop copies those boxes, against a device copy
// of the same bytes measured in the same run.
//
//   build/bench_stream [--mib N] [--reps R]
//
// A pattern is a matrix [rows, row_bytes] (the experts' weights of one layer), read by one block a
// multiprocessor as the swapped kernel reads it: tile t (blocks take t, t + grid, ...) is tile_rows
// consecutive rows, and its k loop copies step_bytes of each row a stage into a ring of stages
// (TMA boxes of box_bytes x at most 256 rows on the stage's full barrier; one warp waits for each
// stage and frees it at once). With b_rows, each stage also copies b_rows rows of an activation
// matrix (boxes of 16 rows), the chunk of tile t / nx: nx column blocks read the same chunk, as the
// swapped kernel's do (from L2 after the first). "contiguous" reads each stage's bytes from one run
// of memory, as weights stored in stage order would be. Each pattern's time is the median of R
// runs; its rate is the matrix's bytes over that time.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/hopper.cuh"
#include "scripts/bench_timing.cuh"

struct pattern {
    const char *name;
    int64_t row_bytes;
    int box_bytes; // 64 or 128: the swizzle of the same width
    int tile_rows, step_bytes, stages;
    bool contiguous;
    int b_rows, nx; // the activations' rows a stage (0: none), column blocks a chunk of them
};

struct stream_args {
    int tiles, steps, tile_rows, step_bytes, box_bytes, box_rows, stages, contiguous;
    int b_rows, nx;
};

__global__ void __launch_bounds__(64, 1)
    stream_kernel(const __grid_constant__ CUtensorMap map, const __grid_constant__ CUtensorMap bmap,
                  const stream_args a) {
#if MOESERVE_WGMMA_DEVICE
    extern __shared__ __align__(16) unsigned char smem_raw[];
    __shared__ __align__(8) uint64_t bars[2 * 16];
    const uint32_t smem0 = ((uint32_t)__cvta_generic_to_shared(smem_raw) + 1023u) & ~1023u;
    const uint32_t bar0 = (uint32_t)__cvta_generic_to_shared(bars);
    const int S = a.stages, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const uint32_t a_bytes = (uint32_t)a.tile_rows * a.step_bytes;
    const uint32_t stage_bytes = a_bytes + (uint32_t)a.b_rows * a.step_bytes;
    if (threadIdx.x == 0) {
        for (int s = 0; s < S; s++) {
            mbar_init(bar0 + 8 * s, 1);
            mbar_init(bar0 + 8 * (16 + s), 1);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    int it = 0;
    for (int t = blockIdx.x; t < a.tiles; t += gridDim.x)
        for (int kb = 0; kb < a.steps; kb++, it++) {
            const int s = it % S, ph = (it / S) & 1;
            if (warp == 0) {
                if (lane == 0) {
                    mbar_wait(bar0 + 8 * (16 + s), ph ^ 1);
                    mbar_arrive_tx(bar0 + 8 * s, stage_bytes);
                    const uint32_t dst = smem0 + s * stage_bytes;
                    int64_t row = (int64_t)t * a.tile_rows;
                    int col = kb * a.step_bytes;
                    if (a.contiguous) { // the stage's rows follow one another
                        row = ((int64_t)t * a.steps + kb) * a.tile_rows;
                        col = 0;
                    }
                    const int nbx = a.step_bytes / a.box_bytes;
                    for (int r = 0; r < a.tile_rows; r += a.box_rows)
                        for (int b = 0; b < nbx; b++)
                            tma_load_2d(dst + (r / a.box_rows * nbx + b) * a.box_rows * a.box_bytes,
                                        &map, col + b * a.box_bytes, (int)(row + r), bar0 + 8 * s);
                    // the chunk's rows (tile t's chunk t / nx), read again by its nx column blocks
                    for (int r = 0; r < a.b_rows; r += 16)
                        for (int b = 0; b < nbx; b++)
                            tma_load_2d(dst + a_bytes + (r / 16 * nbx + b) * 16 * a.box_bytes,
                                        &bmap, col + b * a.box_bytes, t / a.nx * a.b_rows + r,
                                        bar0 + 8 * s);
                }
                __syncwarp();
            } else {
                mbar_wait(bar0 + 8 * s, ph);
                __syncwarp();
                if (lane == 0) mbar_arrive(bar0 + 8 * (16 + s));
            }
        }
#endif
}

int main(int argc, char **argv) {
    int64_t mib = 768; // Qwen3-30B-A3B's gate and up weights of one layer: 768 MiB
    int reps = 15;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--mib") && i + 1 < argc)
            mib = atoll(argv[++i]);
        else if (!strcmp(argv[i], "--reps") && i + 1 < argc)
            reps = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: %s [--mib N] [--reps R]\n", argv[0]);
            return 2;
        }
    }
    int dev = 0, sms = 0, cc = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    CUDA_CHECK(cudaDeviceGetAttribute(&cc, cudaDevAttrComputeCapabilityMajor, dev));
    if (cc != 9) {
        fprintf(stderr, "bench_stream: needs a Hopper device (compute capability 9.x)\n");
        return 1;
    }
    const size_t bytes = (size_t)mib << 20;
    void *src = NULL, *dst = NULL, *bsrc = NULL;
    const size_t b_bytes = (size_t)160 << 20; // the activations' rows
    CUDA_CHECK(cudaMalloc(&src, bytes));
    CUDA_CHECK(cudaMalloc(&bsrc, b_bytes));
    CUDA_CHECK(cudaMemset(bsrc, 1, b_bytes));
    CUDA_CHECK(cudaMalloc(&dst, bytes));
    CUDA_CHECK(cudaMemset(src, 1, bytes));
    double copy_us = 0;
    const double copy = copy_rate(dst, src, bytes, reps, &copy_us);
    printf("device copy of %lld MiB: %.1f us, %.0f GB/s (read + write)\n", (long long)mib, copy_us,
           copy);
    printf("%-44s %10s %9s %8s\n", "pattern (rows x bytes a step, stages)", "us", "GB/s",
           "of copy");
    // GEMM 1 of Qwen3-30B-A3B (rows of 4096 bytes) and GEMM 2 (1536), as the swapped kernel reads
    // them with 4 and 2 A tiles a warpgroup, and the alternatives of the same stage size
    const pattern pats[] = {
        {"k 4096 B: 512 x 64 (NA 4), 5", 4096, 64, 512, 64, 5, false, 0, 1},
        {"k 4096 B: 512 x 64 (NA 4), 6", 4096, 64, 512, 64, 6, false, 0, 1},
        {"k 4096 B: 512 x 64 (NA 4), 3", 4096, 64, 512, 64, 3, false, 0, 1},
        {"k 4096 B: 256 x 128 (NA 2), 4", 4096, 128, 256, 128, 4, false, 0, 1},
        {"k 4096 B: 256 x 128 (NA 2), 6", 4096, 128, 256, 128, 6, false, 0, 1},
        {"k 4096 B: 128 x 256, 6", 4096, 128, 128, 256, 6, false, 0, 1},
        {"k 4096 B: 64 x 512, 6", 4096, 128, 64, 512, 6, false, 0, 1},
        {"k 4096 B: 512 x 128, 3", 4096, 128, 512, 128, 3, false, 0, 1},
        {"k 4096 B: 512 x 64 + 160 rows / 3 (GEMM 1), 5", 4096, 64, 512, 64, 5, false, 160, 3},
        {"k 4096 B: 512 x 64 + 80 rows / 3, 5", 4096, 64, 512, 64, 5, false, 80, 3},
        {"k 1536 B: 256 x 128 (NA 2), 4", 1536, 128, 256, 128, 4, false, 0, 1},
        {"k 1536 B: 256 x 128 (NA 2), 6", 1536, 128, 256, 128, 6, false, 0, 1},
        {"k 1536 B: 256 x 128 + 160 rows / 8 (GEMM 2), 4", 1536, 128, 256, 128, 4, false, 160, 8},
        {"k 1536 B: 256 x 128 + 80 rows / 8, 4", 1536, 128, 256, 128, 4, false, 80, 8},
        {"k 1536 B: 512 x 64 + 160 rows / 4, 5", 1536, 64, 512, 64, 5, false, 160, 4},
        {"contiguous 32 KB stages, 5", 64, 64, 512, 64, 5, true, 0, 1},
        {"contiguous 32 KB stages, 6", 128, 128, 256, 128, 6, true, 0, 1},
    };
    for (const pattern &p : pats) {
        const int64_t rows = (int64_t)bytes / p.row_bytes;
        const int64_t stage = (int64_t)p.tile_rows * p.step_bytes;
        stream_args a = {};
        a.tile_rows = p.tile_rows;
        a.step_bytes = p.step_bytes;
        a.box_bytes = p.box_bytes;
        a.box_rows = std::min(p.tile_rows, 256);
        a.stages = p.stages;
        a.contiguous = p.contiguous;
        a.b_rows = p.b_rows;
        a.nx = p.nx;
        a.steps = p.contiguous ? (int)(4096 / p.step_bytes) : (int)(p.row_bytes / p.step_bytes);
        a.tiles =
            (int)(p.contiguous ? rows / ((int64_t)p.tile_rows * a.steps) : rows / p.tile_rows);
        const CUtensorMap map = tma_map_rows(src, rows, p.row_bytes, a.box_rows, p.box_bytes);
        const int64_t b_rows = (a.tiles / p.nx + 1) * (int64_t)p.b_rows;
        if (b_rows * p.row_bytes > (int64_t)b_bytes) {
            fprintf(stderr, "bench_stream: %s: the rows need more than %zu bytes\n", p.name,
                    b_bytes);
            return 1;
        }
        const CUtensorMap bmap =
            p.b_rows ? tma_map_rows(bsrc, b_rows, p.row_bytes, 16, p.box_bytes) : map;
        const size_t smem = (size_t)p.stages * (stage + (int64_t)p.b_rows * p.step_bytes) + 1024;
        CUDA_CHECK(cudaFuncSetAttribute(stream_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        (int)smem));
        const unsigned grid = (unsigned)std::min(a.tiles, sms);
        const double read = (double)a.tiles * a.steps * stage;
        const float ms = median_ms(reps, [&] {
            stream_kernel<<<grid, 64, smem>>>(map, bmap, a);
            CUDA_CHECK(cudaGetLastError());
        });
        const double gbs = read / (ms * 1e-3) / 1e9;
        printf("%-44s %10.1f %9.0f %7.1f%%\n", p.name, ms * 1e3, gbs, 100.0 * gbs / copy);
    }
    CUDA_CHECK(cudaFree(src));
    CUDA_CHECK(cudaFree(dst));
    CUDA_CHECK(cudaFree(bsrc));
    return 0;
}
