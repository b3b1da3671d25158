#!/usr/bin/env bash
# gpu-rehearse.sh — runs scripts/gpu-check.sh --cpu in a root that holds only what the GPU machine
# holds, on a machine without a GPU (as root: it uses mmdebstrap, unshare and chroot):
#   make-root DIR   once, with network: DIR/root from Debian's packages (mmdebstrap
#                   --variant=minbase bookworm) with only the compiler (g++), python3 and its venv
#                   module, CMake and Ninja; then a venv at /opt/torch/.venv (where the GPU
#                   machine's python3 lives) holding the torch 2.11.0 wheel and numpy from PyPI,
#                   the Python packages of the GPU machine's list that gpu-check.sh uses. No CUDA
#                   toolkit, no Debian -dev package, no git, no pkg-config.
#   run DIR [gpu-check.sh options]
#                   copies what a device call sends (the working tree: tracked and untracked files
#                   git does not ignore, plus the carried .gpu-bundle and .gpu-prebuilt) into
#                   DIR/root/work/repo, then runs gpu-check.sh --cpu there in namespaces of its own:
#                   its own network namespace (loopback only), its own process and mount
#                   namespaces, chrooted into DIR/root, so that nothing of this machine's /usr,
#                   /opt or ~/.cache is visible; an empty HOME, an environment of PATH (the venv
#                   first, as python3 is the GPU machine's torch), HOME and OUT alone, /tmp and
#                   /dev/shm fresh tmpfs. Results in DIR/out (gpu-check.sh's $OUT) and
#                   DIR/root/work/repo/gpu-results.
# The two rehearsals of docs/gpu.md:
#   bash scripts/gpu-rehearse.sh run DIR                    # the prebuilt binaries
#   bash scripts/gpu-rehearse.sh run DIR --prebuilt no      # the build from the carried bundle
# Each prints every step's time (gpu-check.sh's summary.tsv) and the size of what was carried.
# REHEARSE_WARM=1 keeps the last run's build-gpu/ and gpu-results/, as a warm machine does (a
# second call: gpu-check.sh --rest).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
what="${1:-}"; dir="${2:-}"
[[ "$what" =~ ^(make-root|run)$ && -n "$dir" ]] || { echo "usage: gpu-rehearse.sh make-root|run DIR [gpu-check.sh options]" >&2; exit 2; }
shift 2
mkdir -p "$dir" && dir=$(cd "$dir" && pwd)
root="$dir/root"
torch_release=2.11.0

