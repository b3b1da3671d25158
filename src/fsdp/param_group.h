// param_group.h — FSDP's communication group: the parameters of one fully_shard call,
// all-gathered in ONE collective and reduce-scattered in ONE collective. The group decides
// WHEN; collectives.h lays out the buffers and issues the collectives.
//
// Where each collective is issued and who waits for it (all in param_group.cpp):
//   all-gather:      unshard() issues it (from pre-forward, pre-backward, a prefetch, or the
//                    user's FSDPModule::unshard); wait_for_unshard() waits and copies out.
//   reduce-scatter:  post_backward() issues it (on reduce_scatter_group(): the shard group, or
//                    its own group); first, CommContext::make_room_for_reduction() waits for
//                    the oldest reduce-scatter whose input is still held when the group's limit is
//                    reached, and drops that input. CommContext::finish_reductions() waits for
//                    the rest (the next post-backward, for those already done, and the end of the
//                    last backward, for all) and writes the sharded gradients.
//   all-reduce:      HSDP only: issue_all_reduce() issues it over the replicate group right after
//                    its reduce-scatter, as FSDP2 does, so that every rank interleaves the two
//                    groups' collectives in the same program order (NCCL needs that across
//                    communicators). It reads the reduce-scatter's output: on a device the
//                    all-reduce stream waits for the reduce-scatter stream, which waited for the
//                    collective; on the CPU the replicate group's communication thread waits for
//                    the reduce-scatter. finish_reductions() waits for it before
//                    finish_reduction() writes the sharded gradients. With quantized_gradients
//                    the input must be encoded first: on the CPU the all-reduce (an all-gather
//                    of encoded rows, or a bf16 all-reduce) is deferred to the next post-backward
//                    or the end of backward (CommContext::issue_deferred_all_reduces, which waits
//                    for its reduce-scatter), in the same order on every rank, unless the shard
//                    group has one rank (nothing to wait for: issued at once); finish_reduction()
//                    decodes it.
//
// Streams (a device only): the compute stream waits once per iteration's forward, at the root's
// pre-forward (begin_forward()), before the all-gather streams read the shards; within backward
// it waits only for each reduce-scatter (before its input is dropped), and for the gradients'
// copy-out at the end of backward (wait_for_gradients()).
#pragma once

#include "src/device/device_ops.h"
#include "src/fsdp/collectives.h"
#include "src/fsdp/common.h"
#include "src/fsdp/fsdp_param.h"
#include "src/fsdp/mesh_info.h"

#include <fsdp/device_mesh.h>
#include <fsdp/mixed_precision.h>
#include <fsdp/offload.h>
#include <fsdp/process_group.h>

#include <ATen/core/Tensor.h>

#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace fsdp {
namespace detail {

class FSDPParamGroup;

// One group's gradient reduction, from its post-backward until its gradients are written.
struct PendingReduction {
  // What follows the reduce-scatter: writing the sharded gradients (FSDP), an all-reduce over the
  // replicate group first (HSDP), or keeping the output as a partial sum for a later backward
  // (HSDP with set_requires_all_reduce(false)).
  enum class Next { kWriteGrads, kAllReduce, kKeepPartial };

