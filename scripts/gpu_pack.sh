#!/usr/bin/env bash
# Build here, then pack what the GPU machine needs into one file small enough to carry there
# (its copy of the working tree is limited to 64 MiB, and every binary links the whole library:
# about 31 MB each once stripped, for sm_90a and sm_100a): the server, the bench tools and the
# CUDA op tests, stripped, with the libraries the machine lacks (scripts/gpu_bundle.sh), as
# build/gpu.txz (about 10 MB, with OLD's build as well).
#   scripts/gpu_pack.sh            make -j2, then pack
#   OLD=REV [OLD_PATCH=FILE] scripts/gpu_pack.sh
#                                  also build commit REV (in a git worktree, build/old-src, with
#                                  FILE applied there if given: a variant to time) and pack its
#                                  server, bench tools and CUDA op tests as build/gpu/old, for
#                                  scripts/gpu_ab.sh to time against the working tree's
# NVCC_ARCHS in the environment builds for fewer targets (faster here), as with make.
# On the GPU machine, from the repository root, with build/gpu.txz carried:
#   tar xJf build/gpu.txz -C build && BUILD=build/gpu bash scripts/gpu_all.sh
# (or any of gpu_check.sh, gpu_bench.sh, gpu_serve_bench.sh, gpu_ep_check.sh with BUILD=build/gpu;
# with OLD: A=build/gpu/old B=build/gpu bash scripts/gpu_ab.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
make -j2 >/dev/null
dir=build/gpu
rm -rf "$dir" && mkdir -p "$dir/tests"

# pack_build SRC DEST: SRC's server, bench tools and CUDA op tests, stripped, with the libraries
pack_build() {
    local src=$1 dest=$2 b t
    mkdir -p "$dest/tests"
    for b in moeserve moeserve-bench bench_step bench_a2a_cuda quant_kl bench_stream bench_stream_rows \
        bench_nvfp4_decode bench_wgmma_rate; do
        if [ -x "$src/$b" ]; then cp "$src/$b" "$dest/"; fi
    done
    for t in "$src"/tests/test_cuda_*; do
        case "$t" in *.o | *.d) continue ;; esac
        cp "$t" "$dest/tests/"
    done
    strip "$dest"/* "$dest"/tests/* 2>/dev/null || true
    BUILD=$dest scripts/gpu_bundle.sh "$dest/moeserve" >/dev/null
}
pack_build build "$dir"

if [ -n "${OLD:-}" ]; then
    wt=build/old-src
    rm -rf "$wt"
    git worktree prune
    git worktree add -q --detach "$wt" "$OLD"
    if [ -n "${OLD_PATCH:-}" ]; then git -C "$wt" apply "$(realpath "$OLD_PATCH")"; fi
    targets=(build/moeserve build/bench_step build/bench_a2a_cuda)
    for t in "$wt"/tests/test_cuda_*.c; do
        t=${t#"$wt"/}
        targets+=("build/${t%.c}")
    done
    make -C "$wt" -j2 "${targets[@]}" >/dev/null
    pack_build "$wt/build" "$dir/old"
    git worktree remove --force "$wt"
    echo "build/gpu/old: $OLD$([ -z "${OLD_PATCH:-}" ] || echo " with $OLD_PATCH")"
fi
# Every binary links the whole library, so they are mostly the same bytes: one dictionary wide
# enough to span them all (one thread: xz's threads would split it) packs them as one.
tar cf - -C build gpu | xz -T1 --lzma2=preset=3,dict=512MiB >build/gpu.txz
rm -rf "$dir"
echo "build/gpu.txz: $(du -h build/gpu.txz | cut -f1); on the GPU machine:"
echo "  tar xJf build/gpu.txz -C build && BUILD=build/gpu bash scripts/gpu_all.sh"
