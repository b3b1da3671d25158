#!/usr/bin/env python3
"""A/B benchmark: fsdp-train (ours) against PyTorch FSDP2 (the peer, fully_shard on torch 2.15).

For every (preset, world size) cell the two programs run alternately,
ours then peer, --pairs times (A B A B A B). Both use the same preset,
per-rank batch, sequence length, steps, world size, data, optimizer math
(Adam, lr 1e-3, no clipping, constant LR, dropout 0) and the same starting
weights. The script writes every raw JSON to --out and prints a markdown table,
also saved as <out>/table.md. The peer is bench/peer/peer_fsdp2.py (--peer-dir).

    python3 bench/peer_ab.py                                  # tiny,small x W=1,2 x 3 pairs
    python3 bench/peer_ab.py --presets small --worlds 2 --pairs 5
    python3 bench/peer_ab.py --only peer --presets tiny --pairs 1 --steps 6
    python3 bench/peer_ab.py --out bench/results/peer_ab/DIR --report-only
    python3 bench/peer_ab.py --dry-run                        # print the commands only
    python3 bench/peer_ab.py --presets small --worlds 2 --baseline-build-dir ../old/build

    python3 bench/peer_ab.py --presets small,medium --worlds 1,2 --dtypes fp32,bf16
    python3 bench/peer_ab.py --strategy ddp --presets tiny,small --worlds 2   # vs PyTorch DDP
    python3 bench/peer_ab.py --backends gloo,mpi --presets tiny,small --worlds 2
    python3 bench/peer_ab.py --presets llama_small --worlds 2 --dtypes fp32,bf16 --no-matmul   # Llama
    python3 bench/peer_ab.py --presets gpt2_small --worlds 2 --no-matmul                        # GPT-2

The Llama family (--presets llama_small): the peer is transformers' LlamaForCausalLM under
fully_shard (per decoder layer and root), ours fsdp-train with model.init_from of the same
Hugging Face directory; targets at W = 2: 0.85x the peer's step time, 0.7x its peak RSS.
GPT-2 (--presets gpt2_small) the same way: transformers' GPT2LMHeadModel under fully_shard (per
block and root) against fsdp-train with bench/peer/gpt2.yaml; no target yet (measured, not judged).

Backends (--backends gloo,mpi; default gloo). Ours runs once per backend in every pair, gloo
first: under fsdprun for gloo, under `mpirun -np W` (MPIRUN below) with
--fsdp_config.backend=mpi for mpi; the peer is unchanged (FSDP2 on c10d's gloo). Every table
gets a row per backend; run names of mpi runs have side "ours_mpi". The step-time targets on
mpi are those of the MPI backend's issue: tiny 0.25x, small 0.35x the peer's.

Data parallelism (--strategy ddp): ours runs sharding_strategy NO_SHARD (fsdp::replicate, DDP's
bucketed gradient all-reduce), the peer runs torch's DistributedDataParallel (--mode ddp); the
targets are then 0.9x the peer's step time on tiny and small, and 0.8x its peak RSS per rank.

Hybrid sharding (--strategy hsdp, even world sizes): ours runs sharding_strategy HYBRID_SHARD
with replicate_degree 2 (W/2 ranks shard, 2 replicas all-reduce), the peer runs FSDP2's
fully_shard on a 2-D (replicate 2, shard W/2) mesh (--mode hsdp); the targets are fsdp's.

Targets (--strategy fsdp, the default; judged at W = 2): ours/peer median step time <= 0.5 on
tiny, <= 0.6 on small (and <= 0.8 on medium); ours/peer peak RSS per rank <= 0.8; max |Δloss|
<= 1e-5 in fp32. The peer runs FSDP2's fully_shard on every world size, W = 1 included (a real
1-rank mesh: the sharding code runs, the collectives move nothing).

Mixed precision (--dtypes fp32,bf16; default fp32 only). Each pair then runs, in this order:
ours fp32, ours bf16, peer fp32, peer bf16. Ours bf16 = fsdp-train with
--fsdp_config.mixed_precision=true (param bf16, reduce fp32, fp32 master weights); peer bf16 =
peer_fsdp2.py --mixed-precision bf16 (FSDP2's MixedPrecisionPolicy(param_dtype=bfloat16,
reduce_dtype=float32)). The fp32 table, its targets and Δloss are as
without --dtypes; a second table gives tokens/s ratios within each pair (ours bf16 / ours fp32,
peer bf16 / peer fp32, ours bf16 / peer bf16), peak RSS per rank per dtype, and the largest
loss difference of ours bf16 against ours fp32 and against peer bf16 (no target: bf16 rounds).
Run names of bf16 runs end in _bf16; fp32 runs keep the names they had before.

Matmul fraction and MFU (both estimates). At the start of a run the script runs
<build-dir>/bench/bench_matmul --json once per thread count a rank uses (OMP_NUM_THREADS =
OPENBLAS_NUM_THREADS = cores / W) at the products of each preset's model (shapes below) and at
2048^3, for each dtype, and records the GFLOP/s in meta.json (raw: matmul_t<T>.json). From the
model in src/models/transformer/transformer.cpp (= bench/peer/model.py; the Llama presets have no such
count here, so no matmul fraction or MFU), per rank and step, with B the
per-rank batch, T the sequence length, M = B*T, d = dim, h = n_heads, d/h = head_dim, L = n_layers,
V = vocab_size, the forward matmuls are
    per block: wq, wk, wv, wo          4 x (M x d) @ (d x d)
               feed_forward w1, w2     (M x d) @ (d x 4d), (M x 4d) @ (4d x d)
               scores = Q K^T          B*h x (T x d/h) @ (d/h x T)     (causal mask applied after:
               out = P V               B*h x (T x T) @ (T x d/h)        the full T x T is computed)
    once:      output head             (M x d) @ (d x V)
    FLOP_fwd  = L * (24 M d^2 + 4 B T^2 d) + 2 M d V
    FLOP_step = 3 * FLOP_fwd   (backward: the gradient of each matmul's two inputs, two matmuls
                                of the same size; embeddings, norms, softmax, GELU, the loss and
                                Adam are not counted)
and the derived columns are
    matmul fraction = (sum over those products of 3 * count * FLOP / bench_matmul's GFLOP/s at
                       that product's shape) / step time
                    = "the time the matmuls would take at bench_matmul's rate / step time",
                      an estimate: bench_matmul times (A @ B) with both operands contiguous, in
                      one process before the runs, while the step also runs the transposed
                      variants (x W^T forward, W^T and x^T products backward), and at W = 2 the
                      other rank runs on the other core at the same time;
    MFU             = FLOP_step / step time / peak, peak = the best GFLOP/s bench_matmul measured
                      for that dtype at the rank's thread count (over all its shapes);
bf16 runs use the bf16 rates, fp32 runs the fp32 rates. --no-matmul skips the measurement.

With --baseline-build-dir every pair becomes a triple: the baseline build of fsdp-train
("base"), then ours, then the peer, and the table adds ours/base ratios: how a change of
fsdp-cpp moved its step time and memory, measured in the same alternating run.

Runs already stored in --out with the same settings and a good result are not
repeated, so an interrupted benchmark resumes when given the same --out
(--force reruns them). Only the standard library is needed, so any python3 runs this script;
the peer runs under $FSDP_PYTHON (set by scripts/torch-env.sh; default
~/.cache/fsdp-cpp/venv-torch-2.15.0/bin/python, the venv with torch 2.15.0).

Files in --out:
  meta.json                          settings, machine, BLAS, versions
  init_<preset>.pt                   starting weights (peer --save-init); init_<llama preset>/: a
                                     Hugging Face directory (peer --hf-config --save-init)
  <preset>_w<W>_p<k>_<side>[_bf16].json     the program's raw JSON (side = base | ours | peer)
  <preset>_w<W>_p<k>_<side>[_bf16].run.json command, environment, exit code, wall time, status
  <preset>_w<W>_p<k>_<side>[_bf16].log      stdout + stderr
  matmul_t<T>.json, matmul_t<T>.log  bench_matmul's JSON and output at T threads
  table.md                           the report
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from _common import (MODEL, MPI_AS_ROOT, MPIRUN, PY, REPO, blas_libs, cores, cpu_model, fmt, fsdp_train,
                     fsdprun, git_commit, load_json, med, pct, run_env, run_process, sh, sha256,
                     threads_for, utc_now, write_json)

PEER_SCRIPT = "peer_fsdp2.py"
# Run order inside a pair: base (when given), ours once per backend in --backends (gloo first),
# then the peer. Ours on gloo keeps the side name "ours" (and the run names) it had before
# backends existed.
BACKENDS = ("gloo", "mpi")
OURS_SIDE = {"gloo": "ours", "mpi": "ours_mpi"}
# How ours starts on each backend: fsdprun (gloo) or mpirun (mpi, with _common's MPIRUN options).

# preset -> defaults. seq = the preset's max_seq_len (peer model.py PRESETS).
PRESETS = {
    "tiny": dict(batch=4, steps=30, warmup=2, seq=16, timeout=300),
    "small": dict(batch=8, steps=8, warmup=2, seq=256, timeout=1800),
    "medium": dict(batch=2, steps=4, warmup=1, seq=512, timeout=3600),
    "llama_small": dict(batch=8, steps=8, warmup=2, seq=256, timeout=1800),
    "gpt2_small": dict(batch=8, steps=8, warmup=2, seq=256, timeout=1800),
}
INIT_TIMEOUT = {"tiny": 300, "small": 600, "medium": 1800, "llama_small": 600, "gpt2_small": 600}
# The Hugging Face families: preset -> its config.json (under --peer-dir) and fsdp-train's YAML
# (under bench/peer). Both sides train the same Hugging Face directory, written once per --out by
# transformers from that config.json with the seed: ours fsdp-train with the YAML and
# --model.init_from=<dir>, the peer transformers' AutoModelForCausalLM under fully_shard
# (peer_fsdp2.py --hf-model <dir>).
HF_PRESETS = {"llama_small": (os.path.join("llama_small", "config.json"), "llama.yaml"),
              "gpt2_small": (os.path.join("gpt2_small", "config.json"), "gpt2.yaml")}

DTYPES = ("fp32", "bf16")
OURS_DTYPE_OVERRIDES = {"fp32": [], "bf16": ["--fsdp_config.mixed_precision=true"]}
PEER_DTYPE_ARGS = {"fp32": [], "bf16": ["--mixed-precision", "bf16"]}
MATMUL_TIMEOUT = 1200
MATMUL_PEAK_N = 2048  # bench_matmul also times N^3 at this N: part of the "peak" for the MFU

# The step-time, memory and loss targets; judged at W = 2 only.
TARGET_WORLD = 2
# What each side runs for --strategy, and the targets judged (ours/peer median step time per
# preset, ours/peer peak RSS per rank).
STRATEGIES = {
    "fsdp": {"ours": [], "peer_mode": "fsdp2", "peer_name": "PyTorch FSDP2",
             "step_target": {"tiny": 0.5, "small": 0.6, "medium": 0.8, "llama_small": 0.85}, "rss_target": 0.8,
             "rss_target_by_preset": {"llama_small": 0.7},
             "step_target_by_backend": {"mpi": {"tiny": 0.25, "small": 0.35}}},
    "ddp": {"ours": ["--fsdp_config.sharding_strategy=NO_SHARD"], "peer_mode": "ddp", "peer_name": "PyTorch DDP",
            "step_target": {"tiny": 0.9, "small": 0.9}, "rss_target": 0.8},
    "hsdp": {"ours": ["--fsdp_config.sharding_strategy=HYBRID_SHARD", "--fsdp_config.replicate_degree=2"],
             "peer_mode": "hsdp", "peer_name": "PyTorch FSDP2 (HSDP)",
             "step_target": {"tiny": 0.5, "small": 0.6, "medium": 0.8}, "rss_target": 0.8},
}
TARGET_LOSS_DIFF = 1e-5  # max |loss_ours - loss_peer| over all steps

LR = 1e-3
SEED = 0
DATA_SEED = 1234


ENV_KEYS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE",
            "MKL_NUM_THREADS", "GOTO_NUM_THREADS", "LD_LIBRARY_PATH", "LD_PRELOAD")


# --------------------------------------------------------------------------- commands

def is_hf(preset: str) -> bool:
    """A Hugging Face family's preset (llama_small, gpt2_small): both sides train its directory."""
    return preset in HF_PRESETS


