"""fsdp::models::Llama against transformers, the oracle: every model here is a random-initialized
config (no downloads) written with save_pretrained, read by hf_driver (tests/interop/
hf_driver.cpp) through config.json and the safetensors files.

- logits at W = 1 within 1e-5 relative (fp32) for a Llama config (GQA, llama3 rope scaling,
  tied embeddings), a Qwen2 config (q/k/v biases, untied) and a Mistral config;
- saved_inv_freq: the rotary inv_freq buffers older conversions saved are skipped on load, as
  transformers skips them;
- export: the directory hf_driver writes (W = 2) loads with from_pretrained, no missing or
  unexpected keys, and gives the same logits; a bf16 export reads back into an fp32 model;
- fsdp_train_export: fsdp-train from a save_pretrained directory, training.export hf, then
  from_pretrained: no missing or unexpected keys, logits equal to ours on the exported files;
- full_shard_w2: 5 AdamW steps under FULL_SHARD at W = 2 against transformers' model under
  PyTorch's fully_shard (one call per decoder layer and the root, llama_fsdp2_reference.py), from
  the same weights and batches: per-rank losses within 1e-5 relative, final parameters within 1e-5;
- dp2_tp2_w4: the same at W = 4 on a (dp 2, tp 2) mesh, the reference split by parallelize_module
  with the same plan;
- activation_checkpointing_w2: the same at W = 2 with every decoder layer checkpointed, against
  transformers' model with checkpoint_wrapper around each layer under fully_shard: the same
  losses, and a lower measured peak on both sides (ours: peak tensor bytes of the steps; the
  reference's: peak RSS); the four peaks are printed;
- eval_w2: `fsdp-train eval` at W = 2 of a save_pretrained directory prints transformers' mean
  cross-entropy over the same windows within 1e-5 relative;
- rope_precedence: config.json with the older rope_scaling, the newer rope_parameters, both
  agreeing and both disagreeing: the rotary embeddings read are AutoConfig's in every case (a
  rope type not computed here is refused naming the key AutoConfig reads), and a disagreement is
  said, naming rope_scaling as the one used;
- bad_input: an unknown architecture, a missing field and a tensor of the wrong shape each stop
  the driver with an error naming the file and the key or tensor.

    FSDP_BUILD_DIR=build $FSDP_PYTHON -m pytest tests/interop/test_llama.py -k logits
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

from llama_configs import make_model  # noqa: E402

RTOL = 1e-5
STEPS = 5


def build_dir() -> str:
    return os.environ.get("FSDP_BUILD_DIR", os.path.join(_HERE, "..", "..", "build"))


def tool(path: str) -> str:
    full = os.path.join(build_dir(), path)
    if not os.access(full, os.X_OK):
        pytest.fail(f"{full} is missing: build the project first (scripts/build.sh) or set FSDP_BUILD_DIR")
    return full


def environment() -> dict:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return env


def driver(world: int, *args: str, expect_ok: bool = True) -> subprocess.CompletedProcess:
    cmd = [tool("tests/interop/hf_driver"), *args]
    if world > 1:
        cmd = [tool("tools/fsdprun/fsdprun"), "--standalone", "--nproc-per-node", str(world), *cmd]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=environment(), timeout=300)
    if expect_ok and proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited with {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def read_single(path: str) -> dict:
    from safetensors.torch import load_file
    out = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, name)))
    return out


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return ((ours.double() - reference.double()).abs().max() / reference.double().abs().max()).item()


def reference_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=tokens).logits.float()


def our_logits(hf_dir: str, tokens: torch.Tensor, workdir: str) -> torch.Tensor:
    from safetensors.torch import save_file
    tokens_file = os.path.join(workdir, "tokens.safetensors")
    save_file({"tokens": tokens.contiguous()}, tokens_file)
    out = os.path.join(workdir, "logits")
    shutil.rmtree(out, ignore_errors=True)
    driver(1, "logits", hf_dir, tokens_file, out)
    return read_single(out)["logits"]


@pytest.fixture
def workdir():
    path = tempfile.mkdtemp(prefix="fsdp-llama-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def tokens_for(model, batch: int = 2, seq: int = 24, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (batch, seq), generator=g)


def check_logits(family: str, workdir: str):
    model = make_model(family)
    hf = os.path.join(workdir, "hf")
    model.save_pretrained(hf)
    tokens = tokens_for(model)
    err = relative_error(our_logits(hf, tokens, workdir), reference_logits(model, tokens))
    print(f"{family}: max |difference| / max |logit| = {err:.3g}")
    assert err <= RTOL, f"{family}: logits differ from transformers' by {err:.3g} relative (> {RTOL})"


def test_logits_llama(workdir: str):
    check_logits("llama", workdir)


def test_logits_qwen2(workdir: str):
    check_logits("qwen2", workdir)


def test_logits_mistral(workdir: str):
    check_logits("mistral", workdir)


def test_saved_inv_freq(workdir: str):
    """Checkpoints converted by older transformers keep each layer's rotary inv_freq buffer as a
    tensor: transformers skips it on load, and so does our loader, with the same logits; a
    tensor that no rule skips is still refused by name."""
    from safetensors.torch import load_file, save_file
    model = make_model("llama")
    hf = os.path.join(workdir, "hf")
    model.save_pretrained(hf)
    path = os.path.join(hf, "model.safetensors")
    tensors = load_file(path)
    half = model.config.hidden_size // model.config.num_attention_heads // 2
    for i in range(model.config.num_hidden_layers):
        tensors[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = torch.ones(half)
    save_file(tensors, path, metadata={"format": "pt"})
    tokens = tokens_for(model)
    err = relative_error(our_logits(hf, tokens, workdir), reference_logits(model, tokens))
    assert err <= RTOL, f"with saved inv_freq buffers: logits differ from transformers' by {err:.3g} relative"
    assert_an_extra_tensor_is_refused(hf, tensors, "model.layers.0.self_attn.extra", workdir)


def assert_an_extra_tensor_is_refused(hf: str, tensors: dict, name: str, workdir: str) -> None:
    """`tensors` (the directory's model.safetensors, loadable) with one more tensor, `name`, that no
    rule skips: the driver refuses the directory naming it. our_logits wrote the tokens file."""
    from safetensors.torch import save_file
    save_file({**tensors, name: torch.zeros(2)}, os.path.join(hf, "model.safetensors"), metadata={"format": "pt"})
    tokens_file = os.path.join(workdir, "tokens.safetensors")
    proc = driver(1, "logits", hf, tokens_file, os.path.join(workdir, "out"), expect_ok=False)
    assert proc.returncode != 0 and f"'{name}'" in proc.stderr, proc.stderr[-2000:]


def test_export(workdir: str):
    from transformers import AutoModelForCausalLM
    model = make_model("llama")
    hf = os.path.join(workdir, "hf")
    model.save_pretrained(hf)
    tokens = tokens_for(model)
    for dtype in ("float32", "bfloat16"):
        out = os.path.join(workdir, f"export-{dtype}")
        driver(2, "export", hf, out, dtype)
        loaded, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True, dtype=torch.float32)
        assert not info["missing_keys"] and not info["unexpected_keys"], f"{dtype} export: {info}"
        assert loaded.config.tie_word_embeddings and loaded.config.num_key_value_heads == 2
        reference = reference_logits(loaded, tokens)
        if dtype == "float32":
            err = relative_error(reference, reference_logits(model, tokens))
            assert err <= RTOL, f"the fp32 export's logits differ from the original's by {err:.3g} relative"
        # Our model read back from the exported files (bf16 into fp32) gives transformers' logits.
        err = relative_error(our_logits(out, tokens, workdir), reference)
        assert err <= RTOL, f"{dtype} export read back: logits differ by {err:.3g} relative"


def test_fsdp_train_export(workdir: str):
    """fsdp-train from a Hugging Face directory (W = 2, FULL_SHARD, 2 steps), training.export hf:
    from_pretrained loads it with no missing or unexpected keys, its logits are those of our model
    read from the same files, and the weights did train."""
    from transformers import AutoModelForCausalLM
    model = make_model("llama")
    hf = os.path.join(workdir, "hf")
    model.save_pretrained(hf)
    config = os.path.join(workdir, "train.yaml")
    with open(config, "w") as f:
        f.write("data:\n  source: synthetic\noptimizer:\n  lr: 1.0e-2\n"
                "training:\n  steps: 2\n  micro_batch_size: 2\n  seq_len: 16\n  resume: never\n"
                "logging:\n  progress: off\n")
    out = os.path.join(workdir, "exported")
    cmd = [tool("tools/fsdprun/fsdprun"), "--standalone", "--nproc-per-node", "2", tool("tools/fsdp-train/fsdp-train"),
           config, f"--model.init_from={hf}", f"--training.export=hf:{out}",
           f"--fsdp_config.checkpoint_dir={os.path.join(workdir, 'checkpoints')}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=environment(), timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    loaded, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    tokens = tokens_for(model)
    reference = reference_logits(loaded, tokens)
    err = relative_error(our_logits(out, tokens, workdir), reference)
    assert err <= RTOL, f"the exported model's logits differ from ours by {err:.3g} relative"
    moved = relative_error(reference, reference_logits(model, tokens))
    assert moved > 1e-3, f"the export equals the initial model (relative change {moved:.3g}): did it train?"


def write_token_file(path: str, ids: torch.Tensor, vocab_size: int) -> None:
    """fsdp-train's token file (tools/fsdp-train/data/data.h): "FSDPTOK\\0", version 1, bytes per
    token, vocabulary size, count, then the ids, little-endian."""
    import struct
    width = 2 if vocab_size <= 65536 else 4
    body = ids.numpy().astype("<u%d" % width).tobytes()
    with open(path, "wb") as f:
        f.write(b"FSDPTOK\0" + struct.pack("<IIQQ", 1, width, vocab_size, ids.numel()) + body)


def test_eval_w2(workdir: str):
    """A save_pretrained directory evaluated by `fsdp-train eval` at W = 2 (model.init_from): the
    printed loss is transformers' mean cross-entropy over the same windows within 1e-5 relative."""
    model = make_model("llama")
    hf = os.path.join(workdir, "hf")
    model.save_pretrained(hf)
    world, rows, seq, batches = 2, 2, 16, 2
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (batches * world * rows * (seq + 1),), generator=g)
    tokens = os.path.join(workdir, "eval.tokens")
    write_token_file(tokens, ids, vocab)
    config = os.path.join(workdir, "eval.yaml")
    with open(config, "w") as f:
        f.write(f"data:\n  source: synthetic\ntraining:\n  micro_batch_size: {rows}\n  seq_len: {seq}\n"
                f"  resume: never\neval:\n  path: {tokens}\n  batches: {batches}\nlogging:\n  progress: off\n")
    cmd = [tool("tools/fsdprun/fsdprun"), "--standalone", "--nproc-per-node", str(world),
           tool("tools/fsdp-train/fsdp-train"), "eval", config, f"--model.init_from={hf}",
           f"--fsdp_config.checkpoint_dir={os.path.join(workdir, 'checkpoints')}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=environment(), timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    found = [line.split("eval loss:")[1] for line in proc.stdout.splitlines() if "eval loss:" in line]
    assert found, f"no 'eval loss:' line in:\n{proc.stdout[-3000:]}"
    ours = float(found[-1].split()[0])
    windows = ids.view(-1, seq + 1)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=windows[:, :-1]).logits.float()
        reference = torch.nn.functional.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten()).item()
    print(f"eval loss: ours {ours!r}, transformers {reference!r}")
    assert abs(ours - reference) <= RTOL * abs(reference), f"eval loss {ours} against transformers' {reference}"


