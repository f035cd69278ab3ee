#!/usr/bin/env bash
# Builds Sinew, its tests and tools with AddressSanitizer + UBSan (GCC, SINEW_SANITIZE=ON)
# into ./build-asan and runs the unit tests under ctest, leaving out the tests that
# docs/fuzzing.md lists with the reason for each. Extra arguments go to ctest.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${SINEW_ASAN_BUILD_DIR:-build-asan}

# Left out under the sanitizers; docs/fuzzing.md says why for each.
EXCLUDED=(
  install_consumer
  runtime_job_test
)

launcher=()
if command -v ccache >/dev/null; then launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache); fi
# -O1 -g1: the sanitizers' usual optimization level, with line tables for the reports.
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" \
  -DSINEW_SANITIZE=ON -DSINEW_BUILD_BENCHMARKS=OFF -DSINEW_INSTALL=OFF "${launcher[@]}"
cmake --build "$BUILD_DIR" -j "${SINEW_JOBS:-$(nproc)}"

# Each setting is explained in docs/fuzzing.md ("Sanitizer settings").
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=0:abort_on_error=1:detect_odr_violation=0}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}

exclude=$(IFS='|'; echo "^(${EXCLUDED[*]})\$")
ctest --test-dir "$BUILD_DIR" --output-on-failure --timeout 900 -E "$exclude" "$@"
