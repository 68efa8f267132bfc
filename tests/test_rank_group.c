/* Tests of the rank group (runner/rank_group.c).
 *
 *   test_rank_group                     alone (tests/run.sh): SGLang's parallel flags, the group
 *                                       of one without MPI (rank 0 of 1, no communicator, the
 *                                       step decision from its own report, the load table, pick,
 *                                       the URLs for each kind of listen address, the liveness
 *                                       check, bad timeouts), last a group of one with MPI forced
 *   mpirun -np N test_rank_group        the group of N (tests/a2a_test.sh, N = 1..4): ranks, pids,
 *                                       hostnames, 200 steps of different reports per rank (every
 *                                       report must arrive intact, runtime_max the largest, some
 *                                       all-zero steps) while another thread reads the load table,
 *                                       stop from each rank, the least-loaded pick and its spread,
 *                                       URLs of mixed listen addresses, the liveness check
 *   mpirun -np N test_rank_group timeout
 *                                       timeout 1 s, the highest rank sleeps through a step: the
 *                                       others fail that step after 1 to 2 s naming it
 *   mpirun --mca orte_allowed_exit_without_sync 1 -np N test_rank_group gone
 *                                       the highest rank exits during a step: the others fail it
 *                                       within a fraction of a second naming its pid
 *
 * Every report is a pure function of (step, rank), so each rank knows what every other rank sent.
 * Under mpirun rank 0 prints the "N passed, M failed" line with every rank's counts summed; after
 * a failed step the group's communicator is left alone (the sums go over MPI_COMM_WORLD while the
 * slow peer is alive, or over a communicator of the survivors when it has exited). */
#include "runner/rank_group.h"
#include "tests/check.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* AddressSanitizer builds (make asan): OpenMPI keeps allocations from MPI_Init until the process
 * exits (see tests/test_a2a.c). */
#if defined(__SANITIZE_ADDRESS__)
const char *__lsan_default_options(void) { return "fast_unwind_on_malloc=0:print_suppressions=0"; }
const char *__lsan_default_suppressions(void) {
    return "leak:libmpi.so\nleak:libopen-pal.so\nleak:libevent_core\n";
}
#endif

