#!/usr/bin/env python3
"""FSDP alone (dp W) against FSDP over tensor parallelism (dp W/t x tp t) in fsdp-train: per-rank
peak tensor bytes, per-step communication per kind of collective split by mesh dim, and step
time, from alternating runs (one configuration, then the other, --pairs times) on the same
model, data, starting weights and global batch. Then, with --paper-model, when tensor
parallelism would pay off, from measured matmul and collective rates.

    python3 bench/tensor_parallel.py --preset small --pairs 3 --out DIR
    python3 bench/tensor_parallel.py --out DIR --report-only
    python3 bench/tensor_parallel.py --measure-constants --out DIR
    python3 bench/tensor_parallel.py --paper-model DIR/constants.json

Both configurations train on the same global batch: --batch rows per rank under dp W, t * --batch
rows per dp rank under dp W/t x tp t (the t ranks of a tp group share their rows). The tp
configuration splits the embedding and the output head by vocabulary (the trainer's default,
fsdp_config.vocab_parallel); --whole-head adds a third configuration that keeps them whole on
every tp rank, alternating with the other two. The
communication comes from the summary JSON's comm_by_mesh_dim (logging.summary_json): what each
rank sent per step on each mesh dim's process group, measured by that group's counters (the tp
layers' all-reduces run on the tp group; the gradient norm adds one 8-byte all-reduce per dim).

--measure-constants runs bench_collectives (under fsdprun, W = 2 and 4, 5 times each, at --collective-sizes-kib)
and bench_matmul (one thread, the presets' linear layers) and writes DIR/constants.json: for each
world and kind a line time = latency + bytes sent / bandwidth fitted through the sizes, and the
median matmul rate. --paper-model prints the model of docs/benchmarks.md from such a file.

Only the standard library is needed; fsdp-train, fsdprun, bench_collectives and bench_matmul come
from --build-dir. OPENBLAS_CORETYPE is passed through (see docs/blas.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (MODEL, REPO, cores, cpu_model, fsdp_train, fsdprun, git_commit, load_json, mib,  # noqa: E402
                     run_alternating, run_env, utc_now, write_json, write_text)

DEFAULTS = {  # preset -> per-rank rows under dp W, sequence length, steps, warm-up steps
    "small": dict(batch=2, seq=256, steps=6, warmup=2),
    "medium": dict(batch=1, seq=512, steps=5, warmup=1),
}
KINDS = ("all_gather", "reduce_scatter", "all_reduce")
TP_ALL_REDUCES_PER_BLOCK = 4  # forward: wo, w2; backward: the attention's input gradient (wq, wk, wv share it), w1's


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small", choices=sorted(DEFAULTS))
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size of the second configuration (default 2)")
    p.add_argument("--batch", type=int, help="rows per rank under dp W (default: small 2, medium 1)")
    p.add_argument("--seq", type=int, help="sequence length (default: the preset's, small 256, medium 512)")
    p.add_argument("--steps", type=int)
    p.add_argument("--warmup", type=int)
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--whole-head", action="store_true",
                   help="also run dp W/t x tp t with the embedding and output head whole on every tp rank")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    p.add_argument("--build-dir", default=os.path.join(REPO, "build"))
    p.add_argument("--out", help="output dir (default bench/results/tensor_parallel/<UTC date-time>)")
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--measure-constants", action="store_true")
    p.add_argument("--collective-sizes-kib", default="16,64,256,1024,4096,16384")
    p.add_argument("--constant-worlds", default="4", help="worlds bench_collectives runs at, besides 2 (default 4)")
    p.add_argument("--collective-runs", type=int, default=5, help="bench_collectives runs per world (default 5)")
    p.add_argument("--paper-model", metavar="CONSTANTS_JSON")
    a = p.parse_args(argv)
    for k, v in DEFAULTS[a.preset].items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.tp < 2 or a.world % a.tp:
        p.error("--tp must be >= 2 and divide --world")
    if a.out is None:
        a.out = os.path.join(REPO, "bench", "results", "tensor_parallel", utc_now()[:19].replace(" ", "_"))
    a.out = os.path.abspath(a.out)
    return a


def configs(a) -> list[tuple[str, int, bool]]:
    """(name, tp size, vocab-parallel): FSDP alone first, then FSDP over tp (vocab-parallel, and
    with --whole-head the head whole on every tp rank)."""
    out = [(f"dp{a.world}", 1, False), (f"dp{a.world // a.tp}_tp{a.tp}", a.tp, True)]
    if a.whole_head:
        out.append((f"dp{a.world // a.tp}_tp{a.tp}_whole_head", a.tp, False))
    return out


def run_name(a, config: str, pair: int) -> str:
    return f"{a.preset}_{config}_p{pair}"


def command(a, tp: int, vocab_parallel: bool, json_out: str, ckpt_dir: str) -> list[str]:
    return [*fsdprun(a.build_dir, a.world), fsdp_train(a.build_dir),
            os.path.join(REPO, "configs", f"{a.preset}.yaml"), f"--model.preset={a.preset}", "--model.dropout_p=0",
            f"--training.micro_batch_size={a.batch * tp}", f"--training.seq_len={a.seq}", f"--training.steps={a.steps}",
            "--training.max_grad_norm=0", "--training.resume=never", "--training.export=none", "--sample.length=0",
            "--fsdp_config.checkpoint_interval=0", f"--fsdp_config.checkpoint_dir={ckpt_dir}",
            f"--fsdp_config.model_parallel_size={tp}", f"--fsdp_config.vocab_parallel={str(vocab_parallel).lower()}",
            "--logging.progress=off", "--logging.log_interval=1000000",
            f"--logging.summary_json={json_out}", f"--logging.summary_warmup={a.warmup}"]


def run_all(a) -> None:
    run_alternating(a.pairs, configs(a), lambda c, k: run_name(a, c[0], k),
                    lambda c, json_out, ckpt: command(a, c[1], c[2], json_out, ckpt),
                    a.out, run_env(a.world), a.timeout, "tp_bench_ckpt_")


def comm(res: dict, dim: str, kind: str, field: str, rank: int = 0) -> float:
    """A rank's per-step number of one kind of collective on one mesh dim (0 when absent)."""
    d = res["comm_by_mesh_dim"].get(dim)
    return d[kind][field][rank] / res["steps"] if d else 0.0


