// config.json <-> Gpt2Args (fsdp/models/gpt2_hf.h), read as transformers' GPT2Config reads it.
// Every refusal names the file and the key.
#include <fsdp/models/gpt2_hf.h>

#include "src/models/hf_config.h"

#include <c10/util/Exception.h>

namespace fsdp {
namespace models {
namespace {

using hf_config::Json;
using hf_config::Reader;

constexpr const char* kArchitecture = "GPT2LMHeadModel";

// GPT2Config's name for a size, else transformers' common alias (its attribute_map), else the
// default.
int64_t size_or(const Reader& r, const std::string& key, const std::string& alias, int64_t fallback) {
  return r.integer_or(r.has(key) || !r.has(alias) ? key : alias, fallback);
}

// GPT2Config's options that change the arithmetic in ways the model does not compute.
void check_unsupported(const Reader& r) {
  if (r.flag_or("scale_attn_by_inverse_layer_idx", false))
    r.fail("scale_attn_by_inverse_layer_idx", "is true; the scores are not scaled by layer here; set it to false");
  if (r.flag_or("reorder_and_upcast_attn", false))
    r.fail("reorder_and_upcast_attn", "is true; the attention is not reordered and upcast here; set it to false");
  if (r.flag_or("add_cross_attention", false))
    r.fail("add_cross_attention", "is true; GPT2LMHeadModel's cross-attention is not computed here");
}

}  // namespace

const std::vector<std::string>& gpt2_hf_architectures() {
  static const std::vector<std::string> names = {kArchitecture};
  return names;
}

Gpt2Args gpt2_args_from_hf_config_text(const std::string& text, const std::string& config_path) {
  const Json j = hf_config::parse(text, config_path);
  const Reader r{config_path, j};
  r.architecture(gpt2_hf_architectures(), "fsdp::models::Gpt2");
  check_unsupported(r);
  // GPT2Config's defaults (openai-community/gpt2's sizes) for what is missing, as AutoConfig.
  Gpt2Args a;
  a.vocab_size = r.integer_or("vocab_size", 50257);
  a.n_positions = size_or(r, "n_positions", "max_position_embeddings", 1024);
  a.n_embd = size_or(r, "n_embd", "hidden_size", 768);
  a.n_layer = size_or(r, "n_layer", "num_hidden_layers", 12);
  a.n_head = size_or(r, "n_head", "num_attention_heads", 12);
  a.n_inner = r.integer_or("n_inner", 4 * a.n_embd);
  a.layer_norm_epsilon = r.number_or("layer_norm_epsilon", 1e-5);
  if (r.has("activation_function")) {
    if (!j.at("activation_function").is_string())
      r.fail("activation_function", "is " + j.at("activation_function").dump() + ", not a string");
    a.activation_function = j.at("activation_function").get<std::string>();
    if (a.activation_function != "gelu_new" && a.activation_function != "gelu_pytorch_tanh" &&
        a.activation_function != "gelu")
      r.fail("activation_function",
             "is \"" + a.activation_function + "\"; fsdp::models::Gpt2 computes gelu_new, gelu_pytorch_tanh and gelu");
  }
  a.scale_attn_weights = r.flag_or("scale_attn_weights", true);
  a.tie_word_embeddings = r.flag_or("tie_word_embeddings", true);
  a.embd_pdrop = r.number_or("embd_pdrop", 0.1);
  a.attn_pdrop = r.number_or("attn_pdrop", 0.1);
  a.resid_pdrop = r.number_or("resid_pdrop", 0.1);
  a.initializer_range = r.number_or("initializer_range", 0.02);
  hf_config::check_args(a, config_path);
  return a;
}

std::string gpt2_hf_config_json(const Gpt2Args& args, at::ScalarType dtype) {
  const Json j = {{"architectures", {kArchitecture}},
                  {"model_type", "gpt2"},
                  {"vocab_size", args.vocab_size},
                  {"n_positions", args.n_positions},
                  {"n_embd", args.n_embd},
                  {"n_layer", args.n_layer},
                  {"n_head", args.n_head},
                  {"n_inner", args.n_inner},
                  {"activation_function", args.activation_function},
                  {"layer_norm_epsilon", args.layer_norm_epsilon},
                  {"scale_attn_weights", args.scale_attn_weights},
                  {"scale_attn_by_inverse_layer_idx", false},
                  {"reorder_and_upcast_attn", false},
                  {"add_cross_attention", false},
                  {"tie_word_embeddings", args.tie_word_embeddings},
                  {"embd_pdrop", args.embd_pdrop},
                  {"attn_pdrop", args.attn_pdrop},
                  {"resid_pdrop", args.resid_pdrop},
                  {"initializer_range", args.initializer_range},
                  {"dtype", hf_config::dtype_name(dtype)},
                  {"torch_dtype", hf_config::dtype_name(dtype)}};
  return j.dump(2) + "\n";
}

}  // namespace models
}  // namespace fsdp
