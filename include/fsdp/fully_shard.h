// layer: fsdp (what may include what: docs/architecture.md)
/// \file
/// fsdp/fully_shard.h — fully_shard(): shard a module's parameters over a device mesh, in place.
///
/// \code{.cpp}
///   auto mesh = fsdp::init_device_mesh("cpu", {world});
///   for (auto& block : model->blocks()) fsdp::fully_shard(block, fsdp::FullyShardOptions().mesh(mesh));
///   fsdp::fully_shard(model, fsdp::FullyShardOptions().mesh(mesh));          // the root, last
///   torch::optim::Adam opt(model->parameters(), 1e-3);                       // sharded parameters
///   for (...) {
///     opt.zero_grad();
///     at::Tensor loss = loss_fn(fsdp::call(model, x), y);                    // see fsdp/call.h
///     loss.backward();                                                        // reduce-scatters grads
///     opt.step();
///   }
/// \endcode
///
/// What it does: each parameter of the module not already owned by an earlier fully_shard call
/// (apply it bottom-up) is split along dim 0 (or the dim FullyShardOptions::shard_placement_fn
/// chooses) over the mesh with torch.chunk's rule (dim 0 padded internally so every rank
/// exchanges the same size; a dim 0 smaller than the world leaves the last ranks empty).
/// Afterwards module->parameters() / named_parameters() return this rank's shards under the same
/// names (FQNs), and fsdp::as_dtensor(param) gives the DTensor view (Shard(0), or the chosen
/// Shard(d); global shape). All those parameters form one communication group: one all-gather
/// per unshard and one reduce-scatter per backward.
///
/// HSDP (hybrid sharding): pass a 2-D mesh with dim names, e.g.
/// \code{.cpp}
///   auto mesh = fsdp::init_device_mesh("cpu", {replicas, shards}, {"replicate", "shard"});
/// \endcode
/// Parameters are sharded over mesh dim 1 (each row of the mesh holds one full copy of the
/// model, split over its `shards` ranks) and replicated over dim 0; their DTensors have
/// placements (Replicate(), Shard(0)) (or Shard(d)). Forward and backward all-gather within the
/// shard group only; backward reduce-scatters over the shard group, then all-reduces the result over the
/// replicate group, so each gradient is the mean over all replicas x shards ranks (see
/// FSDPModule::set_gradient_divide_factor for other divisions). FSDP does not make the replicas
/// equal: start them from the same values, e.g. with fsdp::sync_module_states
/// (fsdp/replicate_sync.h). A mesh of more than 2 dims, or a 2-D mesh without dim names, is an
/// error naming what to pass.
///
/// Frozen parameters: set requires_grad on the registered shards (the tensors parameters() and
/// named_parameters() return after fully_shard). The module's member (e.g. linear->weight) takes
/// the shard's flag at each forward, so freezing or unfreezing between iterations applies from
/// the next forward; setting it on the member instead is overwritten there. Frozen parameters
/// are gathered for forward like the others but never reduced: a reduce-scatter carries only
/// the parameters that got a gradient (a group with none issues none), and a parameter without
/// one keeps no gradient (FSDPModule::set_reduce_scatter_unused_params changes that for
/// trainable ones).
///
/// Dtypes and devices: module->to(dtype) and module->to(device) work before and after
/// fully_shard, on the root or any module in it, as module.to() does under FSDP2. Called on every
/// rank between iterations; not collective itself. LibTorch's Module::to converts the registered
/// shards in place (the optimizer keeps them), and each FSDP module re-lays its converted shards
/// at its next unshard (its forward, or FSDPModule::unshard): a new flat shard in their dtype,
/// the unsharded parameters, all-gather and reduce-scatter following, and a MixedPrecisionPolicy
/// resolved again on top of the new dtype. State dicts and checkpoints carry the new dtype at
/// once. That unshard throws c10::Error, before any collective, naming the parameters, when
/// the shards of one fully_shard call were left in two dtypes (convert the FSDP module whole),
/// are not on the mesh's device (on the host under CPUOffloadPolicy), or were converted between
/// a forward and its backward.
///
/// Collective: every rank of the mesh calls fully_shard on the same modules in the same order.
/// Allocates this rank's shards and frees the full parameters (except on a shard group of one
/// rank), so a model too large for one rank can be built sharded: fully_shard each block as soon
/// as it is built, before the next one (fsdp::models::sharded_transformer does it for the
/// Transformer). Only CPU parameters are supported by this release; other cases fail with a message
/// that says so.
#pragma once

