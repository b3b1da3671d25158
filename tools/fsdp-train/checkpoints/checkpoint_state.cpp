// checkpoint_state.cpp — building and reading the ShardedStateDict of an fsdp-train checkpoint
// (key layout in checkpoint_state.h).
#include "checkpoints/checkpoint_state.h"

#include <fsdp/checkpoint.h>
#include <fsdp/dcp.h>
#include <fsdp/dtensor.h>
#include <fsdp/optim_state_dict.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Functions.h>

#include <vector>

namespace fsdp {
namespace train {
namespace {

const std::string kModelPrefix = "model.";
const std::string kOptimPrefix = "optim.";
const std::string kCountersKey = "trainer.counters";
const std::string kRngKey = "trainer.rng";
const std::string kScalerPrefix = "trainer.grad_scaler.";

// The entries of `sd` whose key starts with prefix, under the key without it.
ShardedStateDict with_prefix_removed(const ShardedStateDict& sd, const std::string& prefix) {
  ShardedStateDict out;
  for (const auto& item : sd)
    if (item.key().rfind(prefix, 0) == 0) out.insert(item.key().substr(prefix.size()), item.value());
  return out;
}

}  // namespace

ShardedStateDict checkpoint_state(torch::nn::Module& model, torch::optim::Optimizer& optimizer, const DeviceMesh& mesh,
                                  const TrainerCounters& counters, const GradScaler* scaler) {
  ShardedStateDict sd;
  for (const auto& item : sharded_state_dict(model)) sd.insert(kModelPrefix + item.key(), item.value());
  for (const auto& item : sharded_optimizer_state_dict(model, optimizer))
    sd.insert(kOptimPrefix + item.key(), item.value());
  auto replicated = [&](const at::Tensor& t) {
    return DTensor::from_local(t, mesh, std::vector<Placement>(mesh.ndim(), Replicate()));
  };
  const std::vector<int64_t> numbers{counters.steps_done, counters.tokens_seen};
  sd.insert(kCountersKey, replicated(at::tensor(numbers, at::kLong)));
  sd.insert(kRngKey, replicated(at::detail::getDefaultCPUGenerator().get_state()));
  if (scaler)
    for (const auto& item : scaler->sharded_state_dict(mesh, kScalerPrefix)) sd.insert(item.key(), item.value());
  return sd;
}

TrainerCounters load_checkpoint_state(const std::string& dir, torch::nn::Module& model,
                                      torch::optim::Optimizer& optimizer, const DeviceMesh& mesh, GradScaler* scaler) {
  init_optimizer_state(optimizer);  // so that the state dict lists the state to load into
  const ShardedStateDict loaded = load_checkpoint(dir, checkpoint_state(model, optimizer, mesh, {}, scaler));
  if (scaler) scaler->load_sharded_state_dict(loaded, kScalerPrefix);
  load_sharded_state_dict(model, with_prefix_removed(loaded, kModelPrefix));
  load_sharded_optimizer_state_dict(model, optimizer, with_prefix_removed(loaded, kOptimPrefix));
  at::Generator rng = at::detail::getDefaultCPUGenerator();  // a handle to the same generator
  rng.set_state(loaded[kRngKey].to_local());
  const at::Tensor counters = loaded[kCountersKey].to_local();
  return TrainerCounters{counters[0].item<int64_t>(), counters[1].item<int64_t>()};
}

void save_dcp_state(const std::string& dir, torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                    int64_t steps_done, double base_lr) {
  save_dcp(dir, sharded_state_dict(model), sharded_optimizer_state_dict(model, optimizer), steps_done,
           DcpOptions().initial_lr(base_lr));
}

int64_t load_dcp_state(const std::string& dir, torch::nn::Module& model, torch::optim::Optimizer& optimizer) {
  init_optimizer_state(optimizer);  // so that the state dict lists the state to load into
  const DcpState loaded = load_dcp(dir, sharded_state_dict(model), sharded_optimizer_state_dict(model, optimizer));
  load_sharded_state_dict(model, loaded.model);
  load_sharded_optimizer_state_dict(model, optimizer, loaded.optimizer);
  return loaded.step;
}

}  // namespace train
}  // namespace fsdp
