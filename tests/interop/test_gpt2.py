"""fsdp::models::Gpt2 against transformers' GPT2LMHeadModel, the oracle: every model here is a
random-initialized config (no downloads) written with save_pretrained, read by hf_driver
(tests/interop/hf_driver.cpp) or fsdp-train through config.json and the safetensors files.

- logits at W = 1 within 1e-5 relative (fp32): GPT-2's defaults (tied head, gelu_new, scaled
  attention), and an untied head with n_inner, gelu (erf), unscaled attention, another epsilon;
- hub_layout: the Hub's original files (no "transformer." prefix, the causal masks kept as
  tensors) load as transformers loads them, with its logits;
- export: the directory hf_driver writes (W = 2) loads with from_pretrained, no missing or
  unexpected keys, and gives the same logits; a bf16 export reads back into an fp32 model;
- fsdp_train_export: fsdp-train from a save_pretrained directory (W = 2), training.export hf,
  then from_pretrained: no missing or unexpected keys, logits equal to ours on the exported files;
- eval_w2: `fsdp-train eval` at W = 2 prints transformers' mean cross-entropy over the same
  windows within 1e-5 relative;
- full_shard_w2: 5 AdamW steps at W = 2 against transformers' model under PyTorch's fully_shard
  (one call per block and the root, llama_fsdp2_reference.py), from the same weights and batches:
  per-rank losses within 1e-5 relative, final parameters within 1e-5 (the keys' third of
  c_attn.bias, whose gradient is only rounding noise, within AdamW's 2 lr x steps);
- activation_checkpointing_w2: the same with every block checkpointed, against transformers' model
  with checkpoint_wrapper around each block under fully_shard: the same losses, and a lower
  measured peak on both sides (ours: peak tensor bytes of the steps; the reference's: peak RSS);
- bad_input: options the model does not compute, a tensor of the wrong shape and tensor
  parallelism each stop with an error naming the key, the tensor or the option.

    FSDP_BUILD_DIR=build $FSDP_PYTHON -m pytest tests/interop/test_gpt2.py -k logits
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

pytest.importorskip("transformers", reason="transformers is not installed (scripts/install-deps.sh installs it)")
pytest.importorskip("safetensors", reason="safetensors is not installed (scripts/install-deps.sh installs it)")

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)

from test_llama import (  # noqa: E402
    assert_an_extra_tensor_is_refused, driver, environment, read_single, reference_logits, relative_error, tool,
    write_token_file)

RTOL = 1e-5
STEPS = 5

# Small, fp32, no dropout (the training check compares losses step by step).
COMMON = dict(vocab_size=96, n_positions=64, n_embd=32, n_layer=2, n_head=4, embd_pdrop=0.0, attn_pdrop=0.0,
              resid_pdrop=0.0, bos_token_id=0, eos_token_id=0)
VARIANTS = {
    "default": {},
    "untied": dict(tie_word_embeddings=False, n_inner=48, activation_function="gelu", scale_attn_weights=False,
                   layer_norm_epsilon=1e-3),
}


def make_model(variant: str = "default", seed: int = 0, **overrides):
    """Every weight drawn (the LayerNorms' weights around 1) so that no part of the model is an
    identity that hides an error."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(seed)
    config = GPT2Config(**{**COMMON, **VARIANTS[variant], **overrides})
    config._attn_implementation = "eager"
    model = GPT2LMHeadModel(config).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if ".ln_" in name and name.endswith("weight") else 0.0))
    return model


def fsdp_train(workdir: str, world: int, *args: str) -> subprocess.CompletedProcess:
    cmd = [tool("tools/fsdprun/fsdprun"), "--standalone", "--nproc-per-node", str(world),
           tool("tools/fsdp-train/fsdp-train"), *args,
           f"--fsdp_config.checkpoint_dir={os.path.join(workdir, 'checkpoints')}"]
    return subprocess.run(cmd, capture_output=True, text=True, env=environment(), timeout=300)


