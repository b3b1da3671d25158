#!/usr/bin/env python3
"""Loss parity of the options that move fewer bytes between hosts, against the fp32 run.

The Llama small (bench/peer/llama_small/config.json, the weights bench/links.py writes with
transformers, seed 0) trains --steps steps on 2 ranks of this machine (fsdprun --standalone), on
a learnable text: the GPL-3 that every Debian machine has, as byte tokens (fsdp-train tokenize),
Adam lr 1e-3 (bench/peer/llama.yaml, as bench/links.py runs it), batch 4 x 128 per rank (a quarter
of the link benchmark's tokens per step, so that 300 steps of every run fit a shared 2-vCPU
machine; --batch, --seq). One run per option, from the same weights and batches:

  fp32        FULL_SHARD, nothing compressed (the reference)
  fp32_hsdp   HYBRID_SHARD 2 x 1, nothing compressed: the same mean gradient added in another
              order, which shows how far two exact runs drift apart (added after the others)
  qw_rs_bf16  FULL_SHARD, quantized_weights int8 (blocks of 256) and reduce_dtype bfloat16
  qg_int8     HYBRID_SHARD 2 x 1 (two replicas of one rank), quantized_gradients int8 with error
              feedback: the same mean gradient over 2 ranks as fp32, through the quantized
              all-reduce
  diloco_h50  HYBRID_SHARD 2 x 1, DiLoCo with H = 50 inner steps (outer lr 0.7, Nesterov 0.9)

The tolerances, stated before the runs (docs/benchmarks.md says why): the mean loss over the
last 20 steps within 1 % of fp32's for qw_rs_bf16 and qg_int8, within 5 % for diloco_h50.

    python3 bench/loss_parity.py --out bench/results/loss_parity/DIR [--runs fp32,qg_int8] [--steps 300]
    python3 bench/loss_parity.py --out DIR --report-only

Runs given together run one after another; separate invocations with different --runs may run
at once (each writes only its own files). Writes to --out: <run>.rank0.jsonl (every step's
metrics), <run>.log, <run>.json (the summary), <run>.cmd.json (the command, machine, commit,
load), table.md, curves.svg. Only the standard library.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess

from _common import REPO, cpu_model, fsdp_train, fsdprun, git_commit, load_average, utc_now, write_text

LLAMA_YAML = os.path.join(REPO, "bench", "peer", "llama.yaml")
GPL3 = "/usr/share/common-licenses/GPL-3"
HSDP_2X1 = ["--fsdp_config.sharding_strategy=HYBRID_SHARD", "--fsdp_config.replicate_degree=2"]
RUNS = {  # name -> (fsdp-train arguments, tolerance on the last-20-step mean, relative to fp32)
    "fp32": ([], None),
    # The noise floor: the same fp32 training through HSDP's collectives, whose other order of
    # additions changes the last bits of the gradients, and from there the trajectory.
    "fp32_hsdp": (HSDP_2X1, None),
    "qw_rs_bf16": (["--fsdp_config.quantized_weights=int8", "--fsdp_config.reduce_dtype=bfloat16"], 0.01),
    "qg_int8": (HSDP_2X1 + ["--fsdp_config.quantized_gradients=int8"], 0.01),
    "diloco_h50": (HSDP_2X1 + ["--fsdp_config.diloco_inner_steps=50"], 0.05),
}
TAIL = 20


def argv_of(a, name: str) -> list[str]:
    extra, _ = RUNS[name]
    return [*fsdprun(a.build_dir, 2), fsdp_train(a.build_dir), LLAMA_YAML,
            f"--model.init_from={a.init}", f"--training.micro_batch_size={a.batch}",
            "--training.gradient_accumulation_steps=1", f"--training.seq_len={a.seq}", f"--training.steps={a.steps}",
            "--training.max_grad_norm=0",
            "--training.seed=0", "--training.resume=never", "--training.export=none", "--optimizer.lr=1e-3",
            "--optimizer.weight_decay=0", "--optimizer.betas=[0.9,0.999]", "--optimizer.eps=1e-8",
            "--schedule.warmup_steps=0", "--schedule.min_lr=1e-3", "--data.source=tokens",
            f"--data.path={a.tokens}", "--data.data_seed=1234", "--fsdp_config.checkpoint_interval=0",
            f"--fsdp_config.checkpoint_dir={a.out}/ckpt_{name}", "--logging.progress=off", "--logging.log_interval=10",
            f"--logging.summary_json={a.out}/{name}.json", f"--logging.jsonl={a.out}/{name}.rank{{rank}}.jsonl",
            *extra]


def losses(out: str, name: str) -> list[float]:
    path = os.path.join(out, f"{name}.rank0.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line)["loss"] for line in f if line.strip()]


def report(a) -> None:
    base = losses(a.out, "fp32")
    rows = ["| run | steps | loss at 1 / 100 / 200 / last | mean of the last 20 | against fp32 | tolerance | within |",
            "|---|---|---|---|---|---|---|"]
    curves = {}
    for name, (_, tol) in RUNS.items():
        ls = losses(a.out, name)
        if not ls:
            continue
        curves[name] = ls
        n = min(len(ls), len(base)) if base else len(ls)
        tail = sum(ls[n - TAIL:n]) / TAIL if n >= TAIL else float("nan")
        ref = sum(base[n - TAIL:n]) / TAIL if base and n >= TAIL else float("nan")
        rel = (tail - ref) / ref if ref == ref and ref else float("nan")
        at = " / ".join(f"{ls[i - 1]:.4f}" if len(ls) >= i else "-" for i in (1, 100, 200)) + f" / {ls[-1]:.4f}"
        within = "-" if tol is None or rel != rel else ("yes" if abs(rel) <= tol else "no")
        rows.append(f"| {name} | {len(ls)} | {at} | {tail:.4f} (steps {n - TAIL + 1}-{n}) | "
                    f"{'-' if name == 'fp32' else f'{rel * 100:+.2f} %'} | "
                    f"{'-' if tol is None else f'{tol * 100:.0f} %'} | {within} |")
    write_text(os.path.join(a.out, "table.md"), "\n".join(rows) + "\n")
    print("\n".join(rows))
    write_svg(os.path.join(a.out, "curves.svg"), curves)


def write_svg(path: str, curves: dict) -> None:
    if not curves:
        return
    w, h, pad = 720, 420, 50
    steps = max(len(v) for v in curves.values())
    top = max(max(v) for v in curves.values())
    low = min(min(v) for v in curves.values())
    colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e"]
    x = lambda i: pad + (w - 2 * pad) * i / max(1, steps - 1)  # noqa: E731
    y = lambda v: h - pad - (h - 2 * pad) * (v - low) / max(1e-9, top - low)  # noqa: E731
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}">',
             f'<rect width="{w}" height="{h}" fill="white"/>',
             f'<text x="{pad}" y="20" font-size="13">loss per step (rank 0\'s global mean), llama_small on '
             f'GPL-3 bytes, 2 ranks</text>']
    for k, (name, ls) in enumerate(curves.items()):
        pts = " ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in enumerate(ls))
        parts.append(f'<polyline fill="none" stroke="{colors[k % 5]}" stroke-width="1.2" points="{pts}"/>')
        parts.append(f'<text x="{w - pad - 110}" y="{40 + 16 * k}" font-size="12" fill="{colors[k % 5]}">{name}</text>')
    parts.append(f'<text x="{pad}" y="{h - 15}" font-size="11">step 1 .. {steps}; loss {low:.2f} .. {top:.2f}</text>')
    parts.append("</svg>")
    write_text(path, "\n".join(parts) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--runs", default=",".join(RUNS))
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--build-dir", default=os.path.join(REPO, "build"))
    p.add_argument("--init", default=None, help="the Hugging Face directory to start from (default: "
                   "--out/init_llama_small, written with transformers as bench/links.py writes it)")
    p.add_argument("--report-only", action="store_true")
    a = p.parse_args()
    a.out = os.path.abspath(a.out)
    os.makedirs(a.out, exist_ok=True)
    a.init = a.init or os.path.join(a.out, "init_llama_small")
    a.tokens = os.path.join(a.out, "gpl3.tokens")
    if not a.report_only:
        if not os.path.isdir(a.init):
            from links import ensure_init  # the same weights as the link benchmark's
            ensure_init(a)
        if not os.path.exists(a.tokens):
            subprocess.run([fsdp_train(a.build_dir), "tokenize", GPL3, a.tokens], check=True)
        for name in a.runs.split(","):
            argv = argv_of(a, name)
            if os.path.exists(os.path.join(a.out, f"{name}.json")):
                continue
            with open(os.path.join(a.out, f"{name}.cmd.json"), "w") as f:
                json.dump({"date": utc_now(), "machine": cpu_model(), "commit": git_commit(dirty=True),
                           "load_at_start": load_average(), "argv": argv}, f, indent=1)
            with open(os.path.join(a.out, f"{name}.log"), "w") as log:
                subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, check=False,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    report(a)


if __name__ == "__main__":
    main()