def render(a, meta: dict) -> str:
    lines = [f"# FSDP alone against FSDP over tensor parallelism, {a.preset} at W={a.world}", "",
             f"Command: `{meta['command']}`  ",
             f"Date: {meta['date']}; CPU: {meta['cpu']}; cores: {meta['cores']}; load before: {meta['load']}; "
             f"fsdp-cpp commit: {meta['commit']}; OPENBLAS_CORETYPE={meta['coretype']}; global batch "
             f"{a.batch * a.world} x {a.seq} tokens ({a.batch} rows per rank under dp {a.world}, {a.batch * a.tp} per "
             f"dp rank under tp {a.tp}); {a.steps} steps ({a.warmup} warm-up), {a.pairs} pair(s), fp32, dropout 0", "",
             "Step = median over pairs of rank 0's median step time (per-pair values after it). Peak tensors = the "
             "largest over ranks of the run's peak of tensor bytes (exact, the same every pair). Communication: rank 0, "
             "per step, over pair 1 (the counts and bytes are the same every pair), bytes sent on the wire; busy = the "
             "group's communication thread running them, waited = the training thread blocked on them, both averaged "
             "over every step including the warm-up.", "",
             "| config | step s | per pair | peak tensors MiB (max rank) | per rank | peak RSS MiB | final loss |",
             "|---|---|---|---|---|---|---|"]
    runs = {}
    for name, _, _ in configs(a):
        got = [load_json(p) for p in (os.path.join(a.out, run_name(a, name, k) + ".json")
                                                for k in range(1, a.pairs + 1)) if os.path.exists(p)]
        runs[name] = [r for r in got if isinstance(r, dict) and "median_step_s" in r]
        if not runs[name]:
            lines.append(f"| {name} | failed | | | | | |")
            continue
        rs = runs[name]
        steps = [r["median_step_s"] for r in rs]
        peak = [max(r["peak_tensor_mib_per_rank"]) for r in rs]
        per_rank = " / ".join("%.1f" % x for x in rs[0]["peak_tensor_mib_per_rank"])
        rss = statistics.median(max(r["peak_rss_mib_per_rank"]) for r in rs)
        lines.append(f"| {name} | {statistics.median(steps):.3f} | {', '.join('%.3f' % x for x in steps)} | "
                     f"{statistics.median(peak):.1f} | {per_rank} | {rss:.0f} | {rs[0]['losses'][-1]:.6f} |")
    lines += ["", "| config | mesh dim | kind | calls / step | MiB sent / step | busy s / step | waited s / step |",
              "|---|---|---|---|---|---|---|"]
    for name, _, _ in configs(a):
        if not runs[name]:
            continue
        r0 = runs[name][0]
        for dim in r0["mesh_dim_names"]:
            for kind in KINDS:
                calls = comm(r0, dim, kind, "calls_per_rank")
                if calls == 0:
                    continue
                lines.append(f"| {name} | {dim} | {kind} | {calls:g} | {mib(comm(r0, dim, kind, 'bytes_per_rank'))} | "
                             f"{comm(r0, dim, kind, 's_per_rank'):.3f} | {comm(r0, dim, kind, 'wait_s_per_rank'):.3f} |")
    if all(runs.values()):
        alone = runs[configs(a)[0][0]][0]["losses"]
        for name, _, vocab_parallel in configs(a)[1:]:
            other = runs[name][0]["losses"]
            lines += ["", f"Largest |loss difference| from dp{a.world} over the steps of pair 1, {name}: "
                          f"{max(abs(x - y) for x, y in zip(alone, other)):.2e}"]
            lines += ["", paper_check(a, runs[name][0], vocab_parallel)]
    return "\n".join(lines) + "\n"