  FSDPParamGroup* group;
  ReduceScatterResult reduce_scatter;
  Next next;
  // Its reduce-scatter was waited for (on a device: by the reduce-scatter stream) and, for
  // Next::kKeepPartial, its output added to the partial sum.
  bool reduce_scattered = false;
  WorkHandle all_reduce;  // Next::kAllReduce: issued right after the reduce-scatter
  // On a device: recorded on the reduce-scatter stream once it waited for the collective; the
  // compute stream waits for it before the reduce-scatter input (made there) is dropped.
  std::optional<device::Event> reduce_scattered_event;
  // quantized_gradients on the CPU: the all-reduce waits to be issued until the reduce-scatter
  // output can be encoded (CommContext::issue_deferred_all_reduces).
  bool all_reduce_deferred = false;
  // quantized_gradients: the encoded rows of the all-reduce (`all_reduce` is its Work).
  std::optional<QuantizedAllReduce> quantized_all_reduce = std::nullopt;
};

// FSDP2's communication streams, made at the root's lazy init when its mesh is on a device
// (none on the CPU, where everything runs in program order). A tensor made on one stream and used
// on another is kept referenced until its maker waited for an event recorded after the use, so
// that memory is reused deterministically, without record_stream.
struct CommStreams {
  c10::Stream all_gather_copy_in;  // the all-gather input (cast, host-to-device copy) and buffers
  c10::Stream all_gather;          // issues the all-gather; the compute stream waits for its event
  c10::Stream reduce_scatter;      // pre-division, the reduce-scatter, and (FSDP) the gradients' copy-out
  c10::Stream all_reduce;          // HSDP: the all-reduce, then the gradients' copy-out
};

// Shared by every group under one root (created by the root's lazy init), and by several roots
// after fsdp::share_comm_ctx.
struct CommContext {
  std::optional<CommStreams> streams;  // on a device only
  // Events after the gradients' copy-out, which the compute stream waits for at the end of
  // backward; and those after copies to pinned host memory (CPU offload), which the host waits for.
  std::vector<device::Event> reduction_events;
  std::vector<device::Event> host_copy_events;
  // Reduce outputs a stream other than their maker's used (an HSDP all-reduce's buffer, or the
  // output of a one-rank shard group, made on the compute stream): kept referenced until the
  // compute stream waited for reduction_events, so that no stream reuses their memory early.
  std::vector<at::Tensor> reduce_outputs_in_use;

  // Makes the streams on `device` (a no-op on the CPU, or when they exist).
  void init_streams(c10::Device device);
  // The root's pre-forward, once per iteration's forward (FSDP2's wait in _root_pre_forward):
  // both all-gather streams wait for the compute stream, whose latest work (the optimizer step,
  // a state dict loaded) wrote the shards that every all-gather of this iteration reads. A no-op
  // on the CPU.
  void begin_forward();
  // The end of the last backward: the compute stream waits for every gradient written, and the
  // host for every gradient copied to host memory. A no-op on the CPU.
  void wait_for_gradients();

  // Groups in the order their post-forward ran this iteration (with repeats): backward prefetch
  // walks it in reverse.
  std::vector<FSDPParamGroup*> post_forward_order;
  std::deque<PendingReduction> reductions;  // in issue order

  // quantized_gradients on the CPU: issues, in issue order, the all-reduces deferred until their
  // reduce-scatter finished (waiting for it). Called at every post-backward before its
  // reduce-scatter, and at the end of the last backward: the same program points on every rank,
  // so every rank issues them in the same order.
  void issue_deferred_all_reduces();
  // Moves pending reductions on, in issue order: each one whose collectives finished writes its
  // gradients. With wait_all, waits for every one; otherwise waits for nothing.
  void finish_reductions(bool wait_all);
  // Before a group issues one more reduce-scatter: while `max_in_flight` (>= 1) reductions still
  // hold their reduce-scatter input, waits for the oldest one's reduce-scatter and drops its input
  // (on a device the compute stream waits, the host does not), so that at most that many
  // reduce-scatter inputs are alive. All-reduces keep running.
  void make_room_for_reduction(int64_t max_in_flight);
  // Waits for `r`'s reduce-scatter (on a device: the reduce-scatter stream waits) and, for
  // Next::kKeepPartial, adds its output to the group's partial sum. Once per reduction.
  void complete_reduce_scatter(PendingReduction& r);
  // Completes the reduce-scatters of `group`'s pending reductions, so that its partial sum holds
  // every earlier micro-batch before it is read.
  void complete_reduce_scatters_of(const FSDPParamGroup* group);
  // FSDPModule::reset_iter_state: takes every pending reduction's collectives to the end (all
  // were issued on every rank alike), then drops them without writing a gradient. Rethrows the
  // first failure, after dropping them all.
  void discard_reductions();

