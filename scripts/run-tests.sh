#!/usr/bin/env bash
# Installs dependencies, builds Sinew, checks formatting and runs every test with ctest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/build.sh
scripts/check-format.sh
ctest --test-dir build --output-on-failure --timeout 900 "$@"
