#!/usr/bin/env bash
# gpu-bundle.sh — downloads, on a machine with Debian's mirror and PyPI, what scripts/gpu-check.sh
# needs to build on a GPU machine that has no network and no Debian -dev packages, into
# .gpu-bundle/ (git ignores it, so the device call must name it in `carry`):
#   *.deb     the Debian packages scripts/gpu-deps.txt names: GoogleTest, nlohmann-json, yaml-cpp and
#             zlib's headers (required), CLI11 and SentencePiece (optional); gpu-check.sh unpacks
#             them with dpkg -x into a folder of its own, installing nothing
#   wheels/   with --with-cmake only: the PyPI wheels of CMake and Ninja (27 MiB), for a machine that
#             has neither on its PATH (the GPU machine has both); gpu-check.sh installs them with
#             pip install --target into a folder of its own
#   cuda-headers-<version>.tar.gz   crt/ and nv/ of this machine's CUDA toolkit (CUDA_HOME, else
#             /usr/local/cuda; 0.1 MiB): the headers that ATen's CUDA headers reach and the torch
#             wheel's nvidia-* packages lack, for a GPU machine without nvcc
#             (cmake/FsdpCudaWithoutNvcc.cmake); used there only if its version is the wheel's
# CUDA's headers, NCCL's and PyTorch come from the GPU machine's PyTorch (its nvidia-* wheels).
# About 3 MiB without the wheels. Prints the total with the working tree and .gpu-prebuilt/
# (scripts/gpu-prebuild.sh), against the device call's 64 MiB.
#   bash scripts/gpu-bundle.sh [--with-cmake] [DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
with_cmake=0
[[ "${1:-}" == --with-cmake ]] && { with_cmake=1; shift; }
dir="${1:-.gpu-bundle}"
# The `find ... deb` and `deb` lines of scripts/gpu-deps.txt.
mapfile -t packages < <(sed 's/#.*//' scripts/gpu-deps.txt | awk '$1 == "find" && $3 == "deb" { print $4 } $1 == "deb" { print $2 }' |
  tr ',' '\n' | sort -u)
# CMake 3.x (4.0 dropped compatibility with projects that ask for < 3.5); any Ninja.
wheels=("cmake>=3.28,<4" "ninja>=1.11")
python="${FSDP_PYTHON:-python3}"
mkdir -p "$dir/wheels"
rm -f "$dir"/*.deb "$dir"/wheels/*.whl "$dir"/cuda-*.tar.gz
# apt-get download writes into the current folder; as root it warns that _apt cannot write
# there, which is harmless.
(cd "$dir" && apt-get download "${packages[@]}" 2>&1 | grep -v "^W: Download is performed unsandboxed" || true)
for p in "${packages[@]}"; do
  ls "$dir/${p}_"*.deb >/dev/null 2>&1 || { echo "gpu-bundle.sh: ${p} was not downloaded (apt-get update?)" >&2; exit 1; }
done
# The GPU machine's Python is 3.12 on x86-64 (manylinux); both wheels are pure-Python-tagged binaries.
if (( with_cmake )); then
  "$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
    -d "$dir/wheels" "${wheels[@]}"
  ls "$dir"/wheels/cmake-*.whl "$dir"/wheels/ninja-*.whl >/dev/null
else
  rmdir "$dir/wheels" 2>/dev/null || true
fi
cuda="${CUDA_HOME:-/usr/local/cuda}"
if [[ -f "$cuda/include/crt/host_config.h" && -f "$cuda/include/nv/target" ]]; then
  v=$(sed -n 's/^#define CUDA_VERSION \([0-9]*\).*/\1/p' "$cuda/include/cuda.h")
  tar -czf "$dir/cuda-headers-$((v / 1000)).$((v % 1000 / 10)).tar.gz" -C "$(readlink -f "$cuda/include")" crt nv
else
  echo "gpu-bundle.sh: note: no CUDA toolkit at $cuda: a GPU machine without nvcc cannot build" >&2
fi
mib() { echo "$(( ($1 + 524288) / 1048576 ))"; }
bundle=$(du -sb "$dir" | cut -f1)
prebuilt=$(du -sb .gpu-prebuilt 2>/dev/null | cut -f1 || true)
tree=$(git ls-files -co --exclude-standard -z | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
echo "gpu-bundle.sh: $(ls "$dir"/*.deb | wc -l) packages, $(ls "$dir"/wheels/*.whl 2>/dev/null | wc -l) wheels and" \
     "$(ls "$dir"/cuda-headers-*.tar.gz 2>/dev/null | wc -l) CUDA header tar in $dir: $(mib "$bundle") MiB; with the working" \
     "tree ($(mib "$tree") MiB) and .gpu-prebuilt ($(mib "${prebuilt:-0}") MiB) the device call carries" \
     "$(mib $((bundle + tree + ${prebuilt:-0}))) MiB of its 64"
