// replicate(): argument checks, which parameters a call reduces, making the replicas identical
// (broadcast from the mesh's first rank), the module -> reducer registry, and the user's
// controls (ReplicatedModule, NoSyncGuard).
#include <fsdp/replicate.h>

#include "src/ddp/reducer.h"
#include "src/tensor/default_mesh.h"

#include <fsdp/distributed.h>
#include <fsdp/fsdp_module.h>
#include <fsdp/fully_shard.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <mutex>
#include <set>
#include <unordered_map>

namespace fsdp {
namespace detail {
namespace {

// Module -> reducer (keeps the reducer alive as long as the module), and parameter -> reducer.
struct Registry {
  std::mutex mu;
  struct Entry {
    std::weak_ptr<torch::nn::Module> module;
    std::shared_ptr<Reducer> reducer;
  };
  std::unordered_map<const torch::nn::Module*, Entry> by_module;
  std::unordered_map<const c10::TensorImpl*, std::weak_ptr<Reducer>> by_param;

  // Entries of modules that no longer exist (their addresses may be reused). Returns the dead
  // reducers, to be released after the lock.
  std::vector<std::shared_ptr<Reducer>> drop_expired() {
    std::vector<std::shared_ptr<Reducer>> dead;
    for (auto it = by_module.begin(); it != by_module.end();) {
      if (it->second.module.expired()) {
        dead.push_back(std::move(it->second.reducer));
        it = by_module.erase(it);
      } else {
        ++it;
      }
    }
    for (auto it = by_param.begin(); it != by_param.end();) {
      bool dead_reducer = it->second.expired();
      for (const auto& d : dead) dead_reducer = dead_reducer || it->second.lock() == d;
      it = dead_reducer ? by_param.erase(it) : std::next(it);
    }
    return dead;
  }
  std::shared_ptr<Reducer> find(const torch::nn::Module& module) {
    auto it = by_module.find(&module);
    if (it == by_module.end() || it->second.module.lock().get() != &module) return nullptr;
    return it->second.reducer;
  }
};

Registry& registry() {
  static Registry* r = new Registry();  // never destroyed: hooks may run during static teardown
  return *r;
}

DeviceMesh checked_mesh(const ReplicateOptions& options) {
  DeviceMesh mesh = options.mesh().valid() ? options.mesh() : default_world_mesh();
  TORCH_CHECK(mesh.ndim() == 1, "fsdp::replicate: got a ", mesh.ndim(), "-D mesh; replicate() takes a 1-D mesh (for "
              "replicas of a sharded model use fully_shard; to replicate over one dim of a larger mesh pass "
              "mesh[\"<dim name>\"])");
  return mesh;
}

int64_t cap_bytes(double mb, const char* name) {
  TORCH_CHECK(mb > 0, "fsdp::replicate: ", name, " must be positive, got ", mb);
  return std::max<int64_t>(1, static_cast<int64_t>(mb * 1024 * 1024));
}

// The trainable parameters replicate() reduces, by FQN in registration order: those of the
// module's tree outside fully_shard()ed submodules (which reduce their own, as in PyTorch).
// A parameter sharded by the fully_shard of an enclosing module, or already reduced by another
// replicate(), is an error.
void collect_params(const std::shared_ptr<torch::nn::Module>& m, const std::string& prefix, bool top,
                    std::set<const c10::TensorImpl*>& seen, std::vector<std::pair<std::string, at::Tensor>>& out) {
  if (!top && is_fsdp_module(*m)) return;
  for (const auto& item : m->named_parameters(/*recurse=*/false)) {
    const at::Tensor& t = item.value();
    const std::string fqn = prefix.empty() ? item.key() : prefix + "." + item.key();
    TORCH_CHECK(!is_sharded_parameter(t), "fsdp::replicate: parameter '", fqn, "' is sharded by the fully_shard() "
                "of an enclosing module; a module is either sharded or replicated: apply replicate() to a module "
                "outside that one, or fully_shard() it instead");
    TORCH_CHECK(!is_replicated_parameter(t), "fsdp::replicate: parameter '", fqn, "' is already reduced by "
                "another replicate() call (on an enclosing module or a submodule); apply replicate() once, to the "
                "outermost module");
    if (!t.defined() || !t.requires_grad() || !seen.insert(t.unsafeGetTensorImpl()).second) continue;
    out.emplace_back(fqn, t);
  }
  for (const auto& child : m->named_children()) {
    collect_params(child.value(), prefix.empty() ? child.key() : prefix + "." + child.key(), false, seen, out);
  }
}

// Rank 0's values in place, through the tensors' data (no autograd version bump).
void broadcast_in_place(const std::vector<at::Tensor>& tensors, ProcessGroup& group) {
  if (group.size() == 1) return;
  std::vector<std::pair<at::Tensor, at::Tensor>> staged;  // (target, contiguous copy) pairs
  std::vector<WorkHandle> works;
  for (const at::Tensor& t : tensors) {
    if (!t.defined() || t.numel() == 0) continue;
    at::Tensor data = t.detach();
    if (!data.is_contiguous()) {
      staged.emplace_back(data, data.contiguous());
      data = staged.back().second;
    }
    works.push_back(group.broadcast(data, 0));
  }
  for (auto& w : works) w->wait();
  at::NoGradGuard no_grad;
  for (auto& s : staged) s.first.copy_(s.second);
}

// Every parameter and buffer outside fully_shard()ed submodules (those are sharded, not copies).
std::vector<at::Tensor> module_states(const std::shared_ptr<torch::nn::Module>& m, bool top) {
  std::vector<at::Tensor> out;
  if (!top && is_fsdp_module(*m)) return out;
  for (const auto& p : m->parameters(/*recurse=*/false)) out.push_back(p);
  for (const auto& b : m->buffers(/*recurse=*/false)) out.push_back(b);
  for (const auto& child : m->children()) {
    for (auto& t : module_states(child, false)) out.push_back(std::move(t));
  }
  return out;
}

}  // namespace
}  // namespace detail

ReplicatedModule make_replicated_module(std::shared_ptr<detail::Reducer> reducer) {
  return ReplicatedModule(std::move(reducer));
}

ReplicatedModule replicate(const std::shared_ptr<torch::nn::Module>& module, const ReplicateOptions& options) {
  TORCH_CHECK(module != nullptr, "fsdp::replicate: got a null module");
  TORCH_CHECK(!is_fsdp_module(*module), "fsdp::replicate: this ", module->name(), " is managed by fully_shard(); a "
              "module is either sharded (fully_shard) or replicated (replicate), not both");
  TORCH_CHECK(!is_replicated(*module), "fsdp::replicate: replicate() was already applied to this ", module->name(),
              "; apply it once");
  const DeviceMesh mesh = detail::checked_mesh(options);
  detail::ReducerOptions reducer_options;
  reducer_options.bucket_cap_bytes = detail::cap_bytes(options.bucket_cap_mb(), "bucket_cap_mb");
  reducer_options.first_bucket_cap_bytes = detail::cap_bytes(options.first_bucket_cap_mb(), "first_bucket_cap_mb");
  reducer_options.find_unused_parameters = options.find_unused_parameters();
  reducer_options.gradient_as_bucket_view = options.gradient_as_bucket_view();

  std::vector<std::pair<std::string, at::Tensor>> params;
  std::set<const c10::TensorImpl*> seen;
  detail::collect_params(module, "", true, seen, params);
  // DDP makes the replicas identical at construction: every rank starts from rank 0's weights.
  detail::broadcast_in_place(detail::module_states(module, true), *mesh.get_group(0));

  auto reducer = std::make_shared<detail::Reducer>(params, mesh, module, reducer_options);
  reducer->install_hooks();
  std::vector<std::shared_ptr<detail::Reducer>> dead;  // released after the lock
  {
    detail::Registry& r = detail::registry();
    std::lock_guard<std::mutex> lock(r.mu);
    dead = r.drop_expired();
    r.by_module[module.get()] = detail::Registry::Entry{module, reducer};
    for (const auto& p : params) r.by_param[p.second.unsafeGetTensorImpl()] = reducer;
  }
  return make_replicated_module(reducer);
}

bool is_replicated(const torch::nn::Module& module) {
  detail::Registry& r = detail::registry();
  std::lock_guard<std::mutex> lock(r.mu);
  return r.find(module) != nullptr;
}

bool is_replicated_parameter(const at::Tensor& param) {
  if (!param.defined()) return false;
  detail::Registry& r = detail::registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.by_param.find(param.unsafeGetTensorImpl());
  if (it == r.by_param.end()) return false;
  auto reducer = it->second.lock();
  return reducer && reducer->module() != nullptr;
}

ReplicatedModule get_replicated_module(const torch::nn::Module& module) {
  std::shared_ptr<detail::Reducer> reducer;
  {
    detail::Registry& r = detail::registry();
    std::lock_guard<std::mutex> lock(r.mu);
    reducer = r.find(module);
  }
  TORCH_CHECK(reducer, "fsdp::get_replicated_module: this ", module.name(), " is not replicated; call "
              "fsdp::replicate() on it first");
  return make_replicated_module(reducer);
}

// ------------------------------------------------------------------------------ the handle

std::shared_ptr<torch::nn::Module> ReplicatedModule::module() const {
  TORCH_CHECK(reducer_, "fsdp::ReplicatedModule: invalid handle; obtain one from fsdp::replicate()");
  return reducer_->module();
}

DeviceMesh ReplicatedModule::mesh() const {
  TORCH_CHECK(reducer_, "fsdp::ReplicatedModule: invalid handle; obtain one from fsdp::replicate()");
  return reducer_->mesh();
}

void ReplicatedModule::set_requires_gradient_sync(bool requires_gradient_sync) {
  TORCH_CHECK(reducer_, "fsdp::ReplicatedModule: invalid handle; obtain one from fsdp::replicate()");
  reducer_->set_requires_gradient_sync(requires_gradient_sync);
}

bool ReplicatedModule::requires_gradient_sync() const {
  TORCH_CHECK(reducer_, "fsdp::ReplicatedModule: invalid handle; obtain one from fsdp::replicate()");
  return reducer_->requires_gradient_sync();
}

NoSyncGuard ReplicatedModule::no_sync() {
  TORCH_CHECK(reducer_, "fsdp::ReplicatedModule: invalid handle; obtain one from fsdp::replicate()");
  NoSyncGuard guard(reducer_, reducer_->requires_gradient_sync());
  reducer_->set_requires_gradient_sync(false);
  return guard;
}

void ReplicatedModule::broadcast_buffers() {
  auto m = module();
  TORCH_CHECK(m, "fsdp::ReplicatedModule::broadcast_buffers: the module no longer exists");
  detail::broadcast_in_place(m->buffers(), *reducer_->mesh().get_group(0));
}

std::vector<BucketInfo> ReplicatedModule::buckets() const {
  TORCH_CHECK(reducer_, "fsdp::ReplicatedModule: invalid handle; obtain one from fsdp::replicate()");
  return reducer_->buckets();
}

NoSyncGuard::NoSyncGuard(std::shared_ptr<detail::Reducer> reducer, bool previous)
    : reducer_(std::move(reducer)), previous_(previous) {}

NoSyncGuard::NoSyncGuard(NoSyncGuard&& other) noexcept
    : reducer_(std::move(other.reducer_)), previous_(other.previous_) {}

NoSyncGuard::~NoSyncGuard() {
  if (reducer_) reducer_->set_requires_gradient_sync(previous_);
}

}  // namespace fsdp
