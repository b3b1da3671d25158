// layer: checkpoint (what may include what: docs/architecture.md)
/// \file
/// fsdp/optim_state_dict.h — an optimizer's state keyed by parameter FQN, sharded like the
/// parameters, so that it can be saved with the model and loaded at another world size.
///
/// \code{.cpp}
///   fsdp::ShardedStateDict osd = fsdp::sharded_optimizer_state_dict(*model, adam);
///   ...
///   fsdp::load_sharded_optimizer_state_dict(*model, adam, osd);
/// \endcode
///
/// The layout is PyTorch's flattened one (torch.distributed.checkpoint.state_dict):
/// \code{.cpp}
///   state.<fqn>.<name>          per-parameter state: DTensors sharded like the parameter
///                               (exp_avg, exp_avg_sq, max_exp_avg_sq, momentum_buffer), and
///                               `state.<fqn>.step` as a 0-dim int64 tensor (Replicate)
///   param_groups.<fqn>.<option> the options of the parameter's group (lr, beta1, beta2, eps,
///                               weight_decay, amsgrad, momentum, dampening, nesterov) as 0-dim
///                               float64 tensors (Replicate)
/// \endcode
/// Supported optimizers: torch::optim::Adam, AdamW and SGD; others fail saying so.
#pragma once

#include <fsdp/state_dict.h>

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

namespace fsdp {

/// No communication; the DTensors share storage with the optimizer's state. Parameters the
/// optimizer has no state for yet (no step taken) have only their param_groups entries.
ShardedStateDict sharded_optimizer_state_dict(torch::nn::Module& model, torch::optim::Optimizer& optimizer);

/// Replaces the optimizer's state for every parameter of `model` found in `state_dict` and sets
/// its groups' options. Values may be laid out for another world size (they are redistributed
/// like load_sharded_state_dict does; collective when they are). Checks everything before
/// writing: an unknown parameter, a missing option or a shape mismatch names the key.
void load_sharded_optimizer_state_dict(torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                                       const ShardedStateDict& state_dict);

/// Creates the optimizer's per-parameter state (as one step would) without changing any parameter:
/// one step with learning rate 0, zero gradients standing in for missing ones. Call it on a fresh
/// optimizer before loading a checkpoint, so that sharded_optimizer_state_dict() lists the state
/// to load into. Not collective.
void init_optimizer_state(torch::optim::Optimizer& optimizer);

}  // namespace fsdp
