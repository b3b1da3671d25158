// fsdp/fsdp_module.h — the handle of a module that fully_shard() was applied to: manual
// unshard/reshard, prefetch control, gradient-sync control and how gradients are reduced.
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

#include <ATen/core/Tensor.h>

#include <functional>
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

  // Whether backward reduce-scatters gradients (and, under HSDP, all-reduces them). false =
  // accumulate unsharded gradients locally (no communication, more memory) until a backward
  // with true; FSDP1's no_sync. Sets what set_requires_all_reduce sets, too.
  void set_requires_gradient_sync(bool requires_gradient_sync, bool recurse = true);
  // HSDP: whether backward all-reduces the reduce-scattered gradients over the replicate group.
  // false = every backward still reduce-scatters, but the outputs are summed into a buffer of
  // the module's group and no sharded gradient is written; the first backward with true adds
  // that sum before its all-reduce. So gradient accumulation over micro-batches can skip the
  // inter-replica traffic (at 1/shards of the gradients' memory). No effect on a 1-D mesh.
  void set_requires_all_reduce(bool requires_all_reduce, bool recurse = true);
  // Divide this module's gradients by `factor` instead of taking the mean: the sharded
  // gradient becomes the sum over all data-parallel ranks divided by `factor` (e.g. the number of
  // tokens of the global batch). This module's group only, not its FSDP submodules. Throws
  // unless factor is positive and finite.
  void set_gradient_divide_factor(double factor);
  // true = this module's collectives only SUM; the division runs as a separate step on the
  // reduced gradients (for backends without AVG). This module's group only.
  void set_force_sum_reduction_for_comms(bool enable);
  // `hook(reduce_output)` is called once per backward for this module's group, at the end of
  // backward (on every rank at the same point, in the same order, so the hook may run blocking
  // collectives), with the flat reduced shard (reduce dtype, padding included,
  // before any remaining division): after the reduce-scatter on a 1-D mesh (where the hook may
  // all-reduce it over replicas itself, e.g. with a ProcessGroup of its own, in place), after
  // the all-reduce under HSDP. It may modify the tensor in place or assign one of the same size
  // and dtype; the sharded gradients are then written from it. An empty function removes the
  // hook. This module's group only. (PyTorch's `stream` argument has no CPU counterpart and is
  // not offered.)
  void set_all_reduce_hook(std::function<void(at::Tensor&)> hook);
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
