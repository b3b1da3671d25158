// transformer_family.cpp — the reference Transformer (fsdp/models/transformer.h) as a family of
// the trainer (models/family.h): shaped by model.preset and the model size keys, split over tp
// by fsdp/models/parallelize.h, planned by fsdp::plan::transformer_spec. It is no model of
// transformers', so it has no Hugging Face format.
#include "models/family.h"

#include <fsdp/models/parallelize.h>
#include <fsdp/models/transformer.h>

#include <c10/util/Exception.h>

namespace fsdp {
namespace train {
namespace {

models::ModelArgs args_of(const TrainConfig& cfg) {
  const ModelConfig& m = cfg.model;
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

class TransformerFamily : public ModelFamily {
 public:
  explicit TransformerFamily(const models::ModelArgs& args) : args_(args) {}

  std::string name() const override { return "transformer"; }
  ModelShape shape() const override {
    return ModelShape{args_.n_layers, args_.vocab_size, args_.max_seq_len, args_.dim, args_.n_heads, args_.dropout_p};
  }
  void check(const TrainConfig&, int64_t) const override {}

  BuiltModel build(const OnLayerBuilt& on_layer) const override {
    models::Transformer model(args_, [&](models::TransformerBlock& block) {
      if (on_layer) on_layer(block.ptr());
    });
    return BuiltModel{model.ptr(), model.get()};
  }

  void parallelize_layer(torch::nn::Module& layer, const tp::TensorParallelMesh& tp) const override {
    models::parallelize_block(*layer.as<models::TransformerBlockImpl>(), args_, tp);
  }
  void parallelize_rest(torch::nn::Module& model, const tp::TensorParallelMesh& tp,
                        bool vocab_parallel) const override {
    if (vocab_parallel) models::parallelize_vocab(*model.as<models::TransformerImpl>(), tp);
    tp::register_replicated(model, tp);
  }

  std::vector<PlanSize> plan_sizes() const override {
    return {{"n_layers", "model.n_layers", args_.n_layers},
            {"vocab_size", "model.vocab_size", args_.vocab_size},
            {"max_seq_len", "model.max_seq_len", args_.max_seq_len},
            {"dim", "model.dim", args_.dim},
            {"n_heads", "model.n_heads", args_.n_heads}};
  }
  plan::ModelSpec plan_spec(const std::vector<PlanSize>& sizes, const plan::ActivationOptions& activations,
                            const plan::TransformerSharding& sharding) const override {
    const plan::TransformerShape shape{size_named(sizes, "n_layers"),    size_named(sizes, "vocab_size"),
                                       size_named(sizes, "max_seq_len"), size_named(sizes, "dim"),
                                       size_named(sizes, "n_heads"),     args_.dropout_p};
    return plan::transformer_spec(shape, activations, sharding);
  }

  bool has_hf_format() const override { return false; }
  std::string hf_config_json(at::ScalarType) const override { throw no_hf_format(); }
  ShardedStateDict hf_state_dict(torch::nn::Module&) const override { throw no_hf_format(); }
  bool hf_state_dict_is_whole() const override { return true; }

 private:
  static ConfigError no_hf_format() {
    return ConfigError(
        "model.architecture transformer is fsdp-cpp's own model, not one of transformers': it has no Hugging "
        "Face directory to read or write; export auto, none, a .safetensors path or a PyTorch file");
  }

  models::ModelArgs args_;
};

}  // namespace

std::unique_ptr<const ModelFamily> make_transformer_family(const FamilySource& source) {
  if (!source.config_json_path.empty())
    throw ConfigError(source.config_json_path +
                      " (a Hugging Face config.json) does not shape model.architecture transformer, whose shape is "
                      "model.preset and the model size keys; remove model.hf_config");
  return std::make_unique<TransformerFamily>(args_of(source.cfg));
}

std::vector<std::string> transformer_hf_architectures() { return {}; }

}  // namespace train
}  // namespace fsdp
