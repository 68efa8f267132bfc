#!/usr/bin/env bash
# The GPU figures of docs/benchmarks.md (CUDA backend) in one command, run ON the GPU machine from
# the repository root with the build carried there (build here: `make -j2 && scripts/gpu_bundle.sh`):
# decode step time and prefill throughput of Qwen3-30B-A3B (dummy weights) in both matmul
# precisions, and of the DeepSeek-V3 MoE shape. The op tests' own timings come from
# scripts/gpu_check.sh (build/tests/test_cuda_* print them).
set -u
cd "$(dirname "$0")/.."
export LD_LIBRARY_PATH=${BUILD:-build}/gpu-libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
b=${BUILD:-build}/bench_step
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
for p in high medium; do
    echo "== Qwen3-30B-A3B, dummy weights, matmul precision $p"
    "$b" --model-path config/models/qwen3-30b-a3b --load-format dummy --device cuda \
        --matmul-precision "$p" --batches 1,8,64,256 --context 1024 --steps 16 \
        --prefill-prompts 1,8,32 --prefill-len 2048 --chunk 8192
done
echo "== Qwen3-30B-A3B, dummy weights, matmul precision high, decode graphs up to batch 64"
"$b" --model-path config/models/qwen3-30b-a3b --load-format dummy --device cuda \
    --cuda-graph-max-bs 64 --batches 1,8,64 --context 1024 --steps 16 --prefill-prompts 1
echo "== DeepSeek-V3 MoE shape (2 layers), dummy weights, matmul precision high"
"$b" --model-path config/models/deepseek-v3-moe-shape --load-format dummy --device cuda \
    --batches 1,64 --context 1024 --steps 16 --prefill-prompts 1,8 --prefill-len 2048 --chunk 8192
