// config.json <-> LlamaArgs (fsdp/models/llama_hf.h). Every refusal names the file and the key,
// so that a user can tell which field of which checkpoint the decoder does not compute.
#include <fsdp/models/llama_hf.h>

#include "src/models/hf_config.h"

#include <c10/util/Exception.h>

#include <vector>

namespace fsdp {
namespace models {
namespace {

using hf_config::Json;
using hf_config::Reader;

// Python's truth value of a JSON value, which transformers' `rope_scaling or rope_parameters` tests.
bool truthy(const Json& v) {
  if (v.is_null()) return false;
  if (v.is_boolean()) return v.get<bool>();
  if (v.is_number()) return v.get<double>() != 0;
  if (v.is_string() || v.is_array() || v.is_object()) return !v.empty();
  return true;
}

// The rope object as transformers 5.25 completes it (standardize_rope_params): rope_type from
// the older "type" key or "default", rope_theta from the top level or 10000, and
// original_max_position_embeddings from max_position_embeddings for the scaled types.
Json completed_rope(const Reader& r, Json p) {
  if (!p.is_object()) return p;
  if (!p.contains("rope_type")) p["rope_type"] = p.value("type", Json("default"));
  p.erase("type");
  if (!p.contains("rope_theta")) p["rope_theta"] = r.has("rope_theta") ? r.j.at("rope_theta") : Json(10000.0);
  const Json& type = p.at("rope_type");
  if (type == "llama3" || type == "yarn" || type == "longrope") {
    if (!p.contains("original_max_position_embeddings") && r.has("max_position_embeddings"))
      p["original_max_position_embeddings"] = r.j.at("max_position_embeddings");
  }
  return p;
}

// Which rope object transformers 5.25 reads (PreTrainedConfig.convert_rope_params_to_dict):
// rope_scaling whenever it is set to anything Python counts as true, else rope_parameters, else
// none. Where both are set and differ, `notes` is told which one is used.
std::string rope_key_of(const Reader& r, std::vector<std::string>* notes) {
  const bool old_style = r.j.contains("rope_scaling") && truthy(r.j.at("rope_scaling"));
  const bool new_style = r.j.contains("rope_parameters") && truthy(r.j.at("rope_parameters"));
  if (old_style && new_style && notes) {
    const Json used = completed_rope(r, r.j.at("rope_scaling"));
    const Json other = completed_rope(r, r.j.at("rope_parameters"));
    if (used != other)
      notes->push_back(r.path + ": rope_scaling " + used.dump() + " and rope_parameters " + other.dump() +
                       " disagree; rope_scaling is used, as transformers' AutoConfig uses it when both are set "
                       "(remove one of them to silence this note)");
  }
  return old_style ? "rope_scaling" : new_style ? "rope_parameters" : "";
}

// The rotary embeddings of rope_key_of's object: its rope_theta, else the top-level rope_theta
// (the Hub's older configs), else 10000; its rope_type, else its older "type", else "default".
RopeArgs rope_of(const Reader& r, std::vector<std::string>* notes) {
  RopeArgs rope;
  const std::string key = rope_key_of(r, notes);
  rope.theta = r.number_or("rope_theta", rope.theta);
  if (key.empty()) return rope;
  const Json& p = r.j.at(key);
  if (!p.is_object()) r.fail(key, "is " + p.dump() + ", not an object");
  rope.theta = r.number_or(p, "rope_theta", rope.theta);
  const Json type = p.contains("rope_type") ? p.at("rope_type") : p.value("type", Json("default"));
  if (!type.is_string()) r.fail(key + ".rope_type", "is " + type.dump() + ", not a string");
  rope.type = type.get<std::string>();
  if (rope.type != "default" && rope.type != "llama3")
    r.fail(key + ".rope_type", "is \"" + rope.type + "\"; fsdp::models::Llama computes \"default\" and \"llama3\"");
  if (rope.type == "llama3") {
    for (const char* field : {"factor", "low_freq_factor", "high_freq_factor"})
      if (!p.contains(field)) r.fail(key + "." + field, "is missing; llama3 rope scaling needs it");
    rope.factor = r.number_or(p, "factor", rope.factor);
    rope.low_freq_factor = r.number_or(p, "low_freq_factor", rope.low_freq_factor);
    rope.high_freq_factor = r.number_or(p, "high_freq_factor", rope.high_freq_factor);
    // transformers fills a missing original_max_position_embeddings with max_position_embeddings.
    const double original =
        r.number_or(p, "original_max_position_embeddings", static_cast<double>(r.integer("max_position_embeddings")));
    rope.original_max_position_embeddings = static_cast<int64_t>(original);
  }
  return rope;
}

// What the decoder does not compute, refused rather than ignored.
void check_unsupported(const Reader& r, const std::string& arch, int64_t seq_len) {
  if (r.has("hidden_act") && r.j.at("hidden_act") != "silu")
    r.fail("hidden_act", "is " + r.j.at("hidden_act").dump() + "; the Llama MLP computes silu only");
  if (r.flag_or("mlp_bias", false)) r.fail("mlp_bias", "is true; the Llama MLP here has no biases");
  if (arch == "MistralForCausalLM" && r.has("sliding_window")) {
    const int64_t window = r.integer("sliding_window");
    if (window < seq_len)
      r.fail("sliding_window", "is " + std::to_string(window) + ", shorter than the sequence length " +
                                   std::to_string(seq_len) + "; sliding-window attention is not computed here, " +
                                   "so use a sequence no longer than the window");
  }
  if (r.has("layer_types")) {
    const Json& types = r.j.at("layer_types");
    if (!types.is_array()) r.fail("layer_types", "is " + types.dump() + ", not a list");
    for (const Json& t : types)
      if (t != "full_attention")
        r.fail("layer_types", "holds " + t.dump() + "; every layer here computes full attention");
  }
  if (arch == "Qwen2ForCausalLM" && r.flag_or("use_sliding_window", false))
    r.fail("use_sliding_window", "is true; sliding-window attention is not computed here");
}

const char* model_type_of(const std::string& arch) {
  if (arch == "MistralForCausalLM") return "mistral";
  if (arch == "Qwen2ForCausalLM") return "qwen2";
  return "llama";
}

}  // namespace

const std::vector<std::string>& llama_hf_architectures() {
  static const std::vector<std::string> names = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"};
  return names;
}

LlamaArgs llama_args_from_hf_config(const std::string& config_path, int64_t seq_len, std::vector<std::string>* notes) {
  return llama_args_from_hf_config_text(hf_config::read_text(config_path), config_path, seq_len, notes);
}

LlamaArgs llama_args_from_hf_config_text(const std::string& text, const std::string& config_path, int64_t seq_len,
                                         std::vector<std::string>* notes) {
  const Json j = hf_config::parse(text, config_path);
  const Reader r{config_path, j};
  LlamaArgs a;
  a.architecture = r.architecture(llama_hf_architectures(), "fsdp::models::Llama");
  check_unsupported(r, a.architecture, seq_len);
  a.vocab_size = r.integer("vocab_size");
  a.hidden_size = r.integer("hidden_size");
  a.intermediate_size = r.integer("intermediate_size");
  a.num_hidden_layers = r.integer("num_hidden_layers");
  a.num_attention_heads = r.integer("num_attention_heads");
  a.num_key_value_heads = r.integer_or("num_key_value_heads", a.num_attention_heads);
  TORCH_CHECK(a.num_attention_heads > 0, config_path, ": key 'num_attention_heads' must be positive");
  a.head_dim = r.integer_or("head_dim", a.hidden_size / a.num_attention_heads);
  a.max_position_embeddings = r.integer("max_position_embeddings");
  a.rms_norm_eps = r.number_or("rms_norm_eps", a.rms_norm_eps);
  a.rope = rope_of(r, notes);
  // Qwen2's q/k/v always have biases; Llama's follow attention_bias.
  a.attention_bias = a.architecture == "Qwen2ForCausalLM" || r.flag_or("attention_bias", false);
  if (a.architecture == "Qwen2ForCausalLM" && r.has("attention_bias") && !r.flag_or("attention_bias", true))
    r.fail("attention_bias", "is false, but Qwen2ForCausalLM's q/k/v projections always have biases");
  a.tie_word_embeddings = r.flag_or("tie_word_embeddings", false);
  if (a.architecture == "MistralForCausalLM" && r.has("sliding_window")) a.sliding_window = r.integer("sliding_window");
  a.initializer_range = r.number_or("initializer_range", a.initializer_range);
  hf_config::check_args(a, config_path);
  return a;
}

std::string hf_config_json(const LlamaArgs& args, at::ScalarType dtype) {
  Json rope = {{"rope_type", args.rope.type}, {"rope_theta", args.rope.theta}};
  if (args.rope.type == "llama3") {
    rope["factor"] = args.rope.factor;
    rope["low_freq_factor"] = args.rope.low_freq_factor;
    rope["high_freq_factor"] = args.rope.high_freq_factor;
    rope["original_max_position_embeddings"] = args.rope.original_max_position_embeddings;
  }
  Json j = {{"architectures", {args.architecture}},
            {"model_type", model_type_of(args.architecture)},
            {"vocab_size", args.vocab_size},
            {"hidden_size", args.hidden_size},
            {"intermediate_size", args.intermediate_size},
            {"num_hidden_layers", args.num_hidden_layers},
            {"num_attention_heads", args.num_attention_heads},
            {"num_key_value_heads", args.num_key_value_heads},
            {"head_dim", args.head_dim},
            {"max_position_embeddings", args.max_position_embeddings},
            {"rms_norm_eps", args.rms_norm_eps},
            {"rope_theta", args.rope.theta},
            {"rope_parameters", rope},
            {"hidden_act", "silu"},
            {"tie_word_embeddings", args.tie_word_embeddings},
            {"initializer_range", args.initializer_range},
            {"dtype", hf_config::dtype_name(dtype)},
            {"torch_dtype", hf_config::dtype_name(dtype)}};
  if (args.architecture == "MistralForCausalLM") j["sliding_window"] = nullptr;
  if (args.architecture == "Qwen2ForCausalLM") {
    j["use_sliding_window"] = false;
  } else {
    j["attention_bias"] = args.attention_bias;
    j["mlp_bias"] = false;
  }
  return j.dump(2) + "\n";
}

}  // namespace models
}  // namespace fsdp
