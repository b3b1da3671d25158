"""A run that moves C++ → Python → C++ through PyTorch Distributed Checkpoints, at three world
sizes, against the same run uninterrupted.

1. fsdp-train trains steps 1-3 at W = 2 and saves a DCP checkpoint (checkpoint_format: dcp).
2. PyTorch's FSDP2 (fsdp2_train.py) loads it at W = 3 with dcp.load, trains steps 4-6 and
   saves with dcp.save.
3. fsdp-train resumes from Python's checkpoint at W = 1 and trains steps 7-8.

The global batch is 6 rows at every world size (3, 2 and 6 rows per rank), and the LR schedule's
decay is fixed (schedule.decay_steps), so every step trains what the uninterrupted W = 2 run
trains: each hand-over's losses and gradient norms must equal that run's within the fp32
tolerance of the differential rows (1e-5 relative). The optimizer state, step count and LR
schedule carry over, or the steps after a hand-over would not match.

    FSDP_BUILD_DIR=build $FSDP_PYTHON -m pytest tests/interop/test_dcp_round_trip.py
"""

from __future__ import annotations

import json
import os
import sys

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)

from test_differential import BASE, FP32, build_dir, run, workdir, write_initial_weights  # noqa: E402,F401

STEPS = 8
COMMON = ["--schedule.decay_steps=10", "--training.resume=never"]


def fsdp_train(workdir: str, name: str, world: int, steps: int, args: list[str]) -> dict[int, tuple[float, float]]:
    """Runs fsdp-train; returns step -> (loss, gradient norm) of the steps it trained."""
    build = build_dir()
    out = os.path.join(workdir, name)
    os.makedirs(out, exist_ok=True)
    cmd = [os.path.join(build, "tools/fsdprun/fsdprun"), "--standalone", "--nproc-per-node", str(world),
           os.path.join(build, "tools/fsdp-train/fsdp-train"), BASE, *COMMON,
           f"--training.micro_batch_size={6 // world}", f"--training.steps={steps}",
           f"--logging.jsonl={os.path.join(out, 'm{rank}.jsonl')}", "--training.export=none", *args]
    run(cmd, os.path.join(out, "log.txt"))
    metrics = {}
    with open(os.path.join(out, "m0.jsonl")) as f:
        for line in f:
            if line.strip():
                m = json.loads(line)
                metrics[m["step"]] = (m["loss"], m["grad_norm"])
    return metrics


def fsdp2(workdir: str, init: str, resume: str, save: str) -> dict[int, tuple[float, float]]:
    """Runs PyTorch's FSDP2 at W = 3 from `resume` to step 6; returns step -> (loss, norm)."""
    out = os.path.join(workdir, "python")
    os.makedirs(out, exist_ok=True)
    cmd = [sys.executable, os.path.join(_HERE, "fsdp2_train.py"), BASE, "--world", "3", "--out", out,
           *COMMON, "--training.micro_batch_size=2", "--training.steps=6", f"--model.init_from={init}",
           "--resume-dcp", resume, "--save-dcp", save]
    run(cmd, os.path.join(out, "log.txt"), retry_if_killed=True)
    with open(os.path.join(out, "result.json")) as f:
        result = json.load(f)
    first = result["first_step"]
    return {first + i: (loss, norm) for i, (loss, norm) in enumerate(zip(result["losses"], result["grad_norms"]))}


def expect_same(what: str, got: dict, want: dict, steps: range) -> list[str]:
    found = []
    if sorted(got) != list(steps):
        return [f"{what}: trained steps {sorted(got)}, expected {list(steps)}"]
    for step in steps:
        for i, quantity in enumerate(("loss", "gradient norm")):
            a, b = got[step][i], want[step][i]
            if abs(a - b) > FP32["loss_rtol"] * abs(b):
                found.append(f"{what}, step {step}: {quantity} {a:.9g} against {b:.9g} uninterrupted")
    return found


def test_cpp_python_cpp(workdir: str):
    init = os.path.join(workdir, "init.pt")
    write_initial_weights(init)
    start = [f"--model.init_from={init}"]
    uninterrupted = fsdp_train(workdir, "uninterrupted", 2, STEPS,
                               start + [f"--fsdp_config.checkpoint_dir={os.path.join(workdir, 'unused')}"])
    cpp_dir = os.path.join(workdir, "cpp-checkpoints")
    first = fsdp_train(workdir, "cpp-w2", 2, 3, start + ["--fsdp_config.checkpoint_format=dcp",
                                                         "--fsdp_config.checkpoint_interval=3",
                                                         f"--fsdp_config.checkpoint_dir={cpp_dir}"])
    cpp_checkpoint = os.path.join(cpp_dir, "step_3")
    assert os.path.isfile(os.path.join(cpp_checkpoint, ".metadata")), f"fsdp-train wrote no DCP at {cpp_checkpoint}"
    python_checkpoint = os.path.join(workdir, "python-checkpoint")
    second = fsdp2(workdir, init, cpp_checkpoint, python_checkpoint)
    third = fsdp_train(workdir, "cpp-w1", 1, STEPS,
                       [f"--training.resume={python_checkpoint}",
                        f"--fsdp_config.checkpoint_dir={os.path.join(workdir, 'cpp-w1-checkpoints')}"])
    found = expect_same("fsdp-train W=2", first, uninterrupted, range(1, 4))
    found += expect_same("PyTorch FSDP2 W=3 after fsdp-train's checkpoint", second, uninterrupted, range(4, 7))
    found += expect_same("fsdp-train W=1 after PyTorch's checkpoint", third, uninterrupted, range(7, STEPS + 1))
    assert not found, "the round trip differs from the uninterrupted run:\n  " + "\n  ".join(found)