static int g_rank, g_size;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static uint64_t splitmix(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* The report of `rank` in step `step` of the random steps: token counts in [0, 300] (0 for a
 * quarter of the ranks, and for every rank in every 10th step), the wide fields full 64-bit values
 * (negative too) so that any lost or swapped byte shows, n_requests_done = the step so that a
 * snapshot of the load table tells which step it holds. */
#define ZERO_STEP(step) ((step) % 10 == 7)
static void report_of(rank_report *r, int step, int rank) {
    uint64_t s = 0x5eedull + (uint64_t)step * 104729u + (uint64_t)rank * 15485863u;
    memset(r, 0, sizeof *r);
    r->n_tokens = (int64_t)(splitmix(&s) % 301);
    if (splitmix(&s) % 4 == 0 || ZERO_STEP(step)) r->n_tokens = 0;
    r->stop = 0;
    r->n_running = (int64_t)(splitmix(&s) % 64);
    r->n_waiting = (int64_t)(splitmix(&s) % 64);
    r->kv_pages_used = (int64_t)splitmix(&s);
    r->kv_pages_total = (int64_t)splitmix(&s);
    r->n_requests_done = step;
    r->n_generated_tokens = (int64_t)splitmix(&s);
    r->gen_throughput_milli = ((int64_t)rank << 40) | step;
}

/* ---- SGLang's flags (no group needed) ---- */

static void test_parallel_flags(void) {
    char err[512];
#define FLAGS_OK(world, tp, dp, ep, dpa)                                                           \
    do {                                                                                           \
        err[0] = 0;                                                                                \
        int rc_ = rank_group_check_parallel_flags(world, tp, dp, ep, dpa, err, sizeof err);        \
        CHECK(rc_ == 0, "world %d tp %d dp %d ep %d dp-attention %d: rc %d '%s'", world, tp, dp,   \
              ep, (int)(dpa), rc_, err);                                                           \
    } while (0)
#define FLAGS_BAD(world, tp, dp, ep, dpa, needle)                                                  \
    do {                                                                                           \
        err[0] = 0;                                                                                \
        int rc_ = rank_group_check_parallel_flags(world, tp, dp, ep, dpa, err, sizeof err);        \
        CHECK(rc_ == -1 && strstr(err, needle),                                                    \
              "world %d tp %d dp %d ep %d dp-attention %d: rc %d '%s', want '%s'", world, tp, dp,  \
              ep, (int)(dpa), rc_, err, needle);                                                   \
    } while (0)
    /* 0 = not given: always fine */
    for (int world = 1; world <= 8; world *= 2) {
        FLAGS_OK(world, 0, 0, 0, false);
        FLAGS_OK(world, 0, 0, 0, true);
        FLAGS_OK(world, world, 0, 0, false);
        FLAGS_OK(world, 0, 0, world, false);
        FLAGS_OK(world, world, 0, world, false);
        FLAGS_OK(world, world, world, world, true);
        FLAGS_OK(world, 0, world, 0, true);
        FLAGS_OK(world, 0, 1, 0, false); /* one replica: what a single group is */
    }
    FLAGS_OK(1, 1, 1, 1, false);
    FLAGS_OK(1, 1, 1, 1, true);
    /* tp, ep unequal to the world, naming the flag and the world */
    FLAGS_BAD(4, 2, 0, 0, false, "--tp 2");
    FLAGS_BAD(4, 8, 0, 4, true, "--tp 8");
    FLAGS_BAD(2, 1, 0, 0, false, "mpirun -np 2");
    FLAGS_BAD(1, 2, 0, 0, false, "1 rank (");
    FLAGS_BAD(4, 4, 0, 2, false, "--ep 2");
    FLAGS_BAD(4, 0, 0, 1, false, "--ep 1");
    FLAGS_BAD(4, 0, 4, 3, true, "--ep 3");
    FLAGS_BAD(2, -1, 0, 0, false, "--tp -1");
    /* dp: needs --enable-dp-attention, then must equal the world */
    FLAGS_BAD(4, 4, 4, 4, false, "--enable-dp-attention");
    FLAGS_BAD(4, 0, 2, 0, false, "--dp 2");
    FLAGS_BAD(4, 0, 2, 0, true, "--dp 2");
    FLAGS_BAD(4, 0, 2, 0, true, "(4)");
    FLAGS_BAD(4, 0, 1, 0, true, "--dp 1");
    FLAGS_BAD(1, 0, 2, 0, true, "--dp 2");
#undef FLAGS_OK
#undef FLAGS_BAD
}

/* ---- the URLs ---- */

/* The URL this rank must see for a peer listening on host:port (every peer on this node). */
static void want_url(char *out, size_t len, const char *host, int port) {
    const char *h = host ? host : "";
    if (!*h || !strcmp(h, "0.0.0.0"))
        h = "127.0.0.1";
    else if (!strcmp(h, "::") || !strcmp(h, "[::]"))
        h = "[::1]";
    if (strchr(h, ':') && h[0] != '[')
        snprintf(out, len, "http://[%s]:%d", h, port);
    else
        snprintf(out, len, "http://%s:%d", h, port);
}

/* The listen address of rank r in URL round `round` (every rank the same in rounds 0-5). */
static const char *host_of(int round, int r, char *buf, size_t len) {
    static const char *const same[] = {"127.0.0.1", "0.0.0.0", "::", "", "localhost", "::1"};
    if (round < 6) return same[round];
    switch (r % 6) {
    case 0: return "0.0.0.0";
    case 1: return "::";
    case 2: snprintf(buf, len, "10.0.0.%d", r); return buf;
    case 3: snprintf(buf, len, "fe80::%x", r); return buf;
    case 4: return "[::]";
    default: return "127.0.0.2";
    }
}

static void test_urls(rank_group *g) {
    char err[512], buf[64], want[128];
    for (int r = 0; r < g_size; r++)
        CHECK(!strcmp(rank_group_url(g, r), ""), "rank %d: url(%d) '%s' before share_endpoints",
              g_rank, r, rank_group_url(g, r));
    for (int round = 0; round < 7; round++) {
        const char *mine = host_of(round, g_rank, buf, sizeof buf);
        const int port = 8000 + 100 * round;
        err[0] = 0;
        int rc = rank_group_share_endpoints(g, mine, port + g_rank, err, sizeof err);
        CHECK(rc == 0, "rank %d: share_endpoints('%s'): %s", g_rank, mine, err);
        int bad = 0;
        for (int r = 0; r < g_size; r++) {
            char hb[64];
            want_url(want, sizeof want, host_of(round, r, hb, sizeof hb), port + r);
            if (strcmp(rank_group_url(g, r), want) != 0) {
                if (bad++ < 4)
                    fprintf(stderr, "rank %d round %d: url(%d) = '%s', want '%s'\n", g_rank, round,
                            r, rank_group_url(g, r), want);
            }
        }
        CHECK(bad == 0, "rank %d: URL round %d ('%s' here): %d URLs differ", g_rank, round, mine,
              bad);
    }
    /* No host at all: the wildcard. */
    rank_group_share_endpoints(g, NULL, 7000 + g_rank, err, sizeof err);
    snprintf(want, sizeof want, "http://127.0.0.1:%d", 7000 + g_rank);
    CHECK(!strcmp(rank_group_url(g, g_rank), want), "rank %d: NULL host: '%s'", g_rank,
          rank_group_url(g, g_rank));
    CHECK(!strcmp(rank_group_url(g, -1), "") && !strcmp(rank_group_url(g, g_size), ""),
          "rank %d: url of a rank outside the group", g_rank);
}

/* ---- alone: the group of one ---- */

static void test_bad_timeouts(void) {
    char err[512];
    const double bad[] = {-1.0, -1e-9, 1e6 + 1, 1e300, NAN, INFINITY, -INFINITY};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        err[0] = 0;
        rank_group *g = rank_group_init(NULL, NULL, false, bad[i], err, sizeof err);
        CHECK(g == NULL && strstr(err, "--dist-timeout"), "timeout %g: %s '%s'", bad[i],
              g ? "a group" : "NULL", err);
        if (g) rank_group_finalize(g);
    }
}

