#!/usr/bin/env bash
# Two builds timed side by side in one call of the GPU machine: every command of a plan runs on
# build A and on build B, alternating (A B in odd rounds, B A in even ones) so that a drift of the
# clocks or of the machine's load falls on both. Build them here with scripts/gpu_pack.sh (OLD=REV
# packs a second build, of another commit, beside the working tree's).
#   A=build/gpu/old B=build/gpu ROUNDS=2 OUT=/tmp/ab bash scripts/gpu_ab.sh [PLAN]
# PLAN (default scripts/gpu_ab.plan): one command a line, `NAME | REGEX | COMMAND` (the fields
# split at " | ", spaces around the bar), where COMMAND names the build's directory as $BIN
# (`$BIN/bench_step ...`, `$BIN/tests/test_cuda_moe ...`) and REGEX (extended; the medians read
# it with Python's re, so keep to what both take) picks the lines of its output that the
# summary shows; `#` starts a comment. Each run's output is kept in
# $OUT/NAME.LABEL.ROUND.txt (LABEL: the last part of A's and B's paths, or "a" and "b" where
# those are equal). The summary prints, for each command, its picked lines from every run (a
# run that failed says so, with its exit status), then each picked line with its numbers'
# medians over the rounds, A's above B's.
# ONLY=REGEX runs the plan's lines whose name matches; TIMEOUT (300) caps each run in seconds.
set -u
cd "$(dirname "$0")/.." || exit 2
plan=${1:-scripts/gpu_ab.plan}
a=${A:-build/gpu/old}
b=${B:-build/gpu}
rounds=${ROUNDS:-2}
out=${OUT:-/tmp/gpu-ab}
only=${ONLY:-.}
limit=${TIMEOUT:-300}
export NCCL_NVLS_ENABLE=0
for d in "$a" "$b"; do
    [ -d "$d" ] || { echo "gpu_ab: no build at $d (scripts/gpu_pack.sh makes one)" >&2; exit 2; }
done
[ -f "$plan" ] || { echo "gpu_ab: no plan $plan" >&2; exit 2; }
la=$(basename "$a")
lb=$(basename "$b")
[ "$la" != "$lb" ] || { la=a; lb=b; }
mkdir -p "$out"

names=() regexes=() commands=()
while IFS= read -r line; do
    line=${line%%#*}
    [[ "$line" =~ [^[:space:]] ]] || continue
    # split at the first two " | " (a regex may hold "|" without spaces, a command anything)
    name=${line%% | *} rest=${line#* | }
    regex=${rest%% | *} command=${rest#* | }
    name=$(echo "$name" | xargs)
    regex=$(echo "$regex" | sed 's/^ *//; s/ *$//')
    if [[ "$line" != *" | "*" | "* ]] || [ -z "$name" ] || [ -z "$regex" ] ||
        [ -z "${command// /}" ]; then
        echo "gpu_ab: $plan: a line needs NAME | REGEX | COMMAND: $line" >&2
        exit 2
    fi
    [[ "$name" =~ $only ]] || continue
    names+=("$name") regexes+=("$regex") commands+=("$command")
done <"$plan"
[ ${#names[@]} -gt 0 ] || { echo "gpu_ab: no command of $plan matches ONLY=$only" >&2; exit 2; }

command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
echo "A = $a ($la), B = $b ($lb), $rounds rounds, logs in $out"

# run_one INDEX DIR LABEL ROUND: one command on one build, its output in its log
run_one() {
    local i=$1 dir=$2 label=$3 r=$4
    local log="$out/${names[$i]}.$label.$r.txt"
    (export BIN=$dir LD_LIBRARY_PATH=$dir/gpu-libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
     timeout "$limit" bash -c "${commands[$i]}") >"$log" 2>&1
    local rc=$?
    [ "$rc" -eq 0 ] || echo "gpu_ab: exit status $rc" >>"$log"
}

t0=$(date +%s)
for ((r = 1; r <= rounds; r++)); do
    for i in "${!names[@]}"; do
        if ((r % 2)); then
            run_one "$i" "$a" "$la" "$r"
            run_one "$i" "$b" "$lb" "$r"
        else
            run_one "$i" "$b" "$lb" "$r"
            run_one "$i" "$a" "$la" "$r"
        fi
    done
    echo "round $r done at $(($(date +%s) - t0)) s"
done

for i in "${!names[@]}"; do
    echo
    echo "== ${names[$i]}: ${commands[$i]}"
    for ((r = 1; r <= rounds; r++)); do
        for label in "$la" "$lb"; do
            log="$out/${names[$i]}.$label.$r.txt"
            grep -E -- "${regexes[$i]}|^gpu_ab: exit status" "$log" | sed "s/^/$label $r: /"
        done
    done
    # The picked lines' numbers, median over the rounds, A's line above B's: the k-th picked
    # line of one run against the k-th of every other run, where they have as many numbers.
    python3 - "$out" "${names[$i]}" "$la" "$lb" "$rounds" "${regexes[$i]}" <<'PY'
import re, statistics, sys
out, name, la, lb, rounds, regex = sys.argv[1:7]
num = re.compile(r"-?[0-9]+(?:\.[0-9]+)?(?:e[-+]?[0-9]+)?")
def picked(label, r):
    try:
        with open(f"{out}/{name}.{label}.{r}.txt") as f:
            return [l.rstrip("\n") for l in f if re.search(regex, l)]
    except OSError:
        return []
runs = {lab: [picked(lab, r) for r in range(1, int(rounds) + 1)] for lab in (la, lb)}
n = min(len(p) for ps in runs.values() for p in ps)
if n == 0:
    sys.exit(0)
print(f"median of {rounds} rounds:")
for k in range(n):
    for lab in (la, lb):
        lines = [p[k] for p in runs[lab]]
        vals = [num.findall(l) for l in lines]
        if any(len(v) != len(vals[0]) for v in vals):
            print(f"{lab} med: (rounds differ) {lines[0]}")
            continue
        med = iter(f"{statistics.median(float(x) for x in col):g}" for col in zip(*vals))
        print(f"{lab} med: " + num.sub(lambda m: next(med), lines[0]))
PY
done
