#!/usr/bin/env python3
"""Compares the per-step losses of two fsdp-train runs (their logging.jsonl files, rank 0's lines)
and prints one verdict line, PASS or FAIL, with the largest relative difference and the
tolerance. Exit status 0 on PASS, 1 on FAIL, 2 when the files hold no comparable steps.

    python3 scripts/compare_losses.py --name NAME --rtol 1e-3 [--from-step N] RUN.jsonl REFERENCE.jsonl

Steps are matched by number; a step a resumed run logged twice counts with its last line. Steps
whose loss scaler skipped the update are compared too (both runs see the same batches).
"""

from __future__ import annotations

import argparse
import json
import math
import sys


def losses(path: str) -> dict[int, float]:
    out: dict[int, float] = {}
    with open(path) as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            rec = json.loads(line)
            if rec.get("rank", 0) == 0 and "loss" in rec:
                out[int(rec["step"])] = float(rec["loss"])
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--name", required=True)
    p.add_argument("--rtol", type=float, required=True, help="largest allowed |a - b| / |b| per step")
    p.add_argument("--from-step", type=int, default=1)
    p.add_argument("run")
    p.add_argument("reference")
    a = p.parse_args()
    try:
        run, ref = losses(a.run), losses(a.reference)
    except (OSError, ValueError) as e:
        print(f"{a.name}: FAIL: cannot read the losses: {e}")
        return 2
    steps = sorted(s for s in run if s in ref and s >= a.from_step)
    if not steps:
        print(f"{a.name}: FAIL: no common steps >= {a.from_step} ({len(run)} and {len(ref)} steps logged)")
        return 2
    worst_step, worst = steps[0], 0.0
    for s in steps:
        x, y = run[s], ref[s]
        rel = math.inf if not (math.isfinite(x) and math.isfinite(y)) else abs(x - y) / max(abs(y), 1e-12)
        if rel >= worst:
            worst_step, worst = s, rel
    verdict = "PASS" if worst <= a.rtol else "FAIL"
    print(f"{a.name}: {verdict}: largest relative loss difference {worst:.2e}, tolerance {a.rtol:g} "
          f"(steps {steps[0]}-{steps[-1]}; at step {worst_step}: {run[worst_step]:.6f} vs {ref[worst_step]:.6f})")
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
