#!/usr/bin/env python3
"""fsdp-train against PyTorch's FSDP2 on one GPU: the same Transformer, starting weights, batches
and dtype, one rank each (NCCL at W=1), in alternating pairs. Prints and writes a table of
tokens/s, peak CUDA memory (the caching allocator's max_memory_allocated) and the per-step
losses of both sides.

    python3 bench/gpu_side_by_side.py --build-dir build-gpu --out results/ [--preset medium] [--loss-rtol 1e-2]

The last line printed is the verdict on the losses: "loss agreement: PASS" (or FAIL, then the exit
status is 3) when every step's losses differ by at most --loss-rtol relative. --device cpu runs the
same comparison on the CPU (a rehearsal of the script on a machine without a GPU).

Both sides get bench/peer_ab.py's settings (Adam-equivalent AdamW: weight decay 0, constant LR
1e-3, no clipping, no warmup), plus --fsdp_config.device=cuda and --device cuda. fsdp-train's
peak covers its whole run; the peer's is reset after its warm-up steps, so the peer's peak can
only be lower for that reason.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import types

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)

import peer_ab  # noqa: E402
from _common import PY  # noqa: E402

DTYPES = {"bf16": "bf16", "fp32": "fp32"}


def run(cmd: list[str], log: str, timeout: int) -> None:
    with open(log, "w") as fh:
        fh.write(" ".join(cmd) + "\n")
        fh.flush()
        proc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout)
    if proc.returncode != 0:
        with open(log) as fh:
            tail = fh.read()[-4000:]
        raise SystemExit(f"gpu_side_by_side: command failed ({proc.returncode}), log {log}:\n{tail}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--preset", default="medium", choices=sorted(peer_ab.PRESETS))
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--timeout", type=int, default=300, help="seconds per run")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--loss-rtol", type=float, default=None,
                   help="largest relative per-step loss difference that passes (default: 1e-2 for bf16, 1e-4 for fp32)")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    seq = peer_ab.PRESETS[a.preset]["seq"]
    init = os.path.join(a.out, "init.pt")
    run(peer_ab.init_cmd(types.SimpleNamespace(peer_dir=os.path.join(_HERE, "peer")), a.preset, seq, init),
        os.path.join(a.out, "init.log"), a.timeout)
    cell = {"preset": a.preset, "world": 1, "batch": a.batch, "seq": seq, "steps": a.steps, "warmup": a.warmup,
            "init": init}
    opts = types.SimpleNamespace(strategy="fsdp", peer_dir=os.path.join(_HERE, "peer"))
    runs = {"ours": [], "peer": []}
    for pair in range(a.pairs):
        ours_json = os.path.join(a.out, f"ours{pair}.json")
        cmd = peer_ab.ours_cmd(opts, cell, ours_json, os.path.join(a.out, "ckpt"), a.build_dir, DTYPES[a.dtype])
        run(cmd + [f"--fsdp_config.device={a.device}"], os.path.join(a.out, f"ours{pair}.log"), a.timeout)
        peer_json = os.path.join(a.out, f"peer{pair}.json")
        run(peer_ab.peer_cmd(opts, cell, peer_json, DTYPES[a.dtype]) + ["--device", a.device],
            os.path.join(a.out, f"peer{pair}.log"), a.timeout)
        with open(ours_json) as fh:
            runs["ours"].append(json.load(fh))
        with open(peer_json) as fh:
            runs["peer"].append(json.load(fh))
    ours_tps = statistics.median(r["tokens_per_s"] for r in runs["ours"])
    peer_tps = statistics.median(r["tokens_per_s"] for r in runs["peer"])
    ours_peak = max(max(r["peak_tensor_mib_per_rank"]) for r in runs["ours"])
    peer_peaks = [x for r in runs["peer"] for x in (r.get("cuda_peak_allocated_mib_per_rank") or []) if x is not None]
    peer_peak = max(peer_peaks, default=float("nan"))  # none on cpu
    ours_losses, peer_losses = runs["ours"][0]["losses"], runs["peer"][0]["losses"]
    diff = max(abs(x - y) for x, y in zip(ours_losses, peer_losses))
    rel = max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(ours_losses, peer_losses))
    rtol = a.loss_rtol if a.loss_rtol is not None else (1e-2 if a.dtype == "bf16" else 1e-4)
    agree = rel <= rtol and len(ours_losses) == len(peer_losses) == a.steps
    lines = [
        f"| {a.preset}, {a.dtype}, W=1, batch {a.batch} x seq {seq} | fsdp-train | PyTorch FSDP2 | ours/peer |",
        "| --- | --- | --- | --- |",
        f"| tokens/s (median of {a.pairs} runs) | {ours_tps:,.0f} | {peer_tps:,.0f} | {ours_tps / peer_tps:.2f} |",
        f"| peak CUDA allocated (MiB) | {ours_peak:,.1f} | {peer_peak:,.1f} | {ours_peak / peer_peak:.2f} |",
        f"| max per-step loss difference | {diff:.2e} | | |",
        "",
        "| step | fsdp-train loss | FSDP2 loss |",
        "| --- | --- | --- |",
        *[f"| {i + 1} | {x:.6f} | {y:.6f} |" for i, (x, y) in enumerate(zip(ours_losses, peer_losses))],
    ]
    table = "\n".join(lines)
    print(table)
    print(f"loss agreement: {'PASS' if agree else 'FAIL'}: largest relative per-step loss difference {rel:.2e} "
          f"over {len(ours_losses)} steps (peer: {len(peer_losses)}), tolerance {rtol:g}")
    with open(os.path.join(a.out, "side_by_side.md"), "w") as fh:
        fh.write(table + "\n")
    with open(os.path.join(a.out, "side_by_side.json"), "w") as fh:
        json.dump({"runs": runs, "ours_tokens_per_s": ours_tps, "peer_tokens_per_s": peer_tps,
                   "ours_peak_mib": ours_peak, "peer_peak_mib": peer_peak, "max_loss_diff": diff,
                   "max_loss_rel_diff": rel, "loss_rtol": rtol, "loss_agreement": agree, "python": PY}, fh)
    if not agree:
        sys.exit(3)


if __name__ == "__main__":
    main()
