// state.h — the per-fully_shard-call state: its hooks (called through fsdp::call and autograd),
// the training state machine, root detection and lazy initialisation, prefetch lists, and the
// root's end-of-backward callback. It drives its param group; it never talks to a process
// group itself.
#pragma once

#include "fsdp/param_group.h"

#include <fsdp/fully_shard.h>

#include <torch/nn/module.h>

#include <memory>
#include <set>
#include <string>
#include <vector>

namespace fsdp {
namespace detail {

class FSDPState;

// Shared by every state under one root (made by the root's lazy init).
struct StateContext {
  std::vector<FSDPState*> all_states;  // pre-order over the root's module tree
  FSDPState* iter_forward_root = nullptr;
  bool final_callback_queued = false;
  CommContext comm;
};

class FSDPState : public std::enable_shared_from_this<FSDPState> {
 public:
  FSDPState(std::vector<std::shared_ptr<torch::nn::Module>> modules, std::unique_ptr<FSDPParamGroup> group,
            ReshardAfterForward reshard_after_forward);
  ~FSDPState();

  int64_t id() const { return id_; }
  // May be null: a fully_shard call whose module had no parameters left to own.
  FSDPParamGroup* group() const { return group_.get(); }
  std::shared_ptr<torch::nn::Module> module() const { return modules_.front().lock(); }
  const std::string& fqn() const { return fqn_; }
  bool is_root() const { return is_root_ == 1; }
  TrainingState training_state() const { return training_state_; }

  // Hooks.
  std::vector<at::Tensor> pre_forward(std::vector<at::Tensor> inputs);
  void post_forward(std::vector<at::Tensor>& outputs);
  void pre_backward();
  void post_backward();  // from the autograd function on the inputs

  // Names the resharded FSDP modules under this one, for errors.
  std::vector<std::string> resharded_modules_below() const;

  // FSDPModule setters.
  std::vector<std::weak_ptr<FSDPState>> forward_prefetch;
  std::vector<std::weak_ptr<FSDPState>> backward_prefetch;
  void set_reshard_after_forward(ReshardAfterForward option);

  // Lazy initialisation as the root (no-op once initialised as root or child). Also runs for a
  // user's unshard() before any forward, so the comm context exists.
  void lazy_init();

 private:
  void root_post_forward();
  void prefetch_next_in_forward();
  void prefetch_in_backward();
  static void final_callback(std::weak_ptr<FSDPState> root);

  const int64_t id_;
  std::vector<std::weak_ptr<torch::nn::Module>> modules_;
  std::unique_ptr<FSDPParamGroup> group_;
  ReshardAfterForward reshard_option_;
  std::string fqn_;
  int is_root_ = -1;  // -1 until lazy init, then 1 or 0
  std::shared_ptr<StateContext> ctx_;
  TrainingState training_state_ = TrainingState::kIdle;
  int modules_in_forward_ = 0;  // for a list of modules: how many ran forward this round
};

// Registry: module -> state, and param -> its record; lookups are cheap and thread-safe.
std::shared_ptr<FSDPState> find_state(const torch::nn::Module& module);
void register_state(const std::vector<std::shared_ptr<torch::nn::Module>>& modules,
                    const std::shared_ptr<FSDPState>& state);
std::shared_ptr<FSDPState> find_state_by_id(int64_t id);

}  // namespace detail
}  // namespace fsdp
