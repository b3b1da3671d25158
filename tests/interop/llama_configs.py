"""The random-initialized transformers models of test_llama.py: small, fp32, with every weight
drawn (the norms around 1) so that no part of the model is an identity that hides an error."""

from __future__ import annotations

import torch

COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, max_position_embeddings=64, rms_norm_eps=1e-6,
              attn_implementation="eager")


def make_config(family: str, **overrides):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config
    if family == "llama":
        # GQA, llama3 rope scaling with a short original context (so the scaling changes the
        # frequencies the test sequences use), tied embeddings.
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
        return LlamaConfig(**{**COMMON, **overrides}, tie_word_embeddings=True, rope_parameters=rope)
    if family == "qwen2":
        return Qwen2Config(**COMMON, tie_word_embeddings=False, rope_parameters={"rope_type": "default",
                                                                                 "rope_theta": 1000000.0})
    if family == "mistral":
        return MistralConfig(**COMMON, tie_word_embeddings=False, sliding_window=None)
    raise ValueError(f"unknown family {family}")


def make_model(family: str, seed: int = 0, **overrides):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(make_config(family, **overrides), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if "norm" in name else 0.0))
    return model
