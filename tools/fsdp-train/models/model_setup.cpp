// model_setup.cpp — the configuration turned into a model on its mesh (model_setup.h).
#include "models/model_setup.h"

#include "common/errors.h"

#include <fsdp/call.h>
#include <fsdp/checkpoint_activations.h>
#include <fsdp/device.h>
#include <fsdp/distributed.h>
#include <fsdp/fully_shard.h>
#include <fsdp/memory.h>
#include <fsdp/mixed_precision.h>
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
// the family's key that gave max_seq_len.
std::string seq_len_too_long(const TrainConfig& cfg, const ModelFamily& family, int64_t seq, int64_t max_seq_len) {
  const std::string seq_at = origin_of(cfg, "training.seq_len");
  std::string max_key = "model.max_seq_len";
  for (const PlanSize& s : family.plan_sizes())
    if (s.name == "max_seq_len") max_key = s.key;
  // A YAML key was set on a line, or came from the preset; a config.json key says its file.
  const bool yaml_key = max_key.rfind("model.", 0) == 0;
  const std::string max_at = yaml_key ? origin_of(cfg, max_key) : "";
  const std::string max_from = !yaml_key        ? ""
                               : max_at.empty() ? ", model.preset " + cfg.model.preset + "'s"
                                                : ", set at " + max_at;
  return (seq_at.empty() ? std::string() : seq_at + ": ") + "training.seq_len (" + std::to_string(seq) +
         ") is longer than " + max_key + " (" + std::to_string(max_seq_len) + max_from +
         "); lower training.seq_len or raise " + max_key;
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

// "names are like a, b, c, ...": the model's first parameters, for a message.
std::string some_parameter_names(const torch::nn::Module& model) {
  std::string names;
  int shown = 0;
  for (const auto& item : model.named_parameters()) {
    if (shown++ == 4) return names + ", ...";
    names += (names.empty() ? "names are like " : ", ") + item.key();
  }
  return names;
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
      throw ConfigError("model.freeze: '" + terminal_safe(entry) + "' names no parameter of the model (" +
                        some_parameter_names(model) + ")");
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
  if (f.quantized_gradients) {
    o.quantized_gradients(format(*f.quantized_gradients).skip_zero_blocks(f.quantized_gradients_skip_zero_blocks));
  }
  if (f.diloco_inner_steps > 0) o.mesh(m.mesh["shard"]);
}

// Every decoder layer is its own group as soon as it is built (split over tp first with
// model_parallel_size k > 1, by the family's plan: the Megatron plan, the layer's norms whole,
// then sharded over dp); then, with tp, the embedding and the head (split by vocabulary with
// vocab_parallel); with output_head_group, the final norm and the head a group of their own;
// the root holds the rest (the embeddings, the final norm, the head). On a 2-D mesh
// (HYBRID_SHARD*) the same calls shard within each replica. The values are those of building
// the whole model first (fully_shard draws no random numbers), so a seed gives the same run
// either way.
BuiltModel sharded_model(const TrainConfig& cfg, const ModelFamily& family, const ParallelModel& m,
                         const MixedPrecisionPolicy& policy, const std::optional<CPUOffloadPolicy>& offload) {
  const FsdpConfig& f = cfg.fsdp_config;
  const bool reshard = reshard_after_forward(cfg);
  FullyShardOptions layer_options =
      FullyShardOptions().mesh(m.mesh).reshard_after_forward(reshard).mp_policy(policy).offload_policy(offload);
  if (f.reshard_after_forward) layer_options.reshard_after_forward(*f.reshard_after_forward);
  // The root's parameters are needed first in backward, so it keeps them gathered (FSDP2's
  // default for the root) unless SHARD_GRAD_OP says to keep everything anyway.
  FullyShardOptions root_options = FullyShardOptions().mesh(m.mesh).mp_policy(policy).offload_policy(offload);
  if (!reshard) root_options.reshard_after_forward(false);
  add_link_options(f, m, layer_options);
  add_link_options(f, m, root_options);
  std::optional<tp::TensorParallelMesh> tp;
  if (m.tp > 1) {
    const auto dp_dims = DataParallelMeshDims().shard("dp");
    layer_options.dp_mesh_dims(dp_dims);
    root_options.dp_mesh_dims(dp_dims);
    tp.emplace(m.mesh, "tp");
  }
  BuiltModel built = family.build([&](const std::shared_ptr<torch::nn::Module>& layer) {
    if (tp) family.parallelize_layer(*layer, *tp);
    fully_shard(layer, layer_options);
  });
  if (tp) family.parallelize_rest(*built.module, *tp, f.vocab_parallel);
  if (f.output_head_group) {
    // The head runs backward first, so keeping it gathered from forward saves an all-gather and
    // no memory (torchtitan does the same for its last group); it reshards after its backward.
    FullyShardOptions head_options = layer_options;
    head_options.reshard_after_forward(false);
    fully_shard(
        std::vector<std::shared_ptr<torch::nn::Module>>{built.lm->final_norm_module(), built.lm->output_head().ptr()},
        head_options);
  }
  fully_shard(built.module, root_options);
  return built;
}

// fsdp_config.prefetch_depth k > 1: each group all-gathers the next k groups, in forward in the
// order the groups start (the root, the blocks, the head group) and in backward in the reverse of
// the order they finish forward (the root, the head group, the blocks from the last). A head group,
// last in forward, gathers the last k blocks for their backward while the loss is computed
// (FSDPModule::set_modules_to_forward_prefetch keeps those for the backward). Depth 1 keeps
// FSDP2's implicit prefetch, which does the same for one group.
void prefetch_ahead(const FSDPModule& root, const std::vector<FSDPModule>& blocks, FSDPModule head, int64_t depth) {
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
void prefetch_ahead_in(const FsdpConfig& f, const FSDPModule& root, models::CausalLM& lm) {
  std::vector<FSDPModule> groups;
  for (const auto& layer : lm.decoder_layer_modules()) groups.push_back(get_fsdp_module(*layer));
  const FSDPModule head = f.output_head_group ? get_fsdp_module(*lm.final_norm_module()) : FSDPModule();
  prefetch_ahead(root, groups, head, f.prefetch_depth);
}

// The model as the strategy makes it, frozen where configured, with activation checkpointing.
void build_model(const TrainConfig& cfg, const ModelFamily& family, const Precision& precision, ParallelModel& m) {
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
  if (f.sharding_strategy == ShardingStrategy::NO_SHARD) {
    // Whole parameters on every rank, gradients averaged in buckets during backward (DDP). The
    // gradients are views of the buckets: backward accumulates into what is all-reduced, so
    // there is neither a copy nor a second set of gradients in memory.
    m.built = family.build(nullptr);
    freeze_parameters(cfg.model, *m.built.module);  // before replicate, which buckets only what trains
    m.replicated = replicate(m.built.module, ReplicateOptions().mesh(m.mesh).gradient_as_bucket_view(true));
  } else {
    m.built = sharded_model(cfg, family, m, policy, offload);
    m.root = get_fsdp_module(*m.built.module);
    prefetch_ahead_in(f, m.root, *m.built.lm);
    if (f.reduce_scatter_max_input_buffers > 1)
      m.root.set_reduce_scatter_max_input_buffers(f.reduce_scatter_max_input_buffers);
    freeze_parameters(cfg.model, *m.built.module);  // the shards: FSDP follows their requires_grad
  }
  if (f.activation_checkpointing) {
    m.built.lm->set_activation_checkpointing(f.activation_checkpointing_every,
                                             CheckpointOptions().use_reentrant(f.use_reentrant));
  }
  m.build_peak_tensor_bytes = static_cast<int64_t>(tensor_memory(m.mesh).peak_mib * kMiBBytes);
}

}  // namespace

int64_t seq_len_of(const TrainConfig& cfg, const ModelFamily& family) {
  const int64_t max_seq_len = family.shape().max_seq_len;
  const int64_t seq = cfg.training.seq_len > 0 ? cfg.training.seq_len : max_seq_len;
  if (seq > max_seq_len) throw ConfigError(seq_len_too_long(cfg, family, seq, max_seq_len));
  if (cfg.training.loss_chunks > seq)
    throw ConfigError("training.loss_chunks (" + std::to_string(cfg.training.loss_chunks) +
                      ") is more than the sequence has positions (training.seq_len " + std::to_string(seq) +
                      "); use at most one piece per position");
  family.check(cfg, seq);
  return seq;
}

std::vector<at::Tensor> ParallelModel::parameters() const { return models::unique_parameters(*built.module); }

at::Tensor ParallelModel::forward_loss(const at::Tensor& inputs, const at::Tensor& targets, int64_t chunks) {
  models::CausalLM* lm = built.lm;
  return call_as_forward(
      built.module,
      [lm, chunks](const at::Tensor& in, const at::Tensor& tg) { return lm->forward_loss(in, tg, chunks); }, inputs,
      targets);
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

ParallelModel parallelize_model(const TrainConfig& cfg, const ModelFamily& family, const Precision& precision,
                                int local_world_size) {
  const int world = get_world_size();
  const std::string& e = cfg.training.export_path;
  if ((e == "hf" || e.rfind("hf:", 0) == 0) && !family.has_hf_format())
    family.hf_config_json(at::kFloat);  // throws the family's ConfigError: it has no Hugging Face format
  const ModelShape shape = family.shape();
  check_model_parallel(cfg, world, shape.n_heads, shape.dim, shape.vocab_size);
  ParallelModel m;
  m.shape = data_parallel_shape(cfg, world, local_world_size);
  check_reshard_group(cfg, m.shape);
  m.tp = static_cast<int>(cfg.fsdp_config.model_parallel_size);
  m.mesh = training_mesh(m.shape, world, m.tp, cfg.fsdp_config.device);
  m.dp_world = world / m.tp;
  m.dp_rank = m.tp > 1 ? static_cast<int>(m.mesh.get_local_rank(0)) : get_rank();
  build_model(cfg, family, precision, m);
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
