// fully_shard(): argument checks, which modules and parameters a call manages, how its group
// reshards after forward, and swapping the registered parameters for shards, recorded in the
// composable registry (behind is_sharded_parameter and as_dtensor).
#include <fsdp/fully_shard.h>

#include "src/fsdp/mesh_info.h"
#include "src/fsdp/policies.h"
#include "src/composable/registry.h"
#include "src/fsdp/state.h"
#include "src/tensor/default_mesh.h"

#include <fsdp/distributed.h>
#include <fsdp/dtensor_parameter.h>

#include <c10/util/Exception.h>
#include <torch/nn/modules/container/moduledict.h>
#include <torch/nn/modules/container/modulelist.h>

#include <typeinfo>
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

using composable::Api;
using composable::ParamRole;

// The registry's record of a tensor that fully_shard manages in `role`, or nullopt.
std::optional<composable::ManagedParameter> fsdp_parameter(const at::Tensor& t, std::optional<ParamRole> role) {
  auto managed = composable::managed_parameter(t);
  if (!managed || managed->api != Api::kFullyShard || (role && managed->role != *role)) return std::nullopt;
  return managed;
}

// The record of a sharded parameter (its shard or its unsharded member) in its group.
std::pair<std::shared_ptr<FSDPState>, const FSDPParam*> fsdp_param_record(const at::Tensor& t) {
  auto managed = fsdp_parameter(t, std::nullopt);
  if (!managed) return {nullptr, nullptr};
  auto state = std::static_pointer_cast<FSDPState>(managed->state);
  if (!state->group()) return {nullptr, nullptr};
  return {state, state->group()->params().at(managed->slot).get()};
}

// Post-order (children first), not descending into modules another call already manages
// (fully_shard or replicate).
void collect_managed(const std::shared_ptr<torch::nn::Module>& m, bool top,
                     std::vector<std::shared_ptr<torch::nn::Module>>& out, std::set<const torch::nn::Module*>& seen) {
  if (!top && composable::managed_module(*m)) return;
  if (!seen.insert(m.get()).second) return;
  for (const auto& child : m->children()) collect_managed(child, false, out, seen);
  out.push_back(m);
}

// reshard_after_forward -> the group a parameter group's backward all-gather runs over, or null
// to keep the parameters unsharded from forward to backward. The one place the option is
// interpreted. Unset means true here; lazy initialisation turns it off for a root. An int k
// with 1 < k < shard group size creates the group of this rank's k consecutive shard ranks
// (collective over them). Under HSDP k stays within this rank's shard group (its replica): each
// replica's post-forward groups are its own k-rank blocks. (PyTorch's FSDP2 instead views the
// whole 2-D mesh as rows of k ranks; for k dividing the shard size both give the same blocks.)
std::shared_ptr<ProcessGroup> post_forward_group(const ReshardAfterForward& option,
                                                 const std::shared_ptr<ProcessGroup>& shard_group) {
  if (option.is_unset()) return shard_group;
  if (option.is_bool()) return option.as_bool() ? shard_group : nullptr;
  const int64_t world = shard_group->size();
  const int64_t k = option.group_size();
  TORCH_CHECK(k >= 1 && k <= world && world % k == 0, "fully_shard: reshard_after_forward=", k,
              " must divide the shard group size ", world, "; pass a factor of ", world, ", true or false");
  if (k == world) return shard_group;
  if (k == 1) return nullptr;
  const auto& members = shard_group->global_ranks();
  const int64_t block = shard_group->rank() / k;
  return new_group(std::vector<int>(members.begin() + block * k, members.begin() + (block + 1) * k));
}

// Prefix of every module under `modules` within the first of them (for FQNs).
std::unordered_map<const torch::nn::Module*, std::string> module_prefixes(
    const std::vector<std::shared_ptr<torch::nn::Module>>& modules) {
  std::unordered_map<const torch::nn::Module*, std::string> prefix;
  for (const auto& m : modules) {
    for (const auto& item : m->named_modules("", true)) prefix.emplace(item.value().get(), item.key());
  }
  return prefix;
}

using TensorSet = std::set<const c10::TensorImpl*>;

