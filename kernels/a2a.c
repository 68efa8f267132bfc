/* MoE all-to-all, the transport-independent half: transport names, the expert split, the
 * configuration check (once, at create, agreed by every rank), the phase guard, the routing
 * records, and the `none` transport (one rank: local copies).
 *
 * Choices:
 * - a2a_create checks the configuration locally, then every rank learns over one MPI_Allreduce
 *   whether any rank failed and whether the shared fields agree, so a bad or mismatched setting
 *   fails on every rank at once instead of leaving some ranks waiting in a collective.
 * - Routing is decided here, before any byte moves: for each token and each slot k the owner
 *   rank; the first slot per owner takes the next slot at that owner (a token travels once per
 *   rank), later slots of the same owner share it. The records stay until combine, which needs
 *   them to find slot k of token t in the combine region.
 * - Phases: IDLE -> dispatch -> DISPATCHED -> combine -> IDLE. A second dispatch or a combine
 *   without a dispatch is refused with a message; argument errors leave the phase as it was. A
 *   failed wait makes the a2a BROKEN for good: a late peer may still write into the workspace,
 *   so no later round can be trusted; the caller reports and exits. */
#include "kernels/a2a.h"

#include "common/log.h"
#include "common/tensor.h"
#include "kernels/cpu/a2a_internal.h"
#include "kernels/quant.h"

#include <errno.h>
#include <math.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define A2A_DEFAULT_TIMEOUT_S 30.0
/* The largest segment we agree to allocate per rank: far above any real setting, low enough
 * that every offset computation stays clear of overflow. */
#define A2A_MAX_SEGMENT_BYTES ((size_t)1 << 40)

bool a2a_transport_parse(const char *s, a2a_transport *out) {
    static const struct {
        const char *name;
        a2a_transport t;
    } names[] = {
        {"none", A2A_NONE},
        {"shm", A2A_SHM},
        {"mpi", A2A_MPI},
        {"nvlink_one_sided", A2A_NVLINK_ONE_SIDED},
        {"flashinfer_nvlink_one_sided", A2A_NVLINK_ONE_SIDED},
        {"nccl", A2A_NCCL},
    };
    if (!s) return false;
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (strcmp(s, names[i].name) == 0) {
            if (out) *out = names[i].t;
            return true;
        }
    return false;
}

const char *a2a_transport_name(a2a_transport t) {
    switch (t) {
    case A2A_NONE: return "none";
    case A2A_SHM: return "shm";
    case A2A_MPI: return "mpi";
    case A2A_NVLINK_ONE_SIDED: return "nvlink_one_sided";
    case A2A_NCCL: return "nccl";
    }
    return "unknown";
}

bool a2a_payload_parse(const char *s, a2a_payload *out) {
    static const struct {
        const char *name;
        a2a_payload p;
    } names[] = {{"f32", A2A_PAYLOAD_F32},
                 {"fp32", A2A_PAYLOAD_F32},
                 {"bf16", A2A_PAYLOAD_BF16},
                 {"fp8", A2A_PAYLOAD_FP8},
                 {"nvfp4", A2A_PAYLOAD_NVFP4}};
    if (!s) return false;
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (strcmp(s, names[i].name) == 0) {
            if (out) *out = names[i].p;
            return true;
        }
    return false;
}

const char *a2a_payload_name(a2a_payload p) {
    switch (p) {
    case A2A_PAYLOAD_F32: return "f32";
    case A2A_PAYLOAD_BF16: return "bf16";
    case A2A_PAYLOAD_FP8: return "fp8";
    case A2A_PAYLOAD_NVFP4: return "nvfp4";
    }
    return "unknown";
}

size_t a2a_payload_bytes(a2a_payload p, int D) {
    switch (p) {
    case A2A_PAYLOAD_F32: return (size_t)D * 4;
    case A2A_PAYLOAD_BF16: return (size_t)D * 2;
    case A2A_PAYLOAD_FP8: return (size_t)D + 4 * (size_t)((D + QUANT_FP8_GROUP - 1) / QUANT_FP8_GROUP);
    case A2A_PAYLOAD_NVFP4: return 4 + (size_t)D / QUANT_FP4_GROUP + (size_t)D / 2;
    }
    return 0;
}