static void test_group_of_one(void) {
    char err[512] = "", host[256] = "";
    gethostname(host, sizeof host - 1);
    rank_group *g = rank_group_init(NULL, NULL, false, 0, err, sizeof err);
    CHECK(g != NULL, "group of one: %s", err);
    if (!g) return;
    CHECK(rank_group_rank(g) == 0 && rank_group_size(g) == 1, "rank %d of %d", rank_group_rank(g),
          rank_group_size(g));
    CHECK(rank_group_local_rank(g) == 0 && rank_group_local_size(g) == 1 && rank_group_same_node(g),
          "local rank %d of %d", rank_group_local_rank(g), rank_group_local_size(g));
    CHECK(rank_group_comm(g) == MPI_COMM_NULL, "a communicator without MPI");
    CHECK(rank_group_timeout(g) == 60.0, "timeout 0 gives %g, want the default 60",
          rank_group_timeout(g));
    CHECK(rank_group_pid(g, 0) == (int)getpid() && rank_group_pid(g, 1) == 0 &&
              rank_group_pid(g, -1) == 0,
          "pids %d %d", rank_group_pid(g, 0), rank_group_pid(g, 1));
    CHECK(!strcmp(rank_group_hostname(g, 0), host) && !strcmp(rank_group_hostname(g, 1), ""),
          "hostname '%s', want '%s'", rank_group_hostname(g, 0), host);
    int initialized = 0;
    MPI_Initialized(&initialized);
    CHECK(!initialized, "MPI started for a group of one");

    /* The load table before any step: zeros, a large age; pick: this rank. */
    rank_report loads[2];
    memset(loads, 0x55, sizeof loads);
    double age = rank_group_loads(g, loads);
    rank_report zero;
    memset(&zero, 0, sizeof zero);
    CHECK(age >= 1e8 && !memcmp(&loads[0], &zero, sizeof zero), "loads before a step: age %g", age);
    CHECK(rank_group_pick(g, 0) == 0 && rank_group_pick(g, 1000) == 0, "pick before a step");

    /* Steps: the decision is this rank's report. */
    int bad = 0;
    for (int step = 0; step < 50; step++) {
        rank_report mine;
        report_of(&mine, step, 0);
        mine.stop = step % 7 == 3;
        rank_step out = {.runtime_max = -5, .stop = true, .stop_rank = 9};
        int rc = rank_group_step(g, &mine, &out, err, sizeof err);
        age = rank_group_loads(g, loads);
        if (rc != 0 || out.runtime_max != mine.n_tokens || out.stop != (mine.stop != 0) ||
            out.stop_rank != (mine.stop ? 0 : -1) || memcmp(&loads[0], &mine, sizeof mine) ||
            age < 0 || age > 5) {
            if (bad++ < 4)
                fprintf(stderr,
                        "group of one step %d: rc %d '%s', runtime_max %d (tokens %lld), stop %d "
                        "rank %d (asked %lld), age %g\n",
                        step, rc, err, out.runtime_max, (long long)mine.n_tokens, (int)out.stop,
                        out.stop_rank, (long long)mine.stop, age);
        }
        CHECK(rank_group_pick(g, step) == 0, "group of one: pick gave another rank");
    }
    CHECK(bad == 0, "group of one: %d of 50 steps wrong", bad);

    test_urls(g);
    CHECK(rank_group_check_peers(g, err, sizeof err) == 0 &&
              rank_group_check_peers_cb(g, err, sizeof err) == 0,
          "check_peers alone: '%s'", err);
    rank_group_abandon(g);

    /* A timeout given is kept; a second group of one (no MPI to start twice). */
    g = rank_group_init(NULL, NULL, false, 1.5, err, sizeof err);
    CHECK(g && rank_group_timeout(g) == 1.5, "timeout 1.5: %s", g ? "other value" : err);
    if (g) rank_group_finalize(g);
    MPI_Initialized(&initialized);
    CHECK(!initialized, "MPI started by the finalize of a group of one");
}