// The tensors of FullyShardOptions::ignored_params, by identity.
TensorSet ignored_set(const std::vector<at::Tensor>& ignored) {
  TensorSet out;
  for (size_t i = 0; i < ignored.size(); ++i) {
    TORCH_CHECK(ignored[i].defined(), "fully_shard: ignored_params[", i,
                "] is an undefined tensor; pass the "
                "module's parameters (module->parameters()) to leave out of sharding");
    out.insert(ignored[i].unsafeGetTensorImpl());
  }
  return out;
}

// The managed modules' direct parameters, in post-order, each once (tied parameters appear in
// several modules), as records of their sharding over `mesh`; the ignored ones stay out.
FSDPParams collect_params(const std::vector<std::shared_ptr<torch::nn::Module>>& managed,
                          const std::unordered_map<const torch::nn::Module*, std::string>& prefix, const MeshInfo& mesh,
                          const TensorSet& ignored) {
  const int64_t world = mesh.shard_size();
  const int64_t rank = mesh.shard_rank();
  FSDPParams params;
  TensorSet seen = ignored;
  for (const auto& m : managed) {
    for (const auto& item : ParameterRegistry::of(*m)) {
      const at::Tensor& t = item.value();
      if (!t.defined() || !seen.insert(t.unsafeGetTensorImpl()).second) continue;
      const std::string& pre = prefix.at(m.get());
      const std::string fqn = pre.empty() ? item.key() : pre + "." + item.key();
      const auto owner = composable::managed_parameter(t);
      const bool fsdp_owner = owner && owner->api == Api::kFullyShard;
      TORCH_CHECK(!(fsdp_owner && owner->role == ParamRole::kUnsharded), "fully_shard: parameter '", fqn,
                  "' is shared with a parameter already managed by another FSDP group; shard the modules "
                  "that share it in one call: fully_shard({module_a, module_b})");
      TORCH_CHECK(!(fsdp_owner && owner->role == ParamRole::kSharded), "fully_shard: parameter '", fqn,
                  "' is already a shard of another FSDP group");
      TORCH_CHECK(!owner || owner->api != Api::kReplicate, "fully_shard: parameter '", fqn,
                  "' is reduced by the replicate() of "
                  "an enclosing module; a module is either sharded or replicated, not both");
      params.push_back(std::make_unique<FSDPParam>(fqn, t, world, rank));
    }
  }
  return params;
}

// FSDP2 moves the managed modules' parameters and buffers to the mesh's device before sharding
// (the ignored parameters stay where they are). In place (set_data), as Module::to() does, so
// the modules and the optimizer keep the same tensors.
void move_states_to_device(const std::vector<std::shared_ptr<torch::nn::Module>>& managed, c10::Device device,
                           const TensorSet& ignored) {
  at::NoGradGuard no_grad;
  for (const auto& m : managed) {
    for (auto& t : m->parameters(/*recurse=*/false)) {
      if (t.defined() && t.device() != device && !ignored.count(t.unsafeGetTensorImpl())) t.set_data(t.to(device));
    }
    for (auto& t : m->buffers(/*recurse=*/false)) {
      if (t.defined() && t.device() != device) t.set_data(t.to(device));
    }
  }
}

// Each parameter's shard dim, as the user's shard_placement_fn chooses (the records check it).
// Runs before the group lays out its shard.
void apply_shard_placements(const FSDPParams& params, const ShardPlacementFn& placement_fn) {
  if (!placement_fn) return;
  for (const auto& p : params) {
    const std::optional<Placement> placement = placement_fn(p->fqn(), p->unsharded());
    if (!placement) continue;
    TORCH_CHECK(placement->is_shard(), "fully_shard: shard_placement_fn returned ", placement->str(),
                " for parameter '", p->fqn(),
                "'; FSDP shards every parameter it manages: return Shard(d), or "
                "std::nullopt for Shard(0)");
    p->shard_on(placement->dim());
  }
}

