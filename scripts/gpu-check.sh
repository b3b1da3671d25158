#!/usr/bin/env bash
# gpu-check.sh — the CUDA path on a machine with an NVIDIA GPU, CUDA and PyTorch >= 2.11, and no
# network: builds fsdp-cpp with -DFSDP_USE_CUDA=ON against that machine's PyTorch, runs the CUDA
# tests (a race and sync check under compute-sanitizer where it works), and runs fsdp-train
# beside PyTorch's FSDP2 on the same GPU (bench/gpu_side_by_side.py). Everything it prints and
# every result lands in one folder.
#
#   bash scripts/gpu-bundle.sh                  # first, on a machine with Debian's mirror
#   bash scripts/gpu-check.sh [--dry-run] [--out DIR] [--jobs N] [--budget SECONDS]
#
# The build dependencies travel as .deb files (.gpu-bundle/, from gpu-bundle.sh) and are unpacked
# with dpkg -x into a folder of their own: nothing is installed. --dry-run does what needs no GPU
# (the bundle, the configure step against it) and prints the rest. Each step is bounded so that
# the whole run stays inside --budget (default 480 s); a step cut short says so, and the later
# ones still write what they can.
set -uo pipefail
cd "$(dirname "$0")/.."

out=gpu-results
jobs=$(nproc)
budget=480
dry_run=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry-run) dry_run=1 ;;
    --out) out="$2"; shift ;;
    --jobs) jobs="$2"; shift ;;
    --budget) budget="$2"; shift ;;
    *) echo "gpu-check.sh: unknown argument '$1' (see the header of $0)" >&2; exit 2 ;;
  esac
  shift
done
mkdir -p "$out"
start=$(date +%s)
log() { echo "[gpu-check +$(( $(date +%s) - start ))s] $*" | tee -a "$out/check.log"; }
left() { echo $(( budget - ($(date +%s) - start) )); }
# step NAME SECONDS CMD...: runs CMD with its output in $out/NAME.txt, bounded by SECONDS and by
# what is left of the budget.
step() {
  local name="$1" limit="$2"; shift 2
  local remaining; remaining=$(left)
  (( limit > remaining )) && limit=$remaining
  if (( limit <= 5 )); then log "$name: skipped, the budget is spent"; return 124; fi
  log "$name: start (at most ${limit}s): $*"
  timeout --kill-after=5 "$limit" "$@" > "$out/$name.txt" 2>&1
  local rc=$?
  log "$name: rc=$rc$([[ $rc == 124 ]] && echo ' (cut off by its time limit)')"
  return $rc
}

python=${FSDP_PYTHON:-python3}
log "machine: $(uname -srm); $(nproc) cores; commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 || echo "no nvidia-smi"
  nvcc --version 2>&1 | tail -1 || echo "no nvcc"
  "$python" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())' 2>&1
  cmake --version | head -1
} | tee "$out/machine.txt"

torch_cmake=$("$python" -c 'import torch; print(torch.utils.cmake_prefix_path)' 2>/dev/null) || {
  log "no PyTorch in '$python' (set FSDP_PYTHON)"; exit 1; }

