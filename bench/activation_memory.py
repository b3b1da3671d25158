#!/usr/bin/env python3
"""Peak tensor memory and step time of fsdp-train with activation checkpointing: none, every
block, every second block, every block with the loss in pieces of the rows (training.loss_chunks:
the output head and loss one autograd function that holds one piece's logits at a time), and
each of those with the final norm and output head as an FSDP group of their own
(fsdp_config.output_head_group), in alternating runs of the same configuration.

For each setting, rank 0's JSONL metrics give, per step, the live tensor bytes after the step
(the sharded-state floor: parameters, gradients and optimizer state of this rank's shards) and
the step's peak tensor bytes. The table reports the peak above the floor (max over the timed
steps), its ratio to no checkpointing, and the median step time and its ratio.

    python3 bench/activation_memory.py --out bench/results/activation_memory/DIR
    python3 bench/activation_memory.py --preset medium --world 2 --seq 512 --batch 2 --steps 4 --pairs 1
    python3 bench/activation_memory.py --out DIR --settings "none,every block + loss in 8 pieces"

Only the standard library is needed. OPENBLAS_CORETYPE is passed through (see docs/blas.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

from _common import REPO, alternate, cpu_model, fsdp_train, fsdprun, git_commit, run_jsonl, write_text

SETTINGS = {  # name -> fsdp-train overrides
    "none": [],
    "every block": ["--fsdp_config.activation_checkpointing=true", "--fsdp_config.activation_checkpointing_every=1"],
    "every 2nd block": ["--fsdp_config.activation_checkpointing=true",
                        "--fsdp_config.activation_checkpointing_every=2"],
    "every block + loss in 8 pieces": ["--fsdp_config.activation_checkpointing=true",
                                       "--fsdp_config.activation_checkpointing_every=1", "--training.loss_chunks=8"],
    "every block + loss in 32 pieces": ["--fsdp_config.activation_checkpointing=true",
                                        "--fsdp_config.activation_checkpointing_every=1", "--training.loss_chunks=32"],
    "every block + head group": ["--fsdp_config.activation_checkpointing=true",
                                 "--fsdp_config.activation_checkpointing_every=1",
                                 "--fsdp_config.output_head_group=true"],
    "every block + loss in 8 pieces + head group": ["--fsdp_config.activation_checkpointing=true",
                                                    "--fsdp_config.activation_checkpointing_every=1",
                                                    "--training.loss_chunks=8", "--fsdp_config.output_head_group=true"],
    "every block + loss in 32 pieces + head group": ["--fsdp_config.activation_checkpointing=true",
                                                     "--fsdp_config.activation_checkpointing_every=1",
                                                     "--training.loss_chunks=32",
                                                     "--fsdp_config.output_head_group=true"],
}


def run(a: argparse.Namespace, name: str, pair: int) -> dict:
    tag = name.replace(" ", "_") + f"_p{pair}"
    jsonl = os.path.join(a.out, tag + ".jsonl")
    cmd = [*fsdprun(a.build_dir, a.world), fsdp_train(a.build_dir), os.path.join(REPO, f"configs/{a.preset}.yaml"),
           f"--training.steps={a.steps}", f"--training.seq_len={a.seq}", f"--training.micro_batch_size={a.batch}",
           "--training.resume=never", "--training.export=none", "--fsdp_config.checkpoint_interval=0",
           f"--fsdp_config.checkpoint_dir={tempfile.mkdtemp(prefix='activation_memory_')}",
           "--logging.log_interval=1", f"--logging.jsonl={jsonl}", "--logging.progress=off",
           "--sample.length=0"] + SETTINGS[name]
    rows = run_jsonl(name, cmd, os.path.join(a.out, tag + ".log"), jsonl)
    timed = [r for r in rows if r["step"] > a.warmup]
    floor = rows[-1]["live_mib"]
    peak = max(r["peak_mib"] for r in timed)
    return {"floor": floor, "peak": peak, "above": peak - floor,
            "step_s": statistics.median(r["step_s"] for r in timed), "loss": rows[-1]["loss"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--build-dir", default=os.path.join(REPO, "build"))
    p.add_argument("--preset", default="medium")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1, help="steps left out of the figures")
    p.add_argument("--pairs", type=int, default=1, help="rounds of the settings, in alternation")
    p.add_argument("--settings", default=",".join(SETTINGS),
                   help="comma-separated names of the settings to run; 'none' (the baseline) is always run")
    a = p.parse_args()
    names = ["none"] + [n.strip() for n in a.settings.split(",") if n.strip() and n.strip() != "none"]
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        sys.exit(f"unknown setting(s) {unknown}; choose from {list(SETTINGS)}")
    os.makedirs(a.out, exist_ok=True)
    results: dict[str, list[dict]] = {name: [] for name in names}
    for pair, name in alternate(a.pairs, names):
        results[name].append(run(a, name, pair))
    commit = git_commit()
    base = {k: statistics.median(r[k] for r in results["none"]) for k in ("above", "step_s")}
    lines = [f"{a.preset}, W={a.world}, seq {a.seq}, batch {a.batch}/rank, {a.steps} steps ({a.warmup} warm-up), "
             f"{a.pairs} round(s); {cpu_model('unknown CPU')}; commit {commit}", "",
             "| checkpointing | floor MiB | peak MiB | peak above floor MiB | vs none | step s | vs none | final loss |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, rs in results.items():
        m = {k: statistics.median(r[k] for r in rs) for k in ("floor", "peak", "above", "step_s", "loss")}
        lines.append(f"| {name} | {m['floor']:.1f} | {m['peak']:.1f} | {m['above']:.1f} | "
                     f"{m['above'] / base['above']:.3f} | {m['step_s']:.3f} | {m['step_s'] / base['step_s']:.3f} | "
                     f"{m['loss']:.6f} |")
    write_text(os.path.join(a.out, "table.md"), "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