// The registered parameters become the shards; the modules' members keep the unsharded tensors.
void register_shards(const std::vector<std::shared_ptr<torch::nn::Module>>& managed,
                     const std::shared_ptr<FSDPState>& state) {
  const FSDPParamGroup& group = *state->group();
  std::unordered_map<const c10::TensorImpl*, const at::Tensor*> shard_of;
  for (const auto& p : group.params()) shard_of[p->unsharded().unsafeGetTensorImpl()] = &p->sharded();
  for (const auto& m : managed) {
    for (auto& item : ParameterRegistry::of(*m)) {
      if (!item.value().defined()) continue;
      auto it = shard_of.find(item.value().unsafeGetTensorImpl());
      if (it != shard_of.end()) item.value() = *it->second;
    }
  }
  std::vector<composable::ParameterRecord> records;
  for (size_t i = 0; i < group.params().size(); ++i) {
    const auto& p = group.params()[i];
    records.push_back({p->sharded(), ParamRole::kSharded, static_cast<int64_t>(i)});
    records.push_back({p->unsharded(), ParamRole::kUnsharded, static_cast<int64_t>(i)});
  }
  composable::register_parameters(state, records);
}

// A 1-D mesh (FSDP), a 2-D mesh with dim names (HSDP: replicate over dim 0, shard over dim 1),
// or a named mesh with dp_mesh_dims (FSDP over the dp dim, the others the model's).
MeshInfo checked_mesh(const FullyShardOptions& options) {
  if (options.dp_mesh_dims()) {
    TORCH_CHECK(options.mesh().valid(),
                "fully_shard: dp_mesh_dims names dims of FullyShardOptions::mesh, which is "
                "not set; pass the whole mesh the parameters are DTensors on (e.g. the (dp, tp) mesh)");
    TORCH_CHECK(!options.reshard_after_forward().is_int(), "fully_shard: an int reshard_after_forward (",
                options.reshard_after_forward().group_size(),
                ") is not supported with dp_mesh_dims; pass true or "
                "false");
  }
  return mesh_info_of(options.mesh().valid() ? options.mesh() : default_world_mesh(), options.dp_mesh_dims());
}

// With dp_mesh_dims every parameter is already a DTensor on the whole mesh (PyTorch requires
// the same), copied over the dp dim: FSDP shards its local piece there and keeps its layout on
// the model dims for as_dtensor.
void attach_model_layouts(const FSDPParams& params, const MeshInfo& mesh) {
  if (!mesh.has_model_dims()) return;
  const std::string dp_name = mesh.mesh.dim_names()[mesh.shard_dim];
  for (const auto& p : params) {
    const std::optional<DTensor> d = dtensor_parameter(p->unsharded());
    TORCH_CHECK(d.has_value(),
                "fully_shard: when dp_mesh_dims is provided, all parameters must be DTensors on the "
                "full SPMD mesh, but '",
                p->fqn(),
                "' is a plain tensor; split or register it first "
                "(a plan such as fsdp::models::parallelize, or fsdp::register_dtensor_parameter with Replicate() on "
                "every dim)");
    TORCH_CHECK(d->device_mesh() == mesh.mesh, "fully_shard: parameter '", p->fqn(), "' is a DTensor on the mesh ",
                d->device_mesh().str(), ", not on FullyShardOptions::mesh ", mesh.mesh.str(),
                "; with dp_mesh_dims "
                "both must be the same mesh object");
    const std::vector<Placement> placements = d->placements();
    TORCH_CHECK(placements[mesh.shard_dim].is_replicate(), "fully_shard: parameter '", p->fqn(), "' is ",
                placements[mesh.shard_dim].str(), " on the data-parallel mesh dim '", dp_name,
                "'; with "
                "dp_mesh_dims it must be Replicate() there (FSDP does the sharding over dp)");
    p->set_model_layout(placements, d->sizes());
  }
}

}  // namespace
}  // namespace detail

