// bench_fsdp — training steps of the Transformer under fully_shard: what FSDP's hooks cost, and how
// much of FSDP's communication the steps hide behind compute.
//
//   bench_fsdp overhead [--preset small] [--batch 4] [--seq 128] [--warmup 2] [--rounds 10]
//                       [--steps 1] [--json]
//     One process (world 1; no launcher needed). Times training steps (zero_grad, forward through
//     fsdp::call, cross-entropy, backward, Adam step) of (A) the plain model and (B) the same model
//     with fully_shard on every block and on the root, alternating A B A B ... for --rounds rounds
//     of --steps steps each, after --warmup steps of each. Prints the median step times and the
//     ratio B / A. On one rank fully_shard communicates nothing, so the ratio is the cost of the
//     hooks and of FSDP's bookkeeping.
//
//   fsdprun --standalone --nproc-per-node 2 bench_fsdp overlap
//       [--preset small] [--batch 4] [--seq 128] [--warmup 2] [--steps 5] [--explicit-prefetch] [--json]
//     The sharded model on every rank (fully_shard on each block and the root, implicit prefetch
//     unless --explicit-prefetch). For each timed step: the step time and, from the counters of
//     the FSDP mesh's process group, per kind of collective:
//       busy    = time the group's communication thread spent running the operations,
//       blocked = time the training thread spent blocked in Work::wait() for them,
//       hidden  = max(busy - blocked, 0), the communication that overlapped with compute,
//     and hidden / busy. --batch is per rank here (each rank trains on its own tokens).
//     (fsdprun sets OMP_NUM_THREADS and OPENBLAS_NUM_THREADS to 1 per rank unless already set.)
//     Caveats: both counters are measured on this rank only. "busy" includes the time the
//     communication thread waits for a slower peer, and operations run one at a time in issue
//     order, so time blocked on an all-gather queued behind a reduce-scatter is charged to the
//     all-gather; the per-kind split is therefore approximate, the total is not.
//
//     On a 2-vCPU machine the two ranks (and their communication threads) share one physical
//     core, so "overlap" there is time-slicing, not concurrency: the numbers are printed but
//     are not meaningful. Measure overlap on a machine with cores to spare (at least two physical
//     cores per rank: one computes, one communicates).
//
// Both modes print the peak tensor bytes allocated during a step (fsdp::memory), per rank.
#include <fsdp/call.h>
#include <fsdp/device_mesh.h>
#include <fsdp/distributed.h>
#include <fsdp/fully_shard.h>
#include <fsdp/memory.h>
#include <fsdp/models/transformer.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Functions.h>
#include <ATen/Parallel.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adam.h>
#include <torch/utils.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;
using fsdp::CollectiveKind;
using fsdp::models::Transformer;

struct Options {
  std::string mode;
  std::string preset = "small";
  int64_t batch = 4;
  int64_t seq = 128;
  int warmup = 2;
  int rounds = 10;
  int steps = 0;  // 0: 1 per round (overhead) or 5 (overlap)
  bool explicit_prefetch = false;
  bool json = false;
};

[[noreturn]] void usage() {
  std::fprintf(stderr,
               "usage: bench_fsdp overhead [--preset P] [--batch B] [--seq S] [--warmup N] [--rounds R] [--steps N] "
               "[--json]\n"
               "       fsdprun ... bench_fsdp overlap [--preset P] [--batch B] [--seq S] [--warmup N] [--steps N] "
               "[--explicit-prefetch] [--json]\n");
  std::exit(2);
}

