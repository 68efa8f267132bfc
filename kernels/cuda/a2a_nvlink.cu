/* The GPU all-to-all object (kernels/cuda/a2a_cuda.h) and its one-sided NVLink transport; the
 * kernels serve the nccl transport too (a2a_nccl.cu stages through local buffers instead of
 * peer memory).
 *
 * One round, one-sided, on every rank (segment layout in a2a_cuda_internal.h):
 *   route kernel (1 block)   for each token and each rank owning one of its experts, the row at
 *                            that rank: rows are handed out in token order (a block-wide scan),
 *                            exactly as kernels/a2a.c does, so received rows come in the CPU
 *                            transports' order; then the count line {count, runtime_max} and its
 *                            flag 2N+1 go to every rank (release, system scope), early, before
 *                            any payload: receivers learn their row offsets at once. Small
 *                            rounds (runtime_max <= A2A_FUSED_T, <= 8 ranks) have no route
 *                            kernel: every dispatch block routes the round itself into shared
 *                            memory (block 0 also writes the maps and the count lines), which
 *                            saves a launch and a grid boundary, about 4 us a round.
 *   dispatch kernel          blocks take items: SEND (a chunk of rows for one peer: encode each
 *                            token once per peer from x, store into the peer's receive region,
 *                            then the chunk's flag), SELF (this rank's own rows: the same encoding
 *                            through the local region, decoded into the received arrays), RECV
 *                            (wait for a peer's chunk flag, decode the chunk to fp32). Every block
 *                            first reads all count lines (acquire), checks that every rank used
 *                            the same runtime_max, and knows each source's first row.
 *   combine kernel           SEND (a received chunk's outputs back to its home: the slots this
 *                            rank owns as fp32, or their weighted sum as BF16, then the chunk's
 *                            flag), SELF (own tokens: straight into out, or the partial into the
 *                            local region), RECV (home: wait for a chunk flag, copy the slots /
 *                            sum the partials in rank order into out), FINISH (the last block to
 *                            finish writes the end flag 2N+2 into every rank and advances the
 *                            round; it does not wait: the next route kernel does).
 *
 * Why no more flags are needed: a rank writes into a peer's memory for round N+1 only after its
 * route kernel N+1 (fused: the block that sends there) saw that peer's end flag of round N,
 * which the peer stores once every block of its combine N is past its sends and its gathers,
 * and its combine runs after its dispatch N decode (stream order). The wait sits where it costs
 * least: between one round's combine and the next dispatch the engine runs the rest of the
 * layer. Flag values never repeat (2N+1, 2N+2; the round lives in device memory and advances in
 * the kernel), so CUDA graph replays are new rounds and an equal flag can only be this round's.
 *
 * Ordering: payload stores are plain; each block's stores are followed by __syncthreads, a
 * system fence and a release store of the flag (system scope); the receiver spins with acquire
 * loads and reads the payload through L2 (ld.global.cg), never a stale L1 line. Every spin has
 * a budget (cfg.timeout_s, %globaltimer); on timeout the first block records {peer, wait, round}
 * in mapped host memory, sets the device error word, and every block and later kernel returns.
 * A kernel cannot call cfg.check_peers, so a host thread does (every 100 ms) and, when it names
 * a peer that is gone, sets a word in that mapped memory; a wait that has lasted a millisecond
 * reads it every 64 spins, so a dead peer ends the round in about 0.1 s instead of timeout_s.
 *
 * Co-residency: blocks that wait (RECV) wait for peer blocks that may wait in turn, so every grid
 * is at most what fits on the device at once (occupancy x SMs), and a block does all its SEND
 * and SELF items (which wait for no peer's data) before any RECV item. Grids follow the work: a
 * rank with T = 0 and nothing to receive launches one block per kernel (it still publishes its
 * zero counts and its end flag); with rows to receive, as many as their chunks.
 *
 * Payload encoding mirrors kernels/a2a.c's payload_encode/decode with kernels/quant.h's element
 * conversions (host and device code), the same divisions and products, no fused multiply-add:
 * results equal the CPU transports' bit for bit. The record layout differs (sections 16-byte
 * aligned for vector stores). */
#include "kernels/cuda/a2a_cuda_internal.h"

#include "kernels/quant.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define A2A_DEFAULT_TIMEOUT_S 30.0

int a2a_gpu_errf(char *err, size_t errlen, const char *fmt, ...) {
    if (err && errlen) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, errlen, fmt, ap);
        va_end(ap);
    }
    return -1;
}

int a2a_gpu_cuda_fail(char *err, size_t errlen, int rank, const char *what, cudaError_t e) {
    return a2a_gpu_errf(err, errlen, "all-to-all rank %d: %s failed: %s", rank, what,
                        cudaGetErrorString(e));
}

/* ---- device helpers ---- */

