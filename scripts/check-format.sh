#!/usr/bin/env bash
# Fails if any C++ file differs from .clang-format's style.
set -euo pipefail
cd "$(dirname "$0")/.."
mapfile -t files < <(git ls-files '*.h' '*.cc' 2>/dev/null || find . -name '*.h' -o -name '*.cc')
if [ ${#files[@]} -eq 0 ]; then exit 0; fi
clang-format --dry-run -Werror "${files[@]}"
echo "check-format: ${#files[@]} files formatted correctly"
