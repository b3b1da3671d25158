// param_group.cpp — the group's state machine: which transition each hook step makes, and
// when it issues or waits for a collective (the collectives themselves: collectives.cpp).
#include "src/fsdp/param_group.h"

#include "src/fsdp/policies.h"

#include <fsdp/trace.h>

#include <c10/util/Exception.h>

namespace fsdp {
namespace detail {
namespace {

// Waits for `work`, as a "wait <kind> <module>" span in the trace when one is recorded: the
// part of a collective that was not hidden behind compute.
void wait_traced(const WorkHandle& work, const char* kind, const std::string& module_fqn) {
  if (!trace::enabled() || work->is_completed()) {
    work->wait();
    return;
  }
  const auto begin = trace::Clock::now();
  work->wait();
  trace::record("wait", std::string("wait ") + kind + " " + (module_fqn.empty() ? "(root)" : module_fqn), begin,
                trace::Clock::now());
}

}  // namespace

void CommContext::finish_reductions(bool wait_all) {
  while (!reductions.empty()) {
    PendingReduction& r = reductions.front();
    if (!wait_all && !r.result.work->is_completed()) break;
    wait_traced(r.result.work, "reduce_scatter", r.group->module_fqn());
    r.group->finish_reduction(r.result);
    reductions.pop_front();
  }
}

FSDPParamGroup::FSDPParamGroup(FSDPParams params, DeviceMesh mesh, std::string module_fqn,
                               std::shared_ptr<ProcessGroup> post_forward_group, const MixedPrecisionPolicy& mp_policy,
                               const std::optional<CPUOffloadPolicy>& offload_policy)
    : params_(std::move(params)),
      mesh_(std::move(mesh)),
      shard_group_(mesh_.get_group(0)),
      module_fqn_(std::move(module_fqn)),
      devices_(resolve_group_devices(mesh_, offload_policy)),
      offloaded_(offload_policy.has_value()),
      post_forward_group_(std::move(post_forward_group)) {
  TORCH_CHECK(!params_.empty(), "FSDPParamGroup needs at least one parameter");
  const at::ScalarType dtype = params_.front()->orig_dtype();
  for (const auto& p : params_) {
    TORCH_CHECK(p->orig_dtype() == dtype, "fully_shard: parameters of one group must share a dtype, but '",
                params_.front()->fqn(), "' is ", dtype, " and '", p->fqn(), "' is ", p->orig_dtype(),
                "; convert the module (module->to(dtype)) before fully_shard, or shard them in separate calls");
  }
  dtypes_ = resolve_group_dtypes(mp_policy, dtype);
  shard_layout_ = shard_layout(params_, shard_group_->size());
  flat_shard_ = init_flat_shard(params_, shard_layout_);
  if (dtypes_.unsharded != dtypes_.orig) {
    // The unsharded faces compute in the policy's dtype; each unshard casts into the all-gather.
    for (auto& p : params_) p->set_unsharded_dtype(dtypes_.unsharded);
  } else if (shard_group_->size() == 1) {
    // Nothing to gather, ever: the unsharded tensors alias the shards and stay unsharded.
    for (size_t i = 0; i < params_.size(); ++i) params_[i]->alias_shard(flat_shard_, shard_layout_.offset[i]);
    unsharded_aliases_shard_ = true;
    sharded_state_ = ShardedState::kUnsharded;
  } else {
    free_unsharded_params();
  }
}

// ------------------------------------------------------------------------------ all-gather

// The sharded leaves must still be views of the flat shard, on the shards' device: set_data()
// (e.g. by module->to(dtype or device)) gives a leaf new storage, after which the optimizer
// would update a tensor no collective reads. Refused before anything is issued, naming them.
void FSDPParamGroup::check_shards_intact() const {
  std::string moved, replaced;
  for (const auto& p : params_) {
    const at::Tensor& shard = p->sharded();
    const std::string name = "'" + p->fqn() + "'";
    if (shard.device() != devices_.shard) {
      moved += (moved.empty() ? "" : ", ") + name + " on " + shard.device().str();
    } else if (shard.scalar_type() != dtypes_.orig || !shard.storage().is_alias_of(flat_shard_.storage())) {
      replaced += (replaced.empty() ? "" : ", ") + name + " (" + c10::toString(shard.scalar_type()) + ")";
    }
  }
  const char* load_in_place = ". Load state dicts into the sharded parameters in place (fsdp::load_sharded_state_dict) "
                              "instead of moving them.";
  TORCH_CHECK(moved.empty() || !offloaded_, "fsdp: FSDP parameters should be materialized on CPU when enabling CPU "
              "offloading (CPUOffloadPolicy), but these of '", module_fqn_, "' are not: ", moved, load_in_place);
  TORCH_CHECK(moved.empty(), "fsdp: the sharded parameters of '", module_fqn_, "' must stay on ", devices_.shard.str(),
              ", but these moved: ", moved, load_in_place);
  TORCH_CHECK(replaced.empty(), "fsdp: the sharded parameters of '", module_fqn_, "' were replaced after fully_shard "
              "(e.g. by module->to(dtype) or set_data()), so FSDP can no longer gather them: ", replaced, ". Change "
              "dtypes before fully_shard (or compute in another dtype with a MixedPrecisionPolicy), and load values "
              "with fsdp::load_sharded_state_dict.");
}

void FSDPParamGroup::unshard() {
  if (sharded_state_ == ShardedState::kUnsharded || has_pending_unshard()) return;
  check_shards_intact();
  if (sharded_state_ == ShardedState::kShardedPostForward) {
    pending_all_gather_ = foreach_all_gather(post_forward_shard_, post_forward_layout(params_, post_forward_group_->size()),
                                             *post_forward_group_);
  } else {
    pending_all_gather_ =
        foreach_all_gather(all_gather_input(flat_shard_, dtypes_.unsharded, devices_), shard_layout_, *shard_group_);
  }
}

void FSDPParamGroup::wait_for_unshard() {
  if (!has_pending_unshard()) return;
  if (pending_all_gather_.work) wait_traced(pending_all_gather_.work, "all_gather", module_fqn_);
  for (auto& p : params_) p->alloc_unsharded();
  foreach_all_gather_copy_out(pending_all_gather_, params_);
  pending_all_gather_ = AllGatherResult{};
  post_forward_shard_ = at::Tensor();
  sharded_state_ = ShardedState::kUnsharded;
}

// An all-gather nobody will use: let it land, then drop it.
void FSDPParamGroup::drop_pending_all_gather() {
  if (pending_all_gather_.work) pending_all_gather_.work->wait();
  pending_all_gather_ = AllGatherResult{};
}

void FSDPParamGroup::reshard() {
  drop_pending_all_gather();
  if (unsharded_aliases_shard_) return;  // the unsharded tensors are the shards
  if (sharded_state_ == ShardedState::kUnsharded) free_unsharded_params();
  post_forward_shard_ = at::Tensor();
  sharded_state_ = ShardedState::kSharded;
}

void FSDPParamGroup::free_unsharded_params() {
  for (auto& p : params_) p->free_unsharded();
}

// Keeps only this rank's 1/k of every unsharded param, for a backward all-gather among k ranks.
void FSDPParamGroup::reshard_to_post_forward_shard() {
  if (sharded_state_ != ShardedState::kUnsharded || unsharded_aliases_shard_) return;
  post_forward_shard_ = copy_post_forward_shard(params_, post_forward_layout(params_, post_forward_group_->size()),
                                                post_forward_group_->rank());
  free_unsharded_params();
  sharded_state_ = ShardedState::kShardedPostForward;
}

void FSDPParamGroup::reshard_post_forward() {
  if (!post_forward_group_) return;  // kept unsharded until backward
  if (post_forward_group_ == shard_group_) {
    reshard();
  } else {
    reshard_to_post_forward_shard();
  }
}

void FSDPParamGroup::prefetch_in_forward() {
  if (sharded_state_ == ShardedState::kUnsharded || has_pending_unshard()) return;
  unshard();
  prefetched_in_forward_ = true;
}

void FSDPParamGroup::drop_unused_forward_prefetch() {
  if (!prefetched_in_forward_) return;
  prefetched_in_forward_ = false;
  if (reshards_after_forward()) reshard();
}

// ------------------------------------------------------------------------------ hook steps

void FSDPParamGroup::pre_forward() {
  check_shards_intact();  // also where nothing is gathered (one rank)
  training_state_ = TrainingState::kForward;
  unshard();
  wait_for_unshard();
  prefetched_in_forward_ = false;
}

void FSDPParamGroup::post_forward() {
  reshard_post_forward();
  if (comm_) {
    post_forward_indices_.push_back(static_cast<int64_t>(comm_->post_forward_order.size()));
    comm_->post_forward_order.push_back(this);
  }
  training_state_ = TrainingState::kIdle;
}

void FSDPParamGroup::pre_backward() {
  if (training_state_ == TrainingState::kPreBackward) return;  // another output's hook got here first
  training_state_ = TrainingState::kPreBackward;
  unshard();
  wait_for_unshard();
}

int64_t FSDPParamGroup::pop_post_forward_index() {
  if (post_forward_indices_.empty()) return -1;
  const int64_t i = post_forward_indices_.back();
  post_forward_indices_.pop_back();
  return i;
}

// ------------------------------------------------------------------------------ reduce-scatter

bool FSDPParamGroup::has_unsharded_grads() const {
  for (const auto& p : params_) {
    if (p->requires_grad() && p->has_unsharded_grad()) return true;
  }
  return false;
}

// No sync: the unsharded grads keep accumulating until a backward that reduces, in the reduce
// dtype when it is wider than the compute dtype (bf16 micro-batch grads summed in fp32).
void FSDPParamGroup::keep_unsynced_grads() {
  if (dtypes_.reduce == dtypes_.unsharded) return;  // autograd accumulates them in place
  for (auto& p : params_) {
    if (p->requires_grad()) p->accumulate_unsharded_grad(dtypes_.reduce);
  }
}

void FSDPParamGroup::post_backward() {
  training_state_ = TrainingState::kPostBackward;
  if (!reduce_grads_ || !has_unsharded_grads()) {
    if (!reduce_grads_) keep_unsynced_grads();
    if (reshard_after_backward_) reshard();
    return;
  }
  // Checked before anything is issued: a reduce-scatter nobody would wait for must not start.
  TORCH_CHECK(comm_ != nullptr || shard_group_->size() == 1, "internal: post_backward of '", module_fqn_,
              "' before lazy initialisation");
  // The gradients are tensors of their own: the parameters can be freed before the copy-in.
  if (reshard_after_backward_) reshard();
  ReduceScatterResult result = foreach_reduce(params_, shard_layout_, *shard_group_, dtypes_, devices_);
  if (!result.work) return;  // one rank: the grads were handed over, nothing in flight
  comm_->reductions.push_back({std::move(result), this});
}

void FSDPParamGroup::finish_reduction(const ReduceScatterResult& reduced) {
  foreach_reduce_copy_out(reduced, params_, shard_layout_, dtypes_.orig, devices_);
}

void FSDPParamGroup::finalize_backward() {
  drop_pending_all_gather();  // a prefetch for a module that did not run backward
  post_forward_indices_.clear();
  training_state_ = TrainingState::kIdle;
}

int64_t FSDPParamGroup::unsharded_bytes() const {
  int64_t n = 0;
  for (const auto& p : params_) {
    if (!p->aliases_shard()) n += static_cast<int64_t>(p->unsharded().storage().nbytes());
  }
  return n;
}

}  // namespace detail
}  // namespace fsdp
