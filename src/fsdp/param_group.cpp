// param_group.cpp — the group's state machine: which transition each hook step makes, and
// when it issues or waits for a collective (the collectives themselves: collectives.cpp).
#include "src/fsdp/param_group.h"

#include "src/device/stream_check.h"
#include "src/fsdp/policies.h"

#include <fsdp/trace.h>

#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <exception>

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
  trace::record("wait", std::string("wait ") + kind + " " + module_label(module_fqn), begin, trace::Clock::now());
}

// The process group's error names the op, its sequence number, the group and the missing
// ranks; this adds which FSDP module's collective it was, and for a reduce-scatter among live
// ranks the usual cause: ranks whose backward reached different modules.
[[noreturn]] void rethrow_naming_module(const CollectiveError& e, const char* kind, const std::string& module_fqn) {
  std::string msg = std::string(e.what()) + " [the " + kind + " of FSDP module '" + module_label(module_fqn) + "']";
  // Only when every rank is alive: a rank that stopped or ended explains the timeout instead.
  const bool all_alive = msg.find("stopped making progress") == std::string::npos &&
                         msg.find("whose process has ended") == std::string::npos;
  if (std::string(kind) == "reduce_scatter" && all_alive) {
    msg +=
        ". If the ranks' backward passes do not all reach the same FSDP modules (rank-dependent control "
        "flow, unused parameters), call set_reduce_scatter_unused_params(true) on the root FSDPModule on "
        "every rank, so that every rank issues the same reduce-scatters";
  }
  throw CollectiveError(msg);
}

void wait_for(const WorkHandle& work, const char* kind, const std::string& module_fqn) {
  try {
    wait_traced(work, kind, module_fqn);
  } catch (const CollectiveError& e) {
    rethrow_naming_module(e, kind, module_fqn);
  }
}

}  // namespace

void CommContext::init_streams(c10::Device device) {
  if (streams) return;
  device::DeviceOps& ops = device::ops_for(device);
  if (!ops.has_streams()) return;
  streams = CommStreams{ops.side_stream(device, true), ops.side_stream(device, true), ops.side_stream(device, true),
                        ops.side_stream(device, false)};
  device::stream_check::label_stream(streams->all_gather_copy_in, "the all-gather copy-in stream");
  device::stream_check::label_stream(streams->all_gather, "the all-gather stream");
  device::stream_check::label_stream(streams->reduce_scatter, "the reduce-scatter stream");
  device::stream_check::label_stream(streams->all_reduce, "the all-reduce stream");
}

// FSDP2 waits here, once, rather than before each unshard: within the iteration nothing but the
// optimizer step and the user's own code between iterations writes the shards on the compute
// stream (a post-forward shard is waited for by an event of its own), so the all-gathers of
// forward, of backward and their prefetches may run ahead of the compute stream.
void CommContext::begin_forward() {
  if (!streams) return;
  const c10::Device device = streams->all_gather.device();
  device::DeviceOps& ops = device::ops_for(device);
  const device::Event now = ops.record(ops.current_stream(device));
  ops.wait(streams->all_gather_copy_in, now);
  ops.wait(streams->all_gather, now);
}

void CommContext::wait_for_gradients() {
  if (!streams) return;
  const c10::Device device = streams->reduce_scatter.device();
  device::DeviceOps& ops = device::ops_for(device);
  const c10::Stream current = ops.current_stream(device);
  for (const device::Event& e : reduction_events) ops.wait(current, e);
  for (const device::Event& e : host_copy_events) ops.synchronize(e);
  reduction_events.clear();
  host_copy_events.clear();
  reduce_outputs_in_use.clear();  // the compute stream waited for every stream that used them
}

namespace {

bool collectives_finished(const PendingReduction& r) {
  const WorkHandle& rs = r.reduce_scatter.work;
  return !r.all_reduce_deferred && (r.reduce_scattered || !rs || rs->is_completed()) &&
         (!r.all_reduce || r.all_reduce->is_completed());
}

}  // namespace

// Gradients are written in issue order, each once every collective of its reduction finished.
// A group with an all-reduce hook waits for the end of backward: each rank polls and reaches a
// finished collective at its own moment, and a hook that runs a blocking collective there could
// wait for a rank that waits for this one; at the end of backward every rank is at the same point.
void CommContext::finish_reductions(bool wait_all) {
  if (wait_all) issue_deferred_all_reduces();
  while (!reductions.empty()) {
    PendingReduction& r = reductions.front();
    if (!wait_all && (r.group->has_all_reduce_hook() || !collectives_finished(r))) return;
    if (!r.reduce_scattered) complete_reduce_scatter(r);
    wait_for_all_reduce(r);
    PendingReduction done = std::move(r);
    reductions.pop_front();
    write_gradients_of(done);
  }
}

void CommContext::issue_deferred_all_reduces() {
  for (PendingReduction& r : reductions) {
    if (!r.all_reduce_deferred) continue;
    complete_reduce_scatter(r);
    r.all_reduce_deferred = false;
    r.group->issue_quantized_all_reduce(r);
  }
}

