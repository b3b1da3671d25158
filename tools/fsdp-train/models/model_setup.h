// model_setup.h — the configuration turned into a model on its mesh: the model's sizes and the
// checks on them, the device mesh, and the model built, split over tp, sharded or replicated,
// and frozen where configured. The initial weights are initial_weights.h's.
#pragma once

#include "config/config.h"

#include <fsdp/device_mesh.h>
#include <fsdp/distributed.h>
#include <fsdp/fsdp_module.h>
#include <fsdp/models/llama.h>
#include <fsdp/models/transformer.h>
#include <fsdp/replicate.h>

#include <cstdint>
#include <string>
#include <vector>

namespace fsdp {
namespace train {

// The model's sizes: the preset with the configured keys over it. Throws ConfigError when dim
// is not a multiple of n_heads. For architecture llama, the sizes the trainer's checks and
// reports read (n_layers, vocab_size, max_seq_len = max_position_embeddings, dim = hidden_size,
// n_heads) from its config.json.
models::ModelArgs model_args_of(const ModelConfig& m);
// Whether the configuration trains the Llama family: model.architecture llama, or a Hugging Face
// directory (with config.json) as model.init_from. Throws ConfigError naming model.init_from when
// it names a path that does not exist (before any check that the model it would shape fails).
bool is_llama(const ModelConfig& m);
// What the trainer does with the Transformer and not (yet) with the Llama family (NO_SHARD,
// activation checkpointing, an output head group): throws ConfigError naming the key. The trainer
// and `fsdp-train plan` both ask.
void check_llama_supported(const TrainConfig& cfg);
// The config.json that shapes a Llama: model.hf_config, else init_from's. Throws ConfigError when
// neither names one, and (naming the file and key) what llama_args_from_hf_config throws.
models::LlamaArgs llama_args_of(const ModelConfig& m, int64_t seq_len);
// What reading the Llama's config.json decided that the file does not say plainly (which of two
// disagreeing rope objects is used), one line each; none for the Transformer.
std::vector<std::string> llama_config_notes(const ModelConfig& m);
// training.seq_len, or the model's max_seq_len when unset. Throws ConfigError naming where both
// values come from when it is longer than max_seq_len, or when loss_chunks exceeds it.
int64_t seq_len_of(const TrainConfig& cfg, const models::ModelArgs& a);
// Before anything is allocated: throws ConfigError for a model or batch this machine cannot
// hold (model_size.h).
void check_memory(const TrainConfig& cfg, const models::ModelArgs& a, int64_t seq, const RendezvousInfo& env);

// A model on its mesh, as the strategy made it.
struct ParallelModel {
  models::Transformer model{nullptr};  // architecture transformer
  models::Llama llama{nullptr};        // architecture llama (model is then null)
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
  // The model, whichever architecture it is.
  torch::nn::Module& module() const;
  // Its parameters, each once (a tied embedding is registered under two names).
  std::vector<at::Tensor> parameters() const;
  // The mean cross-entropy of the model's prediction of targets from inputs (int64 [rows, seq]),
  // computed in `chunks` pieces (TransformerImpl::forward_loss, LlamaImpl::forward_loss), through
  // the FSDP root's hooks.
  at::Tensor forward_loss(const at::Tensor& inputs, const at::Tensor& targets, int64_t chunks);
  // "sharded over 4 rank(s), FULL_SHARD", "replicated on 4 rank(s), NO_SHARD", or for HSDP
  // "sharded over 2 rank(s) in each of 2 replicas, HYBRID_SHARD".
  std::string description(const FsdpConfig& f, int world) const;
};

// Collective over the world (creates the mesh's groups; fully_shard and replicate
// communicate): every rank calls it after init_process_group, with the same configuration.
// Every block is its own FSDP group and the root holds the rest; each block is split over tp
// and sharded as soon as it is built, so no rank ever holds the whole model. Throws ConfigError
// for a strategy, replicate degree or model-parallel size the world does not allow.
ParallelModel parallelize_model(const TrainConfig& cfg, const models::ModelArgs& args, const Precision& precision,
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
