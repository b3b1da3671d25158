// bench_checkpoint — how long a training step is blocked by a checkpoint save: a synchronous
// save against an asynchronous one (only its staging copy blocks), model + Adam state.
//
//   fsdprun --standalone --nproc-per-node 2 build/bench/bench_checkpoint [--preset medium]
//       [--rounds 3] [--dir /tmp/fsdp_bench_ckpt]
//
// Each round times CheckpointManager::save (everything, on the caller's thread) and
// CheckpointManager::save_async (the blocking part only), then waits the async one out before
// the next round. The time is the maximum over ranks; the table gives the medians.
#include <fsdp/checkpoint.h>
#include <fsdp/distributed.h>
#include <fsdp/fully_shard.h>
#include <fsdp/models/transformer.h>
#include <fsdp/optim_state_dict.h>

#include <ATen/ATen.h>
#include <torch/optim/adam.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

double max_over_ranks(double v) {
  at::Tensor t = at::full({1}, v, at::kDouble);
  fsdp::world()->all_reduce(t, fsdp::ReduceOp::kMax)->wait();
  return t.item<double>();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  std::string preset = "medium", dir = "/tmp/fsdp_bench_ckpt";
  int rounds = 3;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--preset") && i + 1 < argc) preset = argv[++i];
    else if (!std::strcmp(argv[i], "--rounds") && i + 1 < argc) rounds = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--dir") && i + 1 < argc) dir = argv[++i];
    else {
      std::fprintf(stderr, "usage: bench_checkpoint [--preset tiny|small|medium] [--rounds N] [--dir DIR]\n");
      return 2;
    }
  }
  fsdp::init_process_group();
  const int rank = fsdp::get_rank();
  torch::manual_seed(0);
  fsdp::models::Transformer model(fsdp::models::ModelArgs::preset(preset));
  const int64_t params = fsdp::models::count_parameters(*model);
  for (auto& block : model->blocks()) fsdp::fully_shard(block);
  fsdp::fully_shard(model);
  torch::optim::Adam opt(model->parameters(), 1e-3);
  fsdp::init_optimizer_state(opt);
  auto state = [&] {
    fsdp::ShardedStateDict sd;
    for (const auto& item : fsdp::sharded_state_dict(*model)) sd.insert("model." + item.key(), item.value());
    for (const auto& item : fsdp::sharded_optimizer_state_dict(*model, opt))
      sd.insert("optim." + item.key(), item.value());
    return sd;
  };
  int64_t local_bytes = 0;
  for (const auto& item : state())
    local_bytes += item.value().to_local().numel() * item.value().to_local().element_size();

  if (rank == 0) std::filesystem::remove_all(dir);
  fsdp::world()->barrier()->wait();
  fsdp::CheckpointManager sync_saver(dir + "/sync", 1), async_saver(dir + "/async", 1);
  std::vector<double> sync_s, async_block_s, async_total_s;
  for (int r = 0; r < rounds; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    sync_saver.save(r, state());
    sync_s.push_back(max_over_ranks(seconds_since(t0)));
    t0 = std::chrono::steady_clock::now();
    async_saver.save_async(r, state());
    async_block_s.push_back(max_over_ranks(seconds_since(t0)));
    async_saver.wait();
    async_total_s.push_back(max_over_ranks(seconds_since(t0)));
  }
  if (rank == 0) {
    std::printf(
        "bench_checkpoint: preset %s (%lld parameters), world %d, model + Adam state, %.1f MiB per rank, %d rounds\n",
        preset.c_str(), static_cast<long long>(params), fsdp::get_world_size(), local_bytes / 1048576.0, rounds);
    std::printf("  synchronous save            median %8.3f s\n", median(sync_s));
    std::printf("  async save, blocking part   median %8.3f s\n", median(async_block_s));
    std::printf("  async save, until written   median %8.3f s\n", median(async_total_s));
    std::printf("  blocked async / sync        %.3f\n", median(async_block_s) / median(sync_s));
  }
  fsdp::world()->barrier()->wait();
  if (rank == 0) std::filesystem::remove_all(dir);
  return 0;
}
