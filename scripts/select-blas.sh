#!/usr/bin/env bash
# select-blas.sh — install the BLAS that LibTorch should use and make it the system's
# libblas.so.3 (and liblapack.so.3) through Debian's alternatives. Run as root by the
# project's install script, after `apt-get update`. Safe to run again: it installs only what
# is missing and re-selects the same files.
#
#   scripts/select-blas.sh              # the measured choice: OpenBLAS (pthread)
#   scripts/select-blas.sh openblas|blis|reference
#   FSDP_BLAS=blis scripts/select-blas.sh
#
# Why OpenBLAS: see docs/blas.md (measured on AMD EPYC Zen 5, 2 vCPU, 2026-11-29).
# Run-time environment the project must keep (set by the workplace, do not change):
#   OPENBLAS_CORETYPE=Haswell  OPENBLAS_L2_SIZE=512
# and, when several ranks share a machine, OPENBLAS_NUM_THREADS=<cores per rank> (OpenBLAS
# otherwise starts one thread per CPU in every process; at::set_num_threads does not
# change it, because Debian's LibTorch calls the generic BLAS interface).
set -euo pipefail

choice="${1:-${FSDP_BLAS:-openblas}}"

if [[ ${EUID:-$(id -u)} -ne 0 ]]; then
  echo "select-blas.sh: must run as root (apt-get, update-alternatives)" >&2
  exit 1
fi

case "$(dpkg --print-architecture)" in
  amd64) multiarch=x86_64-linux-gnu ;;
  arm64) multiarch=aarch64-linux-gnu ;;
  *) multiarch="$(gcc -print-multiarch 2>/dev/null || true)" ;;
esac
if [[ -z "$multiarch" ]]; then
  echo "select-blas.sh: cannot tell the multiarch directory" >&2
  exit 1
fi
libdir="/usr/lib/$multiarch"

case "$choice" in
  openblas)
    packages=(libopenblas0-pthread)
    blas="$libdir/openblas-pthread/libblas.so.3"
    lapack="$libdir/openblas-pthread/liblapack.so.3"  # OpenBLAS ships an optimised LAPACK
    ;;
  blis)
    packages=(libblis4-pthread liblapack3)
    blas="$libdir/blis-pthread/libblas.so.3"
    lapack="$libdir/lapack/liblapack.so.3"  # BLIS has no LAPACK; reference LAPACK over BLIS
    ;;
  reference)
    packages=(libblas3 liblapack3)
    blas="$libdir/blas/libblas.so.3"
    lapack="$libdir/lapack/liblapack.so.3"
    ;;
  *)
    echo "select-blas.sh: unknown BLAS '$choice' (openblas, blis or reference)" >&2
    exit 2
    ;;
esac

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
if ((${#missing[@]})); then
  echo "select-blas.sh: installing ${missing[*]}"
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}"
fi

select_alt() {  # name path
  local name="$1" path="$2"
  if [[ ! -e "$path" ]]; then
    echo "select-blas.sh: $path is missing after installing ${packages[*]}" >&2
    exit 1
  fi
  update-alternatives --set "$name" "$path" >/dev/null
  local now
  now="$(update-alternatives --query "$name" | sed -n 's/^Value: //p')"
  if [[ "$now" != "$path" ]]; then
    echo "select-blas.sh: $name points to '$now', not $path" >&2
    exit 1
  fi
  echo "select-blas.sh: $name -> $path"
}

select_alt "libblas.so.3-$multiarch" "$blas"
select_alt "liblapack.so.3-$multiarch" "$lapack"

if [[ "$choice" == openblas && "${OPENBLAS_CORETYPE:-}" != "Haswell" ]]; then
  echo "select-blas.sh: note: run programs with OPENBLAS_CORETYPE=Haswell (see docs/blas.md)"
fi
