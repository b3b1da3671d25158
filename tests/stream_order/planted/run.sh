#!/usr/bin/env bash
# run.sh — shows that the stream-order checker catches real defects: puts each one back into the
# source (a patch in this folder), rebuilds the library and the checker's tests in BUILD_DIR,
# runs the matrix test that meets it, and expects it to fail with a report naming the defect;
# then takes the patch out again. Needs a clean tree for the patched files.
#   bash tests/stream_order/planted/run.sh [BUILD_DIR]      # default: build
set -uo pipefail
cd "$(dirname "$0")/../../.."
build="${1:-build}"
here=tests/stream_order/planted
# patch | the matrix test | what its report must say
cases=(
  "one-rank-offload-aliases-host-memory|StreamOrder.CpuOffloadOnOneRank|mixes host memory"
  "one-rank-gradient-copy-not-waited-for|StreamOrder.CpuOffloadOnOneRankWithMixedPrecision|without synchronizing with it"
  "device-state-adamw-frees-a-copy-in-flight|StreamOrder.DeviceStateAdamW|allocated again"
  "all-gather-copy-out-without-its-wait|StreamOrder.FullShard|the all-gather output of"
  "reduce-scatter-copy-in-without-its-wait|StreamOrder.FullShard|the reduce-scatter input of"
)
failed=0
for c in "${cases[@]}"; do
  IFS='|' read -r name filter expected <<<"$c"
  git apply "$here/$name.patch" || { echo "run.sh: $name.patch does not apply"; failed=1; continue; }
  log=$(mktemp)
  if cmake --build "$build" -j2 --target fsdp_stream_order_tests >"$log" 2>&1; then
    "$build/tests/fsdp_stream_order_tests" --gtest_filter="$filter" >"$log" 2>&1
    rc=$?
    report=$(grep -m1 -E "^(fsdp stream check: |  - ).*$expected" "$log")
    if [[ $rc -ne 0 && -n "$report" ]]; then
      echo "caught   $name ($filter): ${report:0:400}"
    else
      echo "MISSED   $name ($filter): exit $rc, no report saying '$expected'"; failed=1
    fi
  else
    echo "run.sh: $name does not build (see $log)"; failed=1
  fi
  git apply -R "$here/$name.patch"
done
cmake --build "$build" -j2 --target fsdp_stream_order_tests >/dev/null 2>&1
exit $failed
