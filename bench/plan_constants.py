#!/usr/bin/env python3
"""Measures the rates the planner (fsdp::plan, `fsdp-train plan`) predicts step times and RSS
with, and writes them to configs/plan_constants.json, the one file they live in (the library
builds it in; `fsdp-train plan --constants FILE` reads another). Run it on a quiet machine,
holding the benchmark lock, and rebuild afterwards:

    bash scripts/build.sh
    flock /tmp/fsdp-bench.lock python3 bench/plan_constants.py \\
        [--out configs/plan_constants.json]

Any python3 runs this script; its measurements in Python (plan_elementwise.py, LibTorch's default
thread count, the memory bandwidth) run under $FSDP_PYTHON, the venv with torch 2.15 (set by
scripts/torch-env.sh; default ~/.cache/fsdp-cpp/venv-torch-2.15.0/bin/python).

Two thread settings are measured, as the trainer runs: one thread per rank (fsdprun's workers when
several share a machine: OMP_NUM_THREADS=1, OPENBLAS_NUM_THREADS=1), and a rank alone with no
thread variables (LibTorch's default thread count, OpenBLAS's thread per CPU). In each:
- matmul rates: bench/bench_matmul, the median over the shapes of small's and medium's linear
  layers and heads, the best of three runs;
- elementwise rates: bench/plan_elementwise.py, a block's forward and backward less its matmuls,
  per byte the planner counts for it, the best of three runs.
Collectives: bus bandwidth from bench/bench_collectives at W=2 (a line through its 1, 8 and 64 MiB
all-gather and reduce-scatter times), on Gloo (fsdprun) and MPI (mpirun); latency per ring step
from the trainer on tiny (whose collectives carry a few KiB): what its step gains from W=1 to W=2,
and to W=4 on fewer cores (two ranks per core), per step of its collectives' rings. The optimizer's
memory bandwidth: an in-place add of 64 MiB at one thread, the best of 7. The overheads
beyond the arithmetic (per stage, per checkpointed stage): tiny at W=1 with one thread, plain and
checkpointed. The runtime RSS (part rss, apart from the rest: a machine's load does not change
it): tiny at W=1; RSS per tensor byte: small at W=1, (peak RSS - runtime) / peak tensor bytes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import tempfile

from _common import (MPI_AS_ROOT, MPIRUN_ONE_THREAD, PY, REPO, cpu_model, fsdp_train, fsdprun, git_commit,
                     load_average, wait_for_quiet)

ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
# tiny's collectives per step (FULL_SHARD, 2 blocks): all-gathers of the root and of each block in
# forward and backward (5), reduce-scatters of the root and the blocks (3), the gradient norm's
# all-reduce (1).
TINY_COLLECTIVES_PER_STEP = 9
QUIET_WAIT_S = 120.0
STARTS: list[bool] = []  # for each measurement: whether the machine was quiet when it started


def run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    """A measurement, started once the machine is quiet (or QUIET_WAIT_S has passed)."""
    STARTS.append(wait_for_quiet(QUIET_WAIT_S))
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, capture_output=True, text=True, check=True, **kwargs)

def environment(threads: dict | None) -> dict:
    """The environment of a measurement: the thread variables given, or none at all."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")}
    env.update(threads or {})
    env.update(MPI_AS_ROOT)
    return env


def last_json(text: str):
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise SystemExit("no JSON in:\n" + text)


def libtorch_default_threads() -> int:
    out = subprocess.run([PY, "-c", "import torch; print(torch.get_num_threads())"],
                         capture_output=True, text=True, check=True, env=environment(None)).stdout
    return int(out.strip())


def matmul(build: str, threads: dict | None, torch_threads: int) -> dict:
    # The best of three runs, since other jobs on the machine only ever slow it down.
    shapes = "1024x256x256,1024x256x1024,1024x1024x256,1024x256x8192,1024x768x768,1024x768x3072,1024x3072x768"
    best = {"fp32": 0.0, "bf16": 0.0}
    for _ in range(3):
        out = run([f"{build}/bench/bench_matmul", "--shapes", shapes, "--threads", str(torch_threads),
                   "--dtypes", "fp32,bf16", "--json"], env=environment(threads)).stdout
        results = last_json(out)["results"]
        for d in best:
            best[d] = max(best[d], statistics.median(r["gflops"] for r in results if r["dtype"] == d) * 1e9)
    return best


