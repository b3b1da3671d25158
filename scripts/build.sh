#!/usr/bin/env bash
# build.sh — configure and build fsdp-cpp (Release) into build/ with Ninja, against the LibTorch
# that scripts/install-deps.sh installed (or FSDP_LIBTORCH; see scripts/torch-env.sh).
#   scripts/build.sh [extra cmake -D options]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/torch-env.sh
if [[ -z "$FSDP_TORCH_PREFIX" || ! -d "$FSDP_TORCH_PREFIX/share/cmake/Torch" ]]; then
  echo "build.sh: no LibTorch at '${FSDP_TORCH_PREFIX}' (no share/cmake/Torch there): run" \
       "scripts/install-deps.sh, or set FSDP_LIBTORCH to your LibTorch folder" >&2
  exit 1
fi
# The Python-side tests need a Python that imports torch; without one they report skipped.
test_python="$FSDP_PYTHON"
if ! "$test_python" -c "import torch" >/dev/null 2>&1; then
  echo "build.sh: note: '${test_python}' cannot import torch; the Python-side tests will report skipped" >&2
  test_python=""
fi
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$FSDP_TORCH_PREFIX" -DFSDP_PYTHON="$test_python" "$@"
cmake --build build -j "${FSDP_BUILD_JOBS:-2}"
