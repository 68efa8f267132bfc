// How many wgmma a multiprocessor issues a cycle at the decode kernels' small N, with the A operand
// from registers (the lean kernels' form) and B through a 128-byte-swizzled descriptor: the
// tensor-side ceiling of a kernel that spends C wgmma on each 64 x 16 block of weights. No
// arithmetic beside them; the sums are written out so that nothing is left out.
//
//   build/bench_wgmma_rate [--iters N]
//
// A case is (N, wgmma a k16 step, warpgroups a block, blocks a multiprocessor): each warpgroup
// issues `iters` k16 steps, each step its wgmma on the same A registers (two: B's two 8-token
// halves, as high precision's hi and lo products), four steps a commit group with one group in
// flight, as the lean kernels do. The rate is wgmma a multiprocessor a cycle (the window from the
// first start to the last end, %globaltimer, times the clock clock64 gives) and the weights a
// multiprocessor a cycle that it allows (64 x 16 a step).
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/hopper.cuh"

// C wgmma of N a k16 step; the B tile (up to 32 rows x 128 bytes, 4 KB) at the smem's start
template <int N, int C>
__global__ void __launch_bounds__(256) rate_kernel(float *out, long long *rec, int iters) {
#if MOESERVE_WGMMA_DEVICE
    extern __shared__ __align__(1024) unsigned char smem[];
    for (int i = threadIdx.x; i < 4096 / 4; i += blockDim.x)
        reinterpret_cast<uint32_t *>(smem)[i] = 0x3f803f80u * (i & 1);
    __syncthreads();
    const uint32_t base = (uint32_t)__cvta_generic_to_shared(smem);
    uint32_t a[4] = {threadIdx.x, threadIdx.x * 3u, threadIdx.x ^ 5u, 7u};
    float d[C][N / 2];
    for (int c = 0; c < C; c++)
        for (int i = 0; i < N / 2; i++)
            d[c][i] = 0.0f;
    long long g0;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g0));
    const long long t0 = clock64();
    for (int it = 0; it < iters; it += 4) {
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
        for (int s = 0; s < 4; s++)
#pragma unroll
            for (int c = 0; c < C; c++)
                wgmma_rs_bf16<N>(d[c], a, wgmma_desc_sw128(base + 32 * s + 1024 * c));
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
        a[0] += 0x00010001u; // the next step's A registers, as a decode would write them
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    const long long t1 = clock64();
    long long g1;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g1));
    float s = 0.0f;
    for (int c = 0; c < C; c++)
        for (int i = 0; i < N / 2; i++)
            s += d[c][i];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
    if (threadIdx.x == 0) {
        rec[3 * blockIdx.x] = t1 - t0;
        rec[3 * blockIdx.x + 1] = g0;
        rec[3 * blockIdx.x + 2] = g1;
    }
#else
    __trap(); // sm_100a: no wgmma (main takes a Hopper device only)
#endif
}

template <int N, int C>
static void run_case(int sms, int wg, int bpsm, int iters, float *out, long long *cyc) {
    auto k = rate_kernel<N, C>;
    const int smem = 8192;
    cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    const int grid = sms * bpsm;
    k<<<grid, 128 * wg, smem>>>(out, cyc, iters); // warm-up
    k<<<grid, 128 * wg, smem>>>(out, cyc, iters);
    if (cudaDeviceSynchronize() != cudaSuccess) {
        printf("N %2d x%d wg %d blocks/SM %d: %s\n", N, C, wg, bpsm,
               cudaGetErrorString(cudaGetLastError()));
        exit(1);
    }
    long long *h = (long long *)malloc(3 * grid * sizeof(long long));
    cudaMemcpy(h, cyc, 3 * grid * sizeof(long long), cudaMemcpyDeviceToHost);
    // the clock from each block's cycles over its nanoseconds (the largest block's), the window
    // from the first block's start to the last one's end: blocks that were not resident together
    // count as they ran
    long long g0 = h[1], g1 = h[2];
    double ghz = 0.0;
    for (int i = 0; i < grid; i++) {
        g0 = h[3 * i + 1] < g0 ? h[3 * i + 1] : g0;
        g1 = h[3 * i + 2] > g1 ? h[3 * i + 2] : g1;
        const double f = (double)h[3 * i] / (double)(h[3 * i + 2] - h[3 * i + 1]);
        ghz = f > ghz ? f : ghz;
    }
    free(h);
    const double sm_cycles = (double)(g1 - g0) * ghz;
    const double per_sm = (double)iters * C * wg * grid / sms / sm_cycles; // wgmma an SM a cycle
    printf("N %2d x%d (%s), %d warpgroup(s) x %d block(s) an SM: %6.1f cycles a wgmma an SM, "
           "%5.1f weights an SM a cycle (%.2f GHz, %.1f us)\n",
           N, C, C == 2 ? "hi and lo" : "one product", wg, bpsm, 1.0 / per_sm, per_sm / C * 64 * 16,
           ghz, (g1 - g0) * 1e-3);
}

int main(int argc, char **argv) {
    int iters = 4096;
    for (int i = 1; i + 1 < argc; i++)
        if (!strcmp(argv[i], "--iters")) iters = atoi(argv[++i]) & ~3;
    cudaDeviceProp p;
    if (cudaGetDeviceProperties(&p, 0) != cudaSuccess || p.major != 9) {
        printf("skipped: needs a Hopper GPU (sm_90a)\n");
        return 0;
    }
    const int sms = p.multiProcessorCount;
    float *out;
    long long *cyc;
    cudaMalloc(&out, (size_t)sms * 8 * 256 * sizeof(float));
    cudaMalloc(&cyc, (size_t)sms * 8 * 3 * sizeof(long long));
    printf("%s, %d SMs, %d k16 steps a warpgroup\n", p.name, sms, iters);
    const int shapes[][2] = {{1, 1}, {1, 2}, {1, 4}, {2, 1}, {2, 2}};
    for (auto &s : shapes) {
        run_case<8, 1>(sms, s[0], s[1], iters, out, cyc);
        run_case<8, 2>(sms, s[0], s[1], iters, out, cyc);
        run_case<16, 1>(sms, s[0], s[1], iters, out, cyc);
        run_case<16, 2>(sms, s[0], s[1], iters, out, cyc);
        run_case<32, 1>(sms, s[0], s[1], iters, out, cyc);
    }
    return 0;
}
