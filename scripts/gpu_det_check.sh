#!/usr/bin/env bash
# Deterministic mode's two linear kernels side by side, run ON the GPU machine from the repository
# root with the build carried there (scripts/gpu_pack.sh, then BUILD=build/gpu): the op checks
# (test_cuda_ops runs its deterministic cases with the pinned cuBLASLt algorithm and with
# cuda_linear_bi), then bench_step's decode steps and prefill of Qwen3-30B-A3B (dummy weights,
# high precision) without the mode, with it on cuda_linear_bi (the default) and with it on the
# pinned cuBLASLt algorithm (MOESERVE_DET_LINEAR=cublas), in one process each, same settings as
# docs/benchmarks.md's table. The serving figures: scripts/gpu_serve_bench.sh
# [--enable-deterministic-inference] (with MOESERVE_DET_LINEAR=cublas for the other kernel).
set -u
cd "$(dirname "$0")/.."
b=${BUILD:-build}
export LD_LIBRARY_PATH=$b/gpu-libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
out=${OUT:-/tmp/gpu-det}
mkdir -p "$out"
echo "== test_cuda_ops"
timeout 900 "$b/tests/test_cuda_ops" > "$out/test_cuda_ops.txt" 2>&1
grep -E "^FAIL|deterministic linear:|passed, [0-9]+ failed" "$out/test_cuda_ops.txt" | head -n 40
step() { # $1 = label, then bench_step's extra flags
    local label=$1
    shift
    echo "== $label"
    timeout 600 "$b/bench_step" --model-path config/models/qwen3-30b-a3b --load-format dummy \
        --device cuda --context 1024 --steps 16 --batches 1,8,64,256 --prefill-prompts 1,8 \
        --prefill-len 2048 --cuda-graph-max-bs 256 "$@" 2>&1 | tee "$out/step-${label// /-}.txt" |
        grep -vE "^\[" | tail -n 20
}
step "not deterministic" --deterministic 0
step "deterministic, cuda_linear_bi" --deterministic 1
MOESERVE_DET_LINEAR=cublas step "deterministic, cuBLASLt pinned" --deterministic 1
