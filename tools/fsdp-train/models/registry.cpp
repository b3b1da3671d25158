// registry.cpp — the model families fsdp-train trains, in one place, and the choice of one for a
// run (registry.h). A family lives in its folder (models/<name>/, its library part in
// src/models/<name>/) and is registered here by one line.
#include "models/registry.h"

#include "common/errors.h"
#include "config/read_file.h"

#include <nlohmann/json.hpp>

#include <filesystem>
#include <stdexcept>

namespace fsdp {
namespace train {

// Each family's folder defines make_<name>_family (its args read from the source) and
// <name>_hf_architectures (the config.json "architectures" it computes, none for a family that
// is not one of transformers' models).
#define FSDP_TRAIN_FAMILIES(X) \
  X(transformer)               \
  X(llama)                     \
  X(gpt2)

#define FSDP_TRAIN_DECLARE_FAMILY(name)                                                \
  std::unique_ptr<const ModelFamily> make_##name##_family(const FamilySource& source); \
  std::vector<std::string> name##_hf_architectures();
FSDP_TRAIN_FAMILIES(FSDP_TRAIN_DECLARE_FAMILY)
#undef FSDP_TRAIN_DECLARE_FAMILY

namespace {

struct Registered {
  const char* name;
  std::unique_ptr<const ModelFamily> (*make)(const FamilySource&);
  std::vector<std::string> (*hf_architectures)();
};

const std::vector<Registered>& registered() {
#define FSDP_TRAIN_ENTRY(name) Registered{#name, &make_##name##_family, &name##_hf_architectures},
  static const std::vector<Registered> families = {FSDP_TRAIN_FAMILIES(FSDP_TRAIN_ENTRY)};
#undef FSDP_TRAIN_ENTRY
  return families;
}

std::string joined(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}

std::vector<std::string> every_hf_architecture() {
  std::vector<std::string> out;
  for (const Registered& f : registered())
    for (const std::string& a : f.hf_architectures()) out.push_back(a);
  return out;
}

// The family whose config.json "architectures" names, or nullptr when no family computes it
// (or the file does not name one: the family's own reader then says what is wrong).
const Registered* family_of_json(const std::string& path, const std::string& text) {
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || !j.contains("architectures")) return nullptr;
  const nlohmann::json& a = j.at("architectures");
  if (!a.is_array() || a.size() != 1 || !a[0].is_string()) return nullptr;
  const std::string name = a[0].get<std::string>();
  for (const Registered& f : registered())
    for (const std::string& known : f.hf_architectures())
      if (known == name) return &f;
  throw ConfigError(path + ": key 'architectures' names " + name + ", which fsdp-train does not train; it trains " +
                    joined(every_hf_architecture()));
}

const Registered& family_named(const TrainConfig& cfg) {
  const std::string& name = cfg.model.architecture;
  for (const Registered& f : registered())
    if (name == f.name) return f;
  const std::string at = origin_of(cfg, "model.architecture");
  throw ConfigError((at.empty() ? "" : at + ": ") + "model.architecture: '" + name +
                    "' is not a model family; one of " + joined(family_names()));
}

}  // namespace

bool is_hf_model_dir(const std::string& dir) {
  std::error_code ec;
  return std::filesystem::is_directory(dir, ec) &&
         std::filesystem::exists(std::filesystem::path(dir) / "config.json", ec);
}

std::vector<std::string> family_names() {
  std::vector<std::string> out;
  for (const Registered& f : registered()) out.push_back(f.name);
  return out;
}

std::unique_ptr<const ModelFamily> choose_family(const TrainConfig& cfg) {
  const ModelConfig& m = cfg.model;
  // init_from may decide the family and shape the model: a path that does not exist is said
  // first, not as a size error against the default preset's model.
  std::error_code ec;
  if (!m.init_from.empty() && !std::filesystem::exists(m.init_from, ec))
    throw ConfigError("model.init_from: " + terminal_safe(m.init_from) +
                      " does not exist; give a torch.save file, a safetensors directory or a Hugging Face model "
                      "directory");
  FamilySource source{cfg, m.hf_config, ""};
  const bool hf_dir = !m.init_from.empty() && is_hf_model_dir(m.init_from);
  if (source.config_json_path.empty() && hf_dir) source.config_json_path = m.init_from + "/config.json";
  const Registered* from_json = nullptr;
  if (!source.config_json_path.empty()) {
    const std::string& path = source.config_json_path;
    const std::string key = m.hf_config.empty() ? "model.init_from" : "model.hf_config";
    try {
      source.config_json_text = read_file(path, {path + " is a directory; expected a Hugging Face config.json",
                                                 "cannot open " + path, "reading " + path + " failed"});
    } catch (const std::runtime_error& e) {
      throw ConfigError(key + ": " + e.what());
    }
    from_json = family_of_json(path, source.config_json_text);
  }
  if (m.architecture.empty()) {
    if (!from_json && !source.config_json_path.empty())
      throw ConfigError(source.config_json_path +
                        ": key 'architectures' is missing or not a list of one name; it names the model, one of " +
                        joined(every_hf_architecture()));
    // No architecture named: the config.json's, else the first registered family.
    return (from_json ? *from_json : registered().front()).make(source);
  }
  const Registered& named = family_named(cfg);
  if (from_json && from_json != &named) {
    const std::string what = hf_dir && m.hf_config.empty() ? "model.init_from " + m.init_from +
                                                                 " is a Hugging Face model directory whose config.json"
                                                           : "model.hf_config " + m.hf_config;
    throw ConfigError(what + " shapes a model of family " + from_json->name + ", but model.architecture is " +
                      named.name + "; set model.architecture: " + from_json->name + " or leave it out");
  }
  return named.make(source);
}

}  // namespace train
}  // namespace fsdp
