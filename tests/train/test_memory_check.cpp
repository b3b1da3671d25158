// test_memory_check.cpp — the start-up memory check (tools/fsdp-train/models/memory_check.h),
// asked of the planner: a model or batch the machine cannot hold is refused at configuration
// time, naming the key to lower; a run that fits is not. And the parameter counts of the
// planner's specs, which the check and `fsdp-train plan` print.
#include "config/config.h"
#include "models/memory_check.h"
#include "models/model_setup.h"
#include "models/plan_question.h"
#include "models/registry.h"

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

using namespace fsdp::train;

namespace {

constexpr double kGiB = 1024.0 * 1024 * 1024;

struct Checked {
  TrainConfig cfg;
  std::unique_ptr<const ModelFamily> family;
  int64_t seq = 0;
};

Checked checked(const std::vector<std::string>& overrides) {
  Checked c{load_config("", overrides), nullptr, 0};
  c.family = choose_family(c.cfg);
  c.seq = seq_len_of(c.cfg, *c.family);
  return c;
}

// The ConfigError's message, or "" when none is thrown.
std::string rejection(const std::vector<std::string>& overrides, double mem = 16 * kGiB, int world = 2,
                      int local_world = 2) {
  try {
    const Checked c = checked(overrides);
    check_fits_in_memory(c.cfg, *c.family, c.seq, world, local_world, mem);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

void expect_rejected_naming(const std::vector<std::string>& overrides, const std::string& key) {
  const std::string msg = rejection(overrides);
  ASSERT_FALSE(msg.empty()) << key;
  EXPECT_EQ(msg.rfind(key + ":", 0), 0u) << msg;  // the key first, as every configuration error
  for (const char* part : {"per rank", "MemTotal", "Most of it is", "Rule:", "LOCAL_WORLD_SIZE", "fsdp-train plan"})
    EXPECT_NE(msg.find(part), std::string::npos) << part << " not in: " << msg;
}

int64_t parameters(const std::vector<std::string>& overrides) {
  const Checked c = checked(overrides);
  return parameter_count(*c.family, plan_question(c.cfg, *c.family, c.seq, 2, 2, /*strict=*/false));
}

std::string shipped_llama() { return std::string(FSDP_TRAIN_CONFIGS_DIR) + "/llama/config.json"; }

}  // namespace

// The counts of the presets (the whole model): 2 V D + S D + L (12 D^2 + 9 D) + 2 D, which the
// trainer's first line prints too (Trainer.PrintsTheWholeModelsParameterCountWhichTheFormulaGives).
TEST(MemoryCheck, ParameterCountsOfThePresets) {
  EXPECT_EQ(parameters({}), 6976);
  EXPECT_EQ(parameters({"--model.preset=small"}), 7415296);
  EXPECT_EQ(parameters({"--model.preset=medium"}), 106225152);
}

// configs/llama/config.json: the tied head once, GQA's k/v, SwiGLU's three projections. Its
// SwiGLU made too wide for any machine is refused naming the config.json key.
TEST(MemoryCheck, LlamaParameterCountAndARejectionNamingTheConfigJsonKey) {
  EXPECT_EQ(parameters({"--model.architecture=llama", "--model.hf_config=" + shipped_llama()}), 771200);
}

TEST(MemoryCheck, ShippedSizesFitAndTheEstimateIsShardedOverTheWorld) {
  EXPECT_EQ(rejection({}), "");
  EXPECT_EQ(rejection({"--model.preset=medium", "--training.seq_len=512"}), "");  // 3.6 GiB per rank
  EXPECT_EQ(rejection({"--model.architecture=llama", "--model.hf_config=" + shipped_llama()}), "");
  // A model of 1 GiB of fp32 parameters needs 16 GiB of state over one rank, 2 over eight.
  const std::vector<std::string> big = {
      "--model.n_layers=8", "--model.vocab_size=32000", "--model.max_seq_len=512",      "--model.dim=3072",
      "--model.n_heads=32", "--training.seq_len=16",    "--training.micro_batch_size=1"};
  EXPECT_NE(rejection(big, 8 * kGiB, 1, 1), "");
  EXPECT_EQ(rejection(big, 8 * kGiB, 8, 1), "");
  // NO_SHARD keeps every parameter's state on every rank, whatever the world.
  std::vector<std::string> no_shard = big;
  no_shard.push_back("--fsdp_config.sharding_strategy=NO_SHARD");
  EXPECT_NE(rejection(no_shard, 8 * kGiB, 8, 1), "");
}

TEST(MemoryCheck, EnormousSizesAreRejectedNamingTheKey) {
  expect_rejected_naming({"--model.dim=1000000000"}, "model.dim");
  expect_rejected_naming({"--model.vocab_size=1000000000000"}, "model.vocab_size");
  expect_rejected_naming({"--model.n_layers=1000000000"}, "model.n_layers");
  expect_rejected_naming({"--model.max_seq_len=1000000000000", "--training.seq_len=16"}, "model.max_seq_len");
  expect_rejected_naming({"--training.micro_batch_size=1000000000000"}, "training.micro_batch_size");
  expect_rejected_naming({"--model.max_seq_len=1000000", "--training.seq_len=1000000"}, "training.seq_len");
  expect_rejected_naming(
      {"--model.architecture=llama", "--model.hf_config=" + shipped_llama(), "--training.micro_batch_size=100000000"},
      "training.micro_batch_size");
}

// Products far beyond int64 (dim^2, vocab * dim) are never computed in int64: no overflow, no
// wrap-around to a small number that would pass.
TEST(MemoryCheck, ProductsOverflowingInt64AreRejected) {
  expect_rejected_naming({"--model.dim=4611686018427387904"}, "model.dim");
  expect_rejected_naming({"--model.vocab_size=4611686018427387904", "--model.dim=64"}, "model.vocab_size");
  // Unknown machine memory: still rejected beyond what the planner models.
  EXPECT_NE(rejection({"--model.vocab_size=4611686018427387904"}, 0), "");
  EXPECT_EQ(rejection({"--model.vocab_size=1000000", "--model.dim=1024"}, 0), "");
}

TEST(MemoryCheck, RanksOnOneMachineShareItsMemory) {
  const std::vector<std::string> medium = {"--model.preset=medium", "--training.seq_len=512"};
  // What one rank needs, from the message of a machine far too small for it.
  const std::string msg = rejection(medium, 1024, 8, 1);
  ASSERT_FALSE(msg.empty());
  const std::string needle = "this run needs at least ";
  const size_t at = msg.find(needle) + needle.size();
  const double per_rank = std::stod(msg.substr(at)) * (msg.find("MiB", at) < msg.find("GiB", at) ? 1 << 20 : kGiB);
  EXPECT_EQ(rejection(medium, 2.2 * per_rank, 8, 1), "");
  const std::string shared = rejection(medium, 2.2 * per_rank, 8, 8);
  EXPECT_NE(shared.find("8 rank(s) on this machine"), std::string::npos) << shared;
}

TEST(MemoryCheck, MachineMemoryIsRead) { EXPECT_GT(machine_memory_bytes(), 0); }
