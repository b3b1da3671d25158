// state.cpp — the per-call state's hooks and its lookups in the composable registry. The hooks
// run the state machine of common.h: pre-forward and post-forward from the hook point (fsdp::call),
// pre-backward from tensor hooks on the outputs, post-backward from an autograd function on
// the inputs, and the root's end-of-backward callback from the autograd engine.
#include "src/fsdp/state.h"

#include "src/fsdp/policies.h"

#include <fsdp/flight_recorder.h>

#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>

#include <algorithm>
#include <exception>
#include <functional>
#include <unordered_map>

namespace fsdp {
namespace detail {
namespace {

// The autograd function on a module's inputs: identity forward; its backward runs when the
// gradient w.r.t. the inputs is known, i.e. after the module's own backward — post-backward.
struct PostBackwardFunction : public torch::autograd::Function<PostBackwardFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, at::TensorList inputs,
                                                int64_t state_id) {
    ctx->saved_data["state_id"] = state_id;
    return inputs.vec();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    if (auto state = find_state_by_id(ctx->saved_data["state_id"].toInt())) state->post_backward();
    grads.emplace_back();  // no gradient for state_id
    return grads;
  }
};

}  // namespace

std::shared_ptr<FSDPState> find_state(const torch::nn::Module& module) {
  return std::static_pointer_cast<FSDPState>(composable::state_of(module, composable::Api::kFullyShard));
}

std::shared_ptr<FSDPState> find_state_by_id(int64_t id) {
  auto managed = composable::find_state_by_id(id);
  if (!managed || managed->api != composable::Api::kFullyShard) return nullptr;
  return std::static_pointer_cast<FSDPState>(managed->state);
}

// ------------------------------------------------------------------------------ set-up

FSDPState::FSDPState(std::vector<std::shared_ptr<torch::nn::Module>> modules, std::unique_ptr<FSDPParamGroup> group,
                     bool auto_reshard_after_forward, MixedPrecisionPolicy mp_policy)
    : group_(std::move(group)),
      auto_reshard_after_forward_(auto_reshard_after_forward),
      mp_policy_(std::move(mp_policy)) {
  for (const auto& m : modules) modules_.push_back(m);
}

void FSDPState::set_states_to_forward_prefetch(std::vector<std::weak_ptr<FSDPState>> states) {
  states_to_forward_prefetch_ = std::move(states);
}

void FSDPState::set_states_to_backward_prefetch(std::vector<std::weak_ptr<FSDPState>> states) {
  states_to_backward_prefetch_ = std::move(states);
}

void FSDPState::set_reshard_after_forward(bool reshard_after_forward) {
  auto_reshard_after_forward_ = false;  // the user's choice now holds for a root too
  if (group_) group_->set_post_forward_group(reshard_after_forward ? group_->shard_group() : nullptr);
}

void FSDPState::set_is_last_backward(bool is_last_backward) {
  if (ctx_) {
    ctx_->is_last_backward = is_last_backward;
  } else {
    is_last_backward_before_init_ = is_last_backward;
  }
}

int64_t FSDPState::reductions_in_flight() const {
  return ctx_ ? static_cast<int64_t>(ctx_->comm->reductions.size()) : 0;
}