/* force_mpi without mpirun: MPI's singleton, a group of one over a real communicator. Last: MPI
 * cannot start again after its finalize. */
static void test_forced_singleton(int *argc, char ***argv) {
    char err[512] = "";
    rank_group *g = rank_group_init(argc, argv, true, 5, err, sizeof err);
    CHECK(g != NULL, "forced MPI: %s", err);
    if (!g) return;
    int initialized = 0, size = 0;
    MPI_Initialized(&initialized);
    CHECK(initialized && rank_group_comm(g) != MPI_COMM_NULL, "forced MPI: no communicator");
    if (rank_group_comm(g) != MPI_COMM_NULL) MPI_Comm_size(rank_group_comm(g), &size);
    CHECK(size == 1 && rank_group_size(g) == 1 && rank_group_rank(g) == 0 &&
              rank_group_local_size(g) == 1,
          "forced MPI: size %d / %d", size, rank_group_size(g));
    CHECK(rank_group_pid(g, 0) == (int)getpid(), "forced MPI: pid %d", rank_group_pid(g, 0));
    rank_report mine;
    report_of(&mine, 3, 0);
    mine.stop = 1;
    rank_step out;
    int rc = rank_group_step(g, &mine, &out, err, sizeof err);
    CHECK(rc == 0 && out.runtime_max == mine.n_tokens && out.stop && out.stop_rank == 0,
          "forced MPI step: rc %d '%s' runtime_max %d stop %d/%d", rc, err, out.runtime_max,
          (int)out.stop, out.stop_rank);
    rank_group_share_endpoints(g, "0.0.0.0", 9999, err, sizeof err);
    CHECK(!strcmp(rank_group_url(g, 0), "http://127.0.0.1:9999"), "forced MPI url '%s'",
          rank_group_url(g, 0));
    rank_group_finalize(g);
    int finalized = 0;
    MPI_Finalized(&finalized);
    CHECK(finalized, "rank_group_finalize left MPI running");
}

/* ---- under mpirun ---- */

typedef struct {
    rank_group *g;
    atomic_int stop;
    atomic_long checked; /* snapshots taken after a step */
    long bad;
} load_reader;

/* Another thread (as the HTTP threads do): every snapshot of the load table holds the reports of
 * one step, every rank's exactly. Also picks, which must name a rank of the group. */
static void *load_reader_main(void *arg) {
    load_reader *lr = arg;
    rank_report *snap = calloc((size_t)g_size, sizeof *snap), want;
    while (!atomic_load(&lr->stop)) {
        double age = rank_group_loads(lr->g, snap);
        int p = rank_group_pick(lr->g, 1);
        if (p < 0 || p >= g_size) lr->bad++;
        if (age >= 1e8) continue; /* before the first step */
        const int step = (int)snap[0].n_requests_done;
        for (int r = 0; r < g_size; r++) {
            report_of(&want, step, r);
            if (memcmp(&snap[r], &want, sizeof want) != 0) {
                if (lr->bad++ < 3)
                    fprintf(stderr,
                            "rank %d reader: snapshot of step %d: rank %d's report is "
                            "from step %lld or differs\n",
                            g_rank, step, r, (long long)snap[r].n_requests_done);
            }
        }
        atomic_fetch_add(&lr->checked, 1);
    }
    free(snap);
    return NULL;
}

