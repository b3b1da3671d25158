#!/usr/bin/env bash
# check-format.sh — fails when a C++ file differs from what .clang-format makes of it, naming
# the files; CI runs it before building (scripts/test.sh). To format:
#   git ls-files '*.cpp' '*.h' | xargs clang-format -i
# The result depends on clang-format's version: the house format is Debian 12's clang-format 14
# (scripts/install-deps.sh installs it).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v clang-format >/dev/null; then
  echo "check-format: clang-format not found: run scripts/install-deps.sh" >&2
  exit 1
fi
version=$(clang-format --version | grep -o 'version [0-9]*' | cut -d' ' -f2)
if [[ "$version" != "14" ]]; then
  echo "check-format: note: clang-format $version, not 14: its output may differ from the house format's" >&2
fi
drift=()
while IFS= read -r f; do
  if ! clang-format --dry-run --Werror "$f" >/dev/null 2>&1; then drift+=("$f"); fi
done < <(git ls-files '*.cpp' '*.h')
if ((${#drift[@]})); then
  echo "check-format: ${#drift[@]} file(s) differ from .clang-format's layout:" >&2
  printf '  %s\n' "${drift[@]}" >&2
  echo "format them with: clang-format -i <file>... (clang-format 14)" >&2
  exit 1
fi
echo "check-format: $(git ls-files '*.cpp' '*.h' | wc -l) files formatted as .clang-format says"
