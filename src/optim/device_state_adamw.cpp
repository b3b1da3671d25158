// device_state_adamw.cpp — DeviceStateAdamW (fsdp/device_state_adamw.h): host parameters,
// device state, the copies up and back on a copy stream overlapping the updates.
#include <fsdp/device_state_adamw.h>

#include "src/device/device_ops.h"
#include "src/optim/adamw_per_op.h"
#include "src/util/compat.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/utils.h>

#include <optional>
#include <utility>

namespace fsdp {
namespace optim {
namespace {

using torch::optim::AdamWOptions;
using torch::optim::AdamWParamState;

// One parameter's device copies and the point of the copy stream where they are complete.
struct Uploaded {
  at::Tensor param;
  at::Tensor grad;
  device::Event ready;
};

// The streams of one step. The copies' memory is allocated on the compute stream (the caching
// allocator's stream for it), and the copy stream waits for that point before writing into it;
// uploads and downloads share the copy stream, so a download always ends before a later upload
// writes into memory the allocator handed on.
class StepStreams {
 public:
  explicit StepStreams(c10::Device device)
      : device_(device),
        ops_(device::ops_for(device)),
        compute_(ops_.current_stream(device)),
        copies_(ops_.side_stream(device, /*high_priority=*/false)) {}

  Uploaded upload(const at::Tensor& param) {
    Uploaded u{ops_.empty_like_on(param, device_), ops_.empty_like_on(param.grad(), device_), {}};
    const device::Event allocated = ops_.record(compute_);
    device::StreamScope scope(copies_);
    ops_.wait(copies_, allocated);
    u.param.copy_(param, /*non_blocking=*/true);
    u.grad.copy_(param.grad(), /*non_blocking=*/true);
    u.ready = ops_.record(copies_);
    return u;
  }

  void wait_for(const Uploaded& u) { ops_.wait(compute_, u.ready); }

  void download(at::Tensor& param, const at::Tensor& updated) {
    const device::Event done = ops_.record(compute_);
    device::StreamScope scope(copies_);
    ops_.wait(copies_, done);
    param.copy_(updated, /*non_blocking=*/true);
  }

  void finish() { ops_.synchronize(ops_.record(copies_)); }

 private:
  c10::Device device_;
  device::DeviceOps& ops_;
  c10::Stream compute_;
  c10::Stream copies_;
};

// A state tensor on `device`: itself when it is there already.
at::Tensor moved_to(const at::Tensor& t, const c10::Device& device) {
  return !t.defined() || t.device() == device ? t : t.to(device);
}

}  // namespace

DeviceStateAdamW::DeviceStateAdamW(std::vector<torch::optim::OptimizerParamGroup> param_groups, AdamWOptions defaults,
                                   c10::Device state_device)
    : torch::optim::AdamW(std::move(param_groups), std::move(defaults)), state_device_(state_device) {
  device::ops_for(state_device_);  // a device this build cannot use fails here, not at the first step
}

DeviceStateAdamW::DeviceStateAdamW(std::vector<at::Tensor> params, AdamWOptions defaults, c10::Device state_device)
    : DeviceStateAdamW({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults), state_device) {}

torch::Tensor DeviceStateAdamW::step(LossClosure closure) {
  torch::NoGradGuard no_grad;
  torch::Tensor loss;
  if (closure != nullptr) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  for (auto& group : param_groups_) step_group(group);
  return loss;
}

AdamWParamState& DeviceStateAdamW::state_for(const at::Tensor& param, const at::Tensor& on_device,
                                             const AdamWOptions& options) {
  const auto key = compat::optimizer_state_key(state_, param.unsafeGetTensorImpl());
  auto it = state_.find(key);
  if (it == state_.end()) it = state_.emplace(key, detail::new_adamw_state(on_device, options)).first;
  auto& state = static_cast<AdamWParamState&>(*it->second);
  state.exp_avg(moved_to(state.exp_avg(), state_device_));
  state.exp_avg_sq(moved_to(state.exp_avg_sq(), state_device_));
  state.max_exp_avg_sq(moved_to(state.max_exp_avg_sq(), state_device_));
  return state;
}

void DeviceStateAdamW::step_group(torch::optim::OptimizerParamGroup& group) {
  const auto& options = static_cast<const AdamWOptions&>(group.options());
  std::vector<at::Tensor> params;
  for (const at::Tensor& p : group.params()) {
    if (!p.grad().defined()) continue;
    TORCH_CHECK(!p.grad().is_sparse(), "AdamW does not support sparse gradients");
    params.push_back(p);
  }
  if (params.empty()) return;
  StepStreams streams(state_device_);
  std::optional<Uploaded> next = streams.upload(params[0]);
  for (size_t i = 0; i < params.size(); ++i) {
    Uploaded current = std::move(*next);
    next.reset();
    // Issued before the update below, so that the next parameter's copies overlap it.
    if (i + 1 < params.size()) next = streams.upload(params[i + 1]);
    streams.wait_for(current);
    detail::adamw_step_per_op(current.param, current.grad, state_for(params[i], current.param, options), options);
    streams.download(params[i], current.param);
  }
  streams.finish();
}

}  // namespace optim
}  // namespace fsdp
