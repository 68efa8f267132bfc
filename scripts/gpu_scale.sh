#!/usr/bin/env bash
# The scale-out run (4 or 8 GPUs of one host: issue 11) in one command, ON that machine from the
# repository root with the build carried there (scripts/gpu_pack.sh here, then `tar xJf
# build/gpu.txz -C build` and BUILD=build/gpu there):
#   NP=8 scripts/gpu_scale.sh [PART...]      PART: a2a det serve (default: all three)
#   a2a    build/bench_a2a_cuda under mpirun -np NP, hidden 7168: one-sided against NCCL, every
#          payload, 1 to 8192 tokens a rank, top-8 of 256 experts, CUDA graphs
#   det    scripts/gpu_ep_compare.py --deterministic --graphs 32 at each rank count of RANKS
#          past 1: the test checkpoint on N GPUs against one, every round bit for bit (so 1, 2,
#          4 and 8 ranks give the same bits)
#   serve  scripts/gpu_serve_bench.sh (moeserve-bench serving, random ids, ILEN + OLEN tokens a
#          request, REQS x concurrency requests) for each model of MODELS, format of FORMATS and
#          rank count of RANKS, at each concurrency of CONC; a table of output tokens/s, in all
#          and per GPU, at the end
# Environment: NP (ranks of the a2a and det parts and the largest of RANKS; default: the GPUs
# nvidia-smi lists), RANKS (1, 2, 4 and 8 up to NP, and NP), MODELS (config/models/qwen3-30b-a3b and
# config/models/deepseek-v3-moe-shape), FORMATS ("bf16 fp8 nvfp4"), CONC ("64 256 1024"), ILEN
# and OLEN (1000 and 1000), REQS (2), COMBINE (the serve part's --moe-a2a-combine on several
# ranks; unset: the server's default, partial on GPUs), OUT (/tmp/gpu-scale), DEVICE (cuda; `DEVICE=cpu` runs
# the det and serve parts with CPU ranks, oversubscribed, on a machine without GPU: a dry run
# of this script, with small MODELS, CONC and lengths and FORMATS=bf16, since dummy quantized
# experts are made on a GPU only). The last line is "N passed, M failed" over the a2a run, the
# det part's checks and the serving runs.
# A whole run takes longer than one call of the GPU machine may (10 minutes): split it by PART
# and by the lists, e.g. `NP=8 scripts/gpu_scale.sh a2a det`, then `RANKS=8 MODELS=... FORMATS=bf16
# REQS=1 scripts/gpu_scale.sh serve` a call; one and two GPUs' serving can come from the smaller
# kinds (`RANKS="1 2"`).
set -u
cd "$(dirname "$0")/.." || exit 2
b=${BUILD:-build}
export LD_LIBRARY_PATH=$b/gpu-libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export NCCL_NVLS_ENABLE=0
device=${DEVICE:-cuda}
np=${NP:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')}
[ "${np:-0}" -ge 1 ] || { echo "gpu_scale: no GPU listed; set NP" >&2; exit 2; }
ranks=${RANKS:-$(for n in 1 2 4 8 "$np"; do [ "$n" -le "$np" ] && echo "$n"; done | sort -nu | tr '\n' ' ')}
models=${MODELS:-config/models/qwen3-30b-a3b config/models/deepseek-v3-moe-shape}
formats=${FORMATS:-bf16 fp8 nvfp4}
conc=${CONC:-64 256 1024}
out=${OUT:-/tmp/gpu-scale}
parts=" ${*:-a2a det serve} "
mkdir -p "$out"
mpi=(mpirun --allow-run-as-root -x NCCL_NVLS_ENABLE -x LD_LIBRARY_PATH)
serve_flags=(--moe-a2a-backend nvlink_one_sided --cuda-graph-max-bs 256)
if [ "$device" = cpu ]; then
    mpi+=(--oversubscribe --mca mpi_yield_when_idle 1)
    serve_flags=()
fi
[ -n "${COMBINE:-}" ] && serve_flags+=(--moe-a2a-combine "$COMBINE")
pass=0
fail=0
result() { # NAME OK: one check or run into the totals
    if [ "$2" = 1 ]; then pass=$((pass + 1)); else fail=$((fail + 1)) && echo "FAIL $1"; fi
}
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=index,name,clocks.max.sm --format=csv,noheader
echo "NP $np, ranks [$ranks], device $device, logs in $out"

if [[ "$parts" == *" a2a "* ]]; then
    echo "== a2a: bench_a2a_cuda, $np ranks, hidden 7168"
    timeout 1200 "${mpi[@]}" -np "$np" "$b/bench_a2a_cuda" --hidden 7168 > "$out/a2a.txt" 2>&1
    rc=$?
    result "a2a (exit $rc, $out/a2a.txt)" $((rc == 0))
    grep -E "ranks|link ceiling|^D=|^ +[0-9]+ \|" "$out/a2a.txt"
fi

if [[ "$parts" == *" det "* ]]; then
    for n in $ranks; do
        [ "$n" -gt 1 ] || continue
        echo "== det: the test checkpoint on $n ranks against one, deterministic, bit for bit"
        flags=(--np "$n" --deterministic)
        if [ "$device" = cpu ]; then flags+=(--device cpu); else flags+=(--graphs 32 --backends nvlink_one_sided); fi
        OUT=$out/det-$n timeout 900 python3 scripts/gpu_ep_compare.py "${flags[@]}" \
            > "$out/det-$n.txt" 2>&1
        grep -E '^FAIL|bit for bit' "$out/det-$n.txt"
        line=$(grep -E '^[0-9]+ passed, [0-9]+ failed$' "$out/det-$n.txt" | tail -n 1)
        if [ -z "$line" ]; then
            result "det $n: no summary ($out/det-$n.txt)" 0
        else
            pass=$((pass + ${line%% passed*}))
            f=${line#*, }
            fail=$((fail + ${f%% failed*}))
        fi
    done
fi

if [[ "$parts" == *" serve "* ]]; then
    table=$out/serve-table.txt
    printf '%-28s %-6s %5s %6s %12s %12s\n' model format ranks conc "out tok/s" "per GPU" > "$table"
    for model in $models; do
        for fmt in $formats; do
            q=(); [ "$fmt" = bf16 ] || q=(--quantization "$fmt")
            for n in $ranks; do
                name=$(basename "$model")-$fmt-np$n
                echo "== serve: $name, concurrency $conc, ${ILEN:-1000} + ${OLEN:-1000} tokens"
                launch=""; [ "$n" -gt 1 ] && launch="${mpi[*]} -np $n"
                ef=(); [ "$n" -gt 1 ] && ef=("${serve_flags[@]}")
                OUT=$out/$name LAUNCH=$launch MODEL=$model CONC=$conc ILEN=${ILEN:-1000} \
                    OLEN=${OLEN:-1000} REQS=${REQS:-2} DEVICE=$device timeout 2400 \
                    bash scripts/gpu_serve_bench.sh "${ef[@]}" "${q[@]}" > "$out/$name.txt" 2>&1
                rc=$?
                result "serve $name (exit $rc, $out/$name.txt)" $((rc == 0))
                for c in $conc; do
                    tps=$(awk '/^Output token throughput/ {print $NF}' \
                        "$out/$name/bench-c$c.txt" 2>/dev/null)
                    per=$([ -n "$tps" ] && python3 -c "print(f'{$tps / $n:.1f}')")
                    printf '%-28s %-6s %5d %6d %12s %12s\n' "$(basename "$model")" "$fmt" "$n" \
                        "$c" "${tps:--}" "${per:--}" >> "$table"
                done
            done
        done
    done
    cat "$table"
fi
echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
