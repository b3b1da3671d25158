// fully_shard() and FSDPModule: argument checks, which modules and parameters a call manages,
// swapping the registered parameters for shards, and the user-facing setters.
#include <fsdp/fully_shard.h>

#include "fsdp/state.h"

#include <fsdp/distributed.h>

#include <c10/util/Exception.h>

#include <mutex>
#include <set>
#include <unordered_map>

namespace fsdp {
namespace detail {
namespace {

// LibTorch's parameter registry is protected; a pointer to member named through a derived
// class reaches it without changing LibTorch.
struct ParameterRegistry : torch::nn::Module {
  using Dict = torch::OrderedDict<std::string, at::Tensor>;
  static Dict& of(torch::nn::Module& m) {
    constexpr Dict torch::nn::Module::*member = &ParameterRegistry::parameters_;
    return m.*member;
  }
};

// Sharded parameter -> its record, and unsharded tensor -> owner, across all calls.
struct ParamIndex {
  std::mutex mu;
  struct Entry {
    std::weak_ptr<FSDPState> state;
    FSDPParam* param;
  };
  std::unordered_map<const c10::TensorImpl*, Entry> by_sharded;
  std::unordered_map<const c10::TensorImpl*, Entry> by_unsharded;

  // Entries of FSDP modules that no longer exist (their tensors' addresses may be reused).
  void drop_expired() {
    for (auto* map : {&by_sharded, &by_unsharded}) {
      for (auto it = map->begin(); it != map->end();) it = it->second.state.expired() ? map->erase(it) : std::next(it);
    }
  }
  const Entry* find(const std::unordered_map<const c10::TensorImpl*, Entry>& map, const at::Tensor& t) const {
    if (!t.defined()) return nullptr;
    auto it = map.find(t.unsafeGetTensorImpl());
    return it == map.end() || it->second.state.expired() ? nullptr : &it->second;
  }
  const Entry* find_sharded(const at::Tensor& t) const { return find(by_sharded, t); }
  // The shard's or the unsharded member's record.
  const Entry* find_any(const at::Tensor& t) const {
    const Entry* e = find(by_sharded, t);
    return e ? e : find(by_unsharded, t);
  }
};
ParamIndex& param_index() {
  static ParamIndex* index = new ParamIndex();
  return *index;
}

DeviceMesh default_mesh() {
  static std::mutex mu;
  static DeviceMesh mesh;
  std::lock_guard<std::mutex> lock(mu);
  if (!mesh.valid()) mesh = init_device_mesh("cpu", {get_world_size()});
  return mesh;
}

// Post-order (children first), not descending into modules another call already manages.
void collect_managed(const std::shared_ptr<torch::nn::Module>& m, bool top,
                     std::vector<std::shared_ptr<torch::nn::Module>>& out, std::set<const torch::nn::Module*>& seen) {
  if (!top && find_state(*m)) return;
  if (!seen.insert(m.get()).second) return;
  for (const auto& child : m->children()) collect_managed(child, false, out, seen);
  out.push_back(m);
}

}  // namespace
}  // namespace detail

using detail::FSDPParam;
using detail::FSDPParamGroup;
using detail::FSDPState;

FSDPModule make_fsdp_module(std::shared_ptr<FSDPState> state) { return FSDPModule(std::move(state)); }

FSDPModule fully_shard(const std::vector<std::shared_ptr<torch::nn::Module>>& modules,
                       const FullyShardOptions& options) {
  TORCH_CHECK(!modules.empty(), "fully_shard: the module list is empty");
  for (const auto& m : modules) {
    TORCH_CHECK(m != nullptr, "fully_shard: got a null module");
    TORCH_CHECK(!detail::find_state(*m), "fully_shard: fully_shard was already applied to this ", m->name(),
                "; apply it once per module, bottom-up");
  }
  DeviceMesh mesh = options.mesh().valid() ? options.mesh() : detail::default_mesh();
  TORCH_CHECK(mesh.ndim() == 1, "fully_shard: a ", mesh.ndim(), "-D mesh (HSDP) is not supported yet by fsdp-cpp; "
              "pass a 1-D mesh");
  const int64_t world = mesh.size(0);
  const int64_t rank = mesh.get_local_rank(0);

  // Managed modules, and the prefix of each within the first module (for FQNs).
  std::vector<std::shared_ptr<torch::nn::Module>> managed;
  std::set<const torch::nn::Module*> seen;
  for (const auto& m : modules) detail::collect_managed(m, true, managed, seen);
  std::unordered_map<const torch::nn::Module*, std::string> prefix;
  for (const auto& m : modules) {
    for (const auto& item : m->named_modules("", true)) prefix.emplace(item.value().get(), item.key());
  }

  // Their direct parameters, in post-order, each once (tied parameters appear in several modules).
  std::vector<std::unique_ptr<FSDPParam>> params;
  std::unordered_map<const c10::TensorImpl*, FSDPParam*> by_impl;
  auto& index = detail::param_index();
  {
    std::lock_guard<std::mutex> lock(index.mu);
    index.drop_expired();
    for (const auto& m : managed) {
      for (const auto& item : detail::ParameterRegistry::of(*m)) {
        const at::Tensor& t = item.value();
        if (!t.defined() || by_impl.count(t.unsafeGetTensorImpl())) continue;
        const std::string& pre = prefix[m.get()];
        const std::string fqn = pre.empty() ? item.key() : pre + "." + item.key();
        TORCH_CHECK(!index.by_unsharded.count(t.unsafeGetTensorImpl()), "fully_shard: parameter '",
                    fqn, "' is shared with a parameter already managed by another FSDP group; shard the modules "
                    "that share it in one call: fully_shard({module_a, module_b})");
        TORCH_CHECK(!index.by_sharded.count(t.unsafeGetTensorImpl()), "fully_shard: parameter '", fqn,
                    "' is already a shard of another FSDP group");
        params.push_back(std::make_unique<FSDPParam>(fqn, t, world, rank));
        by_impl[t.unsafeGetTensorImpl()] = params.back().get();
      }
    }
  }

  std::unique_ptr<FSDPParamGroup> group;
  if (!params.empty()) {
    group = std::make_unique<FSDPParamGroup>(std::move(params), mesh, prefix[modules.front().get()]);
  }
  auto state = std::make_shared<FSDPState>(modules, std::move(group), options.reshard_after_forward());

  // Swap the registered parameters for the shards; the modules' members keep the unsharded tensors.
  if (FSDPParamGroup* g = state->group()) {
    std::unordered_map<const c10::TensorImpl*, const at::Tensor*> shard_of;
    for (const auto& p : g->params()) shard_of[p->unsharded().unsafeGetTensorImpl()] = &p->sharded();
    for (const auto& m : managed) {
      for (auto& item : detail::ParameterRegistry::of(*m)) {
        if (!item.value().defined()) continue;
        auto it = shard_of.find(item.value().unsafeGetTensorImpl());
        if (it != shard_of.end()) item.value() = *it->second;
      }
    }
    std::lock_guard<std::mutex> lock(index.mu);
    for (const auto& p : g->params()) {
      index.by_sharded[p->sharded().unsafeGetTensorImpl()] = {state, p.get()};
      index.by_unsharded[p->unsharded().unsafeGetTensorImpl()] = {state, p.get()};
    }
  }
  detail::register_state(modules, state);
  return make_fsdp_module(state);
}

FSDPModule fully_shard(const std::shared_ptr<torch::nn::Module>& module, const FullyShardOptions& options) {
  return fully_shard(std::vector<std::shared_ptr<torch::nn::Module>>{module}, options);
}

DTensor as_dtensor(const at::Tensor& param) {
  auto& index = detail::param_index();
  std::lock_guard<std::mutex> lock(index.mu);
  const auto* entry = index.find_any(param);
  auto state = entry ? entry->state.lock() : nullptr;
  TORCH_CHECK(state && state->group(), "fsdp::as_dtensor: this tensor is not a parameter sharded by fully_shard");
  return DTensor::from_local(entry->param->sharded(), state->group()->mesh(), {Shard(0)},
                             entry->param->global_shape());
}

bool is_sharded_parameter(const at::Tensor& param) {
  auto& index = detail::param_index();
  std::lock_guard<std::mutex> lock(index.mu);
  return index.find_sharded(param) != nullptr;
}

// ------------------------------------------------------------------------------ FSDPModule

bool is_fsdp_module(const torch::nn::Module& module) { return detail::find_state(module) != nullptr; }

FSDPModule get_fsdp_module(const torch::nn::Module& module) {
  auto state = detail::find_state(module);
  TORCH_CHECK(state, "fsdp::get_fsdp_module: this ", module.name(), " is not an FSDP module; apply fsdp::fully_shard to it first");
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

namespace {
std::vector<std::weak_ptr<FSDPState>> weak_states(const std::vector<FSDPModule>& modules, const char* setter) {
  std::vector<std::weak_ptr<FSDPState>> out;
  for (const auto& m : modules) {
    TORCH_CHECK(m.valid(), "fsdp::FSDPModule::", setter, ": got an invalid FSDPModule handle");
    out.push_back(detail::find_state(*m.module()));
  }
  return out;
}
}  // namespace

void FSDPModule::set_modules_to_forward_prefetch(const std::vector<FSDPModule>& modules) {
  TORCH_CHECK(state_, "fsdp::FSDPModule: invalid handle");
  state_->forward_prefetch = weak_states(modules, "set_modules_to_forward_prefetch");
}

void FSDPModule::set_modules_to_backward_prefetch(const std::vector<FSDPModule>& modules) {
  TORCH_CHECK(state_, "fsdp::FSDPModule: invalid handle");
  state_->backward_prefetch = weak_states(modules, "set_modules_to_backward_prefetch");
}

void FSDPModule::set_requires_gradient_sync(bool requires_gradient_sync, bool recurse) {
  for (FSDPState* st : states(recurse)) {
    if (st->group()) st->group()->reduce_grads = requires_gradient_sync;
  }
}

void FSDPModule::set_reshard_after_forward(bool reshard_after_forward, bool recurse) {
  for (FSDPState* st : states(recurse)) st->set_reshard_after_forward(reshard_after_forward);
}

void FSDPModule::set_reshard_after_backward(bool reshard_after_backward, bool recurse) {
  for (FSDPState* st : states(recurse)) {
    if (st->group()) st->group()->reshard_after_backward = reshard_after_backward;
  }
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
