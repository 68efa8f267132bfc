#!/usr/bin/env bash
# The all-to-all tests (tests/test_a2a.c, an MPI program) under mpirun -np 1, 2, 3 and 4. Ranks
# beyond the cores oversubscribe them, so OpenMPI is told to yield when idle and each rank runs one
# OpenMP thread. Prints one line per run and one combined "N passed, M failed" last line.
set -u
cd "$(dirname "$0")/.."
bin=${BUILD:-build}/tests/test_a2a
fail_early() {
    echo "FAIL a2a_test.sh: $1"
    echo "0 passed, 1 failed"
    exit 1
}
[ -x "$bin" ] || fail_early "$bin is not built (make)"
command -v mpirun >/dev/null || fail_early "mpirun not found (apt-get install openmpi-bin)"

export OMP_NUM_THREADS=1
flags=(--allow-run-as-root --oversubscribe --mca mpi_yield_when_idle 1 -x OMP_NUM_THREADS)

total_pass=0
total_fail=0
for np in 1 2 3 4; do
    out=$(timeout -k 5 120 mpirun "${flags[@]}" -np "$np" "$bin" 2>&1)
    rc=$?
    line=$(printf '%s\n' "$out" | grep -E '^[0-9]+ passed, [0-9]+ failed$' | tail -n 1)
    if [ -z "$line" ]; then
        printf '%s\n' "$out" | tail -n 20
        echo "FAIL np $np: no summary line (exit $rc)"
        total_fail=$((total_fail + 1))
        continue
    fi
    p=${line%% passed*}
    f=${line#*, }
    f=${f%% failed*}
    if [ "$rc" -ne 0 ] && [ "$f" -eq 0 ]; then f=1; fi
    if [ "$f" -ne 0 ]; then printf '%s\n' "$out" | grep -vE '^[0-9]+ passed' | head -n 20; fi
    echo "np $np: $line"
    total_pass=$((total_pass + p))
    total_fail=$((total_fail + f))
done
echo "$total_pass passed, $total_fail failed"
[ "$total_fail" -eq 0 ]
