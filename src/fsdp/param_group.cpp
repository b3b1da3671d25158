#include "fsdp/param_group.h"

#include <fsdp/distributed.h>
#include <fsdp/trace.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cstring>

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

char* bytes_of(const at::Tensor& t) { return static_cast<char*>(t.data_ptr()); }

std::vector<int64_t> shard_shape(const FSDPParam& p) {
  std::vector<int64_t> shape = p.global_shape();
  shape[0] = p.shard_rows();
  return shape;
}

}  // namespace

void CommContext::finish_reductions(bool wait_all) {
  while (!reductions.empty()) {
    PendingReduction& r = reductions.front();
    if (!wait_all && !r.work->is_completed()) break;
    wait_traced(r.work, "reduce_scatter", r.group->module_fqn());
    r.group->finish_reduction(r.output);
    reductions.pop_front();
  }
}

FSDPParamGroup::FSDPParamGroup(std::vector<std::unique_ptr<FSDPParam>> params, DeviceMesh mesh,
                               std::string module_fqn)
    : params_(std::move(params)), mesh_(std::move(mesh)), module_fqn_(std::move(module_fqn)) {
  TORCH_CHECK(!params_.empty(), "FSDPParamGroup needs at least one parameter");
  TORCH_CHECK(mesh_.ndim() == 1, "fully_shard: a ", mesh_.ndim(), "-D mesh (HSDP) is not supported yet by "
              "fsdp-cpp; pass a 1-D mesh");
  shard_group_ = mesh_.get_group(0);
  dtype_ = params_.front()->dtype();
  for (const auto& p : params_) {
    TORCH_CHECK(p->dtype() == dtype_, "fully_shard: parameters of one group must share a dtype, but '",
                params_.front()->fqn(), "' is ", dtype_, " and '", p->fqn(), "' is ", p->dtype(),
                "; convert the module (module->to(dtype)) before fully_shard, or shard them in separate calls");
    offsets_.push_back(flat_numel_);
    flat_numel_ += p->padded_shard_numel();
  }
  // Each rank keeps only its padded chunk of every parameter, in one flat buffer; the sharded
  // leaves are views into it, so the all-gather sends it as it is (no copy-in).
  flat_shard_ = at::empty({flat_numel_}, at::TensorOptions().dtype(dtype_));
  const size_t es = flat_shard_.element_size();
  for (size_t i = 0; i < params_.size(); ++i) {
    FSDPParam& p = *params_[i];
    p.copy_shard_to(bytes_of(flat_shard_) + offsets_[i] * es);
    p.init_sharded(flat_shard_, offsets_[i]);
    if (shard_group_->size() == 1) {
      p.alias_shard(flat_shard_, offsets_[i]);  // nothing to gather, ever
    } else {
      p.free_unsharded();
    }
  }
}

void FSDPParamGroup::set_reshard_policy(ReshardPolicy p) {
  const int64_t world = shard_group_->size();
  if (p.kind == ReshardPolicy::kPartial) {
    TORCH_CHECK(p.partial_size >= 1 && p.partial_size <= world && world % p.partial_size == 0,
                "reshard_after_forward=", p.partial_size, " must divide the shard group size ", world,
                " (module '", module_fqn_, "')");
    if (p.partial_size == world) p = ReshardPolicy{ReshardPolicy::kFull, 0};
    if (p.partial_size == 1) p = ReshardPolicy{ReshardPolicy::kKeep, 0};
  }
  reshard_policy_ = p;
  if (reshard_policy_.kind == ReshardPolicy::kPartial && !post_forward_group_) {
    // Consecutive blocks of partial_size shard ranks (e.g. the ranks of one node).
    const auto& members = shard_group_->global_ranks();
    const int64_t k = reshard_policy_.partial_size;
    const int64_t block = shard_group_->rank() / k;
    std::vector<int> ranks(members.begin() + block * k, members.begin() + (block + 1) * k);
    post_forward_group_ = new_group(ranks);
  }
}

// ------------------------------------------------------------------------------ all-gather