def is_llama(preset: str) -> bool:
    return preset == "llama_small"


def peer_cmd(a, cell: dict, json_out: str, dtype: str = "fp32") -> list[str]:
    model = (["--hf-model", cell["init"]] if is_hf(cell["preset"])
             else ["--preset", cell["preset"], "--init-from", cell["init"]])
    return [PY, os.path.join(a.peer_dir, PEER_SCRIPT),
            "--mode", STRATEGIES[a.strategy]["peer_mode"], "--world", str(cell["world"]), *model,
            "--batch", str(cell["batch"]), "--seq", str(cell["seq"]), "--steps", str(cell["steps"]),
            "--warmup", str(cell["warmup"]), "--lr", "1e-3", "--seed", str(SEED),
            "--data-seed", str(DATA_SEED), "--json-out", json_out,
            *PEER_DTYPE_ARGS[dtype]]


def backends_of(meta_or_args) -> list[str]:
    if isinstance(meta_or_args, dict):
        return meta_or_args.get("backends") or ["gloo"]  # results from before --backends: gloo
    return meta_or_args.backends


def ours_sides(meta_or_args) -> tuple:
    """Our sides, one per backend: "ours" (gloo), "ours_mpi"."""
    return tuple(OURS_SIDE[b] for b in backends_of(meta_or_args))


def backend_of(side: str) -> str:
    return "mpi" if side == OURS_SIDE["mpi"] else "gloo"


def sides_of(meta_or_args) -> tuple:
    base = meta_or_args.get("baseline_build_dir") if isinstance(meta_or_args, dict) else meta_or_args.baseline_build_dir
    return (("base",) if base else ()) + ours_sides(meta_or_args) + ("peer",)


def launcher(build_dir: str, world: int, backend: str) -> list[str]:
    """The command that starts `world` ranks of fsdp-train: fsdprun for gloo, mpirun for mpi
    (fsdp-train then picks mpi itself; the run says so explicitly)."""
    if backend == "mpi":
        return [*MPIRUN, "-np", str(world), "-x", "OMP_NUM_THREADS", "-x", "OPENBLAS_NUM_THREADS"]
    return fsdprun(build_dir, world)


def ours_cmd(a, cell: dict, json_out: str, ckpt_dir: str, build_dir: str, dtype: str = "fp32",
             backend: str = "gloo") -> list[str]:
    p = cell["preset"]
    model = ([os.path.join(REPO, "bench", "peer", HF_PRESETS[p][1])] if is_hf(p)
             else [os.path.join(REPO, "configs", f"{p}.yaml"), f"--model.preset={p}", "--model.dropout_p=0"])
    return [*launcher(build_dir, cell["world"], backend),
            fsdp_train(build_dir),
            *model, f"--model.init_from={cell['init']}",
            f"--training.micro_batch_size={cell['batch']}", "--training.gradient_accumulation_steps=1",
            f"--training.seq_len={cell['seq']}", f"--training.steps={cell['steps']}",
            "--training.max_grad_norm=0", f"--training.seed={SEED}", "--training.resume=never",
            "--training.export=none",
            "--optimizer.lr=0.001", "--optimizer.weight_decay=0", "--optimizer.betas=[0.9,0.999]",
            "--optimizer.eps=1e-8",
            "--schedule.warmup_steps=0", "--schedule.min_lr=0.001",
            "--data.source=synthetic", f"--data.data_seed={DATA_SEED}",
            "--fsdp_config.checkpoint_interval=0", f"--fsdp_config.checkpoint_dir={ckpt_dir}",
            "--logging.progress=off", "--logging.log_interval=1000000",
            f"--logging.summary_json={json_out}", f"--logging.summary_warmup={cell['warmup']}",
            *OURS_DTYPE_OVERRIDES[dtype], *STRATEGIES[a.strategy]["ours"],
            *(["--fsdp_config.backend=mpi"] if backend == "mpi" else [])]