def paper_check(a, tp_run: dict, vocab_parallel: bool) -> str:
    """The tp all-reduces the paper model predicts for this run, against the counters."""
    m = MODEL[a.preset]
    t, rows = a.tp, a.tp * a.batch * a.seq  # the tp group's tokens
    activation = ring_all_reduce_sent(rows * m["dim"] * 4, t)
    calls = m["n_layers"] * TP_ALL_REDUCES_PER_BLOCK + 1  # and the gradient norm's
    predicted = m["n_layers"] * TP_ALL_REDUCES_PER_BLOCK * activation + ring_all_reduce_sent(8, t)
    what = f"L x {TP_ALL_REDUCES_PER_BLOCK} all-reduces of t x B x T x d fp32"
    if vocab_parallel:
        # The embedding's output and the head's input gradient; the loss: the rows' max, then
        # their sum of exp and target logit.
        calls += 2 + 2
        predicted += 2 * activation + ring_all_reduce_sent(rows * 4, t) + ring_all_reduce_sent(2 * rows * 4, t)
        what += " + 2 more (embedding, head) + the loss's 2 of 4 and 8 bytes a token"
    measured = comm(tp_run, "tp", "all_reduce", "bytes_per_rank")
    measured_calls = comm(tp_run, "tp", "all_reduce", "calls_per_rank")
    return (f"tp all-reduces per step: model {calls} calls, {mib(predicted)} MiB ({what}, ring, and the gradient "
            f"norm's); counters {measured_calls:g} calls, {mib(measured)} MiB.")


# --------------------------------------------------------------------------- the paper model

def ring_all_reduce_sent(nbytes: float, w: int) -> float:
    return 2 * (w - 1) / w * nbytes