Options parse_args(int argc, char** argv) {
  Options o;
  if (argc < 2) usage();
  o.mode = argv[1];
  if (o.mode != "overhead" && o.mode != "overlap") usage();
  for (int i = 2; i < argc; ++i) {
    const bool has_value = i + 1 < argc;
    if (!std::strcmp(argv[i], "--preset") && has_value) o.preset = argv[++i];
    else if (!std::strcmp(argv[i], "--batch") && has_value) o.batch = std::atoll(argv[++i]);
    else if (!std::strcmp(argv[i], "--seq") && has_value) o.seq = std::atoll(argv[++i]);
    else if (!std::strcmp(argv[i], "--warmup") && has_value) o.warmup = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--rounds") && has_value) o.rounds = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--steps") && has_value) o.steps = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--explicit-prefetch")) o.explicit_prefetch = true;
    else if (!std::strcmp(argv[i], "--json")) o.json = true;
    else usage();
  }
  if (o.steps <= 0) o.steps = o.mode == "overhead" ? 1 : 5;
  return o;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// OpenBLAS does the matmuls and ignores at::set_num_threads (docs/blas.md): report its setting.
const char* blas_threads() {
  const char* v = std::getenv("OPENBLAS_NUM_THREADS");
  return v ? v : "unset";
}

template <typename... Args>
std::string format(const char* fmt, Args... args) {
  char buf[1024];
  std::snprintf(buf, sizeof buf, fmt, args...);
  return buf;
}

double mib(double bytes) { return bytes / (1024.0 * 1024.0); }

fsdp::models::ModelArgs model_args(const Options& o) {
  fsdp::models::ModelArgs args = fsdp::models::ModelArgs::preset(o.preset);
  args.dropout_p = 0.0;  // deterministic work per step
  TORCH_CHECK(o.seq >= 1 && o.seq <= args.max_seq_len, "--seq must be in [1, ", args.max_seq_len, "] for preset ",
              o.preset);
  return args;
}

// Random tokens and targets, int64 [batch, seq]; `seed` differs per rank.
std::pair<at::Tensor, at::Tensor> random_batch(const Options& o, int64_t vocab, uint64_t seed) {
  at::Generator gen = at::detail::createCPUGenerator(seed);
  const auto i64 = at::TensorOptions().dtype(at::kLong);
  return {at::randint(0, vocab, {o.batch, o.seq}, gen, i64), at::randint(0, vocab, {o.batch, o.seq}, gen, i64)};
}

// fully_shard on every block, then the root; returns the block handles and the root's.
std::pair<std::vector<fsdp::FSDPModule>, fsdp::FSDPModule> shard_model(Transformer& model,
                                                                       const fsdp::DeviceMesh& mesh) {
  std::vector<fsdp::FSDPModule> blocks;
  for (auto& block : model->blocks()) blocks.push_back(fsdp::fully_shard(block, fsdp::FullyShardOptions().mesh(mesh)));
  fsdp::FSDPModule root = fsdp::fully_shard(model, fsdp::FullyShardOptions().mesh(mesh));
  return {blocks, root};
}

// One training step; returns its wall time in seconds.
double train_step(Transformer& model, torch::optim::Optimizer& optim, const at::Tensor& x, const at::Tensor& y) {
  const auto t0 = Clock::now();
  optim.zero_grad();
  at::Tensor logits = fsdp::call(model, x);
  at::Tensor loss = torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}), y.reshape({-1}));
  loss.backward();
  optim.step();
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// ------------------------------------------------------------------------------ overhead (W = 1)