def init_cmd(a, preset: str, seq: int, path: str) -> list[str]:
    if is_hf(preset):
        return [PY, os.path.join(a.peer_dir, PEER_SCRIPT), "--hf-config",
                os.path.join(a.peer_dir, HF_PRESETS[preset][0]), "--seed", str(SEED), "--save-init", path]
    return [PY, os.path.join(a.peer_dir, PEER_SCRIPT), "--mode", "single", "--preset", preset,
            "--steps", "3", "--warmup", "2", "--batch", "1", "--seq", str(seq), "--seed", str(SEED),
            "--save-init", path]


# --------------------------------------------------------------------------- matmul rates

def matmul_products(preset: str, batch: int, seq: int) -> list[dict]:
    """The forward matmuls of one rank's training step (see the module docstring): count per
    forward, and the product as bench_matmul takes it (batch 0 = a 2-D product); none for the
    Hugging Face presets (their FLOP are not counted here)."""
    if is_hf(preset):
        return []
    m = MODEL[preset]
    L, d, h, V = m["n_layers"], m["dim"], m["n_heads"], m["vocab_size"]
    M, hd = batch * seq, d // h
    return [
        dict(name="wq, wk, wv, wo", count=4 * L, batch=0, m=M, k=d, n=d),
        dict(name="feed_forward w1", count=L, batch=0, m=M, k=d, n=4 * d),
        dict(name="feed_forward w2", count=L, batch=0, m=M, k=4 * d, n=d),
        dict(name="scores Q K^T", count=L, batch=batch * h, m=seq, k=hd, n=seq),
        dict(name="P V", count=L, batch=batch * h, m=seq, k=seq, n=hd),
        dict(name="output head", count=1, batch=0, m=M, k=d, n=V),
    ]


def shape_str(p: dict) -> str:
    return (f"{p['batch']}x" if p["batch"] else "") + f"{p['m']}x{p['k']}x{p['n']}"


def product_flop(p: dict) -> int:
    return 2 * max(p["batch"], 1) * p["m"] * p["k"] * p["n"]


def step_flop(preset: str, batch: int, seq: int) -> int | None:
    """FLOP_step = 3 * (L * (24 M d^2 + 4 B T^2 d) + 2 M d V), per rank; None for the Hugging Face presets."""
    if is_hf(preset):
        return None
    flop = 3 * sum(p["count"] * product_flop(p) for p in matmul_products(preset, batch, seq))
    m = MODEL[preset]
    L, d, V, M = m["n_layers"], m["dim"], m["vocab_size"], batch * seq
    assert flop == 3 * (L * (24 * M * d * d + 4 * batch * seq * seq * d) + 2 * M * d * V)
    return flop


def matmul_threads(worlds) -> list[int]:
    return sorted({threads_for(w) for w in worlds})


def matmul_bin(a) -> str:
    return a.matmul_bin or os.path.join(a.build_dir, "bench", "bench_matmul")


def matmul_cmd(a, threads: int, cells: list[dict]) -> list[str]:
    shapes = sorted({shape_str(p) for c in cells for p in matmul_products(c["preset"], c["batch"], c["seq"])})
    dtypes = [d for d in DTYPES if d in a.dtypes]
    return [matmul_bin(a), "--json", "--threads", str(threads), "--dtypes", ",".join(dtypes), "--reps", "3",
            "--n", str(MATMUL_PEAK_N), "--shapes", ",".join(shapes)]


def ensure_matmul(a, cells: list[dict], meta: dict) -> None:
    """Runs bench_matmul once per thread count a rank uses (unless stored with the same command),
    writing matmul_t<T>.json; records a summary in meta["matmul"]."""
    for t in matmul_threads(a.worlds):
        cmd = matmul_cmd(a, t, cells)
        path, log_path = os.path.join(a.out, f"matmul_t{t}.json"), os.path.join(a.out, f"matmul_t{t}.log")
        env = dict(os.environ, OMP_NUM_THREADS=str(t), OPENBLAS_NUM_THREADS=str(t))
        print(f"[matmul] threads {t}: OMP_NUM_THREADS={t} OPENBLAS_NUM_THREADS={t} {shlex.join(cmd)}", flush=True)
        if a.dry_run:
            continue
        stored = load_matmul(a.out, t)
        if stored is not None and stored.get("_cmd") == cmd and not a.force:
            print(f"[matmul] threads {t}: stored", flush=True)
        else:
            if not os.path.exists(cmd[0]):
                print(f"[matmul] threads {t}: no {cmd[0]} (build the bench_matmul target); "
                      "no matmul fraction or MFU", flush=True)
                continue
            t0 = time.time()
            try:
                r = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=MATMUL_TIMEOUT)
                rc, out_s, err_s = r.returncode, r.stdout, r.stderr
            except subprocess.TimeoutExpired as e:
                def text(x):
                    return x.decode(errors="replace") if isinstance(x, bytes) else (x or "")
                rc, out_s, err_s = None, text(e.stdout), text(e.stderr) + f"\ntimeout after {MATMUL_TIMEOUT}s"
            with open(log_path, "w") as fh:
                fh.write(f"# {utc_now()}\n# {shlex.join(cmd)}\n# rc={rc}\n{out_s}{err_s}")
            res = None
            for line in reversed(out_s.splitlines()):  # the JSON object is the last line
                if line.startswith("{"):
                    try:
                        res = json.loads(line)
                    except ValueError:
                        pass
                    break
            if res is None:
                print(f"[matmul] threads {t}: FAILED rc={rc}; see {os.path.basename(log_path)}", flush=True)
                continue
            res.update(_cmd=cmd, _rc=rc, _wall_s=round(time.time() - t0, 1))
            write_json(path, res)
            stored = res
            print(f"[matmul] threads {t}: rc={rc} in {time.time() - t0:.0f}s"
                  + ("" if res.get("ok") else " -- a numeric check FAILED (rates still used)"), flush=True)
        meta.setdefault("matmul", {})[str(t)] = {
            "cmd": shlex.join(cmd), "rc": stored.get("_rc"), "ok": stored.get("ok"),
            "kernels": sorted({f"{x['dtype']}: {x.get('kernel', '?')}" for x in stored.get("results", [])}),
            "gflops": {d: {x.get("shape", str(x["n"])): x["gflops"] for x in stored.get("results", [])
                           if x["dtype"] == d} for d in a.dtypes},
        }


def load_matmul(out: str, threads: int) -> dict | None:
    path = os.path.join(out, f"matmul_t{threads}.json")
    try:
        return load_json(path) if os.path.exists(path) else None
    except (OSError, ValueError):
        return None


def _gflops(r: dict) -> float:
    """GFLOP/s of one bench_matmul row, from its best time where it has one (more digits)."""
    if r.get("best_s") and "m" in r and "k" in r:
        return 2.0 * max(r.get("batch", 0), 1) * r["m"] * r["k"] * r["n"] / r["best_s"] / 1e9
    return r["gflops"]


