#!/usr/bin/env python3
"""The planner (`fsdp-train plan`) against the trainer: predicted vs measured peak tensor bytes
and step time, for every combination of preset, world size, reshard_after_forward (FULL_SHARD /
SHARD_GRAD_OP), precision (fp32 / bf16 compute) and checkpointing mode asked for, optionally
with tensor parallelism (--tp) or on the MPI backend (--backend mpi).

Each combination is trained for a few steps (fsdprun for W > 1, mpirun for --backend mpi); the
measured peak is the largest per-step peak tensor bytes of rank 0 after the first step (the first
step has no optimizer state yet), the measured step time the median of those steps. The planner
is asked the same configuration with --json. Measurements are cached in OUT/measured.json (delete
an entry to measure it again), so a changed planner is compared again without retraining, and a
long sweep can be split into several commands.

    python3 bench/plan_accuracy.py --out bench/results/plan_accuracy/DIR \\
        --presets tiny,small --worlds 1,2,4 --lock /tmp/fsdp-bench.lock

--lock FILE holds that lock (flock) around each timed run, so that benchmarks of others never
overlap one. --untimed runs measure memory only (peak tensor bytes are exact whatever the load):
their step times are kept out of the table until a timed run of the same combination replaces
them. --table-only prints the table of what is cached. Only the standard library is needed.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import fcntl
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

from _common import (MPI_AS_ROOT, MPIRUN_ONE_THREAD, REPO, fsdp_train, fsdprun, git_commit, load_average,
                     wait_for_quiet, write_text)

STRATEGIES = {"true": "FULL_SHARD", "false": "SHARD_GRAD_OP"}
PRECISIONS = {"fp32": [], "bf16": ["--fsdp_config.mixed_precision=true"]}
EVERY = ["--fsdp_config.activation_checkpointing=true", "--fsdp_config.activation_checkpointing_every=1"]
CHECKPOINTING = {
    "none": [],
    "every": EVERY,
    "every2": ["--fsdp_config.activation_checkpointing=true", "--fsdp_config.activation_checkpointing_every=2"],
    "every+loss4": EVERY + ["--training.loss_chunks=4"],
    # The final norm and the output head as an FSDP group of their own, with and without the rest.
    "head": ["--fsdp_config.output_head_group=true"],
    "every+loss4+head": EVERY + ["--training.loss_chunks=4", "--fsdp_config.output_head_group=true"],
}

# Options beyond the matrix, each planned and trained once at small (W=2 and 4 unless it needs
# a world): --coverage. "{tokens}" is a token file of the GPL-3 text the script makes.
COVERAGE = {
    "accumulation 2": ([2, 4], ["--training.gradient_accumulation_steps=2"]),
    "FusedAdamW": ([2, 4], ["--optimizer.fused=true"]),
    "offload": ([2, 4], ["--fsdp_config.offload_params=true", "--fsdp_config.offload_optimizer_state=true"]),
    "NO_SHARD": ([2, 4], ["--fsdp_config.sharding_strategy=NO_SHARD"]),
    "HYBRID_SHARD 2 x 2": ([4], ["--fsdp_config.sharding_strategy=HYBRID_SHARD", "--fsdp_config.replicate_degree=2"]),
    "HYBRID_SHARD 2 x 2, accumulation 2": ([4], ["--fsdp_config.sharding_strategy=HYBRID_SHARD",
                                                 "--fsdp_config.replicate_degree=2",
                                                 "--training.gradient_accumulation_steps=2"]),
    "bf16 reduce": ([2, 4], ["--fsdp_config.param_dtype=bfloat16", "--fsdp_config.reduce_dtype=bfloat16"]),
    "bf16, fp16 reduce": ([2, 4], ["--fsdp_config.mixed_precision=true", "--fsdp_config.reduce_dtype=float16"]),
    "dropout 0.1": ([2, 4], ["--model.dropout_p=0.1"]),
    "a background checkpoint every step": ([2, 4], ["--fsdp_config.checkpoint_interval=1"]),
    "token file": ([2, 4], ["--data.source=tokens", "--data.path={tokens}"]),
    "MPI backend": ([2, 4], ["--fsdp_config.backend=mpi"]),
    "MPI backend, bf16, every block": ([2, 4], ["--fsdp_config.backend=mpi", "--fsdp_config.mixed_precision=true"] + EVERY),
    "tp 2": ([2, 4], ["--fsdp_config.model_parallel_size=2"]),
    "tp 2, embedding and head whole": ([2, 4], ["--fsdp_config.model_parallel_size=2",
                                                "--fsdp_config.vocab_parallel=false"]),
    "tp 2, loss in 4 pieces": ([2, 4], ["--fsdp_config.model_parallel_size=2", "--training.loss_chunks=4"]),
    "tp 4": ([4], ["--fsdp_config.model_parallel_size=4"]),
    "tp 2, bf16, every block, SHARD_GRAD_OP": ([2, 4], ["--fsdp_config.model_parallel_size=2",
                                                        "--fsdp_config.mixed_precision=true",
                                                        "--fsdp_config.sharding_strategy=SHARD_GRAD_OP"] + EVERY),
    "head group, accumulation 2": ([2, 4], ["--fsdp_config.output_head_group=true",
                                            "--training.gradient_accumulation_steps=2"]),
}


class Run:
    """One configuration: planned, and trained for a.steps steps."""

    def __init__(self, a, key: str, preset: str, world: int, options: list[str], labels: list[str]):
        self.key, self.preset, self.world, self.labels = key, preset, world, labels
        self.options = [f"--training.steps={a.steps}", "--fsdp_config.checkpoint_interval=0",
                        f"--fsdp_config.model_parallel_size={a.tp}",
                        f"--fsdp_config.backend={a.backend}"] + options
        self.mpi = a.backend == "mpi" or "--fsdp_config.backend=mpi" in options


def matrix_runs(a) -> list[Run]:
    runs = []
    for preset, world, raf, prec, ckpt in itertools.product(
            a.presets.split(","), [int(w) for w in a.worlds.split(",")], a.reshard.split(","),
            a.precisions.split(","), a.checkpointing.split(",")):
        if world % a.tp != 0 or (a.tp > 1 and "head" in ckpt):
            continue
        key = "/".join(map(str, (preset, world, raf, prec, ckpt))) + (f"/tp{a.tp}" if a.tp > 1 else "") + \
            (f"/{a.backend}" if a.backend != "gloo" else "")
        options = [f"--fsdp_config.sharding_strategy={STRATEGIES[raf]}"] + PRECISIONS[prec] + CHECKPOINTING[ckpt]
        runs.append(Run(a, key, preset, world, options, [preset, str(world), raf, prec, ckpt]))
    return runs


def coverage_runs(a, tokens: str) -> list[Run]:
    runs = []
    for name, (worlds, options) in COVERAGE.items():
        for world in worlds:
            opts = [o.replace("{tokens}", tokens) for o in options]
            runs.append(Run(a, f"coverage/{name}/small/{world}", "small", world, opts, ["small", str(world), name]))
    return runs


@contextlib.contextmanager
def held(lock_path: str | None):
    if not lock_path:
        yield
        return
    with open(lock_path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def measure(a, run: Run) -> dict:
    tmp = tempfile.mkdtemp(prefix="plan_accuracy_")
    jsonl = os.path.join(tmp, "m{rank}.jsonl")
    train = [fsdp_train(a.build_dir), os.path.join(REPO, f"configs/{run.preset}.yaml"),
             "--training.resume=never", "--training.export=none", f"--fsdp_config.checkpoint_dir={tmp}/ck", "--logging.log_interval=1", f"--logging.jsonl={jsonl}",
             "--logging.progress=off", "--sample.length=0"] + run.options
    if run.mpi:
        cmd = MPIRUN_ONE_THREAD + ["-np", str(run.world)] + train
    elif run.world == 1:
        cmd = train
    else:
        cmd = fsdprun(a.build_dir, run.world) + train
    env = dict(os.environ, **MPI_AS_ROOT)
    with held(None if a.untimed else a.lock):
        quiet = False if a.untimed else wait_for_quiet(a.quiet_wait)
        load = " ".join(load_average())
        when = f"{datetime.datetime.utcnow():%Y-%m-%d %H:%M:%S} UTC"
        print("+", " ".join(cmd), f"(load {load})", flush=True)
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp, env=env)
    if out.returncode != 0:
        sys.exit(f"fsdp-train exited {out.returncode}:\n{out.stdout}\n{out.stderr}")
    with open(jsonl.format(rank=0)) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    shutil.rmtree(tmp, ignore_errors=True)
    timed = [r for r in rows if r["step"] > 1]
    return {"peak_mib": max(r["peak_mib"] for r in timed), "step_s": statistics.median(r["step_s"] for r in timed),
            "timed": not a.untimed, "quiet": quiet, "load_before": load, "utc": when}


def predict(a, run: Run) -> dict:
    cmd = [fsdp_train(a.build_dir), "plan",
           os.path.join(REPO, f"configs/{run.preset}.yaml"), "--world", str(run.world), "--json"] + run.options
    # The trainer's ranks under mpirun get one thread each (MPIRUN_ONE_THREAD's -x), as fsdprun's do.
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1") if run.mpi else None
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        sys.exit(f"fsdp-train plan exited {out.returncode}: {out.stderr}")
    plan = json.loads(out.stdout)
    rank0 = plan["ranks"][0]
    # The step after a background save (the same as the peak without background saves).
    return {"peak_mib": rank0["peak_tensor_bytes_after_save"] / 2**20, "step_s": plan["step_time_s"]}


def table(a, runs: list[Run], cache: dict, coverage: bool) -> list[str]:
    commit = git_commit()
    columns = "| preset | W | options |" if coverage else "| preset | W | reshard_after_forward | precision | checkpointing |"
    lines = [f"planner at commit {commit}; {a.steps} steps, rank 0, measured peak = max over steps 2..{a.steps}, "
             f"measured step = their median; tp {a.tp}, backend {a.backend}; step times only from timed runs, "
             "(busy): other processes were running when it started", "",
             columns + " predicted peak MiB | measured peak MiB | error | predicted step s | measured step s | error "
             "| load before |", "|---|--:|" + "---|" * (len(runs[0].labels) - 2) + "--:|--:|--:|--:|--:|--:|--:|"]
    summary: dict = {}
    for run in runs:
        m = cache.get(run.key)
        if m is None:
            continue
        q = predict(a, run)
        e_peak = q["peak_mib"] / m["peak_mib"] - 1
        s = summary.setdefault((run.preset, run.world), {"runs": 0, "peak": [], "time": [], "quiet": 0})
        s["runs"] += 1
        s["peak"].append(e_peak)
        if m.get("timed", True):
            e_time = q["step_s"] / m["step_s"] - 1
            s["time"].append(e_time)
            s["quiet"] += 1 if m.get("quiet") else 0
            quiet = "" if m.get("quiet") else " (busy)"
            timing = f"{q['step_s']:.4f} | {m['step_s']:.4f} | {100 * e_time:+.0f}% | {m.get('load_before', '')}{quiet}"
        else:
            timing = f"{q['step_s']:.4f} | - | - | -"
        lines.append("| " + " | ".join(run.labels) + f" | {q['peak_mib']:.2f} | {m['peak_mib']:.2f} | "
                     f"{100 * e_peak:+.1f}% | {timing} |")
    lines += ["", "| preset | W | runs | peak error min / max | peak within ±10 % | timed runs (quiet) | "
              "step-time error min / max | step time within ±30 % |", "|---|--:|--:|--:|--:|--:|--:|--:|"]
    for (preset, world), s in summary.items():
        p, t = s["peak"], s["time"]
        peak_ok = sum(abs(e) <= 0.10 for e in p)
        time_ok = sum(abs(e) <= 0.30 for e in t)
        trange = f"{100 * min(t):+.0f} % / {100 * max(t):+.0f} %" if t else "-"
        lines.append(f"| {preset} | {world} | {s['runs']} | {100 * min(p):+.1f} % / {100 * max(p):+.1f} % | "
                     f"{peak_ok} of {len(p)} | {len(t)} ({s['quiet']}) | {trange} | {time_ok} of {len(t)} |")
    return lines


def token_file(a) -> str:
    path = os.path.abspath(os.path.join(a.out, "gpl3.tokens"))  # the runs start in a directory of their own
    if not os.path.exists(path):
        subprocess.run([fsdp_train(a.build_dir), "tokenize",
                        "/usr/share/common-licenses/GPL-3", path], check=True, capture_output=True)
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--build-dir", default=os.path.join(REPO, "build"))
    p.add_argument("--presets", default="tiny,small")
    p.add_argument("--worlds", default="1,2,4")
    p.add_argument("--reshard", default="true,false")
    p.add_argument("--precisions", default=",".join(PRECISIONS))
    p.add_argument("--checkpointing", default=",".join(CHECKPOINTING))
    p.add_argument("--tp", type=int, default=1, help="fsdp_config.model_parallel_size (worlds it does not divide "
                   "are skipped)")
    p.add_argument("--backend", default="gloo", choices=["gloo", "mpi"])
    p.add_argument("--coverage", action="store_true", help="the options of COVERAGE at small instead of the matrix")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--lock", help="hold this lock (flock) around each timed run")
    p.add_argument("--untimed", action="store_true", help="memory only: step times not reported")
    p.add_argument("--quiet-wait", type=float, default=60,
                   help="seconds a timed run waits for no other process to be running (it runs anyway after)")
    p.add_argument("--retime", action="store_true",
                   help="time again the cached runs that were untimed or started on a busy machine")
    p.add_argument("--measure-only", action="store_true")
    p.add_argument("--table-only", action="store_true")
    p.add_argument("--table", default="table.md", help="the table's file name under OUT")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    cache_path = os.path.join(a.out, "measured.json")
    cache = json.load(open(cache_path)) if os.path.exists(cache_path) else {}
    runs = coverage_runs(a, token_file(a)) if a.coverage else matrix_runs(a)
    for run in [] if a.table_only else runs:
        entry = cache.get(run.key, {})
        retime = a.retime and not a.untimed and entry and not (entry.get("timed", True) and entry.get("quiet", True))
        if not entry or retime:
            cache[run.key] = measure(a, run)
            with open(cache_path, "w") as f:
                json.dump(cache, f, indent=1, sort_keys=True)
    if a.measure_only:
        return
    lines = table(a, runs, cache, a.coverage)
    write_text(os.path.join(a.out, a.table), "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
