#!/usr/bin/env python3
"""Fails when README.md, docs/*.md or a folder's README.md names something of this repository
that does not exist.

Checked, outside fenced code blocks:
  - every Markdown link and image, [text](target) and ![alt](target): the file or folder it
    names, relative to the page, and its #anchor, a heading of that page (or of this page for a
    bare #anchor) as GitHub slugs it;
  - every repository path written as code, `include/fsdp/plan.h`, `tools/fsdp-train/data/data.h`,
    `<fsdp/call.h>`: the file or folder must exist. Paths with a placeholder or a pattern in them
    (`step_<N>`, `*.cmake`, `state.{h,cpp}`) and paths under build outputs are not checked.
Links to other sites (http:, https:, mailto:) are not fetched.

Usage: check-doc-links.py [--root DIR] [FILE.md ...]
  (default: README.md, docs/*.md and every folder's README.md, build folders left out)
Python 3 standard library only. Exit status 0 when everything exists, 1 otherwise, with one
line per problem: FILE:LINE: what is missing.
"""
import argparse
import pathlib
import re
import sys
import unicodedata

LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")
# Top-level folders of this repository whose paths, written as code, must exist.
CHECKED_ROOTS = ("include/", "src/", "tools/", "tests/", "scripts/", "bench/", "configs/",
                 "docs/", "examples/", "cmake/", ".ci/")
PLACEHOLDER = re.compile(r"[<>*{}$?\[\]]|\.\.\.|…")


def github_slug(heading):
    """The anchor GitHub gives a heading: lower case, inline markup and punctuation dropped,
    spaces to hyphens (letters, digits, '-' and '_' kept)."""
    text = re.sub(r"!\[[^\]]*\]\([^)]*\)", "", heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"<[^>]+>", "", text)
    text = text.strip().lower()
    out = []
    for ch in text:
        if ch in "-_ ":
            out.append("-" if ch == " " else ch)
        elif unicodedata.category(ch)[0] in "LN":
            out.append(ch)
    return "".join(out)


def prose_lines(text):
    """(line number, line) of the lines outside fenced code blocks."""
    fence = None
    for number, line in enumerate(text.split("\n"), 1):
        stripped = line.lstrip()
        marker = re.match(r"(`{3,}|~{3,})", stripped)
        if fence is None and marker:
            fence = marker.group(1)[0] * len(marker.group(1))
            continue
        if fence is not None:
            closing = stripped.strip()
            if closing.startswith(fence) and set(closing) == {fence[0]}:
                fence = None
            continue
        yield number, line


def anchors_of(path, cache={}):
    if path not in cache:
        seen = {}
        anchors = set()
        for _, line in prose_lines(path.read_text(encoding="utf-8")):
            anchors.update(HTML_ANCHOR.findall(line))
            match = HEADING.match(line)
            if not match:
                continue
            slug = github_slug(match.group(2))
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            anchors.add(slug if count == 0 else f"{slug}-{count}")
        cache[path] = anchors
    return cache[path]


def check_link(page, root, target):
    if re.match(r"^[a-z][a-z0-9+.-]*:", target):   # http:, https:, mailto:
        return None
    path_part, _, anchor = target.partition("#")
    dest = (page.parent / path_part).resolve() if path_part else page.resolve()
    try:
        dest.relative_to(root)
    except ValueError:
        return f"link {target} leaves the repository"
    if not dest.exists():
        return f"link {target}: no file or folder {dest.relative_to(root)}"
    if anchor:
        if dest.is_dir() or dest.suffix.lower() != ".md":
            return None  # line anchors (#L10) of source files are GitHub's, not checked here
        if anchor not in anchors_of(dest):
            return f"link {target}: {dest.relative_to(root)} has no section with the anchor #{anchor}"
    return None


def code_paths(line):
    for match in CODE_SPAN.finditer(line):
        span = match.group(2).strip()
        for word in span.split():
            word = word.rstrip(".,;:)").lstrip("(")
            header = re.fullmatch(r"<(fsdp/[A-Za-z0-9_./-]+\.h)>", word)
            if header:
                yield "include/" + header.group(1)
                continue
            if PLACEHOLDER.search(word) or "=" in word:
                continue
            if word.startswith(CHECKED_ROOTS):
                yield word


def check_page(page, root):
    problems = []
    rel = page.relative_to(root)
    for number, line in prose_lines(page.read_text(encoding="utf-8")):
        for target in LINK.findall(line):
            problem = check_link(page, root, target)
            if problem:
                problems.append(f"{rel}:{number}: {problem}")
        for path in code_paths(line):
            if not (root / path).exists():
                problems.append(f"{rel}:{number}: `{path}` does not exist in the repository")
    return problems


def default_pages(root):
    """README.md, docs/*.md, and the README.md of every folder of the repository (build folders,
    hidden folders and the virtual environment's left out)."""
    readmes = [p for p in root.glob("*/**/README.md")
               if not any(part.startswith((".", "build")) or part in ("node_modules", "venv")
                          for part in p.relative_to(root).parts[:-1])]
    return [root / "README.md"] + sorted((root / "docs").glob("*.md")) + sorted(readmes)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", default=pathlib.Path(__file__).resolve().parent.parent,
                        type=pathlib.Path, help="the repository (default: this script's)")
    parser.add_argument("pages", nargs="*", type=pathlib.Path)
    args = parser.parse_args()
    root = args.root.resolve()
    pages = [p.resolve() for p in args.pages] or default_pages(root)
    missing = [p for p in pages if not p.is_file()]
    if missing:
        print(f"check-doc-links: no such page: {', '.join(map(str, missing))}", file=sys.stderr)
        return 2
    problems = []
    for page in pages:
        problems += check_page(page, root)
    for problem in problems:
        print(problem)
    print(f"check-doc-links: {len(pages)} pages, {len(problems)} problem(s)", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