# The bundle, unpacked without installing. Debian's absolute symlinks (libz.so -> /lib/...) are
# pointed into the unpacked tree.
deps=/tmp/fsdp-gpu-deps
rm -rf "$deps" && mkdir -p "$deps"
ls .gpu-bundle/*.deb >/dev/null 2>&1 || { log "no .gpu-bundle/*.deb: run scripts/gpu-bundle.sh first"; exit 1; }
for deb in .gpu-bundle/*.deb; do dpkg -x "$deb" "$deps"; done
while IFS= read -r link; do
  target=$(readlink "$link")
  if [[ "$target" == /* && -e "$deps$target" ]]; then ln -sfn "$deps$target" "$link"; fi
done < <(find "$deps" -type l)
log "bundle unpacked into $deps: $(ls .gpu-bundle/*.deb | wc -l) packages"
export LD_LIBRARY_PATH="$deps/usr/lib/x86_64-linux-gnu:$deps/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

build=build-gpu
configure=(cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release "-DCMAKE_PREFIX_PATH=$torch_cmake;$deps/usr"
           -DFSDP_USE_CUDA=ON -DFSDP_BUILD_BENCHMARKS=OFF -DFSDP_BUILD_EXAMPLES=OFF "-DFSDP_PYTHON=$(command -v "$python")")
step configure 120 "${configure[@]}" || { log "configure failed: see $out/configure.txt"; exit 1; }
grep -E "^(GTest|nlohmann_json|yaml-cpp|ZLIB_LIBRARY|FSDP_NCCL_INCLUDE_DIR)[A-Za-z_]*(:[A-Z]+)?=" "$build/CMakeCache.txt" \
  | tee -a "$out/check.log"
if (( dry_run )); then
  log "dry run: the bundle and the configure step worked; a GPU run would now build fsdp_cuda_tests, fsdp-train"
  log "and fsdprun (-j$jobs), run fsdp_cuda_tests, one of them under compute-sanitizer racecheck and"
  log "synccheck, bench/gpu_side_by_side.py --build-dir $build --out $out/side_by_side, and fsdp-train"
  log "with fp16: true (loss scaling) for 30 steps and a resume to 40, configs/seed002.yaml on 8 ranks, and"
  log "bench/offload_placements.py (the three offload placements, measured beside fsdp-train plan)"
  exit 0
fi

step build 300 cmake --build "$build" -j "$jobs" --target fsdp_cuda_tests fsdp-train fsdprun || {
  log "build failed: see $out/build.txt"; tail -40 "$out/build.txt"; exit 1; }
step cuda_tests 150 "$build/tests/fsdp_cuda_tests"
tail -25 "$out/cuda_tests.txt"
step side_by_side 180 "$python" bench/gpu_side_by_side.py --build-dir "$build" --out "$out/side_by_side" \
  --preset medium --dtype bf16 --steps 12 --warmup 3 --pairs 2
tail -30 "$out/side_by_side.txt"
# fp16 with loss scaling in the trainer: 30 steps with a checkpoint every 10, then a resume to 40
# (the scaler's state comes back from the checkpoint).
fp16_run=("$build/tools/fsdp-train/fsdp-train" configs/tiny.yaml --fsdp_config.device=cuda --fsdp_config.fp16=true
          --fsdp_config.checkpoint_interval=10 "--fsdp_config.checkpoint_dir=$out/fp16_ckpt" --logging.log_interval=5
          --training.export=none)
step fp16_train 60 "${fp16_run[@]}" --training.steps=30 --training.resume=never
step fp16_resume 60 "${fp16_run[@]}" --training.steps=40 --training.resume=auto
tail -8 "$out/fp16_train.txt" "$out/fp16_resume.txt"
# configs/seed002.yaml with its fsdp_config unmodified (8 ranks on this one GPU, so its groups on
# Gloo staged through pinned memory: NCCL refuses two ranks on a GPU); only the step count is
# shortened, and ./checkpoints lands in the results folder.
mkdir -p "$out/seed002"
step seed002 120 env -C "$out/seed002" FSDP_CUDA_BACKEND=gloo "$PWD/$build/tools/fsdprun/fsdprun" --standalone --nproc-per-node 8 \
  "$PWD/$build/tools/fsdp-train/fsdp-train" "$PWD/configs/seed002.yaml" --training.steps=4 --logging.log_interval=1 \
  --training.export=none
tail -12 "$out/seed002.txt"
# The three placements of the sharded state (no offload; parameters offloaded with AdamW's state on
# the GPU; full offload): GPU peak and step time measured, beside fsdp-train plan's GPU and host peaks.
step offload_placements 90 "$python" bench/offload_placements.py --build-dir "$build" --device cuda \
  --preset small --steps 8 --out "$out/offload_placements"
tail -8 "$out/offload_placements.txt"
if command -v compute-sanitizer >/dev/null; then
  for tool in racecheck synccheck; do
    step "sanitizer_$tool" 60 compute-sanitizer --tool "$tool" --target-processes all --error-exitcode 9 \
      "$build/tests/fsdp_cuda_tests" --gtest_filter='Cuda.FullyShardOnOneGpuTrainsLikeTheUnshardedModel'
    tail -5 "$out/sanitizer_$tool.txt"
  done
else
  log "compute-sanitizer: not on PATH; the race and sync checks did not run"
fi
log "done; results in $out"
