// layer: models (what may include what: docs/architecture.md)
/// \file
/// fsdp/models/gpt2_hf.h — a Hugging Face GPT-2 directory's config.json (transformers'
/// GPT2Config) read into Gpt2Args (fsdp/models/gpt2.h), and Gpt2Args written back as one.
///
/// \code{.cpp}
///   fsdp::models::Gpt2Args args = fsdp::models::gpt2_args_from_hf_config_text(text, "ckpt/config.json");
///   std::string json = fsdp::models::gpt2_hf_config_json(args, at::kBFloat16);
/// \endcode
///
/// The weights themselves are safetensors (fsdp/safetensors.h) under transformers' names, which
/// are the Gpt2 module's own.
#pragma once

#include <fsdp/models/gpt2.h>

#include <c10/core/ScalarType.h>

#include <string>
#include <vector>

namespace fsdp {
namespace models {

/// Reads config.json's text (`config_path` names it in the errors; no file is read) as
/// transformers' GPT2Config reads it: a key that is missing or null takes GPT2Config's default
/// (n_inner's null: 4 n_embd; the dropouts 0.1), and the sizes may also be given under their
/// aliases (hidden_size, max_position_embeddings, num_hidden_layers, num_attention_heads). Not
/// collective. Throws c10::Error naming the file and the key on: text that is not a JSON object;
/// "architectures" missing or naming another model; a field of the wrong type; an option the
/// model does not compute (scale_attn_by_inverse_layer_idx, reorder_and_upcast_attn,
/// add_cross_attention true; an activation_function other than gelu_new, gelu_pytorch_tanh,
/// gelu); and what Gpt2Args::check throws.
Gpt2Args gpt2_args_from_hf_config_text(const std::string& text, const std::string& config_path);

/// The "architectures" a config.json may name for this model: GPT2LMHeadModel.
const std::vector<std::string>& gpt2_hf_architectures();

/// The config.json of `args` (with "dtype" and "torch_dtype" naming `dtype`: float32, bfloat16
/// or float16) that transformers' AutoConfig reads back into the same model. Throws c10::Error for
/// another dtype.
std::string gpt2_hf_config_json(const Gpt2Args& args, at::ScalarType dtype);

}  // namespace models
}  // namespace fsdp
