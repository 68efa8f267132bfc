#!/usr/bin/env bash
# End-to-end tests of build/moeserve-bench against `mpirun -np 2 moeserve serve` on the CPU with
# the tiny test checkpoint (ranks on ports P and P+1, both given as --url):
#   - every --help lists every flag;
#   - gsm8k, backends sglang and openai, on 20 questions of ../shared/data/gsm8k/test.jsonl (2
#     shots: 8 would not fit the checkpoint's 512-token context): every request successful, the
#     closing lines Accuracy / Invalid / Latency / Output throughput, the JSON line appended, both
#     ranks used (skipped with a line saying so when the data is absent);
#   - serving on 50 random prompts, backends sglang, openai and openai-chat (and random-ids):
#     every request successful, every label of the result block printed, its token totals equal
#     to the growth of the server's /metrics counters (prompt_tokens_total,
#     generation_tokens_total) summed over both ranks, the JSON line appended;
#   - failed requests are counted and the first error printed (a prompt over the context, a
#     server that is not there); the progress bar is drawn when stderr is a terminal.
# Skips, with a line saying so and "0 passed, 0 failed", when mpirun is not installed. Whatever
# happens, the server group started here is killed on exit. Last line: "N passed, M failed".
set -u
cd "$(dirname "$0")/.."
build=${BUILD:-build}
bench=$build/moeserve-bench
server=$build/moeserve
model=tests/data/tiny-qwen3-moe
gsm8k_data=../shared/data/gsm8k/test.jsonl
limit=${BENCH_TEST_STEP_TIMEOUT:-120} # seconds any one step may take
pass=0
fail=0

ok() {
    echo "ok $*"
    pass=$((pass + 1))
}
bad() {
    echo "FAIL $*"
    fail=$((fail + 1))
}
check() { # $1 = description; the rest = a command that must succeed
    local what=$1
    shift
    if "$@"; then ok "$what"; else bad "$what"; fi
}

if ! command -v mpirun >/dev/null; then
    echo "SKIP bench_test.sh: mpirun not found (apt-get install openmpi-bin); benchmark client tests not run"
    echo "0 passed, 0 failed"
    exit 0
fi
for b in "$bench" "$server"; do
    if [ ! -x "$b" ]; then
        echo "FAIL bench_test.sh: $b is not built (make)"
        echo "0 passed, 1 failed"
        exit 1
    fi
done

