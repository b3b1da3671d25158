// layer: fsdp (what may include what: docs/architecture.md)
/// \file
/// fsdp/fsdp_module.h — the handle of a module that fully_shard() was applied to: manual
/// unshard/reshard, prefetch control, gradient-sync control and how gradients are reduced.
///
/// \code{.cpp}
///   fsdp::FSDPModule root = fsdp::fully_shard(model);
///   fsdp::FSDPModule same = fsdp::get_fsdp_module(*model);   // reachable from the module
///   root.unshard();                 // all-gather now (collective), e.g. before calling forward() directly
///   root.reshard();                 // free the gathered parameters
/// \endcode
///
/// A handle is cheap to copy; copies refer to the same FSDP state. Unless said otherwise a
/// method is not collective and acts on this module only (not its FSDP submodules).
#pragma once

#include <fsdp/custom_comm.h>
#include <fsdp/device_mesh.h>
#include <fsdp/process_group.h>

#include <torch/nn/module.h>

#include <ATen/core/Tensor.h>
#include <c10/core/Event.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace fsdp {
namespace detail {
class FSDPState;
}  // namespace detail

/// Returned by FSDPModule::unshard(async_op = true): wait() makes the gathered parameters
/// usable. If nobody waits, the module's next pre-forward does.
class UnshardHandle {
 public:
  UnshardHandle() = default;
  /// Blocks until the all-gather finished and the unsharded parameters are in place. Idempotent.
  void wait();

 private:
  friend class FSDPModule;
  explicit UnshardHandle(std::shared_ptr<detail::FSDPState> state) : state_(std::move(state)) {}
  std::shared_ptr<detail::FSDPState> state_;
};

/// The handle of a module that fully_shard() was applied to (see the file comment): the
/// runtime controls of FSDP2's FSDPModule.
class FSDPModule {
 public:
  FSDPModule() = default;  ///< invalid handle
  /// Whether this handle refers to an FSDP module.
  bool valid() const { return state_ != nullptr; }
  /// The module fully_shard() was applied to (the first one, for a list); null once that module
  /// no longer exists (the handle keeps the FSDP state, not the module, alive).
  std::shared_ptr<torch::nn::Module> module() const;

  /// All-gathers this module's parameters (collective over its mesh) and registers nothing
  /// new: the module's member tensors become usable. With async_op the all-gather is only
  /// issued; use the handle (or the next forward) to wait. No-op if already unsharded.
  UnshardHandle unshard(bool async_op = false);
  /// Frees the gathered parameters. Not collective, never blocks. An all-gather issued by
  /// unshard(true) and not yet waited for stays pending, as in FSDP2: the next unshard (or
  /// forward) uses it rather than gathering again.
  void reshard();

  /// After this module's all-gather in forward, also issue the all-gathers of `modules`
  /// (one = same overlap as the default, issued earlier; two or more = more aggressive, more memory).
  /// A module in the list that already ran in this forward and resharded is gathered for its
  /// backward: its pre-backward uses that all-gather (under no-grad, or if unused by the end of
  /// the last backward, it is dropped). So the last module of a forward can start the first
  /// backward all-gathers while the loss is computed.
  void set_modules_to_forward_prefetch(const std::vector<FSDPModule>& modules);
  /// In backward, prefetch `modules` instead of the default (the module that ran forward before this one).
  void set_modules_to_backward_prefetch(const std::vector<FSDPModule>& modules);

