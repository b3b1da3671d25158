// layer: optim (what may include what: docs/architecture.md)
/// \file
/// fsdp/device_state_adamw.h — AdamW for sharded parameters offloaded to host memory whose
/// optimizer state stays in device memory: the split ZeRO-Offload makes, beside FSDP2's
/// CPUOffloadPolicy, which keeps the state with the parameters in host memory.
///
/// \code{.cpp}
///   auto mesh = fsdp::init_device_mesh("cuda", {fsdp::get_world_size()});
///   auto offload = fsdp::FullyShardOptions().mesh(mesh).offload_policy(fsdp::CPUOffloadPolicy());
///   for (auto& block : model->blocks()) fsdp::fully_shard(block, offload);
///   fsdp::fully_shard(model, offload);                       // shards and gradients: pinned host
///   fsdp::optim::DeviceStateAdamW opt(model->parameters(), torch::optim::AdamWOptions(3e-4),
///                                     mesh.device());         // exp_avg, exp_avg_sq: on the GPU
///   ...
///   loss.backward();
///   opt.step();   // each shard and its gradient go up, AdamW steps there, the shard comes back
/// \endcode
///
/// Same optimizer, same state, other place: DeviceStateAdamW IS a torch::optim::AdamW (it
/// replaces only step()), so its AdamWOptions, per-parameter AdamWParamState under AdamW's state()
/// keys, save()/load(), fsdp::sharded_optimizer_state_dict and its loader, init_optimizer_state and
/// checkpoints are AdamW's. The arithmetic is AdamW's per-op update on the state's device. The
/// state is created on `state_device` at a parameter's first step; state found elsewhere (loaded
/// by torch::load onto the host, say) is moved there at the next step.
///
/// What step() does, per param group, per parameter with a gradient, in order: the parameter and
/// its gradient are copied to the device on a copy stream (non-blocking from pinned memory), the
/// update runs on the current stream once they have arrived, and the parameter is copied back on
/// the copy stream. The copies of the next parameter are issued before the update of the current
/// one, so they overlap it; at most two parameters' device copies exist at a time. Events order
/// the streams (no record_stream): a device copy is freed only after the current stream has waited
/// for its copy back, so its memory cannot be handed to the next update while that copy still
/// reads it. step() returns once every parameter is back in host memory, so the next forward's
/// all-gather reads updated shards. With `state_device` the CPU (the stand-in on a machine without
/// a GPU) every copy is a host copy and the streams are one order.
/// Not collective. Like AdamW, not safe to call concurrently with anything that reads or writes
/// the parameters, their gradients or this optimizer.
#pragma once

#include <c10/core/Device.h>
#include <torch/optim/adamw.h>

#include <vector>

namespace fsdp {
namespace optim {

/// AdamW whose state lives on a device while the parameters and gradients stay in host memory
/// (ZeRO-Offload's split; see the file comment).
class DeviceStateAdamW : public torch::optim::AdamW {
 public:
  /** @{ */
  /// AdamW's constructors, with the device the state lives and the update runs on. Throws
  /// c10::Error (AdamW's checks of the options; a device this build has no operations for, naming
  /// the build option).
  DeviceStateAdamW(std::vector<torch::optim::OptimizerParamGroup> param_groups, torch::optim::AdamWOptions defaults,
                   c10::Device state_device);
  DeviceStateAdamW(std::vector<at::Tensor> params, torch::optim::AdamWOptions defaults, c10::Device state_device);
  /** @} */

  /// One AdamW step for every parameter with a gradient (see the file comment); parameters
  /// without one keep their step count. `closure`, when given, is called with grad mode on and
  /// its result returned, as in AdamW. Blocks until the parameters are back in host memory.
  torch::Tensor step(LossClosure closure = nullptr) override;

  /// The device the state lives and the update runs on.
  const c10::Device& state_device() const { return state_device_; }

 private:
  void step_group(torch::optim::OptimizerParamGroup& group);
  /// The state of host `param`, created like `on_device` (its copy on the state's device) at its
  /// first step, and moved to the state's device when found elsewhere.
  torch::optim::AdamWParamState& state_for(const at::Tensor& param, const at::Tensor& on_device,
                                           const torch::optim::AdamWOptions& options);

  c10::Device state_device_;
};

}  // namespace optim
}  // namespace fsdp
