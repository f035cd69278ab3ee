#!/usr/bin/env bash
# Configures and builds Sinew into ./build (Ninja, ccache when present). RelWithDebInfo with
# line tables only (-g1): stacks and sanitizer reports keep file:line, and a build of the
# libtorch-heavy sources takes about half the time of CMake's default full -g. Pass
# -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2 -g -DNDEBUG" for variables in gdb.
# The libraries build as unity builds (CMake's UNITY_BUILD, 8 sources per unit: libtorch's
# headers parsed once per unit, not once per source; their cold build took 172 s instead of
# about 375 s). SINEW_UNITY_BUILD=OFF compiles each source on its own, which suits editing one
# file at a time and checks that every source includes what it uses.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${SINEW_BUILD_DIR:-build}
launcher=()
if command -v ccache >/dev/null; then launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache); fi
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2 -g1 -DNDEBUG" \
  -DCMAKE_UNITY_BUILD="${SINEW_UNITY_BUILD:-ON}" -DCMAKE_UNITY_BUILD_BATCH_SIZE=8 \
  "${launcher[@]}" "$@"
cmake --build "$BUILD_DIR" -j "${SINEW_JOBS:-$(nproc)}"
