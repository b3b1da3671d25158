#!/usr/bin/env python3
"""fsdp-train's sharding strategies side by side: step time, peak memory and per-step
communication of FULL_SHARD, HYBRID_SHARD (HSDP) and NO_SHARD at one world size, run
alternately (one run of each strategy per pair, --pairs pairs) on the same model, data and
starting weights.

    python3 bench/strategies.py --out bench/results/strategies/DIR
    python3 bench/strategies.py --preset small --world 4 --pairs 2 --steps 6
    python3 bench/strategies.py --out DIR --report-only

Each run's summary JSON (logging.summary_json) gives per rank the payload bytes it sent per kind
of collective over every group of the data-parallel mesh (the shard group and, for HSDP, the
replicate group), divided here by the steps run. The table also derives, from the algorithms of
fsdp-cpp's Gloo backend, the reduce-scatter's output bytes (bytes sent / (S - 1): a rank sends
S - 1 output-sized pieces) and the all-reduce's payload (bytes sent / (2 (R - 1) / R): a ring
reduce-scatter and all-gather), which HSDP makes equal. The trainer's one-number all-reduce for
the gradient norm (8 bytes a step) is included in the all-reduce column.

Only the standard library is needed; fsdp-train and fsdprun come from --build-dir.
OPENBLAS_CORETYPE is passed through (see docs/blas.md).
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (MODEL, REPO, cores, cpu_model, fsdp_train, fsdprun, git_commit, load_json,  # noqa: E402
                     mib, run_alternating, run_env, utc_now, write_json, write_text)

STRATEGIES = {  # name -> (fsdp-train overrides, replicate degree R as a function of the world)
    "FULL_SHARD": (["--fsdp_config.sharding_strategy=FULL_SHARD"], lambda w: 1),
    "HYBRID_SHARD 2x(W/2)": (["--fsdp_config.sharding_strategy=HYBRID_SHARD", "--fsdp_config.replicate_degree=2"],
                             lambda w: 2),
    "NO_SHARD": (["--fsdp_config.sharding_strategy=NO_SHARD"], lambda w: w),
}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small", choices=sorted(MODEL))
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--batch", type=int, default=4, help="per-rank micro-batch (default 4)")
    p.add_argument("--seq", type=int, default=128, help="sequence length (default 128)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--pairs", type=int, default=2, help="rounds of one run per strategy (default 2)")
    p.add_argument("--strategies", default=",".join(STRATEGIES),
                   help="comma list of " + ", ".join(STRATEGIES) + " (default all)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    p.add_argument("--build-dir", default=os.path.join(REPO, "build"))
    p.add_argument("--out", default=None, help="output dir (default bench/results/strategies/<UTC date-time>)")
    p.add_argument("--report-only", action="store_true")
    a = p.parse_args(argv)
    a.strategies = [s.strip() for s in a.strategies.split(",") if s.strip()]
    for s in a.strategies:
        if s not in STRATEGIES:
            p.error(f"unknown strategy {s!r}")
    if a.world < 2 or a.world % 2:
        p.error("--world must be even and >= 2 (HYBRID_SHARD uses 2 replicas)")
    if a.out is None:
        a.out = os.path.join(REPO, "bench", "results", "strategies", utc_now()[:19].replace(" ", "_"))
    a.out = os.path.abspath(a.out)
    return a


def run_name(strategy: str, pair: int) -> str:
    return strategy.split(" ")[0].lower() + f"_p{pair}"


def command(a, strategy: str, json_out: str, ckpt_dir: str) -> list[str]:
    return [*fsdprun(a.build_dir, a.world), fsdp_train(a.build_dir),
            os.path.join(REPO, "configs", f"{a.preset}.yaml"), f"--model.preset={a.preset}", "--model.dropout_p=0",
            f"--training.micro_batch_size={a.batch}", f"--training.seq_len={a.seq}", f"--training.steps={a.steps}",
            "--training.max_grad_norm=0", "--training.resume=never", "--training.export=none",
            "--fsdp_config.checkpoint_interval=0", f"--fsdp_config.checkpoint_dir={ckpt_dir}",
            "--logging.progress=off", "--logging.log_interval=1000000", f"--logging.summary_json={json_out}",
            f"--logging.summary_warmup={a.warmup}", *STRATEGIES[strategy][0]]


def run_all(a) -> None:
    os.makedirs(a.out, exist_ok=True)
    run_alternating(a.pairs, a.strategies, run_name, lambda s, json_out, ckpt: command(a, s, json_out, ckpt),
                    a.out, run_env(a.world), a.timeout, "strategies_ckpt_")


def per_step(res: dict, key: str) -> list[float]:
    return [b / res["steps"] for b in res.get(key) or []]


def render(a, meta: dict) -> str:
    w = a.world
    lines = [f"# fsdp-train sharding strategies, {a.preset} at W={w}", "",
             f"Command: `{meta['command']}`  ",
             f"Date: {meta['date']}; CPU: {meta['cpu']}; cores: {meta['cores']}; fsdp-cpp commit: {meta['commit']}; "
             f"OPENBLAS_CORETYPE={meta['coretype']}; per-rank batch {a.batch}, seq {a.seq}, {a.steps} steps "
             f"({a.warmup} warm-up), {a.pairs} pair(s), run order {', '.join(a.strategies)}", "",
             "Step = median over pairs of rank 0's median step time. Bytes are per step and rank (rank 0), sent on "
             "the wire: AG all-gather, RS reduce-scatter, AR all-reduce. RS out = RS sent / (S − 1); AR payload = "
             "AR sent / (2 (R − 1) / R). Peak RSS = max over ranks, median over pairs.", "",
             "| strategy | R × S | step s | step / FULL_SHARD | AG MiB | RS MiB | AR MiB | RS out MiB | "
             "AR payload MiB | peak RSS MiB | peak tensors MiB | final loss |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    base = None
    for s in a.strategies:
        runs = []
        for k in range(1, a.pairs + 1):
            path = os.path.join(a.out, run_name(s, k) + ".json")
            if os.path.exists(path):
                runs.append(load_json(path))
        runs = [r for r in runs if isinstance(r, dict) and "median_step_s" in r]
        R = STRATEGIES[s][1](w)
        S = w // R
        if not runs:
            lines.append(f"| {s} | {R} × {S} | failed | | | | | | | | | |")
            continue
        step = statistics.median(r["median_step_s"] for r in runs)
        base = step if s == "FULL_SHARD" else base
        r0 = runs[0]
        ag, rs, ar = (per_step(r0, f"{k}_bytes_per_rank")[0] for k in ("all_gather", "reduce_scatter", "all_reduce"))
        rs_out = rs / (S - 1) if S > 1 else 0.0
        ar_payload = ar / (2 * (R - 1) / R) if R > 1 else 0.0
        rss = statistics.median(max(r["peak_rss_mib_per_rank"]) for r in runs)
        tensors = statistics.median(max(r["peak_tensor_mib_per_rank"]) for r in runs)
        ratio = f"{step / base:.3f}" if base else "–"
        lines.append(f"| {s} | {R} × {S} | {step:.4g} | {ratio} | {mib(ag)} | {mib(rs)} | {mib(ar)} | "
                     f"{mib(rs_out) if S > 1 else '–'} | {mib(ar_payload) if R > 1 else '–'} | {rss:.0f} | "
                     f"{tensors:.0f} | {r0['losses'][-1]:.6f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = parse_args(argv)
    meta_path = os.path.join(a.out, "meta.json")
    if a.report_only:
        meta = load_json(meta_path)
    else:
        os.makedirs(a.out, exist_ok=True)
        meta = {"command": shlex.join([sys.executable, "bench/strategies.py", *argv]), "date": utc_now(),
                "cpu": cpu_model(), "cores": cores(), "commit": git_commit() or "?",
                "coretype": os.environ.get("OPENBLAS_CORETYPE")}
        write_json(meta_path, meta)
        run_all(a)
    table = render(a, meta)
    write_text(os.path.join(a.out, "table.md"), table)
    print(table, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
