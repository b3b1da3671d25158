// param_group.h — FSDP's communication group: the parameters of one fully_shard call,
// all-gathered in ONE collective and reduce-scattered in ONE collective.
//
// Where collectives are issued and who waits for them, all in param_group.cpp:
//   all-gather:      unshard() issues it (from pre-forward, pre-backward, a prefetch, or the
//                    user's FSDPModule::unshard); wait_for_unshard() waits and copies out.
//   reduce-scatter:  post_backward() issues it; CommContext::finish_reductions() waits (the next
//                    post-backward, for those already done, and the end of backward, for all).
#pragma once

#include "fsdp/fsdp_param.h"

#include <fsdp/device_mesh.h>
#include <fsdp/process_group.h>

#include <ATen/core/Tensor.h>

#include <deque>
#include <memory>
#include <string>
#include <vector>

namespace fsdp {
namespace detail {

enum class TrainingState { kIdle, kForward, kPreBackward, kPostBackward };
enum class ShardedState { kSharded, kShardedPostForward, kUnsharded };

class FSDPParamGroup;

// Shared by every group under one root (created by the root's lazy init).
struct CommContext {
  // Groups in the order their post-forward ran this iteration (with repeats): backward prefetch
  // walks it in reverse.
  std::vector<FSDPParamGroup*> post_forward_order;
  // Groups in the order their pre-forward ran, this iteration and the previous one: forward
  // prefetch follows the previous one (on CPU nothing runs ahead by itself).
  std::vector<FSDPParamGroup*> forward_order;
  std::vector<FSDPParamGroup*> last_forward_order;

  struct PendingReduction {
    WorkHandle work;
    at::Tensor output;  // this rank's reduced, padded shards of the group's gradients
    FSDPParamGroup* group;
  };
  std::deque<PendingReduction> reductions;  // in issue order

  // Writes the gradients of finished reduce-scatters into the sharded params, in issue order.
  // With wait_all, waits for every pending one; otherwise stops at the first still running.
  void finish_reductions(bool wait_all);
};

// How a group reshards after forward.
struct ReshardPolicy {
  enum Kind { kKeep, kFull, kPartial } kind = kFull;
  int64_t partial_size = 0;  // kPartial: ranks in the post-forward sub-group
};

class FSDPParamGroup {
 public:
  FSDPParamGroup(std::vector<std::unique_ptr<FSDPParam>> params, DeviceMesh mesh, std::string module_fqn);
  FSDPParamGroup(const FSDPParamGroup&) = delete;
  FSDPParamGroup& operator=(const FSDPParamGroup&) = delete;

  const std::vector<std::unique_ptr<FSDPParam>>& params() const { return params_; }
  const DeviceMesh& mesh() const { return mesh_; }
  const std::shared_ptr<ProcessGroup>& shard_group() const { return shard_group_; }
  const std::string& module_fqn() const { return module_fqn_; }
  void set_module_fqn(std::string fqn) { module_fqn_ = std::move(fqn); }
  void set_comm_context(CommContext* ctx) { comm_ = ctx; }

  TrainingState training_state() const { return training_state_; }
  void set_training_state(TrainingState s) { training_state_ = s; }
  ShardedState sharded_state() const { return sharded_state_; }
  bool has_pending_unshard() const { return pending_.work != nullptr; }

  // Runtime flags (FSDPModule setters).
  void set_reshard_policy(ReshardPolicy p);
  const ReshardPolicy& reshard_policy() const { return reshard_policy_; }
  bool reshard_after_backward = true;
  bool reduce_grads = true;
  // Set when a prefetch issued this group's all-gather and no pre-forward consumed it yet.
  bool prefetched_in_forward = false;

  // Issues the all-gather (no-op if unsharded or already issued). Collective.
  void unshard();
  // Waits for the issued all-gather and makes the unsharded parameters usable.
  void wait_for_unshard();
  // Frees the unsharded parameters (waiting out an issued all-gather first). Not collective.
  void reshard();

  // Hook steps, called by FSDPState.
  void pre_forward();
  void post_forward();
  void pre_backward();
  void post_backward();
  // End of backward: back to IDLE, unconsumed prefetches dropped.
  void finalize_backward();
  // Index in CommContext::post_forward_order of this group's latest post-forward, or -1.
  int64_t pop_post_forward_index();

  // Gradients of a finished reduce-scatter -> the sharded params' grads.
  void finish_reduction(const at::Tensor& reduced);

  // Bytes of unsharded parameter storage currently allocated (0 when resharded).
  int64_t unsharded_bytes() const;

 private:
  void copy_out(const at::Tensor& gathered, int64_t parts, const std::vector<int64_t>& piece_numel);
  void reshard_post_forward();
  void reshard_partially();
  std::shared_ptr<ProcessGroup> post_forward_group();

  std::vector<std::unique_ptr<FSDPParam>> params_;
  DeviceMesh mesh_;
  std::shared_ptr<ProcessGroup> shard_group_;
  std::string module_fqn_;
  CommContext* comm_ = nullptr;
  at::ScalarType dtype_;

  at::Tensor flat_shard_;             // every param's padded shard, concatenated (this rank's)
  std::vector<int64_t> offsets_;      // each param's offset in flat_shard_
  int64_t flat_numel_ = 0;

  ReshardPolicy reshard_policy_;
  std::shared_ptr<ProcessGroup> post_forward_group_;  // kPartial; created on first use
  at::Tensor post_forward_shard_;     // kPartial: this rank's piece of every unsharded param
  std::vector<int64_t> post_forward_offsets_;

  TrainingState training_state_ = TrainingState::kIdle;
  ShardedState sharded_state_ = ShardedState::kSharded;
  std::vector<int64_t> post_forward_indices_;

  struct PendingAllGather {
    WorkHandle work;
    at::Tensor output;
    bool from_post_forward_shard = false;
  } pending_;
};

}  // namespace detail
}  // namespace fsdp
