#!/usr/bin/env bash
# SGLang's own bench_serving (PyPI package sglang) against a running moeserve, next to
# build/moeserve-bench serving with the same settings, and their token counts compared. Run by
# hand where PyPI is reachable:
#
#   scripts/bench_sglang_peer.sh --url http://127.0.0.1:30000 [--url http://127.0.0.1:30001 ...]
#   scripts/bench_sglang_peer.sh --start-np 2     # serve tests/data/tiny-qwen3-moe here first
#
# Pairs run (SGLang backend <-> moeserve-bench backend): sglang <-> sglang (POST /generate) and
# sglang-oai <-> openai (POST /v1/completions). Settings shared by both clients: dataset
# random-ids, --num-prompts, --random-input-len, --random-output-len, --random-range-ratio 1 (so
# every prompt has exactly the input length and every answer, with ignore_eos, the output length,
# whatever numbers each client's random generator draws), no warm-up. SGLang's sglang backend gets
# --tokenize-prompt (input_ids, as moeserve-bench sends); its sglang-oai backend sends the ids
# decoded to text, which the server tokenizes again, so there the server's prompt count may
# differ from the one SGLang claims; the table shows both.
# For each run the table gives what the client printed (successful requests, input tokens,
# generated tokens) and the growth of the server's /metrics token counters over all --url
# (needs `moeserve serve --enable-metrics`). Exit status 0 when the clients agree with each other
# on every count and moeserve-bench agrees with /metrics, 1 otherwise.
#
# SGLang is installed with pip into a virtual environment (--venv, default
# ~/.cache/moeserve/sglang-venv, made with --system-site-packages so that an installed torch is
# reused) unless `python3 -m sglang.benchmark.serving` already works there. bench_serving loads
# the model's tokenizer with transformers: --tokenizer DIR, by default the tokenizer_path that
# GET /get_model_info reports.
set -u
cd "$(dirname "$0")/.."

urls=()
num_prompts=200
input_len=128
output_len=64
seed=1
request_rate=inf
max_concurrency=
one_url=0
tokenizer=
venv=${SGLANG_VENV:-$HOME/.cache/moeserve/sglang-venv}
start_np=0
model=tests/data/tiny-qwen3-moe
port=30000
bench=${BUILD:-build}/moeserve-bench

