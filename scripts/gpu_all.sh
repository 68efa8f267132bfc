#!/usr/bin/env bash
# Every GPU check and figure of the CUDA backend in one command, for one call of the GPU machine
# (its time is scarce: one call saves the machine's start-up each extra call would cost):
#   1. scripts/gpu_check.sh        op tests against the CPU, whole model, server (pass / fail)
#   2. the op tests' timings       test_cuda_attention --bench-only, test_cuda_moe (in 1: its full
#                                  run prints its tables), PyTorch side by side where installed
#   3. scripts/gpu_bench.sh        decode steps and prefill of Qwen3-30B-A3B and the DeepSeek shape
#   4. scripts/gpu_serve_bench.sh  serving over HTTP at concurrency 1, 64 and 256
#   5. scripts/gpu_ep_check.sh     with two GPUs or more: the GPU all-to-all's test, the server
#                                  on two GPUs against one, serving on two (its one-GPU serving
#                                  is part 4's)
# Run from the repository root with the build carried there (build here: `make -j2 &&
# scripts/gpu_bundle.sh`). Logs go to ${OUT:-/tmp/gpu-all}, packed into logs.tgz there; the
# console gets each part's summary. SKIP="serve bench" leaves parts out.
set -u
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/gpu-all}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0
b=${BUILD:-build}
skip=" ${SKIP:-} "
part() { [[ "$skip" != *" $1 "* ]]; }

echo "== 1. checks"
OUT="$out/check" timeout 600 bash scripts/gpu_check.sh > "$out/check.txt" 2>&1
grep -E "^(ok|FAIL)|passed, [0-9]+ failed" "$out/check.txt" | tail -n 12

if part timing; then
    echo "== 2. op timings"
    export LD_LIBRARY_PATH=$b/gpu-libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    timeout 300 "$b/tests/test_cuda_attention" --bench-only > "$out/attention-bench.txt" 2>&1
    grep -E "^decode B=1 |^prefill" "$out/attention-bench.txt"
    python3 scripts/bench_attention_torch.py > "$out/attention-torch.txt" 2>&1 ||
        echo "(no PyTorch attention figures: see attention-torch.txt)"
    python3 scripts/bench_grouped_mm_torch.py > "$out/grouped-mm-torch.txt" 2>&1 ||
        echo "(no torch._grouped_mm figures: see grouped-mm-torch.txt)"
fi
if part bench; then
    echo "== 3. engine steps"
    timeout 900 bash scripts/gpu_bench.sh > "$out/bench.txt" 2>&1
    grep -E "^==|^ +[0-9]+ +[0-9.]+ +[0-9.]+" "$out/bench.txt"
fi
if part serve; then
    echo "== 4. serving"
    OUT="$out/serve" timeout 900 bash scripts/gpu_serve_bench.sh
fi
n_gpu=$(nvidia-smi -L 2> /dev/null | grep -c '^GPU ')
if part ep && [ "$n_gpu" -ge 2 ]; then
    echo "== 5. two GPUs"
    OUT="$out/ep" SKIP_ONE=1 timeout 1200 bash scripts/gpu_ep_check.sh
fi
tar czf "$out/logs.tgz" -C "$out" --exclude logs.tgz . 2> /dev/null
echo "logs: $out/logs.tgz"
