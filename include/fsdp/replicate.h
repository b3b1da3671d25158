// layer: ddp (what may include what: docs/architecture.md)
/// \file
/// fsdp/replicate.h — replicate(): PyTorch's composable DDP. Every rank keeps the whole model;
/// backward all-reduces (averages) the gradients in buckets, overlapped with the rest of backward.
///
/// \code{.cpp}
///   auto model = MyModel();
///   fsdp::ReplicatedModule ddp = fsdp::replicate(model);     // broadcasts rank 0's weights
///   torch::optim::Adam opt(model->parameters(), 1e-3);       // plain, whole parameters
///   for (...) {
///     opt.zero_grad();
///     at::Tensor loss = loss_fn(model->forward(x), y);       // or fsdp::call(model, x)
///     loss.backward();                                       // grads averaged over the mesh
///     opt.step();
///   }
///   {
///     auto guard = ddp.no_sync();                            // accumulate locally, no communication
///     loss_fn(model->forward(x1), y1).backward();
///   }
///   loss_fn(model->forward(x2), y2).backward();              // all-reduces the accumulated grads
/// \endcode
///
/// What it does. Parameters stay whole, plain tensors under the same names; nothing is gathered
/// and the forward is untouched (model->forward(x) and fsdp::call(model, x) are the same here).
/// At replicate() the trainable parameters (requires_grad, not already sharded by fully_shard) are
/// assigned to buckets in reverse registration order, the order their gradients are expected to
/// become ready in backward (DDP's heuristic): a bucket is closed once it holds at least
/// bucket_cap_mb (first_bucket_cap_mb for the first one), so it exceeds the cap by at most its
/// last parameter; parameters of different dtypes never share a bucket. Each bucket is one flat
/// buffer, allocated once. A hook on each parameter's gradient accumulator copies its gradient
/// into its bucket; when every gradient of a bucket is there (and every earlier bucket has been
/// issued, so all ranks issue the same collectives in the same order), the bucket's all-reduce
/// (average) is issued asynchronously and backward goes on. At the end of backward every bucket
/// is waited for and param.grad receives the average over the mesh of each rank's param.grad
/// (as DDP: an existing gradient accumulates first, then the sum is averaged).
///
/// Parameters that got no gradient in a backward. find_unused_parameters false (DDP's default):
/// the backward ends with a c10::Error naming them and this option, after the rank has still
/// reduced every bucket (zeros for the missing ones), so its peers do not hang. With true, those
/// gradients count as zeros on this rank; a parameter that no rank used keeps its param.grad as
/// it was (DDP's rule), which costs one extra small all-reduce per synced backward.
///
/// Not supported (each fails saying so): 2-D meshes, a module already managed by fully_shard or by
/// an enclosing replicate(). Buffers are broadcast from rank 0 at replicate() only, not at every
/// forward (DDP's broadcast_buffers): call ReplicatedModule::broadcast_buffers() where a model
/// changes them in forward (e.g. BatchNorm statistics). Apply dtype/device changes (module->to)
/// before replicate(): LibTorch gives a parameter whose dtype or device changes a new gradient
/// accumulator, which replicate() has not hooked. A backward in which other parameters still
/// reduce fails naming those; if every parameter changed, no hook runs and nothing is reduced.
///
/// Collective: every rank of the mesh calls replicate() on the same module structure, and runs the
/// same synced backwards. State dicts and checkpoints (fsdp/state_dict.h, fsdp/checkpoint.h) see
/// every parameter and buffer as a Replicate() DTensor over the replicate mesh; only the mesh's
/// first rank writes them to a checkpoint, which loads into a fully_shard()ed model at any world
/// size and the other way round.
#pragma once

#include <fsdp/device_mesh.h>