def parameters(m: dict, max_seq: int) -> tuple[int, int]:
    """(one block's parameters, the root's: embeddings, final norm, output head)."""
    d, V = m["dim"], m["vocab_size"]
    block = 4 * d * d + (4 * d * d + 4 * d) + (4 * d * d + d) + 2 * 2 * d  # attention, w1, w2, two LayerNorms
    return block, V * d + max_seq * d + 2 * d + V * d


def collective_time(c: dict, world: int, kind: str, sent: float, calls: int = 1) -> float:
    """Ring algorithms on a node with a core per rank, from the two-rank measurement: W - 1
    steps of the measured latency per call, and the bytes this rank sends at the measured rate."""
    line = c["collectives"]["2"][kind]
    return calls * (world - 1) * line["latency_s"] + sent / line["bytes_per_s"]


# The tensor-parallel plans the model compares: fsdp-cpp's first plan ("before": each
# column-parallel layer all-reduced its own input gradient, wq, wk, wv and w1, plus wo and w2 in
# forward; embeddings and output head whole on every tp rank), today's with the head whole
# (fsdp_config.vocab_parallel: false: one all-reduce for the input gradient wq, wk and wv share,
# 4 per block) and today's default, Megatron's plan (4 per block and a vocab-parallel embedding
# and output head with a parallel cross-entropy: one activation all-reduce each, and for the loss
# two of 4 and 8 bytes per token).
PLANS = {
    "before": dict(per_block=6, split_head=False),
    "head whole": dict(per_block=TP_ALL_REDUCES_PER_BLOCK, split_head=False),
    "vocab-parallel": dict(per_block=TP_ALL_REDUCES_PER_BLOCK, split_head=True),
}


def step_model(c: dict, preset: str, world: int, tp: int, tokens: float, seq: int, plan: str = "vocab-parallel") -> dict:
    """Seconds per step of one rank: matmuls, dp collectives and tp all-reduces. tokens = the
    tokens of one rank under dp `world` (the global batch's tokens / world)."""
    m = MODEL[preset]
    L, d, V = m["n_layers"], m["dim"], m["vocab_size"]
    per_block, split_head = PLANS[plan]["per_block"], PLANS[plan]["split_head"]
    dp = world // tp
    blk, root = parameters(m, seq)
    # Blocks: t ranks split the work of t x tokens, so as much per rank as under dp alone; a
    # whole output head on every tp rank does t times the tokens.
    head_tokens = tokens if split_head else tp * tokens
    flop = 3 * tokens * L * (24 * d * d + 4 * seq * d) + 3 * head_tokens * 2 * d * V
    compute = flop / c["matmul_flops"]
    frac = (dp - 1) / dp
    # Blocks gathered in forward and backward and reduce-scattered once; the root gathered once
    # (kept from forward to backward) and reduce-scattered once. A tp rank holds 1/t of each
    # block (and of the embedding and head when they are split).
    root_here = root - (1 - 1 / tp) * 2 * V * d if split_head else root
    gather = frac * 4 * (2 * L * blk / tp + root_here)
    scatter = frac * 4 * (L * blk / tp + root_here)
    dp_s = 0.0
    if dp > 1:
        dp_s = (collective_time(c, dp, "all_gather", gather, 2 * L + 1)
                + collective_time(c, dp, "reduce_scatter", scatter, L + 1))
    tp_s = 0.0
    if tp > 1:
        activation = tp * tokens * d * 4
        calls = L * per_block + (2 if split_head else 0)
        tp_s = collective_time(c, tp, "all_reduce", calls * ring_all_reduce_sent(activation, tp), calls)
        if split_head:
            tp_s += collective_time(c, tp, "all_reduce", 3 * ring_all_reduce_sent(tp * tokens * 4, tp), 2)
    # serial: nothing overlaps (this machine, roughly); overlapped: FSDP's prefetched collectives
    # hide behind the matmuls and the tp all-reduces, which the training thread waits for.
    return dict(compute=compute, dp=dp_s, tp=tp_s, serial=compute + dp_s + tp_s,
                overlapped=max(compute + tp_s, dp_s))


