#!/usr/bin/env bash
# Build here, then pack what the GPU machine needs into one file small enough to carry there
# (its copy of the working tree is limited to 64 MiB, and every binary links the whole library:
# about 11 MB each once stripped): the server, the bench tools and the CUDA op tests, stripped,
# with the libraries the machine lacks (scripts/gpu_bundle.sh), as build/gpu.txz (about 11 MB).
#   scripts/gpu_pack.sh            make -j2, then pack
# On the GPU machine, from the repository root, with build/gpu.txz carried:
#   tar xJf build/gpu.txz -C build && BUILD=build/gpu bash scripts/gpu_all.sh
# (or any of gpu_check.sh, gpu_bench.sh, gpu_serve_bench.sh, gpu_ep_check.sh with BUILD=build/gpu).
set -euo pipefail
cd "$(dirname "$0")/.."
make -j2 >/dev/null
dir=build/gpu
rm -rf "$dir" && mkdir -p "$dir/tests"
for b in build/moeserve build/moeserve-bench build/bench_step build/bench_a2a_cuda build/quant_kl; do
    [ -x "$b" ] && cp "$b" "$dir/"
done
for t in build/tests/test_cuda_*; do
    case "$t" in *.o | *.d) continue ;; esac
    cp "$t" "$dir/tests/"
done
strip "$dir"/* "$dir"/tests/* 2>/dev/null || true
BUILD=$dir scripts/gpu_bundle.sh "$dir/moeserve" >/dev/null
tar cf - -C build gpu | xz -3 -T2 >build/gpu.txz
rm -rf "$dir"
echo "build/gpu.txz: $(du -h build/gpu.txz | cut -f1); on the GPU machine:"
echo "  tar xJf build/gpu.txz -C build && BUILD=build/gpu bash scripts/gpu_all.sh"