void FSDPState::lazy_init() {
  if (ctx_) return;
  auto root_module = module();
  TORCH_CHECK(root_module, "fsdp: the module of this FSDP state no longer exists");
  TORCH_CHECK(modules_.size() == 1,
              "fsdp: FSDP requires a single root module, but the first forward ran through "
              "one of ",
              modules_.size(),
              " modules sharded together by fully_shard({...}) with no FSDP module "
              "above them. Apply fully_shard to a module that contains them all (last, as the root) and run the "
              "forward through it.");
  ctx_ = std::make_shared<StateContext>();
  ctx_->comm = comm_before_init_ ? std::move(comm_before_init_) : std::make_shared<CommContext>();
  comm_before_init_.reset();
  is_root_ = true;
  for (const auto& item : root_module->named_modules("", /*include_self=*/true)) {
    auto st = find_state(*item.value());
    if (!st) continue;
    if (std::find(ctx_->all_states.begin(), ctx_->all_states.end(), st.get()) != ctx_->all_states.end()) continue;
    if (st.get() != this) {
      TORCH_CHECK(!st->ctx_, "fsdp: FSDP module '", item.key(),
                  "' was already initialised as a root of its own: "
                  "its forward ran before the forward of its parent FSDP module. Run the first forward through "
                  "the root module.");
      TORCH_CHECK(!st->comm_before_init_, "fsdp::share_comm_ctx was given FSDP module '", item.key(),
                  "', which "
                  "is not a root: it runs under the FSDP module that contains it. Pass only root modules.");
      st->ctx_ = ctx_;
      st->is_root_ = false;
    }
    st->fqn_ = item.key();
    if (st->group_) {
      st->group_->set_module_fqn(module_label(item.key()));
      st->group_->set_comm_context(ctx_->comm.get());
      ctx_->comm->init_streams(st->group_->devices().compute);
      ctx_->compute_device = st->group_->devices().compute;
    }
    ctx_->all_states.push_back(st.get());
  }
  // What set_is_last_backward said before there was a shared context: the root's, else the
  // first state's that was told.
  for (FSDPState* st : ctx_->all_states) {  // pre-order: the root comes first
    if (st->is_last_backward_before_init_) {
      ctx_->is_last_backward = *st->is_last_backward_before_init_;
      break;
    }
  }
  for (FSDPState* st : ctx_->all_states) st->is_last_backward_before_init_.reset();
  // The root does not reshard after forward by default: backward needs it again at once.
  if (group_ && auto_reshard_after_forward_) group_->set_post_forward_group(nullptr);
}

// ------------------------------------------------------------------------------ recovery

namespace {

// True while this thread runs a backward (a hook, or the backward of an autograd function).
bool in_backward() { return torch::autograd::get_current_graph_task_exec_info() != nullptr; }

}  // namespace

// A forward after an exception left an iteration half done would run on stale bookkeeping (an
// iteration root that never ended, groups still unsharded, a backward whose end never came),
// and its collectives could pair with the wrong ones on other ranks: refuse it by name.
void FSDPState::check_previous_iteration_finished() const {
  if (!ctx_) return;
  TORCH_CHECK(ctx_->failed_forward.empty(), "fsdp: an exception escaped the forward of FSDP module '",
              ctx_->failed_forward,
              "' and left that iteration unfinished. Call reset_iter_state() on the root "
              "FSDPModule (on every rank) before running forward again.");
  // A backward runs FSDP's end-of-backward callback when it ends; one that was thrown out of
  // never does.
  TORCH_CHECK(!ctx_->final_callback_queued || in_backward(), "fsdp: the previous backward through FSDP module '",
              module_label(fqn_),
              "' did not finish (an exception was thrown inside it), so its gradient "
              "reduction never completed. Call reset_iter_state() on the root FSDPModule (on every rank) before "
              "running forward again.");
}

void FSDPState::mark_iteration_failed() {
  if (ctx_ && ctx_->failed_forward.empty()) ctx_->failed_forward = module_label(fqn_);
}

// Every rank must reach this at the same point of its collectives (an exception every rank
// threw alike): it waits for the collectives they all issued.
void FSDPState::reset_iter_state() {
  TORCH_CHECK(is_root_ != false,
              "fsdp::FSDPModule::reset_iter_state() must be called on the root FSDP module, but "
              "'",
              fqn_,
              "' runs under the FSDP module that contains it. Call it on the module the training loop "
              "calls.");
  if (!ctx_) return;  // no forward ran yet: nothing to reset
  StateContext& ctx = *ctx_;
  std::exception_ptr first_error;
  auto keep_first_error = [&first_error](const std::function<void()>& step) {
    try {
      step();
    } catch (...) {
      if (!first_error) first_error = std::current_exception();
    }
  };
  keep_first_error([&ctx] { ctx.comm->discard_reductions(); });
  for (FSDPState* st : ctx.all_states) {
    st->training_state_ = TrainingState::kIdle;
    st->modules_to_run_forward_.clear();
    if (st->group_) keep_first_error([st] { st->group_->reset_iter_state(); });
  }
  ctx.iter_forward_root = nullptr;
  ctx.final_callback_queued = false;
  ctx.forward_order.clear();
  ctx.comm->post_forward_order.clear();
  ctx.failed_forward.clear();
  if (first_error) std::rethrow_exception(first_error);
}

