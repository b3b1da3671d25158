// model_setup.h — the configuration turned into a model on its mesh: the family's model built
// layer by layer, each decoder layer split over tp by the family's plan and sharded as soon as it
// is built (or the whole model replicated under NO_SHARD), an output head group of its own,
// activation checkpointing per decoder layer, and frozen parameters. Nothing here names a
// family: what differs between them is models/family.h's. The initial weights are
// initial_weights.h's.
#pragma once

#include "config/config.h"
#include "models/family.h"

#include <fsdp/device_mesh.h>
#include <fsdp/distributed.h>
#include <fsdp/fsdp_module.h>
#include <fsdp/replicate.h>

#include <cstdint>
#include <string>
#include <vector>

namespace fsdp {
namespace train {

// training.seq_len, or the model's max_seq_len when unset. Throws ConfigError naming where both
// values come from when it is longer than max_seq_len, or when loss_chunks exceeds it, and what
// the family refuses at that length (ModelFamily::check).
int64_t seq_len_of(const TrainConfig& cfg, const ModelFamily& family);

// A model on its mesh, as the strategy made it.
struct ParallelModel {
  BuiltModel built;  // the family's model: the root module, and it as a language model
  DeviceMesh mesh;
  FSDPModule root;              // FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD*
  ReplicatedModule replicated;  // NO_SHARD
  DataParallelShape shape;      // replicas x shards of the data-parallel ranks
  // The data-parallel ranks: every rank, or with model_parallel_size k the world / k rows of
  // the (dp, tp) mesh, whose k tp ranks train on the same rows.
  int tp = 1, dp_rank = 0, dp_world = 1;
  int64_t parameter_count = 0;          // of the whole model, not of this rank's shards
  int64_t build_peak_tensor_bytes = 0;  // the peak of tensor bytes while building and sharding

  DataParallelKind kind() const;
  // The model, whichever family it is.
  torch::nn::Module& module() const { return *built.module; }
  // Its parameters, each once (a tied embedding is registered under two names).
  std::vector<at::Tensor> parameters() const;
  // The mean cross-entropy of the model's prediction of targets from inputs (int64 [rows, seq]),
  // computed in `chunks` pieces (fsdp/models/causal_lm.h's forward_loss), through the FSDP root's
  // (or replicate's) hooks.
  at::Tensor forward_loss(const at::Tensor& inputs, const at::Tensor& targets, int64_t chunks);
  // "sharded over 4 rank(s), FULL_SHARD", "replicated on 4 rank(s), NO_SHARD", or for HSDP
  // "sharded over 2 rank(s) in each of 2 replicas, HYBRID_SHARD".
  std::string description(const FsdpConfig& f, int world) const;
};

// Collective over the world (creates the mesh's groups; fully_shard and replicate
// communicate): every rank calls it after init_process_group, with the same configuration.
// Every decoder layer is its own FSDP group and the root holds the rest; each layer is split
// over tp and sharded as soon as it is built, so no rank ever holds the whole model. Throws
// ConfigError for a strategy, replicate degree or model-parallel size the world does not allow,
// and what the family refuses.
ParallelModel parallelize_model(const TrainConfig& cfg, const ModelFamily& family, const Precision& precision,
                                int local_world_size);

// What check_supported needs to know of this machine. CUDA is probed only when the
// configuration asks for device cuda, so that a CPU run never initialises it.
DeviceSupport device_support_for(const TrainConfig& cfg);

// Tensor memory as the step line and the summary report it, in MiB: the GPU's caching allocator
// on a "cuda" mesh, the counting CPU allocator (fsdp/memory.h) otherwise. Not collective.
struct TensorMemory {
  double live_mib = 0;
  double peak_mib = 0;
};
constexpr double kMiBBytes = 1024.0 * 1024.0;
TensorMemory tensor_memory(const DeviceMesh& mesh);
// Starts a new peak for tensor_memory (both allocators).
void reset_tensor_peak(const DeviceMesh& mesh);

}  // namespace train
}  // namespace fsdp
