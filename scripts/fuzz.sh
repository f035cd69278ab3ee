#!/usr/bin/env bash
# Builds the libFuzzer harnesses (clang, SINEW_BUILD_FUZZERS=ON, ./build-fuzz) and runs each
# given harness (default: all) for the given seconds (default 60; 0 only builds) on a
# scratch copy of its seed corpus, so the committed corpus never grows. Prints one line per
# harness,
#   FUZZ <name> secs=<s> execs=<n> crashes=<k>
# and exits non-zero if any harness crashed; the crashing inputs are kept in
# build-fuzz/findings/<name>/ (docs/fuzzing.md says how to reproduce them).
#
# A harness stops at its first crash (crashes=1). SINEW_FUZZ_FORK=1 runs libFuzzer in fork
# mode with crashes ignored instead, collecting every crash of a long run (it restarts the
# process per job, which costs libtorch's start-up each time, so it suits long runs only).
# Extra libFuzzer flags: SINEW_FUZZ_FLAGS.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${SINEW_FUZZ_BUILD_DIR:-build-fuzz}
secs=${1:-60}
shift || true
harnesses=("$@")
if [ ${#harnesses[@]} -eq 0 ]; then
  mapfile -t harnesses < <(sed -n 's/^sinew_add_fuzzer(\([a-z0-9_]*\).*/\1/p' fuzz/CMakeLists.txt)
fi

launcher=()
if command -v ccache >/dev/null; then launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache); fi
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_COMPILER=clang++ -DSINEW_BUILD_FUZZERS=ON -DSINEW_BUILD_TESTS=OFF \
  -DSINEW_BUILD_BENCHMARKS=OFF -DSINEW_BUILD_EXAMPLES=OFF -DSINEW_INSTALL=OFF \
  "${launcher[@]}" >/dev/null
cmake --build "$BUILD_DIR" -j "${SINEW_JOBS:-$(nproc)}" \
  --target "${harnesses[@]/#/fuzz_}"

# ASan's defaults (libFuzzer checks each input for leaks too); UBSan prints the stack.
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1}

if [ "$secs" -eq 0 ]; then
  echo "fuzz.sh: 0 seconds: built ${harnesses[*]}, ran nothing"
  exit 0
fi

status=0
for h in "${harnesses[@]}"; do
  if [ ! -d "fuzz/corpus/$h" ]; then
    echo "fuzz.sh: no harness named $h (fuzz/corpus/$h is missing)" >&2
    exit 2
  fi
  scratch="$BUILD_DIR/scratch/$h"
  findings="$BUILD_DIR/findings/$h"
  rm -rf "$scratch" "$findings"
  mkdir -p "$scratch/corpus" "$findings"
  cp "fuzz/corpus/$h"/* "$scratch/corpus/"
  log="$BUILD_DIR/findings/$h.log"
  start=$(date +%s)
  mode=()
  if [ "${SINEW_FUZZ_FORK:-0}" = 1 ]; then
    mode=(-fork=1 -ignore_crashes=1 -ignore_ooms=1 -ignore_timeouts=1)
  fi
  # One intra-op thread: libtorch's pool would only add noise to a 2-core run.
  OMP_NUM_THREADS=1 "$BUILD_DIR/fuzz/fuzz_$h" "$scratch/corpus" "${mode[@]}" \
    -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -malloc_limit_mb=1024 \
    -max_len=8192 -artifact_prefix="$findings/" -print_final_stats=1 \
    ${SINEW_FUZZ_FLAGS:-} >"$log" 2>&1 || true
  elapsed=$(($(date +%s) - start))
  # -print_final_stats=1 ends with "stat::number_of_executed_units: <n>"; fork mode reports
  # "#<n>: cov: ..." per job instead.
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  if [ -z "$execs" ]; then
    execs=$(grep -o '^#[0-9]*' "$log" | tail -1 | tr -d '#' || true)
  fi
  crashes=$(find "$findings" -type f | wc -l)
  echo "FUZZ $h secs=$elapsed execs=${execs:-0} crashes=$crashes"
  if [ "$crashes" -ne 0 ]; then
    status=1
    for f in "$findings"/*; do echo "  finding: $f (log: $log)"; done
  fi
done
exit $status
