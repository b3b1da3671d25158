// hf_config.h — private to src/models: reading a transformers config.json, shared by the
// families shaped by one (gpt2/, llama/). Every refusal names the file and the key, so that a
// user can tell which field of which checkpoint is wrong.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace fsdp {
namespace models {
namespace hf_config {

using Json = nlohmann::json;

// The file's text; throws c10::Error naming `path` when it cannot be read.
std::string read_text(const std::string& path);
// `text` as a JSON object; throws c10::Error naming `path` when it is not one.
Json parse(const std::string& text, const std::string& path);

// Typed reads of one config.json's keys. A key set to null counts as missing, as transformers'
// PretrainedConfig takes None for its default.
struct Reader {
  const std::string& path;
  const Json& j;

  [[noreturn]] void fail(const std::string& key, const std::string& problem) const;
  bool has(const std::string& key) const { return j.contains(key) && !j.at(key).is_null(); }
  // A key without a default: refused when missing.
  int64_t integer(const std::string& key) const;
  int64_t integer_or(const std::string& key, int64_t fallback) const { return has(key) ? integer(key) : fallback; }
  // `obj`'s number under `key` (obj is j or one of its objects); the refusal names `key`.
  double number_or(const Json& obj, const std::string& key, double fallback) const;
  double number_or(const std::string& key, double fallback) const { return number_or(j, key, fallback); }
  bool flag_or(const std::string& key, bool fallback) const;
  // "architectures" as a list of one name, among `supported`; `model` names the class that
  // computes them in the refusal.
  std::string architecture(const std::vector<std::string>& supported, const std::string& model) const;
};

// config.json's name for a dtype it writes ("float32", "bfloat16", "float16").
const char* dtype_name(at::ScalarType dtype);

// `args` checked by its own check(), whose refusal is told again naming `path`.
template <typename Args>
void check_args(const Args& args, const std::string& path) {
  try {
    args.check();
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, path, ": ", e.msg());
  }
}

}  // namespace hf_config
}  // namespace models
}  // namespace fsdp
