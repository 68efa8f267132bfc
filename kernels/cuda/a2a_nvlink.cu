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
 *                            any payload: receivers learn their row offsets at once.
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
 *                            finish writes the end flag into every rank, waits for every rank's,
 *                            then advances the round).
 *
 * Why no more flags are needed: a rank writes into a peer's regions for round N+1 only after its
 * combine N ended, which waited for that peer's end flag N, stored after the peer finished its
 * combine N sends, which run after its dispatch N decode (stream order). Flag values never
 * repeat (2N+1, 2N+2; the round lives in device memory and advances in the kernel), so CUDA
 * graph replays are new rounds and an equal flag can only be this round's.
 *
 * Ordering: payload stores are plain; each block's stores are followed by __syncthreads, a
 * system fence and a release store of the flag (system scope); the receiver spins with acquire
 * loads and reads the payload through L2 (ld.global.cg), never a stale L1 line. Every spin has
 * a budget (cfg.timeout_s, %globaltimer); on timeout the first block records {peer, wait, round}
 * in mapped host memory, sets the device error word, and every block and later kernel returns.
 *
 * Co-residency: blocks that wait (RECV, the end barrier) wait for peer blocks that may wait in
 * turn, so every grid is at most what fits on the device at once (occupancy x SMs).
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

#define A2A_DEFAULT_TIMEOUT_S 30.0

static int gerr(char *err, size_t errlen, const char *fmt, ...) {
    if (err && errlen) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, errlen, fmt, ap);
        va_end(ap);
    }
    return -1;
}

int a2a_gpu_cuda_fail(char *err, size_t errlen, int rank, const char *what, cudaError_t e) {
    return gerr(err, errlen, "all-to-all rank %d: %s failed: %s", rank, what,
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
__device__ __forceinline__ void pdl_wait_() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_trigger_() {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}
__device__ __forceinline__ int broken(const a2a_kp &p) { return *(volatile int *)&p.st->err; }

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
            if (globaltimer() - t0 > p.timeout_ns) {
                raise_error(p, A2A_GPU_E_TIMEOUT, peer, where, 0, 0, 0, round);
                return false;
            }
        }
    }
}

