// clip_grad_norm_ over sharded gradients: each rank's part of the norm, then the all-reduces
// that combine the parts into the norm of the whole gradients.
#include <fsdp/clip_grad.h>

#include "src/fsdp/mesh_info.h"

#include <fsdp/dtensor_parameter.h>
#include <fsdp/fully_shard.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>

namespace fsdp {
namespace {

// How the parameters' parts are combined.
struct NormPlan {
  // FSDP (and HSDP): one all-reduce over the shard group (the replicas hold the same gradients).
  std::shared_ptr<ProcessGroup> shard_group;
  // Parameters that are DTensors on a mesh with model dims (FSDP over tensor parallelism, or
  // tensor parallelism alone): all-reduces over every dim of this mesh, each gradient element
  // counted on one rank only (see counts_here).
  DeviceMesh mesh;
  bool any_plain = false;
};

// Whether this rank's piece of `d` takes part in the sum: a piece copied over a mesh dim
// (Replicate()) is counted by that dim's rank 0 only, so that summing over the whole mesh
// counts every element once.
bool counts_here(const DTensor& d) {
  const std::vector<Placement> placements = d.placements();
  for (size_t i = 0; i < placements.size(); ++i) {
    if (placements[i].is_replicate() && d.device_mesh().get_local_rank(static_cast<int64_t>(i)) != 0) return false;
  }
  return true;
}

// The DTensor of a parameter on a mesh with model dims, if it is one: sharded by fully_shard
// with dp_mesh_dims, or split (or registered) by tensor parallelism and not sharded.
std::optional<DTensor> model_dtensor(const at::Tensor& p) {
  if (is_sharded_parameter(p)) {
    if (!detail::mesh_info_of_parameter(p).has_model_dims()) return std::nullopt;
    return as_dtensor(p);
  }
  return dtensor_parameter(p);
}

// This rank's part of the norm: the sum of |g|^p over its pieces (max |g| for the inf-norm), in
// double. Host gradients are read one at a time; GPU ones are combined on their device and read
// once, since every read of a GPU value waits for the stream.
double local_norm_part(const std::vector<at::Tensor>& grads, double norm_type, bool inf) {
  double local = 0.0;
  std::vector<at::Tensor> on_device;
  for (const auto& g : grads) {
    if (g.numel() == 0) continue;
    if (!g.device().is_cpu()) {
      on_device.push_back(inf ? g.abs().max().to(at::kDouble) : at::norm(g, norm_type).to(at::kDouble).pow(norm_type));
    } else if (inf) {
      local = std::max(local, g.abs().max().item<double>());
    } else {
      local += std::pow(at::norm(g, norm_type).item<double>(), norm_type);
    }
  }
  if (on_device.empty()) return local;
  std::vector<std::vector<at::Tensor>> per_device;
  for (auto& v : on_device) {
    auto same = [&](const std::vector<at::Tensor>& b) { return b.front().device() == v.device(); };
    auto it = std::find_if(per_device.begin(), per_device.end(), same);
    if (it == per_device.end()) per_device.push_back({v});
    else it->push_back(v);
  }
  for (const auto& values : per_device) {
    const at::Tensor stacked = at::stack(values);
    const double part = (inf ? stacked.max() : stacked.sum()).item<double>();
    local = inf ? std::max(local, part) : local + part;
  }
  return local;
}

}  // namespace

double clip_grad_norm_(const std::vector<at::Tensor>& parameters, double max_norm, double norm_type) {
  TORCH_CHECK(norm_type > 0, "clip_grad_norm_: norm_type must be positive or infinity, got ", norm_type);
  const bool inf = std::isinf(norm_type);
  NormPlan plan;
  std::vector<at::Tensor> grads;    // every gradient, to scale
  std::vector<at::Tensor> counted;  // the ones this rank's part of the norm sums
  for (const auto& p : parameters) {
    bool counts = true;
    if (std::optional<DTensor> d = model_dtensor(p)) {
      TORCH_CHECK(!plan.mesh.valid() || plan.mesh == d->device_mesh(),
                  "clip_grad_norm_: the parameters are "
                  "DTensors on different meshes; clip each mesh's parameters separately");
      plan.mesh = d->device_mesh();
      counts = counts_here(*d);
    } else if (is_sharded_parameter(p)) {
      // Under HSDP the replicas hold the same gradients: the norm sums one replica's shards.
      auto g = detail::mesh_info_of_parameter(p).shard_group();
      TORCH_CHECK(!plan.shard_group || plan.shard_group.get() == g.get(),
                  "clip_grad_norm_: the parameters are "
                  "sharded over different process groups; clip each group's parameters separately");
      plan.shard_group = g;
    } else {
      plan.any_plain = true;
    }
    if (!p.grad().defined()) continue;
    grads.push_back(p.grad());
    if (counts || inf) counted.push_back(p.grad());  // a max may count a copy twice
  }
  const int kinds = (plan.shard_group ? 1 : 0) + (plan.mesh.valid() ? 1 : 0) + (plan.any_plain ? 1 : 0);
  TORCH_CHECK(kinds <= 1, "clip_grad_norm_: the parameters mix ",
              plan.shard_group ? "parameters sharded by fully_shard over a data-parallel mesh, " : "",
              plan.mesh.valid() ? "DTensor parameters on a mesh with model dims, " : "",
              plan.any_plain ? "plain parameters, " : "",
              "whose norms cannot be combined correctly; clip each kind "
              "separately");
  const double local = local_norm_part(counted, norm_type, inf);
  double total = local;
  std::vector<std::shared_ptr<ProcessGroup>> groups;
  if (plan.shard_group) groups.push_back(plan.shard_group);
  for (int64_t d = 0; plan.mesh.valid() && d < plan.mesh.ndim(); ++d) groups.push_back(plan.mesh.get_group(d));
  if (!groups.empty()) {
    at::Tensor t = at::full({1}, local, at::kDouble);
    for (const auto& group : groups) {
      // A device backend (NCCL) reduces GPU tensors: the value goes to this rank's current GPU.
      if (group->device_type() != t.device().type()) t = t.to(at::Device(group->device_type()));
      group->all_reduce(t, inf ? ReduceOp::kMax : ReduceOp::kSum)->wait();
    }
    total = t.item<double>();
  }
  if (!inf) total = std::pow(total, 1.0 / norm_type);
  const double clip_coef = max_norm / (total + 1e-6);
  if (clip_coef < 1.0) {
    at::NoGradGuard no_grad;
    for (auto& g : grads) g.mul_(clip_coef);
  }
  return total;
}

}  // namespace fsdp
