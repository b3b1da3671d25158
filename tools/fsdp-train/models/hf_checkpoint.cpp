// hf_checkpoint.cpp — Hugging Face directories in and out (hf_checkpoint.h). The weights go
// through the library's safetensors reader and writer, which check every header and convert
// floating dtypes; the family says which names the files use.
#include "models/hf_checkpoint.h"

#include <fsdp/distributed.h>
#include <fsdp/safetensors.h>

#include <c10/util/Exception.h>

#include <filesystem>
#include <fstream>

namespace fsdp {
namespace train {

void load_hf_weights(const std::string& dir, const ModelFamily& family, torch::nn::Module& model) {
  SafetensorsOptions options = SafetensorsOptions().convert_float_dtypes(true);
  family.hf_load_tolerances(options);
  load_safetensors_into(dir, family.hf_state_dict(model), options);
}

void save_hf(const std::string& dir, const ModelFamily& family, torch::nn::Module& model, at::ScalarType dtype) {
  namespace fs = std::filesystem;
  const std::string config = family.hf_config_json(dtype);  // checks the dtype first
  ShardedStateDict out;
  for (const auto& item : family.hf_state_dict(model)) {
    const DTensor& d = item.value();
    out.insert(item.key(), DTensor::from_local(d.to_local().to(dtype), d.device_mesh(), d.placements(), d.sizes()));
  }
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
