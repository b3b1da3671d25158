// llama_family.cpp — the Llama family (fsdp/models/llama.h: Llama, Mistral, Qwen2 under
// transformers' names) as a family of the trainer (models/family.h): shaped by a Hugging Face
// config.json, read once; split over tp by fsdp/models/llama_parallelize.h; planned by
// fsdp::plan::llama_spec; its weights' names are transformers' own, the tied head left out of
// the files as save_pretrained leaves it out.
#include "models/family.h"
#include "models/hf_family.h"

#include <fsdp/models/llama.h>
#include <fsdp/models/llama_hf.h>
#include <fsdp/models/llama_parallelize.h>

#include <c10/util/Exception.h>

namespace fsdp {
namespace train {
namespace {

class LlamaFamily : public ModelFamily {
 public:
  LlamaFamily(const models::LlamaArgs& args, std::string config_json, std::vector<std::string> notes)
      : args_(args), config_json_(std::move(config_json)), notes_(std::move(notes)) {}

  std::string name() const override { return "llama"; }
  ModelShape shape() const override {
    return ModelShape{args_.num_hidden_layers, args_.vocab_size, args_.max_position_embeddings, args_.hidden_size,
                      args_.num_attention_heads};
  }

  void check(const TrainConfig& cfg, int64_t seq) const override {
    try {
      args_.check_sequence_length(seq);
    } catch (const c10::Error& e) {
      throw ConfigError(config_json_ + ": key " + e.msg());
    }
    const FsdpConfig& f = cfg.fsdp_config;
    if (f.output_head_group && args_.tie_word_embeddings)
      throw ConfigError(
          "fsdp_config.output_head_group: true with tie_word_embeddings in " + config_json_ +
          " is not supported: the head's weight is the embedding's tensor, which the root holds, and one tensor "
          "cannot be in two FSDP groups; set output_head_group: false");
    const int64_t tp = f.model_parallel_size;
    if (tp == 1) return;
    try {
      models::check_llama_parallelizable(args_, tp);
    } catch (const c10::Error& e) {
      throw ConfigError("fsdp_config.model_parallel_size: " + std::to_string(tp) + ": " + e.msg());
    }
    if (f.vocab_parallel && args_.tie_word_embeddings)
      throw ConfigError(
          "fsdp_config.vocab_parallel: true (the default) cannot split tied embeddings "
          "(tie_word_embeddings in config.json) by vocabulary; set fsdp_config.vocab_parallel: false");
  }

  BuiltModel build(const OnLayerBuilt& on_layer) const override {
    models::Llama model(args_, [&](models::LlamaDecoderLayer& layer) {
      if (on_layer) on_layer(layer.ptr());
    });
    return BuiltModel{model.ptr(), model.get()};
  }

  void parallelize_layer(torch::nn::Module& layer, const tp::TensorParallelMesh& tp) const override {
    models::parallelize_llama_layer(*layer.as<models::LlamaDecoderLayerImpl>(), args_, tp);
  }
  void parallelize_rest(torch::nn::Module& model, const tp::TensorParallelMesh& tp,
                        bool vocab_parallel) const override {
    models::parallelize_llama_rest(*model.as<models::LlamaImpl>(), tp,
                                   models::ParallelizeOptions().vocab_parallel(vocab_parallel));
  }

  std::vector<PlanSize> plan_sizes() const override {
    const std::string in = " (config.json)";
    return {{"n_layers", "num_hidden_layers" + in, args_.num_hidden_layers},
            {"vocab_size", "vocab_size" + in, args_.vocab_size},
            {"max_seq_len", "max_position_embeddings" + in, args_.max_position_embeddings},
            {"dim", "hidden_size" + in, args_.hidden_size},
            {"n_heads", "num_attention_heads" + in, args_.num_attention_heads},
            {"intermediate_size", "intermediate_size" + in, args_.intermediate_size}};
  }
  plan::ModelSpec plan_spec(const std::vector<PlanSize>& sizes, const plan::ActivationOptions& activations,
                            const plan::TransformerSharding& sharding) const override {
    plan::LlamaShape s;
    s.n_layers = size_named(sizes, "n_layers");
    s.vocab_size = size_named(sizes, "vocab_size");
    s.hidden_size = size_named(sizes, "dim");
    s.intermediate_size = size_named(sizes, "intermediate_size");
    s.n_heads = size_named(sizes, "n_heads");
    s.n_kv_heads = args_.num_key_value_heads;
    s.head_dim = args_.head_dim;
    s.max_position_embeddings = size_named(sizes, "max_seq_len");
    s.attention_bias = args_.attention_bias;
    s.tie_word_embeddings = args_.tie_word_embeddings;
    return plan::llama_spec(s, activations, sharding);
  }

  std::vector<std::string> config_notes() const override { return notes_; }

  bool has_hf_format() const override { return true; }
  std::string hf_config_json(at::ScalarType dtype) const override { return models::hf_config_json(args_, dtype); }
  ShardedStateDict hf_state_dict(torch::nn::Module& model) const override {
    return without_tied_head(model, args_.tie_word_embeddings);
  }
  // Llama checkpoints converted by older transformers keep each layer's rotary inv_freq buffer
  // as a tensor; transformers skips it on load, and so does this (it is computed from the rope).
  void hf_load_tolerances(SafetensorsOptions& options) const override {
    options.ignore_unexpected({R"(^model\.layers\.[0-9]+\.self_attn\.rotary_emb\.inv_freq$)"});
  }
  bool hf_state_dict_is_whole() const override { return !args_.tie_word_embeddings; }

 private:
  models::LlamaArgs args_;
  std::string config_json_;
  std::vector<std::string> notes_;
};

}  // namespace

std::unique_ptr<const ModelFamily> make_llama_family(const FamilySource& source) {
  refuse_size_keys(source.cfg.model, "llama");
  const std::string& config_json = require_config_json(source, "llama");
  try {
    std::vector<std::string> notes;
    models::LlamaArgs args = models::llama_args_from_hf_config_text(source.config_json_text, config_json,
                                                                    source.cfg.training.seq_len, &notes);
    return std::make_unique<LlamaFamily>(args, config_json, std::move(notes));
  } catch (const c10::Error& e) {
    throw ConfigError(e.msg());
  }
}

std::vector<std::string> llama_hf_architectures() { return models::llama_hf_architectures(); }

}  // namespace train
}  // namespace fsdp
