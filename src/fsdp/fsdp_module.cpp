// fsdp_module.cpp — FSDPModule and UnshardHandle: the user's runtime controls, each a thin
// call into the module's state or parameter group.
#include <fsdp/fsdp_module.h>

#include "src/device/device_ops.h"
#include "src/fsdp/state.h"

#include <fsdp/distributed.h>

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <map>

namespace fsdp {

using detail::FSDPParamGroup;
using detail::FSDPState;

FSDPModule make_fsdp_module(std::shared_ptr<FSDPState> state) { return FSDPModule(std::move(state)); }

bool is_fsdp_module(const torch::nn::Module& module) { return detail::find_state(module) != nullptr; }

FSDPModule get_fsdp_module(const torch::nn::Module& module) {
  auto state = detail::find_state(module);
  TORCH_CHECK(state, "fsdp::get_fsdp_module: this ", module.name(),
              " is not an FSDP module; apply fsdp::fully_shard to it first");
  return make_fsdp_module(state);
}

std::shared_ptr<torch::nn::Module> FSDPModule::module() const {
  TORCH_CHECK(state_, "fsdp::FSDPModule: invalid handle");
  return state_->module();
}

std::vector<FSDPState*> FSDPModule::states(bool recurse) const {
  TORCH_CHECK(state_, "fsdp::FSDPModule: invalid handle");
  std::vector<FSDPState*> out{state_.get()};
  if (!recurse) return out;
  auto m = state_->module();
  if (!m) return out;
  for (const auto& item : m->named_modules("", false)) {
    auto st = detail::find_state(*item.value());
    if (st && std::find(out.begin(), out.end(), st.get()) == out.end()) out.push_back(st.get());
  }
  return out;
}

void UnshardHandle::wait() {
  if (state_ && state_->group()) state_->group()->wait_for_unshard();
}

UnshardHandle FSDPModule::unshard(bool async_op) {
  TORCH_CHECK(state_, "fsdp::FSDPModule: invalid handle");
  if (FSDPParamGroup* g = state_->group()) {
    g->unshard();
    if (!async_op) g->wait_for_unshard();
  }
  return UnshardHandle(state_);
}

void FSDPModule::reshard() {
  TORCH_CHECK(state_, "fsdp::FSDPModule: invalid handle");
  if (FSDPParamGroup* g = state_->group()) g->reshard();
}

// The handles' states (held by the handles themselves, so a module that is gone is no problem).
std::vector<std::weak_ptr<FSDPState>> FSDPModule::states_of(const std::vector<FSDPModule>& modules,
                                                            const char* setter) {
  std::vector<std::weak_ptr<FSDPState>> out;
  for (const auto& m : modules) {
    TORCH_CHECK(m.valid(), "fsdp::FSDPModule::", setter, ": got an invalid FSDPModule handle");
    out.push_back(m.state_);
  }
  return out;
}

void FSDPModule::set_modules_to_forward_prefetch(const std::vector<FSDPModule>& modules) {
  TORCH_CHECK(state_, "fsdp::FSDPModule: invalid handle");
  state_->set_states_to_forward_prefetch(states_of(modules, "set_modules_to_forward_prefetch"));
}

void FSDPModule::set_modules_to_backward_prefetch(const std::vector<FSDPModule>& modules) {
  TORCH_CHECK(state_, "fsdp::FSDPModule: invalid handle");
  state_->set_states_to_backward_prefetch(states_of(modules, "set_modules_to_backward_prefetch"));
}

void FSDPModule::set_requires_gradient_sync(bool requires_gradient_sync, bool recurse) {
  for (FSDPState* st : states(recurse)) {
    if (!st->group()) continue;
    st->group()->set_reduce_grads(requires_gradient_sync);
    st->group()->set_all_reduce_grads(requires_gradient_sync);
  }
}

void FSDPModule::set_requires_all_reduce(bool requires_all_reduce, bool recurse) {
  for (FSDPState* st : states(recurse)) {
    if (st->group()) st->group()->set_all_reduce_grads(requires_all_reduce);
  }
}

void FSDPModule::set_gradient_divide_factor(double factor) {
  TORCH_CHECK(factor > 0 && std::isfinite(factor),
              "fsdp::FSDPModule::set_gradient_divide_factor: the factor must be "
              "positive and finite, got ",
              factor);
  if (FSDPParamGroup* g = states(false).front()->group()) g->set_gradient_divide_factor(factor);
}

void FSDPModule::set_force_sum_reduction_for_comms(bool enable) {
  if (FSDPParamGroup* g = states(false).front()->group()) g->set_force_sum_reduction_for_comms(enable);
}

void FSDPModule::set_all_reduce_hook(std::function<void(at::Tensor&)> hook) {
  if (FSDPParamGroup* g = states(false).front()->group()) g->set_all_reduce_hook(std::move(hook));
}

void FSDPModule::set_reshard_after_forward(bool reshard_after_forward, bool recurse) {
  for (FSDPState* st : states(recurse)) st->set_reshard_after_forward(reshard_after_forward);
}

void FSDPModule::set_reshard_after_backward(bool reshard_after_backward, bool recurse) {
  for (FSDPState* st : states(recurse)) {
    if (st->group()) st->group()->set_reshard_after_backward(reshard_after_backward);
  }
}

void FSDPModule::set_reduce_scatter_unused_params(bool enable, bool recurse) {
  for (FSDPState* st : states(recurse)) {
    if (st->group()) st->group()->set_reduce_scatter_unused_params(enable);
  }
}

void FSDPModule::set_is_last_backward(bool is_last_backward) {
  TORCH_CHECK(state_, "fsdp::FSDPModule: invalid handle");
  state_->set_is_last_backward(is_last_backward);
}

void FSDPModule::set_unshard_in_backward(bool unshard_in_backward) {
  TORCH_CHECK(state_, "fsdp::FSDPModule: invalid handle");
  if (FSDPParamGroup* g = state_->group()) g->set_unshard_in_backward(unshard_in_backward);
}

// One new group per shard group among the modules (their order is the module tree's, the same
// on every rank, so every rank creates the same groups in the same order).
void FSDPModule::set_separate_reduce_scatter_group(bool enable, bool recurse) {
  std::map<std::vector<int>, std::shared_ptr<ProcessGroup>> made;
  for (FSDPState* st : states(recurse)) {
    FSDPParamGroup* g = st->group();
    if (!g) continue;
    if (!enable) {
      g->set_separate_reduce_scatter_group(nullptr);
      continue;
    }
    if (g->has_separate_reduce_scatter_group() || g->shard_group()->size() == 1) continue;
    std::shared_ptr<ProcessGroup>& group = made[g->shard_group()->global_ranks()];
    if (!group) group = fsdp::new_group(g->shard_group()->global_ranks());
    g->set_separate_reduce_scatter_group(group);
  }
}

void FSDPModule::set_reduce_scatter_max_input_buffers(int max_buffers, bool recurse) {
  TORCH_CHECK(max_buffers > 0,
              "fsdp::FSDPModule::set_reduce_scatter_max_input_buffers: max_buffers must be at "
              "least 1, got ",
              max_buffers);
  for (FSDPState* st : states(recurse)) {
    if (st->group()) st->group()->set_max_reductions_in_flight(max_buffers);
  }
}

void FSDPModule::set_custom_all_gather(std::shared_ptr<AllGather> comm) {
  if (FSDPParamGroup* g = states(false).front()->group()) g->set_custom_all_gather(std::move(comm));
}

void FSDPModule::set_custom_reduce_scatter(std::shared_ptr<ReduceScatter> comm) {
  if (FSDPParamGroup* g = states(false).front()->group()) g->set_custom_reduce_scatter(std::move(comm));
}

void FSDPModule::set_allocate_memory_from_process_group_for_comm(bool enable) {
  if (!enable) return;  // the default: FSDP's own buffers (or a custom comm's)
  FSDPParamGroup* g = states(false).front()->group();
  TORCH_CHECK(!g || !g->has_custom_comm(),
              "fsdp::FSDPModule::set_allocate_memory_from_process_group_for_comm: this "
              "module has a custom all-gather or reduce-scatter installed, which allocates its buffers; it cannot "
              "take memory from the process group as well");
  TORCH_CHECK(false,
              "fsdp::FSDPModule::set_allocate_memory_from_process_group_for_comm(true) is not supported by "
              "this backend: fsdp-cpp's CPU process group (Gloo over TCP) sends from any host memory and has no "
              "communication-memory allocator to take buffers from. To control the buffers, install a custom "
              "all-gather or reduce-scatter (fsdp/custom_comm.h), whose allocate() FSDP uses.");
}

void FSDPModule::set_post_optim_event(const c10::Event& event) {
  TORCH_CHECK(false, "fsdp::FSDPModule::set_post_optim_event: not supported yet (got an event of device type ",
              c10::DeviceTypeName(event.device_type()),
              "). It lets the root's all-gathers wait for that event instead of the whole current stream. Here "
              "each all-gather's copy-in waits for the whole current stream, which already includes the optimizer "
              "step: remove the call; the order it asks for holds without it.");
}

void FSDPModule::set_symm_mem_for_comm(const std::string& backend) {
  TORCH_CHECK(false, "fsdp::FSDPModule::set_symm_mem_for_comm(\"", backend,
              "\"): not supported: symmetric-memory "
              "all-gather buffers need NCCL, and fsdp-cpp's process groups are Gloo and MPI on CPU, which send from "
              "any host memory. Remove the call, or install a custom all-gather (fsdp/custom_comm.h) to control "
              "the buffers.");
}

void FSDPModule::set_unshard_async_op(bool async_op) {
  TORCH_CHECK(state_, "fsdp::FSDPModule: invalid handle");
  for (FSDPState* st : states(/*recurse=*/true)) {
    if (!st->group()) continue;
    TORCH_CHECK(!async_op || device::ops_for(st->group()->devices().compute).has_streams(),
                "fsdp::FSDPModule::set_unshard_async_op(true) is not supported on a CPU mesh: it moves the "
                "all-gather's allocation onto the current stream, and a CPU mesh has no streams. Its all-gathers "
                "already run on the group's communication thread and are waited for right before the module runs; "
                "for overlap, prefetch explicitly (unshard(true) or set_modules_to_forward_prefetch).");
    st->group()->set_unshard_async_op(async_op);
  }
}

void FSDPModule::reset_iter_state() {
  TORCH_CHECK(state_, "fsdp::FSDPModule: invalid handle");
  state_->reset_iter_state();
}

void share_comm_ctx(const std::vector<FSDPModule>& modules) {
  if (modules.empty()) return;
  for (const auto& m : modules) TORCH_CHECK(m.valid(), "fsdp::share_comm_ctx: got an invalid FSDPModule handle");
  // Every module is checked (comm_context_to_share refuses a non-root) before any changes.
  for (const auto& m : modules) m.state_->comm_context_to_share();
  std::shared_ptr<detail::CommContext> comm = modules.front().state_->comm_context_to_share();
  for (size_t i = 1; i < modules.size(); ++i) modules[i].state_->use_comm_context(comm);
}

std::shared_ptr<ProcessGroup> FSDPModule::reduce_scatter_group() const {
  TORCH_CHECK(state_, "fsdp::FSDPModule: invalid handle");
  TORCH_CHECK(state_->group(), "fsdp::FSDPModule::reduce_scatter_group: this FSDP module manages no parameters");
  return state_->group()->reduce_scatter_group();
}

int64_t FSDPModule::reductions_in_flight() const {
  TORCH_CHECK(state_, "fsdp::FSDPModule: invalid handle");
  return state_->reductions_in_flight();
}

DeviceMesh FSDPModule::mesh() const {
  TORCH_CHECK(state_, "fsdp::FSDPModule: invalid handle");
  TORCH_CHECK(state_->group(), "fsdp::FSDPModule::mesh: this FSDP module manages no parameters");
  return state_->group()->mesh();
}

int64_t FSDPModule::unsharded_parameter_bytes() const {
  TORCH_CHECK(state_, "fsdp::FSDPModule: invalid handle");
  return state_->group() ? state_->group()->unsharded_bytes() : 0;
}

}  // namespace fsdp