/* One token into its payload bytes, and back. Scales go first so they stay 4-byte aligned. */
static void payload_encode(a2a_payload p, void *dst, const float *x, int D) {
    switch (p) {
    case A2A_PAYLOAD_F32: memcpy(dst, x, (size_t)D * 4); break;
    case A2A_PAYLOAD_BF16:
        for (int i = 0; i < D; i++)
            ((uint16_t *)dst)[i] = f32_to_bf16(x[i]);
        break;
    case A2A_PAYLOAD_FP8: {
        float *sc = dst;
        quant_fp8_rows((uint8_t *)(sc + (D + QUANT_FP8_GROUP - 1) / QUANT_FP8_GROUP), sc, x, 1, D);
        break;
    }
    case A2A_PAYLOAD_NVFP4: {
        uint8_t *sf = (uint8_t *)dst + 4;
        float s2 = quant_nvfp4(sf + D / QUANT_FP4_GROUP, sf, x, 1, D, 0.0f);
        memcpy(dst, &s2, 4);
        break;
    }
    }
}

static void payload_decode(a2a_payload p, float *x, const void *src, int D) {
    switch (p) {
    case A2A_PAYLOAD_F32: memcpy(x, src, (size_t)D * 4); break;
    case A2A_PAYLOAD_BF16:
        for (int i = 0; i < D; i++)
            x[i] = bf16_to_f32(((const uint16_t *)src)[i]);
        break;
    case A2A_PAYLOAD_FP8: {
        const float *sc = src;
        dequant_fp8_rows(x, (const uint8_t *)(sc + (D + QUANT_FP8_GROUP - 1) / QUANT_FP8_GROUP), sc,
                         1, D);
        break;
    }
    case A2A_PAYLOAD_NVFP4: {
        float s2;
        memcpy(&s2, src, 4);
        const uint8_t *sf = (const uint8_t *)src + 4;
        dequant_nvfp4(x, sf + D / QUANT_FP4_GROUP, sf, s2, 1, D);
        break;
    }
    }
}

void a2a_payload_roundtrip(a2a_payload p, float *y, const float *x, int D) {
    if (p == A2A_PAYLOAD_F32) {
        if (y != x) memmove(y, x, (size_t)D * 4);
        return;
    }
    void *buf = xmalloc(a2a_payload_bytes(p, D) + 4);
    payload_encode(p, buf, x, D);
    payload_decode(p, y, buf, D);
    free(buf);
}

void a2a_split_experts(int n_experts, int n_ranks, int *expert_begin) {
    int base = n_ranks > 0 ? n_experts / n_ranks : 0;
    int extra = n_ranks > 0 ? n_experts % n_ranks : 0;
    expert_begin[0] = 0;
    for (int r = 0; r < n_ranks; r++)
        expert_begin[r + 1] = expert_begin[r] + base + (r < extra ? 1 : 0);
}

/* ---- shared helpers of the transports (a2a_internal.h) ---- */

int a2a_fail(a2a *a, char *err, size_t errlen, const char *fmt, ...) {
    char msg[sizeof a->broken_why];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    a->phase = A2A_PHASE_BROKEN;
    snprintf(a->broken_why, sizeof a->broken_why, "%s", msg);
    return set_err(err, errlen, "%s", msg);
}

double a2a_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

void a2a_backoff_start(a2a_backoff *b, const a2a_config *cfg) {
    b->start = a2a_now();
    b->deadline = b->start + cfg->timeout_s;
    b->next_check = b->start + 0.1;
    b->polls = 0;
    b->cfg = cfg;
    b->gone[0] = '\0';
}

/* Spin for the first polls (a peer on its own core answers within microseconds), then yield the
 * core (an oversubscribed peer gets it), then sleep 1 us doubling to 1 ms. */
bool a2a_backoff_pause(a2a_backoff *b) {
    enum { SPIN_POLLS = 256, YIELD_POLLS = 256 + 1024 };
    b->polls++;
    if (b->polls <= SPIN_POLLS) {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#elif defined(__aarch64__)
        __asm__ __volatile__("yield");
#endif
        return true;
    }
    if (b->polls <= YIELD_POLLS) {
        sched_yield();
    } else {
        long shift = b->polls - YIELD_POLLS;
        long ns = shift >= 10 ? 1000000 : 1000L << shift;
        struct timespec ts = {0, ns};
        nanosleep(&ts, NULL);
    }
    /* The clock is read only off the spin path. */
    double now = a2a_now();
    if (b->cfg->check_peers && now >= b->next_check) {
        b->next_check = now + 0.1;
        if (b->cfg->check_peers(b->cfg->check_ctx, b->gone, sizeof b->gone) != 0) {
            if (!b->gone[0]) snprintf(b->gone, sizeof b->gone, "a peer has gone");
            return false;
        }
    }
    return now < b->deadline;
}