__device__ __forceinline__ uint16_t bf16_rne(float f) {
    uint32_t u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
__device__ __forceinline__ float bf16_f32(uint32_t h) { return __uint_as_float(h << 16); }
__device__ __forceinline__ float amax_acc(float m, float x) {
    float a = fabsf(x);
    return a > m ? a : m; /* NaN never wins, as kernels/cpu/quant.c's amax_of */
}
__device__ __forceinline__ float warp_max(float m) {
    for (int o = 16; o > 0; o >>= 1) {
        float y = __shfl_xor_sync(0xffffffffu, m, o);
        m = y > m ? y : m;
    }
    return m;
}

/* Block-wide: token t's record for target rank r at rec (codes | scales | ids | w). */
__device__ void encode_token(const a2a_kp &p, char *rec, int t, int r, float *s_red) {
    const int D = p.D, tid = threadIdx.x, nt = blockDim.x;
    const float *x = p.x + (size_t)t * D;
    switch (p.payload) {
    case A2A_PAYLOAD_F32:
        for (int c = tid * 4; c < D; c += nt * 4)
            *(float4 *)(rec + (size_t)c * 4) = *(const float4 *)(x + c);
        break;
    case A2A_PAYLOAD_BF16:
        for (int c = tid * 8; c < D; c += nt * 8) {
            float4 u = *(const float4 *)(x + c), v = *(const float4 *)(x + c + 4);
            uint4 o;
            o.x = bf16_rne(u.x) | (uint32_t)bf16_rne(u.y) << 16;
            o.y = bf16_rne(u.z) | (uint32_t)bf16_rne(u.w) << 16;
            o.z = bf16_rne(v.x) | (uint32_t)bf16_rne(v.y) << 16;
            o.w = bf16_rne(v.z) | (uint32_t)bf16_rne(v.w) << 16;
            *(uint4 *)(rec + (size_t)c * 2) = o;
        }
        break;
    case A2A_PAYLOAD_FP8: {
        const int lane = tid & 31, warp = tid >> 5, nw = nt >> 5;
        const int G = (D + QUANT_FP8_GROUP - 1) / QUANT_FP8_GROUP;
        for (int g = warp; g < G; g += nw) {
            const int c = g * QUANT_FP8_GROUP + lane * 4;
            const bool ok = c < D;
            float4 v = ok ? *(const float4 *)(x + c) : make_float4(0.f, 0.f, 0.f, 0.f);
            float m = amax_acc(amax_acc(amax_acc(amax_acc(0.0f, v.x), v.y), v.z), v.w);
            m = warp_max(m);
            const float sc = (m > 1e-10f ? m : 1e-10f) / FP8_E4M3_MAX;
            if (ok)
                *(uint32_t *)(rec + c) = (uint32_t)fp8_e4m3_from_float(v.x / sc) |
                                         (uint32_t)fp8_e4m3_from_float(v.y / sc) << 8 |
                                         (uint32_t)fp8_e4m3_from_float(v.z / sc) << 16 |
                                         (uint32_t)fp8_e4m3_from_float(v.w / sc) << 24;
            if (lane == 0) *(float *)(rec + p.off_sc + g * 4) = sc;
        }
        break;
    }
    case A2A_PAYLOAD_NVFP4: {
        float m = 0.0f;
        for (int c = tid * 4; c < D; c += nt * 4) {
            float4 v = *(const float4 *)(x + c);
            m = amax_acc(amax_acc(amax_acc(amax_acc(m, v.x), v.y), v.z), v.w);
        }
        m = warp_max(m);
        if ((tid & 31) == 0) s_red[tid >> 5] = m;
        __syncthreads();
        float a = 0.0f;
        for (int i = 0; i < (nt >> 5); i++)
            a = s_red[i] > a ? s_red[i] : a;
        __syncthreads(); /* s_red is reused by the next token */
        const float s2 = a > 0.0f ? a / (FP4_E2M1_MAX * FP8_E4M3_MAX) : 1.0f;
        for (int g = tid; g < D / QUANT_FP4_GROUP; g += nt) {
            float v[16];
            const float4 *xg = (const float4 *)(x + g * 16);
#pragma unroll
            for (int i = 0; i < 4; i++) {
                float4 q = xg[i];
                v[4 * i] = q.x, v[4 * i + 1] = q.y, v[4 * i + 2] = q.z, v[4 * i + 3] = q.w;
            }
            float am = 0.0f;
#pragma unroll
            for (int i = 0; i < 16; i++)
                am = amax_acc(am, v[i]);
            const uint8_t code = fp8_e4m3_from_float(am / (FP4_E2M1_MAX * s2));
            const float scale = fp8_e4m3_to_float(code) * s2;
            uint32_t lo = 0, hi = 0;
#pragma unroll
            for (int i = 0; i < 16; i++) {
                uint32_t nib = scale > 0.0f ? fp4_e2m1_from_float(v[i] / scale) : 0;
                if (i < 8)
                    lo |= nib << (4 * i);
                else
                    hi |= nib << (4 * (i - 8));
            }
            *(uint2 *)(rec + g * 8) = make_uint2(lo, hi);
            rec[p.off_sc + g] = (char)code;
        }
        if (tid == 0) *(float *)(rec + p.off_s2) = s2;
        break;
    }
    }
    const int32_t *ids = p.ids + (size_t)t * p.K;
    const float *w = p.w + (size_t)t * p.K;
    const int begin = p.ebegin[r];
    for (int k = tid; k < p.K; k += nt) {
        const int id = ids[k];
        const bool ok = id >= 0 && id < p.E && p.owner[id] == r;
        ((int32_t *)(rec + p.off_ids))[k] = ok ? id - begin : -1;
        ((float *)(rec + p.off_w))[k] = w[k];
    }
}

/* Block-wide: the record at rec -> received row i (fp32 x, ids, w). Reads through L2: a peer
 * wrote it. lut: the 256 E4M3 values. */
__device__ void decode_token(const a2a_kp &p, int i, const char *rec, const float *lut) {
    const int D = p.D, tid = threadIdx.x, nt = blockDim.x;
    float *x = p.rx + (size_t)i * D;
    switch (p.payload) {
    case A2A_PAYLOAD_F32:
        for (int c = tid * 4; c < D; c += nt * 4)
            *(float4 *)(x + c) = __ldcg((const float4 *)(rec + (size_t)c * 4));
        break;
    case A2A_PAYLOAD_BF16:
        for (int c = tid * 8; c < D; c += nt * 8) {
            uint4 q = __ldcg((const uint4 *)(rec + (size_t)c * 2));
            *(float4 *)(x + c) = make_float4(bf16_f32(q.x & 0xffff), bf16_f32(q.x >> 16),
                                             bf16_f32(q.y & 0xffff), bf16_f32(q.y >> 16));
            *(float4 *)(x + c + 4) = make_float4(bf16_f32(q.z & 0xffff), bf16_f32(q.z >> 16),
                                                 bf16_f32(q.w & 0xffff), bf16_f32(q.w >> 16));
        }
        break;
    case A2A_PAYLOAD_FP8:
        for (int c = tid * 4; c < D; c += nt * 4) {
            uint32_t q = __ldcg((const unsigned int *)(rec + c));
            float sc = __ldcg((const float *)(rec + p.off_sc) + c / QUANT_FP8_GROUP);
            *(float4 *)(x + c) =
                make_float4(__fmul_rn(lut[q & 255], sc), __fmul_rn(lut[(q >> 8) & 255], sc),
                            __fmul_rn(lut[(q >> 16) & 255], sc), __fmul_rn(lut[q >> 24], sc));
        }
        break;
    case A2A_PAYLOAD_NVFP4: {
        const float s2 = __ldcg((const float *)(rec + p.off_s2));
        for (int g = tid; g < D / QUANT_FP4_GROUP; g += nt) {
            uint2 q = __ldcg((const uint2 *)(rec + g * 8));
            const float sf = lut[(uint8_t)__ldcg((const signed char *)(rec + p.off_sc + g))];
            float v[16];
#pragma unroll
            for (int e = 0; e < 16; e++) {
                uint32_t nib = ((e < 8 ? q.x : q.y) >> (4 * (e & 7))) & 15;
                /* e2m1 x e4m3 is exact; one rounding, by s2 (as dequant_nvfp4) */
                v[e] = __fmul_rn(__fmul_rn(fp4_e2m1_to_float((uint8_t)nib), sf), s2);
            }
            float4 *xo = (float4 *)(x + g * 16);
#pragma unroll
            for (int e = 0; e < 4; e++)
                xo[e] = make_float4(v[4 * e], v[4 * e + 1], v[4 * e + 2], v[4 * e + 3]);
        }
        break;
    }
    }
    for (int k = tid; k < p.K; k += nt) {
        p.rids[(size_t)i * p.K + k] = __ldcg((const int *)(rec + p.off_ids) + k);
        p.rw[(size_t)i * p.K + k] = __ldcg((const float *)(rec + p.off_w) + k);
    }
}

/* ---- route ---- */

/* Exclusive scan of 8 counters per thread over the block; tot gets the block totals. */
__device__ void block_scan8(int v[8], int tot[8], int (*s_w)[8]) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    int incl[8];
#pragma unroll
    for (int i = 0; i < 8; i++) {
        int x = v[i];
        for (int o = 1; o < 32; o <<= 1) {
            int y = __shfl_up_sync(0xffffffffu, x, o);
            if (lane >= o) x += y;
        }
        incl[i] = x;
        if (lane == 31) s_w[warp][i] = x;
    }
    __syncthreads();
    if (warp == 0) {
#pragma unroll
        for (int i = 0; i < 8; i++) {
            int x = lane < nw ? s_w[lane][i] : 0;
            for (int o = 1; o < 32; o <<= 1) {
                int y = __shfl_up_sync(0xffffffffu, x, o);
                if (lane >= o) x += y;
            }
            if (lane < nw) s_w[lane][i] = x;
        }
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < 8; i++) {
        v[i] = (warp > 0 ? s_w[warp - 1][i] : 0) + incl[i] - v[i];
        tot[i] = s_w[nw - 1][i];
    }
    __syncthreads();
}

