#include "fsdp/state.h"

#include <fsdp/call.h>

#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/engine.h>

#include <atomic>
#include <map>
#include <mutex>
#include <unordered_map>

namespace fsdp {
namespace detail {
namespace {

// ------------------------------------------------------------------------------ registry

struct Registry {
  std::mutex mu;
  struct Entry {
    std::weak_ptr<torch::nn::Module> module;
    std::shared_ptr<FSDPState> state;
  };
  std::unordered_map<const torch::nn::Module*, Entry> by_module;
  std::map<int64_t, std::weak_ptr<FSDPState>> by_id;
};

Registry& registry() {
  static Registry* r = new Registry();  // never destroyed: hooks may run during static teardown
  return *r;
}

std::atomic<int64_t> g_next_state_id{0};

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

ReshardPolicy policy_for(const ReshardAfterForward& option, bool is_root) {
  if (option.is_unset()) return ReshardPolicy{is_root ? ReshardPolicy::kKeep : ReshardPolicy::kFull, 0};
  if (option.is_bool()) return ReshardPolicy{option.as_bool() ? ReshardPolicy::kFull : ReshardPolicy::kKeep, 0};
  return ReshardPolicy{ReshardPolicy::kPartial, option.group_size()};
}

}  // namespace

std::shared_ptr<FSDPState> find_state(const torch::nn::Module& module) {
  std::shared_ptr<FSDPState> stale;  // released after the lock: ~FSDPState takes it too
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.by_module.find(&module);
  if (it == r.by_module.end()) return nullptr;
  if (it->second.module.lock().get() != &module) {  // a dead module's address, reused
    stale = std::move(it->second.state);
    r.by_module.erase(it);
    return nullptr;
  }
  return it->second.state;
}

void register_state(const std::vector<std::shared_ptr<torch::nn::Module>>& modules,
                    const std::shared_ptr<FSDPState>& state) {
  std::vector<std::shared_ptr<FSDPState>> dead;  // released after the lock
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  // States of modules that no longer exist go now, with their shards.
  for (auto it = r.by_module.begin(); it != r.by_module.end();) {
    if (it->second.module.expired()) {
      dead.push_back(std::move(it->second.state));
      it = r.by_module.erase(it);
    } else {
      ++it;
    }
  }
  for (const auto& m : modules) r.by_module[m.get()] = Registry::Entry{m, state};
  r.by_id[state->id()] = state;
}

std::shared_ptr<FSDPState> find_state_by_id(int64_t id) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.by_id.find(id);
  return it == r.by_id.end() ? nullptr : it->second.lock();
}

// ------------------------------------------------------------------------------ state

FSDPState::FSDPState(std::vector<std::shared_ptr<torch::nn::Module>> modules, std::unique_ptr<FSDPParamGroup> group,
                     ReshardAfterForward reshard_after_forward)
    : id_(g_next_state_id++), group_(std::move(group)), reshard_option_(reshard_after_forward) {
  for (const auto& m : modules) modules_.push_back(m);
  if (group_) group_->set_reshard_policy(policy_for(reshard_option_, /*is_root=*/false));
}

FSDPState::~FSDPState() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.by_id.erase(id_);
}

void FSDPState::set_reshard_after_forward(ReshardAfterForward option) {
  reshard_option_ = option;
  if (group_) group_->set_reshard_policy(policy_for(option, is_root()));
}

void FSDPState::lazy_init() {
  if (ctx_) return;
  auto root_module = module();
  TORCH_CHECK(root_module, "fsdp: the module of this FSDP state no longer exists");
  ctx_ = std::make_shared<StateContext>();
  is_root_ = 1;
  for (const auto& item : root_module->named_modules("", /*include_self=*/true)) {
    auto st = find_state(*item.value());
    if (!st) continue;
    bool seen = false;
    for (FSDPState* s : ctx_->all_states) seen = seen || s == st.get();
    if (seen) continue;
    if (st.get() != this) {
      TORCH_CHECK(!st->ctx_, "fsdp: FSDP module '", item.key(), "' was already initialised as a root of its own: "
                  "its forward ran before the forward of its parent FSDP module. Run the first forward through "
                  "the root module.");
      st->ctx_ = ctx_;
      st->is_root_ = 0;
    }
    st->fqn_ = item.key();
    if (st->group_) {
      st->group_->set_module_fqn(item.key().empty() ? "<root>" : item.key());
      st->group_->set_comm_context(&ctx_->comm);
    }
    ctx_->all_states.push_back(st.get());
  }
  // The root does not reshard after forward by default: backward needs it again at once.
  if (group_ && reshard_option_.is_unset()) group_->set_reshard_policy(policy_for(reshard_option_, true));
}

