#!/usr/bin/env python3
"""fsdp-train against PyTorch's FSDP2 across hosts on rate-limited links.

Two hosts of their own on this machine (tests/multihost/hosts.py: network namespaces on a
bridge), one of them behind a user-space cable that delays every frame (--delay-ms, each way),
and each host's interface limited by the kernel's token-bucket filter (tc qdisc tbf) to each of
--rates in turn. On them, alternately, pair after pair:
  ours   fsdp-train, one fsdprun agent per host (bench/peer/llama.yaml, model.init_from of a
         Hugging Face directory that transformers wrote from bench/peer/llama_small/config.json);
  peer   PyTorch's FSDP2 (bench/peer/peer_fsdp2.py --hf-model of the same directory:
         transformers' LlamaForCausalLM under fully_shard), one torchrun per host.
Same weights, same batches (global batch of step s from seed data_seed + s), Adam lr 1e-3,
fp32, one thread per rank.

Layouts (--layouts): full_shard = 2 hosts x 1 rank, FULL_SHARD over both; hsdp = 2 hosts x 2
ranks, shards within a host, replicated across the hosts (fsdp-train HYBRID_SHARD with
replicate_degree 2; FSDP2 on a (replicate 2, shard 2) mesh); hsdp_2x1 = 2 hosts x 1 rank, each
host one whole replica (HYBRID_SHARD with replicate_degree 2; FSDP2 on a (replicate 2, shard 1)
mesh): only the gradients' all-reduce crosses the link.

    sudo python3 bench/links.py --out bench/results/links/DIR                 # the whole table
    python3 bench/links.py --rates 200mbit --layouts full_shard --pairs 1 --steps 4
    python3 bench/links.py --out DIR --report-only                           # table + plots again
    python3 bench/links.py --ours "int8=--fsdp_config.SOME_KEY=int8 SOME_ENV=1" --only ours
    python3 bench/links.py --ours "base=build:../old/build" --ours ours      # before/after a change

--ours NAME=ARGS (repeatable; default one side "ours") adds a fsdp-train side: ARGS, split as a
shell would, holds fsdp-train arguments (--fsdp_config.key=value, ...), environment variables
(KEY=VALUE, upper case) and at most one build:DIR (the build to run; default --build-dir). Each
such side gets the same columns and its ratio to the peer within each pair.

What each cell reports (table.md, and the raw files beside it):
  step s, tokens/s        median over the steps after the warm-up, median over the pairs;
  ratio                   side / peer, within each pair, median over the pairs (step time; and
                          tokens/s, its inverse, both shown);
  wire MB/step/host       bytes the busier host's interface sent per step, from its counters
                          (/sys/class/net/<if>/statistics/tx_bytes, headers included): each side's
                          counters over a run minus those over a short run of the same side
                          (--calibration-steps), divided by the difference in steps, so that
                          start-up, rendezvous and the final report drop out;
  algorithm MB/step/host  what FSDP must move between the hosts per step and host, from the
                          parameter counts: FULL_SHARD (W ranks): (forward all-gather of every
                          parameter + backward all-gather of the resharded layers + reduce-scatter
                          of every gradient) x (W-1)/W; HSDP (H hosts): the all-reduce of every
                          gradient across the hosts, 2 (H-1)/H of it (fp32 throughout);
  limit s                 max(compute, algorithm bytes / link rate), compute = ours' step on the
                          link without tbf ("none": only the cable) in the same layout (median);
  step / limit            how far from the physical limit: per pair, the step / max(ours' step
                          without tbf in the same pair, bytes / rate), median over the pairs;
  step / schedule bound   the same against the least step that any schedule of the algorithm's
                          dependencies reaches when the optimizer steps after every reduction, from
                          ours' run without tbf in the same pair: the embedding's gradient is the
                          last one made and the first op reads the embedding, so FULL_SHARD
                          max(compute + the embedding's all-gather and reduce-scatter / rate,
                          bytes / rate, every forward all-gather / rate + backward + the
                          embedding's reduce-scatter / rate), as backward starts from the loss;
                          HSDP max(compute + the embedding's all-reduce / rate, forward + bytes /
                          rate), as nothing can be sent before the first gradient (forward,
                          backward: ours' forward_s, backward_s in <name>.steps.jsonl);
  exposed s               ours: the time its training thread waited for all-gathers,
                          reduce-scatters and all-reduces (fsdp-train's summary: *_wait_s_per_rank,
                          run totals / steps, mean over ranks); both: step - compute of the same
                          side (its step at "none");
  losses                  every step's loss, both sides (max |Δloss| to the peer in the table).

Files in --out: meta.json (settings, machine, load), init_llama_small/ (the starting weights),
<layout>_<rate>_p<k>_<side>.json (the program's JSON: fsdp-train's summary or peer_fsdp2's line),
.steps.jsonl (fsdp-train's per-step metrics, rank 0),
.run.json (commands, environment, status, counters, load), .h<i>.log (each host's output),
<layout>_calib_<side>.* (the short runs), cells.json (each link's probe), table.md,
links_step.png, links_loss.png.

Needs root (network namespaces, tc). Only the standard library, except the plots, which run
under $FSDP_PYTHON (matplotlib).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from _common import (PY, REPO, cpu_model, fmt, fsdp_train, git_commit, llama_train_args, load_average, load_json,
                     med, utc_now, write_json, write_text)

sys.path.insert(0, os.path.join(REPO, "tests", "multihost"))
from hosts import IFNAME, Hosts, Impairment, available  # noqa: E402
from hosts import rate_bits as hosts_rate_bits  # noqa: E402

PEER_SCRIPT = os.path.join(REPO, "bench", "peer", "peer_fsdp2.py")
HF_CONFIG = os.path.join(REPO, "bench", "peer", "llama_small", "config.json")
LR, SEED, DATA_SEED = 1e-3, 0, 1234
HOSTS = 2
HYBRID = ["--fsdp_config.sharding_strategy=HYBRID_SHARD", f"--fsdp_config.replicate_degree={HOSTS}"]
LAYOUTS = {  # ranks per host, fsdp-train's strategy, peer_fsdp2's mode
    "full_shard": dict(nproc=1, ours=["--fsdp_config.sharding_strategy=FULL_SHARD"], peer="fsdp2"),
    "hsdp": dict(nproc=2, ours=HYBRID, peer="hsdp"),
    "hsdp_2x1": dict(nproc=1, ours=HYBRID, peer="hsdp"),
}
UNLIMITED = "none"
PEER = "peer"
WAIT_FIELDS = ("all_gather_wait_s_per_rank", "reduce_scatter_wait_s_per_rank", "all_reduce_wait_s_per_rank")
BUSY_FIELDS = ("all_gather_s_per_rank", "reduce_scatter_s_per_rank", "all_reduce_s_per_rank")


# --------------------------------------------------------------------------- sides

class Side:
    """One program the cells run: the peer, or fsdp-train from a build with extra arguments and
    environment."""

    def __init__(self, name, build_dir=None, args=(), env=None):
        self.name, self.build_dir, self.args, self.env = name, build_dir, list(args), dict(env or {})

    @property
    def is_peer(self):
        return self.name == PEER

    def describe(self):
        return {"name": self.name, "build_dir": self.build_dir, "args": self.args, "env": self.env}


def parse_ours(spec: str, default_build: str) -> Side:
    name, _, rest = spec.partition("=")
    if not name or not name.replace("_", "").replace("-", "").isalnum() or name == PEER:
        raise SystemExit(f"--ours {spec!r}: NAME must be letters, digits, - or _, and not '{PEER}'")
    build, args, env = default_build, [], {}
    for tok in shlex.split(rest):
        if tok.startswith("build:"):
            build = os.path.abspath(tok[len("build:"):])
        elif tok.startswith("-"):
            args.append(tok)
        elif "=" in tok and tok.split("=", 1)[0].isupper():
            k, v = tok.split("=", 1)
            env[k] = v
        else:
            raise SystemExit(f"--ours {spec!r}: {tok!r} is neither an argument (--...), KEY=VALUE nor build:DIR")
    return Side(name, build, args, env)


# --------------------------------------------------------------------------- the workload

def param_counts(config_json: str) -> dict:
    """Parameters of the Llama of a Hugging Face config.json: per decoder layer, and the root's
    (embedding, final norm, head)."""
    with open(config_json) as f:
        c = json.load(f)
    d, v, inter = c["hidden_size"], c["vocab_size"], c["intermediate_size"]
    hd = c.get("head_dim") or d // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * hd, c.get("num_key_value_heads", c["num_attention_heads"]) * hd
    layer = d * q + 2 * d * kv + q * d + 3 * d * inter + 2 * d
    root = v * d + d + (0 if c.get("tie_word_embeddings") else v * d)
    n = c["num_hidden_layers"]
    return {"layer": layer, "layers": n, "root": root, "total": n * layer + root, "embedding": v * d}


def algorithm_bytes(layout: str, counts: dict, elem_bytes: int = 4) -> float:
    """What FSDP must send between the hosts per step, per host (see the module docstring)."""
    total, layers = counts["total"], counts["layers"] * counts["layer"]
    if layout == "full_shard":
        w = HOSTS * LAYOUTS[layout]["nproc"]
        return (total + layers + total) * (w - 1) / w * elem_bytes
    return 2 * (HOSTS - 1) / HOSTS * total * elem_bytes


def exposed_bytes(layout: str, counts: dict, elem_bytes: int = 4) -> float:
    """Bytes per host that no compute of the step can run beside, in any schedule where the
    optimizer steps after every gradient is reduced: the embedding's gradient is the last one
    backward makes, so its reduction closes the step (HSDP: its all-reduce; FULL_SHARD: its
    reduce-scatter), and under FULL_SHARD its all-gather opens the step, as the first op reads it."""
    embedding = counts.get("embedding") or param_counts(HF_CONFIG)["embedding"]  # older meta.json files lack it
    if layout == "full_shard":
        w = HOSTS * LAYOUTS[layout]["nproc"]
        return 2 * embedding * (w - 1) / w * elem_bytes
    return 2 * (HOSTS - 1) / HOSTS * embedding * elem_bytes


def rate_bits(rate: str) -> float | None:
    if rate == UNLIMITED:
        return None
    try:
        return hosts_rate_bits(rate)
    except ValueError as e:
        raise SystemExit(f"--rates: {e}, or {UNLIMITED}")


# --------------------------------------------------------------------------- commands

def steps_jsonl(json_out: str) -> str:
    """Rank 0's per-step metrics (forward_s among them) beside the run's summary."""
    return json_out[:-len(".json")] + ".steps.jsonl"


def ours_argv(a, side: Side, layout: str, steps: int, host: int, port: int, json_out: str, run_dir: str):
    lay = LAYOUTS[layout]
    return [os.path.join(side.build_dir, "tools", "fsdprun", "fsdprun"), "--nnodes", str(HOSTS),
            "--node-rank", str(host), "--nproc-per-node", str(lay["nproc"]), "--master-addr", a.master_addr,
            "--master-port", str(port), "--join-timeout", "120", fsdp_train(side.build_dir),
            *llama_train_args(init=a.init, micro_batch=a.batch, accumulation=1, seq=a.seq, steps=steps, lr=LR,
                              seed=SEED, data_seed=DATA_SEED, data_path=a.data_path, checkpoint_dir=f"{run_dir}/ckpt",
                              summary_json=json_out, jsonl=steps_jsonl(json_out), log_interval=1000000),
            f"--logging.summary_warmup={a.warmup}", *lay["ours"], *side.args]


def peer_argv(a, layout: str, steps: int, host: int, port: int, json_out: str):
    lay = LAYOUTS[layout]
    return [PY, "-m", "torch.distributed.run", "--nnodes", str(HOSTS), "--node-rank", str(host),
            "--nproc-per-node", str(lay["nproc"]), "--master-addr", a.master_addr, "--master-port", str(port),
            PEER_SCRIPT, "--mode", lay["peer"], "--hf-model", a.init, "--batch", str(a.batch), "--seq", str(a.seq),
            "--steps", str(steps), "--warmup", str(a.warmup), "--lr", str(LR), "--seed", str(SEED),
            "--data-seed", str(DATA_SEED), "--threads", "1", "--json-out", json_out,
            *(["--data-path", a.data_path] if a.data_path else [])]


def host_env(side: Side) -> dict:
    # One thread per rank on both sides; each side's socket library on the hosts' interface.
    env = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "FSDP_SOCKET_IFNAME": IFNAME, "GLOO_SOCKET_IFNAME": IFNAME, "PYTHONDONTWRITEBYTECODE": "1"}
    env.update(side.env)
    return env


# --------------------------------------------------------------------------- running

class Priority:
    """While a run lasts, gives every process in the hosts the niceness --nice, as the weight of
    its scheduling group (/proc/<pid>/autogroup): with the kernel's autogroups, a process's own
    nice value only ranks it within its session, and the hosts' processes run in sessions of their
    own, each of which otherwise gets the share of one session beside every other on the machine."""

    def __init__(self, hosts: Hosts, nice: int):
        import threading
        self.hosts, self.nice, self.stop = hosts, nice, threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def __enter__(self):
        if self.nice:
            self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join()

    def run(self):
        done = set()
        while not self.stop.wait(0.2):
            for i in range(self.hosts.count):
                r = subprocess.run(["ip", "netns", "pids", self.hosts.netns(i)], capture_output=True, text=True)
                for pid in r.stdout.split():
                    if pid in done:
                        continue
                    try:
                        with open(f"/proc/{pid}/autogroup", "w") as f:
                            f.write(str(self.nice))
                        done.add(pid)
                    except OSError:  # ended meanwhile
                        pass


class Ports:
    """A fresh store port for every run (the last one's may linger in TIME_WAIT)."""

    def __init__(self):
        self.next = 21000 + os.getpid() % 20000

    def take(self):
        self.next += 1
        return self.next


def run_on_hosts(a, hosts: Hosts, side: Side, layout: str, steps: int, name: str, ports: Ports) -> dict:
    """Runs one side on every host; returns the run record (written to <name>.run.json)."""
    json_out = os.path.join(a.out, name + ".json")
    if os.path.exists(json_out):
        os.remove(json_out)
    port = ports.take()
    run_dir = tempfile.mkdtemp(prefix="links_")
    env = host_env(side)
    argvs = [peer_argv(a, layout, steps, i, port, json_out) if side.is_peer
             else ours_argv(a, side, layout, steps, i, port, json_out, run_dir) for i in range(HOSTS)]
    before = [hosts.interface_counters(i) for i in range(HOSTS)]
    load_before = load_average()
    logs = [open(os.path.join(a.out, f"{name}.h{i}.log"), "w") for i in range(HOSTS)]
    started = time.monotonic()
    procs = [hosts.start(i, argvs[i], env=env, stdout=logs[i], stderr=subprocess.STDOUT,
                         cwd=os.path.dirname(PEER_SCRIPT) if side.is_peer else REPO) for i in range(HOSTS)]
    status, rcs = "ok", []
    deadline = started + a.timeout
    with Priority(hosts, a.nice):
        for p in procs:
            try:
                rcs.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                status = "timeout"
                for i in range(HOSTS):
                    hosts.kill_host(i)
                rcs.append(p.wait())
    wall = time.monotonic() - started
    for f in logs:
        f.close()
    after = [hosts.interface_counters(i) for i in range(HOSTS)]
    subprocess.run(["rm", "-rf", run_dir])
    if status == "ok" and any(rcs):
        status = "failed"
    if status == "ok" and not os.path.exists(json_out):
        status = "no-json"
    rec = {"name": name, "side": side.describe(), "layout": layout, "steps": steps, "status": status, "rc": rcs,
           "wall_s": round(wall, 2), "started": utc_now(), "load_before": load_before, "load_after": load_average(),
           "tx_bytes": [after[i]["tx_bytes"] - before[i]["tx_bytes"] for i in range(HOSTS)],
           "rx_bytes": [after[i]["rx_bytes"] - before[i]["rx_bytes"] for i in range(HOSTS)],
           "tx_packets": [after[i]["tx_packets"] - before[i]["tx_packets"] for i in range(HOSTS)],
           "env": env, "argv": argvs}
    write_json(os.path.join(a.out, name + ".run.json"), rec)
    msg = f"[run] {name}: {status} rc={rcs} wall {wall:.0f}s"
    if status == "ok":
        r = load_json(json_out)
        msg += f"  median {r['median_step_s']:.3f}s  final loss {r['losses'][-1]:.6f}  " \
               f"tx MB {[round(b / 1e6, 1) for b in rec['tx_bytes']]}"
    print(msg, flush=True)
    return rec


def stored_ok(a, name: str, side: Side, steps: int) -> bool:
    path = os.path.join(a.out, name + ".run.json")
    if a.force or not os.path.exists(path) or not os.path.exists(os.path.join(a.out, name + ".json")):
        return False
    rec = load_json(path)
    return rec.get("status") == "ok" and rec.get("side") == side.describe() and rec.get("steps") == steps


PROBE_SERVER = r'''
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen(1)
c, _ = s.accept(); n, t0 = 0, None
while True:
    b = c.recv(1 << 20)
    if not b: break
    if t0 is None: t0 = time.monotonic()
    n += len(b)
print(n / (time.monotonic() - t0))
'''
PROBE_CLIENT = r'''
import socket, sys, time
for _ in range(100):
    try:
        c = socket.create_connection((sys.argv[1], int(sys.argv[2]))); break
    except OSError: time.sleep(0.05)
buf = b"x" * (1 << 20)
for _ in range(int(sys.argv[3])): c.sendall(buf)
c.close()
'''


def probe_link(a, hosts: Hosts, rate: str, ports: Ports) -> float | None:
    """Bytes per second one TCP stream gets from host 1 to host 0 (through the cable and tbf)."""
    bits = rate_bits(rate)
    mib = int(max(8, min(64, (bits or 8e9) / 8 * 0.5 / 2**20)))
    port = ports.take()
    server = hosts.start(0, [sys.executable, "-c", PROBE_SERVER, str(port)], stdout=subprocess.PIPE, text=True)
    client = hosts.start(1, [sys.executable, "-c", PROBE_CLIENT, a.master_addr, str(port), str(mib)])
    try:
        client.wait(timeout=120)
        out, _ = server.communicate(timeout=30)
        return float(out.strip())
    except (subprocess.TimeoutExpired, ValueError):
        return None


def make_hosts(a) -> Hosts:
    cable = {1: Impairment(delay_s=a.delay_ms / 1000, loss=0.0)} if a.delay_ms > 0 else {}
    return Hosts(HOSTS, impaired=cable, mtu=a.mtu)


def run_all(a, sides: list[Side]) -> None:
    """Per layout one set of hosts; per pair every rate in turn (the tbf limit changed between
    runs), each side once at each rate, in ABBA order, so that every cell of a pair, the compute
    reference at "none" included, is measured in the same few minutes of the machine's load."""
    path = os.path.join(a.out, "cells.json")
    cells = load_json(path) if os.path.exists(path) else {}
    ports = Ports()
    for layout in a.layouts:
        with make_hosts(a) as hosts:
            a.master_addr = hosts.address(0)
            for k in range(1, a.pairs + 1):
                for rate in a.rates:
                    for i in range(HOSTS):
                        hosts.limit_rate(i, None if rate == UNLIMITED else rate)
                    if k == 1:
                        probe = probe_link(a, hosts, rate, ports)
                        cells[f"{layout}_{rate}"] = {"probe_bytes_per_s": probe, "delay_ms": a.delay_ms, "mtu": a.mtu}
                        write_json(path, cells)
                        print(f"[cell] {layout} {rate}: one TCP stream host 1 -> host 0 gets "
                              f"{fmt(probe and probe / 1e6, '.1f')} MB/s", flush=True)
                        if rate == a.rates[0]:
                            for side in sides:  # the short runs that the counters' fixed part comes from
                                name = f"{layout}_calib_{side.name}"
                                if not stored_ok(a, name, side, a.calibration_steps):
                                    run_on_hosts(a, hosts, side, layout, a.calibration_steps, name, ports)
                    order = sides if k % 2 else list(reversed(sides))  # ABBA: drift cancels
                    for side in order:
                        name = f"{layout}_{rate}_p{k}_{side.name}"
                        if stored_ok(a, name, side, a.steps):
                            print(f"[skip] {name}: stored", flush=True)
                            continue
                        run_on_hosts(a, hosts, side, layout, a.steps, name, ports)


def ensure_init(a) -> None:
    if os.path.exists(os.path.join(a.init, "model.safetensors")):
        return
    cmd = [PY, PEER_SCRIPT, "--hf-config", HF_CONFIG, "--seed", str(SEED), "--save-init", a.init]
    print(f"[init] {shlex.join(cmd)}", flush=True)
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


# --------------------------------------------------------------------------- report

def load_run(out: str, name: str):
    rec_path, json_path = os.path.join(out, name + ".run.json"), os.path.join(out, name + ".json")
    if not (os.path.exists(rec_path) and os.path.exists(json_path)):
        return None, None
    rec = load_json(rec_path)
    if rec.get("status") != "ok":
        return rec, None
    return rec, load_json(json_path)


def wire_per_step(out: str, layout: str, side: str, rec: dict) -> float | None:
    """Bytes the busier host sent per step: the run's counters minus the short run's, per step."""
    calib, _ = load_run(out, f"{layout}_calib_{side}")
    if not calib or calib.get("status") != "ok" or rec["steps"] == calib["steps"]:
        return None
    per_host = [(rec["tx_bytes"][i] - calib["tx_bytes"][i]) / (rec["steps"] - calib["steps"]) for i in range(HOSTS)]
    return max(per_host)


def cell_stats(out: str, meta: dict, layout: str, rate: str, side: str) -> dict | None:
    steps, tok, wire, waited, busy, losses, loads = [], [], [], [], [], [], []
    for k in range(1, meta["pairs"] + 1):
        rec, r = load_run(out, f"{layout}_{rate}_p{k}_{side}")
        if r is None:
            continue
        steps.append(r["median_step_s"])
        tok.append(r["tokens_per_s"])
        losses.append(r["losses"])
        loads.append(float(rec["load_before"][0]))
        w = wire_per_step(out, layout, side, rec)
        if w is not None:
            wire.append(w)
        if all(f in r for f in WAIT_FIELDS):
            n = r["steps"]
            waited.append([statistics.mean(r[f]) / n for f in WAIT_FIELDS])
            busy.append([statistics.mean(r[f]) / n for f in BUSY_FIELDS])
    if not steps:
        return None
    return {"step": med(steps), "steps": steps, "tokens_per_s": med(tok), "wire": med(wire) if wire else None,
            "waited": [med(list(c)) for c in zip(*waited)] if waited else None,
            "busy": [med(list(c)) for c in zip(*busy)] if busy else None, "losses": losses[0], "load": med(loads)}


def pair_ratios(out: str, meta: dict, layout: str, rate: str, side: str) -> list[float]:
    ratios = []
    for k in range(1, meta["pairs"] + 1):
        _, o = load_run(out, f"{layout}_{rate}_p{k}_{side}")
        _, p = load_run(out, f"{layout}_{rate}_p{k}_{PEER}")
        if o and p:
            ratios.append(o["median_step_s"] / p["median_step_s"])
    return ratios


def compute_of(out: str, meta: dict, layout: str, side: str) -> float | None:
    """The side's step on the link without tbf (median over the pairs)."""
    if UNLIMITED not in meta["rates"]:
        return None
    s = cell_stats(out, meta, layout, UNLIMITED, side)
    return s and s["step"]


def ratios_against(out: str, meta: dict, layout: str, rate: str, side: str, ours: str, reference) -> list[float]:
    """Per pair: the side's step / reference(name, run) of ours' run without tbf in the same pair."""
    if UNLIMITED not in meta["rates"]:
        return []
    ratios = []
    for k in range(1, meta["pairs"] + 1):
        _, r = load_run(out, f"{layout}_{rate}_p{k}_{side}")
        name = f"{layout}_{UNLIMITED}_p{k}_{ours}"
        _, c = load_run(out, name)
        denominator = reference(name, c) if r and c else None
        if denominator:
            ratios.append(r["median_step_s"] / denominator)
    return ratios


def limit_ratios(out: str, meta: dict, layout: str, rate: str, side: str, ours: str) -> list[float]:
    """Per pair: the side's step / max(ours' step without tbf in the same pair, bytes / rate)."""
    return ratios_against(out, meta, layout, rate, side, ours,
                          lambda name, c: limit_of(meta, layout, rate, c["median_step_s"])[1])


def limit_of(meta: dict, layout: str, rate: str, compute: float | None) -> tuple:
    """(algorithm bytes / link rate, max(compute, that)) in seconds."""
    bits = rate_bits(rate)
    link = algorithm_bytes(layout, meta["param_counts"]) * 8 / bits if bits else 0.0
    return link, (max(compute, link) if compute is not None else None)


def phases_of(out: str, name: str, warmup: int) -> dict | None:
    """fsdp-train's forward (with the loss) and backward per step, rank 0, medians after the
    warm-up, from the run's per-step metrics (<name>.steps.jsonl)."""
    path = os.path.join(out, name + ".steps.jsonl")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    rows = [r for r in rows if r.get("step", 0) > warmup]
    if not rows:
        return None
    return {k: med([r[k + "_s"] for r in rows]) for k in ("forward", "backward")}


def phases_at_unlimited(out: str, meta: dict, layout: str, side: str) -> dict | None:
    """The side's forward and backward without tbf, medians over the pairs."""
    runs = [phases_of(out, f"{layout}_{UNLIMITED}_p{k}_{side}", meta["warmup"]) for k in range(1, meta["pairs"] + 1)]
    runs = [r for r in runs if r]
    return {k: med([r[k] for r in runs]) for k in ("forward", "backward")} if runs else None


def bound_of(meta: dict, layout: str, rate: str, compute: float | None, phases: dict | None) -> float | None:
    """The schedule bound: the least step any schedule of the algorithm's dependencies reaches
    (the optimizer after every reduction), from ours' compute, forward and backward without tbf:
    - both: compute + exposed bytes / rate (the embedding's collectives, see exposed_bytes);
    - FULL_SHARD: bytes / rate; and every forward all-gather / rate + backward + the embedding's
      reduce-scatter / rate, as backward starts from the loss, after the last forward all-gather,
      and that reduce-scatter starts after backward;
    - HSDP: forward + bytes / rate, as no gradient exists to send before the forward ends."""
    bits = rate_bits(rate)
    link, _ = limit_of(meta, layout, rate, None)
    if compute is None or phases is None:
        return None
    counts = meta["param_counts"]
    seconds = (lambda b: b * 8 / bits) if bits else (lambda b: 0.0)
    exposed = seconds(exposed_bytes(layout, counts))
    if layout == "full_shard":
        w = HOSTS * LAYOUTS[layout]["nproc"]
        forward_gathers = seconds(counts["total"] * (w - 1) / w * 4)  # every parameter, fp32
        reduce_scatter = exposed / 2  # the embedding's, alone
        return max(compute + exposed, link, forward_gathers + phases["backward"] + reduce_scatter)
    return max(compute + exposed, phases["forward"] + link)


def bound_ratios(out: str, meta: dict, layout: str, rate: str, side: str, ours: str) -> list[float]:
    """Per pair: the side's step / the schedule bound from ours' run without tbf in the same pair."""
    return ratios_against(out, meta, layout, rate, side, ours,
                          lambda name, c: bound_of(meta, layout, rate, c["median_step_s"],
                                                   phases_of(out, name, meta["warmup"])))


def render(out: str) -> str:
    meta = load_json(os.path.join(out, "meta.json"))
    cells = load_json(os.path.join(out, "cells.json")) if os.path.exists(os.path.join(out, "cells.json")) else {}
    sides = [s["name"] for s in meta["sides"]]
    ours = [s for s in sides if s != PEER]
    counts = meta["param_counts"]
    lines = [f"# fsdp-train against FSDP2 across hosts on rate-limited links", "",
             f"{meta['machine']}, {meta['cores']} vCPUs; {meta['date']}; commit {meta['commit']}; "
             f"load average at the start of the runs (median) in the last column.", "",
             f"Workload: llama_small ({counts['total']:,} parameters), {HOSTS} hosts, batch {meta['batch']} x seq "
             f"{meta['seq']} per rank, {meta['steps']} steps ({meta['warmup']} warm-up), fp32, {meta['pairs']} "
             f"alternating pair(s); host 1's cable delays each frame {meta['delay_ms']} ms each way; MTU "
             f"{meta['mtu']}; tbf on each host's interface.", "",
             f"Command: `{meta['command']}`", "",
             "| layout | link | probe MB/s | side | step s | tokens/s | step vs FSDP2 (pairs) | tokens/s vs FSDP2 | "
             "wire MB/step/host | algorithm MB/step/host | limit s | step / limit | step / schedule bound | "
             "exposed s: waited / over compute | final loss | max abs Δloss vs FSDP2 | load |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for layout in meta["layouts"]:
        alg = algorithm_bytes(layout, counts)
        ours_compute = compute_of(out, meta, layout, ours[0]) if ours else None
        for rate in meta["rates"]:
            probe = (cells.get(f"{layout}_{rate}") or {}).get("probe_bytes_per_s")
            link_s, limit = limit_of(meta, layout, rate, ours_compute)
            peer = cell_stats(out, meta, layout, rate, PEER)
            for side in sides:
                s = cell_stats(out, meta, layout, rate, side)
                if s is None:
                    continue
                compute = compute_of(out, meta, layout, side)
                to_limit = limit_ratios(out, meta, layout, rate, side, ours[0]) if ours else []
                to_bound = bound_ratios(out, meta, layout, rate, side, ours[0]) if ours else []
                ratios = pair_ratios(out, meta, layout, rate, side) if side != PEER else []
                rr = med(ratios) if ratios else None
                waited = sum(s["waited"]) if s["waited"] else None
                over = s["step"] - compute if compute is not None else None
                dloss = (max(abs(x - y) for x, y in zip(s["losses"], peer["losses"]))
                         if peer and side != PEER else None)
                label = "FSDP2" if side == PEER else side
                lines.append(
                    f"| {layout} | {rate} | {fmt(probe and probe / 1e6, '.0f')} | {label} | {s['step']:.3f} | "
                    f"{s['tokens_per_s']:.0f} | "
                    f"{fmt(rr, '.3f') + (' (' + ', '.join(f'{x:.3f}' for x in ratios) + ')' if ratios else '')} | "
                    f"{fmt(1 / rr if rr else None, '.2f')} | {fmt(s['wire'] and s['wire'] / 1e6, '.1f')} | "
                    f"{alg / 1e6:.1f} | {fmt(limit, '.3f')} | {fmt(med(to_limit), '.2f')} | "
                    f"{fmt(med(to_bound), '.2f')} | {fmt(waited, '.3f')} / {fmt(over, '.3f')} | "
                    f"{s['losses'][-1]:.5f} | {fmt(dloss, '.1e')} | {fmt(s['load'], '.1f')} |")
    lines += ["", "fsdp-train's collectives per step (run totals / steps, mean over ranks, median over pairs): "
              "busy = on its communication threads, waited = the training thread blocked.", "",
              "| layout | link | side | all-gather busy / waited s | reduce-scatter busy / waited s | "
              "all-reduce busy / waited s | algorithm bytes / rate s |", "|---|---|---|---|---|---|---|"]
    for layout in meta["layouts"]:
        for rate in meta["rates"]:
            link_s, _ = limit_of(meta, layout, rate, None)
            for side in ours:
                s = cell_stats(out, meta, layout, rate, side)
                if s is None or s["busy"] is None:
                    continue
                b, w = s["busy"], s["waited"]
                lines.append(f"| {layout} | {rate} | {side} | {b[0]:.3f} / {w[0]:.3f} | {b[1]:.3f} / {w[1]:.3f} | "
                             f"{b[2]:.3f} / {w[2]:.3f} | {link_s:.3f} |")
    lines += ["", "Losses per step (pair 1):", ""]
    for layout in meta["layouts"]:
        for side in sides:
            s = cell_stats(out, meta, layout, meta["rates"][0], side)
            if s:
                lines.append(f"- {layout}, {'FSDP2' if side == PEER else side}: "
                             + ", ".join(f"{x:.5f}" for x in s["losses"]))
    return "\n".join(lines) + "\n"


def compact_table(out: str) -> str:
    """The docs' table: one row per cell and side, the columns that carry the comparison."""
    meta = load_json(os.path.join(out, "meta.json"))
    sides = [s["name"] for s in meta["sides"]]
    ours = [s for s in sides if s != PEER]
    lines = ["| layout | link | side | step s | tokens/s | step vs FSDP2 | wire MB/step/host | limit s | step / limit "
             "| step / schedule bound | waited for comm s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for layout in meta["layouts"]:
        compute = compute_of(out, meta, layout, ours[0]) if ours else None
        for rate in meta["rates"]:
            _, limit = limit_of(meta, layout, rate, compute)
            for side in sides:
                s = cell_stats(out, meta, layout, rate, side)
                if s is None:
                    continue
                ratios = pair_ratios(out, meta, layout, rate, side) if side != PEER else []
                to_limit = limit_ratios(out, meta, layout, rate, side, ours[0]) if ours else []
                to_bound = bound_ratios(out, meta, layout, rate, side, ours[0]) if ours else []
                waited = sum(s["waited"]) if s["waited"] else None
                lines.append(f"| {layout} | {rate} | {'FSDP2' if side == PEER else side} | {s['step']:.3f} | "
                             f"{s['tokens_per_s']:.0f} | {fmt(med(ratios), '.3f')} | "
                             f"{fmt(s['wire'] and s['wire'] / 1e6, '.1f')} | {fmt(limit, '.3f')} | "
                             f"{fmt(med(to_limit), '.2f')} | {fmt(med(to_bound), '.2f')} | {fmt(waited, '.3f')} |")
    return "\n".join(lines) + "\n"


def plot(out: str) -> None:
    """links_step.png (step time against link rate, every side, the physical limit and the
    schedule bound) and links_loss.png (the loss curves); needs matplotlib (run under $FSDP_PYTHON)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    meta = load_json(os.path.join(out, "meta.json"))
    sides = [s["name"] for s in meta["sides"]]
    ours = [s for s in sides if s != PEER]
    limited = [r for r in meta["rates"] if r != UNLIMITED]
    fig, axes = plt.subplots(1, len(meta["layouts"]), figsize=(5.5 * len(meta["layouts"]), 4), squeeze=False)
    for ax, layout in zip(axes[0], meta["layouts"]):
        xs = [rate_bits(r) / 1e6 for r in limited]
        for side in sides:
            ys = [(cell_stats(out, meta, layout, r, side) or {}).get("step") for r in limited]
            pts = [(x, y) for x, y in zip(xs, ys) if y]
            if pts:
                ax.plot(*zip(*pts), marker="o", label="FSDP2" if side == PEER else f"fsdp-train ({side})")
        compute = compute_of(out, meta, layout, ours[0]) if ours else None
        lim = [limit_of(meta, layout, r, compute)[1] for r in limited]
        if all(v is not None for v in lim):
            ax.plot(xs, lim, linestyle="--", color="gray", label="physical limit")
        phases = phases_at_unlimited(out, meta, layout, ours[0]) if ours else None
        bound = [bound_of(meta, layout, r, compute, phases) for r in limited]
        if all(v is not None for v in bound):
            ax.plot(xs, bound, linestyle=":", color="black", label="schedule bound")
        ax.set_xscale("log")
        ax.set_xlabel("link rate, Mbit/s (tbf)")
        ax.set_ylabel("step time, s")
        ax.set_title(f"{layout}, llama_small, {HOSTS} hosts")
        ax.set_ylim(bottom=0)
        ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "links_step.png"), dpi=110)
    fig, axes = plt.subplots(1, len(meta["layouts"]), figsize=(5.5 * len(meta["layouts"]), 3.5), squeeze=False)
    for ax, layout in zip(axes[0], meta["layouts"]):
        for side in sides:
            s = cell_stats(out, meta, layout, meta["rates"][-1], side)
            if s:
                ax.plot(range(1, len(s["losses"]) + 1), s["losses"], marker=".",
                        label="FSDP2" if side == PEER else f"fsdp-train ({side})")
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.set_title(f"{layout} at {meta['rates'][-1]}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "links_loss.png"), dpi=110)


# --------------------------------------------------------------------------- main

def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--out", default=None, help="results folder (default bench/results/links/<UTC time>)")
    p.add_argument("--rates", default=f"{UNLIMITED},10gbit,1gbit,200mbit",
                   help=f"comma list of tbf rates (tc's spelling) or {UNLIMITED} (the compute reference; put it first)")
    p.add_argument("--layouts", default="full_shard,hsdp", help="comma list of " + ", ".join(LAYOUTS))
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--calibration-steps", type=int, default=3,
                   help="steps of the short run per side and layout whose counters are subtracted")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--data-path", default=None,
                   help="a token file (fsdp-train tokenize) both sides train on, the same windows each step "
                        "(peer_fsdp2.py --data-path); default: uniform random tokens, whose loss cannot fall")
    p.add_argument("--delay-ms", type=float, default=0.5, help="host 1's cable: each frame's delay, each way")
    p.add_argument("--mtu", type=int, default=65000,
                   help="the links' MTU: the user-space cable moves a frame per read, so it carries more with big ones")
    p.add_argument("--build-dir", default=os.path.join(REPO, "build"))
    p.add_argument("--ours", action="append", default=None, metavar="NAME=ARGS",
                   help="a fsdp-train side (repeatable; default 'ours'): see below")
    p.add_argument("--only", choices=("ours", "peer"), default=None, help="run one kind of side only")
    p.add_argument("--timeout", type=float, default=900, help="per run, seconds")
    p.add_argument("--nice", type=int, default=0,
                   help="both sides' niceness, as their scheduling groups' (negative: ahead of other work on a "
                        "shared machine; needs root)")
    p.add_argument("--force", action="store_true", help="rerun runs already stored")
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--plot-only", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.rates = a.rates.split(",")
    for r in a.rates:
        rate_bits(r)
    a.layouts = a.layouts.split(",")
    bad = [x for x in a.layouts if x not in LAYOUTS]
    if bad:
        p.error(f"--layouts: unknown {bad}; choose from {list(LAYOUTS)}")
    if a.steps <= a.warmup or a.calibration_steps <= a.warmup or a.calibration_steps >= a.steps:
        p.error("need warmup < calibration-steps < steps")
    a.build_dir = os.path.abspath(a.build_dir)
    a.out = os.path.abspath(a.out or os.path.join(REPO, "bench", "results", "links",
                                                  time.strftime("%Y%m%d-%H%M%S", time.gmtime())))
    a.init = os.path.join(a.out, "init_llama_small")
    if a.data_path:
        a.data_path = os.path.abspath(a.data_path)  # the peer's torchrun runs in another folder
    return a


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = parse_args(argv)
    if a.nice and not a.report_only and not a.plot_only and os.getsid(0) != os.getpid():
        # A scheduling group of its own (the session's), so that --nice does not raise the
        # caller's whole session with it.
        os.execvp("setsid", ["setsid", "--wait", sys.executable, os.path.abspath(__file__), *argv])
    if a.plot_only:
        plot(a.out)
        return 0
    sides = [parse_ours(s, a.build_dir) for s in (a.ours or ["ours"])]
    sides = ([] if a.only == "peer" else sides) + ([] if a.only == "ours" else [Side(PEER)])
    if not a.report_only:
        why = available()
        if why:
            print(f"links.py: no hosts here: {why}", file=sys.stderr)
            return 77
        os.makedirs(a.out, exist_ok=True)
        if a.nice:  # the cable's thread runs in this process, now in a session of its own
            with open("/proc/self/autogroup", "w") as f:
                f.write(str(a.nice))
        ensure_init(a)
        write_json(os.path.join(a.out, "meta.json"), {
            "command": "python3 bench/links.py " + shlex.join(argv), "date": utc_now(), "machine": cpu_model(),
            "cores": os.cpu_count(), "commit": git_commit(dirty=True), "rates": a.rates, "layouts": a.layouts,
            "pairs": a.pairs, "steps": a.steps, "warmup": a.warmup, "calibration_steps": a.calibration_steps,
            "batch": a.batch, "seq": a.seq, "data_path": a.data_path, "delay_ms": a.delay_ms, "mtu": a.mtu, "nice": a.nice,
            "sides": [s.describe() for s in sides], "param_counts": param_counts(HF_CONFIG),
            "load_at_start": load_average()})
        run_all(a, sides)
    table = render(a.out)
    write_text(os.path.join(a.out, "table.md"), table)
    write_text(os.path.join(a.out, "table_compact.md"), compact_table(a.out))
    print(table)
    if not a.no_plot:
        r = subprocess.run([PY, os.path.abspath(__file__), "--out", a.out, "--plot-only"])
        if r.returncode != 0:
            print("links.py: the plots failed (matplotlib under $FSDP_PYTHON?)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
