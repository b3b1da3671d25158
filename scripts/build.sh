#!/usr/bin/env bash
# build.sh — configure and build fsdp-cpp (Release) into build/ with Ninja.
#   scripts/build.sh [extra cmake -D options]
set -euo pipefail
cd "$(dirname "$0")/.."
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release "$@"
cmake --build build -j "${FSDP_BUILD_JOBS:-2}"
