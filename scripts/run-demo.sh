#!/usr/bin/env bash
# run-demo.sh — the main job (until the trainer exists): install, build, and run the 2-process
# DTensor demo under fsdprun.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
bash scripts/build.sh
build/tools/fsdprun/fsdprun --standalone --nproc-per-node 2 build/examples/dtensor_demo