// A failed collective leaves the process group unusable: every pending reduction is dropped, so
// none is waited for again. On a device the wait and what follows (an HSDP partial sum) run on
// the reduce-scatter stream, beside the compute stream.
void CommContext::complete_reduce_scatter(PendingReduction& r) {
  if (r.reduce_scattered) return;
  std::optional<device::StreamScope> scope;
  if (streams) scope.emplace(streams->reduce_scatter);
  try {
    if (r.reduce_scatter.work) wait_for(r.reduce_scatter.work, "reduce_scatter", r.group->module_fqn());
  } catch (...) {
    reductions.clear();
    throw;
  }
  if (streams) {
    device::DeviceOps& ops = device::ops_for(streams->reduce_scatter.device_type());
    r.reduce_scattered_event = ops.record(streams->reduce_scatter);
  }
  r.reduce_scattered = true;
  r.group->after_reduce_scatter(r);
}

void CommContext::complete_reduce_scatters_of(const FSDPParamGroup* group) {
  for (PendingReduction& r : reductions) {
    if (r.group == group) complete_reduce_scatter(r);
  }
}

void CommContext::wait_for_all_reduce(PendingReduction& r) {
  if (!r.all_reduce) return;
  std::optional<device::StreamScope> scope;
  if (streams) scope.emplace(streams->all_reduce);
  try {
    wait_for(r.all_reduce, "all_reduce", r.group->module_fqn());
  } catch (...) {
    reductions.clear();
    throw;
  }
}

// The input was made on the compute stream and read by the reduce-scatter stream: on a device,
// the compute stream waits for the collective (FSDP2's reduce-scatter event), not for what follows
// it, before the input is dropped and its memory can be taken by the next allocation there.
void CommContext::release_reduce_scatter_input(PendingReduction& r) {
  if (!r.reduce_scatter.input.defined()) return;
  complete_reduce_scatter(r);
  if (streams && r.reduce_scattered_event) {
    device::DeviceOps& ops = device::ops_for(streams->reduce_scatter.device_type());
    ops.wait(ops.current_stream(streams->reduce_scatter.device()), *r.reduce_scattered_event);
  }
  r.reduce_scatter.input = at::Tensor();
}

// The output is made on the reduce-scatter stream, or, on a shard group of one rank, it is the
// input, made on the compute stream. Used only by its maker, it may go now; an HSDP all-reduce's
// buffer, used on the all-reduce stream, and the one-rank output stay referenced until the end of
// backward, when the compute stream waited for every reduction (FSDP2 keeps its all-reduce state
// as long).
void CommContext::keep_reduce_output_in_use(const PendingReduction& r) {
  const bool made_and_used_on_one_stream = r.reduce_scatter.work && !r.all_reduce;
  if (!made_and_used_on_one_stream) reduce_outputs_in_use.push_back(r.reduce_scatter.output);
}

// On a device: the copy-out runs on the stream of the reduction's last collective; the compute
// stream waits for it only at the end of backward (wait_for_gradients), and the host then for a
// copy to pinned host memory, so that neither the copy-out nor an offload copy holds up backward.
void CommContext::write_gradients_of(PendingReduction& r) {
  if (!streams) {
    if (r.next != PendingReduction::Next::kKeepPartial) r.group->finish_reduction(r);
    return;
  }
  release_reduce_scatter_input(r);
  const c10::Stream last = r.all_reduce ? streams->all_reduce : streams->reduce_scatter;
  device::DeviceOps& ops = device::ops_for(last.device_type());
  {
    device::StreamScope scope(last);
    if (r.next != PendingReduction::Next::kKeepPartial) r.group->finish_reduction(r);
  }
  const device::Event done = ops.record(last);
  reduction_events.push_back(done);
  keep_reduce_output_in_use(r);
  const GroupDevices& devices = r.group->devices();
  if (devices.offloaded && devices.non_blocking) host_copy_events.push_back(done);
}

void CommContext::make_room_for_reduction(int64_t max_in_flight) {
  int64_t holding = 0;
  for (const PendingReduction& r : reductions) holding += r.reduce_scatter.input.defined() ? 1 : 0;
  for (PendingReduction& r : reductions) {
    if (holding < max_in_flight) break;
    if (!r.reduce_scatter.input.defined()) continue;
    release_reduce_scatter_input(r);
    --holding;
  }
  finish_reductions(false);
}

// Every pending reduction takes its collectives to the end, as on every other rank (each one's
// all-reduce was issued with its reduce-scatter), and is dropped. On a device the compute stream
// waits for them and for the copy-outs already queued, so that the dropped buffers' memory is
// reused only after. After a failed collective the groups are unusable, and nothing more is issued.
void CommContext::discard_reductions() {
  std::exception_ptr first_error;
  for (PendingReduction& r : reductions) {
    try {
      if (r.reduce_scatter.work) r.reduce_scatter.work->wait();
      if (r.all_reduce) r.all_reduce->wait();
    } catch (...) {
      first_error = std::current_exception();
      break;
    }
  }
  reductions.clear();
  wait_for_gradients();
  if (first_error) std::rethrow_exception(first_error);
}

