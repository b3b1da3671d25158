#!/usr/bin/env python3
"""Resident memory at a real size: a random 0.85 B-parameter Llama (transformers' LlamaConfig,
hidden 2048, 16 layers, 16/4 heads, SwiGLU 5632, vocabulary 32000, untied), saved in bf16 as two
shards, at W = 2 in fp32, micro-batch 1 x 128:
- `fsdp-train eval` of it (model.init_from the directory);
- 3 training steps from it (synthetic tokens);
each against `fsdp-train plan` (--eval for the eval): every rank's peak RSS (VmHWM) and peak
tensors, measured and planned. Prints a Markdown table with the machine, the date and the commit.

    bash scripts/build.sh
    python3 bench/rss_real_size.py [--build-dir build] [--work /tmp/rss_real_size] [--only eval] [--export]

With --export the training run ends as a user's would: the final checkpoint, then a bf16
Hugging Face export. The summary's peak RSS (the table's) then includes the final checkpoint;
the export runs after the summary is written.

Memory: about 2 x 3 GiB for the eval and 2 x 9 GiB for the training steps (check `free -g`).
Each run is stopped (and reported as such) when the machine's available memory falls under
1.5 GiB, so that a shared machine is never pushed into the OOM killer.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import struct
import subprocess
import sys
import time

from _common import PY, REPO, cpu_model, fsdp_train, fsdprun, git_commit, load_average, utc_now

MAKE_MODEL = """
import sys, torch
from transformers import AutoModelForCausalLM, LlamaConfig
cfg = LlamaConfig(hidden_size=2048, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4,
                  intermediate_size=5632, vocab_size=32000, tie_word_embeddings=False, max_position_embeddings=2048)
torch.manual_seed(0)
AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(sys.argv[1], max_shard_size="1GB")
"""


def available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 1 << 62


def run_guarded(cmd: list[str], log: str) -> tuple[int, str]:
    """Runs cmd in its own process group; kills the group when available memory drops under 1.5 GiB."""
    with open(log, "w") as out:
        p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
        killed = False
        while p.poll() is None:
            if available_bytes() < 1.5 * 2**30:
                os.killpg(p.pid, signal.SIGKILL)
                killed = True
            time.sleep(0.2)
    with open(log) as f:
        text = f.read()
    return (-1 if killed else p.returncode), text


def planned(build: str, args: list[str], eval_: bool) -> dict:
    cmd = [fsdp_train(build), "plan"] + args + ["--world", "2", "--json"] + (["--eval"] if eval_ else [])
    r = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)["ranks"][0]
    return {"rss": r["peak_rss_bytes"] / 2**20, "tensors": r["peak_tensor_bytes"] / 2**20}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build-dir", default=os.path.join(REPO, "build"))
    p.add_argument("--work", default="/tmp/rss_real_size")
    p.add_argument("--only", choices=["eval", "train"], default=None)
    p.add_argument("--export", action="store_true",
                   help="end the training run with its final checkpoint and a bf16 Hugging Face export (to WORK/hf_export)")
    a = p.parse_args()
    os.makedirs(a.work, exist_ok=True)
    model = os.path.join(a.work, "llama085")
    if not os.path.exists(os.path.join(model, "config.json")):
        subprocess.run([PY, "-c", MAKE_MODEL, model], check=True)
    tokens = os.path.join(a.work, "eval.tokens")
    n = 20000
    with open(tokens, "wb") as f:
        f.write(b"FSDPTOK\0" + struct.pack("<IIQQ", 1, 2, 32000, n))
        f.write(struct.pack(f"<{n}H", *[(i * 7919) % 32000 for i in range(n)]))
    common = [f"--model.init_from={model}", "--training.seq_len=128", "--training.micro_batch_size=1",
              "--data.source=synthetic", f"--eval.path={tokens}", "--training.resume=never",
              "--logging.progress=off", "--fsdp_config.checkpoint_interval=0", "--training.export=none",
              "--sample.length=0"]
    rows = []
    for mode in ("eval", "train"):
        if a.only and a.only != mode:
            continue
        args = common + [f"--fsdp_config.checkpoint_dir={a.work}/ckpt_{mode}"]
        if mode == "train":
            args += ["--training.steps=3", f"--logging.summary_json={a.work}/summary.json"]
            if a.export:
                args = [x for x in args if x != "--training.export=none"]
                args += [f"--training.export=hf:{a.work}/hf_export", "--training.export_dtype=bfloat16"]
        plan = planned(a.build_dir, args, mode == "eval")
        cmd = fsdprun(a.build_dir, 2) + [fsdp_train(a.build_dir)] + (["eval"] if mode == "eval" else []) + args
        code, text = run_guarded(cmd, os.path.join(a.work, f"{mode}.log"))
        if code != 0:
            rows.append(f"| {mode} | stopped (exit {code}; see {a.work}/{mode}.log) | | | |")
            continue
        if mode == "eval":
            m = re.search(r"eval: peak RSS per rank ([0-9.]+) MiB, ([0-9.]+) MiB; peak tensors per rank ([0-9.]+) MiB",
                          text)
            rss, tensors = max(float(m[1]), float(m[2])), float(m[3])
        else:
            with open(f"{a.work}/summary.json") as f:
                s = json.load(f)
            rss, tensors = max(s["peak_rss_mib_per_rank"]), max(s["peak_tensor_mib_per_rank"])
        rows.append(f"| {mode} | {rss:.0f} | {plan['rss']:.0f} ({100 * (plan['rss'] / rss - 1):+.1f} %) | "
                    f"{tensors:.0f} | {plan['tensors']:.0f} ({100 * (plan['tensors'] / tensors - 1):+.1f} %) |")
    print(f"{cpu_model()}; {utc_now()}; commit {git_commit()}; load average {' '.join(load_average())}")
    print("| run (W = 2) | peak RSS MiB per rank | planned RSS MiB | peak tensors MiB | planned tensors MiB |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(r)


if __name__ == "__main__":
    sys.exit(main())
