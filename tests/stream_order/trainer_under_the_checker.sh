#!/usr/bin/env bash
# trainer_under_the_checker.sh — fsdp-train, as a user runs it under fsdprun, with the CPU's
# stream-order checker on (FSDP_DEVICE_CHECK=1): CPU offload with mixed precision, gradient
# accumulation and a background checkpoint; HSDP with activation checkpointing; tensor
# parallelism under FSDP; one rank with offload. Each run must end with status 0 (a process
# that found a report exits with 86) and say that the checker was on.
#   tests/stream_order/trainer_under_the_checker.sh FSDPRUN FSDP_TRAIN CONFIGS_DIR
set -uo pipefail
fsdprun="$1" trainer="$2" configs="$3"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
runs=(
  "2|--fsdp_config.offload_params=true --fsdp_config.mixed_precision=true --training.gradient_accumulation_steps=2"
  "4|--fsdp_config.sharding_strategy=HYBRID_SHARD --fsdp_config.activation_checkpointing=true"
  "4|--fsdp_config.model_parallel_size=2"
  "1|--fsdp_config.offload_params=true"
)
failed=0
n=0
for run in "${runs[@]}"; do
  IFS='|' read -r nproc flags <<<"$run"
  dir="$work/run$((++n))"
  mkdir -p "$dir"
  # shellcheck disable=SC2086  # the flags are words
  FSDP_DEVICE_CHECK=1 "$fsdprun" --standalone --nproc-per-node "$nproc" "$trainer" "$configs/tiny.yaml" \
    --training.steps=4 --fsdp_config.checkpoint_interval=2 "--fsdp_config.checkpoint_dir=$dir/ckpt" \
    --training.export=none --logging.log_interval=2 $flags >"$dir/log" 2>&1
  rc=$?
  if [[ $rc -ne 0 ]] || ! grep -q "fsdp stream check: on" "$dir/log"; then
    echo "FAILED (exit $rc): $nproc ranks, $flags"
    grep -E "fsdp stream check|error|Error" "$dir/log" | head -20
    failed=1
  else
    echo "passed: $nproc ranks, $flags"
  fi
done
exit $failed
