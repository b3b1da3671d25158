#!/usr/bin/env bash
# gpu-rehearse.sh — runs scripts/gpu-check.sh --cpu under the GPU machine's constraints, on a
# machine without a GPU (as root: it uses unshare): no network (a network namespace with only
# loopback), no CUDA toolkit (/usr/local/cuda's target hidden under a tmpfs, nvcc and ptxas masked),
# no cmake, ctest, cpack, ninja or ccache (masked, and left out of a PATH made for the run), and
# python3 the given venv (the GPU machine's is Python 3.12 with torch 2.11). The CUDA tests then
# report skipped, the race tests run their plumbing on the CPU stand-in, and the trainer steps run
# on device cpu. Needs .gpu-bundle/ (scripts/gpu-bundle.sh). Results in gpu-results/ and $OUT.
#
#   python3.12 -m venv /work/gpu-rehearsal/venv312 && /work/gpu-rehearsal/venv312/bin/pip install 'torch==2.11.*' numpy
#   OUT=/work/gpu-rehearsal/out bash scripts/gpu-rehearse.sh /work/gpu-rehearsal/venv312 [gpu-check.sh options]
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:?usage: gpu-rehearse.sh VENV [gpu-check.sh options]}"; shift
[[ -x "$venv/bin/python3" ]] || { echo "gpu-rehearse.sh: no $venv/bin/python3" >&2; exit 2; }
farm=$(mktemp -d /tmp/gpu-rehearse-path.XXXXXX)
masked=(cmake ctest cpack ccmake ninja ccache nvcc ptxas)
for f in /usr/bin/*; do
  b=${f##*/}
  [[ " ${masked[*]} " == *" $b "* ]] || ln -s "$f" "$farm/$b"
done
cuda=$(readlink -f /usr/local/cuda 2>/dev/null || true)
export REHEARSE_PATH="$venv/bin:$farm:/usr/sbin" REHEARSE_CUDA="$cuda" REHEARSE_MASKED="${masked[*]}"
rc=0
unshare -mn --propagation private bash -c '
  set -e
  [[ -n "$REHEARSE_CUDA" && -d "$REHEARSE_CUDA" ]] && mount -t tmpfs tmpfs "$REHEARSE_CUDA"
  for b in $REHEARSE_MASKED; do
    for d in /usr/bin /usr/local/bin; do [[ -e $d/$b ]] && mount --bind /dev/null $d/$b; done
  done
  ip link set lo up
  export PATH=$REHEARSE_PATH
  unset CMAKE_CXX_COMPILER_LAUNCHER CCACHE_DIR
  echo "gpu-rehearse: python3 $(python3 --version 2>&1) at $(command -v python3); cmake: $(command -v cmake || echo none);" \
       "ninja: $(command -v ninja || echo none); nvcc: $(command -v nvcc || echo none); network: loopback only"
  exec bash scripts/gpu-check.sh --cpu --jobs "$(nproc)" --budget 100000 --slow 20 "$@"
' bash "$@" || rc=$?
rm -rf "$farm"
exit $rc
