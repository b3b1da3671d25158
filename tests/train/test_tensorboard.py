"""fsdp-train's TensorBoard files read back by TensorBoard's own reader.

A two-rank run under fsdprun with logging.tensorboard_dir and logging.jsonl; TensorBoard's
EventAccumulator (tensorboard.backend.event_processing) loads the folder, and every scalar's
tags, steps and values are checked against rank 0's JSONL metrics, the configuration against
the Text tab's tensor. A resumed run adds a file of its own, and the reader sees each step once:
steps trained again after resuming from an older checkpoint replace the earlier file's.
Run by ctest (tests/train/CMakeLists.txt), which passes the programs' paths in the environment
and reports the test skipped when the venv has no tensorboard.
"""
import json
import os
import pathlib
import subprocess

import numpy as np
import pytest

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
tensor_util = pytest.importorskip("tensorboard.util.tensor_util")

FSDP_TRAIN = os.environ.get("FSDP_TRAIN_BIN", "")
FSDPRUN = os.environ.get("FSDPRUN_BIN", "")
CONFIGS = os.environ.get("FSDP_TRAIN_CONFIGS_DIR", "")

# TensorBoard tag -> the JSONL key it mirrors (tools/fsdp-train/outputs/tensorboard.h).
TAGS = {
    "train/loss": "loss",
    "train/lr": "lr",
    "train/grad_norm": "grad_norm",
    "train/tokens_per_s": "tokens_per_s",
    "time/step_s": "step_s",
    "time/forward_s": "forward_s",
    "time/backward_s": "backward_s",
    "time/optimizer_s": "optimizer_s",
    "memory/live_mib": "live_mib",
    "memory/peak_mib": "peak_mib",
    "memory/rss_mib": "rss_mib",
}


def train(tmp: pathlib.Path, steps: int, *more: str) -> None:
    if not (FSDP_TRAIN and FSDPRUN and CONFIGS):
        pytest.fail("FSDP_TRAIN_BIN, FSDPRUN_BIN and FSDP_TRAIN_CONFIGS_DIR must be set (ctest sets them)")
    cmd = [FSDPRUN, "--standalone", "--nproc-per-node", "2", FSDP_TRAIN, f"{CONFIGS}/tiny.yaml",
           "--model.dim=64", "--model.max_seq_len=64", "--model.vocab_size=64", "--training.seq_len=64",
           f"--training.steps={steps}", "--training.micro_batch_size=4", "--training.export=none",
           "--fsdp_config.checkpoint_interval=2", f"--fsdp_config.checkpoint_dir={tmp}/ckpt",
           f"--logging.jsonl={tmp}/m{{rank}}.jsonl", "--logging.progress=off",
           f"--logging.tensorboard_dir={tmp}/tb", *more]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, f"{cmd}\nexit {done.returncode}\n{done.stdout}\n{done.stderr}"


def jsonl(path: pathlib.Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def accumulator(folder: pathlib.Path):
    acc = event_accumulator.EventAccumulator(
        str(folder), size_guidance={event_accumulator.SCALARS: 0, event_accumulator.TENSORS: 0})
    acc.Reload()
    return acc


def config_texts(acc) -> list:
    texts = []
    for event in acc.Tensors("config"):
        texts.append(tensor_util.make_ndarray(event.tensor_proto).item().decode())
    return texts


def check_scalars_match(acc, rows: list) -> None:
    assert set(acc.Tags()["scalars"]) == set(TAGS), acc.Tags()["scalars"]
    for tag, key in TAGS.items():
        events = acc.Scalars(tag)
        assert [e.step for e in events] == [r["step"] for r in rows], tag
        for e, r in zip(events, rows):
            # TensorBoard keeps scalars as 32-bit floats; the JSONL writes the double exactly.
            assert e.value == float(np.float32(r[key])), f"{tag} at step {e.step}: {e.value} vs {r[key]}"


def test_scalars_and_config_read_back(tmp_path: pathlib.Path) -> None:
    train(tmp_path, 4)
    files = sorted((tmp_path / "tb").iterdir())
    assert len(files) == 1 and "tfevents" in files[0].name, files  # rank 0 only
    rows = jsonl(tmp_path / "m0.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    acc = accumulator(tmp_path / "tb")
    check_scalars_match(acc, rows)
    texts = config_texts(acc)
    assert len(texts) == 1
    assert f"`{CONFIGS}/tiny.yaml`" in texts[0] and "sharding_strategy: FULL_SHARD" in texts[0]
    assert "--training.steps=4" in texts[0] and f"--logging.tensorboard_dir={tmp_path}/tb" in texts[0]


def test_resumed_run_adds_a_file_and_each_step_once(tmp_path: pathlib.Path) -> None:
    train(tmp_path, 2)
    train(tmp_path, 4)  # resume: auto, from step_2
    assert len(list((tmp_path / "tb").iterdir())) == 2
    rows = jsonl(tmp_path / "m0.jsonl")  # the resumed run appends to the same file
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    acc = accumulator(tmp_path / "tb")
    check_scalars_match(acc, rows)
    assert [e.step for e in acc.Tensors("config")] == [0, 2]


def test_steps_trained_again_replace_the_earlier_ones(tmp_path: pathlib.Path) -> None:
    train(tmp_path, 4)  # checkpoints at steps 2 and 4
    # Back to step 2, with another learning rate so that steps 3 and 4 log other values.
    train(tmp_path, 4, f"--training.resume={tmp_path}/ckpt/step_2", "--optimizer.lr=2e-3")
    rows = jsonl(tmp_path / "m0.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 3, 4]  # the JSONL keeps both; the later counts
    latest = list({r["step"]: r for r in rows}.values())
    assert latest[2]["lr"] != rows[2]["lr"]
    check_scalars_match(accumulator(tmp_path / "tb"), latest)
