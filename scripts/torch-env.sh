# torch-env.sh — where fsdp-cpp's LibTorch and its Python live. Sourced by the other scripts.
#
#   FSDP_TORCH_VERSION  the pinned PyTorch release (the newest one whose CMake files configure
#                       with this machine's CUDA 13 toolkit)
#   FSDP_VENV           the virtual environment holding that wheel, outside the clone and reused
#                       by every clone (default ~/.cache/fsdp-cpp/venv-torch-<version>)
#   FSDP_LIBTORCH       set it to use a LibTorch of your own (the official archive, or the torch
#                       folder of your own PyTorch); then nothing is downloaded
#   FSDP_PYTHON         the Python for the Python-side tests and benchmarks (the venv's)
#   FSDP_TORCH_PREFIX   what CMake's CMAKE_PREFIX_PATH gets (the folder holding share/cmake/Torch)
FSDP_TORCH_VERSION="2.15.0"
FSDP_BASE_PYTHON="${FSDP_BASE_PYTHON:-python3}"
FSDP_VENV="${FSDP_VENV:-${HOME}/.cache/fsdp-cpp/venv-torch-${FSDP_TORCH_VERSION}}"
if [[ -n "${FSDP_LIBTORCH:-}" ]]; then
  FSDP_PYTHON="${FSDP_PYTHON:-python3}"
  FSDP_TORCH_PREFIX="${FSDP_LIBTORCH}"
else
  FSDP_PYTHON="${FSDP_PYTHON:-${FSDP_VENV}/bin/python}"
  # Empty until install-deps.sh has made the venv; `|| true` keeps a caller's `set -e -o pipefail`
  # from ending it silently here on a fresh machine.
  FSDP_TORCH_PREFIX="$(ls -d "${FSDP_VENV}"/lib/python3*/site-packages/torch 2>/dev/null | head -n 1 || true)"
fi
export FSDP_TORCH_VERSION FSDP_VENV FSDP_PYTHON FSDP_TORCH_PREFIX
