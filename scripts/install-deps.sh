#!/usr/bin/env bash
# install-deps.sh — everything fsdp-cpp needs on a fresh Debian 12 machine, from Debian's
# packages only, and the fast BLAS for LibTorch (scripts/select-blas.sh, docs/blas.md).
# Idempotent: installs only what is missing, so a second run needs no network.
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(
  cmake ninja-build g++ make pkg-config
  libtorch-dev libgloo-dev          # LibTorch 1.13 (CPU) with c10d, and the gloo transport
  libgtest-dev libbenchmark-dev     # tests and benchmarks
  libcli11-dev nlohmann-json3-dev libyaml-cpp-dev zlib1g-dev
  python3-torch                     # tests: Python's torch.load reads our exports
  libopenblas0-pthread              # the BLAS LibTorch is pointed at (select-blas.sh)
  libopenmpi-dev openmpi-bin        # the MPI backend and mpirun (optional at build time)
)

as_root() {
  if [[ ${EUID:-$(id -u)} -eq 0 ]]; then "$@"; else sudo "$@"; fi
}

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "install-deps: installing ${missing[*]}"
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
as_root bash scripts/select-blas.sh
