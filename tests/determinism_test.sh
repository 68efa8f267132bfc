#!/usr/bin/env bash
# End-to-end tests of --enable-deterministic-inference (tests/test_determinism.py): one prompt in
# batches of 1..32, SGLang's input/output logprob match, seeded sampling alone and under load, the
# prefix cache, 200 requests with random arrivals against their solo runs, and mpirun -np 1, 2, 3,
# 4, 8 against one process; every comparison exact. About 50 s on 2 cores.
# Arguments go to test_determinism.py (groups). Whatever happens (failure, timeout, Ctrl-C), every
# server the test started is killed: the Python side keeps the process-group ids of those running
# in a file, and the trap below kills whatever is still listed there.
# Prints the checks, then one "N passed, M failed" last line.
set -u
cd "$(dirname "$0")/.."
bin=${BUILD:-build}/moeserve
limit=${DET_TEST_TIMEOUT:-300} # seconds for the whole run; a hang becomes a failure

if [ ! -x "$bin" ]; then
    echo "FAIL determinism_test.sh: $bin is not built (make)"
    echo "0 passed, 1 failed"
    exit 1
fi

pidfile=$(mktemp "${TMPDIR:-/tmp}/moeserve-det-pids.XXXXXX")
log=$(mktemp "${TMPDIR:-/tmp}/moeserve-det-log.XXXXXX")
runner=
cleanup() {
    local kind id
    [ -n "$runner" ] && kill -KILL "$runner" 2>/dev/null
    if [ -s "$pidfile" ]; then
        while read -r kind id; do
            [ "$kind" = pgid ] && kill -KILL -- "-$id" 2>/dev/null
        done <"$pidfile"
    fi
    rm -f "$pidfile" "$pidfile.tmp" "$log"
}
on_signal() { # let the Python side stop its servers (timeout passes the signal on), then go
    if [ -n "$runner" ]; then
        kill -TERM "$runner" 2>/dev/null
        for _ in $(seq 50); do kill -0 "$runner" 2>/dev/null || break; sleep 0.2; done
    fi
    exit 130
}
trap cleanup EXIT
trap on_signal INT TERM

DET_TEST_PIDFILE=$pidfile timeout -k 10 "$limit" python3 -u tests/test_determinism.py "$@" >"$log" 2>&1 &
runner=$!
wait "$runner"
rc=$?
runner=
grep -vE '^[0-9]+ passed, [0-9]+ failed$' "$log"
line=$(grep -E '^[0-9]+ passed, [0-9]+ failed$' "$log" | tail -n 1)
if [ -z "$line" ]; then
    p=$(grep -c '^ok ' "$log")
    f=$(grep -c '^FAIL ' "$log")
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        echo "FAIL determinism_test.sh: test_determinism.py did not finish within $limit s"
    else
        echo "FAIL determinism_test.sh: test_determinism.py ended without a summary (exit $rc)"
    fi
    echo "$p passed, $((f + 1)) failed"
    exit 1
fi
p=${line%% passed*}
f=${line#*, }
f=${f%% failed*}
if [ "$rc" -ne 0 ] && [ "$f" -eq 0 ]; then
    echo "FAIL determinism_test.sh: test_determinism.py exited $rc"
    f=1
fi
echo "$p passed, $f failed"
[ "$f" -eq 0 ]
