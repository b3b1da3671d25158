#!/usr/bin/env bash
# gpu-prebuild.sh — builds, on this machine, what scripts/gpu-check.sh runs on the GPU machine, against
# that machine's exact PyTorch (torch 2.11.0 with CUDA 13.0, the PyPI wheel, in a scratch venv), and
# packs it into .gpu-prebuilt/ (git ignores it; the device call names it in `carry`), so that the
# first device call spends its minutes on tests, not on a cold build:
#   build/src/libfsdp.so.<soversion>, build/src/libfsdp_cuda.so, build/tests/fsdp_cuda_tests,
#   build/tools/fsdp-train/fsdp-train, build/tools/fsdprun/fsdprun
#             the CUDA configuration, Release, stripped, in the build tree's layout (the bench
#             scripts take the folder as --build-dir); MPI left out, SentencePiece in
#   lib/      every shared library they need that is neither the GPU machine's torch or nvidia-*
#             libraries nor glibc or libstdc++/libgcc_s (yaml-cpp, sentencepiece, zlib: closed
#             under ldd; scripts/check-gpu-deps.py checks it again)
#   lib-cxx/  this machine's libstdc++ and libgcc_s, used there only if the machine's own are older
#             than the binaries need (gpu-check.sh asks ldd)
#   manifest.txt  torch and CUDA versions, the commit, a hash of the sources the binaries are built
#             from, the glibc and libstdc++ versions they need, the build machine, and each file's
#             sha256
# gpu-check.sh uses them when the machine's torch.__version__ and torch.version.cuda match the
# manifest and the tree's sources hash to the manifest's; otherwise it builds, as before.
# Without a GPU the same binaries run their tests here (SKIPPED, with the reason) against the
# scratch venv's torch: `bash scripts/gpu-prebuild.sh --check` after the build.
#
#   bash scripts/gpu-prebuild.sh [--check] [--jobs N]
#   FSDP_PREBUILT_TORCH       the torch release (default 2.11.0: the GPU machine's)
#   FSDP_PREBUILT_VENV        the scratch venv (default ~/.cache/fsdp-cpp/venv-torch-<release>; about
#                             5 GiB with the CUDA wheels; made when missing, from PyPI)
#   FSDP_PREBUILT_BASE_PYTHON the Python that makes it (default python3.12, the GPU machine's, if
#                             found, else python3)
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
check=0
jobs=${FSDP_BUILD_JOBS:-2}
while [[ $# -gt 0 ]]; do
  case "$1" in
    --check) check=1 ;;
    --jobs) jobs="$2"; shift ;;
    *) echo "gpu-prebuild.sh: unknown argument '$1' (see the header of $0)" >&2; exit 2 ;;
  esac
  shift
done
torch_release=${FSDP_PREBUILT_TORCH:-2.11.0}
venv=${FSDP_PREBUILT_VENV:-$HOME/.cache/fsdp-cpp/venv-torch-$torch_release}
build=build-gpu-prebuilt
pack=.gpu-prebuilt
t0=$(date +%s)
say() { echo "gpu-prebuild.sh [+$(( $(date +%s) - t0 ))s]: $*"; }

# ---------------------------------------------------------------- the scratch venv
if ! "$venv/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$torch_release')" 2>/dev/null; then
  base=${FSDP_PREBUILT_BASE_PYTHON:-$(command -v python3.12 || command -v python3)}
  say "making $venv with $base and torch==$torch_release from PyPI (about 5 GiB)"
  rm -rf "$venv"
  "$base" -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check "torch==$torch_release" numpy
fi
python="$venv/bin/python"
read -r torch_version torch_cuda torch_dir < <("$python" -c \
  'import os, torch; print(torch.__version__, torch.version.cuda, os.path.dirname(torch.__file__))')
say "torch $torch_version (CUDA $torch_cuda) at $torch_dir"
site=$(dirname "$torch_dir")
# The libraries the GPU machine's torch brings: torch's own and the nvidia-* wheels'.
torch_libs="$torch_dir/lib$(for d in "$site"/nvidia/*/lib "$site"/nvidia/*/*/lib; do [[ -d $d ]] && printf ':%s' "$d"; done; true)"

