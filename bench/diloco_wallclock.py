#!/usr/bin/env python3
"""DiLoCo's loss against wall-clock time at equal tokens, beside FSDP2 and fsdp-train without it.

Reads a bench/links.py results folder whose runs trained on a token file (--data-path), e.g.

    python3 bench/links.py --out DIR --layouts hsdp --rates 50mbit --pairs 1 --steps 60 \\
        --data-path build/gpl3.tokens --ours ours --ours "diloco=--fsdp_config.diloco_inner_steps=20"
    python3 bench/diloco_wallclock.py DIR [--rate 50mbit]

and writes DIR/diloco_wallclock.md (each side's loss and elapsed training time at every tenth
step: the same tokens at each step on every side) and DIR/diloco_wallclock.svg (loss against
elapsed seconds). Elapsed time is the sum of each side's step times (rank 0's), start-up
excluded. Only the standard library.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def side_curve(path: str) -> tuple[list[float], list[float]] | None:
    if not os.path.exists(path):
        return None
    with open(path) as f:
        d = json.load(f)
    losses = d.get("losses") or []
    times = d.get("step_s_rank0") or d.get("step_s") or []
    if isinstance(times, dict):
        times = next(iter(times.values()))
    elapsed, t = [], 0.0
    for s in times[: len(losses)]:
        t += s
        elapsed.append(t)
    return losses[: len(elapsed)], elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--rate", default="50mbit")
    p.add_argument("--layout", default="hsdp")
    a = p.parse_args()
    curves = {}
    for name in sorted(os.listdir(a.out)):
        prefix = f"{a.layout}_{a.rate}_p1_"
        if name.startswith(prefix) and name.endswith(".json") and not name.endswith(".run.json"):
            c = side_curve(os.path.join(a.out, name))
            if c and c[0]:
                curves[name[len(prefix):-len(".json")]] = c
    if not curves:
        sys.exit(f"no runs {a.layout}_{a.rate}_p1_*.json with losses in {a.out}")
    steps = min(len(c[0]) for c in curves.values())
    names = list(curves)
    rows = ["| step | " + " | ".join(f"{n}: loss, elapsed s" for n in names) + " |",
            "|---|" + "---|" * len(names)]
    for s in list(range(10, steps + 1, 10)) or [steps]:
        rows.append(f"| {s} | " + " | ".join(f"{curves[n][0][s - 1]:.4f}, {curves[n][1][s - 1]:.1f}" for n in names) + " |")
    text = "\n".join(rows) + "\n"
    with open(os.path.join(a.out, "diloco_wallclock.md"), "w") as f:
        f.write(text)
    print(text)
    write_svg(os.path.join(a.out, "diloco_wallclock.svg"), curves, steps)


def write_svg(path: str, curves: dict, steps: int) -> None:
    w, h, pad = 720, 420, 50
    tmax = max(c[1][steps - 1] for c in curves.values())
    lo = min(min(c[0][:steps]) for c in curves.values())
    hi = max(max(c[0][:steps]) for c in curves.values())
    colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"]
    x = lambda t: pad + (w - 2 * pad) * t / tmax  # noqa: E731
    y = lambda v: h - pad - (h - 2 * pad) * (v - lo) / max(1e-9, hi - lo)  # noqa: E731
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}">',
             f'<rect width="{w}" height="{h}" fill="white"/>',
             f'<text x="{pad}" y="20" font-size="13">loss against elapsed training seconds, {steps} steps '
             f'(equal tokens)</text>']
    for k, (name, (ls, ts)) in enumerate(curves.items()):
        pts = " ".join(f"{x(t):.1f},{y(v):.1f}" for v, t in zip(ls[:steps], ts[:steps]))
        parts.append(f'<polyline fill="none" stroke="{colors[k % 4]}" stroke-width="1.4" points="{pts}"/>')
        parts.append(f'<text x="{w - pad - 120}" y="{40 + 16 * k}" font-size="12" fill="{colors[k % 4]}">{name}</text>')
    parts.append(f'<text x="{pad}" y="{h - 15}" font-size="11">0 .. {tmax:.0f} s; loss {lo:.2f} .. {hi:.2f}</text>')
    parts.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(parts) + "\n")


if __name__ == "__main__":
    main()
