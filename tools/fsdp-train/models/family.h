// family.h — one model family behind one interface: the trainer's side of a model of
// fsdp::models. A family reads its args once (from the YAML's model keys or a config.json),
// builds its model layer by layer, splits a layer and the rest over tensor parallelism as its
// plan says, gives the planner its spec, and names its weights as Hugging Face files do. The
// logits, the loss over the chunked head and activation checkpointing per decoder layer are the
// library's, written once (fsdp/models/causal_lm.h); how each layer is sharded is the trainer's
// (model_setup.cpp). The families are registered in one place (registry.cpp), which chooses one
// per run; nothing else of the trainer names a family.
#pragma once

#include "config/config.h"
#include "models/model_shape.h"

#include <fsdp/models/causal_lm.h>
#include <fsdp/plan.h>
#include <fsdp/safetensors.h>
#include <fsdp/state_dict.h>
#include <fsdp/tensor_parallel.h>

#include <c10/core/ScalarType.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace fsdp {
namespace train {

// A model as its family built it: the root module and the same object as a language model.
struct BuiltModel {
  std::shared_ptr<torch::nn::Module> module;
  models::CausalLM* lm = nullptr;
};

// Called with each decoder layer right after it is built, before the next one exists: sharding
// it there keeps at most one layer whole on a rank.
using OnLayerBuilt = std::function<void(const std::shared_ptr<torch::nn::Module>& layer)>;

// What a family reads its args from, once: the configuration's model keys, and the config.json
// that shapes the model (model.hf_config, or model.init_from's), already read by the registry.
struct FamilySource {
  const TrainConfig& cfg;
  std::string config_json_path;  // "" when there is none
  std::string config_json_text;  // its text
};

class ModelFamily {
 public:
  virtual ~ModelFamily() = default;

  // The family's name: model.architecture's value for it.
  virtual std::string name() const = 0;
  // The sizes every family has (ModelShape), which the trainer's checks and reports read.
  virtual ModelShape shape() const = 0;
  // What reading its args decided that the files do not say plainly (for example which of two
  // disagreeing objects of a config.json is used), one line each, for the start-up log.
  virtual std::vector<std::string> config_notes() const { return {}; }

  // The family's own refusals of a configuration, each a ConfigError naming the key: sizes it
  // cannot train at sequence length `seq` (training.seq_len resolved), a tensor-parallel size its
  // plan cannot split over, options it does not support yet.
  virtual void check(const TrainConfig& cfg, int64_t seq) const = 0;

  // The whole model on this rank, its initial values drawn from the global generator (seed it
  // the same on every rank first); on_layer (may be empty) sees each decoder layer as it is built.
  virtual BuiltModel build(const OnLayerBuilt& on_layer) const = 0;

  // Its tensor-parallel plan (torchtitan's parallelize, beside the model): one decoder layer split
  // in place over `tp`, then, once the layers are built, the embedding and the head (split by
  // vocabulary when vocab_parallel) and every parameter left whole registered on the tp mesh.
  // check() has refused what the plan cannot split.
  virtual void parallelize_layer(torch::nn::Module& layer, const tp::TensorParallelMesh& tp) const = 0;
  virtual void parallelize_rest(torch::nn::Module& model, const tp::TensorParallelMesh& tp,
                                bool vocab_parallel) const = 0;

  // The planner's model (fsdp/plan.h) of this family with `sizes` (those of plan_sizes(), some
  // perhaps changed: the memory check and `fsdp-train plan --memory-per-rank` vary them) for
  // these activations and this sharding. Throws std::invalid_argument for what the planner refuses.
  virtual plan::ModelSpec plan_spec(const std::vector<PlanSize>& sizes, const plan::ActivationOptions& activations,
                                    const plan::TransformerSharding& sharding) const = 0;
  // Its sizes as the planner takes them, each with the key a user sets it by.
  virtual std::vector<PlanSize> plan_sizes() const = 0;

  // Hugging Face: whether the family is one of transformers' models, its config.json in
  // `dtype`, and the model's state dict under the names its files use (what transformers leaves
  // out, such as a tied head, left out). The tensors are the model's own (sharded) ones.
  virtual bool has_hf_format() const = 0;
  virtual std::string hf_config_json(at::ScalarType dtype) const = 0;
  virtual ShardedStateDict hf_state_dict(torch::nn::Module& model) const = 0;
  // How its Hugging Face files may name tensors otherwise than hf_state_dict, as transformers
  // loads them: tensors it skips (options.ignore_unexpected) and the base model's prefix that
  // files may leave out (options.optional_key_prefix). The default: the files name exactly
  // hf_state_dict's tensors.
  virtual void hf_load_tolerances(SafetensorsOptions& /*options*/) const {}
  // Whether every tensor of the model's state dict is in hf_state_dict (false when some is
  // another's alias: load_sharded_state_dict then loads non-strict).
  virtual bool hf_state_dict_is_whole() const = 0;
};

}  // namespace train
}  // namespace fsdp
