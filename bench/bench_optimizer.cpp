// bench_optimizer — the step time of fsdp::optim::FusedAdamW against torch::optim::AdamW on the
// shards one rank of a fully_shard'ed Transformer holds.
//
//   bench_optimizer [--preset medium] [--worlds 1,2] [--threads 1,0] [--rounds 7] [--warmup 1]
//
// One process, no communication: for each world size W it lays out rank 0's shards of the
// preset's parameters exactly as fully_shard does (one flat buffer per group, a group being a
// block or the root's own parameters; each parameter's piece is ceil(rows / W) rows, padded;
// the sharded parameters are views into the buffer and their gradients views into a second
// buffer of the same layout, like a reduce-scatter output) and fills them with random values.
// Both optimizers step these same tensors, each with its own state (created by one warm-up
// step): FusedAdamW, AdamW, FusedAdamW, ... for --rounds rounds. Prints the median step times,
// their ratio, and the bytes per second the fused pass moves (28 bytes per fp32 element: p, g,
// exp_avg, exp_avg_sq read, p and both moments written). --threads lists the ATen thread counts
// to run (at::set_num_threads; 0: one per CPU the process may use). fsdprun gives each rank
// OMP_NUM_THREADS=1, and ATen's own default is the number of physical cores it detects.
// The weight decay is on (AdamW's default 0.01), amsgrad off, as in fsdp-train.
#include <fsdp/fused_adamw.h>
#include <fsdp/models/transformer.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/accumulate.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

struct Options {
  std::string preset = "medium";
  std::vector<int64_t> worlds = {1, 2};
  std::vector<int64_t> threads = {1, 0};
  int rounds = 7;
  int warmup = 1;
};

[[noreturn]] void usage() {
  std::fprintf(stderr,
               "usage: bench_optimizer [--preset P] [--worlds 1,2] [--threads 1,0] [--rounds R] [--warmup N]\n");
  std::exit(2);
}

std::vector<int64_t> parse_list(const char* text) {
  std::vector<int64_t> out;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');) out.push_back(std::atoll(item.c_str()));
  return out;
}

Options parse_args(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const bool has_value = i + 1 < argc;
    if (!std::strcmp(argv[i], "--preset") && has_value) o.preset = argv[++i];
    else if (!std::strcmp(argv[i], "--worlds") && has_value) o.worlds = parse_list(argv[++i]);
    else if (!std::strcmp(argv[i], "--threads") && has_value) o.threads = parse_list(argv[++i]);
    else if (!std::strcmp(argv[i], "--rounds") && has_value) o.rounds = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--warmup") && has_value) o.warmup = std::atoi(argv[++i]);
    else usage();
  }
  if (o.rounds < 1 || o.worlds.empty() || o.threads.empty()) usage();
  return o;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

std::string cpu_model() {
  std::ifstream f("/proc/cpuinfo");
  for (std::string line; std::getline(f, line);) {
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  }
  return "unknown";
}

// The preset's parameter shapes, grouped as fully_shard on every block and then the root
// groups them: one group per block ("layers.<i>."), the root's own parameters last.
std::vector<std::vector<std::vector<int64_t>>> parameter_groups(const std::string& preset) {
  fsdp::models::Transformer model(fsdp::models::ModelArgs::preset(preset));
  std::map<std::string, std::vector<std::vector<int64_t>>> blocks;
  std::vector<std::vector<int64_t>> root;
  for (const auto& item : model->named_parameters()) {
    const std::string& name = item.key();
    if (name.rfind("layers.", 0) == 0) {
      blocks[name.substr(0, name.find('.', 7))].push_back(item.value().sizes().vec());
    } else {
      root.push_back(item.value().sizes().vec());
    }
  }
  std::vector<std::vector<std::vector<int64_t>>> groups;
  for (auto& block : blocks) groups.push_back(std::move(block.second));
  groups.push_back(std::move(root));
  return groups;
}

// Rank 0's shards at world size `world`: parameters (leaves) that view one flat buffer per
// group, with gradients that view a second buffer of the same layout.
struct Shards {
  std::vector<at::Tensor> params;
  std::vector<at::Tensor> buffers;  // keeps the flat gradient buffers alive (the views do too)
  int64_t numel = 0;                // real elements, padding left out
};

