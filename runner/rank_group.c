/* The rank group (see rank_group.h).
 *
 * Choices:
 * - The step agreement is one small message from every rank to every other (MPI_Isend/Irecv on a
 *   private duplicate of the world), not an MPI_Allgather: a rank waiting on separate receives
 *   knows which peers have answered, so a timeout names the ones that have not. Messages of one
 *   (source, tag, communicator) arrive in order, so steps cannot mix.
 * - Waits test their requests, spin a little, then yield, then sleep up to 1 ms between tests
 *   (ranks may share cores), and ask rank_group_check_peers every 100 ms: a peer on this node that
 *   has died is named at once instead of at the timeout.
 * - The load table is the last step's reports, under a mutex for the HTTP threads. */
#include "runner/rank_group.h"

#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"

#define RG_DEFAULT_TIMEOUT_S 60.0
#define RG_TAG_STEP          0x5354 /* "ST" */
#define RG_TAG_SHARE         0x5348 /* "SH" */
#define RG_HOST_LEN          256
#define RG_CHECK_INTERVAL_S  0.1

typedef struct {
    char host[RG_HOST_LEN]; /* the address it listens on */
    int32_t port;
} rg_endpoint;

struct rank_group {
    bool mpi; /* MPI was started here */
    MPI_Comm comm;
    int rank, size, local_rank, local_size;
    double timeout_s;
    int32_t *pids;                 /* [size] */
    char (*hostnames)[RG_HOST_LEN]; /* [size] */
    bool *same_host;               /* [size] */
    char (*urls)[RG_HOST_LEN + 32]; /* [size] */

    /* step agreement (engine thread) */
    int64_t *recv;     /* [size * RANK_REPORT_FIELDS] */
    int64_t *send;     /* [RANK_REPORT_FIELDS] */
    MPI_Request *reqs; /* [2 * size] receives, then sends */
    uint64_t n_steps;

    /* load table (any thread, under mu) */
    pthread_mutex_t mu;
    rank_report *loads; /* [size] */
    double loads_at;    /* monotonic seconds; 0 = never */
    int64_t *recent;    /* [size] picks since the last reports */
};

static double rg_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static bool launched_by_mpi(void) {
    static const char *const vars[] = {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK",
                                       "PMI_SIZE", "MPI_LOCALRANKID"};
    for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++)
        if (getenv(vars[i])) return true;
    return false;
}

static rank_group *rg_alloc(int size) {
    rank_group *g = xcalloc(1, sizeof *g);
    g->size = size;
    g->comm = MPI_COMM_NULL;
    g->pids = xcalloc((size_t)size, sizeof *g->pids);
    g->hostnames = xcalloc((size_t)size, sizeof *g->hostnames);
    g->same_host = xcalloc((size_t)size, sizeof *g->same_host);
    g->urls = xcalloc((size_t)size, sizeof *g->urls);
    g->recv = xcalloc((size_t)size * RANK_REPORT_FIELDS, sizeof(int64_t));
    g->send = xcalloc(RANK_REPORT_FIELDS, sizeof(int64_t));
    g->reqs = xcalloc(2 * (size_t)size, sizeof(MPI_Request));
    g->loads = xcalloc((size_t)size, sizeof(rank_report));
    g->recent = xcalloc((size_t)size, sizeof(int64_t));
    pthread_mutex_init(&g->mu, NULL);
    return g;
}

static void rg_free(rank_group *g) {
    if (!g) return;
    pthread_mutex_destroy(&g->mu);
    free(g->pids);
    free(g->hostnames);
    free(g->same_host);
    free(g->urls);
    free(g->recv);
    free(g->send);
    free(g->reqs);
    free(g->loads);
    free(g->recent);
    free(g);
}

