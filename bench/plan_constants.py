#!/usr/bin/python3
"""Measures the rates the planner (fsdp::plan, `fsdp-train plan`) predicts step times and RSS
with, and writes them to configs/plan_constants.json, the one file they live in (the library
builds it in; `fsdp-train plan --constants FILE` reads another).

    bash scripts/build.sh
    OPENBLAS_CORETYPE=Haswell /usr/bin/python3 bench/plan_constants.py [--out configs/plan_constants.json]

matmul rates: bench/bench_matmul on every core (one rank alone on the machine; the planner
divides the rates among the ranks of one machine), the median over the shapes of small's and
medium's linear layers, the best of three runs; collective bandwidth: bench/bench_collectives at
W=2 (the slope of a line through its 1, 8 and 64 MiB all-gather and reduce-scatter times);
latency: what tiny's step gains from W=1 to W=2, per collective; memory bandwidth: an in-place
add of 64 MiB at one thread (torch), the best of 7; the runtime RSS and per-step overhead:
fsdp-train on tiny at W=1 (its tensors are a few hundred KiB); RSS per tensor byte: fsdp-train on small at
W=1, (peak RSS - runtime) / peak tensor bytes. Rebuild afterwards: the file is built into the library.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def last_json(text: str):
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise SystemExit("no JSON in:\n" + text)


def matmul(build: str) -> dict:
    # Every core, as one rank alone on the machine has them; the best of three runs, since other
    # jobs on the machine only ever slow it down.
    shapes = "1024x256x256,1024x256x1024,1024x1024x256,1024x768x768,1024x768x3072,1024x3072x768"
    best = {"fp32": 0.0, "bf16": 0.0}
    for _ in range(3):
        out = subprocess.run([f"{build}/bench/bench_matmul", "--shapes", shapes, "--threads", str(os.cpu_count()),
                              "--dtypes", "fp32,bf16", "--json"], capture_output=True, text=True, check=True).stdout
        results = last_json(out)["results"]
        for d in best:
            best[d] = max(best[d], statistics.median(r["gflops"] for r in results if r["dtype"] == d) * 1e9)
    return best


def collectives(build: str) -> dict:
    out = subprocess.run([f"{build}/tools/fsdprun/fsdprun", "--standalone", "--nproc-per-node", "2",
                          f"{build}/bench/bench_collectives", "--json"], capture_output=True, text=True, check=True).stdout
    rows = [json.loads(l.split(":", 1)[1] if l.startswith("[rank") else l) for l in out.splitlines()
            if "all_gather_ms" in l]
    # time = latency + (bytes x (W-1)/W) / bandwidth, fitted through the points.
    xs, ys = [], []
    for r in rows:
        sent = r["size_mib"] * 2**20 * (r["world"] - 1) / r["world"]
        for k in ("all_gather_ms", "reduce_scatter_ms"):
            xs.append(sent)
            ys.append(r[k] / 1e3)
    mx, my = statistics.mean(xs), statistics.mean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return {"bandwidth": 1 / slope}


def memory_bandwidth() -> float:
    code = ("import torch,time\ntorch.set_num_threads(1)\na=torch.ones(16*2**20);b=torch.ones(16*2**20)\n"
            "a.add_(b)\nts=[]\nfor _ in range(7):\n t=time.perf_counter();a.add_(b);ts.append(time.perf_counter()-t)\n"
            "ts.sort();print(3*a.numel()*4/ts[0])")
    return float(subprocess.run(["/usr/bin/python3", "-c", code], capture_output=True, text=True,
                                check=True).stdout.strip())


def train(build: str, preset: str, world: int = 1) -> dict:
    tmp = tempfile.mkdtemp(prefix="plan_constants_")
    launcher = [] if world == 1 else [f"{build}/tools/fsdprun/fsdprun", "--standalone", "--nproc-per-node", str(world)]
    cmd = launcher + [f"{build}/tools/fsdp-train/fsdp-train", f"{REPO}/configs/{preset}.yaml", "--training.steps=6",
           "--training.resume=never", "--training.export=none", "--fsdp_config.checkpoint_interval=0",
           f"--fsdp_config.checkpoint_dir={tmp}/ck", "--logging.progress=off", f"--logging.summary_json={tmp}/s.json",
           "--sample.length=0"]
    subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=tmp)
    with open(f"{tmp}/s.json") as f:
        s = json.load(f)
    return {"rss": s["peak_rss_mib_per_rank"][0] * 2**20, "tensors": s["peak_tensor_mib_per_rank"][0] * 2**20,
            "step_s": s["median_step_s"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build-dir", default=os.path.join(REPO, "build"))
    p.add_argument("--out", default=os.path.join(REPO, "configs/plan_constants.json"))
    a = p.parse_args()
    mm = matmul(a.build_dir)
    coll = collectives(a.build_dir)
    tiny, small = train(a.build_dir, "tiny"), train(a.build_dir, "small")
    # Latency: what tiny's step gains at W=2, per collective of its step (2 all-gathers and a
    # reduce-scatter per block, the root's all-gather and reduce-scatter, the trainer's gradient
    # norm all-reduce and its step vote): payloads of a few KiB, so all of it is latency.
    tiny2 = train(a.build_dir, "tiny", 2)
    collectives_per_step = 3 * 2 + 2 + 2
    latency = max(1e-5, (tiny2["step_s"] - tiny["step_s"]) / collectives_per_step)
    runtime = tiny["rss"] - tiny["tensors"]
    cpu = "unknown CPU"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    commit = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    out = {
        "source": f"{cpu}, {os.cpu_count()} CPUs, {datetime.datetime.utcnow():%Y-%m-%d %H:%M} UTC, commit {commit}, "
                  "bench/plan_constants.py",
        "matmul_flops_fp32": round(mm["fp32"]), "matmul_flops_bf16": round(mm["bf16"]),
        "memory_bytes_per_s": round(memory_bandwidth()),
        "collective_bytes_per_s": round(coll["bandwidth"]), "collective_latency_s": latency,
        "step_overhead_s": tiny["step_s"], "cpu_cores": os.cpu_count(),
        "runtime_rss_bytes": round(runtime),
        "rss_per_tensor_byte": round((small["rss"] - runtime) / small["tensors"], 3),
    }
    with open(a.out, "w") as f:
        json.dump(out, f, indent=2)
        f.write("\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