 private:
  void release_reduce_scatter_input(PendingReduction& r);
  void wait_for_all_reduce(PendingReduction& r);
  void write_gradients_of(PendingReduction& r);
  void keep_reduce_output_in_use(const PendingReduction& r);
};

class FSDPParamGroup {
 public:
  // `post_forward_group` says how the group reshards after forward (see
  // set_post_forward_group). Copies every parameter's shard into the group's flat shard and
  // frees the unsharded storage (on a mesh of one rank the unsharded tensors alias the shards).
  // `mp_policy` gives the dtypes of the group's collectives and unsharded parameters (resolved
  // again when module->to(dtype) converts the shards), and `offload_policy` (when set) keeps its
  // shards in host memory.
  FSDPParamGroup(FSDPParams params, MeshInfo mesh_info, std::string module_fqn,
                 std::shared_ptr<ProcessGroup> post_forward_group, const MixedPrecisionPolicy& mp_policy,
                 const std::optional<CPUOffloadPolicy>& offload_policy);
  FSDPParamGroup(const FSDPParamGroup&) = delete;
  FSDPParamGroup& operator=(const FSDPParamGroup&) = delete;

  const FSDPParams& params() const { return params_; }
  const DeviceMesh& mesh() const { return mesh_; }
  const MeshInfo& mesh_info() const { return mesh_info_; }
  const std::shared_ptr<ProcessGroup>& shard_group() const { return shard_group_; }
  // HSDP: the group gradients are all-reduced over after the reduce-scatter; null otherwise.
  const std::shared_ptr<ProcessGroup>& replicate_group() const { return replicate_group_; }
  const std::string& module_fqn() const { return module_fqn_; }
  const GroupDtypes& dtypes() const { return dtypes_; }
  const GroupDevices& devices() const { return devices_; }
  void set_module_fqn(std::string fqn) { module_fqn_ = std::move(fqn); }
  void set_comm_context(CommContext* ctx) { comm_ = ctx; }

  TrainingState training_state() const { return training_state_; }
  ShardedState sharded_state() const { return sharded_state_; }
  bool has_pending_unshard() const { return pending_all_gather_.output.defined(); }

  // How post-forward reshards: null keeps the parameters unsharded until backward; the shard
  // group frees them; a smaller group (made by fully_shard for reshard_after_forward = k) keeps
  // this rank's 1/k for an all-gather among those k ranks in backward. Not collective.
  void set_post_forward_group(std::shared_ptr<ProcessGroup> group) { post_forward_group_ = std::move(group); }
  bool reshards_after_forward() const { return post_forward_group_ != nullptr; }

  // Runtime controls of FSDPModule: whether post-backward reduce-scatters (false: unsharded
  // gradients keep accumulating) and whether it frees the unsharded parameters.
  void set_reduce_grads(bool reduce) { reduce_grads_ = reduce; }
  void set_reshard_after_backward(bool reshard) { reshard_after_backward_ = reshard; }
  // HSDP: whether the reduce-scatter output is all-reduced over the replicate group (false: it is
  // summed into the partial reduce output and no sharded gradient is written). No effect on FSDP.
  void set_all_reduce_grads(bool all_reduce) { all_reduce_grads_ = all_reduce; }
  // The division of gradients (collectives.h gradient_division): a custom factor (nullopt: the
  // default mean), and SUM-only collectives with the division done separately.
  void set_gradient_divide_factor(std::optional<double> factor) { gradient_divide_factor_ = factor; }
  void set_force_sum_reduction_for_comms(bool force_sum) { force_sum_reduction_ = force_sum; }
  // Called with every reduce output once its collectives finished, before the last division and
  // before the sharded gradients are written, at the end of backward. Empty: none.
  void set_all_reduce_hook(std::function<void(at::Tensor&)> hook) { all_reduce_hook_ = std::move(hook); }
  bool has_all_reduce_hook() const { return static_cast<bool>(all_reduce_hook_); }