__device__ __forceinline__ unsigned long long ld_acquire_sys(const unsigned long long *p) {
    unsigned long long v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void st_release_sys(unsigned long long *p, unsigned long long v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ unsigned long long globaltimer() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
/* Optional timeline (MOESERVE_A2A_TRACE=1): %globaltimer at fixed points of a round. */
__device__ __forceinline__ void trace(const a2a_kp &p, int point) {
    if (p.trace) p.trace[point] = globaltimer();
}

__device__ __forceinline__ void pdl_wait_() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_trigger_() {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}
__device__ __forceinline__ int broken(const a2a_kp &p) { return *(volatile int *)&p.st->err; }
/* The rank that owns expert id (in range): id / (E / ep) where the split is even, else the
 * table. */
__device__ __forceinline__ int owner_of(const a2a_kp &p, int id) {
    return p.eper ? id / p.eper : __ldg(p.owner + id);
}

/* Record the object's first error (later ones are dropped). */
__device__ void raise_error(const a2a_kp &p, int code, int peer, int where, int a, int b, int c,
                            unsigned long long round) {
    if (atomicCAS(&p.st->err, 0, code) != 0) return;
    volatile a2a_gpu_err *e = p.herr;
    e->peer = peer;
    e->where = where;
    e->a = a;
    e->b = b;
    e->c = c;
    e->round = round;
    __threadfence_system();
    e->code = code;
    __threadfence_system();
}

/* One thread spins until *flag == v; false on timeout (recorded, naming peer) or an error. */
__device__ bool wait_flag(const a2a_kp &p, const unsigned long long *flag, unsigned long long v,
                          int peer, int where, unsigned long long round) {
    if (ld_acquire_sys(flag) == v) return true;
    const unsigned long long t0 = globaltimer();
    for (int i = 0;; i++) {
        if (ld_acquire_sys(flag) == v) return true;
        if ((i & 63) == 63) {
            if (broken(p)) return false;
            const unsigned long long waited = globaltimer() - t0;
            if (waited > p.timeout_ns) {
                raise_error(p, A2A_GPU_E_TIMEOUT, peer, where, 0, 0, 0, round);
                return false;
            }
            /* the host's word, over PCIe: only once the wait is already long */
            if (waited > 1000000ull && *(volatile int *)&p.herr->peer_gone) {
                raise_error(p, A2A_GPU_E_PEER_GONE, peer, where, 0, 0, 0, round);
                return false;
            }
        }
    }
}

/* One thread: rank r has ended round - 1 (its combine end flag 2 round is in this rank's
 * segment), so this round may write into r's memory. */
__device__ bool wait_peer_ended(const a2a_kp &p, int r, unsigned long long round) {
    return wait_flag(
        p, (const unsigned long long *)(p.peer[p.me] + p.off_cdone + (size_t)r * A2A_GPU_LINE),
        2 * round, r, A2A_GPU_W_COMBINE_END, round);
}

__device__ __forceinline__ uint16_t bf16_rne(float f) {
    uint32_t u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
__device__ __forceinline__ float bf16_f32(uint32_t h) { return __uint_as_float(h << 16); }
__device__ __forceinline__ float bf16_round(float f) { return bf16_f32(bf16_rne(f)); }
__device__ __forceinline__ uint32_t bf16x2(float a, float b) {
    return bf16_rne(a) | (uint32_t)bf16_rne(b) << 16;
}
__device__ __forceinline__ float amax_acc(float m, float x) {
    float a = fabsf(x);
    return a > m ? a : m; /* NaN never wins, as kernels/cpu/quant.c's amax_of */
}
__device__ __forceinline__ float amax4(float m, float4 v) {
    return amax_acc(amax_acc(amax_acc(amax_acc(m, v.x), v.y), v.z), v.w);
}
__device__ __forceinline__ float warp_max(float m) {
    for (int o = 16; o > 0; o >>= 1) {
        float y = __shfl_xor_sync(0xffffffffu, m, o);
        m = y > m ? y : m;
    }
    return m;
}
__device__ __forceinline__ int cdiv(int a, int b) { return (a + b - 1) / b; }

/* Work is spread over the block's threads as flat "units" (a row and 8 or 16 of its channels,
 * or a row and a slot); each thread loads A2A_UNR units before it stores any, so loads from
 * HBM overlap instead of waiting one by one. Rows go A2A_SUB at a time, their metadata in
 * shared memory. */
#define A2A_UNR 4
#define A2A_SUB 32

typedef struct {
    int tok[A2A_SUB];               /* token (or row) of each row of the sub-chunk */
    int ids[A2A_SUB][A2A_GPU_KMAX]; /* local ids of the rows' slots (or a slot mask) */
    float w[A2A_SUB][A2A_GPU_KMAX];
    int nr[A2A_SUB];               /* partial gather: ranks of each token, in rank order, */
    int rr[A2A_SUB][A2A_GPU_KMAX]; /* and the token's row there */
    int rj[A2A_SUB][A2A_GPU_KMAX];
    float amax[A2A_SUB]; /* NVFP4: each row's amax */
    float red[32];
    float lut[256]; /* E4M3 code -> value */
    int send[A2A_MAX_RANKS], count[A2A_MAX_RANKS], begin[A2A_MAX_RANKS + 1];
    unsigned long long seen[A2A_MAX_RANKS];
    int ok;
} a2a_smem;

/* NVFP4: s.amax[row] = max |x| of token s.tok[row] (NaN never wins). Block-wide. */
__device__ void rows_amax(const a2a_kp &p, a2a_smem &s, int R) {
    const int D4 = p.D / 4, tid = threadIdx.x, nt = blockDim.x, lane = tid & 31, warp = tid >> 5,
              nw = nt >> 5;
    if (R < nw) { /* few rows: the whole block on each */
        for (int row = 0; row < R; row++) {
            const float4 *x = (const float4 *)(p.x + (size_t)s.tok[row] * p.D);
            float m = 0.0f;
            for (int u0 = tid; u0 < D4; u0 += nt * A2A_UNR) {
                float4 v[A2A_UNR];
#pragma unroll
                for (int q = 0; q < A2A_UNR; q++)
                    if (u0 + q * nt < D4) v[q] = x[u0 + q * nt];
#pragma unroll
                for (int q = 0; q < A2A_UNR; q++)
                    if (u0 + q * nt < D4) m = amax4(m, v[q]);
            }
            m = warp_max(m);
            if (lane == 0) s.red[warp] = m;
            __syncthreads();
            if (tid == 0) {
                float a = 0.0f;
                for (int i = 0; i < nw; i++)
                    a = s.red[i] > a ? s.red[i] : a;
                s.amax[row] = a;
            }
            __syncthreads();
        }
    } else { /* a warp per row */
        for (int row = warp; row < R; row += nw) {
            const float4 *x = (const float4 *)(p.x + (size_t)s.tok[row] * p.D);
            float m = 0.0f;
            for (int u0 = lane; u0 < D4; u0 += 32 * A2A_UNR) {
                float4 v[A2A_UNR];
#pragma unroll
                for (int q = 0; q < A2A_UNR; q++)
                    if (u0 + q * 32 < D4) v[q] = x[u0 + q * 32];
#pragma unroll
                for (int q = 0; q < A2A_UNR; q++)
                    if (u0 + q * 32 < D4) m = amax4(m, v[q]);
            }
            m = warp_max(m);
            if (lane == 0) s.amax[row] = m;
        }
        __syncthreads();
    }
}

/* Block-wide: R tokens s.tok[0..R) for target rank r. SELF = false: encode each into its record
 * at rec0 + row * rec (codes | scales | ids | w). SELF = true: this rank's own tokens, the same
 * round trip in registers, decoded into received rows out0 + row. */
template <bool SELF, bool FUSED>
__device__ void encode_rows(const a2a_kp &p, a2a_smem &s, int R, char *rec0, int out0, int r) {
    const int D = p.D, K = p.K, tid = threadIdx.x, nt = blockDim.x;
    const int begin = p.ebegin[r]; /* requested before the payload's loads, not after them */
    switch (p.payload) {
    case A2A_PAYLOAD_F32:
    case A2A_PAYLOAD_BF16: {
        const bool bf = p.payload == A2A_PAYLOAD_BF16;
        const int upr = D / 8, U = R * upr;
        for (int u0 = tid; u0 < U; u0 += nt * A2A_UNR) {
            float4 a[A2A_UNR], b[A2A_UNR];
#pragma unroll
            for (int q = 0; q < A2A_UNR; q++) {
                const int u = u0 + q * nt;
                if (u >= U) break;
                const int row = u / upr, c = (u - row * upr) * 8;
                const float4 *x = (const float4 *)(p.x + (size_t)s.tok[row] * D + c);
                a[q] = x[0];
                b[q] = x[1];
            }
#pragma unroll
            for (int q = 0; q < A2A_UNR; q++) {
                const int u = u0 + q * nt;
                if (u >= U) break;
                const int row = u / upr, c = (u - row * upr) * 8;
                if (SELF) {
                    float4 *y = (float4 *)(p.rx + (size_t)(out0 + row) * D + c);
                    if (bf) {
                        y[0] = make_float4(bf16_round(a[q].x), bf16_round(a[q].y),
                                           bf16_round(a[q].z), bf16_round(a[q].w));
                        y[1] = make_float4(bf16_round(b[q].x), bf16_round(b[q].y),
                                           bf16_round(b[q].z), bf16_round(b[q].w));
                    } else {
                        y[0] = a[q];
                        y[1] = b[q];
                    }
                } else {
                    char *rec = rec0 + (size_t)row * p.rec;
                    if (bf) {
                        *(uint4 *)(rec + (size_t)c * 2) =
                            make_uint4(bf16x2(a[q].x, a[q].y), bf16x2(a[q].z, a[q].w),
                                       bf16x2(b[q].x, b[q].y), bf16x2(b[q].z, b[q].w));
                    } else {
                        float4 *o = (float4 *)(rec + (size_t)c * 4);
                        o[0] = a[q];
                        o[1] = b[q];
                    }
                }
            }
        }
        break;
    }
    case A2A_PAYLOAD_FP8: { /* a warp per (row, group of 128 channels) */
        const int lane = tid & 31, warp = tid >> 5, nw = nt >> 5;
        const int G = cdiv(D, QUANT_FP8_GROUP), W = R * G;
        for (int w0 = warp; w0 < W; w0 += nw * 2) {
            float4 v[2];
#pragma unroll
            for (int q = 0; q < 2; q++) {
                const int wu = w0 + q * nw, row = wu / G,
                          c = (wu - row * G) * QUANT_FP8_GROUP + lane * 4;
                v[q] = wu < W && c < D ? *(const float4 *)(p.x + (size_t)s.tok[row] * D + c)
                                       : make_float4(0.f, 0.f, 0.f, 0.f);
            }
#pragma unroll
            for (int q = 0; q < 2; q++) {
                const int wu = w0 + q * nw;
                if (wu >= W) break; /* warp-uniform */
                const int row = wu / G, g = wu - row * G, c = g * QUANT_FP8_GROUP + lane * 4;
                const float m = warp_max(amax4(0.0f, v[q]));
                const float sc = (m > 1e-10f ? m : 1e-10f) / FP8_E4M3_MAX;
                const uint8_t c0 = fp8_e4m3_from_float(v[q].x / sc),
                              c1 = fp8_e4m3_from_float(v[q].y / sc),
                              c2 = fp8_e4m3_from_float(v[q].z / sc),
                              c3 = fp8_e4m3_from_float(v[q].w / sc);
                if (c >= D) continue;
                if (SELF) {
                    *(float4 *)(p.rx + (size_t)(out0 + row) * D + c) =
                        make_float4(__fmul_rn(s.lut[c0], sc), __fmul_rn(s.lut[c1], sc),
                                    __fmul_rn(s.lut[c2], sc), __fmul_rn(s.lut[c3], sc));
                } else {
                    char *rec = rec0 + (size_t)row * p.rec;
                    *(uint32_t *)(rec + c) =
                        (uint32_t)c0 | (uint32_t)c1 << 8 | (uint32_t)c2 << 16 | (uint32_t)c3 << 24;
                    if (lane == 0) *(float *)(rec + p.off_sc + g * 4) = sc;
                }
            }
        }
        break;
    }
    case A2A_PAYLOAD_NVFP4: {
        rows_amax(p, s, R);
        const int gpr = D / QUANT_FP4_GROUP, U = R * gpr;
        for (int u0 = tid; u0 < U; u0 += nt * 2) {
            float4 v[2][4];
#pragma unroll
            for (int q = 0; q < 2; q++) {
                const int u = u0 + q * nt;
                if (u >= U) break;
                const int row = u / gpr, g = u - row * gpr;
                const float4 *x = (const float4 *)(p.x + (size_t)s.tok[row] * D + g * 16);
#pragma unroll
                for (int i = 0; i < 4; i++)
                    v[q][i] = x[i];
            }
#pragma unroll
            for (int q = 0; q < 2; q++) {
                const int u = u0 + q * nt;
                if (u >= U) break;
                const int row = u / gpr, g = u - row * gpr;
                const float a = s.amax[row];
                const float s2 = a > 0.0f ? a / (FP4_E2M1_MAX * FP8_E4M3_MAX) : 1.0f;
                const float e[16] = {v[q][0].x, v[q][0].y, v[q][0].z, v[q][0].w,
                                     v[q][1].x, v[q][1].y, v[q][1].z, v[q][1].w,
                                     v[q][2].x, v[q][2].y, v[q][2].z, v[q][2].w,
                                     v[q][3].x, v[q][3].y, v[q][3].z, v[q][3].w};
                float am = 0.0f;
#pragma unroll
                for (int i = 0; i < 16; i++)
                    am = amax_acc(am, e[i]);
                const uint8_t code = fp8_e4m3_from_float(am / (FP4_E2M1_MAX * s2));
                const float sfv = s.lut[code], scale = sfv * s2;
                uint32_t nib[16];
#pragma unroll
                for (int i = 0; i < 16; i++)
                    nib[i] = scale > 0.0f ? fp4_e2m1_from_float(e[i] / scale) : 0;
                if (SELF) {
                    float y[16];
#pragma unroll
                    for (int i = 0; i < 16; i++)
                        y[i] = __fmul_rn(__fmul_rn(fp4_e2m1_to_float((uint8_t)nib[i]), sfv), s2);
                    float4 *o = (float4 *)(p.rx + (size_t)(out0 + row) * D + g * 16);
#pragma unroll
                    for (int i = 0; i < 4; i++)
                        o[i] = make_float4(y[4 * i], y[4 * i + 1], y[4 * i + 2], y[4 * i + 3]);
                } else {
                    char *rec = rec0 + (size_t)row * p.rec;
                    uint32_t lo = 0, hi = 0;
#pragma unroll
                    for (int i = 0; i < 8; i++) {
                        lo |= nib[i] << (4 * i);
                        hi |= nib[8 + i] << (4 * i);
                    }
                    *(uint2 *)(rec + g * 8) = make_uint2(lo, hi);
                    rec[p.off_sc + g] = (char)code;
                    if (g == 0) *(float *)(rec + p.off_s2) = s2;
                }
            }
        }
        break;
    }
    }
    /* each slot's owner: the route kernel's (no chain of loads), or, routed in this kernel
     * (FUSED: block 0 writes slot_rank while the others run), from the id */
    for (int u = tid; u < R * K; u += nt) {
        const int row = u / K, k = u - row * K, t = s.tok[row];
        const int id = p.ids[(size_t)t * K + k];
        const float w = p.w[(size_t)t * K + k];
        const bool in = id >= 0 && id < p.E;
        const int owner = !in ? -1 : FUSED ? owner_of(p, id) : p.slot_rank[(size_t)t * K + k];
        const bool own = in && owner == r;
        const int lid = own ? id - begin : -1;
        if (SELF) {
            p.rids[(size_t)(out0 + row) * K + k] = lid;
            p.rw[(size_t)(out0 + row) * K + k] = w;
        } else {
            char *rec = rec0 + (size_t)row * p.rec;
            ((int32_t *)(rec + p.off_ids))[k] = lid;
            ((float *)(rec + p.off_w))[k] = w;
        }
    }
}

/* Block-wide: R records at rec0 + row * rec -> received rows out0 + row (fp32 x, ids, w). Reads
 * through L2 (ld.global.cg): a peer wrote them. */
__device__ void decode_rows(const a2a_kp &p, const a2a_smem &s, int R, const char *rec0, int out0) {
    const int D = p.D, K = p.K, tid = threadIdx.x, nt = blockDim.x;
    switch (p.payload) {
    case A2A_PAYLOAD_F32:
    case A2A_PAYLOAD_BF16:
    case A2A_PAYLOAD_FP8: {
        const int upr = D / 8, U = R * upr, pl = p.payload;
        for (int u0 = tid; u0 < U; u0 += nt * A2A_UNR) {
            uint4 a[A2A_UNR], b[A2A_UNR];
            float sc[A2A_UNR];
#pragma unroll
            for (int q = 0; q < A2A_UNR; q++) {
                const int u = u0 + q * nt;
                if (u >= U) break;
                const int row = u / upr, c = (u - row * upr) * 8;
                const char *rec = rec0 + (size_t)row * p.rec;
                if (pl == A2A_PAYLOAD_F32) {
                    a[q] = __ldcg((const uint4 *)(rec + (size_t)c * 4));
                    b[q] = __ldcg((const uint4 *)(rec + (size_t)c * 4 + 16));
                } else if (pl == A2A_PAYLOAD_BF16) {
                    a[q] = __ldcg((const uint4 *)(rec + (size_t)c * 2));
                } else {
                    uint2 cc = __ldcg((const uint2 *)(rec + c));
                    a[q] = make_uint4(cc.x, cc.y, 0, 0);
                    sc[q] = __ldcg((const float *)(rec + p.off_sc) + c / QUANT_FP8_GROUP);
                }
            }
#pragma unroll
            for (int q = 0; q < A2A_UNR; q++) {
                const int u = u0 + q * nt;
                if (u >= U) break;
                const int row = u / upr, c = (u - row * upr) * 8;
                float4 *y = (float4 *)(p.rx + (size_t)(out0 + row) * D + c);
                if (pl == A2A_PAYLOAD_F32) {
                    y[0] = make_float4(__uint_as_float(a[q].x), __uint_as_float(a[q].y),
                                       __uint_as_float(a[q].z), __uint_as_float(a[q].w));
                    y[1] = make_float4(__uint_as_float(b[q].x), __uint_as_float(b[q].y),
                                       __uint_as_float(b[q].z), __uint_as_float(b[q].w));
                } else if (pl == A2A_PAYLOAD_BF16) {
                    y[0] = make_float4(bf16_f32(a[q].x & 0xffff), bf16_f32(a[q].x >> 16),
                                       bf16_f32(a[q].y & 0xffff), bf16_f32(a[q].y >> 16));
                    y[1] = make_float4(bf16_f32(a[q].z & 0xffff), bf16_f32(a[q].z >> 16),
                                       bf16_f32(a[q].w & 0xffff), bf16_f32(a[q].w >> 16));
                } else {
                    const uint32_t lo = a[q].x, hi = a[q].y;
                    const float f = sc[q];
                    y[0] = make_float4(
                        __fmul_rn(s.lut[lo & 255], f), __fmul_rn(s.lut[(lo >> 8) & 255], f),
                        __fmul_rn(s.lut[(lo >> 16) & 255], f), __fmul_rn(s.lut[lo >> 24], f));
                    y[1] = make_float4(
                        __fmul_rn(s.lut[hi & 255], f), __fmul_rn(s.lut[(hi >> 8) & 255], f),
                        __fmul_rn(s.lut[(hi >> 16) & 255], f), __fmul_rn(s.lut[hi >> 24], f));
                }
            }
        }
        break;
    }
    case A2A_PAYLOAD_NVFP4: {
        const int gpr = D / QUANT_FP4_GROUP, U = R * gpr;
        for (int u0 = tid; u0 < U; u0 += nt * A2A_UNR) {
            uint2 cc[A2A_UNR];
            uint8_t sf[A2A_UNR];
            float s2[A2A_UNR];
#pragma unroll
            for (int q = 0; q < A2A_UNR; q++) {
                const int u = u0 + q * nt;
                if (u >= U) break;
                const int row = u / gpr, g = u - row * gpr;
                const char *rec = rec0 + (size_t)row * p.rec;
                cc[q] = __ldcg((const uint2 *)(rec + g * 8));
                sf[q] = (uint8_t)__ldcg((const signed char *)(rec + p.off_sc + g));
                s2[q] = __ldcg((const float *)(rec + p.off_s2));
            }
#pragma unroll
            for (int q = 0; q < A2A_UNR; q++) {
                const int u = u0 + q * nt;
                if (u >= U) break;
                const int row = u / gpr, g = u - row * gpr;
                const float sfv = s.lut[sf[q]];
                float y[16];
#pragma unroll
                for (int e = 0; e < 16; e++) {
                    const uint32_t nib = ((e < 8 ? cc[q].x : cc[q].y) >> (4 * (e & 7))) & 15;
                    /* e2m1 x e4m3 is exact; one rounding, by s2 (as dequant_nvfp4) */
                    y[e] = __fmul_rn(__fmul_rn(fp4_e2m1_to_float((uint8_t)nib), sfv), s2[q]);
                }
                float4 *o = (float4 *)(p.rx + (size_t)(out0 + row) * D + g * 16);
#pragma unroll
                for (int i = 0; i < 4; i++)
                    o[i] = make_float4(y[4 * i], y[4 * i + 1], y[4 * i + 2], y[4 * i + 3]);
            }
        }
        break;
    }
    }
    for (int u = tid; u < R * K; u += nt) {
        const int row = u / K, k = u - row * K;
        const char *rec = rec0 + (size_t)row * p.rec;
        p.rids[(size_t)(out0 + row) * K + k] = __ldcg((const int *)(rec + p.off_ids) + k);
        p.rw[(size_t)(out0 + row) * K + k] = __ldcg((const float *)(rec + p.off_w) + k);
    }
}

/* ---- route ---- */

/* Block-wide exclusive scan of 8 bits per thread (bit q of m: this thread's token goes to rank
 * group member q): pre[q] = how many lower threads have bit q, tot[q] = how many have it in all.
 * Ballots count within a warp, one warp scans the warps' counts (the 8 chains interleaved), so
 * the dependent steps are few: a thread-per-counter shuffle scan cost about 2 us here. */
__device__ void block_scan_bits8(unsigned m, int pre[8], int tot[8], int (*s_w)[8]) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    unsigned b[8];
#pragma unroll
    for (int q = 0; q < 8; q++)
        b[q] = __ballot_sync(0xffffffffu, (m >> q) & 1u);
#pragma unroll
    for (int q = 0; q < 8; q++)
        if (lane == q) s_w[warp][q] = __popc(b[q]);
    __syncthreads();
    if (warp == 0) {
        int x[8];
#pragma unroll
        for (int q = 0; q < 8; q++)
            x[q] = lane < nw ? s_w[lane][q] : 0;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1)
#pragma unroll
            for (int q = 0; q < 8; q++) {
                const int y = __shfl_up_sync(0xffffffffu, x[q], o);
                if (lane >= o) x[q] += y;
            }
        if (lane < nw)
#pragma unroll
            for (int q = 0; q < 8; q++)
                s_w[lane][q] = x[q];
    }
    __syncthreads();
    const unsigned below = (1u << lane) - 1u;
#pragma unroll
    for (int q = 0; q < 8; q++) {
        pre[q] = (warp > 0 ? s_w[warp - 1][q] : 0) + __popc(b[q] & below);
        tot[q] = s_w[nw - 1][q];
    }
    __syncthreads();
}

/* Routing of a round by one block of NT threads, tokens a pass of P at a time (P <= NT). A warp
 * takes 32 / K tokens at once, a lane a slot: the owner rank of every slot, kept in registers
 * for the pass. Then for each group of 8 ranks: each token's set of ranks in the group
 * (shared-memory OR: a token goes to a rank once), a ballot scan of the sets over the block, rows
 * handed out in token order after the rows of the earlier passes (as kernels/a2a.c does), and
 * every slot takes its token's row at its rank. Loads come first and nothing waits on a global
 * load inside the loops (an earlier thread-per-run-of-tokens version waited on them one slot at
 * a time: 41 us at 2048 tokens, 6 us at one). rs.base[r] ends as the count for rank r. With glob
 * the slot maps and the inverse map row -> token go to global memory (p.slot_rank,
 * p.slot_index, p.inv: what the dispatch and combine kernels read); with inv (ep <= 8 and
 * runtime_max <= A2A_FUSED_T) the inverse map also goes to shared memory. */
template <int NT> struct a2a_route_smem {
    int w[32][8], row[NT][8], base[A2A_MAX_RANKS];
    unsigned m[NT];
};
template <int NT, int IT> /* IT: token groups a warp takes per pass */
__device__ void route_block(const a2a_kp &p, unsigned long long round, bool glob,
                            a2a_route_smem<NT> &rs, short (*inv)[A2A_FUSED_T]) {
    const int T = p.T, K = p.K, ep = p.ep, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5,
              nw = NT >> 5;
    const int tpw = 32 / K, lt = lane / K, k = lane - lt * K;
    const int P = min(NT, nw * tpw * IT);
    if (glob && tid == 0) trace(p, A2A_TR_ROUTE);
    for (int r = tid; r < ep; r += NT)
        rs.base[r] = 0;
    for (int t0 = 0; t0 < T; t0 += P) {
        int id[IT], rk[IT];
#pragma unroll
        for (int q = 0; q < IT; q++) {
            const int j = (q * nw + warp) * tpw + lt, t = t0 + j;
            id[q] = lt < tpw && j < P && t < T ? p.ids[(size_t)t * K + k] : 0;
        }
#pragma unroll
        for (int q = 0; q < IT; q++) {
            const int j = (q * nw + warp) * tpw + lt, t = t0 + j;
            rk[q] = -1;
            if (!(lt < tpw && j < P && t < T)) continue;
            if (id[q] < 0 || id[q] >= p.E) {
                if (glob) raise_error(p, A2A_GPU_E_EXPERT, p.me, 0, t, k, id[q], round);
                id[q] = 0;
            }
            rk[q] = owner_of(p, id[q]);
            if (glob) p.slot_rank[(size_t)t * K + k] = rk[q];
        }
        for (int rg = 0; rg < ep; rg += 8) {
            if (tid < P) rs.m[tid] = 0;
            __syncthreads();
#pragma unroll
            for (int q = 0; q < IT; q++) {
                const unsigned d = (unsigned)(rk[q] - rg);
                if (rk[q] >= 0 && d < 8) atomicOr(&rs.m[(q * nw + warp) * tpw + lt], 1u << d);
            }
            __syncthreads();
            const unsigned m = tid < P ? rs.m[tid] : 0u;
            int cnt[8], tot[8];
            block_scan_bits8(m, cnt, tot, rs.w);
#pragma unroll
            for (int q = 0; q < 8; q++)
                if ((m >> q) & 1u) {
                    const int row = rs.base[rg + q] + cnt[q];
                    rs.row[tid][q] = row;
                    if (glob) p.inv[(size_t)(rg + q) * p.M + row] = t0 + tid;
                    if (inv) inv[q][row] = (short)(t0 + tid);
                }
            __syncthreads();
#pragma unroll
            for (int q = 0; q < 8; q++)
                if (tid == q && rg + q < ep) rs.base[rg + q] += tot[q];
            if (glob)
#pragma unroll
                for (int q = 0; q < IT; q++) {
                    const int j = (q * nw + warp) * tpw + lt;
                    const unsigned d = (unsigned)(rk[q] - rg);
                    if (rk[q] >= 0 && d < 8) p.slot_index[(size_t)(t0 + j) * K + k] = rs.row[j][d];
                }
        }
    }
    __syncthreads();
    if (glob && tid == 0) trace(p, A2A_TR_ROUTE_SCANNED);
}

/* This rank's counts (base[r]: tokens for rank r) into its state and, one-sided, its count
 * line into every rank, before any payload: receivers learn their row offsets early. Nothing
 * of this round goes into rank r's memory before r has ended the previous round (its combine
 * end flag, 2N): by then it has read everything of that round. nccl: the lines NCCL sends.
 * Per thread (thread r takes rank r): false where a wait failed (the error is recorded). */
__device__ bool publish_counts(const a2a_kp &p, unsigned long long round, const int *base) {
    const unsigned long long v = 2 * round + 1;
    bool ok = true;
    for (int r = threadIdx.x; r < p.ep; r += blockDim.x) {
        const int c = base[r];
        p.st->send[r] = c;
        if (p.one_sided) {
            if (ok && !wait_peer_ended(p, r, round)) ok = false;
            if (!ok) continue;
            a2a_gpu_count_line *line =
                (a2a_gpu_count_line *)(p.peer[r] + p.off_count + (size_t)p.me * A2A_GPU_LINE);
            line->count = c;
            line->runtime_max = p.rm;
            st_release_sys(&line->flag, v);
            if (r == 0) trace(p, A2A_TR_ROUTE_END);
        } else {
            p.cnt_out[r].count = c;
            p.cnt_out[r].runtime_max = p.rm;
            p.cnt_out[r].flag = v;
        }
    }
    return ok;
}

/* The route kernel (one block): route_block, then the counts. The dispatch kernel does the same
 * itself where the round is small (kp.fused). */
__global__ void __launch_bounds__(A2A_GPU_ROUTE_THREADS) a2a_route_kernel(a2a_kp p) {
    pdl_trigger_(); /* the dispatch kernel may launch now; it waits for this one to finish */
    __shared__ a2a_route_smem<A2A_GPU_ROUTE_THREADS> rs;
    if (broken(p)) return;
    const unsigned long long round = p.st->round;
    route_block<A2A_GPU_ROUTE_THREADS, 8>(p, round, true, rs, nullptr);
    publish_counts(p, round, rs.base);
}

/* ---- dispatch ---- */

/* Item i of the list: ranks me+1, me+2, ... (mod ep), each cdiv(count[r], ch) chunks. Returns
 * the rank, or -1 past the end; *c = the chunk. */
__device__ int nth_item(const a2a_kp &p, const int *count, int i, int *c) {
    for (int q = 1; q < p.ep; q++) {
        const int r = (p.me + q) % p.ep, n = cdiv(count[r], p.ch);
        if (i < n) {
            *c = i;
            return r;
        }
        i -= n;
    }
    return -1;
}

/* The SEND and SELF items of a block list, interleaved (send 0, self 0, send 1, self 1, ...) so
 * the link (SEND) and local memory (SELF) work at once; *send says which, the index returned. No
 * item of this list waits for a peer's data, so a block never holds a send back behind a wait. */
__device__ __forceinline__ int mixed_item(int it, int n_send, int n_self, bool *send) {
    const int m = min(n_send, n_self);
    if (it < 2 * m) {
        *send = !(it & 1);
        return it >> 1;
    }
    *send = n_send > n_self;
    return it - m;
}

/* All count lines of this round: every rank's count for me and its runtime_max. Block-wide;
 * false when the round cannot go on (the error is recorded). */
__device__ bool read_counts(const a2a_kp &p, unsigned long long round, a2a_smem &s) {
    const unsigned long long v = 2 * round + 1;
    if (threadIdx.x == 0) {
        int ok = 1, sum = 0;
        for (int q = 0; q < p.ep && ok; q++) {
            const a2a_gpu_count_line *line =
                (const a2a_gpu_count_line *)(p.cnt_base + (size_t)q * p.cnt_stride);
            if (p.one_sided && !wait_flag(p, &line->flag, v, q, A2A_GPU_W_DISPATCH, round)) {
                ok = 0;
                break;
            }
            const int c = __ldcg(&line->count), rm = __ldcg(&line->runtime_max);
            if (rm != p.rm) {
                raise_error(p, A2A_GPU_E_RUNTIME_MAX, q, 0, rm, p.rm, 0, round);
                ok = 0;
            } else if (c < 0 || c > p.rm) {
                raise_error(p, A2A_GPU_E_COUNT, q, 0, c, p.rm, 0, round);
                ok = 0;
            }
            s.count[q] = c;
            s.begin[q] = sum;
            sum += c;
        }
        s.begin[p.ep] = sum;
        s.ok = ok;
    }
    __syncthreads();
    return s.ok;
}

/* FUSED (kp.fused): every block routes the round itself (two instances, so that the routing's
 * registers do not weigh on the unfused kernel's loops). */
template <bool FUSED>
__global__ void __launch_bounds__(A2A_GPU_THREADS, 2) a2a_dispatch_kernel(a2a_kp p) {
    __shared__ a2a_smem s;
    __shared__ a2a_route_smem<FUSED ? A2A_GPU_THREADS : 1> rs;
    __shared__ short s_inv[FUSED ? 8 : 1][A2A_FUSED_T]; /* rank r's row -> token */
    pdl_wait_();
    if (broken(p)) return;
    const int tid = threadIdx.x, me = p.me, ch = p.ch, G = gridDim.x;
    const unsigned long long round = p.st->round, v = 2 * round + 1;
    for (int i = tid; i < 256; i += blockDim.x)
        s.lut[i] = fp8_e4m3_to_float((uint8_t)i);
    if constexpr (FUSED) { /* every block routes the round; block 0 also publishes it */
        route_block<A2A_GPU_THREADS, 4>(p, round, blockIdx.x == 0, rs, s_inv);
        const bool ok = blockIdx.x == 0 ? publish_counts(p, round, rs.base) : true;
        if (!__syncthreads_and(ok)) return;
        for (int r = tid; r < p.ep; r += blockDim.x)
            s.send[r] = rs.base[r];
    } else {
        for (int r = tid; r < p.ep; r += blockDim.x)
            s.send[r] = p.st->send[r];
    }
    __syncthreads();
    unsigned waited = blockIdx.x == 0 ? ~0u : 0u; /* fused: peers whose end flag this block saw */

    /* SEND and SELF items interleaved, one list over the blocks (mixed_item) */
    const int n_self = (p.roles & A2A_GPU_SELF) ? cdiv(s.send[me], ch) : 0;
    int n_send = 0;
    if (p.roles & A2A_GPU_SEND)
        for (int q = 1; q < p.ep; q++)
            n_send += cdiv(s.send[(me + q) % p.ep], ch);
    bool have_counts = false;
    if (blockIdx.x == 0 && tid == 0) trace(p, A2A_TR_DISPATCH);
    for (int it = blockIdx.x; it < n_send + n_self; it += G) {
        bool send = false;
        const int idx = mixed_item(it, n_send, n_self, &send);
        if (send) {
            int c = 0;
            const int r = nth_item(p, s.send, idx, &c);
            char *dst = p.one_sided ? p.peer[r] + p.off_recv + (size_t)me * p.rm * p.rec
                                    : p.send_buf + (size_t)r * p.rm * p.rec;
            if (FUSED && !((waited >> r) & 1u)) { /* r has ended the previous round */
                if (tid == 0) s.ok = wait_peer_ended(p, r, round);
                __syncthreads();
                if (!s.ok) return;
                waited |= 1u << r;
            }
            const int j1 = min(s.send[r], (c + 1) * ch);
            for (int j0 = c * ch; j0 < j1; j0 += A2A_SUB) {
                const int R = min(A2A_SUB, j1 - j0);
                if (tid < R)
                    s.tok[tid] = FUSED ? s_inv[r][j0 + tid] : p.inv[(size_t)r * p.M + j0 + tid];
                __syncthreads();
                encode_rows<false, FUSED>(p, s, R, dst + (size_t)j0 * p.rec, 0, r);
                __syncthreads();
            }
            if (p.one_sided && tid == 0) /* after the block's stores (the barrier above) */
                st_release_sys((unsigned long long *)(p.peer[r] + p.off_dchunk) +
                                   (size_t)me * A2A_GPU_NCHUNK + c,
                               v);
        } else {
            if (!have_counts) {
                if (!read_counts(p, round, s)) return;
                have_counts = true;
            }
            const int c = idx, j1 = min(s.send[me], (c + 1) * ch);
            for (int j0 = c * ch; j0 < j1; j0 += A2A_SUB) {
                const int R = min(A2A_SUB, j1 - j0);
                if (tid < R)
                    s.tok[tid] = FUSED ? s_inv[me][j0 + tid] : p.inv[(size_t)me * p.M + j0 + tid];
                __syncthreads();
                encode_rows<true, FUSED>(p, s, R, NULL, s.begin[me] + j0, me);
                __syncthreads();
            }
        }
    }
    if (blockIdx.x == 0 && tid == 0) trace(p, A2A_TR_DISPATCH_SENT);
    if (!(p.roles & (A2A_GPU_SELF | A2A_GPU_RECV))) return;
    if (!have_counts && !read_counts(p, round, s)) return;
    if (blockIdx.x == G - 1 && tid == 0) trace(p, A2A_TR_DISPATCH_COUNTS);
    if (blockIdx.x == 0) {
        for (int q = tid; q < p.ep; q += blockDim.x) {
            p.st->count[q] = s.count[q];
            p.st->begin[q] = s.begin[q];
        }
        if (tid == 0) {
            p.st->begin[p.ep] = s.begin[p.ep];
            p.st->n = s.begin[p.ep];
        }
    }
    if (!(p.roles & A2A_GPU_RECV)) return;
    /* RECV items from the top block down, so they land on the blocks with the least to send */
    int n_recv = 0;
    for (int q = 1; q < p.ep; q++)
        n_recv += cdiv(s.count[(me + q) % p.ep], ch);
    for (int it = G - 1 - blockIdx.x; it < n_recv; it += G) {
        int c = 0;
        const int src = nth_item(p, s.count, it, &c);
        if (p.one_sided) {
            if (tid == 0)
                s.ok = wait_flag(p,
                                 (const unsigned long long *)(p.peer[me] + p.off_dchunk) +
                                     (size_t)src * A2A_GPU_NCHUNK + c,
                                 v, src, A2A_GPU_W_DISPATCH_DATA, round);
            __syncthreads();
            if (!s.ok) return;
        }
        const int j1 = min(s.count[src], (c + 1) * ch);
        for (int j0 = c * ch; j0 < j1; j0 += A2A_SUB)
            decode_rows(p, s, min(A2A_SUB, j1 - j0),
                        p.recv_base + ((size_t)src * p.rm + j0) * p.rec, s.begin[src] + j0);
        __syncthreads();
    }
    if (blockIdx.x == G - 1 && tid == 0) trace(p, A2A_TR_DISPATCH_END);
}

/* ---- combine ---- */

/* Block-wide: the returns of received rows i0 + row (row < R; s.ids / s.w hold their local ids
 * and weights). Slots form: each owned slot's fp32 row, to dst0 + row * ret + k D 4, or with
 * to_out straight into out[s.tok[row], k]. Partial form: the BF16 sum of w * expert_out over
 * the owned slots in slot order (fp32, no fused multiply-add), to dst0 + row * ret. */
__device__ void pack_rows(const a2a_kp &p, const a2a_smem &s, int R, int i0, char *dst0,
                          bool to_out) {
    const int D = p.D, K = p.K, tid = threadIdx.x, nt = blockDim.x, upr = D / 8;
    const size_t ret = p.partial ? (size_t)D * 2 : (size_t)K * D * 4;
    if (!p.partial) {
        const int U = R * K * upr;
        for (int u0 = tid; u0 < U; u0 += nt * A2A_UNR) {
            float4 a[A2A_UNR], b[A2A_UNR];
#pragma unroll
            for (int q = 0; q < A2A_UNR; q++) {
                const int u = u0 + q * nt;
                if (u >= U) break;
                const int row = u / (K * upr), rem = u - row * K * upr, k = rem / upr,
                          c = (rem - k * upr) * 8;
                if (s.ids[row][k] < 0) continue;
                const float4 *e = (const float4 *)(p.eo + ((size_t)(i0 + row) * K + k) * D + c);
                a[q] = e[0];
                b[q] = e[1];
            }
#pragma unroll
            for (int q = 0; q < A2A_UNR; q++) {
                const int u = u0 + q * nt;
                if (u >= U) break;
                const int row = u / (K * upr), rem = u - row * K * upr, k = rem / upr,
                          c = (rem - k * upr) * 8;
                if (s.ids[row][k] < 0) continue;
                float4 *o = to_out ? (float4 *)(p.out + ((size_t)s.tok[row] * K + k) * D + c)
                                   : (float4 *)(dst0 + (size_t)row * ret + ((size_t)k * D + c) * 4);
                o[0] = a[q];
                o[1] = b[q];
            }
        }
    } else {
        const int U = R * upr;
        for (int u = tid; u < U; u += nt) {
            const int row = u / upr, c = (u - row * upr) * 8;
            float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            const float *eo = p.eo + (size_t)(i0 + row) * K * D + c;
            for (int k0 = 0; k0 < K; k0 += 4) { /* the loads of 4 slots first, then the sums */
                float4 a[4], b[4];
#pragma unroll
                for (int q = 0; q < 4; q++)
                    if (k0 + q < K && s.ids[row][k0 + q] >= 0) {
                        a[q] = *(const float4 *)(eo + (size_t)(k0 + q) * D);
                        b[q] = *(const float4 *)(eo + (size_t)(k0 + q) * D + 4);
                    }
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    if (k0 + q >= K) break;
                    if (s.ids[row][k0 + q] < 0) continue;
                    const float wk = s.w[row][k0 + q];
                    const float e[8] = {a[q].x, a[q].y, a[q].z, a[q].w,
                                        b[q].x, b[q].y, b[q].z, b[q].w};
#pragma unroll
                    for (int i = 0; i < 8; i++)
                        acc[i] = __fadd_rn(acc[i], __fmul_rn(wk, e[i]));
                }
            }
            *(uint4 *)(dst0 + (size_t)row * ret + (size_t)c * 2) =
                make_uint4(bf16x2(acc[0], acc[1]), bf16x2(acc[2], acc[3]), bf16x2(acc[4], acc[5]),
                           bf16x2(acc[6], acc[7]));
        }
    }
}