usage() {
    sed -n '2,/^set -u/p' "$0" | sed -e '/^set -u/d' -e 's/^# \{0,1\}//'
    cat <<EOF
Flags:
  --url URL             a rank of the running server (repeat once per rank); SGLang's client
                        talks to the first, moeserve-bench to all of them
  --num-prompts N       requests per run (default $num_prompts)
  --input-len L         prompt tokens per request (default $input_len)
  --output-len L        output tokens per request (default $output_len)
  --seed S              seed of both clients (default $seed)
  --request-rate R      requests per second of both clients (default $request_rate)
  --max-concurrency C   requests running at once at most, both clients (default no limit)
  --one-url             moeserve-bench also sends every request to the first --url, as SGLang's
                        client does (timings then compare like for like); /metrics is still
                        read from every --url
  --tokenizer DIR       tokenizer folder for bench_serving (default: /get_model_info's)
  --venv DIR            virtual environment for the sglang package (default $venv)
  --start-np N          start \`mpirun -np N moeserve serve --model-path $model\` on ports
                        $port.. first (with --enable-metrics), stop it at the end
  --model-path DIR      the model of --start-np (default $model)
  --port P              the first port of --start-np (default $port)
  --help                this text
EOF
}

while [ $# -gt 0 ]; do
    case "$1" in
    --url) urls+=("${2%/}"); shift 2 ;;
    --num-prompts) num_prompts=$2; shift 2 ;;
    --input-len) input_len=$2; shift 2 ;;
    --output-len) output_len=$2; shift 2 ;;
    --seed) seed=$2; shift 2 ;;
    --request-rate) request_rate=$2; shift 2 ;;
    --max-concurrency) max_concurrency=$2; shift 2 ;;
    --one-url) one_url=1; shift ;;
    --tokenizer) tokenizer=$2; shift 2 ;;
    --venv) venv=$2; shift 2 ;;
    --start-np) start_np=$2; shift 2 ;;
    --model-path) model=$2; shift 2 ;;
    --port) port=$2; shift 2 ;;
    --help | -h) usage; exit 0 ;;
    *) echo "bench_sglang_peer.sh: unknown flag '$1' (--help lists them)" >&2; exit 2 ;;
    esac
done

[ -x "$bench" ] || make --no-print-directory "$bench" || exit 1
tmp=$(mktemp -d "${TMPDIR:-/tmp}/moeserve-sglang-peer.XXXXXX")
group=
cleanup() {
    if [ -n "$group" ]; then
        kill -TERM -- "-$group" 2>/dev/null
        for _ in $(seq 100); do kill -0 -- "-$group" 2>/dev/null || break; sleep 0.1; done
        kill -KILL -- "-$group" 2>/dev/null
        wait "$group" 2>/dev/null
    fi
    rm -rf "$tmp"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

if [ "$start_np" -gt 0 ]; then
    [ -x build/moeserve ] || make --no-print-directory build/moeserve || exit 1
    setsid mpirun --allow-run-as-root --oversubscribe --mca mpi_yield_when_idle 1 -np "$start_np" \
        build/moeserve serve --model-path "$model" --port "$port" --enable-metrics \
        >"$tmp/server.log" 2>&1 &
    group=$!
    urls=()
    for r in $(seq 0 $((start_np - 1))); do urls+=("http://127.0.0.1:$((port + r))"); done
fi
[ ${#urls[@]} -gt 0 ] || urls=("http://127.0.0.1:30000")
for u in "${urls[@]}"; do
    for _ in $(seq 600); do
        curl -sf "$u/health" >/dev/null 2>&1 && break
        sleep 0.1
    done
    curl -sf "$u/health" >/dev/null 2>&1 || {
        echo "bench_sglang_peer.sh: $u/health does not answer" >&2
        [ -n "$group" ] && tail -n 20 "$tmp/server.log" >&2
        exit 1
    }
done

# ---- SGLang's client ----
py=$venv/bin/python3
sgl_module() { "$py" - <<'EOF' 2>/dev/null
import importlib.util
for m in ("sglang.benchmark.serving", "sglang.bench_serving"):
    if importlib.util.find_spec(m.rsplit(".", 1)[0]) and importlib.util.find_spec(m):
        print(m); break
EOF
}
if [ ! -x "$py" ]; then
    echo "making $venv (python3 -m venv --system-site-packages)"
    python3 -m venv --system-site-packages "$venv" || exit 1
fi
module=$(sgl_module)
if [ -z "$module" ]; then
    echo "installing sglang into $venv (pip install sglang; it brings its own torch)"
    "$venv/bin/pip" install -q sglang || { echo "bench_sglang_peer.sh: pip install sglang failed" >&2; exit 1; }
    module=$(sgl_module)
fi
[ -n "$module" ] || { echo "bench_sglang_peer.sh: no sglang bench_serving module in $venv" >&2; exit 1; }
echo "SGLang: $("$py" -c 'import importlib.metadata as m; print(m.version("sglang"))') ($module)"

if [ -z "$tokenizer" ]; then
    tokenizer=$(curl -s "${urls[0]}/get_model_info" | python3 -c 'import json,sys; print(json.load(sys.stdin).get("tokenizer_path") or "")')
fi
[ -n "$tokenizer" ] || { echo "bench_sglang_peer.sh: no tokenizer path (give --tokenizer DIR)" >&2; exit 1; }
vocab=$("$py" -c "from transformers import AutoTokenizer; print(AutoTokenizer.from_pretrained('$tokenizer').vocab_size)") ||
    { echo "bench_sglang_peer.sh: transformers cannot load the tokenizer $tokenizer" >&2; exit 1; }
echo "tokenizer: $tokenizer (vocab_size $vocab); ${#urls[@]} URL(s): ${urls[*]}"

# sum of a counter over every URL (empty when /metrics is off)
metrics_sum() { # $1 = metric name
    local u s=0 v
    for u in "${urls[@]}"; do
        v=$(curl -sf "$u/metrics" | awk -v n="$1" '$1 ~ "^"n"[{]" {s += $2; f = 1} END {if (f) printf "%d\n", s}')
        [ -n "$v" ] || { echo ""; return; }
        s=$((s + v))
    done
    echo "$s"
}

common=(--num-prompts "$num_prompts" --random-input-len "$input_len" --random-output-len "$output_len"
    --random-range-ratio 1 --seed "$seed" --warmup-requests 0 --request-rate "$request_rate"
    ${max_concurrency:+--max-concurrency "$max_concurrency"})
rows=()
times=()
status=0
run() { # $1 = label, $2 = JSON output file, the rest = the command
    local label=$1 json=$2
    shift 2
    local p0 g0 p1 g1
    p0=$(metrics_sum moeserve:prompt_tokens_total)
    g0=$(metrics_sum moeserve:generation_tokens_total)
    echo "== $label"
    "$@" 2>&1 | tee "$tmp/$label.log" | grep -E "^(Successful|Failed|Total input|Total generated|Mean TTFT|Mean TPOT|Mean ITL|Output token throughput|First error)"
    p1=$(metrics_sum moeserve:prompt_tokens_total)
    g1=$(metrics_sum moeserve:generation_tokens_total)
    local line timing
    line=$(tail -n 1 "$json" 2>/dev/null | python3 -c '
import json, sys
r = json.loads(sys.stdin.read())
print(r.get("completed"), r.get("total_input_tokens"), r.get("total_output_tokens"))' 2>/dev/null)
    [ -n "$line" ] || line="- - -"
    timing=$(tail -n 1 "$json" 2>/dev/null | python3 -c '
import json, sys
r = json.loads(sys.stdin.read())
k = ["duration", "output_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
     "mean_tpot_ms", "median_itl_ms", "p99_itl_ms", "mean_e2e_latency_ms"]
print(" ".join("%.2f" % r[x] if isinstance(r.get(x), (int, float)) else "-" for x in k))' 2>/dev/null)
    [ -n "$timing" ] || timing="- - - - - - - - -"
    times+=("$label $timing")
    if [ -n "$p0" ] && [ -n "$p1" ]; then
        rows+=("$label $line $((p1 - p0)) $((g1 - g0))")
    else
        rows+=("$label $line - -")
    fi
}

sglang_run() { # $1 = SGLang backend, the rest = more flags
    local b=$1
    shift
    run "sglang:$b" "$tmp/sglang-$b.jsonl" "$py" -m "$module" --backend "$b" --base-url "${urls[0]}" \
        --dataset-name random-ids --tokenizer "$tokenizer" "${common[@]}" --disable-tqdm \
        --output-file "$tmp/sglang-$b.jsonl" "$@"
}
ours_run() { # $1 = moeserve-bench backend
    local b=$1 u args=()
    for u in "${urls[@]}"; do args+=(--url "$u"); done
    [ "$one_url" = 1 ] && args=(--url "${urls[0]}")
    run "moeserve-bench:$b" "$tmp/ours-$b.jsonl" "$bench" serving "${args[@]}" --backend "$b" \
        --dataset random-ids --vocab-size "$vocab" "${common[@]}" --disable-progress \
        --output-file "$tmp/ours-$b.jsonl"
}

sglang_run sglang --tokenize-prompt
ours_run sglang
sglang_run sglang-oai
ours_run openai

echo
printf '%-26s %10s %13s %13s %15s %15s\n' run successful "input tok" "output tok" "/metrics input" "/metrics output"
for r in "${rows[@]}"; do
    # shellcheck disable=SC2086
    printf '%-26s %10s %13s %13s %15s %15s\n' $r
done
echo
printf '%-26s %9s %9s %9s %9s %9s %9s %9s %9s %9s\n' run "dur s" "out tok/s" "mean TTFT" \
    "med TTFT" "P99 TTFT" "mean TPOT" "med ITL" "P99 ITL" "mean E2E"
for r in "${times[@]}"; do
    # shellcheck disable=SC2086
    printf '%-26s %9s %9s %9s %9s %9s %9s %9s %9s %9s\n' $r
done
echo "(milliseconds but for the duration and the throughput)"
echo

# the checks: each pair agrees; moeserve-bench agrees with /metrics; SGLang's output tokens too
field() { echo "${rows[$1]}" | awk -v k="$2" '{print $k}'; }
compare() { # $1 = what, $2 = a, $3 = b
    if [ "$2" = "$3" ] && [ "$2" != - ]; then
        echo "same: $1 ($2)"
    else
        echo "DIFFERENT: $1 ($2 vs $3)"
        status=1
    fi
}
for pair in "0 1" "2 3"; do
    set -- $pair
    a=$1 b=$2
    name="$(field "$a" 1) vs $(field "$b" 1)"
    compare "$name: successful requests" "$(field "$a" 2)" "$(field "$b" 2)"
    compare "$name: total input tokens" "$(field "$a" 3)" "$(field "$b" 3)"
    compare "$name: total generated tokens" "$(field "$a" 4)" "$(field "$b" 4)"
    compare "$(field "$b" 1): input tokens vs /metrics" "$(field "$b" 3)" "$(field "$b" 5)"
    compare "$(field "$b" 1): generated tokens vs /metrics" "$(field "$b" 4)" "$(field "$b" 6)"
    compare "$(field "$a" 1): generated tokens vs /metrics" "$(field "$a" 4)" "$(field "$a" 6)"
done
compare "sglang:sglang (input_ids): input tokens vs /metrics" "$(field 0 3)" "$(field 0 5)"
echo "(sglang:sglang-oai sends text: its claimed input tokens $(field 2 3), the server counted $(field 2 5))"
exit $status
