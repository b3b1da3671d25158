#!/usr/bin/python3
"""A/B benchmark: fsdp-train (ours) against PyTorch FSDP1 (the peer, torch 1.13).

For every (preset, world size) cell the two programs run alternately,
ours then peer, --pairs times (A B A B A B). Both use the same preset,
per-rank batch, sequence length, steps, world size, data, optimizer math
(Adam, lr 1e-3, no clipping, constant LR, dropout 0) and the same starting
weights. The script writes every raw JSON to --out and prints a markdown table,
also saved as <out>/table.md.

    /usr/bin/python3 bench/peer_ab.py                                  # tiny,small x W=1,2 x 3 pairs
    /usr/bin/python3 bench/peer_ab.py --presets small --worlds 2 --pairs 5
    /usr/bin/python3 bench/peer_ab.py --only peer --presets tiny --pairs 1 --steps 6
    /usr/bin/python3 bench/peer_ab.py --out bench/results/peer_ab/DIR --report-only
    /usr/bin/python3 bench/peer_ab.py --dry-run                        # print the commands only
    /usr/bin/python3 bench/peer_ab.py --presets small --worlds 2 --baseline-build-dir ../old/build

With --baseline-build-dir every pair becomes a triple: the baseline build of fsdp-train
("base"), then ours, then the peer, and the table adds ours/base ratios: how a change of
fsdp-cpp moved its step time and memory, measured in the same alternating run.

Runs already stored in --out with the same settings and a good result are not
repeated, so an interrupted benchmark resumes when given the same --out
(--force reruns them). Only the standard library is needed. The peer runs
under /usr/bin/python3, the interpreter that has torch.

Files in --out:
  meta.json                          settings, machine, BLAS, versions
  init_<preset>.pt                   starting weights (peer --save-init)
  <preset>_w<W>_p<k>_<side>.json     the program's raw JSON (side = base | ours | peer)
  <preset>_w<W>_p<k>_<side>.run.json command, environment, exit code, wall time, status
  <preset>_w<W>_p<k>_<side>.log      stdout + stderr
  table.md                           the report
"""

from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

PY = "/usr/bin/python3"  # has torch 1.13; the python3 on PATH does not
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIDES = ("ours", "peer")  # run order inside a pair: A = ours, B = peer (base first when given)

# preset -> defaults. seq = the preset's max_seq_len (peer model.py PRESETS).
PRESETS = {
    "tiny": dict(batch=4, steps=30, warmup=2, seq=16, timeout=300),
    "small": dict(batch=8, steps=8, warmup=2, seq=256, timeout=1800),
    "medium": dict(batch=2, steps=4, warmup=1, seq=512, timeout=3600),
}
INIT_TIMEOUT = {"tiny": 300, "small": 600, "medium": 1800}

# The step-time, memory and loss targets; judged at W = 2 only.
TARGET_WORLD = 2
TARGET_STEP_RATIO = {"small": 0.6, "medium": 0.8}  # ours/peer median step time
TARGET_RSS_RATIO = 0.9  # ours/peer peak RSS per rank
TARGET_LOSS_DIFF = 1e-5  # max |loss_ours - loss_peer| over all steps

LR = 1e-3
SEED = 0
DATA_SEED = 1234


# --------------------------------------------------------------------------- helpers

def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def sh(cmd: list[str]) -> str:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        return r.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


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
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(obj, fh, indent=1)
        fh.write("\n")
    os.replace(tmp, path)


def threads_for(world: int) -> int:
    return max(1, len(os.sched_getaffinity(0)) // world)


def run_env(world: int) -> dict:
    """Identical environment for both programs; OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE are kept."""
    env = dict(os.environ)
    t = str(threads_for(world))
    env["OMP_NUM_THREADS"] = t
    env["OPENBLAS_NUM_THREADS"] = t
    return env


ENV_KEYS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE",
            "MKL_NUM_THREADS", "GOTO_NUM_THREADS", "LD_LIBRARY_PATH", "LD_PRELOAD")


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


# --------------------------------------------------------------------------- commands

def peer_cmd(a, cell: dict, json_out: str) -> list[str]:
    return [PY, os.path.join(a.peer_dir, "peer_fsdp1.py"),
            "--mode", "fsdp1", "--world", str(cell["world"]), "--preset", cell["preset"],
            "--batch", str(cell["batch"]), "--seq", str(cell["seq"]), "--steps", str(cell["steps"]),
            "--warmup", str(cell["warmup"]), "--lr", "1e-3", "--seed", str(SEED),
            "--data-seed", str(DATA_SEED), "--init-from", cell["init"], "--json-out", json_out]


