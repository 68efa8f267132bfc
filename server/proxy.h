/* Relay of one HTTP exchange to another rank's endpoint, so that one address is enough: a rank
 * that receives a generation request it should not run itself (the least-loaded rank is another)
 * passes it on and relays the answer, streamed or whole.
 *
 * One thread runs every relayed transfer through libcurl's multi interface; exchanges wait
 * suspended (http_defer / http_stream), as local ones do, so a relay costs no thread while it
 * waits. The upstream request repeats the method, path, body and the Content-Type, Accept and
 * Authorization headers, and adds "X-Moeserve-Routed: <from_rank>" so the receiving rank runs it
 * itself instead of relaying it again. The answer keeps the upstream status and Content-Type; a
 * 200 text/event-stream answer is relayed piece by piece as it arrives, anything else once it is
 * complete. A client that goes away cancels the upstream transfer (the peer then sees its client
 * gone and aborts the request). A peer that cannot be reached or fails mid-answer gives 502 with
 * a JSON error naming the rank and its URL (or, once a stream has started, an error event and the
 * end of the stream). */
#ifndef MOESERVE_PROXY_H
#define MOESERVE_PROXY_H

#include <stddef.h>

#include "server/http.h"

#define PROXY_ROUTED_HEADER "X-Moeserve-Routed"

typedef struct proxy proxy;

/* Start the relay thread for exchanges of server h. NULL with a message on failure. */
proxy *proxy_create(http_server *h, char *err, size_t errlen);
/* Cancel every transfer left (their clients get 502 or the end of their stream), stop the thread,
 * free. Call before http_server_stop. */
void proxy_free(proxy *p);

/* Inside on_request (polling thread, x locked): relay x to base_url ("http://HOST:PORT", no
 * trailing slash) as rank from_rank, naming the target as rank to_rank in errors. done(ctx) runs
 * once when the relay has ended, however it ended (any thread; may be NULL). */
void proxy_forward(proxy *p, http_exchange *x, const char *base_url, int from_rank, int to_rank,
                   void (*done)(void *ctx, int to_rank), void *ctx);

/* Relays in progress (and proxy_post_all's notes). */
int proxy_n_active(proxy *p);

/* A note to every peer, fire and forget: POST body (JSON) to base_urls[i] + path as rank
 * from_rank (the routed header, so no peer passes it on again), with "Authorization:
 * <authorization>" when that is not NULL. Sent from a thread of its own, every peer at once, each
 * given 2 s; a peer that does not answer 200 is logged. Counted in proxy_n_active while it
 * runs, so api_stop_relays waits for it. Any thread. */
void proxy_post_all(proxy *p, const char *const *base_urls, int n, const char *path,
                    const char *body, const char *authorization, int from_rank);

#endif
