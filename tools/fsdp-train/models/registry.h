// registry.h — the model families fsdp-train trains, registered in one place (registry.cpp),
// and the one choice of a family for a run: model.architecture, or the "architectures" of the
// config.json that shapes the model (model.hf_config, or model.init_from's when it is a Hugging
// Face directory). The family reads its args then, once.
#pragma once

#include "config/config.h"
#include "models/family.h"

#include <memory>
#include <string>
#include <vector>

namespace fsdp {
namespace train {

// The family this configuration trains, its args read (the YAML's model keys, or config.json).
// Throws ConfigError naming the key: an unknown model.architecture; a config.json whose
// "architectures" no family computes, or that names another family than model.architecture; a
// key that does not apply to the family; and what reading its args refuses (naming the file and
// the key). Reads config.json once; touches no other file.
std::unique_ptr<const ModelFamily> choose_family(const TrainConfig& cfg);

// The families' names (model.architecture's values), in registration order.
std::vector<std::string> family_names();

// Whether `dir` is a Hugging Face model directory: a directory holding config.json beside its
// weights. The one place fsdp-train decides it.
bool is_hf_model_dir(const std::string& dir);

}  // namespace train
}  // namespace fsdp