int run_overhead(const Options& o) {
  fsdp::init_process_group();
  TORCH_CHECK(fsdp::get_world_size() == 1, "bench_fsdp overhead runs as one process; start it without fsdprun");
  const auto args = model_args(o);

  // The same initial weights for both variants.
  torch::manual_seed(0);
  Transformer plain(args);
  torch::manual_seed(0);
  Transformer sharded(args);
  const int64_t n_params = fsdp::models::count_parameters(*plain);
  auto mesh = fsdp::init_device_mesh("cpu", {1});
  shard_model(sharded, mesh);

  torch::optim::Adam optim_plain(plain->parameters(), torch::optim::AdamOptions(1e-3));
  torch::optim::Adam optim_sharded(sharded->parameters(), torch::optim::AdamOptions(1e-3));
  auto [x, y] = random_batch(o, args.vocab_size, /*seed=*/100);

  struct Variant {
    const char* name;
    Transformer* model;
    torch::optim::Optimizer* optim;
    std::vector<double> times;
    int64_t peak_delta = 0;  // largest (peak during a step - allocated before it)
  };
  Variant variants[2] = {{"plain", &plain, &optim_plain, {}, 0}, {"sharded", &sharded, &optim_sharded, {}, 0}};

  for (int w = 0; w < o.warmup; ++w) {
    for (auto& v : variants) train_step(*v.model, *v.optim, x, y);
  }
  for (int r = 0; r < o.rounds; ++r) {
    for (auto& v : variants) {  // A B A B ...
      for (int s = 0; s < o.steps; ++s) {
        const int64_t before = fsdp::memory::allocated_bytes();
        fsdp::memory::reset_peak_allocated();
        v.times.push_back(train_step(*v.model, *v.optim, x, y));
        v.peak_delta = std::max(v.peak_delta, fsdp::memory::max_allocated_bytes() - before);
      }
    }
  }

  const double a = median(variants[0].times), b = median(variants[1].times);
  std::printf(
      "bench_fsdp overhead: preset %s (%d blocks, %lld parameters), batch %lld, seq %lld, dropout 0, "
      "world 1, %d intra-op threads, OPENBLAS_NUM_THREADS %s\n",
      o.preset.c_str(), static_cast<int>(args.n_layers), static_cast<long long>(n_params),
      static_cast<long long>(o.batch), static_cast<long long>(o.seq), at::get_num_threads(), blas_threads());
  std::printf("  %d warm-up steps each, then %d rounds x %d steps per variant, alternating\n", o.warmup, o.rounds,
              o.steps);
  for (const auto& v : variants) {
    std::printf("  %-8s median %8.4f s  (min %.4f, max %.4f)  peak tensor bytes above step start %.1f MiB\n", v.name,
                median(v.times), *std::min_element(v.times.begin(), v.times.end()),
                *std::max_element(v.times.begin(), v.times.end()), mib(static_cast<double>(v.peak_delta)));
  }
  const double amin = *std::min_element(variants[0].times.begin(), variants[0].times.end());
  const double bmin = *std::min_element(variants[1].times.begin(), variants[1].times.end());
  std::printf("  ratio sharded / plain: %.4f (medians), %.4f (minima)\n", b / a, bmin / amin);
  std::printf("  tensor bytes resident now (both models and their Adam states): %.1f MiB\n",
              mib(static_cast<double>(fsdp::memory::allocated_bytes())));
  if (o.json) {
    std::printf(
        "{\"bench\":\"fsdp_overhead\",\"preset\":\"%s\",\"batch\":%lld,\"seq\":%lld,\"threads\":%d,"
        "\"steps_per_variant\":%zu,\"plain_median_s\":%.6f,\"sharded_median_s\":%.6f,\"ratio\":%.6f,\"ratio_min\":%.6f,"
        "\"plain_step_peak_bytes\":%lld,\"sharded_step_peak_bytes\":%lld}\n",
        o.preset.c_str(), static_cast<long long>(o.batch), static_cast<long long>(o.seq), at::get_num_threads(),
        variants[0].times.size(), a, b, b / a, bmin / amin, static_cast<long long>(variants[0].peak_delta),
        static_cast<long long>(variants[1].peak_delta));
  }
  return 0;
}

// ------------------------------------------------------------------------------ overlap (W >= 2)

struct KindTimes {
  double busy_ms = 0, blocked_ms = 0;
  int64_t calls = 0;
  double hidden_ms() const { return std::max(busy_ms - blocked_ms, 0.0); }
  // Percent of the communication time that was hidden; negative when there was none.
  double hidden_pct() const { return busy_ms > 0 ? 100.0 * hidden_ms() / busy_ms : -1.0; }
};

KindTimes kind_times(const fsdp::CollectiveStats& s, CollectiveKind k) {
  const fsdp::CollectiveCounters& c = s[k];
  return {c.busy_ns / 1e6, c.blocked_ns / 1e6, c.calls};
}

std::string pct(double p) {
  if (p < 0) return "    -";
  char buf[16];
  std::snprintf(buf, sizeof buf, "%4.0f%%", p);
  return buf;
}