FSDPParamGroup::FSDPParamGroup(FSDPParams params, MeshInfo mesh_info, std::string module_fqn,
                               std::shared_ptr<ProcessGroup> post_forward_group, const MixedPrecisionPolicy& mp_policy,
                               const std::optional<CPUOffloadPolicy>& offload_policy)
    : params_(std::move(params)),
      mesh_(mesh_info.mesh),
      mesh_info_(std::move(mesh_info)),
      shard_group_(mesh_info_.shard_group()),
      replicate_group_(mesh_info_.replicate_group()),
      module_fqn_(std::move(module_fqn)),
      devices_(resolve_group_devices(mesh_, offload_policy)),
      offloaded_(offload_policy.has_value()),
      post_forward_group_(std::move(post_forward_group)),
      mp_policy_(mp_policy) {
  TORCH_CHECK(!params_.empty(), "FSDPParamGroup needs at least one parameter");
  const at::ScalarType dtype = params_.front()->orig_dtype();
  for (const auto& p : params_) {
    TORCH_CHECK(p->unsharded().device() == devices_.compute, "fully_shard: parameter '", p->fqn(), "' is on ",
                p->unsharded().device(), " but the mesh computes on ", devices_.compute,
                "; build the mesh for that device (init_device_mesh(\"",
                c10::DeviceTypeName(p->unsharded().device().type(), true), "\", ...)) or move the module to ",
                devices_.compute, " first");
    TORCH_CHECK(p->orig_dtype() == dtype, "fully_shard: parameters of one group must share a dtype, but '",
                params_.front()->fqn(), "' is ", dtype, " and '", p->fqn(), "' is ", p->orig_dtype(),
                "; convert the module (module->to(dtype)) before fully_shard, or shard them in separate calls");
  }
  dtypes_ = resolve_group_dtypes(mp_policy, dtype);
  shard_layout_ = shard_layout(params_, shard_group_->size());
  flat_shard_ = init_flat_shard(params_, shard_layout_, devices_);
  label_for_stream_check(flat_shard_, "the flat shard of");
  if (dtypes_.unsharded != dtypes_.orig) {
    // The unsharded faces compute in the policy's dtype; each unshard casts into the all-gather.
    for (auto& p : params_) p->set_unsharded_dtype(dtypes_.unsharded);
  } else if (unsharded_can_alias_shard()) {
    // Nothing to gather, ever: the unsharded tensors alias the shards and stay unsharded.
    for (size_t i = 0; i < params_.size(); ++i) params_[i]->alias_shard(flat_shard_, shard_layout_.offset[i]);
    unsharded_aliases_shard_ = true;
    sharded_state_ = ShardedState::kUnsharded;
  } else {
    free_unsharded_params();
  }
}

// ------------------------------------------------------------------------------ all-gather

// One rank without a cast: nothing to gather, ever. Not when CPU offload keeps the shards in host
// memory apart from the device's: each unshard copies them into a device buffer, as FSDP2 does.
bool FSDPParamGroup::unsharded_can_alias_shard() const {
  return dtypes_.unsharded == dtypes_.orig && shard_group_->size() == 1 &&
         (!offloaded_ || device::ops_for(devices_.compute).shares_host_memory());
}

// ------------------------------------------------------------------------------ conversions

// FSDP2 re-lays its shards after module.to() from FSDPModule._apply (reset_sharded_param).
// LibTorch's Module::to converts each registered tensor in place through set_data, and no
// hook of the user's module class can be FSDP's: the sharded leaves keep their TensorImpls and
// get storage of their own. So a group compares its leaves with its flat shard at every unshard
// (one storage comparison per parameter) and re-lays them there, before anything is gathered.
bool FSDPParamGroup::shards_replaced() const {
  return std::any_of(params_.begin(), params_.end(), [this](const auto& p) { return !p->shard_views(flat_shard_); });
}

void FSDPParamGroup::reset_sharded_params_if_replaced() {
  if (!shards_replaced()) return;
  check_replaced_shards();
  reset_sharded_params();
}

// What cannot be re-laid, refused before anything is issued, naming the parameters.
void FSDPParamGroup::check_replaced_shards() const {
  TORCH_CHECK(training_state_ != TrainingState::kPreBackward && training_state_ != TrainingState::kPostBackward,
              "fsdp: the parameters of FSDP module '", module_label(module_fqn_),
              "' were converted (module->to() or set_data()) between its forward and its backward, which needs "
              "the parameters that forward computed with. Convert between iterations: after backward, or before "
              "the first forward.");
  const bool reducing = comm_ && std::any_of(comm_->reductions.begin(), comm_->reductions.end(),
                                             [this](const PendingReduction& r) { return r.group == this; });
  TORCH_CHECK(!reducing, "fsdp: the parameters of FSDP module '", module_label(module_fqn_),
              "' were converted (module->to() or set_data()) while its gradient reduction is in flight "
              "(set_is_last_backward(false)). Convert after a backward run with set_is_last_backward(true).");
  std::string moved, dtypes;
  for (const auto& p : params_) {
    const at::Tensor& shard = p->sharded();
    if (shard.device() != devices_.shard)
      moved += (moved.empty() ? "'" : ", '") + p->fqn() + "' on " + shard.device().str();
    dtypes += (dtypes.empty() ? "'" : ", '") + p->fqn() + "' (" + c10::toString(shard.scalar_type()) + ")";
  }
  const std::string move_back =
      ". Move the module back (module->to(torch::Device(\"" + devices_.shard.str() +
      "\"))) before its next forward, or load state dicts in place (fsdp::load_sharded_state_dict).";
  TORCH_CHECK(moved.empty() || !offloaded_,
              "fsdp: FSDP parameters should be materialized on CPU when enabling CPU "
              "offloading (CPUOffloadPolicy), but these of '",
              module_label(module_fqn_), "' are not: ", moved, move_back);
  TORCH_CHECK(moved.empty(), "fsdp: the sharded parameters of '", module_label(module_fqn_),
              "' must be on the mesh's device ", devices_.shard.str(), ", but these moved: ", moved, move_back);
  const at::ScalarType dtype = params_.front()->sharded().scalar_type();
  const bool uniform = std::all_of(params_.begin(), params_.end(),
                                   [dtype](const auto& p) { return p->sharded().scalar_type() == dtype; });
  TORCH_CHECK(uniform, "fsdp: FSDP expects one dtype for the parameters of FSDP module '", module_label(module_fqn_),
              "' (they are gathered in one all-gather), but after a conversion they are ", dtypes,
              ". Convert the whole FSDP module (module->to(dtype) on it or on a module above it), not a part of it.");
}

