// hf_checkpoint.h — a Hugging Face model directory in and out of a model of a family with a
// Hugging Face format (models/family.h): config.json from the family, the weights as safetensors
// under the names the family gives them (ModelFamily::hf_state_dict), each rank reading only its
// own pieces through the library's validated reader (fsdp/safetensors.h), which converts
// floating dtypes.
#pragma once

#include "models/family.h"

#include <fsdp/state_dict.h>

#include <c10/core/ScalarType.h>
#include <torch/nn/module.h>

#include <string>

namespace fsdp {
namespace train {

// Loads the weights of the Hugging Face directory `dir` (model.safetensors, or the files of
// model.safetensors.index.json) into `model`, already built from dir/config.json and sharded
// (fully_shard and/or tp): each rank reads only the byte ranges of its own pieces, one tensor at
// a time, straight into its parameters (fsdp::load_safetensors_into), so that loading takes no
// memory beside the model's but the tensor being read. Tensors stored as f64, f32, bf16 or f16
// are converted to the parameters' dtype. A tensor the family's Hugging Face names leave out (a
// tied head) is another's: loading that one loads it. Not collective (file reads only). Throws
// c10::Error naming the file and the tensor on a missing or unexpected tensor (before anything
// is written), a shape that differs from config.json's model, a dtype that is not floating or a
// malformed file (the tensors before it are then written: callers that must agree across ranks
// check afterwards and stop together).
void load_hf_weights(const std::string& dir, const ModelFamily& family, torch::nn::Module& model);

// Writes `model` as a Hugging Face directory under `dir`: config.json (rank 0), one safetensors
// file per rank and model.safetensors.index.json, every tensor in `dtype` (float32, bfloat16 or
// float16), under the family's names, such that transformers' from_pretrained(dir) loads it with
// no missing or unexpected keys. Collective over the world (as save_safetensors); blocks until
// every file is written. Throws c10::Error for another dtype, ConfigError for a family without a
// Hugging Face format, and what save_safetensors throws.
void save_hf(const std::string& dir, const ModelFamily& family, torch::nn::Module& model, at::ScalarType dtype);

}  // namespace train
}  // namespace fsdp
