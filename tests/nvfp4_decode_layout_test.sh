#!/usr/bin/env bash
# The host's half of build/bench_nvfp4_decode (built with CUDA; no device needed): both NVFP4
# layouts of its kernels decoded as they decode them, and their arithmetic emulated on the
# bytes their stages hold, against the double-precision reference (--layout-check), at DeepSeek-
# V3's two K. Without the binary (a build without CUDA) nothing runs. The last line is "N passed,
# M failed".
cd "$(dirname "$0")/.." || exit 1
b=${BUILD:-build}/bench_nvfp4_decode
pass=0
fail=0
if [ -x "$b" ]; then
    for k in 7168 2048; do
        if "$b" --layout-check --k "$k"; then
            pass=$((pass + 1))
        else
            echo "FAIL: $b --layout-check --k $k"
            fail=$((fail + 1))
        fi
    done
fi
echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