void a2a_format_missing(char *buf, size_t len, const bool *arrived, int ep) {
    int n_missing = 0;
    for (int p = 0; p < ep; p++)
        n_missing += !arrived[p];
    size_t used = (size_t)snprintf(buf, len, "%s", n_missing == 1 ? "rank" : "ranks");
    int shown = 0;
    for (int p = 0; p < ep && used < len; p++) {
        if (arrived[p]) continue;
        if (shown == 8) {
            snprintf(buf + used, len - used, " and %d more", n_missing - shown);
            break;
        }
        used += (size_t)snprintf(buf + used, len - used, "%s %d", shown ? "," : "", p);
        shown++;
    }
}

/* One token's routing as `target` sees it: ids local to target (-1 where it owns no slot), w. */
static void pack_routing(const a2a *a, int32_t *ids, float *w, int target, const int32_t *ids_t,
                         const float *w_t) {
    const int K = a->cfg.top_k;
    const int begin = a->cfg.expert_begin[target];
    for (int k = 0; k < K; k++)
        ids[k] = a->owner[ids_t[k]] == target ? ids_t[k] - begin : -1;
    memcpy(w, w_t, (size_t)K * sizeof(float));
}

/* A token this rank keeps for its own experts: x after the payload's round trip, as a peer would
 * receive it, and its routing. */
static void pack_fields(const a2a *a, float *x, int32_t *ids, float *w, int target,
                        const float *x_t, const int32_t *ids_t, const float *w_t) {
    a2a_payload_roundtrip(a->cfg.payload, x, x_t, a->cfg.hidden);
    pack_routing(a, ids, w, target, ids_t, w_t);
}

void a2a_pack_record(const a2a *a, void *rec, int target, const float *x_t, const int32_t *ids_t,
                     const float *w_t) {
    payload_encode(a->cfg.payload, rec, x_t, a->cfg.hidden);
    int32_t *ids = (int32_t *)((char *)rec + a->layout.pay_bytes);
    pack_routing(a, ids, (float *)(ids + a->cfg.top_k), target, ids_t, w_t);
}

int a2a_read_counts(a2a *a, const char *segment, char *err, size_t errlen) {
    const a2a_layout *L = &a->layout;
    for (int p = 0; p < a->cfg.ep_size; p++) {
        a2a_count_line c;
        memcpy(&c, segment + L->line_count0 + (size_t)p * A2A_LINE, sizeof c);
        if (c.runtime_max != a->runtime_max)
            return a2a_fail(a, err, errlen,
                            "a2a rank %d: rank %d dispatched round %llu with runtime_max %d, this "
                            "rank with %d: runtime_max must be the same on every rank",
                            a->cfg.rank, p, (unsigned long long)a->round, c.runtime_max,
                            a->runtime_max);
        if (c.count < 0 || c.count > a->runtime_max)
            return a2a_fail(
                a, err, errlen,
                "a2a rank %d: rank %d announced %d tokens for round %llu (runtime_max %d)",
                a->cfg.rank, p, c.count, (unsigned long long)a->round, a->runtime_max);
        a->recv_count[p] = c.count;
    }
    return 0;
}

void a2a_compact_received(a2a *a, const char *segment, const float *x_in, const int32_t *topk_ids,
                          const float *topk_w) {
    const int D = a->cfg.hidden, K = a->cfg.top_k, ep = a->cfg.ep_size, me = a->cfg.rank;
    const a2a_layout *L = &a->layout;
    a->recv_begin[0] = 0;
    for (int p = 0; p < ep; p++) {
        const char *src = segment + L->recv_off + (size_t)p * a->runtime_max * L->rec_bytes;
        int base = a->recv_begin[p];
        if (p == me) { /* this rank's own tokens, straight from the inputs, in slot order */
            for (int t = 0; t < a->T; t++)
                for (int k = 0; k < K; k++) {
                    size_t tk = (size_t)t * K + k;
                    if (!a->slot_first[tk] || a->slot_rank[tk] != me) continue;
                    size_t i = (size_t)base + (size_t)a->slot_index[tk];
                    pack_fields(a, a->recv_x + i * D, a->recv_ids + i * K, a->recv_w + i * K, me,
                                x_in + (size_t)t * D, topk_ids + (size_t)t * K,
                                topk_w + (size_t)t * K);
                }
            a->recv_begin[p + 1] = base + a->recv_count[p];
            continue;
        }
        for (int j = 0; j < a->recv_count[p]; j++) {
            const char *rec = src + (size_t)j * L->rec_bytes;
            const int32_t *ids = (const int32_t *)(rec + L->pay_bytes);
            const float *w = (const float *)(ids + K);
            size_t i = (size_t)base + (size_t)j;
            payload_decode(a->cfg.payload, a->recv_x + i * D, rec, D);
            memcpy(a->recv_ids + i * K, ids, (size_t)K * sizeof(int32_t));
            memcpy(a->recv_w + i * K, w, (size_t)K * sizeof(float));
        }
        a->recv_begin[p + 1] = base + a->recv_count[p];
    }
}

