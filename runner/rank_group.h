/* The rank group: the processes of one `mpirun -np N moeserve serve`, one per GPU (or per share of
 * the CPU cores), every one of them serving HTTP and running attention for its own requests,
 * all of them together running the experts.
 *
 * Start-up: rank_group_init starts MPI when the process was launched by mpirun (or srun with
 * PMIx), else it makes a group of one without MPI. MPI_THREAD_SERIALIZED: after start-up only the
 * engine thread calls MPI while it runs; the main thread calls it again only after joining it.
 *
 * The step agreement: before each forward pass every rank reports how many tokens it will
 * forward, its load and whether it wants to stop; rank_group_step gives every rank every report,
 * hence the same runtime_max (the largest token count) and the same decision: all zero = idle,
 * no forward; any stop = every rank stops after this exchange. A drain (a graceful shutdown) is
 * agreed the same way: once one rank drains every rank drains, and the group stops only when
 * every rank says it has nothing left, so that no rank stops while another still runs requests. A rank with no tokens of its own
 * still runs every layer with zero tokens and joins every all-to-all.
 *
 * Failure: every wait of the group (the agreement here, the all-to-all in kernels/a2a) times out
 * with a message, and, for peers on the same node, notices within a fraction of a second that a
 * peer's process has gone (rank_group_check_peers), naming it. After a failure nothing collective
 * is called again: the process reports, answers its requests with the error, and exits.
 *
 * The reports double as the load table: any thread may read the latest one (rank_group_loads)
 * or ask for the least-loaded rank for a new request (rank_group_pick). */
#ifndef MOESERVE_RANK_GROUP_H
#define MOESERVE_RANK_GROUP_H

#include <mpi.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct rank_group rank_group;

/* What a rank says about itself at each step. */
typedef struct {
    int64_t n_tokens;  /* tokens it forwards in this step (0 = none) */
    int64_t stop;      /* 1: it is stopping, the group stops after this exchange */
    int64_t n_running; /* requests in its running batch */
    int64_t n_waiting; /* requests queued */
    int64_t kv_pages_used;
    int64_t kv_pages_total;
    int64_t n_requests_done;
    int64_t n_generated_tokens;
    int64_t gen_throughput_milli; /* output tokens/s x 1000 over the last seconds */
    int64_t drain; /* 0: serving; 1: draining (finishing its requests, taking no new ones);
                      2: drained (draining, nothing left to run) */
    int64_t update;      /* a /update_weights_from_disk waits here: 1, or 2 with
                            abort_all_requests; 0: none */
    int64_t update_idle; /* 1: paused for the group's update with nothing running */
} rank_report;

#define RANK_REPORT_FIELDS ((int)(sizeof(rank_report) / sizeof(int64_t)))

/* The group's decision for one step, identical on every rank. */
typedef struct {
    int runtime_max; /* the largest n_tokens of any rank: 0 = idle */
    bool stop;       /* some rank is stopping */
    int stop_rank;   /* the lowest rank that asked to stop (-1 if none) */
    bool drain;      /* some rank is draining: every rank drains */
    int drain_rank;  /* the lowest rank that is draining (-1 if none) */
    bool drained;    /* every rank is drained: the group stops after this exchange */
    int update_rank; /* the lowest rank with an update waiting (-1 if none): every rank pauses
                        admission (and with update_abort aborts its requests) */
    bool update_abort; /* that rank's update aborts the running requests */
    bool update_ready; /* every rank is paused with nothing running: the update runs now */
} rank_step;

/* Start the group. timeout_s bounds every wait of the group (0 = 60 s). A process not started by
 * mpirun gets a group of one, without MPI, unless force_mpi. NULL with a message on failure. */
rank_group *rank_group_init(int *argc, char ***argv, bool force_mpi, double timeout_s, char *err,
                            size_t errlen);

int rank_group_rank(const rank_group *g);
int rank_group_size(const rank_group *g);
int rank_group_local_rank(const rank_group *g); /* among the ranks on this node: picks the GPU */
int rank_group_local_size(const rank_group *g);
bool rank_group_same_node(const rank_group *g); /* every rank is on this node */
double rank_group_timeout(const rank_group *g);
/* The world communicator, MPI_COMM_NULL in a group of one without MPI. */
MPI_Comm rank_group_comm(const rank_group *g);

/* Collective (start-up): every rank learns every rank's HTTP endpoint. host is the address this
 * rank listens on; peers on the same node reach a wildcard or loopback listener through
 * 127.0.0.1, peers elsewhere through this node's hostname. 0, or -1 with a message. */
int rank_group_share_endpoints(rank_group *g, const char *host, int port, char *err,
                               size_t errlen);
/* "http://HOST:PORT" of rank r as this rank reaches it ("" before share_endpoints). */
const char *rank_group_url(const rank_group *g, int r);
int rank_group_pid(const rank_group *g, int r);            /* its process id */
const char *rank_group_hostname(const rank_group *g, int r); /* its node's hostname */

/* The step agreement (engine thread, collective). 0, or -1 with a message naming the rank that
 * did not answer or whose process has gone; the group is then unusable. */
int rank_group_step(rank_group *g, const rank_report *mine, rank_step *out, char *err,
                    size_t errlen);

/* Collective (engine thread, between steps): every rank's block of len bytes (mine) into all
 * [size * len], this rank's own included, with the step agreement's timeout and liveness checks.
 * 0, or -1 with a message as rank_group_step's. */
int rank_group_share(rank_group *g, const void *mine, size_t len, void *all, char *err,
                     size_t errlen);

/* Any thread: copies the latest reports (every rank's, [size]); returns the seconds since they
 * arrived (a large number before the first step). */
double rank_group_loads(rank_group *g, rank_report *out);

/* Any thread: the rank that should take a new request: the least loaded by n_running + n_waiting
 * of the latest reports plus the requests this rank has picked it for since those reports (the
 * next reports count them where they run, so nothing is to be undone when a request ends); this
 * rank's own load is local_load (live). Ties go to this rank, then to the lowest rank. */
int rank_group_pick(rank_group *g, int64_t local_load);

/* Any thread, no MPI: -1 with "rank R (pid P) has exited" when the process of a peer on this node
 * is gone (or a zombie), else 0. Cheap enough to call a few times a second. */
int rank_group_check_peers(rank_group *g, char *msg, size_t len);
/* The same with the signature kernels/a2a.h takes for its waits (ctx = the group). */
int rank_group_check_peers_cb(void *ctx, char *msg, size_t len);

/* Collective: MPI_Finalize after an orderly stop. Frees g. */
void rank_group_finalize(rank_group *g);
/* After a failure: let g go without any MPI call (the process is about to exit; memory a pending
 * receive may still write into is not freed; a group of one, without MPI, is freed). */
void rank_group_abandon(rank_group *g);

/* SGLang's parallelism flags against the world size: tp, dp, ep (0 = not given) and
 * --enable-dp-attention. Attention here is data-parallel (each rank runs its own requests with
 * the whole attention) and the experts are split over every rank, so tp, dp and ep must each equal
 * the world size when given (dp only with --enable-dp-attention, as in SGLang). 0, or -1 with a
 * message naming the flag. */
int rank_group_check_parallel_flags(int world, int tp, int dp, int ep, bool enable_dp_attention,
                                    char *err, size_t errlen);

#endif
