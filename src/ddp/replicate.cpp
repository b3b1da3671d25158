// replicate(): argument checks, which parameters a call reduces, making the replicas identical
// (broadcast from the mesh's first rank), recording module and parameters in the composable
// registry, and the user's controls (ReplicatedModule, NoSyncGuard).
#include <fsdp/replicate.h>

#include "src/composable/registry.h"
#include "src/ddp/reducer.h"
#include "src/tensor/default_mesh.h"

#include <fsdp/distributed.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <set>

namespace fsdp {
namespace detail {
namespace {

using composable::Api;

// Whether fully_shard manages `module`: its parameters are reduced by their own groups.
bool is_sharded_module(const torch::nn::Module& module) {
  auto managed = composable::managed_module(module);
  return managed && managed->api == Api::kFullyShard;
}

// replicate()'s reducer of `module`, or null.
std::shared_ptr<Reducer> reducer_of(const torch::nn::Module& module) {
  return std::static_pointer_cast<Reducer>(composable::state_of(module, Api::kReplicate));
}

DeviceMesh checked_mesh(const ReplicateOptions& options) {
  DeviceMesh mesh = options.mesh().valid() ? options.mesh() : default_world_mesh();
  TORCH_CHECK(mesh.ndim() == 1, "fsdp::replicate: got a ", mesh.ndim(),
              "-D mesh; replicate() takes a 1-D mesh (for "
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
  if (!top && is_sharded_module(*m)) return;
  for (const auto& item : m->named_parameters(/*recurse=*/false)) {
    const at::Tensor& t = item.value();
    const std::string fqn = prefix.empty() ? item.key() : prefix + "." + item.key();
    const auto owner = composable::managed_parameter(t);
    TORCH_CHECK(!(owner && owner->api == Api::kFullyShard && owner->role == composable::ParamRole::kSharded),
                "fsdp::replicate: parameter '", fqn,
                "' is sharded by the fully_shard() "
                "of an enclosing module; a module is either sharded or replicated: apply replicate() to a module "
                "outside that one, or fully_shard() it instead");
    TORCH_CHECK(!(owner && owner->api == Api::kReplicate), "fsdp::replicate: parameter '", fqn,
                "' is already reduced by "
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
  if (!top && is_sharded_module(*m)) return out;
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
  TORCH_CHECK(!detail::is_sharded_module(*module), "fsdp::replicate: this ", module->name(),
              " is managed by fully_shard(); a "
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
  composable::register_modules(composable::Api::kReplicate, {module}, reducer);
  std::vector<composable::ParameterRecord> records;
  for (size_t i = 0; i < params.size(); ++i) {
    records.push_back({params[i].second, composable::ParamRole::kReplicated, static_cast<int64_t>(i)});
  }
  composable::register_parameters(reducer, records);
  return make_replicated_module(reducer);
}

bool is_replicated(const torch::nn::Module& module) { return detail::reducer_of(module) != nullptr; }

bool is_replicated_parameter(const at::Tensor& param) {
  auto owner = composable::managed_parameter(param);
  return owner && owner->api == composable::Api::kReplicate;
}

ReplicatedModule get_replicated_module(const torch::nn::Module& module) {
  std::shared_ptr<detail::Reducer> reducer = detail::reducer_of(module);
  TORCH_CHECK(reducer, "fsdp::get_replicated_module: this ", module.name(),
              " is not replicated; call "
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