__device__ __forceinline__ int owner_of(const a2a_kp &p, int t, int k, unsigned long long round) {
    const int id = p.ids[(size_t)t * p.K + k];
    if (id < 0 || id >= p.E) {
        raise_error(p, A2A_GPU_E_EXPERT, p.me, 0, t, k, id, round);
        return 0;
    }
    return p.owner[id];
}

/* Is slot k the first of token t that goes to rank r? Else the earlier slot (>= 0). */
__device__ __forceinline__ int first_slot_of(const a2a_kp &p, int t, int k, int r,
                                             unsigned long long round) {
    for (int k2 = 0; k2 < k; k2++)
        if (owner_of(p, t, k2, round) == r) return k2;
    return -1;
}

__global__ void __launch_bounds__(A2A_GPU_ROUTE_THREADS) a2a_route_kernel(a2a_kp p) {
    pdl_trigger_(); /* the dispatch kernel may launch now; it waits for this one to finish */
    __shared__ int s_w[32][8];
    if (broken(p)) return;
    const unsigned long long round = p.st->round, v = 2 * round + 1;
    const int T = p.T, K = p.K, nt = blockDim.x, tid = threadIdx.x;
    const int per = (T + nt - 1) / nt;
    const int t0 = min(T, tid * per), t1 = min(T, t0 + per);
    for (int rg = 0; rg < p.ep; rg += 8) {
        int cnt[8] = {0, 0, 0, 0, 0, 0, 0, 0}, tot[8];
        for (int t = t0; t < t1; t++)
            for (int k = 0; k < K; k++) {
                const int r = owner_of(p, t, k, round);
                if (r >= rg && r < rg + 8 && first_slot_of(p, t, k, r, round) < 0) {
#pragma unroll
                    for (int i = 0; i < 8; i++)
                        cnt[i] += i == r - rg;
                }
            }
        block_scan8(cnt, tot, s_w);
        for (int t = t0; t < t1; t++)
            for (int k = 0; k < K; k++) {
                const int r = owner_of(p, t, k, round);
                if (r < rg || r >= rg + 8) continue;
                const size_t tk = (size_t)t * K + k;
                const int k2 = first_slot_of(p, t, k, r, round);
                int s = 0;
                if (k2 >= 0) {
                    s = p.slot_index[(size_t)t * K + k2];
                } else {
#pragma unroll
                    for (int i = 0; i < 8; i++)
                        if (i == r - rg) s = cnt[i]++;
                    p.inv[(size_t)r * p.M + s] = t;
                }
                p.slot_rank[tk] = r;
                p.slot_index[tk] = s;
            }
        if (tid < 8 && rg + tid < p.ep) {
            int c = 0;
#pragma unroll
            for (int i = 0; i < 8; i++)
                if (i == tid) c = tot[i];
            p.st->send[rg + tid] = c;
        }
        __syncthreads();
    }
    __syncthreads();
    /* Count lines, before any payload: receivers learn their row offsets early. */
    for (int r = tid; r < p.ep; r += nt) {
        const int c = p.st->send[r];
        if (p.one_sided) {
            a2a_gpu_count_line *line =
                (a2a_gpu_count_line *)(p.peer[r] + p.off_count + (size_t)p.me * A2A_GPU_LINE);
            line->count = c;
            line->runtime_max = p.rm;
            st_release_sys(&line->flag, v);
        } else {
            p.cnt_out[r].count = c;
            p.cnt_out[r].runtime_max = p.rm;
            p.cnt_out[r].flag = v;
        }
    }
}

/* ---- dispatch ---- */

__device__ __forceinline__ int cdiv(int a, int b) { return (a + b - 1) / b; }

/* Item i of the SEND list: targets me+1, me+2, ... (mod ep), each cdiv(count[r], ch) chunks.
 * Returns the target, or -1 past the end; *c = the chunk. */
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

/* All count lines of this round: every rank's count for me and its runtime_max. Block-wide;
 * false when the round cannot go on (the error is recorded). */
__device__ bool read_counts(const a2a_kp &p, unsigned long long round, int *s_count, int *s_begin,
                            int *s_ok) {
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
            s_count[q] = c;
            s_begin[q] = sum;
            sum += c;
        }
        s_begin[p.ep] = sum;
        *s_ok = ok;
    }
    __syncthreads();
    return *s_ok;
}