// The new flat shard takes the leaves' dtype; the policy's dtypes are resolved again on top of it
// (a param_dtype equal to the new dtype is no cast), and the unsharded faces and every gradient
// FSDP holds follow. Between iterations only (check_replaced_shards), so nothing in flight reads
// the old buffers but a pending all-gather, which is let land and dropped.
void FSDPParamGroup::reset_sharded_params() {
  drop_pending_all_gather();
  reshard();
  const at::ScalarType dtype = params_.front()->sharded().scalar_type();
  at::Tensor flat = at::zeros({shard_layout_.row_numel}, at::TensorOptions().dtype(dtype).device(devices_.compute));
  if (offloaded_) flat = device::ops_for(devices_.compute).to_host(flat, dtype, devices_.non_blocking, false);
  for (size_t i = 0; i < params_.size(); ++i) params_[i]->reset_sharded(flat, shard_layout_.offset[i]);
  flat_shard_ = std::move(flat);
  label_for_stream_check(flat_shard_, "the flat shard of");
  dtypes_ = resolve_group_dtypes(mp_policy_, dtype);
  for (auto& p : params_) p->reset_unsharded(dtypes_.unsharded, dtypes_.reduce);
  if (partial_reduce_output_.defined()) partial_reduce_output_ = partial_reduce_output_.to(dtypes_.reduce);
  unsharded_aliases_shard_ = false;
  sharded_state_ = ShardedState::kSharded;
  if (unsharded_can_alias_shard()) {
    for (size_t i = 0; i < params_.size(); ++i) params_[i]->alias_shard(flat_shard_, shard_layout_.offset[i]);
    unsharded_aliases_shard_ = true;
    sharded_state_ = ShardedState::kUnsharded;
  }
  if (comm_ && comm_->streams) {
    // The side streams waited for the compute stream at the root's pre-forward, before these copies.
    device::DeviceOps& ops = device::ops_for(devices_.compute);
    const device::Event copied = ops.record(ops.current_stream(devices_.compute));
    ops.wait(comm_->streams->all_gather_copy_in, copied);
    ops.wait(comm_->streams->all_gather, copied);
  }
}

// FSDP2's rule: the all-gathers of forward and backward, and their prefetches, run on the side
// streams, so that they overlap the compute stream; one the user asks for between iterations
// (FSDPModule::unshard), or every one under set_unshard_async_op(true), runs on the current stream.
bool FSDPParamGroup::unshards_on_side_streams() const {
  return comm_ && comm_->streams && !unshard_async_op_ &&
         (prefetching_ || training_state_ == TrainingState::kForward || training_state_ == TrainingState::kPreBackward);
}

void FSDPParamGroup::unshard() {
  // A prefetch leaves converted parameters to the group's own unshard, which re-lays them (or, in
  // backward, refuses): every rank converts alike, so every rank skips the prefetch alike.
  if (prefetching_ && shards_replaced()) return;
  reset_sharded_params_if_replaced();  // also where nothing is gathered (one rank)
  if (sharded_state_ == ShardedState::kUnsharded || has_pending_unshard()) return;
  const bool on_device = device::ops_for(devices_.compute).has_streams();
  std::optional<c10::Stream> copy_in, gather;
  if (on_device) {
    device::DeviceOps& ops = device::ops_for(devices_.compute);
    const c10::Stream current = ops.current_stream(devices_.compute);
    const bool side = unshards_on_side_streams();
    copy_in = side ? comm_->streams->all_gather_copy_in : current;
    gather = side ? comm_->streams->all_gather : current;
    // The side streams waited for the optimizer's writes to the shards at the root's pre-forward
    // (CommContext::begin_forward); the post-forward shard was made later.
    if (side && post_forward_shard_event_) ops.wait(*copy_in, *post_forward_shard_event_);
  }
  std::optional<device::StreamScope> scope;
  if (copy_in) scope.emplace(*copy_in);
  if (sharded_state_ == ShardedState::kShardedPostForward) {
    pending_all_gather_ =
        foreach_all_gather(post_forward_shard_, post_forward_layout(params_, post_forward_group_->size()),
                           *post_forward_group_, custom_all_gather_.get(), gather);
  } else if (quantized_weights_ && shard_group_->size() > 1) {
    TORCH_CHECK(!custom_all_gather_, "fsdp: FSDP module '", module_label(module_fqn_),
                "' has both quantized_weights and a custom all-gather (set_custom_all_gather); the quantized "
                "all-gather is FSDP's own: drop one of them");
    // Encoded from the shards' own dtype (fp32 master weights), not from a param_dtype cast.
    pending_all_gather_ = foreach_all_gather_quantized(all_gather_input(flat_shard_, dtypes_.orig, devices_),
                                                       shard_layout_, *shard_group_, *quantized_weights_, gather);
  } else {
    pending_all_gather_ = foreach_all_gather(all_gather_input(flat_shard_, dtypes_.unsharded, devices_), shard_layout_,
                                             *shard_group_, custom_all_gather_.get(), gather);
  }
  pending_all_gather_.alloc_stream = copy_in;
  pending_all_gather_.issue_stream = gather;
  label_for_stream_check(pending_all_gather_.output, "the all-gather output of");
}

