// grad_scaler.cpp — fsdp::GradScaler: the per-optimizer stages, the fused inf/nan check and
// unscale of the gradients, the one all-reduce that makes every rank agree, and the scale's
// update rule (torch's _amp_update_scale_).
#include <fsdp/grad_scaler.h>

#include <fsdp/distributed.h>

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <vector>

namespace fsdp {
namespace {

// Elements per task of the unscale loop: large enough that small gradients run inline.
constexpr int64_t kUnscaleGrain = 1 << 16;

const char* const kScaleKey = "scale";
const char* const kGrowthFactorKey = "growth_factor";
const char* const kBackoffFactorKey = "backoff_factor";
const char* const kGrowthIntervalKey = "growth_interval";
const char* const kGrowthTrackerKey = "_growth_tracker";
const char* const kStateKeys[] = {kScaleKey, kGrowthFactorKey, kBackoffFactorKey, kGrowthIntervalKey,
                                  kGrowthTrackerKey};

void check_scale_value(double scale, const char* what) {
  TORCH_CHECK(std::isfinite(scale) && scale > 0 && std::isfinite(static_cast<float>(scale)), "GradScaler: ", what,
              " must be positive and finite in fp32, got ", scale);
}
void check_growth_factor(double factor) {
  TORCH_CHECK(factor > 1.0 && std::isfinite(factor),
              "GradScaler: growth_factor must be > 1.0 (the scale is multiplied by it to grow), got ", factor);
}
void check_backoff_factor(double factor) {
  TORCH_CHECK(factor > 0.0 && factor < 1.0,
              "GradScaler: backoff_factor must be in (0, 1) (the scale is multiplied by it after an inf), got ",
              factor);
}
void check_growth_interval(int64_t interval) {
  TORCH_CHECK(interval > 0, "GradScaler: growth_interval must be > 0 (clean steps before the scale grows), got ",
              interval);
}

// Multiplies data[0, n) by inv_scale in place (unless it is 1) in the type's op-math precision,
// as torch's CUDA kernel does, and returns whether any element was inf or nan. One pass.
template <typename scalar_t>
bool unscale_and_check(scalar_t* data, int64_t n, float inv_scale) {
  using opmath_t = at::opmath_type<scalar_t>;
  const bool write = inv_scale != 1.0f;
  const opmath_t factor = static_cast<opmath_t>(inv_scale);
  std::atomic<bool> found{false};
  at::parallel_for(0, n, kUnscaleGrain, [&](int64_t begin, int64_t end) {
    bool bad = false;
    for (int64_t i = begin; i < end; ++i) {
      const opmath_t value = static_cast<opmath_t>(data[i]);
      bad |= !std::isfinite(value);
      if (write) data[i] = static_cast<scalar_t>(value * factor);
    }
    if (bad) found.store(true, std::memory_order_relaxed);
  });
  return found.load(std::memory_order_relaxed);
}

// The same for one gradient of any floating dtype; non-contiguous ones go through a copy.
bool unscale_gradient(at::Tensor& grad, float inv_scale) {
  at::Tensor dense = grad.is_contiguous() ? grad : grad.contiguous();
  bool found = false;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dense.scalar_type(), "GradScaler::unscale_", [&] {
    found = unscale_and_check(dense.data_ptr<scalar_t>(), dense.numel(), inv_scale);
  });
  if (inv_scale == 1.0f) return found;
  if (dense.is_same(grad)) {
    torch::autograd::impl::bump_version(grad);  // written through its data pointer, like any in-place op
  } else {
    grad.copy_(dense);
  }
  return found;
}

// Gradients on an accelerator go through ATen's fused kernel, the one torch.amp's GradScaler
// calls: one launch per device and dtype, and one host read of its found-inf flag per launch.
bool unscale_device_gradients(const std::vector<at::Tensor>& grads, float inv_scale) {
  std::vector<std::vector<at::Tensor>> batches;  // same device and dtype
  for (const auto& grad : grads) {
    auto same = [&](const std::vector<at::Tensor>& b) {
      return b.front().device() == grad.device() && b.front().scalar_type() == grad.scalar_type();
    };
    auto it = std::find_if(batches.begin(), batches.end(), same);
    if (it == batches.end()) batches.push_back({grad});
    else it->push_back(grad);
  }
  bool found = false;
  for (const auto& batch : batches) {
    const auto on_device = at::TensorOptions().dtype(at::kFloat).device(batch.front().device());
    at::Tensor found_inf = at::zeros({1}, on_device);
    at::_amp_foreach_non_finite_check_and_unscale_(batch, found_inf, at::full({1}, inv_scale, on_device));
    found |= found_inf.item<float>() > 0;
  }
  return found;
}

// The defined gradients of the optimizer's parameters, each checked to be one unscale_ handles.
std::vector<at::Tensor> gradients_of(torch::optim::Optimizer& optimizer) {
  std::vector<at::Tensor> grads;
  for (auto& group : optimizer.param_groups()) {
    for (auto& param : group.params()) {
      const at::Tensor& grad = param.grad();
      if (!grad.defined()) continue;
      TORCH_CHECK(grad.layout() == at::kStrided,
                  "GradScaler::unscale_: sparse gradients are not supported; got one of layout ", grad.layout(),
                  " (use a dense gradient, e.g. an Embedding without sparse=true)");
      TORCH_CHECK(at::isFloatingType(grad.scalar_type()),
                  "GradScaler::unscale_: gradients must be floating point, got one of dtype ", grad.scalar_type());
      grads.push_back(grad);
    }
  }
  return grads;
}

// The group the ranks agree over, or null in a single process that joined no job.
std::shared_ptr<ProcessGroup> agreement_group(const GradScalerOptions& options) {
  if (options.process_group()) return options.process_group();
  return is_initialized() ? world() : nullptr;
}

double state_value(const GradScalerState& state, const char* key) {
  auto it = state.find(key);
  TORCH_CHECK(it != state.end(), "GradScaler::load_state_dict: the state dict has no '", key,
              "' entry; pass a dict returned by GradScaler::state_dict()");
  return it->second;
}

int64_t whole_number(double value, const char* key) {
  TORCH_CHECK(std::isfinite(value) && value >= 0 && value == std::floor(value) && value < 9.007199254740992e15,
              "GradScaler::load_state_dict: '", key, "' must be a non-negative whole number, got ", value);
  return static_cast<int64_t>(value);
}

}  // namespace