  // Gradient-reduction controls of FSDPModule (see fsdp_module.h for their meaning).
  // Whether trainable parameters without a gradient join the reduce-scatter with zeros.
  void set_reduce_scatter_unused_params(bool enable) { reduce_scatter_unused_params_ = enable; }
  bool reduces_unused_params() const { return reduce_scatter_unused_params_; }
  // FSDPModule::set_unshard_async_op: forward and backward all-gathers on the current stream
  // instead of the side streams (a device mesh only; the CPU has one program order).
  void set_unshard_async_op(bool async_op) { unshard_async_op_ = async_op; }
  // Whether pre-backward (and backward prefetch) all-gathers this group.
  void set_unshard_in_backward(bool unshard) { unshard_in_backward_ = unshard; }
  // The group reduce-scatters run on: null = the shard group.
  void set_separate_reduce_scatter_group(std::shared_ptr<ProcessGroup> group);
  bool has_separate_reduce_scatter_group() const { return separate_reduce_scatter_group_ != nullptr; }
  const std::shared_ptr<ProcessGroup>& reduce_scatter_group() const;
  // FullyShardOptions::quantized_weights and quantized_gradients (unset: none).
  void set_quantized_weights(std::optional<QuantizedComm> format);
  void set_quantized_gradients(std::optional<QuantizedComm> format);
  // Issues `r`'s quantized all-reduce; its reduce-scatter must have finished.
  void issue_quantized_all_reduce(PendingReduction& r);
  // At most this many reduce-scatters (>= 1) in flight when this group issues one.
  void set_max_reductions_in_flight(int64_t k);
  // FSDPModule::set_custom_all_gather / set_custom_reduce_scatter (null: FSDP's own).
  void set_custom_all_gather(std::shared_ptr<AllGather> comm) { custom_all_gather_ = std::move(comm); }
  void set_custom_reduce_scatter(std::shared_ptr<ReduceScatter> comm) { custom_reduce_scatter_ = std::move(comm); }
  bool has_custom_comm() const { return custom_all_gather_ || custom_reduce_scatter_; }

  // Issues the all-gather (no-op if unsharded or already issued). Collective. First re-lays shards
  // that module->to() or set_data() converted (see param_group.cpp: conversions), or throws
  // before issuing anything when they cannot be.
  void unshard();
  // Waits for the issued all-gather and makes the unsharded parameters usable.
  void wait_for_unshard();
  // Frees the unsharded parameters (waiting out an issued all-gather first). Not collective.
  void reshard();

  // Forward prefetch: issues the all-gather ahead of this group's pre-forward. If that
  // pre-forward does not come in this forward, drop_unused_forward_prefetch() undoes it, unless
  // the group already ran its forward (under grad mode): then it was gathered for its backward.
  void prefetch_in_forward();
  void drop_unused_forward_prefetch();

  // Hook steps, called by FSDPState.
  void pre_forward();
  void post_forward();
  void pre_backward();
  // Backward prefetch: issues the all-gather ahead of this group's pre-backward (unless the
  // group is not unsharded in backward).
  void prefetch_in_backward();
  void post_backward();
  // Post-backward ahead of this group's backward, which must then not come in this backward:
  // a rank-independent reduce-scatter order (FSDPState::reduce_groups_due_before).
  void post_backward_ahead();
  // Whether post-backward ran in the current backward (reset by end_backward).
  bool reduced_in_this_backward() const { return reduced_in_this_backward_; }
  // End of every backward: back to IDLE.
  void end_backward();
  // End of the last backward (is_last_backward): unconsumed prefetches dropped.
  void finalize_backward();
  // Index in CommContext::post_forward_order of this group's latest post-forward, or -1.
  int64_t pop_post_forward_index();

  // After `r`'s reduce-scatter finished (CommContext::complete_reduce_scatter): a
  // Next::kKeepPartial output is added to the partial reduce output.
  void after_reduce_scatter(PendingReduction& r);
  // After all of `r`'s collectives finished: the all-reduce hook, then the sharded params' grads.
  void finish_reduction(PendingReduction& r);

  // FSDPModule::reset_iter_state: waits out an issued all-gather, reshards, and drops the
  // unfinished iteration's bookkeeping, unreduced gradients, no-sync accumulators and HSDP
  // partial sums. Back to IDLE.
  void reset_iter_state();

  // Bytes of unsharded parameter storage currently allocated (0 when resharded).
  int64_t unsharded_bytes() const;

