#!/usr/bin/env bash
# Installs Sinew's build and test dependencies from Debian. Idempotent: packages that
# are already installed are skipped, so running it twice costs one dpkg query.
# --bench also installs what the benchmarks compare with: python3-torch (PyTorch's
# DistributedDataParallel and torchrun, for sinew-bench-dp-vs-ddp).
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build ccache pkg-config git python3
  clang-format
  clang libfuzzer-14-dev
  libtorch-dev
  libopenmpi-dev openmpi-bin
  libboost-dev libboost-system-dev
  libssl-dev openssl
  libgloo-dev
  libgtest-dev
  nlohmann-json3-dev
  libcli11-dev
  curl gnuplot-nox
  etcd-server
  prometheus
  slurmctld slurmd slurm-client munge
)
if [[ "${1:-}" == "--bench" ]]; then PACKAGES+=(python3-torch); fi

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#PACKAGES[@]} packages present"
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
