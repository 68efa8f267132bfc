/* The subcommands of moeserve-bench (main.c dispatches to them). Each parses its own flags,
 * prints its results on stdout, notes on stderr, and returns the exit status: 0 when every
 * request succeeded, 1 when one failed, 2 for a usage error. */
#ifndef MOESERVE_BENCH_H
#define MOESERVE_BENCH_H

int bench_serving_main(int argc, char **argv);
int bench_gsm8k_main(int argc, char **argv);

#endif
