#!/usr/bin/env python3
"""Loss curves of fsdp-train in fp32 and in bf16 mixed precision, from the same initial weights.

Runs the gpl3 run (configs/gpl3.yaml) once per precision under fsdprun, with the same seed (so
the same initial weights and batches), logs every step to JSONL, and writes to --out:

  <precision>.jsonl, <precision>.log   rank 0's metrics and output of each run
  curves.svg                           both loss curves
  table.md                             loss every --every steps, the final losses and their ratio

    python3 bench/loss_curves.py --out bench/results/loss_curves/DIR
    python3 bench/loss_curves.py --steps 300 --world 2 --out ...  (the defaults)

Only the standard library is needed. OPENBLAS_CORETYPE is passed through (see docs/blas.md).
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import tempfile

from _common import REPO, cpu_model, fsdp_train, fsdprun, git_commit, run_jsonl, write_text

PRECISIONS = {  # name -> fsdp-train overrides
    "fp32": [],
    "bf16": ["--fsdp_config.mixed_precision=true"],
}


def run(a: argparse.Namespace, name: str) -> list[dict]:
    jsonl = os.path.join(a.out, name + ".jsonl")
    ckpt = tempfile.mkdtemp(prefix="loss_curves_" + name + "_")  # the run's checkpoints are not kept
    cmd = [*fsdprun(a.build_dir, a.world), fsdp_train(a.build_dir), os.path.join(REPO, "configs/gpl3.yaml"),
           f"--training.steps={a.steps}", "--training.resume=never", "--training.export=none",
           "--fsdp_config.checkpoint_interval=0", f"--fsdp_config.checkpoint_dir={ckpt}",
           f"--data.path={a.tokens}", "--logging.log_interval=1", f"--logging.jsonl={jsonl}",
           "--sample.length=0"] + PRECISIONS[name]
    return run_jsonl(name, cmd, os.path.join(a.out, name + ".log"), jsonl)


def svg(curves: dict[str, list[tuple[int, float]]], path: str) -> None:
    w, h, pad = 640, 360, 48
    steps = [s for c in curves.values() for s, _ in c]
    losses = [l for c in curves.values() for _, l in c]
    x0, x1, y0, y1 = min(steps), max(steps), min(losses), max(losses)
    sx = lambda s: pad + (s - x0) / max(1, x1 - x0) * (w - 2 * pad)
    sy = lambda l: h - pad - (l - y0) / max(1e-9, y1 - y0) * (h - 2 * pad)
    colors = {"fp32": "#1f77b4", "bf16": "#d62728"}
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">',
           f'<rect width="{w}" height="{h}" fill="white"/>',
           f'<line x1="{pad}" y1="{h - pad}" x2="{w - pad}" y2="{h - pad}" stroke="black"/>',
           f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{h - pad}" stroke="black"/>',
           f'<text x="{w / 2}" y="{h - 12}" text-anchor="middle">step</text>',
           f'<text x="14" y="{h / 2}" transform="rotate(-90 14 {h / 2})" text-anchor="middle">loss</text>']
    for v in (y0, (y0 + y1) / 2, y1):
        out.append(f'<text x="{pad - 4}" y="{sy(v) + 4:.1f}" text-anchor="end">{v:.2f}</text>')
    for v in (x0, (x0 + x1) // 2, x1):
        out.append(f'<text x="{sx(v):.1f}" y="{h - pad + 16}" text-anchor="middle">{v}</text>')
    for i, (name, c) in enumerate(curves.items()):
        pts = " ".join(f"{sx(s):.1f},{sy(l):.1f}" for s, l in c)
        out.append(f'<polyline fill="none" stroke="{colors.get(name, "black")}" stroke-width="1.2" points="{pts}"/>')
        out.append(f'<text x="{w - pad - 60}" y="{pad + 16 * i}" fill="{colors.get(name, "black")}">{name}</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--build-dir", default=os.path.join(REPO, "build"))
    p.add_argument("--tokens", default=os.path.join(REPO, "build/gpl3.tokens"))
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--every", type=int, default=25, help="table rows every N steps")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    if not os.path.exists(a.tokens):
        subprocess.check_call([fsdp_train(a.build_dir), "tokenize",
                               "/usr/share/common-licenses/GPL-3", a.tokens])
    curves = {}
    for name in PRECISIONS:
        rows = run(a, name)
        curves[name] = [(r["step"], r["loss"]) for r in rows]
    svg(curves, os.path.join(a.out, "curves.svg"))
    by_step = {name: dict(c) for name, c in curves.items()}
    commit = git_commit()
    cpu = cpu_model("") or platform.processor() or "unknown CPU"
    lines = [f"gpl3, {a.steps} steps, W={a.world}, same seed; {cpu}; commit {commit}", "",
             "| step | fp32 loss | bf16 loss | bf16 / fp32 |", "|---:|---:|---:|---:|"]
    for step in sorted(by_step["fp32"]):
        if step % a.every == 0 or step in (1, a.steps):
            f, b = by_step["fp32"][step], by_step["bf16"].get(step)
            lines.append(f"| {step} | {f:.4f} | {b:.4f} | {b / f:.4f} |" if b is not None else f"| {step} | {f:.4f} | - | - |")
    final_f, final_b = by_step["fp32"][a.steps], by_step["bf16"][a.steps]
    lines += ["", f"final loss: fp32 {final_f:.4f}, bf16 {final_b:.4f}, bf16/fp32 = {final_b / final_f:.4f} "
              f"({100 * abs(final_b / final_f - 1):.2f}% apart)"]
    write_text(os.path.join(a.out, "table.md"), "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
