/* Streamed answers into timings (see stream.h). */
#include "scripts/bench/stream.h"

#include <cjson/cJSON.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "scripts/bench/util.h"

void bench_stream_begin(bench_stream *s, bench_api api, bench_request *req, double st,
                        int prompt_len, int requested_output_len) {
    *s = (bench_stream){.api = api, .req = req, .st = st, .recent = st};
    req->prompt_len = prompt_len;
    req->output_len = requested_output_len;
}

/* a number field of an object, or -1 */
static int bench_json_int(const cJSON *obj, const char *key) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    return cJSON_IsNumber(v) ? (int)v->valuedouble : -1;
}

/* SGLang's _record_server_prompt_len: usage, else meta_info, prompt_tokens when non-zero */
static void bench_stream_prompt_len(bench_stream *s, const cJSON *data) {
    const cJSON *rep = cJSON_GetObjectItemCaseSensitive(data, "usage");
    if (!cJSON_IsObject(rep)) rep = cJSON_GetObjectItemCaseSensitive(data, "meta_info");
    if (!cJSON_IsObject(rep)) return;
    int n = bench_json_int(rep, "prompt_tokens");
    if (n > 0) {
        s->req->prompt_len = n;
        s->req->prompt_counted = 1;
    }
}

static void bench_stream_usage_output(bench_stream *s, const cJSON *data) {
    const cJSON *usage = cJSON_GetObjectItemCaseSensitive(data, "usage");
    if (!cJSON_IsObject(usage)) return;
    int n = bench_json_int(usage, "completion_tokens");
    if (n >= 0) {
        s->req->output_len = n;
        s->req->output_counted = 1;
    }
}

/* a chunk with text at time now: the first sets TTFT, each later one adds one gap */
static void bench_stream_text_chunk(bench_stream *s, double now) {
    if (!s->seen_text) {
        s->seen_text = 1;
        s->req->ttft = now - s->st;
    } else {
        bench_request_add_itl(s->req, now - s->recent);
    }
    s->recent = now;
}

static int bench_str_nonempty(const cJSON *v) {
    return cJSON_IsString(v) && v->valuestring && v->valuestring[0];
}

static void bench_stream_error(bench_stream *s, const cJSON *err) {
    if (s->error) return;
    const cJSON *msg = cJSON_IsObject(err) ? cJSON_GetObjectItemCaseSensitive(err, "message") : err;
    if (cJSON_IsString(msg)) {
        s->error = bench_strdup(msg->valuestring);
    } else {
        char *text = cJSON_PrintUnformatted(err);
        s->error = bench_strdup(text ? text : "error in the stream");
        free(text);
    }
}

void bench_stream_line(bench_stream *s, const char *line, size_t len, double now) {
    if (len < 5 || strncmp(line, "data:", 5) != 0) return;
    const char *p = line + 5, *end = line + len;
    while (p < end && (*p == ' ' || *p == '\t'))
        p++;
    s->req->latency = now - s->st;
    if (end - p == 6 && memcmp(p, "[DONE]", 6) == 0) return;
    cJSON *data = cJSON_ParseWithLength(p, (size_t)(end - p));
    if (!cJSON_IsObject(data)) {
        if (!s->error) {
            bench_buf b = {0};
            bench_buf_appendf(&b, "a chunk is not a JSON object: %.200s", p);
            s->error = b.data;
        }
        cJSON_Delete(data);
        return;
    }
    const cJSON *err = cJSON_GetObjectItemCaseSensitive(data, "error");
    if (err && !cJSON_IsNull(err)) {
        bench_stream_error(s, err);
        cJSON_Delete(data);
        return;
    }
    bench_stream_prompt_len(s, data);
    if (s->api == BENCH_API_GENERATE) {
        /* the count of every chunk (a request of 0 new tokens has no chunk with text) */
        const cJSON *meta = cJSON_GetObjectItemCaseSensitive(data, "meta_info");
        int n = bench_json_int(meta, "completion_tokens");
        if (n >= 0) {
            s->req->output_len = n;
            s->req->output_counted = 1;
        }
        /* a chunk brings tokens when it has text, or, from a server without a tokenizer
         * (--skip-tokenizer-init: no text, output_ids only), when its count grew */
        const cJSON *ids = cJSON_GetObjectItemCaseSensitive(data, "output_ids");
        bool ids_grew = cJSON_IsArray(ids) && cJSON_GetArraySize(ids) > 0 &&
                        !bench_str_nonempty(cJSON_GetObjectItemCaseSensitive(data, "text")) &&
                        n > s->last_output_len;
        if (bench_str_nonempty(cJSON_GetObjectItemCaseSensitive(data, "text")) || ids_grew) {
            int out = s->req->output_len;
            if (!s->seen_text) {
                s->seen_text = 1;
                s->req->ttft = now - s->st;
            } else {
                int added = out - s->last_output_len;
                if (added == 0) goto done; /* no new token: the gap runs on */
                for (int k = 0; k < added; k++)
                    bench_request_add_itl(s->req, (now - s->recent) / added);
            }
            s->recent = now;
            s->last_output_len = out;
        }
    } else {
        bench_stream_usage_output(s, data);
        const cJSON *choices = cJSON_GetObjectItemCaseSensitive(data, "choices");
        const cJSON *c0 = cJSON_IsArray(choices) ? cJSON_GetArrayItem(choices, 0) : NULL;
        if (cJSON_IsObject(c0)) {
            int has_text;
            if (s->api == BENCH_API_COMPLETIONS) {
                has_text = bench_str_nonempty(cJSON_GetObjectItemCaseSensitive(c0, "text"));
            } else {
                const cJSON *delta = cJSON_GetObjectItemCaseSensitive(c0, "delta");
                has_text = bench_str_nonempty(cJSON_GetObjectItemCaseSensitive(delta, "content")) ||
                           bench_str_nonempty(
                               cJSON_GetObjectItemCaseSensitive(delta, "reasoning_content"));
            }
            if (has_text) bench_stream_text_chunk(s, now);
        }
    }
done:
    cJSON_Delete(data);
}

void bench_stream_end(bench_stream *s, long status, const char *transport_error, const char *body) {
    bench_request *r = s->req;
    bench_buf b = {0};
    if (status != 200 && status != 0) {
        bench_buf_appendf(&b, "HTTP %ld: %.300s", status, body ? body : "");
        /* one line: the body may hold a newline */
        for (char *c = b.data; *c; c++)
            if (*c == '\n' || *c == '\r') *c = ' ';
    } else if (transport_error) {
        bench_buf_appendf(&b, "%s", transport_error);
    } else if (s->error) {
        bench_buf_appendf(&b, "%s", s->error);
    } else if (status == 0) {
        bench_buf_appendf(&b, "no HTTP answer");
    }
    free(s->error);
    s->error = NULL;
    r->ok = b.data == NULL;
    r->error = b.data;
}
