#!/usr/bin/env bash
# Put next to the build the shared libraries that the GPU machine lacks (see ../shared/DESIGN.md:
# it has CUDA, NCCL, OpenMPI, libcurl, PCRE2, but not libmicrohttpd, libcJSON or this utf8proc),
# so binaries built here run there with LD_LIBRARY_PATH=build/gpu-libs.
#   scripts/gpu_bundle.sh [BINARY...]   (default: build/moeserve)
# On the GPU machine: `LD_LIBRARY_PATH=build/gpu-libs ldd build/moeserve | grep 'not found'`
# should print nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${BUILD:-build}/gpu-libs
mkdir -p "$out"
bins=("$@")
[ ${#bins[@]} -gt 0 ] || bins=("${BUILD:-build}/moeserve")
for b in "${bins[@]}"; do
    [ -x "$b" ] || { echo "gpu_bundle: $b is not built (make)" >&2; exit 1; }
    ldd "$b" | awk '/libmicrohttpd|libcjson|libutf8proc/ {print $3}' | while read -r lib; do
        cp -L -u "$lib" "$out/"
    done
done
ls "$out"
