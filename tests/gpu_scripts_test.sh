#!/usr/bin/env bash
# The GPU machine's scripts, run here on the CPU so that they work when a GPU call runs them:
#   - scripts/gpu_ab.sh: a plan of two commands (bench_step on the tiny test checkpoint, and one
#     that fails) on two build folders, two rounds: each run's picked lines, the failing run's
#     exit status, and the medians of A and B;
#   - scripts/gpu_scale.sh with DEVICE=cpu (its dry run): the test checkpoint on 4 CPU ranks
#     against one process in deterministic mode, bit for bit, and serving on 1 and 4 ranks with
#     a row of output tokens/s for each.
# Last line: "N passed, M failed".
set -u
cd "$(dirname "$0")/.." || exit 1
b=${BUILD:-build}
pass=0
fail=0
ok() { echo "ok $*"; pass=$((pass + 1)); }
bad() { echo "FAIL $*"; fail=$((fail + 1)); }
for f in "$b/bench_step" "$b/moeserve" "$b/moeserve-bench"; do
    if [ ! -x "$f" ]; then
        echo "FAIL gpu_scripts_test.sh: $f is not built (make)"
        echo "0 passed, 1 failed"
        exit 1
    fi
done
tmp=$(mktemp -d "${TMPDIR:-/tmp}/gpu-scripts-test.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

# gpu_ab.sh: two "builds" (folders holding the same bench_step), labelled by their names
mkdir -p "$tmp/old" "$tmp/new"
for d in old new; do ln -s "$PWD/$b/bench_step" "$tmp/$d/bench_step"; done
cat >"$tmp/plan" <<'EOF'
# a comment, then two commands
step | ^ +[0-9]+ +[0-9.]+ +[0-9.]+ +[0-9]+|^never picked | $BIN/bench_step --model-path tests/data/tiny-qwen3-moe --device cpu --context 32 --steps 2 --prefill-prompts 1 --prefill-len 8 --batches 1,2
gone | ^never | $BIN/not_built
EOF
A=$tmp/old B=$tmp/new ROUNDS=2 OUT=$tmp/ab timeout 300 bash scripts/gpu_ab.sh "$tmp/plan" \
    >"$tmp/ab.txt" 2>&1
rc=$?
[ "$rc" -eq 0 ] && ok "gpu_ab.sh: exit 0" || bad "gpu_ab.sh: exit $rc ($(tail -n 1 "$tmp/ab.txt"))"
n=$(grep -Ec '^(old|new) [12]: +[12] +[0-9.]+' "$tmp/ab.txt")
[ "$n" -eq 8 ] && ok "gpu_ab.sh: batches 1 and 2 of both builds in both rounds" ||
    bad "gpu_ab.sh: $n of 8 picked lines"
n=$(grep -Ec '^(old|new) [12]: gpu_ab: exit status 127' "$tmp/ab.txt")
[ "$n" -eq 4 ] && ok "gpu_ab.sh: the failing command's exit status, each run" ||
    bad "gpu_ab.sh: $n of 4 failed runs named"
n=$(grep -Ec '^(old|new) med: +[12] +[0-9.]+' "$tmp/ab.txt")
[ "$n" -eq 4 ] && ok "gpu_ab.sh: medians of both builds for batches 1 and 2" ||
    bad "gpu_ab.sh: $n of 4 median lines"
ls "$tmp/ab/step.old.1.txt" "$tmp/ab/step.new.2.txt" >/dev/null 2>&1 &&
    ok "gpu_ab.sh: each run's log kept" || bad "gpu_ab.sh: the runs' logs are missing"
echo "two | fields only" >"$tmp/plan2"
A=$tmp/old B=$tmp/new OUT=$tmp/ab2 bash scripts/gpu_ab.sh "$tmp/plan2" >"$tmp/ab2.txt" 2>&1
rc=$?
[ "$rc" -eq 2 ] && grep -q "a line needs NAME | REGEX | COMMAND" "$tmp/ab2.txt" &&
    ok "gpu_ab.sh: a malformed plan line is refused, naming the format" ||
    bad "gpu_ab.sh: malformed plan: exit $rc, $(head -n 1 "$tmp/ab2.txt")"

# gpu_scale.sh's dry run on CPU ranks
NP=4 RANKS="1 4" DEVICE=cpu MODELS=tests/data/tiny-qwen3-moe FORMATS=bf16 CONC=4 ILEN=24 \
    OLEN=8 OUT=$tmp/scale timeout 600 bash scripts/gpu_scale.sh det serve >"$tmp/scale.txt" 2>&1
rc=$?
last=$(tail -n 1 "$tmp/scale.txt")
[ "$rc" -eq 0 ] && [[ "$last" =~ ^[1-9][0-9]*\ passed,\ 0\ failed$ ]] &&
    ok "gpu_scale.sh (CPU ranks): $last" || bad "gpu_scale.sh: exit $rc, $last"
grep -q "^ok   np 4 shm, deterministic: every round gives one GPU's logprobs bit for bit" \
    "$tmp/scale.txt" && ok "gpu_scale.sh: 4 ranks give one process's bits" ||
    bad "gpu_scale.sh: no bit-for-bit line for 4 ranks"
for n in 1 4; do
    grep -Eq "^tiny-qwen3-moe +bf16 +$n +4 +[0-9]+\.[0-9]+ +[0-9]+\.[0-9]+$" "$tmp/scale.txt" &&
        ok "gpu_scale.sh: serving tokens/s on $n rank(s)" ||
        bad "gpu_scale.sh: no serving row for $n rank(s)"
done
echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
