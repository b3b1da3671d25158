// What the Hugging Face-shaped families share (hf_family.h).
#include "models/hf_family.h"

#include <utility>

namespace fsdp {
namespace train {

void refuse_size_keys(const ModelConfig& m, const std::string& family) {
  for (const auto& [key, set] : {std::pair<const char*, bool>{"n_layers", m.n_layers.has_value()},
                                 {"vocab_size", m.vocab_size.has_value()},
                                 {"max_seq_len", m.max_seq_len.has_value()},
                                 {"dim", m.dim.has_value()},
                                 {"n_heads", m.n_heads.has_value()},
                                 {"dropout_p", m.dropout_p.has_value()}})
    if (set)
      throw ConfigError(std::string("model.") + key + " does not apply to model.architecture " + family +
                        ", which takes its shape from its config.json; remove it");
}

const std::string& require_config_json(const FamilySource& source, const std::string& family) {
  if (source.config_json_path.empty())
    throw ConfigError("model.architecture " + family +
                      " needs its shape from a Hugging Face config.json: set model.hf_config to one, or "
                      "model.init_from to a Hugging Face model directory");
  return source.config_json_path;
}

ShardedStateDict without_tied_head(torch::nn::Module& model, bool tie_word_embeddings) {
  ShardedStateDict out;
  for (const auto& item : sharded_state_dict(model)) {
    if (tie_word_embeddings && item.key() == "lm_head.weight") continue;
    out.insert(item.key(), item.value());
  }
  return out;
}

}  // namespace train
}  // namespace fsdp
