#!/usr/bin/env bash
# The simulator's benchmark (docs/goodput.md): sinew-sim on each node trace of traces/ with
# Sinew's model and the two reference models on the same throughput table (Sinew's cost model
# for gpt3_1.3b_v100.json), the synthetic traces run one interval past their last loss. Prints
# a table per trace; the last line is the 10-minute trace's
#   RESULT sim_goodput_vs_fixed_cost=<r> sim_goodput_vs_restart=<r>
# Usage: bench/sim/run.sh [BUILD_DIR] [extra sinew-sim flags...]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
build=${1:-$here/../../build}
shift || true
sim=$build/sim/sinew-sim
[ -x "$sim" ] || { echo "run.sh: $sim not built (scripts/build.sh)" >&2; exit 2; }
common=(--profile "$here/gpt3_1.3b_v100.json" --microbatches 256 --fault-tolerance 1
        --costs "$here/costs.json" --checkpoint-s 20 --restart-s 120 "$@")
last=""
# trace:duration_s (0: the trace's end); 10m last, for the RESULT line.
for t in 1h:57600 5m:4800 p3-trace:0 10m:9600; do
  name=${t%%:*}
  duration=${t##*:}
  out=$("$sim" --trace "$here/traces/$name.csv" --duration-s "$duration" "${common[@]}")
  printf '%s\n' "$out" | grep -v '^RESULT'
  last=$(printf '%s\n' "$out" | grep '^RESULT')
done
echo "$last"