void a2a_gather_out(const a2a *a, const char *segment, const float *expert_out, float *out) {
    const int D = a->cfg.hidden, K = a->cfg.top_k, me = a->cfg.rank;
    const float *comb = (const float *)(segment + a->layout.comb_off);
    const float *own = expert_out + (size_t)a->recv_begin[me] * K * D; /* my tokens' rows here */
    for (int t = 0; t < a->T; t++)
        for (int k = 0; k < K; k++) {
            size_t tk = (size_t)t * K + k;
            const float *src;
            if (a->slot_rank[tk] == me) {
                src = own + ((size_t)a->slot_index[tk] * K + k) * D;
            } else {
                size_t j = (size_t)a->slot_rank[tk] * a->runtime_max + (size_t)a->slot_index[tk];
                src = comb + (j * K + k) * D;
            }
            memcpy(out + tk * D, src, (size_t)D * sizeof(float));
        }
}

/* ---- the none transport: one rank, the received tokens are this rank's own ---- */

static int none_dispatch(a2a *a, const float *x, const int32_t *topk_ids, const float *topk_w,
                         char *err, size_t errlen) {
    const int D = a->cfg.hidden, K = a->cfg.top_k, T = a->T;
    if (T > 0) {
        for (int t = 0; t < T; t++) /* the payload's round trip, as with several ranks */
            a2a_payload_roundtrip(a->cfg.payload, a->recv_x + (size_t)t * D, x + (size_t)t * D, D);
        memcpy(a->recv_ids, topk_ids, (size_t)T * K * sizeof(int32_t)); /* rank 0 owns [0, E) */
        memcpy(a->recv_w, topk_w, (size_t)T * K * sizeof(float));
    }
    a->recv_count[0] = T;
    a->recv_begin[0] = 0;
    a->recv_begin[1] = T;
    return 0;
}

static int none_combine(a2a *a, const float *expert_out, float *out, char *err, size_t errlen) {
    if (a->T > 0)
        memcpy(out, expert_out, (size_t)a->T * a->cfg.top_k * a->cfg.hidden * sizeof(float));
    return 0;
}

static void none_destroy(a2a *a) {}

static const a2a_transport_ops none_ops = {none_dispatch, none_combine, none_destroy};

/* ---- create / destroy ---- */

static int layout_compute(a2a_layout *L, const a2a_config *c) {
    const size_t ep = (size_t)c->ep_size, M = (size_t)c->max_tokens_per_rank;
    const size_t D = (size_t)c->hidden, K = (size_t)c->top_k;
    L->line_round = 0;
    L->line_dflag0 = A2A_LINE;
    L->line_cflag0 = L->line_dflag0 + ep * A2A_LINE;
    L->line_count0 = L->line_cflag0 + ep * A2A_LINE;
    size_t header = L->line_count0 + ep * A2A_LINE;
    L->pay_bytes = (a2a_payload_bytes(c->payload, (int)D) + 3) & ~(size_t)3;
    L->rec_bytes = L->pay_bytes + 2 * K * 4;
    L->recv_off = (header + 4095) & ~(size_t)4095;
    /* The operands are bounded by the validation (each factor < 2^31 and ep <= 256), so the
     * products below cannot wrap in 64 bits before the size check. */
    double recv = (double)ep * (double)M * (double)L->rec_bytes;
    double comb = (double)ep * (double)M * (double)K * (double)D * 4.0;
    if ((double)L->recv_off + recv + comb + 8192.0 > (double)A2A_MAX_SEGMENT_BYTES) return -1;
    L->comb_off = (L->recv_off + ep * M * L->rec_bytes + 4095) & ~(size_t)4095;
    L->seg_bytes = (L->comb_off + ep * M * K * D * 4 + 4095) & ~(size_t)4095;
    return 0;
}

