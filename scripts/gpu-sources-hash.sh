#!/usr/bin/env bash
# gpu-sources-hash.sh — one sha256 over the sources that .gpu-prebuilt/'s binaries are built from
# (the C++ and CMake files of src/, include/, tests/, tools/, cmake/ and the top CMakeLists.txt;
# path and content of each, in a fixed order). scripts/gpu-prebuild.sh writes it into the
# manifest, and scripts/gpu-check.sh uses the prebuilt binaries only when the tree it was sent
# hashes the same. Needs no git (the GPU machine may have none).
#   bash scripts/gpu-sources-hash.sh
set -euo pipefail
cd "$(dirname "$0")/.."
find src include tests tools cmake CMakeLists.txt -type f \
  \( -name '*.cpp' -o -name '*.cc' -o -name '*.h' -o -name '*.hpp' -o -name '*.cu' -o -name '*.cuh' \
     -o -name '*.cmake' -o -name '*.in' -o -name CMakeLists.txt \) -print0 |
  LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -c1-64