__global__ void __launch_bounds__(A2A_GPU_THREADS) a2a_dispatch_kernel(a2a_kp p) {
    __shared__ int s_send[A2A_MAX_RANKS], s_count[A2A_MAX_RANKS], s_begin[A2A_MAX_RANKS + 1];
    __shared__ int s_ok;
    __shared__ float s_red[32], s_lut[256];
    pdl_wait_();
    if (broken(p)) return;
    const int tid = threadIdx.x, me = p.me, ch = p.ch, G = gridDim.x;
    const unsigned long long round = p.st->round, v = 2 * round + 1;
    for (int i = tid; i < 256; i += blockDim.x)
        s_lut[i] = fp8_e4m3_to_float((uint8_t)i);
    for (int r = tid; r < p.ep; r += blockDim.x)
        s_send[r] = p.st->send[r];
    __syncthreads();

    /* SEND items, then SELF items, one list over the blocks */
    const int n_self = (p.roles & A2A_GPU_SELF) ? cdiv(s_send[me], ch) : 0;
    int n_send = 0;
    if (p.roles & A2A_GPU_SEND)
        for (int q = 1; q < p.ep; q++)
            n_send += cdiv(s_send[(me + q) % p.ep], ch);
    bool have_counts = false;
    for (int it = blockIdx.x; it < n_send + n_self; it += G) {
        if (it < n_send) {
            int c = 0;
            const int r = nth_item(p, s_send, it, &c);
            char *dst = p.one_sided
                            ? p.peer[r] + p.off_recv + (size_t)me * p.rm * p.rec
                            : p.send_buf + (size_t)r * p.rm * p.rec;
            const int j1 = min(s_send[r], (c + 1) * ch);
            for (int j = c * ch; j < j1; j++)
                encode_token(p, dst + (size_t)j * p.rec, p.inv[(size_t)r * p.M + j], r, s_red);
            if (p.one_sided) {
                __syncthreads();
                if (tid == 0) {
                    __threadfence_system();
                    st_release_sys((unsigned long long *)(p.peer[r] + p.off_dchunk) +
                                       (size_t)me * A2A_GPU_NCHUNK + c,
                                   v);
                }
            }
        } else {
            if (!have_counts) {
                if (!read_counts(p, round, s_count, s_begin, &s_ok)) return;
                have_counts = true;
            }
            const int c = it - n_send, j1 = min(s_send[me], (c + 1) * ch);
            for (int j = c * ch; j < j1; j++) {
                char *rec = p.recv_base + ((size_t)me * p.rm + j) * p.rec;
                encode_token(p, rec, p.inv[(size_t)me * p.M + j], me, s_red);
                __syncthreads();
                decode_token(p, s_begin[me] + j, rec, s_lut);
            }
        }
        __syncthreads();
    }
    if (!(p.roles & (A2A_GPU_SELF | A2A_GPU_RECV))) return;
    if (!have_counts && !read_counts(p, round, s_count, s_begin, &s_ok)) return;
    if (blockIdx.x == 0) {
        for (int q = tid; q < p.ep; q += blockDim.x) {
            p.st->count[q] = s_count[q];
            p.st->begin[q] = s_begin[q];
        }
        if (tid == 0) {
            p.st->begin[p.ep] = s_begin[p.ep];
            p.st->n = s_begin[p.ep];
        }
    }
    if (!(p.roles & A2A_GPU_RECV)) return;
    /* RECV items from the top block down, so they land on the blocks with the least to send */
    int n_recv = 0;
    for (int q = 1; q < p.ep; q++)
        n_recv += cdiv(s_count[(me + q) % p.ep], ch);
    for (int it = G - 1 - blockIdx.x; it < n_recv; it += G) {
        int c = 0;
        const int src = nth_item(p, s_count, it, &c);
        if (p.one_sided) {
            if (tid == 0)
                s_ok = wait_flag(p,
                                 (const unsigned long long *)(p.peer[me] + p.off_dchunk) +
                                     (size_t)src * A2A_GPU_NCHUNK + c,
                                 v, src, A2A_GPU_W_DISPATCH_DATA, round);
            __syncthreads();
            if (!s_ok) return;
        }
        const int j1 = min(s_count[src], (c + 1) * ch);
        for (int j = c * ch; j < j1; j++)
            decode_token(p, s_begin[src] + j, p.recv_base + ((size_t)src * p.rm + j) * p.rec,
                         s_lut);
        __syncthreads();
    }
}

/* ---- combine ---- */

/* Block-wide: received row i's return to its home at dst (slots: the owned slots' fp32 rows at
 * [K][D]; partial: the BF16 weighted sum of them in slot order). */