std::shared_ptr<CommContext> FSDPState::comm_context_to_share() {
  TORCH_CHECK(is_root_ != false, "fsdp::share_comm_ctx: FSDP module '", fqn_,
              "' is not a root: it runs under the "
              "FSDP module that contains it. Pass only root modules.");
  if (ctx_) return ctx_->comm;
  if (!comm_before_init_) comm_before_init_ = std::make_shared<CommContext>();
  return comm_before_init_;
}

void FSDPState::use_comm_context(std::shared_ptr<CommContext> comm) {
  TORCH_CHECK(is_root_ != false, "fsdp::share_comm_ctx: FSDP module '", fqn_,
              "' is not a root: it runs under the "
              "FSDP module that contains it. Pass only root modules.");
  if (!ctx_) {
    comm_before_init_ = std::move(comm);
    return;
  }
  if (ctx_->comm == comm) return;
  TORCH_CHECK(ctx_->comm->reductions.empty(), "fsdp::share_comm_ctx: FSDP module '", module_label(fqn_), "' has ",
              ctx_->comm->reductions.size(),
              " gradient reductions in flight; share communication contexts "
              "between iterations (after a backward run with set_is_last_backward(true)).");
  ctx_->comm = std::move(comm);
  for (FSDPState* st : ctx_->all_states) {
    if (st->group_) st->group_->set_comm_context(ctx_->comm.get());
  }
}

bool FSDPState::is_module_of_this_state(const torch::nn::Module& module) const {
  for (const auto& m : modules_) {
    if (m.lock().get() == &module) return true;
  }
  return false;
}

// ------------------------------------------------------------------------------ forward

// FSDP2's _root_pre_forward, for the first state whose forward runs in an iteration: the
// all-gather streams wait for the compute stream (once, not before each all-gather), and the
// tensor inputs move to the mesh's device, as FSDP2 moves them, before any cast.
void FSDPState::root_pre_forward(std::vector<at::Tensor>& inputs) {
  ctx_->iter_forward_root = this;
  ctx_->comm->begin_forward();
  move_inputs_to_device(inputs, ctx_->compute_device);
}

// Every call of one of this state's modules casts, the re-run of a forward during backward too,
// so that a recomputation sees the dtypes the forward saw.
void FSDPState::cast_forward_inputs(std::vector<at::Tensor>& inputs) const {
  if (mp_policy_.cast_forward_inputs() && mp_policy_.param_dtype()) {
    cast_floating_tensors(inputs, *mp_policy_.param_dtype());
  }
}

void FSDPState::cast_forward_outputs(std::vector<at::Tensor>& outputs) const {
  if (mp_policy_.output_dtype()) cast_floating_tensors(outputs, *mp_policy_.output_dtype());
}

std::vector<at::Tensor> FSDPState::pre_forward(const torch::nn::Module& module, std::vector<at::Tensor> inputs) {
  check_previous_iteration_finished();
  if (RecomputationScope::current()) {
    cast_forward_inputs(inputs);
    return pre_recompute(std::move(inputs));
  }
  if (training_state_ == TrainingState::kPreBackward) {
    // A forward re-run during backward that is not fsdp::checkpoint's (its graph is not
    // backpropagated through): parameters must be present.
    cast_forward_inputs(inputs);
    if (group_) {
      group_->unshard();
      group_->wait_for_unshard();
    }
    return inputs;
  }
  lazy_init();
  if (!ctx_->iter_forward_root) root_pre_forward(inputs);
  cast_forward_inputs(inputs);
  training_state_ = TrainingState::kForward;
  // What the flight recorder writes with this rank's next collectives, and as "last seen in".
  FlightRecorder::global().set_context("forward", module_label(fqn_));
  if (!group_ || !modules_to_run_forward_.empty()) return inputs;  // the round already started
  for (const auto& m : modules_) {
    if (auto locked = m.lock()) modules_to_run_forward_.insert(locked.get());
  }
  TORCH_CHECK(modules_to_run_forward_.count(&module),
              "internal: pre-forward of a module that is not managed by "
              "this FSDP state ('",
              fqn_, "')");
  group_->pre_forward();
  prefetch_next_in_forward();
  hook_inputs_for_post_backward(inputs);
  return inputs;
}

