// to_dtype_driver — the C++ side of the differential row that converts the model after
// fully_shard (rows.py: `driver`): fsdp-train's own pieces (its configuration, model,
// initial weights, schedule, synthetic data, clipping, export), with `model->to(dtype)` after
// the model is sharded and its initial weights loaded, as tests/interop/fsdp2_train.py calls
// `model.to(torch.float64)` after fully_shard.
//
//   fsdprun --nproc-per-node 2 to_dtype_driver CONFIG.yaml --model.dtype=float64 [--section.key=value ...]
//
// `--model.dtype` (float32 | float64) is this driver's; every other argument is fsdp-train's.
// It writes what test_differential.py reads of fsdp-train: logging.summary_json ("losses": the
// mean over the ranks of each step's loss), logging.jsonl (rank r's "grad_norm" per step, the
// norm before clipping) and training.export (a torch.save file of the full parameters).
// AdamW is torch's, with fsdp-train's options; one micro-batch per step, FULL_SHARD only.
#include "config/config.h"
#include "data/data.h"
#include "models/initial_weights.h"
#include "models/model_setup.h"
#include "models/registry.h"
#include "run/schedule.h"

#include <fsdp/clip_grad.h>
#include <fsdp/distributed.h>
#include <fsdp/process_group.h>
#include <fsdp/state_dict.h>

#include <torch/optim/adamw.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <string>
#include <vector>

namespace {

using namespace fsdp;
using namespace fsdp::train;

at::ScalarType dtype_named(const std::string& name) {
  if (name == "float32") return at::kFloat;
  if (name == "float64") return at::kDouble;
  throw std::invalid_argument("--model.dtype: '" + name + "' is not float32 or float64");
}

void check_modelled(const TrainConfig& cfg) {
  const bool plain = cfg.fsdp_config.sharding_strategy == ShardingStrategy::FULL_SHARD &&
                     cfg.training.gradient_accumulation_steps == 1 && cfg.fsdp_config.model_parallel_size == 1 &&
                     !cfg.fsdp_config.fp16 && !cfg.fsdp_config.mixed_precision && !cfg.fsdp_config.param_dtype &&
                     !cfg.fsdp_config.reduce_dtype && choose_family(cfg)->name() == "transformer";
  if (!plain)
    throw std::invalid_argument(
        "to_dtype_driver trains FULL_SHARD with one micro-batch, no tensor parallelism, no mixed precision and "
        "the Transformer only");
}

double world_mean(double value) {
  at::Tensor t = at::tensor({value}, at::kDouble);
  world()->all_reduce(t)->wait();
  return t.item<double>() / get_world_size();
}

void write_outputs(const TrainConfig& cfg, const std::vector<double>& losses, const std::vector<double>& norms,
                   const TensorStateDict& full) {
  const int rank = get_rank();
  if (!cfg.logging.jsonl.empty()) {
    std::string path = cfg.logging.jsonl;
    const auto at = path.find("{rank}");
    if (at != std::string::npos) path.replace(at, 6, std::to_string(rank));
    std::ofstream f(path);
    f << std::setprecision(17);
    for (size_t i = 0; i < norms.size(); ++i) f << "{\"step\": " << i + 1 << ", \"grad_norm\": " << norms[i] << "}\n";
  }
  if (rank != 0) return;
  if (!cfg.logging.summary_json.empty()) {
    std::ofstream f(cfg.logging.summary_json);
    f << std::setprecision(17) << "{\"losses\": [";
    for (size_t i = 0; i < losses.size(); ++i) f << (i ? ", " : "") << losses[i];
    f << "]}\n";
  }
  const auto parent = std::filesystem::path(cfg.training.export_path).parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent);
  save_pytorch_state_dict(full, cfg.training.export_path);
}

void train_converted(const TrainConfig& cfg, at::ScalarType dtype) {
  const auto family = choose_family(cfg);
  const int64_t seq = seq_len_of(cfg, *family);
  const RendezvousInfo env = rendezvous_info_from_env();
  ParallelModel pm = parallelize_model(cfg, *family, precision_of(cfg.fsdp_config), env.local_world_size);
  load_initial_weights(cfg, *family, pm.module(), [](const std::string& line) { std::cout << line << "\n"; });
  pm.module().to(dtype);  // after fully_shard: FSDP re-lays the shards at the first forward

  const OptimizerConfig& o = cfg.optimizer;
  torch::optim::AdamW optimizer(
      pm.parameters(),
      torch::optim::AdamWOptions(o.lr).betas({o.beta1, o.beta2}).eps(o.eps).weight_decay(o.weight_decay));
  const LrSchedule schedule = lr_schedule(cfg);
  const auto data = synthetic_data(family->shape().vocab_size, cfg.data.data_seed);
  const int64_t batch = cfg.training.micro_batch_size;
  const double max_norm = cfg.training.max_grad_norm;
  std::vector<double> losses, norms;
  for (int64_t step = 1; step <= cfg.training.steps; ++step) {
    for (auto& group : optimizer.param_groups())
      static_cast<torch::optim::AdamWOptions&>(group.options()).lr(lr_at(schedule, step));
    const at::Tensor global = data->global_batch(step - 1, pm.dp_world * batch, seq);
    const auto [inputs, targets] = micro_batch(global, pm.dp_rank, 1, 0, batch);
    const at::Tensor loss = pm.forward_loss(inputs, targets, cfg.training.loss_chunks);
    loss.backward();
    norms.push_back(clip_grad_norm_(pm.parameters(), max_norm > 0 ? max_norm : INFINITY));
    optimizer.step();
    optimizer.zero_grad();
    losses.push_back(world_mean(loss.item<double>()));
  }
  write_outputs(cfg, losses, norms, full_state_dict(pm.module(), FullStateDictOptions().rank0_only(true)));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::cerr << "usage: to_dtype_driver CONFIG.yaml [--model.dtype=float32|float64] [--section.key=value ...]\n";
    return 2;
  }
  try {
    std::string dtype = "float32";
    std::vector<std::string> overrides;
    for (int i = 2; i < argc; ++i) {
      const std::string arg = argv[i];
      if (arg.rfind("--model.dtype=", 0) == 0) {
        dtype = arg.substr(std::string("--model.dtype=").size());
      } else {
        overrides.push_back(arg);
      }
    }
    const TrainConfig cfg = load_config(argv[1], overrides);
    check_modelled(cfg);
    const at::ScalarType scalar_type = dtype_named(dtype);
    init_process_group();
    train_converted(cfg, scalar_type);
    destroy_process_group();
  } catch (const std::exception& e) {
    std::cerr << "to_dtype_driver: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