__global__ void __launch_bounds__(A2A_GPU_THREADS, 2) a2a_combine_kernel(a2a_kp p) {
    __shared__ a2a_smem s;
    pdl_wait_();
    if (broken(p)) return;
    const int tid = threadIdx.x, nt = blockDim.x, me = p.me, ch = p.ch, G = gridDim.x, D = p.D,
              K = p.K;
    const unsigned long long round = p.st->round, v = 2 * round + 2;
    const size_t ret = p.partial ? (size_t)D * 2 : (size_t)K * D * 4; /* one return */
    for (int r = tid; r < p.ep; r += nt) {
        s.send[r] = p.st->send[r];
        s.count[r] = p.st->count[r];
        s.begin[r] = p.st->begin[r];
        s.seen[r] = ~0ull;
    }
    if (tid == 0) s.ok = 1;
    __syncthreads();

    /* SEND and SELF items interleaved (mixed_item) */
    int n_send = 0;
    if (p.roles & A2A_GPU_SEND)
        for (int q = 1; q < p.ep; q++)
            n_send += cdiv(s.count[(me + q) % p.ep], ch);
    const int n_self = (p.roles & A2A_GPU_SELF) ? cdiv(s.count[me], ch) : 0;
    if (blockIdx.x == 0 && tid == 0) trace(p, A2A_TR_COMBINE);
    for (int it = blockIdx.x; it < n_send + n_self; it += G) {
        int c = 0, r = me;
        bool send = false;
        const int idx = mixed_item(it, n_send, n_self, &send);
        if (send)
            r = nth_item(p, s.count, idx, &c);
        else
            c = idx;
        const int j1 = min(s.count[r], (c + 1) * ch);
        for (int j0 = c * ch; j0 < j1; j0 += A2A_SUB) {
            const int R = min(A2A_SUB, j1 - j0), i0 = s.begin[r] + j0;
            for (int u = tid; u < R * K; u += nt) {
                const int row = u / K, k = u - row * K;
                s.ids[row][k] = p.rids[(size_t)(i0 + row) * K + k];
                s.w[row][k] = p.rw[(size_t)(i0 + row) * K + k];
            }
            if (tid < R) s.tok[tid] = p.inv[(size_t)me * p.M + j0 + tid];
            __syncthreads();
            if (r != me)
                pack_rows(p, s, R, i0,
                          (p.one_sided ? p.peer[r] + p.off_comb + (size_t)me * p.rm * ret
                                       : p.csend_buf + (size_t)r * p.rm * ret) +
                              (size_t)j0 * ret,
                          false);
            else if (p.partial) /* own tokens' partial sums into the local region */
                pack_rows(p, s, R, i0, p.comb_base + ((size_t)me * p.rm + j0) * ret, false);
            else /* own tokens' slots straight into out */
                pack_rows(p, s, R, i0, NULL, true);
            __syncthreads();
        }
        if (p.one_sided && (r != me || p.partial) && tid == 0)
            st_release_sys((unsigned long long *)(p.peer[r] + p.off_cchunk) +
                               (size_t)me * A2A_GPU_NCHUNK + c,
                           v);
    }

    if (blockIdx.x == 0 && tid == 0) trace(p, A2A_TR_COMBINE_SENT);
    /* RECV (home): gather the returns */
    if ((p.roles & A2A_GPU_RECV) && !p.partial) {
        int n_recv = 0;
        for (int q = 1; q < p.ep; q++)
            n_recv += cdiv(s.send[(me + q) % p.ep], ch);
        const int upr = D / 8;
        for (int it = G - 1 - blockIdx.x; it < n_recv && s.ok; it += G) {
            int c = 0;
            const int src = nth_item(p, s.send, it, &c);
            if (p.one_sided) {
                if (tid == 0)
                    s.ok = wait_flag(p,
                                     (const unsigned long long *)(p.peer[me] + p.off_cchunk) +
                                         (size_t)src * A2A_GPU_NCHUNK + c,
                                     v, src, A2A_GPU_W_COMBINE_DATA, round);
                __syncthreads();
                if (!s.ok) break;
            }
            const int j1 = min(s.send[src], (c + 1) * ch);
            for (int j0 = c * ch; j0 < j1; j0 += A2A_SUB) {
                const int R = min(A2A_SUB, j1 - j0);
                for (int u = tid; u < R * K; u += nt) {
                    const int row = u / K, k = u - row * K;
                    const int t = p.inv[(size_t)src * p.M + j0 + row];
                    if (k == 0) s.tok[row] = t;
                    s.ids[row][k] = p.slot_rank[(size_t)t * K + k] == src ? 0 : -1;
                }
                __syncthreads();
                const char *rows = p.comb_base + ((size_t)src * p.rm + j0) * ret;
                const int U = R * K * upr;
                for (int u0 = tid; u0 < U; u0 += nt * A2A_UNR) {
                    uint4 a[A2A_UNR], b[A2A_UNR];
#pragma unroll
                    for (int q = 0; q < A2A_UNR; q++) {
                        const int u = u0 + q * nt;
                        if (u >= U) break;
                        const int row = u / (K * upr), rem = u - row * K * upr, k = rem / upr,
                                  cc = (rem - k * upr) * 8;
                        if (s.ids[row][k] < 0) continue;
                        const uint4 *e =
                            (const uint4 *)(rows + (size_t)row * ret + ((size_t)k * D + cc) * 4);
                        a[q] = __ldcg(e);
                        b[q] = __ldcg(e + 1);
                    }
#pragma unroll
                    for (int q = 0; q < A2A_UNR; q++) {
                        const int u = u0 + q * nt;
                        if (u >= U) break;
                        const int row = u / (K * upr), rem = u - row * K * upr, k = rem / upr,
                                  cc = (rem - k * upr) * 8;
                        if (s.ids[row][k] < 0) continue;
                        uint4 *o = (uint4 *)(p.out + ((size_t)s.tok[row] * K + k) * D + cc);
                        o[0] = a[q];
                        o[1] = b[q];
                    }
                }
                __syncthreads();
            }
        }
    } else if (p.roles & A2A_GPU_RECV) {
        const int n_recv = cdiv(p.T, ch), upr = D / 8;
        for (int it = G - 1 - blockIdx.x; it < n_recv && s.ok; it += G) {
            const int t1 = min(p.T, (it + 1) * ch);
            for (int t0 = it * ch; t0 < t1 && s.ok; t0 += A2A_SUB) {
                const int R = min(A2A_SUB, t1 - t0);
                if (tid < R) { /* the ranks of the token's slots in rank order, its rows there */
                    const int t = t0 + tid;
                    int nr = 0;
                    for (int k = 0; k < K; k++) {
                        const int r = p.slot_rank[(size_t)t * K + k];
                        const int j = p.slot_index[(size_t)t * K + k];
                        bool dup = false;
                        for (int q = 0; q < nr; q++)
                            dup |= s.rr[tid][q] == r;
                        if (dup) continue;
                        int pos = nr++;
                        while (pos > 0 && s.rr[tid][pos - 1] > r) {
                            s.rr[tid][pos] = s.rr[tid][pos - 1];
                            s.rj[tid][pos] = s.rj[tid][pos - 1];
                            pos--;
                        }
                        s.rr[tid][pos] = r;
                        s.rj[tid][pos] = j;
                    }
                    s.nr[tid] = nr;
                }
                __syncthreads();
                if (p.one_sided && tid == 0)
                    for (int row = 0; row < R && s.ok; row++)
                        for (int q = 0; q < s.nr[row] && s.ok; q++) {
                            const int r = s.rr[row][q], c = s.rj[row][q] / ch;
                            if (s.seen[r] == (unsigned long long)c) continue;
                            if (!wait_flag(p,
                                           (const unsigned long long *)(p.peer[me] + p.off_cchunk) +
                                               (size_t)r * A2A_GPU_NCHUNK + c,
                                           v, r, A2A_GPU_W_COMBINE_DATA, round))
                                s.ok = 0;
                            s.seen[r] = c;
                        }
                __syncthreads();
                if (!s.ok) break;
                for (int u = tid; u < R * upr; u += nt) {
                    const int row = u / upr, cc = (u - row * upr) * 8;
                    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
                    uint4 b[8];
                    const int nr = s.nr[row];
                    for (int q0 = 0; q0 < nr; q0 += 8) { /* loads first, then the sums in order */
#pragma unroll
                        for (int q = 0; q < 8; q++)
                            if (q0 + q < nr)
                                b[q] = __ldcg((const uint4 *)(p.comb_base +
                                                              ((size_t)s.rr[row][q0 + q] * p.rm +
                                                               s.rj[row][q0 + q]) *
                                                                  ret +
                                                              (size_t)cc * 2));
#pragma unroll
                        for (int q = 0; q < 8; q++) {
                            if (q0 + q >= nr) break;
                            const uint32_t h[4] = {b[q].x, b[q].y, b[q].z, b[q].w};
#pragma unroll
                            for (int e = 0; e < 4; e++) {
                                acc[2 * e] = __fadd_rn(acc[2 * e], bf16_f32(h[e] & 0xffff));
                                acc[2 * e + 1] = __fadd_rn(acc[2 * e + 1], bf16_f32(h[e] >> 16));
                            }
                        }
                    }
                    float4 *o = (float4 *)(p.out + (size_t)(t0 + row) * D + cc);
                    o[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
                    o[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
                }
                __syncthreads();
            }
        }
    }
    if (blockIdx.x == G - 1 && tid == 0) trace(p, A2A_TR_COMBINE_GATHERED);
    if (!(p.roles & A2A_GPU_FINISH)) return;
    /* FINISH: the last block through tells every rank this one is done with the round (the
     * next round's route kernel waits for it) and advances the round (every block read it
     * before arriving). */
    __syncthreads();
    if (tid != 0) return;
    __threadfence();
    const unsigned int prev = atomicAdd(&p.st->arrive, 1u);
    if (prev != (unsigned int)G - 1) return;
    __threadfence();
    if (p.one_sided) /* waited for by the next round's route kernel on every rank */
        for (int r = 0; r < p.ep; r++)
            st_release_sys(
                (unsigned long long *)(p.peer[r] + p.off_cdone + (size_t)me * A2A_GPU_LINE), v);
    trace(p, A2A_TR_COMBINE_END);
    p.st->arrive = 0;
    if (!broken(p)) p.st->round = round + 1;
}

/* ---- host ---- */

size_t a2a_gpu_record_bytes(const a2a_gpu *a) { return a ? (size_t)a->rec : 0; }

int a2a_gpu_trace(const a2a_gpu *a, unsigned long long *t, int n) {
    if (!a || !a->trace) return 0;
    if (n > A2A_TR_N) n = A2A_TR_N;
    /* the kernels that write it run on the engine's non-blocking stream */
    if (cudaDeviceSynchronize() != cudaSuccess ||
        cudaMemcpy(t, a->trace, (size_t)n * 8, cudaMemcpyDeviceToHost) != cudaSuccess)
        return 0;
    return n;
}

size_t a2a_gpu_return_bytes(const a2a_gpu *a, int partial) {
    return partial ? (size_t)a->cfg.hidden * 2 : (size_t)a->cfg.top_k * a->cfg.hidden * 4;
}

static size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

static void record_layout(a2a_gpu *a) {
    const int D = a->cfg.hidden, K = a->cfg.top_k;
    size_t codes = 0, sc = 0;
    a->off_s2 = 0;
    switch (a->cfg.payload) {
    case A2A_PAYLOAD_F32: codes = (size_t)D * 4; break;
    case A2A_PAYLOAD_BF16: codes = (size_t)D * 2; break;
    case A2A_PAYLOAD_FP8:
        codes = (size_t)D;
        sc = 4 * (size_t)((D + QUANT_FP8_GROUP - 1) / QUANT_FP8_GROUP);
        break;
    case A2A_PAYLOAD_NVFP4:
        codes = (size_t)D / 2;
        sc = align_up((size_t)D / QUANT_FP4_GROUP, 4) + 4;
        break;
    }
    a->off_sc = (int)align_up(codes, 16);
    if (a->cfg.payload == A2A_PAYLOAD_NVFP4)
        a->off_s2 = a->off_sc + (int)align_up((size_t)D / QUANT_FP4_GROUP, 4);
    a->off_ids = (int)align_up((size_t)a->off_sc + sc, 16);
    a->off_w = a->off_ids + 4 * K;
    a->rec = (int)align_up((size_t)a->off_w + 4 * (size_t)K, 16);
}

void a2a_gpu_params(const a2a_gpu *a, a2a_kp *kp, const float *x, const int32_t *ids,
                    const float *w, const float *eo, float *out) {
    memset(kp, 0, sizeof *kp);
    const a2a_config *c = &a->cfg;
    kp->ep = c->ep_size;
    kp->me = c->rank;
    kp->D = c->hidden;
    kp->K = c->top_k;
    kp->E = c->n_experts;
    kp->M = c->max_tokens_per_rank;
    kp->T = a->T;
    kp->rm = a->runtime_max;
    kp->ch = a->runtime_max > 0 ? (a->runtime_max + a->nchunks - 1) / a->nchunks : 1;
    kp->nch = (a->runtime_max + kp->ch - 1) / kp->ch;
    kp->payload = (int)c->payload;
    kp->one_sided = c->transport == A2A_NVLINK_ONE_SIDED;
    kp->rec = a->rec;
    kp->off_sc = a->off_sc;
    kp->off_s2 = a->off_s2;
    kp->off_ids = a->off_ids;
    kp->off_w = a->off_w;
    kp->timeout_ns = (unsigned long long)(c->timeout_s * 1e9);
    kp->trace = a->trace;
    kp->st = a->st;
    kp->herr = a->herr_dev;
    kp->owner = a->owner;
    kp->eper = a->eper;
    kp->ebegin = a->ebegin;
    kp->slot_rank = a->slot_rank;
    kp->slot_index = a->slot_index;
    kp->inv = a->inv;
    kp->rx = a->rx;
    kp->rids = a->rids;
    kp->rw = a->rw;
    if (kp->one_sided) {
        kp->peer = a->peer_dev;
        kp->off_count = a->off_count;
        kp->off_dchunk = a->off_dchunk;
        kp->off_cchunk = a->off_cchunk;
        kp->off_cdone = a->off_cdone;
        kp->off_recv = a->off_recv;
        kp->off_comb = a->off_comb;
        kp->recv_base = a->seg + a->off_recv;
        kp->comb_base = a->seg + a->off_comb;
        kp->cnt_base = a->seg + a->off_count;
        kp->cnt_stride = A2A_GPU_LINE;
    }
    kp->x = x;
    kp->ids = ids;
    kp->w = w;
    kp->eo = eo;
    kp->out = out;
}

static int launch(a2a_gpu *a, void (*k)(a2a_kp), int grid, int block, bool pdl, const a2a_kp *kp,
                  cudaStream_t s, const char *what, char *err, size_t errlen) {
    cudaLaunchConfig_t lc;
    memset(&lc, 0, sizeof lc);
    lc.gridDim = dim3((unsigned)grid);
    lc.blockDim = dim3((unsigned)block);
    lc.stream = s;
    cudaLaunchAttribute at[1];
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[0].val.programmaticStreamSerializationAllowed = 1;
    lc.attrs = at;
    lc.numAttrs = pdl && a->pdl ? 1 : 0;
    cudaError_t e = cudaLaunchKernelEx(&lc, k, *kp);
    if (e != cudaSuccess) return a2a_gpu_cuda_fail(err, errlen, a->cfg.rank, what, e);
    return 0;
}

int a2a_gpu_launch_route(a2a_gpu *a, const a2a_kp *kp, cudaStream_t s, char *err, size_t errlen) {
    return launch(a, a2a_route_kernel, 1, A2A_GPU_ROUTE_THREADS, false, kp, s,
                  "the route kernel's launch", err, errlen);
}

static int cdiv_h(int x, int y) { return (x + y - 1) / y; }

int a2a_gpu_launch_dispatch(a2a_gpu *a, const a2a_kp *kp, cudaStream_t s, char *err,
                            size_t errlen) {
    const int ep = kp->ep, tch = cdiv_h(kp->T, kp->ch);
    long ub = 0;
    if (kp->roles & A2A_GPU_SEND) ub += (long)tch * (ep - 1 < kp->K ? ep - 1 : kp->K);
    if (kp->roles & A2A_GPU_SELF) ub += tch;
    if (kp->roles & A2A_GPU_RECV) ub += (long)(ep - 1) * kp->nch;
    int grid = (int)(ub < 1 ? 1 : ub > a->cap_dispatch ? a->cap_dispatch : ub);
    return launch(a, kp->fused ? a2a_dispatch_kernel<true> : a2a_dispatch_kernel<false>, grid,
                  A2A_GPU_THREADS, true, kp, s, "the dispatch kernel's launch", err, errlen);
}

int a2a_gpu_launch_combine(a2a_gpu *a, const a2a_kp *kp, cudaStream_t s, char *err, size_t errlen) {
    const int ep = kp->ep, nch = kp->nch;
    long ub = 0;
    if (kp->roles & A2A_GPU_SEND) ub += (long)(ep - 1) * nch;
    if (kp->roles & A2A_GPU_SELF) ub += nch;
    if (kp->roles & A2A_GPU_RECV)
        ub += kp->partial ? cdiv_h(kp->T, kp->ch) : (long)cdiv_h(kp->T, kp->ch) * (ep - 1);
    int grid = (int)(ub < 1 ? 1 : ub > a->cap_combine ? a->cap_combine : ub);
    return launch(a, a2a_combine_kernel, grid, A2A_GPU_THREADS, true, kp, s,
                  "the combine kernel's launch", err, errlen);
}

/* ---- create / destroy ---- */

static int config_check(const a2a_config *c, MPI_Comm comm, char *err, size_t errlen) {
    int size = 0, rank = 0;
    if (comm == MPI_COMM_NULL)
        return a2a_gpu_errf(err, errlen, "all-to-all: the communicator is NULL");
    MPI_Comm_size(comm, &size);
    MPI_Comm_rank(comm, &rank);
    if (c->ep_size != size || c->rank != rank)
        return a2a_gpu_errf(err, errlen,
                            "all-to-all: config says rank %d of %d, the communicator rank %d of %d",
                            c->rank, c->ep_size, rank, size);
    if (c->ep_size < 1 || c->ep_size > A2A_MAX_RANKS)
        return a2a_gpu_errf(err, errlen, "all-to-all: ep_size %d outside [1, %d]", c->ep_size,
                            A2A_MAX_RANKS);
    if (c->transport != A2A_NVLINK_ONE_SIDED && c->transport != A2A_NCCL)
        return a2a_gpu_errf(
            err, errlen, "all-to-all: the GPU all-to-all serves nvlink_one_sided and nccl, not %s",
            a2a_transport_name(c->transport));
    if (c->max_tokens_per_rank < 1)
        return a2a_gpu_errf(err, errlen, "all-to-all: max_tokens_per_rank %d must be >= 1",
                            c->max_tokens_per_rank);
    if (c->hidden < 16 || c->hidden % 16 != 0)
        return a2a_gpu_errf(
            err, errlen,
            "all-to-all: the GPU transports need hidden %% 16 == 0 (vector stores), "
            "hidden is %d",
            c->hidden);
    if ((unsigned)c->payload > (unsigned)A2A_PAYLOAD_NVFP4)
        return a2a_gpu_errf(err, errlen, "all-to-all: unknown payload %d", (int)c->payload);
    if (c->n_experts < 1 || c->top_k < 1 || c->top_k > c->n_experts || c->top_k > A2A_GPU_KMAX)
        return a2a_gpu_errf(err, errlen,
                            "all-to-all: top_k %d outside [1, min(n_experts = %d, %d)]", c->top_k,
                            c->n_experts, A2A_GPU_KMAX);
    if (c->expert_begin[0] != 0 || c->expert_begin[c->ep_size] != c->n_experts)
        return a2a_gpu_errf(err, errlen,
                            "all-to-all: expert_begin must run from 0 to n_experts = %d",
                            c->n_experts);
    for (int r = 0; r < c->ep_size; r++)
        if (c->expert_begin[r + 1] < c->expert_begin[r])
            return a2a_gpu_errf(err, errlen, "all-to-all: expert_begin decreases at rank %d", r);
    if (!(c->timeout_s >= 0) || c->timeout_s > 1e6)
        return a2a_gpu_errf(err, errlen, "all-to-all: timeout_s %g outside [0, 1e6]", c->timeout_s);
    return 0;
}

/* Every rank's verdict and the shared fields, as min and max in one MPI_Allreduce. */
static int config_agree(const a2a_config *c, MPI_Comm comm, int ok, char *err, size_t errlen) {
    enum { N = 8 };
    uint32_t h = 2166136261u;
    for (int r = 0; r <= c->ep_size && r <= A2A_MAX_RANKS; r++)
        h = (h ^ (uint32_t)c->expert_begin[r]) * 16777619u;
    int v[2 * N] = {ok,       (int)c->transport, c->max_tokens_per_rank, c->hidden,
                    c->top_k, c->n_experts,      (int)(h & 0x7fffffff),  (int)c->payload};
    static const char *names[N] = {"ok",    "transport", "max_tokens_per_rank", "hidden",
                                   "top_k", "n_experts", "expert_begin",        "payload"};
    int r[2 * N];
    for (int i = 0; i < N; i++)
        v[N + i] = -v[i];
    if (MPI_Allreduce(v, r, 2 * N, MPI_INT, MPI_MAX, comm) != MPI_SUCCESS)
        return a2a_gpu_errf(err, errlen,
                            "all-to-all: MPI_Allreduce failed while checking the config");
    if (-r[N] != 1) {
        if (ok)
            a2a_gpu_errf(err, errlen,
                         "all-to-all: another rank rejected the config (see its message)");
        return -1;
    }
    for (int i = 1; i < N; i++)
        if (r[i] != -r[N + i])
            return a2a_gpu_errf(
                err, errlen,
                "all-to-all: %s differs between ranks (%d .. %d): every rank must pass "
                "the same config",
                names[i], -r[N + i], r[i]);
    return 0;
}

bool a2a_gpu_agree(MPI_Comm comm, bool ok) {
    int v = ok ? 1 : 0, all = 0;
    if (MPI_Allreduce(&v, &all, 1, MPI_INT, MPI_MIN, comm) != MPI_SUCCESS) return false;
    return all == 1;
}

#define TRY(call, what)                                                                            \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess) {                                                                   \
            a2a_gpu_cuda_fail(err, errlen, a->cfg.rank, what, e_);                                 \
            goto fail;                                                                             \
        }                                                                                          \
    } while (0)

