// state.h — the per-fully_shard-call state: its hooks (called through fsdp::call and autograd),
// the training state machine, root detection and lazy initialisation, prefetch lists, and the
// root's end-of-backward callback. It drives its param group; it never talks to a process
// group itself.
#pragma once

#include "src/autograd/recomputation.h"
#include "src/composable/registry.h"
#include "src/fsdp/common.h"
#include "src/fsdp/param_group.h"

#include <fsdp/fsdp_module.h>
#include <fsdp/mixed_precision.h>

#include <torch/nn/module.h>

#include <functional>
#include <memory>
#include <optional>
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
  // FSDPModule::set_is_last_backward: whether the next end of backward finalizes (waits for
  // every reduction, drops unconsumed prefetches and the backward prefetch order).
  bool is_last_backward = true;
  // The order every rank's reduce-scatters follow under set_reduce_scatter_unused_params: the
  // groups in the reverse order of their last pre-forward in the latest forward (all ranks run
  // the same forwards, or their all-gathers would not match), then the groups that did not run
  // forward, in reverse pre-order. Set at the end of each forward.
  std::vector<FSDPParamGroup*> canonical_reduce_order;
  // Groups in the order their pre-forward ran, this iteration and the previous one: forward
  // prefetch follows the previous one (on CPU nothing runs ahead by itself). Per root, also when
  // roots share a CommContext, so that each root's prefetch follows its own modules.
  std::vector<FSDPParamGroup*> forward_order;
  std::vector<FSDPParamGroup*> last_forward_order;
  // The FSDP module whose forward (or a hook around it) an exception escaped, empty if none:
  // until FSDPModule::reset_iter_state() the next forward is refused, since half an
  // iteration's bookkeeping is left behind.
  std::string failed_forward;
  // The root's own, or the first root's under fsdp::share_comm_ctx.
  std::shared_ptr<CommContext> comm;
  // The device the groups under this root compute on (the mesh's): the root's pre-forward moves
  // the forward's tensor inputs there.
  c10::Device compute_device{c10::DeviceType::CPU};
};

// One fully_shard call's state. The composable registry owns it while its modules live and
// finds it for fsdp::call (forward_hooks) and for autograd (by id).
class FSDPState : public composable::ModuleState, public ForwardHooks, public std::enable_shared_from_this<FSDPState> {
 public:
  // `auto_reshard_after_forward`: reshard_after_forward was left unset, so the group's
  // post-forward resharding (already set up by fully_shard) is turned off if this state
  // becomes a root: backward needs the root's parameters again at once.
  // `mp_policy` also says how forward inputs and outputs are cast.
  FSDPState(std::vector<std::shared_ptr<torch::nn::Module>> modules, std::unique_ptr<FSDPParamGroup> group,
            bool auto_reshard_after_forward, MixedPrecisionPolicy mp_policy);

  detail::ForwardHooks* forward_hooks() override { return this; }
  // May be null: a fully_shard call whose module had no parameters left to own.
  FSDPParamGroup* group() const { return group_.get(); }
  std::shared_ptr<torch::nn::Module> module() const { return modules_.front().lock(); }
  const std::string& fqn() const { return fqn_; }
  TrainingState training_state() const { return training_state_; }

  // Hooks. `module` is the one being called (one of this state's modules).
  std::vector<at::Tensor> pre_forward(const torch::nn::Module& module, std::vector<at::Tensor> inputs) override;
  void post_forward(const torch::nn::Module& module, std::vector<at::Tensor>& outputs) override;
  // Marks the iteration failed; LibTorch's error about freed storage becomes one naming the
  // resharded FSDP modules below (call.cpp).
  [[noreturn]] void rethrow_forward_error() override;
  void pre_backward();
  void post_backward();  // from the autograd function on the inputs

  // Names the resharded FSDP modules under this one, for errors.
  std::vector<std::string> resharded_modules_below() const;

