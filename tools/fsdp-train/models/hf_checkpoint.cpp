// hf_checkpoint.cpp — Hugging Face directories in and out (hf_checkpoint.h). The weights go
// through the library's safetensors reader and writer; what is added here is the dtype (a file
// may hold bf16 for an fp32 model) and the tied head that transformers does not write.
#include "models/hf_checkpoint.h"

#include <fsdp/distributed.h>
#include <fsdp/models/llama_hf.h>
#include <fsdp/safetensors.h>
#include <fsdp/state_dict.h>

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>

namespace fsdp {
namespace train {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

constexpr const char* kTiedHead = "lm_head.weight";

at::ScalarType dtype_of_code(const std::string& code, const std::string& file, const std::string& tensor) {
  if (code == "F32") return at::kFloat;
  if (code == "BF16") return at::kBFloat16;
  if (code == "F16") return at::kHalf;
  TORCH_CHECK(false, file, ": tensor '", tensor, "' is stored as ", code,
              "; a model's weights load from F32, BF16 or F16");
}

// A safetensors file's header: tensor name -> dtype.
std::map<std::string, at::ScalarType> header_dtypes(const std::string& file) {
  std::ifstream in(file, std::ios::binary);
  TORCH_CHECK(in, file, ": cannot be read");
  unsigned char size_bytes[8] = {};
  in.read(reinterpret_cast<char*>(size_bytes), 8);
  uint64_t size = 0;
  for (int i = 7; i >= 0; --i) size = (size << 8) | size_bytes[i];
  TORCH_CHECK(in && size < (uint64_t{1} << 30), file, ": not a safetensors file (header size ", size, ")");
  std::string text(size, '\0');
  in.read(text.data(), static_cast<std::streamsize>(size));
  const Json header = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  TORCH_CHECK(in && header.is_object(), file, ": its header is not a JSON object; not a safetensors file");
  std::map<std::string, at::ScalarType> out;
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") continue;
    TORCH_CHECK(entry.is_object() && entry.contains("dtype") && entry.at("dtype").is_string(), file, ": tensor '", name,
                "' has no dtype");
    out[name] = dtype_of_code(entry.at("dtype").get<std::string>(), file, name);
  }
  return out;
}

// Every tensor of the directory with its dtype, from the index's files or the single file.
std::map<std::string, at::ScalarType> directory_dtypes(const std::string& dir) {
  const fs::path index = fs::path(dir) / "model.safetensors.index.json";
  if (!fs::exists(index)) return header_dtypes((fs::path(dir) / "model.safetensors").string());
  std::ifstream in(index);
  const Json j = Json::parse(in, nullptr, /*allow_exceptions=*/false);
  TORCH_CHECK(j.is_object() && j.contains("weight_map") && j.at("weight_map").is_object(), index.string(),
              ": has no \"weight_map\" object; not a safetensors index");
  std::map<std::string, at::ScalarType> out;
  std::map<std::string, bool> files;
  for (const auto& [name, file] : j.at("weight_map").items()) files[file.get<std::string>()] = true;
  for (const auto& [file, unused] : files) {
    (void)unused;
    for (const auto& [name, dtype] : header_dtypes((fs::path(dir) / file).string())) out[name] = dtype;
  }
  return out;
}

DTensor with_dtype(const DTensor& d, at::ScalarType dtype) {
  return DTensor::from_local(d.to_local().to(dtype), d.device_mesh(), d.placements(), d.sizes());
}

// The model's state dict as transformers names it in files: the tied head left out.
ShardedStateDict hf_state_dict(models::LlamaImpl& model) {
  ShardedStateDict out;
  for (const auto& item : sharded_state_dict(model)) {
    if (model.args().tie_word_embeddings && item.key() == kTiedHead) continue;
    out.insert(item.key(), item.value());
  }
  return out;
}

}  // namespace

bool is_hf_model_dir(const std::string& dir) {
  std::error_code ec;
  return fs::is_directory(dir, ec) && fs::exists(fs::path(dir) / "config.json", ec);
}

void load_hf_weights(const std::string& dir, models::LlamaImpl& model) {
  const ShardedStateDict wanted = hf_state_dict(model);
  const std::map<std::string, at::ScalarType> stored = directory_dtypes(dir);
  for (const auto& item : wanted) {
    TORCH_CHECK(stored.count(item.key()), dir, ": tensor '", item.key(),
                "' is missing; config.json's model has it (is this directory the model config.json describes?)");
  }
  for (const auto& [name, dtype] : stored) {
    (void)dtype;
    TORCH_CHECK(wanted.find(name), dir, ": tensor '", name, "' is not a parameter of the model config.json describes",
                model.args().tie_word_embeddings && name == kTiedHead ? " (tie_word_embeddings is true)" : "");
  }
  // Each tensor read in the dtype it is stored in and converted into its parameter before the
  // next is read. The tied head is the embedding's tensor: loading the embedding loads it.
  load_safetensors_into(dir, wanted, SafetensorsOptions().convert_dtype(true));
}

void save_hf(const std::string& dir, models::LlamaImpl& model, at::ScalarType dtype) {
  const std::string config = models::hf_config_json(model.args(), dtype);  // checks the dtype first
  ShardedStateDict out;
  for (const auto& item : hf_state_dict(model)) out.insert(item.key(), with_dtype(item.value(), dtype));
  save_safetensors(out, dir);
  if (get_rank() != 0) return;
  const fs::path path = fs::path(dir) / "config.json";
  const fs::path tmp = fs::path(dir) / "config.json.tmp";
  {
    std::ofstream f(tmp);
    f << config;
    TORCH_CHECK(f.good(), tmp.string(), ": cannot be written");
  }
  fs::rename(tmp, path);
}

}  // namespace train
}  // namespace fsdp
