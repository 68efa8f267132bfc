#!/usr/bin/env bash
# Serving throughput over HTTP on the GPU machine, in one command: `moeserve serve` on a model
# folder with dummy weights (--load-format dummy --skip-tokenizer-init, so config.json alone is
# enough), then `moeserve-bench serving` (random token ids, ignore_eos) at concurrency 1, 64 and
# 256. Run it from the repository root with the build carried there (build here: `make -j2 &&
# scripts/gpu_bundle.sh`).
#   scripts/gpu_serve_bench.sh [extra serve flags...]
# Environment: MODEL (default config/models/qwen3-30b-a3b), PORT (31000), ILEN / OLEN (prompt and
# output tokens per request, 512 / 128), CONC (the concurrencies, "1 64 256"), REQS (requests a
# run: REQS x the concurrency, 2; 8 at concurrency 1), LAUNCH (a prefix
# such as "mpirun -np 2" for several ranks; the bench then spreads requests over their ports),
# DEVICE (cuda; cpu runs the same on a machine without GPU), OUT (logs, /tmp/gpu-serve-bench).
# Each run prints the main lines of SGLang's "Serving Benchmark Result" block; the whole block is
# in OUT/bench-cC.txt.
set -u
cd "$(dirname "$0")/.." || exit 2
export LD_LIBRARY_PATH=${BUILD:-build}/gpu-libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export NCCL_NVLS_ENABLE=0
model=${MODEL:-config/models/qwen3-30b-a3b}
port=${PORT:-31000}
out=${OUT:-/tmp/gpu-serve-bench}
bin=${BUILD:-build}/moeserve
bench=${BUILD:-build}/moeserve-bench
mkdir -p "$out"
vocab=$(python3 -c "import json, sys; print(json.load(open(sys.argv[1]))['vocab_size'])" \
    "$model/config.json") || { echo "no vocab_size in $model/config.json"; exit 1; }
ranks=1
case "${LAUNCH:-}" in *"-np "*) ranks=$(sed -E 's/.*-np ([0-9]+).*/\1/' <<< "$LAUNCH") ;; esac

# shellcheck disable=SC2086
${LAUNCH:-} "$bin" serve --model-path "$model" --load-format dummy --skip-tokenizer-init \
    --device "${DEVICE:-cuda}" --port "$port" "$@" > "$out/serve.log" 2>&1 &
pid=$!
urls=()
for ((r = 0; r < ranks; r++)); do urls+=(--url "http://127.0.0.1:$((port + r))"); done
up=0
for _ in $(seq 600); do
    ok=1
    for ((r = 0; r < ranks; r++)); do
        curl -sf "http://127.0.0.1:$((port + r))/health" > /dev/null || ok=0
    done
    [ "$ok" = 1 ] && { up=1; break; }
    kill -0 "$pid" 2> /dev/null || break
    sleep 0.5
done
if [ "$up" != 1 ]; then
    echo "the server did not come up; log:"
    tail -n 20 "$out/serve.log"
    kill "$pid" 2> /dev/null
    exit 1
fi
grep -m 3 -E "loaded|KV" "$out/serve.log"
status=0
for c in ${CONC:-1 64 256}; do
    n=$((c == 1 ? 8 : ${REQS:-2} * c))
    echo "== concurrency $c, $n requests of ${ILEN:-512} + ${OLEN:-128} tokens"
    "$bench" serving "${urls[@]}" --backend sglang --dataset random-ids --vocab-size "$vocab" \
        --num-prompts "$n" --max-concurrency "$c" --random-input-len "${ILEN:-512}" \
        --random-output-len "${OLEN:-128}" --random-range-ratio 1 --warmup-requests 1 \
        --disable-progress 2>&1 | tee "$out/bench-c$c.txt" | grep -E \
        "Successful|Failed|Output token throughput|Mean TTFT|Median TTFT|Mean TPOT|Mean ITL" ||
        status=1
done
kill "$pid" 2> /dev/null
wait "$pid" 2> /dev/null
exit $status
