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
    python3 bench/link_timeline.py DIR/trace_rank0.json --step 4 --head model.norm   # and the head's window

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


def head_window(events: list[dict], names: dict, link: set, t0: float, t1: float, head: str) -> tuple:
    """(start, end, link busy) of the head group's window in the step: from the end of the
    training thread's wait for the head's all-gather (its forward starts) to the first reduction
    on the link after backward starts (its gradient exists). Nothing of the next step can cross
    the link in it, and nothing of this step's reductions yet."""
    inside = [e for e in events if t0 <= e["ts"] <= t1]
    waits = [e for e in inside if e["name"] == f"wait all_gather {head}" and e["tid"] not in link]
    if not waits:
        raise SystemExit(f"--head {head}: no 'wait all_gather {head}' span in this step, so the head's forward "
                         "start is not in the trace (its all-gather arrived before forward needed it); pick a "
                         "step or run where forward waits for it, or another group's name")
    backward = [e for e in inside if e["name"] == "backward"]
    if not backward:
        raise SystemExit("--head: no 'backward' span in this step")
    start = waits[0]["ts"] + waits[0]["dur"]
    reductions = [e["ts"] for e in inside if e["tid"] in link and e["ts"] >= backward[0]["ts"]
                  and e["name"].startswith(("reduce_scatter", "all_reduce"))]
    if not reductions:
        raise SystemExit("--head: no reduction on the link after backward starts in this step")
    end = min(reductions)
    busy = sum(max(0.0, min(e["ts"] + e["dur"], end) - max(e["ts"], start)) for e in inside if e["tid"] in link)
    return start, end, busy


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace")
    p.add_argument("--step", type=int, required=True, help="the step to lay out (the trace's 'step N' span)")
    p.add_argument("--cross", help="the communication thread(s) whose collectives cross the link (a name part)")
    p.add_argument("--min-idle-ms", type=float, default=1.0, help="idle intervals shorter than this are summed only")
    p.add_argument("--head", help="also the window of this FSDP group (e.g. model.norm, the head group): from its "
                                  "forward to its gradient's first reduction, and what the link carries in it")
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
    if a.head:
        start, end, busy = head_window(events, names, link, t0, t1, a.head)
        print(f"\nthe window of {a.head}, from its forward to its gradient's first reduction on the link:")
        print(f"  {ms(start):8.1f} .. {ms(end):8.1f} ms: {(end - start) / 1000:7.1f} ms; the link carries collectives "
              f"{busy / 1000:.1f} ms of it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