  /// Whether backward reduce-scatters gradients (and, under HSDP, all-reduces them). false =
  /// accumulate unsharded gradients locally (no communication, more memory) until a backward
  /// with true; FSDP1's no_sync. Sets what set_requires_all_reduce sets, too.
  void set_requires_gradient_sync(bool requires_gradient_sync, bool recurse = true);
  /// HSDP: whether backward all-reduces the reduce-scattered gradients over the replicate group.
  /// false = every backward still reduce-scatters, but the outputs are summed into a buffer of
  /// the module's group and no sharded gradient is written; the first backward with true adds
  /// that sum before its all-reduce. So gradient accumulation over micro-batches can skip the
  /// inter-replica traffic (at 1/shards of the gradients' memory). No effect on a 1-D mesh.
  void set_requires_all_reduce(bool requires_all_reduce, bool recurse = true);
  /// Divide this module's gradients by `factor` instead of taking the mean: the sharded
  /// gradient becomes the sum over all data-parallel ranks divided by `factor` (e.g. the number of
  /// tokens of the global batch). This module's group only, not its FSDP submodules. Throws
  /// unless factor is positive and finite.
  void set_gradient_divide_factor(double factor);
  /// true = this module's collectives only SUM; the division runs as a separate step on the
  /// reduced gradients (for backends without AVG). This module's group only.
  void set_force_sum_reduction_for_comms(bool enable);
  /// `hook(reduce_output)` is called once per backward for this module's group, at the end of
  /// backward (on every rank at the same point, in the same order, so the hook may run blocking
  /// collectives), with the flat reduced shard (reduce dtype, padding included,
  /// before any remaining division): after the reduce-scatter on a 1-D mesh (where the hook may
  /// all-reduce it over replicas itself, e.g. with a ProcessGroup of its own, in place), after
  /// the all-reduce under HSDP. It may modify the tensor in place or assign one of the same size
  /// and dtype; the sharded gradients are then written from it. An empty function removes the
  /// hook. This module's group only. (PyTorch's `stream` argument has no CPU counterpart and is
  /// not offered.)
  void set_all_reduce_hook(std::function<void(at::Tensor&)> hook);
  /// Runtime change of reshard_after_forward (bool form).
  void set_reshard_after_forward(bool reshard_after_forward, bool recurse = true);
  /// Whether post-backward frees the gathered parameters (false: the next forward needs no all-gather).
  void set_reshard_after_backward(bool reshard_after_backward, bool recurse = true);

  // ---- Gradient reduction. Each reduce-scatter is collective over the module's shard group, so
  // every setter below that changes which reduce-scatters run must be called alike on all ranks.

  /// Whether trainable parameters that got no gradient in a backward still join the
  /// reduce-scatter, with zeros (and then get a zero gradient; PyTorch FSDP's newest behaviour).
  /// Default false: only parameters with a gradient are reduced, and a parameter without one
  /// keeps no gradient (or the one it had). Turn it on when the ranks' control flow differs
  /// (a rank skips a block, mixture-of-experts routing): otherwise the rank that skipped a module
  /// issues fewer reduce-scatters and the job fails at the collective timeout. A whole module
  /// a rank's backward did not reach reduces its zeros too. So that equal-sized modules never
  /// pair the wrong reduce-scatters, every rank then issues them in one order: the reverse of
  /// the latest forward (modules that ran no forward last); before a module reduces, any module
  /// due earlier that has not reduced yet reduces first. That needs each rank's backward to
  /// follow this order, as a sequential model's does; a module whose backward finishes while
  /// one due before it is still running is refused with an error. A rank that skips a module
  /// also prefetches differently in backward, so its all-gathers fall between other
  /// reduce-scatters than on the other ranks: on one process group the two kinds would then pair
  /// up wrongly. Use set_separate_reduce_scatter_group too, which gives each kind a sequence of
  /// its own. Frozen parameters (requires_grad false) are never reduced.
  void set_reduce_scatter_unused_params(bool enable, bool recurse = true);
  /// Whether the next backward is the last before the optimizer step. false (micro-batches to
  /// follow): its end leaves the reduce-scatters pending (their gradients are written as they
  /// finish during later backwards) and keeps the prefetch bookkeeping. The gradients are
  /// complete after the end of the next backward run with true (the default) — the one point the
  /// optimizer may look at them. Shared by every module under the same root; set before the
  /// first forward, the root's value (else a submodule's) applies. Not collective.
  void set_is_last_backward(bool is_last_backward);
  /// Whether backward all-gathers this module's parameters (this module only; default true).
  /// false: pre-backward and backward prefetch skip the all-gather, for parameters whose values
  /// no gradient needs (an embedding table, an added bias); their gradients still arrive in the
  /// unsharded parameters and are reduced. A backward that does read them fails.
  void set_unshard_in_backward(bool unshard_in_backward);
  /// Runs reduce-scatters on a process group of their own (a new group over the same ranks, with
  /// its own communication thread), so that a reduce-scatter and the next all-gather no longer
  /// queue behind each other. enable = false goes back to the shard group. Collective when it
  /// creates a group: every rank must call it at the same point of its sequence of group
  /// creations (fsdp::new_group), alike on all ranks. One group is made per call (for the
  /// modules that have none yet); nothing on a mesh of one rank. Blocks until the ranks connect.
  void set_separate_reduce_scatter_group(bool enable = true, bool recurse = true);
  /// At most `max_buffers` reduce-scatters in flight (default 1, as in PyTorch FSDP): before one
  /// more is issued, the oldest is waited for and its gradients written (under HSDP its
  /// all-reduce is started, and goes on beside the next reduce-scatter), which bounds the memory
  /// their inputs hold. More overlaps communication with later backward compute at that memory
  /// cost. Throws c10::Error if max_buffers < 1; a bool does not compile.
  void set_reduce_scatter_max_input_buffers(int max_buffers, bool recurse = true);
  void set_reduce_scatter_max_input_buffers(bool, bool recurse = true) = delete;