int run_overlap(const Options& o) {
  fsdp::init_process_group();
  const int rank = fsdp::get_rank(), world = fsdp::get_world_size();
  const auto args = model_args(o);
  auto mesh = fsdp::init_device_mesh("cpu", {world});
  auto pg = mesh.get_group(0);  // FSDP's collectives run here, not on fsdp::world()
  auto world_group = fsdp::world();

  torch::manual_seed(0);
  Transformer model(args);
  auto [blocks, root] = shard_model(model, mesh);
  if (o.explicit_prefetch) {  // as in examples/train_fsdp_explicit_prefetch.cpp
    const int n = static_cast<int>(blocks.size());
    for (int i = 0; i < n; ++i) {
      std::vector<fsdp::FSDPModule> next, previous;
      for (int j = 1; j <= 2 && i + j < n; ++j) next.push_back(blocks[i + j]);
      for (int j = 1; j <= 2 && i - j >= 0; ++j) previous.push_back(blocks[i - j]);
      if (!next.empty()) blocks[i].set_modules_to_forward_prefetch(next);
      if (!previous.empty()) blocks[i].set_modules_to_backward_prefetch(previous);
    }
  }
  torch::optim::Adam optim(model->parameters(), torch::optim::AdamOptions(1e-3));
  auto [x, y] = random_batch(o, args.vocab_size, /*seed=*/100 + rank);
  auto step = [&] {
    if (o.explicit_prefetch) root.unshard(/*async_op=*/true);
    return train_step(model, optim, x, y);
  };

  for (int w = 0; w < o.warmup; ++w) step();

  struct StepRecord {
    double time_s;
    KindTimes ag, rs;
    int64_t peak_bytes;
  };
  std::vector<StepRecord> records;
  for (int s = 0; s < o.steps; ++s) {
    world_group->barrier()->wait();  // start together (the world group is not the mesh's group)
    pg->reset_stats();
    fsdp::memory::reset_peak_allocated();
    const double t = step();
    const fsdp::CollectiveStats stats = pg->stats();
    records.push_back({t, kind_times(stats, CollectiveKind::kAllGather),
                       kind_times(stats, CollectiveKind::kReduceScatter), fsdp::memory::max_allocated_bytes()});
  }

  std::vector<std::string> json_lines;  // printed after the tables
  if (rank == 0) {
    std::printf(
        "bench_fsdp overlap: preset %s, batch %lld per rank, seq %lld, dropout 0, world %d, %s prefetch, "
        "%d intra-op threads per rank, OPENBLAS_NUM_THREADS %s\n",
        o.preset.c_str(), static_cast<long long>(o.batch), static_cast<long long>(o.seq), world,
        o.explicit_prefetch ? "explicit" : "implicit", at::get_num_threads(), blas_threads());
    std::printf("rank 0, per step (ms; hidden = busy - blocked):\n");
    std::printf(
        "  step  time_ms | all-gather  n   busy blocked hidden | reduce-scatter n   busy blocked hidden | "
        "total hidden\n");
    for (size_t i = 0; i < records.size(); ++i) {
      const auto& r = records[i];
      KindTimes tot{r.ag.busy_ms + r.rs.busy_ms, r.ag.blocked_ms + r.rs.blocked_ms, r.ag.calls + r.rs.calls};
      std::printf("  %4zu %8.1f | %12lld %6.1f %7.1f %s | %16lld %6.1f %7.1f %s | %7.1f %s\n", i, r.time_s * 1e3,
                  static_cast<long long>(r.ag.calls), r.ag.busy_ms, r.ag.blocked_ms, pct(r.ag.hidden_pct()).c_str(),
                  static_cast<long long>(r.rs.calls), r.rs.busy_ms, r.rs.blocked_ms, pct(r.rs.hidden_pct()).c_str(),
                  tot.hidden_ms(), pct(tot.hidden_pct()).c_str());
      if (o.json) {
        json_lines.push_back(
            format("{\"bench\":\"fsdp_overlap\",\"rank\":0,\"step\":%zu,\"time_s\":%.6f,\"ag_calls\":%lld,"
                   "\"ag_busy_ms\":%.3f,\"ag_blocked_ms\":%.3f,\"rs_calls\":%lld,\"rs_busy_ms\":%.3f,"
                   "\"rs_blocked_ms\":%.3f,\"hidden_pct\":%.2f}",
                   i, r.time_s, static_cast<long long>(r.ag.calls), r.ag.busy_ms, r.ag.blocked_ms,
                   static_cast<long long>(r.rs.calls), r.rs.busy_ms, r.rs.blocked_ms, tot.hidden_pct()));
      }
    }
  }

  // Per-rank summary, gathered on rank 0: median step, summed busy / blocked, peak bytes.
  constexpr int kCols = 7;
  at::Tensor summary = at::zeros({world, kCols}, at::kDouble);
  {
    std::vector<double> times;
    double ag_busy = 0, ag_blocked = 0, rs_busy = 0, rs_blocked = 0, peak = 0;
    for (const auto& r : records) {
      times.push_back(r.time_s);
      ag_busy += r.ag.busy_ms, ag_blocked += r.ag.blocked_ms, rs_busy += r.rs.busy_ms, rs_blocked += r.rs.blocked_ms;
      peak = std::max(peak, static_cast<double>(r.peak_bytes));
    }
    const double row[kCols] = {median(times),
                               ag_busy,
                               ag_blocked,
                               rs_busy,
                               rs_blocked,
                               peak,
                               static_cast<double>(fsdp::memory::allocated_bytes())};
    for (int c = 0; c < kCols; ++c) summary[rank][c] = row[c];
  }
  world_group->all_reduce(summary, fsdp::ReduceOp::kSum)->wait();
  if (rank == 0) {
    std::printf("per rank, over %d steps (ms):\n", o.steps);
    std::printf(
        "  rank median_step | ag busy blocked hidden | rs busy blocked hidden | total hidden | peak tensor MiB "
        "(resident)\n");
    for (int r = 0; r < world; ++r) {
      auto v = [&](int c) { return summary[r][c].item<double>(); };
      KindTimes ag{v(1), v(2), 0}, rs{v(3), v(4), 0}, tot{v(1) + v(3), v(2) + v(4), 0};
      std::printf("  %4d %9.1f ms | %7.1f %7.1f %s | %7.1f %7.1f %s | %7.1f %s | %7.1f (%.1f)\n", r, v(0) * 1e3,
                  ag.busy_ms, ag.blocked_ms, pct(ag.hidden_pct()).c_str(), rs.busy_ms, rs.blocked_ms,
                  pct(rs.hidden_pct()).c_str(), tot.hidden_ms(), pct(tot.hidden_pct()).c_str(), mib(v(5)), mib(v(6)));
      if (o.json) {
        json_lines.push_back(format(
            "{\"bench\":\"fsdp_overlap_summary\",\"rank\":%d,\"world\":%d,\"preset\":\"%s\",\"explicit_prefetch\":%s,"
            "\"median_step_s\":%.6f,\"ag_busy_ms\":%.3f,\"ag_blocked_ms\":%.3f,\"rs_busy_ms\":%.3f,"
            "\"rs_blocked_ms\":%.3f,\"hidden_pct\":%.2f,\"peak_allocated_bytes\":%.0f}",
            r, world, o.preset.c_str(), o.explicit_prefetch ? "true" : "false", v(0), v(1), v(2), v(3), v(4),
            tot.hidden_pct(), v(5)));
      }
    }
    if (std::thread::hardware_concurrency() < 2u * static_cast<unsigned>(world)) {
      std::printf(
          "note: %u hardware threads for %d ranks: ranks and communication threads time-share cores, so "
          "these overlap numbers are not meaningful\n",
          std::thread::hardware_concurrency(), world);
    }
    for (const auto& line : json_lines) std::printf("%s\n", line.c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse_args(argc, argv);
  return o.mode == "overhead" ? run_overhead(o) : run_overlap(o);
}
