#!/usr/bin/env python3
"""Turns a public header's plain // comments into Doxygen comments, keeping their words.

For a header written with // comments (one from before the API reference, or from a branch that
predates it); new headers are written with /// from the start. In place, for each FILE:
  - the top comment, after the "// layer: ..." line, becomes the file's comment (/// \\file);
  - a run of full-line // comments directly above a declaration at namespace or class scope
    becomes ///, and a trailing // beside such a declaration becomes ///<;
  - an example (lines indented by two spaces or more after the comment's own space) becomes a
    \\code block;
  - a word with <...> in it (step_<N>, std::vector<at::Tensor>) is quoted as code, since Doxygen
    would read it as an HTML tag.
Comments inside function bodies, section comments followed by a blank line, and closing-brace
comments stay as they are. What the run leaves undocumented, Doxygen names: build the reference
(cmake --build build --target docs) and write those comments by hand.

Usage: python3 docs/api/doxygen_comments.py include/fsdp/models/new_header.h ...
Python 3 standard library only.
"""
import pathlib
import re
import sys

SCOPE = re.compile(r'\b(namespace|class|struct|union|enum)\b|extern\s+"C"')
# An example starts indented by two spaces after "// " (three after "///"); its lines may be deeper.
EXAMPLE_START = re.compile(r"^\s*/// {3}\S")
EXAMPLE = re.compile(r"^\s*///\s{3,}\S")


def split_comment(line):
    """(code, comment): the line cut at its first // outside a string or character literal."""
    quote, i = None, 0
    while i < len(line):
        c = line[i]
        if quote:
            if c == "\\":
                i += 2
                continue
            if c == quote:
                quote = None
        elif c in "\"'":
            quote = c
        elif line.startswith("//", i):
            return line[:i], line[i:]
        i += 1
    return line, ""


def opens_scope(declaration):
    """Whether a { after this declaration text opens a namespace, class, struct, union or enum
    (and not a function body: no parenthesis after the keyword)."""
    match = SCOPE.search(declaration)
    return match is not None and "(" not in declaration[match.end():]


def convert_comments(lines):
    out, depth_kinds, declaration = [], [], ""
    i = 0
    if lines and lines[0].startswith("// layer:"):
        out.append(lines[0])
        i = 1
        top = []
        while i < len(lines) and lines[i].startswith("//") and not lines[i].startswith("///"):
            top.append(lines[i])
            i += 1
        if top:
            out.append("/// \\file")
            out += ["///" + t[2:] for t in top]
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        at_scope = all(kind == "scope" for kind in depth_kinds)
        if at_scope and stripped.startswith("//") and not stripped.startswith("///"):
            end = i
            while end < len(lines) and lines[end].strip().startswith("//") \
                    and not lines[end].strip().startswith("///"):
                end += 1
            following = lines[end].strip() if end < len(lines) else ""
            documents = following and not following.startswith(
                ("#", "}", "//", "public:", "private:", "protected:"))
            continues_trailing = out and "///<" in out[-1] and not out[-1].strip().startswith("//") \
                and lines[i - 1].find("//") == line.find("//")
            for k in range(i, end):
                if continues_trailing:
                    out.append(lines[k].replace("//", "///<", 1))
                else:
                    out.append(lines[k].replace("//", "///", 1) if documents else lines[k])
            i = end
            continue
        code, comment = split_comment(line)
        if at_scope and comment and code.strip() and not comment.startswith("///") \
                and not code.strip().startswith(("#", "}")) \
                and (not code.rstrip().endswith("{") or opens_scope(declaration + code)):
            line = code + "///< " + comment[2:].lstrip()
        out.append(line)
        for c in code:
            if c == "{":
                depth_kinds.append("scope" if opens_scope(declaration) else "body")
                declaration = ""
            elif c == "}":
                if depth_kinds:
                    depth_kinds.pop()
                declaration = ""
            elif c == ";":
                declaration = ""
            else:
                declaration += c
        declaration += " "
        i += 1
    return out


def fence_examples(lines):
    out, i, in_code = [], 0, False
    while i < len(lines):
        stripped = lines[i].strip()
        if stripped.startswith(("/// \\code", "/// \\endcode")):
            in_code = stripped.startswith("/// \\code")
        if not in_code and EXAMPLE_START.match(lines[i]) and not stripped.startswith("///<"):
            indent = re.match(r"^(\s*)", lines[i]).group(1)
            end = i
            while end < len(lines) and (EXAMPLE.match(lines[end]) or (
                    lines[end].strip() == "///" and end + 1 < len(lines) and EXAMPLE.match(lines[end + 1]))):
                end += 1
            out += [indent + "/// \\code{.cpp}"] + lines[i:end] + [indent + "/// \\endcode"]
            i = end
        else:
            out.append(lines[i])
            i += 1
    return out


def quote_token(match):
    token, lead, trail = match.group(0), "", ""
    while token and token[0] in "(\"'":
        lead, token = lead + token[0], token[1:]
    while token and (token[-1] in ".,;:\"'" or (token[-1] == ")" and token.count("(") < token.count(")"))):
        trail, token = token[-1] + trail, token[:-1]
    return lead + "`" + token + "`" + trail


def quote_angle_words(lines):
    out, in_code = [], False
    for line in lines:
        s = line.strip()
        if s.startswith("/// \\code"):
            in_code = True
        elif s.startswith("/// \\endcode"):
            in_code = False
        elif "///" in line and not in_code:
            head, body = re.match(r"^(.*?///<?)(.*)$", line).groups()
            parts = re.split(r"(`[^`]*`)", body)
            for k in range(0, len(parts), 2):
                parts[k] = re.sub(r"\S*<\S*>\S*", quote_token, parts[k])
            line = head + "".join(parts)
        out.append(line)
    return out


def main(paths):
    for name in paths:
        path = pathlib.Path(name)
        lines = path.read_text(encoding="utf-8").split("\n")
        path.write_text("\n".join(quote_angle_words(fence_examples(convert_comments(lines)))), encoding="utf-8")
    return 0


if __name__ == "__main__":
    if len(sys.argv) < 2:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1:]))
