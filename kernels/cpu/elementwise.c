/* Elementwise ops: silu_mul (the expert and dense FFN activation) and add (residuals). Both are
 * single passes over memory; OpenMP only pays off above a few tens of thousands of elements. */
#include <math.h>

#include "kernels/cpu/cpu_ops.h"

#define ELEMENTWISE_PARALLEL_MIN (1 << 16)

/* out[T, F] = silu(gate[T, F]) * up[T, F], silu(g) = g / (1 + exp(-g)), in fp32. out may equal
 * gate or up. */
void cpu_silu_mul(float *out, const float *gate, const float *up, int T, int F) {
    if (T <= 0) return;
    const int64_t n = (int64_t)T * F;
#pragma omp parallel for schedule(static) if (n >= ELEMENTWISE_PARALLEL_MIN)
    for (int64_t i = 0; i < n; i++)
        out[i] = cpu_silu(gate[i]) * up[i];
}

/* out[n] = a[n] + b[n]; out may equal a. */
void cpu_add(float *out, const float *a, const float *b, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n >= ELEMENTWISE_PARALLEL_MIN)
    for (int64_t i = 0; i < n; i++)
        out[i] = a[i] + b[i];
}