def crossover(c: dict, preset: str, world: int, tp: int, seq: int, key: str, plan: str) -> str:
    """The tokens per rank (under dp alone) below which dp W/t x tp t beats dp W (step time
    `key`), by bisection; "never" when it does not at 1 token."""
    def tp_wins(n):
        return step_model(c, preset, world, tp, n, seq, plan)[key] < step_model(c, preset, world, 1, n, seq)[key]
    lo, hi = 1.0, 1e7
    if not tp_wins(lo):
        return "never"
    if tp_wins(hi):
        return "always"
    for _ in range(100):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if tp_wins(mid) else (lo, mid)
    return f"{lo:.0f}"


MODEL_CASES = (("small", 256), ("medium", 512))  # preset, sequence length (the presets' max)
MODEL_TOKENS = 512  # tokens per rank under dp alone, as benchmarked above
MODEL_WORLDS = (4, 8)


def paper_model(path: str) -> str:
    c = load_json(path)
    out = [f"Constants: {os.path.relpath(path, REPO)} ({c.get('source', '?')}); matmul {c['matmul_flops'] / 1e9:.1f} GFLOP/s per rank "
           "(fp32, one thread). Collectives: time = latency + bytes sent / bandwidth (latency: the smallest size; "
           "bandwidth: least squares over >= 512 KiB sent), from the per-size medians of the runs. The model uses "
           "W = 2 (a core per rank); W = 4 is this machine with 4 ranks on 2 vCPUs.", "",
           "| measured at W | kind | latency us | bandwidth GB/s (bytes sent per second per rank) |", "|---|---|---|---|"]
    for w, kinds in sorted(c["collectives"].items(), key=lambda x: int(x[0])):
        for kind in KINDS:
            out.append(f"| {w} | {kind} | {kinds[kind]['latency_s'] * 1e6:.0f} | {kinds[kind]['bytes_per_s'] / 1e9:.2f} |")
    out += ["", f"Per rank and step at {MODEL_TOKENS} tokens per rank under dp alone (tp 2: twice the tokens per dp "
                "rank), seconds; tp 2 " + " / ".join(PLANS) + ":", "",
            "| preset | W | matmuls: dp alone; tp 2 | dp collectives: dp alone; tp 2 | tp all-reduces | "
            "serial: dp alone; tp 2 | overlapped: dp alone; tp 2 |", "|---|---|---|---|---|---|---|"]
    for preset, seq in MODEL_CASES:
        for world in MODEL_WORLDS:
            alone = step_model(c, preset, world, 1, MODEL_TOKENS, seq)
            tp = [step_model(c, preset, world, 2, MODEL_TOKENS, seq, plan) for plan in PLANS]
            both = lambda key: " / ".join(f"{x[key]:.3f}" for x in tp)  # noqa: E731
            out.append(f"| {preset} | {world} | {alone['compute']:.3f}; {both('compute')} | {alone['dp']:.3f}; "
                       f"{both('dp')} | {both('tp')} | {alone['serial']:.3f}; {both('serial')} | "
                       f"{alone['overlapped']:.3f}; {both('overlapped')} |")
    out += ["", "Crossover: tp 2 is faster than dp alone below this many tokens per rank (under dp alone):", "",
            f"| preset | W | serial: {' / '.join(PLANS)} | overlapped: {' / '.join(PLANS)} |", "|---|---|---|---|"]
    for preset, seq in MODEL_CASES:
        for world in MODEL_WORLDS:
            cells = [" / ".join(crossover(c, preset, world, 2, seq, key, plan) for plan in PLANS)
                     for key in ("serial", "overlapped")]
            out.append(f"| {preset} | {world} | {cells[0]} | {cells[1]} |")
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------- measured constants

