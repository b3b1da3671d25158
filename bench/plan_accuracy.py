#!/usr/bin/python3
"""The planner (`fsdp-train plan`) against the trainer: predicted vs measured peak tensor bytes
and step time, for every combination of preset, world size, reshard_after_forward (FULL_SHARD /
SHARD_GRAD_OP), precision (fp32 / bf16 compute) and checkpointing mode asked for.

Each combination is trained for a few steps (fsdprun for W > 1); the measured peak is the largest
per-step peak tensor bytes of rank 0 after the first step (the first step has no optimizer state
yet), the measured step time the median of those steps. The planner is asked the same
configuration with --json. Measurements are cached in OUT/measured.json (delete it to measure
again), so a changed planner is compared again without retraining.

    OPENBLAS_CORETYPE=Haswell /usr/bin/python3 bench/plan_accuracy.py --out bench/results/plan_accuracy/DIR \
        --presets tiny,small --worlds 1,2,4

Only the standard library is needed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STRATEGIES = {"true": "FULL_SHARD", "false": "SHARD_GRAD_OP"}
PRECISIONS = {"fp32": [], "bf16": ["--fsdp_config.mixed_precision=true"]}
CHECKPOINTING = {
    "none": [],
    "every": ["--fsdp_config.activation_checkpointing=true", "--fsdp_config.activation_checkpointing_every=1"],
    "every2": ["--fsdp_config.activation_checkpointing=true", "--fsdp_config.activation_checkpointing_every=2"],
    "every+loss4": ["--fsdp_config.activation_checkpointing=true", "--fsdp_config.activation_checkpointing_every=1",
                    "--training.loss_chunks=4"],
}


def overrides(raf: str, prec: str, ckpt: str, steps: int) -> list[str]:
    return [f"--fsdp_config.sharding_strategy={STRATEGIES[raf]}", f"--training.steps={steps}"] + \
        PRECISIONS[prec] + CHECKPOINTING[ckpt]


def measure(a, preset: str, world: int, raf: str, prec: str, ckpt: str) -> dict:
    tmp = tempfile.mkdtemp(prefix="plan_accuracy_")
    jsonl = os.path.join(tmp, "m{rank}.jsonl")
    train = [os.path.join(a.build_dir, "tools/fsdp-train/fsdp-train"), os.path.join(REPO, f"configs/{preset}.yaml"),
             "--training.resume=never", "--training.export=none", "--fsdp_config.checkpoint_interval=0",
             f"--fsdp_config.checkpoint_dir={tmp}/ck", "--logging.log_interval=1", f"--logging.jsonl={jsonl}",
             "--logging.progress=off", "--sample.length=0"] + overrides(raf, prec, ckpt, a.steps)
    cmd = train if world == 1 else [os.path.join(a.build_dir, "tools/fsdprun/fsdprun"), "--standalone",
                                    "--nproc-per-node", str(world)] + train
    print("+", " ".join(cmd), flush=True)
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp)
    if out.returncode != 0:
        sys.exit(f"fsdp-train exited {out.returncode}:\n{out.stdout}\n{out.stderr}")
    with open(jsonl.format(rank=0)) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    timed = [r for r in rows if r["step"] > 1]
    return {"peak_mib": max(r["peak_mib"] for r in timed), "step_s": statistics.median(r["step_s"] for r in timed)}


def predict(a, preset: str, world: int, raf: str, prec: str, ckpt: str) -> dict:
    cmd = [os.path.join(a.build_dir, "tools/fsdp-train/fsdp-train"), "plan", os.path.join(REPO, f"configs/{preset}.yaml"),
           "--world", str(world), "--json"] + overrides(raf, prec, ckpt, a.steps)
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"fsdp-train plan exited {out.returncode}: {out.stderr}")
    plan = json.loads(out.stdout)
    rank0 = plan["ranks"][0]
    return {"peak_mib": rank0["peak_tensor_bytes"] / 2**20, "step_s": plan["step_time_s"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--build-dir", default=os.path.join(REPO, "build"))
    p.add_argument("--presets", default="tiny,small")
    p.add_argument("--worlds", default="1,2,4")
    p.add_argument("--reshard", default="true,false")
    p.add_argument("--precisions", default=",".join(PRECISIONS))
    p.add_argument("--checkpointing", default=",".join(CHECKPOINTING))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--measure-only", action="store_true")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    cache_path = os.path.join(a.out, "measured.json")
    cache = json.load(open(cache_path)) if os.path.exists(cache_path) else {}
    combos = list(itertools.product(a.presets.split(","), [int(w) for w in a.worlds.split(",")],
                                    a.reshard.split(","), a.precisions.split(","), a.checkpointing.split(",")))
    for combo in combos:
        key = "/".join(map(str, combo))
        if key not in cache:
            cache[key] = measure(a, *combo)
            with open(cache_path, "w") as f:
                json.dump(cache, f, indent=1, sort_keys=True)
    if a.measure_only:
        return
    commit = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    lines = [f"commit {commit}; {a.steps} steps, rank 0, measured peak = max over steps 2..{a.steps}", "",
             "| preset | W | reshard_after_forward | precision | checkpointing | predicted peak MiB | measured peak MiB "
             "| error | predicted step s | measured step s | error |", "|---|--:|---|---|---|--:|--:|--:|--:|--:|--:|"]
    worst_peak = worst_time = 0.0
    for combo in combos:
        m = cache["/".join(map(str, combo))]
        q = predict(a, *combo)
        e_peak = q["peak_mib"] / m["peak_mib"] - 1
        e_time = q["step_s"] / m["step_s"] - 1
        worst_peak, worst_time = max(worst_peak, abs(e_peak)), max(worst_time, abs(e_time))
        preset, world, raf, prec, ckpt = combo
        lines.append(f"| {preset} | {world} | {raf} | {prec} | {ckpt} | {q['peak_mib']:.2f} | {m['peak_mib']:.2f} | "
                     f"{100 * e_peak:+.1f}% | {q['step_s']:.4f} | {m['step_s']:.4f} | {100 * e_time:+.0f}% |")
    lines += ["", f"largest peak error {100 * worst_peak:.1f}%, largest step-time error {100 * worst_time:.0f}%"]
    with open(os.path.join(a.out, "table.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
