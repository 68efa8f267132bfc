/* Chat templates rendered natively (see chat_template.h). A Jinja interpreter is out of scope:
 * the markers of a template are enough to know its format, and the formats in use are few. */
#include "server/chat_template.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"

static char *chat_template_slurp(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    size_t cap = 1 << 14, n = 0, got;
    char *buf = xmalloc(cap);
    while ((got = fread(buf + n, 1, cap - n - 1, f)) > 0) {
        n += got;
        if (cap - n - 1 == 0) buf = xrealloc(buf, cap *= 2);
    }
    fclose(f);
    buf[n] = '\0';
    return buf;
}

/* The template source from tokenizer_config.json, or NULL. */
static char *chat_template_from_config(const char *dir) {
    char *path = path_join(dir, "tokenizer_config.json");
    char *text = chat_template_slurp(path);
    free(path);
    if (!text) return NULL;
    cJSON *root = cJSON_Parse(text);
    free(text);
    char *src = NULL;
    const cJSON *t = cJSON_GetObjectItemCaseSensitive(root, "chat_template");
    if (cJSON_IsString(t)) {
        src = xstrdup(t->valuestring);
    } else if (cJSON_IsArray(t)) {
        const cJSON *e;
        cJSON_ArrayForEach(e, t) {
            const cJSON *name = cJSON_GetObjectItemCaseSensitive(e, "name");
            const cJSON *tpl = cJSON_GetObjectItemCaseSensitive(e, "template");
            if (!cJSON_IsString(tpl)) continue;
            if (!src || (cJSON_IsString(name) && !strcmp(name->valuestring, "default"))) {
                free(src);
                src = xstrdup(tpl->valuestring);
            }
        }
    }
    cJSON_Delete(root);
    return src;
}

void chat_template_load(chat_template *t, const char *dir) {
    memset(t, 0, sizeof *t);
    char *src = chat_template_from_config(dir);
    if (!src) {
        char *path = path_join(dir, "chat_template.jinja");
        src = chat_template_slurp(path);
        free(path);
    }
    if (!src) {
        snprintf(t->why, sizeof t->why,
                 "the model folder %s has no chat template (tokenizer_config.json "
                 "chat_template or chat_template.jinja)",
                 dir);
        return;
    }
    if (strstr(src, "<|im_start|>") && strstr(src, "<|im_end|>")) {
        t->kind = CHAT_TEMPLATE_CHATML;
    } else {
        snprintf(t->why, sizeof t->why,
                 "the chat template of %s is not a supported format (supported: ChatML, "
                 "<|im_start|>role ... <|im_end|>)",
                 dir);
    }
    free(src);
}

static void chat_append(char **buf, size_t *len, size_t *cap, const char *s) {
    size_t n = strlen(s);
    if (*len + n + 1 > *cap) {
        while (*len + n + 1 > *cap)
            *cap = *cap ? *cap * 2 : 256;
        *buf = xrealloc(*buf, *cap);
    }
    memcpy(*buf + *len, s, n + 1);
    *len += n;
}

char *chat_template_render(const chat_template *t, const chat_message *msgs, int n,
                           bool add_generation_prompt) {
    MS_ASSERT(t->kind == CHAT_TEMPLATE_CHATML);
    char *buf = NULL;
    size_t len = 0, cap = 0;
    chat_append(&buf, &len, &cap, "");
    for (int i = 0; i < n; i++) {
        chat_append(&buf, &len, &cap, "<|im_start|>");
        chat_append(&buf, &len, &cap, msgs[i].role);
        chat_append(&buf, &len, &cap, "\n");
        chat_append(&buf, &len, &cap, msgs[i].content);
        chat_append(&buf, &len, &cap, "<|im_end|>\n");
    }
    if (add_generation_prompt) chat_append(&buf, &len, &cap, "<|im_start|>assistant\n");
    return buf;
}