def sides_of(meta_or_args) -> tuple:
    base = meta_or_args.get("baseline_build_dir") if isinstance(meta_or_args, dict) else meta_or_args.baseline_build_dir
    return (("base",) if base else ()) + SIDES


def ours_cmd(a, cell: dict, json_out: str, ckpt_dir: str, build_dir: str) -> list[str]:
    p = cell["preset"]
    return [os.path.join(build_dir, "tools", "fsdprun", "fsdprun"), "--standalone",
            "--nproc-per-node", str(cell["world"]),
            os.path.join(build_dir, "tools", "fsdp-train", "fsdp-train"),
            os.path.join(REPO, "configs", f"{p}.yaml"),
            f"--model.preset={p}", "--model.dropout_p=0", f"--model.init_from={cell['init']}",
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
            f"--logging.summary_json={json_out}", f"--logging.summary_warmup={cell['warmup']}"]


def init_cmd(a, preset: str, seq: int, path: str) -> list[str]:
    return [PY, os.path.join(a.peer_dir, "peer_fsdp1.py"), "--mode", "single", "--preset", preset,
            "--steps", "3", "--warmup", "2", "--batch", "1", "--seq", str(seq), "--seed", str(SEED),
            "--save-init", path]


# --------------------------------------------------------------------------- running

def run_name(cell: dict, pair: int, side: str) -> str:
    return f"{cell['preset']}_w{cell['world']}_p{pair}_{side}"


SETTING_KEYS = ("preset", "world", "batch", "seq", "steps", "warmup")


def settings(cell: dict) -> dict:
    return {k: cell[k] for k in SETTING_KEYS}


def ensure_init(a, preset: str, seq: int) -> str | None:
    path = os.path.join(a.out, f"init_{preset}.pt")
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
    print(f"[init] {preset}: wrote {path} ({os.path.getsize(path)} bytes) in {wall:.0f}s", flush=True)
    return path


