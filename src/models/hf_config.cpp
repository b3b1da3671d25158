// What every family shaped by a transformers config.json reads the same way (hf_config.h).
#include "src/models/hf_config.h"

#include <fstream>
#include <sstream>

namespace fsdp {
namespace models {
namespace hf_config {
namespace {

std::string joined(const std::vector<std::string>& names) {
  std::string out;
  for (const std::string& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}

}  // namespace

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  TORCH_CHECK(in, path, ": cannot be read; a Hugging Face model directory holds config.json");
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

Json parse(const std::string& text, const std::string& path) {
  Json j = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  TORCH_CHECK(j.is_object(), path, ": is not a JSON object; expected a transformers config.json");
  return j;
}

void Reader::fail(const std::string& key, const std::string& problem) const {
  TORCH_CHECK(false, path, ": key '", key, "' ", problem);
}

int64_t Reader::integer(const std::string& key) const {
  if (!has(key)) fail(key, "is missing; this model's config.json has it, with no default");
  if (!j.at(key).is_number_integer()) fail(key, "is " + j.at(key).dump() + ", not an integer");
  return j.at(key).get<int64_t>();
}

double Reader::number_or(const Json& obj, const std::string& key, double fallback) const {
  if (!obj.contains(key) || obj.at(key).is_null()) return fallback;
  if (!obj.at(key).is_number()) fail(key, "is " + obj.at(key).dump() + ", not a number");
  return obj.at(key).get<double>();
}

bool Reader::flag_or(const std::string& key, bool fallback) const {
  if (!has(key)) return fallback;
  if (!j.at(key).is_boolean()) fail(key, "is " + j.at(key).dump() + ", not true or false");
  return j.at(key).get<bool>();
}

std::string Reader::architecture(const std::vector<std::string>& supported, const std::string& model) const {
  if (!has("architectures")) fail("architectures", "is missing; name one of " + joined(supported));
  const Json& a = j.at("architectures");
  if (!a.is_array() || a.size() != 1 || !a.at(0).is_string())
    fail("architectures", "is " + a.dump() + "; expected a list of one name");
  const std::string name = a.at(0).get<std::string>();
  for (const std::string& known : supported)
    if (name == known) return name;
  fail("architectures", "names " + name + ", which " + model + " does not compute; supported: " + joined(supported));
}

const char* dtype_name(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return "float32";
    case at::kBFloat16: return "bfloat16";
    case at::kHalf: return "float16";
    default: TORCH_CHECK(false, "config.json: dtype ", dtype, " is not one of float32, bfloat16, float16");
  }
}

}  // namespace hf_config
}  // namespace models
}  // namespace fsdp
