// layer: checkpoint (what may include what: docs/architecture.md)
/// \file
/// fsdp/state_dict.h — model state dicts of a fully_shard()ed model: sharded (no communication)
/// and full (gathered), loading either back in place, and PyTorch's file format.
///
/// \code{.cpp}
///   auto sharded = fsdp::sharded_state_dict(*model);           // FQN -> DTensor, shares storage
///   auto full = fsdp::full_state_dict(*model);                 // FQN -> whole tensor (collective)
///   fsdp::save_pytorch_state_dict(full, "model.pt");           // torch.load("model.pt") in Python
///   fsdp::load_full_state_dict(*model, fsdp::load_pytorch_state_dict("model.pt"));
/// \endcode
///
/// Keys are the parameters' and buffers' fully qualified names, the same before and after
/// fully_shard. Loading checks every key, shape and dtype first and writes nothing unless all
/// of them are right; errors name the key.
#pragma once

#include <fsdp/dtensor.h>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/ordered_dict.h>

#include <string>
#include <vector>

namespace fsdp {

/// FQN -> DTensor: this rank's pieces and their layout.
using ShardedStateDict = torch::OrderedDict<std::string, DTensor>;
/// FQN -> a plain (whole) tensor.
using TensorStateDict = torch::OrderedDict<std::string, at::Tensor>;

/// Every parameter and buffer of `model` as a DTensor, in named_parameters() then named_buffers()
/// order: parameters sharded by fully_shard as their DTensor (Shard(0), or the Shard(d) a
/// shard_placement_fn chose; HSDP: Replicate() first), whose local tensor IS the live shard
/// (no copy); everything else (buffers, parameters fully_shard did not manage) as a
/// Replicate() DTensor over the same mesh, also sharing storage. A model split by tensor
/// parallelism and not passed to fully_shard (fsdp/tensor_parallel.h) gives its parameters'
/// DTensors on the tp mesh (Shard(0) / Shard(1) / Replicate()), so its full state dict, exports
/// and checkpoints hold the whole tensors. No communication. Throws if the model has no
/// parameter sharded by fully_shard or split by tensor parallelism and no module replicated by
/// replicate() (fsdp/replicate.h; a replicated model's entries are all Replicate() over its mesh).
ShardedStateDict sharded_state_dict(torch::nn::Module& model);

/// Writes `state_dict` into `model` in place. Each value may use any placements: a DTensor with
/// the parameter's own mesh and placements is copied locally; other placements or meshes are
/// gathered first (collective over the value's mesh). With strict, the keys must match
/// exactly. Nothing is written unless every key, shape and dtype matches.
void load_sharded_state_dict(torch::nn::Module& model, const ShardedStateDict& state_dict, bool strict = true);

/// The same from whole (unsharded) tensors, e.g. read from a file: each rank takes its own
/// torch.chunk piece. Every rank passes the whole dict. No communication.
void load_full_state_dict(torch::nn::Module& model, const TensorStateDict& state_dict, bool strict = true);

/// The options of full_state_dict().
struct FullStateDictOptions {
  /// Only rank 0 receives the tensors (the others get an empty dict but still take part).
  TORCH_ARG(bool, rank0_only) = false;
  /// Copy every tensor to the CPU (a no-op for the CPU tensors of this build).
  TORCH_ARG(bool, cpu_offload) = true;
};

/// The whole model as plain tensors, gathered with DTensor::full_tensor(): one all-gather per
/// sharded parameter. Collective over the model's mesh. The tensors are new (not views of the
/// live model).
TensorStateDict full_state_dict(torch::nn::Module& model, const FullStateDictOptions& options = FullStateDictOptions());

/// Writes a dict of name -> tensor in PyTorch's own file format: Python's torch.load returns it
/// as a dict of FQN -> tensor. Views are written as their own data only. The file is written
/// under `<path>.tmp` and renamed: a failed write (a full disk) leaves an earlier file at `path`
/// as it was and no temporary, and throws c10::Error naming the file.
void save_pytorch_state_dict(const TensorStateDict& state_dict, const std::string& path);
/// Reads a file written by Python's torch.save (or by save_pytorch_state_dict), e.g.
/// torch.save(model.state_dict(), path): a dict or OrderedDict of name -> tensor, of any number
/// of entries. The file may also hold a bundle, a dict with the state dict next to other things
/// ({"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 3}). The rule:
/// \code{.cpp}
///   - a top-level dict whose values are all tensors (or that has no entries) is the state dict;
///   - otherwise, if exactly one of "state_dict", "model_state_dict", "model" holds a dict, that
///     dict is the state dict (the other entries are read but not returned: when `ignored` is
///     not null, it receives one line per such entry, "'epoch' (int)", "'optimizer' (dict)", for
///     the caller to say what was left out; nothing of them runs);
///   - two of them holding a dict is ambiguous, and none with no tensor at the top level means
///     there is no state dict: both are errors listing the top-level keys;
///   - none, with tensors at the top level: the top-level dict is the state dict.
/// \endcode
/// Every key of the state dict must be a str and every value a tensor, or an error names the key.
/// Tensors are created on the CPU, whatever device they were saved from; tensors that shared a
/// storage in Python (tied weights, a transposed view) share one here too. Not collective.
/// Throws c10::Error naming the path on a missing file, a directory, a file that is not a
/// torch.save zip archive (torch.save's legacy format included), or one that is truncated,
/// damaged or malformed.
TensorStateDict load_pytorch_state_dict(const std::string& path, std::vector<std::string>* ignored = nullptr);

}  // namespace fsdp
