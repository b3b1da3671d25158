#!/usr/bin/env python3
"""Compares the per-step losses of two fsdp-train runs (their logging.jsonl files, rank 0's lines)
and prints one verdict line, PASS or FAIL, with the largest relative difference and the
tolerance. Exit status 0 on PASS, 1 on FAIL, 2 when the files hold no comparable steps.

    python3 scripts/compare_losses.py --name NAME --rtol 1e-3 [--from-step N] RUN.jsonl REFERENCE.jsonl

Steps are matched by number; a step a resumed run logged twice counts with its last line. Steps
whose loss scaler skipped the update are compared too (both runs see the same batches), and where
both runs log a loss scale (fp16), the scales must be equal at every step.
"""

from __future__ import annotations

import argparse
import json
import math
import sys


def records(path: str) -> dict[int, dict]:
    out: dict[int, dict] = {}
    with open(path) as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            rec = json.loads(line)
            if rec.get("rank", 0) == 0 and "loss" in rec:
                out[int(rec["step"])] = rec
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
        run_recs, ref_recs = records(a.run), records(a.reference)
    except (OSError, ValueError) as e:
        print(f"{a.name}: FAIL: cannot read the losses: {e}")
        return 2
    run = {s: float(r["loss"]) for s, r in run_recs.items()}
    ref = {s: float(r["loss"]) for s, r in ref_recs.items()}
    steps = sorted(s for s in run if s in ref and s >= a.from_step)
    if not steps:
        print(f"{a.name}: FAIL: no common steps >= {a.from_step} ({len(run)} and {len(ref)} steps logged)")
        return 2
    scales = [s for s in steps if "loss_scale" in run_recs[s] and "loss_scale" in ref_recs[s]]
    scale_diffs = [s for s in scales if run_recs[s]["loss_scale"] != ref_recs[s]["loss_scale"]]
    worst_step, worst = steps[0], 0.0
    for s in steps:
        x, y = run[s], ref[s]
        rel = math.inf if not (math.isfinite(x) and math.isfinite(y)) else abs(x - y) / max(abs(y), 1e-12)
        if rel >= worst:
            worst_step, worst = s, rel
    verdict = "PASS" if worst <= a.rtol and not scale_diffs else "FAIL"
    scale_note = ""
    if scale_diffs:
        s = scale_diffs[0]
        scale_note = (f", loss scales differ at {len(scale_diffs)} steps (first: step {s}, "
                      f"{run_recs[s]['loss_scale']} vs {ref_recs[s]['loss_scale']})")
    elif scales:
        scale_note = f", loss scales equal at {len(scales)} steps"
    print(f"{a.name}: {verdict}: largest relative loss difference {worst:.2e}, tolerance {a.rtol:g}{scale_note} "
          f"(steps {steps[0]}-{steps[-1]}; at step {worst_step}: {run[worst_step]:.6f} vs {ref[worst_step]:.6f})")
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
