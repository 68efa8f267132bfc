#!/usr/bin/env bash
# Run every test binary under build/tests/ and every tests/*_test.sh, add up their
# "N passed, M failed" lines; the last line printed is the total. Exit non-zero on any failure.
# Each test's whole output is kept in build/test-logs/NAME.log; of a failing one its FAIL lines
# and its last lines are printed (carriage returns as line breaks, so no line hides another).
set -u
cd "$(dirname "$0")/.."
logs="${BUILD:-build}/test-logs"
mkdir -p "$logs"
total_pass=0
total_fail=0
for t in "${BUILD:-build}"/tests/test_* tests/*_test.sh; do
    [ -x "$t" ] || continue
    case "$t" in *.d | *.o) continue ;; esac
    name=$(basename "$t")
    out=$("$t" 2>&1)
    rc=$?
    printf '%s\n' "$out" > "$logs/$name.log"
    line=$(printf '%s\n' "$out" | grep -E '^[0-9]+ passed, [0-9]+ failed$' | tail -n 1)
    if [ -z "$line" ]; then
        printf '%s\n' "$out" | tr '\r' '\n' | tail -n 20
        echo "$name: no summary line (exit $rc)"
        total_fail=$((total_fail + 1))
        continue
    fi
    p=${line%% passed*}
    f=${line#*, }
    f=${f%% failed*}
    if [ "$rc" -ne 0 ] && [ "$f" -eq 0 ]; then f=1; fi
    if [ "$f" -ne 0 ]; then
        printf '%s\n' "$out" | tr '\r' '\n' | grep -E '^FAIL|error' | head -n 20
        echo "-- the last lines of $name (all of it: $logs/$name.log):"
        printf '%s\n' "$out" | tr '\r' '\n' | tail -n 15
    fi
    printf '%-28s %s\n' "$name" "$line"
    total_pass=$((total_pass + p))
    total_fail=$((total_fail + f))
done
echo "$total_pass passed, $total_fail failed"
[ "$total_fail" -eq 0 ]
