/* The HTTP API of `moeserve serve`: SGLang's native endpoints and the OpenAI-compatible ones, as
 * ../shared/notes/api.md describes them.
 *
 * The api turns a JSON request into engine requests (text is tokenized here), submits them to the
 * scheduler and turns the request channel back into JSON: a whole answer when every request is
 * done, or server-sent events as tokens arrive. It never blocks the polling thread: a waiting
 * exchange is suspended and the request's notify callback (engine thread) wakes it.
 *
 * Life cycle (main builds in this order and frees in reverse): api_create (state starting: only
 * the info endpoints answer, /health says 503) -> http_server_start(on_request = api_on_request)
 * -> api_set_http -> model and scheduler -> api_set_ready -> ... signal ... -> api_drain (new
 * generation requests get 503, /health says 503; nothing is submitted after it returns) -> stop
 * the scheduler loop (it finishes what is left with FINISH_ABORT) -> http_server_stop ->
 * api_free. */
#ifndef MOESERVE_API_H
#define MOESERVE_API_H

#include <stdbool.h>
#include <stddef.h>

#include "runner/scheduler.h"
#include "server/chat_template.h"
#include "server/http.h"
#include "server/metrics.h"
#include "server/tokenizer.h"

/* The arguments of `moeserve serve`, validated once by main (see its usage text). */
typedef struct {
    const char *model_path;
    const char *host;
    int port;
    const char *device; /* "cpu" | "cuda" */
    int max_running_requests;
    int max_total_tokens;
    int chunked_prefill_size;
    int context_length;
    int page_size;
    const char *served_model_name;
    const char *api_key; /* NULL: no authentication */
    bool enable_metrics;
    bool disable_radix_cache;
    const char *log_level;
    int threads; /* 0: all cores */
    size_t max_body_bytes;
    int max_queued_requests; /* waiting requests at most; a request that would pass it gets 503
                                with Retry-After (0: no limit) */
    double shutdown_timeout;   /* SIGTERM / SIGINT: seconds to finish what runs (0: abort it) */
    double connection_timeout; /* seconds a connection may send and take nothing */
    /* the rank group */
    bool load_balance;           /* place generation requests on the least-loaded rank */
    const char *moe_a2a_backend; /* none | shm | mpi | nvlink_one_sided | nccl; NULL = by machine */
    const char *moe_a2a_combine; /* slots | partial once resolved; NULL or auto = by transport */
    int tp, dp, ep;              /* SGLang's flags, 0 = not given; checked against the world */
    bool enable_dp_attention;
    double dist_timeout; /* seconds a rank waits for its peers before giving up */
    double mem_fraction_static; /* share of the device's memory for weights + KV pool; 0 = default */
    int cuda_graph_max_bs;      /* decode steps replayed as CUDA graphs up to this batch; 0 = off
                                   (serve starts from -1: its default by device) */
    const char *load_format;    /* auto | safetensors | dummy (random weights from config.json) */
    const char *quantization;   /* --quantization, or NULL: the checkpoint's own format */
    bool skip_tokenizer_init;   /* no tokenizer: token ids in and out (api_create gets NULL) */
    bool enable_deterministic_inference; /* results independent of what else runs; unseeded
                                            sampling takes API_DETERMINISTIC_SEED */
    bool kv_cache_bf16;                  /* --kv-cache-dtype bfloat16 (else the cache is float32) */
} server_args;

typedef struct api_server api_server;

/* tok, tpl and met (NULL when metrics are off) must outlive the api. vocab_size is the model's
 * (ids are checked against it); eos ids come from the model too (see api_set_ready).
 * tok is NULL with args.skip_tokenizer_init, as SGLang's --skip-tokenizer-init: text prompts,
 * stop strings and chat answer 400; /generate answers carry output_ids and no text;
 * /v1/completions takes token-id prompts and answers empty text. */
api_server *api_create(const server_args *args, const tokenizer *tok, const chat_template *tpl,
                       metrics *met);
void api_free(api_server *a);

/* The http_config callback: route, check and answer one exchange. */
void api_on_request(void *app, http_exchange *x);

void api_set_http(api_server *a, http_server *h);
/* The rank group this server belongs to (a group of one needs no call): /server_info lists every
 * rank's load, and with args.load_balance generation requests go to the least-loaded rank
 * (relayed by server/proxy.h unless they carry the X-Moeserve-Routed header). After
 * api_set_http. */
struct rank_group;
void api_set_group(api_server *a, struct rank_group *g);
/* Stop relaying: new generation requests are no longer passed on, relays in flight get a few
 * seconds to end by themselves, then the rest are cut (502, or an error event that ends their
 * stream). After api_drain and before http_server_stop; nothing to do without a group. */
void api_stop_relays(api_server *a);
/* The engine is up: generation endpoints open, /health says 200. */
void api_set_ready(api_server *a, scheduler *s, const model_config *cfg);
/* Refuse new generation requests from now on; returns once no submit is in progress. */
void api_drain(api_server *a);
/* After the scheduler loop has ended: free what engine-side state is left. */
void api_reap(api_server *a);

#endif
