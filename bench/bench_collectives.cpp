// bench_collectives — bus bandwidth of fsdp-cpp's all-gather, reduce-scatter and all-reduce,
// next to c10d's ProcessGroupGloo all-gather and reduce-scatter into one tensor (what PyTorch's
// FSDP2 calls: all_gather_into_tensor and reduce_scatter_tensor) and its all-gather into a list
// of tensors (what FSDP1 and DDP-era code call), over real processes.
//
//   fsdprun --standalone --nproc-per-node 2 build/bench/bench_collectives [--iters N] [--json] [--sizes-kib K,...]
//   mpirun -np 2 build/bench/bench_collectives      # the MPI backend (no c10d column: no store)
//
// Sizes are the full (unsharded) payload: 1, 8 and 64 MiB of fp32 unless --sizes-kib lists
// others (small ones show the latency; each is rounded down to a multiple of W floats, at
// least W). Sizes of 64 MiB and more run half the iterations (at least 3). Each timed iteration starts
// after a barrier; a size's time is the maximum over ranks of the per-rank median. Bus bandwidth
// follows nccl-tests: size/time x (W-1)/W for all-gather and reduce-scatter, x 2(W-1)/W for
// all-reduce.
#include <fsdp/distributed.h>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <algorithm>
#include <cmath>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Median seconds of `op` over `iters` runs (after one warm-up), maxed over ranks.
double time_op(const std::function<void()>& op, int iters) {
  auto world = fsdp::world();
  op();
  std::vector<double> times;
  for (int i = 0; i < iters; ++i) {
    world->barrier()->wait();
    const auto t0 = Clock::now();
    op();
    times.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  at::Tensor m = at::full({1}, median(times), at::kDouble);
  world->all_reduce(m, fsdp::ReduceOp::kMax)->wait();
  return m.item<double>();
}

// c10d's Gloo group over the same store, for the baseline.
c10::intrusive_ptr<c10d::ProcessGroupGloo> make_c10d_gloo(const fsdp::RendezvousInfo& info) {
  c10d::TCPStoreOptions opts;
  opts.port = static_cast<std::uint16_t>(info.master_port);
  opts.isServer = false;
  opts.waitWorkers = false;
  auto tcp = c10::make_intrusive<c10d::TCPStore>(info.master_addr, opts);
  auto store = c10::make_intrusive<c10d::PrefixStore>("bench_c10d_gloo", tcp);
  auto options = c10d::ProcessGroupGloo::Options::create();
  options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, info.rank, info.world_size, options);
}

// "16,256,1024" -> {16, 256, 1024}; empty when any item is not a positive number.
std::vector<int64_t> parse_sizes(const char* list) {
  std::vector<int64_t> sizes;
  for (const char* p = list; *p;) {
    char* end = nullptr;
    const long long v = std::strtoll(p, &end, 10);
    if (end == p || v <= 0 || (*end != ',' && *end != '\0')) return {};
    sizes.push_back(v);
    p = *end == ',' ? end + 1 : end;
  }
  return sizes;
}

std::string size_label(int64_t kib) {
  return kib % 1024 == 0 ? std::to_string(kib / 1024) + " MiB" : std::to_string(kib) + " KiB";
}

}  // namespace