  // ---- Custom communication (fsdp/custom_comm.h). This module's group only, not its FSDP
  // submodules; null goes back to FSDP's own. Install the same kind of object on every rank.

  /// This module's all-gathers (in forward, backward and prefetches; with reshard_after_forward
  /// = k also the backward one among k ranks) allocate their input and output through
  /// `comm->allocate` and run through `(*comm)(output, input, group)`.
  void set_custom_all_gather(std::shared_ptr<AllGather> comm);
  /// This module's reduce-scatters likewise, `(*comm)(output, input, group, op)` (on the
  /// reduce_scatter_group()). Under HSDP the all-reduce that follows is FSDP's own.
  void set_custom_reduce_scatter(std::shared_ptr<ReduceScatter> comm);
  /// PyTorch FSDP2 lets the process group's backend allocate the staging buffers (NCCL's
  /// registered memory, for zero-copy collectives). fsdp-cpp's CPU process group sends from any
  /// host memory (Gloo over TCP) and has no such allocator, so enable = true is refused with a
  /// "not supported by this backend" error; false (the default) does nothing. As in PyTorch, it
  /// is also refused while a custom all-gather or reduce-scatter is installed on this module (a
  /// custom comm installed afterwards overrides it).
  void set_allocate_memory_from_process_group_for_comm(bool enable);

  // ---- PyTorch FSDP2's controls of CUDA streams and NCCL memory. A CPU mesh has no streams,
  // events or symmetric memory: the optimizer step already precedes the next all-gather in
  // program order, and every all-gather is issued on its group's communication thread and
  // waited for right before the module runs. So these calls fail loudly where code written
  // for FSDP2 expects an effect, never to be ignored.

  /// PyTorch: the root's next all-gathers wait for `event` (recorded after the optimizer step)
  /// instead of the whole current stream. Refused, with an error saying why: on a CPU mesh there
  /// is no all-gather stream to order, and on a CUDA mesh each all-gather's copy-in already waits
  /// for the whole current stream.
  void set_post_optim_event(const c10::Event& event);
  /// PyTorch: all-gather staging buffers from NCCL symmetric memory. Always refused here
  /// (`backend` is named in the error).
  void set_symm_mem_for_comm(const std::string& backend = "NCCL");
  /// PyTorch (`_set_unshard_async_op`), on this module and every FSDP module below it: whether
  /// pre-forward and pre-backward all-gathers run on the current CUDA stream (true: their buffers
  /// come from the compute stream's pool, and overlap needs explicit prefetch) instead of FSDP's
  /// all-gather streams (false, the default). Not collective. true on a CPU mesh is refused,
  /// since there both run the same way (issued on the communication thread, waited for before
  /// the module runs).
  void set_unshard_async_op(bool async_op);

