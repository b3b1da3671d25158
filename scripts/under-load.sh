#!/usr/bin/env bash
# under-load.sh — runs a selection of the suite N times beside two CPU-bound neighbours
# (stress-ng --cpu 2, from Debian), to show that the tests' timing assertions hold on a busy
# machine; prints each run's failures and, at the end, how often each test failed.
#   scripts/under-load.sh N [ctest arguments...]    e.g. scripts/under-load.sh 10 -L multihost
#   FSDP_BUILD_DIR   the build folder (default build); FSDP_TEST_JOBS  ctest's -j (default 1)
#   FSDP_UNDER_LOAD_LOGS  where each run's ctest output goes (default <build>/under-load)
set -uo pipefail
cd "$(dirname "$0")/.."
if [[ $# -lt 1 || ! $1 =~ ^[1-9][0-9]*$ ]]; then
  echo "under-load.sh: usage: scripts/under-load.sh RUNS [ctest arguments...], RUNS a positive count" >&2
  exit 2
fi
runs=$1
shift
build_dir="${FSDP_BUILD_DIR:-build}"
logs="${FSDP_UNDER_LOAD_LOGS:-$build_dir/under-load}"
if ! command -v stress-ng >/dev/null; then
  echo "under-load.sh: stress-ng not found: apt-get install stress-ng" >&2
  exit 1
fi
if [[ ! -f "$build_dir/CTestTestfile.cmake" ]]; then
  echo "under-load.sh: no test suite in '$build_dir': build it first (scripts/build.sh)" >&2
  exit 1
fi
mkdir -p "$logs"
stress-ng --cpu 2 --cpu-method matrixprod --timeout 0 --quiet &
neighbours=$!
trap 'kill "$neighbours" 2>/dev/null; wait "$neighbours" 2>/dev/null' EXIT
declare -A failures=()
failed_runs=0
for ((i = 1; i <= runs; ++i)); do
  log="$logs/run_$i.log"
  started=$SECONDS
  (cd "$build_dir" && ctest --output-on-failure -j "${FSDP_TEST_JOBS:-1}" "$@") >"$log" 2>&1
  status=$?
  counts=$(grep -E "tests passed, [0-9]+ tests? failed out of" "$log" | tail -n 1)
  names=""
  if [[ $status -ne 0 ]]; then
    ((++failed_runs))
    # From this run's own output (ctest's "<number> - <name> (Failed)" lines): another ctest
    # in the same folder may rewrite Testing/Temporary meanwhile.
    names=$(sed -n '/The following tests FAILED:/,$ s/^[[:space:]]*[0-9]* - \([^ ]*\) (.*/\1/p' "$log" | paste -sd' ' -)
    for n in $names; do failures[$n]=$((${failures[$n]:-0} + 1)); done
  fi
  echo "under-load.sh: run $i of $runs ($((SECONDS - started)) s): ${counts:-ctest status $status}${names:+; failed: $names} ($log)"
done
echo "under-load.sh: $((runs - failed_runs)) of $runs runs passed, beside 2 CPU-bound stress-ng workers"
for n in "${!failures[@]}"; do echo "under-load.sh:   $n failed ${failures[$n]} of $runs"; done
[[ $failed_runs -eq 0 ]]
