// run_identity.cpp — a run's identity and its comparison with a checkpoint's (run_identity.h).
#include "checkpoints/run_identity.h"

#include <filesystem>
#include <system_error>

namespace fsdp {
namespace train {
namespace {

const std::string kPrefix = "fsdp-train.";

// A relative data.path means the same file from any working directory only once made absolute.
std::string absolute_path(const std::string& path) {
  std::error_code ec;
  const std::filesystem::path p = std::filesystem::weakly_canonical(std::filesystem::absolute(path, ec), ec);
  return ec ? path : p.string();
}

// A recorded value for a message: escaped, since metadata.json may have been edited by hand.
std::string shown(const std::string& v) {
  std::string out;
  for (const char ch : v.substr(0, 200)) {
    const unsigned char c = static_cast<unsigned char>(ch);
    if (c >= 0x20 && c < 0x7f) {
      out += ch;
    } else {
      static const char* hex = "0123456789abcdef";
      out += std::string("\\x") + hex[c >> 4] + hex[c & 15];
    }
  }
  return out.empty() ? "(empty)" : out;
}

}  // namespace

std::map<std::string, std::string> run_identity(const TrainConfig& cfg, const ModelShape& a) {
  std::map<std::string, std::string> id = {
      {"model.n_layers", std::to_string(a.n_layers)},
      {"model.vocab_size", std::to_string(a.vocab_size)},
      {"model.max_seq_len", std::to_string(a.max_seq_len)},
      {"model.dim", std::to_string(a.dim)},
      {"model.n_heads", std::to_string(a.n_heads)},
      {"training.seed", std::to_string(cfg.training.seed)},
      {"data.source", cfg.data.source},
      {"data.data_seed", std::to_string(cfg.data.data_seed)},
      // Its checkpoints hold the gradient scaler's state, and only its checkpoints do.
      {"fsdp_config.fp16", cfg.fsdp_config.fp16 ? "true" : "false"},
  };
  if (cfg.data.source == "tokens") id["data.path"] = absolute_path(cfg.data.path);
  std::map<std::string, std::string> out;
  for (const auto& [key, value] : id) out[kPrefix + key] = value;
  return out;
}

std::vector<std::string> identity_differences(const std::string& checkpoint,
                                              const std::map<std::string, std::string>& recorded,
                                              const std::map<std::string, std::string>& ours) {
  std::vector<std::string> lines;
  for (const auto& [name, value] : ours) {
    const auto it = recorded.find(name);
    if (it == recorded.end() || it->second == value) continue;
    const std::string key = name.substr(kPrefix.size());
    lines.push_back("checkpoint " + checkpoint + " was written with " + key + " " + shown(it->second) +
                    ", this config has " + key + " " + shown(value));
  }
  return lines;
}

}  // namespace train
}  // namespace fsdp
