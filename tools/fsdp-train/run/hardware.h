// hardware.h — whether this CPU runs bf16 matmuls natively, checked at start-up when a run
// computes in bf16. Without native support (AVX512-BF16 or AMX-BF16), LibTorch's bf16 matmuls
// fall back to slow conversion loops, often an order of magnitude below fp32, so mixed
// precision would make training slower rather than faster; the trainer then says so once,
// with rates measured on this machine.
//
// FSDP_TRAIN_CPU_FLAGS in the environment, when set, replaces the flags of /proc/cpuinfo (so
// that a machine with native bf16 can exercise the other path); the rates are always measured.
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace fsdp {
namespace train {

// The native-bf16 flags (avx512_bf16, amx_bf16) among the whitespace-separated words of
// `cpuinfo`: a whole /proc/cpuinfo or just a flags list. Each flag once, in that order.
std::vector<std::string> native_bf16_flags(const std::string& cpuinfo);

// FSDP_TRAIN_CPU_FLAGS when set, else /proc/cpuinfo ("" when it cannot be read).
std::string cpu_flags_text();

struct MatmulRates {
  double bf16_gflops = 0;
  double fp32_gflops = 0;
};

// Square matmuls in bf16 and in fp32, each for about `seconds_per_dtype` after one warm-up
// call, on the calling thread's intra-op threads. Not collective.
MatmulRates measure_matmul_rates(double seconds_per_dtype = 0.025);

// The line rank 0 prints: with native flags, which ones; without, the measured rates, and when
// bf16 is the slower one a warning of how much slower (and what to do about it).
std::string bf16_support_line(const std::vector<std::string>& native_flags, const std::optional<MatmulRates>& measured);

// The start-up check of a run whose parameters compute in bf16: the flags, and the probe only
// when they show no native support. Returns bf16_support_line's text.
std::string check_bf16_support();

}  // namespace train
}  // namespace fsdp
