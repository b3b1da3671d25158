#!/usr/bin/env bash
# gpu-check.sh — confirms the CUDA path on a machine with an NVIDIA GPU, PyTorch >= 2.11 and no
# network. It runs the binaries built here against that machine's exact PyTorch
# (.gpu-prebuilt/, scripts/gpu-prebuild.sh) when its torch and CUDA versions and the tree's sources
# match their manifest and ldd finds every library they need; otherwise it builds the CUDA path
# against that machine's PyTorch from .gpu-bundle/ (scripts/gpu-bundle.sh). Then, most valuable
# first (each step's verdict is PASS, FAIL, SKIPPED or CUT OFF):
#   cuda_tests          the CUDA tests (fsdp_cuda_tests, all but the race tests), one process per
#                       test suite, each writing gtest's JSON
#   races               the stream-race tests (CudaRaces.*: side streams delayed, results compared),
#                       beside the CUDA tests
#   side_by_side        fsdp-train beside PyTorch's FSDP2 on the GPU, losses compared
#                       (bench/gpu_side_by_side.py)
#   seed002             configs/seed002.yaml on 8 ranks (Gloo staged: one GPU), its losses
#                       compared with the same run without offload
#   fp16                fp16 with loss scaling against fp32, fp32 against the CPU, and a resume from
#                       the fp16 checkpoint against the uninterrupted run
#   offload_placements  the three offload placements beside fsdp-train plan
#   sanitizer           compute-sanitizer's racecheck and synccheck on one test
# docs/gpu.md gives the device calls (command, carry, timeout_s) and each step's time.
#
# What comes back in $OUT (at most 8 files), each written as soon as it is known:
#   preflight.txt     within seconds of the start: the GPU and driver (nvidia-smi), python3's torch and
#                     CUDA, the prebuilt binaries' manifest against them, the libraries ldd finds
#                     missing, the compiler, nvcc, cmake and ninja, and what the script will do
#   gpu-check.log     each step's command, time and verdict; summary.tsv (step, rc, seconds, verdict,
#                     detail); live.txt: the running steps' output tails, copied every 15 s
#   cuda_tests.json, races.json   every test's verdict (scripts/gtest_results.py: gtest's JSON per
#                     suite, or the output's lines for a suite that was cut off)
#   results.txt       the tails of every step's output; everything.tar.gz: all of it, the configure
#                     and build logs included (no checkpoints or weights)
#
#   bash scripts/gpu-check.sh [--out DIR] [--jobs N] [--budget SECONDS] [--only STEP,...] [--rest]
#                             [--prebuilt auto|yes|no] [--cpu] [--slow F]
#     --only     just these steps, e.g. --only seed002,fp16 (configure and build, when the prebuilt
#                binaries are not used, always run; they are incremental on a warm machine)
#     --rest     the steps the last call on this machine did not reach a verdict on (it keeps
#                gpu-results/ while warm; on a fresh machine, every step)
#     --prebuilt auto: the prebuilt binaries when they match (default); yes: those or stop; no: build
#     --cpu      the rehearsal on a machine without a GPU: the CUDA tests report skipped, and the
#                trainer steps run on device cpu (bf16 for fp16) to check the comparisons
#     --slow F   each step's own time limit times F (for a slower machine: the rehearsal's 2 vCPUs)
#   FSDP_PYTHON        the Python with torch (default python3); exported, as an absolute path, to
#                      every step (bench/ and the comparisons run it)
#   FSDP_GPU_NVCC      when building: auto (default), yes (the toolkit's nvcc only), no (the wheel's
#                      headers only)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
repo=$PWD

work=gpu-results
jobs=$(nproc)
budget=570
only=""
rest=0
cpu=0
slow=1
prebuilt_mode=${FSDP_GPU_PREBUILT:-auto}
while [[ $# -gt 0 ]]; do
  case "$1" in
    --out) work="$2"; shift ;;
    --jobs) jobs="$2"; shift ;;
    --budget) budget="$2"; shift ;;
    --only) only=",$2,"; shift ;;
    --prebuilt) prebuilt_mode="$2"; shift ;;
    --rest) rest=1 ;;
    --cpu) cpu=1 ;;
    --slow) slow="$2"; shift ;;
    *) echo "gpu-check.sh: unknown argument '$1' (see the header of $0)" >&2; exit 2 ;;
  esac
  shift
