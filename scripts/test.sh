#!/usr/bin/env bash
# test.sh — install, build, and run every test (GoogleTest under ctest), in both build
# configurations: the CPU one (build/), and the CUDA one (build-cuda/: -DFSDP_USE_CUDA=ON against
# the CUDA LibTorch and the CUDA toolkit, every target compiled and linked). Without a GPU the
# CUDA tests report skipped with their reason.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
# The format first: it takes seconds, the build most of an hour.
bash scripts/check-format.sh
# -Werror: the build stays free of warnings (CMakeLists.txt).
bash scripts/build.sh -DFSDP_WERROR=ON
(cd build && ctest --output-on-failure -j "${FSDP_TEST_JOBS:-2}" --timeout 900)
# The CUDA configuration. Its object files are the CPU configuration's (ccache) but for the
# CUDA path's, so it costs the CUDA sources, the links and its suite. The interop label (fsdp-train
# against Python's FSDP2, the longest part of the suite) and the multihost one (network namespaces,
# fsdprun across hosts) run in the CPU configuration only: the code they drive is the same object
# code in both.
FSDP_BUILD_DIR=build-cuda bash scripts/build.sh -DFSDP_WERROR=ON -DFSDP_USE_CUDA=ON
(cd build-cuda && ctest --output-on-failure -j "${FSDP_TEST_JOBS:-2}" --timeout 900 -LE "interop|multihost")