def elementwise(threads: dict | None) -> dict:
    rates = {}
    for dtype in ("fp32", "bf16"):
        best = None
        for _ in range(3):
            out = run([PY, os.path.join(REPO, "bench/plan_elementwise.py"), "--dtype", dtype],
                      env=environment(threads)).stdout
            r = last_json(out)
            # The block's work beyond its matmuls; at least a tenth of the block, against noise.
            seconds = max(r["block_s"] - r["matmul_s"], 0.1 * r["block_s"])
            best = seconds if best is None else min(best, seconds)
        rates[dtype] = r["planned_bytes"] / best
    return rates


def compute_rates(build: str, threads: dict | None, torch_threads: int) -> dict:
    mm, ew = matmul(build, threads, torch_threads), elementwise(threads)
    return {"matmul_flops_fp32": round(mm["fp32"]), "matmul_flops_bf16": round(mm["bf16"]),
            "elementwise_bytes_per_s_fp32": round(ew["fp32"]), "elementwise_bytes_per_s_bf16": round(ew["bf16"])}


def launcher(build: str, world: int, backend: str) -> list[str]:
    if backend == "mpi":
        return MPIRUN_ONE_THREAD + ["-np", str(world)]
    return [] if world == 1 else fsdprun(build, world)


def bandwidth(build: str, backend: str) -> float:
    out = run(launcher(build, 2, backend) + [f"{build}/bench/bench_collectives", "--json"],
              env=environment(ONE_THREAD)).stdout
    # Without c10d's baseline (MPI) its columns are "nan", which JSON spells NaN.
    rows = [json.loads((l.split(":", 1)[1] if l.startswith("[rank") else l).replace(": nan", ": NaN"))
            for l in out.splitlines() if "all_gather_ms" in l]
    # time = latency + (bytes x (W-1)/W) / bandwidth, fitted through the points.
    xs, ys = [], []
    for r in rows:
        sent = r["size_mib"] * 2**20 * (r["world"] - 1) / r["world"]
        for k in ("all_gather_ms", "reduce_scatter_ms"):
            xs.append(sent)
            ys.append(r[k] / 1e3)
    mx, my = statistics.mean(xs), statistics.mean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return 1 / slope


def memory_bandwidth() -> float:
    code = ("import torch,time\ntorch.set_num_threads(1)\na=torch.ones(16*2**20);b=torch.ones(16*2**20)\n"
            "a.add_(b)\nts=[]\nfor _ in range(7):\n t=time.perf_counter();a.add_(b);ts.append(time.perf_counter()-t)\n"
            "ts.sort();print(3*a.numel()*4/ts[0])")
    return float(run([PY, "-c", code], env=environment(ONE_THREAD)).stdout.strip())


def train(build: str, preset: str, world: int = 1, backend: str = "gloo", steps: int = 6,
          extra: list[str] | None = None) -> dict:
    """fsdp-train for a few steps, one thread per rank; its summary (medians after 2 warm-up steps)."""
    tmp = tempfile.mkdtemp(prefix="plan_constants_")
    cmd = launcher(build, world, backend) + [
        fsdp_train(build), f"{REPO}/configs/{preset}.yaml", f"--training.steps={steps}",
        f"--fsdp_config.backend={backend}", "--training.resume=never", "--training.export=none",
        "--fsdp_config.checkpoint_interval=0", f"--fsdp_config.checkpoint_dir={tmp}/ck", "--logging.progress=off",
        f"--logging.summary_json={tmp}/s.json", "--sample.length=0"] + (extra or [])
    run(cmd, cwd=tmp, env=environment(ONE_THREAD))
    with open(f"{tmp}/s.json") as f:
        s = json.load(f)
    shutil.rmtree(tmp, ignore_errors=True)
    return {"rss": s["peak_rss_mib_per_rank"][0] * 2**20, "tensors": s["peak_tensor_mib_per_rank"][0] * 2**20,
            "step_s": s["median_step_s"]}


def tiny_step(build: str, world: int = 1, backend: str = "gloo", extra: list[str] | None = None,
              best: bool = True) -> float:
    """tiny's step time, a few milliseconds, from three runs' medians over 40 steps: the best (other
    work on the machine only ever slows one rank down), or their median (ranks that wait for each
    other also wait for the machine to wake the other up, which takes 1 to 10 ms by chance)."""
    steps = [train(build, "tiny", world, backend, steps=40, extra=extra)["step_s"] for _ in range(3)]
    return min(steps) if best else statistics.median(steps)