done
[[ "$prebuilt_mode" =~ ^(auto|yes|no)$ ]] || { echo "gpu-check.sh: --prebuilt takes auto, yes or no" >&2; exit 2; }
start=$(date +%s)
mkdir -p "$work" && work=$(cd "$work" && pwd)
# --rest: the steps that the last call here (a warm machine keeps gpu-results/) left without a
# verdict of PASS, FAIL or SKIPPED, i.e. not started or cut off.
done_before=","
if (( rest )) && [[ -f "$work/summary.tsv" ]]; then
  done_before=",$(awk -F'\t' '$4 == "PASS" || $4 == "FAIL" || $4 == "SKIPPED" { print $1 }' "$work/summary.tsv" |
    sed 's/^sanitizer_.*/sanitizer/' | sort -u | paste -sd, -),"
fi
# This run's results only (a second call on the warm machine finds the first one's).
rm -rf "$work"/*.txt "$work"/*.tsv "$work"/*.log "$work"/*.json "$work"/json "$work"/running \
  "$work"/{side_by_side,seed002,fp16,offload_placements}
mkdir -p "$work/json" "$work/running"
out="${OUT:-}"
[[ -n "$out" ]] && mkdir -p "$out" && out=$(cd "$out" && pwd)
[[ "$out" == "$work" ]] && out=""
log() { echo "[gpu-check +$(( $(date +%s) - start ))s] $*" | tee -a "$work/gpu-check.log"; }
left() { echo $(( budget - ($(date +%s) - start) )); }
wanted() { [[ ( -z "$only" || "$only" == *",$1,"* ) && "$done_before" != *",$1,"* ]]; }

# ---------------------------------------------------------------- preflight (first seconds)
pre="$work/preflight.txt"
preflight() {
  echo "$*" >> "$pre"
  [[ -n "$out" ]] && cp -f "$pre" "$out/preflight.txt"
  return 0
}
python=${FSDP_PYTHON:-python3}
python_path=$(command -v "$python" || true)
[[ "$python_path" == /* ]] || python_path="$PWD/$python_path"
# Exported as given on the PATH (a venv's python must not be resolved through its symlink).
export FSDP_PYTHON="$python_path"
# python3's torch and the GPU, asked at once. The preflight says within 10 s what it knows; a
# torch import slower than that (a cold disk, a loaded machine) is waited for, and said.
timeout 180 "$FSDP_PYTHON" -c 'import os, sys, torch
print(os.path.dirname(torch.__file__)); print(torch.__version__); print(torch.version.cuda or "")
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())' \
  > "$work/.torch_probe" 2>&1 &
torch_probe=$!
timeout 6 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$work/.gpu_probe" 2>&1 &
gpu_probe=$!
# finished_within PID SECONDS: true when PID ended within SECONDS (it is not waited for).
finished_within() { local i; for (( i = 0; i < $2 * 5; ++i )); do kill -0 "$1" 2>/dev/null || return 0; sleep 0.2; done; return 1; }
version_of() { local p; p=$(command -v "$1") || { echo "none"; return; }; echo "$p ($("$p" --version 2>&1 | grep -m1 -oE '[0-9]+\.[0-9]+(\.[0-9]+)?' | head -1))"; }
commit=$(git rev-parse --short HEAD 2>/dev/null || echo 'no git')
sources=$(bash scripts/gpu-sources-hash.sh 2>/dev/null || echo unknown)
preflight "gpu-check preflight, $(date -u +%Y-%m-%dT%H:%M:%SZ): commit $commit; sources ${sources:0:16}; budget ${budget}s$([[ $cpu == 1 ]] && echo '; --cpu rehearsal')"
preflight "machine: $(uname -srm); $(nproc) cores; $(awk '/MemTotal/ {printf "%.0f GiB", $2 / 1048576}' /proc/meminfo) memory; $(df -h --output=avail . 2>/dev/null | tail -1 | tr -d ' ') free here"
preflight "compiler: g++ $(version_of g++); c++ $(version_of c++); nvcc $(version_of nvcc)$([[ -x /usr/local/cuda/bin/nvcc ]] && echo " /usr/local/cuda/bin/nvcc")"
preflight "tools: cmake $(version_of cmake); ninja $(version_of ninja); compute-sanitizer $(command -v compute-sanitizer || echo none); ldd $(command -v ldd || echo none); git $(command -v git || echo none)"
preflight "python: FSDP_PYTHON=$FSDP_PYTHON ($("$FSDP_PYTHON" --version 2>&1))"
preflight "carried: .gpu-prebuilt $([[ -f .gpu-prebuilt/manifest.txt ]] && echo "yes ($(du -sh .gpu-prebuilt | cut -f1))" || echo no); .gpu-bundle $(ls .gpu-bundle/*.deb 2>/dev/null | wc -l) .debs"
wait "$gpu_probe"
preflight "gpu: $(tr '\n' ' ' < "$work/.gpu_probe" | cut -c1-300)"
if ! finished_within "$torch_probe" $(( 8 - ($(date +%s) - start) )); then
  preflight "torch: python3 is still importing torch at +$(( $(date +%s) - start ))s; waiting (at most 180 s)"
fi
if wait "$torch_probe"; then
  torch_dir=$(sed -n 1p "$work/.torch_probe")
  torch_version=$(sed -n 2p "$work/.torch_probe")
  torch_cuda=$(sed -n 3p "$work/.torch_probe")
  preflight "torch: $(sed -n 4p "$work/.torch_probe") at $torch_dir (+$(( $(date +%s) - start ))s)"
else
  preflight "torch: no PyTorch in '$FSDP_PYTHON' (set FSDP_PYTHON): $(tail -3 "$work/.torch_probe" | tr '\n' ' ')"
  log "no PyTorch in '$FSDP_PYTHON'"; exit 1
fi
site=$(dirname "$torch_dir")
# torch's own libraries and the nvidia-* wheels' beside it.
torch_libs="$torch_dir/lib$(for d in "$site"/nvidia/*/lib "$site"/nvidia/*/*/lib; do [[ -d $d ]] && printf ':%s' "$d"; done; true)"

