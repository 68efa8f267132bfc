#!/usr/bin/env bash
# End-to-end tests of the rank group (tests/test_ep.py): `mpirun -np 1..4 moeserve serve` on the
# tiny checkpoint against one plain process (same logprobs and tokens, requests spread or on one
# rank, balancing, 40 concurrent, staggered arrivals, a checkpoint whose routers send every token
# to rank 0), a rank killed with SIGKILL, and the rank-group flags. Ranks beyond the cores
# oversubscribe them (one engine thread per rank, OpenMPI yields when idle).
# Arguments go to test_ep.py (groups; `tests/ep_test.sh kill-all` also wants every surviving rank,
# not only rank 0, to name the killed one). Skips, with a line saying so and "0 passed, 0 failed",
# when mpirun is not installed.
# Whatever happens (failure, timeout, Ctrl-C), every process the test started is killed: the
# Python side keeps the ids of the process groups and ranks it has running in a file, and the
# trap below kills whatever is still listed there.
# Prints the checks, then one "N passed, M failed" last line.
set -u
cd "$(dirname "$0")/.."
bin=${BUILD:-build}/moeserve
limit=${EP_TEST_TIMEOUT:-420} # seconds for the whole run; a hang becomes a failure

if ! command -v mpirun >/dev/null; then
    echo "SKIP ep_test.sh: mpirun not found (apt-get install openmpi-bin); rank-group tests not run"
    echo "0 passed, 0 failed"
    exit 0
fi
if [ ! -x "$bin" ]; then
    echo "FAIL ep_test.sh: $bin is not built (make)"
    echo "0 passed, 1 failed"
    exit 1
fi

pidfile=$(mktemp "${TMPDIR:-/tmp}/moeserve-ep-pids.XXXXXX")
log=$(mktemp "${TMPDIR:-/tmp}/moeserve-ep-log.XXXXXX")
runner=
cleanup() {
    local kind id
    [ -n "$runner" ] && kill -KILL "$runner" 2>/dev/null
    if [ -s "$pidfile" ]; then
        while read -r kind id; do
            case "$kind" in
            pgid) kill -KILL -- "-$id" 2>/dev/null ;;
            pid) kill -KILL "$id" 2>/dev/null ;;
            esac
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

# Run in the background so that a signal reaches on_signal at once; the output is followed from
# the log, and the summary line printed once, at the end, after any line this script adds.
EP_TEST_PIDFILE=$pidfile timeout -k 10 "$limit" python3 -u tests/test_ep.py "$@" >"$log" 2>&1 &
runner=$!
tail -s 0.2 -n +1 -f --pid="$runner" "$log" | grep -vE '^[0-9]+ passed, [0-9]+ failed$' &
follower=$!
wait "$runner"
rc=$?
runner=
wait "$follower"
line=$(grep -E '^[0-9]+ passed, [0-9]+ failed$' "$log" | tail -n 1)
p=$(grep -c '^ok ' "$log")
f=$(grep -c '^FAIL ' "$log")
if [ -z "$line" ]; then
    # killed by the timeout (124, 137) or crashed: what passed counts, the rest is one failure
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        echo "FAIL ep_test.sh: test_ep.py did not finish within $limit s"
    else
        echo "FAIL ep_test.sh: test_ep.py ended without a summary (exit $rc)"
    fi
    echo "$p passed, $((f + 1)) failed"
    exit 1
fi
p=${line%% passed*}
f=${line#*, }
f=${f%% failed*}
if [ "$rc" -ne 0 ] && [ "$f" -eq 0 ]; then
    echo "FAIL ep_test.sh: test_ep.py exited $rc"
    f=1
fi
echo "$p passed, $f failed"
[ "$f" -eq 0 ]