def our_logits(hf_dir: str, tokens: torch.Tensor, workdir: str) -> torch.Tensor:
    from safetensors.torch import save_file
    tokens_file = os.path.join(workdir, "tokens.safetensors")
    save_file({"tokens": tokens.contiguous()}, tokens_file)
    out = os.path.join(workdir, "logits")
    shutil.rmtree(out, ignore_errors=True)
    driver(1, "logits", hf_dir, tokens_file, out)
    return read_single(out)["logits"]


def tokens_for(model, batch: int = 2, seq: int = 24, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (batch, seq), generator=g)


@pytest.fixture
def workdir():
    path = tempfile.mkdtemp(prefix="fsdp-gpt2-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def saved(model, workdir: str) -> str:
    hf = os.path.join(workdir, "hf")
    model.save_pretrained(hf)
    return hf


def check_logits(variant: str, workdir: str) -> None:
    model = make_model(variant)
    hf = saved(model, workdir)
    tokens = tokens_for(model)
    err = relative_error(our_logits(hf, tokens, workdir), reference_logits(model, tokens))
    print(f"gpt2 {variant}: max |difference| / max |logit| = {err:.3g}")
    assert err <= RTOL, f"gpt2 {variant}: logits differ from transformers' by {err:.3g} relative (> {RTOL})"


def test_logits(workdir: str):
    check_logits("default", workdir)


def test_logits_untied(workdir: str):
    check_logits("untied", workdir)


def test_hub_layout(workdir: str):
    """The Hub's original GPT-2 files (openai-community/gpt2 and its sizes): the base model's
    tensors named without "transformer.", each block's causal mask kept as "h.N.attn.bias" (and
    "h.N.attn.masked_bias" in older ones), the tied head left out. transformers loads them; so
    does our loader, with transformers' logits of the same files; a tensor that no rule skips is
    still refused by name."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM
    model = make_model()
    hf = saved(model, workdir)
    path = os.path.join(hf, "model.safetensors")
    n = model.config.n_positions
    hub = {k.removeprefix("transformer."): v for k, v in load_file(path).items() if k != "lm_head.weight"}
    assert not any(k.startswith("transformer.") for k in hub)
    for i in range(model.config.n_layer):
        hub[f"h.{i}.attn.bias"] = torch.tril(torch.ones(n, n)).view(1, 1, n, n)
        hub[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    save_file(hub, path, metadata={"format": "pt"})
    tokens = tokens_for(model)
    loaded = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    reference = reference_logits(loaded, tokens)
    assert relative_error(reference, reference_logits(model, tokens)) <= RTOL, "transformers read the files otherwise"
    err = relative_error(our_logits(hf, tokens, workdir), reference)
    assert err <= RTOL, f"the Hub's layout: logits differ from transformers' by {err:.3g} relative"
    assert_an_extra_tensor_is_refused(hf, hub, "h.0.attn.extra", workdir)


def test_export(workdir: str):
    from transformers import AutoModelForCausalLM
    model = make_model()
    hf = saved(model, workdir)
    tokens = tokens_for(model)
    for dtype in ("float32", "bfloat16"):
        out = os.path.join(workdir, f"export-{dtype}")
        driver(2, "export", hf, out, dtype)
        loaded, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True, dtype=torch.float32)
        assert not info["missing_keys"] and not info["unexpected_keys"], f"{dtype} export: {info}"
        assert type(loaded).__name__ == "GPT2LMHeadModel" and loaded.config.tie_word_embeddings
        reference = reference_logits(loaded, tokens)
        if dtype == "float32":
            err = relative_error(reference, reference_logits(model, tokens))
            print(f"fp32 export read by from_pretrained: logits differ by {err:.3g} relative")
            assert err <= RTOL, f"the fp32 export's logits differ from the original's by {err:.3g} relative"
        err = relative_error(our_logits(out, tokens, workdir), reference)
        assert err <= RTOL, f"{dtype} export read back: logits differ by {err:.3g} relative"


def test_fsdp_train_export(workdir: str):
    """fsdp-train from a Hugging Face directory (W = 2, FULL_SHARD, 2 steps), training.export hf:
    from_pretrained loads it with no missing or unexpected keys, its logits are those of our model
    read from the same files, and the weights did train."""
    from transformers import AutoModelForCausalLM
    model = make_model()
    hf = saved(model, workdir)
    config = os.path.join(workdir, "train.yaml")
    with open(config, "w") as f:
        f.write("data:\n  source: synthetic\noptimizer:\n  lr: 1.0e-2\n"
                "training:\n  steps: 2\n  micro_batch_size: 2\n  seq_len: 16\n  resume: never\n"
                "logging:\n  progress: off\n")
    out = os.path.join(workdir, "exported")
    proc = fsdp_train(workdir, 2, config, f"--model.init_from={hf}", f"--training.export=hf:{out}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    loaded, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    tokens = tokens_for(model)
    reference = reference_logits(loaded, tokens)
    err = relative_error(our_logits(out, tokens, workdir), reference)
    assert err <= RTOL, f"the exported model's logits differ from ours by {err:.3g} relative"
    moved = relative_error(reference, reference_logits(model, tokens))
    assert moved > 1e-3, f"the export equals the initial model (relative change {moved:.3g}): did it train?"


def test_eval_w2(workdir: str):
    """A save_pretrained directory evaluated by `fsdp-train eval` at W = 2 (model.init_from): the
    printed loss is transformers' mean cross-entropy over the same windows within 1e-5 relative."""
    model = make_model()
    hf = saved(model, workdir)
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
    proc = fsdp_train(workdir, world, "eval", config, f"--model.init_from={hf}")
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
    check_training(workdir)


def test_activation_checkpointing_w2(workdir: str):
    # Wide enough that the activations dominate the peak: 4 blocks of 4 x 128 rows per rank.
    shape = dict(n_embd=64, n_layer=4, n_positions=128)
    # At this size AdamW's normalised step turns the rounding noise of gradients near zero into
    # moves of up to lr for single elements (as for the keys' bias), on both sides alike: the
    # parameters are compared as whole tensors, the losses step by step.
    plain = check_training(os.path.join(workdir, "plain"), rows=4, seq=128, whole_tensors=True, **shape)
    checkpointed = check_training(os.path.join(workdir, "ac"), rows=4, seq=128, ac=True, whole_tensors=True, **shape)
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


def check_training(workdir: str, rows: int = 2, seq: int = 16, ac: bool = False, whole_tensors: bool = False,
                   **overrides) -> dict:
    """5 AdamW steps at W = 2 on both sides from the same weights and batches (with ac, every
    block checkpointed: ours by CausalLM, transformers' by checkpoint_wrapper); compares them and
    returns each side's largest peak over the ranks and our per-rank losses. The losses within
    1e-5 relative; each final parameter element within 1e-5, or with whole_tensors each tensor
    within 1e-4 relative (the norm of the difference over the reference's)."""
    from safetensors.torch import save_file
    os.makedirs(workdir, exist_ok=True)
    world, lr = 2, 1e-2
    model = make_model(**overrides)
    hf = saved(model, workdir)
    g = torch.Generator().manual_seed(7)
    batches = torch.randint(0, model.config.vocab_size, (STEPS, world * rows, seq + 1), generator=g)
    batches_file = os.path.join(workdir, "batches.safetensors")
    save_file({"batches": batches}, batches_file)
    ours, ref = os.path.join(workdir, "ours"), os.path.join(workdir, "reference")
    driver(world, "train", hf, batches_file, str(lr), ours, "1", *(["ac"] if ac else []))
    proc = subprocess.run([sys.executable, os.path.join(_HERE, "llama_fsdp2_reference.py"), hf, batches_file, str(lr),
                           ref, "--world", str(world), *(["--ac"] if ac else [])],
                          capture_output=True, text=True, env=environment(), timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    found, losses = [], []
    for rank in range(world):
        with open(os.path.join(ours, f"losses-{rank}.json")) as f:
            a = json.load(f)
        with open(os.path.join(ref, f"losses-{rank}.json")) as f:
            b = json.load(f)
        assert len(a) == len(b) == STEPS
        losses.append(a)
        print(f"rank {rank} losses: ours {a}, FSDP2 {b}")
        for step, (x, y) in enumerate(zip(a, b), start=1):
            if abs(x - y) > RTOL * abs(y):
                found.append(f"rank {rank} step {step}: loss {x:.9g} against {y:.9g}")
    our_params, ref_params = read_single(os.path.join(ours, "final")), read_single(ref)
    assert set(our_params) == set(ref_params), sorted(set(our_params) ^ set(ref_params))
    dim = model.config.n_embd
    for name in sorted(ref_params):
        ours_t, ref_t = our_params[name].double(), ref_params[name].double()
        if name.endswith("attn.c_attn.bias"):
            # The keys' bias has no gradient in exact arithmetic: q . (k + b) moves every score of
            # a query by the same q . b, which the softmax cancels. Its gradient is rounding noise,
            # which AdamW's normalised step turns into moves of up to lr per step on either side:
            # bounded by that; the queries' and values' biases are compared as every parameter.
            keys = (ours_t[dim:2 * dim] - ref_t[dim:2 * dim]).abs().max().item()
            print(f"{name}: keys' bias max |difference| {keys:.3g} (rounding noise, bound {2 * lr * STEPS})")
            if keys > 2 * lr * STEPS:
                found.append(f"{name}: the keys' bias moved {keys:.3g} > {2 * lr * STEPS} apart")
            ours_t, ref_t = torch.cat([ours_t[:dim], ours_t[2 * dim:]]), torch.cat([ref_t[:dim], ref_t[2 * dim:]])
        if whole_tensors:
            err = ((ours_t - ref_t).norm() / ref_t.norm()).item()
            if err > 1e-4:
                found.append(f"{name}: |difference| / |reference| {err:.3g} > 1e-4")
            continue
        worst = (ours_t - ref_t).abs().max().item()
        if worst > 1e-5:
            found.append(f"{name}: max |difference| {worst:.3g} > 1e-5")
    assert not found, "\n".join(found)
    peaks = {}
    for side, folder in (("ours", ours), ("reference", ref)):
        for rank in range(world):
            with open(os.path.join(folder, f"peak-{rank}.json")) as f:
                for key, value in json.load(f).items():
                    peaks.setdefault(side, {})[key] = max(peaks.get(side, {}).get(key, 0), value)
    return {**peaks, "losses": losses}


def test_bad_input(workdir: str):
    model = make_model()
    hf = saved(model, workdir)
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

    refused({**good, "scale_attn_by_inverse_layer_idx": True}, "config.json", "'scale_attn_by_inverse_layer_idx'")
    refused({**good, "reorder_and_upcast_attn": True}, "config.json", "'reorder_and_upcast_attn'")
    refused({**good, "add_cross_attention": True}, "config.json", "'add_cross_attention'")
    refused({**good, "activation_function": "relu"}, "config.json", "'activation_function'")
    refused({**good, "n_embd": "32"}, "config.json", "'n_embd'", "not an integer")
    # The weights of another shape than config.json's model: the tensor is named.
    refused({**good, "n_inner": 64}, "mlp.c_fc.weight", "shape")
    with open(config_path, "w") as f:
        json.dump(good, f)
    # No tensor-parallel plan: fsdp-train refuses it by name.
    yaml = os.path.join(workdir, "tp.yaml")
    with open(yaml, "w") as f:
        f.write("data:\n  source: synthetic\ntraining:\n  steps: 1\n  micro_batch_size: 2\n  seq_len: 16\n"
                "  resume: never\nlogging:\n  progress: off\n")
    proc = fsdp_train(workdir, 2, yaml, f"--model.init_from={hf}", "--fsdp_config.model_parallel_size=2")
    assert proc.returncode != 0 and "not supported yet for gpt2" in proc.stdout + proc.stderr, (
        proc.stdout[-2000:] + proc.stderr[-2000:])
