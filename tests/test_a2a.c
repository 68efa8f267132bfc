/* Tests for the MoE all-to-all (kernels/a2a.c, kernels/cpu/a2a_shm.c, kernels/cpu/a2a_mpi.c), an
 * MPI program: tests/a2a_test.sh runs it under mpirun -np 1, 2, 3 and 4 (run alone it is one
 * rank). Only rank 0 prints the "N passed, M failed" line, with every rank's counts summed.
 *
 * Every rank's inputs of every round are a pure function of (config, round, rank), so each rank
 * can compute exactly what every other rank sends it and what must come home. The expert is a
 * fake one that depends on the token, the slot's weight and the local expert id; received
 * tokens and combined outputs must match the expected values exactly (bit for bit), ids and
 * counts too.
 *
 * Covered, per transport available at this size (none only on one rank; shm and mpi always):
 * random rounds (T in [0, max] per rank, so some ranks have none; runtime_max = the max over ranks,
 * different each round), skewed routing (every token to one rank's experts), all-zero rounds,
 * tokens spread over every rank, a token with two slots on the same rank, E = 10 split unevenly,
 * E = 3 on 4 ranks (a rank with no experts), K = 2..4; the partial combine (each owner rank's
 * weighted sum rounded to BF16, added in rank order) against that formula, bit for bit; the
 * phase guard, argument errors, config
 * checks agreed across ranks, a runtime_max that differs between ranks, a peer that never
 * arrives (the wait times out naming it), and one that the config's check_peers reports gone in
 * dispatch or combine (the wait fails within a fraction of a second with its message). */
#include "common/tensor.h"
#include "kernels/a2a.h"
#include "tests/check.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static int g_rank, g_size;

/* AddressSanitizer builds (make asan): OpenMPI keeps allocations from MPI_Init until the process
 * exits. These hooks keep the leak check quiet about them, whoever starts the binary (mpirun or
 * tests/run.sh). Full unwinding lets the stacks reach the library frames; PMIx's progress thread
 * has its plugin unloaded before the check, so libevent's frames are the named ones there. */
#if defined(__SANITIZE_ADDRESS__)
const char *__lsan_default_options(void) { return "fast_unwind_on_malloc=0:print_suppressions=0"; }
const char *__lsan_default_suppressions(void) {
    return "leak:libmpi.so\nleak:libopen-pal.so\nleak:libevent_core\n";
}
#endif

/* ---- deterministic inputs ---- */

