#!/usr/bin/env bash
# End-to-end HTTP tests of `moeserve serve` (tests/test_http.py, standard library) and of the
# `openai` Python client against it (tests/test_openai_client.py; needs `pip install openai`, and
# counts one failure when it is missing). Prints one combined "N passed, M failed" last line.
set -u
cd "$(dirname "$0")/.."
total_pass=0
total_fail=0

add_summary() { # $1 = name, $2 = output, $3 = exit status
    local line p f
    line=$(printf '%s\n' "$2" | grep -E '^[0-9]+ passed, [0-9]+ failed$' | tail -n 1)
    if [ -z "$line" ]; then
        echo "FAIL $1: no summary line (exit $3)"
        total_fail=$((total_fail + 1))
        return
    fi
    p=${line%% passed*}
    f=${line#*, }
    f=${f%% failed*}
    if [ "$3" -ne 0 ] && [ "$f" -eq 0 ]; then f=1; fi
    total_pass=$((total_pass + p))
    total_fail=$((total_fail + f))
}

out=$(python3 tests/test_http.py 2>&1)
rc=$?
printf '%s\n' "$out"
add_summary test_http.py "$out" "$rc"

if python3 -c 'import openai' 2>/dev/null; then
    out=$(python3 tests/test_openai_client.py 2>&1)
    rc=$?
    printf '%s\n' "$out"
    add_summary test_openai_client.py "$out" "$rc"
else
    echo "FAIL test_openai_client.py: the openai Python package is not installed (pip install openai)"
    total_fail=$((total_fail + 1))
fi

echo "$total_pass passed, $total_fail failed"
[ "$total_fail" -eq 0 ]
