#!/usr/bin/env bash
# Issue 10's load run: `moeserve-bench serving`, N requests (default 10,000; 32 prompt and 16
# output tokens each, ignore_eos) at concurrency 256 over both ranks of `mpirun -np 2
# build/moeserve serve --model-path models/tiny-qwen3-moe` on the CPU. Checks zero failed, every
# answer complete (the server's completion_tokens add up to N x 16), and each rank's resident
# memory after the run against before it (after a warm-up of 300 requests). It is the "load"
# group of tests/test_reliability.py (the test suite runs it with 1000 requests).
#   scripts/load_test.sh [N]
# Prints one line per check, then "P passed, F failed"; exit status 0 when nothing failed.
set -u
cd "$(dirname "$0")/.."
LOAD_REQUESTS=${1:-10000} exec python3 -u tests/test_reliability.py -v load