def run_side(a, cell: dict, pair: int, side: str) -> None:
    name = run_name(cell, pair, side)
    json_path = os.path.join(a.out, name + ".json")
    rec_path = os.path.join(a.out, name + ".run.json")
    if not a.force and os.path.exists(rec_path) and os.path.exists(json_path):
        rec = load_json(rec_path)
        if rec.get("status") == "ok" and rec.get("settings") == settings(cell):
            print(f"[skip] {name}: stored", flush=True)
            return
    env = run_env(cell["world"])
    ckpt_dir = None
    if side in ("ours", "base"):
        ckpt_dir = tempfile.mkdtemp(prefix="peer_ab_ckpt_")
        cmd = ours_cmd(a, cell, json_path, ckpt_dir, a.build_dir if side == "ours" else a.baseline_build_dir)
        cwd = REPO
    else:
        cmd = peer_cmd(a, cell, json_path)
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
    rec = {"name": name, "side": side, "pair": pair, "settings": settings(cell), "status": status,
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
    git = sh(["git", "-C", src, "rev-parse", "--short", "HEAD"]) if src else ""
    dirty = sh(["git", "-C", src, "status", "--porcelain", "--untracked-files=no"]) if src else ""
    return (git + ("-dirty" if dirty else "")) if git else "?"


def collect_meta(a, cells: list[dict], argv: list[str]) -> dict:
    torch_info = sh([PY, "-c", "import torch, os; print(torch.__version__); print(os.path.dirname(torch.__file__))"])
    torch_version, torch_dir = (torch_info.splitlines() + ["?", ""])[:2]
    deb = sh(["dpkg-query", "-W", "-f=${Version}", "python3-torch"])
    libtorch_so = os.path.join(torch_dir, "lib", "libtorch_cpu.so") if torch_dir else ""
    ours_bin = os.path.join(a.build_dir, "tools", "fsdp-train", "fsdp-train")
    git = sh(["git", "-C", REPO, "rev-parse", "--short", "HEAD"])
    dirty = sh(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no"])
    return {
        "command": shlex.join([PY, os.path.relpath(os.path.abspath(__file__), REPO), *argv]),
        "date_utc": utc_now(),
        "cpu_model": cpu_model(),
        "cores": len(os.sched_getaffinity(0)),
        "libblas.so.3": os.path.realpath("/usr/lib/x86_64-linux-gnu/libblas.so.3"),
        "blas_peer_libtorch_cpu": blas_libs(libtorch_so),
        "blas_ours_fsdp_train": blas_libs(ours_bin),
        "torch_version": torch_version + (f" (Debian python3-torch {deb})" if deb else ""),
        "repo_commit": (git + ("-dirty" if dirty else "")) if git else "?",
        "env": {k: os.environ.get(k) for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")},
        "threads_per_rank": {str(w): threads_for(w) for w in sorted({c["world"] for c in cells})},
        "peer_dir": a.peer_dir,
        "build_dir": a.build_dir,
        "baseline_build_dir": a.baseline_build_dir,
        "baseline_commit": source_commit(a.baseline_build_dir) if a.baseline_build_dir else None,
        "pairs": a.pairs,
        "only": a.only,
        "cells": cells,
        "optimizer": "Adam lr 1e-3 betas (0.9,0.999) eps 1e-8, weight decay 0, no clipping, constant LR",
        "seed": SEED,
        "data_seed": DATA_SEED,
    }


# --------------------------------------------------------------------------- report

def load_side(out: str, cell: dict, pair: int, side: str) -> tuple[str, dict | None]:
    name = run_name(cell, pair, side)
    rec_path = os.path.join(out, name + ".run.json")
    json_path = os.path.join(out, name + ".json")
    if not os.path.exists(rec_path):
        return "not run", None
    rec = load_json(rec_path)
    status = rec.get("status", "?")
    if rec.get("settings") not in (None, settings(cell)):
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


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def fmt(x, spec: str, missing: str = "–") -> str:
    return missing if x is None else format(x, spec)


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
    lines = [
        "# fsdp-train vs PyTorch FSDP1 (A/B, alternating)",
        "",
        f"Command: `{meta['command']}`  ",
        f"Date: {meta['date_utc']}; CPU: {meta['cpu_model']}; cores: {meta['cores']}; "
        f"BLAS: libblas.so.3 -> `{meta['libblas.so.3']}`; torch: {meta['torch_version']}; "
        f"fsdp-cpp commit: {meta.get('repo_commit', '?')}  ",
        f"OPENBLAS_CORETYPE={meta['env'].get('OPENBLAS_CORETYPE')}, "
        f"OPENBLAS_L2_SIZE={meta['env'].get('OPENBLAS_L2_SIZE')}; OMP_NUM_THREADS = OPENBLAS_NUM_THREADS "
        f"per rank: {', '.join(f'W={w}: {t}' for w, t in meta['threads_per_rank'].items())}; "
        f"pairs per cell: {pairs} (order {', '.join(sides)})" +
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
        "| preset | W | B/rank | seq | steps (warm-up) | pairs ok | ours step s | peer step s | "
        "step ratio ours/peer | per-pair ratios | ours tok/s | peer tok/s | ours RSS MiB | peer RSS MiB | "
        "RSS ratio | max Δloss | notes |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    run_rows = []
    for cell in cells:
        p, w = cell["preset"], cell["world"]
        runs = {side: [] for side in sides}
        ratios, first_pair, notes = [], None, []
        for k in range(1, pairs + 1):
            got = {}
            for side in sides:
                st, res = load_side(out, cell, k, side)
                got[side] = (st, res)
                if res is not None:
                    runs[side].append(res)
                run_rows.append((cell, k, side, st, res))
            (so, ro), (sp, rp) = got["ours"], got["peer"]
            if ro is not None and rp is not None:
                ratios.append(ro["median_step_s"] / rp["median_step_s"])
                if first_pair is None:
                    first_pair = (k, ro, rp)
        for side in sides:
            bad = [f"p{k} {st}" for (c, k, sd, st, r) in run_rows if c is cell and sd == side and st != "ok"]
            if bad:
                notes.append(f"{side}: " + ", ".join(bad))
        step = {s: med([r["median_step_s"] for r in runs[s]]) for s in SIDES}
        tok = {s: med([r.get("tokens_per_s") for r in runs[s]]) for s in SIDES}
        rss = {s: med([max_rss(r) for r in runs[s]]) for s in SIDES}
        ratio = med(ratios)
        rss_ratio = rss["ours"] / rss["peer"] if rss["ours"] and rss["peer"] else None
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
        if runs["peer"]:
            eff = (runs["peer"][0].get("fsdp") or {}).get("effective_sharding_strategy")
            if eff and eff != "FULL_SHARD":
                notes.append(f"peer FSDP1 effective {eff}" + (" (torch 1.13 clamps W=1)" if w == 1 else ""))
        judged = w == TARGET_WORLD
        lines.append(
            f"| {p} | {w} | {cell['batch']} | {cell['seq']} | {cell['steps']} ({cell['warmup']}) | "
            f"{len(ratios)}/{pairs} | {fmt(step['ours'], '.4g')} | {fmt(step['peer'], '.4g')} | "
            f"{fmt(ratio, '.3f')}{verdict(ratio, TARGET_STEP_RATIO.get(p)) if judged else ''} | "
            f"{', '.join(f'{x:.3f}' for x in ratios) or '–'} | "
            f"{fmt(tok['ours'], '.0f')} | {fmt(tok['peer'], '.0f')} | "
            f"{fmt(rss['ours'], '.0f')} | {fmt(rss['peer'], '.0f')} | "
            f"{fmt(rss_ratio, '.3f')}{verdict(rss_ratio, TARGET_RSS_RATIO) if judged else ''} | "
            f"{fmt(dloss, '.2e')}{verdict(dloss, TARGET_LOSS_DIFF) if judged else ''} | "
            f"{'; '.join(notes)} |")
    if "base" in sides:
        lines += baseline_table(out, cells, pairs)
    lines += comm_table(out, cells, pairs)
    lines += ["", f"Runs (in the order run: for each pair, {', then '.join(sides)}):", "",
              "| preset | W | pair | side | status | median step s | tok/s | peak RSS MiB per rank | "
              "final loss | threads | wall s |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for cell, k, side, st, r in run_rows:
        if r is None:
            lines.append(f"| {cell['preset']} | {cell['world']} | {k} | {side} | {st} | | | | | | |")
            continue
        rss_l = r.get("peak_rss_mib_per_rank")
        rss_s = " / ".join(f"{float(x):.0f}" for x in rss_l) if isinstance(rss_l, list) else fmt(rss_l, ".0f")
        lines.append(
            f"| {cell['preset']} | {cell['world']} | {k} | {side} | ok | {r['median_step_s']:.4g} | "
            f"{fmt(r.get('tokens_per_s'), '.0f')} | {rss_s} | {_final(r)} | {r.get('torch_threads', '?')} | "
            f"{fmt(r.get('_wall_s'), '.0f')} |")
    return "\n".join(lines) + "\n"


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


def comm_table(out: str, cells: list, pairs: int) -> list:
    """Where our step time goes at W > 1, from fsdp-train's summary: per step (run totals / steps,
    mean over ranks), median over the runs; exposed = waited for by the training thread."""
    fields = ("all_gather_s_per_rank", "all_gather_wait_s_per_rank",
              "reduce_scatter_s_per_rank", "reduce_scatter_wait_s_per_rank")
    lines = ["", "Ours, communication per step (run totals / steps, mean over ranks, median over runs):", "",
             "| preset | W | step s | all-gather busy / waited for s | reduce-scatter busy / waited for s | "
             "exposed, % of step |",
             "|---|---|---|---|---|---|"]
    for cell in cells:
        if cell["world"] < 2:
            continue
        per_run = []
        for k in range(1, pairs + 1):
            _, r = load_side(out, cell, k, "ours")
            if r is None or not all(f in r for f in fields):
                continue
            per_step = [statistics.mean(r[f]) / r["steps"] for f in fields]
            per_run.append([r["median_step_s"]] + per_step)
        if not per_run:
            continue
        step, ag, agw, rs, rsw = (med(list(col)) for col in zip(*per_run))
        lines.append(f"| {cell['preset']} | {cell['world']} | {step:.4g} | {ag:.3f} / {agw:.3f} | "
                     f"{rs:.3f} / {rsw:.3f} | {100 * (agw + rsw) / step:.0f} % |")
    return lines


# --------------------------------------------------------------------------- main

def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--presets", default="tiny,small", help="comma list of tiny,small,medium (default tiny,small)")
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
    p.add_argument("--peer-dir", default=os.path.normpath(os.path.join(REPO, "..", "shared", "bench", "peer")))
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
                 "init": os.path.join(a.out, f"init_{preset}.pt")}
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
        missing = [x for x in ([os.path.join(a.peer_dir, "peer_fsdp1.py")] +
                               ([] if a.only == "peer" else
                                [os.path.join(a.build_dir, "tools", "fsdprun", "fsdprun"),
                                 os.path.join(a.build_dir, "tools", "fsdp-train", "fsdp-train")]))
                   if not os.path.exists(x)]
        if missing:
            print("warning: missing " + ", ".join(missing) + " (those runs will fail)", file=sys.stderr)
        meta = collect_meta(a, cells, argv)
        if not a.dry_run:
            write_json(meta_path, meta)
        print(f"[out] {a.out}", flush=True)
        sides = [s for s in sides_of(a) if a.only in (None, s) or (s == "base" and a.only == "ours")]
        inits = {}
        for cell in cells:
            preset = cell["preset"]
            if preset not in inits:
                inits[preset] = ensure_init(a, preset, cell["seq"])
                if inits[preset] and not a.dry_run:
                    meta.setdefault("init_sha256", {})[preset] = sha256(inits[preset])
                    write_json(meta_path, meta)
            if inits[preset] is None:
                print(f"[skip] {preset} W={cell['world']}: no starting weights", flush=True)
                continue
            for k in range(1, a.pairs + 1):
                for side in sides:
                    run_side(a, cell, k, side)
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
