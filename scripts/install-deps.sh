#!/usr/bin/env bash
# install-deps.sh — everything fsdp-cpp needs on a fresh Debian 12 machine:
#  - Debian's packages for the toolchain, the test and benchmark libraries, OpenMPI, OpenBLAS and
#    Slurm (its daemons and munge, for the tests that run a cluster on this machine);
#  - LibTorch 2.x, as the one pinned PyTorch wheel from PyPI (a CUDA build that also runs without
#    a GPU; it carries LibTorch's headers, libraries and share/cmake/Torch, and gloo inside
#    libtorch_cpu), installed with the Python-side test tools into a virtual environment outside
#    the clone (scripts/torch-env.sh says where).
# Idempotent: installs only what is missing, so a second run needs no network.
#
# A user who already has LibTorch 2.x (the official archive, or their own PyTorch) sets
#   FSDP_LIBTORCH=/path/to/libtorch        (the folder holding share/cmake/Torch)
# and no wheel is downloaded; the Python-side tests then use FSDP_PYTHON (default python3), which
# needs torch for those tests to run (they report skipped otherwise).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/torch-env.sh
FSDP_TENSORBOARD_VERSION=2.21.0
FSDP_MATPLOTLIB_VERSION=3.11.2
FSDP_TOKENIZERS_VERSION=0.23.3

packages=(
  cmake ninja-build g++ make pkg-config
  python3-venv                      # the virtual environment that holds the PyTorch wheel
  libgtest-dev libbenchmark-dev     # tests and benchmarks
  libcli11-dev nlohmann-json3-dev libyaml-cpp-dev zlib1g-dev
  libopenmpi-dev openmpi-bin        # the MPI backend and mpirun (optional at build time)
  iproute2                          # ss, for the tests that look at listening sockets
  dpkg-dev file                     # cpack -G DEB's dependency list (dpkg-shlibdeps) and the package test
  clang-format clang-tidy           # the house format (scripts/check-format.sh) and lint (scripts/tidy.sh)
  ccache                            # the second build configuration reuses the first's object files
  doxygen                           # the API reference (docs/api/Doxyfile.in, ctest -L docs)
  libsentencepiece-dev sentencepiece  # fsdp-train tokenize --tokenizer (the library; optional at build
                                    # time: FSDP_WITH_SENTENCEPIECE) and spm_train (the demo, tests)
  stress-ng                         # scripts/under-load.sh: the suite beside CPU-bound neighbours
  slurmctld slurmd slurm-client munge  # the Slurm tests' cluster of their own (tests/multihost/slurm.py);
                                    # they start their own daemons and leave the system's services alone
)

# tools/tensorboard_screenshot.sh, a manual check, needs a headless browser: opt in with
# FSDP_SCREENSHOT_TOOLS=1 (Debian's chromium, some 300 MB with its libraries).
if [[ "${FSDP_SCREENSHOT_TOOLS:-0}" == 1 ]]; then packages+=(chromium); fi

as_root() {
  if [[ ${EUID:-$(id -u)} -eq 0 ]]; then "$@"; else sudo "$@"; fi
}

# Debian's LibTorch 1.13 and its separate gloo are no longer used: nothing here installs them.
# Left installed by something else they do no harm (the build finds the pinned LibTorch first and
# refuses any link of a second gloo), but say so, since the project no longer needs them.
note_old_packages() {
  local old=()
  for p in libtorch-dev python3-torch libgloo-dev; do
    if dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then old+=("$p"); fi
  done
  if ((${#old[@]})); then
    echo "install-deps: note: ${old[*]} (Debian's LibTorch 1.13 and its separate gloo) are installed;" \
         "fsdp-cpp no longer uses them (apt-get remove ${old[*]} if nothing else does)"
  fi
}

install_debian_packages() {
  local missing=()
  for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if ((${#missing[@]})); then
    echo "install-deps: installing ${missing[*]}"
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
  fi
}

# The venv is complete once its torch reports the pinned version; a half-finished one (a
# download cut off) is made again from scratch.
install_torch_wheel() {
  if [[ -n "${FSDP_LIBTORCH:-}" ]]; then
    echo "install-deps: using LibTorch from FSDP_LIBTORCH=${FSDP_LIBTORCH}; no wheel downloaded"
    return
  fi
  if "$FSDP_PYTHON" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '${FSDP_TORCH_VERSION}')" 2>/dev/null; then
    return
  fi
  echo "install-deps: installing torch==${FSDP_TORCH_VERSION} into ${FSDP_VENV} (about 5 GiB with its CUDA libraries)"
  rm -rf "$FSDP_VENV"
  mkdir -p "$(dirname "$FSDP_VENV")"
  "${FSDP_BASE_PYTHON}" -m venv "$FSDP_VENV"
  "$FSDP_VENV/bin/pip" install -q --disable-pip-version-check \
      "torch==${FSDP_TORCH_VERSION}" numpy pytest pyyaml
  "$FSDP_PYTHON" -c "import torch; print('install-deps: torch', torch.__version__, 'at', torch.__file__)"
}

# The Python-side tools beside torch, added to a venv made before they were listed: tensorboard
# (its event reader checks fsdp-train's TensorBoard files; tests/train/test_tensorboard.py),
# matplotlib (bench/plot_readme.py draws the README's pictures) and tokenizers
# (tools/pretokenize.py: a tokenizer.json's byte-level BPE to token files).
install_python_tools() {
  if [[ -n "${FSDP_LIBTORCH:-}" ]]; then return; fi  # FSDP_PYTHON is the user's own: left alone
  if "$FSDP_PYTHON" -c "import tensorboard, matplotlib, tokenizers" 2>/dev/null; then return; fi
  echo "install-deps: installing tensorboard, matplotlib and tokenizers into ${FSDP_VENV}"
  "$FSDP_VENV/bin/pip" install -q --disable-pip-version-check "tensorboard==${FSDP_TENSORBOARD_VERSION}" \
      "matplotlib==${FSDP_MATPLOTLIB_VERSION}" "tokenizers==${FSDP_TOKENIZERS_VERSION}"
}

# transformers, the oracle of the Llama family's interop checks (tests/interop/test_llama.py):
# pinned to the version they were written against (it works with torch 2.15), with safetensors
# for reading and writing the files. Skipped with FSDP_LIBTORCH (no venv of ours).
FSDP_TRANSFORMERS_VERSION=5.25.0
install_transformers() {
  if [[ -n "${FSDP_LIBTORCH:-}" ]]; then return; fi
  if "$FSDP_PYTHON" -c "import sys, transformers, safetensors; sys.exit(transformers.__version__ != '${FSDP_TRANSFORMERS_VERSION}')" 2>/dev/null; then
    return
  fi
  echo "install-deps: installing transformers==${FSDP_TRANSFORMERS_VERSION} into ${FSDP_VENV}"
  "$FSDP_VENV/bin/pip" install -q --disable-pip-version-check "transformers==${FSDP_TRANSFORMERS_VERSION}" safetensors
}

note_old_packages
install_debian_packages
install_torch_wheel
install_python_tools
install_transformers