int main(int argc, char** argv) {
  int iters = 10;
  bool json = false;
  std::vector<int64_t> sizes_kib = {1024, 8 * 1024, 64 * 1024};
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--iters") && i + 1 < argc) iters = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--json")) json = true;
    else if (!std::strcmp(argv[i], "--sizes-kib") && i + 1 < argc && !(sizes_kib = parse_sizes(argv[++i])).empty()) {
    } else {
      std::fprintf(stderr, "usage: bench_collectives [--iters N] [--json] [--sizes-kib K,...] (positive KiB)\n");
      return 2;
    }
  }
  fsdp::init_process_group();
  const auto info = fsdp::rendezvous_info();
  auto pg = fsdp::world();
  const int W = pg->size(), r = pg->rank();
  // The c10d baseline needs the launcher's TCPStore, which only a torchrun-style launch has.
  const std::string backend = fsdp::backend();
  const bool baseline = backend == "gloo";
  c10::intrusive_ptr<c10d::ProcessGroupGloo> c10d_pg;
  if (baseline) c10d_pg = make_c10d_gloo(info);

  if (r == 0 && !json) {
    std::printf(
        "bench_collectives: W=%d, backend %s, fp32, bus bandwidth in GB/s (time in ms), median of %d, max "
        "over ranks\n",
        W, backend.c_str(), iters);
    std::printf("%-8s %-22s %-22s %-22s %-22s %-22s %-22s\n", "size", "all_gather (fsdp)", "reduce_scatter (fsdp)",
                "all_reduce (fsdp)", "all_gather (c10d gloo)", "reduce_scatter (c10d)", "all_gather list (c10d)");
  }
  for (int64_t kib : sizes_kib) {
    const int64_t n = kib * 1024 / 4;  // fp32 elements, full size
    const int64_t shard = std::max<int64_t>(1, n / W);
    const double bytes = static_cast<double>(shard * W * 4);
    const int it = kib >= 64 * 1024 ? std::max(3, iters / 2) : iters;
    at::Tensor full = at::rand({shard * W});
    at::Tensor piece = at::rand({shard});
    at::Tensor out = at::empty({shard});

    const double t_ag = time_op([&] { pg->all_gather_into(full, piece)->wait(); }, it);
    at::Tensor rs_in = at::rand({shard * W});
    const double t_rs = time_op([&] { pg->reduce_scatter_into(out, rs_in)->wait(); }, it);
    at::Tensor ar = at::rand({shard * W});
    const double t_ar = time_op([&] { pg->all_reduce(ar)->wait(); }, it);

    at::Tensor c10d_full = at::empty({shard * W});
    const double t_c10d =
        baseline ? time_op([&] { c10d_pg->_allgather_base(c10d_full, piece)->wait(); }, it) : std::nan("");
    std::vector<at::Tensor> c10d_in = {piece};
    std::vector<std::vector<at::Tensor>> c10d_list(1);
    for (int p = 0; p < W; ++p) c10d_list[0].push_back(at::empty({shard}));
    const double t_c10d_list =
        baseline ? time_op([&] { c10d_pg->allgather(c10d_list, c10d_in)->wait(); }, it) : std::nan("");
    at::Tensor c10d_rs_in = at::rand({shard * W}), c10d_rs_out = at::empty({shard});
    const double t_c10d_rs =
        baseline ? time_op([&] { c10d_pg->_reduce_scatter_base(c10d_rs_out, c10d_rs_in)->wait(); }, it) : std::nan("");

    const double frac = static_cast<double>(W - 1) / W;
    auto busbw = [&](double t, double factor) { return W > 1 ? bytes / t * factor / 1e9 : 0.0; };
    if (r != 0) continue;
    if (json) {
      // JSON has no NaN: a column that was not measured (c10d's, under mpirun) is null.
      auto number = [](double v) {
        if (std::isnan(v)) return std::string("null");
        char b[64];
        std::snprintf(b, sizeof b, "%.3f", v);
        return std::string(b);
      };
      std::printf(
          "{\"backend\": \"%s\", \"world\": %d, \"size_mib\": %.6g, \"size_bytes\": %.0f, \"all_gather_ms\": %.3f, "
          "\"all_gather_busbw\": %.3f, "
          "\"reduce_scatter_ms\": %.3f, \"reduce_scatter_busbw\": %.3f, \"all_reduce_ms\": %.3f, "
          "\"all_reduce_busbw\": %.3f, \"c10d_all_gather_ms\": %s, \"c10d_all_gather_busbw\": %s, "
          "\"c10d_reduce_scatter_ms\": %s, \"c10d_reduce_scatter_busbw\": %s, "
          "\"c10d_all_gather_list_ms\": %s, \"c10d_all_gather_list_busbw\": %s}\n",
          backend.c_str(), W, bytes / (1 << 20), bytes, t_ag * 1e3, busbw(t_ag, frac), t_rs * 1e3, busbw(t_rs, frac),
          t_ar * 1e3, busbw(t_ar, 2 * frac), number(t_c10d * 1e3).c_str(), number(busbw(t_c10d, frac)).c_str(),
          number(t_c10d_rs * 1e3).c_str(), number(busbw(t_c10d_rs, frac)).c_str(), number(t_c10d_list * 1e3).c_str(),
          number(busbw(t_c10d_list, frac)).c_str());
    } else {
      auto cell = [&](double t, double factor) -> const char* {
        if (std::isnan(t)) return "-";
        static char buf[6][64];
        static int k = 0;
        char* b = buf[k++ % 6];
        std::snprintf(b, 64, "%.2f (%.2f ms)", busbw(t, factor), t * 1e3);
        return b;
      };
      std::printf("%-8s %-22s %-22s %-22s %-22s %-22s %-22s\n", size_label(kib).c_str(), cell(t_ag, frac),
                  cell(t_rs, frac), cell(t_ar, 2 * frac), cell(t_c10d, frac), cell(t_c10d_rs, frac),
                  cell(t_c10d_list, frac));
    }
    std::fflush(stdout);
  }
  pg->barrier()->wait();
  fsdp::destroy_process_group();
  std::fflush(stdout);
  // MPI is finalised by an exit handler, so the MPI run leaves through exit().
  if (!baseline) return 0;
  // c10d's Gloo group can hang in its destructor at exit; leave without running destructors.
  std::_Exit(0);
}