// A forward called again by activation checkpointing, inside backward (RecomputationScope). The
// recomputed graph is the one this backward goes on through, so it is hooked like a forward's:
// post-backward on the inputs of the state's first call in the recomputation (its gradient comes
// last), pre-backward on every output (post_forward). None of the iteration's forward bookkeeping
// is redone: no root, no forward order or prefetch, no reshard after it (its backward needs the
// parameters at once), so the recomputation all-gathers once, or uses a backward prefetch.
std::vector<at::Tensor> FSDPState::pre_recompute(std::vector<at::Tensor> inputs) {
  TORCH_CHECK(ctx_,
              "fsdp: an FSDP module ran for the first time in an activation checkpoint's recomputation; a "
              "checkpointed function must call the same modules when it is recomputed in backward");
  if (!group_) return inputs;
  group_->unshard();
  group_->wait_for_unshard();
  // Under no-grad (a checkpoint's forward nested in the recomputation) nothing is hooked yet.
  if (at::GradMode::is_enabled() && RecomputationScope::current()->first_call_of(this)) {
    hook_inputs_for_post_backward(inputs);
  }
  return inputs;
}

// Only the first module of a group's forward hooks its inputs: its gradient arrives after the
// backward of every module of the group that ran after it.
void FSDPState::hook_inputs_for_post_backward(std::vector<at::Tensor>& inputs) {
  if (!at::GradMode::is_enabled()) return;
  std::vector<size_t> needs_grad;
  std::vector<at::Tensor> to_wrap;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (inputs[i].defined() && inputs[i].requires_grad()) {
      needs_grad.push_back(i);
      to_wrap.push_back(inputs[i]);
    }
  }
  if (to_wrap.empty()) return;
  auto wrapped = PostBackwardFunction::apply(at::TensorList(to_wrap), id());
  for (size_t k = 0; k < needs_grad.size(); ++k) inputs[needs_grad[k]] = wrapped[k];
}

void FSDPState::post_forward(const torch::nn::Module& module, std::vector<at::Tensor>& outputs) {
  if (RecomputationScope::current()) {  // see pre_recompute
    hook_outputs_for_pre_backward(outputs);
    cast_forward_outputs(outputs);
    return;
  }
  if (training_state_ == TrainingState::kPreBackward) {
    cast_forward_outputs(outputs);
    return;
  }
  TORCH_CHECK(is_module_of_this_state(module),
              "internal: post-forward of a module that is not managed by this FSDP "
              "state ('",
              fqn_, "')");
  modules_to_run_forward_.erase(&module);
  const bool round_done = modules_to_run_forward_.empty();
  if (group_ && round_done) group_->post_forward();
  hook_outputs_for_pre_backward(outputs);
  cast_forward_outputs(outputs);  // after the hooks, so the cast's gradient reaches them
  if (round_done) training_state_ = TrainingState::kIdle;
  if (ctx_ && ctx_->iter_forward_root == this) root_post_forward();
}

void FSDPState::hook_outputs_for_pre_backward(std::vector<at::Tensor>& outputs) {
  if (!at::GradMode::is_enabled()) return;
  std::weak_ptr<FSDPState> self = weak_from_this();
  for (auto& out : outputs) {
    if (!out.defined() || !out.requires_grad()) continue;
    out.register_hook([self](const at::Tensor&) {
      if (auto st = self.lock()) st->pre_backward();
    });
  }
}

// A group of several modules of which only some ran this forward: its round ends now.
void FSDPState::finish_group_forward() {
  if (modules_to_run_forward_.empty()) return;
  modules_to_run_forward_.clear();
  training_state_ = TrainingState::kIdle;
  if (group_) group_->post_forward();
}