tmp=$(mktemp -d "${TMPDIR:-/tmp}/moeserve-bench-test.XXXXXX")
group=
cleanup() {
    if [ -n "$group" ]; then
        kill -TERM -- "-$group" 2>/dev/null
        for _ in $(seq 30); do kill -0 -- "-$group" 2>/dev/null || break; sleep 0.1; done
        kill -KILL -- "-$group" 2>/dev/null
    fi
    rm -rf "$tmp"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# three consecutive free ports (the third: nothing listens there), below the ephemeral range (tests/harness.py says why)
port=$(python3 -c 'import sys; sys.path.insert(0, "tests"); import harness; print(harness.free_port_block(3))')
urls=(--url "http://127.0.0.1:$port" --url "http://127.0.0.1:$((port + 1))")

# the rank group, in its own process group so that cleanup reaches every rank
setsid mpirun --allow-run-as-root --oversubscribe --mca mpi_yield_when_idle 1 -np 2 \
    "$server" serve --model-path "$model" --port "$port" --threads 1 --enable-metrics \
    >"$tmp/server.log" 2>&1 &
group=$!
up=0
for _ in $(seq 600); do
    if curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 &&
        curl -sf "http://127.0.0.1:$((port + 1))/health" >/dev/null 2>&1; then
        up=1
        break
    fi
    kill -0 "$group" 2>/dev/null || break
    sleep 0.1
done
if [ "$up" -ne 1 ]; then
    tail -n 20 "$tmp/server.log"
    echo "FAIL bench_test.sh: mpirun -np 2 moeserve serve did not come up on ports $port, $((port + 1))"
    echo "0 passed, 1 failed"
    exit 1
fi
ok "mpirun -np 2 moeserve serve is up on ports $port and $((port + 1))"

# "prompt generation finished" counters of one rank, or of both summed
metric() { # $1 = port, $2 = metric name (without labels)
    curl -s "http://127.0.0.1:$1/metrics" | awk -v n="$2" '$1 ~ "^"n"[{]" {s += $2} END {printf "%d\n", s}'
}
counters() { # prompt, generated, finished on rank 0; the same on rank 1
    local p
    for p in "$port" $((port + 1)); do
        printf '%s %s %s ' "$(metric "$p" moeserve:prompt_tokens_total)" \
            "$(metric "$p" moeserve:generation_tokens_total)" \
            "$(metric "$p" moeserve:finished_requests_total)"
    done
    echo
}
value() { # $1 = label, $2 = file: the value printed after the label
    grep -F -- "$1" "$2" | head -n 1 | sed -e "s/^.*$(printf '%s' "$1" | sed 's/[][().*^$/]/\\&/g')[[:space:]]*//" -e 's/[[:space:]]*$//'
}

# ---- --help ----
"$bench" --help >"$tmp/help" 2>&1
check "moeserve-bench --help names both commands" grep -q "gsm8k" "$tmp/help"
for cmd in serving gsm8k; do
    if "$bench" "$cmd" --help >"$tmp/help.$cmd" 2>&1; then
        ok "moeserve-bench $cmd --help exits 0"
    else
        bad "moeserve-bench $cmd --help exits 0"
    fi
done
missing=
for f in --url --backend --dataset --dataset-path --num-prompts --random-input-len \
    --random-output-len --random-range-ratio --request-rate --max-concurrency --seed \
    --warmup-requests --output-file --vocab-size --model --api-key --timeout --disable-progress; do
    grep -q -- "$f " "$tmp/help.serving" || missing="$missing $f"
done
check "serving --help lists every flag${missing:+ (missing:$missing)}" [ -z "$missing" ]
missing=
for f in --url --data-path --num-shots --num-questions --parallel --max-new-tokens \
    --temperature --backend --output-file --model --api-key --timeout --disable-progress; do
    grep -q -- "$f " "$tmp/help.gsm8k" || missing="$missing $f"
done
check "gsm8k --help lists every flag${missing:+ (missing:$missing)}" [ -z "$missing" ]
"$bench" serving --no-such-flag >/dev/null 2>"$tmp/err"
rc=$?
check "an unknown flag exits 2 with a message (exit $rc)" [ "$rc" -eq 2 -a -s "$tmp/err" ]

# ---- gsm8k ----
if [ -f "$gsm8k_data" ]; then
    for backend in sglang openai; do
        before=($(counters))
        timeout -k 5 "$limit" "$bench" gsm8k "${urls[@]}" --backend "$backend" \
            --data-path "$gsm8k_data" --num-shots 2 --num-questions 20 --parallel 8 \
            --max-new-tokens 64 --output-file "$tmp/gsm8k.jsonl" >"$tmp/gsm8k.$backend" 2>&1
        rc=$?
        after=($(counters))
        out=$tmp/gsm8k.$backend
        check "gsm8k $backend: exits 0 (exit $rc)" [ "$rc" -eq 0 ]
        check "gsm8k $backend: every request successful" grep -qx "Failed requests: 0" "$out"
        tail -n 4 "$out" >"$tmp/closing"
        check "gsm8k $backend: closing lines Accuracy, Invalid, Latency, Output throughput" \
            grep -Pzq '^Accuracy: [01]\.\d{3}\nInvalid: [01]\.\d{3}\nLatency: \d+\.\d{3} s\nOutput throughput: \d+\.\d{3} token/s\n$' "$tmp/closing"
        finished=$(( (after[2] - before[2]) + (after[5] - before[5]) ))
        check "gsm8k $backend: 20 requests finished on the server ($finished)" [ "$finished" -eq 20 ]
        check "gsm8k $backend: both ranks answered (${before[2]}->${after[2]}, ${before[5]}->${after[5]})" \
            [ "${after[2]}" -gt "${before[2]}" -a "${after[5]}" -gt "${before[5]}" ]
        gen=$(( (after[1] - before[1]) + (after[4] - before[4]) ))
        lat=$(value "Latency:" "$out" | cut -d' ' -f1)
        thr=$(value "Output throughput:" "$out" | cut -d' ' -f1)
        check "gsm8k $backend: output throughput = server's generated tokens ($gen) / latency ($lat s): $thr" \
            python3 -c "import sys; g, l, t = $gen, $lat, $thr; sys.exit(0 if abs(g / l - t) <= 0.01 * t + 0.01 else 1)"
    done
    check "gsm8k: one JSON line per run appended" python3 -c "
import json, sys
rows = [json.loads(l) for l in open('$tmp/gsm8k.jsonl')]
ok = len(rows) == 2 and [r['backend'] for r in rows] == ['sglang', 'openai']
ok = ok and all(r['task'] == 'gsm8k' and r['num_requests'] == 20 and r['failed'] == 0 for r in rows)
sys.exit(0 if ok else 1)"
else
    echo "SKIP gsm8k part: $gsm8k_data not found (the public GSM8K test.jsonl; see README.md, Benchmarks)"
fi

# ---- serving ----
labels=("Backend:" "Traffic request rate:" "Max request concurrency:" "Successful requests:"
    "Failed requests:" "Benchmark duration (s):" "Total input tokens:" "Total generated tokens:"
    "Request throughput (req/s):" "Input token throughput (tok/s):"
    "Output token throughput (tok/s):" "Total token throughput (tok/s):" "Concurrency:"
    "Mean E2E Latency (ms):" "Median E2E Latency (ms):" "P90 E2E Latency (ms):"
    "P99 E2E Latency (ms):" "Mean TTFT (ms):" "Median TTFT (ms):" "P90 TTFT (ms):"
    "P99 TTFT (ms):" "Mean TPOT (ms):" "Median TPOT (ms):" "P90 TPOT (ms):" "P99 TPOT (ms):"
    "Mean ITL (ms):" "Median ITL (ms):" "P90 ITL (ms):" "P99 ITL (ms):"
    "Serving Benchmark Result" "Time per Output Token (excl. 1st token)")
run=0
serving() { # $1 = backend, $2 = dataset, the rest = more flags
    local backend=$1 dataset=$2
    shift 2
    run=$((run + 1))
    local out=$tmp/serving.$run what="serving $backend $dataset${*:+ $*}"
    local before after rc missing l
    before=($(counters))
    timeout -k 5 "$limit" "$bench" serving "${urls[@]}" --backend "$backend" --dataset "$dataset" \
        --num-prompts 50 --random-input-len 64 --random-output-len 32 --random-range-ratio 0.5 \
        --vocab-size 2048 --warmup-requests 0 --output-file "$tmp/serving.jsonl" "$@" \
        >"$out" 2>&1
    rc=$?
    after=($(counters))
    check "$what: exits 0 (exit $rc)" [ "$rc" -eq 0 ]
    check "$what: 50 successful requests" [ "$(value "Successful requests:" "$out")" = 50 ]
    check "$what: no failed request" [ "$(value "Failed requests:" "$out")" = 0 ]
    missing=
    for l in "${labels[@]}"; do grep -qF -- "$l" "$out" || missing="$missing '$l'"; done
    check "$what: every label of the result block${missing:+ (missing:$missing)}" [ -z "$missing" ]
    local in_srv=$(( (after[0] - before[0]) + (after[3] - before[3]) ))
    local out_srv=$(( (after[1] - before[1]) + (after[4] - before[4]) ))
    local in_cli out_cli
    in_cli=$(value "Total input tokens:" "$out")
    out_cli=$(value "Total generated tokens:" "$out")
    check "$what: total input tokens $in_cli = /metrics prompt tokens over both ranks $in_srv" \
        [ "$in_cli" = "$in_srv" ]
    check "$what: total generated tokens $out_cli = /metrics generation tokens over both ranks $out_srv" \
        [ "$out_cli" = "$out_srv" ]
    check "$what: both ranks served (${before[2]}->${after[2]}, ${before[5]}->${after[5]})" \
        [ "${after[2]}" -gt "${before[2]}" -a "${after[5]}" -gt "${before[5]}" ]
    check "$what: JSON line with the same totals" python3 -c "
import json, sys
r = [json.loads(l) for l in open('$tmp/serving.jsonl')][-1]
ok = r['backend'] == '$backend' and r['completed'] == 50 and r['failed'] == 0
ok = ok and r['total_input_tokens'] == $in_cli and r['total_output_tokens'] == $out_cli
sys.exit(0 if ok else 1)"
}
serving sglang random
serving openai random
serving openai-chat random
serving sglang random-ids --request-rate 200 --max-concurrency 8
check "serving: a rate and a concurrency limit are printed" \
    grep -q "^Traffic request rate: *200.0 *$" "$tmp/serving.$run"
check "serving: random-ids input tokens are the planned ones" \
    [ "$(value "Total input tokens:" "$tmp/serving.$run")" = "$(value "#Input tokens:" "$tmp/serving.$run")" ]

# ---- failures ----
"$bench" serving "${urls[@]}" --backend sglang --dataset random-ids --vocab-size 2048 \
    --num-prompts 5 --random-input-len 600 --random-range-ratio 1 --random-output-len 4 \
    --warmup-requests 0 >"$tmp/fail.1" 2>&1
rc=$?
check "serving: prompts over the context fail: counted, exit 1 (exit $rc)" \
    [ "$rc" -eq 1 -a "$(value "Failed requests:" "$tmp/fail.1")" = 5 ]
check "serving: the first error is printed" grep -q "^First error: HTTP 400" "$tmp/fail.1"
"$bench" serving --url "http://127.0.0.1:$((port + 2))" --num-prompts 3 --random-input-len 8 \
    --random-output-len 4 --warmup-requests 0 >"$tmp/fail.2" 2>&1
rc=$?
check "serving: no server: 3 failed, exit 1 (exit $rc)" \
    [ "$rc" -eq 1 -a "$(value "Failed requests:" "$tmp/fail.2")" = 3 ]
"$bench" serving --url "http://127.0.0.1:$((port + 2))" --num-prompts 3 --random-input-len 8 \
    --random-output-len 4 >"$tmp/fail.3" 2>&1
rc=$?
check "serving: a failed warm-up stops the run (exit $rc)" \
    grep -q "warm-up failed" "$tmp/fail.3"

# ---- progress bar on a terminal ----
if command -v script >/dev/null; then
    script -qec "$bench serving --url http://127.0.0.1:$port --num-prompts 4 --random-input-len 8 --random-output-len 4 --warmup-requests 0" \
        /dev/null >"$tmp/tty" 2>&1 </dev/null
    check "serving: a progress bar when stderr is a terminal" grep -q "serving \[#" "$tmp/tty"
    check "serving: no progress bar when stderr is not a terminal" \
        bash -c "! grep -q 'serving \[' '$tmp/serving.1'"
else
    echo "SKIP progress bar: script(1) not found"
fi

echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