Shards rank0_shards(const std::vector<std::vector<std::vector<int64_t>>>& groups, int64_t world) {
  Shards out;
  for (const auto& shapes : groups) {
    std::vector<int64_t> offsets;
    int64_t group_numel = 0;
    for (const auto& shape : shapes) {
      offsets.push_back(group_numel);
      const int64_t rows = (shape[0] + world - 1) / world;
      group_numel += rows * (c10::multiply_integers(shape) / shape[0]);
    }
    at::Tensor flat_param = at::randn({group_numel}) * 0.02;
    at::Tensor flat_grad = at::randn({group_numel}) * 1e-3;
    for (size_t i = 0; i < shapes.size(); ++i) {
      std::vector<int64_t> shard_shape = shapes[i];
      shard_shape[0] = (shard_shape[0] + world - 1) / world;  // rank 0 always has a full piece
      const int64_t n = c10::multiply_integers(shard_shape);
      at::Tensor p = flat_param.narrow(0, offsets[i], n).view(shard_shape).detach().requires_grad_();
      p.mutable_grad() = flat_grad.narrow(0, offsets[i], n).view(shard_shape);
      out.params.push_back(p);
      out.numel += n;
    }
    out.buffers.push_back(flat_grad);
  }
  return out;
}

double timed_step(torch::optim::Optimizer& opt) {
  const auto t0 = Clock::now();
  opt.step();
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

void run_one(const Shards& shards, int64_t world, int threads, const Options& o) {
  at::set_num_threads(threads);
  fsdp::optim::FusedAdamW fused(shards.params, torch::optim::AdamWOptions(1e-4));
  torch::optim::AdamW reference(shards.params, torch::optim::AdamWOptions(1e-4));
  for (int w = 0; w < o.warmup; ++w) {
    timed_step(fused);
    timed_step(reference);
  }
  std::vector<double> fused_s, reference_s;
  for (int r = 0; r < o.rounds; ++r) {
    fused_s.push_back(timed_step(fused));
    reference_s.push_back(timed_step(reference));
  }
  const double f = median(fused_s), a = median(reference_s);
  const double gb_per_s = 28.0 * static_cast<double>(shards.numel) / f / 1e9;
  std::printf("| %5lld | %7d | %13.1f | %10.1f | %14.1f | %10.2fx | %9.1f | %10lld |\n", static_cast<long long>(world),
              threads, shards.numel / 1e6, a * 1e3, f * 1e3, f / a, gb_per_s,
              static_cast<long long>(fused.last_step_stats().fused_runs));
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse_args(argc, argv);
  const int initial_threads = at::get_num_threads();
  const int cpus = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const char* coretype = std::getenv("OPENBLAS_CORETYPE");
  std::printf("bench_optimizer: preset %s, %d rounds (median), warm-up %d\n", o.preset.c_str(), o.rounds, o.warmup);
  std::printf("cpu: %s; %d CPUs; ATen threads at start: %d; OPENBLAS_CORETYPE=%s\n", cpu_model().c_str(), cpus,
              initial_threads, coretype ? coretype : "unset");
  const char* caching = std::getenv("FSDP_CPU_CACHING");
  std::printf(
      "rank 0's fp32 shards, laid out as fully_shard does; AdamW lr 1e-4, weight_decay 0.01; fsdp's CPU block "
      "cache (AdamW's temporaries) %s\n\n",
      caching && std::string(caching) == "0" ? "off" : "on");
  std::printf(
      "| world | threads | params/rank M | AdamW ms | FusedAdamW ms | fused/AdamW | fused GB/s | fused runs |\n"
      "|------:|--------:|--------------:|---------:|--------------:|------------:|----------:|-----------:|\n");
  const auto groups = parameter_groups(o.preset);
  for (int64_t world : o.worlds) {
    const Shards shards = rank0_shards(groups, world);
    for (int64_t t : o.threads) run_one(shards, world, t > 0 ? static_cast<int>(t) : cpus, o);
  }
  return 0;
}