/* The local half of the check: everything that can be decided from this rank's view. */
static int config_check_local(const a2a_config *c, MPI_Comm comm, char *err, size_t errlen) {
    int size = 0, rank = 0;
    if (comm == MPI_COMM_NULL)
        return set_err(err, errlen, "a2a: the communicator is MPI_COMM_NULL");
    MPI_Comm_size(comm, &size);
    MPI_Comm_rank(comm, &rank);
    if (c->ep_size != size)
        return set_err(err, errlen, "a2a: ep_size %d but the communicator has %d ranks", c->ep_size,
                       size);
    if (c->rank != rank)
        return set_err(err, errlen,
                       "a2a: config rank %d but this process is rank %d of the communicator",
                       c->rank, rank);
    if (c->ep_size < 1 || c->ep_size > A2A_MAX_RANKS)
        return set_err(err, errlen, "a2a: ep_size %d outside [1, %d]", c->ep_size, A2A_MAX_RANKS);
    switch (c->transport) {
    case A2A_NONE:
        if (c->ep_size != 1)
            return set_err(err, errlen,
                           "a2a: transport none serves one rank, ep_size is %d (use shm or mpi)",
                           c->ep_size);
        break;
    case A2A_SHM:
    case A2A_MPI: break;
    case A2A_NVLINK_ONE_SIDED:
    case A2A_NCCL:
        return set_err(err, errlen,
                       "a2a: transport %s needs the CUDA backend, which this build does not have "
                       "(use shm or mpi)",
                       a2a_transport_name(c->transport));
    default: return set_err(err, errlen, "a2a: unknown transport %d", (int)c->transport);
    }
    if (c->max_tokens_per_rank < 1)
        return set_err(err, errlen, "a2a: max_tokens_per_rank %d must be >= 1",
                       c->max_tokens_per_rank);
    if (c->hidden < 1) return set_err(err, errlen, "a2a: hidden %d must be >= 1", c->hidden);
    if ((unsigned)c->payload > (unsigned)A2A_PAYLOAD_NVFP4)
        return set_err(err, errlen, "a2a: unknown payload %d", (int)c->payload);
    if (c->payload == A2A_PAYLOAD_NVFP4 && c->hidden % QUANT_FP4_GROUP != 0)
        return set_err(err, errlen, "a2a: an nvfp4 payload needs hidden %% %d == 0, hidden is %d",
                       QUANT_FP4_GROUP, c->hidden);
    if (c->n_experts < 1)
        return set_err(err, errlen, "a2a: n_experts %d must be >= 1", c->n_experts);
    if (c->top_k < 1 || c->top_k > c->n_experts)
        return set_err(err, errlen, "a2a: top_k %d outside [1, n_experts = %d]", c->top_k,
                       c->n_experts);
    if (c->expert_begin[0] != 0 || c->expert_begin[c->ep_size] != c->n_experts)
        return set_err(err, errlen,
                       "a2a: expert_begin must run from 0 to n_experts = %d, got %d .. %d",
                       c->n_experts, c->expert_begin[0], c->expert_begin[c->ep_size]);
    for (int r = 0; r < c->ep_size; r++)
        if (c->expert_begin[r + 1] < c->expert_begin[r])
            return set_err(err, errlen, "a2a: expert_begin decreases at rank %d (%d > %d)", r,
                           c->expert_begin[r], c->expert_begin[r + 1]);
    if (!(c->timeout_s >= 0) || c->timeout_s > 1e6)
        return set_err(err, errlen, "a2a: timeout_s %g outside [0, 1e6] (0 = %g s)", c->timeout_s,
                       A2A_DEFAULT_TIMEOUT_S);
    a2a_layout L;
    if (layout_compute(&L, c) != 0)
        return set_err(err, errlen,
                       "a2a: workspace for ep_size %d, max_tokens_per_rank %d, hidden %d, top_k %d "
                       "exceeds %zu bytes per rank",
                       c->ep_size, c->max_tokens_per_rank, c->hidden, c->top_k,
                       A2A_MAX_SEGMENT_BYTES);
    return 0;
}

/* Fields that must agree on every rank, as ints; the expert split enters as a hash. */
enum {
    AGREE_OK,
    AGREE_TRANSPORT,
    AGREE_MAX_TOKENS,
    AGREE_HIDDEN,
    AGREE_TOP_K,
    AGREE_EXPERTS,
    AGREE_SPLIT,
    AGREE_PAYLOAD,
    AGREE_N
};
static const char *const agree_names[AGREE_N] = {
    "ok",        "transport", "max_tokens_per_rank", "hidden", "top_k", "n_experts",
    "expert_begin", "payload"};

