#!/usr/bin/env bash
# NVFP4 experts at decode sizes with the weights as wgmma's A operand, decided in one device
# call, run ON the GPU machine from the repository root with the build carried there
# (scripts/gpu_pack.sh here; there `tar xJf build/gpu.txz -C build` and BUILD=build/gpu):
#   1. build/bench_nvfp4_decode: the bench's four kernels against the copy rate (a layer's worth
#      of rows, GEMM 1 and GEMM 2 of 8 DeepSeek-V3 experts, and 6 and 8 stages)
#   2. test_cuda_moe --nvfp4 with MOESERVE_NVFP4_LEAN=1: the lean kernels against the CPU and the
#      tiles bit for bit (their own shape always; Qwen3-30B-A3B's decode sizes with the switch)
#   3. timings with the switch at each of LEANS, alternating, ROUNDS rounds: DeepSeek-V3's experts
#      at T = 1, 2, 8, 16, 32, 64 (test_cuda_moe --deepseek-nvfp4-timing) and Qwen3-30B-A3B's at
#      1, 8, 64 (or QWEN_TS)
#   4. decode steps of Qwen3-30B-A3B in NVFP4 (bench_step, batch 1, 8, 64), medium and high, with
#      the switch at each of LEANS
# Logs go to ${OUT:-/tmp/gpu-lean}; each part prints its summary lines. SKIP="bench check time
# step" leaves parts out; ROUNDS (default 2) sets the timing rounds, LEANS (default "0 2") the
# switch's values for the timings and the steps (2z 2p 2w 2d 2s 2r 2m: MOESERVE_NVFP4_LEAN_FORM
# 0-6; 2t: the default form with 32-row tiles, MOESERVE_LEAN_ROWS24=0). FMT=fp8 times and steps
# FP8 experts instead, the values of LEANS going to MOESERVE_FP8_LEAN (forms 0 to 2, 5 and 6);
# parts 1 and 2 stay NVFP4's. DS_TS sets DeepSeek-V3's sizes (default 1 2 8 16 32 64); APART=1
# times each in a process of its own: in one process on an H100 the sizes before T = 64, at 84 to
# 91% of the copy rate, took 8 points off its medium figure (docs/benchmarks.md, "One H100
# (2026-12-06, twentieth session)").
set -u
cd "$(dirname "$0")/.."
b=${BUILD:-build}
export LD_LIBRARY_PATH=$b/gpu-libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export NCCL_NVLS_ENABLE=0
out=${OUT:-/tmp/gpu-lean}
mkdir -p "$out"
skip() { [[ " ${SKIP:-} " == *" $1 "* ]]; }
fmt=${FMT:-nvfp4}
lean_env() { # a value of LEANS: 2 (the default form), 2z .. 2m (MOESERVE_NVFP4_LEAN_FORM 0-6), 2t
    unset MOESERVE_NVFP4_LEAN MOESERVE_FP8_LEAN
    if [ "$fmt" = fp8 ]; then
        export MOESERVE_FP8_LEAN=${1%[zpwdsrmt]}
    else
        export MOESERVE_NVFP4_LEAN=${1%[zpwdsrmt]}
    fi
    unset MOESERVE_NVFP4_LEAN_FORM MOESERVE_LEAN_ROWS24
    case $1 in
    *z) export MOESERVE_NVFP4_LEAN_FORM=0 ;;
    *p) export MOESERVE_NVFP4_LEAN_FORM=1 ;;
    *w) export MOESERVE_NVFP4_LEAN_FORM=2 ;;
    *d) export MOESERVE_NVFP4_LEAN_FORM=3 ;;
    *s) export MOESERVE_NVFP4_LEAN_FORM=4 ;;
    *r) export MOESERVE_NVFP4_LEAN_FORM=5 ;;
    *m) export MOESERVE_NVFP4_LEAN_FORM=6 ;;
    *t) export MOESERVE_LEAN_ROWS24=0 ;;
    esac
}
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee "$out/gpu.txt"

if ! skip bench; then
    echo "== 1. bench_nvfp4_decode"
    for args in "" "--rows 32768" "--k 2048 --rows 57344" "--stages 6" "--stages 8"; do
        echo "-- $args"
        # shellcheck disable=SC2086
        timeout 300 "$b/bench_nvfp4_decode" $args 2>&1 | tee -a "$out/bench.txt" | tail -n 6
    done
fi
if ! skip check; then
    echo "== 2. test_cuda_moe --nvfp4, MOESERVE_NVFP4_LEAN=1"
    MOESERVE_NVFP4_LEAN=1 timeout 600 "$b/tests/test_cuda_moe" --nvfp4 > "$out/check.txt" 2>&1
    grep -E '^FAIL|lean' "$out/check.txt" | head -n 40
    tail -n 1 "$out/check.txt"
fi
if ! skip time; then
    echo "== 3. timings, $fmt, the lean switch at ${LEANS:-0 2} in turn, ${ROUNDS:-2} rounds"
    for round in $(seq "${ROUNDS:-2}"); do
        for lean in ${LEANS:-0 2}; do
            echo "-- round $round, $fmt, lean switch $lean"
            lean_env "$lean"
            if [ "${APART:-0}" = 1 ]; then # each size in a process of its own (see above)
                for t in ${DS_TS:-1 2 8 16 32 64}; do
                    timeout 120 "$b/tests/test_cuda_moe" --deepseek-"$fmt"-timing 32 "$t"
                done > "$out/ds-$fmt-$lean-$round.txt" 2>&1
            else
                # shellcheck disable=SC2086
                timeout 300 "$b/tests/test_cuda_moe" --deepseek-"$fmt"-timing 32 \
                    ${DS_TS:-1 2 8 16 32 64} > "$out/ds-$fmt-$lean-$round.txt" 2>&1
            fi
            grep -E "$fmt" "$out/ds-$fmt-$lean-$round.txt" | grep -vE '^FAIL' | tail -n 12
            for t in ${QWEN_TS:-1 8 64}; do
                timeout 120 "$b/tests/test_cuda_moe" --$fmt-timing $t \
                    > "$out/qwen-$fmt-$lean-$round-$t.txt" 2>&1
                grep -E "$fmt" "$out/qwen-$fmt-$lean-$round-$t.txt" | grep -vE '^FAIL' | tail -n 3
            done
        done
    done
fi
if ! skip step; then
    echo "== 4. decode steps, Qwen3-30B-A3B $fmt"
    for prec in medium high; do
        for lean in ${LEANS:-0 2}; do
            echo "-- $prec, $fmt, lean switch $lean"
            lean_env "$lean"
            timeout 300 "$b/bench_step" \
                --model-path config/models/qwen3-30b-a3b --load-format dummy --device cuda \
                --context 1024 --steps 16 --prefill-prompts 1 --prefill-len 16 --batches 1,8,64 \
                --cuda-graph-max-bs 64 --quantization "$fmt" --matmul-precision "$prec" \
                > "$out/step-$fmt-$prec-$lean.txt" 2>&1
            tail -n 5 "$out/step-$fmt-$prec-$lean.txt"
        done
    done
fi
