#!/usr/bin/env bash
# CPU decode speed of `moeserve generate`: tokens/s of decode alone, measured as
# (time of N+1 new tokens - time of 1 new token) / N, so prefill and load are excluded.
# Models: the embedded tiny model and a larger random one made by scripts/make_bench_model.py.
# Usage: scripts/bench_cpu.sh [N=128] [threads=all cores]
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-128}
THREADS=${2:-$(nproc)}
BIG=${BENCH_MODEL:-/tmp/moeserve-bench-model}
[ -f "$BIG/config.json" ] || python3 scripts/make_bench_model.py --out "$BIG" >/dev/null

latency() { # model, new tokens -> e2e_latency (best of 3)
    best=
    for _ in 1 2 3; do
        t=$(build/moeserve generate --model-path "$1" --input-ids 10,11,12,13,14,15,16,17 \
            --max-new-tokens "$2" --temperature 0 --ignore-eos --threads "$THREADS" |
            grep -o '"e2e_latency":[0-9.e+-]*' | cut -d: -f2)
        best=$(awk -v a="$t" -v b="$best" 'BEGIN { print (b == "" || a < b) ? a : b }')
    done
    echo "$best"
}

echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//'), $(nproc) cores, threads $THREADS"
for m in models/tiny-qwen3-moe "$BIG"; do
    t1=$(latency "$m" 1)
    tn=$(latency "$m" $((N + 1)))
    awk -v m="$m" -v n="$N" -v a="$t1" -v b="$tn" \
        'BEGIN { printf "%-34s decode %7.1f tok/s  (%.2f ms/token, %d tokens)\n", m, n / (b - a), 1000 * (b - a) / n, n }'
done
