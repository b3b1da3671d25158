"""What the bench/*.py scripts share, so that each script holds only its own experiment.

- where things are: REPO, PY (the Python with torch that runs the peer and the Python-side
  measurements), fsdprun() and fsdp_train() in a build, MPIRUN and its variants, MODEL (the
  presets' dimensions);
- the machine and the source: utc_now(), cpu_model(), cores(), load_average(), git_commit(),
  blas_libs(), wait_for_quiet();
- running: sh() (a short command's output), threads_for() / run_env() (one rank's threads),
  run_process() (a timed run with a log, killed as a group on timeout), run_jsonl() (a run whose
  per-step metrics are read back), alternate() and run_alternating() (the A/B loop: every
  configuration once per pair, pair after pair);
- results: load_json(), write_json(), write_text(), sha256();
- statistics and table cells: med(), fmt(), pct(), mib().

Only the standard library, so any python3 imports it. The scripts import it by name (their own
directory is first on sys.path when they run).
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The Python with torch 2.15 (scripts/torch-env.sh exports FSDP_PYTHON).
PY = os.environ.get("FSDP_PYTHON") or os.path.expanduser("~/.cache/fsdp-cpp/venv-torch-2.15.0/bin/python")

# mpirun's options for one machine: --oversubscribe (ranks may outnumber cores) and --bind-to none
# (a rank's compute and communication threads must not share one pinned core).
MPIRUN = ["mpirun", "--oversubscribe", "--bind-to", "none"]
# Two-copy shared memory: what a container that forbids cross-memory attach gets.
TWO_COPY = ["--mca", "btl_vader_single_copy_mechanism", "none"]
# As the planner's measurements run the trainer: two-copy, one thread per rank, OpenBLAS's core type passed on.
MPIRUN_ONE_THREAD = MPIRUN + TWO_COPY + ["-x", "OMP_NUM_THREADS=1", "-x", "OPENBLAS_NUM_THREADS=1",
                                         "-x", "OPENBLAS_CORETYPE"]
# OpenMPI refuses to run as root without both.
MPI_AS_ROOT = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}

# The presets' model dimensions (fsdp::models::ModelArgs::preset = bench/peer/model.py PRESETS).
MODEL = {
    "tiny": dict(n_layers=2, dim=16, n_heads=4, vocab_size=8),
    "small": dict(n_layers=4, dim=256, n_heads=8, vocab_size=8192),
    "medium": dict(n_layers=8, dim=768, n_heads=12, vocab_size=32000),
}


def fsdprun(build_dir: str, world: int) -> list[str]:
    """The launcher's command for `world` ranks on this machine; the program follows it."""
    return [os.path.join(build_dir, "tools", "fsdprun", "fsdprun"), "--standalone", "--nproc-per-node", str(world)]


def fsdp_train(build_dir: str) -> str:
    return os.path.join(build_dir, "tools", "fsdp-train", "fsdp-train")


LLAMA_YAML = os.path.join(REPO, "bench", "peer", "llama.yaml")


def llama_train_args(*, init: str, micro_batch: int, accumulation: int, seq: int, steps: int, lr: float,
                     seed: int, data_seed: int, data_path: str | None, checkpoint_dir: str, summary_json: str,
                     jsonl: str, log_interval: int) -> list[str]:
    """fsdp-train's arguments for the Llama that the benchmarks train against a peer or a baseline:
    bench/peer/llama.yaml from a Hugging Face directory, Adam (AdamW with weight decay 0) at a
    constant lr, no clipping, no checkpoints, no export; byte tokens from data_path, else synthetic
    batches. The layout and the options under test follow."""
    data = ["--data.source=tokens", f"--data.path={data_path}"] if data_path else ["--data.source=synthetic"]
    return [LLAMA_YAML, f"--model.init_from={init}", f"--training.micro_batch_size={micro_batch}",
            f"--training.gradient_accumulation_steps={accumulation}", f"--training.seq_len={seq}",
            f"--training.steps={steps}", "--training.max_grad_norm=0", f"--training.seed={seed}",
            "--training.resume=never", "--training.export=none", f"--optimizer.lr={lr}",
            "--optimizer.weight_decay=0", "--optimizer.betas=[0.9,0.999]", "--optimizer.eps=1e-8",
            "--schedule.warmup_steps=0", f"--schedule.min_lr={lr}", *data, f"--data.data_seed={data_seed}",
            "--fsdp_config.checkpoint_interval=0", f"--fsdp_config.checkpoint_dir={checkpoint_dir}",
            "--logging.progress=off", f"--logging.log_interval={log_interval}",
            f"--logging.summary_json={summary_json}", f"--logging.jsonl={jsonl}"]


# --------------------------------------------------------------------------- machine and source

def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def sh(cmd: list[str]) -> str:
    """A short command's stdout, stripped; "" when it cannot run."""
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        return r.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def cpu_model(unknown: str = "unknown") -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return unknown


def cores() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0))


def load_average() -> list[str]:
    """The 1, 5 and 15 minute load averages, as /proc/loadavg writes them."""
    with open("/proc/loadavg") as fh:
        return fh.read().split()[:3]


def git_commit(src: str = REPO, dirty: bool = False) -> str:
    """The short commit of the checkout at src ("" outside one); with dirty, "-dirty" is added
    when tracked files have changes, and "?" stands for no commit."""
    git = sh(["git", "-C", src, "rev-parse", "--short", "HEAD"])
    if not dirty:
        return git
    changed = sh(["git", "-C", src, "status", "--porcelain", "--untracked-files=no"])
    return (git + ("-dirty" if changed else "")) if git else "?"


