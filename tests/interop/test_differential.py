"""Differential tests: fsdp-train against PyTorch's FSDP2, row by row (tests/interop/rows.py).

Each row trains one configuration twice from the same starting weights on the same global
batches: fsdp-train under fsdprun, and tests/interop/fsdp2_train.py (PyTorch's fully_shard, DDP
or parallelize_module) under torch.multiprocessing. It compares the per-step losses and the
final full parameters, then runs the reference again with the row's planted error and checks
that the comparison now fails: a row that cannot fail proves nothing.

    FSDP_BUILD_DIR=build $FSDP_PYTHON -m pytest tests/interop/test_differential.py -k full_shard_w2

ctest runs one row per test (tests/CMakeLists.txt: interop.<row>). FSDP_INTEROP_KEEP=DIR keeps
every run's files under DIR/<row>.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest
import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
sys.path.insert(0, os.path.abspath(os.path.join(_HERE, "..", "..", "bench", "peer")))

from rows import ROWS  # noqa: E402

BASE = os.path.join(_HERE, "base.yaml")
STEPS = 5

# What is compared each step: the loss, and the gradient norm before clipping. AdamW divides
# each gradient element by its own running magnitude, so a gradient wrong by a constant factor
# (a wrong divide factor) leaves the parameters almost unchanged: the norm is what sees it.
#
# fp32: both sides run the same float32 arithmetic in a different order (FSDP2's flat buffers
# and collectives, fsdp-cpp's), so only rounding separates them: losses and gradient norms
# within 1e-5 relative, parameters within 1e-5 after the 5 steps.
FP32 = dict(loss_rtol=1e-5, norm_rtol=1e-5, param_atol=1e-5)
# bf16 (unit roundoff u = 2^-8): both round the same tensors to bfloat16, but where the float32
# sums before a rounding differ in their last bits (another order of the same ops: the C++
# model's attention and loss are written separately from model.py's) the bf16 value may land
# one rounding apart. The loss is a mean over many such values and the gradient norm a sum,
# so both stay within a fraction of u: u / 2 relative (measured: at most 3.2e-4 for the loss,
# 7.2e-4 for the norm, on a CPU with avx512_bf16; other CPUs take other bf16 kernels, so the
# margin is kept at over 2x). A single parameter is not averaged: an element whose gradient is near zero can
# change sign under one rounding, and AdamW then moves it by up to lr the other way, so the only
# bound on a parameter is the distance AdamW can move it, 2 * STEPS * lr (measured: 4.5e-3, the
# same size as the distance between a bf16 and an fp32 run). The bf16 rows therefore catch
# wrong gradients through the norm and the loss, and parameters only when grossly wrong.
BF16_U = 2.0 ** -8
BF16 = dict(loss_rtol=BF16_U / 2, norm_rtol=BF16_U / 2, param_atol=2 * STEPS * 2e-3)

# fp64 (a model converted with to(float64) after fully_shard): parameters, optimizer and
# gradients in float64 on both sides; the loss is cross-entropy of the logits cast to float32
# (.float() on both sides), so losses and gradient norms stay within fp32's 1e-5, while the
# parameters after 5 steps must agree to 1e-10, which a float32 run misses by far (measured:
# 2.8e-16 between the two float64 runs, 5.8e-7 against the float32 one of the plant keep-float32).
FP64 = dict(loss_rtol=1e-5, norm_rtol=1e-5, param_atol=1e-10)

TOLERANCES = {"fp32": FP32, "bf16": BF16, "fp64": FP64}


def build_dir(driver: str | None = None) -> str:
    path = os.environ.get("FSDP_BUILD_DIR", os.path.join(_HERE, "..", "..", "build"))
    for tool in ("tools/fsdprun/fsdprun", f"tests/interop/{driver}" if driver else "tools/fsdp-train/fsdp-train"):
        if not os.access(os.path.join(path, tool), os.X_OK):
            pytest.fail(f"{os.path.join(path, tool)} is missing: build the project first (scripts/build.sh) "
                        "or set FSDP_BUILD_DIR to the build directory")
    return path


def environment() -> dict:
    env = dict(os.environ)
    # One thread per rank on both sides: the same per-op reduction order, and no oversubscription.
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return env


def write_initial_weights(path: str) -> None:
    """The starting weights both sides load (model.init_from): base.yaml's model, seed 0."""
    import yaml
    from model import Transformer, make_args
    with open(BASE) as f:
        model_cfg = yaml.safe_load(f)["model"]
    fields = {k: v for k, v in model_cfg.items() if k != "preset"}
    torch.manual_seed(0)
    model = Transformer(make_args(model_cfg["preset"], **fields))
    torch.save({k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}, path)


def run(cmd: list[str], log: str, retry_if_killed: bool = False) -> None:
    """Runs `cmd`, its output into `log`; fails the test when it exits non-zero. With
    retry_if_killed (the PyTorch reference only, never fsdp-train), a run whose worker process
    died by a signal is run once more: PyTorch's gloo teardown on torch 2.15 aborted a worker
    once in about a hundred runs here ("terminate called without an active exception"), which
    says nothing about the numbers compared. The first run's output is kept beside the log."""
    with open(log, "w") as out:
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=environment(), timeout=300)
    if proc.returncode != 0 and retry_if_killed:
        with open(log) as f:
            text = f.read()
        if "terminated with signal" in text:
            os.replace(log, log + ".killed")
            print(f"note: {cmd[1]} lost a worker to a signal; running it again (first output: {log}.killed)")
            with open(log, "w") as out:
                proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=environment(), timeout=300)
    if proc.returncode != 0:
        with open(log) as f:
            tail = f.read()[-4000:]
        pytest.fail(f"{' '.join(cmd)} exited with {proc.returncode}:\n{tail}")


