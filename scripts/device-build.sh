#!/usr/bin/env bash
# Builds Sinew on the lent GPU machine (Ubuntu, no Debian packages, python3's torch 2.x with
# CUDA) against that libtorch, as the device tool runs it from the repository root:
#   1. here: scripts/device-build.sh --download   (apt-get download the .debs into
#      build-device-debs/: Gloo and its runtime libraries, nlohmann-json, CLI11, googletest)
#   2. there: scripts/device-build.sh              (carry build-device-debs; unpacks them into
#      build-device/prefix with dpkg -x, never into /, and builds into build-device/)
# Extra arguments after -- go to ninja (targets). MPI is off there (no Open MPI).
set -euo pipefail
cd "$(dirname "$0")/.."
debs=(libgloo-dev libgloo0 libhiredis0.14 libibverbs1 libnl-3-200 libnl-route-3-200
      nlohmann-json3-dev libcli11-dev libgtest-dev)
if [ "${1:-}" = "--download" ]; then
  mkdir -p build-device-debs
  (cd build-device-debs && apt-get download "${debs[@]}")
  exit 0
fi
[ "${1:-}" = "--" ] && shift
prefix="$PWD/build-device/prefix"
mkdir -p "$prefix"
for d in build-device-debs/*.deb; do dpkg -x "$d" "$prefix"; done
# Debian's Gloo targets name the library by its absolute /usr/lib path.
sed -i "s|\"/usr/lib/|\"$prefix/usr/lib/|g" "$prefix"/usr/share/cmake/Gloo/GlooTargets-*.cmake
export LD_LIBRARY_PATH="$prefix/usr/lib:$prefix/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# NCCL: from the CUDA toolkit if it has it, else from the nvidia-nccl wheel torch uses (whose
# library has no unversioned libnccl.so link for find_library).
if [ ! -f /usr/local/cuda/include/nccl.h ] && [ -z "${NCCL_HOME:-}" ]; then
  wheel="$(python3 -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__))' \
    2>/dev/null || true)"
  if [ -n "$wheel" ] && [ -f "$wheel/include/nccl.h" ]; then
    mkdir -p build-device/nccl/lib
    ln -sfn "$wheel/include" build-device/nccl/include
    ln -sf "$wheel/lib/libnccl.so.2" build-device/nccl/lib/libnccl.so
    export NCCL_HOME="$PWD/build-device/nccl"
    export LD_LIBRARY_PATH="$wheel/lib:$LD_LIBRARY_PATH"
  fi
fi
# The programs need the unpacked libraries (libgloo's own dependencies are not on their
# RPATH): `source build-device/env.sh` before running tests, examples or benches there.
mkdir -p build-device
printf 'export LD_LIBRARY_PATH="%s"\n' "$LD_LIBRARY_PATH" > build-device/env.sh
torch_prefix="$(python3 -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')"
cmake -S . -B build-device -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_PREFIX_PATH="$torch_prefix;$prefix/usr" -DSINEW_INSTALL=OFF \
  -DCMAKE_CUDA_ARCHITECTURES=90 -DMPI_CXX_FOUND=OFF -DCMAKE_DISABLE_FIND_PACKAGE_MPI=ON
ninja -C build-device "$@"