def fit_line(points: list[tuple[float, float]]) -> dict:
    """time = latency + bytes / bandwidth from (bytes sent, seconds) points: the bandwidth by
    least squares over the points of 512 KiB sent and more (where latency no longer counts), the
    latency from the smallest point."""
    big = [(x, y) for x, y in points if x >= 2**19] or points
    xs, ys = zip(*big)
    mx, my = statistics.mean(xs), statistics.mean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    x0, y0 = min(points)
    return {"latency_s": max(0.0, y0 - x0 * slope), "bytes_per_s": 1 / slope}


def median_rows(runs: list[list[dict]]) -> list[dict]:
    """Per size, the median over runs of each kind's time."""
    rows = []
    for same_size in zip(*runs):
        row = dict(same_size[0])
        for kind in KINDS:
            row[f"{kind}_ms"] = statistics.median(r[f"{kind}_ms"] for r in same_size)
        rows.append(row)
    return rows


def measure_constants(a) -> dict:
    load = os.getloadavg()[0]
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")  # a core per rank
    collectives = {}
    for w in sorted({2, *map(int, a.constant_worlds.split(","))}):
        cmd = [*fsdprun(a.build_dir, w), os.path.join(a.build_dir, "bench", "bench_collectives"), "--json", "--sizes-kib", a.collective_sizes_kib]
        runs = []
        with open(os.path.join(a.out, f"collectives_w{w}.jsonl"), "w") as fh:
            for _ in range(a.collective_runs):
                print(f"[constants] {shlex.join(cmd)}", flush=True)
                text = subprocess.run(cmd, env=run_env(w), capture_output=True, text=True, check=True).stdout
                runs.append([json.loads(line[line.index("{"):]) for line in text.splitlines() if "all_gather_ms" in line])
                fh.writelines(json.dumps(r) + "\n" for r in runs[-1])
        frac = (w - 1) / w
        sent = {"all_gather": frac, "reduce_scatter": frac, "all_reduce": 2 * frac}  # ring algorithms
        rows = median_rows(runs)
        collectives[str(w)] = {k: fit_line([(r["size_bytes"] * sent[k], r[f"{k}_ms"] / 1e3) for r in rows])
                               for k in KINDS}
    shapes = "1024x256x256,1024x256x1024,1024x1024x256,1024x768x768,1024x768x3072,1024x3072x768"
    cmd = [os.path.join(a.build_dir, "bench", "bench_matmul"), "--shapes", shapes, "--threads", "1", "--dtypes",
           "fp32", "--json"]
    print(f"[constants] {shlex.join(cmd)}", flush=True)
    text = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    matmul = json.loads([line for line in text.splitlines() if line.startswith("{")][-1])
    write_json(os.path.join(a.out, "matmul_t1.json"), matmul)
    results = matmul["results"]
    return {"source": f"{cpu_model()}, {cores()} CPUs, {utc_now()}, commit {git_commit()}, load before {load:.2f}",
            "matmul_flops": statistics.median(r["gflops"] for r in results) * 1e9, "collectives": collectives}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = parse_args(argv)
    if a.paper_model:
        print(paper_model(a.paper_model), end="")
        return 0
    os.makedirs(a.out, exist_ok=True)
    if a.measure_constants:
        constants = measure_constants(a)
        write_json(os.path.join(a.out, "constants.json"), constants)
        text = paper_model(os.path.join(a.out, "constants.json"))
        write_text(os.path.join(a.out, "paper_model.md"), text)
        print(text, end="")
        return 0
    meta_path = os.path.join(a.out, f"meta_{a.preset}.json")
    if a.report_only:
        meta = load_json(meta_path)
    else:
        meta = {"command": shlex.join([sys.executable, "bench/tensor_parallel.py", *argv]), "date": utc_now(),
                "cpu": cpu_model(), "cores": cores(), "load": " ".join(f"{x:.2f}" for x in os.getloadavg()),
                "commit": git_commit() or "?",
                "coretype": os.environ.get("OPENBLAS_CORETYPE")}
        write_json(meta_path, meta)
        run_all(a)
    table = render(a, meta)
    write_text(os.path.join(a.out, f"table_{a.preset}.md"), table)
    print(table, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