GradScaler::GradScaler(GradScalerOptions options)
    : options_(std::move(options)), scale_(static_cast<float>(options_.init_scale())) {
  if (!enabled()) return;
  check_scale_value(options_.init_scale(), "init_scale");
  check_growth_factor(options_.growth_factor());
  check_backoff_factor(options_.backoff_factor());
  check_growth_interval(options_.growth_interval());
}

at::Tensor GradScaler::scale(const at::Tensor& loss) {
  if (!enabled()) return loss;
  TORCH_CHECK(loss.defined() && at::isFloatingType(loss.scalar_type()),
              "GradScaler::scale: the loss must be a defined floating-point tensor, got ",
              loss.defined() ? c10::toString(loss.scalar_type()) : "an undefined tensor");
  scale_used_ = true;
  // A Python-scalar-like factor keeps the loss's dtype (bf16 stays bf16), as ShardedGradScaler does.
  return loss * static_cast<double>(scale_);
}

void GradScaler::check_scale_used(const char* method) const {
  TORCH_CHECK(scale_used_, "GradScaler: attempted ", method,
              "() before any scale(). This may indicate your script "
              "did not use scaler.scale(loss) earlier in the iteration; call backward() on the scaled loss");
}

void GradScaler::unscale_(torch::optim::Optimizer& optimizer) {
  if (!enabled()) return;
  check_scale_used("unscale_");
  OptimizerRecord& record = per_optimizer_[&optimizer];
  TORCH_CHECK(record.stage != Stage::kUnscaled,
              "GradScaler: unscale_() has already been called on this optimizer "
              "since the last update(); call it at most once per optimizer per iteration");
  TORCH_CHECK(record.stage != Stage::kStepped,
              "GradScaler: unscale_() is being called after step(); unscale_ "
              "before step, or let step() unscale");

  std::vector<at::Tensor> grads = gradients_of(optimizer);
  // FP32 division can be imprecise for some compile options: take the reciprocal in double.
  const float inv_scale = static_cast<float>(1.0 / static_cast<double>(scale_));
  bool found_inf = false;
  {
    at::NoGradGuard no_grad;
    std::vector<at::Tensor> on_device;
    for (auto& grad : grads) {
      if (grad.device().is_cpu()) found_inf |= unscale_gradient(grad, inv_scale);
      else on_device.push_back(grad);
    }
    if (!on_device.empty()) found_inf |= unscale_device_gradients(on_device, inv_scale);
  }
  // [found an inf or nan, had a gradient]: max over the ranks answers both for every rank.
  at::Tensor verdict = at::tensor({found_inf ? 1.0f : 0.0f, grads.empty() ? 0.0f : 1.0f});
  if (auto group = agreement_group(options_)) {
    // A device backend (NCCL) reduces device tensors: the verdict goes to this rank's current device.
    if (group->device_type() != c10::DeviceType::CPU) verdict = verdict.to(at::Device(group->device_type()));
    group->all_reduce(verdict, ReduceOp::kMax)->wait();
    verdict = verdict.cpu();
  }
  record.found_inf = verdict[0].item<float>() > 0;
  record.inf_checked = verdict[1].item<float>() > 0;
  record.stage = Stage::kUnscaled;
}

bool GradScaler::step(torch::optim::Optimizer& optimizer) {
  if (!enabled()) {
    optimizer.step();
    return true;
  }
  check_scale_used("step");
  OptimizerRecord& record = per_optimizer_[&optimizer];  // stays valid: unscale_ inserts nothing new
  TORCH_CHECK(record.stage != Stage::kStepped,
              "GradScaler: step() has already been called since the last update(); "
              "call update() to end the iteration first");
  if (record.stage == Stage::kReady) unscale_(optimizer);
  TORCH_CHECK(record.inf_checked,
              "GradScaler::step: no inf checks were recorded for this optimizer: none of its "
              "parameters has a gradient on any rank; call backward() on scaler.scale(loss) before step()");
  const bool take_step = !record.found_inf;
  if (take_step) optimizer.step();
  record.stage = Stage::kStepped;
  return take_step;
}

