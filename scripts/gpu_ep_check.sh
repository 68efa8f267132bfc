#!/usr/bin/env bash
# Expert parallelism over two GPUs in one command, run ON a machine with two GPUs from the
# repository root with the build carried there (build here: `make -j2 && scripts/gpu_bundle.sh`):
#   1. build/tests/test_cuda_a2a under mpirun -np 2: the GPU all-to-all against the CPU's shm
#   2. scripts/gpu_ep_compare.py: `mpirun -np 2 moeserve serve --device cuda` with
#      nvlink_one_sided and with nccl on the test checkpoint against one GPU, logprobs and tokens,
#      with the partial combine (the default) and the slots one; deterministic, every round bit
#      for bit, eagerly and with decode steps as CUDA graphs; graphs with the partial combine
#   3. serving throughput (scripts/gpu_serve_bench.sh, Qwen3-30B-A3B dummy weights, decode graphs)
#      on one GPU and on two, each combine form (SKIP=serve leaves it out, SKIP_ONE=1 the one-GPU
#      run)
# Logs go to ${OUT:-/tmp/gpu-ep}; each part prints its summary, the last line is "N passed, M
# failed" over parts 1 and 2.
set -u
cd "$(dirname "$0")/.."
b=${BUILD:-build}
export LD_LIBRARY_PATH=$b/gpu-libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export NCCL_NVLS_ENABLE=0
out=${OUT:-/tmp/gpu-ep}
mkdir -p "$out"
mpi=(mpirun --allow-run-as-root -x NCCL_NVLS_ENABLE -x LD_LIBRARY_PATH)
pass=0
fail=0
count() { # the "N passed, M failed" line of a log into the totals
    local line
    line=$(grep -E '^[0-9]+ passed, [0-9]+ failed$' "$1" | tail -n 1)
    if [ -z "$line" ]; then
        fail=$((fail + 1))
        echo "FAIL $1: no summary"
        return
    fi
    pass=$((pass + ${line%% passed*}))
    local f=${line#*, }
    fail=$((fail + ${f%% failed*}))
}

echo "== 1. test_cuda_a2a, 2 ranks"
timeout 300 "${mpi[@]}" -np 2 "$b/tests/test_cuda_a2a" > "$out/test_cuda_a2a.txt" 2>&1
grep -E "^(FAIL|ok)" "$out/test_cuda_a2a.txt" | grep -c "^ok" | sed 's/^/ok lines: /'
grep -E "^FAIL" "$out/test_cuda_a2a.txt" | head -n 10
count "$out/test_cuda_a2a.txt"

echo "== 1b. test_cuda_a2a rounds, the segment shared by cuMem POSIX descriptors"
MOESERVE_A2A_MEM=posix_fd timeout 300 "${mpi[@]}" -x MOESERVE_A2A_MEM -np 2 \
    "$b/tests/test_cuda_a2a" rounds > "$out/test_cuda_a2a-posix_fd.txt" 2>&1
grep -E "^FAIL|segment" "$out/test_cuda_a2a-posix_fd.txt" | head -n 10
count "$out/test_cuda_a2a-posix_fd.txt"

echo "== 2. the server on 2 GPUs against 1 (the default combine: partial, BF16 sums per rank)"
OUT=$out timeout 900 python3 scripts/gpu_ep_compare.py > "$out/compare.txt" 2>&1
grep -vE '^[0-9]+ passed' "$out/compare.txt"
count "$out/compare.txt"
echo "== 2a. the same with --moe-a2a-combine slots (every slot home in fp32)"
OUT=$out/slots timeout 900 python3 scripts/gpu_ep_compare.py --combine slots \
    > "$out/compare-slots.txt" 2>&1
grep -vE '^[0-9]+ passed' "$out/compare-slots.txt"
count "$out/compare-slots.txt"
echo "== 2b. the same with --enable-deterministic-inference: every round bit for bit"
OUT=$out/det timeout 600 python3 scripts/gpu_ep_compare.py --deterministic > "$out/compare-det.txt" 2>&1
grep -E '^FAIL|bit for bit' "$out/compare-det.txt"
count "$out/compare-det.txt"
echo "== 2c. decode steps as CUDA graphs (--cuda-graph-max-bs 32), deterministic: bit for bit"
OUT=$out/graphs timeout 600 python3 scripts/gpu_ep_compare.py --deterministic --graphs 32 \
    --backends nvlink_one_sided > "$out/compare-graphs.txt" 2>&1
grep -E '^FAIL|bit for bit' "$out/compare-graphs.txt"
count "$out/compare-graphs.txt"

echo "== 2d. decode steps as CUDA graphs with the partial combine (the GPU server's defaults)"
OUT=$out/graphs-partial timeout 600 python3 scripts/gpu_ep_compare.py --graphs 32 \
    --backends nvlink_one_sided > "$out/compare-graphs-partial.txt" 2>&1
grep -E '^FAIL|partial combine' "$out/compare-graphs-partial.txt"
count "$out/compare-graphs-partial.txt"

if [[ " ${SKIP:-} " != *" serve "* ]]; then
    if [ -z "${SKIP_ONE:-}" ]; then
        echo "== 3. serving, Qwen3-30B-A3B dummy weights: one GPU (decode graphs)"
        OUT=$out/serve1 timeout 600 bash scripts/gpu_serve_bench.sh --cuda-graph-max-bs 256
    fi
    for form in partial slots; do
        echo "== 3. serving, two GPUs (nvlink_one_sided, decode graphs, $form combine)"
        OUT=$out/serve2-$form LAUNCH="${mpi[*]} -np 2" timeout 600 bash scripts/gpu_serve_bench.sh \
            --moe-a2a-backend nvlink_one_sided --moe-a2a-combine $form --cuda-graph-max-bs 256
    done
fi
echo "$pass passed, $fail failed"
