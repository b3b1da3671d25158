// device_state_adamw.cpp — DeviceStateAdamW (fsdp/device_state_adamw.h): host parameters,
// device state, the copies up and back on a copy stream overlapping the updates.
#include <fsdp/device_state_adamw.h>

#include "src/device/device_ops.h"
#include "src/device/stream_check.h"
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

// A parameter's device copies while the copy stream reads `param` back to the host, and the
// point of the copy stream where that read is done.
struct Downloading {
  Uploaded copies;
  device::Event done;
};

// The streams of one step. The copies' memory is allocated on the compute stream (the caching
// allocator's stream for it), and the copy stream waits for that point before writing into it.
// Freeing a copy hands its block back to the compute stream at once, so the next update's
// allocations there can take it: a copy whose download is queued on the copy stream is kept
// until the compute stream has waited for the end of that download (release()). That the copy
// stream runs uploads and downloads in order protects only the copy stream's own writes.
class StepStreams {
 public:
  explicit StepStreams(c10::Device device)
      : device_(device),
        ops_(device::ops_for(device)),
        compute_(ops_.current_stream(device)),
        copies_(ops_.side_stream(device, /*high_priority=*/false)) {
    device::stream_check::label_stream(copies_, "DeviceStateAdamW's copy stream");
  }

  Uploaded upload(const at::Tensor& param) {
    Uploaded u{ops_.empty_like_on(param, device_), ops_.empty_like_on(param.grad(), device_), {}};
    if (device::stream_check::enabled()) {
      device::stream_check::label(u.param, "DeviceStateAdamW's device copy of a parameter");
      device::stream_check::label(u.grad, "DeviceStateAdamW's device copy of a gradient");
    }
    const device::Event allocated = ops_.record(compute_);
    device::StreamScope scope(copies_);
    ops_.wait(copies_, allocated);
    u.param.copy_(param, /*non_blocking=*/true);
    u.grad.copy_(param.grad(), /*non_blocking=*/true);
    u.ready = ops_.record(copies_);
    return u;
  }

  void wait_for(const Uploaded& u) { ops_.wait(compute_, u.ready); }

  // Queues the copy of `u.param` back into `param`; `u` stays alive in the result.
  Downloading download(at::Tensor& param, Uploaded u) {
    const device::Event updated = ops_.record(compute_);
    device::StreamScope scope(copies_);
    ops_.wait(copies_, updated);
    param.copy_(u.param, /*non_blocking=*/true);
    return Downloading{std::move(u), ops_.record(copies_)};
  }

  // Drops `d`'s copies once the compute stream, whose pool gets their blocks back, has waited
  // for their download. Call it before the compute stream allocates again.
  void release(std::optional<Downloading>& d) {
    if (!d) return;
    ops_.wait(compute_, d->done);
    d.reset();
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
  std::optional<Downloading> previous;
  for (size_t i = 0; i < params.size(); ++i) {
    Uploaded current = std::move(*next);
    next.reset();
    // Before this iteration's allocations (the next upload, the state, the update's temporaries).
    // The update then overlaps the next upload instead of the last download: the copy stream,
    // which bounds the step, stays as busy.
    streams.release(previous);
    // Issued before the update below, so that the next parameter's copies overlap it.
    if (i + 1 < params.size()) next = streams.upload(params[i + 1]);
    streams.wait_for(current);
    detail::adamw_step_per_op(current.param, current.grad, state_for(params[i], current.param, options), options);
    previous = streams.download(params[i], std::move(current));
  }
  streams.finish();  // the host has waited for every copy: the last one may go
}

}  // namespace optim
}  // namespace fsdp
