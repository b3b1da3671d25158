#!/usr/bin/env python3
"""Checks that the GPU machine can configure and run this tree: every find_package(... REQUIRED)
and pkg_check_modules(... REQUIRED) of the project's CMake files must be met by what
scripts/gpu-deps.txt says the machine has or .gpu-bundle/ carries, and every shared library a
.gpu-prebuilt/ binary needs must be packed beside it or be one of the machine's (gpu-deps.txt's
`lib` lines). A new required dependency then fails here, not in the first minutes of a device call.

    python3 scripts/check-gpu-deps.py           # the tree and the table; the bundle and prebuilt
                                                # folders too where they exist
Exit status 0 when everything is met, 1 naming each dependency that is not.

The CMake files are read as text (comments dropped, calls that span lines joined); a call inside
an if() counts as if its branch were taken, so the check errs towards asking. The separate
consumer projects of tests/consumer (they find this project's own package) are not the build's.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TABLE = os.path.join(REPO, "scripts", "gpu-deps.txt")
BUNDLE = os.path.join(REPO, ".gpu-bundle")
PREBUILT = os.path.join(REPO, ".gpu-prebuilt")
SKIP_DIRS = {".git", ".gpu-bundle", ".gpu-prebuilt", "gpu-results", "consumer", "__pycache__"}


def read_table():
    finds, debs, libs = {}, [], []
    with open(TABLE) as fh:
        for number, raw in enumerate(fh, 1):
            line = raw.split("#", 1)[0].split()
            if not line:
                continue
            kind = line[0]
            if kind == "find" and len(line) >= 3 and line[2] == "machine":
                finds[line[1]] = ("machine", [], None)
            elif kind == "find" and len(line) == 5 and line[2] == "deb":
                finds[line[1]] = ("deb", line[3].split(","), line[4])
                debs += line[3].split(",")
            elif kind == "deb" and len(line) == 2:
                debs += line[1].split(",")
            elif kind == "lib" and len(line) >= 2:
                libs += line[1:]
            else:
                sys.exit(f"{TABLE}:{number}: cannot read this line: {raw.strip()}")
    return finds, debs, libs


def cmake_files():
    for root, dirs, files in os.walk(REPO):
        rel = os.path.relpath(root, REPO)
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not (rel == "." and d.startswith("build"))]
        for f in files:
            if f == "CMakeLists.txt" or f.endswith(".cmake"):
                yield os.path.join(root, f)


def strip_comments(text: str) -> str:
    """CMake's line comments dropped, keeping quoted strings and the line count."""
    out, quoted, i = [], False, 0
    while i < len(text):
        c = text[i]
        if c == "\\" and quoted:
            out.append(text[i:i + 2])
            i += 2
            continue
        if c == '"':
            quoted = not quoted
        elif c == "#" and not quoted:
            while i < len(text) and text[i] != "\n":
                i += 1
            continue
        out.append(c)
        i += 1
    return "".join(out)


CALL = re.compile(r"\b(find_package|pkg_check_modules|pkg_search_module)\s*\(([^)]*)\)", re.IGNORECASE)
PKG_KEYWORDS = {"REQUIRED", "QUIET", "IMPORTED_TARGET", "GLOBAL", "NO_CMAKE_PATH", "NO_CMAKE_ENVIRONMENT_PATH"}


def required_dependencies():
    """(name, 'file:line') of every REQUIRED find in the build's CMake files."""
    found = []
    for path in sorted(cmake_files()):
        text = strip_comments(open(path, encoding="utf-8", errors="replace").read())
        for m in CALL.finditer(text):
            args = m.group(2).split()
            if "REQUIRED" not in args or not args:
                continue
            where = f"{os.path.relpath(path, REPO)}:{text.count(chr(10), 0, m.start()) + 1}"
            if m.group(1).lower() == "find_package":
                found.append((args[0], where))
            else:
                for module in args[1:]:
                    if module not in PKG_KEYWORDS:
                        found.append(("pkg-config:" + re.split(r"[<>=]", module)[0], where))
    return found


