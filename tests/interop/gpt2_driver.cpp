// gpt2_driver — the C++ side of test_gpt2.py: a Hugging Face GPT-2 directory loaded into
// fsdp::models::Gpt2, sharded with fully_shard per block and root over every rank, then one of
//   logits <hf_dir> <tokens.safetensors> <out_dir>       the logits of "tokens" (int64 [batch, seq])
//   export <hf_dir> <out_dir> <float32|bfloat16|float16>  the model written back as a HF directory
//   train  <hf_dir> <batches.safetensors> <lr> <out_dir> [ac]  AdamW on "batches" (int64 [steps,
//          global rows, seq + 1]), each rank its consecutive rows; per-rank losses to
//          <out_dir>/losses-<rank>.json, the peak tensor bytes and RSS of the steps to
//          <out_dir>/peak-<rank>.json, and the final model as a HF directory <out_dir>/final. With
//          ac, every block checkpointed (CausalLM::set_activation_checkpointing(1)).
// The family (its names, its config.json in and out) is the trainer's, chosen from config.json as
// fsdp-train chooses it. Run it under fsdprun for more than one rank.
#include "models/hf_checkpoint.h"
#include "models/registry.h"

#include <fsdp/call.h>
#include <fsdp/device_mesh.h>
#include <fsdp/distributed.h>
#include <fsdp/fully_shard.h>
#include <fsdp/memory.h>
#include <fsdp/models/gpt2.h>
#include <fsdp/models/gpt2_hf.h>
#include <fsdp/safetensors.h>

#include <torch/optim/adamw.h>
#include <torch/utils.h>

#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

namespace {

using fsdp::models::Gpt2;

std::unique_ptr<const fsdp::train::ModelFamily> family_of(const std::string& hf) {
  fsdp::train::TrainConfig cfg;
  cfg.model.init_from = hf;
  return fsdp::train::choose_family(cfg);
}

Gpt2 load_sharded(const std::string& hf, const fsdp::DeviceMesh& mesh) {
  std::ifstream in(hf + "/config.json");
  std::stringstream text;
  text << in.rdbuf();
  const fsdp::models::Gpt2Args args = fsdp::models::gpt2_args_from_hf_config_text(text.str(), hf + "/config.json");
  const auto options = fsdp::FullyShardOptions().mesh(mesh);
  torch::manual_seed(0);
  Gpt2 model(args, [&](fsdp::models::Gpt2Block& block) { fsdp::fully_shard(block, options); });
  fsdp::fully_shard(model, options);
  fsdp::train::load_hf_weights(hf, *family_of(hf), *model);
  return model;
}

at::Tensor read_tensor(const std::string& file, const std::string& name) {
  const fsdp::TensorStateDict sd = fsdp::load_safetensors_file(file);
  const at::Tensor* t = sd.find(name);
  TORCH_CHECK(t, file, ": has no tensor '", name, "'");
  return *t;
}

at::ScalarType dtype_named(const std::string& name) {
  if (name == "float32") return at::kFloat;
  if (name == "bfloat16") return at::kBFloat16;
  if (name == "float16") return at::kHalf;
  TORCH_CHECK(false, "unknown dtype '", name, "'");
}

void logits(const std::string& hf, const std::string& tokens_file, const std::string& out,
            const fsdp::DeviceMesh& mesh) {
  const at::Tensor tokens = read_tensor(tokens_file, "tokens");
  Gpt2 model = load_sharded(hf, mesh);
  model->eval();
  at::NoGradGuard no_grad;
  const at::Tensor result = fsdp::call(model, tokens);
  fsdp::ShardedStateDict sd;
  sd.insert("logits", fsdp::DTensor::from_local(result.contiguous(), mesh, {fsdp::Replicate()}));
  fsdp::save_safetensors(sd, out);
}

void train(const std::string& hf, const std::string& batches_file, double lr, const std::string& out,
           const fsdp::DeviceMesh& mesh, bool checkpointing) {
  const at::Tensor batches = read_tensor(batches_file, "batches");
  const int64_t rank = fsdp::get_rank();
  const int64_t rows = batches.size(1) / fsdp::get_world_size();
  Gpt2 model = load_sharded(hf, mesh);
  if (checkpointing) model->set_activation_checkpointing(1);
  fsdp::memory::reset_peak_allocated();
  fsdp::memory::reset_peak_rss();
  torch::optim::AdamW optimizer(model->unique_parameters(),
                                torch::optim::AdamWOptions(lr).betas({0.9, 0.95}).eps(1e-8).weight_decay(0.1));
  std::vector<double> losses;
  for (int64_t step = 0; step < batches.size(0); ++step) {
    const at::Tensor mine = batches[step].narrow(0, rank * rows, rows);
    const at::Tensor inputs = mine.narrow(1, 0, mine.size(1) - 1).contiguous();
    const at::Tensor targets = mine.narrow(1, 1, mine.size(1) - 1).contiguous();
    at::Tensor loss = fsdp::call_method(model, &fsdp::models::Gpt2Impl::forward_loss, inputs, targets, int64_t{1});
    loss.backward();
    optimizer.step();
    optimizer.zero_grad();
    losses.push_back(loss.item<double>());
  }
  std::filesystem::create_directories(out);
  std::ofstream f(out + "/losses-" + std::to_string(rank) + ".json");
  f << std::setprecision(17) << "[";
  for (size_t i = 0; i < losses.size(); ++i) f << (i ? ", " : "") << losses[i];
  f << "]\n";
  std::ofstream(out + "/peak-" + std::to_string(rank) + ".json")
      << "{\"peak_tensor_bytes\": " << fsdp::memory::max_allocated_bytes()
      << ", \"peak_rss_bytes\": " << fsdp::memory::peak_rss_bytes() << "}\n";
  fsdp::train::save_hf(out + "/final", *family_of(hf), *model, at::kFloat);
}

}  // namespace

int main(int argc, char** argv) {
  const std::string usage =
      "usage: gpt2_driver logits <hf_dir> <tokens.safetensors> <out_dir> | export <hf_dir> <out_dir> <dtype> | "
      "train <hf_dir> <batches.safetensors> <lr> <out_dir> [ac]";
  const std::string command = argc > 1 ? argv[1] : "";
  if (!(argc == 5 && (command == "logits" || command == "export")) &&
      !((argc == 6 || argc == 7) && command == "train")) {
    std::cerr << usage << "\n";
    return 2;
  }
  try {
    fsdp::memory::install_tracking_allocator();  // the peak tensor bytes of peak-<rank>.json
    fsdp::init_process_group();
    const fsdp::DeviceMesh mesh = fsdp::init_device_mesh("cpu", {fsdp::get_world_size()});
    if (command == "logits") {
      logits(argv[2], argv[3], argv[4], mesh);
    } else if (command == "export") {
      Gpt2 model = load_sharded(argv[2], mesh);
      fsdp::train::save_hf(argv[3], *family_of(argv[2]), *model, dtype_named(argv[4]));
    } else {
      train(argv[2], argv[3], std::stod(argv[4]), argv[5], mesh, argc == 7 && std::string(argv[6]) == "ac");
    }
  } catch (const std::exception& e) {
    std::cerr << "gpt2_driver: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