/* The watch thread: cfg.check_peers every 100 ms until a2a_gpu_destroy, or until it names a
 * peer that is gone (then the kernels' waits see herr->peer_gone). */
static void *watch_main(void *arg) {
    a2a_gpu *a = (a2a_gpu *)arg;
    pthread_mutex_lock(&a->watch_mu);
    while (!a->watch_stop) {
        struct timespec t;
        clock_gettime(CLOCK_MONOTONIC, &t);
        t.tv_nsec += 100 * 1000 * 1000;
        if (t.tv_nsec >= 1000000000L) {
            t.tv_sec++;
            t.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&a->watch_cv, &a->watch_mu, &t);
        if (a->watch_stop) break;
        char msg[sizeof a->watch_why];
        pthread_mutex_unlock(&a->watch_mu);
        const int gone = a->cfg.check_peers(a->cfg.check_ctx, msg, sizeof msg) != 0;
        pthread_mutex_lock(&a->watch_mu);
        if (gone) {
            snprintf(a->watch_why, sizeof a->watch_why, "%s", msg);
            __atomic_store_n(&a->herr->peer_gone, 1, __ATOMIC_RELEASE);
            break;
        }
    }
    pthread_mutex_unlock(&a->watch_mu);
    return NULL;
}

static int watch_start(a2a_gpu *a) {
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&a->watch_cv, &ca);
    pthread_condattr_destroy(&ca);
    pthread_mutex_init(&a->watch_mu, NULL);
    a->watching = pthread_create(&a->watch, NULL, watch_main, a) == 0;
    if (!a->watching) {
        pthread_cond_destroy(&a->watch_cv);
        pthread_mutex_destroy(&a->watch_mu);
    }
    return a->watching ? 0 : -1;
}