static int step_or_fail(rank_group *g, const rank_report *mine, rank_step *out, const char *what) {
    char err[512] = "";
    int rc = rank_group_step(g, mine, out, err, sizeof err);
    CHECK(rc == 0, "rank %d %s: %s", g_rank, what, err);
    return rc;
}

/* 200 steps of different reports per rank. Returns -1 when a step failed (the group is then
 * unusable). */
static int test_random_steps(rank_group *g) {
    load_reader lr = {.g = g, .bad = 0};
    atomic_init(&lr.stop, 0);
    atomic_init(&lr.checked, 0);
    pthread_t th;
    pthread_create(&th, NULL, load_reader_main, &lr);
    int bad_decision = 0, bad_table = 0, zero_steps = 0, failed = 0;
    rank_report *table = calloc((size_t)g_size, sizeof *table), want;
    for (int step = 0; step < 200; step++) {
        rank_report mine;
        report_of(&mine, step, g_rank);
        int64_t max = 0;
        for (int r = 0; r < g_size; r++) {
            report_of(&want, step, r);
            if (want.n_tokens > max) max = want.n_tokens;
        }
        zero_steps += max == 0;
        rank_step out = {.runtime_max = -1, .stop = true, .stop_rank = 7};
        if (step_or_fail(g, &mine, &out, "random step") != 0) {
            failed = 1;
            break;
        }
        if (out.runtime_max != max || out.stop || out.stop_rank != -1) {
            if (bad_decision++ < 4)
                fprintf(stderr, "rank %d step %d: runtime_max %d want %lld, stop %d rank %d\n",
                        g_rank, step, out.runtime_max, (long long)max, (int)out.stop,
                        out.stop_rank);
        }
        double age = rank_group_loads(g, table);
        for (int r = 0; r < g_size; r++) {
            report_of(&want, step, r);
            if (memcmp(&table[r], &want, sizeof want) != 0 || age < 0 || age > 5) {
                if (bad_table++ < 4)
                    fprintf(stderr,
                            "rank %d step %d: rank %d's report differs (tokens %lld want "
                            "%lld, step %lld), age %g\n",
                            g_rank, step, r, (long long)table[r].n_tokens, (long long)want.n_tokens,
                            (long long)table[r].n_requests_done, age);
            }
        }
    }
    /* The steps of one rank can all be over before the thread runs: let it see the last one. */
    for (double t0 = now_s(); atomic_load(&lr.checked) == 0 && now_s() - t0 < 5;)
        sched_yield();
    atomic_store(&lr.stop, 1);
    pthread_join(th, NULL);
    free(table);
    CHECK(bad_decision == 0, "rank %d: %d of 200 steps decided wrongly", g_rank, bad_decision);
    CHECK(bad_table == 0, "rank %d: %d reports arrived damaged or late", g_rank, bad_table);
    CHECK(zero_steps >= 20, "rank %d: only %d all-zero steps", g_rank, zero_steps);
    CHECK(lr.bad == 0 && atomic_load(&lr.checked) > 0,
          "rank %d: the reader saw %ld mixed snapshots of %ld", g_rank, lr.bad,
          atomic_load(&lr.checked));
    if (g_rank == 0)
        printf("random steps: %d all-zero of 200, the reader checked %ld snapshots\n", zero_steps,
               atomic_load(&lr.checked));
    return failed ? -1 : 0;
}

/* Stop asked by one rank, then by it and every higher rank: every rank sees it, stop_rank the
 * lowest; the decision does not stick to later steps. */
static int test_stop(rank_group *g) {
    for (int s = 0; s < g_size; s++) {
        for (int variant = 0; variant < 3; variant++) {
            rank_report mine;
            report_of(&mine, 1000 + s, g_rank);
            mine.stop = variant == 0 ? g_rank == s : variant == 1 ? g_rank >= s : 0;
            rank_step out;
            if (step_or_fail(g, &mine, &out, "stop step") != 0) return -1;
            const bool want_stop = variant < 2;
            CHECK(out.stop == want_stop && out.stop_rank == (want_stop ? s : -1),
                  "rank %d: stop from rank %d (variant %d): stop %d, stop_rank %d", g_rank, s,
                  variant, (int)out.stop, out.stop_rank);
        }
    }
    return 0;
}