__device__ void pack_return(const a2a_kp &p, char *dst, int i, int *s_ids, float *s_w) {
    const int D = p.D, K = p.K, tid = threadIdx.x, nt = blockDim.x;
    for (int k = tid; k < K; k += nt) {
        s_ids[k] = p.rids[(size_t)i * K + k];
        s_w[k] = p.rw[(size_t)i * K + k];
    }
    __syncthreads();
    const float *eo = p.eo + (size_t)i * K * D;
    if (!p.partial) {
        for (int k = 0; k < K; k++) {
            if (s_ids[k] < 0) continue;
            float4 *o = (float4 *)(dst + (size_t)k * D * 4);
            const float4 *s = (const float4 *)(eo + (size_t)k * D);
            for (int c = tid; c < D / 4; c += nt)
                o[c] = s[c];
        }
    } else {
        for (int c = tid * 8; c < D; c += nt * 8) {
            float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            for (int k = 0; k < K; k++) {
                if (s_ids[k] < 0) continue;
                const float wk = s_w[k];
                const float4 a = *(const float4 *)(eo + (size_t)k * D + c);
                const float4 b = *(const float4 *)(eo + (size_t)k * D + c + 4);
                const float e[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
                for (int q = 0; q < 8; q++)
                    acc[q] = __fadd_rn(acc[q], __fmul_rn(wk, e[q]));
            }
            uint4 o;
            o.x = bf16_rne(acc[0]) | (uint32_t)bf16_rne(acc[1]) << 16;
            o.y = bf16_rne(acc[2]) | (uint32_t)bf16_rne(acc[3]) << 16;
            o.z = bf16_rne(acc[4]) | (uint32_t)bf16_rne(acc[5]) << 16;
            o.w = bf16_rne(acc[6]) | (uint32_t)bf16_rne(acc[7]) << 16;
            *(uint4 *)(dst + (size_t)c * 2) = o;
        }
    }
    __syncthreads();
}

__global__ void __launch_bounds__(A2A_GPU_THREADS) a2a_combine_kernel(a2a_kp p) {
    __shared__ int s_send[A2A_MAX_RANKS], s_count[A2A_MAX_RANKS], s_begin[A2A_MAX_RANKS + 1];
    __shared__ int s_ids[A2A_GPU_KMAX], s_ok, s_nr, s_rr[A2A_GPU_KMAX], s_rj[A2A_GPU_KMAX];
    __shared__ float s_w[A2A_GPU_KMAX];
    __shared__ unsigned long long s_seen[A2A_MAX_RANKS];
    pdl_wait_();
    if (broken(p)) return;
    const int tid = threadIdx.x, me = p.me, ch = p.ch, G = gridDim.x, D = p.D, K = p.K;
    const unsigned long long round = p.st->round, v = 2 * round + 2;
    const size_t ret = p.partial ? (size_t)D * 2 : (size_t)K * D * 4; /* one return */
    for (int r = tid; r < p.ep; r += blockDim.x) {
        s_send[r] = p.st->send[r];
        s_count[r] = p.st->count[r];
        s_begin[r] = p.st->begin[r];
        s_seen[r] = ~0ull;
    }
    if (tid == 0) s_ok = 1;
    __syncthreads();

    /* SEND then SELF items */
    int n_send = 0;
    if (p.roles & A2A_GPU_SEND)
        for (int q = 1; q < p.ep; q++)
            n_send += cdiv(s_count[(me + q) % p.ep], ch);
    const int n_self = (p.roles & A2A_GPU_SELF) ? cdiv(s_count[me], ch) : 0;
    for (int it = blockIdx.x; it < n_send + n_self; it += G) {
        int c = 0, r = me;
        if (it < n_send)
            r = nth_item(p, s_count, it, &c);
        else
            c = it - n_send;
        const int j1 = min(s_count[r], (c + 1) * ch);
        if (r != me) {
            char *dst = p.one_sided ? p.peer[r] + p.off_comb + (size_t)me * p.rm * ret
                                    : p.csend_buf + (size_t)r * p.rm * ret;
            for (int j = c * ch; j < j1; j++)
                pack_return(p, dst + (size_t)j * ret, s_begin[r] + j, s_ids, s_w);
            __syncthreads();
            if (p.one_sided && tid == 0) {
                __threadfence_system();
                st_release_sys((unsigned long long *)(p.peer[r] + p.off_cchunk) +
                                   (size_t)me * A2A_GPU_NCHUNK + c,
                               v);
            }
        } else if (p.partial) { /* own tokens' partial sums into the local region */
            for (int j = c * ch; j < j1; j++)
                pack_return(p, p.comb_base + ((size_t)me * p.rm + j) * ret, s_begin[me] + j, s_ids,
                            s_w);
            __syncthreads();
            if (p.one_sided && tid == 0) {
                __threadfence_system();
                st_release_sys((unsigned long long *)(p.peer[me] + p.off_cchunk) +
                                   (size_t)me * A2A_GPU_NCHUNK + c,
                               v);
            }
        } else { /* own tokens' slots straight into out */
            for (int j = c * ch; j < j1; j++) {
                const int i = s_begin[me] + j, t = p.inv[(size_t)me * p.M + j];
                for (int k = 0; k < K; k++) {
                    if (p.rids[(size_t)i * K + k] < 0) continue;
                    const float4 *s = (const float4 *)(p.eo + ((size_t)i * K + k) * D);
                    float4 *o = (float4 *)(p.out + ((size_t)t * K + k) * D);
                    for (int q = tid; q < D / 4; q += blockDim.x)
                        o[q] = s[q];
                }
            }
        }
        __syncthreads();
    }

    /* RECV (home): gather the returns */
    if (p.roles & A2A_GPU_RECV) {
        if (!p.partial) {
            int n_recv = 0;
            for (int q = 1; q < p.ep; q++)
                n_recv += cdiv(s_send[(me + q) % p.ep], ch);
            for (int it = G - 1 - blockIdx.x; it < n_recv && s_ok; it += G) {
                int c = 0;
                const int src = nth_item(p, s_send, it, &c);
                if (p.one_sided) {
                    if (tid == 0)
                        s_ok = wait_flag(p,
                                         (const unsigned long long *)(p.peer[me] + p.off_cchunk) +
                                             (size_t)src * A2A_GPU_NCHUNK + c,
                                         v, src, A2A_GPU_W_COMBINE_DATA, round);
                    __syncthreads();
                    if (!s_ok) break;
                }
                const int j1 = min(s_send[src], (c + 1) * ch);
                for (int j = c * ch; j < j1; j++) {
                    const int t = p.inv[(size_t)src * p.M + j];
                    const char *row = p.comb_base + ((size_t)src * p.rm + j) * ret;
                    for (int k = 0; k < K; k++) {
                        if (p.slot_rank[(size_t)t * K + k] != src) continue;
                        const float4 *s = (const float4 *)(row + (size_t)k * D * 4);
                        float4 *o = (float4 *)(p.out + ((size_t)t * K + k) * D);
                        for (int q = tid; q < D / 4; q += blockDim.x)
                            o[q] = __ldcg(s + q);
                    }
                }
                __syncthreads();
            }
        } else {
            const int n_recv = cdiv(p.T, ch);
            for (int it = G - 1 - blockIdx.x; it < n_recv && s_ok; it += G) {
                const int t1 = min(p.T, (it + 1) * ch);
                for (int t = it * ch; t < t1 && s_ok; t++) {
                    if (tid == 0) { /* the ranks of t's slots, in rank order, and t's rows there */
                        int nr = 0;
                        for (int k = 0; k < K; k++) {
                            const int r = p.slot_rank[(size_t)t * K + k];
                            const int j = p.slot_index[(size_t)t * K + k];
                            int pos = nr;
                            bool dup = false;
                            for (int q = 0; q < nr; q++)
                                if (s_rr[q] == r) dup = true;
                            if (dup) continue;
                            while (pos > 0 && s_rr[pos - 1] > r) {
                                s_rr[pos] = s_rr[pos - 1];
                                s_rj[pos] = s_rj[pos - 1];
                                pos--;
                            }
                            s_rr[pos] = r;
                            s_rj[pos] = j;
                            nr++;
                        }
                        s_nr = nr;
                        if (p.one_sided)
                            for (int q = 0; q < nr && s_ok; q++) {
                                const int r = s_rr[q], c = s_rj[q] / ch;
                                if (s_seen[r] == (unsigned long long)c) continue;
                                if (!wait_flag(p,
                                               (const unsigned long long *)(p.peer[me] +
                                                                            p.off_cchunk) +
                                                   (size_t)r * A2A_GPU_NCHUNK + c,
                                               v, r, A2A_GPU_W_COMBINE_DATA, round))
                                    s_ok = 0;
                                s_seen[r] = c;
                            }
                    }
                    __syncthreads();
                    if (!s_ok) break;
                    for (int c = tid * 8; c < D; c += blockDim.x * 8) {
                        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
                        for (int q = 0; q < s_nr; q++) {
                            const uint4 b = __ldcg(
                                (const uint4 *)(p.comb_base +
                                                ((size_t)s_rr[q] * p.rm + s_rj[q]) * ret +
                                                (size_t)c * 2));
                            const uint32_t h[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
                            for (int e = 0; e < 4; e++) {
                                acc[2 * e] = __fadd_rn(acc[2 * e], bf16_f32(h[e] & 0xffff));
                                acc[2 * e + 1] = __fadd_rn(acc[2 * e + 1], bf16_f32(h[e] >> 16));
                            }
                        }
                        float4 *o = (float4 *)(p.out + (size_t)t * D + c);
                        o[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
                        o[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
                    }
                    __syncthreads();
                }
            }
        }
    }
    if (!(p.roles & A2A_GPU_FINISH)) return;
    /* FINISH: the last block through tells every rank this one is done, waits for all of them,
     * then advances the round (every block read it before arriving). */
    __syncthreads();
    if (tid != 0) return;
    __threadfence();
    const unsigned int prev = atomicAdd(&p.st->arrive, 1u);
    if (prev != (unsigned int)G - 1) return;
    __threadfence();
    if (p.one_sided) {
        __threadfence_system();
        for (int r = 0; r < p.ep; r++)
            st_release_sys((unsigned long long *)(p.peer[r] + p.off_cdone +
                                                  (size_t)me * A2A_GPU_LINE),
                           v);
        for (int r = 0; r < p.ep; r++)
            if (!wait_flag(p,
                           (const unsigned long long *)(p.peer[me] + p.off_cdone +
                                                        (size_t)r * A2A_GPU_LINE),
                           v, r, A2A_GPU_W_COMBINE_END, round))
                return;
    }
    p.st->arrive = 0;
    if (!broken(p)) p.st->round = round + 1;
}

/* ---- host ---- */

size_t a2a_gpu_record_bytes(const a2a_gpu *a) { return a ? (size_t)a->rec : 0; }

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
    kp->ch = a->runtime_max > 0 ? (a->runtime_max + A2A_GPU_NCHUNK - 1) / A2A_GPU_NCHUNK : 1;
    kp->nch = (a->runtime_max + kp->ch - 1) / kp->ch;
    kp->payload = (int)c->payload;
    kp->one_sided = c->transport == A2A_NVLINK_ONE_SIDED;
    kp->rec = a->rec;
    kp->off_sc = a->off_sc;
    kp->off_s2 = a->off_s2;
    kp->off_ids = a->off_ids;
    kp->off_w = a->off_w;
    kp->timeout_ns = (unsigned long long)(c->timeout_s * 1e9);
    kp->st = a->st;
    kp->herr = a->herr_dev;
    kp->owner = a->owner;
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
    return launch(a, a2a_dispatch_kernel, grid, A2A_GPU_THREADS, true, kp, s,
                  "the dispatch kernel's launch", err, errlen);
}

int a2a_gpu_launch_combine(a2a_gpu *a, const a2a_kp *kp, cudaStream_t s, char *err,
                           size_t errlen) {
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
    if (comm == MPI_COMM_NULL) return gerr(err, errlen, "all-to-all: the communicator is NULL");
    MPI_Comm_size(comm, &size);
    MPI_Comm_rank(comm, &rank);
    if (c->ep_size != size || c->rank != rank)
        return gerr(err, errlen,
                    "all-to-all: config says rank %d of %d, the communicator rank %d of %d",
                    c->rank, c->ep_size, rank, size);
    if (c->ep_size < 1 || c->ep_size > A2A_MAX_RANKS)
        return gerr(err, errlen, "all-to-all: ep_size %d outside [1, %d]", c->ep_size,
                    A2A_MAX_RANKS);
    if (c->transport != A2A_NVLINK_ONE_SIDED && c->transport != A2A_NCCL)
        return gerr(err, errlen,
                    "all-to-all: the GPU all-to-all serves nvlink_one_sided and nccl, not %s",
                    a2a_transport_name(c->transport));
    if (c->max_tokens_per_rank < 1)
        return gerr(err, errlen, "all-to-all: max_tokens_per_rank %d must be >= 1",
                    c->max_tokens_per_rank);
    if (c->hidden < 16 || c->hidden % 16 != 0)
        return gerr(err, errlen,
                    "all-to-all: the GPU transports need hidden %% 16 == 0 (vector stores), "
                    "hidden is %d",
                    c->hidden);
    if ((unsigned)c->payload > (unsigned)A2A_PAYLOAD_NVFP4)
        return gerr(err, errlen, "all-to-all: unknown payload %d", (int)c->payload);
    if (c->n_experts < 1 || c->top_k < 1 || c->top_k > c->n_experts || c->top_k > A2A_GPU_KMAX)
        return gerr(err, errlen, "all-to-all: top_k %d outside [1, min(n_experts = %d, %d)]",
                    c->top_k, c->n_experts, A2A_GPU_KMAX);
    if (c->expert_begin[0] != 0 || c->expert_begin[c->ep_size] != c->n_experts)
        return gerr(err, errlen, "all-to-all: expert_begin must run from 0 to n_experts = %d",
                    c->n_experts);
    for (int r = 0; r < c->ep_size; r++)
        if (c->expert_begin[r + 1] < c->expert_begin[r])
            return gerr(err, errlen, "all-to-all: expert_begin decreases at rank %d", r);
    if (!(c->timeout_s >= 0) || c->timeout_s > 1e6)
        return gerr(err, errlen, "all-to-all: timeout_s %g outside [0, 1e6]", c->timeout_s);
    return 0;
}

/* Every rank's verdict and the shared fields, as min and max in one MPI_Allreduce. */
static int config_agree(const a2a_config *c, MPI_Comm comm, int ok, char *err, size_t errlen) {
    enum { N = 8 };
    uint32_t h = 2166136261u;
    for (int r = 0; r <= c->ep_size && r <= A2A_MAX_RANKS; r++)
        h = (h ^ (uint32_t)c->expert_begin[r]) * 16777619u;
    int v[2 * N] = {ok, (int)c->transport, c->max_tokens_per_rank, c->hidden, c->top_k,
                    c->n_experts, (int)(h & 0x7fffffff), (int)c->payload};
    static const char *names[N] = {"ok",    "transport", "max_tokens_per_rank", "hidden",
                                   "top_k", "n_experts", "expert_begin",        "payload"};
    int r[2 * N];
    for (int i = 0; i < N; i++)
        v[N + i] = -v[i];
    if (MPI_Allreduce(v, r, 2 * N, MPI_INT, MPI_MAX, comm) != MPI_SUCCESS)
        return gerr(err, errlen, "all-to-all: MPI_Allreduce failed while checking the config");
    if (-r[N] != 1) {
        if (ok) gerr(err, errlen, "all-to-all: another rank rejected the config (see its message)");
        return -1;
    }
    for (int i = 1; i < N; i++)
        if (r[i] != -r[N + i])
            return gerr(err, errlen,
                        "all-to-all: %s differs between ranks (%d .. %d): every rank must pass "
                        "the same config",
                        names[i], -r[N + i], r[i]);
    return 0;
}

/* Every rank succeeded? (a collective: all keep the object or all free it) */
static bool all_ok(MPI_Comm comm, bool ok) {
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

static int ipc_setup(a2a_gpu *a, char *err, size_t errlen) {
    const int ep = a->cfg.ep_size, me = a->cfg.rank;
    cudaIpcMemHandle_t h, *all = (cudaIpcMemHandle_t *)calloc((size_t)ep, sizeof h);
    int rc = -1;
    TRY(cudaIpcGetMemHandle(&h, a->seg), "cudaIpcGetMemHandle of the segment");
    if (MPI_Allgather(&h, (int)sizeof h, MPI_BYTE, all, (int)sizeof h, MPI_BYTE, a->comm) !=
        MPI_SUCCESS) {
        gerr(err, errlen, "all-to-all rank %d: MPI_Allgather of the IPC handles failed", me);
        goto fail;
    }
    for (int p = 0; p < ep; p++) {
        if (p == me) {
            a->peer_host[p] = a->seg;
            continue;
        }
        void *ptr = NULL;
        cudaError_t e = cudaIpcOpenMemHandle(&ptr, all[p], cudaIpcMemLazyEnablePeerAccess);
        if (e != cudaSuccess) {
            gerr(err, errlen,
                 "all-to-all rank %d: cudaIpcOpenMemHandle of rank %d's segment failed: %s "
                 "(nvlink_one_sided needs every rank's GPU in one node with peer access; use "
                 "nccl otherwise)",
                 me, p, cudaGetErrorString(e));
            goto fail;
        }
        a->peer_host[p] = (char *)ptr;
    }
    rc = 0;
fail:
    free(all);
    return rc;
}

a2a_gpu *a2a_gpu_create(const a2a_config *cfg, MPI_Comm comm, char *err, size_t errlen) {
    if (!cfg) {
        gerr(err, errlen, "all-to-all: no config");
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
    const char *pdl = getenv("MOESERVE_A2A_PDL");
    a->pdl = !(pdl && strcmp(pdl, "0") == 0);
    record_layout(a);
    const int ep = cfg->ep_size, M = cfg->max_tokens_per_rank, D = cfg->hidden,
              K = cfg->top_k, E = cfg->n_experts;
    bool good = false;
    int32_t *owner = (int32_t *)malloc((size_t)E * sizeof(int32_t));
    if (MPI_Comm_dup(comm, &a->comm) != MPI_SUCCESS) {
        gerr(err, errlen, "all-to-all: MPI_Comm_dup failed");
        a->comm = MPI_COMM_NULL;
        free(owner);
        free(a);
        return NULL;
    }
    for (int r = 0; r < ep; r++)
        for (int e = cfg->expert_begin[r]; e < cfg->expert_begin[r + 1]; e++)
            owner[e] = r;
    {
        TRY(cudaGetDevice(&a->device), "cudaGetDevice");
        TRY(cudaDeviceGetAttribute(&a->n_sm, cudaDevAttrMultiProcessorCount, a->device),
            "cudaDeviceGetAttribute");
        int occ_d = 0, occ_c = 0;
        TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ_d, a2a_dispatch_kernel,
                                                          A2A_GPU_THREADS, 0),
            "the occupancy query");
        TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ_c, a2a_combine_kernel,
                                                          A2A_GPU_THREADS, 0),
            "the occupancy query");
        /* one SM's worth left for the route kernel that overlaps the dispatch under PDL */
        a->cap_dispatch = (a->n_sm - 1) * (occ_d > 0 ? occ_d : 1);
        a->cap_combine = (a->n_sm - 1) * (occ_c > 0 ? occ_c : 1);
        TRY(cudaMalloc((void **)&a->st, sizeof(a2a_gpu_state)), "cudaMalloc of the state");
        TRY(cudaMemset(a->st, 0, sizeof(a2a_gpu_state)), "cudaMemset");
        TRY(cudaHostAlloc((void **)&a->herr, sizeof(a2a_gpu_err), cudaHostAllocMapped),
            "cudaHostAlloc (mapped) of the error record");
        memset(a->herr, 0, sizeof(a2a_gpu_err));
        TRY(cudaHostGetDevicePointer((void **)&a->herr_dev, a->herr, 0),
            "cudaHostGetDevicePointer");
        TRY(cudaMalloc((void **)&a->owner, (size_t)E * 4), "cudaMalloc");
        TRY(cudaMemcpy(a->owner, owner, (size_t)E * 4, cudaMemcpyHostToDevice), "cudaMemcpy");
        TRY(cudaMalloc((void **)&a->ebegin, (size_t)(ep + 1) * 4), "cudaMalloc");
        TRY(cudaMemcpy(a->ebegin, cfg->expert_begin, (size_t)(ep + 1) * 4,
                       cudaMemcpyHostToDevice),
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
            TRY(cudaMalloc((void **)&a->seg, a->seg_bytes), "cudaMalloc of the segment");
            TRY(cudaMemset(a->seg, 0, a->off_recv), "cudaMemset of the segment's header");
            TRY(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
            if (ipc_setup(a, err, errlen) != 0) goto fail;
            TRY(cudaMalloc((void **)&a->peer_dev, (size_t)ep * sizeof(char *)), "cudaMalloc");
            TRY(cudaMemcpy(a->peer_dev, a->peer_host, (size_t)ep * sizeof(char *),
                           cudaMemcpyHostToDevice),
                "cudaMemcpy");
        } else if (a2a_nccl_init(a, err, errlen) != 0) {
            goto fail;
        }
        good = true;
    }
fail:
    free(owner);
    /* Every header is zeroed before any rank may write a flag into it. */
    if (!all_ok(a->comm, good)) {
        if (good)
            gerr(err, errlen,
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
    cudaDeviceSynchronize();
    if (a->comm != MPI_COMM_NULL) MPI_Barrier(a->comm); /* no peer still writes into us */
    if (a->cfg.transport == A2A_NCCL) a2a_nccl_free(a);
    if (a->peer_host)
        for (int p = 0; p < a->cfg.ep_size; p++)
            if (p != a->cfg.rank && a->peer_host[p]) cudaIpcCloseMemHandle(a->peer_host[p]);
    free(a->peer_host);
    cudaFree(a->peer_dev);
    cudaFree(a->seg);
    cudaFree(a->st);
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
        return gerr(err, errlen, "all-to-all rank %d: %s refused: the all-to-all failed earlier (%s)",
                    a->cfg.rank, call, a->broken_why);
    if (a->phase == A2A_GPU_DISPATCHED)
        return gerr(err, errlen,
                    "all-to-all rank %d: dispatch called twice without a combine: every dispatch "
                    "must be followed by its combine",
                    a->cfg.rank);
    return gerr(err, errlen, "all-to-all rank %d: combine called without a dispatch", a->cfg.rank);
}

int a2a_gpu_dispatch(a2a_gpu *a, const float *x, const int32_t *topk_ids, const float *topk_w,
                     int T, int runtime_max, void *stream, char *err, size_t errlen) {
    if (!a) return gerr(err, errlen, "all-to-all: dispatch on a NULL object");
    if (a->phase != A2A_GPU_IDLE) return phase_error(a, "dispatch", err, errlen);
    if (runtime_max < 0 || runtime_max > a->cfg.max_tokens_per_rank)
        return gerr(err, errlen,
                    "all-to-all rank %d: runtime_max %d outside [0, max_tokens_per_rank = %d]",
                    a->cfg.rank, runtime_max, a->cfg.max_tokens_per_rank);
    if (T < 0 || T > runtime_max)
        return gerr(err, errlen, "all-to-all rank %d: T = %d tokens outside [0, runtime_max = %d]",
                    a->cfg.rank, T, runtime_max);
    if (T > 0 && (!x || !topk_ids || !topk_w))
        return gerr(err, errlen, "all-to-all rank %d: dispatch of %d tokens with a NULL input",
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
        rc = a2a_gpu_launch_route(a, &kp, a->stream, err, errlen);
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
    if (!a) return gerr(err, errlen, "all-to-all: combine on a NULL object");
    if (a->phase != A2A_GPU_DISPATCHED) return phase_error(a, "combine", err, errlen);
    if (a->T > 0 && !out)
        return gerr(err, errlen, "all-to-all rank %d: combine with a NULL out for %d tokens",
                    a->cfg.rank, a->T);
    if (a->runtime_max > 0 && !expert_out)
        return gerr(err, errlen, "all-to-all rank %d: combine with a NULL expert_out",
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
    if (!a) return gerr(err, errlen, "all-to-all: check on a NULL object");
    cudaError_t e = cudaStreamSynchronize(a->stream);
    if (e != cudaSuccess) {
        a->phase = A2A_GPU_BROKEN;
        snprintf(a->broken_why, sizeof a->broken_why, "the stream failed: %s",
                 cudaGetErrorString(e));
        return gerr(err, errlen, "all-to-all rank %d: the stream failed: %s", a->cfg.rank,
                    cudaGetErrorString(e));
    }
    const volatile a2a_gpu_err *r = a->herr;
    const int me = a->cfg.rank;
    char msg[320];
    static const char *where[] = {"dispatch", "dispatch data", "combine data", "combine end"};
    switch (r->code) {
    case A2A_GPU_E_NONE:
        if (a->phase == A2A_GPU_BROKEN)
            return gerr(err, errlen, "all-to-all rank %d: %s", me, a->broken_why);
        return 0;
    case A2A_GPU_E_TIMEOUT:
        snprintf(msg, sizeof msg,
                 "all-to-all rank %d: rank %d did not arrive within %g s (%s, round %llu); a "
                 "peer that died or skipped this step leaves the group unusable",
                 me, r->peer, a->cfg.timeout_s, where[r->where & 3], r->round);
        break;
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
    default:
        snprintf(msg, sizeof msg, "all-to-all rank %d: unknown error %d", me, r->code);
        break;
    }
    a->phase = A2A_GPU_BROKEN;
    snprintf(a->broken_why, sizeof a->broken_why, "%s", msg);
    return gerr(err, errlen, "%s", msg);
}
