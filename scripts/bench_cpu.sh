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

# Bytes of weights one decode token reads: attention, router, K experts per MoE layer (or the
# dense MLP), final norm and lm_head; embeddings read one row.
active_bytes() {
    python3 - "$1" <<'PY'
import json, sys
c = json.load(open(sys.argv[1] + "/config.json"))
D, L, H = c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"]
Hkv, Dh = c.get("num_key_value_heads", H), c.get("head_dim", D // H)
E, K = c.get("num_experts", c.get("num_local_experts", 0)), c.get("num_experts_per_tok", 0)
step, dense = c.get("decoder_sparse_step", 1), set(c.get("mlp_only_layers", []))
n = 0
for i in range(L):
    n += D * Dh * (2 * H + 2 * Hkv) + 2 * D + 2 * Dh
    if E > 0 and i not in dense and (i + 1) % step == 0:
        n += E * D + K * 3 * D * c["moe_intermediate_size"]
    else:
        n += 3 * D * c["intermediate_size"]
n += D + c["vocab_size"] * D + D
print(2 * n)  # BF16
PY
}

"$(dirname "$0")/../build/bench_membw"
echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//'), $(nproc) cores, threads $THREADS"
for m in models/tiny-qwen3-moe "$BIG"; do
    t1=$(latency "$m" 1)
    tn=$(latency "$m" $((N + 1)))
    awk -v m="$m" -v n="$N" -v a="$t1" -v b="$tn" -v bytes="$(active_bytes "$m")" \
        'BEGIN { s = (b - a) / n; printf "%-30s decode %7.1f tok/s  %.2f ms/token  %.1f MB weights/token -> %.1f GB/s\n", m, 1 / s, 1000 * s, bytes / 1e6, bytes / s / 1e9 }'
done

# The peer, side by side: transformers on the same checkpoints, when PyTorch is installed.
if python3 -c "import torch, transformers" 2>/dev/null; then
    for m in models/tiny-qwen3-moe "$BIG"; do
        python3 scripts/bench_peer_transformers.py "$m" "$N" "$THREADS" 2>/dev/null
    done
else
    echo "transformers not installed: peer comparison skipped (pip install torch transformers)"
fi