#include <c10/core/ScalarType.h>
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace fsdp {
namespace detail {
class Reducer;
}

/// The options of replicate(), DDP's: bucket sizes, gradient views, unused parameters.
struct ReplicateOptions {
  /// The data-parallel mesh, 1-D. Default: a 1-D "cpu" mesh over every rank of the world (made on
  /// first use; collective).
  TORCH_ARG(DeviceMesh, mesh);
  /// A bucket is closed once it holds at least this many MiB of gradients (DDP's default, 25).
  TORCH_ARG(double, bucket_cap_mb) = 25.0;
  /// The same for the first bucket, the first to be all-reduced: small, so that communication
  /// starts early in backward (DDP's default, 1 MiB).
  TORCH_ARG(double, first_bucket_cap_mb) = 1.0;
  /// Whether a parameter without a gradient in a backward is allowed (see the top of this file).
  TORCH_ARG(bool, find_unused_parameters) = false;
  /// param.grad becomes a view into its bucket: backward accumulates straight into the buffer that
  /// is all-reduced, so there is no copy in, no copy out and no second copy of the gradients in
  /// memory. Zeroing gradients in place keeps the views; after set_to_none the next backward's
  /// fresh gradient is copied in once and param.grad points at the bucket again.
  TORCH_ARG(bool, gradient_as_bucket_view) = false;
};

/// One bucket as built by replicate(), for inspection.
struct BucketInfo {
  std::vector<std::string> parameter_names;  ///< in the bucket's layout order
  int64_t bytes = 0;                         ///< size of its flat buffer
  at::ScalarType dtype = at::kFloat;         ///< the one dtype of its parameters
};

class ReplicatedModule;

/// Restores the gradient-sync setting it found when it goes out of scope (ReplicatedModule::no_sync).
class NoSyncGuard {
 public:
  /// Movable (the moved-from guard restores nothing), not copyable.
  NoSyncGuard(NoSyncGuard&& other) noexcept;
  NoSyncGuard(const NoSyncGuard&) = delete;
  NoSyncGuard& operator=(const NoSyncGuard&) = delete;
  NoSyncGuard& operator=(NoSyncGuard&&) = delete;
  ~NoSyncGuard();

 private:
  friend class ReplicatedModule;
  NoSyncGuard(std::shared_ptr<detail::Reducer> reducer, bool previous);
  std::shared_ptr<detail::Reducer> reducer_;
  bool previous_;
};

/// The handle of a replicated module. Cheap to copy; copies refer to the same state. The state
/// lives as long as the module does, whether or not a handle is kept. Not collective unless said.
class ReplicatedModule {
 public:
  ReplicatedModule() = default;  ///< invalid handle
  /// Whether this handle refers to a replicated module.
  bool valid() const { return reducer_ != nullptr; }
  /// The module replicate() was applied to; null once it no longer exists.
  std::shared_ptr<torch::nn::Module> module() const;
  /// The replicate mesh (its group carries the all-reduce counters).
  DeviceMesh mesh() const;

  /// Whether backward all-reduces gradients. false: gradients only accumulate locally (no
  /// communication) until a backward with true, which reduces what accumulated. FSDP2's name for
  /// DDP's no_sync. Set it to the same value on every rank, between backwards.
  void set_requires_gradient_sync(bool requires_gradient_sync);
  /// The current setting of set_requires_gradient_sync.
  bool requires_gradient_sync() const;
  /// DDP's no_sync(): gradient sync off until the guard goes out of scope, then as it was.
  NoSyncGuard no_sync();

  /// Broadcasts every buffer of the module from the mesh's first rank (collective; blocks).
  void broadcast_buffers();

  /// The buckets, in the order their all-reduces are issued.
  std::vector<BucketInfo> buckets() const;

  /// Two handles are equal when they refer to the same replicated module.
  bool operator==(const ReplicatedModule& o) const { return reducer_ == o.reducer_; }

 private:
  friend ReplicatedModule make_replicated_module(std::shared_ptr<detail::Reducer> reducer);
  explicit ReplicatedModule(std::shared_ptr<detail::Reducer> reducer) : reducer_(std::move(reducer)) {}
  std::shared_ptr<detail::Reducer> reducer_;
};

/// Replicates `module` over the mesh: broadcasts its parameters and buffers from the mesh's first
/// rank (collective; blocks until done), builds the buckets and hooks the gradient accumulators.
/// Throws c10::Error on a 2-D mesh, a bucket cap that is not positive, a module fully_shard() or
/// replicate() already manages, or one under a replicated module.
ReplicatedModule replicate(const std::shared_ptr<torch::nn::Module>& module,
                           const ReplicateOptions& options = ReplicateOptions());

/// The same for a LibTorch module holder (a `TORCH_MODULE`).
template <typename Impl>
ReplicatedModule replicate(const torch::nn::ModuleHolder<Impl>& module,
                           const ReplicateOptions& options = ReplicateOptions()) {
  return replicate(std::static_pointer_cast<torch::nn::Module>(module.ptr()), options);
}

/// True if replicate() was applied to `module` itself.
bool is_replicated(const torch::nn::Module& module);
/// True if `param` is one whose gradient a replicate() call reduces.
bool is_replicated_parameter(const at::Tensor& param);
/// The handle of a replicated module; throws c10::Error naming the module type if it is not one.
ReplicatedModule get_replicated_module(const torch::nn::Module& module);

}  // namespace fsdp
