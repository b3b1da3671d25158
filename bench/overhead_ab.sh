#!/usr/bin/env bash
# overhead_ab.sh — `bench_fsdp overhead` of two builds of fsdp-cpp, alternating (A B A B ...),
# to show how a change moved the hook overhead at W = 1 and the step time.
#   bench/overhead_ab.sh BASE_BUILD_DIR NEW_BUILD_DIR [PAIRS] [-- bench_fsdp options]
# Prints every run's lines and, per build, the medians over runs of the plain and sharded step
# medians and of the ratio sharded / plain; then new / base for each.
set -euo pipefail
base=$1 new=$2 pairs=${3:-5}
shift $(( $# >= 3 ? 3 : $# ))
[[ ${1:-} == -- ]] && shift
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-1}
echo "OMP_NUM_THREADS=$OMP_NUM_THREADS OPENBLAS_NUM_THREADS=$OPENBLAS_NUM_THREADS OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-} (see docs/blas.md)"
out=$(mktemp -d)
for ((k = 1; k <= pairs; ++k)); do
  for side in base new; do
    dir=$base; [[ $side == new ]] && dir=$new
    "$dir/bench/bench_fsdp" overhead "$@" > "$out/$side.$k.txt"
    echo "== pair $k $side ($dir)"; grep -E 'plain|sharded' "$out/$side.$k.txt"
  done
done
python3 - "$out" "$pairs" <<'PY'
import re, statistics, sys
out, pairs = sys.argv[1], int(sys.argv[2])
def field(text, name):
    return float(re.search(rf"{name}\s+median\s+([0-9.]+) s", text).group(1))
res = {}
for side in ("base", "new"):
    runs = [open(f"{out}/{side}.{k}.txt").read() for k in range(1, pairs + 1)]
    plain = statistics.median(field(t, "plain") for t in runs)
    sharded = statistics.median(field(t, "sharded") for t in runs)
    ratio = statistics.median(float(re.search(r"ratio sharded / plain: ([0-9.]+)", t).group(1)) for t in runs)
    res[side] = (plain, sharded, ratio)
    print(f"{side}: plain {plain:.4f} s, sharded {sharded:.4f} s, ratio sharded/plain {ratio:.4f} (medians of {pairs})")
b, n = res["base"], res["new"]
print(f"new/base: plain {n[0] / b[0]:.3f}, sharded {n[1] / b[1]:.3f}, overhead ratio {n[2] / b[2]:.3f}")
PY
rm -rf "$out"
