#!/usr/bin/env bash
# The multi-rank tests, MPI programs under mpirun:
# - the all-to-all (tests/test_a2a.c) at np 1, 2, 3 and 4, and once more at np 3 with the mpi
#   transport over OpenMPI's pt2pt one-sided component (active messages, no shared memory: how
#   ranks on different nodes talk);
# - the model with FP8 and NVFP4 experts (tests/test_quant_ep.c) at np 1, 2 and 3: logits bit for
#   bit those of one process, the tokens crossing the all-to-all quantized;
# - the rank group (tests/test_rank_group.c) at np 1, 2, 3 and 4; its timeout case at np 3 (the
#   highest rank sleeps through a step); its gone case at np 3 (the highest rank exits during a
#   step, mpirun told to let a rank exit without MPI_Finalize instead of ending the job).
# Ranks beyond the cores oversubscribe them, so OpenMPI is told to yield when idle and each rank
# runs one OpenMP thread. Prints one line per run and one combined "N passed, M failed" last line.
set -u
cd "$(dirname "$0")/.."
a2a=${BUILD:-build}/tests/test_a2a
rank_group=${BUILD:-build}/tests/test_rank_group
quant_ep=${BUILD:-build}/tests/test_quant_ep
fail_early() {
    echo "FAIL a2a_test.sh: $1"
    echo "0 passed, 1 failed"
    exit 1
}
command -v mpirun >/dev/null || fail_early "mpirun not found (apt-get install openmpi-bin)"

export OMP_NUM_THREADS=1
flags=(--allow-run-as-root --oversubscribe --mca mpi_yield_when_idle 1 -x OMP_NUM_THREADS)
total_pass=0
total_fail=0

run_case() { # $1 = label, $2 = binary, then mpirun arguments before it, then -- and its arguments
    local label=$1 bin=$2 out rc line p f
    shift 2
    if [ ! -x "$bin" ]; then
        echo "FAIL $label: $bin is not built (make)"
        total_fail=$((total_fail + 1))
        return
    fi
    local pre=() post=()
    while [ $# -gt 0 ] && [ "$1" != -- ]; do pre+=("$1"); shift; done
    [ $# -gt 0 ] && shift
    post=("$@")
    out=$(timeout -k 5 120 mpirun "${flags[@]}" "${pre[@]}" "$bin" "${post[@]}" 2>&1)
    rc=$?
    line=$(printf '%s\n' "$out" | grep -E '^[0-9]+ passed, [0-9]+ failed$' | tail -n 1)
    if [ -z "$line" ]; then
        printf '%s\n' "$out" | tail -n 20
        echo "FAIL $label: no summary line (exit $rc)"
        total_fail=$((total_fail + 1))
        return
    fi
    p=${line%% passed*}
    f=${line#*, }
    f=${f%% failed*}
    if [ "$rc" -ne 0 ] && [ "$f" -eq 0 ]; then f=1; fi
    if [ "$f" -ne 0 ]; then printf '%s\n' "$out" | grep -vE '^[0-9]+ passed' | head -n 20; fi
    echo "$label: $line"
    total_pass=$((total_pass + p))
    total_fail=$((total_fail + f))
}

for np in 1 2 3 4; do
    run_case "a2a np $np" "$a2a" -np "$np"
done
run_case "a2a np 3, mpi over osc pt2pt" "$a2a" -np 3 --mca osc pt2pt -- mpi
for np in 1 2 3; do
    run_case "quantized experts np $np" "$quant_ep" -np "$np"
done
for np in 1 2 3 4; do
    run_case "rank group np $np" "$rank_group" -np "$np"
done
run_case "rank group np 3, timeout" "$rank_group" -np 3 -- timeout
run_case "rank group np 3, a rank exits" "$rank_group" -np 3 --mca orte_allowed_exit_without_sync 1 \
    -- gone
echo "$total_pass passed, $total_fail failed"
[ "$total_fail" -eq 0 ]
