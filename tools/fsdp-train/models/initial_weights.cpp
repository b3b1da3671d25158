// initial_weights.cpp — model.init_from (initial_weights.h).
#include "models/initial_weights.h"

#include "common/agreement.h"
#include "common/errors.h"
#include "models/hf_checkpoint.h"
#include "models/registry.h"

#include <fsdp/checkpoint.h>
#include <fsdp/safetensors.h>
#include <fsdp/state_dict.h>

#include <filesystem>
#include <set>
#include <stdexcept>
#include <vector>

namespace fsdp {
namespace train {
namespace {

// The parameters that hold NaN or infinite values, as "name (n of m)".
std::vector<std::string> non_finite_tensors(const TensorStateDict& sd) {
  std::vector<std::string> bad;
  for (const auto& item : sd) {
    const at::Tensor& t = item.value();
    if (!t.is_floating_point()) continue;
    const int64_t n = t.numel() - t.isfinite().sum().item<int64_t>();
    if (n > 0) bad.push_back(item.key() + " (" + std::to_string(n) + " of " + std::to_string(t.numel()) + ")");
  }
  return bad;
}

// Lists the tensors with NaN or infinite values, or "" when there are none.
std::string non_finite_problem(const TensorStateDict& sd, const std::string& where) {
  const std::vector<std::string> bad = non_finite_tensors(sd);
  if (bad.empty()) return "";
  std::string list;
  for (const auto& b : bad) list += (list.empty() ? "" : ", ") + b;
  return std::to_string(bad.size()) + " tensor(s) hold NaN or infinite values" + where + ": " + list +
         "; training cannot start from them";
}

// A directory of safetensors files: what training.export=<name>.safetensors writes, or any
// Hugging Face layout (an index and its files, or one model.safetensors).
bool is_safetensors_dir(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  return fs::is_directory(path, ec) && (fs::exists(fs::path(path) / "model.safetensors.index.json", ec) ||
                                        fs::exists(fs::path(path) / "model.safetensors", ec));
}

// A file (ConfigError naming the key otherwise) that loads as a state dict (errors name the key
// and the file) of finite values. `ignored` receives the other entries of a bundle
// ("'epoch' (int)"), which are read but not used.
TensorStateDict init_state_dict(const std::string& path, std::vector<std::string>* ignored) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) throw ConfigError("model.init_from: " + path + " does not exist");
  if (std::filesystem::is_directory(path, ec))
    throw ConfigError("model.init_from: " + path +
                      " is a directory without model.safetensors.index.json or "
                      "model.safetensors; expected a file written by torch.save, or a safetensors directory");
  TensorStateDict sd;
  try {
    sd = load_pytorch_state_dict(path, ignored);
  } catch (const std::exception& e) {
    throw std::runtime_error("model.init_from " + path + ": " + error_text(e));
  }
  const std::string problem = non_finite_problem(sd, "");
  if (problem.empty()) return sd;
  throw std::runtime_error("model.init_from " + path + ": " + problem);
}

// Each rank reads its own rows straight into its shards, a tensor at a time (the file's copy of
// the weights never sits beside the model's), and checks them; the ranks then agree, so that
// all stop together before training when one rank's rows are unreadable or not finite.
void load_safetensors_rows(const std::string& path, const ModelFamily& family, torch::nn::Module& model) {
  std::string problem;
  try {
    if (is_hf_model_dir(path)) {
      load_hf_weights(path, family, model);
    } else {
      load_safetensors_into(path, sharded_state_dict(model));
    }
    TensorStateDict local;
    std::set<const c10::TensorImpl*> seen;  // a tied head is the embedding's tensor: checked once
    for (const auto& item : sharded_state_dict(model))
      if (seen.insert(item.value().to_local().unsafeGetTensorImpl()).second)
        local.insert(item.key(), item.value().to_local());
    problem = non_finite_problem(local, " in this rank's rows");
  } catch (const std::exception& e) {
    problem = error_text(e);
  }
  throw_unless_every_rank_ok(problem, "model.init_from " + path);
}

}  // namespace

void load_initial_weights(const TrainConfig& cfg, const ModelFamily& family, torch::nn::Module& model,
                          const std::function<void(const std::string&)>& note) {
  if (cfg.model.init_from.empty()) return;
  const std::string& path = cfg.model.init_from;
  if (is_safetensors_dir(path)) {
    load_safetensors_rows(path, family, model);
    return;
  }
  std::vector<std::string> ignored;
  const TensorStateDict sd = init_state_dict(path, &ignored);
  if (!ignored.empty()) {
    std::string list;
    for (const auto& entry : ignored) list += (list.empty() ? "" : ", ") + entry;
    note(terminal_safe("fsdp-train: note: model.init_from " + path +
                       " is a bundle: only its model state dict is "
                       "loaded; these entries are ignored (nothing of them runs): " +
                       list));
  }
  try {
    load_full_state_dict(model, sd);
  } catch (const std::exception& e) {
    throw std::runtime_error("model.init_from " + path + ": " + error_text(e));
  }
}

}  // namespace train
}  // namespace fsdp
