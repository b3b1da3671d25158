// model_setup.cpp — the configuration turned into a model on its mesh (model_setup.h).
#include "models/model_setup.h"

#include "common/errors.h"
#include "models/hf_checkpoint.h"
#include "models/model_size.h"

#include <fsdp/call.h>
#include <fsdp/checkpoint_activations.h>
#include <fsdp/device.h>
#include <fsdp/distributed.h>
#include <fsdp/fully_shard.h>
#include <fsdp/memory.h>
#include <fsdp/mixed_precision.h>
#include <fsdp/models/llama_hf.h>
#include <fsdp/models/llama_parallelize.h>
#include <fsdp/models/parallelize.h>
#include <fsdp/state_dict.h>
#include <fsdp/tensor_parallel.h>

#include <torch/utils.h>

#include <filesystem>
#include <optional>
#include <set>

namespace fsdp {
namespace train {
namespace {

// Says where both values come from, as the loader's own errors do: the line of each key, or
// the preset that gave max_seq_len.
std::string seq_len_too_long(const TrainConfig& cfg, int64_t seq, int64_t max_seq_len) {
  const std::string seq_at = origin_of(cfg, "training.seq_len"), max_at = origin_of(cfg, "model.max_seq_len");
  const std::string max_from = max_at.empty() ? "model.preset " + cfg.model.preset + "'s" : "set at " + max_at;
  return (seq_at.empty() ? std::string() : seq_at + ": ") + "training.seq_len (" + std::to_string(seq) +
         ") is longer than model.max_seq_len (" + std::to_string(max_seq_len) + ", " + max_from +
         "); lower training.seq_len or raise model.max_seq_len";
}

at::ScalarType scalar_type(Dtype d) {
  switch (d) {
    case Dtype::kFloat32: return at::kFloat;
    case Dtype::kBFloat16: return at::kBFloat16;
    case Dtype::kFloat16: return at::kHalf;
  }
  return at::kFloat;
}

// FSDP2's policy for the configured dtypes. A dtype left at fp32 stays unset: the parameters
// are fp32, and FSDP2 computes and reduces in their dtype by default. reduce_dtype unset means
// "as param_dtype", so it is set whenever it differs from the compute dtype.
MixedPrecisionPolicy mp_policy_of(const Precision& p) {
  MixedPrecisionPolicy policy;
  if (p.param != Dtype::kFloat32) policy.param_dtype(scalar_type(p.param));
  if (p.reduce != p.param) policy.reduce_dtype(scalar_type(p.reduce));
  return policy;
}

// The sharded state dict's tensors have the full parameters' sizes.
int64_t full_parameter_count(torch::nn::Module& model) {
  int64_t n = 0;
  std::set<const c10::TensorImpl*> seen;  // a tied weight counts once
  for (const auto& item : sharded_state_dict(model)) {
    if (!seen.insert(item.value().to_local().unsafeGetTensorImpl()).second) continue;
    int64_t numel = 1;
    for (int64_t d : item.value().sizes()) numel *= d;
    n += numel;
  }
  return n;
}

// (dp, tp) with model_parallel_size > 1, (replicate, shard) for HSDP, else one dim. Row-major:
// each tp group, or each replica's shard group, is consecutive ranks.
// On fsdp_config.device: "cuda" puts each rank on GPU local_rank (init_device_mesh chooses it).
DeviceMesh training_mesh(const DataParallelShape& shape, int world, int tp, const std::string& device) {
  if (tp > 1) return init_device_mesh(device, {world / tp, tp}, {"dp", "tp"});
  if (shape.hybrid) return init_device_mesh(device, {shape.replicate, shape.shard}, {"replicate", "shard"});
  return init_device_mesh(device, {world});
}

// model.freeze: requires_grad = false on every parameter an entry names (the parameter itself,
// or a module above it). An entry that names nothing is a configuration error, so a typo never
// trains what was meant to stay fixed.
void freeze_parameters(const ModelConfig& cfg, torch::nn::Module& model) {
  for (const std::string& entry : cfg.freeze) {
    bool found = false;
    for (auto& item : model.named_parameters()) {
      const std::string& name = item.key();
      if (name != entry && name.rfind(entry + ".", 0) != 0) continue;
      item.value().set_requires_grad(false);
      found = true;
    }
    if (!found)
      throw ConfigError("model.freeze: '" + terminal_safe(entry) +
                        "' names no parameter of the model (names are like tok_embeddings, "
                        "layers.0.attention.wq.weight; for llama model.embed_tokens, model.layers.0.mlp)");
  }
}

// The options that move fewer bytes between hosts: quantized all-gathers and replicate
// all-reduces, and for DiLoCo a model sharded within each replica only (its shard dim), whose
// replicas meet in DiLoCo's outer step instead of every backward.
void add_link_options(const FsdpConfig& f, const ParallelModel& m, FullyShardOptions& o) {
  const auto format = [&](const std::string& dtype) {
    return QuantizedComm().dtype(quantized_dtype_from_string(dtype)).block_size(f.quantization_block_size);
  };
  if (f.quantized_weights) o.quantized_weights(format(*f.quantized_weights));
  if (f.quantized_gradients) o.quantized_gradients(format(*f.quantized_gradients));
  if (f.diloco_inner_steps > 0) o.mesh(m.mesh["shard"]);
}

// model_parallel_size k > 1: each block is split over tp as soon as it is built (the Megatron
// plan: fsdp::models::parallelize), then sharded over dp; with vocab_parallel the token embedding
// and the output head are split by vocabulary over tp; the root shards what it holds (the
// embeddings, the final norm, the head) over dp.
models::Transformer tensor_parallel_model(const FsdpConfig& f, const models::ModelArgs& args, const DeviceMesh& mesh,
                                          FullyShardOptions block_options, FullyShardOptions root_options) {
  const auto dp_dims = DataParallelMeshDims().shard("dp");
  block_options.dp_mesh_dims(dp_dims);
  root_options.dp_mesh_dims(dp_dims);
  const tp::TensorParallelMesh tp_mesh(mesh, "tp");
  models::Transformer model(args, [&](models::TransformerBlock& block) {
    models::parallelize_block(*block, args, tp_mesh);
    fully_shard(block, block_options);
  });
  if (f.vocab_parallel) models::parallelize_vocab(*model, tp_mesh);
  tp::register_replicated(*model, tp_mesh);
  fully_shard(model, root_options);
  return model;
}

// Every block is its own group; the root holds the rest (embeddings, final norm, output). On
// a 2-D mesh (HYBRID_SHARD*) the same calls shard within each replica. The values are those of
// building the whole model first (fully_shard draws no random numbers), so a seed gives the
// same run either way.
models::Transformer sharded_model(const TrainConfig& cfg, const models::ModelArgs& args, const ParallelModel& m,
                                  const MixedPrecisionPolicy& policy, const std::optional<CPUOffloadPolicy>& offload) {
  const FsdpConfig& f = cfg.fsdp_config;
  const bool reshard = reshard_after_forward(cfg);
  FullyShardOptions block_options =
      FullyShardOptions().mesh(m.mesh).reshard_after_forward(reshard).mp_policy(policy).offload_policy(offload);
  if (f.reshard_after_forward) block_options.reshard_after_forward(*f.reshard_after_forward);
  // The root's parameters are needed first in backward, so it keeps them gathered (FSDP2's
  // default for the root) unless SHARD_GRAD_OP says to keep everything anyway.
  FullyShardOptions root_options = FullyShardOptions().mesh(m.mesh).mp_policy(policy).offload_policy(offload);
  if (!reshard) root_options.reshard_after_forward(false);
  add_link_options(f, m, block_options);
  add_link_options(f, m, root_options);
  if (m.tp > 1) return tensor_parallel_model(f, args, m.mesh, block_options, root_options);
  if (f.output_head_group) {
    // The head runs backward first, so keeping it gathered from forward saves an all-gather and
    // no memory (torchtitan does the same for its last group); it reshards after its backward.
    FullyShardOptions head_options = block_options;
    head_options.reshard_after_forward(false);
    return models::sharded_transformer(args, block_options, head_options, root_options);
  }
  return models::sharded_transformer(args, block_options, root_options);
}

// The Llama family: each decoder layer its own group as soon as it is built (split over tp
// first with model_parallel_size > 1: fsdp/models/llama_parallelize.h), then the root (the
// embedding, the final norm and the head, tied or not, in one group).
models::Llama sharded_llama(const TrainConfig& cfg, const ParallelModel& m, const MixedPrecisionPolicy& policy,
                            const std::optional<CPUOffloadPolicy>& offload) {
  const FsdpConfig& f = cfg.fsdp_config;
  const bool reshard = reshard_after_forward(cfg);
  FullyShardOptions layer_options =
      FullyShardOptions().mesh(m.mesh).reshard_after_forward(reshard).mp_policy(policy).offload_policy(offload);
  if (f.reshard_after_forward) layer_options.reshard_after_forward(*f.reshard_after_forward);
  FullyShardOptions root_options = FullyShardOptions().mesh(m.mesh).mp_policy(policy).offload_policy(offload);
  if (!reshard) root_options.reshard_after_forward(false);
  add_link_options(f, m, layer_options);
  add_link_options(f, m, root_options);
  const int64_t seq = seq_len_of(cfg, model_args_of(cfg.model));
  const models::LlamaArgs args = llama_args_of(cfg.model, seq);
  if (m.tp == 1) {
    models::Llama model(args, [&](models::LlamaDecoderLayer& layer) { fully_shard(layer, layer_options); });
    if (f.output_head_group) {
      if (args.tie_word_embeddings)
        throw ConfigError(
            "fsdp_config.output_head_group: true with a tied head (tie_word_embeddings in config.json) is not "
            "supported: the head's weight is the embedding's, and one tensor cannot be in two FSDP groups; set "
            "output_head_group: false");
      // As the Transformer's head group: gathered from its forward to its backward, which comes first.
      FullyShardOptions head_options = layer_options;
      head_options.reshard_after_forward(false);
      fully_shard(std::vector<std::shared_ptr<torch::nn::Module>>{model->model->norm.ptr(), model->lm_head.ptr()},
                  head_options);
    }
    fully_shard(model, root_options);
    return model;
  }
  try {
    models::check_llama_parallelizable(args, m.tp);
    if (f.vocab_parallel && args.tie_word_embeddings)
      throw ConfigError(
          "fsdp_config.vocab_parallel: true (the default) cannot split tied embeddings "
          "(tie_word_embeddings in config.json) by vocabulary; set fsdp_config.vocab_parallel: false");
  } catch (const c10::Error& e) {
    throw ConfigError("fsdp_config.model_parallel_size: " + std::to_string(m.tp) + ": " + e.msg());
  }
  const auto dp_dims = DataParallelMeshDims().shard("dp");
  layer_options.dp_mesh_dims(dp_dims);
  root_options.dp_mesh_dims(dp_dims);
  const tp::TensorParallelMesh tp_mesh(m.mesh, "tp");
  models::Llama model(args, [&](models::LlamaDecoderLayer& layer) {
    models::parallelize_llama_layer(*layer, args, tp_mesh);
    fully_shard(layer, layer_options);
  });
  models::parallelize_llama_rest(*model, tp_mesh, models::ParallelizeOptions().vocab_parallel(f.vocab_parallel));
  fully_shard(model, root_options);
  return model;
}

// fsdp_config.prefetch_depth k > 1: each group all-gathers the next k groups, in forward in the
// order the groups start (the root, the blocks, the head group) and in backward in the reverse of
// the order they finish forward (the root, the head group, the blocks from the last). A head group,
// last in forward, gathers the last k blocks for their backward while the loss is computed
// (FSDPModule::set_modules_to_forward_prefetch keeps those for the backward). Depth 1 keeps
// FSDP2's implicit prefetch, which does the same for one group.
void prefetch_ahead(const FSDPModule& root, const std::vector<FSDPModule>& blocks, const FSDPModule& head,
                    int64_t depth) {
  if (depth <= 1) return;
  std::vector<FSDPModule> forward{root}, backward{root};
  forward.insert(forward.end(), blocks.begin(), blocks.end());
  if (head.valid()) {
    forward.push_back(head);
    backward.push_back(head);
  }
  backward.insert(backward.end(), blocks.rbegin(), blocks.rend());
  auto ahead = [depth](const std::vector<FSDPModule>& order, size_t i) {
    const size_t end = std::min(order.size(), i + 1 + static_cast<size_t>(depth));
    return std::vector<FSDPModule>(order.begin() + static_cast<std::ptrdiff_t>(i + 1),
                                   order.begin() + static_cast<std::ptrdiff_t>(end));
  };
  for (size_t i = 0; i < forward.size(); ++i) forward[i].set_modules_to_forward_prefetch(ahead(forward, i));
  if (head.valid()) head.set_modules_to_forward_prefetch(ahead(backward, 1));
  for (size_t i = 0; i < backward.size(); ++i) backward[i].set_modules_to_backward_prefetch(ahead(backward, i));
}

// The FSDP groups of the sharded model, for prefetch_ahead.
template <typename Blocks>
void prefetch_ahead_in(const FsdpConfig& f, const FSDPModule& root, Blocks& blocks, const torch::nn::Module& head) {
  std::vector<FSDPModule> groups;
  for (auto& block : blocks) groups.push_back(get_fsdp_module(*block));
  prefetch_ahead(root, groups, f.output_head_group ? get_fsdp_module(head) : FSDPModule(), f.prefetch_depth);
}

// The model as the strategy makes it, frozen where configured, with activation checkpointing.
void build_model(const TrainConfig& cfg, const models::ModelArgs& args, const Precision& precision, ParallelModel& m) {
  const FsdpConfig& f = cfg.fsdp_config;
  // One policy for every group, the root included (torchtitan's choice): the root's
  // embeddings, final norm and output head compute in param_dtype too. Its inputs are token
  // ids, which no policy casts; the model returns fp32 logits, and the loss is fp32.
  const MixedPrecisionPolicy policy = mp_policy_of(precision);
  // Pinned host shards on a GPU, for asynchronous copies; on a cpu device the copies are identities.
  std::optional<CPUOffloadPolicy> offload;
  if (f.offload_params) offload = CPUOffloadPolicy().pin_memory(f.device == "cuda");
  // Same seed on every rank: fully_shard keeps each rank's piece of identical weights.
  torch::manual_seed(cfg.training.seed);
  memory::reset_peak_allocated();
  reset_tensor_peak(m.mesh);
  if (is_llama(cfg.model)) {
    check_llama_supported(cfg);
    m.llama = sharded_llama(cfg, m, policy, offload);
    m.root = get_fsdp_module(*m.llama);
    prefetch_ahead_in(f, m.root, m.llama->decoder_layers(), *m.llama->model->norm);
    freeze_parameters(cfg.model, *m.llama);
    m.build_peak_tensor_bytes = static_cast<int64_t>(tensor_memory(m.mesh).peak_mib * kMiBBytes);
    return;
  }
  if (f.sharding_strategy == ShardingStrategy::NO_SHARD) {
    // Whole parameters on every rank, gradients averaged in buckets during backward (DDP). The
    // gradients are views of the buckets: backward accumulates into what is all-reduced, so
    // there is neither a copy nor a second set of gradients in memory.
    m.model = models::Transformer(args);
    freeze_parameters(cfg.model, *m.model);  // before replicate, which buckets only what trains
    m.replicated = replicate(m.model, ReplicateOptions().mesh(m.mesh).gradient_as_bucket_view(true));
  } else {
    m.model = sharded_model(cfg, args, m, policy, offload);
    m.root = get_fsdp_module(*m.model);
    prefetch_ahead_in(f, m.root, m.model->blocks(), *m.model->norm);
    freeze_parameters(cfg.model, *m.model);  // the shards: FSDP follows their requires_grad
  }
  if (f.activation_checkpointing) {
    m.model->set_activation_checkpointing(f.activation_checkpointing_every,
                                          CheckpointOptions().use_reentrant(f.use_reentrant));
  }
  m.build_peak_tensor_bytes = static_cast<int64_t>(tensor_memory(m.mesh).peak_mib * kMiBBytes);
}

}  // namespace

void check_llama_supported(const TrainConfig& cfg) {
  const FsdpConfig& f = cfg.fsdp_config;
  auto refuse = [](const std::string& what) {
    throw ConfigError(what +
                      " is not supported with model.architecture llama; it trains under FULL_SHARD, "
                      "SHARD_GRAD_OP or HYBRID_SHARD without it");
  };
  if (f.sharding_strategy == ShardingStrategy::NO_SHARD) refuse("fsdp_config.sharding_strategy NO_SHARD");
  if (f.activation_checkpointing) refuse("fsdp_config.activation_checkpointing");
}

bool is_llama(const ModelConfig& m) {
  // init_from decides the architecture and shapes the model: a path that does not exist is said
  // first, rather than as a size error against the default preset's model.
  std::error_code ec;
  if (!m.init_from.empty() && !std::filesystem::exists(m.init_from, ec))
    throw ConfigError("model.init_from: " + terminal_safe(m.init_from) +
                      " does not exist; give a torch.save file, a safetensors directory or a Hugging Face model "
                      "directory");
  if (m.architecture == "transformer" && !m.init_from.empty() && is_hf_model_dir(m.init_from))
    throw ConfigError("model.init_from " + m.init_from +
                      " is a Hugging Face model directory (it has config.json), which is a Llama-family model, "
                      "but model.architecture is transformer; set model.architecture: llama or leave it out");
  return m.architecture == "llama" || (m.architecture.empty() && !m.init_from.empty() && is_hf_model_dir(m.init_from));
}

namespace {

models::LlamaArgs read_llama_config(const ModelConfig& m, int64_t seq_len, std::vector<std::string>* notes) {
  std::string path = m.hf_config;
  if (path.empty() && !m.init_from.empty() && is_hf_model_dir(m.init_from)) path = m.init_from + "/config.json";
  if (path.empty())
    throw ConfigError(
        "model.architecture llama needs its shape from a Hugging Face config.json: set model.hf_config "
        "to one, or model.init_from to a Hugging Face model directory");
  try {
    return models::llama_args_from_hf_config(path, seq_len, notes);
  } catch (const c10::Error& e) {
    throw ConfigError(e.msg());
  }
}

}  // namespace

models::LlamaArgs llama_args_of(const ModelConfig& m, int64_t seq_len) {
  return read_llama_config(m, seq_len, nullptr);
}

std::vector<std::string> llama_config_notes(const ModelConfig& m) {
  std::vector<std::string> notes;
  if (is_llama(m)) read_llama_config(m, 0, &notes);
  return notes;
}

// The Llama's sizes where the trainer's checks and reports read the Transformer's.
models::ModelArgs llama_model_args(const ModelConfig& m) {
  for (const auto& [key, set] : {std::pair<const char*, bool>{"n_layers", m.n_layers.has_value()},
                                 {"vocab_size", m.vocab_size.has_value()},
                                 {"max_seq_len", m.max_seq_len.has_value()},
                                 {"dim", m.dim.has_value()},
                                 {"n_heads", m.n_heads.has_value()},
                                 {"dropout_p", m.dropout_p.has_value()}})
    if (set)
      throw ConfigError(std::string("model.") + key +
                        " does not apply to model.architecture llama, whose shape is its config.json's; remove it");
  const models::LlamaArgs l = llama_args_of(m, 0);
  models::ModelArgs a;
  a.n_layers = l.num_hidden_layers, a.vocab_size = l.vocab_size, a.max_seq_len = l.max_position_embeddings;
  a.dim = l.hidden_size, a.n_heads = l.num_attention_heads, a.dropout_p = 0;
  return a;
}

models::ModelArgs model_args_of(const ModelConfig& m) {
  if (is_llama(m)) return llama_model_args(m);
  if (!m.hf_config.empty())
    throw ConfigError("model.hf_config shapes a Llama-family model; set model.architecture: llama to use it");
  models::ModelArgs a = models::ModelArgs::preset(m.preset);
  if (m.n_layers) a.n_layers = *m.n_layers;
  if (m.vocab_size) a.vocab_size = *m.vocab_size;
  if (m.max_seq_len) a.max_seq_len = *m.max_seq_len;
  if (m.dim) a.dim = *m.dim;
  if (m.n_heads) a.n_heads = *m.n_heads;
  if (m.dropout_p) a.dropout_p = *m.dropout_p;
  if (a.dim % a.n_heads != 0)
    throw ConfigError("model.dim (" + std::to_string(a.dim) + ") must be divisible by model.n_heads (" +
                      std::to_string(a.n_heads) + ")");
  return a;
}

int64_t seq_len_of(const TrainConfig& cfg, const models::ModelArgs& a) {
  const int64_t seq = cfg.training.seq_len > 0 ? cfg.training.seq_len : a.max_seq_len;
  if (seq > a.max_seq_len) throw ConfigError(seq_len_too_long(cfg, seq, a.max_seq_len));
  if (cfg.training.loss_chunks > seq)
    throw ConfigError("training.loss_chunks (" + std::to_string(cfg.training.loss_chunks) +
                      ") is more than the sequence has positions (training.seq_len " + std::to_string(seq) +
                      "); use at most one piece per position");
  return seq;
}

void check_memory(const TrainConfig& cfg, const models::ModelArgs& a, int64_t seq, const RendezvousInfo& env) {
  ModelSizes m{a.n_layers, a.vocab_size, a.max_seq_len, a.dim, a.n_heads};
  if (is_llama(cfg.model)) {
    const models::LlamaArgs l = llama_args_of(cfg.model, seq);
    m = {l.num_hidden_layers, l.vocab_size,          l.max_position_embeddings,
         l.hidden_size,       l.num_attention_heads, true,
         l.intermediate_size, l.num_key_value_heads, l.head_dim,
         l.attention_bias,    l.tie_word_embeddings};
  }
  const DataParallelShape shape = data_parallel_shape(cfg, env.world_size, env.local_world_size);
  const StepSizes s{env.world_size,
                    env.local_world_size,
                    cfg.training.micro_batch_size,
                    cfg.training.gradient_accumulation_steps,
                    seq,
                    shape.shard};
  check_fits_in_memory(m, s, machine_memory_bytes());
}

torch::nn::Module& ParallelModel::module() const {
  if (llama) return *llama.ptr();
  return *model.ptr();
}

std::vector<at::Tensor> ParallelModel::parameters() const {
  if (llama) return llama->unique_parameters();
  return model->parameters();
}

at::Tensor ParallelModel::forward_loss(const at::Tensor& inputs, const at::Tensor& targets, int64_t chunks) {
  if (llama) return call_method(llama, &models::LlamaImpl::forward_loss, inputs, targets, chunks);
  return call_method(model, &models::TransformerImpl::forward_loss, inputs, targets, chunks);
}

DataParallelKind ParallelModel::kind() const {
  if (replicated.valid()) return DataParallelKind::kReplicated;
  return shape.hybrid ? DataParallelKind::kHybrid : DataParallelKind::kSharded;
}

std::string ParallelModel::description(const FsdpConfig& f, int world) const {
  const std::string strategy = to_string(f.sharding_strategy);
  if (replicated.valid()) return "replicated on " + std::to_string(world) + " rank(s), " + strategy;
  std::string where = "sharded over " + std::to_string(shape.shard) + " rank(s)";
  if (shape.hybrid) where += " in each of " + std::to_string(shape.replicate) + " replicas";
  if (tp > 1) {
    where += " (dp) x tensor-parallel over " + std::to_string(tp) + " (tp";
    where += f.vocab_parallel ? ", embedding and head split by vocabulary)" : ", embedding and head whole)";
  }
  return where + ", " + strategy;
}

ParallelModel parallelize_model(const TrainConfig& cfg, const models::ModelArgs& args, const Precision& precision,
                                int local_world_size) {
  const int world = get_world_size();
  const std::string& e = cfg.training.export_path;
  if ((e == "hf" || e.rfind("hf:", 0) == 0) && !is_llama(cfg.model))
    throw ConfigError("training.export " + e +
                      " writes a Hugging Face Llama-family directory, but model.architecture is transformer; "
                      "export auto, none or a path");
  check_model_parallel(cfg, world, args.n_heads, args.dim, args.vocab_size);
  ParallelModel m;
  m.shape = data_parallel_shape(cfg, world, local_world_size);
  check_reshard_group(cfg, m.shape);
  m.tp = static_cast<int>(cfg.fsdp_config.model_parallel_size);
  m.mesh = training_mesh(m.shape, world, m.tp, cfg.fsdp_config.device);
  m.dp_world = world / m.tp;
  m.dp_rank = m.tp > 1 ? static_cast<int>(m.mesh.get_local_rank(0)) : get_rank();
  build_model(cfg, args, precision, m);
  m.parameter_count = full_parameter_count(m.module());
  return m;
}

DeviceSupport device_support_for(const TrainConfig& cfg) {
  if (cfg.fsdp_config.device != "cuda") return DeviceSupport{};
  return DeviceSupport{cuda_available(), cuda_unavailable_reason()};
}

TensorMemory tensor_memory(const DeviceMesh& mesh) {
  if (mesh.device().is_cpu()) {
    return TensorMemory{memory::allocated_bytes() / kMiBBytes, memory::max_allocated_bytes() / kMiBBytes};
  }
  const DeviceMemoryStats s = device_memory_stats(mesh.device());
  return TensorMemory{s.allocated_bytes / kMiBBytes, s.max_allocated_bytes / kMiBBytes};
}

void reset_tensor_peak(const DeviceMesh& mesh) {
  memory::reset_peak_allocated();
  reset_peak_device_memory(mesh.device());
}

}  // namespace train
}  // namespace fsdp