// The end of the iteration's forward: complete the rounds of groups of which only some modules
// ran, and drop prefetches nobody consumed.
void FSDPState::root_post_forward() {
  for (FSDPState* st : ctx_->all_states) {
    st->finish_group_forward();
    if (st->group_) st->group_->drop_unused_forward_prefetch();
  }
  ctx_->last_forward_order.swap(ctx_->forward_order);
  ctx_->forward_order.clear();
  ctx_->canonical_reduce_order = compute_canonical_reduce_order();
  ctx_->iter_forward_root = nullptr;
}

// See StateContext::canonical_reduce_order. A group that ran forward twice (a shared module)
// reduces first where its later call's backward ends.
std::vector<FSDPParamGroup*> FSDPState::compute_canonical_reduce_order() const {
  std::vector<FSDPParamGroup*> order;
  const auto& forward = ctx_->last_forward_order;
  for (auto it = forward.rbegin(); it != forward.rend(); ++it) {
    if (std::find(order.begin(), order.end(), *it) == order.end()) order.push_back(*it);
  }
  for (auto it = ctx_->all_states.rbegin(); it != ctx_->all_states.rend(); ++it) {
    FSDPParamGroup* g = (*it)->group_.get();
    if (g && std::find(order.begin(), order.end(), g) == order.end()) order.push_back(g);
  }
  return order;
}

std::vector<FSDPParamGroup*> FSDPState::groups_of(const std::vector<std::weak_ptr<FSDPState>>& states) const {
  std::vector<FSDPParamGroup*> groups;
  for (const auto& w : states) {
    auto st = w.lock();
    if (st && st->group_ && st->group_.get() != group_.get()) groups.push_back(st->group_.get());
  }
  return groups;
}

// On CPU nothing runs ahead of the compute by itself, so the default forward prefetch follows
// the order the groups ran in the previous iteration.
void FSDPState::prefetch_next_in_forward() {
  StateContext& order = *ctx_;
  const size_t position = order.forward_order.size();
  order.forward_order.push_back(group_.get());
  std::vector<FSDPParamGroup*> targets = groups_of(states_to_forward_prefetch_);
  if (states_to_forward_prefetch_.empty() && position + 1 < order.last_forward_order.size() &&
      order.last_forward_order[position] == group_.get() && order.last_forward_order[position + 1] != group_.get()) {
    targets.push_back(order.last_forward_order[position + 1]);
  }
  for (FSDPParamGroup* t : targets) t->prefetch_in_forward();
}

// ------------------------------------------------------------------------------ backward

void FSDPState::pre_backward() {
  if (!ctx_) return;
  if (!ctx_->final_callback_queued) {
    ctx_->final_callback_queued = true;
    FSDPState* root = ctx_->all_states.empty() ? this : ctx_->all_states.front();
    std::weak_ptr<FSDPState> weak_root = root->weak_from_this();
    RecomputationScope::queue_end_of_backward_callback([weak_root] { final_callback(weak_root); });
  }
  training_state_ = TrainingState::kPreBackward;
  FlightRecorder::global().set_context("backward", module_label(fqn_));
  if (!group_ || group_->training_state() == TrainingState::kPreBackward) return;
  group_->pre_backward();
  prefetch_in_backward();
}

// Default: the group that finished forward just before this one runs backward next.
void FSDPState::prefetch_in_backward() {
  const int64_t index = group_->pop_post_forward_index();
  std::vector<FSDPParamGroup*> targets = groups_of(states_to_backward_prefetch_);
  // The order is shared with other roots under fsdp::share_comm_ctx, and another root's end of
  // backward may have cleared it.
  const auto& post_forward_order = ctx_->comm->post_forward_order;
  if (states_to_backward_prefetch_.empty() && index > 0 && index <= static_cast<int64_t>(post_forward_order.size())) {
    FSDPParamGroup* previous = post_forward_order[index - 1];
    if (previous != group_.get()) targets.push_back(previous);
  }
  for (FSDPParamGroup* t : targets) t->prefetch_in_backward();
}

