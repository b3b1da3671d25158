// test_hardware.cpp — the start-up check of native bf16 (tools/fsdp-train/run/hardware.h): which
// cpuinfo flags count, the line the trainer prints, and the probe's rates on this machine.
#include "run/hardware.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <string>
#include <vector>

using namespace fsdp::train;

namespace {

const std::string kSapphireRapidsFlags =
    "flags\t\t: fpu vme de pse tsc msr pae mce cx8 apic sep mtrr avx2 avx512f avx512dq avx512_bf16 avx512_fp16 "
    "amx_bf16 amx_tile amx_int8\n";
const std::string kCooperLakeFlags = "fpu sse sse2 avx2 avx512f avx512_bf16 avx512_vnni";
const std::string kSkylakeFlags = "fpu sse sse2 avx avx2 fma avx512f avx512dq avx512bw avx512vl avx512_vnni";

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

}  // namespace

TEST(TrainHardware, NativeBf16FlagsAreFoundInCpuinfoOrAFlagsList) {
  const std::string cpuinfo = "processor\t: 0\nmodel name\t: Intel(R) Xeon(R)\n" + kSapphireRapidsFlags +
                              "\nprocessor\t: 1\n" + kSapphireRapidsFlags;
  EXPECT_EQ(native_bf16_flags(cpuinfo), (std::vector<std::string>{"avx512_bf16", "amx_bf16"}));  // once each
  EXPECT_EQ(native_bf16_flags(kCooperLakeFlags), std::vector<std::string>{"avx512_bf16"});
  EXPECT_TRUE(native_bf16_flags(kSkylakeFlags).empty());
  EXPECT_TRUE(native_bf16_flags("").empty());
  // Whole words only: avx512_fp16, a prefix or a longer name is no bf16 support.
  EXPECT_TRUE(native_bf16_flags("avx512_fp16 avx512_bf1 xavx512_bf16 amx_bf16x amx_tile").empty());
}

TEST(TrainHardware, FlagsComeFromTheEnvironmentWhenItSetsThem) {
  ::setenv("FSDP_TRAIN_CPU_FLAGS", kSkylakeFlags.c_str(), 1);
  EXPECT_EQ(cpu_flags_text(), kSkylakeFlags);
  ::unsetenv("FSDP_TRAIN_CPU_FLAGS");
  EXPECT_TRUE(contains(cpu_flags_text(), "processor")) << "expected /proc/cpuinfo";
}

TEST(TrainHardware, TheLineNamesNativeFlagsOrWarnsWithTheMeasuredRates) {
  EXPECT_EQ(bf16_support_line({"avx512_bf16", "amx_bf16"}, std::nullopt),
            "fsdp-train: this CPU has native bf16 (avx512_bf16, amx_bf16)");
  const MatmulRates slow_bf16{4.8, 68.2};
  const std::string warning = bf16_support_line({}, slow_bf16);
  EXPECT_EQ(warning,
            "fsdp-train: warning: this CPU has no native bf16 (no avx512_bf16 or amx_bf16 flag): bf16 matmul 4.8 "
            "GFLOP/s vs fp32 68; mixed precision will be up to ~14x slower: turn it off "
            "(fsdp_config.param_dtype: float32) or train on a CPU with avx512_bf16 or amx_bf16");
  // No flag, yet the probe finds bf16 as fast: no warning, the rates still shown.
  const MatmulRates fast_bf16{512, 70};
  const std::string note = bf16_support_line({}, fast_bf16);
  EXPECT_FALSE(contains(note, "warning")) << note;
  EXPECT_TRUE(contains(note, "bf16 matmul 512 GFLOP/s vs fp32 70; bf16 is not the slower one here")) << note;
}

// The probe runs real matmuls: positive rates, in about the time it is given.
TEST(TrainHardware, TheProbeMeasuresBothDtypesQuickly) {
  const auto start = std::chrono::steady_clock::now();
  const MatmulRates r = measure_matmul_rates(0.02);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_GT(r.bf16_gflops, 0.1);
  EXPECT_GT(r.fp32_gflops, 0.1);
  EXPECT_LT(seconds, 2.0);
  // Without native flags the trainer's line carries the two rates it measured.
  ::setenv("FSDP_TRAIN_CPU_FLAGS", kSkylakeFlags.c_str(), 1);
  const std::string line = check_bf16_support();
  ::unsetenv("FSDP_TRAIN_CPU_FLAGS");
  EXPECT_TRUE(contains(line, "no native bf16")) << line;
  EXPECT_TRUE(contains(line, "GFLOP/s vs fp32")) << line;
}
