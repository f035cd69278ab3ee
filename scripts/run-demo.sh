#!/usr/bin/env bash
# Installs dependencies, builds Sinew and runs the demo: examples/train_dp trains a small MLP
# with 4 workers under sinew-run; worker 2 is SIGKILLed at step 30. The survivors recover
# and finish, and the last line compares the result with a single-process libtorch reference.
# Then sinew-timeline draws the run (build/demo-logs/run.png): samples/s, loss and members over
# time, with the failure and the recovery marked.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/build.sh
rm -rf build/demo-logs
status=0
build/runtime/sinew-run -n 4 --log-dir build/demo-logs \
  --inject "kill:worker=2:step=30:phase=backward" build/examples/train_dp "$@" || status=$?
runtime/tools/sinew-timeline build/demo-logs -o build/demo-logs/run.png || true
exit $status