void FSDPState::post_backward() {
  if (!group_) return;
  FlightRecorder::global().set_context("post-backward", module_label(fqn_));
  if (ctx_ && group_->reduces_unused_params()) reduce_groups_due_before(group_.get());
  group_->post_backward();
  if (ctx_) ctx_->comm->finish_reductions(/*wait_all=*/false);
}

// Under set_reduce_scatter_unused_params every rank issues every group's reduce-scatter, but a
// rank whose backward skipped a group would issue that one only at the end of backward, out of
// the other ranks' order, and equal-sized groups would pair the wrong reduce-scatters. So before
// `group` reduces, every group due before it in the canonical order (reverse forward order)
// that has not reduced in this backward reduces now: on a rank that skipped it, with zeros.
// This assumes each rank's backward follows that order, as a sequential model's does; a group
// due earlier whose backward is still running breaks it, and is refused.
void FSDPState::reduce_groups_due_before(FSDPParamGroup* group) {
  const auto& order = ctx_->canonical_reduce_order;
  const auto position = std::find(order.begin(), order.end(), group);
  if (position == order.end()) return;
  for (auto it = order.begin(); it != position; ++it) {
    FSDPParamGroup* due = *it;
    if (!due->reduces_unused_params() || due->reduced_in_this_backward()) continue;
    TORCH_CHECK(due->training_state() != TrainingState::kPreBackward,
                "fsdp: set_reduce_scatter_unused_params: "
                "the backward of FSDP module '",
                group->module_fqn(), "' finished while that of '", due->module_fqn(),
                "', which ran forward after it, is still running. Reduce-scatters follow the "
                "reverse order of the forward on every rank, which needs the modules' backward passes to finish "
                "in that order (a sequential model); turn the setting off for this model.");
    due->post_backward_ahead();
  }
}

void FSDPState::final_callback(std::weak_ptr<FSDPState> weak_root) {
  auto root = weak_root.lock();
  if (!root || !root->ctx_) return;
  StateContext& ctx = *root->ctx_;
  FlightRecorder::global().set_context("end of backward", module_label(root->fqn_));
  post_backward_of_unreached_groups(ctx);
  for (FSDPState* st : ctx.all_states) st->training_state_ = TrainingState::kIdle;
  if (ctx.is_last_backward) finalize_backward(ctx);
  for (FSDPState* st : ctx.all_states) {
    if (st->group_) st->group_->end_backward();
  }
  ctx.final_callback_queued = false;
  FlightRecorder::global().set_context("after backward", module_label(root->fqn_));
}

// Groups whose post-backward could not fire (inputs that need no grad, e.g. token ids and the
// root, or modules this rank's backward did not reach) reduce now, in an order every rank
// shares: under set_reduce_scatter_unused_params the canonical one, else pre-order.
void FSDPState::post_backward_of_unreached_groups(StateContext& ctx) {
  for (FSDPParamGroup* g : ctx.canonical_reduce_order) {
    if (g->reduces_unused_params() && g->training_state() != TrainingState::kPostBackward) g->post_backward();
  }
  for (FSDPState* st : ctx.all_states) {
    if (st->group_ && st->group_->training_state() != TrainingState::kPostBackward) st->group_->post_backward();
  }
}

// The end of the last backward before the optimizer: every gradient written, prefetches nobody
// consumed dropped, the backward prefetch order cleared.
void FSDPState::finalize_backward(StateContext& ctx) {
  ctx.comm->finish_reductions(/*wait_all=*/true);
  ctx.comm->wait_for_gradients();
  for (FSDPState* st : ctx.all_states) {
    if (st->group_) st->group_->finalize_backward();
  }
  ctx.comm->post_forward_order.clear();
}

std::vector<std::string> FSDPState::resharded_modules_below() const {
  std::vector<std::string> names;
  auto root = module();
  if (!root) return names;
  for (const auto& item : root->named_modules("", /*include_self=*/true)) {
    auto st = find_state(*item.value());
    if (!st || !st->group_ || st->group_->sharded_state() == ShardedState::kUnsharded) continue;
    std::string name = fqn_.empty() ? item.key() : (item.key().empty() ? fqn_ : fqn_ + "." + item.key());
    names.push_back(module_label(name));
  }
  return names;
}

}  // namespace detail
}  // namespace fsdp
