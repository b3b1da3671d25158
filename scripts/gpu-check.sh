#!/usr/bin/env bash
# gpu-check.sh — confirms the CUDA path on a machine with an NVIDIA GPU, PyTorch >= 2.11 and no
# network: builds fsdp-cpp with -DFSDP_USE_CUDA=ON against that machine's PyTorch, then runs,
# most valuable first (each step's verdict is PASS, FAIL, SKIPPED or CUT OFF):
#   cuda_tests          the CUDA tests (fsdp_cuda_tests, all but the race tests)
#   races               the stream-race tests (CudaRaces.*: side streams delayed, results compared)
#   side_by_side        fsdp-train beside PyTorch's FSDP2 on the GPU, losses compared
#                       (bench/gpu_side_by_side.py)
#   seed002             configs/seed002.yaml on 8 ranks (Gloo staged: one GPU), its losses
#                       compared with the same run without offload
#   fp16                fp16 with loss scaling against fp32, fp32 against the CPU, and a resume from
#                       the fp16 checkpoint against the uninterrupted run
#   offload_placements  the three offload placements beside fsdp-train plan
#   sanitizer           compute-sanitizer's racecheck and synccheck on one test
# The race tests run beside the CUDA tests, and fsdp-train and fsdprun build beside both.
#
# THE DEVICE CALL (prepare once, here: bash scripts/gpu-bundle.sh):
#   command:   bash scripts/gpu-check.sh
#   carry:     [".gpu-bundle"]   (ignored folders travel only when named: without it, no build)
#   timeout_s: 600               (the script keeps to --budget, default 570 s)
# It carries the working tree (4 MiB) and .gpu-bundle/ (29 MiB; 33 of the 64 allowed): the .debs
# of GoogleTest, CLI11, nlohmann-json, yaml-cpp and zlib's headers, unpacked with dpkg -x (or ar
# and tar), nothing installed; the wheels of CMake and Ninja, installed with pip install --target
# only where the machine has no working cmake or ninja; and CUDA 13.0's crt/ and nv/ headers. CUDA's
# other headers, NCCL's and libcudart come from the machine's torch wheel: with nvcc there, torch's
# CMake files use the toolkit; without it, or when that configure fails, -DFSDP_CUDA_WITHOUT_NVCC=ON
# takes them from the wheel's nvidia-* packages and crt/, nv/ from the bundle. Without Ninja it
# builds with Make. Always with every core, and only the targets it runs.
#
# Results, each written as soon as its step ends (a run cut short still returns what it did): in
# $OUT when set (the device machine's folder that comes back: 8 files at most), else in the --out
# folder: gpu-check.log (each step's command, time, verdict and output tail), summary.tsv (step,
# rc, seconds, verdict, detail), cuda_tests.txt, races.txt, side_by_side.txt, seed002.txt,
# fp16.txt, and everything.tar.gz (every output, the configure and build logs included; no
# checkpoints or weights).
#
# If the budget cut the first call short (see summary.tsv), a second call at once, on the still-warm
# machine (its build-gpu/ stays), with what is left of the 15 minutes:
#   command: bash scripts/gpu-check.sh --only seed002,fp16,offload_placements,sanitizer --budget 200
#   carry: [".gpu-bundle"], timeout_s: 230
#
# Time per step. Rehearsed without a GPU (2026-12-06) by scripts/gpu-rehearse.sh on 2 vCPUs (AMD
# EPYC Zen 3, shared with three other builds): torch 2.11.0+cu130 in a Python 3.12.1 venv, no
# nvcc, cmake, ninja or network. Install of the carried CMake and Ninja 6 s, .debs 3 s; configure
# 1 s (8 s with nvcc, and CMake 4.4.5 configures both ways: tried apart); build_tests 748 s cold
# (the jobs' times add up to 1450 s; the longest chain is the precompiled header, 81 s, then a
# 68 s file), 49 s after one test file changed; build_tools 317 s cold beside them (jobs: 620 s);
# the CUDA and race tests 3 s (skipped; the race tests' plumbing on the CPU stand-in 18 s);
# side_by_side 24 s, seed002 11 s, fp16 70 s (all on device cpu, tiny models).
# Estimated on the GPU machine's 16 cores: setup 15 s, configure 10-30 s, build_tests 2.5-3.5 min
# (the chain, not the cores, bounds it), build_tools done during the tests, the CUDA and race
# tests 1-2.5 min side by side, side_by_side 1-2 min, seed002 about 1 min, fp16 0.5 min,
# offload_placements 1 min, sanitizer 1-2 min: the first call likely ends in seed002 or fp16.
#
#   bash scripts/gpu-check.sh [--out DIR] [--jobs N] [--budget SECONDS] [--only STEP,...] [--cpu]
#     --only   just these steps (configure and build always run; they are incremental, so a
#              second call on the still-warm machine rebuilds nothing), e.g. --only seed002,fp16
#     --cpu    the rehearsal on a machine without a GPU: the CUDA tests report skipped, and the
#              trainer steps run on device cpu (bf16 for fp16) to check the comparisons
#     --slow F each step's own time limit times F (for a slower machine: the rehearsal's 2 vCPUs)
#   FSDP_PYTHON        the Python with torch (default python3)
#   FSDP_GPU_NVCC      auto (default), yes (the toolkit's nvcc only), no (the wheel's headers only)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
repo=$PWD