/* Ranks' loads for the pick: `target` reports 3 (2 running + 1 waiting), every other rank 4. */
static void pick_report(rank_report *r, int target, int rank, int load_all) {
    memset(r, 0, sizeof *r);
    r->n_tokens = rank + 1;
    if (load_all >= 0) {
        r->n_running = load_all / 2;
        r->n_waiting = load_all - load_all / 2;
    } else if (rank == target) {
        r->n_running = 2;
        r->n_waiting = 1;
    } else {
        r->n_running = 1;
        r->n_waiting = 3;
    }
}

static int test_pick(rank_group *g) {
    for (int target = 0; target < g_size; target++) {
        rank_report mine;
        pick_report(&mine, target, g_rank, -1);
        rank_step out;
        if (step_or_fail(g, &mine, &out, "pick step") != 0) return -1;
        const int64_t my_load = mine.n_running + mine.n_waiting;
        /* The least loaded first; then, every rank even, the picks made since the reports spread
         * the next g_size picks over every rank: this one first (ties), then the others in rank
         * order; then this one again. */
        int *got = calloc((size_t)g_size + 3, sizeof *got);
        int *want = calloc((size_t)g_size + 3, sizeof *want), n = 0;
        want[n++] = target;
        want[n++] = g_rank;
        for (int r = 0; r < g_size; r++)
            if (r != g_rank) want[n++] = r;
        want[n++] = g_rank;
        int bad = 0;
        for (int i = 0; i < n; i++) {
            got[i] = rank_group_pick(g, my_load);
            bad += got[i] != want[i];
        }
        if (bad) {
            fprintf(stderr, "rank %d target %d picks:", g_rank, target);
            for (int i = 0; i < n; i++)
                fprintf(stderr, " %d(want %d)", got[i], want[i]);
            fprintf(stderr, "\n");
        }
        CHECK(bad == 0, "rank %d: picks with rank %d least loaded: %d of %d differ", g_rank, target,
              bad, n);
        free(got);
        free(want);
    }
    /* A new step forgets the picks; the caller's own load is live: below the others' -> here,
     * equal -> here (ties), above -> the lowest other rank. */
    rank_report mine;
    pick_report(&mine, -1, g_rank, 5);
    rank_step out;
    if (step_or_fail(g, &mine, &out, "pick step, equal loads") != 0) return -1;
    int here = rank_group_pick(g, 5);
    CHECK(here == g_rank,
          "rank %d: equal loads after a new step: pick %d (the picks before the "
          "step still counted?)",
          g_rank, here);
    int low = rank_group_pick(g, 0);
    CHECK(low == g_rank, "rank %d: own live load 0: pick %d", g_rank, low);
    int high = rank_group_pick(g, 1000);
    int want_high = g_size == 1 ? 0 : g_rank == 0 ? 1 : 0;
    CHECK(high == want_high, "rank %d: own live load 1000: pick %d, want %d", g_rank, high,
          want_high);
    return 0;
}

/* One step every rank makes, with reports of `step`. */
static int good_steps(rank_group *g, int from, int n) {
    for (int step = from; step < from + n; step++) {
        rank_report mine, want;
        report_of(&mine, step, g_rank);
        int64_t max = 0;
        for (int r = 0; r < g_size; r++) {
            report_of(&want, step, r);
            if (want.n_tokens > max) max = want.n_tokens;
        }
        rank_step out;
        if (step_or_fail(g, &mine, &out, "step") != 0) return -1;
        CHECK(out.runtime_max == max, "rank %d step %d: runtime_max %d want %lld", g_rank, step,
              out.runtime_max, (long long)max);
    }
    return 0;
}

