#!/usr/bin/env python3
"""Prints the measured differences of every row that a differential run kept, as a markdown
table (docs/interop.md):

    FSDP_INTEROP_KEEP=/tmp/interop $FSDP_PYTHON -m pytest tests/interop/test_differential.py
    $FSDP_PYTHON tests/interop/report.py /tmp/interop

For each row: the largest relative difference of the loss and of the gradient norm over the
steps, and the largest absolute difference of any parameter after the last step, between
fsdp-train and PyTorch's FSDP2; then the same for the reference with the row's planted error.
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rows import ROWS  # noqa: E402
from test_differential import TOLERANCES  # noqa: E402


def load(side: str):
    if os.path.basename(side) == "ours":
        with open(os.path.join(side, "summary.json")) as f:
            losses = json.load(f)["losses"]
        with open(os.path.join(side, "m0.jsonl")) as f:
            norms = [json.loads(line)["grad_norm"] for line in f if line.strip()]
    else:
        with open(os.path.join(side, "result.json")) as f:
            result = json.load(f)
        losses, norms = result["losses"], result["grad_norms"]
    return losses, norms, torch.load(os.path.join(side, "params.pt"), weights_only=True)


def distance(a, b):
    rel = lambda xs, ys: max(abs(x - y) / abs(y) if y else float("inf") for x, y in zip(xs, ys))  # noqa: E731
    param = max((a[2][k].double() - b[2][k].double()).abs().max().item() for k in b[2])
    return rel(a[0], b[0]), rel(a[1], b[1]), param


def main(keep: str) -> None:
    print("| row | W | tolerance (loss, norm rel; params abs) | loss | grad norm | params | planted error | planted: loss | planted: norm | planted: params |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, row in ROWS.items():
        folder = os.path.join(keep, name)
        if not os.path.isdir(os.path.join(folder, "ours")):
            continue
        ours = load(os.path.join(folder, "ours"))
        ref = distance(ours, load(os.path.join(folder, "reference")))
        planted_dir = os.path.join(folder, f"reference-{row['plant']}")
        planted = distance(ours, load(planted_dir)) if os.path.isdir(planted_dir) else (None,) * 3
        tol = TOLERANCES[row["tolerance"]]
        fmt = lambda v: "–" if v is None else f"{v:.2g}"  # noqa: E731
        print(f"| {name} | {row['world']} | {row['tolerance']}: {tol['loss_rtol']:.2g}, {tol['norm_rtol']:.2g}; "
              f"{tol['param_atol']:.2g} | {fmt(ref[0])} | {fmt(ref[1])} | {fmt(ref[2])} | {row['plant']} | "
              f"{fmt(planted[0])} | {fmt(planted[1])} | {fmt(planted[2])} |")


if __name__ == "__main__":
    main(sys.argv[1])