void GradScaler::update(std::optional<double> new_scale) {
  if (!enabled()) return;
  check_scale_used("update");
  if (new_scale) {
    check_scale_value(*new_scale, "update(new_scale)'s new_scale");
    scale_ = static_cast<float>(*new_scale);
  } else {
    bool inf_checked = false, found_inf = false;
    for (const auto& entry : per_optimizer_) {
      inf_checked |= entry.second.inf_checked;
      found_inf |= entry.second.found_inf;
    }
    TORCH_CHECK(inf_checked,
                "GradScaler: no inf checks were recorded prior to update(); call step(optimizer) "
                "(or unscale_) for the optimizers of this iteration first");
    apply_found_inf(found_inf);
  }
  per_optimizer_.clear();
}

void GradScaler::apply_found_inf(bool found_inf) {
  if (found_inf) {
    scale_ *= static_cast<float>(options_.backoff_factor());
    growth_tracker_ = 0;
    return;
  }
  // >= rather than torch's ==: a growth_interval lowered below the tracker still grows.
  if (++growth_tracker_ < options_.growth_interval()) return;
  const float grown = scale_ * static_cast<float>(options_.growth_factor());
  if (std::isfinite(grown)) scale_ = grown;
  growth_tracker_ = 0;
}

double GradScaler::get_scale() const { return enabled() ? static_cast<double>(scale_) : 1.0; }

void GradScaler::set_growth_factor(double factor) {
  check_growth_factor(factor);
  options_.growth_factor(factor);
}

void GradScaler::set_backoff_factor(double factor) {
  check_backoff_factor(factor);
  options_.backoff_factor(factor);
}

void GradScaler::set_growth_interval(int64_t interval) {
  check_growth_interval(interval);
  options_.growth_interval(interval);
}

GradScalerState GradScaler::state_dict() const {
  if (!enabled()) return {};
  return {{kScaleKey, get_scale()},
          {kGrowthFactorKey, options_.growth_factor()},
          {kBackoffFactorKey, options_.backoff_factor()},
          {kGrowthIntervalKey, static_cast<double>(options_.growth_interval())},
          {kGrowthTrackerKey, static_cast<double>(growth_tracker_)}};
}

void GradScaler::load_state_dict(const GradScalerState& state) {
  if (!enabled()) return;
  TORCH_CHECK(!state.empty(),
              "The source state dict is empty, possibly because it was saved from a disabled "
              "instance of GradScaler.");
  const double scale = state_value(state, kScaleKey);
  const double growth_factor = state_value(state, kGrowthFactorKey);
  const double backoff_factor = state_value(state, kBackoffFactorKey);
  const int64_t interval = whole_number(state_value(state, kGrowthIntervalKey), kGrowthIntervalKey);
  const int64_t tracker = whole_number(state_value(state, kGrowthTrackerKey), kGrowthTrackerKey);
  // Check everything before changing anything.
  check_scale_value(scale, "the loaded scale");
  check_growth_factor(growth_factor);
  check_backoff_factor(backoff_factor);
  check_growth_interval(interval);
  scale_ = static_cast<float>(scale);
  options_.growth_factor(growth_factor).backoff_factor(backoff_factor).growth_interval(interval);
  growth_tracker_ = tracker;
}

ShardedStateDict GradScaler::sharded_state_dict(const DeviceMesh& mesh, const std::string& prefix) const {
  ShardedStateDict out;
  if (!enabled()) return out;
  const std::vector<Placement> replicated(static_cast<size_t>(mesh.ndim()), Replicate());
  auto add = [&](const char* key, at::Tensor value) {
    out.insert(prefix + key, DTensor::from_local(std::move(value), mesh, replicated));
  };
  add(kScaleKey, at::scalar_tensor(scale_, at::kFloat));
  add(kGrowthFactorKey, at::scalar_tensor(options_.growth_factor(), at::kDouble));
  add(kBackoffFactorKey, at::scalar_tensor(options_.backoff_factor(), at::kDouble));
  add(kGrowthIntervalKey, at::scalar_tensor(options_.growth_interval(), at::kLong));
  add(kGrowthTrackerKey, at::scalar_tensor(growth_tracker_, at::kLong));
  return out;
}

void GradScaler::load_sharded_state_dict(const ShardedStateDict& state_dict, const std::string& prefix) {
  if (!enabled()) return;
  GradScalerState state;
  for (const char* key : kStateKeys) {
    const DTensor* entry = state_dict.find(prefix + key);
    if (!entry) continue;  // load_state_dict names what is missing
    TORCH_CHECK(entry->numel() == 1 && entry->to_local().numel() == 1, "GradScaler::load_sharded_state_dict: '", prefix,
                key, "' must hold one value, got global shape ", c10::IntArrayRef(entry->sizes()));
    state[key] = entry->to_local().item<double>();
  }
  load_state_dict(state);
}

}  // namespace fsdp