def test_full_shard_w2(workdir: str):
    check_training(workdir, world=2, tp=1)


def test_dp2_tp2_w4(workdir: str):
    # 8 query and 4 key/value heads: each tp rank computes 2 key/value heads, so the order in
    # which they serve the query heads matters on every rank.
    check_training(workdir, world=4, tp=2, num_attention_heads=8, num_key_value_heads=4, head_dim=4)


def test_activation_checkpointing_w2(workdir: str):
    # Wide enough that the activations dominate the peak: 4 layers of 4 x 256 rows per rank.
    shape = dict(hidden_size=64, intermediate_size=256, num_hidden_layers=4, head_dim=16,
                 max_position_embeddings=256)
    # At 4 x 256 rows per rank the two sides' sums over 1024 rows round differently (transformers'
    # eager attention against ours), and five AdamW steps at lr 1e-2 turn those last bits into
    # parameter differences of up to 5e-4 (measured, with and without checkpointing alike); the
    # losses still agree to RTOL. What checkpointing must not change is checked exactly below:
    # each side's parameters with it are those without it.
    plain = check_training(os.path.join(workdir, "plain"), world=2, tp=1, rows=4, seq=256, param_atol=1e-3, **shape)
    checkpointed = check_training(os.path.join(workdir, "ac"), world=2, tp=1, rows=4, seq=256, ac=True,
                                  param_atol=1e-3, **shape)
    for side in ("ours", "reference"):
        for name, value in plain["params"][side].items():
            worst = (checkpointed["params"][side][name].float() - value.float()).abs().max().item()
            assert worst <= 1e-7, f"{side}: {name} differs by {worst:.3g} with activation checkpointing"
    for key, side in (("peak_tensor_bytes", "ours"), ("peak_rss_bytes", "ours"), ("peak_rss_bytes", "reference")):
        without, with_ac = plain[side][key], checkpointed[side][key]
        print(f"{side} {key}: {without / 2**20:.1f} MiB without activation checkpointing, "
              f"{with_ac / 2**20:.1f} MiB with it")
    assert checkpointed["ours"]["peak_tensor_bytes"] < plain["ours"]["peak_tensor_bytes"], (plain, checkpointed)
    assert checkpointed["reference"]["peak_rss_bytes"] < plain["reference"]["peak_rss_bytes"], (plain, checkpointed)
    # Checkpointing recomputes the same operations: our losses are those without it.
    for rank in range(2):
        for x, y in zip(checkpointed["losses"][rank], plain["losses"][rank]):
            assert abs(x - y) <= RTOL * abs(y), (checkpointed["losses"], plain["losses"])