rank_group *rank_group_init(int *argc, char ***argv, bool force_mpi, double timeout_s, char *err,
                            size_t errlen) {
    if (!(timeout_s >= 0) || timeout_s > 1e6) {
        set_err(err, errlen, "--dist-timeout %g: outside [0, 1e6] seconds", timeout_s);
        return NULL;
    }
    if (timeout_s == 0) timeout_s = RG_DEFAULT_TIMEOUT_S;
    char host[RG_HOST_LEN] = "";
    if (gethostname(host, sizeof host - 1) != 0) snprintf(host, sizeof host, "localhost");

    if (!force_mpi && !launched_by_mpi()) {
        rank_group *g = rg_alloc(1);
        g->local_size = 1;
        g->timeout_s = timeout_s;
        g->pids[0] = (int32_t)getpid();
        snprintf(g->hostnames[0], RG_HOST_LEN, "%s", host);
        g->same_host[0] = true;
        return g;
    }

    int provided = 0;
    if (MPI_Init_thread(argc, argv, MPI_THREAD_SERIALIZED, &provided) != MPI_SUCCESS) {
        set_err(err, errlen, "rank group: MPI_Init_thread failed");
        return NULL;
    }
    if (provided < MPI_THREAD_SERIALIZED) {
        set_err(err, errlen,
                "rank group: this MPI library gives thread level %d, below MPI_THREAD_SERIALIZED "
                "(the engine thread calls MPI, not the main thread)",
                provided);
        MPI_Finalize();
        return NULL;
    }
    int size = 1, rank = 0;
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    rank_group *g = rg_alloc(size);
    g->mpi = true;
    g->rank = rank;
    g->timeout_s = timeout_s;
    MPI_Comm_dup(MPI_COMM_WORLD, &g->comm);
    MPI_Comm_set_errhandler(g->comm, MPI_ERRORS_RETURN);

    MPI_Comm node;
    MPI_Comm_split_type(g->comm, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node);
    MPI_Comm_rank(node, &g->local_rank);
    MPI_Comm_size(node, &g->local_size);
    MPI_Comm_free(&node);

    int32_t pid = (int32_t)getpid();
    MPI_Allgather(&pid, 1, MPI_INT32_T, g->pids, 1, MPI_INT32_T, g->comm);
    MPI_Allgather(host, RG_HOST_LEN, MPI_CHAR, g->hostnames, RG_HOST_LEN, MPI_CHAR, g->comm);
    for (int r = 0; r < size; r++) {
        g->hostnames[r][RG_HOST_LEN - 1] = '\0';
        g->same_host[r] = strcmp(g->hostnames[r], host) == 0;
    }
    return g;
}

int rank_group_rank(const rank_group *g) { return g->rank; }
int rank_group_size(const rank_group *g) { return g->size; }
int rank_group_local_rank(const rank_group *g) { return g->local_rank; }
int rank_group_local_size(const rank_group *g) { return g->local_size; }
bool rank_group_same_node(const rank_group *g) { return g->local_size == g->size; }
double rank_group_timeout(const rank_group *g) { return g->timeout_s; }
MPI_Comm rank_group_comm(const rank_group *g) { return g->mpi ? g->comm : MPI_COMM_NULL; }
int rank_group_pid(const rank_group *g, int r) { return r >= 0 && r < g->size ? g->pids[r] : 0; }

const char *rank_group_hostname(const rank_group *g, int r) {
    return r >= 0 && r < g->size ? g->hostnames[r] : "";
}

const char *rank_group_url(const rank_group *g, int r) {
    return r >= 0 && r < g->size ? g->urls[r] : "";
}

/* ---- endpoints ---- */

static bool host_is_wildcard(const char *h) {
    return !*h || !strcmp(h, "0.0.0.0") || !strcmp(h, "::") || !strcmp(h, "[::]");
}

static bool host_is_loopback(const char *h) {
    return !strcmp(h, "localhost") || !strncmp(h, "127.", 4) || !strcmp(h, "::1") ||
           !strcmp(h, "[::1]");
}

/* How this rank reaches a peer listening on host on node hostname. */
static void endpoint_url(char *out, size_t len, const rg_endpoint *ep, bool same_node,
                         const char *hostname) {
    const char *h = ep->host;
    char buf[RG_HOST_LEN + 2];
    if (same_node && host_is_wildcard(h)) {
        h = strchr(h, ':') ? "[::1]" : "127.0.0.1";
    } else if (host_is_wildcard(h) || (!same_node && host_is_loopback(h))) {
        h = hostname; /* a loopback listener elsewhere cannot be reached; the relay says so */
    } else if (strchr(h, ':') && h[0] != '[') {
        snprintf(buf, sizeof buf, "[%s]", h);
        h = buf;
    }
    snprintf(out, len, "http://%s:%d", h, (int)ep->port);
}

