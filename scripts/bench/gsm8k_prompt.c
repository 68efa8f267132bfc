/* GSM8K prompts and answer values (see gsm8k_prompt.h). */
#include "scripts/bench/gsm8k_prompt.h"

#include <string.h>

const char *const gsm8k_stop[3] = {"Question", "Assistant:", "<|separator|>"};

void gsm8k_example(bench_buf *b, const char *question, const char *answer) {
    bench_buf_appendf(b, "Question: %s\nAnswer:", question);
    if (answer) bench_buf_appendf(b, " %s", answer);
}

char *gsm8k_few_shot(const char *const *questions, const char *const *answers, int k) {
    bench_buf b = {0};
    bench_buf_append(&b, "", 0);
    for (int i = 0; i < k; i++) {
        gsm8k_example(&b, questions[i], answers[i]);
        bench_buf_append(&b, "\n\n", 2);
    }
    return b.data;
}

int gsm8k_answer_value(const char *text, char *out, size_t cap) {
    /* the last run of ASCII digits once the commas are gone: commas only join runs, so the run
     * is the digits of the last digit run together with any earlier ones joined by commas */
    const char *end = NULL; /* one past the last digit */
    for (const char *c = text; *c; c++)
        if (*c >= '0' && *c <= '9') end = c + 1;
    if (!end) return 0;
    const char *start = end;
    while (start > text && ((start[-1] >= '0' && start[-1] <= '9') || start[-1] == ','))
        start--;
    size_t n = 0;
    char digits[256];
    for (const char *c = start; c < end; c++) {
        if (*c == ',') continue;
        if (n + 1 >= sizeof digits) return 0; /* longer than any GSM8K answer; not comparable */
        digits[n++] = *c;
    }
    digits[n] = '\0';
    /* ast.literal_eval: "0", "00", "000" are 0; "07" is a syntax error */
    size_t z = 0;
    while (z < n && digits[z] == '0')
        z++;
    if (z == n) {
        if (cap < 2) return 0;
        memcpy(out, "0", 2);
        return 1;
    }
    if (z > 0) return 0;
    if (n + 1 > cap) return 0;
    memcpy(out, digits, n + 1);
    return 1;
}