def blas_libs(binary: str) -> list[str]:
    """BLAS/LAPACK libraries the dynamic linker resolves for a binary or .so."""
    if not binary or not os.path.exists(binary):
        return []
    out = sh(["ldd", binary])
    libs = []
    for line in out.splitlines():
        name = line.strip().split(" ", 1)[0]
        if any(k in name for k in ("blas", "lapack", "mkl", "blis")):
            parts = line.split("=>")
            target = parts[1].strip().split(" (")[0] if len(parts) > 1 else name
            libs.append(f"{name} -> {os.path.realpath(target) if os.path.exists(target) else target}")
    return libs


def wait_for_quiet(limit_s: float) -> bool:
    """Waits (up to limit_s) until no other process is running for 3 s in a row: builds and tests
    at idle priority still slow multi-threaded timings down. Returns whether it got there."""
    deadline, quiet_since = time.time() + limit_s, None
    while time.time() < deadline:
        with open("/proc/loadavg") as f:
            running = int(f.read().split()[3].split("/")[0])
        now = time.time()
        quiet_since = (quiet_since or now) if running <= 1 else None
        if quiet_since and now - quiet_since >= 3:
            return True
        time.sleep(0.5)
    return False


# --------------------------------------------------------------------------- running

def threads_for(world: int) -> int:
    return max(1, cores() // world)


def run_env(world: int) -> dict:
    """Identical environment for every program of a comparison: the cores shared out among the
    ranks (OMP_NUM_THREADS, OPENBLAS_NUM_THREADS); OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE are kept."""
    env = dict(os.environ)
    t = str(threads_for(world))
    env["OMP_NUM_THREADS"] = t
    env["OPENBLAS_NUM_THREADS"] = t
    return env


def run_process(cmd: list[str], env: dict, log_path: str, timeout_s: float, cwd: str) -> tuple[str, int | None, float]:
    """Runs cmd in its own session; returns (status, rc, wall_s). status: ok | failed | timeout."""
    t0 = time.time()
    with open(log_path, "w") as log:
        log.write(f"# {utc_now()}\n# {shlex.join(cmd)}\n")
        log.flush()
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            return "timeout", None, time.time() - t0
        except BaseException:  # Ctrl-C: take the whole process group down with us
            _kill_group(proc)
            raise
    return ("ok" if rc == 0 else "failed"), rc, time.time() - t0


def _kill_group(proc: subprocess.Popen) -> None:
    for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def run_jsonl(name: str, cmd: list[str], log_path: str, jsonl: str) -> list[dict]:
    """Runs a trainer command that writes its per-step metrics to jsonl (logging.jsonl), its
    output to log_path; returns the metrics' rows, or exits naming the log when the run fails.
    A jsonl left by an earlier run is removed first, so its rows are never taken for this run's."""
    if os.path.exists(jsonl):
        os.remove(jsonl)
    print("+", " ".join(cmd), flush=True)
    with open(log_path, "w") as log:
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    if rc != 0:
        sys.exit(f"{name}: fsdp-train exited {rc}; see {log_path}")
    with open(jsonl) as f:
        return [json.loads(line) for line in f if line.strip()]


def alternate(pairs: int, configs):
    """(pair, config) in the order an A/B comparison runs them: every configuration once in each
    pair, pair 1 first, so that a drift of the machine falls on all of them alike."""
    return [(k, c) for k in range(1, pairs + 1) for c in configs]


def run_alternating(pairs: int, configs, name_of, command_of, out: str, env: dict, timeout_s: float,
                    ckpt_prefix: str) -> None:
    """Runs command_of(config, json_out, ckpt_dir) for every (pair, config) of alternate(), each
    with a checkpoint directory of its own that is removed after it, writing <out>/<name>.log
    (name = name_of(config, pair)); the program writes <out>/<name>.json itself."""
    for k, c in alternate(pairs, configs):
        name = name_of(c, k)
        with tempfile.TemporaryDirectory(prefix=ckpt_prefix) as ckpt:
            cmd = command_of(c, os.path.join(out, name + ".json"), ckpt)
            print(f"[run] {name}: {shlex.join(cmd)}", flush=True)
            status, rc, wall = run_process(cmd, env, os.path.join(out, name + ".log"), timeout_s, REPO)
        print(f"[run] {name}: {status} rc={rc} in {wall:.0f}s", flush=True)


# --------------------------------------------------------------------------- result files

def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def load_json(path: str):
    """One JSON object; tolerates a JSON-lines file by taking the last non-empty line."""
    with open(path) as fh:
        text = fh.read()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        lines = [x for x in text.splitlines() if x.strip()]
        return json.loads(lines[-1]) if lines else None


def write_json(path: str, obj) -> None:
    """Written whole or not at all (a temporary file, then renamed), so an interrupted run leaves
    no half file that a resumed one would take for a result."""
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(obj, fh, indent=1)
        fh.write("\n")
    os.replace(tmp, path)


def write_text(path: str, text: str) -> None:
    with open(path, "w") as fh:
        fh.write(text)


# --------------------------------------------------------------------------- statistics, table cells

def med(xs):
    """The median of the known values (None when there are none)."""
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def fmt(x, spec: str, missing: str = "–") -> str:
    return missing if x is None else format(x, spec)


def pct(x) -> str:
    """A fraction as a percentage with 2 significant digits ("–" when unknown)."""
    if x is None:
        return "–"
    return f"{100 * x:.0f} %" if 100 * x >= 10 else f"{100 * x:.2g} %"


def mib(x: float) -> str:
    """Bytes as MiB with two decimals."""
    return f"{x / 2**20:.2f}"
