/* moeserve-bench: the two benchmarks people run on SGLang, as one C program that talks to
 * moeserve (or SGLang) over HTTP:
 *   moeserve-bench gsm8k    GSM8K few-shot accuracy (SGLang's benchmark/gsm8k/bench_sglang.py)
 *   moeserve-bench serving  the serving benchmark (SGLang's python -m sglang.bench_serving)
 * Each subcommand's --help lists its flags. */
#include <stdio.h>
#include <string.h>

#include "scripts/bench/bench.h"

static const char bench_usage[] =
    "usage: moeserve-bench COMMAND [flags]\n"
    "\n"
    "  gsm8k     GSM8K few-shot accuracy, as SGLang's benchmark/gsm8k/bench_sglang.py: prints\n"
    "            Accuracy, Invalid, Latency and Output throughput\n"
    "  serving   serving benchmark, as SGLang's bench_serving: TTFT, TPOT, ITL, E2E latency and\n"
    "            throughputs in its \"Serving Benchmark Result\" block\n"
    "\n"
    "moeserve-bench COMMAND --help lists the flags of a command. Both take --url once per rank of\n"
    "`mpirun -np N moeserve serve` (ports P .. P+N-1) and spread their requests over them.\n";

int main(int argc, char **argv) {
    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") ||
        !strcmp(argv[1], "help")) {
        fputs(bench_usage, argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    if (!strcmp(argv[1], "gsm8k")) return bench_gsm8k_main(argc - 1, argv + 1);
    if (!strcmp(argv[1], "serving")) return bench_serving_main(argc - 1, argv + 1);
    fprintf(stderr, "moeserve-bench: unknown command '%s'\n\n%s", argv[1], bench_usage);
    return 2;
}
