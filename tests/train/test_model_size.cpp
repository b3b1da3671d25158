// test_model_size.cpp — the memory estimate that rejects, at configuration time, a model or
// batch the machine cannot hold (tools/fsdp-train/models/model_size.h). No torch.
#include "config/config.h"
#include "models/model_size.h"

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

using namespace fsdp::train;

namespace {

constexpr double kGiB = 1024.0 * 1024 * 1024;

ModelSizes tiny() { return ModelSizes{2, 8, 16, 16, 4}; }  // ModelArgs::preset("tiny")
StepSizes two_ranks() { return StepSizes{2, 2, 4, 1, 16}; }

// The ConfigError's message, or "" when none is thrown.
std::string rejection(const ModelSizes& m, const StepSizes& s, double mem = 16 * kGiB) {
  try {
    check_fits_in_memory(m, s, mem);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

void expect_rejected_naming(const ModelSizes& m, const StepSizes& s, const std::string& key) {
  const std::string msg = rejection(m, s);
  ASSERT_FALSE(msg.empty()) << key;
  EXPECT_EQ(msg.rfind(key + ":", 0), 0u) << msg;  // the key first, as every configuration error
  for (const char* part : {"per rank", "MemTotal", "16 bytes", "Rule:", "LOCAL_WORLD_SIZE"})
    EXPECT_NE(msg.find(part), std::string::npos) << part << " not in: " << msg;
}

}  // namespace

// The formula's counts for the presets (parameters of the whole model). fsdp-train prints the
// count of the model it builds; Trainer.PrintsTheWholeModelsParameterCountWhichTheFormulaGives
// (test_trainer.cpp) checks that it is the formula's.
TEST(ModelSize, ParameterCountsOfThePresets) {
  EXPECT_EQ(transformer_parameters(tiny()), 6976);
  EXPECT_EQ(transformer_parameters({4, 8192, 256, 256, 8}), 7415296);      // small
  EXPECT_EQ(transformer_parameters({8, 32000, 512, 768, 12}), 106225152);  // medium
}

// configs/llama/config.json: the tied head once, GQA's k/v, SwiGLU's three projections; untied
// and with q/k/v biases (Qwen2) the head and the biases are added.
TEST(ModelSize, LlamaParameterCountsAndARejectionNamingTheConfigJsonKey) {
  ModelSizes l{4, 256, 256, 128, 4, true, 352, 2, 32, false, true};
  EXPECT_EQ(llama_parameters(l), 771200);
  ModelSizes qwen = l;
  qwen.tie_word_embeddings = false;
  qwen.attention_bias = true;
  EXPECT_EQ(llama_parameters(qwen), 771200 + 256 * 128 + 4 * (128 + 2 * 64));
  ModelSizes huge = l;
  huge.intermediate_size = 1 << 24;
  const std::string msg = rejection(huge, two_ranks());
  EXPECT_EQ(msg.rfind("intermediate_size (config.json):", 0), 0u) << msg;
  EXPECT_NE(msg.find(" parameters at 16 bytes"), std::string::npos) << msg;
}

TEST(ModelSize, ShippedSizesFitAndTheEstimateIsShardedOverTheWorld) {
  EXPECT_EQ(rejection(tiny(), two_ranks()), "");
  EXPECT_EQ(rejection({8, 32000, 512, 768, 12}, StepSizes{2, 2, 4, 1, 512}, 4 * kGiB), "");  // medium on 4 GiB
  const ModelSizes big{8, 32000, 512, 4096, 32};
  // 16 bytes per parameter over 1 rank, 16 / 8 over 8: no rank builds the whole model (it is
  // built sharded, one block at a time), so nothing stays at 4 bytes per parameter.
  const double p = transformer_parameters(big);
  EXPECT_GE(bytes_per_rank(big, StepSizes{1, 1, 1, 1, 16}), 16 * p);
  EXPECT_GE(bytes_per_rank(big, StepSizes{8, 8, 1, 1, 16}), 16 * p / 8);
  EXPECT_LT(bytes_per_rank(big, StepSizes{8, 8, 1, 1, 16}), 4 * p);
  // NO_SHARD (each parameter over 1 rank) keeps 16 bytes per parameter whatever the world.
  EXPECT_GE(bytes_per_rank(big, StepSizes{8, 8, 1, 1, 16, 1}), 16 * p);
}

TEST(ModelSize, EnormousSizesAreRejectedNamingTheKey) {
  expect_rejected_naming({2, 8, 16, 1000000000, 4}, two_ranks(), "model.dim");
  expect_rejected_naming({2, 1000000000000, 16, 16, 4}, two_ranks(), "model.vocab_size");
  expect_rejected_naming({1000000000, 8, 16, 16, 4}, two_ranks(), "model.n_layers");
  expect_rejected_naming({2, 8, 1000000000000, 16, 4}, two_ranks(), "model.max_seq_len");
  expect_rejected_naming(tiny(), StepSizes{2, 2, 1000000000000, 1, 16}, "training.micro_batch_size");
  expect_rejected_naming({2, 8, 1000000, 16, 4}, StepSizes{2, 2, 4, 1, 1000000}, "training.seq_len");
}

// Products far beyond int64 (dim^2, vocab * dim) are computed in double: no overflow, no
// wrap-around to a small number that would pass.
TEST(ModelSize, ProductsOverflowingInt64AreRejected) {
  const int64_t huge = INT64_MAX / 2;
  expect_rejected_naming({2, 8, 16, huge, 4}, two_ranks(), "model.dim");  // dim^2 overflows
  expect_rejected_naming({2, huge, 16, 4, 4}, two_ranks(), "model.vocab_size");
  EXPECT_TRUE(std::isfinite(bytes_per_rank({huge, huge, huge, huge, huge}, StepSizes{huge, huge, huge, huge, huge})));
  // Unknown machine memory: still rejected beyond 2^63 bytes.
  EXPECT_NE(rejection({2, huge, 16, huge, 4}, two_ranks(), 0), "");
  EXPECT_EQ(rejection({2, 1000000, 16, 1024, 4}, two_ranks(), 0), "");
}

TEST(ModelSize, RanksOnOneMachineShareItsMemory) {
  const ModelSizes m{8, 32000, 512, 768, 12};
  const StepSizes one{8, 1, 4, 1, 512}, eight{8, 8, 4, 1, 512};
  const double per_rank = bytes_per_rank(m, one);
  EXPECT_EQ(rejection(m, one, 2 * per_rank), "");
  const std::string msg = rejection(m, eight, 2 * per_rank);
  EXPECT_NE(msg.find("8 rank(s) on this machine"), std::string::npos) << msg;
}

TEST(ModelSize, MachineMemoryIsRead) { EXPECT_GT(machine_memory_bytes(), 0); }
