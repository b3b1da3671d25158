// layer: models (what may include what: docs/architecture.md)
/// \file
/// fsdp/models/llama_hf.h — a Hugging Face model directory's config.json read into LlamaArgs
/// (fsdp/models/llama.h), and LlamaArgs written back as one, for the architectures the Llama
/// decoder computes exactly: LlamaForCausalLM, MistralForCausalLM (without a sliding window
/// shorter than the sequence) and Qwen2ForCausalLM (q/k/v biases, no sliding window).
///
/// \code{.cpp}
///   fsdp::models::LlamaArgs args = fsdp::models::llama_args_from_hf_config("ckpt/config.json", 256);
///   std::string json = fsdp::models::hf_config_json(args, at::kBFloat16);
/// \endcode
///
/// The weights themselves are safetensors (fsdp/safetensors.h) under transformers' names, which
/// are the Llama module's own.
#pragma once

#include <fsdp/models/llama.h>

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <string>
#include <vector>

namespace fsdp {
namespace models {

/// Reads `config_path` (a config.json). The rotary embeddings are read as transformers 5.25's
/// AutoConfig reads them: the older "rope_scaling" when it is set (not null, not empty), else
/// "rope_parameters"; the type from its "rope_type", else its older "type", else "default"
/// ("default" and "llama3" are computed); the base from its "rope_theta", else the top-level
/// "rope_theta", else 10000; a llama3 "original_max_position_embeddings" from
/// max_position_embeddings when missing. Where both objects are set and differ, a line saying
/// which one is used (rope_scaling, as transformers does) is appended to `notes` (when given).
/// seq_len is the longest sequence the caller will run (0: not known yet; check it later with
/// LlamaArgs::check_sequence_length), checked against a Mistral
/// sliding_window. Not collective; reads one file.
/// Throws c10::Error naming the file and the key on: an unreadable file or one that is not a JSON
/// object; "architectures" missing or naming another model; a required field missing or of the
/// wrong type (vocab_size, hidden_size, intermediate_size, num_hidden_layers,
/// num_attention_heads, max_position_embeddings); an option the decoder does not compute
/// (hidden_act other than silu, mlp_bias, another rope type, a sliding window shorter than
/// seq_len, Qwen2's use_sliding_window); and what LlamaArgs::check throws.
LlamaArgs llama_args_from_hf_config(const std::string& config_path, int64_t seq_len,
                                    std::vector<std::string>* notes = nullptr);

/// llama_args_from_hf_config of config.json's text, already read; `config_path` names it in the
/// errors. Throws what llama_args_from_hf_config throws, but never reads a file.
LlamaArgs llama_args_from_hf_config_text(const std::string& text, const std::string& config_path, int64_t seq_len,
                                         std::vector<std::string>* notes = nullptr);

/// The "architectures" a config.json may name for this decoder: LlamaForCausalLM,
/// MistralForCausalLM, Qwen2ForCausalLM.
const std::vector<std::string>& llama_hf_architectures();

/// The config.json of `args` (with "dtype" and "torch_dtype" naming `dtype`: float32, bfloat16 or
/// float16) that transformers' AutoConfig reads back into the same model. Throws c10::Error for
/// another dtype.
std::string hf_config_json(const LlamaArgs& args, at::ScalarType dtype);

}  // namespace models
}  // namespace fsdp