FSDPModule fully_shard(const std::vector<std::shared_ptr<torch::nn::Module>>& modules,
                       const FullyShardOptions& options) {
  TORCH_CHECK(!modules.empty(), "fully_shard: the module list is empty");
  for (const auto& m : modules) {
    TORCH_CHECK(m != nullptr, "fully_shard: got a null module");
    const auto managed_by = composable::managed_module(*m);
    TORCH_CHECK(!managed_by || managed_by->api != composable::Api::kFullyShard,
                "fully_shard: fully_shard was "
                "already applied to this ",
                m->name(), "; apply it once per module, bottom-up");
    TORCH_CHECK(!managed_by || managed_by->api != composable::Api::kReplicate, "fully_shard: this ", m->name(),
                " is managed by replicate(); a module is either sharded (fully_shard) or replicated (replicate), "
                "not both");
    // As in PyTorch: a container without a forward is never called, so its hooks would never run.
    TORCH_CHECK(typeid(*m) != typeid(torch::nn::ModuleListImpl) && typeid(*m) != typeid(torch::nn::ModuleDictImpl),
                "fully_shard does not support a ", m->name(),
                ", which has no forward (nothing would run its "
                "hooks). Apply fully_shard to each of its elements, or to the module that owns it, and call the "
                "elements through fsdp::call (see fsdp/call.h)");
  }
  const detail::MeshInfo mesh_info = detail::checked_mesh(options);
  const DeviceMesh& mesh = mesh_info.mesh;
  detail::check_mp_policy(options.mp_policy(), mesh);
  detail::check_offload_policy(options.offload_policy(), mesh);
  detail::check_quantized_comm(options.quantized_weights(), options.quantized_gradients(), mesh_info);
  std::vector<std::shared_ptr<torch::nn::Module>> managed;
  std::set<const torch::nn::Module*> seen;
  for (const auto& m : modules) detail::collect_managed(m, true, managed, seen);
  const auto prefix = detail::module_prefixes(modules);

  const detail::TensorSet ignored = detail::ignored_set(options.ignored_params());
  if (!mesh.device().is_cpu()) detail::move_states_to_device(managed, mesh.device(), ignored);
  detail::FSDPParams params = detail::collect_params(managed, prefix, mesh_info, ignored);
  detail::attach_model_layouts(params, mesh_info);
  detail::apply_shard_placements(params, options.shard_placement_fn());
  std::unique_ptr<detail::FSDPParamGroup> group;
  if (!params.empty()) {
    auto post_forward = detail::post_forward_group(options.reshard_after_forward(), mesh_info.shard_group());
    group = std::make_unique<detail::FSDPParamGroup>(std::move(params), mesh_info, prefix.at(modules.front().get()),
                                                     std::move(post_forward), options.mp_policy(),
                                                     options.offload_policy());
    group->set_quantized_weights(options.quantized_weights());
    group->set_quantized_gradients(options.quantized_gradients());
  }
  auto state = std::make_shared<detail::FSDPState>(modules, std::move(group),
                                                   options.reshard_after_forward().is_unset(), options.mp_policy());
  composable::register_modules(composable::Api::kFullyShard, modules, state);
  if (state->group()) detail::register_shards(managed, state);
  return make_fsdp_module(state);
}

FSDPModule fully_shard(const std::shared_ptr<torch::nn::Module>& module, const FullyShardOptions& options) {
  return fully_shard(std::vector<std::shared_ptr<torch::nn::Module>>{module}, options);
}

DTensor as_dtensor(const at::Tensor& param) {
  const auto [state, record] = detail::fsdp_param_record(param);
  TORCH_CHECK(record, "fsdp::as_dtensor: this tensor is not a parameter sharded by fully_shard");
  const detail::MeshInfo& mesh = state->group()->mesh_info();
  const detail::FSDPParam& p = *record;
  if (p.has_model_layout()) {
    return DTensor::from_local(p.sharded(), mesh.mesh, mesh.placements(p.shard_dim(), p.model_placements()),
                               p.model_global_shape());
  }
  return DTensor::from_local(p.sharded(), mesh.mesh, mesh.placements(p.shard_dim()), p.global_shape());
}

namespace detail {

MeshInfo mesh_info_of_parameter(const at::Tensor& param) {
  const auto [state, record] = fsdp_param_record(param);
  TORCH_CHECK(record, "fsdp: this tensor is not a parameter sharded by fully_shard");
  return state->group()->mesh_info();
}

}  // namespace detail

bool is_sharded_parameter(const at::Tensor& param) {
  return detail::fsdp_parameter(param, composable::ParamRole::kSharded).has_value();
}

}  // namespace fsdp