static void watch_end(a2a_gpu *a) {
    if (!a->watching) return;
    pthread_mutex_lock(&a->watch_mu);
    a->watch_stop = true;
    pthread_cond_signal(&a->watch_cv);
    pthread_mutex_unlock(&a->watch_mu);
    pthread_join(a->watch, NULL);
    pthread_cond_destroy(&a->watch_cv);
    pthread_mutex_destroy(&a->watch_mu);
    a->watching = false;
}

a2a_gpu *a2a_gpu_create(const a2a_config *cfg, MPI_Comm comm, char *err, size_t errlen) {
    if (!cfg) {
        a2a_gpu_errf(err, errlen, "all-to-all: no config");
        return NULL;
    }
    int ok = config_check(cfg, comm, err, errlen) == 0;
    if (comm == MPI_COMM_NULL) return NULL;
    a2a_config safe = *cfg;
    if (safe.ep_size < 1 || safe.ep_size > A2A_MAX_RANKS) safe.ep_size = 1;
    if (config_agree(&safe, comm, ok, err, errlen) != 0) return NULL;

    a2a_gpu *a = (a2a_gpu *)calloc(1, sizeof *a);
    a->cfg = *cfg;
    a->comm = MPI_COMM_NULL;
    if (a->cfg.timeout_s == 0) a->cfg.timeout_s = A2A_DEFAULT_TIMEOUT_S;
    const char *pdl = getenv("MOESERVE_A2A_PDL"), *tr = getenv("MOESERVE_A2A_TRACE"),
               *fuse = getenv("MOESERVE_A2A_FUSE");
    a->pdl = !(pdl && strcmp(pdl, "0") == 0);
    a->fuse = !(fuse && strcmp(fuse, "0") == 0);
    const bool want_trace = tr && strcmp(tr, "1") == 0;
    /* chunks per source (tuning; every rank must use the same: agreed below) */
    const char *nc = getenv("MOESERVE_A2A_CHUNKS");
    a->nchunks = nc ? atoi(nc) : A2A_GPU_NCHUNK;
    if (a->nchunks < 1 || a->nchunks > A2A_GPU_NCHUNK) a->nchunks = A2A_GPU_NCHUNK;
    {
        int v[2] = {a->nchunks, -a->nchunks}, m[2] = {0, 0};
        MPI_Allreduce(v, m, 2, MPI_INT, MPI_MAX, comm);
        if (m[0] != -m[1]) {
            a2a_gpu_errf(
                err, errlen,
                "all-to-all: MOESERVE_A2A_CHUNKS differs between ranks (%d .. %d): every rank "
                "must use the same",
                -m[1], m[0]);
            free(a);
            return NULL;
        }
    }
    record_layout(a);
    const int ep = cfg->ep_size, M = cfg->max_tokens_per_rank, D = cfg->hidden, K = cfg->top_k,
              E = cfg->n_experts;
    bool good = false;
    int32_t *owner = (int32_t *)malloc((size_t)E * sizeof(int32_t));
    if (MPI_Comm_dup(comm, &a->comm) != MPI_SUCCESS) {
        a2a_gpu_errf(err, errlen, "all-to-all: MPI_Comm_dup failed");
        a->comm = MPI_COMM_NULL;
        free(owner);
        free(a);
        return NULL;
    }
    for (int r = 0; r < ep; r++)
        for (int e = cfg->expert_begin[r]; e < cfg->expert_begin[r + 1]; e++)
            owner[e] = r;
    a->eper = E % ep == 0 ? E / ep : 0;
    for (int r = 0; r <= ep && a->eper; r++)
        if (cfg->expert_begin[r] != r * a->eper) a->eper = 0;
    {
        TRY(cudaGetDevice(&a->device), "cudaGetDevice");
        TRY(cudaDeviceGetAttribute(&a->n_sm, cudaDevAttrMultiProcessorCount, a->device),
            "cudaDeviceGetAttribute");
        int occ_d = 0, occ_c = 0;
        TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ_d, a2a_dispatch_kernel<true>,
                                                          A2A_GPU_THREADS, 0),
            "the occupancy query");
        TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ_c, a2a_combine_kernel,
                                                          A2A_GPU_THREADS, 0),
            "the occupancy query");
        /* one SM's worth left for the route kernel that overlaps the dispatch under PDL */
        a->cap_dispatch = (a->n_sm - 1) * (occ_d > 0 ? occ_d : 1);
        a->cap_combine = (a->n_sm - 1) * (occ_c > 0 ? occ_c : 1);
        TRY(cudaMalloc((void **)&a->st, sizeof(a2a_gpu_state)), "cudaMalloc of the state");
        if (want_trace) {
            TRY(cudaMalloc((void **)&a->trace, A2A_TR_N * 8), "cudaMalloc of the trace");
            TRY(cudaMemset(a->trace, 0, A2A_TR_N * 8), "cudaMemset");
        }
        TRY(cudaMemset(a->st, 0, sizeof(a2a_gpu_state)), "cudaMemset");
        TRY(cudaHostAlloc((void **)&a->herr, sizeof(a2a_gpu_err), cudaHostAllocMapped),
            "cudaHostAlloc (mapped) of the error record");
        memset(a->herr, 0, sizeof(a2a_gpu_err));
        TRY(cudaHostGetDevicePointer((void **)&a->herr_dev, a->herr, 0),
            "cudaHostGetDevicePointer");
        TRY(cudaMalloc((void **)&a->owner, (size_t)E * 4), "cudaMalloc");
        TRY(cudaMemcpy(a->owner, owner, (size_t)E * 4, cudaMemcpyHostToDevice), "cudaMemcpy");
        TRY(cudaMalloc((void **)&a->ebegin, (size_t)(ep + 1) * 4), "cudaMalloc");
        TRY(cudaMemcpy(a->ebegin, cfg->expert_begin, (size_t)(ep + 1) * 4, cudaMemcpyHostToDevice),
            "cudaMemcpy");
        TRY(cudaMalloc((void **)&a->slot_rank, (size_t)M * K * 4), "cudaMalloc");
        TRY(cudaMalloc((void **)&a->slot_index, (size_t)M * K * 4), "cudaMalloc");
        TRY(cudaMalloc((void **)&a->inv, (size_t)ep * M * 4), "cudaMalloc");
        TRY(cudaMalloc((void **)&a->rx, (size_t)ep * M * D * 4), "cudaMalloc of the received x");
        TRY(cudaMalloc((void **)&a->rids, (size_t)ep * M * K * 4), "cudaMalloc");
        TRY(cudaMalloc((void **)&a->rw, (size_t)ep * M * K * 4), "cudaMalloc");
        a->peer_host = (char **)calloc((size_t)ep, sizeof(char *));
        if (cfg->transport == A2A_NVLINK_ONE_SIDED) {
            a->off_count = 0;
            a->off_dchunk = (size_t)ep * A2A_GPU_LINE;
            a->off_cchunk = a->off_dchunk + (size_t)ep * A2A_GPU_NCHUNK * 8;
            a->off_cdone = a->off_cchunk + (size_t)ep * A2A_GPU_NCHUNK * 8;
            a->off_recv = align_up(a->off_cdone + (size_t)ep * A2A_GPU_LINE, 4096);
            a->off_comb = align_up(a->off_recv + (size_t)ep * M * a->rec, 4096);
            a->seg_bytes = align_up(a->off_comb + (size_t)ep * M * K * D * 4, 1 << 21);
            if (a2a_segment_setup(a, err, errlen) != 0) goto fail;
            TRY(cudaMemset(a->seg, 0, a->off_recv), "cudaMemset of the segment's header");
            TRY(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
            TRY(cudaMalloc((void **)&a->peer_dev, (size_t)ep * sizeof(char *)), "cudaMalloc");
            TRY(cudaMemcpy(a->peer_dev, a->peer_host, (size_t)ep * sizeof(char *),
                           cudaMemcpyHostToDevice),
                "cudaMemcpy");
        } else if (a2a_nccl_init(a, err, errlen) != 0) {
            goto fail;
        }
        if (cfg->transport == A2A_NVLINK_ONE_SIDED && cfg->check_peers && ep > 1 &&
            watch_start(a) != 0) {
            a2a_gpu_errf(err, errlen, "all-to-all rank %d: the peer watch thread did not start",
                         cfg->rank);
            goto fail;
        }
        /* the copies and zeroings above ran on the legacy stream, which the engine's
         * non-blocking stream does not wait for: done before any kernel reads them */
        TRY(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
        good = true;
    }
fail:
    free(owner);
    /* Every header is zeroed before any rank may write a flag into it. */
    if (!a2a_gpu_agree(a->comm, good)) {
        if (good)
            a2a_gpu_errf(
                err, errlen,
                "all-to-all rank %d: another rank could not set up the %s transport (see its "
                "message)",
                cfg->rank, a2a_transport_name(cfg->transport));
        a2a_gpu_destroy(a);
        return NULL;
    }
    a->phase = A2A_GPU_IDLE;
    return a;
}

