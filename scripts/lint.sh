#!/usr/bin/env bash
# make lint: cppcheck and clang-tidy over the project's own C code (the CUDA files aside: they
# need nvcc's headers; the GPU machine compiles them with -Werror-free nvcc warnings instead).
# cppcheck: warning, performance and portability checks, suppressions in .cppcheck-suppressions
# (each justified there); clang-tidy: the checks of .clang-tidy. Every finding is a failure.
# The last line is "N passed, M failed": N files clean in both tools, M findings. Run from the
# repository root; JOBS (default: the core count) files at a time.
set -u
cd "$(dirname "$0")/.."
jobs=${JOBS:-$(nproc)}
files=$(ls common/*.c config/*.c kernels/*.c kernels/cpu/*.c runner/*.c runner/models/*.c \
    server/*.c scripts/*.c scripts/bench/*.c tests/*.c tests/fuzz/*.c 2>/dev/null)
cflags="-std=c11 -D_GNU_SOURCE -I. $(pkg-config --cflags ompi-c libcurl 2>/dev/null)"
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

# cppcheck: one run over every file (it follows the project's headers itself)
cppcheck -q -j "$jobs" --std=c11 -D_GNU_SOURCE -I. --enable=warning,performance,portability \
    --inline-suppr --suppressions-list=.cppcheck-suppressions \
    --template='{file}:{line}: cppcheck {severity} [{id}]: {message}' $files 2>"$out/cppcheck.txt"
grep -E '^[^ ]+:[0-9]+: cppcheck ' "$out/cppcheck.txt" >"$out/findings.txt"

# clang-tidy: a file at a time, JOBS at once
printf '%s\n' $files | xargs -P "$jobs" -I{} sh -c \
    'clang-tidy -quiet "$1" -- '"$cflags"' -fopenmp 2>/dev/null | \
     grep -E "^[^ ]+:[0-9]+:[0-9]+: (warning|error):" > "$2/tidy.$(echo "$1" | tr / _).txt"' \
    _ {} "$out"
cat "$out"/tidy.*.txt | sed "s|^$PWD/||" >>"$out/findings.txt"

sort -u "$out/findings.txt" -o "$out/findings.txt"
cat "$out/findings.txt"
n_find=$(wc -l <"$out/findings.txt")
n_files=$(printf '%s\n' $files | wc -l)
n_bad=$(cut -d: -f1 "$out/findings.txt" | sort -u | wc -l)
echo "lint: $n_files files, $n_find findings in $n_bad files (cppcheck $(cppcheck --version | \
    cut -d' ' -f2), clang-tidy $(clang-tidy --version | grep -Eo 'version [0-9.]+' | cut -d' ' -f2))"
echo "$((n_files - n_bad)) passed, $n_find failed"
[ "$n_find" -eq 0 ]