#include <fsdp/device_mesh.h>
#include <fsdp/dp_mesh_dims.h>
#include <fsdp/dtensor.h>
#include <fsdp/fsdp_module.h>
#include <fsdp/mixed_precision.h>
#include <fsdp/offload.h>
#include <fsdp/quantized_comm.h>

#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace fsdp {

/// reshard_after_forward: unset (the default: true for non-root modules, false for the root),
/// true, false, or an int k: after forward keep 1/k of each parameter and all-gather among k ranks
/// in backward (k must divide the shard group size; k = shard group size is true, k = 1 is
/// false). Under HSDP the k ranks are k consecutive ranks of this rank's shard group, within
/// its replica.
class ReshardAfterForward {
 public:
  ReshardAfterForward() = default;
  /** @{ */
  /// true or false, or the int k.
  /* implicit */ ReshardAfterForward(bool reshard) : kind_(reshard ? kTrue : kFalse) {}
  /* implicit */ ReshardAfterForward(int group_size) : kind_(kInt), group_size_(group_size) {}
  /** @} */
  /// Unset: fully_shard chooses (true, except for the root, which keeps its parameters).
  bool is_unset() const { return kind_ == kUnset; }
  /** @{ */
  /// Given as true or false, and which.
  bool is_bool() const { return kind_ == kTrue || kind_ == kFalse; }
  bool as_bool() const { return kind_ == kTrue; }
  /** @} */
  /** @{ */
  /// Given as an int k, and k.
  bool is_int() const { return kind_ == kInt; }
  int group_size() const { return group_size_; }
  /** @} */

 private:
  enum Kind { kUnset, kTrue, kFalse, kInt } kind_ = kUnset;
  int group_size_ = 0;
};

/// Chooses the tensor dim each parameter is sharded along. Called once per parameter of the
/// fully_shard call, in the group's order, with its name within the module passed to that call
/// (e.g. "fc1.weight"; for a list of modules, within the first) and the parameter itself (still
/// whole). Return Shard(d) to split dim d over the shard group, or std::nullopt for the default
/// Shard(0). A negative d counts from the end (Shard(-1) is the last dim).
///
/// \code{.cpp}
///   auto by_largest_dim = [](const std::string& fqn, const at::Tensor& p) -> std::optional<fsdp::Placement> {
///     return fsdp::Shard(p.dim() > 1 && p.size(1) > p.size(0) ? 1 : 0);
///   };
///   fsdp::fully_shard(model, fsdp::FullyShardOptions().shard_placement_fn(by_largest_dim));
/// \endcode
///
/// A dim other than 0 must split evenly (its size a multiple of the shard group size: FSDP pads
/// only dim 0), and must be a dim of the parameter; fully_shard throws c10::Error naming the
/// parameter, its shape and the dim otherwise, and for a placement that is not a Shard. Each
/// rank's shard is then its torch.chunk piece along d, stored contiguous; as_dtensor gives
/// placements (Shard(d)) (HSDP: (Replicate(), Shard(d))), which state dicts, optimizer state
/// dicts and checkpoints record. Its pieces are not contiguous in the unsharded tensor, so the
/// copies after each all-gather and before each reduce-scatter move them in runs (one per index
/// of the dims before d). Every rank must return the same placements.
using ShardPlacementFn = std::function<std::optional<Placement>(const std::string& fqn, const at::Tensor& param)>;

