#!/usr/bin/env bash
# Issue 8's KL limits on a trained checkpoint: build/quant_kl on tests/data/tiny-qwen3-moe-trained
# (scripts/make_trained_checkpoint.py: the test checkpoint's shapes trained on GSM8K), teacher-
# forced over the 6 GSM8K sequences of tests/data/reference-tiny-qwen3-moe.json (979 positions),
# the experts' input in their activation format ("as served"): mean KL(BF16 || FP8) at most 1e-3,
# mean KL(BF16 || NVFP4) at most 2e-2. Prints "N passed, M failed" last.
set -u
cd "$(dirname "$0")/.."
bin=${BUILD:-build}/quant_kl
pass=0
fail=0
check() { # $1 = ok (0/1), $2 = what
    if [ "$1" = 1 ]; then
        echo "ok   $2"
        pass=$((pass + 1))
    else
        echo "FAIL $2"
        fail=$((fail + 1))
    fi
}
out=$("$bin" --model-path tests/data/tiny-qwen3-moe-trained 2>&1)
rc=$?
check "$([ $rc = 0 ] && echo 1 || echo 0)" "quant_kl on tests/data/tiny-qwen3-moe-trained exits 0 (exit $rc)"
printf '%s\n' "$out" | sed -n '1p'
kl_of() { # the mean KL on the line that starts with $1
    printf '%s\n' "$out" | grep -F -- "  $1" | head -n 1 | sed -n 's/.*mean KL \([0-9.e+-]*\).*/\1/p'
}
fp8=$(kl_of "FP8 (W8A8")
nvfp4=$(kl_of "NVFP4 (weights, experts' input")
within() { awk -v v="$1" -v lim="$2" 'BEGIN { print (v != "" && v + 0 >= 0 && v + 0 <= lim) ? 1 : 0 }'; }
check "$(within "$fp8" 1e-3)" "FP8 as served: mean KL ${fp8:-none} <= 1e-3"
check "$(within "$nvfp4" 2e-2)" "NVFP4 as served: mean KL ${nvfp4:-none} <= 2e-2"
echo "$pass passed, $fail failed"
[ "$fail" = 0 ]