// On a device: the all-gather stream waits for the collective (a staged one's copy back runs on
// it), and the compute stream for both all-gather streams (on one rank nothing is issued, and
// the copy-in stream holds the only work: the cast into the all-gather input).
void FSDPParamGroup::wait_for_all_gather_on_device() {
  const c10::Stream gather = *pending_all_gather_.issue_stream;
  device::DeviceOps& ops = device::ops_for(gather.device_type());
  if (pending_all_gather_.work) {
    device::StreamScope scope(gather);
    wait_for(pending_all_gather_.work, "all_gather", module_fqn_);
  }
  const c10::Stream current = ops.current_stream(gather.device());
  ops.wait(current, ops.record(*pending_all_gather_.alloc_stream));
  ops.wait(current, ops.record(gather));
}

void FSDPParamGroup::wait_for_unshard() {
  if (!has_pending_unshard()) return;
  if (pending_all_gather_.issue_stream) {
    wait_for_all_gather_on_device();
  } else if (pending_all_gather_.work) {
    wait_for(pending_all_gather_.work, "all_gather", module_fqn_);
  }
  for (auto& p : params_) p->alloc_unsharded();
  foreach_all_gather_copy_out(pending_all_gather_, params_);
  if (pending_all_gather_.alloc_stream) {
    // The buffers were allocated on the copy-in stream and read on this one: their stream waits
    // for the copy-out before they are dropped, so their blocks are reused only after it.
    device::DeviceOps& ops = device::ops_for(devices_.compute);
    const device::Event copied = ops.record(ops.current_stream(devices_.compute));
    ops.wait(*pending_all_gather_.alloc_stream, copied);
    ops.wait(*pending_all_gather_.issue_stream, copied);
  }
  pending_all_gather_ = AllGatherResult{};
  post_forward_shard_ = at::Tensor();
  post_forward_shard_event_.reset();
  sharded_state_ = ShardedState::kUnsharded;
}

// An all-gather nobody will use: let it land, then drop it (on a device, once the stream that
// allocated its buffers waited for the collective). The compute stream waits for it too: the
// collective may read the flat shard itself, which the optimizer step writes there next.
void FSDPParamGroup::drop_pending_all_gather() {
  AllGatherResult dropped = std::move(pending_all_gather_);
  pending_all_gather_ = AllGatherResult{};
  if (dropped.issue_stream) {
    device::DeviceOps& ops = device::ops_for(devices_.compute);
    if (dropped.work) {
      device::StreamScope scope(*dropped.issue_stream);
      wait_for(dropped.work, "all_gather", module_fqn_);
    }
    const device::Event landed = ops.record(*dropped.issue_stream);
    ops.wait(*dropped.alloc_stream, landed);
    ops.wait(ops.current_stream(devices_.compute), landed);
    return;
  }
  if (dropped.work) wait_for(dropped.work, "all_gather", module_fqn_);
}