work=gpu-results
jobs=$(nproc)
budget=570
only=""
cpu=0
slow=1
while [[ $# -gt 0 ]]; do
  case "$1" in
    --out) work="$2"; shift ;;
    --jobs) jobs="$2"; shift ;;
    --budget) budget="$2"; shift ;;
    --only) only=",$2,"; shift ;;
    --cpu) cpu=1 ;;
    --slow) slow="$2"; shift ;;
    *) echo "gpu-check.sh: unknown argument '$1' (see the header of $0)" >&2; exit 2 ;;
  esac
  shift
done
mkdir -p "$work" && work=$(cd "$work" && pwd)
# This run's results only (a second call on the warm machine finds the first one's).
rm -rf "$work"/*.txt "$work"/*.tsv "$work"/*.log "$work"/{side_by_side,seed002,fp16,offload_placements}
out="${OUT:-}"
[[ -n "$out" ]] && mkdir -p "$out" && out=$(cd "$out" && pwd)
[[ "$out" == "$work" ]] && out=""
start=$(date +%s)
log() { echo "[gpu-check +$(( $(date +%s) - start ))s] $*" | tee -a "$work/gpu-check.log"; }
left() { echo $(( budget - ($(date +%s) - start) )); }
wanted() { [[ -z "$only" || "$only" == *",$1,"* ]]; }

# Copies the results to $OUT: the log, the summary, the main steps' outputs (their last 8 MiB)
# and one tar of the rest, so that $OUT never holds more than 8 files.
publish() {
  [[ -n "$out" ]] || return 0
  cp -f "$work/gpu-check.log" "$out/" 2>/dev/null
  cp -f "$work/summary.tsv" "$out/" 2>/dev/null
  local f
  for f in cuda_tests races side_by_side seed002 fp16; do
    [[ -f "$work/$f.txt" ]] && tail -c 8388608 "$work/$f.txt" > "$out/$f.txt"
  done
  tar -czf /tmp/gpu-check-everything.tar.gz --exclude='*.pt' --exclude='*checkpoints*' --exclude='*ckpt*' \
    --exclude='*.safetensors' --exclude='*.distcp' --exclude='*.tar.gz' -C "$work" . 2>/dev/null
  cp -f /tmp/gpu-check-everything.tar.gz "$out/everything.tar.gz"
}

# record NAME RC SECONDS VERDICT DETAIL: one line of summary.tsv, the log, and the results out.
record() {
  printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "$5" >> "$work/summary.tsv"
  log "$1: $4 (rc=$2, ${3}s) $5"
  publish
}

# run_step NAME LIMIT CMD...: CMD with its output in $work/NAME.txt, bounded by LIMIT seconds and
# by what is left of the budget. Sets step_rc and step_s.
run_step() {
  local name="$1" limit=$(( $2 * slow )); shift 2
  local remaining; remaining=$(left)
  (( limit > remaining )) && limit=$remaining
  step_s=0
  if (( limit <= 5 )); then step_rc=124; log "$name: not started, the budget is spent"; return; fi
  log "$name: start (at most ${limit}s): $*"
  local t0; t0=$(date +%s)
  timeout --kill-after=5 "$limit" "$@" > "$work/$name.txt" 2>&1
  step_rc=$?
  step_s=$(( $(date +%s) - t0 ))
}

# The verdict of a gtest run from its output: FAIL, SKIPPED (every test skipped) or PASS.
gtest_verdict() {
  local txt="$1" rc="$2" passed skipped failed
  passed=$(grep -oE '^\[  PASSED  \] [0-9]+' "$txt" | grep -oE '[0-9]+$' | tail -1)
  skipped=$(grep -oE '^\[  SKIPPED \] [0-9]+ test' "$txt" | grep -oE '[0-9]+' | tail -1)
  failed=$(grep -oE '^\[  FAILED  \] [0-9]+ test' "$txt" | grep -oE '[0-9]+' | tail -1)
  detail="passed ${passed:-0}, failed ${failed:-0}, skipped ${skipped:-0}"
  if (( rc == 124 || rc == 137 )); then verdict="CUT OFF"
  elif (( rc != 0 )) || [[ -n "$failed" ]]; then verdict=FAIL
  elif [[ -n "$skipped" && "${passed:-0}" == 0 ]]; then verdict=SKIPPED
  else verdict=PASS; fi
}

plain_verdict() {  # from an exit status alone
  if (( $1 == 124 || $1 == 137 )); then verdict="CUT OFF"; elif (( $1 == 0 )); then verdict=PASS; else verdict=FAIL; fi
}

python=${FSDP_PYTHON:-python3}
log "machine: $(uname -srm); $(nproc) cores; commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'); budget ${budget}s$([[ $cpu == 1 ]] && echo '; --cpu rehearsal')"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 || echo "no nvidia-smi"
  echo "nvcc: $(command -v nvcc || echo none); cmake: $(command -v cmake || echo none); ninja: $(command -v ninja || echo none); g++: $(g++ -dumpfullversion 2>&1)"
} 2>&1 | tee -a "$work/gpu-check.log"

# One import of torch: its folder, its CUDA release, and a line for the log.
torch_info=$("$python" -c 'import os, sys, torch
print(os.path.dirname(torch.__file__)); print(torch.version.cuda or "")
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())' 2>&1) || {
  log "no PyTorch in '$python' (set FSDP_PYTHON): $torch_info"; exit 1; }
torch_dir=$(sed -n 1p <<< "$torch_info")
torch_cuda=$(sed -n 2p <<< "$torch_info")
log "$(sed -n 3p <<< "$torch_info")"

# ---------------------------------------------------------------- what the build needs
# The .debs, unpacked without installing (once per bundle: unchanged files keep their times, so a
# second call rebuilds nothing). Debian's absolute symlinks (libz.so -> /lib/...) are pointed
# into the unpacked tree.
deps=/tmp/fsdp-gpu-deps
ls .gpu-bundle/*.deb >/dev/null 2>&1 || {
  log "no .gpu-bundle/*.deb: run scripts/gpu-bundle.sh here first, and name .gpu-bundle in the device call's carry"; exit 1; }
stamp=$(ls -l .gpu-bundle/*.deb .gpu-bundle/*.tar.gz 2>/dev/null | md5sum | cut -c1-12)
if [[ "$(cat "$deps/.stamp" 2>/dev/null)" != "$stamp" ]]; then
  rm -rf "$deps" && mkdir -p "$deps"
  for deb in .gpu-bundle/*.deb; do
    if command -v dpkg >/dev/null; then dpkg -x "$deb" "$deps"; else  # binutils' ar and tar instead
      member=$(ar t "$deb" | grep '^data\.tar')
      case "$member" in *.xz) z=-J ;; *.gz) z=-z ;; *.zst) z=--zstd ;; *) z= ;; esac
      ar p "$deb" "$member" | tar -x $z -C "$deps" -f -
    fi
  done
  for headers in .gpu-bundle/cuda-headers-*.tar.gz; do
    [[ -f "$headers" ]] || continue
    v=${headers##*/cuda-headers-}; mkdir -p "$deps/cuda-${v%.tar.gz}" && tar -xzf "$headers" -C "$deps/cuda-${v%.tar.gz}"
  done
  while IFS= read -r link; do
    target=$(readlink "$link")
    if [[ "$target" == /* && -e "$deps$target" ]]; then ln -sfn "$deps$target" "$link"; fi
  done < <(find "$deps" -type l)
  echo "$stamp" > "$deps/.stamp"
fi
export LD_LIBRARY_PATH="$deps/usr/lib/x86_64-linux-gnu:$deps/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# CMake 4 refuses projects that ask for a policy version below 3.5; this lets it configure them.
export CMAKE_POLICY_VERSION_MINIMUM=3.5

# CMake and Ninja: the machine's, else the carried wheels' (their binaries, not the Python wrappers).
tools=/tmp/fsdp-gpu-tools
carried_tool() {  # carried_tool NAME: the carried wheel's binary (both wheels installed on first use)
  local bin="$tools/bin/ninja"
  [[ $1 == cmake ]] && bin="$tools/cmake/data/bin/cmake"
  if [[ ! -x "$bin" ]] && ls .gpu-bundle/wheels/*.whl >/dev/null 2>&1; then
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$tools" \
      .gpu-bundle/wheels/*.whl >> "$work/tools.txt" 2>&1
  fi
  [[ -x "$bin" ]] && echo "$bin"
}
machine_tool() { local p; p=$(command -v "$1") && "$p" --version >/dev/null 2>&1 && echo "$p"; }
cmake_bin=$(machine_tool cmake || carried_tool cmake)
[[ -n "$cmake_bin" ]] || { log "no cmake on this machine and none carried (.gpu-bundle/wheels: scripts/gpu-bundle.sh)"; exit 1; }
ninja_bin=$(machine_tool ninja || carried_tool ninja)
if [[ -n "$ninja_bin" ]]; then generator=(-G Ninja "-DCMAKE_MAKE_PROGRAM=$ninja_bin"); else generator=(-G "Unix Makefiles"); fi
log "cmake: $cmake_bin ($("$cmake_bin" --version | head -1)); generator: ${generator[1]}${ninja_bin:+ ($ninja_bin)}"

# ---------------------------------------------------------------- configure and build
build="build-gpu"
nvcc_mode=${FSDP_GPU_NVCC:-auto}
have_nvcc=0
{ command -v nvcc || [[ -x /usr/local/cuda/bin/nvcc ]]; } >/dev/null 2>&1 && have_nvcc=1
# Without nvcc: the toolkit's crt/ and nv/, carried for the wheel's CUDA release.
crt_option=()
if [[ -n "$torch_cuda" && -d "$deps/cuda-$torch_cuda/crt" ]]; then crt_option=("-DFSDP_CUDA_EXTRA_INCLUDE_DIR=$deps/cuda-$torch_cuda")
elif (( ! have_nvcc )); then log "no nvcc, and .gpu-bundle holds no CUDA $torch_cuda headers (crt/, nv/): configure will say what is missing"; fi
configure() {  # configure WITHOUT_NVCC(ON|OFF)
  local saved="" extra=()
  [[ $1 == ON ]] && extra=("${crt_option[@]}")
  # A build folder configured the other way starts afresh.
  saved=$(grep -s '^FSDP_CUDA_WITHOUT_NVCC:BOOL=' "$build/CMakeCache.txt" | cut -d= -f2)
  [[ -n "$saved" && "$saved" != "$1" ]] && rm -rf "$build"
  run_step configure 150 "$cmake_bin" -S . -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
    "-DCMAKE_PREFIX_PATH=$torch_dir;$deps/usr" -DFSDP_USE_CUDA=ON "-DFSDP_CUDA_WITHOUT_NVCC=$1" \
    -DFSDP_BUILD_BENCHMARKS=OFF -DFSDP_BUILD_EXAMPLES=OFF -DCMAKE_DISABLE_FIND_PACKAGE_MPI=ON \
    "-DFSDP_PYTHON=$(command -v "$python")" "${extra[@]}"
}
configured=0
if [[ "$nvcc_mode" != no && $have_nvcc == 1 ]]; then
  configure OFF
  if (( step_rc == 0 )); then configured=1; else
    log "configure with nvcc failed (the tail below; all of it in everything.tar.gz); again with the wheel's CUDA headers"
    tail -15 "$work/configure.txt" | tee -a "$work/gpu-check.log"
    mv "$work/configure.txt" "$work/configure-nvcc.txt"
  fi
fi
if (( ! configured )) && [[ "$nvcc_mode" != yes ]]; then
  configure ON
  (( step_rc == 0 )) && configured=1
fi
if (( ! configured )); then
  plain_verdict "$step_rc"; record configure "$step_rc" "$step_s" "$verdict" "see configure.txt"
  tail -30 "$work/configure.txt" | tee -a "$work/gpu-check.log"; exit 1
fi
record configure 0 "$step_s" PASS "$(grep -hE '^-- fsdp: (LibTorch|no nvcc|the CUDA path)' "$work/configure.txt" | sed 's/^-- //' | tr '\n' ' ')"

run_step build_tests 360 "$cmake_bin" --build "$build" -j "$jobs" --target fsdp_cuda_tests
plain_verdict "$step_rc"
record build_tests "$step_rc" "$step_s" "$verdict" "fsdp_cuda_tests and libfsdp_cuda, -j$jobs"
if (( step_rc != 0 )); then tail -40 "$work/build_tests.txt" | tee -a "$work/gpu-check.log"; exit 1; fi

# The race tests run beside the CUDA tests (another process set: no test of either measures
# time, and the GPU holds both), and fsdp-train and fsdprun build beside them, at a lower priority.
declare -A bg_pid bg_t0
start_bg() {  # start_bg NAME LIMIT CMD...: as run_step, in the background; finish_bg NAME waits
  local name="$1" limit=$(( $2 * slow )); shift 2
  local remaining; remaining=$(left)
  (( limit > remaining )) && limit=$remaining
  log "$name: start in the background (at most ${limit}s): $*"
  bg_t0[$name]=$(date +%s)
  timeout --kill-after=5 "$limit" "$@" > "$work/$name.txt" 2>&1 &
  bg_pid[$name]=$!
}
finish_bg() {  # sets step_rc and step_s
  wait "${bg_pid[$1]}"; step_rc=$?
  step_s=$(( $(date +%s) - bg_t0[$1] ))
  unset "bg_pid[$1]"
}
tests_bin="$build/tests/fsdp_cuda_tests"
record_tests() {  # record_tests NAME
  gtest_verdict "$work/$1.txt" "$step_rc"
  record "$1" "$step_rc" "$step_s" "$verdict" "$detail"
  # The tests that failed or were skipped (gtest's list at the end), and the first reason for a skip.
  grep -E '^\[  (FAILED|SKIPPED) \] [A-Za-z0-9_]+\.[A-Za-z0-9_/]+$' "$work/$1.txt" | sort -u | head -40 | tee -a "$work/gpu-check.log"
  { grep -m1 -oE 'needs a CUDA GPU: .*' "$work/$1.txt" || grep -m1 -A1 -E ': Skipped$' "$work/$1.txt" | tail -1; } |
    sed 's/^/reason for a skip: /' | tee -a "$work/gpu-check.log"
}
# With --cpu the race tests' "GPU" runs use a cpu mesh: their plumbing is rehearsed, not the streams.
wanted races && start_bg races 200 env "FSDP_RACE_TESTS_ON_CPU=$cpu" "$tests_bin" --gtest_filter='CudaRaces.*'
if wanted side_by_side || wanted seed002 || wanted fp16 || (wanted offload_placements && (( ! cpu ))); then
  start_bg build_tools 400 nice -n 10 "$cmake_bin" --build "$build" -j "$jobs" --target fsdp-train fsdprun
fi
tools_ready() {  # waits for the tools' build once; true when it succeeded
  if [[ -n "${bg_pid[build_tools]:-}" ]]; then
    finish_bg build_tools
    plain_verdict "$step_rc"
    record build_tools "$step_rc" "$step_s" "$verdict" "fsdp-train and fsdprun, -j$jobs, beside the tests"
    tools_ok=$step_rc
    (( step_rc == 0 )) || tail -30 "$work/build_tools.txt" | tee -a "$work/gpu-check.log"
  fi
  return "${tools_ok:-1}"
}

# ---------------------------------------------------------------- the tests
if wanted cuda_tests; then
  run_step cuda_tests 200 "$tests_bin" --gtest_filter='-CudaRaces.*'
  record_tests cuda_tests
fi
if wanted races; then
  finish_bg races
  record_tests races
fi

# ---------------------------------------------------------------- the trainer
dev=cuda
(( cpu )) && dev=cpu
train="$repo/$build/tools/fsdp-train/fsdp-train"
fsdprun="$repo/$build/tools/fsdprun/fsdprun"
compare() { "$python" "$repo/scripts/compare_losses.py" "$@"; }
# The two steps below are functions run under timeout, in a bash of their own.
export work cpu dev train fsdprun repo python

if wanted side_by_side && tools_ready; then
  if (( cpu )); then sbs=(--preset tiny --dtype fp32 --steps 6 --warmup 2 --pairs 1 --device cpu --loss-rtol 1e-4)
  else sbs=(--preset medium --dtype bf16 --steps 10 --warmup 3 --pairs 1 --device cuda --loss-rtol 1e-2); fi
  run_step side_by_side 170 "$python" bench/gpu_side_by_side.py --build-dir "$build" --out "$work/side_by_side" "${sbs[@]}"
  plain_verdict "$step_rc"
  record side_by_side "$step_rc" "$step_s" "$verdict" "$(grep -h '^loss agreement' "$work/side_by_side.txt")"
  tail -25 "$work/side_by_side.txt" >> "$work/gpu-check.log"
fi

# configs/seed002.yaml with its fsdp_config as written (8 ranks on this one GPU, so its groups on
# Gloo staged through pinned memory: NCCL refuses two ranks on a GPU), 6 steps, against the same
# run without offload (then plain AdamW on the GPU instead of DeviceStateAdamW).
seed002() {
  local d="$work/seed002" extra=()
  (( cpu )) && extra=(--fsdp_config.device=cpu --fsdp_config.fp16=false)
  rm -rf "$d" && mkdir -p "$d/offload" "$d/no_offload"
  local run=(env FSDP_CUDA_BACKEND=gloo "$fsdprun" --standalone --nproc-per-node 8 "$train" "$repo/configs/seed002.yaml"
             --training.steps=6 --logging.log_interval=1 --logging.progress=off --training.export=none
             --training.resume=never "${extra[@]}")
  echo "== seed002 as written"; (cd "$d/offload" && "${run[@]}" --logging.jsonl="$d/offload.jsonl") || return 1
  echo "== seed002 without offload"
  (cd "$d/no_offload" && "${run[@]}" --fsdp_config.offload_params=false --logging.jsonl="$d/no_offload.jsonl") || return 1
  compare --name "seed002: offload (DeviceStateAdamW) vs no offload" --rtol 1e-3 "$d/offload.jsonl" "$d/no_offload.jsonl"
}
export -f compare seed002
if wanted seed002 && tools_ready; then
  run_step seed002 150 bash -c seed002
  plain_verdict "$step_rc"
  record seed002 "$step_rc" "$step_s" "$verdict" "$(grep -h '^seed002' "$work/seed002.txt" | tail -1 | sed 's/ (steps.*//')"
  tail -20 "$work/seed002.txt" >> "$work/gpu-check.log"
fi

# configs/tiny.yaml, one rank: fp32 on the GPU against fp32 on the CPU; fp16 with loss scaling
# against fp32 (skipped overflow steps included); and fp16 for 30 steps with a checkpoint every
# 10, resumed to 40 (the scaler's state comes from the checkpoint), against 40 uninterrupted.
fp16() {
  local d="$work/fp16" half=(--fsdp_config.fp16=true)
  (( cpu )) && half=(--fsdp_config.mixed_precision=true)  # no fp16 on cpu: bf16 stands in
  rm -rf "$d" && mkdir -p "$d"
  # A fixed decay, so that the 30-step run's schedule is the first 30 steps of the 40-step one.
  local run=("$train" "$repo/configs/tiny.yaml" "--fsdp_config.device=$dev" --logging.log_interval=5
             --logging.progress=off --training.export=none --schedule.decay_steps=38)
  echo "== fp32, device cpu"; "${run[@]}" --fsdp_config.device=cpu --training.steps=40 --training.resume=never \
    --fsdp_config.checkpoint_interval=0 "--fsdp_config.checkpoint_dir=$d/ckpt_cpu" --logging.jsonl="$d/fp32_cpu.jsonl" || return 1
  echo "== fp32, device $dev"; "${run[@]}" --training.steps=40 --training.resume=never --fsdp_config.checkpoint_interval=0 \
    "--fsdp_config.checkpoint_dir=$d/ckpt_fp32" --logging.jsonl="$d/fp32.jsonl" || return 1
  echo "== ${half[*]}, 40 steps"; "${run[@]}" "${half[@]}" --training.steps=40 --training.resume=never \
    --fsdp_config.checkpoint_interval=10 "--fsdp_config.checkpoint_dir=$d/ckpt_straight" --logging.jsonl="$d/half.jsonl" || return 1
  echo "== ${half[*]}, 30 steps"; "${run[@]}" "${half[@]}" --training.steps=30 --training.resume=never \
    --fsdp_config.checkpoint_interval=10 "--fsdp_config.checkpoint_dir=$d/ckpt_resumed" --logging.jsonl="$d/resumed.jsonl" || return 1
  echo "== ${half[*]}, resumed to 40"; "${run[@]}" "${half[@]}" --training.steps=40 --training.resume=auto \
    --fsdp_config.checkpoint_interval=10 "--fsdp_config.checkpoint_dir=$d/ckpt_resumed" --logging.jsonl="$d/resumed.jsonl" || return 1
  local rc=0
  compare --name "fp16: fp32 on $dev vs fp32 on cpu" --rtol 1e-3 "$d/fp32.jsonl" "$d/fp32_cpu.jsonl" || rc=1
  compare --name "fp16: ${half[*]} vs fp32" --rtol 2e-2 "$d/half.jsonl" "$d/fp32.jsonl" || rc=1
  compare --name "fp16: resumed at 30 vs uninterrupted" --rtol 1e-4 --from-step 31 "$d/resumed.jsonl" "$d/half.jsonl" || rc=1
  return $rc
}
export -f fp16
if wanted fp16 && tools_ready; then
  run_step fp16 100 bash -c fp16
  plain_verdict "$step_rc"
  record fp16 "$step_rc" "$step_s" "$verdict" "$(grep -h '^fp16: ' "$work/fp16.txt" | sed 's/ (steps.*//' | tr '\n' ';')"
  tail -12 "$work/fp16.txt" >> "$work/gpu-check.log"
fi

# ---------------------------------------------------------------- the rest
if wanted offload_placements && (( ! cpu )) && tools_ready; then
  run_step offload_placements 90 "$python" bench/offload_placements.py --build-dir "$build" --device cuda \
    --preset small --steps 8 --out "$work/offload_placements"
  plain_verdict "$step_rc"
  record offload_placements "$step_rc" "$step_s" "$verdict" "table in everything.tar.gz"
  tail -8 "$work/offload_placements.txt" >> "$work/gpu-check.log"
fi
# compute-sanitizer sees races inside kernels and barrier misuse, not races between streams (the
# race tests are for those); on a test whose casts run on a side stream.
if wanted sanitizer && (( ! cpu )); then
  if command -v compute-sanitizer >/dev/null; then
    for tool in racecheck synccheck; do
      run_step "sanitizer_$tool" 60 compute-sanitizer --tool "$tool" --target-processes all --error-exitcode 9 \
        "$tests_bin" --gtest_filter='Cuda.Bf16ComputeWithFp32ReductionStaysNearFp32'
      gtest_verdict "$work/sanitizer_$tool.txt" "$step_rc"
      record "sanitizer_$tool" "$step_rc" "$step_s" "$verdict" "$(grep -h 'ERROR SUMMARY' "$work/sanitizer_$tool.txt" | sort -u | tr '\n' ' ')"
    done
  else
    record sanitizer 0 0 SKIPPED "compute-sanitizer is not on PATH"
  fi
fi
[[ -n "${bg_pid[build_tools]:-}" ]] && tools_ready
log "done in $(( $(date +%s) - start ))s; results in ${out:-$work}"
publish
