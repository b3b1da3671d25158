// hf_driver — the C++ side of test_llama.py and test_gpt2.py: a Hugging Face directory loaded
// into the model of its family, chosen from config.json's `architectures` as fsdp-train chooses
// it (tools/fsdp-train/models/registry.h), and built, split and sharded through the family's
// interface as the trainer does: fully_shard per decoder layer and the root, over every rank.
// Then one of
//   logits <hf_dir> <tokens.safetensors> <out_dir>     the logits of "tokens" (int64 [batch, seq])
//   export <hf_dir> <out_dir> <float32|bfloat16|float16>  the model written back as a HF directory
//   train  <hf_dir> <batches.safetensors> <lr> <out_dir> [tp [ac]]  AdamW on "batches" (int64
//          [steps, global rows, seq + 1]), each data-parallel rank its consecutive rows; per-rank
//          losses to <out_dir>/losses-<rank>.json, the peak tensor bytes and RSS of the steps to
//          <out_dir>/peak-<rank>.json, and the final model as a HF directory <out_dir>/final.
//          With tp > 1 the mesh is (dp, tp): each layer split by the family's tensor-parallel
//          plan over tp, then sharded over dp (a family without a plan refuses it). With ac, every
//          decoder layer checkpointed (CausalLM::set_activation_checkpointing(1)).
//   rope   <config.json>                               the Llama family's rotary embeddings read
//          from config.json, as one JSON line {"rope_type", "rope_theta", llama3's fields,
//          "notes": [...]}, without a process group.
// Run it under fsdprun for more than one rank.
#include "models/hf_checkpoint.h"
#include "models/registry.h"

#include <fsdp/call.h>
#include <fsdp/device_mesh.h>
#include <fsdp/distributed.h>
#include <fsdp/fully_shard.h>
#include <fsdp/memory.h>
#include <fsdp/models/llama_hf.h>
#include <fsdp/safetensors.h>
#include <fsdp/tensor_parallel.h>

#include <nlohmann/json.hpp>
#include <torch/optim/adamw.h>
#include <torch/utils.h>

#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace {

using fsdp::train::BuiltModel;
using fsdp::train::ModelFamily;

// The trainer's family for the Hugging Face directory `hf` at sequence length `seq`: its model,
// its tensor-parallel plan, its names and its config.json in and out.
std::unique_ptr<const ModelFamily> family_of(const std::string& hf, int64_t seq) {
  fsdp::train::TrainConfig cfg;
  cfg.model.init_from = hf;
  cfg.training.seq_len = seq;
  return fsdp::train::choose_family(cfg);
}

// A model of `family` with `hf`'s weights, sharded over `mesh` (1-D, or (dp, tp)).
BuiltModel load_sharded(const std::string& hf, const ModelFamily& family, const fsdp::DeviceMesh& mesh) {
  auto options = fsdp::FullyShardOptions().mesh(mesh);
  std::optional<fsdp::tp::TensorParallelMesh> tp;
  if (mesh.ndim() == 2) {
    options.dp_mesh_dims(fsdp::DataParallelMeshDims().shard("dp"));
    tp.emplace(mesh, "tp");
  }
  torch::manual_seed(0);
  BuiltModel built = family.build([&](const std::shared_ptr<torch::nn::Module>& layer) {
    if (tp) family.parallelize_layer(*layer, *tp);
    fsdp::fully_shard(layer, options);
  });
  if (tp) family.parallelize_rest(*built.module, *tp, /*vocab_parallel=*/false);
  fsdp::fully_shard(built.module, options);
  fsdp::train::load_hf_weights(hf, family, *built.module);
  return built;
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
  const auto family = family_of(hf, tokens.size(1));
  const BuiltModel model = load_sharded(hf, *family, mesh);
  model.module->eval();
  at::NoGradGuard no_grad;
  fsdp::models::CausalLM* lm = model.lm;
  const at::Tensor result = fsdp::call_as_forward(
      model.module, [lm](const at::Tensor& t) { return lm->logits(t); }, tokens);
  fsdp::ShardedStateDict sd;
  sd.insert("logits", fsdp::DTensor::from_local(result.contiguous(), mesh, {fsdp::Replicate()}));
  fsdp::save_safetensors(sd, out);
}