# ---------------------------------------------------------------- build
if (( ! check )); then
  # The sources as the build reads them; a change during the build makes the manifest's hash a lie.
  sources=$(bash scripts/gpu-sources-hash.sh)
  nvcc_option=()
  if ! command -v nvcc >/dev/null && [[ ! -x /usr/local/cuda/bin/nvcc ]]; then
    nvcc_option=(-DFSDP_CUDA_WITHOUT_NVCC=ON)
    headers=$(ls .gpu-bundle/cuda-headers-"$torch_cuda".tar.gz 2>/dev/null || true)
    [[ -n "$headers" ]] || { echo "gpu-prebuild.sh: no nvcc and no .gpu-bundle/cuda-headers-$torch_cuda.tar.gz" >&2; exit 1; }
    mkdir -p "$build/cuda-headers" && tar -xzf "$headers" -C "$build/cuda-headers"
    nvcc_option+=("-DFSDP_CUDA_EXTRA_INCLUDE_DIR=$repo/$build/cuda-headers")
  fi
  say "building $build/ (fsdp_cuda_tests, fsdp-train, fsdprun, libfsdp, libfsdp_cuda) with -j$jobs"
  # A ccache of its own: against another torch's headers no object is the other builds' anyway,
  # and these would only push theirs out of the shared cache.
  CCACHE_DIR=${FSDP_PREBUILT_CCACHE_DIR:-$HOME/.cache/fsdp-cpp/ccache-gpu-prebuilt} CCACHE_MAXSIZE=2G \
  FSDP_LIBTORCH="$torch_dir" FSDP_PYTHON="$python" FSDP_BUILD_DIR="$build" FSDP_BUILD_JOBS="$jobs" \
    FSDP_BUILD_TARGETS="fsdp_cuda_tests fsdp-train fsdprun" bash scripts/build.sh \
    -DFSDP_USE_CUDA=ON -DFSDP_BUILD_BENCHMARKS=OFF -DFSDP_BUILD_EXAMPLES=OFF -DCMAKE_DISABLE_FIND_PACKAGE_MPI=ON \
    -DFSDP_WITH_SENTENCEPIECE=ON "${nvcc_option[@]}"
  say "built"
  if [[ "$(bash scripts/gpu-sources-hash.sh)" != "$sources" ]]; then
    echo "gpu-prebuild.sh: the sources changed during the build: run it again (it rebuilds only what changed)" >&2
    exit 1
  fi

  # -------------------------------------------------------------- pack
  rm -rf "$pack" && mkdir -p "$pack/build/src" "$pack/build/tests" "$pack/build/tools/fsdp-train" \
    "$pack/build/tools/fsdprun" "$pack/lib" "$pack/lib-cxx"
  libfsdp=$(readlink -f "$build/src/libfsdp.so")
  soname=$(readelf -d "$libfsdp" | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')
  install -m 755 "$libfsdp" "$pack/build/src/$soname"
  install -m 755 "$build/src/libfsdp_cuda.so" "$pack/build/src/libfsdp_cuda.so"
  install -m 755 "$build/tests/fsdp_cuda_tests" "$pack/build/tests/"
  install -m 755 "$build/tools/fsdp-train/fsdp-train" "$pack/build/tools/fsdp-train/"
  install -m 755 "$build/tools/fsdprun/fsdprun" "$pack/build/tools/fsdprun/"
  mapfile -t binaries < <(find "$pack/build" -type f | sort)
  strip --strip-unneeded "${binaries[@]}"

  # The closure under ldd, with the machine's libraries (torch, nvidia-*, glibc, libstdc++)
  # resolved from the venv and left out.
  machine_lib='^(libc|libm|libdl|librt|libpthread|libresolv|libutil|ld-linux-x86-64|libstdc\+\+|libgcc_s|libtorch[a-z_]*|libc10[a-z_]*|libshm|libgomp|libcaffe2_nvrtc|libcu[A-Za-z0-9_]*|libnccl|libnvrtc[a-z0-9_-]*|libnvJitLink|libnvshmem[a-z0-9_]*|libnvToolsExt|libnvtx[a-z0-9_]*|libcufile[a-z0-9_]*|libcusparseLt|libcudnn[a-z0-9_]*|libgfortran)\.so'
  export LD_LIBRARY_PATH="$repo/$pack/build/src:$torch_libs"
  todo=("${binaries[@]}")
  while ((${#todo[@]})); do
    next=()
    while read -r name path; do
      [[ "$name" =~ $machine_lib ]] && continue
      [[ -e "$pack/lib/$name" || -e "$pack/build/src/$name" ]] && continue
      [[ "$path" == /* ]] || { echo "gpu-prebuild.sh: $name: not found by ldd" >&2; exit 1; }
      install -m 755 "$(readlink -f "$path")" "$pack/lib/$name"
      strip --strip-unneeded "$pack/lib/$name"
      next+=("$pack/lib/$name")
    done < <(ldd "${todo[@]}" 2>/dev/null | sed -n 's/^[[:space:]]*\([^ ]*\) => \([^ ]*\) .*/\1 \2/p; s/^[[:space:]]*\([^ ]*\) => not found.*/\1 -/p' | sort -u)
    todo=("${next[@]}")
  done
  for name in libstdc++.so.6 libgcc_s.so.1; do
    path=$(ldd "${binaries[@]}" | sed -n "s/^[[:space:]]*${name//+/[+]} => \([^ ]*\) .*/\1/p" | head -1)
    [[ -n "$path" ]] && install -m 644 "$(readlink -f "$path")" "$pack/lib-cxx/$name"
  done
  unset LD_LIBRARY_PATH

  # -------------------------------------------------------------- manifest
  # The highest glibc and libstdc++ symbol versions any packed file needs.
  highest() { find "$pack/build" "$pack/lib" -type f -exec objdump -T {} + 2>/dev/null | grep -o "$1_[0-9.]*[0-9]" |
    sed "s/$1_//" | sort -V | tail -1; }
  {
    echo "# .gpu-prebuilt/manifest.txt, written by scripts/gpu-prebuild.sh"
    echo "torch $torch_version"
    echo "cuda $torch_cuda"
    echo "commit $(git rev-parse HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD -- 2>/dev/null || echo ' (with uncommitted changes)')"
    echo "sources $sources"
    echo "built $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -m), $(. /etc/os-release && echo "$PRETTY_NAME"), g++ $(g++ -dumpfullversion)"
    echo "needs GLIBC_$(highest GLIBC) GLIBCXX_$(highest GLIBCXX)"
    echo "configuration -DFSDP_USE_CUDA=ON -DCMAKE_DISABLE_FIND_PACKAGE_MPI=ON -DFSDP_WITH_SENTENCEPIECE=ON Release, stripped"
    (cd "$pack" && find . -type f ! -name manifest.txt | sed 's|^\./||' | sort | xargs sha256sum | sed 's/^/sha256 /')
  } > "$pack/manifest.txt"
fi

[[ -f "$pack/manifest.txt" ]] || { echo "gpu-prebuild.sh: no $pack/manifest.txt: run without --check first" >&2; exit 1; }
if [[ "$(awk '$1 == "sources" { print $2 }' "$pack/manifest.txt")" != "$(bash scripts/gpu-sources-hash.sh)" ]]; then
  say "note: the tree's sources changed since $pack was built: gpu-check.sh will build instead of using it; run this script again"
fi
mib() { echo "$(( ($1 + 524288) / 1048576 ))"; }
size=$(du -sb "$pack" | cut -f1)
tree=$(git ls-files -co --exclude-standard -z | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
bundle=$(du -sb .gpu-bundle 2>/dev/null | cut -f1 || echo 0)
say "$pack: $(mib "$size") MiB ($(grep -c '^sha256 ' "$pack/manifest.txt") files); the working tree $(mib "$tree") MiB," \
    ".gpu-bundle $(mib "${bundle:-0}") MiB: $(mib $((size + tree + ${bundle:-0}))) MiB of the device call's 64"
du -sh "$pack"/build/*/* "$pack"/build/tools/*/* "$pack"/lib/* 2>/dev/null | grep -v '/tools$' | sed 's/^/  /'
if (( size + tree + ${bundle:-0} >= 64 * 1048576 )); then
  echo "gpu-prebuild.sh: what the device call would send is over its 64 MiB (the largest files above): a" \
       "library the GPU machine has is packed? (machine_lib in $0, lib lines in scripts/gpu-deps.txt)" >&2
  exit 1
fi

# ---------------------------------------------------------------- the binaries, here
# The packed binaries against the scratch venv's torch, with nothing of the build tree: every CUDA
# test reports skipped (no GPU), which shows that they load and run.
say "running $pack/build/tests/fsdp_cuda_tests against $torch_dir (no GPU here: SKIPPED expected)"
export LD_LIBRARY_PATH="$repo/$pack/lib:$repo/$pack/build/src:$torch_libs"
if ldd "$pack"/build/tests/fsdp_cuda_tests "$pack"/build/tools/*/* "$pack"/build/src/* | grep 'not found'; then
  echo "gpu-prebuild.sh: a packed binary misses a library (above)" >&2; exit 1
fi
rc=0
"$pack/build/tests/fsdp_cuda_tests" --gtest_brief=1 2>&1 | tail -15 || rc=$?
"$pack/build/tools/fsdp-train/fsdp-train" plan configs/tiny.yaml --world 2 >/dev/null || rc=1
say "the packed binaries ran (fsdp_cuda_tests, fsdp-train plan): rc=$rc"
exit $rc
