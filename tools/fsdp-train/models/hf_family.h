// hf_family.h — what the families shaped by a Hugging Face config.json share on the trainer's
// side: the refusals of keys their config.json decides, and their weights under
// transformers' names with a tied head left out, as save_pretrained leaves it out.
#pragma once

#include "config/config.h"
#include "models/family.h"

#include <fsdp/state_dict.h>

#include <torch/nn/module.h>

#include <string>

namespace fsdp {
namespace train {

// Throws ConfigError naming the first of the YAML's model size keys (model.n_layers, dim, ...,
// dropout_p) that the configuration sets: they shape nothing of `family`, whose shape is its
// config.json's, and are refused rather than ignored.
void refuse_size_keys(const ModelConfig& model, const std::string& family);

// The config.json that shapes `family`; throws ConfigError saying how to give one when the
// configuration names none.
const std::string& require_config_json(const FamilySource& source, const std::string& family);

// The model's sharded state dict without lm_head.weight when the head is tied to the embedding
// (the same tensor, saved once under the embedding's name).
ShardedStateDict without_tied_head(torch::nn::Module& model, bool tie_word_embeddings);

}  // namespace train
}  // namespace fsdp