void write_results(const std::string& out, const std::vector<double>& losses) {
  const std::string rank = std::to_string(fsdp::get_rank());
  std::filesystem::create_directories(out);
  std::ofstream f(out + "/losses-" + rank + ".json");
  f << std::setprecision(17) << "[";
  for (size_t i = 0; i < losses.size(); ++i) f << (i ? ", " : "") << losses[i];
  f << "]\n";
  std::ofstream(out + "/peak-" + rank + ".json") << "{\"peak_tensor_bytes\": " << fsdp::memory::max_allocated_bytes()
                                                 << ", \"peak_rss_bytes\": " << fsdp::memory::peak_rss_bytes() << "}\n";
}

void train(const std::string& hf, const std::string& batches_file, double lr, const std::string& out,
           const fsdp::DeviceMesh& mesh, bool checkpointing) {
  const at::Tensor batches = read_tensor(batches_file, "batches");
  const int64_t dp_world = mesh.ndim() == 1 ? fsdp::get_world_size() : mesh.size(0);
  const int64_t dp_rank = mesh.ndim() == 1 ? fsdp::get_rank() : mesh.get_local_rank(0);
  const int64_t rows = batches.size(1) / dp_world;
  const auto family = family_of(hf, batches.size(2) - 1);
  const BuiltModel model = load_sharded(hf, *family, mesh);
  fsdp::models::CausalLM* lm = model.lm;
  if (checkpointing) lm->set_activation_checkpointing(1);
  fsdp::memory::reset_peak_allocated();
  fsdp::memory::reset_peak_rss();
  torch::optim::AdamW optimizer(fsdp::models::unique_parameters(*model.module),
                                torch::optim::AdamWOptions(lr).betas({0.9, 0.95}).eps(1e-8).weight_decay(0.1));
  std::vector<double> losses;
  for (int64_t step = 0; step < batches.size(0); ++step) {
    const at::Tensor mine = batches[step].narrow(0, dp_rank * rows, rows);
    const at::Tensor inputs = mine.narrow(1, 0, mine.size(1) - 1).contiguous();
    const at::Tensor targets = mine.narrow(1, 1, mine.size(1) - 1).contiguous();
    at::Tensor loss = fsdp::call_as_forward(
        model.module, [lm](const at::Tensor& in, const at::Tensor& tg) { return lm->forward_loss(in, tg, 1); }, inputs,
        targets);
    loss.backward();
    optimizer.step();
    optimizer.zero_grad();
    losses.push_back(loss.item<double>());
  }
  write_results(out, losses);
  fsdp::train::save_hf(out + "/final", *family, *model.module, at::kFloat);
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

int run(int argc, char** argv) {
  const std::string command = argv[1];
  if (command == "rope") {
    print_rope(argv[2]);
    return 0;
  }
  fsdp::memory::install_tracking_allocator();  // the peak tensor bytes of peak-<rank>.json
  fsdp::init_process_group();
  const int64_t tp = command == "train" && argc >= 7 ? std::stoll(argv[6]) : 1;
  const bool checkpointing = command == "train" && argc == 8 && std::string(argv[7]) == "ac";
  const int world = fsdp::get_world_size();
  const fsdp::DeviceMesh mesh =
      tp == 1 ? fsdp::init_device_mesh("cpu", {world}) : fsdp::init_device_mesh("cpu", {world / tp, tp}, {"dp", "tp"});
  if (command == "logits") {
    logits(argv[2], argv[3], argv[4], mesh);
  } else if (command == "export") {
    const auto family = family_of(argv[2], 1);
    const BuiltModel model = load_sharded(argv[2], *family, mesh);
    fsdp::train::save_hf(argv[3], *family, *model.module, dtype_named(argv[4]));
  } else {
    train(argv[2], argv[3], std::stod(argv[4]), argv[5], mesh, checkpointing);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string command = argc > 1 ? argv[1] : "";
  const bool valid = (command == "rope" && argc == 3) || ((command == "logits" || command == "export") && argc == 5) ||
                     (command == "train" && argc >= 6 && argc <= 8);
  if (!valid) {
    std::cerr << "usage: hf_driver logits <hf_dir> <tokens.safetensors> <out_dir> | export <hf_dir> <out_dir> "
                 "<dtype> | train <hf_dir> <batches.safetensors> <lr> <out_dir> [tp [ac]] | rope <config.json>\n";
    return 2;
  }
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "hf_driver: " << e.what() << "\n";
    return 1;
  }
}
