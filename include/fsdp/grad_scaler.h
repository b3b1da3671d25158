// layer: optim (what may include what: docs/architecture.md)
/// \file
/// fsdp/grad_scaler.h — dynamic loss scaling: torch.amp.GradScaler, with the rank agreement of
/// FSDP's ShardedGradScaler, over sharded (fully_shard) or plain gradients.
///
/// \code{.cpp}
///   fsdp::GradScaler scaler;                                  // GradScalerOptions for the knobs
///   torch::optim::AdamW opt(model->parameters(), 1e-3);      // on the shards, as usual
///   for (...) {
///     opt.zero_grad();
///     at::Tensor loss = loss_fn(fsdp::call(model, x), y);
///     scaler.scale(loss).backward();                          // gradients are scale x the true ones
///     scaler.unscale_(opt);                                   // collective: true gradients again
///     fsdp::clip_grad_norm_(model->parameters(), 1.0);        // so clipping sees the true norm
///     scaler.step(opt);                                       // skipped on every rank after an inf/nan
///     scaler.update();                                        // back off after an inf, grow after
///   }                                                         // growth_interval clean steps
/// \endcode
///
/// Why: low-precision gradients (fp16 above all) underflow to zero when small. Multiplying the
/// loss by a large scale S keeps them representable; unscale_ multiplies them by 1/S before the
/// optimizer sees them. When S was too large some gradient overflows to inf (or becomes nan):
/// that step is skipped and S is halved (backoff_factor); after growth_interval steps without
/// one, S is doubled (growth_factor). Works the same for fp32, bf16, fp16 and fp64 gradients.
///
/// Sharded gradients: with fully_shard each rank holds only its shard of every gradient, so an
/// inf on one rank is invisible to the others. unscale_ therefore checks this rank's gradients
/// and then issues exactly ONE all-reduce (a 2-element float tensor, max) over the process group,
/// so that every rank skips or takes the step together and all ranks keep the same scale. On
/// plain (unsharded) modules it works unchanged; in a single process that never called
/// fsdp::init_process_group() it does not communicate at all.
///
/// Stages: per optimizer and per iteration, unscale_ at most once, then step at most once; then
/// update() once for all optimizers of the iteration. Calls out of this order throw c10::Error
/// with torch's messages. Not thread-safe: use one scaler from the training thread. Not copyable
/// (its per-optimizer stages refer to optimizers by address); movable.
///
/// A disabled scaler (enabled(false)) is the identity: scale returns the loss, unscale_ and
/// update do nothing, step is optimizer.step(), get_scale() is 1 and state_dict() is empty.
#pragma once

#include <fsdp/device_mesh.h>
#include <fsdp/process_group.h>
#include <fsdp/state_dict.h>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>

namespace fsdp {

/// The options of GradScaler, with torch.amp.GradScaler's defaults.
struct GradScalerOptions {
  /// The scale before the first update (> 0, finite). Kept in fp32, as torch keeps it.
  TORCH_ARG(double, init_scale) = 65536.0;  ///< 2^16
  /// The scale is multiplied by it after growth_interval consecutive clean steps (> 1).
  TORCH_ARG(double, growth_factor) = 2.0;
  /// The scale is multiplied by it after a step with an inf or nan gradient (in (0, 1)).
  TORCH_ARG(double, backoff_factor) = 0.5;
  /// Consecutive clean steps before the scale grows (> 0).
  TORCH_ARG(int64_t, growth_interval) = 2000;
  /// false: every method is the identity (see the file comment); the options are not checked.
  TORCH_ARG(bool, enabled) = true;
  /// The ranks that must agree on skipping a step: those whose shards the optimizer holds (the
  /// fully_shard mesh's group). Null: fsdp::world() when a process group is initialised at the
  /// time of each unscale_, otherwise no communication (a single process).
  TORCH_ARG(std::shared_ptr<ProcessGroup>, process_group) = nullptr;
};

/// The scaler's state as torch's GradScaler.state_dict() has it: "scale", "growth_factor",
/// "backoff_factor", "growth_interval", "_growth_tracker" (the two counts as whole numbers).
using GradScalerState = std::map<std::string, double>;

/// The key prefix of the scaler's entries in a checkpoint's ShardedStateDict.
inline const std::string kGradScalerPrefix = "grad_scaler.";

/// torch.amp.GradScaler over sharded or plain gradients (see the file comment).
class GradScaler {
 public:
  /// Throws c10::Error naming the option when an enabled scaler's options are out of range.
  explicit GradScaler(GradScalerOptions options = GradScalerOptions());
  GradScaler(const GradScaler&) = delete;
  GradScaler& operator=(const GradScaler&) = delete;
  /** @{ */
  /// Movable, not copyable.
  GradScaler(GradScaler&&) = default;
  GradScaler& operator=(GradScaler&&) = default;
  /** @} */

