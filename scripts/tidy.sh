#!/usr/bin/env bash
# tidy.sh — runs clang-tidy (.clang-tidy's checks) over the given C++ files, or over every
# source file of src/ and tools/ when none are given, with the flags of build/ (configured by
# scripts/build.sh, which writes compile_commands.json). Exits non-zero on any finding. Slow:
# LibTorch's headers take clang-tidy 20-60 s per file on 2 cores, so CI does not run it; run it
# on the files a change touches.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ ! -f build/compile_commands.json ]]; then
  echo "tidy: build/compile_commands.json is missing: run scripts/build.sh first" >&2
  exit 1
fi
files=("$@")
if ((${#files[@]} == 0)); then mapfile -t files < <(git ls-files 'src/*.cpp' 'tools/*.cpp'); fi
# The commands carry GCC's precompiled header (-include .../cmake_pch.hxx beside its .gch), which
# clang cannot read: clang-tidy gets the same commands without it, so each file is checked with
# the includes it states itself.
mkdir -p build/tidy
python3 - build/compile_commands.json build/tidy/compile_commands.json <<'PY'
import json, re, sys
commands = json.load(open(sys.argv[1]))
for c in commands:
    c["command"] = re.sub(r" -include \S*cmake_pch\.hxx| -Winvalid-pch", "", c["command"])
json.dump(commands, open(sys.argv[2], "w"), indent=1)
PY
clang-tidy -p build/tidy --quiet "${files[@]}"
