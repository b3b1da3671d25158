// bench_fsdp_copies — the host cost of FSDP's buffer copies, in one process: the reduce-scatter
// copy-in (foreach_reduce_copy_in) and the all-gather copy-out (foreach_all_gather_copy_out) of
// one group shaped as a Transformer block of dimension d plus an embedding of 32d rows, as rank 0
// of W ranks. Prints the median and 10th-percentile time of each, in microseconds.
//
//   build/bench/bench_fsdp_copies [W=2] [iterations=300] [d=256]
//
// It includes private headers of src/fsdp only, so the same source also builds against another
// checkout's headers and libfsdp (docs/benchmarks.md compares two builds that way).
#include "src/fsdp/collectives.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

using fsdp::detail::AllGatherResult;
using fsdp::detail::FSDPParam;
using fsdp::detail::FSDPParams;
using fsdp::detail::RankMajorLayout;
using fsdp::detail::ReducedParams;

namespace {

template <typename F>
std::vector<double> times_us(int iterations, F f) {
  std::vector<double> t;
  for (int k = 0; k < iterations; ++k) {
    const auto begin = std::chrono::steady_clock::now();
    f();
    t.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - begin).count());
  }
  std::sort(t.begin(), t.end());
  return t;
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t world = argc > 1 ? std::atoi(argv[1]) : 2;
  const int iterations = argc > 2 ? std::atoi(argv[2]) : 300;
  const int64_t d = argc > 3 ? std::atoi(argv[3]) : 256;
  at::set_num_threads(1);
  const std::vector<std::vector<int64_t>> shapes = {{d, d},     {d, d}, {d, d}, {d, d},     {4 * d, d},
                                                    {d, 4 * d}, {d},    {d},    {32 * d, d}};
  FSDPParams params;
  std::vector<at::Tensor> grads;
  for (size_t i = 0; i < shapes.size(); ++i) {
    params.push_back(
        std::make_unique<FSDPParam>("p" + std::to_string(i), at::randn(shapes[i]).set_requires_grad(true), world, 0));
    grads.push_back(at::randn(shapes[i]));
  }
  const RankMajorLayout layout = fsdp::detail::shard_layout(params, world);
  fsdp::detail::init_flat_shard(params, layout);
  ReducedParams all(params.size());
  for (size_t i = 0; i < all.size(); ++i) all[i] = i;
  const at::Tensor output = at::randn({layout.numel()});
  for (auto& p : params) p->alloc_unsharded();

  const auto copy_in = times_us(iterations, [&] {
    for (size_t i = 0; i < params.size(); ++i) params[i]->unsharded().mutable_grad() = grads[i];
    fsdp::detail::foreach_reduce_copy_in(params, all, layout, at::kFloat);
  });
  const auto copy_out = times_us(iterations, [&] {
    fsdp::detail::foreach_all_gather_copy_out(AllGatherResult{nullptr, output, layout, std::nullopt, std::nullopt},
                                              params);
  });
  std::printf("W=%ld d=%ld bytes=%ld copy_in median %.1f us p10 %.1f | copy_out median %.1f us p10 %.1f\n",
              static_cast<long>(world), static_cast<long>(d), static_cast<long>(layout.numel() * 4),
              copy_in[iterations / 2], copy_in[iterations / 10], copy_out[iterations / 2], copy_out[iterations / 10]);
  return 0;
}