 private:
  ReducedParams params_to_reduce() const;
  bool unshards_on_side_streams() const;
  void unshard_as_prefetch();
  void wait_for_all_gather_on_device();
  void issue_reduce_scatter(const ReducedParams& reduced, const GradientDivision& division);
  void issue_all_reduce(PendingReduction& r);
  void keep_unsynced_grads();
  GradientDivision current_gradient_division() const;
  bool can_hand_over_gradients(const GradientDivision& division) const;
  PendingReduction::Next next_after_reduce_scatter() const;
  void keep_partial_reduce_output(const at::Tensor& output);
  void add_partial_reduce_output(const at::Tensor& output);
  void run_all_reduce_hook(at::Tensor& output) const;
  void drop_pending_all_gather();
  bool unsharded_can_alias_shard() const;
  // After module->to(dtype or device) or set_data() on the sharded leaves (param_group.cpp:
  // conversions): whether any leaf left the flat shard, what cannot be re-laid, and the re-lay.
  bool shards_replaced() const;
  void reset_sharded_params_if_replaced();
  void check_replaced_shards() const;
  void reset_sharded_params();
  void label_for_stream_check(const at::Tensor& t, const char* role) const;
  void free_unsharded_params();
  void reshard_post_forward();
  void reshard_to_post_forward_shard();

  FSDPParams params_;
  DeviceMesh mesh_;
  MeshInfo mesh_info_;
  std::shared_ptr<ProcessGroup> shard_group_;
  std::shared_ptr<ProcessGroup> replicate_group_;  // HSDP only
  std::string module_fqn_;
  CommContext* comm_ = nullptr;

  GroupDtypes dtypes_;
  GroupDevices devices_;
  bool offloaded_ = false;
  RankMajorLayout shard_layout_;  // of the flat shard, the all-gather and the reduce-scatter
  at::Tensor flat_shard_;         // this rank's padded shard of every param; the leaves view it
  // One rank, no cast: the unsharded tensors are the shards, never gathered or freed.
  bool unsharded_aliases_shard_ = false;

  std::shared_ptr<ProcessGroup> post_forward_group_;  // see set_post_forward_group
  MixedPrecisionPolicy mp_policy_;                    // resolved again when the parameters' dtype changes
  at::Tensor post_forward_shard_;                     // kShardedPostForward: this rank's 1/k
  // On a device: recorded on the compute stream after post_forward_shard_ was copied there; the
  // all-gather copy-in stream waits for it before the backward all-gather reads it.
  std::optional<device::Event> post_forward_shard_event_;

  bool reduce_grads_ = true;
  bool all_reduce_grads_ = true;
  std::optional<double> gradient_divide_factor_;
  bool force_sum_reduction_ = false;
  std::function<void(at::Tensor&)> all_reduce_hook_;
  // HSDP without all-reduce: the sum of the reduce-scatter outputs not all-reduced yet (reduce
  // dtype, the flat shard's layout); added before the next all-reduce. Undefined when none.
  at::Tensor partial_reduce_output_;
  bool reshard_after_backward_ = true;
  bool prefetched_in_forward_ = false;  // issued by a forward prefetch, not yet consumed
  bool prefetching_ = false;            // inside prefetch_in_forward/backward: FSDP2 uses the side streams
  bool unshard_async_op_ = false;       // set_unshard_async_op
  bool reduce_scatter_unused_params_ = false;
  bool unshard_in_backward_ = true;
  std::shared_ptr<ProcessGroup> separate_reduce_scatter_group_;  // null: the shard group
  int64_t max_reductions_in_flight_ = 1;  // PyTorch FSDP's default: one reduce-scatter input alive
  std::shared_ptr<AllGather> custom_all_gather_;
  std::shared_ptr<ReduceScatter> custom_reduce_scatter_;
  std::optional<QuantizedComm> quantized_weights_;
  std::optional<QuantizedComm> quantized_gradients_;
  // Error feedback of quantized_gradients: this rank's residual, fp32, in the shard layout.
  at::Tensor replicate_residual_;
  // skip_zero_blocks of quantized_gradients: whether the next all-reduce sends nonzero blocks only.
  detail::ZeroBlockSkip zero_block_skip_;
  bool reduced_in_this_backward_ = false;
  bool reduced_ahead_ = false;  // by post_backward_ahead, in this backward

  TrainingState training_state_ = TrainingState::kIdle;
  ShardedState sharded_state_ = ShardedState::kSharded;
  std::vector<int64_t> post_forward_indices_;
  AllGatherResult pending_all_gather_;  // work is null when none is in flight
};

}  // namespace detail
}  // namespace fsdp