std::vector<at::Tensor> FSDPState::pre_forward(std::vector<at::Tensor> inputs) {
  if (training_state_ == TrainingState::kPreBackward) {
    // A forward re-run during backward (activation recomputation): parameters must be present.
    if (group_) {
      group_->unshard();
      group_->wait_for_unshard();
    }
    return inputs;
  }
  lazy_init();
  if (!ctx_->iter_forward_root) ctx_->iter_forward_root = this;
  const bool first_of_group = training_state_ != TrainingState::kForward;
  training_state_ = TrainingState::kForward;
  if (!group_ || !first_of_group) return inputs;
  group_->pre_forward();
  prefetch_next_in_forward();
  // Only the first module of a group's forward hooks its inputs: its gradient arrives after the
  // backward of every module of the group that ran after it.
  if (at::GradMode::is_enabled()) {
    std::vector<size_t> needs_grad;
    std::vector<at::Tensor> to_wrap;
    for (size_t i = 0; i < inputs.size(); ++i) {
      if (inputs[i].defined() && inputs[i].requires_grad()) {
        needs_grad.push_back(i);
        to_wrap.push_back(inputs[i]);
      }
    }
    if (!to_wrap.empty()) {
      auto wrapped = PostBackwardFunction::apply(at::TensorList(to_wrap), id_);
      for (size_t k = 0; k < needs_grad.size(); ++k) inputs[needs_grad[k]] = wrapped[k];
    }
  }
  return inputs;
}

void FSDPState::post_forward(std::vector<at::Tensor>& outputs) {
  if (training_state_ == TrainingState::kPreBackward) return;
  bool group_done = true;
  if (group_) {
    // A group of several modules finishes its forward when each of them has run.
    if (++modules_in_forward_ >= static_cast<int>(modules_.size())) {
      modules_in_forward_ = 0;
      group_->post_forward();
    } else {
      group_done = false;
    }
  }
  if (at::GradMode::is_enabled()) {
    std::weak_ptr<FSDPState> self = weak_from_this();
    for (auto& out : outputs) {
      if (!out.defined() || !out.requires_grad()) continue;
      out.register_hook([self](const at::Tensor&) {
        if (auto st = self.lock()) st->pre_backward();
      });
    }
  }
  if (group_done) training_state_ = TrainingState::kIdle;
  if (ctx_ && ctx_->iter_forward_root == this) root_post_forward();
}

// The end of the iteration's forward: drop prefetches nobody consumed, and complete groups of
// several modules of which only some ran.
void FSDPState::root_post_forward() {
  for (FSDPState* st : ctx_->all_states) {
    FSDPParamGroup* g = st->group_.get();
    if (!g) continue;
    if (st->modules_in_forward_ > 0) {
      st->modules_in_forward_ = 0;
      st->training_state_ = TrainingState::kIdle;
      g->post_forward();
    }
    if (g->prefetched_in_forward) {
      g->prefetched_in_forward = false;
      if (g->reshard_policy().kind != ReshardPolicy::kKeep) g->reshard();
    }
  }
  ctx_->comm.last_forward_order.swap(ctx_->comm.forward_order);
  ctx_->comm.forward_order.clear();
  ctx_->iter_forward_root = nullptr;
}

// On CPU nothing runs ahead of the compute by itself, so the default forward prefetch follows
// the order the groups ran in the previous iteration.
void FSDPState::prefetch_next_in_forward() {
  CommContext& comm = ctx_->comm;
  const size_t position = comm.forward_order.size();
  comm.forward_order.push_back(group_.get());
  std::vector<FSDPParamGroup*> targets;
  if (!forward_prefetch.empty()) {
    for (auto& w : forward_prefetch) {
      if (auto st = w.lock()) {
        if (st->group_) targets.push_back(st->group_.get());
      }
    }
  } else if (position + 1 < comm.last_forward_order.size() && comm.last_forward_order[position] == group_.get()) {
    targets.push_back(comm.last_forward_order[position + 1]);
  }
  for (FSDPParamGroup* t : targets) {
    if (t == group_.get() || t->sharded_state() == ShardedState::kUnsharded || t->has_pending_unshard()) continue;
    t->unshard();
    t->prefetched_in_forward = true;
  }
}

