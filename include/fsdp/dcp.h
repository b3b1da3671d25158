// layer: checkpoint (what may include what: docs/architecture.md)
/// \file
/// fsdp/dcp.h — PyTorch Distributed Checkpoint (DCP) interop: checkpoints that Python's
/// torch.distributed.checkpoint (tested with torch 2.15, FileSystemWriter defaults) loads and saves,
/// in the layout of a training run:
///
/// \code{.cpp}
///   {"model":       FQN -> tensor                       (get_state_dict's model part)
///    "optimizer":   {"state": {fqn: {"step", "exp_avg", "exp_avg_sq"[, "max_exp_avg_sq"]}},
///                    "param_groups": [{"lr", "betas", "eps", "weight_decay", "amsgrad", "maximize",
///                                      "foreach", "capturable", "differentiable", "fused",
///                                      "decoupled_weight_decay"[, "initial_lr"], "params": [fqns]}]}
///    "train_state": {"step": 0-dim int64 tensor, the optimizer steps taken}}
/// \endcode
///
/// flattened by DCP's default planner into keys `model.<fqn>`, `optimizer.state.<fqn>.<name>`,
/// `optimizer.param_groups.<g>.<option>`, train_state.step. On the C++ side the model and optimizer
/// use the layouts of sharded_state_dict() and sharded_optimizer_state_dict() (fsdp/state_dict.h,
/// fsdp/optim_state_dict.h).
///
/// \code{.cpp}
///   // C++ saves; Python loads at any world size with
///   //   sd = {"model": msd, "optimizer": osd, "train_state": {"step": torch.tensor(0)}}
///   //   dcp.load(sd, checkpoint_id=dir); set_state_dict(model, opt, model_state_dict=sd["model"], ...)
///   fsdp::save_dcp("ckpt/step_100", fsdp::sharded_state_dict(*model),
///                  fsdp::sharded_optimizer_state_dict(*model, adamw), 100);    // collective
///   // C++ loads what Python's dcp.save wrote (at any world size):
///   fsdp::init_optimizer_state(adamw);
///   fsdp::DcpState s = fsdp::load_dcp(dir, fsdp::sharded_state_dict(*model),
///                                     fsdp::sharded_optimizer_state_dict(*model, adamw));
///   fsdp::load_sharded_state_dict(*model, s.model);
///   fsdp::load_sharded_optimizer_state_dict(*model, adamw, s.optimizer);
/// \endcode
///
/// Directory layout (DCP's): `__<rank>_0.distcp` per rank, each a sequence of torch.save archives
/// (one per tensor chunk or BYTE_IO value), and .metadata, a pickle of DCP's Metadata, written
/// last by rank 0. Unlike save_checkpoint's format there are no checksums: a damaged data file
/// is caught only where its torch.save archive is malformed.
#pragma once

#include <fsdp/state_dict.h>

#include <torch/arg.h>

#include <cstdint>
#include <optional>
#include <string>

namespace fsdp {

/// What a DCP checkpoint of a training run holds, in fsdp-cpp's layouts.
struct DcpState {
  ShardedStateDict model;      ///< FQN -> DTensor
  ShardedStateDict optimizer;  ///< `state.<fqn>.<name>`, `param_groups.<fqn>.<option>`
  int64_t step = 0;            ///< train_state.step
};

/// The options of save_dcp() and load_dcp().
struct DcpOptions {
  /// The optimizer the state belongs to: AdamW (decoupled_weight_decay true, the default) or
  /// Adam. Saving writes it; loading checks it against the checkpoint's decoupled_weight_decay.
  TORCH_ARG(bool, adamw) = true;
  /// When set, saving also writes each param group's initial_lr (what Python's LR schedulers add
  /// to the groups, which dcp.load then requires). Ignored when loading.
  TORCH_ARG(std::optional<double>, initial_lr) = std::nullopt;
};

/// Writes model, optimizer and step to `dir` (created if needed; a .metadata there is removed
/// first, so an interrupted save never looks complete). Collective over the world: every rank
/// calls it with its own shards of the same keys. Each rank writes `__<rank>_0.distcp` (under a
/// temporary name, fsync'ed, renamed); values replicated over a mesh dim are written by its first
/// rank only; rank 0 writes .metadata the same way once every data file is complete. Blocks until
/// then. The optimizer dict must be an Adam/AdamW one (param_groups options lr, beta1, beta2, eps,
/// weight_decay, amsgrad): another optimizer's throws, saying so. Parameters with identical
/// options share one param group, in the order of their first key. When any rank fails, every
/// rank throws the same c10::Error: a line naming the phase, then one line per failed rank.
void save_dcp(const std::string& dir, const ShardedStateDict& model, const ShardedStateDict& optimizer, int64_t step,
              const DcpOptions& options = DcpOptions());

/// Reads the DCP checkpoint at `dir` (written by Python's dcp.save or save_dcp, at any world
/// size) into new tensors laid out like `model_like` and `optimizer_like` (the keys to read: every
/// one must be in the checkpoint; the checkpoint may hold more, e.g. Python's foreach or fused
/// options, which are ignored). Tensors are cast to the dtype of `like` as Python's dcp.load
/// does; shapes must match. The optimizer's step is read from Python's float32 (or any) step
/// tensor; options from the param group whose `params` lists the FQN. Each rank reads only the
/// chunks overlapping its own pieces. Not collective (file reads only), but every rank normally
/// calls it. Checks before reading data: .metadata in full (dcp_metadata.h: only the classes DCP
/// writes, every field, the chunks' tiling), every item's bytes inside its data file. Each item
/// is read as a torch.save archive allowing only the GLOBALs a tensor or plain value needs.
/// Throws c10::Error naming the file and the key on: a missing directory or .metadata, a damaged
/// one, a missing key, a shape mismatch, a truncated data file, a malformed item, an optimizer
/// the checkpoint says is another (decoupled_weight_decay, maximize: true), a non-integral step,
/// a DCP saved with extensions (compression) or with safetensors serialization (not supported).
DcpState load_dcp(const std::string& dir, const ShardedStateDict& model_like, const ShardedStateDict& optimizer_like,
                  const DcpOptions& options = DcpOptions());

/// train_state.step of the checkpoint at `dir`. Not collective; reads .metadata and one item.
/// Throws as load_dcp does, and when the checkpoint has no train_state.step.
int64_t dcp_step(const std::string& dir);

/// True when `dir` holds a DCP .metadata this build reads and every data file it names exists
/// with at least the bytes it records. Otherwise false, and `why` (when not null) is one line
/// naming the path. Not collective; never throws; does not read the data.
bool is_complete_dcp(const std::string& dir, std::string* why = nullptr);

}  // namespace fsdp
