#!/usr/bin/env python3
"""Loss parity of the options that move fewer bytes between hosts, against the fp32 run.

The Llama small (bench/peer/llama_small/config.json, the weights bench/links.py writes with
transformers, seed 0) trains --steps steps on 2 ranks of this machine (fsdprun --standalone), on
a learnable text: the GPL-3 that every Debian machine has, as byte tokens (fsdp-train tokenize),
Adam lr 1e-3 (bench/peer/llama.yaml, as bench/links.py runs it), batch 4 x 128 per rank (a quarter
of the link benchmark's tokens per step, so that 300 steps of every run fit a shared 2-vCPU
machine; --batch, --seq). Every run from the same weights, once per data seed (--seeds: each
seed gives other batches, from data.data_seed = seed):

  fp32         FULL_SHARD, nothing compressed (the reference)
  fp32_accum2  FULL_SHARD, nothing compressed, each rank's 4 rows as 2 micro-batches of 2: the
               same rows and the same mean gradient added in another order. Its distance from
               fp32 is the noise floor: how far two exact runs drift apart over the steps
  fp32_hsdp    HYBRID_SHARD 2 x 1, nothing compressed (with 2 ranks HSDP's all-reduce adds the
               same 2 numbers as FULL_SHARD's reduce-scatter, so it is bitwise fp32: a check of
               the replicate path, not a noise floor; only when --runs names it)
  qw_rs_bf16   FULL_SHARD, quantized_weights int8 (blocks of 256) and reduce_dtype bfloat16
  qw_int8      FULL_SHARD, quantized_weights int8 alone
  qw_int8_b64  the same in blocks of 64 (a scale per 64 elements: 1.06 bytes per element, not 1.02)
  rs_bf16      FULL_SHARD, reduce_dtype bfloat16 alone (FSDP2's own MixedPrecisionPolicy setting)
  qg_int8      HYBRID_SHARD 2 x 1 (two replicas of one rank), quantized_gradients int8 with error
               feedback: the same mean gradient over 2 ranks as fp32, through the quantized
               all-reduce
  qg_int8_ohg  qg_int8 with the output head in a group of its own (other blocks: which elements
               share a scale changes, not what is sent)
  qg_int8_skip qg_int8 with quantized_gradients_skip_zero_blocks (a replica sends only the blocks
               its gradient touched: the embedding's rows of its batch's tokens) and the output
               head in a group of its own: bench/links.py's hsdp_2x1 options
  diloco_h50   HYBRID_SHARD 2 x 1, DiLoCo with H = 50 inner steps (outer lr 0.7, Nesterov 0.9)
  diloco_h10   the same with H = 10: 30 outer steps in 300 where H = 50 has 6
  diloco_h10_avg  H = 10, outer lr 1 and no momentum: the replicas' parameters averaged every 10
               steps (local Adam with periodic averaging), which tells the outer optimizer's
               part in DiLoCo's loss from the averaging's

The tolerances, stated before the runs (docs/benchmarks.md says why), on the mean loss over the
last 20 steps relative to fp32's from the same seed, averaged over the seeds: 1 % for qw_rs_bf16,
qw_int8, qw_int8_b64, rs_bf16, qg_int8, qg_int8_ohg and qg_int8_skip, 5 % for diloco_h50, diloco_h10 and diloco_h10_avg.
Beside it the table gives every seed's difference and the noise floor (fp32_accum2's largest
difference over the seeds): a difference within the noise floor says nothing was lost that an
exact reordering of the additions would not also move.

    python3 bench/loss_parity.py --out bench/results/loss_parity/DIR [--runs fp32,qg_int8] [--seeds 1234] [--steps 300]
    python3 bench/loss_parity.py --out DIR --report-only

Runs given together run one after another; separate invocations with different --runs may run
at once (each writes only its own files). Writes to --out, for each run and seed
(<stem> = <run>.d<seed>): <stem>.rank0.jsonl (every step's metrics), <stem>.log, <stem>.json (the
summary), <stem>.cmd.json (the command, machine, commit, load); and table.md, curves.svg (the first
seed's curves). Only the standard library.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess

from _common import (REPO, cpu_model, fsdp_train, fsdprun, git_commit, llama_train_args, load_average, utc_now,
                     write_text)
GPL3 = "/usr/share/common-licenses/GPL-3"
HSDP_2X1 = ["--fsdp_config.sharding_strategy=HYBRID_SHARD", "--fsdp_config.replicate_degree=2"]
RUNS = {  # name -> (fsdp-train arguments, tolerance on the last-20-step mean, relative to fp32)
    "fp32": ([], None),
    # The noise floor: the same rows and mean gradient, added in another order (two micro-batches
    # of half the rows), which changes the last bits of the gradients and from there the trajectory.
    "fp32_accum2": ([], None),  # argv_of splits the rows into two micro-batches
    "fp32_hsdp": (HSDP_2X1, None),
    "qw_rs_bf16": (["--fsdp_config.quantized_weights=int8", "--fsdp_config.reduce_dtype=bfloat16"], 0.01),
    "qw_int8": (["--fsdp_config.quantized_weights=int8"], 0.01),
    "qw_int8_b64": (["--fsdp_config.quantized_weights=int8", "--fsdp_config.quantization_block_size=64"], 0.01),
    "rs_bf16": (["--fsdp_config.reduce_dtype=bfloat16"], 0.01),
    "qg_int8": (HSDP_2X1 + ["--fsdp_config.quantized_gradients=int8"], 0.01),
    "qg_int8_ohg": (HSDP_2X1 + ["--fsdp_config.quantized_gradients=int8", "--fsdp_config.output_head_group=true"],
                    0.01),
    "qg_int8_skip": (HSDP_2X1 + ["--fsdp_config.quantized_gradients=int8",
                                 "--fsdp_config.quantized_gradients_skip_zero_blocks=true",
                                 "--fsdp_config.output_head_group=true"], 0.01),
    "diloco_h50": (HSDP_2X1 + ["--fsdp_config.diloco_inner_steps=50"], 0.05),
    "diloco_h10": (HSDP_2X1 + ["--fsdp_config.diloco_inner_steps=10"], 0.05),
    "diloco_h10_avg": (HSDP_2X1 + ["--fsdp_config.diloco_inner_steps=10", "--fsdp_config.diloco_outer_lr=1",
                                   "--fsdp_config.diloco_outer_momentum=0"], 0.05),
}
NOISE_FLOOR = "fp32_accum2"
TAIL = 20


def stem(name: str, seed: int) -> str:
    return f"{name}.d{seed}"


def argv_of(a, name: str, seed: int) -> list[str]:
    extra, _ = RUNS[name]
    micro, accumulation = (a.batch // 2, 2) if name == NOISE_FLOOR else (a.batch, 1)
    out = os.path.join(a.out, stem(name, seed))
    return [*fsdprun(a.build_dir, 2), fsdp_train(a.build_dir),
            *llama_train_args(init=a.init, micro_batch=micro, accumulation=accumulation, seq=a.seq, steps=a.steps,
                              lr=1e-3, seed=0, data_seed=seed, data_path=a.tokens, checkpoint_dir=f"{out}.ckpt",
                              summary_json=f"{out}.json", jsonl=f"{out}.rank{{rank}}.jsonl", log_interval=10),
            *extra]


def losses(out: str, name: str, seed: int) -> list[float]:
    path = os.path.join(out, f"{stem(name, seed)}.rank0.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line)["loss"] for line in f if line.strip()]


def tail_mean(ls: list[float], n: int) -> float:
    return sum(ls[n - TAIL:n]) / TAIL if n >= TAIL else float("nan")


def differences(a, name: str) -> dict[int, float]:
    """Each seed's last-20-step mean relative to fp32's of the same seed, where both ran."""
    out = {}
    for seed in a.seeds:
        ls, base = losses(a.out, name, seed), losses(a.out, "fp32", seed)
        n = min(len(ls), len(base))
        ref = tail_mean(base, n)
        if n >= TAIL and ref:
            out[seed] = (tail_mean(ls, n) - ref) / ref
    return out


def verdict(mean: float, tol, floor: float) -> str:
    if tol is None or mean != mean:
        return "-"
    within = "yes" if abs(mean) <= tol else "no"
    return f"{within}; {'within' if abs(mean) <= floor else 'beyond'} the noise floor"


def report(a) -> None:
    floor_diffs = differences(a, NOISE_FLOOR)
    floor = max((abs(v) for v in floor_diffs.values()), default=float("nan"))
    seeds = " / ".join(str(s) for s in a.seeds)
    rows = [f"| run | loss at 1 / 100 / 200 / last (seed {a.seeds[0]}) | mean of the last 20, seeds {seeds} | "
            f"against fp32, seeds {seeds} | mean against fp32 | tolerance | within |",
            "|---|---|---|---|---|---|---|"]
    curves = {}
    for name, (_, tol) in RUNS.items():
        runs = {seed: losses(a.out, name, seed) for seed in a.seeds}
        if not any(runs.values()):
            continue
        first = runs[a.seeds[0]]
        if first:
            curves[name] = first
        at = " / ".join(f"{first[i - 1]:.4f}" if len(first) >= i else "-" for i in (1, 100, 200))
        at += f" / {first[-1]:.4f}" if first else ""
        tails = " / ".join(f"{tail_mean(ls, len(ls)):.4f}" if len(ls) >= TAIL else "-" for ls in runs.values())
        diffs = differences(a, name)
        each = " / ".join(f"{diffs[s] * 100:+.2f} %" if s in diffs else "-" for s in a.seeds)
        mean = sum(diffs.values()) / len(diffs) if diffs else float("nan")
        is_ref = name == "fp32"
        rows.append(f"| {name} | {at} | {tails} | {'-' if is_ref else each} | "
                    f"{'-' if is_ref else f'{mean * 100:+.2f} %'} | {'-' if tol is None else f'{tol * 100:.0f} %'} | "
                    f"{verdict(mean, tol, floor)} |")
    rows.append("")
    rows.append(f"Noise floor ({NOISE_FLOOR}'s largest |difference| over the seeds): {floor * 100:.2f} %.")
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


def run(a, name: str, seed: int) -> None:
    base = os.path.join(a.out, stem(name, seed))
    if os.path.exists(f"{base}.json"):
        return
    argv = argv_of(a, name, seed)
    with open(f"{base}.cmd.json", "w") as f:
        json.dump({"date": utc_now(), "machine": cpu_model(), "commit": git_commit(dirty=True),
                   "load_at_start": load_average(), "argv": argv}, f, indent=1)
    with open(f"{base}.log", "w") as log:
        subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, check=False,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--runs", default=",".join(r for r in RUNS if r != "fp32_hsdp"),
                   help="comma list of runs (default all but fp32_hsdp, which is bitwise fp32 with 2 ranks)")
    p.add_argument("--seeds", default="1234,2234,3234", help="comma list of data seeds; every run trains once per seed")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--build-dir", default=os.path.join(REPO, "build"))
    p.add_argument("--init", default=None, help="the Hugging Face directory to start from (default: "
                   "--out/init_llama_small, written with transformers as bench/links.py writes it)")
    p.add_argument("--report-only", action="store_true")
    a = p.parse_args()
    a.out = os.path.abspath(a.out)
    a.seeds = [int(x) for x in a.seeds.split(",")]
    os.makedirs(a.out, exist_ok=True)
    a.init = a.init or os.path.join(a.out, "init_llama_small")
    a.tokens = os.path.join(a.out, "gpl3.tokens")
    if not a.report_only:
        if not os.path.isdir(a.init):
            from links import ensure_init  # the same weights as the link benchmark's
            ensure_init(a)
        if not os.path.exists(a.tokens):
            subprocess.run([fsdp_train(a.build_dir), "tokenize", GPL3, a.tokens], check=True)
        for seed in a.seeds:
            for name in a.runs.split(","):
                run(a, name, seed)
    report(a)


if __name__ == "__main__":
    main()