static void test_identity(rank_group *g) {
    char host[256] = "";
    gethostname(host, sizeof host - 1);
    MPI_Comm comm = rank_group_comm(g);
    CHECK(comm != MPI_COMM_NULL, "rank %d: no communicator under mpirun", g_rank);
    if (comm == MPI_COMM_NULL) return;
    int cmp = 0, size = 0;
    MPI_Comm_compare(comm, MPI_COMM_WORLD, &cmp);
    MPI_Comm_size(comm, &size);
    CHECK(cmp == MPI_CONGRUENT && size == g_size,
          "rank %d: the group's communicator is not a private copy of the world (%d, size %d)",
          g_rank, cmp, size);
    /* One node: the local ranks are the ranks. */
    CHECK(rank_group_local_rank(g) == g_rank && rank_group_local_size(g) == g_size &&
              rank_group_same_node(g),
          "rank %d: local rank %d of %d", g_rank, rank_group_local_rank(g),
          rank_group_local_size(g));
    CHECK(rank_group_timeout(g) == 20.0, "rank %d: timeout %g", g_rank, rank_group_timeout(g));
    int *pids = calloc((size_t)g_size, sizeof *pids), mine = (int)getpid(), bad = 0;
    MPI_Allgather(&mine, 1, MPI_INT, pids, 1, MPI_INT, MPI_COMM_WORLD);
    for (int r = 0; r < g_size; r++) {
        bad += rank_group_pid(g, r) != pids[r] || pids[r] <= 0;
        bad += strcmp(rank_group_hostname(g, r), host) != 0;
    }
    CHECK(bad == 0, "rank %d: %d pids or hostnames differ", g_rank, bad);
    CHECK(rank_group_pid(g, g_size) == 0 && !strcmp(rank_group_hostname(g, -1), ""),
          "rank %d: pid or hostname outside the group", g_rank);
    free(pids);
    rank_report *loads = calloc((size_t)g_size, sizeof *loads);
    double age = rank_group_loads(g, loads);
    CHECK(age >= 1e8, "rank %d: the load table before any step is %g s old", g_rank, age);
    free(loads);
}

/* Rank 0 prints every rank's counts summed, over comm (which must still work). */
static int summary(MPI_Comm comm) {
    int mine[2] = {check_passed, check_failed}, sum[2] = {0, 0}, me = 0;
    MPI_Allreduce(mine, sum, 2, MPI_INT, MPI_SUM, comm);
    MPI_Comm_rank(comm, &me);
    if (me == 0) printf("%d passed, %d failed\n", sum[0], sum[1]);
    fflush(stdout);
    return sum[1] ? 1 : 0;
}

static int run_group(int *argc, char ***argv) {
    char err[512] = "";
    test_bad_timeouts(); /* refused before MPI starts */
    rank_group *g = rank_group_init(argc, argv, false, 20, err, sizeof err);
    if (!g) {
        fprintf(stderr, "FAIL rank_group_init under mpirun: %s\n0 passed, 1 failed\n", err);
        return 1;
    }
    g_rank = rank_group_rank(g);
    g_size = rank_group_size(g);
    const char *env_size = getenv("OMPI_COMM_WORLD_SIZE"),
               *env_rank = getenv("OMPI_COMM_WORLD_RANK");
    CHECK(env_size && atoi(env_size) == g_size && env_rank && atoi(env_rank) == g_rank,
          "rank %d of %d, mpirun says %s of %s", g_rank, g_size, env_rank ? env_rank : "?",
          env_size ? env_size : "?");
    if (g_rank == 0) test_parallel_flags();
    test_identity(g);
    int failed = test_random_steps(g) != 0;
    if (!failed) failed = test_stop(g) != 0;
    if (!failed) failed = test_pick(g) != 0;
    if (!failed) test_urls(g);
    CHECK(rank_group_check_peers(g, err, sizeof err) == 0 &&
              rank_group_check_peers_cb(g, err, sizeof err) == 0,
          "rank %d: check_peers with every rank alive: '%s'", g_rank, err);
    if (failed) { /* a broken group: no collective call on it again */
        printf("%d passed, %d failed\n", check_passed, check_failed);
        fflush(stdout);
        _exit(1);
    }
    int rc = summary(rank_group_comm(g));
    rank_group_finalize(g);
    return rc;
}

/* The highest rank sleeps through step 3; the others fail it after the 1 s timeout naming it.
 * It is alive all along (check_peers says so), and joins the sum over MPI_COMM_WORLD after. It
 * never sends its report of step 3: the others' receives stay posted into the group's buffers,
 * which rank_group_abandon frees, so a report arriving later would land in freed memory. */
