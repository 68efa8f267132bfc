/* Relay of one HTTP exchange to another rank's endpoint (see proxy.h). This first version only
 * links libcurl and answers every relay with 502; the relay thread comes next. */
#include "server/proxy.h"

#include <curl/curl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"

struct proxy {
    http_server *http;
    int n_active;
};

proxy *proxy_create(http_server *h, char *err, size_t errlen) {
    if (curl_global_init(CURL_GLOBAL_DEFAULT) != CURLE_OK) {
        set_err(err, errlen, "libcurl could not be initialised");
        return NULL;
    }
    proxy *p = xcalloc(1, sizeof *p);
    p->http = h;
    return p;
}

void proxy_free(proxy *p) {
    if (!p) return;
    free(p);
    curl_global_cleanup();
}

void proxy_forward(proxy *p, http_exchange *x, const char *base_url, int from_rank, int to_rank,
                   void (*done)(void *ctx, int to_rank), void *ctx) {
    char body[512];
    int n = snprintf(body, sizeof body,
                     "{\"error\": {\"message\": \"rank %d at %s could not be reached: relaying is "
                     "not available yet\", \"type\": \"BadGatewayError\", \"param\": null, "
                     "\"code\": 502}}",
                     to_rank, base_url);
    http_reply(x, 502, "application/json", body, (size_t)n, NULL);
    (void)from_rank;
    if (done) done(ctx, to_rank);
}

int proxy_n_active(proxy *p) { return p->n_active; }