void a2a_gpu_destroy(a2a_gpu *a) {
    if (!a) return;
    watch_end(a);
    cudaDeviceSynchronize();
    if (a->comm != MPI_COMM_NULL) MPI_Barrier(a->comm); /* no peer still writes into us */
    if (a->cfg.transport == A2A_NCCL) a2a_nccl_free(a);
    if (a->cfg.transport == A2A_NVLINK_ONE_SIDED) a2a_segment_free(a);
    free(a->peer_host);
    cudaFree(a->peer_dev);
    cudaFree(a->st);
    cudaFree(a->trace);
    if (a->herr) cudaFreeHost(a->herr);
    cudaFree(a->owner);
    cudaFree(a->ebegin);
    cudaFree(a->slot_rank);
    cudaFree(a->slot_index);
    cudaFree(a->inv);
    cudaFree(a->rx);
    cudaFree(a->rids);
    cudaFree(a->rw);
    if (a->comm != MPI_COMM_NULL) MPI_Comm_free(&a->comm);
    free(a);
}

/* ---- one round ---- */

static int phase_error(const a2a_gpu *a, const char *call, char *err, size_t errlen) {
    if (a->phase == A2A_GPU_BROKEN)
        return a2a_gpu_errf(err, errlen,
                            "all-to-all rank %d: %s refused: the all-to-all failed earlier (%s)",
                            a->cfg.rank, call, a->broken_why);
    if (a->phase == A2A_GPU_DISPATCHED)
        return a2a_gpu_errf(
            err, errlen,
            "all-to-all rank %d: dispatch called twice without a combine: every dispatch "
            "must be followed by its combine",
            a->cfg.rank);
    return a2a_gpu_errf(err, errlen, "all-to-all rank %d: combine called without a dispatch",
                        a->cfg.rank);
}

