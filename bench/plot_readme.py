#!/usr/bin/env python3
"""The README's two pictures, drawn from committed results (nothing is run here):

  docs/images/demo-loss.png            the default demo's loss per step (scripts/run-demo.sh, 600
                                       steps on 2 ranks), from its rank-0 JSONL metrics
  docs/images/peer-step-breakdown.png  fsdp-train's median step against PyTorch FSDP2's in the
                                       peer benchmark (bench/peer_ab.py) at W=2, per preset, with
                                       fsdp-train's step split into compute (with the communication
                                       it hid) and the all-gather, reduce-scatter and all-reduce
                                       time it waited for; the peer records its step time only

    python3 bench/plot_readme.py                      (the defaults below)
    python3 bench/plot_readme.py --demo DIR --peer DIR [--peer DIR ...] --out docs/images

Needs matplotlib (scripts/install-deps.sh puts it in the project's venv). Each picture names its
source folder, machine, date and commit, as the results' own files record them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = "bench/results/demo/2026-12-06"
PEER = ["bench/results/peer_ab/2026-12-03_fsdp2", "bench/results/peer_ab/2026-12-03_fsdp2_medium"]
PRESETS = ["tiny", "small", "medium"]


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def moving_mean(values: list[float], width: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= width:
            total -= values[i - width]
        out.append(total / min(i + 1, width))
    return out


def plot_demo(demo_dir: str, out: str) -> None:
    rows = read_jsonl(os.path.join(REPO, demo_dir, "metrics_rank0.jsonl"))
    with open(os.path.join(REPO, demo_dir, "meta.json")) as f:
        meta = json.load(f)
    steps = [r["step"] for r in rows]
    loss = [r["loss"] for r in rows]
    fig, ax = plt.subplots(figsize=(8, 4.2), dpi=110)
    ax.plot(steps, loss, color="#9bb8d9", linewidth=0.8, label="loss per step (global batch)")
    ax.plot(steps, moving_mean(loss, 20), color="#1f4e89", linewidth=1.8, label="mean of the last 20 steps")
    ax.axhline(5.545, color="#999999", linestyle=":", linewidth=1, label="ln(256): a uniform guess over bytes")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy loss (nats)")
    ax.set_title(f"fsdp-train demo: byte-level Transformer on GPL-3, FULL_SHARD on {meta['world']} ranks")
    ax.set_xlim(0, steps[-1])
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize=9)
    fig.text(0.01, 0.01, f"{demo_dir}: {meta['machine']}, {meta['date']}, commit {meta['commit']}",
             fontsize=7, color="#555555")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(out)
    plt.close(fig)


def per_step_wait(run: dict, key: str) -> float:
    """A kind's waited-for seconds per step: run total / steps, mean over ranks."""
    return statistics.mean(run.get(f"{key}_wait_s_per_rank", [0.0])) / run["steps"]


def peer_cells(peer_dirs: list[str]) -> tuple[dict, dict]:
    """preset -> medians over the W=2 pairs of fsdp-train's split and the peer's step; and the metas."""
    cells, metas = {}, {}
    for d in peer_dirs:
        with open(os.path.join(REPO, d, "meta.json")) as f:
            metas[d] = json.load(f)
        for preset in PRESETS:
            ours, peer = [], []
            for pair in range(1, 10):
                base = os.path.join(REPO, d, f"{preset}_w2_p{pair}")
                if not (os.path.exists(base + "_ours.json") and os.path.exists(base + "_peer.json")):
                    continue
                with open(base + "_ours.json") as f:
                    ours.append(json.load(f))
                with open(base + "_peer.json") as f:
                    peer.append(json.load(f))
            if not ours:
                continue
            waits = {k: statistics.median(per_step_wait(r, k) for r in ours)
                     for k in ("all_gather", "reduce_scatter", "all_reduce")}
            step = statistics.median(r["median_step_s"] for r in ours)
            cells[preset] = {"step": step, "compute": max(step - sum(waits.values()), 0.0), **waits,
                             "peer": statistics.median(r["median_step_s"] for r in peer), "pairs": len(ours),
                             "source": d}
    return cells, metas


def plot_peer(peer_dirs: list[str], out: str) -> None:
    cells, metas = peer_cells(peer_dirs)
    presets = [p for p in PRESETS if p in cells]
    fig, axes = plt.subplots(1, len(presets), figsize=(3.2 * len(presets) + 1.2, 4.4), dpi=110)
    parts = [("compute", "compute, with the communication it hid", "#1f4e89"),
             ("all_gather", "all-gather waited for", "#e39b2d"),
             ("reduce_scatter", "reduce-scatter waited for", "#c4452c"),
             ("all_reduce", "all-reduce waited for", "#7a5195")]
    for ax, preset in zip(axes, presets):
        c = cells[preset]
        bottom = 0.0
        for key, label, color in parts:
            ax.bar(0, c[key], bottom=bottom, color=color, width=0.6, label=label)
            bottom += c[key]
        ax.bar(1, c["peer"], color="#8c8c8c", width=0.6, label="PyTorch FSDP2 (step only)")
        for x, v in ((0, c["step"]), (1, c["peer"])):
            ax.text(x, v, f"{v:.3g} s", ha="center", va="bottom", fontsize=8)
        ax.set_xticks([0, 1], ["fsdp-cpp", "FSDP2"])
        ax.set_title(f"{preset}, W=2 ({c['pairs']} pairs)", fontsize=10)
        ax.set_ylim(0, max(c["step"], c["peer"]) * 1.18)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("median step time (s)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8, frameon=False, bbox_to_anchor=(0.5, 0.06))
    fig.suptitle("Step time: fsdp-train vs PyTorch FSDP2 (bench/peer_ab.py, gloo, fp32, CPU)", fontsize=11)
    sources = "; ".join(f"{d}: {m['cpu_model']}, {m['cores']} cores, {m['date_utc']}, commit {m['repo_commit']}"
                        for d, m in metas.items())
    fig.text(0.01, 0.01, sources, fontsize=6.5, color="#555555")
    fig.tight_layout(rect=(0, 0.17, 1, 0.95))
    fig.savefig(out)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--demo", default=DEMO, help="folder with metrics_rank0.jsonl and meta.json")
    ap.add_argument("--peer", action="append", help="a bench/peer_ab.py results folder (repeatable)")
    ap.add_argument("--out", default="docs/images")
    a = ap.parse_args()
    out = os.path.join(REPO, a.out)
    os.makedirs(out, exist_ok=True)
    plot_demo(a.demo, os.path.join(out, "demo-loss.png"))
    plot_peer(a.peer or PEER, os.path.join(out, "peer-step-breakdown.png"))
    print(f"wrote {a.out}/demo-loss.png and {a.out}/peer-step-breakdown.png")


if __name__ == "__main__":
    main()