class Run:
    """One side's per-step losses and gradient norms, and its final full parameters."""

    def __init__(self, losses: list[float], norms: list[float], params: dict):
        self.losses, self.norms, self.params = losses, norms, params


def run_ours(row: dict, workdir: str, init: str) -> Run:
    """fsdp-train, or the row's driver (rows.py), which takes fsdp-train's arguments."""
    build = build_dir(row.get("driver"))
    out = os.path.join(workdir, "ours")
    os.makedirs(out, exist_ok=True)
    program = f"tests/interop/{row['driver']}" if row.get("driver") else "tools/fsdp-train/fsdp-train"
    cmd = [os.path.join(build, "tools/fsdprun/fsdprun"), "--standalone", "--nproc-per-node", str(row["world"]),
           os.path.join(build, program), BASE, *row["overrides"],
           f"--model.init_from={init}", f"--training.steps={STEPS}", "--training.resume=never",
           f"--fsdp_config.checkpoint_dir={os.path.join(out, 'checkpoints')}",
           f"--logging.summary_json={os.path.join(out, 'summary.json')}",
           f"--logging.jsonl={os.path.join(out, 'm{rank}.jsonl')}",
           f"--training.export={os.path.join(out, 'params.pt')}"]
    run(cmd, os.path.join(out, "log.txt"))
    with open(os.path.join(out, "summary.json")) as f:
        losses = json.load(f)["losses"]
    with open(os.path.join(out, "m0.jsonl")) as f:
        norms = [json.loads(line)["grad_norm"] for line in f if line.strip()]
    return Run(losses, norms, torch.load(os.path.join(out, "params.pt"), weights_only=True))


def run_reference(row: dict, workdir: str, init: str, plant: str | None = None) -> Run:
    out = os.path.join(workdir, "reference" + (f"-{plant}" if plant else ""))
    cmd = [sys.executable, os.path.join(_HERE, "fsdp2_train.py"), BASE, "--world", str(row["world"]),
           "--out", out, *row["overrides"], f"--model.init_from={init}", f"--training.steps={STEPS}"]
    if plant:
        cmd += ["--plant", plant]
    os.makedirs(out, exist_ok=True)
    run(cmd, os.path.join(out, "log.txt"), retry_if_killed=True)
    with open(os.path.join(out, "result.json")) as f:
        result = json.load(f)
    return Run(result["losses"], result["grad_norms"], torch.load(os.path.join(out, "params.pt"), weights_only=True))


def series_differences(what: str, ours: list[float], reference: list[float], rtol: float) -> list[str]:
    if len(ours) != len(reference):
        return [f"{len(ours)} values of the {what} against the reference's {len(reference)}"]
    found = []
    for step, (a, b) in enumerate(zip(ours, reference), start=1):
        if abs(a - b) > rtol * abs(b):
            relative = f"relative {abs(a - b) / abs(b):.3g}" if b != 0 else "the reference is 0"
            found.append(f"step {step}: {what} {a:.9g} against {b:.9g} ({relative}; tolerance {rtol:.3g} relative)")
    return found


def differences(ours: Run, reference: Run, tolerance: str) -> list[str]:
    """What differs beyond the row's tolerance, as lines; empty when the runs agree."""
    tol = TOLERANCES[tolerance]
    found = series_differences("loss", ours.losses, reference.losses, tol["loss_rtol"])
    found += series_differences("gradient norm", ours.norms, reference.norms, tol["norm_rtol"])
    our_params, ref_params, param_atol = ours.params, reference.params, tol["param_atol"]
    if set(our_params) != set(ref_params):
        found.append(f"parameter names differ: {sorted(set(our_params) ^ set(ref_params))}")
        return found
    for name in sorted(ref_params):
        a, b = our_params[name].double(), ref_params[name].double()  # exact for every dtype compared
        if a.shape != b.shape:
            found.append(f"{name}: shape {tuple(a.shape)} against {tuple(b.shape)}")
            continue
        worst = (a - b).abs().max().item()
        if worst > param_atol:
            found.append(f"{name}: max |difference| {worst:.3g} > {param_atol:.3g}")
    return found


@pytest.fixture
def workdir(request):
    keep = os.environ.get("FSDP_INTEROP_KEEP")
    if keep:
        callspec = getattr(request.node, "callspec", None)
        path = os.path.join(keep, callspec.id if callspec else request.node.name)
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path)
        yield path
        return
    path = tempfile.mkdtemp(prefix="fsdp-interop-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("name", sorted(ROWS))
def test_row(name: str, workdir: str):
    row = ROWS[name]
    init = os.path.join(workdir, "init.pt")
    write_initial_weights(init)
    ours = run_ours(row, workdir, init)
    reference = run_reference(row, workdir, init)
    found = differences(ours, reference, row["tolerance"])
    assert not found, f"{name}: fsdp-train and PyTorch's FSDP2 differ ({row['reference']}):\n  " + "\n  ".join(found)
    planted = run_reference(row, workdir, init, plant=row["plant"])
    assert differences(ours, planted, row["tolerance"]), (
        f"{name}: the reference with the planted error '{row['plant']}' still agrees with fsdp-train, so this row "
        "could not catch that error")