  // ---- Recovery.

  /// After an exception thrown inside forward or backward (from a module, a hook, the loss), on
  /// the root: waits for the all-gathers and reduce-scatters in flight, reshards every module,
  /// and drops what the unfinished iteration left: the iteration's forward root, every module's
  /// training state, the forward and backward prefetch order, the pending gradient reductions
  /// (none of their gradients is written), unreduced and no-sync gradients and HSDP partial sums
  /// (a micro-batch sequence starts over). Sharded gradients already written stay: zero them
  /// (optimizer.zero_grad()) as every iteration does. Until it is called, the next forward fails
  /// with an error that says to call it. Every rank must call it at the same point, after the
  /// same exception (it waits for the collectives they all issued); when ranks failed at
  /// different points their collectives do not pair and it ends at the collective timeout.
  /// Under fsdp::share_comm_ctx it drops the shared context's pending reductions, the other
  /// roots' too. Throws c10::Error on a module that is not a root; before the first forward it
  /// does nothing.
  void reset_iter_state();

  /// The group this module's reduce-scatters run on: the mesh's shard group, or the one made by
  /// set_separate_reduce_scatter_group (both carry collective counters).
  std::shared_ptr<ProcessGroup> reduce_scatter_group() const;
  /// Reduce-scatters issued under this module's root whose gradients are not written yet
  /// (0 before the first forward and after the end of the last backward). Not collective.
  int64_t reductions_in_flight() const;

  /// The mesh this module's parameters are sharded over (its groups carry the collective counters).
  DeviceMesh mesh() const;

  /// Bytes of gathered (unsharded) parameter storage this module holds now; 0 when resharded.
  int64_t unsharded_parameter_bytes() const;

  /// Two handles are equal when they refer to the same FSDP state.
  bool operator==(const FSDPModule& o) const { return state_ == o.state_; }

 private:
  friend FSDPModule make_fsdp_module(std::shared_ptr<detail::FSDPState> state);
  friend void share_comm_ctx(const std::vector<FSDPModule>& modules);
  explicit FSDPModule(std::shared_ptr<detail::FSDPState> state) : state_(std::move(state)) {}
  std::vector<detail::FSDPState*> states(bool recurse) const;
  static std::vector<std::weak_ptr<detail::FSDPState>> states_of(const std::vector<FSDPModule>& modules,
                                                                 const char* setter);
  std::shared_ptr<detail::FSDPState> state_;
};

/// Makes the FSDP roots `modules` (e.g. the stages of a pipeline, each fully_shard'ed on its
/// own) use the communication context of the first: one queue of gradient reductions in flight,
/// so set_reduce_scatter_max_input_buffers bounds their reduce-scatter inputs together and every
/// root's end of backward waits for all of them, and one backward prefetch order (as in PyTorch
/// FSDP2, whose shared context also holds the CUDA streams; this CPU build has none). Each root
/// keeps its own forward prefetch order and iteration state. Call it on every rank alike, between
/// iterations (a root with reductions in flight is refused), before or after the first forward.
/// An empty list does nothing; a module that is not a root (it runs under another FSDP module)
/// throws c10::Error naming it, at once or at its root's first forward.
void share_comm_ctx(const std::vector<FSDPModule>& modules);

/// True if fully_shard() was applied to `module` (as itself or as a member of a list).
bool is_fsdp_module(const torch::nn::Module& module);
/// The handle of an FSDP module; throws c10::Error naming the module type if it is not one.
FSDPModule get_fsdp_module(const torch::nn::Module& module);

}  // namespace fsdp
