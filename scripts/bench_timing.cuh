// Timing pieces of the device bench programs (scripts/bench_stream.cu, bench_nvfp4_decode.cu):
// CUDA-event times, their median, and a device copy's rate measured the same way.
#ifndef MOESERVE_SCRIPTS_BENCH_TIMING_CUH
#define MOESERVE_SCRIPTS_BENCH_TIMING_CUH

#include <algorithm>
#include <vector>

#include "kernels/cuda/cuda_ops.h"

static float time_ms(cudaEvent_t a, cudaEvent_t b) {
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    return ms;
}

static float median(std::vector<float> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

// The median of reps timed runs of launch() (one untimed run first), ms.
template <class F> static float median_ms(int reps, F &&launch) {
    cudaEvent_t e0, e1;
    CUDA_CHECK(cudaEventCreate(&e0));
    CUDA_CHECK(cudaEventCreate(&e1));
    std::vector<float> t;
    for (int r = 0; r < reps + 1; r++) {
        CUDA_CHECK(cudaEventRecord(e0));
        launch();
        CUDA_CHECK(cudaEventRecord(e1));
        CUDA_CHECK(cudaEventSynchronize(e1));
        if (r) t.push_back(time_ms(e0, e1));
    }
    CUDA_CHECK(cudaEventDestroy(e0));
    CUDA_CHECK(cudaEventDestroy(e1));
    return median(t);
}

// A device-to-device copy of bytes from src to dst: read + write bytes over the median of reps
// copies, GB/s (*us: that median).
static double copy_rate(void *dst, const void *src, size_t bytes, int reps, double *us) {
    const float ms = median_ms(
        reps, [&] { CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice)); });
    if (us) *us = ms * 1e3;
    return 2.0 * bytes / (ms * 1e-3) / 1e9;
}

#endif