int rank_group_share_endpoints(rank_group *g, const char *host, int port, char *err,
                               size_t errlen) {
    rg_endpoint mine = {.port = port};
    snprintf(mine.host, sizeof mine.host, "%s", host ? host : "");
    rg_endpoint *all = xcalloc((size_t)g->size, sizeof *all);
    if (g->mpi) {
        if (MPI_Allgather(&mine, (int)sizeof mine, MPI_BYTE, all, (int)sizeof mine, MPI_BYTE,
                          g->comm) != MPI_SUCCESS) {
            free(all);
            return set_err(err, errlen, "rank group: MPI_Allgather of the HTTP endpoints failed");
        }
    } else {
        all[0] = mine;
    }
    for (int r = 0; r < g->size; r++) {
        all[r].host[RG_HOST_LEN - 1] = '\0';
        endpoint_url(g->urls[r], sizeof g->urls[r], &all[r], g->same_host[r], g->hostnames[r]);
        if (!g->same_host[r] && host_is_loopback(all[r].host))
            LOG_WARN("rank group",
                     "rank %d on %s listens on %s, which rank %d on another node cannot reach: "
                     "serve with --host 0.0.0.0 to relay requests between nodes",
                     r, g->hostnames[r], all[r].host, g->rank);
    }
    free(all);
    return 0;
}

/* ---- liveness ---- */

/* 1 when pid is gone or a zombie, 0 when it runs. */
static int pid_gone(int32_t pid) {
    if (pid <= 0) return 0;
    if (kill((pid_t)pid, 0) != 0) return errno == ESRCH;
    char path[64], buf[256];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = '\0';
    const char *paren = strrchr(buf, ')'); /* "pid (comm) S ..." */
    return paren && paren[1] == ' ' && (paren[2] == 'Z' || paren[2] == 'X');
}

/* Every peer found gone is named: when one rank dies, the ranks that notice it leave too, so a
 * rank that looks later may find several gone and cannot tell which went first. */
int rank_group_check_peers(rank_group *g, char *msg, size_t len) {
    int gone[8], n_gone = 0, n_more = 0;
    for (int r = 0; r < g->size; r++) {
        if (r == g->rank || !g->same_host[r] || !pid_gone(g->pids[r])) continue;
        if (n_gone < 8)
            gone[n_gone++] = r;
        else
            n_more++;
    }
    if (n_gone == 0) return 0;
    size_t used = 0;
    for (int i = 0; i < n_gone && used < len; i++) {
        int r = gone[i];
        const char *sep = i == 0 ? "" : (i == n_gone - 1 && !n_more ? " and " : ", ");
        used += (size_t)snprintf(msg + used, len - used, "%srank %d (pid %d on %s)", sep, r,
                                 (int)g->pids[r], g->hostnames[r]);
    }
    if (n_more && used < len) used += (size_t)snprintf(msg + used, len - used, " and %d more", n_more);
    if (used < len)
        snprintf(msg + used, len - used, " %s exited", n_gone + n_more == 1 ? "has" : "have");
    return -1;
}

int rank_group_check_peers_cb(void *ctx, char *msg, size_t len) {
    return rank_group_check_peers(ctx, msg, len);
}

/* ---- the step agreement ---- */

static void report_pack(int64_t *v, const rank_report *r) { memcpy(v, r, sizeof *r); }
static void report_unpack(rank_report *r, const int64_t *v) { memcpy(r, v, sizeof *r); }

/* Pause between tests of a wait: spin, then yield, then sleep 1 us doubling to 1 ms. */
static void wait_pause(long polls) {
    enum { SPIN = 64, YIELD = 64 + 512 };
    if (polls <= SPIN) return;
    if (polls <= YIELD) {
        sched_yield();
        return;
    }
    long shift = polls - YIELD;
    struct timespec ts = {0, shift >= 10 ? 1000000 : 1000L << shift};
    nanosleep(&ts, NULL);
}

static void format_missing(char *buf, size_t len, const bool *arrived, int n, int me) {
    size_t used = 0;
    int shown = 0, missing = 0;
    for (int p = 0; p < n; p++)
        missing += p != me && !arrived[p];
    used += (size_t)snprintf(buf, len, "%s", missing == 1 ? "rank" : "ranks");
    for (int p = 0; p < n && used < len; p++) {
        if (p == me || arrived[p]) continue;
        if (shown == 8) {
            snprintf(buf + used, len - used, " and %d more", missing - shown);
            break;
        }
        used += (size_t)snprintf(buf + used, len - used, "%s %d", shown ? "," : "", p);
        shown++;
    }
}

