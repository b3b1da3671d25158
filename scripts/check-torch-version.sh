#!/usr/bin/env bash
# check-torch-version.sh — compiles the library against another LibTorch release's headers and
# links it against its libraries, to show that src/util/compat.h covers it. Not part of CI:
# it downloads that release's wheel (about 0.9 GiB, once; kept in ~/.cache/fsdp-cpp) and builds
# the library alone into build-torch-<version>/.
#
#   scripts/check-torch-version.sh            # 2.11.0, the oldest release fsdp-cpp supports
#   scripts/check-torch-version.sh 2.13.0
#
# Only the torch wheel itself is fetched (no nvidia-* wheels): compiling and linking a shared
# library needs LibTorch's headers, CMake files and libraries, not the CUDA libraries they load.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/torch-env.sh

version="${1:-2.11.0}"
cache="${HOME}/.cache/fsdp-cpp"
wheels="${cache}/wheels"
prefix="${cache}/libtorch-${version}"
build="build-torch-${version}"

if [[ ! -d "${prefix}/torch/share/cmake/Torch" ]]; then
  mkdir -p "$wheels"
  if ! ls "$wheels"/torch-"${version}"-*.whl >/dev/null 2>&1; then
    echo "check-torch-version: downloading the torch ${version} wheel into ${wheels}"
    "$FSDP_PYTHON" -m pip download -q --no-deps --only-binary=:all: -d "$wheels" "torch==${version}"
  fi
  wheel="$(ls "$wheels"/torch-"${version}"-*.whl | head -n 1)"
  echo "check-torch-version: unpacking LibTorch from $(basename "$wheel")"
  rm -rf "$prefix"
  mkdir -p "$prefix"
  "$FSDP_PYTHON" - "$wheel" "$prefix" <<'PY'
import sys, zipfile
wheel, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    names = [n for n in z.namelist()
             if n.startswith(("torch/include/", "torch/share/cmake/", "torch/lib/"))]
    z.extractall(out, names)
    for n in names:  # keep the libraries' execute bits
        if n.startswith("torch/lib/"):
            import os
            os.chmod(os.path.join(out, n), 0o755)
PY
fi

echo "check-torch-version: configuring ${build} against LibTorch ${version}"
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="${prefix}/torch" \
  -DFSDP_BUILD_TESTS=OFF -DFSDP_BUILD_BENCHMARKS=OFF -DFSDP_BUILD_EXAMPLES=OFF -DFSDP_BUILD_TOOLS=OFF \
  > "${build}.configure.log" 2>&1 || { tail -n 30 "${build}.configure.log"; exit 1; }
grep -E '^-- fsdp: LibTorch' "${build}.configure.log"
start=$(date +%s)
cmake --build "$build" -j "${FSDP_BUILD_JOBS:-2}" --target fsdp
echo "check-torch-version: the library compiled and linked against LibTorch ${version}" \
     "in $(( $(date +%s) - start )) s (${build}/src/libfsdp.so)"
