#!/usr/bin/env bash
# Installs dependencies, builds Sinew and runs the demo: examples/train_gpt trains a small
# GPT-2-style decoder (its head tied to its token embedding; AdamW, warm-up + cosine, clipping,
# evaluation on a held-out split, epochs over a token file made from the licence texts under
# /usr/share/common-licenses) as pipelines on 8 workers, nodes of two, no worker able to hold
# the model (two pipelines of two nodes). At step 25 both workers of node 1 are SIGKILLed: the
# survivors reconfigure onto the three-node template, copy the lost layers from live replicas
# and finish (worker 0 then trains the reference: it gets 120 s to exit); the
# last line compares the gathered model with a single-process libtorch run of the same recipe
# (float64, so that "equal" means to about 1e-12). sinew-timeline draws the run
# (build/demo-logs/run.png): samples/s, loss and members over time, the failure and the
# recovery marked.
#
# --dp runs the data-parallel demo instead: examples/train_dp, a small MLP on 4 workers,
# worker 2 SIGKILLed at step 30. Other arguments go to the example.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/build.sh
rm -rf build/demo-logs
status=0
if [[ "${1:-}" == "--dp" ]]; then
  shift
  build/runtime/sinew-run -n 4 --log-dir build/demo-logs \
    --inject "kill:worker=2:step=30:phase=backward" build/examples/train_dp "$@" || status=$?
else
  build/runtime/sinew-run -n 8 --log-dir build/demo-logs --exit-grace-s 120 \
    --inject "kill:worker=2:step=25:phase=forward;kill:worker=3:step=25:phase=forward" \
    build/examples/train_gpt --devices-per-node 2 --memory-bytes 8000000 --float64 "$@" ||
    status=$?
fi
runtime/tools/sinew-timeline build/demo-logs -o build/demo-logs/run.png || true
exit $status