int a2a_gpu_dispatch(a2a_gpu *a, const float *x, const int32_t *topk_ids, const float *topk_w,
                     int T, int runtime_max, void *stream, char *err, size_t errlen) {
    if (!a) return a2a_gpu_errf(err, errlen, "all-to-all: dispatch on a NULL object");
    if (a->phase != A2A_GPU_IDLE) return phase_error(a, "dispatch", err, errlen);
    if (runtime_max < 0 || runtime_max > a->cfg.max_tokens_per_rank)
        return a2a_gpu_errf(
            err, errlen, "all-to-all rank %d: runtime_max %d outside [0, max_tokens_per_rank = %d]",
            a->cfg.rank, runtime_max, a->cfg.max_tokens_per_rank);
    if (T < 0 || T > runtime_max)
        return a2a_gpu_errf(err, errlen,
                            "all-to-all rank %d: T = %d tokens outside [0, runtime_max = %d]",
                            a->cfg.rank, T, runtime_max);
    if (T > 0 && (!x || !topk_ids || !topk_w))
        return a2a_gpu_errf(err, errlen,
                            "all-to-all rank %d: dispatch of %d tokens with a NULL input",
                            a->cfg.rank, T);
    a->T = T;
    a->runtime_max = runtime_max;
    a->stream = (cudaStream_t)stream;
    a2a_kp kp;
    a2a_gpu_params(a, &kp, x, topk_ids, topk_w, NULL, NULL);
    int rc;
    if (a->cfg.transport == A2A_NCCL) {
        rc = a2a_nccl_dispatch(a, &kp, a->stream, err, errlen);
    } else {
        kp.roles = A2A_GPU_SEND | A2A_GPU_SELF | A2A_GPU_RECV;
        kp.fused = a->fuse && kp.ep <= 8 && kp.rm <= A2A_FUSED_T;
        rc = kp.fused ? 0 : a2a_gpu_launch_route(a, &kp, a->stream, err, errlen);
        if (rc == 0) rc = a2a_gpu_launch_dispatch(a, &kp, a->stream, err, errlen);
    }
    if (rc != 0) {
        a->phase = A2A_GPU_BROKEN;
        snprintf(a->broken_why, sizeof a->broken_why, "%s", err ? err : "dispatch failed");
        return -1;
    }
    a->phase = A2A_GPU_DISPATCHED;
    return 0;
}

