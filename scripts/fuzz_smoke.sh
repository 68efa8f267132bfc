#!/usr/bin/env bash
# make fuzz-smoke: run every fuzz target of build-fuzz/ for SECS seconds (default 10) over a
# scratch copy of its corpus (tests/fuzz/corpus/<target>/ is left as committed). A target that
# crashes, hangs or trips a sanitizer fails; its reproducer is kept in build-fuzz/crashes/.
# The last line is "N passed, M failed". Run from the repository root.
set -u
cd "$(dirname "$0")/.."
secs=${1:-10}
pass=0
fail=0
mkdir -p build-fuzz/crashes
for bin in build-fuzz/fuzz_*; do
    [ -x "$bin" ] || continue
    name=$(basename "$bin")
    work=$(mktemp -d)
    [ -d "tests/fuzz/corpus/$name" ] && cp -a "tests/fuzz/corpus/$name/." "$work/"
    log=build-fuzz/$name.log
    "$bin" -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 \
        -artifact_prefix=build-fuzz/crashes/"$name"- -print_final_stats=1 "$work" >"$log" 2>&1
    rc=$?
    rm -rf "$work"
    runs=$(grep -Eo 'stat::number_of_executed_units: *[0-9]+' "$log" | grep -Eo '[0-9]+$')
    cov=$(grep -Eo 'cov: [0-9]+' "$log" | tail -n 1)
    if [ "$rc" -eq 0 ]; then
        pass=$((pass + 1))
        printf '%-26s ok    %s runs, %s\n' "$name" "${runs:-?}" "${cov:-cov: ?}"
    else
        fail=$((fail + 1))
        grep -E 'ERROR|SUMMARY|runtime error|Test unit written' "$log" | head -n 5
        printf '%-26s FAIL  exit %d, log %s\n' "$name" "$rc" "$log"
    fi
done
echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