def matmul_estimate(out: str, meta: dict, cell: dict, dtype: str, step_s: float | None) -> dict:
    """{flop, mm_s, frac, mfu, peak} for one cell and dtype at a step time (None when unknown)."""
    flop = step_flop(cell["preset"], cell["batch"], cell["seq"])
    est = {"flop": flop, "mm_s": None, "frac": None, "mfu": None, "peak": None, "note": ""}
    if flop is None:
        est["note"] = "Hugging Face family: FLOP not counted"
        return est
    t = (meta.get("threads_per_rank") or {}).get(str(cell["world"]))
    mm = load_matmul(out, t) if t is not None else None
    if mm is None:
        return est
    rows = [r for r in mm.get("results", []) if r.get("dtype") == dtype and r.get("at_threads") == t]
    rate = {r.get("shape", str(r["n"])): _gflops(r) for r in rows}
    if rows:
        est["peak"] = max(rate.values())
    products = matmul_products(cell["preset"], cell["batch"], cell["seq"])
    if all(shape_str(p) in rate and rate[shape_str(p)] > 0 for p in products):
        est["mm_s"] = sum(3 * p["count"] * product_flop(p) / (rate[shape_str(p)] * 1e9) for p in products)
    if not mm.get("ok", True):
        est["note"] = "bench_matmul check failed"
    if step_s:
        if est["mm_s"] is not None:
            est["frac"] = est["mm_s"] / step_s
        if est["peak"]:
            est["mfu"] = flop / step_s / (est["peak"] * 1e9)
    return est


# --------------------------------------------------------------------------- running

def run_name(cell: dict, pair: int, side: str, dtype: str = "fp32") -> str:
    return f"{cell['preset']}_w{cell['world']}_p{pair}_{side}" + ("" if dtype == "fp32" else f"_{dtype}")


SETTING_KEYS = ("preset", "world", "batch", "seq", "steps", "warmup")


def settings(cell: dict, dtype: str = "fp32") -> dict:
    out = {k: cell[k] for k in SETTING_KEYS}
    if dtype != "fp32":  # fp32 runs keep the settings (and names) they had before --dtypes
        out["dtype"] = dtype
    return out


def run_order(sides, dtypes) -> list[tuple[str, str]]:
    """(side, dtype) in the order run inside one pair: base (fp32 only), then ours fp32, ours bf16,
    peer fp32, peer bf16 (those of `dtypes`)."""
    return [(side, d) for side in sides for d in (("fp32",) if side == "base" else dtypes)
            if side != "base" or "fp32" in dtypes]


def init_path(out: str, preset: str) -> str:
    """The starting weights: a torch.save'd state dict, or for the Llama presets a Hugging Face
    directory (config.json, model.safetensors)."""
    return os.path.join(out, f"init_{preset}" if is_hf(preset) else f"init_{preset}.pt")


def init_digest(path: str) -> str:
    return sha256(os.path.join(path, "model.safetensors") if os.path.isdir(path) else path)


def ensure_init(a, preset: str, seq: int) -> str | None:
    path = init_path(a.out, preset)
    if os.path.exists(path) and not a.force_init:
        return path
    cmd = init_cmd(a, preset, seq, path)
    print(f"[init] {preset}: {shlex.join(cmd)}", flush=True)
    if a.dry_run:
        return path
    status, rc, wall = run_process(cmd, run_env(1), os.path.join(a.out, f"init_{preset}.log"),
                                   INIT_TIMEOUT[preset], a.peer_dir)
    if status != "ok" or not os.path.exists(path):
        print(f"[init] {preset}: {status} rc={rc} after {wall:.0f}s; see init_{preset}.log", flush=True)
        return None
    print(f"[init] {preset}: wrote {path} in {wall:.0f}s", flush=True)
    return path


def run_side(a, cell: dict, pair: int, side: str, dtype: str = "fp32") -> None:
    name = run_name(cell, pair, side, dtype)
    json_path = os.path.join(a.out, name + ".json")
    rec_path = os.path.join(a.out, name + ".run.json")
    if not a.force and os.path.exists(rec_path) and os.path.exists(json_path):
        rec = load_json(rec_path)
        if rec.get("status") == "ok" and rec.get("settings") == settings(cell, dtype):
            print(f"[skip] {name}: stored", flush=True)
            return
    env = run_env(cell["world"])
    ckpt_dir = None
    if side != "peer":
        ckpt_dir = tempfile.mkdtemp(prefix="peer_ab_ckpt_")
        cmd = ours_cmd(a, cell, json_path, ckpt_dir, a.baseline_build_dir if side == "base" else a.build_dir,
                       dtype, backend_of(side))
        cwd = REPO
        if backend_of(side) == "mpi" and os.geteuid() == 0:
            env.update(MPI_AS_ROOT)
    else:
        cmd = peer_cmd(a, cell, json_path, dtype)
        cwd = a.peer_dir
    env_shown = {k: env[k] for k in ENV_KEYS if k in env}
    print(f"[run] {name}: {' '.join(f'{k}={v}' for k, v in env_shown.items() if 'THREADS' in k)} "
          f"{shlex.join(cmd)}", flush=True)
    if a.dry_run:
        if ckpt_dir:
            shutil.rmtree(ckpt_dir, ignore_errors=True)
        return
    for stale in (json_path, rec_path):
        if os.path.exists(stale):
            os.remove(stale)
    started = utc_now()
    try:
        status, rc, wall = run_process(cmd, env, os.path.join(a.out, name + ".log"), cell["timeout"], cwd)
    finally:
        if ckpt_dir:
            shutil.rmtree(ckpt_dir, ignore_errors=True)
    res = None
    if status == "ok":
        try:
            res = load_json(json_path) if os.path.exists(json_path) else None
        except (OSError, ValueError):
            res = None
        if not isinstance(res, dict):
            status = "no-json"
        elif "median_step_s" not in res:
            status = "bad-json"
    rec = {"name": name, "side": side, "dtype": dtype, "pair": pair, "settings": settings(cell, dtype),
           "status": status,
           "rc": rc, "wall_s": round(wall, 1), "timeout_s": cell["timeout"], "started": started,
           "cmd": cmd, "cwd": cwd, "env": env_shown}
    write_json(rec_path, rec)
    if status == "ok":
        print(f"[run] {name}: median {res['median_step_s']:.4g}s  tok/s {res.get('tokens_per_s', 0):.1f}  "
              f"rss {res.get('peak_rss_mib_per_rank')}  final loss {_final(res)}  wall {wall:.0f}s", flush=True)
    else:
        print(f"[run] {name}: {status.upper()} rc={rc} after {wall:.0f}s; see {name}.log", flush=True)


def _final(res: dict):
    losses = res.get("losses") or []
    return f"{losses[-1]:.6f}" if losses else "?"


def source_commit(build_dir: str) -> str:
    """The commit of the source tree a CMake build directory was configured from."""
    try:
        with open(os.path.join(build_dir, "CMakeCache.txt")) as fh:
            src = next((l.split("=", 1)[1].strip() for l in fh if l.startswith("CMAKE_HOME_DIRECTORY:")), "")
    except OSError:
        return "?"
    return git_commit(src, dirty=True) if src else "?"


