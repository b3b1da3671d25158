#!/usr/bin/env bash
# ccache-reuse.sh — shows, from an empty ccache, that the CUDA configuration takes its object
# files from the CPU configuration's: builds the same objects in a CPU folder, then in a CUDA
# folder (build-reuse-cpu/, build-reuse-cuda/), and prints ccache's result for each compilation.
#   scripts/ccache-reuse.sh [object ...]
# By default the objects are one source of each precompiled header's family (the library's, the
# trainer's, the tests'), a source without one (fsdprun's), and the one CUDA test source whose
# compile command differs by a definition (a miss); the library's util layer comes with the configure
# step. Needs ccache and, for the CUDA folder, what scripts/build.sh -DFSDP_USE_CUDA=ON needs.
# Slow from an empty cache: each precompiled header takes minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v ccache >/dev/null; then
  echo "ccache-reuse.sh: ccache not found: run scripts/install-deps.sh" >&2
  exit 1
fi
objects=("$@")
if [[ ${#objects[@]} -eq 0 ]]; then
  objects=(tools/fsdprun/CMakeFiles/fsdprun.dir/options.cpp.o
           tools/fsdp-train/CMakeFiles/fsdp_train_checkpoints.dir/checkpoints/run_lock.cpp.o
           tests/CMakeFiles/fsdp_tests.dir/util/test_memory.cpp.o
           tests/CMakeFiles/fsdp_cuda_tests.dir/cuda/test_cuda_defects.cpp.o)
fi
cache=$(mktemp -d /tmp/fsdp-ccache-cold.XXXXXX)
trap 'rm -rf "$cache"' EXIT
for config in cpu cuda; do
  dir="build-reuse-$config"
  args=(-DFSDP_WERROR=ON)
  [[ $config == cuda ]] && args+=(-DFSDP_USE_CUDA=ON)
  rm -rf "$dir"
  stats="$cache/stats-$config.log"
  CCACHE_DIR="$cache" CCACHE_STATSLOG="$stats" FSDP_BUILD_DIR="$dir" FSDP_BUILD_TARGETS=fsdp_util \
    bash scripts/build.sh "${args[@]}" >"$cache/build-$config.log" 2>&1 ||
    { cat "$cache/build-$config.log" >&2; exit 1; }
  CCACHE_DIR="$cache" CCACHE_STATSLOG="$stats" ninja -C "$dir" -j 1 "${objects[@]}" >>"$cache/build-$config.log" 2>&1 ||
    { cat "$cache/build-$config.log" >&2; exit 1; }
  # The stats log: "# <source>" then that compilation's result counters.
  awk -v config="$config" '
    /^# / { source = $2; next }
    /^(direct|preprocessed)_cache_hit$/ { result[source] = "hit (" $1 ")" }
    /^cache_miss$/ { if (!(source in result)) result[source] = "miss" }
    !/^(local_storage|remote_storage)|_(hit|miss)$/ { if (!(source in result)) result[source] = "not cached: " $1 }
    END {
      hits = 0
      for (s in result) { printf "ccache-reuse.sh: %-4s %-70s %s\n", config, s, result[s]; hits += (result[s] ~ /^hit/) }
      printf "ccache-reuse.sh: %s configuration: %d of %d compilations were ccache hits\n", config, hits, length(result)
    }' "$stats"
done
