// llama_driver — the C++ side of test_llama.py: a Hugging Face directory loaded into
// fsdp::models::Llama, sharded with fully_shard per decoder layer and root over every rank, then
// one of
//   logits <hf_dir> <tokens.safetensors> <out_dir>     the logits of "tokens" (int64 [batch, seq])
//   export <hf_dir> <out_dir> <float32|bfloat16|float16>  the model written back as a HF directory
//   train  <hf_dir> <batches.safetensors> <lr> <out_dir> [tp [ac]]  AdamW on "batches" (int64
//          [steps, global rows, seq + 1]), each data-parallel rank its consecutive rows; per-rank
//          losses to <out_dir>/losses-<rank>.json, the peak tensor bytes and RSS of the steps to
//          <out_dir>/peak-<rank>.json, and the final model as a HF directory <out_dir>/final.
//          With tp > 1 the mesh is (dp, tp): the layers split by fsdp/models/llama_parallelize.h
//          over tp, then sharded over dp. With ac, every decoder layer checkpointed
//          (CausalLM::set_activation_checkpointing(1)).
//   rope   <config.json>                               the rotary embeddings read from config.json, as
//          one JSON line {"rope_type", "rope_theta", llama3's fields, "notes": [...]}, without a
//          process group.
// Run it under fsdprun for more than one rank.
#include "models/hf_checkpoint.h"
#include "models/registry.h"

#include <fsdp/call.h>
#include <fsdp/device_mesh.h>
#include <fsdp/distributed.h>
#include <fsdp/fully_shard.h>
#include <fsdp/memory.h>
#include <fsdp/models/llama.h>
#include <fsdp/models/llama_hf.h>
#include <fsdp/models/llama_parallelize.h>
#include <fsdp/safetensors.h>

#include <nlohmann/json.hpp>
#include <torch/optim/adamw.h>
#include <torch/utils.h>

#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <string>
#include <vector>

namespace {

using fsdp::models::Llama;

// The trainer's family for the Hugging Face directory `hf`, chosen from its config.json as
// fsdp-train chooses it: its names and its config.json in and out.
std::unique_ptr<const fsdp::train::ModelFamily> family_of(const std::string& hf) {
  fsdp::train::TrainConfig cfg;
  cfg.model.init_from = hf;
  return fsdp::train::choose_family(cfg);
}

Llama load_sharded(const std::string& hf, int64_t seq, const fsdp::DeviceMesh& mesh) {
  const fsdp::models::LlamaArgs args = fsdp::models::llama_args_from_hf_config(hf + "/config.json", seq);
  auto options = fsdp::FullyShardOptions().mesh(mesh);
  torch::manual_seed(0);
  if (mesh.ndim() == 1) {
    Llama model(args, [&](fsdp::models::LlamaDecoderLayer& layer) { fsdp::fully_shard(layer, options); });
    fsdp::fully_shard(model, options);
    fsdp::train::load_hf_weights(hf, *family_of(hf), *model);
    return model;
  }
  options.dp_mesh_dims(fsdp::DataParallelMeshDims().shard("dp"));
  const fsdp::tp::TensorParallelMesh tp(mesh, "tp");
  Llama model(args, [&](fsdp::models::LlamaDecoderLayer& layer) {
    fsdp::models::parallelize_llama_layer(*layer, args, tp);
    fsdp::fully_shard(layer, options);
  });
  fsdp::models::parallelize_llama_rest(*model, tp, fsdp::models::ParallelizeOptions());
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
  Llama model = load_sharded(hf, tokens.size(1), mesh);
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
  const int64_t dp_world = mesh.ndim() == 1 ? fsdp::get_world_size() : mesh.size(0);
  const int64_t dp_rank = mesh.ndim() == 1 ? rank : mesh.get_local_rank(0);
  const int64_t rows = batches.size(1) / dp_world;
  Llama model = load_sharded(hf, batches.size(2) - 1, mesh);
  if (checkpointing) model->set_activation_checkpointing(1);
  fsdp::memory::reset_peak_allocated();
  fsdp::memory::reset_peak_rss();
  torch::optim::AdamW optimizer(model->unique_parameters(),
                                torch::optim::AdamWOptions(lr).betas({0.9, 0.95}).eps(1e-8).weight_decay(0.1));
  std::vector<double> losses;
  for (int64_t step = 0; step < batches.size(0); ++step) {
    const at::Tensor mine = batches[step].narrow(0, dp_rank * rows, rows);
    const at::Tensor inputs = mine.narrow(1, 0, mine.size(1) - 1).contiguous();
    const at::Tensor targets = mine.narrow(1, 1, mine.size(1) - 1).contiguous();
    at::Tensor loss = fsdp::call_method(model, &fsdp::models::LlamaImpl::forward_loss, inputs, targets, int64_t{1});
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

// The rope arguments config.json gives, for comparison with transformers' AutoConfig.
void print_rope(const std::string& config) {
  std::vector<std::string> notes;
  const fsdp::models::RopeArgs rope = fsdp::models::llama_args_from_hf_config(config, 1, &notes).rope;
  nlohmann::json j = {{"rope_type", rope.type}, {"rope_theta", rope.theta}, {"notes", notes}};
  if (rope.type == "llama3") {
    j["factor"] = rope.factor;
    j["low_freq_factor"] = rope.low_freq_factor;
    j["high_freq_factor"] = rope.high_freq_factor;
    j["original_max_position_embeddings"] = rope.original_max_position_embeddings;
  }
  std::cout << j.dump() << "\n";
}

}  // namespace

int main(int argc, char** argv) {
  const std::string usage =
      "usage: llama_driver logits <hf_dir> <tokens.safetensors> <out_dir> | export <hf_dir> <out_dir> <dtype> | "
      "train <hf_dir> <batches.safetensors> <lr> <out_dir> [tp [ac]] | rope <config.json>";
  const std::string command = argc > 1 ? argv[1] : "";
  if (command == "rope" && argc == 3) {
    try {
      print_rope(argv[2]);
    } catch (const std::exception& e) {
      std::cerr << "llama_driver: " << e.what() << "\n";
      return 1;
    }
    return 0;
  }
  if (argc != 5 && !(command == "train" && argc >= 6 && argc <= 8)) {
    std::cerr << usage << "\n";
    return 2;
  }
  try {
    fsdp::memory::install_tracking_allocator();  // the peak tensor bytes of peak-<rank>.json
    fsdp::init_process_group();
    const int64_t tp = command == "train" && argc >= 7 ? std::stoll(argv[6]) : 1;
    const bool checkpointing = command == "train" && argc == 8 && std::string(argv[7]) == "ac";
    const int world = fsdp::get_world_size();
    const fsdp::DeviceMesh mesh = tp == 1 ? fsdp::init_device_mesh("cpu", {world})
                                          : fsdp::init_device_mesh("cpu", {world / tp, tp}, {"dp", "tp"});
    if (command == "logits") {
      logits(argv[2], argv[3], argv[4], mesh);
    } else if (command == "export") {
      Llama model = load_sharded(argv[2], 1, mesh);
      fsdp::train::save_hf(argv[3], *family_of(argv[2]), *model, dtype_named(argv[4]));
    } else if (command == "train") {
      train(argv[2], argv[3], std::stod(argv[4]), argv[5], mesh, checkpointing);
    } else {
      std::cerr << usage << "\n";
      return 2;
    }
  } catch (const std::exception& e) {
    std::cerr << "llama_driver: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
