#!/usr/bin/env bash
# Installs dependencies, builds Sinew and runs the demo: a small job of 4 worker processes
# that survives one worker being SIGKILLed mid-run.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/build.sh
build/examples/collectives_demo "$@"