def collect_meta(a, cells: list[dict], argv: list[str]) -> dict:
    torch_info = sh([PY, "-c", "import torch, os, re; print(torch.__version__); print(os.path.dirname(torch.__file__)); "
                         "m = re.search(r'BLAS_INFO=([^,\\s]+)', torch.__config__.show()); print(m.group(1) if m else '?')"])
    torch_version, torch_dir, torch_blas = (torch_info.splitlines() + ["?", "", "?"])[:3]
    libtorch_so = os.path.join(torch_dir, "lib", "libtorch_cpu.so") if torch_dir else ""
    ours_bin = fsdp_train(a.build_dir)
    return {
        "command": shlex.join([sys.executable, os.path.relpath(os.path.abspath(__file__), REPO), *argv]),
        "date_utc": utc_now(),
        "cpu_model": cpu_model(),
        "cores": cores(),
        "libblas.so.3": os.path.realpath("/usr/lib/x86_64-linux-gnu/libblas.so.3"),
        # the torch wheel links its BLAS (MKL) statically: ldd lists none, torch's build config names it
        "blas_peer_libtorch_cpu": blas_libs(libtorch_so) or [f"built in (torch BLAS_INFO={torch_blas})"],
        "blas_ours_fsdp_train": blas_libs(ours_bin),
        "torch_version": torch_version,
        "peer_python": PY,
        "peer_script": PEER_SCRIPT,
        "peer_name": STRATEGIES[a.strategy]["peer_name"],
        "repo_commit": git_commit(dirty=True),
        "env": {k: os.environ.get(k) for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")},
        "threads_per_rank": {str(w): threads_for(w) for w in sorted({c["world"] for c in cells})},
        "peer_dir": a.peer_dir,
        "build_dir": a.build_dir,
        "baseline_build_dir": a.baseline_build_dir,
        "baseline_commit": source_commit(a.baseline_build_dir) if a.baseline_build_dir else None,
        "pairs": a.pairs,
        "dtypes": a.dtypes,
        "backends": a.backends,
        "mpirun": shlex.join(MPIRUN) if "mpi" in a.backends else None,
        "strategy": a.strategy,
        "ours_strategy_overrides": STRATEGIES[a.strategy]["ours"],
        "peer_mode": STRATEGIES[a.strategy]["peer_mode"],
        "ours_dtype_overrides": {d: OURS_DTYPE_OVERRIDES[d] for d in a.dtypes},
        "peer_dtype_args": {d: PEER_DTYPE_ARGS[d] for d in a.dtypes},
        "matmul_bin": None if a.no_matmul else matmul_bin(a),
        "step_flop_per_rank": {c["preset"]: step_flop(c["preset"], c["batch"], c["seq"]) for c in cells},
        "only": a.only,
        "cells": cells,
        "optimizer": "Adam lr 1e-3 betas (0.9,0.999) eps 1e-8, weight decay 0, no clipping, constant LR",
        "seed": SEED,
        "data_seed": DATA_SEED,
    }


# --------------------------------------------------------------------------- report

def load_side(out: str, cell: dict, pair: int, side: str, dtype: str = "fp32") -> tuple[str, dict | None]:
    name = run_name(cell, pair, side, dtype)
    rec_path = os.path.join(out, name + ".run.json")
    json_path = os.path.join(out, name + ".json")
    if not os.path.exists(rec_path):
        return "not run", None
    rec = load_json(rec_path)
    status = rec.get("status", "?")
    if rec.get("settings") not in (None, settings(cell, dtype)):
        return "other settings", None
    if status != "ok":
        if status == "failed":
            status = f"failed rc={rec.get('rc')}"
        elif status == "timeout":
            status = f"timeout {rec.get('timeout_s'):g}s"
        return status, None
    try:
        res = load_json(json_path)
    except (OSError, ValueError):
        return "no-json", None
    res["_wall_s"] = rec.get("wall_s")
    return "ok", res


def max_rss(res: dict) -> float | None:
    v = res.get("peak_rss_mib_per_rank")
    if isinstance(v, list) and v:
        return max(float(x) for x in v)
    if isinstance(v, (int, float)):
        return float(v)
    return None


def verdict(value, target) -> str:
    if target is None:
        return ""
    if value is None:
        return f" (≤ {target:g}: n/a)"
    return f" (≤ {target:g}: **{'met' if value <= target else 'missed'}**)"


def loss_diff(ours: dict, peer: dict) -> tuple[float | None, str]:
    lo, lp = ours.get("losses") or [], peer.get("losses") or []
    n = min(len(lo), len(lp))
    if n == 0:
        return None, "no losses"
    d = max(abs(float(x) - float(y)) for x, y in zip(lo[:n], lp[:n]))
    note = "" if len(lo) == len(lp) else f"compared {n} steps (ours {len(lo)}, peer {len(lp)})"
    return d, note


def mismatches(ours: dict, peer: dict) -> list[str]:
    out = []
    for k in ("world", "batch", "seq", "steps", "warmup", "params"):
        if k in ours and k in peer and ours[k] != peer[k]:
            out.append(f"{k} ours {ours[k]} ≠ peer {peer[k]}")
    return out


def render(out: str, meta: dict) -> str:
    cells = meta["cells"]
    pairs = meta["pairs"]
    sides = sides_of(meta)
    strategy = STRATEGIES[meta.get("strategy", "fsdp")]
    # results stored by an earlier peer harness keep the peer's name they were run with
    peer_name = meta.get("peer_name") or ("PyTorch FSDP1" if meta.get("peer_mode") == "fsdp1" else strategy["peer_name"])
    lines = [
        f"# fsdp-train vs {peer_name} (A/B, alternating)",
        "",
        f"Command: `{meta['command']}`  ",
        f"Date: {meta['date_utc']}; CPU: {meta['cpu_model']}; cores: {meta['cores']}; "
        f"BLAS: libblas.so.3 -> `{meta['libblas.so.3']}`; torch: {meta['torch_version']}; "
        f"fsdp-cpp commit: {meta.get('repo_commit', '?')}  ",
        f"OPENBLAS_CORETYPE={meta['env'].get('OPENBLAS_CORETYPE')}, "
        f"OPENBLAS_L2_SIZE={meta['env'].get('OPENBLAS_L2_SIZE')}; OMP_NUM_THREADS = OPENBLAS_NUM_THREADS "
        f"per rank: {', '.join(f'W={w}: {t}' for w, t in meta['threads_per_rank'].items())}; "
        f"pairs per cell: {pairs} (order {', '.join(f'{x} {d}' if d != 'fp32' or len(meta.get('dtypes') or ['fp32']) > 1 else x for x, d in run_order(sides, meta.get('dtypes') or ['fp32']))})" +
        (f"; base = `{meta['baseline_build_dir']}` at commit {meta.get('baseline_commit')}" if "base" in sides else ""),
        "",
    ]
    if meta.get("blas_ours_fsdp_train") or meta.get("blas_peer_libtorch_cpu"):
        lines.append(f"BLAS via ldd: ours `{'; '.join(meta.get('blas_ours_fsdp_train') or ['?'])}`, "
                     f"peer `{'; '.join(meta.get('blas_peer_libtorch_cpu') or ['?'])}`")
        lines.append("")
    lines += [
        "Step time = rank-0 median over steps after warm-up of forward+backward+optimizer; ratio = median over "
        "pairs of (ours / peer) within each pair. RSS = peak RSS (VmHWM) per rank, max over ranks, median over "
        "runs. Δloss = max over steps of |loss_ours − loss_peer| (global-batch mean), first pair with both runs ok. "
        f"Targets judged at W={TARGET_WORLD}.",
        "",
        "| preset | W | backend | B/rank | seq | steps (warm-up) | pairs ok | ours step s | peer step s | "
        "step ratio ours/peer | per-pair ratios | ours tok/s | peer tok/s | ours RSS MiB | peer RSS MiB | "
        "RSS ratio | max Δloss | notes |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for cell in cells:
        for ours in ours_sides(meta):
            lines.append(main_row(out, cell, pairs, sides, ours, strategy))
    if "base" in sides:
        lines += baseline_table(out, cells, pairs)
    dtypes = meta.get("dtypes") or ["fp32"]
    if "bf16" in dtypes:
        lines += mixed_precision_table(out, cells, pairs, ours_sides(meta))
    lines += derived_table(out, meta, cells, pairs, sides, dtypes)
    lines += comm_table(out, cells, pairs, dtypes, ours_sides(meta))
    order = run_order(sides, dtypes)
    lines += ["", "Runs (in the order run: for each pair, "
              f"{', then '.join(side if d == 'fp32' and len(dtypes) == 1 else f'{side} {d}' for side, d in order)}):",
              "",
              "| preset | W | pair | side | dtype | status | median step s | tok/s | peak RSS MiB per rank | "
              "final loss | threads | wall s |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for cell in cells:
        for k in range(1, pairs + 1):
            for side, d in order:
                st, r = load_side(out, cell, k, side, d)
                if r is None:
                    lines.append(f"| {cell['preset']} | {cell['world']} | {k} | {side} | {d} | {st} | | | | | | |")
                    continue
                rss_l = r.get("peak_rss_mib_per_rank")
                rss_s = " / ".join(f"{float(x):.0f}" for x in rss_l) if isinstance(rss_l, list) else fmt(rss_l, ".0f")
                lines.append(
                    f"| {cell['preset']} | {cell['world']} | {k} | {side} | {d} | ok | {r['median_step_s']:.4g} | "
                    f"{fmt(r.get('tokens_per_s'), '.0f')} | {rss_s} | {_final(r)} | {r.get('torch_threads', '?')} | "
                    f"{fmt(r.get('_wall_s'), '.0f')} |")
    return "\n".join(lines) + "\n"


def rss_target(strategy: dict, preset: str):
    return strategy.get("rss_target_by_preset", {}).get(preset, strategy["rss_target"])


def step_target(strategy: dict, backend: str, preset: str):
    return strategy.get("step_target_by_backend", {}).get(backend, strategy["step_target"]).get(preset)


def main_row(out: str, cell: dict, pairs: int, sides, ours: str, strategy: dict) -> str:
    """One row of the main table: our runs on one backend (side `ours`) against the peer's."""
    p, w = cell["preset"], cell["world"]
    runs = {side: [] for side in (ours, "peer")}
    ratios, first_pair, notes = [], None, []
    for k in range(1, pairs + 1):
        (so, ro), (sp, rp) = load_side(out, cell, k, ours), load_side(out, cell, k, "peer")
        for side, res in ((ours, ro), ("peer", rp)):
            if res is not None:
                runs[side].append(res)
        if ro is not None and rp is not None:
            ratios.append(ro["median_step_s"] / rp["median_step_s"])
            if first_pair is None:
                first_pair = (k, ro, rp)
    for side in (s for s in sides if s in (ours, "peer", "base")):
        bad = [f"p{k} {st}" for k in range(1, pairs + 1) for st in [load_side(out, cell, k, side)[0]] if st != "ok"]
        if bad:
            notes.append(f"{side}: " + ", ".join(bad))
    step = {s: med([r["median_step_s"] for r in runs[s]]) for s in runs}
    tok = {s: med([r.get("tokens_per_s") for r in runs[s]]) for s in runs}
    rss = {s: med([max_rss(r) for r in runs[s]]) for s in runs}
    ratio = med(ratios)
    rss_ratio = rss[ours] / rss["peer"] if rss[ours] and rss["peer"] else None
    dloss = None
    if first_pair:
        k, ro, rp = first_pair
        dloss, n = loss_diff(ro, rp)
        if k != 1:
            notes.append(f"Δloss from pair {k}")
        if n:
            notes.append(n)
        notes += mismatches(ro, rp)
        to, tp = ro.get("torch_threads"), rp.get("torch_threads")
        if to != tp:
            notes.append(f"torch threads ours {to} ≠ peer {tp}")
    if runs["peer"] and strategy["peer_mode"] != "ddp":
        eff = (runs["peer"][0].get("fsdp") or {}).get("effective_sharding_strategy")
        if eff and eff not in ("FULL_SHARD", "HYBRID_SHARD"):
            notes.append(f"peer effective {eff}")
    judged = w == TARGET_WORLD
    backend = backend_of(ours)
    return (
        f"| {p} | {w} | {backend} | {cell['batch']} | {cell['seq']} | {cell['steps']} ({cell['warmup']}) | "
        f"{len(ratios)}/{pairs} | {fmt(step[ours], '.4g')} | {fmt(step['peer'], '.4g')} | "
        f"{fmt(ratio, '.3f')}{verdict(ratio, step_target(strategy, backend, p)) if judged else ''} | "
        f"{', '.join(f'{x:.3f}' for x in ratios) or '–'} | "
        f"{fmt(tok[ours], '.0f')} | {fmt(tok['peer'], '.0f')} | "
        f"{fmt(rss[ours], '.0f')} | {fmt(rss['peer'], '.0f')} | "
        f"{fmt(rss_ratio, '.3f')}{verdict(rss_ratio, rss_target(strategy, p)) if judged else ''} | "
        f"{fmt(dloss, '.2e')}{verdict(dloss, TARGET_LOSS_DIFF) if judged else ''} | "
        f"{'; '.join(notes)} |")


def pair_ratios(out: str, cell: dict, pairs: int, num: tuple, den: tuple) -> list[float]:
    """tokens/s of run `num` / tokens/s of run `den` ((side, dtype) each), within every pair where both ran."""
    ratios = []
    for k in range(1, pairs + 1):
        n, d = load_side(out, cell, k, *num)[1], load_side(out, cell, k, *den)[1]
        if n is not None and d is not None and n.get("tokens_per_s") and d.get("tokens_per_s"):
            ratios.append(n["tokens_per_s"] / d["tokens_per_s"])
    return ratios


def first_pair_dloss(out: str, cell: dict, pairs: int, x: tuple, y: tuple):
    for k in range(1, pairs + 1):
        rx, ry = load_side(out, cell, k, *x)[1], load_side(out, cell, k, *y)[1]
        if rx is not None and ry is not None:
            return loss_diff(rx, ry)[0]
    return None


def mixed_precision_table(out: str, cells: list, pairs: int, ours_list=("ours",)) -> list:
    """bf16 (mixed precision) against fp32, and ours against the peer in bf16."""
    lines = ["", "Mixed precision: bf16 compute, fp32 master weights and gradient reduction (ours: "
             "`--fsdp_config.mixed_precision=true`; peer: FSDP2 `MixedPrecisionPolicy(param_dtype=bfloat16, "
             "reduce_dtype=float32)`). Ratios are of tokens/s (> 1: the first is faster), "
             "median over pairs of the ratio within each pair (per-pair values in brackets); tok/s and RSS (peak "
             "per rank, max over ranks) are medians over runs; Δloss = max over steps of the loss difference, first "
             "pair with both runs ok (no target: bf16 rounds).", "",
             "| preset | W | backend | ours fp32 tok/s | ours bf16 tok/s | ours bf16/fp32 | peer fp32 tok/s | peer bf16 tok/s | "
             "peer bf16/fp32 | ours bf16 / peer bf16 | ours RSS MiB fp32 / bf16 | peer RSS MiB fp32 / bf16 | "
             "Δloss ours bf16 vs fp32 | Δloss ours bf16 vs peer bf16 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def ratio_cell(rs: list) -> str:
        return f"{fmt(med(rs), '.3f')} [{', '.join(f'{x:.2f}' for x in rs)}]" if rs else "–"

    for cell, o in ((cell, o) for cell in cells for o in ours_list):
        tok, rss = {}, {}
        for side in (o, "peer"):
            for d in DTYPES:
                runs = [r for r in (load_side(out, cell, k, side, d)[1] for k in range(1, pairs + 1)) if r is not None]
                tok[side, d] = med([r.get("tokens_per_s") for r in runs])
                rss[side, d] = med([max_rss(r) for r in runs])
        if tok[o, "bf16"] is None and tok["peer", "bf16"] is None:
            continue
        lines.append(
            f"| {cell['preset']} | {cell['world']} | {backend_of(o)} | {fmt(tok[o, 'fp32'], '.0f')} | "
            f"{fmt(tok[o, 'bf16'], '.0f')} | "
            f"{ratio_cell(pair_ratios(out, cell, pairs, (o, 'bf16'), (o, 'fp32')))} | "
            f"{fmt(tok['peer', 'fp32'], '.0f')} | {fmt(tok['peer', 'bf16'], '.0f')} | "
            f"{ratio_cell(pair_ratios(out, cell, pairs, ('peer', 'bf16'), ('peer', 'fp32')))} | "
            f"{ratio_cell(pair_ratios(out, cell, pairs, (o, 'bf16'), ('peer', 'bf16')))} | "
            f"{fmt(rss[o, 'fp32'], '.0f')} / {fmt(rss[o, 'bf16'], '.0f')} | "
            f"{fmt(rss['peer', 'fp32'], '.0f')} / {fmt(rss['peer', 'bf16'], '.0f')} | "
            f"{fmt(first_pair_dloss(out, cell, pairs, (o, 'bf16'), (o, 'fp32')), '.2e')} | "
            f"{fmt(first_pair_dloss(out, cell, pairs, (o, 'bf16'), ('peer', 'bf16')), '.2e')} |")
    return lines


def derived_table(out: str, meta: dict, cells: list, pairs: int, sides, dtypes) -> list:
    """Matmul fraction and MFU per (cell, side, dtype), from the analytic FLOP count and bench_matmul."""
    threads = sorted({t for t in (meta.get("threads_per_rank") or {}).values()})
    mms = {t: load_matmul(out, t) for t in threads}
    if not any(mms.values()):
        return []
    lines = ["", "Matmul share of the step, estimated: FLOP/step/rank = 3 (L (24 M d² + 4 B T² d) + 2 M d V) "
             "(forward + backward of the Linear layers, Q K^T and P V; M = B T); matmul s = that FLOP at "
             "bench_matmul's GFLOP/s for each product's shape, dtype and the rank's thread count; matmul fraction "
             "= matmul s / step s (an estimate: the time the matmuls would take at bench_matmul's rate, over the "
             "step time); MFU = FLOP/step / step s / peak, peak = the best bench_matmul GFLOP/s at that dtype and "
             "thread count. bench_matmul kernels: " +
             "; ".join(f"{t} thr: " + ", ".join(sorted({f"{r['dtype']} {r.get('kernel', '?')}"
                                                       for r in (mm or {}).get("results", [])}))
                       for t, mm in mms.items() if mm) + ".", "",
             "| preset | W | side | dtype | GFLOP/step/rank | step s | matmul s at bench_matmul rate | "
             "matmul fraction | peak GFLOP/s | MFU | notes |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for cell in cells:
        for side in sides:
            for d in (("fp32",) if side == "base" else dtypes):
                runs = [r for r in (load_side(out, cell, k, side, d)[1] for k in range(1, pairs + 1)) if r is not None]
                step = med([r["median_step_s"] for r in runs])
                if step is None:
                    continue
                e = matmul_estimate(out, meta, cell, d, step)
                lines.append(
                    f"| {cell['preset']} | {cell['world']} | {side} | {d} | "
                    f"{fmt(e['flop'] and e['flop'] / 1e9, '.4g')} | {step:.4g} | "
                    f"{fmt(e['mm_s'], '.4g')} | {pct(e['frac'])} | {fmt(e['peak'], '.1f')} | {pct(e['mfu'])} | "
                    f"{e['note']} |")
    mm_lines = []
    for t, mm in mms.items():
        if not mm:
            continue
        for r in mm.get("results", []):
            mm_lines.append(f"| {t} | {r['dtype']} | {r.get('shape', r['n'])} | {_gflops(r):.3g} | "
                            f"{r.get('kernel', '?')} | {r.get('max_rel_err', 0):.2e} / {r.get('tol', 0):.2e} |")
    if mm_lines:
        lines += ["", "bench_matmul rates used (shape = [batch x] M x K x N):", "",
                  "| threads | dtype | shape | GFLOP/s | kernel | sampled error / tol |", "|---|---|---|---|---|---|"]
        lines += mm_lines
    return lines


def baseline_table(out: str, cells: list, pairs: int) -> list:
    """Ours against the baseline build, per pair (each base run directly precedes its ours run)."""
    lines = ["", "Ours against the baseline build (ratio = median over pairs of ours / base within each pair):", "",
             "| preset | W | base step s | ours step s | step ratio ours/base | per-pair ratios | "
             "base RSS MiB | ours RSS MiB | RSS ratio ours/base | max Δloss ours vs base |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for cell in cells:
        got = [(load_side(out, cell, k, "base")[1], load_side(out, cell, k, "ours")[1]) for k in range(1, pairs + 1)]
        both = [(b, o) for b, o in got if b is not None and o is not None]
        if not both:
            continue
        ratios = [o["median_step_s"] / b["median_step_s"] for b, o in both]
        rss_b, rss_o = med([max_rss(b) for b, _ in both]), med([max_rss(o) for _, o in both])
        dloss, _ = loss_diff(both[0][1], both[0][0])
        lines.append(
            f"| {cell['preset']} | {cell['world']} | {fmt(med([b['median_step_s'] for b, _ in both]), '.4g')} | "
            f"{fmt(med([o['median_step_s'] for _, o in both]), '.4g')} | {fmt(med(ratios), '.3f')} | "
            f"{', '.join(f'{x:.3f}' for x in ratios)} | {fmt(rss_b, '.0f')} | {fmt(rss_o, '.0f')} | "
            f"{fmt(rss_o / rss_b if rss_b and rss_o else None, '.3f')} | {fmt(dloss, '.2e')} |")
    return lines


def comm_table(out: str, cells: list, pairs: int, dtypes=("fp32",), ours=("ours",)) -> list:
    """Where our step time goes at W > 1, from fsdp-train's summary: per step (run totals / steps,
    mean over ranks), median over the runs; exposed = waited for by the training thread. bf16 runs
    get their own rows ("<preset> bf16")."""
    fields = ("all_gather_s_per_rank", "all_gather_wait_s_per_rank",
              "reduce_scatter_s_per_rank", "reduce_scatter_wait_s_per_rank")
    lines = ["", "Ours, communication per step (run totals / steps, mean over ranks, median over runs):", "",
             "| preset | W | backend | step s | all-gather busy / waited for s | reduce-scatter busy / waited for s | "
             "exposed, % of step |",
             "|---|---|---|---|---|---|---|"]
    for cell in cells:
        if cell["world"] < 2:
            continue
        for side, d in ((side, d) for side in ours for d in dtypes):
            per_run = []
            for k in range(1, pairs + 1):
                _, r = load_side(out, cell, k, side, d)
                if r is None or not all(f in r for f in fields):
                    continue
                per_step = [statistics.mean(r[f]) / r["steps"] for f in fields]
                per_run.append([r["median_step_s"]] + per_step)
            if not per_run:
                continue
            step, ag, agw, rs, rsw = (med(list(col)) for col in zip(*per_run))
            label = cell["preset"] + ("" if d == "fp32" else f" {d}")
            lines.append(f"| {label} | {cell['world']} | {backend_of(side)} | {step:.4g} | {ag:.3f} / {agw:.3f} | "
                         f"{rs:.3f} / {rsw:.3f} | {100 * (agw + rsw) / step:.0f} % |")
    return lines


# --------------------------------------------------------------------------- main

def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--presets", default="tiny,small", help="comma list of tiny,small,medium,llama_small,gpt2_small (default tiny,small)")
    p.add_argument("--worlds", default="1,2", help="comma list of world sizes (default 1,2)")
    p.add_argument("--pairs", type=int, default=3, help="A/B pairs per cell (default 3)")
    p.add_argument("--batch", type=int, default=None, help="per-rank batch for all presets "
                   "(default: tiny 4, small 8, medium 2)")
    p.add_argument("--steps", type=int, default=None, help="steps for all presets (default: tiny 30, small 8, medium 4)")
    p.add_argument("--seq", type=int, default=None, help="sequence length for all presets (default: max_seq_len: "
                   "tiny 16, small 256, medium 512)")
    p.add_argument("--warmup", type=int, default=None, help="steps excluded from medians (default: 2; medium 1)")
    p.add_argument("--timeout", type=float, default=None, help="seconds per run (default: tiny 300, small 1800, "
                   "medium 3600)")
    p.add_argument("--only", choices=["ours", "peer"], default=None, help="run only one side")
    p.add_argument("--out", default=None, help="output dir (default bench/results/peer_ab/<UTC date-time>)")
    p.add_argument("--build-dir", default=os.path.join(REPO, "build"))
    p.add_argument("--baseline-build-dir", default=None,
                   help="another build of fsdp-cpp (e.g. of the previous commit), run first in every pair")
    p.add_argument("--peer-dir", default=os.path.join(REPO, "bench", "peer"),
                   help="the peer harness (default bench/peer, fsdp-cpp's copy)")
    p.add_argument("--dtypes", default="fp32", help="comma list of fp32,bf16 (default fp32): bf16 runs ours with "
                   "--fsdp_config.mixed_precision=true and the peer with --mixed-precision bf16")
    p.add_argument("--backends", default="gloo", help="comma list of gloo,mpi (default gloo): ours runs once per "
                   "backend in each pair, under fsdprun for gloo and under mpirun -np W for mpi")
    p.add_argument("--strategy", choices=sorted(STRATEGIES), default="fsdp",
                   help="fsdp (default): ours FULL_SHARD against the peer's FSDP2 fully_shard; ddp: ours "
                        "sharding_strategy NO_SHARD (fsdp::replicate) against the peer's DDP (fp32 only); hsdp: "
                        "ours HYBRID_SHARD (2 replicas) against FSDP2 on a 2-D mesh (even world sizes)")
    p.add_argument("--matmul-bin", default=None, help="bench_matmul to measure matmul rates with "
                   "(default <build-dir>/bench/bench_matmul)")
    p.add_argument("--no-matmul", action="store_true", help="skip bench_matmul (no matmul fraction or MFU)")
    p.add_argument("--report-only", action="store_true", help="re-render table.md from --out")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("--force", action="store_true", help="rerun runs already stored in --out")
    p.add_argument("--force-init", action="store_true", help="recreate init_<preset>.pt even if present")
    a = p.parse_args(argv)
    if a.report_only and not a.out:
        p.error("--report-only needs --out")
    if a.out is None:
        a.out = os.path.join(REPO, "bench", "results", "peer_ab",
                             _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d_%H%M%S"))
    a.out = os.path.abspath(a.out)
    a.build_dir = os.path.abspath(a.build_dir)
    if a.baseline_build_dir:
        a.baseline_build_dir = os.path.abspath(a.baseline_build_dir)
    a.peer_dir = os.path.abspath(a.peer_dir)
    a.presets = [x.strip() for x in a.presets.split(",") if x.strip()]
    for x in a.presets:
        if x not in PRESETS:
            p.error(f"unknown preset {x!r}; choose from {', '.join(PRESETS)}")
    a.worlds = [int(x) for x in a.worlds.split(",") if x.strip()]
    a.dtypes = [x.strip() for x in a.dtypes.split(",") if x.strip()]
    for x in a.dtypes:
        if x not in DTYPES:
            p.error(f"unknown dtype {x!r}; choose from {', '.join(DTYPES)}")
    a.dtypes = [d for d in DTYPES if d in a.dtypes]  # fp32 runs first in a pair
    if not a.dtypes:
        p.error("--dtypes is empty")
    a.backends = [x.strip() for x in a.backends.split(",") if x.strip()]
    for x in a.backends:
        if x not in BACKENDS:
            p.error(f"unknown backend {x!r}; choose from {', '.join(BACKENDS)}")
    a.backends = [b for b in BACKENDS if b in a.backends]  # gloo runs first in a pair
    if not a.backends:
        p.error("--backends is empty")
    if "mpi" in a.backends and not shutil.which(MPIRUN[0]):
        p.error("--backends mpi needs mpirun on PATH (scripts/install-deps.sh installs OpenMPI)")
    if a.strategy == "ddp" and any(is_llama(x) for x in a.presets):
        p.error("--strategy ddp: fsdp-train trains the Llama family under FULL_SHARD or HYBRID_SHARD, "
                "not NO_SHARD; leave the llama presets out or use --strategy fsdp or hsdp")
    if a.strategy == "hsdp" and any(w % 2 for w in a.worlds):
        p.error("--strategy hsdp needs even world sizes (2 replicas of W/2 shards)")
    if a.strategy == "ddp" and a.dtypes != ["fp32"]:
        p.error("--strategy ddp runs fp32 only: the peer's DDP has no mixed-precision mode")
    if a.matmul_bin:
        a.matmul_bin = os.path.abspath(a.matmul_bin)
    if a.pairs < 1 or any(w < 1 for w in a.worlds):
        p.error("--pairs and --worlds must be >= 1")
    return a


def make_cells(a) -> list[dict]:
    cells = []
    for preset in a.presets:
        d = PRESETS[preset]
        cell0 = {"preset": preset,
                 "batch": a.batch or d["batch"], "steps": a.steps or d["steps"],
                 "warmup": d["warmup"] if a.warmup is None else a.warmup,
                 "seq": a.seq or d["seq"], "timeout": a.timeout or d["timeout"],
                 "init": init_path(a.out, preset)}
        if cell0["steps"] <= cell0["warmup"]:
            raise SystemExit(f"{preset}: steps {cell0['steps']} must exceed warm-up {cell0['warmup']}")
        if cell0["seq"] > PRESETS[preset]["seq"]:
            raise SystemExit(f"{preset}: seq {cell0['seq']} > max_seq_len {PRESETS[preset]['seq']}")
        for w in a.worlds:
            cells.append({**cell0, "world": w})
    return cells


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = parse_args(argv)
    meta_path = os.path.join(a.out, "meta.json")
    if a.report_only:
        if not os.path.exists(meta_path):
            raise SystemExit(f"no {meta_path}")
        meta = load_json(meta_path)
    else:
        cells = make_cells(a)
        if not a.dry_run:
            os.makedirs(a.out, exist_ok=True)
        missing = [x for x in ([os.path.join(a.peer_dir, PEER_SCRIPT), PY] +
                               ([] if a.only == "peer" else
                                [fsdprun(a.build_dir, 1)[0], fsdp_train(a.build_dir)]) +
                               ([] if a.no_matmul else [matmul_bin(a)]))
                   if not os.path.exists(x)]
        if missing:
            print("warning: missing " + ", ".join(missing) + " (those runs will fail)", file=sys.stderr)
        meta = collect_meta(a, cells, argv)
        if not a.dry_run:
            write_json(meta_path, meta)
        print(f"[out] {a.out}", flush=True)
        if not a.no_matmul:
            if any(matmul_products(c["preset"], c["batch"], c["seq"]) for c in cells):
                ensure_matmul(a, cells, meta)
            else:
                print("[matmul] no cell with counted products (the Llama presets): none measured", flush=True)
            if not a.dry_run:
                write_json(meta_path, meta)
        sides = [s for s in sides_of(a) if a.only in (None, s) or (s != "peer" and a.only == "ours")]
        inits = {}
        for cell in cells:
            preset = cell["preset"]
            if preset not in inits:
                inits[preset] = ensure_init(a, preset, cell["seq"])
                if inits[preset] and not a.dry_run:
                    meta.setdefault("init_sha256", {})[preset] = init_digest(inits[preset])
                    write_json(meta_path, meta)
            if inits[preset] is None:
                print(f"[skip] {preset} W={cell['world']}: no starting weights", flush=True)
                continue
            for k in range(1, a.pairs + 1):
                for side, dtype in run_order(sides, a.dtypes):
                    run_side(a, cell, k, side, dtype)
        if a.dry_run:
            return 0
    table = render(a.out, meta)
    with open(os.path.join(a.out, "table.md"), "w") as fh:
        fh.write(table)
    print()
    print(table, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
