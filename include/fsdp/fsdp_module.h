// fsdp/fsdp_module.h — the handle of a module that fully_shard() was applied to: manual
// unshard/reshard, prefetch control and gradient-sync control.
//
//   fsdp::FSDPModule root = fsdp::fully_shard(model);
//   fsdp::FSDPModule same = fsdp::get_fsdp_module(*model);   // reachable from the module
//   root.unshard();                 // all-gather now (collective), e.g. before calling forward() directly
//   root.reshard();                 // free the gathered parameters
//
// A handle is cheap to copy; copies refer to the same FSDP state. Unless said otherwise a
// method is not collective and acts on this module only (not its FSDP submodules).
#pragma once

#include <fsdp/device_mesh.h>

#include <torch/nn/module.h>

#include <memory>
#include <vector>

namespace fsdp {
namespace detail {
class FSDPState;
class FSDPParamGroup;
}  // namespace detail

// Returned by FSDPModule::unshard(async_op = true): wait() makes the gathered parameters
// usable. If nobody waits, the module's next pre-forward does.
class UnshardHandle {
 public:
  UnshardHandle() = default;
  // Blocks until the all-gather finished and the unsharded parameters are in place. Idempotent.
  void wait();

 private:
  friend class FSDPModule;
  explicit UnshardHandle(std::shared_ptr<detail::FSDPState> state) : state_(std::move(state)) {}
  std::shared_ptr<detail::FSDPState> state_;
};

class FSDPModule {
 public:
  FSDPModule() = default;  // invalid handle
  bool valid() const { return state_ != nullptr; }
  // The module fully_shard() was applied to (the first one, for a list); null once that module
  // no longer exists (the handle keeps the FSDP state, not the module, alive).
  std::shared_ptr<torch::nn::Module> module() const;

  // All-gathers this module's parameters (collective over its mesh) and registers nothing
  // new: the module's member tensors become usable. With async_op the all-gather is only
  // issued; use the handle (or the next forward) to wait. No-op if already unsharded.
  UnshardHandle unshard(bool async_op = false);
  // Frees the gathered parameters (waiting out an issued all-gather first). Not collective.
  void reshard();

  // After this module's all-gather in forward, also issue the all-gathers of `modules`
  // (one = same overlap as the default, issued earlier; two or more = more aggressive, more memory).
  void set_modules_to_forward_prefetch(const std::vector<FSDPModule>& modules);
  // In backward, prefetch `modules` instead of the default (the module that ran forward before this one).
  void set_modules_to_backward_prefetch(const std::vector<FSDPModule>& modules);

  // Whether backward reduce-scatters gradients. false = accumulate unsharded gradients locally
  // (no communication, more memory) until a backward with true; FSDP1's no_sync.
  void set_requires_gradient_sync(bool requires_gradient_sync, bool recurse = true);
  // Runtime change of reshard_after_forward (bool form).
  void set_reshard_after_forward(bool reshard_after_forward, bool recurse = true);
  // Whether post-backward frees the gathered parameters (false: the next forward needs no all-gather).
  void set_reshard_after_backward(bool reshard_after_backward, bool recurse = true);

  // The mesh this module's parameters are sharded over (its groups carry the collective counters).
  DeviceMesh mesh() const;

  // Bytes of gathered (unsharded) parameter storage this module holds now; 0 when resharded.
  int64_t unsharded_parameter_bytes() const;

  bool operator==(const FSDPModule& o) const { return state_ == o.state_; }

 private:
  friend FSDPModule make_fsdp_module(std::shared_ptr<detail::FSDPState> state);
  explicit FSDPModule(std::shared_ptr<detail::FSDPState> state) : state_(std::move(state)) {}
  std::vector<detail::FSDPState*> states(bool recurse) const;
  static std::vector<std::weak_ptr<detail::FSDPState>> states_of(const std::vector<FSDPModule>& modules,
                                                                 const char* setter);
  std::shared_ptr<detail::FSDPState> state_;
};

// True if fully_shard() was applied to `module` (as itself or as a member of a list).
bool is_fsdp_module(const torch::nn::Module& module);
// The handle of an FSDP module; throws c10::Error naming the module type if it is not one.
FSDPModule get_fsdp_module(const torch::nn::Module& module);

}  // namespace fsdp
