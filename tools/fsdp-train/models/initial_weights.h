// initial_weights.h — model.init_from: the weights a run starts from, loaded into whatever the
// strategy made of the model.
#pragma once

#include "config/config.h"
#include "models/family.h"

#include <torch/nn/module.h>

#include <functional>
#include <string>

namespace fsdp {
namespace train {

// Collective over the world: every rank calls it. A safetensors directory is read a rank's
// rows at a time (a model built sharded is never whole on any rank) and the ranks agree before
// any weight is replaced; a torch.save file is read whole by every rank. Throws ConfigError for
// a path that does not exist or is the wrong kind of directory, and std::runtime_error naming
// the file for one that does not load or holds NaN or infinite values. A Hugging Face model
// directory (config.json beside the safetensors, which chose the family) loads under the
// family's names as hf_checkpoint.h reads it, a rank's rows at a time, floating dtypes
// converted. `note` receives what is worth saying (the ignored entries of a bundle).
void load_initial_weights(const TrainConfig& cfg, const ModelFamily& family, torch::nn::Module& model,
                          const std::function<void(const std::string&)>& note);

}  // namespace train
}  // namespace fsdp
