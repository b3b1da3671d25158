// config.json <-> Gpt2Args (fsdp/models/gpt2_hf.h), read as transformers' GPT2Config reads it.
// Every refusal names the file and the key.
#include <fsdp/models/gpt2_hf.h>

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

namespace fsdp {
namespace models {
namespace {

using Json = nlohmann::json;

constexpr const char* kArchitecture = "GPT2LMHeadModel";

struct Reader {
  const std::string& path;
  const Json& j;

  [[noreturn]] void fail(const std::string& key, const std::string& problem) const {
    TORCH_CHECK(false, path, ": key '", key, "' ", problem);
  }
  bool has(const std::string& key) const { return j.contains(key) && !j.at(key).is_null(); }
  // GPT2Config's name for a size, else transformers' common alias (attribute_map), else the default.
  int64_t integer(const std::string& key, const std::string& alias, int64_t fallback) const {
    const std::string& k = has(key) || alias.empty() || !has(alias) ? key : alias;
    if (!has(k)) return fallback;
    if (!j.at(k).is_number_integer()) fail(k, "is " + j.at(k).dump() + ", not an integer");
    return j.at(k).get<int64_t>();
  }
  double number(const std::string& key, double fallback) const {
    if (!has(key)) return fallback;
    if (!j.at(key).is_number()) fail(key, "is " + j.at(key).dump() + ", not a number");
    return j.at(key).get<double>();
  }
  bool flag(const std::string& key, bool fallback) const {
    if (!has(key)) return fallback;
    if (!j.at(key).is_boolean()) fail(key, "is " + j.at(key).dump() + ", not true or false");
    return j.at(key).get<bool>();
  }
};

void check_architecture(const Reader& r) {
  if (!r.has("architectures")) r.fail("architectures", std::string("is missing; name ") + kArchitecture);
  const Json& a = r.j.at("architectures");
  if (!a.is_array() || a.size() != 1 || !a.at(0).is_string())
    r.fail("architectures", "is " + a.dump() + "; expected a list of one name");
  if (a.at(0) != kArchitecture)
    r.fail("architectures", "names " + a.at(0).get<std::string>() + ", which fsdp::models::Gpt2 does not compute; " +
                                "supported: " + kArchitecture);
}

// GPT2Config's options that change the arithmetic in ways the model does not compute.
void check_unsupported(const Reader& r) {
  if (r.flag("scale_attn_by_inverse_layer_idx", false))
    r.fail("scale_attn_by_inverse_layer_idx", "is true; the scores are not scaled by layer here; set it to false");
  if (r.flag("reorder_and_upcast_attn", false))
    r.fail("reorder_and_upcast_attn", "is true; the attention is not reordered and upcast here; set it to false");
  if (r.flag("add_cross_attention", false))
    r.fail("add_cross_attention", "is true; GPT2LMHeadModel's cross-attention is not computed here");
}

const char* dtype_name(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return "float32";
    case at::kBFloat16: return "bfloat16";
    case at::kHalf: return "float16";
    default: TORCH_CHECK(false, "gpt2_hf_config_json: dtype ", dtype, " is not one of float32, bfloat16, float16");
  }
}

}  // namespace

const std::vector<std::string>& gpt2_hf_architectures() {
  static const std::vector<std::string> names = {kArchitecture};
  return names;
}

Gpt2Args gpt2_args_from_hf_config_text(const std::string& text, const std::string& config_path) {
  const Json j = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  TORCH_CHECK(j.is_object(), config_path, ": is not a JSON object; expected a transformers config.json");
  const Reader r{config_path, j};
  check_architecture(r);
  check_unsupported(r);
  // GPT2Config's defaults (openai-community/gpt2's sizes) for what is missing, as AutoConfig.
  Gpt2Args a;
  a.vocab_size = r.integer("vocab_size", "", 50257);
  a.n_positions = r.integer("n_positions", "max_position_embeddings", 1024);
  a.n_embd = r.integer("n_embd", "hidden_size", 768);
  a.n_layer = r.integer("n_layer", "num_hidden_layers", 12);
  a.n_head = r.integer("n_head", "num_attention_heads", 12);
  a.n_inner = r.integer("n_inner", "", 4 * a.n_embd);
  a.layer_norm_epsilon = r.number("layer_norm_epsilon", 1e-5);
  if (r.has("activation_function")) {
    if (!j.at("activation_function").is_string())
      r.fail("activation_function", "is " + j.at("activation_function").dump() + ", not a string");
    a.activation_function = j.at("activation_function").get<std::string>();
    if (a.activation_function != "gelu_new" && a.activation_function != "gelu_pytorch_tanh" &&
        a.activation_function != "gelu")
      r.fail("activation_function",
             "is \"" + a.activation_function + "\"; fsdp::models::Gpt2 computes gelu_new, gelu_pytorch_tanh and gelu");
  }
  a.scale_attn_weights = r.flag("scale_attn_weights", true);
  a.tie_word_embeddings = r.flag("tie_word_embeddings", true);
  a.embd_pdrop = r.number("embd_pdrop", 0.1);
  a.attn_pdrop = r.number("attn_pdrop", 0.1);
  a.resid_pdrop = r.number("resid_pdrop", 0.1);
  a.initializer_range = r.number("initializer_range", 0.02);
  try {
    a.check();
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, config_path, ": ", e.msg());
  }
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
                  {"dtype", dtype_name(dtype)},
                  {"torch_dtype", dtype_name(dtype)}};
  return j.dump(2) + "\n";
}

}  // namespace models
}  // namespace fsdp
