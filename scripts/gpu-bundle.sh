#!/usr/bin/env bash
# gpu-bundle.sh — downloads, on a machine with Debian's mirror, the build dependencies that
# scripts/gpu-check.sh needs on a GPU machine with no network and no mirror: the .deb files of
# GoogleTest, CLI11, nlohmann-json, yaml-cpp and zlib's headers, into .gpu-bundle/ (git ignores it).
# gpu-check.sh unpacks them there with dpkg -x into a folder of its own, without installing
# anything. CUDA, NCCL, CMake, Ninja and PyTorch come from the GPU machine itself.
#   bash scripts/gpu-bundle.sh [DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${1:-.gpu-bundle}"
packages=(libgtest-dev libcli11-dev nlohmann-json3-dev libyaml-cpp-dev libyaml-cpp0.7 zlib1g-dev zlib1g)
mkdir -p "$dir"
rm -f "$dir"/*.deb
# apt-get download writes into the current folder; as root it warns that _apt cannot write
# there, which is harmless.
(cd "$dir" && apt-get download "${packages[@]}" 2>&1 | grep -v "^W: Download is performed unsandboxed" || true)
for p in "${packages[@]}"; do
  ls "$dir/${p}_"*.deb >/dev/null 2>&1 || { echo "gpu-bundle.sh: ${p} was not downloaded (apt-get update?)" >&2; exit 1; }
done
du -ch "$dir"/*.deb | tail -1 | sed "s|total|in $dir: ${#packages[@]} packages|"
