"""The link benchmark's short version (bench/links.py): fsdp-train and PyTorch's FSDP2 (torchrun,
transformers' Llama) train the same weights on the same batches across two hosts whose links
tbf limits to one rate, a few steps each; both finish with the same losses, each host's
interface counters see what each side must send (the counters measure the traffic), and the table
has a row per side. Run by ctest (label multihost) with FSDP_BUILD_DIR set; skipped, with the
reason, where namespaces cannot be made or the Python side lacks transformers."""
import json
import os
import subprocess
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hosts import available  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.environ.get("FSDP_BUILD_DIR", os.path.join(REPO, "build"))
LINKS = os.path.join(REPO, "bench", "links.py")
# What pytest runs under is the project's Python (FSDP_PYTHON): the peer needs its torch and transformers.
PY = os.environ.get("FSDP_PYTHON") or sys.executable

why_not = available()
pytestmark = pytest.mark.skipif(bool(why_not), reason=f"no network namespaces here: {why_not}")


def test_both_sides_train_alike_over_a_limited_link_and_the_counters_see_their_bytes():
    try:
        import transformers  # noqa: F401
    except ImportError:
        pytest.skip("transformers is not installed (scripts/install-deps.sh installs it): the peer needs it")
    steps, calib = 4, 3
    with tempfile.TemporaryDirectory() as out:
        r = subprocess.run([sys.executable, LINKS, "--out", out, "--build-dir", BUILD, "--rates", "1gbit",
                            "--layouts", "full_shard", "--pairs", "1", "--steps", str(steps), "--warmup", "2",
                            "--calibration-steps", str(calib), "--batch", "2", "--seq", "64", "--no-plot"],
                           capture_output=True, text=True, timeout=280, env={**os.environ, "FSDP_PYTHON": PY})
        assert r.returncode == 0, r.stdout + r.stderr
        meta = json.load(open(os.path.join(out, "meta.json")))
        sys.path.insert(0, os.path.join(REPO, "bench"))
        import links
        alg = links.algorithm_bytes("full_shard", meta["param_counts"])
        result = {}
        for side in ("ours", "peer"):
            rec = json.load(open(os.path.join(out, f"full_shard_1gbit_p1_{side}.run.json")))
            assert rec["status"] == "ok", (side, rec)
            result[side] = json.load(open(os.path.join(out, f"full_shard_1gbit_p1_{side}.json")))
            assert len(result[side]["losses"]) == steps
            wire = links.wire_per_step(out, "full_shard", side, rec)
            assert wire is not None, side
            # Everything FSDP must move went through the interfaces; fsdp-train sends it once (the
            # frames' headers, the per-step vote and the cable's jitter on top), FSDP2's gloo
            # reduce-scatter is an all-reduce and sends the gradients' half twice.
            assert wire >= 0.97 * alg, (side, wire, alg)
            if side == "ours":
                assert wire <= 1.1 * alg, (wire, alg)
        diffs = [abs(a - b) for a, b in zip(result["ours"]["losses"], result["peer"]["losses"])]
        assert max(diffs) < 1e-4, (result["ours"]["losses"], result["peer"]["losses"])
        table = open(os.path.join(out, "table.md")).read()
        assert "| full_shard | 1gbit |" in table and "| FSDP2 |" in table and "| ours |" in table, table
