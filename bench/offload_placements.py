"""The three placements of the sharded training state, side by side, one rank: no offload;
parameters (and gradients) offloaded with AdamW's state on the device (fsdp::optim::DeviceStateAdamW);
and full offload (FSDP2's CPUOffloadPolicy). For each, fsdp-train's measured step time and device
peak (the GPU allocator's on cuda), beside the device and host peaks `fsdp-train plan` predicts.

    python3 bench/offload_placements.py --build-dir build-gpu --device cuda --out DIR
    python3 bench/offload_placements.py --device cpu --out DIR   # the CPU stand-in: one memory

On cpu the three are one memory (device memory is host memory) and the trainer runs them alike:
the run there checks the script and the planner's one-memory figure, not the placements. Writes
DIR/table.md and DIR/results.json, and each run's log.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from _common import REPO, cpu_model, fsdp_train, git_commit, load_json, run_env, run_process, utc_now, write_json, \
    write_text

PLACEMENTS = {
    "none": ["--fsdp_config.offload_params=false", "--fsdp_config.offload_optimizer_state=false"],
    "params, state on device": ["--fsdp_config.offload_params=true", "--fsdp_config.offload_optimizer_state=false"],
    "full": ["--fsdp_config.offload_params=true", "--fsdp_config.offload_optimizer_state=true"],
}
MIB = 1024.0 * 1024.0


def common_args(a) -> list[str]:
    return [os.path.join(REPO, "configs", f"{a.preset}.yaml"), f"--model.preset={a.preset}",
            f"--fsdp_config.device={a.device}", f"--training.steps={a.steps}", "--training.resume=never",
            "--training.export=none", "--fsdp_config.checkpoint_interval=0", "--logging.progress=off",
            "--data.source=synthetic", "--fsdp_config.world_size=1"]


def planned(a, placement: list[str]) -> dict:
    """The plan's device and host peaks for rank 0 (bytes)."""
    cmd = [fsdp_train(a.build_dir), "plan", *common_args(a), *placement, "--world", "1", "--json"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        sys.exit(f"offload_placements: {' '.join(cmd)} failed:\n{r.stdout}{r.stderr}")
    rank = json.loads(r.stdout)["ranks"][0]
    return {"device_peak": rank["peak_tensor_bytes"], "host_peak": rank.get("host_peak_tensor_bytes")}


def measured(a, name: str, placement: list[str]) -> dict:
    summary = os.path.join(a.out, f"{name}.json")
    cmd = [fsdp_train(a.build_dir), *common_args(a), *placement, f"--logging.summary_json={summary}",
           f"--logging.summary_warmup={a.warmup}"]
    status, _, wall = run_process(cmd, run_env(1), os.path.join(a.out, f"{name}.log"), a.timeout, REPO)
    if status != "ok":
        return {"status": status}
    s = load_json(summary)
    return {"status": "ok", "median_step_s": s["median_step_s"], "device_peak_mib": s["peak_tensor_mib_per_rank"][0],
            "final_loss": s["losses"][-1] if s["losses"] else None, "wall_s": wall}


def table(a, rows: dict) -> str:
    device = "GPU" if a.device == "cuda" else "device (= host)"
    lines = [f"# Offload placements, {a.preset}, one rank, device {a.device}", "",
             f"{utc_now()}, commit {git_commit()}, CPU {cpu_model()}; {a.steps} steps, medians after {a.warmup}.", "",
             f"| placement | planned {device} peak MiB | measured {device} peak MiB | planned host peak MiB "
             "| median step s | final loss |", "|---|---|---|---|---|---|"]
    for name, r in rows.items():
        p, m = r["plan"], r["run"]
        host = "–" if p["host_peak"] is None else f"{p['host_peak'] / MIB:.1f}"
        if m["status"] != "ok":
            lines.append(f"| {name} | {p['device_peak'] / MIB:.1f} | {m['status']} | {host} | – | – |")
            continue
        lines.append(f"| {name} | {p['device_peak'] / MIB:.1f} | {m['device_peak_mib']:.1f} | {host} | "
                     f"{m['median_step_s']:.4f} | {m['final_loss']:.6f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--build-dir", default=os.path.join(REPO, "build"))
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    p.add_argument("--preset", default="small")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    rows = {}
    for i, (name, placement) in enumerate(PLACEMENTS.items()):
        rows[name] = {"plan": planned(a, placement), "run": measured(a, f"placement_{i}", placement)}
        print(f"[{name}] plan {rows[name]['plan']} run {rows[name]['run']}", flush=True)
    write_json(os.path.join(a.out, "results.json"), {"device": a.device, "preset": a.preset, "rows": rows})
    text = table(a, rows)
    write_text(os.path.join(a.out, "table.md"), text)
    print(text)


if __name__ == "__main__":
    main()