def overheads(build: str) -> dict:
    """What a step costs beyond its arithmetic, from tiny at W=1 (one thread), whose arithmetic is
    negligible: its step spread over its 4 stages (embeddings, 2 blocks, head), in fp32 and in bf16
    (which casts every parameter), and what checkpointing both blocks adds, per block. (Its steps at 2 and 8 blocks, a line through which
    would split off a per-step part, vary by a third between runs of 8 blocks on this VM.)"""
    plain = tiny_step(build)
    checkpointed = tiny_step(build, extra=["--fsdp_config.activation_checkpointing=true"])
    bf16 = tiny_step(build, extra=["--fsdp_config.mixed_precision=true"])
    return {"stage_overhead_s": plain / 4, "bf16_stage_overhead_s": bf16 / 4,
            "checkpointed_stage_overhead_s": max(0.0, (checkpointed - plain) / 2)}


def latencies(build: str, backend: str, cores: int, alone_s: float) -> tuple[float, float]:
    """Seconds per ring step of tiny's collectives: at W=2 (a core each, when there are 2), and at
    two ranks per core (W = 2 x cores), where each rank's compute also takes twice as long."""
    two = tiny_step(build, 2, backend, best=False)
    over = tiny_step(build, 2 * cores, backend, best=False)
    per_step = max(1e-6, (two - alone_s) / (TINY_COLLECTIVES_PER_STEP * 1))
    per_step_over = max(per_step, (over - 2 * alone_s) / (TINY_COLLECTIVES_PER_STEP * (2 * cores - 1)))
    return per_step, per_step_over


PARTS = ("compute", "overheads", "gloo", "mpi", "memory", "rss")


def measure(part: str, b: str, cores: int) -> dict:
    """The constants of one part of the file."""
    if part == "compute":
        torch_threads = libtorch_default_threads()
        return {"one_thread": compute_rates(b, ONE_THREAD, 1), "single_rank": compute_rates(b, None, torch_threads),
                "libtorch_default_threads": torch_threads}
    if part == "overheads":
        return overheads(b)
    if part in ("gloo", "mpi"):
        prefix = "" if part == "gloo" else "mpi_"
        latency, over = latencies(b, part, cores, tiny_step(b))
        return {f"{prefix}collective_bytes_per_s": round(bandwidth(b, part)), f"{prefix}collective_latency_s": latency,
                f"{prefix}collective_latency_s_oversubscribed": over}
    if part == "memory":
        return {"memory_bytes_per_s": round(memory_bandwidth())}
    # rss: what a rank holds besides its tensors, which the machine's load does not change.
    tiny, small = train(b, "tiny"), train(b, "small")
    runtime = tiny["rss"] - tiny["tensors"]
    return {"runtime_rss_bytes": round(runtime), "rss_per_tensor_byte": round((small["rss"] - runtime) / small["tensors"], 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build-dir", default=os.path.join(REPO, "build"))
    p.add_argument("--out", default=os.path.join(REPO, "configs/plan_constants.json"))
    p.add_argument("--parts", default=",".join(PARTS),
                   help="what to measure again (" + ", ".join(PARTS) + "); the rest is kept from --out")
    p.add_argument("--quiet-wait", type=float, default=120.0,
                   help="seconds each measurement waits for no other process to be running")
    a = p.parse_args()
    global QUIET_WAIT_S
    QUIET_WAIT_S = a.quiet_wait
    cores = os.cpu_count()
    parts = a.parts.split(",")
    out = json.load(open(a.out)) if set(parts) != set(PARTS) else {}
    out["cpu_cores"] = cores
    commit = git_commit()
    # When and how each part was last measured: a part measured again replaces its own line only.
    when = out.get("measured_parts", {})
    for part in parts:
        first = len(STARTS)
        out.update(measure(part, a.build_dir, cores))
        quiet = STARTS[first:]
        when[part] = (f"{datetime.datetime.utcnow():%Y-%m-%d %H:%M} UTC, commit {commit}, {sum(quiet)} of "
                      f"{len(quiet)} runs started with no other process running")
    out["measured_parts"] = {part: when[part] for part in PARTS if part in when}
    out["source"] = (f"{cpu_model('unknown CPU')}, {cores} CPUs, bench/plan_constants.py: " +
                     "; ".join(f"{part} {line}" for part, line in out["measured_parts"].items()) +
                     f"; load average at the end {' '.join(load_average())}")
    order = ["source", "measured_parts", "cpu_cores", "one_thread", "single_rank", "libtorch_default_threads", "memory_bytes_per_s",
             "collective_bytes_per_s", "collective_latency_s", "collective_latency_s_oversubscribed",
             "mpi_collective_bytes_per_s", "mpi_collective_latency_s", "mpi_collective_latency_s_oversubscribed",
             "stage_overhead_s", "bf16_stage_overhead_s", "checkpointed_stage_overhead_s", "runtime_rss_bytes",
             "rss_per_tensor_byte"]
    out = {k: out[k] for k in order if k in out}
    with open(a.out, "w") as f:
        json.dump(out, f, indent=2)
        f.write("\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
