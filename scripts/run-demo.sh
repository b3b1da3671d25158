#!/usr/bin/env bash
# run-demo.sh — the main job (until the trainer exists): install, build, then on 2 processes
# under fsdprun: the DTensor demo (shards a small model's parameters, prints each rank's shard
# shapes and the reassembled full tensor) and the seed-001 training example.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
bash scripts/build.sh
fsdprun=build/tools/fsdprun/fsdprun
"$fsdprun" --standalone --nproc-per-node 2 build/examples/dtensor_demo
"$fsdprun" --standalone --nproc-per-node 2 build/examples/train_fsdp --steps 10
