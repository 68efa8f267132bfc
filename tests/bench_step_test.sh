#!/usr/bin/env bash
# build/bench_step on the CPU with the tiny test checkpoint:
#   - batches whose prompts take several prefill steps (context 64, steps of 64 tokens): every
#     timed step runs the whole batch (bench_step stops with an error when one runs fewer tokens),
#     and each batch's row is printed;
#   - --routing random runs, and says so; --routing with another value is refused with a message;
#   - --kv-cache-dtype bfloat16 runs the same batches; the header names the cache's type (auto:
#     float32 on the CPU).
# Last line: "N passed, M failed".
set -u
cd "$(dirname "$0")/.."
bin=${BUILD:-build}/bench_step
model=tests/data/tiny-qwen3-moe
pass=0
fail=0
ok() { echo "ok $*"; pass=$((pass + 1)); }
bad() { echo "FAIL $*"; fail=$((fail + 1)); }
if [ ! -x "$bin" ]; then
    echo "FAIL bench_step_test.sh: $bin is not built (make)"
    echo "0 passed, 1 failed"
    exit 1
fi
tmp=$(mktemp -d "${TMPDIR:-/tmp}/bench-step-test.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

run() { # $1 = log name; the rest: extra flags
    local log=$tmp/$1
    shift
    timeout 300 "$bin" --model-path "$model" --device cpu --batches 1,8,16 --context 64 --steps 4 \
        --chunk 64 --prefill-prompts 1 --prefill-len 16 "$@" >"$log" 2>&1
}
for routing in model random; do
    if run "$routing" --routing "$routing"; then
        ok "routing $routing: every timed step ran its whole batch (prompts over 16 prefill steps)"
    else
        bad "routing $routing: exit $? ($(tail -n 1 "$tmp/$routing"))"
    fi
    for b in 1 8 16; do
        if grep -Eq "^ +$b +[0-9.]+ +[0-9.]+ +[0-9]+" "$tmp/$routing"; then
            ok "routing $routing: batch $b's row"
        else
            bad "routing $routing: no row for batch $b"
        fi
    done
done
if run bf16 --kv-cache-dtype bfloat16 && grep -Eq "^ +16 +[0-9.]+ +[0-9.]+ +[0-9]+" "$tmp/bf16"; then
    ok "--kv-cache-dtype bfloat16: every batch's row"
else
    bad "--kv-cache-dtype bfloat16: $(tail -n 1 "$tmp/bf16")"
fi
if grep -q "kv cache bfloat16," "$tmp/bf16" && grep -q "kv cache float32," "$tmp/model"; then
    ok "the header names the cache's type (bfloat16 asked, float32 by default on the CPU)"
else
    bad "the header's cache type: $(grep -ho 'kv cache [a-z0-9]*' "$tmp/bf16" "$tmp/model" | tr '\n' ' ')"
fi
if grep -q "uniformly drawn experts" "$tmp/random"; then
    ok "--routing random says so"
else
    bad "--routing random does not say so"
fi
if "$bin" --model-path "$model" --routing sometimes >"$tmp/bad" 2>&1; then
    bad "--routing sometimes was accepted"
elif grep -q "routing must be model or random" "$tmp/bad"; then
    ok "--routing sometimes refused with a message"
else
    bad "--routing sometimes: no message ($(head -n 1 "$tmp/bad"))"
fi
echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
