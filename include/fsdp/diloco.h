// layer: optim (what may include what: docs/architecture.md)
/// \file
/// fsdp/diloco.h — DiLoCo: replicas that train apart for H inner steps and meet in an outer step.
///
/// For HSDP across slow links: each host's replica is fully_shard over the host's own ranks (the
/// "shard" dim of a 2-D mesh) and steps its own inner optimizer on its own data, with no
/// traffic between hosts. Every `inner_steps` steps the outer step averages the replicas'
/// pseudo-gradient, Δ = (parameters at the last outer step) - (parameters now), over the
/// "replicate" dim, and an outer SGD with Nesterov momentum moves the last outer step's
/// parameters along it (DiLoCo, Douillard et al. 2023, arXiv 2311.08105; its defaults: H = 500,
/// outer lr 0.7, momentum 0.9, inner AdamW). Traffic between hosts: one all-reduce of the model
/// every H steps instead of every step.
///
/// \code{.cpp}
///   auto mesh = fsdp::init_device_mesh("cpu", {hosts, ranks_per_host}, {"replicate", "shard"});
///   for (auto& block : model->blocks) fsdp::fully_shard(block, fsdp::FullyShardOptions().mesh(mesh["shard"]));
///   fsdp::fully_shard(model, fsdp::FullyShardOptions().mesh(mesh["shard"]));
///   torch::optim::AdamW inner(model->parameters(), torch::optim::AdamWOptions(4e-4));
///   fsdp::DiLoCo diloco(model->parameters(), fsdp::DiLoCoOptions().process_group(mesh.get_group("replicate")));
///   for (...) {
///     inner.zero_grad();
///     fsdp::call(model, x) ... .backward();   // reduce-scatters within the host only
///     inner.step();
///     diloco.step();                          // every H-th call: the outer step (collective)
///   }
/// \endcode
///
/// The parameters are this rank's shards (fully_shard's parameters()); a rank's shard is the same
/// piece of the model on every replica, so the replicas' pieces are averaged piece by piece. Start
/// every replica from the same values (fsdp::sync_module_states, or the same seed): DiLoCo keeps
/// them equal at each outer step, not before the first.
///
/// Streaming DiLoCo (Douillard et al. 2025, arXiv 2501.18512), in part: with `fragments` = P > 1
/// the parameters are cut into P consecutive fragments, and fragment p takes its outer step at
/// inner steps t with t mod H = floor(p H / P) (its first after fewer than H steps), so a sync
/// moves 1/P of the model and the link's peak use drops by P. Its overlap of a fragment's
/// all-reduce with the following inner steps is not implemented: each outer step blocks for its
/// collective. `quantized` encodes the pseudo-gradient on the link (fsdp/quantized_comm.h;
/// int8, fp8 or bf16; no error feedback: the outer momentum accumulates the outer steps).
///
/// Not saved by checkpoints: the outer state (the parameters at the last outer step and the
/// momentum, two fp32 copies of this rank's shards) lives here only. Not thread-safe.
#pragma once

#include <fsdp/process_group.h>
#include <fsdp/quantized_comm.h>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

namespace fsdp {

/// The options of DiLoCo, with arXiv 2311.08105's settings as defaults.
struct DiLoCoOptions {
  /// H: inner steps between outer steps (>= 1).
  TORCH_ARG(int64_t, inner_steps) = 500;
  /// The outer SGD's learning rate (> 0).
  TORCH_ARG(double, outer_lr) = 0.7;
  /// The outer SGD's momentum, in [0, 1).
  TORCH_ARG(double, outer_momentum) = 0.9;
  /// Nesterov momentum (the paper's); false: heavy-ball.
  TORCH_ARG(bool, nesterov) = true;
  /// P: fragments synchronized in turn (Streaming DiLoCo), 1 to inner_steps.
  TORCH_ARG(int64_t, fragments) = 1;
  /// The pseudo-gradient's encoding on the link. Default: none (fp32).
  TORCH_ARG(std::optional<QuantizedComm>, quantized) = std::nullopt;
  /// The replicas: the ranks holding the same shard on other hosts (a 2-D mesh's "replicate"
  /// group). Null: no communication (one replica; the outer step still applies).
  TORCH_ARG(std::shared_ptr<ProcessGroup>, process_group) = nullptr;
};

/// The outer loop of DiLoCo over an inner optimizer's parameters (see the file comment).
class DiLoCo {
 public:
  /// Keeps `params` (tensors shared with the caller, e.g. model->parameters()) and copies them as
  /// the first outer step's starting point. Throws c10::Error naming the option when one is out
  /// of range, or when a parameter is not a floating-point tensor. Not collective; allocates two
  /// fp32 copies of the parameters.
  DiLoCo(std::vector<at::Tensor> params, DiLoCoOptions options = DiLoCoOptions());
  DiLoCo(const DiLoCo&) = delete;
  DiLoCo& operator=(const DiLoCo&) = delete;

  /// Counts one inner step; call it after each inner optimizer step. When a fragment's turn has
  /// come, takes its outer step: averages its pseudo-gradient over the process group (collective:
  /// every replica calls step() equally often; blocks until the average arrived) and writes the
  /// new values into the parameters in place. Returns the number of fragments that took an outer
  /// step in this call (0 on most calls).
  int64_t step();

  /// Inner steps counted so far.
  int64_t inner_step_count() const { return inner_steps_; }
  /// Outer steps taken so far, each fragment's counted as one.
  int64_t outer_step_count() const { return outer_steps_; }
  /// The options it was made with.
  const DiLoCoOptions& options() const { return options_; }

 private:
  struct Fragment {
    std::vector<size_t> params;  // indices into params_
    int64_t offset = 0;          // its outer steps come at inner steps t with t mod H == offset
    int64_t numel = 0;
  };
  void outer_step(const Fragment& fragment);

  std::vector<at::Tensor> params_;
  std::vector<at::Tensor> anchor_;    // fp32: the parameters after the last outer step
  std::vector<at::Tensor> momentum_;  // fp32: the outer SGD's buffer
  std::vector<Fragment> fragments_;
  DiLoCoOptions options_;
  int64_t inner_steps_ = 0;
  int64_t outer_steps_ = 0;
};

}  // namespace fsdp
