// gpt2_family.cpp — GPT-2 (fsdp/models/gpt2.h: transformers' GPT2LMHeadModel under its names) as
// a family of the trainer (models/family.h): shaped by a Hugging Face config.json, read once;
// planned by fsdp::plan::gpt2_spec; its weights' names are transformers' own, the tied head left
// out of the files as save_pretrained leaves it out. It has no tensor-parallel plan yet: a
// model_parallel_size above 1 is refused.
#include "models/family.h"
#include "models/hf_family.h"

#include <fsdp/models/gpt2.h>
#include <fsdp/models/gpt2_hf.h>

#include <c10/util/Exception.h>

#include <algorithm>

namespace fsdp {
namespace train {
namespace {

class Gpt2Family : public ModelFamily {
 public:
  Gpt2Family(const models::Gpt2Args& args, std::string config_json)
      : args_(args), config_json_(std::move(config_json)) {}

  std::string name() const override { return "gpt2"; }
  ModelShape shape() const override {
    return ModelShape{args_.n_layer,     args_.vocab_size,
                      args_.n_positions, args_.n_embd,
                      args_.n_head,      std::max({args_.embd_pdrop, args_.attn_pdrop, args_.resid_pdrop})};
  }

  void check(const TrainConfig& cfg, int64_t /*seq*/) const override {
    const FsdpConfig& f = cfg.fsdp_config;
    if (f.output_head_group && args_.tie_word_embeddings)
      throw ConfigError(
          "fsdp_config.output_head_group: true with tie_word_embeddings in " + config_json_ +
          " is not supported: the head's weight is wte's tensor, which the root holds, and one tensor cannot be in "
          "two FSDP groups; set output_head_group: false");
    if (f.model_parallel_size > 1)
      throw ConfigError("fsdp_config.model_parallel_size: " + std::to_string(f.model_parallel_size) +
                        ": tensor parallelism is not supported yet for gpt2 (it has no tensor-parallel plan); set "
                        "model_parallel_size: 1");
  }

  BuiltModel build(const OnLayerBuilt& on_layer) const override {
    models::Gpt2 model(args_, [&](models::Gpt2Block& block) {
      if (on_layer) on_layer(block.ptr());
    });
    return BuiltModel{model.ptr(), model.get()};
  }

  // check() refuses model_parallel_size > 1, so the trainer never asks for a split.
  void parallelize_layer(torch::nn::Module& /*layer*/, const tp::TensorParallelMesh& /*tp*/) const override {
    TORCH_CHECK(false, "tensor parallelism is not supported yet for gpt2; set fsdp_config.model_parallel_size: 1");
  }
  void parallelize_rest(torch::nn::Module& /*model*/, const tp::TensorParallelMesh& /*tp*/,
                        bool /*vocab_parallel*/) const override {
    TORCH_CHECK(false, "tensor parallelism is not supported yet for gpt2; set fsdp_config.model_parallel_size: 1");
  }

  std::vector<PlanSize> plan_sizes() const override {
    const std::string in = " (config.json)";
    return {{"n_layers", "n_layer" + in, args_.n_layer},
            {"vocab_size", "vocab_size" + in, args_.vocab_size},
            {"max_seq_len", "n_positions" + in, args_.n_positions},
            {"dim", "n_embd" + in, args_.n_embd},
            {"n_heads", "n_head" + in, args_.n_head},
            {"intermediate_size", "n_inner" + in, args_.n_inner}};
  }
  plan::ModelSpec plan_spec(const std::vector<PlanSize>& sizes, const plan::ActivationOptions& activations,
                            const plan::TransformerSharding& sharding) const override {
    plan::Gpt2Shape s;
    s.n_layers = size_named(sizes, "n_layers");
    s.vocab_size = size_named(sizes, "vocab_size");
    s.n_positions = size_named(sizes, "max_seq_len");
    s.n_embd = size_named(sizes, "dim");
    s.n_heads = size_named(sizes, "n_heads");
    s.n_inner = size_named(sizes, "intermediate_size");
    s.tie_word_embeddings = args_.tie_word_embeddings;
    s.embd_pdrop = args_.embd_pdrop;
    s.attn_pdrop = args_.attn_pdrop;
    s.resid_pdrop = args_.resid_pdrop;
    return plan::gpt2_spec(s, activations, sharding);
  }

  bool has_hf_format() const override { return true; }
  std::string hf_config_json(at::ScalarType dtype) const override { return models::gpt2_hf_config_json(args_, dtype); }
  ShardedStateDict hf_state_dict(torch::nn::Module& model) const override {
    return without_tied_head(model, args_.tie_word_embeddings);
  }
  // The Hub's original GPT-2 files (openai-community/gpt2 and its sizes) name the base model's
  // tensors without "transformer." and keep each block's causal mask ("h.N.attn.bias", and
  // "attn.masked_bias" in older ones) as tensors; transformers loads them so, and so does this.
  void hf_load_tolerances(SafetensorsOptions& options) const override {
    options.optional_key_prefix("transformer.");
    options.ignore_unexpected({R"(^(transformer\.)?h\.[0-9]+\.attn\.(masked_)?bias$)"});
  }
  bool hf_state_dict_is_whole() const override { return !args_.tie_word_embeddings; }

 private:
  models::Gpt2Args args_;
  std::string config_json_;
};

}  // namespace

std::unique_ptr<const ModelFamily> make_gpt2_family(const FamilySource& source) {
  refuse_size_keys(source.cfg.model, "gpt2");
  const std::string& config_json = require_config_json(source, "gpt2");
  try {
    return std::make_unique<Gpt2Family>(models::gpt2_args_from_hf_config_text(source.config_json_text, config_json),
                                        config_json);
  } catch (const c10::Error& e) {
    throw ConfigError(e.msg());
  }
}

std::vector<std::string> gpt2_hf_architectures() { return models::gpt2_hf_architectures(); }

}  // namespace train
}  // namespace fsdp
