// hardware.cpp — the start-up check of native bf16 support (hardware.h).
#include "run/hardware.h"

#include "config/read_file.h"

#include <ATen/Functions.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <sstream>

namespace fsdp {
namespace train {
namespace {

const char* const kNativeBf16Flags[] = {"avx512_bf16", "amx_bf16"};

// 4.8, 68: one decimal below 10, none above (rates and ratios read at a glance).
std::string short_number(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, v < 10 ? "%.1f" : "%.0f", v);
  return buf;
}

// GFLOP/s of n x n matmuls in `dtype`. The operands are not random: drawing them would move the
// default generator, which the run's dropout and its checkpoints depend on.
double matmul_gflops(at::ScalarType dtype, double seconds) {
  constexpr int64_t n = 256;
  const at::Tensor a = at::linspace(-1.0, 1.0, n * n).reshape({n, n}).to(dtype);
  const at::Tensor b = a.t().contiguous();
  at::matmul(a, b);  // warm-up: first-call allocations and kernel selection
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  int64_t calls = 0;
  double elapsed = 0;
  do {
    at::matmul(a, b);
    ++calls;
    elapsed = std::chrono::duration<double>(Clock::now() - start).count();
  } while (elapsed < seconds);
  return 2.0 * n * n * n * static_cast<double>(calls) / elapsed / 1e9;
}

}  // namespace

std::vector<std::string> native_bf16_flags(const std::string& cpuinfo) {
  std::vector<std::string> words;
  std::istringstream in(cpuinfo);
  for (std::string w; in >> w;) words.push_back(w);
  std::vector<std::string> found;
  for (const char* flag : kNativeBf16Flags)
    if (std::find(words.begin(), words.end(), flag) != words.end()) found.push_back(flag);
  return found;
}

std::string cpu_flags_text() {
  if (const char* flags = std::getenv("FSDP_TRAIN_CPU_FLAGS")) return flags;
  try {
    return read_file("/proc/cpuinfo", {"", "", ""});
  } catch (const std::exception&) {
    return "";  // not Linux, or no procfs: the probe decides
  }
}

MatmulRates measure_matmul_rates(double seconds_per_dtype) {
  MatmulRates r;
  r.bf16_gflops = matmul_gflops(at::kBFloat16, seconds_per_dtype);
  r.fp32_gflops = matmul_gflops(at::kFloat, seconds_per_dtype);
  return r;
}

std::string bf16_support_line(const std::vector<std::string>& native_flags,
                              const std::optional<MatmulRates>& measured) {
  if (!native_flags.empty()) {
    std::string list;
    for (const auto& f : native_flags) list += (list.empty() ? "" : ", ") + f;
    return "fsdp-train: this CPU has native bf16 (" + list + ")";
  }
  std::string line = "this CPU has no native bf16 (no avx512_bf16 or amx_bf16 flag)";
  if (!measured) return "fsdp-train: " + line;
  line += ": bf16 matmul " + short_number(measured->bf16_gflops) + " GFLOP/s vs fp32 " +
          short_number(measured->fp32_gflops);
  if (measured->bf16_gflops >= measured->fp32_gflops)
    return "fsdp-train: " + line + "; bf16 is not the slower one here, so mixed precision costs no speed";
  const double slower = measured->fp32_gflops / std::max(measured->bf16_gflops, 1e-9);
  return "fsdp-train: warning: " + line + "; mixed precision will be up to ~" + short_number(slower) +
         "x slower: turn it off (fsdp_config.param_dtype: float32) or train on a CPU with avx512_bf16 or "
         "amx_bf16";
}

std::string check_bf16_support() {
  const std::vector<std::string> flags = native_bf16_flags(cpu_flags_text());
  if (!flags.empty()) return bf16_support_line(flags, std::nullopt);
  return bf16_support_line(flags, measure_matmul_rates());
}

}  // namespace train
}  // namespace fsdp