void FSDPParamGroup::unshard() {
  if (sharded_state_ == ShardedState::kUnsharded || pending_.work) return;
  if (shard_group_->size() == 1) {
    sharded_state_ = ShardedState::kUnsharded;  // the unsharded params alias the shards
    return;
  }
  if (sharded_state_ == ShardedState::kShardedPostForward) {
    at::Tensor out = at::empty({post_forward_group_->size() * post_forward_shard_.numel()}, flat_shard_.options());
    pending_ = {post_forward_group_->all_gather_into(out, post_forward_shard_), out, true};
  } else {
    at::Tensor out = at::empty({shard_group_->size() * flat_numel_}, flat_shard_.options());
    pending_ = {shard_group_->all_gather_into(out, flat_shard_), out, false};
  }
}

void FSDPParamGroup::wait_for_unshard() {
  if (!pending_.work) return;
  wait_traced(pending_.work, "all_gather", module_fqn_);
  for (auto& p : params_) p->alloc_unsharded();
  std::vector<int64_t> pieces;
  if (pending_.from_post_forward_shard) {
    const int64_t k = post_forward_group_->size();
    for (auto& p : params_) pieces.push_back(p->padded_full_numel() / k);
    copy_out(pending_.output, k, pieces);
    post_forward_shard_ = at::Tensor();
  } else {
    for (auto& p : params_) pieces.push_back(p->padded_shard_numel());
    copy_out(pending_.output, shard_group_->size(), pieces);
  }
  pending_ = PendingAllGather{};
  sharded_state_ = ShardedState::kUnsharded;
}

// The gathered buffer is rank-major: row q holds, param after param, rank q's piece of each.
// Each unsharded param's storage is its pieces in rank order, so its real data is the prefix.
void FSDPParamGroup::copy_out(const at::Tensor& gathered, int64_t parts, const std::vector<int64_t>& piece_numel) {
  const size_t es = gathered.element_size();
  int64_t row = 0;
  std::vector<int64_t> offset;
  for (int64_t n : piece_numel) {
    offset.push_back(row);
    row += n;
  }
  const char* src = bytes_of(gathered);
  for (size_t i = 0; i < params_.size(); ++i) {
    char* dst = params_[i]->unsharded_bytes();
    const size_t piece = static_cast<size_t>(piece_numel[i]) * es;
    for (int64_t q = 0; q < parts; ++q) std::memcpy(dst + q * piece, src + (q * row + offset[i]) * es, piece);
  }
}

void FSDPParamGroup::reshard() {
  if (pending_.work) {  // an all-gather nobody will use: let it land, then drop it
    pending_.work->wait();
    pending_ = PendingAllGather{};
  }
  if (sharded_state_ == ShardedState::kUnsharded && shard_group_->size() > 1) {
    for (auto& p : params_) p->free_unsharded();
  }
  post_forward_shard_ = at::Tensor();
  sharded_state_ = ShardedState::kSharded;
}

// Keeps only this rank's 1/k of every unsharded param, for a backward all-gather among k ranks.
void FSDPParamGroup::reshard_partially() {
  if (sharded_state_ != ShardedState::kUnsharded || shard_group_->size() == 1) return;
  const int64_t k = post_forward_group_->size();
  const int64_t j = post_forward_group_->rank();
  const size_t es = flat_shard_.element_size();
  int64_t total = 0;
  post_forward_offsets_.clear();
  for (auto& p : params_) {
    post_forward_offsets_.push_back(total);
    total += p->padded_full_numel() / k;
  }
  post_forward_shard_ = at::empty({total}, flat_shard_.options());
  for (size_t i = 0; i < params_.size(); ++i) {
    const size_t piece = static_cast<size_t>(params_[i]->padded_full_numel() / k) * es;
    std::memcpy(bytes_of(post_forward_shard_) + post_forward_offsets_[i] * es,
                params_[i]->unsharded_bytes() + j * piece, piece);
    params_[i]->free_unsharded();
  }
  sharded_state_ = ShardedState::kShardedPostForward;
}

