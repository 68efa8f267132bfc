/* The counter-based generator behind sampling: a uniform number from (seed, counter), with no
 * state, so a request's draw at a position is the same whatever else runs, on every backend.
 * Header-only so that the host sampler (runner/sampler.c) and the CUDA sampling kernels
 * (kernels/cuda/sampling.cu) compile the very same bits without kernels/ depending on runner/.
 *
 * counter_rng_bits is splitmix64(seed ^ splitmix64(counter)); its top 53 bits are the draw:
 * counter_rng_uniform = (bits >> 11) / 2^53 in [0, 1). Mixing the counter before xoring in the
 * seed keeps (seed, counter) and (seed ^ d, counter ^ d) apart, which a plain seed ^ counter
 * would merge. */
#ifndef MOESERVE_COUNTER_RNG_H
#define MOESERVE_COUNTER_RNG_H

#include <stdint.h>

#ifdef __CUDACC__
#define COUNTER_RNG_HD __host__ __device__
#else
#define COUNTER_RNG_HD
#endif

#define COUNTER_RNG_GOLDEN 0x9e3779b97f4a7c15ull

/* splitmix64: one step of Steele, Lea and Flood's generator from state x. */
static inline COUNTER_RNG_HD uint64_t counter_rng_splitmix64(uint64_t x) {
    uint64_t z = x + COUNTER_RNG_GOLDEN;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* 64 random bits of (seed, counter); the draw uses the top 53. */
static inline COUNTER_RNG_HD uint64_t counter_rng_bits(uint64_t seed, uint64_t counter) {
    return counter_rng_splitmix64(seed ^ counter_rng_splitmix64(counter));
}

/* A uniform double in [0, 1): the top 53 bits of counter_rng_bits over 2^53. */
static inline COUNTER_RNG_HD double counter_rng_uniform(uint64_t seed, uint64_t counter) {
    return (double)(counter_rng_bits(seed, counter) >> 11) * (1.0 / 9007199254740992.0);
}

#endif
