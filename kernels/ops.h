/* The backend op table: the only interface between the model code and the kernels.
 *
 * Shape letters, written once:
 *   T  tokens in the batch          D   hidden size           V  vocabulary
 *   H  query heads                  Hkv key/value heads       Dh head dim
 *   E  experts                      K   experts per token     F  FFN width (expert or dense)
 *   P  KV pages                     S   tokens per KV page    N, Kin  linear out / in features
 *
 * Activations are float32 buffers on the backend's device (dev_alloc); so are the index arrays
 * (ids, pos, seq, page tables, top-k ids) and the KV cache. Weights are tensors, made usable by
 * upload / prepare_experts (BF16, F16 or F32; on a backend that has them, FP8 and NVFP4 experts
 * and FP8 projections through the optional prepare_* hooks). Arguments go outputs, inputs, sizes.
 * Every op of every backend has the CPU version in kernels/cpu/ as its reference. */
#ifndef MOESERVE_OPS_H
#define MOESERVE_OPS_H

#include "common/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Where each token of a batch sits in the paged KV cache. Token t belongs to sequence seq[t]
 * and has absolute position pos[t]; the KV of position p of sequence s lives in page
 * page_table[s * max_pages + p / S], slot p % S. A token attends to positions 0..pos[t] of its
 * own sequence (causal), which must already be stored (kv_store runs first). */
typedef struct {
    int T;
    const int32_t *pos;        /* [T] */
    const int32_t *seq;        /* [T] */
    const int32_t *page_table; /* [n_seq, max_pages] */
    int max_pages;
    int page_size; /* S */
} attn_batch;

/* One paged KV cache layer: k and v are [P, S, Hkv, Dh] float32, or with bf16 set bfloat16 (the
 * pointers then address uint16_t elements: kv_k_bf16 / kv_v_bf16). The stores round k and v to
 * nearest even once; attention widens them back exactly, so it computes what it would over an
 * fp32 cache that held the rounded values. */
typedef struct {
    float *k;
    float *v;
    int bf16;
} kv_layer;
static inline uint16_t *kv_k_bf16(kv_layer kv) { return (uint16_t *)(void *)kv.k; }
static inline uint16_t *kv_v_bf16(kv_layer kv) { return (uint16_t *)(void *)kv.v; }

/* The weights of one MoE layer's experts, hub layout: per expert gate/up [F, D], down [D, F].
 * A backend that wants them in one piece makes its own copy once, in prepare_experts: CUDA keeps
 * gate_up [E, 2F, D] (expert e's gate rows, then its up rows) and down [E, D, F] on the device,
 * in the checkpoint's dtype. The CPU reads the per-expert tensors and leaves these NULL. */
typedef struct moe_experts { /* the tag: C++ sees the member moe_experts below in ops */
    int E;
    const tensor *gate; /* [E] tensors of [F, D] */
    const tensor *up;   /* [E] tensors of [F, D] */
    const tensor *down; /* [E] tensors of [D, F] */
    void *gate_up;      /* backend copy [E, 2F, D] or NULL */
    void *down_all;     /* backend copy [E, D, F] or NULL */
    dtype wdtype;       /* dtype of the backend copies */
    /* MOE_W_NVFP4 (CUDA, cuda_prepare_experts_nvfp4): the backend copies hold NVFP4 codes, two a
     * byte (gate_up [E, 2F, D / 2], down_all [E, D, F / 2], wdtype U8), with their E4M3 group
     * scales (gate_up_sf [E, 2F, D / 16], down_sf [E, D, F / 16]) and tensor scales s2 [E, 3]
     * (gate, up, down), all on the device, as the checkpoint stores them up to an arrangement
     * the GEMMs read faster (moe.cu's nvfp4_pack_kernel: codes reordered within each 64 values of
     * a row, scales re-encoded, s2 times 2^7); the host tensors hold the dequantized weights.
     * MOE_W_FP8 (CUDA, cuda_prepare_experts_fp8): E4M3 codes (gate_up [E, 2F, D], down_all
     * [E, D, F], wdtype U8, reordered within each 64 values of a row: moe.cu's fp8_pack_kernel)
     * and fp32 block scales a weight row each (gate_up_sf [E, ceil(D / 128), 2F], down_sf
     * [E, ceil(F / 128), D]: kernels/quant.h's quant_fp8_row_scales); s2 NULL.
     * MOE_W_NVFP4_SM100 (CUDA on compute capability 10.0 with MOESERVE_NVFP4_SM100=1, opt-in
     * until checked on such a GPU): the NVFP4 codes as the checkpoint stores them, the group
     * scales in the atoms of quant_nvfp4_sf_atoms (gate_up_sf over E 2F rows, down_sf over E D),
     * and s2 a tensor scale a 128 rows (gate_up's [E, 2F / 128], then down's [E, D / 128]), for
     * the NVFP4 x NVFP4 GEMMs of kernels/cuda/nvfp4_sm100.cu. */
    int wformat; /* MOE_W_PLAIN (0), MOE_W_NVFP4, MOE_W_FP8 or MOE_W_NVFP4_SM100 */
    void *gate_up_sf;
    void *down_sf;
    float *s2;
} moe_experts;
enum { MOE_W_PLAIN = 0, MOE_W_NVFP4 = 1, MOE_W_FP8 = 2, MOE_W_NVFP4_SM100 = 3 };

