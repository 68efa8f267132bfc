#!/usr/bin/env bash
# Issue 10's overload, faults, security and load checks (tests/test_reliability.py): the real
# binary over real HTTP, one process and mpirun -np 2, on models/tiny-qwen3-moe; the load group
# sends 1000 requests (scripts/load_test.sh sends 10,000). Arguments go to test_reliability.py
# (groups: overload faults group security load). The whole run is bounded by
# $RELIABILITY_TEST_TIMEOUT seconds (default 420): past it the script is stopped, it kills the
# servers it started, and the run counts one failure. Prints the checks, then "N passed, M failed".
set -u
cd "$(dirname "$0")/.."
limit=${RELIABILITY_TEST_TIMEOUT:-420}
if [ ! -x "${BUILD:-build}/moeserve" ]; then
    echo "FAIL reliability_test.sh: ${BUILD:-build}/moeserve is not built (make)"
    echo "0 passed, 1 failed"
    exit 1
fi
out=$(timeout -k 10 "$limit" python3 -u tests/test_reliability.py "$@" 2>&1)
rc=$?
printf '%s\n' "$out" | grep -vE '^[0-9]+ passed, [0-9]+ failed$'
line=$(printf '%s\n' "$out" | grep -E '^[0-9]+ passed, [0-9]+ failed$' | tail -n 1)
if [ -z "$line" ]; then
    echo "FAIL reliability_test.sh: test_reliability.py ended without a summary (exit $rc)"
    echo "$(printf '%s\n' "$out" | grep -c '^ok ') passed, $(($(printf '%s\n' "$out" | grep -c '^FAIL ') + 1)) failed"
    exit 1
fi
p=${line%% passed*}
f=${line#*, }
f=${f%% failed*}
if [ "$rc" -ne 0 ] && [ "$f" -eq 0 ]; then
    echo "FAIL reliability_test.sh: test_reliability.py exited $rc"
    f=1
fi
echo "$p passed, $f failed"
[ "$f" -eq 0 ]