/* Every rank's block of count elements of type (size bytes each) from send into recv + p * count *
 * size for each peer p, under tag; waits as the step agreement does (what names the exchange in a
 * timeout's message). */
static int exchange_blocks(rank_group *g, const void *send, void *recv, int count,
                           MPI_Datatype type, size_t size, int tag, const char *what, char *err,
                           size_t errlen) {
    const int n = g->size, me = g->rank;
    int n_req = 0;
    for (int p = 0; p < n; p++) {
        if (p == me) continue;
        if (MPI_Irecv((char *)recv + (size_t)p * (size_t)count * size, count, type, p, tag, g->comm,
                      &g->reqs[n_req++]) != MPI_SUCCESS)
            return set_err(err, errlen, "rank group: MPI_Irecv from rank %d failed", p);
    }
    for (int p = 0; p < n; p++) {
        if (p == me) continue;
        if (MPI_Isend(send, count, type, p, tag, g->comm, &g->reqs[n_req++]) != MPI_SUCCESS)
            return set_err(err, errlen, "rank group: MPI_Isend to rank %d failed", p);
    }
    bool *arrived = xcalloc((size_t)n, sizeof(bool));
    double start = rg_now(), next_check = start + RG_CHECK_INTERVAL_S;
    int rc = 0;
    for (long polls = 1;; polls++) {
        int done = 0;
        if (MPI_Testall(n_req, g->reqs, &done, MPI_STATUSES_IGNORE) != MPI_SUCCESS) {
            rc = set_err(err, errlen, "rank group rank %d: MPI_Testall failed in step %llu", me,
                         (unsigned long long)g->n_steps);
            break;
        }
        if (done) break;
        wait_pause(polls);
        if (polls < 64) continue;
        double now = rg_now();
        if (now < next_check) continue;
        next_check = now + RG_CHECK_INTERVAL_S;
        char why[256];
        if (rank_group_check_peers(g, why, sizeof why)) {
            rc = set_err(err, errlen, "rank group rank %d: %s; the group cannot go on", me, why);
            break;
        }
        if (now - start > g->timeout_s) {
            for (int i = 0, p = 0; p < n; p++) {
                if (p == me) continue;
                int flag = 0;
                MPI_Test(&g->reqs[i], &flag, MPI_STATUS_IGNORE);
                arrived[p] = flag || g->reqs[i] == MPI_REQUEST_NULL;
                i++;
            }
            char missing[160];
            format_missing(missing, sizeof missing, arrived, n, me);
            rc = set_err(err, errlen,
                         "rank group rank %d: %s %llu: %s did not answer within %.3g s "
                         "(--dist-timeout); the group cannot go on",
                         me, what, (unsigned long long)g->n_steps, missing, g->timeout_s);
            break;
        }
    }
    free(arrived);
    return rc;
}

static int exchange(rank_group *g, char *err, size_t errlen) {
    return exchange_blocks(g, g->send, g->recv, RANK_REPORT_FIELDS, MPI_INT64_T, sizeof(int64_t),
                           RG_TAG_STEP, "step", err, errlen);
}

int rank_group_share(rank_group *g, const void *mine, size_t len, void *all, char *err,
                     size_t errlen) {
    memcpy((char *)all + (size_t)g->rank * len, mine, len);
    if (g->size == 1) return 0;
    if (len > INT_MAX) return set_err(err, errlen, "rank group: a shared block of %zu bytes", len);
    return exchange_blocks(g, mine, all, (int)len, MPI_BYTE, 1, RG_TAG_SHARE, "exchange after step",
                           err, errlen);
}

