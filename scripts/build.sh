#!/usr/bin/env bash
# Configures and builds Sinew into ./build (Ninja, ccache when present). RelWithDebInfo with
# line tables only (-g1): stacks and sanitizer reports keep file:line, and a build of the
# libtorch-heavy sources takes about half the time of CMake's default full -g. Pass
# -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2 -g -DNDEBUG" for variables in gdb.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${SINEW_BUILD_DIR:-build}
launcher=()
if command -v ccache >/dev/null; then launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache); fi
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2 -g1 -DNDEBUG" "${launcher[@]}" "$@"
cmake --build "$BUILD_DIR" -j "${SINEW_JOBS:-$(nproc)}"
