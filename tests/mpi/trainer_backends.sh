#!/usr/bin/env bash
# trainer_backends.sh W FSDPRUN FSDP_TRAIN CONFIG WORKDIR -- MPIRUN...
# Trains CONFIG for a few steps at world size W twice: on gloo under fsdprun and on mpi under
# mpirun. Both must finish, the MPI run must say it used MPI, and rank 0's losses must agree
# step by step (the backends reduce in different orders, so up to float rounding).
set -euo pipefail
world=$1 fsdprun=$2 train=$3 config=$4 work=$5
shift 5
[[ $1 == -- ]] && shift
rm -rf "$work" && mkdir -p "$work"
args=(--training.steps=4 --training.seq_len=16 --training.keep_checkpoints=0
      --fsdp_config.checkpoint_interval=0 --logging.progress=off --logging.log_interval=1
      --training.export=none --sample.length=0 --fsdp_config.collective_timeout_s=120)
timeout 300 "$fsdprun" --standalone --nproc-per-node "$world" "$train" "$config" "${args[@]}" \
  --fsdp_config.backend=gloo --fsdp_config.checkpoint_dir="$work/gloo/ckpt" \
  --logging.jsonl="$work/gloo/m{rank}.jsonl" >"$work/gloo.out" 2>&1 || { cat "$work/gloo.out"; exit 1; }
timeout 300 "$@" -np "$world" "$train" "$config" "${args[@]}" \
  --fsdp_config.backend=mpi --fsdp_config.checkpoint_dir="$work/mpi/ckpt" \
  --logging.jsonl="$work/mpi/m{rank}.jsonl" >"$work/mpi.out" 2>&1 || { cat "$work/mpi.out"; exit 1; }
grep -q "collectives on mpi" "$work/mpi.out" || { echo "the MPI run did not say it ran on mpi"; cat "$work/mpi.out"; exit 1; }
grep -q "collectives on gloo" "$work/gloo.out" || { echo "the fsdprun run did not say it ran on gloo"; exit 1; }
python3 - "$work/gloo/m0.jsonl" "$work/mpi/m0.jsonl" <<'PY'
import json, sys
def losses(path):
    return {json.loads(l)["step"]: json.loads(l)["loss"] for l in open(path) if l.strip()}
g, m = losses(sys.argv[1]), losses(sys.argv[2])
assert g and g.keys() == m.keys(), f"steps differ: gloo {sorted(g)} mpi {sorted(m)}"
for s in sorted(g):
    assert abs(g[s] - m[s]) <= 1e-5 * max(1.0, abs(g[s])), f"step {s}: gloo loss {g[s]} mpi loss {m[s]}"
print("trainer_backends: same losses on gloo and mpi for steps", sorted(g))
PY