void FSDPState::pre_backward() {
  if (!ctx_) return;
  if (!ctx_->final_callback_queued) {
    ctx_->final_callback_queued = true;
    FSDPState* root = ctx_->all_states.empty() ? this : ctx_->all_states.front();
    std::weak_ptr<FSDPState> weak_root = root->weak_from_this();
    torch::autograd::Engine::get_default_engine().queue_callback([weak_root] { final_callback(weak_root); });
  }
  training_state_ = TrainingState::kPreBackward;
  if (!group_ || group_->training_state() == TrainingState::kPreBackward) return;
  group_->pre_backward();
  prefetch_in_backward();
}

// Default: the group that finished forward just before this one runs backward next.
void FSDPState::prefetch_in_backward() {
  std::vector<FSDPParamGroup*> targets;
  const int64_t index = group_->pop_post_forward_index();
  if (!backward_prefetch.empty()) {
    for (auto& w : backward_prefetch) {
      if (auto st = w.lock()) {
        if (st->group_) targets.push_back(st->group_.get());
      }
    }
  } else if (index > 0) {
    targets.push_back(ctx_->comm.post_forward_order[index - 1]);
  }
  for (FSDPParamGroup* t : targets) {
    if (t != group_.get()) t->unshard();
  }
}

void FSDPState::post_backward() {
  if (!group_) return;
  group_->post_backward();
  if (ctx_) ctx_->comm.finish_reductions(/*wait_all=*/false);
}

void FSDPState::final_callback(std::weak_ptr<FSDPState> weak_root) {
  auto root = weak_root.lock();
  if (!root || !root->ctx_) return;
  StateContext& ctx = *root->ctx_;
  // Groups whose post-backward could not fire (inputs that need no grad, e.g. token ids and
  // the root) reduce now, in a fixed order so every rank issues the same collectives.
  for (FSDPState* st : ctx.all_states) {
    if (st->group_ && st->group_->training_state() != TrainingState::kPostBackward) st->group_->post_backward();
    st->training_state_ = TrainingState::kIdle;
  }
  ctx.comm.finish_reductions(/*wait_all=*/true);
  for (FSDPState* st : ctx.all_states) {
    if (st->group_) st->group_->finalize_backward();
  }
  ctx.comm.post_forward_order.clear();
  ctx.final_callback_queued = false;
}

std::vector<std::string> FSDPState::resharded_modules_below() const {
  std::vector<std::string> names;
  auto root = module();
  if (!root) return names;
  for (const auto& item : root->named_modules("", /*include_self=*/true)) {
    auto st = find_state(*item.value());
    if (!st || !st->group_ || st->group_->sharded_state() == ShardedState::kUnsharded) continue;
    std::string name = fqn_.empty() ? item.key() : (item.key().empty() ? fqn_ : fqn_ + "." + item.key());
    names.push_back(name.empty() ? "<root>" : name);
  }
  return names;
}

// ------------------------------------------------------------------------------ call.h entry points

FSDPState* state_of(const torch::nn::Module& module) { return find_state(module).get(); }

std::vector<at::Tensor> pre_forward(FSDPState& state, std::vector<at::Tensor> inputs) {
  return state.pre_forward(std::move(inputs));
}

void post_forward(FSDPState& state, std::vector<at::Tensor>& outputs) { state.post_forward(outputs); }

void rethrow_forward_error(FSDPState& state) {
  try {
    throw;
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    const bool freed_storage = msg.find("data is not allocated yet") != std::string::npos ||
                               msg.find("storage of size 0") != std::string::npos;
    const auto resharded = state.resharded_modules_below();
    if (!freed_storage || resharded.empty()) throw;
    std::string names;
    for (const auto& n : resharded) names += (names.empty() ? "'" : ", '") + n + "'";
    TORCH_CHECK(false, "fsdp: a module computed on resharded (freed) parameters. At that moment these FSDP modules "
                "were resharded: ", names, ". Call FSDP modules through fsdp::call(module, ...) instead of "
                "module->forward(...) or module(...), or unshard() them first. LibTorch said: ", msg);
  }
}

}  // namespace detail
}  // namespace fsdp
