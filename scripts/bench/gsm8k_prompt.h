/* GSM8K prompts and answers exactly as SGLang's benchmark/gsm8k/bench_sglang.py makes and reads
 * them.
 *   one example   "Question: " + question + "\nAnswer:" (+ " " + answer for a shot)
 *   prompt        the first k rows of the file as shots, each followed by "\n\n", then the
 *                 question; question i is row i of the same file (so with k shots the first k
 *                 questions are among the shots, as in SGLang)
 *   answer value  commas removed, the last run of decimal digits (re "\d+"), read as Python's
 *                 ast.literal_eval reads it: a minus sign is not part of it ("-5" gives 5), a
 *                 run with a leading zero and another digit after it ("007") is not a Python
 *                 integer and counts as invalid, as does text without a digit. (Python's "\d"
 *                 also takes non-ASCII decimal digits; only ASCII ones are taken here.) */
#ifndef MOESERVE_BENCH_GSM8K_PROMPT_H
#define MOESERVE_BENCH_GSM8K_PROMPT_H

#include "scripts/bench/util.h"

/* the stop strings of bench_sglang.py's gen() */
extern const char *const gsm8k_stop[3];

/* appends one example to b */
void gsm8k_example(bench_buf *b, const char *question, const char *answer /* NULL: none */);

/* the few-shot prefix of k shots (questions[i], answers[i], i < k); a fresh string */
char *gsm8k_few_shot(const char *const *questions, const char *const *answers, int k);

/* The answer value of text, written to out (cap bytes) as its digits without leading zeros
 * ("0" for zero), comparable with strcmp. Returns 1, or 0 for an invalid answer. */
int gsm8k_answer_value(const char *text, char *out, size_t cap);

#endif
