/* Memory read bandwidth of this machine: OpenMP threads sum a 1 GiB buffer of floats, best of 5.
 * The ceiling for CPU decode, which streams every active weight once per token. */
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define LANES 32

int main(void) {
    const size_t n = (size_t)1 << 28; /* 1 GiB of float */
    float *buf = malloc(n * sizeof(float));
    if (!buf) return 1;
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) buf[i] = (float)(i & 7);
    double best = 1e30, sink = 0;
    for (int rep = 0; rep < 5; rep++) {
        struct timespec a, b;
        clock_gettime(CLOCK_MONOTONIC, &a);
        double s = 0;
#pragma omp parallel reduction(+ : s)
        {
            /* LANES independent sums per thread: the adds vectorize and do not wait on each
             * other, so the loop is bound by memory rather than by add latency. */
            float acc[LANES] = {0};
#pragma omp for schedule(static)
            for (size_t blk = 0; blk < n / LANES; blk++)
                for (int j = 0; j < LANES; j++) acc[j] += buf[blk * LANES + j];
            for (int j = 0; j < LANES; j++) s += acc[j];
        }
        clock_gettime(CLOCK_MONOTONIC, &b);
        double t = (double)(b.tv_sec - a.tv_sec) + 1e-9 * (double)(b.tv_nsec - a.tv_nsec);
        if (t < best) best = t;
        sink += s;
    }
    printf("memory read bandwidth: %.1f GB/s (%d threads, 1 GiB, best of 5; checksum %g)\n",
           (double)(n * sizeof(float)) / best / 1e9, omp_get_max_threads(), sink);
    free(buf);
    return 0;
}
