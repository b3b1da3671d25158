// The quantized collectives' codec on this CPU (src/tensor/quantize.h): encode and decode rates
// of each format, one thread (as one fsdp-train rank runs), and the link rate below which the
// bytes a format saves take longer to send than the format takes to encode and decode: above
// it the format costs more than it saves, even before compute hides any of it.
//
//   build/bench/bench_quantize [elements=5242880] [repeats=7]
#include "src/tensor/quantize.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

namespace {

double median_seconds(int repeats, const std::function<void()>& f) {
  f();  // warm-up: first touch of the buffers
  std::vector<double> t;
  for (int i = 0; i < repeats; ++i) {
    const auto a = std::chrono::steady_clock::now();
    f();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t n = argc > 1 ? std::atoll(argv[1]) : 5242880;
  const int repeats = argc > 2 ? std::atoi(argv[2]) : 7;
  at::set_num_threads(1);
  at::manual_seed(0);
  const at::Tensor x = at::randn({n}) * 0.02;
  const at::Tensor residual = at::zeros({n});
  std::printf("elements %lld, 1 thread, median of %d\n", static_cast<long long>(n), repeats);
  std::printf("%-12s %-10s %10s %10s %10s %12s %12s %14s\n", "format", "path", "encode ms", "decode ms", "bytes/el",
              "rel. error", "saves MB", "pays below");
  const double copy_ms = 1e3 * median_seconds(repeats, [&] { (void)x.clone(); });
  for (auto dtype : {fsdp::QuantizedDtype::kInt8, fsdp::QuantizedDtype::kFloat8E4M3, fsdp::QuantizedDtype::kBFloat16}) {
    const fsdp::QuantizedComm f = fsdp::QuantizedComm().dtype(dtype);
    const int64_t bytes = fsdp::detail::encoded_bytes(n, f);
    at::Tensor b = at::empty({bytes}, at::kByte), y = at::empty({n});
    for (bool reference : {false, true}) {
      if (reference && dtype == fsdp::QuantizedDtype::kBFloat16) continue;  // one path
      auto enc = reference ? fsdp::detail::encode_reference : fsdp::detail::encode;
      auto dec = reference ? fsdp::detail::decode_reference : fsdp::detail::decode;
      const double e = 1e3 * median_seconds(repeats, [&] { enc(x, b, f, at::Tensor()); });
      const double d = 1e3 * median_seconds(repeats, [&] { dec(b, y, f, false); });
      const double ef = 1e3 * median_seconds(repeats, [&] { enc(x, b, f, residual); });
      const double err = ((y - x).norm() / x.norm()).item<double>();
      const double saved = 4.0 * n - bytes;
      // Seconds of link time saved per second of codec time, as a rate: saved bits / codec s.
      const double pays_below_gbit = saved * 8 / ((e + d) * 1e-3) / 1e9;
      std::printf("%-12s %-10s %10.2f %10.2f %10.3f %12.2e %12.2f %11.2f Gbit/s   (with residual: encode %.2f ms)\n",
                  fsdp::to_string(dtype), reference ? "aten" : "loops", e, d, double(bytes) / n, err, saved / 1e6,
                  pays_below_gbit, ef);
    }
  }
  std::printf("fp32 copy of the same elements: %.2f ms\n", copy_ms);
  return 0;
}
