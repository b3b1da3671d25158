#!/usr/bin/env python3
"""One training step of an fsdp-train trace, laid out against its communication: where the link
between hosts carries nothing.

fsdp-train writes a Chrome trace per rank with `--logging.trace=true --logging.trace_dir=DIR`
(include/fsdp/trace.h): the training thread's spans (step, forward, backward, the waits for
collectives) and, per process group, a communication thread's spans, one per collective. For the
step asked for, this prints every span in time order (all-gathers of a group that stays within a
host, e.g. HSDP's shard group, are left out with --cross), then the intervals in which no
collective of the chosen threads ran, and their sum.

    python3 bench/link_timeline.py DIR/trace_rank0.json --step 4
    python3 bench/link_timeline.py DIR/trace_rank0.json --step 4 --cross 'g0[0,2]'   # HSDP: replicate group

Only the standard library.
"""

from __future__ import annotations

import argparse
import json
import sys


def load(path: str) -> tuple[list[dict], dict]:
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise SystemExit(f"{path}: not a readable Chrome trace ({e})")
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    names = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    return [e for e in events if e.get("ph") == "X"], names


def link_threads(names: dict, cross: str | None) -> set:
    """The communication threads whose collectives cross the link: those named with `cross`, or
    every group's except the world's (the trainer's own small collectives)."""
    if cross:
        chosen = {t for t, n in names.items() if cross in n}
        if not chosen:
            raise SystemExit(f"--cross {cross!r}: no thread of that name; threads: {sorted(names.values())}")
        return chosen
    return {t for t, n in names.items() if n.startswith("comm") and n != "comm world"}


def idle_intervals(spans: list[tuple[float, float]], begin: float, end: float) -> list[tuple[float, float]]:
    idle, cursor = [], begin
    for a, b in sorted(spans):
        if a > cursor:
            idle.append((cursor, min(a, end)))
        cursor = max(cursor, b)
        if cursor >= end:
            break
    if cursor < end:
        idle.append((cursor, end))
    return [(a, b) for a, b in idle if b > a]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace")
    p.add_argument("--step", type=int, required=True, help="the step to lay out (the trace's 'step N' span)")
    p.add_argument("--cross", help="the communication thread(s) whose collectives cross the link (a name part)")
    p.add_argument("--min-idle-ms", type=float, default=1.0, help="idle intervals shorter than this are summed only")
    a = p.parse_args(argv)
    events, names = load(a.trace)
    steps = [e for e in events if e["name"] == f"step {a.step}"]
    if not steps:
        raise SystemExit(f"{a.trace}: no span 'step {a.step}'")
    t0 = steps[0]["ts"]
    t1 = t0 + steps[0]["dur"]
    link = link_threads(names, a.cross)
    ms = lambda t: (t - t0) / 1000  # noqa: E731
    print(f"step {a.step}: {(t1 - t0) / 1000:.1f} ms; link threads: {', '.join(sorted(names[t] for t in link))}")
    print(f"{'start ms':>9} {'ms':>8}  thread          span")
    spans = []
    for e in sorted(events, key=lambda e: e["ts"]):
        if e["ts"] + e["dur"] < t0 or e["ts"] > t1:
            continue
        thread = names.get(e["tid"], str(e["tid"]))
        if thread.startswith("comm") and e["tid"] not in link:
            continue
        if e["tid"] in link:
            spans.append((e["ts"], e["ts"] + e["dur"]))
        print(f"{ms(e['ts']):9.1f} {e['dur'] / 1000:8.1f}  {thread[:15]:15} {e['name']}")
    idle = idle_intervals(spans, t0, t1)
    print("\nthe link carries no collective:")
    for a_, b in idle:
        if (b - a_) / 1000 >= a.min_idle_ms:
            print(f"  {ms(a_):8.1f} .. {ms(b):8.1f} ms: {(b - a_) / 1000:7.1f} ms")
    total = sum(b - a_ for a_, b in idle) / 1000
    print(f"  in all {total:.1f} ms of {(t1 - t0) / 1000:.1f} ({100 * total * 1000 / (t1 - t0):.0f} %)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