def deb_files(package: str):
    """The .deb of `package` in the bundle and its file list (None without dpkg-deb)."""
    debs = [f for f in os.listdir(BUNDLE) if f.startswith(package + "_") and f.endswith(".deb")]
    if not debs:
        return None, None
    try:
        listing = subprocess.run(["dpkg-deb", "-c", os.path.join(BUNDLE, debs[0])], capture_output=True,
                                 text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return debs[0], None
    return debs[0], [line.split()[-1] for line in listing.splitlines() if line.split()]


def check_finds(finds, debs) -> list[str]:
    problems = []
    have_bundle = os.path.isdir(BUNDLE)
    required = required_dependencies()
    print(f"check-gpu-deps: {len(required)} REQUIRED finds in the tree's CMake files")
    for name, where in required:
        if name not in finds:
            problems.append(f"{name} ({where}) is REQUIRED, but scripts/gpu-deps.txt says nothing of it: the GPU "
                            "machine has no Debian -dev packages, so add a `find` line with the Debian package that "
                            "provides it (scripts/gpu-bundle.sh then carries it), or make the dependency optional")
            continue
        provider, packages, evidence = finds[name]
        if provider == "machine" or not have_bundle:
            print(f"  {name:14} {where:40} {provider}" + ("" if provider == "machine" else " (no .gpu-bundle/ here)"))
            continue
        holds = False
        for package in packages:
            deb, listing = deb_files(package)
            if deb is None:
                problems.append(f"{name} ({where}): .gpu-bundle/ has no {package}_*.deb: run scripts/gpu-bundle.sh")
            elif listing is None or any(f.endswith("/" + evidence) for f in listing):
                holds = True
        if holds:
            print(f"  {name:14} {where:40} .gpu-bundle: {', '.join(packages)} ({evidence})")
        elif not any("has no" in p and name in p for p in problems):
            problems.append(f"{name} ({where}): none of {', '.join(packages)} in .gpu-bundle/ holds {evidence}")
    if have_bundle:
        for package in debs:
            if deb_files(package)[0] is None:
                problems.append(f".gpu-bundle/ has no {package}_*.deb (scripts/gpu-deps.txt lists it): run "
                                "scripts/gpu-bundle.sh")
    return problems


def needed(path: str):
    out = subprocess.run(["readelf", "-d", path], capture_output=True, text=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)


def is_elf(path: str) -> bool:
    with open(path, "rb") as fh:
        return fh.read(4) == b"\x7fELF"


def check_prebuilt(libs) -> list[str]:
    manifest = os.path.join(PREBUILT, "manifest.txt")
    if not os.path.isfile(manifest):
        print("check-gpu-deps: no .gpu-prebuilt/manifest.txt (scripts/gpu-prebuild.sh makes it): not checked")
        return []
    problems = []
    packed = set()
    files = []
    for root, _, names in os.walk(PREBUILT):
        for n in names:
            full = os.path.join(root, n)
            if n != "manifest.txt":
                files.append(full)
                if os.path.relpath(root, PREBUILT) in ("lib", os.path.join("build", "src")):
                    packed.add(n)
    sums = {}
    for line in open(manifest):
        parts = line.split()
        if parts and parts[0] == "sha256":
            sums[parts[2]] = parts[1]
    for full in sorted(files):
        rel = os.path.relpath(full, PREBUILT)
        digest = hashlib.sha256(open(full, "rb").read()).hexdigest()
        if sums.get(rel) != digest:
            problems.append(f".gpu-prebuilt/{rel}: its sha256 is not the manifest's: run scripts/gpu-prebuild.sh again")
        if not is_elf(full) or rel.startswith("lib-cxx"):
            continue
        for lib in needed(full):
            if lib in packed or any(fnmatch.fnmatch(lib, g) for g in libs):
                continue
            problems.append(f".gpu-prebuilt/{rel} needs {lib}, which is neither packed nor the GPU machine's "
                            "(scripts/gpu-deps.txt `lib` lines): run scripts/gpu-prebuild.sh again")
    print(f"check-gpu-deps: .gpu-prebuilt/: {len(files)} files, every NEEDED library packed or the machine's"
          if not problems else f"check-gpu-deps: .gpu-prebuilt/: {len(problems)} problems")
    return problems


def main() -> int:
    finds, debs, libs = read_table()
    problems = check_finds(finds, debs) + check_prebuilt(libs)
    for p in problems:
        print(f"check-gpu-deps: FAIL: {p}")
    if problems:
        return 1
    print("check-gpu-deps: every required dependency is met on the GPU machine")
    return 0


if __name__ == "__main__":
    sys.exit(main())