def check_training(workdir: str, world: int, tp: int, rows: int = 2, seq: int = 16, ac: bool = False,
                   param_atol: float = 1e-5, **overrides) -> dict:
    """Trains both sides and compares them (losses to RTOL, final parameters to param_atol);
    returns each side's largest peak over the ranks ({"ours": {...}, "reference": {...}}), our
    per-rank losses and both sides' final parameters."""
    os.makedirs(workdir, exist_ok=True)
    from safetensors.torch import save_file
    model = make_model("llama", **overrides)
    hf = os.path.join(workdir, "hf")
    model.save_pretrained(hf)
    lr = 1e-2
    g = torch.Generator().manual_seed(7)
    batches = torch.randint(0, model.config.vocab_size, (STEPS, world * rows, seq + 1), generator=g)
    batches_file = os.path.join(workdir, "batches.safetensors")
    save_file({"batches": batches}, batches_file)
    ours, ref = os.path.join(workdir, "ours"), os.path.join(workdir, "reference")
    driver(world, "train", hf, batches_file, str(lr), ours, str(tp), *(["ac"] if ac else []))
    proc = subprocess.run([sys.executable, os.path.join(_HERE, "llama_fsdp2_reference.py"), hf, batches_file, str(lr),
                           ref, "--world", str(world), "--tp", str(tp), *(["--ac"] if ac else [])],
                          capture_output=True, text=True, env=environment(), timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    found, losses = [], []
    for rank in range(world):
        with open(os.path.join(ours, f"losses-{rank}.json")) as f:
            a = json.load(f)
        losses.append(a)
        with open(os.path.join(ref, f"losses-{rank}.json")) as f:
            b = json.load(f)
        assert len(a) == len(b) == STEPS
        for step, (x, y) in enumerate(zip(a, b), start=1):
            if abs(x - y) > RTOL * abs(y):
                found.append(f"rank {rank} step {step}: loss {x:.9g} against {y:.9g}")
    our_params, ref_params = read_single(os.path.join(ours, "final")), read_single(ref)
    assert set(our_params) == set(ref_params), sorted(set(our_params) ^ set(ref_params))
    for name in sorted(ref_params):
        worst = (our_params[name].float() - ref_params[name].float()).abs().max().item()
        if worst > param_atol:
            found.append(f"{name}: max |difference| {worst:.3g} > {param_atol:g}")
    assert not found, "\n".join(found)
    peaks = {}
    for side, folder in (("ours", ours), ("reference", ref)):
        for rank in range(world):
            with open(os.path.join(folder, f"peak-{rank}.json")) as f:
                for key, value in json.load(f).items():
                    peaks.setdefault(side, {})[key] = max(peaks.get(side, {}).get(key, 0), value)
    return {**peaks, "losses": losses, "params": {"ours": our_params, "reference": ref_params}}


def test_bad_input(workdir: str):
    model = make_model("llama")
    hf = os.path.join(workdir, "hf")
    model.save_pretrained(hf)
    from safetensors.torch import save_file
    tokens_file = os.path.join(workdir, "tokens.safetensors")
    save_file({"tokens": tokens_for(model)}, tokens_file)
    config_path = os.path.join(hf, "config.json")
    with open(config_path) as f:
        good = json.load(f)

    def refused(config: dict, *needles: str) -> None:
        with open(config_path, "w") as f:
            json.dump(config, f)
        proc = driver(1, "logits", hf, tokens_file, os.path.join(workdir, "out"), expect_ok=False)
        assert proc.returncode != 0, f"accepted: {config}"
        for needle in needles:
            assert needle in proc.stderr, f"'{needle}' not in: {proc.stderr[-2000:]}"

    # The family is chosen from "architectures" (as fsdp-train chooses it): one no family computes
    # is refused by name.
    refused({**good, "architectures": ["GPTNeoXForCausalLM"]}, "config.json", "'architectures'", "GPTNeoXForCausalLM")
    refused({k: v for k, v in good.items() if k != "hidden_size"}, "config.json", "'hidden_size'", "missing")
    refused({**good, "hidden_act": "gelu"}, "config.json", "'hidden_act'")
    # The weights of another shape than config.json's model: the tensor is named.
    refused({**good, "intermediate_size": good["intermediate_size"] * 2}, "mlp.gate_proj.weight", "shape")


ROPE_BASE = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 96, "hidden_size": 32,
             "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "max_position_embeddings": 64}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}
ROPE_CASES = {
    # name: (the config's rope keys, whether a disagreement note is expected)
    "old style only": ({"rope_theta": 500000.0, "rope_scaling": {**LLAMA3, "type": "llama3"}}, False),
    "old style, theta only": ({"rope_theta": 250000.0}, False),
    "new style only": ({"rope_parameters": {"rope_type": "default", "rope_theta": 1234.0}}, False),
    "new style llama3": ({"rope_parameters": {**LLAMA3, "rope_theta": 500000.0}}, False),
    "both agreeing": ({"rope_parameters": {**LLAMA3, "rope_theta": 8.0e5}, "rope_scaling": {**LLAMA3, "rope_theta": 8.0e5}},
                      False),
    "both agreeing, old keys": ({"rope_theta": 99.0, "rope_parameters": {"rope_type": "default", "rope_theta": 99.0},
                                 "rope_scaling": {"type": "default"}}, False),
    "both disagreeing": ({"rope_parameters": {"rope_type": "default", "rope_theta": 1234.0}, "rope_scaling": LLAMA3},
                         True),
    "both disagreeing in theta": ({"rope_theta": 77.0, "rope_parameters": {"rope_type": "default", "rope_theta": 1234.0},
                                   "rope_scaling": {"rope_type": "default"}}, True),
    "both disagreeing, new llama3": ({"rope_parameters": LLAMA3, "rope_scaling": {"rope_type": "default"}}, True),
    "empty rope_scaling": ({"rope_scaling": {}, "rope_parameters": {**LLAMA3, "rope_theta": 3.0e5}}, False),
    "null rope_parameters": ({"rope_theta": 42.0, "rope_parameters": None}, False),
}


def rope_of_autoconfig(path: str) -> dict:
    from transformers import AutoConfig
    p = dict(AutoConfig.from_pretrained(path).rope_parameters)
    out = {"rope_type": p["rope_type"], "rope_theta": float(p["rope_theta"])}
    if p["rope_type"] == "llama3":
        for key in ("factor", "low_freq_factor", "high_freq_factor"):
            out[key] = float(p[key])
        out["original_max_position_embeddings"] = int(p["original_max_position_embeddings"])
    return out


def test_rope_precedence(workdir: str):
    for name, (keys, disagree) in ROPE_CASES.items():
        hf = os.path.join(workdir, name.replace(" ", "_").replace(",", ""))
        os.makedirs(hf)
        with open(os.path.join(hf, "config.json"), "w") as f:
            json.dump({**ROPE_BASE, **keys}, f)
        expected = rope_of_autoconfig(hf)
        proc = driver(1, "rope", os.path.join(hf, "config.json"))
        ours = json.loads(proc.stdout)
        notes = ours.pop("notes")
        assert ours == expected, f"{name}: ours {ours}, AutoConfig {expected}"
        assert len(notes) == (1 if disagree else 0), f"{name}: notes {notes}"
        if disagree:
            assert "rope_scaling is used" in notes[0], notes[0]
    # transformers reads the yarn rope_scaling beside a default rope_parameters: so a yarn model,
    # which is refused by the key AutoConfig reads rather than trained as the default one.
    hf = os.path.join(workdir, "yarn")
    os.makedirs(hf)
    with open(os.path.join(hf, "config.json"), "w") as f:
        json.dump({**ROPE_BASE, "rope_parameters": {"rope_type": "default"},
                   "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, f)
    assert rope_of_autoconfig(hf)["rope_type"] == "yarn"
    proc = driver(1, "rope", os.path.join(hf, "config.json"), expect_ok=False)
    assert proc.returncode != 0 and "key 'rope_scaling.rope_type' is \"yarn\"" in proc.stderr, proc.stderr
