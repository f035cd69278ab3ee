#!/usr/bin/env bash
# The GPU checks in one run on the lent GPU machine (docs/gpu.md), as the device tool runs it
# from the repository root with build-device-debs carried (scripts/device-build.sh --download
# here first). Each phase has its own time limit so that a slow one leaves the others their
# time, and writes its log into $OUT (or ./device-logs) as it goes:
#   env.log    the machine: GPU, driver, nvcc, torch, Boost
#   build.log  the GPU tests' targets against python3's libtorch 2.x
#   gpu.log    ctest -L gpu
#   comm.log   the Gloo communicator tests (Gloo's loop and the shared device under libtorch 2.x)
#   all.log    the rest of the project, with -k 0, so that every compile error shows at once
# Usage: scripts/device-check.sh [seconds for the whole run, default 540]
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
budget="${1:-540}"
start=$(date +%s)
out="${OUT:-$PWD/device-logs}"
mkdir -p "$out"
left() { echo $((budget - ($(date +%s) - start))); }
phase() {  # phase NAME SECONDS COMMAND...: at most SECONDS, and never past the budget
  local name=$1 limit=$2
  shift 2
  local l
  l=$(left)
  ((limit > l)) && limit=$l
  if ((limit < 10)); then
    echo "== $name: skipped, $l s left" | tee -a "$out/summary.log"
    return
  fi
  local t0
  t0=$(date +%s)
  timeout -k 5 "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc $rc in $(($(date +%s) - t0)) s (limit $limit s)" | tee -a "$out/summary.log"
  tail -n 25 "$out/$name.log"
}
gpu_targets=(collectives_cuda_test checkpoint_cuda_snapshot_test runtime_gpu_job_test
             collectives_communicator_test)
phase env 30 bash -c 'nvidia-smi -L; nvidia-smi --query-gpu=driver_version --format=csv;
  nvcc --version | tail -n 2; python3 -c "import torch; print(torch.__version__, torch.version.cuda)";
  nproc; ls -d /usr/include/boost 2>&1; grep -m1 "define BOOST_LIB_VERSION" /usr/include/boost/version.hpp'
phase build 300 scripts/device-build.sh -- -k 0 "${gpu_targets[@]}"
grep -c "warning:" "$out/build.log" | sed 's/^/build warnings: /' | tee -a "$out/summary.log"
# shellcheck disable=SC1091
[ -f build-device/env.sh ] && source build-device/env.sh
phase gpu 240 ctest --test-dir build-device -L gpu --output-on-failure --timeout 200
phase comm 90 ctest --test-dir build-device -R '^collectives_communicator_test' \
  --output-on-failure --timeout 80
phase all 400 ninja -C build-device -k 0
grep -E "error:|warning:" "$out/all.log" "$out/build.log" | sort -u | head -n 40 \
  | tee -a "$out/summary.log"
cat "$out/summary.log"