/// The options of fully_shard(), LibTorch style:
/// `fsdp::FullyShardOptions().mesh(mesh).reshard_after_forward(false)`.
struct FullyShardOptions {
  /// The data-parallel mesh. Default: a 1-D "cpu" mesh over every rank of the world (made on
  /// first use; collective). With dp_mesh_dims: the whole mesh, model dims included.
  TORCH_ARG(DeviceMesh, mesh);
  /// The data-parallel dims of `mesh` when it has model dims (see DataParallelMeshDims).
  /// Default: none; `mesh` is wholly data-parallel (1-D FSDP, or 2-D HSDP).
  TORCH_ARG(std::optional<DataParallelMeshDims>, dp_mesh_dims) = std::nullopt;
  /// Whether forward frees the gathered parameters (see ReshardAfterForward). Default: unset.
  TORCH_ARG(ReshardAfterForward, reshard_after_forward);
  /// The dtypes this group computes, communicates and returns in (fsdp/mixed_precision.h).
  /// Default: none; everything runs in the parameters' own dtype.
  TORCH_ARG(MixedPrecisionPolicy, mp_policy);
  /// Sharded parameters, gradients and optimizer state in host memory (fsdp/offload.h).
  /// Default: none; they live on the mesh's device.
  TORCH_ARG(std::optional<CPUOffloadPolicy>, offload_policy) = std::nullopt;
  /// Parameters this call leaves alone: not sharded, not gathered, not reduced. They stay the
  /// plain tensors their modules registered (parameters() returns them as they are, and
  /// fsdp::is_sharded_parameter is false for them), and the modules' forward uses them as they
  /// are. A call whose every parameter is ignored creates no group (it still registers the
  /// module, so it may be a root or a child). Their gradients are not synchronized: the user
  /// reduces them (e.g. an all-reduce over fsdp::world() after backward) or keeps them
  /// rank-local. State dicts hold them as whole tensors (Replicate() DTensors in
  /// sharded_state_dict; a checkpoint stores the first rank's copy), so keep them equal on every
  /// rank if they are to be saved. Pass the tensors parameters() returns before fully_shard;
  /// a tensor that is not a parameter of the modules this call manages has no effect.
  TORCH_ARG(std::vector<at::Tensor>, ignored_params);
  /// Per-parameter shard dim (see ShardPlacementFn). Default: none; every parameter is Shard(0).
  TORCH_ARG(ShardPlacementFn, shard_placement_fn) = nullptr;
  /// ZeRO++'s quantized weights (qwZ; fsdp/quantized_comm.h): the all-gather over the shard
  /// group carries the shards encoded (blockwise int8 by default), and every rank decodes the
  /// same bytes into the unsharded parameters; the shards, the optimizer and checkpoints keep
  /// the parameters' own dtype. Not FSDP2's: its unsharded parameters are exact. The backward
  /// all-gather of reshard_after_forward = k (among k ranks, a host's) is not quantized.
  /// error_feedback has no meaning here (weights are re-encoded from the exact shards each time).
  /// Refused with set_custom_all_gather. Default: none.
  TORCH_ARG(std::optional<QuantizedComm>, quantized_weights) = std::nullopt;
  /// ZeRO++'s quantized gradients (qgZ; fsdp/quantized_comm.h), HSDP only: the all-reduce over
  /// the replicate mesh dim carries the reduce-scatter's output encoded (int8 by default; bf16),
  /// with error feedback by default. The reduce-scatter within a replica is unchanged (FSDP2's
  /// MixedPrecisionPolicy::reduce_dtype halves it). A 1-D mesh is refused. Default: none.
  TORCH_ARG(std::optional<QuantizedComm>, quantized_gradients) = std::nullopt;
};

/** @{ */
/// Shards `module` (see the file comment).
FSDPModule fully_shard(const std::shared_ptr<torch::nn::Module>& module,
                       const FullyShardOptions& options = FullyShardOptions());
/** @} */
/// One group for several modules (e.g. a final norm and the output head, or tied modules).
FSDPModule fully_shard(const std::vector<std::shared_ptr<torch::nn::Module>>& modules,
                       const FullyShardOptions& options = FullyShardOptions());

/// The same for a LibTorch module holder (a `TORCH_MODULE`, e.g. fsdp::models::Transformer).
template <typename Impl>
FSDPModule fully_shard(const torch::nn::ModuleHolder<Impl>& module,
                       const FullyShardOptions& options = FullyShardOptions()) {
  return fully_shard(std::static_pointer_cast<torch::nn::Module>(module.ptr()), options);
}

/// The DTensor view of a sharded parameter: its local shard, the mesh, placements {Shard(d)}
/// (HSDP: {Replicate(), Shard(d)}; d = 0 unless shard_placement_fn chose another; with
/// dp_mesh_dims, see DataParallelMeshDims) and the global shape. Shares storage with the shard. `param`
/// is either the registered shard (from parameters() / named_parameters()) or the module's
/// member tensor (e.g. linear->weight, which stays the unsharded tensor autograd computes with).
/// Throws if it is neither.
DTensor as_dtensor(const at::Tensor& param);
/// True if `param` is a parameter sharded by fully_shard (the registered shard).
bool is_sharded_parameter(const at::Tensor& param);

}  // namespace fsdp