/* One logit row of ops->sample: what to do with it. The draw follows runner/sampler.c (its
 * header says the order: penalties -> temperature -> top-k -> top-p -> min-p -> draw). */
enum { SAMPLE_DRAW, SAMPLE_SCORE, SAMPLE_SKIP };
#define OPS_SAMPLE_GREEDY_EPS 1e-6f /* runner/sampler.h's SAMPLER_GREEDY_EPS */
#define OPS_SAMPLE_TOP_P_SLACK 1e-6 /* runner/sampler.c's SAMPLER_TOP_P_SLACK */
typedef struct {
    uint64_t seed;            /* SAMPLE_DRAW: the generator's key (the request's seed) */
    uint64_t position;        /* and its counter (the index of the token being sampled) */
    float temperature;        /* below OPS_SAMPLE_GREEDY_EPS: greedy */
    float top_p;              /* (0, 1]; 1 = off */
    float min_p;              /* [0, 1]; 0 = off */
    int32_t top_k;            /* -1 (all) or >= 1; 1 = greedy */
    float repetition_penalty; /* (0, 2]; 1 = off */
    float frequency_penalty;  /* 0 = off */
    float presence_penalty;   /* 0 = off */
    int32_t mode;             /* SAMPLE_DRAW, SAMPLE_SCORE (the logprob of target), SAMPLE_SKIP */
    int32_t target;           /* SAMPLE_SCORE: the token scored, in [0, V) */
    int32_t pen_start, n_pen; /* SAMPLE_DRAW: this row's penalty entries pen[pen_start ..) */
    int32_t want_logprob;     /* 1: logprobs[r] = log_softmax(the unpenalized row)[tokens[r]] */
    int32_t top_n;            /* top logprobs wanted, 0 .. the call's top_n_max */
    int32_t bias_start, n_bias; /* SAMPLE_DRAW: this row's logit bias bias[bias_start ..) */
    int32_t pad_;
} sample_row;

/* A token of a row's context for the penalties: each distinct id of prompt + output once, with
 * its count in the output (0: prompt only). Only output ids are needed when the repetition
 * penalty is off. */
typedef struct {
    int32_t id;
    int32_t count;
} sample_penalty;

/* A logit bias entry (runner/sampler.h's sampler_bias, the same layout): bias is added to token
 * id's logit after the penalties; a row's ids are distinct. */
typedef struct {
    int32_t id;
    float bias;
} sample_bias;

