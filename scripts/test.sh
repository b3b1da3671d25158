#!/usr/bin/env bash
# test.sh — install, build, and run every test (GoogleTest under ctest).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
# The format first: it takes seconds, the build most of an hour.
bash scripts/check-format.sh
# -Werror: the build stays free of warnings (CMakeLists.txt).
bash scripts/build.sh -DFSDP_WERROR=ON
cd build
ctest --output-on-failure -j "${FSDP_TEST_JOBS:-2}" --timeout 900
