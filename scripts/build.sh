#!/usr/bin/env bash
# build.sh — configure and build fsdp-cpp (Release) into build/ with Ninja, against the LibTorch
# that scripts/install-deps.sh installed (or FSDP_LIBTORCH; see scripts/torch-env.sh).
#   scripts/build.sh [extra cmake -D options]
#   FSDP_BUILD_DIR=build-cuda scripts/build.sh -DFSDP_USE_CUDA=ON    # the CUDA configuration
#   FSDP_BUILD_TARGETS="fsdp-train fsdprun" scripts/build.sh            # only those, and what they link
# With ccache installed, compilations go through it (cache in ~/.cache/fsdp-cpp/ccache): every
# object file but the CUDA path's is the same in both configurations (cmake/FsdpTorch.cmake), so
# the second configuration compiles only those and links.
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
build_dir="${FSDP_BUILD_DIR:-build}"
launcher=()
if command -v ccache >/dev/null 2>&1; then
  # Paths under the repository are hashed relative to the build folder, so that the two
  # configurations' folders share entries; the precompiled headers need the sloppiness. The
  # settings live in the build folder's compiler launcher, not only in this script's environment,
  # so that a build started by hand (cmake --build, ninja) uses the same cache the same way:
  # without them it went to ccache's default folder, where every file compiled with a
  # precompiled header is uncacheable, and compiled the tree again.
  ccache_env=("CCACHE_DIR=${CCACHE_DIR:-$HOME/.cache/fsdp-cpp/ccache}" "CCACHE_BASEDIR=$PWD"
              "CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime"
              "CCACHE_MAXSIZE=${CCACHE_MAXSIZE:-4G}")
  export "${ccache_env[@]}"  # for the statistics below
  printf -v launcher_list '%s;' "$(command -v cmake)" -E env "${ccache_env[@]}" "$(command -v ccache)"
  launcher=("-DCMAKE_CXX_COMPILER_LAUNCHER=${launcher_list%;}")
fi
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release "${launcher[@]}" \
  -DCMAKE_PREFIX_PATH="$FSDP_TORCH_PREFIX" -DFSDP_PYTHON="$test_python" "$@"
# FSDP_BUILD_TARGETS: only these targets (and what they link), e.g. "fsdp-train fsdprun".
targets=()
for t in ${FSDP_BUILD_TARGETS:-}; do targets+=(--target "$t"); done
cmake --build "$build_dir" -j "${FSDP_BUILD_JOBS:-2}" "${targets[@]}"
if [[ ${#launcher[@]} -gt 0 ]]; then ccache --show-stats 2>/dev/null | grep -Ei "hits|misses" | head -4 || true; fi