void FSDPParamGroup::reshard_post_forward() {
  switch (reshard_policy_.kind) {
    case ReshardPolicy::kKeep: return;
    case ReshardPolicy::kFull: reshard(); return;
    case ReshardPolicy::kPartial: reshard_partially(); return;
  }
}

// ------------------------------------------------------------------------------ hook steps

void FSDPParamGroup::pre_forward() {
  training_state_ = TrainingState::kForward;
  unshard();
  wait_for_unshard();
  prefetched_in_forward = false;
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

void FSDPParamGroup::post_backward() {
  training_state_ = TrainingState::kPostBackward;
  bool any_grad = false;
  for (auto& p : params_) any_grad = any_grad || (p->requires_grad() && p->unsharded_grad().defined());
  if (!reduce_grads || !any_grad) {  // no sync: the unsharded grads keep accumulating
    if (reshard_after_backward) reshard();
    return;
  }
  const int64_t world = shard_group_->size();
  if (world == 1) {  // the shard is the whole param: hand the grad over, no copy
    for (auto& p : params_) {
      at::Tensor g = p->unsharded_grad();
      if (p->requires_grad() && g.defined()) p->accumulate_sharded_grad(g);  // same shape at world size 1
      p->clear_unsharded_grad();
    }
    if (reshard_after_backward) reshard();
    return;
  }
  // Copy-in: the all-gather layout in reverse. Row q = rank q's padded chunk of every grad.
  at::Tensor input = at::empty({world * flat_numel_}, flat_shard_.options());
  const size_t es = input.element_size();
  char* in = bytes_of(input);
  for (size_t i = 0; i < params_.size(); ++i) {
    FSDPParam& p = *params_[i];
    at::Tensor g = p.requires_grad() ? p.unsharded_grad() : at::Tensor();
    TORCH_CHECK(!g.defined() || g.scalar_type() == dtype_, "FSDP reduce-scatter expects gradients of dtype ", dtype_,
                " but '", p.fqn(), "' has ", g.scalar_type());
    // A param that got no grad on this rank contributes zeros, so every rank sends the same layout.
    if (g.defined()) g = g.contiguous();
    const char* src = g.defined() ? static_cast<const char*>(g.data_ptr()) : nullptr;
    const int64_t chunk = p.padded_shard_numel();
    for (int64_t q = 0; q < world; ++q) {
      char* dst = in + (q * flat_numel_ + offsets_[i]) * es;
      const int64_t begin = std::min(q * chunk, p.unsharded_numel());
      const int64_t real = src ? std::min(chunk, p.unsharded_numel() - begin) : 0;
      if (real > 0) std::memcpy(dst, src + begin * es, real * es);
      std::memset(dst + real * es, 0, (chunk - real) * es);
    }
    p.clear_unsharded_grad();
  }
  if (reshard_after_backward) reshard();
  at::Tensor output = at::empty({flat_numel_}, flat_shard_.options());
  // Averaged over the data-parallel ranks, like PyTorch's FSDP.
  WorkHandle work = shard_group_->reduce_scatter_into(output, input, ReduceOp::kAvg);
  TORCH_CHECK(comm_ != nullptr, "internal: post_backward of '", module_fqn_, "' before lazy initialisation");
  comm_->reductions.push_back({std::move(work), output, this});
}

void FSDPParamGroup::finish_reduction(const at::Tensor& reduced) {
  for (size_t i = 0; i < params_.size(); ++i) {
    FSDPParam& p = *params_[i];
    if (!p.requires_grad()) continue;
    // Shares the reduce-scatter output's storage, padding left out. Not an autograd view:
    // LibTorch's Optimizer::zero_grad() detaches grads in place, which views refuse.
    const std::vector<int64_t> shape = shard_shape(p);
    at::Tensor grad = at::empty({0}, reduced.options());
    grad.set_(reduced.storage(), reduced.storage_offset() + offsets_[i], shape, c10::contiguous_strides(shape));
    p.accumulate_sharded_grad(grad);
  }
}

void FSDPParamGroup::finalize_backward() {
  if (pending_.work) {  // a prefetch for a module that did not run backward
    pending_.work->wait();
    pending_ = PendingAllGather{};
  }
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