// An all-gather issued and not yet used (a backward prefetch for a module this backward did not
// reach, or unshard(async_op)) stays pending, as in FSDP2: the next unshard uses it instead of
// gathering again. Only the end of the last backward and reset_iter_state() drop one.
void FSDPParamGroup::reshard() {
  if (unsharded_aliases_shard_) return;  // the unsharded tensors are the shards
  if (sharded_state_ == ShardedState::kUnsharded) free_unsharded_params();
  post_forward_shard_ = at::Tensor();
  post_forward_shard_event_.reset();
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
  if (comm_ && comm_->streams) {
    device::DeviceOps& ops = device::ops_for(devices_.compute);
    post_forward_shard_event_ = ops.record(ops.current_stream(devices_.compute));
  }
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

// unshard() as a prefetch: on the side streams whatever set_unshard_async_op says, as FSDP2 does.
void FSDPParamGroup::unshard_as_prefetch() {
  prefetching_ = true;
  try {
    unshard();
  } catch (...) {
    prefetching_ = false;
    throw;
  }
  prefetching_ = false;
}

void FSDPParamGroup::prefetch_in_forward() {
  if (sharded_state_ == ShardedState::kUnsharded || has_pending_unshard()) return;
  unshard_as_prefetch();
  prefetched_in_forward_ = true;
}

// A group that ran its forward before the prefetch was issued (it has a post-forward index not
// yet taken by backward) was gathered for its backward, early: its pre-backward uses the pending
// all-gather, as FSDP2 keeps such an unshard pending for its next wait, and the end of the last
// backward drops it if unused. Without grad mode no backward follows, so it goes now, as does
// the prefetch of a group that did not run.
void FSDPParamGroup::drop_unused_forward_prefetch() {
  if (!prefetched_in_forward_) return;
  prefetched_in_forward_ = false;
  if (!reshards_after_forward()) return;
  if (!post_forward_indices_.empty() && at::GradMode::is_enabled()) return;
  drop_pending_all_gather();
  reshard();
}

// ------------------------------------------------------------------------------ hook steps

void FSDPParamGroup::pre_forward() {
  // Freezing or unfreezing the shards between iterations takes effect in this forward's graph.
  for (auto& p : params_) p->copy_requires_grad_from_shard();
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
  TORCH_CHECK(!reduced_ahead_, "fsdp: the gradients of FSDP module '", module_fqn_,
              "' arrived after it was "
              "reduce-scattered ahead of its backward (set_reduce_scatter_unused_params keeps every rank's "
              "reduce-scatters in the reverse order of the forward, and a module that ran forward later than '",
              module_fqn_,
              "' finished its backward first). This setting needs the modules' backward passes to "
              "run in the reverse order of their forward passes, as in a sequential model.");
  training_state_ = TrainingState::kPreBackward;
  if (!unshard_in_backward_) return;  // its parameters are not needed to compute gradients
  unshard();
  wait_for_unshard();
}

void FSDPParamGroup::prefetch_in_backward() {
  if (!unshard_in_backward_) return;
  unshard_as_prefetch();
}

int64_t FSDPParamGroup::pop_post_forward_index() {
  if (post_forward_indices_.empty()) return -1;
  const int64_t i = post_forward_indices_.back();
  post_forward_indices_.pop_back();
  return i;
}

// ------------------------------------------------------------------------------ reduce-scatter

void FSDPParamGroup::set_separate_reduce_scatter_group(std::shared_ptr<ProcessGroup> group) {
  TORCH_CHECK(!group || group->global_ranks() == shard_group_->global_ranks(),
              "internal: a separate "
              "reduce-scatter group of FSDP module '",
              module_fqn_, "' must have the shard group's ranks");
  separate_reduce_scatter_group_ = std::move(group);
}

const std::shared_ptr<ProcessGroup>& FSDPParamGroup::reduce_scatter_group() const {
  return separate_reduce_scatter_group_ ? separate_reduce_scatter_group_ : shard_group_;
}

void FSDPParamGroup::set_max_reductions_in_flight(int64_t k) {
  TORCH_CHECK(k > 0, "fsdp: set_reduce_scatter_max_input_buffers needs at least 1 buffer, got ", k);
  max_reductions_in_flight_ = k;
}

// The trainable parameters with a gradient, or every trainable one when unused parameters are
// reduced too. Frozen parameters never take part: they have no gradient on any rank.
// HSDP micro-batches summed before one all-reduce (set_requires_all_reduce(false)) must share a
// layout, so they carry every trainable parameter too.
ReducedParams FSDPParamGroup::params_to_reduce() const {
  const bool partial_sums = replicate_group_ && (!all_reduce_grads_ || partial_reduce_output_.defined());
  ReducedParams reduced;
  for (size_t i = 0; i < params_.size(); ++i) {
    const FSDPParam& p = *params_[i];
    if (p.requires_grad() && (reduce_scatter_unused_params_ || partial_sums || p.has_unsharded_grad()))
      reduced.push_back(i);
  }
  // Without unused-parameter reduction, a backward that gave none of them a gradient reduces
  // nothing, as without HSDP.
  const bool any_grad =
      std::any_of(reduced.begin(), reduced.end(), [&](size_t i) { return params_[i]->has_unsharded_grad(); });
  if (partial_sums && !reduce_scatter_unused_params_ && !any_grad) return {};
  return reduced;
}

// No sync: the unsharded grads keep accumulating until a backward that reduces, in the reduce
// dtype when it is wider than the compute dtype (bf16 micro-batch grads summed in fp32).
void FSDPParamGroup::keep_unsynced_grads() {
  if (dtypes_.reduce == dtypes_.unsharded) return;  // autograd accumulates them in place
  for (auto& p : params_) {
    if (p->requires_grad()) p->accumulate_unsharded_grad(dtypes_.reduce);
  }
}

// The division for this backward, from the group's sizes and the user's settings.
GradientDivision FSDPParamGroup::current_gradient_division() const {
  const int64_t replicas = replicate_group_ ? replicate_group_->size() : 1;
  return gradient_division(dtypes_.reduce, shard_group_->size(), replicas, gradient_divide_factor_,
                           force_sum_reduction_);
}

// One rank with nothing to reduce, divide or show a hook: the gradients are the shards' already.
bool FSDPParamGroup::can_hand_over_gradients(const GradientDivision& division) const {
  return shard_group_->size() == 1 && !replicate_group_ && !all_reduce_hook_ && division.is_identity();
}

PendingReduction::Next FSDPParamGroup::next_after_reduce_scatter() const {
  if (!replicate_group_) return PendingReduction::Next::kWriteGrads;
  return all_reduce_grads_ ? PendingReduction::Next::kAllReduce : PendingReduction::Next::kKeepPartial;
}

void FSDPParamGroup::post_backward() {
  training_state_ = TrainingState::kPostBackward;
  if (shards_replaced()) check_replaced_shards();  // converted since its forward: refused
  reduced_in_this_backward_ = true;
  // HSDP: an earlier micro-batch's reduce-scatter still in flight belongs in the partial sum,
  // which decides what this one reduces and is read by its all-reduce.
  if (replicate_group_ && comm_) comm_->complete_reduce_scatters_of(this);
  const ReducedParams reduced = reduce_grads_ ? params_to_reduce() : ReducedParams{};
  if (reduced.empty()) {
    if (!reduce_grads_) keep_unsynced_grads();
    if (reshard_after_backward_) reshard();
    return;
  }
  const GradientDivision division = current_gradient_division();
  const bool hand_over = can_hand_over_gradients(division);
  // Checked before anything is issued: a reduce-scatter nobody would wait for must not start.
  TORCH_CHECK(comm_ != nullptr || hand_over, "internal: post_backward of '", module_fqn_,
              "' before lazy initialisation");
  // The gradients are tensors of their own: the parameters can be freed before the copy-in.
  if (reshard_after_backward_) reshard();
  if (hand_over) {
    // A copy to pinned host memory left running is waited for by the host at the end of backward.
    const bool may_run_on = comm_ != nullptr && comm_->streams.has_value();
    if (foreach_reduce_hand_over(params_, reduced, dtypes_, devices_, may_run_on)) {
      device::DeviceOps& ops = device::ops_for(devices_.compute);
      comm_->host_copy_events.push_back(ops.record(ops.current_stream(devices_.compute)));
    }
    if (device::stream_check::enabled()) {
      for (size_t i : reduced) {
        device::stream_check::label(params_[i]->sharded().grad(),
                                    "the sharded gradient of '" + params_[i]->fqn() + "'");
      }
    }
    return;
  }
  issue_reduce_scatter(reduced, division);
}

void FSDPParamGroup::post_backward_ahead() {
  reduced_ahead_ = true;
  post_backward();
}

// On a device, as in FSDP2: the copy-in on the compute stream, which made the unsharded gradients
// and frees them; the division and the collective on the reduce-scatter stream.
void FSDPParamGroup::issue_reduce_scatter(const ReducedParams& reduced, const GradientDivision& division) {
  comm_->make_room_for_reduction(max_reductions_in_flight_);
  comm_->issue_deferred_all_reduces();
  ProcessGroup& group = *reduce_scatter_group();
  ReduceScatterInput prepared =
      foreach_reduce_prepare(params_, reduced, group.size(), dtypes_.reduce, custom_reduce_scatter_.get());
  std::optional<device::StreamScope> scope;
  if (comm_->streams) {
    device::DeviceOps& ops = device::ops_for(devices_.compute);
    ops.wait(comm_->streams->reduce_scatter, ops.record(ops.current_stream(devices_.compute)));
    scope.emplace(comm_->streams->reduce_scatter);
  }
  label_for_stream_check(prepared.input, "the reduce-scatter input of");
  ReduceScatterResult result =
      foreach_reduce_issue(std::move(prepared), reduced, group, division, custom_reduce_scatter_.get());
  label_for_stream_check(result.output, "the reduce-scatter output of");
  comm_->reductions.push_back(
      PendingReduction{this, std::move(result), next_after_reduce_scatter(), false, nullptr, std::nullopt});
  if (comm_->reductions.back().next == PendingReduction::Next::kAllReduce) issue_all_reduce(comm_->reductions.back());
}

// FSDP2's order: the all-reduce is issued right after its reduce-scatter, in program order on
// every rank, never when this rank happens to notice that the reduce-scatter finished. It reads the
// reduce-scatter's output (plus the partial sum of earlier micro-batches), so it starts after it:
// - on a device, the reduce-scatter stream waits for the collective (the host does not, on NCCL),
//   adds the partial sum, and the all-reduce stream waits for it;
// - on the CPU, the replicate group's communication thread waits for the reduce-scatter (`after`),
//   so that the host goes on with backward while both run; a partial sum to add first is added by
//   the host, after it waited for the reduce-scatter.
void FSDPParamGroup::issue_all_reduce(PendingReduction& r) {
  const bool on_streams = comm_->streams.has_value();
  if (quantized_gradients_ && !on_streams) {
    if (!r.reduce_scatter.work) {
      // A one-rank shard group's output is its input, ready now on every rank; the deferred
      // all-reduces before it were issued ahead of this reduce-scatter, so the order holds.
      comm_->complete_reduce_scatter(r);
      issue_quantized_all_reduce(r);
      return;
    }
    // Encoding needs the reduce-scatter's output: rather than block backward for it here, the
    // next post-backward (which waits for it anyway) or the end of backward issues it.
    r.all_reduce_deferred = true;
    return;
  }
  WorkHandle after = r.reduce_scatter.work;
  if (on_streams || partial_reduce_output_.defined()) {
    comm_->complete_reduce_scatter(r);
    after = nullptr;
  }
  if (!on_streams) {
    add_partial_reduce_output(r.reduce_scatter.output);
    r.all_reduce = foreach_all_reduce(r.reduce_scatter, *replicate_group_, std::move(after));
    return;
  }
  device::DeviceOps& ops = device::ops_for(devices_.compute);
  {
    device::StreamScope scope(comm_->streams->reduce_scatter);
    add_partial_reduce_output(r.reduce_scatter.output);
  }
  ops.wait(comm_->streams->all_reduce, ops.record(comm_->streams->reduce_scatter));
  device::StreamScope scope(comm_->streams->all_reduce);
  if (quantized_gradients_) {
    issue_quantized_all_reduce(r);
    return;
  }
  r.all_reduce = foreach_all_reduce(r.reduce_scatter, *replicate_group_);
}

void FSDPParamGroup::set_quantized_weights(std::optional<QuantizedComm> format) {
  TORCH_CHECK(!format || at::isFloatingType(dtypes_.orig),
              "fully_shard: quantized_weights encodes floating-point "
              "parameters, but those of '",
              module_label(module_fqn_), "' are ", dtypes_.orig,
              "; shard them in a call of their own without quantized_weights");
  quantized_weights_ = std::move(format);
}

void FSDPParamGroup::set_quantized_gradients(std::optional<QuantizedComm> format) {
  TORCH_CHECK(!format || replicate_group_, "internal: quantized_gradients on FSDP module '", module_label(module_fqn_),
              "' without a replicate group");
  quantized_gradients_ = std::move(format);
  replicate_residual_ = at::Tensor();
  zero_block_skip_ = detail::ZeroBlockSkip();
}

// On the CPU the host encodes (its reduce-scatter finished: issue_deferred_all_reduces waited);
// on a device the all-reduce stream does, after it waited for the reduce-scatter stream.
void FSDPParamGroup::issue_quantized_all_reduce(PendingReduction& r) {
  if (!comm_->streams) add_partial_reduce_output(r.reduce_scatter.output);
  if (quantized_gradients_->error_feedback() && !replicate_residual_.defined()) {
    replicate_residual_ = at::zeros({shard_layout_.row_numel}, r.reduce_scatter.output.options().dtype(at::kFloat));
  }
  r.quantized_all_reduce = foreach_all_reduce_quantized(r.reduce_scatter, *replicate_group_, *quantized_gradients_,
                                                        replicate_residual_, shard_layout_, &zero_block_skip_);
  r.all_reduce = r.quantized_all_reduce->work;
}

void FSDPParamGroup::end_backward() {
  training_state_ = TrainingState::kIdle;
  reduced_in_this_backward_ = false;
  reduced_ahead_ = false;
}

void FSDPParamGroup::after_reduce_scatter(PendingReduction& r) {
  if (r.next == PendingReduction::Next::kKeepPartial) keep_partial_reduce_output(r.reduce_scatter.output);
}

// The first micro-batch's output becomes the partial sum; later ones are added to it.
void FSDPParamGroup::keep_partial_reduce_output(const at::Tensor& output) {
  if (partial_reduce_output_.defined()) {
    partial_reduce_output_.add_(output);
  } else {
    partial_reduce_output_ = output;
  }
}

// The micro-batches reduce-scattered without all-reduce join this one's all-reduce.
void FSDPParamGroup::add_partial_reduce_output(const at::Tensor& output) {
  if (!partial_reduce_output_.defined()) return;
  output.add_(partial_reduce_output_);
  partial_reduce_output_ = at::Tensor();
}

void FSDPParamGroup::run_all_reduce_hook(at::Tensor& output) const {
  if (!all_reduce_hook_) return;
  const at::Tensor before = output;
  all_reduce_hook_(output);
  TORCH_CHECK(output.defined() && output.numel() == before.numel() && output.scalar_type() == before.scalar_type(),
              "fsdp: the all-reduce hook of '", module_fqn_,
              "' must modify the reduce output in place (or replace "
              "it by a tensor of ",
              before.numel(), " elements of ", before.scalar_type(), "), but it left ",
              output.defined() ? std::to_string(output.numel()) + " elements of " + c10::toString(output.scalar_type())
                               : std::string("an undefined tensor"));
  if (!output.is_contiguous()) output = output.contiguous();
}

void FSDPParamGroup::finish_reduction(PendingReduction& r) {
  if (r.quantized_all_reduce) finish_all_reduce_quantized(*r.quantized_all_reduce, r.reduce_scatter);
  run_all_reduce_hook(r.reduce_scatter.output);
  foreach_reduce_copy_out(r.reduce_scatter, params_, dtypes_.orig, devices_);
  if (!r.reduce_scatter.params.empty()) {
    label_for_stream_check(params_[r.reduce_scatter.params.front()]->sharded().grad(), "the sharded gradients of");
  }
}

void FSDPParamGroup::finalize_backward() {
  drop_pending_all_gather();  // a prefetch for a module that did not run backward
  post_forward_indices_.clear();
}

void FSDPParamGroup::reset_iter_state() {
  training_state_ = TrainingState::kIdle;
  prefetched_in_forward_ = false;
  reduced_in_this_backward_ = false;
  reduced_ahead_ = false;
  post_forward_indices_.clear();
  partial_reduce_output_ = at::Tensor();
  for (auto& p : params_) p->clear_unsharded_grad();
  reshard();
  drop_pending_all_gather();  // last: it waits for an all-gather in flight, which may throw
}

// Names a buffer of this group in the stream-order checker's reports; builds nothing when it is off.
void FSDPParamGroup::label_for_stream_check(const at::Tensor& t, const char* role) const {
  if (device::stream_check::enabled()) {
    device::stream_check::label(t, std::string(role) + " '" + module_label(module_fqn_) + "'");
  }
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
