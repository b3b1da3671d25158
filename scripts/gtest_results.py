#!/usr/bin/env python3
"""One JSON of a gtest binary's results, from runs of one test suite each (scripts/gpu-check.sh):
each suite's --gtest_output=json file where the run wrote one, and where it did not (the run was
cut off by its time limit, or crashed) the tests read from that run's output, so that a run cut
short still says which tests passed. Writes gtest's JSON layout (testsuites, each test's
result and failures) with two additions: each test's "verdict" (PASSED, FAILED, SKIPPED, CUT OFF,
CRASHED or NOT RUN) and each suite's "source" (its gtest JSON, or the output). Prints one line:

    passed P, failed F, skipped S, cut off C, not run N; skipped because: <the first reason>

    python3 scripts/gtest_results.py --out cuda_tests.json --text cuda_tests.txt --suites A,B,C JSON_DIR
The output holds the runs one after another, each headed "== <suite> (exit <status>)" once it ended.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

RESULT_LINE = re.compile(r"^\[\s*(OK|FAILED|SKIPPED)\s*\] ([A-Za-z0-9_/]+\.[A-Za-z0-9_/]+)(?: \((\d+) ms\))?$")
RUN_LINE = re.compile(r"^\[ RUN\s*\] ([A-Za-z0-9_/]+\.[A-Za-z0-9_/]+)$")
SUITE_HEAD = re.compile(r"^== ([A-Za-z0-9_/]+)(?: \(exit (-?\d+)\))?$")


def verdict_of(test: dict) -> str:
    if test.get("failures"):
        return "FAILED"
    if test.get("result") == "SKIPPED":
        return "SKIPPED"
    if test.get("status") == "NOTRUN" or test.get("result") == "SUPPRESSED":
        return "NOT RUN"
    return "PASSED"


def output_sections(text: str) -> dict:
    """suite -> (its output lines, exit status or None while it ran)."""
    sections, current = {}, None
    for line in text.splitlines():
        m = SUITE_HEAD.match(line)
        if m:
            current = m.group(1)
            lines, _ = sections.get(current, ([], None))
            sections[current] = (lines, int(m.group(2)) if m.group(2) else None)
            continue
        if current:
            sections[current][0].append(line)
    return sections


def from_output(suite: str, lines: list, status) -> dict:
    """A suite's tests as its output shows them; the test running when it ended is CUT OFF (the
    time limit: status 124 or 137, or still running) or CRASHED."""
    tests, order, running, reason = {}, [], None, {}
    for line in lines:
        m = RUN_LINE.match(line)
        if m:
            running = m.group(1)
            order.append(running)
            tests[running] = {"name": running.split(".", 1)[1], "classname": suite, "status": "RUN"}
            continue
        m = RESULT_LINE.match(line)
        if m and m.group(2) in tests:
            t = tests[m.group(2)]
            t["time"] = f"{int(m.group(3) or 0) / 1000:.3f}s"
            if m.group(1) == "FAILED":
                t["failures"] = [{"failure": "failed (see the output)", "type": ""}]
            elif m.group(1) == "SKIPPED":
                t["result"] = "SKIPPED"
                if running in reason:
                    t["skipped"] = [{"message": reason[running]}]
            t.setdefault("result", "COMPLETED")
            running = None
        elif running and line.strip() and not line.startswith("[") and not line.endswith(": Skipped"):
            reason.setdefault(running, line.strip())
    for name in order:
        t = tests[name]
        if "result" not in t:
            t["verdict"] = "CUT OFF" if status in (None, 124, 137, -9, -15) else "CRASHED"
            t["failures"] = [{"failure": f"the run ended during this test (exit {status})", "type": ""}]
        else:
            t["verdict"] = verdict_of(t)
    return {"name": suite, "source": "the output (no gtest JSON: cut off or crashed)",
            "tests": len(order), "testsuite": [tests[n] for n in order]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--text", required=True)
    p.add_argument("--suites", default="", help="the suites that were to run, in order (comma-separated)")
    p.add_argument("json_dir")
    a = p.parse_args()
    text = open(a.text, errors="replace").read() if os.path.exists(a.text) else ""
    sections = output_sections(text)
    wanted = [s for s in a.suites.split(",") if s] or sorted(sections)
    suites = []
    for suite in wanted:
        path = os.path.join(a.json_dir, suite + ".json")
        data = None
        if os.path.exists(path):
            try:
                data = json.load(open(path))
            except ValueError:
                data = None
        if data:
            for s in data.get("testsuites", []):
                s["source"] = "gtest JSON"
                for t in s.get("testsuite", []):
                    t["verdict"] = verdict_of(t)
                suites.append(s)
        elif suite in sections:
            suites.append(from_output(suite, *sections[suite]))
        else:
            suites.append({"name": suite, "source": "not started (no time left)", "tests": 0, "testsuite": [],
                           "verdict": "NOT RUN"})
    counts = {}
    for s in suites:
        for t in s.get("testsuite", []):
            counts[t["verdict"]] = counts.get(t["verdict"], 0) + 1
    not_started = [s["name"] for s in suites if s.get("verdict") == "NOT RUN"]
    reasons = [m.get("message", "") for s in suites for t in s.get("testsuite", []) for m in t.get("skipped", [])
               if isinstance(m, dict)]
    if not any(reasons):  # gtest prints a skip's message on the line after "<file>:<line>: Skipped"
        lines = text.splitlines()
        reasons = [lines[i + 1] for i, l in enumerate(lines[:-1]) if l.endswith(": Skipped")]
    result = {"tests": sum(counts.values()), "failures": counts.get("FAILED", 0) + counts.get("CRASHED", 0),
              "counts": counts, "suites_not_started": not_started, "testsuites": suites}
    with open(a.out, "w") as fh:
        json.dump(result, fh, indent=1)
    line = (f"passed {counts.get('PASSED', 0)}, failed {counts.get('FAILED', 0) + counts.get('CRASHED', 0)}, "
            f"skipped {counts.get('SKIPPED', 0)}, cut off {counts.get('CUT OFF', 0)}, "
            f"not run {counts.get('NOT RUN', 0)}{' + suites ' + ','.join(not_started) if not_started else ''}")
    # Each distinct reason once, the most frequent first, with how many tests gave it.
    tally = {}
    for reason in reasons:
        first = next((l for l in reason.splitlines() if l.strip() and not re.match(r"^\S+:\d+$", l.strip())), "")
        if first:
            tally[first[:160]] = tally.get(first[:160], 0) + 1
    if tally:
        line += "; skipped because: " + "; ".join(
            f"{r} ({n})" for r, n in sorted(tally.items(), key=lambda kv: -kv[1])[:3])
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
