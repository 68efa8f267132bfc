/* POST /update_weights_from_disk, SGLang's endpoint for RL loops: serve the weights of another
 * checkpoint folder of the same architecture without a restart.
 *
 *   {"model_path": folder (required), "load_format": "auto" (the only one taken),
 *    "abort_all_requests": bool (false)}
 *   -> 200 {"success": true, "message", "num_paused_requests": n}
 *   -> 400 {"success": false, "message", "num_paused_requests": n} when it did not happen
 *
 * The engine thread does the work (scheduler_update_weights): admission pauses, the running
 * requests finish (or, with abort_all_requests, everything queued or running is aborted and
 * answers what it has, as /abort_request's abort_all), the folder is loaded beside the old weights,
 * its config must equal the served one, then the weights are swapped, the old ones freed and the
 * prefix cache emptied. On any failure the old weights keep serving. num_paused_requests counts
 * the requests the call aborted on this rank. /get_model_info then names the new folder (on every
 * rank of a group, which updates together: scheduler_update_weights). The call waits on a thread
 * of its own, so the HTTP server keeps answering meanwhile. */
#include "server/api_internal.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"

typedef struct {
    api_server *a;
    http_server *http;
    http_ref ref;
    char *dir;
    bool abort_running;
    atomic_int refs; /* the worker and the exchange */
    atomic_bool done;
    int rc, n_aborted;
    char msg[600];
} api_update_job;

static void job_unref(api_update_job *j) {
    if (atomic_fetch_sub(&j->refs, 1) != 1) return;
    free(j->dir);
    free(j);
}

static void *job_main(void *arg) {
    api_update_job *j = arg;
    j->rc = scheduler_update_weights(j->a->sched, j->dir, j->abort_running, &j->n_aborted, j->msg,
                                     sizeof j->msg);
    atomic_store(&j->done, true);
    if (http_ref_lock(j->http, j->ref)) {
        http_ref_wake_locked(j->http, j->ref);
        http_ref_unlock(j->http, j->ref);
    }
    job_unref(j);
    return NULL;
}

/* polling thread: answer once the worker is done */
static void job_poll(void *ctx, http_exchange *x) {
    api_update_job *j = ctx;
    if (!atomic_load(&j->done)) return;
    api_server *a = j->a;
    cJSON *o = cJSON_CreateObject();
    cJSON_AddBoolToObject(o, "success", j->rc == 0);
    cJSON_AddStringToObject(o, "message", j->msg);
    cJSON_AddNumberToObject(o, "num_paused_requests", j->n_aborted);
    api_reply_json(a, x, j->rc == 0 ? 200 : 400, o);
}

static void job_close(void *ctx, bool completed) {
    (void)completed;
    job_unref(ctx);
}

void api_update_weights(api_server *a, http_exchange *x, const cJSON *body) {
    api_error e;
    const cJSON *path = cJSON_GetObjectItemCaseSensitive(body, "model_path");
    if (!cJSON_IsString(path) || !path->valuestring[0]) {
        api_fail(&e, 400, "model_path", "model_path must be a non-empty string (a model folder)");
        api_reply_error(a, x, &e);
        return;
    }
    const cJSON *lf = cJSON_GetObjectItemCaseSensitive(body, "load_format");
    if (lf && !cJSON_IsNull(lf) &&
        !(cJSON_IsString(lf) && (!strcmp(lf->valuestring, "auto") || !lf->valuestring[0]))) {
        api_fail(&e, 400, "load_format", "load_format: only \"auto\" is supported");
        api_reply_error(a, x, &e);
        return;
    }
    bool abort_running = false;
    if (api_get_bool(body, "abort_all_requests", &abort_running, &e) < 0) {
        api_reply_error(a, x, &e);
        return;
    }
    LOG_INFO("api", "/update_weights_from_disk: %s%s", path->valuestring,
             abort_running ? " (aborting every request)" : "");
    api_update_job *j = xcalloc(1, sizeof *j);
    j->a = a;
    j->http = http_exchange_server(x);
    j->ref = http_exchange_ref(x);
    j->dir = xstrdup(path->valuestring);
    j->abort_running = abort_running;
    atomic_init(&j->refs, 2);
    atomic_init(&j->done, false);
    http_defer(x, j, job_poll, job_close);
    pthread_t t;
    pthread_attr_t at;
    pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    if (pthread_create(&t, &at, job_main, j) != 0) {
        j->rc = -1;
        snprintf(j->msg, sizeof j->msg, "could not start a thread for the update");
        atomic_store(&j->done, true);
        http_ref_wake_locked(j->http, j->ref); /* the exchange's lock is held here */
        job_unref(j);
    }
    pthread_attr_destroy(&at);
}