static int split_hash(const a2a_config *c) {
    uint32_t h = 2166136261u;
    for (int r = 0; r <= c->ep_size && r <= A2A_MAX_RANKS; r++) {
        h ^= (uint32_t)c->expert_begin[r];
        h *= 16777619u;
    }
    return (int)(h & 0x7fffffff);
}

/* Every rank calls this with its local verdict; all learn whether every rank passed and whether
 * the shared fields agree. Values go in twice, as v and -v, so one MPI_MAX gives min and max. */
static int config_agree(const a2a_config *c, MPI_Comm comm, int local_ok, char *err,
                        size_t errlen) {
    int v[2 * AGREE_N], r[2 * AGREE_N];
    v[AGREE_OK] = local_ok ? 1 : 0;
    v[AGREE_TRANSPORT] = (int)c->transport;
    v[AGREE_MAX_TOKENS] = c->max_tokens_per_rank;
    v[AGREE_HIDDEN] = c->hidden;
    v[AGREE_TOP_K] = c->top_k;
    v[AGREE_EXPERTS] = c->n_experts;
    v[AGREE_SPLIT] = split_hash(c);
    v[AGREE_PAYLOAD] = (int)c->payload;
    for (int i = 0; i < AGREE_N; i++)
        v[AGREE_N + i] = -v[i];
    if (MPI_Allreduce(v, r, 2 * AGREE_N, MPI_INT, MPI_MAX, comm) != MPI_SUCCESS)
        return set_err(err, errlen, "a2a: MPI_Allreduce failed while checking the config");
    if (-r[AGREE_N + AGREE_OK] != 1) {
        if (local_ok)
            set_err(err, errlen, "a2a: another rank rejected the config (see its message)");
        return -1;
    }
    for (int i = 1; i < AGREE_N; i++)
        if (r[i] != -r[AGREE_N + i])
            return set_err(
                err, errlen,
                "a2a: %s differs between ranks (%d .. %d): every rank must pass the same config",
                agree_names[i], -r[AGREE_N + i], r[i]);
    return 0;
}

a2a *a2a_create(const a2a_config *cfg, MPI_Comm comm, char *err, size_t errlen) {
    if (!cfg) {
        set_err(err, errlen, "a2a: no config");
        return NULL;
    }
    int local_ok = config_check_local(cfg, comm, err, errlen) == 0;
    if (comm == MPI_COMM_NULL) return NULL;
    /* Out-of-range ep_size would index past expert_begin; give the hash a safe view. */
    a2a_config safe = *cfg;
    if (safe.ep_size < 1 || safe.ep_size > A2A_MAX_RANKS) safe.ep_size = 1;
    if (config_agree(&safe, comm, local_ok, err, errlen) != 0) return NULL;

    a2a *a = xcalloc(1, sizeof *a);
    a->cfg = *cfg;
    if (a->cfg.timeout_s == 0) a->cfg.timeout_s = A2A_DEFAULT_TIMEOUT_S;
    layout_compute(&a->layout, &a->cfg);
    const int ep = cfg->ep_size, M = cfg->max_tokens_per_rank, D = cfg->hidden, K = cfg->top_k;
    a->owner = xmalloc((size_t)cfg->n_experts * sizeof(int32_t));
    for (int r = 0; r < ep; r++)
        for (int e = cfg->expert_begin[r]; e < cfg->expert_begin[r + 1]; e++)
            a->owner[e] = r;
    a->slot_rank = xmalloc((size_t)M * K * sizeof(int32_t));
    a->slot_index = xmalloc((size_t)M * K * sizeof(int32_t));
    a->slot_first = xmalloc((size_t)M * K);
    a->send_count = xcalloc((size_t)ep, sizeof(int32_t));
    a->recv_count = xcalloc((size_t)ep, sizeof(int32_t));
    a->recv_begin = xcalloc((size_t)ep + 1, sizeof(int32_t));
    a->recv_x = xmalloc((size_t)ep * M * D * sizeof(float));
    a->recv_ids = xmalloc((size_t)ep * M * K * sizeof(int32_t));
    a->recv_w = xmalloc((size_t)ep * M * K * sizeof(float));
    a->phase = A2A_PHASE_IDLE;

    if (MPI_Comm_dup(comm, &a->comm) != MPI_SUCCESS) {
        set_err(err, errlen, "a2a: MPI_Comm_dup failed");
        a->comm = MPI_COMM_NULL;
        a2a_destroy(a);
        return NULL;
    }
    MPI_Comm_set_errhandler(a->comm, MPI_ERRORS_RETURN);
    int rc = 0;
    switch (cfg->transport) {
    case A2A_NONE: a->ops = &none_ops; break;
    case A2A_SHM: rc = a2a_shm_init(a, err, errlen); break;
    case A2A_MPI: rc = a2a_mpi_init(a, err, errlen); break;
    default: rc = -1; break; /* refused by the check above */
    }
    /* All ranks keep the workspace or all free it: a window freed on some ranks only would
     * leave the others in MPI_Win_free. */
    int ok = rc == 0, all_ok = 0;
    if (MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, a->comm) != MPI_SUCCESS) all_ok = 0;
    if (!all_ok) {
        if (ok)
            set_err(err, errlen,
                    "a2a rank %d: another rank could not set up the %s transport (see its message)",
                    cfg->rank, a2a_transport_name(cfg->transport));
        a2a_destroy(a);
        return NULL;
    }
    return a;
}

