/* Chat templates: messages -> prompt text, done natively (no Jinja).
 *
 * The model's template is read from tokenizer_config.json ("chat_template": a string, or a list
 * of {name, template} where "default" wins) or from chat_template.jinja beside it. A template
 * that uses ChatML's markers (<|im_start|>, <|im_end|>: Qwen and others) is rendered as
 *   <|im_start|>{role}\n{content}<|im_end|>\n   per message, then <|im_start|>assistant\n
 * Any other template is reported as unsupported: the server starts with a warning and answers
 * chat requests with 400. */
#ifndef MOESERVE_CHAT_TEMPLATE_H
#define MOESERVE_CHAT_TEMPLATE_H

#include <stdbool.h>
#include <stddef.h>

typedef enum {
    CHAT_TEMPLATE_NONE,   /* no template, or one this code cannot render */
    CHAT_TEMPLATE_CHATML, /* <|im_start|>role\n...<|im_end|>\n */
} chat_template_kind;

typedef struct {
    chat_template_kind kind;
    char why[256]; /* kind NONE: why (for the warning and the 400 message) */
} chat_template;

typedef struct {
    const char *role;
    const char *content; /* NUL-terminated */
} chat_message;

/* Find and classify the template of the model folder dir. Never fails: a missing or unsupported
 * template gives kind NONE with why set. */
void chat_template_load(chat_template *t, const char *dir);

/* The prompt text for msgs[n] (malloc'ed); add_generation_prompt appends the assistant's
 * opening. Requires kind != NONE. */
char *chat_template_render(const chat_template *t, const chat_message *msgs, int n,
                           bool add_generation_prompt);

#endif