  // FSDPModule controls.
  void set_states_to_forward_prefetch(std::vector<std::weak_ptr<FSDPState>> states);
  void set_states_to_backward_prefetch(std::vector<std::weak_ptr<FSDPState>> states);
  // The bool form only, so it never creates a process group: true reshards over the shard group.
  void set_reshard_after_forward(bool reshard_after_forward);
  // Sets the shared context's flag; before lazy initialisation it is kept here and the shared
  // context starts from it (the root's, else the first state's in pre-order that was set).
  void set_is_last_backward(bool is_last_backward);
  // Reduce-scatters issued under this state's root whose gradients are not yet written.
  int64_t reductions_in_flight() const;

  // An exception escaped one of this state's modules' forward (or its hooks): see
  // StateContext::failed_forward.
  void mark_iteration_failed();
  // FSDPModule::reset_iter_state, on a root: waits for the collectives in flight, drops them
  // and every piece of the unfinished iteration's bookkeeping, reshards every group.
  void reset_iter_state();
  // fsdp::share_comm_ctx. The communication context this root uses, created now if it has
  // none yet (then lazy initialisation adopts it).
  std::shared_ptr<CommContext> comm_context_to_share();
  // Makes this root use `comm` (only between iterations: none of its reductions in flight).
  void use_comm_context(std::shared_ptr<CommContext> comm);

  // Lazy initialisation as the root, from the first pre-forward (no-op once initialised as root
  // or child): collects the states under this module, shares one context with them, names their
  // groups and turns off the root's automatic reshard after forward.
  void lazy_init();

 private:
  bool is_module_of_this_state(const torch::nn::Module& module) const;
  void check_previous_iteration_finished() const;
  void root_pre_forward(std::vector<at::Tensor>& inputs);
  void cast_forward_inputs(std::vector<at::Tensor>& inputs) const;
  void cast_forward_outputs(std::vector<at::Tensor>& outputs) const;
  std::vector<at::Tensor> pre_recompute(std::vector<at::Tensor> inputs);
  void hook_inputs_for_post_backward(std::vector<at::Tensor>& inputs);
  void hook_outputs_for_pre_backward(std::vector<at::Tensor>& outputs);
  void finish_group_forward();
  void root_post_forward();
  void prefetch_next_in_forward();
  void prefetch_in_backward();
  std::vector<FSDPParamGroup*> groups_of(const std::vector<std::weak_ptr<FSDPState>>& states) const;
  std::vector<FSDPParamGroup*> compute_canonical_reduce_order() const;
  void reduce_groups_due_before(FSDPParamGroup* group);
  static void final_callback(std::weak_ptr<FSDPState> root);
  static void post_backward_of_unreached_groups(StateContext& ctx);
  static void finalize_backward(StateContext& ctx);

  std::vector<std::weak_ptr<torch::nn::Module>> modules_;
  std::unique_ptr<FSDPParamGroup> group_;
  bool auto_reshard_after_forward_;
  MixedPrecisionPolicy mp_policy_;
  std::string fqn_;
  std::optional<bool> is_root_;                       // set by lazy init
  std::optional<bool> is_last_backward_before_init_;  // see set_is_last_backward
  std::shared_ptr<StateContext> ctx_;
  std::shared_ptr<CommContext> comm_before_init_;  // from fsdp::share_comm_ctx before lazy init
  TrainingState training_state_ = TrainingState::kIdle;
  // The modules of this state that have not finished forward in the current round; a round
  // starts when the first of them is called with the set empty, and the group's post-forward
  // runs when the set is empty again (a module called twice does not end the round early).
  std::set<const torch::nn::Module*> modules_to_run_forward_;
  std::vector<std::weak_ptr<FSDPState>> states_to_forward_prefetch_;
  std::vector<std::weak_ptr<FSDPState>> states_to_backward_prefetch_;
};

// The composable registry's answers for fully_shard: module -> state, and state id -> state (for
// the autograd function). Cheap, thread-safe.
std::shared_ptr<FSDPState> find_state(const torch::nn::Module& module);
std::shared_ptr<FSDPState> find_state_by_id(int64_t id);

}  // namespace detail

// The public handle of a state (fsdp_module.cpp; FSDPModule's constructor is private).
FSDPModule make_fsdp_module(std::shared_ptr<detail::FSDPState> state);

}  // namespace fsdp