void a2a_destroy(a2a *a) {
    if (!a) return;
    if (a->ops) a->ops->destroy(a);
    if (a->comm != MPI_COMM_NULL) MPI_Comm_free(&a->comm);
    free(a->owner);
    free(a->slot_rank);
    free(a->slot_index);
    free(a->slot_first);
    free(a->send_count);
    free(a->recv_count);
    free(a->recv_begin);
    free(a->recv_x);
    free(a->recv_ids);
    free(a->recv_w);
    free(a->partial_slots);
    free(a);
}

/* ---- one round ---- */

static int phase_error(const a2a *a, const char *call, char *err, size_t errlen) {
    if (a->phase == A2A_PHASE_BROKEN)
        return set_err(err, errlen, "a2a rank %d: %s refused: the all-to-all failed earlier (%s)",
                       a->cfg.rank, call, a->broken_why);
    if (a->phase == A2A_PHASE_DISPATCHED)
        return set_err(err, errlen,
                       "a2a rank %d: dispatch called twice without a combine (round %llu): every "
                       "dispatch must be followed by its combine",
                       a->cfg.rank, (unsigned long long)a->round);
    return set_err(err, errlen, "a2a rank %d: combine called without a dispatch (round %llu)",
                   a->cfg.rank, (unsigned long long)a->round);
}

int a2a_dispatch(a2a *a, const float *x, const int32_t *topk_ids, const float *topk_w, int T,
                 int runtime_max, char *err, size_t errlen) {
    if (!a) return set_err(err, errlen, "a2a: dispatch on a NULL a2a");
    if (a->phase != A2A_PHASE_IDLE) return phase_error(a, "dispatch", err, errlen);
    const int K = a->cfg.top_k, E = a->cfg.n_experts;
    if (runtime_max < 0 || runtime_max > a->cfg.max_tokens_per_rank)
        return set_err(err, errlen,
                       "a2a rank %d: runtime_max %d outside [0, max_tokens_per_rank = %d]",
                       a->cfg.rank, runtime_max, a->cfg.max_tokens_per_rank);
    if (T < 0 || T > runtime_max)
        return set_err(err, errlen, "a2a rank %d: T = %d tokens outside [0, runtime_max = %d]",
                       a->cfg.rank, T, runtime_max);
    if (T > 0 && (!x || !topk_ids || !topk_w))
        return set_err(err, errlen, "a2a rank %d: dispatch of %d tokens with a NULL input",
                       a->cfg.rank, T);
    for (int64_t i = 0; i < (int64_t)T * K; i++)
        if (topk_ids[i] < 0 || topk_ids[i] >= E)
            return set_err(err, errlen,
                           "a2a rank %d: token %lld slot %lld: expert id %d outside [0, %d)",
                           a->cfg.rank, (long long)(i / K), (long long)(i % K), topk_ids[i], E);

    /* Routing records: slot per (token, owner rank), the first slot of each owner carries it. */
    a->T = T;
    a->runtime_max = runtime_max;
    memset(a->send_count, 0, (size_t)a->cfg.ep_size * sizeof(int32_t));
    for (int t = 0; t < T; t++)
        for (int k = 0; k < K; k++) {
            size_t tk = (size_t)t * K + k;
            int r = a->owner[topk_ids[tk]];
            int first = 1;
            for (int k2 = 0; k2 < k; k2++)
                if (a->slot_rank[(size_t)t * K + k2] == r) {
                    a->slot_index[tk] = a->slot_index[(size_t)t * K + k2];
                    first = 0;
                    break;
                }
            a->slot_rank[tk] = r;
            a->slot_first[tk] = (uint8_t)first;
            if (first) a->slot_index[tk] = a->send_count[r]++;
        }

    if (a->ops->dispatch(a, x, topk_ids, topk_w, err, errlen) != 0) return -1;
    a->phase = A2A_PHASE_DISPATCHED;
    return 0;
}

