#!/usr/bin/env bash
# fresh-clone-times.sh — how long a newcomer waits. Clones this repository at COMMIT into a
# scratch folder, with the install already there (scripts/install-deps.sh's venv and Debian's
# packages) but an empty ccache of its own, runs scripts/run-demo.sh and, with --then-test,
# scripts/test.sh after it, and writes to LOG every line they print, stamped with the seconds since
# the start, and ccache's counts after each command. docs/building.md's table of the demo's first
# training step and test.sh's times came from it.
#   scripts/fresh-clone-times.sh --first-step COMMIT LOG   # the demo until its first step line
#   scripts/fresh-clone-times.sh --then-test COMMIT LOG    # the whole demo, then test.sh
# Needs ccache. Run it on a quiet machine: the times are the point.
set -euo pipefail
usage="usage: $0 --first-step|--then-test COMMIT LOG"
mode=${1:?$usage} commit=${2:?$usage} log=${3:?$usage}
[[ $mode == --first-step || $mode == --then-test ]] || { echo "$0: unknown mode '$mode'; $usage" >&2; exit 2; }
command -v ccache >/dev/null || { echo "$0: ccache not found: run scripts/install-deps.sh" >&2; exit 1; }
repo=$(cd "$(dirname "$0")/.." && pwd)
log=$(realpath -m "$log")
scratch=$(mktemp -d /tmp/fsdp-fresh-clone.XXXXXX)
trap 'rm -rf "$scratch"' EXIT
export CCACHE_DIR=$scratch/ccache
git clone -q "$repo" "$scratch/clone"
git -C "$scratch/clone" checkout -q "$commit"
cd "$scratch/clone"

start_us=${EPOCHREALTIME/./}
# Each line prefixed with the seconds since the start, to a tenth.
stamp() {
  local line d
  while IFS= read -r line; do
    d=$(( ${EPOCHREALTIME/./} - start_us ))
    printf '%6d.%d %s\n' $((d / 1000000)) $(((d / 100000) % 10)) "$line"
  done
}
# The demo's fsdprun and fsdp-train: those running in the clone, not another checkout's.
stop_demo() {
  local pid
  for pid in $(pgrep -f "build/tools/fsdp" || true); do
    [[ $(readlink "/proc/$pid/cwd" 2>/dev/null) == "$scratch/clone"* ]] && kill "$pid" 2>/dev/null || true
  done
}
counts() { echo "== ccache after $1:"; ccache --show-stats | grep -E "Cacheable|Hits|Misses" | head -3; }

{
  echo "== $(git log -1 --format='%h %s') | $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2-) |" \
       "$(nproc) CPUs | $(date -u +%FT%TZ)"
  ccache --zero-stats >/dev/null
  if [[ $mode == --first-step ]]; then
    # The demo is stopped at its first step line: what is measured is the wait for it.
    set +o pipefail
    bash scripts/run-demo.sh 2>&1 | stamp | while IFS= read -r line; do
      echo "$line"
      if [[ $line == *"step: "* ]]; then
        echo "== first step line"
        stop_demo
        break
      fi
    done
    set -o pipefail
    counts run-demo.sh
  else
    rc=0
    bash scripts/run-demo.sh 2>&1 | stamp || rc=$?
    echo "== run-demo.sh exit code $rc"
    counts run-demo.sh
    rc=0
    bash scripts/test.sh 2>&1 | stamp || rc=$?
    echo "== test.sh exit code $rc"
    counts "run-demo.sh and test.sh"
  fi
  echo "== end $(date -u +%FT%TZ)"
} >"$log" 2>&1
grep -E "^== |first step|built in|test.sh: " "$log" || true