# The prebuilt binaries, when they are this machine's: same torch and CUDA, the same sources, and
# every library found (with the carried libstdc++ only if the machine's is older than they need).
prebuilt=.gpu-prebuilt
manifest="$prebuilt/manifest.txt"
why_not=""
manifest_of() { awk -v k="$1" '$1 == k { $1 = ""; sub(/^ /, ""); print; exit }' "$manifest"; }
if [[ "$prebuilt_mode" == no ]]; then why_not="--prebuilt no"
elif [[ ! -f "$manifest" ]]; then why_not="no $manifest (carry .gpu-prebuilt; scripts/gpu-prebuild.sh makes it)"
else
  preflight "manifest: torch $(manifest_of torch), cuda $(manifest_of cuda), commit $(manifest_of commit), built $(manifest_of built), needs $(manifest_of needs)"
  [[ "$(manifest_of torch)" == "$torch_version" ]] || why_not+="torch here is $torch_version, the binaries' $(manifest_of torch); "
  [[ "$(manifest_of cuda)" == "$torch_cuda" ]] || why_not+="CUDA here is $torch_cuda, the binaries' $(manifest_of cuda); "
  [[ "$(manifest_of sources)" == "$sources" ]] ||
    why_not+="the tree's sources (${sources:0:16}) are not the ones the binaries were built from ($(manifest_of sources | cut -c1-16)): run scripts/gpu-prebuild.sh after the last change; "
  if [[ -z "$why_not" ]] && ! (cd "$prebuilt" && awk '$1 == "sha256" { print $2 "  " $3 }' manifest.txt | sha256sum -c --quiet >/dev/null 2>&1); then
    why_not+="a file differs from its checksum in the manifest; "
  fi