typedef struct ops {
    const char *name;
    device_kind device;

    /* ---- memory: buffers on the backend's device (the CPU: malloc, memcpy) ---- */
    /* bytes of device memory, uninitialized; NULL when there is not enough. */
    void *(*dev_alloc)(size_t bytes);
    void (*dev_free)(void *p);
    void (*to_device)(void *dst, const void *src, size_t bytes); /* host -> device */
    void (*to_host)(void *dst, const void *src, size_t bytes);   /* device -> host, after all
                                                                    work queued before it */
    void (*dev_zero)(void *p, size_t bytes);
    /* Make a weight usable by this backend's kernels: CUDA copies t->data (host, e.g. the
     * memory-mapped checkpoint) to the device once and points t->data there (t->device =
     * DEVICE_CUDA); the CPU leaves it where it is. 0, or -1 with a message. */
    int (*upload)(tensor *t, char *err, size_t errlen);
    /* The experts' backend copies (see moe_experts); the CPU does nothing. 0, or -1. */
    int (*prepare_experts)(moe_experts *w, char *err, size_t errlen);
    /* Optional (NULL where the backend has none): the experts in NVFP4 from host arrays in the
     * layout of moe_experts' MOE_W_NVFP4 fields (CUDA: cuda_prepare_experts_nvfp4). */
    int (*prepare_experts_nvfp4)(moe_experts *w, const uint8_t *gate_up_q,
                                 const uint8_t *gate_up_sf, const uint8_t *down_q,
                                 const uint8_t *down_sf, const float *s2, int D, int F, char *err,
                                 size_t errlen);
    /* Optional: the experts in FP8 from host arrays in the layout of moe_experts' MOE_W_FP8
     * fields, the codes in checkpoint order (CUDA: cuda_prepare_experts_fp8). */
    int (*prepare_experts_fp8)(moe_experts *w, const uint8_t *gate_up_q, const float *gate_up_s,
                               const uint8_t *down_q, const float *down_s, int D, int F, char *err,
                               size_t errlen);
    /* Optional: a dense weight [N, K] in block FP8 as a tensor this backend's linear takes
     * (*t: dtype DTYPE_F8_E4M3, its data the backend's; freed with dev_free), from its E4M3 codes
     * [N, K] and its scales a row per 128-k block [ceil(K / 128), N] (quant_fp8_row_scales)
     * (CUDA: cuda_prepare_linear_fp8, W8A16). */
    int (*prepare_linear_fp8)(tensor *t, const uint8_t *codes, const float *row_scales, int N,
                              int K, char *err, size_t errlen);
    /* Wait for every queued kernel (the CPU returns at once). */
    void (*sync)(void);
    /* Free and total bytes of the device's memory (the CPU: available and physical RAM). */
    void (*mem_info)(size_t *free_bytes, size_t *total_bytes);

    /* Graphs (CUDA graphs; NULL where the backend has none): the kernels queued between
     * graph_begin and graph_end are recorded, not run, into a graph that graph_launch replays
     * with the same pointers and sizes. graph_end returns NULL with a message when the capture
     * failed (the stream is usable again). graph_epoch changes whenever the backend reallocates
     * a workspace its kernels use: graphs captured in an older epoch must not be launched. */
    int (*graph_begin)(char *err, size_t errlen);
    void *(*graph_end)(char *err, size_t errlen);
    void (*graph_launch)(void *graph);
    void (*graph_free)(void *graph);
    uint64_t (*graph_epoch)(void);

    /* out[n, D] = x[rows[i], :] (rows on the device). */
    void (*gather_rows)(float *out, const float *x, const int32_t *rows, int n, int D);

    /* p[i] = offset + scale * u(seed, i), i < n, for p of dtype dt (F32, BF16 or F16), where u is
     * uniform in [-1, 1) from a counter-based hash of (seed, i), rounded once to dt (F32 or
     * BF16): the same bits on every backend (dummy weights: --load-format dummy). */
    void (*fill_random)(void *p, dtype dt, int64_t n, uint64_t seed, float offset, float scale);

    /* out[T, D] = table[ids[t], :] (table [V, D]). */
    void (*embedding)(float *out, const tensor *table, const int32_t *ids, int T, int D);

    /* out[R, C] = x / sqrt(mean(x^2) + eps) * w, each of R rows; w [C]. out may equal x. */
    void (*rmsnorm)(float *out, const float *x, const tensor *w, int R, int C, float eps);

    /* The residual add fused with the next norm: x[T, D] += o[T, D], then h[T, D] =
     * rmsnorm(x) * w (w [D]), in one pass over each row. The same bits as add(x, x, o, T * D)
     * followed by rmsnorm(h, x, w, T, D, eps) on the same backend. h overlaps neither x nor o. */
    void (*add_rmsnorm)(float *x, float *h, const float *o, const tensor *w, int T, int D,
                        float eps);

    /* out[T, N] = x[T, Kin] w[N, Kin]^T, fp32 accumulation; w read in its own dtype. */
    void (*linear)(float *out, const float *x, const tensor *w, int T, int N, int Kin);

    /* In place rotate-half RoPE on q[T, H, Dh] and k[T, Hkv, Dh] at positions pos[T]:
     * element j pairs with j + Dh/2, angle pos * theta^(-2j/Dh). */
    void (*rope)(float *q, float *k, const int32_t *pos, int T, int H, int Hkv, int Dh,
                 double theta);

    /* Qwen3's q/k norm fused with RoPE, in place: each head of q[T, H, Dh] normed with
     * q_norm [Dh] and each head of k[T, Hkv, Dh] with k_norm [Dh], then both rotated at pos[T].
     * The same bits as rmsnorm(q, q, q_norm, T * H, Dh, eps), rmsnorm(k, k, k_norm, T * Hkv, Dh,
     * eps), rope(q, k, pos, T, H, Hkv, Dh, theta) on the same backend. */
    void (*qk_norm_rope)(float *q, float *k, const tensor *q_norm, const tensor *k_norm,
                         const int32_t *pos, int T, int H, int Hkv, int Dh, double theta,
                         float eps);

    /* The attention prologue in one pass, for a model whose q, k and v projections are one
     * linear: qkv[T, (H + 2 Hkv) Dh] holds each token's q heads, then its k heads, then its v
     * heads. q_out[T, H, Dh] = the q heads normed with q_norm [Dh] and rotated at pos[t]; the k
     * heads, normed with k_norm and rotated, and the v heads as they are go into the cache at
     * (seq[t], pos[t]). The same bits as splitting qkv into q, k, v, then qk_norm_rope and
     * kv_store on the same backend (the CPU's is that composition, the reference). */
    void (*qkv_prepare)(float *q_out, kv_layer kv, const float *qkv, const tensor *q_norm,
                        const tensor *k_norm, const attn_batch *b, int H, int Hkv, int Dh,
                        double theta, float eps);

    /* Store k, v [T, Hkv, Dh] of every token into the cache at (seq[t], pos[t]). */
    void (*kv_store)(kv_layer kv, const float *k, const float *v, const attn_batch *b, int Hkv,
                     int Dh);

    /* out[T, H, Dh] = softmax(q k^T * scale, causal) v per head; head h reads kv head
     * h / (H / Hkv). Accumulates in fp32 over positions 0..pos[t] in order. */
    void (*attention)(float *out, const float *q, kv_layer kv, const attn_batch *b, int H,
                      int Hkv, int Dh, float scale);

    /* Router: probs = softmax(logits[T, E]) in fp32; topk_ids/topk_w [T, K] the K largest in
     * descending order (ties: lower expert id first); if norm, weights divided by their sum. */
    void (*router_topk)(int32_t *topk_ids, float *topk_w, const float *logits, int T, int E,
                        int K, bool norm);

    /* out[T, K, D]: slot k of token t = down(silu(gate(x_t)) * up(x_t)) of expert
     * topk_ids[t, k] (an index into w, < w->E). Tokens are grouped by expert so each expert's
     * weights are read once. A negative id marks a slot this call does not compute (another
     * rank owns its expert): its row of out is left as it was. */
    void (*moe_experts)(float *out, const float *x, const int32_t *topk_ids,
                        const moe_experts *w, int T, int K, int D, int F);

    /* moe_experts over rows 0..n-1 of x and topk_ids, where n = *n_rows is in the backend's
     * memory (written by an earlier op: the all-to-all's received count) and T >= n bounds it on
     * the host; the rows from n on are not read and their rows of out are left as they are. The
     * same bits as moe_experts with T = n. */
    void (*moe_experts_n)(float *out, const float *x, const int32_t *topk_ids,
                          const int32_t *n_rows, const struct moe_experts *w, int T, int K, int D,
                          int F);

    /* The routed experts' activation format: y[T, D] = each token of x[T, D] after the round
     * trip of all-to-all payload `payload` (an a2a_payload of kernels/a2a.h: A2A_PAYLOAD_FP8 is
     * E4M3 with one fp32 scale per 128 channels, A2A_PAYLOAD_NVFP4 E2M1 with an E4M3 scale per
     * 16 and the token's fp32 scale; A2A_PAYLOAD_F32 copies), the same bits as
     * a2a_payload_roundtrip row by row. y may equal x. The model applies it to the experts'
     * input when it runs without an all-to-all, so one process gives its experts what the
     * all-to-all's quantized dispatch gives them on several ranks. NULL where the backend has
     * none yet (the model then leaves the activations in fp32: runner/model.h). */
    void (*moe_input_quant)(float *y, const float *x, int T, int D, int payload);

    /* moe_experts on moe_input_quant(x, payload) (xq[T, D]: scratch the backend may write it
     * to): the same bits as the two ops in turn (the CPU's: those two); the CUDA backend can
     * apply the format inside the experts' first GEMM at decode sizes (one launch fewer). NULL:
     * the model calls the two. */
    void (*moe_experts_q)(float *out, float *xq, const float *x, const int32_t *topk_ids,
                          const struct moe_experts *w, int T, int K, int D, int F, int payload);

    /* The backend's own queue, for code outside the op table that queues work beside the ops
     * (the GPU all-to-all): CUDA's cudaStream_t; NULL on the CPU. */
    void *(*native_stream)(void);

    /* Makes the calling thread use the backend's device (CUDA: cudaSetDevice; a thread starts on
     * device 0). A thread other than the one that created the backend calls it before any op;
     * NULL on the CPU. */
    void (*bind_thread)(void);

    /* out[T, D] = sum over k = 0..K-1, in that order, of topk_w[t, k] * expert_out[t, k, :]. */
    void (*moe_finalize)(float *out, const float *expert_out, const float *topk_w, int T, int K,
                         int D);

    /* moe_finalize fused with the residual add and the next norm: o = the finalize sum of
     * expert_out [T, K, D] with topk_w [T, K], then x[T, D] += o and h = rmsnorm(x) * w (w [D]).
     * The same bits as moe_finalize into o, then add_rmsnorm(x, h, o, w, T, D, eps) on the same
     * backend. */
    void (*moe_finalize_add_rmsnorm)(float *x, float *h, const float *expert_out,
                                     const float *topk_w, const tensor *w, int T, int K, int D,
                                     float eps);

    /* out[T, F] = silu(gate[T, F]) * up[T, F]. */
    void (*silu_mul)(float *out, const float *gate, const float *up, int T, int F);

    /* out[n] = a[n] + b[n]; out may equal a. */
    void (*add)(float *out, const float *a, const float *b, int64_t n);

    /* Score and sample on the device (NULL where the backend has none; the engine then copies
     * the logits to the host and uses runner/sampler.c). Row r of logits[n, V] does what
     * rows[r].mode says:
     *   SAMPLE_SCORE  tokens[r] = target; logprobs[r] = log_softmax(row)[target] (always).
     *   SAMPLE_DRAW   tokens[r] = sampler_sample() of the row with rows[r]'s parameters, the
     *                 penalty entries pen[pen_start .. pen_start + n_pen) (distinct ids: the
     *                 caller builds them), the logit bias bias[bias_start .. bias_start +
     *                 n_bias) (distinct ids) and the counter-based generator of
     *                 common/counter_rng.h at (seed, position); logprobs[r] as want_logprob says.
     *   SAMPLE_SKIP   nothing (tokens[r] = -1).
     * Where rows[r].top_n > 0: top_ids[r, 0 .. top_n) and top_logprobs[r, ..] (both
     * [n, top_n_max]) = the top_n largest of log_softmax(row), descending, ties by id.
     * Logprobs are of the row as given (before penalties, bias and temperature); a logprob not
     * wanted is NaN. logits is only read (penalties and bias go to a copy in the backend's
     * workspace). Every pointer is device memory; rows, pen and bias are read on the device. Not
     * for graph capture: the workspace grows on demand. Agreement with runner/sampler.c
     * (tests/test_cuda_sampling.c): greedy tokens exactly; logprobs to fp32 rounding; a draw sees
     * the CPU's distribution, its token the CPU's except where u * kept mass falls within rounding
     * of a token's boundary (the kernels keep the probability masses in fixed point, so results are
     * the same bits run after run and do not depend on the other rows). top_n_max <=
     * OPS_SAMPLE_TOP_N_MAX. */
    void (*sample)(int32_t *tokens, float *logprobs, int32_t *top_ids, float *top_logprobs,
                   const float *logits, const sample_row *rows, const sample_penalty *pen,
                   const sample_bias *bias, int n, int V, int top_n_max);
} ops;

