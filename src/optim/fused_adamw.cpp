// FusedAdamW (fsdp/fused_adamw.h): which parameters are updated together, their state, and
// AdamW's own per-op update for the parameters the fused pass cannot take. The arithmetic of
// the fused pass is in adamw_kernel.cpp.
#include <fsdp/fused_adamw.h>

#include "src/optim/adamw_kernel.h"
#include "src/optim/adamw_per_op.h"
#include "src/util/compat.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/utils.h>

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <iterator>
#include <map>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

namespace fsdp {
namespace optim {
namespace {

using torch::optim::AdamWOptions;
using torch::optim::AdamWParamState;
// Keyed by the parameter's TensorImpl (src/util/compat.h).
using StateMap = std::remove_reference_t<decltype(std::declval<torch::optim::Optimizer&>().state())>;

// Parameters of one dtype that are views into one storage, updated in one pass.
struct Run {
  at::ScalarType dtype;
  std::vector<at::Tensor> params;
  // The bytes [begin, end) of the members, so that a parameter listed twice (or two views that
  // overlap) never lands in one pass twice: it starts a later run, updated after this one.
  std::map<const char*, const char*> claimed;

  bool overlaps(const char* begin, const char* end) const {
    auto next = claimed.lower_bound(begin);
    if (next != claimed.end() && next->first < end) return true;
    return next != claimed.begin() && std::prev(next)->second > begin;
  }
};

AdamWParamState* find_state(StateMap& states, const at::Tensor& param) {
  auto it = states.find(compat::optimizer_state_key(states, param.unsafeGetTensorImpl()));
  return it == states.end() ? nullptr : static_cast<AdamWParamState*>(it->second.get());
}

// A tensor the fused loop can walk as `param.numel()` elements from its data pointer, in the
// parameter's element order.
bool matches_param_layout(const at::Tensor& t, const at::Tensor& param) {
  return t.defined() && t.device().is_cpu() && t.layout() == at::kStrided && t.scalar_type() == param.scalar_type() &&
         t.sizes() == param.sizes() && t.is_contiguous();
}

// Whether the fused pass can take `param` this step (its state, if any, included). Otherwise
// it gets AdamW's per-op update.
bool is_fusable(const at::Tensor& param, const AdamWParamState* state) {
  const auto dtype = param.scalar_type();
  if (dtype != at::kFloat && dtype != at::kDouble) return false;
  if (!param.device().is_cpu() || param.layout() != at::kStrided || !param.is_contiguous()) return false;
  if (!matches_param_layout(param.grad(), param)) return false;
  if (state == nullptr) return true;
  const bool max_ok = !state->max_exp_avg_sq().defined() || matches_param_layout(state->max_exp_avg_sq(), param);
  return matches_param_layout(state->exp_avg(), param) && matches_param_layout(state->exp_avg_sq(), param) && max_ok;
}

// torch::optim::AdamW::step for one parameter, op for op (adamw_per_op.h).
void step_unfused(at::Tensor& p, const AdamWOptions& options, StateMap& states) {
  const auto key = compat::optimizer_state_key(states, p.unsafeGetTensorImpl());
  if (states.find(key) == states.end()) states[key] = detail::new_adamw_state(p, options);
  detail::adamw_step_per_op(p, p.grad(), static_cast<AdamWParamState&>(*states[key]), options);
}

// Creates the state of the run's parameters that have none yet: one flat zero buffer per state
// tensor, holding those parameters one after another, each state tensor a view of its piece.
void create_missing_state(const Run& run, bool amsgrad, StateMap& states) {
  std::vector<const at::Tensor*> missing;
  int64_t total = 0;
  for (const at::Tensor& p : run.params) {
    if (find_state(states, p) == nullptr) {
      missing.push_back(&p);
      total += p.numel();
    }
  }
  if (missing.empty()) return;
  const auto options = run.params.front().options();
  const at::Tensor flat_exp_avg = at::zeros({total}, options);
  const at::Tensor flat_exp_avg_sq = at::zeros({total}, options);
  const at::Tensor flat_max_exp_avg_sq = amsgrad ? at::zeros({total}, options) : at::Tensor();
  int64_t offset = 0;
  for (const at::Tensor* p : missing) {
    auto piece = [&](const at::Tensor& flat) { return flat.narrow(0, offset, p->numel()).view(p->sizes()); };
    auto state = std::make_unique<AdamWParamState>();
    state->step(0);
    state->exp_avg(piece(flat_exp_avg));
    state->exp_avg_sq(piece(flat_exp_avg_sq));
    if (amsgrad) state->max_exp_avg_sq(piece(flat_max_exp_avg_sq));
    states[compat::optimizer_state_key(states, p->unsafeGetTensorImpl())] = std::move(state);
    offset += p->numel();
  }
}

// AdamW's scalars for a parameter about to take step number `step`.
detail::AdamWCoefficients coefficients_for(const AdamWOptions& options, int64_t step) {
  const double beta1 = std::get<0>(options.betas());
  const double beta2 = std::get<1>(options.betas());
  detail::AdamWCoefficients c;
  c.weight_decay_factor = options.weight_decay() != 0 ? 1 - options.lr() * options.weight_decay() : 1.0;
  c.beta1 = beta1;
  c.beta2 = beta2;
  c.sqrt_bias_correction2 = std::sqrt(1 - std::pow(beta2, step));
  c.eps = options.eps();
  c.negative_step_size = -(options.lr() / (1 - std::pow(beta1, step)));
  return c;
}

// Writes through data pointers bypass autograd's version counters: bumped here, as AdamW's
// in-place ops would, so that autograd still notices a tensor it saved was changed.
void bump_versions(std::initializer_list<const at::Tensor*> tensors) {
  for (const at::Tensor* t : tensors) {
    if (t->defined()) t->unsafeGetTensorImpl()->bump_version();
  }
}

// Counts the step of each parameter of the run and points the kernel at its memory.
std::vector<detail::AdamWSpan> spans_for_step(const Run& run, const AdamWOptions& options, StateMap& states) {
  std::vector<detail::AdamWSpan> spans;
  spans.reserve(run.params.size());
  for (const at::Tensor& p : run.params) {
    AdamWParamState& state = *find_state(states, p);
    if (options.amsgrad() && !state.max_exp_avg_sq().defined()) state.max_exp_avg_sq(at::zeros_like(p));
    state.step(state.step() + 1);
    const at::Tensor& max_exp_avg_sq = options.amsgrad() ? state.max_exp_avg_sq() : at::Tensor();
    spans.push_back({p.data_ptr(), p.grad().data_ptr(), state.exp_avg().data_ptr(), state.exp_avg_sq().data_ptr(),
                     max_exp_avg_sq.defined() ? max_exp_avg_sq.data_ptr() : nullptr, p.numel(),
                     coefficients_for(options, state.step())});
    bump_versions({&p, &state.exp_avg(), &state.exp_avg_sq(), &max_exp_avg_sq});
  }
  return spans;
}

// Adds `p` to the run of its storage, or starts one (also when `p` overlaps that run's members).
void add_to_runs(const at::Tensor& p, std::vector<Run>& runs,
                 std::map<std::pair<const c10::StorageImpl*, at::ScalarType>, size_t>& run_of_storage) {
  const auto key = std::make_pair(p.storage().unsafeGetStorageImpl(), p.scalar_type());
  const char* begin = static_cast<const char*>(p.data_ptr());
  const char* end = begin + p.numel() * p.element_size();
  auto it = run_of_storage.find(key);
  if (it == run_of_storage.end() || runs[it->second].overlaps(begin, end)) {
    runs.push_back(Run{p.scalar_type(), {}, {}});
    run_of_storage[key] = runs.size() - 1;
  }
  Run& run = runs[run_of_storage[key]];
  run.params.push_back(p);
  if (end > begin) run.claimed[begin] = end;
}

}  // namespace

torch::Tensor FusedAdamW::step(LossClosure closure) {
  torch::NoGradGuard no_grad;
  torch::Tensor loss;
  if (closure != nullptr) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  last_step_stats_ = FusedAdamWStepStats();
  for (auto& group : param_groups_) step_group(group);
  return loss;
}

void FusedAdamW::step_group(torch::optim::OptimizerParamGroup& group) {
  const auto& options = static_cast<const AdamWOptions&>(group.options());
  std::vector<Run> runs;
  std::map<std::pair<const c10::StorageImpl*, at::ScalarType>, size_t> run_of_storage;
  for (at::Tensor& p : group.params()) {
    if (!p.grad().defined()) continue;
    TORCH_CHECK(!p.grad().is_sparse(), "AdamW does not support sparse gradients");
    if (is_fusable(p, find_state(state_, p))) {
      add_to_runs(p, runs, run_of_storage);
    } else {
      step_unfused(p, options, state_);
      ++last_step_stats_.unfused_params;
    }
  }
  // In order, each run finished before the next is planned: a parameter listed twice is in
  // two runs, and its second update must see the state and step count of its first.
  for (const Run& run : runs) {
    create_missing_state(run, options.amsgrad(), state_);
    detail::adamw_update(run.dtype, spans_for_step(run, options, state_));
    const auto size = static_cast<int64_t>(run.params.size());
    ++last_step_stats_.fused_runs;
    last_step_stats_.fused_params += size;
    last_step_stats_.largest_run_params = std::max(last_step_stats_.largest_run_params, size);
  }
}

}  // namespace optim
}  // namespace fsdp