const a2a_config *a2a_get_config(const a2a *a) { return &a->cfg; }

a2a_received a2a_get_received(const a2a *a) {
    a2a_received r = {0, NULL, NULL, NULL};
    if (!a || a->phase == A2A_PHASE_BROKEN) return r;
    r.n = a->recv_begin[a->cfg.ep_size];
    r.x = a->recv_x;
    r.ids = a->recv_ids;
    r.w = a->recv_w;
    return r;
}

int a2a_combine(a2a *a, const float *expert_out, float *out, char *err, size_t errlen) {
    if (!a) return set_err(err, errlen, "a2a: combine on a NULL a2a");
    if (a->phase != A2A_PHASE_DISPATCHED) return phase_error(a, "combine", err, errlen);
    if (a->recv_begin[a->cfg.ep_size] > 0 && !expert_out)
        return set_err(err, errlen, "a2a rank %d: combine with a NULL expert_out for %d tokens",
                       a->cfg.rank, a->recv_begin[a->cfg.ep_size]);
    if (a->T > 0 && !out)
        return set_err(err, errlen, "a2a rank %d: combine with a NULL out for %d tokens",
                       a->cfg.rank, a->T);
    if (a->ops->combine(a, expert_out, out, err, errlen) != 0) return -1;
    a->phase = A2A_PHASE_IDLE;
    a->round++;
    return 0;
}

/* One token's partial-form sum into out[D] from its K exact slots: each owner rank's slots (the
 * dispatch's slot_rank), in slot order, as w * output in fp32 (no fused multiply-add: -std=c11
 * keeps contraction off), rounded to BF16; those partials added in rank order from +0, as the
 * GPU's partial combine does (the owner rank sums, the home rank adds). acc[D] is scratch. */
static void partial_sum_token(const a2a *a, float *out, float *acc, const float *slots,
                              const int32_t *slot_rank, const float *w) {
    const int D = a->cfg.hidden, K = a->cfg.top_k;
    for (int d = 0; d < D; d++)
        out[d] = 0.0f;
    for (int r = 0; r < a->cfg.ep_size; r++) {
        int any = 0;
        for (int k = 0; k < K; k++) {
            if (slot_rank[k] != r) continue;
            const float *y = slots + (size_t)k * D;
            for (int d = 0; d < D; d++)
                acc[d] = (any ? acc[d] : 0.0f) + w[k] * y[d];
            any = 1;
        }
        if (any)
            for (int d = 0; d < D; d++)
                out[d] = out[d] + bf16_to_f32(f32_to_bf16(acc[d]));
    }
}

int a2a_combine_partial(a2a *a, const float *expert_out, const float *topk_w, float *out, char *err,
                        size_t errlen) {
    if (!a) return set_err(err, errlen, "a2a: combine on a NULL a2a");
    const int T = a->T, D = a->cfg.hidden, K = a->cfg.top_k;
    if (a->phase == A2A_PHASE_DISPATCHED && T > 0 && (!topk_w || !out))
        return set_err(err, errlen, "a2a rank %d: partial combine with a NULL %s for %d tokens",
                       a->cfg.rank, topk_w ? "out" : "topk_w", T);
    const size_t slots = (size_t)a->cfg.max_tokens_per_rank * K * D; /* then acc[D] */
    if (a->phase == A2A_PHASE_DISPATCHED && !a->partial_slots) {
        a->partial_slots = malloc((slots + (size_t)D) * sizeof(float));
        if (!a->partial_slots)
            return set_err(err, errlen, "a2a rank %d: out of memory for the partial combine",
                           a->cfg.rank);
    }
    if (a2a_combine(a, expert_out, a->partial_slots, err, errlen) != 0) return -1;
    for (int t = 0; t < T; t++)
        partial_sum_token(a, out + (size_t)t * D, a->partial_slots + slots,
                          a->partial_slots + (size_t)t * K * D, a->slot_rank + (size_t)t * K,
                          topk_w + (size_t)t * K);
    return 0;
}