static int run_timeout(int *argc, char ***argv) {
    char err[512] = "";
    rank_group *g = rank_group_init(argc, argv, false, 1.0, err, sizeof err);
    if (!g) {
        fprintf(stderr, "FAIL rank_group_init under mpirun: %s\n0 passed, 1 failed\n", err);
        return 1;
    }
    g_rank = rank_group_rank(g);
    g_size = rank_group_size(g);
    const int last = g_size - 1;
    int ok = good_steps(g, 0, 3) == 0;
    if (ok && g_size > 1) {
        if (g_rank == last) {
            struct timespec ts = {2, 500000000};
            nanosleep(&ts, NULL);
        } else {
            rank_report mine;
            report_of(&mine, 3, g_rank);
            rank_step out;
            double t0 = now_s();
            int rc = rank_group_step(g, &mine, &out, err, sizeof err);
            double dt = now_s() - t0;
            char want[64];
            snprintf(want, sizeof want, "rank %d did not answer", last);
            CHECK(rc == -1 && strstr(err, want) && strstr(err, "step 3") &&
                      strstr(err, "--dist-timeout"),
                  "rank %d: step with rank %d asleep: rc %d '%s', want '%s'", g_rank, last, rc, err,
                  want);
            CHECK(dt >= 1.0 && dt < 2.0, "rank %d: failed after %.3f s, want 1 to 2", g_rank, dt);
            CHECK(rank_group_check_peers(g, err, sizeof err) == 0,
                  "rank %d: check_peers names a rank that sleeps: '%s'", g_rank, err);
            if (g_rank == 0) printf("timeout: rank 0 failed the step after %.3f s: %s\n", dt, err);
        }
    }
    rank_group_abandon(g);
    int rc = summary(MPI_COMM_WORLD);
    MPI_Finalize();
    return rc;
}

/* The highest rank exits during step 3 (mpirun told to let it); the others fail that step within a
 * fraction of a second naming it and its pid, and sum their counts among themselves. No
 * MPI_Finalize: its synchronization would wait for the rank that has gone. */
static int run_gone(int *argc, char ***argv) {
    char err[512] = "";
    rank_group *g = rank_group_init(argc, argv, false, 20, err, sizeof err);
    if (!g) {
        fprintf(stderr, "FAIL rank_group_init under mpirun: %s\n0 passed, 1 failed\n", err);
        return 1;
    }
    g_rank = rank_group_rank(g);
    g_size = rank_group_size(g);
    const int last = g_size - 1;
    if (good_steps(g, 0, 3) != 0 || g_size < 2) {
        printf("%d passed, %d failed\n", check_passed, check_failed + (g_size < 2));
        fflush(stdout);
        _exit(1);
    }
    const int last_pid = rank_group_pid(g, last);
    if (g_rank == last) {
        fflush(stdout);
        fflush(stderr);
        _exit(check_failed ? 1 : 0);
    }
    rank_report mine;
    report_of(&mine, 3, g_rank);
    rank_step out;
    double t0 = now_s();
    int rc = rank_group_step(g, &mine, &out, err, sizeof err);
    double dt = now_s() - t0;
    char want[96];
    snprintf(want, sizeof want, "rank %d (pid %d on ", last, last_pid);
    CHECK(rc == -1 && strstr(err, want) && strstr(err, "has exited"),
          "rank %d: step with rank %d gone: rc %d '%s', want '%s'", g_rank, last, rc, err, want);
    CHECK(dt < 1.0, "rank %d: noticed after %.3f s (timeout 20)", g_rank, dt);
    err[0] = 0;
    rc = rank_group_check_peers(g, err, sizeof err);
    CHECK(rc == -1 && strstr(err, want), "rank %d: check_peers: rc %d '%s'", g_rank, rc, err);
    if (g_rank == 0) printf("gone: rank 0 failed the step after %.3f s: %s\n", dt, err);
    rank_group_abandon(g);

    /* The survivors alone: a communicator made only by them. */
    MPI_Group world, alive;
    MPI_Comm_group(MPI_COMM_WORLD, &world);
    int range[1][3] = {{0, last - 1, 1}};
    MPI_Group_range_incl(world, 1, range, &alive);
    MPI_Comm survivors;
    MPI_Comm_create_group(MPI_COMM_WORLD, alive, 0x60e, &survivors);
    rc = summary(survivors);
    fflush(stderr);
    _exit(rc);
}

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "";
    if (getenv("OMPI_COMM_WORLD_SIZE")) {
        if (!strcmp(mode, "timeout")) return run_timeout(&argc, &argv);
        if (!strcmp(mode, "gone")) return run_gone(&argc, &argv);
        if (*mode) {
            fprintf(stderr, "usage: mpirun -np N test_rank_group [timeout|gone]\n");
            return 2;
        }
        return run_group(&argc, &argv);
    }
    g_rank = 0;
    g_size = 1;
    test_parallel_flags();
    test_bad_timeouts();
    test_group_of_one();
    test_forced_singleton(&argc, &argv);
    CHECK_SUMMARY();
}