static uint64_t splitmix(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static int rand_int(uint64_t *s, int n) { return n > 0 ? (int)(splitmix(s) % (uint64_t)n) : 0; }
static float rand_float(uint64_t *s) { return (float)(splitmix(s) >> 40) / (float)(1 << 24); }

typedef enum { ROUTE_RANDOM, ROUTE_SKEWED, ROUTE_ZERO, ROUTE_SPREAD } route_mode;
static const char *const route_names[] = {"random", "skewed", "zero", "spread"};

static route_mode route_of_round(int round) {
    switch (round % 9) {
    case 3: return ROUTE_SKEWED;
    case 6: return ROUTE_ZERO;
    case 8: return ROUTE_SPREAD;
    default: return ROUTE_RANDOM;
    }
}

typedef struct {
    int T;
    float *x;     /* [T, D] */
    int32_t *ids; /* [T, K] global expert ids */
    float *w;     /* [T, K] */
} round_input;

static int owner_of(const a2a_config *c, int e) {
    int r = 0;
    while (e >= c->expert_begin[r + 1])
        r++;
    return r;
}
static int experts_of(const a2a_config *c, int r) {
    return c->expert_begin[r + 1] - c->expert_begin[r];
}
/* The first rank at or after r (cyclically) that owns an expert. */
static int rank_with_experts(const a2a_config *c, int r) {
    while (experts_of(c, r % c->ep_size) == 0)
        r++;
    return r % c->ep_size;
}

static int appears(const int32_t *ids, int n, int32_t e) {
    for (int i = 0; i < n; i++)
        if (ids[i] == e) return 1;
    return 0;
}

/* The inputs of `rank` in `round`; the same on every rank that computes them. */
static void make_input(round_input *in, const a2a_config *c, int cfg_id, int round, int rank) {
    const int D = c->hidden, K = c->top_k, E = c->n_experts, M = c->max_tokens_per_rank;
    uint64_t s = 0x5eedull * 1000003u + (uint64_t)cfg_id * 7919u + (uint64_t)round * 104729u +
                 (uint64_t)rank * 15485863u;
    route_mode mode = route_of_round(round);
    int T = rand_int(&s, M + 1);
    if (rand_int(&s, 4) == 0) T = 0; /* some ranks idle in random rounds */
    if (mode == ROUTE_ZERO) T = 0;
    if (mode != ROUTE_RANDOM && mode != ROUTE_ZERO && T == 0) T = 1 + rand_int(&s, M);
    in->T = T;
    in->x = malloc(((size_t)T * D + 1) * sizeof(float));
    in->ids = malloc(((size_t)T * K + 1) * sizeof(int32_t));
    in->w = malloc(((size_t)T * K + 1) * sizeof(float));
    for (size_t i = 0; i < (size_t)T * D; i++)
        in->x[i] = 2.0f * rand_float(&s) - 1.0f;
    for (size_t i = 0; i < (size_t)T * K; i++)
        in->w[i] = rand_float(&s);
    const int skew_rank = rank_with_experts(c, round / 9); /* the same on every rank */
    for (int t = 0; t < T; t++) {
        int32_t *ids = in->ids + (size_t)t * K;
        if (mode == ROUTE_RANDOM) {
            /* K distinct experts, like a router's top-k */
            int perm[64] = {0};
            for (int e = 0; e < E; e++)
                perm[e] = e;
            for (int k = 0; k < K; k++) {
                int j = k + rand_int(&s, E - k);
                int tmp = perm[k];
                perm[k] = perm[j];
                perm[j] = tmp;
                ids[k] = perm[k];
            }
            /* token 0: its first two slots on one rank (a token goes there once) */
            if (t == 0 && K >= 2) {
                int r = -1;
                for (int q = 0; q < c->ep_size; q++)
                    if (experts_of(c, (q + rank) % c->ep_size) >= 2) {
                        r = (q + rank) % c->ep_size;
                        break;
                    }
                if (r >= 0) {
                    int b = c->expert_begin[r], n = experts_of(c, r);
                    int j = rand_int(&s, n);
                    ids[0] = b + j;
                    ids[1] = b + (j + 1) % n;
                    for (int k = 2; k < K; k++) /* the others stay distinct from all before */
                        while (appears(ids, k, ids[k]))
                            ids[k] = (ids[k] + 1) % E;
                }
            }
        } else if (mode == ROUTE_SKEWED) {
            /* every token of every rank to one rank's experts (repeats when it owns fewer than K)
             */
            int b = c->expert_begin[skew_rank], n = experts_of(c, skew_rank);
            int j = rand_int(&s, n);
            for (int k = 0; k < K; k++)
                ids[k] = b + (j + k) % n;
        } else { /* ROUTE_SPREAD: slot k of token t on rank t + k, so every rank gets tokens */
            for (int k = 0; k < K; k++) {
                int r = rank_with_experts(c, t + k + rank);
                ids[k] = c->expert_begin[r] + rand_int(&s, experts_of(c, r));
            }
        }
    }
}

static void free_input(round_input *in) {
    free(in->x);
    free(in->ids);
    free(in->w);
}

/* The fake expert: deterministic in the token, the slot's weight and the local expert id. */
static float fake_expert(float x, float w, int local_id, int d) {
    return x * (float)(local_id + 1) + w * (float)(d % 7 + 1);
}

/* ---- one round, checked ---- */

/* Combine in the partial form (a2a_combine_partial) instead of the slots form. */
static int g_partial;

typedef struct {
    const a2a_config *c;
    int cfg_id;
    const char *what; /* transport and config, for messages */
} suite;

/* Runs round `round` on every rank: dispatch, check what arrived, run the fake expert, combine,
 * check what came home. Returns 0 when every step worked. */
static int run_round(a2a *a, const suite *S, int round) {
    const a2a_config *c = S->c;
    const int D = c->hidden, K = c->top_k, me = g_rank;
    round_input all[A2A_MAX_RANKS];
    int max_T = 0;
    for (int r = 0; r < g_size; r++) {
        make_input(&all[r], c, S->cfg_id, round, r);
        if (all[r].T > max_T) max_T = all[r].T;
    }
    round_input *in = &all[me];
    int runtime_max = 0;
    MPI_Allreduce(&in->T, &runtime_max, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    CHECK(runtime_max == max_T, "rank %d: runtime_max %d, inputs say %d", me, runtime_max, max_T);

    char err[512] = "";
    int ok = 1;
    int rc = a2a_dispatch(a, in->x, in->ids, in->w, in->T, runtime_max, err, sizeof err);
    CHECK(rc == 0, "rank %d %s round %d (%s): dispatch: %s", me, S->what, round,
          route_names[route_of_round(round)], err);
    if (rc != 0) {
        ok = 0;
        goto done;
    }

    /* What must have arrived: from each source in rank order, its tokens with a slot here. */
    a2a_received got = a2a_get_received(a);
    {
        int n = 0, bad = 0;
        for (int src = 0; src < g_size; src++) {
            const round_input *s = &all[src];
            for (int t = 0; t < s->T; t++) {
                int mine = 0;
                for (int k = 0; k < K; k++)
                    mine |= owner_of(c, s->ids[(size_t)t * K + k]) == me;
                if (!mine) continue;
                if (n < got.n && !bad) {
                    /* x as the payload's round trip leaves it, bit for bit */
                    float xs[256];
                    a2a_payload_roundtrip(c->payload, xs, s->x + (size_t)t * D, D);
                    if (memcmp(got.x + (size_t)n * D, xs, (size_t)D * 4) != 0) bad = 1;
                    for (int k = 0; k < K; k++) {
                        int g = s->ids[(size_t)t * K + k];
                        int want = owner_of(c, g) == me ? g - c->expert_begin[me] : -1;
                        if (got.ids[(size_t)n * K + k] != want) bad = 2;
                        if (memcmp(&got.w[(size_t)n * K + k], &s->w[(size_t)t * K + k], 4) != 0)
                            bad = 3;
                    }
                    if (bad)
                        fprintf(stderr,
                                "rank %d %s round %d: received token %d (source %d, t %d) differs "
                                "(%s)\n",
                                me, S->what, round, n, src, t,
                                bad == 1   ? "x"
                                : bad == 2 ? "ids"
                                           : "w");
                }
                n++;
            }
        }
        CHECK(got.n == n && !bad, "rank %d %s round %d (%s): received %d tokens, want %d%s", me,
              S->what, round, route_names[route_of_round(round)], got.n, n,
              bad ? ", contents differ" : "");
        ok &= got.n == n && !bad;
    }

    /* The fake experts, on every slot this rank owns; other slots hold a poison value that must
     * never come home. */
    float *expert_out = malloc(((size_t)got.n * K * D + 1) * sizeof(float));
    for (int i = 0; i < got.n; i++)
        for (int k = 0; k < K; k++) {
            int lid = got.ids[(size_t)i * K + k];
            float *o = expert_out + ((size_t)i * K + k) * D;
            for (int d = 0; d < D; d++)
                o[d] = lid >= 0
                           ? fake_expert(got.x[(size_t)i * D + d], got.w[(size_t)i * K + k], lid, d)
                           : -12345.0f;
        }
    float *out = malloc(((size_t)in->T * K * D + 1) * sizeof(float));
    rc = g_partial ? a2a_combine_partial(a, expert_out, in->w, out, err, sizeof err)
                   : a2a_combine(a, expert_out, out, err, sizeof err);
    CHECK(rc == 0, "rank %d %s round %d: combine: %s", me, S->what, round, err);
    if (rc == 0 && g_partial) {
        /* out[t, d] = sum over owner ranks r (in order) of bf16(sum over r's slots in order of
         * w * output), the sums in fp32 from +0 */
        int bad = 0;
        for (int t = 0; t < in->T && !bad; t++) {
            float xs[256];
            a2a_payload_roundtrip(c->payload, xs, in->x + (size_t)t * D, D);
            for (int d = 0; d < D && !bad; d++) {
                float want = 0.0f;
                for (int r = 0; r < g_size; r++) {
                    float part = 0.0f;
                    int slots = 0;
                    for (int k = 0; k < K; k++) {
                        int g = in->ids[(size_t)t * K + k];
                        if (owner_of(c, g) != r) continue;
                        float wk = in->w[(size_t)t * K + k];
                        float y = fake_expert(xs[d], wk, g - c->expert_begin[r], d);
                        part = part + wk * y;
                        slots++;
                    }
                    if (slots) want = want + bf16_to_f32(f32_to_bf16(part));
                }
                float have = out[(size_t)t * D + d];
                if (memcmp(&want, &have, 4) != 0) {
                    fprintf(stderr, "rank %d %s round %d: partial out[%d, %d] = %.9g, want %.9g\n",
                            me, S->what, round, t, d, have, want);
                    bad = 1;
                }
            }
        }
        CHECK(!bad, "rank %d %s round %d (%s): partial sums differ", me, S->what, round,
              route_names[route_of_round(round)]);
        ok &= !bad;
    } else if (rc == 0) {
        int bad = 0;
        for (int t = 0; t < in->T && !bad; t++)
            for (int k = 0; k < K && !bad; k++) {
                int g = in->ids[(size_t)t * K + k];
                int lid = g - c->expert_begin[owner_of(c, g)];
                float xs[256];
                a2a_payload_roundtrip(c->payload, xs, in->x + (size_t)t * D, D);
                for (int d = 0; d < D; d++) {
                    float want = fake_expert(xs[d], in->w[(size_t)t * K + k], lid, d);
                    float have = out[((size_t)t * K + k) * D + d];
                    if (memcmp(&want, &have, 4) != 0) {
                        fprintf(stderr,
                                "rank %d %s round %d: out[%d, %d, %d] = %.9g, want %.9g (expert %d "
                                "on rank %d)\n",
                                me, S->what, round, t, k, d, have, want, g, owner_of(c, g));
                        bad = 1;
                        break;
                    }
                }
            }
        CHECK(!bad, "rank %d %s round %d (%s): combined outputs differ", me, S->what, round,
              route_names[route_of_round(round)]);
        ok &= !bad;
    } else {
        ok = 0;
    }
    free(expert_out);
    free(out);
done:
    for (int r = 0; r < g_size; r++)
        free_input(&all[r]);
    return ok ? 0 : -1;
}

/* ---- suites ---- */

/* The payload and hidden size of the suites (the payload suites use 32: nvfp4 needs D % 16). */
static a2a_payload g_payload = A2A_PAYLOAD_F32;
static int g_hidden = 24;

static a2a_config make_config(a2a_transport t, int E, int K) {
    a2a_config c;
    memset(&c, 0, sizeof c);
    c.transport = t;
    c.ep_size = g_size;
    c.rank = g_rank;
    c.max_tokens_per_rank = 12;
    c.hidden = g_hidden;
    c.payload = g_payload;
    c.top_k = K;
    c.n_experts = E;
    a2a_split_experts(E, g_size, c.expert_begin);
    c.timeout_s = 20;
    return c;
}

/* Many rounds, then the phase guard and argument errors, which must leave the a2a usable. */
static void test_rounds(a2a_transport t, int E, int K, int cfg_id) {
    a2a_config c = make_config(t, E, K);
    char what[96], err[512] = "";
    snprintf(what, sizeof what, "%s E=%d K=%d np=%d payload %s", a2a_transport_name(t), E, K,
             g_size, a2a_payload_name(c.payload));
    suite S = {&c, cfg_id, what};
    a2a *a = a2a_create(&c, MPI_COMM_WORLD, err, sizeof err);
    CHECK(a != NULL, "rank %d %s: create: %s", g_rank, what, err);
    if (!a) return;
    CHECK(a2a_get_received(a).n == 0, "rank %d %s: received before any dispatch", g_rank, what);

    const int n_rounds = 36;
    int failed_rounds = 0;
    for (int round = 0; round < n_rounds && failed_rounds < 3; round++) {
        /* every rank counts a round any rank failed, so that all stop together */
        int bad = run_round(a, &S, round) != 0, any = bad;
        MPI_Allreduce(&bad, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
        failed_rounds += any;
    }

    /* Phase guard: a second dispatch before the combine is refused and changes nothing. */
    if (failed_rounds == 0) {
        float x[64 * 2] = {0}, w[4 * 2] = {0};
        int32_t ids[4 * 2] = {0};
        int rc = a2a_dispatch(a, x, ids, w, 1, 1, err, sizeof err);
        CHECK(rc == 0, "rank %d %s: guard round dispatch: %s", g_rank, what, err);
        rc = a2a_dispatch(a, x, ids, w, 1, 1, err, sizeof err);
        CHECK(rc == -1 && strstr(err, "twice"), "rank %d %s: second dispatch: rc %d, '%s'", g_rank,
              what, rc, err);
        a2a_received got = a2a_get_received(a);
        float *eo = calloc((size_t)got.n * K * c.hidden + 1, sizeof(float));
        float *out = calloc((size_t)K * c.hidden + 1, sizeof(float));
        rc = a2a_combine(a, eo, out, err, sizeof err);
        CHECK(rc == 0, "rank %d %s: combine after the refused dispatch: %s", g_rank, what, err);
        rc = a2a_combine(a, eo, out, err, sizeof err);
        free(eo);
        free(out);
        CHECK(rc == -1 && strstr(err, "without a dispatch"),
              "rank %d %s: combine without dispatch: rc %d, '%s'", g_rank, what, rc, err);

        /* Argument errors are local and leave the a2a idle. */
        rc = a2a_dispatch(a, x, ids, w, 2, 1, err, sizeof err);
        CHECK(rc == -1 && strstr(err, "runtime_max"), "rank %d %s: T > runtime_max: '%s'", g_rank,
              what, err);
        rc = a2a_dispatch(a, x, ids, w, 1, c.max_tokens_per_rank + 1, err, sizeof err);
        CHECK(rc == -1 && strstr(err, "max_tokens_per_rank"),
              "rank %d %s: runtime_max > max_tokens_per_rank: '%s'", g_rank, what, err);
        ids[1] = E;
        rc = a2a_dispatch(a, x, ids, w, 1, 1, err, sizeof err);
        CHECK(rc == -1 && strstr(err, "expert id"), "rank %d %s: expert id out of range: '%s'",
              g_rank, what, err);
        ids[1] = -1;
        rc = a2a_dispatch(a, x, ids, w, 1, 1, err, sizeof err);
        CHECK(rc == -1 && strstr(err, "expert id"), "rank %d %s: negative expert id: '%s'", g_rank,
              what, err);
        /* ...and the next round works. */
        CHECK(run_round(a, &S, n_rounds) == 0, "rank %d %s: round after the errors", g_rank, what);
    }
    a2a_destroy(a);
}

/* A runtime_max that differs between ranks is caught by every rank (np >= 2). */
static void test_runtime_max_mismatch(a2a_transport t) {
    a2a_config c = make_config(t, 10, 2);
    char err[512] = "";
    a2a *a = a2a_create(&c, MPI_COMM_WORLD, err, sizeof err);
    CHECK(a != NULL, "rank %d: create: %s", g_rank, err);
    if (!a) return;
    float x[24] = {0}, w[2] = {0.5f, 0.5f};
    int32_t ids[2] = {0, 9};
    int rc = a2a_dispatch(a, x, ids, w, 1, g_rank == 0 ? 2 : 1, err, sizeof err);
    CHECK(rc == -1 && strstr(err, "runtime_max"), "rank %d %s: mismatched runtime_max: rc %d '%s'",
          g_rank, a2a_transport_name(t), rc, err);
    rc = a2a_dispatch(a, x, ids, w, 1, 1, err, sizeof err);
    CHECK(rc == -1 && strstr(err, "failed earlier"), "rank %d: after the failure: rc %d '%s'",
          g_rank, rc, err);
    a2a_destroy(a);
}

/* A peer that never arrives: the wait ends after timeout_s with a message naming it (np >= 2). */
static void test_timeout(a2a_transport t) {
    a2a_config c = make_config(t, 10, 2);
    c.timeout_s = 0.3;
    char err[512] = "";
    a2a *a = a2a_create(&c, MPI_COMM_WORLD, err, sizeof err);
    CHECK(a != NULL, "rank %d: create: %s", g_rank, err);
    if (!a) return;
    if (g_rank == 0) {
        float x[24] = {0}, w[2] = {0.5f, 0.5f};
        int32_t ids[2] = {0, 9};
        double t0 = MPI_Wtime();
        int rc = a2a_dispatch(a, x, ids, w, 1, 1, err, sizeof err);
        double dt = MPI_Wtime() - t0;
        CHECK(rc == -1 && (strstr(err, "rank 1 ") || strstr(err, "ranks 1,")),
              "%s: dispatch with absent peers: rc %d '%s'", a2a_transport_name(t), rc, err);
        CHECK(dt >= 0.29 && dt < 5.0, "%s: timed out after %.3f s, want 0.3", a2a_transport_name(t),
              dt);
        rc = a2a_combine(a, x, x, err, sizeof err);
        CHECK(rc == -1 && strstr(err, "failed earlier"), "after a timeout: rc %d '%s'", rc, err);
    }
    MPI_Barrier(MPI_COMM_WORLD);
    a2a_destroy(a);
}

/* The config's check_peers, answering for the ranks that wait: 0 for the first `healthy` calls
 * (the wait goes on), then -1 naming `gone` ("rank X (pid 0) has exited", as the rank group says
 * it), or with no message at all when silent. */
typedef struct {
    int calls;
    int healthy;
    int gone;
    int silent;
} peer_watch;

static int peer_watch_check(void *ctx, char *msg, size_t len) {
    peer_watch *w = ctx;
    if (++w->calls <= w->healthy) return 0;
    if (!w->silent) snprintf(msg, len, "rank %d (pid 0) has exited", w->gone);
    return -1;
}

/* A peer known to be gone (np >= 2): the highest rank skips the dispatch (or, after a round's
 * dispatch, the combine); the others' wait asks check_peers every 100 ms, goes on while it answers
 * 0 and fails on the first -1, after about 0.1 s per call, far below timeout_s = 20 s, with the
 * callback's message. Then the a2a refuses everything and is destroyed as after a timeout.
 * healthy = a large number: check_peers never objects and the wait ends at timeout_s, naming the
 * missing rank as without a callback. */
static void test_peer_gone(a2a_transport t, int in_combine, int silent, int healthy,
                           double timeout_s) {
    const int last = g_size - 1;
    a2a_config c = make_config(t, 10, 2);
    peer_watch w = {.calls = 0, .healthy = healthy, .gone = last, .silent = silent};
    c.timeout_s = timeout_s;
    c.check_peers = peer_watch_check;
    c.check_ctx = &w;
    char err[512] = "", what[96], want[96];
    snprintf(what, sizeof what, "rank %d %s, peer gone in %s%s", g_rank, a2a_transport_name(t),
             in_combine ? "combine" : "dispatch", silent ? ", no message" : "");
    a2a *a = a2a_create(&c, MPI_COMM_WORLD, err, sizeof err);
    CHECK(a != NULL, "%s: create: %s", what, err);
    if (!a) return;
    float x[2 * 24] = {0}, w2[4] = {0.5f, 0.5f, 0.25f, 0.75f}, out[2 * 2 * 24];
    int32_t ids[4] = {0, 9, 5, 1}; /* tokens to rank 0, the last rank and ranks between */
    for (int i = 0; i < 2 * 24; i++)
        x[i] = (float)i;
    if (in_combine) {
        int rc = a2a_dispatch(a, x, ids, w2, 2, 2, err, sizeof err);
        CHECK(rc == 0, "%s: the round's dispatch: %s", what, err);
    }
    if (g_rank != last) {
        a2a_received got = a2a_get_received(a);
        float *eo = calloc((size_t)got.n * 2 * 24 + 1, sizeof(float));
        double t0 = MPI_Wtime();
        int rc = in_combine ? a2a_combine(a, eo, out, err, sizeof err)
                            : a2a_dispatch(a, x, ids, w2, 2, 2, err, sizeof err);
        double dt = MPI_Wtime() - t0;
        free(eo);
        if (healthy < 1000) {
            if (silent)
                snprintf(want, sizeof want, "a peer has gone");
            else
                snprintf(want, sizeof want, "rank %d (pid 0) has exited", last);
            CHECK(rc == -1 && strstr(err, want) && strstr(err, in_combine ? "combine" : "dispatch"),
                  "%s: rc %d '%s', want '%s'", what, rc, err, want);
            CHECK(dt >= 0.1 * (healthy + 1) - 0.01 && dt < 1.0,
                  "%s: failed after %.3f s, want about %.1f (timeout %g)", what, dt,
                  0.1 * (healthy + 1), timeout_s);
            CHECK(w.calls == healthy + 1, "%s: check_peers called %d times, want %d", what, w.calls,
                  healthy + 1);
        } else {
            snprintf(want, sizeof want, "rank %d did not arrive", last);
            CHECK(rc == -1 && strstr(err, want), "%s: rc %d '%s', want '%s'", what, rc, err, want);
            CHECK(dt >= timeout_s - 0.01 && dt < timeout_s + 1.0,
                  "%s: timed out after %.3f s, want %g", what, dt, timeout_s);
            /* at least once: on a loaded machine the waiting thread may sleep past several of
             * its 100 ms checks and meet the timeout first */
            CHECK(w.calls >= 1, "%s: check_peers called %d times in %.3f s", what, w.calls, dt);
        }
        rc = a2a_dispatch(a, x, ids, w2, 2, 2, err, sizeof err);
        CHECK(rc == -1 && strstr(err, "failed earlier"), "%s: dispatch after: rc %d '%s'", what, rc,
              err);
        CHECK(a2a_get_received(a).n == 0, "%s: received tokens after the failure", what);
    } else {
        CHECK(w.calls == 0, "%s: check_peers called %d times on the rank that skipped", what,
              w.calls);
    }
    MPI_Barrier(MPI_COMM_WORLD);
    a2a_destroy(a);
}

/* The config check: every rank rejects together, whether the fault is shared or one rank's. */
static void test_config(void) {
    char err[512];
    a2a_config c = make_config(A2A_SHM, 10, 2);
#define EXPECT_REJECT(cfg, needle)                                                                 \
    do {                                                                                           \
        err[0] = 0;                                                                                \
        a2a *a_ = a2a_create(&(cfg), MPI_COMM_WORLD, err, sizeof err);                             \
        CHECK(a_ == NULL && strstr(err, (needle)),                                                 \
              "rank %d: want rejection with '%s', got %s '%s'", g_rank, (needle),                  \
              a_ ? "an a2a" : "NULL", err);                                                        \
        if (a_) a2a_destroy(a_);                                                                   \
    } while (0)
    a2a_config b = c;
    b.top_k = 0;
    EXPECT_REJECT(b, "top_k");
    b = c;
    b.top_k = 11;
    EXPECT_REJECT(b, "top_k");
    b = c;
    b.ep_size = g_size + 1;
    EXPECT_REJECT(b, "ep_size");
    b = c;
    b.expert_begin[g_size] = 9;
    EXPECT_REJECT(b, "expert_begin");
    b = c;
    b.transport = A2A_NVLINK_ONE_SIDED;
    EXPECT_REJECT(b, "CUDA");
    b = c;
    b.max_tokens_per_rank = 0;
    EXPECT_REJECT(b, "max_tokens_per_rank");
    b = c;
    b.timeout_s = -1;
    EXPECT_REJECT(b, "timeout_s");
    b = c; /* hidden 24 is not a whole number of NVFP4 groups */
    b.payload = A2A_PAYLOAD_NVFP4;
    EXPECT_REJECT(b, "nvfp4");
    b = c;
    b.payload = (a2a_payload)7;
    EXPECT_REJECT(b, "payload");
    if (g_size > 1) {
        b = c;
        b.transport = A2A_NONE;
        EXPECT_REJECT(b, "none");
        b = c; /* one rank's fault: the others learn of it */
        if (g_rank == 1) b.top_k = 0;
        EXPECT_REJECT(b, g_rank == 1 ? "top_k" : "another rank");
        b = c; /* every rank valid alone, but they disagree */
        if (g_rank == g_size - 1) b.hidden = 32;
        EXPECT_REJECT(b, "hidden differs");
        b = c;
        if (g_rank == 0) b.payload = A2A_PAYLOAD_BF16;
        EXPECT_REJECT(b, "payload differs");
    }
#undef EXPECT_REJECT
}

static void test_names_and_split(void) {
    a2a_transport t;
    CHECK(a2a_transport_parse("shm", &t) && t == A2A_SHM, "shm");
    CHECK(a2a_transport_parse("mpi", &t) && t == A2A_MPI, "mpi");
    CHECK(a2a_transport_parse("none", &t) && t == A2A_NONE, "none");
    CHECK(a2a_transport_parse("nccl", &t) && t == A2A_NCCL, "nccl");
    CHECK(a2a_transport_parse("nvlink_one_sided", &t) && t == A2A_NVLINK_ONE_SIDED, "nvlink");
    CHECK(a2a_transport_parse("flashinfer_nvlink_one_sided", &t) && t == A2A_NVLINK_ONE_SIDED,
          "flashinfer_nvlink_one_sided");
    CHECK(!a2a_transport_parse("tcp", &t) && !a2a_transport_parse("", &t) &&
              !a2a_transport_parse(NULL, &t),
          "unknown names");
    for (int i = A2A_NONE; i <= A2A_NCCL; i++)
        CHECK(a2a_transport_parse(a2a_transport_name((a2a_transport)i), &t) && (int)t == i,
              "name round trip %d", i);
    int b[6];
    a2a_split_experts(10, 3, b);
    CHECK(b[0] == 0 && b[1] == 4 && b[2] == 7 && b[3] == 10, "10 on 3: %d %d %d %d", b[0], b[1],
          b[2], b[3]);
    a2a_split_experts(10, 4, b);
    CHECK(b[1] == 3 && b[2] == 6 && b[3] == 8 && b[4] == 10, "10 on 4");
    a2a_split_experts(3, 4, b);
    CHECK(b[1] == 1 && b[2] == 2 && b[3] == 3 && b[4] == 3, "3 on 4");
    a2a_split_experts(128, 1, b);
    CHECK(b[0] == 0 && b[1] == 128, "128 on 1");
}

/* The round trips against their formats' error bounds, and the names and sizes. */
static void test_payload_errors(void) {
    const int D = 2048;
    float *x = malloc(sizeof(float) * D), *y = malloc(sizeof(float) * D);
    uint64_t s = 77;
    for (int i = 0; i < D; i++)
        x[i] = (2.0f * rand_float(&s) - 1.0f) * (float)(1 << (i % 5)); /* mixed magnitudes */
    const struct {
        a2a_payload p;
        const char *name;
        size_t bytes;
        double rel_rms; /* relative RMS error allowed */
    } f[] = {{A2A_PAYLOAD_F32, "f32", 8192, 0.0},
             {A2A_PAYLOAD_BF16, "bf16", 4096, 0x1p-8},
             {A2A_PAYLOAD_FP8, "fp8", 2048 + 64, 0x1p-4},
             {A2A_PAYLOAD_NVFP4, "nvfp4", 1024 + 128 + 4, 0.15}};
    for (size_t i = 0; i < sizeof f / sizeof f[0]; i++) {
        a2a_payload parsed = A2A_PAYLOAD_F32;
        CHECK(a2a_payload_parse(f[i].name, &parsed) && parsed == f[i].p &&
                  strcmp(a2a_payload_name(f[i].p), f[i].name) == 0,
              "payload name %s", f[i].name);
        CHECK(a2a_payload_bytes(f[i].p, D) == f[i].bytes, "payload %s: %zu bytes a token of %d",
              f[i].name, a2a_payload_bytes(f[i].p, D), D);
        a2a_payload_roundtrip(f[i].p, y, x, D);
        double se = 0, sx = 0;
        for (int d = 0; d < D; d++) {
            se += ((double)y[d] - x[d]) * ((double)y[d] - x[d]);
            sx += (double)x[d] * x[d];
        }
        double rel = sqrt(se / sx);
        CHECK(f[i].p == A2A_PAYLOAD_F32 ? se == 0 : rel <= f[i].rel_rms && rel > 0,
              "payload %s: relative RMS error %.3g, allowed %.3g", f[i].name, rel, f[i].rel_rms);
    }
    CHECK(!a2a_payload_parse("int4", NULL), "an unknown payload name is refused");
    free(x);
    free(y);
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &g_size);

    if (g_rank == 0) test_names_and_split();
    test_config();

    /* Transports: those named on the command line, else every one available at this size. */
    a2a_transport transports[3];
    int n_t = 0;
    for (int i = 1; i < argc && n_t < 3; i++)
        if (!a2a_transport_parse(argv[i], &transports[n_t++]) ||
            (transports[n_t - 1] == A2A_NONE && g_size > 1)) {
            if (g_rank == 0) fprintf(stderr, "usage: test_a2a [none|shm|mpi ...]\n");
            MPI_Finalize();
            return 2;
        }
    if (n_t == 0) {
        if (g_size == 1) transports[n_t++] = A2A_NONE;
        transports[n_t++] = A2A_SHM;
        transports[n_t++] = A2A_MPI;
    }
    const int cfgs[][2] = {{10, 2}, {10, 3}, {10, 4}, {3, 2}}; /* E, K */
    for (int i = 0; i < n_t; i++) {
        for (int j = 0; j < (int)(sizeof cfgs / sizeof cfgs[0]); j++)
            test_rounds(transports[i], cfgs[j][0], cfgs[j][1], j);
        if (g_size > 1 && transports[i] != A2A_NONE) {
            test_runtime_max_mismatch(transports[i]);
            test_timeout(transports[i]);
            test_peer_gone(transports[i], 0, 0, 1, 20);
            test_peer_gone(transports[i], 1, 0, 1, 20);
            test_peer_gone(transports[i], 0, 1, 0, 20);
            test_peer_gone(transports[i], 0, 0, 1000000, 0.35);
        }
    }

    /* Quantized payloads: the same rounds, every token as the round trip leaves it. */
    if (g_rank == 0) test_payload_errors();
    g_hidden = 32;
    for (a2a_payload p = A2A_PAYLOAD_BF16; p <= A2A_PAYLOAD_NVFP4; p++) {
        g_payload = p;
        for (int i = 0; i < n_t; i++) {
            test_rounds(transports[i], 10, 2, 0);
            test_rounds(transports[i], 10, 4, 2);
        }
    }
    g_payload = A2A_PAYLOAD_F32;
    g_hidden = 24;

    /* The partial form: each owner rank's weighted sum in BF16, added in rank order. */
    g_partial = 1;
    for (int i = 0; i < n_t; i++) {
        test_rounds(transports[i], 10, 3, 1);
        test_rounds(transports[i], 3, 2, 3);
    }
    g_partial = 0;

    int mine[2] = {check_passed, check_failed}, sum[2] = {0, 0};
    MPI_Allreduce(mine, sum, 2, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    if (g_rank == 0) printf("%d passed, %d failed\n", sum[0], sum[1]);
    MPI_Finalize();
    return sum[1] ? 1 : 0;
}