  /// loss * scale, a new tensor of the loss's dtype and shape that autograd tracks. Disabled: the
  /// loss itself. Not collective. Throws unless `loss` is a defined floating-point tensor.
  at::Tensor scale(const at::Tensor& loss);

  /// Multiplies every defined gradient of the optimizer's parameters by 1/scale, in place (a
  /// non-contiguous one through a temporary copy), and records whether any rank found an inf or
  /// nan in them. Collective over the process group: every rank calls it for the same optimizers
  /// in the same order, and it blocks for one all-reduce even when this rank has no gradient.
  /// Gradients must be dense floating-point tensors; one that is not is refused (c10::Error)
  /// before any gradient is changed. CPU gradients are checked and scaled in one pass of the
  /// scaler's own loop; gradients on a GPU by ATen's fused kernel (torch.amp's), one launch per
  /// device and dtype, and the verdict is reduced on the group's device (NCCL: the current GPU). Throws when unscale_ or step already ran for this optimizer
  /// in this iteration, or when scale() was never called.
  void unscale_(torch::optim::Optimizer& optimizer);

  /// Calls unscale_(optimizer) unless it already ran this iteration (then step is collective
  /// too), then optimizer.step() unless any rank found an inf or nan. Returns whether it stepped;
  /// the answer is the same on every rank. Disabled: optimizer.step(), returns true. Throws when
  /// step already ran for this optimizer in this iteration, or when no rank had any gradient for it.
  bool step(torch::optim::Optimizer& optimizer);

  /// Ends the iteration. Without new_scale: scale *= backoff_factor if any optimizer's unscale_
  /// found an inf or nan (the growth tracker restarts at 0); otherwise the tracker counts one
  /// clean step, and when it reaches growth_interval scale *= growth_factor (kept unchanged if
  /// that would overflow fp32) and it restarts at 0. With new_scale (> 0, finite): the scale is
  /// set to it. Either way every optimizer's stage is reset. Not collective (every rank reaches
  /// the same result from the agreed inf checks). Throws when no unscale_ recorded an inf check
  /// this iteration (without new_scale), or when scale() was never called.
  void update(std::optional<double> new_scale = std::nullopt);

  /// The current scale (init_scale before the first update); 1.0 when disabled.
  double get_scale() const;
  /** @{ */
  /// The options in force (the setters below change them).
  double get_growth_factor() const { return options_.growth_factor(); }
  double get_backoff_factor() const { return options_.backoff_factor(); }
  int64_t get_growth_interval() const { return options_.growth_interval(); }
  /** @} */
  /// Consecutive clean steps since the scale last changed by growth or backoff; 0 when disabled.
  int64_t get_growth_tracker() const { return enabled() ? growth_tracker_ : 0; }
  /** @{ */
  /// The setters check their value as the constructor does (throwing c10::Error).
  void set_growth_factor(double factor);
  void set_backoff_factor(double factor);
  void set_growth_interval(int64_t interval);
  /** @} */
  /// Whether the scaler scales (GradScalerOptions::enabled); disabled, every call is a no-op.
  bool is_enabled() const { return enabled(); }

  /// torch's state dict (see GradScalerState); empty when disabled. Take it after update().
  GradScalerState state_dict() const;
  /// Restores a state_dict(). Disabled: does nothing. Throws c10::Error when `state` is empty
  /// (torch's "The source state dict is empty, ..."), lacks a key, or holds an invalid value.
  void load_state_dict(const GradScalerState& state);

  /// The same state as checkpoint entries: prefix + each key of state_dict(), as 0-dim tensors
  /// replicated over `mesh` ("scale" fp32, the factors fp64, the counts int64), to merge into the
  /// ShardedStateDict given to fsdp::save_checkpoint. Replicated values load at any world size.
  /// Empty when disabled. Not collective; the tensors are new.
  ShardedStateDict sharded_state_dict(const DeviceMesh& mesh, const std::string& prefix = kGradScalerPrefix) const;
  /// Restores the entries under `prefix` of a dict returned by fsdp::load_checkpoint (other keys
  /// are ignored), checked like load_state_dict. Not collective.
  void load_sharded_state_dict(const ShardedStateDict& state_dict, const std::string& prefix = kGradScalerPrefix);

 private:
  enum class Stage { kReady, kUnscaled, kStepped };
  struct OptimizerRecord {
    Stage stage = Stage::kReady;
    bool inf_checked = false;  ///< some rank had a gradient to check
    bool found_inf = false;    ///< some rank found an inf or nan
  };

  bool enabled() const { return options_.enabled(); }
  void check_scale_used(const char* method) const;
  void apply_found_inf(bool found_inf);

  GradScalerOptions options_;
  float scale_;              ///< fp32, as torch's scale tensor
  bool scale_used_ = false;  ///< scale() was called once: torch's lazily created scale tensor
  int64_t growth_tracker_ = 0;
  std::unordered_map<const torch::optim::Optimizer*, OptimizerRecord> per_optimizer_;
};

}  // namespace fsdp
