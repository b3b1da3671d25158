// hf_checkpoint.h — a Hugging Face model directory in and out of a Llama-family model
// (fsdp/models/llama.h): config.json through fsdp/models/llama_hf.h, the weights as safetensors
// under transformers' names (fsdp/safetensors.h), each rank reading only its own pieces.
#pragma once

#include <fsdp/models/llama.h>
#include <fsdp/state_dict.h>

#include <c10/core/ScalarType.h>

#include <string>

namespace fsdp {
namespace train {

// True when `dir` holds a config.json (a Hugging Face model directory, not a bare safetensors one).
bool is_hf_model_dir(const std::string& dir);

// Loads the weights of the Hugging Face directory `dir` (model.safetensors, or the files of
// model.safetensors.index.json) into `model`, already built from dir/config.json and sharded
// (fully_shard and/or tp): each rank reads only the byte ranges of its own pieces, one tensor at
// a time, straight into its parameters (fsdp::load_safetensors_into), so that loading takes no
// memory beside the model's but the tensor being read. Tensors stored as bf16, fp16 or fp32 are
// converted to the parameters' dtype. With tied embeddings the file holds
// model.embed_tokens.weight only (as transformers writes it), and lm_head.weight is the same
// tensor. Not collective (file reads only). Throws c10::Error naming the file and the tensor on
// a missing or unexpected tensor (before anything is written), a shape that differs from
// config.json's model, an unsupported dtype or an unreadable file (the tensors before it are
// then written: callers that must agree across ranks check afterwards and stop together).
void load_hf_weights(const std::string& dir, models::LlamaImpl& model);

// Writes `model` as a Hugging Face directory under `dir`: config.json (rank 0), one safetensors
// file per rank and model.safetensors.index.json, every tensor in `dtype` (float32, bfloat16 or
// float16), under transformers' names (lm_head.weight left out when tied, as save_pretrained
// does), such that transformers.AutoModelForCausalLM.from_pretrained(dir) loads it with no
// missing or unexpected keys. Collective over the world (as save_safetensors); blocks until
// every file is written. Throws c10::Error for another dtype, and what save_safetensors throws.
void save_hf(const std::string& dir, models::LlamaImpl& model, at::ScalarType dtype);

}  // namespace train
}  // namespace fsdp