/* The largest top_n ops->sample takes (the server's top_logprobs_num is at most 20). */
#define OPS_SAMPLE_TOP_N_MAX 32

/* The hash behind fill_random: element i of stream seed as a uniform number in [-1, 1), with 24
 * random bits. Shared by the backends so dummy weights are identical everywhere. */
#ifdef __CUDACC__
#define OPS_HOST_DEVICE __host__ __device__
#else
#define OPS_HOST_DEVICE
#endif
static inline OPS_HOST_DEVICE float ops_random_uniform(uint64_t seed, uint64_t i) {
    uint64_t z = seed * 0x9E3779B97F4A7C15ull + i + 0x632BE59BD9B4E019ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (float)(int32_t)(z >> 40) * (1.0f / 8388608.0f) - 1.0f;
}

/* The CPU backend (kernels/cpu/). Threads: OpenMP, omp_get_max_threads(). */
const ops *ops_cpu(void);

/* The CUDA backend (kernels/cuda/) on GPU `device` of this node: NULL with a message when this
 * build has no CUDA or the device cannot be used. Kernels run on one stream in order; to_host
 * waits for them. */
const ops *ops_cuda(int device, char *err, size_t errlen);

/* How the CUDA backend multiplies fp32 activations by 16-bit (BF16, F16) weights in linear and the
 * experts' GEMMs, named after PyTorch's float32 matmul precision; one setting per process, read on
 * every call (set it before serving; ops_cuda need not have run). F32 weights always give fp32
 * products (no TF32), and the CPU backend always computes in fp32.
 *   high    the default: results faithful to fp32 x (fp32 products, or x carried as two 16-bit
 *           parts on the tensor cores: relative error about 2^-16 per product).
 *   medium  x rounded to the weight's dtype first (relative error 2^-8 per product with BF16):
 *           fastest prefill, and what moved whole-model logprobs by up to 0.8 from the CPU's. */
typedef enum { MATMUL_PRECISION_HIGH, MATMUL_PRECISION_MEDIUM } matmul_precision;
/* "high" | "medium"; 0 or -1 with a message. */
int ops_cuda_set_matmul_precision(const char *name, char *err, size_t errlen);
matmul_precision ops_cuda_matmul_precision(void);
/* Deterministic mode (--enable-deterministic-inference) for the CUDA backend: every linear runs
 * one way for every T (high precision: the stacked GEMM, never the decode kernel) with one cuBLASLt
 * algorithm pinned per weight shape, no split-K, so a token's row is the same bits alone or in any
 * batch. The experts' GEMMs, attention, the norms and the sampler are batch-invariant already. One
 * setting per process, set before serving; the CPU backend always is. */
void ops_cuda_set_deterministic(bool on);
bool ops_cuda_deterministic(void);

#ifdef __cplusplus
}
#endif

#endif