a2a_gpu_received a2a_gpu_get_received(const a2a_gpu *a) {
    a2a_gpu_received r;
    memset(&r, 0, sizeof r);
    if (!a) return r;
    r.n_max = a->cfg.ep_size * a->runtime_max;
    r.n = &a->st->n;
    r.count = a->st->count;
    r.begin = a->st->begin;
    r.x = a->rx;
    r.ids = a->rids;
    r.w = a->rw;
    return r;
}

static int combine(a2a_gpu *a, const float *expert_out, float *out, int partial, void *stream,
                   char *err, size_t errlen) {
    if (!a) return a2a_gpu_errf(err, errlen, "all-to-all: combine on a NULL object");
    if (a->phase != A2A_GPU_DISPATCHED) return phase_error(a, "combine", err, errlen);
    if (a->T > 0 && !out)
        return a2a_gpu_errf(err, errlen,
                            "all-to-all rank %d: combine with a NULL out for %d tokens",
                            a->cfg.rank, a->T);
    if (a->runtime_max > 0 && !expert_out)
        return a2a_gpu_errf(err, errlen, "all-to-all rank %d: combine with a NULL expert_out",
                            a->cfg.rank);
    a->stream = (cudaStream_t)stream;
    a2a_kp kp;
    a2a_gpu_params(a, &kp, NULL, NULL, NULL, expert_out, out);
    kp.partial = partial;
    int rc;
    if (a->cfg.transport == A2A_NCCL) {
        rc = a2a_nccl_combine(a, &kp, a->stream, err, errlen);
    } else {
        kp.roles = A2A_GPU_SEND | A2A_GPU_SELF | A2A_GPU_RECV | A2A_GPU_FINISH;
        rc = a2a_gpu_launch_combine(a, &kp, a->stream, err, errlen);
    }
    if (rc != 0) {
        a->phase = A2A_GPU_BROKEN;
        snprintf(a->broken_why, sizeof a->broken_why, "%s", err ? err : "combine failed");
        return -1;
    }
    a->phase = A2A_GPU_IDLE;
    return 0;
}

int a2a_gpu_combine(a2a_gpu *a, const float *expert_out, float *out, void *stream, char *err,
                    size_t errlen) {
    return combine(a, expert_out, out, 0, stream, err, errlen);
}

int a2a_gpu_combine_partial(a2a_gpu *a, const float *expert_out, float *out, void *stream,
                            char *err, size_t errlen) {
    return combine(a, expert_out, out, 1, stream, err, errlen);
}

int a2a_gpu_check(a2a_gpu *a, char *err, size_t errlen) {
    if (!a) return a2a_gpu_errf(err, errlen, "all-to-all: check on a NULL object");
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(a->stream, &cs) == cudaSuccess && cs != cudaStreamCaptureStatusNone)
        return 0; /* inside a graph's capture: the caller checks after each replay */
    cudaError_t e = cudaStreamSynchronize(a->stream);
    if (e != cudaSuccess) {
        a->phase = A2A_GPU_BROKEN;
        snprintf(a->broken_why, sizeof a->broken_why, "the stream failed: %s",
                 cudaGetErrorString(e));
        return a2a_gpu_errf(err, errlen, "all-to-all rank %d: the stream failed: %s", a->cfg.rank,
                            cudaGetErrorString(e));
    }
    const volatile a2a_gpu_err *r = a->herr;
    const int me = a->cfg.rank;
    char msg[480];
    static const char *where[] = {"dispatch", "dispatch data", "combine data",
                                  "end of the previous round"};
    switch (r->code) {
    case A2A_GPU_E_NONE:
        if (a->phase == A2A_GPU_BROKEN)
            return a2a_gpu_errf(err, errlen, "all-to-all rank %d: %s", me, a->broken_why);
        return 0;
    case A2A_GPU_E_TIMEOUT:
        snprintf(msg, sizeof msg,
                 "all-to-all rank %d: rank %d did not arrive within %g s (%s, round %llu); a "
                 "peer that died or skipped this step leaves the group unusable",
                 me, r->peer, a->cfg.timeout_s, where[r->where & 3], r->round);
        break;
    case A2A_GPU_E_PEER_GONE: {
        char why[sizeof a->watch_why];
        pthread_mutex_lock(&a->watch_mu);
        snprintf(why, sizeof why, "%s", a->watch_why);
        pthread_mutex_unlock(&a->watch_mu);
        snprintf(msg, sizeof msg,
                 "all-to-all rank %d: %s (seen waiting for rank %d: %s, round %llu); the group "
                 "cannot go on",
                 me, why, r->peer, where[r->where & 3], r->round);
        break;
    }
    case A2A_GPU_E_RUNTIME_MAX:
        snprintf(msg, sizeof msg,
                 "all-to-all rank %d: rank %d dispatched round %llu with runtime_max %d, this "
                 "rank with %d: runtime_max must be the same on every rank",
                 me, r->peer, r->round, r->a, r->b);
        break;
    case A2A_GPU_E_COUNT:
        snprintf(msg, sizeof msg,
                 "all-to-all rank %d: rank %d announced %d tokens for round %llu (runtime_max %d)",
                 me, r->peer, r->a, r->round, r->b);
        break;
    case A2A_GPU_E_EXPERT:
        snprintf(msg, sizeof msg,
                 "all-to-all rank %d: round %llu token %d slot %d: expert id %d outside [0, %d)",
                 me, r->round, r->a, r->b, r->c, a->cfg.n_experts);
        break;
    default: snprintf(msg, sizeof msg, "all-to-all rank %d: unknown error %d", me, r->code); break;
    }
    a->phase = A2A_GPU_BROKEN;
    snprintf(a->broken_why, sizeof a->broken_why, "%s", msg);
    return a2a_gpu_errf(err, errlen, "%s", msg);
}
