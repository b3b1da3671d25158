// run_identity.h — what a checkpoint must share with a configuration for resuming from it to
// continue the same run: the model's shape, the initialisation seed and the data (source, file
// and data seed). Recorded in every checkpoint's metadata.json (CheckpointManager attributes)
// and compared when training.resume: auto picks a checkpoint, so that a job that finds
// another job's checkpoints in its fsdp_config.checkpoint_dir stops instead of continuing
// someone else's run. What may change between runs (step count, learning rate, batch size,
// world size, logging) is left out.
#pragma once

#include "config/config.h"
#include "models/model_shape.h"

#include <map>
#include <string>
#include <vector>

namespace fsdp {
namespace train {

// Config key -> value, as the configuration resolves it (model.* after the preset, data.path
// made absolute). Attribute names are the config keys prefixed with "fsdp-train.".
std::map<std::string, std::string> run_identity(const TrainConfig& cfg, const ModelShape& shape);

// One line per key whose value differs, e.g. "checkpoint step_40 was written with
// training.seed 1, this config has training.seed 2"; a key the checkpoint does not record
// (written before that key was recorded) is not a difference. `checkpoint` names it.
std::vector<std::string> identity_differences(const std::string& checkpoint,
                                              const std::map<std::string, std::string>& recorded,
                                              const std::map<std::string, std::string>& ours);

}  // namespace train
}  // namespace fsdp