fi
# The packed libraries this machine lacks, linked into a folder of their own: where it has a library
# of the same SONAME (zlib, say), its own stays in use, by our binaries and by Python alike.
lacking="$work/lacking-libs"
rm -rf "$lacking" && mkdir -p "$lacking"
machine_sonames=$(ldconfig -p 2>/dev/null | awk 'NR > 1 { print $1 }')
own="" carried=""
for lib in "$repo/$prebuilt"/lib/*; do
  [[ -e "$lib" ]] || continue
  if grep -qxF "${lib##*/}" <<< "$machine_sonames"; then own+="${lib##*/} "
  else ln -s "$lib" "$lacking/"; carried+="${lib##*/} "; fi
done
[[ -n "$own$carried" ]] && preflight "libraries: carried ones used: ${carried:-none}; this machine's own: ${own:-none}"
prebuilt_path="$lacking:$repo/$prebuilt/build/src:$torch_libs"
if [[ -z "$why_not" ]]; then
  binaries=("$prebuilt"/build/tests/fsdp_cuda_tests "$prebuilt"/build/tools/*/* "$prebuilt"/build/src/*)
  missing=$(LD_LIBRARY_PATH="$prebuilt_path" ldd "${binaries[@]}" 2>&1 | grep 'not found' | sed 's/^[[:space:]]*//' | sort -u)
  if grep -qE 'GLIBCXX|CXXABI|GCC_' <<< "$missing" && [[ -f "$prebuilt/lib-cxx/libstdc++.so.6" ]]; then
    preflight "ldd: this machine's libstdc++ is older than the binaries need; with the carried one ($prebuilt/lib-cxx)"
    prebuilt_path="$repo/$prebuilt/lib-cxx:$prebuilt_path"
    missing=$(LD_LIBRARY_PATH="$prebuilt_path" ldd "${binaries[@]}" 2>&1 | grep 'not found' | sed 's/^[[:space:]]*//' | sort -u)
  fi
  # The GPU driver's own libraries exist only where a GPU does: a rehearsal without one goes on.
  if (( cpu )) && grep -qE '^lib(cuda|nvidia-ml)\.so' <<< "$missing"; then
    preflight "ldd: no GPU driver here: $(grep -E '^lib(cuda|nvidia-ml)\.so' <<< "$missing" | cut -d' ' -f1 | tr '\n' ' ')(--cpu goes on)"
    missing=$(grep -vE '^lib(cuda|nvidia-ml)\.so' <<< "$missing")
  fi
  if [[ -n "$missing" ]]; then
    preflight "ldd: missing: $(head -8 <<< "$missing" | tr '\n' ';')"
    why_not+="ldd finds libraries missing; "
  else
    preflight "ldd: every library of the ${#binaries[@]} prebuilt files found (torch's from $torch_dir/lib)"
  fi
fi
if [[ -z "$why_not" ]]; then
  use_prebuilt=1
  preflight "plan: the prebuilt binaries ($prebuilt/build), no build (preflight done at +$(( $(date +%s) - start ))s)"
else
  use_prebuilt=0
  preflight "plan: build from .gpu-bundle, because: ${why_not%; } (preflight done at +$(( $(date +%s) - start ))s)"
  if [[ "$prebuilt_mode" == yes ]]; then log "--prebuilt yes, but: ${why_not%; }"; exit 1; fi
fi

# ---------------------------------------------------------------- results out, as they come
# $OUT never holds more than the 8 files named in the header.
publish() {
  [[ -n "$out" ]] || return 0
  cp -f "$work/gpu-check.log" "$work/summary.tsv" "$pre" "$out/" 2>/dev/null
  cp -f "$work/cuda_tests.json" "$work/races.json" "$out/" 2>/dev/null
  local f
  for f in "$work"/*.txt; do
    [[ "$f" == "$pre" ]] && continue
    echo "==== ${f##*/} (the last 60 lines)"; tail -n 60 "$f"
  done > "$out/results.txt" 2>/dev/null
  tar -czf /tmp/gpu-check-everything.tar.gz --exclude='*.pt' --exclude='*checkpoints*' --exclude='*ckpt*' \
    --exclude='*.safetensors' --exclude='*.distcp' --exclude='*.tar.gz' --exclude='./.*' -C "$work" . 2>/dev/null
  cp -f /tmp/gpu-check-everything.tar.gz "$out/everything.tar.gz"
}
# live.txt: the tails of the steps running now, and the log, every 15 s.
live() {
  while sleep 15; do
    {
      echo "gpu-check live at +$(( $(date +%s) - start ))s; running: $(ls "$work/running" | tr '\n' ' ')"
      for f in "$work"/running/*; do
        [[ -e "$f" ]] || continue
        echo "==== ${f##*/} (the last 40 lines)"; tail -n 40 "$work/${f##*/}.txt" 2>/dev/null
      done
    } > "$work/.live" && cp -f "$work/.live" "$out/live.txt"
    cp -f "$work/gpu-check.log" "$out/" 2>/dev/null
  done
}
if [[ -n "$out" ]]; then
  live & live_pid=$!
  trap 'kill "$live_pid" 2>/dev/null' EXIT
fi

# record NAME RC SECONDS VERDICT DETAIL: one line of summary.tsv, the log, and the results out.
record() {
  printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "$5" >> "$work/summary.tsv"
  log "$1: $4 (rc=$2, ${3}s) $5"
  publish
}

# step_limit NAME SECONDS: the step's limit times --slow, bounded by what is left of the budget.
step_limit() { local limit=$(( $2 * slow )) remaining; remaining=$(left); (( limit > remaining )) && limit=$remaining; echo "$limit"; }

# run_step NAME LIMIT CMD...: CMD with its output in $work/NAME.txt, bounded by LIMIT seconds and
# by what is left of the budget. Sets step_rc and step_s.
run_step() {
  local name="$1" limit; limit=$(step_limit "$1" "$2"); shift 2
  step_s=0
  if (( limit <= 5 )); then step_rc=124; log "$name: not started, the budget is spent"; return; fi
  log "$name: start (at most ${limit}s): $*"
  local t0; t0=$(date +%s)
  touch "$work/running/$name"
  timeout --kill-after=5 "$limit" "$@" > "$work/$name.txt" 2>&1
  step_rc=$?
  rm -f "$work/running/$name"
  step_s=$(( $(date +%s) - t0 ))
}

plain_verdict() {  # from an exit status alone
  if (( $1 == 124 || $1 == 137 )); then verdict="CUT OFF"; elif (( $1 == 0 )); then verdict=PASS; else verdict=FAIL; fi
}

log "machine: $(uname -srm); $(nproc) cores; commit $commit; budget ${budget}s$([[ $cpu == 1 ]] && echo '; --cpu rehearsal')"
log "$(sed -n 4p "$work/.torch_probe"); FSDP_PYTHON=$FSDP_PYTHON"

if (( use_prebuilt )); then
  build="$prebuilt/build"
  export LD_LIBRARY_PATH="$prebuilt_path${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  record prebuilt 0 $(( $(date +%s) - start )) PASS "torch $(manifest_of torch), commit $(manifest_of commit), built $(manifest_of built)"
else
# ---------------------------------------------------------------- what the build needs
# The .debs, unpacked without installing (once per bundle: unchanged files keep their times, so a
# second call rebuilds nothing). Debian's absolute symlinks (libz.so -> /lib/...) are pointed
# into the unpacked tree.
deps=/tmp/fsdp-gpu-deps
ls .gpu-bundle/*.deb >/dev/null 2>&1 || {
  log "no .gpu-bundle/*.deb: run scripts/gpu-bundle.sh here first, and name .gpu-bundle in the device call's carry"; exit 1; }
t0=$(date +%s)
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
    "$FSDP_PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$tools" \
      .gpu-bundle/wheels/*.whl >> "$work/tools.txt" 2>&1
  fi
  [[ -x "$bin" ]] && echo "$bin"
}
machine_tool() { local p; p=$(command -v "$1") && "$p" --version >/dev/null 2>&1 && echo "$p"; }
cmake_bin=$(machine_tool cmake || carried_tool cmake)
[[ -n "$cmake_bin" ]] || { log "no cmake on this machine and none carried (scripts/gpu-bundle.sh --with-cmake)"; exit 1; }
ninja_bin=$(machine_tool ninja || carried_tool ninja)
if [[ -n "$ninja_bin" ]]; then generator=(-G Ninja "-DCMAKE_MAKE_PROGRAM=$ninja_bin"); else generator=(-G "Unix Makefiles"); fi
record setup 0 $(( $(date +%s) - t0 )) PASS "the bundle's .debs unpacked into $deps; cmake $cmake_bin, ${generator[1]}"

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
    "-DFSDP_PYTHON=$FSDP_PYTHON" "${extra[@]}"
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
record configure 0 "$step_s" PASS "$(grep -hE '^-- fsdp(-train)?: (LibTorch|no nvcc|the CUDA path|SentencePiece|without)' "$work/configure.txt" | sed 's/^-- //' | tr '\n' ' ')"

run_step build_tests 360 "$cmake_bin" --build "$build" -j "$jobs" --target fsdp_cuda_tests
plain_verdict "$step_rc"
record build_tests "$step_rc" "$step_s" "$verdict" "fsdp_cuda_tests and libfsdp_cuda, -j$jobs"
if (( step_rc != 0 )); then tail -40 "$work/build_tests.txt" | tee -a "$work/gpu-check.log"; exit 1; fi
fi

# ---------------------------------------------------------------- the tests
# Each test suite of fsdp_cuda_tests runs in a process of its own, with gtest's JSON, so that a
# run cut off by its time limit still says which tests passed (scripts/gtest_results.py). The race
# tests run beside the CUDA tests (another process set: no test of either measures time, and the
# GPU holds both); when building, fsdp-train and fsdprun build beside both, at a lower priority.
tests_bin="$build/tests/fsdp_cuda_tests"
mapfile -t suites < <(timeout 120 "$tests_bin" --gtest_list_tests 2>>"$work/gpu-check.log" | sed -n 's/^\([A-Za-z0-9_]*\)\.$/\1/p')
if (( ${#suites[@]} == 0 )); then
  log "$tests_bin lists no tests (it does not load: the lines above)"
  record load 1 0 FAIL "$tests_bin --gtest_list_tests listed nothing"; exit 1
fi
race_suites=(); other_suites=()
for s in "${suites[@]}"; do if [[ $s == CudaRaces ]]; then race_suites+=("$s"); else other_suites+=("$s"); fi; done

# gtest_step NAME LIMIT SUITE...: the suites one after another within LIMIT seconds; writes
# $work/NAME.txt (each suite's output headed "== SUITE", and "== SUITE (exit RC)" once it ended:
# gtest_results.py reads them), the JSON of each under $work/json/NAME/, and "RC SECONDS" to
# $work/NAME.rc.
gtest_step() {
  local name="$1" limit="$2"; shift 2
  local t0 rc=0 r suite remaining
  t0=$(date +%s)
  mkdir -p "$work/json/$name"
  touch "$work/running/$name"
  : > "$work/$name.txt"
  for suite in "$@"; do
    remaining=$(( limit - ($(date +%s) - t0) ))
    if (( remaining <= 5 )); then rc=124; continue; fi
    echo "== $suite" >> "$work/$name.txt"
    timeout --kill-after=5 "$remaining" "$tests_bin" --gtest_filter="$suite.*" \
      "--gtest_output=json:$work/json/$name/$suite.json" >> "$work/$name.txt" 2>&1
    r=$?
    echo "== $suite (exit $r)" >> "$work/$name.txt"
    if (( r == 124 || r == 137 )); then rc=124; elif (( r != 0 && rc == 0 )); then rc=$r; fi
  done
  rm -f "$work/running/$name"
  echo "$rc $(( $(date +%s) - t0 ))" > "$work/$name.rc"
}
# record_tests NAME SUITE...: the verdict from the JSON of every suite that was to run.
record_tests() {
  local name="$1" rc s detail; shift
  read -r rc s < "$work/$name.rc"
  detail=$("$FSDP_PYTHON" scripts/gtest_results.py --out "$work/$name.json" --text "$work/$name.txt" \
           --suites "$(IFS=,; echo "$*")" "$work/json/$name" 2>&1 | tail -1)
  local passed failed skipped cut
  passed=$(grep -oE 'passed [0-9]+' <<< "$detail" | grep -oE '[0-9]+')
  failed=$(grep -oE 'failed [0-9]+' <<< "$detail" | grep -oE '[0-9]+')
  skipped=$(grep -oE 'skipped [0-9]+' <<< "$detail" | grep -oE '[0-9]+')
  cut=$(grep -oE 'cut off [0-9]+' <<< "$detail" | grep -oE '[0-9]+')
  if (( ${failed:-1} > 0 )) || { (( rc != 0 && rc != 124 )); }; then verdict=FAIL
  elif (( rc == 124 || ${cut:-0} > 0 )); then verdict="CUT OFF"
  elif (( ${passed:-0} == 0 && ${skipped:-0} > 0 )); then verdict=SKIPPED
  else verdict=PASS; fi
  record "$name" "$rc" "$s" "$verdict" "$detail"
  "$FSDP_PYTHON" - "$work/$name.json" <<'EOF' | head -40 | tee -a "$work/gpu-check.log"
import json, sys
for s in json.load(open(sys.argv[1]))["testsuites"]:
    for t in s.get("testsuite", []):
        if t["verdict"] not in ("PASSED", "SKIPPED"):
            print(f"  {t['verdict']}: {s['name']}.{t['name']}")
EOF
}

# With --cpu the race tests' "GPU" runs use a cpu mesh: their plumbing is rehearsed, not the streams.
export FSDP_RACE_TESTS_ON_CPU=$cpu
if wanted races && (( ${#race_suites[@]} )); then
  limit=$(step_limit races 200)
  log "races: start in the background (at most ${limit}s): ${race_suites[*]}"
  gtest_step races "$limit" "${race_suites[@]}" &
  races_pid=$!
fi
declare -A bg_pid bg_t0
start_bg() {  # start_bg NAME LIMIT CMD...: as run_step, in the background; finish_bg NAME waits
  local name="$1" limit; limit=$(step_limit "$1" "$2"); shift 2
  log "$name: start in the background (at most ${limit}s): $*"
  bg_t0[$name]=$(date +%s)
  touch "$work/running/$name"
  timeout --kill-after=5 "$limit" "$@" > "$work/$name.txt" 2>&1 &
  bg_pid[$name]=$!
}
finish_bg() {  # sets step_rc and step_s
  wait "${bg_pid[$1]}"; step_rc=$?
  rm -f "$work/running/$1"
  step_s=$(( $(date +%s) - bg_t0[$1] ))
  unset "bg_pid[$1]"
}
if (( ! use_prebuilt )) && { wanted side_by_side || wanted seed002 || wanted fp16 || (wanted offload_placements && (( ! cpu ))); }; then
  start_bg build_tools 400 nice -n 10 "$cmake_bin" --build "$build" -j "$jobs" --target fsdp-train fsdprun
fi
tools_ready() {  # waits for the tools' build once; true when it succeeded (or nothing is built)
  (( use_prebuilt )) && return 0
  if [[ -n "${bg_pid[build_tools]:-}" ]]; then
    finish_bg build_tools
    plain_verdict "$step_rc"
    record build_tools "$step_rc" "$step_s" "$verdict" "fsdp-train and fsdprun, -j$jobs, beside the tests"
    tools_ok=$step_rc
    (( step_rc == 0 )) || tail -30 "$work/build_tools.txt" | tee -a "$work/gpu-check.log"
  fi
  return "${tools_ok:-1}"
}

if wanted cuda_tests; then
  limit=$(step_limit cuda_tests 200)
  log "cuda_tests: start (at most ${limit}s): ${other_suites[*]}"
  gtest_step cuda_tests "$limit" "${other_suites[@]}"
  record_tests cuda_tests "${other_suites[@]}"
fi
if [[ -n "${races_pid:-}" ]]; then
  wait "$races_pid"
  record_tests races "${race_suites[@]}"
fi

# ---------------------------------------------------------------- the trainer
dev=cuda
(( cpu )) && dev=cpu
train="$repo/$build/tools/fsdp-train/fsdp-train"
fsdprun="$repo/$build/tools/fsdprun/fsdprun"
compare() { "$FSDP_PYTHON" "$repo/scripts/compare_losses.py" "$@"; }
# The two steps below are functions run under timeout, in a bash of their own.
export work cpu dev train fsdprun repo

if wanted side_by_side && tools_ready; then
  if (( cpu )); then sbs=(--preset tiny --dtype fp32 --steps 6 --warmup 2 --pairs 1 --device cpu --loss-rtol 1e-4)
  else sbs=(--preset medium --dtype bf16 --steps 10 --warmup 3 --pairs 1 --device cuda --loss-rtol 1e-2); fi
  run_step side_by_side 170 "$FSDP_PYTHON" bench/gpu_side_by_side.py --build-dir "$build" --out "$work/side_by_side" "${sbs[@]}"
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
  run_step offload_placements 90 "$FSDP_PYTHON" bench/offload_placements.py --build-dir "$build" --device cuda \
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
      plain_verdict "$step_rc"
      grep -q '^\[  SKIPPED \] 1 test' "$work/sanitizer_$tool.txt" && verdict=SKIPPED
      record "sanitizer_$tool" "$step_rc" "$step_s" "$verdict" "$(grep -h 'ERROR SUMMARY' "$work/sanitizer_$tool.txt" | sort -u | tr '\n' ' ')"
    done
  else
    record sanitizer 0 0 SKIPPED "compute-sanitizer is not on PATH"
  fi
fi
[[ -n "${bg_pid[build_tools]:-}" ]] && tools_ready
log "done in $(( $(date +%s) - start ))s; results in ${out:-$work}"
publish
