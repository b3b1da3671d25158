#include <fsdp/clip_grad.h>

#include "src/fsdp/mesh_info.h"

#include <fsdp/fully_shard.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cmath>

namespace fsdp {

double clip_grad_norm_(const std::vector<at::Tensor>& parameters, double max_norm, double norm_type) {
  TORCH_CHECK(norm_type > 0, "clip_grad_norm_: norm_type must be positive or infinity, got ", norm_type);
  const bool inf = std::isinf(norm_type);
  std::shared_ptr<ProcessGroup> group;
  bool any_plain = false;
  std::vector<at::Tensor> grads;
  for (const auto& p : parameters) {
    if (is_sharded_parameter(p)) {
      // Under HSDP the replicas hold the same gradients: the norm sums one replica's shards.
      auto g = detail::mesh_info_of(as_dtensor(p).device_mesh()).shard_group();
      TORCH_CHECK(!group || group.get() == g.get(), "clip_grad_norm_: the parameters are sharded over different "
                  "process groups; clip each group's parameters separately");
      group = g;
    } else {
      any_plain = true;
    }
    if (p.grad().defined()) grads.push_back(p.grad());
  }
  TORCH_CHECK(!(group && any_plain), "clip_grad_norm_: some parameters are sharded by fully_shard and some are not; "
              "their norms cannot be combined correctly");
  // This rank's part: sum of |g|^p over its shards (max |g| for the inf-norm), in double.
  double local = 0.0;
  for (const auto& g : grads) {
    if (g.numel() == 0) continue;
    if (inf) {
      local = std::max(local, g.abs().max().item<double>());
    } else {
      local += std::pow(at::norm(g, norm_type).item<double>(), norm_type);
    }
  }
  double total = local;
  if (group) {
    at::Tensor t = at::full({1}, local, at::kDouble);
    group->all_reduce(t, inf ? ReduceOp::kMax : ReduceOp::kSum)->wait();
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
