#!/usr/bin/env bash
# test.sh — install, build, and run every test (GoogleTest under ctest), in both build
# configurations: the CPU one (build/), and the CUDA one (build-cuda/: -DFSDP_USE_CUDA=ON against
# the CUDA LibTorch and the CUDA toolkit, every target compiled and linked). Without a GPU the
# CUDA tests report skipped with their reason. Between them, a small third one (build-minimal/):
# the library and fsdp-train without the optional SentencePiece, with the tests of its refusals.
#
# Every configuration is built and tested even when an earlier one fails; the script ends with one
# summary line per configuration and exits 1 naming what failed (the format, the GPU machine's
# dependencies, a build, or tests).
#   FSDP_TEST_JOBS   ctest's parallelism (default 2)
#   FSDP_CTEST_ARGS  more ctest arguments for both configurations, e.g. "-L launcher"
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh || exit 1

summaries=()
failed=()

# The format first: it takes seconds, the build most of an hour. A misformatted file is reported
# with the rest, not instead of it.
if bash scripts/check-format.sh; then
  summaries+=("format: clean")
else
  summaries+=("format: FAILED (the files are named above; scripts/check-format.sh says how to format them)")
  failed+=("the format")
fi

# What a GPU machine without Debian's -dev packages can meet (scripts/check-gpu-deps.py, seconds): a
# new find_package(... REQUIRED) fails here rather than in a device call.
if python3 scripts/check-gpu-deps.py; then
  summaries+=("GPU machine's dependencies: every REQUIRED find met (scripts/gpu-deps.txt)")
else
  summaries+=("GPU machine's dependencies: FAILED (scripts/check-gpu-deps.py names them above)")
  failed+=("the GPU machine's dependencies")
fi

# disk_note DIR: when the disk that holds DIR is nearly full, why a build there failed, said in
# the summary line rather than only in a compiler's "No space left on device" far above it. A
# configuration's build folder takes about 2.5 GB (the CPU one; the CUDA one 2 GB).
disk_note() {
  local free_kb
  free_kb=$(df -Pk "$1" 2>/dev/null | awk 'NR == 2 { print $4 }')
  if [[ -n "$free_kb" && "$free_kb" -lt 2097152 ]]; then
    echo "; the disk is nearly full: $((free_kb / 1024)) MB free where $1/ is, and a build folder takes about" \
      "2.5 GB: free space (old build folders, ${TMPDIR:-/tmp}) and run again"
  fi
}

# configuration NAME BUILD_DIR "CMAKE ARGS" "CTEST ARGS" ["TARGETS"]: builds BUILD_DIR (only TARGETS
# when given) and runs its suite, adding a summary line (and, on failure, what failed).
configuration() {
  local name=$1 dir=$2 cmake_args=$3 ctest_args=$4 targets=${5:-}
  local log="$dir/ctest-output.log"
  # shellcheck disable=SC2086  # the arguments are lists of words
  if ! FSDP_BUILD_DIR="$dir" FSDP_BUILD_TARGETS="$targets" bash scripts/build.sh $cmake_args; then
    summaries+=("$name configuration ($dir/): BUILD FAILED, no tests run (its errors are above)$(disk_note "$dir")")
    failed+=("the $name build")
    return
  fi
  # shellcheck disable=SC2086
  (cd "$dir" && ctest --output-on-failure -j "${FSDP_TEST_JOBS:-2}" --timeout 900 $ctest_args \
    ${FSDP_CTEST_ARGS:-}) 2>&1 | tee "$log"
  local status=${PIPESTATUS[0]}
  local counts
  counts=$(grep -E "tests passed, [0-9]+ tests? failed out of" "$log" | tail -n 1)
  if [[ $status -eq 0 ]]; then
    summaries+=("$name configuration ($dir/): built; ${counts:-ctest passed}")
    return
  fi
  # ctest's list of the failed tests: "<number> - <name> (Failed)" lines at the end of its output.
  local names
  names=$(sed -n '/The following tests FAILED:/,$ s/^[[:space:]]*[0-9]* - \([^ ]*\) (.*/\1/p' "$log" | paste -sd, - |
    sed 's/,/, /g')
  summaries+=("$name configuration ($dir/): built; ${counts:-ctest failed (status $status)}; FAILED: ${names:-see $log}")
  failed+=("the $name tests (${names:-see $log})")
}

# -Werror: the build stays free of warnings (CMakeLists.txt). run-demo.sh builds with the same
# flags, so that its objects are this build's.
configuration CPU build "-DFSDP_WERROR=ON" ""
# fsdp-train without its optional package (SentencePiece: FSDP_WITH_SENTENCEPIECE=OFF), so that it
# stays optional: the library, fsdp-train and the tests of the keys that need the package. Every
# object but config.cpp's and tokenizer.cpp's is build/'s (ccache), so it costs the links and
# seconds of tests. (MPI is optional as before; leaving it out changes a definition every library
# object sees, so that configuration is the GPU machine's: scripts/gpu-prebuild.sh, gpu-check.sh.)
configuration "no optional packages" build-minimal \
  "-DFSDP_WERROR=ON -DFSDP_WITH_SENTENCEPIECE=OFF -DFSDP_BUILD_BENCHMARKS=OFF -DFSDP_BUILD_EXAMPLES=OFF" \
  "-R ^train\.(TrainConfig\.|Tokenizer\.|WithoutSentencePiece\.)" \
  "fsdp-train fsdp_train_config_tests fsdp_train_tokenizer_tests"
# The CUDA configuration. Its object files are the CPU configuration's (ccache) but for the
# CUDA path's, so it costs the CUDA sources, the links and its suite. The interop label (fsdp-train
# against Python's FSDP2, the longest part of the suite), the multihost one (network namespaces,
# fsdprun across hosts) and the memory one (a 0.2 B-parameter model's RSS against the plan) run in
# the CPU configuration only: the code they drive is the same object code in both.
configuration CUDA build-cuda "-DFSDP_WERROR=ON -DFSDP_USE_CUDA=ON" "-LE interop|multihost|memory"

echo
for line in "${summaries[@]}"; do echo "test.sh: $line"; done
if [[ ${#failed[@]} -gt 0 ]]; then
  printf -v what '%s; ' "${failed[@]}"
  echo "test.sh: FAILED: ${what%; }" >&2
  exit 1
fi
echo "test.sh: everything passed"