if [[ "$what" == make-root ]]; then
  [[ ! -e "$root" ]] || { echo "gpu-rehearse.sh: $root exists; remove it first" >&2; exit 1; }
  mmdebstrap --mode=root --variant=minbase --include=g++,python3,python3-venv,cmake,ninja-build \
    bookworm "$root" http://deb.debian.org/debian
  py=$(chroot "$root" python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
  # The wheels for the root's Python, downloaded here and installed there without network.
  platforms=()
  for n in 5 12 17 18 24 25 27 28; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
  python3 -m pip download -q --only-binary=:all: --python-version "$py" --implementation cp "${platforms[@]}" \
    --platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64 --platform any \
    -d "$dir/wheels" "torch==$torch_release" numpy
  mkdir -p "$root/wheels"
  mount --bind "$dir/wheels" "$root/wheels"
  rc=0
  chroot "$root" env -i PATH=/usr/bin:/bin sh -c "python3 -m venv /opt/torch/.venv &&
    /opt/torch/.venv/bin/pip install -q --no-index --find-links /wheels torch==$torch_release numpy" || rc=$?
  umount "$root/wheels" && rmdir "$root/wheels"
  (( rc == 0 )) || exit $rc
  echo "gpu-rehearse.sh: $root: $(du -sh "$root" | cut -f1); $(chroot "$root" /opt/torch/.venv/bin/python3 -c \
    'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)')"
  exit 0
fi

[[ -x "$root/opt/torch/.venv/bin/python3" ]] || { echo "gpu-rehearse.sh: no $root: run make-root first" >&2; exit 1; }
# ---------------------------------------------------------------- what a device call sends
t0=$(date +%s)
# REHEARSE_WARM=1: the build folder and results of the last run stay, as on a warm GPU machine
# (its ignored build outputs are kept between calls).
if [[ "${REHEARSE_WARM:-0}" == 1 && -d "$root/work/repo" ]]; then
  find "$root/work/repo" -mindepth 1 -maxdepth 1 ! -name build-gpu ! -name gpu-results -exec rm -rf {} +
else
  rm -rf "$root/work"
fi
rm -rf "$dir/out" "$root/home/empty"
mkdir -p "$root/work/repo" "$dir/out" "$root/home/empty"
git ls-files -co --exclude-standard -z | while IFS= read -r -d '' f; do [[ -e "$f" ]] && printf '%s\0' "$f"; done |
  tar --null -T - -cf - | tar -xf - -C "$root/work/repo"
carried=()
for c in .gpu-bundle .gpu-prebuilt; do [[ -d "$c" ]] && carried+=("$c") && cp -a "$c" "$root/work/repo/"; done
mib() { echo "$(( ($1 + 524288) / 1048576 ))"; }
size=$(du -sb "$root/work/repo" | cut -f1)
echo "gpu-rehearse.sh: sent $(mib "$size") MiB (the working tree and ${carried[*]:-nothing carried}: $(for c in "${carried[@]}"; do echo -n "$c $(mib "$(du -sb "$c" | cut -f1)") MiB "; done)) in $(( $(date +%s) - t0 ))s"
(( size < 64 * 1048576 )) || echo "gpu-rehearse.sh: WARNING: over the device call's 64 MiB" >&2

# ---------------------------------------------------------------- the run
# What runs inside the root: a line on what it sees, then gpu-check.sh.
cat > "$root/work/inner.sh" <<'INNER'
cd /work/repo || exit 1
echo "gpu-rehearse: in the root: $(python3 --version) at $(command -v python3); cmake $(command -v cmake);" \
     "nvcc $(command -v nvcc || echo none); git $(command -v git || echo none); pkg-config $(command -v pkg-config || echo none);" \
     "network interfaces: $(tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' ' | tr '\n' ' ');" \
     "HOME $HOME with $(ls -A "$HOME" | wc -l) files; /usr/local: $(ls -A /usr/local/bin | wc -l) programs"
exec bash scripts/gpu-check.sh --cpu --jobs "$(nproc)" --budget 100000 --slow 20 "$@"
INNER
export REHEARSE_ROOT="$root" REHEARSE_OUT="$dir/out"
rc=0
unshare --mount --net --pid --fork --propagation private bash -c '
  set -e
  ip link set lo up 2>/dev/null || true
  mount -t proc proc "$REHEARSE_ROOT/proc"
  mount -t tmpfs tmpfs "$REHEARSE_ROOT/tmp"
  mount -t tmpfs tmpfs "$REHEARSE_ROOT/dev/shm"
  mkdir -p "$REHEARSE_ROOT/out" && mount --bind "$REHEARSE_OUT" "$REHEARSE_ROOT/out"
  exec chroot "$REHEARSE_ROOT" /usr/bin/env -i HOME=/home/empty OUT=/out \
    PATH=/opt/torch/.venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    bash /work/inner.sh "$@"
' bash "$@" || rc=$?
echo "gpu-rehearse.sh: gpu-check.sh exited $rc; each step (summary.tsv: step, rc, seconds, verdict, detail):"
column -t -s $'\t' "$dir/out/summary.tsv" 2>/dev/null | cut -c1-220 || cat "$dir/out/summary.tsv"
echo "gpu-rehearse.sh: $(ls "$dir/out" | wc -l) files in $dir/out: $(ls "$dir/out" | tr '\n' ' ')"
exit $rc
