#!/usr/bin/env python3
"""Lists every bench/results path that README.md and docs/*.md cite, and whether it is committed.

Only the results the documentation cites are kept in git (with the raw files a script redraws
their tables from); new benchmark output under bench/results is ignored by .gitignore, so a
result that a document starts citing has to be added with `git add -f`. This check catches the
citation whose files were never added, or were removed while still cited:

    python3 bench/cited_results.py            # every cited path; exit 1 naming the missing ones
    python3 bench/cited_results.py --missing  # the missing ones and the count only

A cited path is present when git tracks that file, or a file below that directory, or (a path
with `*`) a file or directory it matches. Outside a git checkout the files on disk count instead.
Only the standard library is needed.
"""

from __future__ import annotations

import argparse
import fnmatch
import glob
import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md", "docs/*.md"]
CITED = re.compile(r"bench/results/[A-Za-z0-9_.*+/-]*[A-Za-z0-9_*+/-]")  # not a sentence's full stop


def citations() -> dict[str, list[str]]:
    """cited path (no trailing /) -> where it is cited (file:line), in order of first citation."""
    found: dict[str, list[str]] = {}
    for doc in sorted({p for pattern in DOCS for p in glob.glob(os.path.join(REPO, pattern))}):
        rel = os.path.relpath(doc, REPO)
        with open(doc, encoding="utf-8") as fh:
            for n, line in enumerate(fh, 1):
                for m in CITED.finditer(line):
                    found.setdefault(m.group(0).rstrip("/"), []).append(f"{rel}:{n}")
    return found


def committed() -> list[str] | None:
    """The files git tracks under bench/results (None outside a git checkout)."""
    try:
        out = subprocess.run(["git", "-C", REPO, "ls-files", "-z", "bench/results"], capture_output=True,
                             text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return [p for p in out.split("\0") if p]


def present(path: str, files: list[str] | None) -> bool:
    if files is None:
        return bool(glob.glob(os.path.join(REPO, path)))
    # every directory of every tracked file, so that a cited directory or a pattern for one matches
    dirs = {os.path.dirname(f) for f in files}
    dirs |= {d for f in dirs for d in (f[:i] for i, c in enumerate(f) if c == "/")}
    return any(fnmatch.fnmatchcase(p, path) for p in (*files, *dirs))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--missing", action="store_true", help="print only the missing paths and the count")
    a = p.parse_args(argv)
    files = committed()
    cited = citations()
    missing = [c for c in cited if not present(c, files)]
    for c, where in cited.items():
        if c in missing or not a.missing:
            print(f"{'MISSING' if c in missing else 'ok':8} {c}  ({', '.join(where)})")
    what = "on disk" if files is None else "committed"
    print(f"{len(cited)} cited paths, {len(missing)} missing" + (f" (not {what})" if missing else ""))
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