int rank_group_step(rank_group *g, const rank_report *mine, rank_step *out, char *err,
                    size_t errlen) {
    const int F = RANK_REPORT_FIELDS;
    report_pack(g->send, mine);
    memcpy(g->recv + (size_t)g->rank * F, g->send, (size_t)F * sizeof(int64_t));
    if (g->size > 1 && exchange(g, err, errlen) != 0) return -1;
    g->n_steps++;

    out->runtime_max = 0;
    out->stop = false;
    out->stop_rank = -1;
    out->drain = false;
    out->drain_rank = -1;
    out->drained = true;
    out->update_rank = -1;
    out->update_abort = false;
    out->update_ready = true;
    pthread_mutex_lock(&g->mu);
    for (int r = 0; r < g->size; r++) {
        report_unpack(&g->loads[r], g->recv + (size_t)r * F);
        const rank_report *x = &g->loads[r];
        if (x->n_tokens > out->runtime_max) out->runtime_max = (int)x->n_tokens;
        if (x->stop && !out->stop) {
            out->stop = true;
            out->stop_rank = r;
        }
        if (x->drain && !out->drain) {
            out->drain = true;
            out->drain_rank = r;
        }
        if (x->drain != 2) out->drained = false;
        if (x->update && out->update_rank < 0) {
            out->update_rank = r;
            out->update_abort = x->update == 2;
        }
        if (!x->update_idle) out->update_ready = false;
        g->recent[r] = 0;
    }
    if (out->update_rank < 0) out->update_ready = false;
    g->loads_at = rg_now();
    pthread_mutex_unlock(&g->mu);
    return 0;
}

/* ---- load table ---- */

double rank_group_loads(rank_group *g, rank_report *out) {
    pthread_mutex_lock(&g->mu);
    memcpy(out, g->loads, (size_t)g->size * sizeof(rank_report));
    double age = g->loads_at > 0 ? rg_now() - g->loads_at : 1e9;
    pthread_mutex_unlock(&g->mu);
    return age;
}

int rank_group_pick(rank_group *g, int64_t local_load) {
    pthread_mutex_lock(&g->mu);
    int best = g->rank;
    int64_t best_load = local_load + g->recent[g->rank];
    for (int r = 0; r < g->size; r++) {
        if (r == g->rank) continue;
        int64_t l = g->loads[r].n_running + g->loads[r].n_waiting + g->recent[r];
        if (l < best_load) {
            best = r;
            best_load = l;
        }
    }
    g->recent[best]++;
    pthread_mutex_unlock(&g->mu);
    return best;
}

/* ---- the end ---- */

void rank_group_finalize(rank_group *g) {
    if (!g) return;
    if (g->mpi) {
        MPI_Comm_free(&g->comm);
        MPI_Finalize();
    }
    rg_free(g);
}

/* The failed step's receives may still be posted: a late report would land in g->recv, so the
 * buffers stay allocated (the process is about to exit), and stay reachable from here, so that
 * they are kept on purpose rather than lost (a process has one MPI group). A group of one has no
 * MPI and nothing posted: it is freed. */
static rank_group *volatile rg_abandoned; /* volatile: written only, and must stay written */

void rank_group_abandon(rank_group *g) {
    if (g && !g->mpi)
        rg_free(g);
    else if (g)
        rg_abandoned = g;
}

/* ---- SGLang's flags ---- */

int rank_group_check_parallel_flags(int world, int tp, int dp, int ep, bool enable_dp_attention,
                                    char *err, size_t errlen) {
    if (tp && tp != world)
        return set_err(err, errlen,
                       "--tp %d: the group has %d rank%s (mpirun -np %d); every rank runs attention "
                       "for its own requests and holds a share of the experts, so --tp must equal "
                       "the number of ranks or be left out",
                       tp, world, world == 1 ? "" : "s", world);
    if (ep && ep != world)
        return set_err(err, errlen,
                       "--ep %d: the group has %d rank%s (mpirun -np %d); the experts are split "
                       "over every rank, so --ep must equal the number of ranks or be left out",
                       ep, world, world == 1 ? "" : "s", world);
    if (dp && dp != 1 && !enable_dp_attention)
        return set_err(err, errlen,
                       "--dp %d without --enable-dp-attention asks for %d separate replicas; here "
                       "the ranks form one group with data-parallel attention: add "
                       "--enable-dp-attention (and --dp %d) or leave --dp out",
                       dp, dp, world);
    if (dp && enable_dp_attention && dp != world)
        return set_err(err, errlen,
                       "--dp %d: with --enable-dp-attention every rank is its own attention "
                       "replica, so --dp must equal the number of ranks (%d)",
                       dp, world);
    return 0;
}
