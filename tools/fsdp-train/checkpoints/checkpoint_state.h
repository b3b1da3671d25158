// checkpoint_state.h — what an fsdp-train checkpoint holds, under which keys, and how it is put
// back. One key space for model, optimizer and the loop's own state:
//
//   model.<fqn>                           the model's sharded state dict (sharded_state_dict)
//   optim.state.<fqn>.<name>              AdamW's per-parameter state (sharded_optimizer_state_dict)
//   optim.param_groups.<fqn>.<option>     AdamW's options per parameter
//   trainer.counters                      int64 [steps done, tokens seen], replicated
//   trainer.rng                           the default CPU generator's state (dropout), replicated
//   trainer.grad_scaler.<key>             fp16: true only: the GradScaler's state (scale, growth
//                                         tracker, factors), replicated
//
// The data position needs no key: a step's batch depends only on the step (data.h).
//
// With fsdp_config.checkpoint_format: dcp the same state goes into PyTorch's DCP layout instead
// (fsdp/dcp.h: model.<fqn>, optimizer.state/param_groups, train_state.step), which a Python
// FSDP2 trainer loads with dcp.load and writes with dcp.save. It holds the steps done; tokens
// seen follow from them (every step trains the same number of tokens); the RNG state and the
// gradient scaler's state are not in it (a resumed fp16 run starts again from the initial scale).
#pragma once

#include <fsdp/device_mesh.h>
#include <fsdp/grad_scaler.h>
#include <fsdp/state_dict.h>

#include <torch/optim/optimizer.h>

#include <cstdint>
#include <string>

namespace fsdp {
namespace train {

// The training loop's counters, saved as trainer.counters.
struct TrainerCounters {
  int64_t steps_done = 0;
  int64_t tokens_seen = 0;
};

// The state to save: model and optimizer shards (sharing storage with the live ones), the
// counters, the RNG state, and the scaler's state when there is a scaler.
ShardedStateDict checkpoint_state(torch::nn::Module& model, torch::optim::Optimizer& optimizer, const DeviceMesh& mesh,
                                  const TrainerCounters& counters, const GradScaler* scaler = nullptr);

// Loads the checkpoint in `dir` into model, optimizer, the default CPU generator and `scaler`
// (when given: the checkpoint must then hold trainer.grad_scaler.*), in place, and returns its
// counters. Collective: every rank calls it.
TrainerCounters load_checkpoint_state(const std::string& dir, torch::nn::Module& model,
                                      torch::optim::Optimizer& optimizer, const DeviceMesh& mesh,
                                      GradScaler* scaler = nullptr);

// Writes model, optimizer and steps done to `dir` in DCP layout; each param group records
// `base_lr` as initial_lr (what a Python LR scheduler adds to its groups). Collective.
void save_dcp_state(const std::string& dir, torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                    int64_t steps_done, double base_lr);

// Loads the DCP checkpoint in `dir` (save_dcp_state's, or a Python trainer's dcp.save of the same
// layout) into model and optimizer, in place, and returns its steps done. Collective.
int64_t load_dcp_state(const std::string& dir, torch::nn::Module& model, torch::optim::Optimizer& optimizer);

}  // namespace train
}  // namespace fsdp
